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
    /// Address to serve /metrics on: ip:port, or :port for every address (default
    /// 127.0.0.1:9435); repeat it to listen on several.
    #[arg(long = "web.listen-address")]
    web_listen_address: Vec<String>,
    /// Path under which to serve the metrics (default /metrics).
    #[arg(long = "web.telemetry-path")]
    web_telemetry_path: Option<String>,
    /// Web configuration file (YAML, Prometheus exporter-toolkit format): TLS,
    /// client certificates, basic auth.
    #[arg(long = "web.config.file", env = "POOLSCOPE_WEB_CONFIG_FILE")]
    web_config_file: Option<PathBuf>,
    /// error, warn, info, debug or trace.
    #[arg(long = "log.level")]
    log_level: Option<String>,
    /// text, logfmt or json.
    #[arg(long = "log.format")]
    log_format: Option<String>,
    /// Only check the configuration (file, environment, flags, web config file) and exit.
    #[arg(long = "config.check")]
    config_check: bool,
}

/// Not `#[tokio::main]`: `run` starts the runtime's threads only after dropping
/// capabilities (see `poolscope::kernel::caps`).
fn main() -> ExitCode {
    let cli = Cli::parse();
    let overrides = Overrides {
        config_file: cli.config_file,
        listen_addresses: cli.web_listen_address,
        telemetry_path: cli.web_telemetry_path,
        log_level: cli.log_level,
        log_format: cli.log_format,
        web_config_file: cli.web_config_file,
    };
    if cli.config_check {
        let checked = poolscope::config::Settings::load(&overrides)
            .map_err(|error| error.to_string())
            .and_then(|_| match &overrides.web_config_file {
                Some(path) => poolscope::web::webconfig::WebConfig::load(path)
                    .map(|web| format!(", web config file: {}", web.summary()))
                    .map_err(|error| error.to_string()),
                None => Ok(String::new()),
            });
        return match checked {
            Ok(web) => {
                println!("poolscope: configuration is valid{web}");
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
