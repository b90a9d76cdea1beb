//! Loading and attaching the programs: which tracepoints each backend and the
//! thread states need, whether this kernel has them, and each probe's outcome
//! ([`Probe`]: attached, loaded for later, or skipped with its reason and the
//! verifier's last words), never fatal for one probe.
use aya::{
    Btf, Ebpf,
    programs::{
        BtfTracePoint, FExit, PerfEvent, ProgramError, RawTracePoint,
        perf_event::{
            PerfEventConfig, PerfEventLinkId, PerfEventScope, SamplePolicy, SoftwareEvent,
        },
    },
};
use poolscope_shared::MAX_PROFILE_SESSIONS;

use super::{KernelError, btf, offsets::vmlinux_btf};

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum TracepointKind {
    /// A raw tracepoint (`category` is then only part of the probe's name).
    Raw,
    /// A raw tracepoint typed by the kernel's BTF: its pointer arguments can be read
    /// directly (`tp_btf`).
    Btf,
}

/// Where each program is attached at start. A probe the kernel cannot take (no such
/// tracepoint, no BTF, the verifier refuses the program) is skipped, logged and
/// exported as `probe_skipped`; the rest still measure.
pub(super) struct Attachment {
    pub(super) program: &'static str,
    category: &'static str,
    event: &'static str,
    kind: TracepointKind,
    /// The program reads `task_struct` at an offset that only the kernel's BTF gives.
    needs_btf: bool,
}

pub(super) const fn raw_tracepoint(
    program: &'static str,
    category: &'static str,
    event: &'static str,
) -> Attachment {
    Attachment {
        program,
        category,
        event,
        kind: TracepointKind::Raw,
        needs_btf: false,
    }
}

pub(super) const fn btf_tracepoint(
    program: &'static str,
    category: &'static str,
    event: &'static str,
) -> Attachment {
    Attachment {
        program,
        category,
        event,
        kind: TracepointKind::Btf,
        needs_btf: false,
    }
}

impl Attachment {
    const fn reading_task_struct(self) -> Self {
        Self {
            needs_btf: true,
            ..self
        }
    }

    fn probe_name(&self) -> String {
        format!("{}/{}", self.category, self.event)
    }
}

/// Whether this kernel has the tracepoint: a BTF one where the kernel's BTF names it
/// (`btf_trace_<event>`); the raw syscall tracepoints are taken as present, as every
/// kernel poolscope can load on has them.
fn tracepoint_exists(vmlinux: Option<&[u8]>, attachment: &Attachment) -> bool {
    match attachment.kind {
        TracepointKind::Raw => true,
        TracepointKind::Btf => {
            vmlinux.is_some_and(|vmlinux| btf::tracepoint_args(vmlinux, attachment.event).is_ok())
        }
    }
}

/// The program that times run-queue waits from their wakeups.
pub(super) const WAKEUP_PROGRAM: &str = "sched_wakeup";

/// Process lifecycle: attached with either backend.
pub(super) const PROCESS_ATTACHMENTS: [Attachment; 3] = [
    btf_tracepoint("process_fork", "task", "task_newtask").reading_task_struct(),
    btf_tracepoint("process_exec", "sched", "sched_process_exec").reading_task_struct(),
    btf_tracepoint("process_exit", "sched", "sched_process_exit"),
];

/// Thread states: attached with either backend (`sched_wakeup` only where the kernel
/// does not count run-queue waits itself, see `sched.rs`).
pub(super) const THREAD_ATTACHMENTS: [Attachment; 3] = [
    btf_tracepoint("sched_switch", "sched", "sched_switch").reading_task_struct(),
    btf_tracepoint(WAKEUP_PROGRAM, "sched", "sched_wakeup").reading_task_struct(),
    btf_tracepoint("process_rename", "task", "task_rename").reading_task_struct(),
];

pub(super) const SOCKET_ATTACHMENTS: [Attachment; 4] = [
    btf_tracepoint("sock_state", "sock", "inet_sock_set_state"),
    btf_tracepoint("sock_data_ready", "sock", "sk_data_ready"),
    btf_tracepoint("sock_recv", "sock", "sock_recv_length"),
    btf_tracepoint("sock_send", "sock", "sock_send_length"),
];

