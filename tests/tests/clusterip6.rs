//! IPv6 ClusterIP load balancing on real packets: the routed node of clusterip.rs,
//! whose pods are dual-stack (tests/src/topology.rs), a Service of IPv6 alone, and
//! real TCP and UDP over IPv6 from the client to its ClusterIP through
//! `tc_ingress6`. The scenarios shared with clusterip.rs are `clusterip_scenarios`'s,
//! written once over the family; the rest are IPv6's own: a dual-stack Service,
//! refusals next to ip6tables' REJECT, affinity per client next to ip6tables,
//! path MTU discovery, and hairpin from the node's IPv6 address.
//!
//! Every test builds its own namespaces, bpffs root and manifest directory, so they run
//! in parallel; everything is removed on drop, also when a test fails.

mod clusterip_scenarios;

use std::{
    fmt::Write as _,
    net::{Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use clusterip_scenarios as scenario;
use ebpf_proxy_tests::{
    Protocol,
    agent::SYNC_DEADLINE,
    client::{
        Outcome, Peer, TIMEOUT, TcpSession, assert_all_replied_from, tcp_request, tcp_tally,
        udp_request, udp_tally,
    },
    iptables::{self, KubeService6},
    manifest::SessionAffinity,
    netns::NetNs,
    sandbox::Sandbox,
    topology::{
        NODE_IP6, add_node_ip6,
        one_node::{
            BACKENDS, CLIENT, CLUSTER_IP, CLUSTER_IP6, IPT_CLIENT, TCP_PORT, UDP_PORT, backend_ips,
            backend_ips6, backend_names, dns, dns6, http, http6, web_service,
        },
        pod_ip6,
    },
};

/// The ip6tables references' ClusterIPs; the agent does not know them, so
/// `tc_ingress6` passes their traffic to netfilter untouched.
const IPT_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x20);

#[test]
fn ipv6_distribution_matches_ip6tables_statistic_and_keeps_the_client_address() {
    scenario::distribution_matches_statistic_and_keeps_the_client_address::<Ipv6Addr>();
}

#[test]
fn ipv6_udp_reaches_backends_with_client_address() {
    scenario::udp_reaches_backends_with_client_address::<Ipv6Addr>();
}

#[test]
fn ipv6_fragmented_udp_is_translated_both_ways() {
    scenario::fragmented_udp_is_translated_both_ways::<Ipv6Addr>();
}

#[test]
fn ipv6_a_closed_udp_port_behind_a_clusterip_is_refused_as_ip6tables_does() {
    scenario::a_closed_udp_port_behind_a_clusterip_is_refused_as_kube_proxy_does::<Ipv6Addr>();
}

#[test]
fn ipv6_a_pods_flood_of_new_flows_leaves_established_connections_alone() {
    scenario::a_pods_flood_of_new_flows_leaves_established_connections_alone::<Ipv6Addr>();
}

#[test]
fn ipv6_translated_packets_keep_valid_checksums_in_every_checksum_state() {
    scenario::translated_packets_keep_valid_checksums_in_every_checksum_state::<Ipv6Addr>();
}

#[test]
fn ipv6_removed_endpoint_gets_no_new_connections_but_keeps_established_ones() {
    scenario::removed_endpoint_gets_no_new_connections_but_keeps_established_ones::<Ipv6Addr>();
}

#[test]
fn ipv6_service_without_endpoints_is_refused_at_once() {
    scenario::service_without_endpoints_is_refused_at_once::<Ipv6Addr>();
}

#[test]
fn ipv6_direct_connection_reusing_a_service_flows_port_is_left_alone() {
    scenario::direct_connection_reusing_a_service_flows_port_is_left_alone::<Ipv6Addr>();
}

#[test]
fn ipv6_one_client_port_to_two_services_on_one_backend_stays_two_connections() {
    scenario::one_client_port_to_two_services_on_one_backend_stays_two_connections::<Ipv6Addr>();
}

#[test]
fn ipv6_a_pod_reaching_itself_from_one_port_through_two_services_stays_two_connections() {
    scenario::a_pod_reaching_itself_from_one_port_through_two_services_stays_two_connections::<
        Ipv6Addr,
    >();
}

#[test]
fn ipv6_tcp_port_reused_at_once_after_a_reset_is_answered() {
    scenario::tcp_port_reused_at_once_after_a_reset_is_answered::<Ipv6Addr>();
}

#[test]
fn ipv6_pod_created_after_the_agent_started_is_served() {
    scenario::pod_created_after_the_agent_started_is_served::<Ipv6Addr>();
}

/// An IPv6 Service without endpoints is refused at once, as kube-proxy's
/// ip6tables rules refuse it: the same Service behind them (its filter table's
/// `-j REJECT`, which answers ICMPv6 port unreachable), on another VIP, from
/// another client. TCP connect and a connected UDP socket get "connection refused"
/// from both, well within a second; ebpf-proxy answers TCP with a RST. An IPv6
/// scenario of its own: the refusal itself is the family's twin of clusterip.rs's
/// ([`ipv6_service_without_endpoints_is_refused_at_once`]); this one adds kube-proxy's
/// REJECT rules as the reference, which take the routes and node address set up here.
#[test]
fn ipv6_service_without_endpoints_is_refused_at_once_as_ip6tables_refuses_it() {
    let mut sb =
        Sandbox::new(&[CLIENT, IPT_CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let empty_vip = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x30);
    let empty = scenario::web("empty6", empty_vip);
    sb.manifests()
        .write("empty6.yaml", &empty.yaml6(&[]))
        .expect("write manifest");
    sb.start_agent_on_manifests().expect("start the agent");
    let node = &sb.topology().node;
    add_node_ip6(node).expect("the node's IPv6 address");
    // A real node routes the service CIDR somewhere (its default route): without a
    // route, a packet to a ClusterIP that nothing translates is refused by routing
    // ("no route") before the filter table's FORWARD chain sees it. Not through
    // `lo`, which IPv6 makes a reject route: through a veth pair of the node's own,
    // which leads nowhere (removed with the node's namespace).
    node.ip(&[
        "link", "add", "svc0", "type", "veth", "peer", "name", "svc1",
    ])
    .expect("a veth pair for the service CIDR");
    for end in ["svc0", "svc1"] {
        node.ip(&["link", "set", end, "up"]).expect("veth up");
    }
    node.ip(&["-6", "route", "add", "fd00:96::/64", "dev", "svc0"])
        .expect("a route for the service CIDR");
    let kube: Vec<KubeService6> = ["http", "dns"]
        .iter()
        .map(|port| empty.kube_service6(port, IPT_VIP6, &[]))
        .collect();
    iptables::apply_with_rejects(node, &kube).expect("load kube-proxy's ip6tables rules");

    let limit = Duration::from_secs(1);
    let mut report = String::new();
    let mut outcomes = Vec::new();
    for (who, client, vip) in [
        ("ebpf-proxy", &sb.client().ns, empty_vip),
        ("ip6tables", &sb.pod(IPT_CLIENT.0).ns, IPT_VIP6),
    ] {
        for proto in [Protocol::Tcp, Protocol::Udp] {
            let start = Instant::now();
            let outcome = match proto {
                Protocol::Tcp => tcp_request(client, http6(vip), TIMEOUT),
                Protocol::Udp => udp_request(client, dns6(vip), TIMEOUT),
                Protocol::Sctp => unreachable!("TCP and UDP only"),
            };
            let took = start.elapsed();
            let _ = writeln!(
                report,
                "{who:<10} {proto:?} to [{vip}]: {outcome} after {took:?}"
            );
            outcomes.push((who, proto, outcome, took));
        }
    }
    eprintln!("{report}");
    let of = |who: &str, proto: Protocol| {
        outcomes
            .iter()
            .find(|o| o.0 == who && o.1 == proto)
            .map(|o| (&o.2, o.3))
            .expect("measured")
    };
    for proto in [Protocol::Tcp, Protocol::Udp] {
        let ((ipt, _), (ebpf, took)) = (of("ip6tables", proto), of("ebpf-proxy", proto));
        assert_eq!(
            *ipt,
            Outcome::Refused,
            "the ip6tables reference did not refuse {proto:?} (sandbox problem?):\n{report}"
        );
        assert_eq!(
            ebpf, ipt,
            "{proto:?}: ebpf-proxy's answer differs from kube-proxy's ip6tables rules':\n{report}"
        );
        // kube-proxy's rules took the SYN's retransmission, a second later, to
        // refuse TCP here; the datapath is held to refusing at once.
        assert!(
            took < limit,
            "{proto:?}: ebpf-proxy took {took:?} to refuse:\n{report}"
        );
    }
    assert!(sb.counter("reject") >= 2, "rejects not counted:\n{report}");
}

/// `test/web` dual-stack: the IPv4 slice on every backend's IPv4 address, the
/// IPv6 slice on `v6_backends`, in one file.
fn dual_stack_web_yaml(v6_backends: &[Ipv6Addr]) -> String {
    let web = web_service(CLUSTER_IP).dual_stack(CLUSTER_IP6);
    format!(
        "{}---\n{}---\n{}",
        web.service_yaml(),
        web.endpoint_slice_yaml(&backend_ips()),
        web.endpoint_slice6_yaml(v6_backends)
    )
}

/// Per backend, the TCP and UDP answers `client` gets from `test/web`'s ClusterIP of
/// one family, with every backend seeing the client's address of that family (so
/// the request reached the backend's address of that family).
fn tally_both<A: Peer>(
    client: &NetNs,
    client_ip: A::Ip,
    tcp: A,
    udp: A,
    n: usize,
    what: &str,
) -> (Vec<u64>, Vec<u64>) {
    let names = backend_names();
    let t = tcp_tally(client, tcp, n, TIMEOUT).expect("TCP run");
    assert_all_replied_from(client_ip, &format!("TCP to {what}"), &t);
    let u = udp_tally(client, udp, n, TIMEOUT).expect("UDP run");
    assert_all_replied_from(client_ip, &format!("UDP to {what}"), &u);
    for (proto, tally) in [("TCP", &t), ("UDP", &u)] {
        assert_eq!(
            tally.replies(),
            n as u64,
            "{proto} to {what}: replies from unexpected backends: {:?}",
            tally.counts
        );
    }
    (t.counts_for(&names), u.counts_for(&names))
}

/// A dual-stack Service is reached on both its ClusterIPs, each family's requests
/// going to the backends' addresses of that family, spread over all three; an
/// endpoint removed from the IPv6 slice alone leaves the IPv6 frontend and keeps
/// its IPv4 twin.
#[test]
fn dual_stack_service_serves_each_family_from_its_own_slice() {
    let mut sb =
        Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("the one-node world");
    sb.manifests()
        .write("web.yaml", &dual_stack_web_yaml(&backend_ips6()))
        .expect("write manifest");
    sb.start_agent_on_manifests().expect("start the agent");
    let client = &sb.client().ns;
    let n = 60;

    let (t4, u4) = tally_both(
        client,
        CLIENT.1,
        http(CLUSTER_IP),
        dns(CLUSTER_IP),
        n,
        "the IPv4 ClusterIP",
    );
    let (t6, u6) = tally_both(
        client,
        pod_ip6(CLIENT.1),
        http6(CLUSTER_IP6),
        dns6(CLUSTER_IP6),
        n,
        "the IPv6 ClusterIP",
    );
    eprintln!("{n} each, per backend: IPv4 TCP {t4:?} UDP {u4:?}, IPv6 TCP {t6:?} UDP {u6:?}");
    for (what, counts) in [
        ("IPv4 TCP", &t4),
        ("IPv4 UDP", &u4),
        ("IPv6 TCP", &t6),
        ("IPv6 UDP", &u6),
    ] {
        assert!(
            counts.iter().all(|&c| c > 0),
            "{what}: {n} requests should reach all three backends, got {counts:?}"
        );
    }

    let (removed, removed_ip) = BACKENDS[2];
    let remaining6: Vec<Ipv6Addr> = backend_ips6()
        .into_iter()
        .filter(|ip| *ip != pod_ip6(removed_ip))
        .collect();
    let mark = sb.agent().log_mark();
    sb.manifests()
        .write("web.yaml", &dual_stack_web_yaml(&remaining6))
        .expect("rewrite manifest");
    sb.agent().wait_synced_since(mark, SYNC_DEADLINE * 10);

    let (t4, u4) = tally_both(
        client,
        CLIENT.1,
        http(CLUSTER_IP),
        dns(CLUSTER_IP),
        n,
        "the IPv4 ClusterIP after the edit",
    );
    let (t6, u6) = tally_both(
        client,
        pod_ip6(CLIENT.1),
        http6(CLUSTER_IP6),
        dns6(CLUSTER_IP6),
        n,
        "the IPv6 ClusterIP after the edit",
    );
    eprintln!(
        "after removing {removed} from the IPv6 slice: IPv4 TCP {t4:?} UDP {u4:?}, IPv6 TCP {t6:?} UDP {u6:?}"
    );
    for (what, counts) in [("IPv4 TCP", &t4), ("IPv4 UDP", &u4)] {
        assert!(
            counts.iter().all(|&c| c > 0),
            "{what}: the IPv4 frontend should keep all three backends after an IPv6-only edit, got {counts:?}"
        );
    }
    for (what, counts) in [("IPv6 TCP", &t6), ("IPv6 UDP", &u6)] {
        assert_eq!(
            counts[2], 0,
            "{what}: synced after {removed} left the IPv6 slice, yet new requests still reach it: {counts:?}"
        );
        assert!(
            counts[..2].iter().all(|&c| c > 0),
            "{what}: both remaining backends should answer: {counts:?}"
        );
    }
}

/// The clients of the affinity test: two for each side, so that each side shows
/// affinity per client, not one backend for everyone.
const EBPF_CLIENTS: [(&str, Ipv4Addr); 2] = [CLIENT, ("client-b", Ipv4Addr::new(10, 200, 0, 4))];
const IPT_CLIENTS: [(&str, Ipv4Addr); 2] =
    [IPT_CLIENT, ("client-ipt-b", Ipv4Addr::new(10, 200, 0, 5))];

/// ClientIP session affinity on an IPv6 ClusterIP, side by side with kube-proxy's
/// ip6tables rules for the same Service (`-m recent --rcheck` per endpoint ahead
/// of the statistic cascade, `-m recent --set` before each DNAT) on another VIP:
/// in both, every client's 20 new connections land on one backend, the one its
/// first went to. Each side has clients of its own, so that neither's conntrack
/// holds the other's flows.
#[test]
fn ipv6_client_ip_affinity_matches_ip6tables_recent_rules() {
    const CONNECTIONS: usize = 20;
    let clients: Vec<(&str, Ipv4Addr)> = EBPF_CLIENTS.iter().chain(&IPT_CLIENTS).copied().collect();
    let mut sb = Sandbox::new(&clients, &BACKENDS, TCP_PORT, UDP_PORT).expect("the one-node world");
    let sticky =
        scenario::web("sticky6", CLUSTER_IP6).session_affinity(SessionAffinity::ClientIp {
            timeout_seconds: None,
        });
    sb.manifests()
        .write("sticky6.yaml", &sticky.yaml6(&backend_ips6()))
        .expect("write manifest");
    sb.start_agent_on_manifests().expect("start the agent");
    let kube = sticky.kube_service6("http", IPT_VIP6, &backend_ips6());
    assert_eq!(kube.affinity_timeout, Some(10_800), "the default timeout");
    iptables::apply(&sb.topology().node, &[kube]).expect("load kube-proxy's ip6tables rules");

    // Per client: how many of its connections each backend answered.
    let run = |side: &[(&str, Ipv4Addr)], vip: Ipv6Addr| -> Vec<(String, Vec<u64>)> {
        side.iter()
            .map(|&(name, ip)| {
                let tally = tcp_tally(&sb.pod(name).ns, http6(vip), CONNECTIONS, TIMEOUT)
                    .unwrap_or_else(|e| panic!("connections from {name} to [{vip}]: {e}"));
                assert_all_replied_from(pod_ip6(ip), &format!("{name} to [{vip}]"), &tally);
                assert_eq!(
                    tally.replies(),
                    CONNECTIONS as u64,
                    "{name} to [{vip}]: not every connection was answered: {:?}",
                    tally.counts
                );
                (name.to_owned(), tally.counts_for(&backend_names()))
            })
            .collect()
    };
    let ebpf = run(&EBPF_CLIENTS, CLUSTER_IP6);
    let ipt = run(&IPT_CLIENTS, IPT_VIP6);
    let mut table = format!(
        "{CONNECTIONS} connections per client, per backend {:?}:\n",
        backend_names()
    );
    for (side, rows) in [("ebpf-proxy", &ebpf), ("ip6tables -m recent", &ipt)] {
        for (name, counts) in rows {
            let _ = writeln!(table, "{side:<20} {name:<13} {counts:?}");
        }
    }
    eprintln!("{table}");
    let on_one_backend = |rows: &[(String, Vec<u64>)]| {
        rows.iter()
            .all(|(_, c)| c.iter().filter(|&&n| n > 0).count() == 1)
    };
    assert!(
        on_one_backend(&ipt),
        "the ip6tables reference did not keep each client on one backend (sandbox problem?):\n{table}"
    );
    assert!(
        on_one_backend(&ebpf),
        "with ClientIP affinity, ebpf-proxy sent a client to more than one backend, which \
         kube-proxy's ip6tables rules do not:\n{table}"
    );
}

/// The router pod of [`ipv6_path_mtu_discovery_works_through_the_cluster_ip`].
const ROUTER: (&str, Ipv4Addr) = ("router", Ipv4Addr::new(10, 200, 0, 40));
/// The backend behind it, and the router's address on their link.
const FAR: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xbeef, 0, 0, 0, 0, 0, 2);
const ROUTER_SIDE: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xbeef, 0, 0, 0, 0, 0, 1);

