//! Lock waits: what measuring them costs (lockserver's throughput, mutexloop's
//! uncontended pairs), futex waits only or with the pthread_mutex_lock uprobes.
use std::{
    collections::BTreeMap,
    fs,
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

mod report;

use super::bpf::BpfStats;
use super::nginx::Counters;
use super::sched::SCHED_PROGRAMS;
use super::{
    Disturbance, Guard, LineProgram, Measured, Process, build_test_programs, env_number, free_port,
    measure_alone, min_median, processes, rotated, scrape, spawn_poolscope, wait_for_metrics,
    wait_for_quiet,
};
use report::locks_report;

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
pub(super) fn run_locks(
    root: &Path,
    dir: PathBuf,
    rounds: usize,
    seconds: u64,
) -> anyhow::Result<()> {
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

/// `value` with `decimals`, or `-` when there is none (NaN: poolscope was off).
fn or_dash(value: f64, decimals: usize) -> String {
    if value.is_nan() {
        "-".to_owned()
    } else {
        format!("{value:.decimals$}")
    }
}
