//! The two text formats, Prometheus text 0.0.4 and OpenMetrics 1.0: escaping, numbers
//! and label values written by hand, each bound's text formatted once per rendering.
use std::fmt::Write as _;

use super::{Family, Format, HistogramValue, Kind, SummaryValue, Value};

/// Label values: backslash, double quote and newline are escaped (both formats).
fn escape_label_value(value: &str, out: &mut String) {
    // Most values need no escape: copied whole.
    if !needs_escape(value.as_bytes()) {
        out.push_str(value);
        return;
    }
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// Whether `bytes` hold a backslash, a double quote or a newline, looked for eight
/// bytes at a time, the last few in a word padded with zeros (label values are
/// short: byte by byte, with three comparisons each, looking was a quarter of
/// rendering; memchr's vector search starts above their length).
fn needs_escape(bytes: &[u8]) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    // Whether any byte of `word` is zero (exact: no false positives).
    let has_zero = |word: u64| (word.wrapping_sub(ONES) & !word & HIGHS) != 0;
    let has = |word: u64, byte: u8| has_zero(word ^ (ONES * u64::from(byte)));
    let needs = |word: u64| has(word, b'\\') || has(word, b'"') || has(word, b'\n');
    let mut chunks = bytes.chunks_exact(8);
    if chunks.any(|chunk| {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        needs(u64::from_ne_bytes(word))
    }) {
        return true;
    }
    // The rest in one word, padded with zeros (which match none of the three).
    let rest = chunks
        .remainder()
        .iter()
        .enumerate()
        .fold(0u64, |word, (i, &byte)| word | u64::from(byte) << (8 * i));
    needs(rest)
}

/// HELP text: backslash and newline escaped (plus `"` in OpenMetrics).
fn escape_help(help: &str, format: Format, out: &mut String) {
    // Most help texts need no escape: copied whole.
    if !needs_escape(help.as_bytes()) {
        out.push_str(help);
        return;
    }
    for c in help.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if format == Format::OpenMetrics => out.push_str("\\\""),
            c => out.push(c),
        }
    }
}

/// A sample's value.
fn write_value(value: f64, out: &mut String) {
    write_number(value, out, |value, out| {
        // Ryū: the shortest text that reads back to `value`, as `{value}` writes it,
        // in about a third of the time (in exponent form outside 1e-5..1e16, which
        // every Prometheus parser reads).
        out.push_str(ryu::Buffer::new().format_finite(value));
    });
}

/// An `le` or `quantile` label's value, as `{value}` writes it: the text is the
/// series' identity, so it stays what earlier versions wrote (formatted once per
/// rendering, see [`BoundTexts`]).
fn write_bound(value: f64, out: &mut String) {
    write_number(value, out, |value, out| {
        let _ = write!(out, "{value}");
    });
}

/// `value` in Prometheus' text: integers, NaN and the infinities by hand, any other
/// number by `fraction`.
fn write_number(value: f64, out: &mut String, fraction: impl FnOnce(f64, &mut String)) {
    // Most values are counts: an integer below 10^15 is written as one (a cast and a
    // compare; NaN and the infinities never compare equal to their cast).
    let integer = value as i64;
    if integer as f64 == value && integer.unsigned_abs() < 1_000_000_000_000_000 {
        write_integer(integer, out);
    } else if value.is_nan() {
        out.push_str("NaN");
    } else if value.is_infinite() {
        out.push_str(if value > 0.0 { "+Inf" } else { "-Inf" });
    } else {
        fraction(value, out);
    }
}

/// `value` in decimal, without the formatting machinery (most values are counts).
fn write_integer(value: i64, out: &mut String) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut rest = value.unsigned_abs();
    loop {
        at -= 1;
        digits[at] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    if value < 0 {
        out.push('-');
    }
    // ASCII digits: one copy rather than a push per digit.
    out.push_str(std::str::from_utf8(&digits[at..]).unwrap_or_default());
}

