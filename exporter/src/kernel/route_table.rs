//! The route table (DESIGN §3), the user-space half of the kernel's route records:
//! each finished request the kernel handed over (`RouteEvent`: its first bytes, status
//! and times) named by its route — the method and the first of its service's templates
//! (`[[targets]] routes`) that names its path, else the path with each segment that
//! names one object of many (a number, a UUID, a long hex id) as `:id`, the query left
//! out — and counted per service and
//! route, by status class, with queue time and duration histograms. A service keeps
//! at most `[limits] routes_per_service` routes and all together `[limits] routes`;
//! beyond, requests count under [`OTHER_ROUTE`], and requests whose first bytes are no
//! request line under [`UNKNOWN_ROUTE`].
use std::collections::{BTreeMap, HashMap};

use crate::config::RoutePatterns;
use poolscope_shared::{
    Histogram, ROUTE_BYTES, RouteEvent, STATUS_CLASSES, StatusClass, histogram_bucket,
    route_line_bytes,
};

/// The route label of requests whose first bytes were no HTTP/1 request line (and of
/// HTTP/2 streams).
pub const UNKNOWN_ROUTE: &str = "unknown";
/// The route label of requests whose route was past the caps.
pub const OTHER_ROUTE: &str = "other";
/// Stands for the segments of a path past the bytes read ([`ROUTE_BYTES`]).
pub const CUT_MARK: &str = "…";

/// The templates of a service that has none.
static NO_PATTERNS: RoutePatterns = RoutePatterns::NONE;

/// Longest method read (`OPTIONS`, `PROPFIND`, `M-SEARCH` are all shorter).
const MAX_METHOD_BYTES: usize = 16;
/// Hex digits from which a segment of hex digits and dashes is an id (a UUID has 32,
/// a SHA-1 40; a word of the letters a–f is shorter).
const MIN_HEX_ID_DIGITS: usize = 16;

/// Whether a path segment names one object of many: all decimal digits, or hex
/// digits and dashes with at least [`MIN_HEX_ID_DIGITS`] digits.
fn is_id(segment: &[u8]) -> bool {
    let all = |test: fn(&u8) -> bool| segment.iter().all(test);
    let hex = segment
        .iter()
        .filter(|byte| byte.is_ascii_hexdigit())
        .count();
    (!segment.is_empty() && all(u8::is_ascii_digit))
        || (all(|&byte| byte.is_ascii_hexdigit() || byte == b'-') && hex >= MIN_HEX_ID_DIGITS)
}

/// A route's label: its method (empty for the reserved routes) and route.
pub type RouteLabel = (String, String);

/// The method and route of the request line that begins with `line`, named by the
/// first of `patterns` that names its path, else by the default normalizer; `None` if
/// it is no request line (another protocol, binary bytes, the HTTP/2 preface, an
/// absolute or authority target).
pub fn route_label(line: &[u8], patterns: &RoutePatterns) -> Option<RouteLabel> {
    let space = line.iter().position(|&byte| byte == b' ')?;
    let (method, target) = (line.get(..space)?, line.get(space + 1..)?);
    let method_ok = !method.is_empty()
        && method.len() <= MAX_METHOD_BYTES
        && method
            .iter()
            .all(|&byte| byte.is_ascii_uppercase() || byte == b'-' || byte == b'_');
    // `PRI * HTTP/2.0` begins the HTTP/2 client preface.
    if !method_ok || method == b"PRI" {
        return None;
    }
    let method = String::from_utf8_lossy(method).into_owned();
    let path = match target.first()? {
        b'*' => return Some((method, "*".to_owned())),
        b'/' => target.get(1..)?,
        _ => return None,
    };
    let ends = |byte: &u8| matches!(byte, b'?' | b'#' | 0..=b' ' | 0x7f);
    let (path, cut) = match path.iter().position(ends) {
        Some(end) => (path.get(..end)?, false),
        None => (path, true),
    };
    if let Some(template) = patterns.route_of(path, cut) {
        return Some((method, template.to_owned()));
    }
    let mut route = String::with_capacity(path.len() + 1);
    for segment in path.split(|&byte| byte == b'/') {
        route.push('/');
        if is_id(segment) {
            route.push_str(":id");
        } else {
            route.push_str(&String::from_utf8_lossy(segment));
        }
    }
    if path.is_empty() {
        route.truncate(1);
    }
    if cut {
        route.push_str(CUT_MARK);
    }
    Some((method, route))
}

