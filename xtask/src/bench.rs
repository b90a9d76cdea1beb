//! `cargo xtask bench`: what poolscope costs a real server, with each request backend.
//! nginx (one worker, pinned to CPU 0) serves a small static file over keep-alive
//! connections to wrk (pinned to CPU 1) at saturation, in rounds interleaved between
//! poolscope off, on with the socket backend and on with the syscall backend. Prints the
//! per-round numbers, the min/median of each mode and their ratios to off: throughput,
//! nginx's and poolscope's CPU per request and the cost of one syscall of a process
//! poolscope does not watch. One more round per backend, with kernel.bpf_stats_enabled,
//! gives the kernel time of its request programs per request poolscope counted (its
//! count is checked against wrk's). Results are printed beside their goals. A round that
//! another poolscope or other busy processes skewed is marked, and measured again once
//! the machine is quiet.
//!
//! Then what the scheduler programs (raw tracepoints `sched_switch`, `sched_wakeup`,
//! which run on every context switch and wakeup of the host) cost: `pingpong`
//! (tests/src/bin/pingpong.rs: two threads pinned to CPU 1 bouncing a byte over pipes,
//! two switches and two wakeups per round trip) in rounds interleaved between poolscope
//! off, `empty` (no poolscope, a program that only returns on both tracepoints: what
//! the hooks cost, and what kernel.bpf_stats_enabled adds to each run it times), on
//! watching only an idle `sleep` (pingpong's threads are unwatched: failed lookups) and
//! on watching pingpong (each event moves a thread's state machine). Each hooked round
//! runs pingpong twice: for its throughput, then with kernel.bpf_stats_enabled for the
//! programs' run time per context switch of the host and per run, as measured and net
//! of the empty program's. Printed beside their goals, skewed rounds measured again.
//!
//! Then what measuring lock waits costs (`BENCH_ONLY=locks`), in rounds interleaved
//! between poolscope off, on (futex waits only, the default) and on with the opt-in
//! `pthread_mutex_lock` uprobes (`[probes] lock_uprobes`): `lockserver` (4 workers
//! contending one pthread mutex held 200 µs on CPU) under a fixed closed-loop load (8
//! clients, one connection per request; neither pinned, so that about half of the lock
//! calls block) for the throughput of a lock-heavy server; `mutexloop`
//! (tests/src/bin/mutexloop.rs, pinned to CPU 0) for the in-process time of an
//! uncontended lock/unlock pair, in a request and outside one. The futex rounds also
//! load, with kernel.bpf_stats_enabled, the contended server and one with a single
//! worker (same hold, no contention): the scheduler programs' extra time per futex
//! lock wait. The uprobe rounds time the probes' programs per lock call the same way.
//! bpf_stats is switched on by the bench around those loads only (as for pingpong),
//! not by poolscope's `[probes] bpf_stats`, which would slow the throughput loads too.
//! Printed beside their goals, skewed rounds measured again.
//!
//! Then what stack snapshots cost (`BENCH_ONLY=stacks`), each in rounds interleaved
//! between its modes. On-CPU samples: `spinners` (one thread spinning on CPU 1) with
//! poolscope sampling at 999 Hz, watching it or only an idle `sleep`; with
//! kernel.bpf_stats_enabled, the run time of `cpu_sample` per run (every CPU's
//! cpu-clock: unwatched, the filter path) and per sample of the watched thread (its
//! CPU time × the rate). Off-CPU stacks: pingpong watched (sampling off) with `[stacks]
//! offcpu` false, true with `offcpu_idle` (pingpong's blocks hold no request: idle;
//! default `offcpu_min`: its µs blocks are captured at each switch, never recorded) and
//! also with `offcpu_min = 1ns` (each also recorded at its wakeup): the scheduler programs' run time per run and per pingpong block. Then the
//! nginx load above with poolscope off and on (socket backend) at 0, 49 and 999 Hz.
//!
//! `BENCH_ROUNDS` (default 3 rounds of all modes) and `BENCH_SECONDS` (default 5) tune
//! all four; `BENCH_LOCK_HOLD_US` (default 200) the lock's hold time. `BENCH_ONLY=nginx`,
//! `BENCH_ONLY=sched`, `BENCH_ONLY=locks` or `BENCH_ONLY=stacks` runs one of them.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    os::fd::{FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

pub const PACKAGES: &[&str] = &["nginx", "wrk"];

/// Goal: kernel time of the request programs per request.
const GOAL_BPF_NS_PER_REQUEST: f64 = 300.0;
/// Goal: throughput at saturation with poolscope on, as a share of off (≤ 3% loss).
const GOAL_THROUGHPUT_RATIO: f64 = 0.97;
/// Goal: kernel time of the scheduler programs per context switch, for threads
/// poolscope does not watch (a failed lookup per event).
const GOAL_SCHED_NS_UNWATCHED: f64 = 100.0;
/// Goal: the same for watched threads (each event moves their state machine).
const GOAL_SCHED_NS_WATCHED: f64 = 250.0;
/// The CPU both pingpong threads run on.
const PINGPONG_CPU: usize = 1;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Off,
    Socket,
    Syscall,
}

impl Mode {
    const ALL: [Self; 3] = [Self::Off, Self::Socket, Self::Syscall];
    const BACKENDS: [Self; 2] = [Self::Socket, Self::Syscall];

    /// Also the value of poolscope's `[probes] backend`.
    fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Socket => "socket",
            Self::Syscall => "syscall",
        }
    }

    /// The backend's programs that follow requests: their run time is the cost of a
    /// request (the process programs run on fork, exec and exit only).
    fn request_programs(self) -> &'static [&'static str] {
        match self {
            Self::Off => &[],
            Self::Socket => &["sock_state", "sock_data_ready", "sock_recv", "sock_send"],
            Self::Syscall => &["sys_enter", "sys_exit"],
        }
    }
}

/// poolscope's counters, from /metrics.
#[derive(Default)]
struct Counters {
    /// `poolscope_requests_total` of nginx.
    requests: f64,
    /// `poolscope_connections_accepted_total` of nginx.
    connections: f64,
    /// program → (runs, run ns)
    programs: BTreeMap<String, (f64, f64)>,
}

impl Counters {
    fn parse(body: &str) -> Self {
        let mut counters = Self::default();
        for line in body.lines() {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let nginx = |metric| label(series, metric, "service") == Some("nginx");
            if nginx("poolscope_requests_total") {
                counters.requests = value;
            } else if nginx("poolscope_connections_accepted_total") {
                counters.connections = value;
            } else if let Some(name) = label(series, "poolscope_bpf_runs_total", "program") {
                counters.programs.entry(name.to_owned()).or_default().0 = value;
            } else if let Some(name) = label(series, "poolscope_bpf_run_seconds_total", "program") {
                counters.programs.entry(name.to_owned()).or_default().1 = value * 1e9;
            }
        }
        counters
    }

    /// What was counted since `before`.
    fn since(&self, before: &Self) -> Self {
        let programs = self
            .programs
            .iter()
            .map(|(name, (runs, ns))| {
                let (runs_before, ns_before) =
                    before.programs.get(name).copied().unwrap_or_default();
                (name.clone(), (runs - runs_before, ns - ns_before))
            })
            .collect();
        Self {
            requests: self.requests - before.requests,
            connections: self.connections - before.connections,
            programs,
        }
    }

    /// Run ns of the mode's request programs per request poolscope counted.
    fn bpf_ns_per_request(&self, mode: Mode) -> f64 {
        let ns: f64 = mode
            .request_programs()
            .iter()
            .filter_map(|name| self.programs.get(*name))
            .map(|(_, ns)| ns)
            .sum();
        ns / self.requests
    }
}

/// The value of the only label of a `metric{label="value"}` series.
fn label<'a>(series: &'a str, metric: &str, label: &str) -> Option<&'a str> {
    series
        .strip_prefix(metric)?
        .strip_prefix('{')?
        .strip_prefix(label)?
        .strip_prefix("=\"")?
        .strip_suffix("\"}")
}

struct Round {
    mode: Mode,
    requests_per_second: f64,
    /// Requests wrk finished.
    requests: f64,
    /// nginx's CPU time (user + system, which includes the kernel programs).
    cpu_us_per_request: f64,
    /// poolscope's own (user space) CPU time.
    poolscope_cpu_us_per_request: f64,
    /// Cost of one syscall of a process poolscope does not watch (the hooks are
    /// system-wide): `dd bs=1` from /dev/zero to /dev/null, pinned to CPU 1.
    unwatched_syscall_ns: f64,
    /// What poolscope counted during the round (nothing when off).
    counted: Counters,
    /// What else ran during the round.
    disturbance: Disturbance,
}

impl Measured for Round {
    fn disturbance(&self) -> &Disturbance {
        &self.disturbance
    }
}

/// Kills and reaps a child when dropped.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        // SAFETY: plain kill(2) on our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A port nothing listens on now (the machine may run other servers, other benches).
fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

