//! Where a socket call's bytes are in the caller's memory (its syscall's buffer, or
//! iovec array, found through the thread's saved registers), and reading them: the
//! frame headers `h2.rs` follows, the client preface that opens an HTTP/2
//! connection, and the status line of an HTTP/1 response.
use core::ffi::c_void;

use aya_ebpf::helpers::{
    bpf_get_current_task_btf, bpf_probe_read_kernel, generated::bpf_probe_read_user,
};
use poolscope_shared::{
    H2_PREFACE, HTTP1_STATUS_PREFIX, ROUTE_BYTES, RouteLine, SyscallSlot, response_status,
};

use crate::{
    abi::{SECOND_ARG_OFFSET, SavedRegisters, THIRD_ARG_OFFSET},
    maps::SYSCALL_SLOTS,
};

/// Where a call's bytes are in the caller's memory: one buffer, or an iovec array.
#[derive(Clone, Copy)]
pub struct Source {
    /// The buffer, or the iovec array.
    pub base: u64,
    /// Buffers in the iovec array; 0 for one buffer.
    pub iovecs: u64,
    /// The one buffer's length (the call's third argument: what a write gives, what
    /// a read may fill), so that no read goes past it; unused for an iovec array.
    pub size: u64,
}

impl Source {
    /// The source of the syscall the current thread is in, if it is one whose buffer
    /// holds the socket's bytes.
    #[inline(always)]
    pub fn of_current_call() -> Option<Self> {
        Self::of_current(|_| true)
    }

    /// The source of the write-family syscall the current thread is in, if it is in
    /// one.
    #[inline(always)]
    pub fn of_current_write() -> Option<Self> {
        Self::of_current(SyscallSlot::is_write)
    }

    #[inline(always)]
    fn of_current(wanted: impl FnOnce(SyscallSlot) -> bool) -> Option<Self> {
        // SAFETY: the helper returns the current task, typed for the next helper.
        let task = unsafe { bpf_get_current_task_btf() };
        let regs = SavedRegisters::of(task.cast())?;
        let number = u32::try_from(regs.number()).ok()?;
        let slot = SyscallSlot::from_u32(SYSCALL_SLOTS.get(number).copied()?);
        if !wanted(slot) {
            return None;
        }
        Self::of_call(slot, regs.second_arg(), regs.third_arg())
    }

    /// The source of syscall `slot` whose saved registers are at kernel address
    /// `regs` (a raw `sys_exit` argument, read through the helper).
    #[inline(always)]
    pub fn of_saved_call(regs: *const u8, slot: SyscallSlot) -> Option<Self> {
        let arg = |at: usize| {
            // SAFETY: the helper checks the read of the kernel's saved registers.
            unsafe { bpf_probe_read_kernel(regs.wrapping_add(at).cast::<u64>()) }.ok()
        };
        Self::of_call(slot, arg(SECOND_ARG_OFFSET)?, arg(THIRD_ARG_OFFSET)?)
    }

    /// The source of syscall `slot` called with these second and third arguments.
    #[inline(always)]
    pub fn of_call(slot: SyscallSlot, second: u64, third: u64) -> Option<Self> {
        match slot {
            SyscallSlot::Read
            | SyscallSlot::Recvfrom
            | SyscallSlot::Write
            | SyscallSlot::Sendto => Some(Self {
                base: second,
                iovecs: 0,
                size: third,
            }),
            SyscallSlot::Readv | SyscallSlot::Writev => Some(Self {
                base: second,
                iovecs: third,
                size: 0,
            }),
            SyscallSlot::Recvmsg | SyscallSlot::Sendmsg => {
                // struct msghdr: msg_iov at 16, msg_iovlen at 24 (64-bit).
                let base: u64 = read_user(second + 16)?;
                let iovecs: u64 = read_user(second + 24)?;
                Some(Self {
                    base,
                    iovecs,
                    size: 0,
                })
            }
            // sendfile, splice, io_uring: no user buffer holds the bytes.
            _ => None,
        }
    }

