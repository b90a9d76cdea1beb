//! The running exporter: the kernel, the watched set and the current settings behind
//! one lock, with the three things that touch them: a rescan, a process event, and a
//! scrape (`Gatherer`). Scans and netlink reads happen outside the lock.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, MutexGuard, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use poolscope_shared::{
    Activity, LossErrno, LossSource, NO_POOL, Peer, ProcessEvent, ProcessEventKind, ProfileSession,
};
use tokio::sync::Notify;

use crate::{
    clock::monotonic_ns,
    config::Settings,
    discovery::procfs,
    discovery::rules,
    discovery::sockdiag,
    discovery::targets::{Targets, WatchChange},
    kernel::{Kernel, Probe, Readout, WatchTable},
    metrics::collect::{
        PoolInput, ReloadStatus, SelfStats, ServiceInput, downstream_families, peer_label,
        pool_families, queue_depths, self_families, service_families, service_listeners,
    },
    metrics::encode::{Family, cap_series},
    metrics::health::{self, HealthTracker, Loss, LossInputs, LossKind},
    metrics::locks::{self, LockProbes, top_locks},
    metrics::pools::{self, COMPONENTS, PoolView, Pools, sum_of},
    metrics::window::Windows,
    stacks::profile::{self, ProfileMeta, StackRecord, View},
    stacks::sessions::{self, ProfileQuery, Refusal, Sessions, Ticket},
    stacks::snapshots::{
        Drained, RecentNames, Saturation, SessionWindows, Snapshots, StackWindows, Trigger, Window,
    },
    stacks::symbolize::{Symbols, Unnamed},
    web::server::{DebugError, Gatherer, LocksFormat, LocksQuery, ProfileOutput, StacksQuery},
};

/// Between the two epoch advances of a snapshot: longer than any kernel program
/// that read the old epoch takes to finish.
const EPOCH_SETTLE: Duration = Duration::from_millis(5);

/// The stack windows being collected (the snapshot's and the profiling sessions').
/// Each drain symbolizes with a symbolizer of its own (blazesym's is not `Send`), so
/// its cache lives as long as one drain.
struct StackCollector {
    windows: StackWindows,
    names: RecentNames,
    saturation: Saturation,
}

/// Length of the quantile window of the `_window` summaries (DESIGN §4).
const QUANTILE_WINDOW: Duration = Duration::from_secs(60);

struct Shared {
    kernel: Kernel,
    targets: Targets,
    pools: Pools,
    windows: Windows,
    lock_probes: LockProbes,
}

