//! HTTP: the router and its endpoints (`server`), the listener with its TLS
//! handshakes (`listener`), and `--web.config.file` (`webconfig`).
pub mod listener;
pub mod server;
pub mod webconfig;
