//! Per-Service counters, end to end: the agent on the fake API server
//! programs three Services of one namespace, `web` (one endpoint), `idle`
//! (one endpoint, no traffic) and `empty` (no endpoints). Known TCP
//! sessions to `web` and refused connections to `empty` show on /metrics
//! as `ebpf_proxy_service_*` of each, by namespace, Service, port and
//! protocol: `web`'s flows exactly, its packets and bytes by direction
//! within what the headers add to the payloads sent, `empty`'s rejects
//! exactly, `idle`'s nothing; a `connect()` of the node's own, sent to
//! `web`'s backend by the socket hook, counts as a flow of `web`. A
//! Service that goes away takes its series with it, and a Service given a
//! freed service id starts from zero. `ebpf-proxy status` gives the same
//! counters by Service port, and says what was refused of a Service and why
//! (an externalIP that is another Service's ClusterIP; a Service without a
//! spec, refused as a whole).
//!
//! Needs root (namespaces, BPF), the release binary (`cargo xtask build`)
//! and `promtool` (`cargo xtask setup` installs it).

use ebpf_proxy_apiserver as apiserver;

mod scrape;

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    time::Duration,
};

use apiserver::{Resource, node, service, slice};
use ebpf_proxy_tests::{
    agent::Agent,
    cgroup::TestCgroup,
    client::{Outcome, TIMEOUT, TcpSession, tcp_request},
    eventually, eventually_value,
    netns::{NetNs, unique_stem},
    require_root,
    sandbox::Sandbox,
    topology::one_node::{BACKENDS, CLIENT, CLUSTER_IP, TCP_PORT, UDP_PORT, VIP},
};
use scrape::{Scrape, promtool_accepts};

/// Not another test's port, so that the flag is seen honoured.
const METRICS: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 10351);
const CONVERGE: Duration = Duration::from_secs(10);
const IDLE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 11);
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 12);
const FRESH_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 13);
const SQUATTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 14);
/// Service ids below it are counted: the three Services' (ids 1 to 3),
/// so that a Service that comes later takes a freed one.
const COUNTED: &str = "4";
const SESSIONS: usize = 3;
const EXCHANGES: usize = 4;
const REFUSED: usize = 5;
/// Least and most an IPv4 TCP packet's headers add to its payload (20
/// bytes each without options, 60 with the most).
const HEADERS: (u64, u64) = (40, 120);

