//! Reading processes and their listening sockets from a procfs root. The parsers are
//! pure functions over file contents (tested on fixtures); `scan` walks a root such as
//! `/proc`, or a fixture tree in tests, and tolerates processes vanishing mid-scan.
//!
//! A process in a Kubernetes pod's container also gets its pod's names: the kubelet's
//! (pod, namespace and container, from its log link: `pod_logs`) where the node lists
//! the container, else its pod's name from its environment: the container runtime
//! (containerd, CRI-O, cri-dockerd) puts `HOSTNAME=<pod hostname>` in every
//! container's environment, and the pod hostname is the pod name unless the pod sets
//! `spec.hostname` (kubelet cuts it to 63 characters). That is only trusted when the
//! process has a UTS namespace of its own: a `hostNetwork` pod shares the host's, and
//! its HOSTNAME is the node's name.
use std::{
    collections::{HashMap, HashSet},
    fs, io,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

mod containers;
mod mappings;
mod own;
mod sockets;
mod tasks;

use crate::discovery::{
    pod_logs::{ContainerNames, PodIndex},
    sockdiag::ListenQueue,
};
use containers::read_pod_name;
pub use containers::*;
pub use mappings::*;
pub use own::*;
pub use sockets::*;
pub use tasks::*;

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
    /// The names of its Kubernetes pod container, when its cgroup is one's and they
    /// are known (see the module comment).
    pub pod: Option<PodNames>,
    /// Inodes of the listening TCP sockets among its open fds.
    pub listeners: Vec<u64>,
}

/// What is known of a pod container's names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodNames {
    /// The kubelet's: pod, namespace and container.
    Kubelet(Arc<ContainerNames>),
    /// The pod's hostname from the container's environment: its name, unless the pod
    /// sets `spec.hostname`.
    Hostname(String),
}

impl PodNames {
    /// The pod's name.
    pub fn pod(&self) -> &str {
        match self {
            Self::Kubelet(names) => &names.pod,
            Self::Hostname(name) => name,
        }
    }
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

/// Reads one process, its pod container's names from `pods`; `None` if it
/// vanished or is a kernel thread.
pub fn read_process(root: &Path, pid: u32, pods: &PodIndex) -> Option<ProcInfo> {
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
    // Only pod containers' environments are read, and only those the kubelet's links
    // do not name: the read costs, and elsewhere a HOSTNAME means nothing.
    let pod = pod_container_id(&cgroup).and_then(|id| match pods.get(id) {
        Some(names) => Some(PodNames::Kubelet(names)),
        None => read_pod_name(root, pid).map(PodNames::Hostname),
    });
    Some(ProcInfo {
        pid,
        ppid: stat.ppid,
        start_time: stat.start_time,
        comm: stat.comm,
        exe,
        cgroup,
        pod,
        listeners: Vec::new(),
    })
}

/// The start time of `pid` now, to check that a pid still names the same process.
pub fn start_time(root: &Path, pid: u32) -> Option<u64> {
    let content = read_lossy(&root.join(pid.to_string()).join("stat"))?;
    parse_stat(&content).map(|stat| stat.start_time)
}

/// Scans every process under `root` with its listening sockets. Listening sockets are
/// read once per network namespace, through a process inside it; those of a namespace
/// in `known` are taken from it instead, as are the sockets of a process in `known`
/// (the same pid started at the same time).
pub fn scan(root: &Path, mut known: Known, pods: &PodIndex) -> io::Result<ProcSnapshot> {
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
        let Some(mut process) = read_process(root, pid, pods) else {
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

#[cfg(test)]
pub(crate) mod tests;
