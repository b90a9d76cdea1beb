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
//!
//! BTF-typed raw tracepoints (`tp_btf`), as in `sched.rs`: the tasks' tids are loaded
//! from their `task_struct`s, and nothing is read from tracefs (its event formats
//! and ids are under a directory only root may search).
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::btf_tracepoint,
    programs::BtfTracePointContext,
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
    sched::task_tid,
    threads::{self, thread},
};

/// 1 where sched_process_exit passes `bool group_dead` (6.16 and later), which user
/// space finds in the kernel's BTF; 0 where it does not: the group leader's exit
/// then stands for the process's.
#[unsafe(no_mangle)]
static EXIT_HAS_GROUP_DEAD: u32 = 0;

const CLONE_THREAD: u64 = 0x0001_0000;

/// task_newtask(struct task_struct *task, u64 clone_flags)
#[btf_tracepoint(function = "task_newtask")]
pub fn process_fork(ctx: BtfTracePointContext) -> i32 {
    try_process_fork(&ctx);
    0
}

fn try_process_fork(ctx: &BtfTracePointContext) {
    // task_newtask runs in the creator.
    let creator = bpf_get_current_pid_tgid();
    let parent = (creator >> 32) as u32;
    let Some(parent_watch) = watched(parent) else {
        return;
    };
    let child = task_tid(ctx.arg(0));
    let clone_flags: u64 = ctx.arg(1);
    follow_thread(child, creator as u32, parent_watch.service);
    if clone_flags & CLONE_THREAD != 0 {
        return;
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
        return;
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

/// task_rename(struct task_struct *task, const char *comm): `task` need not be the
/// current one (a write to /proc/<pid>/task/<tid>/comm).
#[btf_tracepoint(function = "task_rename")]
pub fn process_rename(ctx: BtfTracePointContext) -> i32 {
    let tid = task_tid(ctx.arg(0));
    let Some(thread) = thread(tid) else {
        return 0;
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
    0
}

/// sched_process_exec(struct task_struct *p, pid_t old_pid, struct linux_binprm *bprm)
#[btf_tracepoint(function = "sched_process_exec")]
pub fn process_exec(ctx: BtfTracePointContext) -> i32 {
    // `p->pid`: after the exec, the process's pid even where another thread called
    // it (it took the leader's place).
    let pid = task_tid(ctx.arg(0));
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
    0
}

/// sched_process_exit(struct task_struct *p[, bool group_dead]); runs in the exiting
/// thread.
#[btf_tracepoint(function = "sched_process_exit")]
pub fn process_exit(ctx: BtfTracePointContext) -> i32 {
    try_process_exit(&ctx);
    0
}

fn try_process_exit(ctx: &BtfTracePointContext) {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    let tgid = (pid_tgid >> 32) as u32;
    // A thread killed inside a syscall or pthread_mutex_lock leaves its entry
    // behind otherwise (a futex wait in progress lives in its thread entry). Before
    // the checks below: before 6.16 (no group_dead) the main thread's exit ends
    // the watch while the others, killed with it, are still exiting, and user space,
    // told of the exit, may already have dropped their thread entries; the checks
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
    // must go too. WATCHED is looked up only if there is no thread entry, and again
    // below: holding both lookups' pointers let the compiler OR them to test both at
    // once, which the verifier refuses ("pointer |= pointer prohibited").
    if followed.is_none() && watched(tgid).is_none() {
        return;
    }
    if let Some(thread) = followed {
        // It runs its exit: its last interval is on CPU.
        threads::change(tid, thread, Activity::Running, now_ns());
        threads::exits(tid, thread);
        locks::thread_exits(tid, thread);
        threads::unfollow(tid);
    }
    let _ = THREAD_POOLS.remove(tid);
    // SAFETY: a load-time constant (read-only data, so the verifier knows its value
    // and never checks the argument read on a kernel without it); volatile so that
    // the compiler does not fold it.
    let has_group_dead = unsafe { core::ptr::read_volatile(&EXIT_HAS_GROUP_DEAD) } != 0;
    let process_gone = if has_group_dead {
        ctx.arg::<u64>(1) as u8 != 0
    } else {
        tid == tgid
    };
    if !process_gone {
        return;
    }
    let Some(watch) = watched(tgid) else {
        return;
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
}
