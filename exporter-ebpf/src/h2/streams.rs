//! What each HTTP/2 frame does to a connection's streams (RFC 9113): HEADERS open a
//! stream, END_STREAM finishes it, RST_STREAM and GOAWAY reset it, SETTINGS bound
//! how many may be open; with the frame types, the frame header's parse, and the
//! moment of one call that every frame of it shares.
use poolscope_shared::{
    H2_STREAM_SLOTS, H2Conn, LossErrno, LossSource, ServiceCounters, h2_stream_slot,
};

use crate::{
    maps::{atomic_add, compare_and_swap, count_loss, update_service},
    requests,
    routes::Named,
    source::read_user,
};

/// Frame types (RFC 9113 §6).
pub(super) const DATA: u8 = 0;
pub(super) const HEADERS: u8 = 1;
pub(super) const PRIORITY: u8 = 2;
pub(super) const RST_STREAM: u8 = 3;
pub(super) const SETTINGS: u8 = 4;
pub(super) const PUSH_PROMISE: u8 = 5;
pub(super) const PING: u8 = 6;
pub(super) const GOAWAY: u8 = 7;
pub(super) const WINDOW_UPDATE: u8 = 8;
pub(super) const CONTINUATION: u8 = 9;
pub(super) const END_STREAM: u8 = 0x1;
pub(super) const ACK: u8 = 0x1;
pub(super) const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
/// SETTINGS entries read from one frame for `SETTINGS_MAX_CONCURRENT_STREAMS`.
pub(super) const MAX_SETTINGS: u32 = 8;

/// How a stream ended.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum End {
    /// Answered: by the END_STREAM of a HEADERS frame (`trailers`) or of a DATA frame.
    Finished {
        trailers: bool,
    },
    Reset,
}

/// What every frame of one call shares.
pub(super) struct Moment {
    pub(super) service: u32,
    pub(super) now: u64,
    /// When this read's bytes arrived.
    pub(super) arrive: u64,
}

/// A frame header.
pub(super) struct Frame {
    pub(super) length: u32,
    pub(super) kind: u8,
    pub(super) flags: u8,
    pub(super) stream: u32,
}

impl Frame {
    #[inline(always)]
    pub(super) fn of(bytes: &[u8; 32]) -> Self {
        Self {
            length: u32::from(bytes[0]) << 16 | u32::from(bytes[1]) << 8 | u32::from(bytes[2]),
            kind: bytes[3],
            flags: bytes[4],
            stream: u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]) & 0x7fff_ffff,
        }
    }

    /// Whether the frame is one a peer may send (RFC 9113 §6): the first of each side
    /// is SETTINGS, and each type has its stream and size rules. Bytes that break them
    /// are not HTTP/2 (or no longer in step): the connection is not followed further.
    #[inline(always)]
    pub(super) fn well_formed(&self, first: bool) -> bool {
        if first && self.kind != SETTINGS {
            return false;
        }
        match self.kind {
            DATA | HEADERS => self.stream != 0,
            PRIORITY => self.stream != 0 && self.length == 5,
            RST_STREAM => self.stream != 0 && self.length == 4,
            SETTINGS => self.stream == 0 && self.length.is_multiple_of(6),
            PING => self.stream == 0 && self.length == 8,
            GOAWAY => self.stream == 0 && self.length >= 8,
            WINDOW_UPDATE => self.length == 4,
            // PUSH_PROMISE, CONTINUATION, and extension types, which peers ignore.
            _ => true,
        }
    }
}

/// A frame the client sent.
#[inline(always)]
pub(super) fn received(h2: &mut H2Conn, frame: &Frame, moment: &Moment) {
    match frame.kind {
        // A HEADERS frame on a new (higher, odd) client stream id opens a stream; on
        // an open one it carries trailers.
        HEADERS if frame.stream & 1 == 1 && frame.stream > h2.last_stream => {
            h2.last_stream = frame.stream;
            // After the server's GOAWAY, streams above its last id are not processed.
            if h2.goaway == 0 || frame.stream < h2.goaway {
                open(h2, frame.stream, moment);
            }
        }
        RST_STREAM => {
            end(h2, frame.stream, End::Reset, moment);
        }
        _ => {}
    }
}

/// A frame the server sent; whether it answered a stream (its END_STREAM).
#[inline(always)]
pub(super) fn sent(h2: &mut H2Conn, frame: &Frame, moment: &Moment) -> bool {
    match frame.kind {
        DATA | HEADERS if frame.flags & END_STREAM != 0 => {
            let trailers = frame.kind == HEADERS;
            end(h2, frame.stream, End::Finished { trailers }, moment)
        }
        RST_STREAM => {
            end(h2, frame.stream, End::Reset, moment);
            false
        }
        _ => false,
    }
}

/// Client stream `id` opens.
#[inline(always)]
pub(super) fn open(h2: &mut H2Conn, id: u32, moment: &Moment) {
    let Some(stream) = h2.streams.get_mut(h2_stream_slot(id)) else {
        return;
    };
    if stream.id != 0 {
        count_loss(LossSource::Http2StreamSlots, LossErrno::None);
        return;
    }
    stream.arrive_ns = moment.arrive;
    stream.start_ns = moment.now;
    // Counted before the id is seen: an end on another CPU that finds the stream
    // then takes away one the count has.
    atomic_add(&mut h2.open, 1);
    stream.id = u64::from(id);
    let limit = limit_change(h2);
    update_service(moment.service, |c| {
        c.serving_entered.add(1);
        c.streams_opened.add(1);
        limit.count(c);
    });
}

