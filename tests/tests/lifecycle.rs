//! Session affinity, connection lifecycle, terminating endpoints and hairpin on real
//! packets: a routed node (docs/architecture.md, "Test topologies") with client and backend pods,
//! ebpf-proxy in the node namespace on a manifest directory the tests rewrite, and,
//! where kube-proxy's behaviour is the reference, kube-proxy's own iptables rules on
//! another VIP of the same node.
//!
//! Every test builds its own namespaces, bpffs root and manifest directory, so they run
//! in parallel; everything is removed on drop, also when a test fails.

use std::{
    collections::BTreeSet,
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddrV4, UdpSocket},
    thread,
    time::{Duration, Instant},
};

use ebpf_proxy_tests::{
    Protocol,
    affinity::{AFFINITY_TIMEOUT_S, STICKY_RUN, affinity_run, connect_n, distinct},
    client::{Reply, TIMEOUT, TcpSession, tcp_request, udp_request},
    iptables,
    manifest::{Endpoint, Service, SessionAffinity},
    require_root,
    sandbox::Sandbox,
};

use ebpf_proxy_tests::topology::one_node::{
    BACKENDS, CLIENT, CLUSTER_IP, IPT_CLIENT, TCP_PORT, UDP_PORT, backend_ips, dns, http,
};
/// The iptables reference's VIP; the agent does not know it, so its program passes
/// that traffic to netfilter untouched.
const IPT_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
/// The source address the datapath gives hairpin flows (`proxy_common::HAIRPIN_ADDR`).
const HAIRPIN_SRC: Ipv4Addr = Ipv4Addr::new(169, 254, 42, 1);
/// How long the agent may take to apply a manifest change: within one second,
/// which clusterip.rs holds it to. Checks that must only see the new state wait this
/// long after a write instead of guessing when the change landed.
const SETTLE: Duration = Duration::from_secs(1);

/// `test/<name>` with `http` 80/TCP -> 8080 and `dns` 53/UDP -> 5353.
fn service(name: &str, cluster_ip: Ipv4Addr, affinity: SessionAffinity) -> Service {
    Service::new("test", name, cluster_ip)
        .port("http", 80, Protocol::Tcp, TCP_PORT)
        .port("dns", 53, Protocol::Udp, UDP_PORT)
        .session_affinity(affinity)
}

fn client_ip(timeout_seconds: Option<u32>) -> SessionAffinity {
    SessionAffinity::ClientIp { timeout_seconds }
}

/// A sandbox with `clients` and `backends`, `yaml` as `web.yaml`, and the agent on it.
fn sandbox_with(
    clients: &[(&str, Ipv4Addr)],
    backends: &[(&str, Ipv4Addr)],
    yaml: &str,
) -> Sandbox {
    require_root().expect("privileged test");
    let mut sb = Sandbox::new(clients, backends, TCP_PORT, UDP_PORT).expect("sandbox");
    sb.manifests()
        .write("web.yaml", yaml)
        .expect("write manifest");
    sb.start_agent_on_manifests().expect("start the agent");
    sb
}

/// Rewrites `web.yaml` and waits until the agent must have applied it.
fn rewrite(sb: &Sandbox, yaml: &str) {
    sb.manifests()
        .write("web.yaml", yaml)
        .expect("rewrite manifest");
    thread::sleep(SETTLE);
}

