//! The agent binary as a DaemonSet runs it: `ebpf-proxy run --config FILE`,
//! a kube-proxy configuration whose kubeconfig names the API server (the
//! loopback fake, tests/apiserver/), with no `--master`; and /healthz and
//! /livez following this node's Node through the API as kube-proxy's do, and
//! /readyz, the DaemonSet's startup and readiness probe, 200 throughout: a
//! drained node must not hold back or restart its proxy.
//!
//! Needs root (namespaces, BPF) and the release binary (`cargo xtask build`).

use ebpf_proxy_apiserver as apiserver;

use std::{
    fs,
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    time::Duration,
};

use apiserver::{node, service, slice};
use ebpf_proxy_tests::{
    agent::{self, Agent, HEALTHZ},
    eventually,
    netns::{NetNs, run_in, unique_stem},
    require_root,
    sandbox::Sandbox,
};
use serde_json::{Value, json};

use ebpf_proxy_tests::topology::one_node::{CLIENT, TCP_PORT, UDP_PORT};

const BACKENDS: [(&str, Ipv4Addr); 1] = [ebpf_proxy_tests::topology::one_node::BACKENDS[0]];
/// Set by the file (kube-proxy's default is 127.0.0.1:10249).
const METRICS_FROM_FILE: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10359);
/// Set by the file, and overridden by the harness's --healthz-bind-address.
const HEALTHZ_FROM_FILE: &str = "127.0.0.1:10366";
const CONVERGE: Duration = Duration::from_secs(10);

/// A directory of files for one test, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let dir = std::env::temp_dir().join(format!("{}-kube-config", unique_stem()));
        fs::create_dir_all(&dir).expect("temporary directory");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Writes kubeadm's two ConfigMap keys as the DaemonSet mounts them: a
/// `config.conf` that names `kubeconfig.conf`, which names the API server.
fn write_config(dir: &TempDir, server_url: &str) -> PathBuf {
    let kubeconfig = dir.0.join("kubeconfig.conf");
    fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    server: {server_url}\n  name: default\n\
             contexts:\n- context:\n    cluster: default\n    namespace: default\n    user: default\n  name: default\n\
             current-context: default\nusers:\n- name: default\n  user: {{}}\n"
        ),
    )
    .expect("write kubeconfig.conf");
    let config = dir.0.join("config.conf");
    fs::write(
        &config,
        format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n\
             bindAddress: 0.0.0.0\nclientConnection:\n  kubeconfig: {}\n  qps: 0\n\
             healthzBindAddress: {HEALTHZ_FROM_FILE}\nmetricsBindAddress: {METRICS_FROM_FILE}\n\
             mode: ipvs\nipvs:\n  strictARP: false\n  syncPeriod: 30s\n",
            kubeconfig.display()
        ),
    )
    .expect("write config.conf");
    config
}

/// Status code and JSON body of `GET path` on the agent's health port.
fn probe(node: &NetNs, path: &str) -> Result<(u16, Value), String> {
    let (code, response) = run_in(&node.path(), || agent::http_get(HEALTHZ, path))
        .and_then(|r| r)
        .map_err(|e| format!("GET {path}: {e:#}"))?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body)
        .unwrap_or_default();
    let json = serde_json::from_str(body)
        .map_err(|e| format!("GET {path}: body {body:?} is not JSON: {e}"))?;
    Ok((code, json))
}

/// /healthz and /livez answer `healthz` and `livez`, /healthz's body saying
/// `eligible`; /readyz answers 200 (every call is after the first sync).
fn answers(node: &NetNs, healthz: u16, livez: u16, eligible: bool) -> Result<(), String> {
    let (code, body) = probe(node, "/healthz")?;
    if code != healthz || body["nodeEligible"] != json!(eligible) {
        return Err(format!(
            "/healthz: {code} {body}, want {healthz} with nodeEligible {eligible}"
        ));
    }
    let (code, body) = probe(node, "/livez")?;
    if code != livez || body.get("nodeEligible").is_some() {
        return Err(format!(
            "/livez: {code} {body}, want {livez} without nodeEligible"
        ));
    }
    let (code, body) = probe(node, "/readyz")?;
    if code != 200 || body.get("nodeEligible").is_some() {
        return Err(format!(
            "/readyz: {code} {body}, want 200 without nodeEligible"
        ));
    }
    Ok(())
}

#[test]
fn config_file_reaches_the_api_and_healthz_follows_the_node() {
    require_root().expect("privileged test");
    let sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let node_ns = &sb.topology().node;
    let node_name = node_ns.name().to_owned();

    let (_runtime, server) = apiserver::serve_in(node_ns);
    server.apply(node(&node_name, None));
    server.apply(service("test", "web", "10.96.0.10"));
    server.apply(slice("test", "web-1", "web", &node_name, &["10.200.0.11"]));

    let dir = TempDir::new();
    let config = write_config(&dir, server.url());
    // Healthy means the Services were listed: through the file's kubeconfig,
    // as no --master is given. The harness's --healthz-bind-address (where
    // it waits) overrides the file's.
    let agent = Agent::start_with_config(node_ns, &config, &[])
        .expect("the agent on --config, healthy on the flag's address");
    let log = agent.log();
    for expected in [
        "field=mode value=ipvs",
        "configuration field not applied",
        "flag=healthz-bind-address",
    ] {
        assert!(log.contains(expected), "no {expected:?} in the log:\n{log}");
    }
    assert!(
        !log.contains("field=ipvs"),
        "ipvs.syncPeriod applies in ipvs mode and strictARP false is a default:\n{log}"
    );
    let metrics = run_in(&node_ns.path(), || {
        agent::http_status(METRICS_FROM_FILE, "/metrics")
    })
    .and_then(|r| r);
    assert_eq!(
        metrics.ok(),
        Some(200),
        "metrics are served on the file's metricsBindAddress"
    );
    let file_healthz: SocketAddrV4 = HEALTHZ_FROM_FILE.parse().unwrap();
    assert!(
        run_in(&node_ns.path(), || agent::http_status(
            file_healthz,
            "/healthz"
        ))
        .and_then(|r| r)
        .is_err(),
        "nothing listens on the file's healthzBindAddress: the flag overrode it"
    );

    eventually("healthy and eligible", CONVERGE, || {
        answers(node_ns, 200, 200, true)
    });
    let (_, body) = probe(node_ns, "/healthz").expect("/healthz");
    assert_eq!(
        body["lastUpdated"], body["currentTime"],
        "healthy: lastUpdated is now, as kube-proxy answers"
    );

    let mut tainted = node(&node_name, None);
    tainted["spec"] = json!({"taints": [
        {"key": "ToBeDeletedByClusterAutoscaler", "value": "1700000000", "effect": "NoSchedule"}
    ]});
    server.apply(tainted);
    eventually(
        "tainted ToBeDeletedByClusterAutoscaler: /healthz 503, /livez 200",
        CONVERGE,
        || answers(node_ns, 503, 200, false),
    );

    let mut other_taint = node(&node_name, None);
    other_taint["spec"] = json!({"taints": [
        {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
    ]});
    server.apply(other_taint);
    eventually("taint removed (another one left)", CONVERGE, || {
        answers(node_ns, 200, 200, true)
    });

    let mut deleting = node(&node_name, None);
    deleting["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    server.apply(deleting);
    eventually(
        "deletionTimestamp set: /healthz 503, /livez 200",
        CONVERGE,
        || answers(node_ns, 503, 200, false),
    );

    server.apply(node(&node_name, None));
    eventually("an ordinary Node again", CONVERGE, || {
        answers(node_ns, 200, 200, true)
    });
    drop(agent);
}
