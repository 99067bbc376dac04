//! North-south traffic over IPv6 on real packets: NodePorts on the nodes' IPv6
//! addresses, IPv6 LoadBalancer IPs and ExternalIPs, reached from clients outside
//! the cluster in the dual-stack two-node topology of docs/architecture.md, "Test
//! topologies" (`cluster`), with an agent on each node told both its addresses
//! (`--node-ip`). Each scenario runs with XDP on the uplinks, which translates and
//! sends back out what it can (`xdp_ingress6`, checked by its `xdp_tx` count) and
//! leaves the rest to tc intact, or through tc alone (`--xdp-mode off`). The
//! scenarios are `northsouth_scenarios`'s, shared with northsouth.rs.
//!
//! Every test builds its own namespaces, bpffs roots and manifest directory, so they
//! run in parallel; everything is removed on drop, also when a test fails.

mod northsouth_scenarios;

use std::net::{Ipv6Addr, SocketAddrV6};

use ebpf_proxy_tests::{cluster::NODE_A_IP6, topology::pod_ip6};
use northsouth_scenarios::{self as scenario, BACKEND, Fixture, LocalDetector, NODE_PORT, Path};

#[test]
fn ipv6_nodeport_cluster_policy_spreads_and_snats_remote_native_xdp() {
    scenario::nodeport_cluster_policy::<Ipv6Addr>(Path::Native);
}

#[test]
fn ipv6_nodeport_cluster_policy_spreads_and_snats_remote_generic_xdp() {
    scenario::nodeport_cluster_policy::<Ipv6Addr>(Path::Generic);
}

#[test]
fn ipv6_nodeport_cluster_policy_spreads_and_snats_remote_tc_only() {
    scenario::nodeport_cluster_policy::<Ipv6Addr>(Path::TcOnly);
}

#[test]
fn ipv6_local_policy_keeps_the_client_and_drops_without_local_endpoint_tc_only() {
    scenario::local_policy::<Ipv6Addr>(Path::TcOnly, LocalDetector::None);
}

/// `--detect-local-mode NodeCIDR`: a pod is in-cluster by its Node's
/// `spec.podCIDRs`, without `--cluster-cidr`.
#[test]
fn ipv6_local_policy_node_cidr_tc_only() {
    scenario::local_policy::<Ipv6Addr>(Path::TcOnly, LocalDetector::NodeCidr);
}

#[test]
fn ipv6_local_policy_keeps_the_client_and_drops_without_local_endpoint_native_xdp() {
    scenario::local_policy::<Ipv6Addr>(Path::Native, LocalDetector::ClusterCidr);
}

#[test]
fn ipv6_load_balancer_source_ranges_and_external_ip_tc_only() {
    scenario::load_balancer_and_external_ip::<Ipv6Addr>(Path::TcOnly);
}

#[test]
fn ipv6_load_balancer_source_ranges_and_external_ip_native_xdp() {
    scenario::load_balancer_and_external_ip::<Ipv6Addr>(Path::Native);
}

/// An IPv6 NodePort whose Service has no endpoints is refused at once, while the
/// NodePort next to it serves: the step of both families' `nodeport_cluster_policy`
/// scenarios, here on its own with XDP off.
#[test]
fn ipv6_nodeport_without_endpoints_is_refused() {
    let fx = Fixture::<Ipv6Addr>::new(Path::TcOnly);
    fx.publish(
        &scenario::web::<Ipv6Addr>("web"),
        &[(pod_ip6(BACKEND.1), "b")],
    );
    fx.reply_within(
        "client1",
        SocketAddrV6::new(NODE_A_IP6, NODE_PORT, 0, 0),
        "IPv6 NodePort on A",
    );
    scenario::refused_without_endpoints(&fx, Path::TcOnly);
}

#[test]
fn ipv6_nodeport_fragments_native_xdp() {
    scenario::nodeport_fragments::<Ipv6Addr>(Path::Native);
}

#[test]
fn ipv6_nodeport_fragments_tc_only() {
    scenario::nodeport_fragments::<Ipv6Addr>(Path::TcOnly);
}

#[test]
fn ipv6_nodeport_closed_port_is_refused_native_xdp() {
    scenario::nodeport_closed_port_is_refused::<Ipv6Addr>(Path::Native);
}

#[test]
fn ipv6_nodeport_closed_port_is_refused_tc_only() {
    scenario::nodeport_closed_port_is_refused::<Ipv6Addr>(Path::TcOnly);
}

#[test]
fn ipv6_concurrent_snat_flows_never_share_a_port() {
    scenario::concurrent_snat_flows_never_share_a_port::<Ipv6Addr>();
}

#[test]
fn ipv6_nodeport_syn_flood_native_xdp() {
    scenario::nodeport_syn_flood::<Ipv6Addr>(Path::Native);
}

#[test]
fn ipv6_nodeport_syn_flood_tc_only() {
    scenario::nodeport_syn_flood::<Ipv6Addr>(Path::TcOnly);
}

#[test]
fn ipv6_nodeport_auto_xdp_with_partial_checksums() {
    scenario::nodeport_auto_xdp_with_partial_checksums::<Ipv6Addr>();
}

/// `--masquerade-all` over IPv6: every new flow to a Service SNATed to the
/// node's IPv6 address.
#[test]
fn ipv6_masquerade_all_tc_only() {
    scenario::masquerade_all::<Ipv6Addr>(Path::TcOnly);
}

/// `--detect-local-mode InterfaceNamePrefix` over IPv6.
#[test]
fn ipv6_local_policy_interface_name_prefix_tc_only() {
    scenario::local_policy::<Ipv6Addr>(Path::TcOnly, LocalDetector::InterfaceNamePrefix);
}

/// Off-cluster clients of an IPv6 ClusterIP masqueraded to the node.
#[test]
fn ipv6_off_cluster_clients_of_a_cluster_ip_are_masqueraded_tc_only() {
    scenario::off_cluster_clients_of_a_cluster_ip::<Ipv6Addr>(Path::TcOnly);
}

/// `--detect-local-mode BridgeInterface` over IPv6.
#[test]
fn ipv6_local_policy_bridge_interface_tc_only() {
    scenario::local_policy::<Ipv6Addr>(Path::TcOnly, LocalDetector::BridgeInterface);
}

#[test]
fn ipv6_masqueraded_answers_to_a_node_port_tc_only() {
    scenario::masqueraded_answers_to_a_node_port::<Ipv6Addr>(Path::TcOnly);
}

#[test]
fn ipv6_masqueraded_answers_to_a_node_port_native_xdp() {
    scenario::masqueraded_answers_to_a_node_port::<Ipv6Addr>(Path::Native);
}
