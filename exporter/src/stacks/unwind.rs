//! Caller-true user stacks. The kernel walks user stacks by frame pointers; through
//! code built without them (Debian's glibc, most interpreters) that walk skips the
//! frames between the blocking call and the first function that keeps a frame
//! pointer, and so the function that called into the library. For each user stack
//! id new to its map, the kernel also copies the thread's registers and the top of
//! its stack ([`StackCopy`]); here that copy is unwound by the modules' unwind
//! tables (`.eh_frame`, `.debug_frame`) with framehop, and the frames it finds are
//! spliced in front of the walk's. Tables are read once per file, section by
//! section, and cached within a memory limit: the least recently used are evicted to
//! make room for a module's, so a node whose binaries change (deploys, restarts)
//! still unwinds its new ones. Splicing is a pure function.
use std::{
    cell::RefCell,
    collections::{BTreeMap, HashMap},
    ops::Range,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::Arc,
    time::Instant,
};

use framehop::{
    ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder as _,
    x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64},
};
use object::{Object as _, ObjectSection as _, ObjectSegment as _, ReadCache};
use poolscope_shared::StackCopy;

use crate::discovery::procfs::Mapping;

/// Where poolscope opens the file of `mapping` of process `pid`: through
/// `/proc/<pid>/map_files/` (the very file mapped, even if deleted or in another
/// mount namespace) where it may, else by its path under `/proc/<pid>/root/`.
pub fn mapped_file(procfs_root: &Path, pid: u32, mapping: &Mapping) -> PathBuf {
    let process = procfs_root.join(pid.to_string());
    let mapped = process
        .join("map_files")
        .join(format!("{:x}-{:x}", mapping.start, mapping.end));
    if std::fs::metadata(&mapped).is_ok() {
        return mapped;
    }
    let relative = mapping.path.strip_prefix("/").unwrap_or(&mapping.path);
    process.join("root").join(relative)
}

/// Frames kept from one unwind (the kernel's walk keeps 127).
const MAX_FRAMES: usize = 127;

/// What became of one stack copy: the `result` label of `stack_unwinds_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum UnwindResult {
    /// Unwound by the modules' tables (the frames are joined with the walk's).
    Unwound,
    /// The innermost frame's module has no unwind tables (or no module maps it):
    /// the walk stays.
    NoUnwindTables,
    /// The kernel could not read the thread's stack.
    StackUnreadable,
    /// The process was gone before its copy was read.
    ProcessGone,
    /// The module's tables alone pass `stacks.unwind_memory_bytes` (or, with the
    /// tables the same unwind needs, leave no room): the walk stays.
    OverMemoryLimit,
}

impl UnwindResult {
    pub const ALL: [UnwindResult; 5] = [
        Self::Unwound,
        Self::NoUnwindTables,
        Self::StackUnreadable,
        Self::ProcessGone,
        Self::OverMemoryLimit,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            Self::Unwound => "unwound",
            Self::NoUnwindTables => "no_unwind_tables",
            Self::StackUnreadable => "stack_unreadable",
            Self::ProcessGone => "process_gone",
            Self::OverMemoryLimit => "over_memory_limit",
        }
    }
}

/// The unwind tables of one ELF file, and where its segments lie.
struct Tables {
    /// `.text`'s addresses (framehop analyses prologues there without its bytes).
    text: Option<Range<u64>>,
    eh_frame: Option<(Range<u64>, Arc<[u8]>)>,
    eh_frame_hdr: Option<(Range<u64>, Arc<[u8]>)>,
    debug_frame: Option<Arc<[u8]>>,
    /// (file offset range, virtual address) of each loadable segment.
    segments: Vec<(Range<u64>, u64)>,
}

impl Tables {
    fn bytes(&self) -> u64 {
        [&self.eh_frame, &self.eh_frame_hdr]
            .iter()
            .filter_map(|section| section.as_ref().map(|(_, data)| data.len() as u64))
            .chain(self.debug_frame.as_ref().map(|data| data.len() as u64))
            .sum()
    }

    fn has_tables(&self) -> bool {
        self.eh_frame.is_some() || self.debug_frame.is_some()
    }

