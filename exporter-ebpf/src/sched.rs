//! Scheduler events (raw tracepoints `sched_switch`, `sched_wakeup`): the on-CPU,
//! run-queue and off-CPU intervals of watched threads, with what each waits for.
//!
//! Raw tracepoints because these run on every context switch of the host: no record
//! is built, and a thread we do not watch costs a failed lookup in `THREADS` (two per
//! switch, one per wakeup). A task's tid is read from its `task_struct` at the offset
//! user space found in the kernel's BTF. What a blocking thread waits for comes from
//! the syscall it is in (its saved registers: the number, and a poll's fd count) and
//! from what it holds (one request, several, none); a futex wait while serving is
//! also a lock wait (`locks.rs`).
use aya_ebpf::{
    helpers::{
        bpf_get_current_pid_tgid, bpf_get_current_task_btf, bpf_probe_read_kernel, bpf_task_pt_regs,
    },
    macros::raw_tracepoint,
    programs::RawTracePointContext,
};
use poolscope_shared::{Activity, Peer, Serving, WaitClass};

use crate::{
    abi::{NUMBER_OFFSET, SECOND_ARG_OFFSET},
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

#[inline(always)]
fn task_tid(task: *const u8) -> Result<u32, i64> {
    // SAFETY: a load-time constant; volatile so that the compiler does not fold it.
    let offset = unsafe { core::ptr::read_volatile(&TASK_PID_OFFSET) };
    // SAFETY: `task` is the kernel's task_struct of this event; the helper checks the read.
    let pid: i32 = unsafe { bpf_probe_read_kernel(task.add(offset as usize).cast::<i32>())? };
    Ok(pid as u32)
}

/// sched_switch(bool preempt, struct task_struct *prev, struct task_struct *next,
/// unsigned int prev_state); runs on the CPU, in the context of `prev`.
#[raw_tracepoint(tracepoint = "sched_switch")]
pub fn sched_switch(ctx: RawTracePointContext) -> i32 {
    match try_sched_switch(&ctx) {
        Ok(()) | Err(_) => 0,
    }
}

fn try_sched_switch(ctx: &RawTracePointContext) -> Result<(), i64> {
    // The clock is read only for watched threads (most switches are not theirs),
    // once per switch.
    let mut now = 0;
    let prev_tid = bpf_get_current_pid_tgid() as u32;
    if let Some(prev) = thread(prev_tid) {
        let preempt: u64 = ctx.arg(0);
        let prev_state: u64 = ctx.arg(3);
        let state = prev_state as u32 & TASK_STATE_MASK;
        now = now_ns();
        let mut lock_wait = None;
        if preempt & 1 != 0 || state == 0 {
            threads::change(prev_tid, prev, Activity::Runnable, now);
        } else {
            let call = current_syscall();
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
        locks::switched_out(ctx, prev_tid, prev, lock_wait, now);
    }
    let next: *const u8 = ctx.arg(2);
    switched_in(task_tid(next)?, now);
    Ok(())
}

/// The syscall the current thread is in: its saved user registers, what it waits
/// for, and its number. `None` if the registers cannot be read.
#[inline(always)]
fn current_syscall() -> Option<(*const u8, WaitClass, u64)> {
    // SAFETY: the current task is valid while its program runs; the helper returns
    // its saved user registers (0 if none).
    let regs = unsafe { bpf_task_pt_regs(bpf_get_current_task_btf()) } as *const u8;
    if regs.is_null() {
        return None;
    }
    // SAFETY: the helper checks the read.
    let number = unsafe { bpf_probe_read_kernel(regs.add(NUMBER_OFFSET).cast::<u64>()) }.ok()?;
    // Outside a syscall (a fault) the number is -1 or an error code; the table's
    // default for those is Other.
    let class = match WAIT_CLASSES.get(number as u32) {
        Some(class) => WaitClass::from_u32(*class),
        None => WaitClass::Other,
    };
    Some((regs, class, number))
}

/// The fd count of a `poll` that the rule of [`Activity::blocked`] needs: read only
/// for a thread that serves one request at a time (0 otherwise, and 0 if the
/// register cannot be read, which classifies the poll as a worker's).
#[inline(always)]
fn polled_fds(call: Option<(*const u8, WaitClass, u64)>, serving: Serving) -> u64 {
    match call {
        Some((regs, WaitClass::Poll, _)) if serving == Serving::OneAtATime => {
            // SAFETY: the helper checks the read.
            unsafe { bpf_probe_read_kernel(regs.add(SECOND_ARG_OFFSET).cast::<u64>()) }.unwrap_or(0)
        }
        _ => 0,
    }
}

/// sched_wakeup(struct task_struct *p)
#[raw_tracepoint(tracepoint = "sched_wakeup")]
pub fn sched_wakeup(ctx: RawTracePointContext) -> i32 {
    let task: *const u8 = ctx.arg(0);
    if let Ok(tid) = task_tid(task) {
        woken(tid);
    }
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
