//! io_uring against the request backends. `tests/iouring/iouring_server.c` is an
//! HTTP/1.1 keep-alive server whose every accept, read, write and close goes through
//! one io_uring (no read/write/recv/send syscall touches a client socket); it serves
//! at most N requests at once for S each, driven by C > N closed-loop HTTP clients
//! (`load::ClosedLoop::start_http`). The truth is requests.rs's: in steady state N
//! requests are read and unanswered, C − N arrived and unread, each waits C·S/N − S,
//! and the clients and the server count and time every request themselves.
//!
//! The socket and tcp backends hook the socket layer under io_uring
//! (`sock_recv_length`/`sock_send_length`, `tcp_rcv_space_adjust`/`net_dev_queue`) and
//! must see it all, with each pair of ops: RECV/SEND and READ/WRITE. The syscall
//! backend hooks syscalls that io_uring does not make (it submits through
//! `io_uring_enter`), so it must count nothing at all: docs/limits.md says so.
use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Context as _;
use poolscope_tests::{
    Metrics, Poolscope, Program, Served, backend_config, backends,
    downstream::compile_c,
    load::ClosedLoop,
    one_at_a_time, privileged, requests_settled, scorecard, scrape_until, skip,
    steady::{self, SAMPLE_EVERY, Steady, assert_within, value},
};

const SLOTS: u32 = 4;
const CLIENTS: usize = 12;
const SERVICE: Duration = Duration::from_millis(20);
const WARM_UP: Duration = Duration::from_secs(1);
const STEADY: Duration = Duration::from_secs(4);

/// Builds the server into `dir`.
fn build(dir: &Path) -> anyhow::Result<PathBuf> {
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("iouring/iouring_server.c");
    let binary = dir.join("iouring_server");
    compile_c(&source, &binary, &["-luring"]).context("are gcc and liburing-dev installed?")?;
    Ok(binary)
}

/// A running iouring_server with `SLOTS` slots of `SERVICE`; `ops` is `recv` (RECV
/// and SEND) or `read` (READ and WRITE).
struct UringServer {
    program: Program,
    port: u16,
}

impl UringServer {
    fn start(binary: &Path, ops: &str) -> anyhow::Result<Self> {
        let args = [
            SLOTS.to_string(),
            SERVICE.as_micros().to_string(),
            ops.to_owned(),
        ];
        let mut program = Program::start_path(binary, &args)?;
        let port = program
            .line("port")
            .context(
                "iouring_server did not start (is io_uring enabled: kernel.io_uring_disabled?)",
            )?
            .parse()?;
        Ok(Self { program, port })
    }

    /// Stops serving; the server's own count and service times.
    fn finish(mut self) -> anyhow::Result<Served> {
        let line = self.program.finish("served")?;
        let numbers: Vec<u64> = line
            .split(' ')
            .map(str::parse)
            .collect::<Result<_, _>>()
            .with_context(|| format!("iouring_server said {line:?}"))?;
        let [count, mean, p50] = numbers[..] else {
            anyhow::bail!("iouring_server said {line:?}");
        };
        Ok(Served {
            count,
            mean: Duration::from_nanos(mean),
            p50: Duration::from_nanos(p50),
        })
    }
}

/// Whether `backend` is one this run tests; a skip of `test` otherwise (a failure
/// under CI=true).
fn wanted(test: &str, backend: &str) -> bool {
    if !privileged(test) {
        return false;
    }
    let wanted = backends().contains(&backend);
    if !wanted {
        skip(
            test,
            &format!(
                "the {backend} backend is not tested here (kernel or POOLSCOPE_TEST_BACKENDS)"
            ),
        );
    }
    wanted
}

/// The saturated server under `backend`: what poolscope measured and what the
/// clients and the server saw.
fn saturate(backend: &str, ops: &str) -> anyhow::Result<(Steady, Metrics, u64, Served)> {
    let dir = tempfile::tempdir()?;
    let server = UringServer::start(&build(dir.path())?, ops)?;
    let service = format!("iouring-{ops}-{backend}");
    let poolscope = Poolscope::start(&backend_config(backend, &service, &[server.program.pid()]))?;
    scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", &service)]) == Some(1.0)
            && m.has_label("backend", backend)
    })?;
    let clients = ClosedLoop::start_http(server.port, CLIENTS);
    std::thread::sleep(WARM_UP);
    let steady = steady::measure(&poolscope, &service, STEADY, SAMPLE_EVERY)?;
    let completed = clients.stop()?.completed;
    // The syscall backend counts nothing, so its count cannot settle: one scrape after
    // the load, once every request has been answered, is its final word.
    let last = if backend == "syscall" {
        poolscope.scrape()?
    } else {
        scrape_until(&poolscope, |m| requests_settled(m, &service, completed))
            .with_context(|| format!("{service}: {completed} requests made"))?
    };
    let served = server.finish()?;
    eprintln!(
        "{backend} {ops}: clients completed {completed}, server served {}, \
         poolscope counted {}",
        served.count,
        value(&last, "poolscope_requests_total", &service)
    );
    anyhow::ensure!(served.count == completed, "server and clients disagree");
    Ok((steady, last, completed, served))
}

