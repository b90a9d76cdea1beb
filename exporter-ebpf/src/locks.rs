//! Lock waits (DESIGN §3): the futex waits of serving threads, and, opt-in, the time
//! inside `pthread_mutex_lock` (uprobes on libc, attached per process by user space).
//!
//! A futex wait is timed from the context switch that blocks the thread in a waiting
//! futex operation until the thread is back on CPU, the span its own `lock()` call
//! measures minus the syscall's entry and exit; futex waits on one lock in quick
//! succession are one lock wait (one acquisition, see [`REWAIT_NS`]). The scheduler
//! programs see waits begin (`sched.rs` reads the syscall and its arguments from the
//! thread's saved registers) and end (`threads::switched_in`), so no syscall
//! tracepoint is needed: `syscalls:sys_enter_futex` would put every syscall of every
//! process on the tracing slow path. A futex call that does not block (the value
//! changed, or the lock was free again) costs nothing, and neither does an
//! uncontended lock, which never calls futex at all.
//!
//! Requeues (condition variables) keep the wait on the address it began on; PI
//! locks, timeouts and signals end the wait when the thread runs again, like a wake.
//! A wait whose first futex call had a timeout is recorded apart
//! ([`LockPrimitive::FutexTimed`]): sleeps and timed parks of a JVM are futex waits
//! with one, a mutex's wait has none.
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_user},
    macros::{uprobe, uretprobe},
    programs::{BtfTracePointContext, ProbeContext, RetProbeContext},
};
use poolscope_shared::{
    LockKey, LockPrimitive, LossErrno, LossSource, STACK_COPY_LOCKS, Serving, Thread,
    lock_wait_index, maps::CountedMap,
};

use crate::{
    abi::{SYS_FUTEX, SYS_FUTEX_WAIT, SYS_FUTEX_WAITV, SavedRegisters},
    clock::now_ns,
    maps::{
        LOCK_STACKS, LOCK_WAIT_COUNTS, LOCK_WAITS, LOCKS, MUTEX_CALLS, ZERO_HISTOGRAM,
        add_to_shared_histogram, atomic_add, count_loss, get_or_insert, insert_counted,
        remove_counted,
    },
    stackmaps::{BPF_F_USER_STACK, copy_user_stack, stack_id},
    threads::{self, thread},
};

/// futex(2) operations that block (include/uapi/linux/futex.h): WAIT, LOCK_PI,
/// WAIT_BITSET, WAIT_REQUEUE_PI, LOCK_PI2. The rest wake, requeue or try.
const FUTEX_WAITING_OPS: u32 = 1 << 0 | 1 << 6 | 1 << 9 | 1 << 11 | 1 << 13;
/// FUTEX_PRIVATE_FLAG | FUTEX_CLOCK_REALTIME: modifiers, not the operation.
const FUTEX_OP_FLAGS: u32 = 128 | 256;
/// Offset of `uaddr` in `struct futex_waitv` (after the u64 `val`).
const FUTEX_WAITV_UADDR: usize = 8;

/// A waiting futex call a thread blocked in.
#[derive(Clone, Copy)]
struct FutexWait {
    address: u64,
    /// The call has a timeout (a non-null timespec pointer).
    timed: bool,
}

/// What the thread blocked in syscall `number` waits on, if that call is a waiting
/// futex one; `regs` are its saved user registers.
#[inline(always)]
fn futex_wait(regs: SavedRegisters, number: u64) -> Option<FutexWait> {
    let first = regs.first_arg();
    match number {
        // futex(uaddr, op, val, timeout, ...): every waiting op's timeout is the
        // fourth argument.
        SYS_FUTEX => {
            let command = regs.second_arg() as u32 & !FUTEX_OP_FLAGS;
            (command < 32 && FUTEX_WAITING_OPS & (1 << command) != 0).then(|| FutexWait {
                address: first,
                timed: regs.fourth_arg() != 0,
            })
        }
        // futex_wait(uaddr, val, mask, flags, timeout, clockid).
        SYS_FUTEX_WAIT => Some(FutexWait {
            address: first,
            timed: regs.fifth_arg() != 0,
        }),
        // futex_waitv(waiters, nr, flags, timeout, clockid): the first waiter's
        // address stands for the set.
        SYS_FUTEX_WAITV => {
            // SAFETY: a user pointer of the current thread; the helper checks the read.
            let address =
                unsafe { bpf_probe_read_user((first as usize + FUTEX_WAITV_UADDR) as *const u64) }
                    .ok()?;
            Some(FutexWait {
                address,
                timed: regs.fourth_arg() != 0,
            })
        }
        _ => None,
    }
}

