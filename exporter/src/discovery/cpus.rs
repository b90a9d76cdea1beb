//! The CPUs a service may use, the CPU bound of its capacity: the CPU quotas of its
//! processes' cgroups (v2 `cpu.max`, or v1's `cpu.cfs_quota_us` where the `cpu`
//! controller is on a v1 hierarchy; the smallest on the way up to the root, added
//! over the service's distinct cgroups), the CPUs its processes may run
//! on (`Cpus_allowed_list`: cpusets and affinity masks), and the host's CPUs. Parsers
//! over configurable procfs and cgroupfs roots, tested on fixtures; read every
//! [`REFRESH`] per service, not at every scrape (a few files per service).
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fs,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use crate::{discovery::procfs, idmap::IdMap};

/// How long a service's CPU limit is used before it is read again (a quota changed
/// by `systemctl set-property` or a pod resize shows within this).
pub const REFRESH: Duration = Duration::from_secs(10);

/// Which limit on CPUs holds for a service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuBound {
    /// Its cgroups' `cpu.max` quotas.
    Quota,
    /// The CPUs its processes are allowed on, fewer than the host's.
    Cpuset,
    /// The host's CPUs.
    Host,
}

/// The CPUs a service may use and what limits them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuLimit {
    pub cpus: f64,
    pub bound: CpuBound,
}

/// A `cpu.max` file's quota in CPUs (`"150000 100000"` → 1.5); `None` for `max`
/// (no quota) or what does not parse.
pub fn parse_cpu_max(content: &str) -> Option<f64> {
    let mut fields = content.split_whitespace();
    let quota: f64 = fields.next()?.parse().ok()?;
    let period: f64 = fields.next()?.parse().ok()?;
    (quota > 0.0 && period > 0.0).then(|| quota / period)
}

/// The CPUs of a kernel CPU list (`"0-3,6"` → {0, 1, 2, 3, 6}); `None` if it does
/// not parse.
pub fn parse_cpu_list(list: &str) -> Option<BTreeSet<u32>> {
    let mut cpus = BTreeSet::new();
    for part in list.trim().split(',').filter(|part| !part.is_empty()) {
        let (first, last): (u32, u32) = match part.split_once('-') {
            Some((first, last)) => (first.parse().ok()?, last.parse().ok()?),
            None => {
                let cpu = part.parse().ok()?;
                (cpu, cpu)
            }
        };
        if last < first {
            return None;
        }
        cpus.extend(first..=last);
    }
    Some(cpus)
}

