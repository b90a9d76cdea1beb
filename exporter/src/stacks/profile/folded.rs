//! Folded stacks (Brendan Gregg's format): the merged, sorted lines that the flame
//! graph is drawn from too, weighted by the view.
use std::collections::BTreeMap;

use super::{MICROS_PER_SEC, ProfileMeta, StackKind, StackRecord, View, div_round};

/// One merged folded line, its weight split by where the time went (the flame graph
/// colors by that split).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Line {
    pub(super) stack: String,
    pub(super) on_cpu: u64,
    pub(super) off_cpu: u64,
}

impl Line {
    pub(super) fn weight(&self) -> u64 {
        self.on_cpu.saturating_add(self.off_cpu)
    }
}

/// Raw totals of the records that fold to one line; converted to the view's unit
/// only once summed, so that merging does not add up rounding errors.
#[derive(Default, Clone, Copy)]
struct Totals {
    samples: u64,
    offcpu_ns: u64,
}

/// Appends a frame name with the characters the folded format reserves (`;` between
/// frames, newline between lines) replaced; an empty name would read as a missing frame.
fn push_frame(out: &mut String, name: &str) {
    if name.is_empty() {
        out.push_str("[unknown]");
        return;
    }
    out.extend(name.chars().map(|c| {
        if matches!(c, ';' | '\n' | '\r') {
            '_'
        } else {
            c
        }
    }));
}

/// The folded stack of one record, without its weight.
fn folded_stack(record: &StackRecord) -> String {
    let mut stack = String::with_capacity(32 * (record.frames.len() + 2));
    push_frame(&mut stack, &record.pool);
    for frame in &record.frames {
        stack.push(';');
        push_frame(&mut stack, &frame.name);
        if frame.kernel {
            stack.push_str("_[k]");
        }
    }
    if let StackKind::OffCpu(reason) = record.kind {
        stack.push_str(";[off-cpu: ");
        stack.push_str(reason.name());
        stack.push(']');
    }
    stack
}

/// The view's records merged into folded lines, sorted, without zero weights.
pub(super) fn lines(records: &[&StackRecord], view: View, meta: &ProfileMeta) -> Vec<Line> {
    let mut merged: BTreeMap<String, Totals> = BTreeMap::new();
    for record in records.iter().filter(|r| view.shows(r.kind)) {
        let totals = merged.entry(folded_stack(record)).or_default();
        match record.kind {
            StackKind::Cpu => totals.samples = totals.samples.saturating_add(record.count),
            StackKind::OffCpu(_) => totals.offcpu_ns = totals.offcpu_ns.saturating_add(record.ns),
        }
    }
    merged
        .into_iter()
        .map(|(stack, totals)| Line {
            stack,
            on_cpu: on_cpu_weight(totals.samples, view, meta),
            off_cpu: div_round(u128::from(totals.offcpu_ns), 1000),
        })
        .filter(|line| line.weight() > 0)
        .collect()
}

/// On-CPU samples in the view's unit: samples in the cpu view, µs in the wall view.
fn on_cpu_weight(samples: u64, view: View, meta: &ProfileMeta) -> u64 {
    match view {
        View::Cpu => samples,
        View::OffCpu => 0,
        View::Wall => div_round(
            u128::from(samples) * MICROS_PER_SEC,
            u128::from(meta.sampling_hz),
        ),
    }
}

/// Folded stacks, one `frame;frame;... weight` line per distinct stack, outermost
/// frame (the pool) first. Weights: cpu = samples, offcpu and wall = microseconds.
pub fn folded(records: &[&StackRecord], view: View, meta: &ProfileMeta) -> String {
    let mut out = String::new();
    for line in lines(records, view, meta) {
        out.push_str(&line.stack);
        out.push(' ');
        out.push_str(&line.weight().to_string());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stacks::profile::{
        OffCpuReason,
        tests::{fixture, meta, record, refs, user},
    };

    #[test]
    fn folded_cpu_merges_and_suffixes_kernel_frames() {
        let records = fixture();
        let out = folded(&refs(&records), View::Cpu, &meta(50));
        assert_eq!(
            out,
            "burner;main;work 5\n\
             burner;main;work;sys_write_[k] 1\n"
        );
    }

    #[test]
    fn folded_offcpu_in_microseconds_with_reason_frame() {
        let records = fixture();
        let out = folded(&refs(&records), View::OffCpu, &meta(50));
        // 2_000_400 + 1_000_400 ns merged before rounding; 499 ns rounds to 0 µs and
        // the line is dropped.
        assert_eq!(
            out,
            "burner;main;pthread_mutex_lock;futex_wait_[k];[off-cpu: lock] 3001\n"
        );
    }

    #[test]
    fn folded_wall_converts_samples_to_microseconds() {
        let records = fixture();
        let out = folded(&refs(&records), View::Wall, &meta(50));
        // hz = 50: one sample is 20000 µs.
        assert_eq!(
            out,
            "burner;main;pthread_mutex_lock;futex_wait_[k];[off-cpu: lock] 3001\n\
             burner;main;work 100000\n\
             burner;main;work;sys_write_[k] 20000\n"
        );
    }

    #[test]
    fn folded_replaces_reserved_characters() {
        let records = vec![record(
            "io;pool",
            StackKind::OffCpu(OffCpuReason::Disk),
            vec![user("read file\nnow", "app", 0x2000), user("", "", 0)],
            1,
            1_500,
        )];
        let out = folded(&refs(&records), View::OffCpu, &meta(50));
        assert_eq!(out, "io_pool;read file_now;[unknown];[off-cpu: disk] 2\n");
    }

    #[test]
    fn folded_of_nothing_is_empty() {
        assert_eq!(folded(&[], View::Wall, &meta(50)), "");
    }

    #[test]
    fn folded_wall_without_sampling_keeps_offcpu() {
        let records = fixture();
        let out = folded(&refs(&records), View::Wall, &meta(0));
        assert_eq!(
            out,
            "burner;main;pthread_mutex_lock;futex_wait_[k];[off-cpu: lock] 3001\n"
        );
    }
}
