//! A thread-pool server whose thread states the tests know: the ground truth for the
//! thread-state metrics. One `acceptor` thread accepts connections onto a FIFO queue;
//! `worker-1` … `worker-N` each wait on that queue's condition variable while idle (a
//! futex wait holding no request), take one connection, read its request, spend the
//! service time in one known state, answer, close, and wait again.
//!
//! Protocol: one request per connection; the request is `req\n`, the response `ok\n`.
//! Usage: `threadpool <workers> <service_us> <spin|sleep|lock>`. Prints `port <n>`,
//! then `workers <tid>,<tid>,...` (kernel tids, in worker order) once every thread has
//! started, then serves until stdin closes, then prints `served <count> <busy ns>`:
//! the requests answered, and the sum over them of the time from the read that
//! returned the request to the return of the write of the response. Each line `busy`
//! on stdin is answered by `busy <count> <busy ns>`, the same totals so far (the
//! per-window truth of a test: what the workers really spent, oversleeping included).
//! Errors on single
//! connections (a client that left early) only count; their number goes to stderr as
//! `errors <n>` when nonzero.
//!
//! How a worker spends the service time:
//! - `spin`: on CPU, polling the clock;
//! - `sleep`: in one nanosleep;
//! - `lock`: blocked on a mutex that the worker's partner thread `holder-<i>` holds
//!   for the service time, so the worker's wait is a futex wait on a lock, not a
//!   sleep of its own.
use std::{
    collections::VecDeque,
    io::{BufRead as _, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicU64, Ordering},
        mpsc::{Receiver, Sender, channel},
    },
    thread::Builder,
    time::{Duration, Instant},
};

use poolscope_tests::{start_named_workers, workers_line};

/// The kernel's listen backlog cap by default (net.core.somaxconn); open-loop bursts
/// must queue in the kernel, not be dropped and retried a second later.
const BACKLOG: i32 = 4096;

/// A request line longer than this is not `req\n`.
const MAX_REQUEST: usize = 64;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Work {
    Spin,
    Sleep,
    Lock,
}

impl Work {
    fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "spin" => Self::Spin,
            "sleep" => Self::Sleep,
            "lock" => Self::Lock,
            _ => return None,
        })
    }
}

/// The pool's queue of accepted, unread connections.
struct Queue {
    state: Mutex<QueueState>,
    /// Signalled when a connection arrives or the pool stops.
    changed: Condvar,
    /// Signalled when a worker exits.
    exited: Condvar,
}

struct QueueState {
    connections: VecDeque<TcpStream>,
    stopping: bool,
    running_workers: usize,
}

impl Queue {
    fn push(&self, stream: TcpStream) {
        self.lock().connections.push_back(stream);
        self.changed.notify_one();
    }

