//! The opt-in `pthread_mutex_lock` probes (`probes.lock_uprobes`): attached to each
//! newly watched process of a service that asks for them, in the libc it maps, and
//! detached when the process is no longer watched.
use std::{
    collections::{HashMap, HashSet},
    path::Path,
};

use aya::programs::uprobe::UProbeLinkId;

use crate::{discovery::procfs, kernel::Kernel};

/// Which services get the `pthread_mutex_lock` probes (`probes.lock_uprobes`).
#[derive(Debug, Default)]
pub struct LockProbes {
    /// Service names; `*` stands for every service.
    services: HashSet<String>,
    attached: HashMap<u32, Vec<UProbeLinkId>>,
    /// Processes whose probes could not be attached (no libc, or the kernel refused).
    pub errors: u64,
}

impl LockProbes {
    pub fn new(services: &[String]) -> Self {
        Self {
            services: services.iter().cloned().collect(),
            ..Self::default()
        }
    }

    /// A reload's list; it applies to processes watched from now on.
    pub fn set_services(&mut self, services: &[String]) {
        self.services = services.iter().cloned().collect();
    }

    fn wants(&self, service: &str) -> bool {
        self.services.contains("*") || self.services.contains(service)
    }

    /// Attaches the probes to a newly watched process of `service`, if it wants them.
    pub fn follow(&mut self, kernel: &mut Kernel, procfs_root: &Path, pid: u32, service: &str) {
        if !self.wants(service) || self.attached.contains_key(&pid) {
            return;
        }
        let Some(libc) = procfs::libc_path(procfs_root, pid) else {
            self.errors += 1;
            tracing::warn!(
                pid,
                service,
                "no libc mapped (static binary?): no pthread_mutex probes"
            );
            return;
        };
        match kernel.attach_mutex_probes(pid, &libc) {
            Ok(links) => {
                self.attached.insert(pid, links);
            }
            Err(error) => {
                self.errors += 1;
                tracing::warn!(pid, service, %error, "cannot attach the pthread_mutex probes");
            }
        }
    }

    /// Detaches the probes of a process no longer watched.
    pub fn forget(&mut self, kernel: &mut Kernel, pid: u32) {
        if let Some(links) = self.attached.remove(&pid) {
            kernel.detach_mutex_probes(links);
        }
    }

    /// Processes with the probes attached.
    pub fn processes(&self) -> usize {
        self.attached.len()
    }
}
