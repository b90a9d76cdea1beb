//! What an uncontended `pthread_mutex_lock` costs a watched process, for `cargo xtask
//! bench` (`BENCH_ONLY=locks`): a tight loop of lock/unlock pairs on a private,
//! never-contended glibc mutex, timed in-process with the monotonic clock. An
//! uncontended lock never enters the kernel, so without the opt-in uprobes poolscope
//! cannot add to it; with them, each `pthread_mutex_lock` call traps twice (entry and
//! return), whether or not the program records anything.
//!
//! The loop runs in two places:
//! - in a request: thread `looper` serves TCP connections one after another; each line
//!   `loop <pairs>\n` it reads is a request (the thread holds it while it loops) and
//!   is answered by `<ns>\n`, the time the pairs took (keep-alive: several lines per
//!   connection);
//! - outside any request: the main thread runs it for each line `loop <pairs>` read on
//!   stdin (a pipe, not a request) and prints `ns <ns>`.
//!
//! Usage: `mutexloop`. Prints `port <n>` and `looper <tid>`, then serves until stdin
//! closes.
use std::{
    cell::UnsafeCell,
    io::{BufRead as _, BufReader, Write as _},
    net::{TcpListener, TcpStream},
    sync::mpsc::channel,
    thread::Builder,
    time::Instant,
};

use poolscope_tests::gettid;

/// A glibc default mutex owned by one thread, which nothing else ever takes.
struct PrivateMutex(Box<UnsafeCell<libc::pthread_mutex_t>>);

impl PrivateMutex {
    fn new() -> Self {
        // Boxed: a pthread mutex must not move once used.
        Self(Box::new(UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER)))
    }

    /// Locks and unlocks it `pairs` times; the time that took, in ns. Never inlined,
    /// and the calls are to libc through the PLT: the loop is what a C caller does.
    #[inline(never)]
    fn lock_loop(&self, pairs: u64) -> u64 {
        let mutex = self.0.get();
        let started = Instant::now();
        for _ in 0..pairs {
            // SAFETY: a valid, initialized mutex that does not move (boxed), locked
            // and unlocked by this thread only, each lock paired with one unlock.
            unsafe {
                libc::pthread_mutex_lock(mutex);
                libc::pthread_mutex_unlock(mutex);
            }
        }
        started.elapsed().as_nanos() as u64
    }
}

impl Drop for PrivateMutex {
    fn drop(&mut self) {
        // SAFETY: unlocked (every lock was paired with an unlock) and no longer used.
        unsafe { libc::pthread_mutex_destroy(self.0.get()) };
    }
}

/// The pair count of a `loop <pairs>` line.
fn pairs(line: &str) -> Option<u64> {
    line.trim_end().strip_prefix("loop ")?.parse().ok()
}

/// Serves one connection: each `loop <pairs>` line is a request.
fn serve(stream: TcpStream, mutex: &PrivateMutex) -> std::io::Result<()> {
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let Some(pairs) = pairs(&line) else {
            writer.write_all(b"error: expected loop <pairs>\n")?;
            continue;
        };
        let ns = mutex.lock_loop(pairs);
        writer.write_all(format!("{ns}\n").as_bytes())?;
    }
}

fn main() -> std::io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "port {}", listener.local_addr()?.port())?;
    stdout.flush()?;

    let (started, tid) = channel::<i64>();
    Builder::new().name("looper".to_owned()).spawn(move || {
        let _ = started.send(gettid());
        drop(started);
        let mutex = PrivateMutex::new();
        for stream in listener.incoming().flatten() {
            let _ = stream.set_nodelay(true);
            let _ = serve(stream, &mutex);
        }
    })?;
    let looper = tid
        .recv()
        .map_err(|_| std::io::Error::other("the looper thread did not start"))?;
    writeln!(stdout, "looper {looper}")?;
    stdout.flush()?;

    let mutex = PrivateMutex::new();
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        match pairs(&line) {
            Some(pairs) => writeln!(stdout, "ns {}", mutex.lock_loop(pairs))?,
            None => writeln!(stdout, "error: expected loop <pairs>")?,
        }
        stdout.flush()?;
    }
    Ok(())
}
