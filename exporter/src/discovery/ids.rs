//! Dense ids `0..max` for keys (service names, pools), the indices of the kernel's
//! per-service and per-pool arrays. A freed id is reused by the next key; the caller
//! zeroes the kernel's counters of an id before handing it out again.
use std::{collections::HashMap, hash::Hash};

#[derive(Debug)]
pub struct DenseIds<K> {
    slots: Vec<Option<K>>,
    by_key: HashMap<K, u32>,
    max: u32,
}

impl<K: Clone + Eq + Hash> DenseIds<K> {
    pub fn new(max: u32) -> Self {
        Self {
            slots: Vec::new(),
            by_key: HashMap::new(),
            max,
        }
    }

    pub fn get(&self, key: &K) -> Option<u32> {
        self.by_key.get(key).copied()
    }

    /// The id of `key`, and whether it was allocated by this call; `None` when all
    /// `max` ids are taken.
    pub fn get_or_allocate(&mut self, key: &K) -> Option<(u32, bool)> {
        if let Some(id) = self.get(key) {
            return Some((id, false));
        }
        let id = match self.slots.iter().position(Option::is_none) {
            Some(free) => free as u32,
            None if (self.slots.len() as u32) < self.max => {
                self.slots.push(None);
                self.slots.len() as u32 - 1
            }
            None => return None,
        };
        self.slots[id as usize] = Some(key.clone());
        self.by_key.insert(key.clone(), id);
        Some((id, true))
    }

    pub fn key(&self, id: u32) -> Option<&K> {
        self.slots.get(id as usize)?.as_ref()
    }

    pub fn free(&mut self, id: u32) {
        if let Some(slot) = self.slots.get_mut(id as usize)
            && let Some(key) = slot.take()
        {
            self.by_key.remove(&key);
        }
    }

    /// Frees every id whose key fails `keep`.
    pub fn retain(&mut self, mut keep: impl FnMut(&K) -> bool) {
        for slot in &mut self.slots {
            if slot.as_ref().is_some_and(|key| !keep(key))
                && let Some(key) = slot.take()
            {
                self.by_key.remove(&key);
            }
        }
    }

    /// Every id in use with its key, in id order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &K)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(id, key)| Some((id as u32, key.as_ref()?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_dense_capped_and_reused_after_free() {
        let mut ids = DenseIds::new(2);
        assert_eq!(ids.get_or_allocate(&"a"), Some((0, true)));
        assert_eq!(ids.get_or_allocate(&"b"), Some((1, true)));
        assert_eq!(ids.get_or_allocate(&"a"), Some((0, false)));
        assert_eq!(ids.get_or_allocate(&"c"), None);
        ids.free(0);
        assert_eq!(ids.get(&"a"), None);
        assert_eq!(ids.get_or_allocate(&"c"), Some((0, true)));
        ids.retain(|key| *key != "b");
        assert_eq!(ids.iter().collect::<Vec<_>>(), vec![(0, &"c")]);
        assert_eq!(ids.key(1), None);
    }
}
