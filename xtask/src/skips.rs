//! The tests' skip log: `cargo xtask test` names a file in `POOLSCOPE_SKIP_LOG`, each
//! test that cannot run here appends `<test binary>\t<test>\t<reason>` to it
//! (`poolscope_tests::skip`), and the run ends with one line per skipped group (a test
//! binary and a reason), so that a pass with skips says what it did not check.
use std::{collections::BTreeMap, fs, io::ErrorKind, path::Path};

use anyhow::Context as _;

/// The environment variable the tests read the log's path from.
pub const ENV: &str = "POOLSCOPE_SKIP_LOG";

/// Empties the log at `path` for a new run.
pub fn reset(path: &Path) -> anyhow::Result<()> {
    match fs::remove_file(path) {
        Err(error) if error.kind() != ErrorKind::NotFound => {
            Err(error).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// The summary of the log at `path`: nothing when no test skipped.
pub fn summary(path: &Path) -> anyhow::Result<Vec<String>> {
    match fs::read_to_string(path) {
        Ok(log) => Ok(summarize(&log)),
        Err(error) if error.kind() == ErrorKind::NotFound => Ok(Vec::new()),
        Err(error) => Err(error).with_context(|| format!("reading {}", path.display())),
    }
}

/// One line per (test binary, reason), with how many tests skipped for it and the
/// first of them.
fn summarize(log: &str) -> Vec<String> {
    let mut groups: BTreeMap<(&str, &str), (usize, &str)> = BTreeMap::new();
    for line in log.lines() {
        let mut fields = line.splitn(3, '\t');
        let (Some(binary), Some(test), Some(reason)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        groups
            .entry((binary, reason))
            .and_modify(|(count, _)| *count += 1)
            .or_insert((1, test));
    }
    groups
        .into_iter()
        .map(|((binary, reason), (count, first))| match count {
            1 => format!("skipped {binary}: {first}: {reason}"),
            _ => format!("skipped {binary}: {count} tests ({first}, …): {reason}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_binary_and_reason() {
        let log = "requests\tcounts_exactly\tneeds root (loads eBPF programs)\n\
                   requests\tqueue_depth\tneeds root (loads eBPF programs)\n\
                   poolscope\tgo_tool_pprof_reads_the_profile\tno go on PATH\n\
                   requests\tmalformed line\n";
        assert_eq!(
            summarize(log),
            [
                "skipped poolscope: go_tool_pprof_reads_the_profile: no go on PATH",
                "skipped requests: 2 tests (counts_exactly, …): needs root (loads eBPF programs)",
            ]
        );
        assert!(summarize("").is_empty());
    }
}
