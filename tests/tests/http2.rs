//! Cleartext HTTP/2 (h2c, prior knowledge). poolscope follows a connection that starts
//! with the client preface frame by frame: one request per stream the client opened
//! with HEADERS and the server ended with END_STREAM (`requests_total`, a duration
//! each), open streams in `requests_in_flight`; a stream ended by RST_STREAM (either
//! side) or by the connection's close before the server's END_STREAM counts in
//! `http2_streams_reset_total` instead; a connection whose frames cannot be followed
//! counts in `events_lost_total{source="http2_…"}` and no request after. Each test
//! compares poolscope's numbers with the other side's own count:
//! - nginx (`Kind::NginxH2c`) under `h2load -c 4 -m M`, M = 1, 10, 100: every stream
//!   counted exactly, none in flight after, no reset, 4 connections;
//! - a gRPC server (grpcio, a pool of W workers, unary calls of S ms) under a closed
//!   loop of C calls on one channel, below (C ≤ W) and past (C > W) saturation: calls
//!   counted exactly, and the mean in flight by Little's law from the client's
//!   timings against poolscope's gauge; server-streaming calls, one request each
//!   whatever their messages;
//! - resets: aborted gRPC calls (trailers-only responses: requests, not resets), calls
//!   the client cancels with RST_STREAM, calls open when the client closes, and
//!   nginx resetting streams itself (`return 444`);
//! - hostile input to nginx and to the plain server below: garbage after the
//!   preface, a frame announcing 16 MB, a request one byte per send, a request cut
//!   inside its HEADERS frame header at each offset: never more requests than the
//!   server answered, and each valid request counted exactly unless an `http2_*` loss
//!   says its connection was given up;
//! - HTTP/1.1 and h2c in one service; an h2c connection older than poolscope;
//! - a plain server of the standard library (a thread per stream), which also runs in
//!   the test guests: streams, in flight and durations against its own count; its
//!   stream limit, a client's close under open streams, a connection older than
//!   poolscope, the `Upgrade: h2c` path, the hostile input.
//!
//! The socket backend follows HTTP/2, and the tcp backend where fexit attaches
//! ([`http2_capable`]). The tables go to stderr (`--nocapture`).
use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use poolscope_tests::{
    Metrics, Poolscope, backend_config, backends, free_port,
    http2::{
        Amount, GrpcClient, GrpcServer, Hostile, NodeH2Server, OldConnection, PlainConnection,
        PlainH2Server, RawResult, UpgradeServer, curl_upgrade, h2load, h2load_grpc, h2load_h1,
        h2load_paths, h2raw, plain_streams,
    },
    one_at_a_time, privileged, scorecard, scrape_until,
    servers::{Kind, RealServer, pin_to_first_cpu},
    skip, tcp_follows_http2,
};

/// The request backends that follow HTTP/2 frame by frame: the socket backend, and the
/// tcp backend where the kernel lets its fexit programs attach (`tcp_h2.rs`,
/// [`tcp_follows_http2`]). The syscall backend is one line away.
fn http2_capable() -> Vec<&'static str> {
    let mut capable = vec!["socket"];
    if tcp_follows_http2() {
        capable.push("tcp");
    }
    capable
}
/// How far a mean duration may be from a server's own, relative.
const DURATION_BOUND: f64 = 0.02;

const REQUESTS: &str = "poolscope_requests_total";
const IN_FLIGHT: &str = "poolscope_requests_in_flight";
const RESETS: &str = "poolscope_http2_streams_reset_total";
const CONNECTIONS: &str = "poolscope_http2_connections_total";
const LOST: &str = "poolscope_events_lost_total";
const AT_LIMIT: &str = "poolscope_http2_connections_at_stream_limit";
const DURATION_SUM: &str = "poolscope_request_duration_seconds_sum";
const DURATION_COUNT: &str = "poolscope_request_duration_seconds_count";

/// [`http2_capable`] backends this kernel has (the socket backend needs Linux 6.3), for
/// `test`; none is a skip of `test` (a failure under CI=true), never a pass.
fn http2_backends(test: &str) -> Vec<&'static str> {
    let available = backends();
    let capable = http2_capable();
    let chosen: Vec<&'static str> = capable
        .iter()
        .copied()
        .filter(|backend| available.contains(backend))
        .collect();
    if chosen.is_empty() {
        skip(
            test,
            &format!("no backend here follows HTTP/2 ({capable:?} do; {available:?} tested here)"),
        );
    }
    chosen
}

/// A service's counters and gauge in one scrape (0 where a series is absent).
#[derive(Clone, Debug, Default, PartialEq)]
struct Counts {
    requests: f64,
    in_flight: f64,
    resets: f64,
    connections: f64,
    duration_sum: f64,
    duration_count: f64,
    /// `events_lost_total` of each `http2_*` source.
    losses: BTreeMap<String, f64>,
}

impl Counts {
    fn of(metrics: &Metrics, service: &str) -> Self {
        let value = |name| metrics.value(name, &[("service", service)]).unwrap_or(0.0);
        let losses = metrics
            .samples
            .iter()
            .filter(|sample| sample.name == LOST)
            .filter_map(|sample| {
                let (_, source) = sample.labels.iter().find(|(key, _)| key == "source")?;
                source
                    .starts_with("http2_")
                    .then(|| (source.clone(), sample.value))
            })
            .collect();
        Self {
            requests: value(REQUESTS),
            in_flight: value(IN_FLIGHT),
            resets: value(RESETS),
            connections: value(CONNECTIONS),
            duration_sum: value(DURATION_SUM),
            duration_count: value(DURATION_COUNT),
            losses,
        }
    }

    fn scrape(poolscope: &Poolscope, service: &str) -> anyhow::Result<Self> {
        Ok(Self::of(&poolscope.scrape()?, service))
    }

    /// What rose since `before`, and the gauge now.
    fn since(&self, before: &Self) -> Delta {
        let losses = self
            .losses
            .iter()
            .filter_map(|(source, now)| {
                let rose = now - before.losses.get(source).copied().unwrap_or(0.0);
                (rose != 0.0).then(|| (source.clone(), rose))
            })
            .collect();
        Delta {
            requests: self.requests - before.requests,
            in_flight: self.in_flight,
            resets: self.resets - before.resets,
            connections: self.connections - before.connections,
            duration_sum: self.duration_sum - before.duration_sum,
            duration_count: self.duration_count - before.duration_count,
            losses,
        }
    }
}

/// Counters' rises between two scrapes; `in_flight` is the later scrape's gauge.
#[derive(Clone, Debug, Default)]
struct Delta {
    requests: f64,
    in_flight: f64,
    resets: f64,
    connections: f64,
    duration_sum: f64,
    duration_count: f64,
    losses: BTreeMap<String, f64>,
}

impl Delta {
    /// Connections given up (all `http2_*` sources).
    fn lost(&self) -> f64 {
        self.losses.values().sum()
    }

    /// `source +n, …`, or `-`.
    fn lost_sources(&self) -> String {
        if self.losses.is_empty() {
            return "-".to_owned();
        }
        let sources: Vec<String> = self
            .losses
            .iter()
            .map(|(source, rose)| format!("{source} +{rose}"))
            .collect();
        sources.join(", ")
    }

    /// The mean request duration, seconds (NaN without requests).
    fn mean_duration(&self) -> f64 {
        self.duration_sum / self.duration_count
    }
}

/// Starts poolscope on `backend` watching `pids` as `service`, and waits until it does.
fn watch(backend: &str, service: &str, pids: &[u32]) -> anyhow::Result<Poolscope> {
    watch_with(backend, service, pids, "")
}

/// [`watch`] with more keys for the service's `[[targets]]` entry.
fn watch_with(
    backend: &str,
    service: &str,
    pids: &[u32],
    target_keys: &str,
) -> anyhow::Result<Poolscope> {
    let config = format!("{}{target_keys}", backend_config(backend, service, pids));
    let poolscope = Poolscope::start(&config)?;
    scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", service)]) == Some(pids.len() as f64)
            && m.has_label("backend", backend)
    })?;
    Ok(poolscope)
}

/// Scrapes until `service` has settled after a load that ended: nothing in flight,
/// `enough` of what was done counted since `before`, and the counters the same as in
/// the previous scrape, so that a count that rises late (at a connection's close)
/// shows. Fails after 10 s with the last scrape.
fn settle(
    poolscope: &Poolscope,
    service: &str,
    before: &Counts,
    mut enough: impl FnMut(&Delta) -> bool,
) -> anyhow::Result<Delta> {
    let mut previous: Option<Counts> = None;
    let metrics = scrape_until(poolscope, |m| {
        let now = Counts::of(m, service);
        let delta = now.since(before);
        let stable = previous.as_ref() == Some(&now);
        previous = Some(now);
        stable && delta.in_flight == 0.0 && enough(&delta)
    })?;
    Ok(Counts::of(&metrics, service).since(before))
}

/// [`settle`] once `requests` requests and `resets` resets are counted, or a loss
/// says some will not be (the comparison that follows then fails, naming it).
fn settle_on(
    poolscope: &Poolscope,
    service: &str,
    before: &Counts,
    requests: u64,
    resets: u64,
) -> anyhow::Result<Delta> {
    settle(poolscope, service, before, |delta| {
        (delta.requests >= requests as f64 && delta.resets >= resets as f64) || delta.lost() > 0.0
    })
}

/// Compares the deltas of a load with its truth; each mismatch is a line of
/// `failures`, prefixed with `what`.
struct Expect<'a> {
    what: &'a str,
    requests: u64,
    resets: u64,
    /// HTTP/2 connections made, when the test knows how many.
    connections: Option<u64>,
}

impl Expect<'_> {
    fn check(&self, delta: &Delta, failures: &mut Vec<String>) {
        let what = self.what;
        if delta.requests != self.requests as f64 {
            failures.push(format!(
                "{what}: requests_total +{}, truth {}",
                delta.requests, self.requests
            ));
        }
        if delta.resets != self.resets as f64 {
            failures.push(format!(
                "{what}: http2_streams_reset_total +{}, truth {}",
                delta.resets, self.resets
            ));
        }
        if let Some(connections) = self.connections
            && delta.connections != connections as f64
        {
            failures.push(format!(
                "{what}: http2_connections_total +{}, truth {connections}",
                delta.connections
            ));
        }
        if delta.in_flight != 0.0 {
            failures.push(format!(
                "{what}: requests_in_flight {} once the load stopped",
                delta.in_flight
            ));
        }
        if delta.lost() != 0.0 {
            failures.push(format!(
                "{what}: connections given up: {}",
                delta.lost_sources()
            ));
        }
    }
}

