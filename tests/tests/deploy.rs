//! The operators' kit outside the exporter, checked without root: the systemd unit
//! (`systemd-analyze verify` and `security`), the Kubernetes and autoscaling manifests
//! of deploy/ (kubernetes-validate against the Kubernetes schemas, a structural check
//! of the two custom resources, how the objects reference each other), that the unit
//! and the DaemonSet grant the same capabilities, and that the autoscalers read the
//! recording rule alerts/ defines. (tests/tests/privileges.rs runs poolscope under
//! the unit itself.) As root, the container image `cargo xtask image` builds runs
//! with the DaemonSet's settings and the shipped ConfigMap, and measures a real server.
//!
//! A missing tool skips a test with a message, or fails it under CI=true;
//! `cargo xtask setup` installs them all.
use std::{
    collections::{BTreeMap, BTreeSet},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use anyhow::{Context as _, ensure};
use poolscope_tests::{
    Metrics, PoolServer, bin_dir, free_port,
    load::{ClosedLoop, Connections},
    one_at_a_time, privileged,
    profiles::http_get,
    quota::QuotaCgroup,
    skip, wait_until,
};
use serde_json::Value;

/// The exposure `systemd-analyze security` may rate the unit at most: what it rates
/// the unit today (the goal was at most 2.0; docs/install.md's systemd section lists what is left
/// and why; node_exporter's example unit scores 9.2).
const MAX_EXPOSURE: f64 = 1.9;

/// Oldest Kubernetes the manifests are valid for: 1.30 added the container's
/// `appArmorProfile`. The validator's newest bundled version is checked too.
const OLDEST_KUBERNETES: &str = "1.30.0";

const UNIT: &str = "systemd/poolscope.service";
const PROMTOOL: &str = "/usr/bin/promtool";
const RECORDING_RULES: &str = "alerts/poolscope-rules.yml";
const QUEUE_DEPTH_RULE: &str = "service:poolscope_queue_depth:sum";

fn workspace() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// `path` when it is there; otherwise says why the test skips, or fails under CI=true.
fn tool(test: &str, path: PathBuf) -> Option<PathBuf> {
    if path.is_file() {
        return Some(path);
    }
    skip(
        test,
        &format!("{} is missing (cargo xtask setup)", path.display()),
    );
    None
}

fn on_path(test: &str, name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let found = std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file());
    tool(test, found.unwrap_or_else(|| PathBuf::from(name)))
}

/// The venv `cargo xtask setup` installs kubernetes-validate into (its python has
/// PyYAML, which reads the manifests here).
fn validator_venv() -> PathBuf {
    workspace().join("target/tools/kubernetes-validate/bin")
}

fn run(command: &mut Command) -> anyhow::Result<Output> {
    command
        .output()
        .with_context(|| format!("running {command:?}"))
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Every document of a YAML file, as JSON values (PyYAML from the validator's venv).
fn yaml_documents(python: &Path, file: &Path) -> anyhow::Result<Vec<Value>> {
    yaml_documents_of(python, &std::fs::read_to_string(file)?)
        .with_context(|| format!("parsing {}", file.display()))
}

fn yaml_documents_of(python: &Path, yaml: &str) -> anyhow::Result<Vec<Value>> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("in.yaml");
    std::fs::write(&file, yaml)?;
    let output = run(Command::new(python)
        .arg("-c")
        .arg(
            "import json, sys, yaml\n\
         docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]\n\
         json.dump(docs, sys.stdout)",
        )
        .arg(&file))?;
    ensure!(output.status.success(), "PyYAML: {}", text(&output));
    Ok(serde_json::from_slice(&output.stdout)?)
}

/// The YAML files under `dir`, sorted.
fn yaml_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// Every document of deploy/<sub>/, with the file it came from.
fn manifests(python: &Path, sub: &str) -> anyhow::Result<Vec<(PathBuf, Value)>> {
    let mut all = Vec::new();
    for file in yaml_files(&workspace().join("deploy").join(sub))? {
        for document in yaml_documents(python, &file)? {
            all.push((file.clone(), document));
        }
    }
    ensure!(!all.is_empty(), "no manifests in deploy/{sub}");
    Ok(all)
}

/// The one document of `kind` (several, or none, is an error).
fn one<'a>(documents: &'a [(PathBuf, Value)], kind: &str) -> anyhow::Result<&'a Value> {
    let mut found = documents.iter().filter(|(_, d)| d["kind"] == kind);
    let first = found.next().with_context(|| format!("no {kind}"))?;
    ensure!(found.next().is_none(), "more than one {kind}");
    Ok(&first.1)
}

