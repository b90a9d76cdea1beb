//! Socket backend (kernel ≥ 6.3): requests from the `sock:*` tracepoints, keyed by
//! the socket's kernel address, so reads and writes by any thread, syscall or io_uring
//! count alike. `inet_sock_set_state` tells when a connection to a watched port enters
//! the accept queue and when it is gone; `sk_data_ready` when request bytes arrive.
//!
//! The three hot events (every receive, send and arrival on the host) are BTF
//! tracepoints: their arguments come as they are, with no record to build, and the
//! socket's fields are plain loads. A socket whose local port is no watched
//! listener's (a client's, most of the host's) costs one load and one array read in
//! `WATCHED_PORTS`, and no hash lookup.
use aya_ebpf::{
    helpers::bpf_probe_read_kernel,
    macros::{btf_tracepoint, tracepoint},
    programs::{BtfTracePointContext, TracePointContext},
};
use poolscope_shared::{ListenKey, watched_port_bit};

use poolscope_shared::Conn;

use crate::{
    maps::{ADOPT, ADOPTING, CONNS, LISTEN_PORTS, WATCHED_PORTS},
    requests::{self, Arrivals, now_ns},
};

/// Offsets in `inet_sock_set_state`'s record (/sys/kernel/tracing/events/sock/
/// inet_sock_set_state/format, unchanged since the tracepoint came in 4.16).
const STATE_SKADDR: usize = 8;
const STATE_OLD: usize = 16;
const STATE_NEW: usize = 20;
const STATE_SPORT: usize = 24;
const STATE_PROTOCOL: usize = 30;
/// The local address as IPv6 (IPv4 mapped, `::ffff:a.b.c.d`).
const STATE_SADDR_V6: usize = 40;

/// Offset of the `struct net *` in `struct sock` (`__sk_common.skc_net.net`), and of
/// the namespace's inode number in `struct net` (`ns.inum`), from the kernel's BTF;
/// 0 where it has none, and then every connection is claimed by port alone.
#[unsafe(no_mangle)]
static SOCK_NET_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static NET_INUM_OFFSET: u32 = 0;
/// Offset of the local port in `struct sock` (`__sk_common.skc_num`, host order),
/// from the kernel's BTF; the loader refuses the socket backend without it.
#[unsafe(no_mangle)]
static SOCK_PORT_OFFSET: u32 = 0;
/// Where a socket's inode number is: `sk->sk_socket`, the `struct inode` that follows
/// that `struct socket` in its `socket_alloc`, and `i_ino` in it (kernel BTF; 0 where
/// there is none, and then nothing is adopted).
#[unsafe(no_mangle)]
static SOCK_SOCKET_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SOCKET_INODE_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static INODE_INO_OFFSET: u32 = 0;

const IPPROTO_TCP: u16 = 6;
const TCP_ESTABLISHED: i32 = 1;
const TCP_SYN_RECV: i32 = 3;
const TCP_CLOSE: i32 = 7;
const TCP_CLOSE_WAIT: i32 = 8;

#[tracepoint]
pub fn sock_state(ctx: TracePointContext) -> u32 {
    match try_sock_state(&ctx) {
        Ok(()) | Err(_) => 0,
    }
}

fn try_sock_state(ctx: &TracePointContext) -> Result<(), i64> {
    // SAFETY (all reads): offsets match the tracepoint's format.
    let protocol: u16 = unsafe { ctx.read_at(STATE_PROTOCOL)? };
    if protocol != IPPROTO_TCP {
        return Ok(());
    }
    let key: u64 = unsafe { ctx.read_at(STATE_SKADDR)? };
    let new_state: i32 = unsafe { ctx.read_at(STATE_NEW)? };
    match new_state {
        TCP_ESTABLISHED => {
            let old_state: i32 = unsafe { ctx.read_at(STATE_OLD)? };
            // SYN_RECV → ESTABLISHED is the server side; clients come from SYN_SENT.
            if old_state != TCP_SYN_RECV {
                return Ok(());
            }
            let port: u16 = unsafe { ctx.read_at(STATE_SPORT)? };
            // A listener bound to the connection's own address, else one on every
            // address (the kernel prefers the same way).
            let mut listener = ListenKey {
                netns: namespace(key as *const u8)?,
                port: u32::from(port),
                addr: unsafe { ctx.read_at(STATE_SADDR_V6)? },
            };
            // SAFETY (both): copied out at once.
            let mut service = unsafe { LISTEN_PORTS.get(listener).copied() };
            if service.is_none() {
                listener.addr = ListenKey::ANY_ADDRESS;
                service = unsafe { LISTEN_PORTS.get(listener).copied() };
            }
            if let Some(service) = service {
                requests::connected(key, service, 0, now_ns());
            }
        }
        TCP_CLOSE_WAIT => {
            if let Some(conn) = CONNS.get_ptr_mut(key) {
                // SAFETY: a live entry; races with its own reader are tolerated (README).
                requests::peer_closed(unsafe { &mut *conn });
            }
        }
        TCP_CLOSE => requests::closed(key, now_ns()),
        _ => {}
    }
    Ok(())
}

