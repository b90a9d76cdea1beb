//! Validation of the raw configuration into [`Settings`]: every refusal names the
//! source that set the key, the key and the reason.
use std::time::Duration;

use figment::Figment;
use poolscope_shared::OVERFLOW_STACK;
use regex::Regex;

use super::{
    ConfigError, Limits, MetricsSettings, OctavesPerBucket, ProfileLimits, RawConfig, RawLimits,
    RawProfiles, RawRoutes, RawTarget, RawWeb, RoutePatterns, ScrapeLimits, ServiceOptions,
    ServiceRoutes, Settings, SnapshotSettings, TargetRule, source_name,
};

/// Most slots of the thread array: 152 bytes of kernel memory each (144 MiB here),
/// and tids (below 2^22) spread over them all well before.
const MAX_THREAD_SLOTS: u32 = 1 << 20;
/// Entries of a stack map (1 kB each): far below [`OVERFLOW_STACK`], the lowest of
/// the bits that mark a stack id's kind, which no map id may reach.
const MAX_STACK_MAP_ENTRIES: u32 = 1 << 24;
const _: () = assert!(MAX_STACK_MAP_ENTRIES.next_power_of_two() < OVERFLOW_STACK as u32);

/// A validation failure for `key`, naming the source that set it.
fn invalid(figment: &Figment, key: &str, reason: impl std::fmt::Display) -> ConfigError {
    let source = source_name(figment.find_metadata(key));
    ConfigError::Invalid(format!("{source}: key `{key}`: {reason}"))
}

