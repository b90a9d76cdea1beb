//! Failed updates of kernel maps made by user space (a full `WATCHED`, a refused
//! `LISTEN_PORTS` entry), counted by map and errno class for
//! `poolscope_map_update_errors_total`.
use std::collections::BTreeMap;

use aya::maps::MapError;
use poolscope_shared::LossErrno;

/// Failed inserts into kernel maps from user space, by map and errno.
#[derive(Clone, Debug, Default)]
pub struct MapErrors(BTreeMap<(&'static str, LossErrno), u64>);

impl MapErrors {
    pub fn count(&mut self, map: &'static str, error: &MapError) {
        *self.0.entry((map, errno_of(error))).or_default() += 1;
    }

    pub fn iter(&self) -> impl Iterator<Item = (&'static str, LossErrno, u64)> + '_ {
        self.0
            .iter()
            .map(|(&(map, errno), &count)| (map, errno, count))
    }
}

/// The errno class of a failed map operation from user space.
fn errno_of(error: &MapError) -> LossErrno {
    match error {
        MapError::SyscallError(error) => error
            .io_error
            .raw_os_error()
            .map_or(LossErrno::Other, |errno| LossErrno::of(-i64::from(errno))),
        _ => LossErrno::Other,
    }
}