/// A counter's samples with `labels`, summed, as a whole count; None when
/// there is none.
fn count_of(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> Option<u64> {
    scrape.sum(name, labels).map(|v| v as u64)
}

/// [`count_of`], which must exist.
fn count(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> u64 {
    scrape.get(name, labels) as u64
}

/// The service id `ebpf-proxy status` shows for the first port of
/// `namespace/name`, if it shows the Service.
fn service_id(status: &str, namespace: &str, name: &str) -> Option<u32> {
    let header = format!("{namespace}/{name}");
    let mut lines = status.lines().skip_while(|l| *l != header).skip(1);
    let port = lines.find(|l| l.starts_with("  port "))?;
    let (_, rest) = port.split_once("(service id ")?;
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// The ids of `names` (of `namespace`) once the status shows them all.
fn ids_when_programmed(agent: &Agent, namespace: &str, names: &[&str]) -> Vec<u32> {
    eventually_value("the Services in the status", CONVERGE, || {
        let status = agent.status().map_err(|e| format!("{e:#}"))?;
        names
            .iter()
            .map(|name| {
                service_id(&status, namespace, name)
                    .ok_or_else(|| format!("no service id of {namespace}/{name} in:\n{status}"))
            })
            .collect::<Result<Vec<u32>, String>>()
    })
    .0
}

/// Payload bytes each way of `SESSIONS` sessions to `web`, each with
/// `EXCHANGES` lines: (to the backend, to the client).
fn sessions(client: &NetNs) -> (u64, u64) {
    let line = "x".repeat(99);
    let (mut to_backend, mut to_client) = (0u64, 0u64);
    for n in 0..SESSIONS {
        let mut session = TcpSession::open(client, VIP, TIMEOUT)
            .unwrap_or_else(|e| panic!("session {n} to web ({VIP}): {e:#}"));
        let greeting = format!("{} {}\n", session.greeting.backend, session.greeting.peer);
        to_client += greeting.len() as u64;
        for _ in 0..EXCHANGES {
            let answer = session
                .exchange(&line)
                .unwrap_or_else(|e| panic!("an exchange of session {n} to web: {e:#}"));
            to_backend += line.len() as u64 + 1;
            to_client += answer.len() as u64 + 1;
        }
    }
    (to_backend, to_client)
}

/// `namespace/squatter`: a Service whose externalIP is idle's ClusterIP,
/// which the address policy refuses (ClusterIPs always win); its ClusterIP
/// is served.
fn squatter(namespace: &str) -> serde_json::Value {
    let mut svc = service(namespace, "squatter", &SQUATTER_IP.to_string());
    svc["spec"]["externalIPs"] = serde_json::json!([IDLE_IP.to_string()]);
    svc
}

/// A metric's sum for a Service of the test's namespace, with labels.
type Get<'a> = &'a dyn Fn(&str, &'static str, &[(&str, &str)]) -> u64;

/// `ebpf-proxy status --output json` gives web's and empty's counters as
/// the metrics (`get`) do, and says what was refused of squatter and
/// hollow and why; as text too.
fn status_agrees(agent: &Agent, ns: &str, get: Get<'_>) {
    let report = eventually_value(
        "squatter's and hollow's refusals in the status",
        CONVERGE,
        || {
            let out = agent
                .status_with(&["--output", "json"])
                .map_err(|e| format!("ebpf-proxy status --output json: {e:#}"))?;
            let report: serde_json::Value = serde_json::from_str(&out)
                .map_err(|e| format!("status is not JSON ({e}):\n{out}"))?;
            let refused = |name: &str| {
                report["services"].as_array().is_some_and(|list| {
                    list.iter().any(|s| {
                        s["namespace"] == ns && s["name"] == name && s["refused"].is_array()
                    })
                })
            };
            if refused("squatter") && refused("hollow") {
                Ok(report)
            } else {
                Err(format!("not both refused yet:\n{report:#}"))
            }
        },
    )
    .0;
    let of = |name: &str| service_in(&report, ns, name);
    let counters = |name: &str| of(name)["ports"][0]["counters"].clone();
    let web = counters("web");
    let dir = |d| [("direction", d)];
    for (what, got, want) in [
        (
            "flows",
            &web["flows"],
            get("ebpf_proxy_service_flows_total", "web", &[]),
        ),
        (
            "packets to the backend",
            &web["packets"]["to_backend"],
            get(
                "ebpf_proxy_service_packets_total",
                "web",
                &dir("to_backend"),
            ),
        ),
        (
            "packets to the client",
            &web["packets"]["to_client"],
            get("ebpf_proxy_service_packets_total", "web", &dir("to_client")),
        ),
        (
            "bytes to the backend",
            &web["bytes"]["to_backend"],
            get("ebpf_proxy_service_bytes_total", "web", &dir("to_backend")),
        ),
        (
            "bytes to the client",
            &web["bytes"]["to_client"],
            get("ebpf_proxy_service_bytes_total", "web", &dir("to_client")),
        ),
    ] {
        assert_eq!(
            got.as_u64(),
            Some(want),
            "web's {what} in the status, against /metrics:\n{web:#}"
        );
    }
    let empty = counters("empty");
    assert_eq!(
        (empty["rejected"].as_u64(), empty["flows"].as_u64()),
        (Some(REFUSED as u64), Some(0)),
        "empty's rejects and flows in the status:\n{empty:#}"
    );
    refusals_told(agent, &report, ns, get);
}

/// The Service `ns`/`name` of a `status --output json` report.
fn service_in<'a>(report: &'a serde_json::Value, ns: &str, name: &str) -> &'a serde_json::Value {
    report["services"]
        .as_array()
        .and_then(|list| {
            list.iter()
                .find(|s| s["namespace"] == ns && s["name"] == name)
        })
        .unwrap_or_else(|| panic!("no {ns}/{name} in the status:\n{report:#}"))
}

/// What was refused of squatter and hollow, and why, in `report` and in
/// the text.
fn refusals_told(agent: &Agent, report: &serde_json::Value, ns: &str, get: Get<'_>) {
    let of = |name: &str| service_in(report, ns, name);
    let refused = |name: &str| -> Vec<(String, String)> {
        of(name)["refused"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|r| {
                (
                    r["reason"].as_str().unwrap_or("?").to_owned(),
                    r["text"].as_str().unwrap_or("?").to_owned(),
                )
            })
            .collect()
    };
    let squatter = refused("squatter");
    assert!(
        squatter.len() == 1
            && squatter[0].0 == "cluster_ip"
            && squatter[0].1.contains(&IDLE_IP.to_string()),
        "squatter's refusal, its externalIP {IDLE_IP} being idle's ClusterIP: {squatter:?}"
    );
    assert!(
        !of("squatter")["ports"].as_array().is_none_or(Vec::is_empty),
        "squatter's ClusterIP is served, yet it has no port in the status"
    );
    let hollow = refused("hollow");
    assert!(
        hollow.len() == 1 && hollow[0].0 == "invalid" && hollow[0].1.contains("spec"),
        "hollow, without a spec, refused as a whole: {hollow:?}"
    );
    assert_eq!(refused("web"), [], "web has nothing refused");

    let text = agent
        .status_with(&["--service", &format!("{ns}/squatter")])
        .unwrap_or_else(|e| panic!("ebpf-proxy status --service: {e:#}"));
    assert!(
        text.lines()
            .any(|l| l.starts_with("  refused (cluster_ip): ") && l.contains(&IDLE_IP.to_string())),
        "the text of squatter lacks its refusal:\n{text}"
    );
    let text = agent
        .status_with(&["--service", &format!("{ns}/web")])
        .unwrap_or_else(|e| panic!("ebpf-proxy status --service: {e:#}"));
    let flows = get("ebpf_proxy_service_flows_total", "web", &[]);
    assert!(
        text.lines()
            .any(|l| l.starts_with(&format!("    traffic: {flows} flows, packets "))),
        "the text of web lacks its traffic line of {flows} flows:\n{text}"
    );
}

/// Checks that `packets` packets of `bytes` carry `payload` bytes: each
/// packet's headers add between `HEADERS` bytes.
fn check_bytes(direction: &str, packets: u64, bytes: u64, payload: u64, least_packets: u64) {
    assert!(
        packets >= least_packets,
        "web's packets {direction}: {packets}, fewer than the {least_packets} its sessions sent"
    );
    let overhead = bytes.checked_sub(payload).unwrap_or_else(|| {
        panic!("web's bytes {direction}: {bytes}, fewer than the {payload} bytes of payload sent")
    });
    assert!(
        (HEADERS.0 * packets..=HEADERS.1 * packets).contains(&overhead),
        "web's bytes {direction}: {bytes} in {packets} packets, {overhead} more than the \
         {payload} bytes of payload, where their headers add between {} and {}",
        HEADERS.0 * packets,
        HEADERS.1 * packets
    );
}

/// One connection of the node's own to `web` (bash's `/dev/tcp`, in
/// `cgroup`), which the socket hook sends to the backend at `connect()`:
/// its packets pass no translation.
fn node_connects(node: &NetNs, cgroup: &TestCgroup) {
    let script = format!("exec 3<>/dev/tcp/{}/{}; head -1 <&3", VIP.ip(), VIP.port());
    let out = cgroup
        .command_in(node, "timeout")
        .args(["3", "bash", "-c", &script])
        .output()
        .expect("running bash");
    assert!(
        out.status.success() && !out.stdout.is_empty(),
        "the node's connection to web ({VIP}): {} stdout {:?} stderr {:?}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom; its steps share the namespaces, API server and agent it sets up"
)]
fn service_counters_count_each_services_flows_bytes_and_rejects() {
    require_root().expect("privileged test");
    let sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let node_ns = &sb.topology().node;
    let client = &sb.client().ns;
    let node_name = node_ns.name().to_owned();
    let ns = format!("counted-{}", unique_stem().replace('_', "-").to_lowercase());
    // The socket hooks on a cgroup of this test's own, declared before the
    // agent so that it outlives the agent's links.
    let cgroup = TestCgroup::create(&unique_stem()).expect("a cgroup of the test's own");
    let cgroup_root = cgroup.path().display().to_string();

    let (_runtime, server) = apiserver::serve_in(node_ns);
    server.apply(node(&node_name, None));
    server.apply(service(&ns, "web", &CLUSTER_IP.to_string()));
    server.apply(slice(&ns, "web-1", "web", &node_name, &["10.200.0.11"]));
    server.apply(service(&ns, "idle", &IDLE_IP.to_string()));
    server.apply(slice(&ns, "idle-1", "idle", &node_name, &["10.200.0.12"]));
    server.apply(service(&ns, "empty", &EMPTY_IP.to_string()));
    let agent = Agent::start_on_api(
        node_ns,
        server.url(),
        &[
            "--metrics-bind-address",
            &METRICS.to_string(),
            "--service-counters",
            COUNTED,
            "--cgroup-root",
            &cgroup_root,
        ],
    )
    .expect("the agent on the API source");
    let ids = ids_when_programmed(&agent, &ns, &["web", "idle", "empty"]);
    // Refused: an externalIP that is idle's ClusterIP, and a Service the
    // model cannot program at all. After the three, so that their ids are
    // the counted ones.
    server.apply(squatter(&ns));
    server.apply(serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "hollow", "namespace": ns},
    }));

    let (to_backend, to_client) = sessions(client);
    let empty_vip = SocketAddrV4::new(EMPTY_IP, 80);
    for n in 0..REFUSED {
        match tcp_request(client, empty_vip, TIMEOUT) {
            Outcome::Refused => {}
            other => panic!("connection {n} to empty ({empty_vip}), without endpoints: {other}"),
        }
    }
    node_connects(node_ns, &cgroup);
    // The sessions' last packets (their FINs and ACKs) through.
    std::thread::sleep(Duration::from_millis(500));

    let scraped = scrape::scrape(node_ns, METRICS);
    promtool_accepts(&scraped);
    let of = |svc: &'static str| -> [(&'static str, String); 4] {
        [
            ("namespace", ns.clone()),
            ("service", svc.to_owned()),
            ("port", "80".to_owned()),
            ("protocol", "TCP".to_owned()),
        ]
    };
    let get = |name: &str, svc: &'static str, extra: &[(&str, &str)]| -> u64 {
        let labels = of(svc);
        let mut all: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
        all.extend_from_slice(extra);
        count(&scraped, name, &all)
    };
    let dir = |d| [("direction", d)];

    assert_eq!(
        get("ebpf_proxy_service_flows_total", "web", &[]),
        SESSIONS as u64 + 1,
        "web's flows: one a session, and the node's connect()"
    );
    // Each session's handshake, lines and close: SYN, ACK, the lines and
    // a FIN at least each way.
    let least = (EXCHANGES + 2) as u64 * SESSIONS as u64;
    check_bytes(
        "to the backend",
        get(
            "ebpf_proxy_service_packets_total",
            "web",
            &dir("to_backend"),
        ),
        get("ebpf_proxy_service_bytes_total", "web", &dir("to_backend")),
        to_backend,
        least,
    );
    check_bytes(
        "to the client",
        get("ebpf_proxy_service_packets_total", "web", &dir("to_client")),
        get("ebpf_proxy_service_bytes_total", "web", &dir("to_client")),
        to_client,
        least,
    );
    assert_eq!(
        get("ebpf_proxy_service_rejected_total", "web", &[]),
        0,
        "web has an endpoint: nothing to reject"
    );
    assert_eq!(
        get("ebpf_proxy_service_rejected_total", "empty", &[]),
        REFUSED as u64,
        "empty's rejects: one a connection refused"
    );
    assert_eq!(
        get("ebpf_proxy_service_flows_total", "empty", &[]),
        0,
        "empty started no flow"
    );
    for name in [
        "ebpf_proxy_service_flows_total",
        "ebpf_proxy_service_packets_total",
        "ebpf_proxy_service_bytes_total",
        "ebpf_proxy_service_rejected_total",
        "ebpf_proxy_service_dropped_total",
    ] {
        assert_eq!(
            get(name, "idle", &[]),
            0,
            "idle had no traffic, yet {name} is not 0"
        );
    }
    assert_eq!(
        count_of(
            &scraped,
            "ebpf_proxy_service_dropped_total",
            &[("namespace", &ns)]
        ),
        Some(0),
        "no flow was dropped:\n{}",
        scraped.text
    );
    status_agrees(&agent, &ns, &get);
    eprintln!(
        "web: {} packets / {} bytes to the backend ({to_backend} of payload), {} / {} to the client ({to_client})",
        get(
            "ebpf_proxy_service_packets_total",
            "web",
            &dir("to_backend")
        ),
        get("ebpf_proxy_service_bytes_total", "web", &dir("to_backend")),
        get("ebpf_proxy_service_packets_total", "web", &dir("to_client")),
        get("ebpf_proxy_service_bytes_total", "web", &dir("to_client")),
    );

    // Squatter's id, above the bound, is not one `fresh` could take.
    server.delete(Resource::Services, &ns, "squatter");
    // `web` goes, then `fresh` comes: it takes web's id, the only one free
    // below the bound, and starts from zero.
    server.delete(Resource::Services, &ns, "web");
    eventually("web's series gone", CONVERGE, || {
        let s = scrape::scrape(node_ns, METRICS);
        match count_of(
            &s,
            "ebpf_proxy_service_flows_total",
            &[("namespace", &ns), ("service", "web")],
        ) {
            None => Ok(()),
            Some(_) => Err(format!("web is still exposed:\n{}", s.text)),
        }
    });
    server.apply(service(&ns, "fresh", &FRESH_IP.to_string()));
    server.apply(slice(&ns, "fresh-1", "fresh", &node_name, &["10.200.0.13"]));
    let fresh = ids_when_programmed(&agent, &ns, &["fresh"]);
    assert_eq!(
        fresh[0], ids[0],
        "fresh took another id than web's {}, the only one free below {COUNTED}",
        ids[0]
    );
    let after = scrape::scrape(node_ns, METRICS);
    let fresh_total: u64 = [
        "ebpf_proxy_service_flows_total",
        "ebpf_proxy_service_packets_total",
        "ebpf_proxy_service_bytes_total",
    ]
    .iter()
    .map(|name| {
        count(
            &after,
            name,
            &[("namespace", ns.as_str()), ("service", "fresh")],
        )
    })
    .sum();
    assert_eq!(
        fresh_total, 0,
        "fresh, on web's former id {}, shows web's totals:\n{}",
        ids[0], after.text
    );

    server.delete(Resource::Services, &ns, "idle");
    eventually("idle's series gone", CONVERGE, || {
        let s = scrape::scrape(node_ns, METRICS);
        match count_of(
            &s,
            "ebpf_proxy_service_packets_total",
            &[("namespace", &ns), ("service", "idle")],
        ) {
            None => Ok(()),
            Some(_) => Err(format!("idle is still exposed:\n{}", s.text)),
        }
    });
    drop(agent);
}
