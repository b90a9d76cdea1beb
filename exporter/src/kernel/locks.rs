//! The lock maps: the `pthread_mutex_lock` uprobes attached per process, and
//! `LOCKS` / `LOCK_STACKS` (futex waits per process, address and stack).
use std::{num::NonZeroU32, path::Path};

use aya::programs::{
    UProbe,
    uprobe::{UProbeLinkId, UProbeScope},
};
use poolscope_shared::{Histogram, LockKey, maps::CountedMap};

use super::{
    Kernel, KernelError,
    attach::{MUTEX_PROBES, MUTEX_SYMBOL, typed_program},
    stacks::addresses,
};

impl Kernel {
    /// Attaches the `pthread_mutex_lock` probes to process `pid`, in the libc that
    /// process maps (a path inside its mount namespace, reached through its root).
    pub fn attach_mutex_probes(
        &mut self,
        pid: u32,
        libc: &Path,
    ) -> Result<Vec<UProbeLinkId>, KernelError> {
        let scope = NonZeroU32::new(pid).map_or(UProbeScope::AllProcesses, UProbeScope::OneProcess);
        let target = Path::new("/proc")
            .join(pid.to_string())
            .join("root")
            .join(libc.strip_prefix("/").unwrap_or(libc));
        let mut links = Vec::new();
        for (program, probe) in MUTEX_PROBES {
            let attached = typed_program::<UProbe>(&mut self.ebpf, program).and_then(|uprobe| {
                uprobe
                    .attach(MUTEX_SYMBOL, &target, scope)
                    .map_err(|source| KernelError::Attach {
                        program,
                        probe: format!("{probe} in {}", target.display()),
                        source,
                    })
            });
            match attached {
                Ok(link) => links.push(link),
                Err(error) => {
                    self.detach_mutex_probes(links);
                    return Err(error);
                }
            }
        }
        Ok(links)
    }

    /// Detaches what [`Kernel::attach_mutex_probes`] attached.
    pub fn detach_mutex_probes(&mut self, links: Vec<UProbeLinkId>) {
        for ((program, _), link) in MUTEX_PROBES.iter().zip(links) {
            let uprobe: Option<&mut UProbe> = self
                .ebpf
                .program_mut(program)
                .and_then(|program| program.try_into().ok());
            if let Some(uprobe) = uprobe
                && let Err(error) = uprobe.detach(link)
            {
                tracing::warn!(%error, program, "detaching a lock probe failed");
            }
        }
    }
    /// Every entry of `LOCKS`: the futex waits per (process, address, stack).
    pub fn locks(&self) -> Vec<(LockKey, Histogram)> {
        self.locks.iter().filter_map(Result::ok).collect()
    }

    /// The user stack (return addresses, innermost first) of a `LOCKS` key.
    pub fn lock_stack(&self, id: i32) -> Option<Vec<u64>> {
        addresses(&self.lock_stacks, id)
    }

    /// Removes the lock entries of a process no longer watched. Its stacks stay in
    /// `LOCK_STACKS` (shared by identical stacks; that map is a cache that evicts
    /// nothing, and a full bucket is counted).
    pub fn forget_locks(&mut self, pid: u32) {
        let keys: Vec<LockKey> = self
            .locks
            .keys()
            .filter_map(Result::ok)
            .filter(|key| key.tgid == pid)
            .collect();
        // One gone already (the map cleared meanwhile) was counted by its remover.
        let removed = keys
            .iter()
            .filter(|key| self.locks.remove(key).is_ok())
            .count();
        self.count_own_entries(CountedMap::Locks, -(removed as i64));
    }
}
