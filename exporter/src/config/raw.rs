//! The configuration as written ([`RawConfig`] and its `Raw*` sections): the keys of
//! the TOML file, the environment and the flags, with their defaults, before validation.
use std::{path::PathBuf, time::Duration};

use serde::{Deserialize, Serialize};

use super::DEFAULT_LISTEN_ADDRESS;

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
    pub metrics: RawMetrics,
    pub targets: Vec<RawTarget>,
}

impl Default for RawConfig {
    fn default() -> Self {
        Self {
            web: RawWeb {
                listen_address: ListenAddresses::One(DEFAULT_LISTEN_ADDRESS.to_owned()),
                telemetry_path: "/metrics".to_owned(),
                max_concurrent_scrapes: 4,
                scrape_timeout: Duration::from_secs(10),
                scrape_timeout_offset: Duration::from_millis(500),
                debug_endpoints: DebugAccess::Localhost,
            },
            log: RawLog {
                level: "info".to_owned(),
                format: LogFormat::Text,
            },
            discovery: RawDiscovery {
                rescan_interval: Duration::from_secs(5),
                procfs_root: PathBuf::from("/proc"),
                pod_logs_dir: PathBuf::from("/var/log/containers"),
                cgroupfs_root: PathBuf::from("/sys/fs/cgroup"),
            },
            probes: RawProbes {
                backend: Backend::Auto,
                bpf_stats: false,
                response_status: true,
                routes: false,
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
                offcpu_full_rate: 1000,
                offcpu_sample_one_in: 8,
                interval: Duration::from_secs(60),
                keep: 10,
                memory_limit_bytes: 64 << 20,
                unwind_memory_bytes: 32 << 20,
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
                thread_slots: poolscope_shared::THREAD_SLOTS,
                connections: 65_536,
                locks: poolscope_shared::MAX_LOCKS,
                lock_stacks: poolscope_shared::MAX_LOCK_STACKS,
                stacks: poolscope_shared::MAX_STACKS,
                stack_counts: poolscope_shared::MAX_STACK_COUNTS,
                syscalls_in_flight: poolscope_shared::MAX_SYSCALLS_IN_FLIGHT,
                mutex_calls_in_flight: poolscope_shared::MAX_MUTEX_CALLS_IN_FLIGHT,
                listen_ports: poolscope_shared::MAX_LISTEN_PORTS,
                downstreams: poolscope_shared::MAX_DOWNSTREAMS,
                routes: 1024,
                routes_per_service: 50,
                route_events: 29000,
                http2_decoded_connections: 4096,
                degraded_for: Duration::from_secs(300),
            },
            metrics: RawMetrics {
                octaves_per_bucket: 3.0,
                pool_histogram_buckets: false,
                native_histograms: true,
            },
            targets: Vec::new(),
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawWeb {
    pub listen_address: ListenAddresses,
    pub telemetry_path: String,
    pub max_concurrent_scrapes: u32,
    #[serde(with = "humantime_serde")]
    pub scrape_timeout: Duration,
    #[serde(with = "humantime_serde")]
    pub scrape_timeout_offset: Duration,
    pub debug_endpoints: DebugAccess,
}

/// `[web] listen_address`: one address, or a list of them (as `--web.listen-address`
/// repeated).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum ListenAddresses {
    One(String),
    Many(Vec<String>),
}

impl Default for ListenAddresses {
    fn default() -> Self {
        Self::Many(Vec::new())
    }
}

impl ListenAddresses {
    pub fn as_slice(&self) -> &[String] {
        match self {
            Self::One(address) => std::slice::from_ref(address),
            Self::Many(addresses) => addresses,
        }
    }
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawLog {
    pub level: String,
    pub format: LogFormat,
}

/// How the log is written (`[log] format`, `--log.format`).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// tracing's readable lines.
    #[default]
    Text,
    /// `ts=… level=… msg=…`, as Prometheus writes.
    Logfmt,
    /// One JSON object per line.
    Json,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawDiscovery {
    #[serde(with = "humantime_serde")]
    pub rescan_interval: Duration,
    pub procfs_root: PathBuf,
    pub cgroupfs_root: PathBuf,
    pub pod_logs_dir: PathBuf,
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
    Tcp,
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
    /// Read the status line of each HTTP/1 answer (`responses_total` by class, and
    /// interim answers that do not end their request). On by default; off saves one
    /// read of the server's buffer per request (docs/configuration.md).
    pub response_status: bool,
    /// Read the first bytes of each HTTP/1 request and hand every finished request
    /// to user space for its route (`route_*` families). Off by default: on, it
    /// costs a read of the server's buffer and a ring record per request
    /// (docs/configuration.md).
    pub routes: bool,
    /// Services (by name; `"*"` for all) whose processes get uprobes on
    /// `pthread_mutex_lock`. Off by default: each call then traps into the kernel,
    /// contended or not (docs/metrics.md, "Lock waits").
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
    /// Blocks per second per CPU whose stacks are all captured; beyond it, one in
    /// `offcpu_sample_one_in` is, at random, and weighs for that many.
    pub offcpu_full_rate: u64,
    /// The sampling ratio past the full rate: a power of two, 1 (every block) to 1024.
    pub offcpu_sample_one_in: u32,
    /// A snapshot of the stacks is kept every interval.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Snapshots kept, newest first, within `memory_limit_bytes`.
    pub keep: usize,
    pub memory_limit_bytes: u64,
    /// Memory for the unwind tables of the modules whose stacks are unwound (0: no
    /// unwinding, frame pointers only).
    pub unwind_memory_bytes: u64,
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
    /// Slots of the thread array (a power of two): a followed thread whose slot
    /// (its tid modulo this) is free costs the scheduler programs no hash lookup.
    pub thread_slots: u32,
    pub connections: u32,
    /// Locks (process, futex address, stack) with wait statistics for
    /// `/debug/locks`, 1.8 kB each; and the distinct stacks they began at, 1 kB each.
    pub locks: u32,
    pub lock_stacks: u32,
    /// Distinct user or kernel stacks per snapshot drain (each of the three stack
    /// maps, 1 kB per entry); and (stack, pool, reason) counters per drain.
    pub stacks: u32,
    pub stack_counts: u32,
    /// Threads inside a followed syscall at once.
    pub syscalls_in_flight: u32,
    /// Threads inside a probed `pthread_mutex_lock` at once.
    pub mutex_calls_in_flight: u32,
    /// Listening (namespace, port, address) keys of watched services.
    pub listen_ports: u32,
    /// (pool, peer) pairs whose network waits are kept apart.
    pub downstreams: u32,
    /// Routes kept over all services, and per service; a service's requests beyond
    /// count under `route="other"`.
    pub routes: u32,
    pub routes_per_service: u32,
    /// Finished requests the route ring holds between two drains (100 ms apart).
    pub route_events: u32,
    /// HTTP/2 connections whose header tables are kept at once (routes read); the
    /// streams of connections beyond count under `route="unknown"`.
    pub http2_decoded_connections: u32,
    /// How long a loss keeps poolscope degraded after its counter last rose.
    #[serde(with = "humantime_serde")]
    pub degraded_for: Duration,
}

/// How histograms are exposed. Each classic histogram costs one
/// series per bucket per service or pool: the defaults keep an idle service under 40
/// series and a busy one with two pools under 100.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RawMetrics {
    /// Octaves between two bucket bounds: 0.5, 1, 2, 3 or 4 (0.5 gives 48 buckets
    /// from 8.2 µs to 103 s; 3 gives 8, from 8.2 µs to 17 s).
    pub octaves_per_bucket: f64,
    /// Pools' run-queue and lock-wait histograms with buckets; off: `_sum` and
    /// `_count` only (the mean wait).
    pub pool_histogram_buckets: bool,
    /// Histograms with native buckets too, for scrapers that ask for the protobuf
    /// exposition (a Prometheus with native histograms on keeps them instead of the
    /// classic buckets); off, such scrapers get the classic buckets.
    pub native_histograms: bool,
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
    /// Whether the service hands each HTTP/2 stream to a thread of a pool until its
    /// response, so that its open streams no worker serves are waiting (`true`), or
    /// serves every open stream at once (`false`). Unset: detected from which threads
    /// answer its streams.
    pub http2_worker_threads: Option<bool>,
    /// Whether the service's routes are read (`true`, `false`; unset: as `[probes]
    /// routes`), or the route templates (`"/users/:id"`, `"/static/*"`) that name them
    /// first, which reads them.
    pub routes: Option<RawRoutes>,
}

/// `routes = true` or `routes = ["/users/:id"]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(untagged)]
pub enum RawRoutes {
    Read(bool),
    Templates(Vec<String>),
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
    pub(super) fn to_vec(&self) -> Vec<u16> {
        match self {
            Self::None => Vec::new(),
            Self::One(port) => vec![*port],
            Self::Many(ports) => ports.clone(),
        }
    }
}
