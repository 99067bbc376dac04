//! The agent started as each distribution starts kube-proxy: the binary
//! called through a symlink named `kube-proxy`, with no subcommand, on the
//! command line of kubeadm's DaemonSet (`--config` with kubeadm's default
//! KubeProxyConfiguration), of kOps' (its flags, klog's and go-runner's
//! among them) and of k3s' embedded kube-proxy. Each must become healthy
//! after a first sync that programmed the loopback API server's Service,
//! name the flags it ignores in exactly one warning line, and show the
//! settings the line gives where they are observable: the node name in the
//! API requests and the log, the conntrack size in `ebpf-proxy status`, the
//! conntrack timeouts and cluster CIDRs in the pinned maps.
//!
//! Besides each distribution's own arguments, the tests add only what this
//! environment needs, each saying so: `--bpf-root` (a bpffs root of the
//! test's own, removed afterwards), a kubeconfig file naming the loopback
//! API server, and a temporary `--log-file`. /healthz is where kube-proxy
//! serves it: port 10256 of the node namespace, which is the test's own.
//!
//! Needs root (namespaces, BPF) and the release binary (`cargo xtask build`).

use ebpf_proxy_apiserver as apiserver;

use std::{collections::BTreeSet, fs, path::PathBuf, time::Duration};

use apiserver::{ApiServer, Resource, node, service, slice};
use ebpf_proxy_tests::{
    agent::{self, Agent},
    eventually,
    netns::{NetNs, unique_stem},
    require_root,
};
use proxy_common::{CtTimeouts, ct_timeout};
use proxy_userspace::{
    datapath::{Maps, PinLayout},
    model::Cidr,
    planner::node::DesiredNode,
};

const CLUSTER_IP: &str = "10.96.0.10";
const ENDPOINT: &str = "10.200.0.11";
const CONVERGE: Duration = Duration::from_secs(10);
/// The message of the one warning that names the ignored flags.
const IGNORED_WARNING: &str = "kube-proxy flags without a meaning here, ignored";

const HOUR: Duration = Duration::from_hours(1);
const SECOND: Duration = Duration::from_secs(1);

/// kubeadm's default KubeProxyConfiguration (`kubeadm config print
/// init-defaults --component-configs KubeProxyConfiguration`).
const KUBEADM_CONFIG: &str =
    include_str!("../../proxy-userspace/src/config/testdata/kubeadm-init-defaults.yaml");
/// Where kubeadm's DaemonSet mounts the kubeconfig its config names.
const KUBEADM_KUBECONFIG: &str = "/var/lib/kube-proxy/kubeconfig.conf";

/// A directory of files for one test (the `kube-proxy` symlink, the
/// configuration, the kubeconfig), removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let dir = std::env::temp_dir().join(format!("{}-kube-proxy-argv", unique_stem()));
        fs::create_dir_all(&dir).expect("temporary directory");
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// What one distribution's command line should come to.
struct Expected {
    /// The kube-proxy flags the warning names, in any order.
    ignored: &'static [&'static str],
    /// Connections conntrack is sized for.
    conntrack_connections: u64,
    /// TCP established, TCP closing, UDP.
    timeouts: [Duration; 3],
    cluster_cidrs: &'static [&'static str],
}

/// A node namespace with the loopback API server in it, serving this node's
/// Node, one Service and its EndpointSlice; a `kube-proxy` symlink to the
/// agent binary and a kubeconfig naming the server.
struct Node {
    // Dropped in this order: the directory, the API server, the namespace.
    dir: TempDir,
    server: ApiServer,
    _runtime: tokio::runtime::Runtime,
    ns: NetNs,
    kube_proxy: PathBuf,
    kubeconfig: PathBuf,
}

