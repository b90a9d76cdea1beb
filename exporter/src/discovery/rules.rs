//! Which processes form which service: target rules (or auto-discovery) applied to a
//! procfs snapshot. Pure: `assign` maps a snapshot to (process, service name) pairs.
//!
//! - A process matches a rule when every selector the rule gives matches.
//! - With no rules, every process with a listening TCP socket is a service, named by
//!   its Kubernetes workload, else its systemd unit, else its container, else its comm
//!   (see [`default_service_name`]).
//! - A process that matches nothing belongs to the service of its nearest matching
//!   ancestor when it is in the same cgroup (a login shell moved to its own session
//!   scope by sshd is not part of sshd). pid 1 is never an ancestor service: every
//!   process descends from it.
//!
//! **Kubernetes workloads.** A pod container's process is named after its namespace,
//! workload and container, `<namespace>.<workload>.<container>` (`prod.web.web`,
//! `prod.web.istio-proxy`), so that the replicas of a Deployment on a node are one
//! service whose name survives rollouts and restarts, a sidecar is a service apart
//! from its application, and `api` in two namespaces is two services. The names come
//! from the kubelet's log links (`pod_logs`); where the node does not list the
//! container, the service is the workload alone, from the pod name in the container's
//! environment (`procfs`). Dots join the parts: a Kubernetes label value may hold
//! them (an HPA selects by one), and the name reads back whole, since neither a
//! namespace nor a container name holds a dot. The workload is guessed from the pod
//! name by the suffixes the controllers append:
//! - Deployment: `<name>-<pod-template-hash>-<5 random>` (`web-7d9f8c6b5-x2k4q` →
//!   `web`); the hash is 5 to 10 characters of the alphabet Kubernetes draws random
//!   names from (`bcdfghjklmnpqrstvwxz2456789`: no vowels, no 0, 1, 3).
//! - CronJob: `<name>-<scheduled minute since 1970>-<5 random>` (`backup-28391840-k2x9p`
//!   → `backup`).
//! - DaemonSet, Job, bare ReplicaSet: `<name>-<5 random>` (`fluentd-x2k4q` → `fluentd`).
//! - StatefulSet: `<name>-<ordinal>` (`db-0` → `db`).
//! - Anything else stays as it is (`nginx`, `redis-master`).
//!
//! The guess only sees the name, so it has limits: a bare pod whose last segment
//! happens to look generated loses it (`web-bcdfg` → `web`, `worker-2` → `worker`), as
//! does a DaemonSet whose name ends in 5 to 10 letters of the alphabet (`proxy-https`'s
//! pods become `proxy`); pods of controllers with other schemes keep a changing name
//! (OpenShift's `<dc>-<version>-<5>` becomes `<dc>-<version>`); names cut to fit 63
//! characters (long workload names) lose the `-` before their suffix and stay whole;
//! a pod named from its environment that sets `spec.hostname` is named by it. Named
//! from the environment, workloads of the same name in different namespaces on one
//! node, and every container of one pod (sidecars too), are one service: the cgroup
//! and the environment do not say the namespace or the container's name. Target
//! rules name services explicitly where that matters.
use std::collections::HashMap;

use crate::{
    config::{ServiceOptions, TargetRule},
    discovery::procfs::{PodNames, ProcInfo, ProcSnapshot, container_id, systemd_service},
};

/// One process and the service it belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    pub pid: u32,
    pub start_time: u64,
    pub service: String,
    /// How the rule that named it says to read the service (the defaults without one).
    pub options: ServiceOptions,
    /// The Kubernetes pod container it was named after, if any.
    pub workload: Option<Workload>,
}

/// The Kubernetes namespace, workload and container a service is named after.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Workload {
    pub namespace: String,
    pub workload: String,
    pub container: String,
}

