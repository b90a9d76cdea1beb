//! Types, map names and limits shared by the kernel programs (`poolscope-ebpf`) and
//! the exporter. Everything here is `#[repr(C)]` with explicit padding so that both
//! sides agree on the layout; the size asserts at the bottom catch drift.
#![no_std]

/// Map names, as the exporter looks them up in the loaded object.
pub mod maps {
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
    /// per-CPU array of one i64: entries made in [`SOCK_CONNS`] less those removed,
    /// summed over CPUs (the kernel cannot count a storage map's entries for us).
    pub const SOCK_CONN_COUNT: &str = "SOCK_CONN_COUNT";
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
    /// per-CPU array, index service id → [`crate::RequestTimes`].
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
    /// tid (u32) → [`crate::Thread`]: the threads of watched processes and what each
    /// is doing since when. Written by the kernel only (user space inserts a thread
    /// it finds already running, once).
    pub const THREADS: &str = "THREADS";
    /// tid (u32) → pool id: user space names pools; a new thread starts in its
    /// creator's pool until user space reads its name.
    pub const THREAD_POOLS: &str = "THREAD_POOLS";
    /// per-CPU array, index pool id → [`crate::PoolStats`].
    pub const POOL_STATS: &str = "POOL_STATS";
    /// syscall number (index) → [`crate::WaitClass`] as u32, filled by user space.
    pub const WAIT_CLASSES: &str = "WAIT_CLASSES";
    /// array, index [`crate::lock_wait_index`] (pool, primitive) → [`crate::Histogram`]
    /// of lock waits. Shared by all CPUs, updated with atomic adds: waits are rare
    /// next to the per-CPU cost of a histogram per pool.
    pub const LOCK_WAITS: &str = "LOCK_WAITS";
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
    /// Stack trace maps of generations 0, 1, 2 (user and kernel stacks alike).
    pub const STACKS: [&str; crate::STACK_GENERATIONS as usize] =
        ["STACKS_0", "STACKS_1", "STACKS_2"];
    /// array[[`crate::MAX_PROFILE_SESSIONS`]]: the on-demand profiling sessions
    /// ([`crate::ProfileSession`]), written by user space.
    pub const PROFILE_SESSIONS: &str = "PROFILE_SESSIONS";
}

/// Capacity of the per-service arrays; service ids are `0..MAX_SERVICES`.
pub const MAX_SERVICES: u32 = 1024;
/// Default capacity of the per-pool array; pool ids are `0..` its size.
pub const MAX_POOLS: u32 = 1024;
/// Default capacity of [`maps::THREADS`] and [`maps::THREAD_POOLS`].
pub const MAX_THREADS: u32 = 65536;
/// Default capacity of [`maps::LOCKS`] (each entry holds a 1.8 kB histogram).
pub const MAX_LOCKS: u32 = 2048;
/// Capacity of [`maps::DOWNSTREAM_WAITS`]: (pool, peer) pairs.
pub const MAX_DOWNSTREAMS: u32 = 4096;
/// Default capacity of [`maps::LOCK_STACKS`].
pub const MAX_LOCK_STACKS: u32 = 2048;
/// Default capacity of each [`maps::STACKS`] map.
pub const MAX_STACKS: u32 = 4096;
/// Default capacity of [`maps::STACK_COUNTS`].
pub const MAX_STACK_COUNTS: u32 = 16384;
/// Stack maps in rotation: the one being filled, the one whose off-CPU blocks may
/// still end (they go where their stack is), and the one user space drains.
pub const STACK_GENERATIONS: u32 = 3;
/// Capacity of [`maps::MUTEX_CALLS`]: at most one entry per thread inside the call.
pub const MUTEX_CALLS_CAPACITY: u32 = 16384;
/// Capacity of [`maps::PENDING_CALLS`]: at most one entry per thread inside a syscall.
pub const PENDING_CALLS_CAPACITY: u32 = 16384;
/// Capacity of [`maps::LISTEN_PORTS`].
pub const LISTEN_PORTS_CAPACITY: u32 = 4096;
/// Words of [`maps::WATCHED_PORTS`]: 64 ports each, every port.
pub const WATCHED_PORT_WORDS: u32 = 65536 / 64;

/// The word of [`maps::WATCHED_PORTS`] that holds `port`, and its bit there.
pub const fn watched_port_bit(port: u16) -> (u32, u64) {
    ((port / 64) as u32, 1 << (port % 64))
}
/// Size of the syscall-number → slot table (covers every x86_64 and aarch64 number).
pub const SYSCALL_TABLE_SIZE: u32 = 512;

/// Value of [`maps::WATCHED`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Watched {
    /// Dense id assigned by user space, `< MAX_SERVICES`.
    pub service: u32,
    pub _pad: u32,
    /// CLOCK_MONOTONIC ns when this tgid started being watched. Together with the
    /// tgid it names one process: a reused pid gets a new `since`.
    pub since_ns: u64,
}

/// Key of [`maps::CONNS`] in the syscall backend. The socket backend keys by the
/// kernel address of the socket, which is above 2^63 and so never collides.
pub const fn fd_conn_key(tgid: u32, fd: u32) -> u64 {
    ((tgid as u64) << 32) | fd as u64
}

/// The tgid of a syscall-backend key.
pub const fn conn_key_tgid(key: u64) -> u32 {
    (key >> 32) as u32
}

