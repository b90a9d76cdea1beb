//! The lock benchmark's report: its tables and goals.

use super::{
    FutexStats, GOAL_LOCKS_THROUGHPUT_RATIO, GOAL_UNCONTENDED_RATIO, LOCK_CLIENTS, LOCK_WORKERS,
    LockMode, LockRound, Side, or_dash,
};
use crate::bench::{met, min_median, min_median_where};

/// (min, median) of one quantity over the rounds of a mode.
fn of_lock_mode(
    rounds: &[LockRound],
    mode: LockMode,
    pick: impl Fn(&LockRound) -> f64,
) -> (f64, f64) {
    min_median_where(rounds, |r| r.mode == mode, pick)
}

pub(super) fn locks_report(rounds: &[LockRound], hold_us: u64) {
    let of = |mode, pick: fn(&LockRound) -> f64| of_lock_mode(rounds, mode, pick);
    let rate = |mode| of(mode, |r| r.requests_per_second);
    let in_request = |mode| of(mode, |r| r.pair_ns_in_request);
    let outside = |mode| of(mode, |r| r.pair_ns_outside);
    let (rate_off_min, rate_off) = rate(LockMode::Off);
    let (_, in_request_off) = in_request(LockMode::Off);
    let (_, outside_off) = outside(LockMode::Off);

    println!();
    println!(
        "| lockserver {LOCK_WORKERS} workers, 1 mutex held {hold_us} µs, {LOCK_CLIENTS} clients \
         | requests/s median (min) | /off median | /off min | futex waits/request (poolscope) \
         median | blocked lock calls/call (lockserver) median |"
    );
    println!("|---|---|---|---|---|---|");
    for mode in LockMode::ALL {
        let (rate_min, rate_median) = rate(mode);
        let (_, waits) = of(mode, |r| r.waits_per_request);
        let (_, blocked) = of(mode, |r| r.blocked_per_call);
        println!(
            "| {} | {rate_median:.0} ({rate_min:.0}) | {:.4} | {:.4} | {} | {blocked:.3} |",
            mode.name(),
            rate_median / rate_off,
            rate_min / rate_off_min,
            or_dash(waits, 3),
        );
    }

    println!();
    println!(
        "| mutexloop, uncontended lock/unlock pair | in a request: ns median (min) | minus off \
         | outside a request: ns median (min) | minus off | pthread_mutex waits recorded per \
         call: in a request / outside |"
    );
    println!("|---|---|---|---|---|---|");
    for mode in LockMode::ALL {
        let (in_min, in_median) = in_request(mode);
        let (out_min, out_median) = outside(mode);
        let (_, recorded_in) = of(mode, |r| r.recorded_in_request);
        let (_, recorded_out) = of(mode, |r| r.recorded_outside);
        println!(
            "| {} | {in_median:.2} ({in_min:.2}) | {:+.2} | {out_median:.2} ({out_min:.2}) \
             | {:+.2} | {} / {} |",
            mode.name(),
            in_median - in_request_off,
            out_median - outside_off,
            or_dash(recorded_in, 3),
            or_dash(recorded_out, 3),
        );
    }

    println!();
    let futex_rounds: Vec<&FutexStats> = rounds
        .iter()
        .filter_map(|r| r.futex_stats.as_ref())
        .collect();
    let stat = |pick: &dyn Fn(&FutexStats) -> f64| {
        let mut values: Vec<f64> = futex_rounds.iter().map(|s| pick(s)).collect();
        min_median(&mut values)
    };
    println!(
        "| futex rounds, bpf_stats on | requests/s median | futex waits/request median \
         | switches/request median | sched_switch ns/run median | sched_wakeup ns/run median \
         | sched BPF ns/request median (min) |"
    );
    println!("|---|---|---|---|---|---|---|");
    let sides: [(String, Side); 2] = [
        (format!("contended ({LOCK_WORKERS} workers)"), |s| {
            &s.contended
        }),
        ("uncontended (1 worker)".to_owned(), |s| &s.uncontended),
    ];
    for (name, side) in &sides {
        let (_, rate) = stat(&|s| side(s).requests_per_second);
        let (_, waits) = stat(&|s| side(s).waits_per_request());
        let (_, switches) = stat(&|s| side(s).switches_per_request());
        let (_, switch) = stat(&|s| side(s).switch_ns_per_run());
        let (_, wakeup) = stat(&|s| side(s).wakeup_ns_per_run());
        let (ns_min, ns_median) = stat(&|s| side(s).sched_ns_per_request());
        println!(
            "| {name} | {rate:.0} | {waits:.3} | {switches:.2} | {switch:.1} | {wakeup:.1} \
             | {ns_median:.0} ({ns_min:.0}) |"
        );
    }
    let (extra_min, extra) = stat(&FutexStats::extra_ns_per_wait);
    let per_round: Vec<String> = futex_rounds
        .iter()
        .map(|s| format!("{:.0}", s.extra_ns_per_wait()))
        .collect();
    let (_, extra_switches) = stat(&|s| {
        (s.contended.switches_per_request() - s.uncontended.switches_per_request())
            / s.contended.waits_per_request()
    });
    println!();
    println!(
        "Extra BPF ns per futex lock wait: {extra:.0} median ({extra_min:.0} min; rounds {}): \
         (contended − uncontended) sched_switch + sched_wakeup ns per request, over the \
         contended server's futex waits per request. It includes the switches and wakeups a \
         wait causes ({extra_switches:.2} more switches per wait, median) \
         besides the lock work itself (registers, user stack, per-lock histogram); bpf_stats \
         adds its own clock reads to every run.",
        per_round.join(", ")
    );
    let (_, uprobe_bpf) = of(LockMode::Uprobes, |r| r.uprobe_bpf_ns_per_call);
    let (_, uprobe_in) = in_request(LockMode::Uprobes);
    let (_, uprobe_out) = outside(LockMode::Uprobes);
    println!(
        "Uprobes: a lock call costs {:+.0} ns in a request and {:+.0} ns outside one \
         (uncontended; median, minus off); their programs (mutex_lock_enter + \
         mutex_lock_return, bpf_stats on) {uprobe_bpf:.0} ns of it, the rest is the two \
         traps (entry and return) every call pays, contended or not, recorded or not.",
        uprobe_in - in_request_off,
        uprobe_out - outside_off,
    );

    println!();
    println!(
        "Goals: uncontended locks cost nothing in the default mode (no uprobes): a lock/unlock \
         pair ≤ {:.0}% slower than off; lock-heavy throughput with poolscope on (futex) ≥ {:.0}% \
         of off (medians of rounds).",
        (GOAL_UNCONTENDED_RATIO - 1.0) * 100.0,
        GOAL_LOCKS_THROUGHPUT_RATIO * 100.0
    );
    let (_, in_futex) = in_request(LockMode::Futex);
    let (_, out_futex) = outside(LockMode::Futex);
    let (rate_futex_min, rate_futex) = rate(LockMode::Futex);
    let (in_ratio, out_ratio) = (in_futex / in_request_off, out_futex / outside_off);
    let throughput = rate_futex / rate_off;
    println!(
        "futex    uncontended pair {:.1}% of off in a request, {:.1}% outside: {}; lock-heavy \
         throughput {:.2}% of off (min {:.2}%): {}",
        in_ratio * 100.0,
        out_ratio * 100.0,
        met(in_ratio <= GOAL_UNCONTENDED_RATIO && out_ratio <= GOAL_UNCONTENDED_RATIO),
        throughput * 100.0,
        rate_futex_min / rate_off_min * 100.0,
        met(throughput >= GOAL_LOCKS_THROUGHPUT_RATIO),
    );
    let (rate_uprobes_min, rate_uprobes) = rate(LockMode::Uprobes);
    println!(
        "uprobes  uncontended pair {:.0}× off in a request, {:.0}× outside; lock-heavy \
         throughput {:.2}% of off (min {:.2}%) (opt-in: no goal)",
        uprobe_in / in_request_off,
        uprobe_out / outside_off,
        rate_uprobes / rate_off * 100.0,
        rate_uprobes_min / rate_off_min * 100.0,
    );
    println!(
        "Why lock_uprobes is off by default: every pthread_mutex_lock call of a process with \
         them traps twice into the kernel (+{:.0} ns here, {:.0}× an uncontended pair's \
         {in_request_off:.1} ns), in a request or not, contended or not; futex waits cost only \
         the lock calls that block.",
        uprobe_in - in_request_off,
        (uprobe_in - in_request_off) / in_request_off
    );
    for round in rounds.iter().filter(|r| r.disturbance.skews()) {
        println!("{} round{}", round.mode.name(), round.disturbance.note());
    }
}
