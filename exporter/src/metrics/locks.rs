//! The top contended locks of `/debug/locks`: the kernel's `LOCKS` entries grouped
//! by lock, with quantiles from their fine histograms; a pure function. Which
//! processes get the lock probes is `discovery/lock_probes.rs`'s; reading the stacks,
//! symbolizing and rendering them, `exporter/lock_report.rs`'s.
use std::collections::BTreeMap;

use poolscope_shared::{Histogram, LockKey};
use serde::Serialize;

use crate::metrics::window::quantiles;

/// One lock: a futex address in one process, over all stacks that waited on it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LockReport {
    pub pid: u32,
    /// The futex word's address (for a glibc mutex, the `pthread_mutex_t`'s).
    pub address: String,
    pub wait_seconds: f64,
    pub waits: u64,
    /// Of `waits`, those whose futex call had a timeout (a sleep, a timed park or
    /// condition wait: `lock_wait_seconds{primitive="futex_timed"}`).
    pub timed_waits: u64,
    pub p50_seconds: f64,
    pub p99_seconds: f64,
    /// The stacks that waited on it, most wait first.
    pub stacks: Vec<StackReport>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StackReport {
    pub wait_seconds: f64,
    pub waits: u64,
    /// The waits from this stack had a timeout.
    pub timed: bool,
    /// Innermost first, symbolized (`name+0xoffset (module)`, or `module+0xoffset`
    /// where no symbol is known). Empty if the stack was not captured.
    pub frames: Vec<String>,
    /// The kernel's stack id; negative if none.
    #[serde(skip)]
    pub stack_id: i32,
    /// Return addresses read from the kernel's stack map, innermost first.
    #[serde(skip)]
    pub addresses: Vec<u64>,
}

/// Groups `LOCKS` entries of the processes `include` accepts by lock and keeps the
/// `limit` locks with the most wait time. Frames are left empty for the caller.
pub fn top_locks(
    entries: &[(LockKey, Histogram)],
    include: impl Fn(u32) -> bool,
    limit: usize,
) -> Vec<LockReport> {
    let mut by_lock: BTreeMap<(u32, u64), (Histogram, Vec<StackReport>)> = BTreeMap::new();
    for (key, histogram) in entries.iter().filter(|(key, _)| include(key.tgid)) {
        let (total, stacks) = by_lock.entry((key.tgid, key.address)).or_default();
        total.add(histogram);
        stacks.push(StackReport {
            wait_seconds: histogram.sum_ns as f64 / 1e9,
            waits: histogram.count(),
            timed: key.timed != 0,
            frames: Vec::new(),
            stack_id: key.stack,
            addresses: Vec::new(),
        });
    }
    let mut locks: Vec<LockReport> = by_lock
        .into_iter()
        .filter(|(_, (total, _))| total.count() > 0)
        .map(|((pid, address), (total, mut stacks))| {
            stacks.sort_by(|a, b| b.wait_seconds.total_cmp(&a.wait_seconds));
            let [p50_seconds, p99_seconds] = quantiles(&total, [0.5, 0.99]).unwrap_or_default();
            LockReport {
                pid,
                address: format!("{address:#x}"),
                wait_seconds: total.sum_ns as f64 / 1e9,
                waits: total.count(),
                timed_waits: stacks
                    .iter()
                    .filter(|stack| stack.timed)
                    .map(|stack| stack.waits)
                    .sum(),
                p50_seconds,
                p99_seconds,
                stacks,
            }
        })
        .collect();
    locks.sort_by(|a, b| b.wait_seconds.total_cmp(&a.wait_seconds));
    locks.truncate(limit);
    locks
}

#[cfg(test)]
pub(crate) mod tests {
    use poolscope_shared::histogram_bucket;

    use super::*;

    /// A histogram of the waits `waits_ns`.
    pub(crate) fn histogram(waits_ns: &[u64]) -> Histogram {
        let mut histogram = Histogram::default();
        for &ns in waits_ns {
            histogram.buckets[histogram_bucket(ns)] += 1;
            histogram.sum_ns += ns;
        }
        histogram
    }

    /// An untimed wait's key.
    pub(crate) fn key(tgid: u32, stack: i32, address: u64) -> LockKey {
        LockKey {
            tgid,
            stack,
            address,
            timed: 0,
            _pad: 0,
        }
    }

    #[test]
    fn locks_are_grouped_over_stacks_and_ranked_by_wait() {
        let entries = vec![
            (key(10, 1, 0x1000), histogram(&[1_000_000, 3_000_000])),
            (
                LockKey {
                    timed: 1,
                    ..key(10, 2, 0x1000)
                },
                histogram(&[2_000_000]),
            ),
            (key(10, 1, 0x2000), histogram(&[500_000])),
            // Another process: same address, another lock.
            (key(11, 1, 0x1000), histogram(&[9_000_000])),
            // Excluded process.
            (key(12, 1, 0x1000), histogram(&[90_000_000])),
        ];
        let locks = top_locks(&entries, |pid| pid != 12, 2);
        assert_eq!(locks.len(), 2);
        assert_eq!((locks[0].pid, locks[0].address.as_str()), (11, "0x1000"));
        let lock = &locks[1];
        assert_eq!(
            (lock.pid, lock.address.as_str(), lock.waits),
            (10, "0x1000", 3)
        );
        assert!((lock.wait_seconds - 0.006).abs() < 1e-12);
        // Stacks most wait first.
        assert_eq!(lock.stacks[0].stack_id, 1);
        assert_eq!(lock.stacks[0].waits, 2);
        assert_eq!(lock.stacks[1].stack_id, 2);
        // The timed waits of a lock are those of its stacks with a timeout.
        assert_eq!(lock.timed_waits, 1);
        assert!(lock.stacks[1].timed && !lock.stacks[0].timed);
        // The median of 1, 2, 3 ms within a fine bucket (1/8 octave) of 2 ms.
        assert!(
            (lock.p50_seconds - 0.002).abs() <= 0.002 / 8.0,
            "{}",
            lock.p50_seconds
        );
    }
}
