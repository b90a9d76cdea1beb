//! Socket backend (kernel ≥ 6.3): requests from the `sock:*` tracepoints, their
//! state kept in the socket itself (`SOCK_CONNS`), so reads and writes by any
//! thread, syscall or io_uring count alike. `inet_sock_set_state` tells when a
//! connection to a watched port enters the accept queue and when it is gone;
//! `sk_data_ready` when request bytes arrive.
//!
//! All four are BTF tracepoints: their arguments come as they are, with no record to
//! build, the socket's fields are plain loads, and the socket pointer is one the
//! socket-storage helpers take. A socket whose local port is no watched listener's
//! (a client's, most of the host's) costs one load and one array read in
//! `WATCHED_PORTS`; the others a read of their own storage, and no hash lookup.
use core::{ffi::c_void, ptr};

use aya_ebpf::{
    bindings::BPF_SK_STORAGE_GET_F_CREATE,
    helpers::{
        bpf_probe_read_kernel,
        generated::{bpf_sk_storage_delete, bpf_sk_storage_get},
    },
    macros::btf_tracepoint,
    programs::BtfTracePointContext,
};
use poolscope_shared::{
    Conn, ListenKey, LossErrno, LossSource, maps::CountedMap, watched_port_bit,
};

use crate::{
    clock::now_ns,
    h2,
    maps::{
        ADOPT, ADOPTING, LISTEN_CHANGES, LISTEN_PORTS, SERVICE_EPOCHS, SOCK_CONNS, WATCHED_PORTS,
        atomic_add, count_entries, count_loss,
    },
    requests::{self, Arrivals},
    source::Source,
};
use poolscope_shared::Phase;

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
/// Offsets in `struct sock` of what a handshake's claim reads (kernel BTF, as the
/// port): `sk_protocol`, `__sk_common.skc_family`, and the local address as IPv4
/// (`skc_rcv_saddr`) and IPv6 (`skc_v6_rcv_saddr`).
#[unsafe(no_mangle)]
pub(crate) static SOCK_PROTOCOL_OFFSET: u32 = 0;
/// Offset of the TCP state in `struct sock` (`__sk_common.skc_state`), as the port.
#[unsafe(no_mangle)]
pub(crate) static SOCK_STATE_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SOCK_FAMILY_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SOCK_SADDR_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SOCK_V6_SADDR_OFFSET: u32 = 0;
/// Where a socket's inode number is: `sk->sk_socket`, the `struct inode` that follows
/// that `struct socket` in its `socket_alloc`, and `i_ino` in it (kernel BTF; 0 where
/// there is none, and then nothing is adopted).
#[unsafe(no_mangle)]
static SOCK_SOCKET_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static SOCKET_INODE_OFFSET: u32 = 0;
#[unsafe(no_mangle)]
static INODE_INO_OFFSET: u32 = 0;

pub(crate) const IPPROTO_TCP: u16 = 6;
const AF_INET6: u16 = 10;
const TCP_ESTABLISHED: i32 = 1;
const TCP_SYN_RECV: i32 = 3;
const TCP_CLOSE: i32 = 7;
const TCP_CLOSE_WAIT: i32 = 8;
const TCP_LISTEN: i32 = 10;
/// recv's flag to look at queued bytes and leave them queued.
const MSG_PEEK: i32 = 2;

/// A load-time constant, read volatile so that the compiler does not fold it.
#[inline(always)]
pub(crate) fn offset(global: &u32) -> usize {
    // SAFETY: a static of this program.
    unsafe { ptr::read_volatile(global) as usize }
}

/// Reads a `T` at `at` in kernel object `base`; the helper checks the read.
#[inline(always)]
pub(crate) fn read_kernel<T>(base: *const u8, at: usize) -> Result<T, i64> {
    // SAFETY: the helper faults nothing; an offset from BTF names the field.
    unsafe { bpf_probe_read_kernel(base.wrapping_add(at).cast::<T>()) }.map_err(i64::from)
}

