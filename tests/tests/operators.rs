//! The operators' kit against the real tools (issue 7):
//! - the Prometheus rules in `alerts/` pass `promtool check rules` and their unit tests
//!   in `alerts/tests/`, which cover every alert firing and quiet and every recording
//!   rule;
//! - the Grafana dashboards in `dashboards/` are well-formed (schema, ids, layout,
//!   datasource variable, template variables) and name only metrics poolscope exports,
//!   read from the `Family::new` calls under `exporter/src/` at test time, so a renamed
//!   metric fails here;
//! - as root: every dashboard query, variable query and rule expression runs against a
//!   real Prometheus scraping poolscope while three test servers are under load; panels
//!   must return data, rules must evaluate, rule groups be healthy and the scrape up.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail, ensure};
use poolscope_tests::{
    PoolServer, Poolscope, Program,
    downstream::{self, Backend, Kind},
    http1::{StatusLoad, StatusServer},
    http2::{Amount, GrpcClient, GrpcServer},
    load::{ClosedLoop, Connections},
    one_at_a_time, parse_tids,
    pods::{Cgroups, cgroup_mounts, container_id, log_link, move_into, systemd_driver_path},
    privileged,
    prometheus::Prometheus,
    requests_settled, scrape_until, wait_until,
};
use serde_json::Value;

const PROMTOOL: &str = "/usr/bin/promtool";

/// What Grafana puts in `$__rate_interval` and friends for the live test: a window
/// that holds ~10 of the test's 1 s scrapes.
const RATE_INTERVAL: &str = "10s";

/// Scrapes to wait for before querying: more than a rate window's worth.
const MIN_SCRAPES: f64 = 12.0;

/// The service the kubelet's log links name in the live test.
const CHECKOUT: &str = "shop.checkout.checkout";

/// Grafana's built-in variables the dashboards may use.
const BUILTIN_VARIABLES: [&str; 4] = ["__rate_interval", "__interval", "__range", "__interval_ms"];

/// Units a panel may use; one per kind of quantity so that boards read alike.
const UNITS: [&str; 6] = ["s", "percentunit", "short", "reqps", "cps", "bytes"];

fn repo_root() -> anyhow::Result<PathBuf> {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .context("tests/ has no parent directory")
}

/// The files in `dir` (relative to the repository) ending in `.ext`, sorted.
fn files(dir: &str, ext: &str) -> anyhow::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    let path = repo_root()?.join(dir);
    for entry in std::fs::read_dir(&path).with_context(|| format!("listing {}", path.display()))? {
        let path = entry?.path();
        if path.is_file() && path.extension().is_some_and(|e| e == ext) {
            found.push(path);
        }
    }
    found.sort();
    ensure!(!found.is_empty(), "no *.{ext} in {dir}");
    Ok(found)
}

// ------------------------------------------------------------------ what poolscope exports

/// The product code (each file up to its unit tests) of every `.rs` file under `dir`.
fn product_code(dir: &Path) -> anyhow::Result<String> {
    let mut code = String::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)?
        .map(|entry| entry.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    entries.sort();
    for path in entries {
        if path.is_dir() {
            code.push_str(&product_code(&path)?);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            let text = std::fs::read_to_string(&path)?;
            code.push_str(text.split("#[cfg(test)]").next().unwrap_or_default());
        }
    }
    Ok(code)
}

/// Every series name poolscope can export: the `Family::new("name", Kind::…` calls
/// (and `Family::standard`, the `process_*` families, without the prefix)
/// under `exporter/src/` (outside unit tests: each collector names its own families,
/// and the web server and profiling sessions theirs), with encode/mod.rs's prefix and the
/// suffixes it writes for each kind.
fn exported_metrics() -> anyhow::Result<BTreeSet<String>> {
    let root = repo_root()?;
    let code = product_code(&root.join("exporter/src"))?;
    let encode = std::fs::read_to_string(root.join("exporter/src/encode/mod.rs"))?;
    let prefix = encode
        .split("pub const PREFIX: &str = \"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .context("no PREFIX in exporter/src/encode/mod.rs")?;
    let mut names = BTreeSet::new();
    let calls = code
        .split("Family::new(")
        .skip(1)
        .map(|call| (prefix, call))
        .chain(
            code.split("Family::standard(")
                .skip(1)
                .map(|call| ("", call)),
        );
    for (prefix, call) in calls {
        let call = call.trim_start();
        let name = call
            .strip_prefix('"')
            .and_then(|rest| rest.split('"').next())
            .with_context(|| format!("Family::new without a literal name: {:.60}", call))?;
        let kind = call[name.len() + 2..]
            .trim_start()
            .strip_prefix(',')
            .map(str::trim_start)
            .and_then(|rest| rest.strip_prefix("Kind::"))
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_alphanumeric()).next())
            .with_context(|| format!("Family::new(\"{name}\" without a Kind"))?;
        let suffixes: &[&str] = match kind {
            "Gauge" => &[""],
            "Counter" => &["_total"],
            "Histogram" => &["_bucket", "_sum", "_count"],
            "Summary" => &["", "_sum", "_count"],
            other => bail!("unknown Kind::{other} of {name}"),
        };
        for suffix in suffixes {
            names.insert(format!("{prefix}{name}{suffix}"));
        }
    }
    ensure!(
        names.len() >= 40,
        "only {} series names parsed from exporter/src: {names:?}",
        names.len()
    );
    Ok(names)
}

// ------------------------------------------------------------------ PromQL and templates

/// Index just past the string literal that starts at `start`.
fn skip_string(chars: &[char], start: usize) -> usize {
    let quote = chars[start];
    let mut i = start + 1;
    while i < chars.len() && chars[i] != quote {
        // Backquoted strings have no escapes.
        i += if chars[i] == '\\' && quote != '`' {
            2
        } else {
            1
        };
    }
    i + 1
}

/// Index just past the `close` that ends the group opened at `start`, skipping strings.
fn skip_group(chars: &[char], start: usize, close: char) -> usize {
    let mut i = start + 1;
    while i < chars.len() && chars[i] != close {
        i = if matches!(chars[i], '"' | '\'' | '`') {
            skip_string(chars, i)
        } else {
            i + 1
        };
    }
    i + 1
}

