//! HTTP endpoints: `/metrics` (text or OpenMetrics by Accept header), `/healthz`,
//! `/debug/threads` (every followed thread, tab-separated), `/debug/locks` (a
//! service's top contended locks, text or JSON), `/debug/snapshots` (the stack
//! snapshots kept), `/debug/stacks/{cpu,offcpu,wall}` (one snapshot's stacks as
//! folded text, an SVG flame graph or a pprof profile) and `/debug/pprof/profile`
//! (an on-demand profiling session of one service, for `go tool pprof`).
//! `app` builds the router so that tests can call it without a socket.
//!
//! Scrapes are bounded ([`ScrapeGate`]): at most `web.max_concurrent_scrapes` gather at
//! once (more get 503 at once), and each has until the scraper's
//! `X-Prometheus-Scrape-Timeout-Seconds` less an offset (else `web.scrape_timeout`)
//! before it gets 503; both refusals are counted in `scrapes_refused_total`.
//!
//! `/debug/*` answers only loopback clients by default (`web.debug_endpoints`).
//!
//! The gate also counts the listener's failed TLS handshakes
//! (`tls_handshake_errors_total`), so that every web-level counter comes out of one
//! place at each scrape.
use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::Bytes,
    extract::{ConnectInfo, Path, Query, Request, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    middleware::{self, Next},
    response::{Html, IntoResponse, Response},
    routing::get,
};

use crate::{
    clock::monotonic_ns,
    config::{DebugAccess, ScrapeLimits},
    encode::{self, Exposition, Family, Kind, weighted_items},
    stacks::profile::{self, ProfileError, View},
    stacks::sessions::{ProfileQuery, Refusal, Ticket},
    web::landing::landing_page,
};

/// Something that reads every metric family for one scrape.
pub trait Gatherer: Send + Sync + 'static {
    /// Blocking: reads kernel maps and netlink; the families to be written in
    /// `exposition` (only the protobuf exposition carries native buckets).
    fn gather(&self, exposition: Exposition) -> Vec<Family>;

    /// Blocking: one line per followed thread, with a header line.
    fn debug_threads(&self) -> String;

    /// Blocking (symbolizes): the top contended locks of one service.
    fn debug_locks(&self, query: &LocksQuery) -> Result<String, DebugError>;

    /// The snapshots kept, as JSON.
    fn debug_snapshots(&self) -> String;

    /// Blocking (renders): one snapshot's stacks in `query.format`.
    fn debug_stacks(&self, view: View, query: &StacksQuery) -> Result<Vec<u8>, DebugError>;

    /// Blocking (opens perf events): checks `query` and starts its session.
    fn begin_profile(&self, query: &ProfileQuery, requested_ns: u64) -> Result<Ticket, Refusal>;

    /// Blocking (drains, symbolizes, renders): ends the session and renders it.
    fn end_profile(&self, ticket: Ticket) -> Result<ProfileOutput, Refusal>;

    /// Ends the session without rendering it (its client left).
    fn cancel_profile(&self, ticket: Ticket);

    /// Becomes true when poolscope stops: sessions end early then.
    fn stopping(&self) -> tokio::sync::watch::Receiver<bool>;

    /// Not blocking: `ok`, or `degraded` and one line per cause (see `health`).
    fn health(&self) -> String;
}

/// A rendered profiling session.
#[derive(Debug)]
pub struct ProfileOutput {
    pub body: Vec<u8>,
    pub format: profile::Format,
    /// The lightest stacks left out to stay within `profiles.max_response_bytes`.
    pub stacks_dropped: usize,
}

/// Locks shown when `limit` is not given, and the most that may be asked for.
const DEFAULT_LOCKS: usize = 10;
const MAX_LOCKS: usize = 1000;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LocksFormat {
    #[default]
    Text,
    Json,
}

/// `/debug/locks?service=NAME[&format=text|json][&limit=N]`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
pub struct LocksQuery {
    pub service: String,
    #[serde(default)]
    pub format: LocksFormat,
    #[serde(default = "default_locks")]
    pub limit: usize,
}

