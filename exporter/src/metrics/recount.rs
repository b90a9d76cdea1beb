//! The gauges' recount. Each gauge is a difference of counters the kernel programs
//! keep (entered less left); an update lost between two CPUs would leave it off until
//! poolscope restarts. So, when a service's counters stand still for a sample (the
//! sampling loop's, every second) after they moved (or a minute after the last
//! recount), poolscope counts the live entries of the
//! connection state (`discovery/live.rs`), reads the counters again, and for each
//! service whose counters did not move meanwhile takes the entries as the truth: the
//! difference from the counters becomes the service's offset, and every change of an
//! offset counts in `poolscope_recount_corrections_total{gauge}`. A recount reads every
//! socket of the network namespace (sock_diag), so it runs at most every
//! [`MIN_INTERVAL`].
use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use poolscope_shared::ServiceCounters;

use crate::discovery::{
    live::{Live, PerGauge},
    targets::Corrections,
};

/// The shortest time between two recounts.
pub const MIN_INTERVAL: Duration = Duration::from_secs(5);
/// A recount at least this often while some service stands still, for a gauge that
/// reads 0 and should not (a lost `entered`, or an extra `left`).
pub const MAX_INTERVAL: Duration = Duration::from_secs(60);

/// Each gauge as the counters give it, with user space's moves (connections purged
/// or adopted) and without the recount's offsets; below 0 after a lost `entered`.
pub fn counted(counters: &ServiceCounters, corrections: &Corrections) -> PerGauge<i64> {
    let open = |entered: u64, left: u64, purged: u64| entered as i64 - left as i64 - purged as i64;
    PerGauge {
        unserved: open(
            counters.unserved_entered.get() + corrections.adopted_unserved,
            counters.unserved_left.get(),
            corrections.unserved,
        ),
        waiting: open(
            counters.waiting_entered.get(),
            counters.waiting_left.get(),
            corrections.waiting,
        ),
        in_flight: open(
            counters.serving_entered.get(),
            counters.serving_left.get(),
            corrections.serving,
        ),
        at_stream_limit: open(
            counters.at_limit_entered.get(),
            counters.at_limit_left.get(),
            0,
        ),
    }
}

/// The gauges exported: as counted, less the recount's offsets, never below 0 (a
/// read of the per-CPU counters between two CPUs' updates may be).
pub fn gauges(counters: &ServiceCounters, corrections: &Corrections) -> PerGauge<u64> {
    counted(counters, corrections).zip(&corrections.recounted, |counted, offset| {
        u64::try_from(counted - offset).unwrap_or(0)
    })
}

/// What the recounts did so far, for poolscope's own families.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecountStats {
    /// The sum of the changes of every offset, per gauge.
    pub corrected: PerGauge<u64>,
    pub recounts: u64,
    /// Recounts that could not read the connection state.
    pub failures: u64,
}

/// When the last recount ran, each service's counters at the last sample, and the
/// recounts' totals.
#[derive(Debug, Default)]
pub struct Recount {
    previous: BTreeMap<u32, ServiceCounters>,
    /// Each service's counters when a recount last held them to its entries (or
    /// passed it): a service still there reads what that recount made it read (a
    /// request held for minutes, connections that send nothing) and is no reason for
    /// another.
    checked: BTreeMap<u32, ServiceCounters>,
    last: Option<Instant>,
    pub stats: RecountStats,
}

impl Recount {
    /// Whether a recount is due at this sample: some service's counters stood still
    /// since the last sample after they moved since a recount last checked them (a
    /// burst of activity ended: once per quiet spell), or [`MAX_INTERVAL`] passed
    /// since the last recount while one stands still; never within [`MIN_INTERVAL`]
    /// of the last. Keeps `counters` for the next sample.
    pub fn due(&mut self, counters: &BTreeMap<u32, ServiceCounters>, now: Instant) -> bool {
        let since_last = self.last.map(|last| now.saturating_duration_since(last));
        let still: Vec<(u32, &ServiceCounters)> = counters
            .iter()
            .filter(|&(id, counters)| self.previous.get(id) == Some(counters))
            .map(|(&id, counters)| (id, counters))
            .collect();
        self.previous.clone_from(counters);
        self.checked.retain(|id, _| counters.contains_key(id));
        if since_last.is_some_and(|since| since < MIN_INTERVAL) || still.is_empty() {
            return false;
        }
        since_last.is_none_or(|since| since >= MAX_INTERVAL)
            || still
                .iter()
                .any(|&(id, counters)| self.checked.get(&id) != Some(counters))
    }

