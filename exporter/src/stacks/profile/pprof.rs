//! The gzipped pprof protobuf (`perftools.profiles`, written by hand with prost) that
//! `go tool pprof`, Pyroscope and Parca read: one sample per record, labels for the pool,
//! service and reason.
use std::collections::HashMap;
use std::io::Write as _;
use std::time::{Duration, UNIX_EPOCH};

use prost::Message as _;

use super::{Frame, ProfileError, ProfileMeta, StackKind, StackRecord, View, sample_ns};

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
    use crate::stacks::profile::tests::{TestResult, fixture, meta, refs};

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
    fn pprof_of_nothing_is_a_valid_profile() -> TestResult {
        let profile = decode(&pprof(&[], View::Cpu, &meta(50))?)?;
        assert!(profile.sample.is_empty());
        assert_eq!(profile.sample_type.len(), 2);
        Ok(())
    }

    /// `go tool pprof` reads what we write (skipped where Go is not installed, failed
    /// under CI=true).
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
                    poolscope_tests::skip(
                        "go_tool_pprof_reads_the_profile",
                        "no go on PATH (apt-get install golang-go)",
                    );
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
