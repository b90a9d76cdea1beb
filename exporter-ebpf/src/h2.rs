//! HTTP/2 over cleartext TCP (DESIGN §3): a connection whose first bytes are the client
//! preface leaves the one-request-at-a-time machine of `requests.rs` (its `Conn`
//! becomes `Multiplexed`) and is followed here frame by frame. A request is a stream:
//! it starts when the server reads the client's HEADERS that open it and ends at the
//! server's END_STREAM (finished) or at an RST_STREAM from either side, or the
//! connection's end (reset). Fed by each read and write at its return with its length:
//! the socket backend's tracepoints (`sock.rs`), or the tcp backend's fexit programs
//! where the kernel has them (`tcp_h2.rs`).
//!
//! Neither hook carries a buffer: the bytes are read from the syscall's own buffer,
//! found through the calling thread's saved registers (read, recvfrom, readv, recvmsg
//! and their write twins, iovecs included). Only frame headers are
//! read (9 bytes a frame; a payload is skipped by its length, whatever wrote it).
//! Parse state lives in the socket (`H2_CONNS`) since a header may span reads,
//! writes and buffers. Where the frame stream cannot be followed (bytes that break
//! the protocol, a header in a buffer that cannot be read, more frames in one call
//! than a run follows) the connection stops counting, its open streams leave the
//! in-flight gauge uncounted, and the reason is counted as a loss: a count known to be
//! partial, never a wrong one.
use core::{ffi::c_void, ptr};

use aya_ebpf::{
    bindings::BPF_SK_STORAGE_GET_F_CREATE,
    helpers::{
        bpf_get_current_pid_tgid,
        generated::{bpf_loop, bpf_sk_storage_get},
    },
};
use poolscope_shared::{
    CallWalk, Conn, FrameCursor, H2_BLOCK_BYTES, H2_FRAME_HEADER, H2_PREFACE, H2_STREAM_SLOTS,
    H2Conn, LossErrno, LossSource, Phase, STREAM_ANSWERER, STREAM_READER, SyscallSlot,
};

use self::streams::{
    ACK, CONTINUATION, Frame, GOAWAY, Moment, SETTINGS, announced_limit, goaway, limit_streams,
    received, sent, settings, streams_ended,
};
use crate::{
    clock::now_ns,
    maps::{H2_CONNS, TCP_HTTP2, count_loss, swap, update_service},
    requests,
    source::{Source, preface_prefix, read_user},
    threads,
};

mod blocks;
mod streams;

/// Steps one program run takes through a call's bytes: a frame header, a payload
/// skipped, or a move to the next buffer each. A call that needs more loses the
/// connection (`Http2FrameBound`): 100 streams answered in one write take ~400.
const MAX_STEPS: u32 = 2048;
/// Which way bytes go on the connection.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Client to server: reads by the server.
    Received,
    /// Server to client: writes by the server.
    Sent,
}

/// `H2_CONNS` as the helpers take it.
#[inline(always)]
fn h2_conns() -> *mut c_void {
    ptr::from_ref(&H2_CONNS).cast_mut().cast()
}

/// The state of HTTP/2 connection `sk`, if it has one.
#[inline(always)]
fn stored(sk: *const u8) -> Option<&'static mut H2Conn> {
    // SAFETY: `sk` is the tracepoint's `struct sock *`, as the helper wants it.
    let h2 = unsafe { bpf_sk_storage_get(h2_conns(), sk.cast_mut().cast(), ptr::null_mut(), 0) };
    // SAFETY: a live storage value, freed with the socket after every program that
    // holds it ends.
    (!h2.is_null()).then(|| unsafe { &mut *h2.cast::<H2Conn>() })
}

