//! The threads of a process: their tids, the syscall each is in, whether one is
//! exiting, the process a tid belongs to, and a thread's name.
use std::{fs, path::Path};

use super::{parse_stat, read_lossy};

/// The number of the syscall a thread is in, from `/proc/<pid>/task/<tid>/syscall`:
/// `None` when it runs in user space ("running") or is not in a syscall ("-1 …").
pub fn parse_syscall(content: &str) -> Option<u64> {
    content.split_whitespace().next()?.parse().ok()
}

/// (tid, syscall number) of each thread of `pid` that is inside a syscall now.
pub fn blocked_syscalls(root: &Path, pid: u32) -> Vec<(u32, u64)> {
    let Ok(tasks) = fs::read_dir(root.join(pid.to_string()).join("task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| {
            let tid = task.file_name().to_str()?.parse().ok()?;
            let number = parse_syscall(&fs::read_to_string(task.path().join("syscall")).ok()?)?;
            Some((tid, number))
        })
        .collect()
}

/// A thread of a process as `/proc/<pid>/task/<tid>/stat` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Task {
    pub tid: u32,
    pub comm: String,
    pub state: char,
}

/// Whether thread `tid` of `pid` has begun to exit or is gone.
pub fn task_exiting(root: &Path, pid: u32, tid: u32) -> bool {
    let path = root
        .join(pid.to_string())
        .join("task")
        .join(tid.to_string())
        .join("stat");
    read_lossy(&path)
        .and_then(|content| parse_stat(&content))
        .is_none_or(|stat| stat.exiting())
}

/// The threads of `pid` (empty if it vanished; threads that exit mid-read are skipped).
pub fn tasks(root: &Path, pid: u32) -> Vec<Task> {
    let Ok(entries) = fs::read_dir(root.join(pid.to_string()).join("task")) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let tid = entry.file_name().to_str()?.parse().ok()?;
            let stat = parse_stat(&read_lossy(&entry.path().join("stat"))?)?;
            Some(Task {
                tid,
                comm: stat.comm,
                state: stat.state,
            })
        })
        .collect()
}

/// The thread group (process) id in `/proc/<tid>/status`.
pub fn parse_tgid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("Tgid:"))?
        .trim()
        .parse()
        .ok()
}

/// The process of thread `tid` (`None` if it exited).
pub fn thread_group(root: &Path, tid: u32) -> Option<u32> {
    parse_tgid(&read_lossy(&root.join(tid.to_string()).join("status"))?)
}

/// The name of thread `tid` of any process (`/proc/<tid>` resolves for every tid).
pub fn thread_comm(root: &Path, tid: u32) -> Option<String> {
    let comm = read_lossy(&root.join(tid.to_string()).join("comm"))?;
    Some(comm.trim_end_matches('\n').to_owned())
}