/// Where a connection's current request is (DESIGN §3). Each phase but `Responded` and
/// `Closing` is one of the gauges: a transition updates one `*_left` and one
/// `*_entered` counter of [`ServiceCounters`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Connected (socket backend: handshake done; syscall backend: accepted), no
    /// request byte read yet.
    Unserved = 1,
    /// Request bytes arrived on an open connection and were not read yet.
    Waiting,
    /// The request was read (at least in part) and no response byte written yet.
    Serving,
    /// Response bytes written; the request ends at the last write before the next
    /// request or the close.
    Responded,
    /// The peer closed its side after the last response.
    Closing,
    /// Closed and accounted: the entry is being removed, and an event that still
    /// holds it (on another CPU) changes nothing.
    Gone = 0,
}

impl Phase {
    pub const fn from_u32(value: u32) -> Self {
        match value {
            0 => Self::Gone,
            1 => Self::Unserved,
            2 => Self::Waiting,
            3 => Self::Serving,
            4 => Self::Responded,
            _ => Self::Closing,
        }
    }
}

/// Value of [`maps::CONNS`] and [`maps::SOCK_CONNS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conn {
    pub service: u32,
    /// [`Phase`] as u32.
    pub phase: u32,
    /// Syscall backend: [`Watched::since_ns`] of the owning process when the entry was
    /// made; an entry whose owner no longer matches is stale. 0 in the socket backend.
    pub owner_since_ns: u64,
    /// When the current request arrived (handshake, bytes queued, or first read when
    /// the arrival is not seen).
    pub arrive_ns: u64,
    /// First read of the current request.
    pub start_ns: u64,
    /// Last write of the current request so far.
    pub end_ns: u64,
    /// Socket backend: when bytes arrived while the request was being served and
    /// were not read yet (0 if none): on loopback the next request can arrive before
    /// the tracepoint of the write that answered this one has run.
    pub next_arrive_ns: u64,
    /// The watched thread whose read started the current request (0 if none): it is
    /// serving until the response begins (see [`Thread::serving`]).
    pub server_tid: u32,
    /// Socket backend: the service's epoch ([`maps::SERVICE_EPOCHS`]) when the
    /// connection was claimed; 0 in the syscall backend.
    pub epoch: u32,
}

/// Value of [`maps::PENDING_CALLS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingCall {
    /// [`SyscallSlot`] as u32.
    pub slot: u32,
    /// The fd argument (reads, writes); unused for accepts.
    pub fd: u32,
    /// The syscall number, checked again at exit: user space adopts threads already
    /// blocked in accept when they start being watched, and a thread may have left
    /// that call by the time the entry is made.
    pub number: u32,
    pub _pad: u32,
}

/// Per-service counters, summed over CPUs by user space. Each gauge of DESIGN §4 is
/// an `entered − left` pair, so that per-CPU counters need no atomics.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceCounters {
    /// Connections that entered [`Phase::Unserved`]: accept/accept4 returned a socket
    /// (syscall backend) or a handshake completed on a watched port (socket backend).
    pub accepted: u64,
    pub unserved_entered: u64,
    pub unserved_left: u64,
    pub waiting_entered: u64,
    pub waiting_left: u64,
    pub serving_entered: u64,
    pub serving_left: u64,
}

impl ServiceCounters {
    /// Field-wise sum (per-CPU values to one).
    #[must_use]
    pub const fn plus(self, other: &Self) -> Self {
        Self {
            accepted: self.accepted + other.accepted,
            unserved_entered: self.unserved_entered + other.unserved_entered,
            unserved_left: self.unserved_left + other.unserved_left,
            waiting_entered: self.waiting_entered + other.waiting_entered,
            waiting_left: self.waiting_left + other.waiting_left,
            serving_entered: self.serving_entered + other.serving_entered,
            serving_left: self.serving_left + other.serving_left,
        }
    }
}

/// Buckets of a [`Histogram`]: bucket 0 holds [0, 1024 ns); then 8 linear
/// sub-buckets per power of two from 2^10 ns to 2^38 ns (~275 s), each at most
/// 1/8 of its lower bound wide; the last bucket also takes everything longer.
pub const HISTOGRAM_BUCKETS: usize = 1 + HISTOGRAM_OCTAVES as usize * 8;
const HISTOGRAM_OCTAVES: u32 = 28;
const HISTOGRAM_FIRST_OCTAVE: u32 = 10;
const SUB_BUCKET_BITS: u32 = 3;

/// floor(log2(value)) for value > 0, without loops (the BPF verifier dislikes them).
pub const fn log2_floor(mut value: u64) -> u32 {
    let mut log = 0;
    if value >= 1 << 32 {
        value >>= 32;
        log += 32;
    }
    if value >= 1 << 16 {
        value >>= 16;
        log += 16;
    }
    if value >= 1 << 8 {
        value >>= 8;
        log += 8;
    }
    if value >= 1 << 4 {
        value >>= 4;
        log += 4;
    }
    if value >= 1 << 2 {
        value >>= 2;
        log += 2;
    }
    if value >= 1 << 1 {
        log += 1;
    }
    log
}

/// The bucket of a duration in ns.
pub const fn histogram_bucket(ns: u64) -> usize {
    if ns < 1 << HISTOGRAM_FIRST_OCTAVE {
        return 0;
    }
    let octave = log2_floor(ns);
    // Past the last octave, tested before any index is computed: the compiler splits
    // log2_floor's branches into constant octaves, and on the top one an index past
    // the end, clamped after, leaves a path that Linux 6.1's verifier cannot prove
    // dead (it then refuses every program that counts into a histogram).
    if octave >= HISTOGRAM_FIRST_OCTAVE + HISTOGRAM_OCTAVES {
        return HISTOGRAM_BUCKETS - 1;
    }
    let sub = (ns >> (octave - SUB_BUCKET_BITS)) & 7;
    1 + (octave - HISTOGRAM_FIRST_OCTAVE) as usize * 8 + sub as usize
}

