//! The IPv6 twins of lifecycle.rs: session affinity, connection lifecycle and
//! terminating endpoints of an IPv6 Service on real packets, in the routed node of
//! clusterip6.rs (dual-stack pods, docs/architecture.md, "Test topologies"), with
//! kube-proxy's own ip6tables rules on another VIP of the same node where its
//! behaviour is the reference. The scenarios are `lifecycle_scenarios`'s, shared with
//! lifecycle.rs; hairpin over IPv6 is in clusterip6.rs.
//!
//! Every test builds its own namespaces, bpffs root and manifest directory, so they run
//! in parallel; everything is removed on drop, also when a test fails.

mod lifecycle_scenarios;

use std::net::Ipv6Addr;

use lifecycle_scenarios as scenario;

#[test]
fn ipv6_client_ip_affinity_sticks_switches_and_expires() {
    scenario::client_ip_affinity_sticks_switches_and_expires::<Ipv6Addr>();
}

#[test]
fn ipv6_affinity_expiry_matches_ip6tables_recent_rules() {
    scenario::affinity_expiry_matches_recent_rules::<Ipv6Addr>();
}

#[test]
fn ipv6_established_connection_survives_scaling_3_10_3() {
    scenario::established_connection_survives_scaling_3_10_3::<Ipv6Addr>();
}

#[test]
fn ipv6_udp_flow_moves_within_a_second_when_its_backend_is_removed() {
    scenario::udp_flow_moves_within_a_second_when_its_backend_is_removed::<Ipv6Addr>();
}

#[test]
fn ipv6_terminating_endpoints_drain_and_are_the_fallback() {
    scenario::terminating_endpoints_drain_and_are_the_fallback::<Ipv6Addr>();
}

#[test]
fn ipv6_affinity_holds_on_terminating_fallback_endpoints() {
    scenario::affinity_holds_on_terminating_fallback_endpoints::<Ipv6Addr>();
}

#[test]
fn ipv6_stuck_client_moves_when_its_backend_stops_being_ready_or_is_removed() {
    scenario::stuck_client_moves_when_its_backend_stops_being_ready_or_is_removed::<Ipv6Addr>();
}

#[test]
fn ipv6_affinity_entries_outliving_their_services_affinity_go_at_the_next_start() {
    scenario::affinity_entries_outliving_their_services_affinity_go_at_the_next_start::<Ipv6Addr>();
}

#[test]
fn ipv6_udp_flow_sending_every_300ms_outlives_a_1s_timeout() {
    scenario::udp_flow_sending_every_300ms_outlives_a_1s_timeout::<Ipv6Addr>();
}
