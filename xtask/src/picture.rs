//! `cargo xtask picture`: the README's picture, `docs/images/wall-flame.svg`, a
//! wall-clock flame graph that poolscope draws of a real server. Owns the server it
//! draws (gunicorn, one gthread worker of 8 threads, serving `APP`: each request
//! waits on a stand-in backend, hashes a password in OpenSSL, takes a lock every
//! request shares and renders in pure Python), the load (wrk) and the profile it
//! fetches (`/debug/pprof/profile?kind=wall&format=svg`). Starts poolscope with
//! bench's helpers; every process it starts is stopped when it returns, on error too.
//! Needs root, as poolscope does.
use std::{
    fs,
    path::Path,
    process::{Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::bench::{
    Guard, free_port, get_into, spawn_poolscope_binary, wait_for_metrics, wait_until_listening,
};

pub const PACKAGES: &[&str] = &["gunicorn", "wrk"];

/// Where the picture goes, in the workspace.
const OUTPUT: &str = "docs/images/wall-flame.svg";
/// The service's name in poolscope, and the flame graph's.
const SERVICE: &str = "gunicorn";
/// The profile's length, and the load's warm-up before it.
const SECONDS: u64 = 10;
const WARM_UP: Duration = Duration::from_secs(8);

/// The WSGI app gunicorn serves: what a web app's request does, each step in a
/// function of its own. Debian's CPython 3.11 writes no perf map (`-X perf` came in
/// 3.12), so the flame graph names no Python function: the steps are told apart by
/// their C and kernel frames (`clock_nanosleep`, `PyThread_acquire_lock_timed`,
/// `PKCS5_PBKDF2_HMAC`, `_PyEval_EvalFrameDefault`), CPython's own static functions
/// stay `python3.11+0x…`. The lock is the bottleneck (held 1.5 ms by one thread of 8,
/// each request taking it once): about half the threads' time waits for it.
const APP: &str = r#""""cargo xtask picture's server (xtask/src/picture.rs)."""
import hashlib
import threading
import time

BODY = b"ok\n"
SESSIONS = threading.Lock()  # one lock every request takes
sessions = {}


def query_backend():
    time.sleep(0.005)  # a backend's answer: off-CPU, asleep


def check_password():
    # OpenSSL, with the GIL released: on-CPU in libcrypto
    return hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 5000)


def touch_session(key):
    with SESSIONS:  # held 1.5 ms: the other threads wait for it (off-CPU, lock)
        sessions[key] = time.monotonic()
        time.sleep(0.0015)


def render_page():
    # pure Python: on-CPU in the interpreter, holding the GIL
    return "".join(str(i * i) for i in range(3000))


def application(environ, start_response):
    query_backend()
    touch_session(check_password())
    render_page()
    start_response("200 OK", [("Content-Length", str(len(BODY)))])
    return [BODY]
"#;

/// Draws the picture: builds nothing (main.rs builds poolscope first), starts gunicorn,
/// wrk and poolscope, profiles gunicorn for `SECONDS` and writes `OUTPUT`.
pub fn run(root: &Path) -> anyhow::Result<()> {
    let started = Instant::now();
    let dir = root.join("target/picture");
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).context("creating target/picture")?;
    fs::write(dir.join("app.py"), APP).context("writing app.py")?;

    let port = free_port()?;
    let log = fs::File::create(dir.join("gunicorn.log"))?;
    // gunicorn's arbiter stops its worker on SIGTERM (the guard's).
    let mut gunicorn = Guard(
        Command::new("gunicorn")
            .args(["--bind", &format!("127.0.0.1:{port}")])
            .args([
                "--worker-class",
                "gthread",
                "--workers",
                "1",
                "--threads",
                "8",
            ])
            .arg("--chdir")
            .arg(&dir)
            .arg("--worker-tmp-dir")
            .arg(&dir)
            .args(["--graceful-timeout", "3", "--log-level", "warning"])
            .arg("app:application")
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env_remove("GUNICORN_CMD_ARGS")
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting gunicorn")?,
    );
    wait_until_listening(&mut gunicorn, "gunicorn", port, &dir.join("gunicorn.log"))?;

    // Stacks drained every 2 s rather than 10: by the end of the warm-up, the stacks
    // that frame-pointer walks cut short through CPython have been unwound and their
    // callers told apart (docs/endpoints.md, Stack snapshots).
    let config = dir.join("poolscope.toml");
    fs::write(
        &config,
        format!(
            "[discovery]\nrescan_interval = \"500ms\"\n[stacks]\ninterval = \"2s\"\n\
             [[targets]]\nservice = \"{SERVICE}\"\nport = [{port}]\n"
        ),
    )?;
    let address = format!("127.0.0.1:{}", free_port()?);
    let _poolscope = spawn_poolscope_binary(
        &root.join("target/release/poolscope"),
        &config,
        &address,
        &[],
    )?;
    // The arbiter and its worker.
    wait_for_metrics(
        &address,
        &[format!("poolscope_targets{{service=\"{SERVICE}\"}} 2\n")],
    )?;

    let _wrk = Guard(
        Command::new("wrk")
            .args(["-t2", "-c16"])
            .arg(format!("-d{}s", SECONDS + WARM_UP.as_secs() + 5))
            .arg(format!("http://127.0.0.1:{port}/"))
            .stdout(Stdio::null())
            .spawn()
            .context("starting wrk")?,
    );
    sleep(WARM_UP);

    println!("xtask: profiling {SERVICE} under wrk for {SECONDS} s");
    let mut response = Vec::new();
    get_into(
        &address,
        &format!("/debug/pprof/profile?service={SERVICE}&seconds={SECONDS}&kind=wall&format=svg"),
        "",
        &mut response,
    )
    .context("fetching the flame graph")?;
    let body = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|head| &response[head + 4..])
        .context("poolscope's answer has no head")?;
    if !body.windows(4).any(|w| w == b"<svg") {
        bail!(
            "poolscope answered no SVG: {}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        );
    }
    let output = root.join(OUTPUT);
    fs::create_dir_all(output.parent().context("OUTPUT has a directory")?)?;
    fs::write(&output, body).with_context(|| format!("writing {OUTPUT}"))?;
    println!(
        "xtask: wrote {OUTPUT} ({} kB) in {:.0} s",
        body.len().div_ceil(1000),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
