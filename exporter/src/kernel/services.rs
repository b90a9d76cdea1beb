//! The requests part of [`Kernel`]: `WATCHED`, the listen ports, the connection maps
//! and the per-service counters ([`Requests`]), the kernel's side of the watched set
//! ([`WatchTable`]), and their read for a scrape.
use std::{
    collections::BTreeMap,
    os::fd::{AsFd as _, OwnedFd},
    sync::Arc,
};

use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData, MapError, PerCpuArray, PerCpuValues},
};
use poolscope_shared::{
    Conn, ListenKey, PendingCall, Phase, RequestTimes, ServiceCounters, StreamWorkers, SyscallSlot,
    Watched, conn_key_tgid, fd_conn_key,
    maps::{self, CountedMap},
    syscall_counter_index, watched_port_bit,
};

use super::{
    BPF_NOEXIST, Backend, Kernel, KernelError, MapSizes, ServedConnection, WatchTable,
    batch::BatchMap, mapping::SharedValues, reread::Reread, syscalls::syscall_number, take,
};
use crate::config::{Limits, ServiceRoutes};

/// The maps of the watched processes, their listeners, connections and requests.
pub(super) struct Requests {
    watched: HashMap<MapData, u32, Watched>,
    conns: HashMap<MapData, u64, Conn>,
    service_epochs: Array<MapData, u32>,
    /// Services that hand HTTP/2 streams to worker threads (`WatchTable::set_stream_workers`).
    stream_workers: Array<MapData, u32>,
    listen_ports: HashMap<MapData, ListenKey, u32>,
    socket_namespaces: bool,
    watched_ports: Array<MapData, u64>,
    /// How many TCP sockets began or stopped listening on the host (`sock_state`).
    listen_changes: Array<MapData, u64>,
    adopt: HashMap<MapData, u64, Conn>,
    adopting: Array<MapData, u32>,
    /// The kernel's BTF says where a socket's inode is (socket backend adoption).
    socket_inodes: bool,
    /// Each service's request times, mapped (one for all CPUs), and as last read.
    request_times: SharedValues<RequestTimes>,
    request_times_read: Reread<RequestTimes>,
    pending_calls: HashMap<MapData, u32, PendingCall>,
    syscall_counts: PerCpuArray<MapData, u64>,
    service_counters: PerCpuArray<MapData, ServiceCounters>,
    /// `WATCHED` and `SERVICE_COUNTERS`, which a scrape reads whole, for batch reads.
    watched_batch: BatchMap,
    service_counters_batch: BatchMap,
    /// `CONNS`, which a recount reads whole.
    conns_batch: BatchMap,
    /// `SOCK_CONNS` and `H2_CONNS`, which only sock_diag reads from user space.
    sock_conns: StorageMap,
    h2_conns: StorageMap,
}

/// A socket-storage map as sock_diag hands over its values: a descriptor of it (a
/// duplicate of aya's) and its id, which names it in the reply.
#[derive(Debug)]
pub struct StorageMap {
    pub fd: OwnedFd,
    pub id: u32,
}

impl StorageMap {
    fn named(ebpf: &Ebpf, name: &'static str) -> Result<Self, KernelError> {
        let Some(aya::maps::Map::SkStorage(map)) = ebpf.map(name) else {
            return Err(KernelError::MissingMap(name));
        };
        let id = map
            .info()
            .map_err(|source| KernelError::Map { map: name, source })?
            .id();
        Ok(Self {
            fd: map
                .fd()
                .as_fd()
                .try_clone_to_owned()
                .map_err(KernelError::Descriptor)?,
            id,
        })
    }

    /// Another descriptor of the same map, for a read outside the core lock.
    fn duplicate(&self) -> std::io::Result<Self> {
        Ok(Self {
            fd: self.fd.try_clone()?,
            id: self.id,
        })
    }
}

impl Requests {
    /// The sizes `limits` gives these maps.
    pub fn sizes(limits: &Limits) -> MapSizes {
        vec![
            (maps::WATCHED, limits.watched_processes),
            (maps::CONNS, limits.connections),
            (maps::ADOPT, limits.connections),
            (maps::SERVICE_COUNTERS, limits.max_services),
            (maps::SERVICE_EPOCHS, limits.max_services),
            (maps::REQUEST_TIMES, limits.max_services),
            (maps::PENDING_CALLS, limits.syscalls_in_flight),
            (maps::LISTEN_PORTS, limits.listen_ports),
        ]
    }

