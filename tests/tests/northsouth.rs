//! North-south traffic on real packets: NodePort, LoadBalancer IPs and ExternalIPs
//! reached from clients outside the cluster, in the two-node topology of docs/architecture.md,
//! "Test topologies" (`cluster`), with an agent on each node. Each scenario runs through XDP
//! (native on these veths, and generic) and through tc alone (`--xdp-mode off`).

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddrV4},
    thread,
    time::{Duration, Instant},
};

use ebpf_proxy_tests::{
    Protocol,
    agent::{Agent, http_get},
    client::{
        Outcome, TcpSession, tcp_request, tcp_request_speaking_first, udp_request,
        udp_sized_request,
    },
    cluster::{CLIENT1, CLIENT2, Cluster, NODE_A_IP, NODE_B_IP},
    manifest::{Endpoint, ManifestDir, Service, ServiceType, TrafficPolicy},
    require_root,
    servers::{TcpServer, UdpServer},
};
use proxy_userspace::datapath::{Maps, PinLayout};

const BACKEND: (&str, Ipv4Addr) = ("web-b1", Ipv4Addr::new(10, 1, 2, 10));
const LOCAL_BACKEND: (&str, Ipv4Addr) = ("web-a1", Ipv4Addr::new(10, 1, 1, 10));
const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 5353;
const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 50);
const NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;
const HEALTH_PORT: u16 = 32100;
const LB_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 60, 10);
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 60, 20);
use ebpf_proxy_tests::client::TIMEOUT;
/// A dropped connection attempt is given this long to (wrongly) succeed.
const DROP_WAIT: Duration = Duration::from_millis(700);

/// The XDP settings every scenario runs under.
#[derive(Clone, Copy, Debug)]
enum Path {
    Native,
    Generic,
    TcOnly,
    /// The default: generic XDP on these veth uplinks.
    Auto,
}

impl Path {
    fn arg(self) -> &'static str {
        match self {
            Path::Native => "native",
            Path::Generic => "generic",
            Path::TcOnly => "off",
            Path::Auto => "auto",
        }
    }
}

/// Two nodes, two outside clients, a backend on each node serving TCP and UDP, and
/// an agent on each node following one manifest directory.
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
        Fixture {
            agents: Vec::new(),
            _servers: servers,
            manifests,
            cluster,
        }
        .with_agents(path, args)
    }

    fn with_agents(mut self, path: Path, args: &[&str]) -> Fixture {
        for node in ["a", "b"] {
            let ns = &self.cluster.node(node).ns;
            let mut all = vec!["--xdp-mode", path.arg()];
            all.extend_from_slice(args);
            let agent = Agent::start_with(ns, self.manifests.path(), &all)
                .unwrap_or_else(|e| panic!("agent on node {node}: {e:#}"));
            self.agents.push(agent);
        }
        self
    }

    /// The node name an agent uses for node `n` (its namespace name).
    fn node_name(&self, n: &str) -> String {
        self.cluster.node(n).ns.name().to_owned()
    }

    /// Writes `service` with its endpoints (each on its node) and waits until
    /// both agents have it.
    fn publish(&self, service: &Service, endpoints: &[(Ipv4Addr, &str)]) {
        let eps: Vec<_> = endpoints
            .iter()
            .map(|(ip, node)| Endpoint::ready(*ip).on_node(&self.node_name(node)))
            .collect();
        self.manifests
            .write(&format!("{}.yaml", service.name), &service.yaml_with(&eps))
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

    fn client(&self, name: &str) -> &ebpf_proxy_tests::netns::NetNs {
        &self.cluster.client(name).ns
    }
}

/// Polls a TCP request until it gets a reply (the agents pick up a manifest
/// change within a sync), then returns it.
#[track_caller]
fn reply_within(
    fx: &Fixture,
    client: &str,
    addr: SocketAddrV4,
    what: &str,
) -> ebpf_proxy_tests::client::Reply {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match tcp_request(fx.client(client), addr, TIMEOUT) {
            Outcome::Reply(r) => return r,
            other if Instant::now() > deadline => panic!(
                "{what}: no reply from {addr} within 5 s, last outcome {other}; {}",
                fx.counters()
            ),
            _ => thread::sleep(Duration::from_millis(100)),
        }
    }
}

