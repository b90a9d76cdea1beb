//! Every way poolscope can measure less than it should, and whether it does now.
//! [`Loss`] is one loss counter (or refusal gauge) as exported; [`HealthTracker`]
//! turns the latest values into [`Health`]: degraded while a counter rose within
//! `limits.degraded_for`, a refusal gauge is above 0 or a probe the config wants is
//! skipped, each cause with what to change. It logs when a cause begins and when
//! the last one ends; `/healthz` and `poolscope_degraded` show the current state.
//! Here the counters and their advice; the tracker and its verdict in `tracker`.
use std::{collections::BTreeMap, fmt};

use poolscope_shared::{LossErrno, LossSource, maps};

use crate::{
    config::Limits,
    kernel::{MapErrors, Probe, ProbeState, Skip},
    stacks::symbolize::Unnamed,
};

mod tracker;

pub use tracker::{Cause, Health, HealthTracker, Loss};

/// What one loss counter counts (its family and labels).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LossKind {
    /// `map_update_errors_total{map, errno}`.
    MapUpdate { map: &'static str, errno: LossErrno },
    /// `events_lost_total{source}`.
    Events(&'static str),
    /// `series_dropped_total`.
    SeriesDropped,
    /// `services_refused` (a gauge: processes refused by the last scan).
    ServicesRefused,
    /// `processes_unreadable` (a gauge: processes whose open files the last scan
    /// was not allowed to read).
    ProcessesUnreadable,
    /// `pools_refused_total`.
    PoolsRefused,
    /// `lock_uprobe_errors_total`.
    LockUprobes,
    /// `probe_skipped{probe, reason}` for a probe the config asked for.
    ProbeSkipped { probe: String, reason: &'static str },
    /// `stack_frames_unsymbolized_total{space}`: `user` or `kernel`.
    Unsymbolized(&'static str),
}

/// Off-CPU blocks that outlived their stack map (longer than a drain interval, or in
/// progress at a snapshot, which drains twice) keep their time without stacks
/// (`[stack lost]`): expected for long waits, nothing to change.
const STACKS_EXPIRED: &str = "offcpu_stacks_expired";
const PROCESS_EVENTS: &str = "process_events";
/// A connection event that lost its phase change to other CPUs three times.
const PHASE_RETRIES: &str = "phase_retries";
/// A user stack copy the ring buffer had no room for: the stack keeps its
/// frame-pointer walk, nothing to change unless it keeps rising.
const STACK_COPIES: &str = "stack_copies";
/// A finished request the route ring had no room for: missing from the route
/// families only.
const ROUTE_EVENTS: &str = "route_events";
/// HTTP/2 connections no longer followed, by why, and streams not followed.
const HTTP2_UNPARSABLE: &str = "http2_unparsable";
const HTTP2_UNREADABLE: &str = "http2_unreadable";
const HTTP2_FRAME_BOUND: &str = "http2_frame_bound";
const HTTP2_STREAM_SLOTS: &str = "http2_stream_slots";
const HTTP2_ADOPTED: &str = "http2_adopted";
const HTTP2_SYSCALL_BACKEND: &str = "http2_syscall_backend";
const HTTP2_TCP_BACKEND: &str = "http2_tcp_backend";

/// Every loss path's current count, from the kernel and user space.
#[derive(Clone, Copy, Debug, Default)]
pub struct LossInputs<'a> {
    pub kernel: &'a [(LossSource, LossErrno, u64)],
    /// User space's failed map updates (discovery's, the pools').
    pub map_errors: [Option<&'a MapErrors>; 2],
    pub series_dropped: u64,
    pub services_refused: u64,
    pub processes_unreadable: u64,
    pub pools_refused: u64,
    pub lock_uprobe_errors: u64,
    pub unsymbolized: Unnamed,
    pub probes: &'a [Probe],
}

/// The loss counters as exported: every path, 0 where nothing was lost (each map's
/// `E2BIG` included, and `SOCK_CONNS`' `ENOMEM`, the one way it fails, so that a
/// first rise shows in `increase()`), other errnos once they happen; user space's and
/// the kernel's failures on one map are summed.
pub fn losses(inputs: &LossInputs<'_>) -> Vec<Loss> {
    let mut counts: BTreeMap<LossKind, u64> = ADVISED_MAPS
        .iter()
        .map(|&map| {
            let kind = LossKind::MapUpdate {
                map,
                errno: LossErrno::E2big,
            };
            (kind, 0)
        })
        .chain([
            (
                LossKind::MapUpdate {
                    map: maps::SOCK_CONNS,
                    errno: LossErrno::Enomem,
                },
                0,
            ),
            (
                LossKind::MapUpdate {
                    map: maps::H2_CONNS,
                    errno: LossErrno::Enomem,
                },
                0,
            ),
            (LossKind::Events(PROCESS_EVENTS), 0),
            (LossKind::Events(STACKS_EXPIRED), 0),
            (LossKind::Events(PHASE_RETRIES), 0),
            (LossKind::Events(STACK_COPIES), 0),
            (LossKind::Events(ROUTE_EVENTS), 0),
            (LossKind::Events(HTTP2_UNPARSABLE), 0),
            (LossKind::Events(HTTP2_UNREADABLE), 0),
            (LossKind::Events(HTTP2_FRAME_BOUND), 0),
            (LossKind::Events(HTTP2_STREAM_SLOTS), 0),
            (LossKind::Events(HTTP2_ADOPTED), 0),
            (LossKind::Events(HTTP2_SYSCALL_BACKEND), 0),
            (LossKind::Events(HTTP2_TCP_BACKEND), 0),
            (LossKind::SeriesDropped, inputs.series_dropped),
            (LossKind::ServicesRefused, inputs.services_refused),
            (LossKind::ProcessesUnreadable, inputs.processes_unreadable),
            (LossKind::PoolsRefused, inputs.pools_refused),
            (LossKind::LockUprobes, inputs.lock_uprobe_errors),
            (LossKind::Unsymbolized("user"), inputs.unsymbolized.user),
            (LossKind::Unsymbolized("kernel"), inputs.unsymbolized.kernel),
        ])
        .collect();
    let kernel = inputs
        .kernel
        .iter()
        .filter(|(_, _, lost)| *lost > 0)
        .map(|&(source, errno, lost)| (LossKind::of_kernel(source, errno), lost));
    let user = inputs
        .map_errors
        .iter()
        .flatten()
        .flat_map(|errors| errors.iter())
        .map(|(map, errno, count)| (LossKind::MapUpdate { map, errno }, count));
    for (kind, count) in kernel.chain(user) {
        *counts.entry(kind).or_default() += count;
    }
    // A kernel without the tcp backend's HTTP/2 hooks loses nothing until an HTTP/2
    // connection comes, which is then counted (`http2_tcp_backend`).
    for probe in inputs.probes {
        if let ProbeState::Skipped(skip) = probe.state
            && !matches!(skip, Skip::Off | Skip::NoHttp2Hooks)
        {
            let kind = LossKind::ProbeSkipped {
                probe: probe.name.clone(),
                reason: skip.name(),
            };
            counts.insert(kind, 1);
        }
    }
    counts
        .into_iter()
        .map(|(kind, value)| Loss { kind, value })
        .collect()
}

impl LossKind {
    /// The counter a kernel-side loss goes to.
    pub fn of_kernel(source: LossSource, errno: LossErrno) -> Self {
        let map = |map| Self::MapUpdate { map, errno };
        match source {
            LossSource::ConnsInsert => map(maps::CONNS),
            LossSource::SockConnsInsert => map(maps::SOCK_CONNS),
            LossSource::PendingCallsInsert => map(maps::PENDING_CALLS),
            LossSource::WatchedInsert => map(maps::WATCHED),
            LossSource::ThreadsInsert => map(maps::THREADS),
            LossSource::LocksInsert => map(maps::LOCKS),
            LossSource::LockStackCapture => map(maps::LOCK_STACKS),
            LossSource::MutexCallsInsert => map(maps::MUTEX_CALLS),
            LossSource::StackCapture => map(maps::STACK_MAPS),
            LossSource::StackCountsInsert => map(maps::STACK_COUNTS),
            LossSource::DownstreamInsert => map(maps::DOWNSTREAM_WAITS),
            LossSource::ProcessEvents => Self::Events(PROCESS_EVENTS),
            LossSource::OffCpuStacksExpired => Self::Events(STACKS_EXPIRED),
            LossSource::PhaseRetries => Self::Events(PHASE_RETRIES),
            LossSource::StackCopies => Self::Events(STACK_COPIES),
            LossSource::StackVariants => map(maps::STACK_VARIANTS),
            LossSource::Http2Unparsable => Self::Events(HTTP2_UNPARSABLE),
            LossSource::Http2Unreadable => Self::Events(HTTP2_UNREADABLE),
            LossSource::Http2FrameBound => Self::Events(HTTP2_FRAME_BOUND),
            LossSource::Http2StreamSlots => Self::Events(HTTP2_STREAM_SLOTS),
            LossSource::Http2ConnsInsert => map(maps::H2_CONNS),
            LossSource::Http2Adopted => Self::Events(HTTP2_ADOPTED),
            LossSource::Http2SyscallBackend => Self::Events(HTTP2_SYSCALL_BACKEND),
            LossSource::Http2TcpBackend => Self::Events(HTTP2_TCP_BACKEND),
            LossSource::RouteEvents => Self::Events(ROUTE_EVENTS),
        }
    }

    /// A gauge: degraded while above 0 (a counter: while it rose recently).
    fn is_gauge(&self) -> bool {
        matches!(
            self,
            Self::ServicesRefused | Self::ProcessesUnreadable | Self::ProbeSkipped { .. }
        )
    }

    /// Whether this loss makes poolscope degraded: something was not measured. A
    /// stack that did not fit its stack map (a hash-bucket collision, more frequent
    /// as the map fills: kept less its innermost frame where that fits), that could
    /// not be walked, or that expired keeps its sample's time, under no stack or
    /// `[stack lost]`, and a frame without a symbol keeps its module and offset:
    /// counted, not degrading. Processes whose open files poolscope may not follow
    /// are counted and logged, not degrading: some hosts run one that no exporter
    /// may read (a sandbox's init, behind a security module), for good.
    fn degrades(&self) -> bool {
        !matches!(
            self,
            Self::Events(STACKS_EXPIRED | STACK_COPIES)
                | Self::Unsymbolized(_)
                | Self::ProcessesUnreadable
                | Self::MapUpdate {
                    map: maps::STACK_MAPS | maps::LOCK_STACKS,
                    errno: LossErrno::Eexist | LossErrno::Efault,
                }
                | Self::MapUpdate {
                    map: maps::STACK_VARIANTS,
                    ..
                }
        )
    }

    /// What the operator can change; `capacity` is the map's size, if known.
    fn advice(&self, capacity: Option<u64>) -> String {
        let size = capacity.map_or_else(String::new, |c| format!(" (capacity {c})"));
        match self {
            Self::MapUpdate { map, errno } => match errno {
                LossErrno::E2big | LossErrno::Eexist => match Limits::key_of(map) {
                    Some(key) => format!("kernel map {map} is full{size}: raise {key}"),
                    None => format!(
                        "kernel map {map} is full{size}; its size is fixed: too many at once \
                         (see docs/limits.md)"
                    ),
                },
                LossErrno::Enomem if *map == maps::SOCK_CONNS || *map == maps::H2_CONNS => format!(
                    "kernel map {map}: a socket had no room for its entry (its option memory, \
                     net.core.optmem_max, or memory pressure)"
                ),
                LossErrno::Enomem => {
                    format!("kernel map {map}: the kernel could not allocate (memory pressure)")
                }
                LossErrno::Ebusy => format!(
                    "kernel map {map}: an update interrupted another on the same bucket \
                     (rare; nothing to change unless it keeps rising)"
                ),
                LossErrno::Efault => format!(
                    "kernel map {map}: a stack could not be walked (a thread exiting, or a user \
                     stack the kernel could not read); its time is kept under [stack lost]"
                ),
                LossErrno::None | LossErrno::Other => {
                    format!("kernel map {map}: an insert failed; the log may say why")
                }
            },
            Self::Events(PROCESS_EVENTS) => "the process-event ring buffer was full: forks, \
                 execs and exits were missed until the next rescan (discovery.rescan_interval)"
                .to_owned(),
            Self::Events(ROUTE_EVENTS) => "the route ring buffer was full: finished requests \
                 are missing from the route_* families (raise limits.route_events)"
                .to_owned(),
            Self::Events(PHASE_RETRIES) => "a connection's events kept racing on several CPUs: \
                 one transition was dropped and a request gauge may be off by one (report it)"
                .to_owned(),
            Self::Events(STACK_COPIES) => "the stack-copy ring buffer was full: some stacks \
                 keep their frame-pointer walk, without the callers of libraries built without \
                 frame pointers (bursts of new stacks; nothing to change unless it keeps rising)"
                .to_owned(),
            Self::Events(HTTP2_UNPARSABLE) => "an HTTP/2 connection's bytes broke the protocol \
                 (or were not HTTP/2 after a preface): it counts no requests from then on"
                .to_owned(),
            Self::Events(HTTP2_UNREADABLE) => "an HTTP/2 frame header was in bytes no user \
                 buffer held (io_uring, sendfile, splice) or that could not be read: that \
                 connection counts no requests from then on"
                .to_owned(),
            Self::Events(HTTP2_FRAME_BOUND) => "one read or write of an HTTP/2 connection held \
                 more frames or buffers than a program run follows (512 steps): that \
                 connection counts no requests from then on"
                .to_owned(),
            Self::Events(HTTP2_STREAM_SLOTS) => "an HTTP/2 stream opened while the stream 256 \
                 ids before it on its connection was still open: that stream is not counted"
                .to_owned(),
            Self::Events(HTTP2_ADOPTED) => "a connection open before its service was watched \
                 (a restart, a reload) carries HTTP/2 mid-stream: it counts no requests; new \
                 connections do"
                .to_owned(),
            Self::Events(HTTP2_SYSCALL_BACKEND) => "an HTTP/2 connection under the syscall \
                 backend, which does not follow streams: it counts no requests (the socket \
                 backend does, kernel 6.3 or later)"
                .to_owned(),
            Self::Events(HTTP2_TCP_BACKEND) => "an HTTP/2 connection under the tcp backend, \
                 which does not follow streams: it counts no requests (the socket backend \
                 does, kernel 6.3 or later)"
                .to_owned(),
            Self::Events(source) => format!("events lost from {source}"),
            Self::SeriesDropped => {
                "series were cut by limits.max_series: raise it, or narrow [[targets]]".to_owned()
            }
            Self::ServicesRefused => {
                "processes left unwatched by limits.max_services: raise it".to_owned()
            }
            Self::ProcessesUnreadable => "processes whose open files poolscope may not read, \
                 so their listening sockets are unknown and discovery cannot find them: give \
                 it CAP_SYS_PTRACE (the systemd unit and the DaemonSet do)"
                .to_owned(),
            Self::PoolsRefused => {
                "threads left in their creator's pool by limits.max_pools: raise it".to_owned()
            }
            Self::LockUprobes => "pthread_mutex_lock probes could not be attached to some \
                 processes; the log says which"
                .to_owned(),
            Self::ProbeSkipped { probe, reason } => format!(
                "probe {probe} is skipped ({reason}): what it measures is missing; the start \
                 log says why"
            ),
            Self::Unsymbolized(space) => format!(
                "{space} stack frames without a function name (see docs/endpoints.md, \
                 Stack snapshots)"
            ),
        }
    }
}

impl fmt::Display for LossKind {
    /// The series, as exported.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::MapUpdate { map, errno } => write!(
                f,
                "map_update_errors_total{{map=\"{map}\",errno=\"{}\"}}",
                errno.name()
            ),
            Self::Events(source) => write!(f, "events_lost_total{{source=\"{source}\"}}"),
            Self::SeriesDropped => f.write_str("series_dropped_total"),
            Self::ServicesRefused => f.write_str("services_refused"),
            Self::ProcessesUnreadable => f.write_str("processes_unreadable"),
            Self::PoolsRefused => f.write_str("pools_refused_total"),
            Self::LockUprobes => f.write_str("lock_uprobe_errors_total"),
            Self::ProbeSkipped { probe, reason } => {
                write!(f, "probe_skipped{{probe={probe:?},reason=\"{reason}\"}}")
            }
            Self::Unsymbolized(space) => {
                write!(f, "stack_frames_unsymbolized_total{{space=\"{space}\"}}")
            }
        }
    }
}

