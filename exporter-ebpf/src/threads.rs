//! The thread state machine of DESIGN §3, fed by `sched.rs` (switches and wakeups)
//! and by `serving.rs` (a thread starts or stops serving a request). Each watched
//! thread's entry (its slot of `THREAD_ENTRIES`, or `THREADS` if another thread owns
//! the slot) holds its [`Activity`] since when; leaving an activity closes the
//! interval into the per-CPU stats of the thread's pool (a run-queue wait also into
//! the pool's run-queue histogram), and, while the thread holds requests, into their
//! components too.
use core::ptr::{read_volatile, write_volatile};

use aya_ebpf::bindings::{BPF_EXIST, BPF_NOEXIST};
use poolscope_shared::{
    Activity, NO_POOL, Peer, SLOT_CLAIMING, SLOT_OVERFLOW_ONE, Serving, StreamWorkers,
    THREAD_SLOTS, Thread, histogram_bucket, slot_claimant, slot_claiming, slot_overflow,
    slot_owner,
};

use crate::{
    downstream,
    maps::{
        E2BIG, EEXIST, POOL_EPOCH, POOL_RUNQUEUE, POOL_STATS, STREAM_WORKERS, THREAD_ENTRIES,
        THREAD_OWNERS, THREAD_POOLS, THREADS, atomic_add, compare_and_swap,
    },
};

/// `limits.thread_slots` − 1 (a power of two less one), set at load time.
#[unsafe(no_mangle)]
static THREAD_SLOT_MASK: u32 = THREAD_SLOTS - 1;

/// The slot of `tid` in `THREAD_ENTRIES` and `THREAD_OWNERS`.
#[inline(always)]
fn slot_of(tid: u32) -> u32 {
    // SAFETY: a load-time constant; volatile so that the compiler does not fold it.
    tid & unsafe { core::ptr::read_volatile(&THREAD_SLOT_MASK) }
}

/// The owner word of `slot`.
#[inline(always)]
fn owner_word(slot: u32) -> Option<&'static mut u64> {
    // SAFETY: a live array slot; other CPUs and user space change it atomically only.
    THREAD_OWNERS
        .get_ptr_mut(slot)
        .map(|word| unsafe { &mut *word })
}

/// The entry in `slot` of `THREAD_ENTRIES`.
#[inline(always)]
fn slot_entry(slot: u32) -> Option<&'static mut Thread> {
    // SAFETY: as for `thread`.
    THREAD_ENTRIES
        .get_ptr_mut(slot)
        .map(|thread| unsafe { &mut *thread })
}

/// Follows `tid` from now with `thread` (replacing a stale entry): in its slot if
/// the slot is free, else in `THREADS`, counted in the slot's word before the entry
/// exists so that no lookup misses it.
#[inline(always)]
pub fn follow(tid: u32, thread: &Thread) -> Result<(), i32> {
    let slot = slot_of(tid);
    let (Some(owner), Some(entry)) = (owner_word(slot), slot_entry(slot)) else {
        return Err(-E2BIG);
    };
    // Tried again by hand, as in `unfollow`.
    let mut claimed = claim(owner, entry, tid, thread);
    if claimed == Claim::Raced {
        claimed = claim(owner, entry, tid, thread);
    }
    if claimed == Claim::Owned {
        return Ok(());
    }
    atomic_add(owner, SLOT_OVERFLOW_ONE);
    match THREADS.insert(tid, thread, u64::from(BPF_NOEXIST)) {
        Ok(()) => Ok(()),
        Err(code) => {
            atomic_add(owner, SLOT_OVERFLOW_ONE.wrapping_neg());
            if code == -EEXIST {
                THREADS.insert(tid, thread, u64::from(BPF_EXIST))
            } else {
                Err(code)
            }
        }
    }
}

/// What one try at claiming a thread's slot did.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Claim {
    /// The slot is the thread's (its entry written, unless user space is writing it).
    Owned,
    /// Another thread owns the slot.
    Taken,
    /// The word changed between its read and the swap: worth another try.
    Raced,
}

