//! The threads-and-pools part of [`Kernel`] ([`Pools`]): the thread array (through
//! `slots.rs`), `THREADS`, `THREAD_POOLS`, `POOL_STATS`, `POOL_RUNQUEUE`, `LOCK_WAITS`
//! and `DOWNSTREAM_WAITS` ([`ThreadTable`], and their read for a scrape).
use std::{collections::BTreeMap, sync::Arc};

use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData, MapError, PerCpuArray, PerCpuValues},
};
use poolscope_shared::{
    DownstreamKey, DownstreamWait, Histogram, LockPrimitive, NO_POOL, PoolStats, Thread,
    lock_wait_index, maps,
};

use super::{
    BPF_NOEXIST, Claim, Kernel, KernelError, LockWaits, MapSizes, Readout, ThreadSlots,
    ThreadTable, batch::BatchMap, mapping::Counters, reread::Reread, take,
};
use crate::{config::Limits, idmap::IdMap};

/// The maps of the followed threads and of their pools, with what the last read of
/// them keeps for the next.
pub(super) struct Pools {
    /// The thread array, mapped; and the followed threads whose slot another owns,
    /// with how many of them the last read found.
    thread_slots: ThreadSlots,
    threads: HashMap<MapData, u32, Thread>,
    threads_overflow: u64,
    /// Raised after each change to `thread_pools`, and its value (user space is its
    /// only writer).
    pool_epoch: Array<MapData, u32>,
    pools_epoch: u32,
    thread_pools: HashMap<MapData, u32, u32>,
    /// tid → (service, pool) as the last read of the threads found them (see
    /// `thread_entries`).
    thread_pools_read: IdMap<u32, (u32, u32)>,
    /// Buffers of the last read of the threads, kept for the next so that their
    /// pages stay mapped: the map `thread_pools_read` is swapped with (emptied),
    /// the slots' copies (emptied), and the entries a readout gave back (emptied
    /// when taken).
    thread_pools_spare: IdMap<u32, (u32, u32)>,
    slots_read: Vec<(u32, Thread)>,
    entries_spare: Vec<(u32, Thread, Option<u32>)>,
    pool_stats: PerCpuArray<MapData, PoolStats>,
    pool_runqueue: PerCpuArray<MapData, Histogram>,
    lock_waits: Array<MapData, Histogram>,
    /// Counts of the records in `lock_waits` (mapped: a scrape reads them all).
    lock_wait_counts: Counters,
    downstream_waits: HashMap<MapData, DownstreamKey, DownstreamWait>,
    /// Each pool's lock waits and run-queue waits, as last read.
    lock_waits_read: Reread<Histogram>,
    runqueues_read: Reread<Histogram>,
    /// The maps a scrape reads whole, for batch reads.
    threads_batch: BatchMap,
    pool_stats_batch: BatchMap,
    pool_runqueue_batch: BatchMap,
    lock_waits_batch: BatchMap,
}

impl Pools {
    /// The sizes `limits` gives these maps.
    pub fn sizes(limits: &Limits) -> MapSizes {
        vec![
            (maps::THREAD_ENTRIES, limits.thread_slots),
            (maps::THREAD_OWNERS, limits.thread_slots),
            (maps::THREADS, limits.threads),
            (maps::THREAD_POOLS, limits.threads),
            (maps::POOL_STATS, limits.max_pools),
            (maps::POOL_RUNQUEUE, limits.max_pools),
            (maps::LOCK_WAITS, lock_wait_slots(limits)),
            (maps::LOCK_WAIT_COUNTS, lock_wait_slots(limits)),
            (maps::DOWNSTREAM_WAITS, limits.downstreams),
        ]
    }

    /// The load-time globals `limits` gives these programs: the mask of a tid's
    /// slot in `THREAD_ENTRIES` and `THREAD_OWNERS` (a power of two in size).
    pub fn globals(limits: &Limits) -> Vec<(&'static str, u32)> {
        vec![("THREAD_SLOT_MASK", limits.thread_slots.wrapping_sub(1))]
    }

