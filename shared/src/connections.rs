//! Connections and their requests: watched processes, the connection phase and key,
//! pending syscalls, per-service counters, request durations and listeners.

use crate::{HISTOGRAM_BUCKETS, Histogram, STATUS_CLASSES};
#[cfg(doc)]
use crate::{StatusClass, SyscallSlot, Thread, maps};

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
    /// An HTTP/2 connection (its first bytes were the client preface): its requests
    /// are its streams, followed in [`crate::maps::H2_CONNS`], not by this machine.
    Multiplexed = 6,
}

impl Phase {
    pub const fn from_u32(value: u32) -> Self {
        match value {
            0 => Self::Gone,
            1 => Self::Unserved,
            2 => Self::Waiting,
            3 => Self::Serving,
            4 => Self::Responded,
            6 => Self::Multiplexed,
            _ => Self::Closing,
        }
    }
}

/// Value of [`maps::CONNS`] and [`maps::SOCK_CONNS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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
    /// Last write of the current request so far (0 before the first answer).
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
    /// Tcp backend: the socket's `write_seq` at the last transmit seen as a write (0
    /// before the first), so that a response that went out unseen is told from more
    /// bytes of the same request when the next request arrives; 0 elsewhere.
    pub seen_write_seq: u32,
    /// The status of the current request's final answer, read from its first write
    /// ([`response_status`](crate::response_status), 100–599); 0 until then, or if
    /// its head was not read.
    pub status: u16,
    /// Socket backend: 1 for a connection adopted open, until its first read or write
    /// tells whether it carries HTTP/2 mid-stream; else 0.
    pub adopted: u8,
    /// Socket backend: 1 once its second request began (the only one whose first
    /// bytes may be an HTTP/2 preface, after an `Upgrade: h2c`); else 0.
    pub upgrade_checked: u8,
    /// The stream limit (`SETTINGS_MAX_CONCURRENT_STREAMS`) an HTTP/2 server announced
    /// in a greeting, valid if [`Conn::greeting_limit_set`].
    pub greeting_limit: u32,
    /// 1 if the server wrote before the connection's first request (a greeting: gRPC
    /// sends its SETTINGS at accept).
    pub greeted: u8,
    /// 1 if [`Conn::greeting_limit`] holds a limit.
    pub greeting_limit_set: u8,
    /// How many bytes of [`Conn::line`] the current request's first read filled (0:
    /// none read, or routes are off).
    pub line_len: u16,
    /// The first bytes of the current request (its request line), for its route.
    pub line: crate::RouteLine,
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

/// One CPU's count of an event, in a per-CPU map value. Programs that run in process
/// context (a read's, a write's) and programs that run in softirq context (an
/// arrival's, a transmit's, a handshake's) change the same CPU's counts, and a softirq
/// may run between the load and the store of a process-context program's `+= 1`
/// (on the way out of an interrupt): so a count changes only by [`Count::add`], one
/// atomic add, and never by a load and a store.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Count(u64);

impl Count {
    #[must_use]
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    #[must_use]
    pub const fn get(self) -> u64 {
        self.0
    }

    /// Adds `value` as one atomic add (BPF's `lock add`; the target's `AtomicU64` has
    /// no `fetch_add`). Only the kernel programs change counts.
    #[cfg(target_arch = "bpf")]
    #[inline(always)]
    pub fn add(&mut self, value: u64) {
        // SAFETY: an aligned u64 that `self` borrows mutably; the intrinsic is one
        // BPF atomic add instruction.
        unsafe {
            core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(
                &raw mut self.0,
                value,
            );
        }
    }

    /// The sum of two CPUs' counts.
    #[must_use]
    pub const fn plus(self, other: Self) -> Self {
        Self(self.0 + other.0)
    }
}

