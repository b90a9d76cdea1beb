//! `cargo xtask vm-test`: poolscope in a VM on each kernel of [`KERNELS`]: Debian 12's
//! stock kernel (6.1, the oldest supported: the tcp backend, and the syscall one
//! forced) and the newest one Debian 12 offers from bookworm-backports (6.12: the
//! socket backend).
//!
//! - The guest: a root filesystem that debootstrap builds from Debian's packages,
//!   with both kernels installed by apt, turned into an ext4 image. Kernels and image
//!   are cached under [`CACHE`], keyed by a stamp of the recipe, so later runs only
//!   boot.
//! - The run: qemu boots each kernel in turn (KVM where a guest boots under it, software
//!   emulation otherwise) with the host's `target/release` shared read-only and a work
//!   directory shared read-write. The guest's init runs [`guest_script`]: poolscope on
//!   its default configuration (which probes attached, which backend), then a subset
//!   of the privileged ground-truth tests, the very test binaries the host runs.
//! - The report, per kernel: its release, the backend, every probe attached or skipped
//!   (with the reason), each test passed or failed; the task fails unless each guest
//!   ran its kernel, auto chose that kernel's backend, every probe attached and every
//!   test passed.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

/// Debian packages the host needs: qemu and debootstrap (mke2fs is in e2fsprogs).
pub const PACKAGES: &[&str] = &["qemu-system-x86", "debootstrap", "e2fsprogs"];

/// Where the guest's kernel, initrd and root image are kept between runs (outside
/// the clone: CI starts from a clean one).
const CACHE: &str = "/var/cache/poolscope/vm";
const SUITE: &str = "bookworm";
const MIRROR: &str = "http://deb.debian.org/debian";

/// A kernel the guest boots.
struct GuestKernel {
    /// The start of the release it must report (and of its file names in /boot).
    series: &'static str,
    /// The Debian suite its `linux-image-amd64` comes from.
    suite: &'static str,
    /// The backend `auto` must choose on it.
    backend: &'static str,
    /// The backends its ground-truth tests run on (`POOLSCOPE_TEST_BACKENDS`): the
    /// one it is there for and the syscall one; the host runs every backend.
    test_backends: &'static str,
}

/// The oldest kernel poolscope supports, and the newest Debian 12 offers.
const KERNELS: [GuestKernel; 2] = [
    GuestKernel {
        series: "6.1.",
        suite: SUITE,
        backend: "tcp",
        test_backends: "tcp,syscall",
    },
    GuestKernel {
        series: "6.12.",
        suite: "bookworm-backports",
        backend: "socket",
        test_backends: "socket,syscall",
    },
];
/// Besides the minimal base: the kernel, `ip` (loopback up) and curl (scrape).
const GUEST_PACKAGES: &str = "linux-image-amd64,iproute2,curl";
/// The guest's /sbin/poolscope-vm-init: mounts the host's shares, runs the script.
const GUEST_INIT: &str = "#!/bin/sh
# poolscope vm-test: mount what the host shares (its target/release, read-only; a work
# directory with the script to run, for the results) and run the script.
mount -t proc proc /proc 2>/dev/null
mount -t sysfs sysfs /sys 2>/dev/null
mkdir -p /poolscope/release /poolscope/work
mount -t 9p -o trans=virtio,version=9p2000.L,ro release /poolscope/release
mount -t 9p -o trans=virtio,version=9p2000.L work /poolscope/work
exec /poolscope/work/run
";