/// `ip` with `args` (split at spaces) in `ns`; panics with what failed.
fn ip(ns: &NetNs, args: &str) {
    let args: Vec<&str> = args.split(' ').collect();
    ns.ip(&args)
        .unwrap_or_else(|e| panic!("ip {} in {}: {e:#}", args.join(" "), ns.name()));
}

/// A namespace at [`FAR`] behind the router pod [`ROUTER`] of `sb`: 1,500-byte
/// links on both sides of the router, its route to `FAR` locked at 1,280 bytes
/// (a route MTU holds for forwarded packets only when locked), and the node's
/// route to `FAR` through the router.
fn far_behind_a_router(sb: &mut Sandbox) -> NetNs {
    let router6 = sb.add_pod(ROUTER.0, ROUTER.1).expect("the router pod").ip6;
    let far = NetNs::create(&format!("{}-far", sb.topology().stem())).expect("the far namespace");
    let router = &sb.pod(ROUTER.0).ns;
    ip(
        router,
        &format!(
            "link add far0 type veth peer name eth0 netns {}",
            far.name()
        ),
    );
    for (ns, ifname, addr) in [(router, "far0", ROUTER_SIDE), (&far, "eth0", FAR)] {
        ns.sysctl(&format!("net.ipv6.conf.{ifname}.accept_dad"), "0")
            .expect("accept_dad");
        ip(ns, &format!("-6 addr add {addr}/64 dev {ifname} nodad"));
        ip(ns, &format!("link set {ifname} up"));
    }
    router
        .sysctl("net.ipv6.conf.all.forwarding", "1")
        .expect("forwarding in the router");
    ip(
        router,
        &format!("-6 route replace {FAR}/128 dev far0 mtu lock 1280"),
    );
    ip(&far, &format!("-6 route add default via {ROUTER_SIDE}"));
    let router_if = &sb.pod(ROUTER.0).host_if;
    ip(
        &sb.topology().node,
        &format!("-6 route add {FAR}/128 via {router6} dev {router_if}"),
    );
    far
}

