//! Reading processes and their listening sockets from a procfs root. The parsers are
//! pure functions over file contents (tested on fixtures); `scan` walks a root such as
//! `/proc`, or a fixture tree in tests, and tolerates processes vanishing mid-scan.
//!
//! A process in a Kubernetes pod's container also gets its pod's name: the container
//! runtime (containerd, CRI-O, cri-dockerd) puts `HOSTNAME=<pod hostname>` in every
//! container's environment, and the pod hostname is the pod name unless the pod sets
//! `spec.hostname` (kubelet cuts it to 63 characters). It is only trusted when the
//! process has a UTS namespace of its own: a `hostNetwork` pod shares the host's, and
//! its HOSTNAME is the node's name.
use std::{
    collections::{HashMap, HashSet},
    fs, io,
    net::SocketAddr,
    path::{Path, PathBuf},
};

mod containers;
mod own;
mod sockets;

use crate::discovery::sockdiag::ListenQueue;
use containers::read_pod_name;
pub use containers::*;
pub use own::*;
pub use sockets::*;

/// What discovery needs to know about one process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcInfo {
    pub pid: u32,
    pub ppid: u32,
    /// Clock ticks after boot (`/proc/<pid>/stat` field 22); with the pid it names
    /// one process even when the pid is reused.
    pub start_time: u64,
    pub comm: String,
    pub exe: Option<PathBuf>,
    /// cgroup v2 path (`0::<path>`), or the systemd v1 hierarchy's path.
    pub cgroup: String,
    /// The Kubernetes pod's hostname (its name, normally) when the cgroup is a pod
    /// container's and the environment says it (see the module comment).
    pub pod_name: Option<String>,
    /// Inodes of the listening TCP sockets among its open fds.
    pub listeners: Vec<u64>,
}

/// One scan of a procfs root.
#[derive(Clone, Debug, Default)]
pub struct ProcSnapshot {
    pub processes: Vec<ProcInfo>,
    /// Listening TCP sockets of every network namespace seen, by socket inode.
    pub listen_sockets: HashMap<u64, SocketAddr>,
    /// The network namespace (inode number) of each of `listen_sockets`, where the
    /// namespace link could be read.
    pub listen_namespaces: HashMap<u64, u32>,
    /// One process of each network namespace seen, to read its listen queues through.
    pub namespace_pids: HashMap<u32, u32>,
    /// A process holding each of `listen_sockets` (the first seen) and its fd there.
    pub listen_holders: HashMap<u64, (u32, u32)>,
    /// The listening sockets of each network namespace seen (by inode number).
    pub namespace_listeners: HashMap<u32, Vec<ListenQueue>>,
    /// Namespaces whose `net/tcp` tables the scan read (the others were known).
    pub tables_read: u64,
    /// Processes whose open files poolscope was not allowed to follow (EACCES):
    /// their listening sockets are unknown. One that exits mid-scan is not here.
    pub processes_unreadable: Vec<u32>,
    /// The listening sockets of every process whose open files were read or taken
    /// over (by pid), for the next scan.
    pub held: HashMap<u32, HeldSockets>,
    /// Processes whose open files were read (the others were taken over).
    pub fds_read: u64,
}

/// The sockets a process held at a scan, for the next to take over while no socket
/// on the host began or stopped listening (see [`Known`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeldSockets {
    /// With the pid, names the process: a pid reused by another is read again.
    pub start_time: u64,
    /// Whether it held any socket: a namespace's listeners are read through a
    /// process with sockets.
    pub any: bool,
    /// fd and inode of its sockets, by fd: every one while a scan reads them, the
    /// listening ones in a snapshot.
    pub sockets: Vec<(u32, u64)>,
}

/// What a scan may take over instead of reading it again.
#[derive(Clone, Debug, Default)]
pub struct Known {
    /// The listening sockets of network namespaces (by inode number).
    pub namespaces: HashMap<u32, Vec<ListenQueue>>,
    /// The sockets of processes (by pid) found by an earlier scan. Each is valid while
    /// no socket began or stopped listening since: a new listener or a closed one
    /// changes the set, and a process that gained one by fork is a new process. What
    /// it misses (a listener passed over a unix socket, or closed in one process of
    /// several that share it) lasts until the caller stops offering them.
    pub processes: HashMap<u32, HeldSockets>,
}

