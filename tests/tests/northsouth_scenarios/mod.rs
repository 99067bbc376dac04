//! The scenarios of northsouth.rs and northsouth6.rs, once over the family
//! ([`Family`]): NodePorts, LoadBalancer IPs and ExternalIPs of a Service of one
//! family reached from clients outside the cluster, in the dual-stack two-node
//! topology of docs/architecture.md, "Test topologies" (`cluster`), with an agent on
//! each node. Each scenario runs with XDP on the uplinks (native on these veths, or
//! generic), which translates and sends back out what it can (checked by its
//! `xdp_tx` count) and leaves the rest to tc, or through tc alone (`--xdp-mode off`).
//!
//! Every scenario builds its own namespaces, bpffs roots and manifest directory, so
//! they run in parallel; everything is removed on drop, also when one fails.

use std::{
    collections::{BTreeMap, BTreeSet},
    marker::PhantomData,
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
};

use ebpf_proxy_tests::{
    POLL, Protocol,
    agent::{Agent, http_get},
    client::{
        Outcome, Peer, Reply, TIMEOUT, TcpSession, tcp_request, tcp_request_here,
        tcp_request_speaking_first, udp_request, udp_sized_request,
    },
    cluster::{CLIENT1, CLIENT2, Cluster},
    eventually,
    family::Family,
    flood::BURST,
    manifest::{ManifestDir, Service, ServiceType, TrafficPolicy},
    netns::NetNs,
    nftables, require_root,
    servers::{TcpServer, UdpServer},
    stats::chi_square_uniform,
    wait_for, wait_until,
};
use proxy_userspace::datapath::{Maps, PinLayout};

/// The backend pod on node b.
pub const BACKEND: (&str, Ipv4Addr) = ("web-b1", Ipv4Addr::new(10, 1, 2, 10));
/// The backend pod on node a.
pub const LOCAL_BACKEND: (&str, Ipv4Addr) = ("web-a1", Ipv4Addr::new(10, 1, 1, 10));
const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 5353;
pub const NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;
/// The healthCheckNodePort of the externalTrafficPolicy Local scenarios.
pub const HEALTH_PORT: u16 = 32100;
/// How long the agents may take to apply a manifest change before a scenario
/// gives up waiting for it (a condition waited for: a passing run takes what
/// the sync takes).
const SYNC_WAIT: Duration = Duration::from_secs(10);
/// A dropped connection attempt is given this long to (wrongly) succeed.
const DROP_WAIT: Duration = Duration::from_millis(700);
/// Significance level of the spread's chi-square test: a correct datapath fails it
/// about once in a thousand runs.
const ALPHA: f64 = 0.001;

/// The XDP settings the scenarios run under.
#[derive(Clone, Copy, Debug)]
pub enum Path {
    Native,
    Generic,
    /// `--xdp-mode auto`: native XDP on uplinks, none on veth uplinks (these):
    /// tc alone.
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

/// Two dual-stack nodes, two outside clients, a backend on each node serving TCP
/// and UDP on both families, and an agent on each node following one manifest
/// directory, started as family `F`'s scenarios start it.
pub struct Fixture<F: Family> {
    pub agents: Vec<Agent>,
    _servers: Vec<(TcpServer, UdpServer)>,
    manifests: ManifestDir,
    pub cluster: Cluster,
    family: PhantomData<F>,
}

impl<F: Family> Fixture<F> {
    pub fn new(path: Path) -> Fixture<F> {
        Fixture::with_args(path, &[])
    }

    /// [`Fixture::new`] with `args` for both agents.
    pub fn with_args(path: Path, args: &[&str]) -> Fixture<F> {
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
                let node_ip = F::node_ip_arg(n);
                let mut all = vec!["--xdp-mode", path.arg()];
                if let Some(ip) = &node_ip {
                    all.extend(["--node-ip", ip.as_str()]);
                }
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
            family: PhantomData,
        }
    }

    /// Node `node`'s address of the family.
    pub fn node_ip(&self, node: &str) -> F {
        F::uplink(self.cluster.node(node).ip)
    }

    /// Writes `service` with its endpoints, each on its node.
    pub fn publish(&self, service: &Service, endpoints: &[(F, &str)]) {
        let names: Vec<String> = endpoints
            .iter()
            .map(|(_, node)| self.cluster.node(node).ns.name().to_owned())
            .collect();
        let on_nodes: Vec<(F, &str)> = endpoints
            .iter()
            .zip(&names)
            .map(|((ip, _), name)| (*ip, name.as_str()))
            .collect();
        let file = format!("{}.yaml", service.name);
        let marks: Vec<usize> = self.agents.iter().map(Agent::log_mark).collect();
        self.manifests
            .write(&file, &F::yaml_on_nodes(service, &on_nodes))
            .expect("write manifest");
        // Both nodes have it in their maps before the scenario asks either:
        // a node asked before its sync answers as if it had no Service (its
        // stack refuses a NodePort that should have been dropped).
        for (agent, mark) in self.agents.iter().zip(marks) {
            agent.wait_synced_file_since(mark, &file, SYNC_WAIT);
        }
    }

    pub fn counter(&self, node: usize, name: &str) -> u64 {
        self.agents[node]
            .counter(name)
            .unwrap_or_else(|e| panic!("counter {name}: {e:#}"))
    }

    /// The non-zero counters of both nodes, for failure messages.
    pub fn counters(&self) -> String {
        let mut out = String::new();
        for (agent, node) in self.agents.iter().zip(["a", "b"]) {
            out.push_str(&format!("node {node}: {}; ", agent.nonzero_counters()));
        }
        out
    }

    pub fn client(&self, name: &str) -> &NetNs {
        &self.cluster.client(name).ns
    }

