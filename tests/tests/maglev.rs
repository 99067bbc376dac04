//! Maglev in the kernel. On hand-built frames through `BPF_PROG_TEST_RUN`:
//! two datapaths on bpffs roots of their own stand for two nodes, each
//! programmed by its own planner with the same Service (learnt in another
//! order, its backends given other ids). The same new flows must reach the
//! same backends through both, the backend user space predicts from the
//! flow's hash and the table, and the same again after one "node" is
//! reloaded from nothing (its conntrack lost, as an agent restart on a new
//! node or an eviction loses it). On real connections: two agents
//! (`ebpf-proxy run --lb-algorithm maglev`) on the two nodes of the
//! `cluster` topology, a client reaching the NodePort of each from the same
//! source ports. Needs root.

use std::net::{IpAddr, Ipv4Addr, SocketAddrV4};

use ebpf_proxy_tests::{
    POLL, Protocol as WireProtocol,
    agent::Agent,
    client::{Outcome, TIMEOUT, tcp_request_from_port_here},
    cluster::Cluster,
    family::Family,
    frames::{self as frame, Spec, build, parse_checked},
    manifest::{ManifestDir, ServiceType},
    require_root,
    servers::TcpServer,
    topology::two_node::CLIENT1,
    wait_for,
};
use proxy_userspace::{
    datapath::{Datapath, PinLayout},
    maglev::{self, BackendName, LbAlgorithm, LbConfig},
    model::{BackendAddr, Frontend, FrontendKind, Protocol, ServicePortName},
    planner::{Planner, encode},
    source::ObjectKey,
};

// How tc passes a packet: tcx's `TCX_NEXT` (-1), on to the interface's
// next program and legacy filters, as the kernel's test run reports it.
use ebpf_proxy_tests::fuzz::verdict::TCX_NEXT as TC_PASS;
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
    // The flows' marks as the agent's housekeeping leaves them once its
    // programs run: what conntrack holds, so that every flow a test makes
    // must mark its own replies.
    proxy_userspace::datapath::prefilter_rebuild::settle(&datapath.maps)
        .expect("settling the prefilter's flow marks");
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
        result.return_value, TC_PASS,
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

/// The backend that answers a connection from `port` of the client to
/// `node`:`NODE_PORT`.
fn served_by(cluster: &Cluster, port: u16, node: Ipv4Addr) -> Result<String, String> {
    let to = SocketAddrV4::new(node, NODE_PORT);
    match cluster
        .client(CLIENT1.0)
        .ns
        .run(|| tcp_request_from_port_here(port, to, TIMEOUT))
    {
        Ok(Outcome::Reply(reply)) => Ok(reply.backend),
        Ok(other) => Err(format!("from port {port} to {to}: {other}")),
        Err(e) => Err(format!("from port {port} to {to}: {e:#}")),
    }
}

const NODE_PORT: u16 = 30080;
const POD_A: (&str, Ipv4Addr) = ("mg-a1", Ipv4Addr::new(10, 1, 1, 10));
const POD_B: (&str, Ipv4Addr) = ("mg-b1", Ipv4Addr::new(10, 1, 2, 10));
/// Source ports compared through both nodes before the restart, and those
/// compared after it (used through node B only before).
const COMPARED: std::ops::Range<u16> = 21_000..22_000;
const AFTER_RESTART: std::ops::Range<u16> = 23_000..23_300;

/// The `cluster` topology with a backend pod on each node and an agent on
/// each node balancing by Maglev, serving [`NODE_PORT`] (both answer).
struct World {
    cluster: Cluster,
    _servers: Vec<TcpServer>,
    manifests: ManifestDir,
    agents: Vec<Agent>,
    xdp_mode: &'static str,
}

impl World {
    /// The world with the agents' XDP as `xdp_mode` says (`--xdp-mode`).
    fn new(xdp_mode: &'static str) -> World {
        require_root().expect("privileged test");
        let cluster = Cluster::new(&[("a", &[POD_A]), ("b", &[POD_B])]).expect("two-node cluster");
        let servers = [POD_A, POD_B]
            .iter()
            .map(|(name, _)| {
                TcpServer::start(&cluster.pod(name).ns, name, TARGET).expect("backend")
            })
            .collect();
        let manifests = ManifestDir::create(cluster.stem()).expect("manifest dir");
        let mut world = World {
            cluster,
            _servers: servers,
            manifests,
            agents: Vec::new(),
            xdp_mode,
        };
        world.agents = vec![world.start("a"), world.start("b")];
        let service = <Ipv4Addr as Family>::service("test", "mg", <Ipv4Addr as Family>::vip(60))
            .type_(ServiceType::NodePort)
            .port("http", PORT, WireProtocol::Tcp, TARGET)
            .node_port("http", NODE_PORT);
        let names = [
            world.cluster.node("a").ns.name().to_owned(),
            world.cluster.node("b").ns.name().to_owned(),
        ];
        let on_nodes = [(POD_A.1, names[0].as_str()), (POD_B.1, names[1].as_str())];
        world
            .manifests
            .write(
                "mg.yaml",
                &<Ipv4Addr as Family>::yaml_on_nodes(&service, &on_nodes),
            )
            .expect("write manifest");
        world.wait_served("a", 20_000);
        world.wait_served("b", 20_300);
        world
    }

