//! SCTP associations on real packets through the real kernel, both families: this
//! kernel has no SCTP sockets, so each end is a raw socket of protocol 132
//! (`ebpf_proxy_tests::sctp`) that speaks the association packet by packet and
//! checks every packet it gets: checksum, verification tag, chunk, addresses and
//! ports. Through a ClusterIP in the one-node topology (the client pod's address
//! kept, the port changed), through a NodePort of the two-node cluster from an
//! outside client to a backend on the other node (SNATed), at XDP and at tc; and
//! pod to pod with no Service and no agent, which shows the raw-socket peers work
//! and that the kernel, its raw socket having taken a packet, sends no ICMP error.
//!
//! Every test builds its own namespaces, bpffs roots and manifest directory, so
//! they run in parallel; everything is removed on drop, also when a test fails.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use ebpf_proxy_tests::{
    POLL, Protocol,
    agent::Agent,
    cluster::{CLIENT1, Cluster},
    family::Family,
    manifest::{ManifestDir, ServiceType},
    netns::NetNs,
    require_root,
    sctp::{self, Ending, Plan, RawPeer},
    snmp,
    topology::{Topology, one_node, two_node},
    wait_for,
};

const SERVICE_PORT: u16 = 9000;
/// The backends' SCTP port: the Service changes the port.
const TARGET_PORT: u16 = 9999;
const NODE_PORT: u16 = 30_090;
/// How long the agent may take to program a Service.
const SYNC_WAIT: Duration = Duration::from_secs(15);
/// Bytes of the client's DATA: a checksum update over more than 256 bytes.
const LONG: usize = 1200;

/// The ICMP errors a namespace sends for a protocol it has no handler for
/// (protocol unreachable; over IPv6 a parameter problem, unknown next header).
const ICMP_ERRORS: [&str; 2] = ["IcmpOutDestUnreachs", "Icmp6OutParmProblems"];

/// The sum of `names` in `ns`'s SNMP counters.
fn icmp_errors(ns: &NetNs) -> u64 {
    let all = snmp::read(ns).unwrap_or_else(|e| panic!("SNMP counters of {}: {e:#}", ns.name()));
    ICMP_ERRORS.iter().filter_map(|n| all.get(*n)).sum()
}

/// Sends INITs from `client` to `to` (each from a port of its own) until one
/// reaches `server`: the agent has programmed the frontend. The probes' flows are
/// left to time out.
fn wait_for_frontend(client: &RawPeer, server: &RawPeer, to: SocketAddr, what: &str) {
    let mut port = client.port + 1;
    let got = wait_for(SYNC_WAIT, POLL, || {
        port += 1;
        let init = sctp::packet(
            port,
            to.port(),
            0,
            &[sctp::init(
                sctp::chunk::INIT,
                0x7e57_0000 | u32::from(port),
                1,
                None,
            )],
        );
        client.send(to.ip(), &init).map_err(|e| format!("{e:#}"))?;
        match server.recv(Duration::from_millis(300)) {
            Ok(Some(_)) => Ok(()),
            Ok(None) => Err(format!("no INIT to {to} reached the backend yet")),
            Err(e) => Err(format!("{e:#}")),
        }
    });
    if let Err(e) = got {
        panic!("{what}: the frontend {to} never reached the backend: {e}");
    }
}

/// One association between `client` and `server` per `plan`, ended by
/// `ending`, with no ICMP error sent by either namespace; panics with what
/// differed.
fn associate_checked(
    (client, client_ns): (&RawPeer, &NetNs),
    (server, server_ns): (&RawPeer, &NetNs),
    plan: &Plan,
    ending: Ending,
    what: &str,
    counters: impl Fn() -> String,
) {
    let before = (icmp_errors(client_ns), icmp_errors(server_ns));
    if let Err(e) = sctp::associate(client, server, plan, LONG, ending) {
        panic!("{what}: {e:#}; {}", counters());
    }
    assert_eq!(
        (icmp_errors(client_ns), icmp_errors(server_ns)),
        before,
        "{what}: ICMP errors ({ICMP_ERRORS:?}) sent by (client, server) during the association"
    );
}

