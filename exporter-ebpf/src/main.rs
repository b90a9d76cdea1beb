//! poolscope's kernel programs. Thin by design: each program classifies one event,
//! updates state or a per-CPU counter in a map, and returns. User space reads the
//! maps at scrape time. One module per kernel subsystem; `requests.rs` is the state
//! machine that the two request backends (`sock.rs`, `syscalls.rs`) share, and
//! `threads.rs` the thread state machine that `sched.rs` and the requests feed;
//! `locks.rs` times the lock waits that machine sees begin, and `stacks.rs` counts
//! the stacks of its threads on and off CPU.
#![no_std]
#![no_main]
// The BPF target has no `AtomicU64`; the intrinsic compiles to BPF's atomic add.
#![feature(core_intrinsics)]
#![allow(internal_features, reason = "core_intrinsics, see above")]

mod downstream;
mod locks;
mod maps;
mod process;
mod requests;
mod sched;
mod sessions;
mod sock;
mod stacks;
mod syscalls;
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