fn is_word(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

/// The metric names an expression selects: every identifier that is not a function
/// or aggregation (followed by `(` or by `by`/`without`), a keyword, a label list
/// (`by (…)`, `on (…)`, `group_left (…)`…), or inside label matchers, ranges, strings,
/// numbers and template variables.
fn metric_names(expr: &str) -> Vec<String> {
    const LISTS: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    const KEYWORDS: [&str; 7] = ["and", "or", "unless", "bool", "offset", "inf", "nan"];
    let chars: Vec<char> = expr.chars().collect();
    let next_non_space = |mut i: usize| {
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        i
    };
    let word_at = |i: usize| -> String {
        chars[i..]
            .iter()
            .take_while(|c| is_word(**c))
            .collect::<String>()
    };
    let mut names = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '"' | '\'' | '`' => i = skip_string(&chars, i),
            '{' => i = skip_group(&chars, i, '}'),
            '[' => i = skip_group(&chars, i, ']'),
            '#' => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '$' => {
                i += 1;
                while i < chars.len() && (is_word(chars[i]) || matches!(chars[i], '{' | '}')) {
                    i += 1;
                }
            }
            c if c.is_ascii_digit() || c == '.' => {
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            c if is_word(c) => {
                let word = word_at(i);
                i += word.chars().count();
                let next = next_non_space(i);
                let lower = word.to_ascii_lowercase();
                let opens = chars.get(next) == Some(&'(');
                if LISTS.contains(&lower.as_str()) {
                    if opens {
                        i = skip_group(&chars, next, ')');
                    }
                } else if KEYWORDS.contains(&lower.as_str()) || opens {
                    // A keyword, or a function or aggregation applied to what follows.
                } else if matches!(word_at(next).as_str(), "by" | "without") {
                    // An aggregation with its label list first: `sum by (le) (…)`.
                } else {
                    names.push(word);
                }
            }
            _ => i += 1,
        }
    }
    names
}

/// Grafana template variables in `text`: `$name`, `${name}`, `${name:format}`,
/// `[[name]]`; each as (the reference as written, the variable's name).
fn variables(text: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(['$', '[']) {
        let tail = &rest[at..];
        let (reference, name) = if let Some(braced) = tail.strip_prefix("${") {
            match braced.find('}') {
                Some(end) => (
                    &tail[..end + 3],
                    braced[..end].split(':').next().unwrap_or_default(),
                ),
                None => (tail, braced),
            }
        } else if let Some(bracketed) = tail.strip_prefix("[[") {
            match bracketed.find("]]") {
                Some(end) => (&tail[..end + 4], &bracketed[..end]),
                None => (&tail[..1], ""),
            }
        } else if let Some(plain) = tail.strip_prefix('$') {
            let end = plain
                .find(|c: char| !is_word(c) || c == ':')
                .unwrap_or(plain.len());
            (&tail[..end + 1], &plain[..end])
        } else {
            (&tail[..1], "")
        };
        if !name.is_empty() {
            found.push((reference.to_owned(), name.to_owned()));
        }
        rest = &tail[reference.len().max(1)..];
    }
    found
}

/// `text` with every template variable replaced by its value in `values`.
fn substitute(text: &str, values: &BTreeMap<&str, String>) -> anyhow::Result<String> {
    let mut out = text.to_owned();
    for (reference, name) in variables(text) {
        let value = values
            .get(name.as_str())
            .with_context(|| format!("no value for variable {reference} in {text}"))?;
        out = out.replacen(&reference, value, 1);
    }
    Ok(out)
}

// ------------------------------------------------------------------ rule files

#[derive(Debug)]
struct Rule {
    name: String,
    alert: bool,
    expr: String,
}

/// Strips one pair of matching YAML quotes.
fn unquote(text: &str) -> String {
    let text = text.trim();
    for quote in ['"', '\''] {
        if let Some(inner) = text
            .strip_prefix(quote)
            .and_then(|rest| rest.strip_suffix(quote))
        {
            return inner.to_owned();
        }
    }
    text.to_owned()
}

/// The rules of a rule file in the style of `alerts/`: `- record:`/`- alert:` lines,
/// `expr:` on one line or as a `|`/`>` block. There is no YAML parser among the test
/// dependencies; promtool's own count of the rules is compared with this list, so a
/// rule this misses fails the test instead of going unchecked.
fn rules_of(text: &str) -> anyhow::Result<Vec<Rule>> {
    let lines: Vec<&str> = text.lines().collect();
    let mut rules: Vec<Rule> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        i += 1;
        for (key, alert) in [("- record:", false), ("- alert:", true)] {
            if let Some(name) = trimmed.strip_prefix(key) {
                rules.push(Rule {
                    name: unquote(name),
                    alert,
                    expr: String::new(),
                });
            }
        }
        let Some(value) = trimmed.strip_prefix("expr:") else {
            continue;
        };
        let rule = rules
            .last_mut()
            .with_context(|| format!("expr before any rule: {line}"))?;
        let value = value.trim();
        rule.expr = if value.starts_with(['|', '>']) {
            let mut block = Vec::new();
            while i < lines.len() {
                let next = lines[i];
                let next_indent = next.len() - next.trim_start().len();
                if !next.trim().is_empty() && next_indent <= indent {
                    break;
                }
                block.push(next.trim());
                i += 1;
            }
            block.join("\n").trim().to_owned()
        } else {
            unquote(value)
        };
    }
    for rule in &rules {
        ensure!(!rule.expr.is_empty(), "rule {} has no expr", rule.name);
    }
    Ok(rules)
}

fn all_rules() -> anyhow::Result<Vec<Rule>> {
    let mut rules = Vec::new();
    for file in files("alerts", "yml")? {
        rules.extend(rules_of(&std::fs::read_to_string(&file)?)?);
    }
    Ok(rules)
}

/// Runs promtool with `args`; its output, or an error with all of it.
fn promtool(args: &[String]) -> anyhow::Result<String> {
    let output = Command::new(PROMTOOL)
        .args(args)
        .current_dir(repo_root()?)
        .output()
        .with_context(|| format!("running {PROMTOOL} (Debian package prometheus)"))?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(
        output.status.success(),
        "promtool {} failed:\n{said}",
        args.join(" ")
    );
    Ok(said)
}

fn relative(paths: &[PathBuf]) -> anyhow::Result<Vec<String>> {
    let root = repo_root()?;
    paths
        .iter()
        .map(|path| {
            Ok(path
                .strip_prefix(&root)
                .context("outside the repository")?
                .to_string_lossy()
                .into_owned())
        })
        .collect()
}

