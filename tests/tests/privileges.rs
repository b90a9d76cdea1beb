//! Least privilege: poolscope runs as an unprivileged user with only the capabilities
//! that systemd/poolscope.service grants, and still measures the truth. Twice: with
//! setpriv (the unit's capability set alone, as nobody: it finds a root-owned
//! server's sockets, and names the functions of a root-owned program's stacks, whose
//! `/proc/<pid>/fd` and `map_files` it may not open), and under the unit itself,
//! started by a real systemd with every sandboxing setting of the file.
use std::{
    fs,
    os::unix::{fs::PermissionsExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, ensure};
use poolscope_tests::{
    Metrics, PoolServer, Poolscope, TestServer, bin_dir, free_port,
    load::{ClosedLoop, Connections},
    one_at_a_time, pids_config, privileged,
    profiles::{Stackburner, http_get, names, parse_folded, start_phase, weight_of},
    skip, wait_followed, wait_until,
};

const UNIT: &str = include_str!("../../systemd/poolscope.service");

/// The unit's AmbientCapabilities, without the CAP_ prefix (`BPF`, `PERFMON`, ...).
fn unit_capabilities() -> anyhow::Result<Vec<String>> {
    let line = UNIT
        .lines()
        .find_map(|line| line.strip_prefix("AmbientCapabilities="))
        .context("no AmbientCapabilities in the unit")?;
    Ok(line
        .split_whitespace()
        .map(|cap| cap.trim_start_matches("CAP_").to_owned())
        .collect())
}

fn uid_of(pid: u32) -> anyhow::Result<u32> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|uid| uid.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no effective uid for {pid}"))
}

/// setpriv's arguments that run a command as nobody with the unit's capabilities
/// alone.
fn as_nobody_with_the_units_capabilities() -> anyhow::Result<Vec<String>> {
    // `+bpf,+perfmon,...`
    let caps: Vec<String> = unit_capabilities()?
        .iter()
        .map(|cap| format!("+{}", cap.to_lowercase()))
        .collect();
    let caps = caps.join(",");
    Ok(vec![
        "setpriv".to_owned(),
        "--reuid=nobody".to_owned(),
        "--regid=nogroup".to_owned(),
        "--clear-groups".to_owned(),
        format!("--inh-caps=-all,{caps}"),
        format!("--ambient-caps=-all,{caps}"),
        format!("--bounding-set=-all,{caps}"),
    ])
}

#[test]
fn runs_as_nobody_with_the_units_capabilities() -> anyhow::Result<()> {
    if !privileged("runs_as_nobody_with_the_units_capabilities") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let wrapper = as_nobody_with_the_units_capabilities()?;
    let server = TestServer::start(16)?;
    let _clients = [server.connect()?, server.connect()?];
    // Auto-discovery: a root-owned process's fds, through fdinfo (CAP_SYS_PTRACE).
    let poolscope =
        Poolscope::start_wrapped("[discovery]\nrescan_interval = \"500ms\"\n", &wrapper)?;
    assert_ne!(uid_of(poolscope.pid())?, 0, "poolscope runs as root");
    let listener = format!("127.0.0.1:{}", server.port);
    let labels = [("service", "testserver"), ("listener", listener.as_str())];
    let seen = wait_until(Duration::from_secs(10), || {
        poolscope
            .scrape()
            .is_ok_and(|m| m.value("poolscope_listen_queue_depth", &labels) == Some(2.0))
    });
    assert!(seen, "{}", poolscope.scrape()?.text);
    Ok(())
}

#[test]
fn names_the_functions_of_other_users_code_with_the_units_capabilities() -> anyhow::Result<()> {
    if !privileged("names_the_functions_of_other_users_code_with_the_units_capabilities") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    // A root-owned program burning in named functions; nobody may not search its
    // /proc/<pid>/map_files, so its code is read by the paths in its maps.
    let Stackburner {
        program,
        port: program_port,
        burner,
        ..
    } = Stackburner::start(Duration::from_secs(10), 20.0)?;
    let map_files = format!("/proc/{}/map_files", program.pid());
    let wrapper = as_nobody_with_the_units_capabilities()?;
    let denied = Command::new(&wrapper[0])
        .args(&wrapper[1..])
        .args(["ls", &map_files])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    ensure!(
        !denied.success(),
        "nobody with the unit's capabilities may list {map_files}: the test would not \
         show the fallback"
    );
    let poolscope = Poolscope::start_wrapped(&pids_config("sb", &[program.pid()]), &wrapper)?;
    wait_followed(&poolscope, &[(burner, "burner")])?;
    start_phase(program_port)?;
    let path = "/debug/pprof/profile?seconds=2&service=sb&pool=burner&format=folded";
    let lines = parse_folded(&http_get(poolscope.port, path)?.text(path)?)?;
    let all = weight_of(&lines, |_| true);
    let named = weight_of(&lines, |frames| names(frames, "burn_three_quarters"));
    println!("{named} of {all} samples under burn_three_quarters");
    ensure!(
        all > 0 && named * 2 >= all,
        "{named} of {all} samples name burn_three_quarters (the program spends 3/4 of \
         its CPU time there); the stacks:\n{lines:#?}"
    );
    Ok(())
}