/// The ground-truth tests that run in each guest: (test target, test names), each on
/// every backend the kernel has (`backends()`). Chosen for software emulation, where
/// each request's syscalls cost ~0.4 ms more than on hardware: tests whose truth is a
/// count, a queue, a schedstat share, the program's own CPU clock or durations from
/// the same syscalls, not those that this cost alone puts past their bound (5 ms
/// service times within 5 %; a pool kept full while each request also pays a
/// connection's accept; CPU samples split between two functions by
/// the program's CPU clock: the count exact, 988 of 988, but the share 66.6 % against
/// 74.7 % in 1 of 3 runs on 6.12, the emulated timer's samples not uniform in time).
/// The keep-alive controlled pool (queue time and in-flight against a pool kept full)
/// stays out too: under emulation a worker is between requests long enough to read
/// 3.8 in flight for 4 (6.12, tcp backend) and Little's law 4.4 % off on 6.1.
const GUEST_TESTS: &[(&str, &[&str])] = &[
    (
        "foundation",
        &[
            "auto_discovery_finds_a_listening_process_by_comm",
            "every_probe_attaches_on_this_kernel",
            "an_exec_is_discovered_without_waiting_for_a_rescan",
            "closed_unserved_connections_leave_the_gauge_and_the_map",
            "forked_children_count_under_the_parent_service",
            "listen_queue_depth_counts_clients_waiting_for_accept",
            "series_of_an_exited_process_go_away_within_two_scrapes",
            "unserved_connections_until_the_server_reads",
        ],
    ),
    (
        "requests",
        &[
            "partial_reads_and_writes",
            "server_writes_before_reading_everything",
            "a_full_connection_map_is_counted_and_spares_the_tracked_connections",
        ],
    ),
    ("threads", &["two_spinners_on_one_cpu_wait_half_the_time"]),
    ("pods", &["same_port_in_two_namespaces_both_watched"]),
    (
        "adoption",
        &[
            "accepted_unread_connections_older_than_poolscope_are_queued",
            "keep_alive_connections_older_than_poolscope_are_followed",
            "old_connections_beyond_the_map_size_are_counted",
        ],
    ),
    (
        "locks",
        &[
            "a_process_killed_mid_wait_leaves_no_entries",
            "counted_map_entries_match_a_walk_of_each_map",
            "full_lock_maps_are_counted_and_spare_the_request_numbers",
        ],
    ),
    ("stacks", &["offcpu_time_matches_the_programs_sleeps"]),
    (
        "faults",
        &[
            "a_full_pending_call_map_is_counted_and_recovers",
            "a_full_watch_map_is_counted_for_a_forked_child_and_recovers",
        ],
    ),
];

const GUEST_MEMORY_MIB: u32 = 2048;
/// The longest a run may take (each guest takes ~2.5–3 min under software emulation).
const RUN_TIMEOUT: Duration = Duration::from_secs(20 * 60);
/// Boots of the test guest: another one only after the guest's kernel reported one of
/// [`EMULATION_FAULTS`]. One CI run saw two lockups in a row on 6.1 and an int3 Oops
/// on 6.12.
const RUN_ATTEMPTS: u32 = 3;
/// What the guest's kernel prints when software emulation, not poolscope, breaks it:
/// a CPU stuck because its timers stalled ("rcu ... timer wakeup didn't happen"), and
/// the int3 that live code patching leaves in a static branch (flipped as probes
/// attach and detach) executed by another emulated CPU before the patch completed
/// (`Oops: int3` in `__schedule`).
const EMULATION_FAULTS: [&str; 2] = ["watchdog: BUG: soft lockup", "Oops: int3"];
/// The start of the reason [`boot`] gives for a guest stopped by one of them.
const EMULATION_FAULT: &str = "was stopped: its kernel reported";
/// How long a guest under KVM may take to boot and power off before KVM is taken as
/// not working here (nested virtualization often hangs rather than fails).
const KVM_PROBE_TIMEOUT: Duration = Duration::from_secs(40);

/// One kernel of the guest: its files, cached.
struct Boot {
    kernel: PathBuf,
    initrd: PathBuf,
}

/// The guest's kernels (in [`KERNELS`]' order) and root image.
struct Guest {
    boots: Vec<Boot>,
    image: PathBuf,
}

