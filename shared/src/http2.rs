//! HTTP/2 connections followed frame by frame (socket backend, DESIGN §3): the state
//! kept in each such socket ([`maps::H2_CONNS`]) and the constants of the frame
//! stream that both sides read.
#[cfg(doc)]
use crate::{Conn, Phase, maps};

/// The client connection preface (RFC 9113 §3.4): a connection whose first bytes are
/// these is followed as HTTP/2.
pub const H2_PREFACE: [u8; 24] = *b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Bytes of a frame header: length (24 bits), type, flags, stream id (31 bits).
pub const H2_FRAME_HEADER: u32 = 9;
/// Streams of one connection followed at once, in slots indexed by client stream id
/// (`id / 2 mod` this): a stream that opens while the one 256 ids before it is still
/// open is not followed (counted in `events_lost_total{source="http2_stream_slots"}`).
pub const H2_STREAM_SLOTS: u32 = 128;

/// The slot of client stream `id` in [`H2Conn::streams`].
pub const fn h2_stream_slot(id: u32) -> usize {
    ((id >> 1) & (H2_STREAM_SLOTS - 1)) as usize
}

/// One direction of a connection's byte stream: where it stands between frames.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameCursor {
    /// Bytes of the current frame's payload not seen yet (skipped as they pass).
    pub payload_left: u32,
    /// Bytes of the preface (until it is whole) or of the next frame header gathered
    /// so far in [`FrameCursor::bytes`]: a header may span reads, writes and buffers.
    pub have: u32,
    /// Bytes of the client preface still to come (receive side; 0 once it is whole).
    pub preface_left: u32,
    /// Frames seen, capped: the first of each side must be SETTINGS.
    pub frames: u32,
    pub bytes: [u8; 32],
    /// 1 while the current frame's payload is a header block handed to user space
    /// (its service's routes are read), and that frame's stream, type and flags.
    pub block: u32,
    pub block_stream: u32,
    pub block_kind: u32,
    pub block_flags: u32,
    /// Its length, and [`crate::H2Block`] records of this direction so far.
    pub block_len: u32,
    pub block_records: u32,
    /// The call being walked: kept here, where the verifier does not track values,
    /// rather than on the stack, where it would tell every step's state apart.
    pub call: CallWalk,
}

/// Where the walk through one read's or write's bytes stands.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallWalk {
    /// Bytes the call moved, and those walked so far.
    pub total: u32,
    pub done: u32,
    /// How the walk of the call ended: the constants of `h2.rs` (going, done, a
    /// buffer unreadable, a frame header unparsable).
    pub outcome: u32,
    /// Whether the call's buffers were found (at its first frame header).
    pub found: u32,
    /// Streams the call's frames answered (server END_STREAMs that ended one); kept
    /// here, not on the walk's stack, where a count would give the verifier a new
    /// state at every step.
    pub answered: u32,
    /// The call's buffer, or its iovec array and their count (0 for one buffer).
    pub source: u64,
    pub iovecs: u64,
    /// The buffer the walk is in: its index, address and length, and the offset in it.
    pub buffer: u64,
    pub base: u64,
    pub size: u64,
    pub at: u64,
}

/// A stream in flight, in its slot of [`H2Conn::streams`]; `id` 0 if the slot is free.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct H2Stream {
    /// 64 bits: the connection's reader and writer may end it on two CPUs at once, and
    /// the BPF target's compare-and-swap is 64-bit.
    pub id: u64,
    /// When the bytes of its HEADERS arrived (`sk_data_ready`), else when read.
    pub arrive_ns: u64,
    /// When the server read its HEADERS.
    pub start_ns: u64,
}

/// Value of [`maps::H2_CONNS`]: made zeroed when a connection's first bytes are the
/// preface; its [`Conn`] in `SOCK_CONNS` is then [`Phase::Multiplexed`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct H2Conn {
    /// Client to server.
    pub recv: FrameCursor,
    /// Server to client.
    pub send: FrameCursor,
    /// 1 + the [`crate::LossSource`] that stopped the following of this connection
    /// (0 while followed): it counts nothing more.
    pub lost: u32,
    /// The highest client stream id opened: a HEADERS frame on a higher odd id opens
    /// a stream, one on a lower id carries trailers.
    pub last_stream: u32,
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` as the server announced it (0: not seen).
    pub max_streams: u32,
    /// 1 + the last stream id of the server's GOAWAY (0: none sent): streams above
    /// it were not and will not be processed.
    pub goaway: u32,
    /// The connection's key in user space's records ([`crate::H2Block::conn`]).
    pub key: u64,
    /// Streams in flight (slots in use). Changed by atomic adds only: a server may
    /// read on one thread and write on another (grpc-go does), so two CPUs open and
    /// end its streams at once.
    pub open: u64,
    /// 1 while the connection is counted at the server's stream limit (in
    /// `at_limit_entered` and not yet in `at_limit_left`); set by compare-and-swap, so
    /// that of two CPUs that see the connection reach or leave the limit one counts it.
    pub at_limit: u64,
    /// When request bytes arrived unread (0 if none since the last read): set by the
    /// arrival's softirq, taken by a read with one atomic exchange.
    pub arrived_ns: u64,
    pub streams: [H2Stream; H2_STREAM_SLOTS as usize],
}

const _: () = assert!(core::mem::size_of::<CallWalk>() == 72);
const _: () = assert!(core::mem::size_of::<FrameCursor>() == 72 + 72);
const _: () = assert!(core::mem::size_of::<H2Stream>() == 24);
const _: () =
    assert!(core::mem::size_of::<H2Conn>() == 2 * (72 + 72) + 48 + H2_STREAM_SLOTS as usize * 24);
const _: () = assert!(H2_STREAM_SLOTS.is_power_of_two());
