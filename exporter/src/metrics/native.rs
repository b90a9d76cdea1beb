//! The kernel's fine duration histograms as Prometheus native histograms (sparse,
//! exponential buckets; one series per histogram), for scrapers that ask for the
//! protobuf exposition.
//!
//! The fine buckets are log-linear in nanoseconds (8 linear sub-buckets per power of
//! two); a native schema's buckets are exponential in seconds, so no schema's bounds
//! coincide with them. Schema 4 (16 buckets per power of two, each 4.4 % wide) is the
//! coarsest in which every fine bucket gets a native bucket of its own: each fine
//! bucket's count goes whole into the native bucket that holds the fine bucket's
//! middle. Nothing the kernel tells apart is merged (the mapping is one-to-one, so the
//! fine counts can be read back), no count is split (bucket counts stay integers and
//! only grow, as Prometheus requires of a counter), and a value is placed at most half
//! a fine bucket plus one native bucket from where it was: the window quantiles'
//! half-bucket error plus 4.4 %.
use poolscope_shared::{HISTOGRAM_BUCKETS, Histogram, histogram_bucket_bounds};

use crate::encode::NativeBuckets;

/// Buckets per power of two: 2^SCHEMA.
pub const SCHEMA: i32 = 4;

/// The native bucket (schema [`SCHEMA`]) that holds `seconds` > 0: bucket `i` holds
/// (2^((i-1)/16), 2^(i/16)].
fn native_index(seconds: f64) -> i32 {
    (seconds.log2() * f64::from(1 << SCHEMA)).ceil() as i32
}

/// The zero bucket: the fine bucket 0, [0, 1024 ns).
const ZERO_THRESHOLD_SECONDS: f64 = histogram_bucket_bounds(0).1 as f64 / 1e9;

/// Seconds at the middle of fine bucket `index`.
fn middle_seconds(index: usize) -> f64 {
    let (lower, upper) = histogram_bucket_bounds(index);
    (lower + upper) as f64 / 2.0 / 1e9
}

/// `histogram` as a native histogram of schema [`SCHEMA`]; only the buckets that
/// counted something.
pub fn native_buckets(histogram: &Histogram) -> NativeBuckets {
    let positive = (1..HISTOGRAM_BUCKETS)
        .filter(|&index| histogram.buckets[index] > 0)
        .map(|index| {
            (
                native_index(middle_seconds(index)),
                histogram.buckets[index],
            )
        })
        .collect();
    NativeBuckets {
        schema: SCHEMA,
        zero_threshold: ZERO_THRESHOLD_SECONDS,
        zero_count: histogram.buckets[0],
        positive,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bounds of native bucket `index`, in seconds.
    fn native_bounds(index: i32) -> (f64, f64) {
        let base = 2f64.powf(1.0 / f64::from(1 << SCHEMA));
        (base.powi(index - 1), base.powi(index))
    }

    #[test]
    fn every_fine_bucket_has_a_native_bucket_of_its_own_near_it() {
        let mut previous = i32::MIN;
        for index in 1..HISTOGRAM_BUCKETS {
            let native = native_index(middle_seconds(index));
            assert!(
                native > previous,
                "fine buckets {} and {index} merged",
                index - 1
            );
            previous = native;
            // The native bucket holds the fine bucket's middle, and is no wider than
            // 4.5 % of it: a value moves at most half a fine bucket plus that.
            let (lower, upper) = native_bounds(native);
            let middle = middle_seconds(index);
            assert!(
                lower < middle && middle <= upper * (1.0 + 1e-12),
                "bucket {index}"
            );
            assert!(upper / lower < 1.045);
        }
        // The coarser schema 3 would merge some (8 exponential buckets per octave
        // against 8 linear ones, bounds not aligned).
        let merged = (2..HISTOGRAM_BUCKETS).any(|index| {
            let schema3 = |i: usize| (middle_seconds(i).log2() * 8.0).ceil() as i32;
            schema3(index) == schema3(index - 1)
        });
        assert!(merged, "schema 3 would do: use it");
    }

    #[test]
    fn counts_go_whole_into_their_buckets() {
        let mut histogram = Histogram::default();
        histogram.buckets[0] = 2;
        histogram.buckets[40] = 5;
        histogram.buckets[41] = 1;
        histogram.buckets[HISTOGRAM_BUCKETS - 1] = 3;
        let native = native_buckets(&histogram);
        assert_eq!(native.zero_count, 2);
        assert!((native.zero_threshold - 1.024e-6).abs() < 1e-15);
        let counts: Vec<u64> = native.positive.iter().map(|&(_, count)| count).collect();
        assert_eq!(counts, [5, 1, 3]);
        let (lower, upper) = native_bounds(native.positive[0].0);
        let (fine_lower, fine_upper) = histogram_bucket_bounds(40);
        assert!(lower * 1e9 < fine_upper as f64 && upper * 1e9 > fine_lower as f64);
    }
}
