//! Checks of the harness itself, without the agent: the routed topology forwards
//! between pods with source addresses intact, the two-node cluster routes between
//! nodes, pods and outside clients, and kube-proxy's iptables rules spread connections
//! evenly. When these fail, the sandbox is broken, not ebpf-proxy.

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};

use ebpf_proxy_tests::{
    Protocol,
    client::{Outcome, tcp_request, tcp_tally, udp_request},
    cluster::{CLIENT1, CLIENT1_IP6, Cluster, NODE_A_IP, NODE_A_IP6, NODE_B_IP, NODE_B_IP6},
    iptables,
    manifest::Service,
    require_root, run_cmd,
    sandbox::Sandbox,
    servers::{TcpServer, UdpServer},
    stats::chi_square_uniform,
    topology::{
        one_node::{BACKENDS, CLIENT},
        pod_ip6,
    },
};

use ebpf_proxy_tests::client::TIMEOUT;

fn sandbox() -> Sandbox {
    require_root().expect("privileged test");
    Sandbox::new(&[CLIENT], &BACKENDS, 8080, 5353).expect("sandbox")
}

#[test]
fn routed_topology_forwards_pod_to_pod_keeping_source_addresses() {
    let sb = sandbox();
    let client = &sb.client().ns;
    for (name, ip) in BACKENDS {
        let tcp = tcp_request(client, SocketAddrV4::new(ip, 8080), TIMEOUT)
            .expect_reply(&format!("TCP from client to {name} ({ip}) directly"));
        assert_eq!(tcp.backend, name);
        assert_eq!(
            *tcp.peer.ip(),
            CLIENT.1,
            "{name} saw another source address"
        );
        let udp = udp_request(client, SocketAddrV4::new(ip, 5353), TIMEOUT)
            .expect_reply(&format!("UDP from client to {name} ({ip}) directly"));
        assert_eq!(udp.backend, name);
        assert_eq!(
            *udp.peer.ip(),
            CLIENT.1,
            "{name} saw another source address"
        );
    }
}

#[test]
fn routed_topology_forwards_ipv6_pod_to_pod_keeping_source_addresses() {
    let sb = sandbox();
    let client = sb.client();
    assert_eq!(client.ip6, pod_ip6(CLIENT.1));
    for (name, ip) in BACKENDS {
        let ip6 = pod_ip6(ip);
        let tcp = tcp_request(&client.ns, SocketAddrV6::new(ip6, 8080, 0, 0), TIMEOUT)
            .expect_reply(&format!("TCP from client to {name} ([{ip6}]) directly"));
        assert_eq!(
            (tcp.backend.as_str(), *tcp.peer.ip()),
            (name, client.ip6),
            "TCP over IPv6: another backend or source address"
        );
        let udp = udp_request(&client.ns, SocketAddrV6::new(ip6, 5353, 0, 0), TIMEOUT)
            .expect_reply(&format!("UDP from client to {name} ([{ip6}]) directly"));
        assert_eq!(
            (udp.backend.as_str(), *udp.peer.ip()),
            (name, client.ip6),
            "UDP over IPv6: another backend or source address"
        );
    }
}

#[test]
fn kube_proxy_iptables_rules_spread_connections_uniformly() {
    let sb = sandbox();
    let vip = Ipv4Addr::new(10, 96, 1, 10);
    let svc = Service::new("test", "web", vip).port("http", 80, Protocol::Tcp, 8080);
    let ips: Vec<Ipv4Addr> = BACKENDS.iter().map(|b| b.1).collect();
    iptables::apply(&sb.topology().node, &[svc.kube_service("http", vip, &ips)])
        .expect("load kube-proxy rules");
    let tally =
        tcp_tally(&sb.client().ns, SocketAddrV4::new(vip, 80), 600, TIMEOUT).expect("connections");
    assert!(tally.failures.is_empty(), "failures: {:?}", tally.failures);
    assert_eq!(
        tally.peers_seen.iter().copied().collect::<Vec<_>>(),
        vec![CLIENT.1],
        "backends saw other source addresses than the client's"
    );
    let names: Vec<&str> = BACKENDS.iter().map(|b| b.0).collect();
    let counts = tally.counts_for(&names);
    let chi = chi_square_uniform(&counts);
    eprintln!("iptables: {names:?} = {counts:?}, {chi}");
    assert!(
        chi.passes(0.001),
        "iptables counts {counts:?} are not uniform: {chi}"
    );
}

