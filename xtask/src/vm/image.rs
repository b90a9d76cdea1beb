//! The guest, built once and cached under [`CACHE`]: a root filesystem that debootstrap
//! builds from Debian's packages, with the kernels of [`KERNELS`] installed by apt,
//! turned into an ext4 image, rebuilt only when its recipe changes.
use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use super::{KERNELS, SUITE};

/// Where the guest's kernel, initrd and root image are kept between runs (outside
/// the clone: CI starts from a clean one).
const CACHE: &str = "/var/cache/poolscope/vm";
const MIRROR: &str = "http://deb.debian.org/debian";
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

/// One kernel of the guest: its files, cached.
pub(super) struct Boot {
    pub(super) kernel: PathBuf,
    pub(super) initrd: PathBuf,
}

/// The guest's kernels (in [`KERNELS`]' order) and root image.
pub(super) struct Guest {
    pub(super) boots: Vec<Boot>,
    pub(super) image: PathBuf,
}

/// The cached guest, built first if missing or made by another recipe.
pub(super) fn ensure_guest() -> anyhow::Result<Guest> {
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
