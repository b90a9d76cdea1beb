//! Addresses to names, with blazesym: ELF symbols and DWARF where present, the perf
//! maps of JIT runtimes (`/tmp/perf-<pid>.map`) for user stacks, and kallsyms (or a
//! vmlinux found on the host) for kernel stacks. An address no symbol covers is
//! named after its module and offset; none is dropped. Lookups are batched per
//! process; the blazesym cache lives as long as the [`Symbols`] that owns it.
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use blazesym::symbolize::{
    Input, Symbolized, Symbolizer,
    source::{Elf, Kernel, Process, Source},
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
    /// A process that has exited is symbolized from `remembered`, its mappings as
    /// last read: each module's ELF file by file offset (its perf map is lost).
    pub fn user(&self, pid: u32, addresses: &[u64], remembered: &[Mapping]) -> Vec<Symbol> {
        let mappings = procfs::maps(&self.procfs_root, pid);
        if mappings.is_empty() && !remembered.is_empty() {
            return self.through_files(addresses, remembered);
        }
        let source = Source::Process(Process::new(blazesym::Pid::from(pid)));
        self.resolve(&source, addresses, |address| {
            module_offset(&mappings, address)
        })
    }

    /// Symbols of addresses of a process gone, through the files it had mapped.
    fn through_files(&self, addresses: &[u64], mappings: &[Mapping]) -> Vec<Symbol> {
        let mut symbols: Vec<Symbol> = addresses
            .iter()
            .map(|&address| module_offset(mappings, address))
            .collect();
        let mut by_file: BTreeMap<&Path, Vec<(usize, u64)>> = BTreeMap::new();
        for (index, &address) in addresses.iter().enumerate() {
            if let Some(mapping) = mappings
                .iter()
                .find(|m| (m.start..m.end).contains(&address) && m.path.is_absolute())
            {
                let offset = address - mapping.start + mapping.offset;
                by_file
                    .entry(&mapping.path)
                    .or_default()
                    .push((index, offset));
            }
        }
        for (path, entries) in by_file {
            let offsets: Vec<u64> = entries.iter().map(|(_, offset)| *offset).collect();
            let source = Source::Elf(Elf::new(path));
            let Ok(found) = self
                .symbolizer
                .symbolize(&source, Input::FileOffset(&offsets))
            else {
                continue;
            };
            for ((index, _), found) in entries.iter().zip(found) {
                if let (Symbolized::Sym(symbol), Some(slot)) = (found, symbols.get_mut(*index)) {
                    *slot = Symbol {
                        name: symbol.name.to_string(),
                        module: file_name(path),
                        offset: Some(symbol.offset as u64),
                    };
                }
            }
        }
        symbols
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
        let symbols = Symbols::new(Path::new("/proc"));
        let found = symbols.user(std::process::id(), &[address], &[]);
        assert_eq!(found.len(), 1);
        assert!(
            found[0].name.contains("own_functions_are_named"),
            "{found:?}"
        );
        assert_eq!(found[0].offset, Some(0));
        // A process gone (a pid with no maps): the same, from its remembered mappings.
        let mappings = procfs::maps(Path::new("/proc"), std::process::id());
        let gone = symbols.user(u32::MAX, &[address], &mappings);
        assert_eq!(gone, found);
    }
}
