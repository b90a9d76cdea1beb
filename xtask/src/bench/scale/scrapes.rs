//! One size and load, scraped: back to back, paced, asking for gzip and as a
//! Prometheus with native histograms; each scrape beside a fetch of the same bytes
//! from the [`Floor`], with poolscope's CPU, RSS and run-queue wait around them.
use std::{
    collections::BTreeMap,
    fs,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::{Measured, PACE, Timed, floor::Floor};
use crate::bench::{min_median, processes, scrape, scrape_into, text};

/// Scrapes per size and load, each followed by a fetch from the static server: the
/// p99 is the tenth slowest (of 200 it was the second, one stall of the VM).
pub(super) const SCRAPES: usize = 1000;
/// poolscope's RSS is read every this many back-to-back scrapes; the median is shown.
const RSS_EVERY: usize = 100;
/// Scrapes with a pause before each, as a scraper with an interval sends them: caches
/// go cold and an idle CPU halts between them, which scrapes back to back never see.
/// Their p99 is the third slowest.
const PACED_SCRAPES: usize = 300;
/// How long poolscope's CPU is read with no scrape, before the paced ones: its
/// background work (pool samples, rescans, stack drains), reported per second and
/// taken off the paced scrapes' CPU. Two rescans at the default interval, so that
/// where the window falls moves it little.
const BACKGROUND: Duration = Duration::from_secs(10);
/// Scrapes of the gzip and protobuf answers, whose p50 alone is reported.
const ENCODED_SCRAPES: usize = 200;
/// The Accept header of Prometheus 2.42 with `--enable-feature=native-histograms`.
const NATIVE_ACCEPT: &str = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;\
    encoding=delimited,application/openmetrics-text;version=1.0.0;q=0.8,\
    application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// poolscope's resident memory (`VmRSS`), in kB.
fn resident_kb(pid: u32) -> anyhow::Result<f64> {
    fs::read_to_string(format!("/proc/{pid}/status"))?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("VmRSS in /proc/<pid>/status")
}

pub(super) fn measure_scrapes(
    address: &str,
    pid: u32,
    services: usize,
    loaded: bool,
) -> anyhow::Result<Measured> {
    let cpu = || processes().get(&pid).map_or(0.0, |p| p.cpu_seconds);
    let body_of = |response: String| {
        response
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_owned())
            .context("a scrape without a body")
    };
    let floor = Floor::serve(body_of(scrape(address)?)?)?;
    // poolscope's CPU over the loop counts its idle work during the fetches too
    // (~8 ms a second at 110 services: ~0.003 ms per scrape).
    let cpu_before = cpu();
    let mut times_ms = Vec::with_capacity(SCRAPES);
    let mut floor_ms = Vec::with_capacity(SCRAPES);
    // Both reads go into buffers kept across the loop, as Prometheus' scrape loop
    // keeps its own: a fresh 434 kB buffer per scrape put the client's page faults
    // and copies inside the timed span (they kept a CPU busy while poolscope was to
    // be woken there, and doubled poolscope's run-queue wait per scrape).
    let (mut response, mut floor_response) = (Vec::new(), Vec::new());
    // Read every RSS_EVERY scrapes, outside the timed spans: one read after the loop
    // ranged 36-63 MB for one build under load from run to run.
    let mut rss_kb = Vec::with_capacity(SCRAPES / RSS_EVERY);
    for scraped in 0..SCRAPES {
        if scraped % RSS_EVERY == RSS_EVERY / 2 {
            rss_kb.push(resident_kb(pid)?);
        }
        let started = Instant::now();
        scrape_into(address, "", &mut response)?;
        times_ms.push(started.elapsed().as_secs_f64() * 1e3);
        let started = Instant::now();
        scrape_into(&floor.address, "", &mut floor_response)?;
        floor_ms.push(started.elapsed().as_secs_f64() * 1e3);
    }
    let body = body_of(text(response)?)?;
    let cpu_ms_per_scrape = (cpu() - cpu_before) * 1e3 / SCRAPES as f64;
    let timed = |accept: &str| -> anyhow::Result<Timed> {
        let cpu_before = cpu();
        let mut times_ms = Vec::with_capacity(ENCODED_SCRAPES);
        let (mut bytes, mut response) = (0, Vec::new());
        for _ in 0..ENCODED_SCRAPES {
            let started = Instant::now();
            bytes = scrape_gzip(address, accept, &mut response)?;
            times_ms.push(started.elapsed().as_secs_f64() * 1e3);
        }
        times_ms.sort_by(f64::total_cmp);
        Ok(Timed {
            bytes,
            p50_ms: times_ms[ENCODED_SCRAPES / 2],
            cpu_ms_per_scrape: (cpu() - cpu_before) * 1e3 / ENCODED_SCRAPES as f64,
        })
    };
    let background_before = cpu();
    std::thread::sleep(BACKGROUND);
    let background_per_s = (cpu() - background_before) / BACKGROUND.as_secs_f64();
    let (mut paced_ms, mut paced_response) = (Vec::with_capacity(PACED_SCRAPES), Vec::new());
    let mut paced_wait_ms = Vec::with_capacity(PACED_SCRAPES);
    let mut paced_less_wait_ms = Vec::with_capacity(PACED_SCRAPES);
    let mut paced_floor_ms = Vec::with_capacity(PACED_SCRAPES);
    let (paced_cpu_before, paced_started) = (cpu(), Instant::now());
    for _ in 0..PACED_SCRAPES {
        std::thread::sleep(PACE);
        let threads_before = run_queue_waits_ns(pid)?;
        let started = Instant::now();
        scrape_into(address, "", &mut paced_response)?;
        let took_ms = started.elapsed().as_secs_f64() * 1e3;
        let waited_ms = waited_since_ns(&threads_before, &run_queue_waits_ns(pid)?) as f64 / 1e6;
        paced_ms.push(took_ms);
        paced_wait_ms.push(waited_ms);
        paced_less_wait_ms.push(took_ms - waited_ms);
        std::thread::sleep(PACE);
        let started = Instant::now();
        scrape_into(&floor.address, "", &mut floor_response)?;
        paced_floor_ms.push(started.elapsed().as_secs_f64() * 1e3);
    }
    let paced_cpu =
        cpu() - paced_cpu_before - background_per_s * paced_started.elapsed().as_secs_f64();
    drop(floor);
    let gzip = timed("text/plain")?;
    let native = timed(NATIVE_ACCEPT)?;
    times_ms.sort_by(f64::total_cmp);
    floor_ms.sort_by(f64::total_cmp);
    paced_ms.sort_by(f64::total_cmp);
    paced_wait_ms.sort_by(f64::total_cmp);
    paced_less_wait_ms.sort_by(f64::total_cmp);
    paced_floor_ms.sort_by(f64::total_cmp);
    let (_, rss_median_kb) = min_median(&mut rss_kb);
    let at_of =
        |times: &[f64], q: f64| times[((q * times.len() as f64) as usize).min(times.len() - 1)];
    let at = |q: f64| at_of(&times_ms, q);
    let samples: Vec<&str> = body.lines().filter(|l| !l.starts_with('#')).collect();
    let of_services = samples
        .iter()
        .filter(|l| l.contains("service=\"svc-"))
        .count();
    let dropped = samples
        .iter()
        .find_map(|l| l.strip_prefix("poolscope_series_dropped_total "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN);
    // A histogram's buckets, `_sum` and `_count` are one native series.
    let histograms = samples.iter().filter(|l| l.contains("le=\"+Inf\"")).count();
    let bucket_lines = samples.iter().filter(|l| l.contains("_bucket{")).count();
    Ok(Measured {
        services,
        loaded,
        series: samples.len(),
        per_service: of_services as f64 / services as f64,
        bytes: body.len(),
        gzip_bytes: gzip.bytes,
        p50_ms: at(0.5),
        p99_ms: at(0.99),
        paced_p50_ms: at_of(&paced_ms, 0.5),
        paced_p99_ms: at_of(&paced_ms, 0.99),
        paced_wait_p50_ms: at_of(&paced_wait_ms, 0.5),
        paced_wait_p99_ms: at_of(&paced_wait_ms, 0.99),
        paced_less_wait_p50_ms: at_of(&paced_less_wait_ms, 0.5),
        paced_less_wait_p99_ms: at_of(&paced_less_wait_ms, 0.99),
        paced_cpu_ms_per_scrape: paced_cpu * 1e3 / PACED_SCRAPES as f64,
        paced_floor_p50_ms: at_of(&paced_floor_ms, 0.5),
        paced_floor_p99_ms: at_of(&paced_floor_ms, 0.99),
        background_cpu_ms_per_s: background_per_s * 1e3,
        floor_p50_ms: at_of(&floor_ms, 0.5),
        floor_p99_ms: at_of(&floor_ms, 0.99),
        rss_mb: rss_median_kb / 1024.0,
        cpu_ms_per_scrape,
        dropped,
        gzip_p50_ms: gzip.p50_ms,
        gzip_cpu_ms_per_scrape: gzip.cpu_ms_per_scrape,
        native,
        native_series: samples.len() - bucket_lines - histograms,
    })
}

/// How long each of poolscope's threads has waited in a run queue for a CPU, in ns
/// (`/proc/<pid>/task/<tid>/schedstat`, its second field), by tid. A thread that
/// exits while it is read is left out; none read at all is an error (a wait of zero
/// would pass the goal unmeasured).
fn run_queue_waits_ns(pid: u32) -> anyhow::Result<BTreeMap<u32, u64>> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task"))
        .with_context(|| format!("listing poolscope's threads (/proc/{pid}/task)"))?;
    let waits: BTreeMap<u32, u64> = tasks
        .flatten()
        .filter_map(|task| {
            let tid = task.file_name().to_str()?.parse().ok()?;
            let schedstat = fs::read_to_string(task.path().join("schedstat")).ok()?;
            let waited = schedstat.split_whitespace().nth(1)?.parse().ok()?;
            Some((tid, waited))
        })
        .collect();
    if waits.is_empty() {
        bail!("no schedstat of poolscope's threads could be read (/proc/{pid}/task/*/schedstat)");
    }
    Ok(waits)
}

