//! `cargo xtask bench`: what poolscope costs a real server. nginx (one worker, pinned
//! to CPU 0) serves a small static file to wrk (pinned to CPU 1) at saturation, in
//! interleaved rounds with poolscope off and on. Prints per-round numbers, the
//! min/median of each side, their ratios, and the kernel programs' ns per run.
//! `BENCH_ROUNDS` (default 3 pairs) and `BENCH_SECONDS` (default 5) tune it.
use std::{
    collections::BTreeMap,
    fs,
    io::{Read as _, Write as _},
    net::TcpStream,
    path::Path,
    process::{Child, Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

pub const PACKAGES: &[&str] = &["nginx", "wrk"];

const NGINX_PORT: u16 = 18080;
const POOLSCOPE_ADDRESS: &str = "127.0.0.1:19435";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Off,
    On,
    /// On, with kernel.bpf_stats_enabled so that per-program run time is counted.
    WithStats,
}

struct Round {
    poolscope: bool,
    requests_per_second: f64,
    requests: f64,
    cpu_us_per_request: f64,
    /// Cost of one syscall of a process poolscope does not watch (the hooks are
    /// system-wide): `dd bs=1` from /dev/zero to /dev/null, pinned to CPU 1.
    unwatched_syscall_ns: f64,
    /// program → (runs, ns) during the round
    programs: BTreeMap<String, (f64, f64)>,
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

pub fn run(root: &Path) -> anyhow::Result<()> {
    let pairs = env_number("BENCH_ROUNDS", 3).max(1);
    let seconds = env_number("BENCH_SECONDS", 5).max(1);
    let dir = root.join("target/bench");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(dir.join("www")).context("creating target/bench")?;
    fs::write(dir.join("www/index.html"), "x".repeat(612))?;
    fs::write(dir.join("nginx.conf"), nginx_config(&dir))?;
    fs::write(
        dir.join("poolscope.toml"),
        "[[targets]]\nservice = \"nginx\"\ncomm = \"^nginx$\"\n",
    )?;

    let nginx = Guard(
        Command::new("taskset")
            .args(["-c", "0", "nginx", "-p"])
            .arg(&dir)
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .stderr(Stdio::null())
            .spawn()
            .context("starting nginx")?,
    );
    wait_for_port(NGINX_PORT)?;
    // Warm up caches and the worker.
    wrk(seconds)?;

    let mut rounds = Vec::new();
    for pair in 0..pairs {
        // Alternate which side goes first so that drift hits both alike.
        let order = if pair % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for poolscope in order {
            let mode = if poolscope { Mode::On } else { Mode::Off };
            let round = measure(root, &dir, nginx.0.id(), mode, seconds)?;
            println!(
                "round {:>2} poolscope {:<3} {:>10.0} req/s {:>8.2} µs CPU/req",
                rounds.len() + 1,
                if poolscope { "on" } else { "off" },
                round.requests_per_second,
                round.cpu_us_per_request
            );
            rounds.push(round);
        }
    }
    // Per-program cost needs kernel.bpf_stats_enabled, which itself slows every run:
    // measured in one extra round, apart from the throughput rounds.
    let stats_round = measure(root, &dir, nginx.0.id(), Mode::WithStats, seconds)?;
    report(&rounds, &stats_round);
    Ok(())
}

fn nginx_config(dir: &Path) -> String {
    format!(
        "daemon off;\nmaster_process on;\nworker_processes 1;\npid {dir}/nginx.pid;\n\
         error_log {dir}/error.log warn;\nevents {{ worker_connections 1024; }}\n\
         http {{\n  access_log off;\n  sendfile on;\n  keepalive_requests 1000000;\n\
         server {{ listen 127.0.0.1:{NGINX_PORT}; root {dir}/www; }}\n}}\n",
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

/// (requests/s, total requests) from wrk's summary.
fn wrk(seconds: u64) -> anyhow::Result<(f64, f64)> {
    let output = Command::new("taskset")
        .args(["-c", "1", "wrk", "-t1", "-c32"])
        .arg(format!("-d{seconds}s"))
        .arg(format!("http://127.0.0.1:{NGINX_PORT}/index.html"))
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

/// CPU seconds (user + system) used so far by nginx's master and workers.
fn nginx_cpu_seconds(master: u32) -> f64 {
    // SAFETY: sysconf cannot fail for _SC_CLK_TCK.
    let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut ticks = 0u64;
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(stat) = fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some(after_comm) = stat.rfind(')').and_then(|i| stat.get(i + 2..)) else {
            continue;
        };
        let fields: Vec<&str> = after_comm.split_whitespace().collect();
        let pid: u32 = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let ppid: u32 = fields.get(1).and_then(|v| v.parse().ok()).unwrap_or(0);
        if pid == master || ppid == master {
            // utime and stime are fields 14 and 15, i.e. 11 and 12 after the comm.
            ticks += fields
                .get(11)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
            ticks += fields
                .get(12)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    ticks as f64 / ticks_per_second
}

fn measure(root: &Path, dir: &Path, nginx: u32, mode: Mode, seconds: u64) -> anyhow::Result<Round> {
    let exporter = if mode == Mode::Off {
        None
    } else {
        let child = Command::new(root.join("target/release/poolscope"))
            .arg("--config.file")
            .arg(dir.join("poolscope.toml"))
            .args([
                "--web.listen-address",
                POOLSCOPE_ADDRESS,
                "--log.level",
                "warn",
            ])
            .env(
                "POOLSCOPE_PROBES__BPF_STATS",
                (mode == Mode::WithStats).to_string(),
            )
            .spawn()
            .context("starting poolscope")?;
        let guard = Guard(child);
        wait_for_targets()?;
        Some(guard)
    };
    let before = exporter.as_ref().map(|_| program_stats()).transpose()?;
    let cpu_before = nginx_cpu_seconds(nginx);
    let (rate, total) = wrk(seconds)?;
    let cpu = nginx_cpu_seconds(nginx) - cpu_before;
    let mut programs = BTreeMap::new();
    if let Some(before) = before {
        for (name, (runs, ns)) in program_stats()? {
            let (runs_before, ns_before) = before.get(&name).copied().unwrap_or_default();
            programs.insert(name, (runs - runs_before, ns - ns_before));
        }
    }
    // After the program counters were read: dd's syscalls are not requests.
    let unwatched_syscall_ns = unwatched_syscall_ns()?;
    drop(exporter);
    Ok(Round {
        poolscope: mode != Mode::Off,
        requests_per_second: rate,
        requests: total,
        unwatched_syscall_ns,
        cpu_us_per_request: cpu * 1e6 / total.max(1.0),
        programs,
    })
}

fn scrape() -> anyhow::Result<String> {
    let mut stream = TcpStream::connect(POOLSCOPE_ADDRESS)?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: poolscope\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response)
}

/// Waits until poolscope serves and watches nginx.
fn wait_for_targets() -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if scrape().is_ok_and(|body| body.contains("poolscope_targets{service=\"nginx\"} 2")) {
            return Ok(());
        }
        sleep(Duration::from_millis(100));
    }
    bail!("poolscope did not watch nginx's two processes within 20 s")
}

/// program → (runs, run ns) from /metrics.
fn program_stats() -> anyhow::Result<BTreeMap<String, (f64, f64)>> {
    let body = scrape()?;
    let mut stats: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    for line in body.lines() {
        let parse = |prefix: &str| -> Option<(String, f64)> {
            let rest = line.strip_prefix(prefix)?;
            let (name, value) = rest.split_once("\"} ")?;
            Some((name.to_owned(), value.trim().parse().ok()?))
        };
        if let Some((name, runs)) = parse("poolscope_bpf_runs_total{program=\"") {
            stats.entry(name).or_default().0 = runs;
        } else if let Some((name, seconds)) = parse("poolscope_bpf_run_seconds_total{program=\"") {
            stats.entry(name).or_default().1 = seconds * 1e9;
        }
    }
    Ok(stats)
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

fn report(rounds: &[Round], stats_round: &Round) {
    let side = |on: bool, pick: fn(&Round) -> f64| -> (f64, f64) {
        let mut values: Vec<f64> = rounds
            .iter()
            .filter(|r| r.poolscope == on)
            .map(pick)
            .collect();
        min_median(&mut values)
    };
    let (rate_off_min, rate_off) = side(false, |r| r.requests_per_second);
    let (rate_on_min, rate_on) = side(true, |r| r.requests_per_second);
    let (cpu_off_min, cpu_off) = side(false, |r| r.cpu_us_per_request);
    let (cpu_on_min, cpu_on) = side(true, |r| r.cpu_us_per_request);
    let (sys_off_min, sys_off) = side(false, |r| r.unwatched_syscall_ns);
    let (sys_on_min, sys_on) = side(true, |r| r.unwatched_syscall_ns);
    println!();
    println!(
        "| nginx, 1 worker, wrk -t1 -c32 | off median (min) | on median (min) | on/off (median) |"
    );
    println!("|---|---|---|---|");
    println!(
        "| requests/s | {rate_off:.0} ({rate_off_min:.0}) | {rate_on:.0} ({rate_on_min:.0}) | {:.4} |",
        rate_on / rate_off
    );
    println!(
        "| nginx CPU µs/request | {cpu_off:.2} ({cpu_off_min:.2}) | {cpu_on:.2} ({cpu_on_min:.2}) | {:.4} |",
        cpu_on / cpu_off
    );
    println!(
        "| ns per syscall, unwatched process (dd bs=1) | {sys_off:.0} ({sys_off_min:.0}) | {sys_on:.0} ({sys_on_min:.0}) | {:.4} |",
        sys_on / sys_off
    );
    println!();
    println!(
        "Kernel programs, from one more round with kernel.bpf_stats_enabled=1 ({:.0} req/s):",
        stats_round.requests_per_second
    );
    println!();
    println!("| kernel program | runs/request | ns/run |");
    println!("|---|---|---|");
    for (name, (runs, ns)) in &stats_round.programs {
        if *runs > 0.0 {
            println!(
                "| {name} | {:.2} | {:.0} |",
                runs / stats_round.requests.max(1.0),
                ns / runs
            );
        }
    }
}
