//! poolscope's log on stderr, in the format `[log] format` names: `text` (tracing's
//! readable lines, the default), `logfmt` (`ts=… level=… msg=…`, as Prometheus and
//! its exporters write) or `json` (one object per line, for log pipelines). The
//! level can change on reload; the format is set once.
use std::fmt;

use tracing::{
    Event, Subscriber,
    field::{Field, Visit},
};
use tracing_subscriber::{
    filter::LevelFilter,
    fmt::{
        FmtContext, FormatEvent, FormatFields,
        format::Writer,
        time::{FormatTime as _, SystemTime},
    },
    layer::SubscriberExt as _,
    registry::LookupSpan,
    reload,
    util::SubscriberInitExt as _,
};

use crate::config::LogFormat;

pub type LogHandle = reload::Handle<LevelFilter, tracing_subscriber::Registry>;

/// Installs the log at `level` in `format`; the handle changes the level later.
pub fn init(level: LevelFilter, format: LogFormat) -> LogHandle {
    let (filter, handle) = reload::Layer::new(level);
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(
            format == LogFormat::Text && std::io::IsTerminal::is_terminal(&std::io::stderr()),
        );
    let registry = tracing_subscriber::registry().with(filter);
    match format {
        LogFormat::Text => registry.with(layer).init(),
        LogFormat::Logfmt => registry.with(layer.event_format(Logfmt)).init(),
        LogFormat::Json => registry.with(layer.json().flatten_event(true)).init(),
    }
    handle
}

/// logfmt: `ts=<RFC 3339> level=<level> target=<module> msg="…"` and each field as
/// `key=value`, values quoted when they hold a space, a quote, `=` or are empty.
pub struct Logfmt;

impl<S, N> FormatEvent<S, N> for Logfmt
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _context: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let metadata = event.metadata();
        write!(writer, "ts=")?;
        SystemTime.format_time(&mut writer)?;
        let level = metadata.level().as_str().to_ascii_lowercase();
        write!(writer, " level={level} target={}", metadata.target())?;
        let mut fields = Fields {
            line: String::new(),
        };
        event.record(&mut fields);
        writeln!(writer, "{}", fields.line)
    }
}

/// The event's fields, as ` key=value` pairs.
struct Fields {
    line: String,
}

impl Fields {
    fn push(&mut self, key: &str, value: &str) {
        let key = if key == "message" { "msg" } else { key };
        self.line.push(' ');
        self.line.push_str(key);
        self.line.push('=');
        self.line.push_str(&logfmt_value(value));
    }
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.push(field.name(), value);
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.push(field.name(), &format!("{value:?}"));
    }
}

/// A logfmt value: as is when plain, else quoted with `\`, `"` and control
/// characters escaped.
pub fn logfmt_value(value: &str) -> String {
    let plain = !value.is_empty()
        && !value
            .chars()
            .any(|c| c == ' ' || c == '"' || c == '=' || c == '\\' || c.is_control());
    if plain {
        return value.to_owned();
    }
    let mut quoted = String::with_capacity(value.len() + 2);
    quoted.push('"');
    for c in value.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            '\n' => quoted.push_str("\\n"),
            '\t' => quoted.push_str("\\t"),
            c if c.is_control() => quoted.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tracing_subscriber::layer::SubscriberExt as _;

    use super::{Logfmt, logfmt_value};

    #[test]
    fn values_are_quoted_only_when_they_must_be() {
        assert_eq!(logfmt_value("E2BIG"), "E2BIG");
        assert_eq!(logfmt_value("127.0.0.1:9435"), "127.0.0.1:9435");
        assert_eq!(logfmt_value(""), "\"\"");
        assert_eq!(logfmt_value("two words"), "\"two words\"");
        assert_eq!(logfmt_value("a=\"b\"\\\nc"), "\"a=\\\"b\\\"\\\\\\nc\"");
    }

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .map_err(|_| std::io::Error::other("poisoned"))?
                .extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn an_event_is_one_logfmt_line() {
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .with_writer(move || writer.clone())
                .event_format(Logfmt),
        );
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(
                map = "LOCKS",
                errno = "E2BIG",
                capacity = 1,
                "kernel map is full"
            );
        });
        let bytes = buffer.0.lock().map(|b| b.clone()).unwrap_or_default();
        let line = String::from_utf8_lossy(&bytes);
        assert!(line.starts_with("ts=20"), "{line}");
        assert!(
            line.ends_with(
                " level=warn target=poolscope::logging::tests msg=\"kernel map is full\" \
                 map=LOCKS errno=E2BIG capacity=1\n"
            ),
            "{line}"
        );
    }
}
