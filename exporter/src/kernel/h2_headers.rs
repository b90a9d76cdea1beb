//! HTTP/2 routes and statuses (DESIGN §3), the user-space half of the kernel's header
//! block records (`exporter-ebpf/src/h2/blocks.rs`): each connection's two HPACK
//! tables, fed every header block in the order the connection carried it, give each
//! stream its `:method` and `:path` (the client's HEADERS), its final `:status` and,
//! for gRPC, its `grpc-status` (the server's HEADERS or trailers). A stream the kernel
//! records as finished is then named like an HTTP/1 request.
//!
//! HPACK cannot skip a block: one lost record (a gap in a direction's sequence, a ring
//! with no room), a block that does not decode, or a connection first seen after its
//! first block leaves that direction unreadable for the rest of the connection. Its
//! streams count under the route `unknown` (and the status class `unknown`), and the
//! loss is counted per service ([`H2Headers::lost`]): a partial count, never a wrong
//! name.
use std::collections::{BTreeMap, HashMap};

use loona_hpack::Decoder;
use poolscope_shared::{H2Block, RouteEvent, RouteRecord};

use super::route_table::{Answer, Finished, GRPC_STATUS_UNREAD, RouteTable};

/// Frame types and flags (RFC 9113 §6).
const HEADERS: u8 = 1;
const PUSH_PROMISE: u8 = 5;
const CONTINUATION: u8 = 9;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;

/// Largest header block decoded (nginx's default `large_client_header_buffers` is
/// 32 KiB; a block past this is a lost direction, not memory).
const MAX_BLOCK_BYTES: usize = 256 * 1024;
/// Largest dynamic table a peer may ask for: RFC 9113's default is 4 KiB, and a table
/// beyond this is a lost direction.
const MAX_TABLE_BYTES: usize = 64 * 1024;
/// Streams of one connection whose request headers are kept until their end: a
/// stream reset by the client is never recorded finished, and the oldest go first.
const MAX_STREAMS_PER_CONNECTION: usize = 1024;

/// Why a direction of a connection can no longer be decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Lost {
    /// A record missing (the ring had no room, a buffer could not be read), or the
    /// connection first seen after its first block.
    Gap,
    /// A block HPACK refused, or frames that do not add up to one.
    Undecodable,
    /// More connections than `[limits] http2_connections_decoded` at once.
    Untracked,
}

impl Lost {
    pub fn label(self) -> &'static str {
        match self {
            Self::Gap => "gap",
            Self::Undecodable => "undecodable",
            Self::Untracked => "untracked",
        }
    }
}

/// What a stream's header blocks said.
#[derive(Debug, Default)]
struct StreamHeaders {
    /// `:method`, a space, `:path` and a space: the request line `route_label` reads.
    line: Option<Vec<u8>>,
    /// Its request's `content-type` is gRPC's.
    grpc: bool,
    /// Its final `:status` (0: none read).
    status: u16,
    /// Its `grpc-status`, if read.
    grpc_status: Option<u8>,
}

/// One direction of a connection: its HPACK table and the block being gathered.
struct Side {
    /// `None` once the direction cannot be decoded.
    decoder: Option<Decoder<'static>>,
    /// The last record's sequence number.
    sequence: u32,
    /// The current frame's payload so far.
    frame: Vec<u8>,
    /// The header block being gathered (HEADERS or PUSH_PROMISE, then CONTINUATIONs),
    /// its stream and first frame's type.
    block: Vec<u8>,
    block_stream: u32,
    block_kind: u8,
    block_open: bool,
}

impl Side {
    fn new() -> Self {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(MAX_TABLE_BYTES);
        Self {
            decoder: Some(decoder),
            sequence: 0,
            frame: Vec::new(),
            block: Vec::new(),
            block_stream: 0,
            block_kind: 0,
            block_open: false,
        }
    }

    /// Takes record `block`; a whole header block's fields (its stream and first
    /// frame's type), or the loss that ends this direction.
    fn take(&mut self, block: &H2Block) -> Result<Option<(u32, u8, Fields)>, Lost> {
        if self.decoder.is_none() {
            return Ok(None);
        }
        if block.sequence != self.sequence.wrapping_add(1) {
            return Err(Lost::Gap);
        }
        self.sequence = block.sequence;
        let bytes = block
            .bytes
            .get(..block.len as usize)
            .ok_or(Lost::Undecodable)?;
        if block.at == 0 {
            self.frame.clear();
        } else if block.at as usize != self.frame.len() {
            return Err(Lost::Gap);
        }
        if self.frame.len() + bytes.len() > MAX_BLOCK_BYTES {
            return Err(Lost::Undecodable);
        }
        self.frame.extend_from_slice(bytes);
        if self.frame.len() < block.frame_len as usize {
            return Ok(None);
        }
        let fragment = fragment(&self.frame, block.kind, block.flags).ok_or(Lost::Undecodable)?;
        match block.kind {
            HEADERS | PUSH_PROMISE if !self.block_open => {
                self.block.clear();
                self.block_stream = block.stream;
                self.block_kind = block.kind;
                self.block_open = true;
            }
            CONTINUATION if self.block_open && self.block_stream == block.stream => {}
            _ => return Err(Lost::Undecodable),
        }
        if self.block.len() + fragment.len() > MAX_BLOCK_BYTES {
            return Err(Lost::Undecodable);
        }
        self.block.extend_from_slice(fragment);
        if block.flags & END_HEADERS == 0 {
            return Ok(None);
        }
        self.block_open = false;
        let decoder = self.decoder.as_mut().ok_or(Lost::Undecodable)?;
        let fields = Fields::decode(decoder, &self.block).ok_or(Lost::Undecodable)?;
        Ok(Some((self.block_stream, self.block_kind, fields)))
    }
}

