//! Addresses to names, with blazesym: ELF symbols and DWARF where present, the perf
//! maps of JIT runtimes (`/tmp/perf-<pid>.map`) for user stacks, and kallsyms (or a
//! vmlinux found on the host) for kernel stacks. An address no symbol covers is
//! named after its module and offset; none is dropped, and each is counted
//! ([`Unnamed`]). Lookups are batched per process; the blazesym cache lives as long
//! as the [`Symbols`] that owns it.
use std::{
    cell::Cell,
    collections::BTreeMap,
    ops::AddAssign,
    path::{Path, PathBuf},
};

use blazesym::symbolize::{
    Input, Symbolized, Symbolizer,
    source::{Elf, Kernel, Process, Source},
};

use crate::discovery::procfs::{self, Mapping};
use poolscope_shared::LOST_FRAME_ADDRESS;

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

/// The mapping of a file (an absolute path) that holds `address`, if any.
fn file_mapping(mappings: &[Mapping], address: u64) -> Option<&Mapping> {
    mappings
        .iter()
        .find(|m| (m.start..m.end).contains(&address) && m.path.is_absolute())
}

/// Frame standing for the innermost frame of a stack kept without it (its whole
/// stack's bucket in the kernel's stack map held another stack).
pub const LOST_INNERMOST_FRAME: &str = "[frame lost]";

/// The symbols of `addresses` in order: [`LOST_FRAME_ADDRESS`] named
/// [`LOST_INNERMOST_FRAME`], the others by `symbolize` (which never sees it, so
/// neither looks it up nor counts it unnamed).
fn with_lost_frames(
    addresses: &[u64],
    symbolize: impl FnOnce(&[u64]) -> Vec<Symbol>,
) -> Vec<Symbol> {
    if !addresses.contains(&LOST_FRAME_ADDRESS) {
        return symbolize(addresses);
    }
    let real: Vec<u64> = addresses
        .iter()
        .copied()
        .filter(|&address| address != LOST_FRAME_ADDRESS)
        .collect();
    let mut named = symbolize(&real).into_iter();
    addresses
        .iter()
        .map(|&address| {
            let bare = |name: String| Symbol {
                name,
                module: String::new(),
                offset: None,
            };
            if address == LOST_FRAME_ADDRESS {
                bare(LOST_INNERMOST_FRAME.to_owned())
            } else {
                named
                    .next()
                    .unwrap_or_else(|| bare(format!("{address:#x}")))
            }
        })
        .collect()
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

/// Addresses left without a function name (`module+0xoffset` or a bare address),
/// by space: stripped code, JIT code without a perf map, a process gone before its
/// maps were read; kernel symbols hidden (no `CAP_SYSLOG`, `kptr_restrict`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Unnamed {
    pub user: u64,
    pub kernel: u64,
}

impl AddAssign for Unnamed {
    fn add_assign(&mut self, other: Self) {
        self.user += other.user;
        self.kernel += other.kernel;
    }
}

/// A symbolizer with its cache, and what it could not name.
pub struct Symbols {
    symbolizer: Symbolizer,
    procfs_root: PathBuf,
    unnamed: Cell<Unnamed>,
}

impl Symbols {
    pub fn new(procfs_root: &Path) -> Self {
        Self {
            symbolizer: Symbolizer::new(),
            procfs_root: procfs_root.to_owned(),
            unnamed: Cell::new(Unnamed::default()),
        }
    }

    /// The addresses this symbolizer left unnamed so far, each time it was asked.
    pub fn unnamed(&self) -> Unnamed {
        self.unnamed.get()
    }

    /// Counts the symbols of `symbols` that have no function.
    fn counted(&self, symbols: Vec<Symbol>, kernel: bool) -> Vec<Symbol> {
        let unnamed = symbols.iter().filter(|s| s.offset.is_none()).count() as u64;
        let mut total = self.unnamed.get();
        if kernel {
            total.kernel += unnamed;
        } else {
            total.user += unnamed;
        }
        self.unnamed.set(total);
        symbols
    }

    /// Symbols of `addresses` (already lookup addresses) in process `pid`, in order.
    /// A process that has exited is symbolized from its mappings as last read (here,
    /// if it exits while being symbolized, or else `remembered`): each module's ELF
    /// file by file offset (its perf map is lost).
    ///
    /// A live process's files are opened through `/proc/<pid>/map_files/` (the very
    /// file it mapped, even if deleted) where poolscope may search that directory:
    /// root, or the process's own user. Otherwise they are opened by the paths its
    /// maps name, under `/proc/<pid>/root/`: in its own mount namespace (a
    /// container's files, or the host's /tmp that a sandboxed poolscope does not
    /// see), and its JIT code by its perf map.
    pub fn user(&self, pid: u32, addresses: &[u64], remembered: &[Mapping]) -> Vec<Symbol> {
        with_lost_frames(addresses, |addresses| {
            self.user_symbols(pid, addresses, remembered)
        })
    }

