//! docs/architecture.md ("Test topologies"): one node, routed (Calico style): a node namespace and one namespace
//! per pod, each pod joined to the node by a veth pair.
//!
//! A pod has its address as a /32 on `eth0` and `default via 169.254.1.1 dev eth0
//! onlink`; nothing owns 169.254.1.1. The node has a /32 route per pod through the
//! pod's host-side veth, answers ARP for the gateway by proxy ARP on that veth, and
//! forwards between pods. The agent runs in the node namespace and sees every pod's
//! packets at tc ingress of that pod's host-side veth.
//!
//! Every pod is dual-stack: next to its IPv4 address it has [`pod_ip6`] of it as a
//! /128, and `default via fe80::1 dev eth0`; the node's end of each veth owns `fe80::1`
//! (IPv6 has no proxy ARP to lean on, so the gateway is a real link-local address, as
//! Calico gives it) and routes the pod's /128 through it. Duplicate address detection
//! is off on both ends, so the addresses work the moment they exist.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};

use anyhow::{Context, Result, bail};

use crate::{
    Protocol,
    manifest::Service,
    netns::{NetNs, unique_stem},
};

/// The pods' default gateway. Link-local and owned by nobody: the node answers ARP for
/// it by proxy ARP, which is all a pod needs to send it every packet.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);

/// The node's own address (on its loopback): the source of its ARP requests to pods and
/// of anything it sends itself.
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 1);

/// The node's IPv6 address, for the tests that give the node one ([`add_node_ip6`]):
/// `--node-ip`'s IPv6 half, the source of its SNAT and hairpin over IPv6.
pub const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x100, 0, 0, 0, 0, 0, 1);

/// Puts [`NODE_IP6`] on `node`'s loopback, usable at once (no duplicate address
/// detection), as `NODE_IP` is.
pub fn add_node_ip6(node: &NetNs) -> Result<()> {
    node.ip(&[
        "-6",
        "addr",
        "add",
        &format!("{NODE_IP6}/128"),
        "dev",
        "lo",
        "nodad",
    ])
    .map(drop)
}

/// The pods' IPv6 default gateway, owned by the node's end of every pod's veth.
pub const GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);

/// The prefix of every pod's IPv6 address: `fd00:10::/96`, the IPv4 address in its low
/// 32 bits.
pub const POD_NET6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 0);

/// The IPv6 address of the pod whose IPv4 address is `ip` (10.200.0.11 ->
/// `fd00:10::ac8:b`), so that each test's IPv4 plan gives its IPv6 one.
pub fn pod_ip6(ip: Ipv4Addr) -> Ipv6Addr {
    Ipv6Addr::from(u128::from(POD_NET6) | u128::from(u32::from(ip)))
}

/// The one-node world the ClusterIP tests, the benches and the demo share: a client pod,
/// a second client for side-by-side references (so that neither conntrack holds the
/// other half's flows), and three backends serving TCP and UDP behind one ClusterIP.
pub mod one_node {
    use super::{Ipv4Addr, Ipv6Addr, Protocol, Service, SocketAddrV4, SocketAddrV6};

