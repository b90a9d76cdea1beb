//! Scheduler events (`sched_switch`, `sched_wakeup`): the on-CPU, run-queue and
//! off-CPU intervals of watched threads, with what each waits for.
//!
//! BTF-typed raw tracepoints (`tp_btf`) because these run on every context switch
//! of the host: no record is built, and the tasks' tids are loaded straight from
//! their `task_struct`s (typed pointers, no probe-read helper), at the offset user
//! space found in the kernel's BTF. A thread we do not watch then costs one read of
//! its slot's owner word in the thread array (`threads::thread`). What a blocking
//! thread waits for comes from the syscall it is in (its saved registers: the
//! number, and a poll's fd count) and from what it holds (one request, several,
//! none); a futex wait while serving is also a lock wait (`locks.rs`).
//!
//! When a woken thread's run-queue wait began is read from the kernel's own
//! accounting when it goes on CPU (`sched_info`, see [`woken_at`]), so that
//! `sched_wakeup` is not attached and no clock is read at wakeups (a clock read is
//! most of what a wakeup program costs: ~75 ns of ~100 on our test VM); on a kernel
//! whose BTF lacks those fields, `sched_wakeup` stamps each wait's start instead.
use aya_ebpf::{macros::btf_tracepoint, programs::BtfTracePointContext};
use poolscope_shared::{Activity, BLOCK_UNSEEN, Peer, Serving, Thread, WaitClass};

use crate::{
    abi::SavedRegisters,
    clock::now_ns,
    downstream, locks,
    maps::WAIT_CLASSES,
    stacks,
    threads::{self, thread},
};

/// Offset of `pid` (the tid) in `struct task_struct`, from /sys/kernel/btf/vmlinux.
#[unsafe(no_mangle)]
static TASK_PID_OFFSET: u32 = 0;

/// Where the kernel keeps a task's run-queue waits (`task_struct.sched_info`: their
/// total `run_delay`, and `last_queued`, when the wait in progress began, 0 if none;
/// CONFIG_SCHED_INFO) and its run queue's clock (`task_struct.se.cfs_rq`, `cfs_rq.rq`,
/// `rq.clock`; CONFIG_FAIR_GROUP_SCHED), from the kernel's BTF; all 0 where it lacks
/// any, and `sched_wakeup` then times the waits.
#[unsafe(no_mangle)]
static TASK_RUN_DELAY_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TASK_LAST_QUEUED_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TASK_CFS_RQ_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static CFS_RQ_RQ_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static RQ_CLOCK_OFFSET: u32 = 0;

/// `prev_state` bit of a task in uninterruptible sleep (include/linux/sched.h).
const TASK_UNINTERRUPTIBLE: u32 = 0x2;
/// The state bits that say how a task sleeps; the rest are modifiers.
const TASK_STATE_MASK: u32 = 0xff;

/// The field of kernel struct `base` at `offset` (one of the offset globals).
#[inline(always)]
fn field<T: Copy>(base: *const u8, offset: &u32) -> T {
    // SAFETY: a load-time constant (read-only data, so the verifier knows its value);
    // volatile so that the compiler does not fold it.
    let offset = unsafe { core::ptr::read_volatile(offset) };
    // SAFETY: `base` is a typed pointer the kernel passed to this event, or one loaded
    // through such a pointer; the verifier checks that the load is of the field (by
    // its offset and size), and the kernel handles a fault in it.
    unsafe { core::ptr::read_volatile(base.add(offset as usize).cast::<T>()) }
}

/// The tid of `task`, a `task_struct` pointer argument of a `tp_btf` program (here and
/// in `process.rs`).
#[inline(always)]
pub(crate) fn task_tid(task: *const u8) -> u32 {
    field::<i32>(task, &TASK_PID_OFFSET) as u32
}

/// Whether run-queue waits are read from the kernel's `sched_info` (else timed by
/// `sched_wakeup`).
#[inline(always)]
fn run_delay_known() -> bool {
    // SAFETY: a load-time constant, as in `field`.
    unsafe { core::ptr::read_volatile(&TASK_RUN_DELAY_OFFSET) != 0 }
}

/// When `task`, going on CPU at `now`, was woken by our clock, from the kernel's
/// accounting. The kernel stamps a wait's start by its run queue's clock
/// (`last_queued`, 0 once the wait is added to `run_delay`: when the task arrives on
/// CPU, after this tracepoint, or moves to another CPU's queue, whose wait then
/// starts anew), so the wakeup is the start of the wait in progress less the waits
/// added since the block. The queue's clock is turned into ours by the offset between
/// the two kept at the block, when the scheduler had just read its clock: not by the
/// queue's clock now, which the scheduler does not read again at a switch that a
/// wakeup asked for (the wakeup read it). Not before the interval the thread is in
/// began (a request's end cuts it), nor after `now`.
#[inline(always)]
fn woken_at(task: *const u8, thread: &Thread, now: u64) -> u64 {
    let last_queued: u64 = field(task, &TASK_LAST_QUEUED_OFFSET);
    // The wait in progress began at `last_queued`; none is (0): it ends now.
    let wait_start = if last_queued == 0 {
        queue_clock(task)
    } else {
        last_queued
    };
    let at = if thread.clock_offset_at_block == BLOCK_UNSEEN {
        // Without the block's offset, the wait in progress by the queue's clock.
        now.saturating_sub(queue_clock(task).saturating_sub(wait_start))
    } else {
        let run_delay: u64 = field(task, &TASK_RUN_DELAY_OFFSET);
        wait_start
            .wrapping_sub(run_delay)
            .wrapping_sub(thread.clock_offset_at_block)
    };
    at.min(now).max(thread.since_ns)
}

