//! Direct server return on real packets: `ebpf-proxy run --lb-mode dsr` (and
//! `hybrid`, DSR for TCP and SNAT for UDP) with `--lb-algorithm maglev`, in the
//! two-node world of docs/architecture.md ("Test topologies", `cluster`):
//!
//! ```text
//!   client1 192.168.50.100   (routes the ExternalIPs via node a; moved to node b
//!        |                    and back mid-connection by the survival tests)
//!   bridge 192.168.50.0/24 ------------------+
//!        |                                   |
//!   node a 192.168.50.1                 node b 192.168.50.2
//!   agent --lb-mode <mode>              agent --lb-mode <mode>
//!        |                                   |
//!   pod dsr-a1 10.1.1.10                pod dsr-b1 10.1.2.10
//!
//!   DSR, request: client1 -> node a (DNAT, IP option) -> node b -> dsr-b1
//!        replies: dsr-b1 -> node b (source ExternalIP:80) -> client1
//! ```
//!
//! `test/dsr-web` has the ExternalIP [`Family::external`] 10: port 80/TCP to the
//! pods' [`TcpServer`] on 8080 and 53/UDP to their [`UdpServer`] on 5353, one
//! endpoint on each node. `test/dsr-bulk` has the ExternalIP [`Family::external`]
//! 11: port 80/TCP to a [`BulkServer`] on dsr-b1 alone, so that every download
//! through node a is served from the other node. Client1 reaches both ExternalIPs
//! through node a. An agent on each node runs the mode under test.
//!
//! A flow through node a to dsr-b1 is the DSR case: node a DNATs it and tells node
//! b the frontend in an IP option; node b's backend answers the client straight
//! from node b, as the ExternalIP. The backend therefore sees the client's own
//! address (under SNAT it would see node a's), node a never translates a reply
//! (`rev_nat` stays put) and its uplink carries the client's ACKs only, not the
//! download. Maglev makes every node pick the same backend for a 5-tuple, so a
//! connection survives its route moving to node b and node a's agent restarting
//! without its conntrack. The `snat` control runs the same measurements and finds
//! the opposite, so the assertions can fail. The `ipv6_` tests run the same over
//! IPv6 (every address above has its `fd00:` twin, [`Family`]), in test
//! functions of their own.
//!
//! Every test builds its own namespaces, bpffs roots and manifest directory, so
//! they run in parallel; everything is removed on drop, also when a test fails.

use std::{
    collections::BTreeMap,
    marker::PhantomData,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use ebpf_proxy_tests::{
    POLL, Protocol,
    agent::Agent,
    bulk::{self, BulkServer, Limits},
    client::{Outcome, Peer, Reply, TIMEOUT, TcpSession, tcp_request, udp_request},
    cluster::{CLIENT1, Cluster},
    family::Family,
    manifest::ManifestDir,
    netns::NetNs,
    require_root,
    servers::{TcpServer, UdpServer},
    wait_for,
};

const POD_A: (&str, Ipv4Addr) = ("dsr-a1", Ipv4Addr::new(10, 1, 1, 10));
const POD_B: (&str, Ipv4Addr) = ("dsr-b1", Ipv4Addr::new(10, 1, 2, 10));
const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 5353;
const BULK_PORT: u16 = 9000;
/// The ExternalIPs' ports.
const HTTP: u16 = 80;
const DNS: u16 = 53;
/// One download: far more than node a's uplink carries for the client's ACKs.
const BULK: u64 = 8 << 20;
/// Generous: a working path moves the 8 MiB in well under a second.
const LIMITS: Limits = Limits {
    within: Duration::from_mins(1),
    stall: Duration::from_secs(15),
};
/// Replies from the other node's backend that a test looks at; with two
/// backends, Maglev sends about half the client ports there.
const REMOTE_REPLIES: usize = 8;
/// Requests a test makes at most to see [`REMOTE_REPLIES`]: 2^-100 that a fair
/// split falls short.
const MAX_REQUESTS: usize = 200;
/// Held connections per backend in the survival tests.
const SESSIONS_EACH: usize = 4;
/// How long one exchange on a held connection may take: a retransmission or two
/// after a route change fit, a connection that broke does not.
const SESSION_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the agents may take to serve what a test needs.
const SERVE_WAIT: Duration = Duration::from_secs(20);

/// `--lb-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LbMode {
    Snat,
    Dsr,
    Hybrid,
}