    /// Takes the request and connection maps out of `ebpf`, with `REQUEST_TIMES`
    /// mapped for `services` ids. `socket_namespaces` and `socket_inodes`: whether
    /// the kernel's BTF gave the offsets the socket programs read for them.
    pub fn take(
        ebpf: &mut Ebpf,
        services: u32,
        socket_namespaces: bool,
        socket_inodes: bool,
    ) -> Result<Self, KernelError> {
        // Descriptors and mappings first: they find their maps by name in `ebpf`.
        let watched_batch = BatchMap::named(ebpf, maps::WATCHED)?;
        let service_counters_batch = BatchMap::named(ebpf, maps::SERVICE_COUNTERS)?;
        let conns_batch = BatchMap::named(ebpf, maps::CONNS)?;
        let request_times = SharedValues::of(ebpf, maps::REQUEST_TIMES, services)?;
        Ok(Self {
            watched: take(ebpf, maps::WATCHED)?,
            conns: take(ebpf, maps::CONNS)?,
            service_epochs: take(ebpf, maps::SERVICE_EPOCHS)?,
            stream_workers: take(ebpf, maps::STREAM_WORKERS)?,
            listen_ports: take(ebpf, maps::LISTEN_PORTS)?,
            socket_namespaces,
            watched_ports: take(ebpf, maps::WATCHED_PORTS)?,
            listen_changes: take(ebpf, maps::LISTEN_CHANGES)?,
            adopt: take(ebpf, maps::ADOPT)?,
            adopting: take(ebpf, maps::ADOPTING)?,
            socket_inodes,
            request_times,
            request_times_read: Reread::default(),
            pending_calls: take(ebpf, maps::PENDING_CALLS)?,
            syscall_counts: take(ebpf, maps::SYSCALL_COUNTS)?,
            service_counters: take(ebpf, maps::SERVICE_COUNTERS)?,
            watched_batch,
            service_counters_batch,
            conns_batch,
            sock_conns: StorageMap::named(ebpf, maps::SOCK_CONNS)?,
            h2_conns: StorageMap::named(ebpf, maps::H2_CONNS)?,
        })
    }

    /// The count of `LISTEN_CHANGES`; `None` if the read fails.
    pub fn listen_changes(&self) -> Option<u64> {
        self.listen_changes.get(&0, 0).ok()
    }

    /// The connection and request counters of `services`, summed over `cpus`.
    pub fn read_counters(
        &self,
        services: &[u32],
        cpus: usize,
    ) -> Result<BTreeMap<u32, ServiceCounters>, KernelError> {
        self.service_counters_batch
            .sum_by_id::<ServiceCounters>(services, cpus, |total, cpu| {
                *total = total.plus(cpu);
            })
            .map(|sums| sums.into_iter().collect())
            .map_err(|source| KernelError::Batch {
                map: maps::SERVICE_COUNTERS,
                source,
            })
    }

    /// The request times of `services` (with their counters, read just before):
    /// those whose finished count moved since they were last read are read again,
    /// the rest kept.
    pub fn read_request_times(
        &mut self,
        services: &BTreeMap<u32, ServiceCounters>,
    ) -> BTreeMap<u32, Arc<RequestTimes>> {
        let finished: Vec<(u32, u64)> = services
            .iter()
            .map(|(&id, counters)| (id, counters.finished.get()))
            .collect();
        let mapped = &self.request_times;
        self.request_times_read
            .refresh_mapped(&finished, |id| mapped.get(id))
    }

    /// The calls of each syscall slot of `services`, summed over CPUs (syscall
    /// backend: the others count none).
    pub fn read_syscalls(
        &self,
        services: &[u32],
    ) -> Result<BTreeMap<(u32, &'static str), u64>, KernelError> {
        let mut syscalls = BTreeMap::new();
        for &service in services {
            for slot in SyscallSlot::ALL {
                let calls: u64 = self
                    .syscall_counts
                    .get(&syscall_counter_index(service, slot), 0)
                    .map_err(|source| KernelError::Map {
                        map: maps::SYSCALL_COUNTS,
                        source,
                    })?
                    .iter()
                    .sum();
                syscalls.insert((service, slot.name()), calls);
            }
        }
        Ok(syscalls)
    }
}

