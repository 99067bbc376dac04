//! The agent's Prometheus metrics, end to end: `ebpf-proxy run` on the fake API
//! server (tests/apiserver/) in a node namespace, with `--metrics-bind-address`,
//! scraped before and after an EndpointSlice change (carrying the
//! `last-change-trigger-time` annotation) and traffic through the ClusterIP. The
//! counters, sync and programming metrics move as the traffic and the change did,
//! and `promtool check metrics` accepts both expositions.
//!
//! Needs root (namespaces, BPF), the release binary (`cargo xtask build`) and
//! `promtool` (Debian's `prometheus`, which `cargo xtask setup` installs).

use ebpf_proxy_apiserver as apiserver;

use std::{
    collections::BTreeMap,
    io::Write,
    net::{Ipv4Addr, SocketAddrV4},
    process::{Command, Stdio},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use apiserver::{node, service, slice};
use ebpf_proxy_tests::{
    agent::{Agent, http_get},
    client::tcp_tally,
    eventually, eventually_value,
    netns::NetNs,
    require_root,
    sandbox::Sandbox,
};
use k8s_openapi::jiff::Timestamp;
use serde_json::json;

use ebpf_proxy_tests::topology::one_node::{BACKENDS, CLIENT, CLUSTER_IP, TCP_PORT, UDP_PORT, VIP};
/// Not kube-proxy's default port, so the test shows the flag is honoured.
const METRICS: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10349);
use ebpf_proxy_tests::client::TIMEOUT;
const CONVERGE: Duration = Duration::from_secs(10);

/// One scrape: every sample by its series (`name{labels}` as exposed).
struct Scrape {
    text: String,
    samples: BTreeMap<String, f64>,
}

impl Scrape {
    fn parse(text: String) -> Scrape {
        let samples = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .map(|line| {
                let (series, value) = line
                    .rsplit_once(' ')
                    .unwrap_or_else(|| panic!("a sample line without a value: {line:?}"));
                let value = value
                    .parse()
                    .unwrap_or_else(|_| panic!("a sample whose value is not a number: {line:?}"));
                (series.to_owned(), value)
            })
            .collect();
        Scrape { text, samples }
    }

    /// The sum of `name`'s samples whose labels include every one of `labels`.
    fn sum(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let matching: Vec<f64> = self
            .samples
            .iter()
            .filter(|(series, _)| {
                let (n, rest) = series.split_once('{').unwrap_or((series, ""));
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
            })
            .map(|(_, v)| *v)
            .collect();
        (!matching.is_empty()).then(|| matching.iter().sum())
    }

    /// [`Scrape::sum`], which must exist.
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.sum(name, labels).unwrap_or_else(|| {
            panic!(
                "no sample of {name} with {labels:?} in the exposition:\n{}",
                self.text
            )
        })
    }
}

/// A scrape that sees what happened before it: /metrics is served from a
/// snapshot up to a second old (docs/security.md, "HTTP endpoints"), so the
/// first snapshot begun after the call, one whose count of encodings is past
/// that of the snapshot answering at the call.
fn scrape(node: &NetNs) -> Scrape {
    const SNAPSHOTS: &str = "ebpf_proxy_metrics_snapshots_total";
    let at_call = scrape_now(node).get(SNAPSHOTS, &[]);
    eventually_value(
        "a /metrics snapshot begun after the scrape was asked for",
        Duration::from_secs(5),
        || {
            let now = scrape_now(node);
            match now.get(SNAPSHOTS, &[]) {
                n if n > at_call => Ok(now),
                n => Err(format!(
                    "still snapshot {n} ({SNAPSHOTS}), the one answering at the call"
                )),
            }
        },
    )
    .0
}

/// What /metrics answers now (a snapshot up to a second old).
fn scrape_now(node: &NetNs) -> Scrape {
    let (status, response) = node
        .run(|| http_get(METRICS, "/metrics"))
        .expect("enter the node namespace")
        .expect("GET /metrics");
    assert_eq!(status, 200, "GET /metrics answered:\n{response}");
    let (head, body) = response
        .split_once("\r\n\r\n")
        .expect("an HTTP response with a body");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "not Prometheus' text format:\n{head}"
    );
    Scrape::parse(dechunk(head, body))
}

