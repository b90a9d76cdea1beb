//! The kernel side seen from user space: loads and attaches `poolscope-ebpf`, owns its
//! maps, and offers small typed operations on them (watch a process, purge its
//! connections) plus one read of every counter for a scrape. No numbers are kept here;
//! the maps are the state.
mod attach;
mod batch;
pub mod btf;
pub mod caps;
mod entries;
mod locks;
mod map_errors;
mod mapping;
mod offsets;
mod read;
mod reread;
mod services;
mod slots;
mod stacks;
mod syscalls;
mod tables;
mod threads;

use std::{os::fd::OwnedFd, time::Duration};

use aya::{
    Btf, Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, MapError, PerCpuArray, RingBuf, stack_trace::StackTraceMap},
    programs::{PerfEvent, ProgramError, UProbe, perf_event::PerfEventLinkId},
};
use poolscope_shared::{
    Conn, DownstreamKey, DownstreamWait, Histogram, ListenKey, LockKey, LockPrimitive,
    MAX_PROFILE_SESSIONS, OffcpuCaptures, PendingCall, PoolStats, ProcessEvent, ProfileSession,
    RequestTimes, STACK_GENERATIONS, ServiceCounters, StackCount, StackHint, StackKey,
    StackVariantKey, SyscallSlot, Thread, Watched,
    maps::{self, CountedMap},
};

