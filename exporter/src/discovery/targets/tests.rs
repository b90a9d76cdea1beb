//! The watched set against a fake kernel and a procfs in a temporary directory.
use std::{fs, io, path::Path};

use poolscope_shared::LossErrno;

use super::*;
use crate::{
    config::{RoutePatterns, ServiceRoutes},
    kernel::fake::FakeTables,
};

/// A procfs with `/proc/<pid>/stat` of each (pid, start time).
fn procfs(processes: &[(u32, u64)]) -> io::Result<tempfile::TempDir> {
    let root = tempfile::tempdir()?;
    for (pid, start_time) in processes {
        write_stat(root.path(), *pid, *start_time)?;
    }
    Ok(root)
}

fn write_stat(root: &Path, pid: u32, start_time: u64) -> io::Result<()> {
    let dir = root.join(pid.to_string());
    fs::create_dir_all(&dir)?;
    fs::write(
        dir.join("stat"),
        format!("{pid} (server) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {start_time} 0 0"),
    )
}

fn assigned(pid: u32, start_time: u64, service: &str) -> Assignment {
    Assignment {
        pid,
        start_time,
        service: service.to_owned(),
        options: ServiceOptions::default(),
        workload: None,
    }
}

fn scan(targets: &mut Targets, tables: &mut FakeTables, assignments: &[Assignment]) {
    targets.apply(
        tables,
        &ProcSnapshot::default(),
        assignments,
        monotonic_ns(),
    );
}

/// The kernel's `WATCHED` as a readout has it (pid → since).
fn watched(tables: &FakeTables) -> BTreeMap<u32, u64> {
    tables
        .watched
        .iter()
        .map(|(&pid, w)| (pid, w.since_ns))
        .collect()
}

fn names(views: &[ServiceView]) -> Vec<(&str, u64)> {
    views
        .iter()
        .map(|view| (view.name.as_str(), view.processes))
        .collect()
}

#[test]
fn a_rules_options_reach_the_kernel_until_a_reload_drops_them() -> io::Result<()> {
    let root = procfs(&[(100, 5), (200, 7)])?;
    let mut targets = Targets::new(root.path().to_owned(), 8);
    let mut tables = FakeTables::default();
    let routes = RoutePatterns::parse(&["/calls/:id".to_owned()]).map_err(io::Error::other)?;
    let grpc = Assignment {
        options: ServiceOptions {
            http2_worker_threads: Some(true),
            routes: ServiceRoutes::Read(routes.clone()),
        },
        ..assigned(100, 5, "grpc")
    };
    scan(
        &mut targets,
        &mut tables,
        &[grpc.clone(), assigned(200, 7, "web")],
    );
    let (Some(id), Some(web)) = (targets.service_id("grpc"), targets.service_id("web")) else {
        panic!("both services get ids");
    };
    assert_eq!(
        tables.stream_workers,
        BTreeMap::from([(id, StreamWorkers::Every)])
    );
    assert_eq!(
        tables.route_services,
        BTreeMap::from([(id, ServiceRoutes::Read(routes))])
    );
    let views = targets.services(&watched(&tables));
    let flags: Vec<(u32, Option<bool>)> = views
        .iter()
        .map(|v| (v.id, v.http2_worker_threads))
        .collect();
    assert_eq!(flags, [(id, Some(true)), (web, None)]);
    // A reload turns the key off: the running process's service is read so.
    let off = Assignment {
        options: ServiceOptions {
            http2_worker_threads: Some(false),
            ..ServiceOptions::default()
        },
        ..grpc.clone()
    };
    scan(&mut targets, &mut tables, &[off, assigned(200, 7, "web")]);
    assert_eq!(
        tables.stream_workers,
        BTreeMap::from([(id, StreamWorkers::None)])
    );
    // A reload drops the key: the service's model is detected again.
    let plain = Assignment {
        options: ServiceOptions::default(),
        ..grpc
    };
    scan(&mut targets, &mut tables, &[plain, assigned(200, 7, "web")]);
    assert!(tables.stream_workers.is_empty());
    assert!(tables.route_services.is_empty());
    assert_eq!(
        targets.services(&watched(&tables))[0].http2_worker_threads,
        None
    );
    Ok(())
}

