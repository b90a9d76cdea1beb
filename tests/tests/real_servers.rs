//! Fidelity against real servers from Debian packages, driven by `wrk --latency`:
//! poolscope's request count must match wrk's to 1 %, and its latency quantiles must
//! not exceed wrk's by more than 5 % (wrk adds the client side on top of ours). The
//! socket backend sees arrivals, so its median must also be at least 0.3 of wrk's
//! (0.44–0.91 measured; without arrivals it would be ~0.05–0.09, the syscall case);
//! the syscall backend cannot see a keep-alive request wait (docs/limits.md), so its latency
//! is its service time. The goal "within 25 % below wrk" is reported, not asserted:
//! on two shared vCPUs wrk's own tail is mostly client-side (see the issue note).
//! Every answer wrk reads is a 2xx, and poolscope must count them so
//! (`responses_total`) to the same 1 %.
//! Each server runs on both backends; the table goes to stderr (`--nocapture`).
use std::time::Duration;

use poolscope_tests::{
    Metrics, Poolscope, backend_config, backends, free_port, one_at_a_time, privileged, scorecard,
    servers::{Kind, RealServer, pin_to_first_cpu, wrk},
    wait_until,
};

const LOAD: Duration = Duration::from_secs(5);
const WRK_THREADS: u32 = 1;
const WRK_CONNECTIONS: u32 = 8;

struct Row {
    counted: f64,
    /// Counted under `2xx`, and with no status read.
    success: f64,
    unknown: f64,
    wrk_requests: u64,
    ours: (f64, f64),
    theirs: (f64, f64),
}

fn quantile(metrics: &Metrics, service: &str, q: &str) -> f64 {
    metrics
        .value(
            "poolscope_request_latency_window_seconds",
            &[("service", service), ("quantile", q)],
        )
        .unwrap_or(f64::NAN)
}

fn measure(kind: Kind, backend: &str) -> anyhow::Result<Row> {
    let server = RealServer::start(kind, free_port()?)?;
    let service = format!("{}-{backend}", kind.name());
    let pids = server.pids();
    let poolscope = Poolscope::start(&backend_config(backend, &service, &pids))?;
    let watching = wait_until(Duration::from_secs(10), || {
        poolscope.scrape().is_ok_and(|m| {
            m.value("poolscope_targets", &[("service", &service)]) == Some(pids.len() as f64)
        })
    });
    anyhow::ensure!(watching, "{service}: poolscope never watched {pids:?}");
    pin_to_first_cpu(&pids)?;
    let result = wrk(server.port(), WRK_THREADS, WRK_CONNECTIONS, LOAD)?;
    anyhow::ensure!(
        result.socket_errors == 0 && result.non_2xx == 0,
        "{service}: wrk saw errors"
    );
    // wrk closes its connections when it stops; the last requests finish then.
    let mut last = f64::NAN;
    let mut metrics = Metrics::default();
    let settled = wait_until(Duration::from_secs(5), || {
        let Ok(now) = poolscope.scrape() else {
            return false;
        };
        let counted = now
            .value("poolscope_requests_total", &[("service", &service)])
            .unwrap_or(f64::NAN);
        let in_flight = now.value("poolscope_requests_in_flight", &[("service", &service)]);
        let settled = counted == last && in_flight == Some(0.0);
        last = counted;
        metrics = now;
        settled
    });
    anyhow::ensure!(
        settled,
        "{service}: requests_total and requests_in_flight did not settle within 5 s \
         after wrk stopped (last {last})"
    );
    let class = |class: &str| {
        metrics
            .value(
                "poolscope_responses_total",
                &[("service", &service), ("status_class", class)],
            )
            .unwrap_or(f64::NAN)
    };
    Ok(Row {
        counted: last,
        success: class("2xx"),
        unknown: class("unknown"),
        wrk_requests: result.requests,
        ours: (
            quantile(&metrics, &service, "0.5"),
            quantile(&metrics, &service, "0.99"),
        ),
        theirs: (result.p50.as_secs_f64(), result.p99.as_secs_f64()),
    })
}

