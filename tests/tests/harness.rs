//! Checks of the harness itself, without the agent: the routed topology forwards
//! between pods with source addresses intact, and kube-proxy's iptables rules spread
//! connections evenly. When these fail, the sandbox is broken, not ebpf-proxy.

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use ebpf_proxy_tests::{
    Protocol,
    client::{tcp_request, tcp_tally, udp_request},
    iptables,
    manifest::Service,
    require_root,
    sandbox::Sandbox,
    stats::chi_square_uniform,
};

const CLIENT: (&str, Ipv4Addr) = ("client", Ipv4Addr::new(10, 200, 0, 2));
const BACKENDS: [(&str, Ipv4Addr); 3] = [
    ("backend-a", Ipv4Addr::new(10, 200, 0, 11)),
    ("backend-b", Ipv4Addr::new(10, 200, 0, 12)),
    ("backend-c", Ipv4Addr::new(10, 200, 0, 13)),
];
const TIMEOUT: Duration = Duration::from_secs(2);

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
