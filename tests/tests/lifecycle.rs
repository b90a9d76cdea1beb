//! The exporter's own lifecycle: refusing bad config at start, SIGHUP reloads (good
//! and bad, idle and under load), a clean stop on SIGTERM, and its own `process_*`
//! numbers against what the kernel says of its process.
use std::{process::Command, time::Duration};

use anyhow::Context as _;

use poolscope_tests::{
    Metrics, PoolServer, Poolscope, TestServer, bin_dir,
    load::{ClosedLoop, Connections},
    one_at_a_time, pids_config, privileged,
    profiles::http_get,
    requests_settled, rss_kb, scrape_until, wait_until,
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
    // The reload is over once its refusal is exported (the one before succeeded).
    scrape_until(&poolscope, |m| {
        m.value("poolscope_config_last_reload_successful", &[]) == Some(0.0)
    })
    .context("waiting for the bad reload's refusal: config_last_reload_successful 0")?;
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
    let mut loaded_before = loaded_at_start;

    // 8 clients on 4 workers: a queue all along.
    let clients = ClosedLoop::start(server.port, 8, Connections::KeepAlive);
    const RELOADS: u32 = 20;
    for round in 1..=RELOADS {
        std::fs::write(&poolscope.config_path, config(300 + round))?;
        poolscope.signal(libc::SIGHUP);
        // Each reload replaces the settings, with a newer load time: wait for it.
        let during = scrape_until(&poolscope, |m| loaded_at(m) > Some(loaded_before))
            .with_context(|| {
                format!(
                    "waiting for reload {round}: a load time after {loaded_before} in \
                     config_last_reload_success_timestamp_seconds"
                )
            })?;
        loaded_before = loaded_at(&during).unwrap_or(loaded_before);
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

/// What the kernel says of a process: (CPU seconds, start time in Unix seconds)
/// from `/proc/<pid>/stat` and `/proc/stat`, and its open descriptors.
fn kernel_view(pid: u32) -> anyhow::Result<(f64, f64, usize)> {
    // SAFETY: sysconf(3) has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let fields: Vec<f64> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .unwrap_or_default()
        .split_whitespace()
        .map(|field| field.parse().unwrap_or(f64::NAN))
        .collect();
    // utime, stime and starttime: fields 14, 15 and 22 of proc(5), 3 before.
    let field = |n: usize| fields.get(n - 3).copied().unwrap_or(f64::NAN);
    let boot: f64 = std::fs::read_to_string("/proc/stat")?
        .lines()
        .find_map(|line| line.strip_prefix("btime "))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or(f64::NAN);
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count();
    Ok((
        (field(14) + field(15)) / ticks,
        boot + field(22) / ticks,
        fds,
    ))
}

/// poolscope's `process_*` families are its own process as the kernel sees it: CPU
/// time between the kernel's before and after the scrape, resident memory between
/// `VmRSS` before and after, descriptors within the scrape's own few, the start
/// time to the clock tick.
#[test]
fn process_metrics_are_poolscopes_own_process() -> anyhow::Result<()> {
    if !privileged("process_metrics_are_poolscopes_own_process") {
        return Ok(());
    }
    let server = TestServer::start(8)?;
    let poolscope = Poolscope::start(&pids_config("own", &[server.pid()]))?;
    scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", "own")]) == Some(1.0)
    })?;
    let pid = poolscope.pid();
    let (cpu_before, start, fds_before) = kernel_view(pid)?;
    let rss_before = rss_kb(pid)? as f64 * 1024.0;
    let metrics = poolscope.scrape()?;
    let (cpu_after, _, fds_after) = kernel_view(pid)?;
    let rss_after = rss_kb(pid)? as f64 * 1024.0;
    let value = |name: &str| metrics.value(name, &[]).unwrap_or(f64::NAN);
    println!(
        "process_*: cpu {} s (kernel {cpu_before}..{cpu_after}), rss {} (VmRSS {rss_before}..{rss_after}), \
         fds {} (kernel {fds_before}, {fds_after}), start {} (kernel {start}), max fds {}",
        value("process_cpu_seconds_total"),
        value("process_resident_memory_bytes"),
        value("process_open_fds"),
        value("process_start_time_seconds"),
        value("process_max_fds"),
    );
    let cpu = value("process_cpu_seconds_total");
    assert!(cpu >= cpu_before && cpu <= cpu_after, "cpu {cpu}");
    let rss = value("process_resident_memory_bytes");
    let (low, high) = (rss_before.min(rss_after), rss_before.max(rss_after));
    // stat's rss and VmRSS come from the same counters, kept per CPU and summed at
    // different moments (1.9 % apart when measured).
    assert!(rss >= low * 0.95 && rss <= high * 1.05, "rss {rss}");
    let fds = value("process_open_fds");
    // The scrape's connection (and its accept) is open while it reads them.
    assert!(
        (fds - fds_before as f64).abs() <= 2.0 && (fds - fds_after as f64).abs() <= 2.0,
        "fds {fds}"
    );
    assert!((value("process_start_time_seconds") - start).abs() < 0.011);
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit(2) with a valid struct.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    // poolscope inherits the test's limit, unless it raises its own.
    assert!(value("process_max_fds") >= limit.rlim_cur as f64);
    assert_eq!(
        metrics.value(
            "poolscope_scrape_collector_success",
            &[("collector", "process")]
        ),
        Some(1.0)
    );
    Ok(())
}

