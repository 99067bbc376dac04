//! End-to-end speed on real packets: a client pod opening short TCP connections and
//! making UDP request/responses to a ClusterIP, and the node itself doing the same (a
//! host-network pod or node agent: its connections never cross tc ingress; ebpf-proxy
//! translates them at `connect()` with its socket hooks, kube-proxy in its OUTPUT
//! chain); the client pod's request/response on established TCP connections, to the
//! ClusterIP and, for traffic to no Service, straight to a backend pod; with S
//! Services installed, through four datapaths side by side in one run:
//!
//! - `ebpf-proxy`: the agent binary on a manifest directory with the S Services;
//! - `kube-proxy iptables`: the same Services as kube-proxy's iptables mode writes them
//!   (tests/src/iptables.rs, `iptables-restore`), no agent;
//! - `kube-proxy nftables`: the same as its nftables mode writes them
//!   (tests/src/nftables.rs, `nft -f`), no agent;
//! - `no LB (pod IP)`: the client talking straight to the backend pods, nothing in
//!   between: the limit.
//!
//! Every Service is dual-stack (a ClusterIP of each family, an EndpointSlice of each),
//! and every exchange is measured over IPv4 and over IPv6 in the same rounds: through
//! `tc_ingress6` and the IPv6 socket hooks, and kube-proxy's rules for IPv6 (its
//! second proxier: `ip6tables-restore`, the `ip6 kube-proxy` table).
//!
//! Each mode gets its own routed topology (docs/architecture.md (test topologies): a client pod and three backend
//! pods on one node), so no mode's rules or conntrack state touch another's. All four
//! are built before measuring and measured in interleaved rounds (the order rotating
//! each round), so a drift in the machine's speed spreads over all modes instead of
//! landing on one.
//!
//! The workload is closed-loop: T client threads in the client pod, each doing one
//! exchange after the other for a fixed time. A TCP exchange is connect, one request,
//! one response, close; the latency is from the start of connect to the last byte of
//! the response. A UDP exchange uses a new socket (a new source port, so a new flow for
//! the load balancer, as a DNS stub resolver does) for one request and its response.
//! Request/response on established connections ("RR", as sockperf's ping-pong or
//! netperf's `TCP_RR`): each client thread opens one connection before its segment
//! starts and closes it after, and in between sends a short request and waits for the
//! answer, again and again; the latency is one such round trip. It comes in two kinds:
//! "established RR" to the ClusterIP (in the no-LB mode, to the pod IPs), the load
//! balancer's cost per packet of a flow it knows; and "pod to pod RR", to the backend
//! pods' IPs in every mode, no Service at all, so that against the no-LB mode it is the
//! cost of running the load balancer on a node for traffic that is none of its business
//! (the agent on against off; kube-proxy's rules loaded against none).
//! The measured Service (port 80/TCP and 53/UDP, three endpoints: the backend pods) sits
//! in the middle of the S: kube-proxy writes its KUBE-SERVICES rules in Go map order,
//! so a Service is on average half-way down the list. The other Services have three
//! endpoints each at addresses that exist nowhere; only their rules and map entries
//! matter.
//!
//! After the measured rounds, a few more with the kernel's BPF statistics on say what
//! one new TCP connection from the pod, and one pod-to-pod request/response, cost the
//! machine's CPUs in each mode, and how much of that was the agent's packet programs:
//! for traffic to no Service, a few hundred nanoseconds of programs against the
//! microseconds the stack takes, a figure the rate's noise would hide.
//!
//! Rates and percentiles are over all rounds. The ratios between modes are the median
//! of per-round ratios: two segments of one round run within a second or two of each
//! other, so their ratio is spared most of the drift and of the bursts of other work a
//! shared machine has; the quartiles of those ratios say how firm a ratio is.
//!
//! Everything is bounded: fixed durations, a cap on exchanges per thread, 1 s I/O
//! timeouts; traffic only ever goes to addresses inside the benchmark's namespaces.
//! Namespaces, servers and agents are removed on drop, also on an error or Ctrl-C.
//!
//! Usage: `cargo bench -p ebpf-proxy-tests --bench e2e -- [--quick] [--out DIR]
//! [--sizes 10,1000] [--rounds N] [--threads N] [--generic-xdp-on-pods] [--socket-lb-pods]
//! [--exchanges pod-tcp,pod-udp]` (root; the agent binary from `cargo xtask build` or
//! $`EBPF_PROXY_BIN`). Prints markdown tables and writes `e2e.md` and `e2e.json` to DIR
//! (default bench/results). `--exchanges` measures only the exchanges named (their
//! keys as in `e2e.json`; `pod-tcp` always), so that agents older than some of them
//! (IPv6 at tc, the node's socket hooks on a given cgroup) can be measured when
//! bisecting a change in the ratios.
//! `--generic-xdp-on-pods` puts the agent's XDP, in generic mode, on the pods'
//! host-side veths: a run with it beside one without is what generic XDP on pod
//! traffic costs end to end.
//! `--socket-lb-pods` runs the agent with that flag: the client pod's TCP connections
//! to the ClusterIP go to a backend at `connect()`, where by default tc translates
//! them; its UDP stays tc's.

mod common;
#[path = "common/program_time.rs"]
mod program_time;

use std::{
    io::{ErrorKind, Read, Write},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream},
    path::Path,
    sync::{Arc, Barrier, atomic::Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail};
use common::{
    Args, BenchMode, INTERRUPTED, Machine, Rows, check_interrupted, interleaved, load_average,
};
use ebpf_proxy_tests::{
    Protocol,
    agent::{self, Agent},
    cgroup::{Entered, TestCgroup},
    iptables::{self, KubeService, KubeService6},
    load::{IO_TIMEOUT, Load, MAX_PER_SEGMENT, Sample},
    manifest::{ManifestDir, Service},
    nftables, require_root,
    servers::{KEEP_OPEN, PooledBackend},
    topology::{NODE_IP, NODE_IP6, Topology, add_node_ip6},
};
use nix::{
    libc,
    sched::{CpuSet, sched_getaffinity, sched_setaffinity},
    sys::socket::{setsockopt, sockopt},
    unistd::Pid,
};
use program_time::HookTimes;
use serde_json::json;

use ebpf_proxy_tests::topology::{
    one_node::{
        self, BACKENDS, CLIENT, CLUSTER_IP6, TCP_PORT, TCP_SERVICE_PORT, UDP_PORT,
        UDP_SERVICE_PORT, backend_ips, backend_ips6,
    },
    pod_ip6,
};
/// Endpoints of every Service (the measured one's are the backend pods).
const ENDPOINTS: u32 = 3;
/// Exchanges per mode before measuring, one at a time: fills neighbour caches and
/// checks that the mode works and spreads over all three backends (a miss of one of
/// them in 60 tries has probability 3·(2/3)^60, about 1e-10). For request/response on
/// established connections, as many connections, one after the other.
const WARMUP: usize = 60;
/// Requests on each of the warm-up's connections: more than one, so that a backend
/// that answered only the first would fail it.
const WARMUP_REQUESTS: usize = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Ebpf,
    Iptables,
    Nftables,
    Direct,
}

impl Mode {
    const ALL: [Mode; 4] = [Mode::Direct, Mode::Iptables, Mode::Nftables, Mode::Ebpf];
}

impl BenchMode for Mode {
    const IPTABLES: Mode = Mode::Iptables;
    const DIRECT: Mode = Mode::Direct;

    fn label(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf-proxy",
            Mode::Iptables => "kube-proxy iptables",
            Mode::Nftables => "kube-proxy nftables",
            Mode::Direct => "no LB (pod IP)",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Iptables => "iptables",
            Mode::Nftables => "nftables",
            Mode::Direct => "direct",
        }
    }
}

