//! Lock waits on a real runtime, against what queueing says they must be:
//! - Tomcat (maxThreads = C) under C wrk connections to a JSP whose every request
//!   holds one shared `synchronized` monitor for H ms (on CPU). The monitor serializes
//!   the requests: it is always held (wrk's throughput is ≈ 1/H) and the C − 1 other
//!   requests in the servlet wait for it, parked by HotSpot in futex waits. So over a
//!   run of D seconds the exec pool's waits add up to ≈ (C − 1) × D, and nearly every
//!   request waits at least once. Checked on `thread_seconds_total{state="blocked_lock"}`
//!   and on `lock_wait_seconds{primitive="futex"}` (`_sum` and `_count`) of the exec
//!   pool (`http-nio-PORT-e`); the other pools of the JVM (poller, acceptor, GC, JIT,
//!   main…) serve no request, so their futex waits are idle time and count as no lock
//!   wait.
//! - Control: the same load on a JSP that only spins for H ms, without the monitor:
//!   the exec pool's lock waits are next to nothing.
//! - Timed waits: the same load on a JSP that calls `Thread.sleep(H)`. HotSpot parks
//!   the sleeping thread on a condition variable with a deadline, a futex wait with
//!   a timeout: `lock_wait_seconds{primitive="futex_timed"}` adds up to the requests'
//!   sleeps (requests × H), and the untimed `futex` waits stay next to nothing, while
//!   under `/locked` the waits for the monitor are mostly untimed.
//!
//! The numbers go to stderr (`--nocapture`).
use std::{
    collections::BTreeMap,
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use poolscope_tests::{
    Metrics, Poolscope, free_short_port, one_at_a_time, pids_config, privileged, scorecard,
    servers::{Kind, Options, RealServer, WrkResult, get, wrk_path},
    thread_names, watch_with,
};

/// Concurrent requests: wrk connections and Tomcat's maxThreads.
const CONNECTIONS: u32 = 8;
/// How long each request holds the monitor, in ms.
const HOLD_MS: u64 = 5;
/// How long wrk runs in each phase.
const LOAD: Duration = Duration::from_secs(5);
/// After wrk stops, for the last waits to end and the pools to be sampled again.
const SETTLE: Duration = Duration::from_millis(1500);

/// Starts poolscope on `pids` and waits until it watches all of them.
fn watch(service: &str, pids: &[u32]) -> anyhow::Result<Poolscope> {
    watch_with(&pids_config(service, pids), service, pids)
}

/// One pool's lock numbers in a scrape. A series not there yet counts as 0: the
/// histogram's series appear with the pool's first wait.
#[derive(Clone, Copy, Debug, Default)]
struct Locks {
    /// `thread_seconds_total{state="blocked_lock"}`.
    blocked_lock: f64,
    /// `lock_wait_seconds_count{primitive="futex"}`.
    waits: f64,
    /// `lock_wait_seconds_sum{primitive="futex"}`.
    wait_seconds: f64,
    /// `lock_wait_seconds_count{primitive="futex_timed"}`.
    timed_waits: f64,
    /// `lock_wait_seconds_sum{primitive="futex_timed"}`.
    timed_wait_seconds: f64,
}

impl Locks {
    fn minus(self, base: Locks) -> Locks {
        Locks {
            blocked_lock: self.blocked_lock - base.blocked_lock,
            waits: self.waits - base.waits,
            wait_seconds: self.wait_seconds - base.wait_seconds,
            timed_waits: self.timed_waits - base.timed_waits,
            timed_wait_seconds: self.timed_wait_seconds - base.timed_wait_seconds,
        }
    }

    fn add(&mut self, other: Locks) {
        self.blocked_lock += other.blocked_lock;
        self.waits += other.waits;
        self.wait_seconds += other.wait_seconds;
        self.timed_waits += other.timed_waits;
        self.timed_wait_seconds += other.timed_wait_seconds;
    }

    /// Futex lock waits' time, timed or not.
    fn all_wait_seconds(self) -> f64 {
        self.wait_seconds + self.timed_wait_seconds
    }
}

/// Every pool of `service` (from `pool_threads`), with its lock numbers.
fn locks(metrics: &Metrics, service: &str) -> BTreeMap<String, Locks> {
    let mut pools = BTreeMap::new();
    for sample in &metrics.samples {
        let label = |key: &str| {
            sample
                .labels
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        };
        if sample.name != "poolscope_pool_threads" || label("service") != Some(service) {
            continue;
        }
        let Some(pool) = label("pool") else {
            continue;
        };
        let futex = [("service", service), ("pool", pool), ("primitive", "futex")];
        let timed = [
            ("service", service),
            ("pool", pool),
            ("primitive", "futex_timed"),
        ];
        let value = |name: &str, labels: &[(&str, &str)]| metrics.value(name, labels);
        pools.insert(
            pool.to_owned(),
            Locks {
                blocked_lock: value(
                    "poolscope_thread_seconds_total",
                    &[
                        ("service", service),
                        ("pool", pool),
                        ("state", "blocked_lock"),
                    ],
                )
                .unwrap_or(f64::NAN),
                waits: value("poolscope_lock_wait_seconds_count", &futex).unwrap_or(0.0),
                wait_seconds: value("poolscope_lock_wait_seconds_sum", &futex).unwrap_or(0.0),
                timed_waits: value("poolscope_lock_wait_seconds_count", &timed).unwrap_or(0.0),
                timed_wait_seconds: value("poolscope_lock_wait_seconds_sum", &timed).unwrap_or(0.0),
            },
        );
    }
    pools
}

/// What one load phase did.
struct Phase {
    wrk: WrkResult,
    /// Wall time from the scrape before wrk to the one after.
    wall: f64,
    /// Per pool, the change over the phase.
    pools: BTreeMap<String, Locks>,
    before: Metrics,
    after: Metrics,
}

const STATES: [&str; 5] = ["running", "runnable", "blocked_lock", "blocked_io", "idle"];

impl Phase {
    /// `pool`'s thread seconds per state over the phase, for the record.
    fn states(&self, service: &str, pool: &str) -> String {
        STATES
            .iter()
            .map(|state| {
                let labels = [("service", service), ("pool", pool), ("state", *state)];
                let seconds = |metrics: &Metrics| {
                    metrics
                        .value("poolscope_thread_seconds_total", &labels)
                        .unwrap_or(0.0)
                };
                format!(
                    "{state} {:.2}",
                    seconds(&self.after) - seconds(&self.before)
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Scrapes, runs wrk on `path` with [`CONNECTIONS`] for [`LOAD`], waits [`SETTLE`],
/// scrapes again.
fn phase(poolscope: &Poolscope, service: &str, port: u16, path: &str) -> anyhow::Result<Phase> {
    let started = Instant::now();
    let before = poolscope.scrape()?;
    let wrk = wrk_path(port, path, 1, CONNECTIONS, LOAD)?;
    anyhow::ensure!(
        wrk.socket_errors == 0 && wrk.non_2xx == 0,
        "wrk saw errors on {path}: {wrk:?}"
    );
    sleep(SETTLE);
    let after = poolscope.scrape()?;
    let wall = started.elapsed().as_secs_f64();
    let base = locks(&before, service);
    let pools = locks(&after, service)
        .into_iter()
        .map(|(name, locks)| {
            let delta = locks.minus(base.get(&name).copied().unwrap_or_default());
            (name, delta)
        })
        .collect();
    Ok(Phase {
        wrk,
        wall,
        pools,
        before,
        after,
    })
}

fn print_phase(what: &str, phase: &Phase) {
    eprintln!(
        "{what}: wrk {} requests in {:.2} s ({:.0}/s), p50 {:?}, p99 {:?}; scrapes {:.2} s apart",
        phase.wrk.requests,
        phase.wrk.seconds,
        phase.wrk.requests_per_second(),
        phase.wrk.p50,
        phase.wrk.p99,
        phase.wall
    );
    eprintln!(
        "{what}: | pool | blocked_lock s | futex waits | futex wait s | futex_timed waits | futex_timed wait s |"
    );
    for (name, locks) in &phase.pools {
        eprintln!(
            "{what}: | {name} | {:.3} | {} | {:.3} | {} | {:.3} |",
            locks.blocked_lock,
            locks.waits,
            locks.wait_seconds,
            locks.timed_waits,
            locks.timed_wait_seconds
        );
    }
}

/// The exec pool's numbers and the other pools' summed.
fn split(phase: &Phase, exec: &str) -> anyhow::Result<(Locks, Locks)> {
    let pool = *phase
        .pools
        .get(exec)
        .with_context(|| format!("no pool {exec:?}; pools: {:?}", phase.pools.keys()))?;
    let mut others = Locks::default();
    for (name, locks) in &phase.pools {
        if name != exec {
            others.add(*locks);
        }
    }
    Ok((pool, others))
}

#[test]
fn tomcat_monitor_waits_are_lock_waits_and_sleeps_are_timed_ones() -> anyhow::Result<()> {
    if !privileged("tomcat_monitor_waits_are_lock_waits_and_sleeps_are_timed_ones") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let locked = format!("/locked?ms={HOLD_MS}");
    let spin = format!("/spin?us={}", HOLD_MS * 1000);
    let sleeping = format!("/sleep?ms={HOLD_MS}");

    let service = "tomcat-locks";
    let port = free_short_port()?;
    let options = Options {
        threads: Some(CONNECTIONS),
        work: true,
        any_address: true,
        ..Options::default()
    };
    let server = RealServer::start_with(Kind::Tomcat, port, &options)?;
    // The first request to each JSP compiles it.
    for path in [&locked, &spin, &sleeping] {
        let compiled = Instant::now();
        get(port, path)?;
        eprintln!("tomcat: first {path} took {:?}", compiled.elapsed());
    }
    let pids = server.pids();
    eprintln!("tomcat threads on port {port}: {:?}", thread_names(&pids)?);
    let poolscope = watch(service, &pids)?;
    // 15 characters of "http-nio-PORT-exec-N".
    let exec = format!("http-nio-{port}-e");

    let contended = phase(&poolscope, service, port, &locked)?;
    print_phase("tomcat /locked", &contended);
    let control = phase(&poolscope, service, port, &spin)?;
    print_phase("tomcat /spin", &control);
    let (pool, others) = split(&contended, &exec)?;
    let (control_pool, _) = split(&control, &exec)?;
    let slept = phase(&poolscope, service, port, &sleeping)?;
    print_phase("tomcat /sleep", &slept);
    let (sleep_pool, sleep_others) = split(&slept, &exec)?;
    let report: serde_json::Value = serde_json::from_str(&poolscope.get(&format!(
        "/debug/locks?service={service}&format=json&limit=1000"
    ))?)?;
    let reported = |field: &str| -> u64 {
        report["locks"]
            .as_array()
            .map(|locks| locks.iter().filter_map(|lock| lock[field].as_u64()).sum())
            .unwrap_or(0)
    };
    let (reported_waits, reported_timed) = (reported("waits"), reported("timed_waits"));
    // Since poolscope started: every pool's futex waits, timed or not.
    let mut counted = Locks::default();
    for pool in locks(&slept.after, service).into_values() {
        counted.add(pool);
    }
    eprintln!(
        "tomcat: /debug/locks: {reported_waits} waits, {reported_timed} timed; lock_wait_seconds_count: futex {}, futex_timed {}",
        counted.waits, counted.timed_waits
    );

    // The monitor is always held, so requests complete one per hold: wrk's throughput
    // says how long it really was held (H plus the hand-over to the next owner).
    let hold = contended.wrk.seconds / contended.wrk.requests as f64;
    // Closed loop, saturated monitor: C requests in the servlet, one holding, C − 1
    // waiting, for the whole run (Little: each request waits ≈ (C − 1) × hold).
    let waiting = f64::from(CONNECTIONS - 1);
    let truth = waiting * contended.wrk.seconds;
    eprintln!(
        "tomcat: monitor held {:.2} ms per request (asked {HOLD_MS} ms); truth: {waiting} requests waiting × {:.2} s = {truth:.2} s of waits, ≈ 1 wait per request ({})",
        hold * 1e3,
        contended.wrk.seconds,
        contended.wrk.requests
    );
    eprintln!(
        "tomcat: {exec} under /locked: blocked_lock {:.2} s ({:.0} % of truth), futex waits {} ({:.2} per request), futex wait sum {:.2} s ({:.0} % of truth); other pools: blocked_lock {:.3} s, futex wait sum {:.3} s",
        pool.blocked_lock,
        pool.blocked_lock / truth * 100.0,
        pool.waits,
        pool.waits / contended.wrk.requests as f64,
        pool.wait_seconds,
        pool.wait_seconds / truth * 100.0,
        others.blocked_lock,
        others.wait_seconds
    );
    // Every request sleeps H ms (at least) in Thread.sleep.
    let slept_truth = slept.wrk.requests as f64 * HOLD_MS as f64 * 1e-3;
    eprintln!(
        "tomcat: {exec} under /locked: untimed futex waits {:.2} s, timed {:.2} s ({} waits, {:.1} % of the wait time)",
        pool.wait_seconds,
        pool.timed_wait_seconds,
        pool.timed_waits,
        pool.timed_wait_seconds / pool.all_wait_seconds() * 100.0
    );
    eprintln!(
        "tomcat: {exec} under /sleep: truth {} requests × {HOLD_MS} ms = {slept_truth:.2} s of sleep; futex_timed {} waits, {:.2} s ({:.0} % of truth); untimed futex {} waits, {:.3} s; blocked_lock {:.2} s; other pools: futex {:.3} s, futex_timed {:.3} s",
        slept.wrk.requests,
        sleep_pool.timed_waits,
        sleep_pool.timed_wait_seconds,
        sleep_pool.timed_wait_seconds / slept_truth * 100.0,
        sleep_pool.waits,
        sleep_pool.wait_seconds,
        sleep_pool.blocked_lock,
        sleep_others.wait_seconds,
        sleep_others.timed_wait_seconds
    );
    for (what, phase) in [
        ("/locked", &contended),
        ("/spin", &control),
        ("/sleep", &slept),
    ] {
        eprintln!(
            "tomcat: {exec} thread seconds under {what}: {}",
            phase.states(service, &exec)
        );
    }
    eprintln!(
        "tomcat: {exec} under /spin (control): blocked_lock {:.3} s, futex waits {}, futex wait sum {:.3} s",
        control_pool.blocked_lock, control_pool.waits, control_pool.wait_seconds
    );

    // The monitor really serialized the requests: at most one per hold.
    assert!(
        hold >= HOLD_MS as f64 * 1e-3 * 0.95,
        "{:.0} requests/s on /locked: more than one per {HOLD_MS} ms, the monitor did not serialize them",
        contended.wrk.requests_per_second()
    );

    // Thread states (poolscope today): blocked_lock is the waits for the monitor.
    // Below the truth: a request's time outside the servlet (network, parsing, wrk's
    // turn) and a woken waiter's time in the run queue are no futex wait; on two CPUs
    // shared with wrk that is ≈ 10–12 % of the truth, seen as `runnable`. Above: never
    // more than C − 1 requests wait at once, and only while wrk runs; 5 % for the
    // edges of wrk's clock.
    assert!(
        pool.blocked_lock >= 0.8 * truth && pool.blocked_lock <= 1.05 * truth,
        "{exec}: blocked_lock {:.2} s under /locked, truth {truth:.2} s (bounds 80–105 %)",
        pool.blocked_lock
    );
    scorecard::bounded(
        "thread_seconds_total of blocked_lock, Tomcat requests queued on one monitor",
        "(C − 1) requests waiting × wrk's run time",
        "-",
        pool.blocked_lock,
        truth,
        "80–105 % of the truth",
    );
    assert!(
        others.blocked_lock <= 0.02 * truth,
        "pools other than {exec} have {:.3} s of blocked_lock: threads that serve no request do not wait for locks",
        others.blocked_lock
    );
    assert!(
        control_pool.blocked_lock <= 0.02 * truth,
        "{exec}: blocked_lock {:.3} s under /spin, which takes no lock",
        control_pool.blocked_lock
    );

    // lock_wait_seconds{primitive="futex"}: each wait for the monitor is a futex
    // wait, from the block until back on CPU: the woken waiter's run-queue time is in
    // the sum too, which stays within the same bounds. A request may park more than
    // once (a woken waiter can lose the monitor to a newcomer), so the count is
    // bounded below only: nearly every request waits. HotSpot parks a monitor's
    // waiters without a timeout (all but its rare "responsible" waiter, which
    // rechecks on a timer): the timed ones are a sliver.
    assert!(
        pool.waits >= 0.8 * contended.wrk.requests as f64,
        "{exec}: {} futex waits under /locked for {} requests that each queue for the monitor",
        pool.waits,
        contended.wrk.requests
    );
    assert!(
        pool.all_wait_seconds() >= 0.8 * truth && pool.all_wait_seconds() <= 1.05 * truth,
        "{exec}: lock_wait_seconds_sum {:.2} s (futex and futex_timed) under /locked, truth {truth:.2} s (bounds 80–105 %)",
        pool.all_wait_seconds()
    );
    scorecard::bounded(
        "lock_wait_seconds_sum, Tomcat requests queued on one monitor",
        "(C − 1) requests waiting × wrk's run time",
        "-",
        pool.all_wait_seconds(),
        truth,
        "80–105 % of the truth",
    );
    assert!(
        pool.wait_seconds >= 0.9 * pool.all_wait_seconds(),
        "{exec}: only {:.2} of {:.2} s of the waits for the monitor are untimed futex waits",
        pool.wait_seconds,
        pool.all_wait_seconds()
    );
    assert!(
        others.wait_seconds <= 0.02 * truth,
        "pools other than {exec}: lock_wait_seconds_sum {:.3} s: idle waits counted as lock waits",
        others.wait_seconds
    );
    assert!(
        control_pool.wait_seconds <= 0.02 * truth
            && control_pool.waits <= 0.05 * control.wrk.requests as f64,
        "{exec}: {} futex waits, {:.3} s under /spin, which takes no lock",
        control_pool.waits,
        control_pool.wait_seconds
    );

    // Thread.sleep: one timed futex wait per request, at least H long, and no longer
    // than the C threads' time under load (measured: 107 % of requests × H, the
    // timer's slack and the woken thread's run-queue time on two busy CPUs). wrk
    // counts only the answers it read: up to C more requests ran.
    let sleep_bound = f64::from(CONNECTIONS) * slept.wrk.seconds;
    assert!(
        sleep_pool.timed_waits >= slept.wrk.requests as f64
            && sleep_pool.timed_waits <= (slept.wrk.requests + 2 * u64::from(CONNECTIONS)) as f64,
        "{exec}: {} futex_timed waits under /sleep for {} requests that each sleep once",
        sleep_pool.timed_waits,
        slept.wrk.requests
    );
    assert!(
        sleep_pool.timed_wait_seconds >= 0.98 * slept_truth
            && sleep_pool.timed_wait_seconds <= sleep_bound,
        "{exec}: futex_timed wait sum {:.2} s under /sleep, truth {slept_truth:.2} s of sleep, at most {sleep_bound:.2} s of requests in the servlet",
        sleep_pool.timed_wait_seconds
    );
    scorecard::bounded(
        "lock_wait_seconds_sum of futex_timed, Tomcat requests in Thread.sleep",
        "wrk's requests × the sleep (H = 5 ms)",
        "-",
        sleep_pool.timed_wait_seconds,
        slept_truth,
        "from 98 % of the truth to C × wrk's run time",
    );
    assert!(
        sleep_pool.wait_seconds <= 0.02 * slept_truth,
        "{exec}: {:.3} s of untimed futex waits under /sleep, which takes no lock",
        sleep_pool.wait_seconds
    );
    // /debug/locks tells the same waits apart per lock (the waits of the scrape and
    // of the report were all over before either was read).
    assert!(
        reported_timed as f64 == counted.timed_waits
            && reported_waits as f64 == counted.waits + counted.timed_waits,
        "/debug/locks: {reported_waits} waits, {reported_timed} timed; metrics: {} untimed, {} timed",
        counted.waits,
        counted.timed_waits
    );
    // The thread state does not tell them apart: both are waits on another thread's
    // futex (see docs/metrics.md, thread states).
    assert!(
        sleep_pool.blocked_lock >= 0.9 * sleep_pool.timed_wait_seconds,
        "{exec}: blocked_lock {:.2} s under /sleep, futex_timed waits {:.2} s",
        sleep_pool.blocked_lock,
        sleep_pool.timed_wait_seconds
    );
    Ok(())
}