/// How long poolscope's threads waited for a CPU between two readings, in ns: a
/// thread new in `after` counts from zero, one gone by then is left out.
fn waited_since_ns(before: &BTreeMap<u32, u64>, after: &BTreeMap<u32, u64>) -> u64 {
    after
        .iter()
        .map(|(tid, waited)| waited.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .sum()
}

/// One scrape asking for gzip and `accept`, into `response` (emptied first; its
/// capacity kept): the size of the body poolscope sent.
fn scrape_gzip(address: &str, accept: &str, response: &mut Vec<u8>) -> anyhow::Result<usize> {
    let headers = format!("Accept: {accept}\r\nAccept-Encoding: gzip\r\n");
    scrape_into(address, &headers, response)?;
    let head_end = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("a response without a head")?;
    let head = String::from_utf8_lossy(&response[..head_end]).to_ascii_lowercase();
    if !head.contains("content-encoding: gzip") {
        bail!("poolscope did not gzip a scrape that asked for it");
    }
    if accept.starts_with("application/vnd.google.protobuf")
        && !head.contains("content-type: application/vnd.google.protobuf")
    {
        bail!("poolscope did not answer in protobuf a scrape that asked for it");
    }
    Ok(response.len() - head_end - 4)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::waited_since_ns;

    #[test]
    fn waits_are_summed_over_the_threads_of_both_readings() {
        let before = BTreeMap::from([(10, 1_000), (11, 5_000), (12, 7_000)]);
        // 10 waited 500 ns more, 11 nothing, 12 exited, 13 started and waited 300 ns.
        let after = BTreeMap::from([(10, 1_500), (11, 5_000), (13, 300)]);
        assert_eq!(waited_since_ns(&before, &after), 800);
        assert_eq!(waited_since_ns(&after, &after), 0);
        // A tid reused by a thread that has waited less than the one before it: not
        // a negative wait.
        let reused = BTreeMap::from([(10, 200)]);
        assert_eq!(waited_since_ns(&BTreeMap::from([(10, 9_000)]), &reused), 0);
    }
}
