//! The read for a scrape: every counter of the watched services and pools, the loss
//! counters, how full each map is and the programs' own run time.
use std::{collections::BTreeMap, sync::Arc, time::Duration};

use poolscope_shared::{
    DownstreamKey, DownstreamWait, Histogram, LOSSES_SIZE, LockPrimitive, LossErrno, LossSource,
    OffcpuCaptures, PoolStats, RequestTimes, ServiceCounters, SyscallSlot, Thread, loss_index,
    maps::{self, CountedMap},
    syscall_counter_index,
};

use super::{Backend, Kernel, KernelError, PoolWaits, WatchTable};

/// A pool's lock waits per [`LockPrimitive`], `None` for a primitive it never waited
/// on.
pub type LockWaits = [Option<Arc<Histogram>>; LockPrimitive::COUNT as usize];

/// Everything the kernel counted, read for one scrape.
#[derive(Clone, Debug, Default)]
pub struct Readout {
    /// The `WATCHED` map: pid → `since_ns`.
    pub watched: BTreeMap<u32, u64>,
    pub services: BTreeMap<u32, ServiceCounters>,
    /// Durations of finished requests per service, since the service id was assigned
    /// (shared with the kernel reader's copy, which keeps them between reads).
    pub request_times: BTreeMap<u32, Arc<RequestTimes>>,
    pub syscalls: BTreeMap<(u32, &'static str), u64>,
    /// Closed intervals of each pool's threads, read before `threads`.
    pub pools: BTreeMap<u32, PoolStats>,
    /// Run-queue waits of each pool (shared with the kernel reader's copy, as the
    /// request times); read only for [`PoolWaits::WithRunqueueHistograms`].
    pub runqueues: BTreeMap<u32, Arc<Histogram>>,
    /// Lock waits of each pool that waited (shared as the run-queue waits).
    pub lock_waits: BTreeMap<u32, LockWaits>,
    /// Network waits of each pool's serving threads, per socket peer.
    pub downstreams: Vec<(DownstreamKey, DownstreamWait)>,
    /// CLOCK_MONOTONIC ns between reading `pools` and `threads`: the end of each
    /// thread's open interval.
    pub threads_read_ns: u64,
    /// The watched threads: tid, state, pool (if named).
    pub threads: Vec<(u32, Thread, Option<u32>)>,
    /// Every kernel-side loss counter, by source and errno.
    pub losses: Vec<(LossSource, LossErrno, u64)>,
    /// Off-CPU blocks captured in full, sampled and left out, summed over CPUs.
    pub offcpu_captures: OffcpuCaptures,
    pub maps: Vec<MapFill>,
    pub programs: Vec<ProgramStats>,
}

#[derive(Clone, Debug)]
pub struct MapFill {
    pub name: &'static str,
    pub entries: u64,
    /// `None` for a map without a size (socket storage).
    pub capacity: Option<u32>,
}

#[derive(Clone, Debug)]
pub struct ProgramStats {
    pub name: String,
    pub run_time: Duration,
    pub runs: u64,
}
impl Kernel {
    /// Every kernel-side loss counter, summed over CPUs.
    pub fn losses(&self) -> Result<Vec<(LossSource, LossErrno, u64)>, KernelError> {
        let mut sums = vec![0u64; LOSSES_SIZE as usize];
        self.batch
            .losses
            .array_each::<u64>(0..LOSSES_SIZE, self.cpus, |index, lost| sums[index] += lost)
            .map_err(|source| KernelError::Batch {
                map: maps::LOSSES,
                source,
            })?;
        Ok(LossSource::ALL
            .into_iter()
            .flat_map(|source| LossErrno::ALL.map(|errno| (source, errno)))
            .map(|(source, errno)| {
                let lost = sums.get(loss_index(source, errno) as usize).copied();
                (source, errno, lost.unwrap_or(0))
            })
            .collect())
    }
    /// The connection and request counters of `services`, summed over CPUs.
    pub fn read_services(
        &self,
        services: &[u32],
    ) -> Result<BTreeMap<u32, ServiceCounters>, KernelError> {
        self.batch
            .service_counters
            .sum_by_id::<ServiceCounters>(services, self.cpus, |total, cpu| {
                *total = total.plus(cpu);
            })
            .map(|sums| sums.into_iter().collect())
            .map_err(|source| KernelError::Batch {
                map: maps::SERVICE_COUNTERS,
                source,
            })
    }
    /// The request times of `services` (with their counters, read just before):
    /// those whose finished count moved since they were last read are read again,
    /// the rest kept.
    fn read_request_times(
        &mut self,
        services: &BTreeMap<u32, ServiceCounters>,
    ) -> BTreeMap<u32, Arc<RequestTimes>> {
        let finished: Vec<(u32, u64)> = services
            .iter()
            .map(|(&id, counters)| (id, counters.finished))
            .collect();
        let mapped = &self.request_times;
        self.request_times_read
            .refresh_mapped(&finished, |id| mapped.get(id))
    }

