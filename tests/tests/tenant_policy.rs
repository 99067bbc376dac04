//! Attacks by one tenant's Services on another's addresses and on the node, on real
//! packets (docs/security.md): the agent binary on the Kubernetes API source (the
//! loopback API server inside the node namespace), a client pod, and backends
//! standing in for the victims (`backend-a`, `backend-b`) and for the attacker's pod
//! (`backend-c`). Each test asserts what the traffic reaches, not what the agent
//! says it did, so each fails against an agent without the address policy.
//!
//! Needs root (namespaces, BPF) and the release binary (`cargo xtask build`). Every
//! test builds its own namespaces, API server and bpffs root, so they run in
//! parallel; everything is removed on drop, also when a test fails.

use ebpf_proxy_apiserver as apiserver;

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use apiserver::{ApiServer, Resource};
use ebpf_proxy_tests::{
    agent,
    client::{Outcome, tcp_request},
    eventually,
    kube_agent::KubeAgent,
    netns::{NetNs, run_in},
    require_root,
    sandbox::Sandbox,
    servers::TcpServer,
    topology::{
        NODE_IP,
        one_node::{BACKENDS, CLIENT, TCP_PORT, UDP_PORT},
    },
};
use proxy_userspace::datapath::{Maps, PinLayout};
use serde_json::{Value, json};

/// How long an API change may take to show in the traffic: the agent's own path is
/// milliseconds; this is slack for a loaded machine.
const CONVERGE: Duration = Duration::from_secs(10);
/// One request's wait for an answer.
const REQUEST: Duration = Duration::from_millis(500);
/// The agent's metrics, inside the node namespace.
const METRICS: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10249);

// ---- the agent on the API ------------------------------------------------------

/// What these tests read of the agent ([`KubeAgent`]) besides the traffic: its
/// programmed frontends, its memory and its count of refused addresses.
trait PolicyAgent {
    /// Frontends in the pinned SERVICES map.
    fn frontends(&self) -> usize;
    /// The agent's resident memory (`VmRSS`), in KiB.
    fn rss_kib(&self) -> u64;
    /// The value of `ebpf_proxy_service_addresses_refused{reason}`, as scraped now.
    fn refused(&self, reason: &str) -> Option<String>;
    /// Waits until `reason` has `want` addresses refused.
    fn wait_refused(&self, reason: &str, want: &str);
}

impl PolicyAgent for KubeAgent {
    fn frontends(&self) -> usize {
        let maps = Maps::open_pinned(&PinLayout::new(self.bpf_root())).expect("the pinned maps");
        maps.services.iter().count()
    }

    fn rss_kib(&self) -> u64 {
        ebpf_proxy_tests::process::rss_kib(self.pid())
            .unwrap_or_else(|e| panic!("the agent's RSS: {e:#}"))
    }

    fn refused(&self, reason: &str) -> Option<String> {
        let series = format!("ebpf_proxy_service_addresses_refused{{reason=\"{reason}\"}} ");
        let (status, body) = run_in(self.netns_path(), || agent::http_get(METRICS, "/metrics"))
            .expect("enter the node namespace")
            .expect("GET /metrics");
        assert_eq!(status, 200, "GET /metrics:\n{body}");
        body.lines()
            .find_map(|l| Some(l.strip_prefix(&series)?.trim().to_owned()))
    }

    fn wait_refused(&self, reason: &str, want: &str) {
        eventually(
            &format!("{want} refused for {reason}"),
            CONVERGE,
            || match self.refused(reason) {
                Some(v) if v == want => Ok(()),
                other => Err(format!(
                    "ebpf_proxy_service_addresses_refused{{reason=\"{reason}\"}} is {other:?}"
                )),
            },
        );
    }
}

// ---- objects ---------------------------------------------------------------------

