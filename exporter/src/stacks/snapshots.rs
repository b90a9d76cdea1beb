//! Stack snapshots (DESIGN §1, stacks): the kernel counts on-CPU samples and off-CPU
//! blocks per stack in one of three generations; a drained generation is turned
//! into symbolized [`StackRecord`]s and added to the current window; every interval
//! (or when a service stays saturated) the window becomes a [`Snapshot`], and the
//! last ones are kept within a count and a memory limit. All of it runs on a timer,
//! never on the scrape path.
use std::{
    collections::{BTreeMap, HashMap, HashSet, VecDeque},
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant, SystemTime},
};

use poolscope_shared::{Activity, StackCount};
use serde::Serialize;

pub use crate::stacks::drained::{Drained, RecentNames};
use crate::{
    stacks::profile::{Frame, OffCpuReason, ProfileMeta, StackKind, StackRecord},
    stacks::symbolize::{Symbol, Symbols, lookup_addresses},
};

/// Frame standing for a stack the kernel could not keep (its map bucket was taken,
/// or the block outlived its stack map): the weight stays visible.
pub const LOST_FRAME: &str = "[stack lost]";
/// Pool of a thread that was not named yet when sampled.
pub const UNNAMED_POOL: &str = "(unnamed)";

/// The off-CPU reason of an activity; `None` for on-CPU.
fn kind_of(activity: u32) -> StackKind {
    match Activity::from_u32(activity) {
        Activity::Running | Activity::Runnable => StackKind::Cpu,
        Activity::OffLock => StackKind::OffCpu(OffCpuReason::Lock),
        Activity::OffDisk => StackKind::OffCpu(OffCpuReason::Disk),
        Activity::OffNetwork => StackKind::OffCpu(OffCpuReason::Network),
        Activity::OffSleep => StackKind::OffCpu(OffCpuReason::Sleep),
        Activity::OffIdle => StackKind::OffCpu(OffCpuReason::Idle),
        Activity::OffOther => StackKind::OffCpu(OffCpuReason::Other),
    }
}

fn frame(symbol: &Symbol, address: u64, kernel: bool) -> Frame {
    Frame {
        name: symbol.name.clone(),
        module: symbol.module.clone(),
        address,
        kernel,
    }
}

fn lost_frame() -> Frame {
    Frame {
        name: LOST_FRAME.to_owned(),
        module: String::new(),
        address: 0,
        kernel: false,
    }
}

/// Symbolizes every stack of `drained`: each process's user addresses in one batch,
/// all kernel addresses in another. Returns, per count entry, its frames outermost
/// first.
fn symbolized_frames(drained: &Drained, symbols: &Symbols) -> Vec<Vec<Frame>> {
    let mut user: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    let mut kernel: Vec<u64> = Vec::new();
    for (key, _) in &drained.counts {
        if let Some(stack) = drained.user_stack(key) {
            user.entry(key.tgid)
                .or_default()
                .extend(lookup_addresses(stack));
        }
        if let Some(stack) = drained.stacks.get(&key.kernel_stack) {
            kernel.extend(lookup_addresses(stack));
        }
    }
    let mut names: HashMap<(u32, u64), Symbol> = HashMap::new();
    for (pid, mut addresses) in user {
        addresses.sort_unstable();
        addresses.dedup();
        let remembered = drained.mappings.get(&pid).map_or(&[][..], Vec::as_slice);
        for (address, symbol) in addresses
            .iter()
            .zip(symbols.user(pid, &addresses, remembered))
        {
            names.insert((pid, *address), symbol);
        }
    }
    kernel.sort_unstable();
    kernel.dedup();
    // Kernel addresses are keyed with pid 0, which no user process has.
    for (address, symbol) in kernel.iter().zip(symbols.kernel(&kernel)) {
        names.insert((0, *address), symbol);
    }
    let frames_of = |stack: &[u64], pid: u32, kernel: bool| -> Vec<Frame> {
        let mut frames: Vec<Frame> = stack
            .iter()
            .zip(lookup_addresses(stack))
            .filter_map(|(&address, lookup)| {
                names
                    .get(&(pid, lookup))
                    .map(|symbol| frame(symbol, address, kernel))
            })
            .collect();
        frames.reverse();
        frames
    };
    drained
        .counts
        .iter()
        .map(|(key, _)| {
            let mut frames = match drained.user_stack(key) {
                Some(stack) => frames_of(stack, key.tgid, false),
                None => vec![lost_frame()],
            };
            if let Some(stack) = drained.stacks.get(&key.kernel_stack) {
                let mut kernel = frames_of(stack, 0, true);
                without_tracing_frames(&mut kernel);
                frames.extend(kernel);
            }
            frames
        })
        .collect()
}