pub(super) fn validate(raw: &RawConfig, figment: &Figment) -> Result<Settings, ConfigError> {
    let listen_addresses = parse_listen_addresses(raw.web.listen_address.as_slice())
        .map_err(|reason| invalid(figment, "web.listen_address", reason))?;
    let telemetry_path = parse_telemetry_path(&raw.web.telemetry_path)
        .map_err(|reason| invalid(figment, "web.telemetry_path", reason))?;
    let log_level = raw.log.level.parse().map_err(|_| {
        invalid(
            figment,
            "log.level",
            "want one of error, warn, info, debug, trace, off",
        )
    })?;
    if raw.discovery.rescan_interval < Duration::from_millis(100) {
        return Err(invalid(
            figment,
            "discovery.rescan_interval",
            "must be at least 100ms",
        ));
    }
    let positive = |key: &str, value: u64| {
        if value == 0 {
            Err(invalid(figment, key, "must be greater than 0"))
        } else {
            Ok(())
        }
    };
    positive("limits.max_series", raw.limits.max_series as u64)?;
    let limits = Limits {
        watched_processes: raw.limits.watched_processes,
        connections: raw.limits.connections,
        max_services: raw.limits.max_services,
        max_pools: raw.limits.max_pools,
        threads: raw.limits.threads,
        thread_slots: raw.limits.thread_slots,
        locks: raw.limits.locks,
        lock_stacks: raw.limits.lock_stacks,
        stacks: raw.limits.stacks,
        stack_counts: raw.limits.stack_counts,
        syscalls_in_flight: raw.limits.syscalls_in_flight,
        mutex_calls_in_flight: raw.limits.mutex_calls_in_flight,
        listen_ports: raw.limits.listen_ports,
        downstreams: raw.limits.downstreams,
        routes: raw.limits.routes,
        routes_per_service: raw.limits.routes_per_service,
        route_events: raw.limits.route_events,
        http2_decoded_connections: raw.limits.http2_decoded_connections,
    };
    for (key, size) in limits.keyed() {
        positive(key, size.into())?;
    }
    if !limits.thread_slots.is_power_of_two() || limits.thread_slots > MAX_THREAD_SLOTS {
        return Err(invalid(
            figment,
            "limits.thread_slots",
            format!("must be a power of two, at most {MAX_THREAD_SLOTS}"),
        ));
    }
    for (key, size) in [
        ("limits.stacks", limits.stacks),
        ("limits.lock_stacks", limits.lock_stacks),
    ] {
        if size > MAX_STACK_MAP_ENTRIES {
            return Err(invalid(
                figment,
                key,
                format!("must be at most {MAX_STACK_MAP_ENTRIES}"),
            ));
        }
    }
    if raw.probes.lock_uprobes.iter().any(String::is_empty) {
        return Err(invalid(
            figment,
            "probes.lock_uprobes",
            "service names must not be empty (\"*\" selects every service)",
        ));
    }
    let snapshots = validate_stacks(raw, figment)?;
    let profiles = validate_profiles(&raw.profiles, figment)?;
    let scrapes = validate_scrapes(&raw.web, figment)?;
    if raw.pools.utilization_window < Duration::from_secs(1) {
        return Err(invalid(
            figment,
            "pools.utilization_window",
            "must be at least 1s (pools are sampled every second)",
        ));
    }
    if raw.limits.degraded_for < Duration::from_secs(1) {
        return Err(invalid(
            figment,
            "limits.degraded_for",
            "must be at least 1s (the loss counters are read every second)",
        ));
    }
    if raw.limits.max_services > poolscope_shared::MAX_SERVICES {
        return Err(invalid(
            figment,
            "limits.max_services",
            format!("at most {}", poolscope_shared::MAX_SERVICES),
        ));
    }
    let octaves_per_bucket =
        OctavesPerBucket::new(raw.metrics.octaves_per_bucket).ok_or_else(|| {
            invalid(
                figment,
                "metrics.octaves_per_bucket",
                format!(
                    "must be one of {:?} (bounds of the kernel's buckets, 8 per octave)",
                    OctavesPerBucket::ALLOWED
                ),
            )
        })?;
    let targets = raw
        .targets
        .iter()
        .enumerate()
        .map(|(index, target)| validate_target(target, index, &raw.limits, figment))
        .collect::<Result<_, _>>()?;
    Ok(Settings {
        listen_addresses,
        telemetry_path,
        scrapes,
        debug_endpoints: raw.web.debug_endpoints,
        log_level,
        log_format: raw.log.format,
        rescan_interval: raw.discovery.rescan_interval,
        procfs_root: raw.discovery.procfs_root.clone(),
        pod_logs_dir: raw.discovery.pod_logs_dir.clone(),
        cgroupfs_root: raw.discovery.cgroupfs_root.clone(),
        backend: raw.probes.backend,
        bpf_stats: raw.probes.bpf_stats,
        response_status: raw.probes.response_status,
        routes: raw.probes.routes,
        lock_uprobes: raw.probes.lock_uprobes.clone(),
        max_series: raw.limits.max_series,
        limits,
        degraded_for: raw.limits.degraded_for,
        utilization_window: raw.pools.utilization_window,
        snapshots,
        profiles,
        metrics: MetricsSettings {
            octaves_per_bucket,
            pool_histogram_buckets: raw.metrics.pool_histogram_buckets,
            native_histograms: raw.metrics.native_histograms,
        },
        targets,
    })
}

fn validate_scrapes(raw: &RawWeb, figment: &Figment) -> Result<ScrapeLimits, ConfigError> {
    const MAX_CONCURRENT: u32 = 1024;
    if !(1..=MAX_CONCURRENT).contains(&raw.max_concurrent_scrapes) {
        return Err(invalid(
            figment,
            "web.max_concurrent_scrapes",
            format!("want 1 to {MAX_CONCURRENT}"),
        ));
    }
    if raw.scrape_timeout < Duration::from_millis(100) {
        return Err(invalid(
            figment,
            "web.scrape_timeout",
            "must be at least 100ms",
        ));
    }
    if raw.scrape_timeout_offset >= raw.scrape_timeout {
        return Err(invalid(
            figment,
            "web.scrape_timeout_offset",
            "must be shorter than web.scrape_timeout",
        ));
    }
    Ok(ScrapeLimits {
        max_concurrent: raw.max_concurrent_scrapes,
        timeout: raw.scrape_timeout,
        timeout_offset: raw.scrape_timeout_offset,
    })
}

