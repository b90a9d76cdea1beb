//! Keeps the docs honest, without root: every configuration key of
//! `exporter/src/config/raw.rs` has a row in the configuration reference
//! (`docs/configuration.md`), every metric family poolscope exports
//! (`Family::new("name", Kind::…)` anywhere in `exporter/src/`, unit tests left out)
//! has a row naming its exposed name and type in the metrics reference
//! (`docs/metrics.md`), every command-line flag is documented, and neither reference
//! documents a key or metric that no longer exists. Every relative link of README.md
//! and docs/ resolves (its file, and its `#anchor` in a Markdown file), every path
//! `docs/ARCHITECTURE.md` names exists, nothing the repository tracks points
//! outside it (its design is in docs/DESIGN.md), and the accuracy scorecard
//! (`docs/accuracy.md`) lists exactly the quantities the tests record.
//!
//! The sources are read at test time, so a key, metric or flag added without docs
//! fails here with a message naming it.
use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, bail, ensure};
use poolscope_tests::rust_files;

const METRICS_REFERENCE: &str = "docs/metrics.md";
const CONFIG_REFERENCE: &str = "docs/configuration.md";
/// The exposed name of every family (`encode/mod.rs`: `PREFIX`).
const PREFIX: &str = "poolscope_";

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(relative: &str) -> anyhow::Result<String> {
    let path = workspace().join(relative);
    fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))
}

/// Markdown lines outside fenced code blocks, with their index.
fn prose_lines(markdown: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for (index, line) in markdown.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            lines.push((index, line));
        }
    }
    lines
}

/// The `## ` sections of a page: (heading, body).
fn subsections(page: &str) -> Vec<(String, String)> {
    let mut parts: Vec<(String, String)> = Vec::new();
    for (_, line) in prose_lines(page) {
        if let Some(heading) = line.strip_prefix("## ") {
            parts.push((heading.trim().to_owned(), String::new()));
        } else if let Some((_, body)) = parts.last_mut() {
            body.push_str(line);
            body.push('\n');
        }
    }
    parts
}

/// Table rows (outside code blocks) as their trimmed cells.
fn table_rows(markdown: &str) -> Vec<Vec<String>> {
    prose_lines(markdown)
        .into_iter()
        .filter_map(|(_, line)| {
            let inner = line.trim().strip_prefix('|')?.strip_suffix('|')?;
            Some(
                inner
                    .split('|')
                    .map(|cell| cell.trim().to_owned())
                    .collect(),
            )
        })
        .collect()
}

/// A cell that is exactly one code span: `` `name` `` → `name`.
fn code_cell(cell: &str) -> Option<&str> {
    let name = cell.strip_prefix('`')?.strip_suffix('`')?;
    (!name.is_empty() && !name.contains('`')).then_some(name)
}

/// The `pub name: Type` fields of `pub struct {name}` in a Rust source.
fn struct_fields(source: &str, name: &str) -> anyhow::Result<Vec<(String, String)>> {
    let header = format!("pub struct {name} {{");
    let start = source
        .find(&header)
        .with_context(|| format!("config/raw.rs has no `{header}`"))?;
    let mut fields = Vec::new();
    for line in source[start + header.len()..].lines() {
        let line = line.trim();
        if line == "}" {
            return Ok(fields);
        }
        if let Some(field) = line.strip_prefix("pub ")
            && let Some((field, ty)) = field.split_once(':')
        {
            let ty = ty.trim().trim_end_matches(',').trim();
            fields.push((field.trim().to_owned(), ty.to_owned()));
        }
    }
    bail!("`{header}` is not closed")
}

/// Every configuration key: (section, key), from `RawConfig`'s sections and the
/// `Raw*` structs they name (`targets: Vec<RawTarget>` is the `[[targets]]` table).
fn config_keys() -> anyhow::Result<Vec<(String, String)>> {
    let source = read("exporter/src/config/raw.rs")?;
    let mut keys = Vec::new();
    for (section, ty) in struct_fields(&source, "RawConfig")? {
        let raw = ty
            .strip_prefix("Vec<")
            .and_then(|inner| inner.strip_suffix('>'))
            .unwrap_or(&ty);
        ensure!(
            raw.starts_with("Raw"),
            "RawConfig.{section} has type `{ty}`, not a `Raw*` section struct: teach \
             tests/tests/docs.rs how to find its keys"
        );
        let fields = struct_fields(&source, raw)?;
        ensure!(!fields.is_empty(), "`{raw}` has no `pub` fields");
        for (key, _) in fields {
            keys.push((section.clone(), key));
        }
    }
    ensure!(
        !keys.is_empty(),
        "no configuration keys found in config/raw.rs"
    );
    Ok(keys)
}

