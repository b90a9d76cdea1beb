//! poolscope under hostile input: many scrapers at once are each answered or refused
//! cleanly, the refusals counted exactly, memory bounded; process and thread names
//! with quotes, backslashes, braces, newlines and invalid UTF-8 make valid exposition;
//! a server in a pid namespace of its own is measured, and a procfs of another pid
//! namespace than the host's is refused with how to run poolscope; processes whose
//! fds poolscope may not follow are counted, with the capability to give.
use std::{
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use poolscope_tests::{
    PoolServer, Poolscope, Program, backend_config, backends,
    load::{ClosedLoop, Connections},
    one_at_a_time, privileged,
    profiles::http_get,
    requests_settled, rss_kb, scorecard, scrape_until,
};

/// What the scrapers got back.
#[derive(Debug, Default)]
struct Answers {
    served: u64,
    refused_concurrency: u64,
    refused_timeout: u64,
    /// Anything else: the first few, whole.
    other: Vec<String>,
    other_count: u64,
}

#[test]
fn a_hundred_concurrent_scrapers_are_answered_or_refused_cleanly() -> anyhow::Result<()> {
    if !privileged("a_hundred_concurrent_scrapers_are_answered_or_refused_cleanly") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    const SCRAPERS: usize = 100;
    const STORM: Duration = Duration::from_secs(30);
    // A watched pool under load, so that each scrape reads real kernel state.
    let server = PoolServer::start(4, Duration::from_millis(5))?;
    let service = "scraped";
    let poolscope = Poolscope::start(&backend_config("auto", service, &[server.pid()]))?;
    scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", service)]) == Some(1.0)
    })?;
    let clients = ClosedLoop::start(server.port, 8, Connections::KeepAlive);
    thread::sleep(Duration::from_secs(1));
    let rss_before = rss_kb(poolscope.pid())?;

    let answers = Arc::new(Mutex::new(Answers::default()));
    let started = Instant::now();
    let port = poolscope.port;
    let scrapers: Vec<_> = (0..SCRAPERS)
        .map(|_| {
            let answers = answers.clone();
            thread::spawn(move || {
                while started.elapsed() < STORM {
                    let outcome = http_get(port, "/metrics");
                    let mut answers = answers.lock().unwrap_or_else(|e| e.into_inner());
                    match outcome {
                        Ok(response) => {
                            let body = String::from_utf8_lossy(&response.body);
                            match response.status {
                                200 if body.contains("poolscope_build_info{")
                                    && body.ends_with('\n') =>
                                {
                                    answers.served += 1;
                                }
                                503 if body.starts_with("too many scrapes at once") => {
                                    answers.refused_concurrency += 1;
                                }
                                503 if body.starts_with("scrape not finished") => {
                                    answers.refused_timeout += 1;
                                }
                                status => {
                                    answers.other_count += 1;
                                    if answers.other.len() < 3 {
                                        answers.other.push(format!("{status}: {body}"));
                                    }
                                }
                            }
                        }
                        Err(error) => {
                            answers.other_count += 1;
                            if answers.other.len() < 3 {
                                answers.other.push(format!("{error:#}"));
                            }
                        }
                    }
                }
            })
        })
        .collect();
    let mut rss = Vec::new();
    while started.elapsed() < STORM {
        rss.push(rss_kb(poolscope.pid())?);
        thread::sleep(Duration::from_millis(500));
    }
    let rss_max = rss.iter().copied().max().unwrap_or(rss_before);
    for scraper in scrapers {
        scraper
            .join()
            .map_err(|_| anyhow::anyhow!("a scraper panicked"))?;
    }
    let seen = clients.stop()?;
    server.finish()?;
    let answers = answers.lock().unwrap_or_else(|e| e.into_inner());
    let metrics = poolscope.scrape()?;
    let counted = |reason| {
        metrics
            .value("poolscope_scrapes_refused_total", &[("reason", reason)])
            .unwrap_or(f64::NAN)
    };
    eprintln!(
        "{SCRAPERS} scrapers for {} s: {answers:?}; poolscope counted {} concurrency and {} \
         timeout refusals; RSS {rss_before} kB before, then every 0.5 s: {rss:?}; the pool \
         served {} requests meanwhile",
        STORM.as_secs(),
        counted("concurrency"),
        counted("timeout"),
        seen.completed
    );
    assert_eq!(
        answers.other_count, 0,
        "answers neither served nor refused: {:?}",
        answers.other
    );
    assert!(answers.served > 0, "no scrape was served");
    // 100 scrapers against the default 4 at once: some must be turned away, each one
    // counted by poolscope.
    assert!(answers.refused_concurrency > 0, "none refused: {answers:?}");
    assert_eq!(counted("concurrency"), answers.refused_concurrency as f64);
    assert_eq!(counted("timeout"), answers.refused_timeout as f64);
    // Within 256 MiB over the storm: RSS climbs while the allocator warms up to the
    // storm's high-water mark, then stays flat (docs/limits.md); the curve is printed
    // above.
    assert!(
        rss_max < 256 * 1024,
        "RSS grew from {rss_before} kB to {rss_max} kB: {rss:?}"
    );
    Ok(())
}