impl LbMode {
    fn arg(self) -> &'static str {
        match self {
            LbMode::Snat => "snat",
            LbMode::Dsr => "dsr",
            LbMode::Hybrid => "hybrid",
        }
    }
}

/// The module doc's world, with both agents in `mode`.
struct World<F: Family> {
    // Fields drop in declaration order: the agents while their nodes exist, the
    // servers, the manifests, then the cluster.
    agents: Vec<Agent>,
    _servers: (Vec<TcpServer>, Vec<UdpServer>, BulkServer),
    manifests: ManifestDir,
    cluster: Cluster,
    mode: LbMode,
    xdp_mode: &'static str,
    family: PhantomData<F>,
}

impl<F: Family> World<F> {
    fn new(mode: LbMode, xdp_mode: &'static str) -> World<F> {
        require_root().expect("privileged test");
        let cluster = Cluster::new(&[("a", &[POD_A]), ("b", &[POD_B])]).expect("two-node cluster");
        let pods = [POD_A, POD_B];
        let tcp = pods
            .iter()
            .map(|(name, _)| {
                TcpServer::start(&cluster.pod(name).ns, name, TCP_PORT).expect("TCP backend")
            })
            .collect();
        let udp = pods
            .iter()
            .map(|(name, _)| {
                UdpServer::start(&cluster.pod(name).ns, name, UDP_PORT).expect("UDP backend")
            })
            .collect();
        let bulk =
            BulkServer::start(&cluster.pod(POD_B.0).ns, POD_B.0, BULK_PORT).expect("bulk backend");
        let manifests = ManifestDir::create(cluster.stem()).expect("manifest dir");
        let mut world = World {
            agents: Vec::new(),
            _servers: (tcp, udp, bulk),
            manifests,
            cluster,
            mode,
            xdp_mode,
            family: PhantomData,
        };
        world.publish();
        for vip in [web_ip::<F>(), bulk_ip::<F>()] {
            F::route_via(&world.cluster, CLIENT1.0, vip, "a")
                .unwrap_or_else(|e| panic!("client1: route to {vip} via node a: {e:#}"));
        }
        world.agents = vec![world.start("a"), world.start("b")];
        world.wait_served("the agents started");
        world
    }

    /// Writes both Services, each endpoint on its node (by the node names the
    /// agents are started with).
    fn publish(&self) {
        let node = |n: &str| self.cluster.node(n).ns.name().to_owned();
        let (a, b) = (node("a"), node("b"));
        let web = F::service("test", "dsr-web", F::vip(70))
            .port("http", HTTP, Protocol::Tcp, TCP_PORT)
            .port("dns", DNS, Protocol::Udp, UDP_PORT)
            .external_ip(web_ip::<F>());
        let bulk = F::service("test", "dsr-bulk", F::vip(71))
            .port("bulk", HTTP, Protocol::Tcp, BULK_PORT)
            .external_ip(bulk_ip::<F>());
        let (pod_a, pod_b) = (F::pod(POD_A.1), F::pod(POD_B.1));
        self.manifests
            .write(
                "dsr-web.yaml",
                &F::yaml_on_nodes(&web, &[(pod_a, a.as_str()), (pod_b, b.as_str())]),
            )
            .expect("write dsr-web");
        self.manifests
            .write(
                "dsr-bulk.yaml",
                &F::yaml_on_nodes(&bulk, &[(pod_b, b.as_str())]),
            )
            .expect("write dsr-bulk");
    }

    fn start(&self, node: &str) -> Agent {
        let n = self.cluster.node(node);
        let node_ip = F::node_ip_arg(n);
        let mut args = vec![
            "--xdp-mode",
            self.xdp_mode,
            "--lb-algorithm",
            "maglev",
            "--lb-mode",
            self.mode.arg(),
        ];
        if let Some(ip) = &node_ip {
            args.extend(["--node-ip", ip.as_str()]);
        }
        Agent::start_with(&n.ns, self.manifests.path(), &args)
            .unwrap_or_else(|e| panic!("agent on node {node} ({args:?}): {e:#}"))
    }

