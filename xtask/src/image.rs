//! `cargo xtask image`: the container image the DaemonSet runs, made from Debian
//! packages only (no registry pull): a root file system holding exactly the files of
//! `libc6`, `libgcc-s1` (what the binary links: `apt-get download`) and poolscope's
//! own `.deb` (`cargo xtask package`), imported by podman as
//! `localhost/poolscope:<version>` and saved as an OCI archive,
//! `target/image/poolscope_<version>.oci.tar`, for `podman load`, `ctr images import`
//! or a registry push.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

use crate::package::output as run;

/// Debian packages `cargo xtask image` (and its test) need: podman, and runc, the
/// runtime that runs on hosts whose cgroups crun refuses (v1 and v2 mixed).
pub const PACKAGES: &[&str] = &["podman", "runc"];

const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The libraries `target/release/poolscope` links (ld.so, libc, libm, libgcc_s).
const RUNTIME_PACKAGES: [&str; 2] = ["libc6", "libgcc-s1"];

/// The image's name in podman's local storage, as the DaemonSet names it.
pub fn name() -> String {
    format!("localhost/poolscope:{VERSION}")
}

/// The commit the image is built from, as `build_info` shows it.
fn revision(root: &Path) -> String {
    Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(root)
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map_or_else(
            || "unknown".to_owned(),
            |output| String::from_utf8_lossy(&output.stdout).trim().to_owned(),
        )
}

/// The `.deb` files in `dir`.
fn debs(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut found: Vec<PathBuf> = fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "deb"))
        .collect();
    found.sort();
    Ok(found)
}

/// Builds the image from `package` (poolscope's `.deb`). Returns the OCI archive.
pub fn build(root: &Path, package: &Path) -> anyhow::Result<PathBuf> {
    let out = root.join("target/image");
    let downloads = out.join("debs");
    let rootfs = out.join("rootfs");
    for dir in [&downloads, &rootfs] {
        if dir.exists() {
            fs::remove_dir_all(dir).with_context(|| format!("emptying {}", dir.display()))?;
        }
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    run(Command::new("apt-get")
        .arg("download")
        .args(RUNTIME_PACKAGES)
        .current_dir(&downloads))
    .context("apt-get download (apt's package lists: apt-get update)")?;
    let mut packages = debs(&downloads)?;
    if packages.len() != RUNTIME_PACKAGES.len() {
        bail!("apt-get download left {packages:?}");
    }
    packages.push(package.to_owned());
    for deb in &packages {
        run(Command::new("dpkg-deb")
            .arg("--extract")
            .arg(deb)
            .arg(&rootfs))?;
    }
    // The dynamic user of the unit is not needed here: the DaemonSet runs the
    // container as uid 0 with its capabilities cut to the unit's.
    for dir in ["tmp", "proc", "sys", "dev", "etc"] {
        fs::create_dir_all(rootfs.join(dir))?;
    }
    fs::write(
        rootfs.join("etc/passwd"),
        "root:x:0:0:root:/:/usr/sbin/nologin\n",
    )?;
    fs::write(rootfs.join("etc/group"), "root:x:0:\n")?;
    let layer = out.join("rootfs.tar");
    run(Command::new("tar")
        .args([
            "--create",
            "--numeric-owner",
            "--owner=0",
            "--group=0",
            "--file",
        ])
        .arg(&layer)
        .arg("--directory")
        .arg(&rootfs)
        .arg("."))?;
    let name = name();
    let revision = revision(root);
    run(Command::new("podman")
        .arg("import")
        .args([
            "--change",
            r#"ENTRYPOINT ["/usr/bin/poolscope"]"#,
            "--change",
            r#"CMD ["--config.file=/etc/poolscope/poolscope.toml"]"#,
            "--change",
            "EXPOSE 9435/tcp",
            "--change",
            &format!("LABEL org.opencontainers.image.version={VERSION}"),
            "--change",
            &format!("LABEL org.opencontainers.image.revision={revision}"),
            "--change",
            "LABEL org.opencontainers.image.title=poolscope",
            "--message",
            "poolscope, from Debian packages (cargo xtask image)",
        ])
        .arg(&layer)
        .arg(&name))
    .context("podman import (apt-get install podman)")?;
    let archive = out.join(format!("poolscope_{VERSION}.oci.tar"));
    if archive.exists() {
        fs::remove_file(&archive)?;
    }
    run(Command::new("podman")
        .args(["save", "--format", "oci-archive", "--output"])
        .arg(&archive)
        .arg(&name))?;
    fs::remove_file(&layer)?;
    Ok(archive)
}
