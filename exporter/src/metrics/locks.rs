//! Lock waits seen from user space: the opt-in `pthread_mutex_lock` probes of the
//! services that ask for them (attached per process, in the libc each one maps), and
//! the top contended locks of `/debug/locks`: the kernel's `LOCKS` entries grouped by
//! lock, with quantiles from their fine histograms and stacks symbolized on request,
//! off the scrape path. Grouping and rendering are pure functions.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fmt::Write as _,
    path::Path,
};

use aya::programs::uprobe::UProbeLinkId;
use poolscope_shared::{Histogram, LockKey};
use serde::Serialize;

use crate::{
    discovery::procfs,
    kernel::Kernel,
    metrics::window::quantiles,
    stacks::symbolize::{Symbol, Symbols, lookup_addresses},
};

/// Which services get the `pthread_mutex_lock` probes (`probes.lock_uprobes`).
#[derive(Debug, Default)]
pub struct LockProbes {
    /// Service names; `*` stands for every service.
    services: HashSet<String>,
    attached: HashMap<u32, Vec<UProbeLinkId>>,
    /// Processes whose probes could not be attached (no libc, or the kernel refused).
    pub errors: u64,
}

impl LockProbes {
    pub fn new(services: &[String]) -> Self {
        Self {
            services: services.iter().cloned().collect(),
            ..Self::default()
        }
    }

    /// A reload's list; it applies to processes watched from now on.
    pub fn set_services(&mut self, services: &[String]) {
        self.services = services.iter().cloned().collect();
    }

    fn wants(&self, service: &str) -> bool {
        self.services.contains("*") || self.services.contains(service)
    }

    /// Attaches the probes to a newly watched process of `service`, if it wants them.
    pub fn follow(&mut self, kernel: &mut Kernel, procfs_root: &Path, pid: u32, service: &str) {
        if !self.wants(service) || self.attached.contains_key(&pid) {
            return;
        }
        let Some(libc) = procfs::libc_path(procfs_root, pid) else {
            self.errors += 1;
            tracing::warn!(
                pid,
                service,
                "no libc mapped (static binary?): no pthread_mutex probes"
            );
            return;
        };
        match kernel.attach_mutex_probes(pid, &libc) {
            Ok(links) => {
                self.attached.insert(pid, links);
            }
            Err(error) => {
                self.errors += 1;
                tracing::warn!(pid, service, %error, "cannot attach the pthread_mutex probes");
            }
        }
    }

    /// Detaches the probes of a process no longer watched.
    pub fn forget(&mut self, kernel: &mut Kernel, pid: u32) {
        if let Some(links) = self.attached.remove(&pid) {
            kernel.detach_mutex_probes(links);
        }
    }

    /// Processes with the probes attached.
    pub fn processes(&self) -> usize {
        self.attached.len()
    }
}

/// One lock: a futex address in one process, over all stacks that waited on it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LockReport {
    pub pid: u32,
    /// The futex word's address (for a glibc mutex, the `pthread_mutex_t`'s).
    pub address: String,
    pub wait_seconds: f64,
    pub waits: u64,
    /// Of `waits`, those whose futex call had a timeout (a sleep, a timed park or
    /// condition wait: `lock_wait_seconds{primitive="futex_timed"}`).
    pub timed_waits: u64,
    pub p50_seconds: f64,
    pub p99_seconds: f64,
    /// The stacks that waited on it, most wait first.
    pub stacks: Vec<StackReport>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StackReport {
    pub wait_seconds: f64,
    pub waits: u64,
    /// The waits from this stack had a timeout.
    pub timed: bool,
    /// Innermost first, symbolized (`name+0xoffset (module)`, or `module+0xoffset`
    /// where no symbol is known). Empty if the stack was not captured.
    pub frames: Vec<String>,
    /// The kernel's stack id; negative if none.
    #[serde(skip)]
    pub stack_id: i32,
    /// Return addresses read from the kernel's stack map, innermost first.
    #[serde(skip)]
    pub addresses: Vec<u64>,
}

