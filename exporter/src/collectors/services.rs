//! The per-service families: connections, the three request gauges, queue depth,
//! request times (cumulative and over the quantile window) and where request time
//! went, from the kernel's counters joined with the listen queues.
use std::{
    collections::{BTreeMap, HashMap},
    net::SocketAddr,
};

use poolscope_shared::{RequestTimes, ServiceCounters, StatusClass};

use super::{Collected, Reading};
use crate::{
    discovery::sockdiag::ListenQueue,
    discovery::targets::{Corrections, ServiceView},
    encode::{Family, Kind, Value},
    kernel::Backend,
    metrics::pools::{COMPONENTS, sum_of},
    metrics::recount,
    metrics::stream_model::{
        ModelSource, StreamModel, StreamThreads, stream_model, waiting_streams,
    },
    metrics::window::{ClassicBuckets, PARTS, QUANTILES, WindowDelta},
};

/// A listening socket that belongs to a watched service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceListener {
    pub service: String,
    pub queue: ListenQueue,
}

/// What the kernel read gives for one service, with the window deltas.
pub struct ServiceInput<'a> {
    pub view: &'a ServiceView,
    pub counters: &'a ServiceCounters,
    /// Cumulative request times since the service id was assigned.
    pub times: &'a RequestTimes,
    /// Request times over the quantile window; `None` if none finished in it.
    pub window: Option<&'a WindowDelta>,
    /// Request time by what the serving thread did, ns per [`COMPONENTS`] entry.
    pub components: [u64; COMPONENTS.len()],
    /// The service's threads now, for its HTTP/2 streams (every pool's).
    pub stream_threads: StreamThreads,
}

/// The three request gauges of a service; see DESIGN §3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gauges {
    /// Connected, no request byte read (in the kernel's map: accepted, or for the
    /// socket backend handshake done, which includes the listen backlog).
    pub unserved: u64,
    pub waiting: u64,
    pub in_flight: u64,
}

/// The gauges of a service; one that hands each HTTP/2 stream to a worker thread
/// ([`StreamModel::Workers`]) also has its streams that wait for a worker, see
/// [`waiting_streams`].
pub fn gauges(
    counters: &ServiceCounters,
    corrections: &Corrections,
    model: StreamModel,
    threads: StreamThreads,
) -> Gauges {
    let mut gauges = socket_gauges(counters, corrections);
    gauges.waiting += waiting_streams(counters, model, threads);
    gauges
}

/// The gauges as the kernel's connection phases count them, recounted.
fn socket_gauges(counters: &ServiceCounters, corrections: &Corrections) -> Gauges {
    let gauges = recount::gauges(counters, corrections);
    Gauges {
        unserved: gauges.unserved,
        waiting: gauges.waiting,
        in_flight: gauges.in_flight,
    }
}

/// (connections_unserved, queue_depth) from the gauges and the listen backlog.
pub fn queue_depth(backend: Backend, gauges: &Gauges, backlog: u64) -> (u64, u64) {
    match backend {
        // The kernel's count starts at the handshake, so it holds the backlog too.
        Backend::Socket | Backend::Tcp => {
            let connected = gauges.unserved.max(backlog);
            (connected - backlog, connected + gauges.waiting)
        }
        Backend::Syscall => (gauges.unserved, backlog + gauges.unserved + gauges.waiting),
    }
}

/// Each service's listen backlog: the depths of its listeners, summed.
fn backlogs(listeners: &[ServiceListener]) -> HashMap<&str, u64> {
    let mut backlog_of: HashMap<&str, u64> = HashMap::new();
    for listener in listeners {
        *backlog_of.entry(listener.service.as_str()).or_default() +=
            u64::from(listener.queue.depth);
    }
    backlog_of
}

/// Each service's `queue_depth`, without the rest of a scrape.
pub fn queue_depths(
    backend: Backend,
    services: &[(&ServiceView, ServiceCounters)],
    listeners: &[ServiceListener],
) -> Vec<(String, u64)> {
    let backlog_of = backlogs(listeners);
    services
        .iter()
        .map(|(view, counters)| {
            let backlog = backlog_of.get(view.name.as_str()).copied().unwrap_or(0);
            // Without the pools' threads: streams that wait for a worker are not in it.
            let socket_only = gauges(
                counters,
                &view.corrections,
                StreamModel::EveryStream,
                StreamThreads::default(),
            );
            let (_, depth) = queue_depth(backend, &socket_only, backlog);
            (view.name.clone(), depth)
        })
        .collect()
}

struct RequestFamilies {
    histograms: [Family; 3],
    windows: [Family; 3],
    buckets: ClassicBuckets,
}

