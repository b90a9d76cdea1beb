//! The per-service families from hand-made counters: the gauges (HTTP/2 stream
//! workers included), the HTTP/2 families, every family rendered, listeners joined by
//! inode.
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use poolscope_shared::{Count, ServiceCounters};

use super::*;
use crate::{
    config::OctavesPerBucket,
    discovery::live::PerGauge,
    encode::{Format, render},
    metrics::window::Windows,
};

fn view(id: u32, name: &str, corrections: Corrections) -> ServiceView {
    ServiceView {
        id,
        name: name.into(),
        processes: 2,
        http2_worker_threads: None,
        workload: None,
        corrections,
    }
}

fn counters() -> ServiceCounters {
    ServiceCounters {
        accepted: Count::new(10),
        unserved_entered: Count::new(10),
        unserved_left: Count::new(6),
        waiting_entered: Count::new(20),
        waiting_left: Count::new(17),
        serving_entered: Count::new(30),
        serving_left: Count::new(25),
        finished: Count::new(25),
        ..ServiceCounters::default()
    }
}

#[test]
fn gauges_are_entered_minus_left_minus_purged() {
    let purged = Corrections {
        unserved: 1,
        waiting: 0,
        serving: 2,
        adopted_unserved: 0,
        recounted: PerGauge::default(),
    };
    let open = gauges(
        &counters(),
        &purged,
        StreamModel::EveryStream,
        StreamThreads::default(),
    );
    assert_eq!(
        open,
        Gauges {
            unserved: 3,
            waiting: 3,
            in_flight: 3
        }
    );
    // Adopted with a request unread: in the gauge until the kernel's read.
    let adopted = Corrections {
        adopted_unserved: 2,
        ..purged
    };
    assert_eq!(
        gauges(
            &counters(),
            &adopted,
            StreamModel::EveryStream,
            StreamThreads::default()
        )
        .unserved,
        5
    );
    // A recount found one fewer in flight than counted, and one more waiting.
    let recounted = Corrections {
        recounted: PerGauge {
            waiting: -1,
            in_flight: 1,
            ..PerGauge::default()
        },
        ..purged
    };
    let moved = gauges(
        &counters(),
        &recounted,
        StreamModel::EveryStream,
        StreamThreads::default(),
    );
    assert_eq!((moved.waiting, moved.in_flight), (4, 2));
    // Syscall backend: the backlog is not in the kernel's count.
    assert_eq!(queue_depth(Backend::Syscall, &open, 4), (3, 10));
    // Socket backend: it is (the count starts at the handshake).
    assert_eq!(queue_depth(Backend::Socket, &open, 2), (1, 6));
    // A backlog read a moment later than the kernel's counters never goes negative.
    assert_eq!(queue_depth(Backend::Socket, &open, 5), (0, 8));
}

#[test]
fn streams_waiting_for_a_worker_add_to_the_sockets_waiting() {
    let h2 = ServiceCounters {
        multiplexed: Count::new(1),
        waiting_entered: Count::new(1),
        serving_entered: Count::new(16),
        streams_opened: Count::new(16),
        ..ServiceCounters::default()
    };
    let corrections = Corrections::default();
    let pool = StreamThreads {
        busy: 5,
        workers: 4,
        workers_busy: 4,
    };
    // 16 open streams, a pool of 4 all busy: 12 wait for a worker, beside the one
    // request whose bytes wait in a socket.
    assert_eq!(
        gauges(&h2, &corrections, StreamModel::Workers, pool).waiting,
        13
    );
    assert_eq!(
        gauges(&h2, &corrections, StreamModel::EveryStream, pool).waiting,
        1
    );
}