/// Removes the entries of `service` from a map of connections (`CONNS`, `ADOPT`):
/// how many it removed (one gone meanwhile, closed or adopted, is not).
fn drop_service_connections(map: &mut HashMap<MapData, u64, Conn>, service: u32) -> i64 {
    let keys: Vec<u64> = map
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, conn)| conn.service == service)
        .map(|(key, _)| key)
        .collect();
    keys.iter().filter(|key| map.remove(key).is_ok()).count() as i64
}

/// What [`WatchTable::adopt_connections`] did.
#[derive(Debug, Default)]
pub struct Adopted {
    /// Socket inodes waiting in `ADOPT` for their first event (socket backend).
    pub pending: Vec<u64>,
    /// Entries made `Unserved` (a request waits unread) without a kernel counter.
    pub unserved: u64,
    /// The inserts that failed (a full map): those connections are not followed.
    pub failed: Vec<MapError>,
}
/// The connection state a recount of the gauges reads, as the backend keeps it.
#[derive(Debug)]
pub enum ConnectionState {
    /// In the sockets' storage (socket and tcp backends): `SOCK_CONNS` and
    /// `H2_CONNS`, which sock_diag hands over.
    Sockets { conns: StorageMap, h2: StorageMap },
    /// In `CONNS` (syscall backend): every entry, stale ones included.
    Entries(Vec<(u64, Conn)>),
}

impl Kernel {
    /// Where the connections' state is, for a recount: the socket-storage maps (new
    /// descriptors, for a read that needs no lock), or the syscall backend's entries,
    /// read in a few batches.
    pub fn connection_state(&self) -> std::io::Result<ConnectionState> {
        Ok(match self.backend {
            Backend::Socket | Backend::Tcp => ConnectionState::Sockets {
                conns: self.requests.sock_conns.duplicate()?,
                h2: self.requests.h2_conns.duplicate()?,
            },
            Backend::Syscall => ConnectionState::Entries(self.requests.conns_batch.hash_entries()?),
        })
    }

    /// Each of `services`' epoch (`SERVICE_EPOCHS`): a socket's connection claimed in
    /// another is stale. A service whose read fails is left out.
    pub fn service_epochs(&self, services: &[u32]) -> BTreeMap<u32, u32> {
        services
            .iter()
            .filter_map(|&id| Some((id, self.requests.service_epochs.get(&id, 0).ok()?)))
            .collect()
    }
}

impl WatchTable for Kernel {
    fn backend(&self) -> Backend {
        self.backend
    }

    fn claims_by_namespace(&self) -> bool {
        self.requests.socket_namespaces
    }

    fn set_listen_ports(&mut self, ports: &BTreeMap<ListenKey, u32>) -> Vec<MapError> {
        let mut failed = Vec::new();
        let current: Vec<(ListenKey, u32)> = self
            .requests
            .listen_ports
            .iter()
            .filter_map(Result::ok)
            .collect();
        let bits = |keys: &mut dyn Iterator<Item = &ListenKey>| {
            let mut words: BTreeMap<u32, u64> = BTreeMap::new();
            for key in keys {
                let (word, bit) = watched_port_bit(u16::try_from(key.port).unwrap_or(0));
                *words.entry(word).or_default() |= bit;
            }
            words
        };
        let old_words = bits(&mut current.iter().map(|(key, _)| key));
        let new_words = bits(&mut ports.keys());
        for (&word, &value) in &new_words {
            let old = old_words.get(&word).copied().unwrap_or(0);
            if value & !old != 0
                && let Err(error) = self.requests.watched_ports.set(word, old | value, 0)
            {
                failed.push(error);
            }
        }
        for (key, service) in current {
            if ports.get(&key) != Some(&service) {
                match self.requests.listen_ports.remove(&key) {
                    Ok(()) => self.health.count_own_entries(CountedMap::ListenPorts, -1),
                    Err(error) => failed.push(error),
                }
            }
        }
        for (key, &service) in ports {
            let before = self.requests.listen_ports.get(key, 0).ok();
            if before != Some(service) {
                match self.requests.listen_ports.insert(key, service, 0) {
                    Ok(()) if before.is_none() => {
                        self.health.count_own_entries(CountedMap::ListenPorts, 1);
                    }
                    Ok(()) => {}
                    Err(error) => failed.push(error),
                }
            }
        }
        for (&word, &old) in &old_words {
            let value = new_words.get(&word).copied().unwrap_or(0);
            if old & !value != 0
                && let Err(error) = self.requests.watched_ports.set(word, value, 0)
            {
                failed.push(error);
            }
        }
        failed
    }

