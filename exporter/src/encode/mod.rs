//! Metric families and their three wire formats: Prometheus text 0.0.4, OpenMetrics
//! 1.0 and the protobuf exposition (with native histograms, `protobuf`), chosen by
//! the scraper's Accept header. Also the series cap. Pure functions.
//!
//! (prometheus-client only writes OpenMetrics; the classic text format is what
//! `promtool check metrics` and older scrapers read, so both are written here.)
use std::fmt::Write as _;

mod protobuf;
mod spare;

pub use spare::{Body, gzip};

/// Every metric name of poolscope's own starts with this.
pub const PREFIX: &str = "poolscope_";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
    Summary,
}

/// The value of one sample; histograms and summaries are one sample with their parts.
/// Their parts are boxed: most of a scrape's thousands of samples are numbers, and
/// with the parts inline every sample took 112 bytes, a cold buffer of ~650 KB at
/// 110 services whose first writes were a third of what pushing a sample cost.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Number(f64),
    Histogram(Box<HistogramValue>),
    Summary(Box<SummaryValue>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct HistogramValue {
    /// (upper bound, cumulative count), ascending; `+Inf` is added when written.
    pub buckets: Vec<(f64, u64)>,
    pub sum: f64,
    pub count: u64,
    /// The same counts as a native histogram, for the protobuf exposition.
    pub native: Option<NativeBuckets>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SummaryValue {
    /// (quantile, value)
    pub quantiles: Vec<(f64, f64)>,
    /// `_sum` and `_count`; `None` for quantiles alone (the `_window` summaries,
    /// whose totals are the same-named histogram's).
    pub totals: Option<(f64, u64)>,
}

/// A native histogram's buckets (positive values only; durations are never negative).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NativeBuckets {
    /// Bucket `i` holds (base^(i-1), base^i], base = 2^(2^-schema).
    pub schema: i32,
    /// Values up to this are counted in `zero_count`.
    pub zero_threshold: f64,
    pub zero_count: u64,
    /// (bucket index, count), ascending, buckets that counted nothing left out.
    pub positive: Vec<(i32, u64)>,
}

impl Value {
    pub fn histogram(
        buckets: Vec<(f64, u64)>,
        sum: f64,
        count: u64,
        native: Option<NativeBuckets>,
    ) -> Self {
        Self::Histogram(Box::new(HistogramValue {
            buckets,
            sum,
            count,
            native,
        }))
    }

    pub fn summary(quantiles: Vec<(f64, f64)>, totals: Option<(f64, u64)>) -> Self {
        Self::Summary(Box::new(SummaryValue { quantiles, totals }))
    }

    /// Lines (series) this value takes in the exposition.
    fn series(&self) -> usize {
        match self {
            Self::Number(_) => 1,
            // the buckets, +Inf, _sum and _count
            Self::Histogram(histogram) => histogram.buckets.len() + 3,
            Self::Summary(summary) => {
                summary.quantiles.len() + 2 * usize::from(summary.totals.is_some())
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// This sample's labels: a range of its family's `label_names`.
    labels: std::ops::Range<usize>,
    pub value: Value,
}

#[cfg(target_pointer_width = "64")]
const _: () = assert!(
    size_of::<Sample>() == 32,
    "a sample is a range and a number"
);

/// A metric family; `name` has no prefix and, for counters, no `_total`.
#[derive(Clone, Debug, PartialEq)]
pub struct Family {
    /// [`PREFIX`], or nothing for a family named by Prometheus' conventions.
    pub prefix: &'static str,
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub samples: Vec<Sample>,
    /// Every sample's label names in order, each with the end of its value in
    /// `label_values` (where the one before ends, it starts): a scrape makes
    /// thousands of samples, and a few growing buffers per family instead of a few
    /// strings per sample halved what building them cost.
    label_names: Vec<(&'static str, usize)>,
    label_values: String,
}

impl Family {
    pub fn new(name: &'static str, kind: Kind, help: &'static str) -> Self {
        let spare::FamilyBuffers {
            samples,
            label_names,
            label_values,
        } = spare::family_buffers(name);
        Self {
            prefix: PREFIX,
            name,
            help,
            kind,
            samples,
            label_names,
            label_values,
        }
    }

    /// A family named as the Prometheus client libraries name it (`process_*`),
    /// without poolscope's prefix.
    pub fn standard(name: &'static str, kind: Kind, help: &'static str) -> Self {
        let mut family = Self::new(name, kind, help);
        family.prefix = "";
        family
    }

    pub fn with(mut self, labels: &[(&'static str, &str)], value: f64) -> Self {
        self.push(labels, value);
        self
    }

    pub fn with_value(mut self, labels: &[(&'static str, &str)], value: Value) -> Self {
        self.push_value(labels, value);
        self
    }

    pub fn push(&mut self, labels: &[(&'static str, &str)], value: f64) {
        self.push_value(labels, Value::Number(value));
    }

    pub fn push_value(&mut self, labels: &[(&'static str, &str)], value: Value) {
        let first = self.label_names.len();
        for (name, value) in labels {
            self.label_values.push_str(value);
            self.label_names.push((name, self.label_values.len()));
        }
        self.samples.push(Sample {
            labels: first..self.label_names.len(),
            value,
        });
    }

    /// The labels of `sample`, one of this family's: (name, value).
    pub fn labels<'a>(
        &'a self,
        sample: &Sample,
    ) -> impl ExactSizeIterator<Item = (&'static str, &'a str)> + Clone + 'a {
        let start_of = |index: usize| index.checked_sub(1).map_or(0, |i| self.label_names[i].1);
        let values = &self.label_values;
        let labels = sample.labels.clone();
        let mut start = start_of(labels.start);
        self.label_names[labels].iter().map(move |&(name, end)| {
            let value = values.get(start..end).unwrap_or_default();
            start = end;
            (name, value)
        })
    }
}

impl Drop for Family {
    fn drop(&mut self) {
        spare::give_family_buffers(
            self.name,
            spare::FamilyBuffers {
                samples: std::mem::take(&mut self.samples),
                label_names: std::mem::take(&mut self.label_names),
                label_values: std::mem::take(&mut self.label_values),
            },
        );
    }
}

/// The text formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `text/plain; version=0.0.4`
    Text,
    /// `application/openmetrics-text; version=1.0.0`
    OpenMetrics,
}

/// What a scrape is answered in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Exposition {
    Text(Format),
    /// `application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily;
    /// encoding=delimited`, which Prometheus asks for first when it ingests native
    /// histograms.
    Protobuf,
}

/// The items of an HTTP header with weights (`Accept`, `Accept-Encoding`): each
/// item's name, its parameters and its weight (`q`, 1 when absent; an unreadable
/// weight makes it 0, never chosen).
pub fn weighted_items(value: &str) -> impl Iterator<Item = (&str, Vec<(&str, &str)>, f64)> {
    value.split(',').map(|item| {
        let mut parts = item.split(';').map(str::trim);
        let name = parts.next().unwrap_or_default();
        let mut weight = 1.0;
        let mut params = Vec::new();
        for (key, value) in parts.filter_map(|param| param.split_once('=')) {
            let (key, value) = (key.trim(), value.trim().trim_matches('"'));
            if key.eq_ignore_ascii_case("q") {
                weight = value.parse::<f64>().unwrap_or(0.0);
            } else {
                params.push((key, value));
            }
        }
        (name, params, weight)
    })
}

impl Exposition {
    /// The format the `Accept` header weighs highest, as Prometheus' own scrapers and
    /// client libraries negotiate (the first listed wins a tie); the classic text
    /// format when nothing we write is asked for, or for `*/*`.
    pub fn negotiate(accept: Option<&str>) -> Self {
        let mut best = (Self::Text(Format::Text), 0.0);
        for (media_type, params, weight) in weighted_items(accept.unwrap_or_default()) {
            let param = |name: &str| {
                params
                    .iter()
                    .find(|(key, _)| key.eq_ignore_ascii_case(name))
                    .map(|&(_, value)| value)
            };
            let offered = match media_type.to_ascii_lowercase().as_str() {
                "application/vnd.google.protobuf"
                    if param("proto") == Some("io.prometheus.client.MetricFamily")
                        && param("encoding") == Some("delimited") =>
                {
                    Self::Protobuf
                }
                "application/openmetrics-text" => Self::Text(Format::OpenMetrics),
                "text/plain" | "text/*" | "*/*" => Self::Text(Format::Text),
                _ => continue,
            };
            if weight > best.1 {
                best = (offered, weight);
            }
        }
        best.0
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Self::Text(Format::Text) => "text/plain; version=0.0.4; charset=utf-8",
            Self::Text(Format::OpenMetrics) => {
                "application/openmetrics-text; version=1.0.0; charset=utf-8"
            }
            Self::Protobuf => {
                "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily; \
                 encoding=delimited"
            }
        }
    }

    /// `families` in this exposition, in a buffer kept from an earlier scrape.
    pub fn render(self, families: &[Family]) -> Body {
        let mut body = Body::new();
        let buffer = body.buffer();
        match self {
            Self::Text(format) => {
                // Empty, so valid UTF-8 whatever it held before.
                let mut out = String::from_utf8(std::mem::take(buffer)).unwrap_or_default();
                render_into(families, format, &mut out);
                *buffer = out.into_bytes();
            }
            Self::Protobuf => protobuf::render_into(families, buffer),
        }
        body
    }
}

/// Keeps at most `max_series` series over `families` (in order; a histogram or
/// summary is kept whole or dropped whole); returns how many series were dropped.
/// Families left empty are removed.
pub fn cap_series(families: &mut Vec<Family>, max_series: usize) -> u64 {
    let mut budget = max_series;
    let mut dropped = 0u64;
    for family in families.iter_mut() {
        family.samples.retain(|sample| {
            let series = sample.value.series();
            if series <= budget {
                budget -= series;
                true
            } else {
                dropped += series as u64;
                false
            }
        });
    }
    families.retain(|family| !family.samples.is_empty());
    dropped
}

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
fn render_into(families: &[Family], format: Format, out: &mut String) {
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

    fn families() -> Vec<Family> {
        vec![
            Family::new("requests", Kind::Counter, "Requests \\ done\nso far.")
                .with(&[("service", "a\"b\\c\nd")], 3.0),
            Family::new("queue_depth", Kind::Gauge, "Queue depth.")
                .with(&[("service", "x")], 0.25)
                .with(&[("service", "y")], 7.0),
        ]
    }

    #[test]
    fn text_format() {
        let text = render(&families(), Format::Text);
        assert_eq!(
            text,
            "# HELP poolscope_requests_total Requests \\\\ done\\nso far.\n\
             # TYPE poolscope_requests_total counter\n\
             poolscope_requests_total{service=\"a\\\"b\\\\c\\nd\"} 3\n\
             # HELP poolscope_queue_depth Queue depth.\n\
             # TYPE poolscope_queue_depth gauge\n\
             poolscope_queue_depth{service=\"x\"} 0.25\n\
             poolscope_queue_depth{service=\"y\"} 7\n"
        );
    }

    #[test]
    fn openmetrics_format() {
        let text = render(&families(), Format::OpenMetrics);
        assert!(text.starts_with("# HELP poolscope_requests Requests"));
        assert!(text.contains("# TYPE poolscope_requests counter\npoolscope_requests_total{"));
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn negotiation_by_weight() {
        use Exposition::{Protobuf, Text};
        // Prometheus 2.42's Accept headers, without and with native histograms on.
        let classic = "application/openmetrics-text;version=1.0.0,\
                       application/openmetrics-text;version=0.0.1;q=0.75,\
                       text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        let native = "application/vnd.google.protobuf;\
                      proto=io.prometheus.client.MetricFamily;encoding=delimited,\
                      application/openmetrics-text;version=1.0.0;q=0.8,\
                      application/openmetrics-text;version=0.0.1;q=0.75,\
                      text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        for (accept, expected) in [
            (None, Text(Format::Text)),
            (Some(""), Text(Format::Text)),
            (Some("text/plain;version=0.0.4"), Text(Format::Text)),
            (Some(classic), Text(Format::OpenMetrics)),
            (Some(native), Protobuf),
            // By weight, not by order; the first of equals.
            (
                Some("text/plain;q=0.9, application/openmetrics-text;q=0.3"),
                Text(Format::Text),
            ),
            (
                Some("text/plain;q=0.3, application/openmetrics-text; q=0.9"),
                Text(Format::OpenMetrics),
            ),
            (
                Some("*/*, application/openmetrics-text"),
                Text(Format::Text),
            ),
            // Protobuf only as Prometheus' delimited MetricFamily stream.
            (Some("application/vnd.google.protobuf"), Text(Format::Text)),
            (
                Some(
                    "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=text",
                ),
                Text(Format::Text),
            ),
            // Refused (q=0) or unreadable weights are never chosen.
            (Some("application/openmetrics-text;q=0"), Text(Format::Text)),
            (
                Some("application/openmetrics-text;q=high"),
                Text(Format::Text),
            ),
            (Some("image/png"), Text(Format::Text)),
        ] {
            assert_eq!(Exposition::negotiate(accept), expected, "{accept:?}");
        }
    }

    #[test]
    fn cap_drops_and_counts_the_rest() {
        let mut families = families();
        assert_eq!(cap_series(&mut families, 2), 1);
        assert_eq!(families.iter().map(|f| f.samples.len()).sum::<usize>(), 2);
        let mut families = self::families();
        assert_eq!(cap_series(&mut families, 1), 2);
        assert_eq!(families.len(), 1);
    }

    #[test]
    fn histograms_and_summaries() {
        let families = vec![
            Family::new("request_duration_seconds", Kind::Histogram, "Durations.").with_value(
                &[("service", "web")],
                Value::histogram(vec![(0.5, 1), (1.0, 3)], 2.25, 4, None),
            ),
            Family::new("request_duration_window_seconds", Kind::Summary, "Window.")
                .with_value(&[], Value::summary(vec![(0.5, 0.75)], Some((2.25, 4)))),
        ];
        assert_eq!(
            render(&families, Format::Text),
            "# HELP poolscope_request_duration_seconds Durations.\n\
             # TYPE poolscope_request_duration_seconds histogram\n\
             poolscope_request_duration_seconds_bucket{service=\"web\",le=\"0.5\"} 1\n\
             poolscope_request_duration_seconds_bucket{service=\"web\",le=\"1\"} 3\n\
             poolscope_request_duration_seconds_bucket{service=\"web\",le=\"+Inf\"} 4\n\
             poolscope_request_duration_seconds_sum{service=\"web\"} 2.25\n\
             poolscope_request_duration_seconds_count{service=\"web\"} 4\n\
             # HELP poolscope_request_duration_window_seconds Window.\n\
             # TYPE poolscope_request_duration_window_seconds summary\n\
             poolscope_request_duration_window_seconds{quantile=\"0.5\"} 0.75\n\
             poolscope_request_duration_window_seconds_sum 2.25\n\
             poolscope_request_duration_window_seconds_count 4\n"
        );
        // A histogram is capped whole: 5 lines do not fit in 4.
        let mut capped = families.clone();
        assert_eq!(cap_series(&mut capped, 4), 5);
        assert_eq!(capped.len(), 1);
        assert_eq!(capped[0].kind, Kind::Summary);
    }

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
    fn summaries_without_totals_keep_their_labels() {
        let families = vec![
            Family::new("wait_seconds", Kind::Summary, "Waits.")
                .with_value(
                    &[("service", "a\"b"), ("pool", "w")],
                    Value::summary(vec![(0.99, 0.5)], None),
                )
                .with_value(
                    &[("service", "c"), ("pool", "w")],
                    Value::summary(Vec::new(), Some((1.5, 3))),
                ),
        ];
        assert_eq!(
            render(&families, Format::Text),
            "# HELP poolscope_wait_seconds Waits.\n\
             # TYPE poolscope_wait_seconds summary\n\
             poolscope_wait_seconds{service=\"a\\\"b\",pool=\"w\",quantile=\"0.99\"} 0.5\n\
             poolscope_wait_seconds_sum{service=\"c\",pool=\"w\"} 1.5\n\
             poolscope_wait_seconds_count{service=\"c\",pool=\"w\"} 3\n"
        );
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

/// Property tests (the exposition fuzz target): any label value and any number make
/// lines a strict parser reads back to the same values; the cap never lets more
/// series through than asked.
#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::*;

    /// One sample line read back: name, unescaped labels, value text.
    type Line<'a> = (&'a str, Vec<(String, String)>, &'a str);

    fn parse_line(line: &str) -> Option<Line<'_>> {
        let brace = line.find('{');
        let (name, mut rest) = match brace {
            Some(at) => (&line[..at], &line[at + 1..]),
            None => {
                let (name, value) = line.split_once(' ')?;
                return Some((name, Vec::new(), value));
            }
        };
        let mut labels = Vec::new();
        loop {
            let (key, after) = rest.split_once("=\"")?;
            let mut value = String::new();
            let mut chars = after.char_indices();
            let end = loop {
                match chars.next()? {
                    (_, '\\') => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        escaped @ ('\\' | '"') => value.push(escaped),
                        _ => return None,
                    },
                    (at, '"') => break at,
                    (_, c) => value.push(c),
                }
            };
            labels.push((key.to_owned(), value));
            rest = &after[end + 1..];
            match rest.strip_prefix(',') {
                Some(next) => rest = next,
                None => break,
            }
        }
        let value = rest.strip_prefix("} ")?;
        Some((name, labels, value))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn any_label_value_and_number_reads_back(
            service in any::<String>(),
            pool in "[\\\\\"\n{}a-z\u{fffd}]{0,12}",
            value in any::<f64>(),
            openmetrics in any::<bool>(),
        ) {
            let format = if openmetrics { Format::OpenMetrics } else { Format::Text };
            let families = [Family::new("queue_depth", Kind::Gauge, "Depth \\ \"of\"\nqueues.")
                .with(&[("service", &service), ("pool", &pool)], value)];
            let text = render(&families, format);
            let samples: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
            prop_assert_eq!(samples.len(), 1, "{}", text);
            let (name, labels, number) = parse_line(samples[0]).ok_or_else(|| {
                TestCaseError::fail(format!("unparsable line {:?}", samples[0]))
            })?;
            prop_assert_eq!(name, "poolscope_queue_depth");
            prop_assert_eq!(
                labels,
                vec![("service".to_owned(), service), ("pool".to_owned(), pool)]
            );
            let read = match number {
                "NaN" => f64::NAN,
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                other => other.parse().map_err(|_| TestCaseError::fail(other.to_owned()))?,
            };
            prop_assert!(
                read == value || (read.is_nan() && value.is_nan()),
                "{} read back as {}",
                value,
                read
            );
            prop_assert_eq!(text.ends_with("# EOF\n"), openmetrics);
        }

        #[test]
        fn the_cap_lets_no_more_series_through_than_asked(
            sizes in proptest::collection::vec(0usize..40, 0..20),
            max_series in 0usize..400,
        ) {
            let mut families: Vec<Family> = sizes
                .iter()
                .map(|&size| {
                    let mut family = Family::new("requests", Kind::Counter, "Requests.");
                    for index in 0..size {
                        family.push(&[("service", &index.to_string())], 1.0);
                    }
                    family
                })
                .collect();
            let before: usize = families.iter().map(|f| f.samples.len()).sum();
            let dropped = cap_series(&mut families, max_series);
            let after: usize = families.iter().map(|f| f.samples.len()).sum();
            prop_assert!(after <= max_series);
            prop_assert_eq!(after as u64 + dropped, before as u64);
        }
    }
}
