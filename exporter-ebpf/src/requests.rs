//! The request state machine of DESIGN §3, shared by both backends: `sock.rs` feeds
//! it socket events keyed by socket address, `syscalls.rs` syscall results keyed by
//! (tgid, fd). A connection's entry in `CONNS` holds the phase of its current request
//! and its timestamps; every phase change moves one `*_entered`/`*_left` counter pair
//! (the gauges) and a finished request goes into the service's histograms.
//!
//! A connection open before its service was watched is adopted: user space makes its
//! entry `Unserved` (unread bytes wait) or `Responded` with `start_ns` 0 (between
//! requests, or a request read before the watch and not answered yet).
use aya_ebpf::helpers::bpf_ktime_get_ns;
use poolscope_shared::{
    Conn, Histogram, LossErrno, LossSource, Phase, ServiceCounters, histogram_bucket,
};

use crate::{
    maps::{CONNS, REQUEST_TIMES, count_loss, update_service},
    threads::{self, End},
};

/// Whether the backend sees request bytes arrive (`sock:sk_data_ready`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Arrivals {
    Seen,
    Unseen,
}

#[inline(always)]
pub fn now_ns() -> u64 {
    // SAFETY: helper without preconditions.
    unsafe { bpf_ktime_get_ns() }
}

/// A new connection of `service` entered the queue at `now` (handshake done or
/// accepted). An entry left under the same key (a socket address or fd reused
/// without a close we saw) is closed first.
#[inline(always)]
pub fn connected(key: u64, service: u32, owner_since_ns: u64, now: u64) {
    closed(key, now);
    let conn = Conn {
        service,
        phase: Phase::Unserved as u32,
        owner_since_ns,
        arrive_ns: now,
        start_ns: 0,
        end_ns: 0,
        next_arrive_ns: 0,
        server_tid: 0,
        _pad: 0,
    };
    if let Err(code) = CONNS.insert(key, conn, 0) {
        count_loss(LossSource::ConnsInsert, LossErrno::of(code.into()));
        return;
    }
    update_service(service, |c| {
        c.accepted += 1;
        c.unserved_entered += 1;
    });
}

/// Request bytes were queued to the socket (socket backend).
#[inline(always)]
pub fn data_arrived(conn: &mut Conn, now: u64) {
    match Phase::from_u32(conn.phase) {
        // The client sends its next request only after the response: the last one is done.
        Phase::Responded => {
            finish(conn);
            wait(conn, now);
        }
        // Bytes for the next request, or more of this one: the next read tells.
        Phase::Serving if conn.next_arrive_ns == 0 => conn.next_arrive_ns = now,
        _ => {}
    }
}

fn wait(conn: &mut Conn, now: u64) {
    conn.phase = Phase::Waiting as u32;
    conn.arrive_ns = now;
    conn.next_arrive_ns = 0;
    update_service(conn.service, |c| c.waiting_entered += 1);
}

/// A read returned request bytes.
#[inline(always)]
pub fn read(conn: &mut Conn, now: u64, arrivals: Arrivals) {
    match Phase::from_u32(conn.phase) {
        Phase::Unserved => start(conn, now, |c| c.unserved_left += 1),
        Phase::Waiting => start(conn, now, |c| c.waiting_left += 1),
        // Adopted between requests (open before the watch): a new request starts,
        // whose arrival is the one seen since, if any.
        Phase::Responded if conn.start_ns == 0 => {
            conn.arrive_ns = if conn.next_arrive_ns != 0 {
                conn.next_arrive_ns
            } else {
                now
            };
            start(conn, now, |_| {});
        }
        Phase::Responded => match arrivals {
            // Bytes arrived while the request was served and nothing read them: the
            // client sent its next request before our write's tracepoint ran.
            Arrivals::Seen if conn.next_arrive_ns != 0 => {
                finish(conn);
                conn.arrive_ns = conn.next_arrive_ns;
                start(conn, now, |_| {});
            }
            // No bytes arrived since the response began: these were queued before it,
            // so the same request goes on (a server that answers before reading all).
            Arrivals::Seen => {
                conn.phase = Phase::Serving as u32;
                conn.server_tid = threads::request_started(now);
                update_service(conn.service, |c| c.serving_entered += 1);
            }
            // The next request; its arrival is not seen, so it did not wait.
            Arrivals::Unseen => {
                finish(conn);
                conn.arrive_ns = now;
                start(conn, now, |_| {});
            }
        },
        // The bytes that arrived meanwhile belong to this request.
        Phase::Serving => conn.next_arrive_ns = 0,
        Phase::Closing => {}
    }
}