/// 1. The Kubernetes e2e affinity checks: with sessionAffinity ClientIP, consecutive
///    new connections from one client land on one backend; switching affinity off
///    spreads them at once; switching it back on sticks again; with timeoutSeconds 3,
///    a client that waits past the timeout is balanced anew (and sticks to the new
///    pick).
#[test]
fn client_ip_affinity_sticks_switches_and_expires() {
    // Without timeoutSeconds: the API default (10800 s) applies.
    let sb = sandbox_with(
        &[CLIENT],
        &BACKENDS,
        &service("web", CLUSTER_IP, client_ip(None)).yaml(Some(&backend_ips())),
    );
    let client = &sb.client().ns;

    let on = connect_n(client, CLIENT.1, http(CLUSTER_IP), STICKY_RUN);
    assert_eq!(
        distinct(&on).len(),
        1,
        "with ClientIP affinity, {STICKY_RUN} new connections should land on one backend: {on:?}"
    );

    rewrite(
        &sb,
        &service("web", CLUSTER_IP, SessionAffinity::None).yaml(Some(&backend_ips())),
    );
    // Uniform picks among 3 repeat one backend 15 times with probability 3^-14.
    let off = connect_n(client, CLIENT.1, http(CLUSTER_IP), STICKY_RUN);
    assert!(
        distinct(&off).len() > 1,
        "{SETTLE:?} after switching affinity off, {STICKY_RUN} new connections still all \
         went to one backend: {off:?}"
    );

    rewrite(
        &sb,
        &service("web", CLUSTER_IP, client_ip(Some(AFFINITY_TIMEOUT_S))).yaml(Some(&backend_ips())),
    );
    let run = affinity_run(client, CLIENT.1, http(CLUSTER_IP)).unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "affinity on: {on:?}\naffinity off: {off:?}\nback on, timeout 3 s: {}",
        run.summary()
    );
    assert!(
        run.stuck(),
        "after switching affinity back on, {STICKY_RUN} new connections should land on one \
         backend: {}",
        run.summary()
    );
    assert!(
        run.resticks(),
        "right after a fresh pick, the next connections should follow it: {}",
        run.summary()
    );
    assert!(
        run.rebalanced(),
        "a client that waited past the {AFFINITY_TIMEOUT_S} s timeout {} times was never \
         balanced to another backend: {}",
        run.rounds.len(),
        run.summary()
    );
}

/// 2. The same affinity scenario against kube-proxy's real iptables rules (`-m recent
///    --rcheck --seconds 3 --reap` per endpoint before the statistic cascade, `-m recent
///    --set` before each DNAT) on another VIP, from another client, at the same time:
///    both datapaths stick for 15 connections, re-stick after each fresh pick, and
///    re-balance after the timeout.
#[test]
fn affinity_matches_iptables_recent_rules() {
    let svc = service("web", CLUSTER_IP, client_ip(Some(AFFINITY_TIMEOUT_S)));
    let sb = sandbox_with(
        &[CLIENT, IPT_CLIENT],
        &BACKENDS,
        &svc.yaml(Some(&backend_ips())),
    );
    let kube = svc.kube_service("http", IPT_VIP, &backend_ips());
    assert_eq!(kube.affinity_timeout, Some(AFFINITY_TIMEOUT_S));
    iptables::apply(&sb.topology().node, &[kube]).expect("load kube-proxy rules");

    // Side by side rather than one after the other: the waits dominate, and both
    // halves see the same machine at the same time.
    let (ebpf, ipt) = thread::scope(|s| {
        let ebpf = s.spawn(|| affinity_run(&sb.client().ns, CLIENT.1, http(CLUSTER_IP)));
        let ipt = s.spawn(|| affinity_run(&sb.pod(IPT_CLIENT.0).ns, IPT_CLIENT.1, http(IPT_VIP)));
        (
            ebpf.join().expect("ebpf-proxy half panicked"),
            ipt.join().expect("iptables half panicked"),
        )
    });
    let ipt = ipt.unwrap_or_else(|e| panic!("iptables reference: {e}"));
    let ebpf = ebpf.unwrap_or_else(|e| panic!("ebpf-proxy: {e}"));
    let table = format!(
        "iptables -m recent: {}\nebpf-proxy:         {}",
        ipt.summary(),
        ebpf.summary()
    );
    eprintln!("{table}");
    assert!(
        ipt.stuck() && ipt.resticks() && ipt.rebalanced(),
        "the iptables reference itself did not stick and re-balance (sandbox problem?):\n{table}"
    );
    assert_eq!(
        (ebpf.stuck(), ebpf.resticks(), ebpf.rebalanced()),
        (ipt.stuck(), ipt.resticks(), ipt.rebalanced()),
        "ebpf-proxy's (stuck, sticky again, re-balanced) differs from kube-proxy's iptables \
         rules:\n{table}"
    );
}