    /// Waits until both backends answer through node a (node b's agent takes part
    /// in every answer from dsr-b1) and the bulk Service answers too.
    #[track_caller]
    fn wait_served(&self, after: &str) {
        let mut seen = BTreeMap::<String, u32>::new();
        let waited = wait_for(SERVE_WAIT, POLL, || {
            match tcp_request(self.client1(), web::<F>(), TIMEOUT) {
                Outcome::Reply(r) => *seen.entry(r.backend).or_default() += 1,
                other => return Err(format!("last outcome {other}")),
            }
            if seen.len() < 2 {
                return Err(format!("only {seen:?} answered so far"));
            }
            match tcp_request(self.client1(), bulk_addr::<F>(), TIMEOUT) {
                Outcome::Reply(_) => Ok(()),
                other => Err(format!("the bulk Service: {other}")),
            }
        });
        if let Err(last) = waited {
            panic!(
                "{after}: {} through node a did not answer from both backends within \
                 {SERVE_WAIT:?} ({}, {:?} mode): {last}; {}",
                web::<F>(),
                F::NAME,
                self.mode,
                self.counters()
            );
        }
    }

    fn client1(&self) -> &NetNs {
        &self.cluster.client(CLIENT1.0).ns
    }

    fn node_ip(&self, node: &str) -> F {
        F::uplink(self.cluster.node(node).ip)
    }

    /// Node `node`'s (0 is a, 1 is b) datapath counter `name`.
    #[track_caller]
    fn counter(&self, node: usize, name: &str) -> u64 {
        self.agents[node]
            .counter(name)
            .unwrap_or_else(|e| panic!("node {}'s counter {name}: {e:#}", ["a", "b"][node]))
    }

    /// Both nodes' non-zero counters, for messages.
    fn counters(&self) -> String {
        let mut out = String::new();
        for (agent, node) in self.agents.iter().zip(["a", "b"]) {
            out.push_str(&format!("node {node}: {}; ", agent.nonzero_counters()));
        }
        out
    }

    /// Makes requests through node a with `request` (a new client port each)
    /// until [`REMOTE_REPLIES`] came from dsr-b1, and at least one from dsr-a1.
    #[track_caller]
    fn replies(
        &self,
        what: &str,
        request: impl Fn(&NetNs) -> Outcome<F::Addr>,
    ) -> Vec<Reply<F::Addr>> {
        let mut replies: Vec<Reply<F::Addr>> = Vec::new();
        let from = |replies: &[Reply<F::Addr>], pod: &str| {
            replies.iter().filter(|r| r.backend == pod).count()
        };
        while from(&replies, POD_B.0) < REMOTE_REPLIES || from(&replies, POD_A.0) == 0 {
            assert!(
                replies.len() < MAX_REQUESTS,
                "{what}: {MAX_REQUESTS} requests through node a, {} answered by {} and {} by \
                 {}: Maglev does not spread client ports; {}",
                from(&replies, POD_A.0),
                POD_A.0,
                from(&replies, POD_B.0),
                POD_B.0,
                self.counters()
            );
            match request(self.client1()) {
                Outcome::Reply(r) => replies.push(r),
                other => panic!(
                    "{what}: request {} through node a: {other}; {}",
                    replies.len() + 1,
                    self.counters()
                ),
            }
        }
        replies
    }

    /// Panics unless the backend of every one of `replies` saw `client` as its
    /// peer, naming those that saw another.
    #[track_caller]
    fn assert_every_backend_saw(&self, replies: &[Reply<F::Addr>], client: F, what: &str) {
        let wrong: Vec<String> = replies
            .iter()
            .filter(|r| r.peer.peer_ip() != client)
            .map(|r| format!("{} saw {}", r.backend, r.peer))
            .collect();
        assert!(
            wrong.is_empty(),
            "{what}: {} of {} did not show the backend client1's address {client}: \
             {wrong:?}; {}",
            wrong.len(),
            replies.len(),
            self.counters()
        );
    }

