//! Kubernetes pod attribution against the real kernel: testservers in cgroups laid out
//! as kubelet lays out pod containers', each in a UTS namespace of its own with
//! `HOSTNAME` set as the container runtime sets it, watched by a real poolscope with
//! auto-discovery. Two replicas of one Deployment must be one service named after the
//! Deployment; a pod container whose pod name is unknown, or not to be trusted (a
//! `hostNetwork` pod shares the host's UTS namespace, where HOSTNAME is the node's
//! name), keeps `container-<id>`.
use std::{
    ffi::CString,
    fs,
    io::{BufRead as _, BufReader},
    net::TcpStream,
    os::unix::{ffi::OsStrExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
};

use anyhow::{Context as _, bail, ensure};
use poolscope_tests::{Poolscope, bin_dir, one_at_a_time, parse_port, privileged, scrape_until};

/// Where this machine mounts the cgroup hierarchies pods live in.
struct CgroupMounts {
    /// The v2 hierarchy.
    unified: PathBuf,
    /// The v1 `name=systemd` hierarchy, where a v1 host keeps its cgroup tree.
    systemd_v1: Option<PathBuf>,
}

fn cgroup_mounts() -> anyhow::Result<CgroupMounts> {
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
fn unified_hierarchy_unused() -> anyhow::Result<bool> {
    let own = fs::read_to_string("/proc/self/cgroup")?;
    Ok(own.lines().any(|line| line == "0::/"))
}

/// Cgroup directories made by the test, removed leaf first when dropped (also when the
/// test fails), after moving out whatever still runs in them.
#[derive(Default)]
struct Cgroups {
    /// (hierarchy root, directory made), in the order they were made.
    made: Vec<(PathBuf, PathBuf)>,
}

impl Cgroups {
    /// Makes `relative` (and its missing parents) under `hierarchy`; the directory.
    fn make(&mut self, hierarchy: &Path, relative: &str) -> anyhow::Result<PathBuf> {
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

/// A `testserver` started in a pod-shaped cgroup; killed when dropped.
struct PodServer {
    child: Child,
    _stdin: ChildStdin,
    port: u16,
}

/// How a [`PodServer`] starts.
struct Pod<'a> {
    /// The cgroup directory it runs in from its first instruction on.
    cgroup: &'a Path,
    /// `HOSTNAME` in its environment (removed when `None`).
    hostname: Option<&'a str>,
    /// A UTS namespace of its own, as every pod without `hostNetwork` has.
    own_uts: bool,
}

impl PodServer {
    fn start(pod: &Pod) -> anyhow::Result<Self> {
        let procs = CString::new(pod.cgroup.join("cgroup.procs").as_os_str().as_bytes())?;
        let uts_hostname = pod
            .own_uts
            .then(|| CString::new(pod.hostname.unwrap_or("pod")))
            .transpose()?;
        let mut command = Command::new(bin_dir()?.join("testserver"));
        command
            .arg("64")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        match pod.hostname {
            Some(hostname) => command.env("HOSTNAME", hostname),
            None => command.env_remove("HOSTNAME"),
        };
        // SAFETY: between fork and exec the closure only makes system calls (open,
        // write, close, unshare, sethostname) on buffers prepared before the fork.
        unsafe {
            command.pre_exec(move || {
                // "0" moves the writer itself: the server never runs elsewhere.
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
                if let Some(name) = &uts_hostname
                    && (libc::unshare(libc::CLONE_NEWUTS) != 0
                        || libc::sethostname(name.as_ptr(), name.as_bytes().len()) != 0)
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting testserver in {}", pod.cgroup.display()))?;
        let stdin = child.stdin.take().context("no stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("no stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let port = parse_port(&line, "testserver")?;
        Ok(Self {
            child,
            _stdin: stdin,
            port,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn connect(&self) -> anyhow::Result<TcpStream> {
        Ok(TcpStream::connect(("127.0.0.1", self.port))?)
    }
}

impl Drop for PodServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A pod uid unique to this run and `index`.
fn pod_uid(index: u32) -> String {
    format!("{:08x}-0000-4000-8000-{index:012x}", std::process::id())
}

/// A container id (64 hex digits) whose short form (12) is unique to this run and
/// `index`.
fn container_id(index: u32) -> String {
    format!("{index:04x}{:08x}{:052x}", std::process::id(), 0xfeed)
}

/// The systemd cgroup driver's path of a container (`qos` empty for guaranteed pods).
fn systemd_driver_path(qos: &str, index: u32, runtime_prefix: &str) -> String {
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
fn check_placed(pid: u32, relative: &str) -> anyhow::Result<()> {
    let cgroups = fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
    ensure!(
        cgroups
            .lines()
            .any(|line| line.ends_with(&format!("/{relative}"))),
        "pid {pid} is not in {relative}:\n{cgroups}"
    );
    Ok(())
}

#[test]
fn pod_replicas_are_one_service_named_by_their_workload() -> anyhow::Result<()> {
    let test = "pod_replicas_are_one_service_named_by_their_workload";
    if !privileged(test) {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let mounts = cgroup_mounts()?;
    // Dropped after the servers (declared before them): the cgroups are empty then.
    let mut cgroups = Cgroups::default();

    // Replica 1: cgroup v2, systemd driver, containerd.
    let replica_1_path = systemd_driver_path("besteffort", 1, "cri-containerd-");
    let replica_1_dir = cgroups.make(&mounts.unified, &replica_1_path)?;
    // Replica 2: cgroupfs driver; in the v1 systemd hierarchy where that is the one
    // poolscope reads (this process at the root of an unused v2 hierarchy).
    let replica_2_path = format!("kubepods/burstable/pod{}/{}", pod_uid(2), container_id(2));
    let replica_2_hierarchy = match &mounts.systemd_v1 {
        Some(systemd_v1) if unified_hierarchy_unused()? => systemd_v1.clone(),
        _ => mounts.unified.clone(),
    };
    eprintln!(
        "replica 1 in {}, replica 2 in {}",
        mounts.unified.display(),
        replica_2_hierarchy.display()
    );
    let replica_2_dir = cgroups.make(&replica_2_hierarchy, &replica_2_path)?;
    // A pod container without HOSTNAME in its environment (guaranteed QoS, CRI-O).
    let unnamed_path = systemd_driver_path("", 3, "crio-");
    let unnamed_dir = cgroups.make(&mounts.unified, &unnamed_path)?;
    // A hostNetwork pod: the host's UTS namespace, HOSTNAME that looks like a pod's.
    let host_network_path = systemd_driver_path("burstable", 4, "docker-");
    let host_network_dir = cgroups.make(&mounts.unified, &host_network_path)?;

    let replica_1 = PodServer::start(&Pod {
        cgroup: &replica_1_dir,
        hostname: Some("web-7d9f8c6b5-x2k4q"),
        own_uts: true,
    })?;
    let replica_2 = PodServer::start(&Pod {
        cgroup: &replica_2_dir,
        hostname: Some("web-7d9f8c6b5-p9zmt"),
        own_uts: true,
    })?;
    let unnamed = PodServer::start(&Pod {
        cgroup: &unnamed_dir,
        hostname: None,
        own_uts: true,
    })?;
    let host_network = PodServer::start(&Pod {
        cgroup: &host_network_dir,
        hostname: Some("web-7d9f8c6b5-h7vwn"),
        own_uts: false,
    })?;
    check_placed(replica_1.pid(), &replica_1_path)?;
    check_placed(replica_2.pid(), &replica_2_path)?;
    check_placed(unnamed.pid(), &unnamed_path)?;
    check_placed(host_network.pid(), &host_network_path)?;
    // Backlogs that tell the replicas' listeners apart: 2 and 1 waiting connections.
    let _clients = [
        replica_1.connect()?,
        replica_1.connect()?,
        replica_2.connect()?,
    ];

    let mut poolscope = Poolscope::start("[discovery]\nrescan_interval = \"500ms\"\n")?;
    let listener_1 = format!("127.0.0.1:{}", replica_1.port);
    let listener_2 = format!("127.0.0.1:{}", replica_2.port);
    let unnamed_service = format!("container-{}", &container_id(3)[..12]);
    let host_network_service = format!("container-{}", &container_id(4)[..12]);
    let metrics = scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", "web")]) == Some(2.0)
            && m.value(
                "poolscope_listen_queue_depth",
                &[("service", "web"), ("listener", &listener_1)],
            ) == Some(2.0)
            && m.value(
                "poolscope_listen_queue_depth",
                &[("service", "web"), ("listener", &listener_2)],
            ) == Some(1.0)
            && m.value("poolscope_targets", &[("service", &unnamed_service)]) == Some(1.0)
            && m.value("poolscope_targets", &[("service", &host_network_service)]) == Some(1.0)
    });
    let metrics = match metrics {
        Ok(metrics) => metrics,
        Err(error) => bail!("{error:#}\npoolscope log:\n{}", poolscope.stop_and_log()),
    };
    // Neither a pod name nor a half-stripped one is a service.
    for pod_name in [
        "web-7d9f8c6b5",
        "web-7d9f8c6b5-x2k4q",
        "web-7d9f8c6b5-p9zmt",
        "web-7d9f8c6b5-h7vwn",
    ] {
        assert!(
            !metrics.has_label("service", pod_name),
            "{pod_name} became a service"
        );
    }
    eprintln!(
        "poolscope_targets{{service=\"web\"}} 2; listen_queue_depth {listener_1} 2, \
         {listener_2} 1; {unnamed_service} 1; {host_network_service} 1"
    );
    Ok(())
}
