//! The request benchmark: nginx and wrk, poolscope off and with each request backend;
//! poolscope's counters from /metrics; the report beside the goals is in `report`.
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

mod report;

use super::bpf::{BpfStats, EmptyProgram};
use super::{
    Disturbance, Guard, Measured, Process, cpu_used, free_port, measure_alone, processes, rotated,
    scrape, spawn_poolscope, wait_for_quiet, wait_until_listening,
};

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Off,
    Socket,
    Tcp,
    Syscall,
}

impl Mode {
    const ALL: [Self; 4] = [Self::Off, Self::Socket, Self::Tcp, Self::Syscall];
    const BACKENDS: [Self; 3] = [Self::Socket, Self::Tcp, Self::Syscall];

    /// Also the value of poolscope's `[probes] backend`.
    fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Socket => "socket",
            Self::Tcp => "tcp",
            Self::Syscall => "syscall",
        }
    }

    /// The backend's programs that follow requests: their run time is the cost of a
    /// request (the process programs run on fork, exec and exit only).
    fn request_programs(self) -> &'static [&'static str] {
        match self {
            Self::Off => &[],
            Self::Socket => &["sock_state", "sock_data_ready", "sock_recv", "sock_send"],
            Self::Tcp => &[
                "sock_state",
                "tcp_segment_received",
                "tcp_read",
                "tcp_transmit",
            ],
            Self::Syscall => &["sys_enter", "sys_exit"],
        }
    }
}

/// poolscope's counters, from /metrics.
#[derive(Default)]
pub(super) struct Counters {
    /// `poolscope_requests_total` of nginx.
    pub(super) requests: f64,
    /// `poolscope_connections_accepted_total` of nginx.
    connections: f64,
    /// program → (runs, run ns)
    pub(super) programs: BTreeMap<String, (f64, f64)>,
}

impl Counters {
    pub(super) fn parse(body: &str) -> Self {
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
    pub(super) fn since(&self, before: &Self) -> Self {
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

pub(super) struct Round {
    mode: Mode,
    pub(super) requests_per_second: f64,
    /// Requests wrk finished.
    requests: f64,
    /// nginx's CPU time (user + system, which includes the kernel programs).
    pub(super) cpu_us_per_request: f64,
    /// poolscope's own (user space) CPU time.
    pub(super) poolscope_cpu_us_per_request: f64,
    /// Cost of one syscall of a process poolscope does not watch (the hooks are
    /// system-wide): `dd bs=1` from /dev/zero to /dev/null, pinned to CPU 1.
    unwatched_syscall_ns: f64,
    /// What poolscope counted during the round (nothing when off).
    counted: Counters,
    /// What else ran during the round.
    pub(super) disturbance: Disturbance,
}

impl Measured for Round {
    fn disturbance(&self) -> &Disturbance {
        &self.disturbance
    }
}

/// The request benchmark: nginx and wrk.
pub(super) fn run_nginx(
    root: &Path,
    dir: PathBuf,
    rounds: usize,
    seconds: u64,
) -> anyhow::Result<()> {
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
    report::report(&measured, &stats_rounds, &calibration);
    Ok(())
}

/// The hooks of the request programs, as raw tracepoints: an empty program on each
/// gives what a run costs before the program does anything (the dispatch, and
/// bpf_stats' own clock reads).
const REQUEST_HOOKS: [(&str, &str); 8] = [
    ("sock_data_ready", "sk_data_ready"),
    ("sock_recv", "sock_recv_length"),
    ("sock_send", "sock_send_length"),
    ("tcp_segment_received", "tcp_probe"),
    ("tcp_read", "tcp_rcv_space_adjust"),
    ("tcp_transmit", "net_dev_queue"),
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
    pub(super) fn start(
        root: &'a Path,
        dir: PathBuf,
        seconds: u64,
    ) -> anyhow::Result<(Guard, Self)> {
        let nginx_port = free_port()?;
        fs::create_dir_all(dir.join("www")).context("creating target/bench/www")?;
        fs::write(dir.join("www/index.html"), "x".repeat(612))?;
        fs::write(
            dir.join("poolscope.toml"),
            "[[targets]]\nservice = \"nginx\"\ncomm = \"^nginx$\"\n",
        )?;
        let nginx = start_nginx(&dir, &nginx_config(&dir, nginx_port), nginx_port)?;
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

/// Starts nginx on CPU 0 with `config` (written to `dir`/nginx.conf), until the guard
/// drops; returns once it listens on `port`.
pub(super) fn start_nginx(dir: &Path, config: &str, port: u16) -> anyhow::Result<Guard> {
    fs::write(dir.join("nginx.conf"), config)?;
    let mut nginx = Guard(
        Command::new("taskset")
            .args(["-c", "0", "nginx", "-p"])
            .arg(dir)
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .stderr(Stdio::null())
            .spawn()
            .context("starting nginx")?,
    );
    wait_until_listening(&mut nginx, "nginx", port, &dir.join("error.log"))?;
    Ok(nginx)
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

/// What every round shares.
pub(super) struct Bench<'a> {
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

    pub(super) fn wait_for_quiet(&self) -> bool {
        wait_for_quiet(|pid, p| self.is_nginx(pid, p))
    }

    pub(super) fn measure(&self, mode: Mode, env: &[(&str, &str)]) -> anyhow::Result<Round> {
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