pub fn run(root: &Path) -> anyhow::Result<()> {
    let rounds = env_number("BENCH_ROUNDS", 3).max(1) as usize;
    let seconds = env_number("BENCH_SECONDS", 5).max(1);
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    type Part = fn(&Path, PathBuf, usize, u64) -> anyhow::Result<()>;
    let parts: [(&str, Part); 4] = [
        ("nginx", run_nginx),
        ("sched", run_sched),
        ("locks", run_locks),
        ("stacks", run_stacks),
    ];
    if !only.is_empty() && !parts.iter().any(|(name, _)| *name == only) {
        bail!("BENCH_ONLY={only}: nginx, sched, locks or stacks");
    }
    let dir = root.join("target/bench");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).context("creating target/bench")?;
    let mut first = true;
    for (name, part) in parts {
        if only.is_empty() || only == name {
            if !first {
                println!();
            }
            first = false;
            part(root, dir.clone(), rounds, seconds)?;
        }
    }
    Ok(())
}

/// The request benchmark: nginx and wrk.
fn run_nginx(root: &Path, dir: PathBuf, rounds: usize, seconds: u64) -> anyhow::Result<()> {
    let (_nginx, bench) = Bench::start(root, dir, seconds)?;
    let mut measured = Vec::new();
    for round in 0..rounds {
        for mode in rotated(&Mode::ALL, round) {
            let result = bench.measure_alone(mode, &[])?;
            println!(
                "round {:>2} {:<7} {:>10.0} req/s {:>8.2} µs nginx CPU/req {:>6.2} µs poolscope CPU/req \
                 {:>6.1} ns/unwatched syscall{}",
                round + 1,
                mode.name(),
                result.requests_per_second,
                result.cpu_us_per_request,
                result.poolscope_cpu_us_per_request,
                result.unwatched_syscall_ns,
                result.disturbance.note()
            );
            measured.push(result);
        }
    }
    // Per-program cost needs kernel.bpf_stats_enabled, which itself slows every run:
    // measured in one extra round per backend, apart from the throughput rounds.
    let stats_rounds = Mode::BACKENDS
        .iter()
        .map(|&mode| bench.measure_alone(mode, &[("POOLSCOPE_PROBES__BPF_STATS", "true")]))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let calibration = bench.calibrate()?;
    report(&measured, &stats_rounds, &calibration);
    Ok(())
}

/// The hooks of the request programs, as raw tracepoints: an empty program on each
/// gives what a run costs before the program does anything (the dispatch, and
/// bpf_stats' own clock reads).
const REQUEST_HOOKS: [(&str, &str); 5] = [
    ("sock_data_ready", "sk_data_ready"),
    ("sock_recv", "sock_recv_length"),
    ("sock_send", "sock_send_length"),
    ("sys_enter", "sys_enter"),
    ("sys_exit", "sys_exit"),
];

/// Run ns of an empty program, by the request program whose hook it shares.
struct Calibration {
    ns_per_run: BTreeMap<&'static str, f64>,
}

impl Calibration {
    /// Run ns of the mode's request programs per request, less what an empty program
    /// costs per run on the same hooks.
    fn net_ns_per_request(&self, counted: &Counters, mode: Mode) -> f64 {
        let ns: f64 = mode
            .request_programs()
            .iter()
            .filter_map(|name| {
                let (runs, ns) = counted.programs.get(*name)?;
                Some(ns - runs * self.ns_per_run.get(name).copied().unwrap_or(0.0))
            })
            .sum();
        ns / counted.requests
    }
}

impl<'a> Bench<'a> {
    /// Starts nginx (until the guard drops) and warms it up.
    fn start(root: &'a Path, dir: PathBuf, seconds: u64) -> anyhow::Result<(Guard, Self)> {
        let nginx_port = free_port()?;
        fs::create_dir_all(dir.join("www")).context("creating target/bench/www")?;
        fs::write(dir.join("www/index.html"), "x".repeat(612))?;
        fs::write(dir.join("nginx.conf"), nginx_config(&dir, nginx_port))?;
        fs::write(
            dir.join("poolscope.toml"),
            "[[targets]]\nservice = \"nginx\"\ncomm = \"^nginx$\"\n",
        )?;

        let mut nginx = Guard(
            Command::new("taskset")
                .args(["-c", "0", "nginx", "-p"])
                .arg(&dir)
                .arg("-c")
                .arg(dir.join("nginx.conf"))
                .stderr(Stdio::null())
                .spawn()
                .context("starting nginx")?,
        );
        wait_for_port(nginx_port)?;
        if let Some(status) = nginx.0.try_wait()? {
            bail!(
                "nginx exited ({status}); see {}",
                dir.join("error.log").display()
            );
        }
        let bench = Bench {
            root,
            seconds,
            nginx: nginx.0.id(),
            nginx_port,
            poolscope_address: format!("127.0.0.1:{}", free_port()?),
            dir,
        };
        // Warm up caches and the worker.
        bench.wrk()?;
        Ok((nginx, bench))
    }
}

fn nginx_config(dir: &Path, port: u16) -> String {
    format!(
        "daemon off;\nmaster_process on;\nworker_processes 1;\npid {dir}/nginx.pid;\n\
         error_log {dir}/error.log warn;\nevents {{ worker_connections 1024; }}\n\
         http {{\n  access_log off;\n  sendfile on;\n  keepalive_requests 1000000;\n\
         server {{ listen 127.0.0.1:{port}; root {dir}/www; }}\n}}\n",
        dir = dir.display()
    )
}

fn wait_for_port(port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        sleep(Duration::from_millis(50));
    }
    bail!("nothing listens on port {port} after 10 s")
}

fn unwatched_syscall_ns() -> anyhow::Result<f64> {
    const COPIES: u64 = 1_000_000;
    let started = Instant::now();
    let status = Command::new("taskset")
        .args(["-c", "1", "dd", "if=/dev/zero", "of=/dev/null", "bs=1"])
        .arg(format!("count={COPIES}"))
        .stderr(Stdio::null())
        .status()
        .context("running dd")?;
    if !status.success() {
        bail!("dd failed ({status})");
    }
    // One read and one write per byte copied.
    Ok(started.elapsed().as_nanos() as f64 / (2 * COPIES) as f64)
}

/// A process's parent, name and CPU time (user + system) so far.
struct Process {
    ppid: u32,
    comm: String,
    cpu_seconds: f64,
}

/// Every process now, by pid.
fn processes() -> BTreeMap<u32, Process> {
    // SAFETY: sysconf cannot fail for _SC_CLK_TCK.
    let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut processes = BTreeMap::new();
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = stat.get(open + 1..close).unwrap_or_default().to_owned();
        let fields: Vec<&str> = stat
            .get(close + 2..)
            .unwrap_or_default()
            .split_whitespace()
            .collect();
        let field = |i: usize| -> u64 { fields.get(i).and_then(|v| v.parse().ok()).unwrap_or(0) };
        // ppid, utime and stime are fields 4, 14 and 15, i.e. 1, 11 and 12 after the comm.
        let process = Process {
            ppid: field(1) as u32,
            comm,
            cpu_seconds: (field(11) + field(12)) as f64 / ticks_per_second,
        };
        processes.insert(pid, process);
    }
    processes
}

/// CPU seconds each process used between two snapshots.
fn cpu_used<'a>(
    before: &'a BTreeMap<u32, Process>,
    after: &'a BTreeMap<u32, Process>,
) -> impl Iterator<Item = (u32, &'a Process, f64)> {
    after.iter().map(|(pid, process)| {
        let earlier = before.get(pid).map_or(0.0, |p| p.cpu_seconds);
        (*pid, process, process.cpu_seconds - earlier)
    })
}

/// Share of one CPU above which other processes skew a round.
const OTHERS_CPU_SHARE: f64 = 0.05;

/// What else ran while we measured: other poolscopes (their hooks are system-wide too)
/// and other processes using CPU, which nginx and wrk need whole. Either skews a round.
#[derive(Default)]
struct Disturbance {
    poolscopes: BTreeSet<u32>,
    /// Their CPU time over the wall time.
    cpu_share: f64,
    /// The name of the process that used the most.
    busiest: String,
}

impl Disturbance {
    /// Between two snapshots `elapsed` apart; `ours` tells our processes (nginx, wrk,
    /// our poolscope) from the others.
    fn between(
        before: &BTreeMap<u32, Process>,
        after: &BTreeMap<u32, Process>,
        elapsed: Duration,
        ours: impl Fn(u32, &Process) -> bool,
    ) -> Self {
        let mut disturbance = Self::default();
        let mut busiest = 0.0;
        let mut cpu_seconds = 0.0;
        for snapshot in [before, after] {
            disturbance.poolscopes.extend(
                snapshot
                    .iter()
                    .filter(|(pid, p)| p.comm == "poolscope" && !ours(**pid, p))
                    .map(|(pid, _)| *pid),
            );
        }
        // Kernel threads (children of kthreadd, pid 2) do the network's work too.
        let others = cpu_used(before, after)
            .filter(|(pid, p, _)| *pid != 2 && p.ppid != 2 && *pid != std::process::id())
            .filter(|(pid, p, _)| !ours(*pid, p));
        for (_, process, used) in others {
            cpu_seconds += used;
            if used > busiest {
                busiest = used;
                disturbance.busiest.clone_from(&process.comm);
            }
        }
        disturbance.cpu_share = cpu_seconds / elapsed.as_secs_f64();
        disturbance
    }