fn ensure_none(test: &str, failures: &[String]) -> anyhow::Result<()> {
    anyhow::ensure!(failures.is_empty(), "{test}:\n  {}", failures.join("\n  "));
    Ok(())
}

const H2LOAD_CLIENTS: u32 = 4;
/// h2load's `-n` (requests) and `-m` (streams in flight per connection) of each run.
const H2LOAD_RUNS: &[(u64, u32)] = &[(4000, 1), (20_000, 10), (20_000, 100)];

/// nginx serving h2c under h2load with 1, 10 and 100 streams in flight on each of 4
/// connections: every stream h2load saw succeed is counted, exactly. The mean
/// durations are reported, not asserted: h2load's time for a request runs from its
/// HEADERS queued to its last byte read, ours from the server's read of the HEADERS
/// to its write of END_STREAM, and with 100 streams per connection h2load's includes
/// the wait behind the other 99.
#[test]
fn nginx_h2load_counts_every_stream() -> anyhow::Result<()> {
    if !privileged("nginx_h2load_counts_every_stream") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    let mut table = vec![
        "| backend | -m | h2load succeeded | requests_total | resets | connections | lost | \
         h2load mean | poolscope mean |"
            .to_owned(),
    ];
    for backend in http2_backends("nginx_h2load_counts_every_stream") {
        let server = RealServer::start(Kind::NginxH2c, free_port()?)?;
        let service = format!("nginx-h2c-{backend}");
        let pids = server.pids();
        let poolscope = watch(backend, &service, &pids)?;
        pin_to_first_cpu(&pids)?;
        for &(requests, streams) in H2LOAD_RUNS {
            let before = Counts::scrape(&poolscope, &service)?;
            let load = h2load(server.port(), "/", requests, H2LOAD_CLIENTS, streams)?;
            anyhow::ensure!(
                load.protocol == "h2c" && load.succeeded == requests && load.status_2xx == requests,
                "h2load -n{requests} -m{streams} did not succeed in full: {load:?}"
            );
            let delta = settle_on(&poolscope, &service, &before, load.succeeded, 0)?;
            table.push(format!(
                "| {backend} | {streams} | {} | {} | {} | {} | {} | {:.0} µs | {:.0} µs |",
                load.succeeded,
                delta.requests,
                delta.resets,
                delta.connections,
                delta.lost_sources(),
                load.mean_request.as_secs_f64() * 1e6,
                delta.mean_duration() * 1e6,
            ));
            Expect {
                what: &format!("{backend}, h2load -m{streams}"),
                requests: load.succeeded,
                resets: 0,
                connections: Some(u64::from(H2LOAD_CLIENTS)),
            }
            .check(&delta, &mut failures);
            if delta.requests == load.succeeded as f64 {
                scorecard::exact(
                    "requests_total, HTTP/2 streams (nginx h2c, 1 to 100 streams in flight)",
                    "h2load's count of succeeded requests",
                    backend,
                    delta.requests,
                    load.succeeded as f64,
                );
            }
        }
    }
    eprintln!("{}", table.join("\n"));
    ensure_none("nginx under h2load", &failures)
}

/// A closed loop of gRPC calls against a pool.
struct GrpcRun {
    name: &'static str,
    /// The Python server's pool of workers; 0: the Go server, a goroutine per call.
    workers: u32,
    concurrency: u32,
    sleep_ms: u64,
    seconds: u64,
    /// The service's `http2_worker_threads`; `None`: not configured.
    configured: Option<bool>,
    /// `model/source` of its `http2_stream_model`.
    model: &'static str,
}

const GRPC_RUNS: &[GrpcRun] = &[
    GrpcRun {
        name: "below saturation",
        workers: 8,
        concurrency: 4,
        sleep_ms: 20,
        seconds: 4,
        configured: None,
        model: "workers/detected",
    },
    GrpcRun {
        name: "past saturation",
        workers: 4,
        concurrency: 16,
        sleep_ms: 20,
        seconds: 4,
        configured: None,
        model: "workers/detected",
    },
    GrpcRun {
        name: "Go, a goroutine per call",
        workers: 0,
        concurrency: 16,
        sleep_ms: 20,
        seconds: 4,
        configured: None,
        model: "every_stream/detected",
    },
    // The rule wins over what is detected: its streams count as served at once.
    GrpcRun {
        name: "past saturation, http2_worker_threads = false",
        workers: 4,
        concurrency: 16,
        sleep_ms: 20,
        seconds: 4,
        configured: Some(false),
        model: "every_stream/configured",
    },
];

/// Calls waiting for a worker, as sampled, against the closed form: a sample can see
/// one of grpcio's own threads (its poller, its executor) running for a moment, which
/// counts as a busy thread, and a worker between two calls.
const WAITING_TOLERANCE: f64 = 1.0;

fn mean(samples: &[f64]) -> f64 {
    samples.iter().sum::<f64>() / samples.len() as f64
}

