//! A node with addresses of one family only (docs/kube-proxy-semantics.md, "Dual
//! stack"): kube-proxy runs a proxier for each family the host's kernel supports,
//! whatever addresses the node has, so the Services of the family the node lacks are
//! still served to pods; ebpf-proxy does the same and says once that the node has no
//! address of that family, and again when that changes. The routed one-node world of
//! clusterip.rs, whose node has an IPv4 address and no global IPv6 one, with a
//! dual-stack `test/web`.
//!
//! Every test builds its own namespaces, bpffs root and manifest directory, so they run
//! in parallel; everything is removed on drop, also when a test fails.

use std::{net::Ipv4Addr, time::Duration};

use ebpf_proxy_tests::{
    client::{Peer, TIMEOUT, assert_all_replied_from, tcp_tally, udp_tally},
    eventually,
    netns::NetNs,
    require_root,
    sandbox::Sandbox,
    topology::{
        NODE_IP, add_node_ip6,
        one_node::{
            BACKENDS, CLIENT, CLUSTER_IP, CLUSTER_IP6, TCP_PORT, UDP_PORT, backend_ips,
            backend_ips6, backend_names, dns, dns6, http, http6, web_service,
        },
        pod_ip6,
    },
    wait_until,
};

/// What the agent logs when the node has no address of a family.
const NO_IPV6: &str = "this node has no IPv6 address";
const NO_IPV4: &str = "this node has no IPv4 address";
/// What it logs when the node has addresses of both families again.
const BOTH: &str = "this node has addresses of both families now";

/// A sandbox with the dual-stack `test/web` (every backend in both slices), `ready`
/// run on its node before the agent starts.
fn dual_stack_sandbox(ready: impl FnOnce(&NetNs)) -> Sandbox {
    require_root().expect("privileged test");
    let mut sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let web = web_service(CLUSTER_IP).dual_stack(CLUSTER_IP6);
    sb.manifests()
        .write(
            "web.yaml",
            &format!(
                "{}---\n{}---\n{}",
                web.service_yaml(),
                web.endpoint_slice_yaml(&backend_ips()),
                web.endpoint_slice6_yaml(&backend_ips6())
            ),
        )
        .expect("write manifest");
    ready(&sb.topology().node);
    sb.start_agent_on_manifests().expect("start the agent");
    sb
}

/// The node's global addresses of one family (`-4` or `-6`), as `ip` lists them.
fn global_addresses(node: &NetNs, family: &str) -> String {
    node.ip(&[family, "-brief", "addr", "show", "scope", "global"])
        .unwrap_or_else(|e| panic!("listing the node's addresses: {e:#}"))
}

/// TCP and UDP to `test/web` on one ClusterIP: every backend answers, each seeing
/// the client's address of that family.
fn served<A: Peer>(sb: &Sandbox, client_ip: A::Ip, tcp: A, udp: A, what: &str) {
    let n = 60;
    let names = backend_names();
    let client = &sb.client().ns;
    for (proto, tally) in [
        ("TCP", tcp_tally(client, tcp, n, TIMEOUT)),
        ("UDP", udp_tally(client, udp, n, TIMEOUT)),
    ] {
        let tally = tally.unwrap_or_else(|e| panic!("{proto} to {what}: {e:#}"));
        assert_all_replied_from(client_ip, &format!("{proto} to {what}"), &tally);
        let counts = tally.counts_for(&names);
        assert!(
            tally.replies() == n as u64 && counts.iter().all(|&c| c > 0),
            "{proto} to {what}: {n} requests should all be answered, by all three backends: \
             {:?}",
            tally.counts
        );
    }
}

/// How many lines of the agent's log contain `text`.
fn logged(sb: &Sandbox, text: &str) -> usize {
    sb.agent()
        .log()
        .lines()
        .filter(|l| l.contains(text))
        .count()
}

/// Waits up to `limit` for the agent's log to hold `text` `times` times.
#[track_caller]
fn wait_logged(sb: &Sandbox, text: &str, times: usize, limit: Duration) {
    eventually(
        &format!("{text:?} logged {times} times"),
        limit,
        || match logged(sb, text) {
            n if n >= times => Ok(()),
            n => Err(format!("logged {n} times; the log:\n{}", sb.agent().log())),
        },
    );
}