    fn watched(&self, pid: u32) -> Option<Watched> {
        self.requests.watched.get(&pid, 0).ok()
    }

    fn watched_pids(&self) -> Vec<(u32, Watched)> {
        // In a few syscalls: a key-by-key walk costs two per pid, read at every scrape.
        self.requests
            .watched_batch
            .hash_entries()
            .unwrap_or_else(|error| {
                tracing::debug!(%error, "batch read of WATCHED failed; reading it key by key");
                self.requests
                    .watched
                    .iter()
                    .filter_map(Result::ok)
                    .collect()
            })
    }

    fn watch(&mut self, pid: u32, watch: Watched) -> Result<(), MapError> {
        self.requests.watched.insert(pid, watch, 0)
    }

    fn unwatch(&mut self, pid: u32, since_ns: u64) {
        if self.watched(pid).is_some_and(|w| w.since_ns == since_ns) {
            // A concurrent exit may have removed it first; either way it is gone.
            let _ = self.requests.watched.remove(&pid);
        }
    }

    fn adopt_blocked_accepts(&mut self, blocked: &[(u32, u64)]) {
        if self.backend != Backend::Syscall {
            return;
        }
        for &(tid, number) in blocked {
            let slot = [SyscallSlot::Accept, SyscallSlot::Accept4]
                .into_iter()
                .find(|slot| {
                    syscall_number(*slot).and_then(|n| u64::try_from(n).ok()) == Some(number)
                });
            let Some(slot) = slot else {
                continue;
            };
            let call = PendingCall {
                slot: slot as u32,
                fd: 0,
                number: number as u32,
                _pad: 0,
            };
            // BPF_NOEXIST: an entry made by the syscall itself is newer than our look.
            if self
                .requests
                .pending_calls
                .insert(tid, call, BPF_NOEXIST)
                .is_ok()
            {
                self.health.count_own_entries(CountedMap::PendingCalls, 1);
            }
        }
    }

    fn adopt_connections(
        &mut self,
        service: u32,
        since_ns: u64,
        pid: u32,
        connections: &[ServedConnection],
        now_ns: u64,
    ) -> Result<Adopted, MapError> {
        let mut adopted = Adopted::default();
        let in_sockets = self.backend.keeps_state_in_sockets();
        // The socket programs check it (see `reset_service`).
        let epoch = if in_sockets {
            self.requests.service_epochs.get(&service, 0)?
        } else {
            0
        };
        // Every connection is tried: one that does not fit is counted and the rest,
        // already made, must still be accounted for.
        for connection in connections {
            let phase = if connection.unread {
                Phase::Unserved
            } else {
                Phase::Responded
            };
            let conn = Conn {
                service,
                phase: phase as u32,
                owner_since_ns: if in_sockets { 0 } else { since_ns },
                arrive_ns: now_ns,
                start_ns: 0,
                end_ns: 0,
                next_arrive_ns: 0,
                server_tid: 0,
                epoch,
                seen_write_seq: 0,
                status: 0,
                adopted: u8::from(in_sockets),
                upgrade_checked: 0,
                greeting_limit: 0,
                greeted: 0,
                greeting_limit_set: 0,
                line_len: 0,
                line: [0; poolscope_shared::ROUTE_BYTES / 8],
            };
            // BPF_NOEXIST: an entry the kernel made itself is newer than our look.
            let (map, inserted) = match self.backend {
                Backend::Syscall => (
                    CountedMap::Conns,
                    self.requests
                        .conns
                        .insert(fd_conn_key(pid, connection.fd), conn, BPF_NOEXIST),
                ),
                Backend::Socket | Backend::Tcp if self.requests.socket_inodes => (
                    CountedMap::Adopt,
                    self.requests
                        .adopt
                        .insert(connection.inode, conn, BPF_NOEXIST),
                ),
                Backend::Socket | Backend::Tcp => continue,
            };
            match inserted {
                Ok(()) => {
                    self.health.count_own_entries(map, 1);
                    if self.backend.keeps_state_in_sockets() {
                        adopted.pending.push(connection.inode);
                    }
                    if phase == Phase::Unserved {
                        adopted.unserved += 1;
                    }
                }
                Err(MapError::SyscallError(error))
                    if error.io_error.raw_os_error() == Some(libc::EEXIST) => {}
                Err(error) => adopted.failed.push(error),
            }
        }
        if !adopted.pending.is_empty() {
            self.set_adopting(true)?;
        }
        Ok(adopted)
    }

