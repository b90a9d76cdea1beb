//! The syscall ABI of each architecture the programs build for: where a blocked
//! thread's saved registers hold its syscall number and first arguments, and the
//! numbers of the futex calls (the other syscalls are told by tables user space fills,
//! from its own libc's numbers).
/// Offsets in `struct pt_regs` of the first two syscall arguments and of the syscall
/// number, and the number of futex(2).
#[cfg(bpf_target_arch = "x86_64")]
pub const FIRST_ARG_OFFSET: usize = 112; // rdi
#[cfg(bpf_target_arch = "x86_64")]
pub const SECOND_ARG_OFFSET: usize = 104; // rsi
#[cfg(bpf_target_arch = "x86_64")]
pub const NUMBER_OFFSET: usize = 120; // orig_ax
#[cfg(bpf_target_arch = "x86_64")]
pub const SYS_FUTEX: u64 = 202;
#[cfg(bpf_target_arch = "aarch64")]
pub const FIRST_ARG_OFFSET: usize = 0; // regs[0]
#[cfg(bpf_target_arch = "aarch64")]
pub const SECOND_ARG_OFFSET: usize = 8; // regs[1]
#[cfg(bpf_target_arch = "aarch64")]
pub const NUMBER_OFFSET: usize = 280; // syscallno
#[cfg(bpf_target_arch = "aarch64")]
pub const SYS_FUTEX: u64 = 98;
/// futex_waitv(2) and futex_wait(2): one number on every architecture.
pub const SYS_FUTEX_WAITV: u64 = 449;
pub const SYS_FUTEX_WAIT: u64 = 455;
