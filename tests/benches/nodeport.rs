//! NodePort new-connection rate and latency on real packets, through XDP, through tc
//! and through kube-proxy's iptables rules, with S Services installed, in the two-node
//! topology of docs/architecture.md (test topologies) (tests/src/cluster.rs).
//!
//! `client1` (192.168.50.100, outside the cluster) opens short TCP connections to node
//! a's address 192.168.50.1 on the measured Service's nodePort. Node a has no endpoint
//! of its own (externalTrafficPolicy Cluster): it translates to the one backend pod,
//! on node b (10.1.2.10:8080), with SNAT to its own address, and the replies come back
//! the same way. Four datapaths, side by side in one run:
//!
//! - `ebpf-proxy XDP`: the agent on both nodes with `--xdp-mode native`;
//! - `ebpf-proxy tc`: the same with `--xdp-mode off`;
//! - `ebpf-proxy DSR`: `--xdp-mode native --lb-mode dsr` on both nodes: node a keeps
//!   client1's address and sends the flow to node b with the NodePort in an IP option
//!   (XDP adds it and sends the packet itself); the backend's replies leave node b straight
//!   to client1, never crossing node a;
//! - `kube-proxy iptables`: kube-proxy's iptables-mode nat table with NodePorts
//!   (tests/src/iptables.rs: KUBE-NODEPORTS, KUBE-EXT, KUBE-MARK-MASQ and the
//!   masquerade in KUBE-POSTROUTING) loaded on both nodes with `iptables-restore`, no
//!   agent: node a DNATs and masquerades;
//! - `no LB (routed)`: no translation at all, the limit of routing alone. client1 has
//!   a route to node b's pod CIDR via node a, node b a route back to client1 via node
//!   a, and client1 connects to the pod's own address: the packets take the same hops
//!   (client1, node a, node b, the pod, and back through node a) with nothing but
//!   forwarding on the way.
//!
//! The Services: S of them (10 and 10,000; `--quick`: 10 and 1,000), each with a
//! ClusterIP and port 80 to 8080. The default NodePort range 30000-32767 holds only
//! 2,768 ports, so min(S, 2,768) Services are NodePorts, a band of consecutive Services
//! centred on the measured one (which sits in the middle of the S, as in e2e.rs), and
//! the others are ClusterIP only. For kube-proxy that is the cost that matters: a
//! NodePort packet walks every ClusterIP rule of KUBE-SERVICES before its last rule
//! sends it to KUBE-NODEPORTS, where it walks half of the NodePort rules. Every Service
//! but the measured one has three endpoints at addresses that exist nowhere.
//!
//! ICMP redirects are off on the nodes and ignored by the client, in every mode: node a
//! forwards the no-LB mode's packets out of the interface they came in on, and a
//! redirect would send client1 straight to node b.
//!
//! The rest is e2e.rs's method (shared in benches/common): a closed loop of T client
//! threads in client1, each exchange a connect, one request, one response and a close
//! with RST, its latency from the start of connect to the response; the modes built
//! first, then measured in interleaved rounds (the order rotating each round); rates
//! and percentiles over all rounds, ratios the median of per-round ratios. After the
//! rounds, node a's counters of the ebpf-proxy modes are read and reported, and so is
//! what node a's uplink carried per connection (packets and bytes in and out, from its
//! interface counters after the warm-up and after the rounds): the entry node's work
//! per connection, which DSR halves. Then a few more rounds of the ebpf-proxy modes
//! alone, with the kernel's BPF run-time statistics on, time node a's programs: the
//! entry node's datapath CPU per connection. The XDP mode must show packets XDP sent
//! itself (`xdp_tx`), and every ebpf-proxy mode a timing of node a's programs, or the
//! run fails; so it does when an ebpf-proxy mode loses more than 1% of its connections
//! (after the result files are written).
//!
//! Everything is bounded: fixed durations, a cap on exchanges per thread, 1 s I/O
//! timeouts; traffic only ever goes to addresses inside the benchmark's namespaces.
//! Namespaces, servers and agents are removed on drop, also on an error or Ctrl-C.
//!
//! Usage: `cargo bench -p ebpf-proxy-tests --bench nodeport -- [--quick] [--out DIR]
//! [--sizes 10,10000] [--rounds N] [--threads N]` (root; the agent binary from `cargo
//! xtask build` or $`EBPF_PROXY_BIN`). Prints a markdown table and writes `nodeport.md`
//! and `nodeport.json` to DIR (default bench/results).

mod common;
#[path = "common/program_time.rs"]
mod program_time;

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use common::{Args, BenchMode, Machine, Rows, check_interrupted, interleaved, load_average};
use ebpf_proxy_tests::{
    NotYet, Protocol,
    agent::{self, Agent},
    cluster::{CLIENT1, Cluster, NODE_A_IP, UPLINK},
    iptables::{self, KubeService},
    load::Load,
    manifest::{Endpoint, ManifestDir, Service, ServiceType},
    require_root,
    servers::PooledBackend,
    topology::one_node,
    wait_for,
};
use program_time::HookTimes;
use proxy_userspace::datapath::{Maps, PinLayout};
use serde_json::json;

