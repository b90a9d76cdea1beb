//! Map names, as the exporter looks them up in the loaded object.

/// tgid (u32) → [`crate::Watched`]: the processes whose events we keep.
pub const WATCHED: &str = "WATCHED";
/// Connection key (u64, see [`crate::fd_conn_key`]) → [`crate::Conn`]: the open
/// connections of watched services and the phase of their current request
/// (syscall backend).
pub const CONNS: &str = "CONNS";
/// Socket-local storage (`BPF_MAP_TYPE_SK_STORAGE`) → [`crate::Conn`]: the same,
/// for the socket backend. The entry lives in the socket itself: finding it costs
/// no hash lookup, and the kernel frees it with the socket, so none goes stale.
/// Unbounded by design (a socket's own memory limit applies).
pub const SOCK_CONNS: &str = "SOCK_CONNS";
/// Socket-local storage → [`crate::H2Conn`]: the HTTP/2 connections of watched
/// services, followed frame by frame (socket backend). Made when a connection's first
/// bytes are the client preface, freed with the socket; unbounded by design, as
/// [`SOCK_CONNS`].
pub const H2_CONNS: &str = "H2_CONNS";
/// array, index service id → [`crate::StreamWorkers`] as u32, set by user space from
/// `[[targets]] http2_worker_threads`: which of the service's threads that hold no
/// request of their own may be serving HTTP/2 streams that another thread read, and
/// so are busy unless they wait for work ([`crate::Serving::Streams`]).
pub const STREAM_WORKERS: &str = "STREAM_WORKERS";
/// per-CPU array, index [`CountedMap`] → i64: the entries the kernel made in that
/// map less those it removed, on this CPU. User space adds its own inserts and
/// removals; the sum is how full the map is, read in O(1) per scrape (walking a
/// map's keys costs a syscall per entry, and the kernel cannot count a storage
/// map's entries at all).
pub const ENTRY_COUNTS: &str = "ENTRY_COUNTS";
/// array, index service id → u32 epoch, raised by user space whenever the id is
/// given to another service. A [`SOCK_CONNS`] entry claimed in an earlier epoch
/// belongs to a departed service and is dropped at its next event: user space
/// cannot walk socket storage to drop them itself.
pub const SERVICE_EPOCHS: &str = "SERVICE_EPOCHS";
/// [`crate::ListenKey`] (network namespace, local TCP port, local address) →
/// service id: the
/// listeners of watched services, so that the socket backend knows a handshake is
/// one of ours (it runs in softirq, in no process's context).
pub const LISTEN_PORTS: &str = "LISTEN_PORTS";
/// Array of one u64: TCP sockets that began or stopped listening, anywhere on the
/// host, counted by the socket backend: the rescan reads the `net/tcp` tables of
/// other network namespaces again only when it moved (each read walks the kernel's
/// whole connection hash).
pub const LISTEN_CHANGES: &str = "LISTEN_CHANGES";
/// Array of [`crate::WATCHED_PORT_WORDS`] u64: a bit per local TCP port on which
/// some watched service listens, in any namespace. The socket programs check it
/// first, so that an event on any other socket (a client's, most of the host's)
/// costs one load and one array read, and no hash lookup.
pub const WATCHED_PORTS: &str = "WATCHED_PORTS";
/// Socket inode (u64) → [`crate::Conn`]: connections of watched services that
/// were open before they were watched (socket backend). The first event on such a
/// socket moves its entry to [`SOCK_CONNS`].
pub const ADOPT: &str = "ADOPT";
/// Array of one u32: non-zero while `ADOPT` may hold entries, so that events on
/// sockets of no watched service skip the inode read when there is nothing to
/// adopt.
pub const ADOPTING: &str = "ADOPTING";
/// Array of one u32: non-zero once the tcp backend's HTTP/2 programs (`tcp_h2.rs`:
/// fexit on `tcp_recvmsg` and `tcp_sendmsg`) are attached, set by user space after
/// their attach. Until then, and on kernels without fexit, an HTTP/2 connection on the
/// tcp backend is refused (counted) rather than left to programs that do not run.
pub const TCP_HTTP2: &str = "TCP_HTTP2";
/// array (one for all CPUs: atomic adds; mmap-able), index service id →
/// [`crate::RequestTimes`].
pub const REQUEST_TIMES: &str = "REQUEST_TIMES";
/// tid (u32) → [`crate::PendingCall`]: an accept, or a read or write of a tracked
/// connection, between syscall entry and exit (syscall backend).
pub const PENDING_CALLS: &str = "PENDING_CALLS";
/// syscall number (index) → [`crate::SyscallSlot`] as u32, filled by user space.
pub const SYSCALL_SLOTS: &str = "SYSCALL_SLOTS";
/// per-CPU array, index [`crate::syscall_counter_index`] → calls.
pub const SYSCALL_COUNTS: &str = "SYSCALL_COUNTS";
/// per-CPU array, index service id → [`crate::ServiceCounters`].
pub const SERVICE_COUNTERS: &str = "SERVICE_COUNTERS";
/// per-CPU array, index [`crate::loss_index`] (source, errno) → events or updates lost.
pub const LOSSES: &str = "LOSSES";
/// ring buffer of [`crate::ProcessEvent`].
pub const PROCESS_EVENTS: &str = "PROCESS_EVENTS";
/// ring buffer of [`crate::RouteEvent`]: every finished request, for its route.
pub const ROUTE_EVENTS: &str = "ROUTE_EVENTS";
/// array, service → 1 if its routes are read (`[probes] routes`, `[[targets]] routes`):
/// its requests' first bytes are kept and each finished one goes to [`ROUTE_EVENTS`].
pub const ROUTE_SERVICES: &str = "ROUTE_SERVICES";
/// array, index [`crate::thread_slot`] → [`crate::Thread`], mmap-able: the threads
/// of watched processes and what each is doing since when, one per slot, owned as
/// [`THREAD_OWNERS`] says. The scheduler programs reach an entry with two inlined
/// array reads instead of a hash lookup (most of their cost before); user space
/// fills the slots of threads it finds already running and reads every entry
/// through its mapping.
pub const THREAD_ENTRIES: &str = "THREAD_ENTRIES";
/// array, index [`crate::thread_slot`] → u64, mmap-able: the slot's owner tid in the
/// lower half ([`crate::slot_owner`]), claimed by compare-and-swap from 0 by the
/// kernel or user space, and in the upper half how many followed threads of the
/// slot live in [`THREADS`] ([`crate::slot_overflow`]), added atomically by both.
/// A thread we do not follow costs the scheduler programs one read of it.
pub const THREAD_OWNERS: &str = "THREAD_OWNERS";
/// tid (u32) → [`crate::Thread`]: the followed threads whose slot of
/// [`THREAD_ENTRIES`] another thread owns.
pub const THREADS: &str = "THREADS";
/// tid (u32) → pool id: user space names pools; a new thread starts in its
/// creator's pool until user space reads its name.
pub const THREAD_POOLS: &str = "THREAD_POOLS";
/// array of one u32: raised by user space after each change it makes to
/// [`THREAD_POOLS`], so that the kernel's copies of a thread's pool in its entry
/// (`Thread::pool`) are read again.
pub const POOL_EPOCH: &str = "POOL_EPOCH";
/// per-CPU array, index pool id → [`crate::PoolStats`].
pub const POOL_STATS: &str = "POOL_STATS";
/// per-CPU array, index pool id → [`crate::Histogram`] of run-queue waits, apart
/// from [`POOL_STATS`] (which counts them): kilobytes per pool and CPU that a
/// scrape reads only for pools that waited since the last.
pub const POOL_RUNQUEUE: &str = "POOL_RUNQUEUE";
/// syscall number (index) → [`crate::WaitClass`] as u32, filled by user space.
pub const WAIT_CLASSES: &str = "WAIT_CLASSES";
/// array, index [`crate::lock_wait_index`] (pool, primitive) → [`crate::Histogram`]
/// of lock waits. Shared by all CPUs, updated with atomic adds: waits are rare
/// next to the per-CPU cost of a histogram per pool.
pub const LOCK_WAITS: &str = "LOCK_WAITS";
/// array, index as [`LOCK_WAITS`] → u64: the waits recorded there, counted after
/// their record (atomic adds): user space reads again only the histograms whose
/// count moved.
pub const LOCK_WAIT_COUNTS: &str = "LOCK_WAIT_COUNTS";
/// [`crate::LockKey`] (process, futex address, stack) → [`crate::Histogram`] of
/// its futex waits, for the top contended locks (atomic adds, as above).
pub const LOCKS: &str = "LOCKS";
/// Stack trace map: the user stacks at which lock waits began.
pub const LOCK_STACKS: &str = "LOCK_STACKS";
/// [`crate::DownstreamKey`] (pool, peer) → [`crate::DownstreamWait`]: the network
/// waits of serving threads on sockets whose peer is known, per peer (atomic
/// adds, as above).
pub const DOWNSTREAM_WAITS: &str = "DOWNSTREAM_WAITS";
/// tid (u32) → CLOCK_MONOTONIC ns of entry into `pthread_mutex_lock` (opt-in
/// uprobes), until its return.
pub const MUTEX_CALLS: &str = "MUTEX_CALLS";
/// One all-zero [`crate::Histogram`]: the initial value of a new [`maps::LOCKS`]
/// entry (too large to build on the BPF stack).
pub const ZERO_HISTOGRAM: &str = "ZERO_HISTOGRAM";
/// array[1]: the stack epoch (user space advances it, see [`crate::StackKey`]);
/// its generation `epoch % STACK_GENERATIONS` picks the stack map and the
/// [`maps::STACK_COUNTS`] entries that samples and off-CPU blocks go to.
pub const STACK_EPOCH: &str = "STACK_EPOCH";
/// [`crate::StackKey`] → [`crate::StackCount`]: on-CPU samples and off-CPU
/// blocks per stack, thread pool and reason. Shared by all CPUs (atomic adds).
pub const STACK_COUNTS: &str = "STACK_COUNTS";
/// The three [`STACKS`] maps together, as loss counters and advice name them.
pub const STACK_MAPS: &str = "STACKS";
/// Ring buffer of [`crate::StackCopy`]: the registers and top of the user stack
/// behind a user stack id, the first time the id is seen, for user space to unwind
/// through code without frame pointers.
pub const STACK_COPIES: &str = "STACK_COPIES";
/// Array, index `map × stride + stack id` (see [`crate::StackCopy`]) → u64: 1 once
/// that stack was copied; user space zeroes a generation's slots when it clears its
/// stack map.
pub const STACK_COPIED: &str = "STACK_COPIED";
/// Array, index user stack id → [`crate::StackHint`]: where the callers behind one
/// frame-pointer stack part, written by user space.
pub const STACK_HINTS: &str = "STACK_HINTS";
/// Hash of [`crate::StackVariantKey`] → u32 (1): the caller paths copied so far in
/// each generation; user space removes a generation's when it clears its stack map.
pub const STACK_VARIANTS: &str = "STACK_VARIANTS";
/// Per-CPU array[1] of [`crate::OffcpuCaptures`]: how many off-CPU blocks each CPU
/// captured in full, sampled or left out.
pub const OFFCPU_CAPTURES: &str = "OFFCPU_CAPTURES";
/// Stack trace maps of generations 0, 1, 2 (user and kernel stacks alike).
pub const STACKS: [&str; crate::STACK_GENERATIONS as usize] = ["STACKS_0", "STACKS_1", "STACKS_2"];
/// Stack trace maps of generations 0, 1, 2 for the stacks whose bucket in the
/// generation's map held another ([`crate::OVERFLOW_STACK`]).
pub const STACK_OVERFLOWS: [&str; crate::STACK_GENERATIONS as usize] = [
    "STACKS_OVERFLOW_0",
    "STACKS_OVERFLOW_1",
    "STACKS_OVERFLOW_2",
];
/// array[[`crate::MAX_PROFILE_SESSIONS`]]: the on-demand profiling sessions
/// ([`crate::ProfileSession`]), written by user space.
pub const PROFILE_SESSIONS: &str = "PROFILE_SESSIONS";

