//! North-south traffic over IPv6 on real packets: NodePorts on the nodes' IPv6
//! addresses, IPv6 LoadBalancer IPs and ExternalIPs, reached from clients outside
//! the cluster in the dual-stack two-node topology of docs/architecture.md, "Test
//! topologies" (`cluster`), with an agent on each node told both its addresses
//! (`--node-ip`). Each scenario runs with XDP on the uplinks, which translates and
//! sends back out what it can (`xdp_ingress6`, checked by its `xdp_tx` count) and
//! leaves the rest to tc intact, or through tc alone (`--xdp-mode off`); the IPv4
//! twins of these scenarios are in northsouth.rs.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv6Addr, SocketAddrV6},
    thread,
    time::{Duration, Instant},
};

use ebpf_proxy_tests::{
    Protocol,
    agent::{Agent, http_get},
    client::{
        Outcome, Reply, TIMEOUT, TcpSession, tcp_request, tcp_request_here,
        tcp_request_speaking_first, udp_request, udp_sized_request,
    },
    cluster::{CLIENT1_IP6, CLIENT2_IP6, Cluster, NODE_A_IP6, NODE_B_IP6},
    manifest::{ManifestDir, Service, ServiceType, TrafficPolicy},
    netns::NetNs,
    require_root,
    servers::{TcpServer, UdpServer},
    stats::chi_square_uniform,
    topology::pod_ip6,
};
use proxy_userspace::datapath::{Maps, PinLayout};

const BACKEND: (&str, std::net::Ipv4Addr) = ("web-b1", std::net::Ipv4Addr::new(10, 1, 2, 10));
const LOCAL_BACKEND: (&str, std::net::Ipv4Addr) = ("web-a1", std::net::Ipv4Addr::new(10, 1, 1, 10));
const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 5353;
const CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x50);
const NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;
const LB_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x60, 0, 0, 0, 0, 0, 0x10);
const EXTERNAL_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x60, 0, 0, 0, 0, 0, 0x20);
/// A dropped connection attempt is given this long to (wrongly) succeed.
const DROP_WAIT: Duration = Duration::from_millis(700);
/// Significance level of the spread's chi-square test: a correct datapath fails it
/// about once in a thousand runs.
const ALPHA: f64 = 0.001;

/// The XDP settings the scenarios run under.
#[derive(Clone, Copy, Debug)]
enum Path {
    Native,
    Generic,
    /// `--xdp-mode auto`: generic XDP on veth uplinks.
    Auto,
    TcOnly,
}

impl Path {
    fn arg(self) -> &'static str {
        match self {
            Path::Native => "native",
            Path::Generic => "generic",
            Path::Auto => "auto",
            Path::TcOnly => "off",
        }
    }
}

/// The healthCheckNodePort of the externalTrafficPolicy Local scenario.
const HEALTH_PORT: u16 = 32100;
/// Every pod's IPv6 address is in this prefix (`topology::POD_NET6`): the IPv6
/// cluster CIDR of the in-cluster client check.
const POD_CIDR6: &str = "fd00:10::/96";

fn backend_ip6() -> Ipv6Addr {
    pod_ip6(BACKEND.1)
}

fn local_backend_ip6() -> Ipv6Addr {
    pod_ip6(LOCAL_BACKEND.1)
}

fn at(ip: Ipv6Addr, port: u16) -> SocketAddrV6 {
    SocketAddrV6::new(ip, port, 0, 0)
}

/// Two dual-stack nodes, two outside clients, a backend on each node serving TCP
/// and UDP on both families, and an agent on each node following one manifest
/// directory.
struct Fixture {
    agents: Vec<Agent>,
    _servers: Vec<(TcpServer, UdpServer)>,
    manifests: ManifestDir,
    cluster: Cluster,
}

impl Fixture {
    fn new(path: Path) -> Fixture {
        Fixture::with_args(path, &[])
    }

    /// [`Fixture::new`] with `args` for both agents.
    fn with_args(path: Path, args: &[&str]) -> Fixture {
        require_root().expect("privileged test");
        let cluster =
            Cluster::new(&[("a", &[LOCAL_BACKEND]), ("b", &[BACKEND])]).expect("two-node cluster");
        let servers = [LOCAL_BACKEND, BACKEND]
            .iter()
            .map(|(name, _)| {
                let ns = &cluster.pod(name).ns;
                (
                    TcpServer::start(ns, name, TCP_PORT).expect("TCP backend"),
                    UdpServer::start(ns, name, UDP_PORT).expect("UDP backend"),
                )
            })
            .collect();
        let manifests = ManifestDir::create(cluster.stem()).expect("manifest dir");
        let agents = ["a", "b"]
            .iter()
            .map(|node| {
                let n = cluster.node(node);
                let node_ip = format!("{},{}", n.ip, n.ip6);
                let mut all = vec!["--xdp-mode", path.arg(), "--node-ip", &node_ip];
                all.extend_from_slice(args);
                Agent::start_with(&n.ns, manifests.path(), &all)
                    .unwrap_or_else(|e| panic!("agent on node {node}: {e:#}"))
            })
            .collect();
        Fixture {
            agents,
            _servers: servers,
            manifests,
            cluster,
        }
    }

