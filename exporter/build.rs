//! Builds the kernel programs (`poolscope-ebpf`) for the BPF target so that the
//! exporter can embed them. Needs bpf-linker and rust-src: `cargo xtask` installs both.
use anyhow::{Context as _, anyhow};

fn main() -> anyhow::Result<()> {
    revision();
    let metadata = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    let ebpf = metadata
        .packages
        .iter()
        .find(|package| package.name.as_str() == "poolscope-ebpf")
        .ok_or_else(|| anyhow!("package poolscope-ebpf not found in the workspace"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("no parent directory for {}", ebpf.manifest_path))?;
    // The pinned stable toolchain builds `core` for the BPF target with -Z build-std,
    // which needs RUSTC_BOOTSTRAP (see docs/toolchain.md).
    // SAFETY: build scripts are single-threaded at this point.
    unsafe { std::env::set_var("RUSTC_BOOTSTRAP", "1") };
    println!("cargo:rerun-if-env-changed=RUSTUP_TOOLCHAIN");
    let toolchain = std::env::var("RUSTUP_TOOLCHAIN").context(
        "RUSTUP_TOOLCHAIN is not set: build through rustup's cargo (rust-toolchain.toml)",
    )?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: ebpf.name.as_str(),
            root_dir: root_dir.as_str(),
            ..Default::default()
        }],
        aya_build::Toolchain::Custom(&toolchain),
    )
}

/// The git commit built (`POOLSCOPE_REVISION`, in `poolscope_build_info` and on the
/// landing page): `unknown` outside a git checkout. Rebuilt when the commit changes.
fn revision() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|output| output.status.success())
            .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
    };
    let revision =
        git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=POOLSCOPE_REVISION={revision}");
    // HEAD, and the branch it points to (its file, or packed-refs once packed).
    for path in ["HEAD", "packed-refs"] {
        if let Some(path) = git(&["rev-parse", "--git-path", path]) {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"])
        .and_then(|reference| git(&["rev-parse", "--git-path", &reference]))
    {
        println!("cargo:rerun-if-changed={branch}");
    }
}
