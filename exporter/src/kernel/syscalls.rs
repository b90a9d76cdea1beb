//! This architecture's syscall numbers: the request-path slots and what a thread
//! blocked in each syscall waits for.
use poolscope_shared::{SyscallSlot, WaitClass};

/// This architecture's number of the syscall.
pub(super) fn syscall_number(slot: SyscallSlot) -> Option<libc::c_long> {
    match slot {
        SyscallSlot::None => None,
        SyscallSlot::Accept => Some(libc::SYS_accept),
        SyscallSlot::Accept4 => Some(libc::SYS_accept4),
        SyscallSlot::Read => Some(libc::SYS_read),
        SyscallSlot::Readv => Some(libc::SYS_readv),
        SyscallSlot::Recvfrom => Some(libc::SYS_recvfrom),
        SyscallSlot::Recvmsg => Some(libc::SYS_recvmsg),
        SyscallSlot::Write => Some(libc::SYS_write),
        SyscallSlot::Writev => Some(libc::SYS_writev),
        SyscallSlot::Sendto => Some(libc::SYS_sendto),
        SyscallSlot::Sendmsg => Some(libc::SYS_sendmsg),
        SyscallSlot::Sendfile => Some(libc::SYS_sendfile),
        SyscallSlot::Close => Some(libc::SYS_close),
    }
}

/// futex_wait(2), 455 on every architecture since 6.7; libc has no name for it yet.
const SYS_FUTEX_WAIT: libc::c_long = 455;

/// What a thread blocked in each syscall waits for (DESIGN §3).
pub(super) fn wait_classes() -> Vec<(libc::c_long, WaitClass)> {
    let mut classes = vec![
        (libc::SYS_epoll_pwait, WaitClass::Idle),
        (libc::SYS_epoll_pwait2, WaitClass::Idle),
        (libc::SYS_ppoll, WaitClass::Poll),
        (libc::SYS_pselect6, WaitClass::Select),
        (libc::SYS_accept4, WaitClass::Idle),
        (libc::SYS_io_uring_enter, WaitClass::Idle),
        (libc::SYS_futex, WaitClass::Futex),
        (libc::SYS_futex_waitv, WaitClass::Futex),
        (SYS_FUTEX_WAIT, WaitClass::Futex),
        (libc::SYS_nanosleep, WaitClass::Sleep),
        (libc::SYS_clock_nanosleep, WaitClass::Sleep),
    ];
    classes.extend(
        [
            libc::SYS_read,
            libc::SYS_readv,
            libc::SYS_recvfrom,
            libc::SYS_recvmsg,
            libc::SYS_recvmmsg,
            libc::SYS_write,
            libc::SYS_writev,
            libc::SYS_sendto,
            libc::SYS_sendmsg,
            libc::SYS_sendmmsg,
            libc::SYS_sendfile,
            libc::SYS_splice,
            libc::SYS_connect,
        ]
        .map(|number| (number, WaitClass::Network)),
    );
    // The older calls that newer architectures only have in their p/2 forms.
    #[cfg(target_arch = "x86_64")]
    classes.extend([
        (libc::SYS_epoll_wait, WaitClass::Idle),
        (libc::SYS_poll, WaitClass::Poll),
        (libc::SYS_select, WaitClass::Select),
        (libc::SYS_accept, WaitClass::Idle),
    ]);
    classes
}
