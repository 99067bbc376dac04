//! Session affinity, connection lifecycle, terminating endpoints and hairpin on real
//! packets: a routed node (docs/architecture.md, "Test topologies") with client and backend pods,
//! ebpf-proxy in the node namespace on a manifest directory the tests rewrite, and,
//! where kube-proxy's behaviour is the reference, kube-proxy's own iptables rules on
//! another VIP of the same node. The scenarios shared with lifecycle6.rs are in
//! `lifecycle_scenarios`, written once over the family.
//!
//! Every test builds its own namespaces, bpffs root and manifest directory, so they run
//! in parallel; everything is removed on drop, also when a test fails.

mod lifecycle_scenarios;

use std::net::Ipv4Addr;

use ebpf_proxy_tests::{
    Protocol,
    client::{TIMEOUT, TcpSession, tcp_request, udp_request},
    manifest::Service,
    topology::one_node::{BACKENDS, CLIENT, CLUSTER_IP, TCP_PORT, UDP_PORT, dns, http},
};
use lifecycle_scenarios as scenario;

/// The source address the datapath gives hairpin flows (`proxy_common::HAIRPIN_ADDR`).
const HAIRPIN_SRC: Ipv4Addr = Ipv4Addr::new(169, 254, 42, 1);

#[test]
fn client_ip_affinity_sticks_switches_and_expires() {
    scenario::client_ip_affinity_sticks_switches_and_expires::<Ipv4Addr>();
}

#[test]
fn affinity_matches_iptables_recent_rules() {
    scenario::affinity_expiry_matches_recent_rules::<Ipv4Addr>();
}

#[test]
fn established_connection_survives_scaling_3_10_3() {
    scenario::established_connection_survives_scaling_3_10_3::<Ipv4Addr>();
}

#[test]
fn udp_flow_moves_within_a_second_when_its_backend_is_removed() {
    scenario::udp_flow_moves_within_a_second_when_its_backend_is_removed::<Ipv4Addr>();
}

#[test]
fn terminating_endpoints_drain_and_are_the_fallback() {
    scenario::terminating_endpoints_drain_and_are_the_fallback::<Ipv4Addr>();
}

#[test]
fn affinity_holds_on_terminating_fallback_endpoints() {
    scenario::affinity_holds_on_terminating_fallback_endpoints::<Ipv4Addr>();
}

#[test]
fn stuck_client_moves_when_its_backend_stops_being_ready_or_is_removed() {
    scenario::stuck_client_moves_when_its_backend_stops_being_ready_or_is_removed::<Ipv4Addr>();
}

/// Hairpin: a pod that is the only endpoint of its service reaches itself through
/// the ClusterIP (TCP, a longer TCP exchange, and UDP); it sees itself as the hairpin
/// address, while every other pod going through the same service keeps its own
/// source address.
///
/// Apart from its IPv6 twin in clusterip6.rs because the two differ in substance: over
/// IPv4 a hairpin flow comes from the link-local hairpin address, over IPv6 from the
/// node's own address, which the agent is given with `--node-ip`.
#[test]
fn backend_reaches_itself_through_its_service_and_others_keep_their_address() {
    let (own, own_ip) = BACKENDS[0];
    let (other, other_ip) = BACKENDS[1];
    let svc = Service::new("test", "self", CLUSTER_IP)
        .port("http", 80, Protocol::Tcp, TCP_PORT)
        .port("dns", 53, Protocol::Udp, UDP_PORT);
    let sb = scenario::sandbox_with(&[CLIENT], &BACKENDS[..2], &svc.yaml(Some(&[own_ip])));
    let pod = &sb.pod(own).ns;

    for i in 0..3 {
        let reply = tcp_request(pod, http(CLUSTER_IP), TIMEOUT).expect_reply(&format!(
            "hairpin TCP connection {i} from {own} to its own service"
        ));
        assert_eq!(reply.backend, own);
        assert_eq!(
            *reply.peer.ip(),
            HAIRPIN_SRC,
            "a hairpin connection must reach the pod from the hairpin address, not from \
             itself (which the kernel would drop as martian)"
        );
    }
    let mut session = TcpSession::open(pod, http(CLUSTER_IP), TIMEOUT)
        .expect("long hairpin connection from the pod to its own service");
    for line in ["one", "two", "three"] {
        assert_eq!(
            session
                .exchange(line)
                .expect("exchange on a hairpin connection"),
            format!("{own} {line}")
        );
    }
    let udp = udp_request(pod, dns(CLUSTER_IP), TIMEOUT)
        .expect_reply(&format!("hairpin UDP from {own} to its own service"));
    assert_eq!((udp.backend.as_str(), *udp.peer.ip()), (own, HAIRPIN_SRC));

    for (name, ns, ip) in [
        (CLIENT.0, &sb.client().ns, CLIENT.1),
        (other, &sb.pod(other).ns, other_ip),
    ] {
        let tcp = tcp_request(ns, http(CLUSTER_IP), TIMEOUT)
            .expect_reply(&format!("TCP from {name} to the service of {own}"));
        assert_eq!(
            (tcp.backend.as_str(), *tcp.peer.ip()),
            (own, ip),
            "a flow from {name} that is not hairpin must keep its source address"
        );
        let udp = udp_request(ns, dns(CLUSTER_IP), TIMEOUT)
            .expect_reply(&format!("UDP from {name} to the service of {own}"));
        assert_eq!(
            (udp.backend.as_str(), *udp.peer.ip()),
            (own, ip),
            "a UDP flow from {name} that is not hairpin must keep its source address"
        );
    }
}

#[test]
fn affinity_entries_outliving_their_services_affinity_go_at_the_next_start() {
    scenario::affinity_entries_outliving_their_services_affinity_go_at_the_next_start::<Ipv4Addr>();
}

#[test]
fn udp_flow_sending_every_300ms_outlives_a_1s_timeout() {
    scenario::udp_flow_sending_every_300ms_outlives_a_1s_timeout::<Ipv4Addr>();
}