fn check(kind: Kind) -> anyhow::Result<()> {
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in backends() {
        let row = measure(kind, backend)?;
        let count_error = (row.counted - row.wrk_requests as f64).abs() / row.wrk_requests as f64;
        let ratio = |ours: f64, theirs: f64| ours / theirs;
        let (p50, p99) = (
            ratio(row.ours.0, row.theirs.0),
            ratio(row.ours.1, row.theirs.1),
        );
        eprintln!(
            "| {} | {backend} | {} | {} | {:+.2}% | {} 2xx, {} unknown | {:.0} µs / {:.0} µs ({p50:.2}) | {:.0} µs / {:.0} µs ({p99:.2}) |",
            kind.name(),
            row.wrk_requests,
            row.counted,
            count_error * 100.0,
            row.success,
            row.unknown,
            row.ours.0 * 1e6,
            row.theirs.0 * 1e6,
            row.ours.1 * 1e6,
            row.theirs.1 * 1e6,
        );
        if count_error > 0.01 {
            failures.push(format!(
                "{backend}: counted {} vs wrk {}",
                row.counted, row.wrk_requests
            ));
        } else {
            scorecard::within(
                "requests_total of a real server (nginx, Tomcat, gunicorn sync and gthread, Node.js, Go)",
                "wrk's count of completed requests",
                backend,
                row.counted,
                row.wrk_requests as f64,
                0.01,
            );
        }
        // Every answer wrk read was a 2xx (it saw no other). nginx corks its answers
        // (`tcp_nopush on`, as Debian ships it): the head it writes goes out in the
        // `sendfile` that follows, a call whose buffer is not the head's, so the tcp
        // backend reads no status (docs/limits.md).
        let status_unread = backend == "tcp" && kind == Kind::Nginx;
        let (classed, expected) = if status_unread {
            (row.unknown, row.counted)
        } else {
            (row.success, row.wrk_requests as f64)
        };
        let class_error = (classed - expected).abs() / expected;
        if class_error > 0.01 || row.success + row.unknown != row.counted {
            failures.push(format!(
                "{backend}: {} 2xx and {} unknown of {} counted, wrk read {} 2xx",
                row.success, row.unknown, row.counted, row.wrk_requests
            ));
        } else if !status_unread {
            scorecard::within(
                "responses_total of status class 2xx of a real server",
                "wrk's count of completed requests, all 2xx",
                backend,
                row.success,
                row.wrk_requests as f64,
                0.01,
            );
        }
        for (name, ratio) in [("p50", p50), ("p99", p99)] {
            if ratio.is_nan() || ratio > 1.05 {
                failures.push(format!(
                    "{backend}: latency {name} ours/wrk = {ratio:.2} > 1.05"
                ));
            }
        }
        let p50_floor = backend != "syscall" && (p50.is_nan() || p50 < 0.3);
        if p50_floor {
            failures.push(format!("{backend}: latency p50 ours/wrk = {p50:.2} < 0.3"));
        }
        if !p50_floor && p50 <= 1.05 {
            scorecard::bounded(
                "request_latency median of a real server (the quantile window's p50)",
                "wrk's median, which adds the client's side (the syscall backend sees no keep-alive wait)",
                backend,
                row.ours.0,
                row.theirs.0,
                "at most 1.05 ×, at least 0.3 × but syscall",
            );
        }
        if p99 <= 1.05 {
            scorecard::bounded(
                "request_latency p99 of a real server (the quantile window's)",
                "wrk's p99, which adds the client's side",
                backend,
                row.ours.1,
                row.theirs.1,
                "at most 1.05 ×",
            );
        }
    }
    anyhow::ensure!(
        failures.is_empty(),
        "{}: {}",
        kind.name(),
        failures.join("; ")
    );
    Ok(())
}

#[test]
fn nginx() -> anyhow::Result<()> {
    if !privileged("nginx") {
        return Ok(());
    }
    check(Kind::Nginx)
}

#[test]
fn tomcat() -> anyhow::Result<()> {
    if !privileged("tomcat") {
        return Ok(());
    }
    check(Kind::Tomcat)
}

#[test]
fn gunicorn_sync() -> anyhow::Result<()> {
    if !privileged("gunicorn_sync") {
        return Ok(());
    }
    check(Kind::GunicornSync)
}

#[test]
fn gunicorn_gthread() -> anyhow::Result<()> {
    if !privileged("gunicorn_gthread") {
        return Ok(());
    }
    check(Kind::GunicornGthread)
}

#[test]
fn node() -> anyhow::Result<()> {
    if !privileged("node") {
        return Ok(());
    }
    check(Kind::Node)
}

#[test]
fn go() -> anyhow::Result<()> {
    if !privileged("go") {
        return Ok(());
    }
    check(Kind::Go)
}