/// Capability numbers (linux/capability.h): the index is the bit.
const CAPABILITIES: [&str; 41] = [
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
];

/// The unit's capabilities as the bit mask /proc/<pid>/status shows.
fn unit_capability_mask() -> anyhow::Result<u64> {
    unit_capabilities()?.iter().try_fold(0u64, |mask, cap| {
        let bit = CAPABILITIES
            .iter()
            .position(|known| known == cap)
            .with_context(|| format!("unknown capability {cap}"))?;
        Ok(mask | 1 << bit)
    })
}

/// The `name:` mask (hex) of `/proc/<pid>/task/<tid>/status`.
fn capability_field(status: &str, name: &str) -> anyhow::Result<u64> {
    let hex = status
        .lines()
        .find_map(|line| line.strip_prefix(name))
        .with_context(|| format!("no {name} in {status}"))?;
    Ok(u64::from_str_radix(hex.trim(), 16)?)
}

/// Started as root, poolscope drops every capability the unit does not grant (but
/// CAP_SYSLOG, for kernel symbols) once its programs are loaded, on every thread, and
/// still measures.
#[test]
fn started_as_root_it_keeps_only_the_units_capabilities() -> anyhow::Result<()> {
    if !privileged("started_as_root_it_keeps_only_the_units_capabilities") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let server = PoolServer::start(2, Duration::from_millis(2))?;
    let mut poolscope = Poolscope::start(&poolscope_tests::pids_config("rooted", &[server.pid()]))?;
    poolscope_tests::scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", "rooted")]) == Some(1.0)
    })?;
    let clients = ClosedLoop::start(server.port, 2, Connections::KeepAlive);
    let counted = poolscope_tests::scrape_until(&poolscope, |m| {
        m.value("poolscope_requests_total", &[("service", "rooted")])
            .is_some_and(|requests| requests > 100.0)
    })?;
    clients.stop()?;
    let syslog = CAPABILITIES
        .iter()
        .position(|cap| *cap == "SYSLOG")
        .context("no SYSLOG")?;
    let expected = unit_capability_mask()? | 1 << syslog;
    let mut threads = 0;
    for task in fs::read_dir(format!("/proc/{}/task", poolscope.pid()))? {
        let status = fs::read_to_string(task?.path().join("status"))?;
        for field in ["CapEff:", "CapPrm:"] {
            let mask = capability_field(&status, field)?;
            ensure!(
                mask == expected,
                "{field} {mask:#x}, the unit grants {expected:#x}:\n{status}"
            );
        }
        ensure!(capability_field(&status, "CapInh:")? == 0, "{status}");
        threads += 1;
    }
    let log = poolscope.stop_and_log();
    eprintln!(
        "{threads} threads, each with CapEff = CapPrm = {expected:#x}; {} requests counted",
        counted
            .value("poolscope_requests_total", &[("service", "rooted")])
            .unwrap_or_default()
    );
    ensure!(log.contains("capabilities dropped after loading"), "{log}");
    Ok(())
}

/// systemd's range for DynamicUser= uids.
const DYNAMIC_UIDS: std::ops::RangeInclusive<u32> = 61184..=65519;