    /// Who translated node `node`'s traffic: with XDP on the uplinks, frames it
    /// sent back out itself (`xdp_tx`); with XDP off, none.
    #[track_caller]
    fn assert_xdp_did_the_work(&self, node: usize, path: Path) {
        let sent = self.counter(node, "xdp_tx");
        match path {
            Path::TcOnly | Path::Auto => assert_eq!(
                sent,
                0,
                "{path:?}: XDP is off on these veth uplinks, yet frames were sent back out by \
                 XDP; {}",
                self.counters()
            ),
            _ => assert!(
                sent > 0,
                "{path:?}: {} was translated, but not at XDP (no frame sent back out by it); {}",
                F::NAME,
                self.counters()
            ),
        }
    }

    /// Polls a TCP request from `client` until it gets a reply (the agents pick up a
    /// manifest change within a sync), then returns it.
    #[track_caller]
    pub fn reply_within(&self, client: &str, addr: F::Addr, what: &str) -> Reply<F::Addr> {
        self.reply_within_from(self.client(client), addr, what)
    }

    /// [`Fixture::reply_within`] from `ns`.
    #[track_caller]
    fn reply_within_from(&self, ns: &NetNs, addr: F::Addr, what: &str) -> Reply<F::Addr> {
        let waited = wait_for(SYNC_WAIT, POLL, || match tcp_request(ns, addr, TIMEOUT) {
            Outcome::Reply(r) => Ok(r),
            other => Err(format!("last outcome {other}")),
        });
        match waited {
            Ok((reply, _)) => reply,
            Err(last) => panic!(
                "{what}: no reply from {addr} within {SYNC_WAIT:?}, {last}; {}",
                self.counters()
            ),
        }
    }
}

/// `test/<name>` of family `F` on [`Family::vip`] 50: NodePort `http` 80/TCP -> 8080
/// on [`NODE_PORT`] and `dns` 53/UDP -> 5353 on [`UDP_NODE_PORT`].
pub fn web<F: Family>(name: &str) -> Service {
    F::service("test", name, F::vip(50))
        .type_(ServiceType::NodePort)
        .port("http", 80, Protocol::Tcp, TCP_PORT)
        .port("dns", 53, Protocol::Udp, UDP_PORT)
        .node_port("http", NODE_PORT)
        .node_port("dns", UDP_NODE_PORT)
}

