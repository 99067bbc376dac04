//! `ebpf-proxy status` by Service: the agent on the loopback API server
//! programs two Services of two namespaces, and the status names them, with
//! their ports, frontends (of their kinds), backends and each backend's
//! share of new flows; as JSON, as text, and narrowed to one Service.
//!
//! Needs root (namespaces, BPF) and the release binary (`cargo xtask build`).

use ebpf_proxy_apiserver as apiserver;

use std::{collections::BTreeMap, time::Duration};

use ebpf_proxy_tests::{
    eventually,
    kube_agent::KubeAgent,
    netns::unique_stem,
    require_root,
    sandbox::Sandbox,
    topology::one_node::{BACKENDS, CLIENT, TCP_PORT, UDP_PORT},
};
use serde_json::{Value, json};

const CONVERGE: Duration = Duration::from_secs(10);
const WEB_IP: &str = "10.96.0.40";
const DNS_IP: &str = "10.96.0.41";
const NODE_PORT: u16 = 30480;

/// `namespace/web`: a NodePort Service, port `http` 80/TCP (NodePort
/// `NODE_PORT`) to the endpoints' port `http`.
fn web(namespace: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": namespace},
        "spec": {
            "type": "NodePort",
            "clusterIP": WEB_IP, "clusterIPs": [WEB_IP],
            "ports": [{
                "name": "http", "port": 80, "protocol": "TCP", "targetPort": "http",
                "nodePort": NODE_PORT,
            }],
        },
    })
}

/// `namespace/kube-dns`: port `dns` 53/UDP to the endpoints' port `dns`.
fn kube_dns(namespace: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "kube-dns", "namespace": namespace},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": DNS_IP, "clusterIPs": [DNS_IP],
            "ports": [{"name": "dns", "port": 53, "protocol": "UDP", "targetPort": "dns"}],
        },
    })
}

/// `(address, port)` -> probability of a port's `backends`.
fn shares(backends: &Value) -> BTreeMap<(String, u64), f64> {
    backends
        .as_array()
        .unwrap_or_else(|| panic!("backends are not a list: {backends}"))
        .iter()
        .map(|b| {
            (
                (
                    b["address"].as_str().unwrap_or("?").to_owned(),
                    b["port"].as_u64().unwrap_or(0),
                ),
                b["probability"].as_f64().unwrap_or(-1.0),
            )
        })
        .collect()
}

/// Each backend of `backends` at `port` with an equal share.
fn equal_shares(backends: &[String], port: u64) -> BTreeMap<(String, u64), f64> {
    backends
        .iter()
        .map(|ip| ((ip.clone(), port), 1.0 / backends.len() as f64))
        .collect()
}

fn same_shares(got: &BTreeMap<(String, u64), f64>, want: &BTreeMap<(String, u64), f64>) -> bool {
    got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|((gk, gp), (wk, wp))| gk == wk && (gp - wp).abs() < 1e-9)
}

/// `(kind, address, port, protocol)` of a port's frontends.
fn frontends(port: &Value) -> Vec<(String, String, u64, String)> {
    port["frontends"]
        .as_array()
        .unwrap_or_else(|| panic!("frontends are not a list: {port}"))
        .iter()
        .map(|f| {
            (
                f["kind"].as_str().unwrap_or("?").to_owned(),
                f["address"].as_str().unwrap_or("?").to_owned(),
                f["port"].as_u64().unwrap_or(0),
                f["protocol"].as_str().unwrap_or("?").to_owned(),
            )
        })
        .collect()
}

fn parse(json: &str, what: &str) -> Value {
    serde_json::from_str(json).unwrap_or_else(|e| panic!("{what} is not JSON ({e}):\n{json}"))
}

