//! No lost transitions: a connection's phase is changed by events on several CPUs at
//! once (an arrival in the client's softirq; the server thread's read and write), and
//! each phase change moves one pair of gauge counters. Driven by `spinserver`, whose
//! connection thread spins on non-blocking reads on the last CPU, and a client on CPU
//! 0 that keeps up to 4 requests in flight on one keep-alive connection (pipelined):
//! each arrival races the server's read and write of the request before it, hundreds
//! of thousands of times. Once the connection is closed, every gauge must be back at
//! 0 with no event dropped. Before phase changes were compare-and-swaps, two runs of
//! this test left `requests_waiting` at 2 and 4 on one closed connection.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{Shutdown, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use poolscope_tests::{
    Poolscope, Program, backend_config, backends, one_at_a_time, pin_to, privileged, scrape_until,
};

const RUN: Duration = Duration::from_secs(10);
/// Requests in flight on the connection.
const DEPTH: u64 = 4;

/// Sends `req\n` for `RUN` with up to `DEPTH` unanswered, from CPU 0, then shuts its
/// side down; reads every answer until the server closes. Returns the requests sent
/// once each was answered.
fn pipelining_client(port: u16) -> anyhow::Result<u64> {
    pin_to(0)?;
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_nodelay(true)?;
    // A lost answer fails the test instead of hanging it.
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let answered = Arc::new(AtomicU64::new(0));
    let answers = answered.clone();
    let sender = std::thread::spawn(move || -> anyhow::Result<u64> {
        pin_to(0)?;
        let started = Instant::now();
        let mut sent = 0;
        while started.elapsed() < RUN {
            if sent - answers.load(Ordering::Relaxed) < DEPTH {
                writer.write_all(b"req\n")?;
                sent += 1;
            } else {
                std::thread::yield_now();
            }
        }
        // The server answers what it has and closes: the reader's end of the stream.
        writer.shutdown(Shutdown::Write)?;
        Ok(sent)
    });
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            break;
        }
        anyhow::ensure!(line == "ok\n", "answer {line:?}");
        answered.fetch_add(1, Ordering::Relaxed);
    }
    let sent = sender
        .join()
        .map_err(|_| anyhow::anyhow!("the sender panicked"))??;
    let answered = answered.load(Ordering::Relaxed);
    anyhow::ensure!(answered == sent, "{sent} sent, {answered} answered");
    Ok(sent)
}

const GAUGES: [&str; 3] = [
    "poolscope_connections_unserved",
    "poolscope_requests_waiting",
    "poolscope_requests_in_flight",
];

#[test]
fn pipelined_requests_racing_on_two_cpus_leave_no_gauge_behind() -> anyhow::Result<()> {
    if !privileged("pipelined_requests_racing_on_two_cpus_leave_no_gauge_behind") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    for backend in backends() {
        let mut server = Program::start("spinserver", &[])?;
        let port: u16 = server.line("port")?.parse()?;
        let service = format!("race-{backend}");
        let poolscope = Poolscope::start(&backend_config(backend, &service, &[server.pid()]))?;
        scrape_until(&poolscope, |m| {
            m.value("poolscope_targets", &[("service", &service)]) == Some(1.0)
        })?;
        let sent = std::thread::spawn(move || pipelining_client(port))
            .join()
            .map_err(|_| anyhow::anyhow!("the client panicked"))??;
        let labels = [("service", service.as_str())];
        let settled = scrape_until(&poolscope, |m| {
            m.value("poolscope_requests_total", &labels)
                .is_some_and(|total| total > 0.0)
                && GAUGES
                    .iter()
                    .all(|gauge| m.value(gauge, &labels) == Some(0.0))
        });
        let metrics = poolscope.scrape()?;
        let mut values: Vec<_> = std::iter::once("poolscope_requests_total")
            .chain(GAUGES)
            .map(|name| (name, metrics.value(name, &labels)))
            .collect();
        let retries = metrics.value(
            "poolscope_events_lost_total",
            &[("source", "phase_retries")],
        );
        values.push(("phase_retries", retries));
        // Pipelined requests count one per read burst (docs/limits.md): fewer than sent.
        eprintln!("{backend}: {sent} pipelined requests sent; {values:?}");
        anyhow::ensure!(
            settled.is_ok() && retries == Some(0.0),
            "{backend}: after {sent} pipelined requests and the close: {values:?}"
        );
        drop(server);
    }
    Ok(())
}
