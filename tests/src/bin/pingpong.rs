//! A context-switch-heavy load for `cargo xtask bench`, which measures what the
//! scheduler programs (raw tracepoints `sched_switch` and `sched_wakeup`) cost per
//! context switch: two threads, `ping` and `pong`, bounce one byte over two pipes as
//! fast as they can. Pinned to one CPU, a round trip is two context switches (ping →
//! pong → ping) and one or two wakeups (when the woken thread preempts the writer
//! before it blocks in its read, the answer finds the writer runnable: ~1.2 in all),
//! and almost nothing else.
//!
//! Pinned (`--cpu`) rather than free: on separate CPUs every hand-off is a cross-CPU
//! wakeup of a CPU that went idle (an IPI, or the idle loop polling), so a round trip
//! is four switches (each thread to and from the idle task), its time is mostly the
//! hypervisor's wakeup latency, and it varies with where the scheduler puts the
//! threads. On our 2-vCPU test VM, five 3 s runs each: free, 41–48 µs per round trip
//! (±8%); pinned to CPU 1, 5.2–5.6 µs (±3.5%). Pinned, a round trip is nine times
//! shorter and steadier, so the programs' share of it is larger and stands out of the
//! noise, and nearly every switch of the host during a run is one of pingpong's.
//!
//! Usage: `pingpong <seconds> [--cpu <n>] [--wait]`. Runs for `<seconds>`, prints
//! `roundtrips <n> <elapsed_ns>` and exits. `--cpu <n>`: both threads pin themselves
//! to CPU n first. `--wait`: once both threads exist (and are pinned), prints
//! `threads <ping tid>,<pong tid>`, then runs once per line read on stdin, printing
//! the line above after each run, and exits when stdin closes (so that an observer
//! can start watching the process before it runs).
use poolscope_tests::{gettid, pin_to};
use std::{
    io::{BufRead as _, PipeReader, PipeWriter, Read as _, Write as _},
    sync::mpsc::{Receiver, Sender, channel},
    thread::Builder,
    time::{Duration, Instant},
};

/// Round trips between two looks at the clock.
const BATCH: u64 = 64;

/// What a thread says once it started: its name and its tid, or why it could not pin.
type Started = (&'static str, std::io::Result<i64>);

/// Pins the calling thread when asked, then says its tid.
fn start(name: &'static str, cpu: Option<usize>, started: &Sender<Started>) -> bool {
    let result = cpu.map_or(Ok(()), pin_to).map(|()| gettid());
    let ok = result.is_ok();
    let _ = started.send((name, result));
    ok
}

/// One run: (round trips, elapsed) once `duration` has passed.
fn run(
    to_pong: &mut PipeWriter,
    from_pong: &mut PipeReader,
    duration: Duration,
) -> (u64, Duration) {
    let mut byte = [1u8];
    let mut roundtrips = 0;
    let started = Instant::now();
    loop {
        for _ in 0..BATCH {
            if to_pong.write_all(&byte).is_err() || from_pong.read_exact(&mut byte).is_err() {
                return (roundtrips, started.elapsed());
            }
        }
        roundtrips += BATCH;
        let elapsed = started.elapsed();
        if elapsed >= duration {
            return (roundtrips, elapsed);
        }
    }
}

/// `ping`: one run per request, until the requests end.
fn ping(
    mut to_pong: PipeWriter,
    mut from_pong: PipeReader,
    runs: &Receiver<Duration>,
    results: &Sender<(u64, Duration)>,
) {
    for duration in runs {
        if results
            .send(run(&mut to_pong, &mut from_pong, duration))
            .is_err()
        {
            return;
        }
    }
}

/// `pong`: answers every byte until ping's end of the pipe closes.
fn pong(mut from_ping: PipeReader, mut to_ping: PipeWriter) {
    let mut byte = [0u8];
    while from_ping.read_exact(&mut byte).is_ok() {
        if to_ping.write_all(&byte).is_err() {
            return;
        }
    }
}

fn usage() -> ! {
    eprintln!("usage: pingpong <seconds> [--cpu <n>] [--wait]");
    std::process::exit(2);
}

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let Some(duration) = args
        .next()
        .and_then(|a| a.parse::<f64>().ok())
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
    else {
        usage()
    };
    let (mut cpu, mut wait) = (None, false);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--wait" => wait = true,
            "--cpu" => {
                let n = args.next().and_then(|a| a.parse::<usize>().ok());
                match n.filter(|&n| n < libc::CPU_SETSIZE as usize) {
                    Some(n) => cpu = Some(n),
                    None => usage(),
                }
            }
            _ => usage(),
        }
    }

    let (from_ping, to_pong) = std::io::pipe()?;
    let (from_pong, to_ping) = std::io::pipe()?;
    let (started, tids) = channel();
    let (request, runs) = channel::<Duration>();
    let (done, results) = channel();
    let ping_started = started.clone();
    let ping_thread = Builder::new().name("ping".to_owned()).spawn(move || {
        if start("ping", cpu, &ping_started) {
            ping(to_pong, from_pong, &runs, &done);
        }
    })?;
    let pong_thread = Builder::new().name("pong".to_owned()).spawn(move || {
        if start("pong", cpu, &started) {
            pong(from_ping, to_ping);
        }
    })?;
    // A thread that could not pin ends its side of the pipes, so the other ends too.
    let (mut ping_tid, mut pong_tid) = (0, 0);
    for _ in 0..2 {
        match tids.recv().map_err(std::io::Error::other)? {
            ("ping", tid) => ping_tid = tid?,
            (_, tid) => pong_tid = tid?,
        }
    }

    let mut stdout = std::io::stdout().lock();
    if wait {
        writeln!(stdout, "threads {ping_tid},{pong_tid}")?;
        stdout.flush()?;
    }
    let mut run_once = || -> std::io::Result<()> {
        request.send(duration).map_err(std::io::Error::other)?;
        let (roundtrips, elapsed) = results.recv().map_err(std::io::Error::other)?;
        writeln!(stdout, "roundtrips {roundtrips} {}", elapsed.as_nanos())?;
        stdout.flush()
    };
    if wait {
        let stdin = std::io::stdin().lock();
        for line in stdin.lines() {
            line?;
            run_once()?;
        }
    } else {
        run_once()?;
    }
    drop(request);
    let _ = ping_thread.join();
    let _ = pong_thread.join();
    Ok(())
}
