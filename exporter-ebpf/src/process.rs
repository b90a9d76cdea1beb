//! Process and thread lifecycle (`task:task_newtask`, `task:task_rename`,
//! `sched:sched_process_exec`, `sched:sched_process_exit`): children of a watched
//! process are watched from their first instruction, and so are its new threads (in
//! their creator's pool until user space reads their name); an exited process leaves
//! `WATCHED` at once, so a reused pid never inherits its numbers, and an exited thread
//! leaves `THREADS` with its last interval accounted. User space hears of each change
//! through a ring buffer.
//!
//! Forks come from `task_newtask` rather than `sched_process_fork` because only the
//! former carries the clone flags that tell a new process from a new thread.
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::tracepoint,
    programs::TracePointContext,
};
use poolscope_shared::{
    Activity, LossErrno, LossSource, ProcessEvent, ProcessEventKind, Thread, Watched,
    maps::CountedMap,
};

use crate::{
    clock::now_ns,
    locks,
    maps::{
        MUTEX_CALLS, PENDING_CALLS, THREAD_POOLS, WATCHED, Wakeup, count_loss, remove_counted,
        send_process_event, watched,
    },
    threads::{self, thread},
};

/// Offsets from /sys/kernel/tracing/events/{task,sched}/*/format.
const NEWTASK_PID: usize = 8;
const NEWTASK_CLONE_FLAGS: usize = 32;
const RENAME_PID: usize = 8;
const EXEC_PID: usize = 12;

/// Offset of `group_dead` in sched_process_exit's record, which newer kernels have
/// (6.18 here) and older ones lack; user space reads it from the tracepoint's format
/// at load time. 0 when absent: the group leader's exit then stands for the process's.
#[unsafe(no_mangle)]
static EXIT_GROUP_DEAD_OFFSET: u32 = 0;

const CLONE_THREAD: u64 = 0x0001_0000;

#[tracepoint]
pub fn process_fork(ctx: TracePointContext) -> u32 {
    match try_process_fork(&ctx) {
        Ok(()) | Err(_) => 0,
    }
}

fn try_process_fork(ctx: &TracePointContext) -> Result<(), i32> {
    // task_newtask runs in the creator.
    let creator = bpf_get_current_pid_tgid();
    let parent = (creator >> 32) as u32;
    let Some(parent_watch) = watched(parent) else {
        return Ok(());
    };
    // SAFETY: offsets match the tracepoint's format.
    let child: u32 = unsafe { ctx.read_at(NEWTASK_PID)? };
    // SAFETY: as above.
    let clone_flags: u64 = unsafe { ctx.read_at(NEWTASK_CLONE_FLAGS)? };
    follow_thread(child, creator as u32, parent_watch.service);
    if clone_flags & CLONE_THREAD != 0 {
        return Ok(());
    }
    // SAFETY: helper without preconditions.
    let since_ns = unsafe { bpf_ktime_get_ns() };
    let child_watch = Watched {
        service: parent_watch.service,
        _pad: 0,
        since_ns,
    };
    if let Err(code) = WATCHED.insert(child, child_watch, 0) {
        count_loss(LossSource::WatchedInsert, LossErrno::of(code.into()));
        return Ok(());
    }
    send_process_event(
        ProcessEvent {
            kind: ProcessEventKind::Fork as u32,
            pid: child,
            parent,
            service: parent_watch.service,
            since_ns,
        },
        Wakeup::Now,
    );
    Ok(())
}

/// A new thread (or a new process's first) of a watched process: runnable from now,
/// in its creator's pool.
#[inline(always)]
fn follow_thread(tid: u32, creator_tid: u32, service: u32) {
    let thread = Thread::new(service, Activity::Runnable, now_ns());
    if let Err(code) = threads::follow(tid, &thread) {
        count_loss(LossSource::ThreadsInsert, LossErrno::of(code.into()));
        return;
    }
    if let Some(pool) = threads::pool_of(creator_tid)
        && let Err(code) = THREAD_POOLS.insert(tid, pool, 0)
    {
        count_loss(LossSource::ThreadsInsert, LossErrno::of(code.into()));
    }
}

#[tracepoint]
pub fn process_rename(ctx: TracePointContext) -> u32 {
    match try_process_rename(&ctx) {
        Ok(()) | Err(_) => 0,
    }
}