/// Starts a throwaway systemd, PID 1 of its own PID, mount, UTS, IPC and cgroup
/// namespaces, whose only job is poolscope.service. Nothing of the host changes: /run,
/// /dev, /usr/local/bin and /sys/fs/cgroup are private mounts, /etc is an overlay
/// whose changes land in DIR, and the manager's cgroups are made below the CGROUP
/// directories it is moved into first.
/// Usage: sandbox.sh outer DIR BINARY PROC_OPTIONS CGROUP...
const SANDBOX_SCRIPT: &str = r#"#!/bin/sh
set -eu
stage=$1 dir=$2 binary=$3 proc_options=$4
shift 4
case $stage in
outer)
    # A cgroup of our own in every hierarchy (moving may fail, e.g. into a v1 cpuset
    # without cpus; systemd does not use those).
    for cgroup in "$@"; do
        mkdir -p "$cgroup" && echo $$ > "$cgroup/cgroup.procs" 2>/dev/null || true
    done
    exec unshare --mount --uts --ipc --cgroup --propagation private -- "$0" inner "$dir" "$binary" "$proc_options"
    ;;
inner)
    cgroupfs=$(stat -f -c %T /sys/fs/cgroup)
    mount -t tmpfs -o mode=755 tmpfs /run
    # A procfs of the host's PID namespace with the unit's own options (see drop_in).
    mkdir /run/host-proc && mount -t proc -o "$proc_options" proc /run/host-proc
    mkdir -p /run/systemd/system/poolscope.service.d
    cp "$dir/poolscope.service" /run/systemd/system/
    cp "$dir/test.conf" /run/systemd/system/poolscope.service.d/
    # The unit's own paths: its ExecStart and its config file.
    mount -t tmpfs -o mode=755 tmpfs /usr/local/bin
    touch /usr/local/bin/poolscope && mount --bind "$binary" /usr/local/bin/poolscope
    mkdir "$dir/etc-upper" "$dir/etc-work"
    mount -t overlay overlay -o "lowerdir=/etc,upperdir=$dir/etc-upper,workdir=$dir/etc-work" /etc
    if [ -f "$dir/poolscope.toml" ]; then
        mkdir -p /etc/poolscope && cp "$dir/poolscope.toml" /etc/poolscope/
    fi
    if [ "$cgroupfs" = cgroup2fs ]; then
        mount -t cgroup2 cgroup2 /sys/fs/cgroup
    else
        # systemd mounts the controllers it uses itself, rooted in our cgroups too.
        mount -t tmpfs -o mode=755 tmpfs /sys/fs/cgroup
        mkdir /sys/fs/cgroup/systemd
        mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd
    fi
    # The host's pseudo devices only, so that the manager's set-up writes nothing there.
    mkdir "$dir/dev" && mount --rbind /dev "$dir/dev"
    mount -t tmpfs -o mode=755,nosuid tmpfs /dev
    for node in null zero full random urandom tty ptmx; do
        touch "/dev/$node" && mount --bind "$dir/dev/$node" "/dev/$node"
    done
    umount -l "$dir/dev"
    mkdir /dev/pts /dev/shm && mount -t tmpfs -o mode=1777 tmpfs /dev/shm
    ln -s /proc/self/fd /dev/fd
    exec unshare --pid --fork --kill-child=SIGKILL --mount-proc \
        env -i container=poolscope-test /lib/systemd/systemd --unit=poolscope.service
    ;;
esac
"#;

/// The drop-in that fits the unit to the throwaway manager. It changes none of the
/// unit's sandboxing.
fn drop_in(log: &Path) -> String {
    format!(
        "[Unit]
# No boot transaction: sysinit.target would apply sysctls and start udev on the host.
DefaultDependencies=no

[Service]
# The manager is PID 1 of its own PID namespace, so the /proc the unit mounts for
# itself (MountAPIVFS, which its Protect* settings imply) would list that namespace's
# processes, while the kernel programs report the host's PIDs, as they do on a host
# where the unit's /proc is the host's. A procfs of the host's PID namespace takes its
# place, mounted with the options the unit's ProcSubset= and ProtectProc= give it (as
# systemd mounts the unit's own); the unit's masks on top of it still apply.
BindPaths=/run/host-proc:/proc
# No journal in the throwaway manager.
StandardOutput=append:{log}
StandardError=append:{log}
",
        log = log.display()
    )
}

