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
use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use poolscope_shared::{H2Block, RouteEvent, RouteRecord};

use super::route_table::{Answer, Finished, GRPC_STATUS_UNREAD, RouteTable};
use crate::hpack::Decoder;

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
/// How long a stream recorded finished by a HEADERS frame waits for that frame's
/// block (its trailers): the kernel hands it over right after the record, in the same
/// program run unless the frame's payload comes in the server's next write.
const TRAILERS_WAIT: Duration = Duration::from_millis(200);
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
    decoder: Option<Decoder>,
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
        Self {
            decoder: Some(Decoder::new(MAX_TABLE_BYTES)),
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
    fn decode(decoder: &mut Decoder, block: &[u8]) -> Option<Self> {
        let mut fields = Self::default();
        let number = |value: &[u8]| std::str::from_utf8(value).ok()?.parse::<u32>().ok();
        let wanted = |name: &[u8]| {
            matches!(
                name,
                b":method" | b":path" | b":status" | b"content-type" | b"grpc-status"
            )
        };
        decoder
            .decode(block, wanted, |name, value| match name {
                b":method" => fields.method = Some(value.to_vec()),
                b":path" => fields.path = Some(value.to_vec()),
                b":status" => fields.status = number(value).and_then(|s| u16::try_from(s).ok()),
                b"content-type" => fields.grpc = value.starts_with(b"application/grpc"),
                b"grpc-status" => {
                    fields.grpc_status = Some(number(value).map_or(GRPC_STATUS_UNREAD, |code| {
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
/// after the record: named once the block is decoded, or after [`TRAILERS_WAIT`].
struct Awaiting {
    conn: u64,
    event: RouteEvent,
    since: Instant,
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
                since: Instant::now(),
            });
        } else {
            self.name(event, table);
        }
    }

    /// The end of a drain at `now`: streams that waited [`TRAILERS_WAIT`] for their
    /// trailers are named with what is known.
    pub fn drained(&mut self, now: Instant, table: &mut RouteTable) {
        let (due, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.awaiting)
            .into_iter()
            .partition(|awaiting| now.duration_since(awaiting.since) >= TRAILERS_WAIT);
        self.awaiting = waiting;
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

#[cfg(test)]
mod tests {
    use loona_hpack::Encoder;
    use poolscope_shared::{H2_BLOCK_BYTES, StatusClass};
    use proptest::prelude::*;

    use super::*;
    use crate::kernel::route_table::{GRPC_STATUSES, RouteCaps, RouteLabel, RouteTotals};

    const CONN: u64 = 77;
    const SERVICE: u32 = 3;

    /// One direction of a test connection: its encoder and record sequence.
    struct Peer {
        encoder: Encoder<'static>,
        sent: bool,
        sequence: u32,
    }

    impl Peer {
        fn new(sent: bool) -> Self {
            Self {
                encoder: Encoder::new(),
                sent,
                sequence: 0,
            }
        }

        fn encode(&mut self, fields: &[(&str, &str)]) -> Vec<u8> {
            self.encoder
                .encode(fields.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())))
        }

        /// The records of a frame whose payload is `payload`, as the kernel cuts it.
        fn frame(&mut self, stream: u32, kind: u8, flags: u8, payload: &[u8]) -> Vec<H2Block> {
            payload
                .chunks(H2_BLOCK_BYTES)
                .enumerate()
                .map(|(index, chunk)| {
                    self.sequence += 1;
                    let mut bytes = [0; H2_BLOCK_BYTES];
                    bytes[..chunk.len()].copy_from_slice(chunk);
                    H2Block {
                        record: RouteRecord::H2Block as u32,
                        service: SERVICE,
                        conn: CONN,
                        stream,
                        kind,
                        flags,
                        sent: u8::from(self.sent),
                        padding: 0,
                        sequence: self.sequence,
                        frame_len: payload.len() as u32,
                        at: (index * H2_BLOCK_BYTES) as u32,
                        len: chunk.len() as u32,
                        bytes,
                    }
                })
                .collect()
        }

        /// The records of one HEADERS frame holding `fields` whole.
        fn headers(&mut self, stream: u32, fields: &[(&str, &str)]) -> Vec<H2Block> {
            let block = self.encode(fields);
            self.frame(stream, HEADERS, END_HEADERS, &block)
        }
    }

    fn finished(stream: u32, trailers: bool) -> RouteEvent {
        RouteEvent {
            h2_stream: stream,
            h2_conn: CONN,
            h2_trailers: u32::from(trailers),
            ..RouteEvent::request(SERVICE, 0, b"", 1_000, 2_000)
        }
    }

    fn table() -> RouteTable {
        RouteTable::new(RouteCaps {
            per_service: 10,
            total: 10,
        })
    }

    fn feed(h2: &mut H2Headers, table: &mut RouteTable, blocks: Vec<H2Block>) {
        for block in blocks {
            h2.block(&block, table);
        }
    }

    fn route(table: &RouteTable, method: &str, route: &str) -> RouteTotals {
        let label: RouteLabel = (method.to_owned(), route.to_owned());
        table.service(SERVICE).remove(&label).unwrap_or_default()
    }

    fn class(status: u16) -> usize {
        StatusClass::index_of(status)
    }

    fn code(name: &str) -> u8 {
        GRPC_STATUSES
            .iter()
            .position(|&known| known == name)
            .unwrap_or(99) as u8
    }

    #[test]
    fn grpc_calls_are_named_by_path_status_and_trailers_across_indexed_blocks() {
        let (mut client, mut server) = (Peer::new(false), Peer::new(true));
        let (mut h2, mut table) = (H2Headers::new(16), table());
        let request = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/pkg.Svc/Get"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ];
        for (stream, status) in [(1, "14"), (3, "0"), (5, "0")] {
            feed(&mut h2, &mut table, client.headers(stream, &request));
            feed(
                &mut h2,
                &mut table,
                server.headers(stream, &[(":status", "200")]),
            );
            // The kernel's record of the END_STREAM comes before its trailers' block.
            h2.finished(&finished(stream, true), &mut table);
            assert_eq!(
                route(&table, "POST", "/pkg.Svc/Get")
                    .grpc
                    .values()
                    .sum::<u64>(),
                u64::from(stream / 2)
            );
            feed(
                &mut h2,
                &mut table,
                server.headers(stream, &[("grpc-status", status)]),
            );
        }
        h2.drained(Instant::now(), &mut table);
        let totals = route(&table, "POST", "/pkg.Svc/Get");
        assert_eq!(
            totals.grpc.get(&(class(200), code("UNAVAILABLE"))),
            Some(&1)
        );
        assert_eq!(totals.grpc.get(&(class(200), code("OK"))), Some(&2));
        assert_eq!(totals.responses, [0; poolscope_shared::STATUS_CLASSES]);
        assert!(h2.lost(SERVICE).is_empty());
        // The encoder indexed the fields: the second request's block is smaller.
        let mut fresh = Peer::new(false);
        assert!(fresh.encode(&request).len() > client.encode(&request).len());
    }

    #[test]
    fn a_block_over_frames_and_records_with_padding_and_priority_decodes() {
        let (mut client, mut server) = (Peer::new(false), Peer::new(true));
        let (mut h2, mut table) = (H2Headers::new(16), table());
        let long = "x".repeat(600);
        let block = client.encode(&[
            (":method", "GET"),
            (":path", "/users/42?q=1"),
            ("cookie", &long),
        ]);
        let (first, rest) = block.split_at(block.len() / 2);
        // PADDED | PRIORITY: pad length, 5 priority bytes, the fragment, 3 pad bytes.
        let mut payload = vec![3, 0, 0, 0, 0, 16];
        payload.extend_from_slice(first);
        payload.extend_from_slice(&[0, 0, 0]);
        feed(
            &mut h2,
            &mut table,
            client.frame(1, HEADERS, PADDED | PRIORITY, &payload),
        );
        feed(
            &mut h2,
            &mut table,
            client.frame(1, CONTINUATION, END_HEADERS, rest),
        );
        let answer = server.encode(&[(":status", "503")]);
        feed(
            &mut h2,
            &mut table,
            server.frame(1, HEADERS, END_HEADERS, &answer),
        );
        h2.finished(&finished(1, false), &mut table);
        let totals = route(&table, "GET", "/users/:id");
        assert_eq!(
            totals.responses[class(503)],
            1,
            "{:?}",
            table.service(SERVICE)
        );
        assert!(totals.grpc.is_empty());
    }

    #[test]
    fn a_lost_record_loses_the_direction_counted_and_its_streams_go_unknown() {
        let (mut client, mut server) = (Peer::new(false), Peer::new(true));
        let (mut h2, mut table) = (H2Headers::new(16), table());
        let request = [(":method", "GET"), (":path", "/a")];
        feed(&mut h2, &mut table, client.headers(1, &request));
        // Stream 3's request block lost in the ring: a gap in the sequence.
        let _lost = client.headers(3, &request);
        feed(&mut h2, &mut table, client.headers(5, &request));
        for stream in [1, 3, 5] {
            feed(
                &mut h2,
                &mut table,
                server.headers(stream, &[(":status", "200")]),
            );
            h2.finished(&finished(stream, false), &mut table);
        }
        assert_eq!(route(&table, "GET", "/a").responses[class(200)], 1);
        assert_eq!(route(&table, "", "unknown").responses[class(200)], 2);
        assert_eq!(h2.lost(SERVICE), BTreeMap::from([(Lost::Gap, 1)]));
    }

    #[test]
    fn a_connection_first_seen_after_its_first_block_is_not_decoded() {
        let mut client = Peer::new(false);
        let (mut h2, mut table) = (H2Headers::new(16), table());
        let _before = client.headers(1, &[(":method", "GET"), (":path", "/a")]);
        feed(
            &mut h2,
            &mut table,
            client.headers(3, &[(":method", "GET"), (":path", "/a")]),
        );
        h2.finished(&finished(3, false), &mut table);
        assert_eq!(route(&table, "", "unknown").responses[class(0)], 1);
        assert_eq!(h2.lost(SERVICE), BTreeMap::from([(Lost::Gap, 1)]));
    }

    #[test]
    fn trailers_that_never_come_are_named_after_a_drain_and_gone_connections_go() {
        let (mut client, mut server) = (Peer::new(false), Peer::new(true));
        let (mut h2, mut table) = (H2Headers::new(1), table());
        let request = [
            (":method", "POST"),
            (":path", "/s/M"),
            ("content-type", "application/grpc"),
        ];
        feed(&mut h2, &mut table, client.headers(1, &request));
        feed(
            &mut h2,
            &mut table,
            server.headers(1, &[(":status", "200")]),
        );
        h2.finished(&finished(1, true), &mut table);
        h2.drained(Instant::now(), &mut table);
        assert!(
            table.service(SERVICE).is_empty(),
            "named before its wait passed"
        );
        h2.drained(Instant::now() + TRAILERS_WAIT, &mut table);
        let totals = route(&table, "POST", "/s/M");
        assert_eq!(totals.grpc.get(&(class(200), GRPC_STATUS_UNREAD)), Some(&1));
        // Gone: its tables go, and a connection past the cap is counted.
        let gone = H2Block {
            record: RouteRecord::H2Gone as u32,
            len: 0,
            ..client.headers(3, &request)[0]
        };
        h2.block(&gone, &mut table);
        assert!(h2.connections.is_empty());
        let mut other = Peer::new(false);
        let first = other.headers(1, &request);
        h2.block(
            &H2Block {
                conn: 1,
                ..first[0]
            },
            &mut table,
        );
        h2.block(
            &H2Block {
                conn: 2,
                ..first[0]
            },
            &mut table,
        );
        assert_eq!(h2.lost(SERVICE), BTreeMap::from([(Lost::Untracked, 1)]));
    }

    proptest! {
        #[test]
        fn any_bytes_are_decoded_or_lost_never_a_panic(
            frames in proptest::collection::vec(
                (any::<u8>(), any::<u8>(), proptest::collection::vec(any::<u8>(), 0..300)),
                1..8,
            )
        ) {
            let mut client = Peer::new(false);
            let (mut h2, mut table) = (H2Headers::new(4), table());
            for (kind, flags, payload) in &frames {
                let kind = [HEADERS, CONTINUATION, PUSH_PROMISE][usize::from(*kind % 3)];
                for block in client.frame(1, kind, *flags, payload) {
                    h2.block(&block, &mut table);
                }
            }
            h2.finished(&finished(1, false), &mut table);
            let counted: u64 = table
                .service(SERVICE)
                .values()
                .map(|totals| totals.responses.iter().sum::<u64>())
                .sum();
            prop_assert_eq!(counted, 1);
        }
    }
}
