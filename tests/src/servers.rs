//! Real servers from Debian packages, started on loopback from a private temp dir, and
//! `wrk --latency` to drive them: the integration tests compare poolscope's numbers
//! with what wrk measured.
//!
//! Every server answers `GET /` with [`BODY`] (100 bytes). Each runs from its own temp
//! dir with config files written here (nothing read from /etc, no systemd); stdout and
//! stderr go to `server.log` there, which errors quote. Dropping a [`RealServer`]
//! stops the server and every process it started.
//!
//! Keep-alive is each server's default: nginx closes a connection after 1000
//! requests (`nginx-h2c`: never), Tomcat after 100, the gunicorn sync worker after
//! every request (it does not do keep-alive), gthread, Node.js and Go keep it open.
use std::{
    collections::{BTreeMap, HashMap},
    fs,
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream},
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::{bin_dir, wait_until};

// The Debian packages these servers come from are installed by `cargo xtask test`
// (`TEST_PACKAGES` in xtask/src/main.rs, the one list).

/// What every server answers to `GET /`: 100 bytes.
pub const BODY: &str = "real server body: 0123456789abcdefghijklmnopqrstuvwxyz \
                        0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ........\n";

/// Where Debian's tomcat10-common puts catalina.sh and the jars.
const CATALINA_HOME: &str = "/usr/share/tomcat10";

/// How long a stopping server may take before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// nginx: master + 1 worker, static file with sendfile.
    Nginx,
    /// The same nginx speaking cleartext HTTP/2 with prior knowledge (h2c, `listen
    /// PORT http2`) on its port, and HTTP/1.1 on [`RealServer::http1_port`] in the
    /// same server block: nginx 1.22 (Debian 12) answers an HTTP/1.1 request on an
    /// `http2` listener with a GOAWAY, so one port cannot serve both. No limit on
    /// requests per connection (`keepalive_requests`, which HTTP/2 uses too), and
    /// `/reset` answers with a stream reset (`return 444`: RST_STREAM
    /// INTERNAL_ERROR, the connection stays). No sendfile: with it, nginx 1.22 sends a
    /// response's file data in a write of its own after the HEADERS frame's, which
    /// Nagle holds until the client's delayed ACK: 44 ms per request with one stream
    /// per connection, against 25 µs without (measured with h2load).
    NginxH2c,
    /// Tomcat 10 (one JVM, NIO connector, default servlet serving a static file).
    Tomcat,
    /// gunicorn arbiter + 2 sync workers (one request at a time each).
    GunicornSync,
    /// gunicorn arbiter + 1 gthread worker with 4 threads.
    GunicornGthread,
    /// Node.js `http` module, one process.
    Node,
    /// Go `net/http`, one process.
    Go,
}

impl Kind {
    pub const ALL: &[Kind] = &[
        Kind::Nginx,
        Kind::NginxH2c,
        Kind::Tomcat,
        Kind::GunicornSync,
        Kind::GunicornGthread,
        Kind::Node,
        Kind::Go,
    ];

    pub fn name(&self) -> &'static str {
        match self {
            Kind::Nginx => "nginx",
            Kind::NginxH2c => "nginx-h2c",
            Kind::Tomcat => "tomcat",
            Kind::GunicornSync => "gunicorn-sync",
            Kind::GunicornGthread => "gunicorn-gthread",
            Kind::Node => "node",
            Kind::Go => "go",
        }
    }

    /// Processes the server runs once it is up (master + workers).
    fn processes(self, options: &Options) -> usize {
        match self {
            Kind::Nginx | Kind::NginxH2c => 1 + options.workers.unwrap_or(1) as usize,
            Kind::GunicornGthread => 2,
            Kind::GunicornSync => 3,
            Kind::Tomcat | Kind::Node | Kind::Go => 1,
        }
    }

    fn startup_timeout(self) -> Duration {
        match self {
            Kind::Tomcat => Duration::from_secs(60),
            _ => Duration::from_secs(30),
        }
    }
}

/// Variants of the servers for the thread-pool tests; `Options::default()` is what
/// [`RealServer::start`] runs.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// The threads that serve requests: Tomcat's `maxThreads`, gunicorn gthread's
    /// `--threads` (default 200 and 4).
    pub threads: Option<u32>,
    /// Also serve the slow paths besides `GET /`: `/sleep?ms=N` (Tomcat, gunicorn,
    /// Go) sleeps N ms before answering; `/spin?us=N` (Tomcat, Node.js, Go) runs on
    /// CPU for N µs; Tomcat's `/locked?ms=N` runs on CPU for N ms inside a
    /// `synchronized` block on one object shared by every request, so concurrent
    /// requests queue for that monitor (HotSpot parks them in futex waits; note that
    /// its `Thread.sleep` is a futex wait too, on a condition variable); Node.js also answers `/elu` with its cumulative event-loop idle and
    /// active milliseconds (`performance.eventLoopUtilization()`: "IDLE ACTIVE\n")
    /// and `/title?name=X` by setting `process.title` (which renames its main thread).
    pub work: bool,
    /// nginx: its `worker_processes` (default 1).
    pub workers: Option<u32>,
    /// nginx: log each request's status, one line each; the Go server: keep its count
    /// of answers in a file; for [`RealServer::statuses`] (off by default: nginx's log
    /// costs the other tests' throughput).
    pub access_log: bool,
    /// Tomcat: listen on all interfaces instead of 127.0.0.1. Tomcat names its threads
    /// after the connector, `http-nio-[ADDRESS-]PORT-exec-N`, and the kernel keeps 15
    /// characters: only without an address and with a 4-digit port do the exec
    /// threads keep a name (`http-nio-8080-e`) apart from the poller's and acceptor's.
    pub any_address: bool,
}

