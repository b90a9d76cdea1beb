//! The clock user space shares with the kernel programs.

/// CLOCK_MONOTONIC in ns, the clock of `bpf_ktime_get_ns`: timestamps read here and
/// in the kernel's maps compare.
pub fn monotonic_ns() -> u64 {
    // SAFETY: zeroed timespec is valid; clock_gettime only writes it.
    let mut now: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}
