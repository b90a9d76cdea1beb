//! Interim responses (RFC 9110 §15.2): an upload sent with `Expect: 100-continue` is
//! answered `100 Continue` before its body is read, and stays one request (the
//! interim answer does not end it), on every backend. Truth: the server's own count
//! and service times (`tests/http1/continue_server.py`, Python's http.server), and
//! the clients' count of final answers (our own keep-alive clients, then curl).
use std::{
    io::{BufReader, Write as _},
    net::TcpStream,
    path::PathBuf,
    time::Duration,
};

use anyhow::Context as _;
use poolscope_tests::{
    Poolscope, Program, backend_config, backends, emulation_allowance,
    http1::read_head,
    one_at_a_time, privileged, scorecard, scrape_until,
    steady::{assert_within_plus, value},
};

/// Keep-alive connections, each making [`UPLOADS`] uploads of [`BODY`] bytes in turn.
const CONNECTIONS: usize = 4;
const UPLOADS: usize = 50;
const BODY: usize = 4096;
/// The server's wait between reading a body and answering.
const SERVICE_MS: u64 = 5;
/// curl's uploads: on one connection, each [`CURL_BODY`] bytes.
const CURL_UPLOADS: usize = 3;
const CURL_BODY: usize = 2 << 20;

/// `continue_server.py`, which counts and times what it serves.
struct ContinueServer {
    program: Program,
    port: u16,
}

/// What the server did: `100 Continue` answers, final answers and their mean time.
struct Served {
    interim: u64,
    count: u64,
    mean: Duration,
}

impl ContinueServer {
    fn start() -> anyhow::Result<Self> {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("http1/continue_server.py");
        let mut program = Program::start_path(
            std::path::Path::new(poolscope_tests::http2::PYTHON),
            &[script.display().to_string(), SERVICE_MS.to_string()],
        )?;
        let port = program
            .line("port")?
            .parse()
            .context("the continue server's port")?;
        Ok(Self { program, port })
    }

    /// What it served so far.
    fn report(&mut self) -> anyhow::Result<Served> {
        self.program.send("report")?;
        let interim = self.program.line("interim")?;
        self.served(&interim)
    }

    /// Stops it; what it served.
    fn finish(mut self) -> anyhow::Result<Served> {
        let interim = self.program.finish("interim")?;
        self.served(&interim)
    }

    /// The report whose `interim` line said `interim`.
    fn served(&mut self, interim: &str) -> anyhow::Result<Served> {
        let served = self.program.line("served")?;
        let mut fields = served.split_whitespace().map(str::parse::<u64>);
        let (Some(Ok(count)), Some(Ok(mean))) = (fields.next(), fields.next()) else {
            anyhow::bail!("the continue server said \"served {served}\"");
        };
        Ok(Served {
            interim: interim
                .parse()
                .context("the continue server's interim count")?,
            count,
            mean: Duration::from_nanos(mean),
        })
    }
}

/// One connection's uploads, each sent as a client that honours `Expect` does: the
/// head, then the body only after `100 Continue`. The final answers it read.
fn upload_in_turn(port: u16) -> anyhow::Result<u64> {
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = stream;
    let body = vec![b'x'; BODY];
    for upload in 0..UPLOADS {
        // One write: a head in pieces would wait on Nagle for the server's delayed
        // acknowledgement, inside the request as poolscope and the server see it.
        let head = format!(
            "PUT /upload/{upload} HTTP/1.1\r\nHost: test\r\nContent-Length: {BODY}\r\n\
             Expect: 100-continue\r\n\r\n"
        );
        writer.write_all(head.as_bytes())?;
        let (interim, _) = read_head(&mut reader)?;
        anyhow::ensure!(interim == 100, "got {interim} for 100");
        writer.write_all(&body)?;
        // The final answer has no body.
        let (last, _) = read_head(&mut reader)?;
        anyhow::ensure!(last == 200, "got {last} for 200");
    }
    Ok(UPLOADS as u64)
}

/// `CURL_UPLOADS` uploads of a file by one curl, on one connection; the answers it
/// counted.
fn curl_uploads(port: u16) -> anyhow::Result<u64> {
    let file = std::env::temp_dir().join(format!("poolscope-upload-{}", std::process::id()));
    std::fs::write(&file, vec![b'y'; CURL_BODY])?;
    let mut args = vec![
        "--silent".to_owned(),
        "--show-error".to_owned(),
        "--header".to_owned(),
        "Expect: 100-continue".to_owned(),
        "--write-out".to_owned(),
        "%{http_code} %{num_connects}\\n".to_owned(),
    ];
    for upload in 0..CURL_UPLOADS {
        args.extend([
            "--upload-file".to_owned(),
            file.display().to_string(),
            format!("http://127.0.0.1:{port}/curl/{upload}"),
        ]);
    }
    let output = std::process::Command::new("curl").args(&args).output();
    let _ = std::fs::remove_file(&file);
    let output = output.context("running curl")?;
    let text = String::from_utf8_lossy(&output.stdout);
    anyhow::ensure!(output.status.success(), "curl: {text} {output:?}");
    let answers: Vec<&str> = text.lines().collect();
    // One connection: the first answer says 1 connect, the others 0.
    anyhow::ensure!(
        answers.len() == CURL_UPLOADS
            && answers.iter().all(|line| line.starts_with("200 "))
            && answers.iter().skip(1).all(|line| line.ends_with(" 0")),
        "curl's answers: {answers:?}"
    );
    Ok(answers.len() as u64)
}

