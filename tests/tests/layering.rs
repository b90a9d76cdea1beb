//! Keeps the code layered as docs/ARCHITECTURE.md draws it, without root: no circle
//! of imports between the kernel crate's modules (one file each), nor between the
//! exporter's top-level modules (its folders and files under `exporter/src/`). An
//! import is every `crate::` path in code (a `use` or inline), and every `super::`
//! path that climbs out of its module, comments left out. Nothing imports from the
//! crate root but its modules: an item of `lib.rs` or `main.rs` (or one re-exported
//! there) that a module used would be an arrow back up, and hide the module it
//! came from.
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

use anyhow::ensure;
use poolscope_tests::rust_files;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The first path segment of every `crate::` path in `source`: `crate::a::b` and
/// each item of `crate::{a::{x, y}, b}` at the group's first level.
fn crate_imports(source: &str) -> BTreeSet<String> {
    let code = code_of(source);
    let mut found = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        // `poolscope_crate::x` is not this crate.
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        found.extend(heads(rest));
    }
    found
}

/// The first segment of the path at the start of `rest`: of each item of a group
/// (`{a::{x, y}, b}`: a, b) at its first level.
fn heads(rest: &str) -> Vec<String> {
    let Some(group) = rest.strip_prefix('{') else {
        return first_segment(rest).into_iter().collect();
    };
    let mut depth = 1;
    let mut item = String::new();
    let mut items = Vec::new();
    for c in group.chars() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            _ => {}
        }
        if depth == 0 {
            break;
        }
        if depth == 1 && c == ',' {
            items.push(std::mem::take(&mut item));
        } else {
            item.push(c);
        }
    }
    items.push(item);
    items
        .iter()
        .filter_map(|item| first_segment(item))
        .collect()
}

/// The first segment after each `super::` chain in `source` that climbs out of the
/// crate's top-level module: from a file `depth` modules below the crate root, plus
/// the inline modules (`mod tests { … }`) the chain is in.
fn climbing_imports(source: &str, depth: usize) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    // For each open brace: whether it opens an inline module.
    let mut braces: Vec<bool> = Vec::new();
    let mut at = 0;
    while at < source.len() {
        let rest = &source[at..];
        if rest.starts_with('{') {
            let before = source[..at].trim_end();
            let opens_module =
                before
                    .rsplit_once(char::is_whitespace)
                    .is_some_and(|(head, name)| {
                        head.trim_end().ends_with("mod")
                            && name.chars().all(|c| c.is_alphanumeric() || c == '_')
                    });
            braces.push(opens_module);
        } else if rest.starts_with('}') {
            braces.pop();
        } else if rest.starts_with("super::") {
            let before = source[..at].chars().next_back();
            let mut chain = rest;
            let mut climbs = 0;
            while let Some(after) = chain.strip_prefix("super::") {
                climbs += 1;
                chain = after;
            }
            // Part of a longer path (`self::super::`) or of a name ending so.
            let starts = !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':');
            let inline = braces.iter().filter(|&&module| module).count();
            if starts && climbs >= depth + inline {
                found.extend(heads(chain));
            }
            at = source.len() - chain.len();
            continue;
        }
        at += rest.chars().next().map_or(1, char::len_utf8);
    }
    found
}

