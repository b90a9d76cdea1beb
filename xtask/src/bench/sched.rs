//! Context switches: what the scheduler programs cost (pingpong, raw tracepoints
//! sched_switch and sched_wakeup), and the rounds the stacks benchmark reuses.
use std::{
    fs,
    io::{BufRead as _, BufReader, Write as _},
    path::{Path, PathBuf},
    process::{ChildStdin, ChildStdout, Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, bail};

use super::bpf::{BpfStats, EmptyProgram};
use super::nginx::Counters;
use super::{
    Disturbance, Guard, Measured, Process, build_test_programs, free_port, measure_alone, met,
    min_median_where, processes, rotated, scrape, spawn_poolscope, wait_for_metrics,
    wait_for_quiet,
};

/// Goal: kernel time of the scheduler programs per context switch, for threads
/// poolscope does not watch (a failed lookup per event).
const GOAL_SCHED_NS_UNWATCHED: f64 = 100.0;
/// Goal: the same for watched threads (each event moves their state machine).
const GOAL_SCHED_NS_WATCHED: f64 = 250.0;
/// The CPU both pingpong threads run on.
pub(super) const PINGPONG_CPU: usize = 1;

/// The programs that run on every context switch and wakeup of the host.
pub(super) const SCHED_PROGRAMS: [&str; 2] = ["sched_switch", "sched_wakeup"];

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum SchedMode {
    Off,
    /// No poolscope; a program that only returns on each of the two tracepoints: the
    /// cost of the hooks themselves, and what bpf_stats adds to each run it times.
    Empty,
    /// poolscope watches only an idle process: pingpong's events fail their lookups.
    Unwatched,
    /// poolscope watches pingpong: its events move the threads' state machines.
    Watched,
}

impl SchedMode {
    const ALL: [Self; 4] = [Self::Off, Self::Empty, Self::Unwatched, Self::Watched];
    const ON: [Self; 2] = [Self::Unwatched, Self::Watched];

    fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Empty => "empty",
            Self::Unwatched => "unwatched",
            Self::Watched => "watched",
        }
    }

    fn goal_ns_per_switch(self) -> f64 {
        match self {
            Self::Off | Self::Empty => f64::NAN,
            Self::Unwatched => GOAL_SCHED_NS_UNWATCHED,
            Self::Watched => GOAL_SCHED_NS_WATCHED,
        }
    }
}

/// What hooks the scheduler in a round.
pub(super) enum Hooks {
    Poolscope { guard: Guard, address: String },
    Empty([EmptyProgram; 2]),
}

impl Hooks {
    /// The programs' counters: program name → (runs, run ns).
    pub(super) fn counters(&self) -> anyhow::Result<Counters> {
        match self {
            Self::Poolscope { address, .. } => Ok(Counters::parse(&scrape(address)?)),
            Self::Empty(programs) => {
                let mut counters = Counters::default();
                for program in programs {
                    counters
                        .programs
                        .insert(program.name.to_owned(), program.counters()?);
                }
                Ok(counters)
            }
        }
    }

    pub(super) fn poolscope_pid(&self) -> Option<u32> {
        match self {
            Self::Poolscope { guard, .. } => Some(guard.0.id()),
            Self::Empty(_) => None,
        }
    }
}

/// One run of pingpong with kernel.bpf_stats_enabled.
pub(super) struct SchedStats {
    roundtrips_per_second: f64,
    pub(super) roundtrips: f64,
    /// (runs, run ns) of `sched_switch` and `sched_wakeup` over the run: every
    /// switch and wakeup of the host, not only pingpong's.
    pub(super) switch: (f64, f64),
    pub(super) wakeup: (f64, f64),
}

impl SchedStats {
    fn new(roundtrips: f64, elapsed_ns: f64, counted: &Counters) -> Self {
        let program = |name: &str| counted.programs.get(name).copied().unwrap_or_default();
        Self {
            roundtrips_per_second: roundtrips * 1e9 / elapsed_ns,
            roundtrips,
            switch: program(SCHED_PROGRAMS[0]),
            wakeup: program(SCHED_PROGRAMS[1]),
        }
    }

    /// Run time of both programs per context switch.
    fn ns_per_switch(&self) -> f64 {
        (self.switch.1 + self.wakeup.1) / self.switch.0
    }

    pub(super) fn switch_ns_per_run(&self) -> f64 {
        self.switch.1 / self.switch.0
    }

    /// Runs of both programs per context switch.
    fn runs_per_switch(&self) -> f64 {
        (self.switch.0 + self.wakeup.0) / self.switch.0
    }

    /// Run time per run of both programs (with the empty programs: what bpf_stats
    /// adds to every run it times).
    fn ns_per_run(&self) -> f64 {
        (self.switch.1 + self.wakeup.1) / (self.switch.0 + self.wakeup.0)
    }

