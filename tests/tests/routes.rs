//! Routes: every finished HTTP/1 request counts under its route (method, and the
//! service's template that names its path, else the path with its ids as `:id`, no
//! query) and the class of its answer's status
//! (`poolscope_route_requests_total`), with its route's queue time and duration
//! histograms, on every backend. Truth: the server's own count and timing of what it
//! served per route (`tests/http1/route_server.py`), and the clients' count of the
//! answers they read. Also: 100,000 distinct paths stay within the route caps and
//! every request still counts; bytes that are no request line count under
//! `route="unknown"`.
use std::{
    collections::BTreeMap,
    io::{BufReader, Read as _, Write as _},
    net::TcpStream,
    time::Duration,
};

use anyhow::Context as _;
use poolscope_tests::{
    Metrics, Poolscope, backends,
    http1::{RouteServer, ServedRoutes, read_answer},
    one_at_a_time, pids_config, privileged, requests_settled, scorecard, scrape_until,
};

/// Keep-alive connections, each making [`REQUESTS`] requests of the mix in turn.
const CONNECTIONS: usize = 4;
const REQUESTS: usize = 64;

/// The `n`th request of a connection's mix: its method, path and body, and the status
/// the server answers it with. Of 8: 4 `GET /fast`, 1 `POST /fast`, 1 `GET
/// /slow/<id>?q=<n>` (a new id each time), 1 `GET /fail`, 1 `GET /missing/page`.
fn request(connection: usize, n: usize) -> (&'static str, String, &'static str, u16) {
    match n % 8 {
        0..=3 => ("GET", "/fast".to_owned(), "", 200),
        4 => ("POST", "/fast".to_owned(), "x=1", 200),
        5 => (
            "GET",
            format!("/slow/{}?q={n}", connection * 1000 + n),
            "",
            200,
        ),
        6 => ("GET", "/fail".to_owned(), "", 500),
        _ => ("GET", "/missing/page".to_owned(), "", 404),
    }
}

/// The service's one route template: it names `/missing/page`, which the default
/// normalizer would keep as it is.
const TEMPLATE: &str = "/missing/*";

/// The route poolscope names a route of the server's (which knows no template).
fn templated(route: &str) -> &str {
    if route.starts_with("/missing/") {
        TEMPLATE
    } else {
        route
    }
}

/// One connection's requests; the answers it read, by status.
fn ask_in_turn(port: u16, connection: usize) -> anyhow::Result<BTreeMap<u16, u64>> {
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let mut read = BTreeMap::new();
    for n in 0..REQUESTS {
        let (method, path, body, code) = request(connection, n);
        let length = if body.is_empty() {
            String::new()
        } else {
            format!("Content-Length: {}\r\n", body.len())
        };
        writer.write_all(
            format!("{method} {path} HTTP/1.1\r\nHost: t\r\n{length}\r\n{body}").as_bytes(),
        )?;
        let (status, _) = read_answer(&mut reader)?;
        anyhow::ensure!(status == code, "{method} {path}: {status}, not {code}");
        *read.entry(status).or_default() += 1;
    }
    Ok(read)
}

/// Every `poolscope_route_requests_total` sample of `service`: (method, route,
/// class) → count; the reserved routes have no method.
fn route_counts(metrics: &Metrics, service: &str) -> BTreeMap<(String, String, String), f64> {
    let label = |sample: &poolscope_tests::Sample, key: &str| {
        sample
            .labels
            .iter()
            .find(|(name, _)| name == key)
            .map(|(_, value)| value.clone())
            .unwrap_or_default()
    };
    metrics
        .samples
        .iter()
        .filter(|sample| {
            sample.name == "poolscope_route_requests_total" && label(sample, "service") == service
        })
        .map(|sample| {
            (
                (
                    label(sample, "method"),
                    label(sample, "route"),
                    label(sample, "status_class"),
                ),
                sample.value,
            )
        })
        .collect()
}

/// A route's mean duration as poolscope has it (seconds), from its histogram.
fn mean_duration(metrics: &Metrics, service: &str, method: &str, route: &str) -> Option<f64> {
    let labels = [("service", service), ("route", route), ("method", method)];
    metrics.histogram_mean("poolscope_route_request_duration_seconds", &labels)
}

