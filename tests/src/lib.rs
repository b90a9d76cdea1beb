//! Helpers for poolscope's privileged end-to-end tests: start the real `poolscope`
//! binary on a free port with a given config, start `testserver` processes whose
//! behaviour the test controls, scrape and parse `/metrics`.
//!
//! Tests that need root call [`privileged`] first: without root they skip with a
//! message, except under `CI=true`, where a skip is a failure.
use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{Ipv4Addr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

pub mod downstream;
pub mod http1;
pub mod http2;
pub mod kernel_maps;
pub mod load;
pub mod pods;
pub mod profiles;
pub mod prometheus;
pub mod quota;
pub mod scorecard;
pub mod servers;
pub mod steady;
pub mod tracepoint_count;

/// The request backends this kernel has, as `[probes] backend` names them: the
/// socket backend's tracepoints came with Linux 6.3, the tcp backend's socket storage
/// in tracing programs with 5.11 (docs/install.md, kernel requirements); the syscall backend
/// runs everywhere. Known from the release rather than from the tracepoints, so that
/// a kernel that has the version but not the tracepoints fails the tests instead of
/// skipping them.
///
/// `POOLSCOPE_TEST_BACKENDS` (a comma-separated list; `cargo xtask vm-test` sets it
/// per guest) narrows them to those it names. A name that is no backend, or a list
/// that leaves none this kernel has, panics: every test would pass having tested
/// nothing.
pub fn backends() -> Vec<&'static str> {
    let available = kernel_backends();
    match std::env::var("POOLSCOPE_TEST_BACKENDS") {
        Ok(wanted) => narrowed(&available, &wanted).unwrap_or_else(|problem| panic!("{problem}")),
        Err(_) => available,
    }
}

/// Every request backend poolscope has.
const ALL_BACKENDS: [&str; 3] = ["socket", "tcp", "syscall"];

/// The backends of `available` that `wanted` (`POOLSCOPE_TEST_BACKENDS`) names, or
/// what is wrong with it.
fn narrowed(available: &[&'static str], wanted: &str) -> Result<Vec<&'static str>, String> {
    let names: Vec<&str> = wanted.split(',').map(str::trim).collect();
    if let Some(unknown) = names.iter().find(|name| !ALL_BACKENDS.contains(name)) {
        return Err(format!(
            "POOLSCOPE_TEST_BACKENDS={wanted:?} names {unknown:?}, which is no backend \
             ({ALL_BACKENDS:?})"
        ));
    }
    let backends: Vec<&'static str> = available
        .iter()
        .copied()
        .filter(|backend| names.contains(backend))
        .collect();
    if backends.is_empty() {
        return Err(format!(
            "POOLSCOPE_TEST_BACKENDS={wanted:?} leaves no backend this kernel has \
             ({available:?}): nothing would be tested"
        ));
    }
    Ok(backends)
}

fn kernel_backends() -> Vec<&'static str> {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    if release_at_least(&release, (6, 3)) {
        vec!["socket", "tcp", "syscall"]
    } else if release_at_least(&release, (5, 11)) {
        eprintln!(
            "kernel {}: before 6.3, no socket backend; testing the tcp and syscall backends",
            release.trim()
        );
        vec!["tcp", "syscall"]
    } else {
        eprintln!(
            "kernel {}: before 5.11, no socket or tcp backend; testing the syscall backend",
            release.trim()
        );
        vec!["syscall"]
    }
}

/// Whether a kernel release (`6.1.0-50-amd64`) is at least `(major, minor)`.
fn release_at_least(release: &str, wanted: (u32, u32)) -> bool {
    let mut numbers = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|part| part.parse::<u32>().unwrap_or(0));
    let major = numbers.next().unwrap_or(0);
    let minor = numbers.next().unwrap_or(0);
    (major, minor) >= wanted
}

/// Whether this kernel lets the tcp backend's HTTP/2 programs (fexit on `tcp_recvmsg`
/// and `tcp_sendmsg`) attach, as `POOLSCOPE_TEST_TCP_HTTP2` says: `cargo xtask vm-test`
/// sets it in its guests, whose kernels have fexit trampolines; CI's host kernel
/// refuses fexit. Where it is set, the tcp backend is tested on HTTP/2 and its probes
/// must attach.
pub fn tcp_follows_http2() -> bool {
    std::env::var_os("POOLSCOPE_TEST_TCP_HTTP2").is_some()
}

/// The tcp backend's HTTP/2 probes, as `poolscope_probe_attached` names them.
pub const TCP_HTTP2_PROBES: [&str; 2] = ["fexit/tcp_recvmsg", "fexit/tcp_sendmsg"];

