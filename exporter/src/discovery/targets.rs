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

use poolscope_shared::{ListenKey, Phase, ProcessEvent, ProcessEventKind, Watched, maps};

use crate::{
    clock::monotonic_ns,
    discovery::held::HeldListener,
    discovery::ids::DenseIds,
    discovery::procfs::{self, NetTables, ProcSnapshot},
    discovery::rules::Assignment,
    kernel::{Backend, MapErrors, WatchTable},
};

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
    /// It hands each HTTP/2 stream to a worker thread (`[[targets]]
    /// http2_worker_threads`): its open streams no thread serves are waiting.
    pub stream_workers: bool,
    /// What user space moved in or out of the gauges without a kernel event.
    pub corrections: Corrections,
}

/// The gauges' moves that user space made, not the kernel: connections it removed
/// from the kernel's maps (their process exited without closing them, syscall
/// backend; or they closed before the socket backend adopted them), by the gauge
/// they left, and connections it adopted with a request unread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Corrections {
    pub unserved: u64,
    pub waiting: u64,
    pub serving: u64,
    pub adopted_unserved: u64,
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
    /// Services flagged in the kernel's `STREAM_WORKERS`.
    stream_workers: HashSet<u32>,
    /// Connections in the kernel's `ADOPT` map: socket inode → (pid, service).
    adoptions: HashMap<u64, (u32, u32)>,
    /// Listening socket inode → service name, from the last scan.
    listeners: HashMap<u64, String>,
    /// Every listening socket the last scan saw, watched or not.
    known_listen_sockets: HashSet<u64>,
    /// The network namespaces of watched listeners (from the last scan).
    listener_namespaces: BTreeMap<u32, NamespaceListeners>,
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
            stream_workers: HashSet::new(),
            adoptions: HashMap::new(),
            listeners: HashMap::new(),
            known_listen_sockets: HashSet::new(),
            listener_namespaces: BTreeMap::new(),
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

    /// Tells the kernel which (network namespace, port, address) keys are the listeners
    /// of which service, so that the socket backend can claim a connection when its
    /// handshake completes.
    fn sync_listen_ports(&mut self, kernel: &mut dyn WatchTable, snapshot: &ProcSnapshot) {
        let by_namespace = kernel.claims_by_namespace();
        self.listener_namespaces = BTreeMap::new();
        for inode in self.listeners.keys() {
            let Some(&netns) = snapshot.listen_namespaces.get(inode) else {
                continue;
            };
            let Some(&pid) = snapshot.namespace_pids.get(&netns) else {
                continue;
            };
            let namespace =
                self.listener_namespaces
                    .entry(netns)
                    .or_insert_with(|| NamespaceListeners {
                        pid,
                        held: Vec::new(),
                    });
            // Both maps have every listening socket some process holds, as each
            // watched listener is.
            if let (Some(&addr), Some(&(pid, fd))) = (
                snapshot.listen_sockets.get(inode),
                snapshot.listen_holders.get(inode),
            ) {
                namespace.held.push(HeldListener {
                    inode: *inode,
                    addr,
                    pid,
                    fd,
                });
            }
        }
        let ports: BTreeMap<ListenKey, u32> = self
            .listeners
            .iter()
            .filter_map(|(inode, service)| {
                let addr = snapshot.listen_sockets.get(inode)?;
                let netns = if by_namespace {
                    // A listener whose namespace is unknown cannot be told from another
                    // namespace's on the same port: it claims nothing.
                    *snapshot.listen_namespaces.get(inode)?
                } else {
                    ListenKey::ANY_NAMESPACE
                };
                let key = ListenKey {
                    netns,
                    port: u32::from(addr.port()),
                    addr: listen_address(addr.ip()),
                };
                Some((key, self.ids.get(service)?))
            })
            .collect();
        let failed = kernel.set_listen_ports(&ports);
        if let Some(first) = failed.first() {
            // At every scan while it lasts: debug, the health check logs the onset.
            tracing::debug!(
                error = %first,
                "{} update(s) of the listening ports of watched services failed",
                failed.len()
            );
        }
        for error in &failed {
            self.map_errors.count(maps::LISTEN_PORTS, error);
        }
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
                self.flag_stream_workers(kernel, service, assignment.http2_worker_threads);
            }
            return None;
        }
        let Some((service, _)) = self.ids.get_or_allocate(&assignment.service) else {
            self.services_refused += 1;
            // At every scan: the health check logs the onset.
            tracing::debug!(service = %assignment.service, "limits.max_services reached; not watched");
            return None;
        };
        self.flag_stream_workers(kernel, service, assignment.http2_worker_threads);
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

    /// Follows the connections a newly watched process already holds on its own
    /// listening ports (open before poolscope, or before a reload watched it).
    fn adopt(&mut self, kernel: &mut dyn WatchTable, new: NewWatch, tables: &mut NetTables) {
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
    fn prune_adoptions(&mut self, kernel: &mut dyn WatchTable) {
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

    /// Tells the kernel whether `service` hands HTTP/2 streams to worker threads, when
    /// that changed (its rule's key, at a reload).
    fn flag_stream_workers(&mut self, kernel: &mut dyn WatchTable, service: u32, on: bool) {
        if self.stream_workers.contains(&service) == on {
            return;
        }
        match kernel.set_stream_workers(service, on) {
            Ok(()) if on => {
                self.stream_workers.insert(service);
            }
            Ok(()) => {
                self.stream_workers.remove(&service);
            }
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
                    stream_workers: self.stream_workers.contains(&id),
                    corrections: self.corrections.get(&id).copied().unwrap_or_default(),
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

    /// True if the last scan saw this listening socket (watched or not).
    pub fn knows_listen_socket(&self, inode: u64) -> bool {
        self.known_listen_sockets.contains(&inode)
    }
}

/// A listener's address as [`ListenKey::addr`]: IPv6, an IPv4 address mapped;
/// [`ListenKey::ANY_ADDRESS`] for one bound to every address.
fn listen_address(ip: std::net::IpAddr) -> [u8; 16] {
    if ip.is_unspecified() {
        return ListenKey::ANY_ADDRESS;
    }
    match ip {
        std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        std::net::IpAddr::V6(v6) => v6.octets(),
    }
}

#[cfg(test)]
mod tests {
    use std::{fs, io, path::Path};

    use poolscope_shared::LossErrno;

    use super::*;
    use crate::kernel::fake::FakeTables;

    /// A procfs with `/proc/<pid>/stat` of each (pid, start time).
    fn procfs(processes: &[(u32, u64)]) -> io::Result<tempfile::TempDir> {
        let root = tempfile::tempdir()?;
        for (pid, start_time) in processes {
            write_stat(root.path(), *pid, *start_time)?;
        }
        Ok(root)
    }

    fn write_stat(root: &Path, pid: u32, start_time: u64) -> io::Result<()> {
        let dir = root.join(pid.to_string());
        fs::create_dir_all(&dir)?;
        fs::write(
            dir.join("stat"),
            format!("{pid} (server) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {start_time} 0 0"),
        )
    }

    fn assigned(pid: u32, start_time: u64, service: &str) -> Assignment {
        Assignment {
            pid,
            start_time,
            service: service.to_owned(),
            http2_worker_threads: false,
        }
    }

    fn scan(targets: &mut Targets, tables: &mut FakeTables, assignments: &[Assignment]) {
        targets.apply(
            tables,
            &ProcSnapshot::default(),
            assignments,
            monotonic_ns(),
        );
    }

    /// The kernel's `WATCHED` as a readout has it (pid → since).
    fn watched(tables: &FakeTables) -> BTreeMap<u32, u64> {
        tables
            .watched
            .iter()
            .map(|(&pid, w)| (pid, w.since_ns))
            .collect()
    }

    fn names(views: &[ServiceView]) -> Vec<(&str, u64)> {
        views
            .iter()
            .map(|view| (view.name.as_str(), view.processes))
            .collect()
    }

    #[test]
    fn a_rule_flags_its_service_stream_workers_until_a_reload_unflags_it() -> io::Result<()> {
        let root = procfs(&[(100, 5), (200, 7)])?;
        let mut targets = Targets::new(root.path().to_owned(), 8);
        let mut tables = FakeTables::default();
        let grpc = Assignment {
            http2_worker_threads: true,
            ..assigned(100, 5, "grpc")
        };
        scan(
            &mut targets,
            &mut tables,
            &[grpc.clone(), assigned(200, 7, "web")],
        );
        let (Some(id), Some(web)) = (targets.service_id("grpc"), targets.service_id("web")) else {
            panic!("both services get ids");
        };
        assert_eq!(tables.stream_workers, BTreeSet::from([id]));
        let views = targets.services(&watched(&tables));
        let flags: Vec<(u32, bool)> = views.iter().map(|v| (v.id, v.stream_workers)).collect();
        assert_eq!(flags, [(id, true), (web, false)]);
        // A reload drops the key: the running process's service is unflagged.
        let plain = Assignment {
            http2_worker_threads: false,
            ..grpc
        };
        scan(&mut targets, &mut tables, &[plain, assigned(200, 7, "web")]);
        assert!(tables.stream_workers.is_empty());
        assert!(!targets.services(&watched(&tables))[0].stream_workers);
        Ok(())
    }

    #[test]
    fn a_scan_watches_what_is_assigned_and_forgets_what_is_not() -> io::Result<()> {
        let root = procfs(&[(100, 5), (200, 7)])?;
        let mut targets = Targets::new(root.path().to_owned(), 8);
        let mut tables = FakeTables::default();
        scan(
            &mut targets,
            &mut tables,
            &[assigned(100, 5, "api"), assigned(200, 7, "db")],
        );
        let (api, db) = (targets.service_id("api"), targets.service_id("db"));
        let (Some(api), Some(db)) = (api, db) else {
            panic!("both services get ids: {api:?} {db:?}");
        };
        assert_eq!(
            tables.watched.keys().copied().collect::<Vec<_>>(),
            [100, 200]
        );
        assert_eq!(tables.watched[&100].service, api);
        assert_eq!(
            targets.take_changes(),
            [
                WatchChange::Watched {
                    pid: 100,
                    service: api
                },
                WatchChange::Watched {
                    pid: 200,
                    service: db
                },
            ]
        );
        assert_eq!(
            names(&targets.services(&watched(&tables))),
            [("api", 1), ("db", 1)]
        );

        scan(&mut targets, &mut tables, &[assigned(100, 5, "api")]);
        assert_eq!(tables.watched.keys().copied().collect::<Vec<_>>(), [100]);
        assert_eq!(
            targets.take_changes(),
            [WatchChange::Forgotten { pid: 200 }]
        );
        // The idle service's id is freed, and its counters zeroed for the next owner.
        assert_eq!(tables.services_reset, [db]);
        assert_eq!(targets.service_id("db"), None);
        assert_eq!(names(&targets.services(&watched(&tables))), [("api", 1)]);
        Ok(())
    }

    #[test]
    fn a_process_seen_with_another_start_time_is_not_watched() -> io::Result<()> {
        // The scan saw pid 100 start at 4; it is another process (start 5) by the
        // time of the insert.
        let root = procfs(&[(100, 5)])?;
        let mut targets = Targets::new(root.path().to_owned(), 8);
        let mut tables = FakeTables::default();
        scan(&mut targets, &mut tables, &[assigned(100, 4, "api")]);
        assert!(tables.watched.is_empty(), "{:?}", tables.watched);
        assert!(targets.take_changes().is_empty());
        assert!(targets.services(&watched(&tables)).is_empty());
        Ok(())
    }

    #[test]
    fn a_full_watched_map_is_counted_and_the_rest_still_watched() -> io::Result<()> {
        let root = procfs(&[(100, 5), (200, 7), (300, 9)])?;
        let mut targets = Targets::new(root.path().to_owned(), 8);
        let mut tables = FakeTables {
            watched_capacity: 2,
            ..FakeTables::default()
        };
        scan(
            &mut targets,
            &mut tables,
            &[
                assigned(100, 5, "api"),
                assigned(200, 7, "api"),
                assigned(300, 9, "db"),
            ],
        );
        assert_eq!(tables.watched.len(), 2);
        assert_eq!(
            targets.map_errors.iter().collect::<Vec<_>>(),
            [(maps::WATCHED, LossErrno::E2big, 1)]
        );
        assert_eq!(names(&targets.services(&watched(&tables))), [("api", 2)]);
        Ok(())
    }

    #[test]
    fn services_beyond_the_limit_are_refused_and_counted() -> io::Result<()> {
        let root = procfs(&[(100, 5), (200, 7)])?;
        let mut targets = Targets::new(root.path().to_owned(), 1);
        let mut tables = FakeTables::default();
        scan(
            &mut targets,
            &mut tables,
            &[assigned(100, 5, "api"), assigned(200, 7, "db")],
        );
        assert_eq!(targets.services_refused, 1);
        assert_eq!(tables.watched.keys().copied().collect::<Vec<_>>(), [100]);
        Ok(())
    }

    #[test]
    fn kernel_entries_no_scan_assigned_go_unless_newer_than_the_scan() -> io::Result<()> {
        let root = procfs(&[])?;
        let mut targets = Targets::new(root.path().to_owned(), 8);
        let mut tables = FakeTables::default();
        let entry = |since_ns| Watched {
            service: 0,
            _pad: 0,
            since_ns,
        };
        // A fork whose event was lost (older than the scan), and one made while the
        // scan ran (its event is still on its way).
        tables.watched.insert(300, entry(1));
        tables.watched.insert(301, entry(u64::MAX));
        scan(&mut targets, &mut tables, &[]);
        assert_eq!(tables.watched.keys().copied().collect::<Vec<_>>(), [301]);
        Ok(())
    }

    #[test]
    fn a_fork_is_followed_and_its_exit_takes_its_connections_out() -> io::Result<()> {
        let root = procfs(&[(100, 5), (101, 6)])?;
        let mut targets = Targets::new(root.path().to_owned(), 8);
        let mut tables = FakeTables::default();
        scan(&mut targets, &mut tables, &[assigned(100, 5, "api")]);
        let Some(api) = targets.service_id("api") else {
            panic!("api has an id");
        };
        targets.take_changes();
        // The kernel watched the child at its fork and told us.
        let since_ns = monotonic_ns();
        tables.watched.insert(
            101,
            Watched {
                service: api,
                _pad: 0,
                since_ns,
            },
        );
        let event = |kind: ProcessEventKind| ProcessEvent {
            kind: kind as u32,
            pid: 101,
            parent: 100,
            service: api,
            since_ns,
        };
        assert_eq!(
            targets.on_event(&mut tables, &event(ProcessEventKind::Fork)),
            None
        );
        assert_eq!(
            targets.take_changes(),
            [WatchChange::Watched {
                pid: 101,
                service: api
            }]
        );
        assert_eq!(names(&targets.services(&watched(&tables))), [("api", 2)]);

        // It exits holding a connection mid-request: the kernel drops its watch,
        // user space its connection, and the serving gauge is corrected.
        tables.connections.insert((101, 7), (api, Phase::Serving));
        tables.watched.remove(&101);
        assert_eq!(
            targets.on_event(&mut tables, &event(ProcessEventKind::Exit)),
            None
        );
        assert_eq!(
            targets.take_changes(),
            [WatchChange::Forgotten { pid: 101 }]
        );
        assert!(tables.connections.is_empty());
        let views = targets.services(&watched(&tables));
        assert_eq!(names(&views), [("api", 1)]);
        assert_eq!(views[0].corrections.serving, 1);
        Ok(())
    }

    #[test]
    fn an_exec_of_an_unwatched_process_is_returned_for_the_rules() -> io::Result<()> {
        let root = procfs(&[(100, 5)])?;
        let mut targets = Targets::new(root.path().to_owned(), 8);
        let mut tables = FakeTables::default();
        scan(&mut targets, &mut tables, &[assigned(100, 5, "api")]);
        let exec = |pid| ProcessEvent {
            kind: ProcessEventKind::Exec as u32,
            pid,
            parent: 0,
            service: u32::MAX,
            since_ns: 0,
        };
        assert_eq!(targets.on_event(&mut tables, &exec(100)), None);
        assert_eq!(targets.on_event(&mut tables, &exec(555)), Some(555));
        Ok(())
    }
}
