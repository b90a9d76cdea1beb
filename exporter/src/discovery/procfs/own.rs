//! A process's own resource use as the Prometheus client libraries export it
//! (`process_*`): CPU time, memory, descriptors and start time, from
//! `/proc/<pid>/stat`, `/proc/<pid>/limits`, `/proc/<pid>/fd` and the boot time
//! (`/proc/stat`, or the clocks where a `ProcSubset=pid` sandbox hides it).
use std::{ffi::CString, fs, os::unix::ffi::OsStrExt as _, path::Path};

use crate::clock::clock_ns;

/// One reading of a process's resource use.
#[derive(Clone, Debug, PartialEq)]
pub struct ProcessUse {
    pub cpu_seconds: f64,
    pub resident_bytes: f64,
    pub virtual_bytes: f64,
    /// The `RLIMIT_AS` soft limit; unlimited as the largest u64, as the client
    /// libraries do.
    pub virtual_max_bytes: f64,
    pub open_fds: f64,
    /// The `RLIMIT_NOFILE` soft limit.
    pub max_fds: f64,
    /// Since the Unix epoch.
    pub start_time_seconds: f64,
}

/// The fields of `/proc/<pid>/stat` it takes, in clock ticks and pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatUse {
    pub user_ticks: u64,
    pub system_ticks: u64,
    pub start_ticks: u64,
    pub virtual_bytes: u64,
    pub resident_pages: u64,
}

/// Parses `/proc/<pid>/stat` (fields counted from the last `)`, as the comm may
/// hold anything).
pub fn parse_stat_use(content: &str) -> Option<StatUse> {
    let close = content.rfind(')')?;
    let fields: Vec<&str> = content.get(close + 1..)?.split_ascii_whitespace().collect();
    // Field n (1-based, proc(5)) is at n - 3 after the `)`.
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(StatUse {
        user_ticks: field(14)?,
        system_ticks: field(15)?,
        start_ticks: field(22)?,
        virtual_bytes: field(23)?,
        resident_pages: field(24)?,
    })
}

/// The soft limit of `name` (`Max open files`) in `/proc/<pid>/limits`; `unlimited`
/// as `u64::MAX`.
pub fn parse_soft_limit(limits: &str, name: &str) -> Option<u64> {
    let rest = limits.lines().find_map(|line| line.strip_prefix(name))?;
    match rest.split_ascii_whitespace().next()? {
        "unlimited" => Some(u64::MAX),
        soft => soft.parse().ok(),
    }
}