/// A service named after a pod container shows its workload while it lives; an id
/// the next service reuses starts without it.
#[test]
fn a_services_workload_lives_with_it() -> io::Result<()> {
    let root = procfs(&[(100, 5), (200, 7)])?;
    let mut targets = Targets::new(root.path().to_owned(), 8);
    let mut tables = FakeTables::default();
    let workload = Workload {
        namespace: "prod".into(),
        workload: "api".into(),
        container: "api".into(),
    };
    let api = Assignment {
        workload: Some(workload.clone()),
        ..assigned(100, 5, "prod.api.api")
    };
    scan(&mut targets, &mut tables, &[api]);
    let views = targets.services(&watched(&tables));
    assert_eq!(views[0].workload, Some(workload));
    let id = views[0].id;
    scan(&mut targets, &mut tables, &[]);
    scan(&mut targets, &mut tables, &[assigned(200, 7, "web")]);
    let views = targets.services(&watched(&tables));
    assert_eq!(views[0].id, id, "the freed id is reused");
    assert_eq!(views[0].workload, None);
    Ok(())
}

#[test]
fn a_scan_watches_what_is_assigned_and_forgets_what_is_not() -> io::Result<()> {
    let root = procfs(&[(100, 5), (200, 7)])?;
    let mut targets = Targets::new(root.path().to_owned(), 8);
    let mut tables = FakeTables::default();
    scan(
        &mut targets,
        &mut tables,
        &[assigned(100, 5, "api"), assigned(200, 7, "db")],
    );
    let (api, db) = (targets.service_id("api"), targets.service_id("db"));
    let (Some(api), Some(db)) = (api, db) else {
        panic!("both services get ids: {api:?} {db:?}");
    };
    assert_eq!(
        tables.watched.keys().copied().collect::<Vec<_>>(),
        [100, 200]
    );
    assert_eq!(tables.watched[&100].service, api);
    assert_eq!(
        targets.take_changes(),
        [
            WatchChange::Watched {
                pid: 100,
                service: api
            },
            WatchChange::Watched {
                pid: 200,
                service: db
            },
        ]
    );
    assert_eq!(
        names(&targets.services(&watched(&tables))),
        [("api", 1), ("db", 1)]
    );

    scan(&mut targets, &mut tables, &[assigned(100, 5, "api")]);
    assert_eq!(tables.watched.keys().copied().collect::<Vec<_>>(), [100]);
    assert_eq!(
        targets.take_changes(),
        [WatchChange::Forgotten { pid: 200 }]
    );
    // The idle service's id is freed, and its counters zeroed for the next owner.
    assert_eq!(tables.services_reset, [db]);
    assert_eq!(targets.service_id("db"), None);
    assert_eq!(names(&targets.services(&watched(&tables))), [("api", 1)]);
    Ok(())
}

#[test]
fn a_process_seen_with_another_start_time_is_not_watched() -> io::Result<()> {
    // The scan saw pid 100 start at 4; it is another process (start 5) by the
    // time of the insert.
    let root = procfs(&[(100, 5)])?;
    let mut targets = Targets::new(root.path().to_owned(), 8);
    let mut tables = FakeTables::default();
    scan(&mut targets, &mut tables, &[assigned(100, 4, "api")]);
    assert!(tables.watched.is_empty(), "{:?}", tables.watched);
    assert!(targets.take_changes().is_empty());
    assert!(targets.services(&watched(&tables)).is_empty());
    Ok(())
}

#[test]
fn a_full_watched_map_is_counted_and_the_rest_still_watched() -> io::Result<()> {
    let root = procfs(&[(100, 5), (200, 7), (300, 9)])?;
    let mut targets = Targets::new(root.path().to_owned(), 8);
    let mut tables = FakeTables {
        watched_capacity: 2,
        ..FakeTables::default()
    };
    scan(
        &mut targets,
        &mut tables,
        &[
            assigned(100, 5, "api"),
            assigned(200, 7, "api"),
            assigned(300, 9, "db"),
        ],
    );
    assert_eq!(tables.watched.len(), 2);
    assert_eq!(
        targets.map_errors.iter().collect::<Vec<_>>(),
        [(maps::WATCHED, LossErrno::E2big, 1)]
    );
    assert_eq!(names(&targets.services(&watched(&tables))), [("api", 2)]);
    Ok(())
}

