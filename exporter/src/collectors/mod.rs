//! From one scrape's reading to metric families. One collector per concern, each
//! naming its own families, run from one list ([`COLLECTORS`]) that times each one
//! and says whether the reading it needed was whole
//! (`poolscope_scrape_duration_seconds`, `poolscope_scrape_collector_success`).
//! Functions of the reading: what to read, and under which lock, is the exporter's
//! business (only `process` reads, poolscope's own `/proc/self`).
pub mod downstream;
pub mod own;
pub mod pools;
pub mod process;
pub mod profiles;
pub mod routes;
pub mod services;
pub mod stacks;
pub mod web_server;

use std::{collections::BTreeMap, path::Path, time::Instant};

use crate::{
    config::MetricsSettings,
    discovery::pools::PoolView,
    discovery::procfs::ProcfsUnits,
    discovery::targets::ServiceView,
    encode::Family,
    kernel::{Backend, Probe, Readout},
    metrics::capacity::Capacity,
    metrics::pools::PoolTotals,
    metrics::window::WindowDelta,
    scrape_counts::ScrapeCounts,
    stacks::{sessions::SessionCounts, unwind::UnwindStats},
};

/// One pool at scrape time: its totals, its busy share over the utilization window
/// (`None` before there is a window) and its capacity (`None` while the window says
/// too little).
#[derive(Clone, Debug)]
pub struct PoolRow {
    pub view: PoolView,
    pub totals: PoolTotals,
    pub utilization: Option<f64>,
    pub capacity: Option<Capacity>,
}

/// What one scrape read.
pub struct Reading<'a> {
    pub backend: Backend,
    /// The kernel's counters; `None` if reading them failed (the per-service
    /// families are then exported at zero).
    pub kernel: Option<&'a Readout>,
    pub services: &'a [ServiceView],
    /// The request times over the quantile window of each service that finished
    /// a request in it.
    pub windows: &'a BTreeMap<u32, WindowDelta>,
    pub pools: &'a [PoolRow],
    /// The listen queues of the services; `None` if reading them failed.
    pub listeners: Option<&'a [services::ServiceListener]>,
    /// How histograms are exposed.
    pub metrics: MetricsSettings,
}

impl Reading<'_> {
    /// The service and pool names of each pool id.
    fn pool_names(&self) -> BTreeMap<u32, (&str, &str)> {
        let service_names: BTreeMap<u32, &str> = self
            .services
            .iter()
            .map(|view| (view.id, view.name.as_str()))
            .collect();
        self.pools
            .iter()
            .filter_map(|row| {
                Some((
                    row.view.id,
                    (
                        *service_names.get(&row.view.service)?,
                        row.view.name.as_str(),
                    ),
                ))
            })
            .collect()
    }
}

/// A collector's families, and whether the reading it needed was whole.
pub struct Collected {
    pub families: Vec<Family>,
    pub whole: bool,
}

/// What a scrape knows of poolscope itself, read after the series cap: these
/// families never count against it, so a full cap cannot hide what it dropped.
pub struct OwnReading<'a> {
    pub stats: &'a own::SelfStats,
    pub probes: &'a [Probe],
    /// The kernel's counters (program runs, map fill); `None` if reading them failed.
    pub kernel: Option<&'a Readout>,
    pub profiles: &'a SessionCounts,
    pub unwinds: &'a UnwindStats,
    /// Where procfs is mounted, and its units (`None` if unreadable so far).
    pub procfs_root: &'a Path,
    pub procfs_units: Option<ProcfsUnits>,
    pub web_server: &'a ScrapeCounts,
}

