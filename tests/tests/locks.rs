//! Ground truth for lock waits, against the real kernel:
//! - `lockserver`: T workers contend one pthread mutex held H on CPU per request and
//!   time their own blocked `pthread_mutex_lock` calls: our futex wait total within
//!   5 % of theirs, the top lock's p50 and p99 those of theirs (by rank, see
//!   [`QUANTILE_CHECKS`]), its stack naming the program's functions; with the opt-in
//!   uprobes, one `pthread_mutex` wait per call;
//! - the same program with one worker (no contention): no futex lock wait at all;
//! - `threadpool`, whose idle workers wait on a condition variable: no lock wait;
//! - a process killed while its threads wait on the mutex leaves no entry behind;
//! - full lock maps are counted, and every counted map holds what `map_entries` says.
use std::{io::Write as _, net::TcpStream, time::Duration};

use poolscope_tests::{
    Metrics, Poolscope, Program,
    kernel_maps::walked_entries,
    load::{ClosedLoop, Connections, OpenLoop},
    one_at_a_time, parse_tids, pids_config, privileged, requests_settled, scorecard, scrape_until,
};

const SERVICE: &str = "lk";
const LOCKER_POOL: &str = "locker";

/// Watches `pid` as [`SERVICE`], with the pthread_mutex_lock probes if asked.
fn config(pid: u32, uprobes: bool) -> String {
    let probes = if uprobes {
        format!("[probes]\nlock_uprobes = [\"{SERVICE}\"]\n")
    } else {
        String::new()
    };
    format!("{probes}{}", pids_config(SERVICE, &[pid]))
}

struct LockServer {
    program: Program,
    port: u16,
}

/// What `lockserver` measured of its own lock calls.
struct OwnTimes {
    calls: u64,
    blocked: u64,
    /// Each blocked call's duration in ns, ascending.
    blocked_ns: Vec<u64>,
    /// Requests answered.
    served: u64,
}

/// A summary: the durations themselves would be thousands of numbers.
impl std::fmt::Debug for OwnTimes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} calls, {} blocked for {:.4} s (p50 {:.6} s, p99 {:.6} s), {} served",
            self.calls,
            self.blocked,
            self.blocked_total_s(),
            self.quantile_s(0.5),
            self.quantile_s(0.99),
            self.served
        )
    }
}

impl OwnTimes {
    fn blocked_total_s(&self) -> f64 {
        self.blocked_ns.iter().sum::<u64>() as f64 / 1e9
    }

    /// The `q` quantile of the blocked calls' durations in seconds (nearest rank).
    fn quantile_s(&self, q: f64) -> f64 {
        let count = self.blocked_ns.len();
        let rank = ((q * count as f64).ceil() as usize).clamp(1, count.max(1));
        self.blocked_ns.get(rank - 1).copied().unwrap_or(0) as f64 / 1e9
    }
}

impl LockServer {
    fn start(workers: u32, hold: Duration) -> anyhow::Result<Self> {
        let mut program = Program::start(
            "lockserver",
            &[workers.to_string(), hold.as_micros().to_string()],
        )?;
        let port = program.line("port")?.parse()?;
        parse_tids(&program.line("workers")?)?;
        Ok(Self { program, port })
    }

    fn pid(&self) -> u32 {
        self.program.pid()
    }

    fn finish(mut self) -> anyhow::Result<OwnTimes> {
        let line = self.program.finish("locks")?;
        let numbers = |line: &str| -> anyhow::Result<Vec<u64>> {
            Ok(line
                .split_whitespace()
                .map(str::parse)
                .collect::<Result<_, _>>()?)
        };
        let [calls, blocked] = numbers(&line)?[..] else {
            anyhow::bail!("locks line {line:?}");
        };
        let blocked_ns = numbers(&self.program.line("blocked_ns")?)?;
        anyhow::ensure!(
            blocked_ns.len() as u64 == blocked,
            "{blocked} blocked calls but {} durations",
            blocked_ns.len()
        );
        let served = self.program.line("served")?.parse()?;
        Ok(OwnTimes {
            calls,
            blocked,
            blocked_ns,
            served,
        })
    }
}