/// Removes the innermost kernel frames that are the tracing machinery itself (the
/// program and the tracepoint that ran it, at a `sched_switch` capture), so that
/// off-CPU stacks end where the thread blocked. `frames` are outermost first.
fn without_tracing_frames(frames: &mut Vec<Frame>) {
    const TRACING: [&str; 4] = ["bpf_prog_", "bpf_trace_run", "__bpf_trace_", "__traceiter_"];
    if let Some(first) = frames
        .iter()
        .position(|frame| TRACING.iter().any(|prefix| frame.name.starts_with(prefix)))
    {
        frames.truncate(first);
    }
}

type RecordKey = (String, String, StackKind, Vec<Frame>);

/// The stacks of one window (a snapshot's or a profiling session's), added up by
/// (service, pool, kind, frames).
#[derive(Debug)]
pub struct Window {
    started: SystemTime,
    records: HashMap<RecordKey, (u64, u64)>,
}

/// The records of a window, heaviest first, within a memory limit.
#[derive(Debug)]
pub struct Records {
    pub records: Vec<StackRecord>,
    /// Records left out to stay within the limit (the lightest).
    pub dropped: u64,
    pub bytes: u64,
}

impl Window {
    pub fn new(started: SystemTime) -> Self {
        Self {
            started,
            records: HashMap::new(),
        }
    }

    pub fn started(&self) -> SystemTime {
        self.started
    }

    fn add(&mut self, key: RecordKey, count: &StackCount) {
        let entry = self.records.entry(key).or_default();
        entry.0 += count.count;
        entry.1 += count.ns;
    }

    /// The records, heaviest first (on- and off-CPU alike in ns, a sample
    /// standing for one period at `sampling_hz`), cut to `memory_limit` bytes.
    pub fn into_records(self, sampling_hz: u32, memory_limit: u64) -> Records {
        let mut records: Vec<StackRecord> = self
            .records
            .into_iter()
            .map(|((service, pool, kind, frames), (count, ns))| StackRecord {
                service,
                pool,
                kind,
                frames,
                count,
                ns,
            })
            .collect();
        let period_ns = 1_000_000_000 / u64::from(sampling_hz.max(1));
        let weight = |record: &StackRecord| match record.kind {
            StackKind::Cpu => record.count * period_ns,
            StackKind::OffCpu(_) => record.ns,
        };
        records.sort_by(|a, b| {
            weight(b)
                .cmp(&weight(a))
                .then_with(|| a.frames.cmp(&b.frames))
        });
        let mut bytes = 0;
        let mut kept = 0;
        for record in &records {
            let size = record_bytes(record);
            if bytes + size > memory_limit {
                break;
            }
            bytes += size;
            kept += 1;
        }
        let dropped = records.len() - kept;
        records.truncate(kept);
        Records {
            records,
            dropped: dropped as u64,
            bytes,
        }
    }

    /// The window as a snapshot ending at `ended`, cut to `memory_limit` bytes (the
    /// lightest stacks go first, and are counted).
    pub fn finish(
        self,
        ended: SystemTime,
        trigger: Trigger,
        sampling_hz: u32,
        memory_limit: u64,
    ) -> Snapshot {
        let started = self.started;
        let Records {
            records,
            dropped,
            bytes,
        } = self.into_records(sampling_hz, memory_limit);
        Snapshot {
            id: 0,
            trigger,
            started,
            ended,
            sampling_hz,
            records,
            records_dropped: dropped,
            bytes,
        }
    }
}