    pub(super) fn wakeup_ns_per_run(&self) -> f64 {
        self.wakeup.1 / self.wakeup.0
    }

    /// Share of the host's switches that were pingpong's (two per round trip).
    pub(super) fn pingpong_share(&self) -> f64 {
        2.0 * self.roundtrips / self.switch.0
    }
}

pub(super) struct SchedRound<M = SchedMode> {
    pub(super) mode: M,
    /// pingpong's throughput, kernel.bpf_stats_enabled off.
    pub(super) roundtrips_per_second: f64,
    /// The second run, with kernel.bpf_stats_enabled (poolscope modes).
    stats: Option<SchedStats>,
    pub(super) disturbance: Disturbance,
}

impl<M> Measured for SchedRound<M> {
    fn disturbance(&self) -> &Disturbance {
        &self.disturbance
    }
}

impl<M> SchedRound<M> {
    pub(super) fn stat(&self, pick: fn(&SchedStats) -> f64) -> f64 {
        self.stats.as_ref().map_or(f64::NAN, pick)
    }
}

/// A pingpong process waiting for runs (`--wait`); killed when dropped.
struct Pingpong {
    guard: Guard,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
}

impl Pingpong {
    fn start(root: &Path, seconds: u64) -> anyhow::Result<Self> {
        let mut child = Command::new(root.join("target/release/pingpong"))
            .arg(seconds.to_string())
            .args(["--cpu", &PINGPONG_CPU.to_string(), "--wait"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting pingpong")?;
        let (input, output) = (child.stdin.take(), child.stdout.take());
        let guard = Guard(child);
        let (Some(input), Some(output)) = (input, output) else {
            bail!("pingpong has no stdin or stdout");
        };
        let mut pingpong = Self {
            guard,
            input,
            output: BufReader::new(output),
        };
        let line = pingpong.line()?;
        if !line.starts_with("threads ") {
            bail!("pingpong said {line:?}, not its threads");
        }
        Ok(pingpong)
    }

    fn pid(&self) -> u32 {
        self.guard.0.id()
    }

    fn line(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        self.output
            .read_line(&mut line)
            .context("reading pingpong")?;
        if line.is_empty() {
            bail!("pingpong exited");
        }
        Ok(line.trim_end().to_owned())
    }

    /// One run: (round trips, elapsed ns).
    fn run(&mut self) -> anyhow::Result<(f64, f64)> {
        self.input
            .write_all(b"run\n")
            .context("starting a pingpong run")?;
        let line = self.line()?;
        let numbers: Vec<f64> = line
            .strip_prefix("roundtrips ")
            .map(|rest| rest.split(' ').filter_map(|v| v.parse().ok()).collect())
            .unwrap_or_default();
        match numbers[..] {
            [roundtrips, elapsed_ns] if roundtrips > 0.0 => Ok((roundtrips, elapsed_ns)),
            _ => bail!("cannot read pingpong's {line:?}"),
        }
    }
}

/// What every context-switch round shares.
pub(super) struct SchedBench<'a> {
    pub(super) root: &'a Path,
    /// target/bench: poolscope's configurations.
    dir: PathBuf,
    pub(super) seconds: u64,
    /// The idle process poolscope watches in the unwatched mode.
    pub(super) idle: u32,
    poolscope_address: String,
}

/// The context-switch benchmark: pingpong.
pub(super) fn run_sched(
    root: &Path,
    dir: PathBuf,
    rounds: usize,
    seconds: u64,
) -> anyhow::Result<()> {
    let (_idle, bench) = SchedBench::start(root, dir, seconds)?;
    let mut measured = Vec::new();
    for round in 0..rounds {
        for mode in rotated(&SchedMode::ALL, round) {
            let result = bench.measure_alone(mode)?;
            let mut line = format!(
                "round {:>2} {:<9} {:>8.0} roundtrips/s",
                round + 1,
                mode.name(),
                result.roundtrips_per_second,
            );
            if let Some(stats) = &result.stats {
                line += &format!(
                    "  stats on: {:>8.0} roundtrips/s {:>5.1} ns/switch (switch {:.1}, wakeup \
                     {:.1} ns/run; pingpong's {:.0}% of switches)",
                    stats.roundtrips_per_second,
                    stats.ns_per_switch(),
                    stats.switch_ns_per_run(),
                    stats.wakeup_ns_per_run(),
                    stats.pingpong_share() * 100.0,
                );
            }
            println!("{line}{}", result.disturbance.note());
            measured.push(result);
        }
    }
    sched_report(&measured);
    Ok(())
}

impl<'a> SchedBench<'a> {
    /// Builds pingpong, starts the idle process (until the guard drops) and warms up.
    pub(super) fn start(
        root: &'a Path,
        dir: PathBuf,
        seconds: u64,
    ) -> anyhow::Result<(Guard, Self)> {
        build_test_programs(root, &["pingpong"])?;
        let idle = Guard(
            Command::new("sleep")
                .arg("infinity")
                .spawn()
                .context("starting sleep")?,
        );
        let bench = SchedBench {
            root,
            dir,
            seconds,
            idle: idle.0.id(),
            poolscope_address: format!("127.0.0.1:{}", free_port()?),
        };
        // Warm up: pingpong's pages, the CPU's caches and frequency.
        Pingpong::start(root, seconds)?.run()?;
        Ok((idle, bench))
    }

