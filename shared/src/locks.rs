//! Lock waits: the primitive that saw them, their per-pool index and the key of a
//! top-contended lock.

#[cfg(doc)]
use crate::maps;

/// How a lock wait was seen: the `primitive` label of `lock_wait_seconds`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockPrimitive {
    /// Blocked in a futex wait without a timeout while serving, until back on CPU.
    Futex = 0,
    /// Inside `pthread_mutex_lock` while serving (opt-in uprobes), contended or not.
    PthreadMutex,
    /// As [`Self::Futex`], for a wait whose first futex call had a timeout: a JVM's
    /// `Thread.sleep` and timed parks, condition variables with a deadline, CPython's
    /// GIL request (5 ms at a time); a lock (a mutex) is rarely taken with one.
    FutexTimed,
}

impl LockPrimitive {
    pub const COUNT: u32 = 3;
    pub const ALL: [LockPrimitive; 3] = [Self::Futex, Self::FutexTimed, Self::PthreadMutex];

    pub const fn name(self) -> &'static str {
        match self {
            Self::Futex => "futex",
            Self::PthreadMutex => "pthread_mutex",
            Self::FutexTimed => "futex_timed",
        }
    }
}

/// Index into [`maps::LOCK_WAITS`].
pub const fn lock_wait_index(pool: u32, primitive: LockPrimitive) -> u32 {
    pool * LockPrimitive::COUNT + primitive as u32
}

/// Key of [`maps::LOCKS`]: one lock (a futex address in one process) waited on from
/// one call stack, with a timeout or without.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LockKey {
    pub tgid: u32,
    /// Id in [`maps::LOCK_STACKS`]; negative when the stack was not captured; with
    /// [`crate::SHORTENED_STACK`] set when it was kept less its innermost frame.
    pub stack: i32,
    pub address: u64,
    /// 1 for waits whose first futex call had a timeout ([`LockPrimitive::FutexTimed`]).
    pub timed: u32,
    pub _pad: u32,
}

const _: () = assert!(core::mem::size_of::<LockKey>() == 24);
