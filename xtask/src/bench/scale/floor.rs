//! The floor a scrape is read against: a static HTTP server of the same bytes on a
//! loopback port, in this process, stopped when dropped.
use std::{
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use anyhow::Context as _;

/// A static HTTP server of one body on a loopback port, stopped when dropped.
pub(super) struct Floor {
    pub(super) address: String,
    stop: Arc<AtomicBool>,
    server: Option<thread::JoinHandle<()>>,
}

impl Floor {
    pub(super) fn serve(body: String) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").context("binding the static server")?;
        let address = listener.local_addr()?.to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let response = [
            format!(
                "HTTP/1.0 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n\
                 content-length: {}\r\n\r\n",
                body.len()
            )
            .into_bytes(),
            body.into_bytes(),
        ]
        .concat();
        let server = thread::spawn({
            let stop = stop.clone();
            move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(mut stream) = stream else { continue };
                    // A client that sends nothing does not hold the server up.
                    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                    // The request ends with an empty line; its content is not looked at.
                    let mut request = Vec::new();
                    let mut chunk = [0u8; 1024];
                    while !request.ends_with(b"\r\n\r\n") {
                        match stream.read(&mut chunk) {
                            Ok(0) | Err(_) => break,
                            Ok(read) => request.extend_from_slice(&chunk[..read]),
                        }
                    }
                    let _ = stream.write_all(&response);
                }
            }
        });
        Ok(Self {
            address,
            stop,
            server: Some(server),
        })
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the accept loop to see the stop; if that fails, the thread is left
        // to end with the process rather than waited for forever.
        if TcpStream::connect(&self.address).is_ok()
            && let Some(server) = self.server.take()
        {
            let _ = server.join();
        }
    }
}