/// Fields of `/proc/<pid>/stat` we use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stat {
    pub comm: String,
    /// Field 3: R (running or runnable), S (interruptible sleep), D (uninterruptible), …
    pub state: char,
    pub ppid: u32,
    /// Field 9: the kernel's `PF_*` flags.
    pub flags: u64,
    pub start_time: u64,
}

/// `PF_EXITING` of include/linux/sched.h: set when a task begins to exit, before
/// `sched_process_exit`.
const PF_EXITING: u64 = 0x4;

impl Stat {
    /// The task has begun to exit (or is a zombie, or dead).
    pub fn exiting(&self) -> bool {
        self.flags & PF_EXITING != 0 || matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// A procfs text file that may hold a process or thread name: any bytes but NUL, so
/// invalid UTF-8 is replaced (U+FFFD) rather than hiding the process or thread.
pub fn read_lossy(path: &Path) -> Option<String> {
    fs::read(path)
        .ok()
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
}

/// Parses `/proc/<pid>/stat`. The comm sits in parentheses and may itself hold spaces
/// and parentheses, so fields are counted from the last `)`.
pub fn parse_stat(content: &str) -> Option<Stat> {
    let open = content.find('(')?;
    let close = content.rfind(')')?;
    let comm = content.get(open + 1..close)?.to_owned();
    // After ") " come field 3 (state), 4 (ppid), ... 22 (starttime).
    let mut fields = content.get(close + 1..)?.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    let ppid = fields.next()?.parse().ok()?;
    // Fields 5 to 8, then 9.
    let flags = fields.nth(4)?.parse().ok()?;
    // Fields 10 to 21, then 22.
    let start_time = fields.nth(12)?.parse().ok()?;
    Some(Stat {
        comm,
        state,
        ppid,
        flags,
        start_time,
    })
}

/// Reads one process; `None` if it vanished or is a kernel thread.
pub fn read_process(root: &Path, pid: u32) -> Option<ProcInfo> {
    let dir = root.join(pid.to_string());
    let stat = parse_stat(&read_lossy(&dir.join("stat"))?)?;
    // A zombie has exited (its parent has not reaped it yet): nothing to watch, and
    // watching it again would bring back what its exit cleaned up.
    if matches!(stat.state, 'Z' | 'X') {
        return None;
    }
    // Kernel threads have no exe and no fds worth looking at.
    let exe = fs::read_link(dir.join("exe")).ok();
    if exe.is_none() && stat.ppid == 2 {
        return None;
    }
    let cgroup = fs::read_to_string(dir.join("cgroup"))
        .map(|content| parse_cgroup(&content))
        .unwrap_or_else(|_| "/".to_owned());
    // Only pod containers' environments are read: the read costs, and elsewhere a
    // HOSTNAME means nothing.
    let pod_name = pod_container_id(&cgroup).and_then(|_| read_pod_name(root, pid));
    Some(ProcInfo {
        pid,
        ppid: stat.ppid,
        start_time: stat.start_time,
        comm: stat.comm,
        exe,
        cgroup,
        pod_name,
        listeners: Vec::new(),
    })
}

/// The start time of `pid` now, to check that a pid still names the same process.
pub fn start_time(root: &Path, pid: u32) -> Option<u64> {
    let content = read_lossy(&root.join(pid.to_string()).join("stat"))?;
    parse_stat(&content).map(|stat| stat.start_time)
}

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

/// Scans every process under `root` with its listening sockets. Listening sockets are
/// read once per network namespace, through a process inside it; those of a namespace
/// in `known` are taken from it instead, as are the sockets of a process in `known`
/// (the same pid started at the same time).
pub fn scan(root: &Path, mut known: Known) -> io::Result<ProcSnapshot> {
    let mut snapshot = ProcSnapshot::default();
    let mut namespaces_seen = HashSet::new();
    let mut pids: Vec<u32> = Vec::new();
    for entry in fs::read_dir(root)? {
        if let Some(pid) = entry?
            .file_name()
            .to_str()
            .and_then(|name| name.parse().ok())
        {
            pids.push(pid);
        }
    }
    // In pid order, as /proc lists them, whatever the root's file system does.
    pids.sort_unstable();
    for pid in pids {
        let Some(mut process) = read_process(root, pid) else {
            continue;
        };
        let dir = root.join(pid.to_string());
        let namespace = fs::read_link(dir.join("ns/net")).ok();
        let inum = namespace.as_deref().and_then(namespace_inode);
        let held = match known.processes.remove(&pid) {
            Some(held) if held.start_time == process.start_time => Some(held),
            _ => {
                snapshot.fds_read += 1;
                read_held(root, &process, &mut snapshot.processes_unreadable)
            }
        };
        let sockets = held.as_ref().map_or(&[][..], |held| &held.sockets);
        for &(fd, inode) in sockets {
            snapshot.listen_holders.entry(inode).or_insert((pid, fd));
        }
        process.listeners = sockets.iter().map(|&(_, inode)| inode).collect();
        // A namespace's listeners are read through its first process with sockets (a
        // read of its tables costs milliseconds, see `listening_tables`), and it is
        // seen once they are: a process that exits in between (or a namespace that
        // vanishes) leaves the namespace to its next process.
        if held.as_ref().is_some_and(|held| held.any) && !namespaces_seen.contains(&namespace) {
            let listening: io::Result<Vec<ListenQueue>> =
                match inum.and_then(|inum| known.namespaces.get(&inum)) {
                    Some(known) => Ok(known.clone()),
                    None => {
                        snapshot.tables_read += 1;
                        listen_queues_of(root, pid)
                    }
                };
            if let Ok(listening) = listening {
                namespaces_seen.insert(namespace);
                for queue in &listening {
                    snapshot.listen_sockets.insert(queue.inode, queue.addr);
                }
                if let Some(inum) = inum {
                    snapshot.namespace_pids.insert(inum, pid);
                    for queue in &listening {
                        snapshot.listen_namespaces.insert(queue.inode, inum);
                    }
                    snapshot.namespace_listeners.insert(inum, listening);
                }
            }
        }
        // Not kept when its fds could not be read: the next scan tries again.
        if let Some(held) = held {
            snapshot.held.insert(pid, held);
        }
        snapshot.processes.push(process);
    }
    // Keep only the sockets that listen; other fds were collected unfiltered above
    // because the namespace tables may be read after the process's fds.
    for process in &mut snapshot.processes {
        process
            .listeners
            .retain(|inode| snapshot.listen_sockets.contains_key(inode));
    }
    for held in snapshot.held.values_mut() {
        held.sockets
            .retain(|(_, inode)| snapshot.listen_sockets.contains_key(inode));
    }
    snapshot
        .listen_holders
        .retain(|inode, _| snapshot.listen_sockets.contains_key(inode));
    Ok(snapshot)
}

/// The sockets of `process` read from its fds, by fd; `None` if they cannot be read
/// (a process poolscope may not follow is added to `unreadable`).
fn read_held(root: &Path, process: &ProcInfo, unreadable: &mut Vec<u32>) -> Option<HeldSockets> {
    match socket_fds(root, process.pid) {
        Ok(sockets) => {
            let mut sockets: Vec<(u32, u64)> = sockets.into_iter().collect();
            sockets.sort_unstable();
            Some(HeldSockets {
                start_time: process.start_time,
                any: !sockets.is_empty(),
                sockets,
            })
        }
        Err(error) => {
            if error.kind() == io::ErrorKind::PermissionDenied {
                unreadable.push(process.pid);
            }
            None
        }
    }
}

/// What `/proc/<pid>/ns/pid` reads for a process of the host's (initial) pid
/// namespace: its inode is `PROC_PID_INIT_INO` (include/linux/proc_ns.h), fixed since
/// Linux 3.8.
const HOST_PID_NAMESPACE: &str = "pid:[4026531836]";

/// The procfs root is not (or may not be) the host pid namespace's.
#[derive(Debug, thiserror::Error)]
pub enum PidNamespaceError {
    #[error(
        "{root} lists the processes of pid namespace {found}, not the host's \
         ({HOST_PID_NAMESPACE}); the kernel probes report the host's pids, so nothing \
         poolscope finds there would be measured. Run poolscope in the host's pid \
         namespace (Kubernetes: hostPID: true; docker: --pid=host), or point \
         discovery.procfs_root at a mount of the host's /proc"
    )]
    Foreign { root: String, found: String },
    #[error(
        "cannot tell whether {link} is the host's pid namespace (reading it may need \
         CAP_SYS_PTRACE): {source}"
    )]
    Unreadable { link: String, source: io::Error },
}

