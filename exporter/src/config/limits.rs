//! Validated limits: the sizes of the kernel's maps ([`Limits`]), of scrapes
//! ([`ScrapeLimits`]) and of on-demand profiling sessions ([`ProfileLimits`]).
use std::time::Duration;

use poolscope_shared::maps;

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
    /// `THREAD_ENTRIES` and `THREAD_OWNERS`: a power of two. Not a capacity that
    /// fills (a thread whose slot is taken goes to `THREADS`), so no map names it.
    pub thread_slots: u32,
    pub locks: u32,
    pub lock_stacks: u32,
    /// Each of the three `STACKS` maps.
    pub stacks: u32,
    pub stack_counts: u32,
    /// `PENDING_CALLS`: threads inside a followed syscall at once.
    pub syscalls_in_flight: u32,
    /// `MUTEX_CALLS`: threads inside a probed `pthread_mutex_lock` at once.
    pub mutex_calls_in_flight: u32,
    /// `LISTEN_PORTS`: the listeners of watched services (socket backend).
    pub listen_ports: u32,
    /// `DOWNSTREAM_WAITS`: (pool, peer) pairs.
    pub downstreams: u32,
    /// Routes kept in user space over all services, and per service (caps, no
    /// kernel map).
    pub routes: u32,
    pub routes_per_service: u32,
    /// `ROUTE_EVENTS`: finished requests the ring holds between two drains.
    pub route_events: u32,
    /// HTTP/2 connections whose header tables user space keeps at once (no kernel
    /// map).
    pub http2_decoded_connections: u32,
}

impl Limits {
    /// Each limit under its configuration key.
    pub fn keyed(&self) -> [(&'static str, u32); 18] {
        [
            ("limits.watched_processes", self.watched_processes),
            ("limits.connections", self.connections),
            ("limits.max_services", self.max_services),
            ("limits.max_pools", self.max_pools),
            ("limits.threads", self.threads),
            ("limits.thread_slots", self.thread_slots),
            ("limits.locks", self.locks),
            ("limits.lock_stacks", self.lock_stacks),
            ("limits.stacks", self.stacks),
            ("limits.stack_counts", self.stack_counts),
            ("limits.syscalls_in_flight", self.syscalls_in_flight),
            ("limits.mutex_calls_in_flight", self.mutex_calls_in_flight),
            ("limits.listen_ports", self.listen_ports),
            ("limits.downstreams", self.downstreams),
            ("limits.routes", self.routes),
            ("limits.routes_per_service", self.routes_per_service),
            ("limits.route_events", self.route_events),
            (
                "limits.http2_decoded_connections",
                self.http2_decoded_connections,
            ),
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
            maps::PENDING_CALLS => "limits.syscalls_in_flight",
            maps::MUTEX_CALLS => "limits.mutex_calls_in_flight",
            maps::LISTEN_PORTS => "limits.listen_ports",
            maps::DOWNSTREAM_WAITS => "limits.downstreams",
            _ => return None,
        })
    }

    /// Slots per stack map in `STACK_COPIED`: a stack id of either kind of stack map
    /// is below it.
    pub fn stack_copy_stride(&self) -> u32 {
        self.stacks.max(self.lock_stacks)
    }

    /// The size of kernel map `map`, if a limit sets it.
    pub fn size_of(&self, map: &str) -> Option<u32> {
        let key = Self::key_of(map)?;
        self.keyed()
            .into_iter()
            .find_map(|(limit, size)| (limit == key).then_some(size))
    }
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