/// 3. A long-lived TCP connection survives scaling its service from 3 to 10 backends
///    and back to 3 (its own backend always in the set): no reset, same backend, lines
///    still answered after each step, while new connections follow the new sets.
#[test]
fn established_connection_survives_scaling_3_10_3() {
    let pods: Vec<(String, Ipv4Addr)> = (0..10u8)
        .map(|i| (format!("pod-{i}"), Ipv4Addr::new(10, 200, 0, 20 + i)))
        .collect();
    let pods: Vec<(&str, Ipv4Addr)> = pods.iter().map(|(n, ip)| (n.as_str(), *ip)).collect();
    let all: Vec<Ipv4Addr> = pods.iter().map(|p| p.1).collect();
    // Every third pod: the added backends sort in between ("10.200.0.21:8080" ...),
    // so both steps replace the slot set instead of appending to it, the harder case.
    let three: Vec<Ipv4Addr> = vec![all[1], all[4], all[7]];
    let names_of = |ips: &[Ipv4Addr]| -> BTreeSet<String> {
        pods.iter()
            .filter(|p| ips.contains(&p.1))
            .map(|p| p.0.to_owned())
            .collect()
    };
    let svc = service("web", CLUSTER_IP, SessionAffinity::None);
    let sb = sandbox_with(&[CLIENT], &pods, &svc.yaml(Some(&three)));
    let client = &sb.client().ns;

    let mut session = TcpSession::open(client, http(CLUSTER_IP), TIMEOUT)
        .expect("open the long-lived connection");
    let own = session.greeting.backend.clone();
    assert!(
        names_of(&three).contains(&own),
        "the long-lived connection landed on {own}, outside the service's backends {:?}",
        names_of(&three)
    );
    let mut exchange = |step: &str| {
        let answer = session.exchange(step).unwrap_or_else(|e| {
            panic!("the long-lived connection to {own} broke at step {step:?}: {e:#}")
        });
        assert_eq!(
            answer,
            format!("{own} {step}"),
            "the long-lived connection is answered by someone else at step {step:?}"
        );
    };
    exchange("with-3");

    sb.manifests()
        .write("web.yaml", &svc.yaml(Some(&all)))
        .expect("scale to 10");
    // Until a new connection reaches one of the added backends: the scale-up is live.
    let added = names_of(&all)
        .difference(&names_of(&three))
        .cloned()
        .collect::<BTreeSet<_>>();
    let start = Instant::now();
    let mut seen = Vec::new();
    while !seen.iter().any(|b| added.contains(b)) {
        assert!(
            start.elapsed() < SETTLE * 2,
            "{:?} after scaling to 10, new connections only reach {:?}",
            start.elapsed(),
            distinct(&seen)
        );
        seen.extend(connect_n(client, CLIENT.1, http(CLUSTER_IP), 1));
    }
    exchange("with-10");

    rewrite(&sb, &svc.yaml(Some(&three)));
    let after = connect_n(client, CLIENT.1, http(CLUSTER_IP), 60);
    let outside: Vec<&str> = distinct(&after)
        .into_iter()
        .filter(|b| !names_of(&three).contains(*b))
        .collect();
    assert!(
        outside.is_empty(),
        "{SETTLE:?} after scaling back to 3, new connections still reach removed backends \
         {outside:?}: {after:?}"
    );
    exchange("with-3-again");
}

