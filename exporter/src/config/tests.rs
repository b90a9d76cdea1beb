//! Settings loaded from TOML files and flags: defaults, what each limit sizes, and
//! refusals that name their source, key and reason.
use poolscope_shared::maps;

use super::*;

pub(super) fn load_toml(toml: &str) -> Result<Settings, ConfigError> {
    let dir = tempfile::tempdir().map_err(|e| ConfigError::Invalid(e.to_string()))?;
    let path = dir.path().join("poolscope.toml");
    std::fs::write(&path, toml).map_err(|e| ConfigError::Invalid(e.to_string()))?;
    Settings::load(&Overrides {
        config_file: Some(path),
        ..Overrides::default()
    })
}

fn error_of(toml: &str) -> String {
    match load_toml(toml) {
        Ok(settings) => panic!("accepted {toml:?} as {settings:?}"),
        Err(error) => error.to_string(),
    }
}

#[test]
fn the_telemetry_path_is_absolute_plain_and_no_other_endpoints() -> Result<(), ConfigError> {
    assert_eq!(load_toml("")?.telemetry_path, "/metrics");
    let settings = load_toml("[web]\ntelemetry_path = \"/probe/v1.metrics\"\n")?;
    assert_eq!(settings.telemetry_path, "/probe/v1.metrics");
    for bad in [
        "",
        "/",
        "metrics",
        "/a b",
        "/a?b",
        "/<x>",
        "/healthz",
        "/debug/threads",
    ] {
        let refused = load_toml(&format!("[web]\ntelemetry_path = \"{bad}\"\n"));
        let Err(ConfigError::Invalid(message)) = refused else {
            panic!("{bad:?} accepted");
        };
        assert!(message.contains("web.telemetry_path"), "{bad:?}: {message}");
    }
    Ok(())
}

#[test]
fn a_listen_address_of_only_a_port_is_every_address() -> Result<(), ConfigError> {
    let settings = load_toml("[web]\nlisten_address = \":9435\"\n")?;
    assert_eq!(
        settings.listen_addresses,
        ["[::]:9435".parse().expect("address")]
    );
    let settings = load_toml("[web]\nlisten_address = \"10.0.0.1:80\"\n")?;
    assert_eq!(
        settings.listen_addresses,
        ["10.0.0.1:80".parse().expect("address")]
    );
    let settings = load_toml("[web]\nlisten_address = [\"127.0.0.1:80\", \"10.0.0.1:80\"]\n")?;
    assert_eq!(
        settings.listen_addresses,
        [
            "127.0.0.1:80".parse().expect("address"),
            "10.0.0.1:80".parse().expect("address")
        ]
    );
    for bad in [
        "[]",
        "[\"127.0.0.1:80\", \"127.0.0.1:80\"]",
        "[\"127.0.0.1:80\", \"x\"]",
    ] {
        let refused = load_toml(&format!("[web]\nlisten_address = {bad}\n"));
        let Err(ConfigError::Invalid(message)) = refused else {
            panic!("{bad:?} accepted");
        };
        assert!(message.contains("web.listen_address"), "{bad:?}: {message}");
    }
    for bad in [":", ":http", ":70000", "localhost:9435", "9435"] {
        let refused = load_toml(&format!("[web]\nlisten_address = \"{bad}\"\n"));
        let Err(ConfigError::Invalid(message)) = refused else {
            panic!("{bad:?} accepted");
        };
        assert!(message.contains("web.listen_address"), "{bad:?}: {message}");
    }
    Ok(())
}

#[test]
fn restart_changes_name_what_a_reload_cannot_apply() -> Result<(), ConfigError> {
    let running = load_toml("")?;
    let reloaded = load_toml(
        "[probes]\nbackend = \"syscall\"\n[limits]\nthreads = 7\nmax_series = 9\n\
             [discovery]\nrescan_interval = \"3s\"\n",
    )?;
    // max_series and the rescan interval apply on reload.
    assert_eq!(
        reloaded.restart_changes(&running),
        ["probes.backend", "limits.threads"]
    );
    assert!(running.restart_changes(&running).is_empty());
    Ok(())
}