fn validate_profiles(raw: &RawProfiles, figment: &Figment) -> Result<ProfileLimits, ConfigError> {
    const MAX_HZ: u32 = 1000;
    if raw.max_sessions > poolscope_shared::MAX_PROFILE_SESSIONS {
        return Err(invalid(
            figment,
            "profiles.max_sessions",
            format!("at most {}", poolscope_shared::MAX_PROFILE_SESSIONS),
        ));
    }
    if raw.max_duration < Duration::from_secs(1) {
        return Err(invalid(
            figment,
            "profiles.max_duration",
            "must be at least 1s",
        ));
    }
    if raw.min_hz == 0 || raw.min_hz > raw.max_hz || raw.max_hz > MAX_HZ {
        return Err(invalid(
            figment,
            "profiles.min_hz",
            format!("want 1 <= profiles.min_hz <= profiles.max_hz <= {MAX_HZ}"),
        ));
    }
    if !(raw.min_hz..=raw.max_hz).contains(&raw.default_hz) {
        return Err(invalid(
            figment,
            "profiles.default_hz",
            "must lie within profiles.min_hz and profiles.max_hz",
        ));
    }
    if raw.max_response_bytes < 64 << 10 {
        return Err(invalid(
            figment,
            "profiles.max_response_bytes",
            "must be at least 64 KiB",
        ));
    }
    Ok(ProfileLimits {
        max_sessions: raw.max_sessions,
        max_duration: raw.max_duration,
        min_hz: raw.min_hz,
        max_hz: raw.max_hz,
        default_hz: raw.default_hz,
        max_response_bytes: raw.max_response_bytes,
    })
}

fn validate_stacks(raw: &RawConfig, figment: &Figment) -> Result<SnapshotSettings, ConfigError> {
    let stacks = &raw.stacks;
    if raw.probes.sampling_hz > 1000 {
        return Err(invalid(
            figment,
            "probes.sampling_hz",
            "1 to 1000 samples per second (0 turns sampling off)",
        ));
    }
    if stacks.interval < Duration::from_secs(1) {
        return Err(invalid(figment, "stacks.interval", "must be at least 1s"));
    }
    if stacks.keep == 0 {
        return Err(invalid(figment, "stacks.keep", "must be greater than 0"));
    }
    if stacks.memory_limit_bytes < 1 << 20 {
        return Err(invalid(
            figment,
            "stacks.memory_limit_bytes",
            "must be at least 1048576 (1 MiB)",
        ));
    }
    if !stacks.offcpu_sample_one_in.is_power_of_two() || stacks.offcpu_sample_one_in > 1024 {
        return Err(invalid(
            figment,
            "stacks.offcpu_sample_one_in",
            "must be a power of two from 1 (every block) to 1024",
        ));
    }
    if stacks.offcpu && stacks.offcpu_min.is_zero() {
        return Err(invalid(
            figment,
            "stacks.offcpu_min",
            "must be greater than 0 (set stacks.offcpu = false to record none)",
        ));
    }
    if stacks.saturation_queue_depth > 0 && stacks.saturation_duration < Duration::from_secs(1) {
        return Err(invalid(
            figment,
            "stacks.saturation_duration",
            "must be at least 1s (queue depth is checked every second)",
        ));
    }
    Ok(SnapshotSettings {
        sampling_hz: raw.probes.sampling_hz,
        offcpu_min: stacks.offcpu.then_some(stacks.offcpu_min),
        offcpu_idle: stacks.offcpu_idle,
        offcpu_full_rate: stacks.offcpu_full_rate,
        offcpu_sample_one_in: stacks.offcpu_sample_one_in,
        interval: stacks.interval,
        keep: stacks.keep,
        memory_limit_bytes: stacks.memory_limit_bytes,
        unwind_memory_bytes: stacks.unwind_memory_bytes,
        saturation: (stacks.saturation_queue_depth > 0)
            .then_some((stacks.saturation_queue_depth, stacks.saturation_duration)),
    })
}

