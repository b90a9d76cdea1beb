//! `cargo xtask <run|test|stress|bench|scorecard|picture|setup|…>`: the project's only entry points. Each first
//! installs what is missing (rust-src, bpf-linker linked to rustc's own libLLVM, the
//! Debian packages the task needs) and says nothing when nothing is missing.
mod bench;
mod image;
mod manifests;
mod package;
mod picture;
mod scorecard;
mod setup;
mod skips;
mod vm;

use std::{
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

use anyhow::{Context as _, bail};

const USAGE: &str = "usage: cargo xtask <command>
  run [-- poolscope flags]  install what is missing, build, run poolscope (auto-discovery)
  test                      install what is missing, run lint, unit and privileged tests, then vm-test
  vm-test                   install what is missing, run poolscope and ground-truth tests on Debian 12's 6.1 kernel in qemu
  stress [--seconds N]      (root) install what is missing, load nginx and Go at full rate on every backend for N s each (default 20): every count against the truth, every gauge back to 0
  bench                     install what is missing, measure poolscope's cost on nginx, per context switch, per lock and of stack snapshots (BENCH_ONLY=nginx|sched|locks|stacks)
  manifests [--job-selector S] [--runbook-base URL]  write deploy/kubernetes/'s PrometheusRule and dashboard ConfigMaps from alerts/ and dashboards/
  image                     build the .deb, then the container image localhost/poolscope:<version> from Debian packages and target/image/poolscope_<version>.oci.tar
  scorecard [--from-log]    run the tests that compare poolscope with a ground truth (as root), write docs/accuracy.md from their log (--from-log: from the log `test` left)
  package                   build the release binary and target/package/poolscope_<version>_<arch>.deb (binary, systemd unit, empty config)
  picture                   (root) install what is missing, build, draw docs/images/wall-flame.svg: poolscope's wall-clock flame graph of gunicorn under wrk
  setup                     only install what is missing";

/// Debian packages the tests use: promtool (prometheus); the real servers of
/// tests/src/servers.rs and wrk. `tomcat10-common` (catalina.sh and the jars, run
/// with the tests' own CATALINA_BASE) rather than `tomcat10`, which only adds the
/// system instance: a systemd unit on port 8080, a user, /etc.
const TEST_PACKAGES: &[&str] = &[
    "prometheus",
    "nginx",
    // tests/tests/kubernetes.rs: nginx's stream proxy is the mesh test's sidecar.
    "libnginx-mod-stream",
    "wrk",
    "tomcat10-common",
    "gunicorn",
    "nodejs",
    "golang-go",
    // Headless Chromium screenshots the flame graph SVGs, so that a test checks what a
    // person sees (tests/tests/stacks.rs); golang-go's `go tool pprof` reads the
    // pprof profiles.
    "chromium",
    // tests/tests/deploy.rs and privileges.rs: systemd-analyze, and the systemd that
    // runs poolscope under its unit; python3-venv for kubernetes-validate's venv.
    "systemd",
    "python3-venv",
    // objcopy strips a copy of a test program (tests/tests/stacks.rs).
    "binutils",
    // tests/tests/downstream.rs: its C server (cc, libcurl) and its Java server, run
    // from source by the JDK's launcher (the JRE that Tomcat pulls in has no javac).
    "gcc",
    "libcurl4-openssl-dev",
    "liburing-dev", // tests/tests/iouring.rs: its io_uring HTTP server, tests/iouring/
    "default-jdk-headless",
    // tests/tests/http2.rs: h2load drives nginx over cleartext HTTP/2 and counts what
    // succeeded; the gRPC server and client (grpcio), the raw HTTP/2 clients that
    // reset, cut up or garble frames and the Upgrade: h2c server (h2) run under
    // Debian's /usr/bin/python3; curl takes the Upgrade: h2c path; a second gRPC
    // server is Go's (grpc-go, built in GOPATH mode from Debian's sources).
    "nghttp2-client",
    "python3-grpcio",
    "python3-h2",
    "curl",
    "golang-google-grpc-dev",
];

/// Prints a failure's chain of causes without a backtrace: under `RUST_BACKTRACE`
/// (CI sets it for the tests' panics) `anyhow` would append xtask's own frames, and
/// a log cut to its tail would show those instead of what failed.
fn main() -> ExitCode {
    match xtask() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn xtask() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = workspace_root()?;
    match args.first().map(String::as_str) {
        Some("run") => {
            setup_and_build(&root, &[])?;
            let flags = args.get(1..).unwrap_or_default();
            let flags: Vec<&str> = flags
                .iter()
                .map(String::as_str)
                .skip_while(|a| *a == "--")
                .collect();
            let binary = root.join("target/release/poolscope");
            run_privileged(&binary, &flags)
        }
        Some("test") => {
            let log = root.join("target/test-skips.log");
            skips::reset(&log)?;
            let comparisons = root.join(scorecard::LOG);
            scorecard::reset(&comparisons)?;
            // SAFETY: xtask is single-threaded; the tests it starts inherit the variables.
            unsafe {
                std::env::set_var(skips::ENV, &log);
                std::env::set_var(scorecard::ENV, &comparisons);
            }
            let result = test(&root);
            for line in skips::summary(&log)? {
                eprintln!("xtask: {line}");
            }
            result
        }
        Some("vm-test") => {
            setup::ensure(vm::PACKAGES)?;
            vm::run(&root)
        }
        Some("stress") => {
            let seconds = match args.get(1..).unwrap_or_default() {
                [] => None,
                [flag, seconds] if flag == "--seconds" => Some(
                    seconds
                        .parse::<u64>()
                        .with_context(|| format!("stress: --seconds {seconds:?} is no number"))?,
                ),
                _ => bail!("stress: unknown arguments\n{USAGE}"),
            };
            if !is_root() {
                bail!("cargo xtask stress loads eBPF programs: run it as root");
            }
            setup::ensure(TEST_PACKAGES)?;
            stress(&root, seconds)
        }
        Some("bench") => {
            setup_and_build(&root, bench::PACKAGES)?;
            bench::run(&root)
        }
        Some("package") => {
            setup_and_build(&root, package::PACKAGES)?;
            let deb = package::build(&root)?;
            println!("{}", deb.display());
            Ok(())
        }
        Some("image") => {
            setup_and_build(&root, &[package::PACKAGES, image::PACKAGES].concat())?;
            let deb = package::build(&root)?;
            println!("{}", image::build(&root, &deb)?.display());
            Ok(())
        }
        Some("scorecard") => {
            let log = root.join(scorecard::LOG);
            match args.get(1).map(String::as_str) {
                Some("--from-log") => {}
                None => {
                    setup::ensure(TEST_PACKAGES)?;
                    run_scorecard_tests(&root, &log)?;
                }
                Some(other) => bail!("scorecard: unknown argument {other:?}\n{USAGE}"),
            }
            let rows = scorecard::write_page(&root, &log)?;
            println!("{}: {rows} comparisons", scorecard::PAGE);
            Ok(())
        }
        Some("picture") => {
            if !is_root() {
                bail!(
                    "cargo xtask picture needs root: the poolscope it runs loads eBPF programs; run it again as root"
                );
            }
            setup_and_build(&root, picture::PACKAGES)?;
            picture::run(&root)
        }
        Some("manifests") => manifests::run(&root, args.get(1..).unwrap_or_default()),
        Some("setup") => {
            setup::ensure(
                &[
                    TEST_PACKAGES,
                    bench::PACKAGES,
                    picture::PACKAGES,
                    vm::PACKAGES,
                ]
                .concat(),
            )?;
            setup::ensure_kubernetes_validate(&root)
        }
        _ => bail!("{USAGE}"),
    }
}

/// `cargo xtask test`: installs what is missing, then lint, unit and privileged tests,
/// then vm-test.
fn test(root: &Path) -> anyhow::Result<()> {
    setup::ensure(
        &[
            TEST_PACKAGES,
            package::PACKAGES,
            image::PACKAGES,
            vm::PACKAGES,
        ]
        .concat(),
    )?;
    setup::ensure_kubernetes_validate(root)?;
    cargo(root, &["fmt", "--all", "--check"])?;
    setup::cargo_deny(root)?;
    cargo(
        root,
        &["clippy", "--quiet", "--all-targets", "--", "-D", "warnings"],
    )?;
    setup::clippy_ebpf(root)?;
    // Unit tests, with debug assertions. The kernel crate builds only for the
    // BPF target (linted above, built by the exporter's build script).
    cargo(
        root,
        &[
            "test",
            "--package",
            "poolscope",
            "--package",
            "poolscope-shared",
            "--package",
            "xtask",
        ],
    )?;
    // The privileged tests measure the binaries as shipped (release), which
    // they start; vm-test then reuses the same build.
    cargo(root, &["build", "--quiet", "--release", "--bins"])?;
    // The package and image tests (privileges.rs, deploy.rs) use these.
    let deb = package::build(root)?;
    image::build(root, &deb)?;
    cargo(root, &["test", "--release", "--package", "poolscope-tests"])?;
    vm::run(root)
}

/// `cargo xtask scorecard`: the release binaries, then each test binary that records
/// comparisons, one at a time (they time the machine), logging to `log`.
fn run_scorecard_tests(root: &Path, log: &Path) -> anyhow::Result<()> {
    if !is_root() {
        bail!("scorecard: the tests that record comparisons load eBPF programs: run as root");
    }
    cargo(root, &["build", "--quiet", "--release", "--bins"])?;
    scorecard::reset(log)?;
    // SAFETY: xtask is single-threaded; the tests it starts inherit the variable.
    unsafe { std::env::set_var(scorecard::ENV, log) };
    for binary in scorecard::recording_binaries(root)? {
        test_binary(root, &binary, &["--test-threads", "1"])?;
    }
    Ok(())
}

/// Runs the privileged test binary tests/tests/`binary`.rs with the test harness's
/// `args`.
fn test_binary(root: &Path, binary: &str, args: &[&str]) -> anyhow::Result<()> {
    let command = [
        "test",
        "--release",
        "--package",
        "poolscope-tests",
        "--test",
        binary,
        "--",
    ];
    cargo(root, &[&command[..], args].concat())
}

/// `cargo xtask stress`: tests/tests/stress.rs, its load `seconds` long per backend.
fn stress(root: &Path, seconds: Option<u64>) -> anyhow::Result<()> {
    cargo(root, &["build", "--quiet", "--release", "--bins"])?;
    if let Some(seconds) = seconds {
        // SAFETY: xtask is single-threaded; the test it starts inherits the variable.
        unsafe { std::env::set_var("POOLSCOPE_STRESS_SECONDS", seconds.to_string()) };
    }
    test_binary(root, "stress", &["--nocapture"])
}

fn workspace_root() -> anyhow::Result<PathBuf> {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .context("xtask has no parent directory")
}

/// Installs what is missing and `packages`, then builds the release poolscope.
fn setup_and_build(root: &Path, packages: &[&str]) -> anyhow::Result<()> {
    setup::ensure(packages)?;
    cargo(
        root,
        &["build", "--quiet", "--release", "--package", "poolscope"],
    )
}

/// Runs cargo (the toolchain rust-toolchain.toml pins) in the workspace.
fn cargo(root: &Path, args: &[&str]) -> anyhow::Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let status = Command::new(cargo)
        .args(args)
        .current_dir(root)
        .status()
        .with_context(|| format!("running cargo {}", args.join(" ")))?;
    if !status.success() {
        bail!("cargo {} failed ({status})", args.join(" "));
    }
    Ok(())
}

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Runs `program` as root (through sudo when we are not root) and returns its result.
fn run_privileged(program: &Path, args: &[&str]) -> anyhow::Result<()> {
    let mut command = if is_root() {
        Command::new(program)
    } else {
        let mut sudo = Command::new("sudo");
        sudo.arg(program);
        sudo
    };
    let status = command
        .args(args)
        .status()
        .with_context(|| format!("starting {}", program.display()))?;
    if !status.success() {
        bail!("{} exited with {status}", program.display());
    }
    Ok(())
}
