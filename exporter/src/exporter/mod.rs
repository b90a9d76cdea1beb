//! The running exporter, composed of services that each own their state and lock:
//! the core (kernel, watched set, pools, windows, lock probes), health, stacks and
//! profiles. What touches them: a rescan, a process event, the timers, a scrape and
//! the debug endpoints (`Gatherer`). Scans and netlink reads happen outside the locks.
//!
//! Lock order: `stacks`' collector → `core` → `health`'s counters. A stack drain
//! holds the collector while it takes `core` (to read the kernel) and then health's
//! unsymbolized count; a scrape and the health check hold `core` while they take
//! health's. Every other lock is taken alone, for one statement or block: the
//! stacks' session windows, snapshots and unwound frames (a drain takes those after
//! releasing `core`), the profiles' sessions, `reload_status`.
//! `settings` is only read for its `Arc`, never held.
mod core;
mod debug;
mod gather;
mod health;
mod lock_report;
mod profiles;
mod recount;
mod stacks;

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, RwLock},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use poolscope_shared::{ProcessEvent, ProcessEventKind, ServiceCounters};
use tokio::sync::Notify;

use self::{
    core::Core,
    health::Health,
    profiles::{Parts, Profiles},
    stacks::Stacks,
};
use crate::{
    clock::monotonic_ns,
    collectors::own::ReloadStatus,
    config::Settings,
    discovery::cpus::{self, CpuLimits},
    discovery::lock_probes::LockProbes,
    discovery::pod_logs::PodLogs,
    discovery::pools::Pools,
    discovery::procfs,
    discovery::rules,
    discovery::sockdiag,
    discovery::targets::Targets,
    encode::{Exposition, Family},
    kernel::{Kernel, PoolWaits, Readout},
    metrics::capacity::Throughput,
    metrics::health::{self as health_model, HealthTracker},
    metrics::pools::{self, PoolWindows},
    metrics::recount::Recount,
    metrics::window::Windows,
    scrape_counts::ScrapeCounts,
    stacks::profile::View,
    stacks::sessions::{ProfileQuery, Refusal, Ticket},
    stacks::snapshots::Trigger,
    web::server::{DebugError, Gatherer, LocksQuery, ProfileOutput, StacksQuery},
};

/// Length of the quantile window of the `_window` summaries (DESIGN §4).
const QUANTILE_WINDOW: Duration = Duration::from_secs(60);

/// Takes a lock whose holder may have panicked. Each lock here guards state that
/// stays valid whatever a panic interrupted (the kernel's maps are the real state;
/// the rest are counters, windows and slot flags), so a poisoned lock is still used.
fn lock_or_recover<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub struct Exporter {
    core: Mutex<Core>,
    settings: RwLock<Arc<Settings>>,
    health: Health,
    stacks: Stacks,
    profiles: Profiles,
    /// Wakes the rescan loop before its next tick.
    rescan_now: Arc<Notify>,
    /// True once poolscope is stopping: profiling sessions end early, so that the
    /// HTTP server's graceful shutdown does not wait for them.
    stopping: tokio::sync::watch::Sender<bool>,
    /// Fixed at start (a reload does not move it).
    procfs_root: PathBuf,
    /// Read at the first scrape that could.
    procfs_units: std::sync::OnceLock<procfs::ProcfsUnits>,
    /// poolscope's own network namespace, read once (it never moves).
    own_network_namespace: std::sync::OnceLock<u32>,
    reload_status: Mutex<ReloadStatus>,
    /// The listeners of each network namespace as the last rescan found them.
    listeners_found: Mutex<ListenersFound>,
    /// Reads of a namespace's `net/tcp` tables, by rescans and scrapes.
    namespace_tables_read: std::sync::atomic::AtomicU64,
    /// Processes whose open files rescans read.
    process_fds_read: std::sync::atomic::AtomicU64,
    /// The CPUs each service may use, read every few seconds outside the core lock.
    cpu_limits: Mutex<CpuLimits>,
    /// Where poolscope's cgroup namespace sits in the hierarchies, for the CPU limits'
    /// reads (kept apart: scrapes read `cpu_limits` meanwhile).
    cgroup_namespace: Mutex<cpus::NamespaceRoot>,
    /// The kubelet's names of pod containers, read by rescans (fixed directory).
    pod_logs: Mutex<PodLogs>,
}

