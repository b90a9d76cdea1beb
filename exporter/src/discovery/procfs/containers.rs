//! Where a process runs: its cgroup, the systemd unit or container it names, and
//! the pod name a Kubernetes container's environment gives (`HOSTNAME`).
use std::{
    fs,
    io::{self, Read as _},
    path::Path,
};

/// The cgroup of a process from `/proc/<pid>/cgroup`: the v2 entry if there is one,
/// else the v1 `name=systemd` entry. A v2 entry at the root while the v1 systemd entry
/// is deeper means the v2 hierarchy is mounted but unused (a v1 host where something
/// mounted cgroup2): the v1 path is the one that says where the process belongs.
pub fn parse_cgroup(content: &str) -> String {
    let entry = |prefix: &str| {
        content.lines().find_map(|line| {
            let (_, rest) = line.split_once(':')?;
            rest.strip_prefix(prefix).map(str::to_owned)
        })
    };
    match (entry(":"), entry("name=systemd:")) {
        (Some(unified), Some(systemd)) if unified == "/" && systemd != "/" => systemd,
        (Some(unified), _) => unified,
        (None, Some(systemd)) => systemd,
        (None, None) => "/".to_owned(),
    }
}

/// The systemd unit of a cgroup path, e.g. `/system.slice/nginx.service` → `nginx`.
pub fn systemd_service(cgroup: &str) -> Option<&str> {
    cgroup
        .rsplit('/')
        .find_map(|component| component.strip_suffix(".service"))
        .filter(|name| !name.is_empty())
}

/// The short (12 hex digits) id of the container a cgroup path belongs to, for the
/// layouts of docker, containerd, CRI-O and podman.
pub fn container_id(cgroup: &str) -> Option<&str> {
    cgroup.rsplit('/').find_map(|component| {
        let component = component.strip_suffix(".scope").unwrap_or(component);
        let id = component.rsplit(['-', ':']).next()?;
        (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| &id[..12])
    })
}

/// The id (64 hex digits) of the container when `cgroup` is a Kubernetes pod container's: a pod
/// cgroup followed by the container's own, as kubelet and the runtimes lay them out:
/// - systemd driver: `/kubepods.slice/kubepods-burstable.slice/
///   kubepods-burstable-pod<uid with _>.slice/cri-containerd-<id>.scope` (`crio-`,
///   `docker-`; guaranteed pods sit in `kubepods-pod<uid>.slice`);
/// - cgroupfs driver: `/kubepods/besteffort/pod<uid>/<id>` (or `crio-<id>`).
///
/// Components are matched rather than the whole path, so what comes before does not
/// matter: a kubelet `--cgroup-root` (kind names its slices `kubelet-kubepods-…`), a
/// node that is itself a container, `..` when the reader is in another cgroup
/// namespace. Deeper cgroups a container makes inside its own are its container's.
pub fn pod_container_id(cgroup: &str) -> Option<&str> {
    let components: Vec<&str> = cgroup.split('/').collect();
    (1..components.len()).rev().find_map(|i| {
        if !is_pod_cgroup(&components[..i]) {
            return None;
        }
        pod_container_component_id(components[i])
    })
}

/// A pod's uid: a UUID (with `_` for `-` under the systemd driver), or 32 hex digits
/// (static pods are named by a hash of their manifest).
fn is_pod_uid(uid: &str) -> bool {
    uid.bytes()
        .all(|b| b.is_ascii_hexdigit() || b == b'-' || b == b'_')
        && uid.bytes().filter(u8::is_ascii_hexdigit).count() == 32
}

/// Whether the last of `path` (components from the root) is a pod's cgroup:
/// `kubepods[-<qos>]-pod<uid>.slice` (systemd driver, possibly under a cgroup root of
/// its own: `kubelet-kubepods-…`), or `pod<uid>` in `kubepods` or in its QoS class
/// directories (cgroupfs driver; `..` stands for what the reader's cgroup namespace
/// hides).
fn is_pod_cgroup(path: &[&str]) -> bool {
    let Some((component, ancestors)) = path.split_last() else {
        return false;
    };
    let mut up = ancestors.iter().rev().copied();
    let (parent, grandparent) = (up.next().unwrap_or(""), up.next().unwrap_or(""));
    if let Some(slice) = component.strip_suffix(".slice") {
        return slice.rsplit_once('-').is_some_and(|(ancestors, pod)| {
            ancestors.split('-').any(|name| name == "kubepods")
                && pod.strip_prefix("pod").is_some_and(is_pod_uid)
        });
    }
    let in_kubepods = match parent {
        "kubepods" | ".." => true,
        "burstable" | "besteffort" => matches!(grandparent, "kubepods" | ".."),
        _ => false,
    };
    in_kubepods && component.strip_prefix("pod").is_some_and(is_pod_uid)
}

