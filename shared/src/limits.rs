//! Capacities of the maps and of the tables user space fills (service ids, pools,
//! threads, locks, stacks, syscall numbers, watched ports).

#[cfg(doc)]
use crate::maps;

/// Capacity of the per-service arrays; service ids are `0..MAX_SERVICES`.
pub const MAX_SERVICES: u32 = 1024;
/// Default capacity of the per-pool array; pool ids are `0..` its size.
pub const MAX_POOLS: u32 = 1024;
/// Default capacity of [`maps::THREADS`] and [`maps::THREAD_POOLS`].
pub const MAX_THREADS: u32 = 65536;
/// Default capacity of [`maps::LOCKS`] (each entry holds a 1.8 kB histogram).
pub const MAX_LOCKS: u32 = 2048;
/// Default capacity of [`maps::DOWNSTREAM_WAITS`]: (pool, peer) pairs.
pub const MAX_DOWNSTREAMS: u32 = 4096;
/// Default capacity of [`maps::LOCK_STACKS`].
pub const MAX_LOCK_STACKS: u32 = 2048;
/// Default capacity of each [`maps::STACKS`] map.
pub const MAX_STACKS: u32 = 4096;
/// Capacity of [`maps::STACK_VARIANTS`]: caller paths copied, over the three
/// generations.
pub const MAX_STACK_VARIANTS: u32 = 2048;
/// Default capacity of [`maps::STACK_COUNTS`].
pub const MAX_STACK_COUNTS: u32 = 16384;
/// Stack maps in rotation: the one being filled, the one whose off-CPU blocks may
/// still end (they go where their stack is), and the one user space drains.
pub const STACK_GENERATIONS: u32 = 3;
/// Default capacity of [`maps::PENDING_CALLS`]: one entry per thread inside a syscall
/// on a followed connection.
pub const MAX_SYSCALLS_IN_FLIGHT: u32 = 16384;
/// Default capacity of [`maps::MUTEX_CALLS`]: one entry per thread inside a probed
/// `pthread_mutex_lock` call.
pub const MAX_MUTEX_CALLS_IN_FLIGHT: u32 = 16384;
/// Default capacity of [`maps::LISTEN_PORTS`]: listening (namespace, port, address)
/// keys of watched services.
pub const MAX_LISTEN_PORTS: u32 = 4096;
/// Words of [`maps::WATCHED_PORTS`]: 64 ports each, every port.
pub const WATCHED_PORT_WORDS: u32 = 65536 / 64;

/// The word of [`maps::WATCHED_PORTS`] that holds `port`, and its bit there.
pub const fn watched_port_bit(port: u16) -> (u32, u64) {
    ((port / 64) as u32, 1 << (port % 64))
}
/// Size of the syscall-number → slot table (covers every x86_64 and aarch64 number).
pub const SYSCALL_TABLE_SIZE: u32 = 512;
