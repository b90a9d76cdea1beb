//! Types, map names and limits shared by the kernel programs (`poolscope-ebpf`) and
//! the exporter. Everything here is `#[repr(C)]` with explicit padding so that both
//! sides agree on the layout; the size asserts at the bottom catch drift.
#![no_std]

/// Map names, as the exporter looks them up in the loaded object.
pub mod maps {
    /// tgid (u32) → [`crate::Watched`]: the processes whose events we keep.
    pub const WATCHED: &str = "WATCHED";
    /// [`crate::ConnKey`] → [`crate::Conn`]: accepted connections of watched processes.
    pub const CONNS: &str = "CONNS";
    /// tid (u32) → [`crate::PendingCall`]: an accept, or a first read of a connection,
    /// between syscall entry and exit.
    pub const PENDING_CALLS: &str = "PENDING_CALLS";
    /// syscall number (index) → [`crate::SyscallSlot`] as u32, filled by user space.
    pub const SYSCALL_SLOTS: &str = "SYSCALL_SLOTS";
    /// per-CPU array, index [`crate::syscall_counter_index`] → calls.
    pub const SYSCALL_COUNTS: &str = "SYSCALL_COUNTS";
    /// per-CPU array, index service id → [`crate::ServiceCounters`].
    pub const SERVICE_COUNTERS: &str = "SERVICE_COUNTERS";
    /// per-CPU array, index [`crate::LossSource`] → events or updates lost.
    pub const LOSSES: &str = "LOSSES";
    /// ring buffer of [`crate::ProcessEvent`].
    pub const PROCESS_EVENTS: &str = "PROCESS_EVENTS";
}

/// Capacity of the per-service arrays; service ids are `0..MAX_SERVICES`.
pub const MAX_SERVICES: u32 = 1024;
/// Capacity of [`maps::PENDING_CALLS`]: at most one entry per thread inside a syscall.
pub const PENDING_CALLS_CAPACITY: u32 = 16384;
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

/// Key of [`maps::CONNS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ConnKey {
    pub tgid: u32,
    pub fd: u32,
}

/// Connection has been accepted but no request byte was read yet.
pub const CONN_UNSERVED: u32 = 1;

/// Value of [`maps::CONNS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conn {
    pub service: u32,
    /// Bit set of `CONN_*` flags.
    pub flags: u32,
    /// [`Watched::since_ns`] of the owning process when the entry was made; an entry
    /// whose owner no longer matches is stale (the process exited, its pid was reused).
    pub owner_since_ns: u64,
}

/// Value of [`maps::PENDING_CALLS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PendingCall {
    /// [`SyscallSlot`] as u32.
    pub slot: u32,
    /// The fd argument (reads); unused for accepts.
    pub fd: u32,
}

/// Per-service counters, summed over CPUs by user space.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServiceCounters {
    /// Connections returned by accept/accept4.
    pub accepted: u64,
    /// Connections that became unserved (tracked after accept).
    pub unserved_entered: u64,
    /// Connections that stopped being unserved: first read, close, fd reuse.
    pub unserved_left: u64,
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
}

/// Index into [`maps::SYSCALL_COUNTS`].
pub const fn syscall_counter_index(service: u32, slot: SyscallSlot) -> u32 {
    service * SyscallSlot::COUNT + slot as u32
}

/// Entries of [`maps::SYSCALL_COUNTS`].
pub const SYSCALL_COUNTS_SIZE: u32 = MAX_SERVICES * SyscallSlot::COUNT;

/// Where the kernel side lost something; index into [`maps::LOSSES`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossSource {
    /// A [`maps::CONNS`] insert failed (map full).
    ConnsFull = 0,
    /// A [`maps::PENDING_CALLS`] insert failed.
    PendingCallsFull,
    /// A [`maps::WATCHED`] insert for a forked child failed.
    WatchedFull,
    /// The process-event ring buffer was full.
    ProcessEvents,
}

impl LossSource {
    pub const COUNT: u32 = 4;
    pub const ALL: [LossSource; 4] = [
        Self::ConnsFull,
        Self::PendingCallsFull,
        Self::WatchedFull,
        Self::ProcessEvents,
    ];
}

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
    unsafe impl aya::Pod for super::ConnKey {}
    unsafe impl aya::Pod for super::Conn {}
    unsafe impl aya::Pod for super::PendingCall {}
    unsafe impl aya::Pod for super::ServiceCounters {}
    unsafe impl aya::Pod for super::ProcessEvent {}
}

const _: () = assert!(core::mem::size_of::<Watched>() == 16);
const _: () = assert!(core::mem::size_of::<ConnKey>() == 8);
const _: () = assert!(core::mem::size_of::<Conn>() == 16);
const _: () = assert!(core::mem::size_of::<PendingCall>() == 8);
const _: () = assert!(core::mem::size_of::<ServiceCounters>() == 24);
const _: () = assert!(core::mem::size_of::<ProcessEvent>() == 24);