/// The maps user space or the kernel inserts into, whose `E2BIG` (full) counter is
/// always exported so that its first rise shows in `increase()`; the advice gives
/// their sizes.
pub const ADVISED_MAPS: [&str; 12] = [
    maps::ADOPT,
    maps::CONNS,
    maps::DOWNSTREAM_WAITS,
    maps::LISTEN_PORTS,
    maps::LOCKS,
    maps::LOCK_STACKS,
    maps::MUTEX_CALLS,
    maps::PENDING_CALLS,
    maps::STACK_MAPS,
    maps::STACK_COUNTS,
    maps::THREADS,
    maps::WATCHED,
];

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use aya::maps::MapError;

    use super::*;

    fn loss(kind: LossKind, value: u64) -> Loss {
        Loss { kind, value }
    }

    const CONNS_FULL: LossKind = LossKind::MapUpdate {
        map: maps::CONNS,
        errno: LossErrno::E2big,
    };

    #[test]
    fn a_rising_counter_degrades_until_it_has_been_still_long_enough() {
        let hold = Duration::from_secs(60);
        let mut tracker = HealthTracker::new(hold, BTreeMap::from([(maps::CONNS, 1024)]));
        let start = Instant::now();
        let at = |seconds| start + Duration::from_secs(seconds);

        assert!(!tracker.observe(at(0), &[loss(CONNS_FULL, 0)]).degraded());
        let health = tracker.observe(at(1), &[loss(CONNS_FULL, 5)]);
        assert_eq!(health.causes.len(), 1);
        assert_eq!(
            health.causes[0].advice,
            "kernel map CONNS is full (capacity 1024): raise limits.connections"
        );
        // Still at 5: degraded until `hold` after the rise, then not.
        assert!(tracker.observe(at(60), &[loss(CONNS_FULL, 5)]).degraded());
        assert!(!tracker.observe(at(61), &[loss(CONNS_FULL, 5)]).degraded());
        assert!(tracker.observe(at(62), &[loss(CONNS_FULL, 6)]).degraded());
    }

    #[test]
    fn a_counter_already_above_zero_at_start_degrades() {
        let mut tracker = HealthTracker::new(Duration::from_secs(60), BTreeMap::new());
        let health = tracker.observe(Instant::now(), &[loss(LossKind::SeriesDropped, 3)]);
        assert!(health.degraded());
    }

    #[test]
    fn gauges_degrade_while_above_zero_and_informational_losses_never() {
        let mut tracker = HealthTracker::new(Duration::from_secs(60), BTreeMap::new());
        let now = Instant::now();
        let skipped = LossKind::ProbeSkipped {
            probe: "sched/sched_switch".into(),
            reason: "load_refused",
        };
        let losses = [
            loss(LossKind::ServicesRefused, 2),
            loss(skipped.clone(), 1),
            loss(LossKind::Events(STACKS_EXPIRED), 100),
            loss(LossKind::Unsymbolized("user"), 40),
            loss(LossKind::ProcessesUnreadable, 3),
        ];
        let health = tracker.observe(now, &losses);
        let kinds: Vec<_> = health.causes.iter().map(|c| c.kind.clone()).collect();
        assert_eq!(kinds, vec![LossKind::ServicesRefused, skipped]);
        let health = tracker.observe(now, &[loss(LossKind::ServicesRefused, 0)]);
        assert!(!health.degraded());
    }

    #[test]
    fn every_map_that_can_fill_names_the_limit_to_raise() {
        for map in ADVISED_MAPS {
            assert!(Limits::key_of(map).is_some(), "{map} has no [limits] key");
        }
    }

    #[test]
    fn the_advice_depends_on_the_errno() {
        let busy = LossKind::MapUpdate {
            map: maps::THREADS,
            errno: LossErrno::Ebusy,
        };
        assert!(busy.advice(None).contains("nothing to change"));
        let fixed = LossKind::MapUpdate {
            map: maps::PROFILE_SESSIONS,
            errno: LossErrno::E2big,
        };
        assert_eq!(
            fixed.advice(Some(8)),
            "kernel map PROFILE_SESSIONS is full (capacity 8); its size is fixed: too many \
             at once (see docs/limits.md)"
        );
        let calls = LossKind::of_kernel(LossSource::MutexCallsInsert, LossErrno::E2big);
        assert_eq!(
            calls.advice(Some(16)),
            "kernel map MUTEX_CALLS is full (capacity 16): raise limits.mutex_calls_in_flight"
        );
        let collision = LossKind::of_kernel(LossSource::StackCapture, LossErrno::Eexist);
        assert_eq!(
            collision.advice(Some(16384)),
            "kernel map STACKS is full (capacity 16384): raise limits.stacks"
        );
    }

    #[test]
    fn the_report_names_each_series_and_what_to_change() {
        let mut tracker = HealthTracker::new(
            Duration::from_secs(300),
            BTreeMap::from([(maps::CONNS, 64)]),
        );
        let health = tracker.observe(
            Instant::now(),
            &[
                loss(CONNS_FULL, 7),
                loss(LossKind::ServicesRefused, 1),
                loss(LossKind::Events(PROCESS_EVENTS), 0),
            ],
        );
        assert_eq!(
            health.report(tracker.degraded_for()),
            "degraded\n\
             map_update_errors_total{map=\"CONNS\",errno=\"E2BIG\"} = 7 (rose in the last 5m): \
             kernel map CONNS is full (capacity 64): raise limits.connections\n\
             services_refused = 1 (now): processes left unwatched by limits.max_services: \
             raise it\n"
        );
        assert_eq!(Health::default().report(Duration::ZERO), "ok\n");
    }

    #[test]
    fn user_space_map_errors_keep_their_errno() {
        let mut errors = MapErrors::default();
        let full = MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_update_elem",
            io_error: std::io::Error::from_raw_os_error(libc::E2BIG),
        });
        errors.count(maps::WATCHED, &full);
        errors.count(maps::WATCHED, &full);
        errors.count(maps::WATCHED, &MapError::KeyNotFound);
        let counted: Vec<_> = errors.iter().collect();
        assert_eq!(
            counted,
            vec![
                (maps::WATCHED, LossErrno::E2big, 2),
                (maps::WATCHED, LossErrno::Other, 1)
            ]
        );
    }
}
