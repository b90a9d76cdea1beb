//! Stack snapshots: what on-CPU samples and off-CPU stacks cost (spinners, pingpong,
//! nginx at several sampling rates).
use std::{
    path::{Path, PathBuf},
    thread::sleep,
    time::{Duration, Instant},
};

use super::bpf::BpfStats;
use super::nginx::{Bench, Mode, Round};
use super::sched::{PINGPONG_CPU, SchedBench, SchedRound, SchedStats};
use super::{
    Disturbance, LineProgram, Measured, Process, build_test_programs, cpu_used, measure_alone,
    min_median_where, processes, rotated,
};

/// poolscope's default sampling rate (`[probes] sampling_hz`) and the high one the
/// bench also measures.
const SAMPLING_HZ_DEFAULT: u32 = 49;
const SAMPLING_HZ_HIGH: u32 = 999;
/// The perf_event program that samples every CPU's cpu-clock.
const SAMPLER: &str = "cpu_sample";
/// The CPU the spinning thread runs on (it pins itself).
const SPINNER_CPU: usize = 1;
/// poolscope's sampling rate in the stacks part's nginx rounds (socket backend,
/// `[stacks]` defaults: off-CPU stacks on); `None`: poolscope off.
const NGINX_SAMPLING: [Option<u32>; 4] = [
    None,
    Some(0),
    Some(SAMPLING_HZ_DEFAULT),
    Some(SAMPLING_HZ_HIGH),
];

#[derive(Clone, Copy, PartialEq, Eq)]
enum SampleMode {
    /// poolscope watches only an idle process: every sample takes the filter path
    /// (a failed thread lookup), the spinner's too.
    Unwatched,
    /// poolscope watches the spinner: its samples capture and count both stacks.
    Watched,
}

impl SampleMode {
    const ALL: [Self; 2] = [Self::Unwatched, Self::Watched];

    fn name(self) -> &'static str {
        match self {
            Self::Unwatched => "unwatched",
            Self::Watched => "watched",
        }
    }
}

/// A round of the spinner under sampling at `SAMPLING_HZ_HIGH`, with
/// kernel.bpf_stats_enabled.
struct SampleRound {
    mode: SampleMode,
    /// Runs and run ns of `cpu_sample` over the round: every CPU's cpu-clock.
    runs: f64,
    ns: f64,
    /// Wall time of the round.
    seconds: f64,
    /// Samples of the spinner: its CPU time × the rate.
    spinner_samples: f64,
    /// poolscope's own CPU time over the wall time.
    poolscope_cpu_share: f64,
    disturbance: Disturbance,
}

impl Measured for SampleRound {
    fn disturbance(&self) -> &Disturbance {
        &self.disturbance
    }
}

impl SampleRound {
    fn ns_per_run(&self) -> f64 {
        self.ns / self.runs
    }

    fn runs_per_second(&self) -> f64 {
        self.runs / self.seconds
    }

    fn spinner_samples_per_second(&self) -> f64 {
        self.spinner_samples / self.seconds
    }

