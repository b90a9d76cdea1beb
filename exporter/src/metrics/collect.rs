//! Reducers from what was read at scrape time (kernel counters, the watched set, the
//! listen queues) to metric families. Pure functions: names, labels and units are
//! decided here and nowhere else.
use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
};

use poolscope_shared::{
    DownstreamKey, DownstreamWait, LockPrimitive, Peer, RequestTimes, ServiceCounters,
};

use crate::{
    discovery::sockdiag::ListenQueue,
    discovery::targets::{Corrections, ServiceView},
    kernel::{Backend, Probe, ProbeState, Readout},
    metrics::encode::{Family, Kind, Value},
    metrics::health::{Loss, LossKind},
    metrics::pools::{COMPONENTS, PoolTotals, REASONS, STATES, sum_of},
    metrics::window::{QUANTILES, coarse_buckets, quantile},
};

/// A listening socket that belongs to a watched service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceListener {
    pub service: String,
    pub queue: ListenQueue,
}

/// What the kernel read gives for one service, with the window deltas.
pub struct ServiceInput<'a> {
    pub view: &'a ServiceView,
    pub counters: &'a ServiceCounters,
    /// Cumulative request times since the service id was assigned.
    pub times: &'a RequestTimes,
    /// Request times over the quantile window.
    pub window: &'a RequestTimes,
    /// Request time by what the serving thread did, ns per [`COMPONENTS`] entry.
    pub components: [u64; COMPONENTS.len()],
}

/// One pool at scrape time.
pub struct PoolInput<'a> {
    pub service: &'a str,
    pub pool: &'a str,
    pub totals: &'a PoolTotals,
    /// Busy share over the utilization window; `None` before there is a window.
    pub utilization: Option<f64>,
}

/// The three request gauges of a service; see DESIGN §3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gauges {
    /// Connected, no request byte read (in the kernel's map: accepted, or for the
    /// socket backend handshake done, which includes the listen backlog).
    pub unserved: u64,
    pub waiting: u64,
    pub in_flight: u64,
}

pub fn gauges(counters: &ServiceCounters, corrections: &Corrections) -> Gauges {
    let open =
        |entered: u64, left: u64, purged: u64| entered.saturating_sub(left).saturating_sub(purged);
    Gauges {
        unserved: open(
            counters.unserved_entered + corrections.adopted_unserved,
            counters.unserved_left,
            corrections.unserved,
        ),
        waiting: open(
            counters.waiting_entered,
            counters.waiting_left,
            corrections.waiting,
        ),
        in_flight: open(
            counters.serving_entered,
            counters.serving_left,
            corrections.serving,
        ),
    }
}

/// (connections_unserved, queue_depth) from the gauges and the listen backlog.
pub fn queue_depth(backend: Backend, gauges: &Gauges, backlog: u64) -> (u64, u64) {
    match backend {
        // The kernel's count starts at the handshake, so it holds the backlog too.
        Backend::Socket => {
            let connected = gauges.unserved.max(backlog);
            (connected - backlog, connected + gauges.waiting)
        }
        Backend::Syscall => (gauges.unserved, backlog + gauges.unserved + gauges.waiting),
    }
}

/// Each service's listen backlog: the depths of its listeners, summed.
fn backlogs(listeners: &[ServiceListener]) -> HashMap<&str, u64> {
    let mut backlog_of: HashMap<&str, u64> = HashMap::new();
    for listener in listeners {
        *backlog_of.entry(listener.service.as_str()).or_default() +=
            u64::from(listener.queue.depth);
    }
    backlog_of
}

/// Each service's `queue_depth`, without the rest of a scrape.
pub fn queue_depths(
    backend: Backend,
    services: &[(&ServiceView, ServiceCounters)],
    listeners: &[ServiceListener],
) -> Vec<(String, u64)> {
    let backlog_of = backlogs(listeners);
    services
        .iter()
        .map(|(view, counters)| {
            let backlog = backlog_of.get(view.name.as_str()).copied().unwrap_or(0);
            let (_, depth) = queue_depth(backend, &gauges(counters, &view.corrections), backlog);
            (view.name.clone(), depth)
        })
        .collect()
}

struct RequestFamilies {
    histograms: [Family; 3],
    windows: [Family; 3],
}