/// Per-service counters, summed over CPUs by user space. Each gauge of DESIGN §4 is
/// an `entered − left` pair of [`Count`]s, so that no two CPUs share a counter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceCounters {
    /// Connections that entered [`Phase::Unserved`]: accept/accept4 returned a socket
    /// (syscall backend) or a handshake completed on a watched port (socket backend).
    pub accepted: Count,
    pub unserved_entered: Count,
    pub unserved_left: Count,
    pub waiting_entered: Count,
    pub waiting_left: Count,
    pub serving_entered: Count,
    pub serving_left: Count,
    /// Requests recorded in [`maps::REQUEST_TIMES`], counted after their record: a
    /// service whose count has not moved since its times were read is not read again
    /// (kilobytes, and most services of a node are idle at any moment).
    pub finished: Count,
    /// Finished requests by the [`StatusClass`] of their final answer, indexed by
    /// [`StatusClass::index_of`], counted with [`ServiceCounters::finished`] (their
    /// sum).
    pub responses: [Count; STATUS_CLASSES],
    /// HTTP/2 connections: their first bytes were the client preface.
    pub multiplexed: Count,
    /// HTTP/2 streams ended by RST_STREAM (either side) or by their connection's end
    /// before the server's END_STREAM: they leave `serving` and are not `finished`.
    pub streams_reset: Count,
    /// HTTP/2 streams opened (the client's HEADERS read) and ended, however they
    /// ended: their difference is the streams open, apart from HTTP/1 requests.
    pub streams_opened: Count,
    pub streams_ended: Count,
    /// HTTP/2 streams the server ended with END_STREAM (answered), and those of them
    /// answered by a thread that had answered one before and never read a stream
    /// ([`crate::Thread::is_stream_worker`]): how user space tells a service that
    /// hands streams to a pool of workers from one that serves them all at once.
    pub streams_answered: Count,
    pub streams_answered_by_workers: Count,
    /// HTTP/2 connections whose open streams reached the server's
    /// `SETTINGS_MAX_CONCURRENT_STREAMS`, and that fell below it again (or closed).
    pub at_limit_entered: Count,
    pub at_limit_left: Count,
    /// The highest `SETTINGS_MAX_CONCURRENT_STREAMS` a server of the service announced
    /// (a maximum, not a sum, over CPUs). A plain load and store: only programs in
    /// process context (the server's reads and writes, where SETTINGS are walked)
    /// change it, and those do not interrupt one another.
    pub max_streams: u64,
}

impl ServiceCounters {
    /// Field-wise sum (per-CPU values to one).
    #[must_use]
    pub const fn plus(self, other: &Self) -> Self {
        Self {
            accepted: self.accepted.plus(other.accepted),
            unserved_entered: self.unserved_entered.plus(other.unserved_entered),
            unserved_left: self.unserved_left.plus(other.unserved_left),
            waiting_entered: self.waiting_entered.plus(other.waiting_entered),
            waiting_left: self.waiting_left.plus(other.waiting_left),
            serving_entered: self.serving_entered.plus(other.serving_entered),
            serving_left: self.serving_left.plus(other.serving_left),
            finished: self.finished.plus(other.finished),
            responses: {
                let mut sum = self.responses;
                let mut class = 0;
                while class < STATUS_CLASSES {
                    sum[class] = sum[class].plus(other.responses[class]);
                    class += 1;
                }
                sum
            },
            multiplexed: self.multiplexed.plus(other.multiplexed),
            streams_reset: self.streams_reset.plus(other.streams_reset),
            streams_opened: self.streams_opened.plus(other.streams_opened),
            streams_ended: self.streams_ended.plus(other.streams_ended),
            streams_answered: self.streams_answered.plus(other.streams_answered),
            streams_answered_by_workers: self
                .streams_answered_by_workers
                .plus(other.streams_answered_by_workers),
            at_limit_entered: self.at_limit_entered.plus(other.at_limit_entered),
            at_limit_left: self.at_limit_left.plus(other.at_limit_left),
            max_streams: if self.max_streams > other.max_streams {
                self.max_streams
            } else {
                other.max_streams
            },
        }
    }
}

/// Value of [`maps::REQUEST_TIMES`]: the three durations of every finished request,
/// one for all CPUs (atomic adds, u64 words only: user space copies it word by word).
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

const _: () = assert!(core::mem::size_of::<Watched>() == 16);
const _: () = assert!(core::mem::size_of::<ListenKey>() == 24);
const _: () = assert!(core::mem::size_of::<Conn>() == 72 + crate::ROUTE_BYTES);
// The kernel swaps a connection's phase with the service id beside it, as one u64
// (little-endian: the phase is the high half).
const _: () = assert!(
    core::mem::offset_of!(Conn, service) == 0
        && core::mem::offset_of!(Conn, phase) == 4
        && core::mem::align_of::<Conn>() == 8
);
const _: () = assert!(core::mem::size_of::<PendingCall>() == 16);
const _: () = assert!(core::mem::size_of::<ServiceCounters>() == 136 + 8 * STATUS_CLASSES);
const _: () = assert!(core::mem::size_of::<RequestTimes>() == 3 * (HISTOGRAM_BUCKETS + 1) * 8);
