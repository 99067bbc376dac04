//! IPv6 ClusterIP load balancing on real packets: the routed node of clusterip.rs,
//! whose pods are dual-stack (tests/src/topology.rs), a Service of IPv6 alone, and
//! real TCP and UDP over IPv6 from the client to its ClusterIP through
//! `tc_ingress6`.
//!
//! Every test builds its own namespaces, bpffs root and manifest directory, so they run
//! in parallel; everything is removed on drop, also when a test fails.

use std::{
    collections::BTreeSet,
    fmt::Write as _,
    net::{Ipv4Addr, Ipv6Addr, SocketAddrV6},
    thread,
    time::{Duration, Instant},
};

use ebpf_proxy_tests::{
    Protocol,
    agent::SYNC_DEADLINE,
    client::{
        Outcome, Peer, Reply, TIMEOUT, Tally, TcpSession, assert_all_replied_from, tcp_request,
        tcp_request_from_port_here, tcp_tally, udp_request, udp_sized_request, udp_tally,
    },
    iptables::{self, KubeService6},
    manifest::{Service, SessionAffinity},
    netns::NetNs,
    sandbox::Sandbox,
    stats::{ChiSquare, chi_square_uniform},
    topology::{
        NODE_IP6, add_node_ip6,
        one_node::{
            BACKENDS, CLIENT, CLUSTER_IP, CLUSTER_IP6, IPT_CLIENT, TCP_PORT, UDP_PORT, backend_ips,
            backend_ips6, backend_names, dns, dns6, http, http6, web_service,
        },
        pod_ip6,
    },
};
use proxy_userspace::datapath::{Maps, PinLayout};

/// Significance level of the distribution tests: a correct datapath fails its
/// check about once in a thousand runs (and so does the ip6tables reference).
const ALPHA: f64 = 0.001;
/// New connections per distribution, as in clusterip.rs.
const CONNECTIONS: usize = 900;

/// `test/web6`: `http` 80/TCP -> 8080 and `dns` 53/UDP -> 5353 on `vip`, IPv6 alone.
fn web6(name: &str, vip: Ipv6Addr) -> Service {
    Service::new_v6("test", name, vip)
        .port("http", 80, Protocol::Tcp, TCP_PORT)
        .port("dns", 53, Protocol::Udp, UDP_PORT)
}

/// The one-node world with `clients` and `test/web6` on all three backends' IPv6
/// addresses, the agent running.
fn serving_web6(clients: &[(&str, Ipv4Addr)]) -> Sandbox {
    let mut sb = Sandbox::new(clients, &BACKENDS, TCP_PORT, UDP_PORT).expect("the one-node world");
    sb.manifests()
        .write(
            "web6.yaml",
            &web6("web6", CLUSTER_IP6).yaml6(&backend_ips6()),
        )
        .expect("write manifest");
    sb.start_agent_on_manifests().expect("start the agent");
    sb
}

/// The ip6tables references' ClusterIPs; the agent does not know them, so
/// `tc_ingress6` passes their traffic to netfilter untouched.
const IPT_VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x20);

fn side_by_side(ebpf: (&[u64], &ChiSquare), ipt: (&[u64], &ChiSquare)) -> String {
    let pct = |c: u64, counts: &[u64]| 100.0 * c as f64 / counts.iter().sum::<u64>() as f64;
    let mut out = format!(
        "{:<12} {:>18} {:>18}\n",
        "backend", "ebpf-proxy", "ip6tables statistic"
    );
    for (i, name) in backend_names().iter().enumerate() {
        let _ = writeln!(
            out,
            "{name:<12} {:>9} ({:>5.1}%) {:>9} ({:>5.1}%)",
            ebpf.0[i],
            pct(ebpf.0[i], ebpf.0),
            ipt.0[i],
            pct(ipt.0[i], ipt.0)
        );
    }
    let _ = writeln!(out, "ebpf-proxy: {}\nip6tables:  {}", ebpf.1, ipt.1);
    out
}