impl RequestFamilies {
    fn new() -> Self {
        Self {
            histograms: [
                Family::new(
                    "request_queue_seconds",
                    Kind::Histogram,
                    "Queue time of finished requests: first read minus arrival.",
                ),
                Family::new(
                    "request_duration_seconds",
                    Kind::Histogram,
                    "Service time of finished requests: last write minus first read.",
                ),
                Family::new(
                    "request_latency_seconds",
                    Kind::Histogram,
                    "Latency of finished requests: last write minus arrival.",
                ),
            ],
            windows: [
                Family::new(
                    "request_queue_window_seconds",
                    Kind::Summary,
                    "Queue time quantiles over the last window (60 s), per instance.",
                ),
                Family::new(
                    "request_duration_window_seconds",
                    Kind::Summary,
                    "Service time quantiles over the last window (60 s), per instance.",
                ),
                Family::new(
                    "request_latency_window_seconds",
                    Kind::Summary,
                    "Latency quantiles over the last window (60 s), per instance.",
                ),
            ],
        }
    }

    fn push(
        &mut self,
        labels: &[(&'static str, &str)],
        times: &RequestTimes,
        window: &RequestTimes,
    ) {
        let cumulative = [&times.queue, &times.duration, &times.latency];
        for (family, histogram) in self.histograms.iter_mut().zip(cumulative) {
            family.push_value(
                labels,
                Value::Histogram {
                    buckets: coarse_buckets(histogram),
                    sum: histogram.sum_ns as f64 / 1e9,
                    count: histogram.count(),
                },
            );
        }
        // Quantiles over the window; `_sum` and `_count` are counters to Prometheus,
        // so they stay cumulative (a window's would go down).
        let windowed = [&window.queue, &window.duration, &window.latency];
        for ((family, histogram), total) in self.windows.iter_mut().zip(windowed).zip(cumulative) {
            let quantiles = QUANTILES
                .iter()
                .map(|&q| (q, quantile(histogram, q).unwrap_or(f64::NAN)))
                .collect();
            family.push_value(
                labels,
                Value::Summary {
                    quantiles,
                    sum: total.sum_ns as f64 / 1e9,
                    count: total.count(),
                },
            );
        }
    }
}

/// Per-service families (the ones the series cap applies to).
pub fn service_families(
    backend: Backend,
    services: &[ServiceInput<'_>],
    syscalls: &BTreeMap<(u32, &'static str), u64>,
    listeners: &[ServiceListener],
) -> Vec<Family> {
    let mut targets = Family::new("targets", Kind::Gauge, "Processes watched for the service.");
    let mut accepted = Family::new(
        "connections_accepted",
        Kind::Counter,
        "Connections the service accepted (syscall backend: accept/accept4 returned a \
         socket; socket backend: the handshake to one of its ports completed).",
    );
    let mut unserved = Family::new(
        "connections_unserved",
        Kind::Gauge,
        "Connections the service accepted and has not read a request byte from yet.",
    );
    let mut waiting = Family::new(
        "requests_waiting",
        Kind::Gauge,
        "Requests whose bytes arrived on an open connection and were not read yet.",
    );
    let mut in_flight = Family::new(
        "requests_in_flight",
        Kind::Gauge,
        "Requests read (at least in part) and not answered yet.",
    );
    let mut depth = Family::new(
        "queue_depth",
        Kind::Gauge,
        "Listen backlog + connections_unserved + requests_waiting: the autoscaling signal.",
    );
    let mut requests = Family::new(
        "requests",
        Kind::Counter,
        "Finished requests (a read burst, then a write burst, ended by the next read or close).",
    );
    let mut time = Family::new(
        "request_time_seconds",
        Kind::Counter,
        "Where the time of finished requests went, by component.",
    );
    let mut request_families = RequestFamilies::new();
    let mut syscall_family = Family::new(
        "syscalls",
        Kind::Counter,
        "Calls of the socket syscalls poolscope correlates, by the service's threads.",
    );
    let backlog_of = backlogs(listeners);
    for input in services {
        let service = input.view;
        let labels = [("service", service.name.as_str())];
        targets.push(&labels, service.processes as f64);
        let counters = input.counters;
        accepted.push(&labels, counters.accepted as f64);
        let gauges = gauges(counters, &service.corrections);
        let backlog = backlog_of.get(service.name.as_str()).copied().unwrap_or(0);
        let (unserved_now, depth_now) = queue_depth(backend, &gauges, backlog);
        unserved.push(&labels, unserved_now as f64);
        waiting.push(&labels, gauges.waiting as f64);
        in_flight.push(&labels, gauges.in_flight as f64);
        depth.push(&labels, depth_now as f64);
        requests.push(&labels, input.times.duration.count() as f64);
        time.push(
            &[("service", service.name.as_str()), ("component", "queue")],
            input.times.queue.sum_ns as f64 / 1e9,
        );
        for ((component, _), ns) in COMPONENTS.iter().zip(input.components) {
            time.push(
                &[("service", service.name.as_str()), ("component", component)],
                ns as f64 / 1e9,
            );
        }
        request_families.push(&labels, input.times, input.window);
        for ((id, syscall), calls) in syscalls.range((service.id, "")..) {
            if *id != service.id {
                break;
            }
            syscall_family.push(
                &[("service", &service.name), ("syscall", syscall)],
                *calls as f64,
            );
        }
    }

    let mut listen_depth = Family::new(
        "listen_queue_depth",
        Kind::Gauge,
        "Connections completed by the kernel and waiting in the listen backlog for accept().",
    );
    let mut limit = Family::new(
        "listen_queue_limit",
        Kind::Gauge,
        "Size of the listen backlog (listen() argument capped by net.core.somaxconn).",
    );
    for listener in listeners {
        let address = listener.queue.addr.to_string();
        let labels = [
            ("service", listener.service.as_str()),
            ("listener", address.as_str()),
        ];
        listen_depth.push(&labels, listener.queue.depth.into());
        if let Some(size) = listener.queue.limit {
            limit.push(&labels, size.into());
        }
    }
    // Gauges and counters first: when the series cap bites, histograms go before them.
    let mut families = vec![
        depth,
        in_flight,
        waiting,
        unserved,
        requests,
        accepted,
        targets,
        listen_depth,
        limit,
        time,
        syscall_family,
    ];
    families.extend(request_families.windows);
    families.extend(request_families.histograms);
    families
}

/// Per-pool families (DESIGN §4).
pub fn pool_families(pools: &[PoolInput<'_>]) -> Vec<Family> {
    let mut threads = Family::new(
        "pool_threads",
        Kind::Gauge,
        "Threads alive in the pool (same normalized thread name within a service).",
    );
    let mut busy = Family::new(
        "pool_threads_busy",
        Kind::Gauge,
        "Threads of the pool busy now: running, runnable, or blocked on a lock or I/O \
         (everything but waiting for work).",
    );
    let mut utilization = Family::new(
        "pool_utilization_ratio",
        Kind::Gauge,
        "Busy thread-seconds over thread-seconds of the pool, over the utilization window \
         (pools.utilization_window). For a one-thread event loop: the share of time not \
         waiting in epoll.",
    );
    let mut state_seconds = Family::new(
        "thread_seconds",
        Kind::Counter,
        "Thread time of the pool by state.",
    );
    let mut offcpu = Family::new(
        "offcpu_seconds",
        Kind::Counter,
        "Time the pool's threads spent blocked, by what they waited for.",
    );
    let mut runqueue = Family::new(
        "runqueue_wait_seconds",
        Kind::Histogram,
        "Run-queue waits of the pool's threads: woken or preempted until back on a CPU.",
    );
    let mut lock_waits = Family::new(
        "lock_wait_seconds",
        Kind::Histogram,
        "Lock waits of the pool's threads while serving. futex: blocked in a futex wait \
         until back on CPU; pthread_mutex (opt-in probes.lock_uprobes): time inside \
         pthread_mutex_lock, contended or not.",
    );
    for input in pools {
        let labels = [("service", input.service), ("pool", input.pool)];
        let totals = input.totals;
        threads.push(&labels, totals.threads as f64);
        busy.push(&labels, totals.threads_busy as f64);
        if let Some(ratio) = input.utilization {
            utilization.push(&labels, ratio);
        }
        for (state, activities) in STATES {
            state_seconds.push(
                &[
                    ("service", input.service),
                    ("pool", input.pool),
                    ("state", state),
                ],
                sum_of(&totals.time_ns, activities) as f64 / 1e9,
            );
        }
        for (reason, activity) in REASONS {
            offcpu.push(
                &[
                    ("service", input.service),
                    ("pool", input.pool),
                    ("reason", reason),
                ],
                totals.time_ns[activity as usize] as f64 / 1e9,
            );
        }
        runqueue.push_value(
            &labels,
            Value::Histogram {
                buckets: coarse_buckets(&totals.runqueue),
                sum: totals.runqueue.sum_ns as f64 / 1e9,
                count: totals.runqueue.count(),
            },
        );
        for (primitive, histogram) in LockPrimitive::ALL.iter().zip(&totals.lock_waits) {
            lock_waits.push_value(
                &[
                    ("service", input.service),
                    ("pool", input.pool),
                    ("primitive", primitive.name()),
                ],
                Value::Histogram {
                    buckets: coarse_buckets(histogram),
                    sum: histogram.sum_ns as f64 / 1e9,
                    count: histogram.count(),
                },
            );
        }
    }
    vec![
        threads,
        busy,
        utilization,
        state_seconds,
        offcpu,
        runqueue,
        lock_waits,
    ]
}

/// A socket peer as a label value: `10.0.0.5:5432`, `[2001:db8::1]:443`.
pub fn peer_label(peer: &Peer) -> String {
    let address = if peer.family == Peer::AF_INET6 {
        let v6 = std::net::Ipv6Addr::from(peer.addr);
        match v6.to_ipv4_mapped() {
            Some(v4) => std::net::SocketAddr::from((v4, peer.port)),
            None => std::net::SocketAddr::from((v6, peer.port)),
        }
    } else {
        let [a, b, c, d, ..] = peer.addr;
        std::net::SocketAddr::from(([a, b, c, d], peer.port))
    };
    address.to_string()
}

/// The network waits of each pool's serving threads per downstream peer. `names`
/// gives a pool id's service and pool names; entries of pools it does not know
/// (gone since the read) are left out.
pub fn downstream_families<'a>(
    waits: &[(DownstreamKey, DownstreamWait)],
    names: impl Fn(u32) -> Option<(&'a str, &'a str)>,
) -> Vec<Family> {
    let mut seconds = Family::new(
        "downstream_wait_seconds",
        Kind::Counter,
        "Time the pool's threads spent blocked on the network while serving a request,          with a socket to this peer in hand (a backend or database they call; part of          offcpu_seconds_total{reason=\"network\"}).",
    );
    let mut count = Family::new(
        "downstream_waits",
        Kind::Counter,
        "Network waits of the pool's serving threads on a socket to this peer that ended.",
    );
    let mut rows: Vec<_> = waits
        .iter()
        .filter_map(|(key, wait)| {
            let (service, pool) = names(key.pool)?;
            Some((service, pool, peer_label(&key.peer), wait))
        })
        .collect();
    rows.sort_by(|a, b| (a.0, a.1, &a.2).cmp(&(b.0, b.1, &b.2)));
    for (service, pool, peer, wait) in &rows {
        let labels = [
            ("service", *service),
            ("pool", *pool),
            ("peer", peer.as_str()),
        ];
        seconds.push(&labels, wait.wait_ns as f64 / 1e9);
        count.push(&labels, wait.waits as f64);
    }
    vec![seconds, count]
}

/// Joins listen queues to the services that own their sockets. Sockets of unwatched
/// processes are left out; one socket shared by several processes counts once, and
/// several sockets on one address (SO_REUSEPORT) add up to one listener: their
/// backlogs and limits summed, as one queue in front of the service.
pub fn service_listeners(
    queues: &[ListenQueue],
    owner: impl Fn(u64) -> Option<String>,
) -> Vec<ServiceListener> {
    let mut merged: BTreeMap<(String, SocketAddr), ListenQueue> = BTreeMap::new();
    for queue in queues {
        let Some(service) = owner(queue.inode) else {
            continue;
        };
        merged
            .entry((service, queue.addr))
            .and_modify(|sum| {
                sum.depth += queue.depth;
                sum.limit = sum.limit.zip(queue.limit).map(|(a, b)| a + b);
            })
            .or_insert(*queue);
    }
    merged
        .into_iter()
        .map(|((service, _), queue)| ServiceListener { service, queue })
        .collect()
}

/// What the exporter knows about its own health at scrape time.
#[derive(Clone, Debug, Default)]
pub struct SelfStats {
    pub version: &'static str,
    pub backend: &'static str,
    /// Every loss counter ([`health::losses`]).
    pub losses: Vec<Loss>,
    /// Whether any loss makes poolscope degraded now.
    pub degraded: bool,
    /// Processes with the `pthread_mutex_lock` probes attached.
    pub lock_probe_processes: usize,
    /// (collector, seconds, success)
    pub collectors: Vec<(&'static str, f64, bool)>,
    pub reload: ReloadStatus,
}

/// The last configuration load, exported as Prometheus exports its own, so that a
/// refused reload (which keeps the running configuration) can be alerted on.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReloadStatus {
    /// False from a refused reload until one succeeds.
    pub successful: bool,
    /// When the running configuration was loaded, at start or by a reload.
    pub success_unix_seconds: f64,
}

/// One family per kind of loss counter ([`health::losses`]); skipped probes are in
/// `probe_skipped` already.
fn loss_families(losses: &[Loss]) -> Vec<Family> {
    let mut events_lost = Family::new(
        "events_lost",
        Kind::Counter,
        "Events the kernel side could not deliver to user space, by source.",
    );
    let mut update_errors = Family::new(
        "map_update_errors",
        Kind::Counter,
        "Inserts into a kernel map that failed, by errno (E2BIG: the map is full); the \
         entry was not tracked.",
    );
    let mut unsymbolized = Family::new(
        "stack_frames_unsymbolized",
        Kind::Counter,
        "Stack frame addresses left without a function name (module+offset or a bare \
         address) by the symbolizer, by space; each distinct address once per drain, each \
         frame of a /debug/locks report.",
    );
    let mut scalars = Vec::new();
    for loss in losses {
        let value = loss.value as f64;
        match &loss.kind {
            LossKind::MapUpdate { map, errno } => {
                update_errors.push(&[("map", map), ("errno", errno.name())], value);
            }
            LossKind::Events(source) => events_lost.push(&[("source", source)], value),
            LossKind::SeriesDropped => scalars.push(
                Family::new(
                    "series_dropped",
                    Kind::Counter,
                    "Series left out of scrapes because limits.max_series was reached.",
                )
                .with(&[], value),
            ),
            LossKind::ServicesRefused => scalars.push(
                Family::new(
                    "services_refused",
                    Kind::Gauge,
                    "Processes the last scan left unwatched because limits.max_services was \
                     reached.",
                )
                .with(&[], value),
            ),
            LossKind::ProcessesUnreadable => scalars.push(
                Family::new(
                    "processes_unreadable",
                    Kind::Gauge,
                    "Processes whose open files the last scan was not allowed to read \
                     (EACCES, no CAP_SYS_PTRACE): their listening sockets are unknown, so \
                     discovery cannot find them.",
                )
                .with(&[], value),
            ),
            LossKind::PoolsRefused => scalars.push(
                Family::new(
                    "pools_refused",
                    Kind::Counter,
                    "Threads left in their creator's pool because limits.max_pools was reached.",
                )
                .with(&[], value),
            ),
            LossKind::LockUprobes => scalars.push(
                Family::new(
                    "lock_uprobe_errors",
                    Kind::Counter,
                    "Processes whose pthread_mutex_lock probes could not be attached (no libc \
                     mapped, or the kernel refused); the log says which.",
                )
                .with(&[], value),
            ),
            LossKind::ProbeSkipped { .. } => {}
            LossKind::Unsymbolized(space) => unsymbolized.push(&[("space", space)], value),
        }
    }
    let mut families = vec![events_lost, update_errors, unsymbolized];
    families.extend(scalars);
    families
}

/// The exporter's own families; never capped.
pub fn self_families(stats: &SelfStats, probes: &[Probe], kernel: Option<&Readout>) -> Vec<Family> {
    let mut families = vec![
        Family::new(
            "build_info",
            Kind::Gauge,
            "poolscope's version and request backend; always 1.",
        )
        .with(
            &[("version", stats.version), ("backend", stats.backend)],
            1.0,
        ),
    ];
    let mut attached = Family::new(
        "probe_attached",
        Kind::Gauge,
        "1 if the kernel probe (category/tracepoint) is attached, else 0.",
    );
    let mut skipped = Family::new(
        "probe_skipped",
        Kind::Gauge,
        "1 for each kernel probe that does not measure, with the reason found at start.",
    );
    for probe in probes {
        match probe.state {
            ProbeState::Attached => attached.push(&[("probe", &probe.name)], 1.0),
            ProbeState::OnDemand => {}
            ProbeState::Skipped(skip) => {
                attached.push(&[("probe", &probe.name)], 0.0);
                skipped.push(&[("probe", &probe.name), ("reason", skip.name())], 1.0);
            }
        }
    }
    families.push(attached);
    families.push(skipped);

    if let Some(kernel) = kernel {
        let mut run_seconds = Family::new(
            "bpf_run_seconds",
            Kind::Counter,
            "Time spent running each kernel program (kernel.bpf_stats_enabled).",
        );
        let mut runs = Family::new("bpf_runs", Kind::Counter, "Runs of each kernel program.");
        for program in &kernel.programs {
            run_seconds.push(
                &[("program", &program.name)],
                program.run_time.as_secs_f64(),
            );
            runs.push(&[("program", &program.name)], program.runs as f64);
        }
        families.extend([run_seconds, runs]);
        let mut entries = Family::new("map_entries", Kind::Gauge, "Entries in each kernel map.");
        let mut capacity = Family::new("map_capacity", Kind::Gauge, "Capacity of each kernel map.");
        for map in &kernel.maps {
            entries.push(&[("map", map.name)], map.entries as f64);
            if let Some(size) = map.capacity {
                capacity.push(&[("map", map.name)], size.into());
            }
        }
        families.extend([entries, capacity]);
    }
    families.extend(loss_families(&stats.losses));
    families.push(
        Family::new(
            "degraded",
            Kind::Gauge,
            "1 while poolscope measures less than it should (a loss counter rose within \
             limits.degraded_for, a refusal gauge is above 0, or a probe is skipped); \
             /healthz and the log say what to change.",
        )
        .with(&[], if stats.degraded { 1.0 } else { 0.0 }),
    );
    families.push(
        Family::new(
            "config_last_reload_successful",
            Kind::Gauge,
            "0 after a reload (SIGHUP) was refused and the running configuration kept; \
             1 once the configuration in use was loaded.",
        )
        .with(&[], if stats.reload.successful { 1.0 } else { 0.0 }),
    );
    families.push(
        Family::new(
            "config_last_reload_success_timestamp_seconds",
            Kind::Gauge,
            "When the configuration in use was loaded (at start or by a reload), in Unix \
             seconds.",
        )
        .with(&[], stats.reload.success_unix_seconds),
    );
    families.push(
        Family::new(
            "lock_uprobe_processes",
            Kind::Gauge,
            "Watched processes with the pthread_mutex_lock probes attached (probes.lock_uprobes).",
        )
        .with(&[], stats.lock_probe_processes as f64),
    );
    let mut duration = Family::new(
        "scrape_duration_seconds",
        Kind::Gauge,
        "Time each collector took in this scrape.",
    );
    let mut success = Family::new(
        "scrape_collector_success",
        Kind::Gauge,
        "1 if the collector succeeded in this scrape, else 0.",
    );
    for (collector, seconds, ok) in &stats.collectors {
        duration.push(&[("collector", collector)], *seconds);
        success.push(&[("collector", collector)], if *ok { 1.0 } else { 0.0 });
    }
    families.extend([duration, success]);
    families.retain(|family| !family.samples.is_empty());
    families
}

#[cfg(test)]
mod tests {
    use poolscope_shared::ServiceCounters;

    use super::*;
    use crate::{
        kernel::Skip,
        metrics::encode::{Format, render},
    };

    fn view(id: u32, name: &str, corrections: Corrections) -> ServiceView {
        ServiceView {
            id,
            name: name.into(),
            processes: 2,
            corrections,
        }
    }

    fn counters() -> ServiceCounters {
        ServiceCounters {
            accepted: 10,
            unserved_entered: 10,
            unserved_left: 6,
            waiting_entered: 20,
            waiting_left: 17,
            serving_entered: 30,
            serving_left: 25,
        }
    }

    #[test]
    fn gauges_are_entered_minus_left_minus_purged() {
        let purged = Corrections {
            unserved: 1,
            waiting: 0,
            serving: 2,
            adopted_unserved: 0,
        };
        let open = gauges(&counters(), &purged);
        assert_eq!(
            open,
            Gauges {
                unserved: 3,
                waiting: 3,
                in_flight: 3
            }
        );
        // Adopted with a request unread: in the gauge until the kernel's read.
        let adopted = Corrections {
            adopted_unserved: 2,
            ..purged
        };
        assert_eq!(gauges(&counters(), &adopted).unserved, 5);
        // Syscall backend: the backlog is not in the kernel's count.
        assert_eq!(queue_depth(Backend::Syscall, &open, 4), (3, 10));
        // Socket backend: it is (the count starts at the handshake).
        assert_eq!(queue_depth(Backend::Socket, &open, 2), (1, 6));
        // A backlog read a moment later than the kernel's counters never goes negative.
        assert_eq!(queue_depth(Backend::Socket, &open, 5), (0, 8));
    }

    #[test]
    fn service_families_render_each_metric() {
        let mut times = RequestTimes::default();
        times.queue.buckets[poolscope_shared::histogram_bucket(2_000_000)] = 4;
        times.queue.sum_ns = 8_000_000;
        times.duration.buckets[poolscope_shared::histogram_bucket(5_000_000)] = 4;
        times.duration.sum_ns = 20_000_000;
        let view = view(3, "web", Corrections::default());
        let counters = counters();
        let inputs = [ServiceInput {
            view: &view,
            counters: &counters,
            times: &times,
            window: &times,
            components: [0; COMPONENTS.len()],
        }];
        let mut syscalls = BTreeMap::new();
        syscalls.insert((3, "read"), 7);
        syscalls.insert((4, "read"), 9);
        let families = service_families(Backend::Syscall, &inputs, &syscalls, &[]);
        let text = render(&families, Format::Text);
        for line in [
            "poolscope_queue_depth{service=\"web\"} 7\n",
            "poolscope_connections_unserved{service=\"web\"} 4\n",
            "poolscope_requests_waiting{service=\"web\"} 3\n",
            "poolscope_requests_in_flight{service=\"web\"} 5\n",
            "poolscope_requests_total{service=\"web\"} 4\n",
            "poolscope_connections_accepted_total{service=\"web\"} 10\n",
            "poolscope_request_time_seconds_total{service=\"web\",component=\"queue\"} 0.008\n",
            "poolscope_syscalls_total{service=\"web\",syscall=\"read\"} 7\n",
            "poolscope_request_queue_seconds_sum{service=\"web\"} 0.008\n",
            "poolscope_request_duration_seconds_count{service=\"web\"} 4\n",
            "poolscope_targets{service=\"web\"} 2\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert!(
            !text.contains("} 9\n"),
            "another service's counter leaked: {text}"
        );
        let median = text
            .lines()
            .find(|l| {
                l.starts_with(
                    "poolscope_request_duration_window_seconds{service=\"web\",quantile=\"0.5\"}",
                )
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .expect("median line");
        assert!((median - 0.005).abs() < 0.0005, "{median}");
    }

    #[test]
    fn downstream_waits_are_labelled_by_peer_and_pool() {
        let mut v4 = Peer {
            port: 5432,
            family: Peer::AF_INET,
            ..Peer::NONE
        };
        v4.addr[..4].copy_from_slice(&[10, 0, 0, 5]);
        let v6 = Peer {
            addr: std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1).octets(),
            port: 443,
            family: Peer::AF_INET6,
        };
        let mapped = Peer {
            addr: std::net::Ipv4Addr::new(127, 0, 0, 1)
                .to_ipv6_mapped()
                .octets(),
            port: 80,
            family: Peer::AF_INET6,
        };
        assert_eq!(peer_label(&v4), "10.0.0.5:5432");
        assert_eq!(peer_label(&v6), "[2001:db8::1]:443");
        assert_eq!(peer_label(&mapped), "127.0.0.1:80");
        let wait = |ns, waits| DownstreamWait { wait_ns: ns, waits };
        let waits = [
            (DownstreamKey { pool: 1, peer: v4 }, wait(2_500_000_000, 50)),
            (DownstreamKey { pool: 2, peer: v6 }, wait(1_000_000, 1)),
            // A pool gone since the read is left out.
            (DownstreamKey { pool: 9, peer: v4 }, wait(7, 7)),
        ];
        let names = |pool| match pool {
            1 => Some(("api", "worker")),
            2 => Some(("api", "io")),
            _ => None,
        };
        let text = render(&downstream_families(&waits, names), Format::Text);
        for line in [
            "poolscope_downstream_wait_seconds_total{service=\"api\",pool=\"worker\",peer=\"10.0.0.5:5432\"} 2.5\n",
            "poolscope_downstream_waits_total{service=\"api\",pool=\"worker\",peer=\"10.0.0.5:5432\"} 50\n",
            "poolscope_downstream_wait_seconds_total{service=\"api\",pool=\"io\",peer=\"[2001:db8::1]:443\"} 0.001\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert!(!text.contains(" 7\n"), "a gone pool's entry: {text}");
    }

    #[test]
    fn listeners_join_by_inode_and_skip_unwatched() {
        let queue = |inode, port| ListenQueue {
            inode,
            addr: format!("127.0.0.1:{port}").parse().expect("addr"),
            depth: 4,
            limit: Some(16),
        };
        let listeners = service_listeners(&[queue(1, 80), queue(2, 81)], |inode| {
            (inode == 1).then(|| "web".to_owned())
        });
        assert_eq!(listeners.len(), 1);
        // SO_REUSEPORT: three sockets on one address are one listener.
        let reuseport = service_listeners(&[queue(1, 80), queue(3, 80), queue(4, 80)], |_| {
            Some("web".to_owned())
        });
        assert_eq!(reuseport.len(), 1);
        assert_eq!(
            (reuseport[0].queue.depth, reuseport[0].queue.limit),
            (12, Some(48))
        );
        // A queue read from procfs (another namespace's) has no known limit, and
        // neither has the sum it is part of.
        let mut foreign = queue(5, 80);
        foreign.limit = None;
        let mixed = service_listeners(&[queue(1, 80), foreign], |_| Some("web".to_owned()));
        assert_eq!((mixed[0].queue.depth, mixed[0].queue.limit), (8, None));
        let text = render(
            &service_families(Backend::Syscall, &[], &BTreeMap::new(), &listeners),
            Format::Text,
        );
        assert!(text.contains(
            "poolscope_listen_queue_depth{service=\"web\",listener=\"127.0.0.1:80\"} 4\n"
        ));
        assert!(text.contains(
            "poolscope_listen_queue_limit{service=\"web\",listener=\"127.0.0.1:80\"} 16\n"
        ));
    }

    #[test]
    fn a_refused_reload_is_exported_beside_the_last_good_load() {
        let stats = SelfStats {
            reload: ReloadStatus {
                successful: false,
                success_unix_seconds: 1_700_000_000.5,
            },
            ..Default::default()
        };
        let text = render(&self_families(&stats, &[], None), Format::Text);
        for line in [
            "poolscope_config_last_reload_successful 0\n",
            "poolscope_config_last_reload_success_timestamp_seconds 1700000000.5\n",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }

    #[test]
    fn losses_are_exported_by_map_and_errno_with_the_degraded_flag() {
        let kernel = [
            (
                poolscope_shared::LossSource::ConnsInsert,
                poolscope_shared::LossErrno::E2big,
                5,
            ),
            (
                poolscope_shared::LossSource::ThreadsInsert,
                poolscope_shared::LossErrno::Ebusy,
                2,
            ),
        ];
        let stats = SelfStats {
            losses: crate::metrics::health::losses(&crate::metrics::health::LossInputs {
                kernel: &kernel,
                series_dropped: 9,
                unsymbolized: crate::stacks::symbolize::Unnamed { user: 3, kernel: 0 },
                ..Default::default()
            }),
            degraded: true,
            ..Default::default()
        };
        let text = render(&self_families(&stats, &[], None), Format::Text);
        for line in [
            "poolscope_map_update_errors_total{map=\"CONNS\",errno=\"E2BIG\"} 5",
            "poolscope_map_update_errors_total{map=\"THREADS\",errno=\"E2BIG\"} 0",
            "poolscope_map_update_errors_total{map=\"THREADS\",errno=\"EBUSY\"} 2",
            "poolscope_events_lost_total{source=\"process_events\"} 0",
            "poolscope_series_dropped_total 9",
            "poolscope_stack_frames_unsymbolized_total{space=\"user\"} 3",
            "poolscope_stack_frames_unsymbolized_total{space=\"kernel\"} 0",
            "poolscope_services_refused 0",
            "poolscope_degraded 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
    }

    #[test]
    fn skipped_probes_say_why_and_on_demand_ones_are_not_attached_probes() {
        let probe = |name: &str, state| Probe {
            name: name.into(),
            state,
        };
        let probes = [
            probe("raw_syscalls/sys_enter", ProbeState::Attached),
            probe("sched/sched_switch", ProbeState::Skipped(Skip::LoadRefused)),
            probe("uprobe/pthread_mutex_lock", ProbeState::OnDemand),
            probe("perf_event/cpu-clock", ProbeState::Skipped(Skip::Off)),
        ];
        let text = render(
            &self_families(&SelfStats::default(), &probes, None),
            Format::Text,
        );
        for line in [
            "poolscope_probe_attached{probe=\"raw_syscalls/sys_enter\"} 1",
            "poolscope_probe_attached{probe=\"sched/sched_switch\"} 0",
            "poolscope_probe_skipped{probe=\"sched/sched_switch\",reason=\"load_refused\"} 1",
            "poolscope_probe_skipped{probe=\"perf_event/cpu-clock\",reason=\"off\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
        assert!(
            !text.contains("probe=\"uprobe/pthread_mutex_lock\""),
            "{text}"
        );
        assert!(!text.contains("sys_enter\",reason"), "{text}");
    }
}
