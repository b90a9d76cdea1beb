//! Servers shaped like Kubernetes pods: each in a network namespace of its own (made by
//! the test with `ip netns`), listening on the same port; and two servers in one
//! namespace bound to two addresses on one port. The truth is each server's
//! own count of what it served and the clients' count of what they sent, and, for a
//! backlog, the number of connections the test left unaccepted. Every number is
//! checked exactly, on both backends.
use std::{
    fs,
    net::{Ipv4Addr, SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::Context as _;
use poolscope_tests::{
    Metrics, Netns, PoolServer, Poolscope, TestServer, backends,
    load::{ClosedLoop, Connections},
    one_at_a_time, privileged, scorecard, scrape_until, wait_until,
};

/// Both pods listen here, as two replicas of one deployment do.
const PORT: u16 = 8080;
const SERVICE: Duration = Duration::from_millis(2);
/// Requests each server's clients complete at least: a volume, not a duration, because
/// a guest under emulation completes 63–98 of A's requests in 1.5 s here and fewer on a
/// slower machine.
const LOAD: u64 = 150;
/// How long A serves on while B's series leave.
const SERVE_ON: Duration = Duration::from_millis(1500);

fn requests(metrics: &Metrics, service: &str) -> Option<f64> {
    metrics.value("poolscope_requests_total", &[("service", service)])
}

fn config(backend: &str, services: &[(&str, u32)]) -> String {
    let mut config =
        format!("[probes]\nbackend = \"{backend}\"\n[discovery]\nrescan_interval = \"500ms\"\n");
    for (service, pid) in services {
        config.push_str(&format!(
            "[[targets]]\nservice = \"{service}\"\npids = [{pid}]\n"
        ));
    }
    config
}

/// Servers A and B on one port where only their placement tells them apart; B
/// takes twice A's clients (from `start_loads`: A's, B's); only A is watched, or both
/// are. Each service must count exactly its own clients' requests, settled: nothing
/// of the other's arrives later under its name.
fn counted_apart(
    backend: &str,
    watch_both: bool,
    [(name_a, server_a), (name_b, server_b)]: [(&str, PoolServer); 2],
    start_loads: impl FnOnce() -> anyhow::Result<(ClosedLoop, ClosedLoop)>,
) -> anyhow::Result<()> {
    let mut watched = vec![(name_a, server_a.pid())];
    if watch_both {
        watched.push((name_b, server_b.pid()));
    }
    let poolscope = Poolscope::start(&config(backend, &watched))?;
    scrape_until(&poolscope, |m| {
        watched
            .iter()
            .all(|(service, _)| m.value("poolscope_targets", &[("service", service)]) == Some(1.0))
            && m.has_label("backend", backend)
    })?;
    let (load_a, load_b) = start_loads()?;
    let loaded = wait_until(Duration::from_secs(60), || {
        load_a.completed() >= LOAD && load_b.completed() >= LOAD
    });
    let (sent_a, sent_b) = (load_a.stop()?.completed, load_b.stop()?.completed);
    anyhow::ensure!(
        loaded,
        "too little load to tell the servers apart: {sent_a} and {sent_b} requests in 60 s"
    );
    let metrics = scrape_until(&poolscope, |m| {
        requests(m, name_a) == Some(sent_a as f64)
            && (!watch_both || requests(m, name_b) == Some(sent_b as f64))
    });
    // A window for anything counted late to show (none may): a measurement, not a wait.
    std::thread::sleep(Duration::from_millis(300));
    let later = poolscope.scrape()?;
    eprintln!(
        "{backend}: {name_a} sent {sent_a}, {name_b} {sent_b}; poolscope counted {name_a} {:?}, \
         {name_b} {:?}",
        requests(&later, name_a),
        requests(&later, name_b)
    );
    let metrics = metrics?;
    assert_eq!(requests(&later, name_a), requests(&metrics, name_a));
    assert_eq!(requests(&later, name_b), requests(&metrics, name_b));
    let mut counted = vec![(&metrics, name_a, sent_a)];
    if watch_both {
        counted.push((&metrics, name_b, sent_b));
    }
    for (metrics, name, sent) in counted {
        scorecard::exact(
            "requests_total of each of two servers on one port (two pods, or two addresses)",
            "its own clients' count of answered requests",
            backend,
            requests(metrics, name).unwrap_or(f64::NAN),
            sent as f64,
        );
    }
    let (served_a, served_b) = (server_a.finish()?.count, server_b.finish()?.count);
    assert_eq!((served_a, served_b), (sent_a, sent_b));
    Ok(())
}

/// Pods A and B, each in its own namespace on one port. Connections are opened per
/// request, so that every request's connection is claimed at its handshake.
fn same_port(backend: &str, watch_both: bool) -> anyhow::Result<()> {
    let _serial = one_at_a_time();
    let (pod_a, pod_b) = (Netns::new("pod-a")?, Netns::new("pod-b")?);
    let server_a = PoolServer::start_in(&pod_a, PORT, 4, SERVICE)?;
    let server_b = PoolServer::start_in(&pod_b, PORT, 4, SERVICE)?;
    counted_apart(
        backend,
        watch_both,
        [("pod-a", server_a), ("pod-b", server_b)],
        || {
            let load_b = pod_b.run(|| Ok(ClosedLoop::start(PORT, 4, Connections::PerRequest)))?;
            let load_a = pod_a.run(|| Ok(ClosedLoop::start(PORT, 2, Connections::PerRequest)))?;
            Ok((load_a, load_b))
        },
    )
}

#[test]
fn same_port_in_two_namespaces_only_one_watched() -> anyhow::Result<()> {
    if !privileged("same_port_in_two_namespaces_only_one_watched") {
        return Ok(());
    }
    for backend in backends() {
        same_port(backend, false)?;
    }
    Ok(())
}

#[test]
fn same_port_in_two_namespaces_both_watched() -> anyhow::Result<()> {
    if !privileged("same_port_in_two_namespaces_both_watched") {
        return Ok(());
    }
    for backend in backends() {
        same_port(backend, true)?;
    }
    Ok(())
}

/// Two servers in one namespace on one port, bound to 127.0.0.1 and 127.0.0.2: a
/// connection is claimed by the listener bound to its own address.
fn same_port_two_addresses(backend: &str, watch_both: bool) -> anyhow::Result<()> {
    let _serial = one_at_a_time();
    let (address_a, address_b) = (Ipv4Addr::new(127, 0, 0, 1), Ipv4Addr::new(127, 0, 0, 2));
    let server_a = PoolServer::start_at(address_a, 0, 4, SERVICE)?;
    let port = server_a.port;
    let server_b = PoolServer::start_at(address_b, port, 4, SERVICE)?;
    counted_apart(
        backend,
        watch_both,
        [("addr-a", server_a), ("addr-b", server_b)],
        || {
            let load_b = ClosedLoop::start_to(
                SocketAddr::from((address_b, port)),
                4,
                Connections::PerRequest,
            );
            let load_a = ClosedLoop::start_to(
                SocketAddr::from((address_a, port)),
                2,
                Connections::PerRequest,
            );
            Ok((load_a, load_b))
        },
    )
}

#[test]
fn same_port_on_two_addresses_in_one_namespace() -> anyhow::Result<()> {
    if !privileged("same_port_on_two_addresses_in_one_namespace") {
        return Ok(());
    }
    for backend in backends() {
        same_port_two_addresses(backend, false)?;
        same_port_two_addresses(backend, true)?;
    }
    Ok(())
}

/// A server in its own namespace accepts nothing while 6 clients connect: they wait
/// in its listen backlog, which sock_diag in poolscope's namespace cannot see (read
/// through a copy of the listener's fd, with the backlog's limit).
#[test]
fn listen_backlog_of_a_pod() -> anyhow::Result<()> {
    if !privileged("listen_backlog_of_a_pod") {
        return Ok(());
    }
    const WAITING: usize = 6;
    let _serial = one_at_a_time();
    for backend in backends() {
        let pod = Netns::new("backlog")?;
        let mut server = TestServer::start_in(&pod, 16)?;
        let service = "pod";
        let poolscope = Poolscope::start(&config(backend, &[(service, server.pid())]))?;
        scrape_until(&poolscope, |m| {
            m.value("poolscope_targets", &[("service", service)]) == Some(1.0)
                && m.has_label("backend", backend)
        })?;
        let port = server.port;
        let clients: Vec<TcpStream> = pod.run(move || {
            (0..WAITING)
                .map(|_| Ok(TcpStream::connect(("127.0.0.1", port))?))
                .collect()
        })?;
        let waiting = WAITING as f64;
        let listener = format!("127.0.0.1:{port}");
        let metrics = scrape_until(&poolscope, |m| {
            m.value(
                "poolscope_listen_queue_depth",
                &[("service", service), ("listener", &listener)],
            ) == Some(waiting)
                && m.value("poolscope_queue_depth", &[("service", service)]) == Some(waiting)
        });
        eprintln!("{backend}: {WAITING} connections in the backlog of a pod");
        let metrics = metrics?;
        scorecard::exact(
            "listen_queue_depth of a server in its own network namespace",
            "the 6 connections its kernel completed and it did not accept",
            backend,
            metrics
                .value(
                    "poolscope_listen_queue_depth",
                    &[("service", service), ("listener", &listener)],
                )
                .unwrap_or(f64::NAN),
            waiting,
        );
        // Read through the listener's fd (the pod's net/tcp tables have no limit).
        let limit = metrics.value(
            "poolscope_listen_queue_limit",
            &[("service", service), ("listener", &listener)],
        );
        assert_eq!(limit, Some(16.0), "the pod's listen(16)");
        // Accepted and unread: they leave the backlog and stay in the queue.
        assert_eq!(server.command(&format!("accept {WAITING}"))?, "ok");
        let metrics = scrape_until(&poolscope, |m| {
            m.value(
                "poolscope_listen_queue_depth",
                &[("service", service), ("listener", &listener)],
            ) == Some(0.0)
                && m.value("poolscope_connections_unserved", &[("service", service)])
                    == Some(waiting)
                && m.value("poolscope_queue_depth", &[("service", service)]) == Some(waiting)
        });
        metrics?;
        drop(clients);
        server.exit()?;
    }
    Ok(())
}

/// A watched server in a pod begins listening on a second port (no fork, no exec:
/// only the kernel's count of listen changes tells a rescan that the pod's listeners
/// it found before are stale) and 3 clients wait there: the new listener's backlog is
/// found, with its limit.
#[test]
fn a_pod_that_listens_again_is_found() -> anyhow::Result<()> {
    if !privileged("a_pod_that_listens_again_is_found") {
        return Ok(());
    }
    const WAITING: usize = 3;
    let _serial = one_at_a_time();
    for backend in backends() {
        let pod = Netns::new("relisten")?;
        let mut server = TestServer::start_in(&pod, 16)?;
        let service = "pod";
        let poolscope = Poolscope::start(&config(backend, &[(service, server.pid())]))?;
        let first = format!("127.0.0.1:{}", server.port);
        scrape_until(&poolscope, |m| {
            m.value(
                "poolscope_listen_queue_limit",
                &[("service", service), ("listener", &first)],
            ) == Some(16.0)
                && m.has_label("backend", backend)
        })?;
        // Two rescans (every 500 ms) with the pod's listeners known: the socket
        // backend reads no table (unless some socket on the host listens meanwhile)
        // and the open files of no process it saw before, the syscall backend (no
        // count of listen changes) the pod's tables and every process's files at each.
        let read = |m: &Metrics| {
            let counter = |name| m.value(name, &[]).unwrap_or(f64::NAN);
            (
                counter("poolscope_discovery_namespace_tables_read_total"),
                counter("poolscope_discovery_process_fds_read_total"),
            )
        };
        // Processes a scan reads (kernel threads have no exe and are skipped).
        let processes = fs::read_dir("/proc")?
            .filter_map(Result::ok)
            .filter(|entry| {
                entry
                    .file_name()
                    .to_str()
                    .is_some_and(|name| name.parse::<u32>().is_ok())
                    && fs::read_link(entry.path().join("exe")).is_ok()
            })
            .count() as f64;
        // A listen() elsewhere on the host is a change too: a window of two.
        let (mut quiet_tables, mut quiet_fds) = (f64::NAN, f64::NAN);
        for _ in 0..2 {
            let (tables, fds) = read(&poolscope.scrape()?);
            // The measurement window: two rescans' worth of quiet.
            std::thread::sleep(Duration::from_millis(1200));
            let (tables_after, fds_after) = read(&poolscope.scrape()?);
            (quiet_tables, quiet_fds) = (tables_after - tables, fds_after - fds);
            if quiet_tables == 0.0 {
                break;
            }
        }
        eprintln!(
            "{backend}: in 1.2 s of quiet rescans, namespace tables read: {quiet_tables}, \
             processes' open files read: {quiet_fds} (of {processes} processes)"
        );
        if backend != "syscall" {
            assert_eq!(quiet_tables, 0.0, "no listen change, no table read");
            // Only processes started meanwhile: fewer than one full read.
            assert!(
                quiet_fds < processes,
                "processes seen before were read again"
            );
        } else {
            assert!(
                quiet_tables >= 2.0,
                "the syscall backend reads them at each rescan"
            );
            assert!(
                quiet_fds >= processes,
                "the syscall backend reads every process at each rescan"
            );
        }
        let answer = server.command("listen 8")?;
        let port: u16 = answer
            .strip_prefix("port ")
            .and_then(|port| port.parse().ok())
            .with_context(|| format!("testserver answered {answer:?}"))?;
        let clients: Vec<TcpStream> = pod.run(move || {
            (0..WAITING)
                .map(|_| Ok(TcpStream::connect(("127.0.0.1", port))?))
                .collect()
        })?;
        let second = format!("127.0.0.1:{port}");
        let metrics = scrape_until(&poolscope, |m| {
            let labels = [("service", service), ("listener", second.as_str())];
            m.value("poolscope_listen_queue_depth", &labels) == Some(WAITING as f64)
                && m.value("poolscope_listen_queue_limit", &labels) == Some(8.0)
        });
        eprintln!(
            "{backend}: a second listener of a pod, {WAITING} waiting: found {}",
            metrics.is_ok()
        );
        metrics?;
        drop(clients);
        server.exit()?;
    }
    Ok(())
}

/// Pod B goes away (its server killed, its namespace deleted) while pod A serves
/// load and poolscope is scraped every 20 ms: every scrape answers, B's series leave,
/// no listen-queue read fails, and A's count stays exact.
#[test]
fn a_pod_that_vanishes_while_scraped() -> anyhow::Result<()> {
    if !privileged("a_pod_that_vanishes_while_scraped") {
        return Ok(());
    }
    for backend in backends() {
        let _serial = one_at_a_time();
        let (pod_a, pod_b) = (Netns::new("stays")?, Netns::new("vanishes")?);
        let server_a = PoolServer::start_in(&pod_a, PORT, 4, SERVICE)?;
        let server_b = PoolServer::start_in(&pod_b, PORT, 4, SERVICE)?;
        let mut poolscope = Poolscope::start(&config(
            backend,
            &[("stays", server_a.pid()), ("vanishes", server_b.pid())],
        ))?;
        let target = |m: &Metrics, service| m.value("poolscope_targets", &[("service", service)]);
        scrape_until(&poolscope, |m| {
            target(m, "stays") == Some(1.0)
                && target(m, "vanishes") == Some(1.0)
                && m.has_label("backend", backend)
        })?;
        let load = pod_a.run(|| Ok(ClosedLoop::start(PORT, 2, Connections::PerRequest)))?;
        let done = std::sync::atomic::AtomicBool::new(false);
        let scraped = std::sync::atomic::AtomicU32::new(0);
        let (scrapes, failures, sent) = std::thread::scope(|scope| {
            let scraper = scope.spawn(|| {
                let (mut scrapes, mut failures) = (0, Vec::new());
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    scrapes += 1;
                    match poolscope.scrape() {
                        Ok(_) => {
                            scraped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        Err(error) => failures.push(error.to_string()),
                    }
                    // The scrapes' pace.
                    std::thread::sleep(Duration::from_millis(20));
                }
                (scrapes, failures)
            });
            // B vanishes once A's load is counted and the scraper scrapes.
            let mut seen = None;
            let underway = wait_until(Duration::from_secs(10), || {
                seen = poolscope.scrape().ok().and_then(|m| requests(&m, "stays"));
                scraped.load(std::sync::atomic::Ordering::Relaxed) > 0
                    && seen.is_some_and(|counted| counted > 0.0)
            });
            drop(server_b);
            drop(pod_b);
            // A serves on while B's series leave: the load's duration.
            std::thread::sleep(SERVE_ON);
            let sent = load.stop().map(|seen| seen.completed);
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            let (scrapes, failures) = scraper.join().unwrap_or_default();
            let sent = sent.and_then(|sent| {
                anyhow::ensure!(
                    underway,
                    "within 10 s, no scrape answered or A's requests not counted: \
                     {} scrapes answered, A's requests_total {seen:?}",
                    scraped.load(std::sync::atomic::Ordering::Relaxed)
                );
                Ok(sent)
            });
            (scrapes, failures, sent)
        });
        let sent = sent?;
        let metrics = scrape_until(&poolscope, |m| {
            target(m, "vanishes").is_none() && requests(m, "stays") == Some(sent as f64)
        });
        eprintln!(
            "{backend}: {scrapes} scrapes while pod B vanished, {} failed; A sent {sent}, \
             counted {:?}",
            failures.len(),
            metrics.as_ref().ok().and_then(|m| requests(m, "stays"))
        );
        metrics?;
        assert!(failures.is_empty(), "{failures:?}");
        assert_eq!(server_a.finish()?.count, sent);
        let log = poolscope.stop_and_log();
        assert!(!log.contains("reading listen queues failed"), "{log}");
    }
    Ok(())
}
