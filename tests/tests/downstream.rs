//! Busy means busy: workers that wait on a slow downstream (an unwatched backend
//! answering after 40 ms) through a client with a timeout are busy, not idle, and
//! their wait is network time. Each server's own clock is the truth: the busy time
//! of its workers (request read → response written) and the time inside its backend
//! calls. Servers (tests/downstream):
//! - C, workers `poll()` the one backend socket before each read (on both request
//!   backends);
//! - C, workers call the backend through libcurl (which polls its socket and a
//!   socketpair);
//! - Python, a ThreadPoolExecutor whose workers use `socket.create_connection(timeout=)`;
//! - Java, a fixed thread pool whose workers read the backend with `setSoTimeout`.
//!
//! Over each load (below saturation and beyond it), between two scrapes with the load
//! drained before the second: the worker pool's busy share from
//! `thread_seconds_total` within 3 points of the server's busy time / (workers ×
//! wall), its `offcpu_seconds_total{reason="network"}` and its
//! `downstream_wait_seconds_total{peer="127.0.0.1:<backend port>"}` each within 5 %
//! of the server's time in backend calls, and once the load stops, no worker is left
//! busy.
//!
//! The numbers go to stderr (`--nocapture`).
use std::time::{Duration, Instant};

use anyhow::Context as _;
use poolscope_tests::{
    Metrics, Poolscope, Program, backends,
    downstream::{self, Backend, Kind},
    load::OpenLoop,
    one_at_a_time, parse_debug_threads, privileged, scorecard, scrape_until, wait_until,
};

const WORKERS: u32 = 8;
/// The backend's answer delay.
const BACKEND_DELAY_MS: u64 = 40;
/// The load's clients: enough in flight to saturate the pool.
const SENDERS: usize = 64;
const POOL: &str = "worker";
/// Offered loads, as shares of the pool's capacity (workers / backend delay); 1.3
/// saturates it.
const LOADS: [f64; 3] = [0.3, 0.6, 1.3];
const RUN: Duration = Duration::from_secs(5);

/// What a server's own clock said at one moment.
#[derive(Clone, Copy, Debug, Default)]
struct Stats {
    served: u64,
    busy_ns: u64,
    wait_ns: u64,
    errors: u64,
}

fn stats(server: &mut Program) -> anyhow::Result<Stats> {
    server.send("stats")?;
    let line = server.line("stats")?;
    let numbers: Vec<u64> = line
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .with_context(|| format!("stats {line:?}"))?;
    let [served, busy_ns, wait_ns, errors] = numbers[..] else {
        anyhow::bail!("stats {line:?}");
    };
    Ok(Stats {
        served,
        busy_ns,
        wait_ns,
        errors,
    })
}

/// Waits (10 s at most) until `server`'s own counts (served and failed) take in the
/// `sent` requests its clients made since `before`: its workers have finished the
/// bookkeeping after each response's write.
fn drained(server: &mut Program, before: &Stats, sent: u64) -> anyhow::Result<()> {
    let mut last = Err(anyhow::anyhow!("not read"));
    let done = wait_until(Duration::from_secs(10), || {
        last = stats(server);
        last.as_ref()
            .is_ok_and(|now| (now.served - before.served) + (now.errors - before.errors) >= sent)
    });
    anyhow::ensure!(
        done,
        "the server's own counts did not take in the {sent} requests sent within 10 s: \
         before {before:?}, last {last:?}"
    );
    Ok(())
}

fn pool_sum(metrics: &Metrics, name: &str, service: &str, label: (&str, &[&str])) -> f64 {
    label
        .1
        .iter()
        .map(|value| {
            metrics
                .value(
                    name,
                    &[("service", service), ("pool", POOL), (label.0, value)],
                )
                .unwrap_or(0.0)
        })
        .sum()
}

const BUSY_STATES: [&str; 4] = ["running", "runnable", "blocked_lock", "blocked_io"];