/// Groups `LOCKS` entries of the processes `include` accepts by lock and keeps the
/// `limit` locks with the most wait time. Frames are left empty for the caller.
pub fn top_locks(
    entries: &[(LockKey, Histogram)],
    include: impl Fn(u32) -> bool,
    limit: usize,
) -> Vec<LockReport> {
    let mut by_lock: BTreeMap<(u32, u64), (Histogram, Vec<StackReport>)> = BTreeMap::new();
    for (key, histogram) in entries.iter().filter(|(key, _)| include(key.tgid)) {
        let (total, stacks) = by_lock.entry((key.tgid, key.address)).or_default();
        total.add(histogram);
        stacks.push(StackReport {
            wait_seconds: histogram.sum_ns as f64 / 1e9,
            waits: histogram.count(),
            timed: key.timed != 0,
            frames: Vec::new(),
            stack_id: key.stack,
            addresses: Vec::new(),
        });
    }
    let mut locks: Vec<LockReport> = by_lock
        .into_iter()
        .filter(|(_, (total, _))| total.count() > 0)
        .map(|((pid, address), (total, mut stacks))| {
            stacks.sort_by(|a, b| b.wait_seconds.total_cmp(&a.wait_seconds));
            let [p50_seconds, p99_seconds] = quantiles(&total, [0.5, 0.99]).unwrap_or_default();
            LockReport {
                pid,
                address: format!("{address:#x}"),
                wait_seconds: total.sum_ns as f64 / 1e9,
                waits: total.count(),
                timed_waits: stacks
                    .iter()
                    .filter(|stack| stack.timed)
                    .map(|stack| stack.waits)
                    .sum(),
                p50_seconds,
                p99_seconds,
                stacks,
            }
        })
        .collect();
    locks.sort_by(|a, b| b.wait_seconds.total_cmp(&a.wait_seconds));
    locks.truncate(limit);
    locks
}

/// `/debug/locks` as text: one block per lock, its stacks indented below it.
pub fn render_text(service: &str, locks: &[LockReport]) -> String {
    let mut text = format!("# top contended locks of service {service}, most wait first\n");
    for lock in locks {
        let _ = writeln!(
            text,
            "lock {} pid {}: wait {:.6} s in {} waits ({} timed), p50 {:.6} s, p99 {:.6} s",
            lock.address,
            lock.pid,
            lock.wait_seconds,
            lock.waits,
            lock.timed_waits,
            lock.p50_seconds,
            lock.p99_seconds
        );
        for stack in &lock.stacks {
            let _ = writeln!(
                text,
                "  stack: wait {:.6} s in {} {}waits",
                stack.wait_seconds,
                stack.waits,
                if stack.timed { "timed " } else { "" }
            );
            if stack.frames.is_empty() {
                text.push_str("    (stack not captured)\n");
            }
            for frame in &stack.frames {
                let _ = writeln!(text, "    {frame}");
            }
        }
    }
    text
}

/// `/debug/locks?format=json`.
pub fn render_json(service: &str, locks: &[LockReport]) -> String {
    #[derive(Serialize)]
    struct Body<'a> {
        service: &'a str,
        locks: &'a [LockReport],
    }
    serde_json::to_string_pretty(&Body { service, locks })
        .map(|mut json| {
            json.push('\n');
            json
        })
        .unwrap_or_else(|error| format!("{{\"error\": \"{error}\"}}\n"))
}

/// Reads the addresses of every stack of `locks` from the kernel.
pub fn read_stacks(kernel: &Kernel, locks: &mut [LockReport]) {
    for stack in locks.iter_mut().flat_map(|lock| &mut lock.stacks) {
        stack.addresses = kernel.lock_stack(stack.stack_id).unwrap_or_default();
    }
}

