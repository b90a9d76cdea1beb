//! Ground truth for on-demand profiling sessions (`/debug/pprof/profile`), against the
//! real kernel and `stackburner` (see `stacks.rs` for what it does):
//! - `go tool pprof -top` pointed at the URL reads a profile whose shares of the two
//!   burn functions are the program's own (its CPU clock), within 5 points;
//! - sessions at 99, 199 and 333 Hz and an off-CPU session run at once, each with rate ×
//!   CPU time samples (schedstat around the request) or the blocked time, within 10%,
//!   while the periodic snapshots keep their own rate's count;
//! - requests outside the limits get their status and the limit's name; a client that
//!   disconnects leaves no perf event, session slot or stack count behind.
use std::{
    io::Write as _,
    net::{Shutdown, TcpStream},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use poolscope_tests::{
    Metrics, Poolscope, Program, one_at_a_time, pids_config, privileged,
    profiles::{
        FoldedLine, Stackburner, go_pprof, http_get, names, parse_folded, snapshots_covering,
        start_phase, top_shares, unix_now, weight_of,
    },
    schedstat, scorecard, wait_followed, wait_until,
};

const SERVICE: &str = "sb";
const BURNER_POOL: &str = "burner";
const SLEEPER_POOL: &str = "sleeper";
/// The periodic snapshots' rate, and the sessions' (the default, and another).
const SNAPSHOT_HZ: u32 = 49;
const SESSION_HZ: u32 = 99;
const FAST_HZ: u32 = 333;
/// go tool pprof's session: ~1600 samples, so that a share's sampling error (σ ≈ 1.1
/// points at 75 %) stays well inside the 5 points allowed.
const PPROF_HZ: u32 = 199;
const SESSION: Duration = Duration::from_secs(8);
/// The program's phase: longer than the sessions, which start right after it does.
const PHASE: Duration = Duration::from_secs(12);
/// The limits test's: longer than all it does (it does not wait for the end).
const LONG_PHASE: Duration = Duration::from_secs(60);
const SLEEP_MS: f64 = 20.0;
const INTERVAL: Duration = Duration::from_secs(2);

/// Starts `stackburner`, waits until poolscope follows both its threads in their
/// pools; (program, its port, burner tid, sleeper tid).
fn burner_followed(
    phase: Duration,
    start_poolscope: impl FnOnce(u32) -> anyhow::Result<Poolscope>,
) -> anyhow::Result<(Program, Poolscope, u16, u32, u32)> {
    let Stackburner {
        program,
        port,
        burner,
        sleeper,
    } = Stackburner::start(phase, SLEEP_MS)?;
    let poolscope = start_poolscope(program.pid())?;
    wait_followed(
        &poolscope,
        &[(burner, BURNER_POOL), (sleeper, SLEEPER_POOL)],
    )?;
    Ok((program, poolscope, port, burner, sleeper))
}

/// A session's folded stacks with the schedstat (running, runnable) of `tid` and
/// the wall time around the request.
struct Measured {
    lines: Vec<FoldedLine>,
    running_ns: u64,
    runnable_ns: u64,
    wall_ns: u64,
}

impl Measured {
    /// `ns` as a share of the request's wall time.
    fn share(&self, ns: u64) -> f64 {
        ns as f64 / self.wall_ns.max(1) as f64
    }
}

fn measured_session(port: u16, pid: u32, tid: u32, query: &str) -> anyhow::Result<Measured> {
    let path = format!("/debug/pprof/profile?{query}");
    let before = schedstat(pid, tid)?;
    let started = Instant::now();
    let response = http_get(port, &path)?;
    let wall_ns = started.elapsed().as_nanos() as u64;
    let after = schedstat(pid, tid)?;
    Ok(Measured {
        lines: parse_folded(&response.text(&path)?)?,
        running_ns: after.0 - before.0,
        runnable_ns: after.1 - before.1,
        wall_ns,
    })
}

/// The result of a scoped thread's work.
fn joined<T>(
    name: &str,
    handle: thread::ScopedJoinHandle<'_, anyhow::Result<T>>,
) -> anyhow::Result<T> {
    handle
        .join()
        .map_err(|_| anyhow::anyhow!("the {name} session's thread panicked"))?
        .with_context(|| format!("the {name} session"))
}

fn within(measured: f64, truth: f64, tolerance: f64) -> bool {
    truth > 0.0 && (measured - truth).abs() <= tolerance * truth
}

/// `key value key value ...` of the program's report line; the value of `key`.
fn reported(line: &str, key: &str) -> anyhow::Result<u64> {
    let words: Vec<&str> = line.split_whitespace().collect();
    words
        .chunks(2)
        .find(|pair| pair[0] == key)
        .and_then(|pair| pair.get(1))
        .with_context(|| format!("no {key} in {line:?}"))?
        .parse()
        .with_context(|| format!("{key} in {line:?}"))
}

#[test]
fn concurrent_sessions_match_the_programs_truth() -> anyhow::Result<()> {
    if !privileged("concurrent_sessions_match_the_programs_truth") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let (mut program, mut poolscope, program_port, burner, sleeper) =
        burner_followed(PHASE, |pid| {
            Poolscope::start(&format!(
                "[probes]\nsampling_hz = {SNAPSHOT_HZ}\n[stacks]\ninterval = \"{}s\"\nkeep = 30\n\
             offcpu_min = \"1ms\"\noffcpu_idle = true\n[profiles]\nmax_sessions = 4\n{}",
                INTERVAL.as_secs(),
                pids_config(SERVICE, &[pid])
            ))
        })?;
    let result = check_concurrent_sessions(&poolscope, &mut program, program_port, burner, sleeper);
    if result.is_err() {
        println!("poolscope's log:\n{}", poolscope.stop_and_log());
    }
    result
}

fn check_concurrent_sessions(
    poolscope: &Poolscope,
    program: &mut Program,
    program_port: u16,
    burner: u32,
    sleeper: u32,
) -> anyhow::Result<()> {
    let (port, pid) = (poolscope.port, program.pid());
    let seconds = SESSION.as_secs();
    start_phase(program_port)?;
    let phase_started = unix_now();
    let url = format!(
        "http://127.0.0.1:{port}/debug/pprof/profile?seconds={seconds}&service={SERVICE}\
         &pool={BURNER_POOL}&hz={PPROF_HZ}"
    );
    let (top, fast, default_rate, offcpu, refused) = thread::scope(|scope| {
        let top = scope.spawn(|| go_pprof(&["-top", "-symbolize=none"], &url));
        let fast = scope.spawn(|| {
            measured_session(
                port,
                pid,
                burner,
                &format!(
                    "seconds={seconds}&service={SERVICE}&pool={BURNER_POOL}&hz={FAST_HZ}\
                     &format=folded"
                ),
            )
        });
        let default_rate = scope.spawn(|| {
            measured_session(
                port,
                pid,
                burner,
                &format!("seconds={seconds}&service={SERVICE}&pool={BURNER_POOL}&format=folded"),
            )
        });
        let offcpu = scope.spawn(|| {
            measured_session(
                port,
                pid,
                sleeper,
                &format!(
                    "seconds={seconds}&service={SERVICE}&pool={SLEEPER_POOL}&kind=offcpu\
                     &format=folded"
                ),
            )
        });
        // A fifth while the four run: refused, naming the limit.
        let refused = wait_until(Duration::from_secs(5), || {
            poolscope
                .scrape()
                .is_ok_and(|m| m.value("poolscope_profile_sessions_active", &[]) == Some(4.0))
        })
        .then(|| {
            http_get(
                port,
                &format!("/debug/pprof/profile?seconds=1&service={SERVICE}"),
            )
        });
        Ok::<_, anyhow::Error>((
            joined("go tool pprof", top)?,
            joined("333 Hz", fast)?,
            joined("99 Hz", default_rate)?,
            joined("off-CPU", offcpu)?,
            refused,
        ))
    })?;
    let burned = program.line("burner")?;
    program.line("sleeper")?;
    program.line("done")?;
    let phase_ended = unix_now();

    // The fifth request, refused with 429 and the limit's name.
    let refused = refused.context("four sessions never ran at once")??;
    let refusal = String::from_utf8_lossy(&refused.body).into_owned();
    println!("fifth session: {} {refusal}", refused.status);
    anyhow::ensure!(
        refused.status == 429 && refusal.contains("profiles.max_sessions"),
        "a fifth session while four ran: {} {refusal}",
        refused.status
    );

    // go tool pprof: the shares of the burn functions are the program's.
    println!("go tool pprof -top {url}\n{top}");
    let cpu_ns = reported(&burned, "cpu_ns")? as f64;
    for (function, key) in [
        ("burn_three_quarters", "three_quarters_ns"),
        ("burn_one_quarter", "one_quarter_ns"),
    ] {
        let truth = 100.0 * reported(&burned, key)? as f64 / cpu_ns;
        let (flat, cum) = top_shares(&top, function)
            .with_context(|| format!("{function} is not in go tool pprof's top"))?;
        println!("{function}: cum {cum:.1} %, flat {flat:.1} %, program {truth:.1} %");
        anyhow::ensure!(
            (cum - truth).abs() <= 5.0,
            "{function}: {cum:.1} % of the samples, the program spent {truth:.1} % of its CPU \
             time there"
        );
        scorecard::points(
            "a function's share of a profiling session's CPU samples (go tool pprof -top, cum)",
            "the program's own split of its CPU time (its CPU clock)",
            "-",
            cum / 100.0,
            truth / 100.0,
            5.0,
        );
    }

    // Each rate's sample count is rate × the burner's CPU time during the session:
    // its share of a CPU around the request (schedstat; the request also spans the
    // session's start and its rendering) × the session's length. Schedstat leaves out
    // what the hypervisor stole from the vCPU while the burner was on it; the sampling
    // timer runs on through part of that. The burner never blocks, so its time on a
    // CPU with the steal is the wall time less its run-queue wait: the truth lies
    // between the two.
    for (hz, session) in [(FAST_HZ, &fast), (SESSION_HZ, &default_rate)] {
        let samples = weight_of(&session.lines, |frames| frames[0] == BURNER_POOL) as f64;
        let on_cpu = session.share(session.running_ns) * SESSION.as_secs_f64();
        let with_steal = session.share(session.wall_ns.saturating_sub(session.runnable_ns))
            * SESSION.as_secs_f64();
        let (low, high) = (f64::from(hz) * on_cpu, f64::from(hz) * with_steal);
        println!(
            "{hz} Hz session: {samples} samples, {hz} Hz × {on_cpu:.3} s on CPU = {low:.0} \
             ({with_steal:.3} s with the steal = {high:.0})"
        );
        anyhow::ensure!(
            low > 0.0 && samples >= 0.90 * low && samples <= 1.10 * high,
            "{hz} Hz: {samples} samples, expected {low:.0} to {high:.0} ± 10 %"
        );
        scorecard::bounded(
            "on-CPU samples of a profiling session (99 and 333 Hz, four sessions at once)",
            "rate × the program's CPU time in the session (schedstat; up to its wall time less run-queue wait, for the host's steal)",
            "-",
            samples,
            low,
            "0.90 × CPU time to 1.10 × with steal",
        );
    }

    // Off-CPU: the sleeper's blocked time during the session, the same way.
    let slept_us = weight_of(&offcpu.lines, |frames| {
        names(frames, "sleep_in_named_function")
    }) as f64;
    let blocked_ns = offcpu
        .wall_ns
        .saturating_sub(offcpu.running_ns + offcpu.runnable_ns);
    let blocked_us = offcpu.share(blocked_ns) * SESSION.as_secs_f64() * 1e6;
    println!(
        "off-CPU session: {slept_us:.0} µs in sleep_in_named_function, blocked {blocked_us:.0} µs"
    );
    anyhow::ensure!(
        within(slept_us, blocked_us, 0.10),
        "off-CPU: {slept_us:.0} µs, the sleeper was blocked {blocked_us:.0} µs (± 10 %)"
    );
    scorecard::within(
        "off-CPU time of a function in a profiling session",
        "the program's own time blocked during the session (schedstat)",
        "-",
        slept_us / 1e6,
        blocked_us / 1e6,
        0.10,
    );

    // Self-metrics: what ran, what was refused, how fast each started, nothing left.
    let metrics = poolscope.scrape()?;
    let value = |name: &str, labels: &[(&str, &str)]| metrics.value(name, labels);
    let expected = [
        (
            "poolscope_profile_sessions_started_total",
            vec![("kind", "cpu")],
            3.0,
        ),
        (
            "poolscope_profile_sessions_started_total",
            vec![("kind", "offcpu")],
            1.0,
        ),
        (
            "poolscope_profile_sessions_refused_total",
            vec![("reason", "sessions")],
            1.0,
        ),
        ("poolscope_profile_sessions_active", vec![], 0.0),
        (
            "poolscope_map_entries",
            vec![("map", "PROFILE_SESSIONS")],
            0.0,
        ),
        ("poolscope_profile_session_start_seconds_count", vec![], 3.0),
        // The goal: under 100 ms from request to first sample.
        (
            "poolscope_profile_session_start_seconds_bucket",
            vec![("le", "0.1")],
            3.0,
        ),
    ];
    for (name, labels, want) in &expected {
        anyhow::ensure!(
            value(name, labels) == Some(*want),
            "{name}{labels:?}: {:?}, want {want}\n{}",
            value(name, labels),
            metrics.text
        );
    }
    println!(
        "start latency: {:.1} ms mean over 3 sessions",
        value("poolscope_profile_session_start_seconds_sum", &[]).unwrap_or(0.0) / 3.0 * 1e3
    );

    snapshots_kept_their_rate(poolscope, cpu_ns, phase_started, phase_ended)
}

/// The periodic snapshots, sampled at their own rate beside the sessions, hold
/// `SNAPSHOT_HZ` × the burner's CPU time.
fn snapshots_kept_their_rate(
    poolscope: &Poolscope,
    burner_cpu_ns: f64,
    phase_started: f64,
    phase_ended: f64,
) -> anyhow::Result<()> {
    let listed = snapshots_covering(poolscope, phase_started, phase_ended, INTERVAL)?;
    let mut samples = 0;
    for snapshot in &listed {
        let id = snapshot["id"].as_u64().context("snapshot without id")?;
        let path = format!("/debug/stacks/cpu?service={SERVICE}&snapshot={id}&format=folded");
        let lines = parse_folded(&poolscope.get(&path)?)?;
        samples += weight_of(&lines, |frames| frames[0] == BURNER_POOL);
    }
    let truth = f64::from(SNAPSHOT_HZ) * burner_cpu_ns / 1e9;
    println!("snapshots: {samples} burner samples, {SNAPSHOT_HZ} Hz × CPU time = {truth:.0}");
    anyhow::ensure!(
        within(samples as f64, truth, 0.10),
        "the snapshots hold {samples} burner samples beside the sessions, expected {truth:.0}"
    );
    scorecard::within(
        "on-CPU samples of the periodic snapshots while profiling sessions run",
        "the snapshots' rate × the program's CPU time",
        "-",
        samples as f64,
        truth,
        0.10,
    );
    Ok(())
}

/// File descriptors of `pid` that are perf events or BPF links.
fn perf_fds(pid: u32) -> anyhow::Result<usize> {
    let mut count = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let target = std::fs::read_link(entry?.path()).unwrap_or_default();
        let target = target.to_string_lossy();
        if target.contains("perf_event") || target.contains("bpf_link") {
            count += 1;
        }
    }
    Ok(count)
}