/// Listeners by network namespace (inode number) and by process, and the kernel's
/// count of listen changes read before they were.
#[derive(Debug, Default)]
struct ListenersFound {
    changes: Option<u64>,
    namespaces: HashMap<u32, Vec<sockdiag::ListenQueue>>,
    processes: HashMap<u32, procfs::HeldSockets>,
    /// Rescans that took them over from the one before.
    reused: u32,
}

/// Rescans in a row that may reuse the listeners found before; the next reads every
/// table and every process's open files (about a minute at the default interval): a
/// safety net for listeners the count of listen changes would miss.
const MAX_LISTENERS_REUSED: u32 = 11;

#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    #[error("scanning {root}: {source}")]
    Procfs {
        root: String,
        source: std::io::Error,
    },
}

impl Exporter {
    pub fn new(kernel: Kernel, settings: Settings) -> Self {
        let probes = kernel.probes().to_vec();
        // Map sizes are fixed at load: the advice names them.
        let capacities = health_model::ADVISED_MAPS
            .iter()
            .filter_map(|&map| Some((map, kernel.capacity(map)?.into())))
            .collect();
        let tracker = HealthTracker::new(settings.degraded_for, capacities);
        let procfs_root = settings.procfs_root.clone();
        let pod_logs_dir = settings.pod_logs_dir.clone();
        let core = Core {
            targets: Targets::new(procfs_root.clone(), settings.limits.max_services),
            pools: Pools::new(procfs_root.clone(), settings.limits.max_pools),
            pool_windows: PoolWindows::new(settings.utilization_window),
            throughput: Throughput::new(settings.utilization_window),
            windows: Windows::new(QUANTILE_WINDOW),
            lock_probes: LockProbes::new(&settings.lock_uprobes),
            recount: Recount::default(),
            kernel,
        };
        Self {
            core: Mutex::new(core),
            health: Health::new(tracker, probes),
            stacks: Stacks::new(&settings),
            profiles: Profiles::default(),
            settings: RwLock::new(Arc::new(settings)),
            reload_status: Mutex::new(loaded_now()),
            rescan_now: Arc::new(Notify::new()),
            stopping: tokio::sync::watch::Sender::new(false),
            procfs_root,
            procfs_units: std::sync::OnceLock::new(),
            own_network_namespace: std::sync::OnceLock::new(),
            listeners_found: Mutex::new(ListenersFound::default()),
            namespace_tables_read: std::sync::atomic::AtomicU64::new(0),
            process_fds_read: std::sync::atomic::AtomicU64::new(0),
            cpu_limits: Mutex::new(CpuLimits::default()),
            cgroup_namespace: Mutex::new(cpus::NamespaceRoot::default()),
            pod_logs: Mutex::new(PodLogs::new(pod_logs_dir)),
        }
    }

    /// poolscope is stopping: running profiling sessions end now.
    pub fn stop(&self) {
        self.stopping.send_replace(true);
    }

    /// Notified when a rescan is worth doing before the next tick.
    pub fn rescan_trigger(&self) -> Arc<Notify> {
        self.rescan_now.clone()
    }

    /// Probes (attached or not) the kernel side has.
    pub fn probe_count(&self) -> usize {
        self.health.probes().len()
    }

    pub fn settings(&self) -> Arc<Settings> {
        self.settings
            .read()
            .map_or_else(|poisoned| poisoned.into_inner().clone(), |s| s.clone())
    }