/// `name="value"` pairs, comma-separated, without braces.
fn write_label_pairs<'a>(labels: impl Iterator<Item = (&'static str, &'a str)>, out: &mut String) {
    for (i, (name, value)) in labels.enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(name);
        out.push_str("=\"");
        escape_label_value(value, out);
        out.push('"');
    }
}

/// The text of the `le` and `quantile` values of one rendering, each formatted once:
/// every histogram of a family has the same bounds, and formatting a float is most
/// of what writing a bucket's line costs otherwise.
#[derive(Default)]
struct BoundTexts {
    /// (the value's bits, its text), most recent last.
    texts: Vec<(u64, String)>,
}

impl BoundTexts {
    /// More than the bounds of any bucket layout and the quantiles together.
    const MAX: usize = 128;

    fn text(&mut self, value: f64) -> &str {
        let bits = value.to_bits();
        let at = match self.texts.iter().rposition(|(kept, _)| *kept == bits) {
            Some(at) => at,
            None => {
                if self.texts.len() == Self::MAX {
                    self.texts.remove(0);
                }
                let mut text = String::new();
                write_bound(value, &mut text);
                self.texts.push((bits, text));
                self.texts.len() - 1
            }
        };
        &self.texts[at].1
    }
}

/// One line: `<head>{<pairs>[,extra]} value`, where `head` is the metric's name with
/// its suffix and `pairs` the sample's labels written once for all its lines.
fn write_line(head: &str, pairs: &str, extra: Option<(&str, &str)>, value: f64, out: &mut String) {
    out.push_str(head);
    match extra {
        Some((name, extra)) => {
            out.push('{');
            out.push_str(pairs);
            if !pairs.is_empty() {
                out.push(',');
            }
            out.push_str(name);
            out.push_str("=\"");
            out.push_str(extra);
            out.push_str("\"}");
        }
        None if !pairs.is_empty() => {
            out.push('{');
            out.push_str(pairs);
            out.push('}');
        }
        None => {}
    }
    write_value_end(value, out);
}

/// A line's end: ` value` and the newline.
fn write_value_end(value: f64, out: &mut String) {
    out.push(' ');
    write_value(value, out);
    out.push('\n');
}

/// A family's metric name with each suffix its lines take, joined once per family.
struct Heads {
    number: String,
    bucket: String,
    sum: String,
    count: String,
}

impl Heads {
    fn of(family: &Family, number_suffix: &str) -> Self {
        let head = |suffix: &str| [family.prefix, family.name, suffix].concat();
        Self {
            number: head(number_suffix),
            bucket: head("_bucket"),
            sum: head("_sum"),
            count: head("_count"),
        }
    }

    /// The `_sum` and `_count` lines of a histogram or summary.
    fn write_totals(&self, pairs: &str, sum: f64, count: u64, out: &mut String) {
        write_line(&self.sum, pairs, None, sum, out);
        write_line(&self.count, pairs, None, count as f64, out);
    }
}

/// Renders families in `format`.
pub fn render(families: &[Family], format: Format) -> String {
    let mut out = String::with_capacity(families.len() * 256);
    render_into(families, format, &mut out);
    out
}