/// The one backend pod, on node b.
const BACKEND: (&str, Ipv4Addr) = ("web-b1", Ipv4Addr::new(10, 1, 2, 10));
const TARGET_PORT: u16 = 8080;
const SERVICE_PORT: u16 = 80;
/// The default `--service-node-port-range`, 30000-32767.
const NODE_PORT_MIN: u16 = 30_000;
const NODE_PORT_MAX: u16 = 32_767;
/// How many Services can be NodePorts: 2,768.
const NODE_PORT_SLOTS: u32 = (NODE_PORT_MAX - NODE_PORT_MIN) as u32 + 1;
/// Endpoints of every Service but the measured one.
const FILLER_ENDPOINTS: u32 = 3;
/// Server threads of the backend pod.
const BACKEND_THREADS: usize = 4;
/// Connections per mode before measuring, one at a time: fills neighbour caches and
/// checks that the mode works.
const WARMUP: usize = 60;
/// How long a mode has to answer its first connection.
const FIRST_ANSWER: Duration = Duration::from_secs(10);
/// An ebpf-proxy mode losing more connections than this fails the run.
const MAX_FAILURE_RATE: f64 = 0.01;
/// Rounds per ebpf-proxy mode of the phase that times node a's programs, after the
/// measured rounds (see [`datapath_time`]).
const CPU_ROUNDS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Xdp,
    Tc,
    Dsr,
    Iptables,
    Direct,
}

impl Mode {
    const ALL: [Mode; 5] = [Mode::Direct, Mode::Iptables, Mode::Tc, Mode::Xdp, Mode::Dsr];

    /// The agent's `--xdp-mode`, for the ebpf-proxy modes.
    fn xdp_mode(self) -> Option<&'static str> {
        match self {
            Mode::Xdp | Mode::Dsr => Some("native"),
            Mode::Tc => Some("off"),
            Mode::Iptables | Mode::Direct => None,
        }
    }
}

impl BenchMode for Mode {
    const IPTABLES: Mode = Mode::Iptables;
    const DIRECT: Mode = Mode::Direct;

    fn label(self) -> &'static str {
        match self {
            Mode::Xdp => "ebpf-proxy XDP",
            Mode::Tc => "ebpf-proxy tc",
            Mode::Dsr => "ebpf-proxy DSR",
            Mode::Iptables => "kube-proxy iptables",
            Mode::Direct => "no LB (routed)",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Mode::Xdp => "xdp",
            Mode::Tc => "tc",
            Mode::Dsr => "dsr",
            Mode::Iptables => "iptables",
            Mode::Direct => "direct",
        }
    }
}

#[derive(Debug, Clone)]
struct Config {
    quick: bool,
    sizes: Vec<u32>,
    rounds: usize,
    segment: Duration,
    threads: usize,
}

impl Config {
    fn new(quick: bool) -> Config {
        let threads = common::default_threads();
        if quick {
            // About half a minute in all.
            Config {
                quick,
                sizes: vec![10, 1_000],
                rounds: 8,
                segment: Duration::from_millis(150),
                threads,
            }
        } else {
            Config {
                quick,
                sizes: vec![10, 10_000],
                rounds: 16,
                segment: Duration::from_millis(300),
                threads,
            }
        }
    }
}

fn main() {
    common::main_with("nodeport", |args| {
        let (cfg, out_dir) = parse_args(args)?;
        run(&cfg, &out_dir)
    });
}

/// `--quick`, `--out DIR`, and for experiments `--sizes 10,1000`, `--rounds N`,
/// `--threads N`. Anything else (cargo passes `--bench`) is ignored.
fn parse_args(args: &Args) -> Result<(Config, PathBuf)> {
    let mut cfg = Config::new(args.flag("--quick"));
    args.overrides(&mut cfg.sizes, &mut cfg.rounds, &mut cfg.threads)?;
    Ok((cfg, args.out_dir()?))
}

fn run(cfg: &Config, out_dir: &Path) -> Result<()> {
    require_root()?;
    let started = Instant::now();
    let bin = agent::binary()?;
    eprintln!("agent binary: {}", bin.display());
    common::install_signal_handlers()?;
    let machine = Machine::probe();
    let load_before = load_average();
    eprintln!(
        "nodeport: {} threads, sizes {:?}, {} rounds of {:?} per mode",
        cfg.threads, cfg.sizes, cfg.rounds, cfg.segment
    );
    let mut results = Vec::new();
    for &services in &cfg.sizes {
        results.extend(measure_size(cfg, services).with_context(|| format!("S = {services}"))?);
    }
    let report = Report {
        cfg,
        machine: &machine,
        results: &results,
        load: (load_before, load_average()),
        elapsed: started.elapsed(),
    };
    common::write_results(out_dir, "nodeport", &report.markdown(), &report.json())?;
    report.check()
}