pub fn run(root: &Path) -> anyhow::Result<()> {
    let guest = ensure_guest()?;
    let binaries = build(root)?;
    let release = root.join("target/release");
    let mut problems = Vec::new();
    let mut accel = None;
    for (kernel, boot_files) in KERNELS.iter().zip(&guest.boots) {
        let started = Instant::now();
        let work = root
            .join("target/vm-test")
            .join(kernel.series.trim_end_matches('.'));
        let accel = match accel {
            Some(accel) => accel,
            None => *accel.insert(accelerator(&guest, boot_files, root, &work)?),
        };
        let mut status = None;
        for attempt in 1..=RUN_ATTEMPTS {
            prepare_work(&work, &guest_script(&binaries, kernel, accel))?;
            eprintln!(
                "xtask: booting {}'s kernel {}x under {accel} (attempt {attempt})",
                kernel.suite, kernel.series
            );
            status = boot(&guest, boot_files, accel, &release, &work, RUN_TIMEOUT)?;
            match &status {
                Some(reason) if reason.starts_with(EMULATION_FAULT) && attempt < RUN_ATTEMPTS => {
                    eprintln!("xtask: the guest {reason}; booting it again");
                }
                _ => break,
            }
        }
        let report = Report::read(&work)?;
        println!(
            "{}",
            report.table(kernel, accel, started.elapsed(), status.as_deref(), &work)
        );
        problems.extend(report.problems(kernel));
    }
    if problems.is_empty() {
        return Ok(());
    }
    bail!("vm-test failed:\n  {}", problems.join("\n  "))
}

/// Builds what the guest runs: poolscope, the test programs and the test binaries
/// of [`GUEST_TESTS`]; returns each test binary's file name under deps/.
fn build(root: &Path) -> anyhow::Result<BTreeMap<&'static str, String>> {
    crate::cargo(
        root,
        &[
            "build",
            "--quiet",
            "--release",
            "--package",
            "poolscope",
            "--package",
            "poolscope-tests",
        ],
    )?;
    let mut args = vec![
        "test",
        "--quiet",
        "--release",
        "--package",
        "poolscope-tests",
        "--no-run",
        "--message-format=json",
    ];
    for (target, _) in GUEST_TESTS {
        args.extend(["--test", target]);
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = Command::new(cargo)
        .args(&args)
        .current_dir(root)
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo test --no-run")?;
    if !output.status.success() {
        bail!("cargo {} failed ({})", args.join(" "), output.status);
    }
    let messages = String::from_utf8_lossy(&output.stdout);
    GUEST_TESTS
        .iter()
        .map(|(target, _)| {
            let path = test_executable(&messages, target)
                .with_context(|| format!("cargo built no test executable for {target}"))?;
            let name = Path::new(&path)
                .file_name()
                .and_then(|n| n.to_str())
                .with_context(|| format!("test executable {path} has no file name"))?;
            Ok((*target, name.to_owned()))
        })
        .collect()
}

/// The executable of test target `target` in cargo's JSON messages.
fn test_executable(messages: &str, target: &str) -> Option<String> {
    let wanted = format!("\"kind\":[\"test\"],\"crate_types\":[\"bin\"],\"name\":\"{target}\"");
    messages
        .lines()
        .filter(|line| line.contains(&wanted))
        .find_map(|line| {
            let start = line.find("\"executable\":\"")? + "\"executable\":\"".len();
            let end = start + line.get(start..)?.find('"')?;
            line.get(start..end).map(str::to_owned)
        })
}

