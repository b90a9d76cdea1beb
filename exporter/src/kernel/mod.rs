//! The kernel side seen from user space: loads and attaches `poolscope-ebpf`, owns its
//! maps, and offers small typed operations on them (watch a process, purge its
//! connections) plus one read of every counter for a scrape. No numbers are kept here;
//! the maps are the state.
mod attach;
mod batch;
pub mod btf;
pub mod caps;
mod h2_headers;
mod health;
mod load;
mod locks;
mod map_errors;
mod mapping;
mod offsets;
mod read;
mod reread;
mod route_table;
mod routes;
mod services;
mod slots;
mod stacks;
mod syscalls;
mod tables;
mod threads;

use std::{os::fd::OwnedFd, time::Duration};

use aya::{
    Ebpf,
    maps::{MapData, MapError, RingBuf},
    programs::ProgramError,
};
use poolscope_shared::{MAX_PROFILE_SESSIONS, ProcessEvent, maps};

pub use self::attach::{Backend, Probe, ProbeState, Skip};
use self::health::Health;
use self::load::{
    KernelLayout, attach_tracepoints, enable_run_time_stats, fill_syscall_tables,
    load_samplers_and_uprobes, open,
};
use self::locks::Locks;
use self::routes::Routes;
use self::services::Requests;
use self::slots::{Claim, ThreadSlots};
use self::stacks::Stacks;
#[cfg(test)]
pub use self::tables::fake;
use self::threads::Pools;
pub use self::{
    load::Reads,
    map_errors::MapErrors,
    read::{LockWaits, MapFill, ProgramStats, Readout},
    route_table::{RouteCaps, RouteLabel, RouteTable, RouteTotals, grpc_status_label},
    routes::RoutesRead,
    services::{Adopted, ConnectionState, StorageMap},
    tables::{ServedConnection, ThreadTable, WatchTable},
    threads::PoolWaits,
};
use crate::config::Limits;

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
    #[error("starting the thread that drains the route records: {0}")]
    Thread(std::io::Error),
    #[error("duplicating a map's descriptor: {0}")]
    Descriptor(std::io::Error),
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

/// Loaded and attached kernel programs with their maps, one part per family of
/// maps: a map belongs to the part of its family, which takes it out of the loaded
/// object and owns what user space keeps of it.
pub struct Kernel {
    ebpf: Ebpf,
    /// Watched processes, listeners, connections and per-service counters.
    requests: Requests,
    /// Followed threads and their pools' stats and waits.
    pools: Pools,
    /// Futex waits per process, address and stack.
    locks: Locks,
    /// Sampled stacks and profiling sessions.
    stacks: Stacks,
    /// Each service's routes, from the kernel's records of finished requests.
    routes: Routes,
    /// Loss counters and how full the counted maps are.
    health: Health,
    probes: Vec<Probe>,
    limits: Limits,
    backend: Backend,
    /// Keeps `kernel.bpf_stats_enabled` on while we run.
    _stats: Option<OwnedFd>,
    cpus: usize,
}

/// Kernel maps by name with the entries `load` gives each (`EbpfLoader::map_max_entries`).
type MapSizes = Vec<(&'static str, u32)>;

/// Reader of process lifecycle events from the kernel.
pub struct ProcessEvents {
    pub ring: RingBuf<MapData>,
}

/// Takes map `name` out of `ebpf` as a `T`.
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
        reads: Reads,
    ) -> Result<(Self, ProcessEvents), KernelError> {
        let layout = KernelLayout::find();
        let mut ebpf = open(&limits, sampling, reads, &layout)?;
        fill_syscall_tables(&mut ebpf)?;
        let stats = enable_run_time_stats(bpf_stats);
        let (mut probes, backend) = attach_tracepoints(&mut ebpf, backends, &layout)?;
        let (socket_namespaces, socket_inodes) = (
            layout.socket_namespace.is_some(),
            layout.socket_inode.is_some(),
        );
        // The kernel's BTF (megabytes) is not needed past the tracepoints.
        drop(layout);
        probes.extend(load_samplers_and_uprobes(&mut ebpf, sampling.hz)?);
        let events = ProcessEvents {
            ring: take(&mut ebpf, maps::PROCESS_EVENTS)?,
        };
        let requests = Requests::take(
            &mut ebpf,
            limits.max_services,
            socket_namespaces,
            socket_inodes,
        )?;
        let pools = Pools::take(&mut ebpf, &limits)?;
        let locks = Locks::take(&mut ebpf)?;
        let stacks = Stacks::take(&mut ebpf)?;
        let routes = Routes::take(&mut ebpf, &limits, reads)?;
        let health = Health::take(&ebpf)?;
        let kernel = Self {
            ebpf,
            requests,
            pools,
            locks,
            stacks,
            routes,
            health,
            probes,
            limits,
            backend,
            _stats: stats,
            cpus: aya::util::nr_cpus().map_or(1, |n| n.max(1)),
        };
        Ok((kernel, events))
    }

    /// Starts draining the route records on a thread of their own (once
    /// capabilities are dropped: the thread keeps those it is created with).
    pub fn start_route_drain(&self) -> Result<(), KernelError> {
        self.routes.start_draining()
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
        counted.then(|| self.requests.listen_changes()).flatten()
    }
}

impl ProcessEvents {
    /// Decodes one ring-buffer record; `None` for a record of the wrong size.
    pub fn decode(bytes: &[u8]) -> Option<ProcessEvent> {
        decode_record(bytes)
    }
}

/// One ring-buffer record as a `T`; `None` for a record shorter than one.
fn decode_record<T: aya::Pod>(bytes: &[u8]) -> Option<T> {
    if bytes.len() < size_of::<T>() {
        return None;
    }
    // SAFETY: a Pod type is repr(C) of integers, any bit pattern is valid, and
    // read_unaligned does not need alignment.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}
