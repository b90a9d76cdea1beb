//! The request state machine of DESIGN §3, shared by both backends: `sock.rs` feeds
//! it socket events on entries stored in each socket (`SOCK_CONNS`), `syscalls.rs`
//! syscall results on entries keyed by (tgid, fd) in `CONNS`. A connection's entry
//! holds the phase of its current request and its timestamps; every phase change moves one `*_entered`/`*_left` counter pair
//! (the gauges) and a finished request goes into the service's histograms. Events of
//! one connection run on several CPUs at once (an arrival in the client's softirq,
//! the server's read and write), so a phase changes by compare-and-swap: the event
//! that loses is applied again to the phase the winner left.
//!
//! A connection open before its service was watched is adopted: user space makes its
//! entry `Unserved` (unread bytes wait) or `Responded` with `start_ns` 0 (between
//! requests, or a request read before the watch and not answered yet).
use poolscope_shared::{
    Conn, LossErrno, LossSource, Phase, ROUTE_BYTES, ServiceCounters, StatusClass,
    is_interim_status, maps::CountedMap,
};

use crate::{
    maps::{
        CONNS, REQUEST_TIMES, add_to_shared_histogram, compare_and_swap, count_loss,
        insert_counted, remove_counted, update_service,
    },
    routes::{self, Line, Named},
    serving::{self, End},
    source::Source,
};

/// 1: the first write of each answer has its status line read (set at load time,
/// `[probes] response_status`): ~150 ns a read (`cargo xtask bench`), once per
/// request. 0: every request counts with no status, and a `100 Continue` ends its
/// request (the upload's body that follows is the next one).
#[unsafe(no_mangle)]
static READ_RESPONSE_STATUS: u32 = 1;

/// Whether the backend sees request bytes arrive (`sock:sk_data_ready`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Arrivals {
    Seen,
    Unseen,
}

/// The phase of `conn` as it is now (other CPUs change it).
#[inline(always)]
pub fn phase(conn: &Conn) -> Phase {
    // SAFETY: a live entry; volatile, since other CPUs change it.
    Phase::from_u32(unsafe { core::ptr::read_volatile(&conn.phase) })
}

/// A new connection of `service` entered the queue at `now` (handshake done or
/// accepted): its entry, to store where the backend keeps them, then [`accepted`].
#[inline(always)]
pub fn new_connection(service: u32, owner_since_ns: u64, epoch: u32, now: u64) -> Conn {
    Conn {
        service,
        phase: Phase::Unserved as u32,
        owner_since_ns,
        arrive_ns: now,
        start_ns: 0,
        end_ns: 0,
        next_arrive_ns: 0,
        server_tid: 0,
        epoch,
        seen_write_seq: 0,
        status: 0,
        adopted: 0,
        upgrade_checked: 0,
        greeting_limit: 0,
        greeted: 0,
        greeting_limit_set: 0,
        line_len: 0,
        line: [0; ROUTE_BYTES / 8],
    }
}

/// The entry of a new connection of `service` was stored: it counts, and waits.
#[inline(always)]
pub fn accepted(service: u32) {
    update_service(service, |c| {
        c.accepted.add(1);
        c.unserved_entered.add(1);
    });
}

/// A new connection under `key` in `CONNS` (syscall backend). An entry left under
/// the same key (an fd reused without a close we saw) is closed first.
#[inline(always)]
pub fn connected(key: u64, service: u32, owner_since_ns: u64, now: u64) {
    closed(key, now);
    let conn = new_connection(service, owner_since_ns, 0, now);
    if let Err(code) = insert_counted(&CONNS, CountedMap::Conns, &key, &conn) {
        count_loss(LossSource::ConnsInsert, LossErrno::of(code.into()));
        return;
    }
    accepted(service);
}

/// A phase change lost to another CPU: the event is applied again to the phase that
/// CPU left.
struct Raced;

/// How many times an event is applied before it gives up (and counts a loss): each
/// retry follows a phase change by another CPU, which takes an event of its own.
const ATTEMPTS: usize = 3;

/// Applies `event` to `conn` until it does not lose a phase change to another CPU.
#[inline(always)]
fn apply(conn: &mut Conn, mut event: impl FnMut(&mut Conn, Phase) -> Result<(), Raced>) {
    for _ in 0..ATTEMPTS {
        // SAFETY: a live map value; volatile, since other CPUs change it.
        let phase = unsafe { core::ptr::read_volatile(&conn.phase) };
        if event(conn, Phase::from_u32(phase)).is_ok() {
            return;
        }
    }
    count_loss(LossSource::PhaseRetries, LossErrno::None);
}

