//! A listening process with hostile names: its own comm and its workers' names hold a
//! double quote, a backslash, braces, a newline and a byte that is not UTF-8, so that
//! a test can check that its `service` and `pool` labels still make valid exposition.
//!
//! Usage: `hostile <workers>`. Names itself [`PROCESS_NAME`], starts `<workers>`
//! threads named [`WORKER_PREFIX`]`-1` … (a pool once the index is stripped), listens
//! on a loopback port, prints `port <port>` and `workers <tid>,…`, then waits until
//! stdin closes.
use std::{io::Write as _, net::TcpListener};

use poolscope_tests::{name_this_thread, wait_for_stdin_close, workers_line};

/// The comm it gives itself (at most 15 bytes).
const PROCESS_NAME: &[u8] = b"q\"b\\{}\n\xff";
/// Its workers' names before `-<index>`.
const WORKER_PREFIX: &[u8] = b"w\"\\{x}\n\xfe";

fn main() -> std::io::Result<()> {
    let workers = std::env::args()
        .nth(1)
        .and_then(|a| a.parse::<usize>().ok())
        .filter(|&w| w > 0);
    let Some(workers) = workers else {
        eprintln!("usage: hostile <workers>");
        std::process::exit(2);
    };
    let (started, tids) = std::sync::mpsc::channel();
    for index in 1..=workers {
        let started = started.clone();
        std::thread::Builder::new().spawn(move || {
            let name = [WORKER_PREFIX, format!("-{index}").as_bytes()].concat();
            let named = name_this_thread(&name).map(|()| poolscope_tests::gettid());
            let _ = started.send((index, named));
            drop(started);
            loop {
                std::thread::park();
            }
        })?;
    }
    drop(started);
    let mut named = Vec::with_capacity(workers);
    for (index, tid) in tids.iter() {
        named.push((index, tid?));
    }
    named.sort_unstable();
    let tids: Vec<i64> = named.into_iter().map(|(_, tid)| tid).collect();
    name_this_thread(PROCESS_NAME)?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "port {}", listener.local_addr()?.port())?;
    writeln!(stdout, "{}", workers_line(&tids))?;
    stdout.flush()?;
    drop(stdout);
    wait_for_stdin_close()
}
