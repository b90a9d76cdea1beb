//! An HTTP/2 server over cleartext TCP (prior knowledge) whose truth the tests know,
//! with nothing but the standard library, so that it runs in the test guests: each
//! stream a client opens with a HEADERS frame that ends it is answered, after
//! `service_ms`, by a HEADERS frame (`:status 200`) that ends it, from a thread of its
//! own (every open stream served at once, as grpc-go's goroutines serve them). A
//! reader thread per connection reads frames; the answers' writes are one at a time.
//! Header blocks are not decoded (the answer's block is the static table's `:status
//! 200`, one byte), which is all poolscope reads of them: frame headers.
//!
//! A connection may also begin with an HTTP/1.1 request for `Upgrade: h2c`: answered
//! `101`, then on stream 1.
//!
//! When a client closes, the connection's streams still open are not answered (the
//! socket is shut down at once): they end with the connection, as resets.
//!
//! With `workers` above 0 it serves as grpcio's executor does instead: the reader
//! hands each stream to a pool of that many threads, which answer one stream at a
//! time in the order they were read; the others wait in the pool's queue.
//!
//! Usage: `h2server <service_ms> [max_streams [workers]]` (`max_streams`: announced as
//! `SETTINGS_MAX_CONCURRENT_STREAMS` in its first SETTINGS, 0 for none); prints `port
//! <n>`, then serves until stdin closes, then prints `served <streams answered>
//! <streams open> <mean ns>`: the mean of its own measure of each stream, from the
//! read that returned its HEADERS (the frame parsed from a buffered read, microseconds
//! after its return) to the return of the write of its answer, where poolscope takes
//! a stream's start and end. Each stdin line `queued` is answered `queued <n>`: the
//! streams in the pool's queue that no worker has taken yet.
use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering},
        mpsc::{Receiver, Sender, channel},
    },
    thread,
    time::{Duration, Instant},
};

use poolscope_tests::http2::{
    H2_ACK as ACK, H2_END_HEADERS as END_HEADERS, H2_END_STREAM as END_STREAM, H2_GOAWAY as GOAWAY,
    H2_HEADERS as HEADERS, H2_PING as PING, H2_PREFACE as PREFACE, H2_SETTINGS as SETTINGS,
    h2_frame as frame,
};

/// HPACK: the static table's entry 8, `:status 200`.
const STATUS_200: u8 = 0x88;
/// The answer to an HTTP/1.1 request for h2c.
const SWITCHING: &[u8] =
    b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n";
/// The SETTINGS parameter of a stream limit.
const MAX_CONCURRENT_STREAMS: u16 = 0x3;

/// What the server counts itself.
#[derive(Default)]
struct Counts {
    answered: AtomicU64,
    open: AtomicI64,
    /// Each timed answered stream's time, summed, and how many.
    served_ns: AtomicU64,
    timed: AtomicU64,
}

/// Writes `bytes` whole, one writer at a time.
fn send(writer: &Mutex<TcpStream>, bytes: &[u8]) -> std::io::Result<()> {
    writer
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .write_all(bytes)
}

/// A stream to answer: its connection and id, when its HEADERS were read (where it
/// is timed).
struct Job {
    connection: Arc<Connection>,
    stream: u32,
    started: Option<Instant>,
}

/// Who answers the streams.
enum Answerers {
    /// A thread of its own each.
    ThreadPerStream,
    /// A pool's threads, which take jobs from this queue.
    Pool(Sender<Job>),
}

/// What every connection shares: the counts, the service time and the answerers.
struct Server {
    counts: Counts,
    service: Duration,
    answerers: Answerers,
    /// Jobs handed to the pool and not taken by a worker yet.
    queued: AtomicI64,
}

