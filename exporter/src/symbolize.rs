//! Addresses to names, with blazesym: ELF symbols and DWARF where present, the perf
//! maps of JIT runtimes (`/tmp/perf-<pid>.map`) for user stacks, and kallsyms (or a
//! vmlinux found on the host) for kernel stacks. An address no symbol covers is
//! named after its module and offset; none is dropped. Lookups are batched per
//! process; the blazesym cache lives as long as the [`Symbols`] that owns it.
use std::path::{Path, PathBuf};

use blazesym::symbolize::{
    Input, Symbolized, Symbolizer,
    source::{Kernel, Process, Source},
};

use crate::procfs::{self, Mapping};

/// What one address resolved to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Symbol {
    /// The function, or `module+0xoffset` (the bare address if no module maps it).
    pub name: String,
    /// File name of the module; `[kernel]` for kernel addresses; empty if unknown.
    pub module: String,
    /// Offset into the function, when a symbol was found.
    pub offset: Option<u64>,
}

impl Symbol {
    /// `name+0xoffset (module)`, or the bare name for unknown frames.
    pub fn describe(&self) -> String {
        match self.offset {
            Some(offset) => format!("{}+{offset:#x} ({})", self.name, self.module),
            None => self.name.clone(),
        }
    }
}

/// Module name of a blazesym symbol or mapping path: its file name.
fn file_name(path: &Path) -> String {
    path.file_name()
        .unwrap_or(path.as_os_str())
        .to_string_lossy()
        .into_owned()
}

/// `module+0xoffset` of an address no symbol covers, or the bare address.
pub fn module_offset(mappings: &[Mapping], address: u64) -> Symbol {
    match mappings
        .iter()
        .find(|m| (m.start..m.end).contains(&address))
    {
        Some(mapping) => {
            let module = file_name(&mapping.path);
            Symbol {
                name: format!("{module}+{:#x}", address - mapping.start + mapping.offset),
                module,
                offset: None,
            }
        }
        None => Symbol {
            name: format!("{address:#x}"),
            module: String::new(),
            offset: None,
        },
    }
}

/// The address to look up for each frame of a stack (innermost first): every frame
/// but the innermost is a return address, and the call is the instruction before
/// it, which may belong to another function (a call at a function's end).
pub fn lookup_addresses(stack: &[u64]) -> impl Iterator<Item = u64> + '_ {
    stack.iter().enumerate().map(|(index, &address)| {
        if index == 0 {
            address
        } else {
            address.saturating_sub(1)
        }
    })
}

/// A symbolizer with its cache.
pub struct Symbols {
    symbolizer: Symbolizer,
    procfs_root: PathBuf,
}

impl Symbols {
    pub fn new(procfs_root: &Path) -> Self {
        Self {
            symbolizer: Symbolizer::new(),
            procfs_root: procfs_root.to_owned(),
        }
    }

    /// Symbols of `addresses` (already lookup addresses) in process `pid`, in order.
    pub fn user(&self, pid: u32, addresses: &[u64]) -> Vec<Symbol> {
        let source = Source::Process(Process::new(blazesym::Pid::from(pid)));
        let mappings = procfs::maps(&self.procfs_root, pid);
        self.resolve(&source, addresses, |address| {
            module_offset(&mappings, address)
        })
    }

    /// Symbols of kernel `addresses`, in order.
    pub fn kernel(&self, addresses: &[u64]) -> Vec<Symbol> {
        let source = Source::Kernel(Kernel::default());
        self.resolve(&source, addresses, |address| Symbol {
            name: format!("{address:#x}"),
            module: "[kernel]".to_owned(),
            offset: None,
        })
    }

    fn resolve(
        &self,
        source: &Source<'_>,
        addresses: &[u64],
        unknown: impl Fn(u64) -> Symbol,
    ) -> Vec<Symbol> {
        if addresses.is_empty() {
            return Vec::new();
        }
        let symbols = self
            .symbolizer
            .symbolize(source, Input::AbsAddr(addresses))
            .unwrap_or_else(|error| {
                tracing::debug!(%error, "symbolization failed; frames as module+offset");
                Vec::new()
            });
        let kernel = matches!(source, Source::Kernel(_));
        addresses
            .iter()
            .enumerate()
            .map(|(index, &address)| match symbols.get(index) {
                Some(Symbolized::Sym(symbol)) => Symbol {
                    name: symbol.name.to_string(),
                    module: if kernel {
                        "[kernel]".to_owned()
                    } else {
                        symbol
                            .module
                            .as_deref()
                            .map(|m| file_name(Path::new(m)))
                            .unwrap_or_default()
                    },
                    offset: Some(symbol.offset as u64),
                },
                _ => unknown(address),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_frames_are_module_and_offset() {
        let mappings = procfs::parse_maps(procfs::tests::MAPS);
        assert_eq!(
            module_offset(&mappings, 0x55d0c0010040).name,
            "server+0x10040"
        );
        assert_eq!(
            module_offset(&mappings, 0x7f1000000010).describe(),
            "libc.so.6+0x28010"
        );
        assert_eq!(
            module_offset(&mappings, 0x7f0000000010).name,
            "0x7f0000000010"
        );
    }

    #[test]
    fn return_addresses_are_looked_up_one_byte_back() {
        let lookups: Vec<u64> = lookup_addresses(&[0x100, 0x200, 0x300]).collect();
        assert_eq!(lookups, vec![0x100, 0x1ff, 0x2ff]);
    }

    #[test]
    fn own_functions_are_named() {
        // This test's own code, in this process: ELF symbols of the test binary.
        let address = own_functions_are_named as *const () as usize as u64;
        let symbols = Symbols::new(Path::new("/proc")).user(std::process::id(), &[address]);
        assert_eq!(symbols.len(), 1);
        assert!(
            symbols[0].name.contains("own_functions_are_named"),
            "{symbols:?}"
        );
        assert_eq!(symbols[0].offset, Some(0));
    }
}
