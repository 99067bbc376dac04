//! The node's own connections through the agent's socket hooks, on real sockets: a
//! routed node (docs/architecture.md, "Test topologies") with three backend pods and
//! the agent's cgroup hooks on a cgroup of each test's own. Connections from the node
//! never cross tc ingress; the hooks translate them at `connect()` and `sendmsg()`, close
//! the node's UDP sockets whose backend leaves, and keep what they remember about a
//! socket in the socket itself. The scenarios with an IPv6 twin are
//! `socket_hooks_scenarios`'s, shared with `socket_hooks6.rs`.
//!
//! Every test builds its own namespaces, cgroup, bpffs root and manifest directory, so
//! they run in parallel; everything is removed on drop, also when a test fails.

mod socket_hooks_scenarios;

use std::{collections::BTreeSet, net::Ipv4Addr, process::Command};

use ebpf_proxy_tests::{
    cgroup::TestCgroup,
    manifest::ServiceType,
    netns::NetNs,
    sandbox::Sandbox,
    topology::one_node::{CLIENT, CLUSTER_IP, backend_ips, backend_names, web_service},
};
use proxy_userspace::datapath::PinLayout;
use socket_hooks_scenarios as scenario;

/// `script` run by bash (whose `/dev/tcp` and `/dev/udp` open connected sockets) in
/// `ns`, inside `cgroup` when given, for at most 3 s.
fn bash_in(ns: &NetNs, cgroup: Option<&TestCgroup>, script: &str) -> std::process::Output {
    let mut cmd = match cgroup {
        Some(cgroup) => cgroup.command_in(ns, "timeout"),
        None => ns.command("timeout"),
    };
    cmd.args(["3", "bash", "-c", script])
        .output()
        .expect("running bash")
}

/// The `<backend> <peer>` greeting a bash client printed, or a panic that says what
/// went wrong.
fn greeting(sb: &Sandbox, out: &std::process::Output, what: &str) -> (String, String) {
    let text = String::from_utf8_lossy(&out.stdout);
    let mut words = text.split_whitespace();
    match (out.status.success(), words.next(), words.next()) {
        (true, Some(name), Some(peer)) => (name.to_string(), peer.to_string()),
        _ => panic!(
            "{what}: {} stdout {text:?} stderr {:?}; agent log:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            sb.agent().log()
        ),
    }
}
/// address, and they must reach at least two backends in all.
fn spread_from_the_node(
    sb: &Sandbox,
    cgroup: &TestCgroup,
    n: usize,
    client: impl Fn(usize) -> (String, String),
) {
    let mut backends = BTreeSet::new();
    for i in 0..n {
        let (script, what) = client(i);
        let out = bash_in(&sb.topology().node, Some(cgroup), &script);
        let (backend, peer) = greeting(sb, &out, &what);
        assert!(
            peer.starts_with(&format!("{}:", ebpf_proxy_tests::topology::NODE_IP)),
            "{what}: the backend saw {peer}, not the node's address"
        );
        backends.insert(backend);
    }
    assert!(
        backends.len() >= 2,
        "{n} connections from the node all reached {backends:?}"
    );
}

