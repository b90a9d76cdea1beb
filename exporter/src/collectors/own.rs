//! poolscope's own families: build info, probes, loss counters and health, map
//! fill, program run time, collector timings and the last configuration load.
use super::{Collected, OwnReading, Timings};
use crate::{
    encode::{Family, Kind},
    kernel::{Probe, ProbeState, Readout},
    metrics::health::{Loss, LossKind},
    metrics::recount::RecountStats,
};

/// What the exporter knows about its own health at scrape time.
#[derive(Clone, Debug, Default)]
pub struct SelfStats {
    pub version: &'static str,
    /// The git commit built (`unknown` outside a checkout).
    pub revision: &'static str,
    pub backend: &'static str,
    /// Every loss counter ([`health::losses`]).
    pub losses: Vec<Loss>,
    /// Whether any loss makes poolscope degraded now.
    pub degraded: bool,
    /// Processes with the `pthread_mutex_lock` probes attached.
    pub lock_probe_processes: usize,
    /// Reads of a network namespace's `net/tcp` tables so far.
    pub namespace_tables_read: u64,
    /// Processes whose open files rescans read so far.
    pub process_fds_read: u64,
    /// Listings of the kubelet's log links read, and refreshes that failed.
    pub pod_log_listings: u64,
    pub pod_log_failures: u64,
    pub reload: ReloadStatus,
    /// What the gauges' recounts did.
    pub recount: RecountStats,
}

/// The last configuration load, exported as Prometheus exports its own, so that a
/// refused reload (which keeps the running configuration) can be alerted on.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReloadStatus {
    /// False from a refused reload until one succeeds.
    pub successful: bool,
    /// When the running configuration was loaded, at start or by a reload.
    pub success_unix_seconds: f64,
}

/// One family per kind of loss counter ([`health::losses`]); skipped probes are in
/// `probe_skipped` already.
fn loss_families(losses: &[Loss]) -> Vec<Family> {
    let mut events_lost = Family::new(
        "events_lost",
        Kind::Counter,
        "Events the kernel side could not deliver to user space, by source.",
    );
    let mut update_errors = Family::new(
        "map_update_errors",
        Kind::Counter,
        "Inserts into a kernel map that failed, by errno (E2BIG: the map is full); the \
         entry was not tracked.",
    );
    let mut unsymbolized = Family::new(
        "stack_frames_unsymbolized",
        Kind::Counter,
        "Stack frame addresses left without a function name (module+offset or a bare \
         address) by the symbolizer, by space; each distinct address once per drain, each \
         frame of a /debug/locks report.",
    );
    let mut scalars = Vec::new();
    for loss in losses {
        let value = loss.value as f64;
        match &loss.kind {
            LossKind::MapUpdate { map, errno } => {
                update_errors.push(&[("map", map), ("errno", errno.name())], value);
            }
            LossKind::Events(source) => events_lost.push(&[("source", source)], value),
            LossKind::SeriesDropped => scalars.push(
                Family::new(
                    "series_dropped",
                    Kind::Counter,
                    "Series left out of scrapes because limits.max_series was reached.",
                )
                .with(&[], value),
            ),
            LossKind::ServicesRefused => scalars.push(
                Family::new(
                    "services_refused",
                    Kind::Gauge,
                    "Processes the last scan left unwatched because limits.max_services was \
                     reached.",
                )
                .with(&[], value),
            ),
            LossKind::ProcessesUnreadable => scalars.push(
                Family::new(
                    "processes_unreadable",
                    Kind::Gauge,
                    "Processes whose open files the last scan was not allowed to read \
                     (EACCES, no CAP_SYS_PTRACE): their listening sockets are unknown, so \
                     discovery cannot find them.",
                )
                .with(&[], value),
            ),
            LossKind::PoolsRefused => scalars.push(
                Family::new(
                    "pools_refused",
                    Kind::Counter,
                    "Threads left in their creator's pool because limits.max_pools was reached.",
                )
                .with(&[], value),
            ),
            LossKind::LockUprobes => scalars.push(
                Family::new(
                    "lock_uprobe_errors",
                    Kind::Counter,
                    "Processes whose pthread_mutex_lock probes could not be attached (no libc \
                     mapped, or the kernel refused); the log says which.",
                )
                .with(&[], value),
            ),
            LossKind::ProbeSkipped { .. } => {}
            LossKind::Unsymbolized(space) => unsymbolized.push(&[("space", space)], value),
        }
    }
    let mut families = vec![events_lost, update_errors, unsymbolized];
    families.extend(scalars);
    families
}

/// Runs last: it reports every step and collector before it (not itself).
pub fn collect(own: &OwnReading<'_>, timings: &Timings) -> Collected {
    Collected {
        families: families(own.stats, own.probes, own.kernel, timings),
        whole: true,
    }
}