/// externalTrafficPolicy Cluster with a backend on each node: new connections from
/// outside to node A's NodePort spread evenly over both (a chi-square test), the
/// local backend sees the client's own address, the remote one node A's address and
/// a port of the SNAT range; UDP likewise; node B the other way round; a long
/// connection through node A works packet after packet; a pod on node A reaches a
/// ClusterIP whose backend is on node B with its own address; a NodePort without
/// endpoints is refused at once; and node A's status shows its SNAT address, its
/// NodePort addresses and frontends, its clock and, with XDP on, its XDP link.
pub fn nodeport_cluster_policy<F: Family>(path: Path) {
    let fx = Fixture::<F>::new(path);
    let (node_a, node_b) = (fx.node_ip("a"), fx.node_ip("b"));
    let (client1, client2) = (F::uplink(CLIENT1.1), F::uplink(CLIENT2.1));
    // Published before the NodePort whose answer says the agents are in sync, so
    // that the pod's first connection to it finds it.
    let remote = F::service("test", "remote", F::vip(53)).port("http", 80, Protocol::Tcp, TCP_PORT);
    fx.publish(&remote, &[(F::pod(BACKEND.1), "b")]);
    fx.publish(
        &web::<F>("web"),
        &[(F::pod(LOCAL_BACKEND.1), "a"), (F::pod(BACKEND.1), "b")],
    );
    let via_a = F::addr(node_a, NODE_PORT);
    fx.reply_within("client1", via_a, &format!("{} NodePort on A", F::NAME));
    let to_remote = spread_through_node_a(&fx, path);

    // UDP, a new socket each: both backends answer, each seeing what TCP's did.
    let mut udp_seen = BTreeMap::new();
    for i in 0..40 {
        let outcome = udp_request(
            fx.client("client1"),
            F::addr(node_a, UDP_NODE_PORT),
            TIMEOUT,
        );
        let Outcome::Reply(r) = outcome else {
            panic!(
                "{path:?}: UDP NodePort on A, request {i}: {outcome}; {}",
                fx.counters()
            );
        };
        udp_seen.insert(r.backend, r.peer.peer_ip());
    }
    assert_eq!(
        udp_seen,
        BTreeMap::from([
            (LOCAL_BACKEND.0.to_owned(), client1),
            (BACKEND.0.to_owned(), node_a)
        ]),
        "{path:?}: UDP through node A: which backend saw which source"
    );

    // Through node B, the local and the remote backend swap places.
    let mut via_b_seen = BTreeMap::new();
    for i in 0..40 {
        let r =
            tcp_request(fx.client("client2"), F::addr(node_b, NODE_PORT), TIMEOUT).expect_reply(
                &format!("{path:?}: {} NodePort on B, connection {i}", F::NAME),
            );
        via_b_seen.insert(r.backend, r.peer.peer_ip());
    }
    assert_eq!(
        via_b_seen,
        BTreeMap::from([
            (LOCAL_BACKEND.0.to_owned(), node_b),
            (BACKEND.0.to_owned(), client2)
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

    // East-west across nodes: a pod on A to a ClusterIP whose backend is on B; the
    // reply enters A through its uplink (and XDP, when on) to be reverse-NATed.
    let pod = &fx.cluster.pod(LOCAL_BACKEND.0).ns;
    let east_west = fx.reply_within_from(
        pod,
        F::addr(F::vip(53), 80),
        "ClusterIP from a pod on A to the backend on B",
    );
    assert_eq!(
        (east_west.backend.as_str(), east_west.peer.peer_ip()),
        (BACKEND.0, F::pod(LOCAL_BACKEND.1)),
        "{path:?}: ClusterIP traffic keeps the pod's address across nodes"
    );

    refused_without_endpoints(&fx, path);

    let status = fx.agents[0].status().expect("ebpf-proxy status");
    let shown = [
        F::status_snat(node_a),
        format!("{node_a} (NodePorts)"),
        format!("{}/TCP", F::addr(F::UNSPECIFIED, NODE_PORT)),
        "datapath clock: jiffies x".to_owned(),
    ];
    let missing: Vec<&String> = shown.iter().filter(|s| !status.contains(*s)).collect();
    assert!(
        missing.is_empty(),
        "{path:?}: the status of node A lacks {missing:?}:\n{status}"
    );
    let xdp_link = status.contains("xdp-eth0");
    assert_eq!(
        xdp_link,
        !matches!(path, Path::TcOnly),
        "{path:?}: XDP link in status:\n{status}"
    );
    let snat = fx.counter(0, "snat_new");
    assert!(
        snat >= to_remote.max(3),
        "{path:?}: node A counted {snat} SNATed flows for {to_remote} connections to the \
         remote backend, expected 3 or more"
    );
    fx.assert_xdp_did_the_work(0, path);
    fx.assert_xdp_did_the_work(1, path);
}

/// New TCP connections from client1 to node A's NodePort, checked one by one (the
/// local backend sees client1, the remote one node A from a SNAT port) and as a
/// spread (uniform over both, by a chi-square test); returns how many reached the
/// remote backend.
fn spread_through_node_a<F: Family>(fx: &Fixture<F>, path: Path) -> u64 {
    const CONNECTIONS: usize = 400;
    let node_a = fx.node_ip("a");
    let client1 = F::uplink(CLIENT1.1);
    let via_a = F::addr(node_a, NODE_PORT);
    // One thread in the client for the whole batch.
    let replies: Vec<Outcome<F::Addr>> = fx
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
            failures.push(outcome.to_string());
            continue;
        };
        *counts.entry(r.backend.clone()).or_default() += 1;
        let snat_range = proxy_common::SNAT_PORT_MIN..=proxy_common::SNAT_PORT_MAX;
        let peer: SocketAddr = r.peer.into();
        let right = match r.backend.as_str() {
            b if b == LOCAL_BACKEND.0 => r.peer.peer_ip() == client1,
            b if b == BACKEND.0 => r.peer.peer_ip() == node_a && snat_range.contains(&peer.port()),
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
        "{path:?}: the local backend must see client1 ({client1}), the remote one node \
         A ({node_a}) from a SNAT port; {} did not, first: {:?}",
        wrong_peers.len(),
        &wrong_peers[..wrong_peers.len().min(5)]
    );
    let spread = [
        counts.get(LOCAL_BACKEND.0).copied().unwrap_or(0),
        counts.get(BACKEND.0).copied().unwrap_or(0),
    ];
    let chi = chi_square_uniform(&spread);
    eprintln!(
        "{path:?}: {CONNECTIONS} {} connections through node A: {} (local) {}, {} (remote) {}; \
         {chi}",
        F::NAME,
        LOCAL_BACKEND.0,
        spread[0],
        BACKEND.0,
        spread[1]
    );
    assert!(
        chi.passes(ALPHA),
        "{path:?}: the spread over the local and the remote backend {counts:?} is not \
         uniform at alpha {ALPHA}: {chi}"
    );
    spread[1]
}

/// A NodePort on node A whose Service has no endpoints is refused at once (a reset
/// from node A's datapath, as kube-proxy's REJECT; XDP leaves the reset to tc).
pub fn refused_without_endpoints<F: Family>(fx: &Fixture<F>, path: Path) {
    let closed_port = NODE_PORT + 10;
    let empty = F::service("test", "empty", F::vip(51))
        .type_(ServiceType::NodePort)
        .port("http", 80, Protocol::Tcp, TCP_PORT)
        .node_port("http", closed_port);
    fx.publish(&empty, &[]);
    let addr = F::addr(fx.node_ip("a"), closed_port);
    // The node's own stack refuses too until the agent has the Service: only the
    // datapath's count says who did.
    let refused = wait_until(SYNC_WAIT, POLL, || {
        match tcp_request(fx.client("client1"), addr, TIMEOUT) {
            Outcome::Refused if fx.counter(0, "reject") > 0 => Ok(()),
            Outcome::Refused => Err("refused, but not by node A's datapath".to_owned()),
            other => Err(format!("{other}")),
        }
    });
    if let Err(last) = refused {
        panic!(
            "{path:?}: an {} NodePort without endpoints, refused by node A's datapath: \
             still {last} after {SYNC_WAIT:?}; {}",
            F::NAME,
            fx.counters()
        );
    }
}

/// Fragmented UDP from outside through node A's NodePort to the backend on node B
/// (SNAT to node A, the source port chosen by the datapath): 4,000-byte requests
/// and 4,000-byte answers, every fragment of both translated, answers whole and
/// from the NodePort, with the client's own address seen by no one but node A; with
/// XDP on, translated and sent back out there.
pub fn nodeport_fragments<F: Family>(path: Path) {
    const EXCHANGES: usize = 10;
    let fx = Fixture::<F>::new(path);
    let node_a = fx.node_ip("a");
    fx.publish(&web::<F>("web"), &[(F::pod(BACKEND.1), "b")]);
    fx.reply_within(
        "client1",
        F::addr(node_a, NODE_PORT),
        &format!("{} NodePort on A", F::NAME),
    );
    let addr = F::addr(node_a, UDP_NODE_PORT);
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
                    "{path:?}: fragmented {what} over {}, exchange {i}: {outcome}; {}",
                    F::NAME,
                    fx.counters()
                );
            };
            assert_eq!(
                (reply.backend.as_str(), reply.peer.peer_ip()),
                (BACKEND.0, node_a),
                "{path:?}: fragmented {what}: the remote backend must see node A (SNAT)"
            );
        }
    }
    if !retried.is_empty() {
        eprintln!("{path:?}: exchanges answered on their retry: {retried:?}");
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

/// From outside, a UDP NodePort whose backend, on the other node (SNAT), listens on
/// no such port: the backend's kernel sends an ICMP port unreachable of the family
/// to node A quoting node A's SNAT port; node A's uplink translates it back (quoting
/// the NodePort, from the NodePort address) and routes it to the client, whose
/// connected socket fails at once with "connection refused" instead of waiting out
/// its timeout.
pub fn nodeport_closed_port_is_refused<F: Family>(path: Path) {
    const EXCHANGES: usize = 10;
    const CLOSED_NODE_PORT: u16 = 30054;
    let fx = Fixture::<F>::new(path);
    let node_a = fx.node_ip("a");
    let closed = F::service("test", "closed", F::vip(52))
        .type_(ServiceType::NodePort)
        .port("dns", 53, Protocol::Udp, 5999)
        .node_port("dns", CLOSED_NODE_PORT);
    fx.publish(&web::<F>("web"), &[(F::pod(BACKEND.1), "b")]);
    fx.publish(&closed, &[(F::pod(BACKEND.1), "b")]);
    fx.reply_within(
        "client1",
        F::addr(node_a, NODE_PORT),
        &format!("{} NodePort on A", F::NAME),
    );
    fx.cluster
        .pod(BACKEND.0)
        .ns
        .sysctl(F::ICMP_RATELIMIT, "0")
        .unwrap_or_else(|e| panic!("lifting the backend's {} ICMP rate limit: {e:#}", F::NAME));
    let addr: SocketAddr = F::addr(node_a, CLOSED_NODE_PORT).into();
    let exchange = || {
        fx.client("client1")
            .run(|| {
                let s = std::net::UdpSocket::bind(F::any(0))?;
                s.connect(addr)?;
                s.set_read_timeout(Some(Duration::from_millis(500)))?;
                s.send(b"anyone there?")?;
                s.recv(&mut [0u8; 64])
            })
            .expect("client1")
    };
    let refusal = |answer: std::io::Result<usize>| match answer {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(()),
        other => Err(format!("{other:?}")),
    };
    // The agents may not have the Service yet: until the first refusal.
    let mut outcomes = Vec::new();
    let first = wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
        refusal(exchange()).inspect_err(|other| outcomes.push(other.clone()))
    });
    if let Err(last) = first {
        panic!(
            "{path:?}: exchange 0: {last} instead of connection refused \
             (earlier: {outcomes:?}); {}",
            fx.counters()
        );
    }
    for refused in 1..EXCHANGES {
        if let Err(other) = refusal(exchange()) {
            panic!(
                "{path:?}: exchange {refused}: {other} instead of connection refused \
                 (before the first refusal: {outcomes:?}); {}",
                fx.counters()
            );
        }
    }
    let translated = fx.counter(0, "icmp_error_translated");
    assert!(
        translated >= EXCHANGES as u64,
        "{path:?}: {translated} {} ICMP errors translated on node A for {EXCHANGES} refusals; {}",
        F::NAME,
        fx.counters()
    );
    // The requests went out through XDP; the errors, left to tc, came back
    // through it.
    fx.assert_xdp_did_the_work(0, path);
}