    pub const CLIENT: (&str, Ipv4Addr) = ("client", Ipv4Addr::new(10, 200, 0, 2));
    /// The client of a side-by-side reference (kube-proxy's rules) in the same test.
    pub const IPT_CLIENT: (&str, Ipv4Addr) = ("client-ipt", Ipv4Addr::new(10, 200, 0, 3));
    pub const BACKENDS: [(&str, Ipv4Addr); 3] = [
        ("backend-a", BACKEND_IPS[0]),
        ("backend-b", BACKEND_IPS[1]),
        ("backend-c", BACKEND_IPS[2]),
    ];
    /// The backends' addresses (the datapath's frame tests, which have no pods).
    pub const BACKEND_IPS: [Ipv4Addr; 3] = [
        Ipv4Addr::new(10, 200, 0, 11),
        Ipv4Addr::new(10, 200, 0, 12),
        Ipv4Addr::new(10, 200, 0, 13),
    ];
    /// The backends' ports (the Services' target ports).
    pub const TCP_PORT: u16 = 8080;
    pub const UDP_PORT: u16 = 5353;
    pub const CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
    /// The Service's ports.
    pub const TCP_SERVICE_PORT: u16 = 80;
    pub const UDP_SERVICE_PORT: u16 = 53;
    /// The ClusterIP's TCP frontend.
    pub const VIP: SocketAddrV4 = SocketAddrV4::new(CLUSTER_IP, TCP_SERVICE_PORT);
    /// The IPv6 ClusterIP of an IPv6 or dual-stack `test/web`.
    pub const CLUSTER_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);

    /// The backends' IPv6 addresses, in [`BACKENDS`] order.
    pub fn backend_ips6() -> Vec<Ipv6Addr> {
        BACKENDS.iter().map(|b| super::pod_ip6(b.1)).collect()
    }

    /// `test/web` with `http` 80/TCP -> 8080 and `dns` 53/UDP -> 5353.
    pub fn web_service(cluster_ip: Ipv4Addr) -> Service {
        Service::new("test", "web", cluster_ip)
            .port("http", TCP_SERVICE_PORT, Protocol::Tcp, TCP_PORT)
            .port("dns", UDP_SERVICE_PORT, Protocol::Udp, UDP_PORT)
    }

    /// The backends' pod names, in [`BACKENDS`] order.
    pub fn backend_names() -> Vec<&'static str> {
        BACKENDS.iter().map(|b| b.0).collect()
    }

    /// The backends' addresses, in [`BACKENDS`] order.
    pub fn backend_ips() -> Vec<Ipv4Addr> {
        BACKENDS.iter().map(|b| b.1).collect()
    }

    /// The `i`th ClusterIP from [`CLUSTER_IP`] up (10.96.0.0/12 holds a million): the
    /// benches' sets of S Services.
    pub fn cluster_ip(i: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(CLUSTER_IP) + i)
    }

    /// The `k`th of `per_service` endpoints of the `service`th Service nobody talks to:
    /// addresses in 10.128.0.0/9 that exist nowhere.
    pub fn filler_endpoint(service: u32, per_service: u32, k: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + service * per_service + k)
    }

    /// The `http` port of `test/web` on `ip`.
    pub fn http(ip: Ipv4Addr) -> SocketAddrV4 {
        SocketAddrV4::new(ip, TCP_SERVICE_PORT)
    }

    /// The `dns` port of `test/web` on `ip`.
    pub fn dns(ip: Ipv4Addr) -> SocketAddrV4 {
        SocketAddrV4::new(ip, UDP_SERVICE_PORT)
    }

    /// The `http` port of `test/web` on the IPv6 `ip`.
    pub fn http6(ip: Ipv6Addr) -> SocketAddrV6 {
        SocketAddrV6::new(ip, TCP_SERVICE_PORT, 0, 0)
    }

    /// The `dns` port of `test/web` on the IPv6 `ip`.
    pub fn dns6(ip: Ipv6Addr) -> SocketAddrV6 {
        SocketAddrV6::new(ip, UDP_SERVICE_PORT, 0, 0)
    }
}

/// The two-node world the north-south tests, the NodePort bench and the datapath's
/// NodePort frames share ([`crate::cluster::Cluster`] builds it): nodes on one network
/// with outside clients, joined by a bridge, each node with pod CIDR of its own.
pub mod two_node {
    use std::net::{Ipv4Addr, Ipv6Addr};