/// One load's truth and poolscope's numbers.
struct Reading {
    truth_utilization: f64,
    utilization: f64,
    truth_wait: f64,
    network_wait: f64,
    /// `downstream_wait_seconds_total` of the backend's address.
    backend_wait: f64,
    /// Workers that `/debug/threads` showed waiting on the backend mid-run.
    waiting_mid_run: usize,
}

/// Whether the backend answers: a failing one makes every request an error.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Calls {
    Answered,
    Failing,
}

fn run_load(
    poolscope: &Poolscope,
    server: &mut Program,
    (port, backend_port): (u16, u16),
    service: &str,
    (load, calls): (f64, Calls),
) -> anyhow::Result<Reading> {
    let rate = load * f64::from(WORKERS) * 1000.0 / BACKEND_DELAY_MS as f64;
    let before_stats = stats(server)?;
    let before = poolscope.scrape()?;
    let started = Instant::now();
    let clients = OpenLoop::start(port, rate, SENDERS);
    // The load's duration (the measurement window), in two halves.
    std::thread::sleep(RUN / 2);
    // Mid-run, a worker in a backend call shows the backend as what it waits on.
    let peer = format!("127.0.0.1:{backend_port}");
    let rows = parse_debug_threads(&poolscope.get("/debug/threads")?)?;
    let waiting = rows
        .iter()
        .filter(|row| row.service == service && row.activity == "OffNetwork")
        .filter(|row| row.waiting_on == peer)
        .count();
    std::thread::sleep(RUN / 2);
    let sent = clients.stop()?;
    // The last responses were read by the clients; their workers finish the
    // bookkeeping after the write.
    drained(server, &before_stats, sent.sent)?;
    let after = poolscope.scrape()?;
    let wall = started.elapsed().as_secs_f64();
    let after_stats = stats(server)?;
    let server_errors = after_stats.errors - before_stats.errors;
    let as_expected = match calls {
        Calls::Answered => sent.errors == 0 && server_errors == 0,
        Calls::Failing => sent.answered == 0 && server_errors == sent.sent,
    };
    anyhow::ensure!(
        as_expected,
        "errors: clients {sent:?}, server {after_stats:?}"
    );
    let delta = |name: &str, label: (&str, &[&str])| {
        pool_sum(&after, name, service, label) - pool_sum(&before, name, service, label)
    };
    let busy = delta("poolscope_thread_seconds_total", ("state", &BUSY_STATES));
    let idle = delta("poolscope_thread_seconds_total", ("state", &["idle"]));
    let network_wait = delta("poolscope_offcpu_seconds_total", ("reason", &["network"]));
    let backend_wait = delta(
        "poolscope_downstream_wait_seconds_total",
        ("peer", &[peer.as_str()]),
    );
    let truth_busy = (after_stats.busy_ns - before_stats.busy_ns) as f64 / 1e9;
    let reading = Reading {
        truth_utilization: truth_busy / (f64::from(WORKERS) * wall),
        utilization: busy / (busy + idle),
        truth_wait: (after_stats.wait_ns - before_stats.wait_ns) as f64 / 1e9,
        network_wait,
        backend_wait,
        waiting_mid_run: waiting,
    };
    eprintln!(
        "{service:>16} {load:>5.1} {:>7} {:>11.3} {:>11.3} {:>12.3} {:>12.3} {:>12.3}",
        after_stats.served - before_stats.served + server_errors,
        reading.truth_utilization,
        reading.utilization,
        reading.truth_wait,
        reading.network_wait,
        reading.backend_wait,
    );
    Ok(reading)
}

/// Every worker's activity once the load is gone: none may stay busy.
fn workers_are_idle(poolscope: &Poolscope, service: &str) -> anyhow::Result<()> {
    let rows = parse_debug_threads(&poolscope.get("/debug/threads")?)?;
    let busy: Vec<_> = rows
        .iter()
        .filter(|row| row.service == service && row.pool == POOL && row.activity != "OffIdle")
        .collect();
    anyhow::ensure!(
        busy.is_empty(),
        "workers left busy after the load: {busy:?}"
    );
    Ok(())
}

