//! The profiling service: `/debug/pprof/*` sessions from request to rendered
//! profile. It owns the session slots (their lock is taken alone, for one call);
//! the kernel side goes through the core lock, the stacks through [`Stacks`].
use std::{
    sync::{Mutex, MutexGuard},
    time::{Duration, SystemTime},
};

use poolscope_shared::{NO_POOL, ProfileSession};

use super::{Core, health::Health, lock_or_recover, stacks::Stacks};
use crate::{
    clock::monotonic_ns,
    config::Settings,
    stacks::profile::{self, ProfileMeta, StackRecord},
    stacks::sessions::{self, ProfileQuery, Refusal, SessionCounts, Sessions, Ticket},
    web::server::ProfileOutput,
};

/// What a session needs besides its own slots.
pub(super) struct Parts<'a> {
    pub settings: &'a Settings,
    pub core: &'a Mutex<Core>,
    pub stacks: &'a Stacks,
    pub health: &'a Health,
}

#[derive(Default)]
pub(super) struct Profiles {
    /// Counters and slot flags stay valid whatever panicked.
    sessions: Mutex<Sessions>,
}

impl Profiles {
    fn sessions(&self) -> MutexGuard<'_, Sessions> {
        lock_or_recover(&self.sessions)
    }

    /// What happened to the sessions asked for so far.
    pub fn counts(&self) -> SessionCounts {
        self.sessions().counts()
    }

    pub fn begin(
        &self,
        query: &ProfileQuery,
        requested_ns: u64,
        parts: &Parts<'_>,
    ) -> Result<Ticket, Refusal> {
        let started = self.try_begin(query, requested_ns, parts);
        if let Err(refusal) = &started {
            self.sessions().refused(refusal);
        }
        started
    }

    pub fn end(&self, ticket: &Ticket, parts: &Parts<'_>) -> Result<ProfileOutput, Refusal> {
        let output = self.try_end(ticket, parts);
        if let Err(refusal) = &output {
            tracing::warn!(%refusal, service = ticket.request.service, "profiling session failed");
            self.sessions().refused(refusal);
        }
        output
    }

    pub fn cancel(&self, ticket: &Ticket, parts: &Parts<'_>) {
        if let Err(refusal) = self.stop_in_kernel(ticket, parts.core) {
            tracing::warn!(%refusal, "ending a profiling session failed");
        }
        parts.stacks.drop_session(ticket.id);
    }

    fn try_begin(
        &self,
        query: &ProfileQuery,
        requested_ns: u64,
        parts: &Parts<'_>,
    ) -> Result<Ticket, Refusal> {
        let settings = parts.settings;
        let request = sessions::validate(
            query,
            &settings.profiles,
            settings.snapshots.offcpu_min.is_some(),
        )?;
        let ticket =
            self.sessions()
                .reserve(request, requested_ns, settings.profiles.max_sessions)?;
        // The window first, so that no drain meanwhile drops the session's counts.
        parts.stacks.start_session(ticket.id);
        if let Err(refusal) = start_in_kernel(&ticket, &mut lock_or_recover(parts.core)) {
            parts.stacks.drop_session(ticket.id);
            self.sessions().release(ticket.slot);
            return Err(refusal);
        }
        self.sessions().started(ticket.request.view);
        tracing::info!(
            service = ticket.request.service,
            pool = ticket.request.pool,
            seconds = ticket.request.duration.as_secs(),
            hz = ticket.request.hz,
            kind = sessions::kind_name(ticket.request.view),
            "profiling session started"
        );
        Ok(ticket)
    }

    /// Stops the session in the kernel and frees its slot; the kernel's last view
    /// of it.
    fn stop_in_kernel(
        &self,
        ticket: &Ticket,
        core: &Mutex<Core>,
    ) -> Result<ProfileSession, Refusal> {
        let stopped = lock_or_recover(core).kernel.stop_profile(ticket.slot);
        self.sessions().release(ticket.slot);
        stopped.map_err(|error| Refusal::Kernel(error.to_string()))
    }

    fn try_end(&self, ticket: &Ticket, parts: &Parts<'_>) -> Result<ProfileOutput, Refusal> {
        let stopped = self.stop_in_kernel(ticket, parts.core);
        let ended = SystemTime::now();
        let window = parts
            .stacks
            .end_session(ticket.id, stopped.is_ok(), parts.core, parts.health);
        let session = stopped?;
        let window =
            window.ok_or_else(|| Refusal::Kernel("the session's window is gone".to_owned()))?;
        let request = &ticket.request;
        let started = window.started();
        let duration = ended.duration_since(started).unwrap_or_default();
        let mut comments = vec![format!(
            "poolscope: {} profile of service {:?}{}, {:.1} s at {} Hz",
            request.view.title(),
            request.service,
            request
                .pool
                .as_ref()
                .map(|pool| format!(", pool {pool:?}"))
                .unwrap_or_default(),
            duration.as_secs_f64(),
            request.hz
        )];
        if duration + Duration::from_secs(1) < request.duration {
            comments.push(format!(
                "poolscope: ended early, {} s were asked for (poolscope is stopping)",
                request.duration.as_secs()
            ));
        }
        if session.first_sample_ns > ticket.requested_ns {
            let latency = Duration::from_nanos(session.first_sample_ns - ticket.requested_ns);
            self.sessions().first_sample(latency);
            comments.push(format!(
                "poolscope: first sample {:.1} ms after the request",
                latency.as_secs_f64() * 1e3
            ));
        }
        let records = window.into_records(request.hz, u64::MAX).records;
        let records: Vec<&StackRecord> = records.iter().collect();
        let meta = ProfileMeta {
            sampling_hz: request.hz,
            started,
            duration,
            comments,
        };
        let title = format!(
            "{} stacks of {}, {} s profile at {} Hz",
            request.view.title(),
            request.service,
            request.duration.as_secs(),
            request.hz
        );
        let limit = parts.settings.profiles.max_response_bytes;
        let (body, stacks_dropped) = profile::render_within(&records, limit, |records| {
            profile::render(records, request.view, &meta, request.format, &title)
        })
        .map_err(|error| Refusal::Render(error.to_string()))?;
        if stacks_dropped > 0 {
            tracing::warn!(
                service = request.service,
                stacks_dropped,
                limit,
                "profile cut to profiles.max_response_bytes: the lightest stacks are left out"
            );
        }
        Ok(ProfileOutput {
            body,
            format: request.format,
            stacks_dropped,
        })
    }
}

