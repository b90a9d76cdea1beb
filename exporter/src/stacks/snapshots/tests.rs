//! Unit tests of `snapshots.rs`.
use std::path::Path;

use poolscope_shared::{SHORTENED_STACK, StackKey};

use super::*;
use poolscope_shared::LOST_FRAME_ADDRESS;

use crate::stacks::symbolize::LOST_INNERMOST_FRAME;

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