/// Lower and upper bound in ns of a bucket (the last one's upper bound is nominal).
pub const fn histogram_bucket_bounds(index: usize) -> (u64, u64) {
    if index == 0 {
        return (0, 1 << HISTOGRAM_FIRST_OCTAVE);
    }
    let octave = HISTOGRAM_FIRST_OCTAVE + ((index - 1) / 8) as u32;
    let sub = ((index - 1) % 8) as u64;
    let step = 1u64 << (octave - SUB_BUCKET_BITS);
    ((8 + sub) * step, (9 + sub) * step)
}

/// A duration histogram in the kernel's fine buckets, with the exact sum.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Histogram {
    pub buckets: [u64; HISTOGRAM_BUCKETS],
    pub sum_ns: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            buckets: [0; HISTOGRAM_BUCKETS],
            sum_ns: 0,
        }
    }
}

impl Histogram {
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// Bucket-wise sum.
    pub fn add(&mut self, other: &Self) {
        for (sum, value) in self.buckets.iter_mut().zip(other.buckets.iter()) {
            *sum += value;
        }
        self.sum_ns += other.sum_ns;
    }
}

/// Value of [`maps::REQUEST_TIMES`]: the three durations of every finished request.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestTimes {
    /// start − arrive
    pub queue: Histogram,
    /// end − start
    pub duration: Histogram,
    /// end − arrive
    pub latency: Histogram,
}

/// What a thread is doing (DESIGN §3), as an index into [`PoolStats::time_ns`]. The
/// off-CPU activities are the `offcpu_seconds_total` reasons; the thread states are
/// their sums: `blocked_lock` = `OffLock`, `idle` = `OffIdle`, `blocked_io` = the rest.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activity {
    Running = 0,
    /// Woken or preempted, waiting for a CPU.
    Runnable,
    /// A futex wait while serving a request.
    OffLock,
    /// Uninterruptible sleep (disk, page faults).
    OffDisk,
    /// Waiting on the network while serving: a socket or pipe read or write, or a
    /// worker's `poll`/`select` on a downstream (see [`Activity::blocked`]).
    OffNetwork,
    /// nanosleep / clock_nanosleep while serving.
    OffSleep,
    /// Waiting for work: epoll, accept, io_uring, an event loop's poll or select, or
    /// any wait while holding no request.
    OffIdle,
    /// Any other wait while serving.
    OffOther,
}

impl Activity {
    /// A power of two: the kernel side bounds an index by masking with `COUNT - 1`.
    pub const COUNT: usize = 8;
    pub const ALL: [Activity; 8] = [
        Self::Running,
        Self::Runnable,
        Self::OffLock,
        Self::OffDisk,
        Self::OffNetwork,
        Self::OffSleep,
        Self::OffIdle,
        Self::OffOther,
    ];

    pub const fn from_u32(value: u32) -> Self {
        match value {
            0 => Self::Running,
            1 => Self::Runnable,
            2 => Self::OffLock,
            3 => Self::OffDisk,
            4 => Self::OffNetwork,
            5 => Self::OffSleep,
            6 => Self::OffIdle,
            _ => Self::OffOther,
        }
    }

    /// Off CPU (blocked, not waiting for a CPU).
    pub const fn is_off_cpu(self) -> bool {
        !matches!(self, Self::Running | Self::Runnable)
    }

    /// Busy = everything but waiting for work.
    pub const fn is_busy(self) -> bool {
        !matches!(self, Self::OffIdle)
    }

    /// The activity of a thread that blocks in a syscall of class `wait`, while it
    /// holds what `serving` says; `polled_fds` is the fd count of a
    /// [`WaitClass::Poll`]. The rule that tells a worker waiting on a downstream from
    /// an event loop waiting for work: a `poll` on at most [`MAX_DOWNSTREAM_FDS`]
    /// fds, or a `select`, by a thread that holds a request and has never held two
    /// at once, waits on the network; any other poll, select or epoll waits for work.
    pub const fn blocked(
        wait: WaitClass,
        serving: Serving,
        polled_fds: u64,
        uninterruptible: bool,
    ) -> Self {
        if uninterruptible {
            return Self::OffDisk;
        }
        match (wait, serving) {
            (WaitClass::Idle, _) | (_, Serving::Nothing) => Self::OffIdle,
            (WaitClass::Poll, Serving::OneAtATime) if polled_fds <= MAX_DOWNSTREAM_FDS => {
                Self::OffNetwork
            }
            (WaitClass::Select, Serving::OneAtATime) => Self::OffNetwork,
            (WaitClass::Poll | WaitClass::Select, _) => Self::OffIdle,
            (WaitClass::Futex, _) => Self::OffLock,
            (WaitClass::Network, _) => Self::OffNetwork,
            (WaitClass::Sleep, _) => Self::OffSleep,
            (WaitClass::Other, _) => Self::OffOther,
        }
    }
}

/// A `poll` on more fds than this is an event loop's, whoever calls it: a worker
/// waiting on a downstream polls its socket, perhaps with a wakeup pipe or two
/// (libcurl polls the socket and a socketpair).
pub const MAX_DOWNSTREAM_FDS: u64 = 8;

/// What a blocking thread holds, for [`Activity::blocked`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Serving {
    /// No request, or only requests it handed to another thread.
    Nothing,
    /// A request, and it never held two at once: a worker of a thread-per-request
    /// pool, whose waits are its request's.
    OneAtATime,
    /// A request, and it once held two at once: an event loop, whose poll waits for
    /// whichever of its connections is ready.
    Multiplexing,
}

