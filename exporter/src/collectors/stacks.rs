//! The stack unwinder's families: copies unwound by result, the unwind tables held
//! and evicted, and the time spent unwinding.
use super::{Collected, OwnReading, Timings};
use crate::{
    encode::{Family, Kind},
    stacks::unwind::{UnwindResult, UnwindStats},
};

pub fn collect(own: &OwnReading<'_>, _: &Timings) -> Collected {
    Collected {
        families: families(own.unwinds),
        whole: true,
    }
}

fn families(stats: &UnwindStats) -> Vec<Family> {
    let mut unwinds = Family::new(
        "stack_unwinds",
        Kind::Counter,
        "User stack copies unwound by the modules' unwind tables (one per distinct \
         stack), by result: unwound, or why the frame-pointer walk stayed.",
    );
    for result in UnwindResult::ALL {
        let count = stats.results.get(&result).copied().unwrap_or(0);
        unwinds.push(&[("result", result.name())], count as f64);
    }
    let tables = Family::new(
        "unwind_tables_bytes",
        Kind::Gauge,
        "Bytes of unwind tables (.eh_frame, .eh_frame_hdr, .debug_frame) held for \
         unwinding, within stacks.unwind_memory_bytes.",
    )
    .with(&[], stats.table_bytes as f64);
    let evicted = Family::new(
        "unwind_tables_evicted",
        Kind::Counter,
        "Modules' unwind tables evicted, least recently used first, to make room \
         within stacks.unwind_memory_bytes (read again if needed again).",
    )
    .with(&[], stats.evicted as f64);
    let seconds = Family::new(
        "stack_unwind_seconds",
        Kind::Counter,
        "Time spent unwinding stack copies, reading the unwind tables included.",
    )
    .with(&[], stats.seconds);
    vec![unwinds, tables, evicted, seconds]
}