/// The directories of a cgroup `name` below this process's cgroup in every mounted
/// hierarchy (v1 controllers, v1 named, v2).
fn own_cgroups(name: &str) -> anyhow::Result<Vec<PathBuf>> {
    let membership = fs::read_to_string("/proc/self/cgroup")?;
    let mut dirs = Vec::new();
    for line in fs::read_to_string("/proc/self/mountinfo")?.lines() {
        let Some((mount, filesystem)) = line.split_once(" - ") else {
            continue;
        };
        let mount: Vec<&str> = mount.split(' ').collect();
        let filesystem: Vec<&str> = filesystem.split(' ').collect();
        let (Some(root), Some(mount_point), Some(kind)) =
            (mount.get(3), mount.get(4), filesystem.first())
        else {
            continue;
        };
        let options: Vec<&str> = filesystem.get(2).unwrap_or(&"").split(',').collect();
        let path = membership.lines().find_map(|line| {
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            let matches = match *kind {
                "cgroup2" => controllers.is_empty(),
                "cgroup" => {
                    !controllers.is_empty() && controllers.split(',').all(|c| options.contains(&c))
                }
                _ => false,
            };
            matches.then_some(path)
        });
        if let Some(path) = path {
            let below_root = path
                .strip_prefix(root.trim_end_matches('/'))
                .unwrap_or(path);
            dirs.push(
                Path::new(mount_point)
                    .join(below_root.trim_start_matches('/'))
                    .join(name),
            );
        }
    }
    ensure!(!dirs.is_empty(), "no cgroup hierarchy mounted");
    Ok(dirs)
}

/// The pid of the child of `parent` whose comm is `name`.
fn child_named(parent: u32, name: &str) -> Option<u32> {
    fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
        let stat = fs::read_to_string(entry.path().join("stat")).ok()?;
        let (head, tail) = stat.rsplit_once(") ")?;
        let comm = head.split_once(" (")?.1;
        let ppid: u32 = tail.split(' ').nth(1)?.parse().ok()?;
        (ppid == parent && comm == name).then_some(pid)
    })
}

/// poolscope started by a throwaway systemd from a unit file (systemd/poolscope.service
/// or the one the Debian package installed); the manager's whole PID namespace is
/// killed when dropped.
struct UnitSandbox {
    /// The `unshare` that forked the manager (--kill-child: its death kills it).
    launcher: Child,
    cgroups: Vec<PathBuf>,
    dir: tempfile::TempDir,
}

impl UnitSandbox {
    /// systemd/poolscope.service, with `config` as its configuration file.
    fn start(config: &str) -> anyhow::Result<Self> {
        Self::start_unit(UNIT, Some(config))
    }

    /// `unit`, with `config` as /etc/poolscope/poolscope.toml (`None`: the host's).
    fn start_unit(unit: &str, config: Option<&str>) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let script = dir.path().join("sandbox.sh");
        fs::write(&script, SANDBOX_SCRIPT)?;
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755))?;
        fs::write(dir.path().join("poolscope.service"), unit)?;
        fs::write(
            dir.path().join("test.conf"),
            drop_in(&dir.path().join("service.log")),
        )?;
        if let Some(config) = config {
            fs::write(dir.path().join("poolscope.toml"), config)?;
        }
        let launcher_log = fs::File::create(dir.path().join("launcher.log"))?;
        let cgroups = own_cgroups(&format!("poolscope-sandbox-{}", std::process::id()))?;
        let mut command = Command::new(&script);
        command
            .arg("outer")
            .arg(dir.path())
            .arg(bin_dir()?.join("poolscope"))
            .arg(proc_options(unit))
            .args(&cgroups)
            .stdin(Stdio::null())
            .stdout(launcher_log.try_clone()?)
            .stderr(launcher_log);
        // SAFETY: prctl in the child before exec; if this test dies, so does the
        // launcher, and with it the manager.
        unsafe {
            command.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let launcher = command.spawn().context("starting the sandbox")?;
        Ok(Self {
            launcher,
            cgroups,
            dir,
        })
    }

    fn manager(&self) -> Option<u32> {
        child_named(self.launcher.id(), "systemd")
    }

    fn poolscope(&self) -> Option<u32> {
        child_named(self.manager()?, "poolscope")
    }

    /// systemctl, talking to the throwaway manager.
    fn systemctl(&self, args: &[&str]) -> anyhow::Result<String> {
        let manager = self.manager().context("the manager is gone")?;
        succeeded(
            Command::new("nsenter")
                .args(["-t", &manager.to_string(), "-m", "-p", "systemctl"])
                .args(args),
        )
    }

    /// What poolscope logged.
    fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("service.log")).unwrap_or_default()
    }

    fn diagnosis(&self) -> String {
        let status = self
            .systemctl(&["status", "--no-pager", "poolscope.service"])
            .unwrap_or_else(|e| e.to_string());
        let launcher = fs::read_to_string(self.dir.path().join("launcher.log"));
        format!(
            "{status}\n--- poolscope's log:\n{}\n--- launcher:\n{}",
            self.log(),
            launcher.unwrap_or_default()
        )
    }
}

