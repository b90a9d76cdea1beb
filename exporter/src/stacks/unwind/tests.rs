//! Unit tests of `unwind.rs`.
use std::path::PathBuf;

use poolscope_shared::STACK_COPY_BYTES;

use super::*;
use crate::discovery::procfs;

fn copy(ip: u64, len: u32) -> Box<StackCopy> {
    Box::new(StackCopy {
        map: 0,
        stack: 0,
        tgid: std::process::id(),
        len,
        variant: 0,
        _pad: 0,
        ip,
        sp: 0,
        bp: 0,
        bytes: [0; STACK_COPY_BYTES],
    })
}

fn own_mappings() -> Vec<Mapping> {
    procfs::maps(Path::new("/proc"), std::process::id())
}

fn by_path(mapping: &Mapping) -> PathBuf {
    mapping.path.clone()
}

#[test]
fn each_reason_to_keep_the_walk_is_counted() {
    let mappings = own_mappings();
    assert!(!mappings.is_empty(), "no mappings of our own process");
    let inside = mappings[0].start;
    let mut unwinder = Unwinder::new(64 << 20);
    // The kernel could not read the stack.
    assert_eq!(
        unwinder.unwind(&[&copy(inside, 0)], &mappings, &by_path)[0],
        None
    );
    // The process exited: no mappings.
    assert_eq!(unwinder.unwind(&[&copy(inside, 8)], &[], &by_path)[0], None);
    // An instruction in no module (JIT code): no tables for the innermost frame.
    assert_eq!(
        unwinder.unwind(&[&copy(8, 8)], &mappings, &by_path)[0],
        None
    );
    let held = unwinder.stats().table_bytes;
    assert!(held > 0, "our own tables were not read");
    // The same files again: read once.
    unwinder.unwind(&[&copy(8, 8)], &mappings, &by_path);
    assert_eq!(unwinder.stats().table_bytes, held);
    // No room for the tables.
    let mut tight = Unwinder::new(0);
    assert_eq!(
        tight.unwind(&[&copy(inside, 8)], &mappings, &by_path)[0],
        None
    );
    assert_eq!(tight.stats().table_bytes, 0);
    let count = |unwinder: &Unwinder, result| unwinder.stats().results.get(&result).copied();
    assert_eq!(count(&unwinder, UnwindResult::StackUnreadable), Some(1));
    assert_eq!(count(&unwinder, UnwindResult::ProcessGone), Some(1));
    assert_eq!(count(&unwinder, UnwindResult::NoUnwindTables), Some(2));
    assert_eq!(count(&tight, UnwindResult::OverMemoryLimit), Some(1));
}

/// The file mapped into this process with the smallest unwind tables that take
/// memory (the test binary's are far larger), and their size. Other tests of
/// this process map files for a while: a symbolization test's separate debug
/// file has tables of no bytes, which would fill no limit.
fn smallest_module() -> (PathBuf, u64) {
    own_mappings()
        .iter()
        .filter_map(|m| {
            let tables = Tables::read(&m.path).filter(Tables::has_tables)?;
            Some((tables.bytes(), m.path.clone())).filter(|(bytes, _)| *bytes > 0)
        })
        .min()
        .map(|(bytes, path)| (path, bytes))
        .expect("no module of our own process has unwind tables")
}

/// `count` copies of the file at `path` in `dir` (distinct files, the same
/// tables), each mapped at an address range of its own.
fn copies(path: &Path, dir: &Path, count: u64) -> Vec<Mapping> {
    (0..count)
        .map(|index| {
            let copy = dir.join(format!("module-{index}"));
            std::fs::copy(path, &copy).expect("copying a module");
            let start = (index + 1) << 32;
            Mapping {
                start,
                end: start + (1 << 20),
                offset: 0,
                path: copy,
            }
        })
        .collect()
}

/// What unwinding a copy whose innermost frame is in `mapping` found, alone.
fn unwind_in(unwinder: &mut Unwinder, mapping: &Mapping) -> UnwindResult {
    let before = unwinder.stats().results;
    unwinder.unwind(
        &[&copy(mapping.start, 8)],
        std::slice::from_ref(mapping),
        &by_path,
    );
    let after = unwinder.stats().results;
    UnwindResult::ALL
        .into_iter()
        .find(|result| after.get(result) != before.get(result))
        .expect("the copy was not counted")
}

/// The cache's reference to the tables of the file of `mapping`, to see whether
/// an eviction freed them.
fn held(unwinder: &Unwinder, mapping: &Mapping) -> std::sync::Weak<Tables> {
    let metadata = std::fs::metadata(&mapping.path).expect("a copied module");
    match unwinder.tables.get(&(metadata.dev(), metadata.ino())) {
        Some(Held::Tables {
            tables: Some(tables),
            ..
        }) => Arc::downgrade(tables),
        _ => panic!("{} has no tables held", mapping.path.display()),
    }
}

