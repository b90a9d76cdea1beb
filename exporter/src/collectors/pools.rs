//! The per-pool families: threads by state, busy share, capacity (and the service's:
//! its pool that saturates first), and lock waits per primitive.
use std::collections::BTreeMap;

use poolscope_shared::{Histogram, LockPrimitive};

use super::{Collected, Reading};
use crate::{
    config::MetricsSettings,
    encode::{Family, Kind, Value},
    metrics::capacity::Capacity,
    metrics::pools::{PoolTotals, REASONS, STATES, sum_of},
    metrics::window::ClassicBuckets,
};

/// One pool at scrape time.
pub struct PoolInput<'a> {
    pub service: &'a str,
    pub pool: &'a str,
    pub totals: &'a PoolTotals,
    /// Busy share over the utilization window; `None` before there is a window.
    pub utilization: Option<f64>,
    /// `None` while the window says too little.
    pub capacity: Option<Capacity>,
}

/// The per-pool families of a reading; whole if the kernel was read.
pub fn collect(reading: &Reading<'_>) -> Collected {
    let names = reading.pool_names();
    let inputs: Vec<PoolInput<'_>> = reading
        .pools
        .iter()
        .filter_map(|row| {
            let (service, pool) = names.get(&row.view.id)?;
            Some(PoolInput {
                service,
                pool,
                totals: &row.totals,
                utilization: row.utilization,
                capacity: row.capacity,
            })
        })
        .collect();
    Collected {
        families: pool_families(&inputs, reading.metrics),
        whole: reading.kernel.is_some(),
    }
}

/// Waits without their buckets: a summary of `_sum` and `_count` (the mean wait).
fn mean_wait(sum_ns: u64, count: u64) -> Value {
    Value::summary(Vec::new(), Some((sum_ns as f64 / 1e9, count)))
}

