//! Where a thread starts or stops serving a request, for the request state machine
//! (`requests.rs`): the thread's state is cut there (`threads.rs`), so that only the
//! request's part of its time is the request's, and a lock wait pending since its
//! last futex wait is recorded (`locks.rs`). Above both, so that neither imports
//! the other.
use aya_ebpf::helpers::bpf_get_current_pid_tgid;
use poolscope_shared::Activity;

use crate::{
    locks,
    threads::{change, thread},
};

/// The current thread read the first bytes of a request: it serves it until the
/// response begins. Returns its tid if it is watched, else 0.
#[inline(always)]
pub fn request_started(now: u64) -> u32 {
    let tid = bpf_get_current_pid_tgid() as u32;
    let Some(thread) = thread(tid) else {
        return 0;
    };
    let activity = Activity::from_u32(thread.activity);
    // Cut the interval so that only its part from now on is the request's.
    change(tid, thread, activity, now);
    locks::request_boundary(tid, thread);
    if thread.serving.open() > 0 {
        thread.multiplexes = 1;
    }
    thread.served = 1;
    thread.serving.start();
    tid
}

/// How a request stopped being served.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The current thread wrote the first bytes of the response.
    Response,
    /// The connection closed (possibly in softirq, on any CPU).
    Close,
}

/// The request that `server_tid` started stopped being served.
#[inline(always)]
pub fn request_ended(server_tid: u32, now: u64, end: End) {
    if server_tid == 0 {
        return;
    }
    let Some(thread) = thread(server_tid) else {
        return;
    };
    let handed_off = end == End::Response && bpf_get_current_pid_tgid() as u32 != server_tid;
    let activity = Activity::from_u32(thread.activity);
    // Answered by another thread: a wait the server thread is in no longer waits for
    // this request but for work (a Go M parked in futexsleep, for seconds, while the
    // goroutine that it read the request for answered on another M).
    let next = if handed_off && activity.is_off_cpu() && activity != Activity::OffDisk {
        Activity::OffIdle
    } else {
        activity
    };
    change(server_tid, thread, next, now);
    thread.serving.end();
    if handed_off {
        thread.hands_off = 1;
        locks::handed_off(server_tid, thread, now);
    } else if end == End::Response {
        locks::request_boundary(server_tid, thread);
    }
}
