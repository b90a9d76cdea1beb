//! A request/response server whose truth the tests know: at most `workers` requests
//! are served at once, each for `service_us` µs. A thread per connection waits until
//! the connection is readable, then for a free worker slot, and only then reads, so
//! requests queue where a real pool's do: accepted and unread (one request per
//! connection) or arrived and unread (keep-alive).
//!
//! Protocol: a request is `req\n`; the response is `ok\n`. Usage:
//! `poolserver <workers> <service_us> [style] [port] [address]`; prints `port <n>`, then serves until
//! stdin closes, then prints `served <count> <mean service ns> <p50 service ns>`: its
//! own measure of each request from its first read's return to its last write's return
//! (where poolscope takes `start` and `end`: a write's own cost, ~20 µs here and
//! ~0.4 ms under software emulation, is the request's).
//!
//! `style` makes the server do what real servers do to a request-tracking tool:
//! - `plain` (default): one read, one write;
//! - `split`: the request in two reads, the response in two writes 1 ms apart;
//! - `early`: reads part of the request, writes part of the response, reads the rest;
//! - `nonblocking`: O_NONBLOCK socket, reads until EAGAIN;
//! - `handoff`: one thread reads, another thread of the process answers;
//! - `handoff-park`: as `handoff`, but the reading thread, blocked in a futex since it
//!   handed the request over, stays there [`PARK`] after the answer, as a Go M parks
//!   while the goroutine it read a request for answers on another M;
//! - `server-close`: the server closes the connection after each response;
//! - `spin`: the service time is spent on a CPU (the thread's own CPU time), not
//!   asleep: a CPU-bound pool, slower in wall time when it waits for a CPU.
use std::{
    io::{Read as _, Write as _},
    mem::ManuallyDrop,
    net::{TcpListener, TcpStream},
    os::fd::{AsRawFd as _, FromRawFd as _, RawFd},
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

use poolscope_tests::wait_for_stdin_close;

/// A counting semaphore: the pool's worker slots.
struct Slots {
    free: Mutex<usize>,
    freed: Condvar,
}

impl Slots {
    fn acquire(&self) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        while *free == 0 {
            free = self.freed.wait(free).unwrap_or_else(|p| p.into_inner());
        }
        *free -= 1;
    }

    fn release(&self) {
        *self.free.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.freed.notify_one();
    }
}

/// Blocks until `stream` has bytes (or EOF) to read, without reading them.
fn wait_readable(stream: &TcpStream) -> std::io::Result<()> {
    let mut poll = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd.
        let ready = unsafe { libc::poll(&mut poll, 1, -1) };
        if ready >= 0 {
            return Ok(());
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Style {
    Plain,
    Split,
    Early,
    Nonblocking,
    Handoff,
    HandoffPark,
    ServerClose,
    Spin,
}

impl Style {
    fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "plain" => Self::Plain,
            "split" => Self::Split,
            "early" => Self::Early,
            "nonblocking" => Self::Nonblocking,
            "handoff" => Self::Handoff,
            "handoff-park" => Self::HandoffPark,
            "server-close" => Self::ServerClose,
            "spin" => Self::Spin,
            _ => return None,
        })
    }
}

/// Reads exactly `buffer.len()` bytes; `false` on EOF before the first byte. A
/// non-blocking socket is polled on EAGAIN, as an event loop would.
fn read_exact_or_eof(stream: &mut TcpStream, buffer: &mut [u8]) -> std::io::Result<bool> {
    let mut done = 0;
    while done < buffer.len() {
        match stream.read(&mut buffer[done..]) {
            Ok(0) if done == 0 => return Ok(false),
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(read) => done += read,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                wait_readable(stream)?;
            }
            Err(error) => return Err(error),
        }
    }
    Ok(true)
}

/// Serves one request; `false` when the client closed instead.
fn serve_one(
    stream: &mut TcpStream,
    style: Style,
    service: Duration,
    responder: Option<&Responder>,
) -> std::io::Result<Option<Duration>> {
    let mut request = [0u8; 4];
    let started;
    match style {
        Style::Split | Style::Early => {
            if !read_exact_or_eof(stream, &mut request[..2])? {
                return Ok(None);
            }
            started = Instant::now();
            if style == Style::Early {
                stream.write_all(b"o")?;
            }
            read_exact_or_eof(stream, &mut request[2..])?;
        }
        _ => {
            if !read_exact_or_eof(stream, &mut request)? {
                return Ok(None);
            }
            started = Instant::now();
            if style == Style::Nonblocking {
                // The next read finds nothing: EAGAIN, which must not count as a read.
                let mut more = [0u8; 1];
                match stream.read(&mut more) {
                    Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
                    other => {
                        return Err(std::io::Error::other(format!("expected EAGAIN: {other:?}")));
                    }
                }
            }
        }
    }
    if style == Style::Spin {
        let cpu_started = thread_cpu_time();
        while thread_cpu_time().saturating_sub(cpu_started) < service {}
    } else {
        std::thread::sleep(service.saturating_sub(started.elapsed()));
    }
    let took = match (style, responder) {
        (Style::Handoff | Style::HandoffPark, Some(responder)) => {
            responder.answer(stream, started)?
        }
        (Style::Split, _) => {
            stream.write_all(b"o")?;
            std::thread::sleep(Duration::from_millis(1));
            stream.write_all(b"k\n")?;
            started.elapsed()
        }
        (Style::Early, _) => {
            stream.write_all(b"k\n")?;
            started.elapsed()
        }
        _ => {
            stream.write_all(b"ok\n")?;
            started.elapsed()
        }
    };
    Ok(Some(took))
}

