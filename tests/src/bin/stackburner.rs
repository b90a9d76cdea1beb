//! A program whose stacks the tests know: the ground truth for stack snapshots
//! (on-CPU samples, off-CPU waits, and the flame graphs and profiles made of them).
//! Two named threads:
//! - `burner-1` (pool `burner`) only burns CPU, in two never-inlined functions,
//!   `burn_three_quarters` and `burn_one_quarter`, 3 ms then 1 ms of its own CPU time
//!   per round (CLOCK_THREAD_CPUTIME_ID), so that 3/4 of its samples should name the
//!   first; it never blocks;
//! - `sleeper-1` (pool `sleeper`) calls `sleep_in_named_function`, which sleeps
//!   `sleep_ms` in nanosleep, over and over, timing each call with the monotonic clock.
//!
//! Both wait for the measured phase, started by a connection to the program's port that
//! sends `go\n` (answered `ok\n`): the test starts it once poolscope follows the threads.
//!
//! Usage: `stackburner <seconds> <sleep_ms>` (`sleep_ms` may be fractional). Prints
//! `port <n>`, `workers <burner tid>,<sleeper tid>`, and when the phase has run its seconds
//! `burner cpu_ns <n> three_quarters_ns <n> one_quarter_ns <n> rounds <n>`
//! (cpu_ns: the burner thread's whole CPU time; the other two: CPU time inside each
//! function), `sleeper slept_ns <n> sleeps <n> running_ns <n> runnable_ns <n>` (the
//! sleep calls' total monotonic time and count, and the sleeper's time on a CPU and in
//! the run queue over the phase, from its schedstat) and `done`; exits when stdin
//! closes.
use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::TcpListener,
    sync::mpsc::{Receiver, Sender, channel},
    time::{Duration, Instant},
};

use poolscope_tests::{start_named_workers, wait_for_stdin_close, workers_line};

/// Iterations of the burn loop between two reads of the thread's CPU clock: ~20 µs,
/// so that the clock's system call (whose samples the frame-pointer unwinder cannot
/// attribute to the burn function: glibc has no frame pointers) is ~1 % of the time.
const CHUNK: u64 = 20_000;

/// CPU time of each function per round: 3:1.
const THREE_QUARTERS: Duration = Duration::from_millis(3);
const ONE_QUARTER: Duration = Duration::from_millis(1);

/// The calling thread's CPU time in ns. Never inlined: a sample taken inside the
/// clock's system call loses the innermost frame with a frame pointer (this one), not
/// the burn function that called it.
#[inline(never)]
fn thread_cpu_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

/// `CHUNK` dependent multiplications of `value` by `factor`, in machine code: the
/// compiler can neither remove them nor turn them into function calls. (In a debug
/// build, Rust's loop and arithmetic helpers are calls made every iteration, and a
/// sample taken in a callee's prologue or epilogue unwinds past the burn function:
/// ~10 % of the samples named neither.)
#[inline(always)]
fn spin(value: u64, factor: u64) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        let mut value = value;
        // SAFETY: registers only: no memory, no stack, no flags anyone reads.
        unsafe {
            std::arch::asm!(
                "2:",
                "imul {value}, {factor}",
                "dec {count}",
                "jnz 2b",
                value = inout(reg) value,
                factor = in(reg) factor,
                count = inout(reg) CHUNK => _,
                options(nomem, nostack),
            );
        }
        value
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let mut value = value;
        for _ in 0..CHUNK {
            // black_box: the loop's result is "used", so it is not optimized away.
            value = std::hint::black_box(value.wrapping_mul(factor));
        }
        value
    }
}

/// Burns `budget` of the thread's CPU time; returns the CPU ns it took. `factor`
/// differs per caller so that the two burn functions' bodies differ: LLVM merges
/// identical functions, and both names would then be one address (one symbol).
#[inline(always)]
fn burn(budget: Duration, factor: u64) -> u64 {
    let budget = budget.as_nanos() as u64;
    let started = thread_cpu_ns();
    let mut value = 1;
    loop {
        value = spin(value, factor);
        let spent = thread_cpu_ns().saturating_sub(started);
        if spent >= budget {
            std::hint::black_box(value);
            return spent;
        }
    }
}

#[inline(never)]
fn burn_three_quarters() -> u64 {
    burn(THREE_QUARTERS, 1_442_695_040_888_963_407)
}

#[inline(never)]
fn burn_one_quarter() -> u64 {
    burn(ONE_QUARTER, 1_013_904_223)
}

/// What the burner measured.
struct Burned {
    cpu_ns: u64,
    three_quarters_ns: u64,
    one_quarter_ns: u64,
    rounds: u64,
}

fn burner(start: Receiver<Instant>, report: Sender<Burned>) {
    let Ok(deadline) = start.recv() else {
        return;
    };
    let mut burned = Burned {
        cpu_ns: 0,
        three_quarters_ns: 0,
        one_quarter_ns: 0,
        rounds: 0,
    };
    while Instant::now() < deadline {
        burned.three_quarters_ns += burn_three_quarters();
        burned.one_quarter_ns += burn_one_quarter();
        burned.rounds += 1;
    }
    // The thread's whole CPU time: the profiler samples all of it (the time before
    // the phase, waiting, is µs).
    burned.cpu_ns = thread_cpu_ns();
    let _ = report.send(burned);
}

