//! Unwind tables age out, least recently used first, so that modules loaded after
//! `stacks.unwind_memory_bytes` filled are still unwound. Against the real kernel:
//! `SPINNER` (below), built without frame pointers, spins on CPU in
//! `spin_in_named_function`, called by `caller_named_function`; a frame-pointer walk
//! from the spin cannot name that caller, only an unwind by the binary's own tables.
//! `COPIES` copies of it (distinct files, so distinct modules with identical
//! tables) run one after another, each a service of its own, with the limit set
//! from the tables' sizes (`readelf`) to hold glibc's, the loader's and
//! `ROOM_FOR` spinners' tables. For each copy: its stacks are unwound (the
//! `unwound` count rises, `over_memory_limit` never), its on-CPU stacks under the
//! spin name the caller, and the tables held stay within the limit; in all, every
//! copy beyond the first `ROOM_FOR` evicts exactly one spinner's tables, and what
//! is held at the end is exactly the sum `readelf` gives.
//!
//! The numbers go to stdout (`--nocapture`).
use std::{collections::BTreeSet, path::Path, process::Command, time::Duration};

use anyhow::Context as _;
use poolscope_tests::{
    Metrics, Poolscope, Program,
    downstream::compile_c,
    one_at_a_time, privileged,
    profiles::{http_get, names, parse_folded, snapshots_covering, unix_now, weight_of},
    scrape_until,
};

/// Spins in a named function, called by another, until a line on stdin; then waits
/// for stdin to close. Both functions are kept out of line, and the caller does
/// something after the call so that it is no tail call (its frame stays).
const SPINNER: &str = r#"
#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

static volatile int stop;

__attribute__((noinline)) void spin_in_named_function(void) {
    volatile unsigned long spins = 0;
    while (!stop)
        spins++;
}

__attribute__((noinline)) void *caller_named_function(void *arg) {
    spin_in_named_function();
    __asm__ volatile("" ::: "memory");
    return arg;
}

int main(void) {
    pthread_t spinner;
    char line[64];
    if (pthread_create(&spinner, NULL, caller_named_function, NULL) != 0)
        return 1;
    printf("ready\n");
    fflush(stdout);
    if (fgets(line, sizeof line, stdin) == NULL)
        return 1;
    stop = 1;
    pthread_join(spinner, NULL);
    printf("stopped\n");
    fflush(stdout);
    while (fgets(line, sizeof line, stdin) != NULL) {
    }
    return 0;
}
"#;

/// Spinners run one after another.
const COPIES: usize = 8;
/// The limit holds this many spinners' tables beside glibc's and the loader's: half
/// a spinner's more, so that a third never fits.
const ROOM_FOR: u64 = 2;
const INTERVAL: Duration = Duration::from_secs(1);
const SAMPLING_HZ: u32 = 99;
/// The sections `Tables::read` keeps (exporter/src/stacks/unwind.rs).
const TABLE_SECTIONS: [&str; 3] = [".eh_frame", ".eh_frame_hdr", ".debug_frame"];

/// Bytes of unwind tables of the ELF file at `path`, as poolscope counts them: the
/// sizes `readelf -SW` gives its table sections.
fn table_bytes(path: &Path) -> anyhow::Result<u64> {
    let output = Command::new("readelf")
        .arg("-SW")
        .arg(path)
        .output()
        .context("running readelf")?;
    anyhow::ensure!(output.status.success(), "readelf {} failed", path.display());
    let mut bytes = 0;
    // `  [17] .eh_frame_hdr PROGBITS 0000000000002010 002010 00003c ...`
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let Some((_, rest)) = line.split_once(']') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if let [name, _kind, _address, _offset, size, ..] = fields[..]
            && TABLE_SECTIONS.contains(&name)
        {
            bytes += u64::from_str_radix(size, 16)
                .with_context(|| format!("section size in {line:?}"))?;
        }
    }
    Ok(bytes)
}

/// The ELF files a running spinner maps besides its own binary (glibc, the loader).
fn libraries(pid: u32, binary: &Path) -> anyhow::Result<BTreeSet<String>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    Ok(maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| path.starts_with('/') && Path::new(path) != binary)
        .map(str::to_owned)
        .collect())
}

fn service(index: usize) -> String {
    format!("evict-{index}")
}

fn config(limit: u64) -> String {
    let mut config = format!(
        "[probes]\nsampling_hz = {SAMPLING_HZ}\n[stacks]\ninterval = \"{}s\"\nkeep = 15\n\
         unwind_memory_bytes = {limit}\n",
        INTERVAL.as_secs()
    );
    for index in 0..COPIES {
        config.push_str(&format!(
            "[[targets]]\nservice = \"{}\"\nexe = \"/{}$\"\n",
            service(index),
            service(index)
        ));
    }
    config
}

fn unwinds(metrics: &Metrics, result: &str) -> f64 {
    metrics
        .value("poolscope_stack_unwinds_total", &[("result", result)])
        .unwrap_or(0.0)
}

