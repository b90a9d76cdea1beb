//! Listen-queue depth and limit of every listening TCP socket, from the kernel's
//! sock_diag netlink interface (what `ss -lnt` shows as Recv-Q / Send-Q): for a
//! listener, `idiag_rqueue` is `sk_ack_backlog` and `idiag_wqueue` is
//! `sk_max_ack_backlog`. One dump per address family per scrape; the parser is a pure
//! function over the reply bytes.
//!
//! The same dump, of every socket that is not listening, also hands over each socket's
//! values in BPF socket-storage maps (`INET_DIAG_REQ_SK_BPF_STORAGES`, Linux 5.2;
//! needs CAP_BPF): what the socket backend keeps per connection, read for a recount.
//!
//! Sees the exporter's own network namespace only; `procfs::listen_queues_of` reads
//! the others'.
use std::{
    io,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
};

/// One listening socket's queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListenQueue {
    pub inode: u64,
    pub addr: SocketAddr,
    /// Connections completed and waiting for accept().
    pub depth: u32,
    /// The backlog given to listen(), capped by net.core.somaxconn; unknown for a
    /// queue read from procfs (another network namespace's).
    pub limit: Option<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum SockDiagError {
    #[error("sock_diag socket: {0}")]
    Io(#[from] io::Error),
    #[error("sock_diag reply truncated or malformed")]
    Malformed,
    #[error("sock_diag error reply: errno {0}")]
    Kernel(i32),
}

const NETLINK_SOCK_DIAG: libc::c_int = 4;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_HDRLEN: usize = 16;
const TCP_LISTEN: u32 = 10;
/// inet_diag_req_v2: family, protocol, ext, pad, states, then a 48-byte socket id.
const REQUEST_LEN: usize = 56;
/// inet_diag_msg: 4 bytes, 48-byte id, expires, rqueue, wqueue, uid, inode.
const MESSAGE_LEN: usize = 72;
/// struct nlattr: length, type.
const NLA_HDRLEN: usize = 4;
const NLA_F_NESTED: u16 = 1 << 15;
/// An attribute's type without NLA_F_NESTED and NLA_F_NET_BYTEORDER.
const NLA_TYPE_MASK: u16 = !(3 << 14);
/// include/uapi/linux/inet_diag.h and sock_diag.h.
const INET_DIAG_REQ_SK_BPF_STORAGES: u16 = 2;
const INET_DIAG_SK_BPF_STORAGES: u16 = 20;
const SK_DIAG_BPF_STORAGE_REQ_MAP_FD: u16 = 1;
const SK_DIAG_BPF_STORAGE: u16 = 1;
const SK_DIAG_BPF_STORAGE_MAP_ID: u16 = 2;
const SK_DIAG_BPF_STORAGE_MAP_VALUE: u16 = 3;

/// Every listening TCP socket (IPv4 and IPv6) with its queue.
pub fn listen_queues() -> Result<Vec<ListenQueue>, SockDiagError> {
    let mut queues = Vec::new();
    for family in [libc::AF_INET, libc::AF_INET6] {
        dump(&request(family as u8, 1 << TCP_LISTEN, &[]), |payload| {
            queues.push(parse_message(payload)?);
            Ok(())
        })?;
    }
    Ok(queues)
}

/// One socket's values in the socket-storage maps asked for: (map id, value bytes).
pub type StoredValues<'a> = Vec<(u32, &'a [u8])>;

