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
use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use inferno::flamegraph::color::{BackgroundColor, Color, PaletteMap};
use prost::Message as _;

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

// ---------------------------------------------------------------------------------
// Folded stacks
// ---------------------------------------------------------------------------------

/// One merged folded line, its weight split by where the time went (the flame graph
/// colors by that split).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Line {
    stack: String,
    on_cpu: u64,
    off_cpu: u64,
}

impl Line {
    fn weight(&self) -> u64 {
        self.on_cpu.saturating_add(self.off_cpu)
    }
}

/// Raw totals of the records that fold to one line; converted to the view's unit
/// only once summed, so that merging does not add up rounding errors.
#[derive(Default, Clone, Copy)]
struct Totals {
    samples: u64,
    offcpu_ns: u64,
}

/// Appends a frame name with the characters the folded format reserves (`;` between
/// frames, newline between lines) replaced; an empty name would read as a missing frame.
fn push_frame(out: &mut String, name: &str) {
    if name.is_empty() {
        out.push_str("[unknown]");
        return;
    }
    out.extend(name.chars().map(|c| {
        if matches!(c, ';' | '\n' | '\r') {
            '_'
        } else {
            c
        }
    }));
}

/// The folded stack of one record, without its weight.
fn folded_stack(record: &StackRecord) -> String {
    let mut stack = String::with_capacity(32 * (record.frames.len() + 2));
    push_frame(&mut stack, &record.pool);
    for frame in &record.frames {
        stack.push(';');
        push_frame(&mut stack, &frame.name);
        if frame.kernel {
            stack.push_str("_[k]");
        }
    }
    if let StackKind::OffCpu(reason) = record.kind {
        stack.push_str(";[off-cpu: ");
        stack.push_str(reason.name());
        stack.push(']');
    }
    stack
}

/// The view's records merged into folded lines, sorted, without zero weights.
fn lines(records: &[&StackRecord], view: View, meta: &ProfileMeta) -> Vec<Line> {
    let mut merged: BTreeMap<String, Totals> = BTreeMap::new();
    for record in records.iter().filter(|r| view.shows(r.kind)) {
        let totals = merged.entry(folded_stack(record)).or_default();
        match record.kind {
            StackKind::Cpu => totals.samples = totals.samples.saturating_add(record.count),
            StackKind::OffCpu(_) => totals.offcpu_ns = totals.offcpu_ns.saturating_add(record.ns),
        }
    }
    merged
        .into_iter()
        .map(|(stack, totals)| Line {
            stack,
            on_cpu: on_cpu_weight(totals.samples, view, meta),
            off_cpu: div_round(u128::from(totals.offcpu_ns), 1000),
        })
        .filter(|line| line.weight() > 0)
        .collect()
}

/// On-CPU samples in the view's unit: samples in the cpu view, µs in the wall view.
fn on_cpu_weight(samples: u64, view: View, meta: &ProfileMeta) -> u64 {
    match view {
        View::Cpu => samples,
        View::OffCpu => 0,
        View::Wall => div_round(
            u128::from(samples) * MICROS_PER_SEC,
            u128::from(meta.sampling_hz),
        ),
    }
}

/// Folded stacks, one `frame;frame;... weight` line per distinct stack, outermost
/// frame (the pool) first. Weights: cpu = samples, offcpu and wall = microseconds.
pub fn folded(records: &[&StackRecord], view: View, meta: &ProfileMeta) -> String {
    let mut out = String::new();
    for line in lines(records, view, meta) {
        out.push_str(&line.stack);
        out.push(' ');
        out.push_str(&line.weight().to_string());
        out.push('\n');
    }
    out
}

// ---------------------------------------------------------------------------------
// Flame graph
// ---------------------------------------------------------------------------------

/// Where the time of one flame graph frame (a node of the merged stack tree) went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Spent {
    OnCpu,
    OffCpu,
    Both,
}

impl Spent {
    /// The tag appended to the frame's name in the flame graph input. inferno colors
    /// by name only, so a frame whose time went elsewhere needs another name; these
    /// four-character `_[x]` tags are the annotations inferno strips from the labels
    /// and tooltips (`_[w]` is its off-CPU "waker" tag; `_[j]` and `_[i]` are unused
    /// here otherwise, and no palette reads them since every color comes from the
    /// palette map). Every frame gets one, so a label always shows the folded name
    /// (with its `_[k]`) and a line never ends in a number that inferno would read as
    /// a second, differential count.
    const fn tag(self) -> &'static str {
        match self {
            Self::OnCpu => "_[j]",
            Self::OffCpu => "_[w]",
            Self::Both => "_[i]",
        }
    }

    /// The fill of a frame: the "hot" palette (red to yellow) on CPU, blue off CPU, a
    /// neutral grey where the frame's time is both. `name` varies the shade (the same
    /// name always gets the same color) so that neighbouring frames stay apart.
    fn color(self, name: &str) -> Color {
        let [a, b, c] = shades(name);
        match self {
            Self::OnCpu => Color {
                r: 205 + scale(50, c),
                g: scale(230, a),
                b: scale(55, b),
            },
            Self::OffCpu => Color {
                r: 80 + scale(60, a),
                g: 80 + scale(60, a),
                b: 205 + scale(50, b),
            },
            Self::Both => {
                let grey = 175 + scale(40, a);
                Color {
                    r: grey,
                    g: grey,
                    b: grey,
                }
            }
        }
    }
}