/// A running real server; stopped with all its processes when dropped.
pub struct RealServer {
    kind: Kind,
    port: u16,
    /// `nginx-h2c`'s HTTP/1.1 port.
    http1_port: Option<u16>,
    child: Child,
    dir: tempfile::TempDir,
}

impl RealServer {
    /// Starts `kind` on 127.0.0.1:`port` and waits until it answers `GET /` with
    /// [`BODY`] and all its workers run.
    pub fn start(kind: Kind, port: u16) -> anyhow::Result<Self> {
        Self::start_with(kind, port, &Options::default())
    }

    /// [`RealServer::start`] with [`Options`].
    pub fn start_with(kind: Kind, port: u16, options: &Options) -> anyhow::Result<Self> {
        // A server already there would answer the readiness check in our place.
        TcpListener::bind(("127.0.0.1", port))
            .with_context(|| format!("port {port} is in use, cannot start {}", kind.name()))?;
        let dir = tempfile::tempdir()?;
        // nginx workers run as nobody and read the file from here.
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755))?;
        let http1_port = match kind {
            Kind::NginxH2c => Some(crate::free_port()?),
            _ => None,
        };
        let mut command = match kind {
            Kind::Nginx => nginx(dir.path(), port, None, options)?,
            Kind::NginxH2c => nginx(dir.path(), port, http1_port, options)?,
            Kind::Tomcat => tomcat(dir.path(), port, options)?,
            Kind::GunicornSync => gunicorn(dir.path(), port, &["--workers", "2"], options.work)?,
            Kind::GunicornGthread => gunicorn(
                dir.path(),
                port,
                &[
                    "--workers",
                    "1",
                    "--worker-class",
                    "gthread",
                    "--threads",
                    &options.threads.unwrap_or(4).to_string(),
                ],
                options.work,
            )?,
            Kind::Node => node(dir.path(), port, options.work)?,
            Kind::Go => go(dir.path(), port, options)?,
        };
        let log = fs::File::create(dir.path().join("server.log"))?;
        let child = command
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {} ({:?})", kind.name(), command.get_program()))?;
        let mut server = Self {
            kind,
            port,
            http1_port,
            child,
            dir,
        };
        let ready = wait_until(kind.startup_timeout(), || {
            !matches!(server.child.try_wait(), Ok(None))
                || (server.answer().is_ok_and(|body| body == BODY)
                    && server.pids().len() >= kind.processes(options))
        });
        if let Some(status) = server.child.try_wait()? {
            bail!(
                "{} exited during startup ({status}):\n{}",
                kind.name(),
                server.log()
            );
        }
        if !ready {
            let answer = match server.answer() {
                Ok(body) => format!("answered {body:?}"),
                Err(error) => format!("{error:#}"),
            };
            bail!(
                "{} not ready on port {port} within {:?} ({answer}; processes {:?}):\n{}",
                kind.name(),
                kind.startup_timeout(),
                server.pids(),
                server.log()
            );
        }
        Ok(server)
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `nginx-h2c`'s HTTP/1.1 port (None for the other kinds).
    pub fn http1_port(&self) -> Option<u16> {
        self.http1_port
    }

    /// The readiness check: the body of `GET /` over HTTP/1.1; for `nginx-h2c`, on
    /// its HTTP/1.1 port once its h2c port answered one request.
    fn answer(&self) -> anyhow::Result<String> {
        match self.http1_port {
            Some(http1_port) => {
                crate::http2::h2c_answers(self.port)?;
                get_body(http1_port)
            }
            None => get_body(self.port),
        }
    }

    /// The spawned process and all its descendants (master and workers), sorted.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = descendants(self.child.id())
            .into_iter()
            .map(|(pid, _)| pid)
            .collect();
        pids.sort_unstable();
        pids
    }

    /// What the server wrote to stdout and stderr so far.
    /// With [`Options::access_log`], how many requests it answered with each status:
    /// nginx's access log (written as each request ends), the Go server's count (all
    /// `200`, kept every 20 ms: read it once its connections closed, and 20 ms on).
    pub fn statuses(&self) -> anyhow::Result<BTreeMap<u16, u64>> {
        let read = |name: &str| {
            let path = self.dir.path().join(name);
            fs::read_to_string(&path)
                .with_context(|| format!("reading {} (is access_log on?)", path.display()))
        };
        let mut statuses = BTreeMap::new();
        match self.kind {
            Kind::Nginx | Kind::NginxH2c => {
                for line in read(ACCESS_LOG)?.lines() {
                    let status = line.trim().parse().with_context(|| {
                        format!("a status line of nginx's access log: {line:?}")
                    })?;
                    *statuses.entry(status).or_default() += 1;
                }
            }
            Kind::Go => {
                let count = read(GO_ANSWERED)?;
                let count = count
                    .trim()
                    .parse()
                    .with_context(|| format!("the Go server's count: {count:?}"))?;
                statuses.insert(200, count);
            }
            _ => bail!("{} keeps no count of its answers", self.kind.name()),
        }
        Ok(statuses)
    }

    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }
}