/// What software emulation puts between a request's duration as poolscope measures it
/// (from the read's return to the write's return, in the kernel) and as the server's
/// own clock does (the same, in user space): there each syscall costs ~0.4 ms more and
/// a thread waits for a vCPU at a syscall's return. `cargo xtask vm-test`'s guest sets
/// `POOLSCOPE_TEST_EMULATED` when it runs under emulation; measured there, on 5–10 ms
/// means: 0.40 ms (6.12, socket backend) and 1.09 ms (6.1, syscall backend, 8
/// connections on 2 vCPUs). None on a real machine.
pub fn emulation_allowance() -> Duration {
    if std::env::var_os("POOLSCOPE_TEST_EMULATED").is_some() {
        Duration::from_micros(1500)
    } else {
        Duration::ZERO
    }
}

/// True when the test can run; otherwise says why it skips (or fails under CI=true).
pub fn privileged(test: &str) -> bool {
    // SAFETY: geteuid cannot fail.
    let reason = if unsafe { libc::geteuid() } != 0 {
        "needs root (loads eBPF programs)"
    } else if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        "needs a kernel with BTF"
    } else {
        return true;
    };
    skip(test, reason);
    false
}

/// Says why `test` skips; under CI=true, where a skip is a failure, panics instead.
/// The skip is also recorded in the file `POOLSCOPE_SKIP_LOG` names, from which
/// `cargo xtask test` ends with one line per skipped group.
pub fn skip(test: &str, reason: &str) {
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{test} cannot run here ({reason}) and CI=true forbids skipping"
    );
    eprintln!("SKIP {test}: {reason}");
    record_skip(test, reason);
}

/// Appends `<test binary>\t<test>\t<reason>` to the skip log, where there is one.
fn record_skip(test: &str, reason: &str) {
    let Some(log) = std::env::var_os("POOLSCOPE_SKIP_LOG") else {
        return;
    };
    let line = format!("{}\t{test}\t{reason}\n", binary_name());
    append_to_log(&log, &line, "the skip");
}

/// Appends `line` to the log at `log` (the skip log, the scorecard's); a failure is
/// said on stderr, naming `what` was not recorded, and fails no test.
pub(crate) fn append_to_log(log: &std::ffi::OsStr, line: &str, what: &str) {
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .and_then(|mut file| file.write_all(line.as_bytes()));
    if let Err(error) = written {
        eprintln!(
            "could not record {what} in {}: {error}",
            log.to_string_lossy()
        );
    }
}

/// The running test binary's name (`requests` of target/<profile>/deps/requests-<hash>).
pub fn binary_name() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.file_stem()?.to_string_lossy().into_owned()))
        .map(|stem| match stem.rsplit_once('-') {
            Some((name, _hash)) => name.to_owned(),
            None => stem,
        })
        .unwrap_or_default()
}

/// Directory of the built binaries (target/<profile>), from the test executable's path.
pub fn bin_dir() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    // target/<profile>/deps/<test>-<hash>
    exe.parent()
        .and_then(|deps| deps.parent())
        .map(PathBuf::from)
        .context("test executable has no target directory")
}

pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Every `.rs` file under `dir`, recursively, appended to `files`.
pub fn rust_files(dir: &Path, files: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, files)?;
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            files.push(path);
        }
    }
    Ok(())
}

/// A free port below 10000 on all interfaces, for servers whose port must fit a short
/// field (see [`servers::Options`]'s `any_address`).
pub fn free_short_port() -> anyhow::Result<u16> {
    // Spread over the range so that concurrent runs rarely try the same ports.
    let start = 2000 + (std::process::id() % 7000) as u16;
    (start..10_000)
        .chain(2000..start)
        .find(|port| {
            TcpListener::bind(("0.0.0.0", *port)).is_ok()
                && TcpListener::bind(("127.0.0.1", *port)).is_ok()
        })
        .context("no free port below 10000")
}

/// Polls `check` every 50 ms until it is true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if check() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        sleep(Duration::from_millis(50));
    }
}

/// Scrapes until `check` holds (10 s at most); the last scrape, or an error with it
/// that ends with where the check is (a log cut to its tail still names it).
#[track_caller]
pub fn scrape_until(
    poolscope: &Poolscope,
    mut check: impl FnMut(&Metrics) -> bool,
) -> anyhow::Result<Metrics> {
    const SETTLE: Duration = Duration::from_secs(10);
    let caller = std::panic::Location::caller();
    let mut last = Metrics::default();
    let ok = wait_until(SETTLE, || match poolscope.scrape() {
        Ok(metrics) => {
            let done = check(&metrics);
            last = metrics;
            done
        }
        Err(_) => false,
    });
    anyhow::ensure!(
        ok,
        "condition not met within {SETTLE:?}; last scrape:\n{}\n\
         (the condition of {caller} was not met within {SETTLE:?})",
        last.text
    );
    Ok(last)
}