/// The boot time (`btime`) in `/proc/stat`, in Unix seconds.
pub fn parse_boot_time(stat: &str) -> Option<u64> {
    stat.lines()
        .find_map(|line| line.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

/// The boot time in Unix seconds from the clocks: the wall clock less the time
/// since boot (`CLOCK_BOOTTIME`, which counts suspend as `btime` does).
fn boot_time_from_clocks() -> Option<u64> {
    let since_epoch = clock_ns(libc::CLOCK_REALTIME)?;
    let since_boot = clock_ns(libc::CLOCK_BOOTTIME)?;
    Some((since_epoch.checked_sub(since_boot)? + 500_000_000) / 1_000_000_000)
}

/// What turns a process's procfs numbers into units; fixed while the system runs,
/// so read once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcfsUnits {
    /// Clock ticks per second: the unit of CPU times.
    pub ticks_per_second: u64,
    /// The unit of resident memory.
    pub page_size: u64,
    /// Unix seconds at boot: where start times count from.
    pub boot_time: u64,
}

impl ProcfsUnits {
    /// The system's clock tick and page size, and the boot time in `root`'s `stat`
    /// (from the clocks if it cannot be read).
    pub fn read(root: &Path) -> Option<Self> {
        // SAFETY: sysconf(3) with a valid name has no preconditions.
        let (ticks, page) = unsafe {
            (
                libc::sysconf(libc::_SC_CLK_TCK),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        Some(Self {
            ticks_per_second: u64::try_from(ticks).unwrap_or(100),
            page_size: u64::try_from(page).unwrap_or(4096),
            boot_time: fs::read_to_string(root.join("stat"))
                .ok()
                .and_then(|stat| parse_boot_time(&stat))
                .or_else(boot_time_from_clocks)?,
        })
    }
}

/// The resource use of process `entry` (a pid, or `self`) under procfs `root`;
/// `None` if a file is missing or malformed.
pub fn process_use(root: &Path, entry: &str, units: &ProcfsUnits) -> Option<ProcessUse> {
    let dir = root.join(entry);
    let stat = parse_stat_use(&fs::read_to_string(dir.join("stat")).ok()?)?;
    let limits = fs::read_to_string(dir.join("limits")).ok()?;
    let open_fds = open_fds(&dir.join("fd"), entry == "self")?;
    let ticks = units.ticks_per_second.max(1) as f64;
    let boot = units.boot_time;
    Some(ProcessUse {
        cpu_seconds: (stat.user_ticks + stat.system_ticks) as f64 / ticks,
        resident_bytes: (stat.resident_pages * units.page_size) as f64,
        virtual_bytes: stat.virtual_bytes as f64,
        virtual_max_bytes: parse_soft_limit(&limits, "Max address space")? as f64,
        open_fds: open_fds as f64,
        max_fds: parse_soft_limit(&limits, "Max open files")? as f64,
        start_time_seconds: boot as f64 + stat.start_ticks as f64 / ticks,
    })
}

/// The open descriptors in `fd_dir`, a process's `fd` directory (`own`: the calling
/// process's). Since Linux 6.2 the size `stat` gives such a directory on procfs is
/// their number: two system calls, where listing it (~90 descriptors: maps,
/// programs, links; procfs makes a dentry per entry) was ~3 % of a scrape at 110
/// services. Listed where the size says nothing: older kernels (0), or a directory
/// on another file system (a fixture).
fn open_fds(fd_dir: &Path, own: bool) -> Option<usize> {
    let on_procfs = is_on_procfs(fd_dir);
    if on_procfs {
        let counted = fs::metadata(fd_dir).ok()?.len();
        if counted > 0 {
            return usize::try_from(counted).ok();
        }
    }
    listed_fds(fd_dir, on_procfs && own)
}

/// The entries of `fd_dir`; without the one the listing reads through when it
/// lists the calling process's own procfs `fd` directory (`own`), so that both
/// ways count the same.
fn listed_fds(fd_dir: &Path, own: bool) -> Option<usize> {
    let listed = fs::read_dir(fd_dir).ok()?.count();
    Some(listed.saturating_sub(usize::from(own)))
}

fn is_on_procfs(path: &Path) -> bool {
    let Ok(path) = CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: statfs(2) reads a NUL-terminated path and writes one `statfs`,
    // zeroed here, whose fields are all plain integers.
    let mut stats: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above; `path` and `stats` outlive the call.
    let status = unsafe { libc::statfs(path.as_ptr(), &mut stats) };
    status == 0 && stats.f_type == libc::PROC_SUPER_MAGIC
}

#[cfg(test)]
mod tests {
    use super::{
        ProcfsUnits, boot_time_from_clocks, is_on_procfs, listed_fds, open_fds, parse_boot_time,
        parse_soft_limit, parse_stat_use, process_use,
    };

    /// A stat line whose comm holds a space and a parenthesis.
    const STAT: &str = "4242 (pool scope)) S 1 4242 4242 0 -1 4194560 2120 0 0 0 \
                        150 75 0 0 20 0 9 0 123456 104857600 2560 18446744073709551615 \
                        1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0\n";
    const LIMITS: &str = "Limit                     Soft Limit           Hard Limit           Units\n\
                          Max cpu time              unlimited            unlimited            seconds\n\
                          Max open files            20000                40000                files\n\
                          Max address space         unlimited            unlimited            bytes\n";

    #[test]
    fn reads_cpu_memory_and_start_from_stat() {
        let stat = parse_stat_use(STAT);
        assert_eq!(
            stat.map(|s| (
                s.user_ticks,
                s.system_ticks,
                s.start_ticks,
                s.virtual_bytes,
                s.resident_pages
            )),
            Some((150, 75, 123_456, 104_857_600, 2560))
        );
        assert_eq!(parse_stat_use("4242 (cut) S 1 2"), None);
    }

    #[test]
    fn reads_soft_limits_and_boot_time() {
        assert_eq!(parse_soft_limit(LIMITS, "Max open files"), Some(20_000));
        assert_eq!(
            parse_soft_limit(LIMITS, "Max address space"),
            Some(u64::MAX)
        );
        assert_eq!(parse_soft_limit(LIMITS, "Max locked memory"), None);
        assert_eq!(
            parse_boot_time("cpu  1 2 3\nbtime 1700000000\n"),
            Some(1_700_000_000)
        );
        assert_eq!(parse_boot_time("cpu  1 2 3\n"), None);
    }

    /// Where /proc/stat is hidden, the clocks give the boot time the kernel keeps
    /// in it (to the second; `btime` is truncated, the clocks' difference rounded).
    #[test]
    fn the_clocks_give_the_boot_time_of_proc_stat() -> std::io::Result<()> {
        let from_proc = parse_boot_time(&std::fs::read_to_string("/proc/stat")?);
        let from_clocks = boot_time_from_clocks();
        assert!(
            matches!((from_proc, from_clocks), (Some(p), Some(c)) if p.abs_diff(c) <= 1),
            "/proc/stat btime {from_proc:?}, clocks {from_clocks:?}"
        );
        let hidden = tempfile::tempdir()?;
        assert_eq!(
            ProcfsUnits::read(hidden.path()).map(|units| units.boot_time),
            from_clocks
        );
        Ok(())
    }

    /// Another process's descriptors (ours change as other tests run): its
    /// directory's entries, and at least stdin, stdout, stderr and the four its
    /// shell opened (it may inherit more from the harness). The shell says when it
    /// has opened them and then blocks in its builtin `read`, so nothing opens or
    /// closes a descriptor while the two ways count (a program it exec'd would: the
    /// dynamic loader opens its libraries after the new `comm` shows).
    #[test]
    fn open_descriptors_are_the_ones_a_process_holds() -> std::io::Result<()> {
        use std::io::BufRead as _;
        let mut child = std::process::Command::new("sh")
            .args([
                "-c",
                "exec 3</dev/null 4</dev/null 5</dev/null 6</dev/null; echo opened; read held",
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let proc_dir = std::path::PathBuf::from(format!("/proc/{}", child.id()));
        // No early return before the kill below: a child left behind would outlive
        // the test.
        let mut said = String::new();
        let read = match child.stdout.take() {
            Some(stdout) => std::io::BufReader::new(stdout).read_line(&mut said),
            None => Ok(0),
        };
        let counted = open_fds(&proc_dir.join("fd"), false);
        let listed = listed_fds(&proc_dir.join("fd"), false);
        let on_procfs = is_on_procfs(&proc_dir);
        child.kill()?;
        child.wait()?;
        read?;
        assert_eq!(said, "opened\n");
        assert!(
            counted == listed && listed >= Some(7),
            "counted {counted:?}, listed {listed:?}"
        );
        // Counted through the size on procfs only.
        let fixture = tempfile::tempdir()?;
        assert!(on_procfs && !is_on_procfs(fixture.path()));
        Ok(())
    }

    #[test]
    fn a_process_tree_gives_what_the_client_libraries_export() -> std::io::Result<()> {
        let root = tempfile::tempdir()?;
        let dir = root.path().join("4242");
        std::fs::create_dir_all(dir.join("fd"))?;
        std::fs::write(dir.join("stat"), STAT)?;
        std::fs::write(dir.join("limits"), LIMITS)?;
        for fd in ["0", "1", "2", "7"] {
            std::fs::write(dir.join("fd").join(fd), "")?;
        }
        std::fs::write(root.path().join("stat"), "cpu  1 2 3\nbtime 1700000000\n")?;
        let units = ProcfsUnits::read(root.path()).map(|units| ProcfsUnits {
            ticks_per_second: 100,
            page_size: 4096,
            ..units
        });
        assert_eq!(units.map(|u| u.boot_time), Some(1_700_000_000));
        let units = units.unwrap_or(ProcfsUnits {
            ticks_per_second: 0,
            page_size: 0,
            boot_time: 0,
        });
        let used = process_use(root.path(), "4242", &units);
        assert_eq!(
            used.map(|u| (
                u.cpu_seconds,
                u.resident_bytes,
                u.virtual_bytes,
                u.open_fds,
                u.max_fds,
                u.start_time_seconds
            )),
            Some((
                2.25,
                10_485_760.0,
                104_857_600.0,
                4.0,
                20_000.0,
                1_700_001_234.56
            ))
        );
        assert_eq!(process_use(root.path(), "9999", &units), None);
        Ok(())
    }
}
