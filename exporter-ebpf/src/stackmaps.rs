//! The stack maps of the three rotating generations (see `stacks.rs`): capturing the
//! current stacks into one, telling apart the callers behind one frame-pointer stack,
//! copying a user stack (or caller path) new to its map for user space to unwind, and
//! counting a sample or block under its key. Shared by the always-on stack counts,
//! the lock waits and the on-demand profiling sessions.
use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_task_btf, bpf_probe_read_user, bpf_probe_read_user_buf},
    maps::StackTrace,
    programs::tracing::StackIdContext,
};
use poolscope_shared::{
    LossErrno, LossSource, OVERFLOW_STACK, SHORTENED_STACK, STACK_COPY_BYTES,
    STACK_COPY_SHORT_BYTES, STACK_HINT_WORDS, StackCopy, StackCount, StackKey, StackVariantKey,
    maps::CountedMap,
};

use crate::{
    abi::SavedRegisters,
    maps::{
        EEXIST, STACK_COPIED, STACK_COPIES, STACK_COUNTS, STACK_EPOCH, STACK_HINTS, STACK_VARIANTS,
        STACKS_0, STACKS_1, STACKS_2, STACKS_OVERFLOW_0, STACKS_OVERFLOW_1, STACKS_OVERFLOW_2,
        atomic_add, compare_and_swap, count_loss, get_or_insert,
    },
};

/// The stacks of one capture: ids in the generation's stack map (negative: not
/// captured) and the user stack's caller path ([`StackKey::variant`]).
#[derive(Clone, Copy)]
pub struct Captured {
    pub user: i32,
    pub kernel: i32,
    pub variant: u32,
}

/// bpf_get_stackid flag: the user stack.
pub const BPF_F_USER_STACK: u64 = 1 << 8;

/// bpf_get_stackid's error when there is no stack to walk (or it cannot be read).
const EFAULT: i32 = 14;

/// bpf_get_stackid flags: skip the innermost frame (`BPF_F_SKIP_FIELD_MASK`'s count).
const SKIP_ONE_FRAME: u64 = 1;

/// bpf_ringbuf_submit flag: no wakeup (user space reads the copies at its drains).
const BPF_RB_NO_WAKEUP: u64 = 1;

/// Slots per stack map in `STACK_COPIED` (the larger stack map's size), set at load
/// time.
#[unsafe(no_mangle)]
static STACK_COPY_STRIDE: u32 = 0;

#[inline(always)]
pub fn current_epoch() -> u32 {
    STACK_EPOCH.get(0).copied().unwrap_or(0)
}

/// The id of the current user stack (`BPF_F_USER_STACK` in `flags`) or kernel stack
/// in `map`; -1 if not captured, counted under `loss` by its errno (its bucket held
/// another stack, no free bucket, or no stack could be walked). A sample taken in
/// user mode has no kernel stack: that is not a loss.
///
/// A bucket keeps the first stack that hashed to it until the map is drained, so a
/// stack whose bucket another took would be refused for the rest of the generation,
/// and, every generation's map hashing alike, in each generation (a service's one hot
/// stack then lost its frames for the whole run). It goes to `overflow` instead,
/// marked [`OVERFLOW_STACK`]: not a loss. Where that bucket is taken too (or there is
/// no overflow map), it is taken again less its innermost frame, which hashes to
/// another bucket, and marked [`SHORTENED_STACK`]: still counted as the collision it
/// was, kept with its callers. Either id is past every copy slot and hint, so it is
/// never copied for unwinding (the copy of a shortened stack would begin at the frame
/// its id lacks).
#[inline(always)]
pub fn stack_id<C: StackIdContext>(
    ctx: &C,
    map: &StackTrace,
    overflow: Option<&StackTrace>,
    flags: u64,
    loss: LossSource,
) -> i32 {
    let error = match ctx.get_stackid(map, flags) {
        Ok(id) => return id as i32,
        Err(error) => error,
    };
    if error == -EEXIST
        && let Some(overflow) = overflow
        && let Ok(id) = ctx.get_stackid(overflow, flags)
    {
        return id as i32 | OVERFLOW_STACK;
    }
    if error != -EFAULT || flags & BPF_F_USER_STACK != 0 {
        count_loss(loss, LossErrno::of(error.into()));
    }
    if error == -EEXIST
        && let Ok(id) = ctx.get_stackid(map, flags | SKIP_ONE_FRAME)
    {
        return id as i32 | SHORTENED_STACK;
    }
    -1
}

