//! How poolscope's heap gives memory back to the kernel. Each stack drain symbolizes
//! with a fresh blazesym cache (the ELF, DWARF and kallsyms of every watched binary,
//! tens of MB) and frees it after; with glibc's defaults RSS then follows the largest
//! drain ever seen and the scattering of what outlives a drain, not what poolscope
//! holds. These calls are no-ops on other C libraries.

/// Allocations from this size up get their own mapping, unmapped when freed.
/// glibc's default threshold starts here too but rises with each large block freed
/// (up to 32 MiB): the symbolizer's buffers then come from the per-thread arenas,
/// grow them to 30+ MB, and the small allocations that outlive a drain, spread
/// across those arenas, keep their pages resident. Side by side for 28 minutes, the
/// lowest RSS of each minute after warm-up was 31.1-35.0 MB and creeping with the
/// default, 23.0-25.0 MB and flat with this fixed threshold (docs/limits.md).
const MMAP_THRESHOLD_BYTES: i32 = 128 * 1024;

/// One arena for every thread. glibc gives threads arenas of their own (up to 8 per
/// CPU); each of poolscope's threads (the HTTP runtime's workers, the drains, the
/// rescans) then grows its own and keeps its free pages, so RSS rose in steps for
/// minutes: the 4-minute soak climbed from 14.3 to 16.7 MB (a 0.8 MB step at 1:45)
/// with peaks of 26 MB, and with one arena stayed within 13.9-14.2 MB (±1.1 %), peaks
/// 15.4 MB. poolscope allocates little outside a scrape or a drain, so the arena's
/// lock costs little (docs/limits.md).
const ARENAS: i32 = 1;

/// Sets the heap up for poolscope's pattern of use (see [`MMAP_THRESHOLD_BYTES`] and
/// [`ARENAS`]); call once, at start-up, before other threads allocate.
pub fn set_up() {
    #[cfg(target_env = "gnu")]
    for (option, value, name) in [
        (
            libc::M_MMAP_THRESHOLD,
            MMAP_THRESHOLD_BYTES,
            "mmap threshold",
        ),
        (libc::M_ARENA_MAX, ARENAS, "arena count"),
    ] {
        // SAFETY: mallopt takes two integers and only changes the allocator's settings.
        if unsafe { libc::mallopt(option, value) } != 1 {
            tracing::warn!(value, "glibc refused the {name}: RSS may creep");
        }
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
