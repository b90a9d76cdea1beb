//! The two views of the kernel's fine duration histograms (DESIGN §4): coarse
//! Prometheus buckets (aggregatable across instances) and quantiles over a sliding
//! window (exact to a few % per instance). The window keeps a few past readings of the
//! kernel's cumulative buckets and subtracts; it never counts anything itself.
use std::{
    collections::{HashMap, VecDeque},
    sync::Arc,
    time::{Duration, Instant},
};

use poolscope_shared::{HISTOGRAM_BUCKETS, Histogram, RequestTimes, histogram_bucket_bounds};

use crate::{
    config::{MetricsSettings, OctavesPerBucket},
    encode::Value,
    metrics::native::native_buckets,
};

/// Quantiles exported by the `_window` summaries.
pub const QUANTILES: [f64; 4] = [0.5, 0.9, 0.99, 0.999];

/// The bounds of the classic Prometheus buckets (`[metrics] octaves_per_bucket`):
/// every `step` eighths of an octave through 2^28 ns, from 2^13 ns (8.2 µs) at the
/// lowest up to 1.5·2^36 ns (103 s).
/// Each bound is a bound of the kernel's fine buckets, so no count is split. Half an
/// octave gives 48 bounds; three octaves (the default) 8, 8.2 µs to 17 s, each 8×
/// the last: the `_window` quantiles carry the precision per instance, the buckets
/// only have to aggregate across instances.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClassicBuckets {
    /// Eighths of an octave between two bounds (the kernel has 8 fine buckets per
    /// octave).
    step: usize,
    /// Whether exported histograms carry native buckets too.
    native: bool,
}

impl ClassicBuckets {
    /// With native buckets too.
    pub fn new(octaves: OctavesPerBucket) -> Self {
        Self {
            step: octaves.eighths(),
            native: true,
        }
    }

    pub fn configured(settings: MetricsSettings) -> Self {
        Self {
            native: settings.native_histograms,
            ..Self::new(settings.octaves_per_bucket)
        }
    }

    /// Fine-bucket indexes where a classic bucket ends (exclusive): every `step`
    /// from 2^28 ns (268 ms, the latency SLO's bound in the shipped rules, so that
    /// every layout has it) both ways, within 2^13 to 1.5·2^36 ns.
    fn bounds(self) -> impl Iterator<Item = usize> {
        let index_of_octave = |octave: usize| 1 + (octave - 10) * 8;
        let (first, last) = (index_of_octave(13), index_of_octave(36) + 4);
        let anchor = index_of_octave(28);
        let start = anchor - (anchor - first) / self.step * self.step;
        (start..=last).step_by(self.step)
    }

    /// (upper bound in seconds, cumulative count) of each finite bucket.
    pub fn of(self, histogram: &Histogram) -> Vec<(f64, u64)> {
        let mut cumulative = 0;
        let mut next = 0;
        self.bounds()
            .map(|bound| {
                cumulative += histogram.buckets[next..bound].iter().sum::<u64>();
                next = bound;
                let (lower_ns, _) = histogram_bucket_bounds(bound);
                (lower_ns as f64 / 1e9, cumulative)
            })
            .collect()
    }

    /// `histogram` as an exported histogram: these classic buckets, and its native
    /// buckets for the protobuf exposition.
    pub fn value(self, histogram: &Histogram) -> Value {
        Value::histogram(
            self.of(histogram),
            histogram.sum_ns as f64 / 1e9,
            histogram.count(),
            self.native.then(|| native_buckets(histogram)),
        )
    }
}

/// The `qs` quantiles (ascending) in seconds, each the middle of the fine bucket it
/// falls in, so at most half a bucket (6.25 %) off whatever the shape inside the
/// bucket; `None` when empty. One count and one pass over the buckets for all of them
/// (a service's summaries take four quantiles of each of its three histograms at
/// every scrape).
pub fn quantiles<const N: usize>(histogram: &Histogram, qs: [f64; N]) -> Option<[f64; N]> {
    quantiles_of(|index| histogram.buckets[index], qs)
}

