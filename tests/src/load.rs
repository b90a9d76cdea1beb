//! Load generators for the test servers (`req\n` answered by `ok\n`).
//!
//! [`ClosedLoop`], for `poolserver`: each client sends a request, waits for the
//! response, and sends the next at once, on one connection (keep-alive) or a new one
//! per request. Counts what completed and how long each took, client side. With
//! [`Protocol::Http`], the same clients speak HTTP/1.1 (for tests/iouring's server).
//!
//! [`OpenLoop`], for `threadpool`: requests arrive at a fixed rate whether or not the
//! server keeps up, one connection each, so a slow pool builds a queue as it would in
//! production instead of slowing its clients down.
use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::{
        Arc, Barrier, OnceLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Connections {
    KeepAlive,
    PerRequest,
}

/// What a client sends and expects back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// `req\n`, answered `ok\n` (this crate's test servers).
    Line,
    /// An HTTP/1.1 GET, answered exactly [`HTTP_RESPONSE`].
    Http,
}

const HTTP_REQUEST: &[u8] = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";

/// The one response an HTTP test server gives (tests/iouring/iouring_server.c).
pub const HTTP_RESPONSE: &[u8] =
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Type: text/plain\r\n\r\nok\n";

/// What the clients saw.
#[derive(Debug, Default)]
pub struct ClientStats {
    pub completed: u64,
    /// Requests completed by each client (each keep-alive client is one connection).
    pub per_client: Vec<u64>,
    /// Every request's latency, connect included for `PerRequest`.
    pub latencies: Vec<Duration>,
}

impl ClientStats {
    /// The `q` quantile of the latencies.
    pub fn quantile(&self, q: f64) -> Duration {
        let mut sorted = self.latencies.clone();
        sorted.sort_unstable();
        let index = ((q * sorted.len() as f64) as usize).min(sorted.len().saturating_sub(1));
        sorted.get(index).copied().unwrap_or_default()
    }
}

/// Running clients; `stop` lets each finish its request in progress and close.
pub struct ClosedLoop {
    stop: Arc<AtomicBool>,
    /// Requests completed so far by all clients, for a test that needs a volume of
    /// load rather than a duration of it.
    completed: Arc<AtomicU64>,
    clients: Vec<JoinHandle<anyhow::Result<ClientStats>>>,
}

fn one_request(
    stream: &mut BufReader<TcpStream>,
    line: &mut String,
    protocol: Protocol,
) -> anyhow::Result<()> {
    match protocol {
        Protocol::Line => {
            stream.get_mut().write_all(b"req\n")?;
            line.clear();
            stream.read_line(line)?;
            anyhow::ensure!(line == "ok\n", "unexpected response {line:?}");
        }
        Protocol::Http => {
            // One write, so that the request arrives whole (no Nagle wait between parts).
            stream.get_mut().write_all(HTTP_REQUEST)?;
            let mut response = [0; HTTP_RESPONSE.len()];
            stream.read_exact(&mut response)?;
            anyhow::ensure!(
                response == HTTP_RESPONSE,
                "unexpected response {:?}",
                String::from_utf8_lossy(&response)
            );
        }
    }
    Ok(())
}

fn client(
    server: SocketAddr,
    (connections, protocol): (Connections, Protocol),
    (stop, completed): (&AtomicBool, &AtomicU64),
) -> anyhow::Result<ClientStats> {
    let mut stats = ClientStats::default();
    let mut line = String::new();
    let connect = || -> anyhow::Result<BufReader<TcpStream>> {
        let stream = TcpStream::connect(server)?;
        stream.set_nodelay(true)?;
        Ok(BufReader::new(stream))
    };
    let mut kept = None;
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        match connections {
            Connections::KeepAlive => {
                let stream = match kept.as_mut() {
                    Some(stream) => stream,
                    None => kept.insert(connect()?),
                };
                one_request(stream, &mut line, protocol)?;
            }
            Connections::PerRequest => one_request(&mut connect()?, &mut line, protocol)?,
        }
        stats.latencies.push(started.elapsed());
        stats.completed += 1;
        completed.fetch_add(1, Ordering::Relaxed);
    }
    Ok(stats)
}

impl ClosedLoop {
    pub fn start(port: u16, clients: usize, connections: Connections) -> Self {
        Self::start_to(
            SocketAddr::from(([127, 0, 0, 1], port)),
            clients,
            connections,
        )
    }

    /// Clients of a server at another address than 127.0.0.1.
    pub fn start_to(server: SocketAddr, clients: usize, connections: Connections) -> Self {
        Self::spawn(server, clients, (connections, Protocol::Line))
    }

    /// HTTP/1.1 keep-alive clients of 127.0.0.1:`port`.
    pub fn start_http(port: u16, clients: usize) -> Self {
        let server = SocketAddr::from(([127, 0, 0, 1], port));
        Self::spawn(server, clients, (Connections::KeepAlive, Protocol::Http))
    }

    fn spawn(server: SocketAddr, clients: usize, how: (Connections, Protocol)) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let completed = Arc::new(AtomicU64::new(0));
        let clients = (0..clients)
            .map(|_| {
                let (stop, completed) = (stop.clone(), completed.clone());
                std::thread::spawn(move || client(server, how, (&stop, &completed)))
            })
            .collect();
        Self {
            stop,
            completed,
            clients,
        }
    }

    /// Requests completed so far, all clients together.
    pub fn completed(&self) -> u64 {
        self.completed.load(Ordering::Relaxed)
    }

    /// Stops every client and sums what they saw.
    pub fn stop(self) -> anyhow::Result<ClientStats> {
        self.stop.store(true, Ordering::Relaxed);
        let mut total = ClientStats::default();
        for client in self.clients {
            let stats = client
                .join()
                .map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
            total.completed += stats.completed;
            total.per_client.push(stats.completed);
            total.latencies.extend(stats.latencies);
        }
        Ok(total)
    }
}

