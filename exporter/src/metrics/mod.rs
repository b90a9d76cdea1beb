//! The reduction between what the kernel counted and the collectors: the two views
//! of duration histograms (`window`), thread pools (`pools`) and their capacity
//! (`capacity`) over a window of readings (`history`), lock waits (`locks`), how a
//! service serves its HTTP/2 streams (`stream_model`), and poolscope's own health
//! and loss counters (`health`).
pub mod capacity;
pub mod health;
pub mod history;
pub mod locks;
pub mod native;
pub mod pools;
pub mod recount;
pub mod stream_model;
pub mod window;
