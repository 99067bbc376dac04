//! Large transfers and path MTU discovery on every translated path of both
//! families: megabytes over real TCP, with checksum offload on transmit, TSO, GSO
//! and GRO on for every veth (read back with `ethtool -k`), so that the datapath
//! sees the super-packets hosts with offloading NICs move, in the two-node world
//! of docs/architecture.md ("Test topologies") with an agent on each node
//! (`--xdp-mode off`: tc translates and redirects).
//!
//! The paths: a ClusterIP from a pod on node a to a backend on node b; a NodePort
//! of node a from an outside client to that backend (SNAT to node a, and the
//! datapath's redirect both ways); hairpin (a pod through a ClusterIP whose only
//! backend is itself). Path MTU discovery: a router beyond node a (a pod of node
//! b, the backend behind it) whose route to the backend has a 1,280-byte MTU, its
//! "fragmentation needed" or "packet too big" to be translated back to the client;
//! and node a's own link toward node b's pods with a 1,280-byte MTU, node a's own
//! check and its error the ones that count. Every transfer must bring every byte,
//! each the one sent; a failure says how far it got, with both agents' counters and
//! the namespaces' ICMP and TCP statistics.
//!
//! Every test builds its own namespaces, bpffs roots and manifest directory, so
//! they run in parallel; everything is removed on drop, also when a test fails.

use std::{
    marker::PhantomData,
    net::{Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use ebpf_proxy_tests::{
    Protocol,
    agent::Agent,
    bulk::{self, BulkServer, Limits, Transfer},
    client::{Outcome, Peer, Reply, TIMEOUT, tcp_request},
    cluster::{CLIENT1, Cluster},
    eventually,
    family::Family,
    manifest::{ManifestDir, Service, ServiceType},
    netns::NetNs,
    offloads, require_root, snmp,
    topology::{GATEWAY, GATEWAY6},
};

/// The client pod on node a.
const POD: (&str, Ipv4Addr) = ("pod-a", Ipv4Addr::new(10, 1, 1, 20));
/// The pod on node a that reaches itself through its Service (hairpin).
const SELF: (&str, Ipv4Addr) = ("self-a", Ipv4Addr::new(10, 1, 1, 30));
/// The backend pod on node b.
const BACKEND: (&str, Ipv4Addr) = ("web-b", Ipv4Addr::new(10, 1, 2, 10));
/// The router pod on node b of the hop beyond, and the backend behind it (an
/// address of node b's pod CIDR, so that node a routes it to node b already).
const ROUTER: (&str, Ipv4Addr) = ("router-b", Ipv4Addr::new(10, 1, 2, 40));
const FAR: (&str, Ipv4Addr) = ("far", Ipv4Addr::new(10, 1, 2, 50));
/// The smaller MTU of the hop beyond and of node a's own link.
const SMALL_MTU: &str = "1280";
/// Node a's own 1,280-byte link to node b: both ends' addresses.
const LINK: &str = "mtu0";
const LINK_A: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
const LINK_B: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 2);
const LINK_A6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, 1);
const LINK_B6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, 2);

const PORT: u16 = 8080;
const SERVICE_PORT: u16 = 80;
const NODE_PORT: u16 = 30090;

/// A bulk download's size; an upload and a download of path MTU discovery each
/// move half of it.
const BULK: u64 = 8 << 20;
/// Generous: a working path moves the 8 MiB in well under a second.
const LIMITS: Limits = Limits {
    within: Duration::from_mins(1),
    stall: Duration::from_secs(15),
};

/// The statistics a failure message shows for each namespace involved.
const STATS: [&str; 8] = [
    "IcmpInDestUnreachs",
    "IcmpOutDestUnreachs",
    "IpFragFails",
    "TcpRetransSegs",
    "Icmp6InPktTooBigs",
    "Icmp6OutPktTooBigs",
    "Ip6InTooBigErrors",
    "Ip6FragFails",
];

