//! How a service serves its HTTP/2 streams (DESIGN §3), and so which of its open
//! streams wait: a server that hands each stream to a worker of a pool until its
//! answer (grpcio's executor) has streams waiting for a worker once the pool is busy;
//! one that serves every open stream at once (goroutines, an event loop, a thread
//! per stream) has none. Read from who answers the streams: in the first kind, the
//! threads that answer are a fixed few that never read a stream (another thread
//! reads and hands each on); in the second, the threads that read also answer (Go's
//! Ms, Node.js's loop), or each answer comes from a thread that answers once (a new
//! thread per stream). `[[targets]] http2_worker_threads` overrides what is read.
use poolscope_shared::ServiceCounters;

/// How a service serves its HTTP/2 streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamModel {
    /// Each stream goes to a worker of a pool until its answer.
    Workers,
    /// Every open stream is served at once.
    EveryStream,
}

impl StreamModel {
    pub const fn label(self) -> &'static str {
        match self {
            Self::Workers => "workers",
            Self::EveryStream => "every_stream",
        }
    }
}

/// Where a service's [`StreamModel`] comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// Its rule's `http2_worker_threads`.
    Configured,
    /// Read from who answered its streams.
    Detected,
    /// Fewer than [`MIN_ANSWERED`] streams answered yet: read as
    /// [`StreamModel::EveryStream`], which counts no stream waiting.
    Undecided,
}

impl ModelSource {
    pub const fn label(self) -> &'static str {
        match self {
            Self::Configured => "configured",
            Self::Detected => "detected",
            Self::Undecided => "undecided",
        }
    }
}

/// Streams a service answers before its model is read from them: a pool's first
/// answer by each worker does not count as a worker's (a thread that answers once
/// may be a thread per stream), so a pool of W needs W answers more than it has
/// workers' answers; 32 leaves a pool of up to 16 a majority.
pub const MIN_ANSWERED: u64 = 32;

/// The model of a service whose rule says `configured` (`None`: detect it) and whose
/// kernel counters are `counters`: workers where at least half of its answered
/// streams were answered by a worker (a thread that answered one before and never
/// read one).
pub fn stream_model(
    configured: Option<bool>,
    counters: &ServiceCounters,
) -> (StreamModel, ModelSource) {
    if let Some(workers) = configured {
        let model = if workers {
            StreamModel::Workers
        } else {
            StreamModel::EveryStream
        };
        return (model, ModelSource::Configured);
    }
    let answered = counters.streams_answered.get();
    if answered < MIN_ANSWERED {
        return (StreamModel::EveryStream, ModelSource::Undecided);
    }
    let by_workers = counters.streams_answered_by_workers.get();
    let model = if by_workers.saturating_mul(2) >= answered {
        StreamModel::Workers
    } else {
        StreamModel::EveryStream
    };
    (model, ModelSource::Detected)
}

/// A service's threads at one instant, as far as its HTTP/2 streams go.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamThreads {
    /// Busy threads of the service.
    pub busy: u64,
    /// Live threads that answer streams other threads read, and those busy.
    pub workers: u64,
    pub workers_busy: u64,
}

/// Open HTTP/2 streams that no worker serves, in a service of `model`: each busy
/// worker serves one stream, so the open streams beyond them wait for one (a pool
/// whose workers are all busy: open streams less the pool; one with a worker idle:
/// none). The busy threads stand for the workers where no thread answers streams
/// without reading (a rule that says workers for a server whose workers hand their
/// answers back to the reading thread to write). HTTP/1 requests are not streams.
pub fn waiting_streams(
    counters: &ServiceCounters,
    model: StreamModel,
    threads: StreamThreads,
) -> u64 {
    if model != StreamModel::Workers {
        return 0;
    }
    let open = counters
        .streams_opened
        .get()
        .saturating_sub(counters.streams_ended.get());
    let serving = if threads.workers > 0 {
        threads.workers_busy
    } else {
        threads.busy
    };
    open.saturating_sub(serving)
}

#[cfg(test)]
mod tests {
    use poolscope_shared::Count;

    use super::*;

    fn answered(all: u64, by_workers: u64) -> ServiceCounters {
        ServiceCounters {
            streams_answered: Count::new(all),
            streams_answered_by_workers: Count::new(by_workers),
            ..ServiceCounters::default()
        }
    }

    #[test]
    fn the_model_is_configured_else_read_from_who_answered() {
        use ModelSource::*;
        use StreamModel::*;
        // grpcio: 4 workers answer nearly all, the reading thread some.
        assert_eq!(
            stream_model(None, &answered(1000, 760)),
            (Workers, Detected)
        );
        // Go, Node.js: the threads that read answer; a thread per stream: none
        // answers twice.
        assert_eq!(
            stream_model(None, &answered(1000, 3)),
            (EveryStream, Detected)
        );
        assert_eq!(
            stream_model(None, &answered(1000, 500)),
            (Workers, Detected)
        );
        assert_eq!(
            stream_model(None, &answered(1000, 499)),
            (EveryStream, Detected)
        );
        // Too few answers to tell: nothing counts as waiting.
        assert_eq!(
            stream_model(None, &answered(31, 31)),
            (EveryStream, Undecided)
        );
        // The rule wins either way.
        assert_eq!(
            stream_model(Some(false), &answered(1000, 1000)),
            (EveryStream, Configured)
        );
        assert_eq!(
            stream_model(Some(true), &answered(0, 0)),
            (Workers, Configured)
        );
    }

    #[test]
    fn open_streams_beyond_the_busy_workers_wait() {
        let counters = ServiceCounters {
            streams_opened: Count::new(116),
            streams_ended: Count::new(100),
            // HTTP/1 requests in flight beside the streams are no streams.
            serving_entered: Count::new(130),
            serving_left: Count::new(100),
            ..ServiceCounters::default()
        };
        let pool = |workers_busy| StreamThreads {
            busy: 6,
            workers: 4,
            workers_busy,
        };
        // 16 open streams, 4 workers all busy (the reading thread busy too): 12 wait.
        assert_eq!(
            waiting_streams(&counters, StreamModel::Workers, pool(4)),
            12
        );
        // A worker idle between two streams: those are counted as they are.
        assert_eq!(
            waiting_streams(&counters, StreamModel::Workers, pool(3)),
            13
        );
        // Every stream served at once: none waits.
        assert_eq!(
            waiting_streams(&counters, StreamModel::EveryStream, pool(0)),
            0
        );
        // More busy workers than open streams: none waits, none below 0.
        let few = ServiceCounters {
            streams_opened: Count::new(2),
            ..ServiceCounters::default()
        };
        assert_eq!(waiting_streams(&few, StreamModel::Workers, pool(4)), 0);
        // No thread answers without reading (a configured rule): the busy threads.
        let handing_back = StreamThreads {
            busy: 6,
            workers: 0,
            workers_busy: 0,
        };
        assert_eq!(
            waiting_streams(&counters, StreamModel::Workers, handing_back),
            10
        );
    }
}
