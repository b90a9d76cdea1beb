//! Ground truth for thread states and pools, against the real kernel:
//! - each watched thread's time on CPU and in the run queue against the kernel's own
//!   accounting (/proc/<pid>/task/<tid>/schedstat fields 1 and 2);
//! - `threadpool` (N named workers, service time S) under open-loop arrivals at rate
//!   λ: pool utilization = λ·S/N, and the busy time is the state the work puts the
//!   worker in (spinning → running, sleeping → blocked_io, waiting on a mutex another
//!   thread holds → blocked_lock), while idle workers waiting on the pool's queue are
//!   idle, never blocked_lock;
//! - two spinning threads pinned to one CPU: each is runnable half the time.
use std::time::{Duration, Instant};

use poolscope_tests::{
    Metrics, Poolscope, Program, ThreadRow, backends, cpu_steal_seconds, load::OpenLoop,
    one_at_a_time, parse_debug_threads, parse_tids, privileged, schedstat, scorecard, scrape_until,
    servers::pin_to_first_cpu,
};

const WORKER_POOL: &str = "worker";

/// Each thread's row of `/debug/threads` with its schedstat.
type Reading = Vec<(ThreadRow, (u64, u64, u64))>;
/// Clients of the open-loop load: enough that arrivals keep their schedule up to
/// overload.
const SENDERS: usize = 64;

/// Watches each (service, pid) with the given request backend and utilization window.
fn config(backend: &str, window: Duration, targets: &[(&str, u32)]) -> String {
    let mut text = format!(
        "[probes]\nbackend = \"{backend}\"\n[pools]\nutilization_window = \"{}s\"\n\
         [discovery]\nrescan_interval = \"500ms\"\n",
        window.as_secs()
    );
    for (service, pid) in targets {
        text.push_str(&format!(
            "[[targets]]\nservice = \"{service}\"\npids = [{pid}]\n"
        ));
    }
    text
}

struct ThreadPool {
    program: Program,
    port: u16,
    workers: Vec<u32>,
}

impl ThreadPool {
    /// The time its workers spent on requests so far, by their own clock.
    fn busy(&mut self) -> anyhow::Result<Duration> {
        self.program.send("busy")?;
        let line = self.program.line("busy")?;
        let busy_ns = line
            .split_whitespace()
            .nth(1)
            .and_then(|ns| ns.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("busy line {line:?}"))?;
        Ok(Duration::from_nanos(busy_ns))
    }

    fn start(workers: u32, service: Duration, work: &str) -> anyhow::Result<Self> {
        let mut program = Program::start(
            "threadpool",
            &[
                workers.to_string(),
                service.as_micros().to_string(),
                work.to_owned(),
            ],
        )?;
        let port = program.line("port")?.parse()?;
        let workers = parse_tids(&program.line("workers")?)?;
        Ok(Self {
            program,
            port,
            workers,
        })
    }
}

/// Waits until every thread in `tids` is in a named pool.
fn wait_for_pools(poolscope: &Poolscope, tids: &[u32]) -> anyhow::Result<Vec<ThreadRow>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rows = parse_debug_threads(&poolscope.get("/debug/threads")?)?;
        let named = tids
            .iter()
            .all(|tid| rows.iter().any(|row| row.tid == *tid && row.pool != "-"));
        if named {
            return Ok(rows);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "threads {tids:?} not all in pools: {rows:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn pool_value(metrics: &Metrics, name: &str, service: &str, extra: &[(&str, &str)]) -> f64 {
    let mut labels = vec![("service", service), ("pool", WORKER_POOL)];
    labels.extend_from_slice(extra);
    metrics.value(name, &labels).unwrap_or(f64::NAN)
}

const STATES: [&str; 5] = ["running", "runnable", "blocked_lock", "blocked_io", "idle"];

/// Thread seconds per state of the worker pool between two scrapes.
fn state_deltas(before: &Metrics, after: &Metrics, service: &str) -> [f64; 5] {
    STATES.map(|state| {
        let value = |m: &Metrics| {
            pool_value(
                m,
                "poolscope_thread_seconds_total",
                service,
                &[("state", state)],
            )
        };
        value(after) - value(before)
    })
}

#[test]
fn thread_times_match_schedstat() -> anyhow::Result<()> {
    if !privileged("thread_times_match_schedstat") {
        return Ok(());
    }
    thread_times_match_schedstat_with("")
}

