//! End to end through the agent binary on the Kubernetes API source: the fake API
//! server (tests/apiserver/) listens inside the node namespace, `ebpf-proxy run
//! --master URL` runs there on the real kube-rs client, and real TCP traffic from a
//! client pod to the ClusterIP follows the Services and EndpointSlices the test
//! creates, scales, relabels and deletes through the API, also across an API outage.
//!
//! Needs root (namespaces, BPF) and the release binary (`cargo xtask build`).

use ebpf_proxy_apiserver as apiserver;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use apiserver::{Fault, Resource, Verb, node, service, slice};
use ebpf_proxy_tests::{
    client::{Outcome, tcp_request, tcp_tally},
    eventually,
    kube_agent::KubeAgent,
    netns::NetNs,
    require_root,
    sandbox::Sandbox,
};
use proxy_common::{AffinityKey, AffinityValue, ServiceKey};
use proxy_userspace::{
    datapath::{Maps, PinLayout},
    planner::{StoredState, encode::service_key_string},
};
use serde_json::json;

use ebpf_proxy_tests::client::TIMEOUT;
use ebpf_proxy_tests::topology::one_node::{BACKENDS, CLIENT, CLUSTER_IP, TCP_PORT, UDP_PORT, VIP};
/// How long an API change may take to show in the traffic. The agent's own path is
/// milliseconds; this is slack for a loaded machine.
const CONVERGE: Duration = Duration::from_secs(5);
/// Recovery after an outage includes kube-rs's backoff (up to ~6 s after a few
/// failed attempts).
const RECOVERY: Duration = Duration::from_secs(20);

/// Which backends answer `n` new connections to the VIP; an error for any request
/// that was not answered.
fn backends_answering(client: &NetNs, n: usize) -> Result<BTreeMap<String, u64>, String> {
    let tally = tcp_tally(client, VIP, n, TIMEOUT).map_err(|e| format!("{e:#}"))?;
    if !tally.failures.is_empty() {
        return Err(format!(
            "{} of the requests failed, e.g. {}; answered: {:?}",
            tally.failures.len(),
            tally.failures[0],
            tally.counts
        ));
    }
    Ok(tally.counts)
}

/// Passes once `n` connections are all answered, by exactly `backends`.
fn served_by(client: &NetNs, n: usize, backends: &[&str]) -> Result<(), String> {
    let counts = backends_answering(client, n)?;
    let seen: Vec<&str> = counts.keys().map(String::as_str).collect();
    if seen == backends {
        Ok(())
    } else {
        Err(format!("answered by {counts:?}, want exactly {backends:?}"))
    }
}

fn web_slice(node_name: &str, backends: &[&str]) -> serde_json::Value {
    let ips: Vec<String> = backends
        .iter()
        .map(|name| {
            BACKENDS
                .iter()
                .find(|b| b.0 == *name)
                .unwrap_or_else(|| panic!("no backend {name}"))
                .1
                .to_string()
        })
        .collect();
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    slice("test", "web-1", "web", node_name, &ips)
}

