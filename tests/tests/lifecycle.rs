//! The exporter's own lifecycle: refusing bad config at start, SIGHUP reloads (good
//! and bad, idle and under load), and a clean stop on SIGTERM.
use std::{process::Command, time::Duration};

use poolscope_tests::{
    Metrics, PoolServer, Poolscope, TestServer, bin_dir,
    load::{ClosedLoop, Connections},
    one_at_a_time, pids_config, privileged, requests_settled, scrape_until, wait_until,
};

/// Needs no privileges: the config is checked before anything is loaded.
#[test]
fn bad_config_is_refused_with_file_key_and_reason() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "[web]\nlisten_address = \"not an address\"\n")?;
    let output = Command::new(bin_dir()?.join("poolscope"))
        .arg("--config.file")
        .arg(&path)
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "accepted a bad config");
    assert!(stderr.contains("bad.toml"), "{stderr}");
    assert!(stderr.contains("web.listen_address"), "{stderr}");
    assert!(stderr.contains("invalid socket address"), "{stderr}");

    let output = Command::new(bin_dir()?.join("poolscope"))
        .env("POOLSCOPE_LIMITS__MAX_SERIES", "0")
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("limits.max_series") && stderr.contains("POOLSCOPE_"),
        "{stderr}"
    );
    Ok(())
}

/// Only `POOLSCOPE_<SECTION>__<KEY>` variables are configuration: Kubernetes sets
/// `POOLSCOPE_SERVICE_HOST` and the like for a Service named poolscope.
#[test]
fn environment_configures_sections_and_ignores_other_variables() -> anyhow::Result<()> {
    let check = |vars: &[(&str, &str)]| -> anyhow::Result<(bool, String)> {
        let output = Command::new(bin_dir()?.join("poolscope"))
            .arg("--config.check")
            .envs(vars.iter().copied())
            .output()?;
        Ok((
            output.status.success(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        ))
    };
    let (ok, stderr) = check(&[
        ("POOLSCOPE_SERVICE_HOST", "10.0.0.1"),
        ("POOLSCOPE_PORT", "tcp://10.0.0.1:9435"),
    ])?;
    assert!(ok, "unrelated variables refused: {stderr}");
    let (ok, stderr) = check(&[("POOLSCOPE_WEB__LISTEN_ADDRESS", "nowhere")])?;
    assert!(!ok && stderr.contains("web.listen_address"), "{stderr}");
    let (ok, stderr) = check(&[("POOLSCOPE_WEB__LISTEN_ADRESS", "127.0.0.1:1")])?;
    assert!(
        !ok && stderr.contains("listen_adress"),
        "a typo inside a section must be refused: {stderr}"
    );
    Ok(())
}

#[test]
fn sighup_reloads_and_a_bad_reload_keeps_the_running_config() -> anyhow::Result<()> {
    if !privileged("sighup_reloads_and_a_bad_reload_keeps_the_running_config") {
        return Ok(());
    }
    let server = TestServer::start(8)?;
    let mut poolscope = Poolscope::start(&pids_config("before", &[server.pid()]))?;
    let has = |poolscope: &Poolscope, service: &str| {
        poolscope
            .scrape()
            .is_ok_and(|m| m.has_label("service", service))
    };
    assert!(wait_until(Duration::from_secs(10), || has(
        &poolscope, "before"
    )));

    std::fs::write(
        &poolscope.config_path,
        pids_config("after", &[server.pid()]),
    )?;
    poolscope.signal(libc::SIGHUP);
    assert!(wait_until(Duration::from_secs(10), || has(
        &poolscope, "after"
    ) && !has(
        &poolscope, "before"
    )));

    std::fs::write(&poolscope.config_path, "[[targets]]\ncomm = \"(\"\n")?;
    poolscope.signal(libc::SIGHUP);
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        has(&poolscope, "after"),
        "a bad reload changed the running config"
    );

    poolscope.signal(libc::SIGTERM);
    let (code, log) = poolscope.wait_exit(Duration::from_secs(10))?;
    assert!(log.contains("reload refused"), "{log}");
    assert!(log.contains("targets[0].comm"), "{log}");
    assert_eq!(code, Some(0), "{log}");
    assert!(log.contains("probes detached"), "{log}");
    Ok(())
}

