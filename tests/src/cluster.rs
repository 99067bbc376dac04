//! docs/architecture.md ("Test topologies"): two nodes and outside clients, for north-south tests (NodePort,
//! LoadBalancer, ExternalIP): node namespaces and client namespaces on one Linux
//! bridge, the bridge in a namespace of its own.
//!
//! ```text
//!                      <stem>-br: br0 (192.168.50.0/24, no address of its own)
//!            n0-a      n1-b      c0-client1      c1-client2     (bridge ports)
//!             |         |             |               |
//!   <stem>-nodea   <stem>-nodeb   <stem>-client1   <stem>-client2
//!   eth0 .50.1     eth0 .50.2     eth0 .50.100     eth0 .50.101
//!   fd00:50::1     fd00:50::2     fd00:50::100     fd00:50::101
//!   pods 10.1.1/24 pods 10.1.2/24
//! ```
//!
//! - Node `i` (0-based, in the order added) has `192.168.50.<i+1>/24` on its uplink
//!   `eth0` and the pod CIDR `10.1.<i+1>.0/24`; every node routes every other node's pod
//!   CIDR via that node's address. Nodes forward and have reverse-path filtering off.
//! - Every node and client is dual-stack: its uplink also has [`uplink_ip6`] of its
//!   IPv4 address in `fd00:50::/64` (node `i` `fd00:50::<i+1>`), duplicate address
//!   detection off, so the address works the moment it exists. A node's IPv6 pod CIDR
//!   is the /120 of its pods' [`pod_ip6`]s (`fd00:10::a01:<i+1>00/120`), and every node
//!   routes every other node's through that node's IPv6 address.
//! - Pods are built exactly like [`crate::topology`]'s (same code): a /32 on `eth0`,
//!   `default via 169.254.1.1 dev eth0 onlink`, a /32 route and proxy ARP on the node's
//!   `v<i>-<pod>` veth. Nodes keep the `169.254.1.1/32 dev lo` route proxy ARP needs,
//!   but have no address on `lo`: theirs is on `eth0`.
//! - Clients (`client1` 192.168.50.100 and `client2` 192.168.50.101 by default) have
//!   their /24 on `eth0` and no route to the pod CIDRs, like hosts outside a cluster;
//!   [`Client::route_via`] / [`Cluster::route_via`] give them a route to a
//!   LoadBalancer IP or ExternalIP through a chosen node ([`Client::route_via6`] /
//!   [`Cluster::route_via6`] for IPv6), and [`Cluster::reroute_via`] /
//!   [`Cluster::reroute_via6`] move it to another node.
//! - Node and client uplinks checksum on transmit (`ethtool -K eth0 tx off`), so
//!   frames on the bridge carry complete checksums, as on a physical wire; XDP, which
//!   has no socket buffer, can only update complete ones.
//! - Each bridge port has GRO on (`ethtool -K <port> gro on`): that enables the veth's
//!   NAPI, without which frames an XDP redirect sends out of the node's `eth0` (into
//!   its peer, the bridge port) are dropped. (`XDP_TX` would also need an XDP program on
//!   the bridge port, or its frames wait until other traffic flushes the queue; the
//!   datapath redirects instead.)
//!
//! Namespaces are `<stem>-br`, `<stem>-node<name>`, `<stem>-<client>` and
//! `<stem>-<pod>`, with a fresh [`unique_stem`], so tests run in parallel. Dropping the
//! [`Cluster`] deletes them all (pods before their node, the bridge last).

use std::net::{Ipv4Addr, Ipv6Addr};

use anyhow::{Context, Result, bail};

use crate::{
    netns::{NetNs, unique_stem},
    run_cmd,
    topology::{IFNAME_MAX, Pod, create_pod, pod_ip6, prepare_routed_node},
};

// The two-node world's names and addresses live with the one-node world's in
// crate::topology; re-exported here, where the cluster that builds it lives.
pub use crate::topology::two_node::*;

/// Node addresses are .1 upwards; keep them below the clients' .100.
const MAX_NODES: usize = 99;

