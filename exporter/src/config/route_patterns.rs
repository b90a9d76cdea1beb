//! Whether a `[[targets]]` entry's service has its routes read, and the templates
//! that name them (`routes = ["/users/:id", ...]`): parsed and checked here, matched by
//! the route table against each request's path before the default normalizer. A segment is a literal, `:name` or `{name}` (any one
//! non-empty segment), or, last only, `*` (the rest of the path, one segment or more).
use std::sync::Arc;

/// Longest template accepted: a path is read up to 96 bytes, so a longer literal
/// prefix could never match, but `*` and ids make the template's text longer or
/// shorter than the paths it names.
const MAX_TEMPLATE_BYTES: usize = 256;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(Box<[u8]>),
    /// `:name` or `{name}`.
    One,
    /// `*`, last.
    Rest,
}

/// One template: its text, which becomes the route label, and its segments.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RoutePattern {
    text: String,
    segments: Box<[Segment]>,
}

impl RoutePattern {
    fn parse(text: &str) -> Result<Self, String> {
        let Some(path) = text.strip_prefix('/') else {
            return Err(format!("{text:?} does not begin with /"));
        };
        if text.len() > MAX_TEMPLATE_BYTES {
            return Err(format!(
                "{text:?} is longer than {MAX_TEMPLATE_BYTES} bytes"
            ));
        }
        if let Some(bad) = text
            .chars()
            .find(|&c| matches!(c, '?' | '#') || c.is_whitespace() || c.is_control())
        {
            return Err(format!(
                "{text:?} holds {bad:?}: a template names a path, without query or fragment"
            ));
        }
        let parts: Vec<&str> = path.split('/').collect();
        let last = parts.len() - 1;
        let segments = parts
            .iter()
            .enumerate()
            .map(|(index, part)| match *part {
                "*" if index == last => Ok(Segment::Rest),
                "*" => Err(format!("{text:?}: * may only be its last segment")),
                _ if is_placeholder(part) => Ok(Segment::One),
                _ if part.starts_with(':') || part.contains(['*', '{', '}']) => Err(format!(
                    "{text:?}: segment {part:?} mixes a placeholder with text \
                     (a segment is a literal, :name, {{name}} or a last *)"
                )),
                _ => Ok(Segment::Literal(part.as_bytes().into())),
            })
            .collect::<Result<_, String>>()?;
        Ok(Self {
            text: text.to_owned(),
            segments,
        })
    }

    /// Whether the path (the bytes after its first `/`, up to `?`, `#` or a space)
    /// is one this template names. `cut`: the path went on past the bytes read, so
    /// its last segment may be whole or not and more may follow: only a `*` covers it.
    fn matches(&self, path: &[u8], cut: bool) -> bool {
        let mut parts = path.split(|&byte| byte == b'/').peekable();
        for segment in &self.segments {
            let Some(part) = parts.next() else {
                return false;
            };
            let whole = !cut || parts.peek().is_some();
            match segment {
                Segment::Rest => return true,
                Segment::One if whole => {
                    if part.is_empty() {
                        return false;
                    }
                }
                Segment::Literal(literal) if whole => {
                    if part != &literal[..] {
                        return false;
                    }
                }
                Segment::One | Segment::Literal(_) => return false,
            }
        }
        parts.next().is_none() && !cut
    }
}

/// `:name` or `{name}`, with a name of at least one character and no `/`, `*`, `{`, `}`.
fn is_placeholder(part: &str) -> bool {
    let name = part.strip_prefix(':').or_else(|| {
        part.strip_prefix('{')
            .and_then(|rest| rest.strip_suffix('}'))
    });
    name.is_some_and(|name| !name.is_empty() && !name.contains(['*', '{', '}', ':']))
}

/// Whether a rule's service has its routes read (`[[targets]] routes`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ServiceRoutes {
    /// As `[probes] routes` says for every service (no `routes` key).
    #[default]
    AsProbes,
    /// `routes = false`.
    Off,
    /// `routes = true` (no template) or a list of templates.
    Read(RoutePatterns),
}

