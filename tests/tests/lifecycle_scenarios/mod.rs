//! The scenarios of lifecycle.rs and lifecycle6.rs, once over the family
//! ([`Family`]): session affinity, connection lifecycle and terminating endpoints of
//! a Service of one family on real packets, in the routed node of docs/architecture.md
//! ("Test topologies"), whose pods are dual-stack, with ebpf-proxy in the node
//! namespace on a manifest directory the scenarios rewrite and, where kube-proxy's
//! behaviour is the reference, kube-proxy's own rules of that family on another VIP
//! of the same node.
//!
//! Every scenario builds its own namespaces, bpffs root and manifest directory, so
//! they run in parallel; everything is removed on drop, also when one fails.

use std::{
    collections::BTreeSet,
    io::ErrorKind,
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    thread,
    time::{Duration, Instant},
};

use ebpf_proxy_tests::{
    Protocol,
    affinity::{AFFINITY_TIMEOUT_S, STICKY_RUN, affinity_run, connect_n, distinct},
    agent::{Agent, SYNC_DEADLINE, map_fill},
    client::{Reply, TIMEOUT, TcpSession},
    eventually,
    family::Family,
    iptables,
    manifest::{Endpoint, Service, SessionAffinity},
    require_root,
    sandbox::Sandbox,
    topology::one_node::{BACKENDS, CLIENT, IPT_CLIENT, TCP_PORT, UDP_PORT},
    wait_for,
};

/// `test/web` of family `F` on its ClusterIP: `http` 80/TCP -> 8080 and `dns` 53/UDP
/// -> 5353.
pub fn service<F: Family>(affinity: SessionAffinity) -> Service {
    F::service("test", "web", F::cluster_ip())
        .port("http", 80, Protocol::Tcp, TCP_PORT)
        .port("dns", 53, Protocol::Udp, UDP_PORT)
        .session_affinity(affinity)
}

pub fn client_ip(timeout_seconds: Option<u32>) -> SessionAffinity {
    SessionAffinity::ClientIp { timeout_seconds }
}