    fn skews(&self) -> bool {
        !self.poolscopes.is_empty() || self.cpu_share > OTHERS_CPU_SHARE
    }

    /// A note for the round's line when it was skewed.
    fn note(&self) -> String {
        let mut note = String::new();
        if !self.poolscopes.is_empty() {
            let pids: Vec<String> = self.poolscopes.iter().map(u32::to_string).collect();
            note += &format!("  (skewed: another poolscope ran, pid {})", pids.join(", "));
        }
        if self.cpu_share > OTHERS_CPU_SHARE {
            note += &format!(
                "  (skewed: other processes used {:.0}% of a CPU, most {})",
                self.cpu_share * 100.0,
                self.busiest
            );
        }
        note
    }
}

/// Waits up to 2 minutes until nothing else runs, so that rounds are not skewed;
/// false when something still does. `ours` tells the processes that stay between
/// rounds.
fn wait_for_quiet(ours: impl Fn(u32, &Process) -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut said = false;
    while Instant::now() < deadline {
        let before = processes();
        let started = Instant::now();
        sleep(Duration::from_secs(1));
        let disturbance = Disturbance::between(&before, &processes(), started.elapsed(), &ours);
        if !disturbance.skews() {
            return true;
        }
        if !said {
            println!(
                "         waiting for other work to end{}",
                disturbance.note()
            );
            said = true;
        }
    }
    false
}

/// A measured round, and what else ran during it.
trait Measured {
    fn disturbance(&self) -> &Disturbance;
}

/// Measures a round again (up to 3 times in all) when something else skewed it,
/// unless the machine did not get quiet before it (`quiet` waits for that); `name`
/// says which.
fn measure_alone<R: Measured>(
    name: &str,
    quiet: impl Fn() -> bool,
    measure: impl Fn() -> anyhow::Result<R>,
) -> anyhow::Result<R> {
    const ATTEMPTS: usize = 3;
    let mut attempt = 1;
    loop {
        let quiet = quiet();
        let round = measure()?;
        if attempt == ATTEMPTS || !quiet || !round.disturbance().skews() {
            return Ok(round);
        }
        println!(
            "         {name:<9} skewed{}; again",
            round.disturbance().note()
        );
        attempt += 1;
    }
}

/// Starts the release poolscope with `config`, serving on `address`, with more
/// settings from `env`.
fn spawn_poolscope(
    root: &Path,
    config: &Path,
    address: &str,
    env: &[(&str, &str)],
) -> anyhow::Result<Guard> {
    let child = Command::new(root.join("target/release/poolscope"))
        .arg("--config.file")
        .arg(config)
        .args(["--web.listen-address", address])
        .args(["--log.level", "warn"])
        .envs(env.iter().copied())
        .spawn()
        .context("starting poolscope")?;
    Ok(Guard(child))
}

/// poolscope's /metrics (with the response's head).
fn scrape(address: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect(address)?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: poolscope\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}

/// Waits up to 20 s until poolscope's /metrics on `address` shows every line of `ready`.
fn wait_for_metrics(address: &str, ready: &[String]) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if scrape(address).is_ok_and(|body| ready.iter().all(|line| body.contains(line.as_str()))) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "poolscope did not show {} within 20 s",
                ready.join(" and ").replace('\n', "")
            );
        }
        sleep(Duration::from_millis(100));
    }
}

/// Builds the release test programs `names` (tests/src/bin).
fn build_test_programs(root: &Path, names: &[&str]) -> anyhow::Result<()> {
    let mut args = vec![
        "build",
        "--quiet",
        "--release",
        "--package",
        "poolscope-tests",
    ];
    for name in names {
        args.extend(["--bin", name]);
    }
    crate::cargo(root, &args)
}

/// What every round shares.
struct Bench<'a> {
    root: &'a Path,
    /// target/bench: nginx's root and configuration, poolscope's configuration.
    dir: PathBuf,
    seconds: u64,
    /// nginx's master process.
    nginx: u32,
    nginx_port: u16,
    poolscope_address: String,
}

impl Bench<'_> {
    /// (requests/s, total requests) from wrk's summary.
    fn wrk(&self) -> anyhow::Result<(f64, f64)> {
        let output = Command::new("taskset")
            .args(["-c", "1", "wrk", "-t1", "-c32"])
            .arg(format!("-d{}s", self.seconds))
            .arg(format!("http://127.0.0.1:{}/index.html", self.nginx_port))
            .output()
            .context("running wrk")?;
        let text = String::from_utf8_lossy(&output.stdout);
        let rate = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("Requests/sec:"))
            .and_then(|v| v.trim().parse().ok());
        let total = text
            .lines()
            .find(|l| l.contains(" requests in "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|v| v.parse().ok());
        match (rate, total) {
            (Some(rate), Some(total)) => Ok((rate, total)),
            _ => bail!("cannot read wrk's output:\n{text}"),
        }
    }

    /// Starts poolscope with the mode's backend and more settings from `env`; `None`
    /// when off.
    fn start_poolscope(&self, mode: Mode, env: &[(&str, &str)]) -> anyhow::Result<Option<Guard>> {
        if mode == Mode::Off {
            return Ok(None);
        }
        let mut env = env.to_vec();
        env.push(("POOLSCOPE_PROBES__BACKEND", mode.name()));
        let guard = spawn_poolscope(
            self.root,
            &self.dir.join("poolscope.toml"),
            &self.poolscope_address,
            &env,
        )?;
        self.wait_for_targets(mode)?;
        Ok(Some(guard))
    }

    /// A round, measured again if something else skewed it (`measure_alone`).
    fn measure_alone(&self, mode: Mode, env: &[(&str, &str)]) -> anyhow::Result<Round> {
        measure_alone(
            mode.name(),
            || self.wait_for_quiet(),
            || self.measure(mode, env),
        )
    }

    fn is_nginx(&self, pid: u32, process: &Process) -> bool {
        pid == self.nginx || process.ppid == self.nginx
    }

    fn wait_for_quiet(&self) -> bool {
        wait_for_quiet(|pid, p| self.is_nginx(pid, p))
    }

    fn measure(&self, mode: Mode, env: &[(&str, &str)]) -> anyhow::Result<Round> {
        let exporter = self.start_poolscope(mode, env)?;
        let exporter_pid = exporter.as_ref().map(|guard| guard.0.id());
        let ours = |pid: u32, p: &Process| {
            self.is_nginx(pid, p) || Some(pid) == exporter_pid || p.comm == "wrk" || p.comm == "dd"
        };
        let before = exporter.as_ref().map(|_| self.counters()).transpose()?;
        let started = Instant::now();
        let at_start = processes();
        let (rate, total) = self.wrk()?;
        let after_wrk = processes();
        // nginx closes the connections wrk left; poolscope ends their last request then.
        sleep(Duration::from_millis(200));
        let counted = match before {
            Some(before) => self.counters()?.since(&before),
            None => Counters::default(),
        };
        // After the counters were read: dd's syscalls are not requests.
        let unwatched_syscall_ns = unwatched_syscall_ns()?;
        let disturbance = Disturbance::between(&at_start, &processes(), started.elapsed(), ours);
        drop(exporter);
        let cpu_us_per_request = |which: &dyn Fn(u32, &Process) -> bool| {
            // fold from +0.0: an empty sum() is -0.0, printed "-0.00".
            let seconds = cpu_used(&at_start, &after_wrk)
                .filter(|(pid, p, _)| which(*pid, p))
                .fold(0.0, |sum, (_, _, used)| sum + used);
            seconds * 1e6 / total.max(1.0)
        };
        Ok(Round {
            mode,
            requests_per_second: rate,
            requests: total,
            unwatched_syscall_ns,
            cpu_us_per_request: cpu_us_per_request(&|pid, p| self.is_nginx(pid, p)),
            poolscope_cpu_us_per_request: cpu_us_per_request(&|pid, _| Some(pid) == exporter_pid),
            counted,
            disturbance,
        })
    }

    fn scrape(&self) -> anyhow::Result<String> {
        scrape(&self.poolscope_address)
    }

    /// One wrk load with an empty program on each request hook and
    /// kernel.bpf_stats_enabled, as the stats rounds have it.
    fn calibrate(&self) -> anyhow::Result<Calibration> {
        let programs = REQUEST_HOOKS
            .iter()
            .map(|(_, hook)| EmptyProgram::attach(hook))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let stats = BpfStats::enable()?;
        let before = programs
            .iter()
            .map(EmptyProgram::counters)
            .collect::<anyhow::Result<Vec<_>>>()?;
        self.wrk()?;
        let mut ns_per_run = BTreeMap::new();
        for (((program, _), empty), (runs, ns)) in REQUEST_HOOKS.iter().zip(&programs).zip(before) {
            let (runs_after, ns_after) = empty.counters()?;
            ns_per_run.insert(*program, (ns_after - ns) / (runs_after - runs).max(1.0));
        }
        drop(stats);
        Ok(Calibration { ns_per_run })
    }

    fn counters(&self) -> anyhow::Result<Counters> {
        Ok(Counters::parse(&self.scrape()?))
    }

    /// Waits until poolscope serves, with the mode's backend, and watches nginx.
    fn wait_for_targets(&self, mode: Mode) -> anyhow::Result<()> {
        let backend = format!("backend=\"{}\"", mode.name());
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.scrape().is_ok_and(|body| {
                body.contains("poolscope_targets{service=\"nginx\"} 2") && body.contains(&backend)
            }) {
                return Ok(());
            }
            sleep(Duration::from_millis(100));
        }
        bail!(
            "poolscope ({} backend) did not watch nginx's two processes within 20 s",
            mode.name()
        )
    }
}