/// The tcp backend (`tcp.rs`): the socket backend's handshakes and closes, and
/// arrivals, reads and transmits from hooks older kernels have.
pub(super) const TCP_ATTACHMENTS: [Attachment; 4] = [
    btf_tracepoint("sock_state", "sock", "inet_sock_set_state"),
    btf_tracepoint("tcp_segment_received", "tcp", "tcp_probe"),
    btf_tracepoint("tcp_read", "tcp", "tcp_rcv_space_adjust"),
    btf_tracepoint("tcp_transmit", "net", "net_dev_queue"),
];

/// The tcp backend's HTTP/2 programs (`tcp_h2.rs`): (program, kernel function), each
/// at the function's return.
pub(super) const TCP_HTTP2_PROGRAMS: [(&str, &str); 2] = [
    ("tcp_h2_read", "tcp_recvmsg"),
    ("tcp_h2_write", "tcp_sendmsg"),
];

pub(super) const SYSCALL_ATTACHMENTS: [Attachment; 2] = [
    raw_tracepoint("sys_enter", "raw_syscalls", "sys_enter"),
    raw_tracepoint("sys_exit", "raw_syscalls", "sys_exit"),
];

/// The opt-in lock probes: (program, probe name) of the entry and the return of
/// `pthread_mutex_lock`, attached per process.
pub(super) const MUTEX_PROBES: [(&str, &str); 2] = [
    ("mutex_lock_enter", "uprobe/pthread_mutex_lock"),
    ("mutex_lock_return", "uretprobe/pthread_mutex_lock"),
];
pub(super) const MUTEX_SYMBOL: &str = "pthread_mutex_lock";

/// The request backend in use (DESIGN §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Socket,
    Tcp,
    Syscall,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Self::Socket => "socket",
            Self::Tcp => "tcp",
            Self::Syscall => "syscall",
        }
    }

    pub(super) fn attachments(self) -> &'static [Attachment] {
        match self {
            Self::Socket => &SOCKET_ATTACHMENTS,
            Self::Tcp => &TCP_ATTACHMENTS,
            Self::Syscall => &SYSCALL_ATTACHMENTS,
        }
    }

    /// Whether a connection's state lives in its socket (`SOCK_CONNS`), as the socket
    /// and tcp backends keep it, rather than under (tgid, fd) in `CONNS`.
    pub fn keeps_state_in_sockets(self) -> bool {
        match self {
            Self::Socket | Self::Tcp => true,
            Self::Syscall => false,
        }
    }

    /// The tracepoints of the backend this kernel lacks (`category/event`), as its
    /// BTF lists them (all of the BTF ones where it has none).
    pub fn missing_tracepoints(self) -> Vec<String> {
        let vmlinux = vmlinux_btf();
        self.attachments()
            .iter()
            .filter(|attachment| !tracepoint_exists(vmlinux.as_deref(), attachment))
            .map(Attachment::probe_name)
            .collect()
    }
}

/// Why a probe does not measure (`poolscope_probe_skipped{reason}`), found at start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    /// Turned off by the configuration.
    Off,
    /// This kernel has no such tracepoint.
    TracepointAbsent,
    /// The program reads kernel structs at offsets only BTF gives; the kernel has none.
    NoBtf,
    /// The kernel refused to load the program: its verifier, or a program type or
    /// helper this kernel lacks.
    LoadRefused,
    /// The program loaded but the kernel refused to attach it.
    AttachRefused,
    /// Its own program attached, but another of its request backend's could not: a
    /// backend counts with all of its probes or not at all.
    BackendIncomplete,
    /// The kernel does not let the tcp backend's HTTP/2 programs run (no fexit, no
    /// `bpf_loop` before 5.17, or no BTF of the functions): HTTP/2 connections are then
    /// refused and counted (`http2_tcp_backend`) when they come, not before.
    NoHttp2Hooks,
}

impl Skip {
    pub fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::TracepointAbsent => "tracepoint_absent",
            Self::NoBtf => "no_btf",
            Self::LoadRefused => "load_refused",
            Self::AttachRefused => "attach_refused",
            Self::BackendIncomplete => "backend_incomplete",
            Self::NoHttp2Hooks => "no_http2_hooks",
        }
    }
}

/// How a probe stands after start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeState {
    Attached,
    /// Loaded, and attached per process (lock probes) or per profiling session.
    OnDemand,
    Skipped(Skip),
}

/// One probe: a program and where it attaches (`category/event`).
#[derive(Clone, Debug)]
pub struct Probe {
    pub name: String,
    pub state: ProbeState,
}