#[test]
fn traffic_follows_services_through_the_api() {
    require_root().expect("privileged test");
    let sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let node_ns = &sb.topology().node;
    let client = &sb.client().ns;
    let node_name = node_ns.name().to_owned();

    let (runtime, server) = apiserver::serve_in(node_ns);
    server.apply(node(&node_name, Some("zone-a")));
    server.apply(service("test", "web", &CLUSTER_IP.to_string()));
    server.apply(web_slice(&node_name, &["backend-a"]));

    let agent = KubeAgent::start(node_ns, server.url());
    let context = |what: &str| format!("{what} (agent /healthz: {})", agent.healthz());

    eventually(&context("created"), CONVERGE, || {
        served_by(client, 10, &["backend-a"])
    });

    server.apply(web_slice(
        &node_name,
        &["backend-a", "backend-b", "backend-c"],
    ));
    let took = eventually(&context("scaled to three"), CONVERGE, || {
        served_by(client, 60, &["backend-a", "backend-b", "backend-c"])
    });
    eprintln!("scale-up visible in the traffic after {took:?}");

    let mut other_proxy = service("test", "web", &CLUSTER_IP.to_string());
    other_proxy["metadata"]["labels"] =
        json!({"service.kubernetes.io/service-proxy-name": "other-proxy"});
    server.apply(other_proxy);
    eventually(
        &context("labelled for another proxy"),
        CONVERGE,
        || match tcp_request(client, VIP, Duration::from_millis(500)) {
            Outcome::Reply(r) => Err(format!("still answered by {}", r.backend)),
            _ => Ok(()),
        },
    );

    server.apply(service("test", "web", &CLUSTER_IP.to_string()));
    eventually(&context("label removed"), CONVERGE, || {
        served_by(client, 60, &["backend-a", "backend-b", "backend-c"])
    });

    // An API outage: the datapath keeps serving what it had; changes made meanwhile
    // (and forgotten by the server's history) arrive after it, without a flush.
    server.set_down(true);
    server.apply(web_slice(&node_name, &["backend-b"]));
    server.compact();
    eventually(&context("the agent notices the outage"), RECOVERY, || {
        if agent.log().contains("API error") {
            Ok(())
        } else {
            Err("no API error logged yet".into())
        }
    });
    served_by(client, 30, &["backend-a", "backend-b", "backend-c"])
        .unwrap_or_else(|e| panic!("{}: {e}", context("during the outage")));
    server.set_down(false);
    let took = eventually(&context("after the outage"), RECOVERY, || {
        served_by(client, 20, &["backend-b"])
    });
    eprintln!("the change made during the outage applied {took:?} after it ended");

    server.delete(Resource::EndpointSlices, "test", "web-1");
    eventually(&context("no endpoints"), CONVERGE, || {
        match tcp_request(client, VIP, TIMEOUT) {
            Outcome::Refused => Ok(()),
            other => Err(format!("not rejected: {other}")),
        }
    });

    server.delete(Resource::Services, "test", "web");
    eventually(&context("deleted"), CONVERGE, || {
        match tcp_request(client, VIP, Duration::from_millis(500)) {
            Outcome::Reply(_) | Outcome::Refused => {
                Err("the ClusterIP is still handled by the datapath".into())
            }
            _ => Ok(()),
        }
    });

    assert_eq!(agent.healthz(), "HTTP 200", "the agent stayed healthy");
    drop(agent);
    drop(server);
    drop(runtime);
}

/// What the agent programmed, as the pinned maps hold it.
fn pinned_state(bpf_root: &Path) -> (StoredState, BTreeMap<AffinityKey, AffinityValue>) {
    let maps = Maps::open_pinned(&PinLayout::new(bpf_root)).expect("the pinned maps");
    let services = maps.read_service_state().expect("reading the service maps");
    let affinity = maps
        .affinity
        .iter()
        .map(|entry| entry.expect("an AFFINITY entry"))
        .collect();
    (services, affinity)
}

/// The map operations each sync of an agent's log made, and those of
/// the garbage collection at its start.
fn logged_ops(log: &str) -> Vec<u64> {
    log.lines()
        .map(strip_ansi)
        .filter(|line| line.contains(" synced ") || line.contains("removed unreferenced"))
        .map(|line| {
            let ops = line
                .split_whitespace()
                .find_map(|field| field.strip_prefix("ops="))
                .unwrap_or_else(|| panic!("a sync logged without ops=: {line}"));
            ops.parse()
                .unwrap_or_else(|e| panic!("ops={ops} in {line:?}: {e}"))
        })
        .collect()
}

fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Service `name` of namespace test at `cluster_ip`, and one EndpointSlice
/// of it with endpoints `ips` on another node.
fn apply_remote_service(
    server: &apiserver::ApiServer,
    name: &str,
    cluster_ip: &str,
    ips: &[String],
) {
    server.apply(service("test", name, cluster_ip));
    let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
    server.apply(slice(
        "test",
        &format!("{name}-1"),
        name,
        "node-elsewhere",
        &ips,
    ));
}

/// Watches the pinned SERVICES map until stopped: every frontend of
/// `before` seen with fewer backends than it had there (or none).
fn watch_for_fewer_endpoints(
    bpf_root: PathBuf,
    before: BTreeMap<ServiceKey, u32>,
    stop: Arc<AtomicBool>,
) -> thread::JoinHandle<(usize, BTreeSet<String>)> {
    thread::spawn(move || {
        let (mut reads, mut fewer) = (0, BTreeSet::new());
        while !stop.load(Ordering::Relaxed) {
            let maps = Maps::open_pinned(&PinLayout::new(&bpf_root)).expect("the pinned maps");
            let now: BTreeMap<ServiceKey, u32> = maps
                .services
                .iter()
                .map(|entry| entry.expect("a SERVICES entry"))
                .map(|(key, value)| (key, value.count))
                .collect();
            reads += 1;
            for (key, count) in &before {
                let seen = now.get(key).copied();
                if seen.is_none_or(|n| n < *count) {
                    fewer.insert(format!(
                        "{}: {count} backends, then {}",
                        service_key_string(key),
                        seen.map_or("none".to_owned(), |n| n.to_string())
                    ));
                }
            }
            // The point: the map is sampled at a steady pace for as long as the
            // restart runs; what it looks for must never happen, so there is no
            // condition to wait for.
            thread::sleep(Duration::from_millis(2));
        }
        (reads, fewer)
    })
}