/// The uplink address of the node added `index`-th (0-based): 192.168.50.<index+1>.
pub fn node_ip(index: usize) -> Ipv4Addr {
    assert!(index < MAX_NODES, "at most {MAX_NODES} nodes");
    let [a, b, c, _] = NODE_NET.octets();
    Ipv4Addr::new(a, b, c, index as u8 + 1)
}

/// The IPv6 uplink address of the node added `index`-th (0-based):
/// `fd00:50::<index+1>`, [`uplink_ip6`] of [`node_ip`].
pub fn node_ip6(index: usize) -> Ipv6Addr {
    uplink_ip6(node_ip(index))
}

/// The pod network of the node added `index`-th (0-based): 10.1.<index+1>.0 (/24).
pub fn pod_net(index: usize) -> Ipv4Addr {
    assert!(index < MAX_NODES, "at most {MAX_NODES} nodes");
    Ipv4Addr::new(10, 1, index as u8 + 1, 0)
}

/// `ethtool`, which is in /usr/sbin, not always on a test's PATH.
pub fn ethtool() -> &'static str {
    const SBIN: &str = "/usr/sbin/ethtool";
    if std::path::Path::new(SBIN).exists() {
        SBIN
    } else {
        "ethtool"
    }
}

fn if_name(s: &str) -> String {
    s.chars().take(IFNAME_MAX).collect()
}

/// A node: its namespace, uplink address and pods.
#[derive(Debug)]
pub struct ClusterNode {
    /// The name given to [`Cluster::new`] / [`Cluster::add_node`] (`a`), what an
    /// EndpointSlice's `nodeName` should say.
    pub name: String,
    /// The uplink's address (192.168.50.x).
    pub ip: Ipv4Addr,
    /// The uplink's IPv6 address (`fd00:50::x`).
    pub ip6: Ipv6Addr,
    /// The node's uplink interface in its namespace, `eth0`.
    pub uplink: String,
    /// The uplink's veth peer, a port of [`BRIDGE`] in the bridge namespace.
    pub bridge_port: String,
    /// Network address of the pod CIDR ([`ClusterNode::pod_cidr`]).
    pub pod_net: Ipv4Addr,
    // Pods first: fields drop in declaration order, so pods go before their node.
    pods: Vec<Pod>,
    pub ns: NetNs,
}

impl ClusterNode {
    /// The pod CIDR, `10.1.x.0/24`.
    pub fn pod_cidr(&self) -> String {
        format!("{}/{POD_CIDR_PREFIX}", self.pod_net)
    }

    /// The IPv6 pod CIDR, `fd00:10::a01:x00/120`: the [`pod_ip6`]s of the pod CIDR.
    pub fn pod_cidr6(&self) -> String {
        format!("{}/{POD_CIDR6_PREFIX}", pod_ip6(self.pod_net))
    }

    /// True when `ip` is in this node's pod CIDR.
    pub fn owns_pod_ip(&self, ip: Ipv4Addr) -> bool {
        let mask = u32::MAX << (32 - POD_CIDR_PREFIX);
        u32::from(ip) & mask == u32::from(self.pod_net)
    }

    /// Address `host` of the pod CIDR (`pod_ip(10)` is 10.1.x.10 on this node).
    pub fn pod_ip(&self, host: u8) -> Ipv4Addr {
        let [a, b, c, _] = self.pod_net.octets();
        Ipv4Addr::new(a, b, c, host)
    }

    pub fn pods(&self) -> &[Pod] {
        &self.pods
    }
}

/// A host outside the cluster on the nodes' network.
#[derive(Debug)]
pub struct Client {
    pub name: String,
    /// The uplink's address (192.168.50.x).
    pub ip: Ipv4Addr,
    /// The uplink's IPv6 address, [`uplink_ip6`] of `ip` (`fd00:50::x`).
    pub ip6: Ipv6Addr,
    /// The client's uplink interface in its namespace, `eth0`.
    pub uplink: String,
    /// The uplink's veth peer, a port of [`BRIDGE`] in the bridge namespace.
    pub bridge_port: String,
    pub ns: NetNs,
}