fn validate_target(
    target: &RawTarget,
    index: usize,
    limits: &RawLimits,
    figment: &Figment,
) -> Result<TargetRule, ConfigError> {
    let key = |field: &str| format!("targets[{index}].{field}");
    let regex = |field: &str, pattern: &Option<String>| {
        pattern
            .as_deref()
            .map(Regex::new)
            .transpose()
            .map_err(|error| invalid(figment, "targets", format!("{}: {error}", key(field))))
    };
    let rule = TargetRule {
        service: target.service.clone(),
        pids: target.pids.clone(),
        comm: regex("comm", &target.comm)?,
        exe: regex("exe", &target.exe)?,
        ports: target.port.to_vec(),
        cgroup: target.cgroup.clone(),
        options: ServiceOptions {
            http2_worker_threads: target.http2_worker_threads,
            routes: validate_routes(target.routes.as_ref(), limits.routes_per_service).map_err(
                |reason| invalid(figment, "targets", format!("{}: {reason}", key("routes"))),
            )?,
        },
    };
    if let Some(service) = &rule.service
        && (service.is_empty() || service.len() > 128)
    {
        return Err(invalid(
            figment,
            "targets",
            format!("{}: 1 to 128 characters", key("service")),
        ));
    }
    if rule.cgroup.as_deref() == Some("") {
        return Err(invalid(
            figment,
            "targets",
            format!("{}: must not be empty", key("cgroup")),
        ));
    }
    let selects = !rule.pids.is_empty()
        || rule.comm.is_some()
        || rule.exe.is_some()
        || !rule.ports.is_empty()
        || rule.cgroup.is_some();
    if !selects {
        return Err(invalid(
            figment,
            "targets",
            format!(
                "{}: needs at least one of pids, comm, exe, port, cgroup",
                key("")
            ),
        ));
    }
    Ok(rule)
}

/// Whether a target's routes are read; its templates valid and no more than a
/// service keeps.
fn validate_routes(routes: Option<&RawRoutes>, per_service: u32) -> Result<ServiceRoutes, String> {
    let templates = match routes {
        None => return Ok(ServiceRoutes::AsProbes),
        Some(RawRoutes::Read(false)) => return Ok(ServiceRoutes::Off),
        Some(RawRoutes::Read(true)) => return Ok(ServiceRoutes::Read(RoutePatterns::NONE)),
        Some(RawRoutes::Templates(templates)) => templates,
    };
    let patterns = RoutePatterns::parse(templates)?;
    if patterns.len() > per_service as usize {
        return Err(format!(
            "{} templates, more than the {per_service} routes a service keeps \
             ([limits] routes_per_service)",
            patterns.len()
        ));
    }
    Ok(ServiceRoutes::Read(patterns))
}

/// `ip:port`, or `:port` for every address (as Prometheus exporters take it): the
/// IPv6 wildcard, which Linux also opens to IPv4 unless `net.ipv6.bindv6only` is set.
/// The path of the metrics (`--web.telemetry-path`): absolute, of letters, digits and
/// `/_.-` (so that it needs no escaping in the landing page's links), and none of
/// the other endpoints'.
pub(super) fn parse_telemetry_path(path: &str) -> Result<String, String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "/_.-".contains(c);
    if !path.starts_with('/') || path.len() < 2 || !path.chars().all(allowed) {
        return Err(format!(
            "{path:?}: want an absolute path such as /metrics, of letters, digits and /_.-"
        ));
    }
    if path == "/healthz" || path == "/debug" || path.starts_with("/debug/") {
        return Err(format!("{path:?} is another endpoint's"));
    }
    Ok(path.to_owned())
}

/// Every address to listen on: at least one, none twice.
fn parse_listen_addresses(texts: &[String]) -> Result<Vec<std::net::SocketAddr>, String> {
    let mut addresses = Vec::with_capacity(texts.len());
    for text in texts {
        let address = parse_listen_address(text)
            .map_err(|error| format!("{error} (want ip:port, or :port for every address)"))?;
        if addresses.contains(&address) {
            return Err(format!("{text:?} is given twice"));
        }
        addresses.push(address);
    }
    if addresses.is_empty() {
        return Err("no address to listen on".to_owned());
    }
    Ok(addresses)
}

pub(super) fn parse_listen_address(text: &str) -> Result<std::net::SocketAddr, String> {
    match text.strip_prefix(':') {
        Some(port) => port
            .parse::<u16>()
            .map(|port| std::net::SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)))
            .map_err(|error| format!("port {port:?}: {error}")),
        None => text.parse().map_err(|error| format!("{error}")),
    }
}