/// The body of a chunked response, as is otherwise.
fn dechunk(head: &str, body: &str) -> String {
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return body.to_owned();
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).expect("a chunk size");
        if size == 0 {
            break;
        }
        out.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
    out
}

/// `promtool check metrics` on the exposition: it parses it as Prometheus
/// does and lints names, types and help.
fn promtool_accepts(scrape: &Scrape) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package; `cargo xtask setup` installs it)");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(scrape.text.as_bytes())
        .expect("write the exposition to promtool");
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics refused the exposition ({}): {}{}\n----- exposition -----\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        scrape.text
    );
}

/// Answers to `n` new connections to the VIP, by backend; an error if any failed.
fn served(client: &NetNs, n: usize) -> Result<BTreeMap<String, u64>, String> {
    let tally = tcp_tally(client, VIP, n, TIMEOUT).map_err(|e| format!("{e:#}"))?;
    match tally.failures.first() {
        Some(failure) => Err(format!(
            "{} of {n} failed, e.g. {failure}",
            tally.failures.len()
        )),
        None => Ok(tally.counts),
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom; its steps share the namespaces and agent it sets up"
)]
#[expect(
    clippy::float_cmp,
    reason = "the samples compared are counts, whole numbers that f64 holds exactly"
)]
fn metrics_move_with_traffic_and_changes() {
    require_root().expect("privileged test");
    let sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let node_ns = &sb.topology().node;
    let client = &sb.client().ns;
    let node_name = node_ns.name().to_owned();

    let (_runtime, server) = apiserver::serve_in(node_ns);
    server.apply(node(&node_name, None));
    server.apply(service("test", "web", &CLUSTER_IP.to_string()));
    server.apply(slice("test", "web-1", "web", &node_name, &["10.200.0.11"]));
    let api_host = server
        .url()
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();

    let agent = Agent::start_on_api(
        node_ns,
        server.url(),
        &["--metrics-bind-address", &METRICS.to_string()],
    )
    .expect("the agent on the API source");
    eventually("served by backend-a", CONVERGE, || {
        served(client, 5).map(|_| ())
    });

    let before = scrape(node_ns);
    promtool_accepts(&before);
    assert_eq!(
        before.get("kubeproxy_network_programming_duration_seconds_count", &[]),
        0.0,
        "no slice has changed since the agent started"
    );
    assert_eq!(
        before.get(
            "kubeproxy_sync_full_proxy_rules_duration_seconds_count",
            &[]
        ),
        1.0,
        "one full sync: the first"
    );

    // The controller's annotation: when the change this slice carries happened.
    let triggered = Timestamp::now();
    let triggered_unix = unix_now();
    let mut scaled = slice(
        "test",
        "web-1",
        "web",
        &node_name,
        &["10.200.0.11", "10.200.0.12", "10.200.0.13"],
    );
    scaled["metadata"]["annotations"] =
        json!({"endpoints.kubernetes.io/last-change-trigger-time": triggered.to_string()});
    server.apply(scaled);
    eventually("served by all three backends", CONVERGE, || {
        let counts = served(client, 30)?;
        if counts.len() == 3 {
            Ok(())
        } else {
            Err(format!("answered by {counts:?}"))
        }
    });
    const CONNECTIONS: usize = 40;
    let counts = served(client, CONNECTIONS).unwrap_or_else(|e| panic!("traffic: {e}"));
    let after = scrape(node_ns);
    let scraped_unix = unix_now();
    promtool_accepts(&after);

    let delta =
        |name: &str, labels: &[(&str, &str)]| after.get(name, labels) - before.get(name, labels);
    let dnat_new = delta("ebpf_proxy_datapath_events_total", &[("event", "dnat_new")]);
    assert!(
        dnat_new >= CONNECTIONS as f64,
        "dnat_new moved by {dnat_new} over at least {CONNECTIONS} new connections ({counts:?})"
    );
    let established = delta(
        "ebpf_proxy_datapath_events_total",
        &[("event", "dnat_established")],
    );
    assert!(established > 0.0, "dnat_established did not move");

    let programmed = after.get("kubeproxy_network_programming_duration_seconds_count", &[]);
    assert_eq!(programmed, 1.0, "the annotated slice change timed once");
    let latency = after.get("kubeproxy_network_programming_duration_seconds_sum", &[]);
    assert!(
        latency > 0.0 && latency <= scraped_unix - triggered_unix,
        "programming latency {latency} s is not between the change ({triggered}) and the scrape {} s later",
        scraped_unix - triggered_unix
    );
    eprintln!(
        "between the scrapes: dnat_new +{dnat_new}, dnat_established +{established}; \
         network programming latency {latency:.3} s"
    );
    assert!(
        delta("kubeproxy_sync_proxy_rules_endpoint_changes_total", &[]) >= 1.0,
        "the slice change is not counted"
    );
    assert!(
        delta(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds_count",
            &[]
        ) >= 1.0,
        "no partial sync after the change"
    );
    assert!(
        delta("kubeproxy_sync_proxy_rules_last_timestamp_seconds", &[]) > 0.0,
        "the last sync time did not move"
    );
    let last_queued = after.get(
        "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
        &[],
    );
    assert!(
        (triggered_unix - 1.0..=scraped_unix).contains(&last_queued),
        "last queued at {last_queued}, the change was made at {triggered_unix}"
    );
    assert_eq!(
        after.get("kubeproxy_sync_proxy_rules_endpoint_changes_pending", &[]),
        0.0,
        "everything is programmed"
    );
    assert!(
        after.get("kubeproxy_proxy_healthz_total", &[("code", "200")]) >= 1.0,
        "the harness' /healthz polls are not counted"
    );

    let lists = after.get(
        "rest_client_requests_total",
        &[("code", "200"), ("method", "GET"), ("host", &api_host)],
    );
    assert!(
        lists >= 3.0,
        "{lists} answered GETs to {api_host}: the listings and watches of Services, EndpointSlices and the Node"
    );
    assert!(
        after.get(
            "rest_client_request_duration_seconds_count",
            &[("verb", "GET"), ("host", &api_host)]
        ) >= lists,
        "every request timed"
    );

    assert!(after.get("process_cpu_seconds_total", &[]) > 0.0);
    assert!(after.get("process_resident_memory_bytes", &[]) > 1e6);
    let started = after.get("process_start_time_seconds", &[]);
    assert!(
        started <= triggered_unix && started > triggered_unix - 600.0,
        "process start {started} is not shortly before the change at {triggered_unix}"
    );

    assert!(
        after.get("ebpf_proxy_map_entries", &[("map", "SERVICES")]) >= 1.0,
        "the ClusterIP frontend"
    );
    assert_eq!(
        after.get("ebpf_proxy_map_entries", &[("map", "BACKENDS")]),
        3.0,
        "three backends"
    );
    let conntrack = after.get("ebpf_proxy_map_entries", &[("map", "CONNTRACK")])
        + after.get("ebpf_proxy_map_entries", &[("map", "CT_NEW")]);
    assert!(
        conntrack > 0.0,
        "no conntrack entries after {CONNECTIONS} connections"
    );
    assert_eq!(
        after.get("ebpf_proxy_map_capacity_entries", &[("map", "CONNTRACK")]),
        f64::from(proxy_common::MAX_CONNTRACK),
        "the default --conntrack-max, two entries a connection"
    );
    assert_eq!(after.get("ebpf_proxy_map_writes_pending", &[]), 0.0);
    assert!(
        after
            .sum("ebpf_proxy_interface_xdp_mode", &[])
            .unwrap_or(0.0)
            >= 1.0,
        "no interface listed:\n{}",
        after.text
    );
    drop(agent);
}