/// A read of `len` bytes began the first request of connection `sk` (`Unserved`), or
/// its second (after an HTTP/1.1 `Upgrade: h2c` request, answered `101` and then in
/// HTTP/2 by the server): if they begin the client preface, the connection becomes
/// `Multiplexed` and its state is made, and `true` tells the caller to follow the
/// read here.
#[inline(never)]
pub fn opens(sk: *const u8, conn: &mut Conn, len: i32) -> bool {
    if !Source::of_current_call().is_some_and(|source| source.begins_with_preface(len.into())) {
        return false;
    }
    // What the server sent before this read went by before the walk begins, so its
    // next frame need not be SETTINGS: a greeting (gRPC sends its SETTINGS at
    // accept), or after an upgrade the 101 and the server's SETTINGS (`end_ns` is the
    // upgrade response's last write).
    let sent_before = conn.greeted != 0 || conn.end_ns != 0;
    // The stream limit of a greeting (`greeting`).
    let greeted_limit = (conn.greeting_limit_set != 0).then_some(conn.greeting_limit);
    let Some(left) = requests::multiplexed(conn) else {
        return false;
    };
    requests::upgraded(conn, left);
    // SAFETY: as in `stored`; a NULL value makes the entry zeroed.
    let h2 = unsafe {
        bpf_sk_storage_get(
            h2_conns(),
            sk.cast_mut().cast(),
            ptr::null_mut(),
            BPF_SK_STORAGE_GET_F_CREATE.into(),
        )
    };
    if h2.is_null() {
        // Multiplexed without a state: it counts no requests, and says so.
        count_loss(LossSource::Http2ConnsInsert, LossErrno::Enomem);
        return false;
    }
    // SAFETY: as in `stored`.
    let h2 = unsafe { &mut *h2.cast::<H2Conn>() };
    h2.key = blocks::key(now_ns());
    h2.recv.preface_left = H2_PREFACE.len() as u32;
    h2.send.frames = u32::from(sent_before);
    if let Some(limit) = greeted_limit {
        limit_streams(h2, limit, conn.service);
    }
    true
}

/// The first read or write (`len` bytes) of connection `conn`, adopted open
/// ([`Conn::adopted`]): if its bytes are HTTP/2 (a frame header: a length under 64
/// KiB, a known type; text protocols and TLS never start so), it becomes
/// `Multiplexed` and counts nothing, since where its frames begin and which streams
/// are open is unknown (`Http2Adopted`). `true` if so; checked once.
#[inline(never)]
pub fn adopted_mid_stream(conn: &mut Conn, len: i32) -> bool {
    conn.adopted = 0;
    if len < H2_FRAME_HEADER as i32 {
        return false;
    }
    let Some((base, _)) = Source::of_current_call().and_then(|source| source.buffer(0)) else {
        return false;
    };
    let Some(header) = read_user::<[u8; H2_FRAME_HEADER as usize]>(base) else {
        return false;
    };
    let frame_like = header[0] == 0 && header[3] <= CONTINUATION && header[5] & 0x80 == 0;
    let mut bytes = [0u8; 32];
    bytes[..9].copy_from_slice(&header);
    let preface = preface_prefix(&bytes, H2_FRAME_HEADER);
    if !(frame_like || preface) || requests::multiplexed(conn).is_none() {
        return false;
    }
    count_loss(LossSource::Http2Adopted, LossErrno::None);
    true
}

/// Syscall backend: the first read of connection `conn` (`Unserved`), syscall `slot`
/// whose saved registers are at kernel address `regs` (a `sys_exit` argument),
/// returned `len` bytes. If they begin the client preface, the connection is HTTP/2,
/// whose streams this backend does not follow: it becomes `Multiplexed` and counts
/// nothing, rather than read/write turns that are not requests
/// (`Http2SyscallBackend`). `true` if so.
#[inline(never)]
pub fn unfollowed(regs: *const u8, slot: SyscallSlot, conn: &mut Conn, len: i64) -> bool {
    Source::of_saved_call(regs, slot).is_some_and(|source| source.begins_with_preface(len))
        && refused(conn, LossSource::Http2SyscallBackend)
}

/// A read's length where it is not known: the whole preface is compared, as much of
/// it as the call's first buffer holds.
pub const UNKNOWN_LENGTH: u32 = H2_PREFACE.len() as u32;

