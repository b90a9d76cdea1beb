//! Stack samples (DESIGN §1, stacks): on-CPU samples from a perf event on every
//! CPU's cpu-clock, and off-CPU blocks, the stacks at which a watched thread blocks
//! weighted by how long it stays blocked. Both count into `STACK_COUNTS` per (user
//! stack, kernel stack, process, pool, activity); user space drains and symbolizes.
//!
//! Stacks go to one of three stack maps, picked by the epoch user space advances: a
//! sample goes to the current one; a block goes, when it ends, to the one its stacks
//! were captured in, if that is at most one epoch old. User space drains and clears
//! the generation two epochs back, to which nothing can be added any more.
//!
//! An off-CPU stack must be captured when the thread blocks, in its own context
//! (`sched_switch`): the helpers cannot walk another task's user stack at wakeup.
//! So a captured block costs its capture whatever its length (the minimum duration
//! filters at the wakeup), and a CPU past its full rate of captures per second
//! captures one block in the sampling ratio, at random, weighted by that ratio
//! (`OffcpuCaptures`).
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_get_prandom_u32},
    macros::perf_event,
    programs::{BtfTracePointContext, PerfEventContext},
};
use poolscope_shared::{
    Activity, LossErrno, LossSource, NO_POOL, STACK_GENERATIONS, StackKey, Thread,
};

use crate::{
    maps::{OFFCPU_CAPTURES, count_loss},
    sessions,
    stackmaps::{add, capture, current_epoch},
    threads::{pool, pool_of, thread},
};

/// Shortest block recorded, set at load time; `u64::MAX` turns off-CPU stacks off.
#[unsafe(no_mangle)]
static OFFCPU_MIN_NS: u64 = u64::MAX;

/// 1: also the blocks of threads waiting for work (set at load time). Off by
/// default: an event loop blocks in epoll after every burst, and each capture costs
/// ~2 µs (`cargo xtask bench`), for stacks that only say "waiting for work".
#[unsafe(no_mangle)]
static OFFCPU_IDLE: u32 = 0;

/// Blocks per second per CPU captured in full; beyond, one in
/// `OFFCPU_SAMPLE_MASK + 1` (a power of two) is. Set at load time.
#[unsafe(no_mangle)]
static OFFCPU_FULL_RATE: u64 = u64::MAX;
#[unsafe(no_mangle)]
static OFFCPU_SAMPLE_MASK: u32 = 0;

const SECOND_NS: u64 = 1_000_000_000;

#[inline(always)]
fn offcpu_min_ns() -> u64 {
    // SAFETY: a load-time constant; volatile so that the compiler does not fold it.
    unsafe { core::ptr::read_volatile(&OFFCPU_MIN_NS) }
}

/// The cpu-clock of one CPU ticked (user space opens one event per CPU at the
/// sampling rate): a watched thread on that CPU is sampled.
#[perf_event]
pub fn cpu_sample(ctx: PerfEventContext) -> u32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    if thread(tid).is_none() {
        return 0;
    }
    let generation = current_epoch() % STACK_GENERATIONS;
    let stacks = capture(&ctx, generation);
    let key = StackKey {
        generation,
        activity: Activity::Running as u32,
        tgid: (pid_tgid >> 32) as u32,
        pool: pool_of(tid).unwrap_or(NO_POOL),
        user_stack: stacks.user,
        kernel_stack: stacks.kernel,
        session: 0,
        variant: stacks.variant,
    };
    add(&key, 1, 0);
    0
}

/// The current watched thread blocks at `now` (`sched_switch`, not a preemption;
/// its activity says why): its stacks are kept until it is woken.
#[inline(always)]
pub fn blocked(ctx: &BtfTracePointContext, thread: &mut Thread, now: u64) {
    // SAFETY: a load-time constant, as above.
    let idle = unsafe { core::ptr::read_volatile(&OFFCPU_IDLE) } != 0;
    if offcpu_min_ns() == u64::MAX
        || (!idle && Activity::from_u32(thread.activity) == Activity::OffIdle)
    {
        return;
    }
    let Some(weight) = capture_weight(now) else {
        thread.blocked_since_ns = 0;
        return;
    };
    let epoch = current_epoch();
    let stacks = capture(ctx, epoch % STACK_GENERATIONS);
    thread.offcpu_user_stack = stacks.user;
    thread.offcpu_kernel_stack = stacks.kernel;
    thread.offcpu_variant = stacks.variant;
    thread.offcpu_epoch = epoch;
    thread.offcpu_tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    thread.offcpu_weight = weight;
    thread.blocked_since_ns = now;
}

/// Whether the block beginning at `now` on this CPU is captured, and how many blocks
/// it then stands for: all while the CPU is within its full rate this second, else one
/// in the sampling ratio at random (`None`: left out).
#[inline(always)]
fn capture_weight(now: u64) -> Option<u32> {
    // SAFETY: load-time constants, as above.
    let (full_rate, mask) = unsafe {
        (
            core::ptr::read_volatile(&OFFCPU_FULL_RATE),
            core::ptr::read_volatile(&OFFCPU_SAMPLE_MASK),
        )
    };
    // SAFETY: this CPU's slot; the scheduler's programs do not nest on a CPU.
    let Some(captures) = OFFCPU_CAPTURES.get_ptr_mut(0).map(|c| unsafe { &mut *c }) else {
        return Some(1);
    };
    if now.wrapping_sub(captures.window_start_ns) >= SECOND_NS {
        captures.window_start_ns = now;
        captures.window_captures = 0;
    }
    if mask == 0 || captures.window_captures < full_rate {
        captures.window_captures += 1;
        captures.full += 1;
        return Some(1);
    }
    // SAFETY: helper without preconditions.
    if unsafe { bpf_get_prandom_u32() } & mask == 0 {
        captures.sampled += 1;
        Some(mask + 1)
    } else {
        captures.skipped += 1;
        None
    }
}

/// `thread` (`tid`) stops being blocked at `now` (woken, or back on CPU without a
/// wakeup seen): a block at least the minimum long is recorded, with the reason it
/// was blocked for.
#[inline(always)]
pub fn unblocked(tid: u32, thread: &mut Thread, now: u64) {
    let activity = Activity::from_u32(thread.activity);
    if !activity.is_off_cpu() || thread.blocked_since_ns == 0 {
        return;
    }
    let blocked_ns = now.saturating_sub(thread.blocked_since_ns);
    thread.blocked_since_ns = 0;
    if blocked_ns < offcpu_min_ns() {
        return;
    }
    let epoch = current_epoch();
    let captured = thread.offcpu_user_stack >= 0 || thread.offcpu_kernel_stack >= 0;
    let (generation, user_stack, kernel_stack, variant) =
        if epoch.wrapping_sub(thread.offcpu_epoch) <= 1 {
            (
                thread.offcpu_epoch % STACK_GENERATIONS,
                thread.offcpu_user_stack,
                thread.offcpu_kernel_stack,
                thread.offcpu_variant,
            )
        } else {
            if captured {
                count_loss(LossSource::OffCpuStacksExpired, LossErrno::None);
            }
            (epoch % STACK_GENERATIONS, -1, -1, 0)
        };
    let key = StackKey {
        generation,
        activity: activity as u32,
        tgid: thread.offcpu_tgid,
        pool: pool(tid, thread).unwrap_or(NO_POOL),
        user_stack,
        kernel_stack,
        session: 0,
        variant,
    };
    let weight = u64::from(thread.offcpu_weight.max(1));
    add(&key, weight, blocked_ns * weight);
    sessions::block_ended(thread.service, key, blocked_ns, weight, now);
}