    /// Downloads [`BULK`] bytes from dsr-b1 through node a and says what node a
    /// and node b did meanwhile.
    #[track_caller]
    fn download(&self) -> Download<F> {
        let before = self.measure();
        let (reply, transfer) = bulk::download(self.client1(), bulk_addr::<F>(), BULK, 7, LIMITS)
            .unwrap_or_else(|e| panic!("download from {}: {e:#}", bulk_addr::<F>()));
        assert!(
            transfer.complete(),
            "{:?} mode: download through node a from {}: {transfer}; {}",
            self.mode,
            reply.backend,
            self.counters()
        );
        let after = self.measure();
        let delta = |name: &str| after[name] - before[name];
        Download {
            peer: reply.peer.peer_ip(),
            a_tx_bytes: delta("a tx_bytes"),
            a_rev_nat: delta("a rev_nat"),
            a_snat_new: delta("a snat_new"),
            a_dsr_new: delta("a dsr_new"),
            b_dsr_learnt: delta("b dsr_learnt"),
            b_rev_nat: delta("b rev_nat"),
        }
    }

    fn measure(&self) -> BTreeMap<&'static str, u64> {
        let mut m = BTreeMap::new();
        m.insert("a tx_bytes", tx_bytes(&self.cluster.node("a").ns, "eth0"));
        m.insert("a rev_nat", self.counter(0, "rev_nat"));
        m.insert("a snat_new", self.counter(0, "snat_new"));
        m.insert("a dsr_new", self.counter(0, "dsr_new"));
        m.insert("b dsr_learnt", self.counter(1, "dsr_learnt"));
        m.insert("b rev_nat", self.counter(1, "rev_nat"));
        m
    }
}

/// What one download through node a from dsr-b1 came to: what the backend saw
/// and how node a's and node b's counters moved meanwhile.
struct Download<F> {
    peer: F,
    /// Bytes node a's uplink sent.
    a_tx_bytes: u64,
    a_rev_nat: u64,
    a_snat_new: u64,
    a_dsr_new: u64,
    b_dsr_learnt: u64,
    b_rev_nat: u64,
}

impl<F: Family> std::fmt::Display for Download<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the backend saw {}; node a: uplink sent {} bytes, rev_nat +{}, snat_new +{}, \
             dsr_new +{}; node b: dsr_learnt +{}, rev_nat +{}",
            self.peer,
            self.a_tx_bytes,
            self.a_rev_nat,
            self.a_snat_new,
            self.a_dsr_new,
            self.b_dsr_learnt,
            self.b_rev_nat
        )
    }
}

/// Client1's address of the family.
fn client1_ip<F: Family>() -> F {
    F::uplink(CLIENT1.1)
}

fn web_ip<F: Family>() -> F {
    F::external(10)
}

fn bulk_ip<F: Family>() -> F {
    F::external(11)
}

fn web<F: Family>() -> F::Addr {
    F::addr(web_ip::<F>(), HTTP)
}

fn dns<F: Family>() -> F::Addr {
    F::addr(web_ip::<F>(), DNS)
}

fn bulk_addr<F: Family>() -> F::Addr {
    F::addr(bulk_ip::<F>(), HTTP)
}

/// The bytes `ifname` sent, from `ns`'s `/proc/net/dev`.
fn tx_bytes(ns: &NetNs, ifname: &str) -> u64 {
    // /proc/thread-self/net is the reading thread's namespace.
    let dev = ns
        .run(|| std::fs::read_to_string("/proc/thread-self/net/dev"))
        .and_then(|r| Ok(r?))
        .unwrap_or_else(|e| panic!("/proc/net/dev of {}: {e:#}", ns.name()));
    // `eth0: <8 receive counters> <tx bytes> ...`
    dev.lines()
        .find_map(|l| l.trim_start().strip_prefix(&format!("{ifname}:")))
        .and_then(|counters| counters.split_whitespace().nth(8)?.parse().ok())
        .unwrap_or_else(|| panic!("no {ifname} in /proc/net/dev of {}:\n{dev}", ns.name()))
}

fn port<A: Peer>(addr: A) -> u16 {
    let addr: SocketAddr = addr.into();
    addr.port()
}

// ---------------------------------------------------------------------------
// 1. The backend sees the client, and the replies bypass the entry node.
// ---------------------------------------------------------------------------

#[test]
fn dsr_backend_on_the_other_node_sees_the_client_and_its_replies_bypass_the_entry_node_tc_only() {
    backend_sees_the_client_and_replies_bypass_the_entry_node::<Ipv4Addr>("off");
}

