//! End to end through the agent binary on the Kubernetes API source: the fake API
//! server (tests/apiserver/) listens inside the node namespace, `ebpf-proxy run
//! --master URL` runs there on the real kube-rs client, and real TCP traffic from a
//! client pod to the ClusterIP follows the Services and EndpointSlices the test
//! creates, scales, relabels and deletes through the API, also across an API outage.
//!
//! Needs root (namespaces, BPF) and the release binary (`cargo xtask build`).

mod apiserver;

use std::{
    collections::BTreeMap,
    fs::{self, File},
    net::{Ipv4Addr, SocketAddrV4},
    os::unix::process::CommandExt,
    path::PathBuf,
    process::{Child, Stdio},
    thread,
    time::{Duration, Instant},
};

use apiserver::{ApiServer, Resource, node, service, slice};
use ebpf_proxy_tests::{
    agent::{self, HEALTHZ},
    client::{Outcome, tcp_request, tcp_tally},
    netns::{NetNs, command_in, run_in, unique_stem},
    require_root, run_cmd,
    sandbox::Sandbox,
};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use serde_json::json;

const CLIENT: (&str, Ipv4Addr) = ("client", Ipv4Addr::new(10, 200, 0, 2));
const BACKENDS: [(&str, Ipv4Addr); 3] = [
    ("backend-a", Ipv4Addr::new(10, 200, 0, 11)),
    ("backend-b", Ipv4Addr::new(10, 200, 0, 12)),
    ("backend-c", Ipv4Addr::new(10, 200, 0, 13)),
];
/// The backends' port; the fake's Services name it `http` (targetPort by name).
const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 5353;
const CLUSTER_IP: &str = "10.96.0.10";
const VIP: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80);
/// Per request.
const TIMEOUT: Duration = Duration::from_secs(2);
/// How long an API change may take to show in the traffic. The agent's own path is
/// milliseconds; this is slack for a loaded machine.
const CONVERGE: Duration = Duration::from_secs(5);
/// Recovery after an outage includes kube-rs's backoff (up to ~6 s after a few
/// failed attempts).
const RECOVERY: Duration = Duration::from_secs(20);

/// `ebpf-proxy run --master URL` in a namespace, stopped and cleaned up on drop.
/// (The harness's `Agent` always passes `--manifests`.)
struct KubeAgent {
    child: Option<Child>,
    bin: PathBuf,
    netns_path: PathBuf,
    bpf_root: PathBuf,
    log_path: PathBuf,
}

impl KubeAgent {
    fn start(node: &NetNs, master: &str) -> KubeAgent {
        let bin = agent::binary().expect("the agent binary");
        let stem = unique_stem();
        // The harness's prefix, so its stale-state sweep knows these.
        let bpf_root = PathBuf::from(format!("/sys/fs/bpf/ebpf-proxy-test-{stem}"));
        let log_path = std::env::temp_dir().join(format!("{stem}-kube-agent.log"));
        let log = File::create(&log_path).expect("agent log file");
        let mut cmd = node.command(&bin);
        cmd.arg("run")
            .arg("--master")
            .arg(master)
            .arg("--bpf-root")
            .arg(&bpf_root)
            .arg("--healthz-bind-address")
            .arg(HEALTHZ.to_string())
            .arg("--node-name")
            .arg(node.name())
            .env_remove("KUBECONFIG")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .process_group(0);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        let child = cmd.spawn().expect("start the agent");
        let mut agent = KubeAgent {
            child: Some(child),
            bin,
            netns_path: node.path(),
            bpf_root,
            log_path,
        };
        agent.wait_healthy(Duration::from_secs(60));
        agent
    }