fn uploads_count_once(backend: &str) -> anyhow::Result<()> {
    let _serial = one_at_a_time();
    let service = format!("continue-{backend}");
    let mut server = ContinueServer::start()?;
    let poolscope = Poolscope::start(&backend_config(backend, &service, &[server.program.pid()]))?;
    scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", &service)]) == Some(1.0)
    })?;
    let port = server.port;
    let clients: Vec<_> = (0..CONNECTIONS)
        .map(|_| std::thread::spawn(move || upload_in_turn(port)))
        .collect();
    let mut made = 0;
    for client in clients {
        made += client
            .join()
            .map_err(|_| anyhow::anyhow!("a client panicked"))??;
    }
    let requests =
        |metrics: &poolscope_tests::Metrics| value(metrics, "poolscope_requests_total", &service);
    let after_clients = scrape_until(&poolscope, |m| {
        requests(m) == made as f64 && m.connection_entries() == Some(0.0)
    })
    .with_context(|| format!("{service}: {made} uploads answered"))?;
    let duration = |family: &str| value(&after_clients, family, &service);
    let mean = duration("poolscope_request_duration_seconds_sum")
        / duration("poolscope_request_duration_seconds_count");
    let by_clients = server.report()?;

    let by_curl = curl_uploads(port)?;
    let after_curl = scrape_until(&poolscope, |m| {
        requests(m) == (made + by_curl) as f64 && m.connection_entries() == Some(0.0)
    })
    .with_context(|| format!("{service}: {by_curl} more uploads by curl"))?;
    let served = server.finish()?;

    println!(
        "{backend}: {made} uploads, then {by_curl} by curl; server: {} and {} interim \
         answers, {} and {} served, mean {:?} of the first; ours: {} and {} requests, \
         mean {mean:.6} s",
        by_clients.interim,
        served.interim,
        by_clients.count,
        served.count,
        by_clients.mean,
        requests(&after_clients),
        requests(&after_curl),
    );
    scorecard::exact(
        "requests_total, Expect: 100-continue uploads",
        "the server's count of final answers (each after a 100 Continue)",
        backend,
        requests(&after_curl),
        served.count as f64,
    );
    assert_eq!(by_clients.count, made, "the server's count");
    assert_eq!(served.count, made + by_curl, "the server's count");
    assert_eq!(served.interim, served.count, "100 Continue answers");
    assert_eq!(requests(&after_curl), served.count as f64, "requests_total");
    // Each counts under its final answer's class, none under the interim one's.
    for (class, truth) in [("2xx", served.count), ("1xx", 0), ("unknown", 0)] {
        let counted = after_curl.value(
            "poolscope_responses_total",
            &[("service", &service), ("status_class", class)],
        );
        assert_eq!(counted, Some(truth as f64), "{backend}: {class} answers");
    }
    for gauge in [
        "poolscope_requests_in_flight",
        "poolscope_requests_waiting",
        "poolscope_connections_unserved",
        "poolscope_queue_depth",
    ] {
        assert_eq!(value(&after_curl, gauge, &service), 0.0, "{gauge} after");
    }
    // One request from its head's read to its final answer: the body's upload after
    // `100 Continue` is in it. Ended at the interim answer, the mean would be half.
    let truth = by_clients.mean.as_secs_f64();
    let allowance = emulation_allowance().as_secs_f64();
    scorecard::within_plus(
        "mean request duration, Expect: 100-continue uploads",
        "the server's own mean, head read to final answer",
        backend,
        mean,
        truth,
        0.05,
        allowance,
    );
    assert_within_plus(
        &format!("{backend}: mean duration of an upload"),
        mean,
        truth,
        0.05,
        allowance,
    );
    Ok(())
}

#[test]
fn expect_continue_uploads_count_once() -> anyhow::Result<()> {
    if !privileged("expect_continue_uploads_count_once") {
        return Ok(());
    }
    for backend in backends() {
        uploads_count_once(backend)?;
    }
    Ok(())
}
