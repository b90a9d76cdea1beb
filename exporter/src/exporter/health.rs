//! The health service: the loss counters' history that `/healthz`, the log and the
//! `degraded` gauge follow, the series the cap dropped, and the addresses no stack
//! drain or lock report could name. Its two locks are leaves: taken last, briefly.
use std::{
    path::Path,
    sync::{
        Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use super::{Core, lock_or_recover};
use crate::{
    kernel::Probe,
    metrics::health::{Health as Verdict, HealthTracker, Loss},
    stacks::symbolize::{Symbols, Unnamed},
};

pub(super) struct Health {
    /// Its counters stay valid whatever a panic interrupted.
    tracker: Mutex<HealthTracker>,
    series_dropped: AtomicU64,
    /// Two counters: nothing a panic could leave half-written.
    unsymbolized: Mutex<Unnamed>,
    probes: Vec<Probe>,
}

impl Health {
    pub fn new(tracker: HealthTracker, probes: Vec<Probe>) -> Self {
        Self {
            tracker: Mutex::new(tracker),
            series_dropped: AtomicU64::new(0),
            unsymbolized: Mutex::new(Unnamed::default()),
            probes,
        }
    }

    /// Probes (attached or not) the kernel side has.
    pub fn probes(&self) -> &[Probe] {
        &self.probes
    }

    pub fn set_degraded_for(&self, degraded_for: Duration) {
        lock_or_recover(&self.tracker).set_degraded_for(degraded_for);
    }

    /// Runs `work` with a symbolizer of its own (blazesym's is not `Send`, so each
    /// drain or report makes one) and counts the addresses it left unnamed.
    pub fn symbolize<T>(&self, procfs_root: &Path, work: impl FnOnce(&Symbols) -> T) -> T {
        let symbols = Symbols::new(procfs_root);
        let result = work(&symbols);
        *lock_or_recover(&self.unsymbolized) += symbols.unnamed();
        result
    }

    /// Every loss counter now, with the kernel side's `kernel` and the series
    /// dropped so far (a scrape adds its own once capped).
    pub fn losses(
        &self,
        core: &Core,
        kernel: &[(
            poolscope_shared::LossSource,
            poolscope_shared::LossErrno,
            u64,
        )],
    ) -> Vec<Loss> {
        core.losses(
            kernel,
            self.series_dropped.load(Ordering::Relaxed),
            *lock_or_recover(&self.unsymbolized),
            &self.probes,
        )
    }

    /// Counts series a scrape dropped; the total so far.
    pub fn series_dropped(&self, dropped: u64) -> u64 {
        self.series_dropped.fetch_add(dropped, Ordering::Relaxed) + dropped
    }

    /// Records the loss counters now; the health they give (logging what changed).
    pub fn observe(&self, losses: &[Loss]) -> Verdict {
        lock_or_recover(&self.tracker).observe(Instant::now(), losses)
    }

    /// The health last observed.
    pub fn last(&self) -> Verdict {
        self.tracker().last().clone()
    }

    /// `/healthz`'s body.
    pub fn report(&self) -> String {
        let tracker = self.tracker();
        tracker.last().report(tracker.degraded_for())
    }

    fn tracker(&self) -> MutexGuard<'_, HealthTracker> {
        lock_or_recover(&self.tracker)
    }

    /// Reads every loss counter and updates the health (logging what changed).
    pub fn check(&self, core: &Core) {
        match core.kernel.losses() {
            Ok(kernel) => {
                let losses = self.losses(core, &kernel);
                self.observe(&losses);
            }
            Err(error) => tracing::warn!(%error, "reading the kernel's loss counters failed"),
        }
    }
}