#[test]
fn dsr_backend_on_the_other_node_sees_the_client_and_its_replies_bypass_the_entry_node_native_xdp()
{
    backend_sees_the_client_and_replies_bypass_the_entry_node::<Ipv4Addr>("native");
}

/// The same over IPv6 (the datapath's DSR may be IPv4's alone; reported apart).
#[test]
fn ipv6_dsr_backend_on_the_other_node_sees_the_client_and_its_replies_bypass_the_entry_node_tc_only()
 {
    backend_sees_the_client_and_replies_bypass_the_entry_node::<Ipv6Addr>("off");
}

#[test]
fn ipv6_dsr_backend_on_the_other_node_sees_the_client_and_its_replies_bypass_the_entry_node_native_xdp()
 {
    backend_sees_the_client_and_replies_bypass_the_entry_node::<Ipv6Addr>("native");
}

/// The control: `--lb-mode snat`, everything else the same. The backend on node
/// b sees node a's address, node a translates every reply and its uplink carries
/// the whole download: the measurements of the DSR tests tell the modes apart.
#[test]
fn snat_control_backend_on_the_other_node_sees_the_entry_node_and_its_replies_return_through_it() {
    let world = World::<Ipv4Addr>::new(LbMode::Snat, "off");
    let (client1, node_a) = (client1_ip::<Ipv4Addr>(), world.node_ip("a"));
    let replies = world.replies("snat: TCP", |ns| {
        tcp_request(ns, web::<Ipv4Addr>(), TIMEOUT)
    });
    for r in &replies {
        let want = if r.backend == POD_B.0 {
            node_a
        } else {
            client1
        };
        assert_eq!(
            r.peer.peer_ip(),
            want,
            "snat: {} saw {} (client1 {client1}, node a {node_a})",
            r.backend,
            r.peer
        );
    }
    let d = world.download();
    eprintln!("snat: download of {BULK} bytes through node a: {d}");
    assert_eq!(d.peer, node_a, "snat: the bulk backend's peer");
    assert!(
        d.a_tx_bytes >= BULK,
        "snat: node a's uplink sent {} bytes during a download of {BULK} through it; {}",
        d.a_tx_bytes,
        world.counters()
    );
    assert!(
        d.a_rev_nat > 0 && d.a_snat_new > 0 && d.a_dsr_new == 0,
        "snat: node a's counters moved rev_nat +{}, snat_new +{}, dsr_new +{}; {}",
        d.a_rev_nat,
        d.a_snat_new,
        d.a_dsr_new,
        world.counters()
    );
}

fn backend_sees_the_client_and_replies_bypass_the_entry_node<F: Family>(xdp_mode: &'static str) {
    let world = World::<F>::new(LbMode::Dsr, xdp_mode);
    let (client1, node_a) = (client1_ip::<F>(), world.node_ip("a"));
    let what = format!("{} dsr --xdp-mode {xdp_mode}", F::NAME);
    let dsr_before = world.counter(0, "dsr_new");
    let xdp_before = world.counter(0, "xdp_tx");
    let replies = world.replies(&format!("{what}: TCP"), |ns| {
        tcp_request(ns, web::<F>(), TIMEOUT)
    });
    xdp_sent_dsr_flows(&world, &what, xdp_before);
    eprintln!(
        "{what}: {} connections through node a, {} to {}",
        replies.len(),
        replies.iter().filter(|r| r.backend == POD_B.0).count(),
        POD_B.0
    );
    world.assert_every_backend_saw(
        &replies,
        client1,
        &format!("{what}: connections through node a (node a is {node_a})"),
    );
    let dsr_new = world.counter(0, "dsr_new") - dsr_before;
    assert!(
        dsr_new >= REMOTE_REPLIES as u64,
        "{what}: node a counted {dsr_new} new DSR flows for {REMOTE_REPLIES} connections or \
         more to {}; {}",
        POD_B.0,
        world.counters()
    );

    let d = world.download();
    eprintln!("{what}: download of {BULK} bytes through node a: {d}");
    assert_eq!(
        d.peer, client1,
        "{what}: the bulk backend on node b saw {} instead of client1 (node a is {node_a})",
        d.peer
    );
    assert_eq!(
        d.a_rev_nat,
        0,
        "{what}: node a translated {} replies of a download served from node b; {}",
        d.a_rev_nat,
        world.counters()
    );
    // Node a forwards only the client's ACKs (and the request): a few percent of
    // the download at most.
    assert!(
        d.a_tx_bytes < BULK / 10,
        "{what}: node a's uplink sent {} bytes during a download of {BULK} bytes that should \
         have bypassed it; {}",
        d.a_tx_bytes,
        world.counters()
    );
    assert!(
        d.a_dsr_new >= 1 && d.b_dsr_learnt >= 1,
        "{what}: the download's flow: node a dsr_new +{}, node b dsr_learnt +{} (want 1 or \
         more each); {}",
        d.a_dsr_new,
        d.b_dsr_learnt,
        world.counters()
    );
    assert_eq!(
        d.a_snat_new,
        0,
        "{what}: node a SNATed a flow in dsr mode; {}",
        world.counters()
    );
}

