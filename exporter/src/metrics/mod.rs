//! The reduction between what the kernel counted and the collectors: the two views
//! of duration histograms (`window`), thread pools (`pools`), lock waits (`locks`),
//! poolscope's own health and loss counters (`health`), and the wire formats with
//! the series cap (`encode`).
pub mod encode;
pub mod health;
pub mod locks;
pub mod pools;
pub mod window;