/// A restart on what an agent of the same version programmed makes no map
/// write, whichever initial listing arrives first, and passes through no
/// state with fewer endpoints: backend ids, service ids and the affinity
/// entries real traffic made stay as they were.
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom; its steps share the namespaces and agent it sets up"
)]
fn restarts_are_diffs_whichever_list_comes_first() {
    require_root().expect("privileged test");
    let sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let node_ns = &sb.topology().node;
    let client = &sb.client().ns;
    let node_name = node_ns.name().to_owned();
    let (runtime, server) = apiserver::serve_in(node_ns);
    server.apply(node(&node_name, Some("zone-a")));
    // Session affinity, so that traffic leaves AFFINITY entries.
    let mut web = service("test", "web", &CLUSTER_IP.to_string());
    web["spec"]["sessionAffinity"] = json!("ClientIP");
    server.apply(web);
    server.apply(web_slice(
        &node_name,
        &["backend-a", "backend-b", "backend-c"],
    ));
    // Topology hints: this node's zone has two of the three endpoints, so
    // the Service reads differently before the Node is known.
    server.apply(service("test", "zoned", "10.96.0.20"));
    let mut zoned = slice(
        "test",
        "zoned-1",
        "zoned",
        &node_name,
        &["10.200.0.11", "10.200.0.12", "10.200.0.13"],
    );
    for (endpoint, zone) in ["zone-a", "zone-b", "zone-a"].iter().enumerate() {
        zoned["endpoints"][endpoint]["hints"] = json!({"forZones": [{"name": zone}]});
    }
    server.apply(zoned);
    // More Services, so that a restart has work to redo if it redoes any.
    for n in 1..=50u8 {
        let name = format!("filler-{n}");
        let ips: Vec<String> = (1..=4).map(|i| format!("10.201.{n}.{i}")).collect();
        apply_remote_service(&server, &name, &format!("10.96.1.{n}"), &ips);
    }

    let mut agent = KubeAgent::start(node_ns, server.url());
    let context =
        |what: &str, agent: &KubeAgent| format!("{what} (agent /healthz: {})", agent.healthz());
    let mut sticky = String::new();
    eventually(&context("programmed", &agent), CONVERGE, || {
        let counts = backends_answering(client, 10)?;
        match counts.keys().collect::<Vec<_>>()[..] {
            [one] => {
                sticky = one.clone();
                Ok(())
            }
            _ => Err(format!(
                "session affinity: one backend should answer, not {counts:?}"
            )),
        }
    });
    let fresh_ops = logged_ops(&agent.log());
    eprintln!(
        "fresh start: {} map operations in {} syncs",
        fresh_ops.iter().sum::<u64>(),
        fresh_ops.len()
    );
    let (services, affinity) = pinned_state(agent.bpf_root());
    assert!(
        !affinity.is_empty(),
        "the client's connections left no AFFINITY entry"
    );
    let counts: BTreeMap<ServiceKey, u32> = services
        .services
        .iter()
        .map(|(key, value)| (*key, value.count))
        .collect();
    assert_eq!(
        counts.len(),
        52,
        "web, zoned and 50 fillers: one frontend each"
    );
    let zoned_count = counts.values().filter(|c| **c == 2).count();
    assert_eq!(
        zoned_count, 1,
        "zoned has its zone's two endpoints: {counts:?}"
    );

    // Every order is tried before any verdict, so that a failure shows
    // which orders go wrong.
    let mut wrong = Vec::new();
    for delayed in [
        Resource::EndpointSlices,
        Resource::Services,
        Resource::Nodes,
    ] {
        let what = format!("restart with the {} listing late", delayed.kind());
        let (services, affinity) = pinned_state(agent.bpf_root());
        let counts: BTreeMap<ServiceKey, u32> = services
            .services
            .iter()
            .map(|(key, value)| (*key, value.count))
            .collect();
        let first_request = server.requests().len();
        server.fail_next(delayed, Verb::List, Fault::Delay(Duration::from_secs(2)), 1);
        let stop = Arc::new(AtomicBool::new(false));
        let watcher =
            watch_for_fewer_endpoints(agent.bpf_root().to_path_buf(), counts, Arc::clone(&stop));
        agent.restart();
        // Healthy: past the first sync. Then past the late listing, and a
        // little longer for any sync that would follow it.
        eventually(
            &format!("{what}: the late listing answered"),
            RECOVERY,
            || {
                let answered = server.requests()[first_request..].iter().any(|r| {
                    r.resource == Some(delayed) && r.verb == Some(Verb::List) && r.status == 200
                });
                answered.then_some(()).ok_or_else(|| "not yet".to_owned())
            },
        );
        // The point: the watcher looks for a sync that must not come, which no
        // condition announces.
        thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        let (reads, fewer) = watcher.join().expect("the map watcher");

        let lists: Vec<Resource> = server.requests()[first_request..]
            .iter()
            .filter(|r| r.verb == Some(Verb::List) && r.status == 200)
            .filter_map(|r| r.resource)
            // ServiceCIDRs are listed beside, and gate no sync.
            .filter(|r| *r != Resource::ServiceCidrs)
            .collect();
        assert!(
            lists.len() == 3 && lists.last() == Some(&delayed),
            "{what}: the listings were answered in the order {lists:?}"
        );

        let ops = logged_ops(&agent.log());
        assert!(!ops.is_empty(), "{what}: no sync logged:\n{}", agent.log());
        eprintln!(
            "{what}: map operations per sync {ops:?}; {reads} reads of the maps, {} saw a frontend with fewer backends",
            if fewer.is_empty() { "none" } else { "some" }
        );
        let mut differs = Vec::new();
        if ops.iter().any(|n| *n > 0) {
            differs.push(format!("map operations per sync {ops:?}, want 0"));
        }
        if !fewer.is_empty() {
            differs.push(format!("frontends seen with fewer backends: {fewer:?}"));
        }
        let (services_now, affinity_now) = pinned_state(agent.bpf_root());
        if services_now != services {
            differs.push("the service maps changed (backend or service ids reassigned)".into());
        }
        if affinity_now != affinity {
            differs.push(format!(
                "AFFINITY changed from {affinity:?} to {affinity_now:?}"
            ));
        }
        if !differs.is_empty() {
            wrong.push(format!("{what}: {}", differs.join("; ")));
        }
    }
    assert!(
        wrong.is_empty(),
        "restarts on unchanged state were not diffs:\n{}",
        wrong.join("\n")
    );
    eventually(&context("after the restarts", &agent), CONVERGE, || {
        let counts = backends_answering(client, 10)?;
        if counts.keys().eq([&sticky]) {
            Ok(())
        } else {
            Err(format!(
                "affinity kept: {sticky} should answer alone, not {counts:?}"
            ))
        }
    });
    drop(agent);
    drop(server);
    drop(runtime);
}

