//! `WATCHED`, the listen ports, the connection maps and the per-service counters:
//! the kernel's side of the watched set ([`WatchTable`]).
use std::collections::BTreeMap;

use aya::maps::{HashMap, MapData, MapError, PerCpuValues};
use poolscope_shared::{
    Conn, ListenKey, PendingCall, Phase, ServiceCounters, SyscallSlot, Watched, conn_key_tgid,
    fd_conn_key, maps::CountedMap, syscall_counter_index, watched_port_bit,
};

use super::{BPF_NOEXIST, Backend, Kernel, ServedConnection, WatchTable, syscalls::syscall_number};

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

/// What [`Kernel::adopt_connections`] did.
#[derive(Debug, Default)]
pub struct Adopted {
    /// Socket inodes waiting in `ADOPT` for their first event (socket backend).
    pub pending: Vec<u64>,
    /// Entries made `Unserved` (a request waits unread) without a kernel counter.
    pub unserved: u64,
    /// The inserts that failed (a full map): those connections are not followed.
    pub failed: Vec<MapError>,
}
impl WatchTable for Kernel {
    fn backend(&self) -> Backend {
        self.backend
    }

    fn claims_by_namespace(&self) -> bool {
        self.socket_namespaces
    }

    fn set_listen_ports(&mut self, ports: &BTreeMap<ListenKey, u32>) -> Vec<MapError> {
        let mut failed = Vec::new();
        let current: Vec<(ListenKey, u32)> =
            self.listen_ports.iter().filter_map(Result::ok).collect();
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
                && let Err(error) = self.watched_ports.set(word, old | value, 0)
            {
                failed.push(error);
            }
        }
        for (key, service) in current {
            if ports.get(&key) != Some(&service) {
                match self.listen_ports.remove(&key) {
                    Ok(()) => self.count_own_entries(CountedMap::ListenPorts, -1),
                    Err(error) => failed.push(error),
                }
            }
        }
        for (key, &service) in ports {
            let before = self.listen_ports.get(key, 0).ok();
            if before != Some(service) {
                match self.listen_ports.insert(key, service, 0) {
                    Ok(()) if before.is_none() => {
                        self.count_own_entries(CountedMap::ListenPorts, 1);
                    }
                    Ok(()) => {}
                    Err(error) => failed.push(error),
                }
            }
        }
        for (&word, &old) in &old_words {
            let value = new_words.get(&word).copied().unwrap_or(0);
            if old & !value != 0
                && let Err(error) = self.watched_ports.set(word, value, 0)
            {
                failed.push(error);
            }
        }
        failed
    }

    fn watched(&self, pid: u32) -> Option<Watched> {
        self.watched.get(&pid, 0).ok()
    }

    fn watched_pids(&self) -> Vec<(u32, Watched)> {
        // In a few syscalls: a key-by-key walk costs two per pid, read at every scrape.
        self.batch.watched.hash_entries().unwrap_or_else(|error| {
            tracing::debug!(%error, "batch read of WATCHED failed; reading it key by key");
            self.watched.iter().filter_map(Result::ok).collect()
        })
    }

    fn watch(&mut self, pid: u32, watch: Watched) -> Result<(), MapError> {
        self.watched.insert(pid, watch, 0)
    }

    fn unwatch(&mut self, pid: u32, since_ns: u64) {
        if self.watched(pid).is_some_and(|w| w.since_ns == since_ns) {
            // A concurrent exit may have removed it first; either way it is gone.
            let _ = self.watched.remove(&pid);
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
            if self.pending_calls.insert(tid, call, BPF_NOEXIST).is_ok() {
                self.count_own_entries(CountedMap::PendingCalls, 1);
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
        // The socket programs check it (see `reset_service`).
        let epoch = if self.backend.keeps_state_in_sockets() {
            self.service_epochs.get(&service, 0)?
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
                owner_since_ns: if self.backend.keeps_state_in_sockets() {
                    Conn::ADOPTED
                } else {
                    since_ns
                },
                arrive_ns: now_ns,
                start_ns: 0,
                end_ns: 0,
                next_arrive_ns: 0,
                server_tid: 0,
                epoch,
                seen_write_seq: 0,
                _pad: 0,
            };
            // BPF_NOEXIST: an entry the kernel made itself is newer than our look.
            let (map, inserted) = match self.backend {
                Backend::Syscall => (
                    CountedMap::Conns,
                    self.conns
                        .insert(fd_conn_key(pid, connection.fd), conn, BPF_NOEXIST),
                ),
                Backend::Socket | Backend::Tcp if self.socket_inodes => (
                    CountedMap::Adopt,
                    self.adopt.insert(connection.inode, conn, BPF_NOEXIST),
                ),
                Backend::Socket | Backend::Tcp => continue,
            };
            match inserted {
                Ok(()) => {
                    self.count_own_entries(map, 1);
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
        let conn = self.adopt.get(&inode, 0).ok()?;
        self.adopt.remove(&inode).ok()?;
        self.count_own_entries(CountedMap::Adopt, -1);
        Some(Phase::from_u32(conn.phase))
    }

    fn awaits_adoption(&self, inode: u64) -> bool {
        self.adopt.get(&inode, 0).is_ok()
    }

    fn set_adopting(&mut self, adopting: bool) -> Result<(), MapError> {
        self.adopting.set(0, u32::from(adopting), 0)
    }

    fn purge_connections(&mut self, pid: u32, since_ns: u64) -> Vec<(u32, Phase)> {
        if self.backend != Backend::Syscall {
            return Vec::new();
        }
        let stale: Vec<(u64, Conn)> = self
            .conns
            .iter()
            .filter_map(Result::ok)
            .filter(|(key, conn)| conn_key_tgid(*key) == pid && conn.owner_since_ns == since_ns)
            .collect();
        let purged: Vec<(u32, Phase)> = stale
            .into_iter()
            .filter(|(key, _)| self.conns.remove(key).is_ok())
            .map(|(_, conn)| (conn.service, Phase::from_u32(conn.phase)))
            .collect();
        self.count_own_entries(CountedMap::Conns, -(purged.len() as i64));
        purged
    }

    fn set_stream_workers(&mut self, service: u32, on: bool) -> Result<(), MapError> {
        self.stream_workers.set(service, u32::from(on), 0)
    }

    fn reset_service(&mut self, service: u32) -> Result<(), MapError> {
        // Its connections may outlive its watch (a reload unwatched a process that
        // still serves them): left here, their events would count under whichever
        // service gets the id next.
        // The socket backend's connections live in their sockets, out of our reach:
        // a new epoch makes the kernel drop them at their next event.
        let dropped = drop_service_connections(&mut self.conns, service);
        self.count_own_entries(CountedMap::Conns, -dropped);
        let dropped = drop_service_connections(&mut self.adopt, service);
        self.count_own_entries(CountedMap::Adopt, -dropped);
        let epoch = self.service_epochs.get(&service, 0)?;
        self.service_epochs.set(service, epoch.wrapping_add(1), 0)?;
        self.stream_workers.set(service, 0, 0)?;
        // The times before their count: a record landing in between then leaves
        // times ahead of the count (read again when it moves), never behind it.
        self.request_times.reset(service);
        self.request_times_read.forget(service);
        let zero_counters = PerCpuValues::try_from(vec![ServiceCounters::default(); self.cpus])?;
        self.service_counters.set(service, zero_counters, 0)?;
        for slot in SyscallSlot::ALL {
            let zeros = PerCpuValues::try_from(vec![0u64; self.cpus])?;
            self.syscall_counts
                .set(syscall_counter_index(service, slot), zeros, 0)?;
        }
        Ok(())
    }
}
