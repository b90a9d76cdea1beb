//! Types, map names and limits shared by the kernel programs (`poolscope-ebpf`) and
//! the exporter. Everything here is `#[repr(C)]` with explicit padding so that both
//! sides agree on the layout; the size asserts beside each type catch drift.
#![no_std]
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(
    target_arch = "bpf",
    allow(internal_features, reason = "one atomic add instruction: `Count::add`")
)]

pub mod maps;

mod connections;
mod histogram;
mod http1;
mod http2;
mod limits;
mod locks;
mod losses;
mod process;
mod routes;
mod stacks;
mod syscalls;
mod threads;

pub use connections::*;
pub use histogram::*;
pub use http1::*;
pub use http2::*;
pub use limits::*;
pub use locks::*;
pub use losses::*;
pub use process::*;
pub use routes::*;
pub use stacks::*;
pub use syscalls::*;
pub use threads::*;

#[cfg(feature = "user")]
mod pod {
    // SAFETY: every type is repr(C), built only from integers, with explicit padding.
    unsafe impl aya::Pod for super::Watched {}
    unsafe impl aya::Pod for super::Conn {}
    unsafe impl aya::Pod for super::PendingCall {}
    unsafe impl aya::Pod for super::ServiceCounters {}
    unsafe impl aya::Pod for super::ProcessEvent {}
    unsafe impl aya::Pod for super::RouteEvent {}
    unsafe impl aya::Pod for super::H2Block {}
    unsafe impl aya::Pod for super::RequestTimes {}
    unsafe impl aya::Pod for super::Thread {}
    unsafe impl aya::Pod for super::PoolStats {}
    unsafe impl aya::Pod for super::LockKey {}
    unsafe impl aya::Pod for super::DownstreamKey {}
    unsafe impl aya::Pod for super::DownstreamWait {}
    unsafe impl aya::Pod for super::ListenKey {}
    unsafe impl aya::Pod for super::Histogram {}
    unsafe impl aya::Pod for super::StackKey {}
    unsafe impl aya::Pod for super::StackCount {}
    unsafe impl aya::Pod for super::StackHint {}
    unsafe impl aya::Pod for super::StackVariantKey {}
    unsafe impl aya::Pod for super::OffcpuCaptures {}
    unsafe impl aya::Pod for super::ProfileSession {}
}
