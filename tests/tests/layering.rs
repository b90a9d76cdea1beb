//! Keeps the code layered as docs/ARCHITECTURE.md draws it, without root: no circle
//! of imports between the kernel crate's modules (one file each), nor between the
//! exporter's top-level modules (its folders and files under `exporter/src/`). An
//! import is every `crate::` path in code (a `use` or inline), comments left out;
//! items of the crate root are not a module.
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
    let code: String = source
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = BTreeSet::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        // `poolscope_crate::x` is not this crate.
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
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
            for item in items {
                found.extend(first_segment(&item));
            }
        } else {
            found.extend(first_segment(rest));
        }
    }
    found
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

/// The top-level modules of the crate whose sources are in `src`, each with the
/// top-level modules its files import (itself and the crate root left out).
fn module_graph(src: &Path) -> anyhow::Result<BTreeMap<String, BTreeSet<String>>> {
    let mut files = Vec::new();
    rust_files(src, &mut files)?;
    let module_of = |file: &Path| -> Option<String> {
        let first = file.strip_prefix(src).ok()?.components().next()?;
        let name = first.as_os_str().to_string_lossy();
        let name = name.strip_suffix(".rs").unwrap_or(&name).to_owned();
        (!matches!(name.as_str(), "main" | "lib")).then_some(name)
    };
    let modules: BTreeSet<String> = files.iter().filter_map(|file| module_of(file)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let Some(module) = module_of(file) else {
            continue;
        };
        let imports = crate_imports(&fs::read_to_string(file)?);
        let entry = graph.entry(module.clone()).or_default();
        entry.extend(
            imports
                .into_iter()
                .filter(|import| *import != module && modules.contains(import)),
        );
    }
    Ok(graph)
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
    let graph = module_graph(&workspace().join(crate_src))?;
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
fn the_kernel_crate_has_no_import_circle() -> anyhow::Result<()> {
    no_circle("exporter-ebpf/src")
}

#[test]
fn the_exporter_has_no_import_circle() -> anyhow::Result<()> {
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