fn default_locks() -> usize {
    DEFAULT_LOCKS
}

/// `/debug/stacks/{cpu,offcpu,wall}?[service=NAME][&pool=NAME][&snapshot=ID][&format=...]`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize)]
pub struct StacksQuery {
    pub service: Option<String>,
    pub pool: Option<String>,
    /// The newest when absent.
    pub snapshot: Option<u64>,
    #[serde(default)]
    pub format: profile::Format,
}

#[derive(Debug, thiserror::Error)]
pub enum DebugError {
    #[error("no watched service named {0:?}")]
    UnknownService(String),
    #[error("{}", match .0 {
        Some(id) => format!("no snapshot {id} (see /debug/snapshots)"),
        None => "no snapshot yet: the first comes one [stacks] interval after start".to_owned(),
    })]
    NoSnapshot(Option<u64>),
    #[error("rendering failed: {0}")]
    Render(#[from] ProfileError),
}

impl DebugError {
    fn status(&self) -> StatusCode {
        match self {
            Self::UnknownService(_) | Self::NoSnapshot(_) => StatusCode::NOT_FOUND,
            Self::Render(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// The header in which Prometheus says how long it waits for a scrape.
const SCRAPE_TIMEOUT_HEADER: &str = "x-prometheus-scrape-timeout-seconds";

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
    fn deadline(&self, headers: &HeaderMap) -> Duration {
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

    fn families(&self) -> [Family; 2] {
        [
            Family::new(
                "scrapes_refused",
                Kind::Counter,
                "Scrapes of /metrics answered 503: too many at once (web.max_concurrent_scrapes) or past their timeout.",
            )
            .with(
                &[("reason", "concurrency")],
                self.refused_busy.load(Ordering::Relaxed) as f64,
            )
            .with(
                &[("reason", "timeout")],
                self.refused_timeout.load(Ordering::Relaxed) as f64,
            ),
            Family::new(
                "tls_handshake_errors",
                Kind::Counter,
                "TLS handshakes of the listener (--web.config.file) that failed or timed out; the connection was closed.",
            )
            .with(
                &[("reason", "failed")],
                self.tls_failed.load(Ordering::Relaxed) as f64,
            )
            .with(
                &[("reason", "timeout")],
                self.tls_timed_out.load(Ordering::Relaxed) as f64,
            ),
        ]
    }
}

/// Where the router serves what: the metrics' path, and who may use `/debug/*`.
#[derive(Clone, Debug)]
pub struct Routes {
    pub telemetry_path: String,
    pub debug: DebugAccess,
}

/// The router. Serve it with `into_make_service_with_connect_info::<SocketAddr>()`:
/// `/debug/*` needs the client's address.
pub fn app(gatherer: Arc<dyn Gatherer>, gate: Arc<ScrapeGate>, routes: Routes) -> Router {
    let Routes {
        telemetry_path,
        debug,
    } = routes;
    let landing = Html(landing_page(&telemetry_path, debug));
    let debug_routes = Router::new()
        .route("/debug/threads", get(debug_threads))
        .route("/debug/locks", get(debug_locks))
        .route("/debug/snapshots", get(debug_snapshots))
        .route("/debug/stacks/{view}", get(debug_stacks))
        .route("/debug/pprof/profile", get(pprof_profile))
        .route_layer(middleware::from_fn_with_state(debug, debug_guard));
    Router::new()
        .route(
            &telemetry_path,
            get(move |State(gatherer), headers| metrics(gatherer, gate, headers)),
        )
        // 200 either way: restarting poolscope does not make a map larger, so a
        // liveness probe must not act on it; the body (and `degraded`) says why.
        .route(
            "/healthz",
            get(|State(gatherer): State<Arc<dyn Gatherer>>| async move { gatherer.health() }),
        )
        .route("/", get(move || async move { landing }))
        .merge(debug_routes)
        .with_state(gatherer)
}

/// Lets a `/debug/*` request through as `web.debug_endpoints` allows.
async fn debug_guard(State(access): State<DebugAccess>, request: Request, next: Next) -> Response {
    let peer = request
        .extensions()
        .get::<ConnectInfo<std::net::SocketAddr>>()
        .map(|ConnectInfo(address)| address.ip().to_canonical());
    match access {
        DebugAccess::All => next.run(request).await,
        DebugAccess::Localhost if peer.is_some_and(|ip| ip.is_loopback()) => {
            next.run(request).await
        }
        DebugAccess::Localhost => (
            StatusCode::FORBIDDEN,
            format!(
                "/debug/* answers only clients on this host (web.debug_endpoints = \"localhost\"); \
                 this one is {}: use kubectl port-forward or an SSH tunnel, or set \"all\"\n",
                peer.map_or_else(|| "unknown".to_owned(), |ip| ip.to_string())
            ),
        )
            .into_response(),
        DebugAccess::Off => (
            StatusCode::NOT_FOUND,
            "/debug/* is off (web.debug_endpoints = \"off\")\n",
        )
            .into_response(),
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

async fn metrics(
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
        let mut families = gatherer.gather(format);
        families.extend(counters.families());
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

async fn debug_threads(State(gatherer): State<Arc<dyn Gatherer>>) -> Response {
    match tokio::task::spawn_blocking(move || gatherer.debug_threads()).await {
        Ok(body) => body.into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading threads failed: {error}\n"),
        )
            .into_response(),
    }
}

async fn debug_locks(
    State(gatherer): State<Arc<dyn Gatherer>>,
    query: Result<Query<LocksQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(query)) = query else {
        return (
            StatusCode::BAD_REQUEST,
            "usage: /debug/locks?service=NAME[&format=text|json][&limit=N]\n",
        )
            .into_response();
    };
    if query.limit == 0 || query.limit > MAX_LOCKS {
        return (
            StatusCode::BAD_REQUEST,
            format!("limit must be 1 to {MAX_LOCKS}\n"),
        )
            .into_response();
    }
    let format = query.format;
    match tokio::task::spawn_blocking(move || gatherer.debug_locks(&query)).await {
        Ok(Ok(body)) => {
            let content_type = match format {
                LocksFormat::Text => "text/plain; charset=utf-8",
                LocksFormat::Json => "application/json",
            };
            ([(header::CONTENT_TYPE, content_type)], body).into_response()
        }
        Ok(Err(error)) => (error.status(), format!("{error}\n")).into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading locks failed: {error}\n"),
        )
            .into_response(),
    }
}

async fn debug_snapshots(State(gatherer): State<Arc<dyn Gatherer>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        gatherer.debug_snapshots(),
    )
        .into_response()
}

const STACKS_USAGE: &str = "usage: /debug/stacks/{cpu|offcpu|wall}?[service=NAME][&pool=NAME]\
                            [&snapshot=ID][&format=folded|svg|pprof]\n";

async fn debug_stacks(
    State(gatherer): State<Arc<dyn Gatherer>>,
    view: Result<Path<View>, axum::extract::rejection::PathRejection>,
    query: Result<Query<StacksQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let (Ok(Path(view)), Ok(Query(query))) = (view, query) else {
        return (StatusCode::BAD_REQUEST, STACKS_USAGE).into_response();
    };
    let format = query.format;
    match tokio::task::spawn_blocking(move || gatherer.debug_stacks(view, &query)).await {
        Ok(Ok(body)) => ([(header::CONTENT_TYPE, format.content_type())], body).into_response(),
        Ok(Err(error)) => (error.status(), format!("{error}\n")).into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering stacks failed: {error}\n"),
        )
            .into_response(),
    }
}

/// Ends a session whose request was dropped (the client disconnected) before it
/// completed: its perf events and kernel slot are freed at once.
struct SessionGuard {
    gatherer: Arc<dyn Gatherer>,
    ticket: Option<Ticket>,
}

impl SessionGuard {
    fn duration(&self) -> Duration {
        self.ticket
            .as_ref()
            .map_or(Duration::ZERO, |ticket| ticket.request.duration)
    }

    fn disarm(mut self) -> Option<Ticket> {
        self.ticket.take()
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            let gatherer = self.gatherer.clone();
            tracing::info!(
                service = ticket.request.service,
                "profiling client disconnected: session ended"
            );
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn_blocking(move || gatherer.cancel_profile(ticket));
                }
                Err(_) => gatherer.cancel_profile(ticket),
            }
        }
    }
}

