//! Kubernetes pod attribution against the real kernel: testservers in cgroups laid out
//! as kubelet lays out pod containers', each in a UTS namespace of its own with
//! `HOSTNAME` set as the container runtime sets it, watched by a real poolscope with
//! auto-discovery. Two replicas of one Deployment must be one service named after the
//! Deployment; a pod container whose pod name is unknown, or not to be trusted (a
//! `hostNetwork` pod shares the host's UTS namespace, where HOSTNAME is the node's
//! name), keeps `container-<id>`. With the kubelet's log links, a pod's sidecar and a
//! workload of the same name in another namespace are services apart (the mesh test).
use std::{
    ffi::CString,
    fs,
    io::{BufRead as _, BufReader},
    net::TcpStream,
    os::unix::{ffi::OsStrExt as _, process::CommandExt as _},
    path::Path,
    process::{Child, ChildStdin, Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, bail, ensure};
use poolscope_tests::{
    Metrics, Netns, PoolServer, Poolscope, backends, bin_dir,
    load::{ClosedLoop, Connections},
    one_at_a_time, parse_port,
    pods::{
        Cgroups, cgroup_mounts, check_placed, container_id, join_cgroup, log_link, move_into,
        pod_uid, systemd_driver_path, unified_hierarchy_unused,
    },
    privileged, scorecard, scrape_until, wait_until,
};

/// A `testserver` started in a pod-shaped cgroup; killed when dropped.
struct PodServer {
    child: Child,
    _stdin: ChildStdin,
    port: u16,
}

/// How a [`PodServer`] starts.
struct Pod<'a> {
    /// The cgroup directory it runs in from its first instruction on.
    cgroup: &'a Path,
    /// `HOSTNAME` in its environment (removed when `None`).
    hostname: Option<&'a str>,
    /// A UTS namespace of its own, as every pod without `hostNetwork` has.
    own_uts: bool,
}