/// `--lb-mode dsr` covers UDP too: a datagram through node a to the backend on
/// node b arrives with the client's address, and the answer comes back as the
/// ExternalIP (the client's connected socket accepts nothing else).
#[test]
fn dsr_udp_to_the_other_nodes_backend_keeps_the_client_address_tc_only() {
    let world = World::<Ipv4Addr>::new(LbMode::Dsr, "off");
    let client1 = client1_ip::<Ipv4Addr>();
    let replies = world.replies("dsr: UDP", |ns| udp_request(ns, dns::<Ipv4Addr>(), TIMEOUT));
    world.assert_every_backend_saw(&replies, client1, "dsr: UDP requests through node a");
}

// ---------------------------------------------------------------------------
// 2. Established connections survive the route moving and node a's restart.
// ---------------------------------------------------------------------------

#[test]
fn dsr_connections_survive_the_route_moving_to_the_other_node_and_an_agent_restart_tc_only() {
    connections_survive_a_route_change_and_a_restart::<Ipv4Addr>("off");
}

#[test]
fn dsr_connections_survive_the_route_moving_to_the_other_node_and_an_agent_restart_native_xdp() {
    connections_survive_a_route_change_and_a_restart::<Ipv4Addr>("native");
}

/// The same over IPv6 (the datapath's DSR may be IPv4's alone; reported apart).
#[test]
fn ipv6_dsr_connections_survive_the_route_moving_to_the_other_node_and_an_agent_restart_tc_only() {
    connections_survive_a_route_change_and_a_restart::<Ipv6Addr>("off");
}

#[test]
fn ipv6_dsr_connections_survive_the_route_moving_to_the_other_node_and_an_agent_restart_native_xdp()
{
    connections_survive_a_route_change_and_a_restart::<Ipv6Addr>("native");
}

/// Node b's agent stopped, as for an upgrade: its pinned `tc_ingress` goes on
/// handing the packets node a sends by DSR to `tc_dsr` through its pinned
/// `TC_DSR`, so new connections through node a to dsr-b1 still see the client and
/// get their answers as the ExternalIP, each learnt from its carrier
/// (`dsr_learnt`).
#[test]
fn dsr_flows_start_while_the_backend_nodes_agent_is_down_tc_only() {
    flows_start_while_the_backend_nodes_agent_is_down::<Ipv4Addr>();
}

/// The same over IPv6 (`tc_dsr6`, through `tc_ingress6`).
#[test]
fn ipv6_dsr_flows_start_while_the_backend_nodes_agent_is_down_tc_only() {
    flows_start_while_the_backend_nodes_agent_is_down::<Ipv6Addr>();
}

fn flows_start_while_the_backend_nodes_agent_is_down<F: Family>() {
    let mut world = World::<F>::new(LbMode::Dsr, "off");
    let status = world.agents[1]
        .terminate()
        .expect("stopping node b's agent");
    assert!(status.success(), "node b's agent exited with {status}");
    let learnt_before = world.counter(1, "dsr_learnt");
    let what = format!("{} dsr, node b's agent stopped", F::NAME);
    let replies = world.replies(&what, |ns| tcp_request(ns, web::<F>(), TIMEOUT));
    world.assert_every_backend_saw(&replies, client1_ip::<F>(), &what);
    let remote = replies.iter().filter(|r| r.backend == POD_B.0).count() as u64;
    let learnt = world.counter(1, "dsr_learnt") - learnt_before;
    assert!(
        learnt >= remote,
        "{what}: node b learnt {learnt} flows from node a's carrier for {remote} connections \
         answered by {}; {}",
        POD_B.0,
        world.counters()
    );
}

