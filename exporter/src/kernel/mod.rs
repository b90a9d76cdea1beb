//! The kernel side seen from user space: loads and attaches `poolscope-ebpf`, owns its
//! maps, and offers small typed operations on them (watch a process, purge its
//! connections) plus one read of every counter for a scrape. No numbers are kept here;
//! the maps are the state.
mod attach;
pub mod btf;
pub mod caps;
mod offsets;

use std::{collections::BTreeMap, num::NonZeroU32, os::fd::OwnedFd, path::Path, time::Duration};

use aya::{
    Btf, Ebpf, EbpfLoader,
    maps::{
        Array, HashMap, MapData, MapError, PerCpuArray, PerCpuValues, RingBuf,
        stack_trace::StackTraceMap,
    },
    programs::{
        PerfEvent, ProgramError, UProbe,
        perf_event::PerfEventLinkId,
        uprobe::{UProbeLinkId, UProbeScope},
    },
};
use poolscope_shared::{
    Conn, DownstreamKey, DownstreamWait, Histogram, ListenKey, LockKey, LockPrimitive, LossErrno,
    LossSource, MAX_PROFILE_SESSIONS, PendingCall, Phase, PoolStats, ProcessEvent, ProfileSession,
    RequestTimes, STACK_GENERATIONS, ServiceCounters, StackCount, StackKey, SyscallSlot, Thread,
    WaitClass, Watched, conn_key_tgid, fd_conn_key, lock_wait_index, loss_index, maps,
    syscall_counter_index, watched_port_bit,
};

pub use self::attach::{Backend, Probe, ProbeState, Skip};
use self::attach::{
    MUTEX_PROBES, MUTEX_SYMBOL, PROCESS_ATTACHMENTS, SESSION_SAMPLERS, THREAD_ATTACHMENTS,
    attach_cpu_clock, attach_sampler, attach_tracepoint, detach_all, ensure_tracefs,
    load_on_demand, session_sampler, typed_program,
};
use self::offsets::{
    BTF_VMLINUX, downstream_offsets, exit_group_dead_offset, socket_inode_offsets,
    socket_namespace_offsets, socket_offsets, task_pid_offset, vmlinux_btf,
};
use crate::{config::Limits, discovery::procfs::ServedConnection};

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("tracefs is not mounted at /sys/kernel/tracing and mounting it failed: {0}")]
    Tracefs(std::io::Error),
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
}

/// Map update flag of include/uapi/linux/bpf.h: insert only if the key is absent.
const BPF_NOEXIST: u64 = 1;

/// This architecture's number of the syscall.
fn syscall_number(slot: SyscallSlot) -> Option<libc::c_long> {
    match slot {
        SyscallSlot::None => None,
        SyscallSlot::Accept => Some(libc::SYS_accept),
        SyscallSlot::Accept4 => Some(libc::SYS_accept4),
        SyscallSlot::Read => Some(libc::SYS_read),
        SyscallSlot::Readv => Some(libc::SYS_readv),
        SyscallSlot::Recvfrom => Some(libc::SYS_recvfrom),
        SyscallSlot::Recvmsg => Some(libc::SYS_recvmsg),
        SyscallSlot::Write => Some(libc::SYS_write),
        SyscallSlot::Writev => Some(libc::SYS_writev),
        SyscallSlot::Sendto => Some(libc::SYS_sendto),
        SyscallSlot::Sendmsg => Some(libc::SYS_sendmsg),
        SyscallSlot::Sendfile => Some(libc::SYS_sendfile),
        SyscallSlot::Close => Some(libc::SYS_close),
    }
}

/// futex_wait(2), 455 on every architecture since 6.7; libc has no name for it yet.
const SYS_FUTEX_WAIT: libc::c_long = 455;

/// What a thread blocked in each syscall waits for (DESIGN §3).
fn wait_classes() -> Vec<(libc::c_long, WaitClass)> {
    let mut classes = vec![
        (libc::SYS_epoll_pwait, WaitClass::Idle),
        (libc::SYS_epoll_pwait2, WaitClass::Idle),
        (libc::SYS_ppoll, WaitClass::Poll),
        (libc::SYS_pselect6, WaitClass::Select),
        (libc::SYS_accept4, WaitClass::Idle),
        (libc::SYS_io_uring_enter, WaitClass::Idle),
        (libc::SYS_futex, WaitClass::Futex),
        (libc::SYS_futex_waitv, WaitClass::Futex),
        (SYS_FUTEX_WAIT, WaitClass::Futex),
        (libc::SYS_nanosleep, WaitClass::Sleep),
        (libc::SYS_clock_nanosleep, WaitClass::Sleep),
    ];
    classes.extend(
        [
            libc::SYS_read,
            libc::SYS_readv,
            libc::SYS_recvfrom,
            libc::SYS_recvmsg,
            libc::SYS_recvmmsg,
            libc::SYS_write,
            libc::SYS_writev,
            libc::SYS_sendto,
            libc::SYS_sendmsg,
            libc::SYS_sendmmsg,
            libc::SYS_sendfile,
            libc::SYS_splice,
            libc::SYS_connect,
        ]
        .map(|number| (number, WaitClass::Network)),
    );
    // The older calls that newer architectures only have in their p/2 forms.
    #[cfg(target_arch = "x86_64")]
    classes.extend([
        (libc::SYS_epoll_wait, WaitClass::Idle),
        (libc::SYS_poll, WaitClass::Poll),
        (libc::SYS_select, WaitClass::Select),
        (libc::SYS_accept, WaitClass::Idle),
    ]);
    classes
}

