//! The accuracy scorecard, docs/accuracy.md: `cargo xtask scorecard` runs the test
//! binaries that record comparisons (those of tests/tests/ that call `scorecard::`),
//! with `POOLSCOPE_SCORECARD_LOG` naming target/scorecard.log, and renders the page
//! from that log, one row per quantity (tests/src/scorecard.rs writes the lines:
//! kernel, binary, test, backend, quantity, truth, tolerance, ours, truth's value,
//! deviation, unit). `cargo xtask scorecard --from-log` renders the log a `cargo xtask
//! test` left, without running anything. A quantity a test's source records but the
//! log lacks (its test failed before the check, or did not run) is listed last as not
//! measured. `cargo xtask vm-test` adds its guests' comparisons to the log when one is
//! being written (under `cargo xtask test`), their kernels marked [`GUEST`]. The page
//! is generated only: tests/tests/docs.rs checks that it names exactly the quantities
//! the tests record.
use std::{
    fs,
    io::{ErrorKind, Write as _},
    path::Path,
};

use anyhow::{Context as _, bail};

/// The environment variable the tests read the log's path from.
pub const ENV: &str = "POOLSCOPE_SCORECARD_LOG";
/// The log, under the workspace.
pub const LOG: &str = "target/scorecard.log";
/// The page, under the workspace.
pub const PAGE: &str = "docs/accuracy.md";
/// What writes the page, as its header says.
const COMMAND: &str = "cargo xtask scorecard";

/// How a `cargo xtask vm-test` guest's kernel is marked in the log.
const GUEST: &str = " guest";

/// Adds the comparisons a `cargo xtask vm-test` guest wrote to `guest_log` to the log
/// the host's tests are writing (`ENV`), if any, each kernel marked [`GUEST`]. A guest
/// whose tests recorded nothing left no log.
pub fn add_guest_log(guest_log: &Path) -> anyhow::Result<()> {
    let Some(log) = std::env::var_os(ENV) else {
        return Ok(());
    };
    let text = match fs::read_to_string(guest_log) {
        Ok(text) => text,
        Err(error) if error.kind() == ErrorKind::NotFound => return Ok(()),
        Err(error) => {
            return Err(error).with_context(|| format!("reading {}", guest_log.display()));
        }
    };
    let marked: String = text
        .lines()
        .filter_map(|line| {
            let (kernel, rest) = line.split_once('\t')?;
            Some(format!("{kernel}{GUEST}\t{rest}\n"))
        })
        .collect();
    let mut file = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log)
        .with_context(|| format!("opening {}", Path::new(&log).display()))?;
    file.write_all(marked.as_bytes())
        .with_context(|| format!("writing {}", Path::new(&log).display()))
}

