//! The scenarios of clusterip.rs and clusterip6.rs, once over the family
//! ([`Family`]): ClusterIP load balancing of a Service of one family on real
//! packets, in the routed node of docs/architecture.md ("Test topologies"), whose
//! pods are dual-stack, with ebpf-proxy in the node namespace and, where kube-proxy's
//! behaviour is the reference, kube-proxy's own rules of that family on another VIP
//! of the same node.
//!
//! Every scenario builds its own namespaces, bpffs root and manifest directory, so
//! they run in parallel; everything is removed on drop, also when one fails.

use std::{
    collections::BTreeSet,
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    os::fd::{AsFd, OwnedFd},
    thread,
    time::{Duration, Instant},
};

use aya::programs::{SchedClassifier, TcAttachType};

use ebpf_proxy_tests::{
    Protocol,
    agent::{SYNC_DEADLINE, map_fill},
    client::{
        Outcome, Peer, Reply, TIMEOUT, Tally, TcpSession, assert_all_replied_from, tcp_request,
        tcp_request_from_port_here, tcp_request_from_port_reset_here, tcp_tally, udp_request,
        udp_sized_request, udp_tally,
    },
    eventually_value,
    family::Family,
    iptables,
    manifest::Service,
    netns::NetNs,
    raw_bpf::{BPF_F_AFTER, BPF_TCX_INGRESS, link_create, load_tc_next},
    require_root,
    sandbox::Sandbox,
    stats::{ChiSquare, chi_square_uniform},
    topology::one_node::{BACKENDS, CLIENT, IPT_CLIENT, TCP_PORT, UDP_PORT, backend_names},
};
use proxy_userspace::{
    datapath::{Maps, PinLayout},
    planner::encode::addr_words,
};

/// Significance level of the distribution tests: a correct datapath fails its
/// check about once in a thousand runs (and so does the iptables reference).
const ALPHA: f64 = 0.001;
/// New connections per distribution: at least 900, so that each of the chi-square
/// test's cells expects enough of them.
const CONNECTIONS: usize = 900;

/// `test/<name>` of family `F` on `vip`: `http` 80/TCP -> 8080 and `dns` 53/UDP ->
/// 5353.
pub fn web<F: Family>(name: &str, vip: F) -> Service {
    F::service("test", name, vip)
        .port("http", 80, Protocol::Tcp, TCP_PORT)
        .port("dns", 53, Protocol::Udp, UDP_PORT)
}

/// The one-node world with `clients` and `test/web` of family `F` on all three
/// backends, the agent running with `agent_args`.
pub fn serving<F: Family>(clients: &[(&str, Ipv4Addr)], agent_args: &[&str]) -> Sandbox {
    require_root().expect("privileged test");
    let mut sb = Sandbox::new(clients, &BACKENDS, TCP_PORT, UDP_PORT).expect("the one-node world");
    sb.manifests()
        .write(
            "web.yaml",
            &F::yaml(&web("web", F::cluster_ip()), &F::backend_ips()),
        )
        .expect("write manifest");
    sb.start_agent_with(agent_args).expect("start the agent");
    sb
}

/// The agent's non-zero counters, for failure messages.
pub fn counters_text(sb: &Sandbox) -> String {
    sb.agent().nonzero_counters()
}

/// A UDP socket of family `F` in `ns` connected to `to`, with the request timeout.
fn connected_udp<F: Family>(ns: &NetNs, to: F::Addr, what: &str) -> UdpSocket {
    ns.run(|| {
        let s = UdpSocket::bind(F::any(0))?;
        s.connect::<SocketAddr>(to.into())?;
        s.set_read_timeout(Some(TIMEOUT))?;
        std::io::Result::Ok(s)
    })
    .and_then(|s| Ok(s?))
    .unwrap_or_else(|e| panic!("{what}: {e:#}"))
}

/// One exchange on a connected UDP socket of family `F`; the backend that answered.
fn udp_exchange<F: Family>(socket: &UdpSocket, what: &str) -> String {
    socket
        .send(b"hello\n")
        .unwrap_or_else(|e| panic!("{what}: send: {e}"));
    let mut buf = [0u8; 512];
    let n = socket
        .recv(&mut buf)
        .unwrap_or_else(|e| panic!("{what}: no answer: {e}"));
    Reply::<F::Addr>::parse(&String::from_utf8_lossy(&buf[..n]))
        .unwrap_or_else(|e| panic!("{what}: {e:#}"))
        .backend
}