fn lock_waits(metrics: &Metrics, pool: &str, primitive: &str, part: &str) -> f64 {
    metrics
        .value(
            &format!("poolscope_lock_wait_seconds_{part}"),
            &[
                ("service", SERVICE),
                ("pool", pool),
                ("primitive", primitive),
            ],
        )
        .unwrap_or(0.0)
}

/// Every futex lock wait of the service, over its pools.
fn service_futex_waits(metrics: &Metrics) -> f64 {
    metrics
        .samples
        .iter()
        .filter(|s| {
            s.name == "poolscope_lock_wait_seconds_count"
                && s.labels.iter().any(|(k, v)| k == "service" && v == SERVICE)
                && s.labels
                    .iter()
                    .any(|(k, v)| k == "primitive" && v == "futex")
        })
        .map(|s| s.value)
        .sum()
}

fn map_entries(metrics: &Metrics, map: &str) -> f64 {
    metrics
        .value("poolscope_map_entries", &[("map", map)])
        .unwrap_or(f64::NAN)
}

/// The quantiles of the top lock checked, each with how far in rank it may sit from
/// the program's. This load's waits cluster at whole hold times (3 ms: the other three
/// workers' holds; 4 and 6 ms: a woken waiter passed over), and its p99 falls in the
/// sparse stretch between 4 and 6 ms, where three calls move the value by a
/// millisecond: a check by value at p99 failed in CI (5.0 ms against the program's
/// 6.1 ms) while the two distributions agreed. Measured over six runs, binned in
/// poolscope's buckets, the cumulative shares differed by at most 0.49 % (at the
/// 3 ms cluster's edge, where the p50 sits: a call's µs on CPU move it across a
/// bucket bound) and by at most 6 calls of ~5,700 above 3.5 ms (0.1 %): each slack
/// is twice what was measured there.
const QUANTILE_CHECKS: [(f64, f64); 2] = [(0.5, 0.01), (0.99, 0.002)];

/// The values a quantile `q` poolscope reports of the program's blocked calls may
/// take: the program's `q ± slack` quantiles, widened by how far a fine bucket's
/// midpoint (what poolscope reports) can sit from a value in the bucket: at most in
/// the bucket `[8, 9)` steps wide, 8.5/9 below and 8.5/8 above.
fn quantile_bounds(own: &OwnTimes, q: f64, slack: f64) -> (f64, f64) {
    (
        own.quantile_s(q - slack) * 8.5 / 9.0,
        own.quantile_s(q + slack) * 8.5 / 8.0,
    )
}

fn within(ours: f64, truth: f64, tolerance: f64) -> bool {
    (ours - truth).abs() <= tolerance * truth
}

/// Waits until poolscope follows the workers (their pool has a series).
fn wait_for_pool(poolscope: &Poolscope) -> anyhow::Result<Metrics> {
    scrape_until(poolscope, |m| {
        m.value(
            "poolscope_pool_threads",
            &[("service", SERVICE), ("pool", LOCKER_POOL)],
        )
        .is_some()
    })
}

