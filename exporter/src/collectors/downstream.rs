//! The network waits of each pool's serving threads, per downstream peer (the
//! database or backend a worker waits on).
use poolscope_shared::{DownstreamKey, DownstreamWait, Peer};

use super::{Collected, Reading};
use crate::encode::{Family, Kind};

/// The downstream families of a reading; whole if the kernel was read.
pub fn collect(reading: &Reading<'_>) -> Collected {
    let names = reading.pool_names();
    Collected {
        families: downstream_families(
            reading.kernel.map_or(&[], |k| k.downstreams.as_slice()),
            |pool| names.get(&pool).copied(),
        ),
        whole: reading.kernel.is_some(),
    }
}

/// A socket peer as a label value: `10.0.0.5:5432`, `[2001:db8::1]:443`.
pub fn peer_label(peer: &Peer) -> String {
    let address = if peer.family == Peer::AF_INET6 {
        let v6 = std::net::Ipv6Addr::from(peer.addr);
        match v6.to_ipv4_mapped() {
            Some(v4) => std::net::SocketAddr::from((v4, peer.port)),
            None => std::net::SocketAddr::from((v6, peer.port)),
        }
    } else {
        let [a, b, c, d, ..] = peer.addr;
        std::net::SocketAddr::from(([a, b, c, d], peer.port))
    };
    address.to_string()
}

/// The network waits of each pool's serving threads per downstream peer. `names`
/// gives a pool id's service and pool names; entries of pools it does not know
/// (gone since the read) are left out.
pub fn downstream_families<'a>(
    waits: &[(DownstreamKey, DownstreamWait)],
    names: impl Fn(u32) -> Option<(&'a str, &'a str)>,
) -> Vec<Family> {
    let mut seconds = Family::new(
        "downstream_wait_seconds",
        Kind::Counter,
        "Time the pool's threads spent blocked on the network while serving a request,          with a socket to this peer in hand (a backend or database they call; part of          offcpu_seconds_total{reason=\"network\"}).",
    );
    let mut count = Family::new(
        "downstream_waits",
        Kind::Counter,
        "Network waits of the pool's serving threads on a socket to this peer that ended.",
    );
    let mut rows: Vec<_> = waits
        .iter()
        .filter_map(|(key, wait)| {
            let (service, pool) = names(key.pool)?;
            Some((service, pool, peer_label(&key.peer), wait))
        })
        .collect();
    rows.sort_by(|a, b| (a.0, a.1, &a.2).cmp(&(b.0, b.1, &b.2)));
    for (service, pool, peer, wait) in &rows {
        let labels = [
            ("service", *service),
            ("pool", *pool),
            ("peer", peer.as_str()),
        ];
        seconds.push(&labels, wait.wait_ns as f64 / 1e9);
        count.push(&labels, wait.waits as f64);
    }
    vec![seconds, count]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::{Format, render};

    #[test]
    fn downstream_waits_are_labelled_by_peer_and_pool() {
        let mut v4 = Peer {
            port: 5432,
            family: Peer::AF_INET,
            ..Peer::NONE
        };
        v4.addr[..4].copy_from_slice(&[10, 0, 0, 5]);
        let v6 = Peer {
            addr: std::net::Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1).octets(),
            port: 443,
            family: Peer::AF_INET6,
        };
        let mapped = Peer {
            addr: std::net::Ipv4Addr::new(127, 0, 0, 1)
                .to_ipv6_mapped()
                .octets(),
            port: 80,
            family: Peer::AF_INET6,
        };
        assert_eq!(peer_label(&v4), "10.0.0.5:5432");
        assert_eq!(peer_label(&v6), "[2001:db8::1]:443");
        assert_eq!(peer_label(&mapped), "127.0.0.1:80");
        let wait = |ns, waits| DownstreamWait { wait_ns: ns, waits };
        let waits = [
            (DownstreamKey { pool: 1, peer: v4 }, wait(2_500_000_000, 50)),
            (DownstreamKey { pool: 2, peer: v6 }, wait(1_000_000, 1)),
            // A pool gone since the read is left out.
            (DownstreamKey { pool: 9, peer: v4 }, wait(7, 7)),
        ];
        let names = |pool| match pool {
            1 => Some(("api", "worker")),
            2 => Some(("api", "io")),
            _ => None,
        };
        let text = render(&downstream_families(&waits, names), Format::Text);
        for line in [
            "poolscope_downstream_wait_seconds_total{service=\"api\",pool=\"worker\",peer=\"10.0.0.5:5432\"} 2.5\n",
            "poolscope_downstream_waits_total{service=\"api\",pool=\"worker\",peer=\"10.0.0.5:5432\"} 50\n",
            "poolscope_downstream_wait_seconds_total{service=\"api\",pool=\"io\",peer=\"[2001:db8::1]:443\"} 0.001\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
        assert!(!text.contains(" 7\n"), "a gone pool's entry: {text}");
    }
}