/// Twenty reloads while a saturated pool serves: the service keeps its counters and
/// every request is counted; a refused reload under load shows in
/// `config_last_reload_successful` until a good one.
#[test]
fn reloads_under_load_lose_no_request_and_a_refused_one_is_exported() -> anyhow::Result<()> {
    if !privileged("reloads_under_load_lose_no_request_and_a_refused_one_is_exported") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let server = PoolServer::start(4, Duration::from_millis(2))?;
    let service = "reloaded";
    // A reloadable key changes each time, so that every reload replaces the settings.
    let target = pids_config(service, &[server.pid()]);
    let config =
        |degraded_for: u32| format!("[limits]\ndegraded_for = \"{degraded_for}s\"\n{target}");
    let mut poolscope = Poolscope::start(&config(300))?;
    let started = scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", service)]) == Some(1.0)
    })?;
    let reload_ok = |m: &Metrics| m.value("poolscope_config_last_reload_successful", &[]);
    let loaded_at = |m: &Metrics| {
        m.value(
            "poolscope_config_last_reload_success_timestamp_seconds",
            &[],
        )
    };
    assert_eq!(reload_ok(&started), Some(1.0));
    let loaded_at_start = loaded_at(&started).unwrap_or(0.0);
    assert!(loaded_at_start > 1.7e9, "{loaded_at_start}");

    // 8 clients on 4 workers: a queue all along.
    let clients = ClosedLoop::start(server.port, 8, Connections::KeepAlive);
    const RELOADS: u32 = 20;
    for round in 1..=RELOADS {
        std::fs::write(&poolscope.config_path, config(300 + round))?;
        poolscope.signal(libc::SIGHUP);
        std::thread::sleep(Duration::from_millis(200));
        let during = poolscope.scrape()?;
        assert_eq!(
            during.value("poolscope_targets", &[("service", service)]),
            Some(1.0),
            "reload {round} lost the service"
        );
    }
    std::fs::write(&poolscope.config_path, "[limits]\ndegraded_for = \"0s\"\n")?;
    poolscope.signal(libc::SIGHUP);
    let refused = scrape_until(&poolscope, |m| reload_ok(m) == Some(0.0))?;
    let made = clients.stop()?.completed;
    let after = scrape_until(&poolscope, |m| requests_settled(m, service, made))?;
    let counted = after
        .value("poolscope_requests_total", &[("service", service)])
        .unwrap_or(0.0);
    let served = server.finish()?;
    eprintln!(
        "{RELOADS} reloads and a refused one under load: counted {counted}, made {made}, \
         served {}",
        served.count
    );
    assert_eq!((counted, made), (served.count as f64, served.count));
    assert_eq!(after.value("poolscope_degraded", &[]), Some(0.0));
    // The refused reload keeps the last good load's time.
    let loaded_last = loaded_at(&refused).unwrap_or(0.0);
    assert!(
        loaded_last > loaded_at_start,
        "{loaded_last} {loaded_at_start}"
    );

    std::fs::write(&poolscope.config_path, config(60))?;
    poolscope.signal(libc::SIGHUP);
    let good_again = scrape_until(&poolscope, |m| reload_ok(m) == Some(1.0))?;
    assert!(loaded_at(&good_again).unwrap_or(0.0) > loaded_last);
    let log = poolscope.stop_and_log();
    assert_eq!(
        log.matches("configuration reloaded").count(),
        RELOADS as usize + 1,
        "{log}"
    );
    assert!(log.contains("limits.degraded_for"), "{log}");
    Ok(())
}