impl Node {
    fn new(distribution: &str) -> Node {
        let ns = NetNs::create(&format!("{}-{distribution}", unique_stem()))
            .expect("creating the node namespace");
        ns.ip(&["link", "set", "lo", "up"]).expect("lo up");
        let (runtime, server) = apiserver::serve_in(&ns);
        server.apply(node(ns.name(), None));
        server.apply(service("default", "web", CLUSTER_IP));
        server.apply(slice("default", "web-1", "web", ns.name(), &[ENDPOINT]));

        let dir = TempDir::new();
        let kube_proxy = dir.path("kube-proxy");
        std::os::unix::fs::symlink(agent::binary().expect("the agent binary"), &kube_proxy)
            .expect("the kube-proxy symlink");
        let kubeconfig = dir.path("kubeconfig.conf");
        fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    server: {}\n  name: default\n\
                 contexts:\n- context:\n    cluster: default\n    namespace: default\n    user: default\n  name: default\n\
                 current-context: default\nusers:\n- name: default\n  user: {{}}\n",
                server.url()
            ),
        )
        .expect("write the kubeconfig");
        Node {
            dir,
            server,
            _runtime: runtime,
            ns,
            kube_proxy,
            kubeconfig,
        }
    }

    fn name(&self) -> &str {
        self.ns.name()
    }

    /// Starts `kube-proxy args` and checks everything `expected` says.
    fn check(&self, args: &[String], expected: &Expected) {
        let bpf_root = Agent::unique_bpf_root();
        let mut argv = args.to_vec();
        // Not kube-proxy's: the agent's pins go below a bpffs root of this
        // test's own, so that tests run side by side (removed on drop).
        argv.push(format!("--bpf-root={}", bpf_root.display()));
        let agent = Agent::start_exact(&self.ns, &self.kube_proxy, &argv, bpf_root)
            .unwrap_or_else(|e| panic!("kube-proxy {}: not healthy: {e:#}", argv.join(" ")));
        let mut failures = Vec::new();

        // Healthy after the first sync; the Service is in the maps.
        eventually("the Service's ClusterIP in the status", CONVERGE, || {
            let status = agent.status().map_err(|e| format!("{e:#}"))?;
            if status.contains(&format!("{CLUSTER_IP}:80/TCP"))
                && status.contains(&format!("{ENDPOINT}:8080"))
            {
                Ok(())
            } else {
                Err(format!(
                    "no {CLUSTER_IP}:80 -> {ENDPOINT}:8080 in the status:\n{status}"
                ))
            }
        });
        let status = agent.status().expect("status");
        let log = agent.log();

        failures.extend(ignored_warning_failure(&log, expected.ignored));

        // --hostname-override: the Node followed is this one, by name.
        let node_requests: Vec<String> = self
            .server
            .requests()
            .into_iter()
            .filter(|r| r.resource == Some(Resource::Nodes))
            .map(|r| r.query)
            .collect();
        if node_requests.is_empty()
            || !node_requests.iter().all(|q| {
                q.contains(&format!("metadata.name%3D{}", self.name()))
                    || q.contains(&format!("metadata.name={}", self.name()))
            })
        {
            failures.push(format!(
                "the Node requests do not all select metadata.name={}: {node_requests:?}",
                self.name()
            ));
        }
        if !log.contains(&format!("node={}", self.name())) {
            failures.push(format!("node={} not in the log", self.name()));
        }

        // Conntrack size, as the status shows it.
        let connections = status
            .lines()
            .find(|l| l.starts_with("conntrack entries:"))
            .and_then(|l| {
                l.rsplit_once('(')?
                    .1
                    .strip_suffix(" connections)")?
                    .parse::<u64>()
                    .ok()
            });
        if connections != Some(expected.conntrack_connections) {
            failures.push(format!(
                "conntrack sized for {connections:?} connections, want {} (status:\n{status})",
                expected.conntrack_connections
            ));
        }

        failures.extend(pinned_failures(agent.bpf_root(), expected));

        assert!(
            failures.is_empty(),
            "kube-proxy {}:\n- {}\n----- agent output -----\n{log}",
            argv.join(" "),
            failures.join("\n- ")
        );
        drop(agent);
    }
}

/// Why the warning naming the ignored flags is not exactly one line naming
/// `ignored` (none when `ignored` is empty), if it is not.
fn ignored_warning_failure(log: &str, ignored: &[&str]) -> Option<String> {
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains(IGNORED_WARNING))
        .collect();
    let want: BTreeSet<&str> = ignored.iter().copied().collect();
    match warnings.as_slice() {
        [] if want.is_empty() => {}
        [line] => {
            let named = ignored_named(line);
            let named: BTreeSet<&str> = named.iter().map(String::as_str).collect();
            if named != want {
                return Some(format!(
                    "the warning names {named:?}, want {want:?}: {line}"
                ));
            }
        }
        lines => {
            return Some(format!(
                "{} warning lines {IGNORED_WARNING:?}, want {}: {lines:#?}",
                lines.len(),
                usize::from(!want.is_empty())
            ));
        }
    }
    None
}

/// What differs in the pinned maps below `bpf_root` from `expected`'s
/// conntrack timeouts and cluster CIDRs.
fn pinned_failures(bpf_root: &std::path::Path, expected: &Expected) -> Vec<String> {
    let mut failures = Vec::new();
    let pins = PinLayout::new(bpf_root);
    let maps = Maps::open_pinned(&pins).expect("the pinned maps");
    let timeouts = maps.ct_timeouts().expect("CT_TIMEOUTS");
    let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap();
    let want_timeouts = CtTimeouts {
        tcp_syn_ns: ct_timeout::TCP_SYN_NS,
        tcp_established_ns: ns(expected.timeouts[0]),
        tcp_close_wait_ns: ns(expected.timeouts[1]),
        tcp_time_wait_ns: ct_timeout::TCP_TIME_WAIT_NS,
        tcp_close_ns: ct_timeout::TCP_CLOSE_NS,
        udp_ns: ns(expected.timeouts[2]),
    };
    if timeouts != want_timeouts {
        failures.push(format!(
            "CT_TIMEOUTS holds {timeouts:?}, want {want_timeouts:?}"
        ));
    }
    let cidrs: Vec<Cidr> = expected
        .cluster_cidrs
        .iter()
        .map(|c| Cidr::parse(c).expect("a CIDR"))
        .collect();
    let want_cidrs = DesiredNode::new(want_timeouts, &cidrs).cluster_cidrs;
    let held = maps.read_node_state().expect("node maps").cluster_cidrs;
    if held != want_cidrs {
        failures.push(format!(
            "CLUSTER_CIDRS holds {} entries, want those of {:?}",
            held.len(),
            expected.cluster_cidrs
        ));
    }
    drop(maps);
    failures
}