/// What a thread waits for in a syscall, by syscall number ([`maps::WAIT_CLASSES`]).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitClass {
    /// Not classified (table default).
    Other = 0,
    /// Waiting for work whatever the thread holds: epoll, accept, io_uring_enter.
    Idle,
    /// futex, futex_wait, futex_waitv: a lock when serving, the pool's queue otherwise.
    Futex,
    /// Socket and pipe reads and writes.
    Network,
    /// nanosleep, clock_nanosleep.
    Sleep,
    /// poll, ppoll: the fd count is the second argument.
    Poll,
    /// select, pselect6: the fd count is not known (the first argument is the
    /// highest fd + 1).
    Select,
}

impl WaitClass {
    pub const fn from_u32(value: u32) -> Self {
        match value {
            1 => Self::Idle,
            2 => Self::Futex,
            3 => Self::Network,
            4 => Self::Sleep,
            5 => Self::Poll,
            6 => Self::Select,
            _ => Self::Other,
        }
    }
}

/// Value of [`maps::THREADS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Thread {
    pub service: u32,
    /// [`Activity`] as u32, since `since_ns`.
    pub activity: u32,
    /// Requests this thread started (read) whose response has not begun: while it is
    /// above 0 the thread is serving, and its time also goes to the requests'
    /// components, once per request it holds.
    pub serving: u32,
    /// 1 once a request this thread read was answered by another thread (an M:N
    /// runtime such as Go, or a hand-off): its waits then do not count as the
    /// request's, since the request may be served elsewhere meanwhile.
    pub hands_off: u32,
    /// 1 once this thread held two requests at once: it multiplexes connections (an
    /// event loop), so its poll or select waits for any of them, not a downstream.
    pub multiplexes: u32,
    pub _pad: u32,
    /// The socket peer of the network wait the thread is in ([`Peer::NONE`]: none
    /// known), to which the wait's time goes in [`maps::DOWNSTREAM_WAITS`].
    pub downstream: Peer,
    pub _pad2: u32,
    pub since_ns: u64,
    /// This thread's time on CPU and in the run queue, closed intervals only
    /// (`/debug/threads`, comparable with /proc/<pid>/task/<tid>/schedstat).
    pub running_ns: u64,
    pub runnable_ns: u64,
    /// The lock wait (one acquisition) this thread is in: when its current futex
    /// wait began (0: not in one; it ends when the thread is back on CPU), the time
    /// of its earlier futex waits, and when the last one ended (0: none pending).
    /// A glibc mutex whose waker lost the race to another thread waits again at
    /// once: those futex waits are one lock wait (see `locks.rs`).
    pub lock_since_ns: u64,
    pub lock_waited_ns: u64,
    pub lock_ended_ns: u64,
    /// The wait's futex address, process and user stack id (negative: none).
    pub lock_address: u64,
    pub lock_tgid: u32,
    pub lock_stack: i32,
    /// The stacks at which the thread last blocked (off CPU), in the stack maps of
    /// `offcpu_epoch` (negative id: not captured), and its process (a wakeup runs
    /// in the waker's).
    pub offcpu_user_stack: i32,
    pub offcpu_kernel_stack: i32,
    pub offcpu_epoch: u32,
    pub offcpu_tgid: u32,
    /// When the thread last blocked (request boundaries cut `since_ns`, not this).
    pub blocked_since_ns: u64,
}

impl Thread {
    /// A thread of `service` doing `activity` since `since_ns`, holding nothing.
    pub const fn new(service: u32, activity: Activity, since_ns: u64) -> Self {
        Self {
            service,
            activity: activity as u32,
            serving: 0,
            hands_off: 0,
            multiplexes: 0,
            _pad: 0,
            downstream: Peer::NONE,
            _pad2: 0,
            since_ns,
            running_ns: 0,
            runnable_ns: 0,
            lock_since_ns: 0,
            lock_waited_ns: 0,
            lock_ended_ns: 0,
            lock_address: 0,
            lock_tgid: 0,
            lock_stack: -1,
            offcpu_user_stack: -1,
            offcpu_kernel_stack: -1,
            offcpu_epoch: 0,
            offcpu_tgid: 0,
            blocked_since_ns: 0,
        }
    }
}

/// The remote end of a socket: an IPv4 address in the first 4 bytes of `addr`
/// (family `AF_INET`) or an IPv6 one (`AF_INET6`); `port` in host order.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Peer {
    pub addr: [u8; 16],
    pub port: u16,
    pub family: u16,
}

impl Peer {
    /// No peer known.
    pub const NONE: Self = Self {
        addr: [0; 16],
        port: 0,
        family: 0,
    };
    pub const AF_INET: u16 = 2;
    pub const AF_INET6: u16 = 10;
}

/// Key of [`maps::DOWNSTREAM_WAITS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DownstreamKey {
    pub pool: u32,
    pub peer: Peer,
}

/// Value of [`maps::DOWNSTREAM_WAITS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DownstreamWait {
    /// Time blocked on the network with this peer's socket in hand.
    pub wait_ns: u64,
    /// Such blocks that ended.
    pub waits: u64,
}

/// How a lock wait was seen: the `primitive` label of `lock_wait_seconds`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockPrimitive {
    /// Blocked in a futex wait while serving, until back on CPU.
    Futex = 0,
    /// Inside `pthread_mutex_lock` while serving (opt-in uprobes), contended or not.
    PthreadMutex,
}

