//! The running exporter: the kernel, the watched set and the current settings behind
//! one lock, with the three things that touch them: a rescan, a process event, and a
//! scrape (`Gatherer`). Scans and netlink reads happen outside the lock.
use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{
        Arc, Mutex, MutexGuard, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use poolscope_shared::ProcessEvent;
use tokio::sync::Notify;

use crate::{
    collect::{SelfStats, ServiceInput, self_families, service_families, service_listeners},
    config::Settings,
    discovery,
    encode::{Family, cap_series},
    kernel::{Kernel, Probe, Readout},
    procfs, sockdiag,
    targets::{Targets, monotonic_ns},
    web::Gatherer,
    window::Windows,
};

/// Length of the quantile window of the `_window` summaries (DESIGN §4).
const QUANTILE_WINDOW: Duration = Duration::from_secs(60);

struct Shared {
    kernel: Kernel,
    targets: Targets,
    windows: Windows,
}

pub struct Exporter {
    shared: Mutex<Shared>,
    settings: RwLock<Arc<Settings>>,
    probes: Vec<Probe>,
    series_dropped: AtomicU64,
    /// Wakes the rescan loop before its next tick.
    rescan_now: Arc<Notify>,
    /// Fixed at start (a reload does not move it).
    procfs_root: PathBuf,
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
        let procfs_root = settings.procfs_root.clone();
        let targets = Targets::new(procfs_root.clone(), settings.max_services);
        Self {
            shared: Mutex::new(Shared {
                kernel,
                targets,
                windows: Windows::new(QUANTILE_WINDOW),
            }),
            settings: RwLock::new(Arc::new(settings)),
            probes,
            series_dropped: AtomicU64::new(0),
            rescan_now: Arc::new(Notify::new()),
            procfs_root,
        }
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
        let mut current = self.settings.write().unwrap_or_else(|p| p.into_inner());
        *current = Arc::new(settings);
    }

    /// Scans procfs and makes the watched set match the target rules.
    pub fn rescan(&self) -> Result<(), ScanError> {
        let settings = self.settings();
        let started_ns = monotonic_ns();
        let snapshot = procfs::scan(&self.procfs_root).map_err(|source| ScanError::Procfs {
            root: self.procfs_root.display().to_string(),
            source,
        })?;
        let assignments = discovery::assign(&snapshot, &settings.targets, std::process::id());
        let mut shared = self.lock();
        let Shared {
            kernel, targets, ..
        } = &mut *shared;
        targets.apply(kernel, &snapshot, &assignments, started_ns);
        Ok(())
    }

    /// Applies process events. An unwatched process that exec'd is checked against the
    /// rules on its own (no full scan: execs are frequent on a busy host).
    pub fn on_events(&self, events: &[ProcessEvent]) {
        let mut execs: Vec<u32> = {
            let mut shared = self.lock();
            let Shared {
                kernel, targets, ..
            } = &mut *shared;
            events
                .iter()
                .filter_map(|event| targets.on_event(kernel, event))
                .collect()
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
        let assignments = discovery::assign(&snapshot, &settings.targets, std::process::id());
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
    }
}

impl Gatherer for Exporter {
    fn gather(&self) -> Vec<Family> {
        let settings = self.settings();
        let mut collectors = Vec::new();

        let started = Instant::now();
        let (services, kernel, windows, owners, backend, targets_stats) = {
            let mut shared = self.lock();
            let kernel = shared.kernel.read(&shared.targets.service_ids());
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
            (
                services,
                kernel.ok(),
                windows,
                shared.targets.listener_owners().clone(),
                shared.kernel.backend(),
                (
                    shared.targets.services_refused,
                    shared.targets.watch_errors,
                    shared.targets.listen_port_errors,
                ),
            )
        };
        collectors.push(("kernel", started.elapsed().as_secs_f64(), kernel.is_some()));

        let started = Instant::now();
        let queues = sockdiag::listen_queues();
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
        let inputs: Vec<ServiceInput<'_>> = services
            .iter()
            .map(|view| ServiceInput {
                view,
                counters: readout.services.get(&view.id).unwrap_or(&no_counters),
                times: readout.request_times.get(&view.id).unwrap_or(&no_times),
                window: windows.get(&view.id).unwrap_or(&no_times),
            })
            .collect();
        let mut families = service_families(backend, &inputs, &readout.syscalls, &listeners);
        let dropped = cap_series(&mut families, settings.max_series);
        let series_dropped = self.series_dropped.fetch_add(dropped, Ordering::Relaxed) + dropped;
        let (services_refused, watch_errors, listen_port_errors) = targets_stats;
        let stats = SelfStats {
            version: env!("CARGO_PKG_VERSION"),
            backend: backend.name(),
            series_dropped,
            services_refused,
            watch_errors,
            listen_port_errors,
            collectors,
        };
        families.extend(self_families(&stats, &self.probes, kernel.as_ref()));
        families
    }
}
