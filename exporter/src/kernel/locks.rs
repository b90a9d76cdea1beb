//! The locks part of [`Kernel`] ([`Locks`]): `LOCKS` / `LOCK_STACKS` (futex waits
//! per process, address and stack), and the `pthread_mutex_lock` uprobes attached
//! per process.
use std::{num::NonZeroU32, path::Path};

use aya::{
    Ebpf,
    maps::{HashMap, MapData, stack_trace::StackTraceMap},
    programs::{
        UProbe,
        uprobe::{UProbeLinkId, UProbeScope},
    },
};
use poolscope_shared::{
    Histogram, LockKey,
    maps::{self, CountedMap},
};

use super::{
    Kernel, KernelError, MapSizes,
    attach::{MUTEX_PROBES, MUTEX_SYMBOL, typed_program},
    stacks::addresses,
    take,
};
use crate::config::Limits;

/// The futex waits of the watched processes and the stacks they waited at.
pub(super) struct Locks {
    /// `LOCKS`: (process, address, stack) → wait histogram.
    waits: HashMap<MapData, LockKey, Histogram>,
    /// `LOCK_STACKS`: the user stacks of `waits`' keys.
    stacks: StackTraceMap<MapData>,
}

impl Locks {
    /// The sizes `limits` gives these maps (and `MUTEX_CALLS`, the kernel's own).
    pub fn sizes(limits: &Limits) -> MapSizes {
        vec![
            (maps::LOCKS, limits.locks),
            (maps::LOCK_STACKS, limits.lock_stacks),
            (maps::MUTEX_CALLS, limits.mutex_calls_in_flight),
        ]
    }

    /// Takes `LOCKS` and `LOCK_STACKS` out of `ebpf`.
    pub fn take(ebpf: &mut Ebpf) -> Result<Self, KernelError> {
        Ok(Self {
            waits: take(ebpf, maps::LOCKS)?,
            stacks: take(ebpf, maps::LOCK_STACKS)?,
        })
    }
}

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
        self.locks.waits.iter().filter_map(Result::ok).collect()
    }

    /// The user stack (return addresses, innermost first) of a `LOCKS` key.
    pub fn lock_stack(&self, id: i32) -> Option<Vec<u64>> {
        addresses(&self.locks.stacks, None, id)
    }

    /// Removes the lock entries of a process no longer watched. Its stacks stay in
    /// `LOCK_STACKS` (shared by identical stacks; that map is a cache that evicts
    /// nothing, and a full bucket is counted).
    pub fn forget_locks(&mut self, pid: u32) {
        let keys: Vec<LockKey> = self
            .locks
            .waits
            .keys()
            .filter_map(Result::ok)
            .filter(|key| key.tgid == pid)
            .collect();
        // One gone already (the map cleared meanwhile) was counted by its remover.
        let removed = keys
            .iter()
            .filter(|key| self.locks.waits.remove(key).is_ok())
            .count();
        self.health
            .count_own_entries(CountedMap::Locks, -(removed as i64));
    }
}