fn try_process_rename(ctx: &TracePointContext) -> Result<(), i32> {
    // SAFETY: offset matches the tracepoint's format.
    let tid: u32 = unsafe { ctx.read_at(RENAME_PID)? };
    let Some(thread) = thread(tid) else {
        return Ok(());
    };
    send_process_event(
        ProcessEvent {
            kind: ProcessEventKind::ThreadRenamed as u32,
            pid: tid,
            parent: 0,
            service: thread.service,
            since_ns: 0,
        },
        Wakeup::Now,
    );
    Ok(())
}

#[tracepoint]
pub fn process_exec(ctx: TracePointContext) -> u32 {
    match try_process_exec(&ctx) {
        Ok(()) | Err(_) => 0,
    }
}

fn try_process_exec(ctx: &TracePointContext) -> Result<(), i32> {
    // SAFETY: offset matches the tracepoint's format.
    let pid: u32 = unsafe { ctx.read_at(EXEC_PID)? };
    // Any process: an exec can make it match a `comm` or `exe` rule.
    send_process_event(
        ProcessEvent {
            kind: ProcessEventKind::Exec as u32,
            pid,
            parent: 0,
            service: u32::MAX,
            since_ns: 0,
        },
        Wakeup::Lazy,
    );
    Ok(())
}

#[tracepoint]
pub fn process_exit(ctx: TracePointContext) -> u32 {
    match try_process_exit(&ctx) {
        Ok(()) | Err(_) => 0,
    }
}

fn try_process_exit(ctx: &TracePointContext) -> Result<(), i32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    let tgid = (pid_tgid >> 32) as u32;
    // A thread killed inside a syscall or pthread_mutex_lock leaves its entry
    // behind otherwise (a futex wait in progress lives in its THREADS entry). Before
    // the checks below: before 6.16 (no group_dead) the main thread's exit ends
    // the watch while the others, killed with it, are still exiting, and user space,
    // told of the exit, may already have dropped their THREADS entries; the checks
    // below would then skip them and leave these entries for good (seen on 6.1 and
    // 6.12 under emulation). Looked up first: for any other thread's exit two
    // lock-free misses, where a delete would take each bucket's lock (measured: 460
    // ns per exit before this change, 930 with two deletes).
    if PENDING_CALLS.get_ptr(tid).is_some() {
        remove_counted(&PENDING_CALLS, CountedMap::PendingCalls, &tid);
    }
    if MUTEX_CALLS.get_ptr(tid).is_some() {
        remove_counted(&MUTEX_CALLS, CountedMap::MutexCalls, &tid);
    }
    let followed = thread(tid);
    // A followed thread of a process no longer watched: before 6.16 the main
    // thread's exit ends the watch while the others are still exiting; their entries
    // must go too. WATCHED is looked up only if THREADS has no entry, and again
    // below: holding both lookups' pointers let the compiler OR them to test both at
    // once, which the verifier refuses ("pointer |= pointer prohibited").
    if followed.is_none() && watched(tgid).is_none() {
        return Ok(());
    }
    if let Some(thread) = followed {
        // It runs its exit: its last interval is on CPU.
        threads::change(tid, thread, Activity::Running, now_ns());
        locks::thread_exits(tid, thread);
        threads::unfollow(tid);
    }
    let _ = THREAD_POOLS.remove(tid);
    // SAFETY: a load-time constant; volatile so that the compiler does not fold it.
    let group_dead_offset = unsafe { core::ptr::read_volatile(&EXIT_GROUP_DEAD_OFFSET) };
    let process_gone = if group_dead_offset == 0 {
        tid == tgid
    } else {
        // SAFETY: the offset comes from this kernel's format of this tracepoint.
        unsafe { ctx.read_at::<u8>(group_dead_offset as usize)? != 0 }
    };
    if !process_gone {
        return Ok(());
    }
    let Some(watch) = watched(tgid) else {
        return Ok(());
    };
    let _ = WATCHED.remove(tgid);
    send_process_event(
        ProcessEvent {
            kind: ProcessEventKind::Exit as u32,
            pid: tgid,
            parent: 0,
            service: watch.service,
            since_ns: watch.since_ns,
        },
        Wakeup::Now,
    );
    Ok(())
}