/// The calling thread's CPU time.
fn thread_cpu_time() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a valid timespec to write; this clock exists on every Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// How long the reading thread of `handoff-park` stays blocked after the answer.
const PARK: Duration = Duration::from_secs(1);

/// Another thread that writes the responses of one connection (`handoff`), on the
/// same fd, as a worker handed a connection by an I/O thread does; it tells the reading
/// thread `park` after it answered.
struct Responder {
    requests: std::sync::mpsc::Sender<(RawFd, Instant)>,
    done: std::sync::mpsc::Receiver<std::io::Result<Duration>>,
}

impl Responder {
    fn start(park: Duration) -> Self {
        let (requests, incoming) = std::sync::mpsc::channel::<(RawFd, Instant)>();
        let (finished, done) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for (fd, started) in incoming {
                // SAFETY: the reading thread keeps the fd open until we answer, and
                // ManuallyDrop keeps us from closing it.
                let mut stream = ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd) });
                let written = stream.write_all(b"ok\n").map(|()| started.elapsed());
                std::thread::sleep(park);
                let _ = finished.send(written);
            }
        });
        Self { requests, done }
    }

    fn answer(&self, stream: &TcpStream, started: Instant) -> std::io::Result<Duration> {
        self.requests
            .send((stream.as_raw_fd(), started))
            .map_err(|_| std::io::Error::other("responder gone"))?;
        self.done
            .recv()
            .map_err(|_| std::io::Error::other("responder gone"))?
    }
}

fn serve(
    mut stream: TcpStream,
    slots: &Slots,
    service: Duration,
    style: Style,
    served: &Mutex<Vec<u64>>,
) -> std::io::Result<()> {
    stream.set_nonblocking(style == Style::Nonblocking)?;
    let responder = match style {
        Style::Handoff => Some(Responder::start(Duration::ZERO)),
        Style::HandoffPark => Some(Responder::start(PARK)),
        _ => None,
    };
    loop {
        wait_readable(&stream)?;
        slots.acquire();
        let result = serve_one(&mut stream, style, service, responder.as_ref());
        slots.release();
        let Some(took) = result? else {
            return Ok(());
        };
        served
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(took.as_nanos() as u64);
        if style == Style::ServerClose {
            return Ok(());
        }
    }
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let workers = args.first().and_then(|a| a.parse::<usize>().ok());
    let service_us = args.get(1).and_then(|a| a.parse::<u64>().ok());
    let style = Style::parse(args.get(2).map_or("plain", String::as_str));
    // A given port lets two servers in two network namespaces share it, as pods do.
    let port = args.get(3).map_or(Some(0), |a| a.parse::<u16>().ok());
    // A given address lets two servers share a port in one namespace.
    let address = args
        .get(4)
        .map_or(Some(std::net::Ipv4Addr::LOCALHOST), |a| a.parse().ok());
    let (Some(workers), Some(service_us), Some(style), Some(port), Some(address)) =
        (workers, service_us, style, port, address)
    else {
        eprintln!(
            "usage: poolserver <workers> <service_us> [plain|split|early|nonblocking|handoff|handoff-park|server-close|spin] [port] [address]"
        );
        std::process::exit(2);
    };
    let listener = TcpListener::bind((address, port))?;
    println!("port {}", listener.local_addr()?.port());
    let slots = Arc::new(Slots {
        free: Mutex::new(workers),
        freed: Condvar::new(),
    });
    let served = Arc::new(Mutex::new(Vec::new()));
    let service = Duration::from_micros(service_us);
    {
        let (slots, served) = (slots.clone(), served.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (slots, served) = (slots.clone(), served.clone());
                std::thread::spawn(move || {
                    let _ = serve(stream, &slots, service, style, &served);
                });
            }
        });
    }
    // Serve until the test closes stdin.
    wait_for_stdin_close()?;
    let mut served = served.lock().unwrap_or_else(|p| p.into_inner()).clone();
    served.sort_unstable();
    let count = served.len() as u64;
    let mean = served.iter().sum::<u64>().checked_div(count).unwrap_or(0);
    let p50 = served.get(served.len() / 2).copied().unwrap_or(0);
    println!("served {count} {mean} {p50}");
    Ok(())
}