/// `namespace/name` at `cluster_ip` with one port `port`/TCP -> 8080, created
/// `created` minutes into 2024, claiming `external_ips`.
fn service(
    namespace: &str,
    name: &str,
    cluster_ip: &str,
    port: u16,
    external_ips: &[&str],
    created: u32,
) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {
            "name": name, "namespace": namespace,
            "uid": format!("uid-{namespace}-{name}"),
            "creationTimestamp": format!("2024-01-01T{:02}:{:02}:00Z", created / 60, created % 60),
        },
        "spec": {
            "type": "ClusterIP", "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
            "ports": [{"name": "http", "port": port, "protocol": "TCP", "targetPort": TCP_PORT}],
            "externalIPs": external_ips,
        },
    })
}

/// The Service as a LoadBalancer whose ingress holds `ingress`.
fn load_balancer(mut service: Value, ingress: &[&str]) -> Value {
    service["spec"]["type"] = json!("LoadBalancer");
    service["status"] = json!({"loadBalancer": {"ingress": ingress.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>()}});
    service
}

/// The one EndpointSlice of `namespace/service`: the pod `backend`.
fn endpoints(namespace: &str, service: &str, node: &str, backend: &str) -> Value {
    let ip = BACKENDS
        .iter()
        .find(|b| b.0 == backend)
        .unwrap_or_else(|| panic!("no backend {backend}"))
        .1
        .to_string();
    apiserver::slice(namespace, &format!("{service}-1"), service, node, &[&ip])
}

fn publish(server: &ApiServer, service: Value, node: &str, backend: &str) {
    let namespace = service["metadata"]["namespace"]
        .as_str()
        .unwrap()
        .to_owned();
    let name = service["metadata"]["name"].as_str().unwrap().to_owned();
    server.apply(endpoints(&namespace, &name, node, backend));
    server.apply(service);
}

/// Passes once `n` requests from `from` to `to` are all answered by `backend`.
fn answered_by(from: &NetNs, to: SocketAddrV4, backend: &str, n: usize) -> Result<(), String> {
    for _ in 0..n {
        match tcp_request(from, to, REQUEST) {
            Outcome::Reply(r) if r.backend == backend => {}
            Outcome::Reply(r) => {
                return Err(format!("{to} answered by {}, not {backend}", r.backend));
            }
            other => return Err(format!("{to}: {other}, not an answer from {backend}")),
        }
    }
    Ok(())
}

