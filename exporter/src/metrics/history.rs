//! Readings of cumulative counters kept over a sliding window, per id (a pool, a
//! service): the oldest reading kept is at least a window old, the base a window's
//! difference is taken from. Shared by the pools' utilization and the services'
//! finished requests, which are read at the same ticks.
use std::{
    collections::VecDeque,
    time::{Duration, Instant},
};

use crate::idmap::IdMap;

#[derive(Debug)]
pub struct History<T> {
    readings: IdMap<u32, VecDeque<(Instant, T)>>,
    window: Duration,
}

impl<T: Copy> History<T> {
    pub fn new(window: Duration) -> Self {
        Self {
            readings: IdMap::default(),
            window,
        }
    }

    pub fn set_window(&mut self, window: Duration) {
        self.window = window;
    }

    /// Records `id`'s reading at `at`, keeping one reading at least a window old.
    pub fn push(&mut self, id: u32, at: Instant, value: T) {
        let readings = self.readings.entry(id).or_default();
        readings.push_back((at, value));
        while readings
            .get(1)
            .is_some_and(|(next, _)| at.duration_since(*next) >= self.window)
        {
            readings.pop_front();
        }
    }

    /// The reading a window ago (or the first, when younger than a window).
    pub fn base(&self, id: u32) -> Option<&(Instant, T)> {
        self.readings.get(&id)?.front()
    }

    /// Drops the readings of ids `keep` refuses.
    pub fn retain(&mut self, keep: impl Fn(u32) -> bool) {
        self.readings.retain(|&id, _| keep(id));
    }
}