pub use self::attach::{Backend, Probe, ProbeState, Skip};
use self::attach::{
    MUTEX_PROBES, PROCESS_ATTACHMENTS, SESSION_SAMPLERS, THREAD_ATTACHMENTS, WAKEUP_PROGRAM,
    attach_backend, attach_sampler, attach_tracepoint, load_on_demand,
};
use self::batch::BatchMap;
use self::mapping::{Counters, SharedValues};
use self::offsets::{
    BTF_VMLINUX, downstream_offsets, exit_has_group_dead, run_delay_offsets, socket_inode_offsets,
    socket_namespace_offsets, socket_offsets, task_pid_offset, tcp_offsets, vmlinux_btf,
};
use self::reread::Reread;
use self::slots::{Claim, ThreadSlots};
use self::syscalls::{syscall_number, wait_classes};
#[cfg(test)]
pub use self::tables::fake;
pub use self::{
    map_errors::MapErrors,
    read::{LockWaits, MapFill, ProgramStats, Readout},
    services::Adopted,
    tables::{ServedConnection, ThreadTable, WatchTable},
    threads::PoolWaits,
};
use crate::config::Limits;
use crate::idmap::IdMap;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("loading the kernel programs failed (needs root or CAP_BPF+CAP_PERFMON): {0}")]
    Load(#[from] aya::EbpfError),
    #[error("kernel program {0} is missing from the object")]
    MissingProgram(&'static str),
    #[error("map {0} is missing from the object")]
    MissingMap(&'static str),
    #[error("program {program}: {source}")]
    Program {
        program: &'static str,
        source: ProgramError,
    },
    #[error("attaching {program} to {probe} failed: {source}")]
    Attach {
        program: &'static str,
        probe: String,
        source: ProgramError,
    },
    #[error("map {map}: {source}")]
    Map { map: &'static str, source: MapError },
    #[error("listing the online CPUs: {0}")]
    Cpus(std::io::Error),
    #[error("no profiling session slot {0}")]
    NoSessionSlot(u32),
    #[error("map {map}: batch read: {source}")]
    Batch {
        map: &'static str,
        source: std::io::Error,
    },
    #[error("no request backend could attach all of its probes (tried {0}; the log says why)")]
    NoBackend(String),
    #[error("map {map}: mapping it into memory: {source}")]
    Mmap {
        map: &'static str,
        source: std::io::Error,
    },
}

/// Map update flag of include/uapi/linux/bpf.h: insert only if the key is absent.
const BPF_NOEXIST: u64 = 1;

/// What the stack programs sample.
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    /// On-CPU samples per second per CPU; 0: none.
    pub hz: u32,
    /// Shortest off-CPU block recorded; `None`: no off-CPU stacks.
    pub offcpu_min: Option<Duration>,
    /// Also the blocks of threads waiting for work.
    pub offcpu_idle: bool,
    /// Blocks per second per CPU captured in full; beyond, one in `offcpu_sample_one_in`
    /// (a power of two).
    pub offcpu_full_rate: u64,
    pub offcpu_sample_one_in: u32,
}

/// Loaded and attached kernel programs with their maps.
pub struct Kernel {
    ebpf: Ebpf,
    watched: HashMap<MapData, u32, Watched>,
    conns: HashMap<MapData, u64, Conn>,
    service_epochs: Array<MapData, u32>,
    /// Services that hand HTTP/2 streams to worker threads (`WatchTable::set_stream_workers`).
    stream_workers: Array<MapData, u32>,
    listen_ports: HashMap<MapData, ListenKey, u32>,
    socket_namespaces: bool,
    watched_ports: Array<MapData, u64>,
    adopt: HashMap<MapData, u64, Conn>,
    adopting: Array<MapData, u32>,
    /// The kernel's BTF says where a socket's inode is (socket backend adoption).
    socket_inodes: bool,
    /// Each service's request times, mapped (one for all CPUs).
    request_times: SharedValues<RequestTimes>,
    pending_calls: HashMap<MapData, u32, PendingCall>,
    syscall_counts: PerCpuArray<MapData, u64>,
    offcpu_captures: PerCpuArray<MapData, OffcpuCaptures>,
    service_counters: PerCpuArray<MapData, ServiceCounters>,
    /// The thread array, mapped; and the followed threads whose slot another owns,
    /// with how many of them the last read found.
    thread_slots: ThreadSlots,
    threads: HashMap<MapData, u32, Thread>,
    threads_overflow: u64,
    /// Raised after each change to `thread_pools`, and its value (user space is its
    /// only writer).
    pool_epoch: Array<MapData, u32>,
    pools_epoch: u32,
    listen_changes: Array<MapData, u64>,
    thread_pools: HashMap<MapData, u32, u32>,
    /// tid → (service, pool) as the last read of the threads found them (see
    /// `thread_entries`).
    thread_pools_read: IdMap<u32, (u32, u32)>,
    /// Buffers of the last read of the threads, kept for the next so that their
    /// pages stay mapped: the map `thread_pools_read` is swapped with (emptied),
    /// the slots' copies (emptied), and the entries a readout gave back (emptied
    /// when taken).
    thread_pools_spare: IdMap<u32, (u32, u32)>,
    slots_read: Vec<(u32, Thread)>,
    entries_spare: Vec<(u32, Thread, Option<u32>)>,
    pool_stats: PerCpuArray<MapData, PoolStats>,
    pool_runqueue: PerCpuArray<MapData, Histogram>,
    lock_waits: Array<MapData, Histogram>,
    /// Counts of the records in `lock_waits` (mapped: a scrape reads them all).
    lock_wait_counts: Counters,
    locks: HashMap<MapData, LockKey, Histogram>,
    lock_stacks: StackTraceMap<MapData>,
    downstream_waits: HashMap<MapData, DownstreamKey, DownstreamWait>,
    stack_epoch: Array<MapData, u32>,
    stack_counts: HashMap<MapData, StackKey, StackCount>,
    stacks: Vec<StackTraceMap<MapData>>,
    /// The user stacks' copies for unwinding, and which stacks were copied.
    stack_copies: RingBuf<MapData>,
    stack_copied: Array<MapData, u64>,
    /// Where the callers behind one user stack id part, by id (see
    /// `stacks/repairs.rs`), as last written; and the caller paths copied.
    stack_hints: Array<MapData, StackHint>,
    hints_written: std::collections::HashMap<u32, StackHint>,
    stack_variants: HashMap<MapData, StackVariantKey, u32>,
    /// The epoch in `stack_epoch` (user space is its only writer).
    epoch: u32,
    profile_sessions: Array<MapData, ProfileSession>,
    /// The cpu-clock perf events of each session slot's sampler, while it runs.
    session_links: [Vec<PerfEventLinkId>; MAX_PROFILE_SESSIONS as usize],
    probes: Vec<Probe>,
    limits: Limits,
    backend: Backend,
    /// Keeps `kernel.bpf_stats_enabled` on while we run.
    _stats: Option<OwnedFd>,
    cpus: usize,
    /// The maps a scrape reads whole, for batch reads.
    batch: BatchMaps,
    /// Per [`CountedMap`]: the entries user space made less those it removed (the
    /// kernel's own are in `ENTRY_COUNTS`).
    own_entries: [i64; CountedMap::COUNT as usize],
    /// Each service's request times, each pool's lock waits and run-queue waits, as
    /// last read.
    request_times_read: Reread<RequestTimes>,
    lock_waits_read: Reread<Histogram>,
    runqueues_read: Reread<Histogram>,
}

/// Descriptors of the maps a scrape reads whole ([`BatchMap`]).
struct BatchMaps {
    watched: BatchMap,
    threads: BatchMap,
    pool_stats: BatchMap,
    pool_runqueue: BatchMap,
    lock_waits: BatchMap,
    service_counters: BatchMap,
    losses: BatchMap,
    entry_counts: BatchMap,
}

impl BatchMaps {
    fn of(ebpf: &Ebpf) -> Result<Self, KernelError> {
        let of = |name: &'static str| {
            let map = ebpf.map(name).ok_or(KernelError::MissingMap(name))?;
            BatchMap::of(map).map_err(|source| KernelError::Batch { map: name, source })
        };
        Ok(Self {
            watched: of(maps::WATCHED)?,
            threads: of(maps::THREADS)?,
            pool_stats: of(maps::POOL_STATS)?,
            pool_runqueue: of(maps::POOL_RUNQUEUE)?,
            lock_waits: of(maps::LOCK_WAITS)?,
            service_counters: of(maps::SERVICE_COUNTERS)?,
            losses: of(maps::LOSSES)?,
            entry_counts: of(maps::ENTRY_COUNTS)?,
        })
    }
}

/// Reader of process lifecycle events from the kernel.
pub struct ProcessEvents {
    pub ring: RingBuf<MapData>,
}
fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, KernelError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    let map = ebpf.take_map(name).ok_or(KernelError::MissingMap(name))?;
    T::try_from(map).map_err(|source| KernelError::Map { map: name, source })
}

