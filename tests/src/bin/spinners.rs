//! Threads that compete for one CPU, for run-queue wait: `spin-1` … `spin-N` each pin
//! themselves to the same CPU and spin, so with two of them each is runnable but not
//! running about half the time.
//!
//! Usage: `spinners <threads> <cpu> <seconds>`. Prints `spinners <tid>,<tid>,...`
//! (kernel tids, in thread order) once every thread has pinned itself, then spins
//! until the seconds have passed or stdin closes, whichever comes first, and exits 0.
use poolscope_tests::{gettid, pin_to};
use std::{
    io::{BufRead as _, Write as _},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc::channel,
    },
    thread::Builder,
    time::{Duration, Instant},
};

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let threads = args
        .first()
        .and_then(|a| a.parse::<usize>().ok())
        .filter(|&t| t > 0);
    let cpu = args
        .get(1)
        .and_then(|a| a.parse::<usize>().ok())
        .filter(|&c| c < libc::CPU_SETSIZE as usize);
    let seconds = args.get(2).and_then(|a| a.parse::<f64>().ok());
    let spin_for = seconds.and_then(|s| Duration::try_from_secs_f64(s).ok());
    let (Some(threads), Some(cpu), Some(spin_for)) = (threads, cpu, spin_for) else {
        eprintln!("usage: spinners <threads> <cpu> <seconds>");
        std::process::exit(2);
    };

    let stop = Arc::new(AtomicBool::new(false));
    let (started, pinned) = channel::<(usize, std::io::Result<i64>)>();
    let mut spinners = Vec::with_capacity(threads);
    for index in 1..=threads {
        let (stop, started) = (stop.clone(), started.clone());
        spinners.push(
            Builder::new()
                .name(format!("spin-{index}"))
                .spawn(move || {
                    let result = pin_to(cpu).map(|()| gettid());
                    let pinned = result.is_ok();
                    let _ = started.send((index, result));
                    drop(started);
                    if pinned {
                        while !stop.load(Ordering::Relaxed) {
                            std::hint::spin_loop();
                        }
                    }
                })?,
        );
    }
    drop(started);
    let mut tids = Vec::with_capacity(threads);
    for (index, result) in pinned.iter() {
        match result {
            Ok(tid) => tids.push((index, tid)),
            Err(error) => {
                eprintln!("spin-{index}: cannot pin to CPU {cpu}: {error}");
                std::process::exit(1);
            }
        }
    }
    let spinning_since = Instant::now();
    tids.sort_unstable();
    let tids: Vec<String> = tids.iter().map(|(_, tid)| tid.to_string()).collect();
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "spinners {}", tids.join(","))?;
    stdout.flush()?;

    // stdin is read on a helper thread so that the main thread can also time out.
    let (closed, stdin_closed) = channel::<()>();
    Builder::new().name("stdin".to_owned()).spawn(move || {
        for line in std::io::stdin().lock().lines() {
            if line.is_err() {
                break;
            }
        }
        let _ = closed.send(());
    })?;
    let _ = stdin_closed.recv_timeout(spin_for.saturating_sub(spinning_since.elapsed()));
    stop.store(true, Ordering::Relaxed);
    for spinner in spinners {
        let _ = spinner.join();
    }
    Ok(())
}