    /// Writes `service` (IPv6) with its endpoints, each on its node.
    fn publish(&self, service: &Service, endpoints: &[(Ipv6Addr, &str)]) {
        let names: Vec<String> = endpoints
            .iter()
            .map(|(_, node)| self.cluster.node(node).ns.name().to_owned())
            .collect();
        let on_nodes: Vec<(Ipv6Addr, &str)> = endpoints
            .iter()
            .zip(&names)
            .map(|((ip, _), name)| (*ip, name.as_str()))
            .collect();
        self.manifests
            .write(
                &format!("{}.yaml", service.name),
                &service.yaml6_on_nodes(&on_nodes),
            )
            .expect("write manifest");
    }

    fn counter(&self, node: usize, name: &str) -> u64 {
        self.agents[node]
            .counter(name)
            .unwrap_or_else(|e| panic!("counter {name}: {e:#}"))
    }

    /// The non-zero counters of both nodes, for failure messages.
    fn counters(&self) -> String {
        let mut out = String::new();
        for (n, agent) in self.agents.iter().enumerate() {
            let maps = Maps::open_pinned(&PinLayout::new(agent.bpf_root()));
            let counters: Vec<(&str, u64)> = maps
                .and_then(|m| m.counters())
                .map(|c| c.into_iter().filter(|(_, v)| *v > 0).collect())
                .unwrap_or_default();
            out.push_str(&format!("node {}: {counters:?}; ", ["a", "b"][n]));
        }
        out
    }

    fn client(&self, name: &str) -> &NetNs {
        &self.cluster.client(name).ns
    }

    /// Who translated node `node`'s traffic: with XDP on the uplinks, frames it
    /// sent back out itself (`xdp_tx`), which only `xdp_ingress6` does for IPv6;
    /// with XDP off, none.
    #[track_caller]
    fn assert_xdp_did_the_work(&self, node: usize, path: Path) {
        let sent = self.counter(node, "xdp_tx");
        match path {
            Path::TcOnly => assert_eq!(
                sent,
                0,
                "{path:?}: XDP is off, yet frames were sent back out by XDP; {}",
                self.counters()
            ),
            _ => assert!(
                sent > 0,
                "{path:?}: IPv6 was translated, but not at XDP (no frame sent back out                  by it); {}",
                self.counters()
            ),
        }
    }

    /// Polls a TCP request from `client` until it gets a reply (the agents pick up a
    /// manifest change within a sync), then returns it.
    #[track_caller]
    fn reply_within(&self, client: &str, addr: SocketAddrV6, what: &str) -> Reply<SocketAddrV6> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match tcp_request(self.client(client), addr, TIMEOUT) {
                Outcome::Reply(r) => return r,
                other if Instant::now() > deadline => panic!(
                    "{what}: no reply from {addr} within 5 s, last outcome {other}; {}",
                    self.counters()
                ),
                _ => thread::sleep(Duration::from_millis(100)),
            }
        }
    }
}

/// `test/<name>`, IPv6 alone: NodePort `http` 80/TCP -> 8080 on [`NODE_PORT`] and
/// `dns` 53/UDP -> 5353 on [`UDP_NODE_PORT`].
fn web6(name: &str) -> Service {
    Service::new_v6("test", name, CLUSTER_IP6)
        .type_(ServiceType::NodePort)
        .port("http", 80, Protocol::Tcp, TCP_PORT)
        .port("dns", 53, Protocol::Udp, UDP_PORT)
        .node_port("http", NODE_PORT)
        .node_port("dns", UDP_NODE_PORT)
}