    /// [`Self::user`] of addresses that are all real.
    fn user_symbols(&self, pid: u32, addresses: &[u64], remembered: &[Mapping]) -> Vec<Symbol> {
        let mappings = procfs::maps(&self.procfs_root, pid);
        let process_dir = self.procfs_root.join(pid.to_string());
        let root = process_dir.join("root");
        let symbols = if mappings.is_empty() {
            self.through_files(addresses, remembered, None)
        } else if std::fs::read_dir(process_dir.join("map_files")).is_ok() {
            self.live(pid, addresses, &mappings)
        } else if root.exists() {
            self.under_root(pid, addresses, &mappings, &root)
        } else {
            self.through_files(addresses, &mappings, None)
        };
        self.counted(symbols, false)
    }

    /// [`Self::user`] of a live process through `/proc/<pid>/map_files/`; through its
    /// files if it exits meanwhile.
    fn live(&self, pid: u32, addresses: &[u64], mappings: &[Mapping]) -> Vec<Symbol> {
        let process = Process::new(blazesym::Pid::from(pid));
        self.resolve(&Source::Process(process), addresses, |address| {
            module_offset(mappings, address)
        })
        .unwrap_or_else(|| self.through_files(addresses, mappings, None))
    }

    /// [`Self::user`] of a live process by the paths in its maps under `root`, its
    /// `/proc/<pid>/root`; addresses in no file (JIT code) by its perf map, which
    /// blazesym reads under that root too.
    fn under_root(
        &self,
        pid: u32,
        addresses: &[u64],
        mappings: &[Mapping],
        root: &Path,
    ) -> Vec<Symbol> {
        let mut symbols = self.through_files(addresses, mappings, Some(root));
        let (indexes, anonymous): (Vec<usize>, Vec<u64>) = addresses
            .iter()
            .enumerate()
            .filter(|(_, address)| file_mapping(mappings, **address).is_none())
            .map(|(index, &address)| (index, address))
            .unzip();
        if anonymous.is_empty() {
            return symbols;
        }
        let process = Process {
            map_files: false,
            ..Process::new(blazesym::Pid::from(pid))
        };
        let found = self.resolve(&Source::Process(process), &anonymous, |address| {
            module_offset(mappings, address)
        });
        for (index, symbol) in indexes.into_iter().zip(found.into_iter().flatten()) {
            if let Some(slot) = symbols.get_mut(index) {
                *slot = symbol;
            }
        }
        symbols
    }

