//! Every map of the kernel side, and the small helpers that update them. Names and
//! value types come from `poolscope_shared` so that user space agrees on them.
use aya_ebpf::{
    bindings::BPF_F_MMAPABLE,
    btf_maps::SkStorage,
    macros::{btf_map, map},
    maps::{Array, HashMap, PerCpuArray, RingBuf, StackTrace},
};
use poolscope_shared::{
    Conn, DownstreamKey, DownstreamWait, H2Conn, Histogram, LOSSES_SIZE, ListenKey, LockKey,
    LockPrimitive, LossErrno, LossSource, MAX_DOWNSTREAMS, MAX_LISTEN_PORTS, MAX_LOCK_STACKS,
    MAX_LOCKS, MAX_MUTEX_CALLS_IN_FLIGHT, MAX_POOLS, MAX_PROFILE_SESSIONS, MAX_SERVICES,
    MAX_STACK_COUNTS, MAX_STACK_VARIANTS, MAX_STACKS, MAX_SYSCALLS_IN_FLIGHT, MAX_THREADS,
    OffcpuCaptures, PendingCall, PoolStats, ProcessEvent, ProfileSession, RequestTimes,
    STACK_GENERATIONS, SYSCALL_COUNTS_SIZE, SYSCALL_TABLE_SIZE, ServiceCounters, StackCount,
    StackHint, StackKey, StackVariantKey, THREAD_SLOTS, Thread, WATCHED_PORT_WORDS, Watched,
    loss_index, maps::CountedMap, overflow_stacks,
};

// Default sizes; user space may override them at load time ([limits] in the config).
#[map]
pub static WATCHED: HashMap<u32, Watched> = HashMap::with_max_entries(16384, 0);
#[map]
pub static CONNS: HashMap<u64, Conn> = HashMap::with_max_entries(65536, 0);
#[btf_map]
pub static SOCK_CONNS: SkStorage<Conn> = SkStorage::new();
#[btf_map]
pub static H2_CONNS: SkStorage<H2Conn> = SkStorage::new();
#[map]
pub static ENTRY_COUNTS: PerCpuArray<i64> = PerCpuArray::with_max_entries(CountedMap::COUNT, 0);
#[map]
pub static SERVICE_EPOCHS: Array<u32> = Array::with_max_entries(MAX_SERVICES, 0);
#[map]
pub static STREAM_WORKERS: Array<u32> = Array::with_max_entries(MAX_SERVICES, 0);
#[map]
pub static ROUTE_SERVICES: Array<u32> = Array::with_max_entries(MAX_SERVICES, 0);
#[map]
pub static WATCHED_PORTS: Array<u64> = Array::with_max_entries(WATCHED_PORT_WORDS, 0);
#[map]
pub static ADOPT: HashMap<u64, Conn> = HashMap::with_max_entries(65536, 0);
#[map]
pub static ADOPTING: Array<u32> = Array::with_max_entries(1, 0);
#[map]
pub static TCP_HTTP2: Array<u32> = Array::with_max_entries(1, 0);
#[map]
pub static LISTEN_CHANGES: Array<u64> = Array::with_max_entries(1, 0);
#[map]
pub static LISTEN_PORTS: HashMap<ListenKey, u32> = HashMap::with_max_entries(MAX_LISTEN_PORTS, 0);
#[map]
pub static PENDING_CALLS: HashMap<u32, PendingCall> =
    HashMap::with_max_entries(MAX_SYSCALLS_IN_FLIGHT, 0);
#[map]
pub static SYSCALL_SLOTS: Array<u32> = Array::with_max_entries(SYSCALL_TABLE_SIZE, 0);
#[map]
pub static SYSCALL_COUNTS: PerCpuArray<u64> = PerCpuArray::with_max_entries(SYSCALL_COUNTS_SIZE, 0);
#[map]
pub static SERVICE_COUNTERS: PerCpuArray<ServiceCounters> =
    PerCpuArray::with_max_entries(MAX_SERVICES, 0);
/// One for all CPUs (atomic adds), mmap-able: a scrape copies a busy service's 5.4 kB
/// once from its mapping, where a per-CPU array made the kernel copy it once per CPU
/// (a 64-CPU node: 345 kB per service per scrape).
#[map]
pub static REQUEST_TIMES: Array<RequestTimes> =
    Array::with_max_entries(MAX_SERVICES, BPF_F_MMAPABLE);
