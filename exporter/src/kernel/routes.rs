//! The routes part of [`Kernel`](super::Kernel) ([`Routes`]): the `ROUTE_EVENTS`
//! ring, drained into the [`RouteTable`] on a thread of its own and at each read.
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, MutexGuard, PoisonError, Weak},
    time::Duration,
};

use aya::{
    Ebpf,
    maps::{MapData, RingBuf},
};
use poolscope_shared::{RouteEvent, maps};

use super::route_table::{RouteCaps, RouteLabel, RouteTable, RouteTotals};
use super::{KernelError, MapSizes, decode_record, take};
use crate::config::{Limits, RoutePatterns};

/// How often the ring is drained: the kernel does not wake the reader (a wakeup per
/// request would cost more than its record), so the ring holds what arrives in one
/// interval (`[limits] route_events` records).
const DRAIN_INTERVAL: Duration = Duration::from_millis(100);

/// Bytes a record takes in the ring: its 8-byte header and the event, 8-aligned.
const RECORD_BYTES: u32 = (8 + size_of::<RouteEvent>() as u32).next_multiple_of(8);

/// The ring and the table it fills: drained by its thread, and by each read so that
/// a scrape counts every request the kernel recorded before it.
struct Drained {
    ring: RingBuf<MapData>,
    table: RouteTable,
}

impl Drained {
    fn drain(&mut self) {
        while let Some(record) = self.ring.next() {
            if let Some(event) = decode_record::<RouteEvent>(&record) {
                self.table.add(&event);
            }
        }
    }
}

/// The route table, filled from the ring.
pub(super) struct Routes {
    drained: Arc<Mutex<Drained>>,
    /// Whether the programs hand over requests (`[probes] routes`): else nothing is
    /// drained.
    enabled: bool,
}

impl Routes {
    /// The size `limits` gives the ring: room for `[limits] route_events` records, a
    /// power of two of at least a page, as the kernel wants.
    pub fn sizes(limits: &Limits) -> MapSizes {
        let bytes = limits
            .route_events
            .saturating_mul(RECORD_BYTES)
            .checked_next_power_of_two()
            .unwrap_or(1 << 31)
            .max(4096);
        vec![(maps::ROUTE_EVENTS, bytes)]
    }

    /// Takes the ring out of `ebpf`; [`Routes::start_draining`] starts its thread.
    pub fn take(ebpf: &mut Ebpf, limits: &Limits, enabled: bool) -> Result<Self, KernelError> {
        let drained = Arc::new(Mutex::new(Drained {
            ring: take(ebpf, maps::ROUTE_EVENTS)?,
            table: RouteTable::new(RouteCaps {
                per_service: limits.routes_per_service as usize,
                total: limits.routes as usize,
            }),
        }));
        Ok(Self { drained, enabled })
    }

    /// Starts the thread that drains the ring, if the programs fill it. Called once
    /// capabilities are dropped: a thread keeps the capabilities it was created with.
    pub fn start_draining(&self) -> Result<(), KernelError> {
        if !self.enabled {
            return Ok(());
        }
        let weak = Arc::downgrade(&self.drained);
        std::thread::Builder::new()
            .name("routes".into())
            .spawn(move || drain_until_dropped(&weak))
            .map_err(KernelError::Thread)?;
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Drained> {
        // A panic while adding leaves counts, not a broken invariant.
        self.drained.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The routes of each of `services`, with every record so far.
    pub fn read(
        &self,
        services: impl Iterator<Item = u32>,
    ) -> BTreeMap<u32, BTreeMap<RouteLabel, RouteTotals>> {
        let mut drained = self.lock();
        drained.drain();
        services
            .map(|service| (service, drained.table.service(service)))
            .collect()
    }

    /// Names `service`'s routes by `patterns` from the next record on (those before
    /// are drained first: a reload's new templates do not name earlier requests).
    pub fn name_routes(&self, service: u32, patterns: &RoutePatterns) {
        let mut drained = self.lock();
        if drained.table.patterns(service) != patterns {
            drained.drain();
            drained.table.set_patterns(service, patterns.clone());
        }
    }

    /// Forgets `service`'s routes, after the records of its requests so far.
    pub fn reset_service(&self, service: u32) {
        let mut drained = self.lock();
        drained.drain();
        drained.table.reset_service(service);
    }
}

/// Drains the ring every [`DRAIN_INTERVAL`], until the kernel part is dropped.
fn drain_until_dropped(drained: &Weak<Mutex<Drained>>) {
    loop {
        std::thread::sleep(DRAIN_INTERVAL);
        let Some(drained) = drained.upgrade() else {
            return;
        };
        drained
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain();
    }
}