    /// The bridge in the bridge namespace.
    pub const BRIDGE: &str = "br0";
    /// The uplink of every node and client (the bridge port is its veth peer).
    pub const UPLINK: &str = "eth0";
    /// The network nodes and clients share.
    pub const NODE_NET: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 0);
    pub const NODE_NET_PREFIX: u8 = 24;
    /// Prefix length of every node's pod CIDR.
    pub const POD_CIDR_PREFIX: u8 = 24;
    /// The first node's address (node "a" in `crate::cluster::Cluster::new(&[("a", ..), ("b", ..)])`).
    pub const NODE_A_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 1);
    /// The second node's address.
    pub const NODE_B_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 2);
    /// The first node's pod CIDR, 10.1.1.0/24.
    pub const NODE_A_POD_NET: Ipv4Addr = Ipv4Addr::new(10, 1, 1, 0);
    /// The second node's pod CIDR, 10.1.2.0/24.
    pub const NODE_B_POD_NET: Ipv4Addr = Ipv4Addr::new(10, 1, 2, 0);
    pub const CLIENT1: (&str, Ipv4Addr) = ("client1", Ipv4Addr::new(192, 168, 50, 100));
    pub const CLIENT2: (&str, Ipv4Addr) = ("client2", Ipv4Addr::new(192, 168, 50, 101));
    /// The clients [`crate::cluster::Cluster::new`] adds.
    pub const DEFAULT_CLIENTS: [(&str, Ipv4Addr); 2] = [CLIENT1, CLIENT2];
    /// A pod of node b (the second node's pod CIDR).
    pub const NODE_B_POD: Ipv4Addr = Ipv4Addr::new(10, 1, 2, 10);

    /// The IPv6 network nodes and clients share, `fd00:50::/64`.
    pub const NODE_NET6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x50, 0, 0, 0, 0, 0, 0);
    pub const NODE_NET6_PREFIX: u8 = 64;
    /// Prefix length of every node's IPv6 pod CIDR: the [`super::pod_ip6`]s of its
    /// IPv4 pod CIDR's /24.
    pub const POD_CIDR6_PREFIX: u8 = 120;
    /// The first node's IPv6 address, [`uplink_ip6`] of [`NODE_A_IP`].
    pub const NODE_A_IP6: Ipv6Addr = uplink_ip6(NODE_A_IP);
    /// The second node's IPv6 address.
    pub const NODE_B_IP6: Ipv6Addr = uplink_ip6(NODE_B_IP);
    /// [`CLIENT1`]'s IPv6 address, `fd00:50::100`.
    pub const CLIENT1_IP6: Ipv6Addr = uplink_ip6(CLIENT1.1);
    /// [`CLIENT2`]'s IPv6 address, `fd00:50::101`.
    pub const CLIENT2_IP6: Ipv6Addr = uplink_ip6(CLIENT2.1);

    /// The IPv6 address of the node or client whose IPv4 address is `ip`: in
    /// [`NODE_NET6`], with the IPv4 host number's decimal digits as its last group
    /// (192.168.50.100 -> `fd00:50::100`), so that either address names the other
    /// at a glance.
    pub const fn uplink_ip6(ip: Ipv4Addr) -> Ipv6Addr {
        let host = ip.octets()[3] as u16;
        let digits = ((host / 100) << 8) | ((host / 10 % 10) << 4) | (host % 10);
        let [a, b, ..] = NODE_NET6.segments();
        Ipv6Addr::new(a, b, 0, 0, 0, 0, 0, digits)
    }
}

/// Longest interface name Linux takes (IFNAMSIZ - 1).
pub(crate) const IFNAME_MAX: usize = 15;

/// One pod: its namespace, address, and the node-side end of its veth.
#[derive(Debug)]
pub struct Pod {
    pub name: String,
    pub ip: Ipv4Addr,
    /// Its IPv6 address, [`pod_ip6`] of `ip`.
    pub ip6: Ipv6Addr,
    /// Name of the host-side veth in the node namespace.
    pub host_if: String,
    pub ns: NetNs,
}

/// A node namespace with routed pods. Dropping it deletes every namespace, and with
/// them the veths.
#[derive(Debug)]
pub struct Topology {
    stem: String,
    // Pods first: fields drop in declaration order, so pods go before their node.
    pods: Vec<Pod>,
    pub node: NetNs,
}

impl Topology {
    /// Builds the node and one pod per `(name, address)`. Namespace names are
    /// `ebpf-<pid>-<n>-node` and `ebpf-<pid>-<n>-<pod name>`, so tests can run in parallel.
    pub fn routed(pods: &[(&str, Ipv4Addr)]) -> Result<Topology> {
        let stem = unique_stem();
        let node = NetNs::create(&format!("{stem}-node"))?;
        let mut topology = Topology {
            stem,
            pods: Vec::new(),
            node,
        };
        topology.setup_node().context("node setup")?;
        for &(name, ip) in pods {
            topology
                .add_pod(name, ip)
                .with_context(|| format!("pod {name} ({ip})"))?;
        }
        Ok(topology)
    }

    fn setup_node(&self) -> Result<()> {
        self.node
            .ip(&["addr", "add", &format!("{NODE_IP}/32"), "dev", "lo"])?;
        prepare_routed_node(&self.node)
    }

    /// Adds a pod to a running topology (an interface the agent has to pick up later).
    pub fn add_pod(&mut self, name: &str, ip: Ipv4Addr) -> Result<&Pod> {
        if self.pods.iter().any(|p| p.name == name || p.ip == ip) {
            bail!("a pod named {name} or with address {ip} exists already");
        }
        let pod = create_pod(&self.node, &self.stem, self.pods.len(), name, ip)?;
        self.pods.push(pod);
        Ok(self.pods.last().expect("just pushed"))
    }

