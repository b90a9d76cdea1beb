//! Metric families and the series cap; their three wire formats: Prometheus text
//! 0.0.4 and OpenMetrics 1.0 (`text`) and the protobuf exposition (with native
//! histograms, `protobuf`), chosen by the scraper's Accept header (`exposition`).
//! Pure functions.
//!
//! (prometheus-client only writes OpenMetrics; the classic text format is what
//! `promtool check metrics` and older scrapers read, so both are written here.)
mod exposition;
mod protobuf;
mod spare;
mod text;

pub use exposition::{Exposition, Format, weighted_items};
pub use spare::{Body, gzip};
pub use text::render;

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
