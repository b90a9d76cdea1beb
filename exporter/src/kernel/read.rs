//! The read for a scrape: every counter of the watched services and pools, the loss
//! counters, how full each map is and the programs' own run time.
use std::{collections::BTreeMap, sync::Arc, time::Duration};

use poolscope_shared::{
    DownstreamKey, DownstreamWait, Histogram, LockPrimitive, LossErrno, LossSource, OffcpuCaptures,
    PoolStats, RequestTimes, ServiceCounters, Thread,
    maps::{self, CountedMap},
};

use super::RoutesRead;
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
    /// Each service's routes, by label.
    pub routes: BTreeMap<u32, RoutesRead>,
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
        self.health.losses(self.cpus)
    }

    /// The connection and request counters of `services`, summed over CPUs.
    pub fn read_services(
        &self,
        services: &[u32],
    ) -> Result<BTreeMap<u32, ServiceCounters>, KernelError> {
        self.requests.read_counters(services, self.cpus)
    }

    /// Reads the counters of `services` and `pools` and the exporter's own
    /// kernel-side health.
    pub fn read(
        &mut self,
        services: &[u32],
        pools: &[u32],
        waits: PoolWaits,
    ) -> Result<Readout, KernelError> {
        let mut readout = Readout {
            watched: self
                .watched_pids()
                .into_iter()
                .map(|(pid, watch)| (pid, watch.since_ns))
                .collect(),
            ..Readout::default()
        };
        readout.services = self.read_services(services)?;
        readout.request_times = self.requests.read_request_times(&readout.services);
        readout.routes = self.routes.read(services.iter().copied());
        if self.backend == Backend::Syscall {
            readout.syscalls = self.requests.read_syscalls(services)?;
        }
        self.read_pools(pools, waits, &mut readout)?;
        readout.losses = self.losses()?;
        readout.offcpu_captures = self.stacks.offcpu_captures()?;
        let fill = |name: &'static str, entries: u64| MapFill {
            name,
            entries,
            capacity: self.capacity(name),
        };
        let counted = self.health.counted_entries(self.cpus)?;
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
                (readout.threads.len() as u64).saturating_sub(self.pools.threads_overflow()),
            ),
            fill(maps::THREADS, self.pools.threads_overflow()),
            count(CountedMap::Locks),
            fill(maps::DOWNSTREAM_WAITS, readout.downstreams.len() as u64),
            count(CountedMap::StackCounts),
            count(CountedMap::MutexCalls),
            fill(maps::PROFILE_SESSIONS, self.stacks.active_sessions()),
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
