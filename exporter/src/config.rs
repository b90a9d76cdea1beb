//! Configuration: raw values merged by figment from built-in defaults, the TOML file,
//! `POOLSCOPE_*` environment variables and command-line flags (in that order of
//! precedence, last wins), then validated into `Settings`. Every refusal names the
//! source, the key and the reason.
use std::{net::SocketAddr, path::PathBuf, time::Duration};

use figment::{
    Figment,
    providers::{Env, Format as _, Serialized, Toml},
};
use poolscope_shared::maps;
use regex::Regex;
use serde::{Deserialize, Serialize};

/// Environment variable prefix; nested keys use `__`, e.g. `POOLSCOPE_WEB__LISTEN_ADDRESS`.
pub const ENV_PREFIX: &str = "POOLSCOPE_";
/// Top-level tables of the file, the only names taken from the environment.
const SECTIONS: [&str; 8] = [
    "web",
    "log",
    "discovery",
    "probes",
    "pools",
    "stacks",
    "profiles",
    "limits",
];
/// Default address: localhost only, the port of no other well-known exporter.
pub const DEFAULT_LISTEN_ADDRESS: &str = "127.0.0.1:9435";

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawConfig {
    pub web: RawWeb,
    pub log: RawLog,
    pub discovery: RawDiscovery,
    pub probes: RawProbes,
    pub pools: RawPools,
    pub stacks: RawStacks,
    pub profiles: RawProfiles,
    pub limits: RawLimits,
    pub targets: Vec<RawTarget>,
}