/// New TCP connections to an IPv6 ClusterIP spread over its three backends as
/// kube-proxy's ip6tables cascade spreads them (each a chi-square test for
/// uniformity, in the same run on the same endpoints), and the backends see the
/// client's own IPv6 address.
#[test]
fn ipv6_distribution_matches_ip6tables_statistic_and_keeps_the_client_address() {
    let sb = serving_web6(&[CLIENT, IPT_CLIENT]);
    let names = backend_names();
    let client6 = pod_ip6(CLIENT.1);

    let ebpf =
        tcp_tally(&sb.client().ns, http6(CLUSTER_IP6), CONNECTIONS, TIMEOUT).expect("ebpf run");
    assert_all_replied_from(client6, "ebpf-proxy IPv6 ClusterIP", &ebpf);
    let ebpf_counts = ebpf.counts_for(&names);
    assert_eq!(
        ebpf.replies(),
        CONNECTIONS as u64,
        "replies from unexpected backends: {:?}",
        ebpf.counts
    );

    // The same endpoints behind kube-proxy's ip6tables rules (its statistic
    // cascade), on a VIP the agent does not know.
    let kube = web6("web6", CLUSTER_IP6).kube_service6("http", IPT_VIP6, &backend_ips6());
    iptables::apply(&sb.topology().node, &[kube]).expect("load kube-proxy's ip6tables rules");
    let ipt = tcp_tally(
        &sb.pod(IPT_CLIENT.0).ns,
        http6(IPT_VIP6),
        CONNECTIONS,
        TIMEOUT,
    )
    .expect("ip6tables run");
    assert_all_replied_from(pod_ip6(IPT_CLIENT.1), "ip6tables VIP", &ipt);
    let ipt_counts = ipt.counts_for(&names);

    let ebpf_chi = chi_square_uniform(&ebpf_counts);
    let ipt_chi = chi_square_uniform(&ipt_counts);
    let table = side_by_side((&ebpf_counts, &ebpf_chi), (&ipt_counts, &ipt_chi));
    eprintln!("{CONNECTIONS} new TCP connections over IPv6 each:\n{table}");
    assert!(
        ipt_chi.passes(ALPHA),
        "the ip6tables reference itself is not uniform at alpha {ALPHA} (sandbox problem?):\n{table}"
    );
    assert!(
        ebpf_chi.passes(ALPHA),
        "ebpf-proxy's IPv6 distribution is not uniform at alpha {ALPHA}:\n{table}"
    );
}

/// UDP to the IPv6 ClusterIP is answered by every backend, each answer from the
/// ClusterIP (a connected socket accepts nothing else), the client's address kept.
#[test]
fn ipv6_udp_reaches_backends_with_client_address() {
    let sb = serving_web6(&[CLIENT]);
    let outcomes: Vec<Outcome<SocketAddrV6>> = (0..90)
        .map(|_| udp_request(&sb.client().ns, dns6(CLUSTER_IP6), TIMEOUT))
        .collect();
    let ports_seen: BTreeSet<u16> = outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::Reply(r) => Some(r.peer.port()),
            _ => None,
        })
        .collect();
    let mut tally = Tally::default();
    for outcome in outcomes {
        tally.record(outcome);
    }
    assert_all_replied_from(pod_ip6(CLIENT.1), "UDP to the IPv6 ClusterIP", &tally);
    let counts = tally.counts_for(&backend_names());
    assert!(
        counts.iter().all(|&c| c > 0),
        "90 datagrams should reach all three backends, got {:?}",
        tally.counts
    );
    // Each datagram came from a socket of its own: a flow, two entries, each;
    // but a socket may be given the port of an earlier one (the same flow
    // again), so the count is of the distinct source ports the backends saw.
    let flows = ports_seen.len() as u64;
    // A datagram and its answer do not assure a flow: its entries are in
    // `CT_NEW6`, or in `CONNTRACK6` once a socket's port came round again.
    let status = sb.agent().status().expect("ebpf-proxy status");
    let entries_of = |map: &str| -> u64 {
        let prefix = format!("map fill {map}: ");
        let fill = status
            .lines()
            .find(|l| l.starts_with(&prefix))
            .unwrap_or_else(|| panic!("status shows no {map} fill:\n{status}"));
        fill[prefix.len()..]
            .split(' ')
            .next()
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("unreadable fill line {fill:?}"))
    };
    let entries = entries_of("CONNTRACK6") + entries_of("CT_NEW6");
    assert!(
        entries >= 2 * flows,
        "{entries} entries in CONNTRACK6 and CT_NEW6, fewer than the {flows} flows \
         (distinct client ports) make:\n{status}"
    );
}

