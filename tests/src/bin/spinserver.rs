//! A server whose connection threads never sleep: each spins on non-blocking reads of
//! its connection and answers every `req\n` with `ok\n`, pinned to the last CPU. With
//! clients on another CPU, a request's arrival (the client's softirq) and its read
//! (this thread) run on two CPUs at once: the race of the request state machine's
//! phase updates that tests/tests/transitions.rs drives.
//!
//! Usage: `spinserver`. Prints `port <n>`, then serves until stdin closes.
use std::{
    io::{ErrorKind, Read as _, Write as _},
    net::{TcpListener, TcpStream},
};

use poolscope_tests::{pin_to, wait_for_stdin_close};

fn serve(mut stream: TcpStream, cpu: usize) -> std::io::Result<()> {
    pin_to(cpu)?;
    stream.set_nonblocking(true)?;
    stream.set_nodelay(true)?;
    let mut buffer = [0u8; 64];
    let mut pending = 0usize;
    loop {
        match stream.read(&mut buffer[pending..]) {
            Ok(0) => return Ok(()),
            Ok(n) => pending += n,
            Err(error) if error.kind() == ErrorKind::WouldBlock => continue,
            Err(error) => return Err(error),
        }
        while let Some(end) = buffer[..pending].iter().position(|b| *b == b'\n') {
            stream.write_all(b"ok\n")?;
            buffer.copy_within(end + 1..pending, 0);
            pending -= end + 1;
        }
        if pending == buffer.len() {
            pending = 0;
        }
    }
}

fn main() -> anyhow::Result<()> {
    let cpu = std::thread::available_parallelism().map_or(0, |n| n.get() - 1);
    let listener = TcpListener::bind("127.0.0.1:0")?;
    println!("port {}", listener.local_addr()?.port());
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || serve(stream, cpu));
        }
    });
    wait_for_stdin_close()?;
    Ok(())
}