impl RequestFamilies {
    fn new(buckets: ClassicBuckets) -> Self {
        Self {
            buckets,
            histograms: [
                Family::new(
                    "request_queue_seconds",
                    Kind::Histogram,
                    "Queue time of finished requests: first read minus arrival.",
                ),
                Family::new(
                    "request_duration_seconds",
                    Kind::Histogram,
                    "Service time of finished requests: last write minus first read.",
                ),
                Family::new(
                    "request_latency_seconds",
                    Kind::Histogram,
                    "Latency of finished requests: last write minus arrival.",
                ),
            ],
            windows: [
                Family::new(
                    "request_queue_window_seconds",
                    Kind::Summary,
                    "Queue time quantiles over the last window (60 s), per instance.",
                ),
                Family::new(
                    "request_duration_window_seconds",
                    Kind::Summary,
                    "Service time quantiles over the last window (60 s), per instance.",
                ),
                Family::new(
                    "request_latency_window_seconds",
                    Kind::Summary,
                    "Latency quantiles over the last window (60 s), per instance.",
                ),
            ],
        }
    }

    fn push(
        &mut self,
        labels: &[(&'static str, &str)],
        times: &RequestTimes,
        window: Option<&WindowDelta>,
    ) {
        // A service with no request finished in the window exports no histograms:
        // their series come back with its next request, cumulative as before.
        let Some(window) = window else {
            return;
        };
        for (family, part) in self.histograms.iter_mut().zip(PARTS) {
            family.push_value(labels, self.buckets.value(part(times)));
        }
        // Quantiles over the window, without `_sum` and `_count`: those are the
        // histogram's (counters to Prometheus, so cumulative, not the window's).
        for (family, part) in self.windows.iter_mut().zip(PARTS) {
            let values = window
                .quantiles(part, QUANTILES)
                .unwrap_or([f64::NAN; QUANTILES.len()]);
            let summary = QUANTILES.into_iter().zip(values).collect();
            family.push_value(labels, Value::summary(summary, None));
        }
    }
}

/// The per-service families of a reading; whole if the kernel and the listen
/// queues were both read.
pub fn collect(reading: &Reading<'_>) -> Collected {
    let no_counters = ServiceCounters::default();
    let no_times = RequestTimes::default();
    let mut components: BTreeMap<u32, [u64; COMPONENTS.len()]> = BTreeMap::new();
    let mut stream_threads: BTreeMap<u32, StreamThreads> = BTreeMap::new();
    for row in reading.pools {
        let sums = components.entry(row.view.service).or_default();
        for (sum, (_, activities)) in sums.iter_mut().zip(COMPONENTS) {
            *sum += sum_of(&row.totals.request_ns, activities);
        }
        let threads = stream_threads.entry(row.view.service).or_default();
        threads.busy += row.totals.threads_busy;
        threads.workers += row.totals.stream_workers;
        threads.workers_busy += row.totals.stream_workers_busy;
    }
    let kernel = reading.kernel;
    let inputs: Vec<ServiceInput<'_>> = reading
        .services
        .iter()
        .map(|view| ServiceInput {
            view,
            counters: kernel
                .and_then(|k| k.services.get(&view.id))
                .unwrap_or(&no_counters),
            times: kernel
                .and_then(|k| k.request_times.get(&view.id).map(std::sync::Arc::as_ref))
                .unwrap_or(&no_times),
            window: reading.windows.get(&view.id),
            components: components.get(&view.id).copied().unwrap_or_default(),
            stream_threads: stream_threads.get(&view.id).copied().unwrap_or_default(),
        })
        .collect();
    let no_syscalls = BTreeMap::new();
    Collected {
        families: service_families(
            reading.backend,
            &inputs,
            kernel.map_or(&no_syscalls, |k| &k.syscalls),
            reading.listeners.unwrap_or_default(),
            ClassicBuckets::configured(reading.metrics),
        ),
        whole: kernel.is_some() && reading.listeners.is_some(),
    }
}

/// Per-service families (the ones the series cap applies to).
pub fn service_families(
    backend: Backend,
    services: &[ServiceInput<'_>],
    syscalls: &BTreeMap<(u32, &'static str), u64>,
    listeners: &[ServiceListener],
    buckets: ClassicBuckets,
) -> Vec<Family> {
    let mut targets = Family::new("targets", Kind::Gauge, "Processes watched for the service.");
    let mut accepted = Family::new(
        "connections_accepted",
        Kind::Counter,
        "Connections the service accepted (syscall backend: accept/accept4 returned a \
         socket; socket backend: the handshake to one of its ports completed).",
    );
    let mut unserved = Family::new(
        "connections_unserved",
        Kind::Gauge,
        "Connections the service accepted and has not read a request byte from yet.",
    );
    let mut waiting = Family::new(
        "requests_waiting",
        Kind::Gauge,
        "Requests whose bytes arrived on an open connection and were not read yet.",
    );
    let mut in_flight = Family::new(
        "requests_in_flight",
        Kind::Gauge,
        "Requests read (at least in part) and not answered yet.",
    );
    let mut depth = Family::new(
        "queue_depth",
        Kind::Gauge,
        "Listen backlog + connections_unserved + requests_waiting: the autoscaling signal.",
    );
    let mut requests = Family::new(
        "requests",
        Kind::Counter,
        "Finished requests (a read burst, then a write burst, ended by the next read or close).",
    );
    let mut responses = Family::new(
        "responses",
        Kind::Counter,
        "Finished requests by the class of their final answer's status (1xx to 5xx; \
         unknown: no status read).",
    );
    let mut kubernetes = Family::new(
        "kubernetes_info",
        Kind::Gauge,
        "The Kubernetes namespace, workload and container a service is named after \
         (`<namespace>.<workload>.<container>`), for selecting and joining; always 1.",
    );
    let mut time = Family::new(
        "request_time_seconds",
        Kind::Counter,
        "Where the time of finished requests went, by component.",
    );
    let mut request_families = RequestFamilies::new(buckets);
    let mut http2 = Http2Families::new();
    let mut syscall_family = Family::new(
        "syscalls",
        Kind::Counter,
        "Calls of the socket syscalls poolscope correlates, by the service's threads.",
    );
    let backlog_of = backlogs(listeners);
    for input in services {
        let service = input.view;
        let labels = [("service", service.name.as_str())];
        targets.push(&labels, service.processes as f64);
        if let Some(workload) = &service.workload {
            kubernetes.push(
                &[
                    ("service", service.name.as_str()),
                    ("namespace", workload.namespace.as_str()),
                    ("workload", workload.workload.as_str()),
                    ("container", workload.container.as_str()),
                ],
                1.0,
            );
        }
        let counters = input.counters;
        accepted.push(&labels, counters.accepted.get() as f64);
        let (model, source) = stream_model(service.http2_worker_threads, counters);
        let gauges = gauges(counters, &service.corrections, model, input.stream_threads);
        let backlog = backlog_of.get(service.name.as_str()).copied().unwrap_or(0);
        let (unserved_now, depth_now) = queue_depth(backend, &gauges, backlog);
        unserved.push(&labels, unserved_now as f64);
        waiting.push(&labels, gauges.waiting as f64);
        in_flight.push(&labels, gauges.in_flight as f64);
        depth.push(&labels, depth_now as f64);
        requests.push(&labels, input.times.duration.count() as f64);
        push_responses(&mut responses, &service.name, counters);
        time.push(
            &[("service", service.name.as_str()), ("component", "queue")],
            input.times.queue.sum_ns as f64 / 1e9,
        );
        for ((component, _), ns) in COMPONENTS.iter().zip(input.components) {
            time.push(
                &[("service", service.name.as_str()), ("component", component)],
                ns as f64 / 1e9,
            );
        }
        request_families.push(&labels, input.times, input.window);
        let at_limit = recount::gauges(counters, &service.corrections).at_stream_limit;
        http2.push(&service.name, counters, at_limit, (model, source));
        for ((id, syscall), calls) in syscalls.range((service.id, "")..) {
            if *id != service.id {
                break;
            }
            syscall_family.push(
                &[("service", &service.name), ("syscall", syscall)],
                *calls as f64,
            );
        }
    }

    let mut listen_depth = Family::new(
        "listen_queue_depth",
        Kind::Gauge,
        "Connections completed by the kernel and waiting in the listen backlog for accept().",
    );
    let mut limit = Family::new(
        "listen_queue_limit",
        Kind::Gauge,
        "Size of the listen backlog (listen() argument capped by net.core.somaxconn).",
    );
    for listener in listeners {
        let address = listener.queue.addr.to_string();
        let labels = [
            ("service", listener.service.as_str()),
            ("listener", address.as_str()),
        ];
        listen_depth.push(&labels, listener.queue.depth.into());
        if let Some(size) = listener.queue.limit {
            limit.push(&labels, size.into());
        }
    }
    // Gauges and counters first: when the series cap bites, histograms go before them.
    let mut families = vec![
        depth,
        in_flight,
        waiting,
        unserved,
        requests,
        responses,
        accepted,
        targets,
        kubernetes,
        listen_depth,
        limit,
        time,
        syscall_family,
    ];
    families.extend(http2.families);
    families.extend(request_families.windows);
    families.extend(request_families.histograms);
    families
}

/// The finished requests of `service` by status class, every class once one finished
/// (so that a ratio has its first error as a change, not as a new series); none
/// before.
fn push_responses(family: &mut Family, service: &str, counters: &ServiceCounters) {
    if counters.finished.get() == 0 {
        return;
    }
    for (class, count) in StatusClass::ALL.iter().zip(counters.responses) {
        family.push(
            &[("service", service), ("status_class", class.label())],
            count.get() as f64,
        );
    }
}

/// The HTTP/2 families of the services that had an HTTP/2 connection (others get no
/// series).
struct Http2Families {
    families: [Family; 6],
}

impl Http2Families {
    fn new() -> Self {
        Self {
            families: [
                Family::new(
                    "http2_connections",
                    Kind::Counter,
                    "Connections that began with the HTTP/2 client preface: their requests \
                     are their streams.",
                ),
                Family::new(
                    "http2_streams_reset",
                    Kind::Counter,
                    "HTTP/2 streams ended by RST_STREAM (either side) or by their connection's \
                     end before the server's END_STREAM; not in requests_total.",
                ),
                Family::new(
                    "http2_connections_at_stream_limit",
                    Kind::Gauge,
                    "HTTP/2 connections whose open streams reached the server's \
                     SETTINGS_MAX_CONCURRENT_STREAMS: their clients queue further requests \
                     on their own side.",
                ),
                Family::new(
                    "http2_max_concurrent_streams",
                    Kind::Gauge,
                    "The highest SETTINGS_MAX_CONCURRENT_STREAMS the service announced (0: \
                     none seen, no limit).",
                ),
                Family::new(
                    "http2_streams_answered",
                    Kind::Counter,
                    "HTTP/2 streams the server ended with END_STREAM, by who wrote it \
                     (answerer: stream_worker, a thread that answered one before and never \
                     read one; other): what the stream model is detected from.",
                ),
                Family::new(
                    "http2_stream_model",
                    Kind::Gauge,
                    "How the service was read to serve its HTTP/2 streams (model: workers, \
                     each stream handed to a worker of a pool, its streams beyond the busy \
                     workers waiting; every_stream, all open streams served at once), and \
                     from what (source: configured, detected, undecided); always 1.",
                ),
            ],
        }
    }

    fn push(
        &mut self,
        service: &str,
        counters: &ServiceCounters,
        at_limit: u64,
        (model, source): (StreamModel, ModelSource),
    ) {
        if counters.multiplexed.get() == 0 {
            return;
        }
        let labels = &[("service", service)];
        let [
            connections,
            reset,
            at_stream_limit,
            max_streams,
            answered,
            stream_model,
        ] = &mut self.families;
        connections.push(labels, counters.multiplexed.get() as f64);
        reset.push(labels, counters.streams_reset.get() as f64);
        at_stream_limit.push(labels, at_limit as f64);
        max_streams.push(labels, counters.max_streams as f64);
        let by_workers = counters.streams_answered_by_workers.get();
        for (answerer, count) in [
            ("stream_worker", by_workers),
            (
                "other",
                counters.streams_answered.get().saturating_sub(by_workers),
            ),
        ] {
            answered.push(
                &[("service", service), ("answerer", answerer)],
                count as f64,
            );
        }
        stream_model.push(
            &[
                ("service", service),
                ("model", model.label()),
                ("source", source.label()),
            ],
            1.0,
        );
    }
}

/// Joins listen queues to the services that own their sockets. Sockets of unwatched
/// processes are left out; one socket shared by several processes counts once, and
/// several sockets on one address (SO_REUSEPORT) add up to one listener: their
/// backlogs and limits summed, as one queue in front of the service.
pub fn service_listeners(
    queues: &[ListenQueue],
    owner: impl Fn(u64) -> Option<String>,
) -> Vec<ServiceListener> {
    let mut merged: BTreeMap<(String, SocketAddr), ListenQueue> = BTreeMap::new();
    for queue in queues {
        let Some(service) = owner(queue.inode) else {
            continue;
        };
        merged
            .entry((service, queue.addr))
            .and_modify(|sum| {
                sum.depth += queue.depth;
                sum.limit = sum.limit.zip(queue.limit).map(|(a, b)| a + b);
            })
            .or_insert(*queue);
    }
    merged
        .into_iter()
        .map(|((service, _), queue)| ServiceListener { service, queue })
        .collect()
}

#[cfg(test)]
mod tests;