/// The cached guest, built first if missing or made by another recipe.
fn ensure_guest() -> anyhow::Result<Guest> {
    let cache = Path::new(CACHE).join(SUITE);
    let guest = Guest {
        boots: KERNELS
            .iter()
            .map(|kernel| Boot {
                kernel: cache.join(format!("vmlinuz-{}x", kernel.series)),
                initrd: cache.join(format!("initrd.img-{}x", kernel.series)),
            })
            .collect(),
        image: cache.join("rootfs.img"),
    };
    let stamp = cache.join("recipe");
    let kernels: Vec<String> = KERNELS
        .iter()
        .map(|kernel| format!("{} from {}", kernel.series, kernel.suite))
        .collect();
    let recipe = format!(
        "{SUITE} {MIRROR} {GUEST_PACKAGES}\nkernels {}\n{GUEST_INIT}",
        kernels.join(", ")
    );
    if fs::read_to_string(&stamp).is_ok_and(|s| s == recipe) {
        return Ok(guest);
    }
    eprintln!("xtask: building the guest (debootstrap {SUITE} with {GUEST_PACKAGES}) in {CACHE}");
    let _ = fs::remove_dir_all(&cache);
    let rootfs = cache.join("rootfs");
    fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let rootfs_arg = rootfs.to_string_lossy().into_owned();
    run_quietly(
        "debootstrap",
        &[
            "--variant=minbase",
            &format!("--include={GUEST_PACKAGES}"),
            SUITE,
            &rootfs_arg,
            MIRROR,
        ],
        &cache.join("debootstrap.log"),
    )?;
    let init = rootfs.join("sbin/poolscope-vm-init");
    fs::write(&init, GUEST_INIT).with_context(|| format!("writing {}", init.display()))?;
    fs::set_permissions(&init, fs::Permissions::from_mode(0o755))?;
    // debootstrap installed the suite's kernel; the others come from their suites,
    // by the guest's own apt (its initramfs-tools makes their initrds).
    for kernel in KERNELS.iter().filter(|kernel| kernel.suite != SUITE) {
        let sources = rootfs.join(format!("etc/apt/sources.list.d/{}.list", kernel.suite));
        fs::write(&sources, format!("deb {MIRROR} {} main\n", kernel.suite))
            .with_context(|| format!("writing {}", sources.display()))?;
        let log = cache.join(format!("kernel-{}.log", kernel.suite));
        let apt = |args: &[&str]| {
            let mut command = vec![rootfs_arg.as_str(), "env", "DEBIAN_FRONTEND=noninteractive"];
            command.extend(args);
            run_quietly("chroot", &command, &log)
        };
        apt(&["apt-get", "update", "-q"])?;
        apt(&[
            "apt-get",
            "install",
            "-y",
            "-q",
            "--no-install-recommends",
            "-t",
            kernel.suite,
            "linux-image-amd64",
        ])?;
    }
    // Each kernel and its initrd (the newest of its series).
    let boot = rootfs.join("boot");
    for (kernel, files) in KERNELS.iter().zip(&guest.boots) {
        fs::copy(
            newest(&boot, &format!("vmlinuz-{}", kernel.series))?,
            &files.kernel,
        )?;
        fs::copy(
            newest(&boot, &format!("initrd.img-{}", kernel.series))?,
            &files.initrd,
        )?;
    }
    let image_arg = guest.image.to_string_lossy().into_owned();
    run_quietly(
        "mke2fs",
        &[
            "-q",
            "-t",
            "ext4",
            "-F",
            "-d",
            &rootfs_arg,
            &image_arg,
            "2G",
        ],
        &cache.join("mke2fs.log"),
    )?;
    fs::remove_dir_all(&rootfs).with_context(|| format!("removing {}", rootfs.display()))?;
    fs::write(&stamp, recipe).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(guest)
}

/// The file in `dir` whose name starts with `prefix` and sorts last.
fn newest(dir: &Path, prefix: &str) -> anyhow::Result<PathBuf> {
    let mut found: Vec<PathBuf> = fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix))
        })
        .collect();
    found.sort();
    found
        .pop()
        .with_context(|| format!("no {prefix}* in {}", dir.display()))
}

/// Runs `program`, its output to `log`; on failure the error names the log.
fn run_quietly(program: &str, args: &[&str], log: &Path) -> anyhow::Result<()> {
    let file = fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let status = Command::new(program)
        .args(args)
        .stdout(file.try_clone()?)
        .stderr(file)
        .status()
        .with_context(|| format!("running {program}"))?;
    if !status.success() {
        bail!("{program} failed ({status}); see {}", log.display());
    }
    Ok(())
}