/// Empties the log at `path` for a new run.
pub fn reset(path: &Path) -> anyhow::Result<()> {
    match fs::remove_file(path) {
        Err(error) if error.kind() != ErrorKind::NotFound => {
            Err(error).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// A quantity a test's source records: its binary, the quantity and the ground truth
/// (the call's first two string literals).
#[derive(Debug, Clone, PartialEq)]
struct Recorded {
    binary: String,
    quantity: String,
    truth_is: String,
}

/// What each test binary's source (tests/tests/<binary>.rs) records.
fn recorded(root: &Path) -> anyhow::Result<Vec<Recorded>> {
    let dir = root.join("tests/tests");
    let mut recorded = Vec::new();
    for entry in fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        let Some(binary) = path
            .file_stem()
            .filter(|_| path.extension().is_some_and(|ext| ext == "rs"))
        else {
            continue;
        };
        let source =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        for (quantity, truth_is) in calls(&source) {
            recorded.push(Recorded {
                binary: binary.to_string_lossy().into_owned(),
                quantity,
                truth_is,
            });
        }
    }
    recorded.sort_by(|a, b| a.binary.cmp(&b.binary));
    Ok(recorded)
}

/// The test binaries whose sources record comparisons, in name order.
pub fn recording_binaries(root: &Path) -> anyhow::Result<Vec<String>> {
    let mut binaries: Vec<String> = recorded(root)?
        .into_iter()
        .map(|recorded| recorded.binary)
        .collect();
    binaries.dedup();
    Ok(binaries)
}

/// The (quantity, truth) string literals that open each call of one of the recorder's
/// functions (`scorecard::` then a lower-case name and `(`) in a test's source; the
/// truth is empty when the second argument is not a literal.
fn calls(source: &str) -> Vec<(String, String)> {
    fn literal(text: &str) -> Option<(&str, &str)> {
        text.trim_start().strip_prefix('"')?.split_once('"')
    }
    source
        .match_indices("scorecard::")
        .filter_map(|(at, call)| {
            let rest = &source[at + call.len()..];
            let name = rest
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(rest.len());
            let arguments = rest[name..].strip_prefix('(').filter(|_| name > 0)?;
            let (quantity, rest) = literal(arguments)?;
            let truth_is = rest
                .trim_start()
                .strip_prefix(',')
                .and_then(literal)
                .map_or("", |(truth_is, _)| truth_is);
            Some((quantity.to_owned(), truth_is.to_owned()))
        })
        .collect()
}

/// Writes the page from the log at `log`: each quantity the sources record, measured
/// or not.
pub fn write_page(root: &Path, log: &Path) -> anyhow::Result<usize> {
    let text = match fs::read_to_string(log) {
        Ok(text) => text,
        Err(error) if error.kind() == ErrorKind::NotFound => {
            bail!(
                "no {}: run `{COMMAND}` (or `cargo xtask test`) as root first",
                log.display()
            )
        }
        Err(error) => return Err(error).with_context(|| format!("reading {}", log.display())),
    };
    let rows = parse(&text);
    if rows.is_empty() {
        bail!("{} records no comparison", log.display());
    }
    let page = root.join(PAGE);
    fs::write(&page, render(&rows, &recorded(root)?))
        .with_context(|| format!("writing {}", page.display()))?;
    Ok(rows.len())
}

/// One recorded comparison.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    kernel: String,
    binary: String,
    test: String,
    backend: String,
    quantity: String,
    truth_is: String,
    tolerance: String,
    ours: f64,
    truth: f64,
    deviation: f64,
    unit: String,
}

/// The log's rows; a line that is not one (a write cut short) is left out.
fn parse(log: &str) -> Vec<Row> {
    log.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split('\t').collect();
            let [
                kernel,
                binary,
                test,
                backend,
                quantity,
                truth_is,
                tolerance,
                ours,
                truth,
                deviation,
                unit,
            ] = fields[..]
            else {
                return None;
            };
            Some(Row {
                kernel: kernel.to_owned(),
                binary: binary.to_owned(),
                test: test.to_owned(),
                backend: backend.to_owned(),
                quantity: quantity.to_owned(),
                truth_is: truth_is.to_owned(),
                tolerance: tolerance.to_owned(),
                ours: ours.parse().ok()?,
                truth: truth.parse().ok()?,
                deviation: deviation.parse().ok()?,
                unit: unit.to_owned(),
            })
        })
        .collect()
}

/// The distinct values of `field` over `rows`, in their first order.
fn distinct<'a>(rows: &[&'a Row], field: impl Fn(&'a Row) -> &'a str) -> Vec<&'a str> {
    let mut values = Vec::new();
    for row in rows {
        let value = field(row);
        if !values.contains(&value) {
            values.push(value);
        }
    }
    values
}

/// A number with 4 significant digits at most, without trailing zeros.
fn number(value: f64) -> String {
    if value == 0.0 || !value.is_finite() {
        return format!("{value}");
    }
    let magnitude = value.abs().log10().floor() as i32;
    let decimals = (3 - magnitude).clamp(0, 9) as usize;
    let text = format!("{value:.decimals$}");
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        text
    }
}

/// `low–high`, or one value when they are the same.
fn range(values: impl Iterator<Item = f64>) -> String {
    let (low, high) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(low, high), v| {
        (low.min(v), high.max(v))
    });
    let (low, high) = (number(low), number(high));
    if low == high {
        low
    } else {
        format!("{low}–{high}")
    }
}

/// A signed deviation, with its sign shown.
fn signed(value: f64) -> String {
    let text = format!("{value:+.1}");
    if text == "-0.0" || text == "+0.0" {
        "0.0".to_owned()
    } else {
        text.replace('-', "−")
    }
}