/// Starts the session of `ticket` in the kernel: its service and pool by id.
fn start_in_kernel(ticket: &Ticket, core: &mut Core) -> Result<(), Refusal> {
    let request = &ticket.request;
    let service = core
        .targets
        .service_id(&request.service)
        .ok_or_else(|| Refusal::UnknownService(request.service.clone()))?;
    let pool = match &request.pool {
        None => NO_POOL,
        Some(name) => core
            .pools
            .views()
            .into_iter()
            .find(|view| view.service == service && view.name == *name)
            .map(|view| view.id)
            .ok_or_else(|| Refusal::UnknownPool {
                service: request.service.clone(),
                pool: name.clone(),
            })?,
    };
    let mut kinds = 0;
    if request.on_cpu() {
        kinds |= ProfileSession::ON_CPU;
    }
    if request.off_cpu() {
        kinds |= ProfileSession::OFF_CPU;
    }
    let session = ProfileSession {
        id: ticket.id,
        active: 1,
        service,
        pool,
        kinds,
        _pad: 0,
        start_ns: monotonic_ns(),
        first_sample_ns: 0,
    };
    core.kernel
        .start_profile(ticket.slot, session, request.on_cpu().then_some(request.hz))
        .map_err(|error| Refusal::Kernel(error.to_string()))
}
