//! The stack service: the windows being collected (the next snapshot's and each
//! profiling session's), the finished snapshots, and saturation tracking. Its
//! collector lock comes first in the lock order: a drain holds it while it takes the
//! core lock to read the kernel.
use std::{
    path::PathBuf,
    sync::{Arc, Mutex, MutexGuard, RwLock},
    time::{Duration, Instant, SystemTime},
};

use super::{Core, health::Health, lock_or_recover};
use crate::{
    config::Settings,
    metrics::locks::LockReport,
    stacks::{
        repairs::StackRepairs,
        snapshots::{
            Drained, RecentNames, Saturation, SessionWindows, Snapshot, SnapshotSummary, Snapshots,
            StackWindows, Trigger, Window,
        },
        unwind::UnwindStats,
    },
};

/// Between the two epoch advances of a snapshot: longer than any kernel program
/// that read the old epoch takes to finish.
const EPOCH_SETTLE: Duration = Duration::from_millis(5);

/// The stack windows being collected. Each drain symbolizes with a symbolizer of its
/// own (blazesym's is not `Send`), so its cache lives as long as one drain.
struct StackCollector {
    windows: StackWindows,
    names: RecentNames,
    saturation: Saturation,
}

pub(super) struct Stacks {
    /// A panic mid-window leaves a window that is still valid to add to.
    collector: Mutex<StackCollector>,
    /// The same as the collector's session windows, reached without its lock.
    session_windows: SessionWindows,
    snapshots: RwLock<Snapshots>,
    /// The frames frame-pointer walks skipped, found in the kernel's stack copies.
    /// Taken alone, or under the collector's lock; never while holding `core`.
    repairs: Mutex<StackRepairs>,
    /// The unwinder's counts as of its last copies: a scrape reads these, never
    /// waiting for an unwind (a module's tables are read at its first one).
    unwind_stats: Mutex<UnwindStats>,
    procfs_root: PathBuf,
}

impl Stacks {
    pub fn new(settings: &Settings) -> Self {
        let session_windows = SessionWindows::default();
        Self {
            collector: Mutex::new(StackCollector {
                windows: StackWindows::new(SystemTime::now(), session_windows.clone()),
                names: RecentNames::default(),
                saturation: Saturation::default(),
            }),
            session_windows,
            snapshots: RwLock::new(Snapshots::new(
                settings.snapshots.keep,
                settings.snapshots.memory_limit_bytes,
            )),
            repairs: Mutex::new(StackRepairs::new(settings.snapshots.unwind_memory_bytes)),
            unwind_stats: Mutex::default(),
            procfs_root: settings.procfs_root.clone(),
        }
    }

