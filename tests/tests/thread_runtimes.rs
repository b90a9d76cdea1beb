//! Pool metrics on real runtimes, against what each runtime or the clock says:
//! - Tomcat with `maxThreads` = N under 4N connections to a 15 ms JSP: its exec pool
//!   has N threads and `pool_utilization_ratio` ≥ 0.95 (every exec thread always has
//!   a request).
//! - Node.js: the event loop's busy share matches `performance.eventLoopUtilization()`
//!   of the same process over the same window within 5 points, at a paced load that
//!   keeps the loop 40–70 % busy. Every Node.js thread is named `node`; the main
//!   thread (the loop) is the `node` pool, the V8 and libuv helpers that kept its name
//!   are `node-threads`. Checked on the default names (`pool_utilization_ratio` and
//!   the `thread_seconds_total` deltas of `node`, and the main thread's running +
//!   runnable from `/debug/threads`), then after the script sets `process.title`
//!   (which renames the main thread at run time): the loop moves to a pool of its own
//!   under the new name, the helpers stay in `node-threads`, and the new pool matches
//!   the ELU too.
//! - gunicorn gthread with T threads: every thread of the arbiter and the worker is
//!   named `gunicorn`; the arbiter and the worker's main thread are the `gunicorn`
//!   pool, the T request threads `gunicorn-threads`. That pool holds T threads, its
//!   utilization is < 0.2 at 5 requests/s and ≥ 0.9 saturated (4T connections to a
//!   20 ms handler).
//! - Go: every thread is in a pool (`goserver`: the main thread, `goserver-threads`:
//!   the rest) and each pool's time adds up: over a window with a stable thread count,
//!   the `thread_seconds_total` deltas summed over states equal `pool_threads` × the
//!   wall time within 5 %. With a handler that only spins on CPU, `blocked_lock` is
//!   < 5 % of the service's thread time: a thread whose request another thread
//!   answered (Go moves goroutines between threads) no longer charges its futex
//!   waits to that request, not even the wait it was in when the answer went out.
//! - That last case with a program whose truth is known (`poolserver handoff-park`):
//!   a thread reads a request, blocks in a futex, another thread answers 5 ms later
//!   and the reader stays blocked 1 s more. `blocked_lock` and the futex lock waits
//!   of the service hold at most the 5 ms, not the second.
//!
//! The numbers go to stderr (`--nocapture`).
use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::TcpStream,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::{JoinHandle, sleep},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use poolscope_tests::{
    Metrics, PoolServer, Poolscope, cpu_steal_seconds, free_short_port, one_at_a_time,
    parse_debug_threads, pids_config, privileged, scorecard, scrape_until,
    servers::{Kind, Options, RealServer, WrkResult, get, pin_to_first_cpu, wrk_path},
    thread_names, watch_with,
};

/// `[pools] utilization_window` in these tests.
const WINDOW: Duration = Duration::from_secs(5);
/// The gauge's window is WINDOW to WINDOW + 2 s long (pools are sampled every second
/// and the base sample is the newest one at least WINDOW old): a load must run this
/// long before the gauge sees only it.
const WINDOW_FILLED: Duration = Duration::from_secs(WINDOW.as_secs() + 2);

const STATES: [&str; 5] = ["running", "runnable", "blocked_lock", "blocked_io", "idle"];

fn config(service: &str, pids: &[u32]) -> String {
    format!(
        "[pools]\nutilization_window = \"{}s\"\n{}",
        WINDOW.as_secs(),
        pids_config(service, pids)
    )
}

/// Starts poolscope on `pids` and waits until it watches all of them.
fn watch(service: &str, pids: &[u32]) -> anyhow::Result<Poolscope> {
    watch_with(&config(service, pids), service, pids)
}

fn thread_count(pids: &[u32]) -> anyhow::Result<usize> {
    Ok(thread_names(pids)?.values().sum())
}

/// One pool as a scrape shows it.
#[derive(Debug)]
struct Pool {
    name: String,
    threads: f64,
    busy: f64,
    utilization: f64,
    /// `thread_seconds_total` per state, in [`STATES`] order.
    seconds: [f64; 5],
}