/// externalTrafficPolicy Cluster with a backend on each node: new connections from
/// outside to node A's IPv6 NodePort spread evenly over both (a chi-square test),
/// the local backend sees the client's own address, the remote one node A's IPv6
/// address and a port of the SNAT range; UDP likewise; node B the other way round;
/// and a long connection through node A works packet after packet.
fn nodeport_cluster_policy(path: Path) {
    let fx = Fixture::new(path);
    fx.publish(
        &web6("web"),
        &[(local_backend_ip6(), "a"), (backend_ip6(), "b")],
    );
    let via_a = at(NODE_A_IP6, NODE_PORT);
    fx.reply_within("client1", via_a, "IPv6 NodePort on A");
    let to_remote = spread_through_node_a(&fx, path);

    // UDP, a new socket each: both backends answer, each seeing what TCP's did.
    let mut udp_seen = BTreeMap::new();
    for i in 0..40 {
        let outcome = udp_request(fx.client("client1"), at(NODE_A_IP6, UDP_NODE_PORT), TIMEOUT);
        let Outcome::Reply(r) = outcome else {
            panic!(
                "{path:?}: UDP NodePort on A, request {i}: {outcome}; {}",
                fx.counters()
            );
        };
        udp_seen.insert(r.backend, *r.peer.ip());
    }
    assert_eq!(
        udp_seen,
        BTreeMap::from([
            (LOCAL_BACKEND.0.to_owned(), CLIENT1_IP6),
            (BACKEND.0.to_owned(), NODE_A_IP6)
        ]),
        "{path:?}: UDP through node A: which backend saw which source"
    );

    // Through node B, the local and the remote backend swap places.
    let mut via_b_seen = BTreeMap::new();
    for i in 0..40 {
        let r = tcp_request(fx.client("client2"), at(NODE_B_IP6, NODE_PORT), TIMEOUT)
            .expect_reply(&format!("{path:?}: IPv6 NodePort on B, connection {i}"));
        via_b_seen.insert(r.backend, *r.peer.ip());
    }
    assert_eq!(
        via_b_seen,
        BTreeMap::from([
            (LOCAL_BACKEND.0.to_owned(), NODE_B_IP6),
            (BACKEND.0.to_owned(), CLIENT2_IP6)
        ]),
        "{path:?}: TCP through node B: which backend saw which source"
    );

    // A long connection works both ways, packet after packet.
    let mut session = TcpSession::open(fx.client("client1"), via_a, TIMEOUT)
        .unwrap_or_else(|e| panic!("{path:?}: a long connection through node A: {e:#}"));
    let backend = session.greeting.backend.clone();
    for i in 0..20 {
        let answer = session
            .exchange(&format!("ping {i}"))
            .unwrap_or_else(|e| panic!("{path:?}: exchange {i} with {backend}: {e}"));
        assert_eq!(answer, format!("{backend} ping {i}"));
    }
    let snat = fx.counter(0, "snat_new");
    assert!(
        snat >= to_remote,
        "{path:?}: node A counted {snat} SNATed flows for {to_remote} connections to the \
         remote backend"
    );
    fx.assert_xdp_did_the_work(0, path);
    fx.assert_xdp_did_the_work(1, path);
}

/// New TCP connections from client1 to node A's IPv6 NodePort, checked one by one
/// (the local backend sees client1, the remote one node A from a SNAT port) and as a
/// spread (uniform over both, by a chi-square test); returns how many reached the
/// remote backend.
fn spread_through_node_a(fx: &Fixture, path: Path) -> u64 {
    const CONNECTIONS: usize = 400;
    let via_a = at(NODE_A_IP6, NODE_PORT);
    // One thread in the client for the whole batch.
    let replies: Vec<Outcome<SocketAddrV6>> = fx
        .client("client1")
        .run(|| {
            (0..CONNECTIONS)
                .map(|_| tcp_request_here(via_a, TIMEOUT))
                .collect()
        })
        .expect("client1");
    let mut counts = BTreeMap::<String, u64>::new();
    let mut wrong_peers = Vec::new();
    let mut failures = Vec::new();
    for outcome in replies {
        let Outcome::Reply(r) = outcome else {
            failures.push(outcome);
            continue;
        };
        *counts.entry(r.backend.clone()).or_default() += 1;
        let snat_range = proxy_common::SNAT_PORT_MIN..=proxy_common::SNAT_PORT_MAX;
        let right = match r.backend.as_str() {
            b if b == LOCAL_BACKEND.0 => *r.peer.ip() == CLIENT1_IP6,
            b if b == BACKEND.0 => {
                *r.peer.ip() == NODE_A_IP6 && snat_range.contains(&r.peer.port())
            }
            _ => false,
        };
        if !right {
            wrong_peers.push(format!("{} saw {}", r.backend, r.peer));
        }
    }
    assert!(
        failures.is_empty(),
        "{path:?}: {} of {CONNECTIONS} connections through node A failed, first: {:?}; {}",
        failures.len(),
        &failures[..failures.len().min(5)],
        fx.counters()
    );
    assert!(
        wrong_peers.is_empty(),
        "{path:?}: the local backend must see client1 ({CLIENT1_IP6}), the remote one node \
         A ({NODE_A_IP6}) from a SNAT port; {} did not, first: {:?}",
        wrong_peers.len(),
        &wrong_peers[..wrong_peers.len().min(5)]
    );
    let spread = [
        counts.get(LOCAL_BACKEND.0).copied().unwrap_or(0),
        counts.get(BACKEND.0).copied().unwrap_or(0),
    ];
    let chi = chi_square_uniform(&spread);
    eprintln!(
        "{path:?}: {CONNECTIONS} connections through node A: {} (local) {}, {} (remote) {}; {chi}",
        LOCAL_BACKEND.0, spread[0], BACKEND.0, spread[1]
    );
    assert!(
        chi.passes(ALPHA),
        "{path:?}: the spread over the local and the remote backend {counts:?} is not \
         uniform at alpha {ALPHA}: {chi}"
    );
    spread[1]
}

