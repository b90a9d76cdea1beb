//! The parsers on fixtures, and scans of fixture procfs trees.
use super::mappings::libc_of;
use super::*;
use crate::discovery::{
    pod_logs::{ContainerNames, PodLogs},
    procfs::containers::ENVIRON_READ_LIMIT,
};

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
    let status =
        "Name:\tworker-1\nUmask:\t0022\nState:\tS (sleeping)\nTgid:\t4242\nNgid:\t0\nPid:\t4250\n";
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
    let no_links = PodIndex::default();
    for (pid, _, _, _, pod_name) in processes {
        let process = read_process(root.path(), pid, &no_links).expect("fixture process");
        assert_eq!(
            process.pod.as_ref().map(PodNames::pod),
            pod_name,
            "pid {pid}"
        );
    }
    // Where the kubelet lists the container, its names, whatever the environment
    // says (pid 14's is no pod name) and whatever its UTS namespace (pid 11 shares
    // the host's).
    let logs_dir = tempfile::tempdir()?;
    fs::write(
        logs_dir
            .path()
            .join(format!("web-7d9f8c6b5-x2k4q_prod_web-{CONTAINER}.log")),
        "",
    )?;
    let mut pod_logs = PodLogs::new(logs_dir.path().to_owned());
    pod_logs.refresh()?;
    let listed = ContainerNames {
        pod: "web-7d9f8c6b5-x2k4q".into(),
        namespace: "prod".into(),
        container: "web".into(),
    };
    for pid in [10, 11, 14] {
        let process = read_process(root.path(), pid, &pod_logs.index()).expect("fixture process");
        assert_eq!(
            process.pod,
            Some(PodNames::Kubelet(listed.clone().into())),
            "pid {pid}"
        );
    }
    // Not a pod container's cgroup: not looked up.
    assert_eq!(
        read_process(root.path(), 13, &pod_logs.index())
            .expect("fixture process")
            .pod,
        None
    );
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
    assert_eq!(
        read_process(root.path(), 10, &no_links).expect("pod").pod,
        None
    );
    assert_eq!(
        read_process(root.path(), 11, &no_links).expect("pod").pod,
        Some(PodNames::Hostname("node-1".into()))
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
    let first = scan(root.path(), Known::default(), &PodIndex::default())?;
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
        &PodIndex::default(),
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
    let snapshot = scan(root.path(), known, &PodIndex::default())?;
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
    let mut snapshot = scan(root.path(), elsewhere, &PodIndex::default())?;
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