/// Per-pool families (DESIGN §4).
pub fn pool_families(pools: &[PoolInput<'_>], layout: MetricsSettings) -> Vec<Family> {
    let mut threads = Family::new(
        "pool_threads",
        Kind::Gauge,
        "Threads alive in the pool (same normalized thread name within a service).",
    );
    let mut busy = Family::new(
        "pool_threads_busy",
        Kind::Gauge,
        "Threads of the pool busy now: running, runnable, or blocked on a lock or I/O \
         (everything but waiting for work).",
    );
    let mut utilization = Family::new(
        "pool_utilization_ratio",
        Kind::Gauge,
        "Busy thread-seconds over thread-seconds of the pool, over the utilization window \
         (pools.utilization_window). For a one-thread event loop: the share of time not \
         waiting in epoll.",
    );
    let mut pool_capacity = Family::new(
        "pool_capacity_requests_per_second",
        Kind::Gauge,
        "The service's request rate at which this pool would be saturated, from the \
         utilization window: the service's finished requests per second over the pool's \
         utilization, or the CPUs the service may use over its on-CPU seconds per request, \
         whichever is less (limit: threads, cpu_quota, cpuset, host_cpus). Absent while \
         the window holds too few finished requests.",
    );
    let mut service_capacity = Family::new(
        "service_capacity_requests_per_second",
        Kind::Gauge,
        "The least capacity of the service's pools: the request rate at which its first \
         pool saturates.",
    );
    let mut least: BTreeMap<&str, f64> = BTreeMap::new();
    let mut state_seconds = Family::new(
        "thread_seconds",
        Kind::Counter,
        "Thread time of the pool by state.",
    );
    let mut offcpu = Family::new(
        "offcpu_seconds",
        Kind::Counter,
        "Time the pool's threads spent blocked on I/O (state blocked_io), by what they \
         waited for: disk, network, sleep, other; a reason appears once the pool has \
         first waited for it.",
    );
    let buckets = ClassicBuckets::configured(layout);
    let distribution = |histogram: &Histogram| {
        if layout.pool_histogram_buckets {
            buckets.value(histogram)
        } else {
            mean_wait(histogram.sum_ns, histogram.count())
        }
    };
    let mut runqueue = Family::new(
        "runqueue_wait_seconds",
        Kind::Histogram,
        "Run-queue waits of the pool's threads: woken or preempted until back on a CPU.",
    );
    let mut lock_waits = Family::new(
        "lock_wait_seconds",
        Kind::Histogram,
        "Lock waits of the pool's threads while serving. futex: blocked in a futex wait \
         until back on CPU; pthread_mutex (opt-in probes.lock_uprobes): time inside \
         pthread_mutex_lock, contended or not.",
    );
    for input in pools {
        let labels = [("service", input.service), ("pool", input.pool)];
        let totals = input.totals;
        threads.push(&labels, totals.threads as f64);
        busy.push(&labels, totals.threads_busy as f64);
        if let Some(ratio) = input.utilization {
            utilization.push(&labels, ratio);
        }
        if let Some(capacity) = input.capacity {
            pool_capacity.push(
                &[
                    ("service", input.service),
                    ("pool", input.pool),
                    ("limit", capacity.limit.label()),
                ],
                capacity.requests_per_second,
            );
            least
                .entry(input.service)
                .and_modify(|least| *least = least.min(capacity.requests_per_second))
                .or_insert(capacity.requests_per_second);
        }
        for (state, activities) in STATES {
            state_seconds.push(
                &[
                    ("service", input.service),
                    ("pool", input.pool),
                    ("state", state),
                ],
                sum_of(&totals.time_ns, activities) as f64 / 1e9,
            );
        }
        for (reason, activity) in REASONS {
            // A reason the pool never waited for is left out, not exported as 0:
            // most pools never touch a disk or sleep, and the total is always there
            // in `thread_seconds_total{state="blocked_io"}`.
            if totals.time_ns[activity as usize] == 0 {
                continue;
            }
            offcpu.push(
                &[
                    ("service", input.service),
                    ("pool", input.pool),
                    ("reason", reason),
                ],
                totals.time_ns[activity as usize] as f64 / 1e9,
            );
        }
        // A pool that never waited exports no empty distribution. Without buckets
        // the mean wait comes from the pool's stats: its per-CPU histograms are not
        // read then.
        if layout.pool_histogram_buckets {
            if let Some(histogram) = &totals.runqueue {
                runqueue.push_value(&labels, buckets.value(histogram));
            }
        } else if totals.runqueue_waits > 0 {
            runqueue.push_value(
                &labels,
                mean_wait(totals.runqueue_wait_ns, totals.runqueue_waits),
            );
        }
        for primitive in LockPrimitive::ALL {
            let Some(histogram) = &totals.lock_waits[primitive as usize] else {
                continue;
            };
            lock_waits.push_value(
                &[
                    ("service", input.service),
                    ("pool", input.pool),
                    ("primitive", primitive.name()),
                ],
                distribution(histogram),
            );
        }
    }
    if !layout.pool_histogram_buckets {
        // Without their buckets, summaries of `_sum` and `_count` (the mean wait).
        runqueue.kind = Kind::Summary;
        lock_waits.kind = Kind::Summary;
    }
    for (service, capacity) in least {
        service_capacity.push(&[("service", service)], capacity);
    }
    vec![
        threads,
        busy,
        utilization,
        pool_capacity,
        service_capacity,
        state_seconds,
        offcpu,
        runqueue,
        lock_waits,
    ]
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::encode::{Format, render};

    /// The mean run-queue wait comes from the pool's stats by default (its per-CPU
    /// histograms are not read then), and the buckets from the histogram when asked.
    #[test]
    fn run_queue_waits_are_the_stats_mean_or_the_histograms_buckets() {
        let mut histogram = Histogram::default();
        histogram.buckets[poolscope_shared::histogram_bucket(2_000_000)] = 4;
        histogram.sum_ns = 8_000_000;
        let totals = PoolTotals {
            runqueue: Some(Arc::new(histogram)),
            runqueue_waits: 5,
            runqueue_wait_ns: 9_000_000,
            ..PoolTotals::default()
        };
        let input = |totals| PoolInput {
            service: "web",
            pool: "worker",
            totals,
            utilization: None,
            capacity: None,
        };
        let text = |totals, pool_histogram_buckets| {
            let layout = MetricsSettings {
                pool_histogram_buckets,
                ..MetricsSettings::default()
            };
            render(&pool_families(&[input(totals)], layout), Format::Text)
        };
        // Whether `text` has the wait's `_sum` and `_count` lines with these values,
        // and buckets or none.
        let exported = |text: &str, sum: &str, count: &str, with_buckets: bool| {
            let labels = "{service=\"web\",pool=\"worker\"}";
            let line = |suffix: &str, value: &str| {
                format!("poolscope_runqueue_wait_seconds_{suffix}{labels} {value}\n")
            };
            text.contains(&line("sum", sum))
                && text.contains(&line("count", count))
                && text.contains("poolscope_runqueue_wait_seconds_bucket{") == with_buckets
        };
        let means = text(&totals, false);
        assert!(exported(&means, "0.009", "5", false), "{means}");
        let buckets = text(&totals, true);
        assert!(exported(&buckets, "0.008", "4", true), "{buckets}");
        // A pool that never waited exports no sample of it.
        let never = text(&PoolTotals::default(), false);
        assert!(
            !never.contains("poolscope_runqueue_wait_seconds_count{"),
            "{never}"
        );
    }

    /// `offcpu_seconds_total` has the reasons the pool has waited for, which add up
    /// to its `blocked_io` time; the others are left out rather than exported as 0.
    #[test]
    fn off_cpu_reasons_appear_once_waited_for_and_add_up_to_blocked_io() {
        let mut totals = PoolTotals::default();
        totals.time_ns[poolscope_shared::Activity::OffDisk as usize] = 1_500_000_000;
        totals.time_ns[poolscope_shared::Activity::OffSleep as usize] = 500_000_000;
        totals.time_ns[poolscope_shared::Activity::OffIdle as usize] = 7_000_000_000;
        let input = PoolInput {
            service: "web",
            pool: "worker",
            totals: &totals,
            utilization: None,
            capacity: None,
        };
        let text = render(
            &pool_families(&[input], MetricsSettings::default()),
            Format::Text,
        );
        let labels = "service=\"web\",pool=\"worker\"";
        for line in [
            format!("poolscope_offcpu_seconds_total{{{labels},reason=\"disk\"}} 1.5\n"),
            format!("poolscope_offcpu_seconds_total{{{labels},reason=\"sleep\"}} 0.5\n"),
            format!("poolscope_thread_seconds_total{{{labels},state=\"blocked_io\"}} 2\n"),
            // States stay whole, at 0 too: they add up to the pool's threads.
            format!("poolscope_thread_seconds_total{{{labels},state=\"blocked_lock\"}} 0\n"),
        ] {
            assert!(text.contains(&line), "no {line:?} in\n{text}");
        }
        assert_eq!(
            text.matches("poolscope_offcpu_seconds_total{").count(),
            2,
            "{text}"
        );
    }
}