/// KVM where a guest boots under it; software emulation otherwise.
fn accelerator(
    guest: &Guest,
    boot_files: &Boot,
    root: &Path,
    work: &Path,
) -> anyhow::Result<&'static str> {
    let kvm = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm");
    if let Err(error) = kvm {
        eprintln!("xtask: no usable /dev/kvm ({error}): software emulation");
        return Ok("tcg");
    }
    prepare_work(work, &format!("echo {BOOTED}\n{POWER_OFF}"))?;
    let release = root.join("target/release");
    let booted = boot(guest, boot_files, "kvm", &release, work, KVM_PROBE_TIMEOUT)?.is_none()
        && fs::read_to_string(work.join("serial.log")).is_ok_and(|s| s.contains(BOOTED));
    if booted {
        return Ok("kvm");
    }
    eprintln!(
        "xtask: /dev/kvm is there but a guest did not boot under it within {} s \
         (nested virtualization?): software emulation",
        KVM_PROBE_TIMEOUT.as_secs()
    );
    Ok("tcg")
}

/// Printed by the guest script once it runs.
const BOOTED: &str = "poolscope-vm: booted";
/// Powers the guest off; the sleep keeps init alive until it is off (an init that
/// exits panics the kernel).
const POWER_OFF: &str = "echo o > /proc/sysrq-trigger\nsleep 60\n";

