//! Property tests (the config parser's fuzz target): any file is accepted or refused
//! with a reason, never a panic; a refused `[limits]` value names its key.
use proptest::prelude::*;

use super::tests::load_toml;

const LIMITS: [&str; 18] = [
    "max_series",
    "max_services",
    "max_pools",
    "watched_processes",
    "threads",
    "thread_slots",
    "connections",
    "locks",
    "lock_stacks",
    "stacks",
    "stack_counts",
    "syscalls_in_flight",
    "mutex_calls_in_flight",
    "listen_ports",
    "downstreams",
    "degraded_for",
    "nonsense",
    "max_series.x",
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// A refusal names the file that was refused and what in it is wrong: a
    /// message of a prefix alone, or of another source, fails.
    #[test]
    fn any_text_is_accepted_or_refused_with_a_reason(text in any::<String>()) {
        if let Err(error) = load_toml(&text) {
            let message = error.to_string();
            prop_assert!(message.contains("poolscope.toml"), "{}", message);
            let reason = message.rsplit(": ").next().unwrap_or_default();
            prop_assert!(reason.trim().len() > 3, "{}", message);
        }
    }

    #[test]
    fn a_refused_limit_names_its_key(
        key in proptest::sample::select(LIMITS.as_slice()),
        value in prop_oneof![
            any::<i64>().prop_map(|v| v.to_string()),
            any::<bool>().prop_map(|v| v.to_string()),
            "\"[a-z0-9 ]{0,8}\"",
            Just("1.5".to_owned()),
            Just("[]".to_owned()),
        ],
    ) {
        if let Err(error) = load_toml(&format!("[limits]\n{key} = {value}\n")) {
            let message = error.to_string();
            let named = key.split('.').next().unwrap_or(key);
            prop_assert!(message.contains(named), "{} = {}: {}", key, value, message);
        }
    }
}
