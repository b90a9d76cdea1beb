//! The gauges' recount (`metrics/recount.rs`), run by the sampling loop every second
//! when due: the sockets' storage is read outside the core lock (a dump of the
//! network namespace's sockets takes milliseconds on a busy host, which scrapes must
//! not wait for); the syscall backend's `CONNS` (a few batch reads) and the counters
//! before and after are read under it.
use std::{collections::BTreeMap, time::Instant};

use poolscope_shared::ServiceCounters;

use super::{Exporter, lock_or_recover};
use crate::{
    discovery::live::{self, LiveCounts},
    kernel::{Backend, WatchTable as _},
    metrics::recount,
};

impl Exporter {
    /// Recounts the gauges if due, given every service's `counters` as just read: each
    /// service the connection state fully holds whose counters do not move across the
    /// read takes its live entries as its gauges' truth.
    pub fn recount_gauges(&self, counters: &BTreeMap<u32, ServiceCounters>) {
        let now = Instant::now();
        let own = self.own_network_namespace();
        let (ids, epochs, watched, state) = {
            let mut core = lock_or_recover(&self.core);
            let core = &mut *core;
            if !core.recount.due(counters, now) {
                return;
            }
            let in_sockets = core.kernel.backend() != Backend::Syscall;
            let watched: BTreeMap<u32, u64> = core
                .kernel
                .watched_pids()
                .into_iter()
                .map(|(pid, watch)| (pid, watch.since_ns))
                .collect();
            let (ids, passed): (Vec<u32>, Vec<u32>) = counters
                .keys()
                .partition(|&&id| core.targets.recountable(id, &watched, in_sockets, own));
            for id in passed {
                if let Some(counters) = counters.get(&id) {
                    core.recount.pass(id, counters);
                }
            }
            let epochs = core.kernel.service_epochs(&ids);
            match core.kernel.connection_state() {
                Ok(state) => (ids, epochs, watched, state),
                Err(error) => {
                    core.recount.ran(now, false);
                    tracing::warn!(%error, "recounting the gauges failed: the connection state");
                    return;
                }
            }
        };
        let read_start = Instant::now();
        let live = live::live_counts(&state, &epochs, &watched);
        tracing::debug!(
            seconds = read_start.elapsed().as_secs_f64(),
            services = ids.len(),
            "recount: read the connection state"
        );
        let mut core = lock_or_recover(&self.core);
        let core = &mut *core;
        core.recount.ran(now, live.is_ok());
        let live: LiveCounts = match live {
            Ok(live) => live,
            Err(error) => {
                tracing::warn!(%error, "recounting the gauges failed: reading the connection state");
                return;
            }
        };
        let after = match core.kernel.read_services(&ids) {
            Ok(after) => after,
            Err(error) => {
                tracing::warn!(%error, "recounting the gauges failed: reading the counters again");
                return;
            }
        };
        for id in ids {
            let (Some(before), Some(after)) = (counters.get(&id), after.get(&id)) else {
                continue;
            };
            // Counters that moved had events during the read: its entries are not
            // one instant's.
            if before != after {
                continue;
            }
            let corrections = core.targets.corrections_of(id);
            let counted = recount::counted(before, &corrections);
            let entries = live.get(&id).copied().unwrap_or_default();
            let offsets =
                core.recount
                    .correct((id, before), counted, &entries, &corrections.recounted);
            if offsets != corrections.recounted {
                tracing::warn!(
                    service = core.targets.service_name(id).unwrap_or("?"),
                    counted = ?counted,
                    live = ?entries,
                    "a gauge was off its live connections (an update the kernel lost); corrected"
                );
                core.targets.set_recounted(id, offsets);
            }
        }
    }
}