async fn pprof_profile(
    State(gatherer): State<Arc<dyn Gatherer>>,
    query: Result<Query<ProfileQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let requested_ns = monotonic_ns();
    let query = match query {
        Ok(Query(query)) => query,
        Err(rejection) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("{rejection}\n{}", crate::stacks::sessions::USAGE),
            )
                .into_response();
        }
    };
    // Started on a blocking thread; should the client leave meanwhile, the ticket
    // finds no receiver and the session is ended there.
    let (sender, receiver) = tokio::sync::oneshot::channel();
    let starter = gatherer.clone();
    tokio::task::spawn_blocking(move || {
        let started = starter.begin_profile(&query, requested_ns);
        if let Err(Ok(ticket)) = sender.send(started) {
            starter.cancel_profile(ticket);
        }
    });
    let ticket = match receiver.await {
        Ok(Ok(ticket)) => ticket,
        Ok(Err(refusal)) => return refusal_response(&refusal),
        Err(_) => {
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                "starting the profiling session panicked\n",
            )
                .into_response();
        }
    };
    let guard = SessionGuard {
        gatherer: gatherer.clone(),
        ticket: Some(ticket),
    };
    let mut stopping = gatherer.stopping();
    tokio::select! {
        () = tokio::time::sleep(guard.duration()) => {}
        _ = stopping.wait_for(|stopping| *stopping) => {
            tracing::info!("poolscope is stopping: profiling session ended early");
        }
    }
    let Some(ticket) = guard.disarm() else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    match tokio::task::spawn_blocking(move || gatherer.end_profile(ticket)).await {
        Ok(Ok(output)) => {
            let mut response = (
                [(header::CONTENT_TYPE, output.format.content_type())],
                output.body,
            )
                .into_response();
            if output.format == profile::Format::Pprof {
                response.headers_mut().insert(
                    header::CONTENT_DISPOSITION,
                    HeaderValue::from_static("attachment; filename=\"profile.pb.gz\""),
                );
            }
            response.headers_mut().insert(
                "x-poolscope-stacks-dropped",
                HeaderValue::from(output.stacks_dropped),
            );
            response
        }
        Ok(Err(refusal)) => refusal_response(&refusal),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("ending the profiling session failed: {error}\n"),
        )
            .into_response(),
    }
}

