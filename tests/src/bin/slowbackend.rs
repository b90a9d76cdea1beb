//! The slow downstream of the `tests/downstream` servers: an unwatched process that
//! answers each request after a fixed delay, as a database or a backend service would.
//!
//! Usage: `slowbackend <delay_ms> [close]`. Prints `port <n>`, then serves until stdin
//! closes; a line `delay <ms>` on stdin sets the delay of the requests that arrive
//! from then on (a backend that slows down). Each connection carries one request: a line `req\n`, answered `ok\n`, or
//! an HTTP request (first line `GET …`, headers to the blank line), answered with an
//! HTTP/1.0 200 whose body is `ok\n`; then the connection closes. With `close`, the
//! connection closes after the delay without an answer: a downstream that fails
//! mid-wait.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

const HTTP_RESPONSE: &[u8] = b"HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\nok\n";

fn answer(stream: TcpStream, delay: Duration, close: bool) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let http = line.starts_with("GET ");
    if http {
        // The headers, to the blank line.
        loop {
            line.clear();
            if reader.read_line(&mut line)? == 0 || line.trim_end().is_empty() {
                break;
            }
        }
    }
    std::thread::sleep(delay);
    if close {
        return Ok(());
    }
    let mut stream = stream;
    stream.write_all(if http { HTTP_RESPONSE } else { b"ok\n" })
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (delay_ms, close) = match args.as_slice() {
        [_, delay_ms] => (delay_ms, false),
        [_, delay_ms, close] if close == "close" => (delay_ms, true),
        _ => anyhow::bail!("usage: slowbackend <delay_ms> [close]"),
    };
    let delay_ms = Arc::new(AtomicU64::new(delay_ms.parse()?));
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", listener.local_addr()?.port());
    let current = delay_ms.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let delay = Duration::from_millis(current.load(Ordering::Relaxed));
            std::thread::spawn(move || answer(stream, delay, close));
        }
    });
    for line in std::io::stdin().lines() {
        let line = line?;
        match line.strip_prefix("delay ").map(str::parse) {
            Some(Ok(ms)) => delay_ms.store(ms, Ordering::Relaxed),
            _ => anyhow::bail!("slowbackend: unknown command {line:?}"),
        }
    }
    Ok(())
}