/// [`render`] appended to `out`.
pub(super) fn render_into(families: &[Family], format: Format, out: &mut String) {
    let mut bounds = BoundTexts::default();
    // One sample's labels, written once for all its lines.
    let mut pairs = String::new();
    for family in families {
        let (kind, number_suffix) = match family.kind {
            Kind::Counter => ("counter", "_total"),
            Kind::Gauge => ("gauge", ""),
            Kind::Histogram => ("histogram", ""),
            Kind::Summary => ("summary", ""),
        };
        // The family name carries `_total` in the text format, not in OpenMetrics.
        let family_suffix = if format == Format::Text {
            number_suffix
        } else {
            ""
        };
        let name = [family.prefix, family.name, family_suffix].concat();
        let _ = write!(out, "# HELP {name} ");
        escape_help(family.help, format, out);
        let _ = writeln!(out, "\n# TYPE {name} {kind}");
        let heads = Heads::of(family, number_suffix);
        for sample in &family.samples {
            // A number's one line takes its labels straight; the others' several
            // lines copy them from `pairs`.
            if !matches!(sample.value, Value::Number(_)) {
                pairs.clear();
                write_label_pairs(family.labels(sample), &mut pairs);
            }
            match &sample.value {
                Value::Number(value) => {
                    out.push_str(&heads.number);
                    let labels = family.labels(sample);
                    if labels.len() > 0 {
                        out.push('{');
                        write_label_pairs(labels, out);
                        out.push('}');
                    }
                    write_value_end(*value, out);
                }
                Value::Histogram(histogram) => {
                    let HistogramValue {
                        buckets,
                        sum,
                        count,
                        native: _,
                    } = &**histogram;
                    for (le, cumulative) in buckets {
                        let le = Some(("le", bounds.text(*le)));
                        write_line(&heads.bucket, &pairs, le, *cumulative as f64, out);
                    }
                    let inf = Some(("le", "+Inf"));
                    write_line(&heads.bucket, &pairs, inf, *count as f64, out);
                    heads.write_totals(&pairs, *sum, *count, out);
                }
                Value::Summary(summary) => {
                    let SummaryValue { quantiles, totals } = &**summary;
                    for (quantile, value) in quantiles {
                        let quantile = Some(("quantile", bounds.text(*quantile)));
                        write_line(&heads.number, &pairs, quantile, *value, out);
                    }
                    if let Some((sum, count)) = totals {
                        heads.write_totals(&pairs, *sum, *count, out);
                    }
                }
            }
        }
    }
    if format == Format::OpenMetrics {
        out.push_str("# EOF\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_as_the_formatter_writes_them() {
        for value in [
            0i64,
            7,
            -7,
            10,
            99,
            100,
            -100,
            123_456_789,
            999_999_999_999_999,
        ] {
            let mut out = String::new();
            write_value(value as f64, &mut out);
            assert_eq!(out, value.to_string());
        }
        let mut out = String::new();
        write_value(-0.0, &mut out);
        assert_eq!(out, "0");
    }

    #[test]
    fn bound_texts_are_the_values_written_once() {
        let mut texts = BoundTexts::default();
        let written = |value: f64| {
            let mut out = String::new();
            write_bound(value, &mut out);
            out
        };
        // More distinct values than are kept, twice over: evicted ones come back right.
        let values: Vec<f64> = (0..BoundTexts::MAX as u32 + 10)
            .map(|i| f64::from(i) * 0.000_512 + 0.25)
            .collect();
        for _ in 0..2 {
            for &value in &values {
                assert_eq!(texts.text(value), written(value));
            }
        }
        assert_eq!(texts.texts.len(), BoundTexts::MAX);
        assert_eq!(texts.text(0.99), "0.99");
        assert_eq!(texts.text(f64::INFINITY), "+Inf");
    }

    #[test]
    fn escapes_are_found_at_every_position() {
        for length in 0..20 {
            let plain = "a".repeat(length);
            assert!(!needs_escape(plain.as_bytes()));
            for at in 0..length {
                for special in [b'\\', b'"', b'\n'] {
                    let mut bytes = plain.clone().into_bytes();
                    bytes[at] = special;
                    assert!(needs_escape(&bytes), "{bytes:?}");
                }
            }
        }
        // Neighbours of the three (and bytes with the high bit set) are not escaped.
        assert!(!needs_escape("[]!#\t\u{0b}é€ żółw Ü".as_bytes()));
    }

    #[test]
    fn special_values() {
        let mut out = String::new();
        write_value(f64::INFINITY, &mut out);
        out.push(' ');
        write_value(f64::NAN, &mut out);
        out.push(' ');
        write_value(1.5e-7, &mut out);
        out.push(' ');
        write_value(0.25, &mut out);
        out.push(' ');
        write_bound(8.192e-6, &mut out);
        assert_eq!(out, "+Inf NaN 1.5e-7 0.25 0.000008192");
    }
}