impl Default for RawConfig {
    fn default() -> Self {
        Self {
            web: RawWeb {
                listen_address: DEFAULT_LISTEN_ADDRESS.to_owned(),
                max_concurrent_scrapes: 4,
                scrape_timeout: Duration::from_secs(10),
                scrape_timeout_offset: Duration::from_millis(500),
                debug_endpoints: DebugAccess::Localhost,
            },
            log: RawLog {
                level: "info".to_owned(),
            },
            discovery: RawDiscovery {
                rescan_interval: Duration::from_secs(5),
                procfs_root: PathBuf::from("/proc"),
            },
            probes: RawProbes {
                backend: Backend::Auto,
                bpf_stats: false,
                lock_uprobes: Vec::new(),
                sampling_hz: 49,
            },
            pools: RawPools {
                utilization_window: Duration::from_secs(10),
            },
            stacks: RawStacks {
                offcpu: true,
                offcpu_min: Duration::from_millis(1),
                offcpu_idle: false,
                interval: Duration::from_secs(60),
                keep: 10,
                memory_limit_bytes: 64 << 20,
                saturation_queue_depth: 0,
                saturation_duration: Duration::from_secs(5),
            },
            profiles: RawProfiles {
                max_sessions: 4,
                max_duration: Duration::from_secs(120),
                min_hz: 1,
                max_hz: 1000,
                default_hz: 99,
                max_response_bytes: 32 << 20,
            },
            limits: RawLimits {
                max_series: 20_000,
                max_services: 256,
                max_pools: 512,
                watched_processes: 16_384,
                threads: 65_536,
                connections: 65_536,
                locks: poolscope_shared::MAX_LOCKS,
                lock_stacks: poolscope_shared::MAX_LOCK_STACKS,
                stacks: poolscope_shared::MAX_STACKS,
                stack_counts: poolscope_shared::MAX_STACK_COUNTS,
                degraded_for: Duration::from_secs(300),
            },
            targets: Vec::new(),
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawWeb {
    pub listen_address: String,
    pub max_concurrent_scrapes: u32,
    #[serde(with = "humantime_serde")]
    pub scrape_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub scrape_timeout_offset: Duration,
    pub debug_endpoints: DebugAccess,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawLog {
    pub level: String,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawDiscovery {
    #[serde(with = "humantime_serde")]
    pub rescan_interval: Duration,
    pub procfs_root: PathBuf,
}

/// Who may use `/debug/*` (`[web] debug_endpoints`): stacks, thread and lock
/// listings and profiling sessions say much about the host and cost CPU.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DebugAccess {
    /// Only clients on a loopback address (also through `kubectl port-forward`).
    #[default]
    Localhost,
    /// Every client of the metrics listener.
    All,
    /// Nobody: 404.
    Off,
}

/// Request-correlation backend (DESIGN §2).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    #[default]
    Auto,
    Socket,
    Syscall,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawProbes {
    pub backend: Backend,
    /// Keep `kernel.bpf_stats_enabled` on while running. Off by default: the kernel
    /// then times every program run, which cost ~75 ns per run on our test VMs
    /// (`cargo xtask bench`). `bpf_run_*` also count when an operator enables it.
    pub bpf_stats: bool,
    /// Services (by name; `"*"` for all) whose processes get uprobes on
    /// `pthread_mutex_lock`. Off by default: each call then traps into the kernel,
    /// contended or not (README, "Lock waits").
    pub lock_uprobes: Vec<String>,
    /// On-CPU stack samples per second on each CPU (1 to 1000; 0: none). An odd
    /// rate keeps clear of periodic work in step with the sampler.
    pub sampling_hz: u32,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawStacks {
    /// Off-CPU stacks: where watched threads block, weighted by how long.
    pub offcpu: bool,
    /// Shorter blocks are not recorded.
    #[serde(with = "humantime_serde")]
    pub offcpu_min: Duration,
    /// Also the blocks of threads waiting for work (`reason="idle"`): off by default,
    /// since an event loop blocks after every burst and each capture costs ~2 µs.
    pub offcpu_idle: bool,
    /// A snapshot of the stacks is kept every interval.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Snapshots kept, newest first, within `memory_limit_bytes`.
    pub keep: usize,
    pub memory_limit_bytes: u64,
    /// A snapshot is also taken when a service's `queue_depth` stays above this for
    /// `saturation_duration` (0: never).
    pub saturation_queue_depth: u64,
    #[serde(with = "humantime_serde")]
    pub saturation_duration: Duration,
}

/// On-demand profiling sessions (`/debug/pprof/profile`).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawProfiles {
    /// Sessions running at once (0: the endpoint is off); at most 8.
    pub max_sessions: u32,
    /// Longest `seconds` a session may ask for.
    #[serde(with = "humantime_serde")]
    pub max_duration: Duration,
    /// The `hz` a session may ask for, and the one it gets when it does not ask.
    pub min_hz: u32,
    pub max_hz: u32,
    pub default_hz: u32,
    /// Largest response: the lightest stacks are left out beyond it (and counted).
    pub max_response_bytes: u64,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawPools {
    /// The window of `pool_utilization_ratio`.
    #[serde(with = "humantime_serde")]
    pub utilization_window: Duration,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawLimits {
    pub max_series: usize,
    pub max_services: u32,
    /// Thread pools over all services (each holds ~2 kB per CPU in the kernel).
    pub max_pools: u32,
    pub watched_processes: u32,
    /// Threads of watched processes followed at once.
    pub threads: u32,
    pub connections: u32,
    /// Locks (process, futex address, stack) with wait statistics for
    /// `/debug/locks`, 1.8 kB each; and the distinct stacks they began at, 1 kB each.
    pub locks: u32,
    pub lock_stacks: u32,
    /// Distinct user or kernel stacks per snapshot drain (each of the three stack
    /// maps, 1 kB per entry); and (stack, pool, reason) counters per drain.
    pub stacks: u32,
    pub stack_counts: u32,
    /// How long a loss keeps poolscope degraded after its counter last rose.
    #[serde(with = "humantime_serde")]
    pub degraded_for: Duration,
}

/// One `[[targets]]` entry; every selector given must match.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawTarget {
    pub service: Option<String>,
    pub pids: Vec<u32>,
    pub comm: Option<String>,
    pub exe: Option<String>,
    pub port: Ports,
    pub cgroup: Option<String>,
}

/// `port = 8080` or `port = [8080, 8443]`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Ports {
    #[default]
    None,
    One(u16),
    Many(Vec<u16>),
}

impl Ports {
    fn to_vec(&self) -> Vec<u16> {
        match self {
            Self::None => Vec::new(),
            Self::One(port) => vec![*port],
            Self::Many(ports) => ports.clone(),
        }
    }
}

/// Values given on the command line; `None` leaves the key to the other sources.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub config_file: Option<PathBuf>,
    pub listen_address: Option<String>,
    pub log_level: Option<String>,
    /// `--web.config.file`: TLS and basic auth (`web/webconfig/`), not part of the TOML
    /// configuration.
    pub web_config_file: Option<PathBuf>,
}

/// A refused configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// Validated settings, ready to use.
#[derive(Clone, Debug)]
pub struct Settings {
    pub listen_address: SocketAddr,
    pub scrapes: ScrapeLimits,
    pub debug_endpoints: DebugAccess,
    pub log_level: tracing::level_filters::LevelFilter,
    pub rescan_interval: Duration,
    pub procfs_root: PathBuf,
    pub backend: Backend,
    pub bpf_stats: bool,
    pub lock_uprobes: Vec<String>,
    pub max_series: usize,
    pub limits: Limits,
    pub degraded_for: Duration,
    pub utilization_window: Duration,
    pub snapshots: SnapshotSettings,
    pub profiles: ProfileLimits,
    /// Empty: auto-discover every process with a listening TCP socket.
    pub targets: Vec<TargetRule>,
}

/// The sizes of the kernel's maps and arrays (`[limits]`), fixed when the programs
/// load: one type for the configuration, the loader, the capacities the health advice
/// names, and the reload's list of what needs a restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub watched_processes: u32,
    /// `CONNS` (syscall backend) and `ADOPT`.
    pub connections: u32,
    /// Entries of the per-service arrays.
    pub max_services: u32,
    /// Entries of the per-pool arrays.
    pub max_pools: u32,
    pub threads: u32,
    pub locks: u32,
    pub lock_stacks: u32,
    /// Each of the three `STACKS` maps.
    pub stacks: u32,
    pub stack_counts: u32,
}

impl Limits {
    /// Each limit under its configuration key.
    pub fn keyed(&self) -> [(&'static str, u32); 9] {
        [
            ("limits.watched_processes", self.watched_processes),
            ("limits.connections", self.connections),
            ("limits.max_services", self.max_services),
            ("limits.max_pools", self.max_pools),
            ("limits.threads", self.threads),
            ("limits.locks", self.locks),
            ("limits.lock_stacks", self.lock_stacks),
            ("limits.stacks", self.stacks),
            ("limits.stack_counts", self.stack_counts),
        ]
    }

    /// The key of the limit that sizes kernel map `map`, if one does.
    pub fn key_of(map: &str) -> Option<&'static str> {
        Some(match map {
            maps::CONNS | maps::ADOPT => "limits.connections",
            maps::WATCHED => "limits.watched_processes",
            maps::THREADS | maps::THREAD_POOLS => "limits.threads",
            maps::LOCKS => "limits.locks",
            maps::LOCK_STACKS => "limits.lock_stacks",
            maps::STACK_COUNTS => "limits.stack_counts",
            maps::STACK_MAPS => "limits.stacks",
            _ => return None,
        })
    }

    /// The size of kernel map `map`, if a limit sets it.
    pub fn size_of(&self, map: &str) -> Option<u32> {
        let key = Self::key_of(map)?;
        self.keyed()
            .into_iter()
            .find_map(|(limit, size)| (limit == key).then_some(size))
    }
}

/// Stack sampling and snapshots (`[probes] sampling_hz`, `[stacks]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotSettings {
    pub sampling_hz: u32,
    /// `None`: no off-CPU stacks.
    pub offcpu_min: Option<Duration>,
    pub offcpu_idle: bool,
    pub interval: Duration,
    pub keep: usize,
    pub memory_limit_bytes: u64,
    /// (threshold, duration); `None`: no saturation snapshots.
    pub saturation: Option<(u64, Duration)>,
}

/// Bounds on scrapes of `/metrics` (`[web]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScrapeLimits {
    /// Scrapes gathered at once; more are refused (503).
    pub max_concurrent: u32,
    /// The longest a scrape may take when the scraper sends no
    /// `X-Prometheus-Scrape-Timeout-Seconds`.
    pub timeout: Duration,
    /// Taken off the scraper's timeout, so that our 503 reaches it before it gives up.
    pub timeout_offset: Duration,
}

