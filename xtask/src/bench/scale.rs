//! How poolscope's cost grows with the node (`BENCH_ONLY=scale`): nodes of 10, 110
//! (the kubelet's default pod limit) and 500 services, each a `threadpool` of eight
//! threads (an acceptor and seven workers: two pools) on its own port, named by a
//! `[[targets]]` rule. For each size, idle and then under load (clients spread over
//! every service), poolscope is scraped in a loop; printed per size and load: the
//! series (all, and per service), the bytes plain and gzip-compressed (as poolscope
//! sends them to a scraper that asks), the scrape time p50 and p99 back to back and
//! with a pause before each scrape (as a scraper with an interval sends them),
//! poolscope's RSS, its CPU per scrape and per second between scrapes, the series
//! the cap dropped, and the p50 and CPU of the same scrapes asking for gzip, and
//! asking as a Prometheus with native histograms on (protobuf, gzip): its bytes and
//! the series it stores.
//! `BENCH_SCALE_PODS=1` puts each service in a network namespace of its own, as pods
//! are (idle only: the load's clients are in the host's namespace).
//!
//! Each scrape, back to back or paced, alternates with a fetch of the same bytes
//! from a static server in this process (`Floor`): what moving the exposition to
//! the client costs on this machine at that moment, so a scrape's time can be read
//! against it where the machine is noisy (the two share every disturbance of the run).
//! Around each paced scrape, poolscope's threads' schedstat is read: how long they
//! waited in a run queue for a CPU during it, and the scrape's time less that wait.
//! The wait is summed over all of poolscope's threads, background ones included, so
//! the time less it under-states what poolscope's own work took.
use std::{
    fmt::Write as _,
    fs,
    io::{Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::{self, sleep},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

mod floor;
mod scrapes;

use super::{LineProgram, free_port, spawn_poolscope, wait_for_metrics};
use scrapes::{SCRAPES, measure_scrapes};

/// Node sizes, in services (`BENCH_SCALE_SIZES=110,500` to choose).
const SIZES: [usize; 3] = [10, 110, 500];
/// Workers of each service (with its acceptor: eight threads).
const WORKERS: &str = "7";
/// The pause before each paced scrape.
const PACE: Duration = Duration::from_millis(50);
/// Client threads of the load, each one request per connection, round robin.
const CLIENTS: usize = 8;
/// The goal at 110 services (issue 29): scrape p99.
const GOAL_SCRAPE_P99_MS: f64 = 5.0;
/// The goals per service (issue 29), idle and busy; the bench's servers have three
/// pools (main thread, acceptor, workers) where the busy budget counts two.
const GOAL_SERIES_PER_SERVICE: [f64; 2] = [40.0, 100.0];
/// The default `[limits] max_series`: the 110-service node must fit with room.
const DEFAULT_MAX_SERIES: usize = 20_000;

/// One size and load, measured.
struct Measured {
    services: usize,
    loaded: bool,
    series: usize,
    per_service: f64,
    bytes: usize,
    gzip_bytes: usize,
    p50_ms: f64,
    p99_ms: f64,
    /// Scrapes [`PACE`] apart.
    paced_p50_ms: f64,
    paced_p99_ms: f64,
    /// How long poolscope's threads waited in a run queue during each paced scrape.
    paced_wait_p50_ms: f64,
    paced_wait_p99_ms: f64,
    /// Each paced scrape's time less that wait.
    paced_less_wait_p50_ms: f64,
    paced_less_wait_p99_ms: f64,
    /// CPU of each paced scrape, less the background's over the same time: more
    /// than back to back, as caches went cold meanwhile.
    paced_cpu_ms_per_scrape: f64,
    /// The same bytes from the static server, fetched [`PACE`] after each paced
    /// scrape and as long before the next: what the machine does to a paced fetch.
    paced_floor_p50_ms: f64,
    paced_floor_p99_ms: f64,
    /// poolscope's CPU with no scrape (pool samples, rescans, stack drains), per
    /// second: what it costs the node between scrapes.
    background_cpu_ms_per_s: f64,
    /// The same bytes from a static server, fetched between the scrapes.
    floor_p50_ms: f64,
    floor_p99_ms: f64,
    /// Median of the reads over the back-to-back loop.
    rss_mb: f64,
    cpu_ms_per_scrape: f64,
    dropped: f64,
    /// The same scrapes asking for gzip (`Accept-Encoding: gzip`, as Prometheus does).
    gzip_p50_ms: f64,
    gzip_cpu_ms_per_scrape: f64,
    /// The same scrapes as a Prometheus with native histograms asks for them.
    native: Timed,
    /// Series such a Prometheus stores: one per histogram.
    native_series: usize,
}

/// Scrapes of one kind, back to back.
struct Timed {
    bytes: usize,
    p50_ms: f64,
    cpu_ms_per_scrape: f64,
}

pub(super) fn run_scale(
    root: &Path,
    dir: PathBuf,
    _rounds: usize,
    _seconds: u64,
) -> anyhow::Result<()> {
    super::build_test_programs(root, &["threadpool"])?;
    let sizes: Vec<usize> = match std::env::var("BENCH_SCALE_SIZES") {
        Ok(sizes) => sizes
            .split(',')
            .map(|size| {
                size.trim()
                    .parse()
                    .context("BENCH_SCALE_SIZES: numbers, comma-separated")
            })
            .collect::<anyhow::Result<_>>()?,
        Err(_) => SIZES.to_vec(),
    };
    println!(
        "scale: nodes of {sizes:?} services (threadpool, 8 threads each), {SCRAPES} scrapes \
         each followed by the same bytes from a static server, idle then loaded"
    );
    let mut results = Vec::new();
    for &services in &sizes {
        results.extend(measure_node(root, &dir, services)?);
    }
    println!(
        "{:>8} {:>6} {:>7} {:>11} {:>9} {:>9} {:>8} {:>8} {:>13} {:>18} {:>17} {:>9} {:>11} {:>7} {:>13} {:>7} {:>10} {:>8} {:>10} {:>10}",
        "services",
        "load",
        "series",
        "per service",
        "bytes",
        "gzip",
        "p50 ms",
        "p99 ms",
        "paced p50/p99",
        "paced wait p50/p99",
        "less wait p50/p99",
        "paced CPU",
        "paced floor",
        "bg ms/s",
        "floor p50/p99",
        "RSS MB",
        "CPU ms/scr",
        "dropped",
        "gz p50 ms",
        "gz CPU ms"
    );
    let print_native = |m: &Measured| {
        println!(
            "{:>8} {:>6}: native (protobuf, gzip) {} series, {} bytes, p50 {:.2} ms, CPU {:.2} ms/scrape",
            m.services,
            if m.loaded { "loaded" } else { "idle" },
            m.native_series,
            m.native.bytes,
            m.native.p50_ms,
            m.native.cpu_ms_per_scrape
        );
    };
    for m in &results {
        println!(
            "{:>8} {:>6} {:>7} {:>11.1} {:>9} {:>9} {:>8.2} {:>8.2} {:>13} {:>18} {:>17} {:>9.2} {:>11} {:>7.1} {:>13} {:>7.1} {:>10.2} {:>8} {:>10.2} {:>10.2}",
            m.services,
            if m.loaded { "loaded" } else { "idle" },
            m.series,
            m.per_service,
            m.bytes,
            m.gzip_bytes,
            m.p50_ms,
            m.p99_ms,
            format!("{:.2}/{:.2}", m.paced_p50_ms, m.paced_p99_ms),
            format!("{:.2}/{:.2}", m.paced_wait_p50_ms, m.paced_wait_p99_ms),
            format!(
                "{:.2}/{:.2}",
                m.paced_less_wait_p50_ms, m.paced_less_wait_p99_ms
            ),
            m.paced_cpu_ms_per_scrape,
            format!("{:.2}/{:.2}", m.paced_floor_p50_ms, m.paced_floor_p99_ms),
            m.background_cpu_ms_per_s,
            format!("{:.2}/{:.2}", m.floor_p50_ms, m.floor_p99_ms),
            m.rss_mb,
            m.cpu_ms_per_scrape,
            m.dropped,
            m.gzip_p50_ms,
            m.gzip_cpu_ms_per_scrape
        );
    }
    results.iter().for_each(print_native);
    for m in results.iter().filter(|m| m.services == 110) {
        let load = if m.loaded { "loaded" } else { "idle" };
        let per_service_goal = GOAL_SERIES_PER_SERVICE[usize::from(m.loaded)];
        println!(
            "110 services {load}: scrape p99 {:.2} ms (goal ≤ {GOAL_SCRAPE_P99_MS} ms: {}; \
             the same bytes from a static server in the same loop: p99 {:.2} ms; \
             scrapes {} ms apart: p99 {:.2} ms ({}), less poolscope's wait for a CPU: \
             p99 {:.2} ms ({}), the static server's between them: p99 {:.2} ms), \
             {:.1} series per service (goal ≤ {per_service_goal}: {}), \
             {} series of the default max_series {DEFAULT_MAX_SERIES} ({})",
            m.p99_ms,
            super::met(m.p99_ms <= GOAL_SCRAPE_P99_MS),
            m.floor_p99_ms,
            PACE.as_millis(),
            m.paced_p99_ms,
            super::met(m.paced_p99_ms <= GOAL_SCRAPE_P99_MS),
            m.paced_less_wait_p99_ms,
            super::met(m.paced_less_wait_p99_ms <= GOAL_SCRAPE_P99_MS),
            m.paced_floor_p99_ms,
            m.per_service,
            super::met(m.per_service <= per_service_goal),
            m.series,
            super::met(m.series * 2 <= DEFAULT_MAX_SERIES && m.dropped == 0.0),
        );
    }
    Ok(())
}

/// Starts `services` servers and poolscope watching them, and measures it idle and
/// under load.
fn measure_node(root: &Path, dir: &Path, services: usize) -> anyhow::Result<Vec<Measured>> {
    let pods = std::env::var("BENCH_SCALE_PODS").is_ok_and(|pods| pods == "1");
    let namespaces = Namespaces::new(if pods { services } else { 0 })?;
    let mut servers = Vec::with_capacity(services);
    let mut ports = Vec::with_capacity(services);
    for index in 0..services {
        let args = [WORKERS.to_owned(), "1000".to_owned(), "sleep".to_owned()];
        let mut server = match namespaces.0.get(index) {
            Some(netns) => LineProgram::start_in_netns(root, "threadpool", netns, &args)?,
            None => LineProgram::start(root, "threadpool", None, &args)?,
        };
        let port: u16 = server.line("port ")?.parse().context("threadpool's port")?;
        server.line("workers ")?;
        ports.push(port);
        servers.push(server);
    }
    let mut config = format!(
        "[limits]\nmax_services = {}\nmax_pools = {}\n",
        services.max(256),
        (services * 4).max(512)
    );
    for (index, (port, server)) in ports.iter().zip(&servers).enumerate() {
        // Pods may listen on the same port: named by pid.
        let rule = if pods {
            format!("pids = [{}]", server.pid())
        } else {
            format!("port = {port}")
        };
        writeln!(config, "[[targets]]\nservice = \"svc-{index}\"\n{rule}")?;
    }
    let config_path = dir.join(format!("scale-{services}.toml"));
    fs::write(&config_path, config).context("writing the scale config")?;
    let address = format!("127.0.0.1:{}", free_port()?);
    let poolscope = spawn_poolscope(root, &config_path, &address, &[])?;
    let ready: Vec<String> = (0..services)
        .map(|index| format!("poolscope_targets{{service=\"svc-{index}\"}} 1\n"))
        .collect();
    wait_for_metrics(&address, &ready)?;
    // Two pool samples, so that every pool is named and has its totals.
    sleep(Duration::from_secs(2));
    let pid = poolscope.0.id();
    let idle = measure_scrapes(&address, pid, services, false)?;
    if pods {
        return Ok(vec![idle]);
    }

    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (stop, served, ports) = (stop.clone(), served.clone(), ports.clone());
            thread::spawn(move || {
                let mut next = client;
                while !stop.load(Ordering::Relaxed) {
                    if request(ports[next % ports.len()]).is_ok() {
                        served.fetch_add(1, Ordering::Relaxed);
                    }
                    next += CLIENTS;
                }
            })
        })
        .collect();
    // Every service serves at least once before the scrapes (the request histograms
    // are exported while requests finish in the window).
    let deadline = Instant::now() + Duration::from_secs(60);
    while served.load(Ordering::Relaxed) < (services as u64) * 2 {
        if Instant::now() > deadline {
            bail!("the load did not reach every service within 60 s");
        }
        sleep(Duration::from_millis(100));
    }
    let loaded = measure_scrapes(&address, pid, services, true);
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        let _ = client.join();
    }
    drop(poolscope);
    for mut server in servers {
        server.input = None;
        let _ = server.line("served ");
    }
    Ok(vec![idle, loaded?])
}

/// Network namespaces made for the pods of a node, deleted when dropped.
struct Namespaces(Vec<String>);

impl Namespaces {
    fn new(count: usize) -> anyhow::Result<Self> {
        let mut made = Self(Vec::with_capacity(count));
        for index in 0..count {
            let name = format!("poolscope-bench-{}-{index}", std::process::id());
            ip(&["netns", "add", &name])?;
            made.0.push(name.clone());
            ip(&["-n", &name, "link", "set", "lo", "up"])?;
        }
        Ok(made)
    }
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let status = std::process::Command::new("ip")
        .args(args)
        .status()
        .context("running ip")?;
    if !status.success() {
        bail!("ip {} failed: {status}", args.join(" "));
    }
    Ok(())
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        for name in &self.0 {
            let _ = std::process::Command::new("ip")
                .args(["netns", "delete", name])
                .status();
        }
    }
}

/// One request on a connection of its own.
fn request(port: u16) -> std::io::Result<()> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.write_all(b"req\n")?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    Ok(())
}