fn refusal_response(refusal: &Refusal) -> Response {
    let mut response = (refusal.status(), format!("{refusal}\n")).into_response();
    if refusal.status() == StatusCode::TOO_MANY_REQUESTS {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("10"));
    }
    response
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    use super::*;

    #[derive(Default)]
    struct Fixed {
        cancelled: std::sync::atomic::AtomicU32,
        stopping: tokio::sync::watch::Sender<bool>,
        /// How long a gather takes.
        delay: Duration,
    }

    const LIMITS: ScrapeLimits = ScrapeLimits {
        max_concurrent: 4,
        timeout: Duration::from_secs(10),
        timeout_offset: Duration::from_millis(500),
    };

    fn router(gatherer: Arc<Fixed>, limits: ScrapeLimits) -> Router {
        app(
            gatherer,
            Arc::new(ScrapeGate::new(limits)),
            Routes {
                telemetry_path: "/metrics".to_owned(),
                debug: DebugAccess::Localhost,
            },
        )
    }

    /// A request as if from `client` (what `into_make_service_with_connect_info` adds).
    fn from(client: [u8; 4], path: &str) -> axum::http::request::Builder {
        axum::http::Request::get(path)
            .extension(ConnectInfo(std::net::SocketAddr::from((client, 40000))))
    }

    impl Gatherer for Fixed {
        fn gather(&self, _: Exposition) -> Vec<Family> {
            std::thread::sleep(self.delay);
            vec![Family::new("queue_depth", Kind::Gauge, "Depth.").with(&[("service", "a")], 2.0)]
        }

        fn debug_threads(&self) -> String {
            "tid\n1\n".to_owned()
        }

        fn health(&self) -> String {
            "degraded\nseries_dropped_total = 3 (rose in the last 5m): raise it\n".to_owned()
        }

        fn debug_locks(&self, query: &LocksQuery) -> Result<String, DebugError> {
            if query.service == "web" {
                Ok(format!("{:?} {}\n", query.format, query.limit))
            } else {
                Err(DebugError::UnknownService(query.service.clone()))
            }
        }

        fn debug_snapshots(&self) -> String {
            "{\"snapshots\": []}\n".to_owned()
        }

        fn debug_stacks(&self, view: View, query: &StacksQuery) -> Result<Vec<u8>, DebugError> {
            match query.snapshot {
                Some(7) | None => Ok(format!("{view:?} {query:?}\n").into_bytes()),
                other => Err(DebugError::NoSnapshot(other)),
            }
        }

        /// `service=busy` is refused; `seconds` is taken as milliseconds.
        fn begin_profile(
            &self,
            query: &ProfileQuery,
            requested_ns: u64,
        ) -> Result<Ticket, Refusal> {
            if query.service.as_deref() == Some("busy") {
                return Err(Refusal::TooMany(4));
            }
            let milliseconds = query.seconds.as_deref().unwrap_or("0").parse().unwrap_or(0);
            Ok(Ticket {
                slot: 0,
                id: 1,
                request: crate::stacks::sessions::ProfileRequest {
                    service: query.service.clone().unwrap_or_default(),
                    pool: None,
                    duration: Duration::from_millis(milliseconds),
                    hz: 99,
                    view: View::Cpu,
                    format: profile::Format::Folded,
                },
                requested_ns,
            })
        }

        fn end_profile(&self, ticket: Ticket) -> Result<ProfileOutput, Refusal> {
            Ok(ProfileOutput {
                body: format!("{} 1\n", ticket.request.service).into_bytes(),
                format: ticket.request.format,
                stacks_dropped: 2,
            })
        }

        fn cancel_profile(&self, _ticket: Ticket) {
            self.cancelled
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }

        fn stopping(&self) -> tokio::sync::watch::Receiver<bool> {
            self.stopping.subscribe()
        }
    }

    async fn get(path: &str, accept: Option<&str>) -> (StatusCode, String, String) {
        let mut request = from([127, 0, 0, 1], path);
        if let Some(accept) = accept {
            request = request.header(header::ACCEPT, accept);
        }
        send(router(Arc::default(), LIMITS), request).await
    }

    async fn send(
        router: Router,
        request: axum::http::request::Builder,
    ) -> (StatusCode, String, String) {
        let (status, headers, body) = send_raw(router, request).await;
        let content_type = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        (
            status,
            content_type,
            String::from_utf8_lossy(&body).into_owned(),
        )
    }

    /// The response's status, headers and body bytes as sent.
    async fn send_raw(
        router: Router,
        request: axum::http::request::Builder,
    ) -> (StatusCode, HeaderMap, axum::body::Bytes) {
        let request = request.body(Body::empty()).expect("request");
        let response = router.oneshot(request).await.expect("response");
        let (status, headers) = (response.status(), response.headers().clone());
        let body = response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes();
        (status, headers, body)
    }

    #[tokio::test]
    async fn metrics_in_both_formats() {
        let (status, content_type, body) = get("/metrics", None).await;
        assert_eq!(status, StatusCode::OK);
        assert!(content_type.starts_with("text/plain; version=0.0.4"));
        assert!(body.contains("poolscope_queue_depth{service=\"a\"} 2\n"));
        let (_, content_type, body) = get(
            "/metrics",
            Some("application/openmetrics-text; version=1.0.0"),
        )
        .await;
        assert!(content_type.starts_with("application/openmetrics-text"));
        assert!(body.ends_with("# EOF\n"));
    }

    #[tokio::test]
    async fn metrics_are_gzipped_when_the_scraper_asks() -> std::io::Result<()> {
        use std::io::Read as _;
        let plain = get("/metrics", None).await.2;
        for (accept_encoding, gzipped) in [
            ("gzip", true),
            ("deflate, gzip;q=0.5", true),
            ("*", true),
            ("gzip;q=0", false),
            ("identity", false),
        ] {
            let request =
                from([127, 0, 0, 1], "/metrics").header(header::ACCEPT_ENCODING, accept_encoding);
            let (_, headers, body) = send_raw(router(Arc::default(), LIMITS), request).await;
            let encoding = headers.get(header::CONTENT_ENCODING).cloned();
            let vary = headers.get(header::VARY).cloned();
            assert_eq!(
                vary.as_ref().and_then(|v| v.to_str().ok()),
                Some("accept-encoding")
            );
            let text = if gzipped {
                assert_eq!(
                    encoding.as_ref().and_then(|v| v.to_str().ok()),
                    Some("gzip"),
                    "{accept_encoding}"
                );
                let mut text = String::new();
                flate2::read::GzDecoder::new(&body[..]).read_to_string(&mut text)?;
                text
            } else {
                assert_eq!(encoding, None, "{accept_encoding}");
                String::from_utf8_lossy(&body).into_owned()
            };
            assert_eq!(text, plain, "{accept_encoding}");
        }
        Ok(())
    }

    #[tokio::test]
    async fn healthz_and_unknown_paths() {
        let (status, _, body) = get("/healthz", None).await;
        assert_eq!(
            (status, body.lines().next()),
            (StatusCode::OK, Some("degraded"))
        );
        assert_eq!(get("/debug/threads", None).await.2, "tid\n1\n");
        assert_eq!(get("/nope", None).await.0, StatusCode::NOT_FOUND);
    }

    #[tokio::test]
    async fn debug_stacks_validates_its_query() {
        let (status, content_type, body) = get("/debug/stacks/cpu", None).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(content_type, "text/plain; charset=utf-8");
        assert!(
            body.starts_with("Cpu StacksQuery { service: None"),
            "{body}"
        );
        let (status, content_type, body) = get(
            "/debug/stacks/offcpu?service=web&pool=workers&snapshot=7&format=svg",
            None,
        )
        .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(content_type, "image/svg+xml");
        assert!(
            body.contains("OffCpu") && body.contains("Some(\"workers\")"),
            "{body}"
        );
        let (_, content_type, _) = get("/debug/stacks/wall?format=pprof", None).await;
        assert_eq!(content_type, "application/octet-stream");
        let (status, _, body) = get("/debug/stacks/cpu?snapshot=3", None).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(body.contains("no snapshot 3"), "{body}");
        for bad in [
            "/debug/stacks/gpu",
            "/debug/stacks/cpu?format=png",
            "/debug/stacks/cpu?snapshot=x",
        ] {
            assert_eq!(get(bad, None).await.0, StatusCode::BAD_REQUEST, "{bad}");
        }
        let (status, content_type, _) = get("/debug/snapshots", None).await;
        assert_eq!(
            (status, content_type.as_str()),
            (StatusCode::OK, "application/json")
        );
    }

    #[tokio::test]
    async fn debug_locks_validates_its_query() {
        assert_eq!(get("/debug/locks?service=web", None).await.2, "Text 10\n");
        let (status, content_type, body) =
            get("/debug/locks?service=web&format=json&limit=3", None).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(content_type, "application/json");
        assert_eq!(body, "Json 3\n");
        let (status, _, body) = get("/debug/locks?service=db", None).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        assert!(body.contains("no watched service named \"db\""));
        for bad in [
            "/debug/locks",
            "/debug/locks?service=web&format=xml",
            "/debug/locks?service=web&limit=0",
            "/debug/locks?service=web&limit=x",
        ] {
            assert_eq!(get(bad, None).await.0, StatusCode::BAD_REQUEST, "{bad}");
        }
    }

    #[tokio::test]
    async fn pprof_profile_runs_a_session_or_says_why_not() {
        let (status, content_type, body) =
            get("/debug/pprof/profile?service=web&seconds=10", None).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(content_type, "text/plain; charset=utf-8");
        assert_eq!(body, "web 1\n");
        let (status, _, body) = get("/debug/pprof/profile?service=busy", None).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert!(body.contains("profiles.max_sessions"), "{body}");
    }

    #[tokio::test]
    async fn a_client_that_leaves_ends_its_session() -> Result<(), Box<dyn std::error::Error>> {
        let fixed = Arc::new(Fixed::default());
        let request = from(
            [127, 0, 0, 1],
            "/debug/pprof/profile?service=web&seconds=60000",
        )
        .body(Body::empty())?;
        let pending = router(fixed.clone(), LIMITS).oneshot(request);
        // The session runs for a minute; the client gives up after 200 ms.
        let outcome = tokio::time::timeout(Duration::from_millis(200), pending).await;
        assert!(outcome.is_err(), "the session ended early");
        let cancelled = || fixed.cancelled.load(std::sync::atomic::Ordering::SeqCst);
        for _ in 0..100 {
            if cancelled() > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(cancelled(), 1);
        Ok(())
    }

    #[tokio::test]
    async fn stopping_ends_a_session_early() -> Result<(), Box<dyn std::error::Error>> {
        let fixed = Arc::new(Fixed::default());
        let request = from(
            [127, 0, 0, 1],
            "/debug/pprof/profile?service=web&seconds=60000",
        )
        .body(Body::empty())?;
        let pending = tokio::spawn(router(fixed.clone(), LIMITS).oneshot(request));
        tokio::time::sleep(Duration::from_millis(100)).await;
        fixed.stopping.send_replace(true);
        let response = tokio::time::timeout(Duration::from_secs(5), pending).await???;
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(fixed.cancelled.load(std::sync::atomic::Ordering::SeqCst), 0);
        Ok(())
    }

    fn scrape(timeout: Option<&str>) -> axum::http::request::Builder {
        let request = axum::http::Request::get("/metrics");
        match timeout {
            Some(seconds) => request.header(SCRAPE_TIMEOUT_HEADER, seconds),
            None => request,
        }
    }

    #[test]
    fn a_scrape_has_the_scrapers_timeout_less_the_offset() {
        let gate = ScrapeGate::new(LIMITS);
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(
                SCRAPE_TIMEOUT_HEADER,
                HeaderValue::from_str(value).expect("header"),
            );
            gate.deadline(&headers)
        };
        assert_eq!(with("10"), Duration::from_millis(9500));
        assert_eq!(with(" 2.5 "), Duration::from_secs(2));
        assert_eq!(with("0.2"), Duration::from_millis(200));
        for ignored in ["0", "-3", "NaN", "inf", "soon"] {
            assert_eq!(with(ignored), LIMITS.timeout, "{ignored}");
        }
        assert_eq!(gate.deadline(&HeaderMap::new()), LIMITS.timeout);
    }

    #[tokio::test]
    async fn scrapes_beyond_the_limit_are_refused_and_counted() {
        let limits = ScrapeLimits {
            max_concurrent: 1,
            ..LIMITS
        };
        let slow = router(
            Arc::new(Fixed {
                delay: Duration::from_millis(300),
                ..Fixed::default()
            }),
            limits,
        );
        let (first, second) = tokio::join!(send(slow.clone(), scrape(None)), async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            send(slow.clone(), scrape(None)).await
        });
        assert_eq!(first.0, StatusCode::OK);
        assert_eq!(second.0, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            second.2,
            "too many scrapes at once: 1 at most (web.max_concurrent_scrapes)\n"
        );
        let (status, _, body) = send(slow, scrape(None)).await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("poolscope_scrapes_refused_total{reason=\"concurrency\"} 1\n"));
        assert!(body.contains("poolscope_scrapes_refused_total{reason=\"timeout\"} 0\n"));
    }

    #[tokio::test]
    async fn a_scrape_past_its_timeout_is_refused_and_holds_its_place_until_done() {
        let limits = ScrapeLimits {
            max_concurrent: 1,
            timeout_offset: Duration::from_millis(100),
            ..LIMITS
        };
        let slow = router(
            Arc::new(Fixed {
                delay: Duration::from_millis(600),
                ..Fixed::default()
            }),
            limits,
        );
        let (status, _, body) = send(slow.clone(), scrape(Some("0.3"))).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body, "scrape not finished within its timeout of 200ms\n");
        // The abandoned gather still runs and keeps the only place.
        assert_eq!(
            send(slow.clone(), scrape(None)).await.0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        tokio::time::sleep(Duration::from_millis(600)).await;
        let (status, _, body) = send(slow, scrape(None)).await;
        assert_eq!(status, StatusCode::OK);
        assert!(body.contains("poolscope_scrapes_refused_total{reason=\"timeout\"} 1\n"));
        assert!(body.contains("poolscope_scrapes_refused_total{reason=\"concurrency\"} 1\n"));
    }

    #[tokio::test]
    async fn debug_endpoints_answer_loopback_clients_only_unless_told() {
        let debug = |access| {
            app(
                Arc::new(Fixed::default()),
                Arc::new(ScrapeGate::new(LIMITS)),
                Routes {
                    telemetry_path: "/metrics".to_owned(),
                    debug: access,
                },
            )
        };
        let local = send(
            debug(DebugAccess::Localhost),
            from([127, 0, 0, 1], "/debug/threads"),
        )
        .await;
        assert_eq!((local.0, local.2.as_str()), (StatusCode::OK, "tid\n1\n"));
        let remote = send(
            debug(DebugAccess::Localhost),
            from([10, 1, 2, 3], "/debug/threads"),
        )
        .await;
        assert_eq!(remote.0, StatusCode::FORBIDDEN);
        assert!(remote.2.contains("this one is 10.1.2.3"), "{}", remote.2);
        let profile = send(
            debug(DebugAccess::Localhost),
            from([10, 1, 2, 3], "/debug/pprof/profile?service=web"),
        )
        .await;
        assert_eq!(profile.0, StatusCode::FORBIDDEN);
        let mapped = axum::http::Request::get("/debug/threads").extension(ConnectInfo(
            "[::ffff:127.0.0.1]:40000"
                .parse::<std::net::SocketAddr>()
                .expect("address"),
        ));
        assert_eq!(
            send(debug(DebugAccess::Localhost), mapped).await.0,
            StatusCode::OK
        );
        let unknown = axum::http::Request::get("/debug/threads");
        assert_eq!(
            send(debug(DebugAccess::Localhost), unknown).await.0,
            StatusCode::FORBIDDEN
        );
        let all = send(
            debug(DebugAccess::All),
            from([10, 1, 2, 3], "/debug/threads"),
        )
        .await;
        assert_eq!(all.0, StatusCode::OK);
        let off = send(
            debug(DebugAccess::Off),
            from([127, 0, 0, 1], "/debug/threads"),
        )
        .await;
        assert_eq!(off.0, StatusCode::NOT_FOUND);
        // The rest is for everyone.
        let metrics = send(debug(DebugAccess::Off), from([10, 1, 2, 3], "/metrics")).await;
        assert_eq!(metrics.0, StatusCode::OK);
    }
}