    fn wait_healthy(&mut self, timeout: Duration) {
        let start = Instant::now();
        let mut last = String::from("no answer yet");
        while start.elapsed() < timeout {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().expect("wait"))
            {
                panic!(
                    "the agent exited ({status}) before becoming healthy:\n{}",
                    self.log()
                );
            }
            match run_in(&self.netns_path, || agent::http_status(HEALTHZ, "/healthz")) {
                Ok(Ok(200)) => return,
                Ok(Ok(code)) => last = format!("HTTP {code}"),
                Ok(Err(e)) | Err(e) => last = format!("{e:#}"),
            }
            thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "the agent was not healthy after {timeout:?} (last /healthz: {last}):\n{}",
            self.log()
        );
    }

    fn healthz(&self) -> String {
        match run_in(&self.netns_path, || agent::http_status(HEALTHZ, "/healthz")) {
            Ok(Ok(code)) => format!("HTTP {code}"),
            Ok(Err(e)) | Err(e) => format!("{e:#}"),
        }
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log_path)
            .unwrap_or_else(|e| format!("(cannot read {}: {e})", self.log_path.display()))
    }
}

impl Drop for KubeAgent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
            let start = Instant::now();
            while child.try_wait().ok().flatten().is_none() {
                if start.elapsed() > Duration::from_secs(10) {
                    eprintln!("warning: the agent ignored SIGTERM for 10 s; killing it");
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                thread::sleep(Duration::from_millis(20));
            }
        }
        let mut cleanup = command_in(&self.netns_path, &self.bin);
        cleanup.arg("cleanup").arg("--bpf-root").arg(&self.bpf_root);
        if let Err(e) = run_cmd(&mut cleanup) {
            eprintln!("warning: agent cleanup failed: {e:#}");
        }
        if self.bpf_root.exists()
            && let Err(e) = fs::remove_dir_all(&self.bpf_root)
        {
            eprintln!("warning: cannot remove {}: {e}", self.bpf_root.display());
        }
        if thread::panicking() {
            eprintln!(
                "----- agent output ({}) -----\n{}----- end of agent output -----",
                self.log_path.display(),
                self.log()
            );
        }
        let _ = fs::remove_file(&self.log_path);
    }
}

