//! HTTP: the router and its endpoints (`server`), the landing page (`landing`), the
//! listener with its TLS handshakes (`listener`), and `--web.config.file`
//! (`webconfig`).
pub mod landing;
pub mod listener;
pub mod server;
pub mod webconfig;