fn side_by_side<F: Family>(ebpf: (&[u64], &ChiSquare), ipt: (&[u64], &ChiSquare)) -> String {
    let pct = |c: u64, counts: &[u64]| 100.0 * c as f64 / counts.iter().sum::<u64>() as f64;
    let mut out = format!(
        "{:<12} {:>18} {:>18}\n",
        "backend",
        "ebpf-proxy",
        format!("{} statistic", F::IPTABLES)
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
    let _ = writeln!(
        out,
        "ebpf-proxy: {}\n{:<12}{}",
        ebpf.1,
        format!("{}:", F::IPTABLES),
        ipt.1
    );
    out
}

/// New TCP connections to the ClusterIP are spread like kube-proxy's statistic
/// cascade spreads them: each distribution passes a chi-square test for uniformity
/// (the cascade's exact probabilities are uniform to 1e-9, see the harness's
/// iptables unit tests), measured on the same endpoints in the same run, and the
/// backends see the client's own address.
pub fn distribution_matches_statistic_and_keeps_the_client_address<F: Family>() {
    let (family, ipt_name) = (F::NAME, F::IPTABLES);
    let sb = serving::<F>(&[CLIENT, IPT_CLIENT], &[]);
    let names = backend_names();

    let ebpf = tcp_tally(
        &sb.client().ns,
        F::http(F::cluster_ip()),
        CONNECTIONS,
        TIMEOUT,
    )
    .expect("ebpf run");
    assert_all_replied_from(
        F::pod(CLIENT.1),
        &format!("ebpf-proxy {family} ClusterIP"),
        &ebpf,
    );
    let ebpf_counts = ebpf.counts_for(&names);
    assert_eq!(
        ebpf.replies(),
        CONNECTIONS as u64,
        "replies from unexpected backends: {:?}",
        ebpf.counts
    );

    // The same service port and endpoints behind kube-proxy's real statistic rules,
    // on another VIP that the agent does not know (so its program passes it
    // untouched).
    let kube = F::kube_service(
        &web("web", F::cluster_ip()),
        "http",
        F::ipt_vip(),
        &F::backend_ips(),
    );
    iptables::apply(&sb.topology().node, &[kube])
        .unwrap_or_else(|e| panic!("load kube-proxy's {ipt_name} rules: {e:#}"));
    let ipt = tcp_tally(
        &sb.pod(IPT_CLIENT.0).ns,
        F::http(F::ipt_vip()),
        CONNECTIONS,
        TIMEOUT,
    )
    .unwrap_or_else(|e| panic!("{ipt_name} run: {e:#}"));
    assert_all_replied_from(F::pod(IPT_CLIENT.1), &format!("{ipt_name} VIP"), &ipt);
    let ipt_counts = ipt.counts_for(&names);

    let ebpf_chi = chi_square_uniform(&ebpf_counts);
    let ipt_chi = chi_square_uniform(&ipt_counts);
    let table = side_by_side::<F>((&ebpf_counts, &ebpf_chi), (&ipt_counts, &ipt_chi));
    eprintln!("{CONNECTIONS} new TCP connections over {family} each:\n{table}");
    assert!(
        ipt_chi.passes(ALPHA),
        "the {ipt_name} reference itself is not uniform at alpha {ALPHA} (sandbox \
         problem?):\n{table}"
    );
    assert!(
        ebpf_chi.passes(ALPHA),
        "ebpf-proxy's {family} distribution is not uniform at alpha {ALPHA}:\n{table}"
    );
}

/// UDP to the ClusterIP is answered by every backend, each answer from the
/// ClusterIP (a connected socket accepts nothing else), the client's address kept;
/// and the agent's conntrack maps of the family hold every flow.
pub fn udp_reaches_backends_with_client_address<F: Family>() {
    let family = F::NAME;
    let sb = serving::<F>(&[CLIENT], &[]);
    let outcomes: Vec<Outcome<F::Addr>> = (0..90)
        .map(|_| udp_request(&sb.client().ns, F::dns(F::cluster_ip()), TIMEOUT))
        .collect();
    let ports_seen: BTreeSet<u16> = outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::Reply(r) => Some(Into::<SocketAddr>::into(r.peer).port()),
            _ => None,
        })
        .collect();
    // The flow-mark slots of the flows' reply keys (backend's port to the
    // client's): two flows may share one, so the marks are counted against
    // the distinct slots, not the flows.
    let reply_slots: BTreeSet<u32> = outcomes
        .iter()
        .filter_map(|o| match o {
            Outcome::Reply(r) => Some(reply_slot::<F>(r)),
            _ => None,
        })
        .collect();
    let mut tally = Tally::default();
    for outcome in outcomes {
        tally.record(outcome);
    }
    assert_all_replied_from(
        F::pod(CLIENT.1),
        &format!("UDP to the {family} ClusterIP"),
        &tally,
    );
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
    // A datagram and its answer do not assure a flow: its entries are in the
    // unassured map, or in the assured one once a socket's port came round again.
    let status = sb.agent().status().expect("ebpf-proxy status");
    let entries_of = |map: &str| -> u64 {
        map_fill(&status, map)
            .unwrap_or_else(|| panic!("status shows no readable {map} fill:\n{status}"))
    };
    let [assured, unassured] = F::CONNTRACK_MAPS;
    let entries = entries_of(assured) + entries_of(unassured);
    assert!(
        entries >= 2 * flows,
        "{entries} entries in {assured} and {unassured}, fewer than the {flows} flows \
         (distinct client ports) make:\n{status}"
    );
    // The flow marks the load opened were refreshed once the programs were
    // attached, and every flow marked its reply.
    let marked = ebpf_proxy_tests::agent::marked_flow_slots(&status)
        .unwrap_or_else(|| panic!("status shows no readable prefilter flow marks:\n{status}"));
    let pins = PinLayout::new(sb.agent().bpf_root());
    let maps = Maps::open_pinned(&pins).expect("opening the agent's pinned maps");
    let marks = maps
        .prefilter_flows
        .as_ref()
        .expect("the agent pins the prefilter's flow marks");
    let unmarked: Vec<u32> = reply_slots
        .iter()
        .copied()
        .filter(|&slot| !marks.is_marked(slot))
        .collect();
    assert!(
        unmarked.is_empty(),
        "{} of the {} slots of the {flows} flows' reply keys are unmarked ({unmarked:?}): \
         their answers would be turned away by the prefilter's flow check",
        unmarked.len(),
        reply_slots.len()
    );
    let slots = u64::from(proxy_common::prefilter::flows::SLOTS);
    let replies = reply_slots.len() as u64;
    assert!(
        (replies..slots).contains(&marked),
        "{marked} of {slots} flow slots marked for {flows} flows, whose reply keys take \
         {replies} slots: the marks opened at load were never refreshed, or flows went \
         unmarked:\n{status}"
    );
}

/// The prefilter flow slot of the reply key of the flow `reply` answered:
/// from the backend's port to the client's address the backend saw.
fn reply_slot<F: Family>(reply: &Reply<F::Addr>) -> u32 {
    let backend = backend_names()
        .iter()
        .position(|name| *name == reply.backend)
        .unwrap_or_else(|| panic!("an answer from {:?}, not a backend", reply.backend));
    let client: SocketAddr = reply.peer.into();
    proxy_common::prefilter::flows::slot(
        &addr_words(F::backend_ips()[backend].into()),
        UDP_PORT.to_be(),
        &addr_words(client.ip()),
        client.port().to_be(),
        proxy_common::PROTO_UDP,
    )
}

/// Fragmented UDP through a ClusterIP, both ways, as kube-proxy's rules serve it
/// (netfilter reassembles before NAT): a 4,000-byte request, which the client sends
/// as three fragments on the 1,500-byte MTU, and a 100-byte request whose 4,000-byte
/// answer comes back in fragments. Only a first fragment carries the UDP header; the
/// later ones must follow its translation, or the backend (or the client) never
/// reassembles the datagram. Each answer must be whole and from the ClusterIP, side
/// by side with the same Service behind kube-proxy's rules; the datapath's counters
/// show the later fragments translated by their first one's ports.
pub fn fragmented_udp_is_translated_both_ways<F: Family>() {
    const EXCHANGES: usize = 20;
    let (family, ipt_name) = (F::NAME, F::IPTABLES);
    let sb = serving::<F>(&[CLIENT, IPT_CLIENT], &[]);
    let kube = F::kube_service(
        &web("web", F::cluster_ip()),
        "dns",
        F::ipt_vip(),
        &F::backend_ips(),
    );
    iptables::apply(&sb.topology().node, &[kube])
        .unwrap_or_else(|e| panic!("load kube-proxy's {ipt_name} rules: {e:#}"));
    let mut table = String::new();
    for (what, request, answer) in [
        ("4,000-byte requests", 4000, 100),
        ("4,000-byte answers", 100, 4000),
    ] {
        let mut answered = [0usize; 2];
        let mut failures = Vec::new();
        for (i, (client, vip)) in [(CLIENT, F::cluster_ip()), (IPT_CLIENT, F::ipt_vip())]
            .iter()
            .enumerate()
        {
            for _ in 0..EXCHANGES {
                let exchange = || {
                    udp_sized_request(&sb.pod(client.0).ns, F::dns(*vip), request, answer, TIMEOUT)
                };
                // One retry, as a UDP client makes: the flood tests running
                // beside this one share the kernel's per-CPU backlog, and a
                // datagram of three fragments has three chances to be
                // dropped there. A datapath that drops fragments loses both.
                let outcome = match exchange() {
                    Outcome::Reply(r) => Outcome::Reply(r),
                    _ => exchange(),
                };
                match outcome {
                    Outcome::Reply(r) if r.peer.peer_ip() == F::pod(client.1) => answered[i] += 1,
                    other => failures.push(format!("{}: {other}", ["ebpf-proxy", ipt_name][i])),
                }
            }
        }
        let _ = writeln!(
            table,
            "{what}: ebpf-proxy {}/{EXCHANGES}, {ipt_name} {}/{EXCHANGES}",
            answered[0], answered[1]
        );
        assert_eq!(
            answered[1], EXCHANGES,
            "the {ipt_name} reference lost {what} (sandbox problem?): {failures:?}"
        );
        assert_eq!(
            answered[0],
            EXCHANGES,
            "{what} through the {family} ClusterIP: {table}first failures: {:?}; counters: {}",
            &failures[..failures.len().min(5)],
            counters_text(&sb)
        );
    }
    eprintln!("{table}");
    // Three fragments a datagram, two of them later ones, in each direction.
    let translated = sb.counter("frag_translated");
    assert!(
        translated >= (4 * EXCHANGES) as u64,
        "{translated} later fragments translated for {} fragmented datagrams of three \
         fragments; counters: {}",
        2 * EXCHANGES,
        counters_text(&sb)
    );
}