impl Pool {
    fn total(&self) -> f64 {
        self.seconds.iter().sum()
    }

    fn busy_seconds(&self) -> f64 {
        self.total() - self.seconds[4]
    }
}

/// Every pool of `service`, by name.
fn pools(metrics: &Metrics, service: &str) -> BTreeMap<String, Pool> {
    let mut pools = BTreeMap::new();
    for sample in &metrics.samples {
        if sample.name != "poolscope_pool_threads"
            || !sample
                .labels
                .iter()
                .any(|(k, v)| k == "service" && v == service)
        {
            continue;
        }
        let Some((_, name)) = sample.labels.iter().find(|(k, _)| k == "pool") else {
            continue;
        };
        let labels = [("service", service), ("pool", name.as_str())];
        let value = |metric: &str| metrics.value(metric, &labels).unwrap_or(f64::NAN);
        let seconds = STATES.map(|state| {
            metrics
                .value(
                    "poolscope_thread_seconds_total",
                    &[("service", service), ("pool", name), ("state", state)],
                )
                .unwrap_or(f64::NAN)
        });
        pools.insert(
            name.clone(),
            Pool {
                name: name.clone(),
                threads: sample.value,
                busy: value("poolscope_pool_threads_busy"),
                utilization: value("poolscope_pool_utilization_ratio"),
                seconds,
            },
        );
    }
    pools
}

fn print_pools(what: &str, pools: &BTreeMap<String, Pool>) {
    eprintln!("{what}: | pool | threads | busy now | utilization |");
    for pool in pools.values() {
        eprintln!(
            "{what}: | {} | {} | {} | {:.3} |",
            pool.name, pool.threads, pool.busy, pool.utilization
        );
    }
}

/// The share of each state in the thread time of `pool` between two scrapes.
fn state_shares(before: &Pool, after: &Pool) -> String {
    let total = after.total() - before.total();
    STATES
        .iter()
        .zip(before.seconds.iter().zip(after.seconds))
        .map(|(state, (b, a))| format!("{state} {:.3}", (a - b) / total))
        .collect::<Vec<_>>()
        .join(", ")
}

fn pool_of<'a>(pools: &'a BTreeMap<String, Pool>, name: &str) -> anyhow::Result<&'a Pool> {
    pools
        .get(name)
        .with_context(|| format!("no pool {name:?}; pools: {:?}", pools.keys()))
}

/// `wrk` on `path` in the background.
fn wrk_in_background(
    port: u16,
    path: &str,
    connections: u32,
    duration: Duration,
) -> JoinHandle<anyhow::Result<WrkResult>> {
    let path = path.to_owned();
    std::thread::spawn(move || wrk_path(port, &path, 1, connections, duration))
}

fn join_wrk(wrk: JoinHandle<anyhow::Result<WrkResult>>) -> anyhow::Result<WrkResult> {
    let result = wrk
        .join()
        .map_err(|_| anyhow::anyhow!("the wrk thread panicked"))??;
    anyhow::ensure!(
        result.socket_errors == 0 && result.non_2xx == 0,
        "wrk saw errors: {result:?}"
    );
    Ok(result)
}

/// Paced HTTP/1.1 requests on one keep-alive connection: request k is sent at
/// start + k / rate, or at once when the previous response came later.
struct Paced {
    stop: Arc<AtomicBool>,
    client: JoinHandle<anyhow::Result<u64>>,
}

impl Paced {
    fn start(port: u16, path: &str, rate_per_second: f64) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
        let flag = stop.clone();
        let client = std::thread::spawn(move || -> anyhow::Result<u64> {
            let stream = TcpStream::connect(("127.0.0.1", port))?;
            stream.set_nodelay(true)?;
            stream.set_read_timeout(Some(Duration::from_secs(10)))?;
            let mut stream = BufReader::new(stream);
            let start = Instant::now();
            let mut sent = 0u64;
            while !flag.load(Ordering::Relaxed) {
                let due = start + Duration::from_secs_f64(sent as f64 / rate_per_second);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    sleep(wait);
                }
                stream.get_mut().write_all(request.as_bytes())?;
                read_response(&mut stream)?;
                sent += 1;
            }
            Ok(sent)
        });
        Self { stop, client }
    }

    /// Stops and returns how many requests were answered.
    fn stop(self) -> anyhow::Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        self.client
            .join()
            .map_err(|_| anyhow::anyhow!("the paced client panicked"))?
    }
}