    /// Takes the thread and pool maps out of `ebpf` (the thread array and the
    /// lock-wait counts mapped, as `limits` sized them).
    pub fn take(ebpf: &mut Ebpf, limits: &Limits) -> Result<Self, KernelError> {
        // Descriptors and mappings first: they find their maps by name in `ebpf`.
        let threads_batch = BatchMap::named(ebpf, maps::THREADS)?;
        let pool_stats_batch = BatchMap::named(ebpf, maps::POOL_STATS)?;
        let pool_runqueue_batch = BatchMap::named(ebpf, maps::POOL_RUNQUEUE)?;
        let lock_waits_batch = BatchMap::named(ebpf, maps::LOCK_WAITS)?;
        let lock_wait_counts = Counters::of(ebpf, maps::LOCK_WAIT_COUNTS, lock_wait_slots(limits))?;
        Ok(Self {
            thread_slots: ThreadSlots::map(ebpf, limits.thread_slots)?,
            threads: take(ebpf, maps::THREADS)?,
            threads_overflow: 0,
            pool_epoch: take(ebpf, maps::POOL_EPOCH)?,
            pools_epoch: 0,
            thread_pools: take(ebpf, maps::THREAD_POOLS)?,
            thread_pools_read: IdMap::default(),
            thread_pools_spare: IdMap::default(),
            slots_read: Vec::new(),
            entries_spare: Vec::new(),
            pool_stats: take(ebpf, maps::POOL_STATS)?,
            pool_runqueue: take(ebpf, maps::POOL_RUNQUEUE)?,
            lock_waits: take(ebpf, maps::LOCK_WAITS)?,
            lock_wait_counts,
            downstream_waits: take(ebpf, maps::DOWNSTREAM_WAITS)?,
            lock_waits_read: Reread::default(),
            runqueues_read: Reread::default(),
            threads_batch,
            pool_stats_batch,
            pool_runqueue_batch,
            lock_waits_batch,
        })
    }

    /// How many followed threads the last read found in `THREADS` (their slot owned
    /// by another).
    pub fn threads_overflow(&self) -> u64 {
        self.threads_overflow
    }
}

/// Entries of the per pool × primitive arrays (`LOCK_WAITS`, `LOCK_WAIT_COUNTS`).
fn lock_wait_slots(limits: &Limits) -> u32 {
    limits.max_pools * LockPrimitive::COUNT
}

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
        if self.pools.thread_slots.overflow(tid) > 0 && self.pools.threads.get(&tid, 0).is_ok() {
            return Ok(());
        }
        if self.pools.thread_slots.claim(tid, &thread) == Claim::Owned {
            return Ok(());
        }
        // Counted before the entry exists: the scheduler programs never look up an
        // entry whose slot they read as holding none in `THREADS`.
        self.pools.thread_slots.count_overflow(tid, true);
        let inserted = self.pools.threads.insert(tid, thread, BPF_NOEXIST);
        if inserted.is_err() {
            self.pools.thread_slots.count_overflow(tid, false);
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
        self.pools.thread_pools_read.remove(&tid);
        self.pools.thread_pools.insert(tid, pool, 0)?;
        // After the change: the kernel's copies of this thread's pool are read again.
        let epoch = self.pools.pools_epoch.wrapping_add(1);
        self.pools.pool_epoch.set(0, epoch, 0)?;
        self.pools.pools_epoch = epoch;
        Ok(())
    }

    fn forget_thread(&mut self, tid: u32) {
        // Either may be gone already (the thread exited, and the kernel freed it).
        if !self.pools.thread_slots.release(tid) && self.pools.threads.remove(&tid).is_ok() {
            self.pools.thread_slots.count_overflow(tid, false);
        }
        let _ = self.pools.thread_pools.remove(&tid);
        self.pools.thread_pools_read.remove(&tid);
    }

    fn reset_pool(&mut self, pool: u32) -> Result<(), MapError> {
        let zeros = PerCpuValues::try_from(vec![PoolStats::default(); self.cpus])?;
        self.pools.pool_stats.set(pool, zeros, 0)?;
        let zeros = PerCpuValues::try_from(vec![Histogram::default(); self.cpus])?;
        self.pools.pool_runqueue.set(pool, zeros, 0)?;
        self.pools.runqueues_read.forget(pool);
        for primitive in LockPrimitive::ALL {
            let index = lock_wait_index(pool, primitive);
            self.pools.lock_waits.set(index, Histogram::default(), 0)?;
            self.pools.lock_wait_counts.reset(index);
            self.pools.lock_waits_read.forget(index);
        }
        // Normally gone already (released with its service), unless a thread of the
        // departed pool was still exiting then.
        self.release_pools(&[pool]);
        Ok(())
    }

    fn release_pools(&mut self, pools: &[u32]) {
        let peers: Vec<DownstreamKey> = self
            .pools
            .downstream_waits
            .keys()
            .filter_map(Result::ok)
            .filter(|key| pools.contains(&key.pool))
            .collect();
        for key in peers {
            // Gone already if removed meanwhile; nothing else to do.
            let _ = self.pools.downstream_waits.remove(&key);
        }
    }
}