#[test]
fn contended_mutex_waits_match_the_program() -> anyhow::Result<()> {
    if !privileged("contended_mutex_waits_match_the_program") {
        return Ok(());
    }
    let _guard = one_at_a_time();
    // One client per worker: a worker that releases the mutex finds its next request
    // only after its client's round trip, so the waiter it woke takes the mutex
    // (few calls block twice) and every blocked call is one futex wait.
    const WORKERS: u32 = 4;
    let hold = Duration::from_millis(1);
    let server = LockServer::start(WORKERS, hold)?;
    let poolscope = Poolscope::start(&config(server.pid(), true))?;
    wait_for_pool(&poolscope)?;
    scrape_until(&poolscope, |m| {
        m.value("poolscope_lock_uprobe_processes", &[]) == Some(1.0)
    })?;

    let load = ClosedLoop::start(server.port, WORKERS as usize, Connections::PerRequest);
    std::thread::sleep(Duration::from_secs(6));
    let clients = load.stop()?;
    let metrics = settled_scrape(&poolscope)?;
    let json = poolscope.get(&format!("/debug/locks?service={SERVICE}&format=json"))?;
    let text = poolscope.get(&format!("/debug/locks?service={SERVICE}"))?;
    let own = server.finish()?;
    let futex_sum = lock_waits(&metrics, LOCKER_POOL, "futex", "sum");
    let futex_count = lock_waits(&metrics, LOCKER_POOL, "futex", "count");
    let mutex_sum = lock_waits(&metrics, LOCKER_POOL, "pthread_mutex", "sum");
    let mutex_count = lock_waits(&metrics, LOCKER_POOL, "pthread_mutex", "count");
    println!("clients: {} requests; program: {own:?}", clients.completed);
    println!(
        "ours: futex {futex_count} waits, {futex_sum:.4} s; pthread_mutex {mutex_count} calls, \
         {mutex_sum:.4} s\n{text}"
    );
    anyhow::ensure!(
        own.blocked > 500,
        "too little contention to compare: {own:?}"
    );

    // Totals: every blocked call's time is futex wait (plus the call's own µs).
    anyhow::ensure!(
        within(futex_sum, own.blocked_total_s(), 0.05),
        "futex wait {futex_sum:.4} s vs the program's blocked lock calls {:.4} s",
        own.blocked_total_s()
    );
    scorecard::within(
        "lock_wait_seconds_sum of futex, a contended pthread mutex",
        "the program's own time in its blocked pthread_mutex_lock calls",
        "-",
        futex_sum,
        own.blocked_total_s(),
        0.05,
    );
    // The uprobes time every pthread_mutex_lock call; the program calls it only
    // after a failed trylock, so exactly for its blocked calls.
    anyhow::ensure!(
        within(mutex_count, own.blocked as f64, 0.01),
        "pthread_mutex calls {mutex_count} vs {} blocked calls",
        own.blocked
    );
    scorecard::within(
        "lock_wait_seconds_count of pthread_mutex (uprobes)",
        "the program's count of its blocked pthread_mutex_lock calls",
        "-",
        mutex_count,
        own.blocked as f64,
        0.01,
    );
    anyhow::ensure!(
        within(mutex_sum, own.blocked_total_s(), 0.05),
        "pthread_mutex time {mutex_sum:.4} s vs {:.4} s",
        own.blocked_total_s()
    );
    scorecard::within(
        "lock_wait_seconds_sum of pthread_mutex (uprobes)",
        "the program's own time in its blocked pthread_mutex_lock calls",
        "-",
        mutex_sum,
        own.blocked_total_s(),
        0.05,
    );

    // The top lock: the one mutex, with the program's percentiles and stack.
    let report: serde_json::Value = serde_json::from_str(&json)?;
    let top = &report["locks"][0];
    let (waits, p50, p99) = (
        top["waits"].as_f64().unwrap_or(0.0),
        top["p50_seconds"].as_f64().unwrap_or(0.0),
        top["p99_seconds"].as_f64().unwrap_or(0.0),
    );
    anyhow::ensure!(
        within(top["wait_seconds"].as_f64().unwrap_or(0.0), futex_sum, 0.02),
        "the top lock does not hold the service's waits: {top}"
    );
    anyhow::ensure!(
        within(waits, own.blocked as f64, 0.05),
        "the top lock's {waits} waits vs {} blocked calls (calls that blocked twice?)",
        own.blocked
    );
    scorecard::within(
        "waits of the top lock in /debug/locks",
        "the program's count of its blocked pthread_mutex_lock calls",
        "-",
        waits,
        own.blocked as f64,
        0.05,
    );
    // glibc waits for a mutex without a timeout.
    anyhow::ensure!(
        top["timed_waits"].as_u64() == Some(0),
        "the mutex has timed waits: {top}"
    );
    for ((q, slack), ours) in QUANTILE_CHECKS.into_iter().zip([p50, p99]) {
        let (low, high) = quantile_bounds(&own, q, slack);
        anyhow::ensure!(
            (low..=high).contains(&ours),
            "top lock's {q} quantile {ours:.6} s vs the program's {low:.6} s to {high:.6} s \
             (its {:.4} to {:.4} quantiles, and a bucket's midpoint)",
            q - slack,
            q + slack
        );
        scorecard::bounded(
            "p50 and p99 of the top lock's waits in /debug/locks",
            "the same quantile of the program's own blocked-call times",
            "-",
            ours,
            own.quantile_s(q),
            "the program's q ± 1 % (p50) or ± 0.2 % (p99) quantiles, and half a fine bucket",
        );
    }
    let frames: Vec<&str> = top["stacks"][0]["frames"]
        .as_array()
        .map(|frames| frames.iter().filter_map(|f| f.as_str()).collect())
        .unwrap_or_default();
    // glibc's lock wait, then the program's functions (through Debian's glibc,
    // which has no frame pointers, by its unwind tables: see `callers.rs`).
    anyhow::ensure!(
        frames.first().is_some_and(|f| f.contains("lll_lock_wait")),
        "innermost frame is not glibc's lock wait: {frames:?}"
    );
    anyhow::ensure!(
        frames.iter().any(|f| f.starts_with("lockserver::worker+")),
        "no frame names the program's worker function: {frames:?}"
    );
    Ok(())
}

