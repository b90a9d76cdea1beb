//! The tables of the watched set, behind a trait so that discovery can be tested
//! without a kernel: which processes are watched (`WATCHED`), which listeners claim
//! connections (`LISTEN_PORTS`, `WATCHED_PORTS`), the connections themselves
//! (`CONNS`, `ADOPT`) and the per-service counters a freed id must lose; and the
//! thread tables the pools keep (`THREADS`, `THREAD_POOLS`, `POOL_STATS`).
use std::collections::BTreeMap;

use aya::maps::MapError;
use poolscope_shared::{ListenKey, Phase, StreamWorkers, Thread, Watched};

use super::{Adopted, Backend};
use crate::config::ServiceRoutes;

/// A connection that a process accepted from one of its own listeners and still
/// holds open, as discovery found it in procfs (it may predate poolscope): what
/// [`WatchTable::adopt_connections`] follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServedConnection {
    pub fd: u32,
    pub inode: u64,
    /// Bytes wait in its receive queue: a request nobody has read yet.
    pub unread: bool,
}

/// The kernel's per-process and per-service tables, as the watched set sees them.
/// [`super::Kernel`] is the real one.
pub trait WatchTable {
    /// The request-path backend the programs were loaded with.
    fn backend(&self) -> Backend;

    /// Whether the socket backend tells listeners apart by network namespace (the
    /// kernel's BTF gave the offsets it reads); if not, keys carry
    /// [`ListenKey::ANY_NAMESPACE`].
    fn claims_by_namespace(&self) -> bool;

    /// Makes `LISTEN_PORTS` equal to `ports` ((namespace, local port) → service id),
    /// and `WATCHED_PORTS` hold their ports. A new port's bit is set before its
    /// listener is, and an old one's cleared after, so that no handshake's later
    /// events are filtered out. Every write is tried: the errors of those that failed
    /// (a key that does not fit a full `LISTEN_PORTS` fails, a changed one is still
    /// updated).
    fn set_listen_ports(&mut self, ports: &BTreeMap<ListenKey, u32>) -> Vec<MapError>;

    /// The watch entry of `pid`, if any.
    fn watched(&self, pid: u32) -> Option<Watched>;

    /// Every entry of `WATCHED`.
    fn watched_pids(&self) -> Vec<(u32, Watched)>;

    /// Watches `pid` as `watch` says (replacing an entry it had).
    fn watch(&mut self, pid: u32, watch: Watched) -> Result<(), MapError>;

    /// Stops watching `pid` if its entry is still the one made at `since_ns`.
    fn unwatch(&mut self, pid: u32, since_ns: u64);

    /// Syscall backend: threads of a newly watched process that are already blocked in
    /// accept (`blocked`: tid, syscall number) get the entry their syscall entry would
    /// have made, so that the connection they return is followed. The exit checks the
    /// number again, so a thread that left accept meanwhile is not misread.
    fn adopt_blocked_accepts(&mut self, blocked: &[(u32, u64)]);

    /// Follows connections that process `(pid, since_ns)` of `service` held before it
    /// was watched: the syscall backend gets their entries at once (keyed by fd), the
    /// socket backend in `ADOPT` (keyed by inode) for its first event on each. An
    /// entry with unread bytes is `Unserved` from now; the rest are between requests.
    /// Returns the inodes put in `ADOPT` and the number of `Unserved` entries made,
    /// which no kernel counter entered.
    fn adopt_connections(
        &mut self,
        service: u32,
        since_ns: u64,
        pid: u32,
        connections: &[ServedConnection],
        now_ns: u64,
    ) -> Result<Adopted, MapError>;

    /// Drops the `ADOPT` entry of a connection that closed before any event adopted
    /// it. Returns its phase if this call removed it (the kernel had not taken it).
    fn forget_adoption(&mut self, inode: u64) -> Option<Phase>;

    /// Whether the kernel has yet to take the `ADOPT` entry of `inode`.
    fn awaits_adoption(&self, inode: u64) -> bool;

    /// Tells the socket programs whether `ADOPT` may hold entries.
    fn set_adopting(&mut self, adopting: bool) -> Result<(), MapError>;