/// The mount options of the procfs systemd gives `unit` (its ProcSubset= and
/// ProtectProc=).
fn proc_options(unit: &str) -> String {
    let setting = |key: &str| {
        unit.lines()
            .rev()
            .find_map(|line| line.strip_prefix(key)?.strip_prefix('='))
            .map(str::trim)
    };
    let mut options = vec!["nosuid".to_owned(), "nodev".to_owned(), "noexec".to_owned()];
    if setting("ProcSubset") == Some("pid") {
        options.push("subset=pid".to_owned());
    }
    if let Some(hidepid) = setting("ProtectProc").filter(|value| *value != "default") {
        options.push(format!("hidepid={hidepid}"));
    }
    options.join(",")
}

/// Subdirectories first.
fn remove_cgroup(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup(&entry.path());
            }
        }
    }
    let _ = fs::remove_dir(dir);
}

impl Drop for UnitSandbox {
    fn drop(&mut self) {
        let _ = self.launcher.kill();
        let _ = self.launcher.wait();
        // The namespace's processes leave their cgroups as they die.
        wait_until(Duration::from_secs(10), || {
            self.cgroups.iter().all(|dir| {
                remove_cgroup(dir);
                !dir.exists()
            })
        });
    }
}

/// GET `path` from 127.0.0.1:`port`; the body of a 200 response.
fn get(port: u16, path: &str) -> anyhow::Result<String> {
    http_get(port, path)?.text(path)
}

/// Scrapes until `check` holds (15 s at most); the last scrape, or why not.
fn scrape_until(
    port: u16,
    sandbox: &UnitSandbox,
    what: &str,
    mut check: impl FnMut(&Metrics) -> bool,
) -> anyhow::Result<Metrics> {
    let mut last = Metrics::default();
    let ok = wait_until(Duration::from_secs(15), || {
        get(port, "/metrics").is_ok_and(|text| {
            last = Metrics::parse(&text);
            check(&last)
        })
    });
    ensure!(
        ok,
        "{what}: not seen; last scrape:\n{}\n{}",
        last.text,
        sandbox.diagnosis()
    );
    Ok(last)
}

/// The tools the sandbox needs (util-linux's and systemd's); under CI=true a missing
/// one fails the test.
fn sandbox_tools(test: &str) -> bool {
    let missing: Vec<&str> = [
        "/lib/systemd/systemd",
        "/usr/bin/unshare",
        "/usr/bin/nsenter",
    ]
    .into_iter()
    .filter(|tool| !Path::new(tool).exists())
    .collect();
    if missing.is_empty() {
        return true;
    }
    skip(test, &format!("missing {missing:?}"));
    false
}

