//! How full the counted maps are ([`CountedMap`]): the kernel programs count the
//! entries they make and remove (`ENTRY_COUNTS`, per CPU), user space those it makes
//! and removes itself; a scrape adds the two up in one batch read, however many
//! entries the maps hold (walking their keys cost a syscall per entry).
use poolscope_shared::maps::{self, CountedMap};

use super::{Kernel, KernelError};

impl Kernel {
    /// Counts entries user space made in `map` (`change` > 0) or removed (< 0).
    pub(super) fn count_own_entries(&mut self, map: CountedMap, change: i64) {
        self.own_entries[map as usize] += change;
    }

    /// The entries of each counted map, in [`CountedMap::ALL`]'s order.
    pub(super) fn counted_entries(&self) -> Result<[u64; CountedMap::COUNT as usize], KernelError> {
        let mut sums = self.own_entries;
        self.batch
            .entry_counts
            .array_each::<i64>(0..CountedMap::COUNT, self.cpus, |slot, count| {
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
}
