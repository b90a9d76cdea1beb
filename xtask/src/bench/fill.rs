//! What reading how full the maps are costs a scrape as they fill (`BENCH_ONLY=fill`):
//! nginx, watched with the syscall backend, holds 0, 1,000 and 100,000 idle
//! connections (each one entry in `CONNS`, adopted when poolscope starts after them).
//! A process may hold at most `ulimit -n` descriptors, and without CAP_SYS_RESOURCE
//! (containers) that is often 20,000: the connections are opened by holder processes
//! of at most [`PER_PROCESS`] each, and nginx runs [`WORKERS`] workers, the kernel
//! spreading connections over them (`reuseport`). At each size poolscope is started and scraped back
//! to back: printed are the entries it reports, the scrape time p50 and p99 and the
//! p50 of its `kernel` collector. `BENCH_COMPARE=<path>` measures another poolscope
//! binary (an older commit's, which walked each map's keys at every scrape) at each
//! size too, side by side.
use std::{
    fs,
    io::{BufRead as _, BufReader},
    net::Ipv4Addr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::{Guard, free_port, nginx::start_nginx, scrape, spawn_poolscope_binary};

/// Idle connections held at each step.
const SIZES: [usize; 3] = [0, 1_000, 100_000];
/// Scrapes per size and binary, back to back.
const SCRAPES: usize = 50;
/// Connections a holder process opens, at most (below a 20,000 `ulimit -n`).
const PER_PROCESS: usize = 17_000;
/// nginx's workers: with [`PER_PROCESS`] each, room for the largest size and more.
const WORKERS: usize = 8;
/// A holder: opens `count` connections to `port`, spread over the addresses, says
/// `open` and keeps them until its stdin closes.
const HOLDER: &str = "import socket, sys
count, port, addresses = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(',')
held = [socket.create_connection((addresses[i % len(addresses)], port)) for i in range(count)]
print('open', flush=True)
sys.stdin.read()
";
/// nginx listens on each, and the connections are spread over them: each offers the
/// ~28,000 ephemeral ports of the default range.
const ADDRESSES: [Ipv4Addr; 4] = [
    Ipv4Addr::new(127, 0, 0, 1),
    Ipv4Addr::new(127, 0, 0, 2),
    Ipv4Addr::new(127, 0, 0, 3),
    Ipv4Addr::new(127, 0, 0, 4),
];

/// One binary at one size, measured.
struct Measured {
    binary: &'static str,
    connections: usize,
    entries: f64,
    p50_ms: f64,
    p99_ms: f64,
    kernel_p50_ms: f64,
}

pub(super) fn run_fill(
    root: &Path,
    dir: PathBuf,
    _rounds: usize,
    _seconds: u64,
) -> anyhow::Result<()> {
    let largest = SIZES.iter().copied().max().unwrap_or(0);
    let dir = dir.join("fill");
    fs::create_dir_all(dir.join("www")).context("creating target/bench/fill")?;
    let port = free_port()?;
    let _nginx = start_nginx(&dir, &nginx_config(&dir, port), port)?;
    let config = dir.join("poolscope.toml");
    fs::write(
        &config,
        format!(
            "[probes]\nbackend = \"syscall\"\n[limits]\nconnections = {}\n\
             [[targets]]\nservice = \"nginx\"\ncomm = \"^nginx$\"\n",
            (largest + largest / 4).max(65_536)
        ),
    )?;
    let mut binaries = vec![("this", root.join("target/release/poolscope"))];
    if let Some(other) = std::env::var_os("BENCH_COMPARE") {
        binaries.push(("compared", PathBuf::from(other)));
    }
    println!(
        "fill: nginx (syscall backend) holding idle connections, each an entry in CONNS; \
         {SCRAPES} scrapes back to back per size and binary"
    );
    let mut holders = Vec::new();
    let mut open = 0;
    let mut results = Vec::new();
    for size in SIZES {
        let opened = Instant::now();
        while open < size {
            let count = (size - open).min(PER_PROCESS);
            holders.push(hold(count, port)?);
            open += count;
        }
        println!(
            "{size} connections open ({:.1} s)",
            opened.elapsed().as_secs_f64()
        );
        for (binary, path) in &binaries {
            results.push(measure(binary, path, &config, size)?);
        }
    }
    println!(
        "{:>9} {:>11} {:>9} {:>8} {:>8} {:>14}",
        "binary", "connections", "CONNS", "p50 ms", "p99 ms", "kernel p50 ms"
    );
    for m in &results {
        println!(
            "{:>9} {:>11} {:>9} {:>8.2} {:>8.2} {:>14.3}",
            m.binary, m.connections, m.entries, m.p50_ms, m.p99_ms, m.kernel_p50_ms
        );
    }
    Ok(())
}

/// Starts `path` and scrapes it [`SCRAPES`] times once it reports the `connections`
/// adopted.
fn measure(
    binary: &'static str,
    path: &Path,
    config: &Path,
    connections: usize,
) -> anyhow::Result<Measured> {
    let address = format!("127.0.0.1:{}", free_port()?);
    let _poolscope = spawn_poolscope_binary(path, config, &address, &[])?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let entries = loop {
        let entries = scrape(&address)
            .ok()
            .and_then(|body| sample(&body, "poolscope_map_entries{map=\"CONNS\"}"));
        if let Some(entries) = entries
            && entries >= connections as f64
        {
            break entries;
        }
        if Instant::now() > deadline {
            bail!("{binary}: CONNS did not reach {connections} entries within 120 s ({entries:?})");
        }
        sleep(Duration::from_millis(200));
    };
    let mut times_ms = Vec::with_capacity(SCRAPES);
    let mut kernel_ms = Vec::with_capacity(SCRAPES);
    for _ in 0..SCRAPES {
        let started = Instant::now();
        let body = scrape(&address)?;
        times_ms.push(started.elapsed().as_secs_f64() * 1e3);
        let kernel = sample(
            &body,
            "poolscope_scrape_duration_seconds{collector=\"kernel\"}",
        );
        kernel_ms.push(kernel.unwrap_or(f64::NAN) * 1e3);
    }
    times_ms.sort_by(f64::total_cmp);
    kernel_ms.sort_by(f64::total_cmp);
    Ok(Measured {
        binary,
        connections,
        entries,
        p50_ms: times_ms[SCRAPES / 2],
        p99_ms: times_ms[SCRAPES * 99 / 100],
        kernel_p50_ms: kernel_ms[SCRAPES / 2],
    })
}

/// The value of the sample written exactly `series` in a scrape.
fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}

