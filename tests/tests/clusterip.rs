//! ClusterIP load balancing on real packets: a routed node (docs/architecture.md, "Test topologies") with a
//! client pod and three backend pods, ebpf-proxy in the node namespace, and real TCP
//! and UDP traffic from the client to the ClusterIP. The scenarios are
//! `clusterip_scenarios`'s, shared with clusterip6.rs. The node's own connections
//! through the socket hooks are in `socket_hooks.rs`; the pinned datapath across
//! agents (restarts, upgrades, resizes, cleanup) in `pinned_datapath.rs`.
//!
//! Every test builds its own namespaces, bpffs root and manifest directory, so they run
//! in parallel; everything is removed on drop, also when a test fails.

mod clusterip_scenarios;

use std::net::Ipv4Addr;

use clusterip_scenarios as scenario;

#[test]
fn distribution_matches_iptables_statistic() {
    scenario::distribution_matches_statistic_and_keeps_the_client_address::<Ipv4Addr>();
}

#[test]
fn udp_reaches_backends_with_client_address() {
    scenario::udp_reaches_backends_with_client_address::<Ipv4Addr>();
}

#[test]
fn fragmented_udp_is_translated_both_ways_as_iptables_does() {
    scenario::fragmented_udp_is_translated_both_ways::<Ipv4Addr>();
}

#[test]
fn a_closed_udp_port_behind_a_clusterip_is_refused_as_iptables_does() {
    scenario::a_closed_udp_port_behind_a_clusterip_is_refused_as_kube_proxy_does::<Ipv4Addr>();
}

#[test]
fn a_pods_flood_of_new_flows_leaves_established_connections_alone() {
    scenario::a_pods_flood_of_new_flows_leaves_established_connections_alone::<Ipv4Addr>();
}

#[test]
fn translated_packets_keep_valid_checksums_in_every_checksum_state() {
    scenario::translated_packets_keep_valid_checksums_in_every_checksum_state::<Ipv4Addr>();
}

#[test]
fn removed_endpoint_gets_no_new_connections_but_keeps_established_ones() {
    scenario::removed_endpoint_gets_no_new_connections_but_keeps_established_ones::<Ipv4Addr>();
}

#[test]
fn service_without_endpoints_is_refused_at_once() {
    scenario::service_without_endpoints_is_refused_at_once::<Ipv4Addr>();
}

#[test]
fn direct_connection_reusing_a_service_flows_port_is_left_alone() {
    scenario::direct_connection_reusing_a_service_flows_port_is_left_alone::<Ipv4Addr>();
}

#[test]
fn one_client_port_to_two_services_on_one_backend_stays_two_connections() {
    scenario::one_client_port_to_two_services_on_one_backend_stays_two_connections::<Ipv4Addr>();
}

#[test]
fn a_pod_reaching_itself_from_one_port_through_two_services_stays_two_connections() {
    scenario::a_pod_reaching_itself_from_one_port_through_two_services_stays_two_connections::<
        Ipv4Addr,
    >();
}

#[test]
fn tcp_port_reused_at_once_after_a_reset_is_answered() {
    scenario::tcp_port_reused_at_once_after_a_reset_is_answered::<Ipv4Addr>();
}

#[test]
fn pod_created_after_the_agent_started_is_served() {
    scenario::pod_created_after_the_agent_started_is_served::<Ipv4Addr>();
}

#[test]
fn a_pods_flood_of_answered_connections_leaves_others_established_alone() {
    scenario::a_pods_flood_of_answered_connections_leaves_others_established_alone::<Ipv4Addr>();
}

#[test]
fn a_reject_flood_is_held_to_the_icmp_error_budget() {
    scenario::a_reject_flood_is_held_to_the_icmp_error_budget::<Ipv4Addr>();
}

#[test]
fn the_service_cidr_refuses_undefined_ports_and_drops_unallocated_addresses() {
    scenario::the_service_cidr_refuses_undefined_ports_and_drops_unallocated_addresses::<Ipv4Addr>(
    );
}

#[test]
fn host_routing_bpf_sends_translated_packets_straight_into_pods() {
    scenario::host_routing_bpf_sends_translated_packets_straight_into_pods::<Ipv4Addr>();
}

#[test]
fn other_tc_filters_see_every_packet() {
    scenario::other_tc_filters_see_every_packet::<Ipv4Addr>();
}

#[test]
fn a_failed_attach_is_retried_until_it_lands() {
    scenario::a_failed_attach_is_retried_until_it_lands::<Ipv4Addr>();
}

#[test]
fn host_routing_leaves_shaped_pods_to_the_stack() {
    scenario::host_routing_leaves_shaped_pods_to_the_stack::<Ipv4Addr>();
}
