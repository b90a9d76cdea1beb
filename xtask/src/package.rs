//! `cargo xtask package`: a Debian package (`target/package/poolscope_<version>_<arch>.deb`)
//! of the release binary, the systemd unit and an empty configuration file, laid out
//! by hand and built by `dpkg-deb` (in every Debian system: no packaging tool to
//! install). The maintainer scripts are the ones debhelper would write for a service:
//! enabled at install, started where systemd runs, stopped at removal, and every
//! trace of it (the enablement state, `/etc/poolscope`) gone at purge.
use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, bail};

/// Debian packages `cargo xtask package` needs: dpkg-deb (dpkg), objcopy (binutils).
pub const PACKAGES: &[&str] = &["dpkg", "binutils"];

const NAME: &str = "poolscope";
const VERSION: &str = env!("CARGO_PKG_VERSION");
/// Where the unit in the repository expects the binary (installed by hand), and where
/// the package puts it.
const SOURCE_BINARY: &str = "/usr/local/bin/poolscope";
const PACKAGED_BINARY: &str = "/usr/bin/poolscope";
/// Debian 12 keeps units under /lib (merged with /usr/lib).
const UNIT_PATH: &str = "lib/systemd/system/poolscope.service";
const CONFIG_PATH: &str = "etc/poolscope/poolscope.toml";

const CONFIG: &str = "# poolscope's configuration (docs/configuration.md).\n\
# Empty: the built-in defaults, auto-discovery of every listening service and\n\
# /metrics on 127.0.0.1:9435. `systemctl reload poolscope` applies a change.\n";

/// After unpacking: enable on first install (kept as the admin left it on upgrades),
/// then start or restart where systemd runs.
const POSTINST: &str = r#"#!/bin/sh
set -e
if [ "$1" = configure ] || [ "$1" = abort-upgrade ] || [ "$1" = abort-deconfigure ] || [ "$1" = abort-remove ]; then
    deb-systemd-helper unmask poolscope.service >/dev/null || true
    if deb-systemd-helper --quiet was-enabled poolscope.service; then
        deb-systemd-helper enable poolscope.service >/dev/null || true
    else
        deb-systemd-helper update-state poolscope.service >/dev/null || true
    fi
    if [ -d /run/systemd/system ]; then
        systemctl --system daemon-reload >/dev/null || true
        deb-systemd-invoke restart poolscope.service >/dev/null || true
    fi
fi
"#;

/// Before removal: stop the service.
const PRERM: &str = r#"#!/bin/sh
set -e
if [ -d /run/systemd/system ] && [ "$1" = remove ]; then
    deb-systemd-invoke stop poolscope.service >/dev/null || true
fi
"#;

/// After removal: forget the unit; at purge, its enablement and the configuration.
const POSTRM: &str = r#"#!/bin/sh
set -e
if [ -d /run/systemd/system ]; then
    systemctl --system daemon-reload >/dev/null || true
fi
if [ "$1" = remove ] && [ -x /usr/bin/deb-systemd-helper ]; then
    deb-systemd-helper mask poolscope.service >/dev/null || true
fi
if [ "$1" = purge ]; then
    if [ -x /usr/bin/deb-systemd-helper ]; then
        deb-systemd-helper purge poolscope.service >/dev/null || true
        deb-systemd-helper unmask poolscope.service >/dev/null || true
    fi
    rm -rf /etc/poolscope
fi
"#;

/// The systemd unit as packaged: the repository's, with the packaged binary's path.
pub fn packaged_unit(unit: &str) -> anyhow::Result<String> {
    let exec_start = format!("ExecStart={SOURCE_BINARY} ");
    if !unit.lines().any(|line| line.starts_with(&exec_start)) {
        bail!("systemd/poolscope.service no longer starts {SOURCE_BINARY}");
    }
    Ok(unit.replace(SOURCE_BINARY, PACKAGED_BINARY))
}

/// The newest `GLIBC_x.y` symbol version `binary` refers to: the oldest libc6 it
/// runs with.
pub fn newest_glibc(binary: &[u8]) -> Option<(u32, u32)> {
    const TAG: &[u8] = b"GLIBC_";
    let mut newest = None;
    for at in 0..binary.len().saturating_sub(TAG.len()) {
        if !binary[at..].starts_with(TAG) {
            continue;
        }
        let rest = &binary[at + TAG.len()..];
        let end = rest
            .iter()
            .position(|b| !(b.is_ascii_digit() || *b == b'.'))
            .unwrap_or(rest.len());
        let text = std::str::from_utf8(&rest[..end]).ok()?;
        let mut parts = text.split('.').map(str::parse::<u32>);
        if let (Some(Ok(major)), Some(Ok(minor))) = (parts.next(), parts.next()) {
            newest = newest.max(Some((major, minor)));
        }
    }
    newest
}