/// A holder process with `count` connections open to `port` (until it drops).
fn hold(count: usize, port: u16) -> anyhow::Result<Guard> {
    let addresses: Vec<String> = ADDRESSES.iter().map(ToString::to_string).collect();
    let mut child = Command::new("python3")
        .args(["-c", HOLDER, &count.to_string(), &port.to_string()])
        .arg(addresses.join(","))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting a connection holder (python3)")?;
    let output = child.stdout.take();
    let holder = Guard(child);
    let mut line = String::new();
    if let Some(output) = output {
        BufReader::new(output).read_line(&mut line)?;
    }
    if line.trim() != "open" {
        bail!("a holder of {count} connections failed (said {line:?})");
    }
    Ok(holder)
}

/// nginx whose workers keep idle connections open (no request, for as long as the
/// bench runs), listening on each of [`ADDRESSES`].
fn nginx_config(dir: &Path, port: u16) -> String {
    let listens: String = ADDRESSES
        .iter()
        .map(|address| format!("    listen {address}:{port} reuseport backlog=4096;\n"))
        .collect();
    format!(
        "daemon off;\nmaster_process on;\nworker_processes {WORKERS};\npid {dir}/nginx.pid;\n\
         error_log {dir}/error.log warn;\nworker_rlimit_nofile {files};\n\
         events {{ worker_connections {files}; multi_accept on; }}\n\
         http {{\n  access_log off;\n  client_header_timeout 1h;\n  keepalive_timeout 1h;\n\
           server {{\n{listens}    root {dir}/www;\n  }}\n}}\n",
        dir = dir.display(),
        files = PER_PROCESS + 1024,
    )
}