/// Reads one HTTP/1.1 response with a Content-Length.
fn read_response(stream: &mut BufReader<TcpStream>) -> anyhow::Result<()> {
    let mut line = String::new();
    stream.read_line(&mut line)?;
    anyhow::ensure!(line.starts_with("HTTP/1.1 200"), "response {line:?}");
    let mut length = None;
    loop {
        line.clear();
        anyhow::ensure!(stream.read_line(&mut line)? > 0, "connection closed");
        let header = line.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = Some(value.trim().parse::<usize>()?);
        }
    }
    let mut body = vec![0; length.context("no Content-Length")?];
    stream.read_exact(&mut body)?;
    Ok(())
}

#[test]
fn tomcat_exec_pool_is_saturated_at_max_threads() -> anyhow::Result<()> {
    if !privileged("tomcat_exec_pool_is_saturated_at_max_threads") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    const MAX_THREADS: u32 = 4;
    const CONNECTIONS: u32 = 4 * MAX_THREADS;
    const SLEEP: &str = "/sleep?ms=15";
    let service = "tomcat-pool";
    let port = free_short_port()?;
    let options = Options {
        threads: Some(MAX_THREADS),
        work: true,
        any_address: true,
        ..Options::default()
    };
    let server = RealServer::start_with(Kind::Tomcat, port, &options)?;
    // The first request compiles the JSP.
    get(port, SLEEP)?;
    let pids = server.pids();
    eprintln!("tomcat threads on port {port}: {:?}", thread_names(&pids)?);
    let poolscope = watch(service, &pids)?;
    // 15 characters of "http-nio-PORT-exec-N".
    let exec = format!("http-nio-{port}-e");

    let started = poolscope.scrape()?;
    let wrk = wrk_in_background(port, SLEEP, CONNECTIONS, WINDOW_FILLED + 3 * WINDOW / 5);
    sleep(WINDOW_FILLED + WINDOW / 5);
    let loaded = poolscope.scrape()?;
    let result = join_wrk(wrk)?;

    let before = pools(&started, service);
    let after = pools(&loaded, service);
    print_pools("tomcat", &after);
    let (before, pool) = (pool_of(&before, &exec)?, pool_of(&after, &exec)?);
    eprintln!(
        "tomcat: wrk {:.0} requests/s (at most {:.0} with {MAX_THREADS} threads of 15 ms), p50 {:?}",
        result.requests_per_second(),
        f64::from(MAX_THREADS) / 0.015,
        result.p50
    );
    eprintln!("tomcat: {exec} under load: {}", state_shares(before, pool));
    eprintln!(
        "tomcat: {exec}: threads {} (truth {MAX_THREADS}), utilization {:.3} (truth 1, at least 0.95)",
        pool.threads, pool.utilization
    );
    assert_eq!(
        pool.threads,
        f64::from(MAX_THREADS),
        "{exec}: pool_threads is not maxThreads"
    );
    scorecard::exact(
        "pool_threads of Tomcat's exec pool",
        "Tomcat's maxThreads",
        "-",
        pool.threads,
        f64::from(MAX_THREADS),
    );
    assert!(
        pool.utilization >= 0.95,
        "{exec}: utilization {:.3} < 0.95 with {CONNECTIONS} connections on {MAX_THREADS} threads",
        pool.utilization
    );
    scorecard::bounded(
        "pool_utilization_ratio of Tomcat's exec pool, saturated",
        "1: more connections than maxThreads, each request 15 ms",
        "-",
        pool.utilization,
        1.0,
        "≥ 0.95",
    );
    Ok(())
}