fn web(name: &str) -> Service {
    Service::new("test", name, CLUSTER_IP)
        .type_(ServiceType::NodePort)
        .port("http", 80, Protocol::Tcp, TCP_PORT)
        .port("dns", 53, Protocol::Udp, UDP_PORT)
        .node_port("http", NODE_PORT)
        .node_port("dns", UDP_NODE_PORT)
}

/// externalTrafficPolicy Cluster: node A, with no backend of its own, reaches the
/// backend on node B with SNAT to its address (TCP and UDP); node B reaches it
/// directly, keeping the client's address.
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom; its steps share the namespaces and agent it sets up"
)]
fn nodeport_cluster_policy(path: Path) {
    let fx = Fixture::new(path);
    fx.publish(&web("web"), &[(BACKEND.1, "b")]);
    let via_a = reply_within(
        &fx,
        "client1",
        SocketAddrV4::new(NODE_A_IP, NODE_PORT),
        "NodePort on A",
    );
    assert_eq!(
        (via_a.backend.as_str(), *via_a.peer.ip()),
        (BACKEND.0, NODE_A_IP),
        "{path:?}: through node A the remote backend must see node A's address (SNAT)"
    );
    let port = via_a.peer.port();
    assert!(
        (proxy_common::SNAT_PORT_MIN..=proxy_common::SNAT_PORT_MAX).contains(&port),
        "{path:?}: SNAT source port {port} outside the SNAT range"
    );
    let udp = udp_request(
        fx.client("client1"),
        SocketAddrV4::new(NODE_A_IP, UDP_NODE_PORT),
        TIMEOUT,
    );
    let Outcome::Reply(udp) = udp else {
        panic!("{path:?}: UDP NodePort on A: {udp}; {}", fx.counters());
    };
    assert_eq!(
        (udp.backend.as_str(), *udp.peer.ip()),
        (BACKEND.0, NODE_A_IP)
    );

    let via_b = tcp_request(
        fx.client("client1"),
        SocketAddrV4::new(NODE_B_IP, NODE_PORT),
        TIMEOUT,
    )
    .expect_reply("NodePort on B");
    assert_eq!(
        (via_b.backend.as_str(), *via_b.peer.ip()),
        (BACKEND.0, CLIENT1.1),
        "{path:?}: a local backend is reached without SNAT"
    );
    // A long connection works both ways, packet after packet.
    let mut session = TcpSession::open(
        fx.client("client1"),
        SocketAddrV4::new(NODE_A_IP, NODE_PORT),
        TIMEOUT,
    )
    .expect("session through node A");
    for i in 0..20 {
        let answer = session.exchange(&format!("ping {i}")).expect("exchange");
        assert_eq!(answer, format!("{} ping {i}", BACKEND.0));
    }
    // East-west across nodes: a pod on A to the ClusterIP, the backend on B; the
    // reply enters A through its uplink (and XDP, when on) to be reverse-NATed.
    let pod = &fx.cluster.pod(LOCAL_BACKEND.0).ns;
    let east_west = tcp_request(pod, SocketAddrV4::new(CLUSTER_IP, 80), TIMEOUT)
        .expect_reply("ClusterIP from a pod on A to the backend on B");
    assert_eq!(
        (east_west.backend.as_str(), *east_west.peer.ip()),
        (BACKEND.0, LOCAL_BACKEND.1),
        "{path:?}: ClusterIP traffic keeps the pod's address across nodes"
    );

    // No endpoints at all: refused at once, as kube-proxy's REJECT (XDP leaves
    // the reset to tc).
    let empty = Service::new("test", "empty", Ipv4Addr::new(10, 96, 0, 51))
        .type_(ServiceType::NodePort)
        .port("http", 80, Protocol::Tcp, TCP_PORT)
        .node_port("http", NODE_PORT + 10);
    fx.publish(&empty, &[]);
    let deadline = Instant::now() + Duration::from_secs(5);
    let refused = loop {
        let outcome = tcp_request(
            fx.client("client1"),
            SocketAddrV4::new(NODE_A_IP, NODE_PORT + 10),
            TIMEOUT,
        );
        // The node's own stack refuses too until the agent has the Service:
        // only the datapath's count says who did.
        if (outcome == Outcome::Refused && fx.counter(0, "reject") > 0) || Instant::now() > deadline
        {
            break outcome;
        }
        thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        refused,
        Outcome::Refused,
        "{path:?}: a NodePort without endpoints"
    );
    assert!(
        fx.counter(0, "reject") > 0,
        "{path:?}: node A's datapath must have rejected"
    );

    let status = fx.agents[0].status().expect("ebpf-proxy status");
    assert!(
        status.contains("SNAT to 192.168.50.1 ports 1024-29999")
            && status.contains("192.168.50.1 (NodePorts)")
            && status.contains("0.0.0.0:30080/TCP")
            && status.contains("datapath clock: jiffies x"),
        "status of node A:\n{status}"
    );
    let xdp_link = status.contains("xdp-eth0");
    assert_eq!(
        xdp_link,
        !matches!(path, Path::TcOnly),
        "{path:?}: XDP link in status:\n{status}"
    );
    let snat = fx.counter(0, "snat_new");
    assert!(
        snat >= 3,
        "{path:?}: node A counted {snat} SNATed flows, expected 3 or more"
    );
    let xdp_tx = fx.counter(0, "xdp_tx");
    match path {
        Path::TcOnly => assert_eq!(xdp_tx, 0, "no XDP: tc must do it all"),
        _ => assert!(
            xdp_tx > 0,
            "{path:?}: XDP sent no packet itself (xdp_tx 0, xdp_to_tc {})",
            fx.counter(0, "xdp_to_tc")
        ),
    }
}