/// Pod to pod, no Service, no agent: the raw-socket peers speak a whole
/// association (both endings) and see each other's own addresses, and neither
/// kernel answers with an ICMP error while a raw socket takes the packets. Once
/// the server's socket is closed, an INIT to it is answered with one: what the
/// raw socket keeps from happening.
fn pod_to_pod<F: Family>() {
    require_root().expect("privileged test");
    let backend = one_node::BACKENDS[0];
    let topology = Topology::routed(&[one_node::CLIENT, backend]).expect("the one-node topology");
    let client_ns = &topology.pod(one_node::CLIENT.0).ns;
    let server_ns = &topology.pod(backend.0).ns;
    let client_ip: IpAddr = F::pod(one_node::CLIENT.1).into();
    let server_ip: IpAddr = F::pod(backend.1).into();
    let v6 = client_ip.is_ipv6();
    let server = RawPeer::open(server_ns, v6, TARGET_PORT, "server").expect("server socket");
    for (i, ending) in [Ending::Shutdown, Ending::Abort].into_iter().enumerate() {
        let client_port = 40_000 + i as u16;
        let client = RawPeer::open(client_ns, v6, client_port, "client").expect("client socket");
        let plan = Plan {
            service: SocketAddr::new(server_ip, TARGET_PORT),
            client_port,
            client_seen: client_ip,
            client_port_kept: true,
            server: SocketAddr::new(server_ip, TARGET_PORT),
            client_tag: 0x0c11_e000 + i as u32,
            server_tag: 0x5e17_e000 + i as u32,
        };
        associate_checked(
            (&client, client_ns),
            (&server, server_ns),
            &plan,
            ending,
            &format!("{} pod to pod, {ending:?}", F::NAME),
            String::new,
        );
    }
    drop(server);
    let before = icmp_errors(server_ns);
    let client = RawPeer::open(client_ns, v6, 40_100, "client").expect("client socket");
    let init = sctp::packet(
        40_100,
        TARGET_PORT,
        0,
        &[sctp::init(sctp::chunk::INIT, 1, 1, None)],
    );
    // Sent again every half second until answered, as a peer retransmits
    // its INIT: one frame lost on a busy machine is not the question (the
    // kernel's rate limit on ICMP errors to one address allows a burst of
    // six, then one a second).
    let mut sent: Option<std::time::Instant> = None;
    let answered = wait_for(Duration::from_secs(5), POLL, || {
        if sent.is_none_or(|at| at.elapsed() >= Duration::from_millis(500)) {
            client
                .send(server_ip, &init)
                .expect("INIT to a pod without a raw socket");
            sent = Some(std::time::Instant::now());
        }
        let now = icmp_errors(server_ns);
        if now > before {
            Ok(now)
        } else {
            Err("no ICMP error yet")
        }
    });
    assert!(
        answered.is_ok(),
        "{}: with no raw socket of protocol 132 open, the kernel was expected to answer an SCTP \
         packet with an ICMP error ({ICMP_ERRORS:?}); it did not to INITs sent every half \
         second for 5 s",
        F::NAME
    );
}

#[test]
fn raw_sctp_peers_associate_pod_to_pod() {
    pod_to_pod::<Ipv4Addr>();
}

#[test]
fn raw_sctp_peers_associate_pod_to_pod6() {
    pod_to_pod::<Ipv6Addr>();
}