/// (f) The node's own connections reach backends through the `connect()` and
/// `sendmsg()` hooks (the scenario, shared with IPv6); then a pod's socket in the
/// same cgroup is left to tc, a process outside the cgroup is not translated at all,
/// the hook outlives the agent through its pinned link, and `cleanup` takes it away.
/// These steps are IPv4's alone: they are the cgroup link's, not a family's.
#[test]
fn the_nodes_own_connections_reach_backends_through_the_socket_hook() {
    let (mut sb, cgroup) = scenario::the_nodes_own_connections_reach_backends::<Ipv4Addr>();
    let root = cgroup.path().display().to_string();
    let tcp = format!("exec 3<>/dev/tcp/{CLUSTER_IP}/80 && head -n1 <&3");
    let translated = sb.counter("sock_connect_translated");
    let tc_new_before = sb.counter("dnat_new");

    // A pod's socket in the same cgroup: translated by tc, not by the hook.
    let out = bash_in(&sb.client().ns, Some(&cgroup), &tcp);
    let (_, peer) = greeting(&sb, &out, "TCP connection from a pod in the cgroup");
    assert!(
        peer.starts_with(&format!("{}:", CLIENT.1)),
        "the backend saw {peer}, not the pod's address"
    );
    assert_eq!(
        sb.counter("sock_connect_translated"),
        translated,
        "the hook translated a pod's connection, which is tc's to translate"
    );
    assert_eq!(
        sb.counter("dnat_new"),
        tc_new_before + 1,
        "tc did not translate the pod's connection"
    );

    let status = sb.agent().status().expect("status");
    assert!(
        status.contains("pods' TCP connections to ClusterIPs: at tc"),
        "status does not say pods' connections are tc's by default:\n{status}"
    );

    // Outside the cgroup the hook sees nothing: the ClusterIP leads nowhere.
    let out = bash_in(&sb.topology().node, None, &tcp);
    assert!(
        !out.status.success(),
        "a process of the node outside the hook's cgroup reached the ClusterIP: {:?}",
        String::from_utf8_lossy(&out.stdout)
    );

    // The hook outlives the agent through its pinned link, and the next agent
    // swaps its own program into that link.
    let status = sb.agent_mut().terminate().expect("stop the agent");
    assert!(status.success(), "the agent exited with {status}");
    let out = bash_in(&sb.topology().node, Some(&cgroup), &tcp);
    greeting(
        &sb,
        &out,
        "TCP connection from the node after the agent exited",
    );
    let mut again = sb
        .agent_on_the_same_root(&["--cgroup-root", &root])
        .expect("start the agent again");
    assert!(
        again.log().contains("took over pinned cgroup link"),
        "the restarted agent did not take the pinned link over; its log:\n{}",
        again.log()
    );
    let out = bash_in(&sb.topology().node, Some(&cgroup), &tcp);
    greeting(&sb, &out, "TCP connection from the node after the restart");
    assert_eq!(
        sb.counter("sock_connect_translated"),
        translated + 2,
        "the connections before and after the restart"
    );
    let status = again.terminate().expect("stop the restarted agent");
    assert!(status.success(), "the restarted agent exited with {status}");

    sb.agent_mut().cleanup().expect("ebpf-proxy cleanup");
    let out = bash_in(&sb.topology().node, Some(&cgroup), &tcp);
    assert!(
        !out.status.success(),
        "the node still reaches the ClusterIP after `ebpf-proxy cleanup`: {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// (g) The node's own connections to 127.0.0.0/8 reach NodePorts, as with kube-proxy's
/// `--iptables-localhost-nodeports` (its default): TCP and connected UDP, from the
/// node's address, spread over the backends. `--localhost-nodeports=false`, or
/// `--nodeport-addresses` without 127.0.0.1, turns them off. IPv4 only, as
/// kube-proxy's: `route_localnet` has no IPv6 twin.
#[test]
fn the_nodes_connections_to_localhost_node_ports_reach_backends() {
    let (mut sb, cgroup) = scenario::hooked_sandbox::<Ipv4Addr>(&[(
        "web.yaml",
        web_service(CLUSTER_IP)
            .type_(ServiceType::NodePort)
            .node_port("http", 30080)
            .node_port("dns", 30053)
            .yaml(Some(&backend_ips())),
    )]);
    let root = cgroup.path().display().to_string();
    let node = &sb.topology().node;
    let tcp = |ip: &str| format!("exec 3<>/dev/tcp/{ip}/30080 && head -n1 <&3");

    spread_from_the_node(&sb, &cgroup, 20, |i| {
        let ip = if i % 2 == 0 { "127.0.0.1" } else { "127.1.2.3" };
        (tcp(ip), format!("TCP connection {i} to {ip}:30080"))
    });
    let out = bash_in(
        node,
        Some(&cgroup),
        "exec 3<>/dev/udp/127.0.0.1/30053 && echo hi >&3 && head -n1 <&3",
    );
    let (backend, _) = greeting(&sb, &out, "UDP request to 127.0.0.1:30053");
    assert!(backend_names().contains(&backend.as_str()), "{backend}");
    assert_eq!(
        sb.counter("sock_connect_translated"),
        21,
        "20 TCP connections and a UDP socket to localhost NodePorts"
    );
    let status = sb.agent().status().expect("status");
    assert!(
        status.contains("localhost NodePorts: on"),
        "status does not show localhost NodePorts on:\n{status}"
    );
    let status = sb.agent_mut().terminate().expect("stop the agent");
    assert!(status.success(), "the agent exited with {status}");

    for args in [
        &["--localhost-nodeports=false"][..],
        &["--nodeport-addresses", "10.0.0.0/8"][..],
    ] {
        let node = &sb.topology().node;
        let mut agent = sb
            .agent_on_the_same_root(&[&["--cgroup-root", &root][..], args].concat())
            .expect("start the agent again");
        let status = agent.status().expect("status");
        assert!(
            status.contains("localhost NodePorts: off"),
            "with {args:?}, status does not show localhost NodePorts off:\n{status}"
        );
        let before = sb.counter("sock_connect_translated");
        let out = bash_in(node, Some(&cgroup), &tcp("127.0.0.1"));
        assert!(
            !out.status.success(),
            "with {args:?}, 127.0.0.1:30080 still reached {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
        // The node's own address still serves the NodePort.
        let out = bash_in(
            node,
            Some(&cgroup),
            &tcp(&ebpf_proxy_tests::topology::NODE_IP.to_string()),
        );
        greeting(
            &sb,
            &out,
            &format!("TCP connection to the node's NodePort with {args:?}"),
        );
        assert_eq!(
            sb.counter("sock_connect_translated"),
            before + 1,
            "with {args:?}: only the connection to the node's address is translated; \
             status:\n{}\nagent log:\n{}",
            agent.status().unwrap_or_default(),
            agent.log()
        );
        let status = agent.terminate().expect("stop the agent");
        assert!(status.success(), "the agent exited with {status}");
    }
}

#[test]
fn pods_tcp_connections_go_at_connect_with_socket_lb_pods() {
    scenario::pods_tcp_connections_go_at_connect::<Ipv4Addr>();
}

/// `--masquerade-all` beside `--socket-lb-pods`: a pod's connections stay tc's, which
/// alone masquerades them, so the backend sees the node's address.
#[test]
fn pods_tcp_connections_stay_tcs_with_masquerade_all() {
    use ebpf_proxy_tests::family::Family;
    let (sb, cgroup) = scenario::hooked_sandbox_with::<Ipv4Addr>(
        &[scenario::web::<Ipv4Addr>(&Ipv4Addr::backend_ips())],
        &["--socket-lb-pods", "--masquerade-all"],
    );
    let http = std::net::SocketAddr::from(Ipv4Addr::http(Ipv4Addr::cluster_ip()));
    let node = Ipv4Addr::node_prefix();
    let before = sb.counter("dnat_new");
    for i in 0..3 {
        scenario::tcp_from(&sb, &sb.client().ns, &cgroup, http, &node, i);
    }
    assert_eq!(
        (
            sb.counter("sock_connect_translated"),
            sb.counter("dnat_new")
        ),
        (0, before + 3),
        "(connect hook, tc's new flows) after 3 connections of the pod with \
         --masquerade-all: tc's alone"
    );
    let status = sb.agent().status().expect("status");
    assert!(
        status.contains("pods' TCP connections to ClusterIPs: at connect() (--socket-lb-pods)"),
        "status does not show the flag, which --masquerade-all overrides:\n{status}"
    );
}

#[test]
fn the_nodes_sockets_show_the_frontend_as_their_peer() {
    scenario::the_nodes_sockets_show_the_frontend_as_their_peer::<Ipv4Addr>();
}

#[test]
fn the_nodes_udp_sockets_connected_to_a_departed_backend_are_closed() {
    scenario::the_nodes_udp_sockets_connected_to_a_departed_backend_are_closed::<Ipv4Addr>();
}

/// (j) What the socket hooks remember about a socket lives with the socket, after
/// 100,000 TCP connections of the node through the hook (the scenario, shared with
/// IPv6: `socket_hooks6::the_nodes_ipv6_socket_notes_outlive_tcp_churn`).
#[test]
fn the_nodes_socket_notes_outlive_tcp_churn() {
    scenario::the_nodes_socket_notes_outlive_tcp_churn::<Ipv4Addr>();
}

/// (k) What the socket hooks remember about a socket is kept in the socket itself,
/// as the agent's pinned iterator lists it (the scenario, shared with IPv6:
/// `socket_hooks6::the_hooks_ipv6_notes_live_in_their_sockets`); then the `SOCK_REVNAT`
/// table an earlier agent kept its notes in is unpinned by the next agent. That step
/// is IPv4's alone: no agent kept IPv6 notes in a table.
#[test]
fn the_hooks_notes_live_in_their_sockets() {
    let (mut sb, cgroup) = scenario::the_hooks_notes_live_in_their_sockets::<Ipv4Addr>();

    // An agent that kept its notes in the SOCK_REVNAT table left it pinned; the next
    // agent unpins it.
    let status = sb.agent_mut().terminate().expect("stop the agent");
    assert!(status.success(), "the agent exited with {status}");
    let revnat = PinLayout::new(sb.agent().bpf_root()).map("SOCK_REVNAT");
    let out = Command::new("bpftool")
        .args(["map", "create"])
        .arg(&revnat)
        .args([
            "type", "lru_hash", "key", "16", "value", "8", "entries", "16",
        ])
        .args(["name", "SOCK_REVNAT"])
        .output()
        .expect("running bpftool");
    assert!(
        out.status.success(),
        "bpftool map create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let root = cgroup.path().display().to_string();
    let mut again = sb
        .agent_on_the_same_root(&["--cgroup-root", &root])
        .expect("start the agent again");
    assert!(
        !revnat.exists()
            && again
                .log()
                .contains("unpinned a map this release no longer has"),
        "a SOCK_REVNAT pin left by an earlier agent stays; log:\n{}",
        again.log()
    );
    let status = again.terminate().expect("stop the restarted agent");
    assert!(status.success(), "the restarted agent exited with {status}");
}
