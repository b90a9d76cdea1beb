//! The `poolscope` binary: command-line flags in Prometheus exporter style, then
//! `poolscope::run`. Exits non-zero with the reason when the configuration is refused
//! or the kernel programs cannot be loaded.
use std::{path::PathBuf, process::ExitCode};

use clap::Parser;
use poolscope::config::Overrides;

/// Prometheus exporter for queue depth, thread-pool use and request timing of every
/// network service on this host, measured with eBPF.
#[derive(Debug, Parser)]
#[command(name = "poolscope", version)]
struct Cli {
    /// TOML configuration file.
    #[arg(long = "config.file", env = "POOLSCOPE_CONFIG_FILE")]
    config_file: Option<PathBuf>,
    /// Address to serve /metrics on (default 127.0.0.1:9435).
    #[arg(long = "web.listen-address")]
    web_listen_address: Option<String>,
    /// error, warn, info, debug or trace.
    #[arg(long = "log.level")]
    log_level: Option<String>,
    /// Only check the configuration (file, environment, flags) and exit.
    #[arg(long = "config.check")]
    config_check: bool,
}

/// Not `#[tokio::main]`: `run` starts the runtime's threads only after dropping
/// capabilities (see `poolscope::caps`).
fn main() -> ExitCode {
    let cli = Cli::parse();
    let overrides = Overrides {
        config_file: cli.config_file,
        listen_address: cli.web_listen_address,
        log_level: cli.log_level,
    };
    if cli.config_check {
        return match poolscope::config::Settings::load(&overrides) {
            Ok(_) => {
                println!("poolscope: configuration is valid");
                ExitCode::SUCCESS
            }
            Err(error) => {
                eprintln!("poolscope: {error}");
                ExitCode::FAILURE
            }
        };
    }
    match poolscope::run(overrides) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("poolscope: {error:#}");
            ExitCode::FAILURE
        }
    }
}