/// Fragmented UDP through the IPv6 ClusterIP, both ways: a 4,000-byte request,
/// which the client sends as three fragments on the 1,500-byte MTU, and a
/// 100-byte request whose 4,000-byte answer comes back in fragments. Only a
/// first fragment carries the UDP header; the later ones must follow its
/// translation, or the backend (or the client) never reassembles the
/// datagram. Each answer must be whole and from the ClusterIP, and the
/// counters show the later fragments translated.
#[test]
fn ipv6_fragmented_udp_is_translated_both_ways() {
    const EXCHANGES: usize = 20;
    let sb = serving_web6(&[CLIENT]);
    let client = &sb.client().ns;
    let mut report = String::new();
    for (what, request, answer) in [
        ("4,000-byte requests", 4000, 100),
        ("4,000-byte answers", 100, 4000),
    ] {
        let mut failures = Vec::new();
        for _ in 0..EXCHANGES {
            let exchange =
                || udp_sized_request(client, dns6(CLUSTER_IP6), request, answer, TIMEOUT);
            // One retry, as a UDP client makes: a datagram of three fragments
            // has three chances to be dropped by a busy kernel. A datapath
            // that breaks fragments loses both.
            let outcome = match exchange() {
                Outcome::Reply(r) => Outcome::Reply(r),
                _ => exchange(),
            };
            match outcome {
                Outcome::Reply(r) if *r.peer.ip() == pod_ip6(CLIENT.1) => {}
                other => failures.push(other.to_string()),
            }
        }
        let _ = writeln!(
            report,
            "{what}: {}/{EXCHANGES} answered",
            EXCHANGES - failures.len()
        );
        assert!(
            failures.is_empty(),
            "{what} through the IPv6 ClusterIP: {report}first failures: {:?}",
            &failures[..failures.len().min(5)]
        );
    }
    eprintln!("{report}");
    // Three fragments a datagram, two of them later ones, in each direction.
    let translated = sb.counter("frag_translated");
    assert!(
        translated >= (4 * EXCHANGES) as u64,
        "{translated} later fragments translated for {} fragmented datagrams of three \
         fragments",
        2 * EXCHANGES
    );
}

