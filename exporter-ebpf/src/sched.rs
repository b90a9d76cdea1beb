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
use aya_ebpf::{macros::btf_tracepoint, programs::BtfTracePointContext};
use poolscope_shared::{Activity, Peer, Serving, WaitClass};

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

/// `prev_state` bit of a task in uninterruptible sleep (include/linux/sched.h).
const TASK_UNINTERRUPTIBLE: u32 = 0x2;
/// The state bits that say how a task sleeps; the rest are modifiers.
const TASK_STATE_MASK: u32 = 0xff;

/// The tid of `task`, a `task_struct` pointer argument of a `tp_btf` program (here and
/// in `process.rs`).
#[inline(always)]
pub(crate) fn task_tid(task: *const u8) -> u32 {
    // SAFETY: a load-time constant (read-only data, so the verifier knows its value);
    // volatile so that the compiler does not fold it.
    let offset = unsafe { core::ptr::read_volatile(&TASK_PID_OFFSET) };
    // SAFETY: `task` is a typed pointer the kernel passed to this event; the verifier
    // checks that the load is of the `pid` field (by its offset and size), and the
    // kernel handles a fault in it.
    let pid = unsafe { core::ptr::read_volatile(task.add(offset as usize).cast::<i32>()) };
    pid as u32
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
    switched_in(task_tid(next), now);
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
        Some((regs, WaitClass::Poll, _)) if serving == Serving::OneAtATime => regs.second_arg(),
        _ => 0,
    }
}

/// sched_wakeup(struct task_struct *p)
#[btf_tracepoint(function = "sched_wakeup")]
pub fn sched_wakeup(ctx: BtfTracePointContext) -> i32 {
    let task: *const u8 = ctx.arg(0);
    woken(task_tid(task));
    0
}

/// `tid` goes on CPU at `now` (0: not read yet): a run-queue wait ends.
#[inline(always)]
fn switched_in(tid: u32, now: u64) {
    let Some(thread) = threads::thread(tid) else {
        return;
    };
    // Already running: the switch that put it off CPU was not seen (its entry was
    // made meanwhile).
    if Activity::from_u32(thread.activity) == Activity::Running {
        return;
    }
    let now = if now == 0 { now_ns() } else { now };
    // From a wait whose wakeup we did not see (entry made while it slept), the
    // interval closes as that wait and no run-queue wait is timed.
    stacks::unblocked(tid, thread, now);
    threads::change(tid, thread, Activity::Running, now);
    locks::switched_in(thread, now);
}

/// `tid` was woken: it waits for a CPU from now.
#[inline(always)]
fn woken(tid: u32) {
    let Some(thread) = threads::thread(tid) else {
        return;
    };
    // A wakeup of a thread on CPU or already queued (it was woken before it slept,
    // or preempted) changes nothing.
    if Activity::from_u32(thread.activity).is_off_cpu() {
        let now = now_ns();
        stacks::unblocked(tid, thread, now);
        threads::change(tid, thread, Activity::Runnable, now);
    }
}