/// Tcp backend, the tracepoint's read (`tcp_read`, from inside the call that copies
/// the bytes, whose length it does not know), in `phase`: whether the read is HTTP/2's,
/// not the HTTP/1 machine's. A connection's first read (`Unserved`) that begins the
/// client preface is left to `tcp_h2.rs`'s program at the call's return, which knows
/// its length and walks it as the socket backend does; where those programs are not
/// attached (no fexit: `TCP_HTTP2` is 0), the connection is refused and counts nothing
/// (`Http2TcpBackend`). With them, the first read of a second request (after an
/// `Upgrade: h2c`) that begins the preface is left to them too; checked once per
/// connection. A first read is compared with the preface over the `first_read` bytes
/// it moved (as the socket backend compares it: a preface a client sends a byte at a
/// time begins with a read of 1); where those are not known ([`UNKNOWN_LENGTH`]),
/// and for a second request, over as much of the preface as the call's first buffer
/// holds: a client writes it whole after an HTTP/1.1 request.
#[inline(never)]
pub fn left_by_tcp_read(conn: &mut Conn, phase: Phase, first_read: u32) -> bool {
    let followed = TCP_HTTP2.get(0).copied().unwrap_or(0) != 0;
    let preface = |len: u32| {
        Source::of_current_call().is_some_and(|source| source.begins_with_preface(len.into()))
    };
    if phase == Phase::Unserved {
        return preface(first_read) && (followed || refused(conn, LossSource::Http2TcpBackend));
    }
    if followed && preface(UNKNOWN_LENGTH) {
        // `after_read` checks it again at the call's return, and marks it checked.
        return true;
    }
    conn.upgrade_checked = 1;
    false
}

/// A read that returned `len` bytes on connection `sk` (`conn`), at its return, by the
/// reading thread (socket backend: `sock_recv`; tcp backend: `tcp_h2_read`): followed
/// here if the connection is multiplexed or these bytes open it (its first read, or its
/// second request's after an `Upgrade: h2c`, checked once). `false` if the read is
/// HTTP/1's.
#[inline(always)]
pub fn after_read(sk: *const u8, conn: &mut Conn, len: i32) -> bool {
    let phase = requests::phase(conn);
    if phase != Phase::Multiplexed {
        if !may_open(conn, phase) {
            return false;
        }
        // A second request is checked once, so that the requests after cost nothing.
        if phase != Phase::Unserved {
            conn.upgrade_checked = 1;
        }
        if !opens(sk, conn, len) {
            return false;
        }
    }
    transferred(sk, conn.service, Direction::Received, len, now_ns());
    true
}

/// Whether a read of connection `conn` in `phase` may begin the client preface: the
/// connection's first read, or the first of its second request (after an HTTP/1.1
/// request, which may have asked for `Upgrade: h2c`) until that was checked.
#[inline(always)]
pub fn may_open(conn: &Conn, phase: Phase) -> bool {
    phase == Phase::Unserved
        || (matches!(phase, Phase::Responded | Phase::Waiting)
            && conn.upgrade_checked == 0
            && conn.start_ns != 0)
}

/// A write that sent `len` bytes on connection `sk` (`conn`), at its return, by the
/// writing thread: followed here if the connection is multiplexed (`true`); before any
/// read, it may be an HTTP/2 server's greeting (`greeting`).
#[inline(always)]
pub fn after_write(sk: *const u8, conn: &mut Conn, len: i32) -> bool {
    match requests::phase(conn) {
        Phase::Multiplexed => {
            transferred(sk, conn.service, Direction::Sent, len, now_ns());
            true
        }
        Phase::Unserved => {
            greeting(conn, len);
            false
        }
        _ => false,
    }
}

/// An HTTP/2 connection a backend does not follow becomes `Multiplexed`, counts
/// nothing, and the refusal is counted as `source`; `false` if another CPU moved it
/// meanwhile.
#[inline(always)]
fn refused(conn: &mut Conn, source: LossSource) -> bool {
    if requests::multiplexed(conn).is_none() {
        return false;
    }
    count_loss(source, LossErrno::None);
    true
}

/// Request bytes arrived on HTTP/2 connection `sk`.
#[inline(always)]
pub fn arrived(sk: *const u8, now: u64) {
    if let Some(h2) = stored(sk)
        && h2.arrived_ns == 0
    {
        h2.arrived_ns = now;
    }
}