/// An IPv6 Service without endpoints is refused at once, as kube-proxy's
/// ip6tables rules refuse it: the same Service behind them (its filter table's
/// `-j REJECT`, which answers ICMPv6 port unreachable), on another VIP, from
/// another client. TCP connect and a connected UDP socket get "connection refused"
/// from both, well within a second; ebpf-proxy answers TCP with a RST.
#[test]
fn ipv6_service_without_endpoints_is_refused_at_once_as_ip6tables_refuses_it() {
    let mut sb =
        Sandbox::new(&[CLIENT, IPT_CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let empty_vip = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x30);
    let empty = web6("empty6", empty_vip);
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

/// Removing an endpoint of an IPv6 Service stops new connections to it within the
/// sync deadline; a connection established to it before keeps its backend.
#[test]
fn ipv6_removed_endpoint_gets_no_new_connections_but_keeps_established_ones() {
    let sb = serving_web6(&[CLIENT]);
    let client = &sb.client().ns;
    let (removed, removed_ip) = BACKENDS[2];
    let removed_ip6 = pod_ip6(removed_ip);

    let mut session = (0..200)
        .map(|_| TcpSession::open(client, http6(CLUSTER_IP6), TIMEOUT).expect("connect"))
        .find(|s| s.greeting.backend == removed)
        .unwrap_or_else(|| panic!("200 connections never reached {removed}"));
    assert_eq!(
        session.exchange("before").expect("exchange before removal"),
        format!("{removed} before")
    );

    let remaining: Vec<Ipv6Addr> = backend_ips6()
        .into_iter()
        .filter(|ip| *ip != removed_ip6)
        .collect();
    sb.manifests()
        .write("web6.yaml", &web6("web6", CLUSTER_IP6).yaml6(&remaining))
        .expect("rewrite manifest");
    let written = Instant::now();
    let mut last_hit: Option<Duration> = None;
    while written.elapsed() < SYNC_DEADLINE {
        if let Outcome::Reply(r) = tcp_request(client, http6(CLUSTER_IP6), TIMEOUT)
            && r.backend == removed
        {
            last_hit = Some(written.elapsed());
        }
        thread::sleep(Duration::from_millis(5));
    }
    eprintln!("last new connection to {removed} after the edit: {last_hit:?}");

    let after = tcp_tally(client, http6(CLUSTER_IP6), 150, TIMEOUT).expect("connections");
    assert_all_replied_from(pod_ip6(CLIENT.1), "after the removal", &after);
    assert_eq!(
        after.counts.get(removed),
        None,
        "{SYNC_DEADLINE:?} after the endpoint was removed, new connections still reach it: {:?}",
        after.counts
    );
    assert_eq!(
        after.counts.len(),
        2,
        "both remaining backends should get new connections: {:?}",
        after.counts
    );
    assert_eq!(
        session
            .exchange("after")
            .expect("the established connection broke when its endpoint was removed"),
        format!("{removed} after"),
        "the established connection moved to another backend"
    );
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
    sb.manifests()
        .write("web.yaml", &dual_stack_web_yaml(&remaining6))
        .expect("rewrite manifest");
    thread::sleep(SYNC_DEADLINE);

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
            "{what}: {SYNC_DEADLINE:?} after {removed} left the IPv6 slice, new requests still reach it: {counts:?}"
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
    let sticky = web6("sticky6", CLUSTER_IP6).session_affinity(SessionAffinity::ClientIp {
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
        .write("web6.yaml", &web6("web6", CLUSTER_IP6).yaml6(&[FAR]))
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
        .write("self6.yaml", &web6("self6", CLUSTER_IP6).yaml6(&[own6]))
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

/// An IPv6 Service without any EndpointSlice (not even an empty one) is refused at
/// once, as one with an empty slice is: TCP connect gets "connection refused" (a
/// RST) and a connected UDP socket ICMPv6 port unreachable, well within a second.
#[test]
fn ipv6_service_without_an_endpoint_slice_is_refused_at_once() {
    let mut sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let noslice_vip = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x31);
    sb.manifests()
        .write(
            "noslice6.yaml",
            &web6("noslice6", noslice_vip).service_yaml(),
        )
        .expect("write manifest");
    sb.start_agent_on_manifests().expect("start the agent");
    let client = &sb.client().ns;
    let limit = Duration::from_secs(1);
    for proto in [Protocol::Tcp, Protocol::Udp] {
        let start = Instant::now();
        let outcome = match proto {
            Protocol::Tcp => tcp_request(client, http6(noslice_vip), TIMEOUT),
            Protocol::Udp => udp_request(client, dns6(noslice_vip), TIMEOUT),
        };
        let took = start.elapsed();
        assert_eq!(
            outcome,
            Outcome::Refused,
            "{proto:?} to [{noslice_vip}] (no EndpointSlice) after {took:?}"
        );
        assert!(
            took < limit,
            "{proto:?} to [{noslice_vip}] (no EndpointSlice) took {took:?} to be refused"
        );
    }
    assert!(sb.counter("reject") >= 2, "rejects not counted");
}

/// A UDP port that no backend listens on, behind an IPv6 ClusterIP: the backend's
/// kernel answers with ICMPv6 port unreachable quoting the backend, which the
/// client's socket, connected to the ClusterIP, would not recognise. Translated back
/// it quotes the ClusterIP, so the client fails at once with "connection refused",
/// as with kube-proxy's ip6tables rules (netfilter translates "related" ICMPv6
/// errors), side by side on another VIP from another client. Without the
/// translation each request waits out its timeout.
#[test]
fn ipv6_a_closed_udp_port_behind_a_clusterip_is_refused_as_ip6tables_does() {
    const EXCHANGES: usize = 10;
    const CLOSED_PORT: u16 = 5999;
    let vips = [
        Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x50),
        Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x51),
    ];
    let mut sb =
        Sandbox::new(&[CLIENT, IPT_CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let closed =
        Service::new_v6("test", "closed6", vips[0]).port("dns", 54, Protocol::Udp, CLOSED_PORT);
    sb.manifests()
        .write("closed6.yaml", &closed.yaml6(&backend_ips6()))
        .expect("write manifest");
    sb.start_agent_on_manifests().expect("start the agent");
    let kube = closed.kube_service6("dns", vips[1], &backend_ips6());
    iptables::apply(&sb.topology().node, &[kube]).expect("load kube-proxy's ip6tables rules");
    for (name, _) in BACKENDS {
        // Every request gets its error, however fast they come.
        sb.pod(name)
            .ns
            .sysctl("net.ipv6.icmp.ratelimit", "0")
            .unwrap_or_else(|e| panic!("{name}: lifting the ICMPv6 rate limit: {e:#}"));
    }
    let mut refused = [0usize; 2];
    let mut failures = Vec::new();
    for (i, (client, vip)) in [(CLIENT, vips[0]), (IPT_CLIENT, vips[1])]
        .iter()
        .enumerate()
    {
        for _ in 0..EXCHANGES {
            let answer = sb
                .pod(client.0)
                .ns
                .run(|| {
                    let s = std::net::UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0))?;
                    s.connect(SocketAddrV6::new(*vip, 54, 0, 0))?;
                    s.set_read_timeout(Some(TIMEOUT))?;
                    s.send(b"anyone there?")?;
                    s.recv(&mut [0u8; 64])
                })
                .unwrap_or_else(|e| panic!("{}: {e:#}", client.0));
            match answer {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => refused[i] += 1,
                other => failures.push(format!("{}: {other:?}", ["ebpf-proxy", "ip6tables"][i])),
            }
        }
    }
    let table = format!(
        "refused at once: ebpf-proxy {}/{EXCHANGES}, ip6tables {}/{EXCHANGES}",
        refused[0], refused[1]
    );
    eprintln!("{table}");
    assert_eq!(
        refused[1], EXCHANGES,
        "the ip6tables reference was not refused (sandbox problem?): {failures:?}"
    );
    assert_eq!(
        refused[0],
        EXCHANGES,
        "{table}; first failures: {:?}",
        &failures[..failures.len().min(5)]
    );
    let translated = sb.counter("icmp_error_translated");
    assert!(
        translated >= EXCHANGES as u64,
        "{translated} ICMPv6 errors translated for {EXCHANGES} refusals"
    );
}

/// A closed flow through the IPv6 ClusterIP leaves conntrack state behind for a
/// while. A new, unrelated connection from the same client port straight to the same
/// backend's pod address must not be taken for it: its replies must reach the client
/// unchanged (kube-proxy's netfilter conntrack tells the two flows apart). A timeout
/// here most likely means the backend's SYN-ACK matched the old flow's
/// reply-direction entry and was reverse-NATed to the ClusterIP.
#[test]
fn ipv6_direct_connection_reusing_a_service_flows_port_is_left_alone() {
    let sb = serving_web6(&[CLIENT]);
    let port = 40_123;
    let (via_service, direct) = sb
        .client()
        .ns
        .run(|| {
            let via_service = tcp_request_from_port_here(port, http6(CLUSTER_IP6), TIMEOUT);
            let Outcome::Reply(reply) = &via_service else {
                return (via_service, None);
            };
            // The client closed first, so its side of that flow is in TIME_WAIT; the
            // same port may still connect elsewhere.
            let backend_ip6 = BACKENDS
                .iter()
                .find(|b| b.0 == reply.backend)
                .map(|b| pod_ip6(b.1))
                .expect("a known backend");
            let direct = tcp_request_from_port_here(
                port,
                SocketAddrV6::new(backend_ip6, TCP_PORT, 0, 0),
                TIMEOUT,
            );
            (via_service, Some((backend_ip6, direct)))
        })
        .expect("client namespace");
    let first = via_service.expect_reply("IPv6 connection to the ClusterIP from a fixed port");
    assert_eq!(first.peer, SocketAddrV6::new(pod_ip6(CLIENT.1), port, 0, 0));
    let (backend_ip6, direct) = direct.expect("ran after a reply");
    let direct = direct.expect_reply(&format!(
        "direct connection to [{backend_ip6}]:{TCP_PORT} from port {port} right after a \
         ClusterIP connection from that port reached that backend"
    ));
    assert_eq!(direct.backend, first.backend);
    assert_eq!(*direct.peer.ip(), pod_ip6(CLIENT.1));
}

/// A pod whose interface appears after the agent started reaches the IPv6
/// ClusterIP: the agent attaches `tc_ingress6` to new interfaces as they come
/// (netlink).
#[test]
fn ipv6_pod_created_after_the_agent_started_is_served() {
    let mut sb = serving_web6(&[CLIENT]);
    let late_ip = Ipv4Addr::new(10, 200, 0, 4);
    let late = sb.add_pod("late", late_ip).expect("add a pod");
    let start = Instant::now();
    let deadline = Duration::from_secs(5);
    let mut outcome = tcp_request(&late.ns, http6(CLUSTER_IP6), TIMEOUT);
    while !matches!(outcome, Outcome::Reply(_)) && start.elapsed() < deadline {
        thread::sleep(Duration::from_millis(100));
        outcome = tcp_request(&late.ns, http6(CLUSTER_IP6), TIMEOUT);
    }
    let reply = outcome.expect_reply(&format!(
        "IPv6 ClusterIP from a pod created after the agent started, for {deadline:?}"
    ));
    assert_eq!(*reply.peer.ip(), pod_ip6(late_ip));
    eprintln!(
        "the new pod's first answered IPv6 connection came after {:?}",
        start.elapsed()
    );
}

/// The agent's non-zero counters, for failure messages.
fn counters_text(sb: &Sandbox) -> String {
    let maps = Maps::open_pinned(&PinLayout::new(sb.agent().bpf_root()));
    let counters: Vec<(&str, u64)> = maps
        .and_then(|m| m.counters())
        .map(|c| c.into_iter().filter(|(_, v)| *v > 0).collect())
        .unwrap_or_default();
    format!("{counters:?}")
}

/// One exchange on a connected IPv6 UDP socket; the backend that answered.
fn udp_exchange6(socket: &std::net::UdpSocket, what: &str) -> String {
    socket
        .send(b"hello\n")
        .unwrap_or_else(|e| panic!("{what}: send: {e}"));
    let mut buf = [0u8; 512];
    let n = socket
        .recv(&mut buf)
        .unwrap_or_else(|e| panic!("{what}: no answer: {e}"));
    Reply::<SocketAddrV6>::parse(&String::from_utf8_lossy(&buf[..n]))
        .unwrap_or_else(|e| panic!("{what}: {e:#}"))
        .backend
}

/// A pod that floods the IPv6 ClusterIP with new flows cannot cut anyone's
/// established connections: with `--conntrack-max 1024`, 50 idle TCP connections and
/// 10 UDP flows inside their timeout (each has exchanged twice) keep their backends
/// while another pod sends 64,000 datagrams from 64,000 source ports, each a new flow
/// the backends answer once: 62 times the connections CONNTRACK6 holds. New
/// connections made during the flood are served.
#[test]
fn ipv6_a_pods_flood_of_new_flows_leaves_established_connections_alone() {
    const FLOODER: (&str, Ipv4Addr) = ("flooder", Ipv4Addr::new(10, 200, 0, 4));
    const FLOOD_PORTS: std::ops::Range<u16> = 1024..65_024;
    let mut sb = Sandbox::new(&[CLIENT, FLOODER], &BACKENDS, TCP_PORT, UDP_PORT)
        .expect("the one-node world");
    sb.manifests()
        .write(
            "web6.yaml",
            &web6("web6", CLUSTER_IP6).yaml6(&backend_ips6()),
        )
        .expect("write manifest");
    sb.start_agent_with(&["--conntrack-max", "1024"])
        .expect("start the agent");
    let client = &sb.client().ns;
    let mut sessions: Vec<TcpSession<SocketAddrV6>> = (0..50)
        .map(|i| {
            TcpSession::open(client, http6(CLUSTER_IP6), TIMEOUT)
                .unwrap_or_else(|e| panic!("connection {i}: {e:#}"))
        })
        .collect();
    let udp_flows: Vec<(std::net::UdpSocket, String)> = (0..10)
        .map(|i| {
            let socket = client
                .run(|| {
                    let s = std::net::UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0))?;
                    s.connect(dns6(CLUSTER_IP6))?;
                    s.set_read_timeout(Some(TIMEOUT))?;
                    std::io::Result::Ok(s)
                })
                .and_then(|s| Ok(s?))
                .unwrap_or_else(|e| panic!("UDP flow {i}: {e:#}"));
            let first = udp_exchange6(&socket, &format!("UDP flow {i}"));
            assert_eq!(
                udp_exchange6(&socket, &format!("UDP flow {i}, again")),
                first,
                "UDP flow {i} changed backend between two exchanges"
            );
            (socket, first)
        })
        .collect();

    let flood = sb
        .pod(FLOODER.0)
        .ns
        .spawn("flood", || {
            let mut sent = 0u32;
            for port in FLOOD_PORTS {
                let Ok(socket) = std::net::UdpSocket::bind((Ipv6Addr::UNSPECIFIED, port)) else {
                    continue;
                };
                if socket.send_to(b"flood\n", dns6(CLUSTER_IP6)).is_ok() {
                    sent += 1;
                }
            }
            sent
        })
        .expect("flooding from the flooder pod");
    let during =
        tcp_tally(client, http6(CLUSTER_IP6), 30, TIMEOUT).expect("connections during the flood");
    let sent = flood.join().expect("the flood thread");
    assert!(sent >= 60_000, "only {sent} flood datagrams sent");
    assert_all_replied_from(
        pod_ip6(CLIENT.1),
        "new connections during the flood",
        &during,
    );

    let mut broken = Vec::new();
    for (i, session) in sessions.iter_mut().enumerate() {
        let expected = format!("{} after", session.greeting.backend);
        match session.exchange("after") {
            Ok(answer) if answer == expected => {}
            Ok(answer) => broken.push(format!("TCP {i}: {answer:?}, expected {expected:?}")),
            Err(e) => broken.push(format!("TCP {i}: {e:#}, expected {expected:?}")),
        }
    }
    for (i, (socket, backend)) in udp_flows.iter().enumerate() {
        let now = udp_exchange6(socket, &format!("UDP flow {i} after the flood"));
        if &now != backend {
            broken.push(format!("UDP {i}: answered by {now}, before by {backend}"));
        }
    }
    assert!(
        broken.is_empty(),
        "{} of 60 established IPv6 flows broken by a flood of {sent} new flows; counters: \
         {}; {:?}",
        broken.len(),
        counters_text(&sb),
        &broken[..broken.len().min(10)]
    );
    let new_flows = sb.counter("ct_new_flow");
    assert!(
        new_flows >= u64::from(sent),
        "{new_flows} new flows counted for {sent} flood datagrams"
    );
}