/// Socket and tcp backends: every request counted, and the gauges and times of a
/// pool of `SLOTS` with `CLIENTS` clients.
fn seen_whole(backend: &str, ops: &str) -> anyhow::Result<()> {
    let _serial = one_at_a_time();
    let (steady, last, completed, served) = saturate(backend, ops)?;
    let service = format!("iouring-{ops}-{backend}");
    assert_eq!(
        value(&last, "poolscope_requests_total", &service),
        completed as f64,
        "requests_total against the clients' count"
    );
    scorecard::exact(
        "requests_total",
        "the clients' count of answered requests",
        backend,
        value(&last, "poolscope_requests_total", &service),
        completed as f64,
    );
    let service_time = served.mean.as_secs_f64();
    assert_within(
        "mean duration",
        steady.duration_sum / steady.requests,
        service_time,
        0.05,
    );
    scorecard::within(
        "mean request duration",
        "the server's own mean time in service",
        backend,
        steady.duration_sum / steady.requests,
        service_time,
        0.05,
    );
    let (clients, slots) = (CLIENTS as f64, f64::from(SLOTS));
    // In flight: N while the server's one thread runs, fewer while it is preempted
    // between its responses and its next reads (measured on this 2-CPU host with
    // other poolscope processes busy: samples of 0 in flight and 12 queued). The truth
    // is then the server's own time in service over the window, by Little's law.
    let served_in_flight = steady.requests * service_time / steady.seconds;
    eprintln!("server's own mean in service: {served_in_flight:.3} (of {slots} slots)");
    assert_within("mean in flight", steady.in_flight, served_in_flight, 0.05);
    scorecard::within(
        "requests_in_flight, mean while saturated",
        "the server's own time in service over the window (Little's law)",
        backend,
        steady.in_flight,
        served_in_flight,
        0.05,
    );
    assert_within(
        "mean queue depth",
        steady.queue_depth,
        clients - slots,
        0.10,
    );
    scorecard::within(
        "queue_depth, mean while saturated",
        "C − N = 12 − 4 clients waiting",
        backend,
        steady.queue_depth,
        clients - slots,
        0.10,
    );
    assert_within(
        "mean queue time",
        steady.queue_sum / steady.requests,
        clients * service_time / slots - service_time,
        0.10,
    );
    scorecard::within(
        "mean request queue time",
        "C·S/N − S with S the server's own mean time in service",
        backend,
        steady.queue_sum / steady.requests,
        clients * service_time / slots - service_time,
        0.10,
    );
    Ok(())
}

/// Syscall backend: io_uring makes none of the syscalls it follows, so the service
/// shows no request, none in flight and none queued, however many were served.
fn seen_nothing(ops: &str) -> anyhow::Result<()> {
    let _serial = one_at_a_time();
    let (steady, last, completed, _) = saturate("syscall", ops)?;
    let service = format!("iouring-{ops}-syscall");
    anyhow::ensure!(completed > 0, "the clients completed no request");
    eprintln!(
        "syscall {ops}: mean in flight {}, mean queue depth {}",
        steady.in_flight, steady.queue_depth
    );
    assert_eq!(value(&last, "poolscope_requests_total", &service), 0.0);
    assert_eq!(steady.in_flight, 0.0, "requests_in_flight under load");
    assert_eq!(steady.queue_depth, 0.0, "queue_depth under load");
    scorecard::exact(
        "requests_total, syscall backend",
        "0: io_uring makes none of the syscalls the backend follows (docs/limits.md)",
        "syscall",
        value(&last, "poolscope_requests_total", &service),
        0.0,
    );
    Ok(())
}

#[test]
fn io_uring_recv_send_socket_backend() -> anyhow::Result<()> {
    if !wanted("io_uring_recv_send_socket_backend", "socket") {
        return Ok(());
    }
    seen_whole("socket", "recv")
}

#[test]
fn io_uring_read_write_socket_backend() -> anyhow::Result<()> {
    if !wanted("io_uring_read_write_socket_backend", "socket") {
        return Ok(());
    }
    seen_whole("socket", "read")
}

#[test]
fn io_uring_recv_send_tcp_backend() -> anyhow::Result<()> {
    if !wanted("io_uring_recv_send_tcp_backend", "tcp") {
        return Ok(());
    }
    seen_whole("tcp", "recv")
}

#[test]
fn io_uring_read_write_tcp_backend() -> anyhow::Result<()> {
    if !wanted("io_uring_read_write_tcp_backend", "tcp") {
        return Ok(());
    }
    seen_whole("tcp", "read")
}

#[test]
fn io_uring_is_invisible_to_the_syscall_backend() -> anyhow::Result<()> {
    if !wanted("io_uring_is_invisible_to_the_syscall_backend", "syscall") {
        return Ok(());
    }
    seen_nothing("recv")?;
    seen_nothing("read")
}
