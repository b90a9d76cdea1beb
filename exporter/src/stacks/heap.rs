//! How poolscope's heap gives memory back to the kernel. Each stack drain symbolizes
//! with a fresh blazesym cache (the ELF, DWARF and kallsyms of every watched binary,
//! tens of MB) and frees it after; with glibc's defaults RSS then follows the largest
//! drain ever seen and the scattering of what outlives a drain, not what poolscope
//! holds. Both calls are no-ops on other C libraries.

/// Allocations from this size up get their own mapping, unmapped when freed.
/// glibc's default threshold starts here too but rises with each large block freed
/// (up to 32 MiB): the symbolizer's buffers then come from the per-thread arenas,
/// grow them to 30+ MB, and the small allocations that outlive a drain, spread
/// across those arenas, keep their pages resident. Side by side for 28 minutes, the
/// lowest RSS of each minute after warm-up was 31.1-35.0 MB and creeping with the
/// default, 23.0-25.0 MB and flat with this fixed threshold (README, Limits).
const MMAP_THRESHOLD_BYTES: i32 = 128 * 1024;

/// Fixes the mmap threshold (see [`MMAP_THRESHOLD_BYTES`]); call once, at start-up.
pub fn map_large_allocations_apart() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt takes two integers and only changes the allocator's settings.
    if unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) } != 1 {
        tracing::warn!(
            threshold = MMAP_THRESHOLD_BYTES,
            "glibc refused the mmap threshold: RSS may creep with each stack drain"
        );
    }
}

/// Gives the heap's free pages back to the kernel: glibc keeps freed memory in its
/// per-thread arenas, so RSS would otherwise climb in steps to the largest drain ever
/// seen (a 30-minute soak measured a 29 MB step at minute 26).
pub fn release_freed() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes no pointer; it only walks the allocator's free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}