/// 4. A UDP client that keeps sending from one socket (one source port: one "flow")
///    while its backend is removed gets answers from another backend within a second
///    of the manifest change, and keeps that backend: the flow's conntrack entry went
///    with the old backend instead of pinning the client to it (kube-proxy's stale UDP
///    conntrack problem).
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom; its steps share the namespaces and agent it sets up"
)]
fn udp_flow_moves_within_a_second_when_its_backend_is_removed() {
    let svc = service("web", CLUSTER_IP, SessionAffinity::None);
    let sb = sandbox_with(&[CLIENT], &BACKENDS, &svc.yaml(Some(&backend_ips())));
    // A connected socket accepts only datagrams from the ClusterIP itself, so every
    // answer counted here was reverse-NATed correctly.
    let socket = sb
        .client()
        .ns
        .run(|| -> std::io::Result<UdpSocket> {
            let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
            s.connect(dns(CLUSTER_IP))?;
            // Long enough that a slow answer is not mistaken for the next one's, short
            // enough to resend soon after a datagram that went nowhere.
            s.set_read_timeout(Some(Duration::from_millis(250)))?;
            Ok(s)
        })
        .expect("client namespace")
        .expect("UDP socket");
    let local_port = socket.local_addr().expect("local address").port();
    // One datagram, and its answer if one comes within the read timeout.
    let ping = |n: usize| -> Option<Reply> {
        socket
            .send(format!("ping {n}\n").as_bytes())
            .expect("send datagram");
        let mut buf = [0u8; 2048];
        match socket.recv(&mut buf) {
            Ok(len) => Some(
                Reply::parse(&String::from_utf8_lossy(&buf[..len])).expect("well-formed answer"),
            ),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => None,
            // ICMP port unreachable (a refusal): no answer this time.
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => None,
            Err(e) => panic!("UDP recv: {e}"),
        }
    };

    let mut sent = 0;
    let mut before = Vec::new();
    while before.len() < 5 {
        assert!(
            sent < 50,
            "the UDP flow got only {before:?} in {sent} datagrams"
        );
        if let Some(r) = ping(sent) {
            before.push(r);
        }
        sent += 1;
    }
    let own = before[0].backend.clone();
    assert!(
        before.iter().all(|r| r.backend == own),
        "datagrams of one flow should all reach one backend: {before:?}"
    );
    assert_eq!(
        before[0].peer,
        SocketAddrV4::new(CLIENT.1, local_port),
        "the backend should see the client's own address and port"
    );

    let remaining: Vec<Ipv4Addr> = BACKENDS
        .iter()
        .filter(|b| b.0 != own)
        .map(|b| b.1)
        .collect();
    sb.manifests()
        .write("web.yaml", &svc.yaml(Some(&remaining)))
        .expect("remove the flow's backend");
    let written = Instant::now();
    // (sent, answered, backend) of every datagram since the change.
    let mut log: Vec<(Duration, Duration, Option<String>)> = Vec::new();
    let (at, reply) = loop {
        let sent_at = written.elapsed();
        let reply = ping(sent);
        let at = written.elapsed();
        sent += 1;
        log.push((sent_at, at, reply.as_ref().map(|r| r.backend.clone())));
        if let Some(r) = reply.filter(|r| r.backend != own) {
            break (at, r);
        }
        assert!(
            at < SETTLE * 3,
            "{at:?} after {own} was removed, the flow still gets no answer from another \
             backend; (sent, answered, backend) since the change: {log:?}"
        );
        thread::sleep(Duration::from_millis(20));
    };
    eprintln!(
        "first answer from {} {at:?} after the change ({} datagrams since)",
        reply.backend,
        log.len()
    );
    assert!(
        at < SETTLE,
        "the first answer from another backend came {at:?} after {own} was removed; \
         (sent, answered, backend) since the change: {log:?}"
    );
    assert_eq!(
        reply.peer,
        SocketAddrV4::new(CLIENT.1, local_port),
        "the new backend should see the same client address and port (the same flow)"
    );
    let new = reply.backend;
    // A datagram may go unanswered on a loaded machine; every answer must come from
    // the new backend.
    let after: Vec<String> = (0..10)
        .filter_map(|_| {
            sent += 1;
            ping(sent).map(|r| r.backend)
        })
        .collect();
    assert!(
        !after.is_empty() && after.iter().all(|b| *b == new),
        "once moved to {new}, the flow should stay there; answers to 10 more datagrams: \
         {after:?}"
    );
}

/// 5. Hairpin: a pod that is the only endpoint of its service reaches itself through
///    the ClusterIP (TCP, a longer TCP exchange, and UDP); it sees itself as the hairpin
///    address, while every other pod going through the same service keeps its own
///    source address.
#[test]
fn backend_reaches_itself_through_its_service_and_others_keep_their_address() {
    let (own, own_ip) = BACKENDS[0];
    let (other, other_ip) = BACKENDS[1];
    let svc = service("self", CLUSTER_IP, SessionAffinity::None);
    let sb = sandbox_with(&[CLIENT], &BACKENDS[..2], &svc.yaml(Some(&[own_ip])));
    let pod = &sb.pod(own).ns;

    for i in 0..3 {
        let reply = tcp_request(pod, http(CLUSTER_IP), TIMEOUT).expect_reply(&format!(
            "hairpin TCP connection {i} from {own} to its own service"
        ));
        assert_eq!(reply.backend, own);
        assert_eq!(
            *reply.peer.ip(),
            HAIRPIN_SRC,
            "a hairpin connection must reach the pod from the hairpin address, not from \
             itself (which the kernel would drop as martian)"
        );
    }
    let mut session = TcpSession::open(pod, http(CLUSTER_IP), TIMEOUT)
        .expect("long hairpin connection from the pod to its own service");
    for line in ["one", "two", "three"] {
        assert_eq!(
            session
                .exchange(line)
                .expect("exchange on a hairpin connection"),
            format!("{own} {line}")
        );
    }
    let udp = udp_request(pod, dns(CLUSTER_IP), TIMEOUT)
        .expect_reply(&format!("hairpin UDP from {own} to its own service"));
    assert_eq!((udp.backend.as_str(), *udp.peer.ip()), (own, HAIRPIN_SRC));

    for (name, ns, ip) in [
        (CLIENT.0, &sb.client().ns, CLIENT.1),
        (other, &sb.pod(other).ns, other_ip),
    ] {
        let tcp = tcp_request(ns, http(CLUSTER_IP), TIMEOUT)
            .expect_reply(&format!("TCP from {name} to the service of {own}"));
        assert_eq!(
            (tcp.backend.as_str(), *tcp.peer.ip()),
            (own, ip),
            "a flow from {name} that is not hairpin must keep its source address"
        );
        let udp = udp_request(ns, dns(CLUSTER_IP), TIMEOUT)
            .expect_reply(&format!("UDP from {name} to the service of {own}"));
        assert_eq!(
            (udp.backend.as_str(), *udp.peer.ip()),
            (own, ip),
            "a UDP flow from {name} that is not hairpin must keep its source address"
        );
    }
}