/// Associations from the client pod to an SCTP ClusterIP (port 9000 to the
/// backend's 9999) with the agent running: every packet translated with its
/// checksum right, the backend seeing the client's own address and port, the
/// client seeing every answer from the ClusterIP:9000; a client packet under
/// another tag than the association's is dropped (the backend never gets it)
/// and counted `drop_sctp_vtag`; both endings, and a new association on the same
/// ports after the first ended.
#[expect(
    clippy::too_many_lines,
    reason = "three associations' steps in their order, each with its checks"
)]
fn cluster_ip<F: Family>() {
    require_root().expect("privileged test");
    let backend = one_node::BACKENDS[0];
    let topology = Topology::routed(&[one_node::CLIENT, backend]).expect("the one-node topology");
    let manifests = ManifestDir::create(topology.stem()).expect("manifest dir");
    let service = F::service("test", "sctp", F::cluster_ip()).port(
        "sctp",
        SERVICE_PORT,
        Protocol::Sctp,
        TARGET_PORT,
    );
    manifests
        .write("sctp.yaml", &F::yaml(&service, &[F::pod(backend.1)]))
        .expect("write manifest");
    let agent = Agent::start_with(&topology.node, manifests.path(), &[]).expect("start the agent");
    let counters = || agent.nonzero_counters();

    let client_ns = &topology.pod(one_node::CLIENT.0).ns;
    let server_ns = &topology.pod(backend.0).ns;
    let client_ip: IpAddr = F::pod(one_node::CLIENT.1).into();
    let server_ip: IpAddr = F::pod(backend.1).into();
    let vip = SocketAddr::new(F::cluster_ip().into(), SERVICE_PORT);
    let v6 = client_ip.is_ipv6();
    let server = RawPeer::open(server_ns, v6, TARGET_PORT, "server").expect("server socket");
    let client_port = 41_000;
    let client = RawPeer::open(client_ns, v6, client_port, "client").expect("client socket");
    wait_for_frontend(&client, &server, vip, &format!("{} ClusterIP", F::NAME));

    let plan = |i: u32| Plan {
        service: vip,
        client_port,
        client_seen: client_ip,
        client_port_kept: true,
        server: SocketAddr::new(server_ip, TARGET_PORT),
        client_tag: 0x0c11_e000 + i,
        server_tag: 0x5e17_e000 + i,
    };
    let what = |ending: Ending| format!("{} ClusterIP {vip}, {ending:?}", F::NAME);
    // Two associations on the same addresses and ports, one after the other.
    for (i, ending) in [Ending::Shutdown, Ending::Abort].into_iter().enumerate() {
        associate_checked(
            (&client, client_ns),
            (&server, server_ns),
            &plan(i as u32),
            ending,
            &what(ending),
            counters,
        );
    }

    // A third, from another port, with a packet under a forged tag.
    let client2 = RawPeer::open(client_ns, v6, 41_500, "client").expect("client socket");
    let (ct, st) = (0x0c11_e100, 0x5e17_e100);
    let drops = agent.counter("drop_sctp_vtag").expect("drop_sctp_vtag");
    let to_vip = |vtag: u32, chunk: Vec<u8>| {
        client2
            .send(
                vip.ip(),
                &sctp::packet(41_500, SERVICE_PORT, vtag, &[chunk]),
            )
            .expect("client send");
    };
    to_vip(0, sctp::init(sctp::chunk::INIT, ct, 1, None));
    let init = server
        .recv(sctp::STEP_WAIT)
        .expect("server receive")
        .unwrap_or_else(|| panic!("{}: the third INIT never came; {}", F::NAME, counters()));
    server
        .send(
            init.from,
            &sctp::packet(
                TARGET_PORT,
                init.packet.sport,
                ct,
                &[sctp::init(sctp::chunk::INIT_ACK, st, 1, Some(b"c"))],
            ),
        )
        .expect("server send");
    let ack = client2.recv(sctp::STEP_WAIT).expect("client receive");
    assert!(
        ack.as_ref().is_some_and(|r| r.packet.vtag == ct),
        "{}: the third association's INIT ACK: {ack:?}; {}",
        F::NAME,
        counters()
    );
    to_vip(st ^ 0xffff, sctp::data(1, b"forged"));
    let leaked = server
        .recv(Duration::from_millis(700))
        .expect("server receive");
    assert!(
        leaked.is_none(),
        "{}: a DATA under tag {:#x}, not the association's {st:#x}, reached the backend: \
         {leaked:?}",
        F::NAME,
        st ^ 0xffff
    );
    assert_eq!(
        agent.counter("drop_sctp_vtag").expect("drop_sctp_vtag"),
        drops + 1,
        "{}: the forged DATA not counted drop_sctp_vtag; {}",
        F::NAME,
        counters()
    );
    to_vip(st, sctp::data(1, b"genuine"));
    let genuine = server.recv(sctp::STEP_WAIT).expect("server receive");
    assert!(
        genuine.is_some_and(|r| r.packet.vtag == st && r.packet.kind() == sctp::chunk::DATA),
        "{}: the DATA under the association's tag never reached the backend; {}",
        F::NAME,
        counters()
    );
    assert_eq!(
        agent
            .counter("unsupported_proto")
            .expect("unsupported_proto"),
        0,
        "{}: SCTP counted unsupported",
        F::NAME
    );
}

#[test]
fn sctp_associations_through_a_cluster_ip() {
    cluster_ip::<Ipv4Addr>();
}