#[test]
fn rules_pass_promtool_check_and_unit_tests() -> anyhow::Result<()> {
    let rule_files = relative(&files("alerts", "yml")?)?;
    let test_files = relative(&files("alerts/tests", "yml")?)?;

    let mut args = vec!["check".to_owned(), "rules".to_owned()];
    args.extend(rule_files.iter().cloned());
    let said = promtool(&args)?;
    // "  SUCCESS: 33 rules found", once per file.
    let checked: usize = said
        .lines()
        .filter_map(|line| line.trim().strip_prefix("SUCCESS: "))
        .filter_map(|rest| rest.strip_suffix(" rules found"))
        .map(str::parse::<usize>)
        .sum::<Result<_, _>>()?;
    let rules = all_rules()?;
    assert_eq!(
        checked,
        rules.len(),
        "promtool counts {checked} rules, this test reads {}: {said}",
        rules.len()
    );

    let mut args = vec!["test".to_owned(), "rules".to_owned()];
    args.extend(test_files.iter().cloned());
    let said = promtool(&args)?;
    assert_eq!(
        said.matches("SUCCESS").count(),
        test_files.len(),
        "promtool test rules:\n{said}"
    );
    Ok(())
}

/// Whether the unit tests expect an alert quiet (`exp_alerts: []`) and firing.
#[derive(Clone, Copy, Debug, Default)]
struct Cases {
    quiet: bool,
    firing: bool,
}

/// The cases of each `alertname:` checked in the unit tests, and every `expr:` they
/// evaluate (one per line).
fn unit_test_coverage() -> anyhow::Result<(BTreeMap<String, Cases>, String)> {
    let mut alerts: BTreeMap<String, Cases> = BTreeMap::new();
    let mut exprs = String::new();
    for file in files("alerts/tests", "yml")? {
        let text = std::fs::read_to_string(&file)?;
        let mut current = None;
        for line in text.lines().map(str::trim) {
            if let Some(name) = line.strip_prefix("alertname:") {
                current = Some(unquote(name));
            } else if let Some(expected) = line.strip_prefix("exp_alerts:")
                && let Some(name) = current.take()
            {
                let seen = alerts.entry(name).or_default();
                if expected.trim() == "[]" {
                    seen.quiet = true;
                } else {
                    seen.firing = true;
                }
            } else if let Some(expr) = line.strip_prefix("- expr:") {
                exprs.push_str(expr);
                exprs.push('\n');
            }
        }
    }
    Ok((alerts, exprs))
}