/// A fresh work directory holding `script` as `run`.
fn prepare_work(work: &Path, script: &str) -> anyhow::Result<()> {
    let _ = fs::remove_dir_all(work);
    fs::create_dir_all(work.join("tests"))
        .with_context(|| format!("creating {}", work.display()))?;
    let run = work.join("run");
    fs::write(&run, format!("#!/bin/sh\n{script}"))
        .with_context(|| format!("writing {}", run.display()))?;
    fs::set_permissions(&run, fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// Boots the guest until it powers off; `Some(reason)` if it had to be stopped.
fn boot(
    guest: &Guest,
    boot_files: &Boot,
    accel: &str,
    release: &Path,
    work: &Path,
    timeout: Duration,
) -> anyhow::Result<Option<String>> {
    // Under software emulation, one host thread runs both vCPUs in turn
    // (`thread=single`): with a thread per vCPU, a vCPU can still execute the int3 that
    // live patching of a static branch leaves for a moment after the kernel's own sync
    // with every CPU (`Oops: int3` in `__schedule` on 6.12, three boots in a row in one
    // CI run); taking turns, no vCPU runs code another one is patching.
    let (cpu, accel) = if accel == "kvm" {
        ("host", "kvm")
    } else {
        ("max", "tcg,thread=single")
    };
    let share = |path: &Path, tag: &str, extra: &str| {
        format!(
            "local,path={},mount_tag={tag},security_model=none{extra}",
            path.display()
        )
    };
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-machine", "q35", "-accel", accel])
        .args([
            "-cpu",
            cpu,
            "-smp",
            "2",
            "-m",
            &GUEST_MEMORY_MIB.to_string(),
        ])
        .args(["-display", "none", "-no-reboot"])
        .arg("-serial")
        .arg(format!("file:{}", work.join("serial.log").display()))
        .arg("-kernel")
        .arg(&boot_files.kernel)
        .arg("-initrd")
        .arg(&boot_files.initrd)
        .args([
            "-append",
            "root=/dev/vda rw console=ttyS0 init=/sbin/poolscope-vm-init panic=-1 quiet",
        ])
        .arg("-drive")
        .arg(format!(
            "file={},format=raw,if=virtio,snapshot=on",
            guest.image.display()
        ))
        .args(["-virtfs", &share(release, "release", ",readonly=on")])
        .args(["-virtfs", &share(work, "work", "")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(work.join("qemu.log"))?)
        .spawn()
        .context("starting qemu-system-x86_64")?;
    let deadline = Instant::now() + timeout;
    let fault = || {
        let serial = fs::read_to_string(work.join("serial.log")).unwrap_or_default();
        emulation_fault(&serial).map(|fault| format!("{EMULATION_FAULT} `{fault}` (serial.log)"))
    };
    loop {
        if let Some(status) = child.try_wait()? {
            // A panicked guest powers off (panic=-1, -no-reboot): say why.
            return Ok(fault()
                .or_else(|| (!status.success()).then(|| format!("qemu exited with {status}"))));
        }
        let fault = fault();
        if fault.is_some() || Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(Some(fault.unwrap_or_else(|| {
                format!("was stopped after {} s", timeout.as_secs())
            })));
        }
        sleep(Duration::from_millis(200));
    }
}

/// The first of [`EMULATION_FAULTS`] the guest's kernel log holds.
fn emulation_fault(serial: &str) -> Option<&'static str> {
    EMULATION_FAULTS
        .into_iter()
        .find(|fault| serial.contains(fault))
}

/// The script the guest runs under `accel`: poolscope on its defaults, then the tests.
fn guest_script(binaries: &BTreeMap<&str, String>, kernel: &GuestKernel, accel: &str) -> String {
    let mut script = format!(
        "echo {BOOTED} $(uname -r)
cd /poolscope/work
uname -r > kernel.txt
ip link set lo up
# poolscope on its built-in default: which probes attached, which backend.
/poolscope/release/poolscope > poolscope.log 2>&1 &
pid=$!
for attempt in $(seq 100); do
  curl -sf http://127.0.0.1:9435/metrics > metrics.txt && break
  sleep 0.3
done
kill $pid
wait $pid
echo $? > poolscope.exit
# The ground-truth tests, as root, where skipping fails (CI=true).
export CI=true
export POOLSCOPE_TEST_BACKENDS={}
",
        kernel.test_backends
    );
    if accel == "tcg" {
        // Durations compared with a program's own clock allow for emulation's cost
        // (`poolscope_tests::emulation_allowance`).
        script.push_str("export POOLSCOPE_TEST_EMULATED=1\n");
    }
    for (target, names) in GUEST_TESTS {
        let binary = binaries.get(target).map_or("missing", String::as_str);
        let _ = writeln!(
            script,
            "/poolscope/release/deps/{binary} --exact {} --test-threads 1 --nocapture \
             > tests/{target}.log 2>&1",
            names.join(" ")
        );
    }
    script.push_str(POWER_OFF);
    script
}

/// What the guest left in the work directory.
struct Report {
    kernel: String,
    backend: Option<String>,
    /// probe → `None` if attached, else the reason it was skipped.
    probes: BTreeMap<String, Option<String>>,
    /// test → passed; a test with no result line did not run to its end.
    tests: Vec<(String, Option<bool>)>,
    /// What each failed test printed: CI keeps only the output, not the guest's logs.
    failures: Vec<(String, String)>,
    poolscope_exit: String,
    /// poolscope's start-up summary (attached, on demand, skipped).
    summary: String,
}

impl Report {
    fn read(work: &Path) -> anyhow::Result<Self> {
        let read = |name: &str| fs::read_to_string(work.join(name)).unwrap_or_default();
        let metrics = read("metrics.txt");
        let mut probes = BTreeMap::new();
        let mut backend = None;
        for line in metrics.lines() {
            if let Some(rest) = line.strip_prefix("poolscope_probe_attached{probe=\"")
                && let Some((probe, _)) = rest.split_once('"')
            {
                probes.entry(probe.to_owned()).or_insert(None);
            } else if let Some(rest) = line.strip_prefix("poolscope_probe_skipped{probe=\"")
                && let Some((probe, rest)) = rest.split_once("\",reason=\"")
                && let Some((reason, _)) = rest.split_once('"')
            {
                probes.insert(probe.to_owned(), Some(reason.to_owned()));
            } else if line.starts_with("poolscope_build_info{")
                && let Some((_, rest)) = line.split_once("backend=\"")
                && let Some((name, _)) = rest.split_once('"')
            {
                backend = Some(name.to_owned());
            }
        }
        let mut tests = Vec::new();
        let mut failures = Vec::new();
        for (target, names) in GUEST_TESTS {
            let log = read(&format!("tests/{target}.log"));
            let results = test_results(&log, names);
            for (name, result) in names.iter().zip(&results) {
                if *result == Some(false) {
                    let output = test_output(&log, name).unwrap_or("(no output found)");
                    failures.push((format!("{target}::{name}"), output.to_owned()));
                }
            }
            tests.extend(
                names
                    .iter()
                    .zip(results)
                    .map(|(name, result)| (format!("{target}::{name}"), result)),
            );
        }
        Ok(Self {
            kernel: read("kernel.txt").trim().to_owned(),
            backend,
            probes,
            tests,
            failures,
            poolscope_exit: read("poolscope.exit").trim().to_owned(),
            summary: read("poolscope.log")
                .lines()
                .find(|line| line.contains("kernel probes loaded"))
                .and_then(|line| line.split_once("kernel="))
                .map_or_else(String::new, |(_, fields)| format!("kernel={fields}")),
        })
    }

    fn table(
        &self,
        kernel: &GuestKernel,
        accel: &str,
        took: Duration,
        stopped: Option<&str>,
        work: &Path,
    ) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "\nvm-test: Debian {SUITE}, kernel {} (from {}), {accel}, {} s",
            self.kernel,
            kernel.suite,
            took.as_secs()
        );
        if let Some(reason) = stopped {
            let _ = writeln!(out, "the guest {reason}");
        }
        let _ = writeln!(
            out,
            "backend chosen by auto: {}",
            self.backend.as_deref().unwrap_or("(no metrics)")
        );
        let _ = writeln!(out, "poolscope at start: {}", self.summary);
        let _ = writeln!(out, "{:<36} state", "probe");
        for (probe, skipped) in &self.probes {
            let state = skipped
                .as_deref()
                .map_or("attached".to_owned(), |reason| format!("skipped: {reason}"));
            let _ = writeln!(out, "{probe:<36} {state}");
        }
        let _ = writeln!(out, "{:<84} result", "ground-truth test");
        for (test, passed) in &self.tests {
            let result = match passed {
                Some(true) => "passed",
                Some(false) => "FAILED",
                None => "did not finish",
            };
            let _ = writeln!(out, "{test:<84} {result}");
        }
        for (test, output) in &self.failures {
            let _ = writeln!(out, "--- what {test} printed ---\n{output}");
        }
        let _ = write!(
            out,
            "logs: {} (serial.log, poolscope.log, tests/)",
            work.display()
        );
        out
    }

    /// What is wrong with the run on `kernel`, each prefixed by the kernel.
    fn problems(&self, kernel: &GuestKernel) -> Vec<String> {
        let mut problems = Vec::new();
        if !self.kernel.starts_with(kernel.series) {
            problems.push(format!(
                "the guest ran kernel {:?}, not {}x",
                self.kernel, kernel.series
            ));
        }
        if self.backend.as_deref() != Some(kernel.backend) {
            problems.push(format!(
                "backend {:?}, not {}",
                self.backend, kernel.backend
            ));
        }
        if self.probes.is_empty() {
            problems.push("poolscope served no probe_attached".to_owned());
        }
        for (probe, skipped) in &self.probes {
            if let Some(reason) = skipped {
                problems.push(format!("probe {probe} skipped: {reason} (poolscope.log)"));
            }
        }
        if self.poolscope_exit != "0" {
            problems.push(format!(
                "poolscope exited with {:?} on SIGTERM",
                self.poolscope_exit
            ));
        }
        for (test, passed) in &self.tests {
            if *passed != Some(true) {
                problems.push(format!("{test} did not pass"));
            }
        }
        problems
            .into_iter()
            .map(|problem| format!("kernel {}x: {problem}", kernel.series))
            .collect()
    }
}