/// The CPUs a process may run on, from its `status`.
pub fn allowed_cpus(procfs_root: &Path, pid: u32) -> Option<BTreeSet<u32>> {
    let status = procfs::read_lossy(&procfs_root.join(pid.to_string()).join("status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("Cpus_allowed_list:"))
        .and_then(parse_cpu_list)
}

/// The host's CPUs: the `cpuN` lines of procfs's `stat`.
pub fn host_cpus(procfs_root: &Path) -> Option<u32> {
    let stat = procfs::read_lossy(&procfs_root.join("stat"))?;
    let cpus = stat
        .lines()
        .filter(|line| {
            line.strip_prefix("cpu")
                .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
        })
        .count();
    u32::try_from(cpus).ok().filter(|&cpus| cpus > 0)
}

/// Where a process's CPU quota is: the cgroup v1 `cpu` controller's hierarchy (its
/// mount under the cgroupfs root is named by its controllers, `cpu` or `cpu,cpuacct`)
/// when the process has one, else the v2 hierarchy; and the process's path in it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct CpuCgroup {
    /// `Some(mount)` for v1.
    v1_mount: Option<String>,
    path: String,
}

/// The CPU cgroup of a process from its `/proc/<pid>/cgroup`.
pub fn parse_cpu_cgroup(content: &str) -> CpuCgroup {
    let v1 = content.lines().find_map(|line| {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        controllers
            .split(',')
            .any(|controller| controller == "cpu")
            .then(|| (controllers.to_owned(), path.to_owned()))
    });
    match v1 {
        Some((mount, path)) => CpuCgroup {
            v1_mount: Some(mount),
            path,
        },
        None => CpuCgroup {
            v1_mount: None,
            path: procfs::parse_cgroup(content),
        },
    }
}

/// The quota in CPUs of one cgroup directory: v2's `cpu.max`, v1's
/// `cpu.cfs_quota_us` over `cpu.cfs_period_us` (-1: none).
fn quota_in(dir: &Path, v1: bool) -> Option<f64> {
    if !v1 {
        return parse_cpu_max(&procfs::read_lossy(&dir.join("cpu.max"))?);
    }
    let read =
        |name: &str| -> Option<f64> { procfs::read_lossy(&dir.join(name))?.trim().parse().ok() };
    let (quota, period) = (read("cpu.cfs_quota_us")?, read("cpu.cfs_period_us")?);
    (quota > 0.0 && period > 0.0).then(|| quota / period)
}

/// How deep under a hierarchy's root [`NamespaceRoot`] looks for an ancestor of
/// poolscope's cgroup namespace root (a pod's container sits at depth 4 under the
/// systemd driver: `kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid>.slice/
/// cri-containerd-<id>.scope`, so its ancestors at 3 or less).
const ANCESTOR_DEPTH: usize = 4;

/// Where poolscope's own cgroup namespace sits in the host's hierarchies. A process
/// outside that namespace (the host's and other pods', seen from a pod with a cgroup
/// namespace of its own: cgroup v2's default) shows its cgroup from the namespace's
/// root: up to the common ancestor, then down
/// (`/../../kubepods-besteffort-pod<uid>.slice/cri-containerd-<id>.scope`). With the
/// host's hierarchy mounted at the cgroupfs root, the ancestor `n` levels up is the
/// shallowest directory that holds the first component after the `..`s; found once
/// per hierarchy and `n` (the namespace root never moves), and looked for again when
/// a path through it is missing.
#[derive(Debug, Default)]
pub struct NamespaceRoot {
    /// (v1 mount or `None` for v2, levels up) → the ancestor, relative to the
    /// hierarchy's root.
    ancestors: HashMap<(Option<String>, usize), PathBuf>,
}

impl NamespaceRoot {
    /// `cgroup`'s directory relative to its hierarchy's root (mounted at
    /// `hierarchy`); `None` if its ancestor cannot be found there.
    fn locate(&mut self, hierarchy: &Path, cgroup: &CpuCgroup) -> Option<PathBuf> {
        let components: Vec<&str> = cgroup.path.split('/').filter(|c| !c.is_empty()).collect();
        let up = components.iter().take_while(|&&c| c == "..").count();
        let below: PathBuf = components[up..].iter().collect();
        if up == 0 {
            return Some(below);
        }
        let first = components.get(up)?;
        let key = (cgroup.v1_mount.clone(), up);
        if let Some(ancestor) = self.ancestors.get(&key) {
            let dir = ancestor.join(&below);
            if hierarchy.join(&dir).is_dir() {
                return Some(dir);
            }
        }
        let ancestor = shallowest_parent_of(hierarchy, first)?;
        let dir = ancestor.join(&below);
        self.ancestors.insert(key, ancestor);
        Some(dir)
    }
}

/// The shallowest directory under `hierarchy` (relative to it, at most
/// [`ANCESTOR_DEPTH`] deep) with a directory `child`.
fn shallowest_parent_of(hierarchy: &Path, child: &str) -> Option<PathBuf> {
    let mut level = vec![PathBuf::new()];
    for _ in 0..=ANCESTOR_DEPTH {
        let mut next = Vec::new();
        for dir in &level {
            let absolute = hierarchy.join(dir);
            if absolute.join(child).is_dir() {
                return Some(dir.clone());
            }
            let Ok(entries) = fs::read_dir(&absolute) else {
                continue;
            };
            next.extend(
                entries
                    .flatten()
                    .filter(|entry| entry.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|entry| dir.join(entry.file_name())),
            );
        }
        level = next;
    }
    None
}

/// The quota in CPUs of `cgroup`: the smallest of it and its ancestors under
/// `cgroupfs_root` (the root has none); `None` also where its directory cannot be
/// found.
pub fn cgroup_quota(
    cgroupfs_root: &Path,
    cgroup: &CpuCgroup,
    namespace: &mut NamespaceRoot,
) -> Option<f64> {
    let hierarchy = match &cgroup.v1_mount {
        Some(mount) => cgroupfs_root.join(mount),
        None => cgroupfs_root.to_path_buf(),
    };
    let path = namespace.locate(&hierarchy, cgroup)?;
    let mut dir = hierarchy;
    let mut quota: Option<f64> = None;
    for component in &path {
        dir.push(component);
        if let Some(cpus) = quota_in(&dir, cgroup.v1_mount.is_some()) {
            quota = Some(quota.map_or(cpus, |q| q.min(cpus)));
        }
    }
    quota
}

/// The CPUs the processes `pids` of one service may use: the sum of their distinct
/// cgroups' quotas (none if any of them has none), the CPUs any of them may run on,
/// the host's (`host`, [`host_cpus`]); whichever is least. `None` if no process could
/// be read.
pub fn service_cpus(
    (procfs_root, cgroupfs_root): (&Path, &Path),
    namespace: &mut NamespaceRoot,
    host: u32,
    pids: &[u32],
) -> Option<CpuLimit> {
    // One process per cgroup: a service's workers share their master's.
    let mut cgroups: BTreeMap<CpuCgroup, u32> = BTreeMap::new();
    for &pid in pids {
        let Some(content) = procfs::read_lossy(&procfs_root.join(pid.to_string()).join("cgroup"))
        else {
            continue;
        };
        cgroups.entry(parse_cpu_cgroup(&content)).or_insert(pid);
    }
    if cgroups.is_empty() {
        return None;
    }
    let mut limit = CpuLimit {
        cpus: f64::from(host),
        bound: CpuBound::Host,
    };
    let mut allowed = BTreeSet::new();
    for &pid in cgroups.values() {
        allowed.extend(allowed_cpus(procfs_root, pid).unwrap_or_default());
    }
    let cpuset = allowed.len() as f64;
    if cpuset > 0.0 && cpuset < limit.cpus {
        limit = CpuLimit {
            cpus: cpuset,
            bound: CpuBound::Cpuset,
        };
    }
    let quotas: Option<f64> = cgroups
        .keys()
        .map(|cgroup| cgroup_quota(cgroupfs_root, cgroup, namespace))
        .sum();
    if let Some(quota) = quotas
        && quota < limit.cpus
    {
        limit = CpuLimit {
            cpus: quota,
            bound: CpuBound::Quota,
        };
    }
    Some(limit)
}

/// The services' CPU limits as last read.
#[derive(Debug, Default)]
pub struct CpuLimits {
    read: IdMap<u32, (Instant, Option<CpuLimit>)>,
}

impl CpuLimits {
    pub fn get(&self, service: u32) -> Option<CpuLimit> {
        self.read.get(&service).and_then(|(_, limit)| *limit)
    }

    /// Whether `service`'s limit is due to be read (never read, or [`REFRESH`] old).
    pub fn due(&self, service: u32, now: Instant) -> bool {
        self.read
            .get(&service)
            .is_none_or(|(at, _)| now.saturating_duration_since(*at) >= REFRESH)
    }

    pub fn store(&mut self, service: u32, now: Instant, limit: Option<CpuLimit>) {
        self.read.insert(service, (now, limit));
    }

    /// Forgets the services `live` refuses.
    pub fn retain(&mut self, live: impl Fn(u32) -> bool) {
        self.read.retain(|&service, _| live(service));
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    #[test]
    fn quotas_and_cpu_lists_parse() {
        assert_eq!(parse_cpu_max("150000 100000\n"), Some(1.5));
        assert_eq!(parse_cpu_max("max 100000\n"), None);
        assert_eq!(parse_cpu_max(""), None);
        assert_eq!(
            parse_cpu_list("0-3,6\n"),
            Some(BTreeSet::from([0, 1, 2, 3, 6]))
        );
        assert_eq!(parse_cpu_list("1"), Some(BTreeSet::from([1])));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
    }

    /// A procfs with the host's `cpus` and processes (pid, cgroup, allowed list), and a
    /// cgroupfs with `cpu.max` files (path, content).
    fn fixture(
        cpus: u32,
        processes: &[(u32, &str, &str)],
        quotas: &[(&str, &str)],
    ) -> std::io::Result<(tempfile::TempDir, tempfile::TempDir)> {
        let (proc, cgroup) = (tempfile::tempdir()?, tempfile::tempdir()?);
        let stat: String = (0..cpus).map(|cpu| format!("cpu{cpu} 1 2 3\n")).collect();
        fs::write(
            proc.path().join("stat"),
            format!("cpu  4 5 6\n{stat}intr 7\n"),
        )?;
        for (pid, path, allowed) in processes {
            let dir = proc.path().join(pid.to_string());
            fs::create_dir_all(&dir)?;
            fs::write(dir.join("cgroup"), format!("0::{path}\n"))?;
            fs::write(
                dir.join("status"),
                format!("Name:\tapi\nCpus_allowed:\tff\nCpus_allowed_list:\t{allowed}\n"),
            )?;
        }
        for (path, content) in quotas {
            let dir = cgroup.path().join(path.trim_start_matches('/'));
            fs::create_dir_all(&dir)?;
            fs::write(dir.join("cpu.max"), content)?;
        }
        Ok((proc, cgroup))
    }

    #[test]
    fn the_least_of_quota_cpuset_and_host_holds() -> std::io::Result<()> {
        let limit = |cpus, processes: &[(u32, &str, &str)], quotas: &[(&str, &str)]| {
            let (proc, cgroup) = fixture(cpus, processes, quotas)?;
            let pids: Vec<u32> = processes.iter().map(|(pid, ..)| *pid).collect();
            let host = host_cpus(proc.path()).unwrap_or(0);
            std::io::Result::Ok(service_cpus(
                (proc.path(), cgroup.path()),
                &mut NamespaceRoot::default(),
                host,
                &pids,
            ))
        };
        let host = |cpus| CpuLimit {
            cpus,
            bound: CpuBound::Host,
        };
        assert_eq!(
            limit(4, &[(10, "/system.slice/api.service", "0-3")], &[])?,
            Some(host(4.0))
        );
        // A parent's quota is smaller than the leaf's: the parent's holds.
        assert_eq!(
            limit(
                4,
                &[(10, "/kubepods.slice/pod1/cri-1", "0-3")],
                &[
                    ("/kubepods.slice/pod1", "50000 100000"),
                    ("/kubepods.slice/pod1/cri-1", "max 100000")
                ]
            )?,
            Some(CpuLimit {
                cpus: 0.5,
                bound: CpuBound::Quota
            })
        );
        // Two replicas in two cgroups: their quotas add up; workers sharing their
        // master's cgroup count once.
        assert_eq!(
            limit(
                8,
                &[(10, "/a", "0-7"), (11, "/a", "0-7"), (20, "/b", "0-7")],
                &[("/a", "100000 100000"), ("/b", "150000 100000")]
            )?,
            Some(CpuLimit {
                cpus: 2.5,
                bound: CpuBound::Quota
            })
        );
        // One of them has no quota: the service has none.
        assert_eq!(
            limit(
                8,
                &[(10, "/a", "0-1"), (20, "/b", "2")],
                &[("/a", "100000 100000")]
            )?,
            Some(CpuLimit {
                cpus: 3.0,
                bound: CpuBound::Cpuset
            })
        );
        // A quota larger than the cpuset: the cpuset holds.
        assert_eq!(
            limit(4, &[(10, "/a", "1")], &[("/a", "300000 100000")])?,
            Some(CpuLimit {
                cpus: 1.0,
                bound: CpuBound::Cpuset
            })
        );
        // A v1 host: the quota is in the cpu controller's hierarchy.
        let (proc, cgroup) = fixture(4, &[(10, "/", "0-3")], &[])?;
        fs::write(
            proc.path().join("10/cgroup"),
            "4:memory:/m\n2:cpu,cpuacct:/capped\n1:name=systemd:/s\n0::/\n",
        )?;
        let dir = cgroup.path().join("cpu,cpuacct/capped");
        fs::create_dir_all(&dir)?;
        fs::write(dir.join("cpu.cfs_quota_us"), "150000\n")?;
        fs::write(dir.join("cpu.cfs_period_us"), "100000\n")?;
        assert_eq!(
            service_cpus(
                (proc.path(), cgroup.path()),
                &mut NamespaceRoot::default(),
                4,
                &[10]
            ),
            Some(CpuLimit {
                cpus: 1.5,
                bound: CpuBound::Quota
            })
        );
        fs::write(dir.join("cpu.cfs_quota_us"), "-1\n")?;
        assert_eq!(
            service_cpus(
                (proc.path(), cgroup.path()),
                &mut NamespaceRoot::default(),
                4,
                &[10]
            ),
            Some(CpuLimit {
                cpus: 4.0,
                bound: CpuBound::Host
            })
        );
        // Processes gone: nothing to say.
        assert_eq!(limit(4, &[], &[])?, None);
        Ok(())
    }

    /// Seen from a pod with a cgroup namespace of its own (poolscope's container at
    /// `kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podP.slice/
    /// cri-containerd-own.scope`), with the host's hierarchy mounted at the cgroupfs
    /// root: another pod's container, a sidecar in poolscope's own pod and a host
    /// service each read their own quota.
    #[test]
    fn paths_from_a_pods_own_cgroup_namespace_find_their_quota() -> std::io::Result<()> {
        let pod = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podA.slice";
        let own_pod = "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podP.slice";
        let (proc, cgroup) = fixture(
            4,
            &[
                (
                    10,
                    "/../../../kubepods-burstable.slice/kubepods-burstable-podA.slice/cri-containerd-a.scope",
                    "0-3",
                ),
                (
                    11,
                    "/../../../kubepods-burstable.slice/kubepods-burstable-podA.slice/cri-containerd-b.scope",
                    "0-3",
                ),
                (20, "/../cri-containerd-sidecar.scope", "0-3"),
                (30, "/../../../../system.slice/api.service", "0-3"),
            ],
            &[
                (pod, "max 100000"),
                (&format!("{pod}/cri-containerd-a.scope"), "50000 100000"),
                (&format!("{pod}/cri-containerd-b.scope"), "150000 100000"),
                (&format!("{own_pod}/cri-containerd-own.scope"), "max 100000"),
                (
                    &format!("{own_pod}/cri-containerd-sidecar.scope"),
                    "25000 100000",
                ),
                ("/system.slice/api.service", "200000 100000"),
            ],
        )?;
        let mut namespace = NamespaceRoot::default();
        let quota = |namespace: &mut NamespaceRoot, pid: u32| {
            service_cpus((proc.path(), cgroup.path()), namespace, 4, &[pid]).map(|l| l.cpus)
        };
        assert_eq!(quota(&mut namespace, 10), Some(0.5));
        // The ancestor found for the first is kept, and holds for the second.
        assert_eq!(quota(&mut namespace, 11), Some(1.5));
        assert_eq!(quota(&mut namespace, 20), Some(0.25));
        assert_eq!(quota(&mut namespace, 30), Some(2.0));
        assert_eq!(namespace.ancestors.len(), 3);
        // A path under no directory of the hierarchy: no quota, the host's CPUs.
        fs::write(
            proc.path().join("10/cgroup"),
            "0::/../../../kubepods-burstable.slice/kubepods-burstable-podGone.slice/x.scope\n",
        )?;
        assert_eq!(quota(&mut namespace, 10), Some(4.0));
        Ok(())
    }

    #[test]
    fn limits_are_read_again_after_the_refresh_interval() {
        let mut limits = CpuLimits::default();
        let now = Instant::now();
        assert!(limits.due(3, now));
        limits.store(3, now, None);
        assert!(!limits.due(3, now + Duration::from_secs(1)));
        assert!(limits.due(3, now + REFRESH));
        limits.retain(|_| false);
        assert!(limits.due(3, now));
    }
}
