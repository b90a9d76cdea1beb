//! `--web.config.file` end to end: the real poolscope binary with a web config file and
//! a real client (curl). TLS: https with the test CA is served, plain http and a
//! client that does not trust the CA fail, and the failed handshakes are counted.
//! Basic auth: every endpoint answers 401 (with `WWW-Authenticate: Basic`) without or
//! with wrong credentials and 200 with the right ones; SIGHUP rotates the password,
//! and a bad file at reload keeps the running one. Mutual TLS with
//! RequireAndVerifyClientCert: only a certificate of the client CA is served. A bad
//! file stops poolscope at start (and fails `--config.check`) with a message naming
//! the file and the key.
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use poolscope_tests::{
    Metrics, Poolscope, bin_dir, free_port, one_at_a_time, pids_config, privileged, wait_until,
};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// A directory with two CAs and their certificates, and the web config file.
struct Pki {
    dir: tempfile::TempDir,
}

fn ca(name: &str) -> anyhow::Result<CertifiedIssuer<'static, KeyPair>> {
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    Ok(CertifiedIssuer::self_signed(params, KeyPair::generate()?)?)
}

impl Pki {
    /// `ca.pem` signed `server.pem` (localhost, 127.0.0.1) and `client.pem`;
    /// `stranger-ca.pem` signed `stranger.pem`; each with its `.key`.
    fn new() -> anyhow::Result<Self> {
        let pki = Self {
            dir: tempfile::tempdir()?,
        };
        let ours = ca("poolscope test CA")?;
        let stranger = ca("stranger CA")?;
        pki.write("ca.pem", &ours.pem())?;
        pki.write("stranger-ca.pem", &stranger.pem())?;
        let leaves = [
            (
                "server",
                &ours,
                vec!["localhost", "127.0.0.1"],
                ExtendedKeyUsagePurpose::ServerAuth,
            ),
            (
                "client",
                &ours,
                vec!["prometheus"],
                ExtendedKeyUsagePurpose::ClientAuth,
            ),
            (
                "stranger",
                &stranger,
                vec!["prometheus"],
                ExtendedKeyUsagePurpose::ClientAuth,
            ),
        ];
        for (name, issuer, names, usage) in leaves {
            let names: Vec<String> = names.into_iter().map(str::to_owned).collect();
            let mut params = CertificateParams::new(names)?;
            params.extended_key_usages = vec![usage];
            params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            let key = KeyPair::generate()?;
            let cert = params.signed_by(&key, issuer)?;
            pki.write(&format!("{name}.pem"), &cert.pem())?;
            pki.write(&format!("{name}.key"), &key.serialize_pem())?;
        }
        Ok(pki)
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    fn write(&self, name: &str, content: &str) -> anyhow::Result<PathBuf> {
        let path = self.dir.path().join(name);
        std::fs::write(&path, content)?;
        Ok(path)
    }
}

const TLS: &str = "tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n";

/// What curl got.
#[derive(Debug)]
struct Answer {
    /// curl's exit code: 0 when it got an HTTP answer.
    exit: Option<i32>,
    /// 0: no HTTP answer.
    status: u16,
    head: String,
    body: String,
    stderr: String,
}

/// curl with `args` (and a 20 s limit), headers and body apart.
fn curl(args: &[&str]) -> anyhow::Result<Answer> {
    let head = tempfile::NamedTempFile::new()?;
    let output = Command::new("curl")
        .args([
            "--silent",
            "--show-error",
            "--max-time",
            "20",
            "--dump-header",
        ])
        .arg(head.path())
        .args(["--write-out", "\n%{http_code}"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running curl (is it installed?)")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let (body, status) = stdout.rsplit_once('\n').unwrap_or(("", &stdout));
    Ok(Answer {
        exit: output.status.code(),
        status: status.trim().parse().unwrap_or(0),
        head: std::fs::read_to_string(head.path()).unwrap_or_default(),
        body: body.to_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    })
}

fn web_args(web_config: &Path) -> Vec<String> {
    vec![format!("--web.config.file={}", web_config.display())]
}

/// A config that watches only this test process (nothing to measure here).
fn toml() -> String {
    pids_config("webconfig-test", &[std::process::id()])
}

/// `poolscope_tls_handshake_errors_total{reason}` as the exporter says it.
fn handshake_errors(metrics_text: &str, reason: &str) -> f64 {
    Metrics::parse(metrics_text)
        .value(
            "poolscope_tls_handshake_errors_total",
            &[("reason", reason)],
        )
        .unwrap_or(-1.0)
}

#[test]
fn tls_serves_https_with_the_test_ca_and_refuses_plain_http() -> anyhow::Result<()> {
    if !privileged("tls_serves_https_with_the_test_ca_and_refuses_plain_http") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let pki = Pki::new()?;
    let web_config = pki.write("web.yml", TLS)?;
    let ca = pki.path("ca.pem");
    let https =
        |poolscope: &Poolscope, path: &str| format!("https://127.0.0.1:{}{path}", poolscope.port);
    let mut poolscope = Poolscope::start_with(&toml(), &web_args(&web_config), |poolscope| {
        curl(&["--cacert", &ca, &https(poolscope, "/healthz")]).is_ok_and(|a| a.status == 200)
    })?;

    let scrape = curl(&["--cacert", &ca, &https(&poolscope, "/metrics")])?;
    ensure!(scrape.status == 200, "{scrape:?}");
    ensure!(
        scrape.body.contains("poolscope_build_info{"),
        "{}",
        scrape.body
    );
    // TLS 1.2 too, and /debug/* still knows the client is on loopback.
    let tls12 = curl(&[
        "--cacert",
        &ca,
        "--tlsv1.2",
        "--tls-max",
        "1.2",
        &https(&poolscope, "/debug/threads"),
    ])?;
    ensure!(tls12.status == 200, "{tls12:?}");

    let plain = curl(&[&format!("http://127.0.0.1:{}/metrics", poolscope.port)])?;
    ensure!(
        plain.status == 0 && plain.exit != Some(0),
        "plain http was answered: {plain:?}"
    );
    let untrusting = curl(&[&https(&poolscope, "/metrics")])?;
    ensure!(
        untrusting.status == 0 && untrusting.exit == Some(60),
        "a client without the test CA: {untrusting:?}"
    );
    println!(
        "plain http: curl exit {:?} ({}); without the CA: exit {:?} ({})",
        plain.exit,
        plain.stderr.trim(),
        untrusting.exit,
        untrusting.stderr.trim()
    );

    // Both failed handshakes are counted, and the server goes on.
    let after = curl(&["--cacert", &ca, &https(&poolscope, "/metrics")])?;
    ensure!(after.status == 200, "{after:?}");
    let failed = handshake_errors(&after.body, "failed");
    ensure!(
        failed >= 2.0,
        "tls_handshake_errors_total{{reason=\"failed\"}} = {failed}"
    );
    ensure!(
        handshake_errors(&after.body, "timeout") == 0.0,
        "{}",
        after.body
    );
    println!("poolscope_tls_handshake_errors_total{{reason=\"failed\"}} {failed}");
    let log = poolscope.stop_and_log();
    ensure!(log.contains("TLS, client_auth_type NoClientCert"), "{log}");
    Ok(())
}

#[test]
fn basic_auth_guards_every_endpoint_and_a_sighup_rotates_the_password() -> anyhow::Result<()> {
    if !privileged("basic_auth_guards_every_endpoint_and_a_sighup_rotates_the_password") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let pki = Pki::new()?;
    let users = |password: &str| -> anyhow::Result<String> {
        Ok(format!(
            "basic_auth_users:\n  prometheus: \"{}\"\n  grafana: \"{}\"\n",
            bcrypt::hash(password, 10)?,
            bcrypt::hash("grafana-password", 10)?
        ))
    };
    let web_config = pki.write("web.yml", &users("scrape-me")?)?;
    let url =
        |poolscope: &Poolscope, path: &str| format!("http://127.0.0.1:{}{path}", poolscope.port);
    let mut poolscope = Poolscope::start_with(&toml(), &web_args(&web_config), |poolscope| {
        curl(&[
            "--user",
            "prometheus:scrape-me",
            &url(poolscope, "/healthz"),
        ])
        .is_ok_and(|a| a.status == 200)
    })?;

    for path in ["/metrics", "/healthz", "/debug/threads", "/no-such-page"] {
        for credentials in [
            None,
            Some("prometheus:wrong"),
            Some("nobody:scrape-me"),
            Some("grafana:scrape-me"),
        ] {
            let mut args = vec![];
            if let Some(credentials) = credentials {
                args.extend(["--user", credentials]);
            }
            let target = url(&poolscope, path);
            args.push(&target);
            let answer = curl(&args)?;
            ensure!(
                answer.status == 401,
                "{path} with {credentials:?}: {answer:?}"
            );
            let challenge = answer
                .head
                .lines()
                .find_map(|line| {
                    line.split_once(':')
                        .filter(|(name, _)| name.eq_ignore_ascii_case("www-authenticate"))
                })
                .map(|(_, value)| value.trim().to_owned());
            ensure!(
                challenge
                    .as_deref()
                    .is_some_and(|value| value.starts_with("Basic")),
                "{path}: {answer:?}"
            );
        }
        let right = curl(&["--user", "prometheus:scrape-me", &url(&poolscope, path)])?;
        let want = if path == "/no-such-page" { 404 } else { 200 };
        ensure!(right.status == want, "{path}: {right:?}");
    }
    let other = curl(&[
        "--user",
        "grafana:grafana-password",
        &url(&poolscope, "/metrics"),
    ])?;
    ensure!(
        other.status == 200 && other.body.contains("poolscope_build_info{"),
        "{other:?}"
    );

    // SIGHUP: the new password, not the old one.
    std::fs::write(&web_config, users("rotated")?)?;
    poolscope.signal(libc::SIGHUP);
    let rotated = wait_until(Duration::from_secs(10), || {
        curl(&["--user", "prometheus:rotated", &url(&poolscope, "/healthz")])
            .is_ok_and(|a| a.status == 200)
    });
    ensure!(rotated, "the rotated password is not taken after SIGHUP");
    let old = curl(&[
        "--user",
        "prometheus:scrape-me",
        &url(&poolscope, "/healthz"),
    ])?;
    ensure!(old.status == 401, "the old password still works: {old:?}");
    // A bad file at reload keeps the running one.
    std::fs::write(&web_config, "basic_auth_users:\n  prometheus: rotated\n")?;
    poolscope.signal(libc::SIGHUP);
    // The reload is over once its refusal is exported (the first one succeeded).
    let mut seen = String::from("no answer");
    let refused = wait_until(Duration::from_secs(10), || {
        let reload =
            curl(&["--user", "prometheus:rotated", &url(&poolscope, "/metrics")]).map(|a| {
                let successful = (a.status == 200).then(|| {
                    Metrics::parse(&a.body).value("poolscope_config_last_reload_successful", &[])
                });
                (a.status, successful.flatten())
            });
        seen = format!("{reload:?}");
        reload
            .as_ref()
            .is_ok_and(|&(status, successful)| status == 200 && successful == Some(0.0))
    });
    ensure!(
        refused,
        "the bad reload not exported as refused (config_last_reload_successful 0) within \
         10 s; last (status, value): {seen}"
    );
    let kept = curl(&["--user", "prometheus:rotated", &url(&poolscope, "/healthz")])?;
    ensure!(kept.status == 200, "{kept:?}");
    let log = poolscope.stop_and_log();
    ensure!(log.contains("web configuration reload refused"), "{log}");
    ensure!(log.contains("basic_auth_users.prometheus"), "{log}");
    println!(
        "401 without, with a wrong or an unknown user's credentials on 4 paths; 200 with them; SIGHUP rotated the password; a bad reload was refused and the running file kept"
    );
    Ok(())
}

#[test]
fn mutual_tls_serves_only_certificates_of_the_client_ca() -> anyhow::Result<()> {
    if !privileged("mutual_tls_serves_only_certificates_of_the_client_ca") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let pki = Pki::new()?;
    let web_config = pki.write(
        "web.yml",
        &format!("{TLS}  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.pem\n"),
    )?;
    let ca = pki.path("ca.pem");
    let (client, client_key) = (pki.path("client.pem"), pki.path("client.key"));
    let https = |poolscope: &Poolscope| format!("https://127.0.0.1:{}/metrics", poolscope.port);
    let poolscope = Poolscope::start_with(&toml(), &web_args(&web_config), |poolscope| {
        curl(&[
            "--cacert",
            &ca,
            "--cert",
            &client,
            "--key",
            &client_key,
            &https(poolscope),
        ])
        .is_ok_and(|a| a.status == 200)
    })?;

    // A scrape over mutual TLS with this client certificate.
    let with_certificate = |cert: &str, key: &str| {
        curl(&[
            "--cacert",
            &ca,
            "--cert",
            cert,
            "--key",
            key,
            &https(&poolscope),
        ])
    };
    let trusted = with_certificate(&client, &client_key)?;
    ensure!(
        trusted.status == 200 && trusted.body.contains("poolscope_build_info{"),
        "{trusted:?}"
    );
    let anonymous = curl(&["--cacert", &ca, &https(&poolscope)])?;
    ensure!(
        anonymous.status == 0 && anonymous.exit != Some(0),
        "no client certificate: {anonymous:?}"
    );
    let (stranger, stranger_key) = (pki.path("stranger.pem"), pki.path("stranger.key"));
    let strange = with_certificate(&stranger, &stranger_key)?;
    ensure!(
        strange.status == 0 && strange.exit != Some(0),
        "a certificate of another CA: {strange:?}"
    );
    println!(
        "no client certificate: curl exit {:?} ({}); another CA's: exit {:?} ({})",
        anonymous.exit,
        anonymous.stderr.trim(),
        strange.exit,
        strange.stderr.trim()
    );

    let after = with_certificate(&client, &client_key)?;
    ensure!(after.status == 200, "{after:?}");
    let failed = handshake_errors(&after.body, "failed");
    ensure!(
        failed >= 2.0,
        "tls_handshake_errors_total{{reason=\"failed\"}} = {failed}"
    );
    Ok(())
}

/// Runs poolscope to its exit (30 s at most): exit code, stdout, stderr.
fn run_to_exit(args: &[String]) -> anyhow::Result<(Option<i32>, String, String)> {
    let mut child = Command::new(bin_dir()?.join("poolscope"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting poolscope (build it first: cargo build --bins)")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait()?.is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let output = child.wait_with_output()?;
            bail!(
                "poolscope still running after 30 s:\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output()?;
    Ok((
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    ))
}

/// Needs no root: the web config file is read before the kernel programs are loaded.
#[test]
fn a_bad_web_config_file_stops_poolscope_naming_the_file_and_key() -> anyhow::Result<()> {
    let pki = Pki::new()?;
    let listen = format!("--web.listen-address=127.0.0.1:{}", free_port()?);
    let cases = [
        (
            format!("{TLS}  cipher_suites: [TLS_RSA_WITH_AES_128_CBC_SHA]\n"),
            "tls_server_config.cipher_suites",
            "not supported",
        ),
        (
            "tls_server_config:\n  cert_file: server.pem\n  key_file: stranger.key\n".to_owned(),
            "tls_server_config.key_file",
            "not usable with the certificate",
        ),
        (
            "tls_server_config:\n  cert_file: missing.pem\n  key_file: server.key\n".to_owned(),
            "tls_server_config.cert_file",
            "missing.pem",
        ),
        (
            format!("{TLS}  client_auth_type: RequireAndVerifyClientCert\n"),
            "tls_server_config.client_ca_file",
            "missing",
        ),
        (
            "basic_auth_users:\n  prometheus: plain-text\n".to_owned(),
            "basic_auth_users.prometheus",
            "not a bcrypt hash",
        ),
        (
            "tls_server_config:\n  certfile: server.pem\n".to_owned(),
            "certfile",
            "unknown field",
        ),
    ];
    for (yaml, key, reason) in cases {
        let web_config = pki.write("web.yml", &yaml)?;
        let file = web_config.display().to_string();
        for check in [false, true] {
            let mut args = web_args(&web_config);
            args.push(listen.clone());
            if check {
                args.push("--config.check".to_owned());
            }
            let (code, _, stderr) = run_to_exit(&args)?;
            ensure!(code == Some(1), "{yaml}: exit {code:?}, {stderr}");
            ensure!(
                stderr.contains(&format!("web config file {file}"))
                    && stderr.contains(key)
                    && stderr.contains(reason),
                "{yaml}: want the file, `{key}` and {reason:?} in:\n{stderr}"
            );
            ensure!(
                !stderr.contains("kernel probes loaded"),
                "started anyway:\n{stderr}"
            );
        }
        println!(
            "refused: {}",
            yaml.lines().last().unwrap_or_default().trim()
        );
    }
    // And a good one passes --config.check.
    let web_config = pki.write(
        "web.yml",
        &format!("{TLS}  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: ca.pem\n"),
    )?;
    let mut args = web_args(&web_config);
    args.push("--config.check".to_owned());
    let (code, stdout, stderr) = run_to_exit(&args)?;
    ensure!(code == Some(0), "{stdout}{stderr}");
    ensure!(
        stdout.contains("web config file: TLS, client_auth_type RequireAndVerifyClientCert"),
        "{stdout}"
    );
    Ok(())
}