/// The maps whose entries are counted where they are made and removed
/// ([`ENTRY_COUNTS`]): every insert that made an entry and every removal that found
/// one, in the kernel and in user space. An insert that replaces an entry in place
/// counts nothing. None of them evicts on its own (no LRU), so the count is exact.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CountedMap {
    SockConns,
    Conns,
    Adopt,
    PendingCalls,
    MutexCalls,
    Locks,
    StackCounts,
    ListenPorts,
}

impl CountedMap {
    pub const ALL: [Self; 8] = [
        Self::SockConns,
        Self::Conns,
        Self::Adopt,
        Self::PendingCalls,
        Self::MutexCalls,
        Self::Locks,
        Self::StackCounts,
        Self::ListenPorts,
    ];
    pub const COUNT: u32 = Self::ALL.len() as u32;

    /// The map's name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::SockConns => SOCK_CONNS,
            Self::Conns => CONNS,
            Self::Adopt => ADOPT,
            Self::PendingCalls => PENDING_CALLS,
            Self::MutexCalls => MUTEX_CALLS,
            Self::Locks => LOCKS,
            Self::StackCounts => STACK_COUNTS,
            Self::ListenPorts => LISTEN_PORTS,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::CountedMap;

    #[test]
    fn each_counted_map_has_its_own_slot() {
        for (slot, map) in CountedMap::ALL.into_iter().enumerate() {
            assert_eq!(map as usize, slot, "{}", map.name());
        }
    }
}
