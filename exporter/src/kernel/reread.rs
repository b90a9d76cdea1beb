//! Values of per-id kernel arrays kept from their last read with the id's counter as
//! read before them (a service's finished requests, a pool's lock waits), so that a
//! scrape reads again only the ids whose counter moved: each value is kilobytes of
//! fine buckets (per CPU for the run-queue waits), and most services and pools of a
//! node record nothing between two scrapes. The kernel counts after it records, so
//! a value read after its counter holds at least what the counter says, and a
//! record that lands between the two reads moves the counter for the next scrape.
//! Values come from batch reads (`refresh`, `refresh_sums`) or a mapping
//! (`refresh_mapped`).
use std::{collections::BTreeMap, convert::Infallible, io, sync::Arc};

use aya::Pod;

use super::batch::BatchMap;

#[derive(Debug)]
pub(super) struct Reread<V> {
    read: BTreeMap<u32, (u64, Arc<V>)>,
}

impl<V> Default for Reread<V> {
    fn default() -> Self {
        Self {
            read: BTreeMap::new(),
        }
    }
}

impl<V> Reread<V> {
    /// Brings the values up to `counts` (each id with its counter, read before the
    /// values): `read` reads the ids whose counter moved since their last read, kept
    /// at that count; ids not in `counts` are forgotten.
    pub fn refresh<Values, Error>(
        &mut self,
        counts: &[(u32, u64)],
        read: impl FnOnce(&[u32]) -> Result<Values, Error>,
    ) -> Result<(), Error>
    where
        Values: IntoIterator<Item = (u32, Arc<V>)>,
    {
        let moved = self.moved(counts.iter().copied());
        let counted: BTreeMap<u32, u64> = counts.iter().copied().collect();
        for (id, value) in read(&moved)? {
            if let Some(&count) = counted.get(&id) {
                self.keep(id, count, value);
            }
        }
        self.retain(|id| counted.contains_key(&id));
        Ok(())
    }

    /// [`Self::refresh`] from a per-CPU array (`batch`, `cpus` values per id, summed
    /// with `add`); the values of the ids in `counts`, shared with this copy.
    pub fn refresh_sums(
        &mut self,
        counts: &[(u32, u64)],
        batch: &BatchMap,
        cpus: usize,
        add: impl Fn(&mut V, &V),
    ) -> io::Result<BTreeMap<u32, Arc<V>>>
    where
        V: Pod + Default,
    {
        self.refresh(counts, |moved| {
            let sums = batch.sum_by_id::<V>(moved, cpus, add)?;
            Ok::<_, io::Error>(sums.into_iter().map(|(id, sum)| (id, Arc::new(sum))))
        })?;
        Ok(self.shared(counts))
    }

    /// [`Self::refresh`] from a mapped array (`get` copies an id's value, `None`
    /// past its end); the values of the ids in `counts`, shared with this copy.
    pub fn refresh_mapped(
        &mut self,
        counts: &[(u32, u64)],
        get: impl Fn(u32) -> Option<Arc<V>>,
    ) -> BTreeMap<u32, Arc<V>> {
        let read = |moved: &[u32]| {
            let values: Vec<_> = moved
                .iter()
                .filter_map(|&id| Some((id, get(id)?)))
                .collect();
            Ok::<_, Infallible>(values)
        };
        match self.refresh(counts, read) {
            Ok(()) => self.shared(counts),
            Err(never) => match never {},
        }
    }

    /// The values of the ids in `counts`, shared with this copy.
    fn shared(&self, counts: &[(u32, u64)]) -> BTreeMap<u32, Arc<V>> {
        counts
            .iter()
            .filter_map(|&(id, _)| Some((id, Arc::clone(self.get(id)?))))
            .collect()
    }

    /// Of `counts` (id, its counter now), the ids whose value was not read since the
    /// counter last moved.
    fn moved(&self, counts: impl IntoIterator<Item = (u32, u64)>) -> Vec<u32> {
        counts
            .into_iter()
            .filter(|(id, count)| self.read.get(id).is_none_or(|(read, _)| read != count))
            .map(|(id, _)| id)
            .collect()
    }

    /// Keeps `value` of `id`, read after its counter was `count`.
    fn keep(&mut self, id: u32, count: u64, value: Arc<V>) {
        self.read.insert(id, (count, value));
    }

    pub fn get(&self, id: u32) -> Option<&Arc<V>> {
        self.read.get(&id).map(|(_, value)| value)
    }

    /// Forgets `id` (its kernel entry was reset for a new owner).
    pub fn forget(&mut self, id: u32) {
        self.read.remove(&id);
    }

    /// Forgets the ids for which `live` is false.
    fn retain(&mut self, live: impl Fn(u32) -> bool) {
        self.read.retain(|&id, _| live(id));
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::Reread;

    #[test]
    fn only_ids_whose_counter_moved_are_read_again() {
        let mut values = Reread::default();
        assert_eq!(values.moved([(1, 0), (2, 5)]), vec![1, 2], "never read");
        values.keep(1, 0, Arc::new("one"));
        values.keep(2, 5, Arc::new("two"));
        assert_eq!(values.moved([(1, 0), (2, 5)]), Vec::<u32>::new());
        assert_eq!(values.moved([(1, 0), (2, 6)]), vec![2]);
        values.keep(2, 6, Arc::new("two, later"));
        assert_eq!(values.get(2).map(|value| **value), Some("two, later"));
        values.forget(1);
        assert_eq!(values.moved([(1, 0)]), vec![1], "reset for a new owner");
        values.retain(|id| id != 2);
        assert!(values.get(2).is_none());
    }
}