impl Drop for RealServer {
    /// SIGTERM to the spawned process, whose shutdown stops and reaps its workers;
    /// what is left after [`STOP_GRACE`] is killed, workers first so that their
    /// master still reaps them (orphans' zombies may never be reaped by a container's
    /// init).
    fn drop(&mut self) {
        let root = self.child.id();
        signal(root, libc::SIGTERM);
        let deadline = Instant::now() + STOP_GRACE;
        while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
            sleep(Duration::from_millis(20));
        }
        if matches!(self.child.try_wait(), Ok(None)) {
            // A stopped master could not reap its workers.
            signal(root, libc::SIGCONT);
            for (pid, start) in descendants(root) {
                if pid != root && start_time(pid) == Some(start) {
                    signal(pid, libc::SIGKILL);
                }
            }
            sleep(Duration::from_millis(200));
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

fn signal(pid: u32, signal: i32) {
    // SAFETY: kill(2) has no memory effects; pids come from our own child's tree.
    unsafe { libc::kill(pid as i32, signal) };
}

/// Parent pid and start time (clock ticks since boot) from /proc/PID/stat.
fn stat(pid: u32) -> Option<(u32, u64)> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // comm (field 2) may hold spaces and parentheses: the fields after it follow the
    // last ')'. Field 3 is state, 4 ppid, 22 starttime.
    let fields: Vec<&str> = stat
        .get(stat.rfind(')')? + 1..)?
        .split_whitespace()
        .collect();
    Some((fields.get(1)?.parse().ok()?, fields.get(19)?.parse().ok()?))
}

fn start_time(pid: u32) -> Option<u64> {
    stat(pid).map(|(_, start)| start)
}

/// `root` and all its descendants that are alive, with their start times.
fn descendants(root: u32) -> Vec<(u32, u64)> {
    let mut children: HashMap<u32, Vec<(u32, u64)>> = HashMap::new();
    let mut root_start = None;
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        if let Some((ppid, start)) = stat(pid) {
            if pid == root {
                root_start = Some(start);
            }
            children.entry(ppid).or_default().push((pid, start));
        }
    }
    let Some(root_start) = root_start else {
        return Vec::new();
    };
    let mut found = vec![(root, root_start)];
    let mut next = 0;
    while let Some(&(pid, _)) = found.get(next) {
        found.extend(children.remove(&pid).unwrap_or_default());
        next += 1;
    }
    found
}

/// `GET /` over a fresh HTTP/1.1 connection; the body of a 200 response.
fn get_body(port: u16) -> anyhow::Result<String> {
    get(port, "/")
}

/// `GET path` from 127.0.0.1:`port` over a fresh HTTP/1.1 connection; the body of a
/// 200 response.
pub fn get(port: u16, path: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("no HTTP header end")?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("GET {path}: {}", head.lines().next().unwrap_or_default());
    }
    Ok(body.to_owned())
}

fn write(dir: &Path, name: &str, contents: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent)?;
    }
    fs::write(&path, contents).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

/// Where nginx logs each request's status with [`Options::access_log`].
const ACCESS_LOG: &str = "access.log";

/// nginx's config: HTTP/1.1 on `port`; or with `http1_port`, cleartext HTTP/2 on
/// `port` and HTTP/1.1 on `http1_port` (see [`Kind::NginxH2c`]).
fn nginx(
    dir: &Path,
    port: u16,
    http1_port: Option<u16>,
    options: &Options,
) -> anyhow::Result<Command> {
    write(dir, "www/index.txt", BODY)?;
    let d = dir.display();
    let workers = options.workers.unwrap_or(1);
    let access_log = if options.access_log {
        format!("log_format statuses '$status';\n    access_log {d}/{ACCESS_LOG} statuses;")
    } else {
        "access_log off;".to_owned()
    };
    let (listen, h2c) = match http1_port {
        None => (format!("listen 127.0.0.1:{port};"), ""),
        Some(http1_port) => (
            format!("listen 127.0.0.1:{port} http2;\n        listen 127.0.0.1:{http1_port};"),
            "    keepalive_requests 1000000000;
        sendfile off;
        location = /reset {
            return 444;
        }
        location = /fail {
            return 500;
        }
    ",
        ),
    };
    let config = write(
        dir,
        "nginx.conf",
        &format!(
            "daemon off;
master_process on;
worker_processes {workers};
pid {d}/nginx.pid;
error_log stderr warn;
events {{
    worker_connections 1024;
}}
http {{
    {access_log}
    sendfile on;
    tcp_nopush on;
    default_type text/plain;
    client_body_temp_path {d}/tmp/body;
    proxy_temp_path {d}/tmp/proxy;
    fastcgi_temp_path {d}/tmp/fastcgi;
    uwsgi_temp_path {d}/tmp/uwsgi;
    scgi_temp_path {d}/tmp/scgi;
    server {{
        {listen}
        root {d}/www;
        location = / {{
            try_files /index.txt =404;
        }}
    {h2c}}}
}}
"
        ),
    )?;
    fs::create_dir_all(dir.join("tmp"))?;
    let mut command = Command::new("nginx");
    command
        .arg("-p")
        .arg(dir)
        .arg("-e")
        .arg("stderr")
        .arg("-c")
        .arg(config);
    Ok(command)
}