#[test]
fn sctp_associations_through_a_cluster_ip6() {
    cluster_ip::<Ipv6Addr>();
}

/// An association from an outside client to an SCTP NodePort on node a whose
/// backend is on node b (externalTrafficPolicy Cluster): SNATed to node a, as
/// TCP's is, so the backend sees node a's address; the client sees every answer
/// from node a's NodePort. `xdp` is the agents' `--xdp-mode`.
fn node_port<F: Family>(xdp: &str) {
    require_root().expect("privileged test");
    let backend = ("sctp-b1", two_node::NODE_B_POD);
    let cluster = Cluster::new(&[("a", &[]), ("b", &[backend])]).expect("two-node cluster");
    let manifests = ManifestDir::create(cluster.stem()).expect("manifest dir");
    let service = F::service("test", "sctp-np", F::vip(70))
        .type_(ServiceType::NodePort)
        .port("sctp", SERVICE_PORT, Protocol::Sctp, TARGET_PORT)
        .node_port("sctp", NODE_PORT);
    let node_b = cluster.node("b").ns.name().to_owned();
    manifests
        .write(
            "sctp.yaml",
            &F::yaml_on_nodes(&service, &[(F::pod(backend.1), node_b.as_str())]),
        )
        .expect("write manifest");
    let agents: Vec<Agent> = ["a", "b"]
        .iter()
        .map(|node| {
            let n = cluster.node(node);
            let node_ip = F::node_ip_arg(n);
            let mut args = vec!["--xdp-mode", xdp];
            if let Some(ip) = &node_ip {
                args.extend(["--node-ip", ip.as_str()]);
            }
            Agent::start_with(&n.ns, manifests.path(), &args)
                .unwrap_or_else(|e| panic!("agent on node {node}: {e:#}"))
        })
        .collect();
    let counters = || {
        format!(
            "node a: {}; node b: {}",
            agents[0].nonzero_counters(),
            agents[1].nonzero_counters()
        )
    };

    let client_ns = &cluster.client(CLIENT1.0).ns;
    let server_ns = &cluster.pod(backend.0).ns;
    let node_a: IpAddr = F::uplink(cluster.node("a").ip).into();
    let server_ip: IpAddr = F::pod(backend.1).into();
    let via_a = SocketAddr::new(node_a, NODE_PORT);
    let v6 = node_a.is_ipv6();
    let server = RawPeer::open(server_ns, v6, TARGET_PORT, "server").expect("server socket");
    let client = RawPeer::open(client_ns, v6, 42_000, "client").expect("client socket");
    let what = format!("{} NodePort {via_a}, --xdp-mode {xdp}", F::NAME);
    wait_for_frontend(&client, &server, via_a, &what);
    for (i, ending) in [Ending::Shutdown, Ending::Abort].into_iter().enumerate() {
        let plan = Plan {
            service: via_a,
            client_port: 42_000,
            client_seen: node_a,
            client_port_kept: false,
            server: SocketAddr::new(server_ip, TARGET_PORT),
            client_tag: 0x0c11_e200 + i as u32,
            server_tag: 0x5e17_e200 + i as u32,
        };
        associate_checked(
            (&client, client_ns),
            (&server, server_ns),
            &plan,
            ending,
            &format!("{what}, {ending:?}"),
            counters,
        );
    }
    let snat = agents[0].counter("snat_new").expect("snat_new");
    assert!(snat > 0, "{what}: node a counted no SNAT; {}", counters());
    let xdp_tx = agents[0].counter("xdp_tx").expect("xdp_tx");
    if xdp == "off" {
        assert_eq!(
            xdp_tx,
            0,
            "{what}: XDP is off, yet sent frames; {}",
            counters()
        );
    } else {
        assert!(
            xdp_tx > 0,
            "{what}: SCTP was translated, but not at XDP; {}",
            counters()
        );
    }
}

#[test]
fn sctp_association_through_a_node_port_native_xdp() {
    node_port::<Ipv4Addr>("native");
}

#[test]
fn sctp_association_through_a_node_port_tc_only() {
    node_port::<Ipv4Addr>("off");
}

#[test]
fn sctp_association_through_a_node_port6_native_xdp() {
    node_port::<Ipv6Addr>("native");
}

#[test]
fn sctp_association_through_a_node_port6_tc_only() {
    node_port::<Ipv6Addr>("off");
}