#[map]
pub static LOSSES: PerCpuArray<u64> = PerCpuArray::with_max_entries(LOSSES_SIZE, 0);
#[map]
pub static THREADS: HashMap<u32, Thread> = HashMap::with_max_entries(MAX_THREADS, 0);
#[map]
pub static THREAD_ENTRIES: Array<Thread> = Array::with_max_entries(THREAD_SLOTS, BPF_F_MMAPABLE);
#[map]
pub static THREAD_OWNERS: Array<u64> = Array::with_max_entries(THREAD_SLOTS, BPF_F_MMAPABLE);
#[map]
pub static THREAD_POOLS: HashMap<u32, u32> = HashMap::with_max_entries(MAX_THREADS, 0);
#[map]
pub static POOL_EPOCH: Array<u32> = Array::with_max_entries(1, 0);
#[map]
pub static POOL_STATS: PerCpuArray<PoolStats> = PerCpuArray::with_max_entries(MAX_POOLS, 0);
#[map]
pub static POOL_RUNQUEUE: PerCpuArray<Histogram> = PerCpuArray::with_max_entries(MAX_POOLS, 0);
#[map]
pub static WAIT_CLASSES: Array<u32> = Array::with_max_entries(SYSCALL_TABLE_SIZE, 0);
#[map]
pub static LOCK_WAITS: Array<Histogram> =
    Array::with_max_entries(MAX_POOLS * LockPrimitive::COUNT, 0);
/// Records in each `LOCK_WAITS` histogram; mmap-able: a scrape reads every pool's
/// without a system call, and `LOCK_WAITS` only where one moved.
#[map]
pub static LOCK_WAIT_COUNTS: Array<u64> =
    Array::with_max_entries(MAX_POOLS * LockPrimitive::COUNT, BPF_F_MMAPABLE);
#[map]
pub static LOCKS: HashMap<LockKey, Histogram> = HashMap::with_max_entries(MAX_LOCKS, 0);
#[map]
pub static DOWNSTREAM_WAITS: HashMap<DownstreamKey, DownstreamWait> =
    HashMap::with_max_entries(MAX_DOWNSTREAMS, 0);
#[map]
pub static LOCK_STACKS: StackTrace = StackTrace::with_max_entries(MAX_LOCK_STACKS, 0);
#[map]
pub static MUTEX_CALLS: HashMap<u32, u64> = HashMap::with_max_entries(MAX_MUTEX_CALLS_IN_FLIGHT, 0);
#[map]
pub static ZERO_HISTOGRAM: Array<Histogram> = Array::with_max_entries(1, 0);
#[map]
pub static STACK_EPOCH: Array<u32> = Array::with_max_entries(1, 0);
#[map]
pub static STACK_COUNTS: HashMap<StackKey, StackCount> =
    HashMap::with_max_entries(MAX_STACK_COUNTS, 0);
#[map]
pub static STACKS_0: StackTrace = StackTrace::with_max_entries(MAX_STACKS, 0);
#[map]
pub static STACKS_1: StackTrace = StackTrace::with_max_entries(MAX_STACKS, 0);
#[map]
pub static STACKS_2: StackTrace = StackTrace::with_max_entries(MAX_STACKS, 0);
/// Sized by user space: `overflow_stacks` of the stack maps' size.
#[map]
pub static STACKS_OVERFLOW_0: StackTrace =
    StackTrace::with_max_entries(overflow_stacks(MAX_STACKS), 0);
#[map]
pub static STACKS_OVERFLOW_1: StackTrace =
    StackTrace::with_max_entries(overflow_stacks(MAX_STACKS), 0);
#[map]
pub static STACKS_OVERFLOW_2: StackTrace =
    StackTrace::with_max_entries(overflow_stacks(MAX_STACKS), 0);
#[map]
pub static PROFILE_SESSIONS: Array<ProfileSession> =
    Array::with_max_entries(MAX_PROFILE_SESSIONS, 0);
/// 4 MiB: ~500 stack copies between two reads by user space.
#[map]
pub static STACK_COPIES: RingBuf = RingBuf::with_byte_size(4 * 1024 * 1024, 0);
#[map]
pub static OFFCPU_CAPTURES: PerCpuArray<OffcpuCaptures> = PerCpuArray::with_max_entries(1, 0);
/// Sized by user space: ([`STACK_GENERATIONS`] + 1) × the stride it sets.
#[map]
pub static STACK_COPIED: Array<u64> =
    Array::with_max_entries((STACK_GENERATIONS + 1) * MAX_STACKS, 0);
