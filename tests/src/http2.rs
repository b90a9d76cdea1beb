//! Cleartext HTTP/2 (h2c, prior knowledge) for tests/tests/http2.rs, each side with
//! its own count of what it did, the truth the tests compare poolscope's with:
//! - [`h2load`] (nghttp2-client) and its report ([`H2Load`]): requests that succeeded,
//!   failed (a stream reset), its mean time per request;
//! - [`GrpcServer`] and [`GrpcClient`]: tests/http2/grpc_server.py and grpc_client.py
//!   (grpcio, no generated code), a thread pool of W workers and a closed loop of C
//!   calls in flight on one channel, which reports its calls and their latencies;
//! - [`h2raw`] and [`OldConnection`]: tests/http2/h2raw.py, the `h2` library's bytes
//!   on a raw socket (resets, closes under open streams, hostile input, a connection
//!   older than poolscope), which reports the streams the server answered;
//!   [`Hostile`] writes its hostile input also with the standard library alone;
//! - [`PlainH2Server`] and [`plain_streams`]: tests/src/bin/h2server.rs and a client
//!   here, both the standard library alone (they run in the test guests, which have
//!   no Python, nginx or nghttp2), each counting its streams; the server with a
//!   thread per stream or a pool of workers that counts the streams it has queued;
//! - [`NodeH2Server`]: tests/http2/node_server.js, Node.js's HTTP/2 server, which
//!   counts the streams it answered.
//!
//! The Python scripts run under Debian's `/usr/bin/python3`, the interpreter that
//! python3-grpcio and python3-h2 install for (a `python3` earlier on PATH, pyenv's,
//! has neither).
use std::{
    io::{Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::Duration,
};

use anyhow::{Context as _, bail};

use crate::{Program, servers::parse_time, wait_until};

/// Debian's interpreter, which has python3-grpcio and python3-h2.
pub const PYTHON: &str = "/usr/bin/python3";

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("http2")
        .join(name)
}

/// What h2load reported.
#[derive(Clone, Debug, PartialEq)]
pub struct H2Load {
    /// `Application protocol:` (`h2c`, or `http/1.1` with `--h1`).
    pub protocol: String,
    pub total: u64,
    pub done: u64,
    /// Requests answered in full (the response's END_STREAM).
    pub succeeded: u64,
    /// Requests that did not succeed: `errored` (a stream reset, a connection lost)
    /// plus `timeout`.
    pub failed: u64,
    pub errored: u64,
    pub timeout: u64,
    /// Responses with a 2xx, 4xx and 5xx status.
    pub status_2xx: u64,
    pub status_4xx: u64,
    pub status_5xx: u64,
    /// `time for request` mean: from the request's HEADERS sent to its last byte.
    pub mean_request: Duration,
    /// `finished in`.
    pub seconds: f64,
}

/// Runs `h2load -n requests -c clients -m streams` (cleartext HTTP/2 with prior
/// knowledge: h2load's default for `http://`) against 127.0.0.1:`port` + `path`,
/// pinned to the last CPU as `servers::wrk` is.
pub fn h2load(
    port: u16,
    path: &str,
    requests: u64,
    clients: u32,
    streams: u32,
) -> anyhow::Result<H2Load> {
    h2load_paths(port, &[path], requests, clients, streams)
}

/// [`h2load`] of several paths: each client asks for them in turn.
pub fn h2load_paths(
    port: u16,
    paths: &[&str],
    requests: u64,
    clients: u32,
    streams: u32,
) -> anyhow::Result<H2Load> {
    let mut args = vec![
        format!("-n{requests}"),
        format!("-c{clients}"),
        format!("-m{streams}"),
    ];
    args.extend(
        paths
            .iter()
            .map(|path| format!("http://127.0.0.1:{port}{path}")),
    );
    run_h2load(&args)
}

/// [`h2load`] of gRPC unary calls to `method` (`/package.Service/Method`), each
/// carrying the one gRPC message `message` (uncompressed).
pub fn h2load_grpc(
    port: u16,
    method: &str,
    message: &[u8],
    requests: u64,
    clients: u32,
    streams: u32,
) -> anyhow::Result<H2Load> {
    let mut body = tempfile::NamedTempFile::new().context("a file for h2load's request body")?;
    let length = u32::try_from(message.len()).context("a gRPC message over 4 GiB")?;
    body.write_all(&[0])
        .and_then(|()| body.write_all(&length.to_be_bytes()))
        .and_then(|()| body.write_all(message))
        .context("writing h2load's request body")?;
    run_h2load(&[
        format!("-n{requests}"),
        format!("-c{clients}"),
        format!("-m{streams}"),
        "-d".to_owned(),
        body.path().display().to_string(),
        "-Hcontent-type: application/grpc".to_owned(),
        "-Hte: trailers".to_owned(),
        format!("http://127.0.0.1:{port}{method}"),
    ])
}

/// [`h2load`] over HTTP/1.1 (`--h1`: one request at a time per connection).
pub fn h2load_h1(port: u16, path: &str, requests: u64, clients: u32) -> anyhow::Result<H2Load> {
    run_h2load(&[
        "--h1".to_owned(),
        format!("-n{requests}"),
        format!("-c{clients}"),
        format!("http://127.0.0.1:{port}{path}"),
    ])
}

