//! Where the kernel programs read kernel structures: field offsets from the kernel's
//! BTF (`/sys/kernel/btf/vmlinux`), found at start-up and
//! passed to the programs as load-time globals (aya-ebpf has no CO-RE). A missing
//! offset is logged once with what poolscope does without it.
use super::btf;

/// Whether sched_process_exit passes `group_dead` (since 6.16), from its BTF
/// arguments; without it the group leader's exit stands for the process's.
pub(super) fn exit_has_group_dead(vmlinux: &[u8]) -> bool {
    btf::tracepoint_args(vmlinux, "sched_process_exit").is_ok_and(|args| args >= 2)
}

/// The kernel's BTF, `None` (logged) where it has none.
pub(super) fn vmlinux_btf() -> Option<Vec<u8>> {
    match std::fs::read(BTF_VMLINUX) {
        Ok(vmlinux) => Some(vmlinux),
        Err(error) => {
            tracing::warn!(
                %error,
                "no kernel BTF at {BTF_VMLINUX} (a kernel built without \
                 CONFIG_DEBUG_INFO_BTF): thread states, pool utilization and lock waits \
                 are not measured, and the socket backend claims connections by port \
                 alone, in whatever network namespace"
            );
            None
        }
    }
}

/// The offsets `find` reads from the kernel's BTF, or `None` with a warning that
/// says `what` could not be found and what poolscope does without it (`lost`).
fn found<T>(find: impl FnOnce() -> Result<T, btf::BtfError>, what: &str, lost: &str) -> Option<T> {
    match find() {
        Ok(found) => Some(found),
        Err(error) => {
            tracing::warn!(%error, "cannot find {what} in {BTF_VMLINUX}: {lost}");
            None
        }
    }
}