/// The same with one slot in the thread array: every thread but one lives in the
/// `THREADS` hash map, the path of threads whose slot another thread owns.
#[test]
fn thread_times_match_schedstat_in_the_hash_map() -> anyhow::Result<()> {
    if !privileged("thread_times_match_schedstat_in_the_hash_map") {
        return Ok(());
    }
    thread_times_match_schedstat_with("[limits]\nthread_slots = 1\n")
}

/// `thread_times_match_schedstat` with `limits` before the rest of the config.
fn thread_times_match_schedstat_with(limits: &str) -> anyhow::Result<()> {
    let _serial = one_at_a_time();
    // Three spinning workers offered 1.2 CPUs of work, all on one CPU: time on CPU and
    // in the run queue both, seconds of each. (Our intervals and schedstat's differ
    // at their ends by a few µs per switch, a fixed ~30 ms over this window: below
    // 5% only when the run-queue time is large. Schedstat's time on CPU also leaves
    // out what the hypervisor stole from the vCPU, which ours includes: CI failed at
    // 3.2800 s ours against 3.1995 s schedstat, 2.5% over, on a vCPU with steal time.
    // The steal on CPU 0 in the window bounds that part.)
    let mut server = ThreadPool::start(3, Duration::from_millis(4), "spin")?;
    let pid = server.program.pid();
    pin_to_first_cpu(&[pid])?;
    let poolscope = Poolscope::start(&format!(
        "{limits}{}",
        config("auto", Duration::from_secs(10), &[("spin", pid)])
    ))?;
    wait_for_pools(&poolscope, &server.workers)?;
    let in_hash_map = poolscope
        .scrape()?
        .value("poolscope_map_entries", &[("map", "THREADS")])
        .unwrap_or(0.0);
    eprintln!("threads in THREADS (their slot taken): {in_hash_map}");
    if !limits.is_empty() {
        assert!(in_hash_map >= server.workers.len() as f64, "{in_hash_map}");
    }
    let load = OpenLoop::start(server.port, 300.0, SENDERS);
    std::thread::sleep(Duration::from_secs(1));

    let read = |poolscope: &Poolscope| -> anyhow::Result<Reading> {
        let rows = parse_debug_threads(&poolscope.get("/debug/threads")?)?;
        rows.into_iter()
            .filter(|row| row.service == "spin")
            .map(|row| Ok((row.clone(), schedstat(pid, row.tid)?)))
            .collect()
    };
    let steal_before = cpu_steal_seconds(0)?;
    let before = read(&poolscope)?;
    std::thread::sleep(Duration::from_secs(10));
    let after = read(&poolscope)?;
    let steal = cpu_steal_seconds(0)? - steal_before;
    let stats = load.stop()?;
    eprintln!("load: {stats:?}; CPU 0 stolen by the hypervisor: {steal:.3} s");

    eprintln!(
        "tid      pool        running ours/kernel (s)   runnable ours/kernel (s)   µs per slice"
    );
    let mut checked = 0;
    for (row, (running, runnable, slices)) in &after {
        let Some((first, (first_running, first_runnable, first_slices))) =
            before.iter().find(|(r, _)| r.tid == row.tid)
        else {
            continue;
        };
        let slice_us =
            (running - first_running) as f64 / 1e3 / (slices - first_slices).max(1) as f64;
        let ours = (row.running - first.running, row.runnable - first.runnable);
        let kernel = (
            (running - first_running) as f64 / 1e9,
            (runnable - first_runnable) as f64 / 1e9,
        );
        eprintln!(
            "{:<8} {:<11} {:>9.4} / {:<9.4}       {:>9.4} / {:<9.4}       {slice_us:>8.1}",
            row.tid, row.pool, ours.0, kernel.0, ours.1, kernel.1
        );
        if kernel.0 >= 0.1 && slice_us >= 1000.0 {
            // Threads that work, a millisecond or more per time on CPU: the issue's
            // bounds.
            assert!(
                ours.0 >= 0.98 * kernel.0 && ours.0 <= 1.02 * kernel.0 + steal,
                "thread {}: running {:.4} s, schedstat {:.4} s (+ {steal:.3} s stolen): \
                 more than 2% off",
                row.tid,
                ours.0,
                kernel.0
            );
            scorecard::bounded(
                "thread time running, per busy thread",
                "the kernel's schedstat (time on CPU)",
                "-",
                ours.0,
                kernel.0,
                "−2 % to +2 % + time stolen by the hypervisor",
            );
            assert!(
                (ours.1 - kernel.1).abs() <= 0.05 * kernel.1,
                "thread {}: runnable {:.4} s, schedstat {:.4} s: more than 5% off",
                row.tid,
                ours.1,
                kernel.1
            );
            scorecard::within(
                "thread time runnable, per busy thread",
                "the kernel's schedstat (run-queue wait)",
                "-",
                ours.1,
                kernel.1,
                0.05,
            );
        } else {
            // A thread that runs µs per wakeup (the acceptor): schedstat charges
            // it up to ~18 µs more per wakeup than the time between the sched_switch
            // tracepoints that put it on and off the CPU, which is what we measure
            // (checked with ftrace; see the issue note). Never more than the kernel
            // and the time stolen from the CPU.
            assert!(
                ours.0 <= 1.02 * kernel.0 + 0.001 + steal,
                "thread {}: running {:.4} s, more than schedstat's {:.4} s",
                row.tid,
                ours.0,
                kernel.0
            );
        }
        checked += 1;
    }
    let workers_busy = after
        .iter()
        .filter(|(row, _)| server.workers.contains(&row.tid))
        .count();
    assert_eq!(workers_busy, server.workers.len(), "every worker compared");
    assert!(checked >= server.workers.len());
    server.program.finish("served")?;
    Ok(())
}

