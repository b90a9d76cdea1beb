//! The accuracy scorecard's recorder: a test that has just checked one of poolscope's
//! numbers against its ground truth records the comparison here, with the numbers the
//! check used, as one line of the file `POOLSCOPE_SCORECARD_LOG` names (`cargo xtask
//! test` names `target/scorecard.log`; nothing is written without it). `cargo xtask
//! scorecard` renders docs/accuracy.md from that log, and tests/tests/docs.rs checks
//! that the page and the `scorecard::` calls of tests/tests/ name the same quantities.
//!
//! A line is `kernel \t binary \t test \t backend \t quantity \t truth \t tolerance \t
//! ours \t truth value \t deviation \t unit`: the kernel release, the test binary, the
//! test (its thread's name, which libtest sets), the request backend (`-` where the
//! quantity does not depend on one), what is measured, what the truth is, the
//! tolerance as the check applies it, the two numbers and how far apart they are (in
//! `%` of the truth, in `points` of a share, `=` for an exact match, or in the unit
//! [`difference`] names).
//!
//! Each function's first argument is the quantity, a string literal: docs.rs reads it
//! from the sources.

/// The environment variable the tests read the log's path from.
pub const ENV: &str = "POOLSCOPE_SCORECARD_LOG";

/// `ours` equals `truth`, checked by the caller just before.
pub fn exact(quantity: &str, truth_is: &str, backend: &str, ours: f64, truth: f64) {
    write(
        quantity,
        truth_is,
        backend,
        "exact",
        (ours, truth),
        (ours - truth, "="),
    );
}

/// `ours` within `tolerance` (relative) of `truth`, checked by the caller just before.
pub fn within(
    quantity: &str,
    truth_is: &str,
    backend: &str,
    ours: f64,
    truth: f64,
    tolerance: f64,
) {
    within_plus(quantity, truth_is, backend, ours, truth, tolerance, 0.0);
}

/// `ours` within `tolerance` (relative) of `truth` plus `allowance` seconds, checked
/// by the caller just before.
pub fn within_plus(
    quantity: &str,
    truth_is: &str,
    backend: &str,
    ours: f64,
    truth: f64,
    tolerance: f64,
    allowance: f64,
) {
    let tolerance = if allowance > 0.0 {
        format!("±{} % + {} ms", percent(tolerance), allowance * 1e3)
    } else {
        format!("±{} %", percent(tolerance))
    };
    bounded(quantity, truth_is, backend, ours, truth, &tolerance);
}

/// `ours` against `truth` under a bound the caller states in words (`0.75–1.05 ×`),
/// checked by the caller just before; the deviation is relative.
pub fn bounded(
    quantity: &str,
    truth_is: &str,
    backend: &str,
    ours: f64,
    truth: f64,
    tolerance: &str,
) {
    write(
        quantity,
        truth_is,
        backend,
        tolerance,
        (ours, truth),
        ((ours - truth) / truth * 100.0, "%"),
    );
}

/// Two shares (0 to 1) within `points` percentage points, checked by the caller just
/// before.
pub fn points(quantity: &str, truth_is: &str, backend: &str, ours: f64, truth: f64, points: f64) {
    write(
        quantity,
        truth_is,
        backend,
        &format!("±{points} points"),
        (ours, truth),
        ((ours - truth) * 100.0, "points"),
    );
}

/// `ours` within `tolerance` `unit`s of `truth` (`1.0, "calls"`), checked by the
/// caller just before.
pub fn difference(
    quantity: &str,
    truth_is: &str,
    backend: &str,
    (ours, truth): (f64, f64),
    tolerance: f64,
    unit: &str,
) {
    write(
        quantity,
        truth_is,
        backend,
        &format!("±{tolerance} {unit}"),
        (ours, truth),
        (ours - truth, unit),
    );
}

/// A fraction as a percentage without float noise (0.05 → 5, 0.015 → 1.5).
fn percent(fraction: f64) -> String {
    let rounded = (fraction * 1e4).round() / 100.0;
    format!("{rounded}")
}

fn write(
    quantity: &str,
    truth_is: &str,
    backend: &str,
    tolerance: &str,
    (ours, truth): (f64, f64),
    (deviation, unit): (f64, &str),
) {
    let Some(log) = std::env::var_os(ENV) else {
        return;
    };
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let test = std::thread::current()
        .name()
        .unwrap_or("main")
        .rsplit("::")
        .next()
        .unwrap_or_default()
        .to_owned();
    let fields = [
        kernel.trim(),
        &crate::binary_name(),
        &test,
        backend,
        quantity,
        truth_is,
        tolerance,
        &ours.to_string(),
        &truth.to_string(),
        &deviation.to_string(),
        unit,
    ];
    let fields: Vec<String> = fields
        .iter()
        .map(|field| field.replace(['\t', '\n'], " "))
        .collect();
    let line = format!("{}\n", fields.join("\t"));
    crate::append_to_log(&log, &line, quantity);
}

#[cfg(test)]
mod tests {
    use super::percent;

    #[test]
    fn percentages_read_as_written() {
        assert_eq!(percent(0.05), "5");
        assert_eq!(percent(0.015), "1.5");
        assert_eq!(percent(0.1), "10");
        assert_eq!(percent(0.002), "0.2");
    }
}