/// A UDP port that no backend listens on, behind a ClusterIP: the backend's kernel
/// answers with an ICMP port unreachable quoting the backend, which the client's
/// socket, connected to the ClusterIP, would not recognise. Translated back it
/// quotes the ClusterIP, so the client fails at once with "connection refused", as
/// with kube-proxy's rules (netfilter translates "related" ICMP errors), side by
/// side on another VIP from another client. Without the translation each request
/// waits out its timeout.
pub fn a_closed_udp_port_behind_a_clusterip_is_refused_as_kube_proxy_does<F: Family>() {
    const EXCHANGES: usize = 10;
    const CLOSED_PORT: u16 = 5999;
    let (family, ipt_name) = (F::NAME, F::IPTABLES);
    let vips = [F::vip(50), F::vip(51)];
    require_root().expect("privileged test");
    let mut sb =
        Sandbox::new(&[CLIENT, IPT_CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let closed = F::service("test", "closed", vips[0]).port("dns", 54, Protocol::Udp, CLOSED_PORT);
    sb.manifests()
        .write("closed.yaml", &F::yaml(&closed, &F::backend_ips()))
        .expect("write manifest");
    sb.start_agent_on_manifests().expect("start the agent");
    let kube = F::kube_service(&closed, "dns", vips[1], &F::backend_ips());
    iptables::apply(&sb.topology().node, &[kube])
        .unwrap_or_else(|e| panic!("load kube-proxy's {ipt_name} rules: {e:#}"));
    for (name, _) in BACKENDS {
        // Every request gets its error, however fast they come.
        sb.pod(name)
            .ns
            .sysctl(F::ICMP_RATELIMIT, "0")
            .unwrap_or_else(|e| panic!("{name}: lifting the {family} ICMP rate limit: {e:#}"));
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
                    let s = UdpSocket::bind(F::any(0))?;
                    s.connect::<SocketAddr>(F::addr(*vip, 54).into())?;
                    s.set_read_timeout(Some(TIMEOUT))?;
                    s.send(b"anyone there?")?;
                    s.recv(&mut [0u8; 64])
                })
                .unwrap_or_else(|e| panic!("{}: {e:#}", client.0));
            match answer {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => refused[i] += 1,
                other => failures.push(format!("{}: {other:?}", ["ebpf-proxy", ipt_name][i])),
            }
        }
    }
    let table = format!(
        "refused at once: ebpf-proxy {}/{EXCHANGES}, {ipt_name} {}/{EXCHANGES}",
        refused[0], refused[1]
    );
    eprintln!("{table}");
    assert_eq!(
        refused[1], EXCHANGES,
        "the {ipt_name} reference was not refused (sandbox problem?): {failures:?}"
    );
    assert_eq!(
        refused[0],
        EXCHANGES,
        "{table}; first failures: {:?}; counters: {}",
        &failures[..failures.len().min(5)],
        counters_text(&sb)
    );
    let translated = sb.counter("icmp_error_translated");
    assert!(
        translated >= EXCHANGES as u64,
        "{translated} {family} ICMP errors translated for {EXCHANGES} refusals; counters: {}",
        counters_text(&sb)
    );
}

/// `n` connections from `client` to the `http` port of `vip`, each greeted by
/// its backend.
fn idle_sessions<F: Family>(client: &NetNs, vip: F, n: usize) -> Vec<TcpSession<F::Addr>> {
    (0..n)
        .map(|i| {
            TcpSession::open(client, F::http(vip), TIMEOUT)
                .unwrap_or_else(|e| panic!("connection {i}: {e:#}"))
        })
        .collect()
}

/// What each of `sessions` answers now that it should not: any other backend
/// than the one that greeted it, or an error.
fn broken_sessions<A: Peer>(sessions: &mut [TcpSession<A>]) -> Vec<String> {
    let mut broken = Vec::new();
    for (i, session) in sessions.iter_mut().enumerate() {
        let expected = format!("{} after", session.greeting.backend);
        match session.exchange("after") {
            Ok(answer) if answer == expected => {}
            Ok(answer) => broken.push(format!("TCP {i}: {answer:?}, expected {expected:?}")),
            Err(e) => broken.push(format!("TCP {i}: {e:#}, expected {expected:?}")),
        }
    }
    broken
}

