//! The exporter's own lifecycle: refusing bad config at start, SIGHUP reloads (good
//! and bad), and a clean stop on SIGTERM.
use std::{process::Command, time::Duration};

use poolscope_tests::{Poolscope, TestServer, bin_dir, pids_config, privileged, wait_until};

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
