//! `cargo xtask bench`: what poolscope costs a real server, with each request backend.
//! nginx (one worker, pinned to CPU 0) serves a small static file over keep-alive
//! connections to wrk (pinned to CPU 1) at saturation, in rounds interleaved between
//! poolscope off and on with each request backend (socket, tcp, syscall). Prints the
//! per-round numbers, the min/median of each mode and their ratios to off: throughput,
//! nginx's and poolscope's CPU per request and the cost of one syscall of a process
//! poolscope does not watch (with its goal: that process's time on ≥ 0.98 of off). One more round per backend, with kernel.bpf_stats_enabled,
//! gives the kernel time of its request programs per request poolscope counted (its
//! count is checked against wrk's). Results are printed beside their goals. A round that
//! another poolscope or other busy processes skewed is marked, and measured again once
//! the machine is quiet.
//!
//! Then what following HTTP/2 streams costs (`BENCH_ONLY=h2`, see `h2.rs`): nginx over
//! cleartext HTTP/2 under h2load, poolscope off and on, and the kernel time per stream.
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
//! Then how poolscope's cost grows with the number of services on the node
//! (`BENCH_ONLY=scale`, see `scale.rs`), and what reading how full the maps are costs
//! a scrape as they fill (`BENCH_ONLY=fill`, see `fill.rs`).
//!
//! `BENCH_ROUNDS` (default 3 rounds of all modes) and `BENCH_SECONDS` (default 5) tune
//! the first four; `BENCH_LOCK_HOLD_US` (default 200) the lock's hold time.
//! `BENCH_ONLY=nginx`, `h2`, `sched`, `locks`, `stacks`, `scale` or `fill` runs one of them;
//! `BENCH_POOLSCOPE=<path>` measures another poolscope binary (an older commit's).
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

mod bpf;
mod fill;
mod h2;
mod locks;
mod nginx;
mod scale;
mod sched;
mod stacks;

use fill::run_fill;
use h2::run_h2;
use locks::run_locks;
use nginx::run_nginx;
use scale::run_scale;
use sched::run_sched;
use stacks::run_stacks;

pub const PACKAGES: &[&str] = &["nginx", "wrk", "nghttp2-client"];

/// Kills and reaps a child when dropped.
pub(crate) struct Guard(pub(crate) Child);

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
pub(crate) fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

pub fn run(root: &Path) -> anyhow::Result<()> {
    let rounds = env_number("BENCH_ROUNDS", 3).max(1) as usize;
    let seconds = env_number("BENCH_SECONDS", 5).max(1);
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    type Part = fn(&Path, PathBuf, usize, u64) -> anyhow::Result<()>;
    let parts: [(&str, Part); 7] = [
        ("nginx", run_nginx),
        ("h2", run_h2),
        ("sched", run_sched),
        ("locks", run_locks),
        ("stacks", run_stacks),
        ("scale", run_scale),
        ("fill", run_fill),
    ];
    if !only.is_empty() && !parts.iter().any(|(name, _)| *name == only) {
        bail!("BENCH_ONLY={only}: nginx, h2, sched, locks, stacks, scale or fill");
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
    // `BENCH_POOLSCOPE`: another build (an older commit's) measured by the same bench.
    let binary = std::env::var_os("BENCH_POOLSCOPE")
        .map_or_else(|| root.join("target/release/poolscope"), PathBuf::from);
    spawn_poolscope_binary(&binary, config, address, env)
}

/// Starts poolscope `binary` with `config`, serving on `address`, with more settings
/// from `env`.
pub(crate) fn spawn_poolscope_binary(
    binary: &Path,
    config: &Path,
    address: &str,
    env: &[(&str, &str)],
) -> anyhow::Result<Guard> {
    let child = Command::new(binary)
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
    let mut response = Vec::new();
    scrape_into(address, "", &mut response)?;
    text(response)
}

/// One scrape of `address` with `headers` (each line ending in CRLF) into `response`
/// (emptied first; its capacity kept), answered with 200: a refusal or a timeout's
/// 503 is an error, not a fast scrape.
fn scrape_into(address: &str, headers: &str, response: &mut Vec<u8>) -> anyhow::Result<()> {
    get_into(address, "/metrics", headers, response)
}

/// `GET path` from poolscope on `address` with `headers` (each line ending in CRLF)
/// into `response` (head and body; emptied first, its capacity kept), answered with
/// 200: any other status is an error.
pub(crate) fn get_into(
    address: &str,
    path: &str,
    headers: &str,
    response: &mut Vec<u8>,
) -> anyhow::Result<()> {
    response.clear();
    let mut stream = TcpStream::connect(address)?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: poolscope\r\n{headers}\r\n").as_bytes())?;
    stream.read_to_end(response)?;
    let status = response.split(|&b| b == b'\n').next().unwrap_or_default();
    if !status.windows(5).any(|w| w == b" 200 ") {
        bail!(
            "{address} answered {:?}",
            String::from_utf8_lossy(status).trim_end()
        );
    }
    Ok(())
}

/// A response as text.
fn text(response: Vec<u8>) -> anyhow::Result<String> {
    String::from_utf8(response).context("a scrape not in UTF-8")
}

/// Waits up to 20 s until poolscope's /metrics on `address` shows every line of `ready`.
pub(crate) fn wait_for_metrics(address: &str, ready: &[String]) -> anyhow::Result<()> {
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

/// Waits up to 10 s until something listens on 127.0.0.1:`port`, and `server` (whose
/// name is `name`) still runs; an error points at its `log`.
pub(crate) fn wait_until_listening(
    server: &mut Guard,
    name: &str,
    port: u16,
    log: &Path,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            bail!(
                "nothing listens on port {port} after 10 s; see {}",
                log.display()
            );
        }
        sleep(Duration::from_millis(50));
    }
    if let Some(status) = server.0.try_wait()? {
        bail!("{name} exited ({status}); see {}", log.display());
    }
    Ok(())
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

fn min_median(values: &mut [f64]) -> (f64, f64) {
    values.sort_by(f64::total_cmp);
    let median = if values.is_empty() {
        f64::NAN
    } else {
        values[values.len() / 2]
    };
    (values.first().copied().unwrap_or(f64::NAN), median)
}

fn met(met: bool) -> &'static str {
    if met { "met" } else { "NOT met" }
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
        let command = match cpu {
            Some(cpu) => {
                let mut taskset = Command::new("taskset");
                taskset.args(["-c", &cpu.to_string()]).arg(binary);
                taskset
            }
            None => Command::new(binary),
        };
        Self::spawn(name, command, args)
    }

    /// Starts `name` in network namespace `netns` (`ip netns exec` execs it: its pid
    /// is the program's).
    fn start_in_netns(
        root: &Path,
        name: &'static str,
        netns: &str,
        args: &[String],
    ) -> anyhow::Result<Self> {
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", netns])
            .arg(root.join("target/release").join(name));
        Self::spawn(name, command, args)
    }

    fn spawn(name: &'static str, mut command: Command, args: &[String]) -> anyhow::Result<Self> {
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