/// Moves `conn` from `from` to `to` unless another CPU moved it first: of the events
/// that see one phase, only the one whose swap succeeds accounts the change, and it
/// writes the entry's other fields after the swap.
#[inline(always)]
fn advance(conn: &mut Conn, from: Phase, to: Phase) -> Result<(), Raced> {
    // The phase shares its 8 bytes with the service id, which never changes: the
    // BPF target's generic CPU has only a 64-bit compare-and-swap.
    let service = u64::from(conn.service);
    let word = |phase: Phase| service | (phase as u64) << 32;
    // SAFETY: `Conn` starts with `service` and `phase` (asserted in shared), 8-aligned.
    let head = unsafe { &mut *core::ptr::from_mut(conn).cast::<u64>() };
    if compare_and_swap(head, word(from), word(to)) {
        Ok(())
    } else {
        Err(Raced)
    }
}

/// Request bytes were queued to the socket (socket backend).
#[inline(always)]
pub fn data_arrived(conn: &mut Conn, now: u64) {
    apply(conn, |conn, phase| {
        match phase {
            // The client sends its next request only after the response: the last one
            // is done.
            Phase::Responded => {
                advance(conn, Phase::Responded, Phase::Waiting)?;
                finish(conn);
                conn.arrive_ns = now;
                conn.next_arrive_ns = 0;
                update_service(conn.service, |c| c.waiting_entered.add(1));
            }
            // Bytes for the next request, or more of this one: the next read tells.
            Phase::Serving if conn.next_arrive_ns == 0 => conn.next_arrive_ns = now,
            _ => {}
        }
        Ok(())
    });
}

/// A read returned `len` request bytes from the caller's memory at `source`; one
/// that begins a request has its first bytes kept for the route (`routes.rs`), found
/// only then (two reads of three begin none).
#[inline(always)]
pub fn read(
    conn: &mut Conn,
    now: u64,
    arrivals: Arrivals,
    source: impl FnOnce() -> Option<Source>,
    len: u64,
) {
    let mut began = false;
    apply(conn, |conn, phase| {
        match phase {
            Phase::Unserved => {
                advance(conn, phase, Phase::Serving)?;
                start(conn, now, |c| c.unserved_left.add(1));
                began = true;
            }
            Phase::Waiting => {
                advance(conn, phase, Phase::Serving)?;
                start(conn, now, |c| c.waiting_left.add(1));
                began = true;
            }
            // Adopted between requests (open before the watch): a new request starts,
            // whose arrival is the one seen since, if any.
            Phase::Responded if conn.start_ns == 0 => {
                advance(conn, phase, Phase::Serving)?;
                conn.arrive_ns = if conn.next_arrive_ns != 0 {
                    conn.next_arrive_ns
                } else {
                    now
                };
                start(conn, now, |_| {});
                began = true;
            }
            Phase::Responded => {
                advance(conn, phase, Phase::Serving)?;
                match arrivals {
                    // Bytes arrived while the request was served and nothing read them:
                    // the client sent its next request before our write's tracepoint ran.
                    Arrivals::Seen if conn.next_arrive_ns != 0 => {
                        finish(conn);
                        conn.arrive_ns = conn.next_arrive_ns;
                        start(conn, now, |_| {});
                        began = true;
                    }
                    // No bytes arrived since the response began: these were queued
                    // before it, so the same request goes on (a server that answers
                    // before reading all).
                    Arrivals::Seen => {
                        conn.server_tid = serving::request_started(now);
                        update_service(conn.service, |c| c.serving_entered.add(1));
                    }
                    // The next request; its arrival is not seen, so it did not wait.
                    Arrivals::Unseen => {
                        finish(conn);
                        conn.arrive_ns = now;
                        start(conn, now, |_| {});
                        began = true;
                    }
                }
            }
            // The bytes that arrived meanwhile belong to this request.
            Phase::Serving => conn.next_arrive_ns = 0,
            // `h2.rs` follows its streams.
            Phase::Multiplexed | Phase::Closing | Phase::Gone => {}
        }
        Ok(())
    });
    // After the phase changed: the request before was recorded (here, or where its
    // successor arrived), and this one is recorded only after its answer, which
    // follows this read.
    if began {
        routes::began(conn, source, len);
    }
}

