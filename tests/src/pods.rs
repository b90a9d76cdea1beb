//! Processes placed as Kubernetes places pod containers, for the tests that need a
//! node's shape without a kubelet: cgroups laid out as the kubelet's systemd and
//! cgroupfs drivers lay them out, made and removed by the test, and the kubelet's
//! container log links (`/var/log/containers`) in a directory of the test's.
use std::{
    ffi::CString,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, ensure};

/// Where this machine mounts the cgroup hierarchies pods live in.
pub struct CgroupMounts {
    /// The v2 hierarchy.
    pub unified: PathBuf,
    /// The v1 `name=systemd` hierarchy, where a v1 host keeps its cgroup tree.
    pub systemd_v1: Option<PathBuf>,
}

pub fn cgroup_mounts() -> anyhow::Result<CgroupMounts> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo")?;
    let mut unified = None;
    let mut systemd_v1 = None;
    for line in mountinfo.lines() {
        let Some((mount, filesystem)) = line.split_once(" - ") else {
            continue;
        };
        let (Some(point), mut filesystem) = (mount.split(' ').nth(4), filesystem.split(' ')) else {
            continue;
        };
        match (filesystem.next(), filesystem.nth(1)) {
            (Some("cgroup2"), _) => unified = Some(PathBuf::from(point)),
            (Some("cgroup"), Some(options)) if options.split(',').any(|o| o == "name=systemd") => {
                systemd_v1 = Some(PathBuf::from(point));
            }
            _ => {}
        }
    }
    Ok(CgroupMounts {
        unified: unified.context("no cgroup2 hierarchy mounted")?,
        systemd_v1,
    })
}

/// True when this process sits at the root of the v2 hierarchy: then, on a host that
/// also mounts the v1 systemd hierarchy, the v2 one is unused and poolscope reads the
/// v1 path.
pub fn unified_hierarchy_unused() -> anyhow::Result<bool> {
    let own = fs::read_to_string("/proc/self/cgroup")?;
    Ok(own.lines().any(|line| line == "0::/"))
}

/// Cgroup directories made by the test, removed leaf first when dropped (also when the
/// test fails), after moving out whatever still runs in them.
#[derive(Default)]
pub struct Cgroups {
    /// (hierarchy root, directory made), in the order they were made.
    made: Vec<(PathBuf, PathBuf)>,
}

impl Cgroups {
    /// Makes `relative` (and its missing parents) under `hierarchy`; the directory.
    pub fn make(&mut self, hierarchy: &Path, relative: &str) -> anyhow::Result<PathBuf> {
        let mut dir = hierarchy.to_path_buf();
        for component in relative.split('/') {
            dir.push(component);
            match fs::create_dir(&dir) {
                Ok(()) => self.made.push((hierarchy.to_path_buf(), dir.clone())),
                Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(error) => {
                    return Err(error).with_context(|| format!("mkdir {}", dir.display()));
                }
            }
        }
        Ok(dir)
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        for (hierarchy, dir) in self.made.iter().rev() {
            let left = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
            for pid in left.lines() {
                let _ = fs::write(hierarchy.join("cgroup.procs"), pid);
            }
            if let Err(error) = fs::remove_dir(dir) {
                eprintln!("could not remove cgroup {}: {error}", dir.display());
            }
        }
    }
}

/// Moves the calling process into the cgroup whose `cgroup.procs` is `procs` ("0":
/// the writer itself), between fork and exec: a process started so never runs
/// elsewhere, and what it starts is there too. Only system calls, on a buffer made
/// before the fork.
pub fn join_cgroup(procs: &CString) -> std::io::Result<()> {
    // SAFETY: a NUL-terminated path, a one-byte buffer, and an fd closed here.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let written = libc::write(fd, c"0".as_ptr().cast(), 1);
        let error = std::io::Error::last_os_error();
        libc::close(fd);
        if written != 1 {
            return Err(error);
        }
    }
    Ok(())
}

/// A pod uid unique to this run and `index`.
pub fn pod_uid(index: u32) -> String {
    format!("{:08x}-0000-4000-8000-{index:012x}", std::process::id())
}

/// A container id (64 hex digits) whose short form (12) is unique to this run and
/// `index`.
pub fn container_id(index: u32) -> String {
    format!("{index:04x}{:08x}{:052x}", std::process::id(), 0xfeed)
}

/// The systemd cgroup driver's path of a container (`qos` empty for guaranteed pods).
pub fn systemd_driver_path(qos: &str, index: u32, runtime_prefix: &str) -> String {
    let uid = pod_uid(index).replace('-', "_");
    let id = container_id(index);
    if qos.is_empty() {
        format!("kubepods.slice/kubepods-pod{uid}.slice/{runtime_prefix}{id}.scope")
    } else {
        format!(
            "kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid}.slice/{runtime_prefix}{id}.scope"
        )
    }
}

/// Fails unless /proc says `pid` is where the test put it.
pub fn check_placed(pid: u32, relative: &str) -> anyhow::Result<()> {
    let cgroups = fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    ensure!(
        cgroups
            .lines()
            .any(|line| line.ends_with(&format!("/{relative}"))),
        "pid {pid} is not in {relative}:\n{cgroups}"
    );
    Ok(())
}

/// Moves `pid` (every thread) into `cgroup`.
pub fn move_into(cgroup: &Path, pid: u32) -> anyhow::Result<()> {
    fs::write(cgroup.join("cgroup.procs"), pid.to_string())
        .with_context(|| format!("moving {pid} into {}", cgroup.display()))
}

/// The kubelet's log link of a container in `dir`, named as the kubelet names it (its
/// target, under /var/log/pods, need not exist: only the name is read).
pub fn log_link(
    dir: &Path,
    pod: &str,
    namespace: &str,
    container: &str,
    id: &str,
) -> anyhow::Result<()> {
    let name = format!("{pod}_{namespace}_{container}-{id}.log");
    let target = format!("/var/log/pods/{namespace}_{pod}_uid/{container}/0.log");
    std::os::unix::fs::symlink(target, dir.join(name))?;
    Ok(())
}