/// One `Family::new("name", Kind::…, …)` of the exporter, or `Family::standard(…)`
/// (a name of Prometheus' conventions, `process_*`, without the prefix).
#[derive(Debug)]
struct Declared {
    name: String,
    kind: String,
    file: String,
    prefix: &'static str,
}

impl Declared {
    /// The name Prometheus sees: prefixed, counters with `_total`.
    fn exposed(&self) -> String {
        let suffix = if self.kind == "counter" { "_total" } else { "" };
        format!("{}{}{suffix}", self.prefix, self.name)
    }
}

/// The files of unit-test modules among `files`: each `#[cfg(test)] mod name;` of a
/// file names `name.rs` (or `name/mod.rs`) in that file's module directory.
fn test_module_files(files: &[PathBuf]) -> anyhow::Result<BTreeSet<PathBuf>> {
    let mut tests = BTreeSet::new();
    for path in files {
        let source =
            fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let Some(parent) = path.parent() else {
            continue;
        };
        let stem = path
            .file_stem()
            .map(|stem| stem.to_string_lossy().into_owned());
        // a/mod.rs and lib.rs hold the modules of a/ and of the crate root; a/b.rs
        // those of a/b/.
        let directory = match stem.as_deref() {
            Some("mod" | "lib" | "main") | None => parent.to_path_buf(),
            Some(stem) => parent.join(stem),
        };
        for (at, _) in source.match_indices("#[cfg(test)]\n") {
            let declaration = source[at..].lines().nth(1).unwrap_or_default().trim();
            let name = declaration
                .strip_prefix("pub(crate) ")
                .unwrap_or(declaration)
                .strip_prefix("mod ")
                .and_then(|rest| rest.strip_suffix(';'));
            if let Some(name) = name {
                tests.insert(directory.join(format!("{name}.rs")));
                tests.insert(directory.join(name).join("mod.rs"));
            }
        }
    }
    Ok(tests)
}