/// Node.js's own cumulative event-loop idle and active milliseconds.
fn elu(port: u16) -> anyhow::Result<(f64, f64)> {
    let text = get(port, "/elu")?;
    let (idle, active) = text
        .trim()
        .split_once(' ')
        .with_context(|| format!("/elu said {text:?}"))?;
    Ok((idle.parse()?, active.parse()?))
}

/// running + runnable seconds of thread `tid` in `/debug/threads`.
fn on_cpu_or_queued(poolscope: &Poolscope, tid: u32) -> anyhow::Result<f64> {
    let rows = parse_debug_threads(&poolscope.get("/debug/threads")?)?;
    let row = rows
        .iter()
        .find(|row| row.tid == tid)
        .with_context(|| format!("thread {tid} not in /debug/threads"))?;
    Ok(row.running + row.runnable)
}

/// What one window of the Node.js test saw.
struct LoopWindow {
    seconds: f64,
    /// performance.eventLoopUtilization() over the window.
    elu: f64,
    /// The main thread's (running + runnable) / wall time, from /debug/threads.
    main_thread: f64,
    /// What the hypervisor took from CPU 0, where the loop is pinned: work on a CPU
    /// that loses time takes longer, and the ELU rises with it.
    stolen: f64,
    before: Metrics,
    after: Metrics,
}

fn loop_window(poolscope: &Poolscope, port: u16, pid: u32) -> anyhow::Result<LoopWindow> {
    let stolen0 = cpu_steal_seconds(0)?;
    let (idle0, active0) = elu(port)?;
    let started = Instant::now();
    let main0 = on_cpu_or_queued(poolscope, pid)?;
    let before = poolscope.scrape()?;
    sleep(WINDOW);
    let (idle1, active1) = elu(port)?;
    let seconds = started.elapsed().as_secs_f64();
    let main1 = on_cpu_or_queued(poolscope, pid)?;
    let after = poolscope.scrape()?;
    let stolen = cpu_steal_seconds(0)? - stolen0;
    let active = active1 - active0;
    Ok(LoopWindow {
        seconds,
        elu: active / (active + idle1 - idle0),
        main_thread: (main1 - main0) / seconds,
        stolen,
        before,
        after,
    })
}

/// The busy share of `name`'s thread time between two scrapes, and the pool at the
/// second.
fn busy_share<'a>(
    before: &BTreeMap<String, Pool>,
    after: &'a BTreeMap<String, Pool>,
    name: &str,
) -> anyhow::Result<(f64, &'a Pool, String)> {
    let (base, pool) = (pool_of(before, name)?, pool_of(after, name)?);
    let share = (pool.busy_seconds() - base.busy_seconds()) / (pool.total() - base.total());
    Ok((share, pool, state_shares(base, pool)))
}