/// What an [`OpenLoop`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpenLoopStats {
    /// Requests whose connection was attempted (`answered + errors`).
    pub sent: u64,
    /// Requests answered `ok\n`.
    pub answered: u64,
    /// Requests that failed: refused, reset, timed out or answered otherwise.
    pub errors: u64,
    /// From the first scheduled arrival to `stop`: `sent` is about rate × elapsed.
    pub elapsed: Duration,
    /// Requests sent more than [`OpenLoop::LATE`] after their scheduled time, because
    /// every sender was still busy with an earlier request: the arrivals were not the
    /// rate asked for.
    pub late: u64,
}

/// Paced arrivals: request k is due at start + k / rate, whoever sends it. Each
/// sender thread claims the next k, sleeps until it is due, and sends it on a new
/// connection; `senders` bounds the requests in flight.
pub struct OpenLoop {
    stop: Arc<AtomicBool>,
    start: Arc<OnceLock<Instant>>,
    senders: Vec<JoinHandle<OpenLoopStats>>,
    /// Why nothing was started, reported by `stop`.
    invalid: Option<String>,
}

/// How long a sender waits for a response; a stuck server must not hang `stop`.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest single sleep of a sender, so that `stop` is not kept waiting for a
/// request due far in the future.
const STOP_CHECK: Duration = Duration::from_millis(20);

fn open_loop_request(port: u16) -> anyhow::Result<()> {
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(RESPONSE_TIMEOUT))?;
    stream.set_write_timeout(Some(RESPONSE_TIMEOUT))?;
    one_request(
        &mut BufReader::new(stream),
        &mut String::new(),
        Protocol::Line,
    )
}

fn sender(
    port: u16,
    rate_per_second: f64,
    next: &AtomicU64,
    stop: &AtomicBool,
    start: Instant,
) -> OpenLoopStats {
    let mut stats = OpenLoopStats::default();
    while !stop.load(Ordering::Relaxed) {
        let k = next.fetch_add(1, Ordering::Relaxed);
        let due = start + Duration::from_secs_f64(k as f64 / rate_per_second);
        // Late is claimed late: every sender was still busy when the request fell
        // due. A sender that claimed it in time and then woke a few ms late from its
        // sleep (the host's scheduler; CI once saw 1 of 281) sends the rate asked.
        let late = Instant::now().saturating_duration_since(due) > OpenLoop::LATE;
        loop {
            let now = Instant::now();
            if now >= due || stop.load(Ordering::Relaxed) {
                break;
            }
            std::thread::sleep((due - now).min(STOP_CHECK));
        }
        if stop.load(Ordering::Relaxed) {
            break;
        }
        if late {
            stats.late += 1;
        }
        stats.sent += 1;
        match open_loop_request(port) {
            Ok(()) => stats.answered += 1,
            Err(_) => stats.errors += 1,
        }
    }
    stats
}

impl OpenLoop {
    /// How far behind schedule a request may be sent before it counts as late.
    pub const LATE: Duration = Duration::from_millis(5);

    /// Starts sending `rate_per_second` requests a second to 127.0.0.1:`port` from
    /// `senders` threads. A rate that is not positive and finite, or no senders, sends
    /// nothing, and `stop` says so.
    pub fn start(port: u16, rate_per_second: f64, senders: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let start = Arc::new(OnceLock::new());
        if !(rate_per_second.is_finite() && rate_per_second > 0.0) || senders == 0 {
            return Self {
                stop,
                start,
                senders: Vec::new(),
                invalid: Some(format!(
                    "OpenLoop needs a positive rate and senders, got {rate_per_second}/s and {senders}"
                )),
            };
        }
        let next = Arc::new(AtomicU64::new(0));
        // The schedule starts once every sender runs, so that spawning them does not
        // make the first requests late.
        let ready = Arc::new(Barrier::new(senders + 1));
        let handles = (0..senders)
            .map(|_| {
                let (next, stop, start, ready) =
                    (next.clone(), stop.clone(), start.clone(), ready.clone());
                std::thread::spawn(move || {
                    ready.wait();
                    let start = *start.get_or_init(Instant::now);
                    sender(port, rate_per_second, &next, &stop, start)
                })
            })
            .collect();
        start.get_or_init(Instant::now);
        ready.wait();
        Self {
            stop,
            start,
            senders: handles,
            invalid: None,
        }
    }

    /// Stops scheduling, lets each request in flight finish, and sums what was done.
    pub fn stop(self) -> anyhow::Result<OpenLoopStats> {
        self.stop.store(true, Ordering::Relaxed);
        let elapsed = self.start.get().map(Instant::elapsed).unwrap_or_default();
        if let Some(invalid) = self.invalid {
            anyhow::bail!(invalid);
        }
        let mut total = OpenLoopStats {
            elapsed,
            ..OpenLoopStats::default()
        };
        for sender in self.senders {
            let stats = sender
                .join()
                .map_err(|_| anyhow::anyhow!("a sender thread panicked"))?;
            total.sent += stats.sent;
            total.answered += stats.answered;
            total.errors += stats.errors;
            total.late += stats.late;
        }
        Ok(total)
    }
}