impl LockPrimitive {
    pub const COUNT: u32 = 2;
    pub const ALL: [LockPrimitive; 2] = [Self::Futex, Self::PthreadMutex];

    pub const fn name(self) -> &'static str {
        match self {
            Self::Futex => "futex",
            Self::PthreadMutex => "pthread_mutex",
        }
    }
}

/// Index into [`maps::LOCK_WAITS`].
pub const fn lock_wait_index(pool: u32, primitive: LockPrimitive) -> u32 {
    pool * LockPrimitive::COUNT + primitive as u32
}

/// Key of [`maps::LISTEN_PORTS`]: a listening address and port in one network
/// namespace, so that pods that listen on the same port, or two services bound to
/// different addresses on one port, never claim each other's connections.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ListenKey {
    /// Inode number of the network namespace (`/proc/<pid>/ns/net`, `net->ns.inum`);
    /// [`ListenKey::ANY_NAMESPACE`] where the kernel's BTF does not say where it is.
    pub netns: u32,
    /// Local port, in host byte order.
    pub port: u32,
    /// The address the listener is bound to, as IPv6 (an IPv4 address mapped,
    /// `::ffff:a.b.c.d`, as `inet_sock_set_state` gives it);
    /// [`ListenKey::ANY_ADDRESS`] for a listener on every address (`0.0.0.0`, `::`).
    pub addr: [u8; 16],
}

impl ListenKey {
    /// The namespace of every key when the namespace cannot be read (no kernel BTF):
    /// connections are then claimed by port alone.
    pub const ANY_NAMESPACE: u32 = 0;
    /// The address of a listener bound to every address: a connection whose own
    /// address no listener is bound to is looked up under it.
    pub const ANY_ADDRESS: [u8; 16] = [0; 16];
}

/// Key of [`maps::LOCKS`]: one lock (a futex address in one process) waited on from
/// one call stack.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LockKey {
    pub tgid: u32,
    /// Id in [`maps::LOCK_STACKS`]; negative when the stack was not captured.
    pub stack: i32,
    pub address: u64,
}

/// Key of [`maps::STACK_COUNTS`]. A sample or block goes to the generation of the
/// stack map that holds its stacks: user space drains a generation (and clears its
/// stack map) once nothing can be added to it any more, two epochs later.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct StackKey {
    /// `epoch % STACK_GENERATIONS`.
    pub generation: u32,
    /// [`Activity::Running`] for on-CPU samples; else the off-CPU reason.
    pub activity: u32,
    pub tgid: u32,
    /// Pool id; [`NO_POOL`] for a thread not named yet.
    pub pool: u32,
    /// Ids in the generation's stack map; negative: not captured ([`stack_id_lost`]).
    pub user_stack: i32,
    pub kernel_stack: i32,
    /// 0 for the periodic snapshots; else the [`ProfileSession::id`] it was
    /// counted for.
    pub session: u32,
}

/// [`StackKey::pool`] of a thread whose pool is not known yet.
pub const NO_POOL: u32 = u32::MAX;

/// Value of [`maps::PROFILE_SESSIONS`]: an on-demand profiling session in one slot.
/// Its on-CPU samples come from the slot's own sampler program (user space opens
/// its perf events at the session's rate); its off-CPU blocks are added when a
/// block of a matching thread ends.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProfileSession {
    /// Unique per session (never 0), so that counts of an ended session that are
    /// drained after the slot was reused are not taken for the new one's.
    pub id: u32,
    /// 0: the slot is free; the kernel records nothing for it.
    pub active: u32,
    pub service: u32,
    /// A pool id, or [`NO_POOL`] for every thread of the service.
    pub pool: u32,
    /// 1: record on-CPU samples; 1 << 1: off-CPU blocks.
    pub kinds: u32,
    pub _pad: u32,
    /// Monotonic ns at which the session began: a block that began earlier counts
    /// from here.
    pub start_ns: u64,
    /// Monotonic ns of the session's first on-CPU sample (0: none yet).
    pub first_sample_ns: u64,
}

impl ProfileSession {
    pub const ON_CPU: u32 = 1;
    pub const OFF_CPU: u32 = 1 << 1;
}

/// Slots of [`maps::PROFILE_SESSIONS`], and sampler programs (`session_sample_N`).
pub const MAX_PROFILE_SESSIONS: u32 = 8;

/// Value of [`maps::STACK_COUNTS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackCount {
    /// On-CPU samples, or off-CPU blocks.
    pub count: u64,
    /// Off-CPU: ns blocked (from switch-out to wakeup).
    pub ns: u64,
}

/// Value of [`maps::POOL_STATS`]: closed intervals of the pool's threads. User space
/// adds each live thread's open interval at read time.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStats {
    /// Thread time per [`Activity`].
    pub time_ns: [u64; Activity::COUNT],
    /// Request time per [`Activity`] of the thread serving it, once per request held.
    pub request_ns: [u64; Activity::COUNT],
    /// Run-queue waits (runnable → on CPU).
    pub runqueue: Histogram,
}

impl Default for PoolStats {
    fn default() -> Self {
        Self {
            time_ns: [0; Activity::COUNT],
            request_ns: [0; Activity::COUNT],
            runqueue: Histogram::default(),
        }
    }
}

impl PoolStats {
    /// Element-wise sum (per-CPU values to one).
    pub fn add(&mut self, other: &Self) {
        for (sum, value) in self.time_ns.iter_mut().zip(other.time_ns) {
            *sum += value;
        }
        for (sum, value) in self.request_ns.iter_mut().zip(other.request_ns) {
            *sum += value;
        }
        self.runqueue.add(&other.runqueue);
    }
}

