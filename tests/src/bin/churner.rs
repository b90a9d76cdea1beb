//! A listening process whose threads and children come and go, or whose threads each
//! have a name of their own: the ground truth for churn and for the pool and series
//! limits.
//!
//! Usage:
//! - `churner churn <processes> <threads>`: prints `port <n>`, waits for a line on
//!   stdin, then forks `<processes>` children that each exit after 1 ms, and starts
//!   `<threads>` threads named `churn-<i>` (one pool) that each exit after 1 ms, at
//!   most 50 alive at once; prints `done <processes> <threads>`, then waits until
//!   stdin closes.
//! - `churner names <threads>`: starts `<threads>` threads, each named by its index in
//!   letters (`ab`, `ac`, …: no digits, so each is a pool of its own), prints
//!   `port <n>` and `workers <count>`, then waits until stdin closes.
use std::{
    io::{BufRead as _, Write as _},
    net::TcpListener,
    time::Duration,
};

use poolscope_tests::{name_this_thread, wait_for_stdin_close};

/// Threads alive at once while churning (the rest wait for a slot).
const BATCH: usize = 50;
const LIFETIME: Duration = Duration::from_millis(1);

/// `index` in base 26, letters only (`a`, …, `z`, `ba`, …), prefixed so that no two
/// indices share a name once poolscope strips digits (there are none).
fn letters(mut index: usize) -> String {
    let mut name = Vec::new();
    loop {
        name.push(b'a' + (index % 26) as u8);
        index /= 26;
        if index == 0 {
            break;
        }
    }
    name.reverse();
    format!("p{}", String::from_utf8_lossy(&name))
}

fn churn(processes: usize, threads: usize) -> std::io::Result<()> {
    for _ in 0..processes {
        // SAFETY: the child only sleeps and exits (no allocation, no locks).
        match unsafe { libc::fork() } {
            -1 => return Err(std::io::Error::last_os_error()),
            0 => {
                std::thread::sleep(LIFETIME);
                // SAFETY: ends the child without running the parent's exit handlers.
                unsafe { libc::_exit(0) };
            }
            child => {
                let mut status = 0;
                // SAFETY: reaps our own child; `status` outlives the call.
                unsafe { libc::waitpid(child, &mut status, 0) };
            }
        }
    }
    let mut started = 0;
    while started < threads {
        let batch: Vec<_> = (started..threads.min(started + BATCH))
            .map(|index| {
                std::thread::Builder::new().spawn(move || {
                    let _ = name_this_thread(format!("churn-{index}").as_bytes());
                    std::thread::sleep(LIFETIME);
                })
            })
            .collect::<Result<_, _>>()?;
        started += batch.len();
        for thread in batch {
            thread
                .join()
                .map_err(|_| std::io::Error::other("a churn thread panicked"))?;
        }
    }
    Ok(())
}

fn main() -> std::io::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let count = |index: usize| args.get(index).and_then(|a| a.parse::<usize>().ok());
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let port = listener.local_addr()?.port();
    match (args.first().map(String::as_str), count(1), count(2)) {
        (Some("churn"), Some(processes), Some(threads)) => {
            println!("port {port}");
            let mut go = String::new();
            std::io::stdin().lock().read_line(&mut go)?;
            churn(processes, threads)?;
            println!("done {processes} {threads}");
        }
        (Some("names"), Some(threads), None) => {
            for index in 0..threads {
                std::thread::Builder::new().spawn(move || {
                    let _ = name_this_thread(letters(index).as_bytes());
                    loop {
                        std::thread::park();
                    }
                })?;
            }
            println!("port {port}\nworkers {threads}");
        }
        _ => {
            eprintln!("usage: churner churn <processes> <threads> | churner names <threads>");
            std::process::exit(2);
        }
    }
    std::io::stdout().flush()?;
    wait_for_stdin_close()
}
