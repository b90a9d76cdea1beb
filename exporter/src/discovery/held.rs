//! The listen queue of a socket that another process holds, read through a copy of
//! its fd (`pidfd_getfd`, Linux 5.6; ptrace-attach permission, which
//! `CAP_SYS_PTRACE` gives) and `TCP_INFO`, which for a listener is `sk_ack_backlog`
//! and `sk_max_ack_backlog` (`tcpi_unacked`, `tcpi_sacked`). This reads the queues of
//! other network namespaces (pods) without their `net/tcp` tables, each read of
//! which walks the kernel's whole connection hash (~5 ms at 262,144 buckets, however
//! few sockets), and gives their limits, which the tables lack.
//!
//! The copy is closed at once: while it is open, the socket would outlive its owner's
//! close (microseconds here).
use std::{
    io,
    net::SocketAddr,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
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