/// Sized by user space: the stack maps' size (ids index it).
#[map]
pub static STACK_HINTS: Array<StackHint> = Array::with_max_entries(MAX_STACKS, 0);
#[map]
pub static STACK_VARIANTS: HashMap<StackVariantKey, u32> =
    HashMap::with_max_entries(MAX_STACK_VARIANTS, 0);
#[map]
pub static PROCESS_EVENTS: RingBuf = RingBuf::with_byte_size(256 * 1024, 0);
/// Sized by user space: `[limits] route_events`.
#[map]
pub static ROUTE_EVENTS: RingBuf = RingBuf::with_byte_size(4 * 1024 * 1024, 0);

/// The watch entry of `tgid`, if user space (or a fork) put one there.
#[inline(always)]
pub fn watched(tgid: u32) -> Option<Watched> {
    // SAFETY: the value is copied out at once; a concurrent delete can at worst give
    // a stale copy, which the `since_ns` checks tolerate.
    unsafe { WATCHED.get(tgid).copied() }
}

#[inline(always)]
pub fn count_loss(source: LossSource, errno: LossErrno) {
    if let Some(counter) = LOSSES.get_ptr_mut(loss_index(source, errno)) {
        // SAFETY: a live per-CPU slot. An atomic add, as a `Count`'s: programs in
        // softirq context count losses too, and may interrupt one in process context
        // on this CPU.
        atomic_add(unsafe { &mut *counter }, 1);
    }
}

/// The errno class of a get-or-insert that found no entry after its insert: the
/// insert's own error, or none known (the entry was removed in between).
#[inline(always)]
pub fn inserted_errno(inserted: Result<(), i32>) -> LossErrno {
    match inserted {
        Err(code) => LossErrno::of(code.into()),
        Ok(()) => LossErrno::Other,
    }
}

/// Counts an entry made (`1`) or removed (`-1`) in `map`.
#[inline(always)]
pub fn count_entries(map: CountedMap, change: i64) {
    if let Some(count) = ENTRY_COUNTS.get_ptr_mut(map as u32) {
        // SAFETY: a live per-CPU slot; an atomic add, as in `count_loss`.
        atomic_add(unsafe { &mut *count }, change);
    }
}

/// Stores `key` → `value` in `map`, whose entries are counted as `counted`,
/// replacing an entry already there (which counts nothing).
#[inline(always)]
pub fn insert_counted<K, V>(
    map: &HashMap<K, V>,
    counted: CountedMap,
    key: &K,
    value: &V,
) -> Result<(), i32> {
    match map.insert(key, value, u64::from(aya_ebpf::bindings::BPF_NOEXIST)) {
        Ok(()) => {
            count_entries(counted, 1);
            Ok(())
        }
        // Removed meanwhile by another CPU, the replacement fails (ENOENT): a loss
        // like any other, counted by the caller.
        Err(code) if LossErrno::of(code.into()) == LossErrno::Eexist => {
            map.insert(key, value, u64::from(aya_ebpf::bindings::BPF_EXIST))
        }
        Err(code) => Err(code),
    }
}

/// Removes `key` from `map`, whose entries are counted as `counted`, if it is there.
#[inline(always)]
pub fn remove_counted<K, V>(map: &HashMap<K, V>, counted: CountedMap, key: &K) {
    if map.remove(key).is_ok() {
        count_entries(counted, -1);
    }
}

/// The entry of `key` in a map shared by all CPUs, made from `initial` if absent
/// (and counted, if the map's entries are); `None` (counted under `loss`) if it
/// cannot be made, e.g. the map is full.
#[inline(always)]
pub fn get_or_insert<K, V>(
    map: &HashMap<K, V>,
    counted: Option<CountedMap>,
    key: &K,
    initial: &V,
    loss: LossSource,
) -> Option<*mut V> {
    if let Some(value) = map.get_ptr_mut(key) {
        return Some(value);
    }
    // BPF_NOEXIST: another CPU may have made it meanwhile; then use that one.
    let inserted = map.insert(key, initial, u64::from(aya_ebpf::bindings::BPF_NOEXIST));
    if let (Ok(()), Some(counted)) = (inserted, counted) {
        count_entries(counted, 1);
    }
    let value = map.get_ptr_mut(key);
    if value.is_none() {
        count_loss(loss, inserted_errno(inserted));
    }
    value
}