/// The correlated syscalls we count, as a dense index.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyscallSlot {
    /// Not one of ours (table default).
    None = 0,
    Accept,
    Accept4,
    Read,
    Readv,
    Recvfrom,
    Recvmsg,
    Write,
    Writev,
    Sendto,
    Sendmsg,
    Sendfile,
    Close,
}

impl SyscallSlot {
    /// Number of slots including `None`.
    pub const COUNT: u32 = 13;
    /// Every counted slot, in index order.
    pub const ALL: [SyscallSlot; 12] = [
        Self::Accept,
        Self::Accept4,
        Self::Read,
        Self::Readv,
        Self::Recvfrom,
        Self::Recvmsg,
        Self::Write,
        Self::Writev,
        Self::Sendto,
        Self::Sendmsg,
        Self::Sendfile,
        Self::Close,
    ];

    pub const fn from_u32(value: u32) -> Self {
        match value {
            1 => Self::Accept,
            2 => Self::Accept4,
            3 => Self::Read,
            4 => Self::Readv,
            5 => Self::Recvfrom,
            6 => Self::Recvmsg,
            7 => Self::Write,
            8 => Self::Writev,
            9 => Self::Sendto,
            10 => Self::Sendmsg,
            11 => Self::Sendfile,
            12 => Self::Close,
            _ => Self::None,
        }
    }

    /// The syscall's name, as in the `syscall` label and the tracepoint names.
    pub const fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Accept => "accept",
            Self::Accept4 => "accept4",
            Self::Read => "read",
            Self::Readv => "readv",
            Self::Recvfrom => "recvfrom",
            Self::Recvmsg => "recvmsg",
            Self::Write => "write",
            Self::Writev => "writev",
            Self::Sendto => "sendto",
            Self::Sendmsg => "sendmsg",
            Self::Sendfile => "sendfile",
            Self::Close => "close",
        }
    }

    pub const fn is_accept(self) -> bool {
        matches!(self, Self::Accept | Self::Accept4)
    }

    /// Reads of request bytes.
    pub const fn is_read(self) -> bool {
        matches!(
            self,
            Self::Read | Self::Readv | Self::Recvfrom | Self::Recvmsg
        )
    }

    /// Writes of response bytes (the socket is the first argument of each).
    pub const fn is_write(self) -> bool {
        matches!(
            self,
            Self::Write | Self::Writev | Self::Sendto | Self::Sendmsg | Self::Sendfile
        )
    }
}

/// Index into [`maps::SYSCALL_COUNTS`].
pub const fn syscall_counter_index(service: u32, slot: SyscallSlot) -> u32 {
    service * SyscallSlot::COUNT + slot as u32
}

/// Entries of [`maps::SYSCALL_COUNTS`].
pub const SYSCALL_COUNTS_SIZE: u32 = MAX_SERVICES * SyscallSlot::COUNT;

/// Where the kernel side lost something; with a [`LossErrno`], the index of its
/// counter in [`maps::LOSSES`] ([`loss_index`]).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum LossSource {
    /// A [`maps::CONNS`] insert failed: that connection is not measured.
    ConnsInsert = 0,
    /// A [`maps::SOCK_CONNS`] entry could not be made (the socket's memory limit,
    /// `net.core.optmem_max`): that connection is not measured.
    SockConnsInsert,
    /// A [`maps::PENDING_CALLS`] insert failed: one syscall not measured.
    PendingCallsInsert,
    /// A [`maps::WATCHED`] insert for a forked child failed: the child is found by the
    /// next rescan instead.
    WatchedInsert,
    /// The process-event ring buffer was full.
    ProcessEvents,
    /// A [`maps::THREADS`] or [`maps::THREAD_POOLS`] insert for a new thread failed.
    ThreadsInsert,
    /// A [`maps::LOCKS`] insert failed: that wait is in `lock_wait_seconds` but not
    /// in the top locks.
    LocksInsert,
    /// A lock wait's stack did not fit in [`maps::LOCK_STACKS`] (its hash bucket
    /// held another stack): the wait is kept without a stack.
    LockStackCollision,
    /// A [`maps::MUTEX_CALLS`] insert failed: one `pthread_mutex_lock` call not timed.
    MutexCallsInsert,
    /// A stack did not fit in its [`maps::STACKS`] map (its hash bucket held another
    /// stack): the sample or block is kept without that stack.
    StackCollision,
    /// A [`maps::STACK_COUNTS`] insert failed: one sample or block lost.
    StackCountsInsert,
    /// An off-CPU block outlived its stack map (it began two epochs before it
    /// ended): its time is kept without stacks.
    OffCpuStacksExpired,
    /// A [`maps::DOWNSTREAM_WAITS`] insert failed: that network wait counts in its
    /// pool, not under its peer.
    DownstreamInsert,
    /// An event on a connection lost its phase change to other CPUs' events three
    /// times in a row and was dropped.
    PhaseRetries,
}

impl LossSource {
    pub const COUNT: u32 = 14;
    pub const ALL: [LossSource; 14] = [
        Self::ConnsInsert,
        Self::SockConnsInsert,
        Self::PendingCallsInsert,
        Self::WatchedInsert,
        Self::ProcessEvents,
        Self::ThreadsInsert,
        Self::LocksInsert,
        Self::LockStackCollision,
        Self::MutexCallsInsert,
        Self::StackCollision,
        Self::StackCountsInsert,
        Self::OffCpuStacksExpired,
        Self::DownstreamInsert,
        Self::PhaseRetries,
    ];
}

