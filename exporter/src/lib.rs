//! poolscope: a Prometheus exporter for queue depth, thread pools and request timing
//! of every network service on a Linux host, from eBPF. `run` wires the pieces:
//! config → kernel programs → discovery → HTTP (plain or TLS and basic auth, per
//! `--web.config.file`), plus signals (SIGHUP reloads both configurations,
//! SIGTERM/SIGINT stop and detach every probe).
pub mod clock;
pub mod collectors;
pub mod config;
pub mod discovery;
pub mod encode;
pub mod exporter;
pub mod hpack;
pub mod idmap;
pub mod kernel;
pub mod logging;
pub mod metrics;
pub mod revision;
pub mod scrape_counts;
pub mod signals;
pub mod stacks;
pub mod web;

use std::{sync::Arc, time::Duration};

use anyhow::Context as _;
use poolscope_shared::ProcessEvent;
use tokio::{io::unix::AsyncFd, sync::Notify};

use crate::{
    config::{Overrides, Settings},
    discovery::procfs,
    exporter::Exporter,
    kernel::{Kernel, ProbeState, ProcessEvents, Sampling, WatchTable as _, caps},
    logging::LogHandle,
    metrics::pools,
    stacks::{heap, snapshots::Trigger},
    web::{listener, server, webconfig},
};

/// How often to look for process events that did not wake us (execs).
const EVENT_POLL_INTERVAL: Duration = Duration::from_millis(200);

/// Stack counts are drained at least this often, so that their kernel maps hold a
/// few seconds of stacks rather than a whole snapshot interval.
const MAX_STACK_DRAIN_INTERVAL: Duration = Duration::from_secs(10);

/// After an exec-triggered rescan, wait at least this long before the next one.
const MIN_TRIGGERED_RESCAN_GAP: Duration = Duration::from_secs(1);

/// The request backends to try, in order: with `auto`, the socket one where this
/// kernel has its tracepoints (6.3), else the tcp one (older kernels with BTF), else
/// the syscall one, each passed over with the reason in the log; the first that
/// attaches whole is used (`Kernel::load`). A forced backend the kernel lacks is
/// refused rather than replaced: its numbers would mean something else than the
/// operator asked for.
fn backend_candidates(wanted: config::Backend) -> anyhow::Result<Vec<kernel::Backend>> {
    use kernel::Backend::{Socket, Syscall, Tcp};
    let lacks = |backend: kernel::Backend| {
        let missing = backend.missing_tracepoints();
        (!missing.is_empty()).then(|| missing.join(", "))
    };
    let forced = |backend: kernel::Backend, needs: &str| match lacks(backend) {
        None => Ok(vec![backend]),
        Some(missing) => anyhow::bail!(
            "probes.backend = \"{}\" needs {needs}; this kernel lacks {missing}: use \"auto\"",
            backend.name()
        ),
    };
    match wanted {
        config::Backend::Auto => {
            let mut candidates = Vec::new();
            for (backend, kernels) in [(Socket, "6.3"), (Tcp, "5.11 with BTF")] {
                match lacks(backend) {
                    None => candidates.push(backend),
                    Some(missing) => tracing::info!(
                        %missing,
                        "this kernel lacks the {} backend's tracepoints (kernel >= {kernels})",
                        backend.name()
                    ),
                }
            }
            candidates.push(Syscall);
            Ok(candidates)
        }
        config::Backend::Socket => forced(
            Socket,
            "the sock:sock_recv_length, sock_send_length, sk_data_ready and \
             inet_sock_set_state tracepoints (kernel >= 6.3)",
        ),
        config::Backend::Tcp => forced(
            Tcp,
            "the tcp:tcp_probe, tcp_rcv_space_adjust, net:net_dev_queue and \
             sock:inet_sock_set_state tracepoints in the kernel's BTF (kernel >= 5.11)",
        ),
        config::Backend::Syscall => Ok(vec![Syscall]),
    }
}