/// Connection `conn` carries HTTP/2: it leaves this machine, and `h2.rs` follows its
/// streams (or, adopted mid-stream, counts none). It leaves the gauge it is in: a new
/// connection's first bytes are the preface (`Unserved`); an upgraded or adopted one
/// may be waiting or between requests. The phase it left; `None` if it is in no phase
/// that can carry HTTP/2's first bytes, or another CPU moved it meanwhile.
#[inline(always)]
pub fn multiplexed(conn: &mut Conn) -> Option<Phase> {
    let mut left = None;
    apply(conn, |conn, phase| {
        match phase {
            Phase::Unserved | Phase::Waiting | Phase::Responded => {
                advance(conn, phase, Phase::Multiplexed)?;
                left = Some(phase);
                update_service(conn.service, |c| {
                    match phase {
                        Phase::Unserved => c.unserved_left.add(1),
                        Phase::Waiting => c.waiting_left.add(1),
                        _ => {}
                    }
                    c.multiplexed.add(1);
                });
            }
            _ => {}
        }
        Ok(())
    });
    left
}

/// Connection `conn` was upgraded to HTTP/2 (`Upgrade: h2c`) and left `phase` for
/// [`multiplexed`]: the HTTP/1.1 request that asked for the upgrade is done (a waiting
/// connection's was finished when the preface arrived).
#[inline(always)]
pub fn upgraded(conn: &Conn, left: Phase) {
    if left == Phase::Responded {
        finish(conn);
    }
}

/// The fields of a request that starts being served at `now`, once its phase is
/// `Serving`; `leave` is the gauge it leaves.
#[inline(always)]
fn start(conn: &mut Conn, now: u64, leave: impl FnOnce(&mut ServiceCounters)) {
    conn.start_ns = now;
    conn.status = 0;
    conn.line_len = 0;
    conn.next_arrive_ns = 0;
    conn.server_tid = serving::request_started(now);
    update_service(conn.service, |c| {
        leave(c);
        c.serving_entered.add(1);
    });
}

/// A write sent response bytes; `status` is the status its first bytes read as (0:
/// not read, or no status line).
#[inline(always)]
pub fn wrote(conn: &mut Conn, now: u64, status: u16) {
    apply(conn, |conn, phase| {
        match phase {
            // Bytes sent before any request (a greeting) are not a response: an
            // HTTP/2 server's first frame (SETTINGS) may be among them (`h2.rs`).
            Phase::Unserved => conn.greeted = 1,
            Phase::Serving => {
                // Before the swap: an arrival on another CPU may finish the request
                // as soon as it is `Responded`.
                conn.status = status;
                advance(conn, phase, Phase::Responded)?;
                conn.end_ns = now;
                serving::request_ended(conn.server_tid, now, End::Response);
                conn.server_tid = 0;
                update_service(conn.service, |c| c.serving_left.add(1));
            }
            // Adopted between a read before the watch and its response: the request in
            // progress counts, from the adoption on (its true start is unknown).
            Phase::Responded if conn.start_ns == 0 => {
                conn.status = status;
                conn.start_ns = conn.arrive_ns;
                conn.end_ns = now;
                update_service(conn.service, |c| {
                    c.serving_entered.add(1);
                    c.serving_left.add(1);
                });
            }
            Phase::Responded => conn.end_ns = now,
            _ => {}
        }
        Ok(())
    });
}

/// A write sent `bytes` from the caller's memory at `source`: the first write of an
/// answer has its status line read. An interim answer (`100 Continue` before an
/// upload's body is read) leaves its request served; any other is [`wrote`].
#[inline(always)]
pub fn wrote_from(conn: &mut Conn, now: u64, bytes: u32, source: impl FnOnce() -> Option<Source>) {
    // SAFETY: a load-time constant.
    let reads = unsafe { core::ptr::read_volatile(&READ_RESPONSE_STATUS) } != 0;
    let status = if reads && phase(conn) == Phase::Serving {
        source().map_or(0, |source| source.response_status(bytes.into()))
    } else {
        0
    };
    if is_interim_status(status) {
        return;
    }
    wrote(conn, now, status);
}

/// The peer closed its side (socket backend): a finished request is done, and the
/// bytes that announce the close are no request.
#[inline(always)]
pub fn peer_closed(conn: &mut Conn) {
    apply(conn, |conn, phase| {
        if phase == Phase::Responded {
            advance(conn, phase, Phase::Closing)?;
            finish(conn);
        }
        Ok(())
    });
}

