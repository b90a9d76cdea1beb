//! Threads and their pools: what a thread is doing (activity, wait class), its map
//! entry, the per-pool time stats, and the downstream peers it waits on.

#[cfg(doc)]
use crate::maps;

/// Default slots of [`maps::THREAD_ENTRIES`] and [`maps::THREAD_OWNERS`]
/// (`limits.thread_slots`); a power of two. Tids are dense, so consecutive tids take
/// different slots: with a thousand followed threads, about 6 % share a slot with
/// another and live in [`maps::THREADS`] instead.
pub const THREAD_SLOTS: u32 = 16384;

/// Bit of a [`maps::THREAD_OWNERS`] word while its owner fills the slot: no tid
/// matches it (tids are below 2^22), so no event reads the entry half written.
pub const SLOT_CLAIMING: u64 = 1 << 31;
/// One followed thread of this slot in [`maps::THREADS`], in a [`maps::THREAD_OWNERS`]
/// word's upper half.
pub const SLOT_OVERFLOW_ONE: u64 = 1 << 32;

/// The slot of `tid` among `slots` (a power of two).
pub const fn thread_slot(tid: u32, slots: u32) -> u32 {
    tid & slots.wrapping_sub(1)
}

/// The tid that owns a slot, from its [`maps::THREAD_OWNERS`] word (0: none; with
/// [`SLOT_CLAIMING`] set: being filled).
pub const fn slot_owner(word: u64) -> u32 {
    word as u32
}

/// The tid that owns a slot or is claiming it, from its [`maps::THREAD_OWNERS`]
/// word (0: none): a thread finds its own slot taken by itself, not by another.
pub const fn slot_claimant(word: u64) -> u32 {
    slot_owner(word) & !(SLOT_CLAIMING as u32)
}

/// The [`maps::THREAD_OWNERS`] word while `tid` fills the free slot whose word was
/// `free` (its overflow count kept).
pub const fn slot_claiming(free: u64, tid: u32) -> u64 {
    free | SLOT_CLAIMING | tid as u64
}

/// How many followed threads of a slot live in [`maps::THREADS`] instead, from its
/// [`maps::THREAD_OWNERS`] word: a lookup there is needed only if this is not 0.
pub const fn slot_overflow(word: u64) -> u32 {
    (word >> 32) as u32
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
            // A worker handed streams waits for the next one on its pool's queue.
            (WaitClass::Futex, Serving::Streams) => Self::OffIdle,
            (WaitClass::Poll, Serving::OneAtATime | Serving::Streams)
                if polled_fds <= MAX_DOWNSTREAM_FDS =>
            {
                Self::OffNetwork
            }
            (WaitClass::Select, Serving::OneAtATime | Serving::Streams) => Self::OffNetwork,
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
    /// No request of its own, but a worker that answers HTTP/2 streams another thread
    /// read ([`StreamWorkers`]): the thread may be serving one, so its waits are busy
    /// unless they wait for work (epoll and the like, or a futex wait: its pool's
    /// queue, or a lock).
    Streams,
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

/// Value of [`maps::THREAD_ENTRIES`] and [`maps::THREADS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Thread {
    pub service: u32,
    /// [`Activity`] as u32, since `since_ns`.
    pub activity: u32,
    /// Requests this thread started (read) whose response has not begun: while it
    /// holds one the thread is serving, and its time also goes to the requests'
    /// components, once per request it holds.
    pub serving: HeldRequests,
    /// 1 once a request this thread read was answered by another thread (an M:N
    /// runtime such as Go, or a hand-off): its waits then do not count as the
    /// request's, since the request may be served elsewhere meanwhile.
    pub hands_off: u32,
    /// 1 once this thread held two requests at once: it multiplexes connections (an
    /// event loop), so its poll or select waits for any of them, not a downstream.
    pub multiplexes: u32,
    /// 1 once this thread read a request: one of its pool's threads that serve
    /// (capacity counts these; a master process or an arbiter named like its workers
    /// is in their pool but never serves).
    pub served: u32,
    /// The caller path of `offcpu_user_stack` ([`crate::StackKey::variant`]; here,
    /// where the struct had a hole).
    pub offcpu_variant: u32,
    /// The thread's pool as the kernel last read it from [`maps::THREAD_POOLS`]
    /// ([`crate::NO_POOL`]: none), valid while `pool_epoch` is the epoch in
    /// [`maps::POOL_EPOCH`] plus one (0: never read). User space raises the epoch
    /// after it changes a thread's pool, so the kernel reads the hash map once per
    /// change instead of at every event.
    pub pool: u32,
    /// The socket peer of the network wait the thread is in ([`Peer::NONE`]: none
    /// known), to which the wait's time goes in [`maps::DOWNSTREAM_WAITS`].
    pub downstream: Peer,
    pub pool_epoch: u32,
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
    /// 1 if the wait's first futex call had a timeout
    /// ([`crate::LockPrimitive::FutexTimed`]).
    pub lock_timed: u32,
    /// The stacks at which the thread last blocked (off CPU), in the stack maps of
    /// `offcpu_epoch` (negative id: not captured), and its process (a wakeup runs
    /// in the waker's).
    pub offcpu_user_stack: i32,
    pub offcpu_kernel_stack: i32,
    pub offcpu_epoch: u32,
    pub offcpu_tgid: u32,
    /// How many blocks the captured one stands for: 1, or
    /// [`crate::OffcpuCaptures`]' sampling ratio once its CPU is past the full rate.
    pub offcpu_weight: u32,
    /// What it did on followed HTTP/2 connections: [`STREAM_READER`] once it read
    /// one's bytes, [`STREAM_ANSWERER`] once it wrote a stream's END_STREAM. A thread
    /// that answers streams and never reads one is a worker that other threads hand
    /// streams to ([`Thread::is_stream_worker`]).
    pub streams: u32,
    /// When the thread last blocked (request boundaries cut `since_ns`, not this).
    pub blocked_since_ns: u64,
    /// When the thread last blocked: its run queue's clock less the kernel's total
    /// of its run-queue waits (`sched_info.run_delay`) less our clock (wrapping),
    /// [`BLOCK_UNSEEN`] if that block was not seen. A later wait's start by the
    /// kernel's clock (`sched_info.last_queued`), less the waits the kernel added
    /// since, less this, is when the thread was woken by our clock (see `sched.rs`).
    pub clock_offset_at_block: u64,
}