/// The header block fragment of a whole frame `payload` of type `kind` with `flags`:
/// without its padding, priority or promised stream id.
fn fragment(payload: &[u8], kind: u8, flags: u8) -> Option<&[u8]> {
    if kind == CONTINUATION {
        return Some(payload);
    }
    let (padding, mut start) = if flags & PADDED != 0 {
        (usize::from(*payload.first()?), 1)
    } else {
        (0, 0)
    };
    if kind == HEADERS && flags & PRIORITY != 0 {
        start += 5;
    }
    if kind == PUSH_PROMISE {
        start += 4;
    }
    payload.get(start..payload.len().checked_sub(padding)?)
}

/// The fields of a header block that name a route and its answer.
#[derive(Debug, Default)]
struct Fields {
    method: Option<Vec<u8>>,
    path: Option<Vec<u8>>,
    grpc: bool,
    status: Option<u16>,
    grpc_status: Option<u8>,
}

impl Fields {
    /// Decodes `block` with `decoder` (which it changes, as HPACK does); `None` if it
    /// does not decode.
    fn decode(decoder: &mut Decoder<'static>, block: &[u8]) -> Option<Self> {
        let mut fields = Self::default();
        let number = |value: &[u8]| std::str::from_utf8(value).ok()?.parse::<u32>().ok();
        decoder
            .decode_with_cb(block, |name, value| match &*name {
                b":method" => fields.method = Some(value.into_owned()),
                b":path" => fields.path = Some(value.into_owned()),
                b":status" => fields.status = number(&value).and_then(|s| u16::try_from(s).ok()),
                b"content-type" => fields.grpc = value.starts_with(b"application/grpc"),
                b"grpc-status" => {
                    fields.grpc_status = Some(number(&value).map_or(GRPC_STATUS_UNREAD, |code| {
                        u8::try_from(code)
                            .unwrap_or(GRPC_STATUS_UNREAD)
                            .min(GRPC_STATUS_UNREAD)
                    }));
                }
                _ => {}
            })
            .ok()?;
        Some(fields)
    }
}

/// A connection's two directions and its streams' headers.
struct Connection {
    service: u32,
    received: Side,
    sent: Side,
    streams: BTreeMap<u32, StreamHeaders>,
}

/// A stream recorded finished by a HEADERS frame whose block (its trailers) comes
/// after the record: named once the block is decoded, or after one more drain.
struct Awaiting {
    conn: u64,
    event: RouteEvent,
    drains: u32,
}

/// The header tables of every followed HTTP/2 connection whose service's routes are
/// read.
pub struct H2Headers {
    connections: HashMap<u64, Connection>,
    /// At most this many connections at once.
    cap: usize,
    awaiting: Vec<Awaiting>,
    /// Directions lost, per service and reason.
    lost: BTreeMap<(u32, Lost), u64>,
}

impl H2Headers {
    pub fn new(cap: usize) -> Self {
        Self {
            connections: HashMap::new(),
            cap,
            awaiting: Vec::new(),
            lost: BTreeMap::new(),
        }
    }

    /// Directions whose headers were lost, per service and reason.
    pub fn lost(&self, service: u32) -> BTreeMap<Lost, u64> {
        self.lost
            .range((service, Lost::Gap)..=(service, Lost::Untracked))
            .map(|(&(_, lost), &count)| (lost, count))
            .collect()
    }

    /// Forgets what was counted of `service` (its id is to be reused).
    pub fn reset_service(&mut self, service: u32) {
        self.lost.retain(|&(of, _), _| of != service);
    }

