//! One drained generation of stacks as read from the kernel, before symbolization
//! (`Drained`), and the names of pools and processes seen in the last few drains
//! that complete it (`RecentNames`).
use std::{collections::HashMap, path::Path};

use poolscope_shared::{StackCount, StackKey};

use crate::discovery::procfs::{self, Mapping};

/// One generation read from the kernel, with the names it needs, before
/// symbolization (which happens outside the exporter's lock).
#[derive(Debug, Default)]
pub struct Drained {
    /// The generation drained.
    pub generation: u32,
    pub counts: Vec<(StackKey, StackCount)>,
    /// Stack id → addresses, innermost first.
    pub stacks: HashMap<i32, Vec<u64>>,
    /// (user stack id, caller path other than 0) → addresses, innermost first: the
    /// paths behind one frame-pointer stack that the kernel told apart.
    pub caller_paths: HashMap<(i32, u32), Vec<u64>>,
    /// Pool id → (service, pool) names.
    pub pools: HashMap<u32, (String, String)>,
    /// tgid → service name, for threads without a pool.
    pub processes: HashMap<u32, String>,
    /// tgid → its mappings as last read, to symbolize a process that has exited.
    pub mappings: HashMap<u32, Vec<Mapping>>,
}

impl Drained {
    /// The user stack of `key`: its caller path's own (never another path's).
    pub(crate) fn user_stack(&self, key: &StackKey) -> Option<&Vec<u64>> {
        if key.variant == 0 {
            self.stacks.get(&key.user_stack)
        } else {
            self.caller_paths.get(&(key.user_stack, key.variant))
        }
    }
}

/// The names of pools and processes seen in the last few drains. A drained
/// generation holds stacks up to two epochs old, whose process may have exited (and
/// its pool been forgotten) since; a name seen in the current drain wins.
#[derive(Debug, Default)]
pub struct RecentNames {
    pools: HashMap<u32, ((String, String), u64)>,
    processes: HashMap<u32, (String, u64)>,
    mappings: HashMap<u32, (Vec<Mapping>, u64)>,
    drains: u64,
}

impl RecentNames {
    /// Drains a name is kept after it was last seen: a snapshot drains twice, and a
    /// generation is drained two epochs after it was filled.
    pub(crate) const KEPT_DRAINS: u64 = 4;

    /// Remembers the names `drained` carries (and the mappings of its live
    /// processes, read under `procfs_root`) and adds those it lacks from recent
    /// drains.
    pub fn complete(&mut self, drained: &mut Drained, procfs_root: &Path) {
        self.drains += 1;
        let drains = self.drains;
        for (id, names) in &drained.pools {
            self.pools.insert(*id, (names.clone(), drains));
        }
        for (pid, service) in &drained.processes {
            self.processes.insert(*pid, (service.clone(), drains));
            let mappings = procfs::maps(procfs_root, *pid);
            if !mappings.is_empty() {
                self.mappings.insert(*pid, (mappings, drains));
            }
        }
        self.pools
            .retain(|_, (_, seen)| drains - *seen < Self::KEPT_DRAINS);
        self.processes
            .retain(|_, (_, seen)| drains - *seen < Self::KEPT_DRAINS);
        self.mappings
            .retain(|_, (_, seen)| drains - *seen < Self::KEPT_DRAINS);
        drained.mappings = self
            .mappings
            .iter()
            .map(|(pid, (mappings, _))| (*pid, mappings.clone()))
            .collect();
        for (id, (names, _)) in &self.pools {
            drained.pools.entry(*id).or_insert_with(|| names.clone());
        }
        for (pid, (service, _)) in &self.processes {
            drained
                .processes
                .entry(*pid)
                .or_insert_with(|| service.clone());
        }
    }
}