/// [`quantiles`] of the fine buckets `in_bucket` gives by index.
fn quantiles_of<const N: usize>(
    in_bucket: impl Fn(usize) -> u64,
    qs: [f64; N],
) -> Option<[f64; N]> {
    let count: u64 = (0..HISTOGRAM_BUCKETS).map(&in_bucket).sum();
    if count == 0 {
        return None;
    }
    let rank = |q: f64| (q * count as f64).max(1.0);
    // Past the last bucket (only by float rounding of a rank near the count): its
    // lower bound.
    let (lower, _) = histogram_bucket_bounds(HISTOGRAM_BUCKETS - 1);
    let mut values = [lower as f64 / 1e9; N];
    let mut next = 0;
    let mut below = 0u64;
    for index in 0..HISTOGRAM_BUCKETS {
        let in_bucket = in_bucket(index);
        if in_bucket == 0 {
            continue;
        }
        below += in_bucket;
        while next < N && below as f64 >= rank(qs[next]) {
            let (lower, upper) = histogram_bucket_bounds(index);
            values[next] = (lower + upper) as f64 / 2.0 / 1e9;
            next += 1;
        }
        if next == N {
            break;
        }
    }
    Some(values)
}

/// One of a service's three histograms: queue, duration or latency.
pub type Part = fn(&RequestTimes) -> &Histogram;

/// The three histograms of [`RequestTimes`], in the order of the families.
pub const PARTS: [Part; 3] = [
    |times| &times.queue,
    |times| &times.duration,
    |times| &times.latency,
];

/// What a service finished over the window: its reading now less the one a window
/// ago (none: everything since its first reading), subtracted bucket by bucket as
/// the quantiles walk them, not into kilobytes of their own at every scrape.
#[derive(Debug)]
pub struct WindowDelta {
    now: Arc<RequestTimes>,
    base: Option<Arc<RequestTimes>>,
}

impl WindowDelta {
    /// Requests of `part` over the window in each fine bucket, by index.
    fn in_buckets(&self, part: Part) -> impl Fn(usize) -> u64 + '_ {
        let now = part(&self.now);
        let base = self.base.as_deref().map(part);
        move |index| {
            let in_now = now.buckets[index];
            base.map_or(in_now, |base| in_now.saturating_sub(base.buckets[index]))
        }
    }

    /// The `qs` quantiles of `part` over the window, as [`quantiles`] gives them.
    pub fn quantiles<const N: usize>(&self, part: Part, qs: [f64; N]) -> Option<[f64; N]> {
        quantiles_of(self.in_buckets(part), qs)
    }
}

/// Past readings of each service's cumulative request times.
#[derive(Debug)]
pub struct Windows {
    length: Duration,
    /// Readings closer together than this are not kept.
    step: Duration,
    /// Shared with the kernel read's kept copies: an unchanged service's reading is
    /// the same allocation as the last, told apart without comparing its kilobytes.
    history: HashMap<u32, VecDeque<(Instant, Arc<RequestTimes>)>>,
}

impl Windows {
    pub fn new(length: Duration) -> Self {
        Self {
            length,
            step: length / 12,
            history: HashMap::new(),
        }
    }

    /// What `service` finished over about the last `length` (or since its first
    /// reading), given its cumulative `times` read at `now`; `None` if it finished
    /// nothing (most services of a node, most of the time).
    pub fn delta(
        &mut self,
        service: u32,
        now: Instant,
        times: &Arc<RequestTimes>,
    ) -> Option<WindowDelta> {
        let same = |reading: &Arc<RequestTimes>| Arc::ptr_eq(reading, times) || reading == times;
        let history = self.history.entry(service).or_default();
        // Counters went back: the id was freed and reused; its past is not ours.
        // (Compared first by pointer, then whole: most services finished nothing
        // since, and their reading is the same allocation as the last.)
        if history
            .back()
            .is_some_and(|(_, last)| !same(last) && last.duration.count() > times.duration.count())
        {
            history.clear();
        }
        // Keep one reading at least `length` old as the base, and nothing older.
        while history.len() > 1
            && history
                .get(1)
                .is_some_and(|(at, _)| now.duration_since(*at) >= self.length)
        {
            history.pop_front();
        }
        let delta = match history.front() {
            Some((_, base)) if same(base) => None,
            Some((_, base)) => Some(WindowDelta {
                now: times.clone(),
                base: Some(base.clone()),
            }),
            None => (**times != RequestTimes::default()).then(|| WindowDelta {
                now: times.clone(),
                base: None,
            }),
        };
        if history
            .back()
            .is_none_or(|(at, _)| now.duration_since(*at) >= self.step)
        {
            history.push_back((now, times.clone()));
        }
        delta
    }

