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
