//! Header blocks handed to user space (DESIGN §3, routes): the payload of each
//! HEADERS, PUSH_PROMISE and CONTINUATION frame of a connection whose service's routes
//! are read goes, as it passes the walk, into `ROUTE_EVENTS` records of up to
//! [`H2_BLOCK_BYTES`]. HPACK's tables are per connection and direction and change with
//! every block, so user space decodes them all in order (`:path`, `:status`,
//! `grpc-status`); here nothing is parsed, and a record that cannot be made still
//! counts in the direction's sequence, so that user space sees the gap.
use aya_ebpf::{
    bindings::BPF_RB_NO_WAKEUP,
    helpers::generated::{bpf_get_smp_processor_id, bpf_probe_read_user},
};
use core::ffi::c_void;
use poolscope_shared::{FrameCursor, H2_BLOCK_BYTES, H2Block, LossErrno, LossSource, RouteRecord};

use super::streams::{CONTINUATION, Frame, HEADERS, PUSH_PROMISE};
use crate::{
    maps::{ROUTE_EVENTS, count_loss},
    routes,
};

/// A key for a connection found HTTP/2 at `now` on this CPU: no two connections share
/// it, even on one socket.
#[inline(always)]
pub(super) fn key(now: u64) -> u64 {
    // SAFETY: helper without preconditions.
    let cpu = unsafe { bpf_get_smp_processor_id() };
    now.wrapping_shl(10) | u64::from(cpu & 0x3ff)
}

/// The walk read `frame`'s header on a connection of `service`: if its payload is a
/// header block to hand over, the cursor says so until the payload has passed.
#[inline(always)]
pub(super) fn frame_begins(cursor: &mut FrameCursor, frame: &Frame, service: u32) {
    cursor.block = u32::from(
        matches!(frame.kind, HEADERS | PUSH_PROMISE | CONTINUATION)
            && frame.length > 0
            && routes::reads_routes(service),
    );
    cursor.block_stream = frame.stream;
    cursor.block_kind = u32::from(frame.kind);
    cursor.block_flags = u32::from(frame.flags);
    cursor.block_len = frame.length;
}

/// Hands the next `len` (≤ [`H2_BLOCK_BYTES`]) bytes of the current frame's header
/// block, where the cursor's walk stands, to user space.
#[inline(never)]
pub(super) fn hand_over(cursor: &mut FrameCursor, conn: u64, service: u32, sent: bool, len: u32) {
    let from = cursor.call.base + cursor.call.at;
    cursor.block_records = cursor.block_records.wrapping_add(1);
    let Some(mut entry) = ROUTE_EVENTS.reserve::<H2Block>(0) else {
        count_loss(LossSource::RouteEvents, LossErrno::None);
        return;
    };
    let block = entry.as_mut_ptr();
    let size = len.min(H2_BLOCK_BYTES as u32);
    // SAFETY: the reserved record, ours until submitted or discarded; `bytes` holds
    // H2_BLOCK_BYTES, at least `size`; the helper checks the user read.
    let copied = unsafe {
        size > 0
            && bpf_probe_read_user(
                (*block).bytes.as_mut_ptr().cast(),
                size,
                from as *const c_void,
            ) == 0
    };
    if !copied {
        // The gap in the sequence tells user space.
        entry.discard(0);
        count_loss(LossSource::RouteEvents, LossErrno::Efault);
        return;
    }
    // SAFETY: as above.
    unsafe {
        (*block).record = RouteRecord::H2Block as u32;
        (*block).service = service;
        (*block).conn = conn;
        (*block).stream = cursor.block_stream;
        (*block).kind = cursor.block_kind as u8;
        (*block).flags = cursor.block_flags as u8;
        (*block).sent = u8::from(sent);
        (*block).sequence = cursor.block_records;
        (*block).frame_len = cursor.block_len;
        (*block).at = cursor.block_len - cursor.payload_left;
        (*block).len = size;
    }
    entry.submit(u64::from(BPF_RB_NO_WAKEUP));
}

/// Connection `conn` of `service` is closed or no longer followed: user space drops
/// its tables.
#[inline(never)]
pub(super) fn gone(conn: u64, service: u32) {
    if !routes::reads_routes(service) {
        return;
    }
    let Some(mut entry) = ROUTE_EVENTS.reserve::<H2Block>(0) else {
        count_loss(LossSource::RouteEvents, LossErrno::None);
        return;
    };
    let block = entry.as_mut_ptr();
    // SAFETY: the reserved record; user space reads only these fields of a gone one.
    unsafe {
        (*block).record = RouteRecord::H2Gone as u32;
        (*block).service = service;
        (*block).conn = conn;
        (*block).len = 0;
    }
    entry.submit(u64::from(BPF_RB_NO_WAKEUP));
}