/// Held connections through node a, [`SESSIONS_EACH`] or more on each backend;
/// every one answers a line, with the backend that greeted it, after each step:
/// the route moved to node b (node b never saw the flows to dsr-a1; it learnt
/// those to dsr-b1 from node a's option), moved back, and node a's agent
/// replaced by one with empty maps.
fn connections_survive_a_route_change_and_a_restart<F: Family>(xdp_mode: &'static str) {
    let mut world = World::<F>::new(LbMode::Dsr, xdp_mode);
    let what = format!("{} dsr --xdp-mode {xdp_mode}", F::NAME);
    let client1 = client1_ip::<F>();
    let mut sessions: Vec<TcpSession<F::Addr>> = Vec::new();
    let on = |sessions: &[TcpSession<F::Addr>], pod: &str| {
        sessions
            .iter()
            .filter(|s| s.greeting.backend == pod)
            .count()
    };
    while on(&sessions, POD_A.0) < SESSIONS_EACH || on(&sessions, POD_B.0) < SESSIONS_EACH {
        assert!(
            sessions.len() < MAX_REQUESTS,
            "{what}: {} held connections through node a, {} on {} and {} on {}",
            sessions.len(),
            on(&sessions, POD_A.0),
            POD_A.0,
            on(&sessions, POD_B.0),
            POD_B.0
        );
        let session = TcpSession::open(world.client1(), web::<F>(), SESSION_TIMEOUT)
            .unwrap_or_else(|e| {
                panic!(
                    "{what}: connection {} through node a: {e:#}; {}",
                    sessions.len(),
                    world.counters()
                )
            });
        assert_eq!(
            session.greeting.peer.peer_ip(),
            client1,
            "{what}: connection {} through node a greeted by {}",
            sessions.len(),
            session.greeting.backend
        );
        sessions.push(session);
    }
    eprintln!(
        "{what}: {} held connections, {} on {} (DSR) and {} on {}",
        sessions.len(),
        on(&sessions, POD_B.0),
        POD_B.0,
        on(&sessions, POD_A.0),
        POD_A.0
    );
    let xdp_before = world.counter(0, "xdp_tx");
    exchange_on_all(&world, &mut sessions, "through node a");
    xdp_sent_dsr_flows(&world, &what, xdp_before);

    let vip = web_ip::<F>();
    let b_before = world.counter(1, "dsr_new");
    F::reroute_via(&world.cluster, CLIENT1.0, vip, "b").expect("move the route to node b");
    exchange_on_all(&world, &mut sessions, "after the route moved to node b");
    // Node b never saw the flows to dsr-a1: it took each up mid-stream and sent
    // it back to node a by DSR. That they count shows the route did move.
    let picked_up = world.counter(1, "dsr_new") - b_before;
    assert!(
        picked_up >= on(&sessions, POD_A.0) as u64,
        "{what}: after the route moved, node b counted {picked_up} new DSR flows for {} \
         connections to {} it had never seen; {}",
        on(&sessions, POD_A.0),
        POD_A.0,
        world.counters()
    );

    F::reroute_via(&world.cluster, CLIENT1.0, vip, "a").expect("move the route back to node a");
    exchange_on_all(
        &world,
        &mut sessions,
        "after the route moved back to node a",
    );

    world.agents[0].terminate().expect("stopping agent a");
    world.agents[0].cleanup().expect("cleaning up agent a");
    world.agents[0] = world.start("a");
    world.wait_served("node a's agent restarted");
    let a_before = world.counter(0, "dsr_new");
    exchange_on_all(
        &world,
        &mut sessions,
        "after node a's agent restarted without its conntrack",
    );
    // The new agent's conntrack is empty: the connections to dsr-b1 are new
    // flows to it, sent by DSR again.
    let picked_up = world.counter(0, "dsr_new") - a_before;
    assert!(
        picked_up >= on(&sessions, POD_B.0) as u64,
        "{what}: node a's new agent counted {picked_up} new DSR flows for {} connections to \
         {} it had lost; {}",
        on(&sessions, POD_B.0),
        POD_B.0,
        world.counters()
    );
}