/// The reasons of the Events posted on `namespace/name`.
fn event_reasons(server: &ApiServer, namespace: &str, name: &str) -> Vec<String> {
    server
        .events()
        .iter()
        .filter(|e| {
            e["regarding"]["namespace"] == json!(namespace) && e["regarding"]["name"] == json!(name)
        })
        .map(|e| e["reason"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// The sandbox: a client pod and the three backends, each answering TCP
/// [`TCP_PORT`] with its name.
fn sandbox() -> Sandbox {
    require_root().expect("privileged test");
    Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox")
}

// ---- the tests ---------------------------------------------------------------------

/// One hijack of a kube-dns-like ClusterIP: the victim's namespace, the attacker's,
/// how the attacker claims the address, and who is created (and listed) first.
struct Hijack {
    victim_ns: &'static str,
    attacker_ns: &'static str,
    via_ingress: bool,
    attacker_first: bool,
    index: u8,
}

impl Hijack {
    fn cluster_ip(&self) -> String {
        format!("10.96.0.{}", 10 + self.index)
    }

    fn victim(&self) -> Value {
        service(
            self.victim_ns,
            &format!("kube-dns-{}", self.index),
            &self.cluster_ip(),
            53,
            &[],
            if self.attacker_first { 20 } else { 10 },
        )
    }

    fn attacker(&self) -> Value {
        let own_ip = format!("10.96.1.{}", 10 + self.index);
        // Its own legal address beside the stolen one: refusing one address of a
        // Service must leave the others served.
        let legal = format!("203.0.113.{}", 10 + self.index);
        let created = if self.attacker_first { 10 } else { 20 };
        let cluster_ip = self.cluster_ip();
        if self.via_ingress {
            let mut s = load_balancer(
                service(
                    self.attacker_ns,
                    &self.attacker_name(),
                    &own_ip,
                    53,
                    &[&legal],
                    created,
                ),
                &[&cluster_ip],
            );
            s["spec"]["ports"][0]["nodePort"] = json!(30_000 + u16::from(self.index));
            s
        } else {
            service(
                self.attacker_ns,
                &self.attacker_name(),
                &own_ip,
                53,
                &[&cluster_ip, &legal],
                created,
            )
        }
    }

    fn attacker_name(&self) -> String {
        format!("evil-{}", self.index)
    }

    fn what(&self) -> String {
        format!(
            "{} via {} of {}, created {} (victim in {})",
            self.cluster_ip(),
            if self.via_ingress {
                "load balancer ingress"
            } else {
                "externalIPs"
            },
            self.attacker_ns,
            if self.attacker_first {
                "before the victim"
            } else {
                "after the victim"
            },
            self.victim_ns,
        )
    }
}

/// A kube-dns-like ClusterIP claimed by another namespace's Service, through its
/// externalIPs and through its load balancer ingress, created before and after the
/// victim, listed before and after it (the attacker's namespace sorting before and
/// after the victim's), and learnt in the initial listing or by a watch: traffic to
/// the ClusterIP reaches the victim's backend, before and after an agent restart,
/// and the attacker's other address is still served.
#[test]
fn a_cluster_ip_is_not_hijacked_by_another_namespaces_external_ip_or_ingress() {
    let sb = sandbox();
    let node_ns = &sb.topology().node;
    let client = &sb.client().ns;
    let node_name = node_ns.name().to_owned();
    let (runtime, server) = apiserver::serve_in(node_ns);
    server.apply(apiserver::node(&node_name, None));

    let mut hijacks = Vec::new();
    for (via_ingress, attacker_first, sorts_first) in
        (0..8).map(|i| (i & 1 == 1, i & 2 == 2, i & 4 == 4))
    {
        let index = hijacks.len() as u8;
        let (victim_ns, attacker_ns) = if sorts_first {
            ("kube-system", "aaa-tenant")
        } else {
            ("kube-system", "zzz-tenant")
        };
        hijacks.push(Hijack {
            victim_ns,
            attacker_ns,
            via_ingress,
            attacker_first,
            index,
        });
    }
    // Who was created first is in the initial listing; the other arrives by a watch.
    for h in &hijacks {
        if h.attacker_first {
            publish(&server, h.attacker(), "node-b", "backend-c");
        } else {
            publish(&server, h.victim(), "node-b", "backend-a");
        }
    }
    let mut agent = KubeAgent::start(node_ns, server.url());
    for h in &hijacks {
        if h.attacker_first {
            publish(&server, h.victim(), "node-b", "backend-a");
        } else {
            publish(&server, h.attacker(), "node-b", "backend-c");
        }
    }
    let check = |when: &str| {
        for h in &hijacks {
            let ip: Ipv4Addr = h.cluster_ip().parse().unwrap();
            eventually(&format!("{when}: {}", h.what()), CONVERGE, || {
                answered_by(client, SocketAddrV4::new(ip, 53), "backend-a", 5)
            });
            let legal = Ipv4Addr::new(203, 0, 113, 10 + h.index);
            eventually(
                &format!("{when}: the attacker's own address, {}", h.what()),
                CONVERGE,
                || answered_by(client, SocketAddrV4::new(legal, 53), "backend-c", 2),
            );
        }
    };
    check("a watch brought the second");
    agent.wait_refused("cluster_ip", "8");
    eventually("an Event on each attacker", CONVERGE, || {
        for h in &hijacks {
            let reasons = event_reasons(&server, h.attacker_ns, &h.attacker_name());
            if reasons != ["AddressRefused"] {
                return Err(format!(
                    "Events on {}/{}: {reasons:?}",
                    h.attacker_ns,
                    h.attacker_name()
                ));
            }
        }
        Ok(())
    });
    for h in &hijacks {
        let name = format!("kube-dns-{}", h.index);
        assert!(
            event_reasons(&server, h.victim_ns, &name).is_empty(),
            "no Event on the victim {name}: {:?}",
            server.events()
        );
    }

    agent.restart();
    check("after a restart, everything in one listing");
    drop(agent);
    drop(server);
    drop(runtime);
}

/// An externalIP that is the node's address, on a port the node listens on; one
/// that is 127.0.0.1; one that is 169.254.169.254, where a listener stands in for
/// the cloud's metadata server: the node's and the metadata server's listeners still
/// answer, never the attacker's pod.
#[test]
fn node_loopback_and_metadata_addresses_stay_the_nodes() {
    let sb = sandbox();
    let node_ns = &sb.topology().node;
    let client = &sb.client().ns;
    let node_name = node_ns.name().to_owned();
    node_ns
        .ip(&["addr", "add", "169.254.169.254/32", "dev", "lo"])
        .expect("the metadata address on the node");
    let _node_listener =
        TcpServer::start(node_ns, "node-listener", 9090).expect("the node's listener");
    let _metadata =
        TcpServer::start(node_ns, "metadata-server", 80).expect("the metadata listener");
    let (runtime, server) = apiserver::serve_in(node_ns);
    server.apply(apiserver::node(&node_name, None));
    // A Service of the victim's, to know the agent serves.
    publish(
        &server,
        service("default", "web", "10.96.0.10", 80, &[], 1),
        "node-b",
        "backend-a",
    );
    let node_ip = NODE_IP.to_string();
    publish(
        &server,
        service("tenant", "evil-node", "10.96.1.1", 9090, &[&node_ip], 2),
        "node-b",
        "backend-c",
    );
    publish(
        &server,
        service(
            "tenant",
            "evil-loopback",
            "10.96.1.2",
            9090,
            &["127.0.0.1"],
            2,
        ),
        "node-b",
        "backend-c",
    );
    publish(
        &server,
        service(
            "tenant",
            "evil-metadata",
            "10.96.1.3",
            80,
            &["169.254.169.254"],
            2,
        ),
        "node-b",
        "backend-c",
    );
    let agent = KubeAgent::start(node_ns, server.url());

    eventually("the victim's Service is served", CONVERGE, || {
        answered_by(
            client,
            SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80),
            "backend-a",
            3,
        )
    });
    eventually("a pod reaching the node's address", CONVERGE, || {
        answered_by(client, SocketAddrV4::new(NODE_IP, 9090), "node-listener", 5)
    });
    eventually("the node reaching 127.0.0.1", CONVERGE, || {
        answered_by(
            node_ns,
            SocketAddrV4::new(Ipv4Addr::LOCALHOST, 9090),
            "node-listener",
            5,
        )
    });
    eventually("a pod reaching the metadata server", CONVERGE, || {
        answered_by(
            client,
            SocketAddrV4::new(Ipv4Addr::new(169, 254, 169, 254), 80),
            "metadata-server",
            5,
        )
    });
    // The attackers' ClusterIPs are theirs, and served: only the addresses were refused.
    answered_by(
        client,
        SocketAddrV4::new(Ipv4Addr::new(10, 96, 1, 3), 80),
        "backend-c",
        2,
    )
    .unwrap_or_else(|e| panic!("the attacker's own ClusterIP: {e}"));
    for reason in ["node_address", "loopback", "link_local"] {
        agent.wait_refused(reason, "1");
    }
    drop(agent);
    drop(server);
    drop(runtime);
}

/// Two Services on one address, port and protocol: the older wins, when it arrives
/// after the younger was programmed and after an agent restart (listed after the
/// younger, whose namespace sorts first), and the younger gets it once the older is
/// deleted. Every Event post fails meanwhile, which must not hold a sync up.
#[test]
fn the_older_service_keeps_a_shared_address_across_restarts() {
    let sb = sandbox();
    let node_ns = &sb.topology().node;
    let client = &sb.client().ns;
    let node_name = node_ns.name().to_owned();
    let (runtime, server) = apiserver::serve_in(node_ns);
    server.apply(apiserver::node(&node_name, None));
    server.fail_events(500, 1_000_000);
    let shared = SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 50), 80);
    publish(
        &server,
        service("aaa-young", "web", "10.96.2.1", 80, &["203.0.113.50"], 30),
        "node-b",
        "backend-c",
    );
    let mut agent = KubeAgent::start(node_ns, server.url());
    eventually("the only claimant is served", CONVERGE, || {
        answered_by(client, shared, "backend-c", 3)
    });

    publish(
        &server,
        service("zzz-old", "web", "10.96.2.2", 80, &["203.0.113.50"], 10),
        "node-b",
        "backend-b",
    );
    eventually(
        "the older, arriving second, takes the address",
        CONVERGE,
        || answered_by(client, shared, "backend-b", 5),
    );
    agent.restart();
    eventually("after a restart: still the older", CONVERGE, || {
        answered_by(client, shared, "backend-b", 5)
    });
    answered_by(client, shared, "backend-b", 20)
        .unwrap_or_else(|e| panic!("after a restart, settled: {e}"));
    assert!(
        server
            .requests()
            .iter()
            .any(|r| r.path.ends_with("/events") && r.status == 500),
        "Events were posted, and refused:\n{}",
        server.request_log()
    );

    server.delete(Resource::Services, "zzz-old", "web");
    eventually("the older deleted: the younger has it", CONVERGE, || {
        answered_by(client, shared, "backend-c", 5)
    });
    drop(agent);
    drop(server);
    drop(runtime);
}

