//! Steady-state readings of a saturated service, shared by the request tests that
//! compare them with a controlled server's truth (requests.rs, iouring.rs): the
//! gauges' means over a sampled window and the counters' deltas across it, and the
//! relative-error check they are held to.
use std::time::{Duration, Instant};

use crate::{Metrics, Poolscope};

/// The value of `service`'s series `name`; NaN if absent (which fails any check).
pub fn value(metrics: &Metrics, name: &str, service: &str) -> f64 {
    metrics
        .value(name, &[("service", service)])
        .unwrap_or(f64::NAN)
}

/// How often [`measure`] samples the gauges. The test servers' N slots start
/// together and so turn over together, every service time S: between the kernel
/// writing their answers and reading their next requests the gauge truly reads fewer
/// than N (io_uring server at 100 ms: 5 samples of 640 below 4, three of them 0, each
/// with in flight + queued = C; poolscope's mean duration 0.6 % shorter than the
/// server's, the same gap). One sample of 0 moves a 40-sample mean by 2.5 %: CI once
/// read 3.78 against 4.01, and the thread pool's mean read as low as 3.85 of 4. Every
/// 37 ms, a period the 20 ms cycle does not divide, takes ~100 samples: 1 % each.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(37);

/// Steady-state means of the gauges and the deltas of the counters between two scrapes.
pub struct Steady {
    pub seconds: f64,
    pub in_flight: f64,
    pub queue_depth: f64,
    pub requests: f64,
    pub duration_sum: f64,
    pub queue_sum: f64,
}

/// Samples `service`'s gauges every `every` for `window` (the pacing is the
/// measurement, not a wait for a condition).
pub fn measure(
    poolscope: &Poolscope,
    service: &str,
    window: Duration,
    every: Duration,
) -> anyhow::Result<Steady> {
    let first = poolscope.scrape()?;
    let started = Instant::now();
    let (mut in_flight, mut depth, mut samples) = (0.0, 0.0, 0.0);
    while started.elapsed() < window {
        let metrics = poolscope.scrape()?;
        in_flight += value(&metrics, "poolscope_requests_in_flight", service);
        depth += value(&metrics, "poolscope_queue_depth", service);
        samples += 1.0;
        std::thread::sleep(every);
    }
    let last = poolscope.scrape()?;
    let seconds = started.elapsed().as_secs_f64();
    let delta = |name| value(&last, name, service) - value(&first, name, service);
    Ok(Steady {
        seconds,
        in_flight: in_flight / samples,
        queue_depth: depth / samples,
        requests: delta("poolscope_requests_total"),
        duration_sum: delta("poolscope_request_duration_seconds_sum"),
        queue_sum: delta("poolscope_request_queue_seconds_sum"),
    })
}

/// `ours` within `tolerance` of `truth`, relative.
pub fn assert_within(what: &str, ours: f64, truth: f64, tolerance: f64) {
    assert_within_plus(what, ours, truth, tolerance, 0.0);
}

/// `ours` within `tolerance` of `truth`, relative, plus `allowance`, absolute.
pub fn assert_within_plus(what: &str, ours: f64, truth: f64, tolerance: f64, allowance: f64) {
    let error = (ours - truth).abs() / truth;
    eprintln!(
        "{what}: ours {ours:.6}, truth {truth:.6}, error {:.1}%",
        error * 100.0
    );
    assert!(
        (ours - truth).abs() <= tolerance * truth + allowance,
        "{what}: ours {ours}, truth {truth}: {:.1}% off, more than {:.0}% (+ {:.1} ms)",
        error * 100.0,
        tolerance * 100.0,
        allowance * 1e3
    );
}