impl Workload {
    /// The workload of a pod container the kubelet named.
    fn of(process: &ProcInfo) -> Option<Self> {
        let Some(PodNames::Kubelet(names)) = &process.pod else {
            return None;
        };
        Some(Self {
            namespace: names.namespace.clone(),
            workload: workload_name(&names.pod).to_owned(),
            container: names.container.clone(),
        })
    }

    fn service_name(&self) -> String {
        format!("{}.{}.{}", self.namespace, self.workload, self.container)
    }
}

/// A service's name and options as a rule, or the default naming, gives them.
#[derive(Clone, Debug)]
struct Named {
    service: String,
    options: ServiceOptions,
    workload: Option<Workload>,
}

/// How deep to look for a matching ancestor (guards against ppid cycles in bad input).
const MAX_ANCESTORS: usize = 64;

/// The service name of a process found without a named rule: its Kubernetes
/// namespace, workload and container (pod containers the kubelet lists), else its
/// workload (pod containers whose pod name is known), else its systemd unit, else
/// `container-<short id>` (other containers, and pod containers whose pod name is not
/// known), else its comm. The workload comes before the unit: a unit inside a pod's
/// container is one of the workload's parts.
pub fn default_service_name(process: &ProcInfo) -> String {
    if let Some(workload) = Workload::of(process) {
        workload.service_name()
    } else if let Some(pod) = &process.pod {
        workload_name(pod.pod()).to_owned()
    } else if let Some(unit) = systemd_service(&process.cgroup) {
        unit.to_owned()
    } else if let Some(id) = container_id(&process.cgroup) {
        format!("container-{id}")
    } else {
        process.comm.clone()
    }
}

/// The characters Kubernetes draws generated name parts from (`utilrand.String`,
/// `rand.SafeEncodeString`): no vowels, so no words, and no 0, 1, 3.
const GENERATED_NAME_ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";

fn is_generated(part: &str, lengths: std::ops::RangeInclusive<usize>) -> bool {
    lengths.contains(&part.len()) && part.bytes().all(|b| GENERATED_NAME_ALPHABET.contains(&b))
}

/// A CronJob's job name part: the scheduled time in minutes since 1970 (8 digits
/// until the year 2160).
fn is_schedule_minute(part: &str) -> bool {
    part.len() >= 8 && part.bytes().all(|b| b.is_ascii_digit())
}

/// A StatefulSet ordinal: a decimal number without leading zeros.
fn is_ordinal(part: &str) -> bool {
    !part.is_empty()
        && part.bytes().all(|b| b.is_ascii_digit())
        && (part == "0" || !part.starts_with('0'))
}

/// The workload a pod name belongs to (see the module comment for the rules and
/// their limits); the pod name itself when no rule applies.
pub fn workload_name(pod: &str) -> &str {
    let Some((rest, last)) = pod.rsplit_once('-') else {
        return pod;
    };
    if rest.is_empty() {
        return pod;
    }
    if is_generated(last, 5..=5) {
        // Deployment (`-<hash>-<random>`) or CronJob (`-<minute>-<random>`), else a
        // DaemonSet's, Job's or ReplicaSet's `-<random>`.
        return match rest.rsplit_once('-') {
            Some((workload, middle))
                if !workload.is_empty()
                    && (is_generated(middle, 5..=10) || is_schedule_minute(middle)) =>
            {
                workload
            }
            _ => rest,
        };
    }
    if is_ordinal(last) {
        return rest;
    }
    pod
}

fn cgroup_matches(selector: &str, cgroup: &str) -> bool {
    if selector.starts_with('/') {
        cgroup == selector
            || cgroup
                .strip_prefix(selector)
                .is_some_and(|rest| rest.starts_with('/') || selector.ends_with('/'))
    } else {
        cgroup.split('/').any(|component| {
            component == selector || component.strip_suffix(".service") == Some(selector)
        })
    }
}

