//! The watched set: which process (pid and start time) is watched for which service,
//! kept in step with the kernel's `WATCHED` map, and the dense service ids the kernel
//! counts by. Updated by rescans (whole snapshot) and by process events (one fork or
//! exit at a time). A process is named by (pid, start time) so that a reused pid is a
//! new process: the kernel drops an exited process at once, and user space checks the
//! start time again after every insert.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    path::PathBuf,
};

use poolscope_shared::{Phase, ProcessEvent, ProcessEventKind, StreamWorkers, Watched, maps};

use crate::{
    clock::monotonic_ns,
    config::ServiceOptions,
    discovery::held::HeldListener,
    discovery::ids::DenseIds,
    discovery::live::PerGauge,
    discovery::procfs::{self, NetTables, ProcSnapshot},
    discovery::rules::{Assignment, Workload},
    kernel::{MapErrors, WatchTable},
};

mod adoption;
mod listeners;

/// One watched process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Tracked {
    start_time: u64,
    service: u32,
    since_ns: u64,
}

/// A live service as the scrape sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceView {
    pub id: u32,
    pub name: String,
    pub processes: u64,
    /// Whether it hands each HTTP/2 stream to a worker thread, as its rule says
    /// (`[[targets]] http2_worker_threads`); `None`: detected.
    pub http2_worker_threads: Option<bool>,
    /// The Kubernetes pod container it is named after, if any.
    pub workload: Option<Workload>,
    /// What user space moved in or out of the gauges without a kernel event.
    pub corrections: Corrections,
}

/// The gauges' moves that user space made, not the kernel: connections it removed
/// from the kernel's maps (their process exited without closing them, syscall
/// backend; or they closed before the socket backend adopted them), by the gauge
/// they left, connections it adopted with a request unread, and the offsets of the
/// last recount (`metrics/recount.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Corrections {
    pub unserved: u64,
    pub waiting: u64,
    pub serving: u64,
    pub adopted_unserved: u64,
    /// How far the counters were from the live entries when last recounted.
    pub recounted: PerGauge<i64>,
}

/// A process just watched, whose connections are yet to adopt.
#[derive(Clone, Copy, Debug)]
struct NewWatch {
    pid: u32,
    service: u32,
    since_ns: u64,
}

/// A change of the watched set that the thread pools follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WatchChange {
    /// User space started watching `pid` (its existing threads need following).
    Watched { pid: u32, service: u32 },
    /// User space stopped watching `pid`, which may still run.
    Forgotten { pid: u32 },
}

#[derive(Debug)]
pub struct Targets {
    /// Service names ↔ dense ids.
    ids: DenseIds<String>,
    changes: Vec<WatchChange>,
    processes: HashMap<u32, Tracked>,
    corrections: HashMap<u32, Corrections>,
    /// Services whose rule says whether they hand HTTP/2 streams to worker threads,
    /// as the kernel's `STREAM_WORKERS` has it (the others are detected).
    stream_workers: HashMap<u32, bool>,
    /// The pod container each service named after one is named after.
    workloads: HashMap<u32, Workload>,
    /// Connections in the kernel's `ADOPT` map: socket inode → (pid, service).
    adoptions: HashMap<u64, (u32, u32)>,
    /// Listening socket inode → service name, from the last scan.
    listeners: HashMap<u64, String>,
    /// Every listening socket the last scan saw, watched or not.
    known_listen_sockets: HashSet<u64>,
    /// The network namespaces of watched listeners (from the last scan).
    listener_namespaces: BTreeMap<u32, NamespaceListeners>,
    /// Each service's listeners' network namespaces (`None`: one unknown).
    service_namespaces: BTreeMap<u32, BTreeSet<Option<u32>>>,
    procfs_root: PathBuf,
    /// Processes the last scan left unwatched because `limits.max_services` was reached.
    pub services_refused: u64,
    /// Processes whose open files the last scan was not allowed to follow.
    pub processes_unreadable: BTreeSet<u32>,
    /// Failed inserts into `WATCHED` and updates of `LISTEN_PORTS`.
    pub map_errors: MapErrors,
}

/// The watched listeners of one network namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceListeners {
    /// A process inside it, to read its `net/tcp` tables through.
    pub pid: u32,
    /// Each listener, where it is held.
    pub held: Vec<HeldListener>,
}