#[test]
fn ipv6_nodeport_cluster_policy_spreads_and_snats_remote_native_xdp() {
    nodeport_cluster_policy(Path::Native);
}

#[test]
fn ipv6_nodeport_cluster_policy_spreads_and_snats_remote_generic_xdp() {
    nodeport_cluster_policy(Path::Generic);
}

#[test]
fn ipv6_nodeport_cluster_policy_spreads_and_snats_remote_tc_only() {
    nodeport_cluster_policy(Path::TcOnly);
}

/// externalTrafficPolicy Local on an IPv6 LoadBalancer Service: node B, with the
/// endpoint, serves keeping the client's IPv6 address; node A, without one, drops
/// (and counts it); the healthCheckNodePort on the nodes' IPv6 addresses says so
/// (503 on A, 200 with the weight on B). A pod on node A is an in-cluster client
/// when the agents know the IPv6 cluster CIDR: then it is served through every
/// endpoint with its own address (kube-proxy's short-circuit); without it, it is
/// external and dropped like client1.
fn local_policy(path: Path, cluster_cidr: bool) {
    let cidrs = format!("10.1.0.0/16,{POD_CIDR6}");
    let args: &[&str] = if cluster_cidr {
        &["--cluster-cidr", &cidrs]
    } else {
        &[]
    };
    let fx = Fixture::with_args(path, args);
    let service = web6("local")
        .type_(ServiceType::LoadBalancer)
        .external_traffic_policy(TrafficPolicy::Local)
        .health_check_node_port(HEALTH_PORT);
    fx.publish(&service, &[(backend_ip6(), "b")]);
    let via_b = fx.reply_within("client1", at(NODE_B_IP6, NODE_PORT), "ETP Local on B");
    assert_eq!(
        (via_b.backend.as_str(), *via_b.peer.ip()),
        (BACKEND.0, CLIENT1_IP6),
        "{path:?}: ETP Local keeps the client's IPv6 address"
    );
    // B's uplink translated it: at XDP, which passes a DNAT on to the stack.
    let translated = fx.counter(1, "xdp_translated");
    match path {
        Path::TcOnly => assert_eq!(translated, 0, "{path:?}: XDP is off, yet translated"),
        _ => assert!(
            translated > 0,
            "{path:?}: the IPv6 flow on B was not translated at XDP; {}",
            fx.counters()
        ),
    }
    let via_a = tcp_request(fx.client("client1"), at(NODE_A_IP6, NODE_PORT), DROP_WAIT);
    assert_eq!(
        via_a,
        Outcome::Timeout,
        "{path:?}: node A has no local endpoint and must drop; {}",
        fx.counters()
    );
    assert!(
        fx.counter(0, "drop_no_endpoint") > 0,
        "{path:?}: node A must count the drop; {}",
        fx.counters()
    );

    let health = |node: Ipv6Addr| {
        fx.client("client1")
            .run(|| http_get(at(node, HEALTH_PORT), "/"))
            .expect("run in client")
            .unwrap_or_else(|e| panic!("{path:?}: health check on [{node}]: {e:#}"))
    };
    let (status_a, body_a) = health(NODE_A_IP6);
    assert_eq!(
        status_a, 503,
        "health check on A's IPv6 address (no local endpoint):\n{body_a}"
    );
    assert!(body_a.contains("\"localEndpoints\": 0"), "{body_a}");
    let (status_b, body_b) = health(NODE_B_IP6);
    assert_eq!(
        status_b, 200,
        "health check on B's IPv6 address (one local endpoint):\n{body_b}"
    );
    assert!(body_b.contains("\"localEndpoints\": 1"), "{body_b}");

    let pod = &fx.cluster.pod(LOCAL_BACKEND.0).ns;
    let from_pod = tcp_request(pod, at(NODE_A_IP6, NODE_PORT), DROP_WAIT);
    if cluster_cidr {
        let Outcome::Reply(r) = from_pod else {
            panic!(
                "{path:?}: a pod with an IPv6 --cluster-cidr: {from_pod}; {}",
                fx.counters()
            );
        };
        assert_eq!(
            (r.backend.as_str(), *r.peer.ip()),
            (BACKEND.0, local_backend_ip6()),
            "{path:?}: an in-cluster IPv6 client reaches the remote endpoint with its own \
             address"
        );
    } else {
        assert_eq!(
            from_pod,
            Outcome::Timeout,
            "{path:?}: without --cluster-cidr an IPv6 pod is external; {}",
            fx.counters()
        );
    }
}