fn tomcat(dir: &Path, port: u16, options: &Options) -> anyhow::Result<Command> {
    let address = if options.any_address {
        ""
    } else {
        r#"address="127.0.0.1" "#
    };
    let mut connector = format!(r#"{address}port="{port}""#);
    if let Some(threads) = options.threads {
        connector.push_str(&format!(r#" maxThreads="{threads}""#));
    }
    write(
        dir,
        "conf/server.xml",
        &format!(
            r#"<?xml version="1.0" encoding="UTF-8"?>
<Server port="-1" shutdown="SHUTDOWN">
  <Service name="Catalina">
    <Connector {connector} protocol="HTTP/1.1" connectionTimeout="20000"/>
    <Engine name="Catalina" defaultHost="localhost">
      <Host name="localhost" appBase="webapps" unpackWARs="false" autoDeploy="false"/>
    </Engine>
  </Service>
</Server>
"#
        ),
    )?;
    // The global web.xml declares the default servlet that serves static files.
    let web_xml = r#"<?xml version="1.0" encoding="UTF-8"?>
<web-app xmlns="https://jakarta.ee/xml/ns/jakartaee"
         xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"
         xsi:schemaLocation="https://jakarta.ee/xml/ns/jakartaee https://jakarta.ee/xml/ns/jakartaee/web-app_6_0.xsd"
         version="6.0">
  <servlet>
    <servlet-name>default</servlet-name>
    <servlet-class>org.apache.catalina.servlets.DefaultServlet</servlet-class>
    <init-param>
      <param-name>listings</param-name>
      <param-value>false</param-value>
    </init-param>
    <load-on-startup>1</load-on-startup>
  </servlet>
  <servlet-mapping>
    <servlet-name>default</servlet-name>
    <url-pattern>/</url-pattern>
  </servlet-mapping>
  <mime-mapping>
    <extension>txt</extension>
    <mime-type>text/plain</mime-type>
  </mime-mapping>
  <welcome-file-list>
    <welcome-file>index.txt</welcome-file>
  </welcome-file-list>
</web-app>
"#;
    if options.work {
        // /sleep, /spin and /locked are JSPs (Jasper compiles each with the JDT compiler
        // that libtomcat10-java depends on, on its first request).
        let work_servlets = r#"  <servlet>
    <servlet-name>jsp</servlet-name>
    <servlet-class>org.apache.jasper.servlet.JspServlet</servlet-class>
    <init-param>
      <param-name>development</param-name>
      <param-value>false</param-value>
    </init-param>
  </servlet>
  <servlet>
    <servlet-name>sleep</servlet-name>
    <jsp-file>/sleep.jsp</jsp-file>
  </servlet>
  <servlet-mapping>
    <servlet-name>sleep</servlet-name>
    <url-pattern>/sleep</url-pattern>
  </servlet-mapping>
  <servlet>
    <servlet-name>spin</servlet-name>
    <jsp-file>/spin.jsp</jsp-file>
  </servlet>
  <servlet-mapping>
    <servlet-name>spin</servlet-name>
    <url-pattern>/spin</url-pattern>
  </servlet-mapping>
  <servlet>
    <servlet-name>locked</servlet-name>
    <jsp-file>/locked.jsp</jsp-file>
  </servlet>
  <servlet-mapping>
    <servlet-name>locked</servlet-name>
    <url-pattern>/locked</url-pattern>
  </servlet-mapping>
  <mime-mapping>"#;
        write(
            dir,
            "conf/web.xml",
            &web_xml.replacen("  <mime-mapping>", work_servlets, 1),
        )?;
        write(
            dir,
            "webapps/ROOT/sleep.jsp",
            r#"<%@ page contentType="text/plain" session="false" trimDirectiveWhitespaces="true" %><%
Thread.sleep(Long.parseLong(request.getParameter("ms")));
out.print("slept\n");
%>"#,
        )?;
        write(
            dir,
            "webapps/ROOT/spin.jsp",
            r#"<%@ page contentType="text/plain" session="false" trimDirectiveWhitespaces="true" %><%
long end = System.nanoTime() + Long.parseLong(request.getParameter("us")) * 1000L;
while (System.nanoTime() < end) {
  Thread.onSpinWait();
}
out.print("spun\n");
%>"#,
        )?;
        // One monitor for every request, held on CPU (a spin, not Thread.sleep, so
        // that the holder itself makes no futex wait): concurrent requests queue for
        // it, parked in futex waits by HotSpot's ObjectMonitor.
        write(
            dir,
            "webapps/ROOT/locked.jsp",
            r#"<%@ page contentType="text/plain" session="false" trimDirectiveWhitespaces="true" %><%!
static final Object LOCK = new Object();
%><%
long hold = Long.parseLong(request.getParameter("ms")) * 1000000L;
synchronized (LOCK) {
  long end = System.nanoTime() + hold;
  while (System.nanoTime() < end) {
    Thread.onSpinWait();
  }
}
out.print("locked\n");
%>"#,
        )?;
    } else {
        write(dir, "conf/web.xml", web_xml)?;
    }
    write(dir, "webapps/ROOT/index.txt", BODY)?;
    for sub in ["logs", "temp", "work"] {
        fs::create_dir_all(dir.join(sub))?;
    }
    let mut command = Command::new(Path::new(CATALINA_HOME).join("bin/catalina.sh"));
    // catalina.sh run execs java: the spawned pid is the JVM.
    command
        .arg("run")
        .env("CATALINA_HOME", CATALINA_HOME)
        .env("CATALINA_BASE", dir)
        .env("CATALINA_TMPDIR", dir.join("temp"))
        // No /tmp/hsperfdata_* left behind.
        .env("JAVA_OPTS", "-Xms64m -Xmx256m -XX:-UsePerfData")
        .env_remove("CATALINA_OPTS");
    Ok(command)
}

fn gunicorn(dir: &Path, port: u16, workers: &[&str], work: bool) -> anyhow::Result<Command> {
    let (imports, sleep) = if work {
        (
            "import time\nfrom urllib.parse import parse_qs\n\n",
            "    if environ[\"PATH_INFO\"] == \"/sleep\":\n        \
             time.sleep(int(parse_qs(environ[\"QUERY_STRING\"])[\"ms\"][0]) / 1000)\n",
        )
    } else {
        ("", "")
    };
    let app = format!(
        "{imports}BODY = {BODY:?}.encode()
HEADERS = [(\"Content-Type\", \"text/plain\"), (\"Content-Length\", str(len(BODY)))]


def application(environ, start_response):
{sleep}    start_response(\"200 OK\", HEADERS)
    return [BODY]
"
    );
    write(dir, "app.py", &app)?;
    let mut command = Command::new("gunicorn");
    command
        .arg("--bind")
        .arg(format!("127.0.0.1:{port}"))
        .args(workers)
        .arg("--chdir")
        .arg(dir)
        .arg("--worker-tmp-dir")
        .arg(dir)
        .args(["--graceful-timeout", "3", "--log-level", "warning"])
        .arg("app:application")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("GUNICORN_CMD_ARGS");
    Ok(command)
}

fn node(dir: &Path, port: u16, work: bool) -> anyhow::Result<Command> {
    if work {
        let script = write(dir, "server.js", &node_work_source(port))?;
        let mut command = Command::new("node");
        command.arg(script);
        return Ok(command);
    }
    let script = write(
        dir,
        "server.js",
        &format!(
            "const http = require('http');
const body = Buffer.from({BODY:?});
const server = http.createServer((req, res) => {{
  res.writeHead(200, {{ 'Content-Type': 'text/plain', 'Content-Length': body.length }});
  res.end(body);
}});
process.on('SIGTERM', () => process.exit(0));
server.listen({port}, '127.0.0.1');
"
        ),
    )?;
    let mut command = Command::new("node");
    command.arg(script);
    Ok(command)
}

/// The Node.js server with the work paths of [`Options::work`].
fn node_work_source(port: u16) -> String {
    format!(
        "const http = require('http');
const {{ performance }} = require('perf_hooks');
const body = Buffer.from({BODY:?});
function answer(res, text) {{
  const data = Buffer.from(text);
  res.writeHead(200, {{ 'Content-Type': 'text/plain', 'Content-Length': data.length }});
  res.end(data);
}}
const server = http.createServer((req, res) => {{
  const url = new URL(req.url, 'http://localhost');
  switch (url.pathname) {{
    case '/spin': {{
      const end = process.hrtime.bigint() + BigInt(url.searchParams.get('us')) * 1000n;
      while (process.hrtime.bigint() < end) {{}}
      answer(res, 'spun\\n');
      break;
    }}
    case '/elu': {{
      const elu = performance.eventLoopUtilization();
      answer(res, `${{elu.idle}} ${{elu.active}}\\n`);
      break;
    }}
    case '/title':
      process.title = url.searchParams.get('name');
      answer(res, 'renamed\\n');
      break;
    default:
      res.writeHead(200, {{ 'Content-Type': 'text/plain', 'Content-Length': body.length }});
      res.end(body);
  }}
}});
process.on('SIGTERM', () => process.exit(0));
server.listen({port}, '127.0.0.1');
"
    )
}

fn go(dir: &Path, port: u16, options: &Options) -> anyhow::Result<Command> {
    let mut command = Command::new(go_binary(options.work)?);
    command.arg(port.to_string());
    if options.access_log {
        command.env("ANSWERED_FILE", dir.join(GO_ANSWERED));
    }
    Ok(command)
}

/// Where the Go server (without [`Options::work`]) keeps, with
/// [`Options::access_log`], how many requests it answered: rewritten every 20 ms.
const GO_ANSWERED: &str = "answered";

fn go_source(work: bool) -> String {
    if work {
        return go_work_source();
    }
    format!(
        "package main

import (
\t\"net/http\"
\t\"os\"
\t\"strconv\"
\t\"sync/atomic\"
\t\"time\"
)

const body = {BODY:?}

var answered atomic.Uint64

// Keeps the count of answered requests in the file ANSWERED_FILE names.
func keepCount(path string) {{
\tfor {{
\t\tcount := []byte(strconv.FormatUint(answered.Load(), 10))
\t\tif os.WriteFile(path+\".new\", count, 0o644) == nil {{
\t\t\tos.Rename(path+\".new\", path)
\t\t}}
\t\ttime.Sleep(20 * time.Millisecond)
\t}}
}}

func main() {{
\thttp.HandleFunc(\"/\", func(w http.ResponseWriter, r *http.Request) {{
\t\tw.Header().Set(\"Content-Type\", \"text/plain\")
\t\tw.Header().Set(\"Content-Length\", strconv.Itoa(len(body)))
\t\tw.Write([]byte(body))
\t\tanswered.Add(1)
\t}})
\tif path := os.Getenv(\"ANSWERED_FILE\"); path != \"\" {{
\t\tgo keepCount(path)
\t}}
\tif err := http.ListenAndServe(\"127.0.0.1:\"+os.Args[1], nil); err != nil {{
\t\tos.Stderr.WriteString(err.Error() + \"\\n\")
\t\tos.Exit(1)
\t}}
}}
"
    )
}

/// The Go server with the work paths of [`Options::work`].
fn go_work_source() -> String {
    format!(
        "package main

import (
\t\"net/http\"
\t\"os\"
\t\"strconv\"
\t\"time\"
)

const body = {BODY:?}

func answer(w http.ResponseWriter, text string) {{
\tw.Header().Set(\"Content-Type\", \"text/plain\")
\tw.Header().Set(\"Content-Length\", strconv.Itoa(len(text)))
\tw.Write([]byte(text))
}}

func number(r *http.Request, name string) time.Duration {{
\tn, _ := strconv.Atoi(r.URL.Query().Get(name))
\treturn time.Duration(n)
}}

func main() {{
\thttp.HandleFunc(\"/\", func(w http.ResponseWriter, r *http.Request) {{
\t\tanswer(w, body)
\t}})
\thttp.HandleFunc(\"/sleep\", func(w http.ResponseWriter, r *http.Request) {{
\t\ttime.Sleep(number(r, \"ms\") * time.Millisecond)
\t\tanswer(w, \"slept\\n\")
\t}})
\thttp.HandleFunc(\"/spin\", func(w http.ResponseWriter, r *http.Request) {{
\t\tend := time.Now().Add(number(r, \"us\") * time.Microsecond)
\t\tfor time.Now().Before(end) {{
\t\t}}
\t\tanswer(w, \"spun\\n\")
\t}})
\tif err := http.ListenAndServe(\"127.0.0.1:\"+os.Args[1], nil); err != nil {{
\t\tos.Stderr.WriteString(err.Error() + \"\\n\")
\t\tos.Exit(1)
\t}}
}}
"
    )
}

/// The Go server, built once per source text (std only: no network).
fn go_binary(work: bool) -> anyhow::Result<PathBuf> {
    build_go(&go_source(work), None)
}

/// A Go program, built once per source text under target/<profile>/real-servers/go;
/// with `packages`, in GOPATH mode against that tree of Go sources (Debian's
/// /usr/share/gocode, where its golang-*-dev packages put them), else with the
/// standard library only. Concurrent builds each build in their own dir and rename.
pub fn build_go(source: &str, packages: Option<&Path>) -> anyhow::Result<PathBuf> {
    use std::hash::{DefaultHasher, Hash as _, Hasher as _};
    let mut hasher = DefaultHasher::new();
    source.hash(&mut hasher);
    let cache = bin_dir()?.join("real-servers/go");
    let built = cache.join(format!("{:016x}", hasher.finish()));
    let binary = built.join("goserver");
    if binary.exists() {
        return Ok(binary);
    }
    fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let build = tempfile::tempdir_in(&cache)?;
    let main = write(build.path(), "main.go", source)?;
    let (gopath, modules) = match packages {
        Some(tree) => (tree.to_owned(), "off"),
        None => (cache.join("gopath"), ""),
    };
    let output = Command::new("go")
        .arg("build")
        .arg("-o")
        .arg(build.path().join("goserver"))
        .arg(&main)
        .current_dir(build.path())
        .env("HOME", &cache)
        .env("GOPATH", gopath)
        .env("GOCACHE", cache.join("gocache"))
        .env("GOFLAGS", "")
        .env("GO111MODULE", modules)
        .env("CGO_ENABLED", "0")
        .output()
        .context("running go build (is golang-go installed?)")?;
    if !output.status.success() {
        bail!(
            "go build failed ({}):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    // Another build may have won the race: its result is as good as ours.
    if let Err(error) = fs::rename(build.path(), &built)
        && !binary.exists()
    {
        return Err(error).with_context(|| format!("renaming to {}", built.display()));
    }
    Ok(binary)
}

/// What `wrk --latency` reported.
#[derive(Clone, Debug, PartialEq)]
pub struct WrkResult {
    /// Responses completed (`N requests in Xs`).
    pub requests: u64,
    pub p50: Duration,
    pub p99: Duration,
    /// Run time wrk measured (`in Xs`).
    pub seconds: f64,
    /// Socket errors (connect + read + write + timeout); 0 when wrk printed none.
    pub socket_errors: u64,
    /// Responses that were not 2xx or 3xx.
    pub non_2xx: u64,
}

impl WrkResult {
    pub fn requests_per_second(&self) -> f64 {
        self.requests as f64 / self.seconds
    }
}

/// Pins every thread of `pids` to CPU 0 (the load generator gets the last CPU).
pub fn pin_to_first_cpu(pids: &[u32]) -> anyhow::Result<()> {
    for pid in pids {
        let status = Command::new("taskset")
            .args(["-a", "-c", "-p", "0", &pid.to_string()])
            .stdout(Stdio::null())
            .status()
            .context("running taskset")?;
        anyhow::ensure!(status.success(), "taskset -a -c -p 0 {pid} failed");
    }
    Ok(())
}

/// Runs `wrk --latency` against `http://127.0.0.1:port/` for `duration` (whole
/// seconds, at least 1).
pub fn wrk(
    port: u16,
    threads: u32,
    connections: u32,
    duration: Duration,
) -> anyhow::Result<WrkResult> {
    wrk_path(port, "/", threads, connections, duration)
}

/// [`wrk`] against `http://127.0.0.1:port` + `path`.
pub fn wrk_path(
    port: u16,
    path: &str,
    threads: u32,
    connections: u32,
    duration: Duration,
) -> anyhow::Result<WrkResult> {
    run_wrk(port, path, threads, connections, duration, &[])
}

/// [`wrk`] asking for `Connection: close`: a connection per request.
pub fn wrk_closing(
    port: u16,
    threads: u32,
    connections: u32,
    duration: Duration,
) -> anyhow::Result<WrkResult> {
    run_wrk(
        port,
        "/",
        threads,
        connections,
        duration,
        &["-H", "Connection: close"],
    )
}

fn run_wrk(
    port: u16,
    path: &str,
    threads: u32,
    connections: u32,
    duration: Duration,
    extra: &[&str],
) -> anyhow::Result<WrkResult> {
    // wrk on the last CPU, away from the server (see `pin_to_first_cpu`): its own
    // scheduling delays would otherwise count as latency on its side only.
    let last_cpu = std::thread::available_parallelism().map_or(0, |n| n.get() - 1);
    let output = Command::new("taskset")
        .arg("-c")
        .arg(last_cpu.to_string())
        .arg("wrk")
        .arg("--latency")
        .arg(format!("-t{threads}"))
        .arg(format!("-c{connections}"))
        .arg(format!("-d{}s", duration.as_secs().max(1)))
        .args(extra)
        .arg(format!("http://127.0.0.1:{port}{path}"))
        .stdin(Stdio::null())
        .output()
        .context("running wrk (is it installed?)")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "wrk failed ({}):\n{stdout}{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    parse_wrk(&stdout).with_context(|| format!("parsing wrk output:\n{stdout}"))
}

/// A wrk time: a number and a unit (us, ms, s, m, h).
pub(crate) fn parse_time(text: &str) -> anyhow::Result<Duration> {
    let split = text
        .find(|c: char| c.is_ascii_alphabetic())
        .with_context(|| format!("no unit in {text:?}"))?;
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .with_context(|| format!("bad number in {text:?}"))?;
    let seconds_per_unit = match unit {
        "us" => 1e-6,
        "ms" => 1e-3,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => bail!("unknown unit in {text:?}"),
    };
    Duration::try_from_secs_f64(number * seconds_per_unit)
        .with_context(|| format!("bad time {text:?}"))
}

/// Parses the output of `wrk --latency`.
pub fn parse_wrk(output: &str) -> anyhow::Result<WrkResult> {
    let mut requests = None;
    let mut p50 = None;
    let mut p99 = None;
    let mut socket_errors = 0;
    let mut non_2xx = 0;
    let mut in_distribution = false;
    for line in output.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["Latency", "Distribution", ..] => in_distribution = true,
            ["50%", time] if in_distribution => p50 = Some(parse_time(time)?),
            ["99%", time] if in_distribution => {
                p99 = Some(parse_time(time)?);
                in_distribution = false;
            }
            [count, "requests", "in", time, ..] => {
                let count = count
                    .parse::<u64>()
                    .with_context(|| format!("bad request count in {line:?}"))?;
                let time = parse_time(time.trim_end_matches(','))?;
                requests = Some((count, time.as_secs_f64()));
            }
            ["Socket", "errors:", rest @ ..] => {
                // connect 0, read 0, write 0, timeout 0
                for count in rest.iter().skip(1).step_by(2) {
                    socket_errors += count
                        .trim_end_matches(',')
                        .parse::<u64>()
                        .with_context(|| format!("bad socket errors line {line:?}"))?;
                }
            }
            ["Non-2xx", "or", "3xx", "responses:", count] => {
                non_2xx = count
                    .parse()
                    .with_context(|| format!("bad non-2xx line {line:?}"))?;
            }
            _ => {}
        }
    }
    let (requests, seconds) = requests.context("no \"N requests in Xs\" line")?;
    Ok(WrkResult {
        requests,
        p50: p50.context("no 50% line in the latency distribution")?,
        p99: p99.context("no 99% line in the latency distribution")?,
        seconds,
        socket_errors,
        non_2xx,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `wrk --latency -t1 -c8 -d3s` against `RealServer::start(Kind::Nginx, ..)`.
    const NGINX: &str = "Running 3s test @ http://127.0.0.1:28090/
  1 threads and 8 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   208.96us  191.36us   4.57ms   97.16%
    Req/Sec    40.79k    10.69k   54.72k    53.33%
  Latency Distribution
     50%  167.00us
     75%  237.00us
     90%  302.00us
     99%  715.00us
  121520 requests in 3.00s, 39.17MB read
Requests/sec:  40502.06
Transfer/sec:     13.06MB
";

    /// The same against Tomcat.
    const TOMCAT: &str = "Running 3s test @ http://127.0.0.1:28090/
  1 threads and 8 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.71ms    9.48ms 106.38ms   95.74%
    Req/Sec    11.14k     5.89k   19.94k    60.00%
  Latency Distribution
     50%  439.00us
     75%    1.36ms
     90%    3.93ms
     99%   59.63ms
  33264 requests in 3.02s, 9.46MB read
Requests/sec:  11024.67
Transfer/sec:      3.14MB
";

    /// Against nginx, a path that is 404.
    const NOT_FOUND: &str = "Running 3s test @ http://127.0.0.1:28090/missing
  1 threads and 8 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   118.77us  130.05us   3.79ms   97.92%
    Req/Sec    71.07k    13.22k   90.50k    64.52%
  Latency Distribution
     50%  101.00us
     75%  124.00us
     90%  162.00us
     99%  317.00us
  218342 requests in 3.10s, 64.13MB read
  Non-2xx or 3xx responses: 218342
Requests/sec:  70434.47
Transfer/sec:     20.69MB
";

    /// `-t1 -c4 -d2s` against a server that closes every other connection unanswered.
    const SOCKET_ERRORS: &str = "Running 2s test @ http://127.0.0.1:28098/
  1 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   132.04us  150.24us   4.15ms   96.95%
    Req/Sec     7.44k   688.10     8.72k    57.14%
  Latency Distribution
     50%  106.00us
     75%  160.00us
     90%  213.00us
     99%  461.00us
  15536 requests in 2.10s, 0.87MB read
  Socket errors: connect 0, read 15536, write 0, timeout 0
Requests/sec:   7399.42
Transfer/sec:    426.33KB
";

    #[test]
    fn parses_real_wrk_output() {
        let nginx = parse_wrk(NGINX).unwrap();
        assert_eq!(
            nginx,
            WrkResult {
                requests: 121_520,
                p50: Duration::from_micros(167),
                p99: Duration::from_micros(715),
                seconds: 3.0,
                socket_errors: 0,
                non_2xx: 0,
            }
        );
        assert!((nginx.requests_per_second() - 40_506.7).abs() < 0.1);

        let tomcat = parse_wrk(TOMCAT).unwrap();
        assert_eq!(tomcat.requests, 33_264);
        assert_eq!(tomcat.p50, Duration::from_micros(439));
        assert_eq!(tomcat.p99, Duration::from_micros(59_630));
        assert!((tomcat.seconds - 3.02).abs() < 1e-9);

        let not_found = parse_wrk(NOT_FOUND).unwrap();
        assert_eq!(not_found.non_2xx, 218_342);
        assert_eq!(not_found.socket_errors, 0);
        assert_eq!(not_found.p99, Duration::from_micros(317));

        let errors = parse_wrk(SOCKET_ERRORS).unwrap();
        assert_eq!(errors.socket_errors, 15_536);
        assert_eq!(errors.requests, 15_536);
        assert!((errors.seconds - 2.1).abs() < 1e-9);
    }

    #[test]
    fn incomplete_wrk_output_is_an_error() {
        assert!(parse_wrk("").is_err());
        assert!(parse_wrk(&NGINX.replace("     99%  715.00us\n", "")).is_err());
        assert!(
            parse_wrk(&NGINX.replace("  121520 requests in 3.00s, 39.17MB read\n", "")).is_err()
        );
    }

    #[test]
    fn units() {
        assert_eq!(parse_time("512.00us").unwrap(), Duration::from_micros(512));
        assert_eq!(parse_time("1.50ms").unwrap(), Duration::from_micros(1500));
        assert_eq!(parse_time("2.00s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_time("1.00m").unwrap(), Duration::from_secs(60));
        assert!(parse_time("3.0").is_err());
        assert!(parse_time("3.0xs").is_err());
    }

    #[test]
    fn body_is_100_bytes() {
        assert_eq!(BODY.len(), 100);
    }

    #[test]
    fn kind_names_are_distinct() {
        let mut names: Vec<&str> = Kind::ALL.iter().map(Kind::name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Kind::ALL.len());
    }
}