impl Pools {
    /// Every followed thread with its pool (if named). A thread's pool is the
    /// kernel's copy in its entry while that copy is current (`Thread::pool`), else
    /// the pool the last read found for it (the same tid of the same service), else
    /// looked up in `THREAD_POOLS`. The pool of a thread changes only when user space
    /// names it (which forgets what was read) or the kernel follows a new thread: a
    /// new tid, or a reused one, whose service is checked (a tid reused by the same
    /// service between two reads is taken for the thread before it, as
    /// `discovery::pools::Pools` takes it: it names each tid once). Walking that map's
    /// 65,536 buckets instead cost ~0.4 ms a scrape at 110 services. The thread array
    /// is read through its mapping; `THREADS` only if some slot counts a thread there.
    fn thread_entries(&mut self) -> Result<Vec<(u32, Thread, Option<u32>)>, KernelError> {
        let mut threads = std::mem::take(&mut self.slots_read);
        let overflow = self.thread_slots.read_into(&mut threads);
        self.threads_overflow = 0;
        if overflow > 0 {
            let overflowed: Vec<(u32, Thread)> =
                self.threads_batch
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

    /// The run-queue waits of each of `pools` that waited (with their stats, read just
    /// before; per CPU, over `cpus`): the histograms whose count moved since they were last read are read
    /// again, the rest kept.
    fn read_runqueues(
        &mut self,
        pools: &BTreeMap<u32, PoolStats>,
        cpus: usize,
    ) -> Result<BTreeMap<u32, Arc<Histogram>>, KernelError> {
        // A pool that never waited has no entry rather than zeros.
        let counts: Vec<(u32, u64)> = pools
            .iter()
            .filter(|(_, stats)| stats.runqueue_waits > 0)
            .map(|(&pool, stats)| (pool, stats.runqueue_waits))
            .collect();
        self.runqueues_read
            .refresh_sums(&counts, &self.pool_runqueue_batch, cpus, Histogram::add)
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
        let batch = &self.lock_waits_batch;
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

impl Kernel {
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
            .pools
            .pool_stats_batch
            .sum_by_id::<PoolStats>(pools, self.cpus, PoolStats::add)
            .map_err(batch_error(maps::POOL_STATS))?
            .into_iter()
            .collect();
        if waits == PoolWaits::WithRunqueueHistograms {
            readout.runqueues = self.pools.read_runqueues(&readout.pools, self.cpus)?;
        }
        if waits != PoolWaits::Skipped {
            readout.lock_waits = self.pools.read_lock_waits(pools)?;
            readout.downstreams = self
                .pools
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
        self.pools.entries_spare = threads;
    }

    /// Reads every followed thread, and when.
    pub fn read_threads(&mut self, readout: &mut Readout) -> Result<(), KernelError> {
        readout.threads_read_ns = crate::clock::monotonic_ns();
        readout.threads = self.pools.thread_entries()?;
        Ok(())
    }
}