/// poolscope as the unit runs it: started by systemd from systemd/poolscope.service
/// (only test.conf added, see `drop_in`), with its dynamic user, capabilities,
/// system-call filter and file-system sandbox. The test checks that the sandbox is in
/// force, then that every kind of number still comes: listen queues (sock_diag and
/// /proc of root's processes), requests counted by the kernel programs, user stack
/// frames named (/proc/<pid>/map_files), and that the unit's reload and stop work.
#[test]
fn runs_under_the_units_own_sandbox() -> anyhow::Result<()> {
    let test = "runs_under_the_units_own_sandbox";
    if !privileged(test) || !sandbox_tools(test) {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let backlog = TestServer::start(16)?;
    let _clients = [backlog.connect()?, backlog.connect()?];
    let pool = PoolServer::start(2, Duration::from_millis(5))?;
    let port = free_port()?;
    let sandbox = UnitSandbox::start(&format!(
        "[web]\nlisten_address = \"127.0.0.1:{port}\"\n\
         [discovery]\nrescan_interval = \"500ms\"\n\
         [stacks]\ninterval = \"2s\"\n"
    ))?;
    let serving = wait_until(Duration::from_secs(30), || get(port, "/healthz").is_ok());
    ensure!(
        serving,
        "poolscope does not serve under the unit:\n{}",
        sandbox.diagnosis()
    );
    let pid = sandbox
        .poolscope()
        .context("no poolscope under the manager")?;

    // The sandbox is in force.
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> anyhow::Result<String> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_owned())
            .with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    let uid = uid_of(pid)?;
    assert!(
        DYNAMIC_UIDS.contains(&uid),
        "uid {uid} is not a dynamic user"
    );
    let mask = unit_capability_mask()?;
    for set in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        let value = u64::from_str_radix(&field(set)?, 16)?;
        assert_eq!(value, mask, "{set}: {value:#x}, the unit grants {mask:#x}");
    }
    assert_eq!(field("NoNewPrivs")?, "1");
    assert_eq!(field("Seccomp")?, "2", "no system-call filter");
    let mounts = fs::read_to_string(format!("/proc/{pid}/mountinfo"))?;
    let root = mounts
        .lines()
        .find(|l| l.split(' ').nth(4) == Some("/"))
        .context("no / mount")?;
    assert!(
        root.split(' ')
            .nth(5)
            .is_some_and(|o| o.split(',').any(|o| o == "ro")),
        "/ is writable under ProtectSystem=strict: {root}"
    );
    // ProcSubset=pid hides everything in /proc but the processes (kallsyms, which
    // ProtectKernelTunables also empties; the host's is not empty).
    assert!(!fs::read("/proc/kallsyms")?.is_empty());
    assert!(
        fs::read(format!("/proc/{pid}/root/proc/kallsyms")).map_or(true, |k| k.is_empty()),
        "kallsyms is readable under the unit"
    );
    for hidden in ["sys", "stat", "kallsyms"] {
        assert!(
            !Path::new(&format!("/proc/{pid}/root/proc/{hidden}")).exists(),
            "/proc/{hidden} is there under the unit's ProcSubset=pid"
        );
    }
    // ProtectHome hides /root (the host's holds at least a shell profile).
    assert!(fs::read_dir("/root")?.next().is_some());
    assert!(
        fs::read_dir(format!("/proc/{pid}/root/root"))?
            .next()
            .is_none(),
        "/root is visible under the unit"
    );

    // Listen queues: sock_diag, and /proc/<pid>/fd of a root process.
    let listener = format!("127.0.0.1:{}", backlog.port);
    let labels = [("service", "testserver"), ("listener", listener.as_str())];
    scrape_until(port, &sandbox, "the backlog of 2", |m| {
        m.value("poolscope_listen_queue_depth", &labels) == Some(2.0)
    })?;
    // Requests: the kernel programs, through bpf() and perf_event_open().
    let service = [("service", "poolserver")];
    scrape_until(port, &sandbox, "poolserver watched", |m| {
        m.value("poolscope_targets", &service) == Some(1.0)
    })?;
    let clients = ClosedLoop::start(pool.port, 2, Connections::KeepAlive);
    // Stacks: off-CPU blocks of the pool, user frames named. Looked for while the
    // load runs: a snapshot taken after it has no serving blocks.
    let stacks = "/debug/stacks/offcpu?service=poolserver";
    let named = wait_until(Duration::from_secs(15), || {
        get(port, stacks).is_ok_and(|folded| folded.contains("poolserver::serve"))
    });
    let folded = get(port, stacks).unwrap_or_default();
    let seen = clients.stop()?;
    assert!(named, "no named frame of poolserver::serve:\n{folded}");
    ensure!(seen.completed > 0, "the clients completed nothing");
    scrape_until(port, &sandbox, "every request counted", |m| {
        m.value("poolscope_requests_total", &service) == Some(seen.completed as f64)
    })?;

    // The unit's ExecReload, then its stop.
    sandbox.systemctl(&["reload", "poolscope.service"])?;
    let reloaded = wait_until(Duration::from_secs(10), || {
        sandbox.log().contains("configuration reloaded")
    });
    assert!(reloaded, "no reload:\n{}", sandbox.diagnosis());
    sandbox.systemctl(&["stop", "poolscope.service"])?;
    assert!(
        sandbox.log().contains("probes detached"),
        "no clean stop:\n{}",
        sandbox.diagnosis()
    );
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "poolscope still runs"
    );
    drop(pool);
    Ok(())
}

/// What the Debian package puts on the host, and where `deb-systemd-helper` records
/// that the unit is enabled.
const PACKAGED_FILES: [&str; 4] = [
    "/usr/bin/poolscope",
    "/lib/systemd/system/poolscope.service",
    "/etc/poolscope/poolscope.toml",
    "/etc/systemd/system/multi-user.target.wants/poolscope.service",
];