/// Symbolizes the stacks of `locks` (addresses read by [`read_stacks`]) with a
/// symbolizer of this request: nothing is cached between requests.
pub fn symbolize(symbols: &Symbols, locks: &mut [LockReport]) {
    for lock in locks {
        for stack in &mut lock.stacks {
            let lookups: Vec<u64> = lookup_addresses(&stack.addresses).collect();
            stack.frames = symbols
                .user(lock.pid, &lookups, &[])
                .iter()
                .map(Symbol::describe)
                .collect();
        }
    }
}

#[cfg(test)]
mod tests {
    use poolscope_shared::histogram_bucket;

    use super::*;

    fn histogram(waits_ns: &[u64]) -> Histogram {
        let mut histogram = Histogram::default();
        for &ns in waits_ns {
            histogram.buckets[histogram_bucket(ns)] += 1;
            histogram.sum_ns += ns;
        }
        histogram
    }

    fn key(tgid: u32, stack: i32, address: u64) -> LockKey {
        LockKey {
            tgid,
            stack,
            address,
            timed: 0,
            _pad: 0,
        }
    }

    #[test]
    fn locks_are_grouped_over_stacks_and_ranked_by_wait() {
        let entries = vec![
            (key(10, 1, 0x1000), histogram(&[1_000_000, 3_000_000])),
            (
                LockKey {
                    timed: 1,
                    ..key(10, 2, 0x1000)
                },
                histogram(&[2_000_000]),
            ),
            (key(10, 1, 0x2000), histogram(&[500_000])),
            // Another process: same address, another lock.
            (key(11, 1, 0x1000), histogram(&[9_000_000])),
            // Excluded process.
            (key(12, 1, 0x1000), histogram(&[90_000_000])),
        ];
        let locks = top_locks(&entries, |pid| pid != 12, 2);
        assert_eq!(locks.len(), 2);
        assert_eq!((locks[0].pid, locks[0].address.as_str()), (11, "0x1000"));
        let lock = &locks[1];
        assert_eq!(
            (lock.pid, lock.address.as_str(), lock.waits),
            (10, "0x1000", 3)
        );
        assert!((lock.wait_seconds - 0.006).abs() < 1e-12);
        // Stacks most wait first.
        assert_eq!(lock.stacks[0].stack_id, 1);
        assert_eq!(lock.stacks[0].waits, 2);
        assert_eq!(lock.stacks[1].stack_id, 2);
        // The timed waits of a lock are those of its stacks with a timeout.
        assert_eq!(lock.timed_waits, 1);
        assert!(lock.stacks[1].timed && !lock.stacks[0].timed);
        // The median of 1, 2, 3 ms within a fine bucket (1/8 octave) of 2 ms.
        assert!(
            (lock.p50_seconds - 0.002).abs() <= 0.002 / 8.0,
            "{}",
            lock.p50_seconds
        );
    }

    #[test]
    fn text_and_json_name_every_lock_and_frame() {
        let mut locks = top_locks(&[(key(7, 3, 0xabc), histogram(&[4_000]))], |_| true, 10);
        locks[0].stacks[0].frames = vec!["__lll_lock_wait+0x2a (libc.so.6)".to_owned()];
        let text = render_text("web", &locks);
        assert!(text.contains("lock 0xabc pid 7: wait 0.000004 s in 1 waits (0 timed)"));
        assert!(text.contains("  stack: wait 0.000004 s in 1 waits\n"));
        assert!(text.contains("    __lll_lock_wait+0x2a (libc.so.6)\n"));
        let json: serde_json::Value =
            serde_json::from_str(&render_json("we\"b", &locks)).unwrap_or_default();
        assert_eq!(json["service"], "we\"b");
        assert_eq!(json["locks"][0]["waits"], 1);
        assert_eq!(
            json["locks"][0]["stacks"][0]["frames"][0],
            "__lll_lock_wait+0x2a (libc.so.6)"
        );
    }
}