/// Path MTU discovery through a ClusterIP: the backend sits behind a router
/// pod whose route to it has a smaller MTU (1,280 bytes) than the links on
/// both sides (1,500 bytes, so the backend's SYN-ACK announces a full-sized
/// MSS). The router answers the client's full-sized segments with "packet
/// too big" quoting the segment as it was on its way to the backend; only
/// translated back to quote the ClusterIP does the client's socket lower
/// its path MTU. A 256 KiB line sent through the ClusterIP and echoed back
/// then completes; untranslated, the client keeps sending segments that
/// never arrive.
#[test]
fn ipv6_path_mtu_discovery_works_through_the_cluster_ip() {
    let mut sb = Sandbox::new(&[CLIENT], &[], TCP_PORT, UDP_PORT).expect("the one-node world");
    let far = far_behind_a_router(&mut sb);
    let _server = ebpf_proxy_tests::servers::TcpServer::start(&far, "far", TCP_PORT)
        .expect("the backend behind the router");
    sb.manifests()
        .write(
            "web6.yaml",
            &scenario::web("web6", CLUSTER_IP6).yaml6(&[FAR]),
        )
        .expect("write manifest");
    sb.start_agent_on_manifests().expect("start the agent");

    let client = &sb.client().ns;
    let mut session = TcpSession::open(client, http6(CLUSTER_IP6), TIMEOUT).expect("connect");
    assert_eq!(
        session.greeting.backend, "far",
        "greeting from the backend behind the router"
    );
    // Black-holed segments fill the send buffer: the session's write timeout makes
    // a write that blocks for good fail the test instead of hanging it.
    let line: String = "0123456789abcdef".repeat(256 * 1024 / 16);
    let answer = session
        .exchange(&line)
        .unwrap_or_else(|e| panic!("256 KiB through the ClusterIP past a 1,280-byte hop: {e:#}"));
    assert_eq!(
        answer.len(),
        "far ".len() + line.len(),
        "the echoed line's length"
    );
    assert!(
        sb.counter("icmp_error_translated") >= 1,
        "no ICMPv6 error was translated"
    );
}