/// From outside, a SYN flood to a NodePort whose backend is on the other node (SNAT)
/// cannot cut the connections already established through it: with `--conntrack-max
/// 1024`, 30 idle connections through node A keep their backend while another client
/// sends 20,000 SYNs from ever new ports (at least ten times the connections conntrack
/// holds reach node A; the backend answers each, the flooding client's kernel resets
/// each), and new connections made during the flood are served. Fewer SYNs than the
/// 28,976 SNAT ports: each takes one until a second after its reset, and a faster
/// flood of more would exhaust them, which is another limit than the one this test is
/// about.
///
/// The flood fills the backend's SYN queue, so the backend answers with SYN cookies,
/// which keep no state: when the handshake's last ACK is lost on the loaded veths, the
/// backend never retransmits, and a client waiting for the greeting would wait until
/// it sent something (runs saw exactly that: the backend greeted a connection only
/// when its client's FIN arrived, 2 s after the handshake). So these clients speak
/// first, as most protocols do, and their data completes such a handshake; and they
/// wait long enough for TCP's own recovery from a lost SYN or two.
pub fn nodeport_syn_flood<F: Family>(path: Path) {
    /// Past the second SYN retransmission (1 s, then 3 s after the first SYN).
    const FLOOD_TIMEOUT: Duration = Duration::from_secs(5);
    const SYNS: u32 = 20_000;
    let fx = Fixture::<F>::with_args(path, &["--conntrack-max", "1024"]);
    fx.publish(&web::<F>("web"), &[(F::pod(BACKEND.1), "b")]);
    let addr = F::addr(fx.node_ip("a"), NODE_PORT);
    fx.reply_within("client1", addr, &format!("{} NodePort on A", F::NAME));
    let mut sessions: Vec<TcpSession<F::Addr>> = (0..30)
        .map(|i| {
            TcpSession::open(fx.client("client1"), addr, TIMEOUT)
                .unwrap_or_else(|e| panic!("{path:?}: connection {i}: {e:#}"))
        })
        .collect();
    let client2 = F::uplink(CLIENT2.1);
    let node_a = fx.agents[0].bpf_root().to_owned();
    let flood = fx
        .client("client2")
        .spawn("syn-flood", move || {
            let mut pace = FloodPace::of(&node_a)?;
            let sent = F::syn_flood_here(client2, addr, SYNS, |sent| pace.wait(sent))?;
            anyhow::Ok((sent, pace.lost))
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
    let (sent, lost) = flood
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
    eprintln!(
        "{path:?}: {new_flows} new {} flows on node A from {SYNS} SYNs sent ({lost} lost on \
         the way)",
        F::NAME
    );
    assert!(
        new_flows >= 10 * 1024,
        "{path:?}: only {new_flows} new flows reached node A's datapath from {SYNS} SYNs \
         ({lost} lost on the way), less than ten times what conntrack holds"
    );
    fx.assert_xdp_did_the_work(0, path);
}

/// A flood's pacing by the datapath it floods: after each burst, the flood goes
/// on once that node's `ct_new_flow` count shows everything sent but the last two
/// bursts, which keeps at most three in flight (192 frames, within a veth's
/// queue of 256) whatever the machine's speed or load. What a queue dropped never shows: frames still missing after
/// [`FloodPace::LOST_AFTER`] are written off as lost, and the flood goes on.
struct FloodPace {
    maps: Maps,
    base: u64,
    lost: u32,
}

impl FloodPace {
    /// Far longer than a node takes to drain two bursts, even a loaded one.
    const LOST_AFTER: Duration = Duration::from_millis(500);

    fn of(bpf_root: &std::path::Path) -> anyhow::Result<FloodPace> {
        let maps = Maps::open_pinned(&PinLayout::new(bpf_root))?;
        let base = Self::new_flows(&maps)?;
        Ok(FloodPace {
            maps,
            base,
            lost: 0,
        })
    }

    /// `ct_new_flow` alone: one lookup, where reading every counter takes
    /// dozens, between every two bursts.
    fn new_flows(maps: &Maps) -> anyhow::Result<u64> {
        let per_cpu = maps.counters.get(&proxy_common::counter::CT_NEW_FLOW, 0)?;
        Ok(per_cpu.iter().sum())
    }

    fn wait(&mut self, sent: u32) {
        let mut seen = 0;
        let caught_up = wait_until(Self::LOST_AFTER, Duration::from_micros(100), || {
            let now = Self::new_flows(&self.maps).map_err(|e| format!("{e:#}"))?;
            seen = u32::try_from(now.saturating_sub(self.base)).unwrap_or(u32::MAX);
            // Frames written off that arrive after all give their allowance back.
            self.lost = self.lost.min(sent.saturating_sub(seen));
            if seen + self.lost + 2 * BURST >= sent {
                Ok(())
            } else {
                Err(format!("{seen} of {sent}"))
            }
        });
        if caught_up.is_err() {
            self.lost = sent.saturating_sub(seen + 2 * BURST);
        }
    }
}

/// Veth uplinks fed with partial checksums (transmit offload on, as between
/// containers of one host, kind-style): `--xdp-mode auto` puts no XDP on a veth
/// (native XDP could not finish those checksums, and generic XDP costs more than
/// tc), so tc translates, and the traffic keeps valid checksums, TCP and UDP.
pub fn nodeport_auto_xdp_with_partial_checksums<F: Family>() {
    let fx = Fixture::<F>::new(Path::Auto);
    for ns in [fx.client("client1"), &fx.cluster.node("b").ns] {
        ebpf_proxy_tests::cluster::set_tx_checksum_offload(ns, true).expect("offload on");
    }
    let log = fx.agents[0].log();
    assert!(
        log.contains("no XDP on this veth uplink") && !log.contains("(\"eth0\", \""),
        "auto on a veth uplink must leave it to tc; agent log:\n{log}"
    );
    fx.publish(&web::<F>("web"), &[(F::pod(BACKEND.1), "b")]);
    let node_a = fx.node_ip("a");
    let addr = F::addr(node_a, NODE_PORT);
    let first = fx.reply_within("client1", addr, &format!("{} NodePort on A", F::NAME));
    assert_eq!(
        first.peer.peer_ip(),
        node_a,
        "the remote backend sees node A"
    );
    for i in 0..20 {
        tcp_request(fx.client("client1"), addr, TIMEOUT)
            .expect_reply(&format!("{} connection {i} through tc", F::NAME));
    }
    let udp = udp_request(
        fx.client("client1"),
        F::addr(node_a, UDP_NODE_PORT),
        TIMEOUT,
    );
    let Outcome::Reply(udp) = udp else {
        panic!("UDP over {} through tc: {udp}; {}", F::NAME, fx.counters());
    };
    assert_eq!(udp.backend, BACKEND.0);
    fx.assert_xdp_did_the_work(0, Path::Auto);
}

/// externalTrafficPolicy Local on a LoadBalancer Service: node B, with the endpoint,
/// serves keeping the client's own address; node A, without one, drops (and counts
/// it); the healthCheckNodePort says so (503 on A, 200 with the weight on B). A pod
/// on node A is an in-cluster client when the agents know the cluster CIDR of the
/// family: then it is served through every endpoint with its own address
/// (kube-proxy's short-circuit); without it, it is external and dropped like
/// client1. With `--detect-local-mode NodeCIDR` the agents know it from
/// their Nodes' `spec.podCIDRs` instead, once the Nodes say so.
pub fn local_policy<F: Family>(path: Path, detector: LocalDetector) {
    let args = detector.args::<F>();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let fx = Fixture::<F>::with_args(path, &args);
    if detector == LocalDetector::NodeCidr {
        publish_nodes_with_pod_cidrs(&fx, path);
    }
    let cluster_cidr = detector != LocalDetector::None;
    let (node_a, node_b) = (fx.node_ip("a"), fx.node_ip("b"));
    let service = web::<F>("local")
        .type_(ServiceType::LoadBalancer)
        .external_traffic_policy(TrafficPolicy::Local)
        .health_check_node_port(HEALTH_PORT);
    fx.publish(&service, &[(F::pod(BACKEND.1), "b")]);
    let via_b = fx.reply_within("client1", F::addr(node_b, NODE_PORT), "ETP Local on B");
    assert_eq!(
        (via_b.backend.as_str(), via_b.peer.peer_ip()),
        (BACKEND.0, F::uplink(CLIENT1.1)),
        "{path:?}: ETP Local keeps the client's {} address",
        F::NAME
    );
    // B's uplink translated it: at XDP, which passes a DNAT on to the stack.
    let translated = fx.counter(1, "xdp_translated");
    match path {
        Path::TcOnly => assert_eq!(translated, 0, "{path:?}: XDP is off, yet translated"),
        _ => assert!(
            translated > 0,
            "{path:?}: the {} flow on B was not translated at XDP; {}",
            F::NAME,
            fx.counters()
        ),
    }
    let via_a = tcp_request(fx.client("client1"), F::addr(node_a, NODE_PORT), DROP_WAIT);
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

    let health = |node: F| {
        fx.client("client1")
            .run(|| http_get(F::addr(node, HEALTH_PORT), "/"))
            .expect("run in client")
            .unwrap_or_else(|e| panic!("{path:?}: health check on {node}: {e:#}"))
    };
    let (status_a, body_a) = health(node_a);
    assert_eq!(
        status_a,
        503,
        "health check on A's {} address (no local endpoint):\n{body_a}",
        F::NAME
    );
    assert!(body_a.contains("\"localEndpoints\": 0"), "{body_a}");
    let (status_b, body_b) = health(node_b);
    assert_eq!(
        status_b,
        200,
        "health check on B's {} address (one local endpoint):\n{body_b}",
        F::NAME
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
    let from_pod = tcp_request(pod, F::addr(node_a, NODE_PORT), DROP_WAIT);
    if cluster_cidr {
        let Outcome::Reply(r) = from_pod else {
            panic!(
                "{path:?}: a pod in {} ({detector:?}): {from_pod}; {}",
                F::CLUSTER_CIDR,
                fx.counters()
            );
        };
        assert_eq!(
            (r.backend.as_str(), r.peer.peer_ip()),
            (BACKEND.0, F::pod(LOCAL_BACKEND.1)),
            "{path:?}: an in-cluster {} client reaches the remote endpoint with its own \
             address",
            F::NAME
        );
    } else {
        assert_eq!(
            from_pod,
            Outcome::Timeout,
            "{path:?}: without --cluster-cidr a pod is external; {}",
            fx.counters()
        );
    }
}

/// `--masquerade-all`, as kube-proxy's: every new flow to a Service is SNATed
/// to the node. A pod on node A reaching a ClusterIP whose backend is on
/// node B is seen by it as node A (without the flag, as itself: see
/// `nodeport_cluster_policy`), over TCP and UDP; a client outside reaching
/// the NodePort through node A likewise; and a connection keeps working
/// packet after packet, its replies translated back.
pub fn masquerade_all<F: Family>(path: Path) {
    let fx = Fixture::<F>::with_args(path, &["--masquerade-all"]);
    let node_a = fx.node_ip("a");
    let remote = web::<F>("remote");
    fx.publish(&remote, &[(F::pod(BACKEND.1), "b")]);
    let pod = &fx.cluster.pod(LOCAL_BACKEND.0).ns;
    let east_west = fx.reply_within_from(
        pod,
        F::addr(F::vip(50), 80),
        "ClusterIP from a pod on A to the backend on B",
    );
    assert_eq!(
        (east_west.backend.as_str(), east_west.peer.peer_ip()),
        (BACKEND.0, node_a),
        "{path:?}: with --masquerade-all the backend sees node A, not the pod"
    );
    let udp = udp_request(pod, F::addr(F::vip(50), 53), TIMEOUT);
    let Outcome::Reply(udp) = udp else {
        panic!(
            "{path:?}: UDP to the ClusterIP from a pod on A: {udp}; {}",
            fx.counters()
        );
    };
    assert_eq!(
        (udp.backend.as_str(), udp.peer.peer_ip()),
        (BACKEND.0, node_a),
        "{path:?}: UDP with --masquerade-all"
    );
    let outside = fx.reply_within(
        "client1",
        F::addr(node_a, NODE_PORT),
        "NodePort on A from outside",
    );
    assert_eq!(
        (outside.backend.as_str(), outside.peer.peer_ip()),
        (BACKEND.0, node_a),
        "{path:?}: NodePort with --masquerade-all"
    );
    let mut session = TcpSession::open(pod, F::addr(F::vip(50), 80), TIMEOUT)
        .unwrap_or_else(|e| panic!("{path:?}: a long connection from the pod: {e}"));
    for i in 0..20 {
        let answer = session
            .exchange(&format!("ping {i}"))
            .unwrap_or_else(|e| panic!("{path:?}: exchange {i} over the masqueraded flow: {e}"));
        assert_eq!(answer, format!("{} ping {i}", BACKEND.0));
    }
    assert!(
        fx.counter(0, "snat_new") >= 3,
        "{path:?}: node A SNATed fewer than the three new flows; {}",
        fx.counters()
    );
}

/// The answer to a flow netfilter masqueraded to one of node A's NodePorts is
/// the masqueraded flow's, as kube-proxy's node leaves it (conntrack takes it as
/// the reply before any NAT rule): a pod on A reaches servers outside through a
/// rule of node A's that SNATs its flows to A's address and a NodePort (as a CNI's
/// `--random-fully` masquerade may pick one), and gets their answers, UDP and
/// TCP (whose first answer is a SYN-ACK), where node A's frontend would have taken
/// each answer for a new flow to the NodePort and sent it to a backend.
pub fn masqueraded_answers_to_a_node_port<F: Family>(path: Path) {
    const UDP_OUT: u16 = 7000;
    const TCP_OUT: u16 = 7001;
    let fx = Fixture::<F>::new(path);
    let node_a = fx.node_ip("a");
    let client1 = F::uplink(CLIENT1.1);
    fx.publish(
        &web::<F>("web"),
        &[(F::pod(LOCAL_BACKEND.1), "a"), (F::pod(BACKEND.1), "b")],
    );
    fx.reply_within("client1", F::addr(node_a, NODE_PORT), "NodePort on A");
    let outside = fx.client("client1");
    let _servers = (
        UdpServer::start(outside, "outside", UDP_OUT).expect("UDP server outside"),
        TcpServer::start(outside, "outside", TCP_OUT).expect("TCP server outside"),
    );
    let (family, node) = (F::NFT_FAMILY, F::addr(node_a, 0).to_string());
    let node = node.strip_suffix(":0").expect("a socket address at port 0");
    let rules = format!(
        "table {family} fixed_masquerade {{\n\
         \tchain postrouting {{\n\
         \t\ttype nat hook postrouting priority srcnat; policy accept;\n\
         \t\t{family} daddr {client1} udp dport {UDP_OUT} snat to {node}:{UDP_NODE_PORT}\n\
         \t\t{family} daddr {client1} tcp dport {TCP_OUT} snat to {node}:{NODE_PORT}\n\
         \t}}\n\
         }}\n"
    );
    nftables::load(&fx.cluster.node("a").ns, &rules)
        .unwrap_or_else(|e| panic!("node A's masquerade rule: {e:#}"));
    let pod = &fx.cluster.pod(LOCAL_BACKEND.0).ns;
    let passed_before = fx.counter(0, "netfilter_pass");
    let new_before = fx.counter(0, "dnat_new");
    for (what, outcome, port) in [
        (
            "UDP",
            udp_request(pod, F::addr(client1, UDP_OUT), TIMEOUT),
            UDP_NODE_PORT,
        ),
        (
            "TCP",
            tcp_request(pod, F::addr(client1, TCP_OUT), TIMEOUT),
            NODE_PORT,
        ),
    ] {
        let Outcome::Reply(reply) = outcome else {
            panic!(
                "{path:?}: {what} from a pod on A to a server outside, masqueraded to A's \
                 NodePort {port}: {outcome} (its answer taken for a new flow to the NodePort?); \
                 {}",
                fx.counters()
            );
        };
        assert_eq!(
            (reply.backend.as_str(), reply.peer),
            ("outside", F::addr(node_a, port)),
            "{path:?}: {what}: who answered, and whom the server outside saw"
        );
    }
    let passed = fx.counter(0, "netfilter_pass") - passed_before;
    assert!(
        passed >= 2,
        "{path:?}: node A left {passed} packets to netfilter, fewer than the two answers; {}",
        fx.counters()
    );
    assert_eq!(
        fx.counter(0, "dnat_new"),
        new_before,
        "{path:?}: node A took an answer for a new flow; {}",
        fx.counters()
    );
}

/// Off-cluster clients of a ClusterIP are masqueraded where a local traffic
/// detector is configured, as kube-proxy's `! -s <cluster CIDR> -d
/// <ClusterIP> -j KUBE-MARK-MASQ`: an outside client routed to a ClusterIP
/// through node A reaches the backend on node B as node A (whose replies
/// then come back through A, to be translated back), while a pod on A, in
/// the cluster CIDR, keeps its own address.
pub fn off_cluster_clients_of_a_cluster_ip<F: Family>(path: Path) {
    let fx = Fixture::<F>::with_args(path, &["--cluster-cidr", F::CLUSTER_CIDR]);
    let node_a = fx.node_ip("a");
    let remote = F::service("test", "remote", F::vip(53)).port("http", 80, Protocol::Tcp, TCP_PORT);
    fx.publish(&remote, &[(F::pod(BACKEND.1), "b")]);
    F::route_via(&fx.cluster, "client1", F::vip(53), "a")
        .unwrap_or_else(|e| panic!("route the ClusterIP through node A: {e:#}"));
    let pod = &fx.cluster.pod(LOCAL_BACKEND.0).ns;
    let from_pod = fx.reply_within_from(
        pod,
        F::addr(F::vip(53), 80),
        "ClusterIP from a pod on A to the backend on B",
    );
    assert_eq!(
        (from_pod.backend.as_str(), from_pod.peer.peer_ip()),
        (BACKEND.0, F::pod(LOCAL_BACKEND.1)),
        "{path:?}: an in-cluster client of a ClusterIP keeps its address"
    );
    let outside = fx.reply_within(
        "client1",
        F::addr(F::vip(53), 80),
        "ClusterIP from outside through node A",
    );
    assert_eq!(
        (outside.backend.as_str(), outside.peer.peer_ip()),
        (BACKEND.0, node_a),
        "{path:?}: an off-cluster client of a ClusterIP is masqueraded to node A"
    );
    let mut session = TcpSession::open(fx.client("client1"), F::addr(F::vip(53), 80), TIMEOUT)
        .unwrap_or_else(|e| panic!("{path:?}: a long connection from outside: {e}"));
    for i in 0..20 {
        let answer = session
            .exchange(&format!("ping {i}"))
            .unwrap_or_else(|e| panic!("{path:?}: exchange {i} over the masqueraded flow: {e}"));
        assert_eq!(answer, format!("{} ping {i}", BACKEND.0));
    }
}

/// The name of pod `pod`'s host-side interface on its node: `v<i>-<pod>`,
/// cut to the kernel's 15 bytes (tests/src/cluster.rs).
fn pod_interface(pod: &str) -> String {
    format!("v0-{pod}").chars().take(15).collect()
}

/// Writes both Nodes with the family's pod CIDRs (`spec.podCIDRs`), and
/// waits until node A's agent holds them (`--detect-local-mode NodeCIDR`).
fn publish_nodes_with_pod_cidrs<F: Family>(fx: &Fixture<F>, path: Path) {
    let pod_cidrs: Vec<String> = F::CLUSTER_CIDR
        .split(',')
        .map(|cidr| format!("\"{cidr}\""))
        .collect();
    let nodes: Vec<String> = ["a", "b"]
        .iter()
        .map(|node| {
            format!(
                "apiVersion: v1\nkind: Node\nmetadata:\n  name: {}\nspec:\n  podCIDRs: [{}]\n",
                fx.cluster.node(node).ns.name(),
                pod_cidrs.join(", ")
            )
        })
        .collect();
    fx.manifests
        .write("nodes.yaml", &nodes.join("---\n"))
        .expect("write the Nodes");
    // Node A's agent holds the Node's pod CIDRs once it has read them.
    eventually(
        &format!("{path:?}: node A's agent holding its Node's pod CIDRs"),
        Duration::from_secs(15),
        || {
            let held = Maps::open_pinned(&PinLayout::new(fx.agents[0].bpf_root()))
                .map_or(0, |maps| maps.cluster_cidrs.keys().count());
            if held == pod_cidrs.len() {
                Ok(())
            } else {
                Err(format!("{held} of {} held", pod_cidrs.len()))
            }
        },
    );
}

/// How the agents tell in-cluster clients (kube-proxy's local traffic
/// detector).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalDetector {
    /// None: every client of an external address is external.
    None,
    /// `--cluster-cidr`.
    ClusterCidr,
    /// `--detect-local-mode NodeCIDR`: the Nodes' `spec.podCIDRs`.
    NodeCidr,
    /// `--detect-local-mode InterfaceNamePrefix`: packets arriving on an
    /// interface whose name starts with the prefix.
    InterfaceNamePrefix,
    /// `--detect-local-mode BridgeInterface`: packets arriving on the named
    /// interface.
    BridgeInterface,
}

impl LocalDetector {
    /// The agents' flags for this detector.
    fn args<F: Family>(self) -> Vec<String> {
        let args: Vec<&str> = match self {
            LocalDetector::None => vec![],
            LocalDetector::ClusterCidr => vec!["--cluster-cidr", F::CLUSTER_CIDR],
            LocalDetector::NodeCidr => vec!["--detect-local-mode", "NodeCIDR"],
            // Pods' host-side interfaces are `v<i>-<pod>` (tests/src/cluster.rs).
            LocalDetector::InterfaceNamePrefix => vec![
                "--detect-local-mode",
                "InterfaceNamePrefix",
                "--pod-interface-name-prefix",
                "v",
            ],
            // The one interface the pod's packets arrive on, as a bridge's
            // would: matched by its name alone, as a bridge is.
            LocalDetector::BridgeInterface => {
                return [
                    "--detect-local-mode",
                    "BridgeInterface",
                    "--pod-bridge-interface",
                ]
                .iter()
                .map(ToString::to_string)
                .chain([pod_interface(LOCAL_BACKEND.0)])
                .collect();
            }
        };
        args.into_iter().map(str::to_owned).collect()
    }
}

/// A LoadBalancer IP with loadBalancerSourceRanges of the family: client1 (inside
/// them) is served through node A, SNATed to the backend on node B; client2 (outside
/// them) is dropped, and counted. An ExternalIP, without source ranges, serves both
/// the same way.
pub fn load_balancer_and_external_ip<F: Family>(path: Path) {
    let fx = Fixture::<F>::new(path);
    let node_a = fx.node_ip("a");
    let (lb_ip, external_ip) = (F::external(10), F::external(20));
    let service = web::<F>("lb")
        .type_(ServiceType::LoadBalancer)
        .load_balancer_ingress(lb_ip)
        .load_balancer_source_range(&format!("{}/{}", F::uplink(CLIENT1.1), F::HOST_PREFIX))
        .external_ip(external_ip);
    fx.publish(&service, &[(F::pod(BACKEND.1), "b")]);
    for client in [CLIENT1.0, CLIENT2.0] {
        for ip in [lb_ip, external_ip] {
            F::route_via(&fx.cluster, client, ip, "a")
                .unwrap_or_else(|e| panic!("{client}: route to {ip} via node A: {e:#}"));
        }
    }
    let lb = fx.reply_within(
        "client1",
        F::addr(lb_ip, 80),
        &format!("{} LB IP from an allowed client", F::NAME),
    );
    assert_eq!(
        (lb.backend.as_str(), lb.peer.peer_ip()),
        (BACKEND.0, node_a),
        "{path:?}: through node A the remote backend sees node A's address (SNAT)"
    );
    let denied = tcp_request(fx.client("client2"), F::addr(lb_ip, 80), DROP_WAIT);
    assert_eq!(
        denied,
        Outcome::Timeout,
        "{path:?}: client2 ({}) is outside the source ranges; {}",
        F::uplink(CLIENT2.1),
        fx.counters()
    );
    assert!(
        fx.counter(0, "drop_source_range") > 0,
        "{path:?}: node A must count the drop; {}",
        fx.counters()
    );
    for client in [CLIENT1.0, CLIENT2.0] {
        let ext = tcp_request(fx.client(client), F::addr(external_ip, 80), TIMEOUT).expect_reply(
            &format!(
                "{path:?}: {client} to the {} ExternalIP (no source ranges)",
                F::NAME
            ),
        );
        assert_eq!(
            (ext.backend.as_str(), ext.peer.peer_ip()),
            (BACKEND.0, node_a),
            "{path:?}: {client} through the ExternalIP"
        );
    }
    fx.assert_xdp_did_the_work(0, path);
}

/// 300 connections held open at once from one client through node A's SNAT: every
/// one is served, and the backend sees 300 distinct (node A, port) sources.
pub fn concurrent_snat_flows_never_share_a_port<F: Family>() {
    const SESSIONS: usize = 300;
    let fx = Fixture::<F>::new(Path::Native);
    fx.publish(&web::<F>("many"), &[(F::pod(BACKEND.1), "b")]);
    let node_a = fx.node_ip("a");
    let addr = F::addr(node_a, NODE_PORT);
    fx.reply_within("client1", addr, &format!("{} NodePort on A", F::NAME));
    let sessions: Vec<TcpSession<F::Addr>> = (0..SESSIONS)
        .map(|i| {
            TcpSession::open(fx.client("client1"), addr, TIMEOUT)
                .unwrap_or_else(|e| panic!("session {i} of {SESSIONS}: {e:#}; {}", fx.counters()))
        })
        .collect();
    let sources: BTreeSet<SocketAddr> = sessions.iter().map(|s| s.greeting.peer.into()).collect();
    assert!(
        sessions.iter().all(|s| s.greeting.peer.peer_ip() == node_a),
        "every session must be SNATed to node A's {} address: {sources:?}",
        F::NAME
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