/// A collector: the families of one concern.
#[derive(Clone, Copy)]
pub enum Collector {
    /// Per service and pool, from a scrape's reading; the series cap applies.
    Services(fn(&Reading<'_>) -> Collected),
    /// poolscope's own, after the cap; given the steps timed before it.
    Own(fn(&OwnReading<'_>, &Timings) -> Collected),
}

/// Every source of metric families, in exposition order: first the per-service
/// ones, which the series cap applies to, then poolscope's own. `own` is last, as it
/// reports the time and success of every step and collector before it.
pub const COLLECTORS: [(&str, Collector); 9] = [
    ("services", Collector::Services(services::collect)),
    ("routes", Collector::Services(routes::collect)),
    ("pools", Collector::Services(pools::collect)),
    ("downstream", Collector::Services(downstream::collect)),
    ("profiles", Collector::Own(profiles::collect)),
    ("stacks", Collector::Own(stacks::collect)),
    ("process", Collector::Own(process::collect)),
    ("web_server", Collector::Own(web_server::collect)),
    ("own", Collector::Own(own::collect)),
];

/// Each step of a scrape: (collector, seconds, success).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings(pub Vec<(&'static str, f64, bool)>);

impl Timings {
    /// Runs `step` (which says whether it succeeded) and records it as `name`.
    pub fn time<T>(&mut self, name: &'static str, step: impl FnOnce() -> (T, bool)) -> T {
        let started = Instant::now();
        let (result, success) = step();
        self.record(name, started, success);
        result
    }

    /// Records the step `name` that began at `started` and just ended.
    fn record(&mut self, name: &'static str, started: Instant, success: bool) {
        self.0
            .push((name, started.elapsed().as_secs_f64(), success));
    }
}

/// Runs every per-service collector of [`COLLECTORS`] on `reading`.
pub fn collect_services(reading: &Reading<'_>, timings: &mut Timings) -> Vec<Family> {
    let mut families = Vec::new();
    for (name, collector) in COLLECTORS {
        if let Collector::Services(collect) = collector {
            families.extend(timings.time(name, || {
                let collected = collect(reading);
                (collected.families, collected.whole)
            }));
        }
    }
    families
}

/// Runs every collector of poolscope's own families of [`COLLECTORS`] on `own`.
pub fn collect_own(own: &OwnReading<'_>, timings: &mut Timings) -> Vec<Family> {
    let mut families = Vec::new();
    for (name, collector) in COLLECTORS {
        if let Collector::Own(collect) = collector {
            let started = Instant::now();
            // Not `time`: the collector reads the timings recorded so far.
            let collected = collect(own, timings);
            timings.record(name, started, collected.whole);
            families.extend(collected.families);
        }
    }
    families
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use poolscope_shared::{
        DownstreamKey, DownstreamWait, Histogram, Peer, RequestTimes, ServiceCounters,
    };

    use super::*;
    use crate::{
        discovery::targets::Corrections,
        encode::{Format, render},
        metrics::window::Windows,
    };

    fn outcome(timings: &Timings) -> Vec<(&'static str, bool)> {
        timings.0.iter().map(|&(name, _, ok)| (name, ok)).collect()
    }

    #[test]
    fn every_collector_reports_and_a_failed_read_exports_zeros_without_success() {
        let services = [ServiceView {
            id: 2,
            name: "api".into(),
            processes: 1,
            http2_worker_threads: None,
            workload: None,
            corrections: Corrections::default(),
        }];
        let pools = [PoolRow {
            view: PoolView {
                id: 5,
                service: 2,
                name: "worker".into(),
            },
            totals: PoolTotals::default(),
            utilization: Some(0.25),
            capacity: None,
        }];
        let mut readout = Readout::default();
        readout.services.insert(
            2,
            ServiceCounters {
                accepted: poolscope_shared::Count::new(7),
                ..ServiceCounters::default()
            },
        );
        let mut peer = Peer {
            port: 5432,
            family: Peer::AF_INET,
            ..Peer::NONE
        };
        peer.addr[..4].copy_from_slice(&[10, 0, 0, 5]);
        readout.downstreams.push((
            DownstreamKey { pool: 5, peer },
            DownstreamWait {
                wait_ns: 2_000_000_000,
                waits: 4,
            },
        ));
        let mut routes = crate::kernel::RouteTable::new(crate::kernel::RouteCaps {
            per_service: 50,
            total: 50,
        });
        routes.add(&poolscope_shared::RouteEvent::request(
            2,
            503,
            b"GET /users/42 HTTP/1.1",
            0,
            1_000_000,
        ));
        readout.routes.insert(
            2,
            crate::kernel::RoutesRead {
                routes: routes.service(2),
                h2_lost: BTreeMap::new(),
            },
        );
        let windows = BTreeMap::new();
        let mut reading = Reading {
            backend: Backend::Syscall,
            kernel: Some(&readout),
            services: &services,
            windows: &windows,
            pools: &pools,
            listeners: Some(&[]),
            metrics: MetricsSettings::default(),
        };
        let mut timings = Timings::default();
        let text = render(&collect_services(&reading, &mut timings), Format::Text);
        assert_eq!(
            outcome(&timings),
            [
                ("services", true),
                ("routes", true),
                ("pools", true),
                ("downstream", true)
            ]
        );
        for line in [
            "poolscope_connections_accepted_total{service=\"api\"} 7\n",
            "poolscope_pool_utilization_ratio{service=\"api\",pool=\"worker\"} 0.25\n",
            "poolscope_route_requests_total{service=\"api\",route=\"/users/:id\",method=\"GET\",\
             status_class=\"5xx\"} 1\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert!(
            text.contains(
                "poolscope_downstream_wait_seconds_total{service=\"api\",pool=\"worker\",peer=\"10.0.0.5:5432\"} 2\n"
            ),
            "no downstream wait in\n{text}"
        );

        // Without the kernel's counters the service is still there, at zero, and
        // the collectors say their input was not whole.
        reading.kernel = None;
        reading.pools = &[];
        let mut timings = Timings::default();
        let text = render(&collect_services(&reading, &mut timings), Format::Text);
        assert_eq!(
            outcome(&timings),
            [
                ("services", false),
                ("routes", false),
                ("pools", false),
                ("downstream", false)
            ]
        );
        assert!(
            text.contains("poolscope_connections_accepted_total{service=\"api\"} 0\n"),
            "{text}"
        );
    }

    #[test]
    fn own_collectors_run_after_the_cap_and_own_reports_every_one_before_it() {
        let stats = own::SelfStats::default();
        let missing_procfs = Path::new("/nonexistent/proc");
        let reading = OwnReading {
            stats: &stats,
            probes: &[],
            kernel: None,
            profiles: &SessionCounts::default(),
            unwinds: &UnwindStats::default(),
            procfs_root: missing_procfs,
            procfs_units: None,
            web_server: &ScrapeCounts {
                refused_busy: 3,
                ..ScrapeCounts::default()
            },
        };
        let mut timings = Timings::default();
        timings.time("kernel", || ((), true));
        let text = render(&collect_own(&reading, &mut timings), Format::Text);
        // `own` is timed after it rendered, so its own line is not in this scrape.
        assert_eq!(
            outcome(&timings),
            [
                ("kernel", true),
                ("profiles", true),
                ("stacks", true),
                ("process", false),
                ("web_server", true),
                ("own", true),
            ]
        );
        for line in [
            "poolscope_scrapes_refused_total{reason=\"concurrency\"} 3\n",
            "poolscope_profile_sessions_active 0\n",
            "poolscope_unwind_tables_bytes 0\n",
            "poolscope_scrape_collector_success{collector=\"kernel\"} 1\n",
            "poolscope_scrape_collector_success{collector=\"process\"} 0\n",
            "poolscope_scrape_collector_success{collector=\"web_server\"} 1\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert!(!text.contains("collector=\"own\""), "{text}");
        assert!(!text.contains("process_cpu_seconds"), "{text}");
        // The services' collectors are not among these.
        assert!(!text.contains("collector=\"services\""), "{text}");
    }

    /// Series of each service in an exposition, by the `service` label.
    fn series_of(text: &str, service: &str) -> usize {
        let label = format!("service=\"{service}\"");
        text.lines()
            .filter(|line| !line.starts_with('#') && line.contains(&label))
            .count()
    }

    /// A service of the named pools, listening on one socket, as the series budget
    /// counts it: idle (nothing ever served, every thread waiting for work), or busy
    /// (requests in the window, every kind of wait, futex lock waits in each pool, a
    /// capacity for each pool).
    fn service_of_pools(
        names: &[&str],
        busy: bool,
    ) -> (Readout, Vec<PoolRow>, BTreeMap<u32, WindowDelta>) {
        let mut readout = Readout::default();
        let mut times = RequestTimes::default();
        let mut totals = PoolTotals::default();
        if busy {
            for ns in [20_000, 300_000, 4_000_000, 90_000_000] {
                let bucket = poolscope_shared::histogram_bucket(ns);
                for histogram in [&mut times.queue, &mut times.duration, &mut times.latency] {
                    histogram.buckets[bucket] += 10;
                    histogram.sum_ns += 10 * ns;
                }
                let add = |histogram: &mut Option<Arc<Histogram>>, count| {
                    Arc::make_mut(histogram.get_or_insert_default()).buckets[bucket] += count;
                };
                add(&mut totals.runqueue, 3);
                totals.runqueue_waits += 3;
                totals.runqueue_wait_ns += 3 * ns;
                add(&mut totals.lock_waits[0], 2);
            }
            totals.time_ns = [1_000_000; poolscope_shared::Activity::COUNT];
            totals.request_ns = [500_000; poolscope_shared::Activity::COUNT];
        }
        let times = Arc::new(times);
        readout.request_times.insert(2, times.clone());
        let pools = names
            .iter()
            .zip(5..)
            .map(|(name, id)| PoolRow {
                view: PoolView {
                    id,
                    service: 2,
                    name: (*name).into(),
                },
                totals: totals.clone(),
                utilization: Some(0.5),
                capacity: busy.then_some(crate::metrics::capacity::Capacity {
                    requests_per_second: 200.0,
                    limit: crate::metrics::capacity::Limit::Threads,
                }),
            })
            .collect();
        // The first reading of a service: its window is all it has finished.
        let window = Windows::new(Duration::from_secs(60)).delta(2, Instant::now(), &times);
        let windows = window
            .filter(|_| busy)
            .map(|window| (2, window))
            .into_iter()
            .collect();
        (readout, pools, windows)
    }

    #[test]
    fn a_service_fits_the_series_budget_at_the_defaults() {
        let services = [ServiceView {
            id: 2,
            name: "api".into(),
            processes: 1,
            http2_worker_threads: None,
            workload: None,
            corrections: Corrections::default(),
        }];
        let listeners = [services::ServiceListener {
            service: "api".into(),
            queue: crate::discovery::sockdiag::ListenQueue {
                inode: 1,
                addr: std::net::SocketAddr::from(([0, 0, 0, 0], 8080)),
                depth: 0,
                limit: Some(4096),
            },
        }];
        let count_of = |names: &[&str], busy: bool, metrics: MetricsSettings| {
            let (readout, pools, windows) = service_of_pools(names, busy);
            let reading = Reading {
                backend: Backend::Socket,
                kernel: Some(&readout),
                services: &services,
                windows: &windows,
                pools: &pools,
                listeners: Some(&listeners),
                metrics,
            };
            let text = render(
                &collect_services(&reading, &mut Timings::default()),
                Format::Text,
            );
            (series_of(&text, "api"), text)
        };
        // Two pools (a main thread and eight workers) for the busy budget; the idle
        // one also for three (a main thread, an acceptor and workers).
        let count = |busy, metrics| count_of(&["server", "worker"], busy, metrics);
        let defaults = MetricsSettings::default();
        let (idle, text) = count(false, defaults);
        assert!(idle <= 40, "{idle} series for an idle service:\n{text}");
        let (idle_three, text) = count_of(&["server", "acceptor", "worker"], false, defaults);
        assert!(
            idle_three <= 40,
            "{idle_three} series for an idle service of three pools:\n{text}"
        );
        assert!(
            !text.contains("_bucket"),
            "an idle service exports no histogram:\n{text}"
        );
        assert!(
            text.contains("poolscope_queue_depth{service=\"api\"} 0\n"),
            "{text}"
        );
        let (busy, text) = count(true, defaults);
        assert!(busy <= 100, "{busy} series for a busy service:\n{text}");
        // 8 bounds and +Inf per request histogram; the pools' waits as sum and count.
        assert_eq!(
            text.matches("poolscope_request_latency_seconds_bucket{")
                .count(),
            9
        );
        assert!(
            text.contains("# TYPE poolscope_lock_wait_seconds summary\n"),
            "{text}"
        );
        assert!(
            !text.contains("poolscope_request_latency_window_seconds_sum"),
            "{text}"
        );
        eprintln!(
            "series per service at the defaults: idle {idle} (three pools: {idle_three}), \
             busy {busy}"
        );

        // The layout of the first release: half an octave per bucket, pool buckets.
        let Some(half_octave) = crate::config::OctavesPerBucket::new(0.5) else {
            panic!("half an octave is a layout");
        };
        let (dense, text) = count(
            true,
            MetricsSettings {
                octaves_per_bucket: half_octave,
                pool_histogram_buckets: true,
                ..MetricsSettings::default()
            },
        );
        assert_eq!(
            text.matches("poolscope_request_latency_seconds_bucket{")
                .count(),
            49
        );
        assert!(
            text.contains("# TYPE poolscope_lock_wait_seconds histogram\n"),
            "{text}"
        );
        assert!(dense > 300, "{dense}");
    }
}