/// Hairpin over IPv6: a pod that is the only endpoint of its IPv6 Service
/// reaches itself through the ClusterIP (TCP, a longer TCP exchange, and UDP),
/// and sees itself as the node's IPv6 address (`--node-ip`, on the node's
/// loopback as `NODE_IP` is), as kube-proxy's masquerade shows it: from its own
/// address the kernel would take the answer for its own and never send it. Every
/// other pod through the same Service keeps its own source address.
///
/// Apart from its IPv4 twin in lifecycle.rs because the two differ in substance: over
/// IPv4 a hairpin flow comes from the link-local hairpin address, over IPv6 from the
/// node's own address, which the agent is given with `--node-ip`.
#[test]
fn ipv6_backend_reaches_itself_through_its_service_and_others_keep_their_address() {
    let node_ip6 = NODE_IP6;
    let (own, own_ip) = BACKENDS[0];
    let (other, other_ip) = BACKENDS[1];
    let own6 = pod_ip6(own_ip);
    let mut sb = Sandbox::new(&[CLIENT], &BACKENDS[..2], TCP_PORT, UDP_PORT).expect("sandbox");
    sb.topology()
        .node
        .ip(&["-6", "addr", "add", &format!("{node_ip6}/128"), "dev", "lo"])
        .expect("the node's IPv6 address");
    sb.manifests()
        .write(
            "self6.yaml",
            &scenario::web("self6", CLUSTER_IP6).yaml6(&[own6]),
        )
        .expect("write manifest");
    let node_ips = format!("{},{node_ip6}", ebpf_proxy_tests::topology::NODE_IP);
    sb.start_agent_with(&["--node-ip", &node_ips])
        .expect("start the agent");
    let pod = &sb.pod(own).ns;

    for i in 0..3 {
        let reply = tcp_request(pod, http6(CLUSTER_IP6), TIMEOUT).expect_reply(&format!(
            "hairpin TCP connection {i} from {own} to its own IPv6 Service"
        ));
        assert_eq!(
            (reply.backend.as_str(), *reply.peer.ip()),
            (own, node_ip6),
            "a hairpin connection must reach the pod from the node's IPv6 address, not \
             from its own {own6}"
        );
    }
    let mut session = TcpSession::open(pod, http6(CLUSTER_IP6), TIMEOUT).expect("connect");
    assert_eq!(*session.greeting.peer.ip(), node_ip6);
    for line in ["one", "two", "three"] {
        assert_eq!(
            session
                .exchange(line)
                .unwrap_or_else(|e| panic!("exchange on a long hairpin connection: {e:#}")),
            format!("{own} {line}")
        );
    }
    let udp = udp_request(pod, dns6(CLUSTER_IP6), TIMEOUT)
        .expect_reply(&format!("hairpin UDP from {own} to its own IPv6 Service"));
    assert_eq!((udp.backend.as_str(), *udp.peer.ip()), (own, node_ip6));
    assert!(sb.counter("hairpin") >= 5, "hairpin flows not counted");

    for (name, ns, ip) in [
        (CLIENT.0, &sb.client().ns, CLIENT.1),
        (other, &sb.pod(other).ns, other_ip),
    ] {
        let ip6 = pod_ip6(ip);
        let tcp = tcp_request(ns, http6(CLUSTER_IP6), TIMEOUT)
            .expect_reply(&format!("TCP from {name} to the IPv6 Service of {own}"));
        assert_eq!(
            (tcp.backend.as_str(), *tcp.peer.ip()),
            (own, ip6),
            "a flow from {name} that is not hairpin must keep its source address"
        );
        let udp = udp_request(ns, dns6(CLUSTER_IP6), TIMEOUT)
            .expect_reply(&format!("UDP from {name} to the IPv6 Service of {own}"));
        assert_eq!(
            (udp.backend.as_str(), *udp.peer.ip()),
            (own, ip6),
            "a UDP flow from {name} that is not hairpin must keep its source address"
        );
    }
}

