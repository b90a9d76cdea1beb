//! Tcp backend (kernels before 6.3 that have BTF): the socket backend's state machine
//! and storage (`SOCK_CONNS`), fed by hooks older kernels have, each fired per socket
//! event, never per syscall:
//! - `sock:inet_sock_set_state`: the socket backend's own program (`sock.rs`);
//! - `tcp:tcp_probe`, each segment an established socket receives: request bytes
//!   arrive when one carries data;
//! - `tcp:tcp_rcv_space_adjust`, run by a read (any syscall, io_uring, splice) each
//!   time it copies received data, in the reading thread: a read;
//! - `net:net_dev_queue`, each packet handed to a device, with its sending socket:
//!   a write, once data the application queued goes out. A response is therefore
//!   seen when it is transmitted rather than when it is written (the same instant
//!   unless the peer's window or congestion holds it back).
//!
//! HTTP/2 connections are followed by `tcp_h2.rs` where the kernel lets its fexit
//! programs attach; these hooks then only leave them to it (and give their arrivals).
//!
//! The socket's own sequence numbers tell data from bare acknowledgements: a
//! received segment carries data when its sequence range exceeds its SYN and FIN;
//! a transmit is a write's when the socket holds data written and not yet sent
//! (`write_seq` ahead of `snd_nxt`, which moves only after the packet is handed on),
//! so that acknowledgements and retransmissions are not responses.
use aya_ebpf::{
    helpers::bpf_get_current_pid_tgid, macros::btf_tracepoint, programs::BtfTracePointContext,
};
use poolscope_shared::{Conn, H2_FRAME_HEADER, Phase, ROUTE_BYTES};

use crate::{
    clock::now_ns,
    h2,
    maps::watched,
    requests::{self, Arrivals},
    sock::{
        IPPROTO_TCP, SOCK_PROTOCOL_OFFSET, SOCK_STATE_OFFSET, conn, conn_on_watched_port, field,
        load, offset, on_watched_port, read_kernel,
    },
    source::Source,
};

/// Offsets from the kernel's BTF: `sk_buff.sk` and `sk_buff.cb`; in the control block
/// TCP keeps there (`struct tcp_skb_cb`), `seq`, `end_seq` and `tcp_flags`; in
/// `struct tcp_sock`, `snd_nxt`, `write_seq`, `copied_seq`, `rcv_nxt` and
/// `bytes_received`. The loader refuses this backend without them.
#[unsafe(no_mangle)]
static SKB_SOCK_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SKB_CB_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TCP_CB_SEQ_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TCP_CB_END_SEQ_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TCP_CB_FLAGS_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TCP_SND_NXT_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TCP_WRITE_SEQ_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TCP_COPIED_SEQ_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TCP_RCV_NXT_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static TCP_BYTES_RECEIVED_OFFSET: u32 = 0;

const TCP_TIME_WAIT: u8 = 6;
const TCP_NEW_SYN_RECV: u8 = 12;
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;

/// tcp_probe(struct sock *sk, struct sk_buff *skb)
#[btf_tracepoint(function = "tcp_probe")]
pub fn tcp_segment_received(ctx: BtfTracePointContext) -> i32 {
    let sk: *const u8 = ctx.arg(0);
    if !on_watched_port(sk) {
        return 0;
    }
    let skb: *const u8 = ctx.arg(1);
    if !carries_data(skb) {
        return 0;
    }
    if let Some(conn) = conn_on_watched_port(sk) {
        // SAFETY: a live entry, changed by compare-and-swap.
        let conn = unsafe { &mut *conn };
        match requests::phase(conn) {
            // Followed by `tcp_h2.rs` where it runs, else refused and counting nothing.
            Phase::Multiplexed => h2::arrived(sk, now_ns()),
            Phase::Serving => {
                let now = now_ns();
                if response_sent_unseen(sk, conn) {
                    requests::wrote(conn, now, 0);
                }
                requests::data_arrived(conn, now);
            }
            _ => requests::data_arrived(conn, now_ns()),
        }
    }
    0
}

/// Whether received segment `skb` carries data: its sequence range is longer than
/// its SYN and FIN, which take one number each.
#[inline(always)]
fn carries_data(skb: *const u8) -> bool {
    let cb = offset(&SKB_CB_OFFSET);
    let seq: u32 = load(skb, cb + offset(&TCP_CB_SEQ_OFFSET));
    let end_seq: u32 = load(skb, cb + offset(&TCP_CB_END_SEQ_OFFSET));
    let flags: u8 = load(skb, cb + offset(&TCP_CB_FLAGS_OFFSET));
    let control = u32::from(flags & TCP_FIN != 0) + u32::from(flags & TCP_SYN != 0);
    end_seq.wrapping_sub(seq) > control
}

/// tcp_rcv_space_adjust(struct sock *sk)
#[btf_tracepoint(function = "tcp_rcv_space_adjust")]
pub fn tcp_read(ctx: BtfTracePointContext) -> i32 {
    let sk = ctx.arg(0);
    if let Some(conn) = conn(sk) {
        // SAFETY: as above.
        let conn = unsafe { &mut *conn };
        // A connection's first bytes tell HTTP/2 (the client preface), and so may its
        // second request's (after an `Upgrade: h2c`): not counted here.
        let phase = requests::phase(conn);
        // A register, not an `Option`: the verifier refuses the unset half of a `None`
        // passed to a function. 0 read is a `MSG_PEEK` (which moves no `copied_seq`):
        // compared as before, over the buffer it filled.
        let first_read = if phase == Phase::Unserved {
            bytes_read(sk)
                .filter(|&read| read != 0)
                .unwrap_or(h2::UNKNOWN_LENGTH)
        } else {
            h2::UNKNOWN_LENGTH
        };
        if h2::may_open(conn, phase) && h2::left_by_tcp_read(conn, phase, first_read) {
            return 0;
        }
        // Adopted mid-stream: its first read tells HTTP/2 frames (counting nothing)
        // from HTTP/1; a read copies at least a frame header's worth in nearly all
        // cases, and the bytes read first are the call's own.
        if conn.adopted != 0 && h2::adopted_mid_stream(conn, H2_FRAME_HEADER as i32) {
            return 0;
        }
        // The length read is not known here: the route takes what the buffer holds,
        // up to its size (a request line ends within it; user space reads up to its
        // end).
        requests::read(
            conn,
            now_ns(),
            Arrivals::Seen,
            Source::of_current_call,
            ROUTE_BYTES as u64,
        );
    }
    0
}

