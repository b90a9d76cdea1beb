//! The kernel's own count of a tracepoint's hits that match a filter, on every CPU:
//! one counting perf event per CPU (`perf_event_open` of the tracepoint, with the
//! tracefs filter set by `PERF_EVENT_IOC_SET_FILTER`), read and summed. No buffer,
//! so nothing is lost however many hits there are. The tests use it as a truth that
//! does not come from poolscope: the reads that returned nothing
//! (`sock_recv_length` with `ret <= 0`), which run poolscope's programs but carry
//! no bytes and depend on timing.
use std::{
    ffi::CString,
    fs::File,
    io::Read as _,
    os::fd::{FromRawFd as _, OwnedFd},
    path::Path,
};

use anyhow::{Context as _, bail};

const TRACEFS: &str = "/sys/kernel/tracing";
const PERF_TYPE_TRACEPOINT: u32 = 2;
/// `_IO('$', 0)` and `_IOW('$', 6, char *)` of linux/perf_event.h.
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400;
const PERF_EVENT_IOC_SET_FILTER: libc::c_ulong = 0x4008_2406;
/// `PERF_FLAG_FD_CLOEXEC`, of perf_event_open's flags.
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;
/// `perf_event_attr.disabled`, the first bit of its flags word.
const ATTR_DISABLED: u64 = 1;

/// The first version of `struct perf_event_attr` (`PERF_ATTR_SIZE_VER0`, 64 bytes):
/// every field a counting tracepoint event needs; the kernel takes the size given.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}
const _: () = assert!(size_of::<PerfEventAttr>() == 64);

/// Counts the hits of one tracepoint that pass a filter, on every online CPU, from
/// [`TracepointCount::open`] on, until dropped.
pub struct TracepointCount {
    per_cpu: Vec<File>,
}

impl TracepointCount {
    /// Counts the hits of `system:event` (`sock:sock_recv_length`) for which
    /// `filter`, in the tracefs filter syntax over the event's fields (`ret <= 0`),
    /// holds. Mounts tracefs where it is not (the event's id is read there).
    pub fn open(system: &str, event: &str, filter: &str) -> anyhow::Result<Self> {
        let id = event_id(system, event)?;
        let filter = CString::new(filter).context("a filter with a NUL byte")?;
        let cpus = online_cpus()?;
        let per_cpu = cpus
            .into_iter()
            .map(|cpu| open_counter(id, cpu, &filter))
            .collect::<anyhow::Result<Vec<_>>>()
            .with_context(|| format!("counting {system}:{event} if {filter:?}"))?;
        Ok(Self { per_cpu })
    }

    /// The hits counted so far, over every CPU.
    pub fn read(&self) -> anyhow::Result<u64> {
        self.per_cpu.iter().try_fold(0u64, |total, mut counter| {
            let mut value = [0u8; 8];
            counter
                .read_exact(&mut value)
                .context("reading a perf counter")?;
            Ok(total + u64::from_ne_bytes(value))
        })
    }
}

/// The id of tracepoint `system:event`, from tracefs (mounted first where it is not).
fn event_id(system: &str, event: &str) -> anyhow::Result<u64> {
    let events = Path::new(TRACEFS).join("events");
    if !events.exists() {
        let status = std::process::Command::new("mount")
            .args(["-t", "tracefs", "nodev", TRACEFS])
            .status()
            .context("running mount")?;
        if !status.success() {
            bail!("mounting tracefs at {TRACEFS}: mount {status}");
        }
    }
    let path = events.join(system).join(event).join("id");
    let id =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    id.trim()
        .parse()
        .with_context(|| format!("{}: not an id: {id:?}", path.display()))
}

/// The online CPUs, from `/sys/devices/system/cpu/online`.
fn online_cpus() -> anyhow::Result<Vec<i32>> {
    let path = "/sys/devices/system/cpu/online";
    let list = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    cpu_list(&list).with_context(|| format!("{path}: {list:?}"))
}

/// The CPUs of a kernel CPU list (`0-1`, `0,2-3`).
fn cpu_list(list: &str) -> anyhow::Result<Vec<i32>> {
    let mut cpus = Vec::new();
    for range in list.trim().split(',') {
        let (first, last) = range.split_once('-').unwrap_or((range, range));
        let (first, last): (i32, i32) = (first.parse()?, last.parse()?);
        cpus.extend(first..=last);
    }
    Ok(cpus)
}

/// A counting event of tracepoint `id` on `cpu` (every process), filtered, enabled.
fn open_counter(id: u64, cpu: i32, filter: &CString) -> anyhow::Result<File> {
    let attr = PerfEventAttr {
        kind: PERF_TYPE_TRACEPOINT,
        size: size_of::<PerfEventAttr>() as u32,
        config: id,
        flags: ATTR_DISABLED,
        ..PerfEventAttr::default()
    };
    // SAFETY: `attr` is a valid perf_event_attr of the size it gives; pid -1 with a
    // CPU counts every process on it.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &raw const attr,
            -1,
            cpu,
            -1,
            PERF_FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        bail!(
            "perf_event_open on CPU {cpu}: {}",
            std::io::Error::last_os_error()
        );
    }
    // SAFETY: a descriptor the kernel just returned, owned by nothing else.
    let counter = File::from(unsafe { OwnedFd::from_raw_fd(fd as i32) });
    ioctl(
        &counter,
        PERF_EVENT_IOC_SET_FILTER,
        filter.as_ptr() as usize,
    )
    .context("setting the filter")?;
    ioctl(&counter, PERF_EVENT_IOC_ENABLE, 0).context("enabling")?;
    Ok(counter)
}

fn ioctl(counter: &File, request: libc::c_ulong, argument: usize) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd as _;
    // SAFETY: a perf event's descriptor and a request it takes, with its argument.
    if unsafe { libc::ioctl(counter.as_raw_fd(), request, argument) } != 0 {
        bail!("ioctl {request:#x}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::cpu_list;

    #[test]
    fn cpu_lists_are_ranges_and_single_cpus() -> anyhow::Result<()> {
        assert_eq!(cpu_list("0-1\n")?, [0, 1]);
        assert_eq!(cpu_list("0,2-3")?, [0, 2, 3]);
        assert_eq!(cpu_list("5")?, [5]);
        assert!(cpu_list("0-x").is_err());
        Ok(())
    }
}