/// inet_sock_set_state(const struct sock *sk, const int oldstate, const int newstate)
#[btf_tracepoint(function = "inet_sock_set_state")]
pub fn sock_state(ctx: BtfTracePointContext) -> i32 {
    match try_sock_state(&ctx) {
        Ok(()) | Err(_) => 0,
    }
}

fn try_sock_state(ctx: &BtfTracePointContext) -> Result<(), i64> {
    let sk: *const u8 = ctx.arg(0);
    if field::<u16>(sk, &SOCK_PROTOCOL_OFFSET) != IPPROTO_TCP {
        return Ok(());
    }
    let new_state: i32 = ctx.arg(2);
    match new_state {
        TCP_ESTABLISHED => {
            let old_state: i32 = ctx.arg(1);
            // SYN_RECV → ESTABLISHED is the server side; clients come from SYN_SENT.
            if old_state == TCP_SYN_RECV
                && let Some(service) = listener(sk)?
            {
                claim(sk, service);
            }
        }
        TCP_CLOSE_WAIT => {
            if let Some(conn) = conn(sk) {
                // SAFETY: a live entry, changed by compare-and-swap.
                requests::peer_closed(unsafe { &mut *conn });
            }
        }
        TCP_LISTEN => listen_changed(),
        TCP_CLOSE if ctx.arg::<i32>(1) == TCP_LISTEN => listen_changed(),
        TCP_CLOSE => {
            if let Some(conn) = current(sk)
                // SAFETY: as above.
                && let Some(gone) = requests::closing(unsafe { &mut *conn })
            {
                let multiplexed = gone.multiplexed();
                gone.account(now_ns());
                if multiplexed {
                    // SAFETY: as above; `service` never changes.
                    h2::closed(sk, unsafe { (*conn).service });
                }
                unstore(sk);
            }
        }
        _ => {}
    }
    Ok(())
}

/// A socket began or stopped listening (`listen()`, a listener's close): rare, so
/// one shared counter.
#[inline(always)]
fn listen_changed() {
    if let Some(changes) = LISTEN_CHANGES.get_ptr_mut(0) {
        // SAFETY: the array's one element, valid while the program runs.
        atomic_add(unsafe { &mut *changes }, 1);
    }
}

/// The service whose listener accepted `sk`: one bound to the connection's own
/// address, else one on every address (the kernel prefers the same way).
#[inline(always)]
fn listener(sk: *const u8) -> Result<Option<u32>, i64> {
    // As the tracepoint's own record has it: IPv4 as `::ffff:a.b.c.d`.
    let mut addr = [0u8; 16];
    if field::<u16>(sk, &SOCK_FAMILY_OFFSET) == AF_INET6 {
        addr = read_kernel(sk, offset(&SOCK_V6_SADDR_OFFSET))?;
    } else {
        let v4: [u8; 4] = read_kernel(sk, offset(&SOCK_SADDR_OFFSET))?;
        addr[10] = 0xff;
        addr[11] = 0xff;
        addr[12..].copy_from_slice(&v4);
    }
    let mut key = ListenKey {
        netns: namespace(sk)?,
        port: u32::from(port(sk)),
        addr,
    };
    // SAFETY (both): copied out at once.
    if let Some(service) = unsafe { LISTEN_PORTS.get(key).copied() } {
        return Ok(Some(service));
    }
    key.addr = ListenKey::ANY_ADDRESS;
    Ok(unsafe { LISTEN_PORTS.get(key).copied() })
}

/// The inode number of the network namespace of socket `sk`, or
/// [`ListenKey::ANY_NAMESPACE`] where the offsets are unknown.
#[inline(always)]
fn namespace(sk: *const u8) -> Result<u32, i64> {
    let inum_at = offset(&NET_INUM_OFFSET);
    if inum_at == 0 {
        return Ok(ListenKey::ANY_NAMESPACE);
    }
    let net: *const u8 = read_kernel(sk, offset(&SOCK_NET_OFFSET))?;
    read_kernel(net, inum_at)
}

/// The local port of `sk`.
#[inline(always)]
fn port(sk: *const u8) -> u16 {
    field(sk, &SOCK_PORT_OFFSET)
}