/// gRPC status codes' names (their index is the code), as the `grpc_status` label
/// says them.
pub const GRPC_STATUSES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];
/// The `grpc_status` of a gRPC call whose status was not read (its trailers' block
/// not decoded, a code past the known ones, or none sent).
pub const GRPC_STATUS_UNREAD: u8 = GRPC_STATUSES.len() as u8;

/// The `grpc_status` label of code index `code`.
pub fn grpc_status_label(code: u8) -> &'static str {
    GRPC_STATUSES
        .get(usize::from(code))
        .copied()
        .unwrap_or("unread")
}

/// How a finished request was answered: its final status (0: not read) and, for a
/// gRPC call, its code ([`GRPC_STATUS_UNREAD`] if not read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub grpc: Option<u8>,
}

/// A finished request, named.
#[derive(Clone, Copy, Debug)]
pub struct Finished {
    pub answer: Answer,
    /// start − arrive, end − start
    pub queue_ns: u64,
    pub duration_ns: u64,
}

/// The requests of one route of a service.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouteTotals {
    /// Finished requests (gRPC calls aside) by status class (`StatusClass::ALL`'s
    /// order).
    pub responses: [u64; STATUS_CLASSES],
    /// Finished gRPC calls by status class index and gRPC code.
    pub grpc: BTreeMap<(usize, u8), u64>,
    /// start − arrive
    pub queue: Histogram,
    /// end − start
    pub duration: Histogram,
}

impl RouteTotals {
    fn add(&mut self, finished: &Finished) {
        let class = StatusClass::index_of(finished.answer.status);
        match finished.answer.grpc {
            Some(code) => *self.grpc.entry((class, code)).or_default() += 1,
            None => {
                if let Some(count) = self.responses.get_mut(class) {
                    *count += 1;
                }
            }
        }
        add_to_histogram(&mut self.queue, finished.queue_ns);
        add_to_histogram(&mut self.duration, finished.duration_ns);
    }
}

fn add_to_histogram(histogram: &mut Histogram, ns: u64) {
    if let Some(bucket) = histogram.buckets.get_mut(histogram_bucket(ns)) {
        *bucket += 1;
        histogram.sum_ns += ns;
    }
}

/// How many routes are kept: per service, and over all services.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteCaps {
    pub per_service: usize,
    pub total: usize,
}

/// The routes of every service, as the kernel's records built them.
#[derive(Debug)]
pub struct RouteTable {
    caps: RouteCaps,
    services: HashMap<u32, BTreeMap<RouteLabel, RouteTotals>>,
    /// The templates of services that have some.
    patterns: HashMap<u32, RoutePatterns>,
    /// Routes kept over all services (the reserved ones not counted).
    kept: usize,
}

impl RouteTable {
    pub fn new(caps: RouteCaps) -> Self {
        Self {
            caps,
            services: HashMap::new(),
            patterns: HashMap::new(),
            kept: 0,
        }
    }

    /// Counts one finished HTTP/1 request, named by its first bytes.
    pub fn add(&mut self, event: &RouteEvent) {
        let len = usize::from(event.line_len).min(ROUTE_BYTES);
        let finished = Finished {
            answer: Answer {
                status: event.status,
                grpc: None,
            },
            queue_ns: event.queue_ns,
            duration_ns: event.duration_ns,
        };
        self.add_line(
            event.service,
            route_line_bytes(&event.line).get(..len),
            &finished,
        );
    }

