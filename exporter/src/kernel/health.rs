//! The kernel's health counters, the health part of [`super::Kernel`]: the loss
//! counters (`LOSSES`, per CPU) and how full the counted maps are ([`CountedMap`]).
//! The kernel programs count the entries they make and remove (`ENTRY_COUNTS`, per
//! CPU), user space those it makes and removes itself; a scrape adds the two up in
//! one batch read, however many entries the maps hold (walking their keys cost a
//! syscall per entry).
use aya::Ebpf;
use poolscope_shared::{
    LOSSES_SIZE, LossErrno, LossSource, loss_index,
    maps::{self, CountedMap},
};

use super::{KernelError, batch::BatchMap};

/// The loss counters and entry counts, read whole at every scrape.
pub(super) struct Health {
    losses: BatchMap,
    entry_counts: BatchMap,
    /// Per [`CountedMap`]: the entries user space made less those it removed (the
    /// kernel's own are in `ENTRY_COUNTS`).
    own_entries: [i64; CountedMap::COUNT as usize],
}

impl Health {
    /// Opens `LOSSES` and `ENTRY_COUNTS` of `ebpf` for batch reads (both stay in it).
    pub fn take(ebpf: &Ebpf) -> Result<Self, KernelError> {
        Ok(Self {
            losses: BatchMap::named(ebpf, maps::LOSSES)?,
            entry_counts: BatchMap::named(ebpf, maps::ENTRY_COUNTS)?,
            own_entries: [0; CountedMap::COUNT as usize],
        })
    }

    /// Counts entries user space made in `map` (`change` > 0) or removed (< 0).
    pub fn count_own_entries(&mut self, map: CountedMap, change: i64) {
        self.own_entries[map as usize] += change;
    }

    /// The entries of each counted map, in [`CountedMap::ALL`]'s order, over `cpus`.
    pub fn counted_entries(
        &self,
        cpus: usize,
    ) -> Result<[u64; CountedMap::COUNT as usize], KernelError> {
        let mut sums = self.own_entries;
        self.entry_counts
            .array_each::<i64>(0..CountedMap::COUNT, cpus, |slot, count| {
                sums[slot] += count;
            })
            .map_err(|source| KernelError::Batch {
                map: maps::ENTRY_COUNTS,
                source,
            })?;
        // Each CPU's count may be negative (made on one CPU, removed on another), the
        // sum never is; a negative sum would be a bug in the counting, shown as 0.
        Ok(sums.map(|sum| u64::try_from(sum).unwrap_or(0)))
    }

    /// Every kernel-side loss counter, summed over `cpus`.
    pub fn losses(&self, cpus: usize) -> Result<Vec<(LossSource, LossErrno, u64)>, KernelError> {
        let mut sums = vec![0u64; LOSSES_SIZE as usize];
        self.losses
            .array_each::<u64>(0..LOSSES_SIZE, cpus, |index, lost| sums[index] += lost)
            .map_err(|source| KernelError::Batch {
                map: maps::LOSSES,
                source,
            })?;
        Ok(LossSource::ALL
            .into_iter()
            .flat_map(|source| LossErrno::ALL.map(|errno| (source, errno)))
            .map(|(source, errno)| {
                let lost = sums.get(loss_index(source, errno) as usize).copied();
                (source, errno, lost.unwrap_or(0))
            })
            .collect())
    }
}