/// net_dev_queue(struct sk_buff *skb)
#[btf_tracepoint(function = "net_dev_queue")]
pub fn tcp_transmit(ctx: BtfTracePointContext) -> i32 {
    let skb: *const u8 = ctx.arg(0);
    let sk: *const u8 = load(skb, offset(&SKB_SOCK_OFFSET));
    if sk.is_null() || !on_watched_port(sk) {
        return 0;
    }
    let Some(Unsent { bytes, write_seq }) = unsent(sk) else {
        return 0;
    };
    if let Some(conn) = conn_on_watched_port(sk) {
        // SAFETY: as above.
        let conn = unsafe { &mut *conn };
        let service = conn.service;
        requests::wrote_from(conn, now_ns(), bytes, || written_here(service));
        conn.seen_write_seq = write_seq;
    }
    0
}

/// The write being transmitted, when the transmit runs inside a write call of a
/// process of `service`: the usual case for an answer's first packet (nothing of
/// the connection is in flight before it). A transmit that an acknowledgement
/// released runs in whichever task it interrupted, whose call says nothing of it.
#[inline(always)]
fn written_here(service: u32) -> Option<Source> {
    let tgid = (bpf_get_current_pid_tgid() >> 32) as u32;
    watched(tgid).filter(|watch| watch.service == service)?;
    Source::of_current_write()
}

/// Bytes a socket holds written and not yet sent, and the sequence number after the
/// last of them.
struct Unsent {
    bytes: u32,
    write_seq: u32,
}

/// What socket `sk` holds written and not yet sent, if it is a full TCP socket (not a
/// handshake's or a closed connection's mini socket) that holds any.
#[inline(always)]
fn unsent(sk: *const u8) -> Option<Unsent> {
    if field::<u16>(sk, &SOCK_PROTOCOL_OFFSET) != IPPROTO_TCP
        || matches!(
            field::<u8>(sk, &SOCK_STATE_OFFSET),
            TCP_TIME_WAIT | TCP_NEW_SYN_RECV
        )
    {
        return None;
    }
    let (snd_nxt, write_seq) = send_sequence(sk)?;
    let bytes = write_seq.wrapping_sub(snd_nxt);
    ahead(bytes).then_some(Unsent { bytes, write_seq })
}

/// `snd_nxt` (next to send) and `write_seq` (after the last written) of TCP socket
/// `sk`, read through the helper: a packet's socket is not a pointer that
/// `bpf_skc_to_tcp_sock` takes on every kernel (an RCU one on 6.18).
#[inline(always)]
fn send_sequence(sk: *const u8) -> Option<(u32, u32)> {
    let snd_nxt: u32 = read_kernel(sk, offset(&TCP_SND_NXT_OFFSET)).ok()?;
    let write_seq: u32 = read_kernel(sk, offset(&TCP_WRITE_SEQ_OFFSET)).ok()?;
    Some((snd_nxt, write_seq))
}

/// The bytes the reader of TCP socket `sk` has taken so far, over all its calls, from
/// inside the call that copies them: `copied_seq` (the next byte to copy) less the
/// sequence number of the first byte (`rcv_nxt` less `bytes_received`, the bytes TCP
/// took in order). On a connection's first read, that call's own length, which the
/// tracepoint is not given.
#[inline(always)]
fn bytes_read(sk: *const u8) -> Option<u32> {
    let copied_seq: u32 = read_kernel(sk, offset(&TCP_COPIED_SEQ_OFFSET)).ok()?;
    let rcv_nxt: u32 = read_kernel(sk, offset(&TCP_RCV_NXT_OFFSET)).ok()?;
    let received: u64 = read_kernel(sk, offset(&TCP_BYTES_RECEIVED_OFFSET)).ok()?;
    Some(copied_seq.wrapping_sub(rcv_nxt.wrapping_sub(received as u32)))
}

/// Whether a sequence-number distance is ahead: not 0, and less than half the space
/// (sequence numbers wrap).
#[inline(always)]
fn ahead(distance: u32) -> bool {
    distance != 0 && distance < 1 << 31
}

/// Request bytes arrive on `conn` (of socket `sk`) while its request is served:
/// whether its server wrote since the last transmit seen as a write and all of it
/// went out (a response whose transmit `net_dev_queue` did not show: a second small
/// write that Nagle held, released by the client's delayed acknowledgement, in about
/// one request of a thousand on 6.18). Without this, the next request would count as
/// more of this one. Nothing written since: more of this request, or a pipelined one.
#[inline(always)]
fn response_sent_unseen(sk: *const u8, conn: &mut Conn) -> bool {
    if conn.seen_write_seq == 0 {
        return false;
    }
    let Some((snd_nxt, write_seq)) = send_sequence(sk) else {
        return false;
    };
    if write_seq != snd_nxt || !ahead(write_seq.wrapping_sub(conn.seen_write_seq)) {
        return false;
    }
    conn.seen_write_seq = write_seq;
    true
}
