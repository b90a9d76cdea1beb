//! The thread array (`THREAD_ENTRIES`, `THREAD_OWNERS`) mapped into user space
//! ([`ThreadSlots`]): claiming and freeing the slots of threads found running, and
//! reading every entry for a scrape without a system call. The kernel claims and
//! frees slots with the same compare-and-swap on the owner words, whose layout is
//! `poolscope_shared`'s (`slot_owner`, `slot_overflow`, `SLOT_CLAIMING`).
use std::sync::atomic::{AtomicU64, Ordering};

use aya::Ebpf;
use poolscope_shared::{
    SLOT_CLAIMING, SLOT_OVERFLOW_ONE, Thread, maps, slot_claimant, slot_claiming, slot_overflow,
    slot_owner, thread_slot,
};

use super::{KernelError, mapping::Mapping};

/// The thread array as user space sees it.
#[derive(Debug)]
pub(super) struct ThreadSlots {
    owners: Mapping,
    entries: Mapping,
    slots: u32,
}

/// What claiming a thread's slot did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Claim {
    /// The slot is the thread's now, or was already (the kernel's entry is kept).
    Owned,
    /// Another thread owns the slot: the entry goes to `THREADS`, counted with
    /// [`ThreadSlots::count_overflow`].
    Taken,
}

impl ThreadSlots {
    /// Maps both arrays of `ebpf`, of `slots` entries each.
    pub fn map(ebpf: &Ebpf, slots: u32) -> Result<Self, KernelError> {
        Ok(Self {
            owners: Mapping::of(ebpf, maps::THREAD_OWNERS, slots, size_of::<u64>())?,
            entries: Mapping::of(ebpf, maps::THREAD_ENTRIES, slots, size_of::<Thread>())?,
            slots,
        })
    }

    fn slot(&self, tid: u32) -> usize {
        thread_slot(tid, self.slots) as usize
    }

    fn owner(&self, slot: usize) -> &AtomicU64 {
        debug_assert!(slot < self.slots as usize);
        // SAFETY: `slot` is below the array's size (a tid masked by it).
        unsafe { self.owners.word(slot) }
    }

    fn entry(&self, slot: usize) -> *mut Thread {
        // SAFETY: as in `owner`; entries are 144 bytes, a multiple of their alignment.
        unsafe { self.entries.base().cast::<Thread>().add(slot) }
    }

    /// Follows `tid` with `thread` in its slot if the slot is free.
    pub fn claim(&self, tid: u32, thread: &Thread) -> Claim {
        let slot = self.slot(tid);
        let owner = self.owner(slot);
        let mut word = owner.load(Ordering::Acquire);
        loop {
            // Claimed for the same thread (by the kernel at its creation, perhaps
            // right now): the kernel's entry is the one to keep.
            let owned_by = slot_claimant(word);
            if owned_by == tid {
                return Claim::Owned;
            }
            if owned_by != 0 {
                return Claim::Taken;
            }
            let claiming = slot_claiming(word, tid);
            match owner.compare_exchange(word, claiming, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                // Claimed meanwhile, or its overflow count moved: look again.
                Err(now) => word = now,
            }
        }
        // SAFETY: the slot is ours while it is marked claiming: no event reads it.
        unsafe { self.entry(slot).write_volatile(*thread) };
        owner.fetch_sub(SLOT_CLAIMING, Ordering::Release);
        Claim::Owned
    }

    /// How many followed threads of `tid`'s slot live in `THREADS`.
    pub fn overflow(&self, tid: u32) -> u32 {
        slot_overflow(self.owner(self.slot(tid)).load(Ordering::Acquire))
    }

    /// Counts one more (`true`) or one less followed thread of `tid`'s slot in
    /// `THREADS`.
    pub fn count_overflow(&self, tid: u32, more: bool) {
        let owner = self.owner(self.slot(tid));
        if more {
            owner.fetch_add(SLOT_OVERFLOW_ONE, Ordering::AcqRel);
        } else {
            owner.fetch_sub(SLOT_OVERFLOW_ONE, Ordering::AcqRel);
        }
    }

    /// Frees `tid`'s slot if it owns it: whether it did.
    pub fn release(&self, tid: u32) -> bool {
        if tid == 0 {
            return false;
        }
        let owner = self.owner(self.slot(tid));
        owner
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |word| {
                (slot_owner(word) == tid).then(|| word - u64::from(tid))
            })
            .is_ok()
    }

    /// Every slot's thread into `threads` (emptied first: a buffer kept from the last
    /// read, whose pages are not faulted in again each scrape), and how many followed
    /// threads live in `THREADS`.
    pub fn read_into(&self, threads: &mut Vec<(u32, Thread)>) -> u64 {
        threads.clear();
        let mut overflow = 0;
        for slot in 0..self.slots as usize {
            let owner = self.owner(slot);
            let word = owner.load(Ordering::Acquire);
            overflow += u64::from(slot_overflow(word));
            // Free, or being filled.
            let tid = slot_owner(word);
            if tid == 0 || tid != slot_claimant(word) {
                continue;
            }
            // SAFETY: a live slot of the mapping; the kernel may write it meanwhile
            // (a copy that mixes two updates of one thread is off by one interval,
            // as a map lookup's copy would be).
            let thread = unsafe { self.entry(slot).read_volatile() };
            // Freed or claimed again during the copy: not this thread's entry.
            if slot_owner(owner.load(Ordering::Acquire)) == tid {
                threads.push((tid, thread));
            }
        }
        overflow
    }
}