fn rule_matches(rule: &TargetRule, process: &ProcInfo, snapshot: &ProcSnapshot) -> bool {
    (rule.pids.is_empty() || rule.pids.contains(&process.pid))
        && rule
            .comm
            .as_ref()
            .is_none_or(|re| re.is_match(&process.comm))
        && rule.exe.as_ref().is_none_or(|re| {
            process
                .exe
                .as_ref()
                .and_then(|exe| exe.to_str())
                .is_some_and(|exe| re.is_match(exe))
        })
        && (rule.ports.is_empty()
            || process.listeners.iter().any(|inode| {
                snapshot
                    .listen_sockets
                    .get(inode)
                    .is_some_and(|addr| rule.ports.contains(&addr.port()))
            }))
        && rule
            .cgroup
            .as_deref()
            .is_none_or(|selector| cgroup_matches(selector, &process.cgroup))
}

/// The service a process belongs to by itself (not through an ancestor).
fn direct_service(
    process: &ProcInfo,
    rules: &[TargetRule],
    snapshot: &ProcSnapshot,
) -> Option<Named> {
    let by_default = |options: ServiceOptions| {
        let workload = Workload::of(process);
        Named {
            service: workload
                .as_ref()
                .map_or_else(|| default_service_name(process), Workload::service_name),
            options,
            workload,
        }
    };
    if rules.is_empty() {
        return (!process.listeners.is_empty()).then(|| by_default(ServiceOptions::default()));
    }
    rules
        .iter()
        .find(|rule| rule_matches(rule, process, snapshot))
        .map(|rule| match &rule.service {
            Some(service) => Named {
                service: service.clone(),
                options: rule.options.clone(),
                workload: None,
            },
            None => by_default(rule.options.clone()),
        })
}

