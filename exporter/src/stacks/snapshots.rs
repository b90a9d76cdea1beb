//! Stack snapshots (DESIGN §1, stacks): the kernel counts on-CPU samples and off-CPU
//! blocks per stack in one of three generations; a drained generation is turned
//! into symbolized [`StackRecord`]s and added to the current window; every interval
//! (or when a service stays saturated) the window becomes a [`Snapshot`], and the
//! last ones are kept within a count and a memory limit. All of it runs on a timer,
//! never on the scrape path.
use std::{
    collections::{BTreeMap, HashMap, HashSet, VecDeque},
    path::Path,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant, SystemTime},
};

use poolscope_shared::{Activity, StackCount, StackKey};
use serde::Serialize;

use crate::{
    discovery::procfs::{self, Mapping},
    stacks::profile::{Frame, OffCpuReason, ProfileMeta, StackKind, StackRecord},
    stacks::symbolize::{Symbol, Symbols, lookup_addresses},
};

/// Frame standing for a stack the kernel could not keep (its map bucket was taken,
/// or the block outlived its stack map): the weight stays visible.
pub const LOST_FRAME: &str = "[stack lost]";
/// Pool of a thread that was not named yet when sampled.
pub const UNNAMED_POOL: &str = "(unnamed)";

/// One generation read from the kernel, with the names it needs, before
/// symbolization (which happens outside the exporter's lock).
#[derive(Debug, Default)]
pub struct Drained {
    /// The generation drained.
    pub generation: u32,
    pub counts: Vec<(StackKey, StackCount)>,
    /// Stack id → addresses, innermost first.
    pub stacks: HashMap<i32, Vec<u64>>,
    /// (user stack id, caller path other than 0) → addresses, innermost first: the
    /// paths behind one frame-pointer stack that the kernel told apart.
    pub caller_paths: HashMap<(i32, u32), Vec<u64>>,
    /// Pool id → (service, pool) names.
    pub pools: HashMap<u32, (String, String)>,
    /// tgid → service name, for threads without a pool.
    pub processes: HashMap<u32, String>,
    /// tgid → its mappings as last read, to symbolize a process that has exited.
    pub mappings: HashMap<u32, Vec<Mapping>>,
}

impl Drained {
    /// The user stack of `key`: its caller path's own (never another path's).
    fn user_stack(&self, key: &StackKey) -> Option<&Vec<u64>> {
        if key.variant == 0 {
            self.stacks.get(&key.user_stack)
        } else {
            self.caller_paths.get(&(key.user_stack, key.variant))
        }
    }
}

/// The names of pools and processes seen in the last few drains. A drained
/// generation holds stacks up to two epochs old, whose process may have exited (and
/// its pool been forgotten) since; a name seen in the current drain wins.
#[derive(Debug, Default)]
pub struct RecentNames {
    pools: HashMap<u32, ((String, String), u64)>,
    processes: HashMap<u32, (String, u64)>,
    mappings: HashMap<u32, (Vec<Mapping>, u64)>,
    drains: u64,
}

impl RecentNames {
    /// Drains a name is kept after it was last seen: a snapshot drains twice, and a
    /// generation is drained two epochs after it was filled.
    const KEPT_DRAINS: u64 = 4;

    /// Remembers the names `drained` carries (and the mappings of its live
    /// processes, read under `procfs_root`) and adds those it lacks from recent
    /// drains.
    pub fn complete(&mut self, drained: &mut Drained, procfs_root: &Path) {
        self.drains += 1;
        let drains = self.drains;
        for (id, names) in &drained.pools {
            self.pools.insert(*id, (names.clone(), drains));
        }
        for (pid, service) in &drained.processes {
            self.processes.insert(*pid, (service.clone(), drains));
            let mappings = procfs::maps(procfs_root, *pid);
            if !mappings.is_empty() {
                self.mappings.insert(*pid, (mappings, drains));
            }
        }
        self.pools
            .retain(|_, (_, seen)| drains - *seen < Self::KEPT_DRAINS);
        self.processes
            .retain(|_, (_, seen)| drains - *seen < Self::KEPT_DRAINS);
        self.mappings
            .retain(|_, (_, seen)| drains - *seen < Self::KEPT_DRAINS);
        drained.mappings = self
            .mappings
            .iter()
            .map(|(pid, (mappings, _))| (*pid, mappings.clone()))
            .collect();
        for (id, (names, _)) in &self.pools {
            drained.pools.entry(*id).or_insert_with(|| names.clone());
        }
        for (pid, (service, _)) in &self.processes {
            drained
                .processes
                .entry(*pid)
                .or_insert_with(|| service.clone());
        }
    }
}

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
mod tests {