// ---------------------------------------------------------------------------
// The Services

fn vip(i: u32) -> Ipv4Addr {
    one_node::cluster_ip(i)
}

/// Endpoints of the Services nobody talks to.
fn filler_endpoint(service: u32, k: u32) -> Ipv4Addr {
    one_node::filler_endpoint(service, FILLER_ENDPOINTS, k)
}

/// S Services, each with its endpoints; the one at index S/2 is the measured one, and
/// the `node_ports` Services around it are NodePorts.
struct ServiceSet {
    services: Vec<(Service, Vec<Ipv4Addr>)>,
    measured: usize,
    node_ports: u32,
}

impl ServiceSet {
    fn new(count: u32) -> ServiceSet {
        let measured = count / 2;
        let node_ports = count.min(NODE_PORT_SLOTS);
        // measured >= node_ports / 2 and first + node_ports <= count, since
        // node_ports <= count.
        let first = measured - node_ports / 2;
        let services = (0..count)
            .map(|i| {
                let svc = Service::new("bench", &format!("svc-{i}"), vip(i)).port(
                    "http",
                    SERVICE_PORT,
                    Protocol::Tcp,
                    TARGET_PORT,
                );
                let svc = if (first..first + node_ports).contains(&i) {
                    svc.type_(ServiceType::NodePort)
                        .node_port("http", NODE_PORT_MIN + (i - first) as u16)
                } else {
                    svc
                };
                let endpoints = if i == measured {
                    vec![BACKEND.1]
                } else {
                    (0..FILLER_ENDPOINTS)
                        .map(|k| filler_endpoint(i, k))
                        .collect()
                };
                (svc, endpoints)
            })
            .collect();
        ServiceSet {
            services,
            measured: measured as usize,
            node_ports,
        }
    }

    fn node_port(&self) -> u16 {
        self.services[self.measured].0.ports[0]
            .node_port
            .expect("the measured Service is a NodePort")
    }

    /// One multi-document file with every Service and its EndpointSlice; the measured
    /// Service's endpoint is on node `backend_node` (the agents' node name).
    fn yaml(&self, backend_node: &str) -> String {
        let mut out = String::new();
        for (i, (svc, eps)) in self.services.iter().enumerate() {
            if i == self.measured {
                let eps: Vec<_> = eps
                    .iter()
                    .map(|ip| Endpoint::ready(*ip).on_node(backend_node))
                    .collect();
                out.push_str(&svc.yaml_with(&eps));
            } else {
                out.push_str(&svc.yaml(Some(eps)));
            }
            out.push_str("---\n");
        }
        out
    }