impl Targets {
    pub fn new(procfs_root: PathBuf, max_services: u32) -> Self {
        Self {
            ids: DenseIds::new(max_services),
            changes: Vec::new(),
            processes: HashMap::new(),
            corrections: HashMap::new(),
            stream_workers: HashMap::new(),
            workloads: HashMap::new(),
            adoptions: HashMap::new(),
            listeners: HashMap::new(),
            known_listen_sockets: HashSet::new(),
            listener_namespaces: BTreeMap::new(),
            service_namespaces: BTreeMap::new(),
            procfs_root,
            services_refused: 0,
            processes_unreadable: BTreeSet::new(),
            map_errors: MapErrors::default(),
        }
    }

    /// Makes the watched set equal to `assignments` (one full scan, begun at
    /// `scan_started_ns`), in user space and in the kernel.
    pub fn apply(
        &mut self,
        kernel: &mut dyn WatchTable,
        snapshot: &ProcSnapshot,
        assignments: &[Assignment],
        scan_started_ns: u64,
    ) {
        let service_of: HashMap<u32, &str> = assignments
            .iter()
            .map(|a| (a.pid, a.service.as_str()))
            .collect();
        self.listeners.clear();
        for process in &snapshot.processes {
            if let Some(service) = service_of.get(&process.pid) {
                for inode in &process.listeners {
                    self.listeners
                        .entry(*inode)
                        .or_insert_with(|| (*service).to_owned());
                }
            }
        }
        self.known_listen_sockets = snapshot.listen_sockets.keys().copied().collect();
        self.services_refused = 0;
        self.note_unreadable(snapshot);
        let desired: HashMap<u32, &Assignment> = assignments.iter().map(|a| (a.pid, a)).collect();
        // Processes watched since the scan began (forks) are not in it: leave them.
        let gone: Vec<u32> = self
            .processes
            .iter()
            .filter(|(_, tracked)| tracked.since_ns < scan_started_ns)
            .filter(|(pid, tracked)| {
                desired.get(pid).is_none_or(|a| {
                    a.start_time != tracked.start_time
                        || self.ids.key(tracked.service).map(String::as_str)
                            != Some(a.service.as_str())
                })
            })
            .map(|(pid, _)| *pid)
            .collect();
        for pid in gone {
            self.forget(kernel, pid);
        }
        // Every watch first, then the connections they held: one read of each
        // namespace's table, made after the watches, so that no connection is
        // accepted between the read and its process's watch unseen by both.
        let watched: Vec<NewWatch> = assignments
            .iter()
            .filter_map(|assignment| self.watch(kernel, assignment))
            .collect();
        let mut tables = NetTables::default();
        for new in watched {
            self.adopt(kernel, new, &mut tables);
        }
        // Kernel entries that the scan should have seen but did not assign: a fork
        // child outside its parent's cgroup, or a fork whose event was lost.
        let in_kernel = kernel.watched_pids();
        for (pid, watch) in &in_kernel {
            if !self.processes.contains_key(pid) && watch.since_ns < scan_started_ns {
                kernel.unwatch(*pid, watch.since_ns);
                self.purge(kernel, *pid, watch.since_ns);
            }
        }
        // A stray just unwatched keeps its id busy until the next scan: harmless.
        // Listeners first: no handshake claims a connection for an id being freed.
        self.sync_listen_ports(kernel, snapshot);
        self.prune_adoptions(kernel);
        self.free_idle_services(kernel, &in_kernel);
    }

    /// Keeps the processes whose open files the scan could not follow, and logs
    /// those that were not in the last scan's (once, not at every scan).
    fn note_unreadable(&mut self, snapshot: &ProcSnapshot) {
        let unreadable: BTreeSet<u32> = snapshot.processes_unreadable.iter().copied().collect();
        let new: Vec<String> = snapshot
            .processes
            .iter()
            .filter(|p| unreadable.contains(&p.pid) && !self.processes_unreadable.contains(&p.pid))
            .map(|p| format!("{} ({})", p.pid, p.comm))
            .collect();
        if !new.is_empty() {
            const SHOWN: usize = 5;
            let more = new.len().saturating_sub(SHOWN);
            tracing::warn!(
                "cannot follow the open files of {} more process(es): {}{}; their listening \
                 sockets are unknown, so discovery and port targets cannot find them. \
                 poolscope needs CAP_SYS_PTRACE to follow processes of other users or with \
                 capabilities it lacks (a security module may also deny it); counted in \
                 poolscope_processes_unreadable",
                new.len(),
                new[..new.len().min(SHOWN)].join(", "),
                if more > 0 {
                    format!(" and {more} more")
                } else {
                    String::new()
                },
            );
        }
        self.processes_unreadable = unreadable;
    }

