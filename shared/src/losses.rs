//! What the kernel side lost (source and errno), and where each loss is counted.

#[cfg(doc)]
use crate::maps;

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
    /// A lock wait's stack was not kept whole in [`maps::LOCK_STACKS`] (its hash
    /// bucket held another stack: kept less its innermost frame where that fits; or
    /// the stack could not be walked): the wait is kept, without a stack if need be.
    LockStackCapture,
    /// A [`maps::MUTEX_CALLS`] insert failed: one `pthread_mutex_lock` call not timed.
    MutexCallsInsert,
    /// A stack was not kept whole in its [`maps::STACKS`] map (its hash bucket held
    /// another stack: kept less its innermost frame where that fits; or the stack
    /// could not be walked): the sample or block is kept, without that stack if need
    /// be.
    StackCapture,
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
    /// The stack-copy ring buffer ([`maps::STACK_COPIES`]) was full: a stack keeps
    /// its frame-pointer walk (a later block with the same stack tries again).
    StackCopies,
    /// A caller path behind a shared frame-pointer stack was new and
    /// [`maps::STACK_VARIANTS`] was full: its samples and blocks keep their own
    /// count, with the frame-pointer walk for frames.
    StackVariants,
    /// An HTTP/2 connection's bytes broke the protocol (a first frame that is not
    /// SETTINGS, a frame of the wrong size, a preface that stopped matching): it is
    /// no longer followed and counts no more requests.
    Http2Unparsable,
    /// An HTTP/2 connection's bytes could not be read where a frame header was
    /// (io_uring, `sendfile` or `splice`, a buffer the helper could not read): as
    /// above.
    Http2Unreadable,
    /// One read or write of an HTTP/2 connection held more frames or buffers than a
    /// program follows in one run: as above.
    Http2FrameBound,
    /// An HTTP/2 stream opened while the stream 256 ids before it was still open
    /// (their slot was taken): that stream is not counted.
    Http2StreamSlots,
    /// An HTTP/2 connection's state could not be stored in its socket (the socket's
    /// memory limit): it counts no requests.
    Http2ConnsInsert,
    /// A connection adopted open (before its service was watched) turned out to
    /// carry HTTP/2 mid-stream: where its frames begin and which streams are open is
    /// unknown, so it counts no requests.
    Http2Adopted,
    /// An HTTP/2 connection under the syscall backend, which does not follow streams:
    /// it counts no requests.
    Http2SyscallBackend,
    /// An HTTP/2 connection under the tcp backend, which sees no write buffers and so
    /// does not follow streams: it counts no requests.
    Http2TcpBackend,
    /// The route ring buffer ([`maps::ROUTE_EVENTS`]) was full: one finished request
    /// is missing from the route families (its service's own counts have it).
    RouteEvents,
}

impl LossSource {
    pub const COUNT: u32 = 25;
    pub const ALL: [LossSource; 25] = [
        Self::ConnsInsert,
        Self::SockConnsInsert,
        Self::PendingCallsInsert,
        Self::WatchedInsert,
        Self::ProcessEvents,
        Self::ThreadsInsert,
        Self::LocksInsert,
        Self::LockStackCapture,
        Self::MutexCallsInsert,
        Self::StackCapture,
        Self::StackCountsInsert,
        Self::OffCpuStacksExpired,
        Self::DownstreamInsert,
        Self::PhaseRetries,
        Self::StackCopies,
        Self::StackVariants,
        Self::Http2Unparsable,
        Self::Http2Unreadable,
        Self::Http2FrameBound,
        Self::Http2StreamSlots,
        Self::Http2ConnsInsert,
        Self::Http2Adopted,
        Self::Http2SyscallBackend,
        Self::Http2TcpBackend,
        Self::RouteEvents,
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
    /// A stack helper found no stack to walk, or could not read it.
    Efault,
    /// Any other errno.
    Other,
}

impl LossErrno {
    /// Counters per [`LossSource`] in [`maps::LOSSES`] (a power of two: the index is
    /// a shift the verifier bounds).
    pub const SLOTS: u32 = 8;
    pub const ALL: [LossErrno; 7] = [
        Self::None,
        Self::E2big,
        Self::Enomem,
        Self::Ebusy,
        Self::Eexist,
        Self::Efault,
        Self::Other,
    ];

    /// The class of a helper's return `code` (a negative errno).
    #[inline(always)]
    pub const fn of(code: i64) -> Self {
        const E2BIG: i64 = 7;
        const ENOMEM: i64 = 12;
        const EFAULT: i64 = 14;
        const EBUSY: i64 = 16;
        const EEXIST: i64 = 17;
        match -code {
            E2BIG => Self::E2big,
            ENOMEM => Self::Enomem,
            EBUSY => Self::Ebusy,
            EEXIST => Self::Eexist,
            EFAULT => Self::Efault,
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
            Self::Efault => "EFAULT",
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
}
