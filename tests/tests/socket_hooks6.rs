//! The node's own IPv6 sockets through the agent's socket hooks (`connect6`,
//! `sendmsg6`, `recvmsg6`, `getpeername6`), on real sockets in the routed one-node
//! topology (docs/architecture.md, "Test topologies"), with the agent's cgroup hooks
//! on a cgroup of each test's own: an IPv6 Service reached from the node's IPv6
//! sockets, which its IPv6 backend pods answer, and an IPv4 Service reached through an
//! IPv6 socket at its IPv4-mapped address; the node's IPv6 UDP sockets the hook
//! connected to a backend are closed when that backend leaves, as IPv4's are, and
//! what the hooks note about the node's IPv6 sockets lives in the sockets
//! (`SOCK_NOTES6`), also after 100,000 TCP connections. The scenarios with an IPv4
//! twin are `socket_hooks_scenarios`'s, shared with `socket_hooks.rs`.
//!
//! Every test builds its own namespaces, cgroup, bpffs root and manifest directory, so
//! they run in parallel; everything is removed on drop, also when a test fails.

mod socket_hooks_scenarios;

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
};

use ebpf_proxy_tests::{
    Protocol,
    manifest::Service,
    topology::{
        NODE_IP,
        one_node::{
            BACKENDS, CLUSTER_IP, TCP_PORT, TCP_SERVICE_PORT, UDP_PORT, UDP_SERVICE_PORT,
            backend_ips, web_service,
        },
    },
};
use socket_hooks_scenarios::{self as scenario, Departing};

#[test]
fn the_nodes_ipv6_sockets_reach_an_ipv6_service() {
    scenario::the_nodes_own_connections_reach_backends::<Ipv6Addr>();
}

#[test]
fn pods_ipv6_tcp_connections_go_at_connect_with_socket_lb_pods() {
    scenario::pods_tcp_connections_go_at_connect::<Ipv6Addr>();
}

#[test]
fn the_nodes_ipv6_sockets_show_the_frontend_as_their_peer() {
    scenario::the_nodes_sockets_show_the_frontend_as_their_peer::<Ipv6Addr>();
}

#[test]
fn the_nodes_ipv6_udp_sockets_connected_to_a_departed_backend_are_closed() {
    scenario::the_nodes_udp_sockets_connected_to_a_departed_backend_are_closed::<Ipv6Addr>();
}

/// The twin of `socket_hooks::the_nodes_socket_notes_outlive_tcp_churn`: 100,000 IPv6
/// TCP connections of the node through `connect6`, then the notes in `SOCK_NOTES6` of
/// the node's IPv6 UDP sockets made before them still serve (`recvmsg6` shows the
/// ClusterIP, the agent closes the sockets of the backend that leaves).
#[test]
fn the_nodes_ipv6_socket_notes_outlive_tcp_churn() {
    scenario::the_nodes_socket_notes_outlive_tcp_churn::<Ipv6Addr>();
}

/// The twin of `socket_hooks::the_hooks_notes_live_in_their_sockets`: the notes of IPv6
/// backends live in the node's IPv6 UDP sockets, in `SOCK_NOTES6`, as the agent's
/// pinned iterator (`sock_notes::read6`) lists them.
#[test]
fn the_hooks_ipv6_notes_live_in_their_sockets() {
    scenario::the_hooks_notes_live_in_their_sockets::<Ipv6Addr>();
}

/// `addr` as an IPv6 socket names it: IPv4-mapped.
fn mapped(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::new(ip.to_ipv6_mapped().into(), port)
}

/// An IPv4 Service reached from an IPv6 socket of the node at the IPv4-mapped form of
/// its ClusterIP is that Service: TCP connections spread over its IPv4 backends, which
/// see the node's IPv4 address, and `getpeername()` shows the mapped ClusterIP; a
/// connected UDP socket gets its answer and shows the mapped ClusterIP as its peer; the
/// answer to an unconnected socket's datagram shows it as its source; a Service without
/// endpoints refuses. IPv6 only: IPv4 sockets have no mapped form.
#[test]
fn an_ipv4_service_is_reached_through_an_ipv6_socket_at_its_mapped_address() {
    let empty_ip = Ipv4Addr::new(10, 96, 0, 30);
    let (sb, cgroup) = scenario::hooked_sandbox::<Ipv6Addr>(&[
        (
            "web.yaml",
            web_service(CLUSTER_IP).yaml(Some(&backend_ips())),
        ),
        (
            "empty.yaml",
            Service::new("test", "empty", empty_ip)
                .port("http", 80, Protocol::Tcp, TCP_PORT)
                .yaml(Some(&[])),
        ),
    ]);
    let node_ip = format!("{NODE_IP}:");
    let http = mapped(CLUSTER_IP, TCP_SERVICE_PORT);
    let reached: BTreeSet<String> = (0..8)
        .map(|i| scenario::tcp_from_the_node(&sb, &cgroup, http, &node_ip, i))
        .collect();
    assert!(
        reached.len() >= 2,
        "8 connections from the node's IPv6 sockets to {http} all reached {reached:?}"
    );
    scenario::udp_from_the_node(
        &sb,
        &cgroup,
        mapped(CLUSTER_IP, UDP_SERVICE_PORT),
        &node_ip,
        12,
    );
    scenario::refused(&sb, &cgroup, mapped(empty_ip, 80));
}

/// The same for an IPv4 Service reached from IPv6 sockets at its IPv4-mapped
/// ClusterIP: the hook noted them in `SOCK_NOTES` by the IPv4 backend, and the agent
/// finds them among the node's IPv6 sockets and closes them when that backend leaves.
/// IPv6 only: IPv4 sockets have no mapped form.
#[test]
fn the_nodes_ipv6_udp_sockets_connected_to_a_departed_ipv4_backend_are_closed() {
    let (sb, cgroup) = scenario::hooked_sandbox::<Ipv6Addr>(&[(
        "web.yaml",
        web_service(CLUSTER_IP).yaml(Some(&backend_ips())),
    )]);
    let service = Departing {
        frontend: mapped(CLUSTER_IP, UDP_SERVICE_PORT),
        pod: |name| mapped(scenario::backend_ip(name), UDP_PORT),
        without: |name| {
            let remaining: Vec<Ipv4Addr> = BACKENDS
                .iter()
                .filter(|b| b.0 != name)
                .map(|b| b.1)
                .collect();
            ("web.yaml", web_service(CLUSTER_IP).yaml(Some(&remaining)))
        },
    };
    let mut clients = scenario::connected_udp_clients(&sb, &cgroup, service.frontend, 12);
    scenario::departed_backends_sockets_are_closed(
        &sb,
        &cgroup,
        &service,
        &mut clients,
        "the IPv4 backend leaving",
    );
}