    /// Reads the counters of `services` and `pools` and the exporter's own
    /// kernel-side health.
    pub fn read(
        &mut self,
        services: &[u32],
        pools: &[u32],
        waits: PoolWaits,
    ) -> Result<Readout, KernelError> {
        let map_error = |map| move |source| KernelError::Map { map, source };
        let mut readout = Readout {
            watched: self
                .watched_pids()
                .into_iter()
                .map(|(pid, watch)| (pid, watch.since_ns))
                .collect(),
            ..Readout::default()
        };
        readout.services = self.read_services(services)?;
        readout.request_times = self.read_request_times(&readout.services);
        let syscall_services = if self.backend == Backend::Syscall {
            services
        } else {
            &[]
        };
        for &service in syscall_services {
            for slot in SyscallSlot::ALL {
                let calls: u64 = self
                    .syscall_counts
                    .get(&syscall_counter_index(service, slot), 0)
                    .map_err(map_error(maps::SYSCALL_COUNTS))?
                    .iter()
                    .sum();
                readout.syscalls.insert((service, slot.name()), calls);
            }
        }
        self.read_pools(pools, waits, &mut readout)?;
        readout.losses = self.losses()?;
        for cpu in self
            .offcpu_captures
            .get(&0, 0)
            .map_err(map_error(maps::OFFCPU_CAPTURES))?
            .iter()
        {
            readout.offcpu_captures.full += cpu.full;
            readout.offcpu_captures.sampled += cpu.sampled;
            readout.offcpu_captures.skipped += cpu.skipped;
        }
        let fill = |name: &'static str, entries: u64| MapFill {
            name,
            entries,
            capacity: self.capacity(name),
        };
        let counted = self.counted_entries()?;
        let count = |map: CountedMap| fill(map.name(), counted[map as usize]);
        readout.maps = vec![
            fill(maps::WATCHED, readout.watched.len() as u64),
            count(match self.backend {
                Backend::Syscall => CountedMap::Conns,
                Backend::Socket | Backend::Tcp => CountedMap::SockConns,
            }),
            count(CountedMap::PendingCalls),
            fill(
                maps::THREAD_ENTRIES,
                (readout.threads.len() as u64).saturating_sub(self.threads_overflow),
            ),
            fill(maps::THREADS, self.threads_overflow),
            count(CountedMap::Locks),
            fill(maps::DOWNSTREAM_WAITS, readout.downstreams.len() as u64),
            count(CountedMap::StackCounts),
            count(CountedMap::MutexCalls),
            fill(
                maps::PROFILE_SESSIONS,
                self.profile_sessions
                    .iter()
                    .filter(|session| session.as_ref().is_ok_and(|s| s.active != 0))
                    .count() as u64,
            ),
            count(CountedMap::ListenPorts),
            count(CountedMap::Adopt),
        ];
        for (name, program) in self.ebpf.programs() {
            if let Ok(info) = program.info() {
                readout.programs.push(ProgramStats {
                    name: name.to_owned(),
                    run_time: info.run_time(),
                    runs: info.run_count(),
                });
            }
        }
        Ok(readout)
    }
}