/// Calls `each` with the values that every TCP socket (IPv4 and IPv6) that is not
/// listening holds in the socket-storage maps `maps` (descriptors); a socket that
/// holds none is skipped.
pub fn socket_storages(
    maps: &[BorrowedFd<'_>],
    mut each: impl FnMut(&StoredValues<'_>),
) -> Result<(), SockDiagError> {
    let fds: Vec<u32> = maps.iter().map(|fd| fd.as_raw_fd() as u32).collect();
    let not_listening = !(1 << TCP_LISTEN);
    for family in [libc::AF_INET, libc::AF_INET6] {
        dump(&request(family as u8, not_listening, &fds), |payload| {
            let values = stored_values(payload)?;
            if !values.is_empty() {
                each(&values);
            }
            Ok(())
        })?;
    }
    Ok(())
}

/// A dump request for TCP sockets of `family` in `states` (a bit per TCP state),
/// with the values of the socket-storage maps `storage_maps` (descriptors).
fn request(family: u8, states: u32, storage_maps: &[u32]) -> Vec<u8> {
    let storages_len = if storage_maps.is_empty() {
        0
    } else {
        NLA_HDRLEN + storage_maps.len() * (NLA_HDRLEN + 4)
    };
    let total = NLMSG_HDRLEN + REQUEST_LEN + storages_len;
    let mut message = Vec::with_capacity(total);
    message.extend_from_slice(&(total as u32).to_ne_bytes());
    message.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    message.extend_from_slice(&flags.to_ne_bytes());
    message.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    message.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel
    message.extend_from_slice(&[family, libc::IPPROTO_TCP as u8, 0, 0]);
    message.extend_from_slice(&states.to_ne_bytes());
    message.resize(NLMSG_HDRLEN + REQUEST_LEN, 0); // any socket id
    if !storage_maps.is_empty() {
        message.extend_from_slice(&(storages_len as u16).to_ne_bytes());
        message.extend_from_slice(&(INET_DIAG_REQ_SK_BPF_STORAGES | NLA_F_NESTED).to_ne_bytes());
        for fd in storage_maps {
            message.extend_from_slice(&((NLA_HDRLEN + 4) as u16).to_ne_bytes());
            message.extend_from_slice(&SK_DIAG_BPF_STORAGE_REQ_MAP_FD.to_ne_bytes());
            message.extend_from_slice(&fd.to_ne_bytes());
        }
    }
    message
}

/// Sends `message` and hands each socket's `inet_diag_msg` (with its attributes) to
/// `each` until the dump is done.
fn dump(
    message: &[u8],
    mut each: impl FnMut(&[u8]) -> Result<(), SockDiagError>,
) -> Result<(), SockDiagError> {
    // SAFETY: plain socket(2); the fd is owned at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error().into());
    }
    // SAFETY: fd is a fresh, valid descriptor that nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: zeroed sockaddr_nl is valid; nl_pid 0 addresses the kernel.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: message and address outlive the call; lengths are theirs.
    let sent = unsafe {
        libc::sendto(
            socket.as_raw_fd(),
            message.as_ptr().cast(),
            message.len(),
            0,
            std::ptr::from_ref(&kernel).cast(),
            size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error().into());
    }
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        // SAFETY: buffer is valid for its length.
        let received = unsafe {
            libc::recv(
                socket.as_raw_fd(),
                buffer.as_mut_ptr().cast(),
                buffer.len(),
                0,
            )
        };
        if received < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error.into());
        }
        let bytes = buffer
            .get(..received as usize)
            .ok_or(SockDiagError::Malformed)?;
        if parse_reply(bytes, &mut each)? {
            return Ok(());
        }
    }
}

/// The native-endian u32 at `offset` of `bytes`, if there.
pub(super) fn u32_at(bytes: &[u8], offset: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(
        bytes.get(offset..offset + 4)?.try_into().ok()?,
    ))
}

/// The native-endian u64 at `offset` of `bytes`, if there.
pub(super) fn u64_at(bytes: &[u8], offset: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(
        bytes.get(offset..offset + 8)?.try_into().ok()?,
    ))
}

fn u16_at(bytes: &[u8], offset: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(
        bytes.get(offset..offset + 2)?.try_into().ok()?,
    ))
}

/// Hands each socket of one received datagram to `each`; `true` once the dump is done.
pub fn parse_reply(
    mut bytes: &[u8],
    mut each: impl FnMut(&[u8]) -> Result<(), SockDiagError>,
) -> Result<bool, SockDiagError> {
    while bytes.len() >= NLMSG_HDRLEN {
        let length = u32_at(bytes, 0).ok_or(SockDiagError::Malformed)? as usize;
        let kind = u16_at(bytes, 4).ok_or(SockDiagError::Malformed)?;
        if length < NLMSG_HDRLEN || length > bytes.len() {
            return Err(SockDiagError::Malformed);
        }
        let payload = &bytes[NLMSG_HDRLEN..length];
        match kind {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let errno = u32_at(payload, 0).ok_or(SockDiagError::Malformed)? as i32;
                return Err(SockDiagError::Kernel(-errno));
            }
            SOCK_DIAG_BY_FAMILY => each(payload)?,
            _ => {}
        }
        // Messages are 4-byte aligned.
        let advance = (length + 3) & !3;
        bytes = bytes.get(advance..).unwrap_or_default();
    }
    Ok(false)
}