/// The flag names in the ignored-flags warning: `flags=--a=1, --b=2`.
fn ignored_named(line: &str) -> Vec<String> {
    let Some((_, flags)) = line.split_once("flags=") else {
        return Vec::new();
    };
    flags
        .split(", ")
        .filter_map(|flag| {
            let flag = flag.trim().trim_matches('"').strip_prefix("--")?;
            Some(
                flag.split_once('=')
                    .map_or(flag, |(name, _)| name)
                    .to_owned(),
            )
        })
        .collect()
}

/// kube-proxy's conntrack sizing: `max(per_core x CPUs, min)` connections.
fn sized(per_core: u64, min: u64) -> u64 {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    (per_core * cpus).max(min)
}

#[test]
fn kubeadm_daemonset_command_line() {
    require_root().expect("privileged test");
    let node = Node::new("kubeadm");
    // kubeadm's default configuration, its kubeconfig (the DaemonSet's
    // mount) moved to where this test wrote one.
    assert!(KUBEADM_CONFIG.contains(KUBEADM_KUBECONFIG));
    let config = node.dir.path("config.conf");
    fs::write(
        &config,
        KUBEADM_CONFIG.replace(KUBEADM_KUBECONFIG, &node.kubeconfig.display().to_string()),
    )
    .expect("write config.conf");
    // kubeadm's DaemonSet: `/usr/local/bin/kube-proxy
    // --config=/var/lib/kube-proxy/config.conf --hostname-override=$(NODE_NAME)`.
    node.check(
        &[
            format!("--config={}", config.display()),
            format!("--hostname-override={}", node.name()),
        ],
        &Expected {
            ignored: &[],
            // conntrack.maxPerCore and min null: kube-proxy's 32768 and 131072.
            conntrack_connections: sized(32_768, 131_072),
            timeouts: [24 * HOUR, HOUR, 60 * SECOND],
            cluster_cidrs: &[],
        },
    );
}

#[test]
fn kops_daemonset_command_line() {
    require_root().expect("privileged test");
    let node = Node::new("kops");
    // Not kOps': klog's log file, which kOps puts in /var/log (ignored).
    let log_file = node.dir.path("kube-proxy.log");
    // kOps' kube-proxy manifest (nodeup's), `--master` being its API
    // server's internal name there and this test's API server here.
    node.check(
        &[
            "--cluster-cidr=100.96.0.0/11".to_owned(),
            "--conntrack-max-per-core=131072".to_owned(),
            format!("--hostname-override={}", node.name()),
            format!("--kubeconfig={}", node.kubeconfig.display()),
            format!("--master={}", node.server.url()),
            "--oom-score-adj=-998".to_owned(),
            "--v=2".to_owned(),
            "--logtostderr=false".to_owned(),
            "--alsologtostderr".to_owned(),
            format!("--log-file={}", log_file.display()),
        ],
        &Expected {
            ignored: &[
                "oom-score-adj",
                "v",
                "logtostderr",
                "alsologtostderr",
                "log-file",
            ],
            conntrack_connections: sized(131_072, 131_072),
            timeouts: [24 * HOUR, HOUR, 60 * SECOND],
            cluster_cidrs: &["100.96.0.0/11"],
        },
    );
}

#[test]
fn k3s_embedded_command_line() {
    require_root().expect("privileged test");
    let node = Node::new("k3s");
    // k3s' agent (pkg/daemons/agent): its healthz address, 127.0.0.1, is
    // kube-proxy's port 10256 on it, where this test probes.
    node.check(
        &[
            "--proxy-mode=iptables".to_owned(),
            "--healthz-bind-address=127.0.0.1".to_owned(),
            "--conntrack-max-per-core=0".to_owned(),
            "--conntrack-tcp-timeout-established=0s".to_owned(),
            "--conntrack-tcp-timeout-close-wait=0s".to_owned(),
            "--cluster-cidr=10.42.0.0/16".to_owned(),
            format!("--hostname-override={}", node.name()),
            format!("--kubeconfig={}", node.kubeconfig.display()),
        ],
        &Expected {
            ignored: &[],
            // A per-core 0 leaves the size as it is: 131072 on a new root.
            conntrack_connections: 131_072,
            // 0s: the kernel's (nf_conntrack_tcp_timeout_established 5
            // days, ..._close_wait 60 s).
            timeouts: [120 * HOUR, 60 * SECOND, 60 * SECOND],
            cluster_cidrs: &["10.42.0.0/16"],
        },
    );
}
