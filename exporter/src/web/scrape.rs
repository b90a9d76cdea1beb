//! `/metrics`: the [`ScrapeGate`] that bounds scrapes (at most
//! `web.max_concurrent_scrapes` at once, each within the scraper's
//! `X-Prometheus-Scrape-Timeout-Seconds` less an offset, else `web.scrape_timeout`)
//! and counts those it refuses and the listener's failed TLS handshakes, and the
//! handler that gathers, renders and, if the scraper accepts it, gzips one scrape.
use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use axum::{
    body::Bytes,
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};

use crate::{
    config::ScrapeLimits,
    encode::{self, Exposition, weighted_items},
    scrape_counts::ScrapeCounts,
    web::gatherer::Gatherer,
};

/// The header in which Prometheus says how long it waits for a scrape.
pub(super) const SCRAPE_TIMEOUT_HEADER: &str = "x-prometheus-scrape-timeout-seconds";

/// Admits scrapes within [`ScrapeLimits`] and counts those it refuses.
pub struct ScrapeGate {
    limits: ScrapeLimits,
    permits: Arc<tokio::sync::Semaphore>,
    refused_busy: AtomicU64,
    refused_timeout: AtomicU64,
    tls_failed: AtomicU64,
    tls_timed_out: AtomicU64,
}

/// Why a TLS handshake failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandshakeError {
    /// The client did not finish within the handshake timeout.
    Timeout,
    /// Anything else: not TLS, no shared version or suite, a refused certificate.
    Failed,
}

impl ScrapeGate {
    pub fn new(limits: ScrapeLimits) -> Self {
        Self {
            limits,
            permits: Arc::new(tokio::sync::Semaphore::new(limits.max_concurrent as usize)),
            refused_busy: AtomicU64::new(0),
            refused_timeout: AtomicU64::new(0),
            tls_failed: AtomicU64::new(0),
            tls_timed_out: AtomicU64::new(0),
        }
    }

    /// Counts a failed TLS handshake of the listener.
    pub fn count_handshake_error(&self, error: HandshakeError) {
        let counter = match error {
            HandshakeError::Timeout => &self.tls_timed_out,
            HandshakeError::Failed => &self.tls_failed,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Failed TLS handshakes counted so far, for one reason.
    pub fn handshake_errors(&self, error: HandshakeError) -> u64 {
        match error {
            HandshakeError::Timeout => &self.tls_timed_out,
            HandshakeError::Failed => &self.tls_failed,
        }
        .load(Ordering::Relaxed)
    }

    /// How long a scrape may take: the scraper's timeout less the offset (all of it
    /// if shorter than the offset), else `web.scrape_timeout`.
    pub(super) fn deadline(&self, headers: &HeaderMap) -> Duration {
        let asked = headers
            .get(SCRAPE_TIMEOUT_HEADER)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.trim().parse::<f64>().ok())
            .filter(|seconds| seconds.is_finite() && *seconds > 0.0)
            .map(|seconds| Duration::from_secs_f64(seconds.min(3600.0)));
        match asked {
            Some(asked) if asked > self.limits.timeout_offset => asked - self.limits.timeout_offset,
            Some(asked) => asked,
            None => self.limits.timeout,
        }
    }

    /// The counts as of now.
    fn counts(&self) -> ScrapeCounts {
        ScrapeCounts {
            refused_busy: self.refused_busy.load(Ordering::Relaxed),
            refused_timeout: self.refused_timeout.load(Ordering::Relaxed),
            tls_failed: self.tls_failed.load(Ordering::Relaxed),
            tls_timed_out: self.tls_timed_out.load(Ordering::Relaxed),
        }
    }
}

/// Whether the scraper accepts a gzip body (`Accept-Encoding: gzip`, or `*`, with a
/// weight above 0). Prometheus asks for it by default.
fn accepts_gzip(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT_ENCODING)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(weighted_items)
        .any(|(coding, _, weight)| {
            (coding.eq_ignore_ascii_case("gzip") || coding == "*") && weight > 0.0
        })
}

pub(super) async fn metrics(
    gatherer: Arc<dyn Gatherer>,
    gate: Arc<ScrapeGate>,
    headers: HeaderMap,
) -> Response {
    let Ok(permit) = gate.permits.clone().try_acquire_owned() else {
        gate.refused_busy.fetch_add(1, Ordering::Relaxed);
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, HeaderValue::from_static("1"))],
            format!(
                "too many scrapes at once: {} at most (web.max_concurrent_scrapes)\n",
                gate.limits.max_concurrent
            ),
        )
            .into_response();
    };
    let format = Exposition::negotiate(
        headers
            .get(header::ACCEPT)
            .and_then(|value| value.to_str().ok()),
    );
    let gzip = accepts_gzip(&headers);
    let deadline = gate.deadline(&headers);
    let counters = gate.clone();
    // Reading maps and netlink blocks; keep it off the async workers. The permit is
    // held until the work ends, also past a timeout: abandoned work still counts.
    let work = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let families = gatherer.gather(format, &counters.counts());
        let body = format.render(&families);
        if gzip {
            encode::gzip(body.as_ref()).map(Bytes::from)
        } else {
            Ok(body.into_bytes())
        }
    });
    match tokio::time::timeout(deadline, work).await {
        Ok(Ok(Ok(body))) => {
            let mut response = (
                [
                    (
                        header::CONTENT_TYPE,
                        HeaderValue::from_static(format.content_type()),
                    ),
                    (header::VARY, HeaderValue::from_static("accept-encoding")),
                ],
                body,
            )
                .into_response();
            if gzip {
                response
                    .headers_mut()
                    .insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
            }
            response
        }
        Ok(Ok(Err(error))) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("compressing the scrape failed: {error}\n"),
        )
            .into_response(),
        Ok(Err(error)) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("scrape failed: {error}\n"),
        )
            .into_response(),
        Err(_) => {
            gate.refused_timeout.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                timeout = ?deadline,
                "a scrape took longer than its timeout (X-Prometheus-Scrape-Timeout-Seconds \
                 less web.scrape_timeout_offset, else web.scrape_timeout)"
            );
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("scrape not finished within its timeout of {deadline:?}\n"),
            )
                .into_response()
        }
    }
}