#[test]
fn node_event_loop_utilization_matches_the_runtime() -> anyhow::Result<()> {
    if !privileged("node_event_loop_utilization_matches_the_runtime") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    // 250 requests/s of 2 ms on CPU: the loop is ~50 % busy plus parsing and writing.
    const RATE: f64 = 250.0;
    const SPIN: &str = "/spin?us=2000";
    let service = "node-loop";
    let port = poolscope_tests::free_port()?;
    let options = Options {
        work: true,
        ..Options::default()
    };
    let server = RealServer::start_with(Kind::Node, port, &options)?;
    let pids = server.pids();
    let [pid] = pids[..] else {
        anyhow::bail!("node runs {pids:?}, expected one process");
    };
    let names = thread_names(&pids)?;
    eprintln!("node threads: {names:?}");
    let poolscope = watch(service, &pids)?;
    pin_to_first_cpu(&pids)?;

    let load = Paced::start(port, SPIN, RATE);
    sleep(WINDOW_FILLED);
    // 1. Default names: the main thread is the pool "node", its helpers "node-threads".
    let default = loop_window(&poolscope, port, pid)?;
    let helpers = thread_count(&pids)? as f64 - 1.0;
    let (before, after) = (
        pools(&default.before, service),
        pools(&default.after, service),
    );
    print_pools("node", &after);
    let (node_busy, node, node_states) = busy_share(&before, &after, "node")?;
    let node_threads = pool_of(&after, "node-threads")?;
    eprintln!(
        "node: window {:.2} s ({:.3} s stolen from CPU 0), ELU {:.3}; main thread running+runnable {:.3}; pool \"node\" ({} threads) utilization {:.3}, busy share from thread_seconds {:.3} ({node_states}); \"node-threads\" {} threads, utilization {:.3}",
        default.seconds,
        default.stolen,
        default.elu,
        default.main_thread,
        node.threads,
        node.utilization,
        node_busy,
        node_threads.threads,
        node_threads.utilization
    );

    // 2. process.title renames the main thread at run time: the loop moves to a pool
    // of its own, named after it; the helpers stay in "node-threads". The new pool's
    // history starts at the rename, under the same load: no need to wait for the
    // gauge's window to fill.
    get(port, "/title?name=eventloop")?;
    scrape_until(&poolscope, |m| {
        m.value(
            "poolscope_pool_threads",
            &[("service", service), ("pool", "eventloop")],
        ) == Some(1.0)
    })?;
    sleep(Duration::from_secs(1));
    let renamed = loop_window(&poolscope, port, pid)?;
    let helpers_now = thread_count(&pids)? as f64 - 1.0;
    let answered = load.stop()?;
    let (before, after) = (
        pools(&renamed.before, service),
        pools(&renamed.after, service),
    );
    print_pools("node renamed", &after);
    let (counted, eventloop, eventloop_states) = busy_share(&before, &after, "eventloop")?;
    let helpers_after = pool_of(&after, "node-threads")?.threads;
    let node_after = after.get("node").map_or(0.0, |pool| pool.threads);
    eprintln!(
        "node renamed: window {:.2} s ({:.3} s stolen from CPU 0), ELU {:.3}; main thread running+runnable {:.3}; pool \"eventloop\" utilization {:.3}, busy share from thread_seconds {:.3} ({eventloop_states}); \"node\" {node_after} threads, \"node-threads\" {helpers_after}",
        renamed.seconds,
        renamed.stolen,
        renamed.elu,
        renamed.main_thread,
        eventloop.utilization,
        counted,
    );
    eprintln!("node: {answered} requests answered in all (paced at {RATE}/s)");

    // Busy but not saturated: a precondition of the load, not a bound on our numbers
    // (those are the 5 points below). The upper bound has room for a slower moment:
    // one CI run measured 0.731 (and poolscope 0.766, in line), above the 0.7 this
    // said then; the time the hypervisor steals from the pinned CPU makes each
    // request's parsing and writing take longer (printed with each window).
    for (window, elu) in [("default", default.elu), ("renamed", renamed.elu)] {
        assert!(
            (0.4..=0.85).contains(&elu),
            "{window}: ELU {elu:.3} outside 0.4–0.85: the load is not what the test needs"
        );
    }
    assert_eq!(
        node.threads, 1.0,
        "pool \"node\" is not the main thread alone"
    );
    assert_eq!(
        node_threads.threads, helpers,
        "pool \"node-threads\" is not every thread but the main one ({names:?})"
    );
    assert_eq!(
        (node_after, helpers_after),
        (0.0, helpers_now),
        "after the rename, \"node\" should be empty and the helpers stay in \"node-threads\""
    );
    let close = |what: &str, ours: f64, elu: f64| {
        assert!(
            (ours - elu).abs() <= 0.05,
            "{what} {ours:.3} vs ELU {elu:.3}: more than 5 points apart"
        );
    };
    close(
        "main thread (/debug/threads)",
        default.main_thread,
        default.elu,
    );
    close(
        "pool_utilization_ratio{pool=\"node\"}",
        node.utilization,
        default.elu,
    );
    scorecard::points(
        "pool_utilization_ratio of a Node.js event loop",
        "Node's own event loop utilization (performance.eventLoopUtilization)",
        "-",
        node.utilization,
        default.elu,
        5.0,
    );
    close(
        "thread_seconds_total busy share of \"node\"",
        node_busy,
        default.elu,
    );
    close(
        "pool_utilization_ratio{pool=\"eventloop\"}",
        eventloop.utilization,
        renamed.elu,
    );
    scorecard::points(
        "pool_utilization_ratio of a Node.js event loop",
        "Node's own event loop utilization (performance.eventLoopUtilization)",
        "-",
        eventloop.utilization,
        renamed.elu,
        5.0,
    );
    close(
        "thread_seconds_total busy share of \"eventloop\"",
        counted,
        renamed.elu,
    );
    Ok(())
}

