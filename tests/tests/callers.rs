//! Stacks that name the caller behind a library built without frame pointers.
//! The kernel walks user stacks by frame pointers; Debian's glibc and its CPython
//! keep none, so that walk goes from inside them straight to the first caller that
//! keeps one, skipping the very function that called into them. poolscope copies
//! the registers and stack top behind each new stack and unwinds the copy by the
//! modules' unwind tables. The truth is in how the programs are written:
//! - `tests/callers/callers.c`, built here with frame pointers, serves `sleep` and
//!   `lock` lines by two named functions that call glibc directly: `usleep`, and
//!   `pthread_mutex_lock` on one mutex that each request holds 2 ms on CPU (so the
//!   other workers wait for it in the kernel). Every sleep of its workers is in the
//!   first, every lock wait in the second: each must carry its function in the
//!   folded off-CPU stacks, the lock's in `/debug/locks`, both in the pprof profile.
//! - A Python thread (`/usr/bin/python3`) sleeping in a loop: its off-CPU stacks
//!   hold the interpreter's frames (`_PyEval_EvalFrameDefault`) above the sleep.
//!
//! The stacks go to stdout (`--nocapture`).
use std::{
    io::{BufRead, BufReader, Write},
    net::TcpStream,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use poolscope_tests::{
    Metrics, Poolscope, Program,
    downstream::compile_c,
    one_at_a_time, privileged,
    profiles::{
        FoldedLine, go_pprof, http_get, names, parse_folded, print_heaviest, snapshots_covering,
        unix_now, weight_of,
    },
    scrape_until,
};

const CALLERS: &str = "callers";
const PYTHON: &str = "pysleeper";
const INTERVAL: Duration = Duration::from_secs(2);
const LOAD: Duration = Duration::from_secs(4);
/// Clients of each kind (one sleeps, three contend for the mutex with 4 workers).
const SLEEPERS: usize = 1;
const LOCKERS: usize = 3;

/// A Python thread that sleeps 5 ms at a time in a named function; the main
/// thread waits on stdin.
const PYTHON_SLEEPER: &str = "import sys, threading, time\n\
def sleep_in_named_python_function():\n    while True:\n        time.sleep(0.005)\n\
threading.Thread(target=sleep_in_named_python_function, daemon=True).start()\n\
print('ready', flush=True)\nsys.stdin.read()\n";

/// Builds callers.c, with frame pointers, into `dir`.
fn build(dir: &Path) -> anyhow::Result<PathBuf> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("callers/callers.c");
    let binary = dir.join("callers");
    compile_c(&source, &binary, &["-fno-omit-frame-pointer"])?;
    Ok(binary)
}

fn config(callers: u32, python: u32) -> String {
    format!(
        "[stacks]\ninterval = \"{}s\"\noffcpu_min = \"1ms\"\noffcpu_idle = true\n\
         [[targets]]\nservice = \"{CALLERS}\"\npids = [{callers}]\n\
         [[targets]]\nservice = \"{PYTHON}\"\npids = [{python}]\n",
        INTERVAL.as_secs()
    )
}

/// `kind` (`sleep` or `lock`) requests on one connection until `until`.
fn client(port: u16, kind: &'static str, until: Instant) -> anyhow::Result<u64> {
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let request = format!("{kind}\n");
    let mut served = 0;
    let mut answer = String::new();
    while Instant::now() < until {
        // One write per line: two would wait for each other (Nagle, delayed ACK).
        writer.write_all(request.as_bytes())?;
        answer.clear();
        reader.read_line(&mut answer)?;
        anyhow::ensure!(answer == "ok\n", "callers answered {answer:?}");
        served += 1;
    }
    Ok(served)
}

/// The folded off-CPU stacks of `service` over every snapshot of `ids`.
fn offcpu(poolscope: &Poolscope, service: &str, ids: &[u64]) -> anyhow::Result<Vec<FoldedLine>> {
    let mut lines = Vec::new();
    for id in ids {
        let path = format!("/debug/stacks/offcpu?service={service}&snapshot={id}");
        lines.extend(parse_folded(
            &http_get(poolscope.port, &path)?.text(&path)?,
        )?);
    }
    Ok(lines)
}

/// Of the weight of lines ending in off-CPU `reason` that pass through `leaf`, the
/// share that also names `caller`.
fn share_named(lines: &[FoldedLine], reason: &str, leaf: &str, caller: &str) -> (u64, f64) {
    let reason = format!("[off-cpu: {reason}]");
    let waits = |frames: &[String]| {
        frames.last().is_some_and(|last| *last == reason) && names(frames, leaf)
    };
    let all = weight_of(lines, waits);
    let named = weight_of(lines, |frames| waits(frames) && names(frames, caller));
    (all, named as f64 / all.max(1) as f64)
}

