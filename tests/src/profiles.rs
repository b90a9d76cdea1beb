//! Helpers for the stack-snapshot and profiling tests: GET with a binary body (pprof
//! is gzip), `stackburner`'s phase, waiting for the snapshots that cover a time span,
//! its report lines, folded-stack parsing, reading a pprof profile with the real `go tool pprof`, and
//! looking at a flame graph the way a person would: a headless Chromium screenshot of
//! the SVG, decoded, its pixels counted by color.
use std::{
    collections::HashMap,
    fs::File,
    io::{BufReader, Read as _, Write as _},
    net::TcpStream,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use crate::{Poolscope, Program, parse_tids, wait_until};

pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Starts `stackburner`'s measured phase (it listens on `port` for `go`).
pub fn start_phase(port: u16) -> anyhow::Result<()> {
    let mut start = TcpStream::connect(("127.0.0.1", port))?;
    start.write_all(b"go\n")?;
    let mut answer = String::new();
    std::io::BufRead::read_line(&mut BufReader::new(&start), &mut answer)?;
    anyhow::ensure!(answer == "ok\n", "stackburner answered go with {answer:?}");
    Ok(())
}

/// The `/debug/snapshots` entries once they cover `from`..`until` (unix seconds):
/// every stack of the span is in a snapshot once one has ended two `interval`s after
/// it (one more for the drain); an error if the oldest kept began after `from`.
pub fn snapshots_covering(
    poolscope: &Poolscope,
    from: f64,
    until: f64,
    interval: Duration,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut listing = serde_json::Value::Null;
    let settled = wait_until(4 * interval + Duration::from_secs(10), || {
        listing = poolscope
            .get("/debug/snapshots")
            .ok()
            .and_then(|text| serde_json::from_str(&text).ok())
            .unwrap_or_default();
        listing["snapshots"].as_array().is_some_and(|all| {
            all.iter().any(|s| {
                s["ended_unix_seconds"]
                    .as_f64()
                    .is_some_and(|ended| ended >= until + 2.0 * interval.as_secs_f64())
            })
        })
    });
    anyhow::ensure!(
        settled,
        "no snapshot ended {:?} after the span: {listing}",
        2 * interval
    );
    let listed = listing["snapshots"]
        .as_array()
        .context("no snapshots array")?
        .clone();
    let oldest = listed
        .iter()
        .filter_map(|s| s["started_unix_seconds"].as_f64())
        .fold(f64::INFINITY, f64::min);
    anyhow::ensure!(
        oldest <= from,
        "the oldest snapshot kept started at {oldest}, after the span did ({from}): \
         snapshots were dropped"
    );
    Ok(listed)
}

/// An HTTP response, its body as bytes.
#[derive(Clone, Debug)]
pub struct Response {
    pub status: u16,
    pub content_type: String,
    pub body: Vec<u8>,
}

impl Response {
    /// The body of a 200 response as text; an error naming the request otherwise.
    pub fn text(self, path: &str) -> anyhow::Result<String> {
        Ok(String::from_utf8(self.ok(path)?)?)
    }

    /// The body of a 200 response; an error naming the request otherwise.
    pub fn ok(self, path: &str) -> anyhow::Result<Vec<u8>> {
        if self.status != 200 {
            bail!(
                "GET {path}: status {}: {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            );
        }
        Ok(self.body)
    }
}

/// GET `path` from 127.0.0.1:`port` (HTTP/1.0: the body ends with the connection).
pub fn http_get(port: u16, path: &str) -> anyhow::Result<Response> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: test\r\n\r\n")?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let end = response
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .with_context(|| format!("GET {path}: no HTTP header end"))?;
    let head = String::from_utf8_lossy(&response[..end]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("GET {path}: status line of {head:?}"))?;
    let content_type = lines
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.eq_ignore_ascii_case("content-type"))
        .map(|(_, value)| value.trim().to_owned())
        .unwrap_or_default();
    Ok(Response {
        status,
        content_type,
        body: response[end + 4..].to_vec(),
    })
}

/// One folded stack: its frames (outermost first) and its weight.
pub type FoldedLine = (Vec<String>, u64);