    /// Takes one header block record.
    pub fn block(&mut self, block: &H2Block, table: &mut RouteTable) {
        if block.record == RouteRecord::H2Gone as u32 {
            self.gone(block.conn, table);
            return;
        }
        if !self.connections.contains_key(&block.conn) {
            if self.connections.len() >= self.cap {
                // Counted once, at its first block.
                if block.sequence == 1 && block.at == 0 {
                    *self
                        .lost
                        .entry((block.service, Lost::Untracked))
                        .or_default() += 1;
                }
                return;
            }
            let mut connection = Connection {
                service: block.service,
                received: Side::new(),
                sent: Side::new(),
                streams: BTreeMap::new(),
            };
            // Routes read from the middle of a connection: its tables are unknown.
            if block.sequence != 1 {
                lose(&mut self.lost, &mut connection, block.sent != 0, Lost::Gap);
            }
            self.connections.insert(block.conn, connection);
        }
        let Some(connection) = self.connections.get_mut(&block.conn) else {
            return;
        };
        let sent = block.sent != 0;
        let side = if sent {
            &mut connection.sent
        } else {
            &mut connection.received
        };
        let (stream, kind, fields) = match side.take(block) {
            Ok(Some(whole)) => whole,
            Ok(None) => return,
            Err(lost) => {
                lose(&mut self.lost, connection, sent, lost);
                return;
            }
        };
        if kind != HEADERS {
            // A pushed request's headers: decoded only for the table.
            return;
        }
        if !sent {
            // The block that opens a stream; the client's trailers find it there.
            if connection.streams.contains_key(&stream) {
                return;
            }
            if connection.streams.len() >= MAX_STREAMS_PER_CONNECTION {
                connection.streams.pop_first();
            }
            let line = fields.method.zip(fields.path).map(|(method, path)| {
                let mut line = method;
                line.push(b' ');
                line.extend_from_slice(&path);
                line.push(b' ');
                line
            });
            connection.streams.insert(
                stream,
                StreamHeaders {
                    line,
                    grpc: fields.grpc,
                    ..StreamHeaders::default()
                },
            );
            return;
        }
        let headers = connection.streams.entry(stream).or_default();
        // An interim answer (1xx) is not the final status.
        if let Some(status) = fields.status.filter(|&status| status >= 200) {
            headers.status = status;
        }
        if fields.grpc_status.is_some() {
            headers.grpc_status = fields.grpc_status;
        }
        let conn = block.conn;
        if let Some(at) = self
            .awaiting
            .iter()
            .position(|awaiting| awaiting.conn == conn && awaiting.event.h2_stream == stream)
        {
            let awaiting = self.awaiting.swap_remove(at);
            self.name(&awaiting.event, table);
        }
    }

    /// Takes a finished stream's record: named now, or once its trailers' block comes.
    pub fn finished(&mut self, event: &RouteEvent, table: &mut RouteTable) {
        let readable = self
            .connections
            .get(&event.h2_conn)
            .is_some_and(|connection| connection.sent.decoder.is_some());
        if event.h2_trailers != 0 && readable {
            self.awaiting.push(Awaiting {
                conn: event.h2_conn,
                event: *event,
                drains: 0,
            });
        } else {
            self.name(event, table);
        }
    }

    /// The end of a drain: streams that waited a whole drain for their trailers are
    /// named with what is known.
    pub fn drained(&mut self, table: &mut RouteTable) {
        let (due, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.awaiting)
            .into_iter()
            .partition(|awaiting| awaiting.drains >= 1);
        self.awaiting = waiting;
        for awaiting in &mut self.awaiting {
            awaiting.drains += 1;
        }
        for awaiting in due {
            self.name(&awaiting.event, table);
        }
    }

    /// Connection `conn` is closed: its streams awaiting trailers are named, and its
    /// tables go.
    fn gone(&mut self, conn: u64, table: &mut RouteTable) {
        let (due, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.awaiting)
            .into_iter()
            .partition(|awaiting| awaiting.conn == conn);
        self.awaiting = waiting;
        for awaiting in due {
            self.name(&awaiting.event, table);
        }
        self.connections.remove(&conn);
    }

    /// Counts finished stream `event` under what its headers said.
    fn name(&mut self, event: &RouteEvent, table: &mut RouteTable) {
        let headers = self
            .connections
            .get_mut(&event.h2_conn)
            .and_then(|connection| connection.streams.remove(&event.h2_stream))
            .unwrap_or_default();
        let finished = Finished {
            answer: Answer {
                status: headers.status,
                grpc: headers
                    .grpc
                    .then(|| headers.grpc_status.unwrap_or(GRPC_STATUS_UNREAD)),
            },
            queue_ns: event.queue_ns,
            duration_ns: event.duration_ns,
        };
        table.add_line(event.service, headers.line.as_deref(), &finished);
    }
}

/// Direction `sent` (or received) of `connection` can no longer be decoded.
fn lose(lost: &mut BTreeMap<(u32, Lost), u64>, connection: &mut Connection, sent: bool, why: Lost) {
    let side = if sent {
        &mut connection.sent
    } else {
        &mut connection.received
    };
    if side.decoder.take().is_some() {
        side.frame = Vec::new();
        side.block = Vec::new();
        *lost.entry((connection.service, why)).or_default() += 1;
    }
}