/// A poolscope watching a route server on `backend` whose routes its target's
/// `routes` value reads (`[probes] routes` left off), with `limits` config lines in
/// `[limits]`, and, as `plain`, other servers whose routes are not read; the server,
/// the service's name and the poolscope.
fn watched(
    backend: &str,
    limits: &str,
    routes: &str,
    plain: &[(&str, u32)],
) -> anyhow::Result<(RouteServer, String, Poolscope)> {
    let service = format!("routes-{backend}");
    let server = RouteServer::start()?;
    let mut config = format!(
        "[probes]\nbackend = \"{backend}\"\n[limits]\n{limits}\n{}routes = {routes}\n",
        pids_config(&service, &[server.pid()])
    );
    for (name, pid) in plain {
        config.push_str(&format!(
            "[[targets]]\nservice = \"{name}\"\npids = [{pid}]\n"
        ));
    }
    let poolscope = Poolscope::start(&config)?;
    scrape_until(&poolscope, |m| {
        [service.as_str()]
            .iter()
            .chain(plain.iter().map(|(name, _)| name))
            .all(|name| m.value("poolscope_targets", &[("service", name)]) == Some(1.0))
    })?;
    Ok((server, service, poolscope))
}

/// The mix, from [`CONNECTIONS`] clients at once; what the server served, and
/// poolscope's scrape once it counted every request. Meanwhile a server whose routes
/// are not read serves the mix on one connection: counted, with no route.
fn run_mix(backend: &str) -> anyhow::Result<(ServedRoutes, String, Metrics)> {
    let unread = RouteServer::start()?;
    let unread_service = format!("unread-{backend}");
    let (server, service, poolscope) = watched(
        backend,
        "",
        &format!("[{TEMPLATE:?}]"),
        &[(&unread_service, unread.pid())],
    )?;
    let port = server.port;
    let unread_port = unread.port;
    let clients: Vec<_> = (0..CONNECTIONS)
        .map(|connection| std::thread::spawn(move || ask_in_turn(port, connection)))
        .chain([std::thread::spawn(move || ask_in_turn(unread_port, 0))])
        .collect();
    let mut read: Vec<u64> = Vec::new();
    for client in clients {
        let by_status = client
            .join()
            .map_err(|_| anyhow::anyhow!("a client panicked"))??;
        read.push(by_status.values().sum::<u64>());
    }
    let unread_made = read.pop().unwrap_or_default();
    let read: u64 = read.iter().sum();
    // The clients hang up; each connection's last request ends at its close.
    let metrics = scrape_until(&poolscope, |m| {
        requests_settled(m, &service, read)
            && requests_settled(m, &unread_service, unread_made)
            && m.connection_entries() == Some(0.0)
    })
    .with_context(|| format!("{service}: {read} requests"))?;
    let unread_routes = route_counts(&metrics, &unread_service);
    anyhow::ensure!(
        unread_routes.is_empty(),
        "{unread_service}, whose routes are not read, has routes {unread_routes:?}"
    );
    drop(unread);
    let served = server.finish()?;
    let made: u64 = served.values().map(|(count, _)| count).sum();
    anyhow::ensure!(
        made == read,
        "the server served {made}, the clients read {read}"
    );
    Ok((served, service, metrics))
}