    /// Drops the readings of services not in `live`.
    pub fn retain(&mut self, live: &[u32]) {
        self.history.retain(|service, _| live.contains(service));
    }
}

#[cfg(test)]
mod tests {
    use poolscope_shared::histogram_bucket;

    use super::*;

    fn histogram_of(durations_ns: &[u64]) -> Histogram {
        let mut histogram = Histogram::default();
        for &ns in durations_ns {
            histogram.buckets[histogram_bucket(ns)] += 1;
            histogram.sum_ns += ns;
        }
        histogram
    }

    #[test]
    fn quantiles_within_ten_percent_from_10us_to_60s() {
        let mut value = 10_000u64;
        while value <= 60_000_000_000 {
            // 1000 samples spread ±1% around the value.
            let samples: Vec<u64> = (0..1000)
                .map(|i| value - value / 100 + value * i / 50_000)
                .collect();
            let histogram = histogram_of(&samples);
            for q in QUANTILES {
                let mut sorted = samples.clone();
                sorted.sort_unstable();
                let truth = sorted[((q * 1000.0) as usize).min(999)] as f64 / 1e9;
                let [ours] = quantiles(&histogram, [q]).expect("non-empty");
                assert!(
                    (ours - truth).abs() <= truth * 0.10,
                    "q{q} of ~{value} ns: ours {ours}, truth {truth}"
                );
            }
            value = value * 13 / 10;
        }
        assert_eq!(quantiles(&Histogram::default(), [0.5]), None);
    }

