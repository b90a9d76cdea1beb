//! Full rate on both CPUs, where the races a quiet test never meets show: every
//! program that changes a service's counters runs on both CPUs at once, in process
//! context and in the softirqs that interrupt it. nginx with 2 workers and Go's
//! net/http (whose goroutines read a request on one thread and may answer it on
//! another) are each loaded at once by wrk over keep-alive connections and by wrk
//! asking for a connection per request (`Connection: close`), on every backend. At
//! the end every count equals the server's own (nginx's access log, the Go server's
//! count of its answers), and once every connection has closed every gauge reads
//! exactly 0, and so does every thread's count of the requests it serves: a lost
//! update leaves one off for good. The events lost are printed.
//!
//! `POOLSCOPE_STRESS_SECONDS` sets each backend's load time (default
//! [`DEFAULT_SECONDS`], CI's short run); `cargo xtask stress --seconds N` sets it.
use std::time::Duration;

use poolscope_tests::{
    Metrics, Poolscope, backends, free_port, one_at_a_time, parse_debug_threads, privileged,
    scrape_until,
    servers::{Kind, Options, RealServer, WrkResult, wrk, wrk_closing},
};

/// Each backend's load time in CI (`cargo xtask test`): 3 backends of it and the
/// settling fit in 2 minutes.
const DEFAULT_SECONDS: u64 = 20;
/// wrk's keep-alive connections and its connections of one request each, per server.
const KEEP_ALIVE: u32 = 128;
const CLOSING: u32 = 16;
/// The gauges that must read 0 once every connection has closed.
const GAUGES: [&str; 5] = [
    "poolscope_requests_in_flight",
    "poolscope_requests_waiting",
    "poolscope_connections_unserved",
    "poolscope_queue_depth",
    "poolscope_pool_threads_busy",
];

fn load_time() -> anyhow::Result<Duration> {
    let seconds = match std::env::var("POOLSCOPE_STRESS_SECONDS") {
        Ok(text) => text.parse().map_err(|_| {
            anyhow::anyhow!("POOLSCOPE_STRESS_SECONDS={text:?} is no number of seconds")
        })?,
        Err(_) => DEFAULT_SECONDS,
    };
    Ok(Duration::from_secs(seconds))
}

/// One server under load: what it is, the service poolscope names it, the server.
struct Loaded {
    name: &'static str,
    service: String,
    server: RealServer,
}

/// A server's two loads at once, for `time`: wrk over keep-alive connections, and wrk
/// over connections of one request each.
fn load(
    port: u16,
    time: Duration,
) -> std::thread::JoinHandle<anyhow::Result<(WrkResult, WrkResult)>> {
    std::thread::spawn(move || {
        let closing = std::thread::spawn(move || wrk_closing(port, 1, CLOSING, time));
        let kept = wrk(port, 1, KEEP_ALIVE, time)?;
        let closing = closing
            .join()
            .map_err(|_| anyhow::anyhow!("the closing wrk's thread panicked"))??;
        Ok((kept, closing))
    })
}

