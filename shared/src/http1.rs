//! What the first bytes a server writes on an HTTP/1 connection say (DESIGN §3): the
//! status of the response, whose class each finished request is counted under, and
//! whether it is an interim answer (`100 Continue`, `103 Early Hints`), one that does
//! not end the request it answers.

/// Bytes of a status line the kernel programs read: `HTTP/1.x NNN`.
pub const HTTP1_STATUS_PREFIX: usize = 12;

/// The status code (100–599) a write that begins with `bytes` answers with; 0 if it
/// does not begin with an HTTP/1 status line (a write in the middle of a response, a body
/// written apart from its head, bytes of another protocol).
pub const fn response_status(bytes: &[u8; HTTP1_STATUS_PREFIX]) -> u16 {
    let version = bytes[0] == b'H'
        && bytes[1] == b'T'
        && bytes[2] == b'T'
        && bytes[3] == b'P'
        && bytes[4] == b'/'
        && bytes[5] == b'1'
        && bytes[6] == b'.'
        && bytes[7].is_ascii_digit()
        && bytes[8] == b' ';
    // RFC 9110 §15: the first digit is the class, 1 to 5.
    let code = bytes[9] >= b'1'
        && bytes[9] <= b'5'
        && bytes[10].is_ascii_digit()
        && bytes[11].is_ascii_digit();
    if !(version && code) {
        return 0;
    }
    (bytes[9] - b'0') as u16 * 100 + (bytes[10] - b'0') as u16 * 10 + (bytes[11] - b'0') as u16
}

/// Whether a response with status `status` is an interim one, which does not end its
/// request (RFC 9110 §15.2). `101 Switching Protocols` is no such answer: the
/// HTTP/1.1 exchange ends there, and what follows (HTTP/2 after `Upgrade: h2c`, a
/// WebSocket) is another protocol.
pub const fn is_interim_status(status: u16) -> bool {
    status >= 100 && status < 200 && status != 101
}

/// The class a finished request is counted under, by the status of its final answer
/// (`poolscope_responses_total{status_class}`), in the order of
/// [`StatusClass::index_of`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusClass {
    /// No status read: the connection closed before an answer, the answer's head was
    /// not in a buffer the kernel programs read (TLS, `sendfile` alone, io_uring, a
    /// transmit out of the writer's call on the tcp backend), or an HTTP/2 stream.
    Unknown,
    Informational,
    Success,
    Redirection,
    ClientError,
    ServerError,
}

/// How many [`StatusClass`]es there are.
pub const STATUS_CLASSES: usize = 6;

impl StatusClass {
    /// Every class, in the order of its index.
    pub const ALL: [Self; STATUS_CLASSES] = [
        Self::Unknown,
        Self::Informational,
        Self::Success,
        Self::Redirection,
        Self::ClientError,
        Self::ServerError,
    ];

    /// The index in [`StatusClass::ALL`] (and in `ServiceCounters::responses`) of
    /// the class of `status`, a [`response_status`] (0, or 100–599): its first digit.
    pub const fn index_of(status: u16) -> usize {
        (status / 100) as usize
    }

    /// Its label value.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Informational => "1xx",
            Self::Success => "2xx",
            Self::Redirection => "3xx",
            Self::ClientError => "4xx",
            Self::ServerError => "5xx",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{HTTP1_STATUS_PREFIX, StatusClass, is_interim_status, response_status};

    fn status(text: &str) -> u16 {
        let mut bytes = [0u8; HTTP1_STATUS_PREFIX];
        let len = text.len().min(HTTP1_STATUS_PREFIX);
        bytes[..len].copy_from_slice(&text.as_bytes()[..len]);
        response_status(&bytes)
    }

    #[test]
    fn status_lines_are_read_and_anything_else_is_none() {
        assert_eq!(status("HTTP/1.1 200 OK\r\n"), 200);
        assert_eq!(status("HTTP/1.0 404 Not Found\r\n"), 404);
        assert_eq!(status("HTTP/1.1 503 Service Unavailable\r\n"), 503);
        assert_eq!(status("HTTP/1.1 100 Continue\r\n\r\n"), 100);
        assert_eq!(status("HTTP/1.1 599 Whatever"), 599);
        assert_eq!(status("HTTP/1.1 600 Out of range"), 0);
        // A write shorter than a status line's start (the rest zeroed, as read).
        assert_eq!(status("HTTP/1.1 10"), 0);
        assert_eq!(status("HTTP/2.0 200 OK"), 0);
        assert_eq!(status("HTTP/1.1 2x0 OK"), 0);
        assert_eq!(status("HTTP/1.1 099 ?"), 0);
        assert_eq!(status("HTTP/1.1  200 OK"), 0);
        assert_eq!(status("ok\n"), 0);
        assert_eq!(status("200 OK HTTP/1.1"), 0);
        assert_eq!(status("{\"a\": 1}"), 0);
    }

    #[test]
    fn interim_answers_are_told_from_final_ones() {
        for interim in [100, 102, 103, 199] {
            assert!(is_interim_status(interim), "{interim}");
        }
        for last in [0, 101, 200, 204, 304, 404, 500] {
            assert!(!is_interim_status(last), "{last}");
        }
    }

    #[test]
    fn classes_follow_the_first_digit() {
        let classes = [0, 101, 200, 299, 302, 404, 500, 599]
            .map(|status| StatusClass::ALL[StatusClass::index_of(status)].label());
        assert_eq!(
            classes,
            ["unknown", "1xx", "2xx", "2xx", "3xx", "4xx", "5xx", "5xx"]
        );
    }
}