fn control(arch: &str, glibc: (u32, u32), installed_kib: u64) -> String {
    format!(
        "Package: {NAME}\n\
         Version: {VERSION}\n\
         Architecture: {arch}\n\
         Maintainer: poolscope developers <poolscope@localhost>\n\
         Installed-Size: {installed_kib}\n\
         Depends: libc6 (>= {}.{}), libgcc-s1\n\
         Section: net\n\
         Priority: optional\n\
         Description: Prometheus exporter of queue depth, thread pools and request timing\n \
         poolscope measures, for every network service on the host and without touching\n \
         it, its queue depth, thread-pool utilization, request queue and response time,\n \
         lock waits and stack snapshots, with eBPF programs in the kernel.\n",
        glibc.0, glibc.1
    )
}

fn write(path: &Path, text: &str, mode: u32) -> anyhow::Result<()> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("setting the mode of {}", path.display()))
}

/// What `command` printed to stdout, trimmed; its stderr in the error if it failed.
pub fn output(command: &mut Command) -> anyhow::Result<String> {
    let out = command
        .output()
        .with_context(|| format!("running {command:?}"))?;
    if !out.status.success() {
        bail!(
            "{command:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

/// Builds the package from `target/release/poolscope` (built already). Returns its path.
pub fn build(root: &Path) -> anyhow::Result<PathBuf> {
    let binary_path = root.join("target/release/poolscope");
    let binary = fs::read(&binary_path)
        .with_context(|| format!("reading {} (build it first)", binary_path.display()))?;
    let glibc = newest_glibc(&binary).context("the binary names no GLIBC_ symbol version")?;
    let arch = output(Command::new("dpkg").arg("--print-architecture"))
        .context("dpkg is missing: apt-get install dpkg")?;
    let out_dir = root.join("target/package");
    let stage = out_dir.join("root");
    if stage.exists() {
        fs::remove_dir_all(&stage).with_context(|| format!("emptying {}", stage.display()))?;
    }
    let installed = stage.join(PACKAGED_BINARY.trim_start_matches('/'));
    fs::create_dir_all(installed.parent().context("a binary path has a parent")?)?;
    // Debug information out (73 of the binary's 88 MB), the symbol table kept: stack
    // snapshots name poolscope's own frames with it.
    output(
        Command::new("objcopy")
            .arg("--strip-debug")
            .arg(&binary_path)
            .arg(&installed),
    )
    .context("objcopy (binutils) strips the debug information")?;
    fs::set_permissions(&installed, fs::Permissions::from_mode(0o755))?;
    let installed_size = fs::metadata(&installed)?.len();
    let unit = fs::read_to_string(root.join("systemd/poolscope.service"))
        .context("reading systemd/poolscope.service")?;
    write(&stage.join(UNIT_PATH), &packaged_unit(&unit)?, 0o644)?;
    write(&stage.join(CONFIG_PATH), CONFIG, 0o644)?;
    let docs = stage.join("usr/share/doc/poolscope");
    write(
        &docs.join("copyright"),
        "poolscope\nLicense: MIT OR Apache-2.0 (the crate's license field)\n",
        0o644,
    )?;
    // The README and the pages it links, so that its links work where it is installed.
    let mut doc_bytes = 0;
    let mut pages = vec![PathBuf::from("README.md")];
    for entry in fs::read_dir(root.join("docs")).context("reading docs/")? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "md")
            && let Some(name) = path.file_name()
        {
            pages.push(Path::new("docs").join(name));
        }
    }
    for page in pages {
        let text = fs::read_to_string(root.join(&page))
            .with_context(|| format!("reading {}", page.display()))?;
        write(&docs.join(&page), &text, 0o644)?;
        doc_bytes += text.len() as u64;
    }
    let installed_kib = (installed_size + unit.len() as u64 + doc_bytes) / 1024 + 1;
    let debian = stage.join("DEBIAN");
    write(
        &debian.join("control"),
        &control(&arch, glibc, installed_kib),
        0o644,
    )?;
    write(
        &debian.join("conffiles"),
        &format!("/{CONFIG_PATH}\n"),
        0o644,
    )?;
    write(&debian.join("postinst"), POSTINST, 0o755)?;
    write(&debian.join("prerm"), PRERM, 0o755)?;
    write(&debian.join("postrm"), POSTRM, 0o755)?;
    let deb = out_dir.join(format!("{NAME}_{VERSION}_{arch}.deb"));
    output(
        Command::new("dpkg-deb")
            .args(["--root-owner-group", "-Zxz", "--build"])
            .arg(&stage)
            .arg(&deb),
    )?;
    Ok(deb)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_packaged_unit_starts_the_packaged_binary() -> anyhow::Result<()> {
        let unit = include_str!("../../systemd/poolscope.service");
        let packaged = packaged_unit(unit)?;
        assert!(
            packaged
                .lines()
                .any(|l| l.starts_with("ExecStart=/usr/bin/poolscope ")),
            "{packaged}"
        );
        assert!(!packaged.contains(SOURCE_BINARY), "{packaged}");
        assert!(packaged_unit("[Service]\nExecStart=/opt/poolscope\n").is_err());
        Ok(())
    }

    #[test]
    fn the_newest_glibc_version_is_found() {
        let binary = b"\0GLIBC_2.2.5\0GLIBC_2.34\0GLIBC_2.9\0GLIBC_PRIVATE\0";
        assert_eq!(newest_glibc(binary), Some((2, 34)));
        assert_eq!(newest_glibc(b"no versions"), None);
    }
}
