//! HTTP: the router (`server`), what it asks of the exporter (`gatherer`), its
//! endpoints (`scrape` for `/metrics`, `debug` for `/debug/*`, `pprof` for profiling
//! sessions, `landing` for the landing page), the listener with its TLS handshakes
//! (`listener`), and `--web.config.file` (`webconfig`).
pub mod debug;
pub mod gatherer;
pub mod landing;
pub mod listener;
pub mod pprof;
pub mod scrape;
pub mod server;
pub mod webconfig;