/// Checks that `root` is a procfs of the host's pid namespace, through the
/// namespace of its pid 1 (the namespace's own init). poolscope itself may run in a
/// pid namespace of its own, as long as it reads the host's procfs.
pub fn check_host_pid_namespace(root: &Path) -> Result<(), PidNamespaceError> {
    let path = root.join("1/ns/pid");
    let link = fs::read_link(&path).map_err(|source| PidNamespaceError::Unreadable {
        link: path.display().to_string(),
        source,
    })?;
    let found = link.to_string_lossy();
    if found == HOST_PID_NAMESPACE {
        Ok(())
    } else {
        Err(PidNamespaceError::Foreign {
            root: root.display().to_string(),
            found: found.into_owned(),
        })
    }
}

/// One mapping of /proc/<pid>/maps that has a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// File offset of `start`.
    pub offset: u64,
    pub path: PathBuf,
}

/// The file-backed mappings of a /proc/<pid>/maps text.
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (start, end) = fields.next()?.split_once('-')?;
            let _permissions = fields.next()?;
            let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
            let _device = fields.next()?;
            let _inode = fields.next()?;
            let path = fields.collect::<Vec<_>>().join(" ");
            if !path.starts_with('/') {
                return None;
            }
            Some(Mapping {
                start: u64::from_str_radix(start, 16).ok()?,
                end: u64::from_str_radix(end, 16).ok()?,
                offset,
                path: PathBuf::from(path),
            })
        })
        .collect()
}

