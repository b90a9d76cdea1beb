//! The on-demand profiling sessions' families (`profile_sessions_*`,
//! `profile_session_start_seconds`): what happened to the sessions asked for.
use super::{Collected, OwnReading, Timings};
use crate::{
    encode::{Family, Kind, Value},
    stacks::sessions::{START_BUCKETS, SessionCounts},
};

pub fn collect(own: &OwnReading<'_>, _: &Timings) -> Collected {
    Collected {
        families: families(own.profiles),
        whole: true,
    }
}

fn families(counts: &SessionCounts) -> Vec<Family> {
    let mut started = Family::new(
        "profile_sessions_started",
        Kind::Counter,
        "On-demand profiling sessions started, by kind.",
    );
    for (kind, count) in &counts.started {
        started.push(&[("kind", kind)], *count as f64);
    }
    let mut refused = Family::new(
        "profile_sessions_refused",
        Kind::Counter,
        "Profiling requests refused (or failed), by reason.",
    );
    for (reason, count) in &counts.refused {
        refused.push(&[("reason", reason)], *count as f64);
    }
    vec![
        Family::new(
            "profile_sessions_active",
            Kind::Gauge,
            "On-demand profiling sessions running now.",
        )
        .with(&[], f64::from(counts.active)),
        started,
        refused,
        Family::new(
            "profile_session_start_seconds",
            Kind::Histogram,
            "From a profiling request to its first on-CPU sample in the kernel.",
        )
        .with_value(
            &[],
            Value::histogram(
                START_BUCKETS
                    .iter()
                    .copied()
                    .zip(counts.start_buckets)
                    .collect(),
                counts.start_sum,
                counts.start_count,
                None,
            ),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{
        encode::{Format, render},
        stacks::{
            profile::View,
            sessions::{Refusal, Sessions},
        },
    };

    #[test]
    fn self_metrics_count_what_happened() {
        let mut sessions = Sessions::default();
        sessions.started(View::Wall);
        sessions.refused(&Refusal::TooMany(4));
        sessions.refused(&Refusal::TooMany(4));
        sessions.first_sample(Duration::from_millis(20));
        let text = render(&families(&sessions.counts()), Format::Text);
        for line in [
            "poolscope_profile_sessions_active 0\n",
            "poolscope_profile_sessions_started_total{kind=\"wall\"} 1\n",
            "poolscope_profile_sessions_refused_total{reason=\"sessions\"} 2\n",
            "poolscope_profile_session_start_seconds_bucket{le=\"0.01\"} 0\n",
            "poolscope_profile_session_start_seconds_bucket{le=\"0.025\"} 1\n",
            "poolscope_profile_session_start_seconds_count 1\n",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
    }
}
