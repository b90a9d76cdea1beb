//! The stack maps of the three rotating generations (see `stacks.rs`): capturing the
//! current stacks into one, and counting a sample or block under its key. Shared by
//! the always-on stack counts and the on-demand profiling sessions.
use aya_ebpf::{maps::StackTrace, programs::tracing::StackIdContext};
use poolscope_shared::{LossErrno, LossSource, StackCount, StackKey, maps::CountedMap};

use crate::maps::{
    STACK_COUNTS, STACK_EPOCH, STACKS_0, STACKS_1, STACKS_2, atomic_add, count_loss, get_or_insert,
};

/// bpf_get_stackid flag: the user stack.
pub const BPF_F_USER_STACK: u64 = 1 << 8;

/// bpf_get_stackid's error when there is no stack to walk (or it cannot be read).
const EFAULT: i32 = 14;

#[inline(always)]
pub fn current_epoch() -> u32 {
    STACK_EPOCH.get(0).copied().unwrap_or(0)
}

/// The id of the current user stack (`BPF_F_USER_STACK` in `flags`) or kernel stack
/// in `map`; -1 if not captured, counted under `loss` by its errno (its bucket held
/// another stack, no free bucket, or no stack could be walked). A sample taken in
/// user mode has no kernel stack: that is not a loss.
#[inline(always)]
pub fn stack_id<C: StackIdContext>(ctx: &C, map: &StackTrace, flags: u64, loss: LossSource) -> i32 {
    match ctx.get_stackid(map, flags) {
        Ok(id) => id as i32,
        Err(error) => {
            if error != -EFAULT || flags & BPF_F_USER_STACK != 0 {
                count_loss(loss, LossErrno::of(error.into()));
            }
            -1
        }
    }
}

/// The current (user, kernel) stack ids in the stack map of `generation`.
#[inline(always)]
pub fn capture<C: StackIdContext>(ctx: &C, generation: u32) -> (i32, i32) {
    let map = match generation {
        0 => &STACKS_0,
        1 => &STACKS_1,
        _ => &STACKS_2,
    };
    (
        stack_id(ctx, map, BPF_F_USER_STACK, LossSource::StackCapture),
        stack_id(ctx, map, 0, LossSource::StackCapture),
    )
}

/// Adds one sample or block of `ns` to `key`'s count.
#[inline(always)]
pub fn add(key: &StackKey, ns: u64) {
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
    atomic_add(&mut count.count, 1);
    if ns > 0 {
        atomic_add(&mut count.ns, ns);
    }
}