/// A Service asking for 3,000 externalIPs x 2 ports (6,002 frontends, over the
/// default budget of 4,096) is refused as a whole, with an Event and the metric; the
/// other Services are still served, none of its frontends reaches the maps, and the
/// agent's resident memory grows by less than [`RSS_BOUND_KIB`].
#[test]
fn an_oversized_service_is_refused_without_growing_the_agent() {
    /// What the agent may grow by while it learns of (and refuses) the Service: its
    /// JSON, about 70 KiB, is decoded once. Measured: 19,192 KiB before, 19,560
    /// after (+368); the agent before the budget programmed the 6,002 frontends and
    /// grew from 20,284 KiB to 24,264 (+3,980).
    const RSS_BOUND_KIB: u64 = 1024;
    let sb = sandbox();
    let node_ns = &sb.topology().node;
    let client = &sb.client().ns;
    let node_name = node_ns.name().to_owned();
    let (runtime, server) = apiserver::serve_in(node_ns);
    server.apply(apiserver::node(&node_name, None));
    let web = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 10), 80);
    publish(
        &server,
        service("default", "web", "10.96.0.10", 80, &[], 1),
        "node-b",
        "backend-a",
    );
    let agent = KubeAgent::start(node_ns, server.url());
    eventually("the first Service is served", CONVERGE, || {
        answered_by(client, web, "backend-a", 3)
    });
    let frontends_before = agent.frontends();
    // Settled: a few scrapes and syncs' worth of the allocator's first growth.
    for _ in 0..3 {
        let _ = agent.refused("budget");
    }
    let rss_before = agent.rss_kib();

    let ips: Vec<String> = (0..3000)
        .map(|i| format!("198.18.{}.{}", i / 250, i % 250 + 1))
        .collect();
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    let mut huge = service("tenant", "huge", "10.96.3.1", 80, &ips, 2);
    huge["spec"]["ports"] = json!([
        {"name": "http", "port": 80, "protocol": "TCP", "targetPort": TCP_PORT},
        {"name": "https", "port": 443, "protocol": "TCP", "targetPort": TCP_PORT},
    ]);
    publish(&server, huge, "node-b", "backend-c");
    // And one more Service after it, served as usual.
    publish(
        &server,
        service("default", "api", "10.96.0.11", 80, &[], 3),
        "node-b",
        "backend-b",
    );

    eventually("the Service after it is served", CONVERGE, || {
        answered_by(
            client,
            SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 11), 80),
            "backend-b",
            3,
        )
    });
    // Both Services' events were in the state by the sync that served the second.
    let rss_after = agent.rss_kib();
    eprintln!("agent VmRSS: {rss_before} KiB before the oversized Service, {rss_after} KiB after");
    let frontends_after = agent.frontends();
    assert_eq!(
        frontends_after,
        frontends_before + 1,
        "one frontend more (the Service after it's ClusterIP), none of the refused one's"
    );
    answered_by(client, web, "backend-a", 3).unwrap_or_else(|e| panic!("the first Service: {e}"));
    if let Outcome::Reply(r) = tcp_request(
        client,
        SocketAddrV4::new(Ipv4Addr::new(10, 96, 3, 1), 80),
        REQUEST,
    ) {
        panic!("the refused Service's ClusterIP answered, by {}", r.backend);
    }
    agent.wait_refused("budget", "1");
    eventually("an Event on the Service", CONVERGE, || {
        let reasons = event_reasons(&server, "tenant", "huge");
        if reasons == ["FrontendBudgetExceeded"] {
            Ok(())
        } else {
            Err(format!("Events on tenant/huge: {reasons:?}"))
        }
    });
    assert!(
        rss_after <= rss_before + RSS_BOUND_KIB,
        "the agent grew from {rss_before} KiB to {rss_after} KiB, more than {RSS_BOUND_KIB} KiB, \
         for a Service it refused"
    );
    drop(agent);
    drop(server);
    drop(runtime);
}

