//! The correlated syscalls counted per service, as dense slots.

use crate::MAX_SERVICES;
#[cfg(doc)]
use crate::maps;

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
