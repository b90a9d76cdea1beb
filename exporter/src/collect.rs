//! Reducers from what was read at scrape time (kernel counters, the watched set, the
//! listen queues) to metric families. Pure functions: names, labels and units are
//! decided here and nowhere else.
use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
};

use poolscope_shared::LossSource;

use crate::{
    encode::{Family, Kind},
    kernel::{Probe, Readout},
    sockdiag::ListenQueue,
    targets::ServiceView,
};

/// A listening socket that belongs to a watched service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceListener {
    pub service: String,
    pub queue: ListenQueue,
}

/// Per-service families (the ones the series cap applies to).
pub fn service_families(
    services: &[ServiceView],
    kernel: &Readout,
    listeners: &[ServiceListener],
) -> Vec<Family> {
    let mut targets = Family::new("targets", Kind::Gauge, "Processes watched for the service.");
    let mut accepted = Family::new(
        "connections_accepted",
        Kind::Counter,
        "Connections the service accepted (accept/accept4 returned a socket).",
    );
    let mut unserved = Family::new(
        "connections_unserved",
        Kind::Gauge,
        "Connections the service accepted and has not read a request byte from yet.",
    );
    let mut syscalls = Family::new(
        "syscalls",
        Kind::Counter,
        "Calls of the socket syscalls poolscope correlates, by the service's threads.",
    );
    for service in services {
        let labels = [("service", service.name.as_str())];
        targets.push(&labels, service.processes as f64);
        let Some(counters) = kernel.services.get(&service.id) else {
            continue;
        };
        accepted.push(&labels, counters.accepted as f64);
        let open = counters
            .unserved_entered
            .saturating_sub(counters.unserved_left)
            .saturating_sub(service.purged_unserved);
        unserved.push(&labels, open as f64);
        for ((id, syscall), calls) in kernel.syscalls.range((service.id, "")..) {
            if *id != service.id {
                break;
            }
            syscalls.push(
                &[("service", &service.name), ("syscall", syscall)],
                *calls as f64,
            );
        }
    }

    let mut depth = Family::new(
        "listen_queue_depth",
        Kind::Gauge,
        "Connections completed by the kernel and waiting in the listen backlog for accept().",
    );
    let mut limit = Family::new(
        "listen_queue_limit",
        Kind::Gauge,
        "Size of the listen backlog (listen() argument capped by net.core.somaxconn).",
    );
    for listener in listeners {
        let address = listener.queue.addr.to_string();
        let labels = [
            ("service", listener.service.as_str()),
            ("listener", address.as_str()),
        ];
        depth.push(&labels, listener.queue.depth.into());
        limit.push(&labels, listener.queue.limit.into());
    }
    vec![targets, accepted, unserved, syscalls, depth, limit]
}

/// Joins listen queues to the services that own their sockets. Sockets of unwatched
/// processes are left out; one socket shared by several processes counts once, and
/// several sockets on one address (SO_REUSEPORT) add up to one listener: their
/// backlogs and limits summed, as one queue in front of the service.
pub fn service_listeners(
    queues: &[ListenQueue],
    owner: impl Fn(u64) -> Option<String>,
) -> Vec<ServiceListener> {
    let mut merged: BTreeMap<(String, SocketAddr), ListenQueue> = BTreeMap::new();
    for queue in queues {
        let Some(service) = owner(queue.inode) else {
            continue;
        };
        merged
            .entry((service, queue.addr))
            .and_modify(|sum| {
                sum.depth += queue.depth;
                sum.limit += queue.limit;
            })
            .or_insert(*queue);
    }
    merged
        .into_iter()
        .map(|((service, _), queue)| ServiceListener { service, queue })
        .collect()
}