/// Once the load stopped: poolscope's numbers, read while the server still runs (its
/// series go with it).
fn settled_scrape(poolscope: &Poolscope) -> anyhow::Result<Metrics> {
    // Every wait in progress when the load stopped has ended by now.
    std::thread::sleep(Duration::from_millis(200));
    let metrics = poolscope.scrape()?;
    // The pool is known (a pool that never waited has no lock_wait_seconds series,
    // so their absence alone would prove nothing).
    anyhow::ensure!(
        metrics
            .value(
                "poolscope_pool_threads",
                &[("service", SERVICE), ("pool", LOCKER_POOL)],
            )
            .is_some(),
        "no series of the workers' pool"
    );
    Ok(metrics)
}

#[test]
fn uncontended_mutex_costs_no_lock_wait() -> anyhow::Result<()> {
    if !privileged("uncontended_mutex_costs_no_lock_wait") {
        return Ok(());
    }
    let _guard = one_at_a_time();
    let server = LockServer::start(1, Duration::from_micros(200))?;
    let poolscope = Poolscope::start(&config(server.pid(), false))?;
    wait_for_pool(&poolscope)?;
    let load = ClosedLoop::start(server.port, 2, Connections::PerRequest);
    std::thread::sleep(Duration::from_secs(3));
    let clients = load.stop()?;
    let metrics = settled_scrape(&poolscope)?;
    let own = server.finish()?;
    let waits = service_futex_waits(&metrics);
    println!(
        "{} requests, program {own:?}, futex lock waits {waits}",
        clients.completed
    );
    anyhow::ensure!(own.calls > 1000 && own.blocked == 0, "{own:?}");
    anyhow::ensure!(waits == 0.0, "{waits} futex lock waits without contention");
    anyhow::ensure!(
        map_entries(&metrics, "LOCKS") == 0.0,
        "LOCKS has entries without contention"
    );
    Ok(())
}

#[test]
fn idle_workers_on_a_condition_variable_are_not_lock_waits() -> anyhow::Result<()> {
    if !privileged("idle_workers_on_a_condition_variable_are_not_lock_waits") {
        return Ok(());
    }
    let _guard = one_at_a_time();
    // threadpool: 4 workers wait on the queue's condition variable between requests
    // (futex waits holding no request) and sleep 2 ms per request.
    let mut pool = Program::start("threadpool", &["4".into(), "2000".into(), "sleep".into()])?;
    let port: u16 = pool.line("port")?.parse()?;
    parse_tids(&pool.line("workers")?)?;
    let poolscope = Poolscope::start(&pids_config(SERVICE, &[pool.pid()]))?;
    scrape_until(&poolscope, |m| {
        m.value(
            "poolscope_pool_threads",
            &[("service", SERVICE), ("pool", "worker")],
        )
        .is_some()
    })?;
    let state = |m: &Metrics, state: &str| {
        m.value(
            "poolscope_thread_seconds_total",
            &[("service", SERVICE), ("pool", "worker"), ("state", state)],
        )
        .unwrap_or(0.0)
    };
    let before = poolscope.scrape()?;
    // Half-loaded: the workers are idle on the condition variable half the time.
    let load = OpenLoop::start(port, 1000.0, 16);
    std::thread::sleep(Duration::from_secs(3));
    let sent = load.stop()?;
    let after = poolscope.scrape()?;
    let idle = state(&after, "idle") - state(&before, "idle");
    let waits = service_futex_waits(&after);
    println!(
        "{} requests; worker idle {idle:.2} s; futex lock waits {waits}",
        sent.answered
    );
    anyhow::ensure!(idle > 3.0, "the workers were not idle: {idle:.2} s");
    anyhow::ensure!(
        waits == 0.0,
        "{waits} lock waits from workers waiting for work"
    );
    Ok(())
}