#[test]
fn every_rule_is_unit_tested_and_names_only_exported_metrics() -> anyhow::Result<()> {
    let exported = exported_metrics()?;
    let rules = all_rules()?;
    let (tested, tested_exprs) = unit_test_coverage()?;
    let recorded: BTreeSet<&str> = rules
        .iter()
        .filter(|rule| !rule.alert)
        .map(|rule| rule.name.as_str())
        .collect();
    // The autoscaling manifests read this one.
    assert!(
        recorded.contains("service:poolscope_queue_depth:sum"),
        "{recorded:?}"
    );
    let mut problems = Vec::new();
    for rule in &rules {
        let names = metric_names(&rule.expr);
        if names.is_empty() {
            problems.push(format!("{}: no metric in {}", rule.name, rule.expr));
        }
        for name in names {
            // `up` is Prometheus's own, for the scrape-down alert.
            if !exported.contains(&name) && !recorded.contains(name.as_str()) && name != "up" {
                problems.push(format!(
                    "{}: {name} is not exported by poolscope",
                    rule.name
                ));
            }
        }
        if rule.alert {
            match tested.get(&rule.name) {
                Some(Cases {
                    quiet: true,
                    firing: true,
                }) => {}
                Some(Cases { quiet, firing }) => problems.push(format!(
                    "{}: unit tests expect it quiet: {quiet}, firing: {firing}; both needed",
                    rule.name
                )),
                None => problems.push(format!("{}: no unit test", rule.name)),
            }
        } else if !tested_exprs.contains(&rule.name) {
            problems.push(format!("{}: no promql_expr_test uses it", rule.name));
        }
    }
    for name in tested.keys() {
        if !rules.iter().any(|rule| rule.alert && &rule.name == name) {
            problems.push(format!("unit tests check {name}, which no rule defines"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    Ok(())
}

// ------------------------------------------------------------------ dashboards

fn dashboards() -> anyhow::Result<Vec<(String, Value)>> {
    files("dashboards", "json")?
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path)?;
            let json = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", path.display()))?;
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            Ok((name, json))
        })
        .collect()
}

/// Every panel, those inside (collapsed) rows included.
fn panels(board: &Value) -> Vec<&Value> {
    let mut all = Vec::new();
    for panel in board["panels"].as_array().into_iter().flatten() {
        all.push(panel);
        all.extend(panel["panels"].as_array().into_iter().flatten());
    }
    all
}

/// One query of a dashboard: a panel target's or a template variable's.
#[derive(Debug)]
struct Query {
    place: String,
    expr: String,
    legend: String,
}

fn panel_queries(file: &str, board: &Value) -> Vec<Query> {
    let mut queries = Vec::new();
    for panel in panels(board) {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push(Query {
                place: format!(
                    "{file} panel {:?} target {}",
                    panel["title"].as_str().unwrap_or_default(),
                    target["refId"].as_str().unwrap_or_default()
                ),
                expr: target["expr"].as_str().unwrap_or_default().to_owned(),
                legend: target["legendFormat"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            });
        }
    }
    queries
}

/// A query variable's `label_values(selector, label)`, as (selector, label).
fn label_values(query: &str) -> Option<(&str, &str)> {
    let inner = query
        .trim()
        .strip_prefix("label_values(")?
        .strip_suffix(')')?;
    let (selector, label) = inner.rsplit_once(',')?;
    Some((selector.trim(), label.trim()))
}

fn variable_queries(board: &Value) -> Vec<(String, String)> {
    board["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|var| var["type"] == "query")
        .map(|var| {
            let query = var["query"]["query"]
                .as_str()
                .or_else(|| var["query"].as_str())
                .unwrap_or_default();
            (
                var["name"].as_str().unwrap_or_default().to_owned(),
                query.to_owned(),
            )
        })
        .collect()
}

fn all_strings<'a>(value: &'a Value, out: &mut Vec<&'a str>) {
    match value {
        Value::String(text) => out.push(text),
        Value::Array(items) => items.iter().for_each(|item| all_strings(item, out)),
        Value::Object(map) => map.values().for_each(|item| all_strings(item, out)),
        _ => {}
    }
}

fn is_templated_datasource(value: &Value) -> bool {
    value["type"] == "prometheus" && value["uid"] == "${datasource}"
}

/// Everything wrong with one dashboard.
fn dashboard_problems(file: &str, board: &Value, exported: &BTreeSet<String>) -> Vec<String> {
    let mut problems = Vec::new();
    let mut problem = |text: String| problems.push(format!("{file}: {text}"));

    for key in ["title", "uid"] {
        if board[key].as_str().is_none_or(str::is_empty) {
            problem(format!("no {key}"));
        }
    }
    if board["uid"].as_str().is_some_and(|uid| uid.len() > 40) {
        problem("uid longer than Grafana's 40 characters".to_owned());
    }
    if board["schemaVersion"].as_u64().is_none_or(|v| v < 39) {
        problem(format!("schemaVersion {} < 39", board["schemaVersion"]));
    }
    if !board["panels"].is_array() {
        problem("no panels".to_owned());
    }
    if board.get("__inputs").is_some() {
        problem("__inputs: the datasource must be the ${datasource} variable".to_owned());
    }

    // Template variables.
    let Some(vars) = board["templating"]["list"].as_array() else {
        problem("no templating.list".to_owned());
        return problems;
    };
    let mut defined = BTreeSet::new();
    for var in vars {
        let name = var["name"].as_str().unwrap_or_default();
        if !defined.insert(name) {
            problem(format!("variable {name:?} defined twice"));
        }
        match var["type"].as_str() {
            Some("datasource") => {
                if name != "datasource" || var["query"] != "prometheus" {
                    problem(format!("datasource variable {name:?} is not prometheus"));
                }
            }
            Some("query") => {
                if !is_templated_datasource(&var["datasource"]) {
                    problem(format!("variable {name} does not query ${{datasource}}"));
                }
            }
            other => problem(format!("variable {name} of type {other:?}")),
        }
    }
    for required in ["datasource", "instance"] {
        if !defined.contains(required) {
            problem(format!("no {required} variable"));
        }
    }
    for (name, query) in variable_queries(board) {
        match label_values(&query) {
            Some((selector, _)) => {
                for metric in metric_names(selector) {
                    if !exported.contains(&metric) {
                        problem(format!("variable {name}: {metric} is not exported"));
                    }
                }
            }
            None => problem(format!(
                "variable {name}: {query:?} is not label_values(…, …)"
            )),
        }
    }
    let mut strings = Vec::new();
    all_strings(board, &mut strings);
    let mut used = BTreeSet::new();
    for text in strings {
        for (reference, name) in variables(text) {
            if defined.contains(name.as_str()) {
                used.insert(name);
            } else if !BUILTIN_VARIABLES.contains(&name.as_str()) {
                problem(format!("{reference} in {text:?} is not a variable"));
            }
        }
    }
    for name in &defined {
        if *name != "datasource" && !used.contains(*name) {
            problem(format!("variable {name} is never used"));
        }
    }

    // Panels.
    let mut ids = BTreeSet::new();
    let mut cells: BTreeMap<(u64, u64), String> = BTreeMap::new();
    for panel in board["panels"].as_array().into_iter().flatten() {
        let title = panel["title"].as_str().unwrap_or_default();
        let pos = &panel["gridPos"];
        let [Some(h), Some(w), Some(x), Some(y)] =
            ["h", "w", "x", "y"].map(|key| pos[key].as_u64())
        else {
            continue; // reported below, with the rows' panels
        };
        for row in y..y + h {
            for column in x..x + w {
                if let Some(other) = cells.insert((row, column), title.to_owned()) {
                    problem(format!("panels {other:?} and {title:?} overlap"));
                }
            }
        }
    }
    for panel in panels(board) {
        let title = panel["title"].as_str().unwrap_or_default().to_owned();
        match panel["id"].as_u64() {
            Some(id) if !ids.insert(id) => problem(format!("panel id {id} used twice")),
            Some(_) => {}
            None => problem(format!("panel {title:?} has no id")),
        }
        if title.is_empty() {
            problem(format!("panel {} has no title", panel["id"]));
        }
        let pos = &panel["gridPos"];
        match ["h", "w", "x", "y"].map(|key| pos[key].as_u64()) {
            [Some(h), Some(w), Some(x), Some(_)] if h > 0 && w > 0 && x + w <= 24 => {}
            _ => problem(format!("panel {title:?}: bad gridPos {pos}")),
        }
        let kind = panel["type"].as_str().unwrap_or_default();
        if kind == "row" {
            continue;
        }
        if panel["description"].as_str().is_none_or(str::is_empty) {
            problem(format!("panel {title:?} has no description"));
        }
        if !is_templated_datasource(&panel["datasource"]) {
            problem(format!(
                "panel {title:?}: datasource is not ${{datasource}}"
            ));
        }
        if matches!(kind, "timeseries" | "stat") {
            let unit = panel["fieldConfig"]["defaults"]["unit"]
                .as_str()
                .unwrap_or_default();
            if !UNITS.contains(&unit) {
                problem(format!(
                    "panel {title:?}: unit {unit:?} not one of {UNITS:?}"
                ));
            }
        }
        let targets = panel["targets"].as_array().cloned().unwrap_or_default();
        if targets.is_empty() {
            problem(format!("panel {title:?} has no targets"));
        }
        let mut ref_ids = BTreeSet::new();
        for target in &targets {
            let ref_id = target["refId"].as_str().unwrap_or_default();
            if ref_id.is_empty() || !ref_ids.insert(ref_id) {
                problem(format!(
                    "panel {title:?}: refId {ref_id:?} missing or repeated"
                ));
            }
            if !is_templated_datasource(&target["datasource"]) {
                problem(format!(
                    "panel {title:?} {ref_id}: datasource is not ${{datasource}}"
                ));
            }
            let expr = target["expr"].as_str().unwrap_or_default();
            let names = metric_names(expr);
            if names.is_empty() {
                problem(format!("panel {title:?} {ref_id}: no metric in {expr:?}"));
            }
            for name in names {
                if !exported.contains(&name) {
                    problem(format!(
                        "panel {title:?} {ref_id}: {name} is not a metric poolscope exports"
                    ));
                }
            }
        }
    }
    problems
}

#[test]
fn dashboards_are_well_formed_and_name_exported_metrics() -> anyhow::Result<()> {
    let exported = exported_metrics()?;
    let boards = dashboards()?;
    let mut problems = Vec::new();
    let mut uids = BTreeSet::new();
    for (file, board) in &boards {
        problems.extend(dashboard_problems(file, board, &exported));
        if !uids.insert(board["uid"].as_str().unwrap_or_default()) {
            problems.push(format!("{file}: uid {} used twice", board["uid"]));
        }
    }
    let files: BTreeSet<&str> = boards.iter().map(|(file, _)| file.as_str()).collect();
    for required in [
        "poolscope-service.json",
        "poolscope-pool.json",
        "poolscope-exporter.json",
    ] {
        if !files.contains(required) {
            problems.push(format!("no dashboards/{required}"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    Ok(())
}

/// The checks above must be able to fail: a panel naming a metric poolscope does not
/// export, a target with another datasource, an undefined variable and a duplicate id
/// are all reported.
#[test]
fn dashboard_check_catches_what_it_should() -> anyhow::Result<()> {
    let exported = exported_metrics()?;
    let (file, mut board) = dashboards()?.into_iter().next().context("no dashboard")?;
    assert!(dashboard_problems(&file, &board, &exported).is_empty());
    let panels = board["panels"].as_array_mut().context("no panels")?;
    let (index, _) = panels
        .iter()
        .enumerate()
        .find(|(_, panel)| panel["type"] != "row")
        .context("no panel with targets")?;
    let first_id = panels[0]["id"].clone();
    let panel = &mut panels[index];
    panel["targets"][0]["expr"] =
        Value::from("sum(rate(poolscope_renamed_total{service=~\"$nosuchvar\"}[5m]))");
    panel["targets"][0]["datasource"]["uid"] = Value::from("prometheus");
    panel["id"] = first_id;
    let problems = dashboard_problems(&file, &board, &exported).join("\n");
    for expected in [
        "poolscope_renamed_total is not a metric poolscope exports",
        "datasource is not ${datasource}",
        "$nosuchvar",
        "used twice",
    ] {
        assert!(
            problems.contains(expected),
            "{expected:?} not in:\n{problems}"
        );
    }
    Ok(())
}

#[test]
fn promql_lexer_finds_metric_names_only() {
    let expr = "histogram_quantile(0.99, sum by (service, le) (rate(poolscope_a_bucket{le=\"0.5\", \
                x=~\"$x\"}[$__rate_interval]))) / ignoring (component) group_left \
                sum(poolscope_b) and on (instance) max_over_time(poolscope_c[5m] offset 1m) > 1e-3 \
                or sum without (pool) (poolscope_d) * 14.4 unless poolscope_e";
    assert_eq!(
        metric_names(expr),
        [
            "poolscope_a_bucket",
            "poolscope_b",
            "poolscope_c",
            "poolscope_d",
            "poolscope_e"
        ]
    );
    assert_eq!(
        metric_names("service:poolscope_queue_depth:sum > 20"),
        ["service:poolscope_queue_depth:sum"]
    );
}

#[test]
fn template_variables_are_found_and_substituted() -> anyhow::Result<()> {
    let text = "a{i=~\"$instance\", s=~\"${service}\", p=~\"${pool:regex}\", o=\"[[old]]\"}[$__rate_interval]";
    let names: Vec<String> = variables(text).into_iter().map(|(_, name)| name).collect();
    assert_eq!(
        names,
        ["instance", "service", "pool", "old", "__rate_interval"]
    );
    let values: BTreeMap<&str, String> = [
        ("instance", "h:1"),
        ("service", ".+"),
        ("pool", "w"),
        ("old", "o"),
        ("__rate_interval", "10s"),
    ]
    .into_iter()
    .map(|(k, v)| (k, v.to_owned()))
    .collect();
    assert_eq!(
        substitute(text, &values)?,
        "a{i=~\"h:1\", s=~\".+\", p=~\"w\", o=\"o\"}[10s]"
    );
    assert!(substitute("x{a=\"$missing\"}", &values).is_err());
    Ok(())
}

// ------------------------------------------------------------------ live Prometheus

/// The number value of one result sample (`[time, "value"]`).
fn sample_value(series: &Value) -> Option<f64> {
    series["value"][1].as_str().and_then(|v| v.parse().ok())
}

/// Labels a legend format refers to (`{{label}}`).
fn legend_labels(legend: &str) -> Vec<&str> {
    legend
        .split("{{")
        .skip(1)
        .filter_map(|part| part.split("}}").next())
        .map(str::trim)
        .collect()
}

/// Runs one dashboard query: it must return series, at least one with a finite value,
/// each carrying the labels its legend shows.
fn check_panel_query(prometheus: &Prometheus, query: &Query, expr: &str) -> anyhow::Result<()> {
    let (kind, result) = prometheus.query(expr)?;
    ensure!(
        kind == "vector",
        "{}: {kind} result for {expr}",
        query.place
    );
    let series = result.as_array().cloned().unwrap_or_default();
    ensure!(!series.is_empty(), "{}: no data for {expr}", query.place);
    ensure!(
        series.iter().filter_map(sample_value).any(f64::is_finite),
        "{}: only NaN/Inf for {expr}: {result}",
        query.place
    );
    for label in legend_labels(&query.legend) {
        ensure!(
            series.iter().all(|s| s["metric"].get(label).is_some()),
            "{}: legend {:?} shows {label}, which {expr} does not return: {result}",
            query.place,
            query.legend
        );
    }
    Ok(())
}

/// The one float a query returns, if it returns one series.
fn one_value(prometheus: &Prometheus, expr: &str) -> anyhow::Result<f64> {
    let (_, result) = prometheus.query(expr)?;
    match result.as_array().map(Vec::as_slice) {
        Some([series]) => sample_value(series).with_context(|| format!("{expr}: {series}")),
        _ => bail!("{expr}: not one series: {result}"),
    }
}

/// Native histograms (issue 29): a Prometheus with native histograms on asks for the
/// protobuf exposition and stores each request histogram as one series; its
/// `histogram_quantile` agrees with the window quantiles (one native bucket per fine
/// bucket: within 4.5 %) and with a classic Prometheus' quantile over the classic
/// buckets (the same classic bucket) on the same requests, whose count all three
/// have exactly. A poolscope with `[metrics] native_histograms = false` scraped by the
/// same native Prometheus gives it the classic buckets (what the shipped rules read).
#[test]
fn native_histograms_in_a_real_prometheus_agree_with_the_classic_buckets_and_the_window()
-> anyhow::Result<()> {
    if !privileged(
        "native_histograms_in_a_real_prometheus_agree_with_the_classic_buckets_and_the_window",
    ) {
        return Ok(());
    }
    let _serial = one_at_a_time();
    // 2 workers of 5 ms, 4 keep-alive clients: latencies of ~10 ms, half of it queued.
    let pooled = PoolServer::start(2, Duration::from_millis(5))?;
    let config = format!(
        "[discovery]\nrescan_interval = \"500ms\"\n\
         [[targets]]\nservice = \"pooled\"\npids = [{}]\n",
        pooled.pid()
    );
    let poolscope = Poolscope::start(&config)?;
    let classic_only = Poolscope::start(&format!(
        "[discovery]\nrescan_interval = \"500ms\"\n[metrics]\nnative_histograms = false\n\
         [[targets]]\nservice = \"pooled_classic\"\npids = [{}]\n",
        pooled.pid()
    ))?;
    // Watched (and its window's first reading, empty, taken) before any request: the
    // window then holds every request of the test (it is shorter than 60 s).
    scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", "pooled")]) == Some(1.0)
    })?;
    scrape_until(&classic_only, |m| {
        m.value("poolscope_targets", &[("service", "pooled_classic")]) == Some(1.0)
    })?;
    let instance = [format!("127.0.0.1:{}", poolscope.port)];
    let both = [
        instance[0].clone(),
        format!("127.0.0.1:{}", classic_only.port),
    ];
    let native = Prometheus::start_with_features("poolscope", &both, &[], &["native-histograms"])?;
    let classic = Prometheus::start("poolscope", &instance, &[])?;
    let clients = ClosedLoop::start(pooled.port, 4, Connections::KeepAlive);
    std::thread::sleep(Duration::from_secs(8));
    let made = clients.stop()?;
    let settled = scrape_until(&poolscope, |m| {
        requests_settled(m, "pooled", made.completed)
    })?;
    ensure!(
        settled.value("poolscope_requests_total", &[("service", "pooled")])
            == Some(made.completed as f64),
        "poolscope counted other than the {} requests made",
        made.completed
    );
    let counts = |prometheus: &Prometheus, expr: &str| one_value(prometheus, expr).ok();
    let native_count = "histogram_count(poolscope_request_latency_seconds{service=\"pooled\"})";
    let classic_count = "poolscope_request_latency_seconds_count{service=\"pooled\"}";
    let opted_out_count = "poolscope_request_latency_seconds_count{service=\"pooled_classic\"}";
    let scraped = wait_until(Duration::from_secs(15), || {
        counts(&native, native_count) == Some(made.completed as f64)
            && counts(&classic, classic_count) == Some(made.completed as f64)
            && counts(&native, opted_out_count) == Some(made.completed as f64)
    });
    ensure!(
        scraped,
        "the Prometheus servers did not count the {} requests: native {:?} ({}), classic {:?} ({})",
        made.completed,
        counts(&native, native_count),
        native.log(),
        counts(&classic, classic_count),
        classic.log()
    );

    // One series per histogram: no classic buckets in the native Prometheus, and the
    // rest of the series the same.
    let (_, buckets) =
        native.query("poolscope_request_latency_seconds_bucket{service=\"pooled\"}")?;
    ensure!(
        buckets.as_array().is_some_and(Vec::is_empty),
        "classic buckets stored: {buckets}"
    );
    // Opted out: classic buckets, no native histogram, in the same Prometheus.
    let opted_out_buckets = one_value(
        &native,
        "count(poolscope_request_latency_seconds_bucket{service=\"pooled_classic\"})",
    )?;
    let (_, opted_out_native) = native
        .query("histogram_count(poolscope_request_latency_seconds{service=\"pooled_classic\"})")?;
    ensure!(
        opted_out_buckets >= 9.0 && opted_out_native.as_array().is_some_and(Vec::is_empty),
        "native_histograms = false: {opted_out_buckets} buckets, native {opted_out_native}"
    );
    let series = "count({__name__=~\"poolscope_.+\", service=\"pooled\"})";
    let (native_series, classic_series) =
        (one_value(&native, series)?, one_value(&classic, series)?);
    let classic_buckets = one_value(
        &classic,
        "count(poolscope_request_latency_seconds_bucket{service=\"pooled\"})",
    )?;
    // Each of the three request histograms: its buckets, _sum and _count against one.
    assert_eq!(
        classic_series - native_series,
        3.0 * (classic_buckets + 1.0),
        "series of the service: classic {classic_series}, native {native_series}"
    );

    let (_, bucket_series) =
        classic.query("poolscope_request_latency_seconds_bucket{service=\"pooled\"}")?;
    let mut bounds: Vec<(f64, f64)> = bucket_series
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|series| {
            let le = series["metric"]["le"].as_str()?.parse().ok()?;
            Some((le, sample_value(series)?))
        })
        .collect();
    bounds.sort_by(|a, b| a.0.total_cmp(&b.0));
    eprintln!(
        "{} requests (client p50 {:?}, p99 {:?}); series of the service: classic \
         {classic_series}, native {native_series}",
        made.completed,
        made.quantile(0.5),
        made.quantile(0.99)
    );
    for q in [0.5, 0.9, 0.99] {
        let window = one_value(
            &classic,
            &format!(
                "poolscope_request_latency_window_seconds{{service=\"pooled\",quantile=\"{q}\"}}"
            ),
        )?;
        let native_q = one_value(
            &native,
            &format!(
                "histogram_quantile({q}, poolscope_request_latency_seconds{{service=\"pooled\"}})"
            ),
        )?;
        let classic_q = one_value(
            &classic,
            &format!(
                "histogram_quantile({q}, poolscope_request_latency_seconds_bucket{{service=\"pooled\"}})"
            ),
        )?;
        // The classic bucket the rank falls in.
        let rank = q * made.completed as f64;
        let upper_at = bounds
            .iter()
            .position(|&(_, cumulative)| cumulative >= rank)
            .with_context(|| format!("no bucket reaches rank {rank}: {bounds:?}"))?;
        let lower = upper_at.checked_sub(1).map_or(0.0, |at| bounds[at].0);
        let upper = bounds[upper_at].0;
        eprintln!(
            "q{q}: window {window:.6} s, native {native_q:.6} s, classic {classic_q:.6} s \
             in ({lower}, {upper}]"
        );
        ensure!(
            (native_q / window - 1.0).abs() <= 0.045,
            "q{q}: native {native_q} against the window's {window}"
        );
        ensure!(
            (lower..=upper).contains(&window) && (lower..=upper).contains(&classic_q),
            "q{q}: window {window} or classic {classic_q} outside ({lower}, {upper}]"
        );
        ensure!(
            lower / 1.045 <= native_q && native_q <= upper * 1.045,
            "q{q}: native {native_q} outside the classic bucket ({lower}, {upper}]"
        );
    }
    Ok(())
}

/// Successful scrapes of the job over the last minute.
fn scrapes(prometheus: &Prometheus) -> f64 {
    prometheus
        .query("sum(sum_over_time(up{job=\"poolscope\"}[1m]))")
        .ok()
        .and_then(|(_, result)| result.get(0).and_then(sample_value))
        .unwrap_or(0.0)
}

/// The statuses `answering` is asked for, in turn.
const ONE_IN_TEN_FAILS: &[u16] = &[200, 200, 200, 200, 200, 200, 200, 200, 200, 503];

#[test]
fn dashboards_and_rules_run_against_a_real_prometheus() -> anyhow::Result<()> {
    if !privileged("dashboards_and_rules_run_against_a_real_prometheus") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let started = Instant::now();

    // Three services that give every panel something to show: `pooled`, a pool of 2
    // workers with 4 keep-alive clients (a queue of 2, sleeps while serving, run-queue
    // waits), `locked`, 3 workers contending one mutex (lock waits, CPU), and
    // `calling`, 2 Python workers that call a 10 ms backend (downstream waits), and
    // `answering`, an HTTP/1.1 server answering one request in ten with a 503 (status
    // classes, the 5xx share), `grpc`, a gRPC server whose calls fail now and then
    // (grpc_status, the gRPC share not OK), and `shop.checkout.checkout`, a pod
    // container the kubelet's log links name (the namespace and workload pickers).
    let mounts = cgroup_mounts()?;
    // Dropped after the servers (declared before them): the cgroup is empty then.
    let mut cgroups = Cgroups::default();
    let pod_path = systemd_driver_path("burstable", 21, "cri-containerd-");
    let pod_dir = cgroups.make(&mounts.unified, &pod_path)?;
    let pod_logs = tempfile::tempdir()?;
    log_link(
        pod_logs.path(),
        "checkout-7d9f8c6b5-x2k4q",
        "shop",
        "checkout",
        &container_id(21),
    )?;
    let checkout = PoolServer::start(2, Duration::from_millis(5))?;
    move_into(&pod_dir, checkout.pid())?;
    let pooled = PoolServer::start(2, Duration::from_millis(5))?;
    let mut locked = Program::start("lockserver", &["3".to_owned(), "2000".to_owned()])?;
    let locked_port: u16 = locked.line("port")?.parse()?;
    parse_tids(&locked.line("workers")?)?;
    let backend = Backend::start(10)?;
    let mut calling = downstream::start(Kind::Python, 2, backend.port, None)?;
    let calling_port: u16 = calling.line("port")?.parse()?;
    let answering = StatusServer::start()?;
    let grpc = GrpcServer::start(2)?;
    let config = format!(
        "[discovery]\nrescan_interval = \"500ms\"\npod_logs_dir = \"{}\"\n\
         [probes]\nbpf_stats = true\nroutes = true\n\
         [[targets]]\npids = [{}]\n\
         [[targets]]\nservice = \"pooled\"\npids = [{}]\n\
         [[targets]]\nservice = \"locked\"\npids = [{}]\n\
         [[targets]]\nservice = \"calling\"\npids = [{}]\n\
         [[targets]]\nservice = \"answering\"\npids = [{}]\n\
         [[targets]]\nservice = \"grpc\"\npids = [{}]\n",
        pod_logs.path().display(),
        checkout.pid(),
        pooled.pid(),
        locked.pid(),
        calling.pid(),
        answering.pid(),
        grpc.pid()
    );
    let poolscope = Poolscope::start(&config)?;
    scrape_until(&poolscope, |m| {
        ["pooled", "locked", "calling", "answering", "grpc", CHECKOUT]
            .iter()
            .all(|service| m.value("poolscope_targets", &[("service", service)]) == Some(1.0))
    })?;
    let pool_clients = ClosedLoop::start(pooled.port, 4, Connections::KeepAlive);
    let checkout_clients = ClosedLoop::start(checkout.port, 2, Connections::KeepAlive);
    let lock_clients = ClosedLoop::start(locked_port, 6, Connections::PerRequest);
    let calling_clients = ClosedLoop::start(calling_port, 2, Connections::PerRequest);
    let answering_client = StatusLoad::start(answering.port, ONE_IN_TEN_FAILS);
    // Longer than the test: killed when dropped.
    let _grpc_calls = GrpcClient::start(grpc.port, "Sleep", 5, 2, Amount::Seconds(600))?;
    let _grpc_failures = GrpcClient::start(grpc.port, "Abort", 0, 1, Amount::Seconds(600))?;

    let instance = format!("127.0.0.1:{}", poolscope.port);
    let rule_files = files("alerts", "yml")?;
    let prometheus = Prometheus::start("poolscope", std::slice::from_ref(&instance), &rule_files)?;
    let scraped = wait_until(Duration::from_secs(40), || {
        scrapes(&prometheus) >= MIN_SCRAPES
    });
    ensure!(
        scraped,
        "fewer than {MIN_SCRAPES} scrapes in 40 s ({}):\n{}",
        scrapes(&prometheus),
        prometheus.log()
    );

    // The scrape is up and clean.
    let targets = prometheus.api("/api/v1/targets")?;
    let target = targets["activeTargets"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| t["labels"]["job"] == "poolscope")
        .with_context(|| format!("no poolscope target: {targets}"))?;
    assert_eq!(target["health"], "up", "{target}");
    assert_eq!(target["lastError"], "", "{target}");
    assert_eq!(target["labels"]["instance"], instance.as_str(), "{target}");

    // Every rule of the files is loaded, has been evaluated and is healthy.
    let file_rules = all_rules()?;
    let loaded = || -> anyhow::Result<Vec<Value>> {
        let data = prometheus.api("/api/v1/rules")?;
        Ok(data["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|group| group["rules"].as_array().cloned().unwrap_or_default())
            .collect())
    };
    let evaluated = wait_until(Duration::from_secs(10), || {
        loaded().is_ok_and(|rules| rules.iter().all(|rule| rule["health"] != "unknown"))
    });
    let rules = loaded()?;
    ensure!(evaluated, "rules not evaluated within 10 s: {rules:?}");
    let mut loaded_names: Vec<&str> = rules.iter().filter_map(|r| r["name"].as_str()).collect();
    let mut file_names: Vec<&str> = file_rules.iter().map(|r| r.name.as_str()).collect();
    loaded_names.sort_unstable();
    file_names.sort_unstable();
    assert_eq!(loaded_names, file_names, "rules loaded vs in alerts/");
    let unhealthy: Vec<&Value> = rules
        .iter()
        .filter(|rule| {
            rule["health"] != "ok" || rule["lastError"].as_str().is_some_and(|e| !e.is_empty())
        })
        .collect();
    assert!(unhealthy.is_empty(), "unhealthy rules: {unhealthy:#?}");

    let mut problems = Vec::new();
    // Every rule expression, as Prometheus parsed it, evaluates; recording rules also
    // return data here (e.g. the SLO's le="0.268435456" bucket is one poolscope
    // writes). Alert expressions need not: they select only what is wrong.
    for rule in &rules {
        let name = rule["name"].as_str().unwrap_or_default();
        let expr = rule["query"].as_str().unwrap_or_default();
        match prometheus.query(expr) {
            Err(error) => problems.push(format!("rule {name}: {error:#}")),
            Ok((_, result))
                if rule["type"] == "recording" && result.as_array().is_none_or(Vec::is_empty) =>
            {
                problems.push(format!("recording rule {name}: no data for {expr}"));
            }
            Ok(_) => {}
        }
    }
    // The autoscaling signal is recorded for both services, with the queue the
    // pooled service has (4 clients, 2 workers: 2 waiting).
    let (_, queue) = prometheus.query(&format!(
        "max_over_time(service:poolscope_queue_depth:sum[{RATE_INTERVAL}])"
    ))?;
    let depth_of = |service: &str| {
        queue
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["metric"]["service"] == service)
            .and_then(sample_value)
    };
    assert!(depth_of("locked").is_some(), "{queue}");
    assert!(
        depth_of("pooled").is_some_and(|depth| (1.0..=4.0).contains(&depth)),
        "pooled queue depth: {queue}"
    );

    // Every dashboard query, with the variables Grafana would fill in ("All" for the
    // label variables).
    let values: BTreeMap<&str, String> = [
        ("__rate_interval", RATE_INTERVAL),
        ("__interval", "1s"),
        ("__interval_ms", "1000"),
        ("__range", "1m"),
        ("instance", instance.as_str()),
        ("namespace", ".*"),
        ("workload", ".*"),
        ("service", ".+"),
        ("pool", ".+"),
    ]
    .into_iter()
    .map(|(name, value)| (name, value.to_owned()))
    .collect();
    let mut panel_count = 0;
    let mut variable_count = 0;
    for (file, board) in dashboards()? {
        for query in panel_queries(&file, &board) {
            panel_count += 1;
            let checked = substitute(&query.expr, &values)
                .and_then(|expr| check_panel_query(&prometheus, &query, &expr));
            if let Err(error) = checked {
                problems.push(format!("{error:#}"));
            }
        }
        // A variable's values: label_values(selector, label) has values iff
        // count by (label) (selector) has series.
        for (name, query) in variable_queries(&board) {
            variable_count += 1;
            let Some((selector, label)) = label_values(&query) else {
                problems.push(format!("{file} variable {name}: {query}"));
                continue;
            };
            let checked = substitute(selector, &values).and_then(|selector| {
                let as_query = Query {
                    place: format!("{file} variable {name}"),
                    expr: query.clone(),
                    legend: format!("{{{{{label}}}}}"),
                };
                check_panel_query(
                    &prometheus,
                    &as_query,
                    &format!("count by ({label}) ({selector})"),
                )
            });
            if let Err(error) = checked {
                problems.push(format!("{error:#}"));
            }
        }
        // Picking the pod's namespace and workload leaves its service alone.
        for (name, query) in variable_queries(&board) {
            let (Some((selector, label)), "service") = (label_values(&query), name.as_str()) else {
                continue;
            };
            let mut picked = values.clone();
            picked.insert("namespace", "shop".to_owned());
            picked.insert("workload", "checkout".to_owned());
            let (_, result) = prometheus.query(&format!(
                "count by ({label}) ({})",
                substitute(selector, &picked)?
            ))?;
            let listed: Vec<&str> = result
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|series| series["metric"]["service"].as_str())
                .collect();
            if listed != [CHECKOUT] {
                problems.push(format!(
                    "{file}: namespace shop, workload checkout list services {listed:?}"
                ));
            }
        }
    }

    let checkout_load = checkout_clients.stop()?;
    ensure!(checkout_load.completed > 0, "no load on {CHECKOUT}");
    let pool_load = pool_clients.stop()?;
    let lock_load = lock_clients.stop()?;
    let calling_load = calling_clients.stop()?;
    let answered = answering_client.stop()?;
    answering.finish()?;
    assert!(
        pool_load.completed > 0
            && lock_load.completed > 0
            && calling_load.completed > 0
            && answered[4] > 0,
        "no load: {} pooled, {} locked, {} calling requests, {answered:?} answered",
        pool_load.completed,
        lock_load.completed,
        calling_load.completed
    );
    eprintln!(
        "evaluated {} rule expressions, {panel_count} panel queries and {variable_count} \
         variable queries against Prometheus in {:.1} s ({} problems)",
        rules.len(),
        started.elapsed().as_secs_f64(),
        problems.len()
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    Ok(())
}