fn routes_counted(backend: &str) -> anyhow::Result<()> {
    let _serial = one_at_a_time();
    let (served, service, metrics) = run_mix(backend)?;
    let counted = route_counts(&metrics, &service);
    println!("{backend}: the server served {served:?}\npoolscope counted {counted:?}");
    // Each route and class the server served, counted exactly, and nothing else.
    let mut expected = BTreeMap::new();
    for (key, &(count, _)) in &served {
        let mut parts = key.splitn(3, ' ');
        let (Some(method), Some(route), Some(class)) = (parts.next(), parts.next(), parts.next())
        else {
            anyhow::bail!("the server's route {key:?}");
        };
        expected.insert(
            (
                method.to_owned(),
                templated(route).to_owned(),
                class.to_owned(),
            ),
            count as f64,
        );
    }
    for ((method, route, class), &truth) in &expected {
        let ours = counted
            .get(&(method.clone(), route.clone(), class.clone()))
            .copied()
            .unwrap_or(0.0);
        scorecard::exact(
            "route_requests_total per route, method and status class",
            "the server's count of the answers it wrote per route and class",
            backend,
            ours,
            truth,
        );
    }
    assert_eq!(counted, expected, "{backend}: requests per route and class");
    // Mean duration per route, against the server's own timing of the same requests.
    let mut by_route: BTreeMap<(String, String), (u64, f64)> = BTreeMap::new();
    for (key, &(count, seconds)) in &served {
        let mut parts = key.splitn(3, ' ');
        let (Some(method), Some(route)) = (parts.next(), parts.next()) else {
            anyhow::bail!("the server's route {key:?}");
        };
        let entry = by_route
            .entry((method.to_owned(), templated(route).to_owned()))
            .or_default();
        entry.0 += count;
        entry.1 += seconds;
    }
    for ((method, route), (count, seconds)) in by_route {
        let truth = seconds / count as f64;
        let ours = mean_duration(&metrics, &service, &method, &route)
            .with_context(|| format!("{backend}: no duration for {method} {route}"))?;
        println!(
            "{backend}: {method} {route}: mean {:.3} ms, the server's {:.3} ms",
            ours * 1e3,
            truth * 1e3
        );
        scorecard::within(
            "mean duration of a route's requests",
            "the server's own timing, request line read to answer written",
            backend,
            ours,
            truth,
            0.05,
        );
        assert!(
            (ours - truth).abs() <= 0.05 * truth,
            "{backend}: {method} {route}: mean duration {ours} s, the server's {truth} s"
        );
    }
    Ok(())
}

#[test]
fn every_request_counts_under_its_route_and_class() -> anyhow::Result<()> {
    if !privileged("every_request_counts_under_its_route_and_class") {
        return Ok(());
    }
    for backend in backends() {
        routes_counted(backend)?;
    }
    Ok(())
}

/// Distinct random paths at full rate, from [`ATTACKERS`] keep-alive connections.
const ATTACK_PATHS: usize = 100_000;
const ATTACKERS: usize = 8;
/// The routes a service keeps, as the test sets it.
const ROUTES_PER_SERVICE: usize = 50;