/// What stands between node a and the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Between {
    /// Node b's bridge at 1,500 bytes, to the backend pod on node b.
    Nothing,
    /// The backend [`FAR`] behind the router pod [`ROUTER`] of node b, whose
    /// route to it is locked at 1,280 bytes (the links on both sides of it are
    /// 1,500 bytes, so the backend's SYN-ACK announces a full-sized MSS).
    RouterBeyond,
    /// Node a reaches node b's pods over a link of its own, 1,280 bytes at
    /// both ends; the clients and node b's answers keep the 1,500-byte bridge.
    NodesOwnLink,
}

/// The two-node world with a bulk backend behind `test/bulk` (a NodePort
/// Service: ClusterIP [`Family::vip`] 60, NodePort [`NODE_PORT`]) on node b, a
/// bulk backend in [`SELF`] behind `test/self` (ClusterIP [`Family::vip`] 62,
/// only itself), offloads on everywhere, and an agent on each node.
struct World<F: Family> {
    // Fields drop in declaration order: the agents while their nodes exist, the
    // servers, the manifests, the far namespace, then the cluster.
    agents: Vec<Agent>,
    servers: Vec<BulkServer>,
    _manifests: ManifestDir,
    far: Option<NetNs>,
    cluster: Cluster,
    between: Between,
    family: PhantomData<F>,
}

impl<F: Family> World<F> {
    fn new(between: Between) -> World<F> {
        require_root().expect("privileged test");
        let mut cluster =
            Cluster::new(&[("a", &[POD, SELF]), ("b", &[BACKEND])]).expect("two-node cluster");
        let far = match between {
            Between::Nothing => None,
            Between::RouterBeyond => Some(far_behind_a_router(&mut cluster)),
            Between::NodesOwnLink => {
                nodes_own_link(&cluster);
                None
            }
        };
        let namespaces = cluster
            .nodes()
            .iter()
            .map(|n| &n.ns)
            .chain(cluster.clients().iter().map(|c| &c.ns))
            .chain(cluster.all_pods().map(|p| &p.ns))
            .chain(far.iter())
            .chain(std::iter::once(cluster.bridge()));
        for ns in namespaces {
            offloads::enable(ns).unwrap_or_else(|e| panic!("offloads on: {e:#}"));
        }
        let backend_ns = far.as_ref().unwrap_or(&cluster.pod(BACKEND.0).ns);
        let backend_name = if far.is_some() { FAR.0 } else { BACKEND.0 };
        let servers = vec![
            BulkServer::start(backend_ns, backend_name, PORT).expect("the bulk backend"),
            BulkServer::start(&cluster.pod(SELF.0).ns, SELF.0, PORT).expect("the hairpin backend"),
        ];
        let manifests = ManifestDir::create(cluster.stem()).expect("manifest dir");
        let node_name = |n: &str| cluster.node(n).ns.name().to_owned();
        let bulk = F::service("test", "bulk", F::vip(60))
            .type_(ServiceType::NodePort)
            .port("http", SERVICE_PORT, Protocol::Tcp, PORT)
            .node_port("http", NODE_PORT);
        let backend_ip = F::pod(if far.is_some() { FAR.1 } else { BACKEND.1 });
        publish::<F>(&manifests, &bulk, &[(backend_ip, &node_name("b"))]);
        let itself =
            F::service("test", "self", F::vip(62)).port("http", SERVICE_PORT, Protocol::Tcp, PORT);
        publish::<F>(&manifests, &itself, &[(F::pod(SELF.1), &node_name("a"))]);
        let agents = ["a", "b"]
            .iter()
            .map(|node| {
                let n = cluster.node(node);
                let node_ip = F::node_ip_arg(n);
                let mut args = vec!["--xdp-mode", "off"];
                if let Some(ip) = &node_ip {
                    args.extend(["--node-ip", ip.as_str()]);
                }
                Agent::start_with(&n.ns, manifests.path(), &args)
                    .unwrap_or_else(|e| panic!("agent on node {node}: {e:#}"))
            })
            .collect();
        let world = World {
            agents,
            servers,
            _manifests: manifests,
            far,
            cluster,
            between,
            family: PhantomData,
        };
        // Each path answers before a test moves data through it.
        for (ns, addr, what) in [
            (
                world.pod(POD.0),
                Self::cluster_ip(),
                "the ClusterIP from a pod",
            ),
            (
                world.client(),
                world.node_port(),
                "the NodePort from outside",
            ),
            (world.pod(SELF.0), Self::own_cluster_ip(), "hairpin"),
        ] {
            eventually(
                &format!("{} {what} answers", F::NAME),
                Duration::from_secs(10),
                || match tcp_request(ns, addr, TIMEOUT) {
                    Outcome::Reply(_) => Ok(()),
                    other => Err(other.to_string()),
                },
            );
        }
        world
    }

