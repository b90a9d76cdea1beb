//! An HTTP/2 server over cleartext TCP (prior knowledge) whose truth the tests know,
//! with nothing but the standard library, so that it runs in the test guests: each
//! stream a client opens with a HEADERS frame that ends it is answered, after
//! `service_ms`, by a HEADERS frame (`:status 200`) that ends it, from a thread of its
//! own (every open stream served at once, as grpc-go's goroutines serve them). A
//! reader thread per connection reads frames; the answers' writes are one at a time.
//! Header blocks are not decoded (the answer's block is the static table's `:status
//! 200`, one byte), which is all poolscope reads of them: frame headers.
//!
//! When a client closes, the connection's streams still open are not answered (the
//! socket is shut down at once): they end with the connection, as resets.
//!
//! Usage: `h2server <service_ms> [max_streams]` (`max_streams`: announced as
//! `SETTINGS_MAX_CONCURRENT_STREAMS` in its first SETTINGS); prints `port <n>`, then serves until stdin closes,
//! then prints `served <streams answered> <streams open> <mean ns>`: the mean of its own
//! measure of each stream, from the read that returned its HEADERS (the frame parsed
//! from a buffered read, microseconds after its return) to the return of the write of
//! its answer, where poolscope takes a stream's start and end.
use std::{
    io::{BufReader, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use poolscope_tests::wait_for_stdin_close;

const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 1;
const SETTINGS: u8 = 4;
const PING: u8 = 6;
const GOAWAY: u8 = 7;
const END_STREAM: u8 = 0x1;
const ACK: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
/// The SETTINGS parameter of a stream limit.
const MAX_CONCURRENT_STREAMS: u16 = 0x3;
/// HPACK: the static table's entry 8, `:status 200`.
const STATUS_200: u8 = 0x88;

/// What the server counts itself.
#[derive(Default)]
struct Counts {
    answered: AtomicU64,
    open: AtomicI64,
    /// Each answered stream's time, summed.
    served_ns: AtomicU64,
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let length = payload.len() as u32;
    let mut bytes = Vec::with_capacity(9 + payload.len());
    bytes.extend_from_slice(&length.to_be_bytes()[1..]);
    bytes.extend_from_slice(&[kind, flags]);
    bytes.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

/// Writes `bytes` whole, one writer at a time.
fn send(writer: &Mutex<TcpStream>, bytes: &[u8]) -> std::io::Result<()> {
    writer
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .write_all(bytes)
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
    let mut preface = [0u8; 24];
    reader.read_exact(&mut preface)?;
    if &preface != PREFACE {
        return Ok(());
    }
    let settings: Vec<u8> = max_streams.map_or_else(Vec::new, |limit| {
        let mut parameter = MAX_CONCURRENT_STREAMS.to_be_bytes().to_vec();
        parameter.extend_from_slice(&limit.to_be_bytes());
        parameter
    });
    send(writer, &frame(SETTINGS, 0, 0, &settings))?;
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
                let started = Instant::now();
                counts.open.fetch_add(1, Ordering::SeqCst);
                let (connection, counts) = (Arc::clone(&connection), Arc::clone(counts));
                thread::spawn(move || {
                    thread::sleep(service);
                    let answer = frame(HEADERS, END_HEADERS | END_STREAM, stream, &[STATUS_200]);
                    if !connection.closed.load(Ordering::SeqCst)
                        && send(&connection.writer, &answer).is_ok()
                    {
                        let took = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                        counts.served_ns.fetch_add(took, Ordering::SeqCst);
                        counts.answered.fetch_add(1, Ordering::SeqCst);
                    }
                    counts.open.fetch_sub(1, Ordering::SeqCst);
                });
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
        counts.served_ns.load(Ordering::SeqCst) / answered.max(1)
    );
    Ok(())
}
