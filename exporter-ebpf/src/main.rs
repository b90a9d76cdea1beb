//! poolscope's kernel programs. Thin by design: each program classifies one event,
//! updates state or a per-CPU counter in a map, and returns. User space reads the
//! maps at scrape time. One module per kernel subsystem, layered so that none reaches
//! back up:
//! - leaves: `maps` (every map and its small helpers), `clock`, `abi` (the syscall
//!   ABI of each architecture); `source` above them (where a socket call's bytes are
//!   in the caller's memory);
//! - `downstream` (the peer of a socket a thread waits on), under `threads`, the thread
//!   state machine; `stackmaps` (capture and count stacks) and `locks` (lock waits)
//!   on top of it; `serving` (a thread starts or stops serving a request) above
//!   `threads` and `locks`;
//! - `routes` (a request's first bytes, handed to user space with its record) above
//!   `source`; `requests`, the request state machine that the three request backends
//!   (`sock`, `tcp`, `syscalls`) share, and `h2`, which follows HTTP/2 connections'
//!   streams instead (socket backend, and tcp backend where fexit attaches);
//! - the programs of each subsystem: `sched` (switches and wakeups drive threads,
//!   stacks and locks), `stacks` and `sessions` (samples and off-CPU blocks),
//!   `process` (lifecycle), `sock`, `tcp` and `tcp_h2` (which use `sock`'s storage)
//!   and `syscalls`.
#![no_std]
#![no_main]
// The BPF target has no `AtomicU64`; the intrinsic compiles to BPF's atomic add.
#![feature(core_intrinsics)]
#![allow(internal_features, reason = "core_intrinsics, see above")]

mod abi;
mod clock;
mod downstream;
mod h2;
mod locks;
mod maps;
mod process;
mod requests;
mod routes;
mod sched;
mod serving;
mod sessions;
mod sock;
mod source;
mod stackmaps;
mod stacks;
mod syscalls;
mod tcp;
mod tcp_h2;
mod threads;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable panic, so this is never run.
    loop {}
}

// GPL-compatible: needed for bpf_probe_read_kernel and the ring buffer helpers.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
