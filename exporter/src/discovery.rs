//! Which processes form which service: target rules (or auto-discovery) applied to a
//! procfs snapshot. Pure: `assign` maps a snapshot to (process, service name) pairs.
//!
//! - A process matches a rule when every selector the rule gives matches.
//! - With no rules, every process with a listening TCP socket is a service, named by
//!   its systemd unit, else its container, else its comm.
//! - A process that matches nothing belongs to the service of its nearest matching
//!   ancestor when it is in the same cgroup (a login shell moved to its own session
//!   scope by sshd is not part of sshd). pid 1 is never an ancestor service: every
//!   process descends from it.
use std::collections::HashMap;

use crate::{
    config::TargetRule,
    procfs::{ProcInfo, ProcSnapshot, container_id, systemd_service},
};

/// One process and the service it belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    pub pid: u32,
    pub start_time: u64,
    pub service: String,
}

/// How deep to look for a matching ancestor (guards against ppid cycles in bad input).
const MAX_ANCESTORS: usize = 64;

/// The service name of a process found without a named rule.
pub fn default_service_name(process: &ProcInfo) -> String {
    if let Some(unit) = systemd_service(&process.cgroup) {
        unit.to_owned()
    } else if let Some(id) = container_id(&process.cgroup) {
        format!("container-{id}")
    } else {
        process.comm.clone()
    }
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
) -> Option<String> {
    if rules.is_empty() {
        return (!process.listeners.is_empty()).then(|| default_service_name(process));
    }
    rules
        .iter()
        .find(|rule| rule_matches(rule, process, snapshot))
        .map(|rule| {
            rule.service
                .clone()
                .unwrap_or_else(|| default_service_name(process))
        })
}

/// Assigns every process of `snapshot` that belongs to a service. `exclude` (the
/// exporter itself) and its descendants are never assigned.
pub fn assign(snapshot: &ProcSnapshot, rules: &[TargetRule], exclude: u32) -> Vec<Assignment> {
    let by_pid: HashMap<u32, &ProcInfo> = snapshot.processes.iter().map(|p| (p.pid, p)).collect();
    let direct: HashMap<u32, String> = snapshot
        .processes
        .iter()
        .filter(|p| p.pid != exclude)
        .filter_map(|p| Some((p.pid, direct_service(p, rules, snapshot)?)))
        .collect();

    let inherited = |process: &ProcInfo| -> Option<String> {
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
            let service = direct
                .get(&process.pid)
                .cloned()
                .or_else(|| inherited(process))?;
            Some(Assignment {
                pid: process.pid,
                start_time: process.start_time,
                service,
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
}
