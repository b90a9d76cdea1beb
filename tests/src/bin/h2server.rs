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
//! Usage: `h2server <service_ms> [max_streams]` (`max_streams`: announced as
//! `SETTINGS_MAX_CONCURRENT_STREAMS` in its first SETTINGS); prints `port <n>`, then
//! serves until stdin closes, then prints `served <streams answered> <streams open> <mean ns>`: the mean of its own
//! measure of each stream, from the read that returned its HEADERS (the frame parsed
//! from a buffered read, microseconds after its return) to the return of the write of
//! its answer, where poolscope takes a stream's start and end.
use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use poolscope_tests::{
    http2::{
        H2_ACK as ACK, H2_END_HEADERS as END_HEADERS, H2_END_STREAM as END_STREAM,
        H2_GOAWAY as GOAWAY, H2_HEADERS as HEADERS, H2_PING as PING, H2_PREFACE as PREFACE,
        H2_SETTINGS as SETTINGS, h2_frame as frame,
    },
    wait_for_stdin_close,
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

/// Stream `stream`'s answer, after `service`, from a thread of its own; timed from
/// `started` where given.
fn answer_later(
    connection: &Arc<Connection>,
    counts: &Arc<Counts>,
    stream: u32,
    service: Duration,
    started: Option<Instant>,
) {
    counts.open.fetch_add(1, Ordering::SeqCst);
    let (connection, counts) = (Arc::clone(connection), Arc::clone(counts));
    thread::spawn(move || {
        thread::sleep(service);
        let answer = frame(HEADERS, END_HEADERS | END_STREAM, stream, &[STATUS_200]);
        if !connection.closed.load(Ordering::SeqCst) && send(&connection.writer, &answer).is_ok() {
            if let Some(started) = started {
                let took = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                counts.served_ns.fetch_add(took, Ordering::SeqCst);
                counts.timed.fetch_add(1, Ordering::SeqCst);
            }
            counts.answered.fetch_add(1, Ordering::SeqCst);
        }
        counts.open.fetch_sub(1, Ordering::SeqCst);
    });
}

/// What a connection's threads share.
struct Connection {
    writer: Mutex<TcpStream>,
    /// The client closed: answers are not written.
    closed: AtomicBool,
}

fn serve(
    socket: TcpStream,
    service: Duration,
    max_streams: Option<u32>,
    counts: &Arc<Counts>,
) -> std::io::Result<()> {
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
        answer_later(&connection, counts, 1, service, None);
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
                answer_later(&connection, counts, stream, service, Some(Instant::now()));
            }
            _ => {}
        }
    }
}

fn main() -> std::io::Result<()> {
    let service_ms: u64 = std::env::args()
        .nth(1)
        .and_then(|arg| arg.parse().ok())
        .unwrap_or(10);
    let service = Duration::from_millis(service_ms);
    let max_streams: Option<u32> = std::env::args().nth(2).and_then(|arg| arg.parse().ok());
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", listener.local_addr()?.port());
    let counts = Arc::new(Counts::default());
    {
        let counts = Arc::clone(&counts);
        thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let counts = Arc::clone(&counts);
                thread::spawn(move || serve(stream, service, max_streams, &counts));
            }
        });
    }
    wait_for_stdin_close()?;
    let answered = counts.answered.load(Ordering::SeqCst);
    println!(
        "served {answered} {} {}",
        counts.open.load(Ordering::SeqCst),
        counts.served_ns.load(Ordering::SeqCst) / counts.timed.load(Ordering::SeqCst).max(1)
    );
    Ok(())
}