#[test]
fn ipv6_local_policy_keeps_the_client_and_drops_without_local_endpoint_tc_only() {
    local_policy(Path::TcOnly, false);
}

#[test]
fn ipv6_local_policy_keeps_the_client_and_drops_without_local_endpoint_native_xdp() {
    local_policy(Path::Native, true);
}

/// An IPv6 LoadBalancer IP with an IPv6 loadBalancerSourceRanges prefix: client1
/// (inside it) is served through node A, SNATed to the backend on node B; client2
/// (outside it) is dropped, and counted. An IPv6 ExternalIP, without source ranges,
/// serves both.
fn load_balancer_and_external_ip(path: Path) {
    let fx = Fixture::new(path);
    let service = web6("lb")
        .type_(ServiceType::LoadBalancer)
        .load_balancer_ingress(LB_IP6)
        .load_balancer_source_range(&format!("{CLIENT1_IP6}/128"))
        .external_ip(EXTERNAL_IP6);
    fx.publish(&service, &[(backend_ip6(), "b")]);
    for client in ["client1", "client2"] {
        for ip in [LB_IP6, EXTERNAL_IP6] {
            fx.cluster
                .route_via6(client, &format!("{ip}/128"), "a")
                .expect("route to the LB IP via node A");
        }
    }
    let lb = fx.reply_within(
        "client1",
        at(LB_IP6, 80),
        "IPv6 LB IP from an allowed client",
    );
    assert_eq!(
        (lb.backend.as_str(), *lb.peer.ip()),
        (BACKEND.0, NODE_A_IP6),
        "{path:?}: through node A the remote backend sees node A's IPv6 address (SNAT)"
    );
    let denied = tcp_request(fx.client("client2"), at(LB_IP6, 80), DROP_WAIT);
    assert_eq!(
        denied,
        Outcome::Timeout,
        "{path:?}: client2 ({CLIENT2_IP6}) is outside the source ranges; {}",
        fx.counters()
    );
    assert!(
        fx.counter(0, "drop_source_range") > 0,
        "{path:?}: node A must count the drop; {}",
        fx.counters()
    );
    for client in ["client1", "client2"] {
        let ext = tcp_request(fx.client(client), at(EXTERNAL_IP6, 80), TIMEOUT)
            .expect_reply(&format!("{path:?}: {client} to the IPv6 ExternalIP"));
        assert_eq!(
            (ext.backend.as_str(), *ext.peer.ip()),
            (BACKEND.0, NODE_A_IP6),
            "{path:?}: {client} through the ExternalIP"
        );
    }
    fx.assert_xdp_did_the_work(0, path);
}

#[test]
fn ipv6_load_balancer_source_ranges_and_external_ip_tc_only() {
    load_balancer_and_external_ip(Path::TcOnly);
}

#[test]
fn ipv6_load_balancer_source_ranges_and_external_ip_native_xdp() {
    load_balancer_and_external_ip(Path::Native);
}

