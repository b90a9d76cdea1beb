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
//!   the exec pool's lock waits are next to nothing. (Not `/sleep`: HotSpot's
//!   `Thread.sleep` parks the thread on a condition variable, a futex wait that
//!   poolscope cannot tell from a lock's: under `/sleep` the exec pool is
//!   `blocked_lock` > 90 % of its time.)
//!
//! The numbers go to stderr (`--nocapture`).
use std::{
    collections::BTreeMap,
    net::TcpListener,
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use poolscope_tests::{
    Metrics, Poolscope, one_at_a_time, pids_config, privileged,
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

/// A free port below 10000 on all interfaces (see [`Options::any_address`]).
fn free_short_port() -> anyhow::Result<u16> {
    // Spread over the range so that concurrent runs rarely try the same ports.
    let start = 2000 + (std::process::id() % 7000) as u16;
    (start..10_000)
        .chain(2000..start)
        .find(|port| {
            TcpListener::bind(("0.0.0.0", *port)).is_ok()
                && TcpListener::bind(("127.0.0.1", *port)).is_ok()
        })
        .context("no free port below 10000")
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
}

impl Locks {
    fn minus(self, base: Locks) -> Locks {
        Locks {
            blocked_lock: self.blocked_lock - base.blocked_lock,
            waits: self.waits - base.waits,
            wait_seconds: self.wait_seconds - base.wait_seconds,
        }
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
    eprintln!("{what}: | pool | blocked_lock s | futex waits | futex wait s |");
    for (name, locks) in &phase.pools {
        eprintln!(
            "{what}: | {name} | {:.3} | {} | {:.3} |",
            locks.blocked_lock, locks.waits, locks.wait_seconds
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
            others.blocked_lock += locks.blocked_lock;
            others.waits += locks.waits;
            others.wait_seconds += locks.wait_seconds;
        }
    }
    Ok((pool, others))
}

#[test]
fn tomcat_synchronized_block_shows_lock_waits_in_the_exec_pool() -> anyhow::Result<()> {
    if !privileged("tomcat_synchronized_block_shows_lock_waits_in_the_exec_pool") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let locked = format!("/locked?ms={HOLD_MS}");
    let spin = format!("/spin?us={}", HOLD_MS * 1000);

    let service = "tomcat-locks";
    let port = free_short_port()?;
    let options = Options {
        threads: Some(CONNECTIONS),
        work: true,
        any_address: true,
    };
    let server = RealServer::start_with(Kind::Tomcat, port, &options)?;
    // The first request to each JSP compiles it.
    for path in [&locked, &spin] {
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
    for (what, phase) in [("/locked", &contended), ("/spin", &control)] {
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
    // bounded below only: nearly every request waits.
    assert!(
        pool.waits >= 0.8 * contended.wrk.requests as f64,
        "{exec}: {} futex waits under /locked for {} requests that each queue for the monitor",
        pool.waits,
        contended.wrk.requests
    );
    assert!(
        pool.wait_seconds >= 0.8 * truth && pool.wait_seconds <= 1.05 * truth,
        "{exec}: lock_wait_seconds_sum {:.2} s under /locked, truth {truth:.2} s (bounds 80–105 %)",
        pool.wait_seconds
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
    Ok(())
}