/// Where the client runs: a pod, whose packets tc ingress translates, or the node
/// itself (a host-network pod, a node agent), whose connections the socket hooks
/// translate (kube-proxy: its OUTPUT chain).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Client {
    Pod,
    Node,
}

/// The IP family of an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ip {
    V4,
    V6,
}

impl Ip {
    fn key(self) -> &'static str {
        match self {
            Ip::V4 => "ipv4",
            Ip::V6 => "ipv6",
        }
    }
}

/// What one exchange is made of, and where it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A new connection (TCP) or socket (UDP) per exchange, to the ClusterIP: every
    /// exchange is a new flow for the load balancer.
    New,
    /// Request/response on a TCP connection opened before the segment, to the
    /// ClusterIP: the load balancer's cost on a flow it already knows.
    Established,
    /// The same to a backend pod's own IP, in every mode: traffic for no Service, so
    /// what a node pays for running the load balancer at all.
    PodToPod,
}

impl Kind {
    fn key(self) -> &'static str {
        match self {
            Kind::New => "new",
            Kind::Established => "established",
            Kind::PodToPod => "pod-to-pod",
        }
    }
}

/// One kind of exchange: who opens it, over what.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Exchange {
    client: Client,
    proto: Protocol,
    ip: Ip,
    kind: Kind,
}

impl Client {
    fn key(self) -> &'static str {
        match self {
            Client::Pod => "pod",
            Client::Node => "node",
        }
    }
}

impl Exchange {
    fn key(self) -> String {
        let what = match self.kind {
            Kind::New => self.proto.lower(),
            Kind::Established => "rr",
            Kind::PodToPod => "p2p-rr",
        };
        match self.ip {
            Ip::V4 => format!("{}-{what}", self.client.key()),
            Ip::V6 => format!("{}-{what}6", self.client.key()),
        }
    }

    /// What one of it is, for the tables of what it costs.
    fn unit(self) -> &'static str {
        match (self.kind, self.proto) {
            (Kind::New, Protocol::Tcp) => "connection",
            _ => "request/response",
        }
    }

    /// Its table's title, and the unit of its rate.
    fn title(self) -> (&'static str, &'static str) {
        use {
            Client::{Node, Pod},
            Ip::{V4, V6},
            Kind::{Established, New, PodToPod},
            Protocol::{Tcp, Udp},
        };
        match (self.kind, self.client, self.proto, self.ip) {
            (New, Pod, Tcp, V4) => ("Short TCP connections from a pod", "conn/s"),
            (New, Pod, Udp, V4) => ("UDP request/response from a pod", "req/s"),
            (New, Node, Tcp, V4) => (
                "Short TCP connections from the node itself (host network; ebpf-proxy: the \
                 connect() socket hook, kube-proxy: its OUTPUT chain)",
                "conn/s",
            ),
            (New, Node, Udp, V4) => (
                "UDP request/response from the node itself (a connected socket per request)",
                "req/s",
            ),
            (New, Pod, Tcp, V6) => (
                "IPv6: short TCP connections from a pod (ebpf-proxy: tc_ingress6; kube-proxy: \
                 ip6tables, nftables `ip6`)",
                "conn/s",
            ),
            (New, Pod, Udp, V6) => ("IPv6: UDP request/response from a pod", "req/s"),
            (New, Node, Tcp, V6) => (
                "IPv6: short TCP connections from the node itself (ebpf-proxy: the connect6() \
                 socket hook)",
                "conn/s",
            ),
            (New, Node, Udp, V6) => ("IPv6: UDP request/response from the node itself", "req/s"),
            (Established, _, _, V4) => (
                "Request/response on established TCP connections from a pod, through the \
                 ClusterIP (no LB: to the pod IPs)",
                "req/s",
            ),
            (PodToPod, _, _, V4) => (
                "Pod to pod request/response, no Service: every mode to the pod IPs \
                 (ebpf-proxy: the agent running; kube-proxy: its rules loaded; no LB: \
                 neither)",
                "req/s",
            ),
            (Established, _, _, V6) => (
                "IPv6: request/response on established TCP connections from a pod",
                "req/s",
            ),
            (PodToPod, _, _, V6) => ("IPv6: pod to pod request/response, no Service", "req/s"),
            (New, _, Protocol::Sctp, _) => unreachable!("no SCTP exchange is benched"),
        }
    }
}

/// Only results of the same kind of exchange are paired.
impl common::Detail for Exchange {
    fn same_cell(&self, other: &Exchange) -> bool {
        self == other
    }
}

const fn exchange(client: Client, proto: Protocol, ip: Ip) -> Exchange {
    Exchange {
        client,
        proto,
        ip,
        kind: Kind::New,
    }
}

/// Request/response on established TCP connections from the client pod.
const fn rr(kind: Kind, ip: Ip) -> Exchange {
    Exchange {
        client: Client::Pod,
        proto: Protocol::Tcp,
        ip,
        kind,
    }
}

/// The new-flow exchanges first, IPv4's before IPv6's, in the order they always had;
/// then those on established connections.
const EXCHANGES: [Exchange; 12] = [
    exchange(Client::Pod, Protocol::Tcp, Ip::V4),
    exchange(Client::Pod, Protocol::Udp, Ip::V4),
    exchange(Client::Node, Protocol::Tcp, Ip::V4),
    exchange(Client::Node, Protocol::Udp, Ip::V4),
    exchange(Client::Pod, Protocol::Tcp, Ip::V6),
    exchange(Client::Pod, Protocol::Udp, Ip::V6),
    exchange(Client::Node, Protocol::Tcp, Ip::V6),
    exchange(Client::Node, Protocol::Udp, Ip::V6),
    rr(Kind::Established, Ip::V4),
    rr(Kind::PodToPod, Ip::V4),
    rr(Kind::Established, Ip::V6),
    rr(Kind::PodToPod, Ip::V6),
];

#[derive(Debug, Clone)]
struct Config {
    quick: bool,
    sizes: Vec<u32>,
    rounds: usize,
    tcp_segment: Duration,
    udp_segment: Duration,
    /// Of request/response on established connections; the connections are opened
    /// before it starts.
    rr_segment: Duration,
    threads: usize,
    /// How ebpf-proxy's agent runs, where an experiment asks for other than
    /// its defaults.
    agent: AgentVariant,
    /// The exchanges measured: all of [`EXCHANGES`], or those `--exchanges` names
    /// (for agents older than some of them, when bisecting a change in the ratios).
    exchanges: Vec<Exchange>,
}

/// The agent's settings an experiment changes (`parse_args`).
#[derive(Debug, Clone, Copy, Default)]
struct AgentVariant {
    /// `--generic-xdp-on-pods`: the agent runs generic XDP on the pods'
    /// host-side veths (as it did by default where they carry a global
    /// address, before `--xdp-mode auto` kept XDP to native uplinks), so that
    /// a run beside one without says what generic XDP on pod traffic costs.
    generic_xdp_on_pods: bool,
    /// `--socket-lb-pods`: the agent sends the pods' TCP connections to
    /// ClusterIPs to a backend at `connect()`.
    socket_lb_pods: bool,
    /// `--host-routing-bpf`: the agent runs with `--host-routing bpf`, its
    /// translated packets sent from tc straight into the pods.
    host_routing_bpf: bool,
}

