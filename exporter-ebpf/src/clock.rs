//! The one clock of the kernel programs: CLOCK_MONOTONIC in ns, the clock user space
//! reads too (`targets::monotonic_ns`), so that their timestamps compare.
use aya_ebpf::helpers::bpf_ktime_get_ns;

#[inline(always)]
pub fn now_ns() -> u64 {
    // SAFETY: helper without preconditions.
    unsafe { bpf_ktime_get_ns() }
}