/// Utilization of the worker pool at offered load `load` (λ·S/N), measured over the
/// last window of a run at that load.
/// Poolscope's utilization of the pool over the last `window` under `load` (a share
/// of the pool's nominal capacity), the state deltas and wall time of the whole run,
/// and the truth: the share of the workers' time that they spent on requests by
/// their own clock over the same last `window` (a worker that oversleeps its service
/// time is busy longer than the load says).
fn utilization_at(
    poolscope: &Poolscope,
    server: &mut ThreadPool,
    service: &str,
    load: f64,
    window: Duration,
) -> anyhow::Result<(f64, [f64; 5], f64, f64)> {
    let workers = server.workers.len() as f64;
    let rate = load * workers / SERVICE_TIME.as_secs_f64();
    let clients = OpenLoop::start(server.port, rate, SENDERS);
    let before = poolscope.scrape()?;
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    let (busy_before, window_started) = (server.busy()?, Instant::now());
    std::thread::sleep(window);
    let after = poolscope.scrape()?;
    let (busy_after, window_ended) = (server.busy()?, Instant::now());
    let wall = started.elapsed().as_secs_f64();
    let stats = clients.stop()?;
    eprintln!("load {load:.2}: rate {rate:.0}/s, {stats:?}");
    let utilization = pool_value(&after, "poolscope_pool_utilization_ratio", service, &[]);
    let truth = (busy_after - busy_before).as_secs_f64()
        / (workers * window_ended.duration_since(window_started).as_secs_f64());
    Ok((
        utilization,
        state_deltas(&before, &after, service),
        wall,
        truth,
    ))
}

const SERVICE_TIME: Duration = Duration::from_millis(20);

#[test]
fn pool_utilization_matches_offered_load() -> anyhow::Result<()> {
    if !privileged("pool_utilization_matches_offered_load") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    const WORKERS: u32 = 4;
    const WINDOW: Duration = Duration::from_secs(5);
    let mut server = ThreadPool::start(WORKERS, SERVICE_TIME, "sleep")?;
    let service = "sleepy";
    let poolscope = Poolscope::start(&config("auto", WINDOW, &[(service, server.program.pid())]))?;
    wait_for_pools(&poolscope, &server.workers)?;
    scrape_until(&poolscope, |m| {
        pool_value(m, "poolscope_pool_threads", service, &[]) == f64::from(WORKERS)
    })?;

    eprintln!("offered   workers' own   utilization   blocked_lock (s)   thread-seconds / wall");
    // 1.1: overload, so that the pool is saturated the whole window.
    for offered in [0.25, 0.5, 0.9, 1.1] {
        let (utilization, states, wall, truth) =
            utilization_at(&poolscope, &mut server, service, offered, WINDOW)?;
        let thread_seconds: f64 = states.iter().sum();
        eprintln!(
            "{offered:>7.2}   {truth:>12.3}   {utilization:>11.3}   {:>16.4}   {:.3}",
            states[2],
            thread_seconds / wall
        );
        assert!(
            (utilization - truth).abs() <= 0.03,
            "offered {offered}: utilization {utilization:.3}, the workers' own {truth:.3} ± 0.03"
        );
        scorecard::points(
            "pool_utilization_ratio at 25, 50, 90 and 110 % offered load",
            "the workers' own busy time by their clock, over the same window",
            "-",
            utilization,
            truth,
            3.0,
        );
        // Idle workers wait on the pool's queue (a futex): idle, not blocked_lock.
        assert_eq!(
            states[2], 0.0,
            "blocked_lock with no lock in the service path"
        );
        // Every thread is in exactly one state at every instant.
        let want = f64::from(WORKERS) * wall;
        assert!(
            (thread_seconds - want).abs() <= 0.02 * want,
            "thread-seconds {thread_seconds:.3} over {wall:.3} s of {WORKERS} threads"
        );
        scorecard::within(
            "thread states' seconds, summed over a pool",
            "threads × wall time (each thread in one state at every instant)",
            "-",
            thread_seconds,
            want,
            0.02,
        );
    }
    server.program.finish("served")?;
    Ok(())
}

