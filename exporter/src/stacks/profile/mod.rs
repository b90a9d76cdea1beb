//! Stack profiles of one snapshot and their renderings: folded stacks (Brendan
//! Gregg's format), an interactive SVG flame graph (inferno), and the gzipped pprof
//! protobuf that `go tool pprof`, Pyroscope and Parca read. Pure functions over
//! already symbolized [`StackRecord`]s.
//!
//! All three keep only the records their [`View`] shows. Folded stacks and the flame
//! graph are built from the same merged, sorted lines (pool name first, `_[k]` on
//! kernel frames, an `[off-cpu: <reason>]` leaf on off-CPU stacks), so they always
//! agree; pprof keeps one sample per record with the pool, service and reason as
//! labels, the way pprof tools expect to slice a profile.
//!
//! In the flame graph, a frame's color tells where its time went: warm when all of it
//! was on CPU, blue when all of it was off CPU, grey when both (the pool and the
//! frames the two kinds of stacks share). See [`svg`] for how inferno is made to do
//! that.
use std::time::{Duration, SystemTime};

mod flame;
mod folded;
mod pprof;

pub use flame::svg;
pub use folded::folded;
pub use pprof::pprof;

/// Why a thread was off CPU (the `reason` of `offcpu_seconds_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OffCpuReason {
    Lock,
    Disk,
    Network,
    Sleep,
    Idle,
    Other,
}

impl OffCpuReason {
    pub const fn name(self) -> &'static str {
        match self {
            Self::Lock => "lock",
            Self::Disk => "disk",
            Self::Network => "network",
            Self::Sleep => "sleep",
            Self::Idle => "idle",
            Self::Other => "other",
        }
    }
}

/// On-CPU samples, or off-CPU blocks for one reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum StackKind {
    Cpu,
    OffCpu(OffCpuReason),
}

/// One symbolized frame.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Frame {
    /// Function name, or `module+0xoffset` where no symbol is known.
    pub name: String,
    /// File name of the module (`libc.so.6`, `[kernel]`); empty if unknown.
    pub module: String,
    pub address: u64,
    pub kernel: bool,
}

/// One distinct stack of one thread pool, with its weight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackRecord {
    pub service: String,
    pub pool: String,
    pub kind: StackKind,
    /// Outermost first: user frames, then kernel frames.
    pub frames: Vec<Frame>,
    /// CPU samples, or off-CPU blocks.
    pub count: u64,
    /// Off-CPU: ns blocked; 0 for CPU samples.
    pub ns: u64,
}

/// Which records a rendering shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum View {
    Cpu,
    OffCpu,
    /// On-CPU and off-CPU together: where the threads' wall-clock time went.
    Wall,
}

/// What a rendering needs to know of the snapshot or session.
#[derive(Clone, Debug)]
pub struct ProfileMeta {
    pub sampling_hz: u32,
    pub started: SystemTime,
    pub duration: Duration,
    /// Notes for the reader: pprof comments (`go tool pprof -comments`), the flame
    /// graph's subtitle.
    pub comments: Vec<String>,
}

impl View {
    /// What the view shows, for titles.
    pub const fn title(self) -> &'static str {
        match self {
            Self::Cpu => "On-CPU",
            Self::OffCpu => "Off-CPU",
            Self::Wall => "Wall-clock (on-CPU and off-CPU)",
        }
    }
}

/// The renderings of a set of records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    #[default]
    Folded,
    Svg,
    Pprof,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Self::Folded => "text/plain; charset=utf-8",
            Self::Svg => "image/svg+xml",
            Self::Pprof => "application/octet-stream",
        }
    }
}

/// `records` rendered as `format`.
pub fn render(
    records: &[&StackRecord],
    view: View,
    meta: &ProfileMeta,
    format: Format,
    title: &str,
) -> Result<Vec<u8>, ProfileError> {
    Ok(match format {
        Format::Folded => folded(records, view, meta).into_bytes(),
        Format::Svg => svg(records, view, meta, title)?.into_bytes(),
        Format::Pprof => pprof(records, view, meta)?,
    })
}

/// The longest prefix of `records` (heaviest first) whose rendering fits in
/// `limit` bytes, rendered; with the number of records left out.
pub fn render_within(
    records: &[&StackRecord],
    limit: u64,
    render: impl Fn(&[&StackRecord]) -> Result<Vec<u8>, ProfileError>,
) -> Result<(Vec<u8>, usize), ProfileError> {
    let fits = |bytes: &[u8]| bytes.len() as u64 <= limit;
    let all = render(records)?;
    if fits(&all) {
        return Ok((all, 0));
    }
    // Binary search for the most records that fit; none always does (an empty
    // rendering is small, and the limit is at least 64 KiB).
    let (mut fitting, mut too_many) = (0, records.len());
    let mut best = render(&[])?;
    while too_many - fitting > 1 {
        let middle = fitting + (too_many - fitting) / 2;
        let bytes = render(&records[..middle])?;
        if fits(&bytes) {
            fitting = middle;
            best = bytes;
        } else {
            too_many = middle;
        }
    }
    Ok((best, records.len() - fitting))
}

