//! The per-route families: each service's finished requests by route, method and
//! status class (and gRPC status), each route's queue time and duration histograms,
//! and the HTTP/2 connections whose headers could not be read.
use std::collections::BTreeMap;

use poolscope_shared::StatusClass;

use super::{Collected, Reading};
use crate::{
    encode::{Family, Kind},
    kernel::{RoutesRead, grpc_status_label},
    metrics::window::ClassicBuckets,
};

/// The route families of a reading; whole if the kernel was read.
pub fn collect(reading: &Reading<'_>) -> Collected {
    let no_routes = BTreeMap::new();
    let routes = reading.kernel.map_or(&no_routes, |kernel| &kernel.routes);
    let services = reading.services.iter().filter_map(|view| {
        routes
            .get(&view.id)
            .map(|routes| (view.name.as_str(), routes))
    });
    Collected {
        families: route_families(services, ClassicBuckets::configured(reading.metrics)),
        whole: reading.kernel.is_some(),
    }
}

/// The families of each service's routes (by name).
pub fn route_families<'a>(
    services: impl Iterator<Item = (&'a str, &'a RoutesRead)>,
    buckets: ClassicBuckets,
) -> Vec<Family> {
    let mut requests = Family::new(
        "route_requests",
        Kind::Counter,
        "Finished requests by route (the path with its ids as :id, no query, or a \
         gRPC method; other: past the route caps; unknown: no request line or \
         HTTP/2 headers read), method and the class of their final answer's status, \
         and for a gRPC call its grpc_status; a class shows from its first request.",
    );
    let mut lost = Family::new(
        "route_http2_headers_lost",
        Kind::Counter,
        "HTTP/2 connection directions (client's, server's) whose header blocks could \
         no longer be decoded, by reason (gap: a block missed or the connection seen \
         after its first; undecodable; untracked: past [limits] \
         http2_decoded_connections): their streams count under route unknown or \
         status_class unknown.",
    );
    let mut queue = Family::new(
        "route_request_queue_seconds",
        Kind::Histogram,
        "Queue time of a route's finished requests: first read minus arrival.",
    );
    let mut duration = Family::new(
        "route_request_duration_seconds",
        Kind::Histogram,
        "Service time of a route's finished requests: last write minus first read.",
    );
    for (service, routes) in services {
        for (reason, &count) in &routes.h2_lost {
            lost.push(
                &[("service", service), ("reason", reason.label())],
                count as f64,
            );
        }
        for ((method, route), totals) in &routes.routes {
            let mut labels = vec![("service", service), ("route", route.as_str())];
            if !method.is_empty() {
                labels.push(("method", method.as_str()));
            }
            for (class, &count) in StatusClass::ALL.iter().zip(&totals.responses) {
                if count > 0 {
                    let mut with_class = labels.clone();
                    with_class.push(("status_class", class.label()));
                    requests.push(&with_class, count as f64);
                }
            }
            for (&(class, code), &count) in &totals.grpc {
                let class = StatusClass::ALL.get(class).map_or("unknown", |c| c.label());
                let mut with_status = labels.clone();
                with_status.push(("status_class", class));
                with_status.push(("grpc_status", grpc_status_label(code)));
                requests.push(&with_status, count as f64);
            }
            queue.push_value(&labels, buckets.value(&totals.queue));
            duration.push_value(&labels, buckets.value(&totals.duration));
        }
    }
    vec![requests, queue, duration, lost]
}
