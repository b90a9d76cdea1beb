//! Ground truth for the Foundation metrics, against the real kernel: a server whose
//! backlog, accepts and reads the test controls, watched by a real poolscope.
use std::{io::Write as _, net::TcpStream, time::Duration};

use poolscope_tests::{
    Poolscope, TCP_HTTP2_PROBES, TestServer, backend_config, backends, pids_config, privileged,
    scorecard, scrape_until, tcp_follows_http2,
};

/// A testserver watched (by pid) as `service`, once poolscope reports it.
fn watched_server(service: &str) -> anyhow::Result<(TestServer, Poolscope)> {
    watched_server_on("auto", service)
}

/// Like [`watched_server`], with the request backend forced.
fn watched_server_on(backend: &str, service: &str) -> anyhow::Result<(TestServer, Poolscope)> {
    let server = TestServer::start(64)?;
    let poolscope = Poolscope::start(&backend_config(backend, service, &[server.pid()]))?;
    scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", service)]) == Some(1.0)
    })?;
    Ok((server, poolscope))
}

#[test]
fn listen_queue_depth_counts_clients_waiting_for_accept() -> anyhow::Result<()> {
    if !privileged("listen_queue_depth_counts_clients_waiting_for_accept") {
        return Ok(());
    }
    for backend in backends() {
        listen_queue_depth_on(backend)?;
    }
    Ok(())
}

fn listen_queue_depth_on(backend: &str) -> anyhow::Result<()> {
    const BACKLOG: u32 = 16;
    const CLIENTS: usize = 5;
    let server = TestServer::start(BACKLOG)?;
    let poolscope = Poolscope::start(&backend_config(backend, "backlog", &[server.pid()]))?;
    let listener = format!("127.0.0.1:{}", server.port);
    let labels = [("service", "backlog"), ("listener", listener.as_str())];

    let metrics = scrape_until(&poolscope, |m| {
        m.value("poolscope_listen_queue_depth", &labels) == Some(0.0)
    })?;
    assert_eq!(
        metrics.value("poolscope_listen_queue_limit", &labels),
        Some(f64::from(BACKLOG))
    );

    // The kernel completes each handshake and queues it; nobody accepts.
    let clients: Vec<TcpStream> = (0..CLIENTS)
        .map(|_| server.connect())
        .collect::<Result<_, _>>()?;
    let metrics = scrape_until(&poolscope, |m| {
        m.value("poolscope_listen_queue_depth", &labels) == Some(CLIENTS as f64)
    })?;
    assert_eq!(
        metrics.value("poolscope_listen_queue_limit", &labels),
        Some(f64::from(BACKLOG))
    );
    let service = [("service", "backlog")];
    assert_eq!(
        metrics.value("poolscope_queue_depth", &service),
        Some(CLIENTS as f64),
        "{backend}: the backlog is part of the queue"
    );
    scorecard::exact(
        "listen_queue_depth and queue_depth, connections waiting for accept",
        "the 5 connections the kernel completed and the server did not accept",
        backend,
        metrics
            .value("poolscope_queue_depth", &service)
            .unwrap_or(f64::NAN),
        CLIENTS as f64,
    );
    assert_eq!(
        metrics.value("poolscope_connections_unserved", &service),
        Some(0.0),
        "{backend}: not accepted yet"
    );
    // The socket and tcp backends count a connection when the kernel completes its
    // handshake (they see no accept call); the syscall backend when accept returns it.
    let accepted = if backend == "syscall" { 0 } else { CLIENTS };
    assert_eq!(
        metrics.value("poolscope_connections_accepted_total", &service),
        Some(accepted as f64),
        "{backend}"
    );
    drop(clients);
    Ok(())
}

#[test]
fn unserved_connections_until_the_server_reads() -> anyhow::Result<()> {
    if !privileged("unserved_connections_until_the_server_reads") {
        return Ok(());
    }
    for backend in backends() {
        unserved_connections_on(backend)?;
    }
    Ok(())
}

