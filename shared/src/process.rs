//! Process lifecycle events sent by the kernel through a ring buffer.

#[cfg(doc)]
use crate::maps;

/// Kind of [`ProcessEvent`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessEventKind {
    /// A watched process forked; the child is already in [`maps::WATCHED`].
    Fork = 1,
    /// A process (watched or not) called exec.
    Exec = 2,
    /// The last thread of a watched process exited; it is already out of [`maps::WATCHED`].
    Exit = 3,
    /// A watched thread changed its name (`pid` is its tid): its pool may change.
    ThreadRenamed = 4,
}

/// Sent through [`maps::PROCESS_EVENTS`]; rare (process lifecycle only).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessEvent {
    pub kind: u32,
    pub pid: u32,
    /// Parent tgid for `Fork`, 0 otherwise.
    pub parent: u32,
    /// Service id for `Fork`/`Exit`, `u32::MAX` for `Exec`.
    pub service: u32,
    /// `Watched::since_ns` of the child (`Fork`) or of the exited process (`Exit`).
    pub since_ns: u64,
}

const _: () = assert!(core::mem::size_of::<ProcessEvent>() == 24);