fn min_median(values: &mut [f64]) -> (f64, f64) {
    values.sort_by(f64::total_cmp);
    let median = if values.is_empty() {
        f64::NAN
    } else {
        values[values.len() / 2]
    };
    (values.first().copied().unwrap_or(f64::NAN), median)
}

/// (min, median) of one quantity over the rounds of a mode.
fn of_mode(rounds: &[Round], mode: Mode, pick: fn(&Round) -> f64) -> (f64, f64) {
    min_median_where(rounds, |r| r.mode == mode, pick)
}

fn met(met: bool) -> &'static str {
    if met { "met" } else { "NOT met" }
}

fn report(rounds: &[Round], stats_rounds: &[Round], calibration: &Calibration) {
    let rate = |mode| of_mode(rounds, mode, |r| r.requests_per_second);
    let cpu = |mode| of_mode(rounds, mode, |r| r.cpu_us_per_request);
    let poolscope_cpu = |mode| of_mode(rounds, mode, |r| r.poolscope_cpu_us_per_request);
    let syscall = |mode| of_mode(rounds, mode, |r| r.unwatched_syscall_ns);
    let (rate_off_min, rate_off) = rate(Mode::Off);
    let (_, cpu_off) = cpu(Mode::Off);
    let (_, syscall_off) = syscall(Mode::Off);
    println!();
    println!(
        "| nginx, 1 worker, wrk -t1 -c32 | requests/s median (min) | /off median | /off min \
         | nginx CPU µs/request median (min) | /off median | poolscope CPU µs/request median \
         (min) | ns per unwatched syscall (dd bs=1) median (min) | minus off (median) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for mode in Mode::ALL {
        let (rate_min, rate_median) = rate(mode);
        let (cpu_min, cpu_median) = cpu(mode);
        let (syscall_min, syscall_median) = syscall(mode);
        let (own_min, own_median) = poolscope_cpu(mode);
        println!(
            "| {} | {rate_median:.0} ({rate_min:.0}) | {:.4} | {:.4} | {cpu_median:.2} ({cpu_min:.2}) \
             | {:.4} | {own_median:.2} ({own_min:.2}) | {syscall_median:.1} ({syscall_min:.1}) \
             | {:+.1} |",
            mode.name(),
            rate_median / rate_off,
            rate_min / rate_off_min,
            cpu_median / cpu_off,
            syscall_median - syscall_off,
        );
    }
    println!();
    println!("Kernel programs, from one more round per backend with kernel.bpf_stats_enabled=1:");
    println!();
    println!(
        "| backend | req/s | requests: wrk | requests: poolscope | poolscope/wrk \
         | requests/connection | BPF ns/request | less an empty program's cost per run |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for round in stats_rounds {
        let counted = &round.counted;
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.4} | {:.0} | {:.0} | {:.0} |",
            round.mode.name(),
            round.requests_per_second,
            round.requests,
            counted.requests,
            counted.requests / round.requests,
            counted.requests / counted.connections,
            counted.bpf_ns_per_request(round.mode),
            calibration.net_ns_per_request(counted, round.mode),
        );
    }
    println!();
    println!("Calibration, the same load with an empty program on each hook (ns per run):");
    for (program, ns) in &calibration.ns_per_run {
        println!("- {program}'s hook: {ns:.0}");
    }
    for round in stats_rounds.iter().filter(|r| r.disturbance.skews()) {
        println!("{} round{}", round.mode.name(), round.disturbance.note());
    }
    println!();
    println!("| backend | kernel program | in ns/request | runs | runs/request | ns/run |");
    println!("|---|---|---|---|---|---|");
    for round in stats_rounds {
        for (name, (runs, ns)) in &round.counted.programs {
            if *runs > 0.0 {
                let counts = round.mode.request_programs().contains(&name.as_str());
                println!(
                    "| {} | {name} | {} | {runs:.0} | {:.2} | {:.0} |",
                    round.mode.name(),
                    if counts { "yes" } else { "no" },
                    runs / round.counted.requests,
                    ns / runs
                );
            }
        }
    }
    println!();
    println!(
        "Goals: ≤ {GOAL_BPF_NS_PER_REQUEST:.0} ns BPF time per request (less the calibration); ≤ {:.0}% throughput loss \
         at saturation (median of rounds).",
        (1.0 - GOAL_THROUGHPUT_RATIO) * 100.0
    );
    for round in stats_rounds {
        let mode = round.mode;
        let bpf_ns = calibration.net_ns_per_request(&round.counted, mode);
        let (rate_min, rate_median) = rate(mode);
        let ratio = rate_median / rate_off;
        println!(
            "{:<7}  BPF {bpf_ns:>5.0} ns/request: {:<7}  throughput {:.2}% of off (min {:.2}%): {}",
            mode.name(),
            met(bpf_ns <= GOAL_BPF_NS_PER_REQUEST),
            ratio * 100.0,
            rate_min / rate_off_min * 100.0,
            met(ratio >= GOAL_THROUGHPUT_RATIO),
        );
    }
}

// Context switches: what the scheduler programs cost.

/// The programs that run on every context switch and wakeup of the host.
const SCHED_PROGRAMS: [&str; 2] = ["sched_switch", "sched_wakeup"];

#[derive(Clone, Copy, PartialEq, Eq)]
enum SchedMode {
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

/// kernel.bpf_stats_enabled while held: the kernel times every BPF program's runs.
/// Taken with bpf(BPF_ENABLE_STATS), as poolscope's `[probes] bpf_stats` does, rather
/// than through the sysctl: it ends with the descriptor, however this process ends.
struct BpfStats {
    /// Held, never used: closing it turns the stats off.
    _fd: OwnedFd,
}

impl BpfStats {
    fn enable() -> anyhow::Result<Self> {
        /// `union bpf_attr`'s `enable_stats`: `{ __u32 type; }`, BPF_STATS_RUN_TIME.
        const BPF_STATS_RUN_TIME: u32 = 0;
        let fd = bpf_fd(BPF_ENABLE_STATS, &BPF_STATS_RUN_TIME).context("bpf(BPF_ENABLE_STATS)")?;
        Ok(Self { _fd: fd })
    }
}

/// bpf(2) commands and program type (include/uapi/linux/bpf.h).
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_RAW_TRACEPOINT_OPEN: libc::c_long = 17;
const BPF_ENABLE_STATS: libc::c_long = 32;
const BPF_PROG_TYPE_RAW_TRACEPOINT: u32 = 17;

/// bpf(2) with `attr` (a prefix of `union bpf_attr`; the kernel zeroes the rest): the
/// descriptor it returns.
fn bpf_fd<T>(command: libc::c_long, attr: &T) -> std::io::Result<OwnedFd> {
    // SAFETY: bpf(2) reads `size_of::<T>()` bytes of `attr`, which lives across the
    // call, and follows only the pointers the caller put in it; it returns a new
    // descriptor or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            std::ptr::from_ref(attr),
            size_of::<T>() as u32,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor the call just opened, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `union bpf_attr` for BPF_PROG_LOAD, up to `prog_name`.
#[repr(C)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
}

/// `union bpf_attr` for BPF_RAW_TRACEPOINT_OPEN.
#[repr(C)]
struct RawTracepointAttr {
    name: u64,
    prog_fd: u32,
    pad: u32,
}

/// A program that only returns, attached to the raw tracepoint it is named after.
struct EmptyProgram {
    name: &'static str,
    program: OwnedFd,
    /// Held: the attachment lasts while it is open.
    _link: OwnedFd,
}

impl EmptyProgram {
    fn attach(tracepoint: &'static str) -> anyhow::Result<Self> {
        // r0 = 0; exit
        const INSTRUCTIONS: [u64; 2] = [0xb7, 0x95];
        let license = c"GPL";
        let mut prog_name = [0; 16];
        prog_name[..5].copy_from_slice(b"empty");
        let attr = ProgLoadAttr {
            prog_type: BPF_PROG_TYPE_RAW_TRACEPOINT,
            insn_cnt: INSTRUCTIONS.len() as u32,
            insns: INSTRUCTIONS.as_ptr() as u64,
            license: license.as_ptr() as u64,
            log_level: 0,
            log_size: 0,
            log_buf: 0,
            kern_version: 0,
            prog_flags: 0,
            prog_name,
        };
        let program = bpf_fd(BPF_PROG_LOAD, &attr).context("loading an empty program")?;
        let name = std::ffi::CString::new(tracepoint)?;
        let attr = RawTracepointAttr {
            name: name.as_ptr() as u64,
            prog_fd: std::os::fd::AsRawFd::as_raw_fd(&program) as u32,
            pad: 0,
        };
        let link = bpf_fd(BPF_RAW_TRACEPOINT_OPEN, &attr)
            .with_context(|| format!("attaching an empty program to {tracepoint}"))?;
        Ok(Self {
            name: tracepoint,
            program,
            _link: link,
        })
    }