/// The file-backed mappings of process `pid` (empty if it is gone).
pub fn maps(root: &Path, pid: u32) -> Vec<Mapping> {
    std::fs::read_to_string(root.join(pid.to_string()).join("maps"))
        .map(|text| parse_maps(&text))
        .unwrap_or_default()
}

/// The C library that `pid` maps (glibc or musl), as a path in its mount namespace.
pub fn libc_path(root: &Path, pid: u32) -> Option<PathBuf> {
    libc_of(&maps(root, pid))
}

fn libc_of(mappings: &[Mapping]) -> Option<PathBuf> {
    mappings
        .iter()
        .find(|mapping| {
            mapping
                .path
                .file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| {
                    name.starts_with("libc.so")
                        || (name.starts_with("libc-") && name.ends_with(".so"))
                        || name.starts_with("ld-musl-")
                })
        })
        .map(|mapping| mapping.path.clone())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::discovery::procfs::containers::ENVIRON_READ_LIMIT;

    /// A /proc/<pid>/maps fixture: a binary, an anonymous mapping, glibc.
    pub(crate) const MAPS: &str = "\
55d0c0000000-55d0c0010000 r--p 00000000 08:01 1234 /usr/bin/server
55d0c0010000-55d0c0050000 r-xp 00010000 08:01 1234 /usr/bin/server
7f0000000000-7f0000001000 rw-p 00000000 00:00 0 
7f1000000000-7f1000100000 r-xp 00028000 08:01 99 /usr/lib/x86_64-linux-gnu/libc.so.6
";

    #[test]
    fn maps_and_the_libc_in_them() {
        let mappings = parse_maps(MAPS);
        assert_eq!(mappings.len(), 3);
        assert_eq!(
            mappings[1],
            Mapping {
                start: 0x55d0_c001_0000,
                end: 0x55d0_c005_0000,
                offset: 0x10000,
                path: PathBuf::from("/usr/bin/server"),
            }
        );
        assert_eq!(
            libc_of(&mappings),
            Some(PathBuf::from("/usr/lib/x86_64-linux-gnu/libc.so.6"))
        );
        let musl = parse_maps("7f00-7f10 r-xp 00000000 08:01 5 /lib/ld-musl-x86_64.so.1\n");
        assert_eq!(
            libc_of(&musl),
            Some(PathBuf::from("/lib/ld-musl-x86_64.so.1"))
        );
        // A static binary maps no libc.
        assert_eq!(libc_of(&mappings[..2]), None);
    }

    #[test]
    fn syscall_of_a_thread() {
        assert_eq!(
            parse_syscall("288 0x3 0x7ffd 0x7ffd 0x80800 0x0 0x0 0x7ffd 0x7f3a\n"),
            Some(288)
        );
        assert_eq!(parse_syscall("running\n"), None);
        assert_eq!(parse_syscall("-1 0x7ffd 0x7f3a\n"), None);
        assert_eq!(parse_syscall(""), None);
    }

    #[test]
    fn stat_with_parentheses_and_spaces_in_comm() {
        let content = "4242 (my (odd) name) S 17 4242 4242 0 -1 4194560 100 0 0 0 3 1 0 0 20 0 2 0 987654 1000 50 18446744073709551615";
        assert_eq!(
            parse_stat(content),
            Some(Stat {
                comm: "my (odd) name".into(),
                state: 'S',
                ppid: 17,
                flags: 4194560,
                start_time: 987654
            })
        );
        let exiting = content.replace(" 4194560 ", " 4194564 ");
        assert!(parse_stat(&exiting).is_some_and(|stat| stat.exiting()));
        assert!(parse_stat(content).is_some_and(|stat| !stat.exiting()));
    }

    #[test]
    fn tgid_from_status() {
        let status = "Name:\tworker-1\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4242\nNgid:\t0\nPid:\t4250\n";
        assert_eq!(parse_tgid(status), Some(4242));
        assert_eq!(parse_tgid("Name:\tx\n"), None);
    }

    #[test]
    fn stat_truncated_is_none() {
        assert_eq!(parse_stat("1 (init) S 0 1"), None);
    }

    pub(super) const CONTAINER: &str =
        "4f1c2a9be0d75c3e8a6b9d0f1e2c3b4a5968778695a4b3c2d1e0f9a8b7c6d5e4";

    /// What a fixture process looks like to [`read_process`] for the pod name.
    struct FixtureProcess<'a> {
        pid: u32,
        cgroup: &'a str,
        uts: &'a str,
        environ: &'a [u8],
    }

    fn make_fixture_process(root: &Path, process: &FixtureProcess) -> io::Result<()> {
        use std::os::unix::fs::symlink;
        let dir = root.join(process.pid.to_string());
        fs::create_dir_all(dir.join("ns"))?;
        fs::write(
            dir.join("stat"),
            format!(
                "{} (server) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5000 0 0",
                process.pid
            ),
        )?;
        fs::write(dir.join("cgroup"), format!("0::{}\n", process.cgroup))?;
        symlink("/usr/bin/server", dir.join("exe"))?;
        symlink(process.uts, dir.join("ns/uts"))?;
        fs::write(dir.join("environ"), process.environ)
    }

    /// The pod name comes from HOSTNAME in a pod container with a UTS namespace of its
    /// own, and from nowhere else.
    #[test]
    fn pod_name_of_fixture_processes() -> io::Result<()> {
        const HOST_UTS: &str = "uts:[4026531838]";
        const POD_UTS: &str = "uts:[4026532301]";
        let root = tempfile::tempdir()?;
        let pod_cgroup = format!(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod3e1a6e0c_5b1f_4d1e_9b4e_0d2f8c7a9b10.slice/cri-containerd-{CONTAINER}.scope"
        );
        let env = b"PATH=/usr/bin\0HOSTNAME=web-7d9f8c6b5-x2k4q\0HOME=/\0";
        // At the read limit: HOSTNAME whole before it, cut by it (what is left,
        // `web-7d9f8c`, would pass for a pod name), wholly after it.
        let mut before = env.to_vec();
        before.extend_from_slice(b"PAD=");
        before.resize(ENVIRON_READ_LIMIT + 10, b'x');
        let mut cut = b"PAD=".to_vec();
        cut.resize(ENVIRON_READ_LIMIT - 20, b'x');
        cut.extend_from_slice(b"\0HOSTNAME=web-7d9f8c6b5-x2k4q\0");
        let mut beyond = b"PAD=".to_vec();
        beyond.resize(ENVIRON_READ_LIMIT + 10, b'x');
        beyond.extend_from_slice(b"\0HOSTNAME=web-7d9f8c6b5-x2k4q\0");
        let processes = [
            (
                10,
                pod_cgroup.as_str(),
                POD_UTS,
                env.as_slice(),
                Some("web-7d9f8c6b5-x2k4q"),
            ),
            // hostNetwork pod: the host's UTS namespace, HOSTNAME is the node's name.
            (
                11,
                pod_cgroup.as_str(),
                HOST_UTS,
                b"HOSTNAME=node-1\0".as_slice(),
                None,
            ),
            (
                12,
                pod_cgroup.as_str(),
                POD_UTS,
                b"PATH=/usr/bin\0".as_slice(),
                None,
            ),
            (
                13,
                "/system.slice/docker-x.scope",
                POD_UTS,
                env.as_slice(),
                None,
            ),
            (
                14,
                pod_cgroup.as_str(),
                POD_UTS,
                b"HOSTNAME=Not A Pod\0".as_slice(),
                None,
            ),
            (15, pod_cgroup.as_str(), POD_UTS, cut.as_slice(), None),
            (16, pod_cgroup.as_str(), POD_UTS, beyond.as_slice(), None),
            (
                17,
                pod_cgroup.as_str(),
                POD_UTS,
                before.as_slice(),
                Some("web-7d9f8c6b5-x2k4q"),
            ),
        ];
        for (pid, cgroup, uts, environ, _) in processes {
            make_fixture_process(
                root.path(),
                &FixtureProcess {
                    pid,
                    cgroup,
                    uts,
                    environ,
                },
            )?;
        }
        // pid 1 cannot be read (a sandbox hides it): the exporter's own namespace.
        fs::create_dir_all(root.path().join("self/ns"))?;
        std::os::unix::fs::symlink(HOST_UTS, root.path().join("self/ns/uts"))?;
        for (pid, _, _, _, pod_name) in processes {
            let process = read_process(root.path(), pid).expect("fixture process");
            assert_eq!(process.pod_name.as_deref(), pod_name, "pid {pid}");
        }
        // With pid 1 readable, pid 1's namespace is the host's.
        make_fixture_process(
            root.path(),
            &FixtureProcess {
                pid: 1,
                cgroup: "/init.scope",
                uts: POD_UTS,
                environ: b"",
            },
        )?;
        assert_eq!(read_process(root.path(), 10).expect("pod").pod_name, None);
        assert_eq!(
            read_process(root.path(), 11)
                .expect("pod")
                .pod_name
                .as_deref(),
            Some("node-1")
        );
        Ok(())
    }

    /// A process under `root` in network namespace 4026531840, whose tables list one
    /// listener (inode 777 on 0.0.0.0:8080), and whose fds are `fds` as fdinfo shows
    /// them: a socket's inode on sockfs, or (`None`) another file.
    fn fixture_listener_process(
        root: &Path,
        pid: u32,
        ppid: u32,
        comm: &str,
        fds: &[Option<u64>],
    ) -> io::Result<()> {
        use std::os::unix::fs::symlink;
        let sockfs = sockets::sockfs_mount_id().expect("sockfs's mount id");
        let dir = root.join(pid.to_string());
        fs::create_dir_all(dir.join("fdinfo"))?;
        fs::create_dir_all(dir.join("net"))?;
        fs::create_dir_all(dir.join("ns"))?;
        fs::write(
            dir.join("stat"),
            format!(
                "{pid} ({comm}) S {ppid} 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {} 0 0",
                1000 + pid
            ),
        )?;
        fs::write(dir.join("cgroup"), "0::/system.slice/web.service\n")?;
        symlink("/usr/bin/web", dir.join("exe"))?;
        symlink("net:[4026531840]", dir.join("ns/net"))?;
        fs::write(
            dir.join("net/tcp"),
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 777 1 0 100 0 0 10 0\n",
        )?;
        for (i, socket) in fds.iter().enumerate() {
            // Not a socket: /dev/null's inode 5 on another mount, which happens to
            // equal a pipe's inode too.
            let (mount, inode) = socket.map_or((sockfs + 1, 5), |inode| (sockfs, inode));
            fs::write(
                dir.join("fdinfo").join(i.to_string()),
                format!("pos:\t0\nflags:\t02\nmnt_id:\t{mount}\nino:\t{inode}\n"),
            )?;
        }
        Ok(())
    }

    /// A scan takes over the sockets of the processes an earlier one found (same pid,
    /// same start) without reading their fds, and reads those of a reused pid.
    #[test]
    fn a_scan_takes_over_the_sockets_of_processes_it_knows() -> io::Result<()> {
        let root = tempfile::tempdir()?;
        fixture_listener_process(root.path(), 10, 1, "web", &[None, Some(777)])?;
        fixture_listener_process(root.path(), 11, 10, "web worker", &[None, Some(777)])?;
        fixture_listener_process(root.path(), 12, 1, "client", &[Some(900)])?;
        let first = scan(root.path(), Known::default())?;
        assert_eq!(first.fds_read, 3);
        let listening_at_fd_1 = |pid: u32| HeldSockets {
            start_time: 1000 + u64::from(pid),
            any: true,
            sockets: vec![(1, 777)],
        };
        let only_a_client = HeldSockets {
            start_time: 1012,
            any: true,
            sockets: Vec::new(),
        };
        assert_eq!(
            first.held,
            HashMap::from([
                (10, listening_at_fd_1(10)),
                (11, listening_at_fd_1(11)),
                (12, only_a_client.clone()),
            ])
        );

        // Pid 10's fds are no longer readable, and pid 11 is another process now,
        // with no socket.
        fs::remove_dir_all(root.path().join("10/fdinfo"))?;
        fs::remove_dir_all(root.path().join("11"))?;
        fixture_listener_process(root.path(), 11, 1, "cron", &[None])?;
        fs::write(
            root.path().join("11/stat"),
            "11 (cron) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5000 0 0",
        )?;
        let second = scan(
            root.path(),
            Known {
                processes: first.held,
                ..Known::default()
            },
        )?;
        assert_eq!(second.fds_read, 1, "only the reused pid's fds are read");
        let listeners = |pid| {
            second
                .processes
                .iter()
                .find(|p| p.pid == pid)
                .map(|p| p.listeners.clone())
        };
        assert_eq!(listeners(10), Some(vec![777]));
        assert_eq!(listeners(11), Some(Vec::new()));
        assert_eq!(second.listen_holders, HashMap::from([(777, (10, 1))]));
        assert_eq!(second.held.get(&12), Some(&only_a_client));
        assert_eq!(second.held.get(&11).map(|held| held.start_time), Some(5000));
        Ok(())
    }

    /// A fixture procfs root: two processes in one namespace, one listening.
    #[test]
    fn scan_fixture_root() -> io::Result<()> {
        use std::os::unix::fs::symlink;
        let root = tempfile::tempdir()?;
        let make = |pid, ppid, comm, fds: &[Option<u64>]| {
            fixture_listener_process(root.path(), pid, ppid, comm, fds)
        };
        make(10, 1, "web", &[None, Some(777), Some(778)])?;
        make(11, 10, "web worker", &[None])?;
        // Listed first, in the same namespace, and gone before its tables are read:
        // the namespace's listeners are read through the next process.
        make(9, 1, "leaving", &[Some(779)])?;
        fs::remove_dir_all(root.path().join("9/net"))?;
        // Alone in a namespace of its own, without sockets: its tables are not read.
        make(12, 1, "batch", &[None])?;
        fs::remove_file(root.path().join("12/ns/net"))?;
        symlink("net:[4026531999]", root.path().join("12/ns/net"))?;
        fs::create_dir_all(root.path().join("self"))?;

        // The namespace's listeners known already (sock_diag): its tables are not read.
        let listening = vec![ListenQueue {
            inode: 778,
            addr: "127.0.0.1:9090".parse().expect("addr"),
            depth: 0,
            limit: Some(128),
        }];
        let namespaces = HashMap::from([(4026531840, listening.clone())]);
        let known = Known {
            namespaces: namespaces.clone(),
            ..Known::default()
        };
        let snapshot = scan(root.path(), known)?;
        assert_eq!(snapshot.namespace_listeners, namespaces);
        assert_eq!(snapshot.tables_read, 0);
        assert_eq!(snapshot.listen_sockets.len(), 1, "{snapshot:?}");
        assert_eq!(snapshot.listen_namespaces.get(&778), Some(&4026531840));
        assert_eq!(
            snapshot.listen_holders,
            HashMap::from([(778, (10, 2))]),
            "pid 10 holds it at fd 2"
        );
        let web = snapshot.processes.iter().find(|p| p.pid == 10);
        assert_eq!(web.map(|p| p.listeners.clone()), Some(vec![778]));
        // Another namespace's: the tables are.
        let elsewhere = Known {
            namespaces: HashMap::from([(4026531841, listening)]),
            ..Known::default()
        };
        let mut snapshot = scan(root.path(), elsewhere)?;
        snapshot.processes.sort_by_key(|p| p.pid);
        assert_eq!(
            snapshot.listen_sockets.get(&777),
            Some(&"0.0.0.0:8080".parse().expect("addr"))
        );
        assert_eq!(snapshot.listen_namespaces.get(&777), Some(&4026531840));
        assert_eq!(snapshot.namespace_pids.len(), 1);
        // Pid 9's (gone) and pid 10's.
        assert_eq!(snapshot.tables_read, 2);
        assert_ne!(snapshot.namespace_pids.get(&4026531840), Some(&9));
        snapshot.processes.retain(|p| p.pid != 9 && p.pid != 12);
        assert_eq!(snapshot.processes.len(), 2);
        assert_eq!(snapshot.processes[0].listeners, vec![777]);
        assert_eq!(snapshot.processes[0].start_time, 1010);
        assert_eq!(snapshot.processes[1].comm, "web worker");
        assert_eq!(snapshot.processes[1].ppid, 10);
        assert!(snapshot.processes[1].listeners.is_empty());
        assert_eq!(snapshot.processes[1].cgroup, "/system.slice/web.service");
        Ok(())
    }

    #[test]
    fn only_a_procfs_of_the_host_pid_namespace_passes() -> io::Result<()> {
        use std::os::unix::fs::symlink;
        let root_with_init_in = |namespace: &str| -> io::Result<tempfile::TempDir> {
            let root = tempfile::tempdir()?;
            fs::create_dir_all(root.path().join("1/ns"))?;
            symlink(namespace, root.path().join("1/ns/pid"))?;
            Ok(root)
        };
        let host = root_with_init_in(HOST_PID_NAMESPACE)?;
        assert!(check_host_pid_namespace(host.path()).is_ok());

        let container = root_with_init_in("pid:[4026532412]")?;
        let error = check_host_pid_namespace(container.path())
            .expect_err("a container's procfs passed")
            .to_string();
        assert!(
            error.contains("pid:[4026532412]") && error.contains("hostPID: true"),
            "{error}"
        );

        let unreadable = tempfile::tempdir()?;
        assert!(matches!(
            check_host_pid_namespace(unreadable.path()),
            Err(PidNamespaceError::Unreadable { .. })
        ));
        Ok(())
    }
}