/// The connection under `key` in `CONNS` is gone (syscall backend).
#[inline(always)]
pub fn closed(key: u64, now: u64) {
    let Some(conn) = CONNS.get_ptr_mut(key) else {
        return;
    };
    // SAFETY: a live map value (freed only after every program that holds it ends).
    if let Some(gone) = closing(unsafe { &mut *conn }) {
        // Before the removal: the map may hand the slot to a new entry at once.
        gone.account(now);
        remove_counted(&CONNS, CountedMap::Conns, &key);
    }
}

/// A connection whose end this event accounts for: its last phase, and its entry,
/// which no other CPU changes any more (its phase is `Gone`).
pub struct Gone<'a> {
    phase: Phase,
    conn: &'a mut Conn,
}

/// The connection of `conn` is gone. Its phase becomes `Gone` first, so that an
/// event on another CPU that still holds the entry changes nothing while it is
/// accounted; `None` if another CPU got there first. The caller calls
/// [`Gone::account`], then removes the entry (not copied: it is 168 bytes, and the
/// syscall backend's stack has no room for them).
#[inline(always)]
pub fn closing(conn: &mut Conn) -> Option<Gone<'_>> {
    let mut left = None;
    apply(conn, |conn, phase| {
        if phase != Phase::Gone {
            advance(conn, phase, Phase::Gone)?;
            left = Some(phase);
        }
        Ok(())
    });
    Some(Gone { phase: left?, conn })
}

impl Gone<'_> {
    /// Whatever the connection held leaves its gauge, and a request in progress ends
    /// at `now`.
    #[inline(always)]
    pub fn account(self, now: u64) {
        let conn = self.conn;
        match self.phase {
            Phase::Unserved => update_service(conn.service, |c| c.unserved_left.add(1)),
            Phase::Waiting => update_service(conn.service, |c| c.waiting_left.add(1)),
            Phase::Serving => {
                update_service(conn.service, |c| c.serving_left.add(1));
                serving::request_ended(conn.server_tid, now, End::Close);
                conn.end_ns = now;
                finish(conn);
            }
            Phase::Responded => finish(conn),
            // Its streams end in `h2.rs`.
            Phase::Multiplexed | Phase::Closing | Phase::Gone => {}
        }
    }

    /// Whether the connection was an HTTP/2 one, whose open streams end apart.
    #[inline(always)]
    pub fn multiplexed(&self) -> bool {
        self.phase == Phase::Multiplexed
    }
}

/// Records a finished request in its service's histograms; a connection adopted
/// between requests (`start_ns` 0) has none to record.
#[inline(always)]
fn finish(conn: &Conn) {
    if conn.start_ns == 0 {
        return;
    }
    let line = Line {
        bytes: &conn.line,
        len: conn.line_len,
    };
    record(
        conn.service,
        conn.arrive_ns,
        conn.start_ns,
        conn.end_ns,
        conn.status,
        Named::Line(line),
    );
}

/// Records a request of `service` that arrived, started and ended at these times in
/// its histograms, then counts it finished, under the class of its answer's `status`
/// (0: not read); what names it goes to user space for its route.
#[inline(always)]
pub fn record(service: u32, arrive_ns: u64, start_ns: u64, end_ns: u64, status: u16, named: Named) {
    let Some(times) = REQUEST_TIMES.get_ptr_mut(service) else {
        return;
    };
    // SAFETY: a live array slot; concurrent updates are atomic adds.
    let times = unsafe { &mut *times };
    let queue_ns = start_ns.saturating_sub(arrive_ns);
    let duration_ns = end_ns.saturating_sub(start_ns);
    add_to_shared_histogram(&mut times.queue, queue_ns);
    add_to_shared_histogram(&mut times.duration, duration_ns);
    add_to_shared_histogram(&mut times.latency, end_ns.saturating_sub(arrive_ns));
    if routes::reads_routes(service) {
        routes::finished(service, status, queue_ns, duration_ns, named);
    }
    // Counted after the record (x86's atomic adds are seen in order, and the
    // compiler keeps them before the counters' lookup, a call that may read them):
    // user space reads the times again only when this count moved.
    update_service(service, |c| {
        c.finished.add(1);
        // The class's index, opaque to the compiler: a bound it sees it moves onto
        // the status (< 600), and the verifier then finds none on the index.
        let class = core::hint::black_box(StatusClass::index_of(status));
        if let Some(count) = c.responses.get_mut(class) {
            count.add(1);
        }
    });
}
