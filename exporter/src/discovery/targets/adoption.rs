//! Adoption: the connections a newly watched process already holds on its listening
//! ports, handed to the kernel's `ADOPT` map for the socket backend to follow, and
//! dropped once the kernel took them or their socket closed.
use std::collections::{HashMap, HashSet};

use poolscope_shared::maps;

use super::{NewWatch, Targets};
use crate::{
    clock::monotonic_ns,
    discovery::procfs::{self, NetTables},
    kernel::{Backend, WatchTable},
};

impl Targets {
    /// Follows the connections a newly watched process already holds on its own
    /// listening ports (open before poolscope, or before a reload watched it).
    pub(super) fn adopt(
        &mut self,
        kernel: &mut dyn WatchTable,
        new: NewWatch,
        tables: &mut NetTables,
    ) {
        let NewWatch {
            pid,
            service,
            since_ns,
        } = new;
        let connections = match procfs::served_connections_of(&self.procfs_root, pid, tables) {
            Ok(connections) => connections,
            // Gone, or its fds unreadable (counted in processes_unreadable).
            Err(_) => return,
        };
        let map = match kernel.backend() {
            Backend::Syscall => maps::CONNS,
            Backend::Socket | Backend::Tcp => maps::ADOPT,
        };
        match kernel.adopt_connections(service, since_ns, pid, &connections, monotonic_ns()) {
            Ok(adopted) => {
                self.corrections
                    .entry(service)
                    .or_default()
                    .adopted_unserved += adopted.unserved;
                for inode in adopted.pending {
                    self.adoptions.insert(inode, (pid, service));
                }
                if let Some(first) = adopted.failed.first() {
                    tracing::warn!(
                        pid,
                        error = %first,
                        "{} connection(s) opened before the watch are not followed ({map} \
                         is full or refused them)",
                        adopted.failed.len()
                    );
                }
                for error in &adopted.failed {
                    self.map_errors.count(map, error);
                }
            }
            Err(error) => {
                self.map_errors.count(map, &error);
                tracing::warn!(pid, %error, "cannot follow connections opened before the watch");
            }
        }
    }

    /// Drops the adoptions the kernel has taken, and those whose socket closed (or
    /// whose process is gone) before any event: these leave their gauge here.
    pub(super) fn prune_adoptions(&mut self, kernel: &mut dyn WatchTable) {
        if self.adoptions.is_empty() {
            return;
        }
        let mut open: HashMap<u32, Option<HashSet<u64>>> = HashMap::new();
        let adoptions: Vec<(u64, (u32, u32))> =
            self.adoptions.iter().map(|(&i, &v)| (i, v)).collect();
        for (inode, (pid, service)) in adoptions {
            let still_open = self.processes.contains_key(&pid)
                && open
                    .entry(pid)
                    .or_insert_with(|| {
                        procfs::socket_fds(&self.procfs_root, pid)
                            .ok()
                            .map(|fds| fds.into_values().collect())
                    })
                    .as_ref()
                    .is_some_and(|inodes| inodes.contains(&inode));
            if still_open && kernel.awaits_adoption(inode) {
                continue;
            }
            self.adoptions.remove(&inode);
            if !still_open && let Some(phase) = kernel.forget_adoption(inode) {
                self.left_without_event(service, phase);
            }
        }
        if self.adoptions.is_empty()
            && let Err(error) = kernel.set_adopting(false)
        {
            tracing::warn!(%error, "cannot update ADOPTING");
        }
    }
}