/// A futex wait on the same lock that begins this soon after the thread's previous
/// one ended (time on CPU: a preemption in between restarts it) continues the same
/// lock wait: glibc's lock loop re-waits at once when another thread took the mutex
/// between its wakeup and its run, usually within µs, but on a busy CPU past 20 µs
/// (1-2 % of the acquisitions of `tests/tests/locks.rs` split at 20 µs; what
/// stretched them was not traced: interrupts and softirqs run on the thread's
/// time). A request boundary in between (a new request read, a response begun) ends
/// the lock wait whatever the time, so only two lock calls within one request and
/// this close together merge.
const REWAIT_NS: u64 = 200_000;

/// The thread crossed a request boundary (read a new request, began a response): a
/// lock wait pending since its last futex wait is over, and is recorded now.
#[inline(always)]
pub fn request_boundary(tid: u32, thread: &mut Thread) {
    if thread.lock_since_ns == 0 && thread.lock_ended_ns != 0 {
        record_lock_wait(tid, thread);
    }
}

/// The request `thread` (`tid`) served was answered by another thread at `now`: a
/// futex wait it is in was the request's until now (as its time in `threads`), and is
/// recorded as ended.
#[inline(always)]
pub fn handed_off(tid: u32, thread: &mut Thread, now: u64) {
    if thread.lock_since_ns != 0 {
        thread.lock_waited_ns += now.saturating_sub(thread.lock_since_ns);
        thread.lock_since_ns = 0;
        record_lock_wait(tid, thread);
    }
}

/// The current watched thread (`tid`, `thread`) leaves the CPU at `now`. `wait` is
/// (saved registers, syscall number) when it blocks in a futex wait while serving;
/// `preempted` when it leaves runnable. A pending lock wait either continues (the same
/// lock, at once), waits out a preemption (which says nothing of where the lock call
/// stands: between two futex waits of one acquisition, the woken thread may be
/// preempted before it waits again) or is recorded; a new one begins with the user
/// stack it began at.
#[inline(always)]
pub fn switched_out(
    ctx: &BtfTracePointContext,
    tid: u32,
    thread: &mut Thread,
    wait: Option<(SavedRegisters, u64)>,
    preempted: bool,
    now: u64,
) {
    if preempted {
        return;
    }
    let futex = wait.and_then(|(regs, number)| futex_wait(regs, number));
    if thread.lock_ended_ns != 0 {
        if futex.is_some_and(|futex| futex.address == thread.lock_address)
            && now.saturating_sub(thread.lock_ended_ns) <= REWAIT_NS
        {
            thread.lock_since_ns = now;
            thread.lock_ended_ns = 0;
            return;
        }
        record_lock_wait(tid, thread);
    }
    let Some(futex) = futex else {
        return;
    };
    let stack = stack_id(
        ctx,
        &LOCK_STACKS,
        None,
        BPF_F_USER_STACK,
        LossSource::LockStackCapture,
    );
    copy_user_stack(STACK_COPY_LOCKS, stack, 0);
    thread.lock_since_ns = now;
    thread.lock_waited_ns = 0;
    thread.lock_address = futex.address;
    thread.lock_timed = u32::from(futex.timed);
    thread.lock_tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    thread.lock_stack = stack;
}

/// `thread` is back on CPU at `now`: its futex wait, if any, ends; the lock wait is
/// recorded when the thread next blocks without waiting on it again. Back from a
/// preemption between two futex waits, the re-wait window restarts: the run-queue
/// time was not time spent outside the lock call.
#[inline(always)]
pub fn switched_in(thread: &mut Thread, now: u64) {
    if thread.lock_since_ns == 0 {
        if thread.lock_ended_ns != 0 {
            thread.lock_ended_ns = now;
        }
        return;
    }
    thread.lock_waited_ns += now.saturating_sub(thread.lock_since_ns);
    thread.lock_since_ns = 0;
    thread.lock_ended_ns = now;
}