impl Shared {
    /// Every loss counter now; `kernel` is the kernel side's (read by the caller).
    fn losses(
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
    fn follow_watch_changes(&mut self, procfs_root: &Path) {
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
}

/// The shared state behind every endpoint and timer.
///
/// Lock order: `stacks` → `shared` → `unsymbolized` → `health`. A stack drain holds the
/// collector while it takes `shared` (to read the kernel) and `unsymbolized`; a scrape
/// and the health check hold `shared` while they take `unsymbolized` and `health`.
/// `session_windows` has a lock of its own, taken inside `stacks`. `snapshots`,
/// `sessions` and `reload_status` are taken alone, for one statement or block.
/// `settings` is only read for its `Arc`, never held.
pub struct Exporter {
    shared: Mutex<Shared>,
    settings: RwLock<Arc<Settings>>,
    probes: Vec<Probe>,
    series_dropped: AtomicU64,
    /// Addresses the stack drains and lock reports could not name.
    unsymbolized: Mutex<Unnamed>,
    health: Mutex<HealthTracker>,
    /// Wakes the rescan loop before its next tick.
    rescan_now: Arc<Notify>,
    /// True once poolscope is stopping: profiling sessions end early, so that the
    /// HTTP server's graceful shutdown does not wait for them.
    stopping: tokio::sync::watch::Sender<bool>,
    /// Fixed at start (a reload does not move it).
    procfs_root: PathBuf,
    stacks: Mutex<StackCollector>,
    /// The same as `stacks`' session windows, reached without its lock.
    session_windows: SessionWindows,
    reload_status: Mutex<ReloadStatus>,
    snapshots: RwLock<Snapshots>,
    sessions: Mutex<Sessions>,
}

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
        let capacities = health::ADVISED_MAPS
            .iter()
            .filter_map(|&map| Some((map, kernel.capacity(map)?.into())))
            .collect();
        let health = HealthTracker::new(settings.degraded_for, capacities);
        let procfs_root = settings.procfs_root.clone();
        let targets = Targets::new(procfs_root.clone(), settings.limits.max_services);
        let pools = Pools::new(
            procfs_root.clone(),
            settings.limits.max_pools,
            settings.utilization_window,
        );
        let snapshots = Snapshots::new(
            settings.snapshots.keep,
            settings.snapshots.memory_limit_bytes,
        );
        let session_windows = SessionWindows::default();
        Self {
            shared: Mutex::new(Shared {
                kernel,
                targets,
                pools,
                windows: Windows::new(QUANTILE_WINDOW),
                lock_probes: LockProbes::new(&settings.lock_uprobes),
            }),
            settings: RwLock::new(Arc::new(settings)),
            probes,
            series_dropped: AtomicU64::new(0),
            unsymbolized: Mutex::new(Unnamed::default()),
            health: Mutex::new(health),
            stacks: Mutex::new(StackCollector {
                windows: StackWindows::new(SystemTime::now(), session_windows.clone()),
                names: RecentNames::default(),
                saturation: Saturation::default(),
            }),
            snapshots: RwLock::new(snapshots),
            session_windows,
            reload_status: Mutex::new(loaded_now()),
            sessions: Mutex::new(Sessions::default()),
            rescan_now: Arc::new(Notify::new()),
            stopping: tokio::sync::watch::Sender::new(false),
            procfs_root,
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
        self.probes.len()
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        // A panic while holding the lock leaves maps consistent (the kernel owns the
        // state), so a poisoned lock is still usable.
        self.shared
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn settings(&self) -> Arc<Settings> {
        self.settings
            .read()
            .map_or_else(|poisoned| poisoned.into_inner().clone(), |s| s.clone())
    }

    /// Takes new settings (SIGHUP); the next rescan applies the new targets.
    pub fn replace_settings(&self, settings: Settings) {
        {
            let mut shared = self.lock();
            shared.pools.set_window(settings.utilization_window);
            // Processes watched from now on; those probed already keep their probes.
            shared.lock_probes.set_services(&settings.lock_uprobes);
        }
        self.health_tracker()
            .set_degraded_for(settings.degraded_for);
        self.snapshots_mut().set_limits(
            settings.snapshots.keep,
            settings.snapshots.memory_limit_bytes,
        );
        let mut current = self.settings.write().unwrap_or_else(|p| p.into_inner());
        *current = Arc::new(settings);
    }

    /// A reload (of the configuration and the web configuration) ended: whole, or
    /// refused in part, where the running configuration stays.
    pub fn reload_finished(&self, successful: bool) {
        let mut status = self.reload_status();
        if successful {
            *status = loaded_now();
        } else {
            status.successful = false;
        }
    }

    fn reload_status(&self) -> MutexGuard<'_, ReloadStatus> {
        // Two plain values, valid whatever a panic interrupted.
        self.reload_status
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Scans procfs and makes the watched set match the target rules.
    pub fn rescan(&self) -> Result<(), ScanError> {
        let settings = self.settings();
        let started_ns = monotonic_ns();
        let snapshot = procfs::scan(&self.procfs_root).map_err(|source| ScanError::Procfs {
            root: self.procfs_root.display().to_string(),
            source,
        })?;
        let assignments = rules::assign(&snapshot, &settings.targets, std::process::id());
        let mut shared = self.lock();
        let Shared {
            kernel, targets, ..
        } = &mut *shared;
        targets.apply(kernel, &snapshot, &assignments, started_ns);
        // Pools of services gone go at the next sample, a second at most.
        shared.follow_watch_changes(&self.procfs_root);
        Ok(())
    }

    /// Runs `work` with a symbolizer of its own (blazesym's is not `Send`, so each
    /// drain or report makes one) and counts the addresses it left unnamed.
    fn symbolize<T>(&self, work: impl FnOnce(&Symbols) -> T) -> T {
        let symbols = Symbols::new(&self.procfs_root);
        let result = work(&symbols);
        *self.unsymbolized_total() += symbols.unnamed();
        result
    }

    fn unsymbolized_total(&self) -> MutexGuard<'_, Unnamed> {
        // Two counters: nothing a panic could leave half-written.
        self.unsymbolized
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn health_tracker(&self) -> MutexGuard<'_, HealthTracker> {
        // Its counters stay valid whatever a panic interrupted.
        self.health
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Reads every loss counter and updates the health (logging what changed); run
    /// every second, so that `/healthz` and the log follow without a scrape.
    pub fn check_health(&self) {
        let shared = self.lock();
        let kernel = match shared.kernel.losses() {
            Ok(kernel) => kernel,
            Err(error) => {
                tracing::warn!(%error, "reading the kernel's loss counters failed");
                return;
            }
        };
        let losses = shared.losses(
            &kernel,
            self.series_dropped.load(Ordering::Relaxed),
            *self.unsymbolized_total(),
            &self.probes,
        );
        self.health_tracker().observe(Instant::now(), &losses);
    }

    /// Samples every pool's totals for the utilization window, and names threads the
    /// kernel started following since the last sample.
    pub fn sample_pools(&self) {
        let mut shared = self.lock();
        let Shared {
            kernel,
            targets,
            pools,
            ..
        } = &mut *shared;
        let mut readout = Readout::default();
        match kernel.read_pools(&pools.ids(), &mut readout) {
            Ok(()) => {
                pools.sample(Instant::now(), &pools::totals(&readout));
                pools.sync(kernel, &targets.service_ids(), &readout.threads);
            }
            Err(error) => tracing::warn!(%error, "reading pool stats failed"),
        }
    }

    fn stack_collector(&self) -> MutexGuard<'_, StackCollector> {
        // A panic mid-window leaves a window that is still valid to add to.
        self.stacks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn snapshots_mut(&self) -> std::sync::RwLockWriteGuard<'_, Snapshots> {
        self.snapshots
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Starts a new stack epoch and reads (then clears) the generation no program
    /// can add to any more, with the names of its pools and processes.
    fn drain_generation(&self) -> Drained {
        let mut shared = self.lock();
        let generation = match shared.kernel.advance_stack_epoch() {
            Ok(generation) => generation,
            Err(error) => {
                tracing::warn!(%error, "cannot advance the stack epoch");
                return Drained::default();
            }
        };
        let counts = shared.kernel.stack_counts(generation);
        let mut stacks = HashMap::new();
        for (key, _) in &counts {
            for id in [key.user_stack, key.kernel_stack] {
                if id >= 0
                    && !stacks.contains_key(&id)
                    && let Some(frames) = shared.kernel.stack(generation, id)
                {
                    stacks.insert(id, frames);
                }
            }
        }
        let keys: Vec<_> = counts.iter().map(|(key, _)| *key).collect();
        shared.kernel.clear_stacks(generation, &keys);
        // A pool or process whose service is gone already (its process exited since
        // the last sample) is left out rather than named "": `RecentNames` then gives
        // the name it had, as for a pool forgotten already. (Named "", the blocks of
        // its last seconds went to no service: one snapshot's worth, in CI.)
        let service_name = |id: u32| shared.targets.service_name(id).map(str::to_owned);
        let pools = shared
            .pools
            .views()
            .into_iter()
            .filter_map(|view| Some((view.id, (service_name(view.service)?, view.name))))
            .collect();
        let processes = shared
            .kernel
            .watched_pids()
            .into_iter()
            .filter_map(|(pid, watch)| Some((pid, service_name(watch.service)?)))
            .collect();
        // Mappings are read by `RecentNames::complete`, outside the lock.
        Drained {
            counts,
            stacks,
            pools,
            processes,
            mappings: HashMap::new(),
        }
    }

    /// Moves the stacks counted up to two epochs ago into the current windows
    /// (symbolized outside the exporter's lock).
    pub fn drain_stacks(&self) {
        let mut collector = self.stack_collector();
        let mut drained = self.drain_generation();
        collector.names.complete(&mut drained, &self.procfs_root);
        self.symbolize(|symbols| collector.windows.add(&drained, symbols));
    }

    /// Brings every stack counted up to now into the windows: two epoch advances (an
    /// off-CPU block still in progress keeps its time but loses its stacks, counted
    /// in `events_lost_total`).
    fn drain_everything(&self, collector: &mut StackCollector) {
        let mut first = self.drain_generation();
        collector.names.complete(&mut first, &self.procfs_root);
        std::thread::sleep(EPOCH_SETTLE);
        let mut second = self.drain_generation();
        collector.names.complete(&mut second, &self.procfs_root);
        self.symbolize(|symbols| {
            collector.windows.add(&first, symbols);
            collector.windows.add(&second, symbols);
        });
    }

    /// Ends the current window as a snapshot.
    pub fn take_snapshot(&self, trigger: Trigger) {
        let settings = self.settings().snapshots;
        let mut collector = self.stack_collector();
        self.drain_everything(&mut collector);
        let now = SystemTime::now();
        let window = std::mem::replace(&mut collector.windows.snapshot, Window::new(now));
        drop(collector);
        let snapshot = window.finish(
            now,
            trigger,
            settings.sampling_hz,
            settings.memory_limit_bytes,
        );
        let summary = snapshot.summary();
        let id = self.snapshots_mut().push(snapshot);
        tracing::debug!(
            id,
            stacks = summary.stacks,
            trigger = summary.trigger,
            "stack snapshot"
        );
    }

    fn sessions(&self) -> MutexGuard<'_, Sessions> {
        // Counters and slot flags stay valid whatever panicked.
        self.sessions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn try_begin_profile(
        &self,
        query: &ProfileQuery,
        requested_ns: u64,
    ) -> Result<Ticket, Refusal> {
        let settings = self.settings();
        let request = sessions::validate(
            query,
            &settings.profiles,
            settings.snapshots.offcpu_min.is_some(),
        )?;
        let ticket =
            self.sessions()
                .reserve(request, requested_ns, settings.profiles.max_sessions)?;
        // The window first, so that no drain meanwhile drops the session's counts.
        self.session_windows.start(ticket.id, SystemTime::now());
        if let Err(refusal) = self.start_in_kernel(&ticket) {
            self.session_windows.take(ticket.id);
            self.sessions().release(ticket.slot);
            return Err(refusal);
        }
        self.sessions().started(ticket.request.view);
        tracing::info!(
            service = ticket.request.service,
            pool = ticket.request.pool,
            seconds = ticket.request.duration.as_secs(),
            hz = ticket.request.hz,
            kind = sessions::kind_name(ticket.request.view),
            "profiling session started"
        );
        Ok(ticket)
    }

    fn start_in_kernel(&self, ticket: &Ticket) -> Result<(), Refusal> {
        let request = &ticket.request;
        let mut shared = self.lock();
        let service = shared
            .targets
            .service_id(&request.service)
            .ok_or_else(|| Refusal::UnknownService(request.service.clone()))?;
        let pool = match &request.pool {
            None => NO_POOL,
            Some(name) => shared
                .pools
                .views()
                .into_iter()
                .find(|view| view.service == service && view.name == *name)
                .map(|view| view.id)
                .ok_or_else(|| Refusal::UnknownPool {
                    service: request.service.clone(),
                    pool: name.clone(),
                })?,
        };
        let mut kinds = 0;
        if request.on_cpu() {
            kinds |= ProfileSession::ON_CPU;
        }
        if request.off_cpu() {
            kinds |= ProfileSession::OFF_CPU;
        }
        let session = ProfileSession {
            id: ticket.id,
            active: 1,
            service,
            pool,
            kinds,
            _pad: 0,
            start_ns: monotonic_ns(),
            first_sample_ns: 0,
        };
        shared
            .kernel
            .start_profile(ticket.slot, session, request.on_cpu().then_some(request.hz))
            .map_err(|error| Refusal::Kernel(error.to_string()))
    }

    /// Stops the session in the kernel and frees its slot; the kernel's last view
    /// of it.
    fn stop_in_kernel(&self, ticket: &Ticket) -> Result<ProfileSession, Refusal> {
        let stopped = self.lock().kernel.stop_profile(ticket.slot);
        self.sessions().release(ticket.slot);
        stopped.map_err(|error| Refusal::Kernel(error.to_string()))
    }

    fn try_end_profile(&self, ticket: &Ticket) -> Result<ProfileOutput, Refusal> {
        let stopped = self.stop_in_kernel(ticket);
        let ended = SystemTime::now();
        let window = {
            let mut collector = self.stack_collector();
            if stopped.is_ok() {
                self.drain_everything(&mut collector);
            }
            self.session_windows.take(ticket.id)
        };
        let session = stopped?;
        let window =
            window.ok_or_else(|| Refusal::Kernel("the session's window is gone".to_owned()))?;
        let request = &ticket.request;
        let started = window.started();
        let duration = ended.duration_since(started).unwrap_or_default();
        let mut comments = vec![format!(
            "poolscope: {} profile of service {:?}{}, {:.1} s at {} Hz",
            request.view.title(),
            request.service,
            request
                .pool
                .as_ref()
                .map(|pool| format!(", pool {pool:?}"))
                .unwrap_or_default(),
            duration.as_secs_f64(),
            request.hz
        )];
        if duration + Duration::from_secs(1) < request.duration {
            comments.push(format!(
                "poolscope: ended early, {} s were asked for (poolscope is stopping)",
                request.duration.as_secs()
            ));
        }
        if session.first_sample_ns > ticket.requested_ns {
            let latency = Duration::from_nanos(session.first_sample_ns - ticket.requested_ns);
            self.sessions().first_sample(latency);
            comments.push(format!(
                "poolscope: first sample {:.1} ms after the request",
                latency.as_secs_f64() * 1e3
            ));
        }
        let records = window.into_records(request.hz, u64::MAX).records;
        let records: Vec<&StackRecord> = records.iter().collect();
        let meta = ProfileMeta {
            sampling_hz: request.hz,
            started,
            duration,
            comments,
        };
        let title = format!(
            "{} stacks of {}, {} s profile at {} Hz",
            request.view.title(),
            request.service,
            request.duration.as_secs(),
            request.hz
        );
        let limit = self.settings().profiles.max_response_bytes;
        let (body, stacks_dropped) = profile::render_within(&records, limit, |records| {
            profile::render(records, request.view, &meta, request.format, &title)
        })
        .map_err(|error| Refusal::Render(error.to_string()))?;
        if stacks_dropped > 0 {
            tracing::warn!(
                service = request.service,
                stacks_dropped,
                limit,
                "profile cut to profiles.max_response_bytes: the lightest stacks are left out"
            );
        }
        Ok(ProfileOutput {
            body,
            format: request.format,
            stacks_dropped,
        })
    }

    /// The listen queues of poolscope's own network namespace (sock_diag, with their
    /// limits) and of every other namespace with watched listeners (procfs, through
    /// a process inside it: depths only). A namespace whose process is gone is left
    /// out, and a rescan finds another process in it.
    fn listen_queues(
        &self,
        namespaces: &BTreeMap<u32, u32>,
    ) -> Result<Vec<sockdiag::ListenQueue>, sockdiag::SockDiagError> {
        let mut queues = sockdiag::listen_queues()?;
        let own = procfs::network_namespace(Path::new("/proc"), "self");
        for (&netns, &pid) in namespaces {
            if Some(netns) == own {
                continue;
            }
            match procfs::listen_queues_of(&self.procfs_root, pid) {
                // The pid may have been reused by a process of another namespace.
                Ok(found)
                    if procfs::network_namespace(&self.procfs_root, &pid.to_string())
                        == Some(netns) =>
                {
                    queues.extend(found);
                }
                Ok(_) | Err(_) => {
                    tracing::debug!(netns, pid, "network namespace's process gone; rescanning");
                    self.rescan_now.notify_one();
                }
            }
        }
        Ok(queues)
    }

    /// Takes a saturation snapshot when a service's queue depth has stayed above
    /// the threshold long enough (checked every second).
    pub fn check_saturation(&self) {
        let Some((threshold, duration)) = self.settings().snapshots.saturation else {
            return;
        };
        let (backend, counters, views, owners, namespaces) = {
            let shared = self.lock();
            let ids = shared.targets.service_ids();
            let counters = match shared.kernel.read_services(&ids) {
                Ok(counters) => counters,
                Err(error) => {
                    tracing::warn!(%error, "reading service counters failed");
                    return;
                }
            };
            let watched = shared
                .kernel
                .watched_pids()
                .into_iter()
                .map(|(pid, watch)| (pid, watch.since_ns))
                .collect();
            (
                shared.kernel.backend(),
                counters,
                shared.targets.services(&watched),
                shared.targets.listener_owners().clone(),
                shared.targets.listener_namespaces().clone(),
            )
        };
        let queues = self.listen_queues(&namespaces).unwrap_or_default();
        let listeners = service_listeners(&queues, |inode| owners.get(&inode).cloned());
        let services: Vec<_> = views
            .iter()
            .filter_map(|view| Some((view, *counters.get(&view.id)?)))
            .collect();
        let depths = queue_depths(backend, &services, &listeners);
        let saturated =
            self.stack_collector()
                .saturation
                .check(&depths, threshold, duration, Instant::now());
        for service in saturated {
            tracing::info!(service, threshold, "queue depth saturated: stack snapshot");
            self.take_snapshot(Trigger::Saturation(service));
        }
    }

    /// Applies process events. An unwatched process that exec'd is checked against the
    /// rules on its own (no full scan: execs are frequent on a busy host).
    pub fn on_events(&self, events: &[ProcessEvent]) {
        let mut execs: Vec<u32> = {
            let mut shared = self.lock();
            let Shared {
                kernel,
                targets,
                pools,
                ..
            } = &mut *shared;
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
            shared.follow_watch_changes(&self.procfs_root);
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
        let processes: Vec<_> = execs
            .into_iter()
            .filter_map(|pid| procfs::read_process(&self.procfs_root, pid))
            .collect();
        let snapshot = procfs::ProcSnapshot {
            processes,
            ..Default::default()
        };
        let assignments = rules::assign(&snapshot, &settings.targets, std::process::id());
        if assignments.is_empty() {
            return;
        }
        let mut shared = self.lock();
        let Shared {
            kernel, targets, ..
        } = &mut *shared;
        for assignment in &assignments {
            targets.add(kernel, assignment);
        }
        shared.follow_watch_changes(&self.procfs_root);
    }
}

impl Gatherer for Exporter {
    fn debug_threads(&self) -> String {
        let shared = self.lock();
        let mut readout = Readout::default();
        if let Err(error) = shared.kernel.read_pools(&[], &mut readout) {
            return format!("reading threads failed: {error}\n");
        }
        let pools: BTreeMap<u32, PoolView> = shared
            .pools
            .views()
            .into_iter()
            .map(|view| (view.id, view))
            .collect();
        let mut text = String::from(
            "tid\tservice\tpool\tactivity\tserving\trunning_seconds\trunnable_seconds\twaiting_on\n",
        );
        for (tid, thread, pool) in &readout.threads {
            let (running_ns, runnable_ns) = pools::thread_times(thread, readout.threads_read_ns);
            let pool = pool.and_then(|id| pools.get(&id));
            let service = shared.targets.service_name(thread.service).unwrap_or("-");
            text.push_str(&format!(
                "{tid}\t{service}\t{}\t{:?}\t{}\t{:.9}\t{:.9}\t{}\n",
                pool.map_or("-", |p| p.name.as_str()),
                Activity::from_u32(thread.activity),
                thread.serving,
                running_ns as f64 / 1e9,
                runnable_ns as f64 / 1e9,
                if thread.downstream == Peer::NONE {
                    "-".to_owned()
                } else {
                    peer_label(&thread.downstream)
                },
            ));
        }
        text
    }

    fn debug_locks(&self, query: &LocksQuery) -> Result<String, DebugError> {
        let mut locks = {
            let shared = self.lock();
            let service = shared
                .targets
                .service_id(&query.service)
                .ok_or_else(|| DebugError::UnknownService(query.service.clone()))?;
            let pids: HashSet<u32> = shared
                .kernel
                .watched_pids()
                .into_iter()
                .filter(|(_, watch)| watch.service == service)
                .map(|(pid, _)| pid)
                .collect();
            let mut locks = top_locks(
                &shared.kernel.locks(),
                |pid| pids.contains(&pid),
                query.limit,
            );
            locks::read_stacks(&shared.kernel, &mut locks);
            locks
        };
        // Outside the lock: symbolization reads binaries and their debug info.
        self.symbolize(|symbols| locks::symbolize(symbols, &mut locks));
        Ok(match query.format {
            LocksFormat::Text => locks::render_text(&query.service, &locks),
            LocksFormat::Json => locks::render_json(&query.service, &locks),
        })
    }

    fn debug_snapshots(&self) -> String {
        #[derive(serde::Serialize)]
        struct Body {
            snapshots: Vec<crate::stacks::snapshots::SnapshotSummary>,
        }
        let snapshots = self
            .snapshots
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .summaries();
        serde_json::to_string_pretty(&Body { snapshots })
            .map(|mut json| {
                json.push('\n');
                json
            })
            .unwrap_or_else(|error| format!("{{\"error\": \"{error}\"}}\n"))
    }

    fn debug_stacks(&self, view: View, query: &StacksQuery) -> Result<Vec<u8>, DebugError> {
        let snapshot = self
            .snapshots
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(query.snapshot)
            .ok_or(DebugError::NoSnapshot(query.snapshot))?;
        let records = snapshot.records(query.service.as_deref(), query.pool.as_deref());
        let title = format!(
            "{} stacks of {}, snapshot {}",
            view.title(),
            query.service.as_deref().unwrap_or("every service"),
            snapshot.id
        );
        Ok(profile::render(
            &records,
            view,
            &snapshot.meta(),
            query.format,
            &title,
        )?)
    }

    fn begin_profile(&self, query: &ProfileQuery, requested_ns: u64) -> Result<Ticket, Refusal> {
        let started = self.try_begin_profile(query, requested_ns);
        if let Err(refusal) = &started {
            self.sessions().refused(refusal);
        }
        started
    }

    fn end_profile(&self, ticket: Ticket) -> Result<ProfileOutput, Refusal> {
        let output = self.try_end_profile(&ticket);
        if let Err(refusal) = &output {
            tracing::warn!(%refusal, service = ticket.request.service, "profiling session failed");
            self.sessions().refused(refusal);
        }
        output
    }

    fn stopping(&self) -> tokio::sync::watch::Receiver<bool> {
        self.stopping.subscribe()
    }

    fn health(&self) -> String {
        let tracker = self.health_tracker();
        tracker.last().report(tracker.degraded_for())
    }

    fn cancel_profile(&self, ticket: Ticket) {
        if let Err(refusal) = self.stop_in_kernel(&ticket) {
            tracing::warn!(%refusal, "ending a profiling session failed");
        }
        self.session_windows.take(ticket.id);
    }

    fn gather(&self) -> Vec<Family> {
        let settings = self.settings();
        let mut collectors = Vec::new();

        let started = Instant::now();
        let (
            services,
            kernel,
            windows,
            owners,
            namespaces,
            backend,
            shared_losses,
            lock_probe_processes,
            pool_rows,
        ) = {
            let mut shared = self.lock();
            let kernel = shared
                .kernel
                .read(&shared.targets.service_ids(), &shared.pools.ids());
            if let Err(error) = &kernel {
                tracing::warn!(%error, "reading kernel maps failed");
            }
            let no_watch_table = BTreeMap::new();
            let watched = kernel.as_ref().map_or(&no_watch_table, |k| &k.watched);
            let services = shared.targets.services(watched);
            let now = Instant::now();
            let mut windows = BTreeMap::new();
            if let Ok(kernel) = &kernel {
                for (service, times) in &kernel.request_times {
                    windows.insert(*service, shared.windows.delta(*service, now, times));
                }
                let live: Vec<u32> = kernel.request_times.keys().copied().collect();
                shared.windows.retain(&live);
            }
            let mut pool_totals = kernel.as_ref().map(pools::totals).unwrap_or_default();
            let pool_rows: Vec<_> = shared
                .pools
                .views()
                .into_iter()
                .filter_map(|view| {
                    let totals = pool_totals.remove(&view.id)?;
                    let utilization = shared.pools.utilization(view.id, &totals);
                    Some((view, totals, utilization))
                })
                .collect();
            // Series dropped by this scrape are added below, once capped.
            let losses = shared.losses(
                kernel.as_ref().map_or(&[], |k| k.losses.as_slice()),
                0,
                *self.unsymbolized_total(),
                &self.probes,
            );
            (
                services,
                kernel.ok(),
                windows,
                shared.targets.listener_owners().clone(),
                shared.targets.listener_namespaces().clone(),
                shared.kernel.backend(),
                losses,
                shared.lock_probes.processes(),
                pool_rows,
            )
        };
        collectors.push(("kernel", started.elapsed().as_secs_f64(), kernel.is_some()));

        let started = Instant::now();
        let queues = self.listen_queues(&namespaces);
        if let Err(error) = &queues {
            tracing::warn!(%error, "reading listen queues failed");
        }
        collectors.push((
            "listen_queues",
            started.elapsed().as_secs_f64(),
            queues.is_ok(),
        ));
        // A socket that began listening after the last scan: find its owner now rather
        // than at the next periodic rescan.
        if let Ok(queues) = &queues {
            let shared = self.lock();
            if queues
                .iter()
                .any(|q| !shared.targets.knows_listen_socket(q.inode))
            {
                self.rescan_now.notify_one();
            }
        }
        let listeners = service_listeners(queues.as_deref().unwrap_or_default(), |inode| {
            owners.get(&inode).cloned()
        });

        // A failed read still yields the per-service families, at zero.
        let no_readout = Readout::default();
        let readout = kernel.as_ref().unwrap_or(&no_readout);
        let no_counters = Default::default();
        let no_times = Default::default();
        let mut components: BTreeMap<u32, [u64; COMPONENTS.len()]> = BTreeMap::new();
        for (view, totals, _) in &pool_rows {
            let sums = components.entry(view.service).or_default();
            for (sum, (_, activities)) in sums.iter_mut().zip(COMPONENTS) {
                *sum += sum_of(&totals.request_ns, activities);
            }
        }
        let inputs: Vec<ServiceInput<'_>> = services
            .iter()
            .map(|view| ServiceInput {
                view,
                counters: readout.services.get(&view.id).unwrap_or(&no_counters),
                times: readout.request_times.get(&view.id).unwrap_or(&no_times),
                window: windows.get(&view.id).unwrap_or(&no_times),
                components: components.get(&view.id).copied().unwrap_or_default(),
            })
            .collect();
        let mut families = service_families(backend, &inputs, &readout.syscalls, &listeners);
        let service_names: BTreeMap<u32, &str> = services
            .iter()
            .map(|view| (view.id, view.name.as_str()))
            .collect();
        let pool_inputs: Vec<PoolInput<'_>> = pool_rows
            .iter()
            .filter_map(|(view, totals, utilization)| {
                Some(PoolInput {
                    service: service_names.get(&view.service)?,
                    pool: &view.name,
                    totals,
                    utilization: *utilization,
                })
            })
            .collect();
        families.extend(pool_families(&pool_inputs));
        let pool_names: BTreeMap<u32, (&str, &str)> = pool_rows
            .iter()
            .filter_map(|(view, _, _)| {
                Some((
                    view.id,
                    (*service_names.get(&view.service)?, view.name.as_str()),
                ))
            })
            .collect();
        families.extend(downstream_families(&readout.downstreams, |pool| {
            pool_names.get(&pool).copied()
        }));
        let dropped = cap_series(&mut families, settings.max_series);
        let series_dropped = self.series_dropped.fetch_add(dropped, Ordering::Relaxed) + dropped;
        let mut losses = shared_losses;
        for loss in &mut losses {
            if loss.kind == LossKind::SeriesDropped {
                loss.value = series_dropped;
            }
        }
        // With the series this scrape dropped; without the kernel's counters a rise
        // would be misread, so the last health stands.
        let degraded = match &kernel {
            Some(_) => self.health_tracker().observe(Instant::now(), &losses),
            None => self.health_tracker().last().clone(),
        }
        .degraded();
        let stats = SelfStats {
            version: env!("CARGO_PKG_VERSION"),
            backend: backend.name(),
            losses,
            degraded,
            lock_probe_processes,
            collectors,
            reload: *self.reload_status(),
        };
        families.extend(self_families(&stats, &self.probes, kernel.as_ref()));
        families.extend(self.sessions().families());
        families
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
