//! Stacks, off the scrape path: drained generations (`drained`), with the frames
//! their walks skipped put back (`unwind`, `repairs`), become snapshots
//! (`snapshots`), symbolized by `symbolize`, rendered as folded stacks, flame graphs
//! and pprof (`profile`); on-demand profiling sessions (`sessions`); and how the heap
//! gives the symbolizer's memory back (`heap`).
pub mod drained;
pub mod heap;
pub mod profile;
pub mod repairs;
pub mod sessions;
pub mod snapshots;
pub mod symbolize;
pub mod unwind;
