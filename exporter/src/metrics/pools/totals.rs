//! Pool totals: the reduction of the kernel's per-pool stats plus each live thread's
//! open interval into each pool's times, waits and threads at one instant.
use std::{collections::BTreeMap, sync::Arc};

use poolscope_shared::{Activity, Histogram, Thread};

use crate::kernel::{LockWaits, Readout};

/// One pool's numbers at one instant: closed intervals plus the live threads' open ones.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolTotals {
    /// Thread time per [`Activity`].
    pub time_ns: [u64; Activity::COUNT],
    /// Request time per [`Activity`] of the serving thread.
    pub request_ns: [u64; Activity::COUNT],
    /// Run-queue waits, `None` if the pool never waited or the scrape did not ask
    /// for the buckets ([`crate::kernel::PoolWaits`]). Histograms are kilobytes
    /// each and every scrape moves the totals of every pool through maps and rows:
    /// they are shared with the kernel reader's copy (kept between reads, see
    /// `kernel/reread.rs`), and a pool that never waited carries none (zeroed ones,
    /// allocated, copied and summed for every pool, cost a 110-service scrape ~1 ms).
    pub runqueue: Option<Arc<Histogram>>,
    /// Run-queue waits and their time, from the pool's stats (the mean wait, exported
    /// without `runqueue`'s buckets).
    pub runqueue_waits: u64,
    pub runqueue_wait_ns: u64,
    /// Lock waits per [`LockPrimitive`], `None` for a primitive never waited on.
    pub lock_waits: LockWaits,
    pub threads: u64,
    pub threads_busy: u64,
    /// Live threads that answer HTTP/2 streams other threads read
    /// (`Thread::is_stream_worker`), and those of them busy.
    pub stream_workers: u64,
    pub stream_workers_busy: u64,
    /// Live threads that have read a request (`Thread::served`).
    pub threads_served: u64,
    /// Threads that exited after reading one (`PoolStats::served_exits`).
    pub served_exits: u64,
}

impl PoolTotals {
    pub fn busy_ns(&self) -> u64 {
        self.total_ns() - self.time_ns[Activity::OffIdle as usize]
    }

    pub fn total_ns(&self) -> u64 {
        self.time_ns.iter().sum()
    }
}

/// Per-pool totals of a readout: the kernel's closed intervals, plus for each live
/// thread the interval it is in, up to when the threads were read.
pub fn totals(readout: &Readout) -> BTreeMap<u32, PoolTotals> {
    let mut totals: BTreeMap<u32, PoolTotals> = readout
        .pools
        .iter()
        .map(|(pool, stats)| {
            let totals = PoolTotals {
                time_ns: stats.time_ns,
                request_ns: stats.request_ns,
                runqueue: readout.runqueues.get(pool).cloned(),
                runqueue_waits: stats.runqueue_waits,
                runqueue_wait_ns: stats.runqueue_wait_ns,
                lock_waits: readout.lock_waits.get(pool).cloned().unwrap_or_default(),
                threads: 0,
                threads_busy: 0,
                stream_workers: 0,
                stream_workers_busy: 0,
                threads_served: 0,
                served_exits: stats.served_exits,
            };
            (*pool, totals)
        })
        .collect();
    for (_, thread, pool) in &readout.threads {
        let Some(pool_totals) = pool.and_then(|pool| totals.get_mut(&pool)) else {
            continue;
        };
        let activity = Activity::from_u32(thread.activity);
        let open = readout.threads_read_ns.saturating_sub(thread.since_ns);
        pool_totals.time_ns[activity as usize] += open;
        pool_totals.request_ns[activity as usize] += open * u64::from(thread.serving.open());
        pool_totals.threads += 1;
        pool_totals.threads_served += u64::from(thread.served != 0);
        let stream_worker = thread.is_stream_worker();
        pool_totals.stream_workers += u64::from(stream_worker);
        if activity.is_busy() {
            pool_totals.threads_busy += 1;
            pool_totals.stream_workers_busy += u64::from(stream_worker);
        }
    }
    totals
}

/// A thread's time on CPU and in the run queue up to `now_ns`, open interval included
/// (comparable with schedstat fields 1 and 2).
pub fn thread_times(thread: &Thread, now_ns: u64) -> (u64, u64) {
    let open = now_ns.saturating_sub(thread.since_ns);
    match Activity::from_u32(thread.activity) {
        Activity::Running => (thread.running_ns + open, thread.runnable_ns),
        Activity::Runnable => (thread.running_ns, thread.runnable_ns + open),
        _ => (thread.running_ns, thread.runnable_ns),
    }
}
