//! The servers of `tests/downstream`: thread pools whose workers call a slow
//! backend (`slowbackend`, an unwatched process) with a timeout, each reporting its
//! own busy and waiting time (`stats` on stdin). Used by tests/tests/downstream.rs
//! for the truth, and by operators.rs for a service with downstream waits.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Context as _;

use crate::Program;

/// A worker pool's server, by language and client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// C, `poll()` on the backend socket before each read.
    CPoll,
    /// C, `poll()` on the backend socket and 15 idle pipes: 16 fds, an event loop's
    /// poll by the rule.
    CPollMany,
    /// C, libcurl's easy interface.
    CCurl,
    /// Python, a ThreadPoolExecutor with socket timeouts.
    Python,
    /// Java, a fixed thread pool with `setSoTimeout`.
    Java,
}

/// The backend: answers each request after `delay_ms`.
pub struct Backend {
    pub program: Program,
    pub port: u16,
}

impl Backend {
    pub fn start(delay_ms: u64) -> anyhow::Result<Self> {
        Self::start_with(&[delay_ms.to_string()])
    }

    /// A backend that closes each connection after `delay_ms` without an answer.
    pub fn start_closing(delay_ms: u64) -> anyhow::Result<Self> {
        Self::start_with(&[delay_ms.to_string(), "close".to_owned()])
    }

    fn start_with(args: &[String]) -> anyhow::Result<Self> {
        let mut program = Program::start("slowbackend", args)?;
        let port = program.line("port")?.parse()?;
        Ok(Self { program, port })
    }
}

fn sources() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("downstream")
}

/// Builds downstream.c into `dir`.
pub fn build_c(dir: &Path) -> anyhow::Result<PathBuf> {
    let binary = dir.join("downstream");
    compile_c(&sources().join("downstream.c"), &binary, &["-lcurl"])
        .context("are gcc and libcurl4-openssl-dev installed?")?;
    Ok(binary)
}

/// `cc -O2 -g -Wall -Werror -pthread -o binary source <extra>`: flags and libraries
/// after the source, where libraries must be to resolve its symbols.
pub fn compile_c(source: &Path, binary: &Path, extra: &[&str]) -> anyhow::Result<()> {
    let output = Command::new("cc")
        .args(["-O2", "-g", "-Wall", "-Werror", "-pthread", "-o"])
        .arg(binary)
        .arg(source)
        .args(extra)
        .output()
        .context("running cc")?;
    anyhow::ensure!(
        output.status.success(),
        "cc {} failed:\n{}",
        source.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(())
}

/// Starts a server of `kind` with `workers` workers calling 127.0.0.1:`backend_port`;
/// `c_binary` is what [`build_c`] made, for the C kinds. Its first line is `port <n>`.
pub fn start(
    kind: Kind,
    workers: u32,
    backend_port: u16,
    c_binary: Option<&Path>,
) -> anyhow::Result<Program> {
    let (workers, backend_port) = (workers.to_string(), backend_port.to_string());
    let script = |name: &str| sources().join(name).display().to_string();
    match kind {
        Kind::CPoll | Kind::CPollMany | Kind::CCurl => {
            let mode = match kind {
                Kind::CPoll => "poll",
                Kind::CPollMany => "pollmany",
                _ => "curl",
            };
            let binary = c_binary.context("the C servers need build_c's binary")?;
            Program::start_path(binary, &[workers, backend_port, mode.to_owned()])
        }
        Kind::Python => Program::start_path(
            Path::new("/usr/bin/python3"),
            &[script("downstream.py"), workers, backend_port],
        ),
        Kind::Java => Program::start_path(
            Path::new("/usr/bin/java"),
            &[script("Downstream.java"), workers, backend_port],
        ),
    }
}