#[test]
fn gunicorn_gthread_utilization_rises_with_load() -> anyhow::Result<()> {
    if !privileged("gunicorn_gthread_utilization_rises_with_load") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    const THREADS: u32 = 4;
    const SLEEP: &str = "/sleep?ms=20";
    const REQUEST_THREADS: &str = "gunicorn-threads";
    let service = "gunicorn-pool";
    let port = poolscope_tests::free_port()?;
    let options = Options {
        threads: Some(THREADS),
        work: true,
        ..Options::default()
    };
    let server = RealServer::start_with(Kind::GunicornGthread, port, &options)?;
    let pids = server.pids();
    let poolscope = watch(service, &pids)?;
    // The executor starts its threads on demand: start them all.
    join_wrk(wrk_in_background(
        port,
        SLEEP,
        4 * THREADS,
        Duration::from_secs(1),
    ))?;
    eprintln!("gunicorn threads: {:?}", thread_names(&pids)?);
    let expected_threads = f64::from(THREADS);

    // Near idle: 5 requests/s of 20 ms, 0.1 thread busy of T.
    let light = Paced::start(port, SLEEP, 5.0);
    sleep(WINDOW_FILLED);
    let quiet = poolscope.scrape()?;
    let answered = light.stop()?;
    let quiet_pools = pools(&quiet, service);
    print_pools("gunicorn 5/s", &quiet_pools);
    let quiet_pool = pool_of(&quiet_pools, REQUEST_THREADS)?;

    // Saturated: 4T connections on T threads.
    let started = poolscope.scrape()?;
    let wrk = wrk_in_background(port, SLEEP, 4 * THREADS, WINDOW_FILLED + 3 * WINDOW / 5);
    sleep(WINDOW_FILLED + WINDOW / 5);
    let loaded = poolscope.scrape()?;
    let result = join_wrk(wrk)?;
    let busy_pools = pools(&loaded, service);
    print_pools("gunicorn saturated", &busy_pools);
    let busy_pool = pool_of(&busy_pools, REQUEST_THREADS)?;
    let started = pools(&started, service);
    for name in busy_pools.keys() {
        if let Some(base) = started.get(name) {
            eprintln!(
                "gunicorn saturated: {name}: {}",
                state_shares(base, &busy_pools[name])
            );
        }
    }
    let main_threads = pool_of(&busy_pools, "gunicorn")?.threads;
    eprintln!(
        "gunicorn: {REQUEST_THREADS} threads {} / {} (truth {THREADS}), \"gunicorn\" {main_threads} (truth 2: arbiter + worker); utilization at 5/s {:.3} ({answered} requests, truth ≈ {:.3}, bound 0.2), saturated {:.3} (wrk {:.0}/s, at most {:.0}/s; bound 0.9)",
        quiet_pool.threads,
        busy_pool.threads,
        quiet_pool.utilization,
        5.0 * 0.02 / expected_threads,
        busy_pool.utilization,
        result.requests_per_second(),
        f64::from(THREADS) / 0.02,
    );
    for pool in [quiet_pool, busy_pool] {
        assert_eq!(
            pool.threads, expected_threads,
            "{REQUEST_THREADS} is not the {THREADS} request threads"
        );
    }
    assert_eq!(
        main_threads, 2.0,
        "\"gunicorn\" is not the arbiter and the worker's main thread"
    );
    assert!(
        quiet_pool.utilization < 0.2,
        "{REQUEST_THREADS}: utilization {:.3} at 5 requests/s",
        quiet_pool.utilization
    );
    assert!(
        busy_pool.utilization >= 0.9,
        "{REQUEST_THREADS}: saturated utilization {:.3} < 0.9",
        busy_pool.utilization
    );
    Ok(())
}

