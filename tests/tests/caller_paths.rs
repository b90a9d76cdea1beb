//! Two callers behind one call site come out as two stacks, each with its own
//! callers. `tests/callers/paths.c`, built without frame pointers, calls one `work`
//! through a function pointer from `caller_a` (one call in four) and `caller_b`;
//! each call spins on CPU, then sleeps in glibc's `usleep`. The kernel's
//! frame-pointer walk from inside `work` or glibc cannot see which caller it came
//! from, so both reach one stack id: the kernel tells their paths apart by the
//! return addresses a hint from user space names, and each path is unwound on its
//! own. The truth is the program's own split of its CPU and off-CPU time between
//! the callers; each caller's share of the stacks through `work`, on-CPU and
//! off-CPU, must be within 5 points of it.
//!
//! The stacks go to stdout (`--nocapture`).
use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use poolscope_tests::{
    Metrics, Poolscope, Program,
    downstream::compile_c,
    one_at_a_time, pids_config, privileged,
    profiles::{
        FoldedLine, http_get, names, parse_folded, print_heaviest, snapshots_covering, unix_now,
        weight_of,
    },
    scorecard, scrape_until, wait_until,
};

const SERVICE: &str = "paths";
const THREADS: u32 = 2;
const INTERVAL: Duration = Duration::from_secs(2);
const LOAD: Duration = Duration::from_secs(8);
/// Samples per second per CPU: ~1 CPU of the program's spinning gives ~1,600
/// samples in the load on a quiet host, a caller's share to within ~1 point (one
/// standard error).
const SAMPLING_HZ: u32 = 199;
/// Points of share a caller's stacks may differ from the program's own split.
const TOLERANCE: f64 = 0.05;

fn build(dir: &Path) -> anyhow::Result<PathBuf> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("callers/paths.c");
    let binary = dir.join("paths");
    compile_c(&source, &binary, &["-fomit-frame-pointer"])?;
    Ok(binary)
}

/// The threads hold no request: their blocks are `idle`, recorded with
/// `offcpu_idle`.
fn config(pid: u32) -> String {
    format!(
        "[probes]\nsampling_hz = {SAMPLING_HZ}\n[stacks]\ninterval = \"{}s\"\nkeep = 30\n\
         offcpu_min = \"1ms\"\noffcpu_idle = true\n{}",
        INTERVAL.as_secs(),
        pids_config(SERVICE, &[pid])
    )
}

/// What the program measured of itself so far: per caller (a, b), CPU and off-CPU
/// microseconds.
fn split(program: &mut Program) -> anyhow::Result<[(f64, f64); 2]> {
    program.send("report")?;
    let line = program.line("a")?;
    let fields: Vec<&str> = line.split_whitespace().collect();
    let number = |index: usize| -> anyhow::Result<f64> {
        let field = fields.get(index).copied().unwrap_or_default();
        field
            .parse()
            .map_err(|_| anyhow::anyhow!("paths reported {line:?}"))
    };
    Ok([(number(0)?, number(1)?), (number(3)?, number(4)?)])
}

/// The folded stacks of `view` over every snapshot of `ids`.
fn folded(poolscope: &Poolscope, view: &str, ids: &[u64]) -> anyhow::Result<Vec<FoldedLine>> {
    let mut lines = Vec::new();
    for id in ids {
        let path = format!("/debug/stacks/{view}?service={SERVICE}&snapshot={id}");
        lines.extend(parse_folded(
            &http_get(poolscope.port, &path)?.text(&path)?,
        )?);
    }
    Ok(lines)
}

/// Whether `frames` hold a frame of function `name` (not merely one that contains
/// it, as the thread's name `paths-worker` contains `work`).
fn has(frames: &[String], name: &str) -> bool {
    frames.iter().any(|frame| frame == name)
}

/// Of the weight of `lines` through `work` (and `leaf`), the share naming
/// `caller_a`, and the share naming either caller.
fn shares(lines: &[FoldedLine], leaf: &str) -> (u64, f64, f64) {
    let through = |frames: &[String]| has(frames, "work") && names(frames, leaf);
    let all = weight_of(lines, through);
    let a = weight_of(lines, |f| through(f) && has(f, "caller_a"));
    let b = weight_of(lines, |f| through(f) && has(f, "caller_b"));
    let total = all.max(1) as f64;
    (all, a as f64 / total, (a + b) as f64 / total)
}