impl Config {
    fn new(quick: bool) -> Config {
        let threads = common::default_threads();
        // Many short rounds rather than a few long ones: on a shared machine the noise
        // comes in bursts of seconds, and interleaving the modes finely spreads each
        // burst over all of them.
        if quick {
            // About 80 s in all (both families, established connections too), so
            // `cargo xtask bench --quick` stays near three minutes.
            Config {
                quick,
                sizes: vec![10, 1_000],
                rounds: 8,
                tcp_segment: Duration::from_millis(150),
                udp_segment: Duration::from_millis(75),
                rr_segment: Duration::from_millis(100),
                threads,
                agent: AgentVariant::default(),
                exchanges: EXCHANGES.to_vec(),
            }
        } else {
            Config {
                quick,
                sizes: vec![10, 1_000, 10_000],
                rounds: 16,
                tcp_segment: Duration::from_millis(300),
                udp_segment: Duration::from_millis(150),
                rr_segment: Duration::from_millis(200),
                threads,
                agent: AgentVariant::default(),
                exchanges: EXCHANGES.to_vec(),
            }
        }
    }

    fn segment(&self, exchange: Exchange) -> Duration {
        match (exchange.kind, exchange.proto) {
            (Kind::New, Protocol::Tcp) => self.tcp_segment,
            (Kind::New, Protocol::Udp) => self.udp_segment,
            (Kind::New, Protocol::Sctp) => unreachable!("no SCTP exchange is benched"),
            (Kind::Established | Kind::PodToPod, _) => self.rr_segment,
        }
    }
}

fn main() {
    common::main_with("e2e", |args| {
        let (cfg, out_dir) = parse_args(args)?;
        run(&cfg, &out_dir)
    });
}

/// `--quick`, `--out DIR`, and for experiments `--sizes 10,1000`, `--rounds N`,
/// `--threads N`, `--generic-xdp-on-pods`, `--socket-lb-pods`, `--host-routing-bpf`,
/// `--exchanges KEY,KEY`. Anything else
/// (cargo passes `--bench`) is ignored.
fn parse_args(args: &Args) -> Result<(Config, std::path::PathBuf)> {
    let mut cfg = Config::new(args.flag("--quick"));
    args.overrides(&mut cfg.sizes, &mut cfg.rounds, &mut cfg.threads)?;
    cfg.agent.generic_xdp_on_pods = args.flag("--generic-xdp-on-pods");
    cfg.agent.socket_lb_pods = args.flag("--socket-lb-pods");
    cfg.agent.host_routing_bpf = args.flag("--host-routing-bpf");
    if let Some(keys) = args.value("--exchanges")? {
        let keys: Vec<&str> = keys.split(',').map(str::trim).collect();
        if let Some(unknown) = keys
            .iter()
            .find(|k| !EXCHANGES.iter().any(|x| x.key() == **k))
        {
            let known: Vec<String> = EXCHANGES.iter().map(|x| x.key()).collect();
            bail!(
                "--exchanges: no exchange {unknown:?} (known: {})",
                known.join(", ")
            );
        }
        cfg.exchanges.retain(|x| keys.contains(&x.key().as_str()));
    }
    if !cfg.exchanges.contains(&COSTED) {
        bail!(
            "--exchanges must include {}, whose cost is measured",
            COSTED.key()
        );
    }
    Ok((cfg, args.out_dir()?))
}

fn run(cfg: &Config, out_dir: &Path) -> Result<()> {
    require_root()?;
    // Before minutes of setup for the other modes, not after.
    let bin = agent::binary()?;
    eprintln!("agent binary: {}", bin.display());
    common::install_signal_handlers()?;
    let machine = Machine::probe();
    let load_before = load_average();
    eprintln!(
        "e2e: {} threads, sizes {:?}, {} rounds of {:?} TCP + {:?} UDP + {:?} \
         request/response on established connections per mode",
        cfg.threads, cfg.sizes, cfg.rounds, cfg.tcp_segment, cfg.udp_segment, cfg.rr_segment
    );
    let mut results = Vec::new();
    let mut costs = Vec::new();
    for &services in &cfg.sizes {
        let (stats, cost) =
            measure_size(cfg, services).with_context(|| format!("S = {services}"))?;
        results.extend(stats);
        costs.extend(cost);
    }
    let report = Report {
        cfg,
        machine: &machine,
        results: &results,
        costs: &costs,
        load: (load_before, load_average()),
    };
    common::write_results(out_dir, "e2e", &report.markdown(), &report.json())
}

// ---------------------------------------------------------------------------
// The Services

fn vip(i: u32) -> Ipv4Addr {
    one_node::cluster_ip(i)
}

/// The `i`th IPv6 ClusterIP from [`CLUSTER_IP6`] up.
fn vip6(i: u32) -> Ipv6Addr {
    Ipv6Addr::from(u128::from(CLUSTER_IP6) + u128::from(i))
}

/// Endpoints of the Services nobody talks to.
fn filler_endpoint(service: u32, k: u32) -> Ipv4Addr {
    one_node::filler_endpoint(service, ENDPOINTS, k)
}

/// The same of IPv6: [`pod_ip6`] of the IPv4 one, so addresses that exist nowhere.
fn filler_endpoint6(service: u32, k: u32) -> Ipv6Addr {
    pod_ip6(filler_endpoint(service, k))
}

/// S dual-stack Services, each with its endpoints of both families; the one at index
/// S/2 is the measured one.
struct ServiceSet {
    services: Vec<(Service, Vec<Ipv4Addr>, Vec<Ipv6Addr>)>,
    measured: usize,
}

impl ServiceSet {
    fn new(count: u32) -> ServiceSet {
        let measured = count / 2;
        let services = (0..count)
            .map(|i| {
                let name = format!("svc-{i}");
                let svc = Service::new("bench", &name, vip(i))
                    .dual_stack(vip6(i))
                    .port("http", TCP_SERVICE_PORT, Protocol::Tcp, TCP_PORT);
                if i == measured {
                    let svc = svc.port("dns", UDP_SERVICE_PORT, Protocol::Udp, UDP_PORT);
                    (svc, backend_ips(), backend_ips6())
                } else {
                    (
                        svc,
                        (0..ENDPOINTS).map(|k| filler_endpoint(i, k)).collect(),
                        (0..ENDPOINTS).map(|k| filler_endpoint6(i, k)).collect(),
                    )
                }
            })
            .collect();
        ServiceSet {
            services,
            measured: measured as usize,
        }
    }

    /// The measured Service's ClusterIP of `ip`.
    fn vip(&self, ip: Ip) -> std::net::IpAddr {
        let svc = &self.services[self.measured].0;
        match ip {
            Ip::V4 => svc.cluster_ip.into(),
            Ip::V6 => svc.cluster_ip6.expect("dual-stack").into(),
        }
    }

    /// One multi-document file with every Service and its EndpointSlices.
    fn yaml(&self) -> String {
        let mut out = String::new();
        for (svc, eps, eps6) in &self.services {
            out.push_str(&svc.service_yaml());
            out.push_str("---\n");
            out.push_str(&svc.endpoint_slice_yaml(eps));
            out.push_str("---\n");
            out.push_str(&svc.endpoint_slice6_yaml(eps6));
            out.push_str("---\n");
        }
        out
    }

    /// Every IPv4 service port as kube-proxy sees it, in Service order.
    fn kube(&self) -> Vec<KubeService> {
        let mut out = Vec::new();
        for (svc, eps, _) in &self.services {
            for port in &svc.ports {
                out.push(svc.kube_service(&port.name, svc.cluster_ip, eps));
            }
        }
        out
    }

