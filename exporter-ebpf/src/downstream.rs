//! Which downstream a serving thread waits on: when it blocks on the network (a
//! read or write, or a worker's poll, see `Activity::blocked`), the socket in its
//! hands is found from the syscall's fd through the task's fd table, and its peer
//! (address and port) is kept in the thread's entry; the wait's time then goes to
//! that (pool, peer) in `DOWNSTREAM_WAITS`. A socket whose local port is a watched
//! listener's is a client's connection, not a downstream, and is left out.
//!
//! Every offset comes from the kernel's BTF (0 where it has none: no peer is found).
//! The fd → socket walk costs about a dozen probe reads, once per network wait of a
//! serving thread, never on a switch of an unwatched one.
use aya_ebpf::helpers::{bpf_get_current_task_btf, bpf_probe_read_kernel, bpf_probe_read_user};
use poolscope_shared::{
    DownstreamKey, DownstreamWait, LossSource, MAX_DOWNSTREAM_FDS, Peer, WaitClass,
    watched_port_bit,
};

use crate::{
    abi::SavedRegisters,
    maps::{DOWNSTREAM_WAITS, WATCHED_PORTS, atomic_add, get_or_insert},
};

/// `task_struct.files`, `files_struct.fdt`, `fdtable.max_fds` and `fdtable.fd`.
#[unsafe(no_mangle)]
static TASK_FILES_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static FILES_FDT_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static FDT_MAX_FDS_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static FDT_FD_OFFSET: u32 = 0;
/// `file.private_data` (a socket's `struct socket`), and `socket.file` and
/// `socket.sk`: a file is a socket's when its private data points back to it.
#[unsafe(no_mangle)]
static FILE_PRIVATE_DATA_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SOCKET_FILE_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SOCKET_SK_OFFSET: u32 = 0;
/// In `struct sock` (`__sk_common`): `skc_family`, `skc_num` (local port, host
/// order), `skc_dport` (network order), `skc_daddr`, `skc_v6_daddr`.
#[unsafe(no_mangle)]
static SK_FAMILY_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SK_LOCAL_PORT_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SK_DPORT_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SK_DADDR_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SK_V6_DADDR_OFFSET: u32 = 0;

#[inline(always)]
fn offset(of: &u32) -> usize {
    // SAFETY: a load-time constant; volatile so that the compiler does not fold it.
    unsafe { core::ptr::read_volatile(of) as usize }
}

/// Reads a `T` at `base + at` in kernel memory.
#[inline(always)]
fn read<T>(base: *const u8, at: &u32) -> Option<T> {
    // SAFETY: the helper checks the read.
    unsafe { bpf_probe_read_kernel(base.wrapping_add(offset(at)).cast::<T>()) }.ok()
}

/// The peer of the socket the current thread blocks on in syscall `class` (saved
/// registers `regs`), if it is a socket with a peer and not a watched listener's
/// connection. A poll's fds (at most `polled_fds`, capped) are tried in order.
#[inline(always)]
pub fn peer_of_wait(regs: SavedRegisters, class: WaitClass, polled_fds: u64) -> Peer {
    if offset(&SOCKET_SK_OFFSET) == 0 {
        return Peer::NONE;
    }
    let first = regs.first_arg();
    match class {
        WaitClass::Network => peer_of_fd(first as i32).unwrap_or(Peer::NONE),
        WaitClass::Poll => {
            // struct pollfd { int fd; short events, revents; } at the user pointer.
            let fds = polled_fds.min(MAX_DOWNSTREAM_FDS);
            for index in 0..MAX_DOWNSTREAM_FDS {
                if index >= fds {
                    break;
                }
                let at = (first + index * 8) as *const i32;
                // SAFETY: a user pointer of the current thread; the helper checks it.
                let Ok(fd) = (unsafe { bpf_probe_read_user(at) }) else {
                    break;
                };
                if let Some(peer) = peer_of_fd(fd) {
                    return peer;
                }
            }
            Peer::NONE
        }
        _ => Peer::NONE,
    }
}

#[inline(always)]
fn peer_of_fd(fd: i32) -> Option<Peer> {
    if fd < 0 {
        return None;
    }
    // SAFETY: the current task is valid while its program runs.
    let task = unsafe { bpf_get_current_task_btf() } as *const u8;
    let files: *const u8 = read(task, &TASK_FILES_OFFSET)?;
    let fdt: *const u8 = read(files, &FILES_FDT_OFFSET)?;
    let max_fds: u32 = read(fdt, &FDT_MAX_FDS_OFFSET)?;
    if fd as u32 >= max_fds {
        return None;
    }
    let table: *const u8 = read(fdt, &FDT_FD_OFFSET)?;
    // SAFETY: the helper checks the read.
    let file: *const u8 =
        unsafe { bpf_probe_read_kernel(table.wrapping_add(fd as usize * 8).cast()) }.ok()?;
    let socket: *const u8 = read(file, &FILE_PRIVATE_DATA_OFFSET)?;
    let back: *const u8 = read(socket, &SOCKET_FILE_OFFSET)?;
    if file.is_null() || back != file {
        return None;
    }
    let sk: *const u8 = read(socket, &SOCKET_SK_OFFSET)?;
    let family: u16 = read(sk, &SK_FAMILY_OFFSET)?;
    let local_port: u16 = read(sk, &SK_LOCAL_PORT_OFFSET)?;
    let (word, bit) = watched_port_bit(local_port);
    if WATCHED_PORTS.get(word).is_some_and(|bits| bits & bit != 0) {
        return None;
    }
    let port = u16::from_be(read(sk, &SK_DPORT_OFFSET)?);
    let mut peer = Peer {
        port,
        family,
        ..Peer::NONE
    };
    match family {
        Peer::AF_INET => {
            let addr: [u8; 4] = read(sk, &SK_DADDR_OFFSET)?;
            peer.addr[..4].copy_from_slice(&addr);
        }
        Peer::AF_INET6 => peer.addr = read(sk, &SK_V6_DADDR_OFFSET)?,
        _ => return None,
    }
    (port != 0).then_some(peer)
}

/// `ns` of a network wait of a thread of `pool` on `peer`; `ended` when the wait is
/// over (not only cut at a request boundary).
#[inline(always)]
pub fn waited(pool: u32, peer: Peer, ns: u64, ended: bool) {
    let key = DownstreamKey { pool, peer };
    let Some(wait) = get_or_insert(
        &DOWNSTREAM_WAITS,
        None,
        &key,
        &DownstreamWait::default(),
        LossSource::DownstreamInsert,
    ) else {
        return;
    };
    // SAFETY: a live map value; concurrent updates are atomic adds.
    let wait = unsafe { &mut *wait };
    atomic_add(&mut wait.wait_ns, ns);
    if ended {
        atomic_add(&mut wait.waits, 1);
    }
}