/// Why a kernel helper failed, by the errno it returned: the advice differs (a full
/// map wants a larger size; a busy bucket or short memory does not).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LossErrno {
    /// No errno: a ring buffer with no room, an expired stack.
    None = 0,
    /// The map is full.
    E2big,
    /// The kernel could not allocate the entry.
    Enomem,
    /// The hash bucket was locked by an update this one interrupted.
    Ebusy,
    /// The key (or, for a stack map, another stack in its bucket) is already there.
    Eexist,
    /// Any other errno.
    Other,
}

impl LossErrno {
    /// Counters per [`LossSource`] in [`maps::LOSSES`] (a power of two: the index is
    /// a shift the verifier bounds).
    pub const SLOTS: u32 = 8;
    pub const ALL: [LossErrno; 6] = [
        Self::None,
        Self::E2big,
        Self::Enomem,
        Self::Ebusy,
        Self::Eexist,
        Self::Other,
    ];

    /// The class of a helper's return `code` (a negative errno).
    #[inline(always)]
    pub const fn of(code: i64) -> Self {
        const E2BIG: i64 = 7;
        const ENOMEM: i64 = 12;
        const EBUSY: i64 = 16;
        const EEXIST: i64 = 17;
        match -code {
            E2BIG => Self::E2big,
            ENOMEM => Self::Enomem,
            EBUSY => Self::Ebusy,
            EEXIST => Self::Eexist,
            _ => Self::Other,
        }
    }

    /// Its name in `map_update_errors_total{errno}`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::E2big => "E2BIG",
            Self::Enomem => "ENOMEM",
            Self::Ebusy => "EBUSY",
            Self::Eexist => "EEXIST",
            Self::Other => "other",
        }
    }
}

const _: () = assert!(LossErrno::SLOTS.is_power_of_two());
const _: () = assert!(LossErrno::ALL.len() as u32 <= LossErrno::SLOTS);

/// Index of the counter of `source` failing with `errno` in [`maps::LOSSES`].
#[inline(always)]
pub const fn loss_index(source: LossSource, errno: LossErrno) -> u32 {
    source as u32 * LossErrno::SLOTS + errno as u32
}

/// Entries of [`maps::LOSSES`].
pub const LOSSES_SIZE: u32 = LossSource::COUNT * LossErrno::SLOTS;

/// Kind of [`ProcessEvent`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessEventKind {
    /// A watched process forked; the child is already in [`maps::WATCHED`].
    Fork = 1,
    /// A process (watched or not) called exec.
    Exec = 2,
    /// The last thread of a watched process exited; it is already out of [`maps::WATCHED`].
    Exit = 3,
    /// A watched thread changed its name (`pid` is its tid): its pool may change.
    ThreadRenamed = 4,
}

/// Sent through [`maps::PROCESS_EVENTS`]; rare (process lifecycle only).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessEvent {
    pub kind: u32,
    pub pid: u32,
    /// Parent tgid for `Fork`, 0 otherwise.
    pub parent: u32,
    /// Service id for `Fork`/`Exit`, `u32::MAX` for `Exec`.
    pub service: u32,
    /// `Watched::since_ns` of the child (`Fork`) or of the exited process (`Exit`).
    pub since_ns: u64,
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: every type is repr(C), built only from integers, with explicit padding.
    unsafe impl aya::Pod for super::Watched {}
    unsafe impl aya::Pod for super::Conn {}
    unsafe impl aya::Pod for super::PendingCall {}
    unsafe impl aya::Pod for super::ServiceCounters {}
    unsafe impl aya::Pod for super::ProcessEvent {}
    unsafe impl aya::Pod for super::RequestTimes {}
    unsafe impl aya::Pod for super::Thread {}
    unsafe impl aya::Pod for super::PoolStats {}
    unsafe impl aya::Pod for super::LockKey {}
    unsafe impl aya::Pod for super::DownstreamKey {}
    unsafe impl aya::Pod for super::DownstreamWait {}
    unsafe impl aya::Pod for super::ListenKey {}
    unsafe impl aya::Pod for super::Histogram {}
    unsafe impl aya::Pod for super::StackKey {}
    unsafe impl aya::Pod for super::StackCount {}
    unsafe impl aya::Pod for super::ProfileSession {}
}

const _: () = assert!(Activity::COUNT.is_power_of_two() && Activity::ALL.len() == Activity::COUNT);
const _: () = assert!(core::mem::size_of::<Watched>() == 16);
const _: () = assert!(core::mem::size_of::<ListenKey>() == 24);
const _: () = assert!(core::mem::size_of::<Conn>() == 56);
const _: () = assert!(core::mem::size_of::<Thread>() == 136);
const _: () = assert!(core::mem::size_of::<StackKey>() == 28);
const _: () = assert!(core::mem::size_of::<ProfileSession>() == 40);
const _: () = assert!(core::mem::size_of::<StackCount>() == 16);
const _: () = assert!(core::mem::size_of::<LockKey>() == 16);
// The kernel swaps a connection's phase with the service id beside it, as one u64
// (little-endian: the phase is the high half).
const _: () = assert!(
    core::mem::offset_of!(Conn, service) == 0
        && core::mem::offset_of!(Conn, phase) == 4
        && core::mem::align_of::<Conn>() == 8
);
const _: () = assert!(core::mem::size_of::<Peer>() == 20);
const _: () = assert!(core::mem::size_of::<DownstreamKey>() == 24);
const _: () = assert!(core::mem::size_of::<DownstreamWait>() == 16);
const _: () = assert!(
    core::mem::size_of::<PoolStats>() == 2 * Activity::COUNT * 8 + (HISTOGRAM_BUCKETS + 1) * 8
);
const _: () = assert!(core::mem::size_of::<PendingCall>() == 16);
const _: () = assert!(core::mem::size_of::<ServiceCounters>() == 56);
const _: () = assert!(core::mem::size_of::<Histogram>() == (HISTOGRAM_BUCKETS + 1) * 8);
const _: () = assert!(core::mem::size_of::<RequestTimes>() == 3 * (HISTOGRAM_BUCKETS + 1) * 8);