    pub(super) fn wait_for_quiet(&self) -> bool {
        wait_for_quiet(|pid, _| pid == self.idle)
    }

    /// A round, measured again if something else skewed it (`measure_alone`).
    fn measure_alone(&self, mode: SchedMode) -> anyhow::Result<SchedRound> {
        measure_alone(mode.name(), || self.wait_for_quiet(), || self.measure(mode))
    }

    /// poolscope watching process `pid` as `service`, with more settings from `env`
    /// (configuration: poolscope-`name`.toml), once /metrics shows every line of `ready`.
    pub(super) fn watch(
        &self,
        name: &str,
        (service, pid): (&str, u32),
        env: &[(&str, &str)],
        ready: &[String],
    ) -> anyhow::Result<Hooks> {
        let config = self.dir.join(format!("poolscope-{name}.toml"));
        fs::write(
            &config,
            format!("[[targets]]\nservice = \"{service}\"\npids = [{pid}]\n"),
        )?;
        let guard = spawn_poolscope(self.root, &config, &self.poolscope_address, env)?;
        wait_for_metrics(&self.poolscope_address, ready)?;
        Ok(Hooks::Poolscope {
            guard,
            address: self.poolscope_address.clone(),
        })
    }

    /// The /metrics lines that say poolscope watches `service` (one process) or, for
    /// pingpong, follows both its threads (found at watch time).
    pub(super) fn ready(service: &str) -> Vec<String> {
        match service {
            "pingpong" => ["ping", "pong"]
                .iter()
                .map(|pool| {
                    format!("poolscope_pool_threads{{service=\"pingpong\",pool=\"{pool}\"}} 1\n")
                })
                .collect(),
            _ => vec![format!("poolscope_targets{{service=\"{service}\"}} 1\n")],
        }
    }

    /// Hooks the scheduler as the mode says: nothing when off.
    fn hook(&self, mode: SchedMode, pingpong: u32) -> anyhow::Result<Option<Hooks>> {
        let (service, pid) = match mode {
            SchedMode::Off => return Ok(None),
            SchedMode::Empty => {
                return Ok(Some(Hooks::Empty([
                    EmptyProgram::attach(SCHED_PROGRAMS[0])?,
                    EmptyProgram::attach(SCHED_PROGRAMS[1])?,
                ])));
            }
            SchedMode::Unwatched => ("idle", self.idle),
            SchedMode::Watched => ("pingpong", pingpong),
        };
        self.watch(mode.name(), (service, pid), &[], &Self::ready(service))
            .map(Some)
    }

    fn measure(&self, mode: SchedMode) -> anyhow::Result<SchedRound> {
        self.pingpong_round(mode, |pingpong| self.hook(mode, pingpong))
    }

