//! Syscall backend (any kernel with raw syscall tracepoints): requests from the
//! socket syscalls of watched processes, keyed by (tgid, fd) of accepted sockets.
//! Counts calls per service and syscall, and feeds the request state machine: an
//! accept connects, a read or write that moved bytes advances the request, a close
//! ends the connection. It cannot see bytes arrive, so a keep-alive request's queue
//! time is not seen (README).
//!
//! Raw tracepoints rather than `syscalls:sys_*_*`: the latter go through perf's
//! trace-buffer setup on every call of every process (measured ~3x the cost of the
//! program itself), while a raw tracepoint costs one failed map lookup for processes
//! we do not watch. The syscall is told by its number through a table user space
//! fills (numbers differ per arch).
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_probe_read_kernel},
    macros::raw_tracepoint,
    programs::RawTracePointContext,
};
use poolscope_shared::{
    LossErrno, LossSource, PendingCall, Phase, SyscallSlot, fd_conn_key, maps::CountedMap,
    syscall_counter_index,
};

use crate::{
    abi::{FIRST_ARG_OFFSET, NUMBER_OFFSET},
    clock::now_ns,
    h2,
    maps::{
        CONNS, PENDING_CALLS, SYSCALL_SLOTS, add_to_counter, count_loss, insert_counted,
        remove_counted, watched,
    },
    requests::{self, Arrivals},
    source::Source,
};

/// sys_enter(struct pt_regs *regs, long id)
#[raw_tracepoint(tracepoint = "sys_enter")]
pub fn sys_enter(ctx: RawTracePointContext) -> i32 {
    match try_sys_enter(&ctx) {
        Ok(()) | Err(_) => 0,
    }
}

fn try_sys_enter(ctx: &RawTracePointContext) -> Result<(), i64> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let Some(watch) = watched(tgid) else {
        return Ok(());
    };
    let number: u64 = ctx.arg(1);
    let slot = match SYSCALL_SLOTS.get(number as u32) {
        Some(slot) => SyscallSlot::from_u32(*slot),
        None => SyscallSlot::None,
    };
    if slot == SyscallSlot::None {
        return Ok(());
    }
    add_to_counter(syscall_counter_index(watch.service, slot));

    let tid = pid_tgid as u32;
    if slot.is_accept() {
        remember_call(tid, slot, 0, number as u32);
        return Ok(());
    }
    let regs: *const u8 = ctx.arg(0);
    // SAFETY: regs is the kernel's pt_regs of this syscall; the helper checks the read.
    let fd: u64 = unsafe { bpf_probe_read_kernel(regs.add(FIRST_ARG_OFFSET).cast::<u64>())? };
    let fd = fd as u32;
    let key = fd_conn_key(tgid, fd);
    // SAFETY: copied out at once.
    let Some(owner) = (unsafe { CONNS.get(key).map(|conn| conn.owner_since_ns) }) else {
        return Ok(());
    };
    if owner != watch.since_ns {
        // Left by an earlier process with this pid; the exit purge removes it.
        return Ok(());
    }
    if slot == SyscallSlot::Close {
        requests::closed(key, now_ns());
    } else {
        remember_call(tid, slot, fd, number as u32);
    }
    Ok(())
}

#[inline(always)]
fn remember_call(tid: u32, slot: SyscallSlot, fd: u32, number: u32) {
    let call = PendingCall {
        slot: slot as u32,
        fd,
        number,
        _pad: 0,
    };
    if let Err(code) = insert_counted(&PENDING_CALLS, CountedMap::PendingCalls, &tid, &call) {
        count_loss(LossSource::PendingCallsInsert, LossErrno::of(code.into()));
    }
}

/// sys_exit(struct pt_regs *regs, long ret)
#[raw_tracepoint(tracepoint = "sys_exit")]
pub fn sys_exit(ctx: RawTracePointContext) -> i32 {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    // SAFETY: copied out at once.
    let Some(call) = (unsafe { PENDING_CALLS.get(tid).copied() }) else {
        return 0;
    };
    remove_counted(&PENDING_CALLS, CountedMap::PendingCalls, &tid);
    let regs: *const u8 = ctx.arg(0);
    // SAFETY: regs is the kernel's pt_regs of this syscall; the helper checks the read.
    let number = unsafe { bpf_probe_read_kernel(regs.add(NUMBER_OFFSET).cast::<u64>()) };
    if number != Ok(u64::from(call.number)) {
        return 0;
    }
    let ret: i64 = ctx.arg(1);
    // Errors (EAGAIN on a non-blocking socket) and EOF move no request bytes.
    if ret < 0 {
        return 0;
    }
    let tgid = (pid_tgid >> 32) as u32;
    let slot = SyscallSlot::from_u32(call.slot);
    if slot.is_accept() {
        if let Some(watch) = watched(tgid) {
            let key = fd_conn_key(tgid, ret as u32);
            requests::connected(key, watch.service, watch.since_ns, now_ns());
        }
        return 0;
    }
    if ret == 0 {
        return 0;
    }
    let Some(conn) = CONNS.get_ptr_mut(fd_conn_key(tgid, call.fd)) else {
        return 0;
    };
    // SAFETY: a live entry of a running process; races between its threads on one
    // fd are tolerated (README).
    let conn = unsafe { &mut *conn };
    if slot.is_read() {
        // A connection's first bytes tell HTTP/2 (the client preface), not followed here.
        if conn.phase == Phase::Unserved as u32 && h2::unfollowed(regs, slot, conn, ret) {
            return 0;
        }
        requests::read(
            conn,
            now_ns(),
            Arrivals::Unseen,
            || Source::of_saved_call(regs, slot),
            ret as u64,
        );
    } else if slot.is_write() {
        requests::wrote_from(conn, now_ns(), ret as u32, || {
            Source::of_saved_call(regs, slot)
        });
    }
    0
}