const _: () = assert!(core::mem::size_of::<ProcessEvent>() == 24);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loss_counters_each_have_their_own_slot() {
        let mut seen = [false; LOSSES_SIZE as usize];
        for source in LossSource::ALL {
            for errno in LossErrno::ALL {
                let index = loss_index(source, errno);
                assert!(index < LOSSES_SIZE, "{source:?} {errno:?} → {index}");
                assert!(!seen[index as usize], "{source:?} {errno:?} shares {index}");
                seen[index as usize] = true;
            }
        }
        assert_eq!(LossSource::ALL.len() as u32, LossSource::COUNT);
    }

    #[test]
    fn helper_errors_are_classed_by_errno() {
        assert_eq!(LossErrno::of(-7), LossErrno::E2big);
        assert_eq!(LossErrno::of(-12), LossErrno::Enomem);
        assert_eq!(LossErrno::of(-16), LossErrno::Ebusy);
        assert_eq!(LossErrno::of(-17), LossErrno::Eexist);
        assert_eq!(LossErrno::of(-22), LossErrno::Other);
        assert_eq!(LossErrno::of(0), LossErrno::Other);
    }

    #[test]
    fn buckets_cover_the_range_without_gaps() {
        let mut previous_upper = 0;
        for index in 0..HISTOGRAM_BUCKETS {
            let (lower, upper) = histogram_bucket_bounds(index);
            assert_eq!(lower, previous_upper, "gap before bucket {index}");
            assert_eq!(histogram_bucket(lower), index);
            assert_eq!(histogram_bucket(upper - 1), index);
            if index > 0 {
                // 8 sub-buckets per octave: width at most 1/8 of the lower bound.
                assert!((upper - lower) * 8 <= lower, "bucket {index} too wide");
            }
            previous_upper = upper;
        }
        assert_eq!(histogram_bucket(u64::MAX), HISTOGRAM_BUCKETS - 1);
        assert!(histogram_bucket_bounds(HISTOGRAM_BUCKETS - 1).0 > 60_000_000_000);
    }

    #[test]
    fn blocked_threads_are_classified_by_wait_and_request() {
        use Activity::*;
        use Serving::*;
        let blocked = |wait, serving| Activity::blocked(wait, serving, 1, false);
        // Waiting for work whatever the thread holds.
        assert_eq!(blocked(WaitClass::Idle, OneAtATime), OffIdle);
        // A futex is the pool's queue when idle, a lock when serving.
        assert_eq!(blocked(WaitClass::Futex, Nothing), OffIdle);
        assert_eq!(blocked(WaitClass::Futex, OneAtATime), OffLock);
        assert_eq!(blocked(WaitClass::Futex, Multiplexing), OffLock);
        assert_eq!(blocked(WaitClass::Network, OneAtATime), OffNetwork);
        assert_eq!(blocked(WaitClass::Network, Nothing), OffIdle);
        assert_eq!(blocked(WaitClass::Sleep, OneAtATime), OffSleep);
        assert_eq!(blocked(WaitClass::Other, OneAtATime), OffOther);
        // Uninterruptible sleep is disk whether serving or not.
        assert_eq!(
            Activity::blocked(WaitClass::Idle, Nothing, 0, true),
            OffDisk
        );
        for activity in Activity::ALL {
            assert_eq!(Activity::from_u32(activity as u32), activity);
        }
    }

    #[test]
    fn a_worker_polling_a_downstream_is_busy_and_an_event_loop_is_not() {
        use Activity::*;
        use Serving::*;
        let poll = |serving, fds| Activity::blocked(WaitClass::Poll, serving, fds, false);
        // A worker holding one request polls its backend socket (and a wakeup pipe).
        assert_eq!(poll(OneAtATime, 1), OffNetwork);
        assert_eq!(poll(OneAtATime, MAX_DOWNSTREAM_FDS), OffNetwork);
        // Many fds: an event loop, whatever it holds.
        assert_eq!(poll(OneAtATime, MAX_DOWNSTREAM_FDS + 1), OffIdle);
        assert_eq!(poll(OneAtATime, 5000), OffIdle);
        // A thread that once held two requests at once is an event loop.
        assert_eq!(poll(Multiplexing, 1), OffIdle);
        // Holding nothing: waiting for work.
        assert_eq!(poll(Nothing, 1), OffIdle);
        let select = |serving| Activity::blocked(WaitClass::Select, serving, 0, false);
        assert_eq!(select(OneAtATime), OffNetwork);
        assert_eq!(select(Multiplexing), OffIdle);
        assert_eq!(select(Nothing), OffIdle);
        for class in [
            WaitClass::Other,
            WaitClass::Idle,
            WaitClass::Futex,
            WaitClass::Network,
            WaitClass::Sleep,
            WaitClass::Poll,
            WaitClass::Select,
        ] {
            assert_eq!(WaitClass::from_u32(class as u32), class);
        }
    }

    #[test]
    fn log2_of_powers_and_neighbours() {
        for bit in 0..64 {
            let value = 1u64 << bit;
            assert_eq!(log2_floor(value), bit);
            if bit > 1 {
                assert_eq!(log2_floor(value - 1), bit - 1);
            }
        }
    }
}