impl PodServer {
    fn start(pod: &Pod) -> anyhow::Result<Self> {
        let procs = CString::new(pod.cgroup.join("cgroup.procs").as_os_str().as_bytes())?;
        let uts_hostname = pod
            .own_uts
            .then(|| CString::new(pod.hostname.unwrap_or("pod")))
            .transpose()?;
        let mut command = Command::new(bin_dir()?.join("testserver"));
        command
            .arg("64")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        match pod.hostname {
            Some(hostname) => command.env("HOSTNAME", hostname),
            None => command.env_remove("HOSTNAME"),
        };
        // SAFETY: between fork and exec the closure only makes system calls (open,
        // write, close, unshare, sethostname) on buffers prepared before the fork.
        unsafe {
            command.pre_exec(move || {
                join_cgroup(&procs)?;
                if let Some(name) = &uts_hostname
                    && (libc::unshare(libc::CLONE_NEWUTS) != 0
                        || libc::sethostname(name.as_ptr(), name.as_bytes().len()) != 0)
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("starting testserver in {}", pod.cgroup.display()))?;
        let stdin = child.stdin.take().context("no stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("no stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        let port = parse_port(&line, "testserver")?;
        Ok(Self {
            child,
            _stdin: stdin,
            port,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn connect(&self) -> anyhow::Result<TcpStream> {
        Ok(TcpStream::connect(("127.0.0.1", self.port))?)
    }
}

impl Drop for PodServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn pod_replicas_are_one_service_named_by_their_workload() -> anyhow::Result<()> {
    let test = "pod_replicas_are_one_service_named_by_their_workload";
    if !privileged(test) {
        return Ok(());
    }
    let _serial = one_at_a_time();
    let mounts = cgroup_mounts()?;
    // Dropped after the servers (declared before them): the cgroups are empty then.
    let mut cgroups = Cgroups::default();

    // Replica 1: cgroup v2, systemd driver, containerd.
    let replica_1_path = systemd_driver_path("besteffort", 1, "cri-containerd-");
    let replica_1_dir = cgroups.make(&mounts.unified, &replica_1_path)?;
    // Replica 2: cgroupfs driver; in the v1 systemd hierarchy where that is the one
    // poolscope reads (this process at the root of an unused v2 hierarchy).
    let replica_2_path = format!("kubepods/burstable/pod{}/{}", pod_uid(2), container_id(2));
    let replica_2_hierarchy = match &mounts.systemd_v1 {
        Some(systemd_v1) if unified_hierarchy_unused()? => systemd_v1.clone(),
        _ => mounts.unified.clone(),
    };
    eprintln!(
        "replica 1 in {}, replica 2 in {}",
        mounts.unified.display(),
        replica_2_hierarchy.display()
    );
    let replica_2_dir = cgroups.make(&replica_2_hierarchy, &replica_2_path)?;
    // A pod container without HOSTNAME in its environment (guaranteed QoS, CRI-O).
    let unnamed_path = systemd_driver_path("", 3, "crio-");
    let unnamed_dir = cgroups.make(&mounts.unified, &unnamed_path)?;
    // A hostNetwork pod: the host's UTS namespace, HOSTNAME that looks like a pod's.
    let host_network_path = systemd_driver_path("burstable", 4, "docker-");
    let host_network_dir = cgroups.make(&mounts.unified, &host_network_path)?;

    let replica_1 = PodServer::start(&Pod {
        cgroup: &replica_1_dir,
        hostname: Some("web-7d9f8c6b5-x2k4q"),
        own_uts: true,
    })?;
    let replica_2 = PodServer::start(&Pod {
        cgroup: &replica_2_dir,
        hostname: Some("web-7d9f8c6b5-p9zmt"),
        own_uts: true,
    })?;
    let unnamed = PodServer::start(&Pod {
        cgroup: &unnamed_dir,
        hostname: None,
        own_uts: true,
    })?;
    let host_network = PodServer::start(&Pod {
        cgroup: &host_network_dir,
        hostname: Some("web-7d9f8c6b5-h7vwn"),
        own_uts: false,
    })?;
    check_placed(replica_1.pid(), &replica_1_path)?;
    check_placed(replica_2.pid(), &replica_2_path)?;
    check_placed(unnamed.pid(), &unnamed_path)?;
    check_placed(host_network.pid(), &host_network_path)?;
    // Backlogs that tell the replicas' listeners apart: 2 and 1 waiting connections.
    let _clients = [
        replica_1.connect()?,
        replica_1.connect()?,
        replica_2.connect()?,
    ];

    let mut poolscope = Poolscope::start("[discovery]\nrescan_interval = \"500ms\"\n")?;
    let listener_1 = format!("127.0.0.1:{}", replica_1.port);
    let listener_2 = format!("127.0.0.1:{}", replica_2.port);
    let unnamed_service = format!("container-{}", &container_id(3)[..12]);
    let host_network_service = format!("container-{}", &container_id(4)[..12]);
    let metrics = scrape_until(&poolscope, |m| {
        m.value("poolscope_targets", &[("service", "web")]) == Some(2.0)
            && m.value(
                "poolscope_listen_queue_depth",
                &[("service", "web"), ("listener", &listener_1)],
            ) == Some(2.0)
            && m.value(
                "poolscope_listen_queue_depth",
                &[("service", "web"), ("listener", &listener_2)],
            ) == Some(1.0)
            && m.value("poolscope_targets", &[("service", &unnamed_service)]) == Some(1.0)
            && m.value("poolscope_targets", &[("service", &host_network_service)]) == Some(1.0)
    });
    let metrics = match metrics {
        Ok(metrics) => metrics,
        Err(error) => bail!("{error:#}\npoolscope log:\n{}", poolscope.stop_and_log()),
    };
    // Neither a pod name nor a half-stripped one is a service.
    for pod_name in [
        "web-7d9f8c6b5",
        "web-7d9f8c6b5-x2k4q",
        "web-7d9f8c6b5-p9zmt",
        "web-7d9f8c6b5-h7vwn",
    ] {
        assert!(
            !metrics.has_label("service", pod_name),
            "{pod_name} became a service"
        );
    }
    eprintln!(
        "poolscope_targets{{service=\"web\"}} 2; listen_queue_depth {listener_1} 2, \
         {listener_2} 1; {unnamed_service} 1; {host_network_service} 1"
    );
    Ok(())
}

/// A mesh sidecar's listener: the application's pod port is reached through it, as
/// Istio's or Linkerd's proxy intercepts a pod's traffic.
const PROXY_PORT: u16 = 15006;
/// The application's port, the same in both pods.
const APP_PORT: u16 = 8080;
/// The application's pool in each pod, and its service time: long enough that the
/// gauges hold still between scrapes.
const APP_WORKERS: u32 = 4;
const APP_SERVICE: Duration = Duration::from_millis(100);
/// Clients of pod A (through its proxy: twice its pool, so that half wait) and of pod
/// B (straight to its application, under its pool).
const CLIENTS_A: usize = 8;
const CLIENTS_B: usize = 2;
/// Requests each pod's clients complete at least before the counts are compared.
const MESH_LOAD: u64 = 60;

/// A proxy sidecar: nginx's stream proxy from [`PROXY_PORT`] to the application on
/// [`APP_PORT`], started in `cgroup` and network namespace `netns` from its first
/// instruction on (its workers too); killed when dropped.
struct Sidecar {
    child: Child,
    _dir: tempfile::TempDir,
}

impl Sidecar {
    fn start(cgroup: &Path, netns: &Netns) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let config = dir.path().join("nginx.conf");
        fs::write(
            &config,
            format!(
                "load_module /usr/lib/nginx/modules/ngx_stream_module.so;
daemon off;
master_process on;
worker_processes 1;
pid {d}/nginx.pid;
error_log stderr warn;
events {{
    worker_connections 1024;
}}
stream {{
    server {{
        listen 127.0.0.1:{PROXY_PORT};
        proxy_pass 127.0.0.1:{APP_PORT};
    }}
}}
",
                d = dir.path().display()
            ),
        )?;
        let procs = CString::new(cgroup.join("cgroup.procs").as_os_str().as_bytes())?;
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", netns.name(), "nginx", "-p"])
            .arg(dir.path())
            .args(["-e", "stderr", "-c"])
            .arg(&config)
            .stdin(Stdio::null());
        // SAFETY: between fork and exec the closure only makes system calls (open,
        // write, close) on a buffer prepared before the fork.
        unsafe {
            command.pre_exec(move || join_cgroup(&procs));
        }
        let child = command
            .spawn()
            .context("starting nginx (libnginx-mod-stream)")?;
        let sidecar = Self { child, _dir: dir };
        let listening = wait_until(Duration::from_secs(10), || {
            netns
                .run(|| Ok(TcpStream::connect(("127.0.0.1", PROXY_PORT)).is_ok()))
                .unwrap_or(false)
        });
        ensure!(listening, "the sidecar did not listen on {PROXY_PORT}");
        Ok(sidecar)
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        // nginx's master stops its workers on SIGTERM; `ip netns exec` exec'd it.
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// Two pods of workload `api` on one port, each in a network namespace of its own, in
/// namespaces `prod` and `staging`; `prod`'s with a proxy sidecar in front of its
/// application. The kubelet's log links name their containers. Truth: each client's
/// requests counted once at the proxy and once at `prod`'s application, `staging`'s
/// apart, matching the applications' own counts; the gauges of each service against
/// its pool and clients (merged services would add them up); the names of each.
fn mesh_pods(backend: &str) -> anyhow::Result<()> {
    let mounts = cgroup_mounts()?;
    let mut cgroups = Cgroups::default();
    let (netns_a, netns_b) = (Netns::new("mesh-a")?, Netns::new("mesh-b")?);
    let pod_a_app = systemd_driver_path("burstable", 11, "cri-containerd-");
    // The sidecar's container: pod A's cgroup, a container id of its own.
    let (pod_a, _) = pod_a_app.rsplit_once('/').context("a container path")?;
    let sidecar_id = container_id(12);
    let pod_a_sidecar = format!("{pod_a}/cri-containerd-{sidecar_id}.scope");
    let pod_b_app = systemd_driver_path("besteffort", 13, "cri-containerd-");
    let dirs = [
        cgroups.make(&mounts.unified, &pod_a_app)?,
        cgroups.make(&mounts.unified, &pod_a_sidecar)?,
        cgroups.make(&mounts.unified, &pod_b_app)?,
    ];
    let logs = tempfile::tempdir()?;
    log_link(
        logs.path(),
        "api-7d9f8c6b5-x2k4q",
        "prod",
        "api",
        &container_id(11),
    )?;
    log_link(
        logs.path(),
        "api-7d9f8c6b5-x2k4q",
        "prod",
        "istio-proxy",
        &sidecar_id,
    )?;
    log_link(
        logs.path(),
        "api-5f6c7d8b9-h7vwn",
        "staging",
        "api",
        &container_id(13),
    )?;

    let app_a = PoolServer::start_in(&netns_a, APP_PORT, APP_WORKERS, APP_SERVICE)?;
    move_into(&dirs[0], app_a.pid())?;
    let app_b = PoolServer::start_in(&netns_b, APP_PORT, APP_WORKERS, APP_SERVICE)?;
    move_into(&dirs[2], app_b.pid())?;
    let _sidecar = Sidecar::start(&dirs[1], &netns_a)?;
    check_placed(app_a.pid(), &pod_a_app)?;
    check_placed(app_b.pid(), &pod_b_app)?;

    let mut poolscope = Poolscope::start(&format!(
        "[probes]\nbackend = \"{backend}\"\n[discovery]\nrescan_interval = \"500ms\"\npod_logs_dir = \"{}\"\n",
        logs.path().display()
    ))?;
    let (app, proxy, staging) = ("prod.api.api", "prod.api.istio-proxy", "staging.api.api");
    let watched = scrape_until(&poolscope, |m| {
        [app, proxy, staging].iter().all(|service| {
            m.value("poolscope_targets", &[("service", service)])
                .is_some()
        }) && m.has_label("backend", backend)
    });
    if let Err(error) = watched {
        bail!("{error:#}\npoolscope log:\n{}", poolscope.stop_and_log());
    }
    let load_a = netns_a.run(|| {
        Ok(ClosedLoop::start(
            PROXY_PORT,
            CLIENTS_A,
            Connections::PerRequest,
        ))
    })?;
    let load_b = netns_b.run(|| {
        Ok(ClosedLoop::start(
            APP_PORT,
            CLIENTS_B,
            Connections::PerRequest,
        ))
    })?;
    // Under load: the proxy holds every client's request, the application serves its
    // pool's worth and queues the rest, staging serves its two clients.
    let gauge = |m: &Metrics, name: &str, service: &str| m.value(name, &[("service", service)]);
    let loaded = scrape_until(&poolscope, |m| {
        gauge(m, "poolscope_requests_in_flight", proxy) == Some(CLIENTS_A as f64)
            && gauge(m, "poolscope_queue_depth", proxy) == Some(0.0)
            && gauge(m, "poolscope_requests_in_flight", app) == Some(f64::from(APP_WORKERS))
            && gauge(m, "poolscope_queue_depth", app)
                == Some(CLIENTS_A as f64 - f64::from(APP_WORKERS))
            && gauge(m, "poolscope_requests_in_flight", staging) == Some(CLIENTS_B as f64)
            && gauge(m, "poolscope_queue_depth", staging) == Some(0.0)
    });
    let volume = wait_until(Duration::from_secs(60), || {
        load_a.completed() >= MESH_LOAD && load_b.completed() >= MESH_LOAD
    });
    let (sent_a, sent_b) = (load_a.stop()?.completed, load_b.stop()?.completed);
    let loaded = match loaded {
        Ok(metrics) => metrics,
        Err(error) => bail!("{backend}: gauges under load: {error:#}"),
    };
    ensure!(
        volume,
        "{backend}: too little load: {sent_a} and {sent_b} requests in 60 s"
    );
    for (service, in_flight, depth) in [
        (proxy, CLIENTS_A as f64, 0.0),
        (
            app,
            f64::from(APP_WORKERS),
            CLIENTS_A as f64 - f64::from(APP_WORKERS),
        ),
        (staging, CLIENTS_B as f64, 0.0),
    ] {
        scorecard::exact(
            "requests in flight of a pod container beside a sidecar",
            "the pool's size, or the clients it holds",
            backend,
            gauge(&loaded, "poolscope_requests_in_flight", service).unwrap_or(f64::NAN),
            in_flight,
        );
        scorecard::exact(
            "queue depth of a pod container beside a sidecar",
            "clients beyond the pool",
            backend,
            gauge(&loaded, "poolscope_queue_depth", service).unwrap_or(f64::NAN),
            depth,
        );
    }
    let requests = |m: &Metrics, service: &str| gauge(m, "poolscope_requests_total", service);
    let counted = scrape_until(&poolscope, |m| {
        requests(m, proxy) == Some(sent_a as f64)
            && requests(m, app) == Some(sent_a as f64)
            && requests(m, staging) == Some(sent_b as f64)
    });
    let (served_a, served_b) = (app_a.finish()?.count, app_b.finish()?.count);
    let metrics = match counted {
        Ok(metrics) => metrics,
        Err(error) => bail!(
            "{backend}: clients sent {sent_a} through the proxy, {sent_b} to staging; \
             the applications served {served_a} and {served_b}: {error:#}"
        ),
    };
    assert_eq!(
        (served_a, served_b),
        (sent_a, sent_b),
        "the applications' own counts"
    );
    for (service, sent) in [(proxy, sent_a), (app, sent_a), (staging, sent_b)] {
        scorecard::exact(
            "requests of a pod container beside a sidecar",
            "the clients' count (the application's own)",
            backend,
            requests(&metrics, service).unwrap_or(f64::NAN),
            sent as f64,
        );
    }
    for (service, namespace, container) in [
        (app, "prod", "api"),
        (proxy, "prod", "istio-proxy"),
        (staging, "staging", "api"),
    ] {
        let labels = [
            ("service", service),
            ("namespace", namespace),
            ("workload", "api"),
            ("container", container),
        ];
        assert_eq!(
            metrics.value("poolscope_kubernetes_info", &labels),
            Some(1.0),
            "{backend}: poolscope_kubernetes_info of {service}"
        );
    }
    // No other service: nothing of the pods merged under a name of its own.
    assert!(
        !metrics.has_label("service", "api"),
        "{backend}: a merged `api`"
    );
    eprintln!(
        "{backend}: {sent_a} requests through the proxy (counted at {proxy} and {app}), \
         {sent_b} to {staging}; under load in flight / queue depth: proxy {CLIENTS_A} / 0, \
         app {APP_WORKERS} / {}, staging {CLIENTS_B} / 0",
        CLIENTS_A - APP_WORKERS as usize
    );
    Ok(())
}

#[test]
fn mesh_sidecar_and_namespaces_are_services_apart() -> anyhow::Result<()> {
    if !privileged("mesh_sidecar_and_namespaces_are_services_apart") {
        return Ok(());
    }
    let _serial = one_at_a_time();
    for backend in backends() {
        mesh_pods(backend)?;
    }
    Ok(())
}
