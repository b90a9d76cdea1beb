//! What the web server asks of the exporter: the [`Gatherer`] trait, the queries of the
//! debug endpoints it passes on (`/debug/locks`, `/debug/stacks/*`), their errors, and
//! a rendered profiling session.
use axum::http::StatusCode;

use crate::{
    encode::{Exposition, Family},
    scrape_counts::ScrapeCounts,
    stacks::{
        profile::{self, ProfileError, View},
        sessions::{ProfileQuery, Refusal, Ticket},
    },
};

/// Something that reads every metric family for one scrape.
pub trait Gatherer: Send + Sync + 'static {
    /// Blocking: reads kernel maps and netlink; the families to be written in
    /// `exposition` (only the protobuf exposition carries native buckets), with the
    /// web server's own counts.
    fn gather(&self, exposition: Exposition, web: &ScrapeCounts) -> Vec<Family>;

    /// Blocking: one line per followed thread, with a header line.
    fn debug_threads(&self) -> String;

    /// Blocking (symbolizes): the top contended locks of one service.
    fn debug_locks(&self, query: &LocksQuery) -> Result<String, DebugError>;

    /// The snapshots kept, as JSON.
    fn debug_snapshots(&self) -> String;

    /// Blocking (renders): one snapshot's stacks in `query.format`.
    fn debug_stacks(&self, view: View, query: &StacksQuery) -> Result<Vec<u8>, DebugError>;

    /// Blocking (opens perf events): checks `query` and starts its session.
    fn begin_profile(&self, query: &ProfileQuery, requested_ns: u64) -> Result<Ticket, Refusal>;

    /// Blocking (drains, symbolizes, renders): ends the session and renders it.
    fn end_profile(&self, ticket: Ticket) -> Result<ProfileOutput, Refusal>;

    /// Ends the session without rendering it (its client left).
    fn cancel_profile(&self, ticket: Ticket);

    /// Becomes true when poolscope stops: sessions end early then.
    fn stopping(&self) -> tokio::sync::watch::Receiver<bool>;

    /// Not blocking: `ok`, or `degraded` and one line per cause (see `health`).
    fn health(&self) -> String;
}

/// A rendered profiling session.
#[derive(Debug)]
pub struct ProfileOutput {
    pub body: Vec<u8>,
    pub format: profile::Format,
    /// The lightest stacks left out to stay within `profiles.max_response_bytes`.
    pub stacks_dropped: usize,
}

/// Locks shown when `limit` is not given, and the most that may be asked for.
const DEFAULT_LOCKS: usize = 10;
pub(super) const MAX_LOCKS: usize = 1000;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LocksFormat {
    #[default]
    Text,
    Json,
}

/// `/debug/locks?service=NAME[&format=text|json][&limit=N]`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
pub struct LocksQuery {
    pub service: String,
    #[serde(default)]
    pub format: LocksFormat,
    #[serde(default = "default_locks")]
    pub limit: usize,
}

fn default_locks() -> usize {
    DEFAULT_LOCKS
}

/// `/debug/stacks/{cpu,offcpu,wall}?[service=NAME][&pool=NAME][&snapshot=ID][&format=...]`.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize)]
pub struct StacksQuery {
    pub service: Option<String>,
    pub pool: Option<String>,
    /// The newest when absent.
    pub snapshot: Option<u64>,
    #[serde(default)]
    pub format: profile::Format,
}

#[derive(Debug, thiserror::Error)]
pub enum DebugError {
    #[error("no watched service named {0:?}")]
    UnknownService(String),
    #[error("{}", match .0 {
        Some(id) => format!("no snapshot {id} (see /debug/snapshots)"),
        None => "no snapshot yet: the first comes one [stacks] interval after start".to_owned(),
    })]
    NoSnapshot(Option<u64>),
    #[error("rendering failed: {0}")]
    Render(#[from] ProfileError),
}

impl DebugError {
    pub(super) fn status(&self) -> StatusCode {
        match self {
            Self::UnknownService(_) | Self::NoSnapshot(_) => StatusCode::NOT_FOUND,
            Self::Render(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}
