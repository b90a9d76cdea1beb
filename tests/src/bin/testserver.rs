//! A TCP server whose behaviour the tests control line by line on stdin, so that the
//! truth is known: how many connections wait in its backlog, how many it accepted and
//! has not read from, whether it forked.
//!
//! Usage: `testserver <backlog>`; prints `port <n>` and then answers each command
//! with one line:
//! - `accept <n>`: accept n connections and keep them open → `ok`
//! - `read`: read once from every kept connection → `ok`
//! - `block`: each kept connection goes to a thread of its own, which blocks in one
//!   read of it on the same fd (a dup would be another fd) and exits when the read
//!   returns → `ok` once every thread has started
//! - `fork`: fork a child that accepts on the same socket forever → `child <pid>`
//! - `listen <backlog>`: listen on another port too, accepting nothing there →
//!   `port <n>`
//! - `exit`: exit at once
use std::{
    io::{BufRead as _, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    os::fd::FromRawFd as _,
};

fn listen(backlog: i32) -> std::io::Result<TcpListener> {
    // std's TcpListener always listens with a backlog of 128; the tests need theirs.
    // SAFETY: plain socket calls on a fresh fd; the address struct is fully initialised.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let listener = TcpListener::from_raw_fd(fd);
        let mut addr: libc::sockaddr_in = std::mem::zeroed();
        addr.sin_family = libc::AF_INET as libc::sa_family_t;
        addr.sin_addr.s_addr = u32::from_ne_bytes([127, 0, 0, 1]);
        let len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
        if libc::bind(fd, std::ptr::from_ref(&addr).cast(), len) != 0
            || libc::listen(fd, backlog) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        Ok(listener)
    }
}

fn main() -> std::io::Result<()> {
    let backlog = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(128);
    let listener = listen(backlog)?;
    let mut out = std::io::stdout();
    writeln!(out, "port {}", listener.local_addr()?.port())?;
    out.flush()?;
    let mut kept: Vec<TcpStream> = Vec::new();
    let mut also_listening: Vec<TcpListener> = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let mut words = line.split_whitespace();
        match (
            words.next(),
            words.next().and_then(|n| n.parse::<usize>().ok()),
        ) {
            (Some("accept"), Some(n)) => {
                for _ in 0..n {
                    kept.push(listener.accept()?.0);
                }
                writeln!(out, "ok")?;
            }
            (Some("read"), _) => {
                let mut buffer = [0u8; 64];
                for stream in &mut kept {
                    let _ = stream.read(&mut buffer)?;
                }
                writeln!(out, "ok")?;
            }
            (Some("block"), _) => {
                let (started, all_started) = std::sync::mpsc::channel();
                let blocking = kept.len();
                for mut stream in kept.drain(..) {
                    let started = started.clone();
                    std::thread::spawn(move || {
                        let _ = started.send(());
                        let mut buffer = [0u8; 64];
                        let _ = stream.read(&mut buffer);
                    });
                }
                for _ in 0..blocking {
                    let _ = all_started.recv();
                }
                writeln!(out, "ok")?;
            }
            (Some("fork"), _) => {
                // SAFETY: the child only uses async-signal-safe calls and std's accept.
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    // SAFETY: prctl with constant arguments: die with the parent.
                    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
                    let mut held = Vec::new();
                    while let Ok((stream, _)) = listener.accept() {
                        held.push(stream);
                    }
                    std::process::exit(0);
                }
                writeln!(out, "child {pid}")?;
            }
            (Some("listen"), Some(backlog)) => {
                let another = listen(i32::try_from(backlog).unwrap_or(i32::MAX))?;
                writeln!(out, "port {}", another.local_addr()?.port())?;
                also_listening.push(another);
            }
            (Some("exit"), _) => std::process::exit(0),
            _ => writeln!(out, "unknown command: {line}")?,
        }
        out.flush()?;
    }
    Ok(())
}