    fn start(&self, node: &str) -> Agent {
        let args = ["--xdp-mode", self.xdp_mode, "--lb-algorithm", "maglev"];
        Agent::start_with(&self.cluster.node(node).ns, self.manifests.path(), &args)
            .unwrap_or_else(|e| panic!("agent on node {node}: {e:#}"))
    }

    fn ip(&self, node: &str) -> Ipv4Addr {
        self.cluster.node(node).ip
    }

    /// Waits until `node` serves the NodePort, trying client ports from
    /// `first` on (kept apart from the compared ones).
    fn wait_served(&self, node: &str, first: u16) {
        let mut port = first;
        wait_for(std::time::Duration::from_secs(15), POLL, || {
            port += 1;
            served_by(&self.cluster, port, self.ip(node))
        })
        .unwrap_or_else(|e| panic!("the NodePort on node {node} never answered: {e:?}"));
    }
}

/// The backend user space predicts for client port `port`: the flow's hash
/// in the table over the two backends' names.
fn predicted_pod(port: u16) -> String {
    let named = [POD_A, POD_B].map(|(name, ip)| {
        let b = BackendAddr::remote(IpAddr::V4(ip), TARGET, Protocol::Tcp);
        (encode::backend_name(&b), name.to_owned())
    });
    let table = maglev::build(&named, lb().table_size, lb().hash_seed);
    let hash = maglev::flow_hash(
        proxy_common::v4_mapped(u32::from_ne_bytes(CLIENT1.1.octets())),
        port.to_be(),
        NODE_PORT.to_be(),
        proxy_common::PROTO_TCP,
        lb().hash_seed,
    );
    table[(hash % lb().table_size) as usize].clone()
}

#[test]
fn two_agents_send_the_same_client_port_to_the_same_backend_tc_only() {
    two_agents_send_the_same_client_port_to_the_same_backend_and_again_after_a_restart("off");
}

#[test]
fn two_agents_send_the_same_client_port_to_the_same_backend_native_xdp() {
    two_agents_send_the_same_client_port_to_the_same_backend_and_again_after_a_restart("native");
}

fn two_agents_send_the_same_client_port_to_the_same_backend_and_again_after_a_restart(
    xdp_mode: &'static str,
) {
    let mut world = World::new(xdp_mode);
    let (node_a, node_b) = (world.ip("a"), world.ip("b"));
    let mut differ = Vec::new();
    let mut mispredicted = Vec::new();
    let mut through_b = std::collections::BTreeMap::new();
    for port in COMPARED.chain(AFTER_RESTART) {
        let b = served_by(&world.cluster, port, node_b).unwrap_or_else(|e| panic!("{e}"));
        let want = predicted_pod(port);
        if b != want {
            mispredicted.push(format!("port {port}: node b {b}, predicted {want}"));
        }
        through_b.insert(port, b);
    }
    for port in COMPARED {
        let a = served_by(&world.cluster, port, node_a).unwrap_or_else(|e| panic!("{e}"));
        if a != through_b[&port] {
            differ.push(format!(
                "port {port}: node a {a}, node b {}",
                through_b[&port]
            ));
        }
    }
    let seen: std::collections::BTreeSet<&String> = through_b.values().collect();
    eprintln!(
        "--xdp-mode {xdp_mode}: {} client ports through both nodes: {} picked differently, {} not as predicted; backends {seen:?}",
        COMPARED.len(),
        differ.len(),
        mispredicted.len()
    );
    assert!(
        differ.is_empty(),
        "{} of {} client ports reached another backend through node a than through node b: {:?}",
        differ.len(),
        COMPARED.len(),
        &differ[..differ.len().min(5)]
    );
    assert!(
        mispredicted.is_empty(),
        "{} picks differ from user space's prediction: {:?}",
        mispredicted.len(),
        &mispredicted[..mispredicted.len().min(5)]
    );
    assert_eq!(seen.len(), 2, "both backends serve");
    let status = world.agents[1].status().expect("node b's status");
    assert!(
        status.contains("maglev"),
        "node b's status marks its NodePort maglev: {status}"
    );

    // Node a's agent stops and its pins go (conntrack with them), then a
    // new one starts: new flows still pick as node b does.
    world.agents[0].terminate().expect("stopping agent a");
    world.agents[0].cleanup().expect("cleaning up agent a");
    world.agents[0] = world.start("a");
    world.wait_served("a", 20_700);
    let moved: Vec<String> = AFTER_RESTART
        .filter_map(|port| {
            let a = served_by(&world.cluster, port, node_a).unwrap_or_else(|e| panic!("{e}"));
            (a != through_b[&port])
                .then(|| format!("port {port}: node a {a}, node b {}", through_b[&port]))
        })
        .collect();
    assert!(
        moved.is_empty(),
        "after agent a's restart {} of {} client ports reached another backend than through node b: {:?}",
        moved.len(),
        AFTER_RESTART.len(),
        &moved[..moved.len().min(5)]
    );
}