    /// The next connection, waiting for one; `None` once the pool stops.
    fn pop(&self) -> Option<TcpStream> {
        let mut state = self.lock();
        loop {
            if state.stopping {
                return None;
            }
            if let Some(stream) = state.connections.pop_front() {
                return Some(stream);
            }
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What the pool did, summed over workers.
#[derive(Default)]
struct Totals {
    served: AtomicU64,
    busy_ns: AtomicU64,
    errors: AtomicU64,
}

/// A worker's partner for `lock` work: takes `lock` when asked, says so, and holds it
/// for the service time.
struct Holder {
    lock: Arc<Mutex<()>>,
    hold: Sender<()>,
    holding: Receiver<()>,
}

impl Holder {
    fn start(index: usize, service: Duration) -> std::io::Result<Self> {
        let lock = Arc::new(Mutex::new(()));
        let (hold, hold_requests) = channel::<()>();
        let (holding_sender, holding) = channel::<()>();
        let held = lock.clone();
        Builder::new()
            .name(format!("holder-{index}"))
            .spawn(move || {
                // Started (and named): the workers line may go out.
                if holding_sender.send(()).is_err() {
                    return;
                }
                for () in hold_requests {
                    let guard = held.lock().unwrap_or_else(|p| p.into_inner());
                    if holding_sender.send(()).is_err() {
                        return;
                    }
                    std::thread::sleep(service);
                    drop(guard);
                }
            })?;
        holding
            .recv()
            .map_err(|_| std::io::Error::other("holder thread did not start"))?;
        Ok(Self {
            lock,
            hold,
            holding,
        })
    }

    /// Blocks on the mutex for about the service time: the holder takes it first.
    fn wait_for_lock(&self) -> std::io::Result<()> {
        let gone = || std::io::Error::other("holder thread gone");
        self.hold.send(()).map_err(|_| gone())?;
        // Wait until the holder has the mutex, so that our lock() below blocks.
        self.holding.recv().map_err(|_| gone())?;
        drop(self.lock.lock().unwrap_or_else(|p| p.into_inner()));
        Ok(())
    }
}

/// Reads up to and including the `\n` of the request; the read that returns it is
/// where the service time starts.
fn read_request(stream: &mut TcpStream) -> std::io::Result<()> {
    let mut request = [0u8; MAX_REQUEST];
    let mut length = 0;
    loop {
        let read = stream.read(&mut request[length..])?;
        if read == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        length += read;
        if request[..length].ends_with(b"\n") {
            return Ok(());
        }
        if length == request.len() {
            return Err(std::io::Error::other("request line too long"));
        }
    }
}

/// Serves the one request of `stream`; the time from the request's read to the
/// response's write.
fn serve(
    stream: &mut TcpStream,
    work: Work,
    service: Duration,
    holder: Option<&Holder>,
) -> std::io::Result<Duration> {
    read_request(stream)?;
    let started = Instant::now();
    match (work, holder) {
        (Work::Spin, _) => while started.elapsed() < service {},
        (Work::Sleep, _) => std::thread::sleep(service),
        (Work::Lock, Some(holder)) => holder.wait_for_lock()?,
        (Work::Lock, None) => return Err(std::io::Error::other("lock work without a holder")),
    }
    stream.write_all(b"ok\n")?;
    Ok(started.elapsed())
}

fn worker(queue: &Queue, totals: &Totals, work: Work, service: Duration, holder: Option<Holder>) {
    while let Some(mut stream) = queue.pop() {
        match serve(&mut stream, work, service, holder.as_ref()) {
            Ok(busy) => {
                totals.served.fetch_add(1, Ordering::Relaxed);
                totals
                    .busy_ns
                    .fetch_add(busy.as_nanos() as u64, Ordering::Relaxed);
            }
            Err(_) => {
                totals.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        // One request per connection: dropping the stream closes it.
    }
    queue.lock().running_workers -= 1;
    queue.exited.notify_all();
}

fn acceptor(listener: &TcpListener, queue: &Queue, totals: &Totals) {
    for stream in listener.incoming() {
        match stream {
            Ok(stream) => queue.push(stream),
            Err(_) => {
                totals.errors.fetch_add(1, Ordering::Relaxed);
                // Out of fds or similar: let the workers close some before retrying.
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let workers = args
        .first()
        .and_then(|a| a.parse::<usize>().ok())
        .filter(|&w| w > 0);
    let service_us = args.get(1).and_then(|a| a.parse::<u64>().ok());
    let work = args.get(2).and_then(|a| Work::parse(a));
    let (Some(workers), Some(service_us), Some(work)) = (workers, service_us, work) else {
        eprintln!("usage: threadpool <workers> <service_us> <spin|sleep|lock>");
        std::process::exit(2);
    };
    let service = Duration::from_micros(service_us);

    let listener = TcpListener::bind("127.0.0.1:0")?;
    // std listens with a backlog of 128; listen() again on a listening socket only
    // changes the backlog (the kernel caps it at net.core.somaxconn).
    // SAFETY: listen(2) on a socket we own.
    if unsafe { libc::listen(listener.as_raw_fd(), BACKLOG) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "port {}", listener.local_addr()?.port())?;
    stdout.flush()?;

    let queue = Arc::new(Queue {
        state: Mutex::new(QueueState {
            connections: VecDeque::new(),
            stopping: false,
            running_workers: workers,
        }),
        changed: Condvar::new(),
        exited: Condvar::new(),
    });
    let totals = Arc::new(Totals::default());
    {
        let (queue, totals) = (queue.clone(), totals.clone());
        let (running, acceptor_started) = channel::<()>();
        // std names the thread from inside it (pthread_setname_np), which sets its comm.
        Builder::new().name("acceptor".to_owned()).spawn(move || {
            let _ = running.send(());
            acceptor(&listener, &queue, &totals);
        })?;
        acceptor_started
            .recv()
            .map_err(|_| std::io::Error::other("acceptor thread did not start"))?;
    }
    let tids = start_named_workers(workers, "worker", |index| {
        let holder = match work {
            Work::Lock => Some(Holder::start(index, service)?),
            _ => None,
        };
        let (queue, totals) = (queue.clone(), totals.clone());
        Ok(move || worker(&queue, &totals, work, service, holder))
    })?;
    writeln!(stdout, "{}", workers_line(&tids))?;
    stdout.flush()?;

    // Serve until the test closes stdin; each `busy` line asks for the totals so far.
    for line in std::io::stdin().lock().lines() {
        if line?.trim() == "busy" {
            print_totals(&mut stdout, "busy", &totals)?;
        }
    }
    // Let the workers finish the requests in progress, so that a response the client
    // already has is counted; a client that never sends its request must not keep us.
    let finish_by = Instant::now() + service + Duration::from_secs(5);
    let mut state = queue.lock();
    state.stopping = true;
    queue.changed.notify_all();
    while state.running_workers > 0 {
        let left = finish_by.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        state = queue
            .exited
            .wait_timeout(state, left)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
    drop(state);
    let errors = totals.errors.load(Ordering::Relaxed);
    if errors > 0 {
        eprintln!("errors {errors}");
    }
    print_totals(&mut stdout, "served", &totals)
}

/// `<prefix> <requests served> <busy ns>`, the totals so far.
fn print_totals(
    out: &mut impl std::io::Write,
    prefix: &str,
    totals: &Totals,
) -> std::io::Result<()> {
    writeln!(
        out,
        "{prefix} {} {}",
        totals.served.load(Ordering::Relaxed),
        totals.busy_ns.load(Ordering::Relaxed)
    )?;
    out.flush()
}
