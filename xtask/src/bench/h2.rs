//! The HTTP/2 benchmark (`BENCH_ONLY=h2`): nginx serving cleartext HTTP/2 (one worker,
//! pinned to CPU 0) to h2load (4 connections of 10 streams each, pinned to CPU 1) at
//! saturation, in rounds interleaved between poolscope off and on (socket backend, the
//! one that follows streams). Prints each round, the min/median of throughput per mode
//! and its ratio to off; then one round with kernel.bpf_stats_enabled for the kernel
//! time of the request programs per stream poolscope counted (checked against
//! h2load's), where the frames are walked.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Duration,
};

use anyhow::{Context as _, bail};

use super::{
    Guard, free_port, min_median,
    nginx::{Counters, start_nginx},
    rotated, scrape, spawn_poolscope, wait_for_metrics,
};

const CONNECTIONS: &str = "4";
const STREAMS: &str = "10";
/// The socket backend's request programs: their run time is a stream's cost.
const REQUEST_PROGRAMS: [&str; 4] = ["sock_state", "sock_data_ready", "sock_recv", "sock_send"];

/// One load: h2load's rate and count, and what poolscope counted meanwhile.
struct Load {
    streams_per_second: f64,
    streams: f64,
    counted: Option<Counters>,
}

pub(super) fn run_h2(root: &Path, dir: PathBuf, rounds: usize, seconds: u64) -> anyhow::Result<()> {
    let port = free_port()?;
    fs::create_dir_all(dir.join("www")).context("creating target/bench/www")?;
    fs::write(dir.join("www/index.html"), "x".repeat(612))?;
    fs::write(
        dir.join("poolscope.toml"),
        "[probes]\nbackend = \"socket\"\n[[targets]]\nservice = \"nginx\"\ncomm = \"^nginx$\"\n",
    )?;
    let _nginx = start_nginx(&dir, &nginx_h2c_config(&dir, port), port)?;
    let address = format!("127.0.0.1:{}", free_port()?);
    let load = |poolscope: bool, env: &[(&str, &str)]| -> anyhow::Result<Load> {
        let exporter = poolscope
            .then(|| -> anyhow::Result<Guard> {
                let guard = spawn_poolscope(root, &dir.join("poolscope.toml"), &address, env)?;
                wait_for_metrics(&address, &["poolscope_targets{service=\"nginx\"} 2".into()])?;
                Ok(guard)
            })
            .transpose()?;
        let before = exporter.as_ref().map(|_| counters(&address)).transpose()?;
        let (streams_per_second, streams) = h2load(port, seconds)?;
        // The last streams end at their close; nginx closes when h2load goes.
        std::thread::sleep(Duration::from_millis(200));
        let counted = match before {
            Some(before) => Some(counters(&address)?.since(&before)),
            None => None,
        };
        Ok(Load {
            streams_per_second,
            streams,
            counted,
        })
    };
    load(false, &[])?; // warm-up
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for poolscope in rotated(&[false, true], round) {
            let result = load(poolscope, &[])?;
            let mode = if poolscope { "socket" } else { "off" };
            println!(
                "h2 round {:>2} {mode:<7} {:>10.0} streams/s",
                round + 1,
                result.streams_per_second
            );
            if poolscope {
                on.push(result.streams_per_second);
            } else {
                off.push(result.streams_per_second);
            }
        }
    }
    let stats = load(true, &[("POOLSCOPE_PROBES__BPF_STATS", "true")])?;
    let Some(counted) = stats.counted else {
        bail!("the stats round had no poolscope");
    };
    let ns: f64 = REQUEST_PROGRAMS
        .iter()
        .filter_map(|program| counted.programs.get(*program))
        .map(|(_, ns)| ns)
        .sum();
    let (off_min, off_median) = min_median(&mut off);
    let (on_min, on_median) = min_median(&mut on);
    println!(
        "\nnginx h2c under h2load -c {CONNECTIONS} -m {STREAMS}, min/median of {rounds} rounds:"
    );
    println!("  off      {off_min:>10.0} / {off_median:>10.0} streams/s");
    println!(
        "  socket   {on_min:>10.0} / {on_median:>10.0} streams/s   ratio to off {:.3} (median)",
        on_median / off_median
    );
    println!(
        "  request programs' kernel time: {:.0} ns per stream ({} streams counted, {} \
         finished by h2load, which stops with up to 40 open; with kernel.bpf_stats_enabled)",
        ns / counted.requests,
        counted.requests,
        stats.streams
    );
    // h2load stops at its duration with up to connections × streams open; the server
    // may finish those (poolscope counts them) after h2load stopped counting.
    let open_at_stop: f64 = CONNECTIONS.parse::<f64>()? * STREAMS.parse::<f64>()?;
    if (counted.requests - stats.streams).abs() > open_at_stop {
        bail!(
            "poolscope counted {} streams, h2load finished {} (more apart than the {} \
             h2load may leave open)",
            counted.requests,
            stats.streams,
            open_at_stop
        );
    }
    Ok(())
}

fn counters(address: &str) -> anyhow::Result<Counters> {
    Ok(Counters::parse(&scrape(address)?))
}

fn nginx_h2c_config(dir: &Path, port: u16) -> String {
    format!(
        "daemon off;\nmaster_process on;\nworker_processes 1;\npid {dir}/nginx.pid;\n\
         error_log {dir}/error.log warn;\nevents {{ worker_connections 1024; }}\n\
         http {{\n  access_log off;\n  keepalive_requests 1000000;\n\
         server {{ listen 127.0.0.1:{port} http2; root {dir}/www; }}\n}}\n",
        dir = dir.display()
    )
}

/// h2load for `seconds` on CPU 1: (streams/s, streams finished).
fn h2load(port: u16, seconds: u64) -> anyhow::Result<(f64, f64)> {
    let output = Command::new("taskset")
        .args(["-c", "1", "h2load", "-c", CONNECTIONS, "-m", STREAMS, "-D"])
        .arg(seconds.to_string())
        .arg(format!("http://127.0.0.1:{port}/"))
        .output()
        .context("running h2load (Debian package nghttp2-client)")?;
    let text = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!("h2load failed: {text}");
    }
    // "finished in 5.00s, 61234.20 req/s, ..." and "requests: N total, N started, N done,
    // N succeeded, ..."
    let rate = text
        .lines()
        .find_map(|line| line.strip_prefix("finished in "))
        .and_then(|line| line.split(", ").nth(1))
        .and_then(|rate| rate.strip_suffix(" req/s"))
        .and_then(|rate| rate.parse().ok());
    let succeeded = text
        .lines()
        .find_map(|line| line.strip_prefix("requests: "))
        .and_then(|line| line.split(", ").find(|part| part.ends_with(" succeeded")))
        .and_then(|part| part.trim_end_matches(" succeeded").parse().ok());
    match (rate, succeeded) {
        (Some(rate), Some(succeeded)) => Ok((rate, succeeded)),
        _ => bail!("cannot read h2load's summary: {text}"),
    }
}