/// Where drained stacks go: the snapshot window (session 0), or the window of the
/// profiling session they were counted for. Counts of a session that ended
/// (or whose client left) before its last drain are dropped with it.
#[derive(Debug)]
pub struct StackWindows {
    pub snapshot: Window,
    pub sessions: SessionWindows,
}

/// The profiling sessions' windows, by session id, behind their own lock: a session
/// starts without waiting for a drain, which holds the stack collector while it
/// symbolizes (a CI run measured 105 ms from request to first sample that way).
#[derive(Clone, Debug, Default)]
pub struct SessionWindows(Arc<Mutex<HashMap<u32, Window>>>);

impl SessionWindows {
    pub fn start(&self, id: u32, started: SystemTime) {
        self.lock().insert(id, Window::new(started));
    }

    pub fn take(&self, id: u32) -> Option<Window> {
        self.lock().remove(&id)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u32, Window>> {
        // A window is whole after every insert; a panic elsewhere leaves it usable.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl StackWindows {
    pub fn new(started: SystemTime, sessions: SessionWindows) -> Self {
        Self {
            snapshot: Window::new(started),
            sessions,
        }
    }

    /// Adds one drained generation, symbolized once for every window.
    pub fn add(&mut self, drained: &Drained, symbols: &Symbols) {
        let frames = symbolized_frames(drained, symbols);
        let mut sessions = self.sessions.lock();
        for ((key, count), frames) in drained.counts.iter().zip(frames) {
            let window = match key.session {
                0 => &mut self.snapshot,
                id => match sessions.get_mut(&id) {
                    Some(window) => window,
                    None => continue,
                },
            };
            let (service, pool) = match drained.pools.get(&key.pool) {
                Some((service, pool)) => (service.clone(), pool.clone()),
                None => (
                    drained
                        .processes
                        .get(&key.tgid)
                        .cloned()
                        .unwrap_or_default(),
                    UNNAMED_POOL.to_owned(),
                ),
            };
            window.add((service, pool, kind_of(key.activity), frames), count);
        }
    }
}

/// Estimated heap and inline size of a record.
fn record_bytes(record: &StackRecord) -> u64 {
    let frames: usize = record
        .frames
        .iter()
        .map(|frame| size_of::<Frame>() + frame.name.len() + frame.module.len())
        .sum();
    (size_of::<StackRecord>() + record.service.len() + record.pool.len() + frames) as u64
}

/// Why a snapshot was taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Trigger {
    Interval,
    /// This service's queue depth stayed above the threshold.
    Saturation(String),
}

/// The stacks of one window.
#[derive(Debug)]
pub struct Snapshot {
    /// Assigned by [`Snapshots::push`], from 1.
    pub id: u64,
    pub trigger: Trigger,
    pub started: SystemTime,
    pub ended: SystemTime,
    pub sampling_hz: u32,
    pub records: Vec<StackRecord>,
    /// Records left out to stay within the memory limit.
    pub records_dropped: u64,
    pub bytes: u64,
}

/// A snapshot in `/debug/snapshots`.
#[derive(Debug, Serialize)]
pub struct SnapshotSummary {
    pub id: u64,
    pub trigger: &'static str,
    pub service: Option<String>,
    pub started_unix_seconds: f64,
    pub ended_unix_seconds: f64,
    pub sampling_hz: u32,
    pub cpu_samples: u64,
    pub offcpu_seconds: f64,
    pub stacks: usize,
    pub stacks_dropped: u64,
    pub bytes: u64,
}

fn unix_seconds(time: SystemTime) -> f64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |since| since.as_secs_f64())
}

impl Snapshot {
    pub fn summary(&self) -> SnapshotSummary {
        let (trigger, service) = match &self.trigger {
            Trigger::Interval => ("interval", None),
            Trigger::Saturation(service) => ("saturation", Some(service.clone())),
        };
        let cpu = |record: &&StackRecord| record.kind == StackKind::Cpu;
        SnapshotSummary {
            id: self.id,
            trigger,
            service,
            started_unix_seconds: unix_seconds(self.started),
            ended_unix_seconds: unix_seconds(self.ended),
            sampling_hz: self.sampling_hz,
            cpu_samples: self.records.iter().filter(cpu).map(|r| r.count).sum(),
            offcpu_seconds: self
                .records
                .iter()
                .filter(|r| !cpu(r))
                .map(|r| r.ns)
                .sum::<u64>() as f64
                / 1e9,
            stacks: self.records.len(),
            stacks_dropped: self.records_dropped,
            bytes: self.bytes,
        }
    }

