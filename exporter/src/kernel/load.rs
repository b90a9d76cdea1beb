//! The steps of [`super::Kernel::load`] before its parts take their maps: what the
//! kernel's BTF says of this kernel ([`KernelLayout`]), opening the object with the
//! sizes each part gives its maps and the load-time globals, filling the syscall
//! tables, the run-time stats, and attaching the programs.
use std::os::fd::OwnedFd;

use aya::{
    Btf, Ebpf, EbpfLoader,
    maps::{Array, MapData},
    programs::{PerfEvent, UProbe},
};
use poolscope_shared::{SyscallSlot, maps};

use super::{
    Backend, KernelError, Probe, Sampling,
    attach::{
        MUTEX_PROBES, PROCESS_ATTACHMENTS, SESSION_SAMPLERS, THREAD_ATTACHMENTS, WAKEUP_PROGRAM,
        attach_backend, attach_sampler, attach_tcp_http2, attach_tracepoint, load_on_demand,
    },
    locks::Locks,
    offsets::{
        BTF_VMLINUX, downstream_offsets, exit_has_group_dead, run_delay_offsets,
        socket_inode_offsets, socket_namespace_offsets, socket_offsets, task_pid_offset,
        tcp_http2_arguments, tcp_offsets, vmlinux_btf,
    },
    routes::Routes,
    services::Requests,
    stacks::Stacks,
    syscalls::{syscall_number, wait_classes},
    threads::Pools,
};
use crate::config::Limits;