/// Runs the exporter until SIGTERM or SIGINT. Loads the kernel programs and drops the
/// capabilities it no longer needs on the calling thread, alone, before any other
/// thread starts: capabilities are per thread, and later threads inherit these.
pub fn run(overrides: Overrides) -> anyhow::Result<()> {
    // First, before any thread starts: every thread inherits the mask.
    signals::block().context("blocking the signals poolscope handles")?;
    let settings = Settings::load(&overrides)?;
    let log = logging::init(settings.log_level, settings.log_format);
    heap::set_up();
    match procfs::check_host_pid_namespace(&settings.procfs_root) {
        Ok(()) => {}
        Err(error @ procfs::PidNamespaceError::Unreadable { .. }) => {
            tracing::warn!(%error, "pids may not match the kernel's");
        }
        Err(error) => return Err(error.into()),
    }
    let web_config = Arc::new(webconfig::WebState::load(
        overrides.web_config_file.as_deref(),
    )?);

    let sampling = Sampling {
        hz: settings.snapshots.sampling_hz,
        offcpu_min: settings.snapshots.offcpu_min,
        offcpu_idle: settings.snapshots.offcpu_idle,
        offcpu_full_rate: settings.snapshots.offcpu_full_rate,
        offcpu_sample_one_in: settings.snapshots.offcpu_sample_one_in,
    };
    let candidates = backend_candidates(settings.backend)?;
    let (kernel, events) = Kernel::load(
        settings.limits,
        &candidates,
        sampling,
        settings.bpf_stats,
        kernel::Reads {
            response_status: settings.response_status,
            routes: settings.any_routes_read(),
            routes_by_default: settings.routes,
        },
    )?;
    let backend = kernel.backend();
    if backend == kernel::Backend::Syscall {
        tracing::warn!(
            "syscall backend: every system call of every process on this node runs one \
             of poolscope's programs (~100-150 ns each; a syscall-bound process slows \
             down), and keep-alive requests show no queue time; the socket backend \
             (kernel >= 6.3) and the tcp backend (kernel >= 5.11 with BTF) cost per socket \
             event instead"
        );
    }
    let probes = kernel.probes();
    let count =
        |wanted: fn(&ProbeState) -> bool| probes.iter().filter(|p| wanted(&p.state)).count();
    tracing::info!(
        kernel = %kernel::release(),
        backend = backend.name(),
        attached = count(|state| *state == ProbeState::Attached),
        on_demand = count(|state| *state == ProbeState::OnDemand),
        skipped = count(|state| matches!(state, ProbeState::Skipped(_))),
        "kernel probes loaded (each skipped one is logged above with its reason)"
    );

    let listeners = settings
        .listen_addresses
        .iter()
        .map(|&address| {
            let listener = bind(address).with_context(|| format!("cannot listen on {address}"))?;
            listener.set_nonblocking(true)?;
            Ok(listener)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    match caps::drop_unneeded(!settings.lock_uprobes.is_empty()) {
        Ok((before, after)) if before != after => tracing::info!(
            kept = %caps::Names(after.permitted),
            dropped = %caps::Names(before.permitted & !after.permitted),
            "capabilities dropped after loading"
        ),
        Ok(_) => tracing::debug!("no capability to drop"),
        Err(error) => tracing::warn!(%error, "cannot drop capabilities; running with them"),
    }
    kernel.start_route_drain()?;
    // One async worker unless TOKIO_WORKER_THREADS says otherwise: the async side
    // moves bytes, waits, and does TLS (what takes the core lock or milliseconds of
    // CPU runs on the blocking pool). A second worker (tokio's default is one per
    // CPU) was woken to look for work at each hand-off of a scrape, and at 110 idle
    // services cost ~0.4 ms of run-queue wait and up to ~0.6 ms of CPU per scrape on
    // two CPUs. Many TLS handshakes at once take turns on the one worker.
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
        runtime.worker_threads(1);
    }
    runtime
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(serve(
            settings, kernel, events, listeners, web_config, overrides, log,
        ))
}

/// Watches, follows and serves until SIGTERM or SIGINT.
async fn serve(
    settings: Settings,
    kernel: Kernel,
    events: ProcessEvents,
    listeners: Vec<std::net::TcpListener>,
    web_config: Arc<webconfig::WebState>,
    overrides: Overrides,
    log: LogHandle,
) -> anyhow::Result<()> {
    let listeners = listeners
        .into_iter()
        .map(tokio::net::TcpListener::from_std)
        .collect::<Result<Vec<_>, _>>()?;
    let (scrapes, debug_access) = (settings.scrapes, settings.debug_endpoints);
    let telemetry_path = settings.telemetry_path.clone();
    let exporter = Arc::new(Exporter::new(kernel, settings));
    if let Err(error) = exporter.rescan() {
        tracing::warn!(%error, "initial scan failed");
    }

    let rescan_now = exporter.rescan_trigger();
    tokio::spawn(rescan_loop(exporter.clone(), rescan_now.clone()));
    tokio::spawn(event_loop(exporter.clone(), events));
    tokio::spawn(pool_sample_loop(exporter.clone()));
    tokio::spawn(stack_loop(exporter.clone()));

    let (shutdown_tx, shutdown_rx) = tokio::sync::oneshot::channel::<()>();
    spawn_signal_thread(
        exporter.clone(),
        overrides,
        log,
        web_config.clone(),
        rescan_now,
        shutdown_tx,
    )?;

    let addresses = listeners
        .iter()
        .map(|listener| listener.local_addr().map(|address| address.to_string()))
        .collect::<Result<Vec<_>, _>>()?;
    tracing::info!(
        address = addresses.join(","),
        path = %telemetry_path,
        web = web_config.current().summary(),
        "serving /metrics"
    );
    let gate = Arc::new(server::ScrapeGate::new(scrapes));
    let routes = server::Routes {
        telemetry_path,
        debug: debug_access,
    };
    let app = server::app(exporter.clone(), gate.clone(), routes).layer(
        axum::middleware::from_fn_with_state(web_config.clone(), webconfig::authorize),
    );
    // The no-op tap makes axum give handlers the client's address (listener.rs).
    let listener = axum::serve::ListenerExt::tap_io(
        listener::Listener::spawn(listeners, web_config, gate, listener::HANDSHAKE_TIMEOUT)?,
        |_| {},
    );
    axum::serve(
        listener,
        app.into_make_service_with_connect_info::<std::net::SocketAddr>(),
    )
    .with_graceful_shutdown(async {
        let _ = shutdown_rx.await;
    })
    .await
    .context("HTTP server")?;

    // Dropping the last reference to the kernel programs detaches every probe.
    let probes = exporter.probe_count();
    drop(exporter);
    tracing::info!(probes, "stopped; probes detached");
    Ok(())
}

/// Samples pool totals and finished requests for the utilization and capacity window,
/// the services' CPU limits when due, queue depths for the saturation snapshots, the
/// gauges' recount when due, and the loss counters for the health.
async fn pool_sample_loop(exporter: Arc<Exporter>) {
    let mut ticks = tokio::time::interval(pools::SAMPLE_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let worker = exporter.clone();
        let sampled = tokio::task::spawn_blocking(move || {
            let counters = worker.sample_pools();
            worker.refresh_cpu_limits();
            if let Some(counters) = counters {
                worker.check_saturation(&counters);
                worker.recount_gauges(&counters);
            }
            worker.check_health();
        });
        if let Err(error) = sampled.await {
            tracing::error!(%error, "pool sampling panicked");
        }
    }
}

/// Drains the kernel's stack counts every few seconds and takes a snapshot every
/// `[stacks] interval` (both symbolize: blocking work, off the async workers).
async fn stack_loop(exporter: Arc<Exporter>) {
    let mut next_snapshot = tokio::time::Instant::now() + exporter.settings().snapshots.interval;
    loop {
        let interval = exporter.settings().snapshots.interval;
        let next_drain = tokio::time::Instant::now() + interval.min(MAX_STACK_DRAIN_INTERVAL);
        tokio::time::sleep_until(next_drain.min(next_snapshot)).await;
        let now = tokio::time::Instant::now();
        let snapshot = now >= next_snapshot;
        if snapshot {
            // A late tick (a slow symbolization) moves the schedule rather than
            // taking snapshots back to back.
            next_snapshot = (next_snapshot + interval).max(now + interval / 2);
        }
        let worker = exporter.clone();
        let work = tokio::task::spawn_blocking(move || {
            if snapshot {
                worker.take_snapshot(Trigger::Interval);
            } else {
                worker.drain_stacks();
            }
            heap::release_freed();
        });
        if let Err(error) = work.await {
            tracing::error!(%error, "stack snapshot panicked");
        }
    }
}

async fn rescan_loop(exporter: Arc<Exporter>, trigger: Arc<Notify>) {
    loop {
        let interval = exporter.settings().rescan_interval;
        let triggered = tokio::select! {
            () = tokio::time::sleep(interval) => false,
            () = trigger.notified() => true,
        };
        let worker = exporter.clone();
        match tokio::task::spawn_blocking(move || worker.rescan()).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(%error, "rescan failed"),
            Err(error) => tracing::error!(%error, "rescan panicked"),
        }
        if triggered {
            tokio::time::sleep(MIN_TRIGGERED_RESCAN_GAP).await;
        }
    }
}