/// `thread` exits: a finished lock wait it has not recorded yet is; one it is still
/// in (killed while waiting) has no end and is dropped.
#[inline(always)]
pub fn thread_exits(tid: u32, thread: &mut Thread) {
    if thread.lock_since_ns == 0 && thread.lock_ended_ns != 0 {
        record_lock_wait(tid, thread);
    }
}

/// Records the finished lock wait of `thread` in its pool and its lock's entry.
#[inline(always)]
fn record_lock_wait(tid: u32, thread: &mut Thread) {
    let waited = thread.lock_waited_ns;
    thread.lock_ended_ns = 0;
    thread.lock_waited_ns = 0;
    let primitive = if thread.lock_timed != 0 {
        LockPrimitive::FutexTimed
    } else {
        LockPrimitive::Futex
    };
    record(threads::pool(tid, thread), primitive, waited);
    let key = LockKey {
        tgid: thread.lock_tgid,
        stack: thread.lock_stack,
        address: thread.lock_address,
        timed: thread.lock_timed,
        _pad: 0,
    };
    let Some(zero) = ZERO_HISTOGRAM.get(0) else {
        return;
    };
    let Some(lock) = get_or_insert(
        &LOCKS,
        Some(CountedMap::Locks),
        &key,
        zero,
        LossSource::LocksInsert,
    ) else {
        return;
    };
    // SAFETY: a live map value; concurrent updates are atomic adds.
    add_to_shared_histogram(unsafe { &mut *lock }, waited);
}

/// One lock wait into the histogram of `pool` (none: the thread has no pool yet).
#[inline(always)]
fn record(pool: Option<u32>, primitive: LockPrimitive, waited: u64) {
    let Some(pool) = pool else {
        return;
    };
    let index = lock_wait_index(pool, primitive);
    if let Some(histogram) = LOCK_WAITS.get_ptr_mut(index) {
        // SAFETY: a live array slot; concurrent updates are atomic adds.
        add_to_shared_histogram(unsafe { &mut *histogram }, waited);
        // After the record: x86's atomic adds are seen in order, and the compiler
        // keeps the record before the lookup (a call that may read it). A reader
        // that sees the count finds the wait.
        if let Some(count) = LOCK_WAIT_COUNTS.get_ptr_mut(index) {
            // SAFETY: as above.
            atomic_add(unsafe { &mut *count }, 1);
        }
    }
}

/// Entry of `pthread_mutex_lock` (opt-in): a serving watched thread's call is timed.
#[uprobe]
pub fn mutex_lock_enter(_ctx: ProbeContext) -> u32 {
    let tid = bpf_get_current_pid_tgid() as u32;
    // A stream worker's futex waits are its pool's queue as much as locks: not timed.
    if thread(tid).is_some_and(|thread| {
        matches!(
            threads::serving(thread),
            Serving::OneAtATime | Serving::Multiplexing
        )
    }) && let Err(code) = insert_counted(&MUTEX_CALLS, CountedMap::MutexCalls, &tid, &now_ns())
    {
        count_loss(LossSource::MutexCallsInsert, LossErrno::of(code.into()));
    }
    0
}

/// Return of `pthread_mutex_lock`: the time inside the call is a lock wait.
#[uretprobe]
pub fn mutex_lock_return(_ctx: RetProbeContext) -> u32 {
    let tid = bpf_get_current_pid_tgid() as u32;
    // SAFETY: copied out at once.
    let Some(entered) = (unsafe { MUTEX_CALLS.get(tid).copied() }) else {
        return 0;
    };
    remove_counted(&MUTEX_CALLS, CountedMap::MutexCalls, &tid);
    record(
        threads::pool_of(tid),
        LockPrimitive::PthreadMutex,
        now_ns().saturating_sub(entered),
    );
    0
}