impl Probe {
    /// A probe that does not measure; says why in the log.
    fn skipped(name: String, program: &str, skip: Skip, detail: &dyn std::fmt::Display) -> Self {
        tracing::warn!(
            probe = %name,
            program,
            reason = skip.name(),
            "probe skipped: {}",
            tail(&detail.to_string(), VERIFIER_LOG_TAIL)
        );
        Self {
            name,
            state: ProbeState::Skipped(skip),
        }
    }
}

/// Bytes of a refusal kept in the log: a verifier's log runs to thousands of lines,
/// and its end says what it refused.
pub(super) const VERIFIER_LOG_TAIL: usize = 2000;

/// The last whole lines of `text` within `max` bytes.
pub(super) fn tail(text: &str, max: usize) -> &str {
    let start = text.len().saturating_sub(max);
    if start == 0 {
        return text;
    }
    match text.get(start..).and_then(|end| end.find('\n')) {
        Some(newline) => &text[start + newline + 1..],
        None => text.lines().last().unwrap_or_default(),
    }
}

/// Why loading or attaching a program failed.
pub(super) enum Refusal {
    Load(ProgramError),
    Attach(ProgramError),
}

/// The program sampling every CPU's cpu-clock.
pub(super) const SAMPLER: &str = "cpu_sample";

/// The sampler program of each profiling session slot (`sessions.rs` of the kernel
/// side).
pub(super) const SESSION_SAMPLERS: [&str; MAX_PROFILE_SESSIONS as usize] = [
    "session_sample_0",
    "session_sample_1",
    "session_sample_2",
    "session_sample_3",
    "session_sample_4",
    "session_sample_5",
    "session_sample_6",
    "session_sample_7",
];

/// The sampler program of session `slot`.
pub(super) fn session_sampler(slot: u32) -> Result<&'static str, KernelError> {
    SESSION_SAMPLERS
        .get(slot as usize)
        .copied()
        .ok_or(KernelError::NoSessionSlot(slot))
}

/// Program `name` of our object as its type (`PerfEvent`, `UProbe`, ...); an error
/// means the object is not what this build expects.
pub(super) fn typed_program<'a, P>(
    ebpf: &'a mut Ebpf,
    name: &'static str,
) -> Result<&'a mut P, KernelError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(KernelError::MissingProgram(name))?
        .try_into()
        .map_err(|source| KernelError::Program {
            program: name,
            source,
        })
}

/// Attaches `program` to the cpu-clock of every online CPU, ticking `hz` times a
/// second. On an error, what was attached is detached again.
pub(super) fn attach_cpu_clock(
    program: &mut PerfEvent,
    name: &'static str,
    hz: u32,
) -> Result<Vec<PerfEventLinkId>, KernelError> {
    let cpus = aya::util::online_cpus().map_err(|(_, error)| KernelError::Cpus(error))?;
    // A fixed period of the cpu-clock (ns) rather than a frequency: the kernel
    // then does not retune it, and a thread on CPU for t seconds gets t × hz samples.
    let period_ns = 1_000_000_000 / u64::from(hz.max(1));
    let mut links = Vec::with_capacity(cpus.len());
    for cpu in cpus {
        let attached = program.attach(
            PerfEventConfig::Software(SoftwareEvent::CpuClock),
            PerfEventScope::AllProcessesOneCpu { cpu },
            SamplePolicy::Period(period_ns),
            false,
        );
        match attached {
            Ok(link) => links.push(link),
            Err(source) => {
                detach_all(program, links);
                return Err(KernelError::Attach {
                    program: name,
                    probe: format!("perf_event/cpu-clock of CPU {cpu}"),
                    source,
                });
            }
        }
    }
    Ok(links)
}

pub(super) fn detach_all(program: &mut PerfEvent, links: Vec<PerfEventLinkId>) {
    for link in links {
        if let Err(error) = program.detach(link) {
            tracing::warn!(%error, "detaching a cpu-clock perf event failed");
        }
    }
}

