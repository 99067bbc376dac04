//! ClusterIP load balancing on real packets: a routed node (docs/architecture.md, "Test topologies") with a
//! client pod and three backend pods, ebpf-proxy in the node namespace, and real TCP
//! and UDP traffic from the client to the ClusterIP. The node's own connections
//! through the socket hooks are in `socket_hooks.rs`; the pinned datapath across
//! agents (restarts, upgrades, resizes, cleanup) in `pinned_datapath.rs`.
//!
//! Every test builds its own namespaces, bpffs root and manifest directory, so they run
//! in parallel; everything is removed on drop, also when a test fails.

use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddrV4},
    thread,
    time::{Duration, Instant},
};

use ebpf_proxy_tests::{
    Protocol,
    agent::SYNC_DEADLINE,
    client::{
        Outcome, TIMEOUT, TcpSession, assert_all_replied_from, tcp_request,
        tcp_request_from_port_here, tcp_tally, udp_request, udp_sized_request, udp_tally,
    },
    iptables,
    manifest::Service,
    require_root,
    sandbox::Sandbox,
    stats::{ChiSquare, chi_square_uniform},
    topology::one_node::{
        BACKENDS, CLIENT, CLUSTER_IP, IPT_CLIENT, TCP_PORT, UDP_PORT, backend_ips, backend_names,
        dns, http, web_service,
    },
};
use proxy_userspace::datapath::{Maps, PinLayout};

/// Significance level of the distribution tests: a correct datapath fails its
/// check about once in a thousand runs (and so does the iptables reference).
const ALPHA: f64 = 0.001;
/// New connections per distribution: at least 900, so that each of the chi-square
/// test's cells expects enough of them.
const CONNECTIONS: usize = 900;