#[test]
fn services_beyond_the_limit_are_refused_and_counted() -> io::Result<()> {
    let root = procfs(&[(100, 5), (200, 7)])?;
    let mut targets = Targets::new(root.path().to_owned(), 1);
    let mut tables = FakeTables::default();
    scan(
        &mut targets,
        &mut tables,
        &[assigned(100, 5, "api"), assigned(200, 7, "db")],
    );
    assert_eq!(targets.services_refused, 1);
    assert_eq!(tables.watched.keys().copied().collect::<Vec<_>>(), [100]);
    Ok(())
}

#[test]
fn kernel_entries_no_scan_assigned_go_unless_newer_than_the_scan() -> io::Result<()> {
    let root = procfs(&[])?;
    let mut targets = Targets::new(root.path().to_owned(), 8);
    let mut tables = FakeTables::default();
    let entry = |since_ns| Watched {
        service: 0,
        _pad: 0,
        since_ns,
    };
    // A fork whose event was lost (older than the scan), and one made while the
    // scan ran (its event is still on its way).
    tables.watched.insert(300, entry(1));
    tables.watched.insert(301, entry(u64::MAX));
    scan(&mut targets, &mut tables, &[]);
    assert_eq!(tables.watched.keys().copied().collect::<Vec<_>>(), [301]);
    Ok(())
}

#[test]
fn a_fork_is_followed_and_its_exit_takes_its_connections_out() -> io::Result<()> {
    let root = procfs(&[(100, 5), (101, 6)])?;
    let mut targets = Targets::new(root.path().to_owned(), 8);
    let mut tables = FakeTables::default();
    scan(&mut targets, &mut tables, &[assigned(100, 5, "api")]);
    let Some(api) = targets.service_id("api") else {
        panic!("api has an id");
    };
    targets.take_changes();
    // The kernel watched the child at its fork and told us.
    let since_ns = monotonic_ns();
    tables.watched.insert(
        101,
        Watched {
            service: api,
            _pad: 0,
            since_ns,
        },
    );
    let event = |kind: ProcessEventKind| ProcessEvent {
        kind: kind as u32,
        pid: 101,
        parent: 100,
        service: api,
        since_ns,
    };
    assert_eq!(
        targets.on_event(&mut tables, &event(ProcessEventKind::Fork)),
        None
    );
    assert_eq!(
        targets.take_changes(),
        [WatchChange::Watched {
            pid: 101,
            service: api
        }]
    );
    assert_eq!(names(&targets.services(&watched(&tables))), [("api", 2)]);

    assert!(targets.recountable(api, &watched(&tables), false, None));

    // It exits holding a connection mid-request: the kernel drops its watch,
    // user space its connection, and the serving gauge is corrected. Until user
    // space has seen the exit, a recount would miss that connection: none runs.
    tables.connections.insert((101, 7), (api, Phase::Serving));
    tables.watched.remove(&101);
    assert!(!targets.recountable(api, &watched(&tables), false, None));
    assert_eq!(
        targets.on_event(&mut tables, &event(ProcessEventKind::Exit)),
        None
    );
    assert_eq!(
        targets.take_changes(),
        [WatchChange::Forgotten { pid: 101 }]
    );
    assert!(tables.connections.is_empty());
    let views = targets.services(&watched(&tables));
    assert_eq!(names(&views), [("api", 1)]);
    assert_eq!(views[0].corrections.serving, 1);
    assert!(targets.recountable(api, &watched(&tables), false, None));
    // The socket backend's state is read in poolscope's network namespace only,
    // and this service's listeners are in none known.
    assert!(!targets.recountable(api, &watched(&tables), true, Some(1)));
    Ok(())
}

#[test]
fn an_exec_of_an_unwatched_process_is_returned_for_the_rules() -> io::Result<()> {
    let root = procfs(&[(100, 5)])?;
    let mut targets = Targets::new(root.path().to_owned(), 8);
    let mut tables = FakeTables::default();
    scan(&mut targets, &mut tables, &[assigned(100, 5, "api")]);
    let exec = |pid| ProcessEvent {
        kind: ProcessEventKind::Exec as u32,
        pid,
        parent: 0,
        service: u32::MAX,
        since_ns: 0,
    };
    assert_eq!(targets.on_event(&mut tables, &exec(100)), None);
    assert_eq!(targets.on_event(&mut tables, &exec(555)), Some(555));
    Ok(())
}