#[test]
fn cluster_routes_between_nodes_pods_and_outside_clients() {
    require_root().expect("privileged test");
    let pod_a1 = Ipv4Addr::new(10, 1, 1, 10);
    let pod_b1 = Ipv4Addr::new(10, 1, 2, 10);
    let cluster = Cluster::new(&[("a", &[("pod-a1", pod_a1)]), ("b", &[("pod-b1", pod_b1)])])
        .expect("cluster");
    let (a, b) = (cluster.node("a"), cluster.node("b"));
    assert_eq!((a.ip, b.ip), (NODE_A_IP, NODE_B_IP));
    assert_eq!(
        (a.pod_cidr().as_str(), b.pod_cidr().as_str()),
        ("10.1.1.0/24", "10.1.2.0/24")
    );
    assert_eq!(cluster.pod_node("pod-b1").name, "b");
    let tcp = TcpServer::start(&cluster.pod("pod-b1").ns, "pod-b1", 8080).expect("server");
    let udp = UdpServer::start(&cluster.pod("pod-b1").ns, "pod-b1", 5353).expect("server");
    let node_a = TcpServer::start(&a.ns, "node-a", 8081).expect("server");

    // Node A reaches a pod on node B through node B, from its uplink address.
    let reply = tcp_request(&a.ns, SocketAddrV4::new(pod_b1, 8080), TIMEOUT)
        .expect_reply("TCP from node a to pod-b1");
    assert_eq!(
        (reply.backend.as_str(), *reply.peer.ip()),
        ("pod-b1", NODE_A_IP)
    );
    let reply = udp_request(&a.ns, SocketAddrV4::new(pod_b1, 5353), TIMEOUT)
        .expect_reply("UDP from node a to pod-b1");
    assert_eq!(
        (reply.backend.as_str(), *reply.peer.ip()),
        ("pod-b1", NODE_A_IP)
    );
    // Pod to pod across nodes keeps the source address.
    let reply = tcp_request(
        &cluster.pod("pod-a1").ns,
        SocketAddrV4::new(pod_b1, 8080),
        TIMEOUT,
    )
    .expect_reply("TCP from pod-a1 to pod-b1");
    assert_eq!(*reply.peer.ip(), pod_a1);

    // An outside client reaches a node's address, but has no route to pods.
    let client1 = cluster.client("client1");
    assert_eq!(client1.ip, CLIENT1.1);
    let reply = tcp_request(&client1.ns, SocketAddrV4::new(NODE_A_IP, 8081), TIMEOUT)
        .expect_reply("TCP from client1 to node a");
    assert_eq!(
        (reply.backend.as_str(), *reply.peer.ip()),
        ("node-a", CLIENT1.1)
    );
    let unroutable = tcp_request(&client1.ns, SocketAddrV4::new(pod_b1, 8080), TIMEOUT);
    assert!(
        !matches!(unroutable, Outcome::Reply(_)),
        "client1 reached a pod without a route: {unroutable}"
    );

    // An extra address (a LoadBalancer IP, say) routed through node a.
    let lb_ip = Ipv4Addr::new(192, 168, 60, 10);
    a.ns.ip(&["addr", "add", &format!("{lb_ip}/32"), "dev", "lo"])
        .expect("address on node a");
    cluster
        .route_via("client1", &format!("{lb_ip}/32"), "a")
        .expect("route");
    let reply = tcp_request(&client1.ns, SocketAddrV4::new(lb_ip, 8081), TIMEOUT)
        .expect_reply("TCP from client1 to an address routed via node a");
    assert_eq!(
        (reply.backend.as_str(), *reply.peer.ip()),
        ("node-a", CLIENT1.1)
    );

    // Bridge ports have GRO on (for XDP_TX into the nodes' uplinks).
    for port in cluster
        .nodes()
        .iter()
        .map(|n| &n.bridge_port)
        .chain(cluster.clients().iter().map(|c| &c.bridge_port))
    {
        let features = run_cmd(
            cluster
                .bridge()
                .command(ebpf_proxy_tests::cluster::ethtool())
                .args(["-k", port]),
        )
        .expect("ethtool -k");
        assert!(
            features.contains("generic-receive-offload: on"),
            "{port}: {features}"
        );
    }

    // Dropping the cluster removes every namespace.
    let names: Vec<String> = std::iter::once(cluster.bridge())
        .chain(cluster.nodes().iter().map(|n| &n.ns))
        .chain(cluster.clients().iter().map(|c| &c.ns))
        .chain(cluster.all_pods().map(|p| &p.ns))
        .map(|ns| ns.name().to_owned())
        .collect();
    assert_eq!(names.len(), 7, "{names:?}");
    drop((tcp, udp, node_a));
    drop(cluster);
    for name in names {
        assert!(
            !std::path::Path::new("/run/netns").join(&name).exists(),
            "{name} is left behind"
        );
    }
}