fn parse_message(payload: &[u8]) -> Result<ListenQueue, SockDiagError> {
    if payload.len() < MESSAGE_LEN {
        return Err(SockDiagError::Malformed);
    }
    let family = payload[0];
    let port = u16::from_be_bytes([payload[4], payload[5]]);
    let source = &payload[8..24];
    let ip = if family == libc::AF_INET6 as u8 {
        let octets: [u8; 16] = source.try_into().map_err(|_| SockDiagError::Malformed)?;
        Ipv6Addr::from(octets).into()
    } else {
        Ipv4Addr::new(source[0], source[1], source[2], source[3]).into()
    };
    let field = |offset| u32_at(payload, offset).ok_or(SockDiagError::Malformed);
    Ok(ListenQueue {
        addr: SocketAddr::new(ip, port),
        depth: field(56)?,
        limit: Some(field(60)?),
        inode: field(68)?.into(),
    })
}

/// The netlink attributes in `bytes`: (type without its flags, payload).
fn attributes(mut bytes: &[u8]) -> impl Iterator<Item = Result<(u16, &[u8]), SockDiagError>> {
    std::iter::from_fn(move || {
        if bytes.len() < NLA_HDRLEN {
            return None;
        }
        let (Some(length), Some(kind)) = (u16_at(bytes, 0), u16_at(bytes, 2)) else {
            return Some(Err(SockDiagError::Malformed));
        };
        let length = usize::from(length);
        let Some(payload) = bytes
            .get(NLA_HDRLEN..length)
            .filter(|_| length >= NLA_HDRLEN)
        else {
            bytes = &[];
            return Some(Err(SockDiagError::Malformed));
        };
        // Attributes are 4-byte aligned.
        bytes = bytes.get((length + 3) & !3..).unwrap_or_default();
        Some(Ok((kind & NLA_TYPE_MASK, payload)))
    })
}