    /// Symbols of addresses of a process gone, or of one whose files are opened under
    /// `root`, through the files it had mapped.
    fn through_files(
        &self,
        addresses: &[u64],
        mappings: &[Mapping],
        root: Option<&Path>,
    ) -> Vec<Symbol> {
        let mut symbols: Vec<Symbol> = addresses
            .iter()
            .map(|&address| module_offset(mappings, address))
            .collect();
        let mut by_file: BTreeMap<PathBuf, Vec<(usize, u64)>> = BTreeMap::new();
        for (index, &address) in addresses.iter().enumerate() {
            if let Some(mapping) = file_mapping(mappings, address) {
                let offset = address - mapping.start + mapping.offset;
                let path = match (root, mapping.path.strip_prefix("/")) {
                    (Some(root), Ok(relative)) => root.join(relative),
                    _ => mapping.path.clone(),
                };
                by_file.entry(path).or_default().push((index, offset));
            }
        }
        for (path, entries) in by_file {
            let offsets: Vec<u64> = entries.iter().map(|(_, offset)| *offset).collect();
            let source = Source::Elf(Elf::new(&path));
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
                        module: file_name(&path),
                        offset: Some(symbol.offset as u64),
                    };
                }
            }
        }
        symbols
    }

    /// Symbols of kernel `addresses`, in order.
    pub fn kernel(&self, addresses: &[u64]) -> Vec<Symbol> {
        with_lost_frames(addresses, |addresses| self.kernel_symbols(addresses))
    }

    /// [`Self::kernel`] of addresses that are all real.
    fn kernel_symbols(&self, addresses: &[u64]) -> Vec<Symbol> {
        let unknown = |address: u64| Symbol {
            name: format!("{address:#x}"),
            module: "[kernel]".to_owned(),
            offset: None,
        };
        let source = Source::Kernel(Kernel::default());
        let symbols = self
            .resolve(&source, addresses, unknown)
            .unwrap_or_else(|| addresses.iter().map(|&address| unknown(address)).collect());
        self.counted(symbols, true)
    }

    /// Symbols of `addresses` in `source`, `unknown` naming those no symbol covers;
    /// `None` if the source cannot be read (a process that just exited).
    fn resolve(
        &self,
        source: &Source<'_>,
        addresses: &[u64],
        unknown: impl Fn(u64) -> Symbol,
    ) -> Option<Vec<Symbol>> {
        if addresses.is_empty() {
            return Some(Vec::new());
        }
        let symbols = match self.symbolizer.symbolize(source, Input::AbsAddr(addresses)) {
            Ok(symbols) => symbols,
            Err(error) => {
                tracing::debug!(%error, "symbolization failed");
                return None;
            }
        };
        let kernel = matches!(source, Source::Kernel(_));
        let symbols = addresses
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
            .collect();
        Some(symbols)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_frame_is_named_without_a_lookup() {
        let mut looked_up = Vec::new();
        let symbols = with_lost_frames(&[LOST_FRAME_ADDRESS, 0x10, 0x20], |addresses| {
            looked_up.extend_from_slice(addresses);
            addresses
                .iter()
                .map(|address| Symbol {
                    name: format!("f{address:x}"),
                    module: "m".to_owned(),
                    offset: Some(0),
                })
                .collect()
        });
        assert_eq!(looked_up, [0x10, 0x20]);
        let names: Vec<&str> = symbols.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, [LOST_INNERMOST_FRAME, "f10", "f20"]);
        // The marker stays where `lookup_addresses` puts the innermost frame: as is.
        let lookups: Vec<u64> = lookup_addresses(&[LOST_FRAME_ADDRESS, 0x100]).collect();
        assert_eq!(lookups, [LOST_FRAME_ADDRESS, 0xff]);
    }

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
        // A process gone (a pid with no maps): the same, from its remembered mappings,
        // in the program and in a shared library.
        let in_libc = libc::getpid as *const () as usize as u64;
        let live = symbols.user(std::process::id(), &[address, in_libc], &[]);
        assert!(live[1].name.contains("getpid"), "{live:?}");
        let mappings = procfs::maps(Path::new("/proc"), std::process::id());
        let gone = symbols.user(u32::MAX, &[address, in_libc], &mappings);
        assert_eq!(gone, live);
    }

    #[test]
    fn addresses_without_a_function_are_counted_by_space() {
        let symbols = Symbols::new(Path::new("/proc"));
        let named = own_functions_are_named as *const () as usize as u64;
        // Page 0 is mapped neither in a process nor in the kernel.
        let found = symbols.user(std::process::id(), &[named, 0x10, 0x20], &[]);
        assert_eq!(found[1].name, "0x10", "{found:?}");
        assert_eq!(symbols.unnamed(), Unnamed { user: 2, kernel: 0 });
        let kernel = symbols.kernel(&[0x10]);
        assert_eq!(kernel[0].name, "0x10", "{kernel:?}");
        // A process gone, its maps unknown: every address counts.
        symbols.user(u32::MAX, &[named], &[]);
        assert_eq!(symbols.unnamed(), Unnamed { user: 3, kernel: 1 });
    }

    #[test]
    fn a_process_of_another_root_is_named_from_its_files_under_that_root() -> std::io::Result<()> {
        // Its maps name this test binary, which exists for it only under its root
        // directory (a fixture's, as a container's would be), and its map_files/
        // cannot be searched: the file is opened there, never by our own path.
        let address = own_functions_are_named as *const () as usize as u64;
        let exe = std::fs::read_link("/proc/self/exe")?;
        let root = tempfile::tempdir()?;
        let pid = u32::MAX - 2;
        let process = root.path().join(pid.to_string());
        let theirs = process.join("root").join("opt/app/service");
        std::fs::create_dir_all(theirs.parent().expect("a parent"))?;
        std::os::unix::fs::symlink(&exe, &theirs)?;
        let maps = std::fs::read_to_string("/proc/self/maps")?
            .replace(exe.to_str().expect("a UTF-8 path"), "/opt/app/service");
        std::fs::write(process.join("maps"), maps)?;
        let found = Symbols::new(root.path()).user(pid, &[address], &[]);
        assert!(
            found[0].name.contains("own_functions_are_named") && found[0].module == "service",
            "{found:?}"
        );
        Ok(())
    }

    #[test]
    fn a_process_exiting_while_symbolized_is_named_from_its_maps_just_read() -> std::io::Result<()>
    {
        // Its maps are read (here under a fixture root, as this process's), then the
        // process is gone when the symbolizer reads it (no process has this pid).
        let address = own_functions_are_named as *const () as usize as u64;
        let root = tempfile::tempdir()?;
        let pid = u32::MAX - 1;
        std::fs::create_dir(root.path().join(pid.to_string()))?;
        std::fs::copy("/proc/self/maps", root.path().join(format!("{pid}/maps")))?;
        let found = Symbols::new(root.path()).user(pid, &[address], &[]);
        assert_eq!(found.len(), 1);
        assert!(
            found[0].name.contains("own_functions_are_named"),
            "{found:?}"
        );
        Ok(())
    }
}
