//! `/debug/locks`: the top contended locks' stacks read from the kernel, symbolized
//! with the request's own symbolizer, and rendered as text or JSON.
use std::fmt::Write as _;

use serde::Serialize;

use crate::{
    kernel::Kernel,
    metrics::locks::LockReport,
    stacks::symbolize::{Symbol, Symbols, lookup_addresses},
};

/// `/debug/locks` as text: one block per lock, its stacks indented below it.
pub fn render_text(service: &str, locks: &[LockReport]) -> String {
    let mut text = format!("# top contended locks of service {service}, most wait first\n");
    for lock in locks {
        let _ = writeln!(
            text,
            "lock {} pid {}: wait {:.6} s in {} waits ({} timed), p50 {:.6} s, p99 {:.6} s",
            lock.address,
            lock.pid,
            lock.wait_seconds,
            lock.waits,
            lock.timed_waits,
            lock.p50_seconds,
            lock.p99_seconds
        );
        for stack in &lock.stacks {
            let _ = writeln!(
                text,
                "  stack: wait {:.6} s in {} {}waits",
                stack.wait_seconds,
                stack.waits,
                if stack.timed { "timed " } else { "" }
            );
            if stack.frames.is_empty() {
                text.push_str("    (stack not captured)\n");
            }
            for frame in &stack.frames {
                let _ = writeln!(text, "    {frame}");
            }
        }
    }
    text
}

/// `/debug/locks?format=json`.
pub fn render_json(service: &str, locks: &[LockReport]) -> String {
    #[derive(Serialize)]
    struct Body<'a> {
        service: &'a str,
        locks: &'a [LockReport],
    }
    serde_json::to_string_pretty(&Body { service, locks })
        .map(|mut json| {
            json.push('\n');
            json
        })
        .unwrap_or_else(|error| format!("{{\"error\": \"{error}\"}}\n"))
}

/// Reads the addresses of every stack of `locks` from the kernel.
pub fn read_stacks(kernel: &Kernel, locks: &mut [LockReport]) {
    for stack in locks.iter_mut().flat_map(|lock| &mut lock.stacks) {
        stack.addresses = kernel.lock_stack(stack.stack_id).unwrap_or_default();
    }
}

/// Symbolizes the stacks of `locks` (addresses read by [`read_stacks`]) with a
/// symbolizer of this request: nothing is cached between requests.
pub fn symbolize(symbols: &Symbols, locks: &mut [LockReport]) {
    for lock in locks {
        for stack in &mut lock.stacks {
            let lookups: Vec<u64> = lookup_addresses(&stack.addresses).collect();
            stack.frames = symbols
                .user(lock.pid, &lookups, &[])
                .iter()
                .map(Symbol::describe)
                .collect();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::locks::{
        tests::{histogram, key},
        top_locks,
    };

    #[test]
    fn text_and_json_name_every_lock_and_frame() {
        let mut locks = top_locks(&[(key(7, 3, 0xabc), histogram(&[4_000]))], |_| true, 10);
        locks[0].stacks[0].frames = vec!["__lll_lock_wait+0x2a (libc.so.6)".to_owned()];
        let text = render_text("web", &locks);
        assert!(text.contains("lock 0xabc pid 7: wait 0.000004 s in 1 waits (0 timed)"));
        assert!(text.contains("  stack: wait 0.000004 s in 1 waits\n"));
        assert!(text.contains("    __lll_lock_wait+0x2a (libc.so.6)\n"));
        let json: serde_json::Value =
            serde_json::from_str(&render_json("we\"b", &locks)).unwrap_or_default();
        assert_eq!(json["service"], "we\"b");
        assert_eq!(json["locks"][0]["waits"], 1);
        assert_eq!(
            json["locks"][0]["stacks"][0]["frames"][0],
            "__lll_lock_wait+0x2a (libc.so.6)"
        );
    }
}