/// The measured cell of one quantity's rows.
fn measured(rows: &[&Row]) -> String {
    let count = rows.len();
    let runs = if count == 1 {
        "1 run".to_owned()
    } else {
        format!("{count} runs")
    };
    let values = format!(
        "ours {}, truth {}",
        range(rows.iter().map(|row| row.ours)),
        range(rows.iter().map(|row| row.truth))
    );
    let units = distinct(rows, |row| row.unit.as_str());
    let (low, high) = rows
        .iter()
        .map(|row| row.deviation)
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(low, high), v| {
            (low.min(v), high.max(v))
        });
    match units[..] {
        ["="] if low == 0.0 && high == 0.0 => format!("equal in {runs} ({values})"),
        [unit] if unit != "=" => {
            let unit = format!(" {unit}");
            let deviation = if signed(low) == signed(high) {
                format!("{}{unit}", signed(low))
            } else {
                format!("{} to {}{unit}", signed(low), signed(high))
            };
            format!("{deviation} over {runs} ({values})")
        }
        _ => format!("{runs} ({values}; deviations {low} to {high})"),
    }
}

/// The backends of a quantity's rows; `-` (a quantity no request backend decides) is
/// shown as `any`. The host's first, then each guest kernel's after its release
/// (`6.1 guest: tcp`).
fn backends(rows: &[&Row]) -> String {
    let names = |rows: &[&Row]| {
        distinct(rows, |row| row.backend.as_str())
            .into_iter()
            .map(|backend| if backend == "-" { "any" } else { backend })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (guests, host): (Vec<&Row>, Vec<&Row>) =
        rows.iter().partition(|row| row.kernel.ends_with(GUEST));
    let mut cells = Vec::new();
    if !host.is_empty() {
        cells.push(names(&host));
    }
    for kernel in distinct(&guests, |row| row.kernel.as_str()) {
        let of_kernel: Vec<&Row> = guests
            .iter()
            .copied()
            .filter(|row| row.kernel == kernel)
            .collect();
        cells.push(format!("{} guest: {}", series(kernel), names(&of_kernel)));
    }
    cells.join("; ")
}

/// A kernel release's series: `6.1` of `6.1.0-41-amd64 guest`.
fn series(kernel: &str) -> String {
    kernel.split('.').take(2).collect::<Vec<_>>().join(".")
}

/// A table cell: no `|` (it would end the cell) and no line break.
fn cell(text: &str) -> String {
    text.replace('|', "/").replace('\n', " ")
}

/// The page: a header saying what it covers, then one row per (test binary, quantity),
/// the binaries in name order, each binary's quantities in the order first recorded.
fn render(rows: &[Row], recorded: &[Recorded]) -> String {
    let mut groups: Vec<((&str, &str), Vec<&Row>)> = Vec::new();
    for row in rows {
        let key = (row.binary.as_str(), row.quantity.as_str());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, group)) => group.push(row),
            None => groups.push((key, vec![row])),
        }
    }
    groups.sort_by_key(|((binary, _), _)| *binary);
    // Recorded by a test's source, absent from the log: the test failed before its
    // check, or did not run.
    let mut unmeasured: Vec<&Recorded> = Vec::new();
    for quantity in recorded {
        let key = (quantity.binary.as_str(), quantity.quantity.as_str());
        if !groups.iter().any(|(k, _)| *k == key)
            && !unmeasured
                .iter()
                .any(|q| (q.binary.as_str(), q.quantity.as_str()) == key)
        {
            unmeasured.push(quantity);
        }
    }
    let all: Vec<&Row> = rows.iter().collect();
    let (guests, host): (Vec<&str>, Vec<&str>) = distinct(&all, |row| row.kernel.as_str())
        .into_iter()
        .partition(|kernel| kernel.ends_with(GUEST));
    let kernels = match guests[..] {
        [] => format!(
            "kernel {} (this host; the guests of `cargo xtask vm-test` add theirs when it \
             runs under `cargo xtask test`)",
            host.join(", ")
        ),
        _ => format!(
            "kernel {} (this host) and the `cargo xtask vm-test` guests' {} (under \
             software emulation, their own subset of the tests)",
            host.join(", "),
            guests
                .iter()
                .map(|kernel| kernel.trim_end_matches(GUEST))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let request_backends: Vec<&str> = distinct(&all, |row| row.backend.as_str())
        .into_iter()
        .filter(|backend| *backend != "-")
        .collect();
    let binaries = distinct(&all, |row| row.binary.as_str()).len();
    let mut page = format!(
        "# Accuracy scorecard\n\n\
         Every quantity poolscope's privileged tests hold to a ground truth: what the truth \
         is, the tolerance the test's check allows, what was measured, on which request \
         backends, and the test that checks it. Back to [testing](testing.md).\n\n\
         Generated, do not edit: `{COMMAND}` runs the test binaries that record \
         comparisons and writes this page from their log (`{LOG}`). Each test records a \
         comparison next to the check it passed, with the numbers that check used \
         (`tests/src/scorecard.rs`); `{COMMAND} --from-log` renders the log that \
         `cargo xtask test` leaves. `tests/tests/docs.rs` fails when a test records a \
         quantity that is not on this page, or the page lists one that no test records.\n\n\
         **Covers** {kernels}, request backends {}, and quantities no request backend decides (thread \
         states, locks, stacks, profiles: backend `any`): {} comparisons of {} quantities from {} test \
         binaries{}. Backend `auto` is the one poolscope picks for the kernel (socket \
         from 6.3, docs/limits.md).\n\n\
         **Measured** is poolscope's value against the truth's over every run: the \
         deviation in % of the truth, in percentage points for a share, or `equal` for \
         an exact count; then the range of both values (seconds for times, requests, \
         connections or samples for counts, requests per second for capacity).\n\n\
         | quantity | ground truth | tolerance | measured | backends | test |\n\
         |---|---|---|---|---|---|\n",
        request_backends.join(", "),
        rows.len(),
        groups.len(),
        binaries,
        match unmeasured.len() {
            0 => String::new(),
            count => format!(
                "; not measured in the run this page comes from (its test failed or did not \
                 run), listed last: {count} more"
            ),
        },
    );
    for ((binary, quantity), group) in &groups {
        let tests = distinct(group, |row| row.test.as_str()).join(", ");
        page.push_str(&format!(
            "| {} | {} | {} | {} | {} | `{binary}`: {} |\n",
            cell(quantity),
            cell(&distinct(group, |row| row.truth_is.as_str()).join("; ")),
            cell(&distinct(group, |row| row.tolerance.as_str()).join("; ")),
            cell(&measured(group)),
            cell(&backends(group)),
            cell(&tests),
        ));
    }
    for quantity in unmeasured {
        page.push_str(&format!(
            "| {} | {} | — | not measured | — | `{}`: — |\n",
            cell(&quantity.quantity),
            cell(&quantity.truth_is),
            quantity.binary,
        ));
    }
    page
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "6.18.4\trequests\tcounts_a\tsocket\trequests_total\tthe clients' count\texact\t984\t984\t0\t=\n\
        6.18.4\trequests\tcounts_b\ttcp\trequests_total\tthe clients' count\texact\t1011\t1011\t0\t=\n\
        6.18.4\trequests\tcounts_a\tsocket\tmean duration\tthe server's\t±5 %\t0.0202\t0.02\t1\t%\n\
        6.18.4\trequests\tcounts_b\ttcp\tmean duration\tthe server's\t±5 %\t0.0198\t0.02\t-1.2\t%\n\
        6.18.4\tthreads\tutil\t-\tutilization\tthe workers'\t±3 points\t0.51\t0.5\t1\tpoints\n\
        6.18.4\thttp2\tgrpc\tsocket\twaiting\tclosed form\t±1 calls\t0.2\t0\t0.2\tcalls\n\
        a line cut short\n";

    #[test]
    fn reads_every_whole_line() {
        let rows = parse(LOG);
        assert_eq!(rows.len(), 6);
        assert_eq!(rows[2].quantity, "mean duration");
        assert_eq!(rows[3].deviation, -1.2);
        assert_eq!(rows[4].backend, "-");
    }

    #[test]
    fn one_row_per_quantity_with_its_range() {
        let recorded = [Recorded {
            binary: "threads".to_owned(),
            quantity: "runnable".to_owned(),
            truth_is: "schedstat".to_owned(),
        }];
        let page = render(&parse(LOG), &recorded);
        let table: Vec<&str> = page
            .lines()
            .filter(|line| line.starts_with("| ") && !line.starts_with("| quantity"))
            .collect();
        assert_eq!(
            table,
            [
                "| waiting | closed form | ±1 calls | +0.2 calls over 1 run (ours 0.2, truth 0) | socket | `http2`: grpc |",
                "| requests_total | the clients' count | exact | equal in 2 runs (ours 984–1011, truth 984–1011) | socket, tcp | `requests`: counts_a, counts_b |",
                "| mean duration | the server's | ±5 % | −1.2 to +1.0 % over 2 runs (ours 0.0198–0.0202, truth 0.02) | socket, tcp | `requests`: counts_a, counts_b |",
                "| utilization | the workers' | ±3 points | +1.0 points over 1 run (ours 0.51, truth 0.5) | any | `threads`: util |",
                "| runnable | schedstat | — | not measured | — | `threads`: — |",
            ]
        );
        assert!(page.contains("**Covers** kernel 6.18.4 (this host"));
        assert!(page.contains("request backends socket, tcp, and"));
        assert!(page.contains(
            "6 comparisons of 4 quantities from 3 test binaries; not measured in the run this \
             page comes from (its test failed or did not run), listed last: 1 more."
        ));
        assert!(!render(&parse(LOG), &[]).contains("more that a test records"));
    }

    #[test]
    fn numbers_keep_four_significant_digits() {
        assert_eq!(number(0.020235587), "0.02024");
        assert_eq!(number(3.925), "3.925");
        assert_eq!(number(1008.0), "1008");
        assert_eq!(number(40.0), "40");
        assert_eq!(number(0.0), "0");
        assert_eq!(signed(-0.02), "0.0");
        assert_eq!(signed(-1.25), "−1.2");
    }

    #[test]
    fn a_source_records_the_literals_of_its_calls() {
        let source = "    scorecard::exact(\n        \"requests_total\",\n        \"the clients'\",\n\
                      scorecard::within(\"mean\", &truth, backend)\n\
                      const CALL: &str = \"scorecard::\";\n\
                      use poolscope_tests::scorecard;\n";
        assert_eq!(
            calls(source),
            [
                ("requests_total".to_owned(), "the clients'".to_owned()),
                ("mean".to_owned(), String::new()),
            ]
        );
    }

    #[test]
    fn a_pipe_cannot_end_a_cell() {
        assert_eq!(cell("a | b"), "a / b");
    }

    #[test]
    fn a_guests_comparisons_are_marked_and_shown_by_kernel() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("xtask-scorecard-{}", std::process::id()));
        fs::create_dir_all(&dir)?;
        let (host_log, guest_log) = (dir.join("host.log"), dir.join("guest.log"));
        fs::write(
            &host_log,
            LOG.lines().next().unwrap_or_default().to_owned() + "\n",
        )?;
        fs::write(
            &guest_log,
            "6.1.0-41-amd64\trequests\tcounts_a\ttcp\trequests_total\tthe clients' count\texact\t70\t70\t0\t=\n\
             6.1.0-41-amd64\trequests\tcounts_a\tsyscall\trequests_total\tthe clients' count\texact\t71\t71\t0\t=\n",
        )?;
        // SAFETY: the one test that sets the variable; none reads it concurrently.
        unsafe { std::env::set_var(ENV, &host_log) };
        add_guest_log(&guest_log)?;
        add_guest_log(&dir.join("no guest ran"))?;
        let rows = parse(&fs::read_to_string(&host_log)?);
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[1].kernel, "6.1.0-41-amd64 guest");
        let page = render(&rows, &[]);
        assert!(
            page.contains(
                "equal in 3 runs (ours 70–984, truth 70–984) | socket; 6.1 guest: tcp, syscall |"
            ),
            "{page}"
        );
        assert!(
            page.contains("**Covers** kernel 6.18.4 (this host) and the `cargo xtask vm-test` guests' 6.1.0-41-amd64 (under"),
            "{page}"
        );
        fs::remove_dir_all(&dir)?;
        Ok(())
    }
}
