//! Tcp backend, HTTP/2: each read and write of a watched connection at its return,
//! with its length, in the calling thread (fexit on `tcp_recvmsg` and
//! `tcp_sendmsg`), handed to `h2.rs` as the socket backend's tracepoints hand theirs.
//! The tracepoints the tcp backend counts HTTP/1 with give neither a read's length
//! nor a write's bytes in its caller's memory, which following frames needs.
//!
//! Attached only with the tcp backend, where the kernel lets fexit programs attach
//! and has `bpf_get_func_ret` and `bpf_loop` (5.17 and later with BTF); user space
//! then sets `TCP_HTTP2`, and `tcp.rs` leaves HTTP/2 connections to these programs
//! instead of refusing them. Both run on every TCP read and write of the host: one
//! that is not of a watched port costs a load and an array read, as `tcp.rs`'s do.
use aya_ebpf::{macros::fexit, programs::FExitContext};

use crate::{
    h2,
    sock::{conn, offset},
};

/// The position of `flags` among `tcp_recvmsg`'s arguments (kernel BTF): 3, or 4
/// before Linux 5.19 (a `nonblock` argument came before it).
#[unsafe(no_mangle)]
static TCP_RECVMSG_FLAGS_ARG: u32 = 3;

/// recv's flag to look at queued bytes and leave them queued.
const MSG_PEEK: i32 = 2;

/// tcp_recvmsg(struct sock *sk, struct msghdr *msg, size_t len, int flags, ...)
#[fexit(function = "tcp_recvmsg")]
pub fn tcp_h2_read(ctx: FExitContext) -> i32 {
    let Ok(ret) = ctx.ret::<i32>() else {
        return 0;
    };
    // As `sock_recv`: EAGAIN and EOF carry nothing, and a peek's bytes are the next
    // read's.
    if ret <= 0 || flags(&ctx) & MSG_PEEK != 0 {
        return 0;
    }
    let sk: *const u8 = ctx.arg(0);
    if let Some(conn) = conn(sk) {
        // SAFETY: a live entry, changed by compare-and-swap.
        h2::after_read(sk, unsafe { &mut *conn }, ret);
    }
    0
}

/// The `flags` argument of `tcp_recvmsg`, where this kernel passes it.
#[inline(always)]
fn flags(ctx: &FExitContext) -> i32 {
    // Both read first, each at a constant offset, as the verifier wants a context read;
    // chosen after by the load-time constant (a branch around the reads would let the
    // compiler make one read at a computed offset, which the verifier refuses).
    let third: i32 = ctx.arg(3);
    let fourth: i32 = ctx.arg(4);
    if offset(&TCP_RECVMSG_FLAGS_ARG) == 4 {
        fourth
    } else {
        third
    }
}

/// tcp_sendmsg(struct sock *sk, struct msghdr *msg, size_t size)
#[fexit(function = "tcp_sendmsg")]
pub fn tcp_h2_write(ctx: FExitContext) -> i32 {
    let Ok(ret) = ctx.ret::<i32>() else {
        return 0;
    };
    if ret <= 0 {
        return 0;
    }
    let sk: *const u8 = ctx.arg(0);
    if let Some(conn) = conn(sk) {
        // SAFETY: as above.
        h2::after_write(sk, unsafe { &mut *conn }, ret);
    }
    0
}