/// Whether `service`'s count of requests has settled on the `made` requests of a load
/// that stopped: none in flight and at least `made` counted. A request counts when it
/// ends, at its connection's next request or close, and the server closes a little
/// after the client has its answer: `requests_in_flight` 0 alone let a scrape fall in
/// between and count one request short (1 of 6 runs in a 6.1 guest). A shortfall
/// fails the caller's `scrape_until` with the last scrape; an excess, its comparison.
pub fn requests_settled(metrics: &Metrics, service: &str, made: u64) -> bool {
    let service = [("service", service)];
    metrics.value("poolscope_requests_in_flight", &service) == Some(0.0)
        && metrics.value("poolscope_requests_total", &service) >= Some(made as f64)
}

/// Serializes the timing tests of one test binary: they share two CPUs.
pub fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// A command that runs `binary` through `wrapper` (a command and its arguments that
/// execs or forks what follows them), or directly when `wrapper` is empty.
fn wrapped(wrapper: &[impl AsRef<std::ffi::OsStr>], binary: &Path) -> Command {
    match wrapper.split_first() {
        Some((program, args)) => {
            let mut command = Command::new(program);
            command.args(args).arg(binary);
            command
        }
        None => Command::new(binary),
    }
}

/// A network namespace of the test's own (`ip netns add`), with its loopback up, as a
/// Kubernetes pod has; deleted when dropped.
pub struct Netns {
    name: String,
}

impl Netns {
    pub fn new(tag: &str) -> anyhow::Result<Self> {
        let name = format!("poolscope-{tag}-{}", std::process::id());
        // Left over by a killed run of the same pid: start afresh.
        if Path::new("/run/netns").join(&name).exists() {
            let _ = Command::new("ip").args(["netns", "delete", &name]).status();
        }
        let namespace = Self { name };
        for args in [
            &["netns", "add", namespace.name()][..],
            &["-n", namespace.name(), "link", "set", "lo", "up"],
        ] {
            let status = Command::new("ip")
                .args(args)
                .status()
                .context("running ip")?;
            if !status.success() {
                bail!("ip {} failed: {status}", args.join(" "));
            }
        }
        Ok(namespace)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `work` on a thread inside the namespace (threads it starts are inside too,
    /// and sockets it opens stay there).
    pub fn run<T: Send + 'static>(
        &self,
        work: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
    ) -> anyhow::Result<T> {
        use std::os::fd::AsRawFd as _;
        let file = std::fs::File::open(format!("/run/netns/{}", self.name))?;
        std::thread::spawn(move || {
            // SAFETY: setns on this thread only, with a namespace fd we hold open.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(std::io::Error::last_os_error().into());
            }
            work()
        })
        .join()
        .map_err(|_| anyhow::anyhow!("a thread in the namespace panicked"))?
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.name])
            .status();
    }
}

/// A running `poolscope` process; killed when dropped, after a last scrape that fails
/// the test if a recount corrected a gauge (a lost update in the kernel's counts),
/// unless the test [`expects`](Poolscope::expect_corrections) it.
pub struct Poolscope {
    child: Child,
    pub port: u16,
    pub config_path: PathBuf,
    corrections_expected: bool,
    _dir: tempfile::TempDir,
}

impl Poolscope {
    /// Starts poolscope with `config` (TOML) and waits until it serves.
    pub fn start(config: &str) -> anyhow::Result<Self> {
        Self::start_wrapped(config, &[])
    }

    /// Like `start`, through a wrapper command that execs it (e.g. setpriv ...).
    pub fn start_wrapped(config: &str, wrapper: &[String]) -> anyhow::Result<Self> {
        Self::launch(config, wrapper, &[], |poolscope| {
            poolscope.get("/healthz").is_ok()
        })
    }

    /// Like `start`, with more command-line arguments (e.g. `--web.config.file`), and
    /// serving once `ready` says so (a plain-HTTP GET of /healthz may not be
    /// answered then).
    pub fn start_with(
        config: &str,
        args: &[String],
        ready: impl FnMut(&Self) -> bool,
    ) -> anyhow::Result<Self> {
        Self::launch(config, &[], args, ready)
    }

