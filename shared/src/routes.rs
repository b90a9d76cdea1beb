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

/// A record of [`maps::ROUTE_EVENTS`]: one finished request (HTTP/2 streams too, with
/// no line).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteEvent {
    pub service: u32,
    /// Its final answer's status (0: not read).
    pub status: u16,
    /// How many bytes of `line` were read (0: none, the route is unknown).
    pub line_len: u16,
    /// start − arrive
    pub queue_ns: u64,
    /// end − start
    pub duration_ns: u64,
    pub line: RouteLine,
}

const _: () = assert!(core::mem::size_of::<RouteEvent>() == 24 + ROUTE_BYTES);