/// One Service, web, served by backend-a through an agent started with
/// `extra_args`: the start of the full-map tests. Dropped in the order the
/// parts need: agent, API server, its runtime, the namespaces.
struct WebOnly {
    agent: KubeAgent,
    server: apiserver::ApiServer,
    _runtime: tokio::runtime::Runtime,
    sb: Sandbox,
}

impl WebOnly {
    fn start(extra_args: &[&str]) -> WebOnly {
        require_root().expect("privileged test");
        let sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
        let node_ns = &sb.topology().node;
        let node_name = node_ns.name().to_owned();
        let (runtime, server) = apiserver::serve_in(node_ns);
        server.apply(node(&node_name, None));
        server.apply(service("test", "web", &CLUSTER_IP.to_string()));
        server.apply(web_slice(&node_name, &["backend-a"]));
        let agent = KubeAgent::start_with(node_ns, server.url(), extra_args);
        eventually(
            &format!("web programmed (agent /healthz: {})", agent.healthz()),
            CONVERGE,
            || served_by(&sb.client().ns, 5, &["backend-a"]),
        );
        WebOnly {
            agent,
            server,
            _runtime: runtime,
            sb,
        }
    }
}

/// A Service whose backends the kernel refuses (BACKENDS full: E2BIG) waits,
/// counted, while /healthz turns 503 once it is overdue; when the map has
/// room again the agent's own retry programs it, with no event from the
/// API, and /healthz is 200 again.
#[test]
fn a_service_refused_by_a_full_map_lands_once_there_is_room() {
    // Health timeout 2 x 1 s.
    let web = WebOnly::start(&["--sync-period", "1s"]);
    let (client, server, agent) = (&web.sb.client().ns, &web.server, &web.agent);
    let context = |what: &str| format!("{what} (agent /healthz: {})", agent.healthz());

    // Fill BACKENDS with entries of ids the agent does not use, until the
    // kernel refuses one.
    let pins = PinLayout::new(agent.bpf_root());
    let mut maps = Maps::open_pinned(&pins).expect("the pinned maps");
    let fillers = fill_backends(&mut maps);
    // `status` shows how full each map is: this one is.
    let status =
        proxy_userspace::status::render(&pins, &proxy_userspace::status::Options::default())
            .expect("ebpf-proxy status");
    let fill = status
        .lines()
        .find(|l| l.starts_with("map fill BACKENDS: "))
        .unwrap_or_else(|| panic!("no BACKENDS fill in the status:\n{status}"));
    assert!(
        fill.ends_with(&format!("of {} (100.0%)", proxy_common::MAX_BACKENDS)),
        "BACKENDS is full, the status says {fill:?}"
    );

    let api_vip = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 30), 80);
    server.apply(service("test", "api", "10.96.0.30"));
    server.apply(slice(
        "test",
        "api-1",
        "api",
        web.sb.topology().node.name(),
        &["10.200.0.12", "10.200.0.13"],
    ));
    eventually(
        "/healthz 503 once the change is overdue",
        CONVERGE,
        || match agent.healthz().as_str() {
            "HTTP 503" => Ok(()),
            other => Err(format!("/healthz: {other}")),
        },
    );
    eventually(&context("the write refused and pending"), CONVERGE, || {
        let log = strip_ansi(&agent.log());
        if log.contains("write failed; retrying") && log.contains("pending=1") {
            Ok(())
        } else {
            Err("no failed write logged yet".into())
        }
    });
    served_by(client, 5, &["backend-a"])
        .unwrap_or_else(|e| panic!("{}: {e}", context("web while api waits")));
    let log = strip_ansi(&agent.log());
    let attempts = log.matches("write failed; retrying").count();
    assert!(
        attempts >= 2,
        "retried by the agent's timer, with no API event: {attempts} attempts\n{log}"
    );

    // Room for the two backends of api.
    for id in &fillers[..2] {
        maps.backends.remove(id).expect("remove a filler entry");
    }
    let took = eventually(
        &context("api programmed once there is room"),
        RECOVERY,
        || {
            let tally = tcp_tally(client, api_vip, 20, TIMEOUT).map_err(|e| format!("{e:#}"))?;
            let seen: Vec<&str> = tally.counts.keys().map(String::as_str).collect();
            if tally.failures.is_empty() && seen == ["backend-b", "backend-c"] {
                Ok(())
            } else {
                Err(format!(
                    "answered by {:?}, failures {:?}",
                    tally.counts, tally.failures
                ))
            }
        },
    );
    eprintln!("{attempts} failed attempts; landed {took:?} after the room was made");
    eventually("/healthz 200 again", CONVERGE, || {
        match agent.healthz().as_str() {
            "HTTP 200" => Ok(()),
            other => Err(format!("/healthz: {other}")),
        }
    });
    let log = strip_ansi(&agent.log());
    assert!(
        log.contains("programmed after retrying"),
        "the landing is logged:\n{log}"
    );
    drop(maps);
    drop(web);
}