    /// Watches one assigned process (no-op if it is watched already).
    pub fn add(&mut self, kernel: &mut dyn WatchTable, assignment: &Assignment) {
        if let Some(new) = self.watch(kernel, assignment) {
            self.adopt(kernel, new, &mut NetTables::default());
        }
    }

    /// Watches one assigned process, not yet its connections; `None` if it was
    /// watched already or cannot be.
    fn watch(&mut self, kernel: &mut dyn WatchTable, assignment: &Assignment) -> Option<NewWatch> {
        if let Some(tracked) = self.processes.get(&assignment.pid) {
            // A reload may have changed its rule's key.
            let service = tracked.service;
            if self.ids.get(&assignment.service) == Some(service) {
                self.apply_options(kernel, service, &assignment.options);
                self.name_workload(service, assignment.workload.as_ref());
            }
            return None;
        }
        let Some((service, _)) = self.ids.get_or_allocate(&assignment.service) else {
            self.services_refused += 1;
            // At every scan: the health check logs the onset.
            tracing::debug!(service = %assignment.service, "limits.max_services reached; not watched");
            return None;
        };
        self.apply_options(kernel, service, &assignment.options);
        self.name_workload(service, assignment.workload.as_ref());
        let pid = assignment.pid;
        // A fork may have put it there already: keep that entry and its `since`.
        let since_ns = match kernel.watched(pid) {
            Some(watch) if watch.service == service => watch.since_ns,
            _ => {
                let since_ns = monotonic_ns();
                let watch = Watched {
                    service,
                    _pad: 0,
                    since_ns,
                };
                if let Err(error) = kernel.watch(pid, watch) {
                    self.map_errors.count(maps::WATCHED, &error);
                    tracing::warn!(pid, %error, "cannot watch process");
                    return None;
                }
                since_ns
            }
        };
        // The pid may have been reused between the scan and the insert.
        if procfs::start_time(&self.procfs_root, pid) != Some(assignment.start_time) {
            kernel.unwatch(pid, since_ns);
            self.purge(kernel, pid, since_ns);
            return None;
        }
        kernel.adopt_blocked_accepts(&procfs::blocked_syscalls(&self.procfs_root, pid));
        self.changes.push(WatchChange::Watched { pid, service });
        self.processes.insert(
            pid,
            Tracked {
                start_time: assignment.start_time,
                service,
                since_ns,
            },
        );
        Some(NewWatch {
            pid,
            service,
            since_ns,
        })
    }

    fn forget(&mut self, kernel: &mut dyn WatchTable, pid: u32) {
        if let Some(tracked) = self.processes.remove(&pid) {
            kernel.unwatch(pid, tracked.since_ns);
            self.purge(kernel, pid, tracked.since_ns);
            self.changes.push(WatchChange::Forgotten { pid });
        }
    }

    /// The changes since the last call, oldest first.
    pub fn take_changes(&mut self) -> Vec<WatchChange> {
        std::mem::take(&mut self.changes)
    }

    fn purge(&mut self, kernel: &mut dyn WatchTable, pid: u32, since_ns: u64) {
        for (service, phase) in kernel.purge_connections(pid, since_ns) {
            self.left_without_event(service, phase);
        }
    }

    /// Counts a connection that user space took out of its gauge.
    fn left_without_event(&mut self, service: u32, phase: Phase) {
        let corrections = self.corrections.entry(service).or_default();
        match phase {
            Phase::Unserved => corrections.unserved += 1,
            Phase::Waiting => corrections.waiting += 1,
            Phase::Serving => corrections.serving += 1,
            Phase::Responded | Phase::Multiplexed | Phase::Closing | Phase::Gone => {}
        }
    }