/// Parses Brendan Gregg's folded format, `frame;frame;... weight` per line. The
/// weight is after the last space: frames may hold spaces (`[off-cpu: idle]`).
pub fn parse_folded(text: &str) -> anyhow::Result<Vec<FoldedLine>> {
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let (stack, weight) = line
                .rsplit_once(' ')
                .with_context(|| format!("folded line without a weight: {line:?}"))?;
            let weight = weight
                .parse()
                .with_context(|| format!("folded line's weight: {line:?}"))?;
            anyhow::ensure!(!stack.is_empty(), "folded line without frames: {line:?}");
            Ok((stack.split(';').map(str::to_owned).collect(), weight))
        })
        .collect()
}

/// The summed weight of the folded lines for which `keep` holds.
pub fn weight_of(lines: &[FoldedLine], mut keep: impl FnMut(&[String]) -> bool) -> u64 {
    lines
        .iter()
        .filter(|(frames, _)| keep(frames))
        .map(|(_, weight)| weight)
        .sum()
}

/// True if one of `frames` contains `name` (symbols carry their crate path and maybe
/// an offset: `stackburner::burn_one_quarter+0x12`).
pub fn names(frames: &[String], name: &str) -> bool {
    frames.iter().any(|frame| frame.contains(name))
}

/// Runs `command` (its stdout and stderr captured) for at most `timeout`; its stdout,
/// or an error with both when it fails or hangs.
fn run(mut command: Command, what: &str, timeout: Duration) -> anyhow::Result<String> {
    let output_dir = tempfile::tempdir()?;
    let (stdout_path, stderr_path) = (
        output_dir.path().join("stdout"),
        output_dir.path().join("stderr"),
    );
    let mut child = command
        .stdin(Stdio::null())
        .stdout(File::create(&stdout_path)?)
        .stderr(File::create(&stderr_path)?)
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "{what} still running after {timeout:?}:\n{}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = String::from_utf8_lossy(&std::fs::read(&stdout_path)?).into_owned();
    if !status.success() {
        bail!(
            "{what} failed ({status}):\n{stdout}\n{}",
            std::fs::read_to_string(&stderr_path).unwrap_or_default()
        );
    }
    Ok(stdout)
}

/// `go tool pprof -top` of a profile: a file (gzipped protobuf) or a URL that
/// serves one. `-symbolize=none`: the profile must carry its function names itself,
/// as it must on a machine that does not have the profiled binaries. Go gets its own
/// HOME and caches (it wants them writable, and the tests' HOME need not be).
pub fn pprof_top(source: impl AsRef<std::ffi::OsStr>) -> anyhow::Result<String> {
    go_pprof(&["-top", "-symbolize=none"], source)
}

/// `go tool pprof <args> <source>`, its stdout.
pub fn go_pprof(args: &[&str], source: impl AsRef<std::ffi::OsStr>) -> anyhow::Result<String> {
    let home = tempfile::tempdir()?;
    let mut command = Command::new("go");
    command
        .args(["tool", "pprof"])
        .args(args)
        .arg(source)
        .env("HOME", home.path())
        .env("GOPATH", home.path().join("gopath"))
        .env("GOCACHE", home.path().join("gocache"))
        .env("PPROF_TMPDIR", home.path().join("pprof"))
        .env("GOFLAGS", "");
    run(
        command,
        "go tool pprof (is golang-go installed?)",
        Duration::from_secs(180),
    )
}

/// `(flat %, cum %)` of the first line of `go tool pprof -top` output that names
/// `function`.
pub fn top_shares(top: &str, function: &str) -> Option<(f64, f64)> {
    let percent = |field: &str| field.trim_end_matches('%').parse::<f64>().ok();
    top.lines()
        .map(str::split_whitespace)
        .map(Iterator::collect::<Vec<_>>)
        .find(|fields| fields.len() >= 6 && fields[5..].iter().any(|f| f.contains(function)))
        .and_then(|fields| Some((percent(fields[1])?, percent(fields[4])?)))
}

/// The Chromium executable on PATH, if one is installed.
pub fn chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |dir| dir.join(name)))
        .find(|candidate| candidate.is_file())
}