#[test]
fn callers_behind_one_call_site_keep_their_own_stacks() -> anyhow::Result<()> {
    if !privileged("callers_behind_one_call_site_keep_their_own_stacks") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir()?;
    let binary = build(dir.path())?;
    let mut program = Program::start_path(&binary, &[THREADS.to_string()])?;
    program.line("ready")?;
    let poolscope = Poolscope::start(&config(program.pid()))?;
    scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", SERVICE)]) == Some(1.0)
    })?;
    // A stack's callers are told apart from the drain after its first copy was
    // unwound (its hint is made then): two snapshots in, every stack of the
    // program has been drained at least once.
    let warmed = wait_until(4 * INTERVAL + Duration::from_secs(5), || {
        poolscope
            .get("/debug/snapshots")
            .ok()
            .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
            .and_then(|listing| listing["snapshots"].as_array().map(Vec::len))
            .is_some_and(|count| count >= 2)
    });
    anyhow::ensure!(warmed, "no two snapshots within {:?}", 4 * INTERVAL);

    let before = split(&mut program)?;
    let started = unix_now();
    std::thread::sleep(LOAD);
    let ended = unix_now();
    let after = split(&mut program)?;
    let [(a_cpu, a_off), (b_cpu, b_off)] = [0, 1].map(|caller| {
        (
            after[caller].0 - before[caller].0,
            after[caller].1 - before[caller].1,
        )
    });
    let truth_cpu = a_cpu / (a_cpu + b_cpu).max(1.0);
    let truth_off = a_off / (a_off + b_off).max(1.0);

    let listed = snapshots_covering(&poolscope, started, ended, INTERVAL)?;
    let ids: Vec<u64> = listed
        .iter()
        .filter(|s| {
            s["started_unix_seconds"]
                .as_f64()
                .is_some_and(|t| t < ended)
                && s["ended_unix_seconds"]
                    .as_f64()
                    .is_some_and(|t| t > started)
        })
        .filter_map(|s| s["id"].as_u64())
        .collect();
    let cpu = folded(&poolscope, "cpu", &ids)?;
    let offcpu = folded(&poolscope, "offcpu", &ids)?;
    print_heaviest("cpu", &cpu);
    print_heaviest("offcpu", &offcpu);
    let metrics: Metrics = poolscope.scrape()?;
    println!(
        "stack copies unwound: {}; caller paths lost to a full map: {}",
        metrics
            .value("poolscope_stack_unwinds_total", &[("result", "unwound")])
            .unwrap_or(0.0),
        metrics
            .value(
                "poolscope_map_update_errors_total",
                &[("map", "STACK_VARIANTS"), ("errno", "E2BIG")]
            )
            .unwrap_or(0.0)
    );

    // The snapshots span more than the load: at least the samples of the program's
    // own CPU time in it (less a tenth for the sampler's ticks that met another
    // thread), and enough for the tolerance (300 samples: a share of 25 % within
    // 2.5 points, one standard error).
    let expected = (a_cpu + b_cpu) / 1e6 * f64::from(SAMPLING_HZ);
    let (samples, cpu_share, cpu_named) = shares(&cpu, "work");
    let (blocked_us, off_share, off_named) = shares(&offcpu, "clock_nanosleep");
    println!(
        "on-CPU: {samples} samples through work ({expected:.0} in the program's CPU time), \
         caller_a {:.1} % (the program's own: {:.1} %), either caller named {:.1} %",
        cpu_share * 100.0,
        truth_cpu * 100.0,
        cpu_named * 100.0
    );
    println!(
        "off-CPU: {blocked_us} µs through work, caller_a {:.1} % (the program's own: {:.1} %), \
         either caller named {:.1} %",
        off_share * 100.0,
        truth_off * 100.0,
        off_named * 100.0
    );
    anyhow::ensure!(
        expected >= 300.0,
        "the program ran {:.2} CPU seconds in the load: too few to measure a share",
        (a_cpu + b_cpu) / 1e6
    );
    anyhow::ensure!(
        samples as f64 >= 0.9 * expected && blocked_us > 0,
        "too few stacks through work: {samples} samples of {expected:.0} expected, \
         {blocked_us} µs blocked"
    );
    anyhow::ensure!(
        cpu_named >= 0.95 && off_named >= 0.95,
        "stacks through work lack their caller: on-CPU {cpu_named:.3}, off-CPU {off_named:.3}"
    );
    anyhow::ensure!(
        (cpu_share - truth_cpu).abs() <= TOLERANCE && (off_share - truth_off).abs() <= TOLERANCE,
        "caller_a's share differs from the program's own split by more than {TOLERANCE}: \
         on-CPU {cpu_share:.3} vs {truth_cpu:.3}, off-CPU {off_share:.3} vs {truth_off:.3}"
    );
    let truth_is = "the program's own split of its time between the two callers";
    scorecard::points(
        "on-CPU samples' share of one of two callers behind one call site (no frame pointers)",
        truth_is,
        "-",
        cpu_share,
        truth_cpu,
        TOLERANCE * 100.0,
    );
    scorecard::points(
        "off-CPU time's share of one of two callers behind one call site (no frame pointers)",
        truth_is,
        "-",
        off_share,
        truth_off,
        TOLERANCE * 100.0,
    );
    Ok(())
}
