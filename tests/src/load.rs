//! A closed-loop load generator for `poolserver`: each client sends a request, waits
//! for the response, and sends the next at once, on one connection (keep-alive) or a
//! new one per request. Counts what completed and how long each took, client side.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::TcpStream,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Connections {
    KeepAlive,
    PerRequest,
}

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
    clients: Vec<JoinHandle<anyhow::Result<ClientStats>>>,
}

fn one_request(stream: &mut BufReader<TcpStream>, line: &mut String) -> anyhow::Result<()> {
    stream.get_mut().write_all(b"req\n")?;
    line.clear();
    stream.read_line(line)?;
    anyhow::ensure!(line == "ok\n", "unexpected response {line:?}");
    Ok(())
}

fn client(port: u16, connections: Connections, stop: &AtomicBool) -> anyhow::Result<ClientStats> {
    let mut stats = ClientStats::default();
    let mut line = String::new();
    let connect = || -> anyhow::Result<BufReader<TcpStream>> {
        let stream = TcpStream::connect(("127.0.0.1", port))?;
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
                one_request(stream, &mut line)?;
            }
            Connections::PerRequest => one_request(&mut connect()?, &mut line)?,
        }
        stats.latencies.push(started.elapsed());
        stats.completed += 1;
    }
    Ok(stats)
}

impl ClosedLoop {
    pub fn start(port: u16, clients: usize, connections: Connections) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let clients = (0..clients)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || client(port, connections, &stop))
            })
            .collect();
        Self { stop, clients }
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