fn families(
    stats: &SelfStats,
    probes: &[Probe],
    kernel: Option<&Readout>,
    timings: &Timings,
) -> Vec<Family> {
    let mut families = vec![
        Family::new(
            "build_info",
            Kind::Gauge,
            "poolscope's version, git commit and request backend; always 1.",
        )
        .with(
            &[
                ("version", stats.version),
                ("revision", stats.revision),
                ("backend", stats.backend),
            ],
            1.0,
        ),
    ];
    let mut attached = Family::new(
        "probe_attached",
        Kind::Gauge,
        "1 if the kernel probe (category/tracepoint) is attached, else 0.",
    );
    let mut skipped = Family::new(
        "probe_skipped",
        Kind::Gauge,
        "1 for each kernel probe that does not measure, with the reason found at start.",
    );
    for probe in probes {
        match probe.state {
            ProbeState::Attached => attached.push(&[("probe", &probe.name)], 1.0),
            ProbeState::OnDemand => {}
            ProbeState::Skipped(skip) => {
                attached.push(&[("probe", &probe.name)], 0.0);
                skipped.push(&[("probe", &probe.name), ("reason", skip.name())], 1.0);
            }
        }
    }
    families.push(attached);
    families.push(skipped);

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
        let mut entries = Family::new("map_entries", Kind::Gauge, "Entries in each kernel map.");
        let mut capacity = Family::new("map_capacity", Kind::Gauge, "Capacity of each kernel map.");
        for map in &kernel.maps {
            entries.push(&[("map", map.name)], map.entries as f64);
            if let Some(size) = map.capacity {
                capacity.push(&[("map", map.name)], size.into());
            }
        }
        families.extend([entries, capacity]);
        let captures = &kernel.offcpu_captures;
        families.push(
            Family::new(
                "offcpu_blocks",
                Kind::Counter,
                "Blocks of watched threads by how their off-CPU stacks were captured: \
                 full (each CPU's first stacks.offcpu_full_rate per second), sampled (one \
                 in stacks.offcpu_sample_one_in beyond, weighing for that many), skipped \
                 (stood for by the sampled ones).",
            )
            .with(&[("capture", "full")], captures.full as f64)
            .with(&[("capture", "sampled")], captures.sampled as f64)
            .with(&[("capture", "skipped")], captures.skipped as f64),
        );
    }
    families.extend(loss_families(&stats.losses));
    families.push(
        Family::new(
            "degraded",
            Kind::Gauge,
            "1 while poolscope measures less than it should (a loss counter rose within \
             limits.degraded_for, a refusal gauge is above 0, or a probe is skipped); \
             /healthz and the log say what to change.",
        )
        .with(&[], if stats.degraded { 1.0 } else { 0.0 }),
    );
    families.push(
        Family::new(
            "config_last_reload_successful",
            Kind::Gauge,
            "0 after a reload (SIGHUP) was refused and the running configuration kept; \
             1 once the configuration in use was loaded.",
        )
        .with(&[], if stats.reload.successful { 1.0 } else { 0.0 }),
    );
    families.push(
        Family::new(
            "config_last_reload_success_timestamp_seconds",
            Kind::Gauge,
            "When the configuration in use was loaded (at start or by a reload), in Unix \
             seconds.",
        )
        .with(&[], stats.reload.success_unix_seconds),
    );
    families.push(
        Family::new(
            "lock_uprobe_processes",
            Kind::Gauge,
            "Watched processes with the pthread_mutex_lock probes attached (probes.lock_uprobes).",
        )
        .with(&[], stats.lock_probe_processes as f64),
    );
    families.push(
        Family::new(
            "discovery_namespace_tables_read",
            Kind::Counter,
            "Reads of a network namespace's /proc/<pid>/net/tcp and tcp6 by rescans, \
             scrapes and the saturation check; each walks the kernel's whole connection \
             hash (milliseconds). With the socket backend the rescan reads them after a \
             socket began or stopped listening and once a minute; with the syscall \
             backend at each rescan; scrapes where a pod's listener cannot be read \
             through its fd.",
        )
        .with(&[], stats.namespace_tables_read as f64),
    );
    families.push(
        Family::new(
            "discovery_process_fds_read",
            Kind::Counter,
            "Processes whose open files (/proc/<pid>/fdinfo, a file per fd) rescans read \
             to find which process holds each listener. With the socket backend, between \
             listen changes only processes new since the last rescan are read (and every \
             process once a minute); with the syscall backend every process at each rescan.",
        )
        .with(&[], stats.process_fds_read as f64),
    );
    families.push(
        Family::new(
            "discovery_pod_log_listings",
            Kind::Counter,
            "Listings of the kubelet's container log links (discovery.pod_logs_dir), which \
             name pod containers: read by a rescan after the directory changed \
             (result=\"read\"), or not readable (result=\"failed\": the names listed \
             before stay).",
        )
        .with(&[("result", "read")], stats.pod_log_listings as f64)
        .with(&[("result", "failed")], stats.pod_log_failures as f64),
    );
    let mut corrections = Family::new(
        "recount_corrections",
        Kind::Counter,
        "How far the recounts moved each gauge, summed over services: when a service's \
         counters stand still, poolscope counts its live connections (and HTTP/2 streams) \
         in the kernel's connection state and corrects a gauge that its counters put \
         elsewhere. Above 0 means an update was lost (docs/DESIGN.md, the recount).",
    );
    for (gauge, moved) in stats.recount.corrected.named() {
        corrections.push(&[("gauge", gauge)], moved as f64);
    }
    families.push(corrections);
    families.push(
        Family::new(
            "recounts",
            Kind::Counter,
            "Recounts of the gauges against the connection state: result=\"done\", or \
             \"failed\" when it could not be read (the log says why).",
        )
        .with(
            &[("result", "done")],
            (stats.recount.recounts - stats.recount.failures) as f64,
        )
        .with(&[("result", "failed")], stats.recount.failures as f64),
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
    for (collector, seconds, ok) in &timings.0 {
        duration.push(&[("collector", collector)], *seconds);
        success.push(&[("collector", collector)], if *ok { 1.0 } else { 0.0 });
    }
    families.extend([duration, success]);
    families.retain(|family| !family.samples.is_empty());
    families
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        encode::{Format, render},
        kernel::Skip,
    };

    #[test]
    fn a_refused_reload_is_exported_beside_the_last_good_load() {
        let stats = SelfStats {
            reload: ReloadStatus {
                successful: false,
                success_unix_seconds: 1_700_000_000.5,
            },
            ..Default::default()
        };
        let text = render(
            &families(&stats, &[], None, &Timings::default()),
            Format::Text,
        );
        for line in [
            "poolscope_config_last_reload_successful 0\n",
            "poolscope_config_last_reload_success_timestamp_seconds 1700000000.5\n",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }

    #[test]
    fn losses_are_exported_by_map_and_errno_with_the_degraded_flag() {
        let kernel = [
            (
                poolscope_shared::LossSource::ConnsInsert,
                poolscope_shared::LossErrno::E2big,
                5,
            ),
            (
                poolscope_shared::LossSource::ThreadsInsert,
                poolscope_shared::LossErrno::Ebusy,
                2,
            ),
        ];
        let stats = SelfStats {
            losses: crate::metrics::health::losses(&crate::metrics::health::LossInputs {
                kernel: &kernel,
                series_dropped: 9,
                unsymbolized: crate::stacks::symbolize::Unnamed { user: 3, kernel: 0 },
                ..Default::default()
            }),
            degraded: true,
            ..Default::default()
        };
        let text = render(
            &families(&stats, &[], None, &Timings::default()),
            Format::Text,
        );
        for line in [
            "poolscope_map_update_errors_total{map=\"CONNS\",errno=\"E2BIG\"} 5",
            "poolscope_map_update_errors_total{map=\"THREADS\",errno=\"E2BIG\"} 0",
            "poolscope_map_update_errors_total{map=\"THREADS\",errno=\"EBUSY\"} 2",
            "poolscope_events_lost_total{source=\"process_events\"} 0",
            "poolscope_series_dropped_total 9",
            "poolscope_stack_frames_unsymbolized_total{space=\"user\"} 3",
            "poolscope_stack_frames_unsymbolized_total{space=\"kernel\"} 0",
            "poolscope_services_refused 0",
            "poolscope_degraded 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
    }

    #[test]
    fn skipped_probes_say_why_and_on_demand_ones_are_not_attached_probes() {
        let probe = |name: &str, state| Probe {
            name: name.into(),
            state,
        };
        let probes = [
            probe("raw_syscalls/sys_enter", ProbeState::Attached),
            probe("sched/sched_switch", ProbeState::Skipped(Skip::LoadRefused)),
            probe("uprobe/pthread_mutex_lock", ProbeState::OnDemand),
            probe("perf_event/cpu-clock", ProbeState::Skipped(Skip::Off)),
        ];
        let text = render(
            &families(&SelfStats::default(), &probes, None, &Timings::default()),
            Format::Text,
        );
        for line in [
            "poolscope_probe_attached{probe=\"raw_syscalls/sys_enter\"} 1",
            "poolscope_probe_attached{probe=\"sched/sched_switch\"} 0",
            "poolscope_probe_skipped{probe=\"sched/sched_switch\",reason=\"load_refused\"} 1",
            "poolscope_probe_skipped{probe=\"perf_event/cpu-clock\",reason=\"off\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
        assert!(
            !text.contains("probe=\"uprobe/pthread_mutex_lock\""),
            "{text}"
        );
        assert!(!text.contains("sys_enter\",reason"), "{text}");
    }
}
