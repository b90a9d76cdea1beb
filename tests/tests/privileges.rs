//! Least privilege: poolscope runs as an unprivileged user with only the capabilities
//! that systemd/poolscope.service grants, and still measures the truth.
use std::time::Duration;

use poolscope_tests::{Poolscope, TestServer, privileged, wait_until};

/// `+bpf,+perfmon,...` from the unit's AmbientCapabilities line.
fn unit_capabilities() -> anyhow::Result<String> {
    let unit = include_str!("../../systemd/poolscope.service");
    let line = unit
        .lines()
        .find_map(|line| line.strip_prefix("AmbientCapabilities="))
        .ok_or_else(|| anyhow::anyhow!("no AmbientCapabilities in the unit"))?;
    let caps: Vec<String> = line
        .split_whitespace()
        .map(|cap| format!("+{}", cap.trim_start_matches("CAP_").to_lowercase()))
        .collect();
    Ok(caps.join(","))
}

fn uid_of(pid: u32) -> anyhow::Result<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|uid| uid.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no effective uid for {pid}"))
}

#[test]
fn runs_as_nobody_with_the_units_capabilities() -> anyhow::Result<()> {
    if !privileged("runs_as_nobody_with_the_units_capabilities") {
        return Ok(());
    }
    let caps = unit_capabilities()?;
    let wrapper = [
        "setpriv".to_owned(),
        "--reuid=nobody".to_owned(),
        "--regid=nogroup".to_owned(),
        "--clear-groups".to_owned(),
        format!("--inh-caps=-all,{caps}"),
        format!("--ambient-caps=-all,{caps}"),
        format!("--bounding-set=-all,{caps}"),
    ];
    let server = TestServer::start(16)?;
    let _clients = [server.connect()?, server.connect()?];
    // Auto-discovery: reading a root-owned process's fds needs CAP_SYS_PTRACE.
    let poolscope =
        Poolscope::start_wrapped("[discovery]\nrescan_interval = \"500ms\"\n", &wrapper)?;
    assert_ne!(uid_of(poolscope.pid())?, 0, "poolscope runs as root");
    let listener = format!("127.0.0.1:{}", server.port);
    let labels = [("service", "testserver"), ("listener", listener.as_str())];
    let seen = wait_until(Duration::from_secs(10), || {
        poolscope
            .scrape()
            .is_ok_and(|m| m.value("poolscope_listen_queue_depth", &labels) == Some(2.0))
    });
    assert!(seen, "{}", poolscope.scrape()?.text);
    Ok(())
}