/// Turns transmit checksum offload of `ns`'s uplink on or off. On (the veth default),
/// frames leave with the checksum still to be finished, as between containers of one
/// host; off, they carry complete checksums, as on a physical wire.
pub fn set_tx_checksum_offload(ns: &NetNs, on: bool) -> Result<()> {
    set_offload(ns, UPLINK, "tx", on)
}

/// `ethtool -K <ifname> <feature> on|off` in `ns`: e.g. `rx` off makes the stack
/// check received checksums itself, where a veth would otherwise vouch for them.
pub fn set_offload(ns: &NetNs, ifname: &str, feature: &str, on: bool) -> Result<()> {
    let state = if on { "on" } else { "off" };
    run_cmd(ns.command(ethtool()).args(["-K", ifname, feature, state]))
        .with_context(|| format!("ethtool -K {ifname} {feature} {state}"))?;
    Ok(())
}

impl Client {
    /// `ip route add <dest> via <gateway>`: e.g. a LoadBalancer IP or ExternalIP
    /// (`"192.168.60.10/32"`) through a node's address.
    pub fn route_via(&self, dest: &str, gateway: Ipv4Addr) -> Result<()> {
        self.ns
            .ip(&["route", "add", dest, "via", &gateway.to_string()])
            .map(drop)
            .with_context(|| format!("{}: route {dest} via {gateway}", self.name))
    }

    /// [`Client::route_via`] for IPv6: `ip -6 route add <dest> via <gateway>` (a
    /// LoadBalancer IP or ExternalIP such as `"fd00:60::10/128"` through a node's IPv6
    /// address).
    pub fn route_via6(&self, dest: &str, gateway: Ipv6Addr) -> Result<()> {
        self.ns
            .ip(&["-6", "route", "add", dest, "via", &gateway.to_string()])
            .map(drop)
            .with_context(|| format!("{}: route {dest} via {gateway}", self.name))
    }

    /// `ip route replace <dest> via <gateway>`: moves a route of
    /// [`Client::route_via`] to another node at once, as an ECMP change or a load
    /// balancer failing over moves a client's flows.
    pub fn reroute_via(&self, dest: &str, gateway: Ipv4Addr) -> Result<()> {
        self.ns
            .ip(&["route", "replace", dest, "via", &gateway.to_string()])
            .map(drop)
            .with_context(|| format!("{}: reroute {dest} via {gateway}", self.name))
    }

    /// [`Client::reroute_via`] for IPv6: `ip -6 route replace <dest> via <gateway>`.
    pub fn reroute_via6(&self, dest: &str, gateway: Ipv6Addr) -> Result<()> {
        self.ns
            .ip(&["-6", "route", "replace", dest, "via", &gateway.to_string()])
            .map(drop)
            .with_context(|| format!("{}: reroute {dest} via {gateway}", self.name))
    }
}

/// Nodes with routed pods and outside clients on one bridge; see the module doc.
/// Dropping it deletes every namespace, and with them the veths.
#[derive(Debug)]
pub struct Cluster {
    stem: String,
    // Fields drop in declaration order: nodes (each with its pods first), clients,
    // then the bridge.
    nodes: Vec<ClusterNode>,
    clients: Vec<Client>,
    bridge: NetNs,
}

impl Cluster {
    /// One node per `(node name, pods)` entry, in that order (so the first is
    /// 192.168.50.1 with pods in 10.1.1.0/24, the second 192.168.50.2 with
    /// 10.1.2.0/24), and the clients [`DEFAULT_CLIENTS`].
    ///
    /// ```no_run
    /// # use std::net::Ipv4Addr;
    /// # use ebpf_proxy_tests::cluster::Cluster;
    /// let cluster = Cluster::new(&[
    ///     ("a", &[("pod-a1", Ipv4Addr::new(10, 1, 1, 10))]),
    ///     ("b", &[("pod-b1", Ipv4Addr::new(10, 1, 2, 10))]),
    /// ])?;
    /// # anyhow::Ok(())
    /// ```
    pub fn new(nodes: &[(&str, &[(&str, Ipv4Addr)])]) -> Result<Cluster> {
        Cluster::with_clients(nodes, &DEFAULT_CLIENTS)
    }