/// Busy time of the worker pool is the state its work puts it in: of the time the
/// work decides, that is busy time less the run-queue wait, which is the machine's
/// (CI, 2 CPUs: sleepers woken every 10 ms waited 9 % of their busy time for a CPU,
/// so blocked_io was 0.877 of all busy time but 0.96 of the rest). The run-queue
/// time itself is checked against schedstat by `thread_times_match_schedstat`.
fn work_kind(backend: &str, work: &str, state: &str, component: &str) -> anyhow::Result<()> {
    let (workers, service_time, rate) = match work {
        // Half a CPU of spinning on two CPUs: little run-queue wait.
        "spin" => (2, Duration::from_millis(5), 100.0),
        _ => (4, Duration::from_millis(10), 200.0),
    };
    let mut server = ThreadPool::start(workers, service_time, work)?;
    let service = format!("{work}-{backend}");
    let poolscope = Poolscope::start(&config(
        backend,
        Duration::from_secs(5),
        &[(&service, server.program.pid())],
    ))?;
    wait_for_pools(&poolscope, &server.workers)?;
    let clients = OpenLoop::start(server.port, rate, SENDERS);
    std::thread::sleep(Duration::from_secs(1));
    let before = poolscope.scrape()?;
    std::thread::sleep(Duration::from_secs(5));
    let after = poolscope.scrape()?;
    let stats = clients.stop()?;
    let states = state_deltas(&before, &after, &service);
    let busy: f64 = states[..4].iter().sum();
    let index = STATES
        .iter()
        .position(|s| *s == state)
        .ok_or_else(|| anyhow::anyhow!("state {state}"))?;
    let component_delta = |name: &str| {
        let value = |m: &Metrics| {
            m.value(
                "poolscope_request_time_seconds_total",
                &[("service", &service), ("component", name)],
            )
            .unwrap_or(f64::NAN)
        };
        value(&after) - value(&before)
    };
    let components = ["running", "runnable", "lock", "io", "other"];
    let component_total: f64 = components.iter().map(|c| component_delta(c)).sum();
    let share = states[index] / (busy - states[1]);
    let component_share =
        component_delta(component) / (component_total - component_delta("runnable"));
    eprintln!(
        "{backend} {work}: {stats:?}\n  busy {busy:.3} s: {:?}\n  {state} share {share:.3} \
         (of busy time but the run queue), request time in {component} {component_share:.3} \
         of {component_total:.3} s (but the run queue)",
        STATES.iter().zip(states).collect::<Vec<_>>()
    );
    assert!(
        share >= 0.9,
        "{work}: {state} is {share:.3} of busy time but the run queue"
    );
    scorecard::bounded(
        "busy time in the work's state (spin: running, sleep: blocked_io, mutex: blocked_lock)",
        "all of the busy time but the run queue's",
        backend,
        share,
        1.0,
        "≥ 90 %",
    );
    assert!(
        component_share >= 0.9,
        "{work}: request time in {component} is {component_share:.3}"
    );
    scorecard::bounded(
        "request time in the work's component (running, io, lock)",
        "all of the request time but the run queue's",
        backend,
        component_share,
        1.0,
        "≥ 90 %",
    );
    if state != "blocked_lock" {
        assert_eq!(
            states[2], 0.0,
            "{work}: idle workers counted as blocked_lock"
        );
    }
    server.program.finish("served")?;
    Ok(())
}

#[test]
fn busy_time_is_what_the_work_does() -> anyhow::Result<()> {
    if !privileged("busy_time_is_what_the_work_does") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    for backend in backends() {
        work_kind(backend, "spin", "running", "running")?;
        work_kind(backend, "sleep", "blocked_io", "io")?;
        work_kind(backend, "lock", "blocked_lock", "lock")?;
    }
    Ok(())
}