/// Limits of the on-demand profiling sessions (`[profiles]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProfileLimits {
    pub max_sessions: u32,
    pub max_duration: Duration,
    pub min_hz: u32,
    pub max_hz: u32,
    pub default_hz: u32,
    pub max_response_bytes: u64,
}

/// A validated `[[targets]]` entry.
#[derive(Clone, Debug)]
pub struct TargetRule {
    pub service: Option<String>,
    pub pids: Vec<u32>,
    pub comm: Option<Regex>,
    pub exe: Option<Regex>,
    pub ports: Vec<u16>,
    pub cgroup: Option<String>,
}

impl Settings {
    /// The keys whose values differ from the `running` settings' and take effect only
    /// on restart (the programs and the listener are set up once).
    pub fn restart_changes(&self, running: &Settings) -> Vec<&'static str> {
        let mut changed: Vec<&'static str> = [
            (
                "web.listen_address",
                self.listen_address != running.listen_address,
            ),
            (
                "web.max_concurrent_scrapes, web.scrape_timeout, web.scrape_timeout_offset",
                self.scrapes != running.scrapes,
            ),
            (
                "web.debug_endpoints",
                self.debug_endpoints != running.debug_endpoints,
            ),
            (
                "discovery.procfs_root",
                self.procfs_root != running.procfs_root,
            ),
            ("probes.backend", self.backend != running.backend),
            ("probes.bpf_stats", self.bpf_stats != running.bpf_stats),
            (
                "probes.sampling_hz",
                self.snapshots.sampling_hz != running.snapshots.sampling_hz,
            ),
            (
                "stacks.offcpu, stacks.offcpu_min",
                self.snapshots.offcpu_min != running.snapshots.offcpu_min,
            ),
            (
                "stacks.offcpu_idle",
                self.snapshots.offcpu_idle != running.snapshots.offcpu_idle,
            ),
        ]
        .into_iter()
        .filter_map(|(key, differs)| differs.then_some(key))
        .collect();
        changed.extend(
            self.limits
                .keyed()
                .into_iter()
                .zip(running.limits.keyed())
                .filter_map(|((key, new), (_, old))| (new != old).then_some(key)),
        );
        changed
    }
}