    /// (runs, run ns) so far, from the program's fdinfo.
    fn counters(&self) -> anyhow::Result<(f64, f64)> {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&self.program);
        let info = fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))?;
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
                .unwrap_or(f64::NAN)
        };
        Ok((field("run_cnt:"), field("run_time_ns:")))
    }
}

/// What hooks the scheduler in a round.
enum Hooks {
    Poolscope { guard: Guard, address: String },
    Empty([EmptyProgram; 2]),
}

impl Hooks {
    /// The programs' counters: program name → (runs, run ns).
    fn counters(&self) -> anyhow::Result<Counters> {
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

    fn poolscope_pid(&self) -> Option<u32> {
        match self {
            Self::Poolscope { guard, .. } => Some(guard.0.id()),
            Self::Empty(_) => None,
        }
    }
}

/// One run of pingpong with kernel.bpf_stats_enabled.
struct SchedStats {
    roundtrips_per_second: f64,
    roundtrips: f64,
    /// (runs, run ns) of `sched_switch` and `sched_wakeup` over the run: every
    /// switch and wakeup of the host, not only pingpong's.
    switch: (f64, f64),
    wakeup: (f64, f64),
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

    fn switch_ns_per_run(&self) -> f64 {
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

    fn wakeup_ns_per_run(&self) -> f64 {
        self.wakeup.1 / self.wakeup.0
    }

    /// Share of the host's switches that were pingpong's (two per round trip).
    fn pingpong_share(&self) -> f64 {
        2.0 * self.roundtrips / self.switch.0
    }
}

struct SchedRound<M = SchedMode> {
    mode: M,
    /// pingpong's throughput, kernel.bpf_stats_enabled off.
    roundtrips_per_second: f64,
    /// The second run, with kernel.bpf_stats_enabled (poolscope modes).
    stats: Option<SchedStats>,
    disturbance: Disturbance,
}

impl<M> Measured for SchedRound<M> {
    fn disturbance(&self) -> &Disturbance {
        &self.disturbance
    }
}

impl<M> SchedRound<M> {
    fn stat(&self, pick: fn(&SchedStats) -> f64) -> f64 {
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
struct SchedBench<'a> {
    root: &'a Path,
    /// target/bench: poolscope's configurations.
    dir: PathBuf,
    seconds: u64,
    /// The idle process poolscope watches in the unwatched mode.
    idle: u32,
    poolscope_address: String,
}

/// The context-switch benchmark: pingpong.
fn run_sched(root: &Path, dir: PathBuf, rounds: usize, seconds: u64) -> anyhow::Result<()> {
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
    fn start(root: &'a Path, dir: PathBuf, seconds: u64) -> anyhow::Result<(Guard, Self)> {
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

    fn wait_for_quiet(&self) -> bool {
        wait_for_quiet(|pid, _| pid == self.idle)
    }

    /// A round, measured again if something else skewed it (`measure_alone`).
    fn measure_alone(&self, mode: SchedMode) -> anyhow::Result<SchedRound> {
        measure_alone(mode.name(), || self.wait_for_quiet(), || self.measure(mode))
    }

    /// poolscope watching process `pid` as `service`, with more settings from `env`
    /// (configuration: poolscope-`name`.toml), once /metrics shows every line of `ready`.
    fn watch(
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
    fn ready(service: &str) -> Vec<String> {
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
    fn pingpong_round<M>(
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
         median | wakeups/switch | pingpong's share of switches (median) |"
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
         time a round trip took more than off, bpf_stats off (hooks and programs)."
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

// Lock waits: what measuring them costs.

/// Goal: an uncontended lock costs nothing in the default mode (futex waits only, no
/// uprobes): a lock/unlock pair at most this much slower than off (median of rounds;
/// the loop's own spread between rounds).
const GOAL_UNCONTENDED_RATIO: f64 = 1.05;
/// Goal: throughput of a lock-heavy server with poolscope on in the default mode, as
/// a share of off.
const GOAL_LOCKS_THROUGHPUT_RATIO: f64 = 0.95;
/// lockserver's workers, all contending its one mutex.
const LOCK_WORKERS: u32 = 4;
/// Closed-loop clients (more than the workers: every worker always has a request).
const LOCK_CLIENTS: usize = 8;
/// The CPU mutexloop runs on (lockserver and its clients are not pinned: on one CPU,
/// a worker holding the lock is rarely preempted, and only ~7% of lock calls block;
/// on two, about half of them).
const MUTEXLOOP_CPU: usize = 0;
/// Lock/unlock pairs per timed loop: ~40 ms at ~8 ns a pair.
const LOOP_PAIRS: u64 = 5_000_000;
/// The same with the uprobes, which trap twice per lock call (~11 µs a call on our
/// test VMs): ~0.2 s.
const LOOP_PAIRS_UPROBES: u64 = 20_000;
/// Timed loops per place (in a request, outside one) per round; the round keeps the
/// fastest (what preemptions and interrupts did not stretch).
const LOOP_SAMPLES: usize = 10;
/// Service names of the lock programs in poolscope's configuration.
const CONTENDED: &str = "lk";
const UNCONTENDED: &str = "lk1";
const MUTEXLOOP: &str = "ml";

#[derive(Clone, Copy, PartialEq, Eq)]
enum LockMode {
    Off,
    /// poolscope watching, default probes: futex waits from the scheduler programs.
    Futex,
    /// The same with `[probes] lock_uprobes` on lockserver and mutexloop.
    Uprobes,
}

impl LockMode {
    const ALL: [Self; 3] = [Self::Off, Self::Futex, Self::Uprobes];

    fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Futex => "futex",
            Self::Uprobes => "uprobes",
        }
    }
}

/// A test program that speaks in lines on its stdin and stdout; killed when dropped.
struct LineProgram {
    name: &'static str,
    input: Option<ChildStdin>,
    output: BufReader<ChildStdout>,
    guard: Guard,
}

impl LineProgram {
    /// Starts `name`, restricted to CPU `cpu` if given.
    fn start(
        root: &Path,
        name: &'static str,
        cpu: Option<usize>,
        args: &[String],
    ) -> anyhow::Result<Self> {
        let binary = root.join("target/release").join(name);
        // taskset execs the program: its pid is the program's.
        let mut command = match cpu {
            Some(cpu) => {
                let mut taskset = Command::new("taskset");
                taskset.args(["-c", &cpu.to_string()]).arg(binary);
                taskset
            }
            None => Command::new(binary),
        };
        let mut child = command
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        let (input, output) = (child.stdin.take(), child.stdout.take());
        let guard = Guard(child);
        let (Some(input), Some(output)) = (input, output) else {
            bail!("{name} has no stdin or stdout");
        };
        Ok(Self {
            name,
            input: Some(input),
            output: BufReader::new(output),
            guard,
        })
    }

    fn pid(&self) -> u32 {
        self.guard.0.id()
    }

    /// The next line, which must start with `prefix`: the rest of it.
    fn line(&mut self, prefix: &str) -> anyhow::Result<String> {
        let mut line = String::new();
        self.output
            .read_line(&mut line)
            .with_context(|| format!("reading {}", self.name))?;
        match line.trim_end().strip_prefix(prefix) {
            Some(rest) => Ok(rest.to_owned()),
            None if line.is_empty() => bail!("{} exited", self.name),
            None => bail!("{} said {line:?}, not {prefix:?}…", self.name),
        }
    }

    fn send(&mut self, line: &str) -> anyhow::Result<()> {
        let input = self.input.as_mut().context("stdin already closed")?;
        input
            .write_all(format!("{line}\n").as_bytes())
            .with_context(|| format!("writing to {}", self.name))
    }
}

/// A `lockserver` (tests/src/bin/lockserver.rs).
struct LockServer {
    program: LineProgram,
    port: u16,
}

impl LockServer {
    fn start(root: &Path, workers: u32, hold_us: u64) -> anyhow::Result<Self> {
        let mut program = LineProgram::start(
            root,
            "lockserver",
            None,
            &[workers.to_string(), hold_us.to_string()],
        )?;
        let port = program.line("port ")?.parse()?;
        program.line("workers ")?;
        Ok(Self { program, port })
    }

    fn pid(&self) -> u32 {
        self.program.pid()
    }

    /// Closes its stdin: (lock calls, calls that blocked), over its life.
    fn finish(mut self) -> anyhow::Result<(f64, f64)> {
        self.program.input = None;
        let line = self.program.line("locks ")?;
        let numbers: Vec<f64> = line.split(' ').filter_map(|v| v.parse().ok()).collect();
        match numbers[..] {
            [calls, blocked, ..] => Ok((calls, blocked)),
            _ => bail!("cannot read lockserver's locks {line:?}"),
        }
    }
}

/// A `mutexloop` (tests/src/bin/mutexloop.rs).
struct MutexLoop {
    program: LineProgram,
    port: u16,
    /// Opened at the first loop in a request, once poolscope watches (it follows the
    /// connections it sees accepted).
    connection: Option<BufReader<TcpStream>>,
}

impl MutexLoop {
    fn start(root: &Path) -> anyhow::Result<Self> {
        let mut program = LineProgram::start(root, "mutexloop", Some(MUTEXLOOP_CPU), &[])?;
        let port = program.line("port ")?.parse()?;
        program.line("looper ")?;
        Ok(Self {
            program,
            port,
            connection: None,
        })
    }

    fn pid(&self) -> u32 {
        self.program.pid()
    }

    /// ns per lock/unlock pair of a loop of `pairs` in a request.
    fn in_request(&mut self, pairs: u64) -> anyhow::Result<f64> {
        let connection = match self.connection.as_mut() {
            Some(connection) => connection,
            None => {
                let stream = TcpStream::connect(("127.0.0.1", self.port))?;
                stream.set_nodelay(true)?;
                stream.set_read_timeout(Some(Duration::from_secs(60)))?;
                self.connection.insert(BufReader::new(stream))
            }
        };
        connection
            .get_mut()
            .write_all(format!("loop {pairs}\n").as_bytes())?;
        let mut line = String::new();
        connection.read_line(&mut line)?;
        let ns: f64 = line
            .trim_end()
            .parse()
            .with_context(|| format!("mutexloop answered {line:?}"))?;
        Ok(ns / pairs as f64)
    }

    /// The same outside any request (its main thread, asked on stdin).
    fn outside_request(&mut self, pairs: u64) -> anyhow::Result<f64> {
        self.program.send(&format!("loop {pairs}"))?;
        let ns: f64 = self.program.line("ns ")?.parse()?;
        Ok(ns / pairs as f64)
    }
}

/// `LOCK_CLIENTS` closed-loop clients, one connection per request (`req\n` → `ok\n`), for `duration`: (requests completed, per second).
fn lock_load(port: u16, duration: Duration) -> anyhow::Result<(f64, f64)> {
    let started = Instant::now();
    let deadline = started + duration;
    let client = move || -> anyhow::Result<u64> {
        let mut completed = 0;
        let mut response = [0u8; 3];
        while Instant::now() < deadline {
            let mut stream = TcpStream::connect(("127.0.0.1", port))?;
            stream.set_nodelay(true)?;
            stream.set_read_timeout(Some(Duration::from_secs(10)))?;
            stream.write_all(b"req\n")?;
            stream.read_exact(&mut response)?;
            if &response != b"ok\n" {
                bail!("lockserver answered {response:?}");
            }
            completed += 1;
        }
        Ok(completed)
    };
    let counts = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..LOCK_CLIENTS).map(|_| scope.spawn(client)).collect();
        clients
            .into_iter()
            .map(|client| match client.join() {
                Ok(result) => result,
                Err(_) => bail!("a client thread panicked"),
            })
            .collect::<anyhow::Result<Vec<u64>>>()
    })?;
    let requests = counts.iter().sum::<u64>() as f64;
    Ok((requests, requests / started.elapsed().as_secs_f64()))
}

/// poolscope's lock counters, from /metrics.
#[derive(Default)]
struct LockCounters {
    /// `lock_wait_seconds_count` summed over pools, by (service, primitive).
    waits: BTreeMap<(String, String), f64>,
    /// program → (runs, run ns)
    programs: BTreeMap<String, (f64, f64)>,
}

impl LockCounters {
    fn parse(body: &str) -> Self {
        let mut counters = Self {
            programs: Counters::parse(body).programs,
            ..Self::default()
        };
        for line in body.lines() {
            let Some((labels, value)) = line
                .strip_prefix("poolscope_lock_wait_seconds_count{")
                .and_then(|rest| rest.rsplit_once("} "))
            else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let get = |key: &str| {
                labels.split(',').find_map(|pair| {
                    pair.strip_prefix(key)?
                        .strip_prefix("=\"")?
                        .strip_suffix('"')
                        .map(str::to_owned)
                })
            };
            if let (Some(service), Some(primitive)) = (get("service"), get("primitive")) {
                *counters.waits.entry((service, primitive)).or_default() += value;
            }
        }
        counters
    }

