//! On-demand profiling sessions (`/debug/pprof/profile`): the query and its checks
//! against `[profiles]`, the kernel slots in use, and the counters behind the
//! `profile_sessions_*` self-metrics. Starting and stopping the kernel side is
//! `Kernel::start_profile`/`stop_profile`; a session's stacks are drained with the
//! snapshots' (`StackWindows`).
use std::{collections::BTreeMap, time::Duration};

use axum::http::StatusCode;
use poolscope_shared::MAX_PROFILE_SESSIONS;

use crate::{
    config::ProfileLimits,
    stacks::profile::{Format, View},
};

/// `seconds` when the request does not say: what `go tool pprof` and Go's
/// `net/http/pprof` assume.
const DEFAULT_SECONDS: u64 = 30;

pub const USAGE: &str = "usage: /debug/pprof/profile?service=NAME[&seconds=S][&pool=NAME]\
                         [&hz=F][&kind=cpu|offcpu|wall][&format=pprof|folded|svg]\n";

/// The raw query: every value a string, so that a malformed one is refused here,
/// with the key it came from, and counted.
#[derive(Clone, Debug, Default, serde::Deserialize)]
pub struct ProfileQuery {
    pub service: Option<String>,
    pub seconds: Option<String>,
    pub pool: Option<String>,
    pub hz: Option<String>,
    pub kind: Option<String>,
    pub format: Option<String>,
}

/// A checked request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileRequest {
    pub service: String,
    pub pool: Option<String>,
    pub duration: Duration,
    pub hz: u32,
    pub view: View,
    pub format: Format,
}

impl ProfileRequest {
    /// Whether the session needs on-CPU samples (a perf event per CPU).
    pub fn on_cpu(&self) -> bool {
        self.view != View::OffCpu
    }

    pub fn off_cpu(&self) -> bool {
        self.view != View::Cpu
    }
}

/// Why a session was not run; the message names the limit or key at fault.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("{0}\n{USAGE}")]
    BadQuery(String),
    #[error("seconds={asked} is outside 1 to {max} (profiles.max_duration)")]
    Duration { asked: u64, max: u64 },
    #[error("hz={asked} is outside {min} to {max} (profiles.min_hz, profiles.max_hz)")]
    Rate { asked: u32, min: u32, max: u32 },
    #[error(
        "{0} profiling sessions are running, the most allowed (profiles.max_sessions); \
         retry when one ends"
    )]
    TooMany(u32),
    #[error("profiling sessions are off (profiles.max_sessions = 0)")]
    Off,
    #[error("kind={0} needs off-CPU stacks, which are off (stacks.offcpu = false)")]
    OffCpuOff(&'static str),
    #[error("no watched service named {0:?}")]
    UnknownService(String),
    #[error("service {service:?} has no pool named {pool:?}")]
    UnknownPool { service: String, pool: String },
    #[error("the kernel side failed: {0}")]
    Kernel(String),
    #[error("rendering the profile failed: {0}")]
    Render(String),
}