#[test]
fn go_thread_time_adds_up() -> anyhow::Result<()> {
    if !privileged("go_thread_time_adds_up") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    const CONNECTIONS: u32 = 8;
    const ATTEMPTS: usize = 5;
    let service = "go-pool";
    let port = poolscope_tests::free_port()?;
    let options = Options {
        work: true,
        ..Options::default()
    };
    let server = RealServer::start_with(Kind::Go, port, &options)?;
    let pids = server.pids();
    let poolscope = watch(service, &pids)?;
    // Go starts threads when it needs them and keeps them: a window under load with
    // the same count at both ends is one where none started. Many connections at
    // first make it start most of the threads it will use.
    join_wrk(wrk_in_background(
        port,
        "/spin?us=200",
        64,
        Duration::from_secs(2),
    ))?;
    let mut window = None;
    for _ in 0..ATTEMPTS {
        let wrk = wrk_in_background(
            port,
            "/spin?us=200",
            CONNECTIONS,
            WINDOW + Duration::from_secs(3),
        );
        sleep(Duration::from_millis(1500));
        let threads0 = thread_count(&pids)?;
        let t0 = Instant::now();
        let before = poolscope.scrape()?;
        let t0 = t0 + t0.elapsed() / 2;
        sleep(WINDOW);
        let t1 = Instant::now();
        let after = poolscope.scrape()?;
        let t1 = t1 + t1.elapsed() / 2;
        let threads1 = thread_count(&pids)?;
        let result = join_wrk(wrk)?;
        eprintln!(
            "go: wrk {:.0} requests/s; threads {threads0} → {threads1} ({:?})",
            result.requests_per_second(),
            thread_names(&pids)?
        );
        // A thread may also change pools within the window (CI once saw the
        // `goserver` pool go 2 → 1 with the process at 5 threads throughout):
        // that window's per-pool truth (threads × wall) does not hold either.
        let (pools0, pools1) = (pools(&before, service), pools(&after, service));
        let same_pools = pools0.len() == pools1.len()
            && pools0.iter().all(|(name, pool)| {
                pools1
                    .get(name)
                    .is_some_and(|later| later.threads == pool.threads)
            });
        window = Some((t1 - t0, before, after, threads1));
        if threads0 == threads1 && same_pools {
            break;
        }
    }
    let Some((wall, before, after, threads)) = window else {
        anyhow::bail!("no window measured");
    };
    let (before, after) = (pools(&before, service), pools(&after, service));
    print_pools("go", &after);
    let wall = wall.as_secs_f64();
    let in_pools: f64 = after.values().map(|pool| pool.threads).sum();
    assert_eq!(
        in_pools, threads as f64,
        "the pools do not hold every thread of the service"
    );
    for (name, pool) in &after {
        let base = pool_of(&before, name)?;
        let counted = pool.total() - base.total();
        let truth = pool.threads * wall;
        eprintln!(
            "go: pool {name}: {} threads × {wall:.3} s = {truth:.3} thread-s, counted {counted:.3} ({:+.2} %); {}",
            pool.threads,
            (counted - truth) / truth * 100.0,
            state_shares(base, pool)
        );
        anyhow::ensure!(
            base.threads == pool.threads,
            "pool {name}: thread count changed in every window ({} → {})",
            base.threads,
            pool.threads
        );
        assert!(
            (counted - truth).abs() <= 0.05 * truth,
            "pool {name}: thread time {counted:.3} s is not threads × wall time {truth:.3} s within 5 %"
        );
    }
    // The handler only spins: the service's futex waits are the scheduler's idle Ms
    // (futexsleep in stopm), not requests waiting for a lock.
    let mut per_state = [0.0; 5];
    for (name, pool) in &after {
        let base = pool_of(&before, name)?;
        for (sum, (a, b)) in per_state
            .iter_mut()
            .zip(pool.seconds.iter().zip(base.seconds))
        {
            *sum += a - b;
        }
    }
    let total: f64 = per_state.iter().sum();
    let blocked_lock = per_state[2] / total;
    eprintln!(
        "go: all pools: {}; blocked_lock {:.1} % of thread time (bound 5 %)",
        STATES
            .iter()
            .zip(per_state)
            .map(|(state, seconds)| format!("{state} {:.3}", seconds / total))
            .collect::<Vec<_>>()
            .join(", "),
        blocked_lock * 100.0
    );
    assert!(
        blocked_lock < 0.05,
        "blocked_lock is {:.1} % of the thread time with a handler that only spins",
        blocked_lock * 100.0
    );
    Ok(())
}