/// Fragmented UDP from outside through node A's NodePort to the backend on node B
/// (SNAT to node A, the source port chosen by the datapath): 4,000-byte requests
/// and 4,000-byte answers, every fragment of both translated, answers whole and
/// from the NodePort, with the client's own address seen by no one but node A.
fn nodeport_fragments(path: Path) {
    const EXCHANGES: usize = 10;
    let fx = Fixture::new(path);
    fx.publish(&web("web"), &[(BACKEND.1, "b")]);
    reply_within(
        &fx,
        "client1",
        SocketAddrV4::new(NODE_A_IP, NODE_PORT),
        "NodePort on A",
    );
    let addr = SocketAddrV4::new(NODE_A_IP, UDP_NODE_PORT);
    let mut retried = Vec::new();
    for (what, request, answer) in [("requests", 4000, 100), ("answers", 100, 4000)] {
        for i in 0..EXCHANGES {
            let mut outcome =
                udp_sized_request(fx.client("client1"), addr, request, answer, TIMEOUT);
            if !matches!(outcome, Outcome::Reply(_)) {
                // One retry, as a UDP client makes, and said: the flood tests
                // running beside this one share the kernel's per-CPU backlog,
                // and a datagram of three fragments has three chances to be
                // dropped there. A datapath that drops fragments loses both.
                retried.push(format!("{what} {i}: {outcome}"));
                outcome = udp_sized_request(fx.client("client1"), addr, request, answer, TIMEOUT);
            }
            let Outcome::Reply(reply) = outcome else {
                panic!(
                    "{path:?}: fragmented {what}, exchange {i}: {outcome}; {}",
                    fx.counters()
                );
            };
            assert_eq!(
                (reply.backend.as_str(), *reply.peer.ip()),
                (BACKEND.0, NODE_A_IP),
                "{path:?}: fragmented {what}: the remote backend must see node A (SNAT)"
            );
        }
    }
    if !retried.is_empty() {
        eprintln!("{path:?}: exchanges answered on their retry: {retried:?}");
    }
    let translated = fx.counter(0, "frag_translated");
    assert!(
        translated >= (4 * EXCHANGES) as u64,
        "{path:?}: {translated} later fragments translated on node A for {} datagrams of \
         three fragments; {}",
        2 * EXCHANGES,
        fx.counters()
    );
}