/// A read (`Received`) or write (`Sent`) of `len` bytes on HTTP/2 connection `sk` of
/// `service`.
#[inline(never)]
pub fn transferred(sk: *const u8, service: u32, direction: Direction, len: i32, now: u64) {
    let Some(h2) = stored(sk) else {
        return;
    };
    if h2.lost != 0 {
        return;
    }
    // A read takes the arrival as one exchange: a load and a store of 0 would erase an
    // arrival that another CPU's softirq (`arrived`) stored in between, and the
    // next read's streams would then have waited for nothing.
    let arrived = match direction {
        Direction::Received => swap(&mut h2.arrived_ns, 0),
        Direction::Sent => h2.arrived_ns,
    };
    let moment = Moment {
        service,
        now,
        arrive: if arrived != 0 { arrived } else { now },
    };
    match follow(h2, direction, len as u32, moment) {
        Ok(answered) => took_part(service, direction, answered),
        Err(lost) => lose(h2, service, lost),
    }
}

/// The calling thread read (`Received`) or wrote a connection's frames that answered
/// `answered` streams: whether streams are handed to it (it answers them and never
/// reads one) tells how the service serves them (DESIGN §3). Counted once a call,
/// outside the frame walk, whose verification a branch per frame would multiply; a
/// write that answers nothing looks nothing up, and a thread's mark is stored once.
#[inline(always)]
fn took_part(service: u32, direction: Direction, answered: u32) {
    let mark = match direction {
        Direction::Received => STREAM_READER,
        Direction::Sent if answered > 0 => STREAM_ANSWERER,
        Direction::Sent => return,
    };
    let Some(thread) = threads::thread(bpf_get_current_pid_tgid() as u32) else {
        return;
    };
    if mark == STREAM_ANSWERER && thread.is_stream_worker() {
        update_service(service, |c| {
            c.streams_answered_by_workers.add(u64::from(answered));
        });
    }
    if thread.streams & mark == 0 {
        thread.streams |= mark;
    }
}

/// HTTP/2 connection `sk` of `service` is gone: its open streams end, reset.
#[inline(never)]
pub fn closed(sk: *const u8, service: u32) {
    let Some(h2) = stored(sk) else {
        return;
    };
    if h2.lost == 0 {
        end_all(h2, service, true);
        blocks::gone(h2.key, service);
    }
}

/// The connection can no longer be followed: its open streams leave the gauge
/// uncounted, and the reason is counted.
#[inline(always)]
fn lose(h2: &mut H2Conn, service: u32, lost: LossSource) {
    // Plus one: 0 is "followed".
    h2.lost = lost as u32 + 1;
    end_all(h2, service, false);
    blocks::gone(h2.key, service);
    count_loss(lost, LossErrno::None);
}

/// Ends every open stream; `reset` counts them as reset.
#[inline(always)]
fn end_all(h2: &mut H2Conn, service: u32, reset: bool) {
    // The ended streams are the slots this takes, not the count: an end on another
    // CPU may free one meanwhile. No branch on what a slot holds: the verifier walks
    // each of the 128 iterations once, where a branch would multiply its states.
    let mut ended = 0u64;
    let mut slot = 0;
    while slot < H2_STREAM_SLOTS as usize {
        if let Some(stream) = h2.streams.get_mut(slot) {
            let id = swap(&mut stream.id, 0);
            // 1 if the slot held a stream.
            ended += (id | id.wrapping_neg()) >> 63;
        }
        slot += 1;
    }
    let limit = streams_ended(h2, ended);
    update_service(service, |c| {
        c.serving_left.add(ended);
        c.streams_ended.add(ended);
        if reset {
            c.streams_reset.add(ended);
        }
        limit.count(c);
    });
}

/// The cursor of `direction`.
#[inline(always)]
fn cursor(h2: &mut H2Conn, direction: Direction) -> &mut FrameCursor {
    match direction {
        Direction::Received => &mut h2.recv,
        Direction::Sent => &mut h2.send,
    }
}

