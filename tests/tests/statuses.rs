//! Status classes: every finished HTTP/1 request counts under the class of its final
//! answer's status (`poolscope_responses_total{status_class}`), read from the first
//! bytes the server writes, on every backend; a `103 Early Hints` before an answer,
//! longer than any `100 Continue`, does not end its request. Truth: the server's own
//! count of the answers it wrote, by class (`tests/http1/status_server.py`, Python's
//! http.server, head and body in two writes), and the clients' count of the status
//! lines they read.
use std::{
    io::{BufReader, Read as _, Write as _},
    net::TcpStream,
};

use anyhow::Context as _;
use poolscope_tests::{
    Metrics, Poolscope, backend_config, backends,
    http1::{ByClass, StatusServer, read_answer},
    one_at_a_time, privileged, scorecard, scrape_until,
    steady::value,
};

/// Keep-alive connections, each making [`REQUESTS`] requests in turn, the last one
/// with `Connection: close`.
const CONNECTIONS: usize = 4;
const REQUESTS: usize = 45;
/// The statuses asked for, in turn: with and without a body, every final class.
const CODES: [u16; 9] = [200, 201, 204, 301, 304, 404, 429, 500, 503];
/// Every this many requests on a connection, the answer is preceded by a `103 Early
/// Hints`.
const HINTED_EVERY: usize = 5;
/// The label values of the classes 1xx to 5xx, in order.
const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// What one connection read: final answers by class, and `103 Early Hints`.
#[derive(Default)]
struct Read {
    by_class: ByClass,
    hints: u64,
}

/// One connection's requests; what it read.
fn ask_in_turn(port: u16, connection: usize) -> anyhow::Result<Read> {
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let mut read = Read::default();
    for request in 0..REQUESTS {
        let code = CODES[(connection + request) % CODES.len()];
        let hinted = request % HINTED_EVERY == HINTED_EVERY - 1;
        let path = if hinted { "early" } else { "status" };
        let close = if request + 1 == REQUESTS {
            "Connection: close\r\n"
        } else {
            ""
        };
        writer.write_all(
            format!("GET /{path}/{code} HTTP/1.1\r\nHost: t\r\n{close}\r\n").as_bytes(),
        )?;
        let (status, interim) = read_answer(&mut reader)?;
        anyhow::ensure!(status == code, "asked for {code}, got {status}");
        anyhow::ensure!(
            interim == u64::from(hinted),
            "{interim} interim answers before {status}"
        );
        read.by_class[usize::from(status / 100 - 1)] += 1;
        read.hints += interim;
    }
    // The server closes after the last answer.
    anyhow::ensure!(
        reader.read(&mut [0; 1])? == 0,
        "open after Connection: close"
    );
    Ok(read)
}

fn responses(metrics: &Metrics, service: &str, class: &str) -> f64 {
    metrics
        .value(
            "poolscope_responses_total",
            &[("service", service), ("status_class", class)],
        )
        .unwrap_or(f64::NAN)
}

/// Whether poolscope reads answers' statuses (`[probes] response_status`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reading {
    Statuses,
    Off,
}

/// What the clients and the server did, and what poolscope counted.
struct Run {
    /// Final answers by class, as the clients read them.
    read: ByClass,
    /// What the server says it wrote.
    served: ByClass,
    /// Ours: `responses_total` for 1xx to 5xx, and unknown.
    counted: Vec<f64>,
    unknown: f64,
}

/// Runs the clients against a status server watched on `backend`; waits until
/// poolscope counts one request per final answer (an early hint and the answer
/// after it are one request, whether statuses are read or not).
fn run(backend: &str, reading: Reading) -> anyhow::Result<Run> {
    let _serial = one_at_a_time();
    let service = format!("statuses-{backend}");
    let server = StatusServer::start()?;
    let port = server.port;
    let mut config = backend_config(backend, &service, &[server.pid()]);
    if reading == Reading::Off {
        config = config.replacen("[probes]\n", "[probes]\nresponse_status = false\n", 1);
    }
    let poolscope = Poolscope::start(&config)?;
    scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", &service)]) == Some(1.0)
    })?;
    let clients: Vec<_> = (0..CONNECTIONS)
        .map(|connection| std::thread::spawn(move || ask_in_turn(port, connection)))
        .collect();
    let mut read = ByClass::default();
    let mut hints = 0;
    for client in clients {
        let by_client = client
            .join()
            .map_err(|_| anyhow::anyhow!("a client panicked"))??;
        for (sum, count) in read.iter_mut().zip(by_client.by_class) {
            *sum += count;
        }
        hints += by_client.hints;
    }
    let expected: u64 = read.iter().sum();
    let metrics = scrape_until(&poolscope, |m| {
        value(m, "poolscope_requests_total", &service) == expected as f64
            && m.connection_entries() == Some(0.0)
    })
    .with_context(|| format!("{service}: {expected} requests"))?;
    let (served, hints_sent) = server.finish()?;
    let counted: Vec<f64> = CLASSES
        .iter()
        .map(|class| responses(&metrics, &service, class))
        .collect();
    let unknown = responses(&metrics, &service, "unknown");
    println!(
        "{backend}: clients read {read:?} and {hints} early hints, the server wrote \
         {served:?} and {hints_sent}; ours {counted:?}, unknown {unknown}"
    );
    assert_eq!(read, served, "the clients' and the server's counts");
    assert_eq!(
        hints, hints_sent,
        "early hints, the clients' and the server's counts"
    );
    assert!(hints > 0, "no early hints sent");
    Ok(Run {
        read,
        served,
        counted,
        unknown,
    })
}

fn classes_counted(backend: &str) -> anyhow::Result<()> {
    let run = run(backend, Reading::Statuses)?;
    for (&ours, truth) in run.counted.iter().zip(run.served) {
        scorecard::exact(
            "responses_total by status class (1xx to 5xx; some answers after a 103 Early Hints)",
            "the server's count of the final answers it wrote, by class",
            backend,
            ours,
            truth as f64,
        );
    }
    for ((class, &ours), truth) in CLASSES.iter().zip(&run.counted).zip(run.served) {
        assert_eq!(ours, truth as f64, "{backend}: {class} answers");
    }
    assert_eq!(run.unknown, 0.0, "{backend}: answers with no status read");
    Ok(())
}

#[test]
fn every_answer_counts_under_its_status_class() -> anyhow::Result<()> {
    if !privileged("every_answer_counts_under_its_status_class") {
        return Ok(());
    }
    for backend in backends() {
        classes_counted(backend)?;
    }
    Ok(())
}

/// `response_status = false`: no answer's first bytes are read, so every request
/// counts `unknown`. An early hint and its answer are one burst of writes, so they
/// still end one request (only an interim answer that the client answers, `100
/// Continue`, splits its request when statuses are not read).
#[test]
fn statuses_turned_off_count_every_request_unknown() -> anyhow::Result<()> {
    if !privileged("statuses_turned_off_count_every_request_unknown") {
        return Ok(());
    }
    for backend in backends() {
        let run = run(backend, Reading::Off)?;
        let total = run.read.iter().sum::<u64>();
        assert_eq!(run.unknown, total as f64, "{backend}: unknown");
        assert!(
            run.counted.iter().all(|&count| count == 0.0),
            "{backend}: {:?} by class with statuses off",
            run.counted
        );
    }
    Ok(())
}
