//! TEMPORARY: manual check of tests/src/servers.rs; delete before handing back.
use std::time::{Duration, Instant};

use poolscope_tests::servers::{Kind, RealServer, wrk};

fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

fn state(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(
        stat[stat.rfind(')').unwrap() + 2..]
            .split(' ')
            .next()
            .unwrap()
            .to_owned(),
    )
}

#[test]
fn check_all() {
    let only = std::env::var("KINDS").unwrap_or_default();
    for (i, kind) in Kind::ALL.iter().enumerate() {
        if !only.is_empty() && !only.split(',').any(|k| k == kind.name()) {
            continue;
        }
        let port = 28080 + i as u16;
        let t = Instant::now();
        let server = RealServer::start(*kind, port).unwrap_or_else(|e| panic!("{e:#}"));
        let startup = t.elapsed();
        let pids = server.pids();
        let comms: Vec<String> = pids.iter().map(|p| format!("{p}:{}", comm(*p))).collect();
        let r = wrk(port, 1, 8, Duration::from_secs(3)).unwrap();
        println!(
            "RESULT {} startup={:.2}s pids={:?} comm={:?} req/s={:.0} p50={:?} p99={:?} requests={} secs={} sockerr={} non2xx={}",
            kind.name(),
            startup.as_secs_f64(),
            pids,
            comms,
            r.requests_per_second(),
            r.p50,
            r.p99,
            r.requests,
            r.seconds,
            r.socket_errors,
            r.non_2xx
        );
        let pids_after = server.pids();
        let t = Instant::now();
        drop(server);
        let left: Vec<(u32, Option<String>)> = pids_after
            .iter()
            .map(|p| (*p, state(*p)))
            .filter(|(_, s)| s.is_some())
            .collect();
        println!(
            "STOP {} took={:.2}s pids_after_load={:?} left={:?}",
            kind.name(),
            t.elapsed().as_secs_f64(),
            pids_after,
            left
        );
        assert!(left.is_empty());
    }
}

#[test]
fn capture_raw() {
    let Ok(kind) = std::env::var("RAW") else {
        return;
    };
    let kind = *Kind::ALL.iter().find(|k| k.name() == kind).unwrap();
    let server = RealServer::start(kind, 28090).unwrap();
    let out = std::process::Command::new("wrk")
        .args([
            "--latency",
            "-t1",
            "-c8",
            "-d3s",
            &format!(
                "http://127.0.0.1:28090{}",
                std::env::var("RAWPATH").unwrap_or("/".into())
            ),
            "--timeout",
            &std::env::var("RAWTO").unwrap_or("2s".into()),
        ])
        .output()
        .unwrap();
    println!("RAW-BEGIN\n{}RAW-END", String::from_utf8_lossy(&out.stdout));
    drop(server);
}