/// This kernel's release (`uname -r`), for the start-up log; from uname(2), which a
/// `ProcSubset=pid` sandbox leaves, unlike /proc/sys/kernel/osrelease.
pub fn release() -> String {
    // SAFETY: utsname is plain old data; uname(2) fills it.
    let mut names: libc::utsname = unsafe { std::mem::zeroed() };
    // SAFETY: a valid, writable utsname.
    if unsafe { libc::uname(&raw mut names) } != 0 {
        return format!("unknown ({})", std::io::Error::last_os_error());
    }
    // SAFETY: the kernel writes a NUL-terminated string into the array.
    unsafe { std::ffi::CStr::from_ptr(names.release.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

impl Kernel {
    /// Loads the programs, fills the syscall table and attaches every probe, with the
    /// first request backend of `backends` that attaches whole.
    pub fn load(
        limits: Limits,
        backends: &[Backend],
        sampling: Sampling,
        bpf_stats: bool,
    ) -> Result<(Self, ProcessEvents), KernelError> {
        let vmlinux = vmlinux_btf();
        let exit_has_group_dead = vmlinux.as_deref().is_some_and(exit_has_group_dead);
        let task_pid_offset = vmlinux.as_deref().and_then(task_pid_offset);
        let socket_namespace = vmlinux.as_deref().and_then(socket_namespace_offsets);
        let socket_inode = vmlinux.as_deref().and_then(socket_inode_offsets);
        let socket = vmlinux.as_deref().and_then(socket_offsets);
        let tcp = vmlinux.as_deref().and_then(tcp_offsets);
        let downstream = vmlinux.as_deref().and_then(downstream_offsets);
        let run_delay = vmlinux.as_deref().and_then(run_delay_offsets);
        // The BTF tracepoints read the socket's fields at their offsets: they load
        // only where those were found.
        let btf = match socket {
            Some(_) => Btf::from_sys_fs()
                .map_err(|error| tracing::warn!(%error, "cannot parse {BTF_VMLINUX}"))
                .ok(),
            None => None,
        };
        let (sock_net_offset, net_inum_offset) = socket_namespace.unwrap_or((0, 0));
        let (sock_socket_offset, socket_inode_offset, inode_ino_offset) =
            socket_inode.unwrap_or((0, 0, 0));
        if !exit_has_group_dead {
            tracing::info!("sched_process_exit has no group_dead: a process ends with its leader");
        }
        let offcpu_min_ns = sampling.offcpu_min.map_or(u64::MAX, |min| {
            u64::try_from(min.as_nanos()).unwrap_or(u64::MAX - 1)
        });
        let mut loader = EbpfLoader::new();
        for name in maps::STACKS {
            loader.map_max_entries(name, limits.stacks);
        }
        let copy_stride = limits.stack_copy_stride();
        // Entries of the per pool × primitive arrays (`LOCK_WAITS`, `LOCK_WAIT_COUNTS`).
        let lock_wait_slots = limits.max_pools * LockPrimitive::COUNT;
        // Left at 0 where BTF does not have them all: no peer is looked for, and the
        // socket programs are skipped.
        let globals = (downstream.iter().flatten())
            .chain(socket.iter().flatten())
            .chain(tcp.iter().flatten());
        for (name, offset) in globals.chain(run_delay.iter().flatten()) {
            loader.override_global(name, offset, true);
        }
        let mut ebpf = loader
            .override_global("EXIT_HAS_GROUP_DEAD", &u32::from(exit_has_group_dead), true)
            .override_global("TASK_PID_OFFSET", &task_pid_offset.unwrap_or(0), true)
            .override_global("SOCK_NET_OFFSET", &sock_net_offset, true)
            .override_global("NET_INUM_OFFSET", &net_inum_offset, true)
            .override_global("SOCK_SOCKET_OFFSET", &sock_socket_offset, true)
            .override_global("SOCKET_INODE_OFFSET", &socket_inode_offset, true)
            .override_global("INODE_INO_OFFSET", &inode_ino_offset, true)
            .map_max_entries(maps::ADOPT, limits.connections)
            .override_global("OFFCPU_MIN_NS", &offcpu_min_ns, true)
            .override_global("OFFCPU_IDLE", &u32::from(sampling.offcpu_idle), true)
            .override_global("OFFCPU_FULL_RATE", &sampling.offcpu_full_rate, true)
            .override_global(
                "OFFCPU_SAMPLE_MASK",
                &sampling.offcpu_sample_one_in.saturating_sub(1),
                true,
            )
            .map_max_entries(maps::STACK_COUNTS, limits.stack_counts)
            .override_global("STACK_COPY_STRIDE", &copy_stride, true)
            .map_max_entries(maps::STACK_COPIED, (STACK_GENERATIONS + 1) * copy_stride)
            .map_max_entries(maps::STACK_HINTS, limits.stacks)
            .map_max_entries(maps::WATCHED, limits.watched_processes)
            .map_max_entries(maps::CONNS, limits.connections)
            .map_max_entries(maps::SERVICE_COUNTERS, limits.max_services)
            .map_max_entries(maps::SERVICE_EPOCHS, limits.max_services)
            .map_max_entries(maps::REQUEST_TIMES, limits.max_services)
            .map_max_entries(maps::POOL_STATS, limits.max_pools)
            .map_max_entries(maps::POOL_RUNQUEUE, limits.max_pools)
            .map_max_entries(maps::THREADS, limits.threads)
            .map_max_entries(maps::THREAD_ENTRIES, limits.thread_slots)
            .map_max_entries(maps::THREAD_OWNERS, limits.thread_slots)
            .override_global(
                "THREAD_SLOT_MASK",
                &limits.thread_slots.wrapping_sub(1),
                true,
            )
            .map_max_entries(maps::THREAD_POOLS, limits.threads)
            .map_max_entries(maps::LOCK_WAITS, lock_wait_slots)
            .map_max_entries(maps::LOCK_WAIT_COUNTS, lock_wait_slots)
            .map_max_entries(maps::LOCKS, limits.locks)
            .map_max_entries(maps::LOCK_STACKS, limits.lock_stacks)
            .map_max_entries(maps::PENDING_CALLS, limits.syscalls_in_flight)
            .map_max_entries(maps::MUTEX_CALLS, limits.mutex_calls_in_flight)
            .map_max_entries(maps::LISTEN_PORTS, limits.listen_ports)
            .map_max_entries(maps::DOWNSTREAM_WAITS, limits.downstreams)
            .load(aya::include_bytes_aligned!(concat!(
                env!("OUT_DIR"),
                "/poolscope"
            )))?;

        let mut slots: Array<_, u32> = take(&mut ebpf, maps::SYSCALL_SLOTS)?;
        for slot in SyscallSlot::ALL {
            if let Some(number) = syscall_number(slot) {
                slots
                    .set(number as u32, slot as u32, 0)
                    .map_err(|source| KernelError::Map {
                        map: maps::SYSCALL_SLOTS,
                        source,
                    })?;
            }
        }

        let mut classes: Array<_, u32> = take(&mut ebpf, maps::WAIT_CLASSES)?;
        for (number, class) in wait_classes() {
            classes
                .set(number as u32, class as u32, 0)
                .map_err(|source| KernelError::Map {
                    map: maps::WAIT_CLASSES,
                    source,
                })?;
        }

        let stats = if bpf_stats {
            match aya::sys::enable_stats(aya::sys::Stats::RunTime) {
                Ok(fd) => Some(fd),
                Err(error) => {
                    tracing::warn!(%error, "cannot enable BPF run-time stats; bpf_run_* will stay 0");
                    None
                }
            }
        } else {
            None
        };

        let mut probes = Vec::new();
        for attachment in PROCESS_ATTACHMENTS.iter().chain(&THREAD_ATTACHMENTS) {
            if attachment.program == WAKEUP_PROGRAM && run_delay.is_some() {
                tracing::info!(
                    "sched_wakeup not attached: run-queue waits come from the kernel's \
                     sched_info when a thread goes on CPU"
                );
                continue;
            }
            probes.push(attach_tracepoint(
                &mut ebpf,
                attachment,
                task_pid_offset.is_some(),
                btf.as_ref(),
                vmlinux.as_deref(),
            )?);
        }
        let backend = attach_backend(
            &mut ebpf,
            backends,
            |backend| {
                (backend == Backend::Tcp && tcp.is_none())
                    .then_some("the kernel's BTF lacks what the tcp backend reads (logged)")
            },
            task_pid_offset.is_some(),
            btf.as_ref(),
            vmlinux.as_deref(),
            &mut probes,
        )?
        .ok_or_else(|| {
            let names: Vec<_> = backends.iter().map(|backend| backend.name()).collect();
            KernelError::NoBackend(names.join(", "))
        })?;
        drop(vmlinux);
        probes.push(attach_sampler(&mut ebpf, sampling.hz)?);
        for (program, probe) in MUTEX_PROBES {
            probes.push(load_on_demand(&mut ebpf, probe, &[program], UProbe::load)?);
        }
        probes.push(load_on_demand(
            &mut ebpf,
            "perf_event/profile-sessions",
            &SESSION_SAMPLERS,
            PerfEvent::load,
        )?);

        let events = ProcessEvents {
            ring: take(&mut ebpf, maps::PROCESS_EVENTS)?,
        };
        let batch = BatchMaps::of(&ebpf)?;
        let stacks = maps::STACKS
            .iter()
            .map(|name| take(&mut ebpf, name))
            .collect::<Result<_, _>>()?;
        let kernel = Self {
            watched: take(&mut ebpf, maps::WATCHED)?,
            conns: take(&mut ebpf, maps::CONNS)?,
            service_epochs: take(&mut ebpf, maps::SERVICE_EPOCHS)?,
            stream_workers: take(&mut ebpf, maps::STREAM_WORKERS)?,
            listen_ports: take(&mut ebpf, maps::LISTEN_PORTS)?,
            socket_namespaces: socket_namespace.is_some(),
            watched_ports: take(&mut ebpf, maps::WATCHED_PORTS)?,
            adopt: take(&mut ebpf, maps::ADOPT)?,
            adopting: take(&mut ebpf, maps::ADOPTING)?,
            socket_inodes: socket_inode.is_some(),
            request_times: SharedValues::of(&ebpf, maps::REQUEST_TIMES, limits.max_services)?,
            pending_calls: take(&mut ebpf, maps::PENDING_CALLS)?,
            syscall_counts: take(&mut ebpf, maps::SYSCALL_COUNTS)?,
            offcpu_captures: take(&mut ebpf, maps::OFFCPU_CAPTURES)?,
            service_counters: take(&mut ebpf, maps::SERVICE_COUNTERS)?,
            thread_slots: ThreadSlots::map(&ebpf, limits.thread_slots)?,
            threads: take(&mut ebpf, maps::THREADS)?,
            threads_overflow: 0,
            pool_epoch: take(&mut ebpf, maps::POOL_EPOCH)?,
            pools_epoch: 0,
            listen_changes: take(&mut ebpf, maps::LISTEN_CHANGES)?,
            thread_pools: take(&mut ebpf, maps::THREAD_POOLS)?,
            thread_pools_read: IdMap::default(),
            thread_pools_spare: IdMap::default(),
            slots_read: Vec::new(),
            entries_spare: Vec::new(),
            pool_stats: take(&mut ebpf, maps::POOL_STATS)?,
            pool_runqueue: take(&mut ebpf, maps::POOL_RUNQUEUE)?,
            lock_waits: take(&mut ebpf, maps::LOCK_WAITS)?,
            lock_wait_counts: Counters::of(&ebpf, maps::LOCK_WAIT_COUNTS, lock_wait_slots)?,
            locks: take(&mut ebpf, maps::LOCKS)?,
            lock_stacks: take(&mut ebpf, maps::LOCK_STACKS)?,
            downstream_waits: take(&mut ebpf, maps::DOWNSTREAM_WAITS)?,
            stack_epoch: take(&mut ebpf, maps::STACK_EPOCH)?,
            stack_counts: take(&mut ebpf, maps::STACK_COUNTS)?,
            stacks,
            stack_copies: take(&mut ebpf, maps::STACK_COPIES)?,
            stack_copied: take(&mut ebpf, maps::STACK_COPIED)?,
            stack_hints: take(&mut ebpf, maps::STACK_HINTS)?,
            hints_written: std::collections::HashMap::new(),
            stack_variants: take(&mut ebpf, maps::STACK_VARIANTS)?,
            epoch: 0,
            profile_sessions: take(&mut ebpf, maps::PROFILE_SESSIONS)?,
            session_links: std::array::from_fn(|_| Vec::new()),
            ebpf,
            probes,
            limits,
            backend,
            _stats: stats,
            cpus: aya::util::nr_cpus().map_or(1, |n| n.max(1)),
            batch,
            own_entries: [0; CountedMap::COUNT as usize],
            request_times_read: Reread::default(),
            lock_waits_read: Reread::default(),
            runqueues_read: Reread::default(),
        };
        Ok((kernel, events))
    }

    pub fn probes(&self) -> &[Probe] {
        &self.probes
    }

    /// The size of kernel map `name` as loaded (each of the three for `STACKS`):
    /// its limit's, or the fixed size of a map no limit sets.
    pub fn capacity(&self, name: &str) -> Option<u32> {
        self.limits.size_of(name).or(match name {
            maps::PROFILE_SESSIONS => Some(MAX_PROFILE_SESSIONS),
            _ => None,
        })
    }

    /// How many TCP sockets began or stopped listening on the host since the
    /// programs loaded, where `sock_state` counts them (`None` where it is not
    /// attached, with the syscall backend or for want of BTF, or if the read fails:
    /// then every rescan reads every table).
    pub fn listen_changes(&self) -> Option<u64> {
        let counted = self.probes.iter().any(|probe| {
            probe.name == "sock/inet_sock_set_state" && probe.state == ProbeState::Attached
        });
        counted
            .then(|| self.listen_changes.get(&0, 0).ok())
            .flatten()
    }
}

impl ProcessEvents {
    /// Decodes one ring-buffer record; `None` for a record of the wrong size.
    pub fn decode(bytes: &[u8]) -> Option<ProcessEvent> {
        if bytes.len() < size_of::<ProcessEvent>() {
            return None;
        }
        // SAFETY: ProcessEvent is repr(C) of integers, any bit pattern is valid, and
        // read_unaligned does not need alignment.
        Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<ProcessEvent>()) })
    }
}