#[inline(always)]
fn start(conn: &mut Conn, now: u64, leave: impl FnOnce(&mut ServiceCounters)) {
    conn.phase = Phase::Serving as u32;
    conn.start_ns = now;
    conn.next_arrive_ns = 0;
    conn.server_tid = threads::request_started(now);
    update_service(conn.service, |c| {
        leave(c);
        c.serving_entered += 1;
    });
}

/// A write sent response bytes.
#[inline(always)]
pub fn wrote(conn: &mut Conn, now: u64) {
    match Phase::from_u32(conn.phase) {
        Phase::Serving => {
            conn.phase = Phase::Responded as u32;
            conn.end_ns = now;
            threads::request_ended(conn.server_tid, now, End::Response);
            conn.server_tid = 0;
            update_service(conn.service, |c| c.serving_left += 1);
        }
        // Adopted between a read before the watch and its response: the request in
        // progress counts, from the adoption on (its true start is unknown).
        Phase::Responded if conn.start_ns == 0 => {
            conn.start_ns = conn.arrive_ns;
            conn.end_ns = now;
            update_service(conn.service, |c| {
                c.serving_entered += 1;
                c.serving_left += 1;
            });
        }
        Phase::Responded => conn.end_ns = now,
        // Bytes sent before any request (a greeting) are not a response.
        _ => {}
    }
}

/// The peer closed its side (socket backend): a finished request is done, and the
/// bytes that announce the close are no request.
#[inline(always)]
pub fn peer_closed(conn: &mut Conn) {
    if Phase::from_u32(conn.phase) == Phase::Responded {
        finish(conn);
        conn.phase = Phase::Closing as u32;
    }
}

/// The connection is gone: whatever it held leaves its gauge, and a request in
/// progress ends now.
#[inline(always)]
pub fn closed(key: u64, now: u64) {
    let Some(conn) = CONNS.get_ptr_mut(key) else {
        return;
    };
    // SAFETY: copied out at once; only the remove below decides who accounts it.
    let mut conn = unsafe { *conn };
    if CONNS.remove(key).is_err() {
        // Someone else removed it first and accounted for it.
        return;
    }
    match Phase::from_u32(conn.phase) {
        Phase::Unserved => update_service(conn.service, |c| c.unserved_left += 1),
        Phase::Waiting => update_service(conn.service, |c| c.waiting_left += 1),
        Phase::Serving => {
            update_service(conn.service, |c| c.serving_left += 1);
            threads::request_ended(conn.server_tid, now, End::Close);
            conn.end_ns = now;
            finish(&conn);
        }
        Phase::Responded => finish(&conn),
        Phase::Closing => {}
    }
}

/// Records a finished request in its service's histograms; a connection adopted
/// between requests (`start_ns` 0) has none to record.
#[inline(always)]
fn finish(conn: &Conn) {
    if conn.start_ns == 0 {
        return;
    }
    let Some(times) = REQUEST_TIMES.get_ptr_mut(conn.service) else {
        return;
    };
    // SAFETY: per-CPU slot, no other writer while we run on this CPU.
    let times = unsafe { &mut *times };
    record(
        &mut times.queue,
        conn.start_ns.saturating_sub(conn.arrive_ns),
    );
    record(
        &mut times.duration,
        conn.end_ns.saturating_sub(conn.start_ns),
    );
    record(
        &mut times.latency,
        conn.end_ns.saturating_sub(conn.arrive_ns),
    );
}

#[inline(always)]
fn record(histogram: &mut Histogram, ns: u64) {
    if let Some(bucket) = histogram.buckets.get_mut(histogram_bucket(ns)) {
        *bucket += 1;
    }
    histogram.sum_ns += ns;
}
