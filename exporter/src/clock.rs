//! The clocks user space reads: the one it shares with the kernel programs, and others
//! by id.

/// CLOCK_MONOTONIC in ns, the clock of `bpf_ktime_get_ns`: timestamps read here and
/// in the kernel's maps compare.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC).unwrap_or(0)
}

/// `clock` in ns; `None` if the kernel does not have it.
pub fn clock_ns(clock: libc::clockid_t) -> Option<u64> {
    // SAFETY: zeroed timespec is valid; clock_gettime only writes it.
    let mut now: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid pointer to a timespec.
    (unsafe { libc::clock_gettime(clock, &mut now) } == 0)
        .then(|| now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64)
}
