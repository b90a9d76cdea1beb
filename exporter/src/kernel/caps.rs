//! Least privilege at run time: once the kernel programs are loaded and attached,
//! poolscope keeps only the capabilities it still uses and drops the rest from its
//! effective, permitted and inheritable sets for good (under the systemd unit there
//! is nothing to drop). Started as root (a container,
//! a shell), it then runs with what the systemd unit grants and nothing more.
use std::fmt;

/// What each kept capability is still used for after the start.
pub const KEPT: [(u32, &str); 4] = [
    // bpf() on maps (needed on kernels before 6.5 whatever the fd), and the
    // on-demand uprobes and profiling sessions.
    (CAP_BPF, "CAP_BPF"),
    // perf_event_open for the lock uprobes and profiling sessions.
    (CAP_PERFMON, "CAP_PERFMON"),
    // /proc/<pid>/fdinfo, maps and root of other users' processes, and their
    // environment's memory.
    (CAP_SYS_PTRACE, "CAP_SYS_PTRACE"),
    // /proc/<pid>/map_files, for the symbolizer.
    (CAP_CHECKPOINT_RESTORE, "CAP_CHECKPOINT_RESTORE"),
];

/// Kept if held: kernel frames are symbolized from /proc/kallsyms at every snapshot.
pub const OPTIONAL: [(u32, &str); 1] = [(CAP_SYSLOG, "CAP_SYSLOG")];

/// Kept if held and `probes.lock_uprobes` names a service: the kernel refuses uprobe
/// perf events to `CAP_PERFMON` alone, and they are attached as processes appear.
pub const FOR_LOCK_UPROBES: (u32, &str) = (CAP_SYS_ADMIN, "CAP_SYS_ADMIN");

const CAP_SYS_PTRACE: u32 = 19;
const CAP_SYS_ADMIN: u32 = 21;
const CAP_SYSLOG: u32 = 34;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;
const CAP_CHECKPOINT_RESTORE: u32 = 40;

/// `_LINUX_CAPABILITY_VERSION_3` of linux/capability.h: two 32-bit words per set.
const CAPABILITY_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// The three sets, 64 bits each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sets {
    pub effective: u64,
    pub permitted: u64,
    pub inheritable: u64,
}

#[derive(Debug, thiserror::Error)]
#[error("{call} failed: {source}")]
pub struct CapsError {
    call: &'static str,
    source: std::io::Error,
}

/// The mask of the capabilities kept: [`KEPT`], [`OPTIONAL`], and
/// [`FOR_LOCK_UPROBES`] if `lock_uprobes`.
pub fn kept_mask(lock_uprobes: bool) -> u64 {
    let wanted = KEPT
        .iter()
        .chain(&OPTIONAL)
        .chain(lock_uprobes.then_some(&FOR_LOCK_UPROBES));
    wanted.fold(0, |mask, (cap, _)| mask | (1 << cap))
}

/// Names of the capabilities in `mask` (numbers for those we do not name).
pub struct Names(pub u64);

impl fmt::Display for Names {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for bit in (0..64).filter(|bit| self.0 & (1 << bit) != 0) {
            if !first {
                f.write_str(",")?;
            }
            first = false;
            let named = KEPT.iter().chain(&OPTIONAL).chain([&FOR_LOCK_UPROBES]);
            match named.into_iter().find(|(cap, _)| *cap == bit) {
                Some((_, name)) => f.write_str(name)?,
                None => write!(f, "{bit}")?,
            }
        }
        if first {
            f.write_str("none")?;
        }
        Ok(())
    }
}

fn get() -> Result<Sets, CapsError> {
    let mut header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget(2) with a version-3 header and room for its two data words.
    let result = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    if result != 0 {
        return Err(CapsError {
            call: "capget",
            source: std::io::Error::last_os_error(),
        });
    }
    let join = |field: fn(&CapData) -> u32| {
        u64::from(field(&data[0])) | (u64::from(field(&data[1])) << 32)
    };
    Ok(Sets {
        effective: join(|d| d.effective),
        permitted: join(|d| d.permitted),
        inheritable: join(|d| d.inheritable),
    })
}

fn set(sets: Sets) -> Result<(), CapsError> {
    let mut header = CapHeader {
        version: CAPABILITY_VERSION_3,
        pid: 0,
    };
    let split = |mask: u64| (mask as u32, (mask >> 32) as u32);
    let (effective, permitted, inheritable) = (
        split(sets.effective),
        split(sets.permitted),
        split(sets.inheritable),
    );
    let data = [
        CapData {
            effective: effective.0,
            permitted: permitted.0,
            inheritable: inheritable.0,
        },
        CapData {
            effective: effective.1,
            permitted: permitted.1,
            inheritable: inheritable.1,
        },
    ];
    // SAFETY: capset(2) on this thread with a version-3 header and two data words.
    let result = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    if result != 0 {
        return Err(CapsError {
            call: "capset",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Drops every capability but [`kept_mask`]'s from the calling thread; returns the
/// sets before and after. Threads started later inherit the reduced sets, so this
/// runs before any other thread starts (see `run`).
pub fn drop_unneeded(lock_uprobes: bool) -> Result<(Sets, Sets), CapsError> {
    let before = get()?;
    let keep = kept_mask(lock_uprobes);
    let after = Sets {
        effective: before.effective & keep,
        permitted: before.permitted & keep,
        // Lowering it would clear the ambient set, which the unit grants on purpose
        // (and nothing is exec'd); only what is not kept goes.
        inheritable: before.inheritable & keep,
    };
    if after != before {
        set(after)?;
    }
    Ok((before, get()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kept_set_is_named() {
        assert_eq!(
            Names(kept_mask(false)).to_string(),
            "CAP_SYS_PTRACE,CAP_SYSLOG,CAP_PERFMON,CAP_BPF,CAP_CHECKPOINT_RESTORE"
        );
        assert_eq!(
            kept_mask(true) & !kept_mask(false),
            1 << CAP_SYS_ADMIN,
            "lock uprobes keep CAP_SYS_ADMIN"
        );
        assert_eq!(Names(1 << 12 | 1 << 39).to_string(), "12,CAP_BPF");
        assert_eq!(Names(0).to_string(), "none");
    }
}
