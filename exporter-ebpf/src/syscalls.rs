//! Socket syscalls of watched processes, from the raw `sys_enter`/`sys_exit`
//! tracepoints: counts calls per service and syscall, and follows each accepted
//! connection from accept to its first successful read (or close) to know how many
//! connections are accepted but not yet served.
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
    CONN_UNSERVED, Conn, ConnKey, LossSource, PendingCall, SyscallSlot, syscall_counter_index,
};

use crate::maps::{
    CONNS, PENDING_CALLS, SYSCALL_SLOTS, add_to_counter, count_loss, update_service, watched,
};

/// Offset of the first syscall argument in `struct pt_regs`.
#[cfg(bpf_target_arch = "x86_64")]
const FIRST_ARG_OFFSET: usize = 112; // rdi
#[cfg(bpf_target_arch = "aarch64")]
const FIRST_ARG_OFFSET: usize = 0; // regs[0]

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
        remember_call(tid, slot, 0);
        return Ok(());
    }
    let is_close = slot == SyscallSlot::Close;
    if !slot.is_read() && !is_close {
        return Ok(());
    }
    let regs: *const u8 = ctx.arg(0);
    // SAFETY: regs is the kernel's pt_regs of this syscall; the helper checks the read.
    let fd: u64 = unsafe { bpf_probe_read_kernel(regs.add(FIRST_ARG_OFFSET).cast::<u64>())? };
    let key = ConnKey {
        tgid,
        fd: fd as u32,
    };
    let Some(conn) = CONNS.get_ptr(key) else {
        return Ok(());
    };
    // SAFETY: copied out at once.
    let conn = unsafe { *conn };
    if is_close {
        forget_connection(&key, &conn);
    } else if conn.flags & CONN_UNSERVED != 0 && conn.owner_since_ns == watch.since_ns {
        remember_call(tid, slot, key.fd);
    }
    Ok(())
}

#[inline(always)]
fn remember_call(tid: u32, slot: SyscallSlot, fd: u32) {
    let call = PendingCall {
        slot: slot as u32,
        fd,
    };
    if PENDING_CALLS.insert(tid, call, 0).is_err() {
        count_loss(LossSource::PendingCallsFull);
    }
}

/// Removes a connection; if it was still unserved, it leaves the unserved count.
/// Counted only when our remove succeeds so that a racing remove counts once.
#[inline(always)]
fn forget_connection(key: &ConnKey, conn: &Conn) {
    if CONNS.remove(key).is_ok() && conn.flags & CONN_UNSERVED != 0 {
        update_service(conn.service, |c| c.unserved_left += 1);
    }
}

/// sys_exit(struct pt_regs *regs, long ret)
#[raw_tracepoint(tracepoint = "sys_exit")]
pub fn sys_exit(ctx: RawTracePointContext) -> i32 {
    match try_sys_exit(&ctx) {
        Ok(()) | Err(_) => 0,
    }
}

fn try_sys_exit(ctx: &RawTracePointContext) -> Result<(), i64> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    // SAFETY: copied out at once.
    let Some(call) = (unsafe { PENDING_CALLS.get(tid).copied() }) else {
        return Ok(());
    };
    let _ = PENDING_CALLS.remove(tid);
    let ret: i64 = ctx.arg(1);
    let tgid = (pid_tgid >> 32) as u32;
    let slot = SyscallSlot::from_u32(call.slot);
    if slot.is_accept() {
        if ret >= 0 {
            on_accepted(tgid, ret as u32);
        }
    } else if ret > 0 {
        // EAGAIN on a non-blocking socket and EOF do not serve the connection.
        on_first_read(ConnKey { tgid, fd: call.fd });
    }
    Ok(())
}

fn on_accepted(tgid: u32, fd: u32) {
    let Some(watch) = watched(tgid) else {
        return;
    };
    update_service(watch.service, |c| c.accepted += 1);
    let key = ConnKey { tgid, fd };
    // The fd was closed in a way we do not see (dup2, close_range, exit): drop the old entry.
    if let Some(old) = CONNS.get_ptr(key) {
        // SAFETY: copied out at once.
        let old = unsafe { *old };
        forget_connection(&key, &old);
    }
    let conn = Conn {
        service: watch.service,
        flags: CONN_UNSERVED,
        owner_since_ns: watch.since_ns,
    };
    if CONNS.insert(key, conn, 0).is_err() {
        count_loss(LossSource::ConnsFull);
        return;
    }
    update_service(watch.service, |c| c.unserved_entered += 1);
}

fn on_first_read(key: ConnKey) {
    let Some(conn) = CONNS.get_ptr_mut(key) else {
        return;
    };
    // SAFETY: a live entry of a running process; only its own threads touch it. Two
    // threads finishing a first read on one fd at once may both count (documented).
    let conn = unsafe { &mut *conn };
    if conn.flags & CONN_UNSERVED != 0 {
        conn.flags &= !CONN_UNSERVED;
        update_service(conn.service, |c| c.unserved_left += 1);
    }
}
