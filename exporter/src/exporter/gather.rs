//! A scrape: one consistent read of the kernel and the watched set under the core
//! lock, the listen queues outside it, then the collectors, the series cap and
//! poolscope's own families. Also the saturation check, which reads the same
//! queues.
use std::{
    collections::BTreeMap,
    io,
    path::Path,
    sync::{
        OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Instant,
};

use poolscope_shared::ServiceCounters;

use super::{Exporter, lock_or_recover};
use crate::{
    collectors::{
        self, OwnReading, PoolRow, Reading, Timings,
        own::SelfStats,
        services::{queue_depths, service_listeners},
    },
    config::MetricsSettings,
    discovery::held,
    discovery::pools::PoolView,
    discovery::procfs,
    discovery::sockdiag,
    discovery::targets::{NamespaceListeners, ServiceView},
    encode::{Exposition, Family, cap_series},
    idmap::IdMap,
    kernel::{Backend, PoolWaits, Readout, WatchTable},
    metrics::capacity,
    metrics::health::{Loss, LossKind},
    metrics::pools,
    metrics::recount::RecountStats,
    metrics::window::WindowDelta,
    scrape_counts::ScrapeCounts,
    stacks::snapshots::Trigger,
};

/// Set once a held listener could not be read (logged at warn once).
static HELD_UNREADABLE_WARNED: AtomicBool = AtomicBool::new(false);

/// The value `cell` holds, or what `read` gives, kept: a failed read is tried again
/// next time.
fn read_once<T: Copy>(cell: &OnceLock<T>, read: impl FnOnce() -> Option<T>) -> Option<T> {
    if let Some(value) = cell.get() {
        return Some(*value);
    }
    let value = read()?;
    Some(*cell.get_or_init(|| value))
}

/// What a scrape reads under the core lock.
struct Locked {
    kernel: Option<Readout>,
    services: Vec<ServiceView>,
    windows: BTreeMap<u32, WindowDelta>,
    pools: Vec<PoolRow>,
    owners: std::collections::HashMap<u64, String>,
    namespaces: BTreeMap<u32, NamespaceListeners>,
    backend: Backend,
    /// Every loss counter, without the series this scrape drops.
    losses: Vec<Loss>,
    lock_probe_processes: usize,
    recount: RecountStats,
}

impl Exporter {
    /// `waits`: how much of the pools' waits the scrape exports.
    fn read_locked(&self, waits: PoolWaits) -> Locked {
        let mut core = lock_or_recover(&self.core);
        let core = &mut *core;
        let kernel = core
            .kernel
            .read(&core.targets.service_ids(), &core.pools.ids(), waits);
        if let Err(error) = &kernel {
            tracing::warn!(%error, "reading kernel maps failed");
        }
        let mut kernel = kernel.ok();
        let no_watch_table = BTreeMap::new();
        let watched = kernel.as_ref().map_or(&no_watch_table, |k| &k.watched);
        let services = core.targets.services(watched);
        let now = Instant::now();
        let mut windows = BTreeMap::new();
        if let Some(kernel) = &kernel {
            for (service, times) in &kernel.request_times {
                if let Some(delta) = core.windows.delta(*service, now, times) {
                    windows.insert(*service, delta);
                }
            }
            let live: Vec<u32> = kernel.request_times.keys().copied().collect();
            core.windows.retain(&live);
        }
        let pool_totals = kernel.as_ref().map(pools::totals).unwrap_or_default();
        // Nothing after the totals reads the threads.
        if let Some(readout) = &mut kernel {
            core.kernel
                .give_back_threads(std::mem::take(&mut readout.threads));
        }
        let mut views: IdMap<u32, PoolView> = core
            .pools
            .views()
            .into_iter()
            .map(|view| (view.id, view))
            .collect();
        // Consumed in order: each total is kilobytes, which removing keys one by one
        // would shift around the tree's nodes.
        let mut windows_of_pools = Vec::with_capacity(pool_totals.len());
        let mut pools: Vec<PoolRow> = pool_totals
            .into_iter()
            .filter_map(|(id, totals)| {
                let view = views.remove(&id)?;
                let window = core.pool_windows.window(id, &totals, now);
                if let Some(window) = window {
                    windows_of_pools.push(capacity::PoolInput {
                        pool: id,
                        service: view.service,
                        window,
                        threads_served: totals.threads_served,
                    });
                }
                Some(PoolRow {
                    view,
                    totals,
                    utilization: window.and_then(|window| window.utilization()),
                    capacity: None,
                })
            })
            .collect();
        let finished: BTreeMap<u32, capacity::Finished> = kernel
            .iter()
            .flat_map(|readout| &readout.services)
            .filter_map(|(&service, counters)| {
                let finished = core
                    .throughput
                    .finished(service, counters.finished.get(), now)?;
                Some((service, finished))
            })
            .collect();
        let cpu_limits = lock_or_recover(&self.cpu_limits);
        let capacities = capacity::capacities(&windows_of_pools, &finished, |service| {
            cpu_limits.get(service)
        });
        drop(cpu_limits);
        for row in &mut pools {
            row.capacity = capacities.get(&row.view.id).copied();
        }
        // Series dropped by this scrape are added once capped.
        let losses = self
            .health
            .losses(core, kernel.as_ref().map_or(&[], |k| k.losses.as_slice()));
        Locked {
            services,
            windows,
            pools,
            owners: core.targets.listener_owners().clone(),
            namespaces: core.targets.listener_namespaces().clone(),
            backend: core.kernel.backend(),
            losses,
            lock_probe_processes: core.lock_probes.processes(),
            recount: core.recount.stats,
            kernel,
        }
    }

    /// The listen queues of poolscope's own network namespace (sock_diag) and of
    /// every other namespace with watched listeners: each listener through a copy of
    /// the fd its process holds it at (`held`), or where that fails, the namespace's
    /// tables through a process inside it (procfs: depths only, and milliseconds per
    /// namespace). A namespace whose process is gone is left out, and a rescan finds
    /// another process in it.
    fn listen_queues(
        &self,
        namespaces: &BTreeMap<u32, NamespaceListeners>,
    ) -> Result<Vec<sockdiag::ListenQueue>, sockdiag::SockDiagError> {
        let mut queues = sockdiag::listen_queues()?;
        let own = self.own_network_namespace();
        for (&netns, listeners) in namespaces {
            if Some(netns) == own {
                continue;
            }
            if !listeners.held.is_empty()
                && self.procfs_is_the_kernels()
                && held::copies_leave_sockets_unchanged()
            {
                match listeners
                    .held
                    .iter()
                    .map(held::listen_queue)
                    .collect::<io::Result<Vec<_>>>()
                {
                    Ok(found) => {
                        queues.extend(found);
                        continue;
                    }
                    // Once at warn: a refusal (no pidfd_getfd, a security module)
                    // lasts, and each scrape then reads the tables.
                    Err(error) if !HELD_UNREADABLE_WARNED.swap(true, Ordering::Relaxed) => {
                        tracing::warn!(netns, %error, "a pod's listener cannot be read through its fd; reading its network namespace's net/tcp instead (milliseconds per scrape)");
                    }
                    Err(error) => {
                        tracing::debug!(netns, %error, "held listener unreadable; reading the namespace's tables");
                    }
                }
            }
            let pid = listeners.pid;
            self.namespace_tables_read.fetch_add(1, Ordering::Relaxed);
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

    /// poolscope's network namespace, read once (unreadable so far: tried again at
    /// the next scrape).
    pub(super) fn own_network_namespace(&self) -> Option<u32> {
        read_once(&self.own_network_namespace, || {
            procfs::network_namespace(Path::new("/proc"), "self")
        })
    }

    /// The system's procfs units, read once (a procfs unreadable so far is tried
    /// again at the next scrape).
    fn procfs_units(&self) -> Option<procfs::ProcfsUnits> {
        read_once(&self.procfs_units, || {
            procfs::ProcfsUnits::read(&self.procfs_root)
        })
    }

    /// Every family of a scrape to be written in `exposition`; `web`: the web
    /// server's counts.
    pub(super) fn gather_families(
        &self,
        exposition: Exposition,
        web: &ScrapeCounts,
    ) -> Vec<Family> {
        let settings = self.settings();
        // Native buckets only where they are written: a text scrape skips mapping
        // every request and wait histogram onto the native schema.
        let metrics = MetricsSettings {
            native_histograms: settings.metrics.native_histograms
                && exposition == Exposition::Protobuf,
            ..settings.metrics
        };
        let mut timings = Timings::default();
        let locked = timings.time("kernel", || {
            let waits = if metrics.pool_histogram_buckets {
                PoolWaits::WithRunqueueHistograms
            } else {
                PoolWaits::Totals
            };
            let locked = self.read_locked(waits);
            let read = locked.kernel.is_some();
            (locked, read)
        });
        let queues = timings.time("listen_queues", || {
            let queues = self.listen_queues(&locked.namespaces);
            if let Err(error) = &queues {
                tracing::warn!(%error, "reading listen queues failed");
            }
            let read = queues.is_ok();
            (queues.ok(), read)
        });
        // A socket that began listening after the last scan: find its owner now rather
        // than at the next periodic rescan.
        if let Some(queues) = &queues {
            let core = lock_or_recover(&self.core);
            if queues
                .iter()
                .any(|q| !core.targets.knows_listen_socket(q.inode))
            {
                self.rescan_now.notify_one();
            }
        }
        let listeners = queues
            .as_ref()
            .map(|queues| service_listeners(queues, |inode| locked.owners.get(&inode).cloned()));
        let reading = Reading {
            backend: locked.backend,
            kernel: locked.kernel.as_ref(),
            services: &locked.services,
            windows: &locked.windows,
            pools: &locked.pools,
            listeners: listeners.as_deref(),
            metrics,
        };
        let mut families = collectors::collect_services(&reading, &mut timings);
        let dropped = cap_series(&mut families, settings.max_series);
        let series_dropped = self.health.series_dropped(dropped);
        let mut losses = locked.losses;
        for loss in &mut losses {
            if loss.kind == LossKind::SeriesDropped {
                loss.value = series_dropped;
            }
        }
        // With the series this scrape dropped; without the kernel's counters a rise
        // would be misread, so the last health stands.
        let degraded = match &locked.kernel {
            Some(_) => self.health.observe(&losses),
            None => self.health.last(),
        }
        .degraded();
        let (pod_log_listings, pod_log_failures) = {
            let pod_logs = lock_or_recover(&self.pod_logs);
            (pod_logs.listings, pod_logs.failures)
        };
        let stats = SelfStats {
            version: env!("CARGO_PKG_VERSION"),
            revision: crate::revision::REVISION,
            backend: locked.backend.name(),
            losses,
            degraded,
            lock_probe_processes: locked.lock_probe_processes,
            namespace_tables_read: self.namespace_tables_read.load(Ordering::Relaxed),
            process_fds_read: self.process_fds_read.load(Ordering::Relaxed),
            pod_log_listings,
            pod_log_failures,
            reload: *lock_or_recover(&self.reload_status),
            recount: locked.recount,
        };
        let own = OwnReading {
            stats: &stats,
            probes: self.health.probes(),
            kernel: locked.kernel.as_ref(),
            profiles: &self.profiles.counts(),
            unwinds: &self.stacks.unwind_stats(),
            procfs_root: &self.procfs_root,
            procfs_units: self.procfs_units(),
            web_server: web,
        };
        families.extend(collectors::collect_own(&own, &mut timings));
        families
    }

    /// Takes a saturation snapshot when a service's queue depth has stayed above
    /// the threshold long enough (checked every second, on the services' `counters`
    /// the pools' sample read).
    pub fn check_saturation(&self, counters: &BTreeMap<u32, ServiceCounters>) {
        let settings = self.settings();
        let Some((threshold, duration)) = settings.snapshots.saturation else {
            return;
        };
        let (backend, views, owners, namespaces) = {
            let core = lock_or_recover(&self.core);
            let watched = core
                .kernel
                .watched_pids()
                .into_iter()
                .map(|(pid, watch)| (pid, watch.since_ns))
                .collect();
            (
                core.kernel.backend(),
                core.targets.services(&watched),
                core.targets.listener_owners().clone(),
                core.targets.listener_namespaces().clone(),
            )
        };
        let queues = self.listen_queues(&namespaces).unwrap_or_default();
        let listeners = service_listeners(&queues, |inode| owners.get(&inode).cloned());
        let services: Vec<_> = views
            .iter()
            .filter_map(|view| Some((view, *counters.get(&view.id)?)))
            .collect();
        let depths = queue_depths(backend, &services, &listeners);
        for service in self.stacks.saturated(&depths, threshold, duration) {
            tracing::info!(service, threshold, "queue depth saturated: stack snapshot");
            self.stacks.take_snapshot(
                Trigger::Saturation(service),
                &settings,
                &self.core,
                &self.health,
            );
        }
    }
}