/// How a service's threads that hold no request are read (`STREAM_WORKERS`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamWorkers {
    /// Not configured: the threads that answer streams and never read one
    /// ([`Thread::is_stream_worker`]) serve streams.
    Detect = 0,
    /// Configured on: every such thread may serve a stream.
    Every = 1,
    /// Configured off: none does.
    None = 2,
}

/// [`Thread::serving`]: the requests a thread holds (read, their response not
/// begun), as two counts that each have one kind of writer, so that no update is
/// lost. The thread itself starts its requests: `started` changes only in its own
/// programs, in its process context. Whichever thread or softirq ends one adds to
/// `ended` atomically: a request one thread read is often answered on another (Go's
/// goroutines move between threads; a hand-off), and a close ends it in softirq on
/// any CPU. One count changed by both, a read-modify-write on each side, lost ends
/// that two CPUs made at once and left the thread serving for good (tests/tests/
/// stress.rs, Go's net/http: a thread left serving in 6 of 12 runs).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeldRequests {
    started: u32,
    ended: u32,
}

/// A thread holding more requests than this reads as holding this many: the cap
/// keeps one miscounted thread from multiplying its time without bound.
pub const MAX_HELD_REQUESTS: u32 = 4096;

impl HeldRequests {
    pub const NONE: Self = Self {
        started: 0,
        ended: 0,
    };

    /// The requests held now, at most [`MAX_HELD_REQUESTS`]. An end whose start this
    /// entry did not count (the thread's tid taken by a new thread in between) makes
    /// the difference negative: 0 until as many starts.
    #[must_use]
    pub const fn open(self) -> u32 {
        let open = self.started.wrapping_sub(self.ended);
        if open > i32::MAX as u32 {
            0
        } else if open > MAX_HELD_REQUESTS {
            MAX_HELD_REQUESTS
        } else {
            open
        }
    }

    /// The thread started a request (only its own programs call this).
    pub const fn start(&mut self) {
        self.started = self.started.wrapping_add(1);
    }

    /// A request the thread held ended, wherever it ended: one BPF atomic add.
    #[cfg(target_arch = "bpf")]
    #[inline(always)]
    pub fn end(&mut self) {
        // SAFETY: an aligned u32 that `self` borrows mutably; the intrinsic is one BPF
        // atomic add instruction.
        unsafe {
            core::intrinsics::atomic_xadd::<u32, u32, { core::intrinsics::AtomicOrdering::Relaxed }>(
                &raw mut self.ended,
                1,
            );
        }
    }
}

/// [`Thread::streams`] bits.
pub const STREAM_READER: u32 = 1;
pub const STREAM_ANSWERER: u32 = 2;

/// [`Thread::clock_offset_at_block`] of a thread whose block was not seen.
pub const BLOCK_UNSEEN: u64 = u64::MAX;