    fn launch(
        config: &str,
        wrapper: &[String],
        args: &[String],
        mut ready: impl FnMut(&Self) -> bool,
    ) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let config_path = dir.path().join("poolscope.toml");
        std::fs::write(&config_path, config)?;
        let port = free_port()?;
        let binary = bin_dir()?.join("poolscope");
        let mut command = wrapped(wrapper, &binary);
        let child = command
            .arg("--config.file")
            .arg(&config_path)
            .arg("--web.listen-address")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--log.level")
            .arg("info")
            .args(args)
            .stderr(Stdio::piped())
            .spawn()
            .context("starting poolscope (build it first: cargo build --bins)")?;
        let mut poolscope = Self {
            child,
            port,
            config_path,
            corrections_expected: false,
            _dir: dir,
        };
        let serving = wait_until(Duration::from_secs(30), || {
            ready(&poolscope) || !matches!(poolscope.child.try_wait(), Ok(None))
        });
        if !serving || !ready(&poolscope) {
            let log = poolscope.stop_and_log();
            bail!("poolscope did not serve within 30 s:\n{log}");
        }
        Ok(poolscope)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// For a test that makes the gauges drift on purpose: its recounts' corrections
    /// do not fail it.
    pub fn expect_corrections(&mut self) {
        self.corrections_expected = true;
    }

    /// Each gauge a recount corrected, with how far (none if poolscope no longer
    /// serves).
    fn corrections(&self) -> Vec<(String, f64)> {
        let Ok(metrics) = self.scrape() else {
            return Vec::new();
        };
        metrics
            .samples
            .iter()
            .filter(|sample| {
                sample.name == "poolscope_recount_corrections_total" && sample.value != 0.0
            })
            .map(|sample| (format!("{:?}", sample.labels), sample.value))
            .collect()
    }

    /// GET `path`; the body of a 200 response.
    pub fn get(&self, path: &str) -> anyhow::Result<String> {
        profiles::http_get(self.port, path)?.text(path)
    }

    pub fn scrape(&self) -> anyhow::Result<Metrics> {
        Ok(Metrics::parse(&self.get("/metrics")?))
    }

    /// Sends `signal` to the exporter.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(self.child.id() as i32, signal) };
    }

    /// Waits for the exporter to exit (after a signal); its exit code and log.
    pub fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<(Option<i32>, String)> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok((status.code(), self.read_log()));
            }
            if Instant::now() > deadline {
                bail!("poolscope still running after {timeout:?}");
            }
            sleep(Duration::from_millis(20));
        }
    }

    fn read_log(&mut self) -> String {
        let mut log = String::new();
        if let Some(mut stderr) = self.child.stderr.take() {
            let _ = stderr.read_to_string(&mut log);
        }
        log
    }

    /// Kills the exporter and returns what it logged.
    pub fn stop_and_log(&mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.read_log()
    }
}

impl Drop for Poolscope {
    fn drop(&mut self) {
        let corrections = if self.corrections_expected || std::thread::panicking() {
            Vec::new()
        } else {
            self.corrections()
        };
        let _ = self.child.kill();
        let _ = self.child.wait();
        assert!(
            corrections.is_empty(),
            "poolscope's recount corrected a gauge (an update the kernel lost): {corrections:?}"
        );
    }
}

/// A running `testserver`; killed when dropped.
pub struct TestServer {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub port: u16,
}

impl TestServer {
    pub fn start(backlog: u32) -> anyhow::Result<Self> {
        Self::launch(&[], backlog)
    }

    /// In network namespace `netns`: connect to it from [`Netns::run`].
    pub fn start_in(netns: &Netns, backlog: u32) -> anyhow::Result<Self> {
        Self::launch(&["ip", "netns", "exec", netns.name()], backlog)
    }