    /// [`Cluster::new`] with other clients (`(name, address in 192.168.50.0/24)`).
    pub fn with_clients(
        nodes: &[(&str, &[(&str, Ipv4Addr)])],
        clients: &[(&str, Ipv4Addr)],
    ) -> Result<Cluster> {
        let stem = unique_stem();
        let bridge = NetNs::create(&format!("{stem}-br"))?;
        let mut cluster = Cluster {
            stem,
            nodes: Vec::new(),
            clients: Vec::new(),
            bridge,
        };
        cluster
            .bridge
            .ip(&["link", "add", BRIDGE, "type", "bridge"])
            .context("create the bridge")?;
        cluster.bridge.ip(&["link", "set", BRIDGE, "up"])?;
        for &(name, pods) in nodes {
            cluster
                .add_node(name)
                .with_context(|| format!("node {name}"))?;
            for &(pod, ip) in pods {
                cluster
                    .add_pod(name, pod, ip)
                    .with_context(|| format!("pod {pod} ({ip}) on node {name}"))?;
            }
        }
        for &(name, ip) in clients {
            cluster
                .add_client(name, ip)
                .with_context(|| format!("client {name} ({ip})"))?;
        }
        Ok(cluster)
    }

    /// Adds a node with the next address and pod CIDR, and routes between its pod
    /// CIDR and every other node's.
    pub fn add_node(&mut self, name: &str) -> Result<&ClusterNode> {
        if self.nodes.iter().any(|n| n.name == name) {
            bail!("a node named {name} exists already");
        }
        let index = self.nodes.len();
        if index >= MAX_NODES {
            bail!("at most {MAX_NODES} nodes");
        }
        let ns_name = format!("{}-node{name}", self.stem);
        self.check_ns_free(&ns_name)?;
        let ns = NetNs::create(&ns_name)?;
        let ip = node_ip(index);
        let ip6 = node_ip6(index);
        let bridge_port = self.plug(&ns, &format!("n{index}-{name}"), ip)?;
        prepare_routed_node(&ns)?;
        ns.sysctl(&format!("net.ipv4.conf.{UPLINK}.rp_filter"), "0")?;
        let node = ClusterNode {
            name: name.to_owned(),
            ip,
            ip6,
            uplink: UPLINK.to_owned(),
            bridge_port,
            pod_net: pod_net(index),
            pods: Vec::new(),
            ns,
        };
        for other in &self.nodes {
            let there = other.pod_cidr();
            node.ns
                .ip(&["route", "add", &there, "via", &other.ip.to_string()])?;
            other
                .ns
                .ip(&["route", "add", &node.pod_cidr(), "via", &ip.to_string()])?;
            let there6 = other.pod_cidr6();
            node.ns
                .ip(&["-6", "route", "add", &there6, "via", &other.ip6.to_string()])?;
            other.ns.ip(&[
                "-6",
                "route",
                "add",
                &node.pod_cidr6(),
                "via",
                &ip6.to_string(),
            ])?;
        }
        self.nodes.push(node);
        Ok(self.nodes.last().expect("just pushed"))
    }

    /// Adds a client with `ip` (in 192.168.50.0/24) on the bridge.
    pub fn add_client(&mut self, name: &str, ip: Ipv4Addr) -> Result<&Client> {
        if self.clients.iter().any(|c| c.name == name || c.ip == ip)
            || self.nodes.iter().any(|n| n.ip == ip)
        {
            bail!("a client named {name} or a host with address {ip} exists already");
        }
        let ns_name = format!("{}-{name}", self.stem);
        self.check_ns_free(&ns_name)?;
        let ns = NetNs::create(&ns_name)?;
        let bridge_port = self.plug(&ns, &format!("c{}-{name}", self.clients.len()), ip)?;
        self.clients.push(Client {
            name: name.to_owned(),
            ip,
            ip6: uplink_ip6(ip),
            uplink: UPLINK.to_owned(),
            bridge_port,
            ns,
        });
        Ok(self.clients.last().expect("just pushed"))
    }