#[inline(always)]
fn claim(owner: &mut u64, entry: &mut Thread, tid: u32, thread: &Thread) -> Claim {
    // SAFETY: an aligned u64 of a live map value.
    let word = unsafe { read_volatile(owner) };
    let owned_by = slot_claimant(word);
    if owned_by == tid {
        // Ours already (a stale entry): replaced, unless user space, which found the
        // thread running, is filling it right now.
        if slot_owner(word) == tid {
            *entry = *thread;
        }
        return Claim::Owned;
    }
    if owned_by != 0 {
        return Claim::Taken;
    }
    if !compare_and_swap(owner, word, slot_claiming(word, tid)) {
        return Claim::Raced;
    }
    *entry = *thread;
    atomic_add(owner, SLOT_CLAIMING.wrapping_neg());
    // A stale entry of the same tid (its exit unseen) would be read twice.
    if slot_overflow(word) != 0 && THREADS.remove(tid).is_ok() {
        atomic_add(owner, SLOT_OVERFLOW_ONE.wrapping_neg());
    }
    Claim::Owned
}

/// Stops following `tid`: its slot is freed, or its entry in `THREADS` goes and
/// then its count.
#[inline(always)]
pub fn unfollow(tid: u32) {
    let Some(owner) = owner_word(slot_of(tid)) else {
        return;
    };
    // Tried again by hand, not in a loop: Linux 6.1's verifier refused loops that
    // LLVM shaped with a fall-through back-edge (see `sessions.rs`).
    let mut released = release(owner, tid);
    if released == Release::Raced {
        released = release(owner, tid);
    }
    if released == Release::Raced {
        released = release(owner, tid);
    }
    if released != Release::NotOwner {
        return;
    }
    // SAFETY: as in `claim`.
    let word = unsafe { read_volatile(owner) };
    if slot_overflow(word) != 0 && THREADS.remove(tid).is_ok() {
        atomic_add(owner, SLOT_OVERFLOW_ONE.wrapping_neg());
    }
}

/// What one try at freeing a slot did.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Release {
    Freed,
    /// The slot is not the thread's: its entry, if any, is in `THREADS`.
    NotOwner,
    /// The word changed between its read and the swap (its overflow count moved, or
    /// another releaser won): worth another try.
    Raced,
}

#[inline(always)]
fn release(owner: &mut u64, tid: u32) -> Release {
    // SAFETY: as in `claim`.
    let word = unsafe { read_volatile(owner) };
    if tid == 0 || slot_owner(word) != tid {
        Release::NotOwner
    } else if compare_and_swap(owner, word, word - u64::from(tid)) {
        Release::Freed
    } else {
        Release::Raced
    }
}

/// The entry of a watched thread: for almost every thread we do not follow, one
/// inlined array read says there is none.
#[inline(always)]
pub fn thread(tid: u32) -> Option<&'static mut Thread> {
    let slot = slot_of(tid);
    // SAFETY: an aligned u64 of a live map value.
    let word = unsafe { read_volatile(THREAD_OWNERS.get(slot)?) };
    if slot_owner(word) == tid && tid != 0 {
        return slot_entry(slot);
    }
    if slot_overflow(word) == 0 {
        return None;
    }
    // SAFETY: entries are updated by the events of their own thread, which do not
    // run concurrently, and by cross-CPU events (wakeups, a request ended by another
    // thread) whose rare races cost one interval at most.
    THREADS
        .get_ptr_mut(tid)
        .map(|thread| unsafe { &mut *thread })
}