/// Stream `id` ends; nothing if it is not open (a server push, one not followed, or
/// one another CPU ended first: the server's END_STREAM and the client's RST_STREAM
/// may cross). Whether it ended here.
#[inline(always)]
pub(super) fn end(h2: &mut H2Conn, id: u32, how: End, moment: &Moment) -> bool {
    let Some(stream) = h2.streams.get_mut(h2_stream_slot(id)) else {
        return false;
    };
    // Read before the slot is freed: a stream opening there may then overwrite them.
    let (arrive, start) = (stream.arrive_ns, stream.start_ns);
    if id == 0 || !compare_and_swap(&mut stream.id, u64::from(id), 0) {
        return false;
    }
    let limit = streams_ended(h2, 1);
    update_service(moment.service, |c| {
        c.serving_left.add(1);
        c.streams_ended.add(1);
        limit.count(c);
        match how {
            End::Reset => c.streams_reset.add(1),
            End::Finished { .. } => c.streams_answered.add(1),
        }
    });
    if let End::Finished { trailers } = how {
        // `:status` is HPACK-coded: not read here (0); user space decodes it from the
        // header blocks where the service's routes are read.
        let named = Named::Stream {
            conn: h2.key,
            id,
            trailers,
        };
        requests::record(moment.service, arrive, start, moment.now, 0, named);
    }
    true
}

/// `ended` streams whose slots the caller freed leave the count.
#[inline(always)]
pub(super) fn streams_ended(h2: &mut H2Conn, ended: u64) -> LimitChange {
    atomic_add(&mut h2.open, ended.wrapping_neg());
    limit_change(h2)
}

/// Whether the connection reached (or left) the server's stream limit, where its
/// client queues any more streams on its own side.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum LimitChange {
    None,
    Reached,
    Left,
}

impl LimitChange {
    /// Adds the change to the service's counters.
    #[inline(always)]
    pub(super) fn count(self, c: &mut ServiceCounters) {
        match self {
            Self::Reached => c.at_limit_entered.add(1),
            Self::Left => c.at_limit_left.add(1),
            Self::None => {}
        }
    }
}

/// Brings the connection's [`H2Conn::at_limit`] to what its open streams and the
/// server's limit say now, after a change to either. Another CPU may change the
/// count meanwhile and then comes here too: the last to come sets the flag, and each
/// flip is counted once, so the service's at-limit gauge never drifts.
#[inline(always)]
fn limit_change(h2: &mut H2Conn) -> LimitChange {
    let max = h2.max_streams;
    let now = u64::from(max != 0 && h2.open >= u64::from(max));
    if h2.at_limit == now || !compare_and_swap(&mut h2.at_limit, now ^ 1, now) {
        return LimitChange::None;
    }
    if now == 1 {
        LimitChange::Reached
    } else {
        LimitChange::Left
    }
}

/// The server's GOAWAY, its payload at user address `at`: the open streams above its
/// last stream id will not be processed, and end (reset).
#[inline(never)]
pub(super) fn goaway(h2: &mut H2Conn, at: u64, service: u32) {
    let Some(last) = read_user::<[u8; 4]>(at) else {
        return;
    };
    let last = u32::from_be_bytes(last) & 0x7fff_ffff;
    h2.goaway = last.saturating_add(1);
    let mut slot = 0;
    while slot < H2_STREAM_SLOTS as usize {
        if let Some(stream) = h2.streams.get_mut(slot) {
            let id = stream.id;
            if id > u64::from(last) && compare_and_swap(&mut stream.id, id, 0) {
                let limit = streams_ended(h2, 1);
                update_service(service, |c| {
                    c.serving_left.add(1);
                    c.streams_ended.add(1);
                    c.streams_reset.add(1);
                    limit.count(c);
                });
            }
        }
        slot += 1;
    }
}

/// Reads the server's SETTINGS payload of `length` bytes at user address `at` for
/// its stream limit.
#[inline(never)]
pub(super) fn settings(h2: &mut H2Conn, at: u64, length: u32, service: u32) {
    if let Some(limit) = announced_limit(at, length) {
        limit_streams(h2, limit, service);
    }
}

/// `SETTINGS_MAX_CONCURRENT_STREAMS` in a SETTINGS payload of `length` bytes at user
/// address `at`, if it is there.
#[inline(always)]
pub(super) fn announced_limit(at: u64, length: u32) -> Option<u32> {
    let mut limit = None;
    let mut entry = 0;
    while entry < MAX_SETTINGS && entry * 6 < length {
        let setting = read_user::<[u8; 6]>(at + u64::from(entry) * 6)?;
        if u16::from_be_bytes([setting[0], setting[1]]) == SETTINGS_MAX_CONCURRENT_STREAMS {
            limit = Some(u32::from_be_bytes([
                setting[2], setting[3], setting[4], setting[5],
            ]));
        }
        entry += 1;
    }
    limit
}

/// The server allows `limit` open streams on the connection from now on.
#[inline(always)]
pub(super) fn limit_streams(h2: &mut H2Conn, limit: u32, service: u32) {
    h2.max_streams = limit;
    let change = limit_change(h2);
    update_service(service, |c| {
        c.max_streams = c.max_streams.max(u64::from(limit));
        change.count(c);
    });
}
