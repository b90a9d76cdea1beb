//! poolscope's own process as every Prometheus client library exports it
//! (`process_*`, without poolscope's prefix, so that the usual dashboards and alerts
//! on exporters' CPU, memory and descriptors work unchanged).
use super::{Collected, OwnReading, Timings};
use crate::{
    discovery::procfs::{self, ProcessUse},
    encode::{Family, Kind},
};

/// Reads `self` under the procfs root (right in any pid namespace); not whole, and
/// no families, when it cannot.
pub fn collect(own: &OwnReading<'_>, _: &Timings) -> Collected {
    let used = own
        .procfs_units
        .and_then(|units| procfs::process_use(own.procfs_root, "self", &units));
    Collected {
        families: used.as_ref().map(families).unwrap_or_default(),
        whole: used.is_some(),
    }
}

fn families(used: &ProcessUse) -> Vec<Family> {
    vec![
        Family::standard(
            "process_cpu_seconds",
            Kind::Counter,
            "Total user and system CPU time spent in seconds.",
        )
        .with(&[], used.cpu_seconds),
        Family::standard(
            "process_resident_memory_bytes",
            Kind::Gauge,
            "Resident memory size in bytes.",
        )
        .with(&[], used.resident_bytes),
        Family::standard(
            "process_virtual_memory_bytes",
            Kind::Gauge,
            "Virtual memory size in bytes.",
        )
        .with(&[], used.virtual_bytes),
        Family::standard(
            "process_virtual_memory_max_bytes",
            Kind::Gauge,
            "Maximum amount of virtual memory available in bytes.",
        )
        .with(&[], used.virtual_max_bytes),
        Family::standard(
            "process_open_fds",
            Kind::Gauge,
            "Number of open file descriptors.",
        )
        .with(&[], used.open_fds),
        Family::standard(
            "process_max_fds",
            Kind::Gauge,
            "Maximum number of open file descriptors.",
        )
        .with(&[], used.max_fds),
        Family::standard(
            "process_start_time_seconds",
            Kind::Gauge,
            "Start time of the process since unix epoch in seconds.",
        )
        .with(&[], used.start_time_seconds),
    ]
}