    /// Whether the first `len` bytes the call moved begin the client preface (as
    /// many of them as its first buffer holds, up to the preface's length).
    #[inline(always)]
    pub fn begins_with_preface(self, len: i64) -> bool {
        let Some((base, size)) = self.buffer(0) else {
            return false;
        };
        let mut bytes = [0u8; 32];
        let len = len.clamp(0, 24) as u32;
        let len = len.min(size.min(24) as u32);
        len != 0 && copy_user(&mut bytes, len, base) && preface_prefix(&bytes, len)
    }

    /// The status of the HTTP/1 response the `len` bytes the call wrote begin; 0 if
    /// they begin none. The status code must be in the first buffer.
    #[inline(always)]
    pub fn response_status(self, len: u64) -> u16 {
        let prefix = HTTP1_STATUS_PREFIX as u64;
        if len < prefix {
            return 0;
        }
        self.buffer(0)
            .filter(|&(_, size)| size >= prefix)
            .and_then(|(base, _)| read_user::<[u8; HTTP1_STATUS_PREFIX]>(base))
            .map_or(0, |status| response_status(&status))
    }

    /// Copies the first bytes (up to `to`'s length) of the `len` the call moved, as
    /// many as its first buffer holds, to `to`: how many it copied (`None` if none).
    #[inline(always)]
    pub fn read_first(self, to: &mut RouteLine, len: u64) -> Option<u16> {
        let (base, size) = self.buffer(0)?;
        let count = len.min(size).min(ROUTE_BYTES as u64) as u32;
        // SAFETY: `to` holds ROUTE_BYTES, at least `count`; the helper checks
        // the user read.
        let copied =
            unsafe { bpf_probe_read_user(to.as_mut_ptr().cast(), count, base as *const c_void) }
                == 0;
        (copied && count > 0).then_some(count as u16)
    }

    /// Buffer `index` of the source: its address and length.
    #[inline(always)]
    pub fn buffer(self, index: u64) -> Option<(u64, u64)> {
        if self.iovecs == 0 {
            return (index == 0).then_some((self.base, self.size));
        }
        if index >= self.iovecs {
            return None;
        }
        // struct iovec: base, length.
        let iovec: [u64; 2] = read_user(self.base + index * 16)?;
        Some((iovec[0], iovec[1]))
    }
}

/// Reads a `T` from user address `at`.
#[inline(always)]
pub fn read_user<T>(at: u64) -> Option<T> {
    // SAFETY: the helper checks the read and faults nothing.
    unsafe { aya_ebpf::helpers::bpf_probe_read_user(at as *const T) }.ok()
}

/// Copies `len` (≤ 24) bytes from user address `from` to `to`.
#[inline(always)]
pub fn copy_user(to: &mut [u8; 32], len: u32, from: u64) -> bool {
    // SAFETY: `to` has room for 31 bytes; the helper checks the user read.
    unsafe { bpf_probe_read_user(to.as_mut_ptr().cast(), len & 31, from as *const c_void) == 0 }
}

/// Whether the first `len` bytes of `bytes` are the first `len` of the preface.
#[inline(always)]
pub fn preface_prefix(bytes: &[u8; 32], len: u32) -> bool {
    let mut word = 0;
    while word < 3 {
        let at = word * 8;
        let mut have = [0u8; 8];
        have.copy_from_slice(&bytes[at..at + 8]);
        let mut want = [0u8; 8];
        want.copy_from_slice(&H2_PREFACE[at..at + 8]);
        let from = at as u32;
        let mask = if len >= from + 8 {
            u64::MAX
        } else if len <= from {
            0
        } else {
            (1u64 << ((len - from) * 8)) - 1
        };
        if (u64::from_le_bytes(have) ^ u64::from_le_bytes(want)) & mask != 0 {
            return false;
        }
        word += 1;
    }
    true
}