/// What the stack programs sample.
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    /// On-CPU samples per second per CPU; 0: none.
    pub hz: u32,
    /// Shortest off-CPU block recorded; `None`: no off-CPU stacks.
    pub offcpu_min: Option<Duration>,
    /// Also the blocks of threads waiting for work.
    pub offcpu_idle: bool,
}

/// Loaded and attached kernel programs with their maps.
pub struct Kernel {
    ebpf: Ebpf,
    watched: HashMap<MapData, u32, Watched>,
    conns: HashMap<MapData, u64, Conn>,
    sock_conn_count: PerCpuArray<MapData, i64>,
    service_epochs: Array<MapData, u32>,
    listen_ports: HashMap<MapData, ListenKey, u32>,
    socket_namespaces: bool,
    watched_ports: Array<MapData, u64>,
    adopt: HashMap<MapData, u64, Conn>,
    adopting: Array<MapData, u32>,
    /// The kernel's BTF says where a socket's inode is (socket backend adoption).
    socket_inodes: bool,
    request_times: PerCpuArray<MapData, RequestTimes>,
    pending_calls: HashMap<MapData, u32, PendingCall>,
    syscall_counts: PerCpuArray<MapData, u64>,
    service_counters: PerCpuArray<MapData, ServiceCounters>,
    losses: PerCpuArray<MapData, u64>,
    threads: HashMap<MapData, u32, Thread>,
    thread_pools: HashMap<MapData, u32, u32>,
    pool_stats: PerCpuArray<MapData, PoolStats>,
    lock_waits: Array<MapData, Histogram>,
    locks: HashMap<MapData, LockKey, Histogram>,
    lock_stacks: StackTraceMap<MapData>,
    downstream_waits: HashMap<MapData, DownstreamKey, DownstreamWait>,
    mutex_calls: HashMap<MapData, u32, u64>,
    stack_epoch: Array<MapData, u32>,
    stack_counts: HashMap<MapData, StackKey, StackCount>,
    stacks: Vec<StackTraceMap<MapData>>,
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
}

/// Reader of process lifecycle events from the kernel.
pub struct ProcessEvents {
    pub ring: RingBuf<MapData>,
}

/// Everything the kernel counted, read for one scrape.
#[derive(Clone, Debug, Default)]
pub struct Readout {
    /// The `WATCHED` map: pid → `since_ns`.
    pub watched: BTreeMap<u32, u64>,
    pub services: BTreeMap<u32, ServiceCounters>,
    /// Durations of finished requests per service, since the service id was assigned.
    pub request_times: BTreeMap<u32, RequestTimes>,
    pub syscalls: BTreeMap<(u32, &'static str), u64>,
    /// Closed intervals of each pool's threads, read before `threads`.
    pub pools: BTreeMap<u32, PoolStats>,
    /// Lock waits of each pool, per [`LockPrimitive`].
    pub lock_waits: BTreeMap<u32, [Histogram; LockPrimitive::COUNT as usize]>,
    /// Network waits of each pool's serving threads, per socket peer.
    pub downstreams: Vec<(DownstreamKey, DownstreamWait)>,
    /// CLOCK_MONOTONIC ns between reading `pools` and `threads`: the end of each
    /// thread's open interval.
    pub threads_read_ns: u64,
    /// The watched threads: tid, state, pool (if named).
    pub threads: Vec<(u32, Thread, Option<u32>)>,
    /// Every kernel-side loss counter, by source and errno.
    pub losses: Vec<(LossSource, LossErrno, u64)>,
    pub maps: Vec<MapFill>,
    pub programs: Vec<ProgramStats>,
}

#[derive(Clone, Debug)]
pub struct MapFill {
    pub name: &'static str,
    pub entries: u64,
    /// `None` for a map without a size (socket storage).
    pub capacity: Option<u32>,
}

#[derive(Clone, Debug)]
pub struct ProgramStats {
    pub name: String,
    pub run_time: Duration,
    pub runs: u64,
}

fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, KernelError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    let map = ebpf.take_map(name).ok_or(KernelError::MissingMap(name))?;
    T::try_from(map).map_err(|source| KernelError::Map { map: name, source })
}

/// The return addresses (innermost first) of stack `id` of a stack map; `None` for
/// a negative id (not captured) or one the map no longer holds.
fn addresses(map: &StackTraceMap<MapData>, id: i32) -> Option<Vec<u64>> {
    let id = u32::try_from(id).ok()?;
    let trace = map.get(&id, 0).ok()?;
    Some(trace.frames().iter().map(|frame| frame.ip).collect())
}

/// Removes the entries of `service` from a map of connections (`CONNS`, `ADOPT`).
fn drop_service_connections(map: &mut HashMap<MapData, u64, Conn>, service: u32) {
    let keys: Vec<u64> = map
        .iter()
        .filter_map(Result::ok)
        .filter(|(_, conn)| conn.service == service)
        .map(|(key, _)| key)
        .collect();
    for key in keys {
        // Gone meanwhile (closed or adopted): fine.
        let _ = map.remove(&key);
    }
}