/// Where the socket programs read a socket's fields in `struct sock`, as their
/// globals name them: the local port (`__sk_common.skc_num`), read on every event,
/// and what a handshake's claim reads (protocol, family, local address as IPv4 and
/// IPv6; the last 0 on a kernel without IPv6, whose sockets are never `AF_INET6`),
/// and the TCP state (`skc_state`, which the tcp backend's transmits check).
pub(super) fn socket_offsets(vmlinux: &[u8]) -> Option<[(&'static str, u32); 6]> {
    found(
        || {
            let member = |strukt, member| btf::member_offset(vmlinux, strukt, member);
            let common = member("sock", "__sk_common")?;
            Ok::<_, btf::BtfError>([
                (
                    "SOCK_PORT_OFFSET",
                    common + member("sock_common", "skc_num")?,
                ),
                ("SOCK_PROTOCOL_OFFSET", member("sock", "sk_protocol")?),
                (
                    "SOCK_STATE_OFFSET",
                    common + member("sock_common", "skc_state")?,
                ),
                (
                    "SOCK_FAMILY_OFFSET",
                    common + member("sock_common", "skc_family")?,
                ),
                (
                    "SOCK_SADDR_OFFSET",
                    common + member("sock_common", "skc_rcv_saddr")?,
                ),
                (
                    "SOCK_V6_SADDR_OFFSET",
                    member("sock_common", "skc_v6_rcv_saddr").map_or(0, |at| common + at),
                ),
            ])
        },
        "a socket's port, protocol or address",
        "the socket backend's probes are skipped",
    )
}

/// Where the tcp backend's programs read (`tcp.rs`, as its globals name them): a
/// packet's socket and TCP's control block in it (`sk_buff.sk`, `sk_buff.cb`, and
/// `seq`, `end_seq`, `tcp_flags` of `struct tcp_skb_cb`), and a TCP socket's next
/// sequence number to send and the one after its last byte written (`tcp_sock`'s
/// `snd_nxt`, `write_seq`), and the next to copy to the reader, the next to receive,
/// and the bytes received in order (`copied_seq`, `rcv_nxt`, `bytes_received`).
pub(super) fn tcp_offsets(vmlinux: &[u8]) -> Option<[(&'static str, u32); 10]> {
    found(
        || {
            let member = |strukt, member| btf::member_offset(vmlinux, strukt, member);
            Ok::<_, btf::BtfError>([
                ("SKB_SOCK_OFFSET", member("sk_buff", "sk")?),
                ("SKB_CB_OFFSET", member("sk_buff", "cb")?),
                ("TCP_CB_SEQ_OFFSET", member("tcp_skb_cb", "seq")?),
                ("TCP_CB_END_SEQ_OFFSET", member("tcp_skb_cb", "end_seq")?),
                ("TCP_CB_FLAGS_OFFSET", member("tcp_skb_cb", "tcp_flags")?),
                ("TCP_SND_NXT_OFFSET", member("tcp_sock", "snd_nxt")?),
                ("TCP_WRITE_SEQ_OFFSET", member("tcp_sock", "write_seq")?),
                ("TCP_COPIED_SEQ_OFFSET", member("tcp_sock", "copied_seq")?),
                ("TCP_RCV_NXT_OFFSET", member("tcp_sock", "rcv_nxt")?),
                (
                    "TCP_BYTES_RECEIVED_OFFSET",
                    member("tcp_sock", "bytes_received")?,
                ),
            ])
        },
        "a packet's socket or TCP's sequence numbers",
        "the tcp backend's probes are skipped",
    )
}

/// Where the tcp backend's HTTP/2 programs (`tcp_h2.rs`) find `tcp_recvmsg`'s flags
/// among its arguments: a `nonblock` argument came before them until Linux 5.19.
pub(super) fn tcp_http2_arguments(vmlinux: &[u8]) -> Option<[(&'static str, u32); 1]> {
    found(
        || {
            let flags = btf::function_param(vmlinux, "tcp_recvmsg", "flags")?;
            Ok::<_, btf::BtfError>([("TCP_RECVMSG_FLAGS_ARG", flags)])
        },
        "tcp_recvmsg's arguments",
        "HTTP/2 is not followed on the tcp backend",
    )
}

/// Where the socket backend finds a socket's network namespace: the offset of the
/// `struct net *` in `struct sock` (`__sk_common.skc_net`, a `possible_net_t` whose
/// only member is that pointer), and of the inode number in `struct net` (`ns.inum`).
pub(super) fn socket_namespace_offsets(vmlinux: &[u8]) -> Option<(u32, u32)> {
    found(
        || {
            let sock_net = btf::member_offset(vmlinux, "sock", "__sk_common")?
                + btf::member_offset(vmlinux, "sock_common", "skc_net")?;
            let net_inum = btf::member_offset(vmlinux, "net", "ns")?
                + btf::member_offset(vmlinux, "ns_common", "inum")?;
            Ok::<_, btf::BtfError>((sock_net, net_inum))
        },
        "a socket's network namespace",
        "the socket backend claims connections by port alone, in whatever network namespace",
    )
}

/// Where the sched programs find the peer of the socket a serving thread waits on
/// (`downstream.rs`): the fd table of the task, the socket of a file, and the
/// socket's family, ports and remote address, in that program's order of globals.
pub(super) fn downstream_offsets(vmlinux: &[u8]) -> Option<[(&'static str, u32); 12]> {
    found(
        || {
            let member = |strukt, member| btf::member_offset(vmlinux, strukt, member);
            let common = member("sock", "__sk_common")?;
            Ok::<_, btf::BtfError>([
                ("TASK_FILES_OFFSET", member("task_struct", "files")?),
                ("FILES_FDT_OFFSET", member("files_struct", "fdt")?),
                ("FDT_MAX_FDS_OFFSET", member("fdtable", "max_fds")?),
                ("FDT_FD_OFFSET", member("fdtable", "fd")?),
                ("FILE_PRIVATE_DATA_OFFSET", member("file", "private_data")?),
                ("SOCKET_FILE_OFFSET", member("socket", "file")?),
                ("SOCKET_SK_OFFSET", member("socket", "sk")?),
                (
                    "SK_FAMILY_OFFSET",
                    common + member("sock_common", "skc_family")?,
                ),
                (
                    "SK_LOCAL_PORT_OFFSET",
                    common + member("sock_common", "skc_num")?,
                ),
                (
                    "SK_DPORT_OFFSET",
                    common + member("sock_common", "skc_dport")?,
                ),
                (
                    "SK_DADDR_OFFSET",
                    common + member("sock_common", "skc_daddr")?,
                ),
                (
                    "SK_V6_DADDR_OFFSET",
                    common + member("sock_common", "skc_v6_daddr")?,
                ),
            ])
        },
        "a task's sockets",
        "network waits are not attributed to their downstream peers",
    )
}

/// Where the socket backend finds a socket's inode number (what `/proc/<pid>/fd`
/// shows), to adopt connections open before the watch: `sock.sk_socket`, the
/// `struct inode` after that `struct socket` in its `socket_alloc`, and `inode.i_ino`.
pub(super) fn socket_inode_offsets(vmlinux: &[u8]) -> Option<(u32, u32, u32)> {
    found(
        || {
            let socket = btf::member_offset(vmlinux, "sock", "sk_socket")?;
            let inode = btf::member_offset(vmlinux, "socket_alloc", "vfs_inode")?
                .checked_sub(btf::member_offset(vmlinux, "socket_alloc", "socket")?)
                .ok_or_else(|| btf::BtfError::NoMember {
                    strukt: "socket_alloc".into(),
                    member: "socket before vfs_inode".into(),
                })?;
            let ino = btf::member_offset(vmlinux, "inode", "i_ino")?;
            Ok::<_, btf::BtfError>((socket, inode, ino))
        },
        "a socket's inode",
        "the socket backend does not follow connections opened before their service was watched",
    )
}

/// Where the scheduler programs read a task's run-queue waits as the kernel counts
/// them (`task_struct.sched_info`, CONFIG_SCHED_INFO) and its run queue's clock
/// (`task_struct.se.cfs_rq`, then `cfs_rq.rq`, CONFIG_FAIR_GROUP_SCHED, then
/// `rq.clock`), in `sched.rs`' order of globals.
pub(super) fn run_delay_offsets(vmlinux: &[u8]) -> Option<[(&'static str, u32); 5]> {
    found(
        || {
            let member = |strukt, member| btf::member_offset(vmlinux, strukt, member);
            let sched_info = member("task_struct", "sched_info")?;
            Ok::<_, btf::BtfError>([
                (
                    "TASK_RUN_DELAY_OFFSET",
                    sched_info + member("sched_info", "run_delay")?,
                ),
                (
                    "TASK_LAST_QUEUED_OFFSET",
                    sched_info + member("sched_info", "last_queued")?,
                ),
                (
                    "TASK_CFS_RQ_OFFSET",
                    member("task_struct", "se")? + member("sched_entity", "cfs_rq")?,
                ),
                ("CFS_RQ_RQ_OFFSET", member("cfs_rq", "rq")?),
                ("RQ_CLOCK_OFFSET", member("rq", "clock")?),
            ])
        },
        "a task's run-queue accounting",
        "sched_wakeup is attached to time run-queue waits (a clock read per wakeup)",
    )
}

/// `task_struct.pid`'s offset from the kernel's BTF; `None` (logged) without it.
pub(super) fn task_pid_offset(vmlinux: &[u8]) -> Option<u32> {
    match btf::member_offset(vmlinux, "task_struct", "pid") {
        Ok(offset) => Some(offset),
        Err(error) => {
            tracing::warn!(%error, "cannot read task_struct.pid from {BTF_VMLINUX}: thread states, pool utilization and lock waits are not measured");
            None
        }
    }
}

pub(super) const BTF_VMLINUX: &str = "/sys/kernel/btf/vmlinux";