    fn pod(&self, name: &str) -> &NetNs {
        &self.cluster.pod(name).ns
    }

    fn client(&self) -> &NetNs {
        &self.cluster.client(CLIENT1.0).ns
    }

    fn cluster_ip() -> F::Addr {
        F::addr(F::vip(60), SERVICE_PORT)
    }

    fn own_cluster_ip() -> F::Addr {
        F::addr(F::vip(62), SERVICE_PORT)
    }

    fn node_port(&self) -> F::Addr {
        F::addr(F::uplink(self.cluster.node("a").ip), NODE_PORT)
    }

    fn backend_name(&self) -> &'static str {
        if self.far.is_some() { FAR.0 } else { BACKEND.0 }
    }

    /// Both agents' non-zero datapath counters and the ICMP and TCP statistics
    /// of every namespace on the path, for failure messages.
    fn diagnosis(&self) -> String {
        let mut out = String::new();
        for (agent, node) in self.agents.iter().zip(["a", "b"]) {
            out.push_str(&format!(
                "\n  node {node} counters: {}",
                agent.nonzero_counters()
            ));
        }
        let mut namespaces: Vec<(&str, &NetNs)> = vec![
            ("node a", &self.cluster.node("a").ns),
            ("node b", &self.cluster.node("b").ns),
            (CLIENT1.0, self.client()),
            (POD.0, self.pod(POD.0)),
            (SELF.0, self.pod(SELF.0)),
        ];
        if let Some(far) = &self.far {
            namespaces.push((ROUTER.0, self.pod(ROUTER.0)));
            namespaces.push((FAR.0, far));
        } else {
            namespaces.push((BACKEND.0, self.pod(BACKEND.0)));
        }
        for (name, ns) in namespaces {
            out.push_str(&format!("\n  {name}: {}", snmp::nonzero(ns, &STATS)));
        }
        out
    }

    /// Moves `len` bytes (`put`: from `ns` to the server; `get`: back) through
    /// `addr` and panics, saying how far it got and why, unless every byte
    /// arrived as sent; returns the server's greeting.
    #[track_caller]
    fn transfer(
        &self,
        ns: &NetNs,
        addr: F::Addr,
        put: bool,
        len: u64,
        what: &str,
    ) -> Reply<F::Addr> {
        let seed = u64::from(addr.into().port()) << 32 | len;
        let moved = if put {
            bulk::upload(ns, addr, len, seed, LIMITS)
        } else {
            bulk::download(ns, addr, len, seed, LIMITS)
        };
        let (reply, t): (Reply<F::Addr>, Transfer) =
            moved.unwrap_or_else(|e| panic!("{} {what}: {e:#}", F::NAME));
        assert!(
            t.complete(),
            "{} {what} ({:?} between node a and the backend), through {addr} from {}: {t}; \
             the backend has taken {} bytes and sent {} in all so far; {}",
            F::NAME,
            self.between,
            ns.name(),
            self.servers[0].received(),
            self.servers[0].sent(),
            self.diagnosis()
        );
        reply
    }

    fn counter(&self, node: usize, name: &str) -> u64 {
        self.agents[node]
            .counter(name)
            .unwrap_or_else(|e| panic!("counter {name}: {e:#}"))
    }
}