    /// Tells the kernel how to read `service` (its rule's keys, which a reload may
    /// change).
    fn apply_options(
        &mut self,
        kernel: &mut dyn WatchTable,
        service: u32,
        options: &ServiceOptions,
    ) {
        self.flag_stream_workers(kernel, service, options.http2_worker_threads);
        if let Err(error) = kernel.name_routes(service, &options.routes) {
            self.map_errors.count(maps::ROUTE_SERVICES, &error);
            tracing::warn!(service, %error, "cannot turn a service's route reading on or off");
        }
    }

    /// Keeps the pod container `service` is named after (a name is made of it, so
    /// one name has one; a reload may name it by a rule instead).
    fn name_workload(&mut self, service: u32, workload: Option<&Workload>) {
        match workload {
            Some(workload) if self.workloads.get(&service) != Some(workload) => {
                self.workloads.insert(service, workload.clone());
            }
            Some(_) => {}
            None => {
                self.workloads.remove(&service);
            }
        }
    }

    /// Tells the kernel whether `service` hands HTTP/2 streams to worker threads
    /// (`None`: detect it), when that changed.
    fn flag_stream_workers(
        &mut self,
        kernel: &mut dyn WatchTable,
        service: u32,
        configured: Option<bool>,
    ) {
        if self.stream_workers.get(&service).copied() == configured {
            return;
        }
        let workers = match configured {
            None => StreamWorkers::Detect,
            Some(true) => StreamWorkers::Every,
            Some(false) => StreamWorkers::None,
        };
        match kernel.set_stream_workers(service, workers) {
            Ok(()) => match configured {
                Some(on) => {
                    self.stream_workers.insert(service, on);
                }
                None => {
                    self.stream_workers.remove(&service);
                }
            },
            Err(error) => {
                self.map_errors.count(maps::STREAM_WORKERS, &error);
                tracing::warn!(service, %error, "cannot flag a service's HTTP/2 worker threads");
            }
        }
    }

    /// Frees the ids of services with no process left, zeroing their kernel counters
    /// and dropping their connections.
    fn free_idle_services(&mut self, kernel: &mut dyn WatchTable, in_kernel: &[(u32, Watched)]) {
        // Kernel entries count too: a fork whose event we have not read yet still
        // counts under its parent's id, which must not pass to another service.
        let busy: HashSet<u32> = self
            .processes
            .values()
            .map(|t| t.service)
            .chain(in_kernel.iter().map(|(_, w)| w.service))
            .collect();
        let idle: Vec<u32> = self
            .service_ids()
            .into_iter()
            .filter(|id| !busy.contains(id))
            .collect();
        for id in idle {
            match kernel.reset_service(id) {
                Ok(()) => {
                    self.ids.free(id);
                    self.corrections.remove(&id);
                    self.stream_workers.remove(&id);
                    self.workloads.remove(&id);
                }
                Err(error) => tracing::warn!(id, %error, "cannot reset counters of a service"),
            }
        }
    }

    /// Applies one event from the kernel. Returns the pid of an unwatched process that
    /// exec'd: it may now match a rule.
    pub fn on_event(&mut self, kernel: &mut dyn WatchTable, event: &ProcessEvent) -> Option<u32> {
        match event.kind {
            k if k == ProcessEventKind::Fork as u32 => {
                if self.ids.key(event.service).is_none() {
                    kernel.unwatch(event.pid, event.since_ns);
                    return None;
                }
                match procfs::start_time(&self.procfs_root, event.pid) {
                    Some(start_time) => {
                        self.processes.insert(
                            event.pid,
                            Tracked {
                                start_time,
                                service: event.service,
                                since_ns: event.since_ns,
                            },
                        );
                        // Its threads are followed by the kernel already; what is
                        // per process (lock probes) needs attaching.
                        self.changes.push(WatchChange::Watched {
                            pid: event.pid,
                            service: event.service,
                        });
                    }
                    // Already gone: its exit event follows, or a rescan cleans up.
                    None => kernel.unwatch(event.pid, event.since_ns),
                }
                None
            }
            k if k == ProcessEventKind::Exit as u32 => {
                if self
                    .processes
                    .get(&event.pid)
                    .is_some_and(|t| t.since_ns == event.since_ns)
                {
                    self.processes.remove(&event.pid);
                    self.changes.push(WatchChange::Forgotten { pid: event.pid });
                }
                self.purge(kernel, event.pid, event.since_ns);
                None
            }
            k if k == ProcessEventKind::Exec as u32 => {
                (!self.processes.contains_key(&event.pid)).then_some(event.pid)
            }
            _ => None,
        }
    }

