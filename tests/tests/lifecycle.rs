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