/// An IPv6 NodePort whose Service has no endpoints is refused at once (a reset from
/// node A's datapath, as kube-proxy's REJECT), while the NodePort next to it serves.
#[test]
fn ipv6_nodeport_without_endpoints_is_refused() {
    let fx = Fixture::new(Path::TcOnly);
    fx.publish(&web6("web"), &[(backend_ip6(), "b")]);
    fx.reply_within("client1", at(NODE_A_IP6, NODE_PORT), "IPv6 NodePort on A");
    let closed_port = NODE_PORT + 10;
    let empty = Service::new_v6(
        "test",
        "empty",
        Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x51),
    )
    .type_(ServiceType::NodePort)
    .port("http", 80, Protocol::Tcp, TCP_PORT)
    .node_port("http", closed_port);
    fx.publish(&empty, &[]);
    let deadline = Instant::now() + Duration::from_secs(5);
    let refused = loop {
        let outcome = tcp_request(fx.client("client1"), at(NODE_A_IP6, closed_port), TIMEOUT);
        // The node's own stack refuses too until the agent has the Service: only
        // the datapath's count says who did.
        if (outcome == Outcome::Refused && fx.counter(0, "reject") > 0) || Instant::now() > deadline
        {
            break outcome;
        }
        thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        refused,
        Outcome::Refused,
        "an IPv6 NodePort without endpoints; {}",
        fx.counters()
    );
    assert!(
        fx.counter(0, "reject") > 0,
        "node A's datapath must have rejected; {}",
        fx.counters()
    );
}

/// Fragmented UDP from outside through node A's IPv6 NodePort to the backend on
/// node B (SNAT to node A's IPv6 address): 4,000-byte requests and 4,000-byte
/// answers, every fragment of both translated, answers whole and from the NodePort;
/// with XDP on, translated and sent back out there.
fn nodeport_fragments(path: Path) {
    const EXCHANGES: usize = 10;
    let fx = Fixture::new(path);
    fx.publish(&web6("web"), &[(backend_ip6(), "b")]);
    fx.reply_within("client1", at(NODE_A_IP6, NODE_PORT), "IPv6 NodePort on A");
    let addr = at(NODE_A_IP6, UDP_NODE_PORT);
    let mut retried = Vec::new();
    for (what, request, answer) in [("requests", 4000, 100), ("answers", 100, 4000)] {
        for i in 0..EXCHANGES {
            let mut outcome =
                udp_sized_request(fx.client("client1"), addr, request, answer, TIMEOUT);
            if !matches!(outcome, Outcome::Reply(_)) {
                // One retry, as a UDP client makes, and said: a datagram of three
                // fragments has three chances to be lost on a loaded machine; a
                // datapath that drops fragments loses both tries.
                retried.push(format!("{what} {i}: {outcome}"));
                outcome = udp_sized_request(fx.client("client1"), addr, request, answer, TIMEOUT);
            }
            let Outcome::Reply(reply) = outcome else {
                panic!(
                    "{path:?}: fragmented {what} over IPv6, exchange {i}: {outcome}; {}",
                    fx.counters()
                );
            };
            assert_eq!(
                (reply.backend.as_str(), *reply.peer.ip()),
                (BACKEND.0, NODE_A_IP6),
                "{path:?}: fragmented {what}: the remote backend must see node A (SNAT)"
            );
        }
    }
    if !retried.is_empty() {
        eprintln!("exchanges answered on their retry: {retried:?}");
    }
    let translated = fx.counter(0, "frag_translated");
    eprintln!("{path:?}: {translated} later fragments translated on node A");
    assert!(
        translated >= (4 * EXCHANGES) as u64,
        "{path:?}: {translated} later fragments translated on node A for {} datagrams of \
         three fragments; {}",
        2 * EXCHANGES,
        fx.counters()
    );
    fx.assert_xdp_did_the_work(0, path);
    if !matches!(path, Path::TcOnly) {
        // Every fragment of a request and of an answer is sent back out by XDP:
        // at least the later ones counted above.
        let sent = fx.counter(0, "xdp_tx");
        assert!(
            sent >= translated,
            "{path:?}: {sent} frames sent back out by XDP, fewer than the {translated} \
             later fragments translated; {}",
            fx.counters()
        );
    }
}

#[test]
fn ipv6_nodeport_fragments_native_xdp() {
    nodeport_fragments(Path::Native);
}

#[test]
fn ipv6_nodeport_fragments_tc_only() {
    nodeport_fragments(Path::TcOnly);
}