#[test]
fn nodeport_fragments_native_xdp() {
    nodeport_fragments(Path::Native);
}

#[test]
fn nodeport_fragments_tc_only() {
    nodeport_fragments(Path::TcOnly);
}

/// From outside, a UDP NodePort whose backend, on the other node (SNAT), listens on
/// no such port: the backend's kernel sends ICMP port unreachable to node A quoting
/// node A's SNAT port; node A's uplink translates it back (quoting the NodePort, from
/// the NodePort address) and routes it to the client, whose connected socket fails
/// at once with "connection refused" instead of waiting out its timeout.
fn nodeport_closed_port_is_refused(path: Path) {
    const EXCHANGES: usize = 10;
    const CLOSED_NODE_PORT: u16 = 30054;
    let fx = Fixture::new(path);
    let closed = Service::new("test", "closed", Ipv4Addr::new(10, 96, 0, 51))
        .type_(ServiceType::NodePort)
        .port("dns", 53, Protocol::Udp, 5999)
        .node_port("dns", CLOSED_NODE_PORT);
    fx.publish(&web("web"), &[(BACKEND.1, "b")]);
    fx.publish(&closed, &[(BACKEND.1, "b")]);
    reply_within(
        &fx,
        "client1",
        SocketAddrV4::new(NODE_A_IP, NODE_PORT),
        "NodePort on A",
    );
    fx.cluster
        .pod(BACKEND.0)
        .ns
        .run(|| std::fs::write("/proc/sys/net/ipv4/icmp_ratelimit", "0"))
        .and_then(|r| Ok(r?))
        .expect("lifting the backend's ICMP rate limit");
    let addr = SocketAddrV4::new(NODE_A_IP, CLOSED_NODE_PORT);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut refused = 0;
    let mut outcomes = Vec::new();
    while refused < EXCHANGES {
        let answer = fx
            .client("client1")
            .run(|| {
                let s = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
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
        "{path:?}: {translated} ICMP errors translated on node A for {EXCHANGES} refusals; {}",
        fx.counters()
    );
}

#[test]
fn nodeport_closed_port_is_refused_native_xdp() {
    nodeport_closed_port_is_refused(Path::Native);
}

#[test]
fn nodeport_closed_port_is_refused_tc_only() {
    nodeport_closed_port_is_refused(Path::TcOnly);
}

/// From outside, a SYN flood to a NodePort whose backend is on the other node (SNAT)
/// cannot cut the connections already established through it: with `--conntrack-max
/// 1024`, 30 idle connections through node A keep their backend while another client
/// sends 20,000 SYNs from ever new ports (at least ten times the connections conntrack
/// holds reach node A;
/// the backend answers each, the flooding client's kernel resets each), and new
/// connections made during the flood are served. Fewer SYNs than the 28,976 SNAT
/// ports: each takes one until a second after its reset, and a faster flood of more
/// would exhaust them, which is another limit than the one this test is about.
///
/// The flood fills the backend's SYN queue, so the backend answers with SYN cookies,
/// which keep no state: when the handshake's last ACK is lost on the loaded veths, the
/// backend never retransmits, and a client waiting for the greeting would wait until
/// it sent something (runs saw exactly that: the backend greeted a connection only
/// when its client's FIN arrived, 2 s after the handshake). So these clients speak
/// first, as most protocols do, and their data completes such a handshake; and they
/// wait long enough for TCP's own recovery from a lost SYN or two.
fn nodeport_syn_flood(path: Path) {
    /// Past the second SYN retransmission (1 s, then 3 s after the first SYN).
    const FLOOD_TIMEOUT: Duration = Duration::from_secs(5);
    const SYNS: u32 = 20_000;
    let fx = Fixture::with_args(path, &["--conntrack-max", "1024"]);
    fx.publish(&web("web"), &[(BACKEND.1, "b")]);
    let addr = SocketAddrV4::new(NODE_A_IP, NODE_PORT);
    reply_within(&fx, "client1", addr, "NodePort on A");
    let mut sessions: Vec<TcpSession> = (0..30)
        .map(|i| {
            TcpSession::open(fx.client("client1"), addr, TIMEOUT)
                .unwrap_or_else(|e| panic!("{path:?}: connection {i}: {e:#}"))
        })
        .collect();
    let flood = fx
        .client("client2")
        .spawn("syn-flood", move || {
            ebpf_proxy_tests::flood::syn_flood_here(CLIENT2.1, addr, SYNS)
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
    eprintln!("{path:?}: {new_flows} new flows on node A from {SYNS} SYNs sent");
    assert!(
        new_flows >= 10 * 1024,
        "{path:?}: only {new_flows} new flows reached node A's datapath from {SYNS} SYNs, \
         less than ten times what conntrack holds"
    );
}

#[test]
fn nodeport_syn_flood_native_xdp() {
    nodeport_syn_flood(Path::Native);
}

#[test]
fn nodeport_syn_flood_tc_only() {
    nodeport_syn_flood(Path::TcOnly);
}

#[test]
fn nodeport_cluster_policy_native_xdp() {
    nodeport_cluster_policy(Path::Native);
}

#[test]
fn nodeport_cluster_policy_generic_xdp() {
    nodeport_cluster_policy(Path::Generic);
}

#[test]
fn nodeport_cluster_policy_tc_only() {
    nodeport_cluster_policy(Path::TcOnly);
}

/// Veth uplinks fed with partial checksums (transmit offload on, as between
/// containers of one host, kind-style): `--xdp-mode auto` picks generic XDP there,
/// and translated traffic keeps valid checksums.
#[test]
fn nodeport_auto_xdp_with_partial_checksums() {
    let fx = Fixture::new(Path::Auto);
    for ns in [fx.client("client1"), &fx.cluster.node("b").ns] {
        ebpf_proxy_tests::cluster::set_tx_checksum_offload(ns, true).expect("offload on");
    }
    let log = fx.agents[0].log();
    assert!(
        log.contains("(\"eth0\", \"generic\")"),
        "auto on a veth uplink must pick generic XDP; agent log:\n{log}"
    );
    fx.publish(&web("web"), &[(BACKEND.1, "b")]);
    let addr = SocketAddrV4::new(NODE_A_IP, NODE_PORT);
    let first = reply_within(&fx, "client1", addr, "NodePort on A");
    assert_eq!(*first.peer.ip(), NODE_A_IP);
    for i in 0..20 {
        tcp_request(fx.client("client1"), addr, TIMEOUT)
            .expect_reply(&format!("connection {i} through generic XDP"));
    }
    let udp = udp_request(
        fx.client("client1"),
        SocketAddrV4::new(NODE_A_IP, UDP_NODE_PORT),
        TIMEOUT,
    );
    let Outcome::Reply(udp) = udp else {
        panic!("UDP through generic XDP: {udp}; {}", fx.counters());
    };
    assert_eq!(udp.backend, BACKEND.0);
    assert!(
        fx.counter(0, "xdp_tx") > 0,
        "XDP must have done the work: {}",
        fx.counters()
    );
}

/// externalTrafficPolicy Local on a LoadBalancer Service: node A (no local
/// endpoint) drops, node B serves with the client's own address, and the
/// healthCheckNodePort says so (503 on A, 200 with the weight on B). A pod on
/// node A is an in-cluster client when the agents know the cluster CIDR:
/// then it is served through every endpoint, unmasqueraded (kube-proxy's
/// short-circuit); without it, it is external and dropped like client1.
fn local_policy(path: Path, cluster_cidr: bool) {
    let args: &[&str] = if cluster_cidr {
        &["--cluster-cidr", "10.1.0.0/16"]
    } else {
        &[]
    };
    let fx = Fixture::with_args(path, args);
    let service = web("local")
        .type_(ServiceType::LoadBalancer)
        .external_traffic_policy(TrafficPolicy::Local)
        .health_check_node_port(HEALTH_PORT);
    fx.publish(&service, &[(BACKEND.1, "b")]);
    let via_b = reply_within(
        &fx,
        "client1",
        SocketAddrV4::new(NODE_B_IP, NODE_PORT),
        "ETP Local on B",
    );
    assert_eq!(
        (via_b.backend.as_str(), *via_b.peer.ip()),
        (BACKEND.0, CLIENT1.1),
        "{path:?}: ETP Local keeps the client's address"
    );
    // B's uplink translated it: at XDP, which passes a DNAT on to the stack.
    let translated = fx.counter(1, "xdp_translated");
    match path {
        Path::TcOnly => assert_eq!(translated, 0, "{path:?}: XDP is off, yet translated"),
        _ => assert!(
            translated > 0,
            "{path:?}: the flow on B was not translated at XDP; {}",
            fx.counters()
        ),
    }
    let via_a = tcp_request(
        fx.client("client1"),
        SocketAddrV4::new(NODE_A_IP, NODE_PORT),
        DROP_WAIT,
    );
    assert_eq!(
        via_a,
        Outcome::Timeout,
        "{path:?}: node A has no local endpoint and must drop"
    );
    assert!(
        fx.counter(0, "drop_no_endpoint") > 0,
        "node A must count the drop"
    );

    let health = |node: Ipv4Addr| {
        fx.client("client1")
            .run(|| http_get(SocketAddrV4::new(node, HEALTH_PORT), "/"))
            .expect("run in client")
            .unwrap_or_else(|e| panic!("health check on {node}: {e:#}"))
    };
    let (status_a, body_a) = health(NODE_A_IP);
    assert_eq!(
        status_a, 503,
        "health check on A (no local endpoint):\n{body_a}"
    );
    assert!(body_a.contains("\"localEndpoints\": 0"), "{body_a}");
    let (status_b, body_b) = health(NODE_B_IP);
    assert_eq!(
        status_b, 200,
        "health check on B (one local endpoint):\n{body_b}"
    );
    assert!(body_b.contains("\"localEndpoints\": 1"), "{body_b}");
    assert!(
        body_b
            .to_ascii_lowercase()
            .contains("x-load-balancing-endpoint-weight: 1"),
        "{body_b}"
    );
    assert!(body_b.contains("\"name\": \"local\""), "{body_b}");

    let pod = &fx.cluster.pod(LOCAL_BACKEND.0).ns;
    let from_pod = tcp_request(pod, SocketAddrV4::new(NODE_A_IP, NODE_PORT), DROP_WAIT);
    if cluster_cidr {
        let Outcome::Reply(r) = from_pod else {
            panic!(
                "{path:?}: a pod with --cluster-cidr: {from_pod}; {}",
                fx.counters()
            );
        };
        assert_eq!(
            (r.backend.as_str(), *r.peer.ip()),
            (BACKEND.0, LOCAL_BACKEND.1),
            "{path:?}: an in-cluster client reaches the remote endpoint with its own address"
        );
    } else {
        assert_eq!(
            from_pod,
            Outcome::Timeout,
            "{path:?}: without --cluster-cidr a pod is external"
        );
    }
}

#[test]
fn local_policy_native_xdp() {
    local_policy(Path::Native, true);
}

#[test]
fn local_policy_tc_only() {
    local_policy(Path::TcOnly, false);
}

/// A healthCheckNodePort that something else holds when the Service arrives
/// opens once it is freed, with nothing else changing: the agent retries it,
/// where the load balancer would otherwise see the node as one without
/// endpoints until the Services next change.
#[test]
fn health_check_port_opens_once_freed() {
    let fx = Fixture::new(Path::TcOnly);
    let squatter = fx
        .cluster
        .node("a")
        .ns
        .run(|| std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, HEALTH_PORT)))
        .and_then(|r| Ok(r?))
        .expect("holding the health check port on node A");
    let service = web("local")
        .type_(ServiceType::LoadBalancer)
        .external_traffic_policy(TrafficPolicy::Local)
        .health_check_node_port(HEALTH_PORT);
    fx.publish(&service, &[(BACKEND.1, "b")]);
    let health = |node: Ipv4Addr| {
        fx.client("client1")
            .run(|| http_get(SocketAddrV4::new(node, HEALTH_PORT), "/"))
            .expect("run in client")
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !fx.agents[0]
        .log()
        .contains("could not open health check node port")
    {
        assert!(
            Instant::now() < deadline,
            "node A's agent never tried the held port; its log:\n{}",
            fx.agents[0].log()
        );
        thread::sleep(Duration::from_millis(100));
    }
    drop(squatter);
    let deadline = Instant::now() + Duration::from_secs(15);
    let (status, body) = loop {
        match health(NODE_A_IP) {
            Ok(answer) => break answer,
            Err(e) => assert!(
                Instant::now() < deadline,
                "the health check port on A never opened once freed: {e:#}; agent log:\n{}",
                fx.agents[0].log()
            ),
        }
        thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        status, 503,
        "health check on A (no local endpoint):\n{body}"
    );
    assert!(body.contains("\"name\": \"local\""), "{body}");
}

/// A LoadBalancer IP with loadBalancerSourceRanges: client1 (inside) is served,
/// client2 (outside) is dropped. An ExternalIP is served too.
fn load_balancer_and_external_ip(path: Path) {
    let fx = Fixture::new(path);
    let service = web("lb")
        .type_(ServiceType::LoadBalancer)
        .load_balancer_ingress(LB_IP)
        .load_balancer_source_range(&format!("{}/32", CLIENT1.1))
        .external_ip(EXTERNAL_IP);
    fx.publish(&service, &[(BACKEND.1, "b")]);
    for client in [CLIENT1.0, CLIENT2.0] {
        for ip in [LB_IP, EXTERNAL_IP] {
            fx.cluster
                .route_via(client, &format!("{ip}/32"), "a")
                .expect("route to the LB IP via node A");
        }
    }
    let lb = reply_within(
        &fx,
        "client1",
        SocketAddrV4::new(LB_IP, 80),
        "LB IP from an allowed client",
    );
    assert_eq!((lb.backend.as_str(), *lb.peer.ip()), (BACKEND.0, NODE_A_IP));
    let denied = tcp_request(
        fx.client("client2"),
        SocketAddrV4::new(LB_IP, 80),
        DROP_WAIT,
    );
    assert_eq!(
        denied,
        Outcome::Timeout,
        "{path:?}: client2 is outside the source ranges"
    );
    assert!(
        fx.counter(0, "drop_source_range") > 0,
        "node A must count the drop"
    );
    for client in ["client1", "client2"] {
        let ext = tcp_request(
            fx.client(client),
            SocketAddrV4::new(EXTERNAL_IP, 80),
            TIMEOUT,
        )
        .expect_reply("ExternalIP (no source ranges)");
        assert_eq!(ext.backend, BACKEND.0, "{client} through the ExternalIP");
    }
}

#[test]
fn load_balancer_and_external_ip_native_xdp() {
    load_balancer_and_external_ip(Path::Native);
}

#[test]
fn load_balancer_and_external_ip_tc_only() {
    load_balancer_and_external_ip(Path::TcOnly);
}

/// 300 connections held open at once from one client through node A's SNAT: every
/// one is served, and the backend sees 300 distinct (node A, port) sources.
#[test]
fn concurrent_snat_flows_never_share_a_port() {
    const SESSIONS: usize = 300;
    let fx = Fixture::new(Path::Native);
    fx.publish(&web("many"), &[(BACKEND.1, "b")]);
    let addr = SocketAddrV4::new(NODE_A_IP, NODE_PORT);
    reply_within(&fx, "client1", addr, "NodePort on A");
    let sessions: Vec<TcpSession> = (0..SESSIONS)
        .map(|i| {
            TcpSession::open(fx.client("client1"), addr, TIMEOUT)
                .unwrap_or_else(|e| panic!("session {i} of {SESSIONS}: {e:#}"))
        })
        .collect();
    let sources: BTreeSet<SocketAddrV4> = sessions.iter().map(|s| s.greeting.peer).collect();
    assert!(
        sessions.iter().all(|s| *s.greeting.peer.ip() == NODE_A_IP),
        "every session must be SNATed to node A"
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
            .expect("exchange on an open session");
        assert_eq!(answer, format!("{} still there", BACKEND.0), "session {i}");
    }
    assert_eq!(fx.counter(0, "snat_exhausted"), 0);
}