/// The two-node cluster over IPv6: nodes reach each other's pods through each
/// other's IPv6 addresses, pods reach pods across nodes and an outside client
/// reaches a pod on the other node through a node (a route of its own, as to a
/// LoadBalancer IP), all keeping their source addresses.
#[test]
fn cluster_routes_ipv6_between_nodes_pods_and_outside_clients() {
    require_root().expect("privileged test");
    let pod_a1 = Ipv4Addr::new(10, 1, 1, 10);
    let pod_b1 = Ipv4Addr::new(10, 1, 2, 10);
    let cluster = Cluster::new(&[("a", &[("pod-a1", pod_a1)]), ("b", &[("pod-b1", pod_b1)])])
        .expect("cluster");
    let (a, b) = (cluster.node("a"), cluster.node("b"));
    assert_eq!((a.ip6, b.ip6), (NODE_A_IP6, NODE_B_IP6));
    assert_eq!(
        (a.pod_cidr6().as_str(), b.pod_cidr6().as_str()),
        ("fd00:10::a01:100/120", "fd00:10::a01:200/120")
    );
    let (pod_a1_6, pod_b1_6) = (pod_ip6(pod_a1), pod_ip6(pod_b1));
    assert_eq!(cluster.pod("pod-b1").ip6, pod_b1_6);
    let _tcp = TcpServer::start(&cluster.pod("pod-b1").ns, "pod-b1", 8080).expect("server");
    let _udp = UdpServer::start(&cluster.pod("pod-b1").ns, "pod-b1", 5353).expect("server");
    let _node_a = TcpServer::start(&a.ns, "node-a", 8081).expect("server");
    let pod_b1_tcp = SocketAddrV6::new(pod_b1_6, 8080, 0, 0);
    let pod_b1_udp = SocketAddrV6::new(pod_b1_6, 5353, 0, 0);

    let reply = tcp_request(&a.ns, pod_b1_tcp, TIMEOUT).expect_reply("TCP from node a to pod-b1");
    assert_eq!(
        (reply.backend.as_str(), *reply.peer.ip()),
        ("pod-b1", NODE_A_IP6),
        "node a reaches a pod on node b from its uplink's IPv6 address"
    );
    let reply = tcp_request(&cluster.pod("pod-a1").ns, pod_b1_tcp, TIMEOUT)
        .expect_reply("TCP from pod-a1 to pod-b1");
    assert_eq!(
        *reply.peer.ip(),
        pod_a1_6,
        "pod to pod across nodes keeps the source"
    );

    let client1 = cluster.client("client1");
    assert_eq!(client1.ip6, CLIENT1_IP6);
    let reply = tcp_request(
        &client1.ns,
        SocketAddrV6::new(NODE_A_IP6, 8081, 0, 0),
        TIMEOUT,
    )
    .expect_reply("TCP from client1 to node a over IPv6");
    assert_eq!(
        (reply.backend.as_str(), *reply.peer.ip()),
        ("node-a", CLIENT1_IP6)
    );
    let unroutable = tcp_request(&client1.ns, pod_b1_tcp, TIMEOUT);
    assert!(
        !matches!(unroutable, Outcome::Reply(_)),
        "client1 reached a pod over IPv6 without a route: {unroutable}"
    );

    // Through node a to the pod on node b, with a route of its own.
    cluster
        .route_via6("client1", &format!("{pod_b1_6}/128"), "a")
        .expect("route to pod-b1 via node a");
    let reply = tcp_request(&client1.ns, pod_b1_tcp, TIMEOUT)
        .expect_reply("TCP from client1 via node a to pod-b1");
    assert_eq!(
        (reply.backend.as_str(), *reply.peer.ip()),
        ("pod-b1", CLIENT1_IP6),
        "client1 -> node a -> node b -> pod-b1 keeps the client's address"
    );
    let reply = udp_request(&client1.ns, pod_b1_udp, TIMEOUT)
        .expect_reply("UDP from client1 via node a to pod-b1");
    assert_eq!(
        (reply.backend.as_str(), *reply.peer.ip()),
        ("pod-b1", CLIENT1_IP6)
    );

    // An extra IPv6 address (a LoadBalancer IP, say) routed through node a.
    let lb_ip6: Ipv6Addr = "fd00:60::10".parse().expect("address");
    a.ns.ip(&["-6", "addr", "add", &format!("{lb_ip6}/128"), "dev", "lo"])
        .expect("address on node a");
    cluster
        .route_via6("client1", &format!("{lb_ip6}/128"), "a")
        .expect("route");
    let reply = tcp_request(&client1.ns, SocketAddrV6::new(lb_ip6, 8081, 0, 0), TIMEOUT)
        .expect_reply("TCP from client1 to an IPv6 address routed via node a");
    assert_eq!(
        (reply.backend.as_str(), *reply.peer.ip()),
        ("node-a", CLIENT1_IP6)
    );
}
