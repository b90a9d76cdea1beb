//! The routes part of [`Kernel`](super::Kernel) ([`Routes`]): which services' routes
//! the programs read (`ROUTE_SERVICES`), and the `ROUTE_EVENTS` ring, drained into the
//! [`RouteTable`] on a thread of its own and at each read.
use std::{
    collections::{BTreeMap, HashSet},
    sync::{Arc, Mutex, MutexGuard, PoisonError, Weak},
    time::Duration,
};

use aya::{
    Ebpf,
    maps::{Array, MapData, MapError, RingBuf},
};
use poolscope_shared::{H2Block, RouteEvent, RouteRecord, maps};

use super::h2_headers::{H2Headers, Lost};
use super::route_table::{RouteCaps, RouteLabel, RouteTable, RouteTotals};
use super::{KernelError, MapSizes, Reads, decode_record, take};
use crate::config::{Limits, RoutePatterns, ServiceRoutes};

/// How often the ring is drained: the kernel does not wake the reader (a wakeup per
/// request would cost more than its record), so the ring holds what arrives in one
/// interval (`[limits] route_events` records).
const DRAIN_INTERVAL: Duration = Duration::from_millis(100);

/// The smallest ring the kernel makes.
const PAGE_BYTES: u32 = 4096;
/// Bytes a record takes in the ring: its 8-byte header and the event, 8-aligned.
const RECORD_BYTES: u32 = (8 + size_of::<RouteEvent>() as u32).next_multiple_of(8);

/// The ring and the table it fills: drained by its thread, and by each read so that
/// a scrape counts every request the kernel recorded before it.
struct Drained {
    ring: RingBuf<MapData>,
    table: RouteTable,
    /// HTTP/2 connections' header tables, which name their streams.
    h2: H2Headers,
}

impl Drained {
    fn drain(&mut self) {
        while let Some(record) = self.ring.next() {
            let Some(kind) = decode_record::<u32>(&record) else {
                continue;
            };
            if kind == RouteRecord::Finished as u32 {
                let Some(event) = decode_record::<RouteEvent>(&record) else {
                    continue;
                };
                if event.h2_stream == 0 {
                    self.table.add(&event);
                } else {
                    self.h2.finished(&event, &mut self.table);
                }
            } else if let Some(block) = decode_record::<H2Block>(&record) {
                self.h2.block(&block, &mut self.table);
            }
        }
        self.h2.drained(std::time::Instant::now(), &mut self.table);
    }
}

/// The route table, filled from the ring, and the services whose routes are read.
pub(super) struct Routes {
    drained: Arc<Mutex<Drained>>,
    /// Whether the programs may hand over requests (any service's routes read): else
    /// nothing is drained.
    enabled: bool,
    /// Whether a service's routes are read when its rule does not say
    /// (`[probes] routes`).
    by_default: bool,
    /// Service → 1 if its routes are read, as the programs check it.
    services: Array<MapData, u32>,
    /// The services set to 1 there.
    read: HashSet<u32>,
}

impl Routes {
    /// The size `limits` gives the ring: room for `[limits] route_events` records, a
    /// power of two of at least a page, as the kernel wants; a page where the programs
    /// read no route (`read` false: they never write it).
    pub fn sizes(limits: &Limits, read: bool) -> MapSizes {
        let bytes = if read {
            limits
                .route_events
                .saturating_mul(RECORD_BYTES)
                .checked_next_power_of_two()
                .unwrap_or(1 << 31)
                .max(PAGE_BYTES)
        } else {
            PAGE_BYTES
        };
        vec![(maps::ROUTE_EVENTS, bytes)]
    }

    /// Takes the ring out of `ebpf`; [`Routes::start_draining`] starts its thread.
    pub fn take(ebpf: &mut Ebpf, limits: &Limits, reads: Reads) -> Result<Self, KernelError> {
        let drained = Arc::new(Mutex::new(Drained {
            ring: take(ebpf, maps::ROUTE_EVENTS)?,
            table: RouteTable::new(RouteCaps {
                per_service: limits.routes_per_service as usize,
                total: limits.routes as usize,
            }),
            h2: H2Headers::new(limits.http2_decoded_connections as usize),
        }));
        Ok(Self {
            drained,
            enabled: reads.routes,
            by_default: reads.routes_by_default,
            services: take(ebpf, maps::ROUTE_SERVICES)?,
            read: HashSet::new(),
        })
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

    /// The routes of each of `services`, with every record so far, and the HTTP/2
    /// connection directions whose headers were lost.
    pub fn read(&self, services: impl Iterator<Item = u32>) -> BTreeMap<u32, RoutesRead> {
        let mut drained = self.lock();
        drained.drain();
        services
            .map(|service| {
                let routes = RoutesRead {
                    routes: drained.table.service(service),
                    h2_lost: drained.h2.lost(service),
                };
                (service, routes)
            })
            .collect()
    }

    /// Reads `service`'s routes or not, as its rule says (`[probes] routes` if it does
    /// not), named by its templates from the next record on (the records before are
    /// drained first: a reload's new templates do not name earlier requests).
    pub fn name_routes(&mut self, service: u32, routes: &ServiceRoutes) -> Result<(), MapError> {
        let (read, patterns) = match routes {
            ServiceRoutes::AsProbes => (self.by_default, &RoutePatterns::NONE),
            ServiceRoutes::Off => (false, &RoutePatterns::NONE),
            ServiceRoutes::Read(patterns) => (true, patterns),
        };
        // Programs that read no route have no reading to turn on.
        let read = read && self.enabled;
        if self.read.contains(&service) != read {
            self.services.set(service, u32::from(read), 0)?;
            if read {
                self.read.insert(service);
            } else {
                self.read.remove(&service);
            }
        }
        let mut drained = self.lock();
        if drained.table.patterns(service) != patterns {
            drained.drain();
            drained.table.set_patterns(service, patterns.clone());
        }
        Ok(())
    }

    /// Forgets `service`'s routes, after the records of its requests so far, and
    /// stops reading them until its id's next service says.
    pub fn reset_service(&mut self, service: u32) -> Result<(), MapError> {
        if self.read.contains(&service) {
            self.services.set(service, 0, 0)?;
            self.read.remove(&service);
        }
        let mut drained = self.lock();
        drained.drain();
        drained.table.reset_service(service);
        drained.h2.reset_service(service);
        Ok(())
    }
}

/// A service's routes, as a read gives them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RoutesRead {
    pub routes: BTreeMap<RouteLabel, RouteTotals>,
    /// HTTP/2 connection directions whose header blocks could no longer be decoded,
    /// by reason: their streams' routes (or statuses) are `unknown`.
    pub h2_lost: BTreeMap<Lost, u64>,
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
