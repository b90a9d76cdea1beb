//! Stack sampling and profiles: the key and value of stack counts, and the
//! on-demand profiling sessions.

#[cfg(doc)]
use crate::{Activity, maps};

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
    /// Ids in the generation's stack map; negative: not captured; with
    /// [`OVERFLOW_STACK`] set: in the generation's overflow map; with
    /// [`SHORTENED_STACK`] set: kept less its innermost frame.
    pub user_stack: i32,
    pub kernel_stack: i32,
    /// 0 for the periodic snapshots; else the [`ProfileSession::id`] it was
    /// counted for.
    pub session: u32,
    /// Which caller path behind one frame-pointer stack ([`StackHint`]): 0 for the
    /// path of the stack's hint (or a stack without one), else a hash of the first
    /// return address where this stack's path left the hint's.
    pub variant: u32,
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

/// The one slot (per CPU) of [`maps::OFFCPU_CAPTURES`]: how off-CPU blocks are
/// captured. A CPU captures the stacks of every block of watched threads up to the
/// full rate per second; beyond it, one block in the sampling ratio, chosen at
/// random, whose count and time weigh for that many (unbiased: each block is in with
/// a known probability, and weighs its inverse).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffcpuCaptures {
    /// Start of the CPU's current one-second window, and the blocks captured in full
    /// in it.
    pub window_start_ns: u64,
    pub window_captures: u64,
    /// Blocks captured in full (weight 1), captured as the sample of several, and
    /// left out (stood for by the sampled ones).
    pub full: u64,
    pub sampled: u64,
    pub skipped: u64,
}

/// Set in a stack id (`StackKey`'s `user_stack` and `kernel_stack`, `LockKey::stack`)
/// whose stack was kept less its innermost frame: its whole stack's hash bucket held
/// another stack (a stack map keeps a bucket's first stack until it is drained) and
/// the shortened stack hashed to a free one. The map's id is the other bits.
pub const SHORTENED_STACK: i32 = 1 << 30;

/// Set in a stack id of a generation (`StackKey`'s `user_stack` and `kernel_stack`)
/// whose stack is in that generation's overflow map: its hash bucket in the
/// generation's map held another stack. Every generation's map hashes alike, so
/// without it a stack that collides with another collides in each generation, for
/// as long as both run. The map's id is the other bits.
pub const OVERFLOW_STACK: i32 = 1 << 29;

/// Entries of a generation's overflow map for `stacks` entries of its stack map:
/// it holds only the stacks that collided there, a few per hundred distinct ones.
pub const fn overflow_stacks(stacks: u32) -> u32 {
    let eighth = stacks / 8;
    if eighth < 16 { 16 } else { eighth }
}

/// Stands, innermost, for the frame a stack kept less its innermost one lacks
/// ([`SHORTENED_STACK`]): no code is at the last byte of the address space, and the
/// symbolizer names it `[frame lost]` without looking it up.
pub const LOST_FRAME_ADDRESS: u64 = u64::MAX;

/// Bytes of user stack a [`StackCopy`] holds: enough for the frames of a library
/// without frame pointers between a blocking call and its caller (glibc's lock and
/// sleep paths use a few hundred) and for a dozen interpreter frames.
pub const STACK_COPY_BYTES: usize = 8192;
/// The shorter copy tried when the long one faults (a thread stack's top is near).
pub const STACK_COPY_SHORT_BYTES: usize = 1024;
/// [`StackCopy::map`] of a lock wait's stack ([`maps::LOCK_STACKS`]); below it, the
/// generation of the stack map ([`maps::STACKS`]).
pub const STACK_COPY_LOCKS: u32 = crate::STACK_GENERATIONS;

/// Record of [`maps::STACK_COPIES`]: the thread's user registers and the top of its
/// user stack when the kernel first put user stack `stack` into `map`, walked by
/// frame pointers. User space unwinds the copy by the modules' unwind tables and
/// puts the frames the frame-pointer walk skipped back into that stack.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct StackCopy {
    /// A generation (`0..STACK_GENERATIONS`) or [`STACK_COPY_LOCKS`].
    pub map: u32,
    pub stack: i32,
    pub tgid: u32,
    /// Bytes of `bytes` copied from `sp` up: [`STACK_COPY_BYTES`],
    /// [`STACK_COPY_SHORT_BYTES`], or 0 when the stack could not be read.
    pub len: u32,
    /// [`StackKey::variant`] of the stack copied.
    pub variant: u32,
    pub _pad: u32,
    pub ip: u64,
    pub sp: u64,
    /// The frame pointer (x86_64's rbp, aarch64's x29).
    pub bp: u64,
    pub bytes: [u8; STACK_COPY_BYTES],
}

/// Return addresses a [`StackHint`] holds: enough for a frameless library's own
/// frames (glibc's `usleep` takes three: `clock_nanosleep`, `nanosleep`, `usleep`),
/// a frameless function that called it and that function's caller.
pub const STACK_HINT_WORDS: usize = 6;

/// Value of [`maps::STACK_HINTS`], index the user stack id (of any generation: a
/// stack map puts one frame-pointer stack in the same bucket each time). User space
/// writes it after unwinding a copy whose walk skipped frames: where (in words above
/// `sp`) the unwinder found those frames' return addresses, and their values. Two
/// callers behind one call site reach the same frame-pointer stack, with the same
/// frames up to where their paths part, so the words agree up to a first one that
/// differs: at a capture, that one names the other caller's path
/// ([`StackKey::variant`]), which gets a copy of its own.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackHint {
    /// The innermost instruction of the stack the hint was made from (another stack
    /// in the same bucket has another one, most likely: the hint does not apply).
    pub ip: u64,
    pub words: [u64; STACK_HINT_WORDS],
    /// Where each word is: 8-byte words above `sp`.
    pub offsets: [u16; STACK_HINT_WORDS],
    /// Words in use (0: no hint).
    pub count: u32,
}

/// Key of [`maps::STACK_VARIANTS`]: a caller path ([`StackKey::variant`], not 0) of
/// user stack `stack` in the stack map of `generation`, copied for unwinding.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StackVariantKey {
    pub generation: u32,
    pub stack: i32,
    pub variant: u32,
}

const _: () = assert!(core::mem::size_of::<StackKey>() == 32);
const _: () = assert!(core::mem::size_of::<StackCopy>() == 48 + STACK_COPY_BYTES);
const _: () = assert!(core::mem::size_of::<StackHint>() == 72);
const _: () = assert!(core::mem::size_of::<StackVariantKey>() == 12);
const _: () = assert!(core::mem::size_of::<ProfileSession>() == 40);
const _: () = assert!(core::mem::size_of::<StackCount>() == 16);
const _: () = assert!(core::mem::size_of::<OffcpuCaptures>() == 40);