/// 6. Terminating endpoints (serving, not ready): no new connections while ready ones
///    exist, an established connection to one keeps working (graceful drain), and when
///    nothing is ready the serving-terminating endpoints take new connections
///    (kube-proxy's fallback) while a terminating endpoint that is not serving never
///    does.
#[test]
fn terminating_endpoints_drain_and_are_the_fallback() {
    let [(a, a_ip), (b, b_ip), (c, c_ip)] = BACKENDS;
    let svc = service("web", CLUSTER_IP, SessionAffinity::None);
    let sb = sandbox_with(&[CLIENT], &BACKENDS, &svc.yaml(Some(&backend_ips())));
    let client = &sb.client().ns;

    // An established connection to c while it is ready.
    let mut session = (0..200)
        .map(|_| TcpSession::open(client, http(CLUSTER_IP), TIMEOUT).expect("connect"))
        .find(|s| s.greeting.backend == c)
        .unwrap_or_else(|| panic!("200 connections never reached {c}"));
    let mut exchange = |step: &str| {
        let answer = session.exchange(step).unwrap_or_else(|e| {
            panic!("the connection to terminating {c} broke at {step:?}: {e:#}")
        });
        assert_eq!(answer, format!("{c} {step}"), "at {step:?}");
    };
    exchange("ready");

    rewrite(
        &sb,
        &svc.yaml_with(&[
            Endpoint::ready(a_ip),
            Endpoint::ready(b_ip),
            Endpoint::terminating_serving(c_ip),
        ]),
    );
    let draining = connect_n(client, CLIENT.1, http(CLUSTER_IP), 60);
    assert_eq!(
        distinct(&draining),
        BTreeSet::from([a, b]),
        "while {a} and {b} are ready, new connections should go to both of them and never \
         to serving-but-terminating {c}: {draining:?}"
    );
    exchange("terminating");

    rewrite(
        &sb,
        &svc.yaml_with(&[
            Endpoint::terminating_not_serving(a_ip),
            Endpoint::terminating_serving(b_ip),
            Endpoint::terminating_serving(c_ip),
        ]),
    );
    let fallback = connect_n(client, CLIENT.1, http(CLUSTER_IP), 60);
    assert_eq!(
        distinct(&fallback),
        BTreeSet::from([b, c]),
        "with nothing ready, new connections should fall back to the serving-terminating \
         {b} and {c}, never to non-serving {a}: {fallback:?}"
    );
    exchange("fallback");
}

