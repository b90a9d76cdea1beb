//! From one scrape's reading to metric families. One collector per concern, each
//! naming its own families, run from one list that times each one and says whether
//! the reading it needed was whole (`poolscope_scrape_collector_duration_seconds`,
//! `poolscope_scrape_collector_success`). Pure functions of the reading: what to
//! read, and under which lock, is the exporter's business.
pub mod downstream;
pub mod own;
pub mod pools;
pub mod services;

use std::{collections::BTreeMap, time::Instant};

use poolscope_shared::RequestTimes;

use crate::{
    discovery::targets::ServiceView,
    encode::Family,
    kernel::{Backend, Readout},
    metrics::pools::{PoolTotals, PoolView},
};

/// One pool at scrape time: its totals and its busy share over the utilization
/// window (`None` before there is a window).
#[derive(Clone, Debug)]
pub struct PoolRow {
    pub view: PoolView,
    pub totals: PoolTotals,
    pub utilization: Option<f64>,
}

/// What one scrape read.
pub struct Reading<'a> {
    pub backend: Backend,
    /// The kernel's counters; `None` if reading them failed (the per-service
    /// families are then exported at zero).
    pub kernel: Option<&'a Readout>,
    pub services: &'a [ServiceView],
    /// Each service's request times over the quantile window.
    pub windows: &'a BTreeMap<u32, RequestTimes>,
    pub pools: &'a [PoolRow],
    /// The listen queues of the services; `None` if reading them failed.
    pub listeners: Option<&'a [services::ServiceListener]>,
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

/// One concern's families from a reading.
pub type Collector = fn(&Reading<'_>) -> Collected;

/// Every collector whose families the series cap applies to, in exposition order.
pub const COLLECTORS: [(&str, Collector); 3] = [
    ("services", services::collect),
    ("pools", pools::collect),
    ("downstream", downstream::collect),
];

/// Each step of a scrape: (collector, seconds, success).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings(pub Vec<(&'static str, f64, bool)>);

impl Timings {
    /// Runs `step` (which says whether it succeeded) and records it as `name`.
    pub fn time<T>(&mut self, name: &'static str, step: impl FnOnce() -> (T, bool)) -> T {
        let started = Instant::now();
        let (result, success) = step();
        self.0
            .push((name, started.elapsed().as_secs_f64(), success));
        result
    }
}

/// Runs every collector of [`COLLECTORS`] on `reading`.
pub fn collect_all(reading: &Reading<'_>, timings: &mut Timings) -> Vec<Family> {
    let mut families = Vec::new();
    for (name, collector) in COLLECTORS {
        families.extend(timings.time(name, || {
            let collected = collector(reading);
            (collected.families, collected.whole)
        }));
    }
    families
}

#[cfg(test)]
mod tests {
    use poolscope_shared::{DownstreamKey, DownstreamWait, Peer, ServiceCounters};

    use super::*;
    use crate::{
        discovery::targets::Corrections,
        encode::{Format, render},
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
        }];
        let mut readout = Readout::default();
        readout.services.insert(
            2,
            ServiceCounters {
                accepted: 7,
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
        let windows = BTreeMap::new();
        let mut reading = Reading {
            backend: Backend::Syscall,
            kernel: Some(&readout),
            services: &services,
            windows: &windows,
            pools: &pools,
            listeners: Some(&[]),
        };
        let mut timings = Timings::default();
        let text = render(&collect_all(&reading, &mut timings), Format::Text);
        assert_eq!(
            outcome(&timings),
            [("services", true), ("pools", true), ("downstream", true)]
        );
        for line in [
            "poolscope_connections_accepted_total{service=\"api\"} 7\n",
            "poolscope_pool_utilization_ratio{service=\"api\",pool=\"worker\"} 0.25\n",
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
        let text = render(&collect_all(&reading, &mut timings), Format::Text);
        assert_eq!(
            outcome(&timings),
            [("services", false), ("pools", false), ("downstream", false)]
        );
        assert!(
            text.contains("poolscope_connections_accepted_total{service=\"api\"} 0\n"),
            "{text}"
        );
    }
}
