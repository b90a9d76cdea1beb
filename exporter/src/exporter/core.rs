//! The state a rescan, a process event and a scrape all touch, behind the exporter's
//! one core lock: the kernel, the watched set, the thread pools and their window, the services'
//! finished requests over the pools' window, the quantile windows, the lock probes and the gauges'
//! recount. They change together (a watch change follows into the pools
//! and lock probes at once), so they share the lock.
use std::{collections::HashMap, path::Path};

use poolscope_shared::{LossErrno, LossSource};

use crate::{
    discovery::lock_probes::LockProbes,
    discovery::pools::Pools,
    discovery::targets::{Targets, WatchChange},
    kernel::{Kernel, Probe, WatchTable},
    metrics::capacity::Throughput,
    metrics::health::{self, Loss, LossInputs},
    metrics::pools::PoolWindows,
    metrics::recount::Recount,
    metrics::window::Windows,
    stacks::snapshots::Drained,
    stacks::symbolize::Unnamed,
};

pub(super) struct Core {
    pub kernel: Kernel,
    pub targets: Targets,
    pub pools: Pools,
    /// The pools' totals over their window, for utilization and capacity.
    pub pool_windows: PoolWindows,
    /// The services' finished requests over the pools' window, for capacity.
    pub throughput: Throughput,
    pub windows: Windows,
    pub lock_probes: LockProbes,
    pub recount: Recount,
}

impl Core {
    /// Every loss counter now; `kernel` is the kernel side's (read by the caller).
    pub fn losses(
        &self,
        kernel: &[(LossSource, LossErrno, u64)],
        series_dropped: u64,
        unsymbolized: Unnamed,
        probes: &[Probe],
    ) -> Vec<Loss> {
        health::losses(&LossInputs {
            kernel,
            map_errors: [Some(&self.targets.map_errors), Some(&self.pools.map_errors)],
            series_dropped,
            services_refused: self.targets.services_refused,
            processes_unreadable: self.targets.processes_unreadable.len() as u64,
            pools_refused: self.pools.pools_refused,
            lock_uprobe_errors: self.lock_probes.errors,
            unsymbolized,
            probes,
        })
    }

    /// Brings the thread pools and lock probes in step with the watched set.
    pub fn follow_watch_changes(&mut self, procfs_root: &Path) {
        for change in self.targets.take_changes() {
            match change {
                WatchChange::Watched { pid, service } => {
                    self.pools.follow_process(&mut self.kernel, pid, service);
                    if let Some(name) = self.targets.service_name(service) {
                        self.lock_probes
                            .follow(&mut self.kernel, procfs_root, pid, name);
                    }
                }
                WatchChange::Forgotten { pid } => {
                    self.pools.forget_process(&mut self.kernel, pid);
                    self.lock_probes.forget(&mut self.kernel, pid);
                    self.kernel.forget_locks(pid);
                }
            }
        }
    }

    /// Starts a new stack epoch and reads (then clears) the generation no program
    /// can add to any more, with the names of its pools and processes.
    pub fn drain_generation(&mut self) -> Drained {
        let generation = match self.kernel.advance_stack_epoch() {
            Ok(generation) => generation,
            Err(error) => {
                tracing::warn!(%error, "cannot advance the stack epoch");
                return Drained::default();
            }
        };
        let counts = self.kernel.stack_counts(generation);
        let mut stacks = HashMap::new();
        for (key, _) in &counts {
            for id in [key.user_stack, key.kernel_stack] {
                if id >= 0
                    && !stacks.contains_key(&id)
                    && let Some(frames) = self.kernel.stack(generation, id)
                {
                    stacks.insert(id, frames);
                }
            }
        }
        let keys: Vec<_> = counts.iter().map(|(key, _)| *key).collect();
        self.kernel.clear_stacks(generation, &keys);
        // A pool or process whose service is gone already (its process exited since
        // the last sample) is left out rather than named "": `RecentNames` then gives
        // the name it had, as for a pool forgotten already. (Named "", the blocks of
        // its last seconds went to no service: one snapshot's worth, in CI.)
        let service_name = |id: u32| self.targets.service_name(id).map(str::to_owned);
        let pools = self
            .pools
            .views()
            .into_iter()
            .filter_map(|view| Some((view.id, (service_name(view.service)?, view.name))))
            .collect();
        let processes = self
            .kernel
            .watched_pids()
            .into_iter()
            .filter_map(|(pid, watch)| Some((pid, service_name(watch.service)?)))
            .collect();
        // Mappings are read by `RecentNames::complete`, outside the lock.
        Drained {
            generation,
            counts,
            stacks,
            pools,
            processes,
            mappings: HashMap::new(),
            caller_paths: HashMap::new(),
        }
    }
}