/// Follows `total` bytes of the current call through the frames of `direction`, one
/// step per `bpf_loop` iteration: the verifier checks a step until its states
/// converge, where a bounded loop of this body would exceed its budget. The streams
/// the call answered.
#[inline(always)]
fn follow(
    h2: &mut H2Conn,
    direction: Direction,
    total: u32,
    moment: Moment,
) -> Result<u32, LossSource> {
    cursor(h2, direction).call = CallWalk {
        total,
        done: 0,
        outcome: GOING,
        found: 0,
        answered: 0,
        source: 0,
        iovecs: 0,
        buffer: 0,
        base: 0,
        size: 0,
        at: 0,
    };
    let mut walk = Walk {
        h2,
        direction,
        moment,
    };
    // SAFETY: `step` has the callback's signature; `walk` outlives the call.
    unsafe {
        bpf_loop(
            MAX_STEPS,
            step as *mut c_void,
            ptr::from_mut(&mut walk).cast(),
            0,
        );
    }
    match cursor(walk.h2, direction).call.outcome {
        GOING => Err(LossSource::Http2FrameBound),
        DONE => Ok(cursor(walk.h2, direction).call.answered),
        UNREADABLE => Err(LossSource::Http2Unreadable),
        // UNPARSABLE, the only other value `step` stores.
        _ => Err(LossSource::Http2Unparsable),
    }
}

/// [`CallWalk::outcome`]s: the walk goes on (it ran out of steps if it ends so), is
/// done, or stopped where a buffer could not be read or a frame header made no sense.
const GOING: u32 = 0;
const DONE: u32 = 1;
const UNREADABLE: u32 = 2;
const UNPARSABLE: u32 = 3;

/// One call's bytes being walked: what stays the same for every step (the walk's
/// place is in the connection's cursor).
struct Walk<'a> {
    h2: &'a mut H2Conn,
    direction: Direction,
    moment: Moment,
}

/// `bpf_loop`'s callback: one step of the walk; 1 stops the loop.
extern "C" fn step(_index: u64, walk: *mut c_void) -> i64 {
    // SAFETY: the `Walk` that `follow` passed, alive for the whole loop.
    let walk = unsafe { &mut *walk.cast::<Walk<'_>>() };
    let outcome = match walk.step() {
        Ok(true) => return 0,
        Ok(false) => DONE,
        Err(stopped) => stopped,
    };
    cursor(walk.h2, walk.direction).call.outcome = outcome;
    1
}

impl Walk<'_> {
    /// Takes one step: skips a payload, moves to the next buffer, or reads (part of)
    /// a frame header or the preface and acts on a whole header. `false` once the
    /// call's bytes are all walked; the outcome that stopped it on an error.
    #[inline(always)]
    fn step(&mut self) -> Result<bool, u32> {
        let key = self.h2.key;
        let cursor = cursor(self.h2, self.direction);
        let call = &mut cursor.call;
        if call.done >= call.total {
            return Ok(false);
        }
        let left = call.total - call.done;
        // A payload passes by its length: no byte of it is read, so a payload that
        // no user buffer holds (sendfile) costs nothing. A header block handed to
        // user space is read below, where its buffer is found.
        if cursor.payload_left > 0 && cursor.block == 0 {
            let skipped = cursor.payload_left.min(left);
            cursor.payload_left -= skipped;
            call.done += skipped;
            call.at += u64::from(skipped);
            return Ok(true);
        }
        // A header (or the preface) begins here: find the buffer that holds it, one
        // step per buffer passed.
        let source = if call.found != 0 {
            // Its first buffer was found and kept (`call.base`, `call.size`): only
            // an iovec array's next ones are looked up again.
            Source {
                base: call.source,
                iovecs: call.iovecs,
                size: call.size,
            }
        } else {
            let found = Source::of_current_call().ok_or(UNREADABLE)?;
            (call.base, call.size) = found.buffer(0).ok_or(UNREADABLE)?;
            (call.found, call.source, call.iovecs) = (1, found.base, found.iovecs);
            found
        };
        if call.at >= call.size {
            call.at -= call.size;
            call.buffer += 1;
            (call.base, call.size) = source.buffer(call.buffer).ok_or(UNREADABLE)?;
            return Ok(true);
        }
        let in_buffer = call.size - call.at;
        if cursor.payload_left > 0 {
            let take = cursor
                .payload_left
                .min(left)
                .min(in_buffer.min(H2_BLOCK_BYTES as u64) as u32);
            let sent = self.direction == Direction::Sent;
            blocks::hand_over(cursor, key, self.moment.service, sent, take);
            cursor.payload_left -= take;
            cursor.call.done += take;
            cursor.call.at += u64::from(take);
            return Ok(true);
        }
        let want = if cursor.preface_left > 0 {
            cursor.preface_left
        } else {
            H2_FRAME_HEADER - cursor.have
        };
        // Whole (a header, the preface) in one read of a constant size, else a byte
        // a step (a header split across buffers or calls: rare): the verifier takes
        // a helper's size as it is, and one that varied would multiply its states.
        let from = call.base + call.at;
        let take = if cursor.have == 0 && want <= left && u64::from(want) <= in_buffer {
            let read = if want == H2_FRAME_HEADER {
                read_user::<[u8; H2_FRAME_HEADER as usize]>(from)
                    .map(|header| cursor.bytes[..9].copy_from_slice(&header))
            } else {
                read_user::<[u8; 24]>(from)
                    .map(|preface| cursor.bytes[..24].copy_from_slice(&preface))
            };
            read.ok_or(UNREADABLE)?;
            want
        } else {
            let byte = read_user::<u8>(from).ok_or(UNREADABLE)?;
            let slot = cursor
                .bytes
                .get_mut((cursor.have & 31) as usize)
                .ok_or(UNPARSABLE)?;
            *slot = byte;
            1
        };
        cursor.have += take;
        call.done += take;
        call.at += u64::from(take);
        if cursor.preface_left > 0 {
            cursor.preface_left -= take;
            if !preface_prefix(&cursor.bytes, cursor.have) {
                return Err(UNPARSABLE);
            }
            if cursor.preface_left == 0 {
                cursor.have = 0;
            }
            return Ok(true);
        }
        if cursor.have < H2_FRAME_HEADER {
            return Ok(true);
        }
        cursor.have = 0;
        let frame = Frame::of(&cursor.bytes);
        if !frame.well_formed(cursor.frames == 0) {
            return Err(UNPARSABLE);
        }
        cursor.frames = cursor.frames.saturating_add(1);
        cursor.payload_left = frame.length;
        // The payload of the server's SETTINGS (its stream limit) and GOAWAY (the
        // last stream it processes), where it is whole in this buffer: nearly
        // always, a small frame.
        let payload_at = (frame.length <= call.total - call.done
            && u64::from(frame.length) <= call.size - call.at)
            .then_some(call.base + call.at);
        blocks::frame_begins(cursor, &frame, self.moment.service);
        match self.direction {
            Direction::Received => received(self.h2, &frame, &self.moment),
            Direction::Sent => {
                match (frame.kind, payload_at) {
                    (SETTINGS, Some(at)) if frame.flags & ACK == 0 => {
                        settings(self.h2, at, frame.length, self.moment.service);
                    }
                    (GOAWAY, Some(at)) => goaway(self.h2, at, self.moment.service),
                    _ => {}
                }
                if sent(self.h2, &frame, &self.moment) {
                    self.h2.send.call.answered += 1;
                }
            }
        }
        Ok(true)
    }
}