fn run_h2load(args: &[String]) -> anyhow::Result<H2Load> {
    let last_cpu = std::thread::available_parallelism().map_or(0, |n| n.get() - 1);
    let output = Command::new("taskset")
        .arg("-c")
        .arg(last_cpu.to_string())
        .arg("h2load")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running h2load (Debian package nghttp2-client)")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "h2load {} failed ({}):\n{stdout}{}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    parse_h2load(&stdout).with_context(|| format!("parsing h2load's output:\n{stdout}"))
}

/// Whether an h2c server on 127.0.0.1:`port` answers one `GET /` with a 2xx (the
/// readiness check of `servers::Kind::NginxH2c`).
pub fn h2c_answers(port: u16) -> anyhow::Result<()> {
    let result = h2load(port, "/", 1, 1, 1)?;
    anyhow::ensure!(
        result.protocol == "h2c" && result.succeeded == 1 && result.status_2xx == 1,
        "GET / over h2c: {result:?}"
    );
    Ok(())
}

/// The number before `word` in `text` (`4000 succeeded`).
fn count_before(text: &str, word: &str) -> anyhow::Result<u64> {
    let words: Vec<&str> = text.split([' ', ',']).filter(|w| !w.is_empty()).collect();
    let index = words
        .iter()
        .position(|w| *w == word)
        .with_context(|| format!("no {word:?} in {text:?}"))?;
    let number = index
        .checked_sub(1)
        .and_then(|i| words.get(i))
        .with_context(|| format!("nothing before {word:?} in {text:?}"))?;
    number
        .parse()
        .with_context(|| format!("{number:?} before {word:?} in {text:?}"))
}

/// Parses h2load's report.
pub fn parse_h2load(output: &str) -> anyhow::Result<H2Load> {
    let mut protocol = None;
    let mut requests = None;
    let mut statuses = None;
    let mut mean_request = None;
    let mut seconds = None;
    for line in output.lines() {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("Application protocol:") {
            protocol = Some(rest.trim().to_owned());
        } else if let Some(rest) = line.strip_prefix("requests:") {
            requests = Some((
                count_before(rest, "total")?,
                count_before(rest, "done")?,
                count_before(rest, "succeeded")?,
                count_before(rest, "failed")?,
                count_before(rest, "errored")?,
                count_before(rest, "timeout")?,
            ));
        } else if let Some(rest) = line.strip_prefix("status codes:") {
            statuses = Some((
                count_before(rest, "2xx")?,
                count_before(rest, "4xx")?,
                count_before(rest, "5xx")?,
            ));
        } else if let Some(rest) = line.strip_prefix("time for request:") {
            // min max mean sd +/-sd
            let mean = rest
                .split_whitespace()
                .nth(2)
                .with_context(|| format!("no mean in {line:?}"))?;
            mean_request = Some(parse_time(mean)?);
        } else if let Some(rest) = line.strip_prefix("finished in") {
            let time = rest
                .split(',')
                .next()
                .with_context(|| format!("no time in {line:?}"))?;
            seconds = Some(parse_time(time.trim())?.as_secs_f64());
        }
    }
    let (total, done, succeeded, failed, errored, timeout) =
        requests.context("no \"requests:\" line")?;
    let (status_2xx, status_4xx, status_5xx) = statuses.context("no \"status codes:\" line")?;
    Ok(H2Load {
        protocol: protocol.context("no \"Application protocol:\" line")?,
        total,
        done,
        succeeded,
        failed,
        errored,
        timeout,
        status_2xx,
        status_4xx,
        status_5xx,
        mean_request: mean_request.context("no \"time for request:\" line")?,
        seconds: seconds.context("no \"finished in\" line")?,
    })
}

/// The gRPC server of tests/http2/grpc_server.py: a ThreadPoolExecutor of `workers`
/// on 127.0.0.1; killed when dropped.
pub struct GrpcServer {
    program: Program,
    pub port: u16,
}

/// The calls each method of [`GrpcServer`] ran to their end (the handler returned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrpcServed {
    pub sleep: u64,
    pub stream: u64,
    pub abort: u64,
}

impl GrpcServer {
    /// Starts it and waits until its port accepts connections.
    pub fn start(workers: u32) -> anyhow::Result<Self> {
        Self::start_with(&[workers.to_string()])
    }

    /// Starts it announcing `SETTINGS_MAX_CONCURRENT_STREAMS` = `max_streams`.
    pub fn start_with_stream_limit(workers: u32, max_streams: u32) -> anyhow::Result<Self> {
        Self::start_with(&[workers.to_string(), max_streams.to_string()])
    }

    fn start_with(args: &[String]) -> anyhow::Result<Self> {
        let script = script("grpc_server.py");
        let mut argv = vec![script.display().to_string()];
        argv.extend_from_slice(args);
        let program = Program::start_path(Path::new(PYTHON), &argv)
            .context("starting the gRPC server (Debian package python3-grpcio)")?;
        Self::serving(program)
    }

    /// The Go server of tests/http2/grpc_server.go (grpc-go, a goroutine per call; its
    /// `Sleep`, and `Abort` failing with UNAVAILABLE), built from Debian's
    /// golang-google-grpc-dev.
    pub fn start_go() -> anyhow::Result<Self> {
        Self::start_go_with(&[])
    }

    /// [`Self::start_go`] announcing `SETTINGS_MAX_CONCURRENT_STREAMS` = `max_streams`.
    pub fn start_go_with_stream_limit(max_streams: u32) -> anyhow::Result<Self> {
        Self::start_go_with(&[max_streams.to_string()])
    }