#[test]
fn a_process_killed_mid_wait_leaves_no_entries() -> anyhow::Result<()> {
    if !privileged("a_process_killed_mid_wait_leaves_no_entries") {
        return Ok(());
    }
    let _guard = one_at_a_time();
    // Held 300 ms per request with 4 clients: three workers are always inside
    // pthread_mutex_lock, blocked in futex, when the process is killed.
    let server = LockServer::start(4, Duration::from_millis(300))?;
    let pid = server.pid();
    let poolscope = Poolscope::start(&config(pid, true))?;
    wait_for_pool(&poolscope)?;
    let load = ClosedLoop::start(server.port, 4, Connections::PerRequest);
    let waiting = scrape_until(&poolscope, |m| {
        map_entries(m, "MUTEX_CALLS") >= 2.0 && map_entries(m, "LOCKS") >= 1.0
    })?;
    println!(
        "mid-wait: MUTEX_CALLS {}, LOCKS {}, THREADS {}",
        map_entries(&waiting, "MUTEX_CALLS"),
        map_entries(&waiting, "LOCKS"),
        map_entries(&waiting, "THREADS")
    );
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let after = scrape_until(&poolscope, |m| {
        map_entries(m, "MUTEX_CALLS") == 0.0
            && map_entries(m, "LOCKS") == 0.0
            && map_entries(m, "THREADS") == 0.0
    });
    // The clients fail once the server is gone; their errors are expected.
    let _ = load.stop();
    drop(server);
    let after = after?;
    println!(
        "after the kill: MUTEX_CALLS {}, LOCKS {}, THREADS {}",
        map_entries(&after, "MUTEX_CALLS"),
        map_entries(&after, "LOCKS"),
        map_entries(&after, "THREADS")
    );
    Ok(())
}