/// The current stacks in the stack map of `generation`; a user stack (or caller
/// path) new to the map is also copied for unwinding.
#[inline(always)]
pub fn capture<C: StackIdContext>(ctx: &C, generation: u32) -> Captured {
    let (map, overflow) = match generation {
        0 => (&STACKS_0, &STACKS_OVERFLOW_0),
        1 => (&STACKS_1, &STACKS_OVERFLOW_1),
        _ => (&STACKS_2, &STACKS_OVERFLOW_2),
    };
    let user = stack_id(
        ctx,
        map,
        Some(overflow),
        BPF_F_USER_STACK,
        LossSource::StackCapture,
    );
    let variant = caller_path(user);
    copy_user_stack(generation, user, variant);
    Captured {
        user,
        kernel: stack_id(ctx, map, Some(overflow), 0, LossSource::StackCapture),
        variant,
    }
}

/// The caller path of the current user stack `id` ([`StackKey::variant`]): 0 unless
/// the id has a hint made from the same instruction and one of its words differs
/// on this thread's stack; then the first word that differs, and which one it was.
/// A stack without a hint (most: their walks skip nothing) pays one array read.
#[inline(always)]
fn caller_path(id: i32) -> u32 {
    let Ok(index) = u32::try_from(id) else {
        return 0;
    };
    let Some(hint) = STACK_HINTS.get(index) else {
        return 0;
    };
    if hint.count == 0 {
        return 0;
    }
    // SAFETY: no preconditions; a typed pointer to the current task.
    let task = unsafe { bpf_get_current_task_btf() };
    let Some(regs) = SavedRegisters::of(task.cast_const().cast()) else {
        return 0;
    };
    if regs.ip() != hint.ip {
        return 0;
    }
    let sp = regs.sp();
    for word in 0..STACK_HINT_WORDS {
        if word as u32 >= hint.count {
            break;
        }
        let address = sp.wrapping_add(u64::from(hint.offsets[word]) * 8);
        // SAFETY: the helper checks the user read (a fault reads as 0: it differs).
        let found = unsafe { bpf_probe_read_user(address as *const u64) }.unwrap_or(0);
        if found != hint.words[word] {
            // Never 0: the word's index is in the top bits.
            return ((word as u32 + 1) << 28) ^ ((found ^ (found >> 32)) as u32 & 0x0fff_ffff);
        }
    }
    0
}

/// Adds `samples` samples or blocks, of `ns` in all, to `key`'s count.
#[inline(always)]
pub fn add(key: &StackKey, samples: u64, ns: u64) {
    let Some(count) = get_or_insert(
        &STACK_COUNTS,
        Some(CountedMap::StackCounts),
        key,
        &StackCount::default(),
        LossSource::StackCountsInsert,
    ) else {
        return;
    };
    // SAFETY: a live map value; concurrent updates are atomic adds.
    let count = unsafe { &mut *count };
    atomic_add(&mut count.count, samples);
    if ns > 0 {
        atomic_add(&mut count.ns, ns);
    }
}