/// What the exporter knows about its own health at scrape time.
#[derive(Clone, Debug, Default)]
pub struct SelfStats {
    pub version: &'static str,
    pub backend: &'static str,
    pub series_dropped: u64,
    pub services_refused: u64,
    pub watch_errors: u64,
    /// (collector, seconds, success)
    pub collectors: Vec<(&'static str, f64, bool)>,
}

/// The exporter's own families; never capped.
pub fn self_families(stats: &SelfStats, probes: &[Probe], kernel: Option<&Readout>) -> Vec<Family> {
    let mut families = vec![
        Family::new(
            "build_info",
            Kind::Gauge,
            "poolscope's version and request backend; always 1.",
        )
        .with(
            &[("version", stats.version), ("backend", stats.backend)],
            1.0,
        ),
    ];
    let mut attached = Family::new(
        "probe_attached",
        Kind::Gauge,
        "1 if the kernel probe (category/tracepoint) is attached, else 0.",
    );
    for probe in probes {
        attached.push(
            &[("probe", &probe.name)],
            if probe.attached { 1.0 } else { 0.0 },
        );
    }
    families.push(attached);

    let mut map_errors = HashMap::from([("WATCHED", stats.watch_errors)]);
    let mut events_lost = Family::new(
        "events_lost",
        Kind::Counter,
        "Events the kernel side could not deliver to user space, by source.",
    );
    if let Some(kernel) = kernel {
        let mut run_seconds = Family::new(
            "bpf_run_seconds",
            Kind::Counter,
            "Time spent running each kernel program (kernel.bpf_stats_enabled).",
        );
        let mut runs = Family::new("bpf_runs", Kind::Counter, "Runs of each kernel program.");
        for program in &kernel.programs {
            run_seconds.push(
                &[("program", &program.name)],
                program.run_time.as_secs_f64(),
            );
            runs.push(&[("program", &program.name)], program.runs as f64);
        }
        families.extend([run_seconds, runs]);

        for (source, lost) in &kernel.losses {
            match source {
                LossSource::ConnsFull => *map_errors.entry("CONNS").or_default() += lost,
                LossSource::PendingCallsFull => {
                    *map_errors.entry("PENDING_CALLS").or_default() += lost;
                }
                LossSource::WatchedFull => *map_errors.entry("WATCHED").or_default() += lost,
                LossSource::ProcessEvents => {
                    events_lost.push(&[("source", "process_events")], *lost as f64);
                }
            }
        }
        let mut entries = Family::new("map_entries", Kind::Gauge, "Entries in each kernel map.");
        let mut capacity = Family::new("map_capacity", Kind::Gauge, "Capacity of each kernel map.");
        for map in &kernel.maps {
            entries.push(&[("map", map.name)], map.entries as f64);
            capacity.push(&[("map", map.name)], map.capacity.into());
        }
        families.extend([entries, capacity]);
    }
    families.push(events_lost);
    let mut update_errors = Family::new(
        "map_update_errors",
        Kind::Counter,
        "Inserts into a kernel map that failed (map full); the entry was not tracked.",
    );
    let mut map_errors: Vec<_> = map_errors.into_iter().collect();
    map_errors.sort();
    for (map, errors) in map_errors {
        update_errors.push(&[("map", map)], errors as f64);
    }
    families.push(update_errors);
    families.push(
        Family::new(
            "series_dropped",
            Kind::Counter,
            "Series left out of scrapes because limits.max_series was reached.",
        )
        .with(&[], stats.series_dropped as f64),
    );
    families.push(
        Family::new(
            "services_refused",
            Kind::Gauge,
            "Processes the last scan left unwatched because limits.max_services was reached.",
        )
        .with(&[], stats.services_refused as f64),
    );
    let mut duration = Family::new(
        "scrape_duration_seconds",
        Kind::Gauge,
        "Time each collector took in this scrape.",
    );
    let mut success = Family::new(
        "scrape_collector_success",
        Kind::Gauge,
        "1 if the collector succeeded in this scrape, else 0.",
    );
    for (collector, seconds, ok) in &stats.collectors {
        duration.push(&[("collector", collector)], *seconds);
        success.push(&[("collector", collector)], if *ok { 1.0 } else { 0.0 });
    }
    families.extend([duration, success]);
    families.retain(|family| !family.samples.is_empty());
    families
}

#[cfg(test)]
mod tests {
    use poolscope_shared::ServiceCounters;

    use super::*;
    use crate::encode::{Format, render};

    fn view(id: u32, name: &str, purged: u64) -> ServiceView {
        ServiceView {
            id,
            name: name.into(),
            processes: 2,
            purged_unserved: purged,
        }
    }

    #[test]
    fn unserved_is_entered_minus_left_minus_purged() {
        let mut readout = Readout::default();
        readout.services.insert(
            3,
            ServiceCounters {
                accepted: 10,
                unserved_entered: 10,
                unserved_left: 6,
            },
        );
        readout.syscalls.insert((3, "read"), 7);
        readout.syscalls.insert((4, "read"), 9);
        let families = service_families(&[view(3, "web", 1)], &readout, &[]);
        let text = render(&families, Format::Text);
        assert!(
            text.contains("poolscope_connections_unserved{service=\"web\"} 3\n"),
            "{text}"
        );
        assert!(text.contains("poolscope_connections_accepted_total{service=\"web\"} 10\n"));
        assert!(text.contains("poolscope_syscalls_total{service=\"web\",syscall=\"read\"} 7\n"));
        assert!(
            !text.contains("} 9\n"),
            "another service's counter leaked: {text}"
        );
        assert!(text.contains("poolscope_targets{service=\"web\"} 2\n"));
    }

    #[test]
    fn listeners_join_by_inode_and_skip_unwatched() {
        let queue = |inode, port| ListenQueue {
            inode,
            addr: format!("127.0.0.1:{port}").parse().expect("addr"),
            depth: 4,
            limit: 16,
        };
        let listeners = service_listeners(&[queue(1, 80), queue(2, 81)], |inode| {
            (inode == 1).then(|| "web".to_owned())
        });
        assert_eq!(listeners.len(), 1);
        // SO_REUSEPORT: three sockets on one address are one listener.
        let reuseport = service_listeners(&[queue(1, 80), queue(3, 80), queue(4, 80)], |_| {
            Some("web".to_owned())
        });
        assert_eq!(reuseport.len(), 1);
        assert_eq!(
            (reuseport[0].queue.depth, reuseport[0].queue.limit),
            (12, 48)
        );
        let text = render(
            &service_families(&[], &Readout::default(), &listeners),
            Format::Text,
        );
        assert!(text.contains(
            "poolscope_listen_queue_depth{service=\"web\",listener=\"127.0.0.1:80\"} 4\n"
        ));
        assert!(text.contains(
            "poolscope_listen_queue_limit{service=\"web\",listener=\"127.0.0.1:80\"} 16\n"
        ));
    }
}