    #[test]
    fn classic_buckets_are_cumulative_and_exact_at_bounds() {
        let histogram = histogram_of(&[8_191, 8_192, 12_287, 12_288, 1_000_000_000]);
        let Some(half_octave) = OctavesPerBucket::new(0.5) else {
            panic!("half an octave is a layout");
        };
        let buckets = ClassicBuckets::new(half_octave).of(&histogram);
        assert_eq!(buckets.len(), 48);
        assert_eq!(buckets[0], (8.192e-6, 1));
        assert_eq!(buckets[1], (12.288e-6, 3));
        assert_eq!(buckets[2].1, 4);
        assert_eq!(buckets.last().map(|b| b.1), Some(5));
        assert!(
            buckets
                .windows(2)
                .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1)
        );
    }

    #[test]
    fn native_buckets_only_when_configured() {
        let histogram = histogram_of(&[500, 70_000, 70_001, 3_000_000]);
        let native = |native_histograms| match ClassicBuckets::configured(MetricsSettings {
            native_histograms,
            ..MetricsSettings::default()
        })
        .value(&histogram)
        {
            Value::Histogram(histogram) => {
                assert_eq!(histogram.count, 4);
                histogram.native
            }
            other => panic!("not a histogram: {other:?}"),
        };
        let counts = native(true).map(|n| (n.zero_count, n.positive.len()));
        assert_eq!(counts, Some((1, 2)));
        assert_eq!(native(false), None);
    }

    #[test]
    fn each_layout_has_the_bounds_its_octaves_give() {
        let histogram = histogram_of(&[8_191, 8_192, 70_000, 1_000_000_000, 200_000_000_000]);
        let bounds = |octaves| -> Vec<(f64, u64)> {
            OctavesPerBucket::new(octaves).map_or_else(Vec::new, |octaves| {
                ClassicBuckets::new(octaves).of(&histogram)
            })
        };
        assert_eq!(bounds(1.0).len(), 24);
        assert_eq!(bounds(2.0).len(), 12);
        assert_eq!(bounds(4.0).len(), 6);
        let default = ClassicBuckets::new(OctavesPerBucket::default()).of(&histogram);
        assert_eq!(
            OctavesPerBucket::new(3.0),
            Some(OctavesPerBucket::default())
        );
        // 2^13, 2^16, … 2^34 ns: 8.2 µs to 17.2 s, each 8 times the last.
        assert_eq!(default.len(), 8);
        assert_eq!(default[0], (8.192e-6, 1));
        assert_eq!(default[1], (65.536e-6, 2));
        assert!(
            (default[7].0 - 17.179869184).abs() < 1e-9,
            "{:?}",
            default[7]
        );
        // 200 s is past the last bound: only in +Inf (the count).
        assert_eq!(default[7].1, 4);
        assert!(
            default
                .windows(2)
                .all(|w| (w[1].0 / w[0].0 - 8.0).abs() < 1e-9)
        );
        for octaves in OctavesPerBucket::ALLOWED {
            assert!(
                bounds(octaves).iter().any(|(le, _)| *le == 0.268435456),
                "{octaves} octaves per bucket lose the SLO bound 2^28 ns"
            );
        }
        assert_eq!(OctavesPerBucket::new(1.5), None);
        assert_eq!(OctavesPerBucket::new(0.25), None);
    }

    #[test]
    fn window_subtracts_the_reading_a_window_ago() {
        let mut windows = Windows::new(Duration::from_secs(60));
        let start = Instant::now();
        let mut times = RequestTimes {
            duration: histogram_of(&[1_000_000; 10]),
            ..RequestTimes::default()
        };
        // First reading: everything so far.
        let count = |delta: Option<WindowDelta>| {
            delta.map(|delta| {
                (0..HISTOGRAM_BUCKETS)
                    .map(delta.in_buckets(PARTS[1]))
                    .sum::<u64>()
            })
        };
        assert_eq!(count(windows.delta(1, start, &Arc::new(times))), Some(10));
        times.duration.add(&histogram_of(&[2_000_000; 5]));
        let delta = windows.delta(1, start + Duration::from_secs(30), &Arc::new(times));
        assert_eq!(count(delta), Some(5));
        times.duration.add(&histogram_of(&[3_000_000; 7]));
        // 70 s in: the 30 s reading is not 60 s old yet, so the first one stays the base.
        let delta = windows.delta(1, start + Duration::from_secs(70), &Arc::new(times));
        assert_eq!(count(delta), Some(12));
        let delta = windows.delta(1, start + Duration::from_secs(95), &Arc::new(times));
        assert_eq!(count(delta), Some(7), "base moved to the 30 s reading");
        // Nothing finished since: the 7 stay in the window until it passes them.
        let delta = windows.delta(1, start + Duration::from_secs(96), &Arc::new(times));
        assert_eq!(count(delta), Some(7));
        // The same reading again (the kernel read's kept copy): still the 7.
        let kept = Arc::new(times);
        let delta = windows.delta(1, start + Duration::from_secs(97), &kept);
        assert_eq!(count(delta), Some(7));
        let delta = windows.delta(1, start + Duration::from_secs(98), &kept);
        assert_eq!(count(delta), Some(7));
        let delta = windows.delta(1, start + Duration::from_secs(200), &Arc::new(times));
        assert_eq!(count(delta), None, "nothing finished in the last minute");
        // A reset (id reused) starts over.
        let fresh = RequestTimes::default();
        let delta = windows.delta(1, start + Duration::from_secs(201), &Arc::new(fresh));
        assert_eq!(count(delta), None);
        assert_eq!(
            count(windows.delta(2, start, &Arc::new(fresh))),
            None,
            "a first reading of nothing"
        );
        windows.retain(&[]);
        assert!(windows.history.is_empty());
    }
}

