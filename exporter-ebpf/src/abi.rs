//! The syscall ABI of each architecture the programs build for: where a blocked
//! thread's saved registers hold its syscall number and first arguments, and the
//! numbers of the futex calls (the other syscalls are told by tables user space fills,
//! from its own libc's numbers), and [`SavedRegisters`] to read them.
use aya_ebpf::{bindings::task_struct, helpers::bpf_task_pt_regs};

/// Offsets in `struct pt_regs` of the first two syscall arguments and of the syscall
/// number, and the number of futex(2).
#[cfg(bpf_target_arch = "x86_64")]
pub const FIRST_ARG_OFFSET: usize = 112; // rdi
#[cfg(bpf_target_arch = "x86_64")]
pub const SECOND_ARG_OFFSET: usize = 104; // rsi
#[cfg(bpf_target_arch = "x86_64")]
pub const THIRD_ARG_OFFSET: usize = 96; // rdx
#[cfg(bpf_target_arch = "x86_64")]
pub const FOURTH_ARG_OFFSET: usize = 56; // r10 (a syscall's, not rcx as in calls)
#[cfg(bpf_target_arch = "x86_64")]
pub const FIFTH_ARG_OFFSET: usize = 72; // r8
#[cfg(bpf_target_arch = "x86_64")]
pub const NUMBER_OFFSET: usize = 120; // orig_ax
/// Offsets in `struct pt_regs` of the user instruction, stack and frame pointers.
#[cfg(bpf_target_arch = "x86_64")]
pub const IP_OFFSET: usize = 128; // ip
#[cfg(bpf_target_arch = "x86_64")]
pub const SP_OFFSET: usize = 152; // sp
#[cfg(bpf_target_arch = "x86_64")]
pub const FP_OFFSET: usize = 32; // bp
/// The type of the syscall number's field (a load must match the field's size).
#[cfg(bpf_target_arch = "x86_64")]
type SyscallNumber = u64;
#[cfg(bpf_target_arch = "x86_64")]
pub const SYS_FUTEX: u64 = 202;
#[cfg(bpf_target_arch = "aarch64")]
pub const FIRST_ARG_OFFSET: usize = 0; // regs[0]
#[cfg(bpf_target_arch = "aarch64")]
pub const SECOND_ARG_OFFSET: usize = 8; // regs[1]
#[cfg(bpf_target_arch = "aarch64")]
pub const THIRD_ARG_OFFSET: usize = 16; // regs[2]
#[cfg(bpf_target_arch = "aarch64")]
pub const FOURTH_ARG_OFFSET: usize = 24; // regs[3]
#[cfg(bpf_target_arch = "aarch64")]
pub const FIFTH_ARG_OFFSET: usize = 32; // regs[4]
#[cfg(bpf_target_arch = "aarch64")]
pub const NUMBER_OFFSET: usize = 280; // syscallno
#[cfg(bpf_target_arch = "aarch64")]
pub const IP_OFFSET: usize = 256; // pc
#[cfg(bpf_target_arch = "aarch64")]
pub const SP_OFFSET: usize = 248; // sp
#[cfg(bpf_target_arch = "aarch64")]
pub const FP_OFFSET: usize = 232; // regs[29]
#[cfg(bpf_target_arch = "aarch64")]
type SyscallNumber = i32;
#[cfg(bpf_target_arch = "aarch64")]
pub const SYS_FUTEX: u64 = 98;
/// futex_waitv(2) and futex_wait(2): one number on every architecture.
pub const SYS_FUTEX_WAITV: u64 = 449;
pub const SYS_FUTEX_WAIT: u64 = 455;

/// A thread's saved user registers: the typed `struct pt_regs` pointer that
/// `bpf_task_pt_regs` returns. Its fields are plain loads that the verifier checks
/// against the kernel's BTF (offset and size of a field) and the kernel guards
/// against faults: no probe-read helper call (about 40 ns each on the machines
/// `cargo xtask bench` ran on).
#[derive(Clone, Copy)]
pub struct SavedRegisters(*const u8);

impl SavedRegisters {
    /// The saved registers of `task`, a typed `task_struct` pointer (a `tp_btf`
    /// argument, or `bpf_get_current_task_btf`); `None` if the kernel has none.
    #[inline(always)]
    pub fn of(task: *const u8) -> Option<Self> {
        // SAFETY: the verifier checks that `task` is a typed task pointer; the
        // helper returns its pt_regs (never NULL for a user task; checked anyway).
        let regs = unsafe { bpf_task_pt_regs(task.cast_mut().cast::<task_struct>()) } as *const u8;
        (!regs.is_null()).then_some(Self(regs))
    }

    #[inline(always)]
    fn load<T>(self, offset: usize) -> T {
        // SAFETY: a typed pt_regs pointer and the offset of one of its fields of
        // type T (the constants above); the verifier refuses any other load.
        unsafe { core::ptr::read_volatile(self.0.add(offset).cast::<T>()) }
    }

    /// The syscall number (-1 as u64, or an error code, outside a syscall).
    #[inline(always)]
    #[allow(
        clippy::unnecessary_cast,
        reason = "u64 on x86_64, but an i32 to sign-extend on aarch64"
    )]
    pub fn number(self) -> u64 {
        self.load::<SyscallNumber>(NUMBER_OFFSET) as u64
    }

    #[inline(always)]
    pub fn first_arg(self) -> u64 {
        self.load(FIRST_ARG_OFFSET)
    }

    #[inline(always)]
    pub fn second_arg(self) -> u64 {
        self.load(SECOND_ARG_OFFSET)
    }

    /// The user instruction pointer, stack pointer and frame pointer.
    #[inline(always)]
    pub fn ip(self) -> u64 {
        self.load(IP_OFFSET)
    }

    #[inline(always)]
    pub fn sp(self) -> u64 {
        self.load(SP_OFFSET)
    }

    #[inline(always)]
    pub fn fp(self) -> u64 {
        self.load(FP_OFFSET)
    }

    #[inline(always)]
    pub fn third_arg(self) -> u64 {
        self.load(THIRD_ARG_OFFSET)
    }

    #[inline(always)]
    pub fn fourth_arg(self) -> u64 {
        self.load(FOURTH_ARG_OFFSET)
    }

    #[inline(always)]
    pub fn fifth_arg(self) -> u64 {
        self.load(FIFTH_ARG_OFFSET)
    }
}