#[test]
fn ipv6_a_pods_flood_of_answered_connections_leaves_others_established_alone() {
    scenario::a_pods_flood_of_answered_connections_leaves_others_established_alone::<Ipv6Addr>();
}

#[test]
fn ipv6_a_reject_flood_is_held_to_the_icmp_error_budget() {
    scenario::a_reject_flood_is_held_to_the_icmp_error_budget::<Ipv6Addr>();
}

#[test]
fn the_service_cidr_refuses_undefined_ports_and_drops_unallocated_addresses() {
    scenario::the_service_cidr_refuses_undefined_ports_and_drops_unallocated_addresses::<Ipv6Addr>(
    );
}

#[test]
fn ipv6_host_routing_bpf_sends_translated_packets_straight_into_pods() {
    scenario::host_routing_bpf_sends_translated_packets_straight_into_pods::<Ipv6Addr>();
}

#[test]
fn ipv6_other_tc_filters_see_every_packet() {
    scenario::other_tc_filters_see_every_packet::<Ipv6Addr>();
}

#[test]
fn ipv6_a_failed_attach_is_retried_until_it_lands() {
    scenario::a_failed_attach_is_retried_until_it_lands::<Ipv6Addr>();
}

#[test]
fn ipv6_host_routing_leaves_shaped_pods_to_the_stack() {
    scenario::host_routing_leaves_shaped_pods_to_the_stack::<Ipv6Addr>();
}