    /// The virtual address (in the file's terms) of file offset `offset`.
    fn address_of_offset(&self, offset: u64) -> Option<u64> {
        self.segments
            .iter()
            .find(|(range, _)| range.contains(&offset))
            .map(|(range, address)| address + (offset - range.start))
    }

    /// Reads the tables of the ELF file at `path`, section by section.
    fn read(path: &Path) -> Option<Tables> {
        let file = std::fs::File::open(path).ok()?;
        let cache = ReadCache::new(file);
        let elf = object::File::parse(&cache).ok()?;
        let section = |name: &str| {
            let section = elf.section_by_name(name)?;
            let range = section.address()..section.address() + section.size();
            // A compressed section (SHF_COMPRESSED) is left out: no decompressor here.
            let data: Arc<[u8]> = Arc::from(section.uncompressed_data().ok()?);
            Some((range, data))
        };
        Some(Tables {
            text: elf
                .section_by_name(".text")
                .map(|text| text.address()..text.address() + text.size()),
            eh_frame: section(".eh_frame"),
            eh_frame_hdr: section(".eh_frame_hdr"),
            debug_frame: section(".debug_frame").map(|(_, data)| data),
            segments: elf
                .segments()
                .map(|segment| {
                    let (offset, size) = segment.file_range();
                    (offset..offset + size, segment.address())
                })
                .collect(),
        })
    }
}

/// What the unwinder did so far, for the metrics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct UnwindStats {
    /// Copies by result.
    pub results: BTreeMap<UnwindResult, u64>,
    /// Time spent on them, reading the tables included.
    pub seconds: f64,
    /// Bytes of tables held.
    pub table_bytes: u64,
    /// Files' tables evicted to make room for others (or for a lowered limit).
    pub evicted: u64,
}

/// What is known of one file's tables.
enum Held {
    /// Read (`None` if the file has no usable tables), and last needed by the unwind
    /// numbered `used`: the least recently used are evicted first.
    Tables {
        tables: Option<Arc<Tables>>,
        used: u64,
    },
    /// This many bytes, more than the whole memory limit when they were read.
    TooLarge(u64),
}

/// Unwinds stack copies; caches the files' tables it read within the limit,
/// evicting the least recently used.
pub struct Unwinder {
    /// By the file's (device, inode): one path may name different files in two
    /// containers.
    tables: HashMap<(u64, u64), Held>,
    bytes: u64,
    memory_limit: u64,
    /// Calls of [`Unwinder::unwind`] so far: the number of the current one stamps
    /// the tables it needs, which are not evicted while it runs.
    unwinds: u64,
    evicted: u64,
    cache: CacheX86_64,
    results: BTreeMap<UnwindResult, u64>,
    seconds: f64,
}

impl Unwinder {
    pub fn new(memory_limit: u64) -> Self {
        Self {
            tables: HashMap::new(),
            bytes: 0,
            memory_limit,
            unwinds: 0,
            evicted: 0,
            cache: CacheX86_64::new(),
            results: BTreeMap::new(),
            seconds: 0.0,
        }
    }

    /// A lowered limit evicts the least recently used tables down to it at once (no
    /// unwind is running: none is kept for one).
    pub fn set_memory_limit(&mut self, memory_limit: u64) {
        self.memory_limit = memory_limit;
        self.make_room(0, u64::MAX);
    }

    pub fn stats(&self) -> UnwindStats {
        UnwindStats {
            results: self.results.clone(),
            seconds: self.seconds,
            table_bytes: self.bytes,
            evicted: self.evicted,
        }
    }

    /// The tables of the file at `path` for the current unwind; read on first use
    /// (and again after an eviction), evicting the least recently used others to
    /// make room. `Err` if they alone pass the memory limit (read again only once a
    /// raised limit has room), or if the tables this unwind already holds leave none.
    fn tables(&mut self, path: &Path) -> Result<Option<Arc<Tables>>, UnwindResult> {
        let Ok(metadata) = std::fs::metadata(path) else {
            return Ok(None);
        };
        let file = (metadata.dev(), metadata.ino());
        match self.tables.get_mut(&file) {
            Some(Held::Tables { tables, used }) => {
                *used = self.unwinds;
                return Ok(tables.clone());
            }
            Some(Held::TooLarge(bytes)) if *bytes > self.memory_limit => {
                return Err(UnwindResult::OverMemoryLimit);
            }
            _ => {}
        }
        let tables = Tables::read(path).filter(Tables::has_tables);
        let bytes = tables.as_ref().map_or(0, Tables::bytes);
        if bytes > self.memory_limit {
            self.tables.insert(file, Held::TooLarge(bytes));
            return Err(UnwindResult::OverMemoryLimit);
        }
        if !self.make_room(bytes, self.unwinds) {
            // Not remembered as too large: once this unwind's tables are no longer
            // needed, they may make room.
            self.tables.remove(&file);
            return Err(UnwindResult::OverMemoryLimit);
        }
        self.bytes += bytes;
        let tables = tables.map(Arc::new);
        let used = self.unwinds;
        self.tables.insert(
            file,
            Held::Tables {
                tables: tables.clone(),
                used,
            },
        );
        Ok(tables)
    }

