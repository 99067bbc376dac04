//! North-south traffic on real packets: NodePorts, LoadBalancer IPs and ExternalIPs
//! reached from clients outside the cluster, in the two-node topology of
//! docs/architecture.md, "Test topologies" (`cluster`), with an agent on each node.
//! Each scenario runs through XDP (native on these veths, and generic) and through tc
//! alone (`--xdp-mode off`). The scenarios shared with northsouth6.rs are
//! `northsouth_scenarios`'s, written once over the family.
//!
//! Every test builds its own namespaces, bpffs roots and manifest directory, so they
//! run in parallel; everything is removed on drop, also when a test fails.

mod northsouth_scenarios;

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use ebpf_proxy_tests::{
    agent::http_get,
    client::{Outcome, tcp_request},
    cluster::NODE_A_IP,
    manifest::{ServiceType, TrafficPolicy},
    wait_for, wait_until,
};
use northsouth_scenarios::{self as scenario, BACKEND, Fixture, HEALTH_PORT, LocalDetector, Path};

#[test]
fn nodeport_fragments_native_xdp() {
    scenario::nodeport_fragments::<Ipv4Addr>(Path::Native);
}

#[test]
fn nodeport_fragments_tc_only() {
    scenario::nodeport_fragments::<Ipv4Addr>(Path::TcOnly);
}

#[test]
fn nodeport_closed_port_is_refused_native_xdp() {
    scenario::nodeport_closed_port_is_refused::<Ipv4Addr>(Path::Native);
}

#[test]
fn nodeport_closed_port_is_refused_tc_only() {
    scenario::nodeport_closed_port_is_refused::<Ipv4Addr>(Path::TcOnly);
}

#[test]
fn nodeport_syn_flood_native_xdp() {
    scenario::nodeport_syn_flood::<Ipv4Addr>(Path::Native);
}

#[test]
fn nodeport_syn_flood_tc_only() {
    scenario::nodeport_syn_flood::<Ipv4Addr>(Path::TcOnly);
}

#[test]
fn nodeport_cluster_policy_native_xdp() {
    scenario::nodeport_cluster_policy::<Ipv4Addr>(Path::Native);
}

#[test]
fn nodeport_cluster_policy_generic_xdp() {
    scenario::nodeport_cluster_policy::<Ipv4Addr>(Path::Generic);
}

#[test]
fn nodeport_cluster_policy_tc_only() {
    scenario::nodeport_cluster_policy::<Ipv4Addr>(Path::TcOnly);
}

#[test]
fn nodeport_auto_xdp_with_partial_checksums() {
    scenario::nodeport_auto_xdp_with_partial_checksums::<Ipv4Addr>();
}

#[test]
fn local_policy_native_xdp() {
    scenario::local_policy::<Ipv4Addr>(Path::Native, LocalDetector::ClusterCidr);
}

#[test]
fn local_policy_tc_only() {
    scenario::local_policy::<Ipv4Addr>(Path::TcOnly, LocalDetector::None);
}

/// `--detect-local-mode NodeCIDR`: a pod is in-cluster by its Node's
/// `spec.podCIDRs`, without `--cluster-cidr`.
#[test]
fn local_policy_node_cidr_tc_only() {
    scenario::local_policy::<Ipv4Addr>(Path::TcOnly, LocalDetector::NodeCidr);
}

/// A healthCheckNodePort that something else holds when the Service arrives
/// opens once it is freed, with nothing else changing: the agent retries it,
/// where the load balancer would otherwise see the node as one without
/// endpoints until the Services next change.
///
/// IPv4 alone: one listener serves both families, and the retry is the agent's,
/// not a family's.
#[test]
fn health_check_port_opens_once_freed() {
    let fx = Fixture::<Ipv4Addr>::new(Path::TcOnly);
    let squatter = fx
        .cluster
        .node("a")
        .ns
        .run(|| std::net::TcpListener::bind((Ipv4Addr::UNSPECIFIED, HEALTH_PORT)))
        .and_then(|r| Ok(r?))
        .expect("holding the health check port on node A");
    let service = scenario::web::<Ipv4Addr>("local")
        .type_(ServiceType::LoadBalancer)
        .external_traffic_policy(TrafficPolicy::Local)
        .health_check_node_port(HEALTH_PORT);
    fx.publish(&service, &[(BACKEND.1, "b")]);
    let health = |node: Ipv4Addr| {
        fx.client("client1")
            .run(|| http_get(SocketAddrV4::new(node, HEALTH_PORT), "/"))
            .expect("run in client")
    };
    let tried = wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        let log = fx.agents[0].log();
        if log.contains("could not open health check node port") {
            Ok(())
        } else {
            Err(format!("its log:\n{log}"))
        }
    });
    if let Err(last) = tried {
        panic!("node A's agent never tried the held port; {last}");
    }
    drop(squatter);
    let opened = wait_for(Duration::from_secs(15), Duration::from_millis(100), || {
        health(NODE_A_IP)
    });
    let (status, body) = match opened {
        Ok((answer, _)) => answer,
        Err(last) => panic!(
            "the health check port on A never opened once freed: {last}; agent log:\n{}",
            fx.agents[0].log()
        ),
    };
    assert_eq!(
        status, 503,
        "health check on A (no local endpoint):\n{body}"
    );
    assert!(body.contains("\"name\": \"local\""), "{body}");
}