    fn scrape(address: &str) -> anyhow::Result<Self> {
        Ok(Self::parse(&scrape(address)?))
    }

    /// What was counted since `before`.
    fn since(&self, before: &Self) -> Self {
        let waits = self
            .waits
            .iter()
            .map(|(key, count)| {
                let earlier = before.waits.get(key).copied().unwrap_or_default();
                (key.clone(), count - earlier)
            })
            .collect();
        let programs = self
            .programs
            .iter()
            .map(|(name, (runs, ns))| {
                let (runs_before, ns_before) =
                    before.programs.get(name).copied().unwrap_or_default();
                (name.clone(), (runs - runs_before, ns - ns_before))
            })
            .collect();
        Self { waits, programs }
    }

    fn waits(&self, service: &str, primitive: &str) -> f64 {
        self.waits
            .get(&(service.to_owned(), primitive.to_owned()))
            .copied()
            .unwrap_or_default()
    }

    fn program(&self, name: &str) -> (f64, f64) {
        self.programs.get(name).copied().unwrap_or_default()
    }
}

/// One load of a lockserver with kernel.bpf_stats_enabled.
struct LockStats {
    requests: f64,
    requests_per_second: f64,
    /// Futex lock waits poolscope counted.
    waits: f64,
    /// (runs, run ns) of `sched_switch` and `sched_wakeup` (every switch and wakeup
    /// of the host).
    switch: (f64, f64),
    wakeup: (f64, f64),
}

impl LockStats {
    /// Run time of both scheduler programs per request.
    fn sched_ns_per_request(&self) -> f64 {
        (self.switch.1 + self.wakeup.1) / self.requests
    }

    fn waits_per_request(&self) -> f64 {
        self.waits / self.requests
    }

    fn switches_per_request(&self) -> f64 {
        self.switch.0 / self.requests
    }

    fn switch_ns_per_run(&self) -> f64 {
        self.switch.1 / self.switch.0
    }

    fn wakeup_ns_per_run(&self) -> f64 {
        self.wakeup.1 / self.wakeup.0
    }
}

/// The stats loads of a futex round: the same lockserver with and without contention.
struct FutexStats {
    contended: LockStats,
    /// One worker: its lock calls never block.
    uncontended: LockStats,
}

impl FutexStats {
    /// The scheduler programs' extra time per futex lock wait: what they spend more
    /// per request on the contended server than on the uncontended one, over the
    /// contended server's lock waits per request. It includes the switches and
    /// wakeups the waits themselves cause, and the lock work (registers, user stack,
    /// per-lock histogram).
    fn extra_ns_per_wait(&self) -> f64 {
        (self.contended.sched_ns_per_request() - self.uncontended.sched_ns_per_request())
            / self.contended.waits_per_request()
    }
}

/// Picks one side of a futex round.
type Side = fn(&FutexStats) -> &LockStats;

struct LockRound {
    mode: LockMode,
    /// The contended lockserver's throughput, client side, bpf_stats off.
    requests_per_second: f64,
    /// Futex lock waits poolscope counted per request of that load (NaN when off).
    waits_per_request: f64,
    /// lockserver's own count of lock calls that blocked, per call, over its life.
    blocked_per_call: f64,
    /// ns per uncontended lock/unlock pair in a request and outside one (the fastest
    /// of the round's loops).
    pair_ns_in_request: f64,
    pair_ns_outside: f64,
    /// pthread_mutex lock waits poolscope recorded per lock call, in a request and
    /// outside one (NaN when off).
    recorded_in_request: f64,
    recorded_outside: f64,
    /// Futex rounds: the scheduler programs on the contended and uncontended servers.
    futex_stats: Option<FutexStats>,
    /// Uprobe rounds: run time of mutex_lock_enter and mutex_lock_return per lock call.
    uprobe_bpf_ns_per_call: f64,
    disturbance: Disturbance,
}

impl Measured for LockRound {
    fn disturbance(&self) -> &Disturbance {
        &self.disturbance
    }
}

/// What every lock round shares.
struct LockBench<'a> {
    root: &'a Path,
    /// target/bench: poolscope's configurations.
    dir: PathBuf,
    seconds: u64,
    hold_us: u64,
    poolscope_address: String,
}

/// The lock benchmark: lockserver and mutexloop.
fn run_locks(root: &Path, dir: PathBuf, rounds: usize, seconds: u64) -> anyhow::Result<()> {
    build_test_programs(root, &["lockserver", "mutexloop"])?;
    let bench = LockBench {
        root,
        dir,
        seconds,
        hold_us: env_number("BENCH_LOCK_HOLD_US", 200),
        poolscope_address: format!("127.0.0.1:{}", free_port()?),
    };
    // Warm up: the programs' pages, the CPUs' caches and frequency.
    let warm = LockServer::start(root, LOCK_WORKERS, bench.hold_us)?;
    lock_load(warm.port, Duration::from_secs(1))?;
    warm.finish()?;
    MutexLoop::start(root)?.in_request(LOOP_PAIRS)?;

    let mut measured = Vec::new();
    for round in 0..rounds {
        for mode in rotated(&LockMode::ALL, round) {
            let result = bench.measure_alone(mode)?;
            let mut line = format!(
                "round {:>2} {:<7} {:>6.0} req/s {:>5} futex waits/req ({:.2} blocked/call) \
                 pair {:>7.1} ns in request {:>7.1} ns outside",
                round + 1,
                mode.name(),
                result.requests_per_second,
                or_dash(result.waits_per_request, 2),
                result.blocked_per_call,
                result.pair_ns_in_request,
                result.pair_ns_outside,
            );
            if let Some(stats) = &result.futex_stats {
                line += &format!(
                    "  stats on: sched {:.0} ns/req contended, {:.0} uncontended: {:.0} ns/wait",
                    stats.contended.sched_ns_per_request(),
                    stats.uncontended.sched_ns_per_request(),
                    stats.extra_ns_per_wait(),
                );
            }
            if mode == LockMode::Uprobes {
                line += &format!(
                    "  stats on: uprobe programs {:.0} ns/call",
                    result.uprobe_bpf_ns_per_call
                );
            }
            println!("{line}{}", result.disturbance.note());
            measured.push(result);
        }
    }
    locks_report(&measured, bench.hold_us);
    Ok(())
}

impl LockBench<'_> {
    /// A round, measured again if something else skewed it (`measure_alone`).
    fn measure_alone(&self, mode: LockMode) -> anyhow::Result<LockRound> {
        measure_alone(
            mode.name(),
            || wait_for_quiet(|_, _| false),
            || self.measure(mode),
        )
    }

