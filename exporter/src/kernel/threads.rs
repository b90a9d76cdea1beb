//! The thread and pool maps: the thread array (through `slots.rs`), `THREADS`,
//! `THREAD_POOLS`, `POOL_STATS`, `POOL_RUNQUEUE`, `LOCK_WAITS` and `DOWNSTREAM_WAITS`
//! ([`ThreadTable`], and their read for a scrape).
use std::{collections::BTreeMap, sync::Arc};

use aya::maps::{MapError, PerCpuValues};
use poolscope_shared::{
    DownstreamKey, Histogram, LockPrimitive, NO_POOL, PoolStats, Thread, lock_wait_index, maps,
};

use super::{BPF_NOEXIST, Claim, Kernel, KernelError, LockWaits, Readout, ThreadTable};

/// How much of the pools' waits a read takes besides their stats and threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolWaits {
    /// None (the utilization sample needs the threads' time only).
    Skipped,
    /// Lock and downstream waits; run-queue waits as the stats' count and sum only
    /// (what a scrape exports by default: the mean wait).
    Totals,
    /// Also each pool's per-CPU run-queue histogram (kilobytes per pool per CPU), for
    /// a scrape that exports the buckets (`[metrics] pool_histogram_buckets`).
    WithRunqueueHistograms,
}

impl ThreadTable for Kernel {
    fn follow_thread(&mut self, tid: u32, thread: Thread) -> Result<(), MapError> {
        // Followed already in `THREADS` (its slot was taken when the kernel followed
        // it): not followed twice.
        if self.thread_slots.overflow(tid) > 0 && self.threads.get(&tid, 0).is_ok() {
            return Ok(());
        }
        if self.thread_slots.claim(tid, &thread) == Claim::Owned {
            return Ok(());
        }
        // Counted before the entry exists: the scheduler programs never look up an
        // entry whose slot they read as holding none in `THREADS`.
        self.thread_slots.count_overflow(tid, true);
        let inserted = self.threads.insert(tid, thread, BPF_NOEXIST);
        if inserted.is_err() {
            self.thread_slots.count_overflow(tid, false);
        }
        match inserted {
            Err(MapError::SyscallError(error))
                if error.io_error.raw_os_error() == Some(libc::EEXIST) =>
            {
                Ok(())
            }
            other => other,
        }
    }

    fn set_thread_pool(&mut self, tid: u32, pool: u32) -> Result<(), MapError> {
        self.thread_pools_read.remove(&tid);
        self.thread_pools.insert(tid, pool, 0)?;
        // After the change: the kernel's copies of this thread's pool are read again.
        let epoch = self.pools_epoch.wrapping_add(1);
        self.pool_epoch.set(0, epoch, 0)?;
        self.pools_epoch = epoch;
        Ok(())
    }

    fn forget_thread(&mut self, tid: u32) {
        // Either may be gone already (the thread exited, and the kernel freed it).
        if !self.thread_slots.release(tid) && self.threads.remove(&tid).is_ok() {
            self.thread_slots.count_overflow(tid, false);
        }
        let _ = self.thread_pools.remove(&tid);
        self.thread_pools_read.remove(&tid);
    }

    fn reset_pool(&mut self, pool: u32) -> Result<(), MapError> {
        let zeros = PerCpuValues::try_from(vec![PoolStats::default(); self.cpus])?;
        self.pool_stats.set(pool, zeros, 0)?;
        let zeros = PerCpuValues::try_from(vec![Histogram::default(); self.cpus])?;
        self.pool_runqueue.set(pool, zeros, 0)?;
        self.runqueues_read.forget(pool);
        for primitive in LockPrimitive::ALL {
            let index = lock_wait_index(pool, primitive);
            self.lock_waits.set(index, Histogram::default(), 0)?;
            self.lock_wait_counts.reset(index);
            self.lock_waits_read.forget(index);
        }
        // Normally gone already (released with its service), unless a thread of the
        // departed pool was still exiting then.
        self.release_pools(&[pool]);
        Ok(())
    }

    fn release_pools(&mut self, pools: &[u32]) {
        let peers: Vec<DownstreamKey> = self
            .downstream_waits
            .keys()
            .filter_map(Result::ok)
            .filter(|key| pools.contains(&key.pool))
            .collect();
        for key in peers {
            // Gone already if removed meanwhile; nothing else to do.
            let _ = self.downstream_waits.remove(&key);
        }
    }
}

impl Kernel {
    /// Every followed thread with its pool (if named). A thread's pool is the
    /// kernel's copy in its entry while that copy is current (`Thread::pool`), else
    /// the pool the last read found for it (the same tid of the same service), else
    /// looked up in `THREAD_POOLS`. The pool of a thread changes only when user space
    /// names it (which forgets what was read) or the kernel follows a new thread: a
    /// new tid, or a reused one, whose service is checked (a tid reused by the same
    /// service between two reads is taken for the thread before it, as `Pools`
    /// takes it: it names each tid once). Walking that map's 65,536 buckets instead
    /// cost ~0.4 ms a scrape at 110 services. The thread array is read through its
    /// mapping; `THREADS` only if some slot counts a thread there.
    fn thread_entries(&mut self) -> Result<Vec<(u32, Thread, Option<u32>)>, KernelError> {
        let mut threads = std::mem::take(&mut self.slots_read);
        let overflow = self.thread_slots.read_into(&mut threads);
        self.threads_overflow = 0;
        if overflow > 0 {
            let overflowed: Vec<(u32, Thread)> =
                self.batch
                    .threads
                    .hash_entries()
                    .map_err(|source| KernelError::Batch {
                        map: maps::THREADS,
                        source,
                    })?;
            self.threads_overflow = overflowed.len() as u64;
            threads.extend(overflowed);
        }
        let current = self.pools_epoch.wrapping_add(1);
        // This read's map is the last read's spare, emptied: no allocation.
        let mut before = std::mem::replace(
            &mut self.thread_pools_read,
            std::mem::take(&mut self.thread_pools_spare),
        );
        let mut entries = std::mem::take(&mut self.entries_spare);
        entries.clear();
        entries.reserve(threads.len());
        for (tid, thread) in threads.drain(..) {
            let read_before = before
                .get(&tid)
                .filter(|(service, _)| *service == thread.service);
            let pool = if thread.pool_epoch == current {
                thread.pool
            } else if let Some(&(_, pool)) = read_before {
                pool
            } else {
                self.pool_in_map(tid)?
            };
            self.thread_pools_read.insert(tid, (thread.service, pool));
            entries.push((tid, thread, (pool != NO_POOL).then_some(pool)));
        }
        before.clear();
        self.thread_pools_spare = before;
        self.slots_read = threads;
        Ok(entries)
    }