/// A label value as the exposition format writes it.
fn escaped(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[test]
fn hostile_names_make_valid_exposition() -> anyhow::Result<()> {
    if !privileged("hostile_names_make_valid_exposition") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let mut program = Program::start("hostile", &["2".to_owned()])?;
    program.line("port")?;
    program.line("workers")?;
    // The names `hostile` gives itself and its workers (src/bin/hostile.rs), with
    // the invalid byte decoded as U+FFFD; the pool is the workers' name less `-N`.
    let service = escaped("q\"b\\{}\n\u{FFFD}");
    let pool = escaped("w\"\\{x}\n\u{FFFD}");
    let poolscope = Poolscope::start(&format!("[[targets]]\npids = [{}]\n", program.pid()))?;
    let series = format!("poolscope_pool_threads{{service=\"{service}\",pool=\"{pool}\"}} 2");
    let metrics = scrape_until(&poolscope, |m| m.text.lines().any(|line| line == series))?;
    assert!(
        metrics
            .text
            .contains(&format!("poolscope_targets{{service=\"{service}\"}} 1\n")),
        "{}",
        metrics.text
    );
    poolscope_tests::prometheus::check_metrics(&metrics.text)?;
    eprintln!(
        "hostile names: service=\"{service}\", pool=\"{pool}\"; promtool check metrics passes"
    );
    Ok(())
}

/// A server in a pid namespace of its own, as in a container: poolscope watches it by
/// the pid the host gives it, which the kernel probes report, and counts exactly the
/// requests it served.
#[test]
fn a_server_in_its_own_pid_namespace_is_counted_exactly() -> anyhow::Result<()> {
    if !privileged("a_server_in_its_own_pid_namespace_is_counted_exactly") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    for backend in backends() {
        let server = PoolServer::start_wrapped(
            &["unshare", "--pid", "--fork", "--kill-child"],
            2,
            Duration::from_millis(2),
        )?;
        let namespace = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/pid"));
        assert_ne!(
            namespace(&server.pid().to_string())?,
            namespace("self")?,
            "the server shares the test's pid namespace"
        );
        let service = "contained";
        let poolscope = Poolscope::start(&backend_config(backend, service, &[server.pid()]))?;
        scrape_until(&poolscope, |m| {
            m.value("poolscope_targets", &[("service", service)]) == Some(1.0)
        })?;
        let clients = ClosedLoop::start(server.port, 2, Connections::KeepAlive);
        thread::sleep(Duration::from_secs(2));
        let made = clients.stop()?.completed;
        let metrics = scrape_until(&poolscope, |m| requests_settled(m, service, made))?;
        let counted = metrics
            .value("poolscope_requests_total", &[("service", service)])
            .unwrap_or(0.0);
        let served = server.finish()?;
        eprintln!(
            "{backend}: server in its own pid namespace: counted {counted}, made {made}, served {}",
            served.count
        );
        assert!(made > 0);
        assert_eq!((counted, made), (served.count as f64, served.count));
        scorecard::exact(
            "requests_total of a server in its own pid namespace",
            "the clients' count of answered requests",
            backend,
            counted,
            made as f64,
        );
    }
    Ok(())
}

/// poolscope reading the procfs of a pid namespace other than the host's would match
/// none of the kernel's pids: it refuses to start and says how to run it.
#[test]
fn a_procfs_of_another_pid_namespace_is_refused_at_start() -> anyhow::Result<()> {
    if !privileged("a_procfs_of_another_pid_namespace_is_refused_at_start") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    // unshare's child, poolscope, is pid 1 of the new namespace and of its /proc.
    let wrapper = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"].map(String::from);
    let Err(error) = Poolscope::start_wrapped("", &wrapper) else {
        anyhow::bail!("poolscope served from another pid namespace's procfs");
    };
    let error = format!("{error:#}");
    assert!(
        error.contains("/proc lists the processes of pid namespace")
            && error.contains("hostPID: true"),
        "{error}"
    );
    Ok(())
}

/// Without CAP_SYS_PTRACE, poolscope may not follow the fds of another user's
/// process: that process's listening sockets are unknown, so a port target cannot
/// find it. poolscope counts it in `processes_unreadable` and logs the capability to
/// give; with the capability the same target is found.
#[test]
fn processes_whose_fds_cannot_be_read_are_counted_and_logged() -> anyhow::Result<()> {
    if !privileged("processes_whose_fds_cannot_be_read_are_counted_and_logged") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let server = PoolServer::start_wrapped(
        &[
            "setpriv",
            "--reuid=nobody",
            "--regid=nogroup",
            "--clear-groups",
        ],
        1,
        Duration::from_millis(1),
    )?;
    let service = "by-port";
    let config = format!(
        "[[targets]]\nservice = \"{service}\"\nport = [{}]\n",
        server.port
    );
    let watched = [("service", service)];
    let unreadable = |m: &poolscope_tests::Metrics| {
        m.value("poolscope_processes_unreadable", &[])
            .unwrap_or(-1.0)
    };

    // Some hosts have processes even root may not follow (a sandbox's init): the
    // baseline, with every capability.
    let mut poolscope = Poolscope::start(&config)?;
    let metrics = scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &watched) == Some(1.0)
    })?;
    let baseline = unreadable(&metrics);
    assert!(baseline >= 0.0, "no poolscope_processes_unreadable");
    let log = poolscope.stop_and_log();
    assert!(
        !log.contains(&format!("{} (poolserver)", server.pid())),
        "the server was reported unreadable with every capability:\n{log}"
    );

    let without_ptrace = [
        "setpriv",
        "--bounding-set=-sys_ptrace",
        "--inh-caps=-sys_ptrace",
    ]
    .map(String::from);
    let mut poolscope = Poolscope::start_wrapped(&config, &without_ptrace)?;
    let metrics = scrape_until(&poolscope, |m| unreadable(m) > baseline)?;
    assert_ne!(metrics.value("poolscope_targets", &watched), Some(1.0));
    let log = poolscope.stop_and_log();
    let warning = log
        .lines()
        .find(|line| line.contains("cannot follow the open files"))
        .unwrap_or_default();
    // The warning names the first few processes only: without CAP_SYS_PTRACE, root's
    // processes with more capabilities than poolscope are closed to it too.
    assert!(warning.contains("CAP_SYS_PTRACE"), "{log}");
    eprintln!(
        "processes unreadable: {baseline} with every capability, {} without CAP_SYS_PTRACE; {warning}",
        unreadable(&metrics)
    );
    Ok(())
}
