//! What an IPv4 scenario and its IPv6 twin differ in, so that the one-node and
//! two-node scenarios run once over each family (docs/testing.md, "IPv4 scenarios
//! and their IPv6 twins"): the worlds' addresses of the family, its sockets, its
//! Service and EndpointSlice, kube-proxy's rules for it, the names its tools and
//! kernel settings go by and how the agent's status shows it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use crate::{
    client::Peer,
    cluster::{Cluster, ClusterNode},
    flood,
    iptables::{self, KubeService},
    manifest::{Endpoint, Service},
    netns::NetNs,
    topology::{
        NODE_IP, NODE_IP6, add_node_ip6,
        one_node::{BACKENDS, TCP_SERVICE_PORT, UDP_SERVICE_PORT},
        pod_ip6,
        two_node::uplink_ip6,
    },
};

/// An IP family of the one-node and two-node worlds: its addresses are `Self`
/// (`Ipv4Addr`, `Ipv6Addr`).
pub trait Family: iptables::Family + Into<IpAddr> {
    /// A socket address of the family.
    type Addr: Peer<Ip = Self>;
    /// How messages name the family.
    const NAME: &'static str;
    /// kube-proxy's rules tool of the family, as messages name the reference.
    const IPTABLES: &'static str;
    const UNSPECIFIED: Self;
    /// The sysctl of the kernel's ICMP error rate limit.
    const ICMP_RATELIMIT: &'static str;
    /// The SNMP counter (`ebpf_proxy_tests::snmp`) of the datagrams a
    /// namespace's stack forwarded.
    const FORWARDED: &'static str;
    /// The agent's conntrack maps of the family, as its status names them: the
    /// assured flows' and the unassured ones'.
    const CONNTRACK_MAPS: [&'static str; 2];
    /// How `ebpf-proxy status` begins the line that shows the node's address of the
    /// family.
    const STATUS_NODE_IP: &'static str;
    /// The prefix length of one address of the family, as a route or a source
    /// range names a single host.
    const HOST_PREFIX: u8;
    /// The agent's `--cluster-cidr` that makes every pod of the two-node world an
    /// in-cluster client over this family (over IPv6 both families' pod networks,
    /// as a dual-stack cluster's).
    const CLUSTER_CIDR: &'static str;
    /// The agent's `--service-cluster-ip-range` of the family: every
    /// [`Family::vip`] is in it.
    const SERVICE_CIDR: &'static str;

    /// The node's address of the family, which its own connections come from.
    fn node_ip() -> Self;

    /// Gives `node` its address of the family where the one-node world does not
    /// already (IPv6: [`add_node_ip6`]).
    fn give_node_its_address(node: &NetNs) -> anyhow::Result<()>;

    /// How a socket address shows the node's address, up to its port:
    /// `10.100.0.1:`, `[fd00:100::1]:`.
    fn node_prefix() -> String {
        Self::prefix(Self::node_ip())
    }

    /// How a socket address shows `ip`, up to its port.
    fn prefix(ip: Self) -> String {
        let addr = Self::addr(ip, 0).to_string();
        addr.strip_suffix('0').unwrap_or(&addr).to_owned()
    }

    /// The address of the pod whose IPv4 address is `ip` (every pod is dual-stack).
    fn pod(ip: Ipv4Addr) -> Self;

    /// The `n`th address of the service range (`n` < 100): 10.96.0.`n`, or
    /// `fd00:96::` with `n`'s decimal digits as its last group, so that either
    /// family's VIP names the other at a glance.
    fn vip(n: u8) -> Self;

    fn addr(ip: Self, port: u16) -> Self::Addr;

    /// The two-node world's address of the family of the node or client whose
    /// IPv4 address is `ip` (every uplink is dual-stack).
    fn uplink(ip: Ipv4Addr) -> Self;

    /// The `n`th address outside the cluster that LoadBalancer IPs and ExternalIPs
    /// of the two-node world come from (`n` < 100): 192.168.60.`n`, or `fd00:60::`
    /// with `n`'s decimal digits as its last group.
    fn external(n: u8) -> Self;

    /// `client` of `cluster` routes `dest` (a host) through node `node`'s address
    /// of the family.
    fn route_via(cluster: &Cluster, client: &str, dest: Self, node: &str) -> anyhow::Result<()>;

    /// Moves `client`'s route to `dest` (given by [`Family::route_via`]) to node
    /// `node`'s address of the family.
    fn reroute_via(cluster: &Cluster, client: &str, dest: Self, node: &str) -> anyhow::Result<()>;

    /// The `--node-ip` of an agent on `node` of the two-node world, if the family's
    /// scenarios give one: over IPv4 the agent finds the node's address itself, and
    /// its status shows what it found; over IPv6 it is told both of the node's
    /// addresses.
    fn node_ip_arg(node: &ClusterNode) -> Option<String>;

    /// `service` and its EndpointSlice of this family with `endpoints` ready, each
    /// on its node (`nodeName`, which externalTrafficPolicy Local and the SNAT of
    /// flows to other nodes go by), as one multi-document file.
    fn yaml_on_nodes(service: &Service, endpoints: &[(Self, &str)]) -> String;

    /// Sends `count` TCP SYNs of the family from `src` to `dst` from the calling
    /// thread's network namespace ([`flood`]), `pace` called after every burst;
    /// how many the kernel took.
    fn syn_flood_here(
        src: Self,
        dst: Self::Addr,
        count: u32,
        pace: impl FnMut(u32),
    ) -> anyhow::Result<u32>;

    /// How `ebpf-proxy status` says that the family's flows to other nodes'
    /// backends are SNATed to `ip`.
    fn status_snat(ip: Self) -> String;

    /// The family's unspecified address at `port`, where a client socket binds.
    fn any(port: u16) -> SocketAddr {
        Self::addr(Self::UNSPECIFIED, port).into()
    }

    /// A Service of this family alone, without ports.
    fn service(namespace: &str, name: &str, cluster_ip: Self) -> Service;

    /// `service` and its EndpointSlice of this family with `endpoints` and their
    /// conditions, as one multi-document file.
    fn yaml_with(service: &Service, endpoints: &[Endpoint<Self>]) -> String;

    /// kube-proxy's view of `service`'s port `port_name` on `vip` with `endpoints`
    /// (at the port's target port), for this family's proxier.
    fn kube_service(
        service: &Service,
        port_name: &str,
        vip: Self,
        endpoints: &[Self],
    ) -> KubeService<Self>;

    /// The test Services' ClusterIP, [`Family::vip`] 10.
    fn cluster_ip() -> Self {
        Self::vip(10)
    }

    /// The VIP of a side-by-side kube-proxy reference, [`Family::vip`] 20: the
    /// agent does not know it, so its programs pass that traffic to netfilter
    /// untouched.
    fn ipt_vip() -> Self {
        Self::vip(20)
    }

    /// The `http` port of `test/web` on `ip`.
    fn http(ip: Self) -> Self::Addr {
        Self::addr(ip, TCP_SERVICE_PORT)
    }

    /// The `dns` port of `test/web` on `ip`.
    fn dns(ip: Self) -> Self::Addr {
        Self::addr(ip, UDP_SERVICE_PORT)
    }

    /// The one-node backends' addresses, in `BACKENDS` order.
    fn backend_ips() -> Vec<Self> {
        BACKENDS.iter().map(|b| Self::pod(b.1)).collect()
    }

    /// `service` and its EndpointSlice with `endpoints` ready.
    fn yaml(service: &Service, endpoints: &[Self]) -> String {
        let endpoints: Vec<Endpoint<Self>> =
            endpoints.iter().map(|ip| Endpoint::ready(*ip)).collect();
        Self::yaml_with(service, &endpoints)
    }
}

impl Family for Ipv4Addr {
    type Addr = SocketAddrV4;
    const NAME: &'static str = "IPv4";
    const IPTABLES: &'static str = "iptables";
    const UNSPECIFIED: Self = Ipv4Addr::UNSPECIFIED;
    const ICMP_RATELIMIT: &'static str = "net.ipv4.icmp_ratelimit";
    const FORWARDED: &'static str = "IpForwDatagrams";
    const CONNTRACK_MAPS: [&'static str; 2] = ["CONNTRACK", "CT_NEW"];
    const STATUS_NODE_IP: &'static str = "node addresses: ";
    const HOST_PREFIX: u8 = 32;
    const CLUSTER_CIDR: &'static str = "10.1.0.0/16";
    const SERVICE_CIDR: &'static str = "10.96.0.0/16";

    fn node_ip() -> Self {
        NODE_IP
    }

    fn give_node_its_address(_: &NetNs) -> anyhow::Result<()> {
        // The routed topology gives the node its IPv4 address.
        Ok(())
    }

    fn pod(ip: Ipv4Addr) -> Self {
        ip
    }

    fn vip(n: u8) -> Self {
        Ipv4Addr::new(10, 96, 0, n)
    }

    fn addr(ip: Self, port: u16) -> SocketAddrV4 {
        SocketAddrV4::new(ip, port)
    }

    fn uplink(ip: Ipv4Addr) -> Self {
        ip
    }

    fn external(n: u8) -> Self {
        Ipv4Addr::new(192, 168, 60, n)
    }

    fn route_via(cluster: &Cluster, client: &str, dest: Self, node: &str) -> anyhow::Result<()> {
        cluster.route_via(client, &format!("{dest}/{}", Self::HOST_PREFIX), node)
    }

    fn reroute_via(cluster: &Cluster, client: &str, dest: Self, node: &str) -> anyhow::Result<()> {
        cluster.reroute_via(client, &format!("{dest}/{}", Self::HOST_PREFIX), node)
    }

    fn node_ip_arg(_: &ClusterNode) -> Option<String> {
        None
    }

    fn yaml_on_nodes(service: &Service, endpoints: &[(Self, &str)]) -> String {
        let endpoints: Vec<_> = endpoints
            .iter()
            .map(|(ip, node)| Endpoint::ready(*ip).on_node(node))
            .collect();
        service.yaml_with(&endpoints)
    }

    fn syn_flood_here(
        src: Self,
        dst: SocketAddrV4,
        count: u32,
        pace: impl FnMut(u32),
    ) -> anyhow::Result<u32> {
        flood::syn_flood_here(src, dst, count, pace)
    }

    fn status_snat(ip: Self) -> String {
        format!("SNAT to {ip} ports 1024-29999")
    }

    fn service(namespace: &str, name: &str, cluster_ip: Self) -> Service {
        Service::new(namespace, name, cluster_ip)
    }

    fn yaml_with(service: &Service, endpoints: &[Endpoint<Self>]) -> String {
        service.yaml_with(endpoints)
    }

    fn kube_service(
        service: &Service,
        port_name: &str,
        vip: Self,
        endpoints: &[Self],
    ) -> KubeService<Self> {
        service.kube_service(port_name, vip, endpoints)
    }
}

impl Family for Ipv6Addr {
    type Addr = SocketAddrV6;
    const NAME: &'static str = "IPv6";
    const IPTABLES: &'static str = "ip6tables";
    const UNSPECIFIED: Self = Ipv6Addr::UNSPECIFIED;
    const ICMP_RATELIMIT: &'static str = "net.ipv6.icmp.ratelimit";
    const FORWARDED: &'static str = "Ip6OutForwDatagrams";
    const CONNTRACK_MAPS: [&'static str; 2] = ["CONNTRACK6", "CT_NEW6"];
    const STATUS_NODE_IP: &'static str = "node IPv6 address: ";
    const HOST_PREFIX: u8 = 128;
    const CLUSTER_CIDR: &'static str = "10.1.0.0/16,fd00:10::/96";
    const SERVICE_CIDR: &'static str = "fd00:96::/112";

    fn node_ip() -> Self {
        NODE_IP6
    }

    fn give_node_its_address(node: &NetNs) -> anyhow::Result<()> {
        add_node_ip6(node)
    }

    fn pod(ip: Ipv4Addr) -> Self {
        pod_ip6(ip)
    }

    fn vip(n: u8) -> Self {
        assert!(n < 100, "vip({n}): two decimal digits at most");
        let digits = (u16::from(n / 10) << 4) | u16::from(n % 10);
        Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, digits)
    }