    /// Every service port as kube-proxy sees it, with its nodePort, in Service order.
    fn kube(&self) -> Vec<(KubeService, Option<u16>)> {
        let mut out = Vec::new();
        for (svc, eps) in &self.services {
            for port in &svc.ports {
                out.push((
                    svc.kube_service(&port.name, svc.cluster_ip, eps),
                    port.node_port,
                ));
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------
// One mode's world

/// A cluster with its backend and whatever load balancer the mode has. Fields drop in
/// declaration order: the agents while their namespaces exist, then the server, the
/// manifests and the namespaces.
struct World {
    mode: Mode,
    /// Node a's agent first.
    agents: Vec<Agent>,
    _backend: PooledBackend,
    manifests: Option<ManifestDir>,
    cluster: Cluster,
    /// Time to program the Services on node a: agent start to healthy, or
    /// `iptables-restore`.
    programming: Option<Duration>,
    targets: Vec<SocketAddrV4>,
    backend_names: Vec<String>,
}

impl World {
    fn build(mode: Mode, set: &ServiceSet) -> Result<World> {
        let cluster = Cluster::with_clients(&[("a", &[]), ("b", &[BACKEND])], &[CLIENT1])
            .context("build the two-node cluster")?;
        for node in cluster.nodes() {
            for iface in ["all", UPLINK] {
                node.ns
                    .sysctl(&format!("net.ipv4.conf.{iface}.send_redirects"), "0")?;
            }
        }
        let client = cluster.client(CLIENT1.0);
        for iface in ["all", UPLINK] {
            client
                .ns
                .sysctl(&format!("net.ipv4.conf.{iface}.accept_redirects"), "0")?;
        }
        let backend = PooledBackend::start(
            &cluster.pod(BACKEND.0).ns,
            BACKEND.0,
            TARGET_PORT,
            None,
            BACKEND_THREADS,
        )?;
        let mut world = World {
            mode,
            agents: Vec::new(),
            _backend: backend,
            manifests: None,
            cluster,
            programming: None,
            targets: vec![SocketAddrV4::new(NODE_A_IP, set.node_port())],
            backend_names: vec![BACKEND.0.to_owned()],
        };
        let (node_a, node_b) = (world.cluster.node("a"), world.cluster.node("b"));
        match mode {
            Mode::Direct => {
                world
                    .cluster
                    .route_via(CLIENT1.0, &node_b.pod_cidr(), "a")?;
                node_b
                    .ns
                    .ip(&[
                        "route",
                        "add",
                        &format!("{}/32", CLIENT1.1),
                        "via",
                        &node_a.ip.to_string(),
                    ])
                    .context("route back to client1 via node a")?;
                world.targets = vec![SocketAddrV4::new(BACKEND.1, TARGET_PORT)];
            }
            Mode::Xdp | Mode::Tc | Mode::Dsr => {
                let manifests = ManifestDir::create(world.cluster.stem())?;
                manifests.write("services.yaml", &set.yaml(node_b.ns.name()))?;
                let lb_mode = if mode == Mode::Dsr { "dsr" } else { "snat" };
                let args = [
                    "--xdp-mode",
                    mode.xdp_mode().expect("an ebpf-proxy mode"),
                    "--lb-mode",
                    lb_mode,
                ];
                for node in [node_a, node_b] {
                    let started = Instant::now();
                    let agent = Agent::start_with(&node.ns, manifests.path(), &args)
                        .with_context(|| format!("start the agent on node {}", node.name))?;
                    if node.name == "a" {
                        world.programming = Some(started.elapsed());
                    }
                    world.agents.push(agent);
                }
                world.manifests = Some(manifests);
            }
            Mode::Iptables => {
                let kube = set.kube();
                for node in [node_a, node_b] {
                    let started = Instant::now();
                    iptables::apply_with_node_ports(&node.ns, &kube).with_context(|| {
                        format!("load kube-proxy's iptables rules on node {}", node.name)
                    })?;
                    if node.name == "a" {
                        world.programming = Some(started.elapsed());
                    }
                }
            }
        }
        Ok(world)
    }

    fn load(&self) -> Load<'_> {
        Load {
            ns: &self.cluster.client(CLIENT1.0).ns,
            proto: Protocol::Tcp,
            targets: &self.targets,
            backends: &self.backend_names,
        }
    }

    /// The agents' last lines of output, to go with an error.
    fn agent_logs(&self) -> String {
        self.agents.iter().map(common::log_tail).collect()
    }

    /// Waits for a first answer (the agents program the Services right after they
    /// report healthy), then one connection at a time: the mode must answer every one.
    fn warm_up(&self) -> Result<()> {
        let first = wait_for(FIRST_ANSWER, Duration::from_millis(100), || {
            let never = |e: anyhow::Error| NotYet::Never(format!("{e:#}"));
            check_interrupted().map_err(never)?;
            let sample = self.load().sequential(1).map_err(never)?;
            if sample.ok == 1 {
                Ok(())
            } else {
                Err(NotYet::Again(format!("{:?}", sample.errors)))
            }
        });
        match first {
            Ok(_) => {}
            Err(NotYet::Never(why)) => bail!("{why}"),
            Err(NotYet::Again(last)) => bail!(
                "{}: no answer from {} within {FIRST_ANSWER:?}: {last}{}",
                self.mode.label(),
                self.targets[0],
                self.agent_logs()
            ),
        }
        let sample = self.load().sequential(WARMUP)?;
        if sample.ok as usize != WARMUP {
            bail!(
                "{}: warm-up of {WARMUP} connections got {} answers, failures {:?}{}",
                self.mode.label(),
                sample.ok,
                sample.errors,
                self.agent_logs()
            );
        }
        Ok(())
    }

    /// What node a's uplink has carried: packets and bytes, received plus sent.
    fn node_a_uplink(&self) -> Result<(u64, u64)> {
        let out = self
            .cluster
            .node("a")
            .ns
            .ip(&["-s", "-j", "link", "show", UPLINK])
            .context("node a's uplink counters")?;
        let links: serde_json::Value = serde_json::from_str(&out).context("ip -j link")?;
        let stats = &links[0]["stats64"];
        let field = |dir: &str, what: &str| {
            stats[dir][what]
                .as_u64()
                .with_context(|| format!("no {dir} {what} in {stats}"))
        };
        Ok((
            field("rx", "packets")? + field("tx", "packets")?,
            field("rx", "bytes")? + field("tx", "bytes")?,
        ))
    }

    /// What node a's packet programs have run so far: XDP and tc programs (the tail-called
    /// ones among them) that use any of the maps pinned under its agent's root (node b's
    /// agent has maps of its own), runs and run time summed per hook. The socket hooks
    /// are left out: they sit on the machine's one cgroup and so also run for client1's
    /// connects, which in a cluster are not the node's. The kernel counts only while its
    /// statistics are on ([`datapath_time`]). None for the modes without an agent.
    fn node_a_programs(&self) -> Result<Option<HookTimes>> {
        let Some(agent) = self.agents.first() else {
            return Ok(None);
        };
        program_time::agent_programs(agent.bpf_root()).map(Some)
    }

    /// Node a's non-zero datapath counters, for the ebpf-proxy modes.
    fn counters(&self) -> Result<Option<Vec<(&'static str, u64)>>> {
        let Some(agent) = self.agents.first() else {
            return Ok(None);
        };
        let maps = Maps::open_pinned(&PinLayout::new(agent.bpf_root()))
            .context("open node a's pinned maps")?;
        let counters = maps.counters().context("read node a's counters")?;
        Ok(Some(counters.into_iter().filter(|(_, v)| *v > 0).collect()))
    }
}

// ---------------------------------------------------------------------------
// Measuring

/// Everything measured for one mode and S, over all rounds.
type Stats = common::Stats<Mode, NodeA>;

/// What the nodeport bench keeps with each result.
#[derive(Debug)]
struct NodeA {
    /// How many of the S Services are NodePorts.
    node_ports: u32,
    /// Node a's non-zero counters after the rounds (warm-up included), for the
    /// ebpf-proxy modes.
    counters: Option<Vec<(&'static str, u64)>>,
    /// Packets and bytes node a's uplink carried (in plus out) per connection
    /// of the rounds.
    per_connection: (f64, f64),
    /// Node a's BPF programs' work in the timing phase, for the ebpf-proxy modes.
    datapath: Option<DatapathTime>,
}

/// Node a's packet programs over the connections of the timing phase.
#[derive(Debug, Clone, Copy, Default)]
struct DatapathTime {
    connections: u64,
    hooks: HookTimes,
}

impl DatapathTime {
    fn per_connection(&self, x: u64) -> f64 {
        x as f64 / self.connections.max(1) as f64
    }

    fn runs(&self) -> u64 {
        self.hooks.runs()
    }

    fn ns(&self) -> u64 {
        self.hooks.ns()
    }

    fn ns_per_connection(&self) -> f64 {
        self.per_connection(self.ns())
    }

    fn ns_per_run(&self) -> f64 {
        self.hooks.ns_per_run()
    }
}

/// All modes at one S ran interleaved.
impl common::Detail for NodeA {
    fn same_cell(&self, _: &NodeA) -> bool {
        true
    }
}

impl NodeA {
    /// Node a's counter `name`, 0 when it was not read or stayed 0.
    fn counter(&self, name: &str) -> u64 {
        self.counters
            .iter()
            .flatten()
            .find(|(n, _)| *n == name)
            .map_or(0, |c| c.1)
    }
}

fn measure_size(cfg: &Config, services: u32) -> Result<Vec<Stats>> {
    let set = ServiceSet::new(services);
    let mut worlds = Vec::new();
    for mode in Mode::ALL {
        check_interrupted()?;
        let world = World::build(mode, &set).with_context(|| format!("set up {}", mode.label()))?;
        match world.programming {
            Some(d) => eprintln!(
                "S = {services}: {} ready, Services programmed on node a in {d:.2?}",
                mode.label()
            ),
            None => eprintln!("S = {services}: {} ready", mode.label()),
        }
        worlds.push(world);
    }
    let mut uplink_before = Vec::new();
    for world in &worlds {
        world
            .warm_up()
            .with_context(|| format!("warm up {}", world.mode.label()))?;
        uplink_before.push(world.node_a_uplink()?);
    }
    let series = interleaved(cfg.rounds, worlds.len(), 1, |w, _| {
        worlds[w]
            .load()
            .closed_loop(cfg.threads, cfg.segment)
            .with_context(|| format!("measure {}", worlds[w].mode.label()))
    })?;
    // Read before the timing phase, whose connections the rounds' do not count.
    let mut after_rounds = Vec::new();
    for world in &worlds {
        let counters = world
            .counters()
            .with_context(|| format!("{} counters", world.mode.label()))?;
        after_rounds.push((world.node_a_uplink()?, counters));
    }
    let datapath = datapath_time(cfg, &worlds)?;
    let mut out = Vec::new();
    for ((((world, mut series), before), (after, counters)), datapath) in worlds
        .iter()
        .zip(series)
        .zip(uplink_before)
        .zip(after_rounds)
        .zip(datapath)
    {
        let series = series.pop().expect("one kind of exchange");
        let connections = (series.ok + series.failed).max(1) as f64;
        let per_connection = (
            (after.0 - before.0) as f64 / connections,
            (after.1 - before.1) as f64 / connections,
        );
        if series.failed > 0 {
            eprintln!(
                "warning: S = {services}, {}: {} of {} connections failed: {:?}",
                world.mode.label(),
                series.failed,
                series.failed + series.ok,
                series.errors
            );
        }
        if let Some(counters) = &counters {
            eprintln!(
                "S = {services}, {}: node a's counters {counters:?}",
                world.mode.label()
            );
        }
        out.push(Stats {
            services,
            mode: world.mode,
            programming: world.programming,
            series,
            detail: NodeA {
                node_ports: set.node_ports,
                counters,
                per_connection,
                datapath,
            },
        });
    }
    eprintln!("S = {services}: measured");
    // The worlds drop here, agents and namespaces with them, before the next S is
    // built.
    Ok(out)
}

/// The entry node's datapath CPU per connection: node a's BPF programs' run time
/// over [`CPU_ROUNDS`] more rounds of each ebpf-proxy mode, interleaved, with the
/// kernel's run-time statistics on (`BPF_ENABLE_STATS`) for this phase only. The
/// measured rounds run without them: they cost each program run two clock reads,
/// which kube-proxy's and the routed modes would not pay. None for those modes.
fn datapath_time(cfg: &Config, worlds: &[World]) -> Result<Vec<Option<DatapathTime>>> {
    let mut times: Vec<Option<DatapathTime>> = worlds
        .iter()
        .map(|w| (!w.agents.is_empty()).then(DatapathTime::default))
        .collect();
    // Statistics stay on while this descriptor is open, and go off when it is
    // dropped, also on an error.
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime)
        .context("turn on the kernel's BPF run-time statistics (BPF_ENABLE_STATS)")?;
    for _ in 0..CPU_ROUNDS {
        for (world, time) in worlds.iter().zip(&mut times) {
            let Some(time) = time else {
                continue;
            };
            check_interrupted()?;
            let label = world.mode.label();
            let before = world.node_a_programs()?.context("node a's agent")?;
            let sample = world
                .load()
                .closed_loop(cfg.threads, cfg.segment)
                .with_context(|| format!("time {label}'s programs"))?;
            let after = world.node_a_programs()?.context("node a's agent")?;
            time.connections += sample.ok + sample.failed();
            time.hooks.add(after.since(before));
        }
    }
    for (world, time) in worlds.iter().zip(&times) {
        if let Some(t) = time {
            eprintln!(
                "{}: node a's {} programs ran {:.1} times and {:.0} ns per connection",
                world.mode.label(),
                t.hooks.programs,
                t.per_connection(t.runs()),
                t.ns_per_connection()
            );
        }
    }
    Ok(times)
}

// ---------------------------------------------------------------------------
// Reporting

struct Report<'a> {
    cfg: &'a Config,
    machine: &'a Machine,
    results: &'a [Stats],
    /// /proc/loadavg's 1-minute figure before and after the run.
    load: (String, String),
    elapsed: Duration,
}

impl Report<'_> {
    #[expect(
        clippy::too_many_lines,
        reason = "the result document, section by section in the order it is printed"
    )]
    fn markdown(&self) -> String {
        let cfg = self.cfg;
        let m = self.machine;
        let mut out = format!(
            "NodePort, externalTrafficPolicy Cluster, in the two-node topology of docs/architecture.md (test topologies): \
             client1 (outside the cluster) connects to node a's address on the nodePort; node \
             a translates to the backend pod on node b with SNAT to itself. One run on this \
             machine: {}, {} cores, kernel {}; {}. Load average (1 min) before / after: \
             {} / {}; the run took {:.0} s.\n\n\
             Closed loop, {} client threads; each connection is connect, one request, one \
             response, close (RST), its latency from connect to the response. Each mode runs \
             {} rounds of {} ms, the modes interleaved; rates and percentiles are over all \
             rounds, the ratios medians of per-round ratios.\n\n\
             Modes: `ebpf-proxy XDP` and `ebpf-proxy tc` are the agent on both nodes with \
             `--xdp-mode native` and `off`; `kube-proxy iptables` is kube-proxy's nat table \
             with NodePorts (KUBE-NODEPORTS, KUBE-EXT, masquerade) on both nodes, no agent; \
             `no LB (routed)` is client1 connecting to the pod's own address through a route \
             via node a (node b routes back via node a): the same hops, no translation, the \
             limit.\n\n\
             Services: all S have a ClusterIP; the NodePort range 30000-32767 holds 2,768 \
             ports, so min(S, 2,768) of them (a band around the measured one, which sits in \
             the middle of the S) are NodePorts and the rest ClusterIP only. kube-proxy's \
             NodePort packets walk every ClusterIP rule of KUBE-SERVICES before its last rule \
             jumps to KUBE-NODEPORTS. All but the measured Service have {FILLER_ENDPOINTS} \
             endpoints at addresses that exist nowhere.{}\n\n\
             | Services | NodePorts | mode | conn/s | vs iptables | vs no LB | p50 µs | p99 µs | failed |\n\
             |---:|---:|---|---:|---:|---:|---:|---:|---:|\n",
            m.cpu,
            m.cores,
            m.kernel,
            m.iptables,
            self.load.0,
            self.load.1,
            self.elapsed.as_secs_f64(),
            cfg.threads,
            cfg.rounds,
            cfg.segment.as_millis(),
            if cfg.quick {
                " Quick mode: short segments, S up to 1,000."
            } else {
                ""
            }
        );
        for s in self.results {
            out.push_str(&format!(
                "| {} | {} {}\n",
                s.services,
                s.detail.node_ports,
                self.results.cells(s)
            ));
        }
        out.push_str("\nPaired per-round ratios (median, quartiles):\n\n");
        for &services in &cfg.sizes {
            let (Some(xdp), Some(tc)) = (
                self.results.find(services, Mode::Xdp),
                self.results.find(services, Mode::Tc),
            ) else {
                continue;
            };
            out.push_str(&format!(
                "- S = {services}: XDP rate {} iptables', {} tc's, {} the no-LB limit; \
                 XDP p99 {} iptables'; tc rate {} iptables'\n",
                self.results.rate_vs(xdp, Mode::Iptables),
                self.results.rate_vs(xdp, Mode::Tc),
                self.results.rate_vs(xdp, Mode::Direct),
                self.results.p99_vs(xdp, Mode::Iptables),
                self.results.rate_vs(tc, Mode::Iptables),
            ));
        }
        for &services in &cfg.sizes {
            let Some(dsr) = self.results.find(services, Mode::Dsr) else {
                continue;
            };
            out.push_str(&format!(
                "- S = {services}: DSR rate {} tc's (SNAT), {} iptables', {} the no-LB limit; \
                 DSR p99 {} tc's\n",
                self.results.rate_vs(dsr, Mode::Tc),
                self.results.rate_vs(dsr, Mode::Iptables),
                self.results.rate_vs(dsr, Mode::Direct),
                self.results.p99_vs(dsr, Mode::Tc),
            ));
        }
        out.push_str(
            "\nWhat node a's uplink carried per connection of the rounds (packets and \
             bytes, in plus out): the entry node's share of each connection. With SNAT \
             every packet of both directions crosses it twice; with DSR only the \
             client's:\n\n| Services | mode | packets / conn | bytes / conn |\n|---:|---|---:|---:|\n",
        );
        for s in self.results {
            out.push_str(&format!(
                "| {} | {} | {:.1} | {:.0} |\n",
                s.services,
                s.mode.label(),
                s.detail.per_connection.0,
                s.detail.per_connection.1
            ));
        }
        out.push_str(&format!(
            "\nThe entry node's datapath CPU per connection: node a's packet programs (the \
             XDP and tc programs using its agent's maps, the tail-called ones among them), \
             their runs and run time as the kernel counts them, over {CPU_ROUNDS} \
             more rounds of each ebpf-proxy mode after the measured ones, with the \
             kernel's BPF statistics on for those rounds only (they cost every run two \
             clock reads). The kernel's own forwarding of each packet (routing, the \
             veth) comes on top, in proportion to the packets above; it has no \
             per-namespace account here:\n\n\
             | Services | mode | runs / conn (XDP + tc) | ns / conn | of which XDP | of which tc | ns / run | connections |\n\
             |---:|---|---:|---:|---:|---:|---:|---:|\n"
        ));
        for s in self.results {
            let Some(t) = &s.detail.datapath else {
                continue;
            };
            out.push_str(&format!(
                "| {} | {} | {:.1} + {:.1} | {:.0} | {:.0} | {:.0} | {:.0} | {} |\n",
                s.services,
                s.mode.label(),
                t.per_connection(t.hooks.xdp.runs),
                t.per_connection(t.hooks.tc.runs),
                t.ns_per_connection(),
                t.per_connection(t.hooks.xdp.ns),
                t.per_connection(t.hooks.tc.ns),
                t.ns_per_run(),
                t.connections
            ));
        }
        for &services in &cfg.sizes {
            let time = |mode| {
                self.results
                    .find(services, mode)
                    .and_then(|s| s.detail.datapath)
            };
            if let (Some(dsr), Some(tc)) = (time(Mode::Dsr), time(Mode::Tc)) {
                out.push_str(&format!(
                    "\n- S = {services}: DSR's entry node spends {:.2}x the datapath time \
                     per connection of SNAT through tc",
                    dsr.ns_per_connection() / tc.ns_per_connection().max(1.0)
                ));
                if let Some(xdp) = time(Mode::Xdp) {
                    out.push_str(&format!(
                        ", {:.2}x SNAT through XDP's",
                        dsr.ns_per_connection() / xdp.ns_per_connection().max(1.0)
                    ));
                }
            }
        }
        out.push_str(
            "\n\nTime to program the Services on node a (agent start to healthy / \
             iptables-restore):\n\n",
        );
        out.push_str(&self.results.programming_markdown(
            &cfg.sizes,
            &[Mode::Xdp, Mode::Tc, Mode::Dsr, Mode::Iptables],
        ));
        out.push_str(
            "\nNode a's datapath counters after the rounds (warm-up included; non-zero \
             ones). `xdp_tx` counts packets XDP translated and sent on itself, both \
             directions; `snat_new` the connections SNATed:\n\n",
        );
        for s in self.results {
            let Some(counters) = &s.detail.counters else {
                continue;
            };
            let list: Vec<String> = counters.iter().map(|(n, v)| format!("{n} {v}")).collect();
            let per_conn = match s.detail.counter("snat_new") {
                0 => String::new(),
                snat => format!(
                    " ({:.1} XDP packets per connection)",
                    s.detail.counter("xdp_tx") as f64 / snat as f64
                ),
            };
            out.push_str(&format!(
                "- S = {}, {}: {}{}\n",
                s.services,
                s.mode.label(),
                list.join(", "),
                if s.mode == Mode::Xdp { &per_conn } else { "" }
            ));
        }
        out
    }

    fn json(&self) -> serde_json::Value {
        let cfg = self.cfg;
        let rows: Vec<serde_json::Value> = self
            .results
            .iter()
            .map(|s| {
                self.results.json(
                    s,
                    json!({
                        "node_ports": s.detail.node_ports,
                        "vs_tc": self.results.rate_vs(s, Mode::Tc).json(),
                        "node_a_uplink_per_connection": {
                            "packets": s.detail.per_connection.0,
                            "bytes": s.detail.per_connection.1,
                        },
                        "node_a_datapath_per_connection": s.detail.datapath.map(|t| json!({
                            "programs": t.hooks.programs,
                            "connections": t.connections,
                            "xdp_runs": t.per_connection(t.hooks.xdp.runs),
                            "tc_runs": t.per_connection(t.hooks.tc.runs),
                            "ns": t.ns_per_connection(),
                            "xdp_ns": t.per_connection(t.hooks.xdp.ns),
                            "tc_ns": t.per_connection(t.hooks.tc.ns),
                            "ns_per_run": t.ns_per_run(),
                        })),
                        "node_a_counters": s.detail.counters.as_ref().map(|c| {
                            c.iter()
                                .map(|(n, v)| (n.to_string(), json!(v)))
                                .collect::<serde_json::Map<_, _>>()
                        }),
                    }),
                )
            })
            .collect();
        json!({
            "machine": self.machine.json(),
            "load_average_before_after": [self.load.0, self.load.1],
            "elapsed_s": self.elapsed.as_secs_f64(),
            "quick": cfg.quick,
            "client_threads": cfg.threads,
            "rounds": cfg.rounds,
            "segment_s": cfg.segment.as_secs_f64(),
            "filler_endpoints_per_service": FILLER_ENDPOINTS,
            "node_port_range": [NODE_PORT_MIN, NODE_PORT_MAX],
            "node_ports": "min(S, 2768) Services, a band around the measured one; the rest ClusterIP only",
            "results": rows,
        })
    }

    /// Fails the run when XDP did not do the XDP mode's work, node a's programs were
    /// not timed, a flow was assured twice, or an ebpf-proxy mode lost more than
    /// [`MAX_FAILURE_RATE`] of its connections.
    fn check(&self) -> Result<()> {
        let mut problems = Vec::new();
        for s in self.results {
            if matches!(s.mode, Mode::Xdp | Mode::Tc | Mode::Dsr)
                && s.series.failure_rate() > MAX_FAILURE_RATE
            {
                problems.push(format!(
                    "S = {}, {}: {:.2}% of connections failed ({} of {}: {:?})",
                    s.services,
                    s.mode.label(),
                    100.0 * s.series.failure_rate(),
                    s.series.failed,
                    s.series.failed + s.series.ok,
                    s.series.errors
                ));
            }
            // An empty timing (no program found, or statistics that did not count)
            // would report a datapath that costs nothing.
            if let Some(t) = &s.detail.datapath
                && (t.hooks.programs == 0 || t.runs() == 0 || t.ns() == 0 || t.connections == 0)
            {
                problems.push(format!(
                    "S = {}, {}: node a's programs were not timed ({t:?})",
                    s.services,
                    s.mode.label()
                ));
            }
            // A flow is assured once: more assured than new flows means two CPUs
            // moved one flow, the race that reset connections at tc.
            let (new, assured) = (
                s.detail.counter("ct_new_flow"),
                s.detail.counter("ct_assured"),
            );
            if assured > new {
                problems.push(format!(
                    "S = {}, {}: ct_assured {assured} above ct_new_flow {new}",
                    s.services,
                    s.mode.label()
                ));
            }
            // The counter that shows the mode did its own work on node a.
            for (mode, counter, what) in [
                (Mode::Dsr, "dsr_new", "node a sent no flow by DSR"),
                (Mode::Dsr, "xdp_tx", "XDP sent no DSR packet itself"),
                (Mode::Xdp, "xdp_tx", "XDP sent no packet itself"),
            ] {
                if s.mode == mode && s.detail.counter(counter) == 0 {
                    problems.push(format!(
                        "S = {}, {}: {what} ({counter} 0; counters {:?})",
                        s.services,
                        s.mode.label(),
                        s.detail.counters
                    ));
                }
            }
        }
        if !problems.is_empty() {
            bail!("{}", problems.join("\n"));
        }
        Ok(())
    }
}