#[test]
fn http2_families_only_for_services_with_http2_connections() {
    let times = RequestTimes::default();
    let (h2, h1) = (
        view(1, "grpc", Corrections::default()),
        view(2, "web", Corrections::default()),
    );
    let h2_counters = ServiceCounters {
        multiplexed: Count::new(3),
        streams_reset: Count::new(2),
        at_limit_entered: Count::new(5),
        at_limit_left: Count::new(4),
        max_streams: 100,
        streams_answered: Count::new(40),
        streams_answered_by_workers: Count::new(30),
        ..counters()
    };
    let h1_counters = counters();
    let input = |view, counters| ServiceInput {
        view,
        counters,
        times: &times,
        window: None,
        components: [0; COMPONENTS.len()],
        stream_threads: StreamThreads::default(),
    };
    let families = service_families(
        Backend::Socket,
        &[input(&h2, &h2_counters), input(&h1, &h1_counters)],
        &BTreeMap::new(),
        &[],
        ClassicBuckets::new(OctavesPerBucket::default()),
    );
    let text = render(&families, Format::Text);
    for line in [
        "poolscope_http2_connections_total{service=\"grpc\"} 3\n",
        "poolscope_http2_streams_reset_total{service=\"grpc\"} 2\n",
        "poolscope_http2_connections_at_stream_limit{service=\"grpc\"} 1\n",
        "poolscope_http2_max_concurrent_streams{service=\"grpc\"} 100\n",
        "poolscope_http2_streams_answered_total{service=\"grpc\",answerer=\"stream_worker\"} 30\n",
        "poolscope_http2_streams_answered_total{service=\"grpc\",answerer=\"other\"} 10\n",
        "poolscope_http2_stream_model{service=\"grpc\",model=\"workers\",source=\"detected\"} 1\n",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    assert!(
        !text.contains("poolscope_http2_connections_total{service=\"web\"}"),
        "a service without HTTP/2 got HTTP/2 series: {text}"
    );
}

#[test]
fn service_families_render_each_metric() {
    let mut times = RequestTimes::default();
    times.queue.buckets[poolscope_shared::histogram_bucket(2_000_000)] = 4;
    times.queue.sum_ns = 8_000_000;
    times.duration.buckets[poolscope_shared::histogram_bucket(5_000_000)] = 4;
    times.duration.sum_ns = 20_000_000;
    let view = view(3, "web", Corrections::default());
    let counters = counters();
    // The service's first reading: the window has all it finished.
    let window = Windows::new(Duration::from_secs(60)).delta(3, Instant::now(), &Arc::new(times));
    let inputs = [ServiceInput {
        view: &view,
        counters: &counters,
        times: &times,
        window: window.as_ref(),
        components: [0; COMPONENTS.len()],
        stream_threads: StreamThreads::default(),
    }];
    let mut syscalls = BTreeMap::new();
    syscalls.insert((3, "read"), 7);
    syscalls.insert((4, "read"), 9);
    let families = service_families(
        Backend::Syscall,
        &inputs,
        &syscalls,
        &[],
        ClassicBuckets::new(OctavesPerBucket::default()),
    );
    let text = render(&families, Format::Text);
    for line in [
        "poolscope_queue_depth{service=\"web\"} 7\n",
        "poolscope_connections_unserved{service=\"web\"} 4\n",
        "poolscope_requests_waiting{service=\"web\"} 3\n",
        "poolscope_requests_in_flight{service=\"web\"} 5\n",
        "poolscope_requests_total{service=\"web\"} 4\n",
        "poolscope_connections_accepted_total{service=\"web\"} 10\n",
        "poolscope_request_time_seconds_total{service=\"web\",component=\"queue\"} 0.008\n",
        "poolscope_syscalls_total{service=\"web\",syscall=\"read\"} 7\n",
        "poolscope_request_queue_seconds_sum{service=\"web\"} 0.008\n",
        "poolscope_request_duration_seconds_count{service=\"web\"} 4\n",
        "poolscope_targets{service=\"web\"} 2\n",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    assert!(
        !text.contains("} 9\n"),
        "another service's counter leaked: {text}"
    );
    let median = text
        .lines()
        .find(|l| {
            l.starts_with(
                "poolscope_request_duration_window_seconds{service=\"web\",quantile=\"0.5\"}",
            )
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .expect("median line");
    assert!((median - 0.005).abs() < 0.0005, "{median}");
}

#[test]
fn listeners_join_by_inode_and_skip_unwatched() {
    let queue = |inode, port| ListenQueue {
        inode,
        addr: format!("127.0.0.1:{port}").parse().expect("addr"),
        depth: 4,
        limit: Some(16),
    };
    let listeners = service_listeners(&[queue(1, 80), queue(2, 81)], |inode| {
        (inode == 1).then(|| "web".to_owned())
    });
    assert_eq!(listeners.len(), 1);
    // SO_REUSEPORT: three sockets on one address are one listener.
    let reuseport = service_listeners(&[queue(1, 80), queue(3, 80), queue(4, 80)], |_| {
        Some("web".to_owned())
    });
    assert_eq!(reuseport.len(), 1);
    assert_eq!(
        (reuseport[0].queue.depth, reuseport[0].queue.limit),
        (12, Some(48))
    );
    // A queue read from procfs (another namespace's) has no known limit, and
    // neither has the sum it is part of.
    let mut foreign = queue(5, 80);
    foreign.limit = None;
    let mixed = service_listeners(&[queue(1, 80), foreign], |_| Some("web".to_owned()));
    assert_eq!((mixed[0].queue.depth, mixed[0].queue.limit), (8, None));
    let text = render(
        &service_families(
            Backend::Syscall,
            &[],
            &BTreeMap::new(),
            &listeners,
            ClassicBuckets::new(OctavesPerBucket::default()),
        ),
        Format::Text,
    );
    assert!(
        text.contains(
            "poolscope_listen_queue_depth{service=\"web\",listener=\"127.0.0.1:80\"} 4\n"
        )
    );
    assert!(
        text.contains(
            "poolscope_listen_queue_limit{service=\"web\",listener=\"127.0.0.1:80\"} 16\n"
        )
    );
}
