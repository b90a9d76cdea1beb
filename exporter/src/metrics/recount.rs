//! The gauges' recount. Each gauge is a difference of counters the kernel programs
//! keep (entered less left); an update lost between two CPUs would leave it off until
//! poolscope restarts. So, at a scrape where a service's counters stood still since the
//! last one and one of its gauges reads other than 0 (or a minute after the last
//! recount), poolscope counts the live entries of the connection state
//! (`discovery/live.rs`), reads the counters again, and for each service whose
//! counters did not move meanwhile takes the entries as the truth: the difference from
//! the counters becomes the service's offset, and every change of an offset counts in
//! `poolscope_gauge_corrections_total{gauge}`. A recount reads every socket of the
//! network namespace (sock_diag), so it runs at most every [`MIN_INTERVAL`].
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

/// When the last recount ran, each service's counters at the last scrape, and the
/// recounts' totals.
#[derive(Debug, Default)]
pub struct Recount {
    previous: BTreeMap<u32, ServiceCounters>,
    last: Option<Instant>,
    pub stats: RecountStats,
}

impl Recount {
    /// Whether a recount is due at this scrape: some service's counters stood still
    /// since the last scrape and either one of its gauges reads off 0 (`off_zero`) or
    /// [`MAX_INTERVAL`] passed since the last recount; never within [`MIN_INTERVAL`]
    /// of the last. Keeps `counters` for the next scrape.
    pub fn due(
        &mut self,
        counters: &BTreeMap<u32, ServiceCounters>,
        off_zero: impl Fn(u32, &ServiceCounters) -> bool,
        now: Instant,
    ) -> bool {
        let since_last = self.last.map(|last| now.saturating_duration_since(last));
        let still: Vec<(u32, &ServiceCounters)> = counters
            .iter()
            .filter(|&(id, counters)| self.previous.get(id) == Some(counters))
            .map(|(&id, counters)| (id, counters))
            .collect();
        self.previous.clone_from(counters);
        if since_last.is_some_and(|since| since < MIN_INTERVAL) || still.is_empty() {
            return false;
        }
        since_last.is_none_or(|since| since >= MAX_INTERVAL)
            || still.iter().any(|&(id, counters)| off_zero(id, counters))
    }

    /// Marks a recount that ran at `now` (`read`: whether it read the state).
    pub fn ran(&mut self, now: Instant, read: bool) {
        self.last = Some(now);
        self.stats.recounts += 1;
        self.stats.failures += u64::from(!read);
    }

    /// The new offsets of a service whose counters did not move across the recount
    /// (`counted` from them, `live` its entries), counting each change.
    pub fn correct(
        &mut self,
        counted: PerGauge<i64>,
        live: &Live,
        old: &PerGauge<i64>,
    ) -> PerGauge<i64> {
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
        corrections.recounted = recount.correct(drifted_counts, &live, &corrections.recounted);
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
            counted(&ended, &corrections),
            &Live::default(),
            &corrections.recounted,
        );
        assert_eq!(same, corrections.recounted);
        assert_eq!(recount.stats.corrected.unserved, 1);
        assert_eq!(recount.stats.corrected.in_flight, 1);
    }

    #[test]
    fn due_when_a_still_service_reads_off_zero_and_not_too_often() {
        let mut recount = Recount::default();
        let start = Instant::now();
        let busy = |n| BTreeMap::from([(1, counters((n, n), (0, 0)))]);
        let off = |_: u32, c: &ServiceCounters| c.unserved_entered != c.unserved_left;
        // The first scrape has no previous one; moving counters are not still.
        assert!(!recount.due(&busy(1), off, start));
        assert!(!recount.due(&busy(2), off, start + Duration::from_secs(1)));
        // Still, reading 0, and no recount yet: due (the minute's recount).
        assert!(recount.due(&busy(2), off, start + Duration::from_secs(2)));
        recount.ran(start + Duration::from_secs(2), true);
        let drifted = BTreeMap::from([(1, counters((3, 2), (0, 0)))]);
        assert!(!recount.due(&drifted, off, start + Duration::from_secs(3)));
        // Still and off 0, but within MIN_INTERVAL of the last.
        assert!(!recount.due(&drifted, off, start + Duration::from_secs(4)));
        assert!(recount.due(&drifted, off, start + Duration::from_secs(8)));
        recount.ran(start + Duration::from_secs(8), false);
        assert_eq!((recount.stats.recounts, recount.stats.failures), (2, 1));
        // Still and at 0: only after MAX_INTERVAL.
        assert!(!recount.due(&busy(2), off, start + Duration::from_secs(20)));
        assert!(!recount.due(&busy(2), off, start + Duration::from_secs(30)));
        assert!(recount.due(&busy(2), off, start + Duration::from_secs(68)));
    }
}