fn side_by_side(ebpf: (&[u64], &ChiSquare), ipt: (&[u64], &ChiSquare)) -> String {
    let pct = |c: u64, counts: &[u64]| 100.0 * c as f64 / counts.iter().sum::<u64>() as f64;
    let mut out = format!(
        "{:<12} {:>18} {:>18}\n",
        "backend", "ebpf-proxy", "iptables statistic"
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
    let _ = writeln!(out, "ebpf-proxy: {}\niptables:   {}", ebpf.1, ipt.1);
    out
}

/// (a) New connections to the ClusterIP are spread like kube-proxy's iptables cascade
/// spreads them: each distribution passes a chi-square test for uniformity (the
/// cascade's exact probabilities are uniform to 1e-9, see the harness's iptables unit
/// tests), measured on the same endpoints in the same run, and the backends see the
/// client's address.
#[test]
fn distribution_matches_iptables_statistic() {
    let sb = Sandbox::serving_web(&[CLIENT, IPT_CLIENT], &[]).expect("the one-node world");
    let names = backend_names();

    let ebpf =
        tcp_tally(&sb.client().ns, http(CLUSTER_IP), CONNECTIONS, TIMEOUT).expect("ebpf run");
    assert_all_replied_from(CLIENT.1, "ebpf-proxy ClusterIP", &ebpf);
    let ebpf_counts = ebpf.counts_for(&names);
    assert_eq!(
        ebpf.replies(),
        CONNECTIONS as u64,
        "replies from unexpected backends: {:?}",
        ebpf.counts
    );

    // The same service port and endpoints behind real iptables statistic rules, on
    // another VIP that the agent does not know (so its program passes it untouched).
    let ipt_vip = Ipv4Addr::new(10, 96, 0, 20);
    let kube = web_service(CLUSTER_IP).kube_service("http", ipt_vip, &backend_ips());
    iptables::apply(&sb.topology().node, &[kube]).expect("load kube-proxy rules");
    let ipt_client = &sb.pod(IPT_CLIENT.0).ns;
    let ipt = tcp_tally(ipt_client, http(ipt_vip), CONNECTIONS, TIMEOUT).expect("iptables run");
    assert_all_replied_from(IPT_CLIENT.1, "iptables VIP", &ipt);
    let ipt_counts = ipt.counts_for(&names);

    let ebpf_chi = chi_square_uniform(&ebpf_counts);
    let ipt_chi = chi_square_uniform(&ipt_counts);
    let table = side_by_side((&ebpf_counts, &ebpf_chi), (&ipt_counts, &ipt_chi));
    eprintln!("{CONNECTIONS} new TCP connections each:\n{table}");
    assert!(
        ipt_chi.passes(ALPHA),
        "the iptables reference itself is not uniform at alpha {ALPHA} (sandbox problem?):\n{table}"
    );
    assert!(
        ebpf_chi.passes(ALPHA),
        "ebpf-proxy's distribution is not uniform at alpha {ALPHA}:\n{table}"
    );
}

/// (b) UDP to the ClusterIP is answered by the backends, the reply comes from the
/// ClusterIP (a connected socket accepts nothing else), and the client's address is
/// preserved.
#[test]
fn udp_reaches_backends_with_client_address() {
    let sb = Sandbox::serving_web(&[CLIENT], &[]).expect("the one-node world");
    let tally = udp_tally(&sb.client().ns, dns(CLUSTER_IP), 90, TIMEOUT).expect("udp run");
    assert_all_replied_from(CLIENT.1, "UDP to the ClusterIP", &tally);
    let counts = tally.counts_for(&backend_names());
    assert!(
        counts.iter().all(|&c| c > 0),
        "90 datagrams should reach all three backends, got {:?}",
        tally.counts
    );
}

/// Fragmented UDP through a ClusterIP, both ways, as kube-proxy's rules serve it (netfilter
/// reassembles before NAT): a 4,000-byte request, which the client sends as three
/// fragments on the 1,500-byte MTU, and a 100-byte request whose 4,000-byte answer
/// comes back in fragments. Each answer must be whole and from the ClusterIP, side by
/// side with the same Service behind kube-proxy's iptables rules; the datapath's
/// counters show the later fragments translated by their first one's ports.
#[test]
fn fragmented_udp_is_translated_both_ways_as_iptables_does() {
    const EXCHANGES: usize = 20;
    let sb = Sandbox::serving_web(&[CLIENT, IPT_CLIENT], &[]).expect("the one-node world");
    let ipt_vip = Ipv4Addr::new(10, 96, 0, 20);
    let kube = web_service(CLUSTER_IP).kube_service("dns", ipt_vip, &backend_ips());
    iptables::apply(&sb.topology().node, &[kube]).expect("load kube-proxy rules");
    let mut table = String::new();
    for (what, request, answer) in [
        ("4,000-byte requests", 4000, 100),
        ("4,000-byte answers", 100, 4000),
    ] {
        let mut answered = [0usize; 2];
        let mut failures = Vec::new();
        for (i, (client, vip)) in [(CLIENT, CLUSTER_IP), (IPT_CLIENT, ipt_vip)]
            .iter()
            .enumerate()
        {
            for _ in 0..EXCHANGES {
                let exchange =
                    || udp_sized_request(&sb.pod(client.0).ns, dns(*vip), request, answer, TIMEOUT);
                // One retry, as a UDP client makes: the flood tests running
                // beside this one share the kernel's per-CPU backlog, and a
                // datagram of three fragments has three chances to be
                // dropped there. A datapath that drops fragments loses both.
                let outcome = match exchange() {
                    Outcome::Reply(r) => Outcome::Reply(r),
                    _ => exchange(),
                };
                match outcome {
                    Outcome::Reply(r) if *r.peer.ip() == client.1 => answered[i] += 1,
                    other => failures.push(format!("{}: {other}", ["ebpf-proxy", "iptables"][i])),
                }
            }
        }
        let _ = writeln!(
            table,
            "{what}: ebpf-proxy {}/{EXCHANGES}, iptables {}/{EXCHANGES}",
            answered[0], answered[1]
        );
        assert_eq!(
            answered[1], EXCHANGES,
            "the iptables reference lost {what} (sandbox problem?): {failures:?}"
        );
        assert_eq!(
            answered[0],
            EXCHANGES,
            "{what} through the ClusterIP: {table}first failures: {:?}; counters: {}",
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
/// answers with ICMP port unreachable quoting the backend, which the client's socket,
/// connected to the ClusterIP, would not recognise. Translated back it quotes the
/// ClusterIP, so the client fails at once with "connection refused", as with
/// kube-proxy's iptables rules (netfilter translates "related" ICMP errors). Without
/// the translation each request waits out its timeout.
#[test]
fn a_closed_udp_port_behind_a_clusterip_is_refused_as_iptables_does() {
    const EXCHANGES: usize = 10;
    const CLOSED_PORT: u16 = 5999;
    let vips = [Ipv4Addr::new(10, 96, 0, 50), Ipv4Addr::new(10, 96, 0, 51)];
    require_root().expect("privileged test");
    let mut sb =
        Sandbox::new(&[CLIENT, IPT_CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let closed =
        Service::new("test", "closed", vips[0]).port("dns", 54, Protocol::Udp, CLOSED_PORT);
    sb.manifests()
        .write("closed.yaml", &closed.yaml(Some(&backend_ips())))
        .expect("write manifest");
    sb.start_agent_on_manifests().expect("start the agent");
    let kube = closed.kube_service("dns", vips[1], &backend_ips());
    iptables::apply(&sb.topology().node, &[kube]).expect("load kube-proxy rules");
    for (name, _) in BACKENDS {
        // Every request gets its error, however fast they come.
        sb.pod(name)
            .ns
            .run(|| std::fs::write("/proc/sys/net/ipv4/icmp_ratelimit", "0"))
            .and_then(|r| Ok(r?))
            .unwrap_or_else(|e| panic!("{name}: lifting the ICMP rate limit: {e:#}"));
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
                    let s = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
                    s.connect(SocketAddrV4::new(*vip, 54))?;
                    s.set_read_timeout(Some(TIMEOUT))?;
                    s.send(b"anyone there?")?;
                    s.recv(&mut [0u8; 64])
                })
                .unwrap_or_else(|e| panic!("{}: {e:#}", client.0));
            match answer {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => refused[i] += 1,
                other => failures.push(format!("{}: {other:?}", ["ebpf-proxy", "iptables"][i])),
            }
        }
    }
    let table = format!(
        "refused at once: ebpf-proxy {}/{EXCHANGES}, iptables {}/{EXCHANGES}",
        refused[0], refused[1]
    );
    eprintln!("{table}");
    assert_eq!(
        refused[1], EXCHANGES,
        "the iptables reference was not refused (sandbox problem?): {failures:?}"
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
        "{translated} ICMP errors translated for {EXCHANGES} refusals; counters: {}",
        counters_text(&sb)
    );
}

/// A pod that floods the ClusterIP with new flows cannot cut anyone's established
/// connections: with `--conntrack-max 1024` (the least it takes), 50 idle TCP connections and
/// 10 UDP flows inside their timeout (each has exchanged twice) keep their backends
/// while another pod sends 64,000 datagrams from 64,000 source ports, each a new flow
/// the backends answer once: 62 times the connections conntrack holds, and twice
/// what its unassured half (`CT_NEW`) holds. New connections made during the flood are served.
#[test]
fn a_pods_flood_of_new_flows_leaves_established_connections_alone() {
    const FLOODER: (&str, Ipv4Addr) = ("flooder", Ipv4Addr::new(10, 200, 0, 4));
    const FLOOD_PORTS: std::ops::Range<u16> = 1024..65_024;
    let sb = Sandbox::serving_web(&[CLIENT, FLOODER], &["--conntrack-max", "1024"])
        .expect("the one-node world");
    let client = &sb.client().ns;
    let mut sessions: Vec<TcpSession> = (0..50)
        .map(|i| {
            TcpSession::open(client, http(CLUSTER_IP), TIMEOUT)
                .unwrap_or_else(|e| panic!("connection {i}: {e:#}"))
        })
        .collect();
    let udp_flows: Vec<(std::net::UdpSocket, String)> = (0..10)
        .map(|i| {
            let socket = client
                .run(|| {
                    let s = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
                    s.connect(dns(CLUSTER_IP))?;
                    s.set_read_timeout(Some(TIMEOUT))?;
                    std::io::Result::Ok(s)
                })
                .and_then(|s| Ok(s?))
                .unwrap_or_else(|e| panic!("UDP flow {i}: {e:#}"));
            let first = udp_exchange(&socket, &format!("UDP flow {i}"));
            assert_eq!(
                udp_exchange(&socket, &format!("UDP flow {i}, again")),
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
                let Ok(socket) = std::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port)) else {
                    continue;
                };
                if socket.send_to(b"flood\n", dns(CLUSTER_IP)).is_ok() {
                    sent += 1;
                }
            }
            sent
        })
        .expect("flooding from the flooder pod");
    let during =
        tcp_tally(client, http(CLUSTER_IP), 30, TIMEOUT).expect("connections during the flood");
    let sent = flood.join().expect("the flood thread");
    assert!(sent >= 60_000, "only {sent} flood datagrams sent");
    assert_all_replied_from(CLIENT.1, "new connections during the flood", &during);

    let mut broken = Vec::new();
    for (i, session) in sessions.iter_mut().enumerate() {
        let expected = format!("{} after", session.greeting.backend);
        match session.exchange("after") {
            Ok(answer) if answer == expected => {}
            other => broken.push(format!("TCP {i}: {other:?}, expected {expected:?}")),
        }
    }
    for (i, (socket, backend)) in udp_flows.iter().enumerate() {
        let now = udp_exchange(socket, &format!("UDP flow {i} after the flood"));
        if &now != backend {
            broken.push(format!("UDP {i}: answered by {now}, before by {backend}"));
        }
    }
    assert!(
        broken.is_empty(),
        "{} of 60 established flows broken by a flood of {sent} new flows; counters: {}; {:?}",
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

/// One exchange on a connected UDP socket; the backend that answered.
fn udp_exchange(socket: &std::net::UdpSocket, what: &str) -> String {
    socket
        .send(b"hello\n")
        .unwrap_or_else(|e| panic!("{what}: send: {e}"));
    let mut buf = [0u8; 512];
    let n = socket
        .recv(&mut buf)
        .unwrap_or_else(|e| panic!("{what}: no answer: {e}"));
    ebpf_proxy_tests::client::Reply::<SocketAddrV4>::parse(&String::from_utf8_lossy(&buf[..n]))
        .unwrap_or_else(|e| panic!("{what}: {e:#}"))
        .backend
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

/// Translated packets carry valid checksums whatever state the kernel keeps them
/// in: partial (offloaded, what pods send), unnecessary (already verified, here by
/// GRO on the node's side of the veth) and none. tc reads the state and updates
/// checksums in place; a wrong update must cost a lost packet here, not pass
/// unseen, so every receiver checks checksums itself (`rx off` on the pods'
/// `eth0`) and the node finishes partial ones before they leave it (`tx off` on
/// its pod-side veths). The datapath's per-state counters show that each state
/// was the one tc read.
#[test]
fn translated_packets_keep_valid_checksums_in_every_checksum_state() {
    use ebpf_proxy_tests::cluster::set_offload;
    let sb = Sandbox::serving_web(&[CLIENT], &[]).expect("the one-node world");
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
        let tcp = tcp_tally(&sb.client().ns, http(CLUSTER_IP), 30, TIMEOUT).expect("tcp run");
        assert_all_replied_from(CLIENT.1, &format!("TCP, {state} checksums"), &tcp);
        let udp = udp_tally(&sb.client().ns, dns(CLUSTER_IP), 30, TIMEOUT).expect("udp run");
        assert_all_replied_from(CLIENT.1, &format!("UDP, {state} checksums"), &udp);
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
            "{state}: tc must have read that state for nearly every translated packet of the 60 exchanges; states read: {delta:?}"
        );
        assert_eq!(
            seen("tc_csum_complete") + seen("tc_csum_unknown"),
            0,
            "{state}: no packet may need the helper here; states read: {delta:?}"
        );
    }
}

/// (c) Removing an endpoint from the manifest stops new connections to it within a
/// second, while a connection established to it before keeps working.
#[test]
fn removed_endpoint_gets_no_new_connections_but_keeps_established_ones() {
    let sb = Sandbox::serving_web(&[CLIENT], &[]).expect("the one-node world");
    let client = &sb.client().ns;
    let (removed, removed_ip) = BACKENDS[2];

    // An established connection that landed on the backend about to be removed.
    let mut session = (0..200)
        .map(|_| TcpSession::open(client, http(CLUSTER_IP), TIMEOUT).expect("connect"))
        .find(|s| s.greeting.backend == removed)
        .unwrap_or_else(|| panic!("200 connections never reached {removed}"));
    assert_eq!(
        session.exchange("before").expect("exchange before removal"),
        format!("{removed} before")
    );

    let remaining: Vec<Ipv4Addr> = backend_ips()
        .into_iter()
        .filter(|ip| *ip != removed_ip)
        .collect();
    sb.manifests()
        .write("web.yaml", &web_service(CLUSTER_IP).yaml(Some(&remaining)))
        .expect("rewrite manifest");
    let written = Instant::now();

    // Until the deadline, watch when the change lands (for the message only).
    let mut last_hit: Option<Duration> = None;
    while written.elapsed() < SYNC_DEADLINE {
        if let Outcome::Reply(r) = tcp_request(client, http(CLUSTER_IP), TIMEOUT)
            && r.backend == removed
        {
            last_hit = Some(written.elapsed());
        }
        thread::sleep(Duration::from_millis(5));
    }
    eprintln!("last new connection to {removed} after the edit: {last_hit:?}");

    let after = tcp_tally(client, http(CLUSTER_IP), 150, TIMEOUT).expect("connections");
    assert_all_replied_from(CLIENT.1, "after the removal", &after);
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

/// (d) A service without endpoints is refused at once: TCP connect gets ECONNREFUSED
/// and a connected UDP socket gets ICMP port unreachable (ECONNREFUSED on recv), both
/// well within a second, for a service with an empty EndpointSlice and one without any.
#[test]
fn service_without_endpoints_is_refused_at_once() {
    require_root().expect("privileged test");
    let mut sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let empty_ip = Ipv4Addr::new(10, 96, 0, 30);
    let noslice_ip = Ipv4Addr::new(10, 96, 0, 31);
    let empty = Service::new("test", "empty", empty_ip)
        .port("http", 80, Protocol::Tcp, TCP_PORT)
        .port("dns", 53, Protocol::Udp, UDP_PORT);
    let noslice = Service::new("test", "noslice", noslice_ip)
        .port("http", 80, Protocol::Tcp, TCP_PORT)
        .port("dns", 53, Protocol::Udp, UDP_PORT);
    sb.manifests()
        .write("empty.yaml", &empty.yaml(Some(&[])))
        .expect("write manifest");
    sb.manifests()
        .write("noslice.yaml", &noslice.yaml(None))
        .expect("write manifest");
    sb.start_agent_on_manifests().expect("start the agent");
    let client = &sb.client().ns;

    let limit = Duration::from_secs(1);
    for (what, ip) in [
        ("empty EndpointSlice", empty_ip),
        ("no EndpointSlice", noslice_ip),
    ] {
        let start = Instant::now();
        let tcp = tcp_request(client, http(ip), TIMEOUT);
        let took = start.elapsed();
        assert_eq!(
            tcp,
            Outcome::Refused,
            "TCP to {ip}:80 ({what}) after {took:?}"
        );
        assert!(
            took < limit,
            "TCP to {ip}:80 ({what}) took {took:?} to be refused"
        );

        let start = Instant::now();
        let udp = udp_request(client, dns(ip), TIMEOUT);
        let took = start.elapsed();
        assert_eq!(
            udp,
            Outcome::Refused,
            "UDP to {ip}:53 ({what}) after {took:?}"
        );
        assert!(
            took < limit,
            "UDP to {ip}:53 ({what}) took {took:?} to be refused"
        );
    }
}

/// A closed flow through the ClusterIP leaves conntrack state behind for a while. A
/// new, unrelated connection from the same client port straight to the same backend's
/// pod address (the kernel may pick that port: the destination differs) must not be
/// taken for it: its replies must reach the client unchanged. (kube-proxy's netfilter
/// conntrack tells the two flows apart.) A timeout here most likely means the
/// backend's SYN-ACK matched the old flow's reply-direction entry and was
/// reverse-NATed to the ClusterIP.
#[test]
fn direct_connection_reusing_a_service_flows_port_is_left_alone() {
    let sb = Sandbox::serving_web(&[CLIENT], &[]).expect("the one-node world");
    let port = 40_123;
    let (via_service, direct) = sb
        .client()
        .ns
        .run(|| {
            let via_service = tcp_request_from_port_here(port, http(CLUSTER_IP), TIMEOUT);
            let Outcome::Reply(reply) = &via_service else {
                return (via_service, None);
            };
            // The client closed first, so its side of that flow is in TIME_WAIT; the
            // same port may still connect elsewhere.
            let backend_ip = BACKENDS
                .iter()
                .find(|b| b.0 == reply.backend)
                .map(|b| b.1)
                .expect("a known backend");
            let direct =
                tcp_request_from_port_here(port, SocketAddrV4::new(backend_ip, TCP_PORT), TIMEOUT);
            (via_service, Some((backend_ip, direct)))
        })
        .expect("client namespace");
    let first = via_service.expect_reply("connection to the ClusterIP from a fixed port");
    assert_eq!(first.peer, SocketAddrV4::new(CLIENT.1, port));
    let (backend_ip, direct) = direct.expect("ran after a reply");
    let direct = direct.expect_reply(&format!(
        "direct connection to {backend_ip}:{TCP_PORT} from port {port} right after a \
         ClusterIP connection from that port reached that backend"
    ));
    assert_eq!(direct.backend, first.backend);
    assert_eq!(*direct.peer.ip(), CLIENT.1);
}

/// A pod whose interface appears after the agent started reaches the ClusterIP: the
/// agent attaches to new interfaces as they come (netlink).
#[test]
fn pod_created_after_the_agent_started_is_served() {
    let mut sb = Sandbox::serving_web(&[CLIENT], &[]).expect("the one-node world");
    let late_ip = Ipv4Addr::new(10, 200, 0, 4);
    let late = sb.add_pod("late", late_ip).expect("add a pod");
    let start = Instant::now();
    let deadline = Duration::from_secs(5);
    let mut outcome = tcp_request(&late.ns, http(CLUSTER_IP), TIMEOUT);
    while !matches!(outcome, Outcome::Reply(_)) && start.elapsed() < deadline {
        thread::sleep(Duration::from_millis(100));
        outcome = tcp_request(&late.ns, http(CLUSTER_IP), TIMEOUT);
    }
    let reply = outcome.expect_reply(&format!(
        "ClusterIP from a pod created after the agent started, for {deadline:?}"
    ));
    assert_eq!(*reply.peer.ip(), late_ip);
    eprintln!(
        "the new pod's first answered connection came after {:?}",
        start.elapsed()
    );
}