/// The lock maps full, from two `lockserver` processes of one service, each with its
/// own mutex and stack (`[limits] locks = 1`, `lock_stacks = 1`, `mutex_calls_in_flight
/// = 2`, with the `pthread_mutex_lock` probes):
/// - `LOCKS` keeps the first (process, lock, stack) and counts each wait of the other
///   as a failed insert (`E2BIG`); `/debug/locks` shows the one lock;
/// - `LOCK_STACKS` keeps the first stack; the other's is a collision (`EEXIST`),
///   counted, its wait kept without a stack: by design this does not degrade;
/// - `MUTEX_CALLS` holds two threads inside `pthread_mutex_lock`; the calls of the
///   others at the same time are not timed, each counted (`E2BIG`).
///
/// poolscope is degraded naming both keys to raise; the service's request numbers,
/// which no lock map holds, stay exact; when the processes exit, the maps empty and
/// poolscope is healthy again.
#[test]
fn full_lock_maps_are_counted_and_spare_the_request_numbers() -> anyhow::Result<()> {
    if !privileged("full_lock_maps_are_counted_and_spare_the_request_numbers") {
        return Ok(());
    }
    let _guard = one_at_a_time();
    let servers = [
        LockServer::start(4, Duration::from_millis(1))?,
        LockServer::start(4, Duration::from_millis(1))?,
    ];
    let config = format!(
        "[probes]\nlock_uprobes = [\"{SERVICE}\"]\n[limits]\nlocks = 1\nlock_stacks = 1\n\
         mutex_calls_in_flight = 2\ndegraded_for = \"2s\"\n{}",
        pids_config(SERVICE, &[servers[0].pid(), servers[1].pid()])
    );
    let mut poolscope = Poolscope::start(&config)?;
    wait_for_pool(&poolscope)?;
    scrape_until(&poolscope, |m| {
        m.value("poolscope_lock_uprobe_processes", &[]) == Some(2.0)
    })?;
    let loads: Vec<ClosedLoop> = servers
        .iter()
        .map(|server| ClosedLoop::start(server.port, 4, Connections::PerRequest))
        .collect();
    let failed = |m: &Metrics, map: &str, errno: &str| {
        m.value(
            "poolscope_map_update_errors_total",
            &[("map", map), ("errno", errno)],
        )
        .unwrap_or(0.0)
    };
    let during = scrape_until(&poolscope, |m| {
        failed(m, "LOCKS", "E2BIG") > 0.0
            && failed(m, "LOCK_STACKS", "EEXIST") > 0.0
            && failed(m, "MUTEX_CALLS", "E2BIG") > 0.0
    })?;
    let health = poolscope.get("/healthz")?;
    // The maps stay full while the load goes on: a second of requests to compare.
    std::thread::sleep(Duration::from_secs(1));
    let report: serde_json::Value = serde_json::from_str(
        &poolscope.get(&format!("/debug/locks?service={SERVICE}&format=json"))?,
    )?;
    let made: u64 = loads
        .into_iter()
        .map(|load| load.stop().map(|stats| stats.completed))
        .sum::<anyhow::Result<u64>>()?;
    let counted = scrape_until(&poolscope, |m| requests_settled(m, SERVICE, made))?
        .value("poolscope_requests_total", &[("service", SERVICE)]);
    println!(
        "failed inserts: LOCKS {}, LOCK_STACKS {}, MUTEX_CALLS {}; entries: LOCKS {}, \
         MUTEX_CALLS ≤ 2; requests counted {counted:?} of {made}\n{health}",
        failed(&during, "LOCKS", "E2BIG"),
        failed(&during, "LOCK_STACKS", "EEXIST"),
        failed(&during, "MUTEX_CALLS", "E2BIG"),
        map_entries(&during, "LOCKS"),
    );
    assert_eq!(map_entries(&during, "LOCKS"), 1.0);
    assert!(map_entries(&during, "MUTEX_CALLS") <= 2.0);
    assert_eq!(
        report["locks"].as_array().map(Vec::len),
        Some(1),
        "{report}"
    );
    assert_eq!(during.value("poolscope_degraded", &[]), Some(1.0));
    assert!(
        health.contains("raise limits.locks")
            && health.contains("raise limits.mutex_calls_in_flight"),
        "{health}"
    );
    assert!(!health.contains("LOCK_STACKS"), "{health}");
    let served: u64 = servers
        .into_iter()
        .map(|server| server.finish().map(|own| own.served))
        .sum::<anyhow::Result<u64>>()?;
    assert_eq!((counted, made), (Some(served as f64), served));

    let recovered = scrape_until(&poolscope, |m| {
        m.value("poolscope_degraded", &[]) == Some(0.0)
    })?;
    assert_eq!(map_entries(&recovered, "LOCKS"), 0.0);
    assert_eq!(map_entries(&recovered, "MUTEX_CALLS"), 0.0);
    assert_eq!(poolscope.get("/healthz")?, "ok\n");
    let log = poolscope.stop_and_log();
    assert!(
        log.contains("kernel map LOCKS is full (capacity 1): raise limits.locks"),
        "{log}"
    );
    Ok(())
}