/// Code without its comment lines.
fn code_of(source: &str) -> String {
    source
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The identifier a path begins with.
fn first_segment(path: &str) -> Option<String> {
    let name: String = path
        .trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

/// The imports of a crate's top-level modules.
struct Imports {
    /// Each module, with the top-level modules its files import (itself left out).
    graph: BTreeMap<String, BTreeSet<String>>,
    /// Each module that imports items of the crate root, with those items.
    from_root: BTreeMap<String, BTreeSet<String>>,
}

/// The imports of the top-level modules of the crate whose sources are in `src`.
fn module_imports(src: &Path) -> anyhow::Result<Imports> {
    let mut files = Vec::new();
    rust_files(src, &mut files)?;
    // The modules a file is in, outermost first (`a/b/mod.rs` and `a/b.rs`: a, b).
    let modules_of = |file: &Path| -> Vec<String> {
        let Ok(relative) = file.strip_prefix(src) else {
            return Vec::new();
        };
        let mut names: Vec<String> = relative
            .components()
            .map(|part| {
                let name = part.as_os_str().to_string_lossy();
                name.strip_suffix(".rs").unwrap_or(&name).to_owned()
            })
            .collect();
        if names.last().is_some_and(|name| name == "mod") {
            names.pop();
        }
        if names.len() == 1 && matches!(names[0].as_str(), "main" | "lib") {
            names.clear();
        }
        names
    };
    let modules: BTreeSet<String> = files
        .iter()
        .filter_map(|file| modules_of(file).into_iter().next())
        .collect();
    let mut imports = Imports {
        graph: BTreeMap::new(),
        from_root: BTreeMap::new(),
    };
    for file in &files {
        let path = modules_of(file);
        let Some(module) = path.first().cloned() else {
            continue;
        };
        let code = code_of(&fs::read_to_string(file)?);
        let mut found = crate_imports(&code);
        found.extend(climbing_imports(&code, path.len()));
        found.remove(&module);
        let (to_modules, to_root): (BTreeSet<String>, BTreeSet<String>) = found
            .into_iter()
            .partition(|import| modules.contains(import));
        imports
            .graph
            .entry(module.clone())
            .or_default()
            .extend(to_modules);
        if !to_root.is_empty() {
            imports.from_root.entry(module).or_default().extend(to_root);
        }
    }
    Ok(imports)
}

/// A circle of `graph`, as the modules along it, if it has one.
fn circle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match marks.get(node) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let start = path.iter().position(|n| n == node).unwrap_or(0);
                let mut found = path[start..].to_vec();
                found.push(node.to_owned());
                return Some(found);
            }
            None => {}
        }
        marks.insert(node.to_owned(), Mark::Open);
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(found) = visit(next, graph, marks, path) {
                return Some(found);
            }
        }
        path.pop();
        marks.insert(node.to_owned(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut marks, &mut Vec::new()))
}

fn no_circle(crate_src: &str) -> anyhow::Result<()> {
    let Imports { graph, from_root } = module_imports(&workspace().join(crate_src))?;
    ensure!(
        from_root.is_empty(),
        "{crate_src}: modules import items of the crate root (arrows back up; move \
         the item into a module): {from_root:?}"
    );
    let edges: usize = graph.values().map(BTreeSet::len).sum();
    ensure!(
        graph.len() > 5 && edges > 5,
        "{crate_src}: only {} modules and {edges} imports found",
        graph.len()
    );
    if let Some(found) = circle(&graph) {
        anyhow::bail!(
            "{crate_src}: the modules import each other in a circle: {}",
            found.join(" → ")
        );
    }
    Ok(())
}

#[test]
fn the_kernel_crate_has_no_import_circle_nor_arrow_back_up() -> anyhow::Result<()> {
    no_circle("exporter-ebpf/src")
}

#[test]
fn the_exporter_has_no_import_circle_nor_arrow_back_up() -> anyhow::Result<()> {
    no_circle("exporter/src")
}

/// The parser and the search, on small inputs, so that a failure of the real checks
/// is about the code and not the check.
#[test]
fn imports_and_circles_are_found() {
    let source = "use crate::{\n    abi::{A, B},\n    maps::{self, C},\n    threads,\n};\n\
                  // crate::commented::out\nfn f() { crate::clock::now_ns(); poolscope_crate::x(); }\n";
    let found: Vec<String> = crate_imports(source).into_iter().collect();
    assert_eq!(found, ["abi", "clock", "maps", "threads"]);
    // From a/b/c.rs (depth 3): `super::super::super::x` reaches the root's x;
    // shorter chains stay inside module a, and `self::super::` is not a chain start.
    let climbing = "use super::super::super::{x, y};\nuse super::super::z;\n\
                    fn f() { super::super::super::w::g(); self::super::v(); }\n\
                    mod tests { use super::super::super::u; use super::super::super::super::t; }";
    let found: Vec<String> = climbing_imports(climbing, 3).into_iter().collect();
    assert_eq!(found, ["t", "w", "x", "y"]);
    let graph = |edges: &[(&str, &str)]| {
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (from, to) in edges {
            graph
                .entry((*from).to_owned())
                .or_default()
                .insert((*to).to_owned());
            graph.entry((*to).to_owned()).or_default();
        }
        graph
    };
    assert_eq!(circle(&graph(&[("a", "b"), ("b", "c"), ("a", "c")])), None);
    assert_eq!(
        circle(&graph(&[("a", "b"), ("b", "c"), ("c", "b")])),
        Some(vec!["b".to_owned(), "c".to_owned(), "b".to_owned()])
    );
}
