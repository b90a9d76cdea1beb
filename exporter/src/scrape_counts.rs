//! What the web server counted: scrapes it refused and its listener's failed TLS
//! handshakes. A leaf: the web server fills it, the `web_server` collector renders it.

/// What the web server counted so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScrapeCounts {
    /// Scrapes refused: too many at once.
    pub refused_busy: u64,
    /// Scrapes refused: past their timeout.
    pub refused_timeout: u64,
    /// TLS handshakes that failed.
    pub tls_failed: u64,
    /// TLS handshakes that timed out.
    pub tls_timed_out: u64,
}
