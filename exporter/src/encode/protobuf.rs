//! The Prometheus protobuf exposition (`io.prometheus.client.MetricFamily`, each
//! message length-delimited): what Prometheus asks for when it ingests native
//! histograms. Histograms carry both their classic buckets and their native ones;
//! Prometheus keeps the native histogram, one series, when it has native histograms on.
use prost::Message as _;

use super::{Family, Kind, NativeBuckets, Value};

/// The messages of `io.prometheus.client` (github.com/prometheus/client_model,
/// io/prometheus/client/metrics.proto, proto2) that poolscope writes, by hand so that
/// no protoc is needed. Tags are the proto's; proto2's repeated scalars are unpacked.
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

/// Spans and deltas of sparse native buckets (ascending index): a span per run of
/// consecutive indexes, its offset the gap since the last span; each count as the
/// difference from the previous bucket's.
fn spans_and_deltas(native: &NativeBuckets) -> (Vec<pb::BucketSpan>, Vec<i64>) {
    let mut spans: Vec<pb::BucketSpan> = Vec::new();
    let mut deltas = Vec::with_capacity(native.positive.len());
    let (mut next_index, mut previous_count) = (None::<i32>, 0i64);
    for &(index, count) in &native.positive {
        let count = i64::try_from(count).unwrap_or(i64::MAX);
        match (next_index, spans.last_mut()) {
            (Some(next), Some(span)) if next == index => {
                span.length = Some(span.length.unwrap_or(0) + 1);
            }
            _ => spans.push(pb::BucketSpan {
                offset: Some(next_index.map_or(index, |next| index - next)),
                length: Some(1),
            }),
        }
        deltas.push(count - previous_count);
        previous_count = count;
        next_index = Some(index + 1);
    }
    (spans, deltas)
}

fn labels(
    family: &Family,
    sample: &super::Sample,
    extra: Option<(&str, String)>,
) -> Vec<pb::LabelPair> {
    family
        .labels(sample)
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .chain(extra.map(|(name, value)| (name.to_owned(), value)))
        .map(|(name, value)| pb::LabelPair {
            name: Some(name),
            value: Some(value),
        })
        .collect()
}

fn family_message(family: &Family) -> Vec<pb::MetricFamily> {
    let base = format!("{}{}", family.prefix, family.name);
    let (kind, name) = match family.kind {
        Kind::Counter => (pb::MetricType::Counter, format!("{base}_total")),
        Kind::Gauge => (pb::MetricType::Gauge, base.clone()),
        Kind::Histogram => (pb::MetricType::Histogram, base.clone()),
        Kind::Summary => (pb::MetricType::Summary, base.clone()),
    };
    let mut main = pb::MetricFamily {
        name: Some(name),
        help: Some(family.help.to_owned()),
        r#type: Some(kind as i32),
        metric: Vec::with_capacity(family.samples.len()),
    };
    // Quantiles without `_sum` and `_count` (the `_window` summaries): Prometheus
    // would read a protobuf summary's missing totals as zeros, two series of false
    // numbers; as gauges by `quantile` they are the series the text format makes.
    let mut quantile_gauges = pb::MetricFamily {
        r#type: Some(pb::MetricType::Gauge as i32),
        metric: Vec::new(),
        ..main.clone()
    };
    for sample in &family.samples {
        let single = |value: f64| Some(pb::Single { value: Some(value) });
        let mut metric = pb::Metric {
            label: labels(family, sample, None),
            ..pb::Metric::default()
        };
        match (&sample.value, family.kind) {
            (Value::Number(value), Kind::Counter) => metric.counter = single(*value),
            (Value::Number(value), _) => metric.gauge = single(*value),
            (
                Value::Histogram {
                    buckets,
                    sum,
                    count,
                    native,
                },
                _,
            ) => {
                let (positive_span, positive_delta) =
                    native.as_ref().map(spans_and_deltas).unwrap_or_default();
                metric.histogram = Some(pb::Histogram {
                    sample_count: Some(*count),
                    sample_sum: Some(*sum),
                    bucket: buckets
                        .iter()
                        .map(|&(upper_bound, cumulative_count)| pb::Bucket {
                            cumulative_count: Some(cumulative_count),
                            upper_bound: Some(upper_bound),
                        })
                        .collect(),
                    schema: native.as_ref().map(|native| native.schema),
                    zero_threshold: native.as_ref().map(|native| native.zero_threshold),
                    zero_count: native.as_ref().map(|native| native.zero_count),
                    positive_span,
                    positive_delta,
                });
            }
            (Value::Summary { quantiles, totals }, _) => {
                let Some((sum, count)) = totals else {
                    for &(quantile, value) in quantiles {
                        quantile_gauges.metric.push(pb::Metric {
                            label: labels(family, sample, Some(("quantile", quantile.to_string()))),
                            gauge: single(value),
                            ..pb::Metric::default()
                        });
                    }
                    continue;
                };
                metric.summary = Some(pb::Summary {
                    sample_count: Some(*count),
                    sample_sum: Some(*sum),
                    quantile: quantiles
                        .iter()
                        .map(|&(quantile, value)| pb::Quantile {
                            quantile: Some(quantile),
                            value: Some(value),
                        })
                        .collect(),
                });
            }
        }
        main.metric.push(metric);
    }
    [main, quantile_gauges]
        .into_iter()
        .filter(|family| !family.metric.is_empty())
        .collect()
}