/// Three numbers in 0..=1 from a name (FNV-1a: stable across runs and machines,
/// unlike the std hasher).
fn shades(name: &str) -> [f32; 3] {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in name.bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    [0, 16, 32].map(|shift| f32::from((hash >> shift) as u16) / f32::from(u16::MAX))
}

/// `max × fraction`, for a fraction in 0..=1.
fn scale(max: u8, fraction: f32) -> u8 {
    (f32::from(max) * fraction.clamp(0.0, 1.0)) as u8
}

/// The merged stack tree of the folded lines, to learn where each frame's time went:
/// the same function can be on CPU in one stack and blocked in another, so the
/// verdict belongs to a path from the pool, not to a name.
#[derive(Default)]
struct StackTree<'a> {
    /// (parent node, frame name) → node; node 0 is the root above the pools.
    children: HashMap<(usize, &'a str), usize>,
    spent: Vec<(bool, bool)>,
}

impl<'a> StackTree<'a> {
    /// Adds a line's frames; returns their nodes, outermost first.
    fn add(&mut self, line: &'a Line) -> Vec<usize> {
        if self.spent.is_empty() {
            self.spent.push((false, false));
        }
        self.mark(0, line);
        let mut parent = 0;
        let mut nodes = Vec::new();
        for name in line.stack.split(';') {
            let next = self.spent.len();
            let node = *self.children.entry((parent, name)).or_insert(next);
            if node == next {
                self.spent.push((false, false));
            }
            self.mark(node, line);
            nodes.push(node);
            parent = node;
        }
        nodes
    }

    fn mark(&mut self, node: usize, line: &Line) {
        if let Some((on, off)) = self.spent.get_mut(node) {
            *on |= line.on_cpu > 0;
            *off |= line.off_cpu > 0;
        }
    }

    fn spent(&self, node: usize) -> Spent {
        match self.spent.get(node) {
            Some((true, false)) => Spent::OnCpu,
            Some((false, true)) => Spent::OffCpu,
            _ => Spent::Both,
        }
    }
}

/// The flame graph's input lines (each frame tagged by where its time went, see
/// [`Spent::tag`]) and the color of every tagged name.
fn flame_input(lines: &[Line]) -> (Vec<String>, PaletteMap) {
    let mut tree = StackTree::default();
    let paths: Vec<Vec<usize>> = lines.iter().map(|line| tree.add(line)).collect();
    let mut palette = PaletteMap::default();
    // inferno's root frame, "all", has the empty name.
    palette.insert("", tree.spent(0).color(""));
    let mut input = Vec::with_capacity(lines.len());
    for (line, nodes) in lines.iter().zip(&paths) {
        let mut tagged = String::with_capacity(line.stack.len() + 4 * nodes.len() + 24);
        for (i, (name, &node)) in line.stack.split(';').zip(nodes).enumerate() {
            if i > 0 {
                tagged.push(';');
            }
            let start = tagged.len();
            let spent = tree.spent(node);
            tagged.push_str(name);
            tagged.push_str(spent.tag());
            let tagged_name = &tagged[start..];
            if palette.get(tagged_name).is_none() {
                palette.insert(tagged_name, spent.color(tagged_name));
            }
        }
        tagged.push(' ');
        tagged.push_str(&line.weight().to_string());
        input.push(tagged);
    }
    (input, palette)
}

