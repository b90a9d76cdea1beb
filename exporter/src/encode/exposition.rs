//! What a scrape is answered in ([`Exposition`]: one of the text [`Format`]s or the
//! protobuf exposition), negotiated from the scraper's `Accept` header, and rendered
//! into a buffer kept from an earlier scrape.
use super::{Body, Family, protobuf, text::render_into};

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