    /// Starts poolscope watching `targets` (service, pid) as the mode says (nothing
    /// when off), and waits until it follows their threads (and, with the uprobes,
    /// has attached them to `uprobed` processes).
    fn start_poolscope(
        &self,
        mode: LockMode,
        targets: &[(&str, u32, &str, u32)],
        uprobed: usize,
    ) -> anyhow::Result<Option<Guard>> {
        if mode == LockMode::Off {
            return Ok(None);
        }
        let mut config = String::new();
        if mode == LockMode::Uprobes {
            config += &format!("[probes]\nlock_uprobes = [\"{CONTENDED}\", \"{MUTEXLOOP}\"]\n");
        }
        let mut ready = Vec::new();
        for (service, pid, pool, threads) in targets {
            config += &format!("[[targets]]\nservice = \"{service}\"\npids = [{pid}]\n");
            ready.push(format!(
                "poolscope_pool_threads{{service=\"{service}\",pool=\"{pool}\"}} {threads}\n"
            ));
        }
        if mode == LockMode::Uprobes {
            ready.push(format!("poolscope_lock_uprobe_processes {uprobed}\n"));
        }
        let path = self
            .dir
            .join(format!("poolscope-locks-{}.toml", mode.name()));
        fs::write(&path, config)?;
        let guard = spawn_poolscope(self.root, &path, &self.poolscope_address, &[])?;
        wait_for_metrics(&self.poolscope_address, &ready)?;
        Ok(Some(guard))
    }

    /// One load of `server` with kernel.bpf_stats_enabled (held by the caller).
    fn stats_load(&self, server: &LockServer, service: &str) -> anyhow::Result<LockStats> {
        let before = LockCounters::scrape(&self.poolscope_address)?;
        let (requests, requests_per_second) =
            lock_load(server.port, Duration::from_secs(self.seconds))?;
        let counted = LockCounters::scrape(&self.poolscope_address)?.since(&before);
        Ok(LockStats {
            requests,
            requests_per_second,
            waits: counted.waits(service, "futex"),
            switch: counted.program(SCHED_PROGRAMS[0]),
            wakeup: counted.program(SCHED_PROGRAMS[1]),
        })
    }

    fn measure(&self, mode: LockMode) -> anyhow::Result<LockRound> {
        let contended = LockServer::start(self.root, LOCK_WORKERS, self.hold_us)?;
        let uncontended = match mode {
            LockMode::Futex => Some(LockServer::start(self.root, 1, self.hold_us)?),
            _ => None,
        };
        let mut looper = MutexLoop::start(self.root)?;
        let mut targets = vec![
            (CONTENDED, contended.pid(), "locker", LOCK_WORKERS),
            (MUTEXLOOP, looper.pid(), "looper", 1),
        ];
        if let Some(server) = &uncontended {
            targets.push((UNCONTENDED, server.pid(), "locker", 1));
        }
        let exporter = self.start_poolscope(mode, &targets, 2)?;
        let exporter_pid = exporter.as_ref().map(|guard| guard.0.id());
        let ours = |pid: u32, _: &Process| {
            targets.iter().any(|target| target.1 == pid) || Some(pid) == exporter_pid
        };
        let counters = || -> anyhow::Result<Option<LockCounters>> {
            match exporter {
                Some(_) => LockCounters::scrape(&self.poolscope_address).map(Some),
                None => Ok(None),
            }
        };
        let since = |before: &Option<LockCounters>, service: &str, primitive: &str| match (
            counters(),
            before,
        ) {
            (Ok(Some(after)), Some(before)) => after.since(before).waits(service, primitive),
            _ => f64::NAN,
        };
        let started = Instant::now();
        let at_start = processes();

        // The lock-heavy server's throughput.
        let before = counters()?;
        let (requests, requests_per_second) =
            lock_load(contended.port, Duration::from_secs(self.seconds))?;
        let waits_per_request = since(&before, CONTENDED, "futex") / requests;

        // Uncontended locks, in a request and outside one.
        let pairs = match mode {
            LockMode::Uprobes => LOOP_PAIRS_UPROBES,
            _ => LOOP_PAIRS,
        };
        let calls = (pairs * LOOP_SAMPLES as u64) as f64;
        let before = counters()?;
        let mut in_request = (0..LOOP_SAMPLES)
            .map(|_| looper.in_request(pairs))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let recorded_in_request = since(&before, MUTEXLOOP, "pthread_mutex") / calls;
        let before = counters()?;
        let mut outside = (0..LOOP_SAMPLES)
            .map(|_| looper.outside_request(pairs))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let recorded_outside = since(&before, MUTEXLOOP, "pthread_mutex") / calls;

        // With bpf_stats: the scheduler programs per lock wait (futex), the probes'
        // programs per call (uprobes).
        let mut futex_stats = None;
        let mut uprobe_bpf_ns_per_call = f64::NAN;
        if let Some(uncontended) = &uncontended {
            let _enabled = BpfStats::enable()?;
            futex_stats = Some(FutexStats {
                contended: self.stats_load(&contended, CONTENDED)?,
                uncontended: self.stats_load(uncontended, UNCONTENDED)?,
            });
        }
        if mode == LockMode::Uprobes {
            let _enabled = BpfStats::enable()?;
            let before = LockCounters::scrape(&self.poolscope_address)?;
            looper.in_request(pairs)?;
            let counted = LockCounters::scrape(&self.poolscope_address)?.since(&before);
            let ns = counted.program("mutex_lock_enter").1 + counted.program("mutex_lock_return").1;
            uprobe_bpf_ns_per_call = ns / pairs as f64;
        }
        let disturbance = Disturbance::between(&at_start, &processes(), started.elapsed(), ours);
        drop(exporter);
        let (lock_calls, blocked) = contended.finish()?;
        if let Some(server) = uncontended {
            server.finish()?;
        }
        Ok(LockRound {
            mode,
            requests_per_second,
            waits_per_request,
            blocked_per_call: blocked / lock_calls,
            pair_ns_in_request: min_median(&mut in_request).0,
            pair_ns_outside: min_median(&mut outside).0,
            recorded_in_request,
            recorded_outside,
            futex_stats,
            uprobe_bpf_ns_per_call,
            disturbance,
        })
    }
}

/// The modes in round `round`'s order: rotated so that each mode takes each place and
/// drift hits all alike.
fn rotated<T: Copy>(modes: &[T], round: usize) -> impl Iterator<Item = T> + '_ {
    modes.iter().copied().cycle().skip(round).take(modes.len())
}

/// (min, median) of one quantity over the rounds `selected` picks.
fn min_median_where<R>(
    rounds: &[R],
    selected: impl Fn(&R) -> bool,
    pick: impl Fn(&R) -> f64,
) -> (f64, f64) {
    let mut values: Vec<f64> = rounds.iter().filter(|r| selected(r)).map(pick).collect();
    min_median(&mut values)
}

/// (min, median) of one quantity over the rounds of a mode.
fn of_lock_mode(
    rounds: &[LockRound],
    mode: LockMode,
    pick: impl Fn(&LockRound) -> f64,
) -> (f64, f64) {
    min_median_where(rounds, |r| r.mode == mode, pick)
}

/// `value` with `decimals`, or `-` when there is none (NaN: poolscope was off).
fn or_dash(value: f64, decimals: usize) -> String {
    if value.is_nan() {
        "-".to_owned()
    } else {
        format!("{value:.decimals$}")
    }
}