/// With native XDP, node a's XDP program must have sent the DSR flows' packets
/// itself (`xdp_tx`), carrier in: else the native variants would show nothing the
/// tc-only ones do not.
#[track_caller]
fn xdp_sent_dsr_flows<F: Family>(world: &World<F>, what: &str, before: u64) {
    if world.xdp_mode != "native" {
        return;
    }
    let sent = world.counter(0, "xdp_tx") - before;
    assert!(
        sent > 0,
        "{what}: node a's XDP sent no packet itself (xdp_tx +0); {}",
        world.counters()
    );
}

/// Sends a line on every session and checks that the backend that greeted it
/// answers it; panics naming every session that did not, its backend and
/// `step`.
#[track_caller]
fn exchange_on_all<F: Family>(world: &World<F>, sessions: &mut [TcpSession<F::Addr>], step: &str) {
    let mut broken = Vec::new();
    for (i, s) in sessions.iter_mut().enumerate() {
        let text = format!("session {i} {step}");
        let backend = s.greeting.backend.clone();
        let client_port = port(s.greeting.peer);
        match s.exchange(&text) {
            Ok(answer) if answer == format!("{backend} {text}") => {}
            Ok(answer) => broken.push(format!(
                "session {i} (client port {client_port}, backend {backend}) answered {answer:?}"
            )),
            Err(e) => broken.push(format!(
                "session {i} (client port {client_port}, backend {backend}): {e:#}"
            )),
        }
    }
    eprintln!(
        "{} {step}: {} of {} sessions answered; {}",
        F::NAME,
        sessions.len() - broken.len(),
        sessions.len(),
        world.counters()
    );
    assert!(
        broken.is_empty(),
        "{} {step}: {} of {} held connections broke: {broken:#?}; {}",
        F::NAME,
        broken.len(),
        sessions.len(),
        world.counters()
    );
}

// ---------------------------------------------------------------------------
// 3. hybrid: DSR for TCP, SNAT for UDP.
// ---------------------------------------------------------------------------

#[test]
fn hybrid_mode_returns_tcp_directly_and_snats_udp_tc_only() {
    let world = World::<Ipv4Addr>::new(LbMode::Hybrid, "off");
    let (client1, node_a) = (client1_ip::<Ipv4Addr>(), world.node_ip("a"));
    let before = (world.counter(0, "dsr_new"), world.counter(0, "snat_new"));

    let tcp = world.replies("hybrid: TCP", |ns| {
        tcp_request(ns, web::<Ipv4Addr>(), TIMEOUT)
    });
    world.assert_every_backend_saw(&tcp, client1, "hybrid: TCP through node a, DSR");
    let dsr_new = world.counter(0, "dsr_new") - before.0;

    let udp = world.replies("hybrid: UDP", |ns| {
        udp_request(ns, dns::<Ipv4Addr>(), TIMEOUT)
    });
    for r in &udp {
        // Only the remote backend's flows are SNATed; the local one sees the
        // client as in every mode.
        let want = if r.backend == POD_B.0 {
            node_a
        } else {
            client1
        };
        assert_eq!(
            r.peer.peer_ip(),
            want,
            "hybrid: UDP through node a answered by {} (SNAT to node a {node_a} for {}, \
             client1 {client1} otherwise); {}",
            r.backend,
            POD_B.0,
            world.counters()
        );
    }
    let snat_new = world.counter(0, "snat_new") - before.1;
    // A UDP flow is its 5-tuple: a later request from a client port the kernel
    // gave out again within the flow's timeout is the same flow, SNATed once.
    // Each flow SNATed shows the remote backend a port of its own.
    let remote_flows = udp
        .iter()
        .filter(|r| r.backend == POD_B.0)
        .map(|r| r.peer)
        .collect::<std::collections::HashSet<_>>()
        .len() as u64;
    assert!(
        dsr_new >= REMOTE_REPLIES as u64 && snat_new >= remote_flows,
        "hybrid: node a counted dsr_new +{dsr_new} for the TCP connections ({REMOTE_REPLIES} \
         or more remote) and snat_new +{snat_new} for the UDP requests ({remote_flows} \
         distinct flows to {}); {}",
        POD_B.0,
        world.counters()
    );
}