/// What `command` printed (stdout, then stderr), or that and its failure.
fn succeeded(command: &mut Command) -> anyhow::Result<String> {
    let output = command
        .output()
        .with_context(|| format!("running {command:?}"))?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(output.status.success(), "{command:?}: {said}");
    Ok(said)
}

/// dpkg with `args`; its output, or why it failed.
fn dpkg(args: &[&str]) -> anyhow::Result<String> {
    succeeded(Command::new("dpkg").args(args))
}

/// dpkg's status of the poolscope package (`install ok installed`), if it knows it.
fn package_status() -> Option<String> {
    let output = Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", "poolscope"])
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The package `cargo xtask package` (and `cargo xtask test`, before this test)
/// built: `dpkg -i` puts the binary, the unit (enabled) and an empty configuration
/// on the host; systemd starts the installed unit with the installed configuration
/// (the defaults: auto-discovery, /metrics on 127.0.0.1:9435), and it measures a
/// server started before it; `dpkg --purge` leaves nothing behind.
#[test]
fn the_debian_package_installs_runs_its_unit_and_purges_cleanly() -> anyhow::Result<()> {
    let test = "the_debian_package_installs_runs_its_unit_and_purges_cleanly";
    if !privileged(test) || !sandbox_tools(test) {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let packages = bin_dir()?.join("../package");
    let deb = fs::read_dir(&packages)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .find(|path| path.extension().is_some_and(|ext| ext == "deb"));
    let Some(deb) = deb else {
        skip(
            test,
            &format!("no .deb in {}: run cargo xtask package", packages.display()),
        );
        return Ok(());
    };
    // An earlier run that died between install and purge.
    if package_status().is_some() {
        dpkg(&["--purge", "poolscope"])?;
    }
    const PORT: u16 = 9435;
    ensure!(
        std::net::TcpListener::bind(("127.0.0.1", PORT)).is_ok(),
        "127.0.0.1:{PORT}, the packaged configuration's /metrics, is taken"
    );
    let pool = PoolServer::start(2, Duration::from_millis(5))?;
    dpkg(&["--install", deb.to_str().context("a non-UTF-8 path")?])?;
    let installed = (|| -> anyhow::Result<()> {
        ensure!(
            package_status().as_deref() == Some("install ok installed"),
            "dpkg status after install: {:?}",
            package_status()
        );
        for file in PACKAGED_FILES {
            ensure!(Path::new(file).exists(), "{file} is missing after install");
        }
        let unit = fs::read_to_string("/lib/systemd/system/poolscope.service")?;
        ensure!(
            unit.contains("\nExecStart=/usr/bin/poolscope "),
            "the installed unit does not start the installed binary"
        );
        let sandbox = UnitSandbox::start_unit(&unit, None)?;
        let service = [("service", "poolserver")];
        scrape_until(PORT, &sandbox, "poolserver watched", |m| {
            m.value("poolscope_targets", &service) == Some(1.0)
        })?;
        let pid = sandbox
            .poolscope()
            .context("no poolscope under the manager")?;
        let exe = fs::read_link(format!("/proc/{pid}/exe"))?;
        ensure!(
            exe == Path::new("/usr/bin/poolscope"),
            "the unit runs {}",
            exe.display()
        );
        let clients = ClosedLoop::start(pool.port, 2, Connections::KeepAlive);
        std::thread::sleep(Duration::from_secs(2));
        let seen = clients.stop()?;
        ensure!(seen.completed > 0, "the clients completed nothing");
        scrape_until(PORT, &sandbox, "every request counted", |m| {
            m.value("poolscope_requests_total", &service) == Some(seen.completed as f64)
        })?;
        eprintln!(
            "{}: {} requests counted by the packaged unit",
            deb.display(),
            seen.completed
        );
        Ok(())
    })();
    let purged = dpkg(&["--purge", "poolscope"]);
    installed?;
    purged?;
    ensure!(
        package_status().is_none_or(|status| status.ends_with("not-installed")),
        "dpkg status after purge: {:?}",
        package_status()
    );
    for file in PACKAGED_FILES.iter().chain(&["/etc/poolscope"]) {
        ensure!(
            fs::symlink_metadata(file).is_err(),
            "{file} is left after purge"
        );
    }
    Ok(())
}