/// Translated IPv6 packets carry valid checksums whatever state the kernel keeps
/// them in: partial (offloaded, what pods send), unnecessary (already verified, here
/// by GRO on the node's side of the veth) and none. IPv6 has no header checksum, so
/// the TCP and UDP ones carry the translated addresses alone; a wrong update must
/// cost a lost packet here, not pass unseen, so every receiver checks checksums
/// itself (`rx off` on the pods' `eth0`) and the node finishes partial ones before
/// they leave it (`tx off` on its pod-side veths). Unlike IPv4's, the IPv6 path
/// leaves every state to the kernel's helper without reading it (proxy-ebpf's
/// `nat6.rs`), so no per-state counter moves: the check is that every exchange of
/// every setting is answered, from the client's own address.
#[test]
fn ipv6_translated_packets_keep_valid_checksums_in_every_checksum_state() {
    use ebpf_proxy_tests::cluster::set_offload;
    let sb = serving_web6(&[CLIENT]);
    let node = &sb.topology().node;
    for pod in sb.topology().pods() {
        set_offload(&pod.ns, "eth0", "rx", false).expect("pod rx checksumming off");
        set_offload(node, &pod.host_if, "tx", false).expect("node tx checksumming off");
    }
    let client6 = pod_ip6(CLIENT.1);
    for (sender_tx, node_gro, state) in [
        (true, false, "partial"),
        (false, false, "none"),
        (false, true, "unnecessary"),
    ] {
        for pod in sb.topology().pods() {
            set_offload(&pod.ns, "eth0", "tx", sender_tx).expect("pod tx");
            set_offload(node, &pod.host_if, "gro", node_gro).expect("node gro");
        }
        for (proto, tally) in [
            (
                "TCP",
                tcp_tally(&sb.client().ns, http6(CLUSTER_IP6), 30, TIMEOUT),
            ),
            (
                "UDP",
                udp_tally(&sb.client().ns, dns6(CLUSTER_IP6), 30, TIMEOUT),
            ),
        ] {
            let what = format!("IPv6 {proto}, {state} checksums");
            let tally = tally.unwrap_or_else(|e| panic!("{what}: {e:#}"));
            assert_all_replied_from(client6, &what, &tally);
            assert_eq!(
                tally.replies(),
                30,
                "{what}: every exchange must be answered (a bad checksum is a lost packet): \
                 {:?}; counters: {}",
                tally.counts,
                counters_text(&sb)
            );
        }
    }
}