    /// The same for kube-proxy's IPv6 proxier.
    fn kube6(&self) -> Vec<KubeService6> {
        let mut out = Vec::new();
        for (svc, _, eps6) in &self.services {
            let vip6 = svc.cluster_ip6.expect("dual-stack");
            for port in &svc.ports {
                out.push(svc.kube_service6(&port.name, vip6, eps6));
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------
// One mode's world

/// A topology with its backends and whatever load balancer the mode has. Fields drop
/// in declaration order: the agent while its namespace exists, then the servers, the
/// manifests and the namespaces.
struct World {
    mode: Mode,
    agent: Option<Agent>,
    _backends: Vec<PooledBackend>,
    manifests: Option<ManifestDir>,
    /// Where the agent's socket hooks attach, which this process enters for
    /// the world's segments alone (`World::enter`).
    cgroup: Option<TestCgroup>,
    topology: Topology,
    /// Time to program the Services: agent start to healthy, `iptables-restore` or
    /// `nft -f`.
    programming: Option<Duration>,
    /// What each (family, protocol) of exchange goes to.
    targets: Vec<((Ip, Protocol), Vec<SocketAddr>)>,
    /// The backend pods' TCP servers of each family, in [`BACKENDS`] order.
    pods: Vec<(Ip, Vec<SocketAddr>)>,
    /// What the backends answer, in [`BACKENDS`] order.
    backend_names: Vec<String>,
}

impl World {
    fn build(mode: Mode, set: &ServiceSet, cfg: &Config) -> Result<World> {
        let threads = cfg.threads;
        let mut pods = vec![CLIENT];
        pods.extend_from_slice(&BACKENDS);
        let topology = Topology::routed(&pods).context("build the routed topology")?;
        let mut backends = Vec::new();
        for (name, _) in BACKENDS {
            backends.push(PooledBackend::start(
                &topology.pod(name).ns,
                name,
                TCP_PORT,
                Some(UDP_PORT),
                threads,
            )?);
        }
        let mut world = World {
            mode,
            agent: None,
            _backends: backends,
            manifests: None,
            cgroup: None,
            topology,
            programming: None,
            targets: Vec::new(),
            pods: Vec::new(),
            backend_names: BACKENDS.iter().map(|b| b.0.to_owned()).collect(),
        };
        let node = &world.topology.node;
        // A real node's default route covers the service CIDR, so that its own
        // connections to a ClusterIP get as far as the OUTPUT hook that DNATs them
        // (the socket hook translates before any route is looked up).
        node.ip(&["route", "add", "10.96.0.0/12", "dev", "lo"])
            .context("a route for the service CIDR")?;
        // The same for IPv6, whose routes through the loopback are reject routes:
        // through a veth pair of the node's own, which leads nowhere (the OUTPUT
        // hook's DNAT routes the packet again, to the pod).
        node.ip(&[
            "link", "add", "svc0", "type", "veth", "peer", "name", "svc1",
        ])
        .context("a veth pair for the IPv6 service CIDR")?;
        for end in ["svc0", "svc1"] {
            node.ip(&["link", "set", end, "up"])?;
        }
        node.ip(&["-6", "route", "add", "fd00:96::/64", "dev", "svc0"])
            .context("a route for the IPv6 service CIDR")?;
        add_node_ip6(node).context("the node's IPv6 address")?;
        let started = Instant::now();
        match mode {
            Mode::Direct => {}
            Mode::Ebpf => world.start_agent(set, cfg)?,
            Mode::Iptables => {
                iptables::apply(node, &set.kube())
                    .context("load kube-proxy's iptables rules (iptables-restore)")?;
                iptables::apply(node, &set.kube6())
                    .context("load kube-proxy's ip6tables rules (ip6tables-restore)")?;
            }
            Mode::Nftables => {
                nftables::apply(node, &set.kube(), &[NODE_IP])
                    .context("load kube-proxy's nftables rules (nft -f)")?;
                nftables::apply(node, &set.kube6(), &[NODE_IP6])
                    .context("load kube-proxy's nftables rules for IPv6 (nft -f)")?;
            }
        }
        if mode != Mode::Direct {
            world.programming = Some(started.elapsed());
        }
        let pods = |ip, port| -> Vec<SocketAddr> {
            BACKENDS
                .iter()
                .map(|b| match ip {
                    Ip::V4 => SocketAddr::from((b.1, port)),
                    Ip::V6 => SocketAddr::from((pod_ip6(b.1), port)),
                })
                .collect()
        };
        for ip in [Ip::V4, Ip::V6] {
            for (proto, service_port, port) in [
                (Protocol::Tcp, TCP_SERVICE_PORT, TCP_PORT),
                (Protocol::Udp, UDP_SERVICE_PORT, UDP_PORT),
            ] {
                let targets = match mode {
                    Mode::Direct => pods(ip, port),
                    _ => vec![SocketAddr::new(set.vip(ip), service_port)],
                };
                world.targets.push(((ip, proto), targets));
            }
            world.pods.push((ip, pods(ip, TCP_PORT)));
        }
        Ok(world)
    }

    /// The agent on the world's node, on a manifest directory of `set`, its socket
    /// hooks on a cgroup of the world's own.
    fn start_agent(&mut self, set: &ServiceSet, cfg: &Config) -> Result<()> {
        let manifests = ManifestDir::create(self.topology.stem())?;
        manifests.write("services.yaml", &set.yaml())?;
        // The client threads are this process's, which enters this cgroup
        // for the world's segments (`World::enter`): there its pods' sockets
        // run the hooks too, as a pod's do below the root the agent hooks
        // by default, and are left to tc (their TCP connections to the
        // ClusterIP not, with `--socket-lb-pods`). The other modes' sockets
        // never run them: with `--socket-lb-pods` the hooks would send
        // their connections to the ClusterIP (the same addresses in every
        // world) to a backend.
        let hooked = TestCgroup::create(self.topology.stem())?;
        let cgroup = hooked.path().display().to_string();
        self.cgroup = Some(hooked);
        let pod_ifs = self.topology.pods().iter().map(|p| p.host_if.as_str());
        let pod_ifs = pod_ifs.collect::<Vec<_>>().join(",");
        let mut args = vec!["--cgroup-root", &cgroup];
        if cfg.agent.generic_xdp_on_pods {
            args.extend(["--xdp-mode", "generic", "--xdp-interfaces", &pod_ifs]);
        }
        if cfg.agent.socket_lb_pods {
            args.push("--socket-lb-pods");
        }
        if cfg.agent.host_routing_bpf {
            args.extend(["--host-routing", "bpf"]);
        }
        let agent = Agent::start_with(&self.topology.node, manifests.path(), &args)
            .context("start the ebpf-proxy agent")?;
        self.agent = Some(agent);
        self.manifests = Some(manifests);
        Ok(())
    }

    /// What the client sends where for `exchange`.
    fn load(&self, exchange: Exchange) -> Load<'_, SocketAddr> {
        let proto = exchange.proto;
        Load {
            ns: match exchange.client {
                Client::Pod => &self.topology.pod(CLIENT.0).ns,
                Client::Node => &self.topology.node,
            },
            proto,
            targets: match exchange.kind {
                Kind::New | Kind::Established => self
                    .targets
                    .iter()
                    .find(|(kind, _)| *kind == (exchange.ip, proto))
                    .map(|(_, t)| t.as_slice()),
                Kind::PodToPod => self
                    .pods
                    .iter()
                    .find(|(ip, _)| *ip == exchange.ip)
                    .map(|(_, t)| t.as_slice()),
            }
            .expect("every family and protocol has targets"),
            backends: &self.backend_names,
        }
    }

    /// `threads` clients for `segment`: a new flow per exchange, or request/response on
    /// connections each thread opens before the segment starts.
    fn closed_loop(&self, exchange: Exchange, threads: usize, segment: Duration) -> Result<Sample> {
        let _inside = self.enter()?;
        let load = self.load(exchange);
        match exchange.kind {
            Kind::New => load.closed_loop(threads, segment),
            Kind::Established | Kind::PodToPod => rr_closed_loop(&load, threads, segment),
        }
    }

    /// This process inside the world's cgroup, if it has one, until the guard drops.
    fn enter(&self) -> Result<Option<Entered>> {
        self.cgroup.as_ref().map(TestCgroup::enter).transpose()
    }

    /// One exchange at a time (for established connections, one connection at a time
    /// with a few requests on each): the mode must answer every one and reach all three
    /// backends.
    fn warm_up(&self, exchange: Exchange) -> Result<()> {
        let _inside = self.enter()?;
        let load = self.load(exchange);
        let (sample, expected) = match exchange.kind {
            Kind::New => (load.sequential(WARMUP)?, WARMUP),
            Kind::Established | Kind::PodToPod => (
                rr_sequential(&load, WARMUP, WARMUP_REQUESTS)?,
                WARMUP * WARMUP_REQUESTS,
            ),
        };
        if sample.ok as usize != expected || sample.backends.contains(&0) {
            bail!(
                "{} {}: warm-up of {expected} exchanges got {} answers (per backend {:?}), \
                 failures {:?}{}",
                self.mode.label(),
                exchange.key(),
                sample.ok,
                sample.backends,
                sample.errors,
                self.agent
                    .as_ref()
                    .map(common::log_tail)
                    .unwrap_or_default()
            );
        }
        Ok(())
    }

    /// What the agent's programs have run so far (`program_time::agent_programs`);
    /// None for the modes without an agent.
    fn agent_programs(&self) -> Result<Option<HookTimes>> {
        self.agent
            .as_ref()
            .map(|a| program_time::agent_programs(a.bpf_root()))
            .transpose()
    }
}

// ---------------------------------------------------------------------------
// Measuring

/// Everything measured for one mode, protocol and S, over all rounds.
type Stats = common::Stats<Mode, Exchange>;

fn measure_size(cfg: &Config, services: u32) -> Result<(Vec<Stats>, Vec<ExchangeCost>)> {
    let set = ServiceSet::new(services);
    let mut worlds = Vec::new();
    for mode in Mode::ALL {
        check_interrupted()?;
        let world =
            World::build(mode, &set, cfg).with_context(|| format!("set up {}", mode.label()))?;
        match world.programming {
            Some(d) => eprintln!(
                "S = {services}: {} ready, Services programmed in {d:.2?}",
                mode.label()
            ),
            None => eprintln!("S = {services}: {} ready", mode.label()),
        }
        worlds.push(world);
    }
    for world in &worlds {
        for &exchange in &cfg.exchanges {
            world
                .warm_up(exchange)
                .with_context(|| format!("warm up {}", world.mode.label()))?;
        }
    }
    let series = interleaved(cfg.rounds, worlds.len(), cfg.exchanges.len(), |w, x| {
        let (world, exchange) = (&worlds[w], cfg.exchanges[x]);
        world
            .closed_loop(exchange, cfg.threads, cfg.segment(exchange))
            .with_context(|| format!("measure {} {}", world.mode.label(), exchange.key()))
    })?;
    let mut out = Vec::new();
    for (world, kinds) in worlds.iter().zip(series) {
        for (&exchange, series) in cfg.exchanges.iter().zip(kinds) {
            if series.failed > 0 {
                eprintln!(
                    "warning: S = {services}, {} {}: {} of {} exchanges failed: {:?}",
                    world.mode.label(),
                    exchange.key(),
                    series.failed,
                    series.failed + series.ok,
                    series.errors
                );
            }
            out.push(Stats {
                services,
                mode: world.mode,
                programming: world.programming,
                series,
                detail: exchange,
            });
        }
    }
    let costs = exchange_costs(cfg, services, &worlds)?;
    eprintln!("S = {services}: measured");
    // The worlds drop here, agent and namespaces with them, before the next S is built.
    Ok((out, costs))
}

// ---------------------------------------------------------------------------
// What an exchange costs the machine

/// Rounds of the phase that measures each mode's CPU per exchange, after the
/// measured rounds (see [`exchange_costs`]).
const CPU_ROUNDS: usize = 4;

/// The exchange whose cost [`exchange_costs`] always measures: a new TCP connection
/// from the pod, over IPv4.
const COSTED: Exchange = EXCHANGES[0];

/// [`COSTED`] over IPv6, measured too where the run measures it: IPv6's new flows
/// at tc take a program of their own (`tc_new6`), whose time the kernel counts in
/// `tc_ingress`'s run, as every tail call's.
const COSTED6: Exchange = EXCHANGES[4];

/// The exchanges [`exchange_costs`] measures: [`COSTED`], [`COSTED6`] where the
/// run measures it, and the pod-to-pod request/response of each family the run
/// measures, which tell what the agent costs traffic that is not its own with less
/// noise than its rate does (a few hundred nanoseconds of programs against the
/// stack's microseconds).
fn costed(cfg: &Config) -> Vec<Exchange> {
    std::iter::once(COSTED)
        .chain(
            cfg.exchanges
                .iter()
                .copied()
                .filter(|x| *x == COSTED6 || x.kind == Kind::PodToPod),
        )
        .collect()
}

/// What the exchanges of one kind (a new connection, a request/response) cost the
/// machine in one mode.
#[derive(Debug, Clone, Copy)]
struct ExchangeCost {
    services: u32,
    mode: Mode,
    exchange: Exchange,
    /// Exchanges made, answered or not.
    count: u64,
    /// Every CPU's busy time over this mode's segments of the phase: the client, the
    /// servers, the node's stack, the load balancer.
    busy_ns: u64,
    /// The agent's packet programs over the same segments (ebpf-proxy only).
    programs: Option<HookTimes>,
}

impl ExchangeCost {
    fn per_exchange(&self, ns: u64) -> f64 {
        ns as f64 / self.count.max(1) as f64
    }
}

/// The machine's CPU time per exchange in each mode, and the ebpf-proxy agent's
/// packet programs' share of it: [`CPU_ROUNDS`] more rounds of each [`costed`]
/// exchange, the modes interleaved, with the kernel's BPF run-time statistics on
/// (`BPF_ENABLE_STATS`) for this phase only. The measured rounds run without them:
/// they add two clock reads to each program run, which the other modes would not
/// pay. The gap between a mode's CPU per exchange and the no-LB mode's is what that
/// mode costs; for ebpf-proxy, the programs' time says how much of the gap is the
/// datapath's own and how much is elsewhere (the hook, caches, the stack).
fn exchange_costs(cfg: &Config, services: u32, worlds: &[World]) -> Result<Vec<ExchangeCost>> {
    let exchanges = costed(cfg);
    let mut costs: Vec<ExchangeCost> = exchanges
        .iter()
        .flat_map(|&exchange| {
            worlds.iter().map(move |w| ExchangeCost {
                services,
                mode: w.mode,
                exchange,
                count: 0,
                busy_ns: 0,
                programs: w.agent.as_ref().map(|_| HookTimes::default()),
            })
        })
        .collect();
    // Statistics stay on while this descriptor is open, and go off when it is
    // dropped, also on an error.
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .context("turn on the kernel's BPF run-time statistics (BPF_ENABLE_STATS)")?;
    for _ in 0..CPU_ROUNDS {
        // `costs` holds each exchange's worlds in the order of `worlds`.
        for (world, cost) in worlds.iter().cycle().zip(&mut costs) {
            let exchange = cost.exchange;
            check_interrupted()?;
            let before = (world.agent_programs()?, machine_busy_ns()?);
            let sample = world
                .closed_loop(exchange, cfg.threads, cfg.segment(exchange))
                .with_context(|| format!("cost {} {}", world.mode.label(), exchange.key()))?;
            let after = (world.agent_programs()?, machine_busy_ns()?);
            cost.count += sample.ok + sample.failed();
            cost.busy_ns += after.1.saturating_sub(before.1);
            if let (Some(total), Some(before), Some(after)) =
                (&mut cost.programs, before.0, after.0)
            {
                total.add(after.since(before));
            }
        }
    }
    for cost in &costs {
        let unit = cost.exchange.unit();
        if cost.count == 0 {
            bail!(
                "{}, {}: no {unit} in the cost phase",
                cost.mode.label(),
                cost.exchange.key()
            );
        }
        if let Some(p) = cost.programs
            && (p.programs == 0 || p.runs() == 0 || p.ns() == 0)
        {
            bail!(
                "{}, {}: the agent's packet programs were not timed ({p:?}): BPF statistics \
                 off?",
                cost.mode.label(),
                cost.exchange.key()
            );
        }
        eprintln!(
            "S = {services}, {}, {}: {:.1} µs of CPU per {unit}{}",
            cost.mode.label(),
            cost.exchange.key(),
            cost.per_exchange(cost.busy_ns) / 1e3,
            cost.programs.map_or(String::new(), |p| format!(
                ", the agent's {} packet programs ran {:.1} times and {:.0} ns of it, its socket \
                 hooks {:.0} ns",
                p.programs,
                cost.per_exchange(p.runs()),
                cost.per_exchange(p.ns()),
                cost.per_exchange(p.sock.ns)
            ))
        );
    }
    Ok(costs)
}

/// The CPU time every CPU of the machine has spent busy (user, nice, system,
/// interrupts, soft interrupts, steal) since boot, in nanoseconds, from
/// `/proc/stat`'s clock ticks (`common::clock_ticks_per_second`).
fn machine_busy_ns() -> Result<u64> {
    let ns_per_tick = 1e9 / common::clock_ticks_per_second()?;
    let stat = std::fs::read_to_string("/proc/stat").context("read /proc/stat")?;
    let Some(cpu) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        bail!("/proc/stat has no `cpu` line");
    };
    let ticks: Vec<u64> = cpu
        .split_whitespace()
        .skip(1)
        .map(|t| {
            t.parse()
                .with_context(|| format!("/proc/stat's cpu line: {t:?}"))
        })
        .collect::<Result<_>>()?;
    // user nice system idle iowait irq softirq steal: all but idle and iowait.
    let busy: u64 = [0, 1, 2, 5, 6, 7]
        .iter()
        .map(|&i| ticks.get(i).copied().unwrap_or(0))
        .sum();
    Ok((busy as f64 * ns_per_tick) as u64)
}

// ---------------------------------------------------------------------------
// Request/response on established connections

/// A failed exchange's stage and error, as the new-flow client counts them.
type Failure = (&'static str, ErrorKind);

/// `threads` closed-loop clients, each with one connection to `load`'s targets (taken
/// in turn, so a no-LB mode spreads them over the backends) opened before the segment
/// starts, ping-ponging on it for `segment`. The connections last one segment: each
/// holds a backend's pool thread, which the new-flow exchanges of the next segment
/// need back.
///
/// The threads are spread over the CPUs, each pinned to one. Left to the scheduler, a
/// ping-pong's waker and wakee tend to share a CPU, and now and then every pair ended
/// up on one: segments then ran at half the rate, at random, whatever the mode.
fn rr_closed_loop(
    load: &Load<'_, SocketAddr>,
    threads: usize,
    segment: Duration,
) -> Result<Sample> {
    let allowed = sched_getaffinity(Pid::from_raw(0)).context("sched_getaffinity")?;
    let cpus: Vec<usize> = (0..CpuSet::count())
        .filter(|&cpu| allowed.is_set(cpu).unwrap_or(false))
        .collect();
    let barrier = Arc::new(Barrier::new(threads + 1));
    let mut workers = Vec::new();
    for i in 0..threads {
        let target = load.targets[i % load.targets.len()];
        let backends = load.backends.to_vec();
        let barrier = barrier.clone();
        let cpu = cpus.get(i % cpus.len().max(1)).copied();
        workers.push(load.ns.spawn(&format!("bench-rr-{i}"), move || {
            if let Some(cpu) = cpu {
                let mut one = CpuSet::new();
                // Best effort: an unpinned thread still measures, only less steadily.
                if one.set(cpu).is_ok() {
                    let _ = sched_setaffinity(Pid::from_raw(0), &one);
                }
            }
            let mut sample = empty_sample(backends.len());
            let mut conn = rr_connect(target)
                .map_err(|failure| count(&mut sample, Instant::now(), Err(failure)))
                .ok();
            barrier.wait();
            let start = Instant::now();
            let until = start + segment;
            let mut buf = [0u8; 64];
            // Attempts, not successes, are bounded: a broken mode must end its turn too.
            for _ in 0..MAX_PER_SEGMENT {
                let t0 = Instant::now();
                if t0 >= until || INTERRUPTED.load(Ordering::Relaxed) {
                    break;
                }
                let result = rr_attempt(&mut conn, target, &mut buf, &backends);
                count(&mut sample, t0, result);
            }
            sample.elapsed = start.elapsed();
            sample
        })?);
    }
    barrier.wait();
    let mut total = Sample::default();
    for w in workers {
        total.merge(w.join().map_err(|_| anyhow!("a client thread panicked"))?);
    }
    Ok(total)
}

/// `connections` connections one after the other, to `load`'s targets in turn, with
/// `requests` ping-pongs on each: a warm-up.
fn rr_sequential(
    load: &Load<'_, SocketAddr>,
    connections: usize,
    requests: usize,
) -> Result<Sample> {
    let (targets, backends) = (load.targets, load.backends);
    load.ns.run(|| {
        let start = Instant::now();
        let mut sample = empty_sample(backends.len());
        let mut buf = [0u8; 64];
        for i in 0..connections {
            let target = targets[i % targets.len()];
            let mut conn = None;
            for _ in 0..requests {
                let t0 = Instant::now();
                let result = rr_attempt(&mut conn, target, &mut buf, backends);
                count(&mut sample, t0, result);
            }
        }
        sample.elapsed = start.elapsed();
        sample
    })
}

fn empty_sample(backends: usize) -> Sample {
    Sample {
        latencies: Vec::with_capacity(1 << 16),
        backends: vec![0; backends],
        ..Sample::default()
    }
}

/// Adds the exchange that started at `t0` and came to `result` (its backend's index).
fn count(sample: &mut Sample, t0: Instant, result: Result<usize, Failure>) {
    match result {
        Ok(b) => {
            sample.ok += 1;
            sample.backends[b] += 1;
            sample
                .latencies
                .push(t0.elapsed().as_nanos().min(u128::from(u32::MAX)) as u32);
        }
        Err((stage, kind)) => {
            *sample
                .errors
                .entry(format!("{stage}: {kind:?}"))
                .or_default() += 1;
        }
    }
}

/// One request/response on `conn`, connecting first if there is none (a failed
/// exchange leaves the connection in an unknown state, so it drops it).
fn rr_attempt(
    conn: &mut Option<TcpStream>,
    target: SocketAddr,
    buf: &mut [u8],
    backends: &[String],
) -> Result<usize, Failure> {
    if conn.is_none() {
        *conn = Some(rr_connect(target)?);
    }
    let stream = conn.as_mut().expect("connected above");
    let result = rr_exchange(stream, buf, backends);
    if result.is_err() {
        *conn = None;
    }
    result
}

/// A connection for ping-pongs. It closes with a RST (`SO_LINGER` 0), as the new-flow
/// client's do, so that no mode is left with sockets in `TIME_WAIT`.
fn rr_connect(target: SocketAddr) -> Result<TcpStream, Failure> {
    let stream =
        TcpStream::connect_timeout(&target, IO_TIMEOUT).map_err(|e| ("connect", e.kind()))?;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    setsockopt(&stream, sockopt::Linger, &linger)
        .map_err(|e| ("SO_LINGER", std::io::Error::from(e).kind()))?;
    // Each request leaves at once, whatever Nagle's algorithm would make of it, as in
    // sockperf and netperf's TCP_RR.
    stream
        .set_nodelay(true)
        .map_err(|e| ("TCP_NODELAY", e.kind()))?;
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .map_err(|e| ("SO_RCVTIMEO", e.kind()))?;
    Ok(stream)
}

/// Sends [`KEEP_OPEN`] and reads the one-line answer: the index of the backend that
/// gave it.
fn rr_exchange(
    stream: &mut TcpStream,
    buf: &mut [u8],
    backends: &[String],
) -> Result<usize, Failure> {
    stream
        .write_all(KEEP_OPEN)
        .map_err(|e| ("send", e.kind()))?;
    let mut len = 0;
    while !buf[..len].ends_with(b"\n") {
        match stream.read(&mut buf[len..]) {
            Ok(0) => return Err(("receive", ErrorKind::UnexpectedEof)),
            Ok(n) => len += n,
            Err(e) => return Err(("receive", e.kind())),
        }
        if len == buf.len() {
            return Err(("receive", ErrorKind::InvalidData));
        }
    }
    let name = &buf[..len - 1];
    backends
        .iter()
        .position(|b| b.as_bytes() == name)
        .ok_or(("reply", ErrorKind::InvalidData))
}

// ---------------------------------------------------------------------------
// Reporting

struct Report<'a> {
    cfg: &'a Config,
    machine: &'a Machine,
    results: &'a [Stats],
    costs: &'a [ExchangeCost],
    /// /proc/loadavg's 1-minute figure before and after the run.
    load: (String, String),
}

impl Report<'_> {
    fn find(&self, services: u32, mode: Mode, exchange: Exchange) -> Option<&Stats> {
        self.results
            .iter()
            .find(|s| s.services == services && s.mode == mode && s.detail == exchange)
    }

    fn markdown(&self) -> String {
        let cfg = self.cfg;
        let m = self.machine;
        let mut out = String::new();
        out.push_str(&format!(
            "End to end through a ClusterIP (routed topology of docs/architecture.md (test topologies): a client pod \
             and three backend pods on one node; the node itself is a client too), one run on \
             this machine: {}, {} cores, \
             kernel {}; {}; {}. Load average (1 min) before / after: {} / {}.\n\n\
             Closed loop, {} client threads. TCP: connect, one request, one response, close \
             (RST); latency from connect to the response. UDP: a new socket (a new flow) per \
             request/response. Established RR (request/response): each client thread, pinned \
             to a CPU in turn, opens one TCP connection before the segment and ping-pongs \
             small messages on it; latency per request/response. Pod to pod RR: the same to \
             the backend pods' own IPs, no Service, in every mode: the load balancer's cost \
             on traffic that is not its own, against a node without one. The measured \
             Service sits in the middle of the S Services; all are dual-stack and have \
             {ENDPOINTS} endpoints of each family. Each mode runs {} rounds of {} ms TCP + {} \
             ms UDP for each client and family and {} ms of each RR from the pod, the modes \
             interleaved. Rates and percentiles are over all rounds; the ratios are \
             medians of per-round ratios (rate against kube-proxy's iptables mode and against \
             the client talking straight to the pods), which cancels most of the noise of a \
             shared machine.{}\n",
            m.cpu,
            m.cores,
            m.kernel,
            m.iptables,
            m.nft,
            self.load.0,
            self.load.1,
            cfg.threads,
            cfg.rounds,
            cfg.tcp_segment.as_millis(),
            cfg.udp_segment.as_millis(),
            cfg.rr_segment.as_millis(),
            if cfg.quick {
                " Quick mode: short segments, S up to 1,000."
            } else {
                ""
            }
        ));
        if cfg.agent.generic_xdp_on_pods {
            out.push_str(
                "\nebpf-proxy runs generic XDP on the pods' host-side veths \
                 (`--generic-xdp-on-pods`: `--xdp-mode generic --xdp-interfaces` naming them), \
                 where by default tc alone handles pod traffic.\n",
            );
        }
        if cfg.agent.socket_lb_pods {
            out.push_str(
                "\nebpf-proxy runs with `--socket-lb-pods`: the client pod's TCP connections \
                 to the ClusterIP go to a backend at `connect()`, where by default tc \
                 translates them; its UDP is tc's either way.\n",
            );
        }
        if cfg.agent.host_routing_bpf {
            out.push_str(
                "\nebpf-proxy runs with `--host-routing bpf`: the packets tc translates go \
                 from tc straight into the pod they are for, where by default the node's \
                 stack forwards them.\n",
            );
        }
        if cfg.exchanges.len() < EXCHANGES.len() {
            let keys: Vec<String> = cfg.exchanges.iter().map(|x| x.key()).collect();
            out.push_str(&format!(
                "\nOnly these exchanges: {} (`--exchanges`).\n",
                keys.join(", ")
            ));
        }
        for &exchange in &cfg.exchanges {
            let (title, unit) = exchange.title();
            out.push_str(&format!(
                "\n### {title}\n\n\
                 | Services | mode | {unit} | vs iptables | vs no LB | p50 µs | p99 µs | failed |\n\
                 |---:|---|---:|---:|---:|---:|---:|---:|\n"
            ));
            for s in self.results.iter().filter(|s| s.detail == exchange) {
                out.push_str(&format!("| {} {}\n", s.services, self.results.cells(s)));
            }
        }
        out.push_str(
            "\nTime to program the Services, both families (agent start to healthy / \
             iptables-restore then ip6tables-restore / nft -f of the ip table then of the ip6 \
             one):\n\n",
        );
        out.push_str(
            &self
                .results
                .programming_markdown(&cfg.sizes, &[Mode::Ebpf, Mode::Iptables, Mode::Nftables]),
        );
        out.push_str(&self.costs_markdown());
        out.push_str(&self.targets_markdown());
        out
    }

    /// The machine's CPU per exchange in each mode, and the ebpf-proxy agent's
    /// packet programs' part of it ([`exchange_costs`]): a table per exchange costed.
    fn costs_markdown(&self) -> String {
        let mut out = String::new();
        for exchange in costed(self.cfg) {
            let unit = exchange.unit();
            out.push_str(&format!(
                "\n### CPU per {unit} ({}, {CPU_ROUNDS} more rounds)\n\n\
                 Every CPU's busy time (`/proc/stat`) over the segments of each mode, per \
                 {unit}; beside it, for ebpf-proxy, what its XDP and tc programs ran, their \
                 time as a share of the no-LB node's CPU per {unit}, and what its socket \
                 hooks took (the pod's connect() runs them too, as a pod's does under the root \
                 cgroup they attach to by default), as the kernel's BPF statistics count them \
                 (on for these rounds only: two clock reads a run more).\n\n\
                 | Services | mode | exchanges | CPU µs per {unit} | more than no LB, µs | \
                 packet program runs per {unit} | their ns per {unit} | ns per run | of no \
                 LB's CPU | socket hooks' ns per {unit} |\n\
                 |---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
                exchange.title().0
            ));
            for c in self.costs.iter().filter(|c| c.exchange == exchange) {
                let cpu = c.per_exchange(c.busy_ns) / 1e3;
                let direct = self.direct_cpu_us(c);
                let programs = c.programs.map_or("- | - | - | - | -".to_owned(), |p| {
                    format!(
                        "{:.1} | {:.0} | {:.0} | {:.1}% | {:.0}",
                        c.per_exchange(p.runs()),
                        c.per_exchange(p.ns()),
                        p.ns_per_run(),
                        self.share_of_direct(c, c.per_exchange(p.ns())),
                        c.per_exchange(p.sock.ns)
                    )
                });
                out.push_str(&format!(
                    "| {} | {} | {} | {cpu:.1} | {:+.1} | {programs} |\n",
                    c.services,
                    c.mode.label(),
                    c.count,
                    cpu - direct
                ));
            }
        }
        out
    }

    /// The no-LB node's CPU per exchange, in µs, beside cost `c` (same size and
    /// exchange); NaN when it was not measured.
    fn direct_cpu_us(&self, c: &ExchangeCost) -> f64 {
        self.costs
            .iter()
            .find(|d| {
                d.services == c.services && d.exchange == c.exchange && d.mode == Mode::Direct
            })
            .map_or(f64::NAN, |d| d.per_exchange(d.busy_ns) / 1e3)
    }

    /// `ns` of one exchange of cost `c`, in percent of the no-LB node's CPU for one.
    fn share_of_direct(&self, c: &ExchangeCost, ns: f64) -> f64 {
        ns / 1e3 / self.direct_cpu_us(c) * 100.0
    }

    /// The end-to-end targets (twice iptables' connection rate, a lower p99, within
    /// 10% of no load balancer and then within 5%, request/response on established
    /// connections and pod to pod against no load balancer) at 10,000 Services, or
    /// at the largest S measured with a note that it is not 10,000. Judged on the
    /// paired per-round medians; the quartiles say how firm each verdict is.
    fn targets_markdown(&self) -> String {
        let Some(&largest) = self.cfg.sizes.iter().max() else {
            return String::new();
        };
        let mut out = format!("\n### Targets, TCP at S = {largest}");
        if largest < 10_000 {
            out.push_str(" (the targets are set at 10,000; this run stops earlier)");
        }
        out.push_str("\n\n");
        let get = |mode| self.find(largest, mode, EXCHANGES[0]);
        let (Some(ebpf), Some(ipt), Some(nft), Some(direct)) = (
            get(Mode::Ebpf),
            get(Mode::Iptables),
            get(Mode::Nftables),
            get(Mode::Direct),
        ) else {
            return out + "missing results\n";
        };
        let verdict = |met: bool| if met { "met" } else { "NOT met" };
        let vs_ipt = self.results.rate_vs(ebpf, Mode::Iptables);
        let vs_direct = self.results.rate_vs(ebpf, Mode::Direct);
        let p99_vs_ipt = self.results.p99_vs(ebpf, Mode::Iptables);
        out.push_str(&format!(
            "- connection rate at least 2x iptables' ({:.0} vs {:.0} conn/s): {vs_ipt}: {}\n\
             - p99 latency below iptables' ({:.1} vs {:.1} µs): {p99_vs_ipt} of it: {}\n\
             - within 10% of the no-LB limit ({:.0} vs {:.0} conn/s): {vs_direct}: {}\n\
             - at least 0.95x the no-LB limit: {vs_direct}: {}\n\
             - for reference, kube-proxy nftables: {} iptables' rate, {} the no-LB limit\n",
            ebpf.series.rate(),
            ipt.series.rate(),
            verdict(vs_ipt.median >= 2.0),
            ebpf.series.percentile_us(0.99),
            ipt.series.percentile_us(0.99),
            verdict(p99_vs_ipt.median < 1.0),
            ebpf.series.rate(),
            direct.series.rate(),
            verdict(vs_direct.median >= 0.9),
            verdict(vs_direct.median >= 0.95),
            self.results.rate_vs(nft, Mode::Iptables),
            self.results.rate_vs(nft, Mode::Direct),
        ));
        // No load balancer can beat the client talking straight to the pods, so this
        // is the most any of them can reach against iptables on this machine.
        out.push_str(&format!(
            "- ceiling: the no-LB limit itself is {} iptables' rate here\n",
            self.results.rate_vs(direct, Mode::Iptables)
        ));
        for (exchange, what, least) in [
            (
                EXCHANGES[8],
                "request/response on an established connection through the ClusterIP",
                0.97,
            ),
            (
                EXCHANGES[9],
                "pod to pod request/response, no Service (agent on against off)",
                0.98,
            ),
            (EXCHANGES[10], "the same over IPv6", 0.97),
            (EXCHANGES[11], "pod to pod over IPv6", 0.98),
        ] {
            let rows = (
                self.find(largest, Mode::Ebpf, exchange),
                self.find(largest, Mode::Iptables, exchange),
                self.find(largest, Mode::Nftables, exchange),
            );
            let (Some(ebpf), Some(ipt), Some(nft)) = rows else {
                continue;
            };
            let vs_direct = self.results.rate_vs(ebpf, Mode::Direct);
            out.push_str(&format!(
                "- {what}, at least {least:.2}x the no-LB node: {vs_direct}: {} (kube-proxy \
                 iptables {}, nftables {}){}\n",
                verdict(vs_direct.median >= least),
                self.results.rate_vs(ipt, Mode::Direct),
                self.results.rate_vs(nft, Mode::Direct),
                self.programs_share(largest, exchange),
            ));
        }
        let failed: u64 = self.results.iter().map(|s| s.series.failed).sum();
        if failed > 0 {
            out.push_str(&format!(
                "- {failed} exchanges failed in this run (see the tables and e2e.json)\n"
            ));
        }
        out
    }

    /// What the agent's packet programs took of one `exchange` at `services`, as
    /// "; ..." for a target's line, where the cost phase measured it: the same
    /// question as the rate's, asked of the machine's CPU, where it is not lost in
    /// the rounds' noise.
    fn programs_share(&self, services: u32, exchange: Exchange) -> String {
        let Some((c, p)) = self
            .costs
            .iter()
            .filter(|c| c.services == services && c.exchange == exchange)
            .find_map(|c| Some((c, c.programs?)))
        else {
            return String::new();
        };
        let ns = c.per_exchange(p.ns());
        format!(
            "; the agent's packet programs took {ns:.0} ns of each {}, {:.1}% of the no-LB \
             node's CPU for one",
            exchange.unit(),
            self.share_of_direct(c, ns)
        )
    }

    fn json(&self) -> serde_json::Value {
        let cfg = self.cfg;
        let rows: Vec<serde_json::Value> = self
            .results
            .iter()
            .map(|s| {
                self.results.json(
                    s,
                    json!({
                        "proto": s.detail.proto.lower(),
                        "family": s.detail.ip.key(),
                        "client": s.detail.client.key(),
                        "exchange": s.detail.kind.key(),
                        "per_backend": s.series.backends,
                    }),
                )
            })
            .collect();
        json!({
            "machine": self.machine.json(),
            "load_average_before_after": [self.load.0, self.load.1],
            "quick": cfg.quick,
            "generic_xdp_on_pods": cfg.agent.generic_xdp_on_pods,
            "socket_lb_pods": cfg.agent.socket_lb_pods,
            "host_routing_bpf": cfg.agent.host_routing_bpf,
            "exchanges": cfg.exchanges.iter().map(|x| x.key()).collect::<Vec<_>>(),
            "client_threads": cfg.threads,
            "rounds": cfg.rounds,
            "tcp_segment_s": cfg.tcp_segment.as_secs_f64(),
            "udp_segment_s": cfg.udp_segment.as_secs_f64(),
            "rr_segment_s": cfg.rr_segment.as_secs_f64(),
            "endpoints_per_service": ENDPOINTS,
            "results": rows,
            "exchange_costs": self.costs.iter().map(|c| json!({
                "services": c.services,
                "mode": c.mode.label(),
                "exchange": c.exchange.key(),
                "unit": c.exchange.unit(),
                "count": c.count,
                "cpu_ns_per_exchange": c.per_exchange(c.busy_ns),
                "program_runs_per_exchange": c.programs.map(|p| c.per_exchange(p.runs())),
                "program_ns_per_exchange": c.programs.map(|p| c.per_exchange(p.ns())),
                "socket_hook_ns_per_exchange": c.programs.map(|p| c.per_exchange(p.sock.ns)),
            })).collect::<Vec<_>>(),
        })
    }
}