    /// Run ns per sample of the watched spinner: the round's run time less its other
    /// runs (idle CPUs, other threads) at `filter_ns` each, over the spinner's samples.
    fn ns_per_watched_sample(&self, filter_ns: f64) -> f64 {
        (self.ns - filter_ns * (self.runs - self.spinner_samples)) / self.spinner_samples
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum OffcpuMode {
    /// `[stacks] offcpu = false`.
    Off,
    /// `offcpu = true`, `offcpu_idle = true`, default `offcpu_min` (1 ms): each of
    /// pingpong's blocks is captured at its switch, none is recorded (they last µs).
    Capture,
    /// As `Capture`, with `offcpu_min = 1ns`: each block is also recorded when it ends.
    Record,
    /// `Capture` and `Record` with `offcpu_sample_one_in = 1`: every block captured,
    /// where the defaults sample one in 8 past 1000 blocks a second per CPU (pingpong
    /// blocks ~100 times that).
    CaptureEvery,
    RecordEvery,
}

impl OffcpuMode {
    const ALL: [Self; 5] = [
        Self::Off,
        Self::Capture,
        Self::Record,
        Self::CaptureEvery,
        Self::RecordEvery,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Off => "offcpu=false",
            Self::Capture => "offcpu_idle",
            Self::Record => "offcpu_min=1ns",
            Self::CaptureEvery => "offcpu_idle,every",
            Self::RecordEvery => "offcpu_min=1ns,every",
        }
    }

    /// poolscope's settings: the mode's, and no on-CPU sampling.
    fn env(self) -> Vec<(&'static str, &'static str)> {
        let mut env = vec![("POOLSCOPE_PROBES__SAMPLING_HZ", "0")];
        match self {
            Self::Off => env.push(("POOLSCOPE_STACKS__OFFCPU", "false")),
            // Pingpong's threads hold no request: their blocks are `idle`, which
            // only `offcpu_idle` captures.
            Self::Capture => env.extend([
                ("POOLSCOPE_STACKS__OFFCPU", "true"),
                ("POOLSCOPE_STACKS__OFFCPU_IDLE", "true"),
            ]),
            Self::Record => env.extend([
                ("POOLSCOPE_STACKS__OFFCPU", "true"),
                ("POOLSCOPE_STACKS__OFFCPU_IDLE", "true"),
                ("POOLSCOPE_STACKS__OFFCPU_MIN", "1ns"),
            ]),
            Self::CaptureEvery => env.extend([
                ("POOLSCOPE_STACKS__OFFCPU", "true"),
                ("POOLSCOPE_STACKS__OFFCPU_IDLE", "true"),
                ("POOLSCOPE_STACKS__OFFCPU_SAMPLE_ONE_IN", "1"),
            ]),
            Self::RecordEvery => env.extend([
                ("POOLSCOPE_STACKS__OFFCPU", "true"),
                ("POOLSCOPE_STACKS__OFFCPU_IDLE", "true"),
                ("POOLSCOPE_STACKS__OFFCPU_MIN", "1ns"),
                ("POOLSCOPE_STACKS__OFFCPU_SAMPLE_ONE_IN", "1"),
            ]),
        }
        env
    }
}

impl SchedStats {
    /// `sched_switch`'s run time per block of a pingpong thread (two per round trip;
    /// the host's other switches are in it too, alike in every mode).
    fn switch_ns_per_block(&self) -> f64 {
        self.switch.1 / (2.0 * self.roundtrips)
    }