fn unserved_connections_on(backend: &str) -> anyhow::Result<()> {
    const CLIENTS: usize = 4;
    let (mut server, poolscope) = watched_server_on(backend, "unserved")?;
    let service = [("service", "unserved")];

    let mut clients: Vec<TcpStream> = (0..CLIENTS)
        .map(|_| server.connect())
        .collect::<Result<_, _>>()?;
    assert_eq!(server.command(&format!("accept {CLIENTS}"))?, "ok");
    let metrics = scrape_until(&poolscope, |m| {
        m.value("poolscope_connections_unserved", &service) == Some(CLIENTS as f64)
    })?;
    assert_eq!(
        metrics.value("poolscope_connections_accepted_total", &service),
        Some(CLIENTS as f64)
    );
    assert_eq!(
        metrics.value("poolscope_queue_depth", &service),
        Some(CLIENTS as f64)
    );
    scorecard::exact(
        "connections_unserved and queue_depth, connections accepted with nothing read",
        "the 4 connections the server accepted and has not read from",
        backend,
        metrics
            .value("poolscope_connections_unserved", &service)
            .unwrap_or(f64::NAN),
        CLIENTS as f64,
    );
    if backend == "syscall" {
        let calls = |syscall| {
            metrics
                .value(
                    "poolscope_syscalls_total",
                    &[("service", "unserved"), ("syscall", syscall)],
                )
                .unwrap_or(0.0)
        };
        assert_eq!(
            calls("accept4") + calls("accept"),
            CLIENTS as f64,
            "one accept call per connection"
        );
    }

    for client in &mut clients {
        client.write_all(b"GET / HTTP/1.0\r\n\r\n")?;
    }
    assert_eq!(server.command("read")?, "ok");
    let metrics = scrape_until(&poolscope, |m| {
        m.value("poolscope_connections_unserved", &service) == Some(0.0)
    })?;
    assert_eq!(
        metrics.value("poolscope_connections_accepted_total", &service),
        Some(CLIENTS as f64)
    );
    // Read and not answered: in flight, no longer queued.
    assert_eq!(
        metrics.value("poolscope_requests_in_flight", &service),
        Some(CLIENTS as f64),
        "{backend}"
    );
    assert_eq!(metrics.value("poolscope_queue_depth", &service), Some(0.0));
    Ok(())
}

#[test]
fn closed_unserved_connections_leave_the_gauge_and_the_map() -> anyhow::Result<()> {
    if !privileged("closed_unserved_connections_leave_the_gauge_and_the_map") {
        return Ok(());
    }
    let (mut server, poolscope) = watched_server("closer")?;
    let service = [("service", "closer")];
    let clients: Vec<TcpStream> = (0..3).map(|_| server.connect()).collect::<Result<_, _>>()?;
    assert_eq!(server.command("accept 3")?, "ok");
    scrape_until(&poolscope, |m| {
        m.value("poolscope_connections_unserved", &service) == Some(3.0)
    })?;
    // The process exits without closing its fds one by one: the purge must catch them.
    server.exit()?;
    drop(clients);
    // The purge runs when the exit event arrives; the map then holds nothing.
    scrape_until(&poolscope, |m| {
        !m.has_label("service", "closer") && m.connection_entries() == Some(0.0)
    })?;
    Ok(())
}

#[test]
fn forked_children_count_under_the_parent_service() -> anyhow::Result<()> {
    if !privileged("forked_children_count_under_the_parent_service") {
        return Ok(());
    }
    let (mut server, poolscope) = watched_server("forky")?;
    let service = [("service", "forky")];

    let answer = server.command("fork")?;
    assert!(answer.starts_with("child "), "{answer}");
    scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &service) == Some(2.0)
    })?;
    // Only the child accepts: its accepts must be counted under the parent's service.
    let clients: Vec<TcpStream> = (0..3).map(|_| server.connect()).collect::<Result<_, _>>()?;
    scrape_until(&poolscope, |m| {
        m.value("poolscope_connections_accepted_total", &service) == Some(3.0)
    })?;
    drop(clients);
    Ok(())
}

#[test]
fn series_of_an_exited_process_go_away_within_two_scrapes() -> anyhow::Result<()> {
    if !privileged("series_of_an_exited_process_go_away_within_two_scrapes") {
        return Ok(());
    }
    let (server, poolscope) = watched_server("ephemeral")?;
    server.exit()?;
    // The contract says within two scrapes; the kernel drops the process at exit, so
    // the very next scrape already goes without it.
    let first = poolscope.scrape()?;
    assert!(
        !first.has_label("service", "ephemeral"),
        "series still there after exit:\n{}",
        first.text
    );
    // And they stay gone: a second (two rescans) for them to come back in, which they
    // may not; a measurement window, not a wait.
    std::thread::sleep(Duration::from_secs(1));
    assert!(!poolscope.scrape()?.has_label("service", "ephemeral"));
    Ok(())
}

#[test]
fn auto_discovery_finds_a_listening_process_by_comm() -> anyhow::Result<()> {
    if !privileged("auto_discovery_finds_a_listening_process_by_comm") {
        return Ok(());
    }
    let server = TestServer::start(32)?;
    let poolscope = Poolscope::start("[discovery]\nrescan_interval = \"500ms\"\n")?;
    let listener = format!("127.0.0.1:{}", server.port);
    let metrics = scrape_until(&poolscope, |m| {
        m.value(
            "poolscope_listen_queue_limit",
            &[("service", "testserver"), ("listener", listener.as_str())],
        ) == Some(32.0)
    })?;
    assert!(
        !metrics
            .text
            .contains(&format!("listener=\"127.0.0.1:{}\"", poolscope.port)),
        "poolscope must not watch itself"
    );
    Ok(())
}

