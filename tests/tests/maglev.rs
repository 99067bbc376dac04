//! Maglev in the kernel, on hand-built frames through `BPF_PROG_TEST_RUN`:
//! two datapaths on bpffs roots of their own stand for two nodes, each
//! programmed by its own planner with the same Service (learnt in another
//! order, its backends given other ids). The same new flows must reach the
//! same backends through both, the backend user space predicts from the
//! flow's hash and the table, and the same again after one "node" is
//! reloaded from nothing (its conntrack lost, as an agent restart on a new
//! node or an eviction loses it). Needs root.

use std::net::{IpAddr, Ipv4Addr};

use ebpf_proxy_tests::{
    agent::Agent,
    frames::{self as frame, Spec, build, parse_checked},
};
use proxy_userspace::{
    datapath::{Datapath, PinLayout},
    maglev::{self, BackendName, LbAlgorithm, LbConfig},
    model::{BackendAddr, Frontend, FrontendKind, Protocol, ServicePortName},
    planner::{Planner, encode},
    source::ObjectKey,
};

const TC_ACT_OK: u32 = 0;
const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 10);
const PORT: u16 = 80;
const TARGET: u16 = 8080;
const FLOWS: u32 = 1200;

fn backend_ips() -> Vec<Ipv4Addr> {
    (1..=7).map(|i| Ipv4Addr::new(10, 244, 1, i * 3)).collect()
}

fn lb() -> LbConfig {
    LbConfig {
        algorithm: LbAlgorithm::Maglev,
        ..LbConfig::default()
    }
}

/// One "node": a datapath on its own pins, removed on drop even when the
/// test panics.
struct Node {
    datapath: Datapath,
    pins: PinLayout,
    planner: Planner,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = proxy_userspace::datapath::cleanup(&self.pins);
    }
}

fn external(ip: Ipv4Addr, port: u16, backends: &[Ipv4Addr]) -> Frontend {
    let backends = backends
        .iter()
        .map(|b| BackendAddr {
            // On this node: no SNAT, so the output frame shows the pick.
            local: true,
            ..BackendAddr::remote(IpAddr::V4(*b), TARGET, Protocol::Tcp)
        })
        .collect();
    let service = ServicePortName::new("test", &ip.to_string(), "http", Protocol::Tcp);
    Frontend {
        kind: FrontendKind::ExternalIp,
        ..Frontend::cluster_ip(service, IpAddr::V4(ip), port, backends)
    }
}

/// A node that programs `first` (other Services, taking ids first) then
/// the Service with its backends in `order`.
fn node(first: &[Frontend], order: &[Ipv4Addr]) -> Node {
    let root = Agent::unique_bpf_root();
    let pins = PinLayout::new(&root);
    let datapath = Datapath::load(pins.clone()).unwrap_or_else(|e| {
        let _ = proxy_userspace::datapath::cleanup(&pins);
        panic!("loading the datapath under {}: {e}", root.display())
    });
    let mut node = Node {
        datapath,
        pins,
        planner: Planner::new(),
    };
    node.planner.balance_with(lb());
    for (i, fe) in first
        .iter()
        .chain([&external(EXTERNAL_IP, PORT, order)])
        .enumerate()
    {
        let owner = ObjectKey {
            namespace: "test".into(),
            name: format!("svc{i}-{}", fe.key),
        };
        let out =
            node.planner
                .sync_service(&owner, std::slice::from_ref(fe), &mut node.datapath.maps);
        assert!(
            out.errors.is_empty(),
            "programming {}: {:?}",
            fe.key,
            out.errors
        );
    }
    node
}

/// The `i`th test flow: (client, source port).
fn flow(i: u32) -> (Ipv4Addr, u16) {
    (
        Ipv4Addr::from(u32::from(Ipv4Addr::new(203, 0, 113, 1)) + i % 200),
        1024 + (i * 7919 % 60_000) as u16,
    )
}