    /// Takes new settings (SIGHUP); the next rescan applies the new targets.
    pub fn replace_settings(&self, settings: Settings) {
        {
            let mut core = lock_or_recover(&self.core);
            core.pool_windows.set_window(settings.utilization_window);
            core.throughput.set_window(settings.utilization_window);
            // Processes watched from now on; those probed already keep their probes.
            core.lock_probes.set_services(&settings.lock_uprobes);
        }
        self.health.set_degraded_for(settings.degraded_for);
        self.stacks.set_limits(
            settings.snapshots.keep,
            settings.snapshots.memory_limit_bytes,
            settings.snapshots.unwind_memory_bytes,
        );
        let mut current = self.settings.write().unwrap_or_else(|p| p.into_inner());
        *current = Arc::new(settings);
    }

    /// A reload (of the configuration and the web configuration) ended: whole, or
    /// refused in part, where the running configuration stays.
    pub fn reload_finished(&self, successful: bool) {
        let mut status = lock_or_recover(&self.reload_status);
        if successful {
            *status = loaded_now();
        } else {
            status.successful = false;
        }
    }

    /// Scans procfs and makes the watched set match the target rules.
    pub fn rescan(&self) -> Result<(), ScanError> {
        let settings = self.settings();
        let started_ns = monotonic_ns();
        let (known, changes, reused) = self.known_listeners();
        let pods = {
            let mut pod_logs = lock_or_recover(&self.pod_logs);
            if let Err(error) = pod_logs.refresh() {
                tracing::debug!(dir = %pod_logs.dir().display(), %error, "cannot list the kubelet's log links");
            }
            pod_logs.index()
        };
        let mut snapshot =
            procfs::scan(&self.procfs_root, known, &pods).map_err(|source| ScanError::Procfs {
                root: self.procfs_root.display().to_string(),
                source,
            })?;
        self.namespace_tables_read
            .fetch_add(snapshot.tables_read, std::sync::atomic::Ordering::Relaxed);
        self.process_fds_read
            .fetch_add(snapshot.fds_read, std::sync::atomic::Ordering::Relaxed);
        *lock_or_recover(&self.listeners_found) = ListenersFound {
            changes,
            // Nothing after this reads them from the snapshot.
            namespaces: std::mem::take(&mut snapshot.namespace_listeners),
            processes: std::mem::take(&mut snapshot.held),
            reused,
        };
        let assignments = rules::assign(&snapshot, &settings.targets, std::process::id());
        let mut core = lock_or_recover(&self.core);
        let Core {
            kernel, targets, ..
        } = &mut *core;
        targets.apply(kernel, &snapshot, &assignments, started_ns);
        // Pools of services gone go at the next sample, a second at most.
        core.follow_watch_changes(&self.procfs_root);
        Ok(())
    }

    /// The listeners a scan need not read from `net/tcp` tables (each read walks the
    /// kernel's whole connection hash, sized by memory and not by sockets: ~5 ms per
    /// table at 262,144 buckets) nor from processes' open files (a file per fd: at
    /// 110 services, half a scan's CPU), with the kernel's count of listen changes
    /// now: those of poolscope's own network namespace by sock_diag (which walks only
    /// the listeners), and every namespace's and process's found by the last scan
    /// while no socket on the host has begun or stopped listening since (up to
    /// [`MAX_LISTENERS_REUSED`] rescans in a row). Only where the procfs root is the
    /// kernel's. Also how many rescans in a row the known listeners were reused.
    fn known_listeners(&self) -> (procfs::Known, Option<u64>, u32) {
        if !self.procfs_is_the_kernels() {
            return (procfs::Known::default(), None, 0);
        }
        // Read before the scan: a listen() during it moves the count for the next.
        let changes = lock_or_recover(&self.core).kernel.listen_changes();
        let (mut known, reused) = {
            let mut found = lock_or_recover(&self.listeners_found);
            if changes.is_some() && found.changes == changes && found.reused < MAX_LISTENERS_REUSED
            {
                let known = procfs::Known {
                    namespaces: found.namespaces.clone(),
                    // This scan finds them again (or reads them).
                    processes: std::mem::take(&mut found.processes),
                };
                (known, found.reused + 1)
            } else {
                (procfs::Known::default(), 0)
            }
        };
        let own = procfs::network_namespace(Path::new("/proc"), "self");
        match (own, sockdiag::listen_queues()) {
            (Some(namespace), Ok(sockets)) => {
                known.namespaces.insert(namespace, sockets);
            }
            (None, _) => {}
            (Some(_), Err(error)) => {
                tracing::debug!(%error, "sock_diag failed; the scan reads net/tcp");
            }
        }
        (known, changes, reused)
    }