impl Settings {
    /// Loads and validates the configuration from every source.
    pub fn load(overrides: &Overrides) -> Result<Self, ConfigError> {
        let figment = figment(overrides)?;
        let raw: RawConfig = figment.extract().map_err(|error| describe(&error))?;
        validate(&raw, &figment)
    }
}

fn figment(overrides: &Overrides) -> Result<Figment, ConfigError> {
    let mut figment = Figment::from(Serialized::defaults(RawConfig::default()));
    if let Some(path) = &overrides.config_file {
        // figment ignores a missing file; a named file that is missing is an error.
        if let Err(error) = std::fs::metadata(path) {
            return Err(ConfigError::File {
                path: path.clone(),
                reason: error.to_string(),
            });
        }
        figment = figment.merge(Toml::file_exact(path));
    }
    figment = figment.merge(
        // Only `<SECTION>__<KEY>` names: other POOLSCOPE_* variables are not ours
        // (Kubernetes sets POOLSCOPE_SERVICE_HOST and friends for a Service of that name).
        Env::prefixed(ENV_PREFIX)
            .filter(|key| {
                SECTIONS.iter().any(|section| {
                    key.as_str()
                        .to_ascii_lowercase()
                        .starts_with(&format!("{section}__"))
                })
            })
            .split("__"),
    );
    if let Some(address) = &overrides.listen_address {
        figment = figment.merge(Serialized::default("web.listen_address", address));
    }
    if let Some(level) = &overrides.log_level {
        figment = figment.merge(Serialized::default("log.level", level));
    }
    Ok(figment)
}

/// Where a value came from: "TOML file (/etc/poolscope.toml)", "`POOLSCOPE_` environment
/// variable(s)", ...
fn source_name(metadata: Option<&figment::Metadata>) -> String {
    metadata.map_or_else(
        || "configuration".to_owned(),
        |metadata| match &metadata.source {
            Some(source) => format!("{} ({source})", metadata.name),
            None => metadata.name.to_string(),
        },
    )
}