    fn launch(wrapper: &[&str], backlog: u32) -> anyhow::Result<Self> {
        let mut child = wrapped(wrapper, &bin_dir()?.join("testserver"))
            .arg(backlog.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting testserver")?;
        let stdin = child.stdin.take().context("no stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("no stdout")?);
        let mut server = Self {
            child,
            stdin,
            stdout,
            port: 0,
        };
        server.port = parse_port(&server.line()?, "testserver")?;
        Ok(server)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn line(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        Ok(line.trim().to_owned())
    }

    /// Sends one command and returns the server's answer.
    pub fn command(&mut self, command: &str) -> anyhow::Result<String> {
        writeln!(self.stdin, "{command}")?;
        self.stdin.flush()?;
        self.line()
    }

    /// Tells the server to exit and reaps it.
    pub fn exit(mut self) -> anyhow::Result<()> {
        writeln!(self.stdin, "exit")?;
        self.stdin.flush()?;
        self.child.wait()?;
        Ok(())
    }

    pub fn connect(&self) -> anyhow::Result<TcpStream> {
        Ok(TcpStream::connect(("127.0.0.1", self.port))?)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One parsed sample.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// Whether it is named `name` and its labels include `labels`.
    fn is(&self, name: &str, labels: &[(&str, &str)]) -> bool {
        self.name == name
            && labels
                .iter()
                .all(|(k, v)| self.labels.iter().any(|(sk, sv)| sk == k && sv == v))
    }
}

/// A parsed scrape (text format; label values without escapes are enough here).
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    pub samples: Vec<Sample>,
    pub text: String,
}

impl Metrics {
    pub fn parse(text: &str) -> Self {
        let samples = text
            .lines()
            .filter(|line| !line.starts_with('#') && !line.is_empty())
            .filter_map(|line| {
                let (series, value) = line.rsplit_once(' ')?;
                let (name, labels) = match series.split_once('{') {
                    Some((name, rest)) => (name, rest.strip_suffix('}')?),
                    None => (series, ""),
                };
                let labels = labels
                    .split("\",")
                    .filter(|pair| !pair.is_empty())
                    .filter_map(|pair| {
                        let (key, value) = pair.split_once("=\"")?;
                        Some((key.to_owned(), value.trim_end_matches('"').to_owned()))
                    })
                    .collect();
                Some(Sample {
                    name: name.to_owned(),
                    labels,
                    value: value.parse().ok()?,
                })
            })
            .collect();
        Self {
            samples,
            text: text.to_owned(),
        }
    }

    /// The entries of the kernel map that holds the request backend's connections:
    /// `CONNS` (syscall backend) or `SOCK_CONNS` (socket backend), whichever the
    /// scrape has.
    pub fn connection_entries(&self) -> Option<f64> {
        ["CONNS", "SOCK_CONNS"]
            .into_iter()
            .find_map(|map| self.value("poolscope_map_entries", &[("map", map)]))
    }

    /// The first sample named `name` whose labels include `labels`.
    fn sample(&self, name: &str, labels: &[(&str, &str)]) -> Option<&Sample> {
        self.samples.iter().find(|s| s.is(name, labels))
    }

    /// Every sample named `name` whose labels include `labels`: its labels and value.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = (&'a [(String, String)], f64)> + 'a {
        self.samples
            .iter()
            .filter(move |s| s.is(name, labels))
            .map(|s| (s.labels.as_slice(), s.value))
    }

    /// The sum of every sample named `name` whose labels include `labels`; 0 if none.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).map(|(_, value)| value).sum()
    }

    /// The value of the one sample named `name` whose labels include `labels`.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.sample(name, labels).map(|s| s.value)
    }

    /// Label `key` of the one sample named `name` whose labels include `labels`.
    pub fn label(&self, name: &str, labels: &[(&str, &str)], key: &str) -> Option<&str> {
        self.sample(name, labels)?
            .labels
            .iter()
            .find_map(|(k, v)| (k == key).then_some(v.as_str()))
    }

    /// The mean of histogram `name` (its `_sum` over its `_count`) for the series whose
    /// labels include `labels`; `None` without observations.
    pub fn histogram_mean(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let sum = self.value(&format!("{name}_sum"), labels)?;
        let count = self.value(&format!("{name}_count"), labels)?;
        (count > 0.0).then(|| sum / count)
    }

    /// True if any sample carries label `key` = `value`.
    pub fn has_label(&self, key: &str, value: &str) -> bool {
        self.samples
            .iter()
            .any(|s| s.labels.iter().any(|(k, v)| k == key && v == value))
    }
}

/// A config that watches exactly these pids as `service`.
pub fn pids_config(service: &str, pids: &[u32]) -> String {
    let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
    let service = service.replace('\\', "\\\\").replace('"', "\\\"");
    format!(
        "[discovery]\nrescan_interval = \"500ms\"\n[[targets]]\nservice = \"{service}\"\npids = [{}]\n",
        pids.join(", ")
    )
}

/// [`pids_config`] with the request backend forced.
pub fn backend_config(backend: &str, service: &str, pids: &[u32]) -> String {
    format!(
        "[probes]\nbackend = \"{backend}\"\n{}",
        pids_config(service, pids)
    )
}

/// A running `poolserver` (a pool of `workers` with a fixed service time); killed
/// when dropped.
pub struct PoolServer {
    child: Child,
    /// The server's own pid: the child's, or the wrapper's child's.
    pid: u32,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    pub port: u16,
}

const LOCALHOST: Ipv4Addr = Ipv4Addr::LOCALHOST;

/// What `poolserver` measured itself.
#[derive(Clone, Copy, Debug)]
pub struct Served {
    pub count: u64,
    pub mean: Duration,
    pub p50: Duration,
}