/// `--web.telemetry-path` moves the metrics (and `/metrics` is then not found); `/`
/// is an HTML page linking them, with the version and the git commit that
/// `poolscope_build_info{revision}` also carries.
#[test]
fn telemetry_path_landing_page_and_revision() -> anyhow::Result<()> {
    if !privileged("telemetry_path_landing_page_and_revision") {
        return Ok(());
    }
    let args = [
        "--web.telemetry-path".to_owned(),
        "/probe/metrics".to_owned(),
    ];
    let poolscope = Poolscope::start_with("", &args, |p| p.get("/healthz").is_ok())?;
    let metrics = http_get(poolscope.port, "/probe/metrics")?;
    assert_eq!(metrics.status, 200);
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    assert!(text.contains("poolscope_build_info{"), "{text}");
    assert_eq!(http_get(poolscope.port, "/metrics")?.status, 404);
    let landing = http_get(poolscope.port, "/")?;
    let page = String::from_utf8_lossy(&landing.body).into_owned();
    assert!(
        landing.content_type.starts_with("text/html"),
        "{}",
        landing.content_type
    );
    assert!(page.contains("<a href=\"/probe/metrics\">"), "{page}");
    let built = text
        .lines()
        .find(|line| line.starts_with("poolscope_build_info{"))
        .and_then(|line| line.split_once("revision=\""))
        .and_then(|(_, rest)| rest.split_once('"'))
        .map(|(revision, _)| revision.to_owned())
        .unwrap_or_default();
    let checkout = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()?;
    // Equal when the binary was built at this commit (CI builds it so).
    println!(
        "build_info revision {built}; this checkout {}",
        String::from_utf8_lossy(&checkout.stdout).trim()
    );
    assert!(
        built.len() == 12 && built.chars().all(|c| c.is_ascii_hexdigit()),
        "{built:?}"
    );
    assert!(page.contains(&format!("commit {built}")), "{page}");
    Ok(())
}

/// `--log.format=json` writes one JSON object per line, with the level and message;
/// `--log.format=logfmt` writes `ts=… level=… … msg=…` lines.
#[test]
fn log_formats_write_one_record_per_line() -> anyhow::Result<()> {
    if !privileged("log_formats_write_one_record_per_line") {
        return Ok(());
    }
    for format in ["json", "logfmt"] {
        let args = ["--log.format".to_owned(), format.to_owned()];
        let mut poolscope = Poolscope::start_with("", &args, |p| p.get("/healthz").is_ok())?;
        let log = poolscope.stop_and_log();
        let lines: Vec<&str> = log.lines().filter(|line| !line.trim().is_empty()).collect();
        anyhow::ensure!(lines.len() >= 3, "{format}: {log}");
        for line in &lines {
            match format {
                "json" => {
                    let record: serde_json::Value = serde_json::from_str(line)
                        .map_err(|error| anyhow::anyhow!("{error}: {line}"))?;
                    anyhow::ensure!(
                        record["level"].is_string() && record["message"].is_string(),
                        "{line}"
                    );
                }
                _ => anyhow::ensure!(
                    line.starts_with("ts=") && line.contains(" level=") && line.contains(" msg="),
                    "{line}"
                ),
            }
        }
        println!("{format}: {} lines, e.g. {}", lines.len(), lines[0]);
    }
    Ok(())
}

/// `--web.listen-address` given twice: both addresses serve the same endpoints.
#[test]
fn a_repeated_listen_address_serves_on_each() -> anyhow::Result<()> {
    if !privileged("a_repeated_listen_address_serves_on_each") {
        return Ok(());
    }
    let second = poolscope_tests::free_port()?;
    let args = [
        "--web.listen-address".to_owned(),
        format!("127.0.0.1:{second}"),
    ];
    let poolscope = Poolscope::start_with("", &args, |p| p.get("/healthz").is_ok())?;
    for port in [poolscope.port, second] {
        let metrics = http_get(port, "/metrics")?;
        assert_eq!(metrics.status, 200, "port {port}");
        assert!(
            String::from_utf8_lossy(&metrics.body).contains("poolscope_build_info{"),
            "port {port}"
        );
    }
    Ok(())
}
