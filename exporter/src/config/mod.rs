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
mod validate;

pub use limits::{Limits, ProfileLimits, ScrapeLimits};
pub use raw::*;
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
    /// The cgroup v2 hierarchy the paths in procfs's `cgroup` files are under (CPU
    /// quotas, for capacity).
    pub cgroupfs_root: PathBuf,
    pub backend: Backend,
    pub bpf_stats: bool,
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
    /// See [`raw::RawTarget::http2_worker_threads`].
    pub http2_worker_threads: bool,
}

impl Settings {
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
mod tests {
    use poolscope_shared::maps;

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
    fn the_telemetry_path_is_absolute_plain_and_no_other_endpoints() -> Result<(), ConfigError> {
        assert_eq!(load_toml("")?.telemetry_path, "/metrics");
        let settings = load_toml("[web]\ntelemetry_path = \"/probe/v1.metrics\"\n")?;
        assert_eq!(settings.telemetry_path, "/probe/v1.metrics");
        for bad in [
            "",
            "/",
            "metrics",
            "/a b",
            "/a?b",
            "/<x>",
            "/healthz",
            "/debug/threads",
        ] {
            let refused = load_toml(&format!("[web]\ntelemetry_path = \"{bad}\"\n"));
            let Err(ConfigError::Invalid(message)) = refused else {
                panic!("{bad:?} accepted");
            };
            assert!(message.contains("web.telemetry_path"), "{bad:?}: {message}");
        }
        Ok(())
    }

    #[test]
    fn a_listen_address_of_only_a_port_is_every_address() -> Result<(), ConfigError> {
        let settings = load_toml("[web]\nlisten_address = \":9435\"\n")?;
        assert_eq!(
            settings.listen_addresses,
            ["[::]:9435".parse().expect("address")]
        );
        let settings = load_toml("[web]\nlisten_address = \"10.0.0.1:80\"\n")?;
        assert_eq!(
            settings.listen_addresses,
            ["10.0.0.1:80".parse().expect("address")]
        );
        let settings = load_toml("[web]\nlisten_address = [\"127.0.0.1:80\", \"10.0.0.1:80\"]\n")?;
        assert_eq!(
            settings.listen_addresses,
            [
                "127.0.0.1:80".parse().expect("address"),
                "10.0.0.1:80".parse().expect("address")
            ]
        );
        for bad in [
            "[]",
            "[\"127.0.0.1:80\", \"127.0.0.1:80\"]",
            "[\"127.0.0.1:80\", \"x\"]",
        ] {
            let refused = load_toml(&format!("[web]\nlisten_address = {bad}\n"));
            let Err(ConfigError::Invalid(message)) = refused else {
                panic!("{bad:?} accepted");
            };
            assert!(message.contains("web.listen_address"), "{bad:?}: {message}");
        }
        for bad in [":", ":http", ":70000", "localhost:9435", "9435"] {
            let refused = load_toml(&format!("[web]\nlisten_address = \"{bad}\"\n"));
            let Err(ConfigError::Invalid(message)) = refused else {
                panic!("{bad:?} accepted");
            };
            assert!(message.contains("web.listen_address"), "{bad:?}: {message}");
        }
        Ok(())
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
        let limits =
            load_toml("[limits]\nstacks = 11\nconnections = 12\nsyscalls_in_flight = 13\nmutex_calls_in_flight = 14\n")?.limits;
        assert_eq!(limits.size_of(maps::STACK_MAPS), Some(11));
        assert_eq!(limits.size_of(maps::ADOPT), Some(12));
        assert_eq!(limits.size_of(maps::CONNS), Some(12));
        assert_eq!(limits.size_of(maps::PENDING_CALLS), Some(13));
        assert_eq!(limits.size_of(maps::MUTEX_CALLS), Some(14));
        assert_eq!(Limits::key_of(maps::CONNS), Some("limits.connections"));
        // Socket storage, one entry per socket: no limit sets it.
        assert_eq!(limits.size_of(maps::SOCK_CONNS), None);
        Ok(())
    }

    #[test]
    fn defaults_listen_on_localhost_and_auto_discover() -> Result<(), ConfigError> {
        let settings = load_toml("")?;
        assert_eq!(
            settings.listen_addresses,
            [DEFAULT_LISTEN_ADDRESS.parse().expect("addr")]
        );
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
        assert_eq!(
            settings.listen_addresses,
            ["0.0.0.0:9999".parse().expect("addr")]
        );
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
        assert_eq!(
            (
                settings.snapshots.offcpu_full_rate,
                settings.snapshots.offcpu_sample_one_in
            ),
            (1000, 8)
        );
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
                "[stacks]\noffcpu_sample_one_in = 3\n",
                "stacks.offcpu_sample_one_in",
            ),
            (
                "[stacks]\noffcpu_sample_one_in = 2048\n",
                "stacks.offcpu_sample_one_in",
            ),
            (
                "[stacks]\noffcpu_sample_one_in = 0\n",
                "stacks.offcpu_sample_one_in",
            ),
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
    fn thread_slots_are_a_power_of_two() -> Result<(), ConfigError> {
        assert_eq!(load_toml("")?.limits.thread_slots, 16384);
        assert_eq!(
            load_toml("[limits]\nthread_slots = 1\n")?
                .limits
                .thread_slots,
            1
        );
        for slots in ["3", "12000", "2097152"] {
            let toml = format!("[limits]\nthread_slots = {slots}\n");
            let error = error_of(&toml);
            assert!(
                error.contains("limits.thread_slots") && error.contains("power of two"),
                "{toml}: {error}"
            );
        }
        Ok(())
    }

    #[test]
    fn stack_maps_stay_clear_of_the_shortened_stack_bit() -> Result<(), ConfigError> {
        assert_eq!(
            load_toml("[limits]\nstacks = 16777216\n")?.limits.stacks,
            1 << 24
        );
        for key in ["stacks", "lock_stacks"] {
            for size in ["16777217", "1073741824"] {
                let toml = format!("[limits]\n{key} = {size}\n");
                let error = error_of(&toml);
                assert!(
                    error.contains(&format!("limits.{key}")) && error.contains("at most"),
                    "{toml}: {error}"
                );
            }
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
            listen_addresses: vec!["127.0.0.1:2".into(), "127.0.0.1:3".into()],
            log_level: Some("debug".into()),
            ..Overrides::default()
        })?;
        assert_eq!(
            settings.listen_addresses,
            [
                "127.0.0.1:2".parse().expect("addr"),
                "127.0.0.1:3".parse().expect("addr")
            ]
        );
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

    const LIMITS: [&str; 18] = [
        "max_series",
        "max_services",
        "max_pools",
        "watched_processes",
        "threads",
        "thread_slots",
        "connections",
        "locks",
        "lock_stacks",
        "stacks",
        "stack_counts",
        "syscalls_in_flight",
        "mutex_calls_in_flight",
        "listen_ports",
        "downstreams",
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