    /// A round of pingpong hooked by `hook` (given pingpong's pid; `None`: not
    /// hooked): one run for its throughput, then, when hooked, one with
    /// kernel.bpf_stats_enabled for the programs' run time.
    pub(super) fn pingpong_round<M>(
        &self,
        mode: M,
        hook: impl FnOnce(u32) -> anyhow::Result<Option<Hooks>>,
    ) -> anyhow::Result<SchedRound<M>> {
        let mut pingpong = Pingpong::start(self.root, self.seconds)?;
        let hooks = hook(pingpong.pid())?;
        let exporter_pid = hooks.as_ref().and_then(Hooks::poolscope_pid);
        let pingpong_pid = pingpong.pid();
        let ours = |pid: u32, _: &Process| {
            pid == pingpong_pid || pid == self.idle || Some(pid) == exporter_pid
        };
        let started = Instant::now();
        let at_start = processes();
        let (roundtrips, elapsed_ns) = pingpong.run()?;
        let stats = match &hooks {
            None => None,
            Some(hooks) => {
                let enabled = BpfStats::enable()?;
                let before = hooks.counters()?;
                let (roundtrips, elapsed_ns) = pingpong.run()?;
                let counted = hooks.counters()?.since(&before);
                drop(enabled);
                Some(SchedStats::new(roundtrips, elapsed_ns, &counted))
            }
        };
        let disturbance = Disturbance::between(&at_start, &processes(), started.elapsed(), ours);
        drop(hooks);
        drop(pingpong);
        Ok(SchedRound {
            mode,
            roundtrips_per_second: roundtrips * 1e9 / elapsed_ns,
            stats,
            disturbance,
        })
    }
}

/// (min, median) of one quantity over the rounds of a mode.
fn of_sched_mode(
    rounds: &[SchedRound],
    mode: SchedMode,
    pick: impl Fn(&SchedRound) -> f64,
) -> (f64, f64) {
    min_median_where(rounds, |r| r.mode == mode, pick)
}

fn sched_report(rounds: &[SchedRound]) {
    let rate = |mode| of_sched_mode(rounds, mode, |r| r.roundtrips_per_second);
    let stat = |mode, pick| of_sched_mode(rounds, mode, |r| r.stat(pick));
    let (rate_off_min, rate_off) = rate(SchedMode::Off);
    // What bpf_stats adds to every run it times: the empty program's run time.
    let (_, floor) = stat(SchedMode::Empty, SchedStats::ns_per_run);
    let net = |mode| {
        let (_, ns) = stat(mode, SchedStats::ns_per_switch);
        let (_, runs) = stat(mode, SchedStats::runs_per_switch);
        ns - floor * runs
    };
    println!();
    println!(
        "| pingpong, 2 threads on CPU {PINGPONG_CPU} | roundtrips/s median (min) | /off median \
         | /off min | wall ns/switch more than off (median) | BPF ns/switch median (min) \
         | minus empty's ns/run (median) | sched_switch ns/run median | sched_wakeup ns/run \
         median | sched_wakeup runs/switch | pingpong's share of switches (median) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for mode in SchedMode::ALL {
        let (rate_min, rate_median) = rate(mode);
        // Two switches per round trip.
        let wall_ns = (1e9 / rate_median - 1e9 / rate_off) / 2.0;
        let (bpf_min, bpf_median) = stat(mode, SchedStats::ns_per_switch);
        let (_, switch) = stat(mode, SchedStats::switch_ns_per_run);
        let (_, wakeup) = stat(mode, SchedStats::wakeup_ns_per_run);
        let (_, runs) = stat(mode, SchedStats::runs_per_switch);
        let (_, share) = stat(mode, SchedStats::pingpong_share);
        println!(
            "| {} | {rate_median:.0} ({rate_min:.0}) | {:.4} | {:.4} | {wall_ns:+.1} \
             | {bpf_median:.1} ({bpf_min:.1}) | {:.1} | {switch:.1} | {wakeup:.1} | {:.3} \
             | {:.1}% |",
            mode.name(),
            rate_median / rate_off,
            rate_min / rate_off_min,
            net(mode),
            runs - 1.0,
            share * 100.0,
        );
    }
    println!();
    println!(
        "BPF ns/switch: run time of sched_switch and sched_wakeup over the runs of \
         sched_switch (every switch of the host), from a second run of each round with \
         kernel.bpf_stats_enabled=1. bpf_stats adds {floor:.1} ns to every run it times (the \
         empty program's ns/run), taken out in the next column. Wall ns/switch: half the \
         time a round trip took more than off, bpf_stats off (hooks and programs). \
         sched_wakeup NaN, 0 runs: not attached (the kernel's sched_info times run-queue \
         waits, exporter-ebpf/src/sched.rs)."
    );
    println!();
    println!(
        "Goals: ≤ {GOAL_SCHED_NS_UNWATCHED:.0} ns BPF time per context switch of unwatched \
         threads, ≤ {GOAL_SCHED_NS_WATCHED:.0} ns of watched ones (median of rounds)."
    );
    let verdict = |ns: f64, goal: f64| {
        let by = if ns > goal {
            format!(
                " (by {:.0} ns, {:.0}%)",
                ns - goal,
                (ns / goal - 1.0) * 100.0
            )
        } else {
            String::new()
        };
        format!("{}{by}", met(ns <= goal))
    };
    for mode in SchedMode::ON {
        let (_, bpf_ns) = stat(mode, SchedStats::ns_per_switch);
        let (rate_min, rate_median) = rate(mode);
        let goal = mode.goal_ns_per_switch();
        println!(
            "{:<9}  BPF {bpf_ns:>5.1} ns/switch: {}; without bpf_stats' own: {:.1}: {}; \
             throughput {:.2}% of off (min {:.2}%)",
            mode.name(),
            verdict(bpf_ns, goal),
            net(mode),
            verdict(net(mode), goal),
            rate_median / rate_off * 100.0,
            rate_min / rate_off_min * 100.0,
        );
    }
    for round in rounds.iter().filter(|r| r.disturbance.skews()) {
        println!("{} round{}", round.mode.name(), round.disturbance.note());
    }
}