/// Fills `BACKENDS` with entries of ids the agent does not use, until the
/// kernel refuses one; returns their ids.
fn fill_backends(maps: &mut Maps) -> Vec<u32> {
    let filler = proxy_common::Backend {
        addr_be: [
            0,
            0,
            0xffff_u32.to_be(),
            u32::from_ne_bytes([10, 254, 0, 1]),
        ],
        port_be: 9u16.to_be(),
        proto: 6,
        flags: 0,
    };
    let first_filler = 0x8000_0000u32;
    let mut id = first_filler;
    let refusal = loop {
        match maps.backends.insert(id, filler, 0) {
            Ok(()) => id += 1,
            Err(e) => break e,
        }
        assert!(
            id - first_filler <= proxy_common::MAX_BACKENDS,
            "BACKENDS took more than its capacity"
        );
    };
    eprintln!(
        "BACKENDS full after {} filler entries: {refusal}",
        id - first_filler
    );
    (first_filler..id).collect()
}

/// A sync of 1,200 new Services x 4 endpoints, its first batch of 1,024
/// frontends (over 8,000 entries) written on the agent's writer thread
/// while the rest are gathered, into a `BACKENDS` with room for 1,000
/// more: the first batch fails part-way through its backends, and the
/// second, which uses a backend the first took and never wrote, is failed
/// before it is written. Nothing
/// half-written is left for a packet to find, and everything lands once
/// there is room.
#[test]
fn a_failed_batch_written_behind_lands_once_there_is_room() {
    use aya::maps::IterableMap;
    const BULK: u32 = 1200;
    const SHARED_FROM: u32 = 800;
    // Changes within 8 s of a sync wait for the next: the bulk below is
    // one sync. (At 3 s, a loaded machine once took longer than that to
    // post the bulk, and its first 834 Services were synced alone.)
    let web = WebOnly::start(&["--sync-period", "1s", "--min-sync-period", "8s"]);
    let (client, server, agent) = (&web.sb.client().ns, &web.server, &web.agent);
    let context = |what: &str| format!("{what} (agent /healthz: {})", agent.healthz());

    // BACKENDS full, then room for 1,000.
    let pins = PinLayout::new(agent.bpf_root());
    let mut maps = Maps::open_pinned(&pins).expect("the pinned maps");
    let fillers = fill_backends(&mut maps);
    let room = 1000;
    let deleted = proxy_userspace::datapath::batch::delete(maps.backends.map(), &fillers[..room])
        .expect("room for 1,000 backends");
    assert_eq!(deleted, room, "fillers deleted to make room");

    // Named to sort as numbered. From bulk-0800 on, the fourth endpoint is
    // one address: its backend is first gathered past the point where the
    // first batch fails, and the second batch uses it too. Written after
    // that failure, the second would point at a backend that never landed.
    for n in 0..BULK {
        let name = format!("bulk-{n:04}");
        let (hi, lo) = (n / 250, n % 250 + 1);
        let ips: Vec<String> = (1..=4)
            .map(|i| match (i, n >= SHARED_FROM) {
                (4, true) => "10.201.255.1".to_owned(),
                _ => format!("10.{}.{lo}.{i}", 202 + hi),
            })
            .collect();
        apply_remote_service(server, &name, &format!("10.97.{hi}.{lo}"), &ips);
    }
    eventually(
        &context("the batch failed and the one after it not written"),
        RECOVERY,
        || {
            let log = strip_ansi(&agent.log());
            if log.contains("a batch of new frontends failed")
                && log.contains("the batch before, whose backends it may use, failed")
            {
                Ok(())
            } else {
                Err("no failed batch logged yet".into())
            }
        },
    );
    served_by(client, 5, &["backend-a"])
        .unwrap_or_else(|e| panic!("{}: {e}", context("web while the bulk waits")));

    let deleted = proxy_userspace::datapath::batch::delete(maps.backends.map(), &fillers[room..])
        .expect("the other fillers deleted");
    assert_eq!(deleted, fillers.len() - room, "fillers deleted");
    let took = eventually(
        &context("every bulk Service programmed once there is room"),
        RECOVERY,
        || {
            let (stored, _) = pinned_state(agent.bpf_root());
            stored
                .check_consistent()
                .map_err(|e| format!("a packet would see an inconsistent service: {e}"))?;
            let programmed = (0..BULK)
                .filter(|n| {
                    let ip = Ipv4Addr::new(10, 97, (n / 250) as u8, (n % 250 + 1) as u8);
                    stored.services.keys().any(|key| {
                        key.port_be == 80u16.to_be()
                            && key.addr_be[3] == u32::from_ne_bytes(ip.octets())
                    })
                })
                .count();
            if programmed == BULK as usize {
                Ok(())
            } else {
                Err(format!("{programmed} of {BULK} bulk Services programmed"))
            }
        },
    );
    eprintln!("every bulk Service landed {took:?} after the room was made");
    let (stored, _) = pinned_state(agent.bpf_root());
    assert_eq!(
        stored.backends.len(),
        // 400 Services' fourth endpoints are one backend.
        (BULK * 4 - (BULK - SHARED_FROM - 1) + 1) as usize,
        "every bulk endpoint and backend-a, nothing left over from the failed batches"
    );
    eventually("/healthz 200 again", RECOVERY, || {
        match agent.healthz().as_str() {
            "HTTP 200" => Ok(()),
            other => Err(format!("/healthz: {other}")),
        }
    });
    served_by(client, 5, &["backend-a"])
        .unwrap_or_else(|e| panic!("{}: {e}", context("web at the end")));
    drop(maps);
    drop(web);
}