/// Each test's result from a libtest log of a run of exactly `names`: `None` for all
/// if the run did not end with its summary or ran other tests than asked. With
/// `--nocapture` a test's output may split its result line, so failures are read
/// from the summary's list.
fn test_results(log: &str, names: &[&str]) -> Vec<Option<bool>> {
    let plural = if names.len() == 1 { "" } else { "s" };
    let ran_all = log
        .lines()
        .any(|line| line == format!("running {} test{plural}", names.len()));
    let Some(summary) = log.rfind("\ntest result: ") else {
        return vec![None; names.len()];
    };
    if !ran_all {
        return vec![None; names.len()];
    }
    let failed: Vec<&str> = log[..summary]
        .rfind("\nfailures:\n")
        .map(|start| {
            log[start..summary]
                .lines()
                .filter_map(|line| line.strip_prefix("    "))
                .collect()
        })
        .unwrap_or_default();
    names
        .iter()
        .map(|name| Some(!failed.contains(name)))
        .collect()
}

/// What test `name` printed in a libtest log run with `--nocapture` (the guest's):
/// from its `test <name> ...` line to the next test's or the failure summary.
fn test_output<'log>(log: &'log str, name: &str) -> Option<&'log str> {
    let start = log.find(&format!("test {name} ... "))?;
    let rest = &log[start..];
    let end = ["\ntest ", "\nfailures:\n"]
        .iter()
        .filter_map(|next| rest.find(next))
        .min()
        .unwrap_or(rest.len());
    Some(rest[..end].trim_end())
}