    fn addr(ip: Self, port: u16) -> SocketAddrV6 {
        SocketAddrV6::new(ip, port, 0, 0)
    }

    fn uplink(ip: Ipv4Addr) -> Self {
        uplink_ip6(ip)
    }

    fn external(n: u8) -> Self {
        assert!(n < 100, "external({n}): two decimal digits at most");
        let digits = (u16::from(n / 10) << 4) | u16::from(n % 10);
        Ipv6Addr::new(0xfd00, 0x60, 0, 0, 0, 0, 0, digits)
    }

    fn route_via(cluster: &Cluster, client: &str, dest: Self, node: &str) -> anyhow::Result<()> {
        cluster.route_via6(client, &format!("{dest}/{}", Self::HOST_PREFIX), node)
    }

    fn reroute_via(cluster: &Cluster, client: &str, dest: Self, node: &str) -> anyhow::Result<()> {
        cluster.reroute_via6(client, &format!("{dest}/{}", Self::HOST_PREFIX), node)
    }

    fn node_ip_arg(node: &ClusterNode) -> Option<String> {
        Some(format!("{},{}", node.ip, node.ip6))
    }

    fn yaml_on_nodes(service: &Service, endpoints: &[(Self, &str)]) -> String {
        service.yaml6_on_nodes(endpoints)
    }