impl Thread {
    /// A thread of `service` doing `activity` since `since_ns`, holding nothing.
    pub const fn new(service: u32, activity: Activity, since_ns: u64) -> Self {
        Self {
            service,
            activity: activity as u32,
            serving: HeldRequests::NONE,
            hands_off: 0,
            multiplexes: 0,
            served: 0,
            streams: 0,
            pool: crate::NO_POOL,
            downstream: Peer::NONE,
            pool_epoch: 0,
            since_ns,
            running_ns: 0,
            runnable_ns: 0,
            lock_since_ns: 0,
            lock_waited_ns: 0,
            lock_ended_ns: 0,
            lock_address: 0,
            lock_tgid: 0,
            lock_stack: -1,
            lock_timed: 0,
            offcpu_user_stack: -1,
            offcpu_kernel_stack: -1,
            offcpu_epoch: 0,
            offcpu_tgid: 0,
            offcpu_weight: 0,
            offcpu_variant: 0,
            blocked_since_ns: 0,
            clock_offset_at_block: BLOCK_UNSEEN,
        }
    }

    /// It answers HTTP/2 streams that other threads read: a worker of a pool that a
    /// reading thread hands each stream to (grpcio's executor).
    pub const fn is_stream_worker(&self) -> bool {
        self.streams == STREAM_ANSWERER
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

/// Value of [`maps::POOL_STATS`]: closed intervals of the pool's threads. User space
/// adds each live thread's open interval at read time.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Thread time per [`Activity`].
    pub time_ns: [u64; Activity::COUNT],
    /// Request time per [`Activity`] of the thread serving it, once per request held.
    pub request_ns: [u64; Activity::COUNT],
    /// Run-queue waits (runnable → on CPU) recorded in [`maps::POOL_RUNQUEUE`],
    /// counted after each record: user space reads that histogram again only when
    /// this moved.
    pub runqueue_waits: u64,
    /// Their time, the histogram's sum: with `runqueue_waits` the mean wait, which is
    /// what a scrape exports unless it asks for the buckets (then the per-CPU
    /// histograms, kilobytes per pool per CPU, need not be read).
    pub runqueue_wait_ns: u64,
    /// Threads of the pool that exited after serving a request (`Thread::served`): a
    /// server that starts a thread per connection has served with many threads over
    /// a window, few of them alive at any instant.
    pub served_exits: u64,
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
        self.runqueue_waits += other.runqueue_waits;
        self.runqueue_wait_ns += other.runqueue_wait_ns;
        self.served_exits += other.served_exits;
    }
}

const _: () = assert!(Activity::COUNT.is_power_of_two() && Activity::ALL.len() == Activity::COUNT);
const _: () = assert!(THREAD_SLOTS.is_power_of_two());
const _: () = assert!(core::mem::size_of::<Thread>() == 176);
const _: () = assert!(core::mem::size_of::<Peer>() == 20);
const _: () = assert!(core::mem::size_of::<DownstreamKey>() == 24);
const _: () = assert!(core::mem::size_of::<DownstreamWait>() == 16);
const _: () = assert!(core::mem::size_of::<PoolStats>() == 2 * Activity::COUNT * 8 + 24);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_requests_are_starts_less_ends_within_their_bounds() {
        let held = |started, ended| HeldRequests { started, ended }.open();
        assert_eq!(held(0, 0), 0);
        assert_eq!(held(5, 3), 2);
        // Both counts wrap: a thread that served 2^32 requests still reads right.
        assert_eq!(held(1, u32::MAX), 2);
        // An end this entry never saw start: nothing held, not 4 billion.
        assert_eq!(held(3, 4), 0);
        assert_eq!(held(10_000, 0), MAX_HELD_REQUESTS);
        let mut one = HeldRequests::NONE;
        one.start();
        assert_eq!(one.open(), 1);
    }

    #[test]
    fn a_slot_word_holds_its_owner_claimant_and_overflow() {
        let free = 3 * SLOT_OVERFLOW_ONE;
        let claiming = slot_claiming(free, 4242);
        assert_eq!(
            (slot_owner(free), slot_claimant(free), slot_overflow(free)),
            (0, 0, 3)
        );
        // While it is claimed, no tid matches the owner; the claimant is the tid.
        assert_ne!(slot_owner(claiming), 4242);
        assert_eq!(
            (slot_claimant(claiming), slot_overflow(claiming)),
            (4242, 3)
        );
        let owned = claiming - SLOT_CLAIMING;
        assert_eq!(
            (
                slot_owner(owned),
                slot_claimant(owned),
                slot_overflow(owned)
            ),
            (4242, 4242, 3)
        );
        assert_eq!(owned - 4242, free);
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
        // A worker of a service that hands it HTTP/2 streams: busy unless it waits
        // for work (its pool's queue is a futex).
        assert_eq!(blocked(WaitClass::Futex, Streams), OffIdle);
        assert_eq!(blocked(WaitClass::Idle, Streams), OffIdle);
        assert_eq!(blocked(WaitClass::Sleep, Streams), OffSleep);
        assert_eq!(blocked(WaitClass::Network, Streams), OffNetwork);
        assert_eq!(blocked(WaitClass::Other, Streams), OffOther);
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
}