/// What the kernel's BTF says of this kernel: each `None` where it lacks what is
/// looked for (logged where found missing).
pub(super) struct KernelLayout {
    /// The kernel's BTF, raw.
    vmlinux: Option<Vec<u8>>,
    /// The same parsed for the BTF tracepoints, which read the socket's fields at
    /// their offsets: they load only where those were found, and only then is it
    /// parsed.
    btf: Option<Btf>,
    exit_has_group_dead: bool,
    task_pid_offset: Option<u32>,
    pub socket_namespace: Option<(u32, u32)>,
    pub socket_inode: Option<(u32, u32, u32)>,
    socket: Option<[(&'static str, u32); 6]>,
    tcp: Option<[(&'static str, u32); 10]>,
    /// Where `tcp_h2.rs` finds `tcp_recvmsg`'s flags; `None`: not attached.
    tcp_http2: Option<[(&'static str, u32); 1]>,
    downstream: Option<[(&'static str, u32); 12]>,
    run_delay: Option<[(&'static str, u32); 5]>,
}

impl KernelLayout {
    /// Reads the kernel's BTF and finds in it every offset the programs read.
    pub fn find() -> Self {
        let vmlinux = vmlinux_btf();
        let exit_has_group_dead = vmlinux.as_deref().is_some_and(exit_has_group_dead);
        let task_pid_offset = vmlinux.as_deref().and_then(task_pid_offset);
        let socket_namespace = vmlinux.as_deref().and_then(socket_namespace_offsets);
        let socket_inode = vmlinux.as_deref().and_then(socket_inode_offsets);
        let socket = vmlinux.as_deref().and_then(socket_offsets);
        let tcp = vmlinux.as_deref().and_then(tcp_offsets);
        let tcp_http2 = vmlinux.as_deref().and_then(tcp_http2_arguments);
        let downstream = vmlinux.as_deref().and_then(downstream_offsets);
        let run_delay = vmlinux.as_deref().and_then(run_delay_offsets);
        let btf = match socket {
            Some(_) => Btf::from_sys_fs()
                .map_err(|error| tracing::warn!(%error, "cannot parse {BTF_VMLINUX}"))
                .ok(),
            None => None,
        };
        if !exit_has_group_dead {
            tracing::info!("sched_process_exit has no group_dead: a process ends with its leader");
        }
        Self {
            vmlinux,
            btf,
            exit_has_group_dead,
            task_pid_offset,
            socket_namespace,
            socket_inode,
            socket,
            tcp,
            tcp_http2,
            downstream,
            run_delay,
        }
    }
}

/// The size of every map a part sizes, as `limits` gives them (the route ring's as
/// `reads` needs it).
fn map_sizes(limits: &Limits, reads: Reads) -> impl Iterator<Item = (&'static str, u32)> {
    (Requests::sizes(limits).into_iter())
        .chain(Pools::sizes(limits))
        .chain(Locks::sizes(limits))
        .chain(Stacks::sizes(limits))
        .chain(Routes::sizes(limits, reads.routes))
}

/// What the request programs read of each request's bytes (`[probes]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reads {
    /// The status line of each answer.
    pub response_status: bool,
    /// The first bytes of each request, for its route: whether any service's may be
    /// read, and whether a service's are when no rule says.
    pub routes: bool,
    pub routes_by_default: bool,
}

/// Loads the object with its maps sized by `limits` (as each part sizes its own)
/// and its load-time globals set from `layout`, `sampling`, `reads` and the parts'
/// own.
pub(super) fn open(
    limits: &Limits,
    sampling: Sampling,
    reads: Reads,
    layout: &KernelLayout,
) -> Result<Ebpf, KernelError> {
    let (sock_net_offset, net_inum_offset) = layout.socket_namespace.unwrap_or((0, 0));
    let (sock_socket_offset, socket_inode_offset, inode_ino_offset) =
        layout.socket_inode.unwrap_or((0, 0, 0));
    let offcpu_min_ns = sampling.offcpu_min.map_or(u64::MAX, |min| {
        u64::try_from(min.as_nanos()).unwrap_or(u64::MAX - 1)
    });
    let mut loader = EbpfLoader::new();
    for (name, entries) in map_sizes(limits, reads) {
        loader.map_max_entries(name, entries);
    }
    let part_globals: Vec<_> = Pools::globals(limits)
        .into_iter()
        .chain(Stacks::globals(limits))
        .collect();
    for (name, value) in &part_globals {
        loader.override_global(name, value, true);
    }
    // Left at 0 where BTF does not have them all: no peer is looked for, and the
    // socket programs are skipped.
    let globals = (layout.downstream.iter().flatten())
        .chain(layout.socket.iter().flatten())
        .chain(layout.tcp.iter().flatten())
        .chain(layout.tcp_http2.iter().flatten());
    for (name, offset) in globals.chain(layout.run_delay.iter().flatten()) {
        loader.override_global(name, offset, true);
    }
    let ebpf = loader
        .override_global(
            "EXIT_HAS_GROUP_DEAD",
            &u32::from(layout.exit_has_group_dead),
            true,
        )
        .override_global(
            "TASK_PID_OFFSET",
            &layout.task_pid_offset.unwrap_or(0),
            true,
        )
        .override_global("SOCK_NET_OFFSET", &sock_net_offset, true)
        .override_global("NET_INUM_OFFSET", &net_inum_offset, true)
        .override_global("SOCK_SOCKET_OFFSET", &sock_socket_offset, true)
        .override_global("SOCKET_INODE_OFFSET", &socket_inode_offset, true)
        .override_global("INODE_INO_OFFSET", &inode_ino_offset, true)
        .override_global(
            "READ_RESPONSE_STATUS",
            &u32::from(reads.response_status),
            true,
        )
        .override_global("READ_ROUTES", &u32::from(reads.routes), true)
        .override_global("OFFCPU_MIN_NS", &offcpu_min_ns, true)
        .override_global("OFFCPU_IDLE", &u32::from(sampling.offcpu_idle), true)
        .override_global("OFFCPU_FULL_RATE", &sampling.offcpu_full_rate, true)
        .override_global(
            "OFFCPU_SAMPLE_MASK",
            &sampling.offcpu_sample_one_in.saturating_sub(1),
            true,
        )
        .load(aya::include_bytes_aligned!(concat!(
            env!("OUT_DIR"),
            "/poolscope"
        )))?;
    Ok(ebpf)
}

/// Fills `SYSCALL_SLOTS` (syscall number → the slot it is counted in) and
/// `WAIT_CLASSES` (syscall number → what a thread blocked in it waits for), which
/// the programs only read. Both stay in `ebpf`: a program is loaded (at its attach)
/// with the descriptors of the maps it reads, which must still be open then.
pub(super) fn fill_syscall_tables(ebpf: &mut Ebpf) -> Result<(), KernelError> {
    let slots = SyscallSlot::ALL
        .into_iter()
        .filter_map(|slot| Some((syscall_number(slot)? as u32, slot as u32)));
    fill(ebpf, maps::SYSCALL_SLOTS, slots)?;
    let classes = wait_classes()
        .into_iter()
        .map(|(number, class)| (number as u32, class as u32));
    fill(ebpf, maps::WAIT_CLASSES, classes)
}

/// Sets each (index, value) of `entries` in the array `name` of `ebpf`.
fn fill(
    ebpf: &mut Ebpf,
    name: &'static str,
    entries: impl IntoIterator<Item = (u32, u32)>,
) -> Result<(), KernelError> {
    let mut array = table(ebpf, name)?;
    for (index, value) in entries {
        array
            .set(index, value, 0)
            .map_err(|source| KernelError::Map { map: name, source })?;
    }
    Ok(())
}

/// The array `name` of `ebpf`, borrowed where it stays.
fn table<'a>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<Array<&'a mut MapData, u32>, KernelError> {
    let map = ebpf.map_mut(name).ok_or(KernelError::MissingMap(name))?;
    Array::try_from(map).map_err(|source| KernelError::Map { map: name, source })
}

/// Turns `kernel.bpf_stats_enabled` on if `bpf_stats` asks, for as long as the
/// descriptor returned is kept; a refusal is logged and leaves `bpf_run_*` at 0.
pub(super) fn enable_run_time_stats(bpf_stats: bool) -> Option<OwnedFd> {
    if !bpf_stats {
        return None;
    }
    match aya::sys::enable_stats(aya::sys::Stats::RunTime) {
        Ok(fd) => Some(fd),
        Err(error) => {
            tracing::warn!(%error, "cannot enable BPF run-time stats; bpf_run_* will stay 0");
            None
        }
    }
}

/// Attaches the process and thread tracepoints and the first request backend of
/// `backends` that attaches whole; the probes with what became of each, and that
/// backend.
pub(super) fn attach_tracepoints(
    ebpf: &mut Ebpf,
    backends: &[Backend],
    layout: &KernelLayout,
) -> Result<(Vec<Probe>, Backend), KernelError> {
    let task_offsets = layout.task_pid_offset.is_some();
    let vmlinux = layout.vmlinux.as_deref();
    let mut probes = Vec::new();
    for attachment in PROCESS_ATTACHMENTS.iter().chain(&THREAD_ATTACHMENTS) {
        if attachment.program == WAKEUP_PROGRAM && layout.run_delay.is_some() {
            tracing::info!(
                "sched_wakeup not attached: run-queue waits come from the kernel's \
                 sched_info when a thread goes on CPU"
            );
            continue;
        }
        probes.push(attach_tracepoint(
            ebpf,
            attachment,
            task_offsets,
            layout.btf.as_ref(),
            vmlinux,
        )?);
    }
    let backend = attach_backend(
        ebpf,
        backends,
        |backend| {
            (backend == Backend::Tcp && layout.tcp.is_none())
                .then_some("the kernel's BTF lacks what the tcp backend reads (logged)")
        },
        task_offsets,
        layout.btf.as_ref(),
        vmlinux,
        &mut probes,
    )?
    .ok_or_else(|| {
        let names: Vec<_> = backends.iter().map(|backend| backend.name()).collect();
        KernelError::NoBackend(names.join(", "))
    })?;
    if backend == Backend::Tcp {
        let (http2, followed) = attach_tcp_http2(
            ebpf,
            layout.btf.as_ref().filter(|_| layout.tcp_http2.is_some()),
        )?;
        probes.extend(http2);
        if followed {
            fill(ebpf, maps::TCP_HTTP2, [(0, 1)])?;
        }
    }
    Ok((probes, backend))
}

/// Loads the on-CPU sampler (attached at `hz`), and the programs attached later:
/// the lock uprobes (per process) and the session samplers (per profiling session).
pub(super) fn load_samplers_and_uprobes(
    ebpf: &mut Ebpf,
    hz: u32,
) -> Result<Vec<Probe>, KernelError> {
    let mut probes = vec![attach_sampler(ebpf, hz)?];
    for (program, probe) in MUTEX_PROBES {
        probes.push(load_on_demand(ebpf, probe, &[program], UProbe::load)?);
    }
    probes.push(load_on_demand(
        ebpf,
        "perf_event/profile-sessions",
        &SESSION_SAMPLERS,
        PerfEvent::load,
    )?);
    Ok(probes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Limits all different, so that a map sized by the wrong one shows.
    fn distinct_limits() -> Limits {
        Limits {
            watched_processes: 101,
            connections: 102,
            max_services: 103,
            max_pools: 104,
            threads: 105,
            thread_slots: 256,
            locks: 107,
            lock_stacks: 108,
            stacks: 109,
            stack_counts: 110,
            syscalls_in_flight: 111,
            mutex_calls_in_flight: 112,
            listen_ports: 113,
            downstreams: 114,
            routes: 115,
            routes_per_service: 116,
            route_events: 117,
            http2_decoded_connections: 118,
        }
    }

    /// A full map's advice names the limit `Limits::size_of` gives it: the map must
    /// be loaded at that limit's size, and every map a limit names must be loaded.
    #[test]
    fn each_map_a_limit_names_is_loaded_at_that_limits_size() {
        let limits = distinct_limits();
        let reads = Reads {
            response_status: true,
            routes: true,
            routes_by_default: false,
        };
        let sizes: Vec<_> = map_sizes(&limits, reads).collect();
        for &(name, entries) in &sizes {
            // The three stack generations are reported as one map.
            let reported = if maps::STACKS.contains(&name) {
                maps::STACK_MAPS
            } else {
                name
            };
            if let Some(size) = limits.size_of(reported) {
                assert_eq!(entries, size, "{name} is not loaded at its limit's size");
            }
        }
        let named = [
            maps::WATCHED,
            maps::CONNS,
            maps::ADOPT,
            maps::THREADS,
            maps::THREAD_POOLS,
            maps::LOCKS,
            maps::LOCK_STACKS,
            maps::STACK_COUNTS,
            maps::PENDING_CALLS,
            maps::MUTEX_CALLS,
            maps::LISTEN_PORTS,
            maps::DOWNSTREAM_WAITS,
            maps::ROUTE_EVENTS,
        ];
        for name in named
            .into_iter()
            .chain(maps::STACKS)
            .chain(maps::STACK_OVERFLOWS)
        {
            assert!(
                sizes.iter().any(|&(sized, _)| sized == name),
                "{name}: no part sizes it"
            );
        }
        // A ring's size is bytes: a power of two with room for its records.
        let ring = sizes.iter().find(|&&(name, _)| name == maps::ROUTE_EVENTS);
        assert_eq!(ring, Some(&(maps::ROUTE_EVENTS, 32768)));
        // A page while no program reads a route (reading the first takes a restart).
        let unread = Reads {
            routes: false,
            ..reads
        };
        let ring = map_sizes(&limits, unread).find(|&(name, _)| name == maps::ROUTE_EVENTS);
        assert_eq!(ring, Some((maps::ROUTE_EVENTS, 4096)));
    }
}