    /// Adds a pod to node `node` (possibly while the agent runs); `ip` must be in the
    /// node's pod CIDR, and pod names are unique in the cluster.
    pub fn add_pod(&mut self, node: &str, name: &str, ip: Ipv4Addr) -> Result<&Pod> {
        if self.all_pods().any(|p| p.name == name || p.ip == ip) {
            bail!("a pod named {name} or with address {ip} exists already");
        }
        let ns_name = format!("{}-{name}", self.stem);
        self.check_ns_free(&ns_name)?;
        let stem = self.stem.clone();
        let Some(node) = self.nodes.iter_mut().find(|n| n.name == node) else {
            bail!("no node named {node}");
        };
        if !node.owns_pod_ip(ip) {
            bail!(
                "{ip} is not in node {}'s pod CIDR {}",
                node.name,
                node.pod_cidr()
            );
        }
        let pod = create_pod(&node.ns, &stem, node.pods.len(), name, ip)?;
        node.pods.push(pod);
        Ok(node.pods.last().expect("just pushed"))
    }

    /// Gives client `client` a route to `dest` (a CIDR such as `192.168.60.10/32`)
    /// through node `node`'s address.
    pub fn route_via(&self, client: &str, dest: &str, node: &str) -> Result<()> {
        self.client(client).route_via(dest, self.node(node).ip)
    }

    /// Gives client `client` a route to `dest` (an IPv6 CIDR such as
    /// `fd00:60::10/128`) through node `node`'s IPv6 address.
    pub fn route_via6(&self, client: &str, dest: &str, node: &str) -> Result<()> {
        self.client(client).route_via6(dest, self.node(node).ip6)
    }

    /// Moves client `client`'s route to `dest` (given by [`Cluster::route_via`]) to
    /// node `node`'s address.
    pub fn reroute_via(&self, client: &str, dest: &str, node: &str) -> Result<()> {
        self.client(client).reroute_via(dest, self.node(node).ip)
    }

    /// Moves client `client`'s route to `dest` (given by [`Cluster::route_via6`]) to
    /// node `node`'s IPv6 address.
    pub fn reroute_via6(&self, client: &str, dest: &str, node: &str) -> Result<()> {
        self.client(client).reroute_via6(dest, self.node(node).ip6)
    }

    /// The node called `name`; panics if there is none (a bug in the test).
    pub fn node(&self, name: &str) -> &ClusterNode {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node named {name} in this cluster"))
    }

    pub fn nodes(&self) -> &[ClusterNode] {
        &self.nodes
    }

    /// The pod called `name`, on whichever node; panics if there is none.
    pub fn pod(&self, name: &str) -> &Pod {
        self.all_pods()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod named {name} in this cluster"))
    }

    /// The node pod `name` runs on; panics if there is no such pod.
    pub fn pod_node(&self, name: &str) -> &ClusterNode {
        self.nodes
            .iter()
            .find(|n| n.pods.iter().any(|p| p.name == name))
            .unwrap_or_else(|| panic!("no pod named {name} in this cluster"))
    }

    /// Every pod, node by node.
    pub fn all_pods(&self) -> impl Iterator<Item = &Pod> {
        self.nodes.iter().flat_map(|n| n.pods.iter())
    }

    /// The client called `name`; panics if there is none.
    pub fn client(&self, name: &str) -> &Client {
        self.clients
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no client named {name} in this cluster"))
    }

    pub fn clients(&self) -> &[Client] {
        &self.clients
    }

    /// The namespace holding [`BRIDGE`] and every bridge port (to capture traffic).
    pub fn bridge(&self) -> &NetNs {
        &self.bridge
    }

    /// The `ebpf-<pid>-<n>` stem shared by this cluster's namespace names; handy for
    /// naming other per-test resources.
    pub fn stem(&self) -> &str {
        &self.stem
    }