    /// Removes the connections of the process `(pid, since_ns)`, which exited without
    /// closing them one by one (syscall backend; the socket backend sees the kernel
    /// close them). Returns the service and phase of each.
    fn purge_connections(&mut self, pid: u32, since_ns: u64) -> Vec<(u32, Phase)>;

    /// Zeroes the counters of a service id, and drops its connections, before the id
    /// is reused for another service.
    fn reset_service(&mut self, service: u32) -> Result<(), MapError>;

    /// Tells the scheduler programs which threads of `service` HTTP/2 streams are
    /// handed to (`STREAM_WORKERS`).
    fn set_stream_workers(&mut self, service: u32, workers: StreamWorkers) -> Result<(), MapError>;

    /// Reads `service`'s routes or not (`ROUTE_SERVICES`), named by its templates,
    /// from its next request on.
    fn name_routes(&mut self, service: u32, routes: &ServiceRoutes) -> Result<(), MapError>;
}

/// The kernel's per-thread and per-pool tables, as the thread pools see them.
/// [`super::Kernel`] is the real one.
pub trait ThreadTable {
    /// Follows a thread found running (not created while watched): its first entry,
    /// unless its creation or an earlier look made one already.
    fn follow_thread(&mut self, tid: u32, thread: Thread) -> Result<(), MapError>;

    /// Puts thread `tid` in pool `pool` from now on.
    fn set_thread_pool(&mut self, tid: u32, pool: u32) -> Result<(), MapError>;

    /// Stops following a thread of a process no longer watched.
    fn forget_thread(&mut self, tid: u32);

    /// Zeroes the stats of a pool id before it is reused for another pool.
    fn reset_pool(&mut self, pool: u32) -> Result<(), MapError>;

    /// Drops what the kernel keeps per (pool, peer) of pools whose service is gone:
    /// left there, each would hold a `DOWNSTREAM_WAITS` entry until its id is reused.
    fn release_pools(&mut self, pools: &[u32]);
}

/// In-memory tables for unit tests of what writes them: each map as a plain
/// collection, with a capacity on `WATCHED` to test a full map.
#[cfg(test)]
pub mod fake {
    use std::collections::{BTreeMap, BTreeSet};

    use aya::{maps::MapError, sys::SyscallError};
    use poolscope_shared::{ListenKey, Phase, StreamWorkers, Thread, Watched};

    use super::{ThreadTable, WatchTable};
    use crate::{
        config::ServiceRoutes,
        kernel::{Adopted, Backend, ServedConnection},
    };

    #[derive(Debug)]
    pub struct FakeTables {
        pub backend: Backend,
        pub watched: BTreeMap<u32, Watched>,
        /// Entries `WATCHED` holds before an insert fails with E2BIG, as a full hash
        /// map does.
        pub watched_capacity: usize,
        pub listen_ports: BTreeMap<ListenKey, u32>,
        /// Connections (pid, fd) with their service and phase (syscall backend).
        pub connections: BTreeMap<(u32, u32), (u32, Phase)>,
        pub services_reset: Vec<u32>,
        /// Services whose `STREAM_WORKERS` entry is not `Detect`.
        pub stream_workers: BTreeMap<u32, StreamWorkers>,
        /// Services whose rule says whether their routes are read.
        pub route_services: BTreeMap<u32, ServiceRoutes>,
        pub threads: BTreeMap<u32, Thread>,
        pub thread_pools: BTreeMap<u32, u32>,
        pub pools_reset: BTreeSet<u32>,
        pub pools_released: BTreeSet<u32>,
    }

    impl Default for FakeTables {
        fn default() -> Self {
            Self {
                backend: Backend::Syscall,
                watched: BTreeMap::new(),
                watched_capacity: usize::MAX,
                listen_ports: BTreeMap::new(),
                connections: BTreeMap::new(),
                services_reset: Vec::new(),
                stream_workers: BTreeMap::new(),
                route_services: BTreeMap::new(),
                threads: BTreeMap::new(),
                thread_pools: BTreeMap::new(),
                pools_reset: BTreeSet::new(),
                pools_released: BTreeSet::new(),
            }
        }
    }

    fn full() -> MapError {
        MapError::SyscallError(SyscallError {
            call: "bpf_map_update_elem",
            io_error: std::io::Error::from_raw_os_error(libc::E2BIG),
        })
    }

