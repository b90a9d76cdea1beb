//! A process's file-backed memory mappings (`/proc/<pid>/maps`), and the C library
//! among them.
use std::path::{Path, PathBuf};

/// One mapping of /proc/<pid>/maps that has a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// File offset of `start`.
    pub offset: u64,
    pub path: PathBuf,
}

/// The file-backed mappings of a /proc/<pid>/maps text.
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (start, end) = fields.next()?.split_once('-')?;
            let _permissions = fields.next()?;
            let offset = u64::from_str_radix(fields.next()?, 16).ok()?;
            let _device = fields.next()?;
            let _inode = fields.next()?;
            let path = fields.collect::<Vec<_>>().join(" ");
            if !path.starts_with('/') {
                return None;
            }
            Some(Mapping {
                start: u64::from_str_radix(start, 16).ok()?,
                end: u64::from_str_radix(end, 16).ok()?,
                offset,
                path: PathBuf::from(path),
            })
        })
        .collect()
}

/// The file-backed mappings of process `pid` (empty if it is gone).
pub fn maps(root: &Path, pid: u32) -> Vec<Mapping> {
    std::fs::read_to_string(root.join(pid.to_string()).join("maps"))
        .map(|text| parse_maps(&text))
        .unwrap_or_default()
}

/// The C library that `pid` maps (glibc or musl), as a path in its mount namespace.
pub fn libc_path(root: &Path, pid: u32) -> Option<PathBuf> {
    libc_of(&maps(root, pid))
}

pub(super) fn libc_of(mappings: &[Mapping]) -> Option<PathBuf> {
    mappings
        .iter()
        .find(|mapping| {
            mapping
                .path
                .file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| {
                    name.starts_with("libc.so")
                        || (name.starts_with("libc-") && name.ends_with(".so"))
                        || name.starts_with("ld-musl-")
                })
        })
        .map(|mapping| mapping.path.clone())
}