    /// Fails if one of this cluster's namespaces is called `ns_name` already (a pod
    /// named like a client, say).
    fn check_ns_free(&self, ns_name: &str) -> Result<()> {
        let taken = std::iter::once(&self.bridge)
            .chain(self.nodes.iter().map(|n| &n.ns))
            .chain(self.clients.iter().map(|c| &c.ns))
            .chain(self.all_pods().map(|p| &p.ns))
            .any(|ns| ns.name() == ns_name);
        if taken {
            bail!("this cluster has a namespace {ns_name} already");
        }
        Ok(())
    }

    /// Joins `ns` to the bridge: a veth whose end in `ns` is [`UPLINK`] with
    /// `ip`/24 and [`uplink_ip6`] of it /64, and whose other end (`port`, cut to 15
    /// characters) is a bridge port with GRO on. Returns the port's name.
    fn plug(&self, ns: &NetNs, port: &str, ip: Ipv4Addr) -> Result<String> {
        let port = if_name(port);
        let bridge = &self.bridge;
        if bridge.ip(&["link", "show", &port]).is_ok() {
            bail!("bridge port {port} exists already (names cut to {IFNAME_MAX} characters)");
        }
        // Created straight into both namespaces, so parallel tests never see each
        // other's interface names.
        bridge.ip(&[
            "link",
            "add",
            &port,
            "type",
            "veth",
            "peer",
            "name",
            UPLINK,
            "netns",
            ns.name(),
        ])?;
        bridge.ip(&["link", "set", &port, "master", BRIDGE])?;
        // GRO turns on the veth's NAPI, which XDP redirects out of its peer (the
        // node's eth0) need; without it such frames are dropped.
        run_cmd(bridge.command(ethtool()).args(["-K", &port, "gro", "on"]))?;
        bridge.ip(&["link", "set", &port, "up"])?;
        // A veth hands frames on with the checksum still to be done
        // (CHECKSUM_PARTIAL) where a physical NIC puts complete ones on the wire;
        // XDP sees no socket buffer and can only update complete checksums.
        // Checksumming on transmit makes this wire look like a real one.
        set_tx_checksum_offload(ns, false)?;
        ns.ip(&[
            "addr",
            "add",
            &format!("{ip}/{NODE_NET_PREFIX}"),
            "dev",
            UPLINK,
        ])?;
        // Without duplicate address detection the addresses (the link-local one
        // included) work at once instead of a second or two after the link is up.
        ns.sysctl(&format!("net.ipv6.conf.{UPLINK}.accept_dad"), "0")?;
        ns.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{}/{NODE_NET6_PREFIX}", uplink_ip6(ip)),
            "dev",
            UPLINK,
            "nodad",
        ])?;
        ns.ip(&["link", "set", UPLINK, "up"])?;
        Ok(port)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_follow_the_node_order() {
        assert_eq!(node_ip(0), NODE_A_IP);
        assert_eq!(node_ip(1), NODE_B_IP);
        assert_eq!(pod_net(0), NODE_A_POD_NET);
        assert_eq!(pod_net(1), NODE_B_POD_NET);
        assert_eq!(node_ip6(0), NODE_A_IP6);
        assert_eq!(NODE_A_IP6, "fd00:50::1".parse::<Ipv6Addr>().unwrap());
        assert_eq!(node_ip6(1), "fd00:50::2".parse::<Ipv6Addr>().unwrap());
        assert_eq!(CLIENT1_IP6, "fd00:50::100".parse::<Ipv6Addr>().unwrap());
        assert_eq!(CLIENT2_IP6, "fd00:50::101".parse::<Ipv6Addr>().unwrap());
        assert_eq!(
            uplink_ip6(Ipv4Addr::new(192, 168, 50, 255)),
            "fd00:50::255".parse::<Ipv6Addr>().unwrap()
        );
        assert_eq!(if_name("c1-a-very-long-client-name"), "c1-a-very-long-");
    }
}
