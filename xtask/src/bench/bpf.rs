//! bpf(2) from the bench itself: kernel.bpf_stats_enabled while held, and empty
//! programs on raw tracepoints (what a hook and bpf_stats cost before any work).
use std::{
    fs,
    os::fd::{FromRawFd as _, OwnedFd},
};

use anyhow::Context as _;

/// kernel.bpf_stats_enabled while held: the kernel times every BPF program's runs.
/// Taken with bpf(BPF_ENABLE_STATS), as poolscope's `[probes] bpf_stats` does, rather
/// than through the sysctl: it ends with the descriptor, however this process ends.
pub(super) struct BpfStats {
    /// Held, never used: closing it turns the stats off.
    _fd: OwnedFd,
}

impl BpfStats {
    pub(super) fn enable() -> anyhow::Result<Self> {
        /// `union bpf_attr`'s `enable_stats`: `{ __u32 type; }`, BPF_STATS_RUN_TIME.
        const BPF_STATS_RUN_TIME: u32 = 0;
        let fd = bpf_fd(BPF_ENABLE_STATS, &BPF_STATS_RUN_TIME).context("bpf(BPF_ENABLE_STATS)")?;
        Ok(Self { _fd: fd })
    }
}

/// bpf(2) commands and program type (include/uapi/linux/bpf.h).
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_RAW_TRACEPOINT_OPEN: libc::c_long = 17;
const BPF_ENABLE_STATS: libc::c_long = 32;
const BPF_PROG_TYPE_RAW_TRACEPOINT: u32 = 17;

/// bpf(2) with `attr` (a prefix of `union bpf_attr`; the kernel zeroes the rest): the
/// descriptor it returns.
fn bpf_fd<T>(command: libc::c_long, attr: &T) -> std::io::Result<OwnedFd> {
    // SAFETY: bpf(2) reads `size_of::<T>()` bytes of `attr`, which lives across the
    // call, and follows only the pointers the caller put in it; it returns a new
    // descriptor or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            command,
            std::ptr::from_ref(attr),
            size_of::<T>() as u32,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor the call just opened, owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `union bpf_attr` for BPF_PROG_LOAD, up to `prog_name`.
#[repr(C)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
}

/// `union bpf_attr` for BPF_RAW_TRACEPOINT_OPEN.
#[repr(C)]
struct RawTracepointAttr {
    name: u64,
    prog_fd: u32,
    pad: u32,
}

/// A program that only returns, attached to the raw tracepoint it is named after.
pub(super) struct EmptyProgram {
    pub(super) name: &'static str,
    program: OwnedFd,
    /// Held: the attachment lasts while it is open.
    _link: OwnedFd,
}

impl EmptyProgram {
    pub(super) fn attach(tracepoint: &'static str) -> anyhow::Result<Self> {
        // r0 = 0; exit
        const INSTRUCTIONS: [u64; 2] = [0xb7, 0x95];
        let license = c"GPL";
        let mut prog_name = [0; 16];
        prog_name[..5].copy_from_slice(b"empty");
        let attr = ProgLoadAttr {
            prog_type: BPF_PROG_TYPE_RAW_TRACEPOINT,
            insn_cnt: INSTRUCTIONS.len() as u32,
            insns: INSTRUCTIONS.as_ptr() as u64,
            license: license.as_ptr() as u64,
            log_level: 0,
            log_size: 0,
            log_buf: 0,
            kern_version: 0,
            prog_flags: 0,
            prog_name,
        };
        let program = bpf_fd(BPF_PROG_LOAD, &attr).context("loading an empty program")?;
        let name = std::ffi::CString::new(tracepoint)?;
        let attr = RawTracepointAttr {
            name: name.as_ptr() as u64,
            prog_fd: std::os::fd::AsRawFd::as_raw_fd(&program) as u32,
            pad: 0,
        };
        let link = bpf_fd(BPF_RAW_TRACEPOINT_OPEN, &attr)
            .with_context(|| format!("attaching an empty program to {tracepoint}"))?;
        Ok(Self {
            name: tracepoint,
            program,
            _link: link,
        })
    }

    /// (runs, run ns) so far, from the program's fdinfo.
    pub(super) fn counters(&self) -> anyhow::Result<(f64, f64)> {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&self.program);
        let info = fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))?;
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
                .unwrap_or(f64::NAN)
        };
        Ok((field("run_cnt:"), field("run_time_ns:")))
    }
}