    /// Counts one finished request of `service` whose request line (or, for an HTTP/2
    /// stream, its `:method`, `:path` and a space) is `line` (`None`: not read).
    pub fn add_line(&mut self, service: u32, line: Option<&[u8]>, finished: &Finished) {
        let patterns = self.patterns.get(&service).unwrap_or(&NO_PATTERNS);
        let label = line
            .and_then(|line| route_label(line, patterns))
            .unwrap_or_else(|| (String::new(), UNKNOWN_ROUTE.to_owned()));
        let routes = self.services.entry(service).or_default();
        let label = if label.0.is_empty() || routes.contains_key(&label) {
            label
        } else if kept_of(routes) < self.caps.per_service && self.kept < self.caps.total {
            self.kept += 1;
            label
        } else {
            (String::new(), OTHER_ROUTE.to_owned())
        };
        routes.entry(label).or_default().add(finished);
    }

    /// The routes of `service` (none if it finished no request since it was
    /// watched).
    pub fn service(&self, service: u32) -> BTreeMap<RouteLabel, RouteTotals> {
        self.services.get(&service).cloned().unwrap_or_default()
    }

    /// The templates that name `service`'s routes.
    pub fn patterns(&self, service: u32) -> &RoutePatterns {
        self.patterns.get(&service).unwrap_or(&NO_PATTERNS)
    }

    /// Names `service`'s routes by `patterns` from now on.
    pub fn set_patterns(&mut self, service: u32, patterns: RoutePatterns) {
        if patterns.is_empty() {
            self.patterns.remove(&service);
        } else {
            self.patterns.insert(service, patterns);
        }
    }

    /// Forgets `service`'s routes and templates (its id is to be reused).
    pub fn reset_service(&mut self, service: u32) {
        self.patterns.remove(&service);
        if let Some(routes) = self.services.remove(&service) {
            self.kept = self.kept.saturating_sub(kept_of(&routes));
        }
    }
}