    use poolscope_shared::SHORTENED_STACK;

    use super::*;
    use crate::{kernel::LOST_FRAME_ADDRESS, stacks::symbolize::LOST_INNERMOST_FRAME};

    fn key(activity: Activity, pool: u32, user_stack: i32, kernel_stack: i32) -> StackKey {
        StackKey {
            generation: 0,
            activity: activity as u32,
            tgid: std::process::id(),
            pool,
            user_stack,
            kernel_stack,
            session: 0,
            variant: 0,
        }
    }

    fn count(count: u64, ns: u64) -> (u64, u64) {
        (count, ns)
    }

    fn drained(entries: &[(StackKey, (u64, u64))]) -> Drained {
        let here = drained as *const () as usize as u64;
        let mut drained = Drained {
            counts: entries
                .iter()
                .map(|(key, (count, ns))| {
                    (
                        *key,
                        StackCount {
                            count: *count,
                            ns: *ns,
                        },
                    )
                })
                .collect(),
            ..Drained::default()
        };
        // Stack 1: this function, called from an address no module maps.
        drained.stacks.insert(1, vec![here, 0x10]);
        drained
            .pools
            .insert(3, ("web".to_owned(), "workers".to_owned()));
        drained
            .processes
            .insert(std::process::id(), "web".to_owned());
        drained
    }

    #[test]
    fn drained_stacks_become_records_outermost_first() {
        let symbols = Symbols::new(Path::new("/proc"));
        let mut windows = StackWindows::new(SystemTime::UNIX_EPOCH, SessionWindows::default());
        windows.add(
            &drained(&[
                (key(Activity::Running, 3, 1, -1), count(5, 0)),
                (key(Activity::OffSleep, 3, 1, -1), count(2, 3_000_000)),
                (key(Activity::Running, u32::MAX, -1, -1), count(1, 0)),
            ]),
            &symbols,
        );
        // The same stack again in a later drain adds up.
        windows.add(
            &drained(&[(key(Activity::Running, 3, 1, -1), count(4, 0))]),
            &symbols,
        );
        let snapshot = windows.snapshot.finish(
            SystemTime::UNIX_EPOCH + Duration::from_secs(60),
            Trigger::Interval,
            100,
            1 << 20,
        );
        assert_eq!(snapshot.records.len(), 3);
        let cpu = &snapshot.records[0];
        assert_eq!(
            (cpu.service.as_str(), cpu.pool.as_str(), cpu.kind, cpu.count),
            ("web", "workers", StackKind::Cpu, 9)
        );
        assert_eq!(cpu.frames.len(), 2);
        // A return address is looked up (and named) one byte back.
        assert_eq!(cpu.frames[0].name, "0xf");
        assert!(cpu.frames[1].name.contains("drained"), "{:?}", cpu.frames);
        // Heaviest first: 1 sample at 100 Hz is 10 ms, more than the 3 ms block.
        let off = &snapshot.records[2];
        assert_eq!(off.kind, StackKind::OffCpu(OffCpuReason::Sleep));
        assert_eq!((off.count, off.ns), (2, 3_000_000));
        let lost = &snapshot.records[1];
        assert_eq!(lost.pool, UNNAMED_POOL);
        assert_eq!(lost.frames[0].name, LOST_FRAME);
        let summary = snapshot.summary();
        assert_eq!(summary.cpu_samples, 10);
        assert!((summary.offcpu_seconds - 0.003).abs() < 1e-12);
        assert_eq!(summary.ended_unix_seconds, 60.0);
        assert_eq!(snapshot.records(Some("web"), Some("workers")).len(), 2);
        assert!(snapshot.records(Some("db"), None).is_empty());
    }