    /// The records of `service` and `pool` (each `None`: all).
    pub fn records(&self, service: Option<&str>, pool: Option<&str>) -> Vec<&StackRecord> {
        self.records
            .iter()
            .filter(|r| service.is_none_or(|s| r.service == s))
            .filter(|r| pool.is_none_or(|p| r.pool == p))
            .collect()
    }

    pub fn meta(&self) -> ProfileMeta {
        ProfileMeta {
            sampling_hz: self.sampling_hz,
            started: self.started,
            duration: self.ended.duration_since(self.started).unwrap_or_default(),
            comments: if self.records_dropped > 0 {
                vec![format!(
                    "poolscope: {} lightest stacks left out (stacks.memory_limit_bytes)",
                    self.records_dropped
                )]
            } else {
                Vec::new()
            },
        }
    }
}

/// The retained snapshots, oldest first.
#[derive(Debug)]
pub struct Snapshots {
    list: VecDeque<Arc<Snapshot>>,
    keep: usize,
    memory_limit: u64,
    next_id: u64,
}

impl Snapshots {
    pub fn new(keep: usize, memory_limit: u64) -> Self {
        Self {
            list: VecDeque::new(),
            keep,
            memory_limit,
            next_id: 1,
        }
    }

    /// A reload's limits, applied at the next push.
    pub fn set_limits(&mut self, keep: usize, memory_limit: u64) {
        self.keep = keep;
        self.memory_limit = memory_limit;
    }

    /// Keeps `snapshot` as the newest; the oldest go while over the limits.
    pub fn push(&mut self, mut snapshot: Snapshot) -> u64 {
        snapshot.id = self.next_id;
        self.next_id += 1;
        self.list.push_back(Arc::new(snapshot));
        while self.list.len() > self.keep
            || (self.list.len() > 1 && self.bytes() > self.memory_limit)
        {
            self.list.pop_front();
        }
        self.next_id - 1
    }

    fn bytes(&self) -> u64 {
        self.list.iter().map(|s| s.bytes).sum()
    }

    /// Snapshot `id`, or the newest.
    pub fn get(&self, id: Option<u64>) -> Option<Arc<Snapshot>> {
        match id {
            Some(id) => self.list.iter().find(|s| s.id == id).cloned(),
            None => self.list.back().cloned(),
        }
    }

    pub fn summaries(&self) -> Vec<SnapshotSummary> {
        self.list.iter().map(|s| s.summary()).collect()
    }
}

/// Watches each service's queue depth for a saturation snapshot: fires once when
/// it has been above the threshold for the duration, and again only after it went
/// back to or below the threshold.
#[derive(Debug, Default)]
pub struct Saturation {
    above_since: HashMap<String, Instant>,
    fired: HashSet<String>,
}

impl Saturation {
    /// The services that just became saturated, given every service's depth now.
    pub fn check(
        &mut self,
        depths: &[(String, u64)],
        threshold: u64,
        duration: Duration,
        now: Instant,
    ) -> Vec<String> {
        let above: HashSet<&str> = depths
            .iter()
            .filter(|(_, depth)| *depth > threshold)
            .map(|(service, _)| service.as_str())
            .collect();
        self.above_since
            .retain(|service, _| above.contains(service.as_str()));
        self.fired
            .retain(|service| above.contains(service.as_str()));
        let mut saturated = Vec::new();
        for service in above {
            let since = *self.above_since.entry(service.to_owned()).or_insert(now);
            if now.duration_since(since) >= duration && self.fired.insert(service.to_owned()) {
                saturated.push(service.to_owned());
            }
        }
        saturated.sort();
        saturated
    }
}

#[cfg(test)]
mod tests;