/// The map and stack helpers' error when a key to create exists, or a stack's
/// bucket holds another stack.
pub const EEXIST: i32 = 17;
/// A map's error when it is full (here also: a slot beyond the array, which the
/// loader's sizes rule out).
pub const E2BIG: i32 = 7;

/// Adds `value` to a counter that other CPUs may update at the same time.
#[inline(always)]
pub fn atomic_add<T: Copy>(counter: &mut T, value: T) {
    // SAFETY: `counter` is a valid, aligned integer in a map value; the intrinsic is
    // one BPF atomic add instruction (32 or 64 bits).
    unsafe {
        core::intrinsics::atomic_xadd::<T, T, { core::intrinsics::AtomicOrdering::Relaxed }>(
            counter, value,
        );
    }
}

/// Sets `value` to `new` as one step no other CPU can split, and returns the value
/// before. 64-bit, as [`compare_and_swap`].
#[inline(always)]
pub fn swap(value: &mut u64, new: u64) -> u64 {
    // SAFETY: `value` is a valid, aligned u64 in a map value; the intrinsic is one
    // BPF atomic exchange.
    unsafe {
        core::intrinsics::atomic_xchg::<u64, { core::intrinsics::AtomicOrdering::SeqCst }>(
            value, new,
        )
    }
}

/// Sets `value` to `new` if it is `current`, as one step no other CPU can split:
/// whether it did. 64-bit: the BPF target's generic CPU has no 32-bit cmpxchg.
#[inline(always)]
pub fn compare_and_swap(value: &mut u64, current: u64, new: u64) -> bool {
    // SAFETY: `value` is a valid, aligned u64 in a map value; the intrinsic is one
    // BPF cmpxchg instruction.
    unsafe {
        core::intrinsics::atomic_cxchg::<
            u64,
            { core::intrinsics::AtomicOrdering::SeqCst },
            { core::intrinsics::AtomicOrdering::SeqCst },
        >(value, current, new)
    }
    .1
}

/// Adds one duration to a histogram shared by all CPUs.
#[inline(always)]
pub fn add_to_shared_histogram(histogram: &mut Histogram, ns: u64) {
    if let Some(bucket) = histogram
        .buckets
        .get_mut(poolscope_shared::histogram_bucket(ns))
    {
        atomic_add(bucket, 1);
        atomic_add(&mut histogram.sum_ns, ns);
    }
}

#[inline(always)]
pub fn add_to_counter(index: u32) {
    if let Some(counter) = SYSCALL_COUNTS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot. A plain add: only `sys_enter` counts here, in process
        // context, and no program that interrupts it does.
        unsafe { *counter += 1 };
    }
}

/// Applies `update` to this CPU's counters of `service` (each a `Count`, changed by
/// atomic adds only: programs in softirq context change them too).
#[inline(always)]
pub fn update_service(service: u32, update: impl FnOnce(&mut ServiceCounters)) {
    if let Some(counters) = SERVICE_COUNTERS.get_ptr_mut(service) {
        // SAFETY: a live per-CPU slot.
        update(unsafe { &mut *counters });
    }
}

/// How urgently user space must hear of an event.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Wakeup {
    /// Wake the reader now (fork and exit of watched processes).
    Now,
    /// Let the reader's periodic poll pick it up: waking it costs an IPI, ~25 µs per
    /// event on our VMs, and execs of unwatched processes are frequent and not urgent.
    Lazy,
}

#[inline(always)]
pub fn send_process_event(event: ProcessEvent, wakeup: Wakeup) {
    let flags = match wakeup {
        // Forced: with flags 0 the kernel wakes the reader only if it has read
        // everything before, which an unread lazy record prevents.
        Wakeup::Now => u64::from(aya_ebpf::bindings::BPF_RB_FORCE_WAKEUP),
        Wakeup::Lazy => u64::from(aya_ebpf::bindings::BPF_RB_NO_WAKEUP),
    };
    if PROCESS_EVENTS
        .output::<ProcessEvent>(&event, flags)
        .is_err()
    {
        count_loss(LossSource::ProcessEvents, LossErrno::None);
    }
}