/// The inode number of the network namespace of socket `sk`, or
/// [`ListenKey::ANY_NAMESPACE`] where the offsets are unknown.
#[inline(always)]
fn namespace(sk: *const u8) -> Result<u32, i64> {
    // SAFETY: load-time constants; volatile so that the compiler does not fold them.
    let (net_at, inum_at) = unsafe {
        (
            core::ptr::read_volatile(&SOCK_NET_OFFSET),
            core::ptr::read_volatile(&NET_INUM_OFFSET),
        )
    };
    if inum_at == 0 {
        return Ok(ListenKey::ANY_NAMESPACE);
    }
    // SAFETY: `sk` is the tracepoint's socket; the helper checks both reads.
    let net: *const u8 = unsafe { bpf_probe_read_kernel(sk.add(net_at as usize).cast())? };
    // SAFETY: as above.
    Ok(unsafe { bpf_probe_read_kernel(net.add(inum_at as usize).cast::<u32>())? })
}

/// The entry of socket `sk`, adopting it first if it was open before its service
/// was watched. A socket on a port no watched service listens on is none of ours:
/// one load and one array read; the others cost a lookup in `CONNS`, plus an array
/// read while user space has connections to adopt.
#[inline(always)]
fn conn(sk: *const u8) -> Option<*mut Conn> {
    // SAFETY: a load-time constant, read volatile so that it is not folded; `sk` is
    // the tracepoint's `struct sock *`, which the verifier lets us read directly.
    let port = unsafe {
        let at = core::ptr::read_volatile(&SOCK_PORT_OFFSET);
        core::ptr::read_volatile(sk.add(at as usize).cast::<u16>())
    };
    let (word, bit) = watched_port_bit(port);
    if WATCHED_PORTS.get(word).copied().unwrap_or(0) & bit == 0 {
        return None;
    }
    let key = sk as u64;
    if let Some(conn) = CONNS.get_ptr_mut(key) {
        return Some(conn);
    }
    if ADOPTING.get(0).copied().unwrap_or(0) == 0 {
        return None;
    }
    adopt(key).ok()?;
    CONNS.get_ptr_mut(key)
}

#[inline(never)]
fn adopt(key: u64) -> Result<(), i64> {
    // SAFETY: load-time constants; volatile so that the compiler does not fold them.
    let (socket_at, inode_at, ino_at) = unsafe {
        (
            core::ptr::read_volatile(&SOCK_SOCKET_OFFSET),
            core::ptr::read_volatile(&SOCKET_INODE_OFFSET),
            core::ptr::read_volatile(&INODE_INO_OFFSET),
        )
    };
    if socket_at == 0 {
        return Err(0);
    }
    let sk = key as *const u8;
    // SAFETY: `sk` is the tracepoint's socket; the helper checks both reads.
    let socket: *const u8 = unsafe { bpf_probe_read_kernel(sk.add(socket_at as usize).cast())? };
    if socket.is_null() {
        return Err(0);
    }
    // SAFETY: as above.
    let inode: u64 =
        unsafe { bpf_probe_read_kernel(socket.add((inode_at + ino_at) as usize).cast::<u64>())? };
    // SAFETY: copied out at once.
    let Some(adopted) = (unsafe { ADOPT.get(inode).copied() }) else {
        return Err(0);
    };
    // Whoever removes the entry accounts for it: user space prunes closed ones.
    ADOPT.remove(inode).map_err(i64::from)?;
    CONNS
        .insert(key, adopted, u64::from(aya_ebpf::bindings::BPF_NOEXIST))
        .map_err(i64::from)
}

/// sk_data_ready(const struct sock *sk)
#[btf_tracepoint(function = "sk_data_ready")]
pub fn sock_data_ready(ctx: BtfTracePointContext) -> i32 {
    if let Some(conn) = conn(ctx.arg(0)) {
        // SAFETY: a live entry; races with its own reader are tolerated (README).
        requests::data_arrived(unsafe { &mut *conn }, now_ns());
    }
    0
}

/// sock_recv_length(struct sock *sk, int ret, int flags)
#[btf_tracepoint(function = "sock_recv_length")]
pub fn sock_recv(ctx: BtfTracePointContext) -> i32 {
    let ret: i32 = ctx.arg(1);
    // EAGAIN (non-blocking sockets) and EOF carry no request bytes.
    if ret <= 0 {
        return 0;
    }
    if let Some(conn) = conn(ctx.arg(0)) {
        // SAFETY: as above.
        requests::read(unsafe { &mut *conn }, now_ns(), Arrivals::Seen);
    }
    0
}

/// sock_send_length(struct sock *sk, int ret, int flags)
#[btf_tracepoint(function = "sock_send_length")]
pub fn sock_send(ctx: BtfTracePointContext) -> i32 {
    let ret: i32 = ctx.arg(1);
    if ret <= 0 {
        return 0;
    }
    if let Some(conn) = conn(ctx.arg(0)) {
        // SAFETY: as above.
        requests::wrote(unsafe { &mut *conn }, now_ns());
    }
    0
}