#[test]
fn load_balancer_and_external_ip_native_xdp() {
    scenario::load_balancer_and_external_ip::<Ipv4Addr>(Path::Native);
}

#[test]
fn load_balancer_and_external_ip_tc_only() {
    scenario::load_balancer_and_external_ip::<Ipv4Addr>(Path::TcOnly);
}

#[test]
fn concurrent_snat_flows_never_share_a_port() {
    scenario::concurrent_snat_flows_never_share_a_port::<Ipv4Addr>();
}

/// `--masquerade-all`: every new flow to a Service SNATed to the node.
#[test]
fn masquerade_all_tc_only() {
    scenario::masquerade_all::<Ipv4Addr>(Path::TcOnly);
}

#[test]
fn masquerade_all_native_xdp() {
    scenario::masquerade_all::<Ipv4Addr>(Path::Native);
}

/// `--detect-local-mode InterfaceNamePrefix`: a pod is in-cluster by the
/// interface its packets arrive on.
#[test]
fn local_policy_interface_name_prefix_tc_only() {
    scenario::local_policy::<Ipv4Addr>(Path::TcOnly, LocalDetector::InterfaceNamePrefix);
}

/// `--detect-local-mode BridgeInterface`, through native XDP.
#[test]
fn local_policy_bridge_interface_native_xdp() {
    scenario::local_policy::<Ipv4Addr>(Path::Native, LocalDetector::BridgeInterface);
}

#[test]
fn off_cluster_clients_of_a_cluster_ip_are_masqueraded_tc_only() {
    scenario::off_cluster_clients_of_a_cluster_ip::<Ipv4Addr>(Path::TcOnly);
}

#[test]
fn off_cluster_clients_of_a_cluster_ip_are_masqueraded_native_xdp() {
    scenario::off_cluster_clients_of_a_cluster_ip::<Ipv4Addr>(Path::Native);
}

/// `--nodeport-addresses primary` (kube-proxy's nftables-mode default): a
/// NodePort is served on the node's primary address (`--node-ip`) and not
/// on a second address of the same interface, which serves it without the
/// keyword.
#[test]
fn nodeport_addresses_primary_serves_the_primary_address_only() {
    const SECOND: Ipv4Addr = Ipv4Addr::new(192, 168, 50, 201);
    for primary in [true, false] {
        let node_a = NODE_A_IP.to_string();
        let mut args = vec!["--node-ip", node_a.as_str()];
        if primary {
            args.extend(["--nodeport-addresses", "primary"]);
        }
        let fx = Fixture::<Ipv4Addr>::with_args(Path::TcOnly, &args);
        fx.cluster
            .node("a")
            .ns
            .ip(&["addr", "add", &format!("{SECOND}/24"), "dev", "eth0"])
            .expect("a second address on node A");
        fx.publish(&scenario::web::<Ipv4Addr>("web"), &[(BACKEND.1, "b")]);
        let via_primary = SocketAddrV4::new(NODE_A_IP, scenario::NODE_PORT);
        fx.reply_within(
            "client1",
            via_primary,
            "the NodePort on the primary address",
        );
        // The agent knows the second address before it is asked: it follows
        // the interfaces every few seconds.
        let listed = wait_until(Duration::from_secs(15), Duration::from_millis(100), || {
            let status = fx.agents[0].status().expect("ebpf-proxy status");
            if status.contains(&SECOND.to_string()) {
                Ok(())
            } else {
                Err(format!("its status:\n{status}"))
            }
        });
        if let Err(last) = listed {
            panic!("node A's agent never listed {SECOND} among its addresses; {last}");
        }
        let via_second = SocketAddrV4::new(SECOND, scenario::NODE_PORT);
        let outcome = tcp_request(fx.client("client1"), via_second, Duration::from_secs(2));
        if primary {
            assert!(
                !matches!(outcome, Outcome::Reply(_)),
                "with primary, the NodePort answered on the second address {SECOND}: {outcome}"
            );
        } else {
            assert!(
                matches!(outcome, Outcome::Reply(_)),
                "without primary, the NodePort must answer on every address: {outcome}; {}",
                fx.counters()
            );
        }
    }
}

#[test]
fn masqueraded_answers_to_a_node_port_tc_only() {
    scenario::masqueraded_answers_to_a_node_port::<Ipv4Addr>(Path::TcOnly);
}

#[test]
fn masqueraded_answers_to_a_node_port_native_xdp() {
    scenario::masqueraded_answers_to_a_node_port::<Ipv4Addr>(Path::Native);
}