/// The CPUs online now (`cpuN` lines of /proc/stat).
fn online_cpus() -> anyhow::Result<usize> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    Ok(stat
        .lines()
        .filter(|line| {
            line.strip_prefix("cpu")
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .count())
}

#[test]
fn refusals_name_their_limit_and_a_leaving_client_frees_everything() -> anyhow::Result<()> {
    if !privileged("refusals_name_their_limit_and_a_leaving_client_frees_everything") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    // No periodic samples and no off-CPU stacks: every stack count is the session's.
    let (_program, mut poolscope, program_port, _, _) = burner_followed(LONG_PHASE, |pid| {
        Poolscope::start(&format!(
            "[probes]\nsampling_hz = 0\n[stacks]\noffcpu = false\ninterval = \"1s\"\n\
             [profiles]\nmax_sessions = 1\nmax_duration = \"10s\"\nmin_hz = 10\nmax_hz = 500\n{}",
            pids_config(SERVICE, &[pid])
        ))
    })?;
    start_phase(program_port)?;
    let result = check_refusals_and_leaving(&poolscope);
    if result.is_err() {
        println!("poolscope's log:\n{}", poolscope.stop_and_log());
    }
    result
}

fn check_refusals_and_leaving(poolscope: &Poolscope) -> anyhow::Result<()> {
    let port = poolscope.port;
    let profile = |query: &str| format!("/debug/pprof/profile?{query}");
    let refusals = [
        ("seconds=11&service=sb", 400, "profiles.max_duration"),
        ("seconds=0&service=sb", 400, "profiles.max_duration"),
        ("seconds=1&service=sb&hz=5", 400, "profiles.min_hz"),
        ("seconds=1&service=sb&hz=501", 400, "profiles.max_hz"),
        ("seconds=1&service=sb&kind=wall", 400, "stacks.offcpu"),
        ("seconds=1&service=sb&format=png", 400, "format=\"png\""),
        ("seconds=1", 400, "service=NAME is required"),
        (
            "seconds=1&service=nope",
            404,
            "no watched service named \"nope\"",
        ),
        (
            "seconds=1&service=sb&pool=nope",
            404,
            "no pool named \"nope\"",
        ),
    ];
    for (query, status, message) in refusals {
        let response = http_get(port, &profile(query))?;
        let body = String::from_utf8_lossy(&response.body);
        println!("{query}: {} {}", response.status, body.trim_end());
        anyhow::ensure!(
            response.status == status && body.contains(message),
            "{query}: {} {body}, want {status} naming {message:?}",
            response.status
        );
    }

    let pid = poolscope.pid();
    let baseline = perf_fds(pid)?;
    let cpus = online_cpus()?;
    let mut client = TcpStream::connect(("127.0.0.1", port))?;
    write!(
        client,
        "GET {} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n",
        profile("seconds=10&service=sb&hz=500")
    )?;
    let metric = |name: &str, labels: &[(&str, &str)]| -> Option<f64> {
        poolscope
            .scrape()
            .ok()
            .and_then(|m: Metrics| m.value(name, labels))
    };
    let stack_counts = || metric("poolscope_map_entries", &[("map", "STACK_COUNTS")]);
    // One perf event per CPU (aya may keep its fd besides the BPF link's).
    let running = wait_until(Duration::from_secs(5), || {
        metric("poolscope_profile_sessions_active", &[]) == Some(1.0)
            && perf_fds(pid).is_ok_and(|fds| fds == baseline + cpus || fds == baseline + 2 * cpus)
            && stack_counts().is_some_and(|entries| entries > 0.0)
    });
    anyhow::ensure!(
        running,
        "the session did not run: perf fds {:?} (baseline {baseline}, {cpus} CPUs), \
         STACK_COUNTS {:?}",
        perf_fds(pid),
        stack_counts()
    );
    println!(
        "during the session: {} perf/link fds, {baseline} before, {cpus} CPUs",
        perf_fds(pid)?
    );
    // Its slot is the only one.
    let busy = http_get(port, &profile("seconds=1&service=sb"))?;
    let body = String::from_utf8_lossy(&busy.body);
    anyhow::ensure!(
        busy.status == 429 && body.contains("profiles.max_sessions"),
        "a second session with max_sessions = 1: {} {body}",
        busy.status
    );

    let left = Instant::now();
    client.shutdown(Shutdown::Both)?;
    drop(client);
    let freed = wait_until(Duration::from_secs(3), || {
        metric("poolscope_profile_sessions_active", &[]) == Some(0.0)
            && metric("poolscope_map_entries", &[("map", "PROFILE_SESSIONS")]) == Some(0.0)
            && perf_fds(pid).is_ok_and(|fds| fds == baseline)
    });
    anyhow::ensure!(
        freed,
        "after the client left: active {:?}, PROFILE_SESSIONS {:?}, perf fds {:?} (baseline \
         {baseline})",
        metric("poolscope_profile_sessions_active", &[]),
        metric("poolscope_map_entries", &[("map", "PROFILE_SESSIONS")]),
        perf_fds(pid)
    );
    println!("session ended {:?} after its client left", left.elapsed());
    // Its counts are drained (every second here) and dropped.
    let drained = wait_until(Duration::from_secs(6), || stack_counts() == Some(0.0));
    anyhow::ensure!(drained, "STACK_COUNTS still holds {:?}", stack_counts());

    let expected = [
        ("duration", 2.0),
        ("rate", 2.0),
        ("offcpu_off", 1.0),
        ("bad_query", 2.0),
        ("unknown_service", 1.0),
        ("unknown_pool", 1.0),
        ("sessions", 1.0),
    ];
    for (reason, count) in expected {
        let seen = metric(
            "poolscope_profile_sessions_refused_total",
            &[("reason", reason)],
        );
        anyhow::ensure!(
            seen == Some(count),
            "refused {reason}: {seen:?}, want {count}"
        );
    }
    // The freed slot serves the next session.
    let next = http_get(port, &profile("seconds=1&service=sb&format=folded"))?;
    let lines = parse_folded(&next.text("the next session")?)?;
    anyhow::ensure!(
        weight_of(&lines, |frames| frames[0] == BURNER_POOL) > 0,
        "the next session has no burner samples"
    );
    Ok(())
}