impl PoolServer {
    pub fn start(workers: u32, service: Duration) -> anyhow::Result<Self> {
        Self::start_styled(workers, service, "plain")
    }

    /// With one of the server's `style`s (see `poolserver.rs`).
    pub fn start_styled(workers: u32, service: Duration, style: &str) -> anyhow::Result<Self> {
        Self::launch(&[], workers, service, style, (0, LOCALHOST))
    }

    /// Bound to `address` and `port`, so that two servers share a port in one
    /// namespace on two addresses.
    pub fn start_at(
        address: Ipv4Addr,
        port: u16,
        workers: u32,
        service: Duration,
    ) -> anyhow::Result<Self> {
        Self::launch(&[], workers, service, "plain", (port, address))
    }

    /// Through a wrapper command that execs it (`setpriv …`) or forks it once
    /// (`unshare --pid --fork`); its `pid()` is the server's either way (the forked
    /// child's, as the host numbers it).
    pub fn start_wrapped(
        wrapper: &[&str],
        workers: u32,
        service: Duration,
    ) -> anyhow::Result<Self> {
        Self::launch(wrapper, workers, service, "plain", (0, LOCALHOST))
    }

    /// In network namespace `netns` on a given `port`, as a pod's server is.
    pub fn start_in(
        netns: &Netns,
        port: u16,
        workers: u32,
        service: Duration,
    ) -> anyhow::Result<Self> {
        let wrapper = ["ip", "netns", "exec", netns.name()];
        Self::launch(&wrapper, workers, service, "plain", (port, LOCALHOST))
    }

