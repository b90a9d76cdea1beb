//! Sockets of a process: its socket fds, the kernel's TCP tables (`net/tcp`,
//! `net/tcp6`) for listen queues and served connections, and its network namespace.
//!
//! The socket fds are read from `fdinfo/<fd>` (the file's mount and inode), not from
//! the `fd/<fd>` links: `fd/` is mode 0500 and only its owner (or
//! `CAP_DAC_READ_SEARCH`) may search it, while `fdinfo/` opens to whoever may
//! ptrace-read the process (`CAP_SYS_PTRACE`, which poolscope has anyway).
use std::{
    collections::{HashMap, HashSet},
    fs,
    io::{self, BufRead as _, Read as _},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket},
    os::fd::AsRawFd as _,
    path::Path,
    sync::OnceLock,
};

use crate::{discovery::sockdiag::ListenQueue, kernel::ServedConnection};

/// The inode of a `socket:[12345]` fd link.
fn socket_inode(link: &str) -> Option<u64> {
    link.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// What an `fdinfo/<fd>` file says of the file: on which mount, and which inode
/// (the `ino:` line is there since Linux 5.14).
#[derive(Debug, PartialEq, Eq)]
struct FdInfo {
    mount: Option<u32>,
    inode: Option<u64>,
}

fn parse_fdinfo(text: &str) -> FdInfo {
    let field = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.trim().parse::<u64>().ok())
    };
    FdInfo {
        mount: field("mnt_id:").and_then(|id| u32::try_from(id).ok()),
        inode: field("ino:"),
    }
}

/// The mount id of sockfs, the kernel's internal mount every socket is a file of
/// (one id, whatever the mount namespace), as `/proc/self/fdinfo` shows it for a
/// socket of our own; `None` where that cannot be read.
pub fn sockfs_mount_id() -> Option<u32> {
    static ID: OnceLock<Option<u32>> = OnceLock::new();
    *ID.get_or_init(|| {
        let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).ok()?;
        let text = fs::read_to_string(format!("/proc/self/fdinfo/{}", socket.as_raw_fd())).ok()?;
        parse_fdinfo(&text).mount
    })
}

const TCP_LISTEN: &str = "0A";
const TCP_ESTABLISHED: &str = "01";

/// One socket's line of `/proc/net/tcp` or `/proc/net/tcp6`.
struct NetTcpRow<'a> {
    local: SocketAddr,
    state: &'a str,
    /// For a listener the kernel prints `sk_ack_backlog` here: the connections
    /// waiting for accept(), as sock_diag reports them; else the unread bytes.
    rx_queue: u32,
    inode: u64,
}

/// The rows of one table, each socket once. The kernel prints the file a page at a
/// time and finds its place again between reads, so a socket can be printed twice when
/// others come and go meanwhile: on this machine 520 of 1,475 reads of 40 connections
/// under connect/close churn held a duplicate (none missed one). Rows without an
/// inode (TIME_WAIT, orphans) are not sockets of any process and are all kept.
fn net_tcp_rows(content: &str) -> impl Iterator<Item = NetTcpRow<'_>> {
    let mut seen = HashSet::new();
    content
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_ascii_whitespace().collect();
            let (_, rx_queue) = fields.get(4)?.split_once(':')?;
            Some(NetTcpRow {
                local: parse_hex_socket_addr(fields.get(1)?)?,
                state: fields.get(3)?,
                rx_queue: u32::from_str_radix(rx_queue, 16).ok()?,
                inode: fields.get(9)?.parse().ok()?,
            })
        })
        .filter(move |row| row.inode == 0 || seen.insert(row.inode))
}

/// Listening sockets (state `0A`) in `/proc/net/tcp` or `/proc/net/tcp6`, with their
/// backlog's depth. The backlog's size is not in the file.
pub fn parse_net_tcp(content: &str) -> Vec<ListenQueue> {
    net_tcp_rows(content)
        .filter(|row| row.state == TCP_LISTEN)
        .map(|row| ListenQueue {
            inode: row.inode,
            addr: row.local,
            depth: row.rx_queue,
            limit: None,
        })
        .collect()
}