    fn start_go_with(args: &[String]) -> anyhow::Result<Self> {
        let binary = crate::servers::build_go(
            include_str!("../http2/grpc_server.go"),
            Some(Path::new("/usr/share/gocode")),
        )
        .context(
            "building the Go gRPC server (Debian packages golang-go, golang-google-grpc-dev)",
        )?;
        let program = Program::start_path(&binary, args).context("starting the Go gRPC server")?;
        Self::serving(program)
    }

    /// Waits until `program`, started, says its port and accepts connections on it.
    fn serving(mut program: Program) -> anyhow::Result<Self> {
        let port: u16 = program
            .line("port")
            .context("the gRPC server did not start")?
            .parse()
            .context("the gRPC server's port")?;
        let accepting = wait_until(Duration::from_secs(10), || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        anyhow::ensure!(accepting, "the gRPC server does not accept on port {port}");
        Ok(Self { program, port })
    }

    pub fn pid(&self) -> u32 {
        self.program.pid()
    }

    /// The calls waiting in the Python server's executor queue for a worker, now.
    pub fn queued(&mut self) -> anyhow::Result<f64> {
        self.program.send("queued")?;
        Ok(self.program.line("queued")?.parse()?)
    }

    /// Stops it (closes its stdin: it stops with a grace period) and returns its
    /// counts.
    pub fn finish(mut self) -> anyhow::Result<GrpcServed> {
        let line = self.program.finish("served")?;
        let numbers: Vec<u64> = line
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("the gRPC server said \"served {line}\""))?;
        let [sleep, stream, abort] = numbers[..] else {
            bail!("the gRPC server said \"served {line}\"");
        };
        Ok(GrpcServed {
            sleep,
            stream,
            abort,
        })
    }
}

/// The server of tests/http2/h2c_upgrade_server.py: HTTP/2 reached by the HTTP/1.1
/// `Upgrade: h2c` request (which nginx does not take); killed when dropped.
pub struct UpgradeServer {
    program: Program,
    pub port: u16,
}

impl UpgradeServer {
    /// Starts it and waits until its port accepts connections; with `peek`, it peeks
    /// (`MSG_PEEK`) at what is queued before each read.
    pub fn start(peek: bool) -> anyhow::Result<Self> {
        let mut args = vec![script("h2c_upgrade_server.py").display().to_string()];
        if peek {
            args.push("--peek".to_owned());
        }
        let mut program = Program::start_path(Path::new(PYTHON), &args)
            .context("starting the h2c upgrade server (Debian package python3-h2)")?;
        let port: u16 = program
            .line("port")
            .context("the h2c upgrade server did not start (is python3-h2 installed?)")?
            .parse()
            .context("the h2c upgrade server's port")?;
        let accepting = wait_until(Duration::from_secs(10), || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        anyhow::ensure!(
            accepting,
            "the h2c upgrade server does not accept on port {port}"
        );
        Ok(Self { program, port })
    }

    pub fn pid(&self) -> u32 {
        self.program.pid()
    }

    /// Stops it and returns how many streams it answered.
    pub fn finish(mut self) -> anyhow::Result<u64> {
        let line = self.program.finish("served")?;
        line.trim()
            .parse()
            .with_context(|| format!("the h2c upgrade server said \"served {line}\""))
    }
}

/// `requests` GETs by one curl on one connection to `port`, the first an HTTP/1.1
/// `Upgrade: h2c` request (`--http2` over cleartext), the rest streams on the upgraded
/// connection. Returns the HTTP version of each answer and the connections curl made.
pub fn curl_upgrade(port: u16, requests: u32) -> anyhow::Result<(Vec<String>, u64)> {
    let mut args = vec![
        "--silent".to_owned(),
        "--http2".to_owned(),
        "--write-out".to_owned(),
        "%{http_version} %{http_code} %{num_connects}\\n".to_owned(),
    ];
    for request in 0..requests {
        args.push("--output".to_owned());
        args.push("/dev/null".to_owned());
        args.push(format!("http://127.0.0.1:{port}/{request}"));
    }
    let output = std::process::Command::new("curl")
        .args(&args)
        .output()
        .context("running curl")?;
    anyhow::ensure!(output.status.success(), "curl failed: {output:?}");
    let text = String::from_utf8_lossy(&output.stdout);
    let mut versions = Vec::new();
    let mut connections = 0;
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [version, code, connects] = fields[..] else {
            bail!("curl wrote {line:?}");
        };
        anyhow::ensure!(code == "200", "curl got {code}: {text}");
        versions.push(version.to_owned());
        connections += connects.parse::<u64>().context("curl's num_connects")?;
    }
    Ok((versions, connections))
}

/// How long a [`GrpcClient`] runs.
#[derive(Clone, Copy, Debug)]
pub enum Amount {
    /// New calls start for this long; those in flight then finish.
    Seconds(u64),
    /// Exactly this many calls.
    Calls(u64),
}

