//! Thread pools' numbers (DESIGN §3): the reduction of the kernel's per-pool stats
//! plus each live thread's open interval into pool totals (`totals`), the states,
//! reasons and request components they are exported by, and the sliding window of
//! `pool_utilization_ratio` and capacity. Which pool each thread is in is
//! `discovery/pools.rs`'s.
use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use poolscope_shared::Activity;

use crate::metrics::history::History;

mod totals;

pub use totals::{PoolTotals, thread_times, totals};

/// `thread_seconds_total{state}`: the thread states of DESIGN §3 as sums of activities.
pub const STATES: [(&str, &[Activity]); 5] = [
    ("running", &[Activity::Running]),
    ("runnable", &[Activity::Runnable]),
    ("blocked_lock", &[Activity::OffLock]),
    (
        "blocked_io",
        &[
            Activity::OffDisk,
            Activity::OffNetwork,
            Activity::OffSleep,
            Activity::OffOther,
        ],
    ),
    ("idle", &[Activity::OffIdle]),
];

/// `offcpu_seconds_total{reason}`: the parts of `blocked_io`. (Lock waits and idle
/// time are `thread_seconds_total{state="blocked_lock"|"idle"}` already: exported
/// twice, they cost two series per pool for nothing.)
pub const REASONS: [(&str, Activity); 4] = [
    ("disk", Activity::OffDisk),
    ("network", Activity::OffNetwork),
    ("sleep", Activity::OffSleep),
    ("other", Activity::OffOther),
];

/// `request_time_seconds_total{component}` besides `queue`: what the serving thread
/// did. `other` is time it waited for no reason of the request's own (an event loop
/// in epoll with the request in hand, or an unclassified wait).
pub const COMPONENTS: [(&str, &[Activity]); 5] = [
    ("running", &[Activity::Running]),
    ("runnable", &[Activity::Runnable]),
    ("lock", &[Activity::OffLock]),
    (
        "io",
        &[Activity::OffDisk, Activity::OffNetwork, Activity::OffSleep],
    ),
    ("other", &[Activity::OffIdle, Activity::OffOther]),
];

/// The sum of `values` over `activities`.
pub fn sum_of(values: &[u64; Activity::COUNT], activities: &[Activity]) -> u64 {
    activities.iter().map(|a| values[*a as usize]).sum()
}

/// How often pool totals are sampled for the utilization window.
pub const SAMPLE_INTERVAL: Duration = Duration::from_secs(1);

/// A pool's cumulative times at one sampling tick.
#[derive(Clone, Copy, Debug)]
struct Sample {
    busy_ns: u64,
    total_ns: u64,
    running_ns: u64,
    runnable_ns: u64,
    serving_ns: u64,
    served_exits: u64,
}

impl Sample {
    fn of(totals: &PoolTotals) -> Self {
        Self {
            busy_ns: totals.busy_ns(),
            total_ns: totals.total_ns(),
            running_ns: totals.time_ns[Activity::Running as usize],
            runnable_ns: totals.time_ns[Activity::Runnable as usize],
            serving_ns: totals.request_ns.iter().sum(),
            served_exits: totals.served_exits,
        }
    }
}

/// What a pool did over its utilization window (or since its first sample, when
/// younger).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PoolWindow {
    pub seconds: f64,
    /// Thread time, all of it and busy (every state but `idle`).
    pub total_ns: u64,
    pub busy_ns: u64,
    /// Thread time on a CPU, and waiting for one.
    pub running_ns: u64,
    pub runnable_ns: u64,
    /// Thread time serving requests (times the requests each thread held).
    pub serving_ns: u64,
    /// Threads that exited after serving.
    pub served_exits: u64,
}

impl PoolWindow {
    /// Busy share of the pool's thread time; `None` without thread time.
    pub fn utilization(&self) -> Option<f64> {
        (self.total_ns > 0).then(|| self.busy_ns as f64 / self.total_ns as f64)
    }
}

/// Each pool's totals at the sampling ticks of its window.
#[derive(Debug)]
pub struct PoolWindows {
    history: History<Sample>,
}

impl PoolWindows {
    pub fn new(window: Duration) -> Self {
        Self {
            history: History::new(window),
        }
    }

    pub fn set_window(&mut self, window: Duration) {
        self.history.set_window(window);
    }

    /// Forgets the pools not in `pools` (released, or of services gone).
    pub fn retain(&mut self, pools: &[u32]) {
        self.history.retain(|id| pools.contains(&id));
    }