    /// `sched_wakeup`'s run time per wakeup of a pingpong thread (the same).
    fn wakeup_ns_per_block(&self) -> f64 {
        self.wakeup.1 / (2.0 * self.roundtrips)
    }
}

/// The stack snapshot benchmark: spinners, pingpong, nginx.
pub(super) fn run_stacks(
    root: &Path,
    dir: PathBuf,
    rounds: usize,
    seconds: u64,
) -> anyhow::Result<()> {
    build_test_programs(root, &["spinners"])?;
    let (_idle, sched) = SchedBench::start(root, dir.clone(), seconds)?;

    let mut samples = Vec::new();
    for round in 0..rounds {
        for mode in rotated(&SampleMode::ALL, round) {
            let result = measure_alone(
                mode.name(),
                || sched.wait_for_quiet(),
                || sched.sample_round(mode),
            )?;
            println!(
                "round {:>2} {:<14} {SAMPLER} at {SAMPLING_HZ_HIGH} Hz {:>6.0} runs/s {:>6.1} ns/run \
                 spinner {:>4.0} samples/s  poolscope {:.2}% of a CPU{}",
                round + 1,
                mode.name(),
                result.runs_per_second(),
                result.ns_per_run(),
                result.spinner_samples_per_second(),
                result.poolscope_cpu_share * 100.0,
                result.disturbance.note()
            );
            samples.push(result);
        }
    }

    let mut offcpu = Vec::new();
    for round in 0..rounds {
        for mode in rotated(&OffcpuMode::ALL, round) {
            let watch = |pingpong| {
                let name = format!("offcpu-{}", mode.name());
                let ready = SchedBench::ready("pingpong");
                sched
                    .watch(&name, ("pingpong", pingpong), &mode.env(), &ready)
                    .map(Some)
            };
            let result = measure_alone(
                mode.name(),
                || sched.wait_for_quiet(),
                || sched.pingpong_round(mode, watch),
            )?;
            println!(
                "round {:>2} {:<14} {:>8.0} roundtrips/s  stats on: sched_switch {:>5.1} ns/run \
                 {:>5.1} ns/block, sched_wakeup {:>5.1} ns/run {:>5.1} ns/block{}",
                round + 1,
                mode.name(),
                result.roundtrips_per_second,
                result.stat(SchedStats::switch_ns_per_run),
                result.stat(SchedStats::switch_ns_per_block),
                result.stat(SchedStats::wakeup_ns_per_run),
                result.stat(SchedStats::wakeup_ns_per_block),
                result.disturbance.note()
            );
            offcpu.push(result);
        }
    }

    let (_nginx, nginx) = Bench::start(root, dir, seconds)?;
    let mut throughput = Vec::new();
    for round in 0..rounds {
        for hz in rotated(&NGINX_SAMPLING, round) {
            let name = sampling_name(hz);
            let backend = if hz.is_some() {
                Mode::Socket
            } else {
                Mode::Off
            };
            let rate = hz.unwrap_or_default().to_string();
            let env = [("POOLSCOPE_PROBES__SAMPLING_HZ", rate.as_str())];
            let result = measure_alone(
                &name,
                || nginx.wait_for_quiet(),
                || nginx.measure(backend, &env),
            )?;
            println!(
                "round {:>2} {:<14} {:>10.0} req/s {:>8.2} µs nginx CPU/req {:>6.2} µs poolscope \
                 CPU/req{}",
                round + 1,
                name,
                result.requests_per_second,
                result.cpu_us_per_request,
                result.poolscope_cpu_us_per_request,
                result.disturbance.note()
            );
            throughput.push((hz, result));
        }
    }
    stacks_report(&samples, &offcpu, &throughput);
    Ok(())
}

fn sampling_name(hz: Option<u32>) -> String {
    match hz {
        None => "off".to_owned(),
        Some(hz) => format!("{hz} Hz"),
    }
}

impl SchedBench<'_> {
    /// One round of `spinners` (one thread spinning on `SPINNER_CPU`) with poolscope
    /// sampling at `SAMPLING_HZ_HIGH`, watching the spinner or only the idle process:
    /// `cpu_sample`'s runs and run time over `seconds` with kernel.bpf_stats_enabled.
    fn sample_round(&self, mode: SampleMode) -> anyhow::Result<SampleRound> {
        let args = ["1".to_owned(), SPINNER_CPU.to_string(), "3600".to_owned()];
        let mut spinner = LineProgram::start(self.root, "spinners", None, &args)?;
        spinner.line("spinners ")?;
        let spinner_pid = spinner.pid();
        let (target, ready) = match mode {
            SampleMode::Unwatched => (("idle", self.idle), Self::ready("idle")),
            SampleMode::Watched => (
                ("spinners", spinner_pid),
                vec!["poolscope_pool_threads{service=\"spinners\",pool=\"spin\"} 1\n".to_owned()],
            ),
        };
        let hz = SAMPLING_HZ_HIGH.to_string();
        let hooks = self.watch(
            &format!("samples-{}", mode.name()),
            target,
            &[("POOLSCOPE_PROBES__SAMPLING_HZ", &hz)],
            &ready,
        )?;
        let exporter_pid = hooks.poolscope_pid();
        let ours = |pid: u32, _: &Process| {
            pid == spinner_pid || pid == self.idle || Some(pid) == exporter_pid
        };
        let enabled = BpfStats::enable()?;
        let started = Instant::now();
        let at_start = processes();
        let before = hooks.counters()?;
        sleep(Duration::from_secs(self.seconds));
        let counted = hooks.counters()?.since(&before);
        let at_end = processes();
        let elapsed = started.elapsed().as_secs_f64();
        drop(enabled);
        let cpu_seconds = |which: Option<u32>| {
            cpu_used(&at_start, &at_end)
                .filter(|(pid, _, _)| Some(*pid) == which)
                .fold(0.0, |sum, (_, _, used)| sum + used)
        };
        let (runs, ns) = counted.programs.get(SAMPLER).copied().unwrap_or_default();
        let disturbance = Disturbance::between(&at_start, &at_end, started.elapsed(), ours);
        drop(hooks);
        drop(spinner);
        Ok(SampleRound {
            mode,
            runs,
            ns,
            seconds: elapsed,
            spinner_samples: cpu_seconds(Some(spinner_pid)) * f64::from(SAMPLING_HZ_HIGH),
            poolscope_cpu_share: cpu_seconds(exporter_pid) / elapsed,
            disturbance,
        })
    }
}