impl View {
    /// Whether records of this kind belong in the view.
    const fn shows(self, kind: StackKind) -> bool {
        match (self, kind) {
            (Self::Wall, _) | (Self::Cpu, StackKind::Cpu) => true,
            (Self::OffCpu, StackKind::OffCpu(_)) => true,
            (Self::Cpu, StackKind::OffCpu(_)) | (Self::OffCpu, StackKind::Cpu) => false,
        }
    }
}

/// A rendering that could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("rendering the flame graph: {0}")]
    FlameGraph(#[source] std::io::Error),
    #[error("the flame graph is not UTF-8: {0}")]
    FlameGraphUtf8(#[from] std::string::FromUtf8Error),
    #[error("compressing the pprof profile: {0}")]
    Compress(#[source] std::io::Error),
}

const NANOS_PER_SEC: u128 = 1_000_000_000;
const MICROS_PER_SEC: u128 = 1_000_000;

/// `n / d` rounded to the nearest integer; 0 when `d` is 0 (sampling off: on-CPU
/// samples then have no known duration), `u64::MAX` when it does not fit.
fn div_round(n: u128, d: u128) -> u64 {
    if d == 0 {
        return 0;
    }
    u64::try_from(n.saturating_add(d / 2) / d).unwrap_or(u64::MAX)
}

/// Nanoseconds one on-CPU sample stands for.
fn sample_ns(count: u64, sampling_hz: u32) -> u64 {
    div_round(u128::from(count) * NANOS_PER_SEC, u128::from(sampling_hz))
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;

    pub(super) type TestResult = Result<(), Box<dyn std::error::Error>>;

    pub(super) fn user(name: &str, module: &str, address: u64) -> Frame {
        Frame {
            name: name.to_owned(),
            module: module.to_owned(),
            address,
            kernel: false,
        }
    }

    pub(super) fn kernel(name: &str, address: u64) -> Frame {
        Frame {
            name: name.to_owned(),
            module: "[kernel]".to_owned(),
            address,
            kernel: true,
        }
    }

    pub(super) fn record(
        pool: &str,
        kind: StackKind,
        frames: Vec<Frame>,
        count: u64,
        ns: u64,
    ) -> StackRecord {
        StackRecord {
            service: "web".to_owned(),
            pool: pool.to_owned(),
            kind,
            frames,
            count,
            ns,
        }
    }

    pub(super) fn meta(sampling_hz: u32) -> ProfileMeta {
        ProfileMeta {
            sampling_hz,
            started: UNIX_EPOCH + Duration::from_secs(1_700_000_000),
            duration: Duration::from_secs(60),
            comments: Vec::new(),
        }
    }

    /// Two pools; burner has on-CPU stacks (two of them the same, to be merged), a
    /// kernel frame, an empty one; blocked stacks for two reasons.
    pub(super) fn fixture() -> Vec<StackRecord> {
        let main = || user("main", "burner", 0x1000);
        let work = || user("work", "burner", 0x1100);
        let lock = || user("pthread_mutex_lock", "libc.so.6", 0x7f00);
        vec![
            record("burner", StackKind::Cpu, vec![main(), work()], 3, 0),
            record("burner", StackKind::Cpu, vec![main(), work()], 2, 0),
            record(
                "burner",
                StackKind::Cpu,
                vec![main(), work(), kernel("sys_write", 0xffff_0010)],
                1,
                0,
            ),
            record("burner", StackKind::Cpu, vec![main()], 0, 0),
            record(
                "burner",
                StackKind::OffCpu(OffCpuReason::Lock),
                vec![main(), lock(), kernel("futex_wait", 0xffff_0020)],
                4,
                2_000_400,
            ),
            record(
                "burner",
                StackKind::OffCpu(OffCpuReason::Lock),
                vec![main(), lock(), kernel("futex_wait", 0xffff_0020)],
                1,
                1_000_400,
            ),
            record(
                "io;pool",
                StackKind::OffCpu(OffCpuReason::Disk),
                vec![user("read file\nnow", "app", 0x2000)],
                1,
                499,
            ),
        ]
    }

    pub(super) fn refs(records: &[StackRecord]) -> Vec<&StackRecord> {
        records.iter().collect()
    }

    #[test]
    fn render_within_keeps_the_heaviest_records_that_fit() -> TestResult {
        let records = fixture();
        let refs = refs(&records);
        let render =
            |records: &[&StackRecord]| Ok(folded(records, View::Wall, &meta(50)).into_bytes());
        let (all, dropped) = render_within(&refs, u64::MAX, render)?;
        assert_eq!(dropped, 0);
        // Room for the first three records: the longest prefix that fits is kept.
        let limit = render(&refs[..3])?.len() as u64;
        let (cut, dropped) = render_within(&refs, limit, render)?;
        let kept = refs.len() - dropped;
        assert!(kept >= 3 && kept < refs.len(), "{kept}");
        assert_eq!(cut, render(&refs[..kept])?);
        assert!(render(&refs[..=kept])?.len() as u64 > limit);
        assert!(cut.len() < all.len());
        let (none, dropped) = render_within(&refs, 0, render)?;
        assert_eq!((none.len(), dropped), (0, refs.len()));
        Ok(())
    }
}
