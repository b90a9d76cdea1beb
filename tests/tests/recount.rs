//! The gauges' recount: a counter update lost in the kernel (made here by changing
//! poolscope's per-service counters behind its back, as a lost update leaves them)
//! shows in its gauge until the service's counters stand still, then the recount of
//! the live connection state puts it back and counts it in
//! `poolscope_recount_corrections_total`, on every backend. Truth: nothing is connected
//! (every gauge 0), then one request held by the server (in flight 1, by the server's
//! own pool of one worker and its service time).
use std::{
    io::{Read as _, Write as _},
    mem::offset_of,
    net::TcpStream,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use poolscope_shared::{ServiceCounters, maps};
use poolscope_tests::{
    Metrics, PoolServer, Poolscope, backend_config, backends, kernel_maps::add_to_per_cpu,
    one_at_a_time, privileged, scorecard, scrape_until,
};

/// How long the server takes per request: long enough for a recount while one is
/// in flight (recounts are at least `MIN_INTERVAL`, 5 s, apart).
const SERVICE: Duration = Duration::from_secs(7);
/// The service's id, its index in `SERVICE_COUNTERS`: poolscope numbers services
/// from 0, and this poolscope watches one.
const SERVICE_ID: u32 = 0;
/// How long a recount may take to come: the scrape after the counters stood still,
/// at most `MIN_INTERVAL` (5 s) after the last recount.
const RECOUNT_WITHIN: Duration = Duration::from_secs(15);

/// One request on its own connection, closed once answered.
fn request(port: u16) -> anyhow::Result<()> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.write_all(b"req\n")?;
    let mut answer = [0u8; 3];
    stream.read_exact(&mut answer)?;
    anyhow::ensure!(&answer == b"ok\n", "answer {answer:?}");
    Ok(())
}

fn gauge(metrics: &Metrics, name: &str, service: &str) -> f64 {
    metrics
        .value(name, &[("service", service)])
        .unwrap_or(f64::NAN)
}

fn corrected(metrics: &Metrics, gauge: &str) -> f64 {
    metrics
        .value("poolscope_recount_corrections_total", &[("gauge", gauge)])
        .unwrap_or(f64::NAN)
}

fn lost_updates_are_recounted(backend: &str) -> anyhow::Result<()> {
    let _serial = one_at_a_time();
    let service = format!("recount-{backend}");
    let server = PoolServer::start(1, SERVICE)?;
    let mut poolscope = Poolscope::start(&backend_config(backend, &service, &[server.pid()]))?;
    poolscope.expect_corrections();
    scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", &service)]) == Some(1.0)
    })?;
    let port = server.port;
    // Two `left` of waiting lost, one `left` of serving counted twice.
    add_to_per_cpu(
        poolscope.pid(),
        maps::SERVICE_COUNTERS,
        SERVICE_ID,
        offset_of!(ServiceCounters, waiting_entered),
        2,
    )?;
    add_to_per_cpu(
        poolscope.pid(),
        maps::SERVICE_COUNTERS,
        SERVICE_ID,
        offset_of!(ServiceCounters, serving_left),
        1,
    )?;
    // The next scrape finds the counters moved: no recount yet, the drift shows.
    let drifted = poolscope.scrape()?;
    anyhow::ensure!(
        gauge(&drifted, "poolscope_requests_waiting", &service) == 2.0,
        "{service}: requests_waiting {} after two lost updates, not 2",
        gauge(&drifted, "poolscope_requests_waiting", &service)
    );
    let start = Instant::now();
    let recounted = scrape_until(&poolscope, |m| {
        corrected(m, "requests_waiting") == 2.0 && corrected(m, "requests_in_flight") == 1.0
    })
    .with_context(|| format!("{service}: no recount corrected the gauges"))?;
    let took = start.elapsed();
    anyhow::ensure!(
        took <= RECOUNT_WITHIN,
        "{service}: the recount took {took:?}"
    );
    let waiting = gauge(&recounted, "poolscope_requests_waiting", &service);
    anyhow::ensure!(
        waiting == 0.0,
        "{service}: requests_waiting {waiting} after the recount"
    );
    for gauge_name in ["connections_unserved", "http2_connections_at_stream_limit"] {
        let moved = corrected(&recounted, gauge_name);
        anyhow::ensure!(moved == 0.0, "{service}: {gauge_name} corrected by {moved}");
    }

    // One request held by the server's one worker: in flight 1, which the extra
    // `left` would have hidden, and which a recount while it is held counts live.
    let held = std::thread::spawn(move || request(port));
    let recounts = |m: &Metrics| {
        m.value("poolscope_recounts_total", &[("result", "done")])
            .unwrap_or(0.0)
    };
    let before_held = recounts(&recounted);
    let during = scrape_until(&poolscope, |m| {
        gauge(m, "poolscope_requests_in_flight", &service) == 1.0 && recounts(m) > before_held
    })
    .with_context(|| format!("{service}: the held request is not in flight through a recount"))?;
    held.join()
        .map_err(|_| anyhow::anyhow!("the client panicked"))??;
    let after = scrape_until(&poolscope, |m| {
        m.value("poolscope_requests_total", &[("service", &service)]) == Some(1.0)
            && gauge(m, "poolscope_requests_in_flight", &service) == 0.0
    })?;
    println!(
        "{backend}: after the lost updates requests_waiting {} (truth 0); recounted in \
         {took:?}: waiting {waiting}, corrections waiting {} in flight {}; a held request \
         in flight {} through recount {}, then {}",
        gauge(&drifted, "poolscope_requests_waiting", &service),
        corrected(&recounted, "requests_waiting"),
        corrected(&recounted, "requests_in_flight"),
        gauge(&during, "poolscope_requests_in_flight", &service),
        recounts(&during),
        gauge(&after, "poolscope_requests_in_flight", &service),
    );
    scorecard::exact(
        "requests_waiting and requests_in_flight after lost counter updates, recounted",
        "no connection open, then one request the server's one worker holds",
        backend,
        waiting + gauge(&during, "poolscope_requests_in_flight", &service),
        1.0,
    );
    // No recount moved anything more: the held request was counted live.
    anyhow::ensure!(
        corrected(&after, "requests_in_flight") == 1.0
            && corrected(&after, "requests_waiting") == 2.0,
        "{service}: later recounts corrected again"
    );
    anyhow::ensure!(
        after.value("poolscope_recounts_total", &[("result", "failed")]) == Some(0.0),
        "{service}: a recount failed"
    );
    server.finish()?;
    Ok(())
}

#[test]
fn lost_counter_updates_are_recounted_on_every_backend() {
    if !privileged("lost_counter_updates_are_recounted_on_every_backend") {
        return;
    }
    let failures: Vec<String> = backends()
        .into_iter()
        .filter_map(|backend| {
            lost_updates_are_recounted(backend)
                .err()
                .map(|error| format!("{backend}: {error:#}"))
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
