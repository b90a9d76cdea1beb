//! Capacity (DESIGN §4): the request rate at which each pool would be saturated,
//! from what it does now, before any queue forms. By Little's law a pool of `n`
//! threads that serve, busy `b` thread-seconds per request, saturates at `n ÷ b`
//! requests per second. Busy here leaves out waits for a CPU: those are the CPU
//! bound's (a CPU short for the service), and at light load they are mostly an idle
//! CPU waking up (nginx under one client: 71 µs a request runnable, 31 µs running),
//! which a saturated pool never pays. The CPUs the service may use bound it too:
//! CPUs ÷ the service's on-CPU seconds per request. The services' finished counts are kept over
//! the pools' utilization window, read at the same ticks.
use std::{collections::BTreeMap, time::Instant};

use crate::{
    discovery::cpus::{CpuBound, CpuLimit},
    metrics::{history::History, pools::PoolWindow},
};

/// Fewer requests finished in a window than this and capacity is not exported:
/// busy time per request is a mean over the window's requests, within ~1/√n of the
/// truth for service times as spread as their mean (50: ~14 %).
pub const MIN_REQUESTS: u64 = 50;

/// What limits a pool's capacity (`limit` label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// The pool's threads, busy `b` seconds per request.
    Threads,
    /// The CPUs the service may use (see [`CpuBound`]).
    Cpus(CpuBound),
}

impl Limit {
    pub fn label(self) -> &'static str {
        match self {
            Self::Threads => "threads",
            Self::Cpus(CpuBound::Quota) => "cpu_quota",
            Self::Cpus(CpuBound::Cpuset) => "cpuset",
            Self::Cpus(CpuBound::Host) => "host_cpus",
        }
    }
}

/// A pool's capacity, in the service's requests per second.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Capacity {
    pub requests_per_second: f64,
    pub limit: Limit,
}

/// Finished requests of a service over a window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Finished {
    pub requests: u64,
    pub seconds: f64,
}

/// The services' finished counts over the window.
#[derive(Debug)]
pub struct Throughput {
    history: History<u64>,
}

impl Throughput {
    pub fn new(window: std::time::Duration) -> Self {
        Self {
            history: History::new(window),
        }
    }

    pub fn set_window(&mut self, window: std::time::Duration) {
        self.history.set_window(window);
    }

    /// Records the services' finished counts at `at` and forgets services gone.
    pub fn sample(&mut self, at: Instant, finished: &BTreeMap<u32, u64>) {
        for (&service, &count) in finished {
            self.history.push(service, at, count);
        }
        self.history
            .retain(|service| finished.contains_key(&service));
    }

    /// Requests `service` finished over the last window, given its count `now`.
    pub fn finished(&self, service: u32, now: u64, at: Instant) -> Option<Finished> {
        let (base_at, base) = self.history.base(service)?;
        Some(Finished {
            requests: now.checked_sub(*base)?,
            seconds: at.saturating_duration_since(*base_at).as_secs_f64(),
        })
    }
}

/// One pool's window and its service's.
pub struct PoolInput {
    pub pool: u32,
    pub service: u32,
    pub window: PoolWindow,
    /// Its live threads that have served a request (the window holds those that
    /// exited after serving).
    pub threads_served: u64,
}