/// `--external-ip-cidrs` and `--max-frontends-per-service` as the command line gives
/// them: an externalIP outside the list is refused and one inside it served; a
/// Service over the small budget is refused as a whole, its ClusterIP included.
#[test]
fn the_allow_list_and_the_budget_come_from_the_command_line() {
    let sb = sandbox();
    let node_ns = &sb.topology().node;
    let client = &sb.client().ns;
    let node_name = node_ns.name().to_owned();
    let (runtime, server) = apiserver::serve_in(node_ns);
    server.apply(apiserver::node(&node_name, None));
    publish(
        &server,
        service(
            "tenant",
            "listed",
            "10.96.4.1",
            80,
            &["203.0.113.5", "198.51.100.5"],
            1,
        ),
        "node-b",
        "backend-a",
    );
    let many: Vec<String> = (1..=12).map(|i| format!("203.0.113.{}", 100 + i)).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    publish(
        &server,
        service("tenant", "big", "10.96.4.2", 80, &many, 2),
        "node-b",
        "backend-c",
    );
    let agent = KubeAgent::start_with(
        node_ns,
        server.url(),
        &[
            "--external-ip-cidrs",
            "203.0.113.0/24",
            "--max-frontends-per-service",
            "10",
        ],
    );
    eventually("the listed externalIP is served", CONVERGE, || {
        answered_by(
            client,
            SocketAddrV4::new(Ipv4Addr::new(203, 0, 113, 5), 80),
            "backend-a",
            3,
        )
    });
    agent.wait_refused("not_allowed", "1");
    agent.wait_refused("budget", "1");
    for (what, ip) in [
        (
            "the externalIP outside the list",
            Ipv4Addr::new(198, 51, 100, 5),
        ),
        (
            "the ClusterIP of the Service over its budget (13 frontends > 10)",
            Ipv4Addr::new(10, 96, 4, 2),
        ),
        (
            "an externalIP of the Service over its budget",
            Ipv4Addr::new(203, 0, 113, 101),
        ),
    ] {
        if let Outcome::Reply(r) = tcp_request(client, SocketAddrV4::new(ip, 80), REQUEST) {
            panic!("{what} ({ip}) answered, by {}", r.backend);
        }
    }
    drop(agent);
    drop(server);
    drop(runtime);
}