fn gauge(metrics: &Metrics, name: &str) -> f64 {
    metrics.value(name, &[]).unwrap_or(0.0)
}

#[test]
fn modules_loaded_after_the_unwind_limit_filled_are_unwound() -> anyhow::Result<()> {
    if !privileged("modules_loaded_after_the_unwind_limit_filled_are_unwound") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let dir = tempfile::tempdir()?;
    let source = dir.path().join("spinner.c");
    std::fs::write(&source, SPINNER)?;
    let built = dir.path().join("spinner");
    compile_c(&source, &built, &["-fomit-frame-pointer"])?;

    // The limit, from the tables a spinner's process maps.
    let spinner_bytes = table_bytes(&built)?;
    let mut probe = Program::start_path(&built, &[])?;
    probe.line("ready")?;
    let mut library_bytes = 0;
    for library in libraries(probe.pid(), &built)? {
        library_bytes += table_bytes(Path::new(&library))?;
    }
    drop(probe);
    let limit = library_bytes + ROOM_FOR * spinner_bytes + spinner_bytes / 2;
    println!(
        "tables: spinner {spinner_bytes} bytes, glibc and loader {library_bytes}; \
         limit {limit}"
    );
    anyhow::ensure!(spinner_bytes > 0, "the spinner has no unwind tables");

    let copies: Vec<_> = (0..COPIES)
        .map(|index| {
            let copy = dir.path().join(service(index));
            std::fs::copy(&built, &copy).map(|_| copy)
        })
        .collect::<Result<_, _>>()?;
    let poolscope = Poolscope::start(&config(limit))?;
    let mut last = poolscope.scrape()?;
    for (index, copy) in copies.iter().enumerate() {
        let started = unix_now();
        let mut spinner = Program::start_path(copy, &[])?;
        spinner.line("ready")?;
        let before = last;
        // Its stacks unwound (by its own tables: the spin is innermost).
        scrape_until(&poolscope, |m| {
            unwinds(m, "unwound") > unwinds(&before, "unwound")
        })?;
        spinner.send("stop")?;
        spinner.line("stopped")?;
        let stopped = unix_now();
        // Every stack of its run drained while it still runs (none `process_gone`).
        let listed = snapshots_covering(&poolscope, started, stopped, INTERVAL)?;
        let mut lines = Vec::new();
        for id in listed.iter().filter_map(|s| s["id"].as_u64()) {
            let path = format!("/debug/stacks/cpu?service={}&snapshot={id}", service(index));
            lines.extend(parse_folded(
                &http_get(poolscope.port, &path)?.text(&path)?,
            )?);
        }
        drop(spinner);
        let spins = weight_of(&lines, |frames| names(frames, "spin_in_named_function"));
        let named = weight_of(&lines, |frames| {
            names(frames, "spin_in_named_function") && names(frames, "caller_named_function")
        });
        last = poolscope.scrape()?;
        let held = gauge(&last, "poolscope_unwind_tables_bytes");
        let evicted = gauge(&last, "poolscope_unwind_tables_evicted_total");
        println!(
            "{}: unwound +{}, over_memory_limit +{}, process_gone +{}; {named} of {spins} \
             spin samples name the caller; {held} bytes held, {evicted} evicted",
            service(index),
            unwinds(&last, "unwound") - unwinds(&before, "unwound"),
            unwinds(&last, "over_memory_limit") - unwinds(&before, "over_memory_limit"),
            unwinds(&last, "process_gone") - unwinds(&before, "process_gone"),
        );
        anyhow::ensure!(
            unwinds(&last, "over_memory_limit") == 0.0,
            "{}: a module stayed over the limit",
            service(index)
        );
        anyhow::ensure!(
            spins > 0 && named == spins,
            "{}: {named} of {spins} spin samples name caller_named_function",
            service(index)
        );
        anyhow::ensure!(held <= limit as f64, "{held} bytes held past {limit}");
    }
    // Each spinner past the first ROOM_FOR evicted exactly one spinner's tables (the
    // least recently used: glibc's and the loader's are used by every spinner).
    let evicted = gauge(&last, "poolscope_unwind_tables_evicted_total");
    let held = gauge(&last, "poolscope_unwind_tables_bytes");
    let expected_held = library_bytes + ROOM_FOR * spinner_bytes;
    println!(
        "in all: {evicted} evicted, {held} bytes held (readelf: {expected_held}), \
         over_memory_limit {}",
        unwinds(&last, "over_memory_limit")
    );
    anyhow::ensure!(
        evicted == (COPIES as u64 - ROOM_FOR) as f64,
        "{evicted} tables evicted, not {}",
        COPIES as u64 - ROOM_FOR
    );
    anyhow::ensure!(
        held == expected_held as f64,
        "{held} bytes of tables held, not {expected_held}"
    );
    Ok(())
}