/// The id of a container cgroup's name inside a pod cgroup. CRI-O's `conmon`
/// monitor has a scope of its own there (`crio-conmon-<id>.scope`) and is not the
/// container.
fn pod_container_component_id(component: &str) -> Option<&str> {
    let name = component.strip_suffix(".scope").unwrap_or(component);
    let id = ["cri-containerd-", "crio-", "docker-"]
        .iter()
        .find_map(|prefix| name.strip_prefix(prefix))
        .unwrap_or(name);
    (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(id)
}

/// How much of `/proc/<pid>/environ` is read: the runtime puts HOSTNAME among the
/// first variables, while an environment can hold megabytes.
pub(super) const ENVIRON_READ_LIMIT: usize = 64 * 1024;

/// The value of variable `name` in a NUL-separated environment block; the first
/// definition wins, as for `getenv`.
pub fn environ_var<'a>(environ: &'a [u8], name: &str) -> Option<&'a [u8]> {
    environ.split(|&b| b == 0).find_map(|entry| {
        entry
            .strip_prefix(name.as_bytes())?
            .strip_prefix(b"=".as_slice())
    })
}

/// True for what a pod hostname can be: lowercase letters, digits, `-` and `.`, at
/// most 63 characters, starting and ending with a letter or digit. Anything else did
/// not come from kubelet (a HOSTNAME the image or the user set) and is not used.
pub fn is_pod_hostname(name: &str) -> bool {
    let edge_ok = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && edge_ok(name.bytes().next())
        && edge_ok(name.bytes().last())
}

/// At most [`ENVIRON_READ_LIMIT`] bytes of the environment of `pid`, cut after the last
/// complete variable when the limit cut one.
fn read_environ(root: &Path, pid: u32) -> Option<Vec<u8>> {
    let mut environ = Vec::new();
    match fs::File::open(root.join(pid.to_string()).join("environ")) {
        Ok(file) => {
            file.take(ENVIRON_READ_LIMIT as u64)
                .read_to_end(&mut environ)
                .ok()?;
        }
        // Mode 0400: only its owner (or CAP_DAC_READ_SEARCH, which poolscope does not
        // have) may open it; CAP_SYS_PTRACE may read the same bytes from the
        // process's memory.
        Err(error) if error.kind() == io::ErrorKind::PermissionDenied => {
            let stat = fs::read_to_string(root.join(pid.to_string()).join("stat")).ok()?;
            environ = environ_from_memory(pid, environ_range(&stat)?)?;
        }
        Err(_) => return None,
    }
    if environ.len() == ENVIRON_READ_LIMIT {
        let complete = environ
            .iter()
            .rposition(|&b| b == 0)
            .map_or(0, |nul| nul + 1);
        environ.truncate(complete);
    }
    Some(environ)
}

/// Where the environment block of a process lies in its memory: `env_start` and
/// `env_end` of its `stat` (fields 50 and 51, shown to those who may ptrace-read it;
/// 0 otherwise).
fn environ_range(stat: &str) -> Option<(u64, u64)> {
    let after_comm = stat.get(stat.rfind(')')? + 1..)?;
    // Field 3 (state) is the first after the comm.
    let mut fields = after_comm.split_ascii_whitespace().skip(50 - 3);
    let start: u64 = fields.next()?.parse().ok()?;
    let end: u64 = fields.next()?.parse().ok()?;
    (start != 0 && end > start).then_some((start, end))
}