/// A sandbox with `clients` and `backends`, `yaml` as `web.yaml`, and the agent on it.
pub fn sandbox_with(
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

/// Rewrites `web.yaml` and waits until the agent has applied it (it read the
/// change and synced since), so that checks that must only see the new state
/// see it. How fast that is, clusterip.rs holds to [`SYNC_DEADLINE`]; this
/// waits up to ten times that.
pub fn rewrite(sb: &Sandbox, yaml: &str) {
    let mark = sb.agent().log_mark();
    sb.manifests()
        .write("web.yaml", yaml)
        .expect("rewrite manifest");
    sb.agent().wait_synced_since(mark, SYNC_DEADLINE * 10);
}

/// The client pod's address of family `F`.
fn client<F: Family>() -> F {
    F::pod(CLIENT.1)
}

/// The backends' addresses of family `F` with the conditions `state` gives each by
/// name; None leaves a backend out.
fn endpoints<F: Family>(state: impl Fn(&str, F) -> Option<Endpoint<F>>) -> Vec<Endpoint<F>> {
    BACKENDS
        .iter()
        .filter_map(|(name, ip)| state(name, F::pod(*ip)))
        .collect()
}

/// The Kubernetes e2e affinity checks: with sessionAffinity ClientIP, consecutive
/// new connections from one client land on one backend; switching affinity off
/// spreads them at once; switching it back on sticks again; with timeoutSeconds 3,
/// a client that waits past the timeout is balanced anew (and sticks to the new
/// pick).
pub fn client_ip_affinity_sticks_switches_and_expires<F: Family>() {
    let family = F::NAME;
    let vip = F::http(F::cluster_ip());
    // Without timeoutSeconds: the API default (10800 s) applies.
    let sb = sandbox_with(
        &[CLIENT],
        &BACKENDS,
        &F::yaml(&service::<F>(client_ip(None)), &F::backend_ips()),
    );
    let ns = &sb.client().ns;

    let on = connect_n(ns, client::<F>(), vip, STICKY_RUN);
    assert_eq!(
        distinct(&on).len(),
        1,
        "with ClientIP affinity, {STICKY_RUN} new {family} connections should land on one \
         backend: {on:?}"
    );

    rewrite(
        &sb,
        &F::yaml(&service::<F>(SessionAffinity::None), &F::backend_ips()),
    );
    // The client's entry goes with the affinity, as kube-proxy's `recent` list goes
    // with its rules: switched back on, the client is balanced afresh.
    eventually(
        "the Service's affinity entries purged once its affinity went off",
        SYNC_DEADLINE * 10,
        || affinity_emptied(sb.agent()),
    );
    // Uniform picks among 3 repeat one backend 15 times with probability 3^-14.
    let off = connect_n(ns, client::<F>(), vip, STICKY_RUN);
    assert!(
        distinct(&off).len() > 1,
        "synced after switching affinity off, yet {STICKY_RUN} new {family} \
         connections still all went to one backend: {off:?}"
    );

    rewrite(
        &sb,
        &F::yaml(
            &service::<F>(client_ip(Some(AFFINITY_TIMEOUT_S))),
            &F::backend_ips(),
        ),
    );
    let run = affinity_run(ns, client::<F>(), vip).unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "affinity on: {on:?}\naffinity off: {off:?}\nback on, timeout 3 s: {}",
        run.summary()
    );
    assert!(
        run.stuck(),
        "after switching affinity back on, {STICKY_RUN} new {family} connections should \
         land on one backend: {}",
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

/// The fill of `AFFINITY` in `agent`'s status: `map fill AFFINITY: N of ...`.
fn affinity_fill(agent: &Agent) -> Result<u64, String> {
    let status = agent.status().map_err(|e| format!("{e:#}"))?;
    map_fill(&status, "AFFINITY")
        .ok_or_else(|| format!("no AFFINITY fill in the status:\n{status}"))
}

/// Ok once `agent`'s status shows `AFFINITY` empty; else how many entries
/// it still holds.
fn affinity_emptied(agent: &Agent) -> Result<(), String> {
    match affinity_fill(agent)? {
        0 => Ok(()),
        n => Err(format!("{n} entries still")),
    }
}

/// Affinity turned off while no agent ran (between one's stop and the next's start):
/// the entries the first left in the pinned `AFFINITY` map go at the next agent's
/// first sync, since no frontend with affinity takes them up; turned on again, the
/// Service's clients are balanced afresh rather than sent back where they were.
pub fn affinity_entries_outliving_their_services_affinity_go_at_the_next_start<F: Family>() {
    let vip = F::http(F::cluster_ip());
    let mut sb = sandbox_with(
        &[CLIENT],
        &BACKENDS,
        &F::yaml(&service::<F>(client_ip(None)), &F::backend_ips()),
    );
    connect_n(&sb.client().ns, client::<F>(), vip, 3);
    assert_eq!(
        affinity_fill(sb.agent()),
        Ok(1),
        "the client's affinity entry"
    );
    let status = sb.agent_mut().terminate().expect("stop the agent");
    assert!(status.success(), "the agent exited with {status}");
    sb.manifests()
        .write(
            "web.yaml",
            &F::yaml(&service::<F>(SessionAffinity::None), &F::backend_ips()),
        )
        .expect("rewrite manifest");
    let next = sb
        .agent_on_the_same_root(&[])
        .expect("the next agent, on the same pins");
    eventually(
        "the entry left by the first agent, of a Service that no longer has affinity, \
         purged by the next",
        SYNC_DEADLINE * 10,
        || affinity_emptied(&next),
    );
}

/// The same affinity scenario against kube-proxy's real rules of the family (`-m
/// recent --rcheck --seconds 3 --reap` per endpoint before the statistic cascade,
/// `-m recent --set` before each DNAT) on another VIP, from another client, at the
/// same time: both datapaths stick for 15 connections, re-stick after each fresh
/// pick, and re-balance after the timeout.
pub fn affinity_expiry_matches_recent_rules<F: Family>() {
    let ipt_name = F::IPTABLES;
    let svc = service::<F>(client_ip(Some(AFFINITY_TIMEOUT_S)));
    let sb = sandbox_with(
        &[CLIENT, IPT_CLIENT],
        &BACKENDS,
        &F::yaml(&svc, &F::backend_ips()),
    );
    let kube = F::kube_service(&svc, "http", F::ipt_vip(), &F::backend_ips());
    assert_eq!(kube.affinity_timeout, Some(AFFINITY_TIMEOUT_S));
    iptables::apply(&sb.topology().node, &[kube])
        .unwrap_or_else(|e| panic!("load kube-proxy's {ipt_name} rules: {e:#}"));

    // Side by side rather than one after the other: the waits dominate, and both
    // halves see the same machine at the same time.
    let (ebpf, ipt) = thread::scope(|s| {
        let ebpf =
            s.spawn(|| affinity_run(&sb.client().ns, client::<F>(), F::http(F::cluster_ip())));
        let ipt = s.spawn(|| {
            affinity_run(
                &sb.pod(IPT_CLIENT.0).ns,
                F::pod(IPT_CLIENT.1),
                F::http(F::ipt_vip()),
            )
        });
        (
            ebpf.join().expect("ebpf-proxy half panicked"),
            ipt.join()
                .unwrap_or_else(|_| panic!("{ipt_name} half panicked")),
        )
    });
    let ipt = ipt.unwrap_or_else(|e| panic!("{ipt_name} reference: {e}"));
    let ebpf = ebpf.unwrap_or_else(|e| panic!("ebpf-proxy: {e}"));
    let table = format!(
        "{:<21}{}\n{:<21}{}",
        format!("{ipt_name} -m recent:"),
        ipt.summary(),
        "ebpf-proxy:",
        ebpf.summary()
    );
    eprintln!("{table}");
    assert!(
        ipt.stuck() && ipt.resticks() && ipt.rebalanced(),
        "the {ipt_name} reference itself did not stick and re-balance (sandbox problem?):\n{table}"
    );
    assert_eq!(
        (ebpf.stuck(), ebpf.resticks(), ebpf.rebalanced()),
        (ipt.stuck(), ipt.resticks(), ipt.rebalanced()),
        "ebpf-proxy's (stuck, sticky again, re-balanced) differs from kube-proxy's \
         {ipt_name} rules:\n{table}"
    );
}

/// A long-lived TCP connection survives scaling its Service from 3 to 10 backends
/// and back to 3 (its own backend always in the set): no reset, same backend, lines
/// still answered after each step, while new connections follow the new sets.
pub fn established_connection_survives_scaling_3_10_3<F: Family>() {
    let family = F::NAME;
    let vip = F::http(F::cluster_ip());
    let pods: Vec<(String, Ipv4Addr)> = (0..10u8)
        .map(|i| (format!("pod-{i}"), Ipv4Addr::new(10, 200, 0, 20 + i)))
        .collect();
    let pods: Vec<(&str, Ipv4Addr)> = pods.iter().map(|(n, ip)| (n.as_str(), *ip)).collect();
    let all: Vec<F> = pods.iter().map(|p| F::pod(p.1)).collect();
    // Every third pod: the added backends sort in between ("10.200.0.21:8080" ...),
    // so both steps replace the slot set instead of appending to it, the harder case.
    let three: Vec<F> = vec![all[1], all[4], all[7]];
    let names_of = |ips: &[F]| -> BTreeSet<String> {
        pods.iter()
            .filter(|p| ips.contains(&F::pod(p.1)))
            .map(|p| p.0.to_owned())
            .collect()
    };
    let svc = service::<F>(SessionAffinity::None);
    let sb = sandbox_with(&[CLIENT], &pods, &F::yaml(&svc, &three));
    let ns = &sb.client().ns;

    let mut session = TcpSession::open(ns, vip, TIMEOUT).expect("open the long-lived connection");
    let own = session.greeting.backend.clone();
    assert!(
        names_of(&three).contains(&own),
        "the long-lived connection landed on {own}, outside the Service's backends {:?}",
        names_of(&three)
    );
    let mut exchange = |step: &str| {
        let answer = session.exchange(step).unwrap_or_else(|e| {
            panic!("the long-lived {family} connection to {own} broke at step {step:?}: {e:#}")
        });
        assert_eq!(
            answer,
            format!("{own} {step}"),
            "the long-lived connection is answered by someone else at step {step:?}"
        );
    };
    exchange("with-3");

    sb.manifests()
        .write("web.yaml", &F::yaml(&svc, &all))
        .expect("scale to 10");
    // Until a new connection reaches one of the added backends: the scale-up is live.
    let added: BTreeSet<String> = names_of(&all)
        .difference(&names_of(&three))
        .cloned()
        .collect();
    let mut seen = Vec::new();
    eventually(
        "after scaling to 10, a new connection to an added backend",
        SYNC_DEADLINE * 2,
        || {
            seen.extend(connect_n(ns, client::<F>(), vip, 1));
            if seen.iter().any(|b| added.contains(b)) {
                Ok(())
            } else {
                Err(format!("new connections only reach {:?}", distinct(&seen)))
            }
        },
    );
    exchange("with-10");

    rewrite(&sb, &F::yaml(&svc, &three));
    let after = connect_n(ns, client::<F>(), vip, 60);
    let outside: Vec<&str> = distinct(&after)
        .into_iter()
        .filter(|b| !names_of(&three).contains(*b))
        .collect();
    assert!(
        outside.is_empty(),
        "synced after scaling back to 3, yet new connections still reach removed \
         backends {outside:?}: {after:?}"
    );
    exchange("with-3-again");
}

/// A UDP client that keeps sending from one socket (one source port: one flow)
/// while its backend is removed gets answers from another backend within a second
/// of the manifest change, and keeps that backend: the flow's conntrack entry
/// (`CONNTRACK`, `CONNTRACK6`) went with the old backend instead of pinning the
/// client to it (kube-proxy's stale UDP conntrack problem).
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom; its steps share the namespaces and agent it sets up"
)]
pub fn udp_flow_moves_within_a_second_when_its_backend_is_removed<F: Family>() {
    let family = F::NAME;
    let svc = service::<F>(SessionAffinity::None);
    let sb = sandbox_with(&[CLIENT], &BACKENDS, &F::yaml(&svc, &F::backend_ips()));
    // A connected socket accepts only datagrams from the ClusterIP itself, so every
    // answer counted here was reverse-NATed correctly.
    let socket = sb
        .client()
        .ns
        .run(|| -> std::io::Result<UdpSocket> {
            let s = UdpSocket::bind(F::any(0))?;
            s.connect::<SocketAddr>(F::dns(F::cluster_ip()).into())?;
            // Long enough that a slow answer is not mistaken for the next one's, short
            // enough to resend soon after a datagram that went nowhere.
            s.set_read_timeout(Some(Duration::from_millis(250)))?;
            Ok(s)
        })
        .expect("client namespace")
        .expect("UDP socket");
    let local_port = socket.local_addr().expect("local address").port();
    // One datagram, and its answer if one comes within the read timeout.
    let ping = |n: usize| -> Option<Reply<F::Addr>> {
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
            "the {family} UDP flow got only {before:?} in {sent} datagrams"
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
    let client_addr = F::addr(client::<F>(), local_port);
    assert_eq!(
        before[0].peer, client_addr,
        "the backend should see the client's own address and port"
    );

    let remaining: Vec<F> = BACKENDS
        .iter()
        .filter(|b| b.0 != own)
        .map(|b| F::pod(b.1))
        .collect();
    sb.manifests()
        .write("web.yaml", &F::yaml(&svc, &remaining))
        .expect("remove the flow's backend");
    let written = Instant::now();
    // (sent, answered, backend) of every datagram since the change.
    let mut log: Vec<(Duration, Duration, Option<String>)> = Vec::new();
    // Every 20 ms: `at` is as precise as that.
    let moved = wait_for(SYNC_DEADLINE * 3, Duration::from_millis(20), || {
        let sent_at = written.elapsed();
        let reply = ping(sent);
        let at = written.elapsed();
        sent += 1;
        log.push((sent_at, at, reply.as_ref().map(|r| r.backend.clone())));
        match reply {
            Some(r) if r.backend != own => Ok((at, r)),
            Some(r) => Err(format!("answered by {} {at:?} after the change", r.backend)),
            None => Err(format!("no answer {at:?} after the change")),
        }
    });
    let ((at, reply), _) = moved.unwrap_or_else(|last| {
        panic!(
            "{:?} after {own} was removed, the {family} flow still gets no answer from \
             another backend (last: {last}); (sent, answered, backend) since the change: {log:?}",
            written.elapsed()
        )
    });
    eprintln!(
        "first answer from {} {at:?} after the change ({} datagrams since)",
        reply.backend,
        log.len()
    );
    assert!(
        at < SYNC_DEADLINE,
        "the first answer from another backend came {at:?} after {own} was removed; \
         (sent, answered, backend) since the change: {log:?}"
    );
    assert_eq!(
        reply.peer, client_addr,
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

/// Terminating endpoints (serving, not ready): no new connections while ready ones
/// exist, an established connection to one keeps working (graceful drain), and when
/// nothing is ready the serving-terminating endpoints take new connections
/// (kube-proxy's fallback) while a terminating endpoint that is not serving never
/// does.
pub fn terminating_endpoints_drain_and_are_the_fallback<F: Family>() {
    let family = F::NAME;
    let vip = F::http(F::cluster_ip());
    let [(a, _), (b, _), (c, _)] = BACKENDS;
    let svc = service::<F>(SessionAffinity::None);
    let sb = sandbox_with(&[CLIENT], &BACKENDS, &F::yaml(&svc, &F::backend_ips()));
    let ns = &sb.client().ns;

    // An established connection to c while it is ready.
    let mut session = (0..200)
        .map(|_| TcpSession::open(ns, vip, TIMEOUT).expect("connect"))
        .find(|s| s.greeting.backend == c)
        .unwrap_or_else(|| panic!("200 connections never reached {c}"));
    let mut exchange = |step: &str| {
        let answer = session.exchange(step).unwrap_or_else(|e| {
            panic!("the {family} connection to terminating {c} broke at {step:?}: {e:#}")
        });
        assert_eq!(answer, format!("{c} {step}"), "at {step:?}");
    };
    exchange("ready");

    rewrite(
        &sb,
        &F::yaml_with(
            &svc,
            &endpoints(|name, ip| {
                Some(if name == c {
                    Endpoint::terminating_serving(ip)
                } else {
                    Endpoint::ready(ip)
                })
            }),
        ),
    );
    let draining = connect_n(ns, client::<F>(), vip, 60);
    assert_eq!(
        distinct(&draining),
        BTreeSet::from([a, b]),
        "while {a} and {b} are ready, new connections should go to both of them and never \
         to serving-but-terminating {c}: {draining:?}"
    );
    exchange("terminating");

    rewrite(
        &sb,
        &F::yaml_with(
            &svc,
            &endpoints(|name, ip| {
                Some(if name == a {
                    Endpoint::terminating_not_serving(ip)
                } else {
                    Endpoint::terminating_serving(ip)
                })
            }),
        ),
    );
    let fallback = connect_n(ns, client::<F>(), vip, 60);
    assert_eq!(
        distinct(&fallback),
        BTreeSet::from([b, c]),
        "with nothing ready, new connections should fall back to the serving-terminating \
         {b} and {c}, never to non-serving {a}: {fallback:?}"
    );
    exchange("fallback");
}

/// Affinity on a fallback set: with nothing ready, kube-proxy writes its affinity
/// rules for the serving-terminating endpoints it falls back to (k/k
/// `proxier_test.go`, "only terminating endpoints exist": `-m recent --rcheck` for
/// each of them), so a client stays on one of them; checked next to those rules. So
/// does a client of a Service whose endpoints are ready but also terminating
/// (publishNotReadyAddresses).
pub fn affinity_holds_on_terminating_fallback_endpoints<F: Family>() {
    let (family, ipt_name) = (F::NAME, F::IPTABLES);
    let vip = F::http(F::cluster_ip());
    let svc = service::<F>(client_ip(None));
    let sb = sandbox_with(
        &[CLIENT, IPT_CLIENT],
        &BACKENDS,
        &F::yaml_with(
            &svc,
            &endpoints(|_, ip| Some(Endpoint::terminating_serving(ip))),
        ),
    );
    // kube-proxy's rules for this slice: CategorizeEndpoints falls back to all three.
    iptables::apply(
        &sb.topology().node,
        &[F::kube_service(
            &svc,
            "http",
            F::ipt_vip(),
            &F::backend_ips(),
        )],
    )
    .unwrap_or_else(|e| panic!("load kube-proxy's {ipt_name} rules: {e:#}"));
    let ipt = connect_n(
        &sb.pod(IPT_CLIENT.0).ns,
        F::pod(IPT_CLIENT.1),
        F::http(F::ipt_vip()),
        STICKY_RUN,
    );
    let ns = &sb.client().ns;
    let fallback = connect_n(ns, client::<F>(), vip, STICKY_RUN);
    eprintln!("only serving-terminating endpoints: {ipt_name} {ipt:?}, ebpf-proxy {fallback:?}");
    assert_eq!(
        distinct(&ipt).len(),
        1,
        "kube-proxy's {ipt_name} rules for the fallback set do not stick (sandbox problem?): \
         {ipt:?}"
    );
    assert_eq!(
        distinct(&fallback).len(),
        1,
        "with ClientIP affinity and only serving-terminating {family} endpoints, \
         {STICKY_RUN} new connections should stay on one of them, as with kube-proxy's \
         rules ({ipt:?}): {fallback:?}"
    );

    // publishNotReadyAddresses: ready stays true while the pod terminates.
    rewrite(
        &sb,
        &F::yaml_with(
            &svc,
            &endpoints(|_, ip| {
                Some(Endpoint {
                    ip,
                    ready: true,
                    serving: true,
                    terminating: true,
                })
            }),
        ),
    );
    let ready_terminating = connect_n(ns, client::<F>(), vip, STICKY_RUN);
    assert_eq!(
        distinct(&ready_terminating).len(),
        1,
        "with ClientIP affinity and ready-but-terminating {family} endpoints, {STICKY_RUN} \
         new connections should stay on one of them: {ready_terminating:?}"
    );
}

/// A client stuck to a backend that stops being ready, or is removed, is balanced
/// anew on its next connection (and sticks to the new pick), never sent to the old
/// one.
pub fn stuck_client_moves_when_its_backend_stops_being_ready_or_is_removed<F: Family>() {
    let vip = F::http(F::cluster_ip());
    let svc = service::<F>(client_ip(None));
    let sb = sandbox_with(&[CLIENT], &BACKENDS, &F::yaml(&svc, &F::backend_ips()));
    let ns = &sb.client().ns;

    let first = connect_n(ns, client::<F>(), vip, STICKY_RUN);
    assert_eq!(
        distinct(&first).len(),
        1,
        "not sticky to begin with: {first:?}"
    );
    let stuck = first[0].clone();

    rewrite(
        &sb,
        &F::yaml_with(
            &svc,
            &endpoints(|name, ip| {
                Some(if name == stuck {
                    Endpoint::terminating_serving(ip)
                } else {
                    Endpoint::ready(ip)
                })
            }),
        ),
    );
    let moved = connect_n(ns, client::<F>(), vip, STICKY_RUN);
    assert!(
        distinct(&moved).len() == 1 && moved[0] != stuck,
        "after {stuck} turned terminating, the client stuck to it should move to one other \
         backend and stay there: {moved:?}"
    );
    let second = moved[0].clone();

    // `second` goes; `stuck` is still terminating, so the third is all that is ready.
    rewrite(
        &sb,
        &F::yaml_with(
            &svc,
            &endpoints(|name, ip| {
                if name == second {
                    None
                } else if name == stuck {
                    Some(Endpoint::terminating_serving(ip))
                } else {
                    Some(Endpoint::ready(ip))
                }
            }),
        ),
    );
    let last = connect_n(ns, client::<F>(), vip, STICKY_RUN);
    assert!(
        distinct(&last).len() == 1 && last[0] != stuck && last[0] != second,
        "after {second} was removed (and {stuck} is terminating), the client stuck to it \
         should move to the last ready backend and stay there: {last:?}"
    );
}

/// A UDP flow that sends every 300 ms under `--conntrack-udp-timeout 1s` lives on:
/// the agent raises the timeout to 3 s (`cli::MIN_IDLE_TIMEOUT`), since the datapath
/// refreshes each direction's entry at most once a second. With 1 s in force, the
/// reply entry read expired before any reply could refresh it: the flow's answers went
/// untranslated, a second at a time.
pub fn udp_flow_sending_every_300ms_outlives_a_1s_timeout<F: Family>() {
    let family = F::NAME;
    let svc = service::<F>(SessionAffinity::None);
    require_root().expect("privileged test");
    let mut sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    sb.manifests()
        .write("web.yaml", &F::yaml(&svc, &F::backend_ips()))
        .expect("write manifest");
    sb.start_agent_with(&["--conntrack-udp-timeout", "1s"])
        .expect("start the agent");
    let new_flows = sb.counter("ct_new_flow");
    let answers = sb
        .client()
        .ns
        .run(|| -> std::io::Result<Vec<Option<String>>> {
            let s = UdpSocket::bind(F::any(0))?;
            s.connect::<SocketAddr>(F::dns(F::cluster_ip()).into())?;
            s.set_read_timeout(Some(Duration::from_millis(250)))?;
            let mut buf = [0u8; 2048];
            let mut answers = Vec::new();
            for n in 0..20 {
                let sent = Instant::now();
                s.send(format!("ping {n}\n").as_bytes())?;
                answers.push(match s.recv(&mut buf) {
                    Ok(len) => Some(
                        Reply::<F::Addr>::parse(&String::from_utf8_lossy(&buf[..len]))
                            .expect("well-formed answer")
                            .backend,
                    ),
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                        None
                    }
                    Err(e) => return Err(e),
                });
                thread::sleep(Duration::from_millis(300).saturating_sub(sent.elapsed()));
            }
            Ok(answers)
        })
        .expect("client namespace")
        .expect("UDP exchanges");
    let backends: BTreeSet<_> = answers.iter().flatten().collect();
    assert!(
        answers.iter().all(Option::is_some) && backends.len() == 1,
        "{family}: 20 datagrams 300 ms apart over 6 s, one flow under a timeout raised to 3 s, \
         should all be answered by one backend; answers (None: lost): {answers:?}"
    );
    assert_eq!(
        sb.counter("ct_new_flow") - new_flows,
        1,
        "{family}: the flow should have been created once, never again as expired"
    );
}