/// The routes of a service that count against the caps (not the reserved ones).
fn kept_of(routes: &BTreeMap<RouteLabel, RouteTotals>) -> usize {
    routes
        .keys()
        .filter(|(method, _)| !method.is_empty())
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn label(line: &str) -> Option<RouteLabel> {
        route_label(line.as_bytes(), &NO_PATTERNS)
    }

    fn named(method: &str, route: &str) -> Option<RouteLabel> {
        Some((method.to_owned(), route.to_owned()))
    }

    #[test]
    fn routes_are_named_with_ids_folded_and_no_query() {
        let cases = [
            ("GET /users/42?x=1 HTTP/1.1", named("GET", "/users/:id")),
            ("GET /users/7#top HTTP/1.1", named("GET", "/users/:id")),
            ("GET / HTTP/1.1", named("GET", "/")),
            ("GET /?q=1 HTTP/1.1", named("GET", "/")),
            ("POST /users/ HTTP/1.1", named("POST", "/users/")),
            ("GET /users HTTP/1.1", named("GET", "/users")),
            (
                "DELETE /o/3e1a6e0c-5b1f-4d1e-9b4e-0d2f8c7a9b10/items/7#f ",
                named("DELETE", "/o/:id/items/:id"),
            ),
            (
                "GET /blob/da39a3ee5e6b4b0d3255bfef95601890afd80709 ",
                named("GET", "/blob/:id"),
            ),
            ("GET /blob/0123456789abcdef ", named("GET", "/blob/:id")),
            // Short hex words are words.
            ("GET /feed/deadbeef ", named("GET", "/feed/deadbeef")),
            ("GET /api/v1/x ", named("GET", "/api/v1/x")),
            ("OPTIONS * HTTP/1.1", named("OPTIONS", "*")),
            ("GET /a/very/lo", named("GET", "/a/very/lo…")),
            ("PRIX / ", named("PRIX", "/")),
        ];
        for (line, expected) in cases {
            assert_eq!(label(line), expected, "{line}");
        }
    }

    #[test]
    fn a_services_templates_name_its_routes_before_the_normalizer() {
        let templates = ["/users/{name}".to_owned(), "/files/*".to_owned()];
        let patterns = RoutePatterns::parse(&templates).expect("valid templates");
        let mut table = RouteTable::new(RouteCaps {
            per_service: 10,
            total: 10,
        });
        table.set_patterns(1, patterns.clone());
        for service in [1, 2] {
            for line in [
                "GET /users/alice HTTP/1.1",
                "GET /users/42?x HTTP/1.1",
                "PUT /files/a/b/c.txt HTTP/1.1",
                "GET /orders/42 HTTP/1.1",
            ] {
                table.add(&event(service, line, 200, 1));
            }
        }
        let routes = |service| -> Vec<(String, String, u64)> {
            table
                .service(service)
                .into_iter()
                .map(|((method, route), totals)| (method, route, totals.responses.iter().sum()))
                .collect()
        };
        let owned = |method: &str, route: &str, count| (method.to_owned(), route.to_owned(), count);
        assert_eq!(
            routes(1),
            [
                owned("GET", "/orders/:id", 1),
                owned("GET", "/users/{name}", 2),
                owned("PUT", "/files/*", 1),
            ]
        );
        assert_eq!(
            routes(2),
            [
                owned("GET", "/orders/:id", 1),
                owned("GET", "/users/:id", 1),
                owned("GET", "/users/alice", 1),
                owned("PUT", "/files/a/b/c.txt", 1),
            ]
        );
        assert_eq!(table.patterns(1), &patterns);
        // An id reused by another service starts without the old one's templates.
        table.reset_service(1);
        assert!(table.patterns(1).is_empty());
    }

    #[test]
    fn no_request_line_is_no_route() {
        for line in [
            &b""[..],
            b"GET",
            b"GET ",
            b"get / HTTP/1.1",
            b"\x16\x03\x01\x02\x00",
            b"GET http://example.com/ HTTP/1.1",
            b"CONNECT example.com:443 HTTP/1.1",
            b"AVERYLONGMETHODNAME / HTTP/1.1",
            b" / HTTP/1.1",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        ] {
            assert_eq!(route_label(line, &NO_PATTERNS), None, "{line:?}");
        }
    }

    fn event(service: u32, line: &str, status: u16, duration_ns: u64) -> RouteEvent {
        RouteEvent::request(service, status, line.as_bytes(), 1_000, duration_ns)
    }

    #[test]
    fn requests_count_per_route_and_class_within_the_caps() {
        let mut table = RouteTable::new(RouteCaps {
            per_service: 2,
            total: 3,
        });
        for event in [
            event(1, "GET /users/1 HTTP/1.1", 200, 2_000_000),
            event(1, "GET /users/2?x HTTP/1.1", 500, 4_000_000),
            event(1, "\u{16}\u{3}", 0, 1),
            event(1, "GET /fail HTTP/1.1", 503, 1),
            // Past the service's cap of 2.
            event(1, "GET /third HTTP/1.1", 200, 1),
            event(2, "GET /a HTTP/1.1", 404, 1),
            // Past the cap of 3 over all.
            event(2, "GET /b HTTP/1.1", 404, 1),
        ] {
            table.add(&event);
        }
        let one = table.service(1);
        let users = &one[&("GET".to_owned(), "/users/:id".to_owned())];
        assert_eq!(users.responses, [0, 0, 1, 0, 0, 1]);
        assert_eq!(users.duration.count(), 2);
        assert_eq!(users.duration.sum_ns, 6_000_000);
        assert_eq!(
            one[&(String::new(), UNKNOWN_ROUTE.to_owned())].responses,
            [1, 0, 0, 0, 0, 0]
        );
        assert_eq!(
            one[&(String::new(), OTHER_ROUTE.to_owned())].responses,
            [0, 0, 1, 0, 0, 0]
        );
        let two = table.service(2);
        assert_eq!(two.len(), 2, "{two:?}");
        assert!(two.contains_key(&(String::new(), OTHER_ROUTE.to_owned())));
        // A service's routes go with it, and free their share of the cap.
        table.reset_service(1);
        assert!(table.service(1).is_empty());
        table.add(&event(2, "GET /b HTTP/1.1", 200, 1));
        assert!(
            table
                .service(2)
                .contains_key(&("GET".to_owned(), "/b".to_owned()))
        );
    }
}