/// Every family, each as a length-delimited `MetricFamily`.
pub fn render(families: &[Family]) -> Vec<u8> {
    let mut out = Vec::with_capacity(families.len() * 128);
    for family in families.iter().flat_map(family_message) {
        // Writing into a Vec cannot run out of room.
        let _ = family.encode_length_delimited(&mut out);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn spans_follow_runs_of_indexes_and_deltas_the_counts() {
        let native = NativeBuckets {
            schema: 4,
            zero_threshold: 1e-6,
            zero_count: 0,
            positive: vec![(-3, 2), (-2, 5), (4, 1), (5, 1), (6, 7)],
        };
        let (spans, deltas) = spans_and_deltas(&native);
        let spans: Vec<(i32, u32)> = spans
            .iter()
            .map(|span| (span.offset.unwrap_or(0), span.length.unwrap_or(0)))
            .collect();
        assert_eq!(spans, [(-3, 2), (5, 3)]);
        assert_eq!(deltas, [2, 3, -4, 0, 6]);
        assert_eq!(
            spans_and_deltas(&NativeBuckets::default()),
            (vec![], vec![])
        );
    }

    #[test]
    fn families_read_back_with_their_types_names_and_values() {
        let families = [
            Family::new("requests", Kind::Counter, "Requests.").with(&[("service", "a")], 3.0),
            Family::new("queue_depth", Kind::Gauge, "Depth.").with(&[("service", "a")], 0.0),
            Family::new("request_latency_seconds", Kind::Histogram, "Latency.").with_value(
                &[("service", "a")],
                Value::Histogram {
                    buckets: vec![(0.5, 1), (1.0, 3)],
                    sum: 2.25,
                    count: 4,
                    native: Some(NativeBuckets {
                        schema: 4,
                        zero_threshold: 1e-6,
                        zero_count: 1,
                        positive: vec![(-16, 1), (0, 2)],
                    }),
                },
            ),
            Family::new("request_latency_window_seconds", Kind::Summary, "Window.").with_value(
                &[("service", "a")],
                Value::Summary {
                    quantiles: vec![(0.5, 0.75), (0.99, 1.0)],
                    totals: None,
                },
            ),
            Family::new("pool_wait_seconds", Kind::Summary, "Mean.").with_value(
                &[],
                Value::Summary {
                    quantiles: vec![],
                    totals: Some((1.5, 2)),
                },
            ),
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
