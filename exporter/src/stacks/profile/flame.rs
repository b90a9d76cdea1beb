//! The interactive SVG flame graph (inferno), each frame colored by where its time
//! went: warm on CPU, blue off CPU, grey both.
use std::collections::HashMap;

use inferno::flamegraph::color::{BackgroundColor, Color, PaletteMap};

use super::folded::{Line, lines};
use super::{ProfileError, ProfileMeta, StackRecord, View};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stacks::profile::{
        StackKind,
        tests::{TestResult, fixture, meta, record, refs, user},
    };

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
}
