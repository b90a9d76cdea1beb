//! From what the kernel counted to metric families: the reducers (`collect`), the
//! two views of duration histograms (`window`), thread pools (`pools`), lock waits
//! (`locks`), poolscope's own health and loss counters (`health`), and the wire
//! formats with the series cap (`encode`).
pub mod collect;
pub mod encode;
pub mod health;
pub mod locks;
pub mod pools;
pub mod window;
