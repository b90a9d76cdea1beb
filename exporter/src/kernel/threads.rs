//! The thread and pool maps: `THREADS`, `THREAD_POOLS`, `POOL_STATS`, `LOCK_WAITS`
//! and `DOWNSTREAM_WAITS` ([`ThreadTable`], and their read for a scrape).
use aya::maps::{MapError, PerCpuValues};
use poolscope_shared::{
    DownstreamKey, Histogram, LockPrimitive, PoolStats, Thread, lock_wait_index, maps,
};

use super::{BPF_NOEXIST, Kernel, KernelError, Readout, ThreadTable};

impl ThreadTable for Kernel {
    fn follow_thread(&mut self, tid: u32, thread: Thread) -> Result<(), MapError> {
        match self.threads.insert(tid, thread, BPF_NOEXIST) {
            Err(MapError::SyscallError(error))
                if error.io_error.raw_os_error() == Some(libc::EEXIST) =>
            {
                Ok(())
            }
            other => other,
        }
    }

    fn set_thread_pool(&mut self, tid: u32, pool: u32) -> Result<(), MapError> {
        self.thread_pools.insert(tid, pool, 0)
    }

    fn forget_thread(&mut self, tid: u32) {
        // Either may be gone already (the thread exited).
        let _ = self.threads.remove(&tid);
        let _ = self.thread_pools.remove(&tid);
    }

    fn reset_pool(&mut self, pool: u32) -> Result<(), MapError> {
        let zeros = PerCpuValues::try_from(vec![PoolStats::default(); self.cpus])?;
        self.pool_stats.set(pool, zeros, 0)?;
        for primitive in LockPrimitive::ALL {
            self.lock_waits
                .set(lock_wait_index(pool, primitive), Histogram::default(), 0)?;
        }
        let peers: Vec<DownstreamKey> = self
            .downstream_waits
            .keys()
            .filter_map(Result::ok)
            .filter(|key| key.pool == pool)
            .collect();
        for key in peers {
            // Gone already if removed meanwhile; nothing else to do.
            let _ = self.downstream_waits.remove(&key);
        }
        Ok(())
    }
}

impl Kernel {
    /// Every followed thread.
    pub fn thread_entries(&self) -> Vec<(u32, Thread)> {
        self.threads.iter().filter_map(Result::ok).collect()
    }
    /// Reads the stats of `pools` and then every followed thread (in that order:
    /// the kernel updates a thread before its pool, so a transition between the two
    /// reads is missed once, never counted twice).
    pub fn read_pools(&self, pools: &[u32], readout: &mut Readout) -> Result<(), KernelError> {
        for &pool in pools {
            let per_cpu = self
                .pool_stats
                .get(&pool, 0)
                .map_err(|source| KernelError::Map {
                    map: maps::POOL_STATS,
                    source,
                })?;
            let mut total = PoolStats::default();
            for cpu in per_cpu.iter() {
                total.add(cpu);
            }
            readout.pools.insert(pool, total);
            let mut waits = [Histogram::default(); LockPrimitive::COUNT as usize];
            for (primitive, histogram) in LockPrimitive::ALL.iter().zip(&mut waits) {
                *histogram = self
                    .lock_waits
                    .get(&lock_wait_index(pool, *primitive), 0)
                    .map_err(|source| KernelError::Map {
                        map: maps::LOCK_WAITS,
                        source,
                    })?;
            }
            readout.lock_waits.insert(pool, waits);
        }
        readout.downstreams = self
            .downstream_waits
            .iter()
            .filter_map(Result::ok)
            .collect();
        readout.threads_read_ns = crate::clock::monotonic_ns();
        readout.threads = self
            .thread_entries()
            .into_iter()
            .map(|(tid, thread)| (tid, thread, self.thread_pools.get(&tid, 0).ok()))
            .collect();
        Ok(())
    }
}
