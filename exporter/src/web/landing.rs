//! The landing page at `/`: what poolscope is, its version and git commit, and a link
//! to every endpoint the listener serves (the `/debug/*` ones only where they answer).
use crate::config::DebugAccess;

/// The page, for metrics at `telemetry_path` (plain: letters, digits and `/_.-`, as
/// the configuration checks) and `/debug/*` as `debug` allows.
pub fn landing_page(telemetry_path: &str, debug: DebugAccess) -> String {
    let mut links = vec![
        (
            telemetry_path,
            "the metrics (Prometheus text, OpenMetrics, gzip)",
        ),
        (
            "/healthz",
            "ok, or what poolscope measures less than it should, and what to change",
        ),
    ];
    let debug_note = match debug {
        DebugAccess::Off => "<p>/debug/* is off (web.debug_endpoints).</p>\n",
        DebugAccess::Localhost => {
            "<p>/debug/* answers clients on this host only (web.debug_endpoints).</p>\n"
        }
        DebugAccess::All => "",
    };
    if debug != DebugAccess::Off {
        links.extend([
            (
                "/debug/threads",
                "every followed thread: service, pool, what it is doing",
            ),
            (
                "/debug/locks",
                "the most contended locks of a service, with stacks (?service=)",
            ),
            ("/debug/snapshots", "the stack snapshots kept (JSON)"),
            (
                "/debug/stacks/cpu",
                "on-CPU stacks of the last snapshot (?service=&format=)",
            ),
            (
                "/debug/stacks/offcpu",
                "off-CPU stacks of the last snapshot",
            ),
            ("/debug/stacks/wall", "on- and off-CPU stacks together"),
            (
                "/debug/pprof/profile",
                "a CPU profile of a service for ?seconds= (pprof)",
            ),
        ]);
    }
    let items: String = links
        .iter()
        .map(|(path, what)| format!("<li><a href=\"{path}\">{path}</a>: {what}</li>\n"))
        .collect();
    format!(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>poolscope</title></head>\n\
         <body>\n<h1>poolscope</h1>\n<p>Queue depth, thread-pool use, request and lock \
         timing of every network service on this host, from eBPF. Version {} (commit {}).\
         </p>\n<ul>\n{items}</ul>\n{debug_note}</body></html>\n",
        env!("CARGO_PKG_VERSION"),
        crate::revision::REVISION,
    )
}

#[cfg(test)]
mod tests {
    use super::landing_page;
    use crate::config::DebugAccess;

    #[test]
    fn links_every_endpoint_that_answers() {
        let page = landing_page("/probe/metrics", DebugAccess::Localhost);
        assert!(page.contains("<a href=\"/probe/metrics\">"));
        assert!(page.contains("<a href=\"/healthz\">"));
        assert!(page.contains("<a href=\"/debug/pprof/profile\">"));
        assert!(page.contains(env!("CARGO_PKG_VERSION")));
        assert!(page.contains(crate::revision::REVISION));
        let off = landing_page("/metrics", DebugAccess::Off);
        assert!(!off.contains("href=\"/debug/"));
        assert!(off.contains("/debug/* is off"));
    }
}