#[test]
fn each_limit_sizes_its_maps() -> Result<(), ConfigError> {
    let limits =
            load_toml("[limits]\nstacks = 11\nconnections = 12\nsyscalls_in_flight = 13\nmutex_calls_in_flight = 14\n")?.limits;
    assert_eq!(limits.size_of(maps::STACK_MAPS), Some(11));
    assert_eq!(limits.size_of(maps::ADOPT), Some(12));
    assert_eq!(limits.size_of(maps::CONNS), Some(12));
    assert_eq!(limits.size_of(maps::PENDING_CALLS), Some(13));
    assert_eq!(limits.size_of(maps::MUTEX_CALLS), Some(14));
    assert_eq!(Limits::key_of(maps::CONNS), Some("limits.connections"));
    // Socket storage, one entry per socket: no limit sets it.
    assert_eq!(limits.size_of(maps::SOCK_CONNS), None);
    Ok(())
}

#[test]
fn defaults_listen_on_localhost_and_auto_discover() -> Result<(), ConfigError> {
    let settings = load_toml("")?;
    assert_eq!(
        settings.listen_addresses,
        [DEFAULT_LISTEN_ADDRESS.parse().expect("addr")]
    );
    assert!(settings.targets.is_empty());
    assert_eq!(settings.backend, Backend::Auto);
    Ok(())
}

#[test]
fn full_file_is_read() -> Result<(), ConfigError> {
    let settings = load_toml(
        r#"
            [web]
            listen_address = "0.0.0.0:9999"
            [discovery]
            rescan_interval = "2s"
            [probes]
            backend = "syscall"
            [[targets]]
            service = "api"
            comm = "^java$"
            port = 8080
            [[targets]]
            pids = [1, 2]
            port = [80, 443]
            cgroup = "nginx.service"
            "#,
    )?;
    assert_eq!(
        settings.listen_addresses,
        ["0.0.0.0:9999".parse().expect("addr")]
    );
    assert_eq!(settings.rescan_interval, Duration::from_secs(2));
    assert_eq!(settings.backend, Backend::Syscall);
    assert_eq!(settings.targets.len(), 2);
    assert_eq!(settings.targets[0].ports, vec![8080]);
    assert_eq!(settings.targets[1].ports, vec![80, 443]);
    Ok(())
}

#[test]
fn unknown_key_names_file_and_key() {
    let error = error_of("[web]\nlisten_adress = \"x\"\n");
    assert!(error.contains("poolscope.toml"), "{error}");
    assert!(error.contains("listen_adress"), "{error}");
}

#[test]
fn bad_values_name_key_and_reason() {
    let error = error_of("[web]\nlisten_address = \"localhost\"\n");
    assert!(
        error.contains("web.listen_address") && error.contains("poolscope.toml"),
        "{error}"
    );
    let error = error_of("[probes]\nbackend = \"kprobe\"\n");
    assert!(
        error.contains("backend") && error.contains("kprobe"),
        "{error}"
    );
    let error = error_of("[[targets]]\ncomm = \"(\"\n");
    assert!(error.contains("targets[0].comm"), "{error}");
    let error = error_of("[[targets]]\nservice = \"x\"\n");
    assert!(error.contains("needs at least one"), "{error}");
    let error = error_of("[log]\nlevel = \"loud\"\n");
    assert!(error.contains("log.level"), "{error}");
    let error = error_of("[discovery]\nrescan_interval = \"soon\"\n");
    assert!(error.contains("rescan_interval"), "{error}");
    let error = error_of("this is not toml");
    assert!(error.contains("poolscope.toml"), "{error}");
}

#[test]
fn response_status_is_read_unless_turned_off() -> Result<(), ConfigError> {
    assert!(load_toml("")?.response_status);
    assert!(load_toml("[probes]\nbackend = \"tcp\"\n")?.response_status);
    assert!(!load_toml("[probes]\nresponse_status = false\n")?.response_status);
    Ok(())
}

#[test]
fn routes_are_read_within_their_caps_once_turned_on() -> Result<(), ConfigError> {
    let settings = load_toml("")?;
    assert!(!settings.routes);
    assert_eq!(
        (
            settings.limits.routes,
            settings.limits.routes_per_service,
            settings.limits.route_events
        ),
        (1024, 50, 29000)
    );
    let settings = load_toml("[probes]\nroutes = true\n[limits]\nroutes_per_service = 5\n")?;
    assert!(settings.routes);
    assert_eq!(settings.limits.routes_per_service, 5);
    let error = error_of("[limits]\nroute_events = 0\n");
    assert!(error.contains("limits.route_events"), "{error}");
    Ok(())
}