    fn collector(&self) -> MutexGuard<'_, StackCollector> {
        lock_or_recover(&self.collector)
    }

    pub fn set_limits(&self, keep: usize, memory_limit_bytes: u64, unwind_memory_bytes: u64) {
        self.snapshots
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .set_limits(keep, memory_limit_bytes);
        lock_or_recover(&self.repairs)
            .unwinder
            .set_memory_limit(unwind_memory_bytes);
    }

    /// Unwinds the stack copies the kernel made since the last call (outside the
    /// core lock: unwinding reads the modules' tables).
    fn read_copies(&self, core: &Mutex<Core>) {
        let copies = lock_or_recover(core).kernel.stack_copies();
        if !copies.is_empty() {
            let mut repairs = lock_or_recover(&self.repairs);
            repairs.add(&copies, &self.procfs_root);
            *lock_or_recover(&self.unwind_stats) = repairs.unwinder.stats();
        }
    }

    /// The generation no program can add to any more, drained, named and with the
    /// frames its walks skipped put back; the kernel gets the hints that tell the
    /// callers behind one walk apart.
    fn drain_one(&self, collector: &mut StackCollector, core: &Mutex<Core>) -> Drained {
        self.read_copies(core);
        let mut drained = lock_or_recover(core).drain_generation();
        collector.names.complete(&mut drained, &self.procfs_root);
        let paths = drained
            .counts
            .iter()
            .map(|(key, _)| (key.user_stack, key.variant));
        let repaired = lock_or_recover(&self.repairs).repair_generation(
            drained.generation,
            &mut drained.stacks,
            paths,
        );
        drained.caller_paths = repaired.caller_paths;
        if !repaired.hints.is_empty() {
            lock_or_recover(core)
                .kernel
                .set_stack_hints(&repaired.hints);
        }
        drained
    }

    /// Puts the frames their walks skipped back into the stacks of `locks`
    /// (`/debug/locks`).
    pub fn repair_lock_stacks(&self, core: &Mutex<Core>, locks: &mut [LockReport]) {
        self.read_copies(core);
        let repairs = lock_or_recover(&self.repairs);
        for stack in locks.iter_mut().flat_map(|lock| &mut lock.stacks) {
            stack.addresses =
                repairs.repair_lock(stack.stack_id, std::mem::take(&mut stack.addresses));
        }
    }

    /// The unwinder's counts as of its last copies.
    pub fn unwind_stats(&self) -> UnwindStats {
        lock_or_recover(&self.unwind_stats).clone()
    }

    /// Moves the stacks counted up to two epochs ago into the current windows
    /// (symbolized outside the core lock).
    pub fn drain(&self, core: &Mutex<Core>, health: &Health) {
        let mut collector = self.collector();
        let drained = self.drain_one(&mut collector, core);
        health.symbolize(&self.procfs_root, |symbols| {
            collector.windows.add(&drained, symbols);
        });
    }

    /// Brings every stack counted up to now into the windows: two epoch advances (an
    /// off-CPU block still in progress keeps its time but loses its stacks, counted
    /// in `events_lost_total`).
    fn drain_everything(
        &self,
        collector: &mut StackCollector,
        core: &Mutex<Core>,
        health: &Health,
    ) {
        let first = self.drain_one(collector, core);
        std::thread::sleep(EPOCH_SETTLE);
        let second = self.drain_one(collector, core);
        health.symbolize(&self.procfs_root, |symbols| {
            collector.windows.add(&first, symbols);
            collector.windows.add(&second, symbols);
        });
    }

    /// Ends the current window as a snapshot.
    pub fn take_snapshot(
        &self,
        trigger: Trigger,
        settings: &Settings,
        core: &Mutex<Core>,
        health: &Health,
    ) {
        let mut collector = self.collector();
        self.drain_everything(&mut collector, core, health);
        let now = SystemTime::now();
        let window = std::mem::replace(&mut collector.windows.snapshot, Window::new(now));
        drop(collector);
        let snapshot = window.finish(
            now,
            trigger,
            settings.snapshots.sampling_hz,
            settings.snapshots.memory_limit_bytes,
        );
        let summary = snapshot.summary();
        let id = self
            .snapshots
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(snapshot);
        tracing::debug!(
            id,
            stacks = summary.stacks,
            trigger = summary.trigger,
            "stack snapshot"
        );
    }

    /// The services whose queue depth has now stayed above `threshold` for
    /// `duration` (each reported once per episode).
    pub fn saturated(
        &self,
        depths: &[(String, u64)],
        threshold: u64,
        duration: Duration,
    ) -> Vec<String> {
        self.collector()
            .saturation
            .check(depths, threshold, duration, Instant::now())
    }

    /// Opens the window of profiling session `id`.
    pub fn start_session(&self, id: u32) {
        self.session_windows.start(id, SystemTime::now());
    }

    /// Closes the window of profiling session `id`: after draining everything the
    /// kernel counted if `drain` (the session ran), so that its last stacks count.
    pub fn end_session(
        &self,
        id: u32,
        drain: bool,
        core: &Mutex<Core>,
        health: &Health,
    ) -> Option<Window> {
        let mut collector = self.collector();
        if drain {
            self.drain_everything(&mut collector, core, health);
        }
        self.session_windows.take(id)
    }

    /// Drops the window of a session that ended without a profile.
    pub fn drop_session(&self, id: u32) {
        self.session_windows.take(id);
    }

    pub fn summaries(&self) -> Vec<SnapshotSummary> {
        self.snapshots
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .summaries()
    }

    /// Snapshot `id`, or the latest.
    pub fn snapshot(&self, id: Option<u64>) -> Option<Arc<Snapshot>> {
        self.snapshots
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(id)
    }
}