/// Loads the sampler and, unless `hz` is 0, attaches it to the cpu-clock of every
/// online CPU. A kernel that refuses the perf events (a container without them)
/// leaves the probe skipped rather than the exporter down: stacks are a view, not the
/// metrics.
pub(super) fn attach_sampler(ebpf: &mut Ebpf, hz: u32) -> Result<Probe, KernelError> {
    let name = "perf_event/cpu-clock".to_owned();
    let sampler = typed_program::<PerfEvent>(ebpf, SAMPLER)?;
    if let Err(error) = sampler.load() {
        return Ok(Probe::skipped(name, SAMPLER, Skip::LoadRefused, &error));
    }
    if hz == 0 {
        return Ok(Probe::skipped(
            name,
            SAMPLER,
            Skip::Off,
            &"stacks.sampling_hz = 0",
        ));
    }
    Ok(match attach_cpu_clock(sampler, SAMPLER, hz) {
        Ok(_) => Probe {
            name,
            state: ProbeState::Attached,
        },
        Err(error) => Probe::skipped(name, SAMPLER, Skip::AttachRefused, &error),
    })
}

/// Loads the program of `attachment` and attaches it, unless this kernel lacks what
/// it needs. Only a program missing from our own object is an error.
pub(super) fn attach_tracepoint(
    ebpf: &mut Ebpf,
    attachment: &Attachment,
    task_offsets: bool,
    btf: Option<&Btf>,
    vmlinux: Option<&[u8]>,
) -> Result<Probe, KernelError> {
    let name = attachment.probe_name();
    let program_name = attachment.program;
    if attachment.needs_btf && !task_offsets {
        let detail = "the kernel has no BTF (/sys/kernel/btf/vmlinux)";
        return Ok(Probe::skipped(name, program_name, Skip::NoBtf, &detail));
    }
    if !tracepoint_exists(vmlinux, attachment) {
        let detail = format!("no tracepoint {name} in the kernel's BTF");
        return Ok(Probe::skipped(
            name,
            program_name,
            Skip::TracepointAbsent,
            &detail,
        ));
    }
    let outcome = match (attachment.kind, btf) {
        (TracepointKind::Raw, _) => {
            let program: &mut RawTracePoint = typed_program(ebpf, program_name)?;
            program.load().map_err(Refusal::Load).and_then(|()| {
                program
                    .attach(attachment.event)
                    .map(drop)
                    .map_err(Refusal::Attach)
            })
        }
        (TracepointKind::Btf, Some(btf)) => {
            let program: &mut BtfTracePoint = typed_program(ebpf, program_name)?;
            program
                .load(attachment.event, btf)
                .map_err(Refusal::Load)
                .and_then(|()| program.attach().map(drop).map_err(Refusal::Attach))
        }
        (TracepointKind::Btf, None) => {
            let detail = "the kernel has no BTF (/sys/kernel/btf/vmlinux)";
            return Ok(Probe::skipped(name, program_name, Skip::NoBtf, &detail));
        }
    };
    Ok(match outcome {
        Ok(()) => Probe {
            name,
            state: ProbeState::Attached,
        },
        Err(Refusal::Load(error)) => Probe::skipped(name, program_name, Skip::LoadRefused, &error),
        Err(Refusal::Attach(error)) => {
            Probe::skipped(name, program_name, Skip::AttachRefused, &error)
        }
    })
}

/// Attaches the first request backend of `candidates` (in order of preference) whose
/// probes all attach, and says which. A backend counts with all of its probes or not
/// at all: where one of them cannot attach, or `unusable` says why the backend cannot
/// run here (offsets its programs read that the kernel's BTF lacks), those that did
/// are detached again, every one of its probes is kept in `probes` as skipped with the
/// reason in the log, and the next candidate is tried. `None` if none attached.
pub(super) fn attach_backend(
    ebpf: &mut Ebpf,
    candidates: &[Backend],
    unusable: impl Fn(Backend) -> Option<&'static str>,
    task_offsets: bool,
    btf: Option<&Btf>,
    vmlinux: Option<&[u8]>,
    probes: &mut Vec<Probe>,
) -> Result<Option<Backend>, KernelError> {
    for &backend in candidates {
        let attachments = backend.attachments();
        if let Some(reason) = unusable(backend) {
            for attachment in attachments {
                let name = attachment.probe_name();
                probes.push(Probe::skipped(
                    name,
                    attachment.program,
                    Skip::NoBtf,
                    &reason,
                ));
            }
            continue;
        }
        let mut attached = Vec::with_capacity(attachments.len());
        for attachment in attachments {
            attached.push(attach_tracepoint(
                ebpf,
                attachment,
                task_offsets,
                btf,
                vmlinux,
            )?);
        }
        if attached
            .iter()
            .all(|probe| probe.state == ProbeState::Attached)
        {
            probes.extend(attached);
            return Ok(Some(backend));
        }
        tracing::warn!(
            backend = backend.name(),
            "the {} request backend could not attach all of its probes: not used",
            backend.name()
        );
        for (attachment, probe) in attachments.iter().zip(attached) {
            if probe.state != ProbeState::Attached {
                probes.push(probe);
                continue;
            }
            unload(ebpf, attachment)?;
            let detail = format!(
                "another probe of the {} backend was skipped",
                backend.name()
            );
            probes.push(Probe::skipped(
                probe.name,
                attachment.program,
                Skip::BackendIncomplete,
                &detail,
            ));
        }
    }
    Ok(None)
}