    /// Records the pools' thread times at `at`.
    pub fn sample(&mut self, at: Instant, totals: &BTreeMap<u32, PoolTotals>) {
        for (pool, totals) in totals {
            self.history.push(*pool, at, Sample::of(totals));
        }
    }

    /// What the pool did over the last window (or since its first sample, when
    /// younger), given its totals `now`; `None` before its first sample or if the
    /// kernel's totals went back (a pool id reused).
    pub fn window(&self, pool: u32, now: &PoolTotals, at: Instant) -> Option<PoolWindow> {
        let (base_at, base) = self.history.base(pool)?;
        let now = Sample::of(now);
        Some(PoolWindow {
            seconds: at.saturating_duration_since(*base_at).as_secs_f64(),
            total_ns: now.total_ns.checked_sub(base.total_ns)?,
            busy_ns: now.busy_ns.saturating_sub(base.busy_ns),
            running_ns: now.running_ns.saturating_sub(base.running_ns),
            runnable_ns: now.runnable_ns.saturating_sub(base.runnable_ns),
            serving_ns: now.serving_ns.saturating_sub(base.serving_ns),
            served_exits: now.served_exits.saturating_sub(base.served_exits),
        })
    }
}

#[cfg(test)]
mod tests {
    use poolscope_shared::{PoolStats, Thread};

    use super::*;
    use crate::kernel::Readout;

    fn thread(activity: Activity, since_ns: u64, serving: u32) -> Thread {
        let mut thread = Thread::new(0, activity, since_ns);
        for _ in 0..serving {
            thread.serving.start();
        }
        thread
    }

    #[test]
    fn totals_add_open_intervals_to_closed_ones() {
        let mut stats = PoolStats::default();
        stats.time_ns[Activity::Running as usize] = 100;
        stats.time_ns[Activity::OffIdle as usize] = 50;
        stats.request_ns[Activity::Running as usize] = 80;
        let readout = Readout {
            pools: BTreeMap::from([(7, stats)]),
            threads_read_ns: 1_000,
            threads: vec![
                (1, thread(Activity::Running, 900, 2), Some(7)),
                (2, thread(Activity::OffIdle, 400, 0), Some(7)),
                // Not named yet: not in any pool.
                (3, thread(Activity::Running, 0, 0), None),
            ],
            ..Readout::default()
        };
        let pool = &totals(&readout)[&7];
        assert_eq!(pool.time_ns[Activity::Running as usize], 200);
        assert_eq!(pool.time_ns[Activity::OffIdle as usize], 650);
        // Serving two requests: the open 100 ns count for each.
        assert_eq!(pool.request_ns[Activity::Running as usize], 280);
        assert_eq!((pool.threads, pool.threads_busy), (2, 1));
        assert_eq!((pool.busy_ns(), pool.total_ns()), (200, 850));
    }

    #[test]
    fn utilization_over_the_window_only() {
        let utilization = |pools: &PoolWindows, pool, now: &PoolTotals| {
            pools.window(pool, now, Instant::now())?.utilization()
        };
        let mut pools = PoolWindows::new(Duration::from_secs(10));
        let start = Instant::now();
        // One thread: busy for 20 s, then idle, sampled every second.
        let at_second = |second: u64| {
            let mut totals = PoolTotals::default();
            totals.time_ns[Activity::Running as usize] = second.min(20) * 1_000;
            totals.time_ns[Activity::OffIdle as usize] = second.saturating_sub(20) * 1_000;
            totals
        };
        for second in 0..=15 {
            pools.sample(
                start + Duration::from_secs(second),
                &BTreeMap::from([(0, at_second(second))]),
            );
        }
        assert_eq!(utilization(&pools, 0, &at_second(15)), Some(1.0));
        for second in 16..=25 {
            pools.sample(
                start + Duration::from_secs(second),
                &BTreeMap::from([(0, at_second(second))]),
            );
        }
        // The window is 15..25 s: 5 s busy, 5 s idle.
        assert_eq!(utilization(&pools, 0, &at_second(25)), Some(0.5));
        for second in 26..=30 {
            pools.sample(
                start + Duration::from_secs(second),
                &BTreeMap::from([(0, at_second(second))]),
            );
        }
        assert_eq!(utilization(&pools, 0, &at_second(30)), Some(0.0));
        assert_eq!(utilization(&pools, 1, &at_second(30)), None);
    }
}