    impl WatchTable for FakeTables {
        fn backend(&self) -> Backend {
            self.backend
        }

        fn claims_by_namespace(&self) -> bool {
            true
        }

        fn set_listen_ports(&mut self, ports: &BTreeMap<ListenKey, u32>) -> Vec<MapError> {
            self.listen_ports = ports.clone();
            Vec::new()
        }

        fn watched(&self, pid: u32) -> Option<Watched> {
            self.watched.get(&pid).copied()
        }

        fn watched_pids(&self) -> Vec<(u32, Watched)> {
            self.watched.iter().map(|(&pid, &w)| (pid, w)).collect()
        }

        fn watch(&mut self, pid: u32, watch: Watched) -> Result<(), MapError> {
            if !self.watched.contains_key(&pid) && self.watched.len() >= self.watched_capacity {
                return Err(full());
            }
            self.watched.insert(pid, watch);
            Ok(())
        }

        fn unwatch(&mut self, pid: u32, since_ns: u64) {
            if self.watched(pid).is_some_and(|w| w.since_ns == since_ns) {
                self.watched.remove(&pid);
            }
        }

        fn adopt_blocked_accepts(&mut self, _blocked: &[(u32, u64)]) {}

        fn adopt_connections(
            &mut self,
            service: u32,
            _since_ns: u64,
            pid: u32,
            connections: &[ServedConnection],
            _now_ns: u64,
        ) -> Result<Adopted, MapError> {
            let mut adopted = Adopted::default();
            for connection in connections {
                let phase = if connection.unread {
                    adopted.unserved += 1;
                    Phase::Unserved
                } else {
                    Phase::Responded
                };
                self.connections
                    .insert((pid, connection.fd), (service, phase));
            }
            Ok(adopted)
        }

        fn forget_adoption(&mut self, _inode: u64) -> Option<Phase> {
            None
        }

        fn awaits_adoption(&self, _inode: u64) -> bool {
            false
        }

        fn set_adopting(&mut self, _adopting: bool) -> Result<(), MapError> {
            Ok(())
        }

        fn purge_connections(&mut self, pid: u32, _since_ns: u64) -> Vec<(u32, Phase)> {
            let keys: Vec<(u32, u32)> = self
                .connections
                .range((pid, 0)..=(pid, u32::MAX))
                .map(|(key, _)| *key)
                .collect();
            keys.iter()
                .filter_map(|key| self.connections.remove(key))
                .collect()
        }

        fn reset_service(&mut self, service: u32) -> Result<(), MapError> {
            self.services_reset.push(service);
            self.connections.retain(|_, (owner, _)| *owner != service);
            self.stream_workers.remove(&service);
            Ok(())
        }

        fn set_stream_workers(
            &mut self,
            service: u32,
            workers: StreamWorkers,
        ) -> Result<(), MapError> {
            if workers == StreamWorkers::Detect {
                self.stream_workers.remove(&service);
            } else {
                self.stream_workers.insert(service, workers);
            }
            Ok(())
        }

        fn name_routes(&mut self, service: u32, routes: &ServiceRoutes) -> Result<(), MapError> {
            if *routes == ServiceRoutes::AsProbes {
                self.route_services.remove(&service);
            } else {
                self.route_services.insert(service, routes.clone());
            }
            Ok(())
        }
    }

    impl ThreadTable for FakeTables {
        fn follow_thread(&mut self, tid: u32, thread: Thread) -> Result<(), MapError> {
            self.threads.entry(tid).or_insert(thread);
            Ok(())
        }

        fn set_thread_pool(&mut self, tid: u32, pool: u32) -> Result<(), MapError> {
            self.thread_pools.insert(tid, pool);
            Ok(())
        }

        fn forget_thread(&mut self, tid: u32) {
            self.threads.remove(&tid);
            self.thread_pools.remove(&tid);
        }

        fn reset_pool(&mut self, pool: u32) -> Result<(), MapError> {
            self.pools_reset.insert(pool);
            Ok(())
        }

        fn release_pools(&mut self, pools: &[u32]) {
            self.pools_released.extend(pools);
        }
    }
}
