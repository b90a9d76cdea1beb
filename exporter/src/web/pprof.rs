//! `/debug/pprof/profile`: one profiling session per request, for `go tool pprof`,
//! ended early when poolscope stops and at once when its client leaves.
use std::{sync::Arc, time::Duration};

use axum::{
    extract::{Query, State},
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};

use crate::{
    clock::monotonic_ns,
    stacks::{
        profile,
        sessions::{ProfileQuery, Refusal, Ticket},
    },
    web::gatherer::Gatherer,
};

/// Ends a session whose request was dropped (the client disconnected) before it
/// completed: its perf events and kernel slot are freed at once.
struct SessionGuard {
    gatherer: Arc<dyn Gatherer>,
    ticket: Option<Ticket>,
}

impl SessionGuard {
    fn duration(&self) -> Duration {
        self.ticket
            .as_ref()
            .map_or(Duration::ZERO, |ticket| ticket.request.duration)
    }

    fn disarm(mut self) -> Option<Ticket> {
        self.ticket.take()
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            let gatherer = self.gatherer.clone();
            tracing::info!(
                service = ticket.request.service,
                "profiling client disconnected: session ended"
            );
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn_blocking(move || gatherer.cancel_profile(ticket));
                }
                Err(_) => gatherer.cancel_profile(ticket),
            }
        }
    }
}

pub(super) async fn pprof_profile(
    State(gatherer): State<Arc<dyn Gatherer>>,
    query: Result<Query<ProfileQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let requested_ns = monotonic_ns();
    let query = match query {
        Ok(Query(query)) => query,
        Err(rejection) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("{rejection}\n{}", crate::stacks::sessions::USAGE),
            )
                .into_response();
        }
    };
    // Started on a blocking thread; should the client leave meanwhile, the ticket
    // finds no receiver and the session is ended there.
    let (sender, receiver) = tokio::sync::oneshot::channel();
    let starter = gatherer.clone();
    tokio::task::spawn_blocking(move || {
        let started = starter.begin_profile(&query, requested_ns);
        if let Err(Ok(ticket)) = sender.send(started) {
            starter.cancel_profile(ticket);
        }
    });
    let ticket = match receiver.await {
        Ok(Ok(ticket)) => ticket,
        Ok(Err(refusal)) => return refusal_response(&refusal),
        Err(_) => {
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                "starting the profiling session panicked\n",
            )
                .into_response();
        }
    };
    let guard = SessionGuard {
        gatherer: gatherer.clone(),
        ticket: Some(ticket),
    };
    let mut stopping = gatherer.stopping();
    tokio::select! {
        () = tokio::time::sleep(guard.duration()) => {}
        _ = stopping.wait_for(|stopping| *stopping) => {
            tracing::info!("poolscope is stopping: profiling session ended early");
        }
    }
    let Some(ticket) = guard.disarm() else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    match tokio::task::spawn_blocking(move || gatherer.end_profile(ticket)).await {
        Ok(Ok(output)) => {
            let mut response = (
                [(header::CONTENT_TYPE, output.format.content_type())],
                output.body,
            )
                .into_response();
            if output.format == profile::Format::Pprof {
                response.headers_mut().insert(
                    header::CONTENT_DISPOSITION,
                    HeaderValue::from_static("attachment; filename=\"profile.pb.gz\""),
                );
            }
            response.headers_mut().insert(
                "x-poolscope-stacks-dropped",
                HeaderValue::from(output.stacks_dropped),
            );
            response
        }
        Ok(Err(refusal)) => refusal_response(&refusal),
        Err(error) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("ending the profiling session failed: {error}\n"),
        )
            .into_response(),
    }
}

fn refusal_response(refusal: &Refusal) -> Response {
    let mut response = (refusal.status(), format!("{refusal}\n")).into_response();
    if refusal.status() == StatusCode::TOO_MANY_REQUESTS {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("10"));
    }
    response
}