/// The sum over the pools of `service` of the futex lock waits' `_sum` (none yet: 0).
fn futex_lock_wait_seconds(metrics: &Metrics, service: &str) -> f64 {
    pools(metrics, service)
        .keys()
        .filter_map(|pool| {
            metrics.value(
                "poolscope_lock_wait_seconds_sum",
                &[("service", service), ("pool", pool), ("primitive", "futex")],
            )
        })
        .sum()
}

#[test]
fn a_reader_parked_after_another_thread_answered_is_idle() -> anyhow::Result<()> {
    if !privileged("a_reader_parked_after_another_thread_answered_is_idle") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    const SERVICE_TIME: Duration = Duration::from_millis(5);
    /// `poolserver`'s `PARK`: how long the reader stays blocked after the answer.
    const PARK: Duration = Duration::from_secs(1);
    let service = "handoff-park";
    let server = PoolServer::start_styled(1, SERVICE_TIME, "handoff-park")?;
    let pids = [server.pid()];
    let poolscope = watch(service, &pids)?;
    let stream = TcpStream::connect(("127.0.0.1", server.port))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut stream = BufReader::new(stream);
    // The connection's reader and its responder are started at accept: wait until
    // poolscope follows every thread of the server.
    sleep(Duration::from_millis(200));
    let threads = thread_count(&pids)?;
    let before = scrape_until(&poolscope, |m| {
        pools(m, service)
            .values()
            .map(|pool| pool.threads)
            .sum::<f64>()
            == threads as f64
    })?;
    stream.get_mut().write_all(b"req\n")?;
    let mut response = String::new();
    stream.read_line(&mut response)?;
    anyhow::ensure!(response == "ok\n", "response {response:?}");
    // The reader wakes after the park and blocks again in poll (waiting for work).
    sleep(PARK + Duration::from_millis(500));
    let after = poolscope.scrape()?;
    let (pools_before, pools_after) = (pools(&before, service), pools(&after, service));
    let mut blocked_lock = 0.0;
    let mut idle = 0.0;
    for (name, pool) in &pools_after {
        let base = pool_of(&pools_before, name)?;
        eprintln!(
            "handoff-park: pool {name}: {} threads; {}",
            pool.threads,
            state_shares(base, pool)
        );
        blocked_lock += pool.seconds[2] - base.seconds[2];
        idle += pool.seconds[4] - base.seconds[4];
    }
    let lock_waits =
        futex_lock_wait_seconds(&after, service) - futex_lock_wait_seconds(&before, service);
    eprintln!(
        "handoff-park: blocked_lock {blocked_lock:.4} s, futex lock waits {lock_waits:.4} s, \
         idle {idle:.3} s over {threads} threads (park {:.1} s, service {:.3} s)",
        PARK.as_secs_f64(),
        SERVICE_TIME.as_secs_f64()
    );
    // The reader's futex wait lasted the service time's remainder plus the park; only
    // its part until the answer (far below the service time: the reader sleeps the
    // service time before handing over) was the request's.
    let bound = SERVICE_TIME.as_secs_f64();
    assert!(
        blocked_lock <= bound,
        "blocked_lock {blocked_lock:.4} s: the reader's park after the answer counted as a lock wait"
    );
    assert!(
        lock_waits <= bound,
        "futex lock waits {lock_waits:.4} s: the reader's park after the answer counted as a lock wait"
    );
    Ok(())
}
