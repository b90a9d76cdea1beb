//! On-demand profiling sessions (DESIGN §1, stacks; `/debug/pprof/profile`): each
//! slot of `PROFILE_SESSIONS` has its own sampler program, which user space attaches
//! to every CPU's cpu-clock at the session's rate while the session runs, so that
//! sessions at different rates never share a perf event. Samples and blocks of the
//! session's service (and pool) count into `STACK_COUNTS` under the session's id,
//! next to the periodic snapshots' counts, and are drained with them.
use aya_ebpf::{
    helpers::{bpf_get_current_pid_tgid, bpf_ktime_get_ns},
    macros::perf_event,
    programs::PerfEventContext,
};
use poolscope_shared::{
    Activity, MAX_PROFILE_SESSIONS, NO_POOL, ProfileSession, STACK_GENERATIONS, StackKey,
};

use crate::{
    maps::PROFILE_SESSIONS,
    stackmaps::{add, capture, current_epoch},
    threads::{pool_of, thread},
};

/// Whether `session` records `kind` for a thread of `service` in `pool`.
#[inline(always)]
fn wants(session: &ProfileSession, kind: u32, service: u32, pool: u32) -> bool {
    session.active != 0
        && session.kinds & kind != 0
        && session.service == service
        && (session.pool == NO_POOL || session.pool == pool)
}

/// The cpu-clock of one CPU ticked for the session in `slot`.
#[inline(always)]
fn sample(ctx: &PerfEventContext, slot: u32) {
    let Some(session) = PROFILE_SESSIONS.get_ptr_mut(slot) else {
        return;
    };
    // SAFETY: a live map value; user space writes it only while no sampler of the
    // slot is attached, and a racing first_sample_ns write only moves it by a tick.
    let session = unsafe { &mut *session };
    let pid_tgid = bpf_get_current_pid_tgid();
    let tid = pid_tgid as u32;
    let Some(thread) = thread(tid) else {
        return;
    };
    let pool = pool_of(tid).unwrap_or(NO_POOL);
    if !wants(session, ProfileSession::ON_CPU, thread.service, pool) {
        return;
    }
    if session.first_sample_ns == 0 {
        // SAFETY: no preconditions.
        session.first_sample_ns = unsafe { bpf_ktime_get_ns() };
    }
    let generation = current_epoch() % STACK_GENERATIONS;
    let stacks = capture(ctx, generation);
    let key = StackKey {
        generation,
        activity: Activity::Running as u32,
        tgid: (pid_tgid >> 32) as u32,
        pool,
        user_stack: stacks.user,
        kernel_stack: stacks.kernel,
        session: session.id,
        variant: stacks.variant,
    };
    add(&key, 1, 0);
}

/// One sampler program per slot: a perf event cannot tell the program which
/// session opened it (attach cookies are not in aya's perf event API).
macro_rules! session_samplers {
    ($($name:ident = $slot:literal),* $(,)?) => {
        $(
            #[perf_event]
            pub fn $name(ctx: PerfEventContext) -> u32 {
                sample(&ctx, $slot);
                0
            }
        )*
        const _: () = assert!([$($slot),*].len() == MAX_PROFILE_SESSIONS as usize);
    };
}

session_samplers!(
    session_sample_0 = 0,
    session_sample_1 = 1,
    session_sample_2 = 2,
    session_sample_3 = 3,
    session_sample_4 = 4,
    session_sample_5 = 5,
    session_sample_6 = 6,
    session_sample_7 = 7,
);

/// A block of a thread of `service` ended at `now` and was counted under `key` for
/// the snapshots, standing for `weight` blocks (sampled): sessions that want it count
/// it too, from their start at most.
#[inline(always)]
pub fn block_ended(service: u32, key: StackKey, blocked_ns: u64, weight: u64, now: u64) {
    // Unrolled by hand: LLVM entered a loop over the slots in its middle, and Linux
    // 6.1's verifier refuses a loop closed by a fall-through ("back-edge from insn").
    macro_rules! each_slot {
        ($($slot:literal)*) => {
            $(block_ended_in($slot, service, key, blocked_ns, weight, now);)*
            const _: () = assert!([$($slot),*].len() == MAX_PROFILE_SESSIONS as usize);
        };
    }
    each_slot!(0 1 2 3 4 5 6 7);
}

#[inline(always)]
fn block_ended_in(slot: u32, service: u32, key: StackKey, blocked_ns: u64, weight: u64, now: u64) {
    let Some(session) = PROFILE_SESSIONS.get(slot) else {
        return;
    };
    if !wants(session, ProfileSession::OFF_CPU, service, key.pool) {
        return;
    }
    let since_start = now.saturating_sub(session.start_ns);
    add(
        &StackKey {
            session: session.id,
            ..key
        },
        weight,
        blocked_ns.min(since_start) * weight,
    );
}