fn locks_report(rounds: &[LockRound], hold_us: u64) {
    let of = |mode, pick: fn(&LockRound) -> f64| of_lock_mode(rounds, mode, pick);
    let rate = |mode| of(mode, |r| r.requests_per_second);
    let in_request = |mode| of(mode, |r| r.pair_ns_in_request);
    let outside = |mode| of(mode, |r| r.pair_ns_outside);
    let (rate_off_min, rate_off) = rate(LockMode::Off);
    let (_, in_request_off) = in_request(LockMode::Off);
    let (_, outside_off) = outside(LockMode::Off);

    println!();
    println!(
        "| lockserver {LOCK_WORKERS} workers, 1 mutex held {hold_us} µs, {LOCK_CLIENTS} clients \
         | requests/s median (min) | /off median | /off min | futex waits/request (poolscope) \
         median | blocked lock calls/call (lockserver) median |"
    );
    println!("|---|---|---|---|---|---|");
    for mode in LockMode::ALL {
        let (rate_min, rate_median) = rate(mode);
        let (_, waits) = of(mode, |r| r.waits_per_request);
        let (_, blocked) = of(mode, |r| r.blocked_per_call);
        println!(
            "| {} | {rate_median:.0} ({rate_min:.0}) | {:.4} | {:.4} | {} | {blocked:.3} |",
            mode.name(),
            rate_median / rate_off,
            rate_min / rate_off_min,
            or_dash(waits, 3),
        );
    }

    println!();
    println!(
        "| mutexloop, uncontended lock/unlock pair | in a request: ns median (min) | minus off \
         | outside a request: ns median (min) | minus off | pthread_mutex waits recorded per \
         call: in a request / outside |"
    );
    println!("|---|---|---|---|---|---|");
    for mode in LockMode::ALL {
        let (in_min, in_median) = in_request(mode);
        let (out_min, out_median) = outside(mode);
        let (_, recorded_in) = of(mode, |r| r.recorded_in_request);
        let (_, recorded_out) = of(mode, |r| r.recorded_outside);
        println!(
            "| {} | {in_median:.2} ({in_min:.2}) | {:+.2} | {out_median:.2} ({out_min:.2}) \
             | {:+.2} | {} / {} |",
            mode.name(),
            in_median - in_request_off,
            out_median - outside_off,
            or_dash(recorded_in, 3),
            or_dash(recorded_out, 3),
        );
    }

    println!();
    let futex_rounds: Vec<&FutexStats> = rounds
        .iter()
        .filter_map(|r| r.futex_stats.as_ref())
        .collect();
    let stat = |pick: &dyn Fn(&FutexStats) -> f64| {
        let mut values: Vec<f64> = futex_rounds.iter().map(|s| pick(s)).collect();
        min_median(&mut values)
    };
    println!(
        "| futex rounds, bpf_stats on | requests/s median | futex waits/request median \
         | switches/request median | sched_switch ns/run median | sched_wakeup ns/run median \
         | sched BPF ns/request median (min) |"
    );
    println!("|---|---|---|---|---|---|---|");
    let sides: [(String, Side); 2] = [
        (format!("contended ({LOCK_WORKERS} workers)"), |s| {
            &s.contended
        }),
        ("uncontended (1 worker)".to_owned(), |s| &s.uncontended),
    ];
    for (name, side) in &sides {
        let (_, rate) = stat(&|s| side(s).requests_per_second);
        let (_, waits) = stat(&|s| side(s).waits_per_request());
        let (_, switches) = stat(&|s| side(s).switches_per_request());
        let (_, switch) = stat(&|s| side(s).switch_ns_per_run());
        let (_, wakeup) = stat(&|s| side(s).wakeup_ns_per_run());
        let (ns_min, ns_median) = stat(&|s| side(s).sched_ns_per_request());
        println!(
            "| {name} | {rate:.0} | {waits:.3} | {switches:.2} | {switch:.1} | {wakeup:.1} \
             | {ns_median:.0} ({ns_min:.0}) |"
        );
    }
    let (extra_min, extra) = stat(&FutexStats::extra_ns_per_wait);
    let per_round: Vec<String> = futex_rounds
        .iter()
        .map(|s| format!("{:.0}", s.extra_ns_per_wait()))
        .collect();
    let (_, extra_switches) = stat(&|s| {
        (s.contended.switches_per_request() - s.uncontended.switches_per_request())
            / s.contended.waits_per_request()
    });
    println!();
    println!(
        "Extra BPF ns per futex lock wait: {extra:.0} median ({extra_min:.0} min; rounds {}): \
         (contended − uncontended) sched_switch + sched_wakeup ns per request, over the \
         contended server's futex waits per request. It includes the switches and wakeups a \
         wait causes ({extra_switches:.2} more switches per wait, median) \
         besides the lock work itself (registers, user stack, per-lock histogram); bpf_stats \
         adds its own clock reads to every run.",
        per_round.join(", ")
    );
    let (_, uprobe_bpf) = of(LockMode::Uprobes, |r| r.uprobe_bpf_ns_per_call);
    let (_, uprobe_in) = in_request(LockMode::Uprobes);
    let (_, uprobe_out) = outside(LockMode::Uprobes);
    println!(
        "Uprobes: a lock call costs {:+.0} ns in a request and {:+.0} ns outside one \
         (uncontended; median, minus off); their programs (mutex_lock_enter + \
         mutex_lock_return, bpf_stats on) {uprobe_bpf:.0} ns of it, the rest is the two \
         traps (entry and return) every call pays, contended or not, recorded or not.",
        uprobe_in - in_request_off,
        uprobe_out - outside_off,
    );

    println!();
    println!(
        "Goals: uncontended locks cost nothing in the default mode (no uprobes): a lock/unlock \
         pair ≤ {:.0}% slower than off; lock-heavy throughput with poolscope on (futex) ≥ {:.0}% \
         of off (medians of rounds).",
        (GOAL_UNCONTENDED_RATIO - 1.0) * 100.0,
        GOAL_LOCKS_THROUGHPUT_RATIO * 100.0
    );
    let (_, in_futex) = in_request(LockMode::Futex);
    let (_, out_futex) = outside(LockMode::Futex);
    let (rate_futex_min, rate_futex) = rate(LockMode::Futex);
    let (in_ratio, out_ratio) = (in_futex / in_request_off, out_futex / outside_off);
    let throughput = rate_futex / rate_off;
    println!(
        "futex    uncontended pair {:.1}% of off in a request, {:.1}% outside: {}; lock-heavy \
         throughput {:.2}% of off (min {:.2}%): {}",
        in_ratio * 100.0,
        out_ratio * 100.0,
        met(in_ratio <= GOAL_UNCONTENDED_RATIO && out_ratio <= GOAL_UNCONTENDED_RATIO),
        throughput * 100.0,
        rate_futex_min / rate_off_min * 100.0,
        met(throughput >= GOAL_LOCKS_THROUGHPUT_RATIO),
    );
    let (rate_uprobes_min, rate_uprobes) = rate(LockMode::Uprobes);
    println!(
        "uprobes  uncontended pair {:.0}× off in a request, {:.0}× outside; lock-heavy \
         throughput {:.2}% of off (min {:.2}%) (opt-in: no goal)",
        uprobe_in / in_request_off,
        uprobe_out / outside_off,
        rate_uprobes / rate_off * 100.0,
        rate_uprobes_min / rate_off_min * 100.0,
    );
    println!(
        "Why lock_uprobes is off by default: every pthread_mutex_lock call of a process with \
         them traps twice into the kernel (+{:.0} ns here, {:.0}× an uncontended pair's \
         {in_request_off:.1} ns), in a request or not, contended or not; futex waits cost only \
         the lock calls that block.",
        uprobe_in - in_request_off,
        (uprobe_in - in_request_off) / in_request_off
    );
    for round in rounds.iter().filter(|r| r.disturbance.skews()) {
        println!("{} round{}", round.mode.name(), round.disturbance.note());
    }
}

// Stack snapshots: what on-CPU samples and off-CPU stacks cost.

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
    /// As `Capture`, with `offcpu_min = 1ns`: each block is also recorded at its wakeup.
    Record,
}

impl OffcpuMode {
    const ALL: [Self; 3] = [Self::Off, Self::Capture, Self::Record];

    fn name(self) -> &'static str {
        match self {
            Self::Off => "offcpu=false",
            Self::Capture => "offcpu_idle",
            Self::Record => "offcpu_min=1ns",
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
fn run_stacks(root: &Path, dir: PathBuf, rounds: usize, seconds: u64) -> anyhow::Result<()> {
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
    let (_, switch_capture) = stat(OffcpuMode::Capture, SchedStats::switch_ns_per_block);
    let (_, switch_record) = stat(OffcpuMode::Record, SchedStats::switch_ns_per_block);
    let (_, wakeup_capture) = stat(OffcpuMode::Capture, SchedStats::wakeup_ns_per_block);
    let (_, wakeup_record) = stat(OffcpuMode::Record, SchedStats::wakeup_ns_per_block);
    let wall_ns = |mode| (1e9 / rate(mode).1 - 1e9 / rate_off) / 2.0;
    println!();
    println!(
        "Per off-CPU event (a block of a watched thread; medians, bpf_stats on): the capture \
         of both stacks at the switch costs {:+.0} ns of sched_switch (offcpu=true − false); \
         recording the block at its wakeup (offcpu_min=1ns, every block) {:+.0} ns of \
         sched_wakeup (− offcpu=true; {:+.0} ns of sched_switch besides). A block shorter \
         than offcpu_min (default 1 ms) pays the capture only. Wall time per block, bpf_stats \
         off (half a round trip more than offcpu=false): {:+.0} ns offcpu=true, {:+.0} ns \
         offcpu_min=1ns.",
        switch_capture - switch_off,
        wakeup_record - wakeup_capture,
        switch_record - switch_capture,
        wall_ns(OffcpuMode::Capture),
        wall_ns(OffcpuMode::Record),
    );

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
