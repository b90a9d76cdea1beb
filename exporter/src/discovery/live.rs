//! What the kernel's connection state holds right now, per service: its connections
//! in each phase that is a gauge, and its HTTP/2 streams open, counted from the entries
//! themselves (the socket backends' socket storage through sock_diag, the syscall
//! backend's `CONNS`), not from the counters' differences. The truth the gauges'
//! recount (`metrics/recount.rs`) holds them to.
use std::{collections::BTreeMap, mem::offset_of, os::fd::AsFd as _};

use poolscope_shared::{Conn, H2Conn, Phase, conn_key_tgid};

use crate::{
    discovery::sockdiag::{self, SockDiagError, StoredValues, u32_at, u64_at},
    kernel::ConnectionState,
};

/// One value for each gauge that the connection state holds the truth of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PerGauge<T> {
    pub unserved: T,
    pub waiting: T,
    pub in_flight: T,
    pub at_stream_limit: T,
}

impl<T: Copy> PerGauge<T> {
    /// Each gauge's metric name (without `poolscope_`) with its value.
    pub fn named(&self) -> [(&'static str, T); 4] {
        [
            ("connections_unserved", self.unserved),
            ("requests_waiting", self.waiting),
            ("requests_in_flight", self.in_flight),
            ("http2_connections_at_stream_limit", self.at_stream_limit),
        ]
    }

    /// `f` of each gauge's two values.
    pub fn zip<U: Copy, R>(&self, other: &PerGauge<U>, f: impl Fn(T, U) -> R) -> PerGauge<R> {
        PerGauge {
            unserved: f(self.unserved, other.unserved),
            waiting: f(self.waiting, other.waiting),
            in_flight: f(self.in_flight, other.in_flight),
            at_stream_limit: f(self.at_stream_limit, other.at_stream_limit),
        }
    }
}

/// A service's live entries: connections unserved, waiting and serving, HTTP/2
/// streams open (in flight with the serving connections) and HTTP/2 connections at
/// their stream limit.
pub type Live = PerGauge<u64>;

/// Each service's live entries; a service with none is absent.
pub type LiveCounts = BTreeMap<u32, Live>;

/// Counts the entries of `state`. `epochs`: each watched service's epoch (a socket
/// claimed in another is stale); `watched`: each watched pid's `since_ns` (a `CONNS`
/// entry of another owner is stale).
pub fn live_counts(
    state: &ConnectionState,
    epochs: &BTreeMap<u32, u32>,
    watched: &BTreeMap<u32, u64>,
) -> Result<LiveCounts, SockDiagError> {
    let mut counts = LiveCounts::new();
    match state {
        ConnectionState::Sockets { conns, h2 } => {
            sockdiag::socket_storages(&[conns.fd.as_fd(), h2.fd.as_fd()], |values| {
                count_socket(&mut counts, values, (conns.id, h2.id), epochs);
            })?;
        }
        ConnectionState::Entries(entries) => {
            for (key, conn) in entries {
                if watched.get(&conn_key_tgid(*key)) == Some(&conn.owner_since_ns) {
                    count_phase(&mut counts, conn.service, conn.phase);
                }
            }
        }
    }
    Ok(counts)
}

/// Counts one socket's connection (and its HTTP/2 streams) from its storage values.
fn count_socket(
    counts: &mut LiveCounts,
    values: &StoredValues<'_>,
    (conns_id, h2_id): (u32, u32),
    epochs: &BTreeMap<u32, u32>,
) {
    let value_of = |id| values.iter().find(|(map, _)| *map == id).map(|(_, v)| *v);
    let Some(conn) = value_of(conns_id) else {
        return;
    };
    let (Some(service), Some(phase), Some(epoch)) = (
        u32_at(conn, offset_of!(Conn, service)),
        u32_at(conn, offset_of!(Conn, phase)),
        u32_at(conn, offset_of!(Conn, epoch)),
    ) else {
        return;
    };
    if epochs.get(&service) != Some(&epoch) {
        return;
    }
    count_phase(counts, service, phase);
    if Phase::from_u32(phase) != Phase::Multiplexed {
        return;
    }
    let Some(streams) = value_of(h2_id) else {
        return;
    };
    let live = counts.entry(service).or_default();
    live.in_flight += u64_at(streams, offset_of!(H2Conn, open)).unwrap_or(0);
    live.at_stream_limit += u64::from(u64_at(streams, offset_of!(H2Conn, at_limit)) == Some(1));
}

fn count_phase(counts: &mut LiveCounts, service: u32, phase: u32) {
    let live = counts.entry(service).or_default();
    match Phase::from_u32(phase) {
        Phase::Unserved => live.unserved += 1,
        Phase::Waiting => live.waiting += 1,
        Phase::Serving => live.in_flight += 1,
        Phase::Responded | Phase::Closing | Phase::Gone | Phase::Multiplexed => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn_bytes(service: u32, phase: Phase, epoch: u32) -> Vec<u8> {
        let mut bytes = vec![0u8; size_of::<Conn>()];
        bytes[offset_of!(Conn, service)..][..4].copy_from_slice(&service.to_ne_bytes());
        bytes[offset_of!(Conn, phase)..][..4].copy_from_slice(&(phase as u32).to_ne_bytes());
        bytes[offset_of!(Conn, epoch)..][..4].copy_from_slice(&epoch.to_ne_bytes());
        bytes
    }

    fn h2_bytes(open: u64, at_limit: u64) -> Vec<u8> {
        let mut bytes = vec![0u8; size_of::<H2Conn>()];
        bytes[offset_of!(H2Conn, open)..][..8].copy_from_slice(&open.to_ne_bytes());
        bytes[offset_of!(H2Conn, at_limit)..][..8].copy_from_slice(&at_limit.to_ne_bytes());
        bytes
    }

    #[test]
    fn sockets_count_by_phase_and_streams_in_the_current_epoch() {
        let epochs = BTreeMap::from([(1, 3), (2, 0)]);
        let (conns, h2) = (10, 11);
        let waiting = conn_bytes(1, Phase::Waiting, 3);
        let serving = conn_bytes(1, Phase::Serving, 3);
        let stale = conn_bytes(1, Phase::Serving, 2);
        let responded = conn_bytes(1, Phase::Responded, 3);
        let multiplexed = conn_bytes(2, Phase::Multiplexed, 0);
        let streams = h2_bytes(5, 1);
        let unwatched = conn_bytes(7, Phase::Unserved, 0);
        let mut counts = LiveCounts::new();
        for values in [
            vec![(conns, &waiting[..])],
            vec![(conns, &serving[..])],
            vec![(conns, &stale[..])],
            vec![(conns, &responded[..])],
            vec![(h2, &streams[..]), (conns, &multiplexed[..])],
            vec![(h2, &streams[..])],
            vec![(conns, &unwatched[..])],
        ] {
            count_socket(&mut counts, &values, (conns, h2), &epochs);
        }
        assert_eq!(
            counts,
            LiveCounts::from([
                (
                    1,
                    Live {
                        unserved: 0,
                        waiting: 1,
                        in_flight: 1,
                        at_stream_limit: 0
                    }
                ),
                (
                    2,
                    Live {
                        unserved: 0,
                        waiting: 0,
                        in_flight: 5,
                        at_stream_limit: 1
                    }
                ),
            ])
        );
    }

    #[test]
    fn entries_of_a_watched_owner_count() -> Result<(), SockDiagError> {
        let conn = |service, phase: Phase, owner_since_ns| Conn {
            service,
            phase: phase as u32,
            owner_since_ns,
            ..Conn::default()
        };
        let entries = vec![
            (
                poolscope_shared::fd_conn_key(100, 5),
                conn(1, Phase::Unserved, 7),
            ),
            (
                poolscope_shared::fd_conn_key(100, 6),
                conn(1, Phase::Serving, 7),
            ),
            // The pid's earlier process, and a pid not watched.
            (
                poolscope_shared::fd_conn_key(100, 8),
                conn(1, Phase::Serving, 6),
            ),
            (
                poolscope_shared::fd_conn_key(200, 5),
                conn(1, Phase::Waiting, 7),
            ),
        ];
        let counts = live_counts(
            &ConnectionState::Entries(entries),
            &BTreeMap::new(),
            &BTreeMap::from([(100, 7)]),
        )?;
        assert_eq!(
            counts,
            LiveCounts::from([(
                1,
                Live {
                    unserved: 1,
                    waiting: 0,
                    in_flight: 1,
                    at_stream_limit: 0
                }
            )])
        );
        Ok(())
    }
}