/// Affinity on a fallback set: with nothing ready, kube-proxy writes its affinity rules
/// for the serving-terminating endpoints it falls back to (k/k `proxier_test.go`, "only
/// terminating endpoints exist": `-m recent --rcheck` for each of them), so a client
/// stays on one of them; checked next to those rules. So does a pod whose endpoint is
/// ready but also terminating (publishNotReadyAddresses).
#[test]
fn affinity_holds_on_terminating_fallback_endpoints() {
    let [(_, a_ip), (_, b_ip), (_, c_ip)] = BACKENDS;
    let svc = service("web", CLUSTER_IP, client_ip(None));
    let sb = sandbox_with(
        &[CLIENT, IPT_CLIENT],
        &BACKENDS,
        &svc.yaml_with(&[
            Endpoint::terminating_serving(a_ip),
            Endpoint::terminating_serving(b_ip),
            Endpoint::terminating_serving(c_ip),
        ]),
    );
    // kube-proxy's rules for this slice: CategorizeEndpoints falls back to all three.
    iptables::apply(
        &sb.topology().node,
        &[svc.kube_service("http", IPT_VIP, &backend_ips())],
    )
    .expect("load kube-proxy rules");
    let ipt = connect_n(
        &sb.pod(IPT_CLIENT.0).ns,
        IPT_CLIENT.1,
        http(IPT_VIP),
        STICKY_RUN,
    );
    let client = &sb.client().ns;
    let fallback = connect_n(client, CLIENT.1, http(CLUSTER_IP), STICKY_RUN);
    eprintln!("only serving-terminating endpoints: iptables {ipt:?}, ebpf-proxy {fallback:?}");
    assert_eq!(
        distinct(&ipt).len(),
        1,
        "kube-proxy's rules for the fallback set do not stick (sandbox problem?): {ipt:?}"
    );
    assert_eq!(
        distinct(&fallback).len(),
        1,
        "with ClientIP affinity and only serving-terminating endpoints, {STICKY_RUN} new \
         connections should stay on one of them, as with kube-proxy's rules ({ipt:?}): \
         {fallback:?}"
    );

    // publishNotReadyAddresses: ready stays true while the pod terminates.
    let published = |ip| Endpoint {
        ip,
        ready: true,
        serving: true,
        terminating: true,
    };
    rewrite(
        &sb,
        &svc.yaml_with(&[published(a_ip), published(b_ip), published(c_ip)]),
    );
    let ready_terminating = connect_n(client, CLIENT.1, http(CLUSTER_IP), STICKY_RUN);
    assert_eq!(
        distinct(&ready_terminating).len(),
        1,
        "with ClientIP affinity and ready-but-terminating endpoints, {STICKY_RUN} new \
         connections should stay on one of them: {ready_terminating:?}"
    );
}

/// A client stuck to a backend that stops being ready, or is removed, is balanced anew
/// on its next connection (and sticks to the new pick), never sent to the old one.
#[test]
fn stuck_client_moves_when_its_backend_stops_being_ready_or_is_removed() {
    let svc = service("web", CLUSTER_IP, client_ip(None));
    let sb = sandbox_with(&[CLIENT], &BACKENDS, &svc.yaml(Some(&backend_ips())));
    let client = &sb.client().ns;

    let first = connect_n(client, CLIENT.1, http(CLUSTER_IP), STICKY_RUN);
    assert_eq!(
        distinct(&first).len(),
        1,
        "not sticky to begin with: {first:?}"
    );
    let stuck = first[0].clone();

    let endpoints: Vec<Endpoint> = BACKENDS
        .iter()
        .map(|(name, ip)| {
            if *name == stuck {
                Endpoint::terminating_serving(*ip)
            } else {
                Endpoint::ready(*ip)
            }
        })
        .collect();
    rewrite(&sb, &svc.yaml_with(&endpoints));
    let moved = connect_n(client, CLIENT.1, http(CLUSTER_IP), STICKY_RUN);
    assert!(
        distinct(&moved).len() == 1 && moved[0] != stuck,
        "after {stuck} turned terminating, the client stuck to it should move to one other \
         backend and stay there: {moved:?}"
    );
    let second = moved[0].clone();

    // `second` goes; `stuck` is still terminating, so the third is all that is ready.
    let endpoints: Vec<Endpoint> = BACKENDS
        .iter()
        .filter(|(name, _)| *name != second)
        .map(|(name, ip)| {
            if *name == stuck {
                Endpoint::terminating_serving(*ip)
            } else {
                Endpoint::ready(*ip)
            }
        })
        .collect();
    rewrite(&sb, &svc.yaml_with(&endpoints));
    let last = connect_n(client, CLIENT.1, http(CLUSTER_IP), STICKY_RUN);
    assert!(
        distinct(&last).len() == 1 && last[0] != stuck && last[0] != second,
        "after {second} was removed (and {stuck} is terminating), the client stuck to it \
         should move to the last ready backend and stay there: {last:?}"
    );
}