fn string_map(value: &Value) -> BTreeMap<String, String> {
    value
        .as_object()
        .map(|map| {
            map.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

/// True when every label of `selector` is among `labels` with the same value.
fn selects(selector: &Value, labels: &Value) -> bool {
    let selector = string_map(selector);
    let labels = string_map(labels);
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// A capability list (`CAP_BPF CAP_PERFMON`, or Kubernetes's `BPF`) as a set of
/// upper-case names without the prefix.
fn capability_set<'a>(names: impl IntoIterator<Item = &'a str>) -> BTreeSet<String> {
    names
        .into_iter()
        .map(|name| name.trim().trim_start_matches("CAP_").to_ascii_uppercase())
        .filter(|name| !name.is_empty())
        .collect()
}

/// The values of `key=` in the unit's [Service] lines (all of them, joined).
fn unit_setting(unit: &str, key: &str) -> Vec<String> {
    unit.lines()
        .filter_map(|line| line.trim().strip_prefix(key)?.strip_prefix('='))
        .flat_map(|value| value.split_whitespace().map(str::to_owned))
        .collect()
}

#[test]
fn the_unit_passes_systemd_analyze_verify() -> anyhow::Result<()> {
    let test = "the_unit_passes_systemd_analyze_verify";
    let Some(analyze) = on_path(test, "systemd-analyze") else {
        return Ok(());
    };
    let unit = std::fs::read_to_string(workspace().join(UNIT))?;
    // verify insists that the unit's commands exist and that the units it depends on
    // are found: an alternate root with the host's unit library, the unit itself, and
    // a stand-in executable at every path the unit runs (what they do is not verify's
    // business).
    let root = tempfile::tempdir()?;
    let units = Path::new("/usr/lib/systemd/system");
    copy_tree(units, &root.path().join(units.strip_prefix("/")?))?;
    let installed = root.path().join("etc/systemd/system/poolscope.service");
    std::fs::create_dir_all(installed.parent().context("no parent")?)?;
    std::fs::write(&installed, &unit)?;
    let commands: Vec<&str> = unit
        .lines()
        .filter(|line| line.starts_with("Exec"))
        .filter_map(|line| line.split_once('=')?.1.split_whitespace().next())
        .map(|command| command.trim_start_matches(['@', '-', ':', '+', '!']))
        .collect();
    ensure!(
        commands.iter().any(|c| c.ends_with("/poolscope")),
        "no ExecStart of poolscope in the unit: {commands:?}"
    );
    for command in commands {
        let stand_in = root.path().join(command.trim_start_matches('/'));
        std::fs::create_dir_all(stand_in.parent().context("no parent")?)?;
        std::fs::write(&stand_in, "#!/bin/sh\n")?;
        std::fs::set_permissions(&stand_in, std::fs::Permissions::from_mode(0o755))?;
    }
    let output = run(Command::new(analyze)
        .arg("verify")
        .arg(format!("--root={}", root.path().display()))
        .arg("/etc/systemd/system/poolscope.service"))?;
    // verify exits 0 on unknown keys and bad values, which it only prints: any output
    // is a failure.
    let said = text(&output);
    assert!(
        output.status.success() && said.trim().is_empty(),
        "systemd-analyze verify ({}):\n{said}",
        output.status
    );
    Ok(())
}

/// Copies a directory of unit files, symlinks as symlinks.
fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        let kind = entry.file_type()?;
        if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(entry.path())?, &target)?;
        } else if kind.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

#[test]
fn the_units_security_exposure_is_at_most_2_1() -> anyhow::Result<()> {
    let test = "the_units_security_exposure_is_at_most_2_1";
    let Some(analyze) = on_path(test, "systemd-analyze") else {
        return Ok(());
    };
    let output = run(Command::new(analyze)
        .args(["security", "--offline=yes", "--no-pager"])
        .arg(workspace().join(UNIT)))?;
    let said = text(&output);
    ensure!(output.status.success(), "systemd-analyze security:\n{said}");
    let exposure: f64 = said
        .lines()
        .find_map(|line| {
            line.split_once("Overall exposure level for poolscope.service:")?
                .1
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .with_context(|| format!("no overall exposure in:\n{said}"))?;
    let remaining: Vec<&str> = said.lines().filter(|l| l.starts_with('✗')).collect();
    eprintln!(
        "exposure {exposure}; what is left:\n{}",
        remaining.join("\n")
    );
    assert!(
        exposure <= MAX_EXPOSURE,
        "exposure {exposure} > {MAX_EXPOSURE}:\n{said}"
    );
    Ok(())
}

#[test]
fn the_daemonset_grants_the_units_capabilities() -> anyhow::Result<()> {
    let test = "the_daemonset_grants_the_units_capabilities";
    let Some(python) = tool(test, validator_venv().join("python")) else {
        return Ok(());
    };
    let unit = std::fs::read_to_string(workspace().join(UNIT))?;
    let ambient = unit_setting(&unit, "AmbientCapabilities");
    let ambient = capability_set(ambient.iter().map(String::as_str));
    let bounding = unit_setting(&unit, "CapabilityBoundingSet");
    let bounding = capability_set(bounding.iter().map(String::as_str));
    ensure!(!ambient.is_empty(), "no AmbientCapabilities in the unit");
    // The bounding set is what the unit's processes could ever get: nothing beyond
    // what it is given.
    assert_eq!(ambient, bounding, "the unit's ambient and bounding sets");

    let documents = manifests(&python, "kubernetes")?;
    let daemonset = one(&documents, "DaemonSet")?;
    let containers = daemonset["spec"]["template"]["spec"]["containers"]
        .as_array()
        .context("no containers")?;
    ensure!(!containers.is_empty(), "no containers");
    for container in containers {
        let capabilities = &container["securityContext"]["capabilities"];
        let names = |list: &Value| -> Vec<String> {
            list.as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        };
        let drop = names(&capabilities["drop"]);
        assert_eq!(drop, ["ALL"], "{}: capabilities.drop", container["name"]);
        let add = names(&capabilities["add"]);
        let add = capability_set(add.iter().map(String::as_str));
        assert_eq!(
            add, ambient,
            "{}: the DaemonSet's capabilities differ from systemd/poolscope.service's",
            container["name"]
        );
    }
    Ok(())
}

/// What kubernetes-validate said about each file, for `version` (None: its newest).
fn validate(validator: &Path, file: &Path, version: Option<&str>) -> anyhow::Result<String> {
    let mut command = Command::new(validator);
    command.arg("--strict");
    if let Some(version) = version {
        command.args(["--kubernetes-version", version]);
    }
    let output = run(command.arg(file))?;
    let said = text(&output);
    ensure!(
        output.status.success(),
        "kubernetes-validate {} ({version:?}):\n{said}",
        file.display()
    );
    Ok(said)
}

#[test]
fn the_manifests_validate() -> anyhow::Result<()> {
    let test = "the_manifests_validate";
    let venv = validator_venv();
    let (Some(validator), Some(python)) = (
        tool(test, venv.join("kubernetes-validate")),
        tool(test, venv.join("python")),
    ) else {
        return Ok(());
    };
    let mut problems = Vec::new();
    let mut checked = 0;
    for sub in ["kubernetes", "autoscaling"] {
        for file in yaml_files(&workspace().join("deploy").join(sub))? {
            let documents = yaml_documents(&python, &file)?;
            let mut said = Vec::new();
            for version in [Some(OLDEST_KUBERNETES), None] {
                said.push((version, validate(&validator, &file, version)?));
            }
            for document in &documents {
                let kind = document["kind"].as_str().unwrap_or_default();
                let name = document["metadata"]["name"].as_str().unwrap_or_default();
                let found = match kind {
                    // Custom resources: the validator's schemas are the core API's only.
                    "ServiceMonitor" => service_monitor_problems(document),
                    "ScaledObject" => scaled_object_problems(&validator, document)?,
                    "PrometheusRule" => prometheus_rule_problems(&python, document)?,
                    _ => said
                        .iter()
                        .filter(|(_, said)| {
                            !said.contains(&format!(
                                "passed for resource {}/{name}",
                                kind.to_ascii_lowercase()
                            ))
                        })
                        .map(|(version, said)| format!("not validated for {version:?}:\n{said}"))
                        .collect(),
                };
                problems.extend(
                    found
                        .into_iter()
                        .map(|p| format!("{} {kind}/{name}: {p}", file.display())),
                );
                checked += 1;
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // At least the 5 documents of kubernetes/, its PrometheusRule and 3 dashboard
    // ConfigMaps, and the 3 of autoscaling/.
    assert!(checked >= 12, "only {checked} documents checked");
    Ok(())
}

/// A `PrometheusRule` (generated by `cargo xtask manifests`): its groups are those of
/// alerts/ (the job matcher aside) and pass `promtool check rules`; the dashboards'
/// ConfigMaps are validated as ConfigMaps, and their JSON compared with dashboards/
/// in `the_dashboard_config_maps_hold_the_dashboards`.
fn prometheus_rule_problems(python: &Path, rule: &Value) -> anyhow::Result<Vec<String>> {
    let mut problems = unknown_keys(rule, &["apiVersion", "kind", "metadata", "spec"], "");
    let shipped = yaml_documents(python, &workspace().join(RECORDING_RULES))?;
    let shipped_groups = shipped.first().map(|rules| &rules["groups"]);
    if shipped_groups != Some(&rule["spec"]["groups"]) {
        problems.push(format!(
            "spec.groups differ from {RECORDING_RULES}'s groups"
        ));
    }
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("rules.json");
    std::fs::write(&file, serde_json::to_vec(&rule["spec"])?)?;
    let output = run(Command::new(PROMTOOL).arg("check").arg("rules").arg(&file))?;
    if !output.status.success() {
        problems.push(format!("promtool check rules: {}", text(&output)));
    }
    Ok(problems)
}

#[test]
fn the_dashboard_config_maps_hold_the_dashboards() -> anyhow::Result<()> {
    let test = "the_dashboard_config_maps_hold_the_dashboards";
    let Some(python) = tool(test, validator_venv().join("python")) else {
        return Ok(());
    };
    let file = workspace().join("deploy/kubernetes/grafana-dashboards.yaml");
    let mut held = BTreeMap::new();
    for map in yaml_documents(&python, &file)? {
        ensure!(
            map["metadata"]["labels"]["grafana_dashboard"] == "1",
            "ConfigMap {} lacks the sidecar's label grafana_dashboard=\"1\"",
            map["metadata"]["name"]
        );
        for (name, json) in map["data"].as_object().into_iter().flatten() {
            let json: Value = serde_json::from_str(json.as_str().unwrap_or_default())
                .with_context(|| format!("{name} in the ConfigMap is not JSON"))?;
            held.insert(name.clone(), json);
        }
    }
    let mut shipped = BTreeMap::new();
    for entry in std::fs::read_dir(workspace().join("dashboards"))? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "json") {
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            let json: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
            shipped.insert(name.unwrap_or_default(), json);
        }
    }
    ensure!(shipped.len() >= 3, "only {} dashboards", shipped.len());
    ensure!(
        held == shipped,
        "the ConfigMaps hold {:?}, dashboards/ has {:?} (or their contents differ): run \
         `cargo xtask manifests`",
        held.keys().collect::<Vec<_>>(),
        shipped.keys().collect::<Vec<_>>()
    );
    Ok(())
}

fn unknown_keys(value: &Value, known: &[&str], at: &str) -> Vec<String> {
    value
        .as_object()
        .into_iter()
        .flat_map(|map| map.keys())
        .filter(|key| !known.contains(&key.as_str()))
        .map(|key| format!("{at}: unknown field {key:?}"))
        .collect()
}

/// The CRD's Duration pattern (monitoring.coreos.com/v1): `0`, or numbers with the
/// units y, w, d, h, m, s, ms, each at most once and in that order (`1m30s`, `500ms`).
fn is_duration(text: &str) -> bool {
    const UNITS: [&str; 7] = ["y", "w", "d", "h", "m", "s", "ms"];
    if text == "0" {
        return true;
    }
    let mut rest = text;
    let mut next = 0;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let after = &rest[digits..];
        // The longest unit that fits, so that `ms` is not read as `m`.
        let Some((index, unit)) = UNITS
            .iter()
            .enumerate()
            .skip(next)
            .filter(|(_, unit)| after.starts_with(**unit))
            .max_by_key(|(_, unit)| unit.len())
        else {
            return false;
        };
        if digits == 0 {
            return false;
        }
        rest = &after[unit.len()..];
        next = index + 1;
    }
    !text.is_empty()
}

/// A structural check of a ServiceMonitor against the fields of the Prometheus
/// Operator's CRD that this repository uses (a strict subset: unknown fields fail).
fn service_monitor_problems(monitor: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    if monitor["apiVersion"] != "monitoring.coreos.com/v1" {
        problems.push(format!("apiVersion {}", monitor["apiVersion"]));
    }
    let spec = &monitor["spec"];
    problems.extend(unknown_keys(
        spec,
        &[
            "selector",
            "namespaceSelector",
            "endpoints",
            "jobLabel",
            "targetLabels",
            "podTargetLabels",
            "sampleLimit",
        ],
        "spec",
    ));
    if string_map(&spec["selector"]["matchLabels"]).is_empty() {
        problems.push("spec.selector.matchLabels is empty".to_owned());
    }
    let endpoints = spec["endpoints"].as_array().cloned().unwrap_or_default();
    if endpoints.is_empty() {
        problems.push("spec.endpoints is empty".to_owned());
    }
    for (index, endpoint) in endpoints.iter().enumerate() {
        let at = format!("spec.endpoints[{index}]");
        problems.extend(unknown_keys(
            endpoint,
            &[
                "port",
                "path",
                "scheme",
                "interval",
                "scrapeTimeout",
                "honorLabels",
                "relabelings",
                "metricRelabelings",
            ],
            &at,
        ));
        if !endpoint["port"].is_string() {
            problems.push(format!("{at}.port is not a port name"));
        }
        for key in ["interval", "scrapeTimeout"] {
            if let Some(value) = endpoint.get(key)
                && !value.as_str().is_some_and(is_duration)
            {
                problems.push(format!("{at}.{key} {value} is not a duration"));
            }
        }
        if endpoint.get("honorLabels").is_some_and(|v| !v.is_boolean()) {
            problems.push(format!("{at}.honorLabels is not a boolean"));
        }
        for (r, relabeling) in endpoint["relabelings"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let at = format!("{at}.relabelings[{r}]");
            problems.extend(unknown_keys(
                relabeling,
                &[
                    "sourceLabels",
                    "targetLabel",
                    "regex",
                    "replacement",
                    "action",
                    "separator",
                    "modulus",
                ],
                &at,
            ));
            let labels = relabeling["sourceLabels"].as_array();
            if !labels.is_some_and(|l| !l.is_empty() && l.iter().all(Value::is_string)) {
                problems.push(format!("{at}.sourceLabels is not a list of labels"));
            }
        }
    }
    problems
}

/// A structural check of a KEDA ScaledObject against the fields of KEDA's CRD that
/// this repository uses; its HPA behaviour is validated as the autoscaling/v2 type it
/// is, with the real schema.
fn scaled_object_problems(validator: &Path, scaled: &Value) -> anyhow::Result<Vec<String>> {
    let mut problems = Vec::new();
    if scaled["apiVersion"] != "keda.sh/v1alpha1" {
        problems.push(format!("apiVersion {}", scaled["apiVersion"]));
    }
    let spec = &scaled["spec"];
    problems.extend(unknown_keys(
        spec,
        &[
            "scaleTargetRef",
            "minReplicaCount",
            "maxReplicaCount",
            "pollingInterval",
            "cooldownPeriod",
            "idleReplicaCount",
            "advanced",
            "fallback",
            "triggers",
        ],
        "spec",
    ));
    problems.extend(unknown_keys(
        &spec["scaleTargetRef"],
        &["apiVersion", "kind", "name", "envSourceContainerName"],
        "spec.scaleTargetRef",
    ));
    if !spec["scaleTargetRef"]["name"].is_string() {
        problems.push("spec.scaleTargetRef.name is missing".to_owned());
    }
    let min = spec["minReplicaCount"].as_u64();
    let max = spec["maxReplicaCount"].as_u64();
    match (min, max) {
        (Some(min), Some(max)) if 1 <= min && min <= max => {}
        _ => problems.push(format!("replica counts {min:?}..{max:?}")),
    }
    if spec
        .get("pollingInterval")
        .is_some_and(|v| v.as_u64().is_none())
    {
        problems.push("spec.pollingInterval is not a number of seconds".to_owned());
    }
    problems.extend(unknown_keys(
        &spec["advanced"],
        &[
            "horizontalPodAutoscalerConfig",
            "restoreToOriginalReplicaCount",
        ],
        "spec.advanced",
    ));
    let behavior = &spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"];
    if !behavior.is_null() {
        problems.extend(hpa_behavior_problems(validator, behavior)?);
    }
    let triggers = spec["triggers"].as_array().cloned().unwrap_or_default();
    if triggers.is_empty() {
        problems.push("spec.triggers is empty".to_owned());
    }
    for (index, trigger) in triggers.iter().enumerate() {
        let at = format!("spec.triggers[{index}]");
        problems.extend(unknown_keys(
            trigger,
            &[
                "type",
                "name",
                "metricType",
                "metadata",
                "authenticationRef",
                "useCachedMetrics",
            ],
            &at,
        ));
        if !["AverageValue", "Value", "Utilization"]
            .contains(&trigger["metricType"].as_str().unwrap_or("AverageValue"))
        {
            problems.push(format!("{at}.metricType {}", trigger["metricType"]));
        }
        // The CRD types metadata as a map of strings: a bare number is refused.
        let metadata = trigger["metadata"].as_object().cloned().unwrap_or_default();
        for (key, value) in &metadata {
            if !value.is_string() {
                problems.push(format!("{at}.metadata.{key} is not a string: {value}"));
            }
        }
        if trigger["type"] == "prometheus" {
            for key in ["serverAddress", "query", "threshold"] {
                if !metadata.contains_key(key) {
                    problems.push(format!("{at}.metadata.{key} is missing"));
                }
            }
            let threshold = metadata.get("threshold").and_then(Value::as_str);
            if !threshold
                .and_then(|t| t.parse::<f64>().ok())
                .is_some_and(|t| t > 0.0)
            {
                problems.push(format!("{at}.metadata.threshold {threshold:?}"));
            }
        }
    }
    Ok(problems)
}

/// Validates an HPA `behavior` with kubernetes-validate, inside a minimal HPA.
fn hpa_behavior_problems(validator: &Path, behavior: &Value) -> anyhow::Result<Vec<String>> {
    let hpa = serde_json::json!({
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "behavior"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "x"},
            "maxReplicas": 2,
            "behavior": behavior,
        },
    });
    let dir = tempfile::tempdir()?;
    // JSON is YAML.
    let file = dir.path().join("behavior.yaml");
    std::fs::write(&file, hpa.to_string())?;
    let mut command = Command::new(validator);
    let output = run(command.arg("--strict").arg(&file))?;
    Ok(if output.status.success() {
        Vec::new()
    } else {
        vec![format!("HPA behavior: {}", text(&output))]
    })
}

#[test]
fn the_kubernetes_objects_fit_together() -> anyhow::Result<()> {
    let test = "the_kubernetes_objects_fit_together";
    let Some(python) = tool(test, validator_venv().join("python")) else {
        return Ok(());
    };
    let documents = manifests(&python, "kubernetes")?;
    let namespace = one(&documents, "Namespace")?["metadata"]["name"]
        .as_str()
        .context("namespace without name")?;
    for (file, document) in &documents {
        if document["kind"] != "Namespace" {
            assert_eq!(
                document["metadata"]["namespace"],
                namespace,
                "{}: not in namespace {namespace}",
                file.display()
            );
        }
    }
    let daemonset = one(&documents, "DaemonSet")?;
    let service = one(&documents, "Service")?;
    let monitor = one(&documents, "ServiceMonitor")?;
    // poolscope's configuration: the ConfigMap that is not a dashboard.
    let configuration: Vec<(PathBuf, Value)> = documents
        .iter()
        .filter(|(_, d)| d["metadata"]["labels"]["grafana_dashboard"].is_null())
        .cloned()
        .collect();
    let config_map = one(&configuration, "ConfigMap")?;
    let pod = &daemonset["spec"]["template"];
    let pod_labels = &pod["metadata"]["labels"];
    assert!(
        selects(&daemonset["spec"]["selector"]["matchLabels"], pod_labels),
        "the DaemonSet's selector does not select its pods"
    );
    assert!(
        selects(&service["spec"]["selector"], pod_labels),
        "the Service does not select the DaemonSet's pods"
    );
    assert!(
        selects(
            &monitor["spec"]["selector"]["matchLabels"],
            &service["metadata"]["labels"]
        ),
        "the ServiceMonitor does not select the Service"
    );
    let watched: Vec<&Value> = monitor["spec"]["namespaceSelector"]["matchNames"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    assert!(
        watched.iter().any(|n| **n == namespace),
        "the ServiceMonitor does not look in {namespace}: {watched:?}"
    );

    let container = &pod["spec"]["containers"][0];
    let container_ports: BTreeMap<String, u64> = container["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some((p["name"].as_str()?.to_owned(), p["containerPort"].as_u64()?)))
        .collect();
    let service_ports: Vec<&Value> = service["spec"]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .collect();
    for endpoint in monitor["spec"]["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let port = service_ports
            .iter()
            .find(|p| p["name"] == endpoint["port"])
            .with_context(|| format!("the Service has no port {}", endpoint["port"]))?;
        let target = port["targetPort"].as_str().context("targetPort by name")?;
        ensure!(
            container_ports.contains_key(target),
            "the Service's targetPort {target} is no container port: {container_ports:?}"
        );
    }
    for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"], "/healthz", "{probe}");
        let port = get["port"].as_str().unwrap_or_default();
        assert!(container_ports.contains_key(port), "{probe} on port {port}");
    }

    // The config file poolscope is given comes from the ConfigMap.
    let args: Vec<&str> = container["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let config_file = args
        .iter()
        .find_map(|a| a.strip_prefix("--config.file="))
        .context("no --config.file")?;
    let (mount_dir, key) = config_file.rsplit_once('/').context("config path")?;
    let mount = container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["mountPath"] == mount_dir)
        .with_context(|| format!("nothing mounted at {mount_dir}"))?;
    assert_eq!(mount["readOnly"], true, "the config is mounted writable");
    let volume = pod["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == mount["name"])
        .context("the config mount has no volume")?;
    assert_eq!(volume["configMap"]["name"], config_map["metadata"]["name"]);
    let config = config_map["data"][key]
        .as_str()
        .with_context(|| format!("the ConfigMap has no {key}"))?;

    // The listen address the DaemonSet sets serves on the container's port.
    let env: BTreeMap<&str, &str> = container["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| Some((e["name"].as_str()?, e["value"].as_str()?)))
        .collect();
    let listen = env
        .get("POOLSCOPE_WEB__LISTEN_ADDRESS")
        .context("no POOLSCOPE_WEB__LISTEN_ADDRESS")?;
    let listen_port: u64 = listen
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .context("listen address port")?;
    assert!(
        container_ports.values().any(|p| *p == listen_port),
        "poolscope listens on {listen}, the container exposes {container_ports:?}"
    );

    // poolscope itself accepts the ConfigMap's file with the DaemonSet's environment.
    let Some(poolscope) = tool(test, bin_dir()?.join("poolscope")) else {
        return Ok(());
    };
    let dir = tempfile::tempdir()?;
    let file = dir.path().join(key);
    std::fs::write(&file, config)?;
    let output = run(Command::new(poolscope)
        .arg(format!("--config.file={}", file.display()))
        .arg("--config.check")
        .env(
            "POOLSCOPE_WEB__LISTEN_ADDRESS",
            listen.replace("$(HOST_IP)", "127.0.0.1"),
        ))?;
    assert!(
        output.status.success(),
        "poolscope --config.check refuses the ConfigMap: {}",
        text(&output)
    );
    Ok(())
}

#[test]
fn the_autoscalers_read_the_queue_depth_rule() -> anyhow::Result<()> {
    let test = "the_autoscalers_read_the_queue_depth_rule";
    let Some(python) = tool(test, validator_venv().join("python")) else {
        return Ok(());
    };
    // The rule is alerts/'s: renaming it there must fail here.
    let rules = yaml_documents(&python, &workspace().join(RECORDING_RULES))?;
    let recorded: Vec<&str> = rules
        .iter()
        .flat_map(|r| r["groups"].as_array().into_iter().flatten())
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .filter_map(|r| r["record"].as_str())
        .collect();
    assert!(
        recorded.contains(&QUEUE_DEPTH_RULE),
        "{RECORDING_RULES} records no {QUEUE_DEPTH_RULE}: {recorded:?}"
    );

    let documents = manifests(&python, "autoscaling")?;
    let scaled = one(&documents, "ScaledObject")?;
    let hpa = one(&documents, "HorizontalPodAutoscaler")?;
    let adapter = one(&documents, "ConfigMap")?;

    // KEDA: the rule's value divided by the replicas.
    let trigger = &scaled["spec"]["triggers"][0];
    assert_eq!(trigger["type"], "prometheus");
    assert_eq!(trigger["metricType"], "AverageValue", "KEDA: per replica");
    let keda_query = trigger["metadata"]["query"].as_str().context("no query")?;
    assert!(
        keda_query.contains(QUEUE_DEPTH_RULE),
        "KEDA's query: {keda_query}"
    );
    let keda_threshold = trigger["metadata"]["threshold"]
        .as_str()
        .unwrap_or_default();

    // prometheus-adapter serves the rule as the HPA's External metric.
    let config = adapter["data"]["config.yaml"]
        .as_str()
        .context("no config.yaml")?;
    let config = yaml_documents_of(&python, config)?;
    let rule = &config.first().context("empty adapter config")?["externalRules"][0];
    let series = rule["seriesQuery"].as_str().context("no seriesQuery")?;
    assert!(series.contains(QUEUE_DEPTH_RULE), "seriesQuery: {series}");
    assert_eq!(
        rule["resources"]["namespaced"], false,
        "the rule has no namespace label, so the metric cannot be namespaced"
    );
    let exposed = rule["name"]["as"].as_str().context("no name.as")?;
    let metrics_query = rule["metricsQuery"].as_str().context("no metricsQuery")?;
    let metric = &hpa["spec"]["metrics"][0];
    assert_eq!(metric["type"], "External");
    assert_eq!(metric["external"]["metric"]["name"], exposed);
    assert_eq!(
        metric["external"]["target"]["type"], "AverageValue",
        "HPA: per replica"
    );

    // One policy, two implementations: the same target, bounds and behaviour.
    assert_eq!(
        metric["external"]["target"]["averageValue"].as_str(),
        Some(keda_threshold),
        "KEDA's threshold and the HPA's target differ"
    );
    assert_eq!(
        scaled["spec"]["minReplicaCount"],
        hpa["spec"]["minReplicas"]
    );
    assert_eq!(
        scaled["spec"]["maxReplicaCount"],
        hpa["spec"]["maxReplicas"]
    );
    assert_eq!(
        scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
        hpa["spec"]["behavior"]
    );
    assert_eq!(
        scaled["spec"]["scaleTargetRef"],
        hpa["spec"]["scaleTargetRef"]
    );
    assert_eq!(
        scaled["metadata"]["namespace"],
        hpa["metadata"]["namespace"]
    );
    let service = metric["external"]["metric"]["selector"]["matchLabels"]["service"]
        .as_str()
        .context("the HPA selects no service")?;
    assert!(
        keda_query.contains(&format!("service=\"{service}\"")),
        "KEDA and the HPA scale on different services: {keda_query} / {service}"
    );

    // Both queries are PromQL that Prometheus accepts, the adapter's as it expands it.
    let Some(promtool) = on_path(test, "promtool") else {
        return Ok(());
    };
    let adapter_query = metrics_query
        .replace("<<.Series>>", QUEUE_DEPTH_RULE)
        .replace("<<.LabelMatchers>>", &format!("service=\"{service}\""))
        .replace("<<.GroupBy>>", "service");
    ensure!(!adapter_query.contains("<<"), "unexpanded: {adapter_query}");
    let rules = serde_json::json!({"groups": [{"name": "autoscaling", "rules": [
        {"record": "keda:query", "expr": keda_query},
        {"record": "adapter:query", "expr": adapter_query},
    ]}]});
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("queries.yml");
    std::fs::write(&file, rules.to_string())?;
    let output = run(Command::new(promtool).args(["check", "rules"]).arg(&file))?;
    assert!(
        output.status.success(),
        "promtool check rules:\n{}",
        text(&output)
    );
    Ok(())
}

/// The checks above can fail: each catches the mistake it is for.
#[test]
fn the_structural_checks_catch_mistakes() -> anyhow::Result<()> {
    let test = "the_structural_checks_catch_mistakes";
    let Some(validator) = tool(test, validator_venv().join("kubernetes-validate")) else {
        return Ok(());
    };
    let monitor = serde_json::json!({
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "spec": {"selector": {"matchLabels": {"a": "b"}},
                 "endpoints": [{"port": "metrics", "interval": "15 seconds", "honorlabels": true}]},
    });
    let problems = service_monitor_problems(&monitor);
    assert_eq!(problems.len(), 2, "{problems:?}");
    let scaled = serde_json::json!({
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "spec": {
            "scaleTargetRef": {"name": "api"},
            "minReplicaCount": 2,
            "maxReplicaCount": 20,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                "scaleDown": {"stabilizationWindowSeconds": "300"}}}},
            "triggers": [{"type": "prometheus", "metricType": "AverageValue",
                          "metadata": {"serverAddress": "http://p:9090", "query": "x",
                                       "threshold": 4}}],
        },
    });
    let problems = scaled_object_problems(&validator, &scaled)?;
    // The string window in the behaviour, the number threshold (twice: not a string,
    // and so no threshold).
    assert_eq!(problems.len(), 3, "{problems:?}");
    assert!(is_duration("1m30s") && is_duration("500ms") && is_duration("15s"));
    assert!(!is_duration("15") && !is_duration("s") && !is_duration(""));
    Ok(())
}

/// podman's settings on hosts like these: no default rlimits (its nofile and nproc
/// defaults exceed limits a root without CAP_SYS_RESOURCE may set), runc with
/// cgroupfs (crun refuses a mix of cgroup v1 and v2). Neither changes what the
/// container may do.
const PODMAN_CONF: &str = "[containers]\ndefault_ulimits = []\n";

/// podman's default seccomp profile as containerd's RuntimeDefault has it (the
/// DaemonSet's `seccompProfile`): since containerd 1.7, `bpf` is allowed with
/// CAP_BPF and `perf_event_open` with CAP_PERFMON; podman 4.3's still wants
/// CAP_SYS_ADMIN for both.
fn runtime_default_seccomp() -> anyhow::Result<Value> {
    const GATED: [(&str, &str); 2] = [("bpf", "CAP_BPF"), ("perf_event_open", "CAP_PERFMON")];
    let path = "/usr/share/containers/seccomp.json";
    let mut profile: Value = serde_json::from_str(
        &std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?,
    )?;
    let syscalls = profile["syscalls"]
        .as_array_mut()
        .context("no syscalls in podman's seccomp profile")?;
    for rule in syscalls.iter_mut() {
        if rule["action"] == "SCMP_ACT_ERRNO"
            && let Some(names) = rule["names"].as_array_mut()
        {
            names.retain(|name| !GATED.iter().any(|(call, _)| name == call));
        }
    }
    syscalls.retain(|rule| {
        rule["names"]
            .as_array()
            .is_none_or(|names| !names.is_empty())
    });
    for (call, capability) in GATED {
        syscalls.push(serde_json::json!({
            "names": [call],
            "action": "SCMP_ACT_ALLOW",
            "includes": {"caps": [capability]},
        }));
    }
    Ok(profile)
}

/// `podman run` arguments for the DaemonSet's container: its host namespaces,
/// capabilities, user, no_new_privs, read-only root and host mounts, with `config`
/// mounted where its ConfigMap goes and /metrics on 127.0.0.1:`port`.
fn daemonset_run_args(
    pod: &Value,
    container: &Value,
    config: &Path,
    seccomp: &Path,
    port: u16,
) -> anyhow::Result<Vec<String>> {
    let mut args = vec!["run".to_owned(), "--detach".to_owned()];
    ensure!(
        pod["hostPID"] == true && pod["hostNetwork"] == true,
        "{pod}"
    );
    args.extend(["--pid=host".to_owned(), "--network=host".to_owned()]);
    let security = &container["securityContext"];
    ensure!(security["privileged"] == false, "{security}");
    args.push(format!(
        "--user={}:{}",
        security["runAsUser"], security["runAsGroup"]
    ));
    if security["allowPrivilegeEscalation"] == false {
        args.push("--security-opt=no-new-privileges".to_owned());
    }
    if security["readOnlyRootFilesystem"] == true {
        args.push("--read-only".to_owned());
    }
    args.push(format!("--security-opt=seccomp={}", seccomp.display()));
    for capability in security["capabilities"]["drop"]
        .as_array()
        .into_iter()
        .flatten()
    {
        args.push(format!(
            "--cap-drop={}",
            capability.as_str().context("a capability")?
        ));
    }
    for capability in security["capabilities"]["add"]
        .as_array()
        .into_iter()
        .flatten()
    {
        args.push(format!(
            "--cap-add={}",
            capability.as_str().context("a capability")?
        ));
    }
    let volumes = pod["volumes"].as_array().context("no volumes")?;
    for mount in container["volumeMounts"]
        .as_array()
        .context("no volumeMounts")?
    {
        let volume = volumes
            .iter()
            .find(|v| v["name"] == mount["name"])
            .with_context(|| format!("no volume {}", mount["name"]))?;
        let source = if volume["configMap"].is_object() {
            config.display().to_string()
        } else {
            let path = volume["hostPath"]["path"].as_str().with_context(|| {
                format!("volume {volume} is neither a ConfigMap nor a hostPath")
            })?;
            // A directory every node has that this machine, no kubelet node, may lack
            // (/var/log/containers): an empty one beside the config stands in.
            if Path::new(path).exists() {
                path.to_owned()
            } else {
                let stand_in =
                    config.with_file_name(path.trim_start_matches('/').replace('/', "-"));
                std::fs::create_dir_all(&stand_in)?;
                stand_in.display().to_string()
            }
        };
        let read_only = if mount["readOnly"] == true { ":ro" } else { "" };
        let target = mount["mountPath"].as_str().context("a mountPath")?;
        args.push(format!("--volume={source}:{target}{read_only}"));
    }
    args.push(format!(
        "--env=POOLSCOPE_WEB__LISTEN_ADDRESS=127.0.0.1:{port}"
    ));
    args.push(container["image"].as_str().context("no image")?.to_owned());
    for arg in container["args"].as_array().into_iter().flatten() {
        args.push(arg.as_str().context("an argument")?.to_owned());
    }
    Ok(args)
}

/// The image `cargo xtask image` built (loaded from its OCI archive) runs as the
/// DaemonSet runs it, with the shipped ConfigMap: it attaches its probes, discovers
/// a server started before it and counts every request the clients completed.
#[test]
fn the_image_runs_with_the_daemonsets_settings_and_measures() -> anyhow::Result<()> {
    let test = "the_image_runs_with_the_daemonsets_settings_and_measures";
    if !privileged(test) {
        return Ok(());
    }
    let (Some(python), Some(podman)) = (
        tool(test, validator_venv().join("python")),
        on_path(test, "podman"),
    ) else {
        return Ok(());
    };
    let archive = std::fs::read_dir(workspace().join("target/image"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .find(|path| path.to_string_lossy().ends_with(".oci.tar"));
    let Some(archive) = archive else {
        skip(test, "no target/image/*.oci.tar: run cargo xtask image");
        return Ok(());
    };
    let _serial = one_at_a_time();
    let documents = manifests(&python, "kubernetes")?;
    let pod = &one(&documents, "DaemonSet")?["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let config_name = pod["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|volume| volume["configMap"]["name"].as_str())
        .context("the DaemonSet mounts no ConfigMap")?;
    let config_map = documents
        .iter()
        .map(|(_, document)| document)
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == config_name)
        .with_context(|| format!("no ConfigMap {config_name}"))?;
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("config");
    std::fs::create_dir(&config)?;
    for (name, text) in config_map["data"]
        .as_object()
        .context("no ConfigMap data")?
    {
        std::fs::write(
            config.join(name),
            text.as_str().context("a ConfigMap value")?,
        )?;
    }
    let seccomp = dir.path().join("seccomp.json");
    std::fs::write(&seccomp, serde_json::to_vec(&runtime_default_seccomp()?)?)?;
    let conf = dir.path().join("containers.conf");
    std::fs::write(&conf, PODMAN_CONF)?;
    let podman = |args: &[String]| -> anyhow::Result<String> {
        let output = run(Command::new(&podman)
            .env("CONTAINERS_CONF", &conf)
            .args(["--runtime", "runc", "--cgroup-manager", "cgroupfs"])
            .args(args))?;
        ensure!(
            output.status.success(),
            "podman {args:?}: {}",
            text(&output)
        );
        Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
    };
    let loaded = podman(&["load".to_owned(), format!("--input={}", archive.display())])?;
    let image = container["image"].as_str().context("no image")?;
    ensure!(
        loaded.contains(image),
        "{} holds {loaded:?}, the DaemonSet runs {image}",
        archive.display()
    );

    // CPU-bound (5 ms of CPU a request) under half a CPU of quota: its capacity is
    // the quota's (100/s), not its 2 threads' (400/s), once poolscope reads the quota
    // through the DaemonSet's mount of the host's cgroups.
    let Some(quota) = QuotaCgroup::half_cpu()? else {
        skip(test, "no cgroup hierarchy with the cpu controller");
        return Ok(());
    };
    let server = PoolServer::start_styled(2, std::time::Duration::from_millis(5), "spin")?;
    quota.add(server.pid())?;
    let port = free_port()?;
    let name = format!("poolscope-image-test-{}", std::process::id());
    let mut args = daemonset_run_args(pod, container, &config, &seccomp, port)?;
    args.insert(2, format!("--name={name}"));
    podman(&args)?;
    let measured = (|| -> anyhow::Result<u64> {
        let scrape = || -> Option<Metrics> {
            let response = http_get(port, "/metrics").ok()?;
            Some(Metrics::parse(&response.text("/metrics").ok()?))
        };
        let service = [("service", "poolserver")];
        let watched = wait_until(std::time::Duration::from_secs(30), || {
            scrape().is_some_and(|m| m.value("poolscope_targets", &service) == Some(1.0))
        });
        ensure!(
            watched,
            "poolserver not watched: {:?}",
            scrape().map(|m| m.text)
        );
        let metrics = scrape().context("no scrape")?;
        let detached: Vec<_> = metrics
            .samples
            .iter()
            .filter(|s| s.name == "poolscope_probe_attached" && s.value != 1.0)
            .collect();
        ensure!(detached.is_empty(), "probes not attached: {detached:?}");
        let clients = ClosedLoop::start(server.port, 2, Connections::KeepAlive);
        const CAPACITY: &str = "poolscope_pool_capacity_requests_per_second";
        let quota_bound = [("service", "poolserver"), ("limit", "cpu_quota")];
        let bounded = wait_until(std::time::Duration::from_secs(30), || {
            scrape().is_some_and(|m| m.value(CAPACITY, &quota_bound).is_some())
        });
        let seen = clients.stop()?;
        ensure!(
            bounded,
            "the half-CPU quota does not bound the capacity: {:?}",
            scrape().map(|m| m
                .samples
                .into_iter()
                .filter(|s| s.name == CAPACITY)
                .collect::<Vec<_>>())
        );
        ensure!(seen.completed > 0, "the clients completed nothing");
        let counted = wait_until(std::time::Duration::from_secs(10), || {
            scrape().is_some_and(|m| {
                m.value("poolscope_requests_total", &service) == Some(seen.completed as f64)
            })
        });
        ensure!(
            counted,
            "{} requests completed, the container counted {:?}",
            seen.completed,
            scrape().and_then(|m| m.value("poolscope_requests_total", &service))
        );
        Ok(seen.completed)
    })();
    let logs = podman(&["logs".to_owned(), name.clone()]).unwrap_or_default();
    let removed = podman(&["rm".to_owned(), "--force".to_owned(), name]);
    let completed = measured.with_context(|| format!("the container's log:\n{logs}"))?;
    removed?;
    println!(
        "{}: {image} counted all {completed} requests under the DaemonSet's settings, \
         its capacity bound by the container's CPU quota",
        archive.display()
    );
    Ok(())
}