    /// The pod called `name`; panics if there is none (a bug in the test).
    pub fn pod(&self, name: &str) -> &Pod {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod named {name} in this topology"))
    }

    pub fn pods(&self) -> &[Pod] {
        &self.pods
    }

    /// The `ebpf-<pid>-<n>` stem shared by this topology's namespace names; handy for
    /// naming other per-test resources.
    pub fn stem(&self) -> &str {
        &self.stem
    }
}

/// Readies `node` for routed pods: the gateway route proxy ARP needs, forwarding, and
/// no reverse-path filtering. Shared by [`Topology`] and [`crate::cluster::Cluster`].
pub(crate) fn prepare_routed_node(node: &NetNs) -> Result<()> {
    // Proxy ARP answers only for addresses the node would route out of another
    // interface than the one the request came in on. A real node's default route
    // through its uplink covers the gateway; these sandboxes have no default route, so
    // the gateway gets a route of its own.
    node.ip(&["route", "add", &format!("{GATEWAY}/32"), "dev", "lo"])?;
    node.sysctl("net.ipv4.ip_forward", "1")?;
    node.sysctl("net.ipv6.conf.all.forwarding", "1")?;
    // Replies from a backend arrive reverse-NATed from the ClusterIP, an address
    // the node has no route back through that veth for; strict reverse-path
    // filtering would drop them.
    node.sysctl("net.ipv4.conf.all.rp_filter", "0")?;
    node.sysctl("net.ipv4.conf.default.rp_filter", "0")?;
    Ok(())
}

/// Creates the pod `name` with address `ip` as the namespace `<stem>-<name>`, joined to
/// `node` by a veth whose node end is `v<index>-<name>` (cut to 15 characters) and the
/// pod end `eth0`; routes and proxy ARP as the module doc describes.
pub(crate) fn create_pod(
    node: &NetNs,
    stem: &str,
    index: usize,
    name: &str,
    ip: Ipv4Addr,
) -> Result<Pod> {
    let host_if: String = format!("v{index}-{name}")
        .chars()
        .take(IFNAME_MAX)
        .collect();
    let ns = NetNs::create(&format!("{stem}-{name}"))?;
    // Created straight into the node and pod namespaces, so parallel tests never
    // see each other's interface names.
    node.ip(&[
        "link",
        "add",
        &host_if,
        "type",
        "veth",
        "peer",
        "name",
        "eth0",
        "netns",
        ns.name(),
    ])?;
    node.sysctl(&format!("net.ipv4.conf.{host_if}.proxy_arp"), "1")?;
    node.sysctl(&format!("net.ipv4.conf.{host_if}.rp_filter"), "0")?;
    // Proxy ARP replies to broadcast requests are delayed by up to proxy_delay
    // (0.8 s by default); Calico sets it to 0 as well.
    node.sysctl(&format!("net.ipv4.neigh.{host_if}.proxy_delay"), "0")?;
    node.sysctl(&format!("net.ipv6.conf.{host_if}.accept_dad"), "0")?;
    node.ip(&["link", "set", &host_if, "up"])?;
    node.ip(&["route", "add", &format!("{ip}/32"), "dev", &host_if])?;
    let gateway6 = GATEWAY6.to_string();
    node.ip(&[
        "-6",
        "addr",
        "add",
        &format!("{gateway6}/64"),
        "dev",
        &host_if,
        "nodad",
    ])?;
    let ip6 = pod_ip6(ip);
    node.ip(&["-6", "route", "add", &format!("{ip6}/128"), "dev", &host_if])?;

    ns.sysctl("net.ipv6.conf.eth0.accept_dad", "0")?;
    ns.ip(&["addr", "add", &format!("{ip}/32"), "dev", "eth0"])?;
    ns.ip(&[
        "-6",
        "addr",
        "add",
        &format!("{ip6}/128"),
        "dev",
        "eth0",
        "nodad",
    ])?;
    ns.ip(&["link", "set", "eth0", "up"])?;
    ns.ip(&[
        "route",
        "add",
        "default",
        "via",
        &GATEWAY.to_string(),
        "dev",
        "eth0",
        "onlink",
    ])?;
    ns.ip(&[
        "-6", "route", "add", "default", "via", &gateway6, "dev", "eth0",
    ])?;
    Ok(Pod {
        name: name.to_owned(),
        ip,
        ip6,
        host_if,
        ns,
    })
}