/// The listen queues of the network namespace of process `pid`, from its
/// `/proc/<pid>/net/tcp` and `tcp6`: what sock_diag cannot read outside poolscope's
/// own namespace without `CAP_SYS_ADMIN` (to enter the namespace).
pub fn listen_queues_of(root: &Path, pid: u32) -> io::Result<Vec<ListenQueue>> {
    let [v4, v6] = listening_tables(root, pid)?;
    let mut queues = parse_net_tcp(&v4);
    queues.extend(parse_net_tcp(&v6));
    Ok(queues)
}

/// `/proc/<pid>/net/tcp` and `tcp6` (empty on a kernel without IPv6).
fn net_tcp_tables(root: &Path, pid: u32) -> io::Result<[String; 2]> {
    let dir = root.join(pid.to_string()).join("net");
    let v4 = fs::read_to_string(dir.join("tcp"))?;
    Ok([v4, fs::read_to_string(dir.join("tcp6")).unwrap_or_default()])
}

/// The listening rows of `/proc/<pid>/net/tcp` and `tcp6` (with their header): the
/// kernel prints the listening hash before the established one, so the read stops at
/// the first row of another state. A node's table can hold tens of thousands of
/// connections (TIME_WAIT after short requests), and each read of the proc file
/// walks the hash from its start: reading it all cost a rescan ~0.3 s per namespace.
fn listening_tables(root: &Path, pid: u32) -> io::Result<[String; 2]> {
    let dir = root.join(pid.to_string()).join("net");
    let v4 = listening_rows(fs::File::open(dir.join("tcp"))?)?;
    let v6 = fs::File::open(dir.join("tcp6"))
        .and_then(listening_rows)
        .unwrap_or_default();
    Ok([v4, v6])
}

/// The header and the leading `0A` (listen) rows of a `/proc/net/tcp` file.
fn listening_rows(file: impl io::Read) -> io::Result<String> {
    let mut rows = String::new();
    for (index, line) in io::BufReader::new(file).lines().enumerate() {
        let line = line?;
        let state = line.split_ascii_whitespace().nth(3);
        if index > 0 && state != Some(TCP_LISTEN) {
            break;
        }
        rows.push_str(&line);
        rows.push('\n');
    }
    Ok(rows)
}

/// The `/proc/net/tcp` tables of each network namespace read so far: a scan that
/// watches many processes of one namespace (host networking) reads its table once,
/// not once per process.
#[derive(Debug, Default)]
pub struct NetTables(HashMap<Option<u32>, [String; 2]>);

impl NetTables {
    fn of(&mut self, root: &Path, pid: u32) -> io::Result<&[String; 2]> {
        let dir = root.join(pid.to_string());
        let namespace = fs::read_link(dir.join("ns/net"))
            .ok()
            .as_deref()
            .and_then(namespace_inode);
        // Without a namespace link (a fixture, or a gone process) nothing is shared.
        if namespace.is_none() {
            self.0.remove(&None);
        }
        Ok(match self.0.entry(namespace) {
            std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::hash_map::Entry::Vacant(entry) => {
                entry.insert(net_tcp_tables(root, pid)?)
            }
        })
    }
}

/// The inode number of a namespace link such as `net:[4026531840]`: the `inum` the
/// kernel's own structures carry.
pub fn namespace_inode(link: &Path) -> Option<u32> {
    let link = link.to_str()?;
    let (_, number) = link.split_once(":[")?;
    number.strip_suffix(']')?.parse().ok()
}

/// The network namespace of process `pid` (`None` if it exited or may not be read).
pub fn network_namespace(root: &Path, pid: &str) -> Option<u32> {
    namespace_inode(&fs::read_link(root.join(pid).join("ns/net")).ok()?)
}