/// A write of `len` bytes before connection `conn` read anything (`Unserved`): an
/// HTTP/2 server may send its SETTINGS at once (gRPC does), before the client's
/// preface tells that the connection is HTTP/2. Its stream limit is kept in the
/// connection's entry for [`opens`].
#[inline(never)]
pub fn greeting(conn: &mut Conn, len: i32) {
    // What `opens` takes as sent before the preface, where the write's transmit is
    // seen only later (tcp backend) or not at all.
    conn.greeted = 1;
    if len < H2_FRAME_HEADER as i32 || conn.greeting_limit_set != 0 {
        return;
    }
    let Some((base, _)) = Source::of_current_call().and_then(|source| source.buffer(0)) else {
        return;
    };
    let Some(header) = read_user::<[u8; H2_FRAME_HEADER as usize]>(base) else {
        return;
    };
    let mut bytes = [0u8; 32];
    bytes[..9].copy_from_slice(&header);
    let frame = Frame::of(&bytes);
    if frame.kind != SETTINGS
        || frame.flags & ACK != 0
        || !frame.well_formed(true)
        || frame.length > len as u32 - H2_FRAME_HEADER
    {
        return;
    }
    if let Some(limit) = announced_limit(base + u64::from(H2_FRAME_HEADER), frame.length) {
        conn.greeting_limit = limit;
        conn.greeting_limit_set = 1;
    }
}