/// The backend `node`'s tc program sends a new TCP flow to.
fn pick(node: &Node, client: Ipv4Addr, sport: u16) -> Ipv4Addr {
    let input = build(&Spec {
        src: client,
        dst: EXTERNAL_IP,
        sport,
        dport: PORT,
        proto: frame::TCP,
        tcp_flags: frame::SYN,
        payload: vec![],
        udp_no_csum: false,
    });
    let mut out = vec![0u8; input.len() + 256];
    let mut opts = aya::programs::TestRunOptions::new();
    opts.data_in = Some(&input);
    opts.data_out = Some(&mut out);
    let result = aya::programs::TestRun::test_run(node.datapath.tc_program(), opts)
        .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN: {e}"));
    out.truncate(result.data_size_out as usize);
    assert_eq!(
        result.return_value, TC_ACT_OK,
        "SYN from {client}:{sport}: verdict"
    );
    let p = parse_checked(&out, "DNATed SYN");
    assert_eq!(p.dport, TARGET, "SYN from {client}:{sport}: not DNATed");
    p.dst
}

/// What user space predicts: the flow's hash modulo the table size, in the
/// table built from the backends' names.
fn predicted(table: &[Ipv4Addr], client: Ipv4Addr, sport: u16) -> Ipv4Addr {
    let lb = lb();
    let hash = maglev::flow_hash(
        proxy_common::v4_mapped(u32::from_ne_bytes(client.octets())),
        sport.to_be(),
        PORT.to_be(),
        proxy_common::PROTO_TCP,
        lb.hash_seed,
    );
    table[(hash % lb.table_size) as usize]
}

fn table(backends: &[Ipv4Addr]) -> Vec<Ipv4Addr> {
    let lb = lb();
    let fe = external(EXTERNAL_IP, PORT, backends);
    let named: Vec<(BackendName, Ipv4Addr)> = fe
        .backends
        .iter()
        .map(|b| match b.ip {
            IpAddr::V4(ip) => (encode::backend_name(b), ip),
            IpAddr::V6(_) => unreachable!("IPv4 backends"),
        })
        .collect();
    maglev::build(&named, lb.table_size, lb.hash_seed)
}

fn picks(node: &Node) -> Vec<Ipv4Addr> {
    (0..FLOWS)
        .map(|i| {
            let (client, sport) = flow(i);
            pick(node, client, sport)
        })
        .collect()
}