/// Every figment error with its key and source, one per line.
fn describe(errors: &figment::Error) -> ConfigError {
    let lines: Vec<String> = errors
        .clone()
        .into_iter()
        .map(|error| {
            let key = error.path.join(".");
            let source = source_name(error.metadata.as_ref());
            format!("{source}: key `{key}`: {}", error.kind)
        })
        .collect();
    ConfigError::Invalid(lines.join("; "))
}

/// A validation failure for `key`, naming the source that set it.
fn invalid(figment: &Figment, key: &str, reason: impl std::fmt::Display) -> ConfigError {
    let source = source_name(figment.find_metadata(key));
    ConfigError::Invalid(format!("{source}: key `{key}`: {reason}"))
}

fn validate(raw: &RawConfig, figment: &Figment) -> Result<Settings, ConfigError> {
    let listen_address = raw.web.listen_address.parse().map_err(|error| {
        invalid(
            figment,
            "web.listen_address",
            format!("{error} (want ip:port)"),
        )
    })?;
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
        locks: raw.limits.locks,
        lock_stacks: raw.limits.lock_stacks,
        stacks: raw.limits.stacks,
        stack_counts: raw.limits.stack_counts,
    };
    for (key, size) in limits.keyed() {
        positive(key, size.into())?;
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
    let targets = raw
        .targets
        .iter()
        .enumerate()
        .map(|(index, target)| validate_target(target, index, figment))
        .collect::<Result<_, _>>()?;
    Ok(Settings {
        listen_address,
        scrapes,
        debug_endpoints: raw.web.debug_endpoints,
        log_level,
        rescan_interval: raw.discovery.rescan_interval,
        procfs_root: raw.discovery.procfs_root.clone(),
        backend: raw.probes.backend,
        bpf_stats: raw.probes.bpf_stats,
        lock_uprobes: raw.probes.lock_uprobes.clone(),
        max_series: raw.limits.max_series,
        limits,
        degraded_for: raw.limits.degraded_for,
        utilization_window: raw.pools.utilization_window,
        snapshots,
        profiles,
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
        interval: stacks.interval,
        keep: stacks.keep,
        memory_limit_bytes: stacks.memory_limit_bytes,
        saturation: (stacks.saturation_queue_depth > 0)
            .then_some((stacks.saturation_queue_depth, stacks.saturation_duration)),
    })
}