    /// The name of a service id in use.
    pub fn service_name(&self, id: u32) -> Option<&str> {
        self.ids.key(id).map(String::as_str)
    }

    /// The id of a service by name, if it has one now.
    pub fn service_id(&self, name: &str) -> Option<u32> {
        self.ids.get(&name.to_owned())
    }

    /// Ids of every service that has an id now (some may have no live process).
    /// The watched processes of each service.
    pub fn processes_by_service(&self) -> BTreeMap<u32, Vec<u32>> {
        let mut by_service: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for (&pid, tracked) in &self.processes {
            by_service.entry(tracked.service).or_default().push(pid);
        }
        by_service
    }

    pub fn service_ids(&self) -> Vec<u32> {
        self.ids.iter().map(|(id, _)| id).collect()
    }

    /// Live services with their process counts. `watched` is the kernel's `WATCHED`
    /// map (pid → since): the kernel drops a process the moment it exits, before its
    /// exit event reaches us, so a process counts only while its entry is there.
    pub fn services(&self, watched: &BTreeMap<u32, u64>) -> Vec<ServiceView> {
        let mut counts: HashMap<u32, u64> = HashMap::new();
        for (pid, tracked) in &self.processes {
            if watched.get(pid) == Some(&tracked.since_ns) {
                *counts.entry(tracked.service).or_default() += 1;
            }
        }
        let mut views: Vec<ServiceView> = counts
            .into_iter()
            .filter_map(|(id, processes)| {
                Some(ServiceView {
                    id,
                    name: self.ids.key(id)?.clone(),
                    processes,
                    http2_worker_threads: self.stream_workers.get(&id).copied(),
                    workload: self.workloads.get(&id).cloned(),
                    corrections: self.corrections_of(id),
                })
            })
            .collect();
        views.sort_by(|a, b| a.name.cmp(&b.name));
        views
    }

    /// Listening socket inode → owning service, from the last scan.
    pub fn listener_owners(&self) -> &HashMap<u64, String> {
        &self.listeners
    }

    /// The network namespaces of watched listeners, by inode number.
    pub fn listener_namespaces(&self) -> &BTreeMap<u32, NamespaceListeners> {
        &self.listener_namespaces
    }

    /// Whether the connection state that a recount reads holds every connection of
    /// `service`, as `watched` (the kernel's `WATCHED`: pid → since) stands: every
    /// process of it that user space follows is still watched there (one that exited
    /// has connections user space has yet to purge, syscall backend), none of its
    /// connections awaits adoption (they are in no socket's storage yet), and with the
    /// state in the sockets (`in_sockets`), which sock_diag reads in poolscope's
    /// network namespace (`own`), every listener is there.
    pub fn recountable(
        &self,
        service: u32,
        watched: &BTreeMap<u32, u64>,
        in_sockets: bool,
        own: Option<u32>,
    ) -> bool {
        let exited = self.processes.iter().any(|(pid, tracked)| {
            tracked.service == service && watched.get(pid) != Some(&tracked.since_ns)
        });
        let adopting = self.adoptions.values().any(|&(_, s)| s == service);
        let elsewhere = || {
            self.service_namespaces
                .get(&service)
                .is_none_or(|namespaces| {
                    namespaces
                        .iter()
                        .any(|&netns| netns.is_none() || netns != own)
                })
        };
        !(exited || adopting || in_sockets && elsewhere())
    }

    /// What user space moved in or out of `service`'s gauges.
    pub fn corrections_of(&self, service: u32) -> Corrections {
        self.corrections.get(&service).copied().unwrap_or_default()
    }

    /// Keeps the offsets of `service`'s last recount.
    pub fn set_recounted(&mut self, service: u32, offsets: PerGauge<i64>) {
        self.corrections.entry(service).or_default().recounted = offsets;
    }

    /// True if the last scan saw this listening socket (watched or not).
    pub fn knows_listen_socket(&self, inode: u64) -> bool {
        self.known_listen_sockets.contains(&inode)
    }
}

#[cfg(test)]
mod tests;
