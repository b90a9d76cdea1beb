//! The `/debug/*` endpoints: who may use them (`web.debug_endpoints`), and
//! `/debug/threads`, `/debug/locks`, `/debug/snapshots` and `/debug/stacks/*`.
use std::sync::Arc;

use axum::{
    extract::{ConnectInfo, Path, Query, Request, State},
    http::{StatusCode, header},
    middleware::Next,
    response::{IntoResponse, Response},
};

use crate::{
    config::DebugAccess,
    stacks::profile::View,
    web::gatherer::{Gatherer, LocksFormat, LocksQuery, MAX_LOCKS, StacksQuery},
};

/// Lets a `/debug/*` request through as `web.debug_endpoints` allows.
pub(super) async fn debug_guard(
    State(access): State<DebugAccess>,
    request: Request,
    next: Next,
) -> Response {
    let peer = request
        .extensions()
        .get::<ConnectInfo<std::net::SocketAddr>>()
        .map(|ConnectInfo(address)| address.ip().to_canonical());
    match access {
        DebugAccess::All => next.run(request).await,
        DebugAccess::Localhost if peer.is_some_and(|ip| ip.is_loopback()) => {
            next.run(request).await
        }
        DebugAccess::Localhost => (
            StatusCode::FORBIDDEN,
            format!(
                "/debug/* answers only clients on this host (web.debug_endpoints = \"localhost\"); \
                 this one is {}: use kubectl port-forward or an SSH tunnel, or set \"all\"\n",
                peer.map_or_else(|| "unknown".to_owned(), |ip| ip.to_string())
            ),
        )
            .into_response(),
        DebugAccess::Off => (
            StatusCode::NOT_FOUND,
            "/debug/* is off (web.debug_endpoints = \"off\")\n",
        )
            .into_response(),
    }
}

pub(super) async fn debug_threads(State(gatherer): State<Arc<dyn Gatherer>>) -> Response {
    match tokio::task::spawn_blocking(move || gatherer.debug_threads()).await {
        Ok(body) => body.into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading threads failed: {error}\n"),
        )
            .into_response(),
    }
}

pub(super) async fn debug_locks(
    State(gatherer): State<Arc<dyn Gatherer>>,
    query: Result<Query<LocksQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(query)) = query else {
        return (
            StatusCode::BAD_REQUEST,
            "usage: /debug/locks?service=NAME[&format=text|json][&limit=N]\n",
        )
            .into_response();
    };
    if query.limit == 0 || query.limit > MAX_LOCKS {
        return (
            StatusCode::BAD_REQUEST,
            format!("limit must be 1 to {MAX_LOCKS}\n"),
        )
            .into_response();
    }
    let format = query.format;
    match tokio::task::spawn_blocking(move || gatherer.debug_locks(&query)).await {
        Ok(Ok(body)) => {
            let content_type = match format {
                LocksFormat::Text => "text/plain; charset=utf-8",
                LocksFormat::Json => "application/json",
            };
            ([(header::CONTENT_TYPE, content_type)], body).into_response()
        }
        Ok(Err(error)) => (error.status(), format!("{error}\n")).into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading locks failed: {error}\n"),
        )
            .into_response(),
    }
}

pub(super) async fn debug_snapshots(State(gatherer): State<Arc<dyn Gatherer>>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        gatherer.debug_snapshots(),
    )
        .into_response()
}

const STACKS_USAGE: &str = "usage: /debug/stacks/{cpu|offcpu|wall}?[service=NAME][&pool=NAME]\
                            [&snapshot=ID][&format=folded|svg|pprof]\n";

pub(super) async fn debug_stacks(
    State(gatherer): State<Arc<dyn Gatherer>>,
    view: Result<Path<View>, axum::extract::rejection::PathRejection>,
    query: Result<Query<StacksQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let (Ok(Path(view)), Ok(Query(query))) = (view, query) else {
        return (StatusCode::BAD_REQUEST, STACKS_USAGE).into_response();
    };
    let format = query.format;
    match tokio::task::spawn_blocking(move || gatherer.debug_stacks(view, &query)).await {
        Ok(Ok(body)) => ([(header::CONTENT_TYPE, format.content_type())], body).into_response(),
        Ok(Err(error)) => (error.status(), format!("{error}\n")).into_response(),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering stacks failed: {error}\n"),
        )
            .into_response(),
    }
}
