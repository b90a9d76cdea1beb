//! Whether poolscope is degraded now: each loss counter's current value ([`Loss`]),
//! the [`HealthTracker`] that remembers when each last rose, and its verdict
//! ([`Health`]) with a [`Cause`] and its advice per counter that degrades.
use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use super::LossKind;

/// One loss counter's current value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Loss {
    pub kind: LossKind,
    pub value: u64,
}

/// Why poolscope is degraded now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cause {
    pub kind: LossKind,
    pub value: u64,
    pub advice: String,
}

/// Degraded while `causes` is not empty.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Health {
    pub causes: Vec<Cause>,
}

impl Health {
    pub fn degraded(&self) -> bool {
        !self.causes.is_empty()
    }

    /// The `/healthz` body: `ok`, or `degraded` and one line per cause.
    pub fn report(&self, degraded_for: Duration) -> String {
        if !self.degraded() {
            return "ok\n".to_owned();
        }
        let mut report = "degraded\n".to_owned();
        for cause in &self.causes {
            let when = if cause.kind.is_gauge() {
                "now".to_owned()
            } else {
                format!(
                    "rose in the last {}",
                    humantime::format_duration(degraded_for)
                )
            };
            report.push_str(&format!(
                "{} = {} ({when}): {}\n",
                cause.kind, cause.value, cause.advice
            ));
        }
        report
    }
}

/// Remembers each counter's last value and when it last rose.
#[derive(Debug)]
pub struct HealthTracker {
    degraded_for: Duration,
    counters: HashMap<LossKind, (u64, Option<Instant>)>,
    /// The last observation (what `/healthz` shows).
    last: Health,
    /// Each map's size, for the advice.
    capacities: BTreeMap<&'static str, u64>,
}

impl HealthTracker {
    pub fn new(degraded_for: Duration, capacities: BTreeMap<&'static str, u64>) -> Self {
        Self {
            degraded_for,
            counters: HashMap::new(),
            last: Health::default(),
            capacities,
        }
    }

    pub fn degraded_for(&self) -> Duration {
        self.degraded_for
    }

    /// A new `limits.degraded_for` (SIGHUP).
    pub fn set_degraded_for(&mut self, degraded_for: Duration) {
        self.degraded_for = degraded_for;
    }

    /// The health given the counters' values at `now`. A counter seen for the first
    /// time counts as risen if above 0: poolscope just started, and it lost already.
    pub fn observe(&mut self, now: Instant, losses: &[Loss]) -> Health {
        let mut causes = Vec::new();
        for loss in losses {
            if !loss.kind.degrades() {
                continue;
            }
            let active = if loss.kind.is_gauge() {
                loss.value > 0
            } else {
                let (last, rose) = self.counters.entry(loss.kind.clone()).or_insert((0, None));
                if loss.value > *last {
                    *rose = Some(now);
                }
                *last = loss.value;
                rose.is_some_and(|rose| now.duration_since(rose) < self.degraded_for)
            };
            if active {
                let map_capacity = match &loss.kind {
                    LossKind::MapUpdate { map, .. } => self.capacities.get(map).copied(),
                    _ => None,
                };
                causes.push(Cause {
                    kind: loss.kind.clone(),
                    value: loss.value,
                    advice: loss.kind.advice(map_capacity),
                });
            }
        }
        causes.sort_by(|a, b| a.kind.cmp(&b.kind));
        let health = Health { causes };
        self.log_changes(&health);
        self.last = health.clone();
        health
    }

    /// The last observation.
    pub fn last(&self) -> &Health {
        &self.last
    }

    fn log_changes(&self, health: &Health) {
        let was = |kind: &LossKind| self.last.causes.iter().any(|cause| cause.kind == *kind);
        for cause in &health.causes {
            if !was(&cause.kind) {
                tracing::warn!(
                    loss = %cause.kind,
                    value = cause.value,
                    "poolscope is degraded: {}",
                    cause.advice
                );
            }
        }
        if !health.degraded() && self.last.degraded() {
            tracing::info!(
                "poolscope measures fully again: no loss counter rose in the last {}",
                humantime::format_duration(self.degraded_for)
            );
        }
    }
}