fn validate_target(
    target: &RawTarget,
    index: usize,
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

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn load_toml(toml: &str) -> Result<Settings, ConfigError> {
        let dir = tempfile::tempdir().map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let path = dir.path().join("poolscope.toml");
        std::fs::write(&path, toml).map_err(|e| ConfigError::Invalid(e.to_string()))?;
        Settings::load(&Overrides {
            config_file: Some(path),
            ..Overrides::default()
        })
    }

    fn error_of(toml: &str) -> String {
        match load_toml(toml) {
            Ok(settings) => panic!("accepted {toml:?} as {settings:?}"),
            Err(error) => error.to_string(),
        }
    }

    #[test]
    fn restart_changes_name_what_a_reload_cannot_apply() -> Result<(), ConfigError> {
        let running = load_toml("")?;
        let reloaded = load_toml(
            "[probes]\nbackend = \"syscall\"\n[limits]\nthreads = 7\nmax_series = 9\n\
             [discovery]\nrescan_interval = \"3s\"\n",
        )?;
        // max_series and the rescan interval apply on reload.
        assert_eq!(
            reloaded.restart_changes(&running),
            ["probes.backend", "limits.threads"]
        );
        assert!(running.restart_changes(&running).is_empty());
        Ok(())
    }

    #[test]
    fn each_limit_sizes_its_maps() -> Result<(), ConfigError> {
        let limits = load_toml("[limits]\nstacks = 11\nconnections = 12\n")?.limits;
        assert_eq!(limits.size_of(maps::STACK_MAPS), Some(11));
        assert_eq!(limits.size_of(maps::ADOPT), Some(12));
        assert_eq!(limits.size_of(maps::CONNS), Some(12));
        assert_eq!(Limits::key_of(maps::CONNS), Some("limits.connections"));
        // Fixed or unbounded: no limit sets them.
        assert_eq!(limits.size_of(maps::PENDING_CALLS), None);
        assert_eq!(limits.size_of(maps::SOCK_CONNS), None);
        Ok(())
    }

    #[test]
    fn defaults_listen_on_localhost_and_auto_discover() -> Result<(), ConfigError> {
        let settings = load_toml("")?;
        assert_eq!(
            settings.listen_address,
            DEFAULT_LISTEN_ADDRESS.parse().expect("addr")
        );
        assert!(settings.listen_address.ip().is_loopback());
        assert!(settings.targets.is_empty());
        assert_eq!(settings.backend, Backend::Auto);
        Ok(())
    }

    #[test]
    fn full_file_is_read() -> Result<(), ConfigError> {
        let settings = load_toml(
            r#"
            [web]
            listen_address = "0.0.0.0:9999"
            [discovery]
            rescan_interval = "2s"
            [probes]
            backend = "syscall"
            [[targets]]
            service = "api"
            comm = "^java$"
            port = 8080
            [[targets]]
            pids = [1, 2]
            port = [80, 443]
            cgroup = "nginx.service"
            "#,
        )?;
        assert_eq!(settings.listen_address.port(), 9999);
        assert_eq!(settings.rescan_interval, Duration::from_secs(2));
        assert_eq!(settings.backend, Backend::Syscall);
        assert_eq!(settings.targets.len(), 2);
        assert_eq!(settings.targets[0].ports, vec![8080]);
        assert_eq!(settings.targets[1].ports, vec![80, 443]);
        Ok(())
    }

    #[test]
    fn unknown_key_names_file_and_key() {
        let error = error_of("[web]\nlisten_adress = \"x\"\n");
        assert!(error.contains("poolscope.toml"), "{error}");
        assert!(error.contains("listen_adress"), "{error}");
    }

    #[test]
    fn bad_values_name_key_and_reason() {
        let error = error_of("[web]\nlisten_address = \"localhost\"\n");
        assert!(
            error.contains("web.listen_address") && error.contains("poolscope.toml"),
            "{error}"
        );
        let error = error_of("[probes]\nbackend = \"kprobe\"\n");
        assert!(
            error.contains("backend") && error.contains("kprobe"),
            "{error}"
        );
        let error = error_of("[[targets]]\ncomm = \"(\"\n");
        assert!(error.contains("targets[0].comm"), "{error}");
        let error = error_of("[[targets]]\nservice = \"x\"\n");
        assert!(error.contains("needs at least one"), "{error}");
        let error = error_of("[log]\nlevel = \"loud\"\n");
        assert!(error.contains("log.level"), "{error}");
        let error = error_of("[discovery]\nrescan_interval = \"soon\"\n");
        assert!(error.contains("rescan_interval"), "{error}");
        let error = error_of("this is not toml");
        assert!(error.contains("poolscope.toml"), "{error}");
    }

    #[test]
    fn stack_settings_are_checked() -> Result<(), ConfigError> {
        let settings = load_toml("")?;
        assert_eq!(settings.snapshots.sampling_hz, 49);
        assert_eq!(
            settings.snapshots.offcpu_min,
            Some(Duration::from_millis(1))
        );
        assert_eq!(settings.snapshots.saturation, None);
        let settings = load_toml(
            "[probes]\nsampling_hz = 0\n[stacks]\noffcpu = false\nsaturation_queue_depth = 8\n",
        )?;
        assert_eq!(settings.snapshots.sampling_hz, 0);
        assert_eq!(settings.snapshots.offcpu_min, None);
        assert_eq!(
            settings.snapshots.saturation,
            Some((8, Duration::from_secs(5)))
        );
        for (toml, key) in [
            ("[probes]\nsampling_hz = 1001\n", "probes.sampling_hz"),
            ("[stacks]\ninterval = \"500ms\"\n", "stacks.interval"),
            ("[stacks]\nkeep = 0\n", "stacks.keep"),
            (
                "[stacks]\nmemory_limit_bytes = 10\n",
                "stacks.memory_limit_bytes",
            ),
            ("[stacks]\noffcpu_min = \"0s\"\n", "stacks.offcpu_min"),
            (
                "[stacks]\nsaturation_queue_depth = 1\nsaturation_duration = \"0s\"\n",
                "stacks.saturation_duration",
            ),
            ("[limits]\nstacks = 0\n", "limits.stacks"),
        ] {
            let error = error_of(toml);
            assert!(error.contains(key), "{toml}: {error}");
        }
        Ok(())
    }

    #[test]
    fn profile_limits_are_checked() -> Result<(), ConfigError> {
        let limits = load_toml("")?.profiles;
        assert_eq!(
            (limits.max_sessions, limits.default_hz, limits.max_duration),
            (4, 99, Duration::from_secs(120))
        );
        let limits =
            load_toml("[profiles]\nmax_sessions = 0\nmin_hz = 10\ndefault_hz = 10\n")?.profiles;
        assert_eq!((limits.max_sessions, limits.min_hz), (0, 10));
        for (toml, key) in [
            ("[profiles]\nmax_sessions = 9\n", "profiles.max_sessions"),
            (
                "[profiles]\nmax_duration = \"10ms\"\n",
                "profiles.max_duration",
            ),
            ("[profiles]\nmin_hz = 0\n", "profiles.min_hz"),
            ("[profiles]\nmax_hz = 5000\n", "profiles.min_hz"),
            ("[profiles]\ndefault_hz = 2000\n", "profiles.default_hz"),
            (
                "[profiles]\nmax_response_bytes = 100\n",
                "profiles.max_response_bytes",
            ),
        ] {
            let error = error_of(toml);
            assert!(error.contains(key), "{toml}: {error}");
        }
        Ok(())
    }

    #[test]
    fn missing_file_is_refused() {
        let result = Settings::load(&Overrides {
            config_file: Some(PathBuf::from("/nonexistent/poolscope.toml")),
            ..Overrides::default()
        });
        let error = result.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains("/nonexistent/poolscope.toml"), "{error}");
    }

    #[test]
    fn flags_override_the_file() -> Result<(), ConfigError> {
        let dir = tempfile::tempdir().map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[web]\nlisten_address = \"127.0.0.1:1\"\n")
            .map_err(|e| ConfigError::Invalid(e.to_string()))?;
        let settings = Settings::load(&Overrides {
            config_file: Some(path),
            listen_address: Some("127.0.0.1:2".into()),
            log_level: Some("debug".into()),
            ..Overrides::default()
        })?;
        assert_eq!(settings.listen_address.port(), 2);
        assert_eq!(
            settings.log_level,
            tracing::level_filters::LevelFilter::DEBUG
        );
        Ok(())
    }
}

