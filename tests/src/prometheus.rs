//! A real Prometheus (Debian's `prometheus` package) for the operators' tests: started
//! on a free port with a generated config that scrapes the given targets and
//! evaluates the given rule files every second, queried through its HTTP API, killed
//! when dropped; and `promtool check metrics` on an exposition.
use std::{
    io::Write as _,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::{free_port, wait_until};

/// Where the Debian package puts the server (`cargo xtask` installs it).
pub const PROMETHEUS: &str = "/usr/bin/prometheus";

/// Runs `promtool check metrics` on `exposition`: fails with what promtool said
/// unless it parses and passes the lint silently.
pub fn check_metrics(exposition: &str) -> anyhow::Result<()> {
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting promtool (Debian package prometheus)")?;
    promtool
        .stdin
        .take()
        .context("promtool has no stdin")?
        .write_all(exposition.as_bytes())?;
    let output = promtool.wait_with_output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    if !output.status.success() || !said.trim().is_empty() {
        bail!("promtool check metrics: {said}\n{exposition}");
    }
    Ok(())
}

/// A running Prometheus; killed (and its storage removed) when dropped.
pub struct Prometheus {
    child: Child,
    pub port: u16,
    dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (`host:port`) as job `job` and evaluating
    /// `rule_files`, both every second, and waits until it is ready.
    pub fn start(job: &str, targets: &[String], rule_files: &[PathBuf]) -> anyhow::Result<Self> {
        Self::start_with_features(job, targets, rule_files, &[])
    }

    /// As [`Self::start`], with `--enable-feature` for each of `features`.
    pub fn start_with_features(
        job: &str,
        targets: &[String],
        rule_files: &[PathBuf],
        features: &[&str],
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let quoted = |text: &str| format!("'{}'", text.replace('\'', "''"));
        let rules: Vec<String> = rule_files
            .iter()
            .map(|path| format!("  - {}\n", quoted(&path.to_string_lossy())))
            .collect();
        let targets: Vec<String> = targets.iter().map(|t| quoted(t)).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n{}\
             scrape_configs:\n  - job_name: {}\n    static_configs:\n      - targets: [{}]\n",
            rules.concat(),
            quoted(job),
            targets.join(", ")
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config)?;
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let port = free_port()?;
        let child = Command::new(PROMETHEUS)
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .args(
                features
                    .iter()
                    .map(|feature| format!("--enable-feature={feature}")),
            )
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {PROMETHEUS} (Debian package prometheus)"))?;
        let mut prometheus = Self { child, port, dir };
        let ready = wait_until(Duration::from_secs(30), || {
            prometheus
                .get("/-/ready")
                .is_ok_and(|(status, _)| status == 200)
                || !matches!(prometheus.child.try_wait(), Ok(None))
        });
        if !ready || !matches!(prometheus.child.try_wait(), Ok(None)) {
            bail!(
                "prometheus was not ready within 30 s:\n{}",
                prometheus.log()
            );
        }
        Ok(prometheus)
    }

    /// What Prometheus logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// GET `path` (with its query string); the status code and the body.
    pub fn get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        let response = crate::profiles::http_get(self.port, path)?;
        Ok((
            response.status,
            String::from_utf8_lossy(&response.body).into_owned(),
        ))
    }

    /// GET an API `path`; its `data`, or the API's error.
    pub fn api(&self, path: &str) -> anyhow::Result<serde_json::Value> {
        let (status, body) = self.get(path)?;
        let answer: serde_json::Value = serde_json::from_str(&body)
            .with_context(|| format!("GET {path}: HTTP {status}, not JSON: {body}"))?;
        if answer["status"] != "success" {
            bail!(
                "GET {path}: HTTP {status}, {}: {}",
                answer["errorType"],
                answer["error"]
            );
        }
        Ok(answer["data"].clone())
    }

    /// Evaluates `expr` now (instant query); the query's result type and result.
    pub fn query(&self, expr: &str) -> anyhow::Result<(String, serde_json::Value)> {
        let data = self.api(&format!("/api/v1/query?query={}", url_encode(expr)))?;
        let kind = data["resultType"]
            .as_str()
            .with_context(|| format!("{expr}: no resultType in {data}"))?
            .to_owned();
        Ok((kind, data["result"].clone()))
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
pub fn url_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 3);
    for byte in text.bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(byte as char);
            }
            _ => out.push_str(&format!("%{byte:02X}")),
        }
    }
    out
}