/// A node without a global IPv6 address serves its IPv6 Services to pods all the
/// same (both ClusterIPs of a dual-stack Service, every backend, the client's address
/// kept), and the agent says so once: not again when the interfaces change (a pod
/// comes), and "both families now" once the node gains an IPv6 address, which the
/// Services keep being served through.
#[test]
fn a_node_without_an_ipv6_address_serves_ipv6_services_and_says_so_once() {
    let mut sb = dual_stack_sandbox(|_| {});
    let node = &sb.topology().node;
    assert_eq!(
        global_addresses(node, "-6").trim(),
        "",
        "the sandbox's node should have no global IPv6 address"
    );
    served(
        &sb,
        pod_ip6(CLIENT.1),
        http6(CLUSTER_IP6),
        dns6(CLUSTER_IP6),
        "the IPv6 ClusterIP on a node without an IPv6 address",
    );
    served(
        &sb,
        CLIENT.1,
        http(CLUSTER_IP),
        dns(CLUSTER_IP),
        "the IPv4 ClusterIP",
    );
    assert_eq!(
        logged(&sb, NO_IPV6),
        1,
        "the missing IPv6 address should be logged once:\n{}",
        sb.agent().log()
    );
    assert_eq!(logged(&sb, NO_IPV4), 0, "the node has an IPv4 address");

    // An interface change makes the agent look at the node's addresses again.
    let late = sb
        .add_pod("late", Ipv4Addr::new(10, 200, 0, 4))
        .expect("add a pod");
    let late_ns = &late.ns;
    let reached = wait_until(
        Duration::from_secs(5),
        Duration::from_millis(100),
        || match tcp_tally(late_ns, http6(CLUSTER_IP6), 1, TIMEOUT) {
            Ok(t) if t.replies() > 0 => Ok(()),
            Ok(t) => Err(format!("{t:?}")),
            Err(e) => Err(format!("{e:#}")),
        },
    );
    if let Err(last) = reached {
        panic!("a pod created after the agent started never reached the IPv6 ClusterIP: {last}");
    }
    assert_eq!(
        logged(&sb, NO_IPV6),
        1,
        "a new interface should not repeat the notice:\n{}",
        sb.agent().log()
    );

    add_node_ip6(&sb.topology().node).expect("the node's IPv6 address");
    wait_logged(&sb, BOTH, 1, Duration::from_secs(5));
    assert_eq!(logged(&sb, NO_IPV6), 1, "said again after the address came");
    served(
        &sb,
        pod_ip6(CLIENT.1),
        http6(CLUSTER_IP6),
        dns6(CLUSTER_IP6),
        "the IPv6 ClusterIP once the node has an IPv6 address",
    );
}

/// The other way round: a node with a global IPv6 address and no IPv4 one still
/// serves its IPv4 Services to pods, and the agent says once that it has no IPv4
/// address.
#[test]
fn a_node_without_an_ipv4_address_serves_ipv4_services_and_says_so_once() {
    let sb = dual_stack_sandbox(|node| {
        node.ip(&["addr", "del", &format!("{NODE_IP}/32"), "dev", "lo"])
            .expect("remove the node's IPv4 address");
        add_node_ip6(node).expect("the node's IPv6 address");
    });
    assert_eq!(
        global_addresses(&sb.topology().node, "-4").trim(),
        "",
        "the node should be left without a global IPv4 address"
    );
    served(
        &sb,
        CLIENT.1,
        http(CLUSTER_IP),
        dns(CLUSTER_IP),
        "the IPv4 ClusterIP on a node without an IPv4 address",
    );
    served(
        &sb,
        pod_ip6(CLIENT.1),
        http6(CLUSTER_IP6),
        dns6(CLUSTER_IP6),
        "the IPv6 ClusterIP",
    );
    assert_eq!(
        (logged(&sb, NO_IPV4), logged(&sb, NO_IPV6)),
        (1, 0),
        "the missing IPv4 address should be logged once, and IPv6 not at all:\n{}",
        sb.agent().log()
    );
}