/// From outside, a UDP NodePort on node A's IPv6 address whose backend, on node B
/// (SNAT), listens on no such port: the backend's kernel sends ICMPv6 port
/// unreachable to node A quoting node A's SNAT port; node A's uplink translates it
/// back (quoting the NodePort, from the NodePort address) and routes it to the
/// client, whose connected socket fails at once with "connection refused" instead
/// of waiting out its timeout.
fn nodeport_closed_port_is_refused(path: Path) {
    const EXCHANGES: usize = 10;
    const CLOSED_NODE_PORT: u16 = 30054;
    let fx = Fixture::new(path);
    let closed = Service::new_v6(
        "test",
        "closed",
        Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x52),
    )
    .type_(ServiceType::NodePort)
    .port("dns", 53, Protocol::Udp, 5999)
    .node_port("dns", CLOSED_NODE_PORT);
    fx.publish(&web6("web"), &[(backend_ip6(), "b")]);
    fx.publish(&closed, &[(backend_ip6(), "b")]);
    fx.reply_within("client1", at(NODE_A_IP6, NODE_PORT), "IPv6 NodePort on A");
    fx.cluster
        .pod(BACKEND.0)
        .ns
        .sysctl("net.ipv6.icmp.ratelimit", "0")
        .expect("lifting the backend's ICMPv6 rate limit");
    let addr = at(NODE_A_IP6, CLOSED_NODE_PORT);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut refused = 0;
    let mut outcomes = Vec::new();
    while refused < EXCHANGES {
        let answer = fx
            .client("client1")
            .run(|| {
                let s = std::net::UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0))?;
                s.connect(addr)?;
                s.set_read_timeout(Some(Duration::from_millis(500)))?;
                s.send(b"anyone there?")?;
                s.recv(&mut [0u8; 64])
            })
            .expect("client1");
        match answer {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => refused += 1,
            // The agents may not have the Service yet.
            other if refused == 0 && Instant::now() < deadline => {
                outcomes.push(format!("{other:?}"));
                thread::sleep(Duration::from_millis(100));
            }
            other => panic!(
                "{path:?}: exchange {refused}: {other:?} instead of connection refused \
                 (earlier: {outcomes:?}); {}",
                fx.counters()
            ),
        }
    }
    let translated = fx.counter(0, "icmp_error_translated");
    assert!(
        translated >= EXCHANGES as u64,
        "{path:?}: {translated} ICMPv6 errors translated on node A for {EXCHANGES} refusals; {}",
        fx.counters()
    );
    // The requests went out through XDP; the errors, left to tc, came back
    // through it.
    fx.assert_xdp_did_the_work(0, path);
}

#[test]
fn ipv6_nodeport_closed_port_is_refused_native_xdp() {
    nodeport_closed_port_is_refused(Path::Native);
}

#[test]
fn ipv6_nodeport_closed_port_is_refused_tc_only() {
    nodeport_closed_port_is_refused(Path::TcOnly);
}

/// 300 IPv6 connections held open at once from one client through node A's SNAT:
/// every one is served, and the backend sees 300 distinct (node A, port) sources.
#[test]
fn ipv6_concurrent_snat_flows_never_share_a_port() {
    const SESSIONS: usize = 300;
    let fx = Fixture::new(Path::Native);
    fx.publish(&web6("many"), &[(backend_ip6(), "b")]);
    let addr = at(NODE_A_IP6, NODE_PORT);
    fx.reply_within("client1", addr, "IPv6 NodePort on A");
    let sessions: Vec<TcpSession<SocketAddrV6>> = (0..SESSIONS)
        .map(|i| {
            TcpSession::open(fx.client("client1"), addr, TIMEOUT)
                .unwrap_or_else(|e| panic!("session {i} of {SESSIONS}: {e:#}; {}", fx.counters()))
        })
        .collect();
    let sources: BTreeSet<SocketAddrV6> = sessions.iter().map(|s| s.greeting.peer).collect();
    assert!(
        sessions.iter().all(|s| *s.greeting.peer.ip() == NODE_A_IP6),
        "every session must be SNATed to node A's IPv6 address: {sources:?}"
    );
    assert_eq!(
        sources.len(),
        SESSIONS,
        "the backend saw {} distinct SNAT sources for {SESSIONS} concurrent sessions",
        sources.len()
    );
    for (i, mut s) in sessions.into_iter().enumerate() {
        let answer = s
            .exchange("still there")
            .unwrap_or_else(|e| panic!("session {i}: exchange on an open session: {e:#}"));
        assert_eq!(answer, format!("{} still there", BACKEND.0), "session {i}");
    }
    assert_eq!(fx.counter(0, "snat_exhausted"), 0, "{}", fx.counters());
}