/// `0100007F:1F90` (IPv4) or 32 hex digits `:` port (IPv6). The address is printed as
/// 32-bit words in host byte order (little-endian on every arch we build for).
fn parse_hex_socket_addr(field: &str) -> Option<SocketAddr> {
    let (ip, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        let hex = ip.get(i * 8..i * 8 + 8)?;
        Some(u32::from_str_radix(hex, 16).ok()?.to_le_bytes())
    };
    match ip.len() {
        8 => Some(SocketAddr::from((Ipv4Addr::from(word(0)?), port))),
        32 => {
            let mut octets = [0u8; 16];
            for i in 0..4 {
                octets[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            Some(SocketAddr::from((Ipv6Addr::from(octets), port)))
        }
        _ => None,
    }
}

/// The open sockets of a process: fd → socket inode. `PermissionDenied` when
/// poolscope may not read them, another error when the process vanished.
pub fn socket_fds(root: &Path, pid: u32) -> io::Result<HashMap<u32, u64>> {
    let sockfs = sockfs_mount_id()
        .ok_or_else(|| io::Error::other("cannot find sockfs's mount id in /proc/self/fdinfo"))?;
    let process = root.join(pid.to_string());
    let mut sockets = HashMap::new();
    let mut text = String::new();
    for entry in fs::read_dir(process.join("fdinfo"))? {
        let Ok(entry) = entry else { continue };
        let Some(fd): Option<u32> = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse().ok())
        else {
            continue;
        };
        text.clear();
        // Other failures than a denial are fds closed since the listing.
        match fs::File::open(entry.path()).and_then(|mut file| file.read_to_string(&mut text)) {
            Ok(_) => {}
            Err(error) if error.kind() == io::ErrorKind::PermissionDenied => return Err(error),
            Err(_) => continue,
        }
        let inode = match parse_fdinfo(&text) {
            FdInfo {
                mount: Some(mount),
                inode: Some(inode),
            } => (mount == sockfs).then_some(inode),
            // Before 5.14 fdinfo has no inode: the link says (its owner, or
            // CAP_DAC_READ_SEARCH, may read it).
            _ => fs::read_link(process.join("fd").join(fd.to_string()))
                .ok()
                .and_then(|link| socket_inode(link.to_str()?)),
        };
        if let Some(inode) = inode {
            sockets.insert(fd, inode);
        }
    }
    Ok(sockets)
}

/// The established connections in `/proc/<pid>/net/tcp{,6}` contents whose local port
/// is one that the process listens on (`sockets`: its fds, fd → inode), and which it
/// holds among its own fds: the server side of its connections.
pub fn served_connections(tables: &[&str], sockets: &HashMap<u32, u64>) -> Vec<ServedConnection> {
    let fd_of: HashMap<u64, u32> = sockets.iter().map(|(&fd, &inode)| (inode, fd)).collect();
    let rows: Vec<NetTcpRow> = tables
        .iter()
        .flat_map(|table| net_tcp_rows(table))
        .collect();
    let ports: HashSet<u16> = rows
        .iter()
        .filter(|row| row.state == TCP_LISTEN && fd_of.contains_key(&row.inode))
        .map(|row| row.local.port())
        .collect();
    rows.iter()
        .filter(|row| row.state == TCP_ESTABLISHED && ports.contains(&row.local.port()))
        .filter_map(|row| {
            Some(ServedConnection {
                fd: *fd_of.get(&row.inode)?,
                inode: row.inode,
                unread: row.rx_queue > 0,
            })
        })
        .collect()
}

/// [`served_connections`] of process `pid`, read from `root` (its namespace's tables
/// through `tables`).
pub fn served_connections_of(
    root: &Path,
    pid: u32,
    tables: &mut NetTables,
) -> io::Result<Vec<ServedConnection>> {
    let sockets = socket_fds(root, pid)?;
    let [v4, v6] = tables.of(root, pid)?;
    Ok(served_connections(&[v4, v6], &sockets))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_listening_read_stops_at_the_first_connection() -> io::Result<()> {
        let header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode";
        let listen = |sl: u32, inode: u64| {
            format!(
                "   {sl}: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 {inode} 1 0 100 0 0 10 0"
            )
        };
        let time_wait = "   2: 0100007F:1F90 0100007F:C350 06 00000000:00000000 03:00000FA0 00000000     0        0 0 3 0";
        // The kernel prints no listener after a connection; were one there, the read
        // would not reach it (the point: the connections are never read).
        let table = [
            header.to_owned(),
            listen(0, 11),
            listen(1, 12),
            time_wait.to_owned(),
            listen(3, 13),
        ]
        .join("\n");
        let rows = listening_rows(table.as_bytes())?;
        let inodes: Vec<u64> = parse_net_tcp(&rows).iter().map(|q| q.inode).collect();
        assert_eq!(inodes, [11, 12]);
        assert!(rows.starts_with(header), "{rows}");
        Ok(())
    }

    #[test]
    fn a_listener_printed_twice_counts_once() {
        let listener = "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000003 00:00000000 00000000     0        0 31337 1 0 100 0 0 10 0";
        let time_wait = "   1: 0100007F:1F90 0100007F:C350 06 00000000:00000000 03:00000FA0 00000000     0        0 0 3 0";
        let table = format!("header\n{listener}\n{listener}\n{time_wait}\n{time_wait}\n");
        let depths: Vec<(u64, u32)> = parse_net_tcp(&table)
            .iter()
            .map(|q| (q.inode, q.depth))
            .collect();
        assert_eq!(depths, [(31337, 3)]);
        assert_eq!(net_tcp_rows(&table).filter(|row| row.inode == 0).count(), 2);
    }

    #[test]
    fn net_tcp_listeners_v4_and_v6() {
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:1F90 00000000:0000 0A 00000000:00000003 00:00000000 00000000     0        0 31337 1 0000000000000000 100 0 0 10 0\n   1: 0100007F:1F90 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 31338 1 0000000000000000 20 4 30 10 -1\n";
        assert_eq!(
            parse_net_tcp(v4),
            vec![ListenQueue {
                inode: 31337,
                addr: "127.0.0.1:8080".parse().expect("addr"),
                depth: 3,
                limit: None,
            }]
        );
        let v6 = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 00000000000000000000000001000000:0050 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4444 1 0000000000000000 100 0 0 10 0\n";
        assert_eq!(
            parse_net_tcp(v6),
            vec![ListenQueue {
                inode: 4444,
                addr: "[::1]:80".parse().expect("addr"),
                depth: 0,
                limit: None,
            }]
        );
    }

    #[test]
    fn served_connections_are_the_established_ones_on_own_listening_ports() {
        // Listens on 8080 (inode 10, fd 3); holds 11 (unread bytes), 12 (idle) and 14
        // (its own outgoing connection to port 5432); 13 on 8080 is another
        // process's (not among its fds). The kernel printed 11 twice (a page boundary
        // while other sockets came and went).
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
            0: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 10 1 0 100 0 0 10 0\n\
            1: 0100007F:1F90 0100007F:C350 01 00000000:00000004 00:00000000 00000000     0        0 11 1 0 20 4 30 10 -1\n\
            1: 0100007F:1F90 0100007F:C350 01 00000000:00000004 00:00000000 00000000     0        0 11 1 0 20 4 30 10 -1\n\
            2: 0100007F:1F90 0100007F:C351 01 00000000:00000000 00:00000000 00000000     0        0 12 1 0 20 4 30 10 -1\n\
            3: 0100007F:1F90 0100007F:C352 01 00000000:00000000 00:00000000 00000000     0        0 13 1 0 20 4 30 10 -1\n\
            4: 0100007F:C353 0100007F:1538 01 00000000:00000000 00:00000000 00000000     0        0 14 1 0 20 4 30 10 -1\n";
        let sockets = HashMap::from([(3, 10), (5, 11), (6, 12), (7, 14)]);
        let mut found = served_connections(&[v4, ""], &sockets);
        found.sort_by_key(|c| c.fd);
        assert_eq!(
            found,
            vec![
                ServedConnection {
                    fd: 5,
                    inode: 11,
                    unread: true
                },
                ServedConnection {
                    fd: 6,
                    inode: 12,
                    unread: false
                },
            ]
        );
        // Without its listener among the fds, nothing is served.
        assert!(served_connections(&[v4], &HashMap::from([(5, 11)])).is_empty());
    }

    #[test]
    fn namespace_links() {
        assert_eq!(
            namespace_inode(Path::new("net:[4026531840]")),
            Some(4026531840)
        );
        assert_eq!(namespace_inode(Path::new("net:[x]")), None);
        assert_eq!(namespace_inode(Path::new("/dev/null")), None);
    }

    #[test]
    fn socket_links() {
        assert_eq!(socket_inode("socket:[123]"), Some(123));
        assert_eq!(socket_inode("pipe:[123]"), None);
        assert_eq!(socket_inode("/dev/null"), None);
        assert_eq!(
            parse_fdinfo("pos:\t0\nflags:\t02000002\nmnt_id:\t10\nino:\t3573548\n"),
            FdInfo {
                mount: Some(10),
                inode: Some(3573548)
            }
        );
        // Before 5.14.
        assert_eq!(
            parse_fdinfo("pos:\t0\nflags:\t02\nmnt_id:\t10\n"),
            FdInfo {
                mount: Some(10),
                inode: None
            }
        );
    }
}