    fn syn_flood_here(
        src: Self,
        dst: SocketAddrV6,
        count: u32,
        pace: impl FnMut(u32),
    ) -> anyhow::Result<u32> {
        flood::syn_flood6_here(src, dst, count, pace)
    }

    fn status_snat(ip: Self) -> String {
        format!("node IPv6 address: {ip}")
    }

    fn service(namespace: &str, name: &str, cluster_ip: Self) -> Service {
        Service::new_v6(namespace, name, cluster_ip)
    }

    fn yaml_with(service: &Service, endpoints: &[Endpoint<Self>]) -> String {
        service.yaml6_with(endpoints)
    }

    fn kube_service(
        service: &Service,
        port_name: &str,
        vip: Self,
        endpoints: &[Self],
    ) -> KubeService<Self> {
        service.kube_service6(port_name, vip, endpoints)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topology::{
        POD_NET6,
        one_node::{CLUSTER_IP, CLUSTER_IP6},
        two_node::{CLIENT1, CLIENT1_IP6},
    };

    #[test]
    fn each_familys_vips_name_the_other() {
        assert_eq!(<Ipv4Addr as Family>::cluster_ip(), CLUSTER_IP);
        assert_eq!(<Ipv6Addr as Family>::cluster_ip(), CLUSTER_IP6);
        assert_eq!(
            <Ipv6Addr as Family>::vip(51),
            "fd00:96::51".parse::<Ipv6Addr>().unwrap()
        );
        assert_eq!(
            <Ipv4Addr as Family>::ipt_vip(),
            Ipv4Addr::new(10, 96, 0, 20)
        );
    }

    #[test]
    fn the_node_prefix_is_its_address_up_to_the_port() {
        assert_eq!(<Ipv4Addr as Family>::node_prefix(), "10.100.0.1:");
        assert_eq!(<Ipv6Addr as Family>::node_prefix(), "[fd00:100::1]:");
    }

    #[test]
    fn the_two_node_worlds_addresses_name_each_other() {
        assert_eq!(<Ipv6Addr as Family>::uplink(CLIENT1.1), CLIENT1_IP6);
        assert_eq!(
            <Ipv6Addr as Family>::external(10),
            "fd00:60::10".parse::<Ipv6Addr>().unwrap()
        );
        assert_eq!(
            <Ipv4Addr as Family>::external(20),
            Ipv4Addr::new(192, 168, 60, 20)
        );
        assert_eq!(
            <Ipv6Addr as Family>::CLUSTER_CIDR,
            format!("{},{POD_NET6}/96", <Ipv4Addr as Family>::CLUSTER_CIDR),
            "the IPv6 cluster CIDR must hold both families' pod networks"
        );
    }
}