/// Writes `service` with its endpoints, each on its node (by namespace name, as
/// the agents call their nodes).
fn publish<F: Family>(manifests: &ManifestDir, service: &Service, endpoints: &[(F, &str)]) {
    manifests
        .write(
            &format!("{}.yaml", service.name),
            &F::yaml_on_nodes(service, endpoints),
        )
        .expect("write manifest");
}

/// `ip` with `args` (split at spaces) in `ns`; panics with what failed.
fn ip(ns: &NetNs, args: &str) {
    let args: Vec<&str> = args.split(' ').collect();
    ns.ip(&args)
        .unwrap_or_else(|e| panic!("ip {} in {}: {e:#}", args.join(" "), ns.name()));
}

fn sysctl(ns: &NetNs, key: &str, value: &str) {
    ns.sysctl(key, value)
        .unwrap_or_else(|e| panic!("{key}={value} in {}: {e:#}", ns.name()));
}

/// [`Between::RouterBeyond`]: the router pod on node b, the far namespace behind
/// it (built like a pod: a /32 and a /128, the gateways as pods have them, and
/// proxy ARP on the router's side), the router's routes to it locked at 1,280
/// bytes (a route MTU holds for forwarded packets only when locked), and node b's
/// routes to it through the router.
fn far_behind_a_router(cluster: &mut Cluster) -> NetNs {
    let router = cluster
        .add_pod("b", ROUTER.0, ROUTER.1)
        .expect("the router pod");
    let (router_if, router6) = (router.host_if.clone(), router.ip6);
    let far = NetNs::create(&format!("{}-{}", cluster.stem(), FAR.0)).expect("the far namespace");
    let far6 = <Ipv6Addr as Family>::pod(FAR.1);
    let router = &cluster.pod(ROUTER.0).ns;
    ip(
        router,
        &format!(
            "link add far0 type veth peer name eth0 netns {}",
            far.name()
        ),
    );
    sysctl(router, "net.ipv4.ip_forward", "1");
    sysctl(router, "net.ipv6.conf.all.forwarding", "1");
    sysctl(router, "net.ipv4.conf.all.rp_filter", "0");
    sysctl(router, "net.ipv4.conf.far0.rp_filter", "0");
    sysctl(router, "net.ipv4.conf.far0.proxy_arp", "1");
    sysctl(router, "net.ipv4.neigh.far0.proxy_delay", "0");
    sysctl(router, "net.ipv6.conf.far0.accept_dad", "0");
    ip(router, &format!("-6 addr add {GATEWAY6}/64 dev far0 nodad"));
    ip(router, "link set far0 up");
    ip(
        router,
        &format!("route add {}/32 dev far0 mtu lock {SMALL_MTU}", FAR.1),
    );
    ip(
        router,
        &format!("-6 route add {far6}/128 dev far0 mtu lock {SMALL_MTU}"),
    );
    sysctl(&far, "net.ipv6.conf.eth0.accept_dad", "0");
    ip(&far, &format!("addr add {}/32 dev eth0", FAR.1));
    ip(&far, &format!("-6 addr add {far6}/128 dev eth0 nodad"));
    ip(&far, "link set eth0 up");
    ip(
        &far,
        &format!("route add default via {GATEWAY} dev eth0 onlink"),
    );
    ip(
        &far,
        &format!("-6 route add default via {GATEWAY6} dev eth0"),
    );
    let node_b = &cluster.node("b").ns;
    ip(
        node_b,
        &format!("route add {}/32 via {} dev {router_if}", FAR.1, ROUTER.1),
    );
    ip(
        node_b,
        &format!("-6 route add {far6}/128 via {router6} dev {router_if}"),
    );
    far
}