async fn event_loop(exporter: Arc<Exporter>, events: ProcessEvents) {
    // SAFETY: the ring buffer owns its map fd for as long as the AsyncFd holds it.
    let registered =
        unsafe { AsyncFd::register_with_interest(events.ring, tokio::io::Interest::READABLE) };
    let mut ring = match registered {
        Ok(ring) => ring,
        Err(error) => {
            let error = error.into_parts().1;
            tracing::error!(%error, "cannot poll process events; relying on rescans");
            return;
        }
    };
    loop {
        // Exec events do not wake us (see the kernel side): poll for them too.
        let readable = tokio::time::timeout(EVENT_POLL_INTERVAL, ring.readable_mut()).await;
        let mut batch = Vec::new();
        match readable {
            Ok(Ok(mut guard)) => {
                drain(guard.get_inner_mut(), &mut batch);
                guard.clear_ready();
            }
            Ok(Err(error)) => {
                tracing::error!(%error, "polling process events failed; relying on rescans");
                return;
            }
            Err(_elapsed) => drain(ring.get_mut(), &mut batch),
        }
        if !batch.is_empty() {
            // Off the async worker: applying events takes the core lock, which a
            // scrape's read holds for milliseconds, and reads procfs for execs.
            let worker = exporter.clone();
            if let Err(error) = tokio::task::spawn_blocking(move || worker.on_events(&batch)).await
            {
                tracing::error!(%error, "applying process events panicked");
            }
        }
    }
}