/// Assigns every process of `snapshot` that belongs to a service. `exclude` (the
/// exporter itself) and its descendants are never assigned.
pub fn assign(snapshot: &ProcSnapshot, rules: &[TargetRule], exclude: u32) -> Vec<Assignment> {
    let by_pid: HashMap<u32, &ProcInfo> = snapshot.processes.iter().map(|p| (p.pid, p)).collect();
    let direct: HashMap<u32, Named> = snapshot
        .processes
        .iter()
        .filter(|p| p.pid != exclude)
        .filter_map(|p| Some((p.pid, direct_service(p, rules, snapshot)?)))
        .collect();

    let inherited = |process: &ProcInfo| -> Option<Named> {
        let mut current = process;
        for _ in 0..MAX_ANCESTORS {
            if current.ppid <= 1 || current.ppid == exclude {
                return None;
            }
            let parent = by_pid.get(&current.ppid)?;
            if let Some(service) = direct.get(&parent.pid) {
                return (parent.cgroup == process.cgroup).then(|| service.clone());
            }
            current = parent;
        }
        None
    };

    snapshot
        .processes
        .iter()
        .filter(|p| p.pid != exclude && p.pid > 1)
        .filter_map(|process| {
            let named = direct
                .get(&process.pid)
                .cloned()
                .or_else(|| inherited(process))?;
            Some(Assignment {
                pid: process.pid,
                start_time: process.start_time,
                service: named.service,
                options: named.options,
                workload: named.workload,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use regex::Regex;

    use super::*;

    fn process(pid: u32, ppid: u32, comm: &str, cgroup: &str, listeners: &[u64]) -> ProcInfo {
        ProcInfo {
            pid,
            ppid,
            start_time: u64::from(pid) * 10,
            comm: comm.into(),
            exe: Some(format!("/usr/bin/{comm}").into()),
            cgroup: cgroup.into(),
            pod: None,
            listeners: listeners.to_vec(),
        }
    }

    fn snapshot() -> ProcSnapshot {
        let addr = |s: &str| -> SocketAddr { s.parse().expect("addr") };
        ProcSnapshot {
            processes: vec![
                process(1, 0, "init", "/init.scope", &[1]),
                process(100, 1, "nginx", "/system.slice/nginx.service", &[10]),
                process(101, 100, "nginx", "/system.slice/nginx.service", &[10]),
                process(102, 101, "helper", "/system.slice/nginx.service", &[]),
                process(200, 1, "sshd", "/system.slice/ssh.service", &[22]),
                process(201, 200, "bash", "/user.slice/session-1.scope", &[]),
                process(300, 1, "java", "/", &[80]),
                process(400, 1, "idle", "/", &[]),
                process(500, 1, "poolscope", "/", &[95]),
            ],
            listen_sockets: [
                (1, addr("0.0.0.0:2024")),
                (10, addr("0.0.0.0:80")),
                (22, addr("0.0.0.0:22")),
                (80, addr("[::]:8080")),
                (95, addr("127.0.0.1:9435")),
            ]
            .into(),
            ..ProcSnapshot::default()
        }
    }

    fn services(assignments: &[Assignment]) -> Vec<(u32, &str)> {
        let mut pairs: Vec<_> = assignments
            .iter()
            .map(|a| (a.pid, a.service.as_str()))
            .collect();
        pairs.sort();
        pairs
    }

    #[test]
    fn auto_discovery_names_by_unit_then_comm() {
        let assignments = assign(&snapshot(), &[], 500);
        assert_eq!(
            services(&assignments),
            vec![
                (100, "nginx"),
                (101, "nginx"),
                (102, "nginx"),
                (200, "ssh"),
                (300, "java")
            ]
        );
        assert_eq!(assignments[0].start_time, 1000);
    }

    fn rule(service: Option<&str>) -> TargetRule {
        TargetRule {
            service: service.map(str::to_owned),
            pids: Vec::new(),
            comm: None,
            exe: None,
            ports: Vec::new(),
            cgroup: None,
            options: ServiceOptions::default(),
        }
    }

    #[test]
    fn every_selector_must_match() {
        let by_comm_and_port = TargetRule {
            comm: Some(Regex::new("^java$").expect("regex")),
            ports: vec![8080],
            ..rule(Some("api"))
        };
        assert_eq!(
            services(&assign(&snapshot(), &[by_comm_and_port], 500)),
            vec![(300, "api")]
        );
        let wrong_port = TargetRule {
            comm: Some(Regex::new("^java$").expect("regex")),
            ports: vec![9999],
            ..rule(Some("api"))
        };
        assert!(assign(&snapshot(), &[wrong_port], 500).is_empty());
    }

    #[test]
    fn children_inherit_within_their_cgroup() {
        let by_pid = TargetRule {
            pids: vec![100],
            ..rule(Some("web"))
        };
        assert_eq!(
            services(&assign(&snapshot(), &[by_pid], 500)),
            vec![(100, "web"), (101, "web"), (102, "web")]
        );
        let sshd = TargetRule {
            comm: Some(Regex::new("sshd").expect("regex")),
            ..rule(None)
        };
        // bash is in its own session scope: not part of sshd.
        assert_eq!(
            services(&assign(&snapshot(), &[sshd], 500)),
            vec![(200, "ssh")]
        );
    }

    #[test]
    fn cgroup_by_unit_or_path() {
        let by_unit = TargetRule {
            cgroup: Some("nginx.service".into()),
            ..rule(None)
        };
        assert_eq!(assign(&snapshot(), &[by_unit], 500).len(), 3);
        let by_unit_short = TargetRule {
            cgroup: Some("nginx".into()),
            ..rule(None)
        };
        assert_eq!(assign(&snapshot(), &[by_unit_short], 500).len(), 3);
        let by_path = TargetRule {
            cgroup: Some("/system.slice".into()),
            ..rule(Some("system"))
        };
        assert_eq!(assign(&snapshot(), &[by_path], 500).len(), 4);
        assert!(!cgroup_matches(
            "/system.slice/ng",
            "/system.slice/nginx.service"
        ));
    }

    #[test]
    fn first_matching_rule_wins_and_self_is_excluded() {
        let rules = [
            TargetRule {
                pids: vec![101],
                ..rule(Some("first"))
            },
            TargetRule {
                exe: Some(Regex::new("/nginx$").expect("regex")),
                ..rule(Some("second"))
            },
            TargetRule {
                pids: vec![500],
                ..rule(Some("me"))
            },
        ];
        assert_eq!(
            services(&assign(&snapshot(), &rules, 500)),
            vec![(100, "second"), (101, "first"), (102, "first")]
        );
    }

    #[test]
    fn workloads_from_pod_names() {
        let cases = [
            // Deployments: hash of 5 to 10 characters, then the random suffix.
            ("web-7d9f8c6b5-x2k4q", "web"),
            ("web-7d9f8c6b5-p9zmt", "web"),
            ("coredns-5d78c9869d-8xjqz", "coredns"),
            ("api-gateway-v2-66b6c48dd5-4wq7n", "api-gateway-v2"),
            ("nginx-deployment-7c5ddbdf54-2xz8l", "nginx-deployment"),
            ("metrics-server-bcdfg-x2k4q", "metrics-server"),
            // CronJob runs: the scheduled minute, then the random suffix.
            ("backup-28391840-k2x9p", "backup"),
            // DaemonSets, Jobs, bare ReplicaSets: the random suffix only.
            ("fluentd-x2k4q", "fluentd"),
            ("kube-proxy-9zv7t", "kube-proxy"),
            ("node-exporter-2xq8m", "node-exporter"),
            ("migrate-db-24567", "migrate-db"),
            // OpenShift's DeploymentConfig: the version stays (not a hash).
            ("web-3-x2k4q", "web-3"),
            // StatefulSets: the ordinal.
            ("db-0", "db"),
            ("kafka-broker-12", "kafka-broker"),
            // Nothing generated: unchanged.
            ("nginx", "nginx"),
            ("redis-master", "redis-master"),
            ("web-abcde", "web-abcde"),
            ("web-v2", "web-v2"),
            ("db-007", "db-007"),
            ("web-x2k4", "web-x2k4"),
            ("web-x2k4qq", "web-x2k4qq"),
            ("-x2k4q", "-x2k4q"),
            ("-7d9f8c6b5-x2k4q", "-7d9f8c6b5"),
            ("web-", "web-"),
            // Known misreadings (documented): generated-looking last segments go.
            ("web-bcdfg", "web"),
            ("worker-2", "worker"),
            ("proxy-https-x2k4q", "proxy"),
        ];
        for (pod, workload) in cases {
            assert_eq!(workload_name(pod), workload, "pod {pod}");
        }
    }

    #[test]
    fn pod_containers_are_named_by_workload_other_containers_by_id() {
        let id = "4f1c2a9be0d75c3e8a6b9d0f1e2c3b4a5968778695a4b3c2d1e0f9a8b7c6d5e4";
        let pod_cgroup = format!(
            "/kubepods.slice/kubepods-burstable.slice/\
             kubepods-burstable-pod3e1a6e0c_5b1f_4d1e_9b4e_0d2f8c7a9b10.slice/\
             cri-containerd-{id}.scope"
        );
        let mut replica = process(600, 1, "web", &pod_cgroup, &[60]);
        replica.pod = Some(PodNames::Hostname("web-7d9f8c6b5-x2k4q".into()));
        assert_eq!(default_service_name(&replica), "web");
        // The pod name could not be read (or was not trusted): the container's id.
        replica.pod = None;
        assert_eq!(default_service_name(&replica), "container-4f1c2a9be0d7");
        let docker = process(
            700,
            1,
            "redis",
            &format!("/system.slice/docker-{id}.scope"),
            &[70],
        );
        assert_eq!(default_service_name(&docker), "container-4f1c2a9be0d7");
        let unit = process(800, 1, "nginx", "/system.slice/nginx.service", &[80]);
        assert_eq!(default_service_name(&unit), "nginx");
    }

    #[test]
    fn replicas_on_one_node_are_one_service() {
        let pod = |uid: &str, id: char| {
            format!(
                "/kubepods/besteffort/pod{uid}/{}",
                std::iter::repeat_n(id, 64).collect::<String>()
            )
        };
        let a = pod("3e1a6e0c-5b1f-4d1e-9b4e-0d2f8c7a9b10", 'a');
        let b = pod("9c2b7d1e-6a2f-4e3d-8c5f-1e3a9d8b0c21", 'b');
        let mut replicas = vec![
            process(600, 1, "web", &a, &[60]),
            process(601, 600, "web-worker", &a, &[]),
            process(700, 1, "web", &b, &[70]),
        ];
        replicas[0].pod = Some(PodNames::Hostname("web-7d9f8c6b5-x2k4q".into()));
        replicas[1].pod = Some(PodNames::Hostname("web-7d9f8c6b5-x2k4q".into()));
        replicas[2].pod = Some(PodNames::Hostname("web-7d9f8c6b5-p9zmt".into()));
        let snapshot = ProcSnapshot {
            processes: replicas,
            listen_sockets: [
                (60, "0.0.0.0:8080".parse().expect("addr")),
                (70, "0.0.0.0:8080".parse().expect("addr")),
            ]
            .into(),
            ..ProcSnapshot::default()
        };
        assert_eq!(
            services(&assign(&snapshot, &[], 1)),
            vec![(600, "web"), (601, "web"), (700, "web")]
        );
    }

    /// With the kubelet's names: replicas stay one service, a sidecar and a workload
    /// of the same name in another namespace are services apart, each with its
    /// workload; a rule that names the service gives none.
    #[test]
    fn kubelet_names_tell_containers_and_namespaces_apart() {
        let in_pod = |pid: u32, listener: u64, pod: &str, namespace: &str, container: &str| {
            let mut process = process(
                pid,
                1,
                container,
                "/kubepods/besteffort/podx/c",
                &[listener],
            );
            process.pod = Some(PodNames::Kubelet(std::sync::Arc::new(
                crate::discovery::pod_logs::ContainerNames {
                    pod: pod.into(),
                    namespace: namespace.into(),
                    container: container.into(),
                },
            )));
            process
        };
        let snapshot = ProcSnapshot {
            processes: vec![
                in_pod(600, 60, "api-7d9f8c6b5-x2k4q", "prod", "api"),
                in_pod(601, 61, "api-7d9f8c6b5-x2k4q", "prod", "istio-proxy"),
                in_pod(700, 70, "api-7d9f8c6b5-p9zmt", "prod", "api"),
                in_pod(800, 80, "api-5f6c7d8b9-h7vwn", "staging", "api"),
            ],
            listen_sockets: [60, 61, 70, 80]
                .map(|inode| (inode, "0.0.0.0:8080".parse().expect("addr")))
                .into(),
            ..ProcSnapshot::default()
        };
        let assigned = assign(&snapshot, &[], 1);
        assert_eq!(
            services(&assigned),
            vec![
                (600, "prod.api.api"),
                (601, "prod.api.istio-proxy"),
                (700, "prod.api.api"),
                (800, "staging.api.api"),
            ]
        );
        assert_eq!(
            assigned[1].workload,
            Some(Workload {
                namespace: "prod".into(),
                workload: "api".into(),
                container: "istio-proxy".into(),
            })
        );
        let named = TargetRule {
            pids: vec![800],
            ..rule(Some("checkout"))
        };
        let assigned = assign(&snapshot, &[named], 1);
        assert_eq!(services(&assigned), vec![(800, "checkout")]);
        assert_eq!(assigned[0].workload, None);
    }
}