/// [`Between::NodesOwnLink`]: a veth between nodes a and b at 1,280 bytes on
/// both ends, and node a's routes to node b's pod CIDRs over it.
fn nodes_own_link(cluster: &Cluster) {
    let (a, b) = (cluster.node("a"), cluster.node("b"));
    ip(
        &a.ns,
        &format!(
            "link add {LINK} type veth peer name {LINK} netns {}",
            b.ns.name()
        ),
    );
    for (ns, addr, addr6) in [(&a.ns, LINK_A, LINK_A6), (&b.ns, LINK_B, LINK_B6)] {
        sysctl(ns, &format!("net.ipv4.conf.{LINK}.rp_filter"), "0");
        sysctl(ns, &format!("net.ipv6.conf.{LINK}.accept_dad"), "0");
        ip(ns, &format!("link set {LINK} mtu {SMALL_MTU}"));
        ip(ns, &format!("addr add {addr}/30 dev {LINK}"));
        ip(ns, &format!("-6 addr add {addr6}/64 dev {LINK} nodad"));
        ip(ns, &format!("link set {LINK} up"));
    }
    ip(
        &a.ns,
        &format!("route replace {} via {LINK_B} dev {LINK}", b.pod_cidr()),
    );
    ip(
        &a.ns,
        &format!(
            "-6 route replace {} via {LINK_B6} dev {LINK}",
            b.pod_cidr6()
        ),
    );
}

/// A pod on node a downloads [`BULK`] bytes through a ClusterIP from the backend
/// on node b, seeing its own address kept.
fn download_through_a_cluster_ip<F: Family>() {
    let w = World::<F>::new(Between::Nothing);
    let reply = w.transfer(
        w.pod(POD.0),
        World::<F>::cluster_ip(),
        false,
        BULK,
        "bulk download through a ClusterIP from a pod",
    );
    assert_eq!(
        (reply.backend.as_str(), reply.peer.peer_ip()),
        (BACKEND.0, F::pod(POD.1)),
        "the ClusterIP's backend and the client address it saw"
    );
}

/// An outside client downloads [`BULK`] bytes through node a's NodePort from the
/// backend on node b: SNAT to node a, the datapath routing the flow's packets
/// both ways.
fn download_through_a_node_port_with_snat<F: Family>() {
    let w = World::<F>::new(Between::Nothing);
    let reply = w.transfer(
        w.client(),
        w.node_port(),
        false,
        BULK,
        "bulk download through a NodePort with SNAT",
    );
    assert_eq!(
        (reply.backend.as_str(), reply.peer.peer_ip()),
        (BACKEND.0, F::uplink(w.cluster.node("a").ip)),
        "the NodePort's backend and the (SNAT) address it saw"
    );
}

/// A pod downloads [`BULK`] bytes from itself through its own Service.
fn download_through_hairpin<F: Family>() {
    let w = World::<F>::new(Between::Nothing);
    let reply = w.transfer(
        w.pod(SELF.0),
        World::<F>::own_cluster_ip(),
        false,
        BULK,
        "bulk download through hairpin",
    );
    assert_eq!(reply.backend, SELF.0, "hairpin: the pod reaches itself");
    assert_ne!(
        reply.peer.peer_ip(),
        F::pod(SELF.1),
        "hairpin: the pod must not see its own address as the peer"
    );
}

/// Path MTU discovery through a ClusterIP from a pod on node a: an upload and a
/// download of half of [`BULK`] each, with `between` on the way.
fn path_mtu_through_a_cluster_ip<F: Family>(between: Between) {
    let w = World::<F>::new(between);
    let what = format!("upload through a ClusterIP from a pod, {between:?}");
    let reply = w.transfer(
        w.pod(POD.0),
        World::<F>::cluster_ip(),
        true,
        BULK / 2,
        &what,
    );
    assert_eq!(
        (reply.backend.as_str(), reply.peer.peer_ip()),
        (w.backend_name(), F::pod(POD.1)),
        "the ClusterIP's backend and the client address it saw"
    );
    let what = format!("download through a ClusterIP from a pod, {between:?}");
    w.transfer(
        w.pod(POD.0),
        World::<F>::cluster_ip(),
        false,
        BULK / 2,
        &what,
    );
    if between == Between::RouterBeyond {
        assert!(
            w.counter(0, "icmp_error_translated") > 0,
            "the router's errors reached the client, but not translated by node a; {}",
            w.diagnosis()
        );
    }
}