/// The kernel memory `BACKEND_SLOTS` holds (`bpftool`'s `bytes_memlock`,
/// which counts a hash map's elements as they are allocated).
fn slots_memory(node: &Node) -> u64 {
    let path = node.pins.map(proxy_common::map_names::BACKEND_SLOTS);
    let out = std::process::Command::new("bpftool")
        .args(["map", "show", "pinned"])
        .arg(&path)
        .arg("-j")
        .output()
        .expect("running bpftool");
    let text = String::from_utf8_lossy(&out.stdout);
    let at = text
        .find("\"bytes_memlock\":")
        .unwrap_or_else(|| panic!("bpftool map show {}: {text}", path.display()));
    text[at + 16..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .expect("bytes_memlock is a number")
}

/// Where `a` and `b` differ, for a message.
fn differences(a: &[Ipv4Addr], b: &[Ipv4Addr]) -> (usize, Vec<String>) {
    let all: Vec<String> = (0..FLOWS)
        .filter(|i| a[*i as usize] != b[*i as usize])
        .map(|i| {
            let (client, sport) = flow(i);
            format!("{client}:{sport} -> {} vs {}", a[i as usize], b[i as usize])
        })
        .collect();
    (all.len(), all.into_iter().take(5).collect())
}

#[test]
fn two_nodes_and_a_restart_pick_the_same_backends_as_user_space_predicts() {
    let backends = backend_ips();
    let mut reversed = backends.clone();
    reversed.reverse();
    let other = external(Ipv4Addr::new(192, 168, 77, 20), 443, &reversed[2..]);

    let node_a = node(&[], &backends);
    let node_b = node(std::slice::from_ref(&other), &reversed);
    let table = table(&backends);
    let want: Vec<Ipv4Addr> = (0..FLOWS)
        .map(|i| {
            let (client, sport) = flow(i);
            predicted(&table, client, sport)
        })
        .collect();

    // Node B holds one table more than node A (`other`'s).
    let (one, two) = (slots_memory(&node_a), slots_memory(&node_b));
    eprintln!(
        "BACKEND_SLOTS: {one} bytes with one table of {}, {two} with two: {} bytes a table",
        lb().table_size,
        two.saturating_sub(one)
    );

    let through_a = picks(&node_a);
    let through_b = picks(&node_b);
    let (n, some) = differences(&through_a, &want);
    assert_eq!(
        n, 0,
        "node A's kernel picks differ from user space's prediction for {n} of {FLOWS} flows: {some:?}"
    );
    let (n, some) = differences(&through_a, &through_b);
    assert_eq!(
        n, 0,
        "nodes A and B pick differently for {n} of {FLOWS} flows: {some:?}"
    );
    let used: std::collections::BTreeSet<_> = through_a.iter().collect();
    assert_eq!(
        used.len(),
        backends.len(),
        "{FLOWS} flows reach every backend: {used:?}"
    );

    // Node A restarts from nothing: new pins, conntrack empty, ids handed
    // out anew (another Service first).
    drop(node_a);
    let node_a = node(std::slice::from_ref(&other), &backends);
    let again = picks(&node_a);
    let (n, some) = differences(&through_a, &again);
    assert_eq!(
        n, 0,
        "after node A's restart {n} of {FLOWS} flows moved: {some:?}"
    );
    eprintln!(
        "{FLOWS} flows over {} backends: the same backend through both nodes, as predicted, and after a restart",
        backends.len()
    );
}

#[test]
fn conntrack_comes_first_and_a_removed_backend_moves_only_its_flows() {
    let backends = backend_ips();
    let mut node = node(&[], &backends);
    let before = picks(&node);

    let removed = backends[3];
    let rest: Vec<Ipv4Addr> = backends.iter().copied().filter(|b| *b != removed).collect();
    let owner = ObjectKey {
        namespace: "test".into(),
        name: format!("svc0-{}", external(EXTERNAL_IP, PORT, &rest).key),
    };
    let started = std::time::Instant::now();
    let out = node.planner.sync_service(
        &owner,
        &[external(EXTERNAL_IP, PORT, &rest)],
        &mut node.datapath.maps,
    );
    eprintln!(
        "a backend removed: table built, written, flipped and the old one deleted in {:?} ({} map operations)",
        started.elapsed(),
        out.ops
    );
    assert!(out.errors.is_empty(), "reprogramming: {:?}", out.errors);

    // The same tuples again: a flow conntrack holds keeps its backend,
    // the removed one included (its purge is the agent's housekeeping,
    // not run here).
    let held = picks(&node);
    let (n, some) = differences(&before, &held);
    assert_eq!(
        n, 0,
        "{n} of {FLOWS} flows conntrack holds changed backend: {some:?}"
    );

    // New flows (other source ports) follow the new table: only the
    // removed backend's share, and about 1/N + 1% at most, moves.
    let table_before = table(&backends);
    let table_after = table(&rest);
    let mut moved = 0;
    let mut others_moved = 0;
    for i in 0..FLOWS {
        let (client, sport) = flow(i);
        let sport = sport.wrapping_add(1);
        let was = predicted(&table_before, client, sport);
        let now = pick(&node, client, sport);
        assert_eq!(
            now,
            predicted(&table_after, client, sport),
            "new flow {client}:{sport}: the kernel's pick is not the new table's"
        );
        assert_ne!(
            now, removed,
            "new flow {client}:{sport} reached the removed backend"
        );
        if now != was {
            moved += 1;
            if was != removed {
                others_moved += 1;
            }
        }
    }
    let share = f64::from(moved) / f64::from(FLOWS);
    let bound = 1.0 / backends.len() as f64 + 0.01 + 0.03;
    eprintln!(
        "removing 1 of {}: {:.2}% of {FLOWS} new flows moved, {others_moved} of them off a surviving backend",
        backends.len(),
        share * 100.0
    );
    // 1/N + 1%, plus the sampling error of 1200 flows (3 standard errors).
    assert!(
        share <= bound,
        "{:.2}% of new flows moved, over {:.2}%",
        share * 100.0,
        bound * 100.0
    );
}