/// What grpc_client.py reported.
#[derive(Clone, Debug, PartialEq)]
pub struct GrpcResult {
    /// Calls the server ended with a status (OK, or Abort's: INVALID_ARGUMENT from
    /// grpcio, UNAVAILABLE from grpc-go): each
    /// one stream the server ended with END_STREAM.
    pub completed: u64,
    /// Of those, the ones with OK.
    pub ok: u64,
    /// Calls that ended otherwise (client-side errors).
    pub failed: u64,
    /// Response messages received.
    pub messages: u64,
    /// The sum of the completed calls' latencies, seconds.
    pub latency_sum: f64,
    /// From the first call's start to the last one's end, seconds.
    pub elapsed: f64,
    /// The first few failures' status codes.
    pub errors: Vec<String>,
}

impl GrpcResult {
    /// The mean number of calls in flight, by Little's law from the client's own
    /// timings.
    pub fn mean_in_flight(&self) -> f64 {
        self.latency_sum / self.elapsed
    }

    fn parse(json: &str) -> anyhow::Result<Self> {
        let value: serde_json::Value =
            serde_json::from_str(json).with_context(|| format!("not JSON: {json}"))?;
        let count = |key: &str| {
            value[key]
                .as_u64()
                .with_context(|| format!("no count {key:?} in {json}"))
        };
        let seconds = |key: &str| {
            value[key]
                .as_f64()
                .with_context(|| format!("no number {key:?} in {json}"))
        };
        Ok(Self {
            completed: count("completed")?,
            ok: count("ok")?,
            failed: count("failed")?,
            messages: count("messages")?,
            latency_sum: seconds("latency_sum")?,
            elapsed: seconds("elapsed")?,
            errors: value["errors"]
                .as_array()
                .map(|errors| errors.iter().map(ToString::to_string).collect())
                .unwrap_or_default(),
        })
    }
}

/// A running grpc_client.py: `concurrency` calls of `method` in flight on one
/// channel (one HTTP/2 connection); killed when dropped.
pub struct GrpcClient {
    program: Program,
}

impl GrpcClient {
    /// Starts it and waits until its channel is connected (before its first call).
    pub fn start(
        port: u16,
        method: &str,
        argument: u64,
        concurrency: u32,
        amount: Amount,
    ) -> anyhow::Result<Self> {
        let (mode, amount) = match amount {
            Amount::Seconds(seconds) => ("--seconds", seconds),
            Amount::Calls(calls) => ("--calls", calls),
        };
        let args = [
            script("grpc_client.py").display().to_string(),
            port.to_string(),
            method.to_owned(),
            argument.to_string(),
            concurrency.to_string(),
            mode.to_owned(),
            amount.to_string(),
        ];
        let mut program = Program::start_path(Path::new(PYTHON), &args)
            .context("starting the gRPC client (Debian package python3-grpcio)")?;
        program
            .line("running")
            .with_context(|| format!("the gRPC client did not connect to port {port}"))?;
        Ok(Self { program })
    }

    /// Waits for its end and returns its report.
    pub fn finish(mut self) -> anyhow::Result<GrpcResult> {
        GrpcResult::parse(&self.program.line("result")?)
    }

    /// Starts it and waits for its report.
    pub fn run(
        port: u16,
        method: &str,
        argument: u64,
        concurrency: u32,
        amount: Amount,
    ) -> anyhow::Result<GrpcResult> {
        Self::start(port, method, argument, concurrency, amount)?.finish()
    }
}

/// What h2raw.py reported of one connection.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RawResult {
    /// Streams the server ended (END_STREAM): the requests it answered.
    pub answered: u64,
    /// Streams the server reset (RST_STREAM).
    pub reset_by_server: u64,
    /// Streams the client reset (RST_STREAM) before the server answered them.
    pub reset_by_us: u64,
    /// Streams still open when the client closed the connection.
    pub abandoned: u64,
    /// Whether the server closed the connection (else the client did).
    pub server_closed: bool,
    /// The error code of the server's GOAWAY, if it sent one.
    pub goaway: Option<u64>,
}

impl RawResult {
    fn parse(json: &str) -> anyhow::Result<Self> {
        let value: serde_json::Value =
            serde_json::from_str(json).with_context(|| format!("not JSON: {json}"))?;
        let count = |key: &str| value[key].as_u64().unwrap_or(0);
        Ok(Self {
            answered: value["answered"]
                .as_u64()
                .with_context(|| format!("no \"answered\" in {json}"))?,
            reset_by_server: count("reset_by_server"),
            reset_by_us: count("reset_by_us"),
            abandoned: count("abandoned"),
            server_closed: value["server_closed"].as_bool().unwrap_or(false),
            goaway: value["goaway"].as_u64(),
        })
    }
}

/// Runs `h2raw.py MODE PORT ARGS…` to its end (see the script for the modes) and
/// returns its report.
pub fn h2raw(mode: &str, port: u16, args: &[String]) -> anyhow::Result<RawResult> {
    let output = Command::new(PYTHON)
        .arg(script("h2raw.py"))
        .arg(mode)
        .arg(port.to_string())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running h2raw.py (Debian package python3-h2)")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "h2raw.py {mode} {port} {} failed ({}):\n{stdout}{}",
            args.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let json = stdout
        .lines()
        .find_map(|line| line.strip_prefix("result "))
        .with_context(|| format!("h2raw.py {mode} printed no result:\n{stdout}"))?;
    RawResult::parse(json)
}

