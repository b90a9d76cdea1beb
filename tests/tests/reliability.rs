//! poolscope under hostile input: many scrapers at once are each answered or refused
//! cleanly, the refusals counted exactly, memory bounded; process and thread names
//! with quotes, backslashes, braces, newlines and invalid UTF-8 make valid exposition.
use std::{
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use poolscope_tests::{
    PoolServer, Poolscope, Program, backend_config,
    load::{ClosedLoop, Connections},
    one_at_a_time, privileged,
    profiles::http_get,
    rss_kb, scrape_until,
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
    // Within 256 MiB over the storm. Not yet flat: RSS still grows ~2.5 MB/s through
    // the storm (issue 8's soak is to find why); the curve is printed above.
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
