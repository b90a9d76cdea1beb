//! What each guest left in its work directory, read back: its kernel, the backend
//! poolscope chose, each probe attached or skipped, each test passed or failed; as a
//! table, and the problems that fail the run.
use std::{collections::BTreeMap, fmt::Write as _, fs, path::Path, time::Duration};

use super::{GUEST_TESTS, GuestKernel, SUITE};

/// What the guest left in the work directory.
pub(super) struct Report {
    kernel: String,
    backend: Option<String>,
    /// probe → `None` if attached, else the reason it was skipped.
    probes: BTreeMap<String, Option<String>>,
    /// test → passed; a test with no result line did not run to its end.
    tests: Vec<(String, Option<bool>)>,
    /// What each failed test printed: CI keeps only the output, not the guest's logs.
    failures: Vec<(String, String)>,
    poolscope_exit: String,
    /// poolscope's start-up summary (attached, on demand, skipped).
    summary: String,
}

impl Report {
    pub(super) fn read(work: &Path) -> anyhow::Result<Self> {
        let read = |name: &str| fs::read_to_string(work.join(name)).unwrap_or_default();
        let metrics = read("metrics.txt");
        let mut probes = BTreeMap::new();
        let mut backend = None;
        for line in metrics.lines() {
            if let Some(rest) = line.strip_prefix("poolscope_probe_attached{probe=\"")
                && let Some((probe, _)) = rest.split_once('"')
            {
                probes.entry(probe.to_owned()).or_insert(None);
            } else if let Some(rest) = line.strip_prefix("poolscope_probe_skipped{probe=\"")
                && let Some((probe, rest)) = rest.split_once("\",reason=\"")
                && let Some((reason, _)) = rest.split_once('"')
            {
                probes.insert(probe.to_owned(), Some(reason.to_owned()));
            } else if line.starts_with("poolscope_build_info{")
                && let Some((_, rest)) = line.split_once("backend=\"")
                && let Some((name, _)) = rest.split_once('"')
            {
                backend = Some(name.to_owned());
            }
        }
        let mut tests = Vec::new();
        let mut failures = Vec::new();
        for (target, names) in GUEST_TESTS {
            let log = read(&format!("tests/{target}.log"));
            let results = test_results(&log, names);
            for (name, result) in names.iter().zip(&results) {
                if *result == Some(false) {
                    let output = test_output(&log, name).unwrap_or("(no output found)");
                    failures.push((format!("{target}::{name}"), output.to_owned()));
                }
            }
            tests.extend(
                names
                    .iter()
                    .zip(results)
                    .map(|(name, result)| (format!("{target}::{name}"), result)),
            );
        }
        Ok(Self {
            kernel: read("kernel.txt").trim().to_owned(),
            backend,
            probes,
            tests,
            failures,
            poolscope_exit: read("poolscope.exit").trim().to_owned(),
            summary: read("poolscope.log")
                .lines()
                .find(|line| line.contains("kernel probes loaded"))
                .and_then(|line| line.split_once("kernel="))
                .map_or_else(String::new, |(_, fields)| format!("kernel={fields}")),
        })
    }

    pub(super) fn table(
        &self,
        kernel: &GuestKernel,
        accel: &str,
        took: Duration,
        stopped: Option<&str>,
        work: &Path,
    ) -> String {
        // What a failed test printed comes first, so that the table naming it ends
        // the report: a log cut to its tail shows which test failed.
        let mut out = String::new();
        for (test, output) in &self.failures {
            let _ = writeln!(out, "--- what {test} printed ---\n{output}");
        }
        let _ = writeln!(
            out,
            "\nvm-test: Debian {SUITE}, kernel {} (from {}), {accel}, {} s",
            self.kernel,
            kernel.suite,
            took.as_secs()
        );
        if let Some(reason) = stopped {
            let _ = writeln!(out, "the guest {reason}");
        }
        let _ = writeln!(
            out,
            "backend chosen by auto: {}",
            self.backend.as_deref().unwrap_or("(no metrics)")
        );
        let _ = writeln!(out, "poolscope at start: {}", self.summary);
        let _ = writeln!(out, "{:<36} state", "probe");
        for (probe, skipped) in &self.probes {
            let state = skipped
                .as_deref()
                .map_or("attached".to_owned(), |reason| format!("skipped: {reason}"));
            let _ = writeln!(out, "{probe:<36} {state}");
        }
        let _ = writeln!(out, "{:<84} result", "ground-truth test");
        for (test, passed) in &self.tests {
            let result = match passed {
                Some(true) => "passed",
                Some(false) => "FAILED",
                None => "did not finish",
            };
            let _ = writeln!(out, "{test:<84} {result}");
        }
        let _ = write!(
            out,
            "logs: {} (serial.log, poolscope.log, tests/)",
            work.display()
        );
        out
    }