#[cfg(test)]
mod tests {
    use super::{emulation_fault, test_executable, test_output, test_results};

    #[test]
    fn emulation_faults_are_told_from_the_guest_kernels_log() {
        let lockup =
            "[  148.6] watchdog: BUG: soft lockup - CPU#0 stuck for 45s! [tokio-rt-worker:385]";
        assert_eq!(emulation_fault(lockup), Some("watchdog: BUG: soft lockup"));
        let int3 = "[   78.5] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI\n[   78.5] RIP: 0010:__schedule+0x34e/0xc00";
        assert_eq!(emulation_fault(int3), Some("Oops: int3"));
        assert_eq!(
            emulation_fault("poolscope-vm: booted 6.1.0-50-amd64\n"),
            None
        );
        // Another Oops (a general protection fault, a NULL dereference) is no
        // emulation fault: the run fails with it.
        assert_eq!(
            emulation_fault("Oops: general protection fault, probably for non-canonical address"),
            None
        );
    }

    #[test]
    fn failures_are_read_from_the_summary_of_a_run() {
        let names = ["fast", "slow"];
        let failed = "running 2 tests\ntest fast ... noise\nok\ntest slow ... FAILED\n\n\
                      failures:\n\n---- slow stdout ----\nError: 6% off\n\n\
                      failures:\n    slow\n\ntest result: FAILED. 1 passed; 1 failed\n";
        assert_eq!(test_results(failed, &names), [Some(true), Some(false)]);
        assert_eq!(test_output(failed, "slow"), Some("test slow ... FAILED"));
        let inline = "running 2 tests\ntest slow ... counted 4001 of 4002\n\nthread 'slow' \
                      panicked at t.rs:1:5:\nassertion failed\nFAILED\ntest fast ... ok\n";
        assert_eq!(
            test_output(inline, "slow"),
            Some(
                "test slow ... counted 4001 of 4002\n\nthread 'slow' panicked at t.rs:1:5:\n\
                 assertion failed\nFAILED"
            )
        );
        let passed =
            "running 2 tests\ntest fast ... ok\ntest slow ... ok\n\ntest result: ok. 2 passed\n";
        assert_eq!(test_results(passed, &names), [Some(true), Some(true)]);
        assert_eq!(test_output(passed, "absent"), None);
        let cut = "running 2 tests\ntest fast ... ok\n";
        assert_eq!(test_results(cut, &names), [None, None]);
        let filtered = "running 1 test\ntest fast ... ok\n\ntest result: ok. 1 passed\n";
        assert_eq!(test_results(filtered, &names), [None, None]);
        assert_eq!(test_results(filtered, &["fast"]), [Some(true)]);
    }

    #[test]
    fn finds_a_test_targets_executable_in_cargos_messages() {
        let messages = concat!(
            r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"crate_types":["lib"],"name":"poolscope_tests"},"executable":null}"#,
            "\n",
            r#"{"reason":"compiler-artifact","target":{"kind":["test"],"crate_types":["bin"],"name":"requests","src_path":"/w/tests/tests/requests.rs"},"executable":"/w/target/release/deps/requests-00945a450b5a0469","fresh":true}"#,
            "\n",
        );
        assert_eq!(
            test_executable(messages, "requests").as_deref(),
            Some("/w/target/release/deps/requests-00945a450b5a0469")
        );
        assert_eq!(test_executable(messages, "threads"), None);
    }
}
