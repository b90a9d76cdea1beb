//! The tables of the watched set, behind a trait so that discovery can be tested
//! without a kernel: which processes are watched (`WATCHED`), which listeners claim
//! connections (`LISTEN_PORTS`, `WATCHED_PORTS`), the connections themselves
//! (`CONNS`, `ADOPT`) and the per-service counters a freed id must lose; and the
//! thread tables the pools keep (`THREADS`, `THREAD_POOLS`, `POOL_STATS`).
use std::collections::BTreeMap;

use aya::maps::MapError;
use poolscope_shared::{ListenKey, Phase, Thread, Watched};

use super::{Adopted, Backend};
use crate::discovery::procfs::ServedConnection;

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
    /// events are filtered out.
    fn set_listen_ports(&mut self, ports: &BTreeMap<ListenKey, u32>) -> Result<(), MapError>;

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
}