/// At most [`ENVIRON_READ_LIMIT`] bytes of `range` of `pid`'s memory, read as
/// /proc/<pid>/environ reads it.
fn environ_from_memory(pid: u32, (start, end): (u64, u64)) -> Option<Vec<u8>> {
    let len = usize::try_from(end - start).ok()?.min(ENVIRON_READ_LIMIT);
    let mut environ = vec![0u8; len];
    let local = libc::iovec {
        iov_base: environ.as_mut_ptr().cast(),
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: start as *mut libc::c_void,
        iov_len: len,
    };
    // SAFETY: `local` covers `environ`'s `len` writable bytes; the kernel checks
    // `remote` against the other process's memory and our right to read it.
    let read =
        unsafe { libc::process_vm_readv(i32::try_from(pid).ok()?, &local, 1, &remote, 1, 0) };
    environ.truncate(usize::try_from(read).ok()?);
    Some(environ)
}

/// The pod hostname of a process in a pod container (see the module comment); `None`
/// when it shares the host's UTS namespace (pid 1's, or where pid 1 cannot be read, as
/// in a sandbox that hides it, the exporter's own: the host's under the shipped unit
/// and DaemonSet), or its environment cannot be read or holds no valid HOSTNAME.
pub(super) fn read_pod_name(root: &Path, pid: u32) -> Option<String> {
    let uts = |process: &str| fs::read_link(root.join(process).join("ns/uts")).ok();
    let own = uts(&pid.to_string())?;
    let host = uts("1").or_else(|| uts("self"))?;
    if own == host {
        return None;
    }
    let environ = read_environ(root, pid)?;
    let hostname = std::str::from_utf8(environ_var(&environ, "HOSTNAME")?).ok()?;
    is_pod_hostname(hostname).then(|| hostname.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::procfs::tests::CONTAINER;

    #[test]
    fn cgroup_v2_then_v1() {
        assert_eq!(
            parse_cgroup("0::/system.slice/nginx.service\n"),
            "/system.slice/nginx.service"
        );
        assert_eq!(
            parse_cgroup("9:name=systemd:/system.slice/a.service\n1:cpu:/\n"),
            "/system.slice/a.service"
        );
        assert_eq!(parse_cgroup(""), "/");
        // cgroup2 mounted but unused on a v1 host: the v1 systemd path says more.
        assert_eq!(
            parse_cgroup("9:name=systemd:/kubepods/besteffort/pod1/c\n1:cpu:/\n0::/\n"),
            "/kubepods/besteffort/pod1/c"
        );
        assert_eq!(
            parse_cgroup("9:name=systemd:/init.scope\n0::/system.slice/a.service\n"),
            "/system.slice/a.service"
        );
        assert_eq!(parse_cgroup("9:name=systemd:/\n0::/\n"), "/");
    }

    /// Pod container cgroups as kubelet and the runtimes make them, each with the short
    /// id it must give.
    #[test]
    fn pod_container_cgroups() {
        let id = CONTAINER;
        let uid = "3e1a6e0c-5b1f-4d1e-9b4e-0d2f8c7a9b10";
        let uid_ = uid.replace('-', "_");
        let pods = [
            // systemd driver (cgroup v2, or the v1 name=systemd hierarchy), every QoS.
            format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/cri-containerd-{id}.scope"
            ),
            format!(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uid_}.slice/crio-{id}.scope"
            ),
            format!("/kubepods.slice/kubepods-pod{uid_}.slice/docker-{id}.scope"),
            // cgroupfs driver.
            format!("/kubepods/burstable/pod{uid}/{id}"),
            format!("/kubepods/besteffort/pod{uid}/{id}"),
            format!("/kubepods/pod{uid}/{id}"),
            format!("/kubepods/burstable/pod{uid}/crio-{id}"),
            // A static pod: its uid is a hash of its manifest.
            format!("/kubepods/burstable/pod6b4f3c2a1d0e9f8a7b6c5d4e3f2a1b0c/{id}"),
            // kind: a node in a docker container, kubelet's cgroup root `kubelet`.
            format!(
                "/system.slice/docker-{}.scope/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{uid_}.slice/cri-containerd-{id}.scope",
                "9".repeat(64)
            ),
            format!("/kubelet/kubepods/burstable/pod{uid}/{id}"),
            // Seen from another cgroup namespace.
            format!("/../../kubepods-besteffort-pod{uid_}.slice/cri-containerd-{id}.scope"),
            format!("/kubepods-besteffort-pod{uid_}.slice/cri-containerd-{id}.scope"),
            format!("/../../../pod{uid}/{id}"),
            // A cgroup the container made inside its own.
            format!("/kubepods/burstable/pod{uid}/{id}/init"),
        ];
        for cgroup in &pods {
            assert_eq!(pod_container_id(cgroup), Some(id), "{cgroup}");
        }
        let not_pods = [
            format!("/system.slice/docker-{id}.scope"),
            format!("/machine.slice/libpod-{id}.scope"),
            format!("/docker/{id}"),
            "/system.slice/nginx.service".to_owned(),
            "/".to_owned(),
            String::new(),
            // The pod cgroup itself, and its CRI-O monitor: not a container.
            format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice"),
            format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/crio-conmon-{id}.scope"
            ),
            // Look-alikes: no kubepods, a uid that is not one, a short id.
            format!("/system.slice/web-pod{uid_}.slice/docker-{id}.scope"),
            format!("/pods/burstable/pod{uid}/{id}"),
            format!("/burstable/pod{uid}/{id}"),
            format!("/kubepods/burstable/podzz/{id}"),
            format!("/kubepods/burstable/pod{uid}/{}", &id[..63]),
            format!("/kubepods/burstable/pod{uid}x/{id}"),
        ];
        for cgroup in &not_pods {
            assert_eq!(pod_container_id(cgroup), None, "{cgroup}");
        }
    }

    #[test]
    fn environment_variables() {
        let environ =
            b"PATH=/usr/bin\0HOSTNAMEX=no\0HOSTNAME=web-7d9f8c6b5-x2k4q\0HOSTNAME=second\0";
        assert_eq!(
            environ_var(environ, "HOSTNAME"),
            Some(b"web-7d9f8c6b5-x2k4q".as_slice())
        );
        assert_eq!(environ_var(environ, "PATH"), Some(b"/usr/bin".as_slice()));
        assert_eq!(
            environ_var(b"HOSTNAME=\0", "HOSTNAME"),
            Some(b"".as_slice())
        );
        assert_eq!(environ_var(b"HOME=/root\0", "HOSTNAME"), None);
        assert_eq!(environ_var(b"", "HOSTNAME"), None);
    }

    #[test]
    fn environment_range_from_stat() {
        // A stat of 6.18 (52 fields), its comm with a space and a parenthesis.
        let stat = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 \
                    5000 10000000 300 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 \
                    1 0 0 0 0 0 93825000000000 93825000001000 93825000002000 \
                    140730000000000 140730000000100 140730000000100 140730000004000 0\n";
        assert_eq!(
            environ_range(stat),
            Some((140730000000100, 140730000004000))
        );
        // Hidden from a reader without ptrace access: zeros.
        let hidden = stat
            .replace("140730000000100 140730000004000", "0 0")
            .replace("140730000000000 140730000000100", "0 0");
        assert_eq!(environ_range(&hidden), None);
        assert_eq!(environ_range("1 (x) S"), None);
    }

    #[test]
    fn the_environment_read_from_memory_is_procs() {
        let pid = std::process::id();
        let stat = fs::read_to_string("/proc/self/stat").expect("own stat");
        let range = environ_range(&stat).expect("own environment range");
        let from_memory = environ_from_memory(pid, range).expect("own memory");
        let mut from_proc = fs::read("/proc/self/environ").expect("own environ");
        from_proc.truncate(ENVIRON_READ_LIMIT);
        assert_eq!(from_memory, from_proc);
    }

    #[test]
    fn pod_hostnames() {
        for name in [
            "web-7d9f8c6b5-x2k4q",
            "db-0",
            "a",
            "pod.with.dots",
            &"x".repeat(63),
        ] {
            assert!(is_pod_hostname(name), "{name}");
        }
        for name in [
            "",
            "Web",
            "web_1",
            "-web",
            "web-",
            "web.",
            "my host",
            &"x".repeat(64),
        ] {
            assert!(!is_pod_hostname(name), "{name}");
        }
    }

    #[test]
    fn service_and_container_names() {
        assert_eq!(
            systemd_service("/system.slice/nginx.service"),
            Some("nginx")
        );
        assert_eq!(
            systemd_service("/user.slice/user-0.slice/session-3.scope"),
            None
        );
        let id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        assert_eq!(
            container_id(&format!("/system.slice/docker-{id}.scope")),
            Some("0123456789ab")
        );
        assert_eq!(
            container_id(&format!(
                "/kubepods/burstable/pod1/cri-containerd-{id}.scope"
            )),
            Some("0123456789ab")
        );
        assert_eq!(container_id("/system.slice/nginx.service"), None);
    }
}