/// Loads and attaches the tcp backend's HTTP/2 programs, both or neither: the probes,
/// and whether they attached. `btf` is `None` where the kernel's BTF lacks what they
/// read. A refusal (this host's kernel has no fexit) is a probe skipped, not an error.
pub(super) fn attach_tcp_http2(
    ebpf: &mut Ebpf,
    btf: Option<&Btf>,
) -> Result<(Vec<Probe>, bool), KernelError> {
    let name = |function: &str| format!("fexit/{function}");
    let skip_all = |ebpf: &mut Ebpf, detail: &dyn std::fmt::Display| {
        let mut probes = Vec::new();
        for (program, function) in TCP_HTTP2_PROGRAMS {
            // Unloading a program that did not load is a no-op error: ignored.
            if let Ok(loaded) = typed_program::<FExit>(ebpf, program) {
                let _ = loaded.unload();
            }
            probes.push(Probe::skipped(
                name(function),
                program,
                Skip::NoHttp2Hooks,
                detail,
            ));
        }
        probes
    };
    let Some(btf) = btf else {
        let detail = "the kernel's BTF lacks tcp_recvmsg's arguments (logged)";
        return Ok((skip_all(ebpf, &detail), false));
    };
    for (program, function) in TCP_HTTP2_PROGRAMS {
        let fexit: &mut FExit = typed_program(ebpf, program)?;
        let outcome = fexit
            .load(function, btf)
            .map_err(Refusal::Load)
            .and_then(|()| fexit.attach().map(drop).map_err(Refusal::Attach));
        if let Err(Refusal::Load(error) | Refusal::Attach(error)) = outcome {
            let detail = format!("{program} on {function}: {error}");
            return Ok((skip_all(ebpf, &detail), false));
        }
    }
    let probes = TCP_HTTP2_PROGRAMS
        .iter()
        .map(|&(_, function)| Probe {
            name: name(function),
            state: ProbeState::Attached,
        })
        .collect();
    Ok((probes, true))
}

/// Detaches and unloads the program of `attachment`.
fn unload(ebpf: &mut Ebpf, attachment: &Attachment) -> Result<(), KernelError> {
    let program = attachment.program;
    let unloaded = match attachment.kind {
        TracepointKind::Raw => typed_program::<RawTracePoint>(ebpf, program)?.unload(),
        TracepointKind::Btf => typed_program::<BtfTracePoint>(ebpf, program)?.unload(),
    };
    unloaded.map_err(|source| KernelError::Program { program, source })
}

/// Loads programs that are attached later (per process, per profiling session) as
/// one probe: on demand if all load, else skipped.
pub(super) fn load_on_demand<P>(
    ebpf: &mut Ebpf,
    name: &str,
    programs: &[&'static str],
    load: impl Fn(&mut P) -> Result<(), ProgramError>,
) -> Result<Probe, KernelError>
where
    for<'a> &'a mut P: TryFrom<&'a mut aya::programs::Program, Error = ProgramError>,
{
    for &program_name in programs {
        if let Err(error) = load(typed_program(ebpf, program_name)?) {
            return Ok(Probe::skipped(
                name.to_owned(),
                program_name,
                Skip::LoadRefused,
                &error,
            ));
        }
    }
    Ok(Probe {
        name: name.to_owned(),
        state: ProbeState::OnDemand,
    })
}

#[cfg(test)]
mod tests {
    use super::tail;

    #[test]
    fn a_refusal_is_logged_by_its_last_whole_lines() {
        let log = "0: (b7) r0 = 0\n1: (79) r2 = *(u64 *)(r1 +0)\nR1 unbounded memory access\n";
        assert_eq!(tail(log, 1000), log);
        assert_eq!(tail(log, 30), "R1 unbounded memory access\n");
        assert_eq!(tail("one long line", 4), "one long line");
        assert_eq!(tail("é\nà", 2), "à");
    }
}