/// Property tests (the config parser's fuzz target): any file is accepted or refused
/// with a reason, never a panic; a refused `[limits]` value names its key.
#[cfg(test)]
mod properties {
    use proptest::prelude::*;

    use super::tests::load_toml;

    const LIMITS: [&str; 13] = [
        "max_series",
        "max_services",
        "max_pools",
        "watched_processes",
        "threads",
        "connections",
        "locks",
        "lock_stacks",
        "stacks",
        "stack_counts",
        "degraded_for",
        "nonsense",
        "max_series.x",
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// A refusal names the file that was refused and what in it is wrong: a
        /// message of a prefix alone, or of another source, fails.
        #[test]
        fn any_text_is_accepted_or_refused_with_a_reason(text in any::<String>()) {
            if let Err(error) = load_toml(&text) {
                let message = error.to_string();
                prop_assert!(message.contains("poolscope.toml"), "{}", message);
                let reason = message.rsplit(": ").next().unwrap_or_default();
                prop_assert!(reason.trim().len() > 3, "{}", message);
            }
        }

        #[test]
        fn a_refused_limit_names_its_key(
            key in proptest::sample::select(LIMITS.as_slice()),
            value in prop_oneof![
                any::<i64>().prop_map(|v| v.to_string()),
                any::<bool>().prop_map(|v| v.to_string()),
                "\"[a-z0-9 ]{0,8}\"",
                Just("1.5".to_owned()),
                Just("[]".to_owned()),
            ],
        ) {
            if let Err(error) = load_toml(&format!("[limits]\n{key} = {value}\n")) {
                let message = error.to_string();
                let named = key.split('.').next().unwrap_or(key);
                prop_assert!(message.contains(named), "{} = {}: {}", key, value, message);
            }
        }
    }
}