#[test]
fn stacks_name_the_caller_of_a_library_without_frame_pointers() -> anyhow::Result<()> {
    if !privileged("stacks_name_the_caller_of_a_library_without_frame_pointers") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir()?;
    let binary = build(dir.path())?;
    let mut callers = Program::start_path(&binary, &["4".to_owned()])?;
    let port: u16 = callers.line("port")?.parse()?;
    let mut python = Program::start_path(
        Path::new("/usr/bin/python3"),
        &["-c".to_owned(), PYTHON_SLEEPER.to_owned()],
    )?;
    python.line("ready")?;
    let poolscope = Poolscope::start(&config(callers.pid(), python.pid()))?;
    scrape_until(&poolscope, |m| {
        [CALLERS, PYTHON]
            .iter()
            .all(|service| m.value("poolscope_targets", &[("service", service)]) == Some(1.0))
    })?;

    let started = unix_now();
    let until = Instant::now() + LOAD;
    let clients: Vec<_> = std::iter::repeat_n("sleep", SLEEPERS)
        .chain(std::iter::repeat_n("lock", LOCKERS))
        .map(|kind| std::thread::spawn(move || client(port, kind, until)))
        .collect();
    for client in clients {
        let served = client
            .join()
            .map_err(|_| anyhow::anyhow!("client panicked"))??;
        anyhow::ensure!(served > 0, "a client was never served");
    }
    let ended = unix_now();

    let listed = snapshots_covering(&poolscope, started, ended, INTERVAL)?;
    let ids: Vec<u64> = listed.iter().filter_map(|s| s["id"].as_u64()).collect();
    let callers_lines = offcpu(&poolscope, CALLERS, &ids)?;
    let python_lines = offcpu(&poolscope, PYTHON, &ids)?;
    print_heaviest("callers", &callers_lines);
    print_heaviest("python", &python_lines);
    let locks: serde_json::Value = serde_json::from_str(
        &poolscope.get(&format!("/debug/locks?service={CALLERS}&format=json"))?,
    )?;
    let lock_frames: Vec<&str> = locks["locks"][0]["stacks"][0]["frames"]
        .as_array()
        .map(|frames| frames.iter().filter_map(|f| f.as_str()).collect())
        .unwrap_or_default();
    println!("/debug/locks top stack: {lock_frames:?}");
    let metrics: Metrics = poolscope.scrape()?;
    let unwound = metrics
        .value("poolscope_stack_unwinds_total", &[("result", "unwound")])
        .unwrap_or(0.0);
    let unwind_seconds = metrics
        .value("poolscope_stack_unwind_seconds_total", &[])
        .unwrap_or(0.0);
    println!(
        "stack copies unwound: {unwound}, {:.0} µs each (tables read included)",
        unwind_seconds / unwound.max(1.0) * 1e6
    );

    // Every sleep of callers' workers is in sleep_in_named_caller, every lock wait in
    // lock_in_named_caller: the stacks that reach glibc's sleep or lock wait name them.
    let (sleeps, sleep_share) = share_named(
        &callers_lines,
        "sleep",
        "clock_nanosleep",
        "sleep_in_named_caller",
    );
    let (lock_waits, lock_share) = share_named(
        &callers_lines,
        "lock",
        "lll_lock_wait",
        "lock_in_named_caller",
    );
    println!(
        "callers: {sleeps} µs of sleeps, {:.1} % under sleep_in_named_caller; {lock_waits} µs of \
         lock waits, {:.1} % under lock_in_named_caller",
        sleep_share * 100.0,
        lock_share * 100.0
    );
    anyhow::ensure!(
        sleeps > 0 && lock_waits > 0,
        "no sleeps or lock waits recorded"
    );
    anyhow::ensure!(
        sleep_share >= 0.95 && lock_share >= 0.95,
        "the named callers are missing from the off-CPU stacks (sleeps {:.3}, lock waits {:.3})",
        sleep_share,
        lock_share
    );
    // /debug/locks: glibc's wait, pthread_mutex_lock, then the function that called it.
    let position = |name: &str| lock_frames.iter().position(|frame| frame.contains(name));
    anyhow::ensure!(
        matches!(
            (position("lll_lock_wait"), position("pthread_mutex_lock"), position("lock_in_named_caller")),
            (Some(0), Some(wait), Some(caller)) if wait < caller
        ),
        "/debug/locks does not go from the lock wait through pthread_mutex_lock to its caller: \
         {lock_frames:?}"
    );
    // pprof: what `go tool pprof` reads, with both callers in its traces.
    let best = ids
        .iter()
        .copied()
        .max_by_key(|id| {
            let lines = offcpu(&poolscope, CALLERS, &[*id]).unwrap_or_default();
            weight_of(&lines, |frames| names(frames, "lock_in_named_caller"))
                .min(weight_of(&lines, |frames| {
                    names(frames, "sleep_in_named_caller")
                }))
        })
        .context("no snapshot")?;
    let path = format!("/debug/stacks/offcpu?service={CALLERS}&snapshot={best}&format=pprof");
    let profile = dir.path().join("offcpu.pb.gz");
    std::fs::write(&profile, http_get(poolscope.port, &path)?.ok(&path)?)?;
    let traces = go_pprof(&["-traces", "-symbolize=none"], &profile)?;
    anyhow::ensure!(
        ["lock_in_named_caller", "sleep_in_named_caller"]
            .iter()
            .all(|name| traces.contains(name)),
        "go tool pprof -traces of snapshot {best} lacks a named caller:\n{traces}"
    );
    // Python: the interpreter's frames above the sleep (the walk had none).
    let (python_sleeps, python_share) = share_named(
        &python_lines,
        "idle",
        "clock_nanosleep",
        "_PyEval_EvalFrameDefault",
    );
    println!(
        "python: {python_sleeps} µs of sleeps, {:.1} % with the interpreter's frames",
        python_share * 100.0
    );
    anyhow::ensure!(
        python_sleeps > 0 && python_share >= 0.95,
        "the Python thread's sleeps lack the interpreter's frames ({python_share:.3} of \
         {python_sleeps} µs)"
    );
    anyhow::ensure!(
        unwound >= 3.0,
        "poolscope_stack_unwinds_total{{result=\"unwound\"}} is {unwound}"
    );
    Ok(())
}
