//! The agent's Prometheus metrics, end to end: `ebpf-proxy run` on the fake API
//! server (tests/apiserver/) in a node namespace, with `--metrics-bind-address`,
//! scraped before and after an EndpointSlice change (carrying the
//! `last-change-trigger-time` annotation) and traffic through the ClusterIP. The
//! counters, sync and programming metrics move as the traffic and the change did,
//! `promtool check metrics` accepts both expositions, and the collector's own
//! descriptors of the maps add no second mapping of the prefilter's arrays.
//!
//! Needs root (namespaces, BPF), the release binary (`cargo xtask build`) and
//! `promtool` (Debian's `prometheus`, which `cargo xtask setup` installs).

use ebpf_proxy_apiserver as apiserver;

mod scrape;

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddrV4},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use apiserver::{node, service, slice};
use ebpf_proxy_tests::{
    agent::Agent, client::tcp_tally, eventually, netns::NetNs, require_root, sandbox::Sandbox,
};
use k8s_openapi::jiff::Timestamp;
use scrape::promtool_accepts;
use serde_json::json;

use ebpf_proxy_tests::topology::one_node::{BACKENDS, CLIENT, CLUSTER_IP, TCP_PORT, UDP_PORT, VIP};
/// Not kube-proxy's default port, so the test shows the flag is honoured.
const METRICS: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10349);
use ebpf_proxy_tests::client::TIMEOUT;
const CONVERGE: Duration = Duration::from_secs(10);

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

    let before = scrape::scrape(node_ns, METRICS);
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
    let after = scrape::scrape(node_ns, METRICS);
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
    assert_eq!(after.get("ebpf_proxy_departed_purges_pending", &[]), 0.0);
    assert!(
        after
            .sum("ebpf_proxy_interface_xdp_mode", &[])
            .unwrap_or(0.0)
            >= 1.0,
        "no interface listed:\n{}",
        after.text
    );

    // The collector reads the maps through descriptors of its own, but leaves
    // the prefilter's arrays to the sync loop's one mapping of each: every
    // mapping puts all of an array's pages in the agent's resident memory.
    let pid = agent.pid().expect("the agent's pid");
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("the agent's mappings");
    for (name, words) in [
        ("PREFILTER", proxy_common::prefilter::WORDS),
        ("PREFILTER_FLOWS", proxy_common::prefilter::flows::WORDS),
    ] {
        let bytes = u64::from(words) * 8;
        let mappings = maps
            .lines()
            .filter(|l| l.contains("anon_inode:bpf-map"))
            .filter(|l| {
                let range = l.split(' ').next().unwrap_or_default();
                let (start, end) = range.split_once('-').unwrap_or_default();
                let size = u64::from_str_radix(end, 16)
                    .ok()
                    .zip(u64::from_str_radix(start, 16).ok());
                size.is_some_and(|(end, start)| end - start == bytes)
            })
            .count();
        assert_eq!(
            mappings, 1,
            "{name} ({bytes} bytes) is mapped {mappings} times into the agent:\n{maps}"
        );
    }
    drop(agent);
}