    /// Marks service `id` checked at `counters` without a recount of it (the
    /// connection state does not hold all of it): it is no reason for another.
    pub fn pass(&mut self, id: u32, counters: &ServiceCounters) {
        self.checked.insert(id, *counters);
    }

    /// Marks a recount that ran at `now` (`read`: whether it read the state).
    pub fn ran(&mut self, now: Instant, read: bool) {
        self.last = Some(now);
        self.stats.recounts += 1;
        self.stats.failures += u64::from(!read);
    }

    /// The new offsets of service `id`, whose `counters` did not move across the
    /// recount (`counted` from them, `live` its entries), counting each change.
    pub fn correct(
        &mut self,
        (id, counters): (u32, &ServiceCounters),
        counted: PerGauge<i64>,
        live: &Live,
        old: &PerGauge<i64>,
    ) -> PerGauge<i64> {
        self.checked.insert(id, *counters);
        let new = counted.zip(live, |counted, live| counted - live as i64);
        let changes = new.zip(old, |new, old| new.abs_diff(old));
        self.stats.corrected = self
            .stats
            .corrected
            .zip(&changes, |total, change| total + change);
        new
    }
}

#[cfg(test)]
mod tests {
    use poolscope_shared::Count;

    use super::*;

    fn counters(unserved: (u64, u64), serving: (u64, u64)) -> ServiceCounters {
        ServiceCounters {
            unserved_entered: Count::new(unserved.0),
            unserved_left: Count::new(unserved.1),
            serving_entered: Count::new(serving.0),
            serving_left: Count::new(serving.1),
            ..ServiceCounters::default()
        }
    }

    #[test]
    fn a_lost_left_and_a_lost_entered_are_offset_and_counted() {
        let mut recount = Recount::default();
        // One `left` lost: 1 unserved counted, none live; one `entered` lost: 0 in
        // flight counted while 1 is live.
        let drifted = counters((10, 9), (5, 5));
        let live = Live {
            in_flight: 1,
            ..Live::default()
        };
        let mut corrections = Corrections::default();
        assert_eq!(gauges(&drifted, &corrections).unserved, 1);
        let drifted_counts = counted(&drifted, &corrections);
        corrections.recounted =
            recount.correct((1, &drifted), drifted_counts, &live, &corrections.recounted);
        assert_eq!(
            corrections.recounted,
            PerGauge {
                unserved: 1,
                in_flight: -1,
                ..PerGauge::default()
            }
        );
        assert_eq!(gauges(&drifted, &corrections), live);
        // The live request ends (its `left` counted): every gauge reads 0.
        let ended = counters((10, 9), (5, 6));
        assert_eq!(gauges(&ended, &corrections), Live::default());
        assert_eq!(
            recount.stats.corrected,
            PerGauge {
                unserved: 1,
                in_flight: 1,
                ..PerGauge::default()
            }
        );
        // A second recount that agrees changes nothing.
        let same = recount.correct(
            (1, &ended),
            counted(&ended, &corrections),
            &Live::default(),
            &corrections.recounted,
        );
        assert_eq!(same, corrections.recounted);
        assert_eq!(recount.stats.corrected.unserved, 1);
        assert_eq!(recount.stats.corrected.in_flight, 1);
    }

    #[test]
    fn due_once_a_service_stands_still_and_not_too_often() {
        let mut recount = Recount::default();
        let start = Instant::now();
        let at = |seconds| start + Duration::from_secs(seconds);
        let service = |n| BTreeMap::from([(1, counters((n, n), (0, 0)))]);
        // The first sample has no previous one; moving counters are not still.
        assert!(!recount.due(&service(1), at(0)));
        assert!(!recount.due(&service(2), at(1)));
        // Still after moving, never checked: due.
        assert!(recount.due(&service(2), at(2)));
        recount.ran(at(2), true);
        recount.correct(
            (1, &service(2)[&1]),
            PerGauge::default(),
            &Live::default(),
            &PerGauge::default(),
        );
        // Still at the counters checked: not due again.
        assert!(!recount.due(&service(2), at(8)));
        // Moved, then still: due, but not within MIN_INTERVAL of the last.
        assert!(!recount.due(&service(3), at(9)));
        recount.ran(at(9), false);
        assert!(!recount.due(&service(3), at(10)));
        assert!(recount.due(&service(3), at(14)));
        recount.ran(at(14), true);
        recount.pass(1, &service(3)[&1]);
        assert_eq!((recount.stats.recounts, recount.stats.failures), (3, 1));
        // Still at the counters passed: only after MAX_INTERVAL.
        assert!(!recount.due(&service(3), at(40)));
        assert!(recount.due(&service(3), at(74)));
    }
}