/// Every map whose entries poolscope counts as they are made and removed (instead of
/// walking it at each scrape) holds what its `map_entries` says, by a walk of its
/// keys with the kernel's own calls: after churn of every kind (connections made
/// and closed, syscalls and `pthread_mutex_lock` calls in flight, contended locks,
/// stack samples, connections and blocked accepts older than poolscope, adopted),
/// at rest with entries in each, and once the server is gone. A reading counts
/// once two scrapes around the walk agree (the maps move while threads run).
#[test]
fn counted_map_entries_match_a_walk_of_each_map() -> anyhow::Result<()> {
    if !privileged("counted_map_entries_match_a_walk_of_each_map") {
        return Ok(());
    }
    let _guard = one_at_a_time();
    for backend in poolscope_tests::backends() {
        let server = LockServer::start(4, Duration::from_millis(1))?;
        // Older than poolscope: two connections whose workers wait for the request
        // (adopted), and two workers blocked in accept.
        let mut early: Vec<TcpStream> = (0..2)
            .map(|_| TcpStream::connect(("127.0.0.1", server.port)))
            .collect::<Result<_, _>>()?;
        std::thread::sleep(Duration::from_millis(200));
        let config = format!(
            "[probes]\nbackend = \"{backend}\"\nlock_uprobes = [\"{SERVICE}\"]\n{}",
            pids_config(SERVICE, &[server.pid()])
        );
        let poolscope = Poolscope::start(&config)?;
        wait_for_pool(&poolscope)?;
        for stream in &mut early {
            stream.write_all(b"req\n")?;
        }
        let load = ClosedLoop::start(server.port, 4, Connections::PerRequest);
        std::thread::sleep(Duration::from_secs(2));
        let made = load.stop()?.completed;
        // (The two older requests may or may not count: adoption.rs says which.)
        scrape_until(&poolscope, |m| requests_settled(m, SERVICE, made))?;
        // At rest with entries: two connections whose requests are not sent yet
        // (their workers blocked in read), the other two workers in accept.
        let idle: Vec<TcpStream> = (0..2)
            .map(|_| TcpStream::connect(("127.0.0.1", server.port)))
            .collect::<Result<_, _>>()?;
        let mut maps = vec!["LOCKS", "STACK_COUNTS", "MUTEX_CALLS"];
        maps.extend(match backend {
            "syscall" => ["CONNS", "PENDING_CALLS"].as_slice(),
            _ => ["LISTEN_PORTS", "ADOPT"].as_slice(),
        });
        let at_rest = compare_with_walks(&poolscope, &maps)?;
        println!("{backend} backend, at rest: (map, map_entries, walked) {at_rest:?}");
        let entries = |map: &str| at_rest.iter().find(|(name, ..)| *name == map).map(|e| e.1);
        assert!(
            entries("LOCKS") >= Some(1),
            "no contended lock: {at_rest:?}"
        );
        if backend == "syscall" {
            // The two idle connections, and the four workers' reads and accepts.
            assert_eq!(entries("CONNS"), Some(2), "{at_rest:?}");
            assert_eq!(entries("PENDING_CALLS"), Some(4), "{at_rest:?}");
        } else {
            assert_eq!(entries("LISTEN_PORTS"), Some(1), "{at_rest:?}");
        }
        drop(idle);
        drop(server);
        scrape_until(&poolscope, |m| {
            m.value("poolscope_targets", &[("service", SERVICE)])
                .is_none()
                // The exit is followed at once, its listener at the next rescan.
                && map_entries(m, "LISTEN_PORTS") == 0.0
        })?;
        let gone = compare_with_walks(&poolscope, &maps)?;
        println!("{backend} backend, server gone: {gone:?}");
        // Its stack counts stay until their generation is drained; nothing else.
        assert!(
            gone.iter()
                .all(|(map, entries, _)| *map == "STACK_COUNTS" || *entries == 0),
            "{gone:?}"
        );
    }
    Ok(())
}

/// For each of `maps`: its name, `map_entries` and a walk of its keys, taken where
/// two scrapes around the walk agree (5 s at most); fails where they differ.
fn compare_with_walks(
    poolscope: &Poolscope,
    maps: &[&'static str],
) -> anyhow::Result<Vec<(&'static str, u64, u64)>> {
    let mut readings = Vec::new();
    for &map in maps {
        let mut reading = None;
        for _ in 0..50 {
            let before = map_entries(&poolscope.scrape()?, map);
            let walked = walked_entries(poolscope.pid(), map)? as u64;
            let after = map_entries(&poolscope.scrape()?, map);
            if before == after {
                reading = Some((map, before as u64, walked));
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let Some(reading) = reading else {
            anyhow::bail!("{map} never held still for two scrapes");
        };
        anyhow::ensure!(
            reading.1 == reading.2,
            "{map}: map_entries {} but {} keys walked",
            reading.1,
            reading.2
        );
        readings.push(reading);
    }
    Ok(readings)
}