fn drain(ring: &mut aya::maps::RingBuf<aya::maps::MapData>, batch: &mut Vec<ProcessEvent>) {
    while let Some(record) = ring.next() {
        if let Some(event) = ProcessEvents::decode(&record) {
            batch.push(event);
        }
    }
}

fn spawn_signal_thread(
    exporter: Arc<Exporter>,
    overrides: Overrides,
    log: LogHandle,
    web_config: Arc<webconfig::WebState>,
    rescan_now: Arc<Notify>,
    shutdown: tokio::sync::oneshot::Sender<()>,
) -> anyhow::Result<()> {
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            loop {
                let signal = match signals::wait() {
                    Ok(signal) => signal,
                    Err(error) => {
                        tracing::error!(%error, "cannot wait for signals; stopping");
                        libc::SIGTERM
                    }
                };
                if signal != libc::SIGHUP {
                    tracing::info!(signal, "shutting down");
                    exporter.stop();
                    let _ = shutdown.send(());
                    return;
                }
                let config_loaded = reload(&exporter, &overrides, &log);
                let web_config_loaded = web_config.reload();
                exporter.reload_finished(config_loaded && web_config_loaded);
                rescan_now.notify_one();
            }
        })
        .context("starting the signal thread")?;
    Ok(())
}

/// Whether the configuration was loaded (a refused one keeps the running one).
fn reload(exporter: &Exporter, overrides: &Overrides, log: &LogHandle) -> bool {
    match Settings::load(overrides) {
        Ok(settings) => {
            let current = exporter.settings();
            for key in settings.restart_changes(&current) {
                tracing::warn!(key, "changed in the configuration; takes effect on restart");
            }
            if let Err(error) = log.modify(|level| *level = settings.log_level) {
                tracing::warn!(%error, "cannot change the log level");
            }
            tracing::info!(targets = settings.targets.len(), "configuration reloaded");
            exporter.replace_settings(settings);
            true
        }
        Err(error) => {
            tracing::error!(%error, "reload refused; keeping the running configuration");
            false
        }
    }
}

/// Binds the metrics listener. `:port` asked for the IPv6 wildcard; on a host without
/// IPv6 that fails, and the IPv4 one serves every address there is.
fn bind(address: std::net::SocketAddr) -> std::io::Result<std::net::TcpListener> {
    match std::net::TcpListener::bind(address) {
        Err(error)
            if address.ip() == std::net::IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
                && error.raw_os_error() == Some(libc::EAFNOSUPPORT) =>
        {
            std::net::TcpListener::bind((std::net::Ipv4Addr::UNSPECIFIED, address.port()))
        }
        other => other,
    }
}