/// Property tests (the reducers' fuzz target): a quantile of any histogram lies within
/// its recorded range and never falls as `q` rises.
#[cfg(test)]
mod properties {
    use poolscope_shared::{HISTOGRAM_BUCKETS, histogram_bucket_bounds};
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn quantiles_stay_in_range_and_rise_with_q(
            counts in proptest::collection::vec((0..HISTOGRAM_BUCKETS, 1u64..1000), 1..30),
            mut qs in proptest::collection::vec(0.0f64..=1.0, 2..8),
        ) {
            let mut histogram = Histogram::default();
            for &(bucket, count) in &counts {
                histogram.buckets[bucket] += count;
            }
            let lowest = counts.iter().map(|c| c.0).min().unwrap_or_default();
            let highest = counts.iter().map(|c| c.0).max().unwrap_or_default();
            let floor = histogram_bucket_bounds(lowest).0 as f64 / 1e9;
            let ceiling = histogram_bucket_bounds(highest).1 as f64 / 1e9;
            qs.sort_by(f64::total_cmp);
            let mut previous = 0.0;
            for q in qs {
                let [value] = quantiles(&histogram, [q])
                    .ok_or_else(|| TestCaseError::fail("no quantile of a non-empty histogram"))?;
                prop_assert!(value >= floor && value <= ceiling, "q {} = {} outside [{}, {}]", q, value, floor, ceiling);
                prop_assert!(value >= previous, "q {} = {} below {}", q, value, previous);
                previous = value;
            }
        }

        #[test]
        fn quantiles_in_one_pass_are_each_by_its_definition(
            counts in proptest::collection::vec((0..HISTOGRAM_BUCKETS, 1u64..1000), 1..30),
            mut qs in proptest::array::uniform4(0.0f64..=1.0),
        ) {
            let mut histogram = Histogram::default();
            for &(bucket, count) in &counts {
                histogram.buckets[bucket] += count;
            }
            qs.sort_by(f64::total_cmp);
            let found = quantiles(&histogram, qs)
                .ok_or_else(|| TestCaseError::fail("no quantiles of a non-empty histogram"))?;
            // By definition: the middle of the first bucket whose cumulative count
            // reaches the rank (at least the first value).
            let total: u64 = histogram.buckets.iter().sum();
            for (q, value) in qs.into_iter().zip(found) {
                let rank = (q * total as f64).max(1.0);
                let mut cumulative = 0;
                let index = histogram
                    .buckets
                    .iter()
                    .position(|&in_bucket| {
                        cumulative += in_bucket;
                        cumulative as f64 >= rank
                    })
                    .unwrap_or(HISTOGRAM_BUCKETS - 1);
                let (lower, upper) = histogram_bucket_bounds(index);
                prop_assert_eq!(value, (lower + upper) as f64 / 2.0 / 1e9, "q {}", q);
            }
        }

        /// A window's quantiles, taken bucket by bucket from the reading now less the
        /// base, are those of the requests finished in between, in each part.
        #[test]
        fn window_quantiles_are_those_of_what_finished_since_the_base(
            before in proptest::collection::vec((0..3usize, 0..HISTOGRAM_BUCKETS, 1u64..1000), 0..30),
            since in proptest::collection::vec((0..3usize, 0..HISTOGRAM_BUCKETS, 1u64..1000), 1..30),
            mut qs in proptest::array::uniform4(0.0f64..=1.0),
        ) {
            let record = |times: &mut RequestTimes, counts: &[(usize, usize, u64)]| {
                for &(part, bucket, count) in counts {
                    let histogram = match part {
                        0 => &mut times.queue,
                        1 => &mut times.duration,
                        _ => &mut times.latency,
                    };
                    histogram.buckets[bucket] += count;
                }
            };
            let (mut base, mut finished) = (RequestTimes::default(), RequestTimes::default());
            record(&mut base, &before);
            record(&mut finished, &since);
            let mut now = base;
            record(&mut now, &since);
            let delta = WindowDelta { now: Arc::new(now), base: Some(Arc::new(base)) };
            qs.sort_by(f64::total_cmp);
            for part in PARTS {
                prop_assert_eq!(delta.quantiles(part, qs), quantiles(part(&finished), qs));
            }
        }
    }
}
