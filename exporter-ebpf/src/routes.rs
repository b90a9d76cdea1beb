//! Routes (DESIGN §3): a request's first bytes (its request line) are copied into its
//! connection's entry when a read begins it, and handed to user space with its status
//! and times when it is recorded, one [`RouteEvent`] in `ROUTE_EVENTS`. User space
//! names the route, folds and caps the routes, and keeps their histograms: no loop
//! over the bytes and no per-route map here, so the cost is one user read at a
//! request's start and one ring record at its end.
use aya_ebpf::bindings::BPF_RB_NO_WAKEUP;
use poolscope_shared::{Conn, LossErrno, LossSource, RouteEvent, RouteLine, RouteRecord};

use crate::{
    maps::{ROUTE_EVENTS, ROUTE_SERVICES, count_loss},
    source::Source,
};

/// 1: some service's routes may be read (set at load time: `[probes] routes`, or a
/// `[[targets]]` entry that reads them). 0: no program looks further.
#[unsafe(no_mangle)]
static READ_ROUTES: u32 = 1;

/// Whether any service's routes may be read (else the verifier drops the rest).
#[inline(always)]
fn any_read() -> bool {
    // SAFETY: a load-time constant; volatile so that the compiler does not fold it.
    unsafe { core::ptr::read_volatile(&READ_ROUTES) != 0 }
}

/// Whether `service`'s routes are read: its first bytes kept, its finished requests
/// handed over.
#[inline(always)]
pub fn reads_routes(service: u32) -> bool {
    any_read() && ROUTE_SERVICES.get(service).is_some_and(|&read| read != 0)
}

/// The read of `len` bytes at `source` began `conn`'s current request: its first
/// bytes become the request's line (none if they cannot be read, or if its service's
/// routes are not read: its record, if they are by then, has no line left over).
#[inline(always)]
pub fn began(conn: &mut Conn, source: impl FnOnce() -> Option<Source>, len: u64) {
    if !any_read() {
        return;
    }
    conn.line_len = if reads_routes(conn.service) {
        source()
            .and_then(|source| source.read_first(&mut conn.line, len))
            .unwrap_or(0)
    } else {
        0
    };
}

/// The first bytes of a request, as [`began`] kept them.
pub struct Line<'a> {
    pub bytes: &'a RouteLine,
    pub len: u16,
}

/// What names a finished request's route.
pub enum Named<'a> {
    /// An HTTP/1 request's first bytes.
    Line(Line<'a>),
    /// HTTP/2 stream `id` of connection `conn` (its `H2Conn::key`), whose header
    /// blocks user space decodes; `trailers` if the server's END_STREAM was on a
    /// HEADERS frame, whose block follows.
    Stream { conn: u64, id: u32, trailers: bool },
}

/// Hands a finished request of `service` to user space: its answer's `status`, its
/// times and what names its route.
#[inline(always)]
pub fn finished(service: u32, status: u16, queue_ns: u64, duration_ns: u64, named: Named) {
    let Some(mut entry) = ROUTE_EVENTS.reserve::<RouteEvent>(0) else {
        count_loss(LossSource::RouteEvents, LossErrno::None);
        return;
    };
    let event = entry.as_mut_ptr();
    // SAFETY: the reserved record, ours until submitted; every field user space reads
    // is written (the line up to `line_len`).
    unsafe {
        (*event).record = RouteRecord::Finished as u32;
        (*event).service = service;
        (*event).status = status;
        (*event).queue_ns = queue_ns;
        (*event).duration_ns = duration_ns;
        match named {
            Named::Line(line) => {
                (*event).line_len = line.len;
                (*event).h2_stream = 0;
                copy_words(&mut (*event).line, line.bytes);
            }
            Named::Stream { conn, id, trailers } => {
                (*event).line_len = 0;
                (*event).h2_stream = id;
                (*event).h2_conn = conn;
                (*event).h2_trailers = u32::from(trailers);
            }
        }
    }
    // User space drains the ring on a timer: a wakeup per request would cost more
    // than the record.
    entry.submit(u64::from(BPF_RB_NO_WAKEUP));
}

/// Copies `from` to `to` word by word. A plain copy compiles to a `memcpy` call that
/// copies bytes in a loop, which 6.1's verifier walks byte by byte until it refuses
/// the program; volatile accesses are neither merged into one nor made a loop.
#[inline(always)]
fn copy_words(to: &mut RouteLine, from: &RouteLine) {
    for (to, from) in to.iter_mut().zip(from) {
        // SAFETY: both are live, aligned words.
        unsafe { core::ptr::write_volatile(to, core::ptr::read_volatile(from)) };
    }
}