/// The socket-storage values of one socket's message: (map id, value).
fn stored_values(payload: &[u8]) -> Result<StoredValues<'_>, SockDiagError> {
    let mut values = Vec::new();
    let after_message = payload.get(MESSAGE_LEN..).ok_or(SockDiagError::Malformed)?;
    for attribute in attributes(after_message) {
        let (kind, storages) = attribute?;
        if kind != INET_DIAG_SK_BPF_STORAGES {
            continue;
        }
        for storage in attributes(storages) {
            let (kind, fields) = storage?;
            if kind != SK_DIAG_BPF_STORAGE {
                continue;
            }
            let (mut id, mut value) = (None, None);
            for field in attributes(fields) {
                match field? {
                    (SK_DIAG_BPF_STORAGE_MAP_ID, bytes) => id = u32_at(bytes, 0),
                    (SK_DIAG_BPF_STORAGE_MAP_VALUE, bytes) => value = Some(bytes),
                    _ => {}
                }
            }
            values.push((
                id.ok_or(SockDiagError::Malformed)?,
                value.ok_or(SockDiagError::Malformed)?,
            ));
        }
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(family: u8, ip: &[u8], port: u16, rqueue: u32, wqueue: u32, inode: u32) -> Vec<u8> {
        let mut payload = vec![0u8; MESSAGE_LEN];
        payload[0] = family;
        payload[1] = TCP_LISTEN as u8;
        payload[4..6].copy_from_slice(&port.to_be_bytes());
        payload[8..8 + ip.len()].copy_from_slice(ip);
        payload[56..60].copy_from_slice(&rqueue.to_ne_bytes());
        payload[60..64].copy_from_slice(&wqueue.to_ne_bytes());
        payload[68..72].copy_from_slice(&inode.to_ne_bytes());
        let mut out = Vec::new();
        out.extend_from_slice(&((NLMSG_HDRLEN + MESSAGE_LEN) as u32).to_ne_bytes());
        out.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        out.extend_from_slice(&[0u8; 10]);
        out.extend_from_slice(&payload);
        out
    }

    fn done() -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&20u32.to_ne_bytes());
        out.extend_from_slice(&NLMSG_DONE.to_ne_bytes());
        out.extend_from_slice(&[0u8; 14]);
        out
    }

    #[test]
    fn parses_v4_and_v6_listeners_then_done() -> Result<(), SockDiagError> {
        let mut bytes = message(libc::AF_INET as u8, &[127, 0, 0, 1], 8080, 3, 128, 99);
        let mut v6 = [0u8; 16];
        v6[15] = 1;
        bytes.extend(message(libc::AF_INET6 as u8, &v6, 443, 0, 4096, 100));
        let mut queues = Vec::new();
        let mut push = |payload: &[u8]| {
            queues.push(parse_message(payload)?);
            Ok(())
        };
        assert!(!parse_reply(&bytes, &mut push)?);
        assert!(parse_reply(&done(), &mut push)?);
        assert_eq!(
            queues,
            vec![
                ListenQueue {
                    inode: 99,
                    addr: "127.0.0.1:8080".parse().expect("addr"),
                    depth: 3,
                    limit: Some(128)
                },
                ListenQueue {
                    inode: 100,
                    addr: "[::1]:443".parse().expect("addr"),
                    depth: 0,
                    limit: Some(4096)
                },
            ]
        );
        Ok(())
    }

    #[test]
    fn truncated_reply_is_an_error() {
        let bytes = message(libc::AF_INET as u8, &[127, 0, 0, 1], 1, 0, 0, 1);
        assert!(parse_reply(&bytes[..40], |_| Ok(())).is_err());
    }

    #[test]
    fn request_asks_for_listeners_only() {
        let request = request(libc::AF_INET as u8, 1 << TCP_LISTEN, &[]);
        assert_eq!(request.len(), 72);
        assert_eq!(u32_at(&request, 20), Some(1 << TCP_LISTEN));
    }

    fn attribute(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&((NLA_HDRLEN + payload.len()) as u16).to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(payload);
        out.resize((out.len() + 3) & !3, 0);
        out
    }

    #[test]
    fn request_for_storages_names_each_map() {
        let request = request(libc::AF_INET6 as u8, !(1 << TCP_LISTEN), &[7, 9]);
        let attributes: Vec<_> = attributes(&request[NLMSG_HDRLEN + REQUEST_LEN..])
            .collect::<Result<_, _>>()
            .expect("attributes");
        assert_eq!(attributes.len(), 1);
        assert_eq!(attributes[0].0, INET_DIAG_REQ_SK_BPF_STORAGES);
        let fds: Vec<_> = super::attributes(attributes[0].1)
            .map(|nested| nested.map(|(kind, fd)| (kind, u32_at(fd, 0))))
            .collect::<Result<_, _>>()
            .expect("nested");
        assert_eq!(
            fds,
            vec![
                (SK_DIAG_BPF_STORAGE_REQ_MAP_FD, Some(7)),
                (SK_DIAG_BPF_STORAGE_REQ_MAP_FD, Some(9))
            ]
        );
    }

    #[test]
    fn storages_of_a_socket_read_by_map_id() -> Result<(), SockDiagError> {
        let storage = |id: u32, value: &[u8]| {
            let mut fields = attribute(SK_DIAG_BPF_STORAGE_MAP_ID, &id.to_ne_bytes());
            fields.extend(attribute(1, &[])); // the pad before a 64-bit value
            fields.extend(attribute(SK_DIAG_BPF_STORAGE_MAP_VALUE, value));
            attribute(SK_DIAG_BPF_STORAGE | NLA_F_NESTED, &fields)
        };
        let mut storages = storage(31, &[1, 2, 3]);
        storages.extend(storage(32, &[4; 8]));
        let mut payload = vec![0u8; MESSAGE_LEN];
        payload.extend(attribute(4, b"cubic\0")); // INET_DIAG_CONG, skipped
        payload.extend(attribute(
            INET_DIAG_SK_BPF_STORAGES | NLA_F_NESTED,
            &storages,
        ));
        let values = stored_values(&payload)?;
        assert_eq!(values, vec![(31, &[1u8, 2, 3][..]), (32, &[4u8; 8][..])]);
        assert_eq!(stored_values(&[0u8; MESSAGE_LEN])?, vec![]);
        assert!(stored_values(&payload[..MESSAGE_LEN + 12 + 10]).is_err());
        Ok(())
    }
}
