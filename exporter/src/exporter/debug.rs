//! The `/debug` text endpoints: the followed threads, a service's top locks, and the
//! stack snapshots (their list and each one rendered).
use std::collections::{BTreeMap, HashSet};

use poolscope_shared::{Activity, Peer};

use super::{Exporter, lock_or_recover, lock_report};
use crate::{
    collectors::downstream::peer_label,
    discovery::pools::PoolView,
    kernel::{Readout, WatchTable},
    metrics::locks::top_locks,
    metrics::pools,
    stacks::profile::{self, View},
    web::server::{DebugError, LocksFormat, LocksQuery, StacksQuery},
};

impl Exporter {
    pub(super) fn threads_text(&self) -> String {
        let mut core = lock_or_recover(&self.core);
        let mut readout = Readout::default();
        if let Err(error) = core.kernel.read_threads(&mut readout) {
            return format!("reading threads failed: {error}\n");
        }
        let pools: BTreeMap<u32, PoolView> = core
            .pools
            .views()
            .into_iter()
            .map(|view| (view.id, view))
            .collect();
        let mut text = String::from(
            "tid\tservice\tpool\tactivity\tserving\trunning_seconds\trunnable_seconds\twaiting_on\n",
        );
        for (tid, thread, pool) in &readout.threads {
            let (running_ns, runnable_ns) = pools::thread_times(thread, readout.threads_read_ns);
            let pool = pool.and_then(|id| pools.get(&id));
            let service = core.targets.service_name(thread.service).unwrap_or("-");
            text.push_str(&format!(
                "{tid}\t{service}\t{}\t{:?}\t{}\t{:.9}\t{:.9}\t{}\n",
                pool.map_or("-", |p| p.name.as_str()),
                Activity::from_u32(thread.activity),
                thread.serving.open(),
                running_ns as f64 / 1e9,
                runnable_ns as f64 / 1e9,
                if thread.downstream == Peer::NONE {
                    "-".to_owned()
                } else {
                    peer_label(&thread.downstream)
                },
            ));
        }
        text
    }

    pub(super) fn locks_text(&self, query: &LocksQuery) -> Result<String, DebugError> {
        let mut locks = {
            let core = lock_or_recover(&self.core);
            let service = core
                .targets
                .service_id(&query.service)
                .ok_or_else(|| DebugError::UnknownService(query.service.clone()))?;
            let pids: HashSet<u32> = core
                .kernel
                .watched_pids()
                .into_iter()
                .filter(|(_, watch)| watch.service == service)
                .map(|(pid, _)| pid)
                .collect();
            let mut locks = top_locks(&core.kernel.locks(), |pid| pids.contains(&pid), query.limit);
            lock_report::read_stacks(&core.kernel, &mut locks);
            locks
        };
        self.stacks.repair_lock_stacks(&self.core, &mut locks);
        // Outside the lock: symbolization reads binaries and their debug info.
        self.health.symbolize(&self.procfs_root, |symbols| {
            lock_report::symbolize(symbols, &mut locks);
        });
        Ok(match query.format {
            LocksFormat::Text => lock_report::render_text(&query.service, &locks),
            LocksFormat::Json => lock_report::render_json(&query.service, &locks),
        })
    }

    pub(super) fn snapshots_json(&self) -> String {
        #[derive(serde::Serialize)]
        struct Body {
            snapshots: Vec<crate::stacks::snapshots::SnapshotSummary>,
        }
        let snapshots = self.stacks.summaries();
        serde_json::to_string_pretty(&Body { snapshots })
            .map(|mut json| {
                json.push('\n');
                json
            })
            .unwrap_or_else(|error| format!("{{\"error\": \"{error}\"}}\n"))
    }

    pub(super) fn snapshot_stacks(
        &self,
        view: View,
        query: &StacksQuery,
    ) -> Result<Vec<u8>, DebugError> {
        let snapshot = self
            .stacks
            .snapshot(query.snapshot)
            .ok_or(DebugError::NoSnapshot(query.snapshot))?;
        let records = snapshot.records(query.service.as_deref(), query.pool.as_deref());
        let title = format!(
            "{} stacks of {}, snapshot {}",
            view.title(),
            query.service.as_deref().unwrap_or("every service"),
            snapshot.id
        );
        Ok(profile::render(
            &records,
            view,
            &snapshot.meta(),
            query.format,
            &title,
        )?)
    }
}