#[test]
fn metrics_pass_promtool_lint() -> anyhow::Result<()> {
    if !privileged("metrics_pass_promtool_lint") {
        return Ok(());
    }
    let mut server = TestServer::start(8)?;
    let poolscope = Poolscope::start(&pids_config("lint \"quoted\" \\ name", &[server.pid()]))?;
    let _client = server.connect()?;
    assert_eq!(server.command("accept 1")?, "ok");
    let metrics = scrape_until(&poolscope, |m| {
        m.value("poolscope_connections_accepted_total", &[])
            .is_some()
    })?;
    poolscope_tests::prometheus::check_metrics(&metrics.text)
}

#[test]
fn an_exec_is_discovered_without_waiting_for_a_rescan() -> anyhow::Result<()> {
    if !privileged("an_exec_is_discovered_without_waiting_for_a_rescan") {
        return Ok(());
    }
    // Periodic rescans effectively off: only the exec event can find the server, and
    // only a listener unknown to the last scan can find its socket (opened after exec).
    let poolscope = Poolscope::start(
        "[discovery]\nrescan_interval = \"1h\"\n[[targets]]\nservice = \"late\"\ncomm = \"^testserver$\"\n",
    )?;
    let server = TestServer::start(8)?;
    let listener = format!("127.0.0.1:{}", server.port);
    scrape_until(&poolscope, |m| {
        m.value(
            "poolscope_listen_queue_limit",
            &[("service", "late"), ("listener", listener.as_str())],
        ) == Some(8.0)
    })?;
    Ok(())
}

/// Every kernel program loads and attaches on this kernel, with each backend it has
/// and the lock probes on: a program the verifier refuses is skipped and only
/// degrades poolscope, so the other tests may pass without it (a change once made
/// the verifier refuse `process_exit` on 6.18 while they all passed).
#[test]
fn every_probe_attaches_on_this_kernel() -> anyhow::Result<()> {
    if !privileged("every_probe_attaches_on_this_kernel") {
        return Ok(());
    }
    for backend in backends() {
        let server = TestServer::start(64)?;
        let config = format!(
            "[probes]\nbackend = \"{backend}\"\nlock_uprobes = [\"probed\"]\n{}",
            pids_config("probed", &[server.pid()])
        );
        let poolscope = Poolscope::start(&config)?;
        let metrics = scrape_until(&poolscope, |m| {
            m.value("poolscope_lock_uprobe_processes", &[]) == Some(1.0)
        })?;
        let attached: Vec<(&str, f64)> = metrics
            .samples
            .iter()
            .filter(|s| s.name == "poolscope_probe_attached")
            .map(|s| {
                let probe = s.labels.iter().find(|(k, _)| k == "probe");
                (probe.map_or("?", |(_, v)| v.as_str()), s.value)
            })
            .collect();
        println!("{backend} backend: {attached:?}");
        // The tcp backend's HTTP/2 probes attach where the kernel has fexit (they
        // must where the tests are told so); elsewhere both are skipped, with the
        // reason that says why, and nothing else is.
        let http2_hooks = |(name, _): &&(&str, f64)| TCP_HTTP2_PROBES.contains(name);
        let hooks: Vec<f64> = attached
            .iter()
            .filter(http2_hooks)
            .map(|&(_, up)| up)
            .collect();
        let hooks_skipped = backend == "tcp" && !tcp_follows_http2() && hooks == [0.0, 0.0];
        if backend == "tcp" {
            assert!(
                hooks == [1.0, 1.0] || hooks_skipped,
                "tcp: HTTP/2 probes {hooks:?} (both attached, or both skipped where \
                 POOLSCOPE_TEST_TCP_HTTP2 is unset)"
            );
        }
        let skipped: Vec<&str> = metrics
            .text
            .lines()
            .filter(|l| l.starts_with("poolscope_probe_skipped{"))
            .filter(|l| !(hooks_skipped && l.contains("reason=\"no_http2_hooks\"")))
            .collect();
        assert!(skipped.is_empty(), "{backend}: {skipped:?}");
        let attached: Vec<(&str, f64)> = attached
            .into_iter()
            .filter(|probe| !(hooks_skipped && http2_hooks(&probe)))
            .collect();
        assert!(attached.len() >= 8, "{backend}: {attached:?}");
        // Where the kernel counts run-queue waits itself (CONFIG_SCHED_INFO, which
        // /proc/<pid>/schedstat stands for), they are read from it and the wakeup
        // program is not attached; otherwise it times them.
        let kernel_counts_waits = std::path::Path::new("/proc/self/schedstat").exists();
        let has = |probe: &str| attached.iter().any(|(name, _)| *name == probe);
        assert!(has("sched/sched_switch"), "{backend}: {attached:?}");
        assert_eq!(
            has("sched/sched_wakeup"),
            !kernel_counts_waits,
            "{backend}: {attached:?}"
        );
        assert!(
            attached.iter().all(|(_, up)| *up == 1.0),
            "{backend}: {attached:?}"
        );
        assert_eq!(metrics.value("poolscope_degraded", &[]), Some(0.0));
    }
    Ok(())
}