/// One hostile connection (h2raw.py's modes), written both by h2raw.py (the `h2`
/// library's bytes, for nginx) and by [`Hostile::run_plain`] (the standard library
/// alone, for [`PlainH2Server`] in the guests, which have no Python).
#[derive(Clone, Copy, Debug)]
pub enum Hostile {
    /// The preface, then 256 bytes of garbage.
    Garbage,
    /// The preface, SETTINGS, a HEADERS frame header announcing 16 MB, 4 KiB.
    Huge,
    /// A valid request, one byte per send().
    Bytewise,
    /// A valid request in two send()s, cut this far into its HEADERS frame header.
    Split(u8),
}

/// How long a hostile client waits for a server that neither answers nor closes.
const HOSTILE_SILENCE: Duration = Duration::from_millis(500);

impl Hostile {
    pub fn all() -> Vec<Self> {
        let mut all = vec![Self::Garbage, Self::Huge, Self::Bytewise];
        all.extend((0..=9).map(Self::Split));
        all
    }

    /// Through h2raw.py.
    pub fn run(self, port: u16) -> anyhow::Result<RawResult> {
        match self {
            Self::Garbage => h2raw("garbage", port, &[]),
            Self::Huge => h2raw("huge", port, &[]),
            Self::Bytewise => h2raw("bytewise", port, &[]),
            Self::Split(offset) => h2raw("split", port, &[offset.to_string()]),
        }
    }

    /// The same bytes' shapes written here: the request is [`PlainConnection`]'s, the
    /// garbage a fixed pseudo-random sequence. A server that neither answers nor
    /// closes is left after [`HOSTILE_SILENCE`].
    pub fn run_plain(self, port: u16) -> anyhow::Result<RawResult> {
        let mut socket = PlainConnection::connect(port)?;
        socket.set_nodelay(true)?;
        let start = PlainConnection::greeting();
        let request = PlainConnection::request_frame(1);
        let mut reader = RawReader::default();
        match self {
            Self::Garbage => {
                let mut state = 7u64;
                let garbage: Vec<u8> = (0..256)
                    .map(|_| {
                        // xorshift64: any fixed sequence will do.
                        state ^= state << 13;
                        state ^= state >> 7;
                        state ^= state << 17;
                        state as u8
                    })
                    .collect();
                socket.write_all(&[H2_PREFACE.as_slice(), &garbage].concat())?;
                reader.read(&mut socket, |_| false)?;
            }
            Self::Huge => {
                socket.write_all(&start)?;
                let flags = H2_END_STREAM | H2_END_HEADERS;
                let mut header = h2_frame(H2_HEADERS, flags, 1, &[]);
                header[..3].copy_from_slice(&[0xff, 0xff, 0xff]);
                socket.write_all(&[header, vec![0; 4096]].concat())?;
                reader.read(&mut socket, |_| false)?;
            }
            Self::Bytewise => {
                for byte in [start, request].concat() {
                    socket.write_all(&[byte])?;
                    // Paced so that the server may read each byte on its own.
                    thread::sleep(Duration::from_millis(1));
                }
                reader.read(&mut socket, RawReader::stream_one_ended)?;
            }
            Self::Split(offset) => {
                let offset = usize::from(offset).min(request.len());
                socket.write_all(&[start.as_slice(), &request[..offset]].concat())?;
                // The server acknowledges our SETTINGS once it read them: it has read
                // the whole first send, so the cut falls between two reads.
                reader.hold = true;
                reader.read(&mut socket, |reader| reader.settings_acked)?;
                socket.write_all(&request[offset..])?;
                reader.release(&mut socket)?;
                reader.read(&mut socket, RawReader::stream_one_ended)?;
            }
        }
        Ok(reader.result)
    }

    /// A valid request the server answers: poolscope must count it, unless it gave
    /// the connection up (a loss).
    pub fn valid(self) -> bool {
        matches!(self, Self::Bytewise | Self::Split(_))
    }

    pub fn name(self) -> String {
        match self {
            Self::Garbage => "garbage after the preface".to_owned(),
            Self::Huge => "a 16 MB frame header".to_owned(),
            Self::Bytewise => "a request byte by byte".to_owned(),
            Self::Split(offset) => format!("HEADERS cut at {offset}"),
        }
    }
}

/// What a hostile client read of the server's frames.
#[derive(Default)]
struct RawReader {
    result: RawResult,
    settings_acked: bool,
    stream_one_ended: bool,
    /// Whether acknowledgements wait: written between a frame's two halves, they
    /// would cut it.
    hold: bool,
    ack_owed: bool,
}

impl RawReader {
    fn stream_one_ended(&self) -> bool {
        self.stream_one_ended
    }

    /// Stops holding acknowledgements back, writing the one owed.
    fn release(&mut self, socket: &mut TcpStream) -> anyhow::Result<()> {
        self.hold = false;
        if std::mem::take(&mut self.ack_owed) {
            socket.write_all(&h2_frame(H2_SETTINGS, H2_ACK, 0, &[]))?;
        }
        Ok(())
    }