    fn forget_adoption(&mut self, inode: u64) -> Option<Phase> {
        let conn = self.requests.adopt.get(&inode, 0).ok()?;
        self.requests.adopt.remove(&inode).ok()?;
        self.health.count_own_entries(CountedMap::Adopt, -1);
        Some(Phase::from_u32(conn.phase))
    }

    fn awaits_adoption(&self, inode: u64) -> bool {
        self.requests.adopt.get(&inode, 0).is_ok()
    }

    fn set_adopting(&mut self, adopting: bool) -> Result<(), MapError> {
        self.requests.adopting.set(0, u32::from(adopting), 0)
    }

    fn purge_connections(&mut self, pid: u32, since_ns: u64) -> Vec<(u32, Phase)> {
        if self.backend != Backend::Syscall {
            return Vec::new();
        }
        let stale: Vec<(u64, Conn)> = self
            .requests
            .conns
            .iter()
            .filter_map(Result::ok)
            .filter(|(key, conn)| conn_key_tgid(*key) == pid && conn.owner_since_ns == since_ns)
            .collect();
        let purged: Vec<(u32, Phase)> = stale
            .into_iter()
            .filter(|(key, _)| self.requests.conns.remove(key).is_ok())
            .map(|(_, conn)| (conn.service, Phase::from_u32(conn.phase)))
            .collect();
        self.health
            .count_own_entries(CountedMap::Conns, -(purged.len() as i64));
        purged
    }

    fn set_stream_workers(&mut self, service: u32, workers: StreamWorkers) -> Result<(), MapError> {
        self.requests.stream_workers.set(service, workers as u32, 0)
    }

    fn name_routes(&mut self, service: u32, routes: &ServiceRoutes) -> Result<(), MapError> {
        self.routes.name_routes(service, routes)
    }

    fn reset_service(&mut self, service: u32) -> Result<(), MapError> {
        // Its connections may outlive its watch (a reload unwatched a process that
        // still serves them): left here, their events would count under whichever
        // service gets the id next.
        // The socket backend's connections live in their sockets, out of our reach:
        // a new epoch makes the kernel drop them at their next event.
        let dropped = drop_service_connections(&mut self.requests.conns, service);
        self.health.count_own_entries(CountedMap::Conns, -dropped);
        let dropped = drop_service_connections(&mut self.requests.adopt, service);
        self.health.count_own_entries(CountedMap::Adopt, -dropped);
        let epoch = self.requests.service_epochs.get(&service, 0)?;
        self.requests
            .service_epochs
            .set(service, epoch.wrapping_add(1), 0)?;
        self.requests.stream_workers.set(service, 0, 0)?;
        self.routes.reset_service(service)?;
        // The times before their count: a record landing in between then leaves
        // times ahead of the count (read again when it moves), never behind it.
        self.requests.request_times.reset(service);
        self.requests.request_times_read.forget(service);
        let zero_counters = PerCpuValues::try_from(vec![ServiceCounters::default(); self.cpus])?;
        self.requests
            .service_counters
            .set(service, zero_counters, 0)?;
        for slot in SyscallSlot::ALL {
            let zeros = PerCpuValues::try_from(vec![0u64; self.cpus])?;
            self.requests
                .syscall_counts
                .set(syscall_counter_index(service, slot), zeros, 0)?;
        }
        Ok(())
    }
}