    /// Whether the procfs root is the kernel's own, whose pids and sockets poolscope
    /// may also reach by system calls (not a fixture).
    fn procfs_is_the_kernels(&self) -> bool {
        self.procfs_root == Path::new("/proc")
    }

    /// Reads every loss counter and updates the health (logging what changed); run
    /// every second, so that `/healthz` and the log follow without a scrape.
    pub fn check_health(&self) {
        self.health.check(&lock_or_recover(&self.core));
    }

    /// Samples every pool's totals and every service's finished requests for the
    /// utilization and capacity window, and names threads the kernel started
    /// following since the last sample. Returns the services' counters it read (the
    /// saturation check's too); `None` if the kernel could not be read.
    pub fn sample_pools(&self) -> Option<BTreeMap<u32, ServiceCounters>> {
        let mut core = lock_or_recover(&self.core);
        let Core {
            kernel,
            targets,
            pools,
            pool_windows,
            throughput,
            ..
        } = &mut *core;
        let services = targets.service_ids();
        let mut readout = Readout::default();
        let read = kernel.read_services(&services).and_then(|counters| {
            kernel.read_pools(&pools.ids(), PoolWaits::Skipped, &mut readout)?;
            Ok(counters)
        });
        match read {
            Ok(counters) => {
                let at = std::time::Instant::now();
                pool_windows.sample(at, &pools::totals(&readout));
                let finished = counters
                    .iter()
                    .map(|(&service, counters)| (service, counters.finished.get()))
                    .collect();
                throughput.sample(at, &finished);
                pools.sync(kernel, &services, &readout.threads);
                pool_windows.retain(&pools.ids());
                kernel.give_back_threads(readout.threads);
                Some(counters)
            }
            Err(error) => {
                tracing::warn!(%error, "reading pool stats failed");
                None
            }
        }
    }

    /// Reads again the CPU limits of the services whose reading is [`cpus::REFRESH`]
    /// old (files of procfs and cgroupfs, read outside the core lock).
    pub fn refresh_cpu_limits(&self) {
        let now = std::time::Instant::now();
        let processes = lock_or_recover(&self.core).targets.processes_by_service();
        let due: Vec<(u32, Vec<u32>)> = {
            let mut limits = lock_or_recover(&self.cpu_limits);
            limits.retain(|service| processes.contains_key(&service));
            processes
                .into_iter()
                .filter(|(service, _)| limits.due(*service, now))
                .collect()
        };
        if due.is_empty() {
            return;
        }
        // Once per pass: procfs's `stat` is a line per CPU, generated at each read.
        let Some(host) = cpus::host_cpus(&self.procfs_root) else {
            return;
        };
        let cgroupfs_root = self.settings().cgroupfs_root.clone();
        let mut namespace = lock_or_recover(&self.cgroup_namespace);
        let read: Vec<(u32, Option<cpus::CpuLimit>)> = due
            .into_iter()
            .map(|(service, pids)| {
                let limit = cpus::service_cpus(
                    (&self.procfs_root, &cgroupfs_root),
                    &mut namespace,
                    host,
                    &pids,
                );
                (service, limit)
            })
            .collect();
        drop(namespace);
        let mut limits = lock_or_recover(&self.cpu_limits);
        for (service, limit) in read {
            limits.store(service, now, limit);
        }
    }