/// Copies the user registers and the top of the user stack of the current thread
/// to user space, which unwinds them by the modules' unwind tables: the first time
/// user stack `id` (caller path `variant`) is in `map` (a generation, or
/// `STACK_COPY_LOCKS`) since user space cleared it. The frame-pointer walk behind the
/// id skips the caller of a library built without frame pointers (Debian's glibc:
/// the function that called `usleep` or `pthread_mutex_lock`); the copy names it.
/// One copy per distinct stack: every other capture pays one array read and a load.
#[inline(always)]
pub fn copy_user_stack(map: u32, id: i32, variant: u32) {
    let Ok(id) = u32::try_from(id) else {
        return;
    };
    if variant != 0 {
        copy_caller_path(StackVariantKey {
            generation: map,
            stack: id as i32,
            variant,
        });
        return;
    }
    // SAFETY: a load-time constant; volatile so that the compiler does not fold it.
    let stride = unsafe { core::ptr::read_volatile(&STACK_COPY_STRIDE) };
    if id >= stride {
        return;
    }
    let Some(slot) = STACK_COPIED.get_ptr_mut(map * stride + id) else {
        return;
    };
    // SAFETY: a live array slot; other CPUs change it by compare-and-swap only. A
    // plain load first: almost every capture finds its stack copied already, and the
    // locked compare-and-swap would cost it a cache line taken exclusive.
    if unsafe { core::ptr::read_volatile(slot) } != 0
        || !compare_and_swap(unsafe { &mut *slot }, 0, 1)
    {
        return;
    }
    // SAFETY: no preconditions; a typed pointer to the current task.
    let task = unsafe { bpf_get_current_task_btf() };
    let Some(regs) = SavedRegisters::of(task.cast_const().cast()) else {
        return;
    };
    if !send_copy(map, id as i32, 0, regs) {
        // SAFETY: as above; the next block with this stack tries again.
        compare_and_swap(unsafe { &mut *slot }, 1, 0);
    }
}

/// Copies the current user stack for caller path `key`, the first time it is seen
/// in its generation.
#[inline(always)]
fn copy_caller_path(key: StackVariantKey) {
    if STACK_VARIANTS.get_ptr(key).is_some() {
        return;
    }
    if let Err(error) = STACK_VARIANTS.insert(key, 1, u64::from(BPF_NOEXIST)) {
        // Another CPU copies it (EEXIST), or the map is full (counted).
        if error != -EEXIST {
            count_loss(LossSource::StackVariants, LossErrno::of(error.into()));
        }
        return;
    }
    // SAFETY: no preconditions; a typed pointer to the current task.
    let task = unsafe { bpf_get_current_task_btf() };
    let sent = SavedRegisters::of(task.cast_const().cast())
        .is_some_and(|regs| send_copy(key.generation, key.stack, key.variant, regs));
    if !sent {
        // The next capture of this path tries again.
        let _ = STACK_VARIANTS.remove(key);
    }
}

/// Sends the registers `regs` and the top of the current user stack as the copy of
/// stack `id` (caller path `variant`) of `map`; false if the ring buffer was full
/// (counted).
#[inline(always)]
fn send_copy(map: u32, id: i32, variant: u32, regs: SavedRegisters) -> bool {
    let Some(mut entry) = STACK_COPIES.reserve::<StackCopy>(0) else {
        count_loss(LossSource::StackCopies, LossErrno::None);
        return false;
    };
    let copy = entry.as_mut_ptr();
    let sp = regs.sp();
    // SAFETY: `copy` is the reserved record, written before it is submitted; the
    // helper checks the user reads (a fault leaves `len` at what was read: nothing).
    unsafe {
        (*copy).map = map;
        (*copy).stack = id;
        (*copy).variant = variant;
        (*copy)._pad = 0;
        (*copy).tgid = (aya_ebpf::helpers::bpf_get_current_pid_tgid() >> 32) as u32;
        (*copy).ip = regs.ip();
        (*copy).sp = sp;
        (*copy).bp = regs.fp();
        let bytes = &mut (*copy).bytes;
        (*copy).len = if bpf_probe_read_user_buf(sp as *const u8, bytes).is_ok() {
            STACK_COPY_BYTES as u32
        } else if bpf_probe_read_user_buf(sp as *const u8, &mut bytes[..STACK_COPY_SHORT_BYTES])
            .is_ok()
        {
            STACK_COPY_SHORT_BYTES as u32
        } else {
            0
        };
    }
    entry.submit(BPF_RB_NO_WAKEUP);
    true
}