/// Sleeps `duration` (through one more never-inlined call, so that the frame the
/// unwinder loses in glibc's nanosleep is that one, not this); the monotonic ns it took.
#[inline(never)]
fn sleep_in_named_function(duration: Duration) -> u64 {
    let started = Instant::now();
    nap(duration);
    started.elapsed().as_nanos() as u64
}

#[inline(never)]
fn nap(duration: Duration) {
    std::thread::sleep(duration);
}

/// What the sleeper measured.
struct Slept {
    slept_ns: u64,
    sleeps: u64,
    /// The thread's time on a CPU and waiting in the run queue over the phase (its
    /// schedstat), part of the time the sleep calls took but not of their blocked time.
    running_ns: u64,
    runnable_ns: u64,
}

/// The calling thread's time on a CPU and in the run queue, in ns (schedstat).
fn own_schedstat() -> std::io::Result<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat")?;
    let mut fields = text.split_whitespace().map(str::parse::<u64>);
    match (fields.next(), fields.next()) {
        (Some(Ok(running)), Some(Ok(runnable))) => Ok((running, runnable)),
        _ => Err(std::io::Error::other(format!("schedstat {text:?}"))),
    }
}

fn sleeper(nap: Duration, start: Receiver<Instant>, report: Sender<std::io::Result<Slept>>) {
    let Ok(deadline) = start.recv() else {
        return;
    };
    let measured = (|| {
        let before = own_schedstat()?;
        let (mut slept_ns, mut sleeps) = (0, 0);
        while Instant::now() < deadline {
            slept_ns += sleep_in_named_function(nap);
            sleeps += 1;
        }
        let after = own_schedstat()?;
        Ok(Slept {
            slept_ns,
            sleeps,
            running_ns: after.0.saturating_sub(before.0),
            runnable_ns: after.1.saturating_sub(before.1),
        })
    })();
    let _ = report.send(measured);
}

/// Accepts connections until one sends `go`; answers it `ok`.
fn wait_for_go(listener: &TcpListener) -> std::io::Result<()> {
    for stream in listener.incoming() {
        let mut stream = stream?;
        let mut line = String::new();
        BufReader::new(&stream).read_line(&mut line)?;
        if line.trim() == "go" {
            stream.write_all(b"ok\n")?;
            return Ok(());
        }
    }
    Err(std::io::Error::other("listener closed"))
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let seconds = args.first().and_then(|a| a.parse::<f64>().ok());
    let phase = seconds.and_then(|s| Duration::try_from_secs_f64(s).ok());
    let nap = args
        .get(1)
        .and_then(|a| a.parse::<f64>().ok())
        .and_then(|ms| Duration::try_from_secs_f64(ms / 1e3).ok());
    let (Some(phase), Some(nap)) = (phase, nap.filter(|nap| !nap.is_zero())) else {
        eprintln!("usage: stackburner <seconds> <sleep_ms>");
        std::process::exit(2);
    };
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "port {}", listener.local_addr()?.port())?;
    stdout.flush()?;

    let (start_burner, burner_start) = channel();
    let (burner_report, burned) = channel();
    let mut burner_start = Some(burner_start);
    let mut tids = start_named_workers(1, "burner", |_| {
        let start = burner_start
            .take()
            .ok_or(std::io::ErrorKind::InvalidInput)?;
        let report = burner_report.clone();
        Ok(move || burner(start, report))
    })?;
    drop(burner_report);
    let (start_sleeper, sleeper_start) = channel();
    let (sleeper_report, slept) = channel();
    let mut sleeper_start = Some(sleeper_start);
    tids.extend(start_named_workers(1, "sleeper", |_| {
        let start = sleeper_start
            .take()
            .ok_or(std::io::ErrorKind::InvalidInput)?;
        let report = sleeper_report.clone();
        Ok(move || sleeper(nap, start, report))
    })?);
    drop(sleeper_report);
    writeln!(stdout, "{}", workers_line(&tids))?;
    stdout.flush()?;

    wait_for_go(&listener)?;
    let deadline = Instant::now() + phase;
    let started = start_burner.send(deadline).is_ok() && start_sleeper.send(deadline).is_ok();
    let (Ok(burned), Ok(slept)) = (burned.recv(), slept.recv()) else {
        return Err(std::io::Error::other(format!(
            "a worker ended without reporting (started: {started})"
        )));
    };
    let slept = slept?;
    writeln!(
        stdout,
        "burner cpu_ns {} three_quarters_ns {} one_quarter_ns {} rounds {}",
        burned.cpu_ns, burned.three_quarters_ns, burned.one_quarter_ns, burned.rounds
    )?;
    writeln!(
        stdout,
        "sleeper slept_ns {} sleeps {} running_ns {} runnable_ns {}",
        slept.slept_ns, slept.sleeps, slept.running_ns, slept.runnable_ns
    )?;
    writeln!(stdout, "done")?;
    stdout.flush()?;
    wait_for_stdin_close()
}