/// An interactive SVG flame graph (inferno) of the view, titled `title`. Widths are
/// samples in the cpu view and microseconds otherwise. Colors: on-CPU frames warm
/// ("hot" palette), off-CPU frames blue, frames with both kinds of time grey, so the
/// wall view shows each pool's whole time as one tower whose branches say where it
/// went. inferno picks colors by frame name only (its `func_frameattrs` cannot set a
/// fill), so every frame gets a hidden tag by where its time went ([`Spent::tag`]) and
/// the tagged names get precomputed colors through inferno's palette map; this also
/// makes the output deterministic.
pub fn svg(
    records: &[&StackRecord],
    view: View,
    meta: &ProfileMeta,
    title: &str,
) -> Result<String, ProfileError> {
    let lines = lines(records, view, meta);
    if lines.is_empty() {
        // inferno refuses to draw nothing.
        return Ok(empty_svg(title));
    }
    let (input, mut palette) = flame_input(&lines);
    let mut options = inferno::flamegraph::Options::default();
    options.title = title.to_owned();
    if !meta.comments.is_empty() {
        options.subtitle = Some(meta.comments.join("; "));
    }
    options.count_name = match view {
        View::Cpu => "samples",
        View::OffCpu | View::Wall => "µs",
    }
    .to_owned();
    options.bgcolors = Some(match view {
        View::Cpu => BackgroundColor::Yellow,
        View::OffCpu => BackgroundColor::Blue,
        View::Wall => BackgroundColor::Grey,
    });
    // Every name is in the palette map; deterministic is only a fallback.
    options.deterministic = true;
    options.palette_map = Some(&mut palette);
    let mut out = Vec::new();
    inferno::flamegraph::from_lines(&mut options, input.iter().map(String::as_str), &mut out)
        .map_err(ProfileError::FlameGraph)?;
    Ok(String::from_utf8(out)?)
}

/// A small SVG that says there is nothing to draw.
fn empty_svg(title: &str) -> String {
    format!(
        concat!(
            r#"<?xml version="1.0" standalone="no"?>"#,
            r#"<svg version="1.1" width="600" height="90" viewBox="0 0 600 90" "#,
            r#"xmlns="http://www.w3.org/2000/svg">"#,
            r#"<rect x="0" y="0" width="600" height="90" fill="rgb(238,238,238)"/>"#,
            r#"<text x="300" y="30" text-anchor="middle" font-family="Verdana" "#,
            r#"font-size="17">{}</text>"#,
            r#"<text x="300" y="65" text-anchor="middle" font-family="Verdana" "#,
            r#"font-size="12">no samples</text></svg>"#,
            "\n"
        ),
        xml_escape(title)
    )
}

fn xml_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

// ---------------------------------------------------------------------------------
// pprof
// ---------------------------------------------------------------------------------