    /// Reads frames until `done`, the server's close, or [`HOSTILE_SILENCE`],
    /// acknowledging the server's SETTINGS (unless held back).
    fn read(&mut self, socket: &mut TcpStream, done: impl Fn(&Self) -> bool) -> anyhow::Result<()> {
        socket.set_read_timeout(Some(HOSTILE_SILENCE))?;
        while !done(self) && !self.result.server_closed {
            let Frame {
                kind,
                flags,
                stream,
                payload,
            } = match read_frame(socket) {
                Ok(frame) => frame,
                Err(error)
                    if matches!(
                        error.kind(),
                        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
                    ) =>
                {
                    self.result.server_closed = true;
                    break;
                }
                Err(error)
                    if matches!(
                        error.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    break;
                }
                Err(error) => return Err(error.into()),
            };
            match kind {
                H2_SETTINGS if flags & H2_ACK != 0 => self.settings_acked = true,
                H2_SETTINGS if self.hold => self.ack_owed = true,
                H2_SETTINGS => socket.write_all(&h2_frame(H2_SETTINGS, H2_ACK, 0, &[]))?,
                H2_HEADERS | H2_DATA if flags & H2_END_STREAM != 0 => {
                    self.result.answered += 1;
                    self.stream_one_ended |= stream == 1;
                }
                H2_RST_STREAM => {
                    self.result.reset_by_server += 1;
                    self.stream_one_ended |= stream == 1;
                }
                H2_GOAWAY => {
                    self.result.goaway = payload.get(4..8).map(|code| {
                        u64::from(u32::from_be_bytes([code[0], code[1], code[2], code[3]]))
                    });
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// An h2c connection to 127.0.0.1:`port` that made one request when opened
/// (h2raw.py's `old` mode) and makes more on demand; closed when dropped.
pub struct OldConnection {
    program: Program,
}

impl OldConnection {
    /// Connects, makes one request and waits for its answer.
    pub fn open(port: u16) -> anyhow::Result<Self> {
        let args = [
            script("h2raw.py").display().to_string(),
            "old".to_owned(),
            port.to_string(),
        ];
        let mut program = Program::start_path(Path::new(PYTHON), &args)
            .context("starting h2raw.py (Debian package python3-h2)")?;
        program
            .line("ready")
            .context("h2raw.py old: no first answer")?;
        Ok(Self { program })
    }

    /// `count` more requests, one after the other, each answered before the next.
    pub fn requests(&mut self, count: u64) -> anyhow::Result<RawResult> {
        self.program.send(&format!("go {count}"))?;
        let line = self.program.line("result")?;
        let value: serde_json::Value = serde_json::from_str(&line)?;
        let mut result = RawResult::parse(&line)?;
        // This round's answers, not the connection's.
        result.answered = value["answered_now"]
            .as_u64()
            .with_context(|| format!("no \"answered_now\" in {line}"))?;
        Ok(result)
    }

    /// Closes the connection and waits until the script has.
    pub fn close(mut self) -> anyhow::Result<()> {
        self.program.finish("closed")?;
        Ok(())
    }
}

/// The server of tests/http2/node_server.js: Node.js's own HTTP/2 server, each
/// stream answered after a fixed service time from its event loop; killed when
/// dropped.
pub struct NodeH2Server {
    program: Program,
    port: u16,
}

impl NodeH2Server {
    pub fn start(service: Duration) -> anyhow::Result<Self> {
        let argv = [
            script("node_server.js").display().to_string(),
            service.as_millis().to_string(),
        ];
        let mut program = Program::start_path(Path::new("/usr/bin/node"), &argv)
            .context("starting the Node.js HTTP/2 server (Debian package nodejs)")?;
        let port = program
            .line("port")?
            .parse()
            .context("the Node.js server's port")?;
        Ok(Self { program, port })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn pid(&self) -> u32 {
        self.program.pid()
    }

    /// Stops it; the streams it answered.
    pub fn finish(mut self) -> anyhow::Result<u64> {
        Ok(self.program.finish("served")?.parse()?)
    }
}

/// tests/src/bin/h2server.rs: each stream answered after a fixed service time, on a
/// thread of its own.
pub struct PlainH2Server {
    program: Program,
    port: u16,
}

/// What `h2server` counted itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlainServed {
    pub answered: u64,
    pub open: i64,
    /// Its own mean time per stream, from its HEADERS read to its answer written.
    pub mean: Duration,
}

impl PlainH2Server {
    pub fn start(service: Duration) -> anyhow::Result<Self> {
        Self::start_with(&[service.as_millis().to_string()])
    }

    /// [`Self::start`] announcing `SETTINGS_MAX_CONCURRENT_STREAMS` = `max_streams`.
    pub fn start_with_stream_limit(service: Duration, max_streams: u32) -> anyhow::Result<Self> {
        Self::start_with(&[service.as_millis().to_string(), max_streams.to_string()])
    }

    /// [`Self::start`] with a pool of `workers` threads that the reader hands each
    /// stream to, as grpcio's executor does.
    pub fn start_pool(service: Duration, workers: u32) -> anyhow::Result<Self> {
        Self::start_with(&[
            service.as_millis().to_string(),
            "0".to_owned(),
            workers.to_string(),
        ])
    }

    fn start_with(args: &[String]) -> anyhow::Result<Self> {
        let mut program = Program::start("h2server", args)?;
        let port = program.line("port")?.parse().context("h2server's port")?;
        Ok(Self { program, port })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn pid(&self) -> u32 {
        self.program.pid()
    }

    /// The streams in its pool's queue that no worker has taken yet, now.
    pub fn queued(&mut self) -> anyhow::Result<i64> {
        self.program.send("queued")?;
        Ok(self.program.line("queued")?.parse()?)
    }

    /// Stops it; what it counted.
    pub fn finish(mut self) -> anyhow::Result<PlainServed> {
        let line = self.program.finish("served")?;
        let numbers: Vec<&str> = line.split(' ').collect();
        let [answered, open, mean_ns] = numbers[..] else {
            bail!("h2server said {line:?}");
        };
        Ok(PlainServed {
            answered: answered.parse()?,
            open: open.parse()?,
            mean: Duration::from_nanos(mean_ns.parse()?),
        })
    }
}

/// HTTP/2 frame types and flags that the plain server and client send and read.
pub const H2_DATA: u8 = 0;
pub const H2_HEADERS: u8 = 1;
pub const H2_RST_STREAM: u8 = 3;
pub const H2_SETTINGS: u8 = 4;
pub const H2_PING: u8 = 6;
pub const H2_GOAWAY: u8 = 7;
pub const H2_END_STREAM: u8 = 0x1;
pub const H2_END_HEADERS: u8 = 0x4;
pub const H2_ACK: u8 = 0x1;
/// The client preface.
pub const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// A request's header block: HPACK's static `:method GET`, `:scheme http`, `:path /`,
/// and `:authority localhost` as a literal not indexed (Node.js resets a request
/// without one).
const H2_REQUEST_BLOCK: [u8; 14] = [
    0x82, 0x86, 0x84, 0x01, 0x09, b'l', b'o', b'c', b'a', b'l', b'h', b'o', b's', b't',
];

/// A frame's bytes: its 9-byte header (length, type, flags, stream) and `payload`.
pub fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut bytes = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    bytes.extend_from_slice(&[kind, flags]);
    bytes.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

/// A frame a client read: its type, flags, stream and payload.
struct Frame {
    kind: u8,
    flags: u8,
    stream: u32,
    payload: Vec<u8>,
}

/// Reads one frame from `socket`: its 9-byte header, then its payload.
fn read_frame(socket: &mut TcpStream) -> std::io::Result<Frame> {
    let mut header = [0u8; 9];
    socket.read_exact(&mut header)?;
    let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
    let mut payload = vec![0u8; length];
    socket.read_exact(&mut payload)?;
    Ok(Frame {
        kind: header[3],
        flags: header[4],
        stream: u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff,
        payload,
    })
}

/// One h2c connection's client side: streams opened in turn (1, 3, 5, ...); closed
/// when dropped.
pub struct PlainConnection {
    socket: TcpStream,
    next_stream: u32,
}

impl PlainConnection {
    pub fn open(port: u16) -> anyhow::Result<Self> {
        let mut socket = Self::connect(port)?;
        Self::greet(&mut socket)?;
        Ok(Self {
            socket,
            next_stream: 1,
        })
    }

    fn connect(port: u16) -> anyhow::Result<TcpStream> {
        let socket = TcpStream::connect(("127.0.0.1", port))?;
        socket.set_read_timeout(Some(Duration::from_secs(30)))?;
        Ok(socket)
    }

    /// The client preface and an empty SETTINGS frame.
    fn greeting() -> Vec<u8> {
        [H2_PREFACE.as_slice(), &h2_frame(H2_SETTINGS, 0, 0, &[])].concat()
    }

    fn greet(socket: &mut TcpStream) -> anyhow::Result<()> {
        socket.write_all(&Self::greeting())?;
        Ok(())
    }

    /// A HEADERS frame that opens `stream` with a request and ends it.
    fn request_frame(stream: u32) -> Vec<u8> {
        let flags = H2_END_STREAM | H2_END_HEADERS;
        h2_frame(H2_HEADERS, flags, stream, &H2_REQUEST_BLOCK)
    }

    /// Connects with an HTTP/1.1 request for `Upgrade: h2c`, and once it is answered
    /// `101` speaks HTTP/2, reading the upgraded request's answer on stream 1.
    pub fn upgraded(port: u16) -> anyhow::Result<Self> {
        let mut socket = Self::connect(port)?;
        socket.write_all(
            b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade, HTTP2-Settings\r\n\
              Upgrade: h2c\r\nHTTP2-Settings: \r\n\r\n",
        )?;
        // Byte by byte, so that no frame after the head is taken with it.
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut byte = [0u8];
            socket.read_exact(&mut byte)?;
            head.push(byte[0]);
        }
        let head = String::from_utf8_lossy(&head);
        anyhow::ensure!(head.starts_with("HTTP/1.1 101"), "no upgrade: {head:?}");
        Self::greet(&mut socket)?;
        let mut connection = Self {
            socket,
            next_stream: 3,
        };
        connection.answer()?;
        Ok(connection)
    }

    /// Opens a stream with a request that ends it.
    pub fn request(&mut self) -> anyhow::Result<()> {
        let frame = Self::request_frame(self.next_stream);
        self.next_stream += 2;
        self.socket.write_all(&frame)?;
        Ok(())
    }

    /// Reads frames until a stream ends (acknowledging the server's settings).
    pub fn answer(&mut self) -> anyhow::Result<()> {
        loop {
            let frame = read_frame(&mut self.socket)?;
            if frame.kind == H2_SETTINGS && frame.flags & H2_ACK == 0 {
                self.socket
                    .write_all(&h2_frame(H2_SETTINGS, H2_ACK, 0, &[]))?;
            } else if frame.kind == H2_HEADERS && frame.flags & H2_END_STREAM != 0 {
                return Ok(());
            }
        }
    }
}

/// A closed loop of `connections` h2c connections to 127.0.0.1:`port`, each keeping
/// `open` streams open until it made `per_connection`; `during` runs meanwhile (from
/// the moment every connection has its streams open). The streams answered.
pub fn plain_streams<T>(
    port: u16,
    connections: u32,
    open: u32,
    per_connection: u32,
    during: impl FnOnce() -> T,
) -> anyhow::Result<(u64, T)> {
    let mut sockets = Vec::new();
    for _ in 0..connections {
        let mut connection = PlainConnection::open(port)?;
        for _ in 0..open.min(per_connection) {
            connection.request()?;
        }
        sockets.push(connection);
    }
    let clients: Vec<_> = sockets
        .into_iter()
        .map(|mut connection| {
            thread::spawn(move || -> anyhow::Result<u64> {
                let mut made = u64::from(open.min(per_connection));
                let mut answered = 0;
                while answered < made {
                    connection.answer()?;
                    answered += 1;
                    if made < u64::from(per_connection) {
                        connection.request()?;
                        made += 1;
                    }
                }
                Ok(answered)
            })
        })
        .collect();
    let during = during();
    let mut answered = 0;
    for client in clients {
        answered += client
            .join()
            .map_err(|_| anyhow::anyhow!("an h2c client thread panicked"))??;
    }
    Ok((answered, during))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `h2load -n 4000 -c 4 -m 10` against `Kind::NginxH2c`.
    const NGINX: &str = "starting benchmark...
spawning thread #0: 4 total client(s). 4000 total requests
Application protocol: h2c
progress: 10% done
progress: 100% done

finished in 96.92ms, 41273.28 req/s, 5.28MB/s
requests: 4000 total, 4000 started, 4000 done, 4000 succeeded, 0 failed, 0 errored, 0 timeout
status codes: 4000 2xx, 0 3xx, 0 4xx, 0 5xx
traffic: 523.63KB (536196) total, 410.16KB (420000) headers (space savings 40.00%), 42.97KB (44000) data
                     min         max         mean         sd        +/- sd
time for request:       42us      7.44ms       861us      1.33ms    88.50%
time for connect:      101us       556us       256us       204us    75.00%
time to 1st byte:     4.00ms      7.64ms      5.85ms      2.01ms   100.00%
req/s           :   10854.99    10929.66    10896.03       31.05    50.00%
";

    /// `h2load -n 100 -c 1 -m 10` against its `/reset` (`return 444`).
    const RESETS: &str = "starting benchmark...
spawning thread #0: 1 total client(s). 100 total requests
Application protocol: h2c
progress: 100% done

finished in 4.77ms, 0.00 req/s, 276.01KB/s
requests: 100 total, 100 started, 100 done, 0 succeeded, 100 failed, 100 errored, 0 timeout
status codes: 0 2xx, 0 3xx, 0 4xx, 0 5xx
traffic: 1.32KB (1349) total, 0B (0) headers (space savings 0.00%), 0B (0) data
                     min         max         mean         sd        +/- sd
time for request:        0us         0us         0us         0us     0.00%
time for connect:      347us       347us       347us         0us   100.00%
time to 1st byte:        0us         0us         0us         0us     0.00%
req/s           :       0.00        0.00        0.00        0.00   100.00%
";

    #[test]
    fn parses_real_h2load_output() {
        assert_eq!(
            parse_h2load(NGINX).unwrap(),
            H2Load {
                protocol: "h2c".to_owned(),
                total: 4000,
                done: 4000,
                succeeded: 4000,
                failed: 0,
                errored: 0,
                timeout: 0,
                status_2xx: 4000,
                status_4xx: 0,
                status_5xx: 0,
                mean_request: Duration::from_micros(861),
                seconds: 0.09692,
            }
        );
        let resets = parse_h2load(RESETS).unwrap();
        assert_eq!(
            (resets.succeeded, resets.failed, resets.errored),
            (0, 100, 100)
        );
        assert_eq!(resets.mean_request, Duration::ZERO);
    }

    #[test]
    fn incomplete_h2load_output_is_an_error() {
        assert!(parse_h2load("").is_err());
        for line in [
            "Application protocol: h2c\n",
            "requests: 4000 total, 4000 started, 4000 done, 4000 succeeded, 0 failed, 0 errored, 0 timeout\n",
            "status codes: 4000 2xx, 0 3xx, 0 4xx, 0 5xx\n",
        ] {
            assert!(parse_h2load(&NGINX.replace(line, "")).is_err(), "{line}");
        }
    }

    #[test]
    fn parses_the_scripts_reports() {
        let grpc = GrpcResult::parse(
            r#"{"completed": 580, "ok": 580, "failed": 0, "messages": 580, "latency_sum": 48.48, "elapsed": 3.08, "errors": []}"#,
        )
        .unwrap();
        assert_eq!(grpc.completed, 580);
        assert!((grpc.mean_in_flight() - 15.74).abs() < 0.01);
        let raw = RawResult::parse(
            r#"{"answered": 1, "reset_by_server": 0, "reset_by_us": 8, "server_closed": false, "goaway": null, "answered_before_reset": 0}"#,
        )
        .unwrap();
        assert_eq!(
            raw,
            RawResult {
                answered: 1,
                reset_by_us: 8,
                ..RawResult::default()
            }
        );
        assert!(RawResult::parse(r#"{"goaway": 1}"#).is_err());
    }
}