    /// Evicts the least recently used tables, none last used by unwind `keep_from`
    /// or later, until `bytes` more fit within the limit; false if they cannot.
    /// Only the [`Process`] of the running unwind shares the held tables besides
    /// this cache, and it holds none of those evicted: their memory is freed here.
    fn make_room(&mut self, bytes: u64, keep_from: u64) -> bool {
        while self.bytes.saturating_add(bytes) > self.memory_limit {
            let oldest = self
                .tables
                .iter()
                .filter_map(|(file, held)| match held {
                    Held::Tables {
                        tables: Some(tables),
                        used,
                    } if *used < keep_from => Some((*used, *file, tables.bytes())),
                    _ => None,
                })
                .min();
            let Some((_, file, freed)) = oldest else {
                return false;
            };
            self.tables.remove(&file);
            self.bytes -= freed;
            self.evicted += 1;
        }
        true
    }

    /// The frames (innermost first) that the modules' tables find in each of
    /// `copies`, stacks of one process with `mappings` whose files are opened at
    /// `open(mapping)`, to splice with the kernel's walk; `None` (counted) where
    /// they cannot. The process's modules are set up once for all its copies.
    pub fn unwind(
        &mut self,
        copies: &[&StackCopy],
        mappings: &[Mapping],
        open: &dyn Fn(&Mapping) -> PathBuf,
    ) -> Vec<Option<Unwound>> {
        let started = Instant::now();
        self.unwinds += 1;
        let process = (!mappings.is_empty()).then(|| self.process(mappings, open));
        let unwound: Vec<Option<Unwound>> = copies
            .iter()
            .map(|copy| {
                let unwound = self.unwound(copy, process.as_ref());
                let result = unwound
                    .as_ref()
                    .err()
                    .copied()
                    .unwrap_or(UnwindResult::Unwound);
                *self.results.entry(result).or_default() += 1;
                unwound.ok()
            })
            .collect();
        self.seconds += started.elapsed().as_secs_f64();
        unwound
    }

    /// The modules of a process with `mappings`: those whose tables are held, and
    /// where the others are mapped.
    fn process(&mut self, mappings: &[Mapping], open: &dyn Fn(&Mapping) -> PathBuf) -> Process {
        let mut process = Process {
            unwinder: UnwinderX86_64::new(),
            mapped: Vec::new(),
        };
        for (path, module_mappings) in by_file(mappings) {
            let Some(first) = module_mappings.first() else {
                continue;
            };
            // A module beyond the memory limit is left out; the others still unwind.
            let held = match self.tables(&open(first)) {
                Ok(Some(tables)) => match module(path, &module_mappings, &tables) {
                    Some(module) => {
                        process.unwinder.add_module(module);
                        Ok(())
                    }
                    None => Err(UnwindResult::NoUnwindTables),
                },
                Ok(None) => Err(UnwindResult::NoUnwindTables),
                Err(over) => Err(over),
            };
            let ranges = module_mappings.iter().map(|m| (m.start..m.end, held));
            process.mapped.extend(ranges);
        }
        process
    }