fn median(samples: &[f64]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The client's calls have all started by then (its first burst takes a few ms).
const RAMP_UP: Duration = Duration::from_millis(300);
const IN_FLIGHT_SAMPLES: u32 = 15;
const SAMPLE_EVERY: Duration = Duration::from_millis(150);

/// The median of poolscope's in-flight gauge against Little's law on the client's
/// own timings (the sum of its calls' latencies over the run's elapsed time), within
/// 15 %. The median, not the mean: in CI runs a few samples in a row read far below
/// C (0 of 4, 0 or 4 of 16), mostly with nothing unread in the socket, so calls the
/// client counted in flight while the server held none (a stall of the client between
/// an answer and its next call would do it; not shown), and the mean of 15 samples
/// moved by up to −28 % while the counts stayed exact. The median reads C through a
/// minority of such samples and still fails a gauge that is off in most of them.
/// The tolerance covers:
/// - a stream is open at the server (HEADERS read to END_STREAM written) for a part
///   of its call as the client times it, which adds the client's own work before the
///   HEADERS leave and after the END_STREAM arrives: measured by hand, calls of 20 ms
///   took 21.4 ms on average at C = 4 (2 vCPUs, Python on both sides), so the server's
///   count is up to ~7 % lower;
/// - 15 samples of a gauge that a closed loop keeps at C but for the short gaps
///   between a call's end and the next one's start (C or C − 1 here);
/// - the client's mean covers its ramp-up and drain too, one call's latency (≤ 80 ms)
///   out of 4 s: ≤ 2 %.
const LITTLE_TOLERANCE: f64 = 0.15;

/// A gRPC server (Python, a pool of W workers) under a closed loop of C calls on one
/// channel, below (C = 4 ≤ W = 8) and past (C = 16 > W = 4: 12 calls wait for a
/// worker, their streams open) saturation, and grpc-go (a goroutine per call), with
/// nothing configured: requests counted exactly, the mean in flight as Little's law
/// on the client's timings has it, the model each is read as, and the calls waiting
/// for a worker as the server counts them in its executor's queue at each sample
/// (grpc-go: none). With `http2_worker_threads = false` the saturated pool counts
/// none waiting: the rule wins.
#[test]
fn grpc_unary_calls_and_littles_law() -> anyhow::Result<()> {
    if !privileged("grpc_unary_calls_and_littles_law") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    let mut table = vec![
        "| backend | run | W | C | completed | requests_total | in flight: client (Little) | \
         poolscope (samples) | error |"
            .to_owned(),
    ];
    let mut waiting_table = vec![
        "| backend | run | W | C | model | answered by stream workers | waiting: server's \
         queue | closed form | requests_waiting | queue_depth |"
            .to_owned(),
    ];
    for backend in http2_backends("grpc_unary_calls_and_littles_law") {
        for run in GRPC_RUNS {
            let what = format!("{backend}, {}", run.name);
            // grpcio hands each stream to a worker of its ThreadPoolExecutor; grpc-go
            // serves every stream at once, on goroutines.
            let mut server = match run.workers {
                0 => GrpcServer::start_go()?,
                workers => GrpcServer::start(workers)?,
            };
            let keys = run
                .configured
                .map(|on| format!("http2_worker_threads = {on}\n"))
                .unwrap_or_default();
            let service = format!("grpc-{backend}");
            let poolscope = watch_with(backend, &service, &[server.pid()], &keys)?;
            let before = Counts::scrape(&poolscope, &service)?;
            let client = GrpcClient::start(
                server.port,
                "Sleep",
                run.sleep_ms,
                run.concurrency,
                Amount::Seconds(run.seconds),
            )?;
            // Pacing the samples inside the run, not waiting for a condition.
            std::thread::sleep(RAMP_UP);
            let mut samples = Vec::new();
            let mut waiting = Vec::new();
            let mut depths = Vec::new();
            let mut queued = Vec::new();
            let mut models = Vec::new();
            for _ in 0..IN_FLIGHT_SAMPLES {
                let started = Instant::now();
                let metrics = poolscope.scrape()?;
                // The server's own count right after: the Go server has no queue.
                queued.push(match run.workers {
                    0 => 0.0,
                    _ => server.queued()?,
                });
                let gauge = |name| metrics.value(name, &[("service", &service)]);
                samples.push(Counts::of(&metrics, &service).in_flight);
                waiting.push(gauge("poolscope_requests_waiting").unwrap_or(f64::NAN));
                depths.push(gauge("poolscope_queue_depth").unwrap_or(f64::NAN));
                models.push(stream_model(&metrics, &service));
                std::thread::sleep(SAMPLE_EVERY.saturating_sub(started.elapsed()));
            }
            let result = client.finish()?;
            anyhow::ensure!(
                result.failed == 0 && result.completed == result.ok && result.completed > 0,
                "{what}: the gRPC client's calls failed: {result:?}"
            );
            let split = answered_by_workers(&poolscope.scrape()?, &service);
            let delta = settle_on(&poolscope, &service, &before, result.completed, 0)?;
            let sampled = median(&samples);
            let little = result.mean_in_flight();
            // The server's count of calls in its executor's queue, but where the rule
            // says every stream is served at once; the closed form (the pool serves
            // min(in flight, W) calls, the rest wait) for comparison.
            let truth_waiting = match run.configured {
                Some(false) => 0.0,
                _ => mean(&queued),
            };
            let closed_form = match run.workers {
                0 => 0.0,
                workers => (little - f64::from(workers)).max(0.0),
            };
            let (waiting, depth) = (mean(&waiting), mean(&depths));
            waiting_table.push(format!(
                "| {backend} | {} | {} | {} | {:?} | {split} | {truth_waiting:.2} | \
                 {closed_form:.2} | {waiting:.2} | {depth:.2} |",
                run.name, run.workers, run.concurrency, models[0]
            ));
            if models.iter().any(|model| model != run.model) {
                failures.push(format!(
                    "{what}: read as {models:?}, not {} at every sample",
                    run.model
                ));
            }
            if (waiting - truth_waiting).abs().is_nan()
                || (waiting - truth_waiting).abs() > WAITING_TOLERANCE
                || (depth - waiting).abs() > WAITING_TOLERANCE
            {
                failures.push(format!(
                    "{what}: requests_waiting {waiting:.2}, queue_depth {depth:.2} (sampled) vs \
                     {truth_waiting:.2} calls waiting for one of {} workers (the server's \
                     executor queue {queued:?}), beyond ±{WAITING_TOLERANCE}",
                    run.workers
                ));
            } else if run.configured.is_none() {
                scorecard::difference(
                    "requests_waiting, gRPC calls waiting for a worker, nothing configured (mean of 15 scrapes)",
                    "the server's own count of calls in its executor's queue at each scrape",
                    backend,
                    (waiting, truth_waiting),
                    WAITING_TOLERANCE,
                    "calls",
                );
            }
            let error = (sampled - little) / little;
            table.push(format!(
                "| {backend} | {} | {} | {} | {} | {} | {little:.2} | {sampled:.2} {samples:?} | \
                 {:+.1} % |",
                run.name,
                run.workers,
                run.concurrency,
                result.completed,
                delta.requests,
                error * 100.0
            ));
            Expect {
                what: &what,
                requests: result.completed,
                resets: 0,
                connections: Some(1),
            }
            .check(&delta, &mut failures);
            if delta.requests == result.completed as f64 {
                scorecard::exact(
                    "requests_total, gRPC unary calls",
                    "the gRPC client's count of completed calls",
                    backend,
                    delta.requests,
                    result.completed as f64,
                );
            }
            if error.abs().is_nan() || error.abs() > LITTLE_TOLERANCE {
                failures.push(format!(
                    "{what}: median in flight {sampled:.2} (sampled) vs {little:.2} \
                     (Little's law, client): {:+.1} %, beyond {:.0} %",
                    error * 100.0,
                    LITTLE_TOLERANCE * 100.0
                ));
            } else {
                scorecard::within(
                    "requests_in_flight, gRPC unary calls (median of 15 scrapes)",
                    "Little's law on the client's own timings",
                    backend,
                    sampled,
                    little,
                    LITTLE_TOLERANCE,
                );
            }
            let served = server.finish()?;
            anyhow::ensure!(
                served.sleep == result.completed,
                "{what}: the server ran {} calls, the client completed {}",
                served.sleep,
                result.completed
            );
        }
    }
    eprintln!("{}", table.join("\n"));
    eprintln!("{}", waiting_table.join("\n"));
    ensure_none("gRPC unary calls", &failures)
}

/// Calls h2load makes to grpc-go in
/// [`grpc_go_streams_opened_and_ended_on_two_cpus`], 4 connections of 32 streams in
/// flight, against a limit of 16 the server announces.
const TWO_CPU_CALLS: u64 = 1_000_000;
const TWO_CPU_CLIENTS: u32 = 4;
const TWO_CPU_STREAMS: u32 = 32;
const TWO_CPU_LIMIT: u32 = 16;
/// Streams not followed because the one 256 ids before them was still open
/// (`http2_stream_slots`), out of every 1000: a call whose goroutine waits for a CPU
/// while 128 newer calls of its connection come and go, so how many depends on the
/// host's load. Measured 0–8 in 400,000 calls (2 vCPUs, h2load on one, the server on
/// both), 43 in 200,000 with tracing slowing the programs; bounded at 1 in 1000.
const TWO_CPU_SLOT_LOSSES_PER_1000: f64 = 1.0;

/// grpc-go reads a connection on one goroutine and writes it on another, so the
/// kernel opens streams on one CPU while it ends others on another: a count they
/// both change would lose updates (a stream left open at the close read as reset,
/// an at-limit gauge that drifts). Calls of 0 ms under h2load, each connection at
/// the server's limit and leaving it at nearly every stream: every call counted (or
/// counted lost, 1 in 1000 at most), the calls the server refused (and no other)
/// counted reset, nothing in flight or at the limit once the connections closed (a
/// count that lost an update stays off after the close). The at-limit gauge while
/// loaded is printed, not checked: a scrape sums per-CPU counters one CPU after the
/// other, so a connection that leaves the limit and reaches it again across the
/// copy reads one high for that scrape.
#[test]
fn grpc_go_streams_opened_and_ended_on_two_cpus() -> anyhow::Result<()> {
    if !privileged("grpc_go_streams_opened_and_ended_on_two_cpus") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in http2_backends("grpc_go_streams_opened_and_ended_on_two_cpus") {
        let what = format!("{backend}, grpc-go under h2load");
        let server = GrpcServer::start_go_with_stream_limit(TWO_CPU_LIMIT)?;
        let service = format!("grpc-two-cpus-{backend}");
        let poolscope = watch(backend, &service, &[server.pid()])?;
        let before = Counts::scrape(&poolscope, &service)?;
        let port = server.port;
        let load = std::thread::spawn(move || {
            h2load_grpc(
                port,
                "/poolscope.Test/Sleep",
                b"0",
                TWO_CPU_CALLS,
                TWO_CPU_CLIENTS,
                TWO_CPU_STREAMS,
            )
        });
        let mut at_limit = Vec::new();
        while !load.is_finished() {
            let metrics = poolscope.scrape()?;
            at_limit.push(
                metrics
                    .value(AT_LIMIT, &[("service", &service)])
                    .unwrap_or(0.0),
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let load = load
            .join()
            .map_err(|_| anyhow::anyhow!("{what}: the h2load thread panicked"))??;
        // The streams a client opens before the server's SETTINGS arrive may pass its
        // limit: the server refuses them (RST_STREAM), h2load counts them errored.
        anyhow::ensure!(
            load.done == TWO_CPU_CALLS
                && load.status_2xx == load.succeeded
                && load.failed == load.errored
                && load.failed < u64::from(TWO_CPU_CLIENTS * TWO_CPU_STREAMS),
            "{what}: h2load's calls did not all end, or not as refused streams: {load:?}"
        );
        let slots = |delta: &Delta| delta.losses.get("http2_stream_slots").copied();
        let delta = settle(&poolscope, &service, &before, |delta| {
            delta.requests + slots(delta).unwrap_or(0.0) >= load.succeeded as f64
                && delta.resets >= load.failed as f64
        })?;
        let lost = slots(&delta).unwrap_or(0.0);
        eprintln!(
            "{what}: {} calls succeeded, {} refused; requests_total +{}, lost {}, resets +{}, \
             at-limit gauge while loaded {:?}",
            load.succeeded,
            load.failed,
            delta.requests,
            delta.lost_sources(),
            delta.resets,
            at_limit
        );
        if delta.requests + lost != load.succeeded as f64 || delta.lost() != lost {
            failures.push(format!(
                "{what}: requests_total +{} and lost {}, truth {} calls",
                delta.requests,
                delta.lost_sources(),
                load.succeeded
            ));
        } else {
            scorecard::exact(
                "requests_total + http2_stream_slots losses, grpc-go on two CPUs",
                "h2load's count of succeeded calls",
                backend,
                delta.requests + lost,
                load.succeeded as f64,
            );
        }
        if lost > TWO_CPU_CALLS as f64 * TWO_CPU_SLOT_LOSSES_PER_1000 / 1000.0 {
            failures.push(format!(
                "{what}: {lost} calls not followed (http2_stream_slots), beyond \
                 {TWO_CPU_SLOT_LOSSES_PER_1000} in 1000"
            ));
        }
        if delta.resets != load.failed as f64 {
            failures.push(format!(
                "{what}: http2_streams_reset_total +{}, truth {} (h2load's refused calls)",
                delta.resets, load.failed
            ));
        } else {
            scorecard::exact(
                "http2_streams_reset_total, grpc-go on two CPUs",
                "h2load's count of calls the server refused",
                backend,
                delta.resets,
                load.failed as f64,
            );
        }
        if delta.connections != f64::from(TWO_CPU_CLIENTS) {
            failures.push(format!(
                "{what}: http2_connections_total +{}, truth {TWO_CPU_CLIENTS}",
                delta.connections
            ));
        }
        let limit_after = poolscope
            .scrape()?
            .value(AT_LIMIT, &[("service", &service)])
            .unwrap_or(0.0);
        if limit_after != 0.0 {
            failures.push(format!(
                "{what}: http2_connections_at_stream_limit {limit_after} once every \
                 connection closed"
            ));
        }
        let served = server.finish()?;
        anyhow::ensure!(
            served.sleep == load.succeeded,
            "{what}: the server ran {} calls, {} succeeded for h2load",
            served.sleep,
            load.succeeded
        );
    }
    ensure_none("grpc-go on two CPUs", &failures)
}

/// Server-streaming calls of K messages (each its own gRPC message, in one or more
/// DATA frames): one request per call, whatever K.
#[test]
fn grpc_server_streaming_is_one_request_per_call() -> anyhow::Result<()> {
    if !privileged("grpc_server_streaming_is_one_request_per_call") {
        return Ok(());
    }
    const WORKERS: u32 = 4;
    const CALLS: u64 = 400;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in http2_backends("grpc_server_streaming_is_one_request_per_call") {
        let server = GrpcServer::start(WORKERS)?;
        let service = format!("grpc-stream-{backend}");
        let poolscope = watch(backend, &service, &[server.pid()])?;
        for messages in [10, 200] {
            let what = format!("{backend}, {CALLS} calls of {messages} messages");
            let before = Counts::scrape(&poolscope, &service)?;
            let result = GrpcClient::run(
                server.port,
                "Stream",
                messages,
                WORKERS,
                Amount::Calls(CALLS),
            )?;
            anyhow::ensure!(
                result.completed == CALLS
                    && result.ok == CALLS
                    && result.messages == CALLS * messages,
                "{what}: the gRPC client's calls failed: {result:?}"
            );
            let delta = settle_on(&poolscope, &service, &before, CALLS, 0)?;
            eprintln!(
                "{what}: requests_total +{}, resets +{}, connections +{}, lost {}",
                delta.requests,
                delta.resets,
                delta.connections,
                delta.lost_sources()
            );
            Expect {
                what: &what,
                requests: CALLS,
                resets: 0,
                connections: Some(1),
            }
            .check(&delta, &mut failures);
        }
    }
    ensure_none("gRPC server streaming", &failures)
}

/// The slow calls that get cancelled: far longer than the cancelling takes.
const SLOW_MS: u64 = 1000;
const CANCELLED: u64 = 8;

/// Streams that end otherwise than by the server's END_STREAM, against a gRPC server:
/// - calls the server aborts with a status: a trailers-only response (HEADERS with
///   END_STREAM), so requests, not resets;
/// - calls the client cancels with RST_STREAM after the server has read them (a
///   PING's round trip between), then one call answered on the same connection;
/// - calls open when the client closes the connection under them.
#[test]
fn grpc_aborts_cancels_and_closes() -> anyhow::Result<()> {
    if !privileged("grpc_aborts_cancels_and_closes") {
        return Ok(());
    }
    const ABORTS: u64 = 200;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in http2_backends("grpc_aborts_cancels_and_closes") {
        // Workers enough that the answered call never waits for a cancelled one.
        let server = GrpcServer::start(2 * CANCELLED as u32)?;
        let service = format!("grpc-resets-{backend}");
        let poolscope = watch(backend, &service, &[server.pid()])?;

        let before = Counts::scrape(&poolscope, &service)?;
        let aborted = GrpcClient::run(server.port, "Abort", 0, 4, Amount::Calls(ABORTS))?;
        anyhow::ensure!(
            aborted.completed == ABORTS && aborted.ok == 0 && aborted.failed == 0,
            "the Abort calls did not all end with the server's status: {aborted:?}"
        );
        let delta = settle_on(&poolscope, &service, &before, ABORTS, 0)?;
        eprintln!(
            "{backend}: {ABORTS} aborted calls: requests_total +{}, resets +{}",
            delta.requests, delta.resets
        );
        Expect {
            what: &format!("{backend}, aborted calls"),
            requests: ABORTS,
            resets: 0,
            connections: Some(1),
        }
        .check(&delta, &mut failures);

        let args = [CANCELLED.to_string(), SLOW_MS.to_string()];
        let before = Counts::scrape(&poolscope, &service)?;
        let cancelled = h2raw("reset", server.port, &args)?;
        anyhow::ensure!(
            cancelled.reset_by_us == CANCELLED && cancelled.answered == 1,
            "h2raw.py reset: {cancelled:?}"
        );
        let delta = settle_on(&poolscope, &service, &before, 1, CANCELLED)?;
        eprintln!(
            "{backend}: {CANCELLED} calls cancelled, 1 answered: requests_total +{}, resets +{}",
            delta.requests, delta.resets
        );
        Expect {
            what: &format!("{backend}, calls cancelled by the client"),
            requests: cancelled.answered,
            resets: cancelled.reset_by_us,
            connections: Some(1),
        }
        .check(&delta, &mut failures);

        let before = Counts::scrape(&poolscope, &service)?;
        let closed = h2raw("close", server.port, &args)?;
        anyhow::ensure!(
            closed.abandoned == CANCELLED && closed.answered == 0,
            "h2raw.py close: {closed:?}"
        );
        let delta = settle_on(&poolscope, &service, &before, 0, CANCELLED)?;
        eprintln!(
            "{backend}: {CANCELLED} calls open at the client's close: requests_total +{}, \
             resets +{}",
            delta.requests, delta.resets
        );
        Expect {
            what: &format!("{backend}, calls open at the close"),
            requests: 0,
            resets: closed.abandoned,
            connections: Some(1),
        }
        .check(&delta, &mut failures);

        let served = server.finish()?;
        anyhow::ensure!(
            served.abort == ABORTS,
            "the server aborted {} calls, not {ABORTS}",
            served.abort
        );
    }
    ensure_none("gRPC resets", &failures)
}

/// nginx resetting streams itself: `/reset` is `return 444`, which nginx answers on
/// HTTP/2 with RST_STREAM (INTERNAL_ERROR) and no response, the connection kept;
/// h2load counts each as failed. Resets, not requests; then requests on the same
/// connections' successors still count exactly.
#[test]
fn nginx_server_resets() -> anyhow::Result<()> {
    if !privileged("nginx_server_resets") {
        return Ok(());
    }
    const RESET_REQUESTS: u64 = 1000;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in http2_backends("nginx_server_resets") {
        let server = RealServer::start(Kind::NginxH2c, free_port()?)?;
        let service = format!("nginx-resets-{backend}");
        let poolscope = watch(backend, &service, &server.pids())?;

        let before = Counts::scrape(&poolscope, &service)?;
        let load = h2load(server.port(), "/reset", RESET_REQUESTS, 2, 10)?;
        anyhow::ensure!(
            load.protocol == "h2c" && load.succeeded == 0 && load.errored == RESET_REQUESTS,
            "h2load against /reset: {load:?}"
        );
        let delta = settle_on(&poolscope, &service, &before, 0, load.errored)?;
        eprintln!(
            "{backend}: {} streams nginx reset: requests_total +{}, resets +{}, lost {}",
            load.errored,
            delta.requests,
            delta.resets,
            delta.lost_sources()
        );
        Expect {
            what: &format!("{backend}, streams nginx reset"),
            requests: 0,
            resets: load.errored,
            connections: Some(2),
        }
        .check(&delta, &mut failures);

        let before = Counts::scrape(&poolscope, &service)?;
        let load = h2load(server.port(), "/", RESET_REQUESTS, 2, 10)?;
        anyhow::ensure!(load.succeeded == RESET_REQUESTS, "h2load: {load:?}");
        let delta = settle_on(&poolscope, &service, &before, load.succeeded, 0)?;
        Expect {
            what: &format!("{backend}, requests after the resets"),
            requests: load.succeeded,
            resets: 0,
            connections: Some(2),
        }
        .check(&delta, &mut failures);
    }
    ensure_none("nginx's resets", &failures)
}

/// Hostile input to nginx's h2c port, one connection each: poolscope keeps serving,
/// never counts more requests than nginx answered (the client reads every answer),
/// and counts each valid request, however cut up, exactly: 1, unless an `http2_*`
/// loss rose for its connection, when it must be 0 (a connection given up counts
/// nothing, rather than something wrong). Then h2load's requests still count exactly.
#[test]
fn nginx_hostile_input() -> anyhow::Result<()> {
    if !privileged("nginx_hostile_input") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    let mut table = HostileTable::default();
    for backend in http2_backends("nginx_hostile_input") {
        let server = RealServer::start(Kind::NginxH2c, free_port()?)?;
        let service = format!("nginx-hostile-{backend}");
        let poolscope = watch(backend, &service, &server.pids())?;
        table.run(&poolscope, backend, &service, &mut failures, |case| {
            case.run(server.port())
        })?;
        // Nothing left behind: the next connections count exactly.
        let before = Counts::scrape(&poolscope, &service)?;
        let load = h2load(server.port(), "/", 1000, 2, 10)?;
        anyhow::ensure!(load.succeeded == 1000, "h2load: {load:?}");
        let delta = settle_on(&poolscope, &service, &before, load.succeeded, 0)?;
        Expect {
            what: &format!("{backend}, h2load after the hostile input"),
            requests: load.succeeded,
            resets: 0,
            connections: Some(2),
        }
        .check(&delta, &mut failures);
    }
    eprintln!("{}", table.rows.join("\n"));
    ensure_none("hostile input", &failures)
}

/// The hostile cases against the standard-library server, written by the standard
/// library too ([`Hostile::run_plain`]), so that they run in the 6.1 guest on the tcp
/// backend: the same verdicts as nginx's, then 3 connections × 8 streams count exactly.
#[test]
fn plain_server_hostile_input() -> anyhow::Result<()> {
    if !privileged("plain_server_hostile_input") {
        return Ok(());
    }
    const CONNECTIONS: u32 = 3;
    const PER_CONNECTION: u32 = 8;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    let mut table = HostileTable::default();
    for backend in http2_backends("plain_server_hostile_input") {
        let server = PlainH2Server::start(Duration::from_millis(5))?;
        let service = format!("h2server-hostile-{backend}");
        let poolscope = watch(backend, &service, &[server.pid()])?;
        let hostile_answered = table.run(&poolscope, backend, &service, &mut failures, |case| {
            case.run_plain(server.port())
        })?;
        let before = Counts::scrape(&poolscope, &service)?;
        let (answered, ()) = plain_streams(server.port(), CONNECTIONS, 4, PER_CONNECTION, || ())?;
        let delta = settle_on(&poolscope, &service, &before, answered, 0)?;
        let served = server.finish()?;
        let streams = u64::from(CONNECTIONS * PER_CONNECTION);
        // The server counts the valid hostile cases' streams too.
        let answers = Answers {
            made: streams,
            client: answered,
            server: served.answered.saturating_sub(hostile_answered),
            server_open: served.open,
        };
        answers.check(
            &format!("{backend}, h2server after the hostile input"),
            &delta,
            CONNECTIONS,
            &mut failures,
        );
    }
    eprintln!("{}", table.rows.join("\n"));
    ensure_none("plain server's hostile input", &failures)
}

/// The rows of the hostile-input tests: one per backend and case.
struct HostileTable {
    rows: Vec<String>,
}

impl Default for HostileTable {
    fn default() -> Self {
        Self {
            rows: vec![
                "| backend | input | answered | server | requests_total | resets | connections \
                 | lost | verdict |"
                    .to_owned(),
            ],
        }
    }
}

impl HostileTable {
    /// Runs every [`Hostile`] case through `run`, one connection each: poolscope keeps
    /// serving (a crash fails the scrapes), never counts more requests than the server
    /// answered, and counts a valid request unless it gave the connection up (a loss).
    /// The streams the server answered, summed.
    fn run(
        &mut self,
        poolscope: &Poolscope,
        backend: &str,
        service: &str,
        failures: &mut Vec<String>,
        run: impl Fn(Hostile) -> anyhow::Result<RawResult>,
    ) -> anyhow::Result<u64> {
        let mut answered = 0;
        for case in Hostile::all() {
            let what = format!("{backend}, {}", case.name());
            let before = Counts::scrape(poolscope, service)?;
            let result = run(case).with_context(|| what.clone())?;
            answered += result.answered;
            if case.valid() {
                anyhow::ensure!(
                    result.answered == 1,
                    "{what}: the server did not answer the request: {result:?}"
                );
            }
            let delta = settle_on(poolscope, service, &before, result.answered, 0)
                .with_context(|| format!("{what}: poolscope did not settle"))?;
            let lost = delta.lost() > 0.0;
            let verdict = if delta.requests > result.answered as f64 {
                format!(
                    "FAIL: {} counted, {} answered",
                    delta.requests, result.answered
                )
            } else if !case.valid() || delta.requests == result.answered as f64 && !lost {
                "ok".to_owned()
            } else if lost && delta.requests == 0.0 {
                "ok: given up (loss), counted 0".to_owned()
            } else if lost {
                format!("FAIL: given up (loss) but counted {}", delta.requests)
            } else {
                format!("FAIL: counted {}, no loss", delta.requests)
            };
            let server_said = match (result.server_closed, result.goaway) {
                (true, Some(code)) => format!("GOAWAY {code}, closed"),
                (true, None) => "closed".to_owned(),
                (false, Some(code)) => format!("GOAWAY {code}"),
                (false, None) => "-".to_owned(),
            };
            self.rows.push(format!(
                "| {backend} | {} | {} | {server_said} | {} | {} | {} | {} | {verdict} |",
                case.name(),
                result.answered,
                delta.requests,
                delta.resets,
                delta.connections,
                delta.lost_sources(),
            ));
            if verdict.starts_with("FAIL") {
                failures.push(format!("{what}: {verdict}"));
            }
        }
        Ok(answered)
    }
}

/// A server that serves every open stream at once (tests/src/bin/h2server.rs: a thread
/// per stream, 500 ms each; the standard library alone, so that it runs in the test
/// guests, the 6.1 one on the tcp backend) under 3 connections that each keep 4 streams
/// open, 24 streams each: every stream the client saw answered and the server counted
/// is counted, the in-flight gauge reads the 12 streams the server holds while the load
/// runs (but for the instants between an answer and the next request) and 0 after, and
/// the mean duration is the server's own, from its read of a stream's HEADERS to the
/// return of its answer's write, within [`DURATION_BOUND`].
#[test]
fn plain_server_streams_counted_exactly() -> anyhow::Result<()> {
    if !privileged("plain_server_streams_counted_exactly") {
        return Ok(());
    }
    // Long enough that a stream is rarely between an answer and its connection's next
    // request (at 100 ms, under CI's emulation, 6 of 8 samples read 9-11 for 12).
    const SERVICE: Duration = Duration::from_millis(500);
    const CONNECTIONS: u32 = 3;
    const OPEN: u32 = 4;
    const PER_CONNECTION: u32 = 24;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in http2_backends("plain_server_streams_counted_exactly") {
        let server = PlainH2Server::start(SERVICE)?;
        let service = format!("h2server-{backend}");
        let poolscope = watch(backend, &service, &[server.pid()])?;
        let before = Counts::scrape(&poolscope, &service)?;
        let (answered, samples) =
            plain_streams(server.port(), CONNECTIONS, OPEN, PER_CONNECTION, || {
                // 8 samples in the first 1.2 s of a load of 3 s or more: each sees all
                // 12 streams unless one is between an answer and its next request.
                (0..8)
                    .map(|_| {
                        std::thread::sleep(Duration::from_millis(150));
                        Counts::scrape(&poolscope, &service).map(|counts| counts.in_flight)
                    })
                    .collect::<anyhow::Result<Vec<f64>>>()
            })?;
        let samples = samples?;
        let streams = u64::from(CONNECTIONS * PER_CONNECTION);
        // Before the server stops: its series go with it.
        let delta = settle_on(&poolscope, &service, &before, streams, 0)?;
        let metrics = poolscope.scrape()?;
        let (model, split) = (
            stream_model(&metrics, &service),
            answered_by_workers(&metrics, &service),
        );
        let served = server.finish()?;
        let held = f64::from(CONNECTIONS * OPEN);
        let mean_ms = delta.mean_duration() * 1e3;
        eprintln!(
            "{backend}: {streams} streams, client answered {answered}, server answered {} \
             ({} open at its end): requests_total +{}, in flight while held {samples:?} \
             (truth {held}), mean duration {mean_ms:.2} ms (server's own {:.2} ms, service \
             {} ms), {model}, answered by stream workers {split}, lost {}",
            served.answered,
            served.open,
            delta.requests,
            served.mean.as_secs_f64() * 1e3,
            SERVICE.as_millis(),
            delta.lost_sources()
        );
        let what = format!("{backend}: h2server");
        let answers = Answers {
            made: streams,
            client: answered,
            server: served.answered,
            server_open: served.open,
        };
        answers.check(&what, &delta, CONNECTIONS, &mut failures);
        if samples.iter().any(|&sample| sample > held) || !samples.contains(&held) {
            failures.push(format!(
                "{what}: in flight while {held} streams were held: {samples:?}"
            ));
        }
        // A new thread answers each stream once: no pool.
        if model != "every_stream/detected" {
            failures.push(format!(
                "{what}: a thread per stream read as {model}, not every_stream/detected"
            ));
        }
        let server_ms = served.mean.as_secs_f64() * 1e3;
        if (mean_ms - server_ms).abs() > server_ms * DURATION_BOUND {
            failures.push(format!(
                "{what}: mean duration {mean_ms:.2} ms, the server's own {server_ms:.2} ms \
                 (bound {} %)",
                DURATION_BOUND * 100.0
            ));
        }
    }
    ensure_none("plain_server_streams_counted_exactly", &failures)
}

/// The streams a closed loop made, as its client and server each counted them.
struct Answers {
    made: u64,
    client: u64,
    server: u64,
    /// Streams the server still held when it stopped.
    server_open: i64,
}

impl Answers {
    /// Both sides answered every stream made, and poolscope counted each, no reset, on
    /// `connections` connections.
    fn check(&self, what: &str, delta: &Delta, connections: u32, failures: &mut Vec<String>) {
        let Self {
            made,
            client,
            server,
            server_open,
        } = *self;
        if client != made || server != made || server_open != 0 {
            failures.push(format!(
                "{what}: the truth disagrees with itself: client {client}, server {server} \
                 ({server_open} open), made {made}"
            ));
        }
        Expect {
            what,
            requests: made,
            resets: 0,
            connections: Some(u64::from(connections)),
        }
        .check(delta, failures);
    }
}

/// A service's answered streams, `by stream workers/all`, what its model is read from.
fn answered_by_workers(metrics: &Metrics, service: &str) -> String {
    let answered = |answerer| {
        metrics
            .value(
                "poolscope_http2_streams_answered_total",
                &[("service", service), ("answerer", answerer)],
            )
            .unwrap_or(0.0)
    };
    let workers = answered("stream_worker");
    format!("{workers}/{}", workers + answered("other"))
}

/// `model/source` of a service's `http2_stream_model`, `none/none` without one.
fn stream_model(metrics: &Metrics, service: &str) -> String {
    let label = |key| {
        metrics
            .label("poolscope_http2_stream_model", &[("service", service)], key)
            .unwrap_or("none")
            .to_owned()
    };
    format!("{}/{}", label("model"), label("source"))
}

/// Node.js's HTTP/2 server (tests/http2/node_server.js: each stream answered from a
/// timer on its one event loop, 50 ms after it opened) under 4 connections that each
/// keep 4 streams open, with nothing configured: every stream counted, read as
/// `every_stream` (detected: the thread that reads answers), and no stream waiting,
/// though 16 are in flight and its one thread is mostly idle.
#[test]
fn node_server_serves_every_stream_at_once() -> anyhow::Result<()> {
    if !privileged("node_server_serves_every_stream_at_once") {
        return Ok(());
    }
    const SERVICE: Duration = Duration::from_millis(50);
    const CONNECTIONS: u32 = 4;
    const OPEN: u32 = 4;
    const PER_CONNECTION: u32 = 250;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in http2_backends("node_server_serves_every_stream_at_once") {
        let server = NodeH2Server::start(SERVICE)?;
        let service = format!("node-h2-{backend}");
        let poolscope = watch(backend, &service, &[server.pid()])?;
        let before = Counts::scrape(&poolscope, &service)?;
        let (answered, samples) =
            plain_streams(server.port(), CONNECTIONS, OPEN, PER_CONNECTION, || {
                // 32 streams are answered within 0.1 s; the load lasts ~3 s.
                std::thread::sleep(Duration::from_millis(500));
                let mut samples = Vec::new();
                for _ in 0..8 {
                    let metrics = poolscope.scrape()?;
                    let gauge = |name| {
                        metrics
                            .value(name, &[("service", &service)])
                            .unwrap_or(f64::NAN)
                    };
                    samples.push((
                        gauge("poolscope_requests_in_flight"),
                        gauge("poolscope_requests_waiting"),
                        stream_model(&metrics, &service),
                    ));
                    std::thread::sleep(Duration::from_millis(200));
                }
                anyhow::Ok(samples)
            })?;
        let samples = samples?;
        let streams = u64::from(CONNECTIONS * PER_CONNECTION);
        let delta = settle_on(&poolscope, &service, &before, streams, 0)?;
        let split = answered_by_workers(&poolscope.scrape()?, &service);
        let served = server.finish()?;
        let what = format!("{backend}: Node.js");
        eprintln!(
            "{what}: {streams} streams, client {answered}, server {served}, samples (in \
             flight, waiting, model) {samples:?}, answered by stream workers {split}, \
             requests_total +{}",
            delta.requests
        );
        let answers = Answers {
            made: streams,
            client: answered,
            server: served,
            server_open: 0,
        };
        answers.check(&what, &delta, CONNECTIONS, &mut failures);
        if samples
            .iter()
            .any(|(_, _, model)| model != "every_stream/detected")
        {
            failures.push(format!(
                "{what}: read as {samples:?}, not every_stream/detected"
            ));
        }
        let waiting = mean(
            &samples
                .iter()
                .map(|(_, waiting, _)| *waiting)
                .collect::<Vec<_>>(),
        );
        if waiting.is_nan() || waiting > WAITING_TOLERANCE {
            failures.push(format!(
                "{what}: requests_waiting {waiting:.2} (mean) while every stream is served \
                 at once: {samples:?}"
            ));
        }
    }
    ensure_none("node_server_serves_every_stream_at_once", &failures)
}

/// The plain server with a pool of 4 workers that its reader hands each stream to
/// (tests/src/bin/h2server.rs, as grpcio's executor; 300 ms a stream), under 4
/// connections that each keep 4 streams open, with nothing configured: read as
/// `workers` (detected), and `requests_waiting` and `queue_depth` read the streams in
/// the pool's queue, by the server's own count at each sample (mean within
/// [`WAITING_TOLERANCE`]: a worker may take a stream between the scrape and the
/// server's count); every stream counted, none waiting once the load is done.
#[test]
fn plain_server_pool_streams_wait_for_a_worker() -> anyhow::Result<()> {
    if !privileged("plain_server_pool_streams_wait_for_a_worker") {
        return Ok(());
    }
    const SERVICE: Duration = Duration::from_millis(300);
    const WORKERS: u32 = 4;
    const CONNECTIONS: u32 = 4;
    const OPEN: u32 = 4;
    const PER_CONNECTION: u32 = 24;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    let mut table = vec![
        "| backend | model | answered by stream workers | queued (server, per sample) | \
         requests_waiting | queue_depth |"
            .to_owned(),
    ];
    for backend in http2_backends("plain_server_pool_streams_wait_for_a_worker") {
        let mut server = PlainH2Server::start_pool(SERVICE, WORKERS)?;
        let service = format!("h2pool-{backend}");
        let poolscope = watch(backend, &service, &[server.pid()])?;
        let before = Counts::scrape(&poolscope, &service)?;
        let port = server.port();
        let (answered, samples) = plain_streams(port, CONNECTIONS, OPEN, PER_CONNECTION, || {
            // The model is read from 32 answered streams: 16 are answered every
            // 1.2 s. Then 8 samples, 250 ms apart, well before the load's end
            // (96 streams: 7.2 s).
            std::thread::sleep(Duration::from_millis(3500));
            let mut samples = Vec::new();
            for _ in 0..8 {
                let metrics = poolscope.scrape()?;
                let queued = server.queued()?;
                let gauge = |name| {
                    metrics
                        .value(name, &[("service", &service)])
                        .unwrap_or(f64::NAN)
                };
                samples.push((
                    queued as f64,
                    gauge("poolscope_requests_waiting"),
                    gauge("poolscope_queue_depth"),
                    stream_model(&metrics, &service),
                ));
                std::thread::sleep(Duration::from_millis(250));
            }
            anyhow::Ok(samples)
        })?;
        let samples = samples?;
        let streams = u64::from(CONNECTIONS * PER_CONNECTION);
        let delta = settle_on(&poolscope, &service, &before, streams, 0)?;
        let after = poolscope.scrape()?;
        let waiting_after = after
            .value("poolscope_requests_waiting", &[("service", &service)])
            .unwrap_or(f64::NAN);
        let split = answered_by_workers(&after, &service);
        let served = server.finish()?;
        let what = format!("{backend}: h2server, a pool of {WORKERS}");
        let answers = Answers {
            made: streams,
            client: answered,
            server: served.answered,
            server_open: served.open,
        };
        answers.check(&what, &delta, CONNECTIONS, &mut failures);
        let column = |part: fn(&(f64, f64, f64, String)) -> f64| -> Vec<f64> {
            samples.iter().map(part).collect()
        };
        let (queued_samples, waiting_samples) = (column(|s| s.0), column(|s| s.1));
        let (queued, waiting, depth) = (
            mean(&queued_samples),
            mean(&waiting_samples),
            mean(&column(|s| s.2)),
        );
        let models: Vec<&str> = samples.iter().map(|s| s.3.as_str()).collect();
        table.push(format!(
            "| {backend} | {models:?} | {split} | {queued:.2} {:?} | {waiting:.2} {:?} | \
             {depth:.2} |",
            queued_samples, waiting_samples,
        ));
        if models.iter().any(|model| *model != "workers/detected") {
            failures.push(format!("{what}: read as {models:?}, not workers/detected"));
        }
        if (waiting - queued).abs().is_nan()
            || (waiting - queued).abs() > WAITING_TOLERANCE
            || (depth - waiting).abs() > WAITING_TOLERANCE
        {
            failures.push(format!(
                "{what}: requests_waiting {waiting:.2}, queue_depth {depth:.2} (mean) vs the \
                 server's {queued:.2} streams queued for a worker, beyond \
                 ±{WAITING_TOLERANCE}"
            ));
        } else {
            scorecard::difference(
                "requests_waiting, HTTP/2 streams waiting for a worker of a pool, nothing configured (mean of 8 scrapes)",
                "the server's own count of streams in its pool's queue at each scrape",
                backend,
                (waiting, queued),
                WAITING_TOLERANCE,
                "streams",
            );
        }
        if waiting_after != 0.0 {
            failures.push(format!("{what}: {waiting_after} waiting after the load"));
        }
    }
    eprintln!("{}", table.join("\n"));
    ensure_none("plain_server_pool_streams_wait_for_a_worker", &failures)
}

/// The same plain server (tests/src/bin/h2server.rs, 600 ms a stream, a limit of 4
/// streams a connection) with what a connection does besides answered streams, each
/// against its truth: a connection opened before poolscope, which cannot be followed
/// (its further requests uncounted, `http2_adopted` +1); a connection holding the
/// server's 4 streams (`http2_connections_at_stream_limit` 1 while held, 0 after, 4
/// requests); a client that closes with 3 streams open (3 resets, no request).
#[test]
fn plain_server_limits_closes_and_old_connections() -> anyhow::Result<()> {
    if !privileged("plain_server_limits_closes_and_old_connections") {
        return Ok(());
    }
    const SERVICE: Duration = Duration::from_millis(600);
    const LIMIT: u32 = 4;
    const CLOSED_OPEN: u32 = 3;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in http2_backends("plain_server_limits_closes_and_old_connections") {
        let server = PlainH2Server::start_with_stream_limit(SERVICE, LIMIT)?;
        let mut old = PlainConnection::open(server.port())?;
        old.request()?;
        old.answer()?;
        let service = format!("h2server-edges-{backend}");
        let poolscope = watch(backend, &service, &[server.pid()])?;
        let before = Counts::scrape(&poolscope, &service)?;
        // The old connection's requests go uncounted.
        old.request()?;
        old.answer()?;
        // A connection at the server's limit.
        let mut full = PlainConnection::open(server.port())?;
        for _ in 0..LIMIT {
            full.request()?;
        }
        let at_limit = scrape_until(&poolscope, |m| {
            m.value(AT_LIMIT, &[("service", &service)]) == Some(1.0)
        })
        .is_ok();
        for _ in 0..LIMIT {
            full.answer()?;
        }
        // A client that closes under open streams, once the server has read them.
        let mut closing = PlainConnection::open(server.port())?;
        for _ in 0..CLOSED_OPEN {
            closing.request()?;
        }
        scrape_until(&poolscope, |m| {
            m.value(IN_FLIGHT, &[("service", &service)]) == Some(f64::from(CLOSED_OPEN))
        })?;
        drop(closing);
        drop(full);
        drop(old);
        let delta = settle_on(&poolscope, &service, &before, u64::from(LIMIT), 3)?;
        let after_limit = poolscope
            .scrape()?
            .value(AT_LIMIT, &[("service", &service)])
            .unwrap_or(0.0);
        let served = server.finish()?;
        eprintln!(
            "{backend}: old connection 1 request after the watch, {LIMIT} streams at the \
             limit ({}: at_limit 1 seen {at_limit}, {after_limit} after), {CLOSED_OPEN} open \
             at a close: requests_total +{}, resets +{}, connections +{}, lost {}",
            served.answered,
            delta.requests,
            delta.resets,
            delta.connections,
            delta.lost_sources()
        );
        let what = format!("{backend}: h2server edges");
        if !at_limit || after_limit != 0.0 {
            failures.push(format!(
                "{what}: http2_connections_at_stream_limit: 1 while {LIMIT} streams were held \
                 seen {at_limit}, {after_limit} after (expected 0)"
            ));
        }
        if delta.requests != f64::from(LIMIT) || delta.resets != f64::from(CLOSED_OPEN) {
            failures.push(format!(
                "{what}: requests_total +{} (truth {LIMIT}), resets +{} (truth {CLOSED_OPEN})",
                delta.requests, delta.resets
            ));
        }
        let adopted = delta.losses.get("http2_adopted").copied().unwrap_or(0.0);
        if adopted != 1.0 || delta.losses.len() != 1 {
            failures.push(format!(
                "{what}: losses {} (expected http2_adopted +1 only: the old connection)",
                delta.lost_sources()
            ));
        }
        if delta.in_flight != 0.0 {
            failures.push(format!("{what}: {} in flight at the end", delta.in_flight));
        }
    }
    ensure_none("plain_server_limits_closes_and_old_connections", &failures)
}

/// The `Upgrade: h2c` path with the plain server (tests/src/bin/h2server.rs, which
/// runs in the guests, the 6.1 one on the tcp backend): the upgrade request is one
/// HTTP/1.1 request (answered `101`, then on stream 1), and each of 20 streams after it
/// on the connection one more: 21, as the server answered.
#[test]
fn plain_server_h2c_upgrade_counts_the_upgrade_and_every_stream() -> anyhow::Result<()> {
    const TEST: &str = "plain_server_h2c_upgrade_counts_the_upgrade_and_every_stream";
    if !privileged(TEST) {
        return Ok(());
    }
    const STREAMS: u32 = 20;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in http2_backends(TEST) {
        let server = PlainH2Server::start(Duration::from_millis(5))?;
        let service = format!("h2server-upgrade-{backend}");
        let poolscope = watch(backend, &service, &[server.pid()])?;
        let before = Counts::scrape(&poolscope, &service)?;
        let mut connection = PlainConnection::upgraded(server.port())?;
        for _ in 0..STREAMS {
            connection.request()?;
            connection.answer()?;
        }
        drop(connection);
        let truth = u64::from(STREAMS) + 1;
        let delta = settle_on(&poolscope, &service, &before, truth, 0)?;
        let served = server.finish()?;
        eprintln!(
            "{backend}: an upgrade and {STREAMS} streams, server answered {}: requests_total \
             +{}, connections +{}, lost {}",
            served.answered,
            delta.requests,
            delta.connections,
            delta.lost_sources()
        );
        let what = format!("{backend}: h2server upgrade");
        if served.answered != truth {
            failures.push(format!(
                "{what}: the server answered {} (expected {truth})",
                served.answered
            ));
        }
        Expect {
            what: &what,
            requests: truth,
            resets: 0,
            connections: Some(1),
        }
        .check(&delta, &mut failures);
    }
    ensure_none(TEST, &failures)
}

/// HTTP/1.1 and h2c in one service at once: nginx's h2c port and its HTTP/1.1 port
/// (one server block, one worker), each under h2load: the service counts both loads'
/// requests exactly, and only the h2c connections as HTTP/2 ones. One port serving
/// both (a server that tells HTTP/1.1 from the preface) is not tested: nginx 1.22
/// answers an HTTP/1.1 request on an `http2` listener with a GOAWAY (measured by hand:
/// curl read it as HTTP/0.9), and `http2 on` on a plain listener came in 1.25.1.
#[test]
fn http1_and_h2c_in_one_service() -> anyhow::Result<()> {
    if !privileged("http1_and_h2c_in_one_service") {
        return Ok(());
    }
    const EACH: u64 = 4000;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in http2_backends("http1_and_h2c_in_one_service") {
        let server = RealServer::start(Kind::NginxH2c, free_port()?)?;
        let http1_port = server
            .http1_port()
            .context("nginx-h2c has an HTTP/1.1 port")?;
        let service = format!("nginx-mixed-{backend}");
        let poolscope = watch(backend, &service, &server.pids())?;
        let before = Counts::scrape(&poolscope, &service)?;
        let h2c_port = server.port();
        let h2c = std::thread::spawn(move || h2load(h2c_port, "/", EACH, 2, 10));
        let http1 = h2load_h1(http1_port, "/", EACH, 2)?;
        let h2c = h2c
            .join()
            .map_err(|_| anyhow::anyhow!("the h2load thread panicked"))??;
        anyhow::ensure!(
            h2c.protocol == "h2c" && h2c.succeeded == EACH,
            "h2load (h2c): {h2c:?}"
        );
        anyhow::ensure!(
            http1.protocol == "http/1.1" && http1.succeeded == EACH,
            "h2load --h1: {http1:?}"
        );
        let both = h2c.succeeded + http1.succeeded;
        let delta = settle_on(&poolscope, &service, &before, both, 0)?;
        eprintln!(
            "{backend}: {} h2c + {} HTTP/1.1 requests: requests_total +{}, HTTP/2 \
             connections +{}, resets +{}, lost {}",
            h2c.succeeded,
            http1.succeeded,
            delta.requests,
            delta.connections,
            delta.resets,
            delta.lost_sources()
        );
        Expect {
            what: &format!("{backend}, h2c and HTTP/1.1"),
            requests: both,
            resets: 0,
            connections: Some(2),
        }
        .check(&delta, &mut failures);
    }
    ensure_none("HTTP/1.1 and h2c", &failures)
}

/// An h2c connection opened (and used once) before poolscope started: its preface
/// went by unseen, so poolscope cannot follow its frames. It is adopted as every
/// connection older than poolscope is; its first bytes after that are HTTP/2 frames,
/// so it counts as an HTTP/2 connection (`http2_connections_total` +1), counts no
/// request (it must not be taken for HTTP/1.1 turns either) and shows as one loss
/// (`events_lost_total{source="http2_adopted"}` +1), while a new connection next to
/// it counts exactly.
#[test]
fn h2c_connection_older_than_poolscope() -> anyhow::Result<()> {
    if !privileged("h2c_connection_older_than_poolscope") {
        return Ok(());
    }
    const OLD_REQUESTS: u64 = 20;
    const NEW_REQUESTS: u64 = 100;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in http2_backends("h2c_connection_older_than_poolscope") {
        let server = RealServer::start(Kind::NginxH2c, free_port()?)?;
        let mut old = OldConnection::open(server.port())?;
        let service = format!("nginx-old-{backend}");
        let poolscope = watch(backend, &service, &server.pids())?;

        let before = Counts::scrape(&poolscope, &service)?;
        let old_result = old.requests(OLD_REQUESTS)?;
        anyhow::ensure!(
            old_result.answered == OLD_REQUESTS,
            "the old connection's requests: {old_result:?}"
        );
        let new = h2load(server.port(), "/", NEW_REQUESTS, 1, 1)?;
        anyhow::ensure!(new.succeeded == NEW_REQUESTS, "h2load: {new:?}");
        let delta = settle_on(&poolscope, &service, &before, NEW_REQUESTS, 0)?;
        eprintln!(
            "{backend}: {OLD_REQUESTS} requests on the old connection, {NEW_REQUESTS} on a \
             new one: requests_total +{}, HTTP/2 connections +{}, resets +{}, lost {}",
            delta.requests,
            delta.connections,
            delta.resets,
            delta.lost_sources()
        );
        if delta.requests != NEW_REQUESTS as f64 {
            failures.push(format!(
                "{backend}: requests_total +{} for {NEW_REQUESTS} on the new connection and \
                 {OLD_REQUESTS} on the old one (expected: the old one's uncounted)",
                delta.requests
            ));
        }
        if delta.connections != 2.0 {
            failures.push(format!(
                "{backend}: http2_connections_total +{} (expected 2: the old and the new \
                 connection)",
                delta.connections
            ));
        }
        let adopted = delta.losses.get("http2_adopted").copied().unwrap_or(0.0);
        if adopted != 1.0 || delta.losses.len() != 1 {
            failures.push(format!(
                "{backend}: losses {} (expected http2_adopted +1 only: the old connection)",
                delta.lost_sources()
            ));
        }
        if delta.resets != 0.0 {
            failures.push(format!(
                "{backend}: http2_streams_reset_total +{}, no stream was reset",
                delta.resets
            ));
        }

        // Its close ends nothing poolscope counted.
        let before = Counts::scrape(&poolscope, &service)?;
        old.close()?;
        let delta = settle(&poolscope, &service, &before, |_| true)?;
        eprintln!(
            "{backend}: the old connection closed: requests_total +{}, resets +{}, lost {}",
            delta.requests,
            delta.resets,
            delta.lost_sources()
        );
        if delta.requests != 0.0 || delta.resets != 0.0 {
            failures.push(format!(
                "{backend}: the old connection's close counted {} requests and {} resets",
                delta.requests, delta.resets
            ));
        }
    }
    ensure_none("an h2c connection older than poolscope", &failures)
}

/// The syscall and tcp backends do not follow HTTP/2 streams: an h2c connection must
/// count no request at all (its frames are not read/write turns), show as an HTTP/2
/// connection, and be counted as a loss (`http2_<backend>_backend`), once per
/// connection; nothing stays in flight.
#[test]
fn backends_without_streams_count_no_http2_request() -> anyhow::Result<()> {
    if !privileged("backends_without_streams_count_no_http2_request") {
        return Ok(());
    }
    const REQUESTS: u64 = 2000;
    let _serial = one_at_a_time();
    let capable = http2_capable();
    let without_streams: Vec<&str> = backends()
        .into_iter()
        .filter(|backend| !capable.contains(backend))
        .collect();
    if without_streams.is_empty() {
        skip(
            "backends_without_streams_count_no_http2_request",
            "every backend tested here follows HTTP/2",
        );
    }
    for backend in without_streams {
        let server = RealServer::start(Kind::NginxH2c, free_port()?)?;
        let service = format!("nginx-h2c-{backend}");
        let poolscope = watch(backend, &service, &server.pids())?;
        let before = Counts::scrape(&poolscope, &service)?;
        let load = h2load(server.port(), "/", REQUESTS, H2LOAD_CLIENTS, 10)?;
        anyhow::ensure!(load.succeeded == REQUESTS, "h2load: {load:?}");
        let clients = f64::from(H2LOAD_CLIENTS);
        let source = format!("http2_{backend}_backend");
        let delta = settle(&poolscope, &service, &before, |delta| {
            delta.losses.get(source.as_str()).copied() == Some(clients)
        })?;
        eprintln!(
            "{backend}: {REQUESTS} h2c requests on {clients} connections: requests_total +{}, \
             HTTP/2 connections +{}, lost {}",
            delta.requests,
            delta.connections,
            delta.lost_sources()
        );
        anyhow::ensure!(
            delta.requests == 0.0 && delta.connections == clients && delta.losses.len() == 1,
            "{backend} backend under h2c: requests_total +{} (expected 0), \
             http2_connections_total +{} (expected {clients}), losses {} (expected {source} \
             +{clients} only)",
            delta.requests,
            delta.connections,
            delta.lost_sources()
        );
    }
    Ok(())
}

/// The HTTP/1.1 `Upgrade: h2c` path: the upgrade request is one HTTP/1.1 request
/// (answered `101`, then on stream 1), and every further request on the connection
/// is a stream, counted exactly. Truth: curl's own answers on one connection. Again
/// with a server that peeks (`MSG_PEEK`) at what is queued before each read: a peek
/// leaves the bytes to the read after it, so its frames count once.
#[test]
fn h2c_upgrade_counts_the_upgrade_and_every_stream() -> anyhow::Result<()> {
    if !privileged("h2c_upgrade_counts_the_upgrade_and_every_stream") {
        return Ok(());
    }
    const REQUESTS: u32 = 20;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in http2_backends("h2c_upgrade_counts_the_upgrade_and_every_stream") {
        for peek in [false, true] {
            let server = UpgradeServer::start(peek)?;
            let reads = if peek { "peek, then read" } else { "read" };
            let service = format!("h2c-upgrade-{backend}");
            let poolscope = watch(backend, &service, &[server.pid()])?;
            let before = Counts::scrape(&poolscope, &service)?;
            let (versions, connections) = curl_upgrade(server.port, REQUESTS)?;
            anyhow::ensure!(
                connections == 1 && versions.iter().all(|v| v == "2"),
                "curl did not upgrade one connection: versions {versions:?}, {connections} \
                 connections"
            );
            let delta = settle_on(&poolscope, &service, &before, u64::from(REQUESTS), 0)?;
            eprintln!(
                "{backend}, server that reads as {reads}: {REQUESTS} requests on one upgraded \
                 connection: requests_total +{}, HTTP/2 connections +{}, resets +{}, lost {}",
                delta.requests,
                delta.connections,
                delta.resets,
                delta.lost_sources()
            );
            Expect {
                what: &format!("{backend}, h2c upgrade, server that reads as {reads}"),
                requests: u64::from(REQUESTS),
                resets: 0,
                connections: Some(1),
            }
            .check(&delta, &mut failures);
            let served = server.finish()?;
            anyhow::ensure!(
                served == u64::from(REQUESTS),
                "the server answered {served} streams, curl {REQUESTS}"
            );
        }
    }
    ensure_none("h2c upgrade", &failures)
}

/// The server's `SETTINGS_MAX_CONCURRENT_STREAMS` against a client's open streams: a
/// gRPC client that keeps 8 calls open on one channel to a server that allows 8 holds
/// its connection at the limit (further calls would queue in the client, where no
/// server-side number sees them); one that keeps 4 open stays under it. Truth: the
/// limit the server was given, and the client's own concurrency (its calls sleep 50
/// ms on 16 workers, so all it keeps open are open at the server).
#[test]
fn streams_against_the_servers_limit() -> anyhow::Result<()> {
    if !privileged("streams_against_the_servers_limit") {
        return Ok(());
    }
    const LIMIT: u32 = 8;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in http2_backends("streams_against_the_servers_limit") {
        for (concurrency, at_limit) in [(LIMIT, 1.0), (LIMIT / 2, 0.0)] {
            let server = GrpcServer::start_with_stream_limit(16, LIMIT)?;
            let service = format!("grpc-limit-{backend}");
            let poolscope = watch(backend, &service, &[server.pid()])?;
            let client =
                GrpcClient::start(server.port, "Sleep", 50, concurrency, Amount::Seconds(3))?;
            std::thread::sleep(RAMP_UP);
            let mut samples = Vec::new();
            let mut announced = f64::NAN;
            for _ in 0..IN_FLIGHT_SAMPLES {
                let started = Instant::now();
                let metrics = poolscope.scrape()?;
                let gauge = |name| metrics.value(name, &[("service", &service)]);
                samples.push(gauge(AT_LIMIT).unwrap_or(f64::NAN));
                announced = gauge("poolscope_http2_max_concurrent_streams").unwrap_or(f64::NAN);
                std::thread::sleep(SAMPLE_EVERY.saturating_sub(started.elapsed()));
            }
            let result = client.finish()?;
            anyhow::ensure!(
                result.failed == 0,
                "the gRPC client's calls failed: {result:?}"
            );
            let share = mean(&samples);
            eprintln!(
                "{backend}: {concurrency} calls open against a limit of {LIMIT}: \
                 max_concurrent_streams {announced}, connections at the limit {share:.2} \
                 (samples {samples:?})"
            );
            if announced != f64::from(LIMIT) {
                failures.push(format!(
                    "{backend}: http2_max_concurrent_streams {announced}, the server announced \
                     {LIMIT}"
                ));
            }
            // A sample may fall between a call's end and the client's next: below the
            // limit for that instant.
            if (share - at_limit).abs() > 0.2 {
                failures.push(format!(
                    "{backend}, {concurrency} open: http2_connections_at_stream_limit {share:.2} \
                     on average, expected {at_limit}"
                ));
            }
        }
    }
    ensure_none("streams against the server's limit", &failures)
}

/// `service`'s route counters (`route_requests_total`, `route_http2_headers_lost_total`)
/// in `metrics`, each as its labels and value.
fn route_counters(metrics: &Metrics, service: &str) -> Vec<String> {
    metrics
        .samples
        .iter()
        .filter(|sample| {
            sample.name.starts_with("poolscope_route_")
                && sample.name.ends_with("_total")
                && sample
                    .labels
                    .iter()
                    .any(|(k, v)| k == "service" && v == service)
        })
        .map(|sample| format!("{:?} {}", sample.labels, sample.value))
        .collect()
}

/// Starts a gRPC server.
type StartGrpc = fn() -> anyhow::Result<GrpcServer>;

/// gRPC routes and statuses: with its target's routes read, every
/// call counts under its method's path, `status_class="2xx"` (its `:status`) and the
/// `grpc_status` of its trailers, decoded from each connection's HPACK tables (grpcio's
/// encoder indexes repeated fields in its dynamic table, so every block after a
/// connection's first depends on the ones before). Truth: the server's count of what
/// each method ran, the clients' count of the statuses they read. A trailers-only
/// answer (Abort's) carries `:status` and `grpc-status` in one block.
#[test]
fn grpc_calls_count_under_their_method_and_status() -> anyhow::Result<()> {
    if !privileged("grpc_calls_count_under_their_method_and_status") {
        return Ok(());
    }
    const SLEEPS: u64 = 300;
    const ABORTS: u64 = 100;
    const SLEEP_MS: u64 = 2;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    let servers: [(&str, StartGrpc, &str); 2] = [
        ("grpcio", || GrpcServer::start(4), "INVALID_ARGUMENT"),
        ("grpc-go", GrpcServer::start_go, "UNAVAILABLE"),
    ];
    for backend in http2_backends("grpc_calls_count_under_their_method_and_status") {
        for (kind, start, failed) in servers {
            let server = start()?;
            let service = format!("{kind}-routes-{backend}");
            let poolscope = watch_with(backend, &service, &[server.pid()], "\nroutes = true\n")?;
            let sleeping =
                GrpcClient::start(server.port, "Sleep", SLEEP_MS, 4, Amount::Calls(SLEEPS))?;
            let aborted = GrpcClient::run(server.port, "Abort", 0, 4, Amount::Calls(ABORTS))?;
            let slept = sleeping.finish()?;
            anyhow::ensure!(
                slept.ok == SLEEPS && aborted.completed == ABORTS && aborted.ok == 0,
                "the clients' calls: {slept:?}, {aborted:?}"
            );
            let route = |metrics: &Metrics, method: &str, status: &str| {
                metrics.value(
                    "poolscope_route_requests_total",
                    &[
                        ("service", service.as_str()),
                        ("route", &format!("/poolscope.Test/{method}")),
                        ("method", "POST"),
                        ("status_class", "2xx"),
                        ("grpc_status", status),
                    ],
                )
            };
            let metrics = scrape_until(&poolscope, |m| {
                route(m, "Sleep", "OK") == Some(SLEEPS as f64)
                    && route(m, "Abort", failed) == Some(ABORTS as f64)
            })
            .unwrap_or_else(|error| {
                failures.push(format!("{kind} on {backend}: {error:#}"));
                Metrics::default()
            });
            let of_service = route_counters(&metrics, &service);
            let served = server.finish()?;
            if (served.sleep, served.abort) != (SLEEPS, ABORTS) {
                failures.push(format!("{kind} on {backend}: the server ran {served:?}"));
            }
            eprintln!(
                "{kind} on {backend}: server ran Sleep {} and Abort {}; clients read OK {} and \
             {failed} {}; poolscope: {of_service:#?}",
                served.sleep, served.abort, slept.ok, aborted.completed
            );
            // Nothing else: no unknown route, no other status, no header table lost.
            if of_service.len() != 2 {
                failures.push(format!(
                    "{backend}: route series other than the two: {of_service:#?}"
                ));
            }
            let labels = [
                ("service", service.as_str()),
                ("route", "/poolscope.Test/Sleep"),
                ("method", "POST"),
            ];
            let mean = metrics.histogram_mean("poolscope_route_request_duration_seconds", &labels);
            eprintln!(
                "{kind} on {backend}: Sleep's mean duration {mean:?} s (the handler sleeps {SLEEP_MS} ms)"
            );
            if !mean.is_some_and(|mean| (SLEEP_MS as f64 / 1000.0..0.02).contains(&mean)) {
                failures.push(format!(
                    "{kind} on {backend}: Sleep's mean duration {mean:?}"
                ));
            }
        }
    }
    anyhow::ensure!(failures.is_empty(), "{failures:#?}");
    Ok(())
}

/// Routes of a plain HTTP/2 server (no Python: the guests run it too, on the tcp
/// backend's fexit programs in 6.1): with the target's routes read, each stream counts
/// under its `:method` and `:path` and its `:status`'s class, from blocks in HPACK's
/// static table and a literal; exactly the streams both sides answered.
#[test]
fn plain_server_streams_count_under_their_route() -> anyhow::Result<()> {
    if !privileged("plain_server_streams_count_under_their_route") {
        return Ok(());
    }
    const CONNECTIONS: u32 = 2;
    const OPEN: u32 = 4;
    const PER_CONNECTION: u32 = 40;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in http2_backends("plain_server_streams_count_under_their_route") {
        let server = PlainH2Server::start(Duration::from_millis(5))?;
        let service = format!("h2server-routes-{backend}");
        let poolscope = watch_with(backend, &service, &[server.pid()], "\nroutes = true\n")?;
        let (answered, ()) =
            plain_streams(server.port(), CONNECTIONS, OPEN, PER_CONNECTION, || ())?;
        let labels = [
            ("service", service.as_str()),
            ("route", "/"),
            ("method", "GET"),
            ("status_class", "2xx"),
        ];
        let counted = scrape_until(&poolscope, |m| {
            m.value("poolscope_route_requests_total", &labels) == Some(answered as f64)
        })
        .map(|m| route_counters(&m, &service).len());
        let served = server.finish()?;
        eprintln!(
            "{backend}: client answered {answered}, server answered {}: route series {counted:?}",
            served.answered
        );
        match counted {
            Ok(1) if served.answered == answered => {}
            other => failures.push(format!(
                "{backend}: {answered} answered (server {}), route series: {other:?}",
                served.answered
            )),
        }
    }
    anyhow::ensure!(failures.is_empty(), "{failures:#?}");
    Ok(())
}

/// HTTP/2 routes and statuses from nginx under h2load (nghttp2's encoder: Huffman
/// strings, fields indexed in each connection's dynamic table): each client asks in
/// turn for `/` (200), `/fail` (500) and `/missing/7` (404), 10 streams open at once;
/// each route counts exactly h2load's responses of its class.
#[test]
fn nginx_h2c_streams_count_under_their_route_and_status() -> anyhow::Result<()> {
    if !privileged("nginx_h2c_streams_count_under_their_route_and_status") {
        return Ok(());
    }
    const REQUESTS: u64 = 600;
    let _serial = one_at_a_time();
    let mut failures = Vec::new();
    for backend in http2_backends("nginx_h2c_streams_count_under_their_route_and_status") {
        let server = RealServer::start(Kind::NginxH2c, free_port()?)?;
        let service = format!("nginx-h2c-routes-{backend}");
        let poolscope = watch_with(backend, &service, &server.pids(), "\nroutes = true\n")?;
        let load = h2load_paths(
            server.port(),
            &["/", "/fail", "/missing/7"],
            REQUESTS,
            2,
            10,
        )?;
        let truth = [
            ("/", "2xx", load.status_2xx),
            ("/fail", "5xx", load.status_5xx),
            ("/missing/:id", "4xx", load.status_4xx),
        ];
        let counted = |m: &Metrics, route: &str, class: &str| {
            m.value(
                "poolscope_route_requests_total",
                &[
                    ("service", service.as_str()),
                    ("route", route),
                    ("method", "GET"),
                    ("status_class", class),
                ],
            )
            .unwrap_or(0.0)
        };
        let metrics = scrape_until(&poolscope, |m| {
            truth
                .iter()
                .all(|&(route, class, count)| counted(m, route, class) == count as f64)
        });
        let metrics = match metrics {
            Ok(metrics) => metrics,
            Err(error) => {
                failures.push(format!("{backend}: {error:#}"));
                poolscope.scrape()?
            }
        };
        for (route, class, count) in truth {
            eprintln!(
                "{backend}: {route} {class}: h2load {count}, poolscope {}",
                counted(&metrics, route, class)
            );
        }
        let succeeded = load.status_2xx + load.status_4xx + load.status_5xx;
        if succeeded != REQUESTS || truth.iter().any(|&(_, _, count)| count != REQUESTS / 3) {
            failures.push(format!("{backend}: h2load {load:?}"));
        }
    }
    anyhow::ensure!(failures.is_empty(), "{failures:#?}");
    Ok(())
}