/// What [`Kernel::adopt_connections`] did.
#[derive(Debug, Default)]
pub struct Adopted {
    /// Socket inodes waiting in `ADOPT` for their first event (socket backend).
    pub pending: Vec<u64>,
    /// Entries made `Unserved` (a request waits unread) without a kernel counter.
    pub unserved: u64,
    /// The inserts that failed (a full map): those connections are not followed.
    pub failed: Vec<MapError>,
}

/// This kernel's release (`uname -r`), for the start-up log.
pub fn release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map_or_else(
        |error| format!("unknown ({error})"),
        |release| release.trim().to_owned(),
    )
}

impl Kernel {
    /// Loads the programs, fills the syscall table and attaches every probe.
    pub fn load(
        limits: Limits,
        backend: Backend,
        sampling: Sampling,
        bpf_stats: bool,
    ) -> Result<(Self, ProcessEvents), KernelError> {
        ensure_tracefs()?;
        let group_dead_offset = exit_group_dead_offset();
        let vmlinux = vmlinux_btf();
        let task_pid_offset = vmlinux.as_deref().and_then(task_pid_offset);
        let socket_namespace = vmlinux.as_deref().and_then(socket_namespace_offsets);
        let socket_inode = vmlinux.as_deref().and_then(socket_inode_offsets);
        let socket = vmlinux.as_deref().and_then(socket_offsets);
        let downstream = vmlinux.as_deref().and_then(downstream_offsets);
        // The BTF tracepoints read the socket's fields at their offsets: they load
        // only where those were found.
        let btf = match socket {
            Some(_) => Btf::from_sys_fs()
                .map_err(|error| tracing::warn!(%error, "cannot parse {BTF_VMLINUX}"))
                .ok(),
            None => None,
        };
        drop(vmlinux);
        let (sock_net_offset, net_inum_offset) = socket_namespace.unwrap_or((0, 0));
        let (sock_socket_offset, socket_inode_offset, inode_ino_offset) =
            socket_inode.unwrap_or((0, 0, 0));
        if group_dead_offset == 0 {
            tracing::info!("sched_process_exit has no group_dead: a process ends with its leader");
        }
        let offcpu_min_ns = sampling.offcpu_min.map_or(u64::MAX, |min| {
            u64::try_from(min.as_nanos()).unwrap_or(u64::MAX - 1)
        });
        let mut loader = EbpfLoader::new();
        for name in maps::STACKS {
            loader.map_max_entries(name, limits.stacks);
        }
        // Left at 0 where BTF does not have them all: no peer is looked for, and the
        // socket programs are skipped.
        for (name, offset) in downstream.iter().flatten().chain(socket.iter().flatten()) {
            loader.override_global(name, offset, true);
        }
        let mut ebpf = loader
            .override_global("EXIT_GROUP_DEAD_OFFSET", &group_dead_offset, true)
            .override_global("TASK_PID_OFFSET", &task_pid_offset.unwrap_or(0), true)
            .override_global("SOCK_NET_OFFSET", &sock_net_offset, true)
            .override_global("NET_INUM_OFFSET", &net_inum_offset, true)
            .override_global("SOCK_SOCKET_OFFSET", &sock_socket_offset, true)
            .override_global("SOCKET_INODE_OFFSET", &socket_inode_offset, true)
            .override_global("INODE_INO_OFFSET", &inode_ino_offset, true)
            .map_max_entries(maps::ADOPT, limits.connections)
            .override_global("OFFCPU_MIN_NS", &offcpu_min_ns, true)
            .override_global("OFFCPU_IDLE", &u32::from(sampling.offcpu_idle), true)
            .map_max_entries(maps::STACK_COUNTS, limits.stack_counts)
            .map_max_entries(maps::WATCHED, limits.watched_processes)
            .map_max_entries(maps::CONNS, limits.connections)
            .map_max_entries(maps::SERVICE_COUNTERS, limits.max_services)
            .map_max_entries(maps::SERVICE_EPOCHS, limits.max_services)
            .map_max_entries(maps::REQUEST_TIMES, limits.max_services)
            .map_max_entries(maps::POOL_STATS, limits.max_pools)
            .map_max_entries(maps::THREADS, limits.threads)
            .map_max_entries(maps::THREAD_POOLS, limits.threads)
            .map_max_entries(maps::LOCK_WAITS, limits.max_pools * LockPrimitive::COUNT)
            .map_max_entries(maps::LOCKS, limits.locks)
            .map_max_entries(maps::LOCK_STACKS, limits.lock_stacks)
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
        let attachments = PROCESS_ATTACHMENTS
            .iter()
            .chain(&THREAD_ATTACHMENTS)
            .chain(backend.attachments());
        for attachment in attachments {
            probes.push(attach_tracepoint(
                &mut ebpf,
                attachment,
                task_pid_offset.is_some(),
                btf.as_ref(),
            )?);
        }
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
        let stacks = maps::STACKS
            .iter()
            .map(|name| take(&mut ebpf, name))
            .collect::<Result<_, _>>()?;
        let kernel = Self {
            watched: take(&mut ebpf, maps::WATCHED)?,
            conns: take(&mut ebpf, maps::CONNS)?,
            sock_conn_count: take(&mut ebpf, maps::SOCK_CONN_COUNT)?,
            service_epochs: take(&mut ebpf, maps::SERVICE_EPOCHS)?,
            listen_ports: take(&mut ebpf, maps::LISTEN_PORTS)?,
            socket_namespaces: socket_namespace.is_some(),
            watched_ports: take(&mut ebpf, maps::WATCHED_PORTS)?,
            adopt: take(&mut ebpf, maps::ADOPT)?,
            adopting: take(&mut ebpf, maps::ADOPTING)?,
            socket_inodes: socket_inode.is_some(),
            request_times: take(&mut ebpf, maps::REQUEST_TIMES)?,
            pending_calls: take(&mut ebpf, maps::PENDING_CALLS)?,
            syscall_counts: take(&mut ebpf, maps::SYSCALL_COUNTS)?,
            service_counters: take(&mut ebpf, maps::SERVICE_COUNTERS)?,
            losses: take(&mut ebpf, maps::LOSSES)?,
            threads: take(&mut ebpf, maps::THREADS)?,
            thread_pools: take(&mut ebpf, maps::THREAD_POOLS)?,
            pool_stats: take(&mut ebpf, maps::POOL_STATS)?,
            lock_waits: take(&mut ebpf, maps::LOCK_WAITS)?,
            locks: take(&mut ebpf, maps::LOCKS)?,
            lock_stacks: take(&mut ebpf, maps::LOCK_STACKS)?,
            downstream_waits: take(&mut ebpf, maps::DOWNSTREAM_WAITS)?,
            mutex_calls: take(&mut ebpf, maps::MUTEX_CALLS)?,
            stack_epoch: take(&mut ebpf, maps::STACK_EPOCH)?,
            stack_counts: take(&mut ebpf, maps::STACK_COUNTS)?,
            stacks,
            epoch: 0,
            profile_sessions: take(&mut ebpf, maps::PROFILE_SESSIONS)?,
            session_links: std::array::from_fn(|_| Vec::new()),
            ebpf,
            probes,
            limits,
            backend,
            _stats: stats,
            cpus: aya::util::nr_cpus().map_or(1, |n| n.max(1)),
        };
        Ok((kernel, events))
    }