#[test]
fn status_names_each_service_with_its_frontends_backends_and_their_shares() {
    require_root().expect("privileged test");
    let sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let node_ns = &sb.topology().node;
    let node_name = node_ns.name().to_owned();
    // Namespaces of this run: unique, so that a report of another run's
    // pins could not pass for this one's.
    let stem = unique_stem().replace('_', "-").to_lowercase();
    let (shop, dns) = (format!("shop-{stem}"), format!("dns-{stem}"));
    let backend_ips: Vec<String> = BACKENDS.iter().map(|b| b.1.to_string()).collect();
    let web_backends = backend_ips[..2].to_vec();
    let addrs: Vec<&str> = backend_ips.iter().map(String::as_str).collect();
    let (_runtime, server) = apiserver::serve_in(node_ns);
    server.apply(apiserver::node(&node_name, None));
    server.apply(web(&shop));
    server.apply(apiserver::slice_on(
        &shop,
        "web-1",
        "web",
        &node_name,
        ("http", 8080, "TCP"),
        &addrs[..2],
    ));
    server.apply(kube_dns(&dns));
    server.apply(apiserver::slice_on(
        &dns,
        "kube-dns-1",
        "kube-dns",
        &node_name,
        ("dns", 5353, "UDP"),
        &addrs,
    ));
    let agent = KubeAgent::start(node_ns, server.url());

    // Both Services programmed, named, with every backend.
    let report = eventually_report(&agent);
    let services = report["services"]
        .as_array()
        .unwrap_or_else(|| panic!("no list of services:\n{report:#}"));
    let names: Vec<(&str, &str)> = services
        .iter()
        .map(|s| {
            (
                s["namespace"].as_str().unwrap_or("?"),
                s["name"].as_str().unwrap_or("?"),
            )
        })
        .collect();
    assert_eq!(
        names,
        [(dns.as_str(), "kube-dns"), (shop.as_str(), "web")],
        "the Services, sorted by namespace:\n{report:#}"
    );

    let dns_id = check_kube_dns(&services[0], &backend_ips);
    check_web(&services[1], &web_backends, &dns_id);
    assert!(
        report["node"]["counters"].is_array() && report["node"]["attached"].is_array(),
        "the node's part is missing:\n{report:#}"
    );
    check_one_service(&agent, &shop, &dns, &services[1], &web_backends);

    let flows = parse(
        &agent
            .status(&["--output", "json", "--flows"])
            .expect("ebpf-proxy status --output json --flows"),
        "status --output json --flows",
    );
    assert!(
        flows["flows"].is_array(),
        "--flows as JSON has no list of flows:\n{flows:#}"
    );
}

/// kube-dns's port, frontend, backends and shares; returns its service id.
fn check_kube_dns(service: &Value, backend_ips: &[String]) -> Value {
    let dns_port = &service["ports"][0];
    assert_eq!(
        (&dns_port["name"], &dns_port["port"], &dns_port["protocol"]),
        (&json!("dns"), &json!(53), &json!("UDP")),
        "kube-dns's port:\n{dns_port:#}"
    );
    assert!(
        dns_port["service_id"].as_u64().is_some_and(|id| id > 0),
        "kube-dns's port has no service id:\n{dns_port:#}"
    );
    assert_eq!(
        frontends(dns_port),
        [(
            "ClusterIP".to_owned(),
            DNS_IP.to_owned(),
            53,
            "UDP".to_owned()
        )],
        "kube-dns's frontends:\n{dns_port:#}"
    );
    let got = shares(&dns_port["backends"]);
    let want = equal_shares(backend_ips, 5353);
    assert!(
        same_shares(&got, &want),
        "kube-dns's backends and shares: {got:?}, expected {want:?}"
    );
    dns_port["service_id"].clone()
}

