//! The Prometheus protobuf exposition (`io.prometheus.client.MetricFamily`, each
//! message length-delimited): what Prometheus asks for when it ingests native
//! histograms. Histograms carry both their classic buckets and their native ones;
//! Prometheus keeps the native histogram, one series, when it has native histograms on.
use super::{Family, HistogramValue, Kind, NativeBuckets, SummaryValue, Value};

/// The messages of `io.prometheus.client` (github.com/prometheus/client_model,
/// io/prometheus/client/metrics.proto, proto2) that poolscope writes, declared for
/// prost (no protoc needed) to read back what [`Writer`] wrote. Tags are the proto's;
/// proto2's repeated scalars are unpacked.
#[cfg(test)]
mod pb {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct MetricFamily {
        #[prost(string, optional, tag = "1")]
        pub name: Option<String>,
        #[prost(string, optional, tag = "2")]
        pub help: Option<String>,
        #[prost(enumeration = "MetricType", optional, tag = "3")]
        pub r#type: Option<i32>,
        #[prost(message, repeated, tag = "4")]
        pub metric: Vec<Metric>,
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq, prost::Enumeration)]
    #[repr(i32)]
    pub enum MetricType {
        Counter = 0,
        Gauge = 1,
        Summary = 2,
        Histogram = 4,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Metric {
        #[prost(message, repeated, tag = "1")]
        pub label: Vec<LabelPair>,
        #[prost(message, optional, tag = "2")]
        pub gauge: Option<Single>,
        #[prost(message, optional, tag = "3")]
        pub counter: Option<Single>,
        #[prost(message, optional, tag = "4")]
        pub summary: Option<Summary>,
        #[prost(message, optional, tag = "7")]
        pub histogram: Option<Histogram>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct LabelPair {
        #[prost(string, optional, tag = "1")]
        pub name: Option<String>,
        #[prost(string, optional, tag = "2")]
        pub value: Option<String>,
    }

    /// `Gauge` and `Counter`: one value at tag 1.
    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct Single {
        #[prost(double, optional, tag = "1")]
        pub value: Option<f64>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Summary {
        #[prost(uint64, optional, tag = "1")]
        pub sample_count: Option<u64>,
        #[prost(double, optional, tag = "2")]
        pub sample_sum: Option<f64>,
        #[prost(message, repeated, tag = "3")]
        pub quantile: Vec<Quantile>,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct Quantile {
        #[prost(double, optional, tag = "1")]
        pub quantile: Option<f64>,
        #[prost(double, optional, tag = "2")]
        pub value: Option<f64>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Histogram {
        #[prost(uint64, optional, tag = "1")]
        pub sample_count: Option<u64>,
        #[prost(double, optional, tag = "2")]
        pub sample_sum: Option<f64>,
        #[prost(message, repeated, tag = "3")]
        pub bucket: Vec<Bucket>,
        #[prost(sint32, optional, tag = "5")]
        pub schema: Option<i32>,
        #[prost(double, optional, tag = "6")]
        pub zero_threshold: Option<f64>,
        #[prost(uint64, optional, tag = "7")]
        pub zero_count: Option<u64>,
        #[prost(message, repeated, tag = "12")]
        pub positive_span: Vec<BucketSpan>,
        #[prost(sint64, repeated, packed = "false", tag = "13")]
        pub positive_delta: Vec<i64>,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct Bucket {
        #[prost(uint64, optional, tag = "1")]
        pub cumulative_count: Option<u64>,
        #[prost(double, optional, tag = "2")]
        pub upper_bound: Option<f64>,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct BucketSpan {
        #[prost(sint32, optional, tag = "1")]
        pub offset: Option<i32>,
        #[prost(uint32, optional, tag = "2")]
        pub length: Option<u32>,
    }
}

/// The protobuf wire types poolscope writes.
#[derive(Clone, Copy)]
enum Wire {
    Varint = 0,
    Fixed64 = 1,
    Len = 2,
}

/// Field numbers of the messages above, and `MetricType` values.
mod tag {
    pub const FAMILY_NAME: u32 = 1;
    pub const FAMILY_HELP: u32 = 2;
    pub const FAMILY_TYPE: u32 = 3;
    pub const FAMILY_METRIC: u32 = 4;
    pub const METRIC_LABEL: u32 = 1;
    pub const METRIC_GAUGE: u32 = 2;
    pub const METRIC_COUNTER: u32 = 3;
    pub const METRIC_SUMMARY: u32 = 4;
    pub const METRIC_HISTOGRAM: u32 = 7;
    pub const LABEL_NAME: u32 = 1;
    pub const LABEL_VALUE: u32 = 2;
    pub const SINGLE_VALUE: u32 = 1;
    pub const SAMPLE_COUNT: u32 = 1;
    pub const SAMPLE_SUM: u32 = 2;
    pub const SUMMARY_QUANTILE: u32 = 3;
    pub const QUANTILE_QUANTILE: u32 = 1;
    pub const QUANTILE_VALUE: u32 = 2;
    pub const HISTOGRAM_BUCKET: u32 = 3;
    pub const HISTOGRAM_SCHEMA: u32 = 5;
    pub const HISTOGRAM_ZERO_THRESHOLD: u32 = 6;
    pub const HISTOGRAM_ZERO_COUNT: u32 = 7;
    pub const HISTOGRAM_POSITIVE_SPAN: u32 = 12;
    pub const HISTOGRAM_POSITIVE_DELTA: u32 = 13;
    pub const BUCKET_CUMULATIVE_COUNT: u32 = 1;
    pub const BUCKET_UPPER_BOUND: u32 = 2;
    pub const SPAN_OFFSET: u32 = 1;
    pub const SPAN_LENGTH: u32 = 2;

    pub const COUNTER: u64 = 0;
    pub const GAUGE: u64 = 1;
    pub const SUMMARY: u64 = 2;
    pub const HISTOGRAM: u64 = 4;
}

/// `value` as a varint: its bytes and how many of them are used.
fn varint_bytes(mut value: u64) -> ([u8; 10], usize) {
    let mut bytes = [0u8; 10];
    let mut length = 0;
    while value >= 0x80 {
        bytes[length] = (value as u8) | 0x80;
        value >>= 7;
        length += 1;
    }
    bytes[length] = value as u8;
    (bytes, length + 1)
}

/// Writes the wire format straight into one buffer: no message structs, no string
/// copies (a scrape writes thousands of metrics).
struct Writer(Vec<u8>);

impl Writer {
    fn varint(&mut self, value: u64) {
        let (bytes, length) = varint_bytes(value);
        self.0.extend_from_slice(&bytes[..length]);
    }

    fn key(&mut self, field: u32, wire: Wire) {
        self.varint(u64::from(field << 3 | wire as u32));
    }

    fn double(&mut self, field: u32, value: f64) {
        self.key(field, Wire::Fixed64);
        self.0.extend_from_slice(&value.to_le_bytes());
    }

    fn uint(&mut self, field: u32, value: u64) {
        self.key(field, Wire::Varint);
        self.varint(value);
    }

    /// `sint32`/`sint64`: zigzag, so that small negative numbers stay short.
    fn sint(&mut self, field: u32, value: i64) {
        self.uint(field, ((value << 1) ^ (value >> 63)) as u64);
    }

    fn string(&mut self, field: u32, value: &str) {
        self.key(field, Wire::Len);
        self.varint(value.len() as u64);
        self.0.extend_from_slice(value.as_bytes());
    }

    /// A message `body` writes, as field `field` (or, without, as one record of the
    /// length-delimited stream): its length goes before it once it is written.
    fn message(&mut self, field: Option<u32>, body: impl FnOnce(&mut Self)) {
        if let Some(field) = field {
            self.key(field, Wire::Len);
        }
        let start = self.0.len();
        body(self);
        let (prefix, prefix_length) = varint_bytes((self.0.len() - start) as u64);
        self.0
            .splice(start..start, prefix[..prefix_length].iter().copied());
    }

    fn labels<'a>(
        &mut self,
        labels: impl Iterator<Item = (&'static str, &'a str)>,
        extra: Option<(&'static str, &'a str)>,
    ) {
        for (name, value) in labels.chain(extra) {
            self.message(Some(tag::METRIC_LABEL), |label| {
                label.string(tag::LABEL_NAME, name);
                label.string(tag::LABEL_VALUE, value);
            });
        }
    }

    /// Native buckets as spans (one per run of consecutive indexes, its offset the
    /// gap since the last span) and deltas (each count less the one before).
    fn native(&mut self, native: &NativeBuckets) {
        self.sint(tag::HISTOGRAM_SCHEMA, i64::from(native.schema));
        self.double(tag::HISTOGRAM_ZERO_THRESHOLD, native.zero_threshold);
        self.uint(tag::HISTOGRAM_ZERO_COUNT, native.zero_count);
        let mut buckets = native.positive.iter().peekable();
        let mut next_index = None::<i32>;
        while let Some(&(first, _)) = buckets.next() {
            let mut length = 1u64;
            while buckets
                .next_if(|&&(index, _)| index == first + length as i32)
                .is_some()
            {
                length += 1;
            }
            self.message(Some(tag::HISTOGRAM_POSITIVE_SPAN), |span| {
                span.sint(
                    tag::SPAN_OFFSET,
                    i64::from(next_index.map_or(first, |next| first - next)),
                );
                span.uint(tag::SPAN_LENGTH, length);
            });
            next_index = Some(first + length as i32);
        }
        let mut previous = 0i64;
        for &(_, count) in &native.positive {
            let count = i64::try_from(count).unwrap_or(i64::MAX);
            self.sint(tag::HISTOGRAM_POSITIVE_DELTA, count - previous);
            previous = count;
        }
    }

    fn family(&mut self, family: &Family) {
        let (kind, suffix) = match family.kind {
            Kind::Counter => (tag::COUNTER, "_total"),
            Kind::Gauge => (tag::GAUGE, ""),
            Kind::Histogram => (tag::HISTOGRAM, ""),
            Kind::Summary => (tag::SUMMARY, ""),
        };
        let name = [family.prefix, family.name, suffix].concat();
        let header = |out: &mut Self, kind: u64| {
            out.string(tag::FAMILY_NAME, &name);
            out.string(tag::FAMILY_HELP, family.help);
            out.uint(tag::FAMILY_TYPE, kind);
        };
        // Quantiles without `_sum` and `_count` (the `_window` summaries): Prometheus
        // would read a protobuf summary's missing totals as zeros, two series of false
        // numbers; as gauges by `quantile` they are the series the text format makes.
        let quantiles_alone = |sample: &&super::Sample| match &sample.value {
            Value::Summary(summary) => summary.totals.is_none(),
            Value::Number(_) | Value::Histogram(_) => false,
        };
        if family
            .samples
            .iter()
            .any(|sample| !quantiles_alone(&sample))
        {
            self.message(None, |out| {
                header(out, kind);
                for sample in family.samples.iter().filter(|s| !quantiles_alone(s)) {
                    out.message(Some(tag::FAMILY_METRIC), |metric| {
                        metric.labels(family.labels(sample), None);
                        metric.value(family.kind, &sample.value);
                    });
                }
            });
        }
        if family.samples.iter().any(|sample| quantiles_alone(&sample)) {
            self.message(None, |out| {
                header(out, tag::GAUGE);
                for sample in family.samples.iter().filter(quantiles_alone) {
                    let Value::Summary(summary) = &sample.value else {
                        continue;
                    };
                    for &(quantile, value) in &summary.quantiles {
                        let quantile = quantile.to_string();
                        out.message(Some(tag::FAMILY_METRIC), |metric| {
                            metric.labels(family.labels(sample), Some(("quantile", &quantile)));
                            metric.message(Some(tag::METRIC_GAUGE), |gauge| {
                                gauge.double(tag::SINGLE_VALUE, value);
                            });
                        });
                    }
                }
            });
        }
    }

    /// The value of one metric, as the message its kind takes.
    fn value(&mut self, kind: Kind, value: &Value) {
        match value {
            Value::Number(number) => {
                let field = if kind == Kind::Counter {
                    tag::METRIC_COUNTER
                } else {
                    tag::METRIC_GAUGE
                };
                self.message(Some(field), |single| {
                    single.double(tag::SINGLE_VALUE, *number)
                });
            }
            Value::Histogram(value) => self.message(Some(tag::METRIC_HISTOGRAM), |histogram| {
                let HistogramValue {
                    buckets,
                    sum,
                    count,
                    native,
                } = &**value;
                histogram.uint(tag::SAMPLE_COUNT, *count);
                histogram.double(tag::SAMPLE_SUM, *sum);
                for &(upper_bound, cumulative) in buckets {
                    histogram.message(Some(tag::HISTOGRAM_BUCKET), |bucket| {
                        bucket.uint(tag::BUCKET_CUMULATIVE_COUNT, cumulative);
                        bucket.double(tag::BUCKET_UPPER_BOUND, upper_bound);
                    });
                }
                if let Some(native) = native {
                    histogram.native(native);
                }
            }),
            Value::Summary(value) => {
                let SummaryValue { quantiles, totals } = &**value;
                self.message(Some(tag::METRIC_SUMMARY), |summary| {
                    if let Some((sum, count)) = totals {
                        summary.uint(tag::SAMPLE_COUNT, *count);
                        summary.double(tag::SAMPLE_SUM, *sum);
                    }
                    for &(quantile, value) in quantiles {
                        summary.message(Some(tag::SUMMARY_QUANTILE), |pair| {
                            pair.double(tag::QUANTILE_QUANTILE, quantile);
                            pair.double(tag::QUANTILE_VALUE, value);
                        });
                    }
                });
            }
        }
    }
}

/// Every family, each as a length-delimited `MetricFamily`.
#[cfg(test)]
pub fn render(families: &[Family]) -> Vec<u8> {
    let mut out = Vec::with_capacity(families.len() * 256);
    render_into(families, &mut out);
    out
}

/// [`render`] appended to `out`.
pub fn render_into(families: &[Family], out: &mut Vec<u8>) {
    let mut writer = Writer(std::mem::take(out));
    for family in families {
        writer.family(family);
    }
    *out = writer.0;
}

#[cfg(test)]
mod tests {
    use super::*;

    use prost::Message as _;

    fn decode(bytes: &[u8]) -> Vec<pb::MetricFamily> {
        let mut rest = bytes;
        let mut families = Vec::new();
        while !rest.is_empty() {
            match pb::MetricFamily::decode_length_delimited(&mut rest) {
                Ok(family) => families.push(family),
                Err(error) => panic!("undecodable at {}: {error}", bytes.len() - rest.len()),
            }
        }
        families
    }

    /// The histogram of the one metric `render` wrote for `native`.
    fn native_read_back(native: NativeBuckets) -> pb::Histogram {
        let family = Family::new("latency_seconds", Kind::Histogram, "Latency.").with_value(
            &[],
            Value::histogram(
                Vec::new(),
                1.0,
                native.zero_count + native.positive.iter().map(|&(_, c)| c).sum::<u64>(),
                Some(native),
            ),
        );
        let read = decode(&render(&[family]));
        read[0].metric[0].histogram.clone().unwrap_or_default()
    }

    #[test]
    fn spans_follow_runs_of_indexes_and_deltas_the_counts() {
        let histogram = native_read_back(NativeBuckets {
            schema: 4,
            zero_threshold: 1e-6,
            zero_count: 3,
            positive: vec![(-3, 2), (-2, 5), (4, 1), (5, 1), (6, 7), (300, 1)],
        });
        let spans: Vec<(i32, u32)> = histogram
            .positive_span
            .iter()
            .map(|span| (span.offset.unwrap_or(0), span.length.unwrap_or(0)))
            .collect();
        assert_eq!(spans, [(-3, 2), (5, 3), (293, 1)]);
        assert_eq!(histogram.positive_delta, [2, 3, -4, 0, 6, -6]);
        assert_eq!(histogram.schema, Some(4));
        assert_eq!(histogram.zero_count, Some(3));
        assert_eq!(histogram.sample_count, Some(20));
        let empty = native_read_back(NativeBuckets::default());
        assert!(empty.positive_span.is_empty() && empty.positive_delta.is_empty());
    }

    #[test]
    fn lengths_past_one_byte_and_escapes_read_back() {
        // A label value of 300 bytes (a two-byte length) with bytes text escapes.
        let long = "\"\\\n".repeat(100);
        let family = Family::new("queue_depth", Kind::Gauge, "Depth.")
            .with(&[("service", &long), ("pool", "")], -2.5);
        let read = decode(&render(&[family]));
        let labels: Vec<(Option<String>, Option<String>)> = read[0].metric[0]
            .label
            .iter()
            .map(|label| (label.name.clone(), label.value.clone()))
            .collect();
        assert_eq!(
            labels,
            [
                (Some("service".to_owned()), Some(long)),
                (Some("pool".to_owned()), Some(String::new()))
            ]
        );
        assert_eq!(read[0].metric[0].gauge.and_then(|g| g.value), Some(-2.5));
    }

    #[test]
    fn families_read_back_with_their_types_names_and_values() {
        let families = [
            Family::new("requests", Kind::Counter, "Requests.").with(&[("service", "a")], 3.0),
            Family::new("queue_depth", Kind::Gauge, "Depth.").with(&[("service", "a")], 0.0),
            Family::new("request_latency_seconds", Kind::Histogram, "Latency.").with_value(
                &[("service", "a")],
                Value::histogram(
                    vec![(0.5, 1), (1.0, 3)],
                    2.25,
                    4,
                    Some(NativeBuckets {
                        schema: 4,
                        zero_threshold: 1e-6,
                        zero_count: 1,
                        positive: vec![(-16, 1), (0, 2)],
                    }),
                ),
            ),
            Family::new("request_latency_window_seconds", Kind::Summary, "Window.").with_value(
                &[("service", "a")],
                Value::summary(vec![(0.5, 0.75), (0.99, 1.0)], None),
            ),
            Family::new("pool_wait_seconds", Kind::Summary, "Mean.")
                .with_value(&[], Value::summary(vec![], Some((1.5, 2)))),
        ];
        let read = decode(&render(&families));
        let names: Vec<(&str, Option<i32>)> = read
            .iter()
            .map(|family| (family.name.as_deref().unwrap_or(""), family.r#type))
            .collect();
        assert_eq!(
            names,
            [
                ("poolscope_requests_total", Some(0)),
                ("poolscope_queue_depth", Some(1)),
                ("poolscope_request_latency_seconds", Some(4)),
                ("poolscope_request_latency_window_seconds", Some(1)),
                ("poolscope_pool_wait_seconds", Some(2)),
            ]
        );
        assert_eq!(read[0].metric[0].counter.and_then(|c| c.value), Some(3.0));
        assert_eq!(read[1].metric[0].gauge.and_then(|g| g.value), Some(0.0));
        let histogram = read[2].metric[0].histogram.clone().unwrap_or_default();
        assert_eq!(histogram.sample_count, Some(4));
        assert_eq!(histogram.bucket.len(), 2);
        assert_eq!((histogram.schema, histogram.zero_count), (Some(4), Some(1)));
        assert_eq!(histogram.positive_delta, [1, 1]);
        let quantiles: Vec<(String, Option<f64>)> = read[3]
            .metric
            .iter()
            .map(|metric| {
                let labels = metric.label.iter().map(|label| {
                    format!(
                        "{}={}",
                        label.name.as_deref().unwrap_or(""),
                        label.value.as_deref().unwrap_or("")
                    )
                });
                (
                    labels.collect::<Vec<_>>().join(","),
                    metric.gauge.and_then(|g| g.value),
                )
            })
            .collect();
        assert_eq!(
            quantiles,
            [
                ("service=a,quantile=0.5".to_owned(), Some(0.75)),
                ("service=a,quantile=0.99".to_owned(), Some(1.0)),
            ]
        );
        let summary = read[4].metric[0].summary.clone().unwrap_or_default();
        assert_eq!(
            (summary.sample_count, summary.sample_sum),
            (Some(2), Some(1.5))
        );
    }
}