fn stacks_report(
    samples: &[SampleRound],
    offcpu: &[SchedRound<OffcpuMode>],
    throughput: &[(Option<u32>, Round)],
) {
    let sample = |mode, pick: &dyn Fn(&SampleRound) -> f64| {
        min_median_where(samples, |r| r.mode == mode, pick)
    };
    let (_, filter_ns) = sample(SampleMode::Unwatched, &SampleRound::ns_per_run);
    println!();
    println!(
        "| {SAMPLER} at {SAMPLING_HZ_HIGH} Hz, spinners (1 thread on CPU {SPINNER_CPU}), \
         bpf_stats on | runs/s median | ns/run median (min) | spinner samples/s median \
         | ns per watched sample median (min) | poolscope CPU, % of a CPU median |"
    );
    println!("|---|---|---|---|---|---|");
    for mode in SampleMode::ALL {
        let (_, runs) = sample(mode, &SampleRound::runs_per_second);
        let (run_min, run) = sample(mode, &SampleRound::ns_per_run);
        let (_, spinner) = sample(mode, &SampleRound::spinner_samples_per_second);
        let per_sample = match mode {
            SampleMode::Unwatched => "-".to_owned(),
            SampleMode::Watched => {
                let (min, median) = sample(mode, &|r| r.ns_per_watched_sample(filter_ns));
                format!("{median:.0} ({min:.0})")
            }
        };
        let (_, own) = sample(mode, &|r| r.poolscope_cpu_share);
        println!(
            "| {} | {runs:.0} | {run:.1} ({run_min:.1}) | {spinner:.0} | {per_sample} | {:.2}% |",
            mode.name(),
            own * 100.0
        );
    }
    println!();
    println!(
        "ns/run: {SAMPLER}'s run time over its runs (every CPU's cpu-clock). Unwatched, every \
         run is the filter path: {filter_ns:.1} ns (median). Per watched sample: the watched \
         rounds' run time less their other runs at that cost, over the spinner's samples (its \
         CPU time × {SAMPLING_HZ_HIGH}); both stacks captured (bpf_get_stackid) and counted. \
         bpf_stats adds its own clock reads to every run (see BENCH_ONLY=sched, empty)."
    );

    let stat = |mode, pick: fn(&SchedStats) -> f64| {
        min_median_where(offcpu, |r| r.mode == mode, |r| r.stat(pick))
    };
    let rate = |mode| min_median_where(offcpu, |r| r.mode == mode, |r| r.roundtrips_per_second);
    let (rate_off_min, rate_off) = rate(OffcpuMode::Off);
    let (_, switch_off) = stat(OffcpuMode::Off, SchedStats::switch_ns_per_block);
    let (_, wakeup_off) = stat(OffcpuMode::Off, SchedStats::wakeup_ns_per_block);
    println!();
    println!(
        "| pingpong watched (2 threads on CPU {PINGPONG_CPU}), sampling off | roundtrips/s \
         median (min) | /offcpu=false median | /offcpu=false min | sched_switch ns/run median \
         (min) | sched_wakeup ns/run median (min) | sched_switch ns/block median | minus \
         offcpu=false | sched_wakeup ns/block median | minus offcpu=false | pingpong's share \
         of switches |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for mode in OffcpuMode::ALL {
        let (rate_min, rate_median) = rate(mode);
        let (switch_min, switch) = stat(mode, SchedStats::switch_ns_per_run);
        let (wakeup_min, wakeup) = stat(mode, SchedStats::wakeup_ns_per_run);
        let (_, switch_block) = stat(mode, SchedStats::switch_ns_per_block);
        let (_, wakeup_block) = stat(mode, SchedStats::wakeup_ns_per_block);
        let (_, share) = stat(mode, SchedStats::pingpong_share);
        println!(
            "| {} | {rate_median:.0} ({rate_min:.0}) | {:.4} | {:.4} | {switch:.1} \
             ({switch_min:.1}) | {wakeup:.1} ({wakeup_min:.1}) | {switch_block:.1} | {:+.1} \
             | {wakeup_block:.1} | {:+.1} | {:.1}% |",
            mode.name(),
            rate_median / rate_off,
            rate_min / rate_off_min,
            switch_block - switch_off,
            wakeup_block - wakeup_off,
            share * 100.0
        );
    }
    let wall_ns = |mode| (1e9 / rate(mode).1 - 1e9 / rate_off) / 2.0;
    for (capture, record, how) in [
        (
            OffcpuMode::CaptureEvery,
            OffcpuMode::RecordEvery,
            "every block captured (offcpu_sample_one_in = 1)",
        ),
        (
            OffcpuMode::Capture,
            OffcpuMode::Record,
            "the defaults (one block in 8 captured past 1000 a second per CPU)",
        ),
    ] {
        let (_, switch_capture) = stat(capture, SchedStats::switch_ns_per_block);
        let (_, switch_record) = stat(record, SchedStats::switch_ns_per_block);
        let (_, wakeup_capture) = stat(capture, SchedStats::wakeup_ns_per_block);
        let (_, wakeup_record) = stat(record, SchedStats::wakeup_ns_per_block);
        println!();
        println!(
            "Per off-CPU event (a block of a watched thread; medians, bpf_stats on), {how}: \
             capturing both stacks at the switch costs {:+.0} ns of sched_switch per block \
             (− offcpu=false); recording the block when it ends (offcpu_min=1ns) {:+.0} ns of \
             sched_wakeup (0 where it is not attached: the block then ends at the switch in) \
             and {:+.0} ns of sched_switch: {:+.0} ns per recorded block in all. A block shorter than offcpu_min (default 1 ms) pays the capture only. Wall \
             time per block, bpf_stats off (half a round trip more than offcpu=false): {:+.0} \
             ns captured, {:+.0} ns recorded.",
            switch_capture - switch_off,
            wakeup_record - wakeup_capture,
            switch_record - switch_capture,
            switch_record - switch_off + wakeup_record - wakeup_off,
            wall_ns(capture),
            wall_ns(record),
        );
    }

    let of = |hz, pick: fn(&Round) -> f64| {
        min_median_where(throughput, |(mode, _)| *mode == hz, |(_, r)| pick(r))
    };
    let (rate_off_min, rate_off) = of(None, |r| r.requests_per_second);
    println!();
    println!(
        "| nginx, 1 worker, wrk -t1 -c32; poolscope socket backend, sampling at | requests/s \
         median (min) | /off median | /off min | nginx CPU µs/request median (min) | poolscope \
         CPU µs/request median (min) | poolscope CPU, % of a CPU median |"
    );
    println!("|---|---|---|---|---|---|---|");
    for hz in NGINX_SAMPLING {
        let (rate_min, rate_median) = of(hz, |r| r.requests_per_second);
        let (cpu_min, cpu) = of(hz, |r| r.cpu_us_per_request);
        let (own_min, own) = of(hz, |r| r.poolscope_cpu_us_per_request);
        // µs per request × requests per second: µs per second.
        let (_, share) = of(hz, |r| {
            r.poolscope_cpu_us_per_request * r.requests_per_second
        });
        println!(
            "| {} | {rate_median:.0} ({rate_min:.0}) | {:.4} | {:.4} | {cpu:.2} ({cpu_min:.2}) \
             | {own:.2} ({own_min:.2}) | {:.2}% |",
            sampling_name(hz),
            rate_median / rate_off,
            rate_min / rate_off_min,
            share / 1e4,
        );
    }
    let skewed = samples
        .iter()
        .map(|r| (r.mode.name().to_owned(), &r.disturbance))
        .chain(
            offcpu
                .iter()
                .map(|r| (r.mode.name().to_owned(), &r.disturbance)),
        )
        .chain(
            throughput
                .iter()
                .map(|(hz, r)| (sampling_name(*hz), &r.disturbance)),
        )
        .filter(|(_, disturbance)| disturbance.skews());
    for (name, disturbance) in skewed {
        println!("{name} round{}", disturbance.note());
    }
}
