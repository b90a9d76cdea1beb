//! HTTP/1 answers with chosen statuses: `tests/http1/status_server.py`, which answers
//! `GET /status/<code>` with that code (and `GET /early/<code>` after a `103 Early
//! Hints`), `tests/http1/route_server.py`, whose routes have known service times and
//! statuses, their clients' reading of answers, and a background load of such requests.
use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
};

use anyhow::Context as _;

use crate::{Program, http2::PYTHON};

/// `status_server.py`, which counts the answers it writes.
pub struct StatusServer {
    pub program: Program,
    pub port: u16,
}

/// Answers by class, 1xx to 5xx.
pub type ByClass = [u64; 5];

impl StatusServer {
    pub fn start() -> anyhow::Result<Self> {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("http1/status_server.py");
        let mut program = Program::start_path(Path::new(PYTHON), &[script.display().to_string()])?;
        let port = program
            .line("port")?
            .parse()
            .context("the status server's port")?;
        Ok(Self { program, port })
    }

    pub fn pid(&self) -> u32 {
        self.program.pid()
    }

    /// Stops it; the final answers it wrote by class, and its `103 Early Hints`.
    pub fn finish(mut self) -> anyhow::Result<(ByClass, u64)> {
        let served = self.program.finish("served")?;
        let counts: Vec<u64> = served
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("the status server said \"served {served}\""))?;
        let by_class = counts
            .try_into()
            .map_err(|_| anyhow::anyhow!("the status server said \"served {served}\""))?;
        let hints = self
            .program
            .line("hints")?
            .parse()
            .context("the status server's hints count")?;
        Ok((by_class, hints))
    }
}

/// `route_server.py`, which times and counts its answers per route.
pub struct RouteServer {
    pub program: Program,
    pub port: u16,
}

/// What a route server wrote, by `"<method> <route> <class>"` (`GET /slow/:id 2xx`):
/// its answers and their total time from request line read to answer written.
pub type ServedRoutes = std::collections::BTreeMap<String, (u64, f64)>;

impl RouteServer {
    pub fn start() -> anyhow::Result<Self> {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("http1/route_server.py");
        let mut program = Program::start_path(Path::new(PYTHON), &[script.display().to_string()])?;
        let port = program
            .line("port")?
            .parse()
            .context("the route server's port")?;
        Ok(Self { program, port })
    }

    pub fn pid(&self) -> u32 {
        self.program.pid()
    }

    /// Stops it; what it served, per route and class.
    pub fn finish(mut self) -> anyhow::Result<ServedRoutes> {
        let routes = self.program.finish("routes")?;
        let parsed: std::collections::BTreeMap<String, (u64, f64)> = serde_json::from_str(&routes)
            .with_context(|| format!("the route server said \"routes {routes}\""))?;
        Ok(parsed)
    }
}

/// Reads one answer's head; its status and `Content-Length`.
pub fn read_head(reader: &mut BufReader<TcpStream>) -> anyhow::Result<(u16, usize)> {
    let mut status_line = String::new();
    reader.read_line(&mut status_line)?;
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("status line {status_line:?}"))?;
    let mut length = 0;
    loop {
        let mut line = String::new();
        anyhow::ensure!(reader.read_line(&mut line)? != 0, "closed mid-answer");
        if line == "\r\n" {
            return Ok((status, length));
        }
        if let Some(value) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = value.trim().parse()?;
        }
    }
}

/// Reads one final answer (interim heads, the head, a body of its `Content-Length`);
/// its status and the interim heads before it.
pub fn read_answer(reader: &mut BufReader<TcpStream>) -> anyhow::Result<(u16, u64)> {
    let mut interim = 0;
    loop {
        let (status, length) = read_head(reader)?;
        if (100..200).contains(&status) {
            interim += 1;
            continue;
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body)?;
        return Ok((status, interim));
    }
}

/// One keep-alive client asking a [`StatusServer`] for `codes` in turn, over and
/// over, until stopped.
pub struct StatusLoad {
    stop: Arc<AtomicBool>,
    client: JoinHandle<anyhow::Result<ByClass>>,
}

impl StatusLoad {
    pub fn start(port: u16, codes: &'static [u16]) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let client = std::thread::spawn(move || {
            let stream = TcpStream::connect(("127.0.0.1", port))?;
            let mut reader = BufReader::new(stream.try_clone()?);
            let mut writer = stream;
            let mut read = ByClass::default();
            for &code in codes.iter().cycle() {
                if stopping.load(Ordering::Relaxed) {
                    break;
                }
                writer.write_all(
                    format!("GET /status/{code} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes(),
                )?;
                let (status, _) = read_answer(&mut reader)?;
                anyhow::ensure!(status == code, "asked for {code}, got {status}");
                read[usize::from(status / 100 - 1)] += 1;
            }
            Ok(read)
        });
        Self { stop, client }
    }

    /// Stops the client; the answers it read by class.
    pub fn stop(self) -> anyhow::Result<ByClass> {
        self.stop.store(true, Ordering::Relaxed);
        self.client
            .join()
            .map_err(|_| anyhow::anyhow!("the status client panicked"))?
    }
}