    /// What is wrong with the run on `kernel`, each prefixed by the kernel.
    pub(super) fn problems(&self, kernel: &GuestKernel) -> Vec<String> {
        let mut problems = Vec::new();
        if !self.kernel.starts_with(kernel.series) {
            problems.push(format!(
                "the guest ran kernel {:?}, not {}x",
                self.kernel, kernel.series
            ));
        }
        if self.backend.as_deref() != Some(kernel.backend) {
            problems.push(format!(
                "backend {:?}, not {}",
                self.backend, kernel.backend
            ));
        }
        if self.probes.is_empty() {
            problems.push("poolscope served no probe_attached".to_owned());
        }
        for (probe, skipped) in &self.probes {
            if let Some(reason) = skipped {
                problems.push(format!("probe {probe} skipped: {reason} (poolscope.log)"));
            }
        }
        if self.poolscope_exit != "0" {
            problems.push(format!(
                "poolscope exited with {:?} on SIGTERM",
                self.poolscope_exit
            ));
        }
        for (test, passed) in &self.tests {
            if *passed != Some(true) {
                problems.push(format!("{test} did not pass"));
            }
        }
        problems
            .into_iter()
            .map(|problem| format!("kernel {}x: {problem}", kernel.series))
            .collect()
    }
}

/// Each test's result from a libtest log of a run of exactly `names`: `None` for all
/// if the run did not end with its summary or ran other tests than asked. With
/// `--nocapture` a test's output may split its result line, so failures are read
/// from the summary's list.
fn test_results(log: &str, names: &[&str]) -> Vec<Option<bool>> {
    let plural = if names.len() == 1 { "" } else { "s" };
    let ran_all = log
        .lines()
        .any(|line| line == format!("running {} test{plural}", names.len()));
    let Some(summary) = log.rfind("\ntest result: ") else {
        return vec![None; names.len()];
    };
    if !ran_all {
        return vec![None; names.len()];
    }
    let failed: Vec<&str> = log[..summary]
        .rfind("\nfailures:\n")
        .map(|start| {
            log[start..summary]
                .lines()
                .filter_map(|line| line.strip_prefix("    "))
                .collect()
        })
        .unwrap_or_default();
    names
        .iter()
        .map(|name| Some(!failed.contains(name)))
        .collect()
}

/// What test `name` printed in a libtest log run with `--nocapture` (the guest's):
/// from its `test <name> ...` line to the next test's or the failure summary.
fn test_output<'log>(log: &'log str, name: &str) -> Option<&'log str> {
    let start = log.find(&format!("test {name} ... "))?;
    let rest = &log[start..];
    let end = ["\ntest ", "\nfailures:\n"]
        .iter()
        .filter_map(|next| rest.find(next))
        .min()
        .unwrap_or(rest.len());
    Some(rest[..end].trim_end())
}

#[cfg(test)]
mod tests {
    use super::{test_output, test_results};

    #[test]
    fn failures_are_read_from_the_summary_of_a_run() {
        let names = ["fast", "slow"];
        let failed = "running 2 tests\ntest fast ... noise\nok\ntest slow ... FAILED\n\n\
                      failures:\n\n---- slow stdout ----\nError: 6% off\n\n\
                      failures:\n    slow\n\ntest result: FAILED. 1 passed; 1 failed\n";
        assert_eq!(test_results(failed, &names), [Some(true), Some(false)]);
        assert_eq!(test_output(failed, "slow"), Some("test slow ... FAILED"));
        let inline = "running 2 tests\ntest slow ... counted 4001 of 4002\n\nthread 'slow' \
                      panicked at t.rs:1:5:\nassertion failed\nFAILED\ntest fast ... ok\n";
        assert_eq!(
            test_output(inline, "slow"),
            Some(
                "test slow ... counted 4001 of 4002\n\nthread 'slow' panicked at t.rs:1:5:\n\
                 assertion failed\nFAILED"
            )
        );
        let passed =
            "running 2 tests\ntest fast ... ok\ntest slow ... ok\n\ntest result: ok. 2 passed\n";
        assert_eq!(test_results(passed, &names), [Some(true), Some(true)]);
        assert_eq!(test_output(passed, "absent"), None);
        let cut = "running 2 tests\ntest fast ... ok\n";
        assert_eq!(test_results(cut, &names), [None, None]);
        let filtered = "running 1 test\ntest fast ... ok\n\ntest result: ok. 1 passed\n";
        assert_eq!(test_results(filtered, &names), [None, None]);
        assert_eq!(test_results(filtered, &["fast"]), [Some(true)]);
    }
}