/// The field of socket `sk` at the offset `global` holds: a plain load, since the
/// BTF tracepoints' `struct sock *` may be read directly (the verifier checks the
/// offset against the type; probe reads cost ~50 ns each).
#[inline(always)]
pub(crate) fn field<T>(sk: *const u8, global: &u32) -> T {
    load(sk, offset(global))
}

/// A plain load at `at` in kernel object `base`, a BTF-typed pointer (a BTF
/// tracepoint's argument, or a field loaded from one): the verifier checks the
/// offset against the type.
#[inline(always)]
pub(crate) fn load<T>(base: *const u8, at: usize) -> T {
    // SAFETY: `base` is typed by the kernel's BTF; the offset names one of its fields.
    unsafe { ptr::read_volatile(base.add(at).cast::<T>()) }
}

/// A new connection of `service` enters its queue.
#[inline(always)]
fn claim(sk: *const u8, service: u32) {
    let epoch = SERVICE_EPOCHS.get(service).copied().unwrap_or(0);
    let mut conn = requests::new_connection(service, 0, epoch, now_ns());
    if store(sk, &mut conn).is_some() {
        requests::accepted(service);
    }
}

/// The entry of socket `sk`, adopting it first if it was open before its service
/// was watched. A socket on a port no watched service listens on is none of ours:
/// one load and one array read; the others cost a read of the socket's own storage,
/// plus an array read while user space has connections to adopt.
#[inline(always)]
pub(crate) fn conn(sk: *const u8) -> Option<*mut Conn> {
    if !on_watched_port(sk) {
        return None;
    }
    conn_on_watched_port(sk)
}

/// Whether socket `sk`'s local port is one a watched service listens on: one load and
/// one array read, all that a socket of no watched service costs.
#[inline(always)]
pub(crate) fn on_watched_port(sk: *const u8) -> bool {
    let (word, bit) = watched_port_bit(port(sk));
    WATCHED_PORTS.get(word).copied().unwrap_or(0) & bit != 0
}

/// [`conn`] of a socket that [`on_watched_port`] let through.
#[inline(always)]
pub(crate) fn conn_on_watched_port(sk: *const u8) -> Option<*mut Conn> {
    if let Some(conn) = current(sk) {
        return Some(conn);
    }
    if ADOPTING.get(0).copied().unwrap_or(0) == 0 {
        return None;
    }
    adopt(sk)
}

/// The entry stored in `sk`, unless it belongs to a service that is gone: its id
/// went to another service since (a newer epoch), so it is dropped unaccounted.
#[inline(always)]
fn current(sk: *const u8) -> Option<*mut Conn> {
    let conn = stored(sk)?;
    // SAFETY: a live entry; `service` and `epoch` never change.
    let (service, epoch) = unsafe { ((*conn).service, (*conn).epoch) };
    if SERVICE_EPOCHS.get(service).copied() == Some(epoch) {
        return Some(conn);
    }
    unstore(sk);
    None
}

#[inline(never)]
fn adopt(sk: *const u8) -> Option<*mut Conn> {
    let socket_at = offset(&SOCK_SOCKET_OFFSET);
    if socket_at == 0 {
        return None;
    }
    let socket: *const u8 = read_kernel(sk, socket_at).ok()?;
    if socket.is_null() {
        return None;
    }
    let inode: u64 = read_kernel(
        socket,
        offset(&SOCKET_INODE_OFFSET) + offset(&INODE_INO_OFFSET),
    )
    .ok()?;
    // SAFETY: copied out at once.
    let mut adopted = unsafe { ADOPT.get(inode).copied() }?;
    // Whoever removes the entry accounts for it: user space prunes closed ones.
    ADOPT.remove(inode).ok()?;
    count_entries(CountedMap::Adopt, -1);
    store(sk, &mut adopted)
}

/// `SOCK_CONNS` as the helpers take it.
#[inline(always)]
fn sock_conns() -> *mut c_void {
    ptr::from_ref(&SOCK_CONNS).cast_mut().cast()
}