/// The messages of `perftools.profiles` (github.com/google/pprof, proto/profile.proto)
/// that we write, by hand so that no protoc is needed. Tags are the proto's.
mod pb {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Profile {
        #[prost(message, repeated, tag = "1")]
        pub sample_type: Vec<ValueType>,
        #[prost(message, repeated, tag = "2")]
        pub sample: Vec<Sample>,
        #[prost(message, repeated, tag = "3")]
        pub mapping: Vec<Mapping>,
        #[prost(message, repeated, tag = "4")]
        pub location: Vec<Location>,
        #[prost(message, repeated, tag = "5")]
        pub function: Vec<Function>,
        #[prost(string, repeated, tag = "6")]
        pub string_table: Vec<String>,
        #[prost(int64, tag = "9")]
        pub time_nanos: i64,
        #[prost(int64, tag = "10")]
        pub duration_nanos: i64,
        #[prost(message, optional, tag = "11")]
        pub period_type: Option<ValueType>,
        #[prost(int64, tag = "12")]
        pub period: i64,
        #[prost(int64, repeated, tag = "13")]
        pub comment: Vec<i64>,
        #[prost(int64, tag = "14")]
        pub default_sample_type: i64,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct ValueType {
        #[prost(int64, tag = "1")]
        pub r#type: i64,
        #[prost(int64, tag = "2")]
        pub unit: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Sample {
        /// Innermost frame first.
        #[prost(uint64, repeated, tag = "1")]
        pub location_id: Vec<u64>,
        #[prost(int64, repeated, tag = "2")]
        pub value: Vec<i64>,
        #[prost(message, repeated, tag = "3")]
        pub label: Vec<Label>,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct Label {
        #[prost(int64, tag = "1")]
        pub key: i64,
        #[prost(int64, tag = "2")]
        pub str: i64,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct Mapping {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "5")]
        pub filename: i64,
        #[prost(bool, tag = "7")]
        pub has_functions: bool,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Location {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(uint64, tag = "2")]
        pub mapping_id: u64,
        #[prost(uint64, tag = "3")]
        pub address: u64,
        #[prost(message, repeated, tag = "4")]
        pub line: Vec<Line>,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct Line {
        #[prost(uint64, tag = "1")]
        pub function_id: u64,
    }

    #[derive(Clone, Copy, PartialEq, prost::Message)]
    pub struct Function {
        #[prost(uint64, tag = "1")]
        pub id: u64,
        #[prost(int64, tag = "2")]
        pub name: i64,
        #[prost(int64, tag = "3")]
        pub system_name: i64,
    }
}

/// The module pprof is told kernel frames come from (what `perf` calls it).
const KERNEL_MAPPING: &str = "[kernel.kallsyms]";

/// Builds a profile, deduplicating strings, mappings, functions and locations.
#[derive(Default)]
struct ProfileBuilder {
    profile: pb::Profile,
    strings: HashMap<String, i64>,
    mappings: HashMap<String, u64>,
    functions: HashMap<(String, String), u64>,
    locations: HashMap<(u64, String, String, bool), u64>,
}

impl ProfileBuilder {
    fn new() -> Self {
        let mut builder = Self::default();
        // pprof requires string_table[0] = "".
        builder.string("");
        builder
    }

    fn string(&mut self, s: &str) -> i64 {
        if let Some(&id) = self.strings.get(s) {
            return id;
        }
        let id = self.profile.string_table.len() as i64;
        self.profile.string_table.push(s.to_owned());
        self.strings.insert(s.to_owned(), id);
        id
    }

    fn value_type(&mut self, kind: &str, unit: &str) -> pb::ValueType {
        pb::ValueType {
            r#type: self.string(kind),
            unit: self.string(unit),
        }
    }

    /// The mapping of a module; 0 (pprof's "unknown") when the module is not known.
    fn mapping(&mut self, module: &str) -> u64 {
        if module.is_empty() {
            return 0;
        }
        if let Some(&id) = self.mappings.get(module) {
            return id;
        }
        let id = self.profile.mapping.len() as u64 + 1;
        let filename = self.string(module);
        // has_functions: the frames are symbolized already, pprof must not try.
        self.profile.mapping.push(pb::Mapping {
            id,
            filename,
            has_functions: true,
        });
        self.mappings.insert(module.to_owned(), id);
        id
    }

    fn function(&mut self, name: &str, module: &str) -> u64 {
        let key = (name.to_owned(), module.to_owned());
        if let Some(&id) = self.functions.get(&key) {
            return id;
        }
        let id = self.profile.function.len() as u64 + 1;
        let name = self.string(name);
        self.profile.function.push(pb::Function {
            id,
            name,
            system_name: name,
        });
        self.functions.insert(key, id);
        id
    }

    fn location(&mut self, frame: &Frame) -> u64 {
        let module = module(frame);
        let key = (
            frame.address,
            frame.name.clone(),
            module.to_owned(),
            frame.kernel,
        );
        if let Some(&id) = self.locations.get(&key) {
            return id;
        }
        let id = self.profile.location.len() as u64 + 1;
        let mapping_id = self.mapping(module);
        let function_id = self.function(&frame.name, module);
        self.profile.location.push(pb::Location {
            id,
            mapping_id,
            address: frame.address,
            line: vec![pb::Line { function_id }],
        });
        self.locations.insert(key, id);
        id
    }

    fn label(&mut self, key: &str, value: &str) -> pb::Label {
        pb::Label {
            key: self.string(key),
            str: self.string(value),
        }
    }

    fn sample(&mut self, record: &StackRecord, value: Vec<i64>) {
        // pprof calls the first mapping the main binary: let it be an outermost
        // frame's module, not the kernel's.
        for frame in &record.frames {
            self.mapping(module(frame));
        }
        // pprof lists the innermost frame first; records are outermost first.
        let location_id = record
            .frames
            .iter()
            .rev()
            .map(|frame| self.location(frame))
            .collect();
        let mut label = vec![
            self.label("service", &record.service),
            self.label("pool", &record.pool),
        ];
        if let StackKind::OffCpu(reason) = record.kind {
            label.push(self.label("reason", reason.name()));
        }
        self.profile.sample.push(pb::Sample {
            location_id,
            value,
            label,
        });
    }
}

/// The module pprof shows a frame in.
fn module(frame: &Frame) -> &str {
    if frame.kernel {
        KERNEL_MAPPING
    } else {
        &frame.module
    }
}

fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn nanos_i64(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

/// A record's sample values, in the order of [`sample_types`]: one sampling period
/// per on-CPU sample.
fn sample_values(record: &StackRecord, view: View, meta: &ProfileMeta) -> Vec<i64> {
    let count = to_i64(record.count);
    let ns = to_i64(match record.kind {
        StackKind::Cpu => sample_ns(record.count, meta.sampling_hz),
        StackKind::OffCpu(_) => record.ns,
    });
    match (view, record.kind) {
        (View::Cpu | View::OffCpu, _) => vec![count, ns],
        (View::Wall, StackKind::Cpu) => vec![count, ns, 0, 0, ns],
        (View::Wall, StackKind::OffCpu(_)) => vec![0, 0, count, ns, ns],
    }
}

/// The (type, unit) of each sample value of the view, and the default type. The
/// wall view carries both kinds apart (`-sample_index=cpu` or `offcpu` picks one)
/// and their sum.
fn sample_types(view: View) -> (&'static [(&'static str, &'static str)], &'static str) {
    match view {
        View::Cpu => (&[("samples", "count"), ("cpu", "nanoseconds")], "cpu"),
        View::OffCpu => (&[("events", "count"), ("offcpu", "nanoseconds")], "offcpu"),
        View::Wall => (
            &[
                ("samples", "count"),
                ("cpu", "nanoseconds"),
                ("events", "count"),
                ("offcpu", "nanoseconds"),
                ("wall", "nanoseconds"),
            ],
            "wall",
        ),
    }
}

/// The gzipped pprof protobuf (`perftools.profiles.Profile`) of the view (values:
/// [`sample_types`]); one sample per record, labelled with its service, pool and
/// (off CPU) reason; `meta.comments` as the profile's comments.
pub fn pprof(
    records: &[&StackRecord],
    view: View,
    meta: &ProfileMeta,
) -> Result<Vec<u8>, ProfileError> {
    let mut builder = ProfileBuilder::new();
    let (types, default) = sample_types(view);
    builder.profile.sample_type = types
        .iter()
        .map(|(kind, unit)| builder.value_type(kind, unit))
        .collect();
    builder.profile.default_sample_type = builder.string(default);
    // The period is that of the on-CPU samples; off-CPU blocks have none.
    if view != View::OffCpu {
        builder.profile.period_type = Some(builder.value_type("cpu", "nanoseconds"));
        builder.profile.period = to_i64(sample_ns(1, meta.sampling_hz));
    }
    builder.profile.time_nanos = meta.started.duration_since(UNIX_EPOCH).map_or(0, nanos_i64);
    builder.profile.duration_nanos = nanos_i64(meta.duration);
    builder.profile.comment = meta
        .comments
        .iter()
        .map(|comment| builder.string(comment))
        .collect();
    for record in records.iter().filter(|r| view.shows(r.kind)) {
        let value = sample_values(record, view, meta);
        if value.iter().any(|&v| v > 0) {
            builder.sample(record, value);
        }
    }
    gzip(&builder.profile.encode_to_vec())
}

fn gzip(bytes: &[u8]) -> Result<Vec<u8>, ProfileError> {
    let mut encoder = flate2::write::GzEncoder::new(
        Vec::with_capacity(bytes.len() / 4 + 64),
        flate2::Compression::default(),
    );
    encoder.write_all(bytes).map_err(ProfileError::Compress)?;
    encoder.finish().map_err(ProfileError::Compress)
}

#[cfg(test)]
mod tests {
    use std::io::Read as _;

    use super::*;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn user(name: &str, module: &str, address: u64) -> Frame {
        Frame {
            name: name.to_owned(),
            module: module.to_owned(),
            address,
            kernel: false,
        }
    }

    fn kernel(name: &str, address: u64) -> Frame {
        Frame {
            name: name.to_owned(),
            module: "[kernel]".to_owned(),
            address,
            kernel: true,
        }
    }

    fn record(pool: &str, kind: StackKind, frames: Vec<Frame>, count: u64, ns: u64) -> StackRecord {
        StackRecord {
            service: "web".to_owned(),
            pool: pool.to_owned(),
            kind,
            frames,
            count,
            ns,
        }
    }

    fn meta(sampling_hz: u32) -> ProfileMeta {
        ProfileMeta {
            sampling_hz,
            started: UNIX_EPOCH + Duration::from_secs(1_700_000_000),
            duration: Duration::from_secs(60),
            comments: Vec::new(),
        }
    }

    /// Two pools; burner has on-CPU stacks (two of them the same, to be merged), a
    /// kernel frame, an empty one; blocked stacks for two reasons.
    fn fixture() -> Vec<StackRecord> {
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

    fn refs(records: &[StackRecord]) -> Vec<&StackRecord> {
        records.iter().collect()
    }

    #[test]
    fn folded_cpu_merges_and_suffixes_kernel_frames() {
        let records = fixture();
        let out = folded(&refs(&records), View::Cpu, &meta(50));
        assert_eq!(
            out,
            "burner;main;work 5\n\
             burner;main;work;sys_write_[k] 1\n"
        );
    }

    #[test]
    fn folded_offcpu_in_microseconds_with_reason_frame() {
        let records = fixture();
        let out = folded(&refs(&records), View::OffCpu, &meta(50));
        // 2_000_400 + 1_000_400 ns merged before rounding; 499 ns rounds to 0 µs and
        // the line is dropped.
        assert_eq!(
            out,
            "burner;main;pthread_mutex_lock;futex_wait_[k];[off-cpu: lock] 3001\n"
        );
    }

    #[test]
    fn folded_wall_converts_samples_to_microseconds() {
        let records = fixture();
        let out = folded(&refs(&records), View::Wall, &meta(50));
        // hz = 50: one sample is 20000 µs.
        assert_eq!(
            out,
            "burner;main;pthread_mutex_lock;futex_wait_[k];[off-cpu: lock] 3001\n\
             burner;main;work 100000\n\
             burner;main;work;sys_write_[k] 20000\n"
        );
    }

    #[test]
    fn folded_replaces_reserved_characters() {
        let records = vec![record(
            "io;pool",
            StackKind::OffCpu(OffCpuReason::Disk),
            vec![user("read file\nnow", "app", 0x2000), user("", "", 0)],
            1,
            1_500,
        )];
        let out = folded(&refs(&records), View::OffCpu, &meta(50));
        assert_eq!(out, "io_pool;read file_now;[unknown];[off-cpu: disk] 2\n");
    }

    #[test]
    fn folded_of_nothing_is_empty() {
        assert_eq!(folded(&[], View::Wall, &meta(50)), "");
    }

    #[test]
    fn folded_wall_without_sampling_keeps_offcpu() {
        let records = fixture();
        let out = folded(&refs(&records), View::Wall, &meta(0));
        assert_eq!(
            out,
            "burner;main;pthread_mutex_lock;futex_wait_[k];[off-cpu: lock] 3001\n"
        );
    }

    /// The `fill`s of the flame graph's frames (the rectangles with a width in
    /// samples, `fg:w`), as `r,g,b`.
    fn fills(svg: &str) -> Vec<&str> {
        svg.split("<rect ")
            .filter_map(|rect| rect.split('>').next())
            .filter(|rect| rect.contains("fg:w="))
            .filter_map(|rect| rect.split("fill=\"rgb(").nth(1))
            .filter_map(|rest| rest.split(')').next())
            .collect()
    }

    fn rgb(color: Color) -> String {
        format!("{},{},{}", color.r, color.g, color.b)
    }

    /// Whether there are frames and every frame's fill passes `test`.
    fn all_fills(svg: &str, test: fn(Color) -> bool) -> bool {
        let fills = fills(svg);
        !fills.is_empty()
            && fills.iter().all(|fill| {
                let parts: Vec<u8> = fill.split(',').filter_map(|p| p.parse().ok()).collect();
                matches!(parts[..], [r, g, b] if test(Color { r, g, b }))
            })
    }

    fn is_warm(color: Color) -> bool {
        color.r >= 200 && color.b <= 60
    }

    fn is_blue(color: Color) -> bool {
        color.b >= 200 && color.r <= 140 && color.g <= 140
    }

    #[test]
    fn svg_cpu_view_is_warm_and_names_frames() -> TestResult {
        let records = fixture();
        let out = svg(&refs(&records), View::Cpu, &meta(50), "burner on CPU")?;
        assert!(out.contains("<svg"));
        assert!(out.contains("burner on CPU"));
        for name in ["burner", "main", "work", "sys_write_[k]"] {
            assert!(out.contains(&format!("<title>{name} (")), "{name} missing");
        }
        assert!(out.contains("samples"));
        // The tags that pick colors never show.
        assert!(!out.contains("_[j]"));
        let work = Spent::OnCpu.color("work_[j]");
        assert!(is_warm(work));
        assert!(fills(&out).contains(&rgb(work).as_str()));
        assert!(all_fills(&out, is_warm));
        Ok(())
    }

    #[test]
    fn svg_wall_view_colors_on_and_off_cpu_apart() -> TestResult {
        let records = fixture();
        let out = svg(&refs(&records), View::Wall, &meta(50), "wall")?;
        assert!(out.contains("µs"));
        let fills = fills(&out);
        // On CPU only: warm.
        let work = Spent::OnCpu.color("work_[j]");
        assert!(is_warm(work), "{work:?}");
        assert!(fills.contains(&rgb(work).as_str()));
        // Off CPU only: blue, the kernel frame and the reason too.
        for name in [
            "pthread_mutex_lock_[w]",
            "futex_wait_[k]_[w]",
            "[off-cpu: lock]_[w]",
        ] {
            let color = Spent::OffCpu.color(name);
            assert!(is_blue(color), "{name}: {color:?}");
            assert!(fills.contains(&rgb(color).as_str()), "{name}");
        }
        // Both (the pool and main): grey, one frame each.
        for name in ["burner_[i]", "main_[i]"] {
            let color = Spent::Both.color(name);
            assert!(color.r == color.g && color.g == color.b, "{name}");
            assert!(fills.contains(&rgb(color).as_str()), "{name}");
        }
        assert_eq!(out.matches("<title>main (").count(), 1);
        assert!(out.contains("<title>futex_wait_[k] ("));
        assert!(out.contains("<title>[off-cpu: lock] ("));
        Ok(())
    }

    #[test]
    fn svg_is_deterministic() -> TestResult {
        let records = fixture();
        let first = svg(&refs(&records), View::Wall, &meta(50), "wall")?;
        let second = svg(&refs(&records), View::Wall, &meta(50), "wall")?;
        assert_eq!(first, second);
        Ok(())
    }

    #[test]
    fn svg_offcpu_view_is_blue() -> TestResult {
        let records = fixture();
        let out = svg(&refs(&records), View::OffCpu, &meta(50), "blocked")?;
        assert!(all_fills(&out, is_blue));
        Ok(())
    }

    #[test]
    fn svg_of_nothing_says_so() -> TestResult {
        let out = svg(&[], View::Cpu, &meta(50), "a <b> & c")?;
        assert!(out.starts_with("<?xml"));
        assert!(out.contains("<svg"));
        assert!(out.contains("no samples"));
        assert!(out.contains("a &lt;b&gt; &amp; c"));
        assert!(out.trim_end().ends_with("</svg>"));
        Ok(())
    }

    #[test]
    fn svg_frame_name_ending_in_a_number_is_not_a_differential() -> TestResult {
        let records = vec![record(
            "p",
            StackKind::Cpu,
            vec![user("f 12", "m", 1)],
            7,
            0,
        )];
        let out = svg(&refs(&records), View::Cpu, &meta(50), "t")?;
        assert!(out.contains("<title>f 12 (7 samples"), "{out}");
        Ok(())
    }

    fn decode(gz: &[u8]) -> Result<pb::Profile, Box<dyn std::error::Error>> {
        let mut bytes = Vec::new();
        flate2::read::GzDecoder::new(gz).read_to_end(&mut bytes)?;
        Ok(pb::Profile::decode(bytes.as_slice())?)
    }

    fn string(profile: &pb::Profile, id: i64) -> &str {
        usize::try_from(id)
            .ok()
            .and_then(|i| profile.string_table.get(i))
            .map_or("<bad string id>", String::as_str)
    }

    fn types_of(profile: &pb::Profile) -> Vec<(String, String)> {
        profile
            .sample_type
            .iter()
            .map(|vt| value_type(profile, vt))
            .collect()
    }

    fn value_type(profile: &pb::Profile, vt: &pb::ValueType) -> (String, String) {
        (
            string(profile, vt.r#type).to_owned(),
            string(profile, vt.unit).to_owned(),
        )
    }

    /// The function names of a sample's locations, in the sample's order.
    fn function_names<'a>(profile: &'a pb::Profile, sample: &pb::Sample) -> Vec<&'a str> {
        sample
            .location_id
            .iter()
            .map(|id| {
                let location = profile.location.iter().find(|l| l.id == *id);
                let function_id = location.and_then(|l| l.line.first()).map(|l| l.function_id);
                let function = profile.function.iter().find(|f| Some(f.id) == function_id);
                function.map_or("<missing>", |f| string(profile, f.name))
            })
            .collect()
    }

    fn labels<'a>(profile: &'a pb::Profile, sample: &pb::Sample) -> Vec<(&'a str, &'a str)> {
        sample
            .label
            .iter()
            .map(|l| (string(profile, l.key), string(profile, l.str)))
            .collect()
    }

    #[test]
    fn pprof_cpu_view() -> TestResult {
        let records = fixture();
        let profile = decode(&pprof(&refs(&records), View::Cpu, &meta(50))?)?;
        assert_eq!(profile.string_table.first().map(String::as_str), Some(""));
        let types = types_of(&profile);
        assert_eq!(
            types,
            [
                ("samples".to_owned(), "count".to_owned()),
                ("cpu".to_owned(), "nanoseconds".to_owned())
            ]
        );
        let period_type = profile.period_type.map(|vt| value_type(&profile, &vt));
        assert_eq!(
            period_type,
            Some(("cpu".to_owned(), "nanoseconds".to_owned()))
        );
        assert_eq!(profile.period, 20_000_000);
        assert_eq!(string(&profile, profile.default_sample_type), "cpu");
        assert_eq!(profile.time_nanos, 1_700_000_000_000_000_000);
        assert_eq!(profile.duration_nanos, 60_000_000_000);
        // The zero-count record is left out; the others stay one sample each.
        let values: Vec<_> = profile.sample.iter().map(|s| s.value.clone()).collect();
        assert_eq!(
            values,
            [
                vec![3, 60_000_000],
                vec![2, 40_000_000],
                vec![1, 20_000_000]
            ]
        );
        let third = &profile.sample[2];
        assert_eq!(
            function_names(&profile, third),
            ["sys_write", "work", "main"]
        );
        assert_eq!(
            labels(&profile, third),
            [("service", "web"), ("pool", "burner")]
        );
        // main and work are one location and function each, shared by the samples.
        assert_eq!(profile.location.len(), 3);
        assert_eq!(profile.function.len(), 3);
        assert_eq!(profile.sample[0].location_id, profile.sample[1].location_id);
        let mappings: Vec<_> = profile
            .mapping
            .iter()
            .map(|m| (string(&profile, m.filename), m.has_functions))
            .collect();
        assert_eq!(mappings, [("burner", true), ("[kernel.kallsyms]", true)]);
        let kernel_location = profile.location.iter().find(|l| l.address == 0xffff_0010);
        assert_eq!(kernel_location.map(|l| l.mapping_id), Some(2));
        Ok(())
    }

    #[test]
    fn pprof_offcpu_view() -> TestResult {
        let records = fixture();
        let profile = decode(&pprof(&refs(&records), View::OffCpu, &meta(50))?)?;
        let types = types_of(&profile);
        assert_eq!(
            types,
            [
                ("events".to_owned(), "count".to_owned()),
                ("offcpu".to_owned(), "nanoseconds".to_owned())
            ]
        );
        assert_eq!(profile.period_type, None);
        let values: Vec<_> = profile.sample.iter().map(|s| s.value.clone()).collect();
        assert_eq!(
            values,
            [vec![4, 2_000_400], vec![1, 1_000_400], vec![1, 499]]
        );
        let first = &profile.sample[0];
        assert_eq!(
            function_names(&profile, first),
            ["futex_wait", "pthread_mutex_lock", "main"]
        );
        assert_eq!(
            labels(&profile, first),
            [("service", "web"), ("pool", "burner"), ("reason", "lock")]
        );
        assert_eq!(
            labels(&profile, &profile.sample[2]),
            [("service", "web"), ("pool", "io;pool"), ("reason", "disk")]
        );
        Ok(())
    }

    #[test]
    fn pprof_wall_view_keeps_cpu_and_offcpu_apart_and_sums_them() -> TestResult {
        let records = fixture();
        let mut meta = meta(50);
        meta.comments = vec!["poolscope: a note".to_owned()];
        let profile = decode(&pprof(&refs(&records), View::Wall, &meta)?)?;
        let types: Vec<String> = types_of(&profile)
            .into_iter()
            .map(|(kind, unit)| format!("{kind}/{unit}"))
            .collect();
        assert_eq!(
            types,
            [
                "samples/count",
                "cpu/nanoseconds",
                "events/count",
                "offcpu/nanoseconds",
                "wall/nanoseconds"
            ]
        );
        assert_eq!(string(&profile, profile.default_sample_type), "wall");
        let values: Vec<_> = profile.sample.iter().map(|s| s.value.clone()).collect();
        assert_eq!(
            values,
            [
                vec![3, 60_000_000, 0, 0, 60_000_000],
                vec![2, 40_000_000, 0, 0, 40_000_000],
                vec![1, 20_000_000, 0, 0, 20_000_000],
                vec![0, 0, 4, 2_000_400, 2_000_400],
                vec![0, 0, 1, 1_000_400, 1_000_400],
                vec![0, 0, 1, 499, 499]
            ]
        );
        let comments: Vec<&str> = profile
            .comment
            .iter()
            .map(|id| string(&profile, *id))
            .collect();
        assert_eq!(comments, ["poolscope: a note"]);
        Ok(())
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

    #[test]
    fn pprof_of_nothing_is_a_valid_profile() -> TestResult {
        let profile = decode(&pprof(&[], View::Cpu, &meta(50))?)?;
        assert!(profile.sample.is_empty());
        assert_eq!(profile.sample_type.len(), 2);
        Ok(())
    }

    /// `go tool pprof` reads what we write (skipped where Go is not installed).
    #[test]
    fn go_tool_pprof_reads_the_profile() -> TestResult {
        let dir = tempfile::tempdir()?;
        let records = fixture();
        for (view, name) in [
            (View::Cpu, "cpu"),
            (View::OffCpu, "offcpu"),
            (View::Wall, "wall"),
        ] {
            let path = dir.path().join(format!("{name}.pb.gz"));
            std::fs::write(&path, pprof(&refs(&records), view, &meta(50))?)?;
            let output = std::process::Command::new("go")
                .args(["tool", "pprof", "-top"])
                .arg(&path)
                // Go wants a cache and pprof a home; keep both out of the real $HOME.
                .env("HOME", dir.path())
                .env("GOCACHE", dir.path().join("gocache"))
                .env("PPROF_TMPDIR", dir.path())
                .output();
            let output = match output {
                Ok(output) => output,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                    eprintln!("go is not installed: skipping the go tool pprof check");
                    return Ok(());
                }
                Err(error) => return Err(error.into()),
            };
            let stdout = String::from_utf8_lossy(&output.stdout);
            let stderr = String::from_utf8_lossy(&output.stderr);
            eprintln!("go tool pprof -top {name}:\n{stdout}{stderr}");
            assert!(output.status.success(), "{stderr}");
            let expected: &[&str] = match view {
                View::Cpu => &["work", "sys_write", "main"],
                View::OffCpu => &["futex_wait", "pthread_mutex_lock", "main"],
                View::Wall => &["work", "futex_wait", "main"],
            };
            for function in expected {
                assert!(stdout.contains(function), "{name}: {function} missing");
            }
        }
        Ok(())
    }
}