/// `drop_unallocated` as the agent's pinned counters have it.
fn dropped_unallocated(bpf_root: &Path) -> u64 {
    let maps = Maps::open_pinned(&PinLayout::new(bpf_root)).expect("open the pinned maps");
    maps.counters()
        .expect("read the counters")
        .into_iter()
        .find(|(name, _)| *name == "drop_unallocated")
        .map_or(0, |(_, n)| n)
}

/// Whether a connection to `ip` goes unanswered and is counted dropped.
fn dropped_at(client: &NetNs, bpf_root: &Path, ip: Ipv4Addr) -> Result<(), String> {
    let before = dropped_unallocated(bpf_root);
    let outcome = tcp_request(
        client,
        SocketAddrV4::new(ip, 80),
        Duration::from_millis(300),
    );
    let after = dropped_unallocated(bpf_root);
    match outcome {
        Outcome::Timeout if after > before => Ok(()),
        other => Err(format!(
            "{ip}: {other}, drop_unallocated {before} -> {after}"
        )),
    }
}

/// The service CIDRs come from the API's `ServiceCIDR` objects, and from
/// `--service-cluster-ip-range` once the API has none: an address of the CIDRs in
/// force that no Service holds gets no answer (dropped, counted); one of the other
/// range is not dropped meanwhile, nor the ClusterIP of a Service another proxy
/// serves.
#[test]
fn service_cidrs_follow_the_api_and_fall_back_to_the_flag() {
    require_root().expect("privileged test");
    let sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    let node_ns = &sb.topology().node;
    let client = &sb.client().ns;
    let node_name = node_ns.name().to_owned();
    let (runtime, server) = apiserver::serve_in(node_ns);
    server.apply(node(&node_name, Some("zone-a")));
    server.apply(service("test", "web", &CLUSTER_IP.to_string()));
    server.apply(web_slice(&node_name, &["backend-a"]));
    server.apply(apiserver::service_cidr("kubernetes", &["10.96.0.0/16"]));
    let agent = KubeAgent::start_with(
        node_ns,
        server.url(),
        &["--service-cluster-ip-range", "10.200.0.0/16"],
    );
    let root = agent.bpf_root().to_owned();
    let (in_api, in_flag) = (Ipv4Addr::new(10, 96, 0, 77), Ipv4Addr::new(10, 200, 0, 77));
    eventually("the Service served", CONVERGE, || {
        served_by(client, 5, &["backend-a"])
    });
    eventually("the API's CIDR in force", CONVERGE, || {
        dropped_at(client, &root, in_api)
    });
    let outside = dropped_at(client, &root, in_flag);
    assert!(
        outside.is_err(),
        "the flag's range is not in force while the API has ServiceCIDRs: {outside:?}"
    );

    // Another proxy's Service: its ClusterIP is passed on, for that proxy.
    let foreign = Ipv4Addr::new(10, 96, 0, 50);
    let mut other = service("test", "other", &foreign.to_string());
    other["metadata"]["labels"] =
        json!({"service.kubernetes.io/service-proxy-name": "other-proxy"});
    server.apply(other);
    eventually(
        "another proxy's ClusterIP passed",
        CONVERGE,
        || match dropped_at(client, &root, foreign) {
            Ok(()) => Err(format!("{foreign} still dropped")),
            Err(_) => Ok(()),
        },
    );

    server.delete(Resource::ServiceCidrs, "", "kubernetes");
    eventually("the flag's CIDR in force", CONVERGE, || {
        dropped_at(client, &root, in_flag)
    });
    assert!(
        dropped_at(client, &root, in_api).is_err(),
        "the deleted ServiceCIDR's range is no longer in force"
    );
    served_by(client, 5, &["backend-a"]).expect("the Service is still served");
    assert_eq!(agent.healthz(), "HTTP 200", "the agent stayed healthy");
    drop(agent);
    drop(server);
    drop(runtime);
}