/// The entry stored in socket `sk`, if any.
#[inline(always)]
fn stored(sk: *const u8) -> Option<*mut Conn> {
    // SAFETY: `sk` is the tracepoint's `struct sock *`, as the helper wants it.
    let conn =
        unsafe { bpf_sk_storage_get(sock_conns(), sk.cast_mut().cast(), ptr::null_mut(), 0) };
    (!conn.is_null()).then_some(conn.cast())
}

/// Stores `conn` in socket `sk` (counted; a failure too).
#[inline(always)]
fn store(sk: *const u8, conn: &mut Conn) -> Option<*mut Conn> {
    // SAFETY: as above; `conn` is the initial value, copied by the helper.
    let stored = unsafe {
        bpf_sk_storage_get(
            sock_conns(),
            sk.cast_mut().cast(),
            ptr::from_mut(conn).cast(),
            BPF_SK_STORAGE_GET_F_CREATE.into(),
        )
    };
    if stored.is_null() {
        // The helper returns no errno: the socket's memory limit, nearly always.
        count_loss(LossSource::SockConnsInsert, LossErrno::Enomem);
        return None;
    }
    count_entries(CountedMap::SockConns, 1);
    Some(stored.cast())
}

/// Removes the entry of socket `sk` (counted).
#[inline(always)]
fn unstore(sk: *const u8) {
    // SAFETY: as above.
    if unsafe { bpf_sk_storage_delete(sock_conns(), sk.cast_mut().cast()) } == 0 {
        count_entries(CountedMap::SockConns, -1);
    }
}

/// sk_data_ready(const struct sock *sk)
#[btf_tracepoint(function = "sk_data_ready")]
pub fn sock_data_ready(ctx: BtfTracePointContext) -> i32 {
    let sk = ctx.arg(0);
    if let Some(conn) = conn(sk) {
        // SAFETY: a live entry, changed by compare-and-swap.
        let conn = unsafe { &mut *conn };
        if requests::phase(conn) == Phase::Multiplexed {
            h2::arrived(sk, now_ns());
        } else {
            requests::data_arrived(conn, now_ns());
        }
    }
    0
}

/// sock_recv_length(struct sock *sk, int ret, int flags)
#[btf_tracepoint(function = "sock_recv_length")]
pub fn sock_recv(ctx: BtfTracePointContext) -> i32 {
    let ret: i32 = ctx.arg(1);
    // EAGAIN (non-blocking sockets) and EOF carry no request bytes, and a peek leaves
    // its bytes to the read that takes them (walked twice, HTTP/2 frames would not
    // parse).
    if ret <= 0 || ctx.arg::<i32>(2) & MSG_PEEK != 0 {
        return 0;
    }
    let sk = ctx.arg(0);
    if let Some(conn) = conn(sk) {
        // SAFETY: as above.
        let conn = unsafe { &mut *conn };
        // HTTP/2's (a connection's first bytes tell it: the client preface), or
        // adopted mid-stream, or HTTP/1's.
        let http2 = h2::after_read(sk, conn, ret)
            || (conn.adopted != 0 && h2::adopted_mid_stream(conn, ret));
        if !http2 {
            read(conn, ret);
        }
    }
    0
}

/// A read of `len` request bytes on an HTTP/1 connection, in the reader's context.
#[inline(always)]
fn read(conn: &mut Conn, len: i32) {
    requests::read(
        conn,
        now_ns(),
        Arrivals::Seen,
        Source::of_current_call,
        len as u64,
    );
}

/// sock_send_length(struct sock *sk, int ret, int flags)
#[btf_tracepoint(function = "sock_send_length")]
pub fn sock_send(ctx: BtfTracePointContext) -> i32 {
    let ret: i32 = ctx.arg(1);
    if ret <= 0 {
        return 0;
    }
    let sk = ctx.arg(0);
    if let Some(conn) = conn(sk) {
        // SAFETY: as above.
        let conn = unsafe { &mut *conn };
        let http2 = h2::after_write(sk, conn, ret)
            || (conn.adopted != 0 && h2::adopted_mid_stream(conn, ret));
        if !http2 {
            requests::wrote_from(conn, now_ns(), ret as u32, Source::of_current_write);
        }
    }
    0
}
