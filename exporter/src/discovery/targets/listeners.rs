//! The watched listeners handed to the kernel: each (network namespace, port, address)
//! of a watched service's listening sockets in `LISTEN_PORTS`, so that the socket
//! backend can claim a connection when its handshake completes, and the listeners of
//! each network namespace for reading their queues.
use std::collections::BTreeMap;

use poolscope_shared::{ListenKey, maps};

use super::{NamespaceListeners, Targets};
use crate::{discovery::held::HeldListener, discovery::procfs::ProcSnapshot, kernel::WatchTable};

impl Targets {
    /// Tells the kernel which (network namespace, port, address) keys are the listeners
    /// of which service, so that the socket backend can claim a connection when its
    /// handshake completes.
    pub(super) fn sync_listen_ports(
        &mut self,
        kernel: &mut dyn WatchTable,
        snapshot: &ProcSnapshot,
    ) {
        let by_namespace = kernel.claims_by_namespace();
        self.listener_namespaces = BTreeMap::new();
        self.service_namespaces = BTreeMap::new();
        for (inode, service) in &self.listeners {
            if let Some(id) = self.ids.get(service) {
                self.service_namespaces
                    .entry(id)
                    .or_default()
                    .insert(snapshot.listen_namespaces.get(inode).copied());
            }
            let Some(&netns) = snapshot.listen_namespaces.get(inode) else {
                continue;
            };
            let Some(&pid) = snapshot.namespace_pids.get(&netns) else {
                continue;
            };
            let namespace =
                self.listener_namespaces
                    .entry(netns)
                    .or_insert_with(|| NamespaceListeners {
                        pid,
                        held: Vec::new(),
                    });
            // Both maps have every listening socket some process holds, as each
            // watched listener is.
            if let (Some(&addr), Some(&(pid, fd))) = (
                snapshot.listen_sockets.get(inode),
                snapshot.listen_holders.get(inode),
            ) {
                namespace.held.push(HeldListener {
                    inode: *inode,
                    addr,
                    pid,
                    fd,
                });
            }
        }
        let ports: BTreeMap<ListenKey, u32> = self
            .listeners
            .iter()
            .filter_map(|(inode, service)| {
                let addr = snapshot.listen_sockets.get(inode)?;
                let netns = if by_namespace {
                    // A listener whose namespace is unknown cannot be told from another
                    // namespace's on the same port: it claims nothing.
                    *snapshot.listen_namespaces.get(inode)?
                } else {
                    ListenKey::ANY_NAMESPACE
                };
                let key = ListenKey {
                    netns,
                    port: u32::from(addr.port()),
                    addr: listen_address(addr.ip()),
                };
                Some((key, self.ids.get(service)?))
            })
            .collect();
        let failed = kernel.set_listen_ports(&ports);
        if let Some(first) = failed.first() {
            // At every scan while it lasts: debug, the health check logs the onset.
            tracing::debug!(
                error = %first,
                "{} update(s) of the listening ports of watched services failed",
                failed.len()
            );
        }
        for error in &failed {
            self.map_errors.count(maps::LISTEN_PORTS, error);
        }
    }
}

/// A listener's address as [`ListenKey::addr`]: IPv6, an IPv4 address mapped;
/// [`ListenKey::ANY_ADDRESS`] for one bound to every address.
fn listen_address(ip: std::net::IpAddr) -> [u8; 16] {
    if ip.is_unspecified() {
        return ListenKey::ANY_ADDRESS;
    }
    match ip {
        std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        std::net::IpAddr::V6(v6) => v6.octets(),
    }
}
