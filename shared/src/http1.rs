//! What the first bytes a server writes on an HTTP/1 connection say to the request
//! state machine (DESIGN §3): an interim answer (`100 Continue`, `103 Early Hints`)
//! does not end the request it answers; the final one does.

/// Bytes of a status line the kernel programs read: `HTTP/1.x NNN`.
pub const HTTP1_STATUS_PREFIX: usize = 12;
/// The longest write read as a possible interim answer. Every server's `100
/// Continue` is 18–25 bytes (`HTTP/1.1 100 \r\n\r\n` to `HTTP/1.1 100
/// Continue\r\n\r\n`), while a final answer carries headers (`Date`,
/// `Content-Length`) that make it longer: reading the caller's buffer costs ~450 ns
/// (`cargo xtask bench`, socket backend), paid only by writes this short. A `103
/// Early Hints` with its `Link` headers is longer, and ends its request.
pub const HTTP1_INTERIM_MAX_BYTES: u32 = 64;

/// Whether a write that begins with `bytes` is an interim (1xx) response, one that
/// does not end its request (RFC 9110 §15.2). `101 Switching Protocols` is no such
/// answer: the HTTP/1.1 exchange ends there, and what follows (HTTP/2 after
/// `Upgrade: h2c`, a WebSocket) is another protocol.
pub const fn is_interim_response(bytes: &[u8; HTTP1_STATUS_PREFIX]) -> bool {
    let version = bytes[0] == b'H'
        && bytes[1] == b'T'
        && bytes[2] == b'T'
        && bytes[3] == b'P'
        && bytes[4] == b'/'
        && bytes[5] == b'1'
        && bytes[6] == b'.'
        && bytes[7].is_ascii_digit()
        && bytes[8] == b' ';
    let informational =
        bytes[9] == b'1' && bytes[10].is_ascii_digit() && bytes[11].is_ascii_digit();
    let switching = bytes[10] == b'0' && bytes[11] == b'1';
    version && informational && !switching
}

#[cfg(test)]
mod tests {
    use super::{HTTP1_STATUS_PREFIX, is_interim_response};

    fn interim(text: &str) -> bool {
        let mut bytes = [0u8; HTTP1_STATUS_PREFIX];
        let len = text.len().min(HTTP1_STATUS_PREFIX);
        bytes[..len].copy_from_slice(&text.as_bytes()[..len]);
        is_interim_response(&bytes)
    }

    #[test]
    fn interim_answers_are_told_from_final_ones() {
        assert!(interim("HTTP/1.1 100 Continue\r\n\r\n"));
        assert!(interim(
            "HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n"
        ));
        assert!(interim("HTTP/1.0 102 Processing\r\n\r\n"));
        // Final answers, the protocol switch and what is not a status line at all.
        assert!(!interim("HTTP/1.1 200 OK\r\n"));
        // A write shorter than a status line's start (the rest zeroed, as read).
        assert!(!interim("HTTP/1.1 10"));
        assert!(!interim("HTTP/1.1 101 Switching Protocols\r\n"));
        assert!(!interim("HTTP/1.1 404 Not Found\r\n"));
        assert!(!interim("HTTP/2.0 100 Continue"));
        assert!(!interim("HTTP/1.1 1x0 Continue"));
        assert!(!interim("ok\n"));
        assert!(!interim("100 Continue HTTP/1.1"));
    }
}
