//! The web server's families: scrapes it refused and its listener's failed TLS
//! handshakes, from the counts the server keeps.
use super::{Collected, OwnReading, Timings};
use crate::{
    encode::{Family, Kind},
    scrape_counts::ScrapeCounts,
};

pub fn collect(own: &OwnReading<'_>, _: &Timings) -> Collected {
    Collected {
        families: families(own.web_server),
        whole: true,
    }
}

/// Also what a test's stand-in for the exporter exports.
pub fn families(counts: &ScrapeCounts) -> Vec<Family> {
    vec![
        Family::new(
            "scrapes_refused",
            Kind::Counter,
            "Scrapes of /metrics answered 503: too many at once (web.max_concurrent_scrapes) or past their timeout.",
        )
        .with(&[("reason", "concurrency")], counts.refused_busy as f64)
        .with(&[("reason", "timeout")], counts.refused_timeout as f64),
        Family::new(
            "tls_handshake_errors",
            Kind::Counter,
            "TLS handshakes of the listener (--web.config.file) that failed or timed out; the connection was closed.",
        )
        .with(&[("reason", "failed")], counts.tls_failed as f64)
        .with(&[("reason", "timeout")], counts.tls_timed_out as f64),
    ]
}