impl Refusal {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadQuery(_) | Self::Duration { .. } | Self::Rate { .. } | Self::OffCpuOff(_) => {
                StatusCode::BAD_REQUEST
            }
            Self::TooMany(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::Off | Self::UnknownService(_) | Self::UnknownPool { .. } => StatusCode::NOT_FOUND,
            Self::Kernel(_) | Self::Render(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The `reason` label of `profile_sessions_refused_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::BadQuery(_) => "bad_query",
            Self::Duration { .. } => "duration",
            Self::Rate { .. } => "rate",
            Self::TooMany(_) => "sessions",
            Self::Off => "off",
            Self::OffCpuOff(_) => "offcpu_off",
            Self::UnknownService(_) => "unknown_service",
            Self::UnknownPool { .. } => "unknown_pool",
            Self::Kernel(_) => "kernel",
            Self::Render(_) => "render",
        }
    }
}

pub fn kind_name(view: View) -> &'static str {
    match view {
        View::Cpu => "cpu",
        View::OffCpu => "offcpu",
        View::Wall => "wall",
    }
}

/// `value` as one of `T`'s names, the ones `/debug/stacks` takes too.
fn named<T: serde::de::DeserializeOwned>(key: &str, value: &str) -> Result<T, Refusal> {
    use serde::de::IntoDeserializer as _;
    T::deserialize(value.into_deserializer()).map_err(|error: serde::de::value::Error| {
        Refusal::BadQuery(format!("{key}={value:?}: {error}"))
    })
}

/// Checks `query` against `limits`; `offcpu` says whether off-CPU stacks are on.
pub fn validate(
    query: &ProfileQuery,
    limits: &ProfileLimits,
    offcpu: bool,
) -> Result<ProfileRequest, Refusal> {
    if limits.max_sessions == 0 {
        return Err(Refusal::Off);
    }
    let service = match query.service.as_deref() {
        Some(service) if !service.is_empty() => service.to_owned(),
        _ => return Err(Refusal::BadQuery("service=NAME is required".to_owned())),
    };
    let number = |key: &str, value: &str| {
        value
            .parse::<u64>()
            .map_err(|_| Refusal::BadQuery(format!("{key}={value:?} is not a whole number")))
    };
    let max_seconds = limits.max_duration.as_secs().max(1);
    let seconds = match query.seconds.as_deref() {
        Some(value) => number("seconds", value)?,
        None => DEFAULT_SECONDS.min(max_seconds),
    };
    if seconds == 0 || seconds > max_seconds {
        return Err(Refusal::Duration {
            asked: seconds,
            max: max_seconds,
        });
    }
    let hz = match query.hz.as_deref() {
        Some(value) => u32::try_from(number("hz", value)?).unwrap_or(u32::MAX),
        None => limits.default_hz,
    };
    if !(limits.min_hz..=limits.max_hz).contains(&hz) {
        return Err(Refusal::Rate {
            asked: hz,
            min: limits.min_hz,
            max: limits.max_hz,
        });
    }
    let view = query
        .kind
        .as_deref()
        .map_or(Ok(View::Cpu), |kind| named("kind", kind))?;
    let format = query
        .format
        .as_deref()
        .map_or(Ok(Format::Pprof), |format| named("format", format))?;
    if view != View::Cpu && !offcpu {
        return Err(Refusal::OffCpuOff(kind_name(view)));
    }
    Ok(ProfileRequest {
        service,
        pool: query.pool.clone().filter(|pool| !pool.is_empty()),
        duration: Duration::from_secs(seconds),
        hz,
        view,
        format,
    })
}

/// A running session: its kernel slot and unique id.
#[derive(Clone, Debug)]
pub struct Ticket {
    pub slot: u32,
    pub id: u32,
    pub request: ProfileRequest,
    /// Monotonic ns at which the request arrived (for the start latency).
    pub requested_ns: u64,
}

/// Upper bounds (s) of `profile_session_start_seconds`: the goal is < 100 ms.
pub const START_BUCKETS: [f64; 8] = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0];

/// The slots in use and what happened to the sessions asked for.
#[derive(Debug, Default)]
pub struct Sessions {
    slots: [bool; MAX_PROFILE_SESSIONS as usize],
    last_id: u32,
    counts: SessionCounts,
}

/// What happened to the sessions asked for so far: the `profile_sessions_*`
/// self-metrics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SessionCounts {
    /// Sessions running now.
    pub active: u32,
    pub started: BTreeMap<&'static str, u64>,
    pub refused: BTreeMap<&'static str, u64>,
    /// Request → first sample: cumulative counts per bucket of [`START_BUCKETS`],
    /// sum, count.
    pub start_buckets: [u64; START_BUCKETS.len()],
    pub start_sum: f64,
    pub start_count: u64,
}

impl Sessions {
    /// Takes a free slot for `request` (at most `max_sessions` taken at once).
    pub fn reserve(
        &mut self,
        request: ProfileRequest,
        requested_ns: u64,
        max_sessions: u32,
    ) -> Result<Ticket, Refusal> {
        let running = self.active();
        let free = self.slots.iter().position(|taken| !taken);
        let slot = match free {
            Some(slot) if running < max_sessions => slot,
            _ => return Err(Refusal::TooMany(running)),
        };
        self.slots[slot] = true;
        self.last_id = self.last_id.checked_add(1).unwrap_or(1);
        Ok(Ticket {
            slot: slot as u32,
            id: self.last_id,
            request,
            requested_ns,
        })
    }

    /// The session in `slot` ended (or never started in the kernel).
    pub fn release(&mut self, slot: u32) {
        if let Some(taken) = self.slots.get_mut(slot as usize) {
            *taken = false;
        }
    }

    pub fn started(&mut self, view: View) {
        *self.counts.started.entry(kind_name(view)).or_default() += 1;
    }

    pub fn refused(&mut self, refusal: &Refusal) {
        *self.counts.refused.entry(refusal.reason()).or_default() += 1;
    }

    /// A session's first sample came `latency` after its request.
    pub fn first_sample(&mut self, latency: Duration) {
        let seconds = latency.as_secs_f64();
        let counts = &mut self.counts;
        for (bucket, bound) in counts.start_buckets.iter_mut().zip(START_BUCKETS) {
            if seconds <= bound {
                *bucket += 1;
            }
        }
        counts.start_sum += seconds;
        counts.start_count += 1;
    }

    pub fn active(&self) -> u32 {
        self.slots.iter().filter(|taken| **taken).count() as u32
    }

    /// The counts as of now.
    pub fn counts(&self) -> SessionCounts {
        SessionCounts {
            active: self.active(),
            ..self.counts.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ProfileLimits {
        ProfileLimits {
            max_sessions: 2,
            max_duration: Duration::from_secs(60),
            min_hz: 10,
            max_hz: 500,
            default_hz: 99,
            max_response_bytes: 1 << 20,
        }
    }

    fn query(pairs: &[(&str, &str)]) -> ProfileQuery {
        let value = |key: &str| {
            pairs
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| (*v).to_owned())
        };
        ProfileQuery {
            service: value("service"),
            seconds: value("seconds"),
            pool: value("pool"),
            hz: value("hz"),
            kind: value("kind"),
            format: value("format"),
        }
    }

    #[test]
    fn defaults_are_a_cpu_pprof_profile_of_30_seconds() -> Result<(), Refusal> {
        let request = validate(&query(&[("service", "web")]), &limits(), true)?;
        assert_eq!(
            request,
            ProfileRequest {
                service: "web".to_owned(),
                pool: None,
                duration: Duration::from_secs(30),
                hz: 99,
                view: View::Cpu,
                format: Format::Pprof,
            }
        );
        assert!(request.on_cpu() && !request.off_cpu());
        let request = validate(
            &query(&[
                ("service", "web"),
                ("seconds", "5"),
                ("pool", "workers"),
                ("hz", "10"),
                ("kind", "wall"),
                ("format", "svg"),
            ]),
            &limits(),
            true,
        )?;
        assert_eq!(
            (request.duration, request.hz, request.view, request.format),
            (Duration::from_secs(5), 10, View::Wall, Format::Svg)
        );
        assert_eq!(request.pool.as_deref(), Some("workers"));
        assert!(request.on_cpu() && request.off_cpu());
        Ok(())
    }

    #[test]
    fn refusals_name_the_limit_and_status() {
        /// (query, reason label, status, part of the message)
        type Case<'a> = (&'a [(&'a str, &'a str)], &'a str, u16, &'a str);
        let cases: [Case; 9] = [
            (&[], "bad_query", 400, "service=NAME is required"),
            (
                &[("service", "w"), ("seconds", "61")],
                "duration",
                400,
                "profiles.max_duration",
            ),
            (
                &[("service", "w"), ("seconds", "0")],
                "duration",
                400,
                "outside 1 to 60",
            ),
            (
                &[("service", "w"), ("seconds", "x")],
                "bad_query",
                400,
                "seconds=\"x\"",
            ),
            (
                &[("service", "w"), ("hz", "5")],
                "rate",
                400,
                "profiles.min_hz",
            ),
            (
                &[("service", "w"), ("hz", "99999999999")],
                "rate",
                400,
                "profiles.max_hz",
            ),
            (
                &[("service", "w"), ("kind", "gpu")],
                "bad_query",
                400,
                "kind=\"gpu\"",
            ),
            (
                &[("service", "w"), ("format", "png")],
                "bad_query",
                400,
                "format=\"png\"",
            ),
            (
                &[("service", "w"), ("kind", "offcpu")],
                "offcpu_off",
                400,
                "stacks.offcpu",
            ),
        ];
        for (pairs, reason, status, message) in cases {
            let refusal = validate(&query(pairs), &limits(), false)
                .err()
                .unwrap_or_else(|| panic!("{pairs:?} was accepted"));
            assert_eq!(refusal.reason(), reason, "{pairs:?}");
            assert_eq!(refusal.status().as_u16(), status, "{pairs:?}");
            assert!(
                refusal.to_string().contains(message),
                "{pairs:?}: {refusal}"
            );
        }
        let off = ProfileLimits {
            max_sessions: 0,
            ..limits()
        };
        let refusal = validate(&query(&[("service", "w")]), &off, true).err();
        assert_eq!(refusal.map(|r| r.status().as_u16()), Some(404));
    }

    #[test]
    fn slots_are_bounded_and_reused_with_new_ids() -> Result<(), Refusal> {
        let mut sessions = Sessions::default();
        let request = validate(&query(&[("service", "web")]), &limits(), true)?;
        let first = sessions.reserve(request.clone(), 1, 2)?;
        let second = sessions.reserve(request.clone(), 2, 2)?;
        let refusal = sessions.reserve(request.clone(), 3, 2).err();
        assert_eq!(
            refusal.as_ref().map(Refusal::status),
            Some(StatusCode::TOO_MANY_REQUESTS)
        );
        assert!(refusal.is_some_and(|r| r.to_string().contains("profiles.max_sessions")));
        assert_eq!(sessions.active(), 2);
        sessions.release(first.slot);
        let third = sessions.reserve(request, 4, 2)?;
        assert_eq!(third.slot, first.slot);
        assert!(third.id != first.id && third.id != second.id && third.id != 0);
        Ok(())
    }
}