/// A screenshot (PNG) of the page or image `page` as headless Chromium renders it in
/// a `width`×`height` window. `--no-sandbox`: Chromium refuses to run as root with its
/// sandbox (and the tests run as root); a profile directory of its own, or a second
/// Chromium would hand the page to the first and exit.
pub fn screenshot(page: &Path, png: &Path, width: u32, height: u32) -> anyhow::Result<()> {
    let browser = chromium().context("no Chromium on PATH (apt-get install chromium)")?;
    let profile = tempfile::tempdir()?;
    let page = std::path::absolute(page)?;
    let mut command = Command::new(browser);
    command
        .arg("--headless")
        .arg("--no-sandbox")
        .arg("--disable-gpu")
        .arg("--hide-scrollbars")
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!(
            "--screenshot={}",
            std::path::absolute(png)?.display()
        ))
        .arg(format!("--window-size={width},{height}"))
        .arg(format!("file://{}", page.display()))
        // Its caches and crash reports go under HOME: not the tests' HOME.
        .env("HOME", profile.path());
    run(command, "chromium", Duration::from_secs(120))?;
    anyhow::ensure!(
        png.metadata().is_ok_and(|m| m.len() > 0),
        "chromium wrote no screenshot to {}",
        png.display()
    );
    Ok(())
}

/// Pixels of a picture by color family.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Colors {
    pub pixels: u64,
    /// Red-dominant, saturated (flame graphs' on-CPU reds, oranges and yellows).
    pub warm: u64,
    /// Blue-dominant, saturated (the off-CPU blues).
    pub blue: u64,
}

impl Colors {
    fn add(&mut self, r: u8, g: u8, b: u8) {
        let (r, g, b) = (i32::from(r), i32::from(g), i32::from(b));
        self.pixels += 1;
        // Thresholds that leave out greys, whites and flame graphs' pale yellow
        // background (#eeeeb0 at its bottom).
        if r >= 150 && r >= g && r - b >= 90 {
            self.warm += 1;
        } else if b >= 120 && b - r >= 50 && b - g >= 30 {
            self.blue += 1;
        }
    }
}

/// Decodes a PNG and counts its pixels by color family (alpha ignored).
pub fn count_colors(png_path: &Path) -> anyhow::Result<Colors> {
    let file = File::open(png_path).with_context(|| format!("opening {}", png_path.display()))?;
    let mut decoder = png::Decoder::new(BufReader::new(file));
    // 8 bits per channel, palettes expanded: only the color types below remain.
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info()?;
    let size = reader
        .output_buffer_size()
        .context("PNG too large for memory")?;
    let mut buffer = vec![0; size];
    let info = reader.next_frame(&mut buffer)?;
    let channels = match info.color_type {
        png::ColorType::Rgb => 3,
        png::ColorType::Rgba => 4,
        png::ColorType::Grayscale => 1,
        png::ColorType::GrayscaleAlpha => 2,
        png::ColorType::Indexed => bail!("PNG palette not expanded"),
    };
    let mut colors = Colors::default();
    for row in buffer.chunks(info.line_size).take(info.height as usize) {
        for pixel in row.chunks_exact(channels).take(info.width as usize) {
            match pixel {
                [r, g, b, ..] => colors.add(*r, *g, *b),
                [gray, ..] => colors.add(*gray, *gray, *gray),
                [] => {}
            }
        }
    }
    Ok(colors)
}

/// A running `stackburner` (see its source): the program, its port and the tids of
/// its two threads.
pub struct Stackburner {
    pub program: Program,
    pub port: u16,
    pub burner: u32,
    pub sleeper: u32,
}

impl Stackburner {
    /// `stackburner` for a phase of `phase`, its sleeper sleeping `sleep_ms` at a time.
    pub fn start(phase: Duration, sleep_ms: f64) -> anyhow::Result<Self> {
        Self::of(Program::start("stackburner", &Self::args(phase, sleep_ms))?)
    }