/// One attacker's share of the distinct paths: `/attack/<letters>`, letters no id
/// rule folds, different for every request.
fn attack(port: u16, attacker: usize) -> anyhow::Result<u64> {
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let mut made = 0;
    for n in (attacker..ATTACK_PATHS).step_by(ATTACKERS) {
        // Base-26 letters of n: distinct for every n.
        let mut letters = String::new();
        let mut rest = n;
        loop {
            letters.push(char::from(b'a' + (rest % 26) as u8));
            rest /= 26;
            if rest == 0 {
                break;
            }
        }
        writer
            .write_all(format!("GET /attack/x{letters} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes())?;
        let (status, _) = read_answer(&mut reader)?;
        anyhow::ensure!(status == 404, "/attack/x{letters}: {status}");
        made += 1;
    }
    Ok(made)
}

fn attack_bounded(backend: &str) -> anyhow::Result<()> {
    let _serial = one_at_a_time();
    let (server, service, poolscope) = watched(
        backend,
        &format!("routes_per_service = {ROUTES_PER_SERVICE}"),
        "true",
        &[],
    )?;
    let port = server.port;
    let attackers: Vec<_> = (0..ATTACKERS)
        .map(|attacker| std::thread::spawn(move || attack(port, attacker)))
        .collect();
    let mut made = 0;
    for attacker in attackers {
        made += attacker
            .join()
            .map_err(|_| anyhow::anyhow!("an attacker panicked"))??;
    }
    let metrics = scrape_until(&poolscope, |m| {
        requests_settled(m, &service, made) && m.connection_entries() == Some(0.0)
    })
    .with_context(|| format!("{service}: {made} requests"))?;
    drop(server);
    let counted = route_counts(&metrics, &service);
    let total: f64 = counted.values().sum();
    let other = counted
        .get(&(String::new(), "other".to_owned(), "4xx".to_owned()))
        .copied()
        .unwrap_or(0.0);
    let series = counted.len();
    println!(
        "{backend}: {made} distinct paths: {series} route series, {total} requests counted, \
         {other} under other"
    );
    scorecard::exact(
        "requests counted over all routes under 100,000 distinct paths",
        "the requests the clients made",
        backend,
        total,
        made as f64,
    );
    assert_eq!(total, made as f64, "{backend}: every request counted");
    // The cap, and one more per CPU that made a route at the same moment.
    assert!(
        series <= ROUTES_PER_SERVICE + 1 + 2,
        "{backend}: {series} route series for {ROUTES_PER_SERVICE} routes"
    );
    assert!(
        other >= (made as usize - ROUTES_PER_SERVICE - 2) as f64,
        "{backend}: {other} under other"
    );
    Ok(())
}

#[test]
fn distinct_paths_stay_within_the_route_cap() -> anyhow::Result<()> {
    if !privileged("distinct_paths_stay_within_the_route_cap") {
        return Ok(());
    }
    for backend in backends() {
        attack_bounded(backend)?;
    }
    Ok(())
}

/// Bytes that are no request line (answered with no status line), a request line
/// split over reads, or one cut: each counted once, under `route="unknown"` where no
/// route could be read, and the connection still served.
fn bad_input(backend: &str) -> anyhow::Result<()> {
    let _serial = one_at_a_time();
    let (server, service, poolscope) = watched(backend, "", "true", &[])?;
    let port = server.port;
    // A request line split over two reads: the first read holds no route.
    let split = TcpStream::connect(("127.0.0.1", port))?;
    let mut reader = BufReader::new(split.try_clone()?);
    let mut writer = split;
    writer.write_all(b"GE")?;
    std::thread::sleep(Duration::from_millis(50));
    writer.write_all(b"T /fast HTTP/1.1\r\nHost: t\r\n\r\n")?;
    anyhow::ensure!(read_answer(&mut reader)?.0 == 200, "split request");
    // A path longer than what the kernel reads: its route is cut.
    let long = format!("/{}", "x".repeat(60_000));
    writer.write_all(format!("GET {long} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes())?;
    anyhow::ensure!(read_answer(&mut reader)?.0 == 404, "long path");
    // Then a plain one on the same connection.
    writer.write_all(b"GET /fast HTTP/1.1\r\nHost: t\r\n\r\n")?;
    anyhow::ensure!(read_answer(&mut reader)?.0 == 200, "after the long path");
    drop((reader, writer));
    // Binary bytes, one word on a line: an HTTP/0.9 request to Python's http.server,
    // which answers with a body and no status line, and closes.
    let mut garbage = TcpStream::connect(("127.0.0.1", port))?;
    garbage.write_all(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n")?;
    let mut answer = String::new();
    garbage.read_to_string(&mut answer)?;
    anyhow::ensure!(
        answer.starts_with("<!DOCTYPE HTML>") && answer.contains("400"),
        "binary bytes: {answer:?}"
    );
    drop(garbage);
    let metrics = scrape_until(&poolscope, |m| {
        requests_settled(m, &service, 4) && m.connection_entries() == Some(0.0)
    })?;
    drop(server);
    let counted = route_counts(&metrics, &service);
    println!("{backend}: {counted:?}");
    let unknown = |class: &str| {
        counted
            .get(&(String::new(), "unknown".to_owned(), class.to_owned()))
            .copied()
            .unwrap_or(0.0)
    };
    assert_eq!(unknown("2xx"), 1.0, "{backend}: the split request");
    assert_eq!(
        unknown("unknown"),
        1.0,
        "{backend}: the binary bytes, answered without a status line"
    );
    let cut = counted
        .iter()
        .find(|((method, route, class), _)| {
            method == "GET" && route.starts_with("/xxxx") && route.ends_with('…') && class == "4xx"
        })
        .map(|(_, &count)| count);
    assert_eq!(cut, Some(1.0), "{backend}: the long path, cut");
    assert_eq!(
        counted.get(&("GET".to_owned(), "/fast".to_owned(), "2xx".to_owned())),
        Some(&1.0),
        "{backend}: the request after the long path"
    );
    assert_eq!(
        counted.values().sum::<f64>(),
        4.0,
        "{backend}: every request counted once"
    );
    Ok(())
}

#[test]
fn bytes_that_are_no_request_line_count_as_unknown() -> anyhow::Result<()> {
    if !privileged("bytes_that_are_no_request_line_count_as_unknown") {
        return Ok(());
    }
    for backend in backends() {
        bad_input(backend)?;
    }
    Ok(())
}
