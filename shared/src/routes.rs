//! A finished HTTP/1 request as the kernel programs hand it to user space for its
//! route (DESIGN §3): the first bytes its server read (method and path), its answer's
//! status, its queue time and duration. User space names, folds and caps the routes
//! (`exporter/src/routes.rs`); the kernel keeps no per-route state.
#[cfg(doc)]
use crate::maps;

/// Bytes of a request's first read kept for its route: the method, a space and a path
/// of up to ~90 bytes; a longer path is cut (user space marks it).
pub const ROUTE_BYTES: usize = 96;

/// A request's first bytes, in memory order, as 8-byte words: a copy of words is a
/// dozen loads and stores, one of bytes a loop that 6.1's verifier walks byte by
/// byte (and refuses).
pub type RouteLine = [u64; ROUTE_BYTES / 8];

/// The bytes of `line`, in the order they were read.
pub fn route_line_bytes(line: &RouteLine) -> [u8; ROUTE_BYTES] {
    let mut bytes = [0; ROUTE_BYTES];
    for (to, word) in bytes.chunks_exact_mut(8).zip(line) {
        to.copy_from_slice(&word.to_ne_bytes());
    }
    bytes
}

/// The line of a request whose first read was `bytes` (as many as fit), and how
/// many it holds.
pub fn route_line_of(bytes: &[u8]) -> (RouteLine, u16) {
    let mut line = [0; ROUTE_BYTES / 8];
    let mut kept = 0;
    for (word, chunk) in line.iter_mut().zip(bytes.chunks(8)) {
        let mut word_bytes = [0; 8];
        for (to, from) in word_bytes.iter_mut().zip(chunk) {
            *to = *from;
        }
        *word = u64::from_ne_bytes(word_bytes);
        kept += chunk.len();
    }
    (line, kept as u16)
}

/// What a record of [`maps::ROUTE_EVENTS`] is: its first `u32`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteRecord {
    /// A [`RouteEvent`].
    Finished = 1,
    /// An [`H2Block`] holding part of a header block.
    H2Block = 2,
    /// An [`H2Block`] with no bytes: its connection is closed or no longer followed,
    /// and its header tables go.
    H2Gone = 3,
}

/// A record of [`maps::ROUTE_EVENTS`]: one finished request. An HTTP/1 request has
/// its first bytes; an HTTP/2 stream names its connection and id instead, whose
/// header blocks ([`H2Block`]) came before it in the ring, or come right after it
/// where the server's last frame was a HEADERS (`h2_trailers`: trailers).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteEvent {
    /// [`RouteRecord::Finished`].
    pub record: u32,
    pub service: u32,
    /// Its final answer's status (0: not read).
    pub status: u16,
    /// How many bytes of `line` were read (0: none, the route is unknown).
    pub line_len: u16,
    /// HTTP/2: the stream's id (0: an HTTP/1 request).
    pub h2_stream: u32,
    /// HTTP/2: the connection ([`H2Block::conn`]).
    pub h2_conn: u64,
    /// start − arrive
    pub queue_ns: u64,
    /// end − start
    pub duration_ns: u64,
    pub line: RouteLine,
    /// HTTP/2: 1 if the server's END_STREAM was on a HEADERS frame, whose block (the
    /// trailers, gRPC's status) follows this record.
    pub h2_trailers: u32,
    pub padding: u32,
}

const _: () = assert!(core::mem::size_of::<RouteEvent>() == 48 + ROUTE_BYTES);

impl RouteEvent {
    /// The record of an HTTP/1 request of `service` whose first bytes were `line`.
    pub fn request(
        service: u32,
        status: u16,
        line: &[u8],
        queue_ns: u64,
        duration_ns: u64,
    ) -> Self {
        let (line, line_len) = route_line_of(line);
        Self {
            record: RouteRecord::Finished as u32,
            service,
            status,
            line_len,
            h2_stream: 0,
            h2_conn: 0,
            queue_ns,
            duration_ns,
            line,
            h2_trailers: 0,
            padding: 0,
        }
    }
}

/// Bytes of a header block one [`H2Block`] carries: a block is cut into records of
/// up to this many (one, for most blocks after the first of a connection).
pub const H2_BLOCK_BYTES: usize = 256;

/// A record of [`maps::ROUTE_EVENTS`]: `len` bytes, at offset `at` of the payload of
/// a HEADERS, PUSH_PROMISE or CONTINUATION frame (`frame_len` bytes in all), on an
/// HTTP/2 connection whose service's routes are read. User space decodes each
/// direction's header blocks with that direction's HPACK table, in the order the
/// records come (the frames' order on the connection: one thread at a time reads, or
/// writes, a socket, and its record is reserved before the call returns).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct H2Block {
    /// [`RouteRecord::H2Block`] or [`RouteRecord::H2Gone`].
    pub record: u32,
    pub service: u32,
    /// The connection: when it was found HTTP/2 (ns) and the CPU that found it, a key
    /// that a later connection on the same socket does not share.
    pub conn: u64,
    /// The frame's stream id, type and flags, and 1 if the server sent it.
    pub stream: u32,
    pub kind: u8,
    pub flags: u8,
    pub sent: u8,
    pub padding: u8,
    /// Records of this direction so far (this one included): a gap says one was lost.
    pub sequence: u32,
    pub frame_len: u32,
    pub at: u32,
    pub len: u32,
    pub bytes: [u8; H2_BLOCK_BYTES],
}

const _: () = assert!(core::mem::size_of::<H2Block>() == 40 + H2_BLOCK_BYTES);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_keeps_its_bytes_in_order_up_to_its_size() {
        let (line, kept) = route_line_of(b"GET /users/42 HTTP/1.1");
        assert_eq!(kept, 22);
        assert_eq!(&route_line_bytes(&line)[..22], b"GET /users/42 HTTP/1.1");
        let long = [b'x'; 200];
        let (line, kept) = route_line_of(&long);
        assert_eq!(usize::from(kept), ROUTE_BYTES);
        assert_eq!(route_line_bytes(&line), [b'x'; ROUTE_BYTES]);
    }
}