#[test]
fn a_target_reads_its_routes_or_not_with_its_templates() -> Result<(), ConfigError> {
    let target = |probes: bool, routes: &str| {
        format!(
            "[probes]\nroutes = {probes}\n[limits]\nroutes_per_service = 2\n\
             [[targets]]\ncomm = \"^api$\"\nroutes = {routes}\n\
             [[targets]]\ncomm = \"^web$\"\n"
        )
    };
    // Templates read the routes of their service alone, [probes] routes off.
    let settings = load_toml(&target(false, r#"["/users/:id", "/static/*"]"#))?;
    let ServiceRoutes::Read(patterns) = &settings.targets[0].options.routes else {
        panic!("templates read routes: {:?}", settings.targets[0]);
    };
    assert_eq!(patterns.len(), 2);
    assert_eq!(patterns.route_of(b"users/7", false), Some("/users/:id"));
    assert_eq!(settings.targets[1].options.routes, ServiceRoutes::AsProbes);
    assert!(settings.any_routes_read());
    let read = ServiceRoutes::Read(RoutePatterns::NONE);
    assert_eq!(
        load_toml(&target(false, "[]"))?.targets[0].options.routes,
        read
    );
    assert_eq!(
        load_toml(&target(false, "true"))?.targets[0].options.routes,
        read
    );
    let off = load_toml(&target(true, "false"))?;
    assert_eq!(off.targets[0].options.routes, ServiceRoutes::Off);
    assert!(
        off.any_routes_read(),
        "[probes] routes reads the other service's"
    );
    assert!(!load_toml(&target(false, "false"))?.any_routes_read());
    for (routes, reason) in [
        (r#"["users"]"#, "does not begin with /"),
        (
            r#"["/a", "/b", "/c"]"#,
            "more than the 2 routes a service keeps",
        ),
    ] {
        let error = error_of(&target(false, routes));
        assert!(
            error.contains("targets[0].routes") && error.contains(reason),
            "{routes}: {error}"
        );
    }
    // The first service whose routes are read needs the programs that read them.
    let running = load_toml(&target(false, "false"))?;
    let changes = load_toml(&target(false, "true"))?.restart_changes(&running);
    assert!(
        changes.iter().any(|key| key.starts_with("targets.routes")),
        "{changes:?}"
    );
    Ok(())
}

#[test]
fn stack_settings_are_checked() -> Result<(), ConfigError> {
    let settings = load_toml("")?;
    assert_eq!(settings.snapshots.sampling_hz, 49);
    assert_eq!(
        settings.snapshots.offcpu_min,
        Some(Duration::from_millis(1))
    );
    assert_eq!(settings.snapshots.saturation, None);
    assert_eq!(
        (
            settings.snapshots.offcpu_full_rate,
            settings.snapshots.offcpu_sample_one_in
        ),
        (1000, 8)
    );
    let settings = load_toml(
        "[probes]\nsampling_hz = 0\n[stacks]\noffcpu = false\nsaturation_queue_depth = 8\n",
    )?;
    assert_eq!(settings.snapshots.sampling_hz, 0);
    assert_eq!(settings.snapshots.offcpu_min, None);
    assert_eq!(
        settings.snapshots.saturation,
        Some((8, Duration::from_secs(5)))
    );
    for (toml, key) in [
        ("[probes]\nsampling_hz = 1001\n", "probes.sampling_hz"),
        ("[stacks]\ninterval = \"500ms\"\n", "stacks.interval"),
        ("[stacks]\nkeep = 0\n", "stacks.keep"),
        (
            "[stacks]\nmemory_limit_bytes = 10\n",
            "stacks.memory_limit_bytes",
        ),
        ("[stacks]\noffcpu_min = \"0s\"\n", "stacks.offcpu_min"),
        (
            "[stacks]\noffcpu_sample_one_in = 3\n",
            "stacks.offcpu_sample_one_in",
        ),
        (
            "[stacks]\noffcpu_sample_one_in = 2048\n",
            "stacks.offcpu_sample_one_in",
        ),
        (
            "[stacks]\noffcpu_sample_one_in = 0\n",
            "stacks.offcpu_sample_one_in",
        ),
        (
            "[stacks]\nsaturation_queue_depth = 1\nsaturation_duration = \"0s\"\n",
            "stacks.saturation_duration",
        ),
        ("[limits]\nstacks = 0\n", "limits.stacks"),
    ] {
        let error = error_of(toml);
        assert!(error.contains(key), "{toml}: {error}");
    }
    Ok(())
}

#[test]
fn thread_slots_are_a_power_of_two() -> Result<(), ConfigError> {
    assert_eq!(load_toml("")?.limits.thread_slots, 16384);
    assert_eq!(
        load_toml("[limits]\nthread_slots = 1\n")?
            .limits
            .thread_slots,
        1
    );
    for slots in ["3", "12000", "2097152"] {
        let toml = format!("[limits]\nthread_slots = {slots}\n");
        let error = error_of(&toml);
        assert!(
            error.contains("limits.thread_slots") && error.contains("power of two"),
            "{toml}: {error}"
        );
    }
    Ok(())
}

#[test]
fn stack_maps_stay_clear_of_the_shortened_stack_bit() -> Result<(), ConfigError> {
    assert_eq!(
        load_toml("[limits]\nstacks = 16777216\n")?.limits.stacks,
        1 << 24
    );
    for key in ["stacks", "lock_stacks"] {
        for size in ["16777217", "1073741824"] {
            let toml = format!("[limits]\n{key} = {size}\n");
            let error = error_of(&toml);
            assert!(
                error.contains(&format!("limits.{key}")) && error.contains("at most"),
                "{toml}: {error}"
            );
        }
    }
    Ok(())
}

#[test]
fn profile_limits_are_checked() -> Result<(), ConfigError> {
    let limits = load_toml("")?.profiles;
    assert_eq!(
        (limits.max_sessions, limits.default_hz, limits.max_duration),
        (4, 99, Duration::from_secs(120))
    );
    let limits =
        load_toml("[profiles]\nmax_sessions = 0\nmin_hz = 10\ndefault_hz = 10\n")?.profiles;
    assert_eq!((limits.max_sessions, limits.min_hz), (0, 10));
    for (toml, key) in [
        ("[profiles]\nmax_sessions = 9\n", "profiles.max_sessions"),
        (
            "[profiles]\nmax_duration = \"10ms\"\n",
            "profiles.max_duration",
        ),
        ("[profiles]\nmin_hz = 0\n", "profiles.min_hz"),
        ("[profiles]\nmax_hz = 5000\n", "profiles.min_hz"),
        ("[profiles]\ndefault_hz = 2000\n", "profiles.default_hz"),
        (
            "[profiles]\nmax_response_bytes = 100\n",
            "profiles.max_response_bytes",
        ),
    ] {
        let error = error_of(toml);
        assert!(error.contains(key), "{toml}: {error}");
    }
    Ok(())
}

#[test]
fn missing_file_is_refused() {
    let result = Settings::load(&Overrides {
        config_file: Some(PathBuf::from("/nonexistent/poolscope.toml")),
        ..Overrides::default()
    });
    let error = result.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(error.contains("/nonexistent/poolscope.toml"), "{error}");
}

#[test]
fn flags_override_the_file() -> Result<(), ConfigError> {
    let dir = tempfile::tempdir().map_err(|e| ConfigError::Invalid(e.to_string()))?;
    let path = dir.path().join("c.toml");
    std::fs::write(&path, "[web]\nlisten_address = \"127.0.0.1:1\"\n")
        .map_err(|e| ConfigError::Invalid(e.to_string()))?;
    let settings = Settings::load(&Overrides {
        config_file: Some(path),
        listen_addresses: vec!["127.0.0.1:2".into(), "127.0.0.1:3".into()],
        log_level: Some("debug".into()),
        ..Overrides::default()
    })?;
    assert_eq!(
        settings.listen_addresses,
        [
            "127.0.0.1:2".parse().expect("addr"),
            "127.0.0.1:3".parse().expect("addr")
        ]
    );
    assert_eq!(
        settings.log_level,
        tracing::level_filters::LevelFilter::DEBUG
    );
    Ok(())
}