    fn launch(
        wrapper: &[&str],
        workers: u32,
        service: Duration,
        style: &str,
        (port, address): (u16, Ipv4Addr),
    ) -> anyhow::Result<Self> {
        let binary = bin_dir()?.join("poolserver");
        let mut command = wrapped(wrapper, &binary);
        let mut child = command
            .arg(workers.to_string())
            .arg(service.as_micros().to_string())
            .arg(style)
            .arg(port.to_string())
            .arg(address.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .context("starting poolserver")?;
        let stdin = child.stdin.take().context("no stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("no stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let port = parse_port(&line, "poolserver")?;
        // Serving, so a wrapper that forks has forked it (and the server itself
        // starts threads, not processes).
        let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", child.id()))?;
        let pid = match children.split_whitespace().next() {
            Some(forked) => forked.parse()?,
            None => child.id(),
        };
        Ok(Self {
            child,
            pid,
            stdin: Some(stdin),
            stdout,
            port,
        })
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Stops serving and returns the server's own count and service times.
    pub fn finish(mut self) -> anyhow::Result<Served> {
        drop(self.stdin.take());
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        let numbers: Vec<u64> = line
            .trim()
            .strip_prefix("served ")
            .with_context(|| format!("poolserver said {line:?}"))?
            .split(' ')
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        let [count, mean, p50] = numbers[..] else {
            bail!("poolserver said {line:?}");
        };
        Ok(Served {
            count,
            mean: Duration::from_nanos(mean),
            p50: Duration::from_nanos(p50),
        })
    }
}

impl Drop for PoolServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A test program of this crate (`threadpool`, `spinners`) that reports on stdout and
/// runs until its stdin closes; killed when dropped.
pub struct Program {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Program {
    pub fn start(name: &str, args: &[String]) -> anyhow::Result<Self> {
        Self::start_path(&bin_dir()?.join(name), args)
    }

    /// A test program at `path` (a copy of one, e.g. stripped).
    pub fn start_path(path: &Path, args: &[String]) -> anyhow::Result<Self> {
        let mut child = Command::new(path)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", path.display()))?;
        let stdin = child.stdin.take().context("no stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("no stdout")?);
        Ok(Self {
            child,
            stdin: Some(stdin),
            stdout,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The rest of the next output line that starts with `prefix` and a space.
    pub fn line(&mut self, prefix: &str) -> anyhow::Result<String> {
        let mut line = String::new();
        loop {
            line.clear();
            if self.stdout.read_line(&mut line)? == 0 {
                bail!("program ended before printing {prefix:?}");
            }
            if let Some(rest) = line.trim_end().strip_prefix(prefix) {
                return Ok(rest.trim_start().to_owned());
            }
        }
    }

    /// Writes `line` and a newline to its stdin.
    pub fn send(&mut self, line: &str) -> anyhow::Result<()> {
        let stdin = self.stdin.as_mut().context("stdin already closed")?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        Ok(())
    }

    /// Closes its stdin (the program stops) and returns the line that starts with `prefix`.
    pub fn finish(&mut self, prefix: &str) -> anyhow::Result<String> {
        drop(self.stdin.take());
        self.line(prefix)
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The port of a test program's first line, `port <n>`.
pub fn parse_port(line: &str, program: &str) -> anyhow::Result<u16> {
    line.trim()
        .strip_prefix("port ")
        .and_then(|port| port.parse().ok())
        .with_context(|| format!("{program} said {line:?}"))
}

/// Parses a comma-separated list of tids.
pub fn parse_tids(list: &str) -> anyhow::Result<Vec<u32>> {
    list.split(',')
        .map(|tid| tid.trim().parse().with_context(|| format!("tid {tid:?}")))
        .collect()
}

/// /proc/<pid>/task/<tid>/schedstat: ns on CPU, ns waiting in the run queue, and
/// the number of times it went on a CPU.
pub fn schedstat(pid: u32, tid: u32) -> anyhow::Result<(u64, u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat"))?;
    let mut fields = text.split_whitespace().map(str::parse::<u64>);
    match (fields.next(), fields.next(), fields.next()) {
        (Some(Ok(running)), Some(Ok(runnable)), Some(Ok(slices))) => {
            Ok((running, runnable, slices))
        }
        _ => bail!("schedstat of {tid}: {text:?}"),
    }
}

/// The time the hypervisor took from `cpu` since boot (`steal` in `/proc/stat`), in
/// seconds. Where the kernel accounts it (`CONFIG_PARAVIRT_TIME_ACCOUNTING`), schedstat's
/// time on CPU leaves it out, while the time between two `sched_switch` events
/// includes it: a thread "running" on a vCPU the host has paused is still on that CPU
/// for everyone in the guest.
pub fn cpu_steal_seconds(cpu: usize) -> anyhow::Result<f64> {
    let text = std::fs::read_to_string("/proc/stat")?;
    let name = format!("cpu{cpu}");
    let line = text
        .lines()
        .find(|line| line.split_whitespace().next() == Some(name.as_str()))
        .with_context(|| format!("no {name} line in /proc/stat"))?;
    // cpuN user nice system idle iowait irq softirq steal ...
    let steal: u64 = line
        .split_whitespace()
        .nth(8)
        .with_context(|| format!("no steal field in {line:?}"))?
        .parse()
        .with_context(|| format!("steal field of {line:?}"))?;
    // SAFETY: sysconf reads a constant of the C library.
    let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    anyhow::ensure!(
        ticks_per_second > 0,
        "sysconf(_SC_CLK_TCK) = {ticks_per_second}"
    );
    Ok(steal as f64 / ticks_per_second as f64)
}

/// One line of poolscope's `/debug/threads`.
#[derive(Clone, Debug, PartialEq)]
pub struct ThreadRow {
    pub tid: u32,
    pub service: String,
    pub pool: String,
    pub activity: String,
    /// The requests the kernel says the thread is serving now.
    pub serving: u32,
    pub running: f64,
    pub runnable: f64,
    /// The peer of the socket the thread waits on now (`-`: none).
    pub waiting_on: String,
}

pub fn parse_debug_threads(text: &str) -> anyhow::Result<Vec<ThreadRow>> {
    text.lines()
        .skip(1)
        .map(|line| {
            let fields: Vec<&str> = line.split('\t').collect();
            let [
                tid,
                service,
                pool,
                activity,
                serving,
                running,
                runnable,
                waiting_on,
            ] = fields[..]
            else {
                bail!("/debug/threads line {line:?}");
            };
            Ok(ThreadRow {
                tid: tid.parse()?,
                service: service.to_owned(),
                pool: pool.to_owned(),
                activity: activity.to_owned(),
                serving: serving.parse()?,
                running: running.parse()?,
                runnable: runnable.parse()?,
                waiting_on: waiting_on.to_owned(),
            })
        })
        .collect()
}

/// Waits (10 s at most) until poolscope follows each (tid, pool) of `threads` in
/// that pool (`/debug/threads`).
pub fn wait_followed(poolscope: &Poolscope, threads: &[(u32, &str)]) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    let followed = wait_until(Duration::from_secs(10), || {
        rows = poolscope
            .get("/debug/threads")
            .and_then(|text| parse_debug_threads(&text))
            .unwrap_or_default();
        threads
            .iter()
            .all(|(tid, pool)| rows.iter().any(|r| r.tid == *tid && r.pool == *pool))
    });
    anyhow::ensure!(
        followed,
        "threads {threads:?} not followed in their pools: {rows:?}"
    );
    Ok(())
}

/// The calling thread's kernel tid.
pub fn gettid() -> i64 {
    // SAFETY: gettid takes no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) }
}

/// Restricts the calling thread to `cpu`.
pub fn pin_to(cpu: usize) -> std::io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(std::io::Error::other(format!("no CPU {cpu}")));
    }
    // SAFETY: an all-zero cpu_set_t is the empty set; `cpu` was checked against
    // CPU_SETSIZE, and sched_setaffinity(0, ...) applies to the calling thread only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Thread names (/proc/PID/task/TID/comm) of `pids` and how many threads carry each.
pub fn thread_names(pids: &[u32]) -> anyhow::Result<std::collections::BTreeMap<String, usize>> {
    let mut names = std::collections::BTreeMap::new();
    for pid in pids {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
            .with_context(|| format!("listing the threads of {pid}"))?;
        for task in tasks.flatten() {
            // A thread may exit between the listing and the read.
            if let Ok(comm) = std::fs::read_to_string(task.path().join("comm")) {
                *names.entry(comm.trim_end().to_owned()).or_default() += 1;
            }
        }
    }
    Ok(names)
}

/// Starts poolscope with `config` and waits until it watches all of `pids` as `service`.
pub fn watch_with(config: &str, service: &str, pids: &[u32]) -> anyhow::Result<Poolscope> {
    let poolscope = Poolscope::start(config)?;
    scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", service)]) == Some(pids.len() as f64)
    })?;
    Ok(poolscope)
}

/// Starts `count` threads named `<prefix>-1` … `<prefix>-<count>`, each running what
/// `work(index)` returns, and returns their kernel tids in index order once all run
/// (std names a thread from inside it, so its comm is set when its tid is reported).
pub fn start_named_workers<F>(
    count: usize,
    prefix: &str,
    mut work: impl FnMut(usize) -> std::io::Result<F>,
) -> std::io::Result<Vec<i64>>
where
    F: FnOnce() + Send + 'static,
{
    let (started, tids) = std::sync::mpsc::channel::<(usize, i64)>();
    for index in 1..=count {
        let body = work(index)?;
        let started = started.clone();
        std::thread::Builder::new()
            .name(format!("{prefix}-{index}"))
            .spawn(move || {
                let _ = started.send((index, gettid()));
                drop(started);
                body();
            })?;
    }
    drop(started);
    let mut tids: Vec<(usize, i64)> = tids.iter().collect();
    tids.sort_unstable();
    Ok(tids.into_iter().map(|(_, tid)| tid).collect())
}

/// The `workers <tid>,<tid>,…` line a test program prints (read by [`parse_tids`]).
pub fn workers_line(tids: &[i64]) -> String {
    let tids: Vec<String> = tids.iter().map(i64::to_string).collect();
    format!("workers {}", tids.join(","))
}

/// Resident memory of `pid` in kB (`VmRSS`).
pub fn rss_kb(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmRSS in /proc/{pid}/status"))
}

/// Names the calling thread (`PR_SET_NAME` takes any bytes but NUL).
pub fn name_this_thread(name: &[u8]) -> std::io::Result<()> {
    let mut bytes = name.to_vec();
    bytes.push(0);
    // SAFETY: a NUL-terminated buffer that outlives the call; the kernel copies at
    // most 16 bytes of it.
    if unsafe { libc::prctl(libc::PR_SET_NAME, bytes.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Blocks until stdin closes: a test program serves until the test closes it.
pub fn wait_for_stdin_close() -> std::io::Result<()> {
    for line in std::io::stdin().lock().lines() {
        line?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{narrowed, release_at_least};

    #[test]
    fn test_backends_narrow_to_known_names_and_never_to_none() {
        let available = ["tcp", "syscall"];
        assert_eq!(
            narrowed(&available, "tcp, syscall"),
            Ok(vec!["tcp", "syscall"])
        );
        assert_eq!(narrowed(&available, "syscall,socket"), Ok(vec!["syscall"]));
        // A typo would otherwise test nothing and pass.
        assert!(narrowed(&available, "bogus").is_err_and(|e| e.contains("\"bogus\"")));
        assert!(narrowed(&available, "tcp,sockte").is_err());
        assert!(narrowed(&available, "socket").is_err_and(|e| e.contains("no backend this")));
    }

    #[test]
    fn kernel_releases_compare_by_major_then_minor() {
        assert!(!release_at_least("6.1.0-50-amd64\n", (6, 3)));
        assert!(release_at_least("6.3.0", (6, 3)));
        assert!(release_at_least("6.18.44-fc-v669", (6, 3)));
        assert!(release_at_least("7.0-rc1", (6, 3)));
        assert!(!release_at_least("5.15.0-91-generic", (6, 3)));
        assert!(!release_at_least("", (6, 3)));
    }
}