    #[test]
    fn a_stack_kept_less_its_innermost_frame_says_so() {
        let here = drained as *const () as usize as u64;
        let shortened = 2 | SHORTENED_STACK;
        let mut drained = drained(&[(key(Activity::Running, 3, shortened, -1), count(3, 0))]);
        // What `Kernel::stack` reads for it: the marker, then the return addresses.
        drained
            .stacks
            .insert(shortened, vec![LOST_FRAME_ADDRESS, here + 1]);
        let symbols = Symbols::new(Path::new("/proc"));
        let frames = symbolized_frames(&drained, &symbols);
        let names: Vec<&str> = frames[0].iter().map(|frame| frame.name.as_str()).collect();
        // The caller's return address is looked up one byte back, as any caller's.
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names[0].contains("drained"), "{names:?}");
        assert_eq!(names[1], LOST_INNERMOST_FRAME);
        assert_eq!(symbols.unnamed().user, 0, "the marker is no unnamed frame");
    }

    #[test]
    fn session_counts_go_to_their_session_only() {
        let symbols = Symbols::new(Path::new("/proc"));
        let mut windows = StackWindows::new(SystemTime::UNIX_EPOCH, SessionWindows::default());
        windows.sessions.start(7, SystemTime::UNIX_EPOCH);
        let for_session = |id, samples| {
            (
                StackKey {
                    session: id,
                    ..key(Activity::Running, 3, 1, -1)
                },
                count(samples, 0),
            )
        };
        windows.add(
            &drained(&[
                (key(Activity::Running, 3, 1, -1), count(5, 0)),
                for_session(7, 3),
                // A session that ended before this drain: dropped.
                for_session(6, 100),
            ]),
            &symbols,
        );
        let samples = |records: &Records| records.records.iter().map(|r| r.count).sum::<u64>();
        let session = windows
            .sessions
            .take(7)
            .map(|w| w.into_records(99, 1 << 20));
        assert_eq!(session.as_ref().map(samples), Some(3));
        assert!(windows.sessions.take(7).is_none());
        assert_eq!(samples(&windows.snapshot.into_records(49, 1 << 20)), 5);
    }

    #[test]
    fn names_outlive_their_process_for_a_few_drains() {
        let mut names = RecentNames::default();
        let drain = |pools: &[(u32, &str)], processes: &[(u32, &str)]| Drained {
            pools: pools
                .iter()
                .map(|(id, pool)| (*id, ("web".to_owned(), (*pool).to_owned())))
                .collect(),
            processes: processes
                .iter()
                .map(|(pid, service)| (*pid, (*service).to_owned()))
                .collect(),
            ..Drained::default()
        };
        let mut first = drain(&[(1, "workers")], &[(10, "web")]);
        names.complete(&mut first, Path::new("/nonexistent"));
        // The process exited: its names still come with the next drains.
        let mut second = drain(&[], &[]);
        names.complete(&mut second, Path::new("/nonexistent"));
        assert_eq!(second.pools[&1].1, "workers");
        assert_eq!(second.processes[&10], "web");
        // A reused pool id takes the current name.
        let mut third = drain(&[(1, "io")], &[]);
        names.complete(&mut third, Path::new("/nonexistent"));
        assert_eq!(third.pools[&1].1, "io");
        for _ in 0..RecentNames::KEPT_DRAINS {
            names.complete(&mut drain(&[], &[]), Path::new("/nonexistent"));
        }
        let mut late = drain(&[], &[]);
        names.complete(&mut late, Path::new("/nonexistent"));
        assert!(late.pools.is_empty() && late.processes.is_empty());
    }

    #[test]
    fn tracing_frames_are_cut_from_kernel_stacks() {
        let frame = |name: &str| Frame {
            name: name.to_owned(),
            module: "[kernel]".to_owned(),
            address: 1,
            kernel: true,
        };
        let mut frames: Vec<Frame> = [
            "do_nanosleep",
            "schedule",
            "__schedule",
            "bpf_trace_run4",
            "bpf_prog_a171f69b431a67c4_sched_switch",
        ]
        .map(frame)
        .to_vec();
        without_tracing_frames(&mut frames);
        let names: Vec<&str> = frames.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["do_nanosleep", "schedule", "__schedule"]);
    }

    #[test]
    fn memory_limit_drops_the_lightest_stacks() {
        let symbols = Symbols::new(Path::new("/proc"));
        let mut windows = StackWindows::new(SystemTime::UNIX_EPOCH, SessionWindows::default());
        windows.add(
            &drained(&[
                (key(Activity::Running, 3, 1, -1), count(50, 0)),
                (key(Activity::OffIdle, 3, 1, -1), count(1, 1_000)),
            ]),
            &symbols,
        );
        let window = windows.snapshot;
        let full = Window {
            started: window.started,
            records: window.records.clone(),
        };
        let one = record_bytes(
            &full
                .finish(SystemTime::UNIX_EPOCH, Trigger::Interval, 100, 1 << 20)
                .records[0],
        );
        let snapshot = window.finish(SystemTime::UNIX_EPOCH, Trigger::Interval, 100, one);
        assert_eq!(snapshot.records.len(), 1);
        assert_eq!(snapshot.records[0].kind, StackKind::Cpu);
        assert_eq!(snapshot.records_dropped, 1);
    }

    fn empty_snapshot(bytes: u64) -> Snapshot {
        Snapshot {
            id: 0,
            trigger: Trigger::Interval,
            started: SystemTime::UNIX_EPOCH,
            ended: SystemTime::UNIX_EPOCH,
            sampling_hz: 49,
            records: Vec::new(),
            records_dropped: 0,
            bytes,
        }
    }

    #[test]
    fn snapshots_are_kept_within_count_and_memory() {
        let mut snapshots = Snapshots::new(3, 100);
        for _ in 0..4 {
            snapshots.push(empty_snapshot(10));
        }
        let ids: Vec<u64> = snapshots.summaries().iter().map(|s| s.id).collect();
        assert_eq!(ids, vec![2, 3, 4]);
        assert_eq!(snapshots.get(None).map(|s| s.id), Some(4));
        assert_eq!(snapshots.get(Some(3)).map(|s| s.id), Some(3));
        assert!(snapshots.get(Some(1)).is_none());
        // Over the memory limit: the oldest go, the newest stays even if alone.
        snapshots.push(empty_snapshot(90));
        let ids: Vec<u64> = snapshots.summaries().iter().map(|s| s.id).collect();
        assert_eq!(ids, vec![4, 5]);
        snapshots.push(empty_snapshot(500));
        let ids: Vec<u64> = snapshots.summaries().iter().map(|s| s.id).collect();
        assert_eq!(ids, vec![6]);
    }

    #[test]
    fn saturation_fires_once_per_episode() {
        let mut saturation = Saturation::default();
        let start = Instant::now();
        let at = |s: u64| start + Duration::from_secs(s);
        let depths = |d: u64| vec![("web".to_owned(), d), ("db".to_owned(), 0)];
        let second = Duration::from_secs(3);
        assert!(saturation.check(&depths(9), 8, second, at(0)).is_empty());
        assert!(saturation.check(&depths(9), 8, second, at(2)).is_empty());
        assert_eq!(saturation.check(&depths(9), 8, second, at(3)), vec!["web"]);
        assert!(saturation.check(&depths(9), 8, second, at(9)).is_empty());
        // At the threshold is not above it: the episode ends and re-arms.
        assert!(saturation.check(&depths(8), 8, second, at(10)).is_empty());
        assert!(saturation.check(&depths(20), 8, second, at(11)).is_empty());
        assert_eq!(
            saturation.check(&depths(20), 8, second, at(14)),
            vec!["web"]
        );
    }
}
