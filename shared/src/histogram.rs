//! Duration histograms in the kernel's fine log-linear buckets, and their bucket math.

/// Buckets of a [`Histogram`]: bucket 0 holds [0, 1024 ns); then 8 linear
/// sub-buckets per power of two from 2^10 ns to 2^38 ns (~275 s), each at most
/// 1/8 of its lower bound wide; the last bucket also takes everything longer.
pub const HISTOGRAM_BUCKETS: usize = 1 + HISTOGRAM_OCTAVES as usize * 8;
const HISTOGRAM_OCTAVES: u32 = 28;
const HISTOGRAM_FIRST_OCTAVE: u32 = 10;
const SUB_BUCKET_BITS: u32 = 3;

/// floor(log2(value)) for value > 0, without loops (the BPF verifier dislikes them).
pub const fn log2_floor(mut value: u64) -> u32 {
    let mut log = 0;
    if value >= 1 << 32 {
        value >>= 32;
        log += 32;
    }
    if value >= 1 << 16 {
        value >>= 16;
        log += 16;
    }
    if value >= 1 << 8 {
        value >>= 8;
        log += 8;
    }
    if value >= 1 << 4 {
        value >>= 4;
        log += 4;
    }
    if value >= 1 << 2 {
        value >>= 2;
        log += 2;
    }
    if value >= 1 << 1 {
        log += 1;
    }
    log
}

/// The bucket of a duration in ns.
pub const fn histogram_bucket(ns: u64) -> usize {
    if ns < 1 << HISTOGRAM_FIRST_OCTAVE {
        return 0;
    }
    let octave = log2_floor(ns);
    // Past the last octave, tested before any index is computed: the compiler splits
    // log2_floor's branches into constant octaves, and on the top one an index past
    // the end, clamped after, leaves a path that Linux 6.1's verifier cannot prove
    // dead (it then refuses every program that counts into a histogram).
    if octave >= HISTOGRAM_FIRST_OCTAVE + HISTOGRAM_OCTAVES {
        return HISTOGRAM_BUCKETS - 1;
    }
    let sub = (ns >> (octave - SUB_BUCKET_BITS)) & 7;
    1 + (octave - HISTOGRAM_FIRST_OCTAVE) as usize * 8 + sub as usize
}

/// Lower and upper bound in ns of a bucket (the last one's upper bound is nominal).
pub const fn histogram_bucket_bounds(index: usize) -> (u64, u64) {
    if index == 0 {
        return (0, 1 << HISTOGRAM_FIRST_OCTAVE);
    }
    let octave = HISTOGRAM_FIRST_OCTAVE + ((index - 1) / 8) as u32;
    let sub = ((index - 1) % 8) as u64;
    let step = 1u64 << (octave - SUB_BUCKET_BITS);
    ((8 + sub) * step, (9 + sub) * step)
}

/// A duration histogram in the kernel's fine buckets, with the exact sum.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Histogram {
    pub buckets: [u64; HISTOGRAM_BUCKETS],
    pub sum_ns: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Self {
            buckets: [0; HISTOGRAM_BUCKETS],
            sum_ns: 0,
        }
    }
}

impl Histogram {
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// Bucket-wise sum.
    pub fn add(&mut self, other: &Self) {
        for (sum, value) in self.buckets.iter_mut().zip(other.buckets.iter()) {
            *sum += value;
        }
        self.sum_ns += other.sum_ns;
    }
}

const _: () = assert!(core::mem::size_of::<Histogram>() == (HISTOGRAM_BUCKETS + 1) * 8);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_the_range_without_gaps() {
        let mut previous_upper = 0;
        for index in 0..HISTOGRAM_BUCKETS {
            let (lower, upper) = histogram_bucket_bounds(index);
            assert_eq!(lower, previous_upper, "gap before bucket {index}");
            assert_eq!(histogram_bucket(lower), index);
            assert_eq!(histogram_bucket(upper - 1), index);
            if index > 0 {
                // 8 sub-buckets per octave: width at most 1/8 of the lower bound.
                assert!((upper - lower) * 8 <= lower, "bucket {index} too wide");
            }
            previous_upper = upper;
        }
        assert_eq!(histogram_bucket(u64::MAX), HISTOGRAM_BUCKETS - 1);
        assert!(histogram_bucket_bounds(HISTOGRAM_BUCKETS - 1).0 > 60_000_000_000);
    }

    #[test]
    fn log2_of_powers_and_neighbours() {
        for bit in 0..64 {
            let value = 1u64 << bit;
            assert_eq!(log2_floor(value), bit);
            if bit > 1 {
                assert_eq!(log2_floor(value - 1), bit - 1);
            }
        }
    }
}