impl Server {
    /// Stream `stream`'s answer, after the service time, from a thread of its own or a
    /// worker of the pool; timed from `started` where given.
    fn answer_later(
        self: &Arc<Self>,
        connection: &Arc<Connection>,
        stream: u32,
        started: Option<Instant>,
    ) {
        self.counts.open.fetch_add(1, Ordering::SeqCst);
        let job = Job {
            connection: Arc::clone(connection),
            stream,
            started,
        };
        match &self.answerers {
            Answerers::ThreadPerStream => {
                let server = Arc::clone(self);
                thread::spawn(move || server.answer(&job));
            }
            Answerers::Pool(queue) => {
                self.queued.fetch_add(1, Ordering::SeqCst);
                if queue.send(job).is_err() {
                    self.queued.fetch_sub(1, Ordering::SeqCst);
                    self.counts.open.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
    }

    /// Serves `job` for the service time, then writes its answer.
    fn answer(&self, job: &Job) {
        thread::sleep(self.service);
        let answer = frame(HEADERS, END_HEADERS | END_STREAM, job.stream, &[STATUS_200]);
        let counts = &self.counts;
        if !job.connection.closed.load(Ordering::SeqCst)
            && send(&job.connection.writer, &answer).is_ok()
        {
            if let Some(started) = job.started {
                let took = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                counts.served_ns.fetch_add(took, Ordering::SeqCst);
                counts.timed.fetch_add(1, Ordering::SeqCst);
            }
            counts.answered.fetch_add(1, Ordering::SeqCst);
        }
        counts.open.fetch_sub(1, Ordering::SeqCst);
    }

    /// A worker of the pool: takes the jobs in turn until the queue is gone.
    fn work(&self, jobs: &Mutex<Receiver<Job>>) {
        loop {
            let job = jobs
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .recv();
            let Ok(job) = job else {
                return;
            };
            self.queued.fetch_sub(1, Ordering::SeqCst);
            self.answer(&job);
        }
    }
}

/// What a connection's threads share.
struct Connection {
    writer: Mutex<TcpStream>,
    /// The client closed: answers are not written.
    closed: AtomicBool,
}

fn serve(socket: TcpStream, max_streams: Option<u32>, server: &Arc<Server>) -> std::io::Result<()> {
    let connection = Arc::new(Connection {
        writer: Mutex::new(socket.try_clone()?),
        closed: AtomicBool::new(false),
    });
    let writer = &connection.writer;
    let mut reader = BufReader::with_capacity(1 << 16, socket);
    let settings: Vec<u8> = max_streams.map_or_else(Vec::new, |limit| {
        let mut parameter = MAX_CONCURRENT_STREAMS.to_be_bytes().to_vec();
        parameter.extend_from_slice(&limit.to_be_bytes());
        parameter
    });
    let mut preface = [0u8; 24];
    reader.read_exact(&mut preface)?;
    if &preface != PREFACE {
        // An HTTP/1.1 request asking for h2c (RFC 7540 §3.2): answered `101`, then in
        // HTTP/2, its answer on stream 1 (not timed: its time began as HTTP/1's); the
        // client's preface follows.
        let mut head = preface.to_vec();
        while !head.ends_with(b"\r\n\r\n") {
            if reader.read_until(b'\n', &mut head)? == 0 {
                return Ok(());
            }
        }
        if !String::from_utf8_lossy(&head)
            .to_ascii_lowercase()
            .contains("upgrade: h2c")
        {
            return Ok(());
        }
        send(writer, SWITCHING)?;
        send(writer, &frame(SETTINGS, 0, 0, &settings))?;
        server.answer_later(&connection, 1, None);
        reader.read_exact(&mut preface)?;
        if &preface != PREFACE {
            return Ok(());
        }
    } else {
        send(writer, &frame(SETTINGS, 0, 0, &settings))?;
    }
    loop {
        let mut header = [0u8; 9];
        if reader.read_exact(&mut header).is_err() {
            connection.closed.store(true, Ordering::SeqCst);
            let _ = reader.get_ref().shutdown(std::net::Shutdown::Both);
            return Ok(());
        }
        let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        let (kind, flags) = (header[3], header[4]);
        let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
        let mut payload = vec![0u8; length];
        reader.read_exact(&mut payload)?;
        match kind {
            SETTINGS if flags & ACK == 0 => send(writer, &frame(SETTINGS, ACK, 0, &[]))?,
            PING if flags & ACK == 0 => send(writer, &frame(PING, ACK, 0, &payload))?,
            GOAWAY => return Ok(()),
            HEADERS if flags & END_STREAM != 0 => {
                server.answer_later(&connection, stream, Some(Instant::now()));
            }
            _ => {}
        }
    }
}

fn main() -> std::io::Result<()> {
    let arg = |n: usize| {
        std::env::args()
            .nth(n)
            .and_then(|arg| arg.parse::<u64>().ok())
    };
    let service = Duration::from_millis(arg(1).unwrap_or(10));
    let max_streams = arg(2)
        .filter(|limit| *limit > 0)
        .and_then(|limit| u32::try_from(limit).ok());
    let workers = arg(3).unwrap_or(0);
    let (answerers, jobs) = if workers > 0 {
        let (queue, jobs) = channel();
        (Answerers::Pool(queue), Some(Arc::new(Mutex::new(jobs))))
    } else {
        (Answerers::ThreadPerStream, None)
    };
    let server = Arc::new(Server {
        counts: Counts::default(),
        service,
        answerers,
        queued: AtomicI64::new(0),
    });
    if let Some(jobs) = jobs {
        for _ in 0..workers {
            let (server, jobs) = (Arc::clone(&server), Arc::clone(&jobs));
            thread::spawn(move || server.work(&jobs));
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", listener.local_addr()?.port());
    {
        let server = Arc::clone(&server);
        thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let server = Arc::clone(&server);
                thread::spawn(move || serve(stream, max_streams, &server));
            }
        });
    }
    for line in std::io::stdin().lock().lines() {
        if line?.trim() == "queued" {
            println!("queued {}", server.queued.load(Ordering::SeqCst));
        }
    }
    let counts = &server.counts;
    let answered = counts.answered.load(Ordering::SeqCst);
    println!(
        "served {answered} {} {}",
        counts.open.load(Ordering::SeqCst),
        counts.served_ns.load(Ordering::SeqCst) / counts.timed.load(Ordering::SeqCst).max(1)
    );
    Ok(())
}