/// The metric families declared in `exporter/src/` outside unit-test modules (inline
/// or in files of their own).
fn declared_families() -> anyhow::Result<Vec<Declared>> {
    const CALLS: [(&str, &str); 2] = [("Family::new(", PREFIX), ("Family::standard(", "")];
    let src = workspace().join("exporter/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files)?;
    files.sort();
    let test_files = test_module_files(&files)?;
    ensure!(
        test_files
            .iter()
            .any(|file| file.ends_with("collectors/services/tests.rs")),
        "the unit-test files were not found (collectors/services/tests.rs among them)"
    );
    let mut declared = Vec::new();
    for path in files.into_iter().filter(|path| !test_files.contains(path)) {
        let file = path
            .strip_prefix(workspace())
            .unwrap_or(&path)
            .display()
            .to_string();
        let source =
            fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        // Unit tests build families of their own, with made-up help and values.
        let source = source
            .find("#[cfg(test)]\nmod tests")
            .map_or(source.as_str(), |end| &source[..end]);
        for (call, prefix, at) in CALLS.iter().flat_map(|&(call, prefix)| {
            source
                .match_indices(call)
                .map(move |(at, _)| (call, prefix, at))
        }) {
            let rest = source[at + call.len()..].trim_start();
            let context = || {
                let line = source[..at].lines().count() + 1;
                format!("{file}:{line}")
            };
            let Some(rest) = rest.strip_prefix('"') else {
                bail!(
                    "{}: {call} without a string literal name; tests/tests/docs.rs \
                     can only check literal names against docs/metrics.md",
                    context()
                );
            };
            let (name, rest) = rest
                .split_once('"')
                .with_context(|| format!("{}: unterminated name", context()))?;
            let kind = rest
                .trim_start()
                .strip_prefix(',')
                .map(str::trim_start)
                .and_then(|rest| rest.strip_prefix("Kind::"))
                .map(|rest| {
                    rest.chars()
                        .take_while(char::is_ascii_alphanumeric)
                        .collect::<String>()
                })
                .with_context(|| format!("{}: `{name}` has no `Kind::` after it", context()))?;
            let kind = match kind.as_str() {
                "Counter" => "counter",
                "Gauge" => "gauge",
                "Histogram" => "histogram",
                "Summary" => "summary",
                other => bail!("{}: `{name}` has an unknown kind `{other}`", context()),
            };
            declared.push(Declared {
                name: name.to_owned(),
                kind: kind.to_owned(),
                file: file.clone(),
                prefix,
            });
        }
    }
    Ok(declared)
}

/// The long flags the binary accepts (`#[arg(long = "…")]` in main.rs).
fn flags() -> anyhow::Result<Vec<String>> {
    const LONG: &str = "long = \"";
    let source = read("exporter/src/main.rs")?;
    let mut flags = Vec::new();
    for (at, _) in source.match_indices(LONG) {
        let rest = &source[at + LONG.len()..];
        let (flag, _) = rest.split_once('"').context("unterminated long flag")?;
        flags.push(format!("--{flag}"));
    }
    ensure!(
        !flags.is_empty(),
        "no `long = \"…\"` flags found in main.rs"
    );
    Ok(flags)
}

#[test]
fn readme_keeps_its_first_lines() -> anyhow::Result<()> {
    let readme = read("README.md")?;
    let mut lines = readme.lines();
    ensure!(
        lines.next() == Some("# poolscope"),
        "README.md must start with `# poolscope`"
    );
    let head: Vec<&str> = lines.take(5).collect();
    ensure!(
        head.first() == Some(&"")
            && head.get(1) == Some(&"```sh")
            && head
                .get(2)
                .is_some_and(|l| l.starts_with("cargo xtask run "))
            && head
                .get(3)
                .is_some_and(|l| l.starts_with("cargo xtask test "))
            && head.get(4) == Some(&"```"),
        "README.md must open with the `cargo xtask run` / `cargo xtask test` block, got {head:?}"
    );
    Ok(())
}

#[test]
fn every_config_key_is_in_the_configuration_reference() -> anyhow::Result<()> {
    let reference = read(CONFIG_REFERENCE)?;
    let parts = subsections(&reference);
    let keys = config_keys()?;
    let sections: BTreeSet<&str> = keys.iter().map(|(section, _)| section.as_str()).collect();

    // The subsection of each `[section]` (`[[targets]]` too) and the keys of its tables.
    let mut documented: BTreeSet<(String, String)> = BTreeSet::new();
    let mut problems = Vec::new();
    for section in &sections {
        let tag = format!("[{section}]");
        let Some((_, body)) = parts.iter().find(|(heading, _)| heading.contains(&tag)) else {
            problems.push(format!("no `## {tag}` heading in {CONFIG_REFERENCE}"));
            continue;
        };
        for row in table_rows(body) {
            if let Some(key) = row.first().and_then(|cell| code_cell(cell)) {
                documented.insert(((*section).to_owned(), key.to_owned()));
            }
        }
    }
    for (section, key) in &keys {
        let dotted = format!("`{section}.{key}`");
        if !documented.contains(&(section.clone(), key.clone())) && !reference.contains(&dotted) {
            problems.push(format!(
                "config key `{section}.{key}` (exporter/src/config/raw.rs) has no row in \
                 {CONFIG_REFERENCE} under its `[{section}]` heading"
            ));
        }
    }
    let known: BTreeSet<(String, String)> = keys.iter().cloned().collect();
    for (section, key) in documented.difference(&known) {
        problems.push(format!(
            "{CONFIG_REFERENCE} documents `{section}.{key}`, which \
             exporter/src/config/raw.rs does not have"
        ));
    }

    for flag in flags()? {
        if !reference.contains(&format!("`{flag}")) {
            problems.push(format!(
                "flag `{flag}` (exporter/src/main.rs) is not in {CONFIG_REFERENCE}"
            ));
        }
    }
    ensure!(problems.is_empty(), "{}", problems.join("\n"));
    Ok(())
}

#[test]
fn every_metric_family_is_in_the_metrics_reference() -> anyhow::Result<()> {
    let reference = read(METRICS_REFERENCE)?;
    // (exposed name, type) of every row whose first cell is one metric.
    let rows: Vec<(String, String)> = table_rows(&reference)
        .into_iter()
        .filter_map(|row| {
            let name = code_cell(row.first()?)?;
            (name.starts_with(PREFIX) || name.starts_with("process_"))
                .then(|| (name.to_owned(), row.get(1).cloned().unwrap_or_default()))
        })
        .collect();
    let declared = declared_families()?;
    ensure!(
        !declared.is_empty(),
        "no Family::new(\"…\") calls found in exporter/src"
    );

    let mut problems = Vec::new();
    let mut exposed = BTreeSet::new();
    for family in &declared {
        let name = family.exposed();
        exposed.insert(name.clone());
        match rows.iter().find(|(row, _)| *row == name) {
            None => problems.push(format!(
                "metric `{name}` ({}, declared in {}) has no row in \
                 {METRICS_REFERENCE} (first cell `{name}`, second cell its type)",
                family.kind, family.file
            )),
            Some((_, kind)) if *kind != family.kind => problems.push(format!(
                "metric `{name}` is a {} ({}) but {METRICS_REFERENCE} says `{kind}`",
                family.kind, family.file
            )),
            Some(_) => {}
        }
    }
    for (row, _) in &rows {
        if !exposed.contains(row) {
            problems.push(format!(
                "{METRICS_REFERENCE} documents `{row}`, which no \
                 Family::new in exporter/src exports (counters are named with `_total`)"
            ));
        }
    }
    ensure!(problems.is_empty(), "{}", problems.join("\n"));
    Ok(())
}

/// The parsers above, on small inputs, so that a failure of the real checks is about
/// the docs and not the parsing.
#[test]
fn parsers_read_what_they_should() -> anyhow::Result<()> {
    let a = "# t\ntext\n```toml\n## not a heading\n| `no` | x |\n```\n\
             ## `[web]`\n| key | type |\n|---|---|\n| `listen_address` | string |\n";
    let parts = subsections(a);
    ensure!(parts.len() == 1 && parts[0].0 == "`[web]`", "{parts:?}");
    let cells: Vec<Vec<String>> = table_rows(&parts[0].1);
    ensure!(
        cells.iter().any(|row| row[0] == "`listen_address`"),
        "{cells:?}"
    );
    ensure!(
        !table_rows(a).iter().any(|row| row[0] == "`no`"),
        "rows inside code blocks must not count"
    );
    ensure!(code_cell("`x`") == Some("x") && code_cell("x").is_none());
    ensure!(anchor_of("`[probes]` and *HTTP/2*: x_y") == "probes-and-http2-x_y");
    ensure!(
        links("[a](b.md#c) `[x](no)` [d](https://e) [f](#g)\n```\n[h](i)\n```\n")
            == [(1, "b.md#c".to_owned()), (1, "#g".to_owned())],
        "{:?}",
        links("[a](b.md#c) `[x](no)` [d](https://e) [f](#g)")
    );

    let source = "pub struct RawX {\n    /// doc: not a field\n    #[serde(default)]\n    \
                  pub a: Duration,\n    pub b: Vec<String>,\n}\n";
    let fields = struct_fields(source, "RawX")?;
    ensure!(
        fields
            == [
                ("a".into(), "Duration".into()),
                ("b".into(), "Vec<String>".into())
            ],
        "{fields:?}"
    );
    let family = Declared {
        name: "requests".into(),
        kind: "counter".into(),
        file: String::new(),
        prefix: PREFIX,
    };
    ensure!(family.exposed() == "poolscope_requests_total");
    let standard = Declared {
        name: "process_cpu_seconds".into(),
        prefix: "",
        ..family
    };
    ensure!(standard.exposed() == "process_cpu_seconds_total");
    Ok(())
}

#[test]
fn nothing_points_outside_the_repository() -> anyhow::Result<()> {
    let output = std::process::Command::new("git")
        .arg("-C")
        .arg(workspace())
        // Spelled in two pieces, so that this line is not a match itself.
        .args(["grep", "-n", "--fixed-strings", concat!("../", "shared/")])
        .output()
        .context("running git grep")?;
    // git grep exits 1 when nothing matches, 128 outside a git checkout.
    match output.status.code() {
        Some(1) => Ok(()),
        Some(128) => {
            poolscope_tests::skip(
                "nothing_points_outside_the_repository",
                "not a git checkout",
            );
            Ok(())
        }
        _ => bail!(
            "the repository points outside itself (the design is docs/DESIGN.md):\n{}",
            String::from_utf8_lossy(&output.stdout)
        ),
    }
}

/// The anchor a Markdown renderer gives a heading: lower case, spaces as hyphens,
/// punctuation but `-` and `_` dropped.
fn anchor_of(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings.
fn anchors(markdown: &str) -> BTreeSet<String> {
    prose_lines(markdown)
        .into_iter()
        .filter_map(|(_, line)| {
            let text = line.trim_start_matches('#');
            (text.len() < line.len() && text.starts_with(' ')).then(|| anchor_of(text))
        })
        .collect()
}

/// The relative link targets of a Markdown file, with their line numbers (from 1):
/// outside code blocks and code spans; web and mail addresses left out.
fn links(markdown: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (index, line) in prose_lines(markdown) {
        // Code spans (`[x](y)` in a span is no link): every other piece between backticks.
        for (piece, text) in line.split('`').enumerate() {
            if piece % 2 == 1 {
                continue;
            }
            for (_, after) in text
                .match_indices("](")
                .map(|(at, _)| text.split_at(at + 2))
            {
                let Some(target) = after.split(')').next() else {
                    continue;
                };
                if !target.is_empty()
                    && !target.contains(char::is_whitespace)
                    && !target.starts_with("http://")
                    && !target.starts_with("https://")
                    && !target.starts_with("mailto:")
                {
                    found.push((index + 1, target.to_owned()));
                }
            }
        }
    }
    found
}

/// README.md and every Markdown page of docs/.
fn pages() -> anyhow::Result<Vec<PathBuf>> {
    let mut pages = vec![workspace().join("README.md")];
    for entry in fs::read_dir(workspace().join("docs"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "md") {
            pages.push(path);
        }
    }
    Ok(pages)
}

#[test]
fn every_relative_link_resolves() -> anyhow::Result<()> {
    let mut problems = Vec::new();
    for page in pages()? {
        let markdown = fs::read_to_string(&page)?;
        let dir = page.parent().context("a page has a directory")?;
        for (line, target) in links(&markdown) {
            let (path, anchor) = target.split_once('#').unwrap_or((&target, ""));
            let file = if path.is_empty() {
                page.clone()
            } else {
                dir.join(path)
            };
            let shown = format!("{}:{line}: `{target}`", page.display());
            if !file.exists() {
                problems.push(format!("{shown}: no such file"));
            } else if !anchor.is_empty()
                && file.extension().is_some_and(|ext| ext == "md")
                && !anchors(&fs::read_to_string(&file)?).contains(anchor)
            {
                problems.push(format!("{shown}: no heading with that anchor"));
            }
        }
    }
    ensure!(problems.is_empty(), "{}", problems.join("\n"));
    Ok(())
}

/// Every path `docs/ARCHITECTURE.md` names in a code span (a span with a `/` or a
/// file extension, no spaces) exists: from the repository's root, or from one of the
/// crates' source folders the page's tables are written relative to.
#[test]
fn every_path_in_the_architecture_exists() -> anyhow::Result<()> {
    const BASES: [&str; 6] = [
        "",
        "exporter/src",
        "exporter-ebpf/src",
        "xtask/src",
        "shared/src",
        "tests/src",
    ];
    // A bare file or folder name (the folder tables name them within their folder's
    // row: `mod.rs`, `procfs/`) is found anywhere in the sources.
    let mut sources = Vec::new();
    for base in &BASES[1..] {
        rust_files(&workspace().join(base), &mut sources)?;
    }
    let mut names = BTreeSet::new();
    for path in &sources {
        if let Some(name) = path.file_name() {
            names.insert(name.to_string_lossy().into_owned());
        }
        if let Some(folder) = path.parent().and_then(Path::file_name) {
            names.insert(format!("{}/", folder.to_string_lossy()));
        }
    }
    let architecture = read("docs/ARCHITECTURE.md")?;
    let mut problems = Vec::new();
    let mut checked = 0;
    for (_, line) in prose_lines(&architecture) {
        for span in line.split('`').skip(1).step_by(2) {
            // Absolute paths and URL paths (`/sys/…`, `/debug/…`) are the host's.
            let path_like = !span.contains(char::is_whitespace)
                && !span.contains("::")
                && !span.starts_with('/')
                && (span.contains('/')
                    || [".rs", ".md", ".toml", ".yml", ".service"]
                        .iter()
                        .any(|ext| span.ends_with(ext)));
            if !path_like {
                continue;
            }
            checked += 1;
            let found = names.contains(span)
                || BASES.iter().any(|base| {
                    workspace()
                        .join(base)
                        .join(span.trim_end_matches('/'))
                        .exists()
                });
            if !found {
                problems.push(format!("`{span}`"));
            }
        }
    }
    ensure!(
        checked > 20,
        "only {checked} paths found in docs/ARCHITECTURE.md"
    );
    ensure!(
        problems.is_empty(),
        "docs/ARCHITECTURE.md names paths that do not exist (from the root or a crate's \
         source folder): {}",
        problems.join(", ")
    );
    Ok(())
}

/// The (test binary, quantity) pairs the test sources record: the string literal that
/// opens each call of a recorder function (`scorecard::exact` and the like) in
/// tests/tests/<binary>.rs.
fn recorded_quantities() -> anyhow::Result<BTreeSet<(String, String)>> {
    const CALL: &str = "scorecard::";
    let mut recorded = BTreeSet::new();
    for entry in fs::read_dir(workspace().join("tests/tests"))? {
        let path = entry?.path();
        let Some(binary) = path
            .file_stem()
            .filter(|_| path.extension().is_some_and(|ext| ext == "rs"))
        else {
            continue;
        };
        let binary = binary.to_string_lossy().into_owned();
        let source = fs::read_to_string(&path)?;
        for (at, _) in source.match_indices(CALL) {
            let rest = &source[at + CALL.len()..];
            let name = rest
                .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                .unwrap_or(rest.len());
            let Some(arguments) = rest[name..].strip_prefix('(') else {
                continue;
            };
            let arguments = arguments.trim_start();
            let quantity = arguments
                .strip_prefix('"')
                .and_then(|literal| literal.split_once('"'))
                .map(|(quantity, _)| quantity)
                .with_context(|| {
                    format!(
                        "{}: a scorecard call whose quantity is not a string literal: {}",
                        path.display(),
                        &rest[..rest.len().min(80)]
                    )
                })?;
            recorded.insert((binary.clone(), quantity.to_owned()));
        }
    }
    Ok(recorded)
}

/// docs/accuracy.md, written by `cargo xtask scorecard` from the tests' own log, lists
/// every quantity a test records (its binary in the last column), and nothing else.
#[test]
fn the_accuracy_scorecard_lists_what_the_tests_record() -> anyhow::Result<()> {
    let recorded = recorded_quantities()?;
    ensure!(
        recorded.len() > 20,
        "only {} recorded quantities found in tests/tests",
        recorded.len()
    );
    let page = read("docs/accuracy.md")?;
    let mut listed = BTreeSet::new();
    for row in table_rows(&page).iter().skip(2) {
        let (Some(quantity), Some(test)) = (row.first(), row.last()) else {
            continue;
        };
        let binary = test
            .strip_prefix('`')
            .and_then(|rest| rest.split_once('`'))
            .map(|(binary, _)| binary)
            .with_context(|| format!("docs/accuracy.md: a row without its test binary: {row:?}"))?;
        listed.insert((binary.to_owned(), quantity.clone()));
    }
    let missing: Vec<String> = recorded
        .difference(&listed)
        .map(|(binary, quantity)| format!("{binary}: {quantity}"))
        .collect();
    let stale: Vec<String> = listed
        .difference(&recorded)
        .map(|(binary, quantity)| format!("{binary}: {quantity}"))
        .collect();
    ensure!(
        missing.is_empty() && stale.is_empty(),
        "docs/accuracy.md is not what the tests record; run `cargo xtask scorecard` (as \
         root).\n  recorded, not listed: {}\n  listed, recorded by no test: {}",
        missing.join("; "),
        stale.join("; ")
    );
    Ok(())
}