/// The clock of `task`'s run queue (`rq_clock`), 0 if it cannot be reached.
#[inline(always)]
fn queue_clock(task: *const u8) -> u64 {
    let cfs_rq: *const u8 = field(task, &TASK_CFS_RQ_OFFSET);
    if cfs_rq.is_null() {
        return 0;
    }
    let rq: *const u8 = field(cfs_rq, &CFS_RQ_RQ_OFFSET);
    if rq.is_null() {
        return 0;
    }
    field(rq, &RQ_CLOCK_OFFSET)
}

/// sched_switch(bool preempt, struct task_struct *prev, struct task_struct *next,
/// unsigned int prev_state); runs on the CPU, in the context of `prev`.
#[btf_tracepoint(function = "sched_switch")]
pub fn sched_switch(ctx: BtfTracePointContext) -> i32 {
    try_sched_switch(&ctx);
    0
}

fn try_sched_switch(ctx: &BtfTracePointContext) {
    // The clock is read only for watched threads (most switches are not theirs),
    // once per switch.
    let mut now = 0;
    let prev_task: *const u8 = ctx.arg(1);
    let prev_tid = task_tid(prev_task);
    if let Some(prev) = thread(prev_tid) {
        let preempt: u64 = ctx.arg(0);
        let prev_state: u64 = ctx.arg(3);
        let state = prev_state as u32 & TASK_STATE_MASK;
        now = now_ns();
        let mut lock_wait = None;
        let preempted = preempt & 1 != 0 || state == 0;
        if preempted {
            threads::change(prev_tid, prev, Activity::Runnable, now);
        } else {
            let call = current_syscall(prev_task);
            let class = call.map_or(WaitClass::Other, |(_, class, _)| class);
            let serving = threads::serving(prev);
            let polled = polled_fds(call, serving);
            let next = Activity::blocked(class, serving, polled, state & TASK_UNINTERRUPTIBLE != 0);
            threads::change(prev_tid, prev, next, now);
            if run_delay_known() {
                let run_delay: u64 = field(prev_task, &TASK_RUN_DELAY_OFFSET);
                prev.clock_offset_at_block = match queue_clock(prev_task) {
                    0 => BLOCK_UNSEEN,
                    clock => clock.wrapping_sub(run_delay).wrapping_sub(now),
                };
            }
            prev.downstream = match call {
                Some((regs, _, _)) if next == Activity::OffNetwork => {
                    downstream::peer_of_wait(regs, class, polled)
                }
                _ => Peer::NONE,
            };
            stacks::blocked(ctx, prev, now);
            if next == Activity::OffLock {
                lock_wait = call.map(|(regs, _, number)| (regs, number));
            }
        }
        locks::switched_out(ctx, prev_tid, prev, lock_wait, preempted, now);
    }
    let next: *const u8 = ctx.arg(2);
    switched_in(next, now);
}

/// The syscall `task` (the current one) is in: its saved user registers, what it
/// waits for, and its number. `None` if it has no saved registers.
#[inline(always)]
fn current_syscall(task: *const u8) -> Option<(SavedRegisters, WaitClass, u64)> {
    let regs = SavedRegisters::of(task)?;
    let number = regs.number();
    // Outside a syscall (a fault) the number is -1 or an error code; the table's
    // default for those is Other.
    let class = match WAIT_CLASSES.get(number as u32) {
        Some(class) => WaitClass::from_u32(*class),
        None => WaitClass::Other,
    };
    Some((regs, class, number))
}

/// The fd count of a `poll` that the rule of [`Activity::blocked`] needs: read only
/// for a thread that serves one request at a time (0 otherwise).
#[inline(always)]
fn polled_fds(call: Option<(SavedRegisters, WaitClass, u64)>, serving: Serving) -> u64 {
    match call {
        Some((regs, WaitClass::Poll, _))
            if matches!(serving, Serving::OneAtATime | Serving::Streams) =>
        {
            regs.second_arg()
        }
        _ => 0,
    }
}

/// sched_wakeup(struct task_struct *p)
#[btf_tracepoint(function = "sched_wakeup")]
pub fn sched_wakeup(ctx: BtfTracePointContext) -> i32 {
    let task: *const u8 = ctx.arg(0);
    let tid = task_tid(task);
    // A wakeup of a thread on CPU or already queued (it was woken before it slept,
    // or preempted) changes nothing.
    if let Some(thread) = threads::thread(tid)
        && Activity::from_u32(thread.activity).is_off_cpu()
    {
        woken(tid, thread, now_ns());
    }
    0
}

/// `task` goes on CPU at `now` (0: not read yet): a run-queue wait ends.
#[inline(always)]
fn switched_in(task: *const u8, now: u64) {
    let tid = task_tid(task);
    let Some(thread) = threads::thread(tid) else {
        return;
    };
    let activity = Activity::from_u32(thread.activity);
    // Already running: the switch that put it off CPU was not seen (its entry was
    // made meanwhile).
    if activity == Activity::Running {
        return;
    }
    let now = if now == 0 { now_ns() } else { now };
    if activity.is_off_cpu() && run_delay_known() {
        woken(tid, thread, woken_at(task, thread, now));
    }
    // From a wait whose wakeup we did not see (entry made while it slept, without
    // `sched_info`), the interval closes as that wait and no run-queue wait is timed.
    stacks::unblocked(tid, thread, now);
    threads::change(tid, thread, Activity::Running, now);
    locks::switched_in(thread, now);
}

/// `thread` (`tid`), off CPU, was woken at `at`: it waits for a CPU from then.
#[inline(always)]
fn woken(tid: u32, thread: &mut Thread, at: u64) {
    stacks::unblocked(tid, thread, at);
    threads::change(tid, thread, Activity::Runnable, at);
}