    /// The pool `THREAD_POOLS` holds for `tid` ([`NO_POOL`]: none, its creator had
    /// none when the kernel followed it).
    fn pool_in_map(&self, tid: u32) -> Result<u32, KernelError> {
        match self.thread_pools.get(&tid, 0) {
            Ok(pool) => Ok(pool),
            Err(MapError::KeyNotFound) => Ok(NO_POOL),
            Err(source) => Err(KernelError::Map {
                map: maps::THREAD_POOLS,
                source,
            }),
        }
    }

    /// Reads the stats of `pools`, their waits as far as `waits` asks, and then every
    /// followed thread (in that order: the kernel updates a thread before its pool,
    /// so a transition between the two reads is missed once, never counted twice).
    pub fn read_pools(
        &mut self,
        pools: &[u32],
        waits: PoolWaits,
        readout: &mut Readout,
    ) -> Result<(), KernelError> {
        let batch_error = |map| move |source| KernelError::Batch { map, source };
        readout.pools = self
            .batch
            .pool_stats
            .sum_by_id::<PoolStats>(pools, self.cpus, PoolStats::add)
            .map_err(batch_error(maps::POOL_STATS))?
            .into_iter()
            .collect();
        if waits == PoolWaits::WithRunqueueHistograms {
            readout.runqueues = self.read_runqueues(&readout.pools)?;
        }
        if waits != PoolWaits::Skipped {
            readout.lock_waits = self.read_lock_waits(pools)?;
            readout.downstreams = self
                .downstream_waits
                .iter()
                .filter_map(Result::ok)
                .collect();
        }
        self.read_threads(readout)
    }

    /// Takes back the threads of a readout read through: the next read fills the
    /// same buffer (~150 kB at 1,000 threads), whose pages are then not faulted in
    /// again.
    pub fn give_back_threads(&mut self, threads: Vec<(u32, Thread, Option<u32>)>) {
        self.entries_spare = threads;
    }

    /// Reads every followed thread, and when.
    pub fn read_threads(&mut self, readout: &mut Readout) -> Result<(), KernelError> {
        readout.threads_read_ns = crate::clock::monotonic_ns();
        readout.threads = self.thread_entries()?;
        Ok(())
    }

    /// The run-queue waits of each of `pools` that waited (with their stats, read just
    /// before): the histograms whose count moved since they were last read are read
    /// again, the rest kept.
    fn read_runqueues(
        &mut self,
        pools: &BTreeMap<u32, PoolStats>,
    ) -> Result<BTreeMap<u32, Arc<Histogram>>, KernelError> {
        // A pool that never waited has no entry rather than zeros.
        let counts: Vec<(u32, u64)> = pools
            .iter()
            .filter(|(_, stats)| stats.runqueue_waits > 0)
            .map(|(&pool, stats)| (pool, stats.runqueue_waits))
            .collect();
        self.runqueues_read
            .refresh_sums(
                &counts,
                &self.batch.pool_runqueue,
                self.cpus,
                Histogram::add,
            )
            .map_err(|source| KernelError::Batch {
                map: maps::POOL_RUNQUEUE,
                source,
            })
    }

    /// The lock waits of each of `pools` that waited: the histograms whose count
    /// moved since they were last read are read again, the rest kept.
    fn read_lock_waits(&mut self, pools: &[u32]) -> Result<BTreeMap<u32, LockWaits>, KernelError> {
        // Most pools never wait on a lock: no entry rather than zeros.
        let counts: Vec<(u32, u64)> = pools
            .iter()
            .flat_map(|&pool| LockPrimitive::ALL.map(|primitive| lock_wait_index(pool, primitive)))
            .map(|index| (index, self.lock_wait_counts.get(index)))
            .filter(|&(_, count)| count > 0)
            .collect();
        let batch = &self.batch.lock_waits;
        self.lock_waits_read
            .refresh(&counts, |moved| {
                let mut fresh = Vec::with_capacity(moved.len());
                batch.array_each_of::<Histogram>(moved, 1, |index, histogram| {
                    fresh.push((index as u32, Arc::new(*histogram)));
                })?;
                Ok(fresh)
            })
            .map_err(|source| KernelError::Batch {
                map: maps::LOCK_WAITS,
                source,
            })?;
        let mut waits: BTreeMap<u32, LockWaits> = BTreeMap::new();
        for (index, _) in counts {
            if let Some(histogram) = self.lock_waits_read.get(index) {
                let (pool, primitive) =
                    (index / LockPrimitive::COUNT, index % LockPrimitive::COUNT);
                waits.entry(pool).or_default()[primitive as usize] = Some(Arc::clone(histogram));
            }
        }
        Ok(waits)
    }
}
