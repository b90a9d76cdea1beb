//! A request/response server whose truth the tests know: at most `workers` requests
//! are served at once, each for `service_us` µs. A thread per connection waits until
//! the connection is readable, then for a free worker slot, and only then reads, so
//! requests queue where a real pool's do: accepted and unread (one request per
//! connection) or arrived and unread (keep-alive).
//!
//! Protocol: a request is a line; the response is `ok\n`. Usage:
//! `poolserver <workers> <service_us>`; prints `port <n>`, then serves until stdin
//! closes, then prints `served <count> <mean service ns> <p50 service ns>`: its own
//! measure of each request from the read's return to the write's start.
use std::{
    io::{BufRead as _, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    sync::{Arc, Condvar, Mutex},
    time::{Duration, Instant},
};

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

fn serve(
    mut stream: TcpStream,
    slots: &Slots,
    service: Duration,
    served: &Mutex<Vec<u64>>,
) -> std::io::Result<()> {
    let mut buffer = [0u8; 256];
    loop {
        wait_readable(&stream)?;
        slots.acquire();
        let result: std::io::Result<bool> = (|| {
            let read = stream.read(&mut buffer)?;
            if read == 0 {
                return Ok(false);
            }
            let started = Instant::now();
            std::thread::sleep(service.saturating_sub(started.elapsed()));
            let took = started.elapsed();
            stream.write_all(b"ok\n")?;
            served
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(took.as_nanos() as u64);
            Ok(true)
        })();
        slots.release();
        if !result? {
            return Ok(());
        }
    }
}

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<u64>().ok());
    let (Some(Some(workers)), Some(Some(service_us))) = (args.next(), args.next()) else {
        eprintln!("usage: poolserver <workers> <service_us>");
        std::process::exit(2);
    };
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", listener.local_addr()?.port());
    let slots = Arc::new(Slots {
        free: Mutex::new(workers as usize),
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
                    let _ = serve(stream, &slots, service, &served);
                });
            }
        });
    }
    // Serve until the test closes stdin.
    for line in std::io::stdin().lock().lines() {
        line?;
    }
    let mut served = served.lock().unwrap_or_else(|p| p.into_inner()).clone();
    served.sort_unstable();
    let count = served.len() as u64;
    let mean = served.iter().sum::<u64>().checked_div(count).unwrap_or(0);
    let p50 = served.get(served.len() / 2).copied().unwrap_or(0);
    println!("served {count} {mean} {p50}");
    Ok(())
}