/// A pod that floods the ClusterIP with new flows cannot cut anyone's established
/// connections: with `--conntrack-max 1024` (the least it takes), 50 idle TCP
/// connections and 10 UDP flows inside their timeout (each has exchanged twice) keep
/// their backends while another pod sends 64,000 datagrams from 64,000 source ports,
/// each a new flow the backends answer once: 62 times the connections conntrack
/// holds, and twice what its unassured half (`CT_NEW`, `CT_NEW6`) holds. New
/// connections made during the flood are served.
pub fn a_pods_flood_of_new_flows_leaves_established_connections_alone<F: Family>() {
    const FLOODER: (&str, Ipv4Addr) = ("flooder", Ipv4Addr::new(10, 200, 0, 4));
    const FLOOD_PORTS: std::ops::Range<u16> = 1024..65_024;
    let family = F::NAME;
    let vip = F::cluster_ip();
    let sb = serving::<F>(&[CLIENT, FLOODER], &["--conntrack-max", "1024"]);
    let client = &sb.client().ns;
    let mut sessions = idle_sessions::<F>(client, vip, 50);
    let udp_flows: Vec<(UdpSocket, String)> = (0..10)
        .map(|i| {
            let socket = connected_udp::<F>(client, F::dns(vip), &format!("UDP flow {i}"));
            let first = udp_exchange::<F>(&socket, &format!("UDP flow {i}"));
            assert_eq!(
                udp_exchange::<F>(&socket, &format!("UDP flow {i}, again")),
                first,
                "UDP flow {i} changed backend between two exchanges"
            );
            (socket, first)
        })
        .collect();

    let flood = sb
        .pod(FLOODER.0)
        .ns
        .spawn("flood", move || {
            let mut sent = 0u32;
            for port in FLOOD_PORTS {
                let Ok(socket) = UdpSocket::bind(F::any(port)) else {
                    continue;
                };
                if socket
                    .send_to::<SocketAddr>(b"flood\n", F::dns(vip).into())
                    .is_ok()
                {
                    sent += 1;
                }
            }
            sent
        })
        .expect("flooding from the flooder pod");
    let during =
        tcp_tally(client, F::http(vip), 30, TIMEOUT).expect("connections during the flood");
    let sent = flood.join().expect("the flood thread");
    assert!(sent >= 60_000, "only {sent} flood datagrams sent");
    assert_all_replied_from(
        F::pod(CLIENT.1),
        "new connections during the flood",
        &during,
    );

    let mut broken = broken_sessions(&mut sessions);
    for (i, (socket, backend)) in udp_flows.iter().enumerate() {
        let now = udp_exchange::<F>(socket, &format!("UDP flow {i} after the flood"));
        if &now != backend {
            broken.push(format!("UDP {i}: answered by {now}, before by {backend}"));
        }
    }
    assert!(
        broken.is_empty(),
        "{} of 60 established {family} flows broken by a flood of {sent} new flows; \
         counters: {}; {:?}",
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

/// A pod that completes connections by the thousand cannot evict another pod's
/// established ones: with `--conntrack-max 1024` (the least it takes) and its
/// default per-source share (512 connections), 50 idle TCP connections of one pod
/// keep their backends while another pod completes 4,000 connections through the
/// same ClusterIP (each answered and closed, so each lives on in `TIME_WAIT`):
/// four times what conntrack holds. The flooder's connections past its share are
/// counted (`ct_share_refused`) and still served.
pub fn a_pods_flood_of_answered_connections_leaves_others_established_alone<F: Family>() {
    const FLOODER: (&str, Ipv4Addr) = ("flooder", Ipv4Addr::new(10, 200, 0, 4));
    const FLOOD: usize = 4_000;
    let family = F::NAME;
    let vip = F::cluster_ip();
    let sb = serving::<F>(&[CLIENT, FLOODER], &["--conntrack-max", "1024"]);
    let client = &sb.client().ns;
    let mut sessions = idle_sessions::<F>(client, vip, 50);
    let flood = tcp_tally(&sb.pod(FLOODER.0).ns, F::http(vip), FLOOD, TIMEOUT)
        .expect("the flooder's connections");
    assert_eq!(
        flood.replies() as usize,
        FLOOD,
        "{family}: the flooder's connections past its share must still be served"
    );
    let broken = broken_sessions(&mut sessions);
    assert!(
        broken.is_empty(),
        "{} of 50 idle {family} connections broken by another pod's {FLOOD} completed \
         connections; counters: {}; {:?}",
        broken.len(),
        counters_text(&sb),
        &broken[..broken.len().min(10)]
    );
    let refused = sb.counter("ct_share_refused");
    assert!(
        refused >= (FLOOD - 512) as u64,
        "{family}: {refused} flows past the flooder's share counted, of {FLOOD} \
         connections and a share of 512"
    );
}

/// A flood of SYNs to a Service without endpoints does not turn the node into a
/// reflector: 20,000 SYNs (their source the client's address, as a spoofer would
/// write any other) get at most the kernel's own ICMP error budget of RSTs back
/// (`icmp_msgs_burst` 50 at once, then `icmp_msgs_per_sec` 1,000 a second),
/// counted where they arrive; the rest are dropped and counted
/// (`reject_rate_limited`).
pub fn a_reject_flood_is_held_to_the_icmp_error_budget<F: Family>() {
    const SYNS: u32 = 20_000;
    let family = F::NAME;
    require_root().expect("privileged test");
    let vip = F::vip(52);
    let mut sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let empty = F::service("test", "empty", vip).port("http", 80, Protocol::Tcp, TCP_PORT);
    sb.manifests()
        .write("empty.yaml", &F::yaml(&empty, &[]))
        .expect("write manifest");
    sb.start_agent_on_manifests().expect("start the agent");
    let client = &sb.client().ns;
    // The agent serves the Service (a connection is refused at once) before
    // the flood; the budget refills in the second after.
    eventually_value(
        &format!("{family} the Service without endpoints rejects"),
        Duration::from_secs(10),
        || match tcp_request(client, F::addr(vip, 80), TIMEOUT) {
            Outcome::Refused => Ok(()),
            other => Err(other.to_string()),
        },
    );
    thread::sleep(Duration::from_millis(1_100));
    let in_segs = |what: &str| {
        ebpf_proxy_tests::snmp::read(client)
            .unwrap_or_else(|e| panic!("{what}: the client's SNMP counters: {e:#}"))
            .get("TcpInSegs")
            .copied()
            .unwrap_or(0)
    };
    let (rejects, limited) = (sb.counter("reject"), sb.counter("reject_rate_limited"));
    let before = in_segs("before");
    let started = Instant::now();
    let src = F::pod(CLIENT.1);
    let sent = client
        .run(move || F::syn_flood_here(src, F::addr(vip, 80), SYNS, |_| {}))
        .expect("the flood's thread")
        .expect("the flood");
    // Every RST the node sent has arrived once the counters stand still.
    let mut last = (0, 0);
    let (answered, _) = eventually_value(
        &format!("{family} the rejects of the flood arrive"),
        Duration::from_secs(10),
        || {
            thread::sleep(Duration::from_millis(200));
            let now = (in_segs("after"), sb.counter("reject"));
            if now == last {
                Ok(now.0 - before)
            } else {
                last = now;
                Err(format!("still moving: {now:?}"))
            }
        },
    );
    let elapsed = started.elapsed();
    let seen = sb.counter("reject") - rejects;
    let dropped = sb.counter("reject_rate_limited") - limited;
    let budget = 50 + (1_000.0 * elapsed.as_secs_f64()).ceil() as u64;
    eprintln!(
        "{family}: {sent} SYNs sent, {seen} reached the datapath, {answered} RSTs back, \
         {dropped} dropped over the budget, in {elapsed:?} (budget {budget})"
    );
    assert!(
        seen >= u64::from(sent) / 2,
        "{family}: only {seen} of {sent} SYNs reached the datapath"
    );
    assert!(
        answered <= budget,
        "{family}: {answered} RSTs came back for {seen} SYNs in {elapsed:?}, over the \
         budget of {budget}"
    );
    assert_eq!(
        seen - dropped,
        answered,
        "{family}: the rejects sent ({seen} - {dropped} over the budget) and the RSTs \
         that arrived differ"
    );
}

/// Translated packets carry valid checksums whatever state the kernel keeps them
/// in: partial (offloaded, what pods send), unnecessary (already verified, here by
/// GRO on the node's side of the veth) and none. A wrong update must cost a lost
/// packet here, not pass unseen, so every receiver checks checksums itself (`rx off`
/// on the pods' `eth0`) and the node finishes partial ones before they leave it
/// (`tx off` on its pod-side veths): every exchange of every setting must be
/// answered, from the client's own address. The datapath's per-state counters
/// show that each state was the one tc read, and that none needed the kernel's
/// helper.
pub fn translated_packets_keep_valid_checksums_in_every_checksum_state<F: Family>() {
    use ebpf_proxy_tests::cluster::set_offload;
    let family = F::NAME;
    let sb = serving::<F>(&[CLIENT], &[]);
    let node = &sb.topology().node;
    for pod in sb.topology().pods() {
        set_offload(&pod.ns, "eth0", "rx", false).expect("pod rx checksumming off");
        set_offload(node, &pod.host_if, "tx", false).expect("node tx checksumming off");
    }
    let states = || -> Vec<(&'static str, u64)> {
        let pins = PinLayout::new(sb.agent().bpf_root());
        Maps::open_pinned(&pins)
            .and_then(|maps| maps.counters())
            .expect("reading the agent's counters")
            .into_iter()
            .filter(|(name, _)| name.starts_with("tc_csum_"))
            .collect()
    };
    // The senders' transmit offload decides between partial and none; GRO on
    // the node's side validates checksums on receipt and marks packets
    // unnecessary.
    for (sender_tx, node_gro, state) in [
        (true, false, "partial"),
        (false, false, "none"),
        (false, true, "unnecessary"),
    ] {
        for pod in sb.topology().pods() {
            set_offload(&pod.ns, "eth0", "tx", sender_tx).expect("pod tx");
            set_offload(node, &pod.host_if, "gro", node_gro).expect("node gro");
        }
        let before = states();
        for (proto, tally) in [
            (
                "TCP",
                tcp_tally(&sb.client().ns, F::http(F::cluster_ip()), 30, TIMEOUT),
            ),
            (
                "UDP",
                udp_tally(&sb.client().ns, F::dns(F::cluster_ip()), 30, TIMEOUT),
            ),
        ] {
            let what = format!("{family} {proto}, {state} checksums");
            let tally = tally.unwrap_or_else(|e| panic!("{what}: {e:#}"));
            assert_all_replied_from(F::pod(CLIENT.1), &what, &tally);
            assert_eq!(
                tally.replies(),
                30,
                "{what}: every exchange must be answered (a bad checksum is a lost packet): \
                 {:?}; counters: {}",
                tally.counts,
                counters_text(&sb)
            );
        }
        let after = states();
        let delta: Vec<(&str, u64)> = after
            .iter()
            .zip(&before)
            .map(|((name, a), (_, b))| (*name, a - b))
            .collect();
        // A few control packets the kernel builds itself (a reset, say) carry
        // a software checksum whatever the offload: "most", not "all".
        let total: u64 = delta.iter().map(|d| d.1).sum();
        let seen = |name: &str| delta.iter().find(|(n, _)| *n == name).map_or(0, |d| d.1);
        let named = seen(&format!("tc_csum_{state}"));
        assert!(
            named >= 60 && named * 10 >= total * 9,
            "{state}: tc must have read that state for nearly every translated packet of the \
             60 exchanges; states read: {delta:?}"
        );
        assert_eq!(
            seen("tc_csum_complete") + seen("tc_csum_unknown"),
            0,
            "{state}: no packet may need the helper here; states read: {delta:?}"
        );
    }
}

/// Removing an endpoint from the manifest stops new connections to it within the
/// sync deadline, while a connection established to it before keeps its backend.
pub fn removed_endpoint_gets_no_new_connections_but_keeps_established_ones<F: Family>() {
    let sb = serving::<F>(&[CLIENT], &[]);
    let client = &sb.client().ns;
    let vip = F::http(F::cluster_ip());
    let (removed, removed_ip) = BACKENDS[2];
    let removed_ip = F::pod(removed_ip);

    // An established connection that landed on the backend about to be removed.
    let mut session = (0..200)
        .map(|_| TcpSession::open(client, vip, TIMEOUT).expect("connect"))
        .find(|s| s.greeting.backend == removed)
        .unwrap_or_else(|| panic!("200 connections never reached {removed}"));
    assert_eq!(
        session.exchange("before").expect("exchange before removal"),
        format!("{removed} before")
    );

    let remaining: Vec<F> = F::backend_ips()
        .into_iter()
        .filter(|ip| *ip != removed_ip)
        .collect();
    sb.manifests()
        .write(
            "web.yaml",
            &F::yaml(&web("web", F::cluster_ip()), &remaining),
        )
        .expect("rewrite manifest");
    let written = Instant::now();

    // The point: the deadline is what is tested, so it is let run out before
    // the check below; meanwhile, watch when the change lands (for the message
    // only).
    let mut last_hit: Option<Duration> = None;
    while written.elapsed() < SYNC_DEADLINE {
        if let Outcome::Reply(r) = tcp_request(client, vip, TIMEOUT)
            && r.backend == removed
        {
            last_hit = Some(written.elapsed());
        }
        thread::sleep(Duration::from_millis(5));
    }
    eprintln!("last new connection to {removed} after the edit: {last_hit:?}");

    let after = tcp_tally(client, vip, 150, TIMEOUT).expect("connections");
    assert_all_replied_from(F::pod(CLIENT.1), "after the removal", &after);
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

/// A Service without endpoints is refused at once: TCP connect gets "connection
/// refused" (a RST) and a connected UDP socket an ICMP port unreachable ("connection
/// refused" on recv), both well within a second, for a Service with an empty
/// EndpointSlice and one without any; every refusal is counted.
pub fn service_without_endpoints_is_refused_at_once<F: Family>() {
    require_root().expect("privileged test");
    let mut sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let empty_ip = F::vip(30);
    let noslice_ip = F::vip(31);
    sb.manifests()
        .write("empty.yaml", &F::yaml(&web("empty", empty_ip), &[]))
        .expect("write manifest");
    sb.manifests()
        .write("noslice.yaml", &web("noslice", noslice_ip).service_yaml())
        .expect("write manifest");
    sb.start_agent_on_manifests().expect("start the agent");
    let client = &sb.client().ns;

    let limit = Duration::from_secs(1);
    for (what, ip) in [
        ("empty EndpointSlice", empty_ip),
        ("no EndpointSlice", noslice_ip),
    ] {
        for proto in [Protocol::Tcp, Protocol::Udp] {
            let start = Instant::now();
            let (to, outcome) = match proto {
                Protocol::Tcp => (F::http(ip), tcp_request(client, F::http(ip), TIMEOUT)),
                Protocol::Udp => (F::dns(ip), udp_request(client, F::dns(ip), TIMEOUT)),
                Protocol::Sctp => unreachable!("TCP and UDP only"),
            };
            let took = start.elapsed();
            assert_eq!(
                outcome,
                Outcome::Refused,
                "{proto:?} to {to} ({what}) after {took:?}"
            );
            assert!(
                took < limit,
                "{proto:?} to {to} ({what}) took {took:?} to be refused"
            );
        }
    }
    let rejects = sb.counter("reject");
    assert!(
        rejects >= 4,
        "{rejects} rejects counted for 4 refusals; counters: {}",
        counters_text(&sb)
    );
}

/// With the service CIDR known (`--service-cluster-ip-range`), as kube-proxy's
/// nftables mode: a ClusterIP's undefined ports are refused at once, TCP and
/// UDP; an address of the CIDR that no Service holds gets no answer at all
/// (dropped, and counted); the Service's own ports are served as before.
pub fn the_service_cidr_refuses_undefined_ports_and_drops_unallocated_addresses<F: Family>() {
    let sb = serving::<F>(&[CLIENT], &["--service-cluster-ip-range", F::SERVICE_CIDR]);
    let client = &sb.client().ns;
    let vip = F::cluster_ip();
    assert!(
        matches!(
            tcp_request(client, F::http(vip), TIMEOUT),
            Outcome::Reply(_)
        ),
        "the Service's own port"
    );
    let limit = Duration::from_secs(1);
    for (what, outcome) in [
        ("TCP", tcp_request(client, F::addr(vip, 81), TIMEOUT)),
        ("UDP", udp_request(client, F::addr(vip, 54), TIMEOUT)),
    ] {
        assert_eq!(
            outcome,
            Outcome::Refused,
            "{what} to an undefined port of {vip}"
        );
    }
    let start = Instant::now();
    let outcome = tcp_request(client, F::http(vip), limit);
    assert!(
        matches!(outcome, Outcome::Reply(_)),
        "the Service's own port after the refusals: {outcome:?} in {:?}",
        start.elapsed()
    );
    let unallocated = F::vip(77);
    let outcome = tcp_request(client, F::http(unallocated), limit);
    assert_eq!(
        outcome,
        Outcome::Timeout,
        "TCP to {unallocated}, held by no Service; counters: {}",
        counters_text(&sb)
    );
    let status = sb.agent().status().expect("ebpf-proxy status");
    let want = format!(
        "service CIDRs: {} (1 ClusterIPs held, 0 of another proxy)",
        F::SERVICE_CIDR
    );
    assert!(
        status.lines().any(|l| l == want),
        "status has no line {want:?}:\n{status}"
    );
    let dropped = sb.counter("drop_unallocated");
    let rejected = sb.counter("reject_undefined_port");
    assert!(
        dropped >= 1 && rejected >= 2,
        "{dropped} dropped (want 1 or more: the SYN and its retransmits), {rejected} rejected \
         (want 2 or more); counters: {}",
        counters_text(&sb)
    );
}

/// A closed flow through the ClusterIP leaves conntrack state behind for a while. A
/// new, unrelated connection from the same client port straight to the same
/// backend's pod address (the kernel may pick that port: the destination differs)
/// must not be taken for it: its replies must reach the client unchanged.
/// (kube-proxy's netfilter conntrack tells the two flows apart.) A timeout here most
/// likely means the backend's SYN-ACK matched the old flow's reply-direction entry
/// and was reverse-NATed to the ClusterIP.
pub fn direct_connection_reusing_a_service_flows_port_is_left_alone<F: Family>() {
    let sb = serving::<F>(&[CLIENT], &[]);
    let port = 40_123;
    let (via_service, direct) = sb
        .client()
        .ns
        .run(|| {
            let via_service = tcp_request_from_port_here(port, F::http(F::cluster_ip()), TIMEOUT);
            let Outcome::Reply(reply) = &via_service else {
                return (via_service, None);
            };
            // The client closed first, so its side of that flow is in TIME_WAIT; the
            // same port may still connect elsewhere.
            let backend = BACKENDS
                .iter()
                .find(|b| b.0 == reply.backend)
                .map(|b| F::addr(F::pod(b.1), TCP_PORT))
                .expect("a known backend");
            let direct = tcp_request_from_port_here(port, backend, TIMEOUT);
            (via_service, Some((backend, direct)))
        })
        .expect("client namespace");
    let first = via_service.expect_reply(&format!(
        "{} connection to the ClusterIP from a fixed port",
        F::NAME
    ));
    assert_eq!(first.peer, F::addr(F::pod(CLIENT.1), port));
    let (backend, direct) = direct.expect("ran after a reply");
    let direct = direct.expect_reply(&format!(
        "direct connection to {backend} from port {port} right after a ClusterIP \
         connection from that port reached that backend"
    ));
    assert_eq!(direct.backend, first.backend);
    assert_eq!(direct.peer.peer_ip(), F::pod(CLIENT.1));
}

/// Two Services whose one endpoint is the same pod, and a client that reaches both
/// from one local port while the first connection is still open (Linux hands a
/// connecting socket's port to connections to other destinations; here both sockets
/// bind it with `SO_REUSEADDR`). Translated as they are, both would be one tuple at
/// the backend, whose socket of the first would answer the second's SYN with a
/// challenge ACK, and the first would be reset by what followed. kube-proxy's
/// netfilter gives the second connection another source port at the backend; so
/// must ebpf-proxy, and both connections must go on.
pub fn one_client_port_to_two_services_on_one_backend_stays_two_connections<F: Family>() {
    one_port_through_two_services_to_one_backend::<F>(false);
}

/// The same from the backend pod itself: both connections hairpin, from one source
/// (IPv4's hairpin address with the pod's port kept, which the second must change;
/// IPv6's node address with a SNAT port each).
pub fn a_pod_reaching_itself_from_one_port_through_two_services_stays_two_connections<F: Family>() {
    one_port_through_two_services_to_one_backend::<F>(true);
}

/// Two Services on the first backend pod alone, reached from one port of the client
/// pod, or of that backend pod itself (`hairpin`): two connections that both go on,
/// two tuples at the backend.
fn one_port_through_two_services_to_one_backend<F: Family>(hairpin: bool) {
    require_root().expect("privileged test");
    let mut sb =
        Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("the one-node world");
    // IPv6's hairpin source.
    F::give_node_its_address(&sb.topology().node).expect("the node's address of the family");
    let backend = &F::backend_ips()[..1];
    let (first_vip, second_vip) = (F::vip(61), F::vip(62));
    for (name, vip) in [("first", first_vip), ("second", second_vip)] {
        sb.manifests()
            .write(&format!("{name}.yaml"), &F::yaml(&web(name, vip), backend))
            .expect("write manifest");
    }
    sb.start_agent_on_manifests().expect("start the agent");
    let (from, own) = if hairpin {
        (sb.pod(BACKENDS[0].0), F::pod(BACKENDS[0].1))
    } else {
        (sb.client(), F::pod(CLIENT.1))
    };
    let ns = &from.ns;
    let port = 40_555;
    let client = F::addr(own, port);
    let mut first = TcpSession::open_from_port(ns, port, F::http(first_vip), TIMEOUT)
        .unwrap_or_else(|e| {
            panic!(
                "{} connection to the first Service: {e:#}\ncounters: {}",
                F::NAME,
                counters_text(&sb)
            )
        });
    let seen_first = first.greeting.peer;
    if hairpin {
        assert_ne!(
            seen_first.peer_ip(),
            own,
            "hairpin: the pod saw its own address as the first connection's peer"
        );
    } else {
        assert_eq!(
            seen_first, client,
            "the backend saw the first connection from another port"
        );
    }
    let mut second = TcpSession::open_from_port(ns, port, F::http(second_vip), TIMEOUT)
        .unwrap_or_else(|e| {
            panic!(
                "{} connection to the second Service from port {port}, which a connection \
                 to the first holds at the same backend: {e:#}\ncounters: {}",
                F::NAME,
                counters_text(&sb)
            )
        });
    for (what, session) in [("first", &mut first), ("second", &mut second)] {
        for round in 0..3 {
            let answer = session.exchange(what).unwrap_or_else(|e| {
                panic!(
                    "{} exchange {round} on the {what} connection: {e:#}\ncounters: {}",
                    F::NAME,
                    counters_text(&sb)
                )
            });
            assert!(
                answer.ends_with(what),
                "the {what} connection's answer {answer:?}"
            );
        }
    }
    assert!(
        second.greeting.peer.peer_ip() == seen_first.peer_ip()
            && second.greeting.peer != seen_first,
        "the backend saw the second connection from {}, want the first's address and \
         another port than the first's {seen_first}",
        second.greeting.peer
    );
    // Only a flow that kept its port can clash; a SNAT port is claimed whole.
    let want = u64::from(Into::<SocketAddr>::into(seen_first).port() == port);
    let remapped = sb.counter("ct_port_remapped");
    assert_eq!(
        remapped,
        want,
        "ct_port_remapped, the first connection seen from {seen_first}; counters: {}",
        counters_text(&sb)
    );
}

/// A client that closes each connection with a RST, as a load generator does to stay
/// out of `TIME_WAIT`, may open the next one from the same port to the same ClusterIP
/// at once: the same tuple, while the last flow's entries are closed but not yet gone.
/// Every connection must be answered from that port, as kube-proxy's conntrack
/// answers it: the SYN starts a flow, never finds a backend still holding the last.
pub fn tcp_port_reused_at_once_after_a_reset_is_answered<F: Family>() {
    const CONNECTIONS: usize = 200;
    let sb = serving::<F>(&[CLIENT], &[]);
    let port = 40_321;
    // The client's kernel may refuse a connect with EADDRNOTAVAIL while a socket of
    // the tuple is still there: one CI run saw the last 182 of 200 refused in a row,
    // no packet sent, most likely the closed socket kept open by a child process
    // another test forked in that instant. Nothing of the datapath's: such a connect
    // is tried again after 5 ms, and only what the network answers is judged.
    let mut local_retries = 0;
    let outcomes: Vec<Outcome<F::Addr>> = sb
        .client()
        .ns
        .run(|| {
            (0..CONNECTIONS)
                .map(|_| {
                    loop {
                        let outcome = tcp_request_from_port_reset_here(
                            port,
                            F::http(F::cluster_ip()),
                            TIMEOUT,
                        );
                        match &outcome {
                            Outcome::Failed(why)
                                if why.starts_with("AddrNotAvailable") && local_retries < 1_000 =>
                            {
                                local_retries += 1;
                                thread::sleep(Duration::from_millis(5));
                            }
                            _ => break outcome,
                        }
                    }
                })
                .collect()
        })
        .expect("client namespace");
    if local_retries > 0 {
        eprintln!("{local_retries} connects refused by the client's kernel were tried again");
    }
    let client = F::addr(F::pod(CLIENT.1), port);
    let failed: Vec<String> = outcomes
        .iter()
        .enumerate()
        .filter_map(|(i, outcome)| match outcome {
            Outcome::Reply(reply) if reply.peer == client => None,
            other => Some(format!("#{i}: {other}")),
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {CONNECTIONS} {} connections to the ClusterIP from port {port}, each closed \
         with a RST and the next opened at once, were not answered from that port: \
         {failed:?}\ncounters: {}",
        failed.len(),
        F::NAME,
        counters_text(&sb)
    );
}

/// A pod whose interface appears after the agent started reaches the ClusterIP: the
/// agent attaches its programs to new interfaces as they come (netlink).
pub fn pod_created_after_the_agent_started_is_served<F: Family>() {
    let family = F::NAME;
    let vip = F::http(F::cluster_ip());
    let mut sb = serving::<F>(&[CLIENT], &[]);
    let late_ip = Ipv4Addr::new(10, 200, 0, 4);
    let late = sb.add_pod("late", late_ip).expect("add a pod");
    let start = Instant::now();
    let (reply, _) = eventually_value(
        &format!("an answer to the {family} ClusterIP from a pod created after the agent started"),
        Duration::from_secs(5),
        || match tcp_request(&late.ns, vip, TIMEOUT) {
            Outcome::Reply(reply) => Ok(reply),
            other => Err(format!("{other}")),
        },
    );
    assert_eq!(reply.peer.peer_ip(), F::pod(late_ip));
    eprintln!(
        "the new pod's first answered {family} connection came after {:?}",
        start.elapsed()
    );
}

/// With `--host-routing bpf`, the translated packets of TCP connections and
/// UDP exchanges to a ClusterIP, both ways, go from tc straight into the pod
/// they are for: counted `to_pod`, not one forwarded by the node's stack,
/// every answer still from a backend to the client's own address. With the
/// default routing the stack forwards them all and none goes so. Each world
/// first makes a few exchanges, so that the node knows its pods' neighbour
/// entries: a packet to a pod the FIB has no neighbour entry for yet is
/// left to the stack, which resolves it.
pub fn host_routing_bpf_sends_translated_packets_straight_into_pods<F: Family>() {
    const EXCHANGES: u64 = 24;
    for bpf in [true, false] {
        let args: &[&str] = if bpf { &["--host-routing", "bpf"] } else { &[] };
        let mode = if bpf { "bpf" } else { "stack" };
        let sb = serving::<F>(&[CLIENT], args);
        let node = &sb.topology().node;
        let forwarded = || {
            ebpf_proxy_tests::snmp::read(node)
                .unwrap_or_else(|e| panic!("SNMP counters of the node: {e:#}"))
                .get(F::FORWARDED)
                .copied()
                .unwrap_or_else(|| panic!("no {} in the node's SNMP counters", F::FORWARDED))
        };
        let exchange = |tally: &mut Tally<F::Addr>| {
            let ns = &sb.client().ns;
            tally.record(tcp_request(ns, F::http(F::cluster_ip()), TIMEOUT));
            tally.record(udp_request(ns, F::dns(F::cluster_ip()), TIMEOUT));
        };
        let mut warm = Tally::default();
        for _ in 0..EXCHANGES {
            exchange(&mut warm);
        }
        let (forwarded_before, to_pod_before) = (forwarded(), sb.counter("to_pod"));
        let mut tally = Tally::default();
        for _ in 0..EXCHANGES {
            exchange(&mut tally);
        }
        let what = format!(
            "TCP and UDP to the {} ClusterIP, --host-routing {mode}",
            F::NAME
        );
        assert_all_replied_from(F::pod(CLIENT.1), &what, &tally);
        let to_pod = sb.counter("to_pod") - to_pod_before;
        let by_stack = forwarded() - forwarded_before;
        let status = sb.agent().status().expect("ebpf-proxy status");
        // A connection's SYN, ACK, request and FIN one way, SYN-ACK,
        // answer and FIN the other; a datagram and its answer.
        let least = EXCHANGES * (7 + 2);
        if bpf {
            assert!(
                to_pod >= least && by_stack == 0,
                "{what}: {to_pod} packets sent into pods (at least {least} expected), \
                 {by_stack} forwarded by the node's stack (0 expected); counters: {}",
                counters_text(&sb)
            );
            assert!(
                status.contains(
                    "host routing: bpf (4 pod interfaces known, 0 with a qdisc left to the stack)"
                ),
                "{what}: the status should say so and count the client's and the three \
                 backends' interfaces:\n{status}"
            );
        } else {
            assert!(
                to_pod == 0 && by_stack >= least,
                "{what}: {to_pod} packets sent into pods (0 expected), {by_stack} forwarded \
                 by the node's stack (at least {least} expected); counters: {}",
                counters_text(&sb)
            );
            assert!(
                status.contains(
                    "host routing: stack (0 pod interfaces known, 0 with a qdisc left to the stack)"
                ),
                "{what}: the status should say so, with no pod interface kept:\n{status}"
            );
        }
    }
}

/// Packets the legacy tc ingress filter of `tc_count_every_packet` on
/// `ifname` in `node` redirected: its action's `Sent ... pkt`.
fn tc_filter_packets(node: &NetNs, ifname: &str) -> u64 {
    let out = ebpf_proxy_tests::run_cmd(
        node.command("tc")
            .args(["-s", "filter", "show", "dev", ifname, "ingress"]),
    )
    .unwrap_or_else(|e| panic!("reading the tc filter of {ifname}: {e:#}"));
    out.split("Sent ")
        .nth(1)
        .and_then(|s| s.split(" pkt").next())
        .and_then(|s| s.split_whitespace().nth(2))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no packet count in the tc filter of {ifname}:\n{out}"))
}

/// Puts on `ifname` what the CNI `bandwidth` plugin puts on a pod's
/// host-side interface to limit its egress: an `ingress` qdisc whose `u32`
/// filter matches every packet and redirects it through an `ifb` device of
/// its own, from which it goes on into the stack (the plugin then shapes
/// the `ifb`'s queue). The filter's action counts what it saw
/// (`tc_filter_packets`).
fn tc_count_every_packet(node: &NetNs, ifname: &str) {
    let ifb = format!("i{ifname}");
    node.ip(&["link", "add", "name", &ifb, "type", "ifb"])
        .and_then(|_| node.ip(&["link", "set", "dev", &ifb, "up"]))
        .unwrap_or_else(|e| panic!("an ifb device for {ifname}: {e:#}"));
    for args in [
        &["qdisc", "add", "dev", ifname, "ingress"][..],
        &[
            "filter", "add", "dev", ifname, "parent", "ffff:", "protocol", "all", "prio", "1",
            "u32", "match", "u32", "0", "0", "action", "mirred", "egress", "redirect", "dev", &ifb,
        ],
    ] {
        ebpf_proxy_tests::run_cmd(node.command("tc").args(args))
            .unwrap_or_else(|e| panic!("setting up a tc filter on {ifname}: {e:#}"));
    }
}

/// The agent's tc programs leave the interfaces' other tc users their turn:
/// a packet it does not drop, reject or redirect goes on down the tcx
/// chain (`TCX_NEXT`), to the programs after it and to the legacy tc
/// filters, which kube-proxy never stood between. A legacy ingress filter
/// on the client's and the backends' host-side interfaces, as the CNI
/// `bandwidth` plugin's, sees every packet of connections and datagrams
/// to the ClusterIP and of connections straight to a pod, and the agent
/// translates them all the same.
pub fn other_tc_filters_see_every_packet<F: Family>() {
    let sb = serving::<F>(&[CLIENT], &[]);
    let filtered = filter_every_pod_interface(&sb);
    filters_see_every_packet::<F>(&sb, &filtered);
}

/// The `bandwidth` plugin's setup (`tc_count_every_packet`) on the client's and
/// the backends' host-side interfaces; their names, the client's first.
fn filter_every_pod_interface(sb: &Sandbox) -> Vec<String> {
    let node = &sb.topology().node;
    let filtered: Vec<String> = std::iter::once(sb.client().host_if.clone())
        .chain(backend_names().iter().map(|b| sb.pod(b).host_if.clone()))
        .collect();
    for ifname in &filtered {
        tc_count_every_packet(node, ifname);
    }
    filtered
}

/// TCP and UDP to the ClusterIP and TCP straight to a pod, every packet seen by
/// the legacy filters on `filtered` (the client's interface, then the
/// backends') and translated by the agent all the same.
fn filters_see_every_packet<F: Family>(sb: &Sandbox, filtered: &[String]) {
    const EXCHANGES: u64 = 12;
    let node = &sb.topology().node;
    let (client_if, backend_ifs) = filtered.split_first().expect("the client's interface");
    let dnat_before = sb.counter("dnat_new");
    let ns = &sb.client().ns;
    let pod = F::pod(BACKENDS[0].1);
    let mut tally = Tally::default();
    let mut direct = Tally::default();
    for _ in 0..EXCHANGES {
        tally.record(tcp_request(ns, F::http(F::cluster_ip()), TIMEOUT));
        tally.record(udp_request(ns, F::dns(F::cluster_ip()), TIMEOUT));
        direct.record(tcp_request(ns, F::addr(pod, TCP_PORT), TIMEOUT));
    }
    let what = format!("TCP and UDP to the {} ClusterIP", F::NAME);
    assert_all_replied_from(F::pod(CLIENT.1), &what, &tally);
    assert_all_replied_from(F::pod(CLIENT.1), "TCP straight to a pod", &direct);
    let dnat = sb.counter("dnat_new") - dnat_before;
    assert!(
        dnat >= 2 * EXCHANGES,
        "{what}: {dnat} new flows translated, at least {} expected; counters: {}",
        2 * EXCHANGES,
        counters_text(sb)
    );
    // Each connection's SYN, ACK, request and FIN (or RST) from the client,
    // SYN-ACK, answer and FIN (or RST) back; a datagram each way.
    let sent = tc_filter_packets(node, client_if);
    let least_sent = EXCHANGES * (4 + 1 + 4);
    let answered: u64 = backend_ifs
        .iter()
        .map(|ifname| tc_filter_packets(node, ifname))
        .sum();
    let least_answered = EXCHANGES * (3 + 1 + 3);
    assert!(
        sent >= least_sent && answered >= least_answered,
        "{what} and straight to a pod: the legacy tc filters counted {sent} packets from the \
         client (at least {least_sent} expected) and {answered} from the backends (at least \
         {least_answered}): the agent's programs ended the interfaces' tc processing or \
         redirected packets past it; \
         counters: {}",
        counters_text(sb)
    );
}

/// With `--host-routing bpf`, a pod whose host-side interface carries a qdisc
/// (the CNI `bandwidth` plugin's, here on the client and every backend) keeps the
/// stack's path both ways: tc redirects no packet arriving on it (which would
/// skip its legacy filters, the pod's egress limit) nor into it (which would skip
/// its qdisc, the pod's ingress limit). Its filters see every packet, `to_pod`
/// does not move, and `ebpf-proxy status` counts those interfaces apart.
pub fn host_routing_leaves_shaped_pods_to_the_stack<F: Family>() {
    let sb = serving::<F>(&[CLIENT], &["--host-routing", "bpf"]);
    let filtered = filter_every_pod_interface(&sb);
    let want = format!(
        "host routing: bpf (0 pod interfaces known, {} with a qdisc left to the stack)",
        filtered.len()
    );
    // The agent follows qdiscs as they come (rtnetlink's tc group); what it
    // said is checked after the traffic, which tells more when it is wrong.
    let said = ebpf_proxy_tests::wait_for(Duration::from_secs(10), ebpf_proxy_tests::POLL, || {
        let status = sb.agent().status().map_err(|e| format!("{e:#}"))?;
        if status.contains(&want) {
            Ok(())
        } else {
            Err(status)
        }
    });
    let to_pod_before = sb.counter("to_pod");
    filters_see_every_packet::<F>(&sb, &filtered);
    let to_pod = sb.counter("to_pod") - to_pod_before;
    assert_eq!(
        to_pod,
        0,
        "packets sent into a pod by a redirect, past a shaped interface's qdisc or filters; \
         counters: {}",
        counters_text(&sb)
    );
    if let Err(status) = said {
        panic!("ebpf-proxy status did not say {want:?}:\n{status}");
    }
}

/// The programs in the tcx ingress chain of the node's interface `ifname`, by
/// name.
fn tcx_chain(node: &NetNs, ifname: &str) -> Vec<String> {
    node.run(|| SchedClassifier::query_tcx(ifname, TcAttachType::Ingress))
        .expect("entering the node's namespace")
        .unwrap_or_else(|e| panic!("querying the tcx chain of {ifname}: {e}"))
        .1
        .iter()
        .map(|p| p.name_as_str().unwrap_or("?").to_owned())
        .collect()
}

/// The most programs a tcx chain holds (the kernel's `bpf_mprog_max()`,
/// `BPF_MPROG_MAX` less the slot that ends the array).
const TCX_CHAIN_MAX: usize = 63;

/// An interface the agent cannot attach tc to (here the client's, its tcx chain
/// already full of another tc user's programs) is said at the interface pass and
/// tried again at each reap (10 s), not left alone until the interfaces change:
/// once one of those programs goes, the agent's lands on the next retry, and the
/// client reaches the ClusterIP, which it could not before.
pub fn a_failed_attach_is_retried_until_it_lands<F: Family>() {
    require_root().expect("privileged test");
    let mut sb =
        Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("the one-node world");
    sb.manifests()
        .write(
            "web.yaml",
            &F::yaml(&web("web", F::cluster_ip()), &F::backend_ips()),
        )
        .expect("write manifest");
    let client_if = sb.client().host_if.clone();
    let mut others: Vec<(OwnedFd, OwnedFd)> = sb
        .topology()
        .node
        .run(|| -> std::io::Result<Vec<(OwnedFd, OwnedFd)>> {
            let index = nix::net::if_::if_nametoindex(client_if.as_str())?;
            (0..TCX_CHAIN_MAX)
                .map(|i| {
                    let prog = load_tc_next(&format!("other_tc_{i}"))?;
                    let link = link_create(prog.as_fd(), index, BPF_TCX_INGRESS, BPF_F_AFTER)?;
                    Ok((prog, link))
                })
                .collect()
        })
        .expect("entering the node's namespace")
        .unwrap_or_else(|e| panic!("filling the tcx chain of {client_if}: {e}"));
    sb.start_agent_with(&[]).expect("start the agent");
    let node = &sb.topology().node;
    let log = sb.agent().log();
    assert!(
        log.contains("interface left without the datapath") && log.contains(&client_if),
        "the agent did not say it could not attach to {client_if}, whose tcx chain is \
         full:\n{log}"
    );
    assert!(
        !tcx_chain(node, &client_if).contains(&"tc_ingress".to_owned()),
        "tc_ingress in the full tcx chain of {client_if}"
    );
    let ns = &sb.client().ns;
    let before = tcp_request(ns, F::http(F::cluster_ip()), TIMEOUT);
    assert!(
        !matches!(before, Outcome::Reply(_)),
        "the {} ClusterIP answered the client before the agent's tc program was on its \
         interface: {before}",
        F::NAME
    );

    others.pop();
    ebpf_proxy_tests::eventually(
        "the agent's tc program attached on a retry",
        Duration::from_secs(30),
        || {
            let chain = tcx_chain(node, &client_if);
            if chain.last().map(String::as_str) == Some("tc_ingress") {
                Ok(())
            } else {
                Err(format!(
                    "the tcx chain of {client_if} ends {:?}",
                    chain.last()
                ))
            }
        },
    );
    // The agent says so just after the attach the chain shows, which a
    // poll of the chain can see first.
    ebpf_proxy_tests::eventually(
        "the agent saying it attached on a retry",
        Duration::from_secs(5),
        || {
            let log = sb.agent().log();
            if log.contains("attached on a retry") {
                Ok(())
            } else {
                Err(format!(
                    "the agent did not say it attached on a retry:\n{log}"
                ))
            }
        },
    );
    let tally = tcp_tally(ns, F::http(F::cluster_ip()), 10, TIMEOUT).expect("TCP tally");
    assert_all_replied_from(
        F::pod(CLIENT.1),
        &format!("the {} ClusterIP after the retry", F::NAME),
        &tally,
    );
    drop(others);
}