    fn unwound(
        &mut self,
        copy: &StackCopy,
        process: Option<&Process>,
    ) -> Result<Unwound, UnwindResult> {
        if copy.len == 0 {
            return Err(UnwindResult::StackUnreadable);
        }
        let process = process.ok_or(UnwindResult::ProcessGone)?;
        // The innermost frame's module has tables, or why not.
        process
            .mapped
            .iter()
            .find(|(range, _)| range.contains(&copy.ip))
            .map_or(Err(UnwindResult::NoUnwindTables), |(_, held)| *held)?;
        let len = (copy.len as usize).min(copy.bytes.len());
        let stack = &copy.bytes[..len];
        // Every word read, by its offset in the copy: where each return address was.
        let reads = RefCell::new(Vec::new());
        let mut read_stack = |address: u64| -> Result<u64, ()> {
            let offset =
                usize::try_from(address.checked_sub(copy.sp).ok_or(())?).map_err(|_| ())?;
            let word = stack.get(offset..offset + 8).ok_or(())?;
            let word = u64::from_le_bytes(word.try_into().map_err(|_| ())?);
            reads.borrow_mut().push((offset, word));
            Ok(word)
        };
        let regs = UnwindRegsX86_64::new(copy.ip, copy.sp, copy.bp);
        let mut unwound = Unwound::default();
        let mut iter =
            process
                .unwinder
                .iter_frames(copy.ip, regs, &mut self.cache, &mut read_stack);
        while unwound.frames.len() < MAX_FRAMES {
            let (address, slot) = match iter.next() {
                Ok(Some(FrameAddress::InstructionPointer(address))) => (address, None),
                Ok(Some(FrameAddress::ReturnAddress(address))) => {
                    let address = address.get();
                    // The last word read that holds it, in 8-byte words above `sp`.
                    let slot = reads
                        .borrow()
                        .iter()
                        .rev()
                        .find(|(offset, word)| *word == address && offset % 8 == 0)
                        .and_then(|(offset, _)| u16::try_from(offset / 8).ok());
                    (address, slot)
                }
                // The end of the stack, or of the copy.
                Ok(None) | Err(_) => break,
            };
            unwound.frames.push(address);
            unwound.slots.push(slot);
        }
        Ok(unwound)
    }
}

/// The frames (innermost first) the modules' tables found in one copy, and where on
/// the copied stack each return address was (8-byte words above `sp`; `None` for
/// the innermost instruction, or a word the unwinder did not read whole).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Unwound {
    pub frames: Vec<u64>,
    pub slots: Vec<Option<u16>>,
}

/// One process's modules for unwinding its copies.
struct Process {
    unwinder: UnwinderX86_64<Arc<[u8]>>,
    /// Each file mapping, and whether its module's tables are held (why not).
    mapped: Vec<(Range<u64>, Result<(), UnwindResult>)>,
}

/// The mappings of `mappings` grouped by file, in address order.
fn by_file(mappings: &[Mapping]) -> BTreeMap<&Path, Vec<&Mapping>> {
    let mut files: BTreeMap<&Path, Vec<&Mapping>> = BTreeMap::new();
    for mapping in mappings {
        files
            .entry(mapping.path.as_path())
            .or_default()
            .push(mapping);
    }
    files
}

/// The framehop module of a file mapped at `mappings` (those of one file).
fn module(path: &Path, mappings: &[&Mapping], tables: &Tables) -> Option<Module<Arc<[u8]>>> {
    let start = mappings.iter().map(|m| m.start).min()?;
    let end = mappings.iter().map(|m| m.end).max()?;
    // Where the file's address 0 is in the process: a mapping's start less the
    // address its file offset has in the file.
    let base_avma = mappings.iter().find_map(|mapping| {
        Some(
            mapping
                .start
                .wrapping_sub(tables.address_of_offset(mapping.offset)?),
        )
    })?;
    let info = ExplicitModuleSectionInfo {
        base_svma: 0,
        text_svma: tables.text.clone(),
        eh_frame_svma: tables.eh_frame.as_ref().map(|(range, _)| range.clone()),
        eh_frame: tables.eh_frame.as_ref().map(|(_, data)| data.clone()),
        eh_frame_hdr_svma: tables.eh_frame_hdr.as_ref().map(|(range, _)| range.clone()),
        eh_frame_hdr: tables.eh_frame_hdr.as_ref().map(|(_, data)| data.clone()),
        debug_frame: tables.debug_frame.clone(),
        ..ExplicitModuleSectionInfo::default()
    };
    Some(Module::new(
        path.to_string_lossy().into_owned(),
        start..end,
        base_avma,
        info,
    ))
}

#[cfg(test)]
mod tests;