    /// The same from a copy of the binary at `path`.
    pub fn start_path(path: &Path, phase: Duration, sleep_ms: f64) -> anyhow::Result<Self> {
        Self::of(Program::start_path(path, &Self::args(phase, sleep_ms))?)
    }

    fn args(phase: Duration, sleep_ms: f64) -> [String; 2] {
        [phase.as_secs_f64().to_string(), sleep_ms.to_string()]
    }

    /// Reads the port and the workers' tids that `program` prints first.
    fn of(mut program: Program) -> anyhow::Result<Self> {
        let port = program.line("port")?.parse()?;
        let tids = parse_tids(&program.line("workers")?)?;
        let [burner, sleeper] = tids[..] else {
            bail!("stackburner's workers: {tids:?}");
        };
        Ok(Self {
            program,
            port,
            burner,
            sleeper,
        })
    }
}

/// `key value key value ...` after a line's prefix.
pub fn fields(line: &str) -> anyhow::Result<HashMap<String, u64>> {
    let words: Vec<&str> = line.split_whitespace().collect();
    anyhow::ensure!(
        words.len().is_multiple_of(2),
        "not key-value pairs: {line:?}"
    );
    words
        .chunks(2)
        .map(|pair| Ok((pair[0].to_owned(), pair[1].parse()?)))
        .collect()
}

pub fn field(fields: &HashMap<String, u64>, key: &str) -> anyhow::Result<u64> {
    fields
        .get(key)
        .copied()
        .with_context(|| format!("no {key}"))
}

/// Prints the four heaviest of `lines`, each prefixed with `what` (`--nocapture`).
pub fn print_heaviest(what: &str, lines: &[FoldedLine]) {
    let mut sorted: Vec<&FoldedLine> = lines.iter().collect();
    sorted.sort_by_key(|(_, weight)| std::cmp::Reverse(*weight));
    for (frames, weight) in sorted.iter().take(4) {
        println!("{what}: {} {weight}", frames.join(";"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folded_lines_keep_frames_with_spaces() -> anyhow::Result<()> {
        let lines = parse_folded(
            "burner;main;stackburner::burn_three_quarters 30\n\
             sleeper;sleep_in_named_function;do_nanosleep_[k];[off-cpu: idle] 12000\n\n",
        )?;
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].0[2], "stackburner::burn_three_quarters");
        assert_eq!(lines[1].0[3], "[off-cpu: idle]");
        assert_eq!(weight_of(&lines, |f| f[0] == "burner"), 30);
        assert_eq!(weight_of(&lines, |f| names(f, "sleep_in_named")), 12000);
        assert!(parse_folded("a;b").is_err());
        assert!(parse_folded("a;b x").is_err());
        Ok(())
    }

    /// Chromium renders an SVG to a PNG here, and its colors count as they should:
    /// the flame graph test depends on both.
    #[test]
    fn chromium_screenshot_of_an_svg_counts_its_colors() -> anyhow::Result<()> {
        if chromium().is_none() {
            crate::skip(
                "chromium_screenshot_of_an_svg_counts_its_colors",
                "no Chromium on PATH (apt-get install chromium)",
            );
            return Ok(());
        }
        let dir = tempfile::tempdir()?;
        let svg = dir.path().join("two.svg");
        // Left half red (a hot palette's), the top quarter of the right half blue (an
        // off-CPU one), the rest white.
        std::fs::write(
            &svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="400" height="200">
<rect width="400" height="200" fill="white"/>
<rect x="0" y="0" width="200" height="200" fill="rgb(230,80,20)"/>
<rect x="200" y="0" width="200" height="50" fill="rgb(90,100,220)"/>
</svg>"#,
        )?;
        let png = dir.path().join("two.png");
        screenshot(&svg, &png, 400, 200)?;
        let colors = count_colors(&png)?;
        eprintln!("{colors:?}");
        assert_eq!(colors.pixels, 400 * 200);
        // Antialiasing may change a row or column of pixels at the edges.
        assert!(colors.warm.abs_diff(200 * 200) <= 2 * 200, "{colors:?}");
        assert!(colors.blue.abs_diff(200 * 50) <= 2 * 200, "{colors:?}");
        Ok(())
    }
}