/// A SYN flood over IPv6 to node A's NodePort (backend on node B, SNAT) cannot cut
/// the connections already established through it: with `--conntrack-max 1024`, 30
/// idle connections through node A keep their backend while client2 sends 20,000
/// SYNs from ever new ports (at least ten times the flows conntrack holds reach node
/// A), and new connections made during the flood are served. The IPv6 twin of
/// northsouth.rs's `nodeport_syn_flood`, whose comment says why these clients
/// speak first and why 20,000.
fn nodeport_syn_flood(path: Path) {
    /// Past the second SYN retransmission (1 s, then 3 s after the first SYN).
    const FLOOD_TIMEOUT: Duration = Duration::from_secs(5);
    const SYNS: u32 = 20_000;
    let fx = Fixture::with_args(path, &["--conntrack-max", "1024"]);
    fx.publish(&web6("web"), &[(backend_ip6(), "b")]);
    let addr = at(NODE_A_IP6, NODE_PORT);
    fx.reply_within("client1", addr, "IPv6 NodePort on A");
    let mut sessions: Vec<TcpSession<SocketAddrV6>> = (0..30)
        .map(|i| {
            TcpSession::open(fx.client("client1"), addr, TIMEOUT)
                .unwrap_or_else(|e| panic!("{path:?}: connection {i}: {e:#}"))
        })
        .collect();
    let flood = fx
        .client("client2")
        .spawn("syn-flood6", move || {
            ebpf_proxy_tests::flood::syn_flood6_here(CLIENT2_IP6, addr, SYNS)
        })
        .expect("flooding from client2");
    let mut during = 0;
    let mut lost = Vec::new();
    for i in 0..20 {
        match tcp_request_speaking_first(fx.client("client1"), addr, FLOOD_TIMEOUT) {
            Outcome::Reply(_) => during += 1,
            other => lost.push(format!("request {i}: {other}")),
        }
    }
    let sent = flood
        .join()
        .expect("the flood thread")
        .expect("raw socket flood");
    assert_eq!(sent, SYNS, "{path:?}: SYNs sent");
    assert_eq!(
        during,
        20,
        "{path:?}: new connections during the flood ({lost:?}); {}",
        fx.counters()
    );
    for (i, session) in sessions.iter_mut().enumerate() {
        let answer = session.exchange("after").unwrap_or_else(|e| {
            panic!(
                "{path:?}: connection {i} after the flood: {e:#}; {}",
                fx.counters()
            )
        });
        assert_eq!(
            answer,
            format!("{} after", BACKEND.0),
            "{path:?}: connection {i}"
        );
    }
    let new_flows = fx.counter(0, "ct_new_flow");
    eprintln!("{path:?}: {new_flows} new IPv6 flows on node A from {SYNS} SYNs sent");
    assert!(
        new_flows >= 10 * 1024,
        "{path:?}: only {new_flows} new flows reached node A's datapath from {SYNS} SYNs, \
         less than ten times what conntrack holds"
    );
    fx.assert_xdp_did_the_work(0, path);
}

#[test]
fn ipv6_nodeport_syn_flood_native_xdp() {
    nodeport_syn_flood(Path::Native);
}

#[test]
fn ipv6_nodeport_syn_flood_tc_only() {
    nodeport_syn_flood(Path::TcOnly);
}

/// Veth uplinks fed with partial checksums (transmit offload on, as between
/// containers of one host): `--xdp-mode auto` picks generic XDP there, and IPv6
/// traffic it translates keeps valid checksums, TCP and UDP.
#[test]
fn ipv6_nodeport_auto_xdp_with_partial_checksums() {
    let fx = Fixture::new(Path::Auto);
    for ns in [fx.client("client1"), &fx.cluster.node("b").ns] {
        ebpf_proxy_tests::cluster::set_tx_checksum_offload(ns, true).expect("offload on");
    }
    let log = fx.agents[0].log();
    assert!(
        log.contains("(\"eth0\", \"generic\")"),
        "auto on a veth uplink must pick generic XDP; agent log:\n{log}"
    );
    fx.publish(&web6("web"), &[(backend_ip6(), "b")]);
    let addr = at(NODE_A_IP6, NODE_PORT);
    let first = fx.reply_within("client1", addr, "IPv6 NodePort on A");
    assert_eq!(
        *first.peer.ip(),
        NODE_A_IP6,
        "the remote backend sees node A"
    );
    for i in 0..20 {
        tcp_request(fx.client("client1"), addr, TIMEOUT)
            .expect_reply(&format!("IPv6 connection {i} through generic XDP"));
    }
    let udp = udp_request(fx.client("client1"), at(NODE_A_IP6, UDP_NODE_PORT), TIMEOUT);
    let Outcome::Reply(udp) = udp else {
        panic!(
            "UDP over IPv6 through generic XDP: {udp}; {}",
            fx.counters()
        );
    };
    assert_eq!(udp.backend, BACKEND.0);
    fx.assert_xdp_did_the_work(0, Path::Auto);
}