/// Watches `server` as service `name` with request backend `backend`, once every
/// worker is in the pool.
fn watch(name: &str, backend: &str, server: &Program) -> anyhow::Result<Poolscope> {
    let poolscope = Poolscope::start(&format!(
        "[probes]\nbackend = \"{backend}\"\n[pools]\nutilization_window = \"5s\"\n\
         [discovery]\nrescan_interval = \"500ms\"\n\
         [[targets]]\nservice = \"{name}\"\npids = [{}]\n",
        server.pid()
    ))?;
    scrape_until(&poolscope, |m| {
        m.value(
            "poolscope_pool_threads",
            &[("service", name), ("pool", POOL)],
        ) == Some(f64::from(WORKERS))
    })?;
    Ok(poolscope)
}

fn check(
    name: &str,
    backend: &str,
    (backend_port, calls): (u16, Calls),
    mut server: Program,
    loads: &[f64],
) -> anyhow::Result<()> {
    let port: u16 = server.line("port")?.parse()?;
    let service = name.to_owned();
    let poolscope = watch(name, backend, &server)?;
    let mut failures = Vec::new();
    for &load in loads {
        let reading = run_load(
            &poolscope,
            &mut server,
            (port, backend_port),
            &service,
            (load, calls),
        )?;
        // At 30 % load 2.4 workers are in a backend call on average: P(none) ≈ 0.09,
        // so this is checked at the busier loads only.
        if load >= 0.5 && reading.waiting_mid_run == 0 {
            failures.push(format!(
                "load {load}: no worker waits on the backend in /debug/threads mid-run"
            ));
        }
        if (reading.utilization - reading.truth_utilization).abs() > 0.03 {
            failures.push(format!(
                "load {load}: utilization {:.3}, truth {:.3} ± 0.03",
                reading.utilization, reading.truth_utilization
            ));
        } else {
            scorecard::points(
                "busy share of a pool calling a slow backend (thread_seconds_total)",
                "the workers' own busy time by their clock",
                backend,
                reading.utilization,
                reading.truth_utilization,
                3.0,
            );
        }
        if (reading.network_wait - reading.truth_wait).abs() > 0.05 * reading.truth_wait {
            failures.push(format!(
                "load {load}: network wait {:.3} s, truth {:.3} s ± 5 %",
                reading.network_wait, reading.truth_wait
            ));
        } else {
            scorecard::within(
                "offcpu_seconds_total of reason network, workers calling a slow backend",
                "the workers' own time in backend calls",
                backend,
                reading.network_wait,
                reading.truth_wait,
                0.05,
            );
        }
        if (reading.backend_wait - reading.truth_wait).abs() > 0.05 * reading.truth_wait {
            failures.push(format!(
                "load {load}: wait on the backend's address {:.3} s, truth {:.3} s ± 5 %",
                reading.backend_wait, reading.truth_wait
            ));
        } else {
            scorecard::within(
                "downstream_wait_seconds_total of the backend's address",
                "the workers' own time in backend calls",
                backend,
                reading.backend_wait,
                reading.truth_wait,
                0.05,
            );
        }
        workers_are_idle(&poolscope, &service)?;
    }
    anyhow::ensure!(failures.is_empty(), "{name}: {}", failures.join("; "));
    Ok(())
}

fn header() {
    eprintln!(
        "{:>16} {:>5} {:>7} {:>11} {:>11} {:>12} {:>12} {:>12}",
        "server", "load", "served", "util truth", "util", "wait truth", "network", "on backend"
    );
}

#[test]
fn c_workers_polling_a_backend_are_busy() -> anyhow::Result<()> {
    if !privileged("c_workers_polling_a_backend_are_busy") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir()?;
    let binary = downstream::build_c(dir.path())?;
    let backend = Backend::start(BACKEND_DELAY_MS)?;
    header();
    // The rule does not depend on the request backend; the poll server checks both.
    let mut runs: Vec<(Kind, &str)> = backends().into_iter().map(|b| (Kind::CPoll, b)).collect();
    runs.push((Kind::CCurl, "auto"));
    for (kind, request_backend) in runs {
        let server = downstream::start(kind, WORKERS, backend.port, Some(&binary))?;
        check(
            &format!("{kind:?}-{request_backend}"),
            request_backend,
            (backend.port, Calls::Answered),
            server,
            &LOADS,
        )?;
    }
    Ok(())
}