/// Ends the current interval of `thread` at `now` and starts `next`. A run-queue
/// wait that ends (runnable → running) also goes into the pool's histogram.
#[inline(always)]
pub fn change(tid: u32, thread: &mut Thread, next: Activity, now: u64) {
    let elapsed = now.saturating_sub(thread.since_ns);
    let raw_activity = thread.activity;
    let activity = Activity::from_u32(raw_activity);
    // The entry first: user space reads the pool stats before the entries, so a
    // reader between the two updates undercounts by one interval, never overcounts.
    thread.since_ns = now;
    thread.activity = next as u32;
    match activity {
        Activity::Running => thread.running_ns += elapsed,
        Activity::Runnable => thread.runnable_ns += elapsed,
        _ => {}
    }
    let downstream = thread.downstream;
    let wait_ended = activity == Activity::OffNetwork && next != Activity::OffNetwork;
    if wait_ended {
        thread.downstream = Peer::NONE;
    }
    let Some(pool) = pool(tid, thread) else {
        return;
    };
    if activity == Activity::OffNetwork && downstream.port != 0 {
        downstream::waited(pool, downstream, elapsed, wait_ended);
    }
    // SAFETY: per-CPU slot, no other writer while we run on this CPU.
    let Some(stats) = POOL_STATS
        .get_ptr_mut(pool)
        .map(|stats| unsafe { &mut *stats })
    else {
        return;
    };
    // The stored value masked, not `activity as usize`: the compiler knows the enum's
    // range and drops any bound on it, which Linux 6.1's verifier then cannot find.
    let index = raw_activity as usize & (Activity::COUNT - 1);
    stats.time_ns[index] += elapsed;
    let held = thread.serving.open();
    if held > 0 {
        stats.request_ns[index] += elapsed * u64::from(held);
    }
    if activity == Activity::Runnable
        && next == Activity::Running
        && let Some(runqueue) = POOL_RUNQUEUE.get_ptr_mut(pool)
    {
        // SAFETY: per-CPU slot, as above.
        let runqueue = unsafe { &mut *runqueue };
        if let Some(bucket) = runqueue.buckets.get_mut(histogram_bucket(elapsed)) {
            // Volatile, so that the compiler keeps the record before the count
            // (x86 keeps stores in order): a reader that sees the count finds it.
            // SAFETY: live map values of this CPU.
            unsafe {
                write_volatile(bucket, *bucket + 1);
                write_volatile(&mut runqueue.sum_ns, runqueue.sum_ns + elapsed);
                write_volatile(
                    &mut stats.runqueue_wait_ns,
                    stats.runqueue_wait_ns + elapsed,
                );
                write_volatile(&mut stats.runqueue_waits, stats.runqueue_waits + 1);
            }
        }
    }
}

/// `thread` (`tid`) exits: if it served, its pool counts one more thread that served
/// (user space counts the live ones).
#[inline(always)]
pub fn exits(tid: u32, thread: &mut Thread) {
    if thread.served == 0 {
        return;
    }
    let Some(pool) = pool(tid, thread) else {
        return;
    };
    if let Some(stats) = POOL_STATS.get_ptr_mut(pool) {
        // SAFETY: per-CPU slot, no other writer while we run on this CPU.
        unsafe { (*stats).served_exits += 1 };
    }
}

/// What `thread` holds when it blocks: its waits are a request's only if it holds
/// one that it did not hand to another thread.
#[inline(always)]
pub fn serving(thread: &Thread) -> Serving {
    if thread.serving.open() == 0 || thread.hands_off != 0 {
        // A worker that HTTP/2 streams are handed to serves streams another thread
        // read.
        let workers = STREAM_WORKERS.get(thread.service).copied().unwrap_or(0);
        let streams = if workers == StreamWorkers::Detect as u32 {
            thread.is_stream_worker()
        } else {
            workers == StreamWorkers::Every as u32
        };
        if streams {
            Serving::Streams
        } else {
            Serving::Nothing
        }
    } else if thread.multiplexes != 0 {
        Serving::Multiplexing
    } else {
        Serving::OneAtATime
    }
}

/// The pool of `thread` (`tid`), if it has one yet: the entry's own copy while no
/// thread's pool changed since it was read (an array read, not a hash lookup).
#[inline(always)]
pub fn pool(tid: u32, thread: &mut Thread) -> Option<u32> {
    // The epoch before the hash map: a change user space makes after this read
    // raises the epoch again, so the copy is read again at the next event.
    let current = POOL_EPOCH.get(0).copied().unwrap_or(0).wrapping_add(1);
    if thread.pool_epoch != current {
        thread.pool = pool_of(tid).unwrap_or(NO_POOL);
        thread.pool_epoch = current;
    }
    (thread.pool != NO_POOL).then_some(thread.pool)
}

/// The pool of thread `tid`, if it has one yet, from the hash map: for events that
/// may interrupt the thread's own (samples) or have no entry at hand.
#[inline(always)]
pub fn pool_of(tid: u32) -> Option<u32> {
    // SAFETY: copied out at once.
    unsafe { THREAD_POOLS.get(tid).copied() }
}
