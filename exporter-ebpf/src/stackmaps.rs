//! The stack maps of the three rotating generations (see `stacks.rs`): capturing the
//! current stacks into one, and counting a sample or block under its key. Shared by
//! the always-on stack counts and the on-demand profiling sessions.
use aya_ebpf::{maps::StackTrace, programs::tracing::StackIdContext};
use poolscope_shared::{LossErrno, LossSource, StackCount, StackKey, maps::CountedMap};

use crate::maps::{
    EEXIST, STACK_COUNTS, STACK_EPOCH, STACKS_0, STACKS_1, STACKS_2, atomic_add, count_loss,
    get_or_insert,
};

/// bpf_get_stackid flag: the user stack.
const BPF_F_USER_STACK: u64 = 1 << 8;

#[inline(always)]
pub fn current_epoch() -> u32 {
    STACK_EPOCH.get(0).copied().unwrap_or(0)
}

/// The id of the current user or kernel stack in `map`; -1 if not captured (no
/// such stack, or its bucket is taken, which is counted).
#[inline(always)]
fn stack_id<C: StackIdContext>(ctx: &C, map: &StackTrace, flags: u64) -> i32 {
    match ctx.get_stackid(map, flags) {
        Ok(id) => id as i32,
        Err(error) => {
            if error == -EEXIST {
                count_loss(LossSource::StackCollision, LossErrno::Eexist);
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
    (stack_id(ctx, map, BPF_F_USER_STACK), stack_id(ctx, map, 0))
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