#[test]
fn two_spinners_on_one_cpu_wait_half_the_time() -> anyhow::Result<()> {
    if !privileged("two_spinners_on_one_cpu_wait_half_the_time") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let mut spinners = Program::start("spinners", &["2".into(), "0".into(), "30".into()])?;
    let tids = parse_tids(&spinners.line("spinners")?)?;
    let pid = spinners.pid();
    let poolscope = Poolscope::start(&config(
        "auto",
        Duration::from_secs(5),
        &[("spinners", pid)],
    ))?;
    wait_for_pools(&poolscope, &tids)?;
    let read = || -> anyhow::Result<(Instant, Reading)> {
        let rows = parse_debug_threads(&poolscope.get("/debug/threads")?)?;
        let at = Instant::now();
        let rows = rows
            .into_iter()
            .filter(|row| tids.contains(&row.tid))
            .map(|row| Ok((row.clone(), schedstat(pid, row.tid)?)))
            .collect::<anyhow::Result<_>>()?;
        Ok((at, rows))
    };
    // The scrapes and the kernel's own counters are read back to back, so that both
    // cover nearly the same interval: the scrapes' (`outer`) holds the counters'.
    let outer_start = Instant::now();
    let before_metrics = poolscope.scrape()?;
    let (start, before) = read()?;
    std::thread::sleep(Duration::from_secs(5));
    let (end, after) = read()?;
    let after_metrics = poolscope.scrape()?;
    let outer = outer_start.elapsed().as_secs_f64();
    let wall = end.duration_since(start).as_secs_f64();
    let mut kernel_total = 0.0;
    for ((row, (_, runnable, _)), (first, (_, first_runnable, _))) in after.iter().zip(&before) {
        let ours = row.runnable - first.runnable;
        let kernel = (runnable - first_runnable) as f64 / 1e9;
        kernel_total += kernel;
        eprintln!(
            "spinner {}: runnable {ours:.3} s of {wall:.3} s ({:.1}%), schedstat {kernel:.3} s",
            row.tid,
            100.0 * ours / wall
        );
        // Half the time, and more when other threads run on that CPU too: the kernel's
        // own count is the truth; this only checks that the two did contend.
        assert!(
            kernel >= 0.4 * wall,
            "the spinners did not share the CPU: {kernel:.3} s"
        );
        assert!((ours - kernel).abs() <= 0.05 * kernel, "against schedstat");
        scorecard::within(
            "thread time runnable, two spinners on one CPU",
            "the kernel's schedstat (run-queue wait)",
            "-",
            ours,
            kernel,
            0.05,
        );
    }
    // A pool's wait series appear with its first finished wait (docs/performance.md, Series per
    // service): before it, a known pool has waited 0 s.
    let waits = |m: &Metrics| {
        let pool = [("service", "spinners"), ("pool", "spin")];
        match m.value("poolscope_runqueue_wait_seconds_sum", &pool) {
            Some(sum) => sum,
            None if m.value("poolscope_pool_threads", &pool).is_some() => 0.0,
            None => f64::NAN,
        }
    };
    let runqueue_sum = waits(&after_metrics) - waits(&before_metrics);
    eprintln!(
        "runqueue_wait_seconds_sum grew {runqueue_sum:.3} s between scrapes {outer:.3} s \
         apart; schedstat {kernel_total:.3} s over {wall:.3} s"
    );
    // The finished waits of both threads, against the kernel's run delay of both: at
    // least schedstat's over the inner interval, at most that at the same rate over the
    // scrapes' outer one (a few ms longer here; ~0.3 s under software emulation, where
    // a scrape and a /debug read take ~0.1 s each). A wait in progress at either end,
    // one time slice, moves the sum by less than 1 %.
    let (least, most) = (kernel_total, kernel_total * outer / wall);
    assert!(
        runqueue_sum >= 0.95 * least && runqueue_sum <= 1.05 * most,
        "run-queue waits {runqueue_sum:.3} s, schedstat {least:.3} s over the inner \
         interval, {most:.3} s at the same rate over the scrapes' interval"
    );
    scorecard::bounded(
        "runqueue_wait_seconds_sum, two spinners on one CPU",
        "the kernel's schedstat run delay over the same interval",
        "-",
        runqueue_sum,
        least,
        "0.95 × schedstat's to 1.05 × its rate over the scrapes' interval",
    );
    drop(spinners.finish(""));
    Ok(())
}