#[test]
fn least_recently_used_tables_make_room_for_new_modules() {
    let (path, bytes) = smallest_module();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let modules = copies(&path, dir.path(), 4);
    // Room for two modules' tables, not three.
    let mut unwinder = Unwinder::new(2 * bytes + bytes / 2);
    let unwound = UnwindResult::Unwound;
    assert_eq!(unwind_in(&mut unwinder, &modules[0]), unwound);
    assert_eq!(unwind_in(&mut unwinder, &modules[1]), unwound);
    // Module 0 used again: module 1 is now the least recently used.
    assert_eq!(unwind_in(&mut unwinder, &modules[0]), unwound);
    assert_eq!(unwinder.stats().table_bytes, 2 * bytes);
    let module_1 = held(&unwinder, &modules[1]);
    // The limit is full: module 2, loaded after, is unwound; module 1 makes room,
    // and its memory is freed (the cache held the only reference).
    assert_eq!(unwind_in(&mut unwinder, &modules[2]), unwound);
    assert_eq!(unwinder.stats().evicted, 1);
    assert_eq!(unwinder.stats().table_bytes, 2 * bytes);
    assert!(module_1.upgrade().is_none(), "evicted tables still held");
    // Module 0 was kept: no read, no eviction.
    assert_eq!(unwind_in(&mut unwinder, &modules[0]), unwound);
    assert_eq!(unwinder.stats().evicted, 1);
    // Module 1 is simply read again, evicting module 2 (used before module 0).
    let module_0 = held(&unwinder, &modules[0]);
    assert_eq!(unwind_in(&mut unwinder, &modules[1]), unwound);
    assert_eq!(unwinder.stats().evicted, 2);
    assert!(
        module_0.upgrade().is_some(),
        "the more recent tables were evicted"
    );
    // Then module 3 evicts module 0.
    assert_eq!(unwind_in(&mut unwinder, &modules[3]), unwound);
    assert_eq!(unwinder.stats().evicted, 3);
    assert!(
        module_0.upgrade().is_none(),
        "module 0 was not the one evicted"
    );
    assert_eq!(unwinder.stats().table_bytes, 2 * bytes);
    assert_eq!(unwinder.stats().results.get(&unwound), Some(&7));
    assert_eq!(
        unwinder.stats().results.get(&UnwindResult::OverMemoryLimit),
        None
    );
    // A lowered limit evicts down to it at once.
    unwinder.set_memory_limit(bytes);
    assert_eq!(unwinder.stats().evicted, 4);
    assert_eq!(unwinder.stats().table_bytes, bytes);
}

#[test]
fn a_module_larger_than_the_limit_alone_keeps_the_walk_and_evicts_nothing() {
    let (path, bytes) = smallest_module();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let modules = copies(&path, dir.path(), 2);
    let limit = 2 * bytes + bytes / 2;
    let exe = std::env::current_exe().expect("the test binary");
    let exe_bytes = Tables::read(&exe).map_or(0, |tables| tables.bytes());
    assert!(
        exe_bytes > limit,
        "the test binary's tables ({exe_bytes} bytes) fit {limit}"
    );
    let mut unwinder = Unwinder::new(limit);
    assert_eq!(unwind_in(&mut unwinder, &modules[0]), UnwindResult::Unwound);
    assert_eq!(unwind_in(&mut unwinder, &modules[1]), UnwindResult::Unwound);
    let large = Mapping {
        start: 1 << 40,
        end: (1 << 40) + (1 << 20),
        offset: 0,
        path: exe,
    };
    assert_eq!(
        unwind_in(&mut unwinder, &large),
        UnwindResult::OverMemoryLimit
    );
    assert_eq!(unwinder.stats().evicted, 0);
    assert_eq!(unwinder.stats().table_bytes, 2 * bytes);
    // Remembered as too large: not read again.
    assert_eq!(
        unwind_in(&mut unwinder, &large),
        UnwindResult::OverMemoryLimit
    );
    // Once the limit has room, it is read (evicting both small modules).
    unwinder.set_memory_limit(exe_bytes);
    assert_eq!(unwind_in(&mut unwinder, &large), UnwindResult::Unwound);
    assert_eq!(unwinder.stats().table_bytes, exe_bytes);
    assert_eq!(unwinder.stats().evicted, 2);
}

#[test]
fn the_tables_one_unwind_needs_are_not_evicted_for_each_other() {
    let (path, bytes) = smallest_module();
    let dir = tempfile::tempdir().expect("a temporary directory");
    // One process maps three modules; the limit holds two.
    let modules = copies(&path, dir.path(), 3);
    let mut unwinder = Unwinder::new(2 * bytes + bytes / 2);
    let unwind = |unwinder: &mut Unwinder, ip: u64| {
        unwinder.unwind(&[&copy(ip, 8)], &modules, &by_path);
    };
    unwind(&mut unwinder, modules[0].start);
    unwind(&mut unwinder, modules[2].start);
    let stats = unwinder.stats();
    assert_eq!(stats.results.get(&UnwindResult::Unwound), Some(&1));
    assert_eq!(stats.results.get(&UnwindResult::OverMemoryLimit), Some(&1));
    assert_eq!(stats.evicted, 0);
    assert_eq!(stats.table_bytes, 2 * bytes);
}