/// The capacity of each pool that served requests in its window, where its service
/// finished at least [`MIN_REQUESTS`]: the smaller of its threads' bound and its
/// service's CPU bound (`cpus`: the CPUs each service may use, where known).
pub fn capacities(
    pools: &[PoolInput],
    finished: &BTreeMap<u32, Finished>,
    cpus: impl Fn(u32) -> Option<CpuLimit>,
) -> BTreeMap<u32, Capacity> {
    // On-CPU seconds per second of each service: all its pools.
    let mut on_cpu: BTreeMap<u32, f64> = BTreeMap::new();
    for input in pools {
        if input.window.seconds > 0.0 {
            *on_cpu.entry(input.service).or_default() +=
                input.window.running_ns as f64 / 1e9 / input.window.seconds;
        }
    }
    pools
        .iter()
        .filter_map(|input| {
            let finished = finished.get(&input.service)?;
            if finished.requests < MIN_REQUESTS
                || finished.seconds <= 0.0
                || input.window.serving_ns == 0
            {
                return None;
            }
            let rate = finished.requests as f64 / finished.seconds;
            let window = &input.window;
            // Threads busy on the pool's requests at once, on average.
            let occupied =
                window.busy_ns.saturating_sub(window.runnable_ns) as f64 / 1e9 / window.seconds;
            // A server that starts a thread per connection serves with as many threads
            // as it has connections, few alive at any instant: its threads are those
            // that served and exited in the window, if more than the live ones.
            let threads = input.threads_served.max(window.served_exits);
            if threads == 0 || occupied <= 0.0 {
                return None;
            }
            let mut capacity = Capacity {
                requests_per_second: rate * threads as f64 / occupied,
                limit: Limit::Threads,
            };
            let on_cpu = on_cpu.get(&input.service).copied().unwrap_or(0.0);
            if let Some(limit) = cpus(input.service)
                && on_cpu > 0.0
            {
                let cpu_bound = limit.cpus * rate / on_cpu;
                if cpu_bound < capacity.requests_per_second {
                    capacity = Capacity {
                        requests_per_second: cpu_bound,
                        limit: Limit::Cpus(limit.bound),
                    };
                }
            }
            Some((input.pool, capacity))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const S: u64 = 1_000_000_000;

    /// `threads` threads over 10 s, busy `busy` s and on a CPU `running` s of it.
    fn window(threads: u64, busy: f64, running: f64) -> PoolWindow {
        PoolWindow {
            seconds: 10.0,
            total_ns: threads * 10 * S,
            busy_ns: (busy * 1e9) as u64,
            running_ns: (running * 1e9) as u64,
            runnable_ns: 0,
            serving_ns: (busy * 1e9) as u64,
            served_exits: 0,
        }
    }

    /// A pool all of whose `threads` serve.
    fn input(pool: u32, service: u32, threads: u64, busy: f64, running: f64) -> PoolInput {
        PoolInput {
            pool,
            service,
            window: window(threads, busy, running),
            threads_served: threads,
        }
    }

    /// Pool 1 of service 1 over `window`, `threads_served` of its live threads served.
    fn pool_one(window: PoolWindow, threads_served: u64) -> PoolInput {
        PoolInput {
            pool: 1,
            service: 1,
            window,
            threads_served,
        }
    }

    /// Every service may use `cpus`, by `bound`.
    fn limited(cpus: f64, bound: CpuBound) -> impl Fn(u32) -> Option<CpuLimit> {
        move |_| Some(CpuLimit { cpus, bound })
    }

    fn finished(requests: u64) -> BTreeMap<u32, Finished> {
        BTreeMap::from([(
            1,
            Finished {
                requests,
                seconds: 10.0,
            },
        )])
    }

    #[test]
    fn a_pool_saturates_at_threads_over_busy_seconds_per_request() {
        // 4 workers, 20 ms busy per request (1 ms on a CPU), 50 requests/s: 200/s.
        let pools = [input(7, 1, 4, 500.0 * 0.020, 500.0 * 0.001)];
        let host = limited(2.0, CpuBound::Host);
        let capacity = capacities(&pools, &finished(500), host)[&7];
        assert!((capacity.requests_per_second - 200.0).abs() < 1e-6);
        assert_eq!(capacity.limit, Limit::Threads);
        // The same work on a CPU 10 ms per request, under a quota of half a CPU: 50/s.
        let pools = [input(7, 1, 4, 500.0 * 0.020, 500.0 * 0.010)];
        let quota = limited(0.5, CpuBound::Quota);
        let capacity = capacities(&pools, &finished(500), quota)[&7];
        assert!((capacity.requests_per_second - 50.0).abs() < 1e-6);
        assert_eq!(capacity.limit.label(), "cpu_quota");
    }

    #[test]
    fn threads_that_never_served_and_waits_for_a_cpu_are_not_capacity() {
        // nginx: a master and one worker in one pool; the worker 31 µs on a CPU and
        // 71 µs runnable per request at 6,000 requests/s: 1 ÷ 31 µs.
        let mut window = window(2, 60_000.0 * 102e-6, 60_000.0 * 31e-6);
        window.runnable_ns = (60_000.0 * 71e-6 * 1e9) as u64;
        let pools = [pool_one(window, 1)];
        let capacity = capacities(&pools, &finished(60_000), |_| None)[&1];
        assert!((capacity.requests_per_second - 1.0 / 31e-6).abs() < 1.0);
    }

    #[test]
    fn a_thread_per_connection_pool_has_the_threads_that_served_in_its_window() {
        // 25 requests/s, each on a thread of its own for 5 ms on a CPU, under half a
        // CPU of quota: 100/s. At a scrape no thread that served may be alive; the
        // 250 that served and exited make the threads' bound (25 × 250 ÷ 0.125 =
        // 50,000/s) far above the quota's.
        let mut churning = window(1, 250.0 * 0.005, 250.0 * 0.005);
        churning.served_exits = 250;
        let pools = [pool_one(churning, 0)];
        let quota = limited(0.5, CpuBound::Quota);
        let capacity = capacities(&pools, &finished(250), quota)[&1];
        assert!((capacity.requests_per_second - 100.0).abs() < 1e-6);
        assert_eq!(capacity.limit, Limit::Cpus(CpuBound::Quota));
        // A fixed pool of 4 that replaced one worker in the window is still 4.
        let mut recycled = window(4, 500.0 * 0.020, 500.0 * 0.001);
        recycled.served_exits = 1;
        let pools = [pool_one(recycled, 4)];
        let capacity = capacities(&pools, &finished(500), |_| None)[&1];
        assert!((capacity.requests_per_second - 200.0).abs() < 1e-6);
    }

    #[test]
    fn every_pool_of_the_service_counts_towards_its_cpu_bound() {
        // Two pools each 5 ms on a CPU per request: 10 ms per request on 1 CPU.
        let pools = [
            input(1, 1, 8, 500.0 * 0.006, 500.0 * 0.005),
            input(2, 1, 8, 500.0 * 0.006, 500.0 * 0.005),
        ];
        let one_cpu = limited(1.0, CpuBound::Cpuset);
        let capacities = capacities(&pools, &finished(500), one_cpu);
        for pool in [1, 2] {
            assert!((capacities[&pool].requests_per_second - 100.0).abs() < 1e-6);
            assert_eq!(capacities[&pool].limit.label(), "cpuset");
        }
    }

    #[test]
    fn too_few_requests_or_a_pool_that_served_none_say_nothing() {
        let serving = input(1, 1, 4, 1.0, 0.1);
        let none = |_| None;
        assert!(capacities(&[serving], &finished(MIN_REQUESTS - 1), none).is_empty());
        let background = PoolInput {
            pool: 2,
            service: 1,
            window: PoolWindow {
                serving_ns: 0,
                ..window(1, 5.0, 5.0)
            },
            threads_served: 1,
        };
        let idle = input(3, 1, 1, 0.0, 0.0);
        let serving = input(1, 1, 4, 1.0, 0.1);
        let found = capacities(&[serving, background, idle], &finished(MIN_REQUESTS), none);
        assert_eq!(found.keys().copied().collect::<Vec<_>>(), [1]);
        // Other services' counts say nothing of this one.
        assert!(capacities(&[input(1, 2, 4, 1.0, 0.1)], &finished(500), none).is_empty());
    }

    #[test]
    fn finished_requests_are_counted_over_the_window() {
        let mut throughput = Throughput::new(Duration::from_secs(10));
        let start = Instant::now();
        for second in 0..=20u64 {
            let at = start + Duration::from_secs(second);
            throughput.sample(at, &BTreeMap::from([(1, second * 100)]));
        }
        let now = start + Duration::from_secs(20);
        assert_eq!(
            throughput.finished(1, 2_000, now),
            Some(Finished {
                requests: 1_000,
                seconds: 10.0
            })
        );
        throughput.sample(now, &BTreeMap::new());
        assert_eq!(throughput.finished(1, 2_000, now), None);
    }
}