    /// Moves the stacks counted up to two epochs ago into the current windows.
    pub fn drain_stacks(&self) {
        self.stacks.drain(&self.core, &self.health);
    }

    /// Ends the current window as a snapshot.
    pub fn take_snapshot(&self, trigger: Trigger) {
        self.stacks
            .take_snapshot(trigger, &self.settings(), &self.core, &self.health);
    }

    /// Applies process events. An unwatched process that exec'd is checked against the
    /// rules on its own (no full scan: execs are frequent on a busy host).
    pub fn on_events(&self, events: &[ProcessEvent]) {
        let mut execs: Vec<u32> = {
            let mut core = lock_or_recover(&self.core);
            let Core {
                kernel,
                targets,
                pools,
                ..
            } = &mut *core;
            let execs = events
                .iter()
                .filter_map(|event| {
                    if event.kind == ProcessEventKind::ThreadRenamed as u32 {
                        pools.renamed(kernel, event.pid, event.service);
                        return None;
                    }
                    targets.on_event(kernel, event)
                })
                .collect();
            core.follow_watch_changes(&self.procfs_root);
            execs
        };
        let settings = self.settings();
        // With no rules, a process becomes a service by listening, which comes after
        // its exec: the scrape sees the new socket and asks for a rescan then.
        if execs.is_empty() || settings.targets.is_empty() {
            return;
        }
        execs.sort_unstable();
        execs.dedup();
        let pods = lock_or_recover(&self.pod_logs).index();
        let processes: Vec<_> = execs
            .into_iter()
            .filter_map(|pid| procfs::read_process(&self.procfs_root, pid, &pods))
            .collect();
        let snapshot = procfs::ProcSnapshot {
            processes,
            ..Default::default()
        };
        let assignments = rules::assign(&snapshot, &settings.targets, std::process::id());
        if assignments.is_empty() {
            return;
        }
        let mut core = lock_or_recover(&self.core);
        let Core {
            kernel, targets, ..
        } = &mut *core;
        for assignment in &assignments {
            targets.add(kernel, assignment);
        }
        core.follow_watch_changes(&self.procfs_root);
    }
}

impl Gatherer for Exporter {
    fn debug_threads(&self) -> String {
        self.threads_text()
    }

    fn debug_locks(&self, query: &LocksQuery) -> Result<String, DebugError> {
        self.locks_text(query)
    }

    fn debug_snapshots(&self) -> String {
        self.snapshots_json()
    }

    fn debug_stacks(&self, view: View, query: &StacksQuery) -> Result<Vec<u8>, DebugError> {
        self.snapshot_stacks(view, query)
    }

    fn begin_profile(&self, query: &ProfileQuery, requested_ns: u64) -> Result<Ticket, Refusal> {
        let settings = self.settings();
        self.profiles
            .begin(query, requested_ns, &self.parts(&settings))
    }

    fn end_profile(&self, ticket: Ticket) -> Result<ProfileOutput, Refusal> {
        let settings = self.settings();
        self.profiles.end(&ticket, &self.parts(&settings))
    }

    fn stopping(&self) -> tokio::sync::watch::Receiver<bool> {
        self.stopping.subscribe()
    }

    fn health(&self) -> String {
        self.health.report()
    }

    fn cancel_profile(&self, ticket: Ticket) {
        let settings = self.settings();
        self.profiles.cancel(&ticket, &self.parts(&settings));
    }

    fn gather(&self, exposition: Exposition, web: &ScrapeCounts) -> Vec<Family> {
        self.gather_families(exposition, web)
    }
}

impl Exporter {
    /// What the profiling service works with.
    fn parts<'a>(&'a self, settings: &'a Settings) -> Parts<'a> {
        Parts {
            settings,
            core: &self.core,
            stacks: &self.stacks,
            health: &self.health,
        }
    }
}

/// The configuration in use was loaded just now.
fn loaded_now() -> ReloadStatus {
    ReloadStatus {
        successful: true,
        success_unix_seconds: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64(),
    }
}
