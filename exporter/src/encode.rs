//! Metric families and their two wire formats: Prometheus text 0.0.4 and OpenMetrics
//! 1.0, chosen by the scraper's Accept header. Also the series cap. Pure functions.
//!
//! (prometheus-client only writes OpenMetrics; the classic text format is what
//! `promtool check metrics` and older scrapers read, so both are written here.)
use std::fmt::Write as _;

/// Every metric name starts with this.
pub const PREFIX: &str = "poolscope_";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    pub labels: Vec<(&'static str, String)>,
    pub value: f64,
}

/// A metric family; `name` has no prefix and, for counters, no `_total`.
#[derive(Clone, Debug, PartialEq)]
pub struct Family {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    pub samples: Vec<Sample>,
}

impl Family {
    pub fn new(name: &'static str, kind: Kind, help: &'static str) -> Self {
        Self {
            name,
            help,
            kind,
            samples: Vec::new(),
        }
    }

    pub fn with(mut self, labels: &[(&'static str, &str)], value: f64) -> Self {
        self.push(labels, value);
        self
    }

    pub fn push(&mut self, labels: &[(&'static str, &str)], value: f64) {
        self.samples.push(Sample {
            labels: labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect(),
            value,
        });
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `text/plain; version=0.0.4`
    Text,
    /// `application/openmetrics-text; version=1.0.0`
    OpenMetrics,
}

impl Format {
    /// OpenMetrics when the Accept header asks for it, else the classic text format.
    pub fn negotiate(accept: Option<&str>) -> Self {
        match accept {
            Some(accept) if accept.contains("application/openmetrics-text") => Self::OpenMetrics,
            _ => Self::Text,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Self::Text => "text/plain; version=0.0.4; charset=utf-8",
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }
}

/// Keeps at most `max_series` samples over `families` (in order); returns how many
/// were dropped. Families left empty are removed.
pub fn cap_series(families: &mut Vec<Family>, max_series: usize) -> u64 {
    let mut budget = max_series;
    let mut dropped = 0u64;
    for family in families.iter_mut() {
        let keep = family.samples.len().min(budget);
        dropped += (family.samples.len() - keep) as u64;
        family.samples.truncate(keep);
        budget -= keep;
    }
    families.retain(|family| !family.samples.is_empty());
    dropped
}

/// Label values: backslash, double quote and newline are escaped (both formats).
fn escape_label_value(value: &str, out: &mut String) {
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// HELP text: backslash and newline escaped (plus `"` in OpenMetrics).
fn escape_help(help: &str, format: Format, out: &mut String) {
    for c in help.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if format == Format::OpenMetrics => out.push_str("\\\""),
            c => out.push(c),
        }
    }
}

fn write_value(value: f64, out: &mut String) {
    if value.is_nan() {
        out.push_str("NaN");
    } else if value.is_infinite() {
        out.push_str(if value > 0.0 { "+Inf" } else { "-Inf" });
    } else if value.fract() == 0.0 && value.abs() < 1e15 {
        let _ = write!(out, "{}", value as i64);
    } else {
        let _ = write!(out, "{value}");
    }
}

/// Renders families in `format`.
pub fn render(families: &[Family], format: Format) -> String {
    let mut out = String::with_capacity(families.len() * 256);
    for family in families {
        let (kind, sample_suffix) = match family.kind {
            Kind::Counter => ("counter", "_total"),
            Kind::Gauge => ("gauge", ""),
        };
        // The family name carries `_total` in the text format, not in OpenMetrics.
        let family_suffix = if format == Format::Text {
            sample_suffix
        } else {
            ""
        };
        let _ = write!(out, "# HELP {PREFIX}{}{family_suffix} ", family.name);
        escape_help(family.help, format, &mut out);
        let _ = writeln!(
            out,
            "\n# TYPE {PREFIX}{}{family_suffix} {kind}",
            family.name
        );
        for sample in &family.samples {
            let _ = write!(out, "{PREFIX}{}{sample_suffix}", family.name);
            if !sample.labels.is_empty() {
                out.push('{');
                for (i, (name, value)) in sample.labels.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    let _ = write!(out, "{name}=\"");
                    escape_label_value(value, &mut out);
                    out.push('"');
                }
                out.push('}');
            }
            out.push(' ');
            write_value(sample.value, &mut out);
            out.push('\n');
        }
    }
    if format == Format::OpenMetrics {
        out.push_str("# EOF\n");
    }
    out
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
    fn negotiation() {
        assert_eq!(Format::negotiate(None), Format::Text);
        assert_eq!(
            Format::negotiate(Some("text/plain;version=0.0.4")),
            Format::Text
        );
        assert_eq!(
            Format::negotiate(Some(
                "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
            )),
            Format::OpenMetrics
        );
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
    fn special_values() {
        let mut out = String::new();
        write_value(f64::INFINITY, &mut out);
        out.push(' ');
        write_value(f64::NAN, &mut out);
        out.push(' ');
        write_value(1.5e-7, &mut out);
        assert_eq!(out, "+Inf NaN 0.00000015");
    }
}