    pub fn probes(&self) -> &[Probe] {
        &self.probes
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Whether the socket backend tells listeners apart by network namespace (the
    /// kernel's BTF gave the offsets it reads); if not, keys carry
    /// [`ListenKey::ANY_NAMESPACE`].
    pub fn claims_by_namespace(&self) -> bool {
        self.socket_namespaces
    }

    /// Makes `LISTEN_PORTS` equal to `ports` ((namespace, local port) → service id),
    /// and `WATCHED_PORTS` hold their ports. A new port's bit is set before its
    /// listener is, and an old one's cleared after, so that no handshake's later
    /// events are filtered out.
    pub fn set_listen_ports(&mut self, ports: &BTreeMap<ListenKey, u32>) -> Result<(), MapError> {
        let current: Vec<(ListenKey, u32)> =
            self.listen_ports.iter().filter_map(Result::ok).collect();
        let bits = |keys: &mut dyn Iterator<Item = &ListenKey>| {
            let mut words: BTreeMap<u32, u64> = BTreeMap::new();
            for key in keys {
                let (word, bit) = watched_port_bit(u16::try_from(key.port).unwrap_or(0));
                *words.entry(word).or_default() |= bit;
            }
            words
        };
        let old_words = bits(&mut current.iter().map(|(key, _)| key));
        let new_words = bits(&mut ports.keys());
        for (&word, &value) in &new_words {
            let old = old_words.get(&word).copied().unwrap_or(0);
            if value & !old != 0 {
                self.watched_ports.set(word, old | value, 0)?;
            }
        }
        for (key, service) in current {
            if ports.get(&key) != Some(&service) {
                self.listen_ports.remove(&key)?;
            }
        }
        for (key, &service) in ports {
            if self.listen_ports.get(key, 0).ok() != Some(service) {
                self.listen_ports.insert(key, service, 0)?;
            }
        }
        for (&word, &old) in &old_words {
            let value = new_words.get(&word).copied().unwrap_or(0);
            if old & !value != 0 {
                self.watched_ports.set(word, value, 0)?;
            }
        }
        Ok(())
    }

    /// The watch entry of `pid`, if any.
    pub fn watched(&self, pid: u32) -> Option<Watched> {
        self.watched.get(&pid, 0).ok()
    }

    /// Every entry of `WATCHED`.
    pub fn watched_pids(&self) -> Vec<(u32, Watched)> {
        self.watched.iter().filter_map(Result::ok).collect()
    }

    pub fn watch(&mut self, pid: u32, watch: Watched) -> Result<(), MapError> {
        self.watched.insert(pid, watch, 0)
    }

    /// The size of kernel map `name` as loaded (each of the three for `STACKS`):
    /// its limit's, or the fixed size of a map no limit sets.
    pub fn capacity(&self, name: &str) -> Option<u32> {
        self.limits.size_of(name).or(match name {
            maps::PENDING_CALLS => Some(poolscope_shared::PENDING_CALLS_CAPACITY),
            maps::DOWNSTREAM_WAITS => Some(poolscope_shared::MAX_DOWNSTREAMS),
            maps::MUTEX_CALLS => Some(poolscope_shared::MUTEX_CALLS_CAPACITY),
            maps::PROFILE_SESSIONS => Some(MAX_PROFILE_SESSIONS),
            maps::LISTEN_PORTS => Some(poolscope_shared::LISTEN_PORTS_CAPACITY),
            _ => None,
        })
    }

    /// Entries in `SOCK_CONNS`: the kernel's count of those made less those removed.
    fn sock_conn_entries(&self) -> Result<usize, KernelError> {
        let counts = self
            .sock_conn_count
            .get(&0, 0)
            .map_err(|source| KernelError::Map {
                map: maps::SOCK_CONN_COUNT,
                source,
            })?;
        // Each CPU's count may be negative (made on one CPU, removed on another).
        Ok(usize::try_from(counts.iter().sum::<i64>()).unwrap_or(0))
    }

    /// Every kernel-side loss counter, summed over CPUs.
    pub fn losses(&self) -> Result<Vec<(LossSource, LossErrno, u64)>, KernelError> {
        let mut losses = Vec::new();
        for source in LossSource::ALL {
            for errno in LossErrno::ALL {
                let lost: u64 = self
                    .losses
                    .get(&loss_index(source, errno), 0)
                    .map_err(|source| KernelError::Map {
                        map: maps::LOSSES,
                        source,
                    })?
                    .iter()
                    .sum();
                losses.push((source, errno, lost));
            }
        }
        Ok(losses)
    }

    /// Stops watching `pid` if its entry is still the one made at `since_ns`.
    pub fn unwatch(&mut self, pid: u32, since_ns: u64) {
        if self.watched(pid).is_some_and(|w| w.since_ns == since_ns) {
            // A concurrent exit may have removed it first; either way it is gone.
            let _ = self.watched.remove(&pid);
        }
    }

    /// Syscall backend: threads of a newly watched process that are already blocked in
    /// accept (`blocked`: tid, syscall number) get the entry their syscall entry would
    /// have made, so that the connection they return is followed. The exit checks the
    /// number again, so a thread that left accept meanwhile is not misread.
    pub fn adopt_blocked_accepts(&mut self, blocked: &[(u32, u64)]) {
        if self.backend != Backend::Syscall {
            return;
        }
        for &(tid, number) in blocked {
            let slot = [SyscallSlot::Accept, SyscallSlot::Accept4]
                .into_iter()
                .find(|slot| {
                    syscall_number(*slot).and_then(|n| u64::try_from(n).ok()) == Some(number)
                });
            let Some(slot) = slot else {
                continue;
            };
            let call = PendingCall {
                slot: slot as u32,
                fd: 0,
                number: number as u32,
                _pad: 0,
            };
            // BPF_NOEXIST: an entry made by the syscall itself is newer than our look.
            let _ = self.pending_calls.insert(tid, call, BPF_NOEXIST);
        }
    }

    /// Follows connections that process `(pid, since_ns)` of `service` held before it
    /// was watched: the syscall backend gets their entries at once (keyed by fd), the
    /// socket backend in `ADOPT` (keyed by inode) for its first event on each. An
    /// entry with unread bytes is `Unserved` from now; the rest are between requests.
    /// Returns the inodes put in `ADOPT` and the number of `Unserved` entries made,
    /// which no kernel counter entered.
    pub fn adopt_connections(
        &mut self,
        service: u32,
        since_ns: u64,
        pid: u32,
        connections: &[ServedConnection],
        now_ns: u64,
    ) -> Result<Adopted, MapError> {
        let mut adopted = Adopted::default();
        // The socket programs check it (see `reset_service`).
        let epoch = match self.backend {
            Backend::Socket => self.service_epochs.get(&service, 0)?,
            Backend::Syscall => 0,
        };
        // Every connection is tried: one that does not fit is counted and the rest,
        // already made, must still be accounted for.
        for connection in connections {
            let phase = if connection.unread {
                Phase::Unserved
            } else {
                Phase::Responded
            };
            let conn = Conn {
                service,
                phase: phase as u32,
                owner_since_ns: match self.backend {
                    Backend::Syscall => since_ns,
                    Backend::Socket => 0,
                },
                arrive_ns: now_ns,
                start_ns: 0,
                end_ns: 0,
                next_arrive_ns: 0,
                server_tid: 0,
                epoch,
            };
            // BPF_NOEXIST: an entry the kernel made itself is newer than our look.
            let inserted = match self.backend {
                Backend::Syscall => {
                    self.conns
                        .insert(fd_conn_key(pid, connection.fd), conn, BPF_NOEXIST)
                }
                Backend::Socket if self.socket_inodes => {
                    self.adopt.insert(connection.inode, conn, BPF_NOEXIST)
                }
                Backend::Socket => continue,
            };
            match inserted {
                Ok(()) => {
                    if self.backend == Backend::Socket {
                        adopted.pending.push(connection.inode);
                    }
                    if phase == Phase::Unserved {
                        adopted.unserved += 1;
                    }
                }
                Err(MapError::SyscallError(error))
                    if error.io_error.raw_os_error() == Some(libc::EEXIST) => {}
                Err(error) => adopted.failed.push(error),
            }
        }
        if !adopted.pending.is_empty() {
            self.set_adopting(true)?;
        }
        Ok(adopted)
    }

    /// Drops the `ADOPT` entry of a connection that closed before any event adopted
    /// it. Returns its phase if this call removed it (the kernel had not taken it).
    pub fn forget_adoption(&mut self, inode: u64) -> Option<Phase> {
        let conn = self.adopt.get(&inode, 0).ok()?;
        self.adopt.remove(&inode).ok()?;
        Some(Phase::from_u32(conn.phase))
    }

    /// Whether the kernel has yet to take the `ADOPT` entry of `inode`.
    pub fn awaits_adoption(&self, inode: u64) -> bool {
        self.adopt.get(&inode, 0).is_ok()
    }

    /// Tells the socket programs whether `ADOPT` may hold entries.
    pub fn set_adopting(&mut self, adopting: bool) -> Result<(), MapError> {
        self.adopting.set(0, u32::from(adopting), 0)
    }

    /// Removes the connections of the process `(pid, since_ns)`, which exited without
    /// closing them one by one (syscall backend; the socket backend sees the kernel
    /// close them). Returns the service and phase of each.
    pub fn purge_connections(&mut self, pid: u32, since_ns: u64) -> Vec<(u32, Phase)> {
        if self.backend != Backend::Syscall {
            return Vec::new();
        }
        let stale: Vec<(u64, Conn)> = self
            .conns
            .iter()
            .filter_map(Result::ok)
            .filter(|(key, conn)| conn_key_tgid(*key) == pid && conn.owner_since_ns == since_ns)
            .collect();
        stale
            .into_iter()
            .filter(|(key, _)| self.conns.remove(key).is_ok())
            .map(|(_, conn)| (conn.service, Phase::from_u32(conn.phase)))
            .collect()
    }

    /// Follows a thread found running (not created while watched): its first entry,
    /// unless its creation or an earlier look made one already.
    pub fn follow_thread(&mut self, tid: u32, thread: Thread) -> Result<(), MapError> {
        match self.threads.insert(tid, thread, BPF_NOEXIST) {
            Err(MapError::SyscallError(error))
                if error.io_error.raw_os_error() == Some(libc::EEXIST) =>
            {
                Ok(())
            }
            other => other,
        }
    }

    /// Puts thread `tid` in pool `pool` from now on.
    pub fn set_thread_pool(&mut self, tid: u32, pool: u32) -> Result<(), MapError> {
        self.thread_pools.insert(tid, pool, 0)
    }

    /// Stops following a thread of a process no longer watched.
    pub fn forget_thread(&mut self, tid: u32) {
        // Either may be gone already (the thread exited).
        let _ = self.threads.remove(&tid);
        let _ = self.thread_pools.remove(&tid);
    }

    /// Every followed thread.
    pub fn thread_entries(&self) -> Vec<(u32, Thread)> {
        self.threads.iter().filter_map(Result::ok).collect()
    }

    /// Zeroes the stats of a pool id before it is reused for another pool.
    pub fn reset_pool(&mut self, pool: u32) -> Result<(), MapError> {
        let zeros = PerCpuValues::try_from(vec![PoolStats::default(); self.cpus])?;
        self.pool_stats.set(pool, zeros, 0)?;
        for primitive in LockPrimitive::ALL {
            self.lock_waits
                .set(lock_wait_index(pool, primitive), Histogram::default(), 0)?;
        }
        let peers: Vec<DownstreamKey> = self
            .downstream_waits
            .keys()
            .filter_map(Result::ok)
            .filter(|key| key.pool == pool)
            .collect();
        for key in peers {
            // Gone already if removed meanwhile; nothing else to do.
            let _ = self.downstream_waits.remove(&key);
        }
        Ok(())
    }

    /// Attaches the `pthread_mutex_lock` probes to process `pid`, in the libc that
    /// process maps (a path inside its mount namespace, reached through its root).
    pub fn attach_mutex_probes(
        &mut self,
        pid: u32,
        libc: &Path,
    ) -> Result<Vec<UProbeLinkId>, KernelError> {
        let scope = NonZeroU32::new(pid).map_or(UProbeScope::AllProcesses, UProbeScope::OneProcess);
        let target = Path::new("/proc")
            .join(pid.to_string())
            .join("root")
            .join(libc.strip_prefix("/").unwrap_or(libc));
        let mut links = Vec::new();
        for (program, probe) in MUTEX_PROBES {
            let attached = typed_program::<UProbe>(&mut self.ebpf, program).and_then(|uprobe| {
                uprobe
                    .attach(MUTEX_SYMBOL, &target, scope)
                    .map_err(|source| KernelError::Attach {
                        program,
                        probe: format!("{probe} in {}", target.display()),
                        source,
                    })
            });
            match attached {
                Ok(link) => links.push(link),
                Err(error) => {
                    self.detach_mutex_probes(links);
                    return Err(error);
                }
            }
        }
        Ok(links)
    }

    /// Detaches what [`Kernel::attach_mutex_probes`] attached.
    pub fn detach_mutex_probes(&mut self, links: Vec<UProbeLinkId>) {
        for ((program, _), link) in MUTEX_PROBES.iter().zip(links) {
            let uprobe: Option<&mut UProbe> = self
                .ebpf
                .program_mut(program)
                .and_then(|program| program.try_into().ok());
            if let Some(uprobe) = uprobe
                && let Err(error) = uprobe.detach(link)
            {
                tracing::warn!(%error, program, "detaching a lock probe failed");
            }
        }
    }

    /// Starts a new stack epoch. Returns the generation to drain: the one of two
    /// epochs back, to which nothing can be added any more (see `stacks.rs` of
    /// the kernel side).
    pub fn advance_stack_epoch(&mut self) -> Result<u32, KernelError> {
        let next = self.epoch.wrapping_add(1);
        self.stack_epoch
            .set(0, next, 0)
            .map_err(|source| KernelError::Map {
                map: maps::STACK_EPOCH,
                source,
            })?;
        self.epoch = next;
        Ok((next + 1) % STACK_GENERATIONS)
    }

    /// The stack counts of `generation`.
    pub fn stack_counts(&self, generation: u32) -> Vec<(StackKey, StackCount)> {
        self.stack_counts
            .iter()
            .filter_map(Result::ok)
            .filter(|(key, _)| key.generation == generation)
            .collect()
    }

    /// The frames (innermost first) of stack `id` of `generation`.
    pub fn stack(&self, generation: u32, id: i32) -> Option<Vec<u64>> {
        addresses(self.stacks.get(generation as usize)?, id)
    }

    /// Empties `generation` (its counts and its stack map) for reuse.
    pub fn clear_stacks(&mut self, generation: u32, counted: &[StackKey]) {
        for key in counted {
            // Gone already only if someone else cleared it; nothing to do then.
            let _ = self.stack_counts.remove(key);
        }
        if let Some(map) = self.stacks.get_mut(generation as usize) {
            let ids: Vec<u32> = map.stack_ids().filter_map(Result::ok).collect();
            for id in ids {
                let _ = map.remove(&id);
            }
        }
    }

    /// Starts `session` in `slot`: the kernel counts its off-CPU blocks at once and,
    /// with `hz`, the slot's sampler ticks on every CPU at that rate.
    pub fn start_profile(
        &mut self,
        slot: u32,
        session: ProfileSession,
        hz: Option<u32>,
    ) -> Result<(), KernelError> {
        let name = session_sampler(slot)?;
        self.set_profile_session(slot, session)?;
        if let Some(hz) = hz {
            let attached = typed_program::<PerfEvent>(&mut self.ebpf, name)
                .and_then(|program| attach_cpu_clock(program, name, hz));
            match attached {
                Ok(links) => self.session_links[slot as usize] = links,
                Err(error) => {
                    self.set_profile_session(slot, ProfileSession::default())?;
                    return Err(error);
                }
            }
        }
        Ok(())
    }

    /// Ends the session in `slot`: its perf events are closed and the slot freed.
    /// Returns the session as the kernel last saw it (with its first sample time).
    pub fn stop_profile(&mut self, slot: u32) -> Result<ProfileSession, KernelError> {
        let name = session_sampler(slot)?;
        let links = std::mem::take(&mut self.session_links[slot as usize]);
        if !links.is_empty() {
            detach_all(typed_program::<PerfEvent>(&mut self.ebpf, name)?, links);
        }
        let session = self
            .profile_sessions
            .get(&slot, 0)
            .map_err(|source| KernelError::Map {
                map: maps::PROFILE_SESSIONS,
                source,
            })?;
        self.set_profile_session(slot, ProfileSession::default())?;
        Ok(session)
    }

    fn set_profile_session(
        &mut self,
        slot: u32,
        session: ProfileSession,
    ) -> Result<(), KernelError> {
        self.profile_sessions
            .set(slot, session, 0)
            .map_err(|source| KernelError::Map {
                map: maps::PROFILE_SESSIONS,
                source,
            })
    }

    /// Every entry of `LOCKS`: the futex waits per (process, address, stack).
    pub fn locks(&self) -> Vec<(LockKey, Histogram)> {
        self.locks.iter().filter_map(Result::ok).collect()
    }

    /// The user stack (return addresses, innermost first) of a `LOCKS` key.
    pub fn lock_stack(&self, id: i32) -> Option<Vec<u64>> {
        addresses(&self.lock_stacks, id)
    }

    /// Removes the lock entries of a process no longer watched. Its stacks stay in
    /// `LOCK_STACKS` (shared by identical stacks; that map is a cache that evicts
    /// nothing, and a full bucket is counted).
    pub fn forget_locks(&mut self, pid: u32) {
        let keys: Vec<LockKey> = self
            .locks
            .keys()
            .filter_map(Result::ok)
            .filter(|key| key.tgid == pid)
            .collect();
        for key in keys {
            // Gone already if the map was cleared meanwhile; nothing else to do.
            let _ = self.locks.remove(&key);
        }
    }

    /// Reads the stats of `pools` and then every followed thread (in that order:
    /// the kernel updates a thread before its pool, so a transition between the two
    /// reads is missed once, never counted twice).
    pub fn read_pools(&self, pools: &[u32], readout: &mut Readout) -> Result<(), KernelError> {
        for &pool in pools {
            let per_cpu = self
                .pool_stats
                .get(&pool, 0)
                .map_err(|source| KernelError::Map {
                    map: maps::POOL_STATS,
                    source,
                })?;
            let mut total = PoolStats::default();
            for cpu in per_cpu.iter() {
                total.add(cpu);
            }
            readout.pools.insert(pool, total);
            let mut waits = [Histogram::default(); LockPrimitive::COUNT as usize];
            for (primitive, histogram) in LockPrimitive::ALL.iter().zip(&mut waits) {
                *histogram = self
                    .lock_waits
                    .get(&lock_wait_index(pool, *primitive), 0)
                    .map_err(|source| KernelError::Map {
                        map: maps::LOCK_WAITS,
                        source,
                    })?;
            }
            readout.lock_waits.insert(pool, waits);
        }
        readout.downstreams = self
            .downstream_waits
            .iter()
            .filter_map(Result::ok)
            .collect();
        readout.threads_read_ns = crate::clock::monotonic_ns();
        readout.threads = self
            .thread_entries()
            .into_iter()
            .map(|(tid, thread)| (tid, thread, self.thread_pools.get(&tid, 0).ok()))
            .collect();
        Ok(())
    }

    /// Zeroes the counters of a service id, and drops its connections, before the id
    /// is reused for another service.
    pub fn reset_service(&mut self, service: u32) -> Result<(), MapError> {
        // Its connections may outlive its watch (a reload unwatched a process that
        // still serves them): left here, their events would count under whichever
        // service gets the id next.
        // The socket backend's connections live in their sockets, out of our reach:
        // a new epoch makes the kernel drop them at their next event.
        drop_service_connections(&mut self.conns, service);
        drop_service_connections(&mut self.adopt, service);
        let epoch = self.service_epochs.get(&service, 0)?;
        self.service_epochs.set(service, epoch.wrapping_add(1), 0)?;
        let zero_counters = PerCpuValues::try_from(vec![ServiceCounters::default(); self.cpus])?;
        self.service_counters.set(service, zero_counters, 0)?;
        let zero_times = PerCpuValues::try_from(vec![RequestTimes::default(); self.cpus])?;
        self.request_times.set(service, zero_times, 0)?;
        for slot in SyscallSlot::ALL {
            let zeros = PerCpuValues::try_from(vec![0u64; self.cpus])?;
            self.syscall_counts
                .set(syscall_counter_index(service, slot), zeros, 0)?;
        }
        Ok(())
    }

    /// The connection and request counters of `services`, summed over CPUs.
    pub fn read_services(
        &self,
        services: &[u32],
    ) -> Result<BTreeMap<u32, ServiceCounters>, KernelError> {
        services
            .iter()
            .map(|&service| {
                let per_cpu =
                    self.service_counters
                        .get(&service, 0)
                        .map_err(|source| KernelError::Map {
                            map: maps::SERVICE_COUNTERS,
                            source,
                        })?;
                let total = per_cpu
                    .iter()
                    .fold(ServiceCounters::default(), |sum, c| sum.plus(c));
                Ok((service, total))
            })
            .collect()
    }

    /// Reads the counters of `services` and `pools` and the exporter's own
    /// kernel-side health.
    pub fn read(&self, services: &[u32], pools: &[u32]) -> Result<Readout, KernelError> {
        let map_error = |map| move |source| KernelError::Map { map, source };
        let mut readout = Readout {
            watched: self
                .watched_pids()
                .into_iter()
                .map(|(pid, watch)| (pid, watch.since_ns))
                .collect(),
            ..Readout::default()
        };
        readout.services = self.read_services(services)?;
        for &service in services {
            let per_cpu = self
                .request_times
                .get(&service, 0)
                .map_err(map_error(maps::REQUEST_TIMES))?;
            let mut times = RequestTimes::default();
            for cpu in per_cpu.iter() {
                times.queue.add(&cpu.queue);
                times.duration.add(&cpu.duration);
                times.latency.add(&cpu.latency);
            }
            readout.request_times.insert(service, times);
            if self.backend != Backend::Syscall {
                continue;
            }
            for slot in SyscallSlot::ALL {
                let calls: u64 = self
                    .syscall_counts
                    .get(&syscall_counter_index(service, slot), 0)
                    .map_err(map_error(maps::SYSCALL_COUNTS))?
                    .iter()
                    .sum();
                readout.syscalls.insert((service, slot.name()), calls);
            }
        }
        self.read_pools(pools, &mut readout)?;
        readout.losses = self.losses()?;
        let fill = |name: &'static str, entries: usize| MapFill {
            name,
            entries: entries as u64,
            capacity: self.capacity(name),
        };
        readout.maps = vec![
            fill(maps::WATCHED, readout.watched.len()),
            match self.backend {
                Backend::Syscall => {
                    fill(maps::CONNS, self.conns.keys().filter(Result::is_ok).count())
                }
                Backend::Socket => fill(maps::SOCK_CONNS, self.sock_conn_entries()?),
            },
            fill(
                maps::PENDING_CALLS,
                self.pending_calls.keys().filter(Result::is_ok).count(),
            ),
            fill(maps::THREADS, readout.threads.len()),
            fill(maps::LOCKS, self.locks.keys().filter(Result::is_ok).count()),
            fill(maps::DOWNSTREAM_WAITS, readout.downstreams.len()),
            fill(
                maps::STACK_COUNTS,
                self.stack_counts.keys().filter(Result::is_ok).count(),
            ),
            fill(
                maps::MUTEX_CALLS,
                self.mutex_calls.keys().filter(Result::is_ok).count(),
            ),
            fill(
                maps::PROFILE_SESSIONS,
                self.profile_sessions
                    .iter()
                    .filter(|session| session.as_ref().is_ok_and(|s| s.active != 0))
                    .count(),
            ),
            fill(
                maps::LISTEN_PORTS,
                self.listen_ports.keys().filter(Result::is_ok).count(),
            ),
            fill(maps::ADOPT, self.adopt.keys().filter(Result::is_ok).count()),
        ];
        for (name, program) in self.ebpf.programs() {
            if let Ok(info) = program.info() {
                readout.programs.push(ProgramStats {
                    name: name.to_owned(),
                    run_time: info.run_time(),
                    runs: info.run_count(),
                });
            }
        }
        Ok(readout)
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