/// Path MTU discovery through node a's NodePort with SNAT from an outside
/// client: an upload and a download of half of [`BULK`] each, with `between` on
/// the way.
fn path_mtu_through_a_node_port_with_snat<F: Family>(between: Between) {
    let w = World::<F>::new(between);
    let what = format!("upload through a NodePort with SNAT, {between:?}");
    let reply = w.transfer(w.client(), w.node_port(), true, BULK / 2, &what);
    assert_eq!(
        (reply.backend.as_str(), reply.peer.peer_ip()),
        (w.backend_name(), F::uplink(w.cluster.node("a").ip)),
        "the NodePort's backend and the (SNAT) address it saw"
    );
    let what = format!("download through a NodePort with SNAT, {between:?}");
    w.transfer(w.client(), w.node_port(), false, BULK / 2, &what);
    if between == Between::RouterBeyond {
        assert!(
            w.counter(0, "icmp_error_translated") > 0,
            "the router's errors reached the client, but not translated by node a; {}",
            w.diagnosis()
        );
    }
}

#[test]
fn bulk_download_through_a_cluster_ip_from_a_pod() {
    download_through_a_cluster_ip::<Ipv4Addr>();
}

#[test]
fn ipv6_bulk_download_through_a_cluster_ip_from_a_pod() {
    download_through_a_cluster_ip::<Ipv6Addr>();
}

#[test]
fn bulk_download_through_a_node_port_with_snat_to_another_node() {
    download_through_a_node_port_with_snat::<Ipv4Addr>();
}

#[test]
fn ipv6_bulk_download_through_a_node_port_with_snat_to_another_node() {
    download_through_a_node_port_with_snat::<Ipv6Addr>();
}

#[test]
fn bulk_download_through_hairpin() {
    download_through_hairpin::<Ipv4Addr>();
}

#[test]
fn ipv6_bulk_download_through_hairpin() {
    download_through_hairpin::<Ipv6Addr>();
}

#[test]
fn path_mtu_from_a_hop_beyond_through_a_cluster_ip() {
    path_mtu_through_a_cluster_ip::<Ipv4Addr>(Between::RouterBeyond);
}

#[test]
fn ipv6_path_mtu_from_a_hop_beyond_through_a_cluster_ip() {
    path_mtu_through_a_cluster_ip::<Ipv6Addr>(Between::RouterBeyond);
}

#[test]
fn path_mtu_from_a_hop_beyond_through_a_node_port_with_snat() {
    path_mtu_through_a_node_port_with_snat::<Ipv4Addr>(Between::RouterBeyond);
}

#[test]
fn ipv6_path_mtu_from_a_hop_beyond_through_a_node_port_with_snat() {
    path_mtu_through_a_node_port_with_snat::<Ipv6Addr>(Between::RouterBeyond);
}

#[test]
fn path_mtu_from_the_node_itself_through_a_cluster_ip() {
    path_mtu_through_a_cluster_ip::<Ipv4Addr>(Between::NodesOwnLink);
}

#[test]
fn ipv6_path_mtu_from_the_node_itself_through_a_cluster_ip() {
    path_mtu_through_a_cluster_ip::<Ipv6Addr>(Between::NodesOwnLink);
}

#[test]
fn path_mtu_from_the_node_itself_through_a_node_port_with_snat() {
    path_mtu_through_a_node_port_with_snat::<Ipv4Addr>(Between::NodesOwnLink);
}

#[test]
fn ipv6_path_mtu_from_the_node_itself_through_a_node_port_with_snat() {
    path_mtu_through_a_node_port_with_snat::<Ipv6Addr>(Between::NodesOwnLink);
}