/// web's port, its ClusterIP and NodePort, backends and shares.
fn check_web(service: &Value, web_backends: &[String], dns_id: &Value) {
    let web_ports = service["ports"]
        .as_array()
        .unwrap_or_else(|| panic!("web has no ports:\n{service:#}"));
    assert_eq!(web_ports.len(), 1, "web's ports:\n{service:#}");
    let web_port = &web_ports[0];
    assert_eq!(
        (&web_port["name"], &web_port["port"], &web_port["protocol"]),
        (&json!("http"), &json!(80), &json!("TCP")),
        "web's port:\n{web_port:#}"
    );
    assert_ne!(
        &web_port["service_id"], dns_id,
        "web's port has kube-dns's service id:\n{web_port:#}"
    );
    assert_eq!(
        frontends(web_port),
        [
            (
                "ClusterIP".to_owned(),
                WEB_IP.to_owned(),
                80,
                "TCP".to_owned()
            ),
            (
                "NodePort".to_owned(),
                "0.0.0.0".to_owned(),
                u64::from(NODE_PORT),
                "TCP".to_owned()
            ),
        ],
        "web's frontends:\n{web_port:#}"
    );
    let got = shares(&web_port["backends"]);
    let want = equal_shares(web_backends, 8080);
    assert!(
        same_shares(&got, &want),
        "web's backends and shares: {got:?}, expected {want:?}"
    );
}

/// `--service`, as JSON and as text: web alone, the node's part whole.
fn check_one_service(
    agent: &KubeAgent,
    shop: &str,
    dns: &str,
    web: &Value,
    web_backends: &[String],
) {
    let service = format!("{shop}/web");
    let only = parse(
        &agent
            .status(&["--output", "json", "--service", &service])
            .expect("ebpf-proxy status --output json --service"),
        "status --service --output json",
    );
    let only_names: Vec<String> = only["services"]
        .as_array()
        .map(|list| {
            list.iter()
                .map(|s| format!("{}/{}", s["namespace"], s["name"]))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        only_names,
        [format!("\"{shop}\"/\"web\"")],
        "--service {service}:\n{only:#}"
    );
    assert_eq!(
        &only["services"][0], web,
        "--service {service} reports web as the full report does"
    );
    assert!(
        only["node"]["counters"].is_array(),
        "--service {service} drops the node's part:\n{only:#}"
    );

    let text = agent
        .status(&["--service", &service])
        .expect("ebpf-proxy status --service");
    let kube_dns = format!("{dns}/kube-dns");
    assert!(
        text.lines().any(|l| l == service)
            && text
                .lines()
                .any(|l| l == format!("    ClusterIP {WEB_IP}:80/TCP"))
            && text
                .lines()
                .any(|l| l == format!("    NodePort 0.0.0.0:{NODE_PORT}/TCP"))
            && !text.contains(&kube_dns)
            && text.lines().any(|l| l.starts_with("counter ")),
        "the text of --service {service} lacks web's lines or the node's counters, or \
         shows {kube_dns}:\n{text}"
    );
    let port_line = text
        .lines()
        .find(|l| l.starts_with("  port http 80/TCP (service id "))
        .unwrap_or_else(|| panic!("no line of web's port in the text:\n{text}"));
    assert!(
        web_backends
            .iter()
            .all(|ip| port_line.contains(&format!("{ip}:8080 50%"))),
        "web's port line lacks a backend at 50%: {port_line}"
    );
}

/// The JSON report once both Services' every backend is in it.
fn eventually_report(agent: &KubeAgent) -> Value {
    let mut report = Value::Null;
    eventually("both Services in the status", CONVERGE, || {
        let out = agent
            .status(&["--output", "json"])
            .map_err(|e| format!("{e:#}"))?;
        report = serde_json::from_str(&out).map_err(|e| format!("not JSON ({e}):\n{out}"))?;
        let backends: usize = report["services"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|s| s["ports"].as_array().into_iter().flatten())
            .map(|p| p["backends"].as_array().map_or(0, Vec::len))
            .sum();
        if backends == 5 {
            Ok(())
        } else {
            Err(format!("{backends} backends of 5 in:\n{report:#}"))
        }
    });
    report
}
