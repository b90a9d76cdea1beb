//! The listen queue of a socket that another process holds, read through a copy of
//! its fd (`pidfd_getfd`, Linux 5.6; ptrace-attach permission, which
//! `CAP_SYS_PTRACE` gives) and `TCP_INFO`, which for a listener is `sk_ack_backlog`
//! and `sk_max_ack_backlog` (`tcpi_unacked`, `tcpi_sacked`). This reads the queues of
//! other network namespaces (pods) without their `net/tcp` tables, each read of
//! which walks the kernel's whole connection hash (~5 ms at 262,144 buckets, however
//! few sockets), and gives their limits, which the tables lack.
//!
//! The copy is closed at once: while it is open, the socket would outlive its owner's
//! close (microseconds here). A socket received this way takes its receiver's net_cls
//! classid and net_prio index (`__receive_sock`), which mean something only where
//! those cgroup v1 controllers are mounted: there no copy is made.
use std::{
    fs, io,
    net::SocketAddr,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::OnceLock,
};

use crate::discovery::sockdiag::ListenQueue;

/// A listening socket, and a process holding it with the fd it holds it at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldListener {
    pub inode: u64,
    pub addr: SocketAddr,
    pub pid: u32,
    pub fd: u32,
}

/// Whether copying a socket's fd leaves the socket as it was: no cgroup v1 hierarchy
/// with net_cls or net_prio is mounted (`/proc/self/mountinfo`; unreadable: not).
pub fn copies_leave_sockets_unchanged() -> bool {
    static UNCHANGED: OnceLock<bool> = OnceLock::new();
    *UNCHANGED.get_or_init(|| {
        fs::read_to_string("/proc/self/mountinfo")
            .is_ok_and(|mountinfo| !classifiers_mounted(&mountinfo))
    })
}

/// A `cgroup` (v1) mount with the net_cls or net_prio controller among its super
/// options, in `/proc/self/mountinfo` text.
fn classifiers_mounted(mountinfo: &str) -> bool {
    mountinfo.lines().any(|line| {
        let Some((_, after)) = line.split_once(" - ") else {
            return false;
        };
        let mut fields = after.split_whitespace();
        fields.next() == Some("cgroup")
            && fields.nth(1).is_some_and(|options| {
                options
                    .split(',')
                    .any(|option| option == "net_cls" || option == "net_prio")
            })
    })
}

/// `TCP_LISTEN` in `tcpi_state` (include/net/tcp_states.h).
const TCP_LISTEN: u8 = 10;

fn owned(returned: libc::c_long) -> io::Result<OwnedFd> {
    if returned < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = i32::try_from(returned).map_err(io::Error::other)?;
    // SAFETY: a descriptor the kernel has just returned, which nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The queue of `held`. Fails when the process is gone, its fd holds another file
/// now, or the socket no longer listens (then its tables tell, and a rescan finds
/// where it went), and where `pidfd_getfd` is missing or denied.
pub fn listen_queue(held: &HeldListener) -> io::Result<ListenQueue> {
    // SAFETY: pidfd_open(pid, flags) takes two integers.
    let process = owned(unsafe { libc::syscall(libc::SYS_pidfd_open, held.pid, 0) })?;
    // SAFETY: pidfd_getfd(pidfd, targetfd, flags) takes three integers.
    let socket =
        owned(unsafe { libc::syscall(libc::SYS_pidfd_getfd, process.as_raw_fd(), held.fd, 0) })?;
    // SAFETY: a zeroed stat is valid, and fstat fills it.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid descriptor and a stat to fill.
    if unsafe { libc::fstat(socket.as_raw_fd(), &mut stat) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // The pid or the fd may have been reused since the scan.
    if stat.st_ino != held.inode {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "the fd holds another file now",
        ));
    }
    // SAFETY: a zeroed tcp_info is valid, and getsockopt fills it.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut length = size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` is valid for `length` bytes.
    let got = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            std::ptr::from_mut(&mut info).cast(),
            &mut length,
        )
    };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    if info.tcpi_state != TCP_LISTEN {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "the socket no longer listens",
        ));
    }
    Ok(ListenQueue {
        inode: held.inode,
        addr: held.addr,
        depth: info.tcpi_unacked,
        limit: Some(info.tcpi_sacked),
    })
}

#[cfg(test)]
mod tests {
    use std::{
        net::{TcpListener, TcpStream},
        os::{fd::AsRawFd as _, unix::fs::MetadataExt as _},
    };

    use super::*;

    #[test]
    fn net_classifiers_are_found_among_cgroup_v1_mounts_only() {
        let v2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
        let v1 = "31 23 0:27 / /sys/fs/cgroup/net_cls,net_prio rw - cgroup cgroup rw,net_cls,net_prio\n\
                  32 23 0:28 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu,cpuacct\n";
        let v1_without = "32 23 0:28 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu,cpuacct\n";
        assert!(!classifiers_mounted(v2));
        assert!(classifiers_mounted(v1));
        assert!(!classifiers_mounted(v1_without));
    }

    /// A listener of this process with two connections waiting, read as another
    /// process's would be; a stale fd or inode is refused.
    #[test]
    fn reads_a_held_listeners_queue_and_refuses_a_stale_one() -> io::Result<()> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let inode = std::fs::metadata(format!("/proc/self/fd/{}", listener.as_raw_fd()))?.ino();
        let waiting = [TcpStream::connect(addr)?, TcpStream::connect(addr)?];
        let held = HeldListener {
            inode,
            addr,
            pid: std::process::id(),
            fd: listener.as_raw_fd() as u32,
        };
        let queue = listen_queue(&held)?;
        assert_eq!(queue.inode, inode);
        assert_eq!(queue.depth, waiting.len() as u32);
        // std listens with a backlog of 128 (the kernel caps it at somaxconn).
        let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")?
            .trim()
            .parse()
            .map_err(io::Error::other)?;
        assert_eq!(queue.limit, Some(128.min(somaxconn)));
        let other_inode = HeldListener {
            inode: inode + 1,
            ..held
        };
        assert!(listen_queue(&other_inode).is_err());
        let connection = HeldListener {
            inode: std::fs::metadata(format!("/proc/self/fd/{}", waiting[0].as_raw_fd()))?.ino(),
            fd: waiting[0].as_raw_fd() as u32,
            ..held
        };
        assert!(
            listen_queue(&connection).is_err(),
            "a connection does not listen"
        );
        Ok(())
    }
}