/// Retries `check` until it passes; panics with its last complaint after `within`.
/// Returns how long it took.
fn eventually(
    what: &str,
    within: Duration,
    mut check: impl FnMut() -> Result<(), String>,
) -> Duration {
    let start = Instant::now();
    loop {
        match check() {
            Ok(()) => return start.elapsed(),
            Err(e) if start.elapsed() > within => panic!("{what}: still after {within:?}: {e}"),
            Err(_) => thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Which backends answer `n` new connections to the VIP; an error for any request
/// that was not answered.
fn backends_answering(client: &NetNs, n: usize) -> Result<BTreeMap<String, u64>, String> {
    let tally = tcp_tally(client, VIP, n, TIMEOUT).map_err(|e| format!("{e:#}"))?;
    if !tally.failures.is_empty() {
        return Err(format!(
            "{} of the requests failed, e.g. {}; answered: {:?}",
            tally.failures.len(),
            tally.failures[0],
            tally.counts
        ));
    }
    Ok(tally.counts)
}

/// Passes once `n` connections are all answered, by exactly `backends`.
fn served_by(client: &NetNs, n: usize, backends: &[&str]) -> Result<(), String> {
    let counts = backends_answering(client, n)?;
    let seen: Vec<&str> = counts.keys().map(String::as_str).collect();
    if seen == backends {
        Ok(())
    } else {
        Err(format!("answered by {counts:?}, want exactly {backends:?}"))
    }
}

fn web_slice(node_name: &str, backends: &[&str]) -> serde_json::Value {
    let ips: Vec<String> = backends
        .iter()
        .map(|name| {
            BACKENDS
                .iter()
                .find(|b| b.0 == *name)
                .unwrap_or_else(|| panic!("no backend {name}"))
                .1
                .to_string()
        })
        .collect();
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    slice("test", "web-1", "web", node_name, &ips)
}

fn bind_in(node: &NetNs) -> std::net::TcpListener {
    let listener = node
        .run(|| std::net::TcpListener::bind("127.0.0.1:0"))
        .expect("enter the node namespace")
        .expect("bind the fake API server in the node namespace");
    listener.set_nonblocking(true).expect("non-blocking");
    listener
}

#[test]
fn traffic_follows_services_through_the_api() {
    require_root().expect("privileged test");
    let sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let node_ns = &sb.topology().node;
    let client = &sb.client().ns;
    let node_name = node_ns.name().to_owned();

    // The API server's runtime: one worker thread, while this thread drives the
    // (blocking) traffic.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let server = {
        let _context = runtime.enter();
        let listener = tokio::net::TcpListener::from_std(bind_in(node_ns)).expect("listener");
        ApiServer::serve(listener)
    };
    server.apply(node(&node_name, Some("zone-a")));
    server.apply(service("test", "web", CLUSTER_IP));
    server.apply(web_slice(&node_name, &["backend-a"]));

    let agent = KubeAgent::start(node_ns, server.url());
    let context = |what: &str| format!("{what} (agent /healthz: {})", agent.healthz());

    eventually(&context("created"), CONVERGE, || {
        served_by(client, 10, &["backend-a"])
    });

    server.apply(web_slice(
        &node_name,
        &["backend-a", "backend-b", "backend-c"],
    ));
    let took = eventually(&context("scaled to three"), CONVERGE, || {
        served_by(client, 60, &["backend-a", "backend-b", "backend-c"])
    });
    eprintln!("scale-up visible in the traffic after {took:?}");

    let mut other_proxy = service("test", "web", CLUSTER_IP);
    other_proxy["metadata"]["labels"] =
        json!({"service.kubernetes.io/service-proxy-name": "other-proxy"});
    server.apply(other_proxy);
    eventually(
        &context("labelled for another proxy"),
        CONVERGE,
        || match tcp_request(client, VIP, Duration::from_millis(500)) {
            Outcome::Reply(r) => Err(format!("still answered by {}", r.backend)),
            _ => Ok(()),
        },
    );

    server.apply(service("test", "web", CLUSTER_IP));
    eventually(&context("label removed"), CONVERGE, || {
        served_by(client, 60, &["backend-a", "backend-b", "backend-c"])
    });

    // An API outage: the datapath keeps serving what it had; changes made meanwhile
    // (and forgotten by the server's history) arrive after it, without a flush.
    server.set_down(true);
    server.apply(web_slice(&node_name, &["backend-b"]));
    server.compact();
    eventually(&context("the agent notices the outage"), RECOVERY, || {
        if agent.log().contains("API error") {
            Ok(())
        } else {
            Err("no API error logged yet".into())
        }
    });
    served_by(client, 30, &["backend-a", "backend-b", "backend-c"])
        .unwrap_or_else(|e| panic!("{}: {e}", context("during the outage")));
    server.set_down(false);
    let took = eventually(&context("after the outage"), RECOVERY, || {
        served_by(client, 20, &["backend-b"])
    });
    eprintln!("the change made during the outage applied {took:?} after it ended");

    server.delete(Resource::EndpointSlices, "test", "web-1");
    eventually(&context("no endpoints"), CONVERGE, || {
        match tcp_request(client, VIP, TIMEOUT) {
            Outcome::Refused => Ok(()),
            other => Err(format!("not rejected: {other}")),
        }
    });

    server.delete(Resource::Services, "test", "web");
    eventually(&context("deleted"), CONVERGE, || {
        match tcp_request(client, VIP, Duration::from_millis(500)) {
            Outcome::Reply(_) | Outcome::Refused => {
                Err("the ClusterIP is still handled by the datapath".into())
            }
            _ => Ok(()),
        }
    });

    assert_eq!(agent.healthz(), "HTTP 200", "the agent stayed healthy");
    drop(agent);
    drop(server);
    drop(runtime);
}
