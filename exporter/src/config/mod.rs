//! Configuration: raw values merged by figment from built-in defaults, the TOML file,
//! `POOLSCOPE_*` environment variables and command-line flags (in that order of
//! precedence, last wins), then validated into `Settings`. Every refusal names the
//! source, the key and the reason.
use std::{net::SocketAddr, path::PathBuf, time::Duration};

use figment::{
    Figment,
    providers::{Env, Format as _, Serialized, Toml},
};
use regex::Regex;

mod limits;
mod raw;
mod route_patterns;
mod validate;

pub use limits::{Limits, ProfileLimits, ScrapeLimits};
pub use raw::*;
pub use route_patterns::{RoutePatterns, ServiceRoutes};
use validate::validate;

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

/// Values given on the command line; `None` leaves the key to the other sources.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub config_file: Option<PathBuf>,
    /// `--web.listen-address`, as often as given (none: the configuration's).
    pub listen_addresses: Vec<String>,
    pub telemetry_path: Option<String>,
    pub log_level: Option<String>,
    pub log_format: Option<String>,
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
    /// Where `/metrics`, `/healthz` and `/debug/*` are served; at least one.
    pub listen_addresses: Vec<SocketAddr>,
    /// Where `/metrics` is served (`web.telemetry_path`).
    pub telemetry_path: String,
    pub scrapes: ScrapeLimits,
    pub debug_endpoints: DebugAccess,
    pub log_level: tracing::level_filters::LevelFilter,
    pub log_format: LogFormat,
    pub rescan_interval: Duration,
    pub procfs_root: PathBuf,
    /// The kubelet's container log links (`<pod>_<namespace>_<container>-<id>.log`),
    /// which name pod containers.
    pub pod_logs_dir: PathBuf,
    /// The cgroup v2 hierarchy the paths in procfs's `cgroup` files are under (CPU
    /// quotas, for capacity).
    pub cgroupfs_root: PathBuf,
    pub backend: Backend,
    pub bpf_stats: bool,
    pub response_status: bool,
    pub routes: bool,
    pub lock_uprobes: Vec<String>,
    pub max_series: usize,
    pub limits: Limits,
    pub degraded_for: Duration,
    pub utilization_window: Duration,
    pub snapshots: SnapshotSettings,
    pub profiles: ProfileLimits,
    pub metrics: MetricsSettings,
    /// Empty: auto-discover every process with a listening TCP socket.
    pub targets: Vec<TargetRule>,
}

/// How histograms are exposed (`[metrics]`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MetricsSettings {
    pub octaves_per_bucket: OctavesPerBucket,
    /// Pools' run-queue and lock-wait histograms with their buckets; otherwise
    /// their `_sum` and `_count` only.
    pub pool_histogram_buckets: bool,
    /// Histograms also carry native buckets (read by scrapers of the protobuf
    /// exposition with native histograms on).
    pub native_histograms: bool,
}

impl Default for MetricsSettings {
    fn default() -> Self {
        Self {
            octaves_per_bucket: OctavesPerBucket::default(),
            pool_histogram_buckets: false,
            native_histograms: true,
        }
    }
}

/// Octaves between two classic bucket bounds: one the kernel's fine buckets (8 per
/// octave) give exactly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OctavesPerBucket(f64);

impl OctavesPerBucket {
    pub const ALLOWED: [f64; 5] = [0.5, 1.0, 2.0, 3.0, 4.0];

    pub fn new(octaves: f64) -> Option<Self> {
        Self::ALLOWED.contains(&octaves).then_some(Self(octaves))
    }

    /// Eighths of an octave between two bounds.
    pub fn eighths(self) -> usize {
        (self.0 * 8.0) as usize
    }
}

impl Default for OctavesPerBucket {
    fn default() -> Self {
        Self(3.0)
    }
}

/// Stack sampling and snapshots (`[probes] sampling_hz`, `[stacks]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotSettings {
    pub sampling_hz: u32,
    /// `None`: no off-CPU stacks.
    pub offcpu_min: Option<Duration>,
    pub offcpu_idle: bool,
    /// Blocks per second per CPU captured in full, and the sampling ratio beyond.
    pub offcpu_full_rate: u64,
    pub offcpu_sample_one_in: u32,
    pub interval: Duration,
    pub keep: usize,
    pub memory_limit_bytes: u64,
    pub unwind_memory_bytes: u64,
    /// (threshold, duration); `None`: no saturation snapshots.
    pub saturation: Option<(u64, Duration)>,
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
    pub options: ServiceOptions,
}

/// How a service is read, from the rule that named it (the defaults without one).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceOptions {
    /// See [`raw::RawTarget::http2_worker_threads`]; `None`: detected.
    pub http2_worker_threads: Option<bool>,
    /// See [`raw::RawTarget::routes`].
    pub routes: ServiceRoutes,
}

impl Settings {
    /// Whether any service's routes may be read: `[probes] routes`, or a rule that
    /// reads them. The programs look no further when none may.
    pub fn any_routes_read(&self) -> bool {
        self.routes
            || self
                .targets
                .iter()
                .any(|rule| matches!(rule.options.routes, ServiceRoutes::Read(_)))
    }

    /// The keys whose values differ from the `running` settings' and take effect only
    /// on restart (the programs and the listener are set up once).
    pub fn restart_changes(&self, running: &Settings) -> Vec<&'static str> {
        let mut changed: Vec<&'static str> = [
            (
                "web.listen_address",
                self.listen_addresses != running.listen_addresses,
            ),
            (
                "web.telemetry_path",
                self.telemetry_path != running.telemetry_path,
            ),
            ("log.format", self.log_format != running.log_format),
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
            (
                "discovery.pod_logs_dir",
                self.pod_logs_dir != running.pod_logs_dir,
            ),
            ("probes.backend", self.backend != running.backend),
            ("probes.bpf_stats", self.bpf_stats != running.bpf_stats),
            (
                "probes.response_status",
                self.response_status != running.response_status,
            ),
            ("probes.routes", self.routes != running.routes),
            (
                "targets.routes (the first service whose routes are read)",
                self.any_routes_read() && !running.any_routes_read(),
            ),
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
            (
                "stacks.offcpu_full_rate, stacks.offcpu_sample_one_in",
                (
                    self.snapshots.offcpu_full_rate,
                    self.snapshots.offcpu_sample_one_in,
                ) != (
                    running.snapshots.offcpu_full_rate,
                    running.snapshots.offcpu_sample_one_in,
                ),
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
    if !overrides.listen_addresses.is_empty() {
        figment = figment.merge(Serialized::default(
            "web.listen_address",
            &overrides.listen_addresses,
        ));
    }
    if let Some(path) = &overrides.telemetry_path {
        figment = figment.merge(Serialized::default("web.telemetry_path", path));
    }
    if let Some(format) = &overrides.log_format {
        figment = figment.merge(Serialized::default("log.format", format));
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

#[cfg(test)]
mod tests;

#[cfg(test)]
mod properties;
