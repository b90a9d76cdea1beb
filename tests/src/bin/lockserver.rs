//! A server whose request handlers contend for one `pthread_mutex_t`: the ground
//! truth for lock-wait metrics. `workers` threads (`locker-1` …) each accept a
//! connection, read its request, take the mutex, hold it for the hold time on CPU,
//! release it, answer and close. Each worker times its own `pthread_mutex_lock`
//! calls with the monotonic clock; a call counts as blocked when `trylock` just
//! before it failed (the mutex was held, so the call had to wait).
//!
//! Protocol: one request per connection, `req\n` answered by `ok\n` (the tests' load
//! generators speak it). Usage: `lockserver <workers> <hold_us>`. Prints `port <n>`,
//! `workers <tid>,...`, then serves until stdin closes and prints
//! `locks <calls> <blocked>`, `blocked_ns <ns> ...` (each blocked call's duration,
//! ascending: tests compare whole distributions, not a few percentiles) and
//! `served <count>`.
use std::{
    cell::UnsafeCell,
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use poolscope_tests::{start_named_workers, wait_for_stdin_close, workers_line};

/// The one contended mutex, a plain glibc default mutex (what C, C++ and most
/// runtimes' native code use), so that the opt-in `pthread_mutex_lock` probes see it.
struct PthreadMutex(UnsafeCell<libc::pthread_mutex_t>);

// SAFETY: pthread mutexes are made to be shared between threads; it is only used
// through the pthread functions and never moved once threads use it (it is static).
unsafe impl Sync for PthreadMutex {}

static THE_MUTEX: PthreadMutex = PthreadMutex(UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER));

/// What the workers saw of their own lock calls.
#[derive(Default)]
struct LockTimes {
    calls: u64,
    /// Duration in ns of each call that blocked.
    blocked: Vec<u64>,
    served: u64,
}

/// Takes THE_MUTEX and spins on it for `hold`; returns how long the lock call took
/// if it blocked. Never inlined: its name must appear in the stack of the wait.
#[inline(never)]
fn contend_for_the_mutex(hold: Duration) -> Option<u64> {
    let mutex = THE_MUTEX.0.get();
    // SAFETY: a valid, initialized static mutex; every lock is paired with one unlock.
    let blocked = unsafe {
        if libc::pthread_mutex_trylock(mutex) == 0 {
            None
        } else {
            let started = Instant::now();
            libc::pthread_mutex_lock(mutex);
            Some(started.elapsed().as_nanos() as u64)
        }
    };
    let held = Instant::now();
    while held.elapsed() < hold {}
    // SAFETY: this thread holds the mutex.
    unsafe { libc::pthread_mutex_unlock(mutex) };
    blocked
}

fn read_request(stream: &mut TcpStream) -> std::io::Result<()> {
    let mut request = [0u8; 64];
    let mut length = 0;
    while !request[..length].ends_with(b"\n") {
        if length == request.len() {
            return Err(std::io::Error::other("request line too long"));
        }
        let read = stream.read(&mut request[length..])?;
        if read == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        length += read;
    }
    Ok(())
}

fn worker(listener: &TcpListener, hold: Duration, times: &Mutex<LockTimes>) {
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        };
        if read_request(&mut stream).is_err() {
            continue;
        }
        let blocked = contend_for_the_mutex(hold);
        let answered = stream.write_all(b"ok\n").is_ok();
        let mut times = times.lock().unwrap_or_else(|p| p.into_inner());
        times.calls += 1;
        times.blocked.extend(blocked);
        times.served += u64::from(answered);
    }
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let workers = args.first().and_then(|a| a.parse::<usize>().ok());
    let hold_us = args.get(1).and_then(|a| a.parse::<u64>().ok());
    let (Some(workers @ 1..), Some(hold_us)) = (workers, hold_us) else {
        eprintln!("usage: lockserver <workers> <hold_us>");
        std::process::exit(2);
    };
    let hold = Duration::from_micros(hold_us);
    let listener = Arc::new(TcpListener::bind("127.0.0.1:0")?);
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "port {}", listener.local_addr()?.port())?;
    stdout.flush()?;

    let times = Arc::new(Mutex::new(LockTimes::default()));
    let tids = start_named_workers(workers, "locker", |_| {
        let (listener, times) = (listener.clone(), times.clone());
        Ok(move || worker(&listener, hold, &times))
    })?;
    writeln!(stdout, "{}", workers_line(&tids))?;
    stdout.flush()?;

    wait_for_stdin_close()?;
    let mut times = times.lock().unwrap_or_else(|p| p.into_inner());
    times.blocked.sort_unstable();
    writeln!(stdout, "locks {} {}", times.calls, times.blocked.len())?;
    let durations: Vec<String> = times.blocked.iter().map(u64::to_string).collect();
    writeln!(stdout, "blocked_ns {}", durations.join(" "))?;
    writeln!(stdout, "served {}", times.served)?;
    stdout.flush()?;
    Ok(())
}