/// A server of an interpreted runtime (no C to build) at every load.
fn runtime_server(test: &str, kind: Kind, name: &str) -> anyhow::Result<()> {
    if !privileged(test) {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let backend = Backend::start(BACKEND_DELAY_MS)?;
    header();
    let server = downstream::start(kind, WORKERS, backend.port, None)?;
    check(
        name,
        "auto",
        (backend.port, Calls::Answered),
        server,
        &LOADS,
    )
}

#[test]
fn python_workers_with_a_socket_timeout_are_busy() -> anyhow::Result<()> {
    runtime_server(
        "python_workers_with_a_socket_timeout_are_busy",
        Kind::Python,
        "python",
    )
}

#[test]
fn java_workers_with_so_timeout_are_busy() -> anyhow::Result<()> {
    runtime_server("java_workers_with_so_timeout_are_busy", Kind::Java, "java")
}

/// The rule's limits, for real: a worker whose poll also watches 15 pipes of its own
/// (16 fds) polls like an event loop and is idle while it waits; a backend that
/// closes every connection mid-wait without an answer keeps the workers busy until
/// each call fails, and leaves none of them busy.
#[test]
fn a_poll_on_many_fds_is_idle_and_a_failing_downstream_frees_its_workers() -> anyhow::Result<()> {
    if !privileged("a_poll_on_many_fds_is_idle_and_a_failing_downstream_frees_its_workers") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir()?;
    let binary = downstream::build_c(dir.path())?;
    header();

    let backend = Backend::start(BACKEND_DELAY_MS)?;
    let mut server = downstream::start(Kind::CPollMany, WORKERS, backend.port, Some(&binary))?;
    let port: u16 = server.line("port")?.parse()?;
    let poolscope = watch("pollmany", "auto", &server)?;
    let reading = run_load(
        &poolscope,
        &mut server,
        (port, backend.port),
        "pollmany",
        (0.6, Calls::Answered),
    )?;
    // Busy only on CPU: the waits in the 16-fd poll are idle.
    anyhow::ensure!(
        reading.utilization < 0.05
            && reading.network_wait < 0.01 * reading.truth_wait
            && reading.waiting_mid_run == 0,
        "a 16-fd poll counted as a downstream wait: utilization {:.3}, network {:.3} s, \
         {} waiting mid-run",
        reading.utilization,
        reading.network_wait,
        reading.waiting_mid_run
    );
    workers_are_idle(&poolscope, "pollmany")?;
    drop(poolscope);

    let closing = Backend::start_closing(BACKEND_DELAY_MS)?;
    let server = downstream::start(Kind::CPoll, WORKERS, closing.port, Some(&binary))?;
    check(
        "failing",
        "auto",
        (closing.port, Calls::Failing),
        server,
        &[0.6],
    )
}

/// `DOWNSTREAM_WAITS` of 1 (`limits.downstreams`): two services, each a C pool whose
/// workers call a backend of their own. The first service's (pool, peer) takes the
/// one entry; each backend call of the other is one failed insert (`E2BIG`): its wait
/// still counts as network time (within 5 % of the server's own clock), only without
/// its peer, and poolscope is degraded with the key to raise. When the first service
/// exits, its entry goes, the other's peer takes the room and poolscope is healthy
/// again.
#[test]
fn a_full_downstream_map_is_counted_and_recovers() -> anyhow::Result<()> {
    if !privileged("a_full_downstream_map_is_counted_and_recovers") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir()?;
    let binary = downstream::build_c(dir.path())?;
    let backends = [
        Backend::start(BACKEND_DELAY_MS)?,
        Backend::start(BACKEND_DELAY_MS)?,
    ];
    let mut first = downstream::start(Kind::CPoll, WORKERS, backends[0].port, Some(&binary))?;
    let mut second = downstream::start(Kind::CPoll, WORKERS, backends[1].port, Some(&binary))?;
    let ports: [u16; 2] = [first.line("port")?.parse()?, second.line("port")?.parse()?];
    let poolscope = Poolscope::start(&format!(
        "[limits]\ndownstreams = 1\ndegraded_for = \"2s\"\n\
         [[targets]]\nservice = \"first\"\npids = [{}]\n\
         [[targets]]\nservice = \"second\"\npids = [{}]\n",
        first.pid(),
        second.pid()
    ))?;
    scrape_until(&poolscope, |m| {
        ["first", "second"].iter().all(|service| {
            m.value(
                "poolscope_pool_threads",
                &[("service", service), ("pool", POOL)],
            ) == Some(f64::from(WORKERS))
        })
    })?;
    let peers = backends.each_ref().map(|b| format!("127.0.0.1:{}", b.port));
    let peer_wait = |m: &Metrics, service: &str, peer: &str| {
        pool_sum(
            m,
            "poolscope_downstream_wait_seconds_total",
            service,
            ("peer", &[peer]),
        )
    };
    let rate = 0.6 * f64::from(WORKERS) * 1000.0 / BACKEND_DELAY_MS as f64;
    // The first service's peer takes the one entry.
    let first_load = OpenLoop::start(ports[0], rate, SENDERS);
    scrape_until(&poolscope, |m| peer_wait(m, "first", &peers[0]) > 0.0)?;
    let network = |m: &Metrics| {
        pool_sum(
            m,
            "poolscope_offcpu_seconds_total",
            "second",
            ("reason", &["network"]),
        )
    };
    let (truth_before, before) = (stats(&mut second)?, poolscope.scrape()?);
    let second_load = OpenLoop::start(ports[1], rate, SENDERS);
    // The load's duration: the measurement window.
    std::thread::sleep(RUN);
    let sent = second_load.stop()?;
    drained(&mut second, &truth_before, sent.sent)?;
    let (truth_after, during) = (stats(&mut second)?, poolscope.scrape()?);
    let health = poolscope.get("/healthz")?;
    let full = [("map", "DOWNSTREAM_WAITS"), ("errno", "E2BIG")];
    let failed = during
        .value("poolscope_map_update_errors_total", &full)
        .unwrap_or(0.0);
    let truth_wait = (truth_after.wait_ns - truth_before.wait_ns) as f64 / 1e9;
    let counted_wait = network(&during) - network(&before);
    eprintln!(
        "DOWNSTREAM_WAITS of 1: {failed} failed inserts, {} entries; second service: \
         {sent:?}, network wait {counted_wait:.3} s, its own clock {truth_wait:.3} s",
        during
            .value("poolscope_map_entries", &[("map", "DOWNSTREAM_WAITS")])
            .unwrap_or(f64::NAN)
    );
    assert!(failed > 0.0);
    assert_eq!(
        during.value("poolscope_map_entries", &[("map", "DOWNSTREAM_WAITS")]),
        Some(1.0)
    );
    assert_eq!(peer_wait(&during, "second", &peers[1]), 0.0);
    assert!(
        (counted_wait - truth_wait).abs() <= 0.05 * truth_wait,
        "network wait {counted_wait:.3} s, truth {truth_wait:.3} s ± 5 %"
    );
    assert_eq!(during.value("poolscope_degraded", &[]), Some(1.0));
    assert!(health.contains("raise limits.downstreams"), "{health}");

    // The first service exits: its entry goes, the second's peer takes the room.
    first_load.stop()?;
    drop(first);
    scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", "first")])
            .is_none()
    })?;
    let again = OpenLoop::start(ports[1], rate, SENDERS);
    let recovered = scrape_until(&poolscope, |m| {
        peer_wait(m, "second", &peers[1]) > 0.0 && m.value("poolscope_degraded", &[]) == Some(0.0)
    });
    again.stop()?;
    let recovered = recovered?;
    assert_eq!(
        recovered.value("poolscope_map_entries", &[("map", "DOWNSTREAM_WAITS")]),
        Some(1.0)
    );
    assert_eq!(poolscope.get("/healthz")?, "ok\n");
    Ok(())
}