/// A service's templates, in the order given (the first that matches names the route).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoutePatterns(Option<Arc<[RoutePattern]>>);

impl RoutePatterns {
    /// No template: every route comes from the default normalizer.
    pub const NONE: Self = Self(None);

    /// Parses `templates`; the error names the first bad one and why.
    pub fn parse(templates: &[String]) -> Result<Self, String> {
        let patterns: Vec<RoutePattern> = templates
            .iter()
            .map(|text| RoutePattern::parse(text))
            .collect::<Result<_, _>>()?;
        if let Some(twice) = patterns
            .iter()
            .enumerate()
            .find(|(index, pattern)| patterns[..*index].contains(pattern))
        {
            return Err(format!("{:?} is given twice", twice.1.text));
        }
        Ok(Self((!patterns.is_empty()).then(|| patterns.into())))
    }

    fn all(&self) -> &[RoutePattern] {
        self.0.as_deref().unwrap_or_default()
    }

    pub fn len(&self) -> usize {
        self.all().len()
    }

    pub fn is_empty(&self) -> bool {
        self.all().is_empty()
    }

    /// The template that names `path` (see [`RoutePattern::matches`]), if any.
    pub fn route_of(&self, path: &[u8], cut: bool) -> Option<&str> {
        self.all()
            .iter()
            .find(|pattern| pattern.matches(path, cut))
            .map(|pattern| pattern.text.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patterns(templates: &[&str]) -> RoutePatterns {
        let templates: Vec<String> = templates.iter().map(|&t| t.to_owned()).collect();
        RoutePatterns::parse(&templates).expect("valid templates")
    }

    #[test]
    fn the_first_template_that_names_a_path_wins() {
        let patterns = patterns(&[
            "/users/me",
            "/users/:id",
            "/users/{id}/orders/:order",
            "/static/*",
            "/",
        ]);
        let cases: [(&str, bool, Option<&str>); 12] = [
            ("users/me", false, Some("/users/me")),
            ("users/alice", false, Some("/users/:id")),
            (
                "users/42/orders/7",
                false,
                Some("/users/{id}/orders/:order"),
            ),
            ("users/42/orders", false, None),
            ("users/", false, None),
            ("users/42/", false, None),
            ("static/app.js", false, Some("/static/*")),
            ("static/js/app.js", false, Some("/static/*")),
            ("static", false, None),
            ("", false, Some("/")),
            // Cut inside the last segment: only a * covers it.
            ("users/ali", true, None),
            ("static/very/lo", true, Some("/static/*")),
        ];
        for (path, cut, expected) in cases {
            assert_eq!(patterns.route_of(path.as_bytes(), cut), expected, "{path}");
        }
        // Cut after a whole segment that a placeholder takes: more may follow.
        assert_eq!(patterns.route_of(b"users/42/orders/7", true), None);
    }

    #[test]
    fn bad_templates_are_refused_with_the_reason() {
        for (template, reason) in [
            ("users/:id", "does not begin with /"),
            ("/users?id=1", "without query"),
            ("/a b", "without query"),
            ("/*/x", "last segment"),
            ("/users/:", "mixes"),
            ("/users/{}", "mixes"),
            ("/users/x{id}", "mixes"),
            ("/files/*.png", "mixes"),
        ] {
            let error = RoutePatterns::parse(&[template.to_owned()]).expect_err(template);
            assert!(error.contains(reason), "{template}: {error}");
        }
        let long = format!("/{}", "a".repeat(MAX_TEMPLATE_BYTES));
        assert!(RoutePatterns::parse(&[long]).is_err());
        let twice = RoutePatterns::parse(&["/a".to_owned(), "/a".to_owned()]);
        assert_eq!(twice, Err("\"/a\" is given twice".to_owned()));
    }
}
