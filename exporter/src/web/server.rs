//! The router: which path goes to which endpoint (`app`), built so that tests can call
//! it without a socket. `/metrics` and its [`ScrapeGate`] are in `scrape`, `/healthz`
//! here, `/` in `landing`, `/debug/*` and who may use them in `debug`,
//! `/debug/pprof/profile` in `pprof`; what they ask of the exporter ([`Gatherer`]) in
//! `gatherer`.
use std::sync::Arc;

use axum::{Router, extract::State, middleware, response::Html, routing::get};

pub use crate::web::{
    gatherer::{DebugError, Gatherer, LocksFormat, LocksQuery, ProfileOutput, StacksQuery},
    scrape::{HandshakeError, ScrapeGate},
};
use crate::{
    config::DebugAccess,
    web::{
        debug::{debug_guard, debug_locks, debug_snapshots, debug_stacks, debug_threads},
        landing::landing_page,
        pprof::pprof_profile,
        scrape::metrics,
    },
};

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

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use axum::{
        Router,
        body::Body,
        extract::ConnectInfo,
        http::{HeaderMap, HeaderValue, StatusCode, header},
    };
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    use super::*;
    use crate::{
        collectors::web_server,
        config::{DebugAccess, ScrapeLimits},
        encode::{Exposition, Family, Kind},
        scrape_counts::ScrapeCounts,
        stacks::{
            profile::{self, View},
            sessions::{ProfileQuery, Refusal, Ticket},
        },
        web::scrape::SCRAPE_TIMEOUT_HEADER,
    };

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
        fn gather(&self, _: Exposition, counts: &ScrapeCounts) -> Vec<Family> {
            std::thread::sleep(self.delay);
            let mut families = vec![
                Family::new("queue_depth", Kind::Gauge, "Depth.").with(&[("service", "a")], 2.0),
            ];
            families.extend(web_server::families(counts));
            families
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
