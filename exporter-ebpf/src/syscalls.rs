//! Socket syscalls of watched processes (`syscalls:sys_enter_*`, `sys_exit_accept*`,
//! `sys_exit_read*`): counts calls per service and syscall, and follows each accepted
//! connection from accept to its first successful read (or close) to know how many
//! connections are accepted but not yet served.
//!
//! One `sys_enter` program is attached to every counted syscall; it tells them apart
//! by the syscall number through a table user space fills (numbers differ per arch).
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::tracepoint,
    programs::TracePointContext,
};
use poolscope_shared::{CONN_UNSERVED, Conn, ConnKey, LossSource, SyscallSlot, syscall_counter_index};

use crate::maps::{
    CONNS, PENDING_READS, SYSCALL_SLOTS, add_to_counter, count_loss, update_service, watched,
};

/// `__syscall_nr` in every sys_enter_*/sys_exit_* format.
const SYSCALL_NR: usize = 8;
/// First argument in sys_enter_* (the fd for every syscall we attach to); `ret` in sys_exit_*.
const ARG0_OR_RET: usize = 16;

#[tracepoint]
pub fn sys_enter(ctx: TracePointContext) -> u32 {
    match try_sys_enter(&ctx) {
        Ok(()) | Err(_) => 0,
    }
}

fn try_sys_enter(ctx: &TracePointContext) -> Result<(), i32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tgid = (pid_tgid >> 32) as u32;
    let Some(watch) = watched(tgid) else {
        return Ok(());
    };
    // SAFETY: offsets match the tracepoints' format.
    let nr: i32 = unsafe { ctx.read_at(SYSCALL_NR)? };
    let slot = match SYSCALL_SLOTS.get(nr as u32) {
        Some(slot) => SyscallSlot::from_u32(*slot),
        None => SyscallSlot::None,
    };
    if slot == SyscallSlot::None {
        return Ok(());
    }
    add_to_counter(syscall_counter_index(watch.service, slot));

    let is_close = slot == SyscallSlot::Close;
    if !slot.is_read() && !is_close {
        return Ok(());
    }
    // SAFETY: as above.
    let fd: u64 = unsafe { ctx.read_at(ARG0_OR_RET)? };
    let key = ConnKey { tgid, fd: fd as u32 };
    let Some(conn) = CONNS.get_ptr(key) else {
        return Ok(());
    };
    // SAFETY: copied out at once.
    let conn = unsafe { *conn };
    if is_close {
        forget_connection(&key, &conn);
    } else if conn.flags & CONN_UNSERVED != 0
        && conn.owner_since_ns == watch.since_ns
        && PENDING_READS.insert(pid_tgid as u32, key.fd, 0).is_err()
    {
        count_loss(LossSource::PendingReadsFull);
    }
    Ok(())
}

/// Removes a connection; if it was still unserved, it leaves the unserved count.
/// Counted only when our remove succeeds so that a racing remove counts once.
#[inline(always)]
fn forget_connection(key: &ConnKey, conn: &Conn) {
    if CONNS.remove(key).is_ok() && conn.flags & CONN_UNSERVED != 0 {
        update_service(conn.service, |c| c.unserved_left += 1);
    }
}

#[tracepoint]
pub fn sys_exit_accept(ctx: TracePointContext) -> u32 {
    match try_sys_exit_accept(&ctx) {
        Ok(()) | Err(_) => 0,
    }
}

fn try_sys_exit_accept(ctx: &TracePointContext) -> Result<(), i32> {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    let Some(watch) = watched(tgid) else {
        return Ok(());
    };
    // SAFETY: offset matches the tracepoint's format.
    let ret: i64 = unsafe { ctx.read_at(ARG0_OR_RET)? };
    if ret < 0 {
        return Ok(());
    }
    update_service(watch.service, |c| c.accepted += 1);
    let key = ConnKey {
        tgid,
        fd: ret as u32,
    };
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
        // SAFETY: helper without preconditions.
        accepted_ns: unsafe { bpf_ktime_get_ns() },
    };
    if CONNS.insert(key, conn, 0).is_err() {
        count_loss(LossSource::ConnsFull);
        return Ok(());
    }
    update_service(watch.service, |c| c.unserved_entered += 1);
    Ok(())
}

#[tracepoint]
pub fn sys_exit_read(ctx: TracePointContext) -> u32 {
    match try_sys_exit_read(&ctx) {
        Ok(()) | Err(_) => 0,
    }
}

fn try_sys_exit_read(ctx: &TracePointContext) -> Result<(), i32> {
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    // SAFETY: copied out at once.
    let Some(fd) = (unsafe { PENDING_READS.get(tid).copied() }) else {
        return Ok(());
    };
    let _ = PENDING_READS.remove(tid);
    // SAFETY: offset matches the tracepoint's format.
    let ret: i64 = unsafe { ctx.read_at(ARG0_OR_RET)? };
    // EAGAIN on a non-blocking socket and EOF do not serve the connection.
    if ret <= 0 {
        return Ok(());
    }
    let key = ConnKey {
        tgid: (pid_tgid >> 32) as u32,
        fd,
    };
    let Some(conn) = CONNS.get_ptr_mut(key) else {
        return Ok(());
    };
    // SAFETY: a live entry of a running process; only its own threads touch it. Two
    // threads finishing a first read on one fd at once may both count (documented).
    let conn = unsafe { &mut *conn };
    if conn.flags & CONN_UNSERVED != 0 {
        conn.flags &= !CONN_UNSERVED;
        update_service(conn.service, |c| c.unserved_left += 1);
    }
    Ok(())
}