#[test]
fn full_rate_on_both_cpus_counts_every_request_and_every_gauge_returns_to_zero()
-> anyhow::Result<()> {
    let test = "full_rate_on_both_cpus_counts_every_request_and_every_gauge_returns_to_zero";
    if !privileged(test) {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let time = load_time()?;
    let mut failures = Vec::new();
    let mut table = vec![
        "| backend | server | wrk keep-alive + closing | the server's count | requests_total | \
         gauges after (in flight, waiting, unserved, queue depth, busy threads) | events lost \
         | recount corrections (recounts) |"
            .to_owned(),
        "|---|---|---|---|---|---|---|---|".to_owned(),
    ];
    for backend in backends() {
        let counted = Options {
            access_log: true,
            ..Options::default()
        };
        let nginx_options = Options {
            workers: Some(2),
            ..counted.clone()
        };
        let servers = [
            Loaded {
                name: "nginx (2 workers)",
                service: format!("stress-nginx-{backend}"),
                server: RealServer::start_with(Kind::Nginx, free_port()?, &nginx_options)?,
            },
            Loaded {
                name: "Go net/http",
                service: format!("stress-go-{backend}"),
                server: RealServer::start_with(Kind::Go, free_port()?, &counted)?,
            },
        ];
        let mut config = format!(
            "[probes]\nbackend = \"{backend}\"\n[discovery]\nrescan_interval = \"500ms\"\n"
        );
        for loaded in &servers {
            let pids: Vec<String> = loaded.server.pids().iter().map(u32::to_string).collect();
            config += &format!(
                "[[targets]]\nservice = \"{}\"\npids = [{}]\n",
                loaded.service,
                pids.join(", ")
            );
        }
        let poolscope = Poolscope::start(&config)?;
        scrape_until(&poolscope, |metrics| {
            servers.iter().all(|loaded| {
                metrics.value("poolscope_targets", &[("service", &loaded.service)])
                    == Some(loaded.server.pids().len() as f64)
            }) && metrics.has_label("backend", backend)
        })?;
        let before = poolscope.scrape()?;
        let lost_before = lost(&before);
        // The servers counted their readiness check's request, made before poolscope.
        let logged_before: Vec<u64> = servers
            .iter()
            .map(|loaded| answered_ok(&loaded.server))
            .collect::<anyhow::Result<_>>()?;
        let loads: Vec<_> = servers
            .iter()
            .map(|loaded| load(loaded.server.port(), time))
            .collect();
        let mut answered = Vec::new();
        for handle in loads {
            answered.push(
                handle
                    .join()
                    .map_err(|_| anyhow::anyhow!("a load's thread panicked"))??,
            );
        }
        for ((loaded, (kept, closing)), logged_before) in
            servers.iter().zip(&answered).zip(logged_before)
        {
            let service = loaded.service.as_str();
            let closed = |metrics: &Metrics| {
                GAUGES
                    .iter()
                    .all(|gauge| summed(metrics, gauge, service) == 0.0)
            };
            // Every connection closes (or the last scrape, read below, says which gauge
            // did not return to 0): only then has the server answered and logged
            // every request wrk sent before it closed.
            let _ = scrape_until(&poolscope, closed);
            // The Go server rewrites its count every 20 ms.
            std::thread::sleep(Duration::from_millis(100));
            let truth = answered_ok(&loaded.server)? - logged_before;
            let requests = |metrics: &Metrics| {
                counter(metrics, "poolscope_requests_total", service)
                    - counter(&before, "poolscope_requests_total", service)
            };
            let settled = scrape_until(&poolscope, |metrics| {
                requests(metrics) >= truth as f64 && closed(metrics)
            });
            let recounts = |metrics: &Metrics| {
                metrics
                    .value("poolscope_recounts_total", &[("result", "done")])
                    .unwrap_or(0.0)
            };
            // Still after the load, the service is recounted against its live
            // connections (a second after, at most 5 s after the last recount): a
            // gauge that drifted under the load is then corrected, and counted.
            let recounted = settled.is_ok()
                && scrape_until(&poolscope, |metrics| recounts(metrics) > recounts(&before))
                    .is_ok();
            let metrics = poolscope.scrape()?;
            let counted = requests(&metrics);
            let gauges: Vec<f64> = GAUGES
                .iter()
                .map(|gauge| summed(&metrics, gauge, service))
                .collect();
            let lost_now = lost(&metrics);
            let lost_here: Vec<String> = lost_now
                .iter()
                .filter_map(|(source, value)| {
                    let before = lost_before
                        .iter()
                        .find(|(other, _)| other == source)
                        .map_or(0.0, |(_, value)| *value);
                    (*value > before).then(|| format!("{source} +{}", value - before))
                })
                .collect();
            // Over the whole poolscope: both servers' services so far.
            let corrected: Vec<String> = metrics
                .matching("poolscope_recount_corrections_total", &[])
                .filter(|(_, value)| *value != 0.0)
                .map(|(labels, value)| format!("{labels:?} {value}"))
                .collect();
            let recounts = recounts(&metrics) - recounts(&before);
            table.push(format!(
                "| {backend} | {} | {} + {} | {truth} | {counted} | {gauges:?} | {} | {} ({recounts}) |",
                loaded.name,
                kept.requests,
                closing.requests,
                if lost_here.is_empty() {
                    "-".to_owned()
                } else {
                    lost_here.join(", ")
                },
                if corrected.is_empty() {
                    "none".to_owned()
                } else {
                    corrected.join(", ")
                }
            ));
            let what = format!("{backend}, {}", loaded.name);
            if !recounted {
                failures.push(format!("{what}: no recount after the load"));
            }
            if !corrected.is_empty() {
                failures.push(format!(
                    "{what}: a recount corrected a gauge (an update the kernel lost): {corrected:?}"
                ));
            }
            if counted != truth as f64 {
                failures.push(format!("{what}: requests_total +{counted}, truth {truth}"));
            }
            // A thread's count of the requests it serves is changed by other threads
            // too (a request read on one thread and answered on another): a lost
            // update would leave it serving for good.
            let threads = parse_debug_threads(&poolscope.get("/debug/threads")?)?;
            let serving: Vec<(u32, u32)> = threads
                .iter()
                .filter(|row| row.service == service && row.serving != 0)
                .map(|row| (row.tid, row.serving))
                .collect();
            if !serving.is_empty() {
                failures.push(format!(
                    "{what}: threads (tid, requests) still serving after every connection \
                     closed: {serving:?}"
                ));
            }
            for (gauge, value) in GAUGES.iter().zip(&gauges) {
                if *value != 0.0 {
                    failures.push(format!(
                        "{what}: {gauge} reads {value} after every connection closed"
                    ));
                }
            }
        }
    }
    eprintln!(
        "load {} s per backend\n{}",
        time.as_secs(),
        table.join("\n")
    );
    anyhow::ensure!(failures.is_empty(), "{}", failures.join("\n"));
    Ok(())
}

/// Requests the server says it answered `200`.
fn answered_ok(server: &RealServer) -> anyhow::Result<u64> {
    Ok(server.statuses()?.get(&200).copied().unwrap_or(0))
}

/// `service`'s counter `name`, 0 before its first sample.
fn counter(metrics: &Metrics, name: &str, service: &str) -> f64 {
    metrics.value(name, &[("service", service)]).unwrap_or(0.0)
}

/// The sum of `service`'s series `name` (over its pools, for the pool gauges).
fn summed(metrics: &Metrics, name: &str, service: &str) -> f64 {
    metrics.sum(name, &[("service", service)])
}

/// `poolscope_events_lost_total` by source.
fn lost(metrics: &Metrics) -> Vec<(String, f64)> {
    metrics
        .matching("poolscope_events_lost_total", &[])
        .filter_map(|(labels, value)| {
            let source = labels.iter().find(|(key, _)| key == "source")?;
            Some((source.1.clone(), value))
        })
        .collect()
}
