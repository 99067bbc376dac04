//! End-to-end speed on real packets: a client pod opening short TCP connections and
//! making UDP request/responses to a ClusterIP, with S Services installed, through
//! four datapaths side by side in one run:
//!
//! - `ebpf-proxy`: the agent binary on a manifest directory with the S Services;
//! - `kube-proxy iptables`: the same Services as kube-proxy's iptables mode writes them
//!   (tests/src/iptables.rs, `iptables-restore`), no agent;
//! - `kube-proxy nftables`: the same as its nftables mode writes them
//!   (tests/src/nftables.rs, `nft -f`), no agent;
//! - `no LB (pod IP)`: the client talking straight to the backend pods, nothing in
//!   between: the limit.
//!
//! Each mode gets its own routed topology (design.md §6: a client pod and three backend
//! pods on one node), so no mode's rules or conntrack state touch another's. All four
//! are built before measuring and measured in interleaved rounds (the order rotating
//! each round), so a drift in the machine's speed spreads over all modes instead of
//! landing on one.
//!
//! The workload is closed-loop: T client threads in the client pod, each doing one
//! exchange after the other for a fixed time. A TCP exchange is connect, one request,
//! one response, close; the latency is from the start of connect to the last byte of
//! the response. A UDP exchange uses a new socket (a new source port, so a new flow for
//! the load balancer, as a DNS stub resolver does) for one request and its response.
//! The measured Service (port 80/TCP and 53/UDP, three endpoints: the backend pods) sits
//! in the middle of the S: kube-proxy writes its KUBE-SERVICES rules in Go map order,
//! so a Service is on average half-way down the list. The other Services have three
//! endpoints each at addresses that exist nowhere; only their rules and map entries
//! matter.
//!
//! Rates and percentiles are over all rounds. The ratios between modes are the median
//! of per-round ratios: two segments of one round run within a second or two of each
//! other, so their ratio is spared most of the drift and of the bursts of other work a
//! shared machine has; the quartiles of those ratios say how firm a ratio is.
//!
//! Everything is bounded: fixed durations, a cap on exchanges per thread, 1 s I/O
//! timeouts; traffic only ever goes to addresses inside the benchmark's namespaces.
//! Namespaces, servers and agents are removed on drop, also on an error or Ctrl-C.
//!
//! Usage: `cargo bench -p ebpf-proxy-tests --bench e2e -- [--quick] [--out DIR]
//! [--sizes 10,1000] [--rounds N] [--threads N]` (root; the agent binary from `cargo
//! xtask build` or $EBPF_PROXY_BIN). Prints markdown tables and writes `e2e.md` and
//! `e2e.json` to DIR (default bench/results).

use std::{
    collections::BTreeMap,
    io::{ErrorKind, Read, Write},
    net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket},
    path::PathBuf,
    process::Command,
    sync::{
        Arc, Barrier,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, anyhow, bail};
use ebpf_proxy_tests::{
    Protocol,
    agent::{self, Agent},
    iptables::{self, KubeService},
    manifest::{ManifestDir, Service},
    netns::{NetNs, NsThread},
    nftables, require_root, run_cmd,
    topology::{NODE_IP, Topology},
};
use nix::sys::{
    signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction},
    socket::{setsockopt, sockopt},
    time::{TimeVal, TimeValLike},
};
use serde_json::json;

const CLIENT: (&str, Ipv4Addr) = ("client", Ipv4Addr::new(10, 200, 0, 2));
const BACKENDS: [(&str, Ipv4Addr); 3] = [
    ("backend-a", Ipv4Addr::new(10, 200, 0, 11)),
    ("backend-b", Ipv4Addr::new(10, 200, 0, 12)),
    ("backend-c", Ipv4Addr::new(10, 200, 0, 13)),
];
const TCP_TARGET_PORT: u16 = 8080;
const UDP_TARGET_PORT: u16 = 5353;
const TCP_SERVICE_PORT: u16 = 80;
const UDP_SERVICE_PORT: u16 = 53;
/// Endpoints of every Service (the measured one's are the backend pods).
const ENDPOINTS: u32 = 3;
const REQUEST: &[u8] = b"ping\n";
/// Connect and read timeout of one TCP exchange, and the UDP reply timeout. Far above
/// any healthy exchange (tens of microseconds), low enough that a lost packet costs a
/// cell little time.
const IO_TIMEOUT: Duration = Duration::from_secs(1);
const UDP_TIMEOUT: Duration = Duration::from_millis(500);
/// How often idle server threads look at their stop flag.
const SERVER_TICK: Duration = Duration::from_millis(100);
/// Exchanges per mode before measuring, one at a time: fills neighbour caches and
/// checks that the mode works and spreads over all three backends (a miss of one of
/// them in 60 tries has probability 3·(2/3)^60, about 1e-10).
const WARMUP: usize = 60;
/// Upper bound on exchanges per thread and segment, whatever the machine's speed.
const MAX_PER_SEGMENT: usize = 2_000_000;

/// Set by SIGINT/SIGTERM: the run stops at the next exchange and unwinds through the
/// `Drop`s, which remove the namespaces and stop the agents.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: nix::libc::c_int) {
    if INTERRUPTED.swap(true, Ordering::Relaxed) {
        // A second signal: the user wants out now, even from a step that does not look
        // at the flag (an agent starting on 10,000 Services). What is left behind
        // carries this pid, and `cargo xtask` removes it on its next start.
        // SAFETY: _exit is async-signal-safe.
        unsafe { nix::libc::_exit(130) };
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Ebpf,
    Iptables,
    Nftables,
    Direct,
}

impl Mode {
    const ALL: [Mode; 4] = [Mode::Direct, Mode::Iptables, Mode::Nftables, Mode::Ebpf];

    fn label(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf-proxy",
            Mode::Iptables => "kube-proxy iptables",
            Mode::Nftables => "kube-proxy nftables",
            Mode::Direct => "no LB (pod IP)",
        }
    }

    fn key(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Iptables => "iptables",
            Mode::Nftables => "nftables",
            Mode::Direct => "direct",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    fn key(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        }
    }
}

#[derive(Debug, Clone)]
struct Config {
    quick: bool,
    sizes: Vec<u32>,
    rounds: usize,
    tcp_segment: Duration,
    udp_segment: Duration,
    threads: usize,
}

impl Config {
    fn new(quick: bool) -> Config {
        // Closed loop, one client thread per core: enough to keep the cores busy (a
        // packet crosses the node in softirq on the sending core), few enough that
        // latency is mostly the path and not the run queue.
        let cores = thread::available_parallelism().map_or(2, |n| n.get());
        let threads = cores.clamp(2, 4);
        // Many short rounds rather than a few long ones: on a shared machine the noise
        // comes in bursts of seconds, and interleaving the modes finely spreads each
        // burst over all of them.
        if quick {
            // About 25 s in all, so `cargo xtask bench --quick` stays near two minutes.
            Config {
                quick,
                sizes: vec![10, 1_000],
                rounds: 8,
                tcp_segment: Duration::from_millis(150),
                udp_segment: Duration::from_millis(75),
                threads,
            }
        } else {
            Config {
                quick,
                sizes: vec![10, 1_000, 10_000],
                rounds: 16,
                tcp_segment: Duration::from_millis(300),
                udp_segment: Duration::from_millis(150),
                threads,
            }
        }
    }

    fn segment(&self, proto: Proto) -> Duration {
        match proto {
            Proto::Tcp => self.tcp_segment,
            Proto::Udp => self.udp_segment,
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let result = parse_args(&args).and_then(|(cfg, out_dir)| run(cfg, &out_dir));
    if let Err(e) = result {
        eprintln!("e2e benchmark failed: {e:#}");
        std::process::exit(1);
    }
}

/// `--quick`, `--out DIR`, and for experiments `--sizes 10,1000`, `--rounds N`,
/// `--threads N`. Anything else (cargo passes `--bench`) is ignored.
fn parse_args(args: &[String]) -> Result<(Config, PathBuf)> {
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .map(|i| {
                args.get(i + 1)
                    .ok_or_else(|| anyhow!("{flag} needs a value"))
            })
            .transpose()
    };
    let mut cfg = Config::new(args.iter().any(|a| a == "--quick"));
    if let Some(sizes) = value("--sizes")? {
        cfg.sizes = sizes
            .split(',')
            .map(|s| s.trim().parse().with_context(|| format!("--sizes: {s:?}")))
            .collect::<Result<_>>()?;
    }
    if let Some(rounds) = value("--rounds")? {
        cfg.rounds = rounds.parse().context("--rounds")?;
    }
    if let Some(threads) = value("--threads")? {
        cfg.threads = threads.parse().context("--threads")?;
    }
    if cfg.sizes.contains(&0) || cfg.rounds == 0 || !(1..=64).contains(&cfg.threads) {
        bail!("sizes and rounds must be positive and threads within 1..=64");
    }
    let out_dir = value("--out")?.map_or_else(|| PathBuf::from("bench/results"), PathBuf::from);
    Ok((cfg, out_dir))
}

fn run(cfg: Config, out_dir: &std::path::Path) -> Result<()> {
    require_root()?;
    // Before minutes of setup for the other modes, not after.
    let bin = agent::binary()?;
    eprintln!("agent binary: {}", bin.display());
    let handler = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { sigaction(signal, &handler) }.context("install the signal handler")?;
    }
    let machine = Machine::probe();
    let load_before = load_average();
    eprintln!(
        "e2e: {} threads, sizes {:?}, {} rounds of {:?} TCP + {:?} UDP per mode",
        cfg.threads, cfg.sizes, cfg.rounds, cfg.tcp_segment, cfg.udp_segment
    );
    let mut results = Vec::new();
    for &services in &cfg.sizes {
        results.extend(measure_size(&cfg, services).with_context(|| format!("S = {services}"))?);
    }
    let report = Report {
        cfg: &cfg,
        machine: &machine,
        results: &results,
        load: (load_before, load_average()),
    };
    let markdown = report.markdown();
    println!("{markdown}");
    std::fs::create_dir_all(out_dir).with_context(|| format!("create {}", out_dir.display()))?;
    let md_path = out_dir.join("e2e.md");
    std::fs::write(&md_path, &markdown).with_context(|| format!("write {}", md_path.display()))?;
    let json_path = out_dir.join("e2e.json");
    let json = serde_json::to_string_pretty(&report.json())?;
    std::fs::write(&json_path, json + "\n")
        .with_context(|| format!("write {}", json_path.display()))?;
    eprintln!("wrote {} and {}", md_path.display(), json_path.display());
    Ok(())
}

fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted");
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The Services

fn vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 10)) + i) // 10.96.0.0/12
}

/// Endpoints of the Services nobody talks to: addresses that exist nowhere.
fn filler_endpoint(service: u32, k: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + service * ENDPOINTS + k)
}

fn backend_ips() -> Vec<Ipv4Addr> {
    BACKENDS.iter().map(|b| b.1).collect()
}

/// S Services, each with its endpoints; the one at index S/2 is the measured one.
struct ServiceSet {
    services: Vec<(Service, Vec<Ipv4Addr>)>,
    measured: usize,
}

impl ServiceSet {
    fn new(count: u32) -> ServiceSet {
        let measured = count / 2;
        let services = (0..count)
            .map(|i| {
                let name = format!("svc-{i}");
                let svc = Service::new("bench", &name, vip(i)).port(
                    "http",
                    TCP_SERVICE_PORT,
                    Protocol::Tcp,
                    TCP_TARGET_PORT,
                );
                if i == measured {
                    let svc = svc.port("dns", UDP_SERVICE_PORT, Protocol::Udp, UDP_TARGET_PORT);
                    (svc, backend_ips())
                } else {
                    (svc, (0..ENDPOINTS).map(|k| filler_endpoint(i, k)).collect())
                }
            })
            .collect();
        ServiceSet {
            services,
            measured: measured as usize,
        }
    }

    fn vip(&self) -> Ipv4Addr {
        self.services[self.measured].0.cluster_ip
    }

    /// One multi-document file with every Service and its EndpointSlice.
    fn yaml(&self) -> String {
        let mut out = String::new();
        for (svc, eps) in &self.services {
            out.push_str(&svc.yaml(Some(eps)));
            out.push_str("---\n");
        }
        out
    }

    /// Every service port as kube-proxy sees it, in Service order.
    fn kube(&self) -> Vec<KubeService> {
        let mut out = Vec::new();
        for (svc, eps) in &self.services {
            for port in &svc.ports {
                out.push(svc.kube_service(&port.name, svc.cluster_ip, eps));
            }
        }
        out
    }
}

// ---------------------------------------------------------------------------
// Backends

/// A backend pod's TCP and UDP servers, made for speed: a fixed pool of threads
/// serving one exchange each inline (the harness's servers spawn a thread per
/// connection, which on a small machine would cost more than the load balancers being
/// compared). TCP: read the request, answer `<name>\n`, close. UDP: answer every
/// datagram with `<name>\n`.
struct Backend {
    stop: Arc<AtomicBool>,
    threads: Vec<NsThread<()>>,
}

impl Backend {
    fn start(ns: &NetNs, name: &str, threads: usize) -> Result<Backend> {
        let (listener, udp) = ns
            .run(|| -> std::io::Result<_> {
                let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, TCP_TARGET_PORT))?;
                let udp = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, UDP_TARGET_PORT))?;
                Ok((listener, udp))
            })?
            .with_context(|| format!("{name}: bind the servers in {}", ns.name()))?;
        // accept() honours SO_RCVTIMEO on Linux, so threads blocked in it wake up to see
        // the stop flag; a blocking accept shared by several threads wakes one of them
        // per connection, where poll() would wake them all.
        setsockopt(
            &listener,
            sockopt::ReceiveTimeout,
            &TimeVal::milliseconds(SERVER_TICK.as_millis() as i64),
        )
        .with_context(|| format!("{name}: SO_RCVTIMEO on the listener"))?;
        udp.set_read_timeout(Some(SERVER_TICK))?;
        let listener = Arc::new(listener);
        let udp = Arc::new(udp);
        let reply: Arc<[u8]> = format!("{name}\n").into_bytes().into();
        let mut backend = Backend {
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
        };
        for i in 0..threads {
            let (listener, stop, tcp_reply) =
                (listener.clone(), backend.stop.clone(), reply.clone());
            backend
                .threads
                .push(ns.spawn(&format!("tcp-{name}-{i}"), move || {
                    tcp_serve(&listener, &tcp_reply, &stop)
                })?);
            let (udp, stop, udp_reply) = (udp.clone(), backend.stop.clone(), reply.clone());
            backend
                .threads
                .push(ns.spawn(&format!("udp-{name}-{i}"), move || {
                    udp_serve(&udp, &udp_reply, &stop)
                })?);
        }
        Ok(backend)
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn tcp_serve(listener: &TcpListener, reply: &[u8], stop: &AtomicBool) {
    let mut buf = [0u8; 256];
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((mut stream, _)) => {
                // Errors are the client's business (it counts them); a server that gives
                // up on one connection goes on with the next.
                let _ = (|| -> std::io::Result<()> {
                    stream.set_read_timeout(Some(IO_TIMEOUT))?;
                    let mut len = 0;
                    while !buf[..len].ends_with(b"\n") {
                        match stream.read(&mut buf[len..])? {
                            0 => return Ok(()),
                            n => len += n,
                        }
                        if len == buf.len() {
                            return Ok(());
                        }
                    }
                    // Then close: the FIN goes first, and the client's RST (it closes
                    // with SO_LINGER 0) ends the socket, so neither side keeps TIME_WAIT.
                    stream.write_all(reply)
                })();
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => {
                eprintln!("warning: accept: {e}");
                thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn udp_serve(socket: &UdpSocket, reply: &[u8], stop: &AtomicBool) {
    let mut buf = [0u8; 256];
    while !stop.load(Ordering::Relaxed) {
        match socket.recv_from(&mut buf) {
            Ok((_, peer)) => {
                let _ = socket.send_to(reply, peer);
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => {
                eprintln!("warning: udp recv: {e}");
                thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

// ---------------------------------------------------------------------------
// One mode's world

/// A topology with its backends and whatever load balancer the mode has. Fields drop
/// in declaration order: the agent while its namespace exists, then the servers, the
/// manifests and the namespaces.
struct World {
    mode: Mode,
    agent: Option<Agent>,
    _backends: Vec<Backend>,
    _manifests: Option<ManifestDir>,
    topology: Topology,
    /// Time to program the Services: agent start to healthy, `iptables-restore` or
    /// `nft -f`.
    programming: Option<Duration>,
    tcp_targets: Vec<SocketAddrV4>,
    udp_targets: Vec<SocketAddrV4>,
}

impl World {
    fn build(mode: Mode, set: &ServiceSet, threads: usize) -> Result<World> {
        let mut pods = vec![CLIENT];
        pods.extend_from_slice(&BACKENDS);
        let topology = Topology::routed(&pods).context("build the routed topology")?;
        let mut backends = Vec::new();
        for (name, _) in BACKENDS {
            backends.push(Backend::start(&topology.pod(name).ns, name, threads)?);
        }
        let mut world = World {
            mode,
            agent: None,
            _backends: backends,
            _manifests: None,
            topology,
            programming: None,
            tcp_targets: Vec::new(),
            udp_targets: Vec::new(),
        };
        let node = &world.topology.node;
        let started = Instant::now();
        match mode {
            Mode::Direct => {}
            Mode::Ebpf => {
                let manifests = ManifestDir::create(world.topology.stem())?;
                manifests.write("services.yaml", &set.yaml())?;
                let agent =
                    Agent::start(node, manifests.path()).context("start the ebpf-proxy agent")?;
                world.agent = Some(agent);
                world._manifests = Some(manifests);
            }
            Mode::Iptables => iptables::apply(node, &set.kube())
                .context("load kube-proxy's iptables rules (iptables-restore)")?,
            Mode::Nftables => nftables::apply(node, &set.kube(), &[NODE_IP])
                .context("load kube-proxy's nftables rules (nft -f)")?,
        }
        if mode != Mode::Direct {
            world.programming = Some(started.elapsed());
        }
        (world.tcp_targets, world.udp_targets) = match mode {
            Mode::Direct => (
                BACKENDS
                    .iter()
                    .map(|b| SocketAddrV4::new(b.1, TCP_TARGET_PORT))
                    .collect(),
                BACKENDS
                    .iter()
                    .map(|b| SocketAddrV4::new(b.1, UDP_TARGET_PORT))
                    .collect(),
            ),
            _ => (
                vec![SocketAddrV4::new(set.vip(), TCP_SERVICE_PORT)],
                vec![SocketAddrV4::new(set.vip(), UDP_SERVICE_PORT)],
            ),
        };
        Ok(world)
    }

    fn client(&self) -> &NetNs {
        &self.topology.pod(CLIENT.0).ns
    }

    fn targets(&self, proto: Proto) -> &[SocketAddrV4] {
        match proto {
            Proto::Tcp => &self.tcp_targets,
            Proto::Udp => &self.udp_targets,
        }
    }

    /// The agent's last lines of output, to go with an error.
    fn agent_log_tail(&self) -> String {
        match &self.agent {
            Some(agent) => {
                let log = agent.log();
                let lines: Vec<&str> = log.lines().collect();
                format!(
                    "\nlast lines of the agent's output:\n{}",
                    lines[lines.len().saturating_sub(20)..].join("\n")
                )
            }
            None => String::new(),
        }
    }

    /// One exchange at a time: the mode must answer every one and reach all three
    /// backends.
    fn warm_up(&self, proto: Proto) -> Result<()> {
        let targets = self.targets(proto).to_vec();
        // Bounded by the count: at most WARMUP times the I/O timeouts.
        let stop = Instant::now() + Duration::from_secs(3600);
        let sample = self
            .client()
            .run(move || worker(proto, &targets, 0, stop, WARMUP))?;
        if sample.ok as usize != WARMUP || sample.backends.contains(&0) {
            bail!(
                "{} {}: warm-up of {WARMUP} exchanges got {} answers (per backend {:?}), \
                 failures {:?}{}",
                self.mode.label(),
                proto.key(),
                sample.ok,
                sample.backends,
                sample.errors,
                self.agent_log_tail()
            );
        }
        Ok(())
    }

    /// `threads` closed-loop clients for `segment`.
    fn measure(&self, proto: Proto, threads: usize, segment: Duration) -> Result<Sample> {
        let barrier = Arc::new(Barrier::new(threads + 1));
        let mut workers = Vec::new();
        for i in 0..threads {
            let targets = self.targets(proto).to_vec();
            let barrier = barrier.clone();
            workers.push(self.client().spawn(&format!("e2e-client-{i}"), move || {
                barrier.wait();
                worker(
                    proto,
                    &targets,
                    i,
                    Instant::now() + segment,
                    MAX_PER_SEGMENT,
                )
            })?);
        }
        barrier.wait();
        let mut total = Sample::default();
        for w in workers {
            let sample = w
                .join()
                .map_err(|_| anyhow!("a client thread of {} panicked", self.mode.label()))?;
            total.merge(sample);
        }
        Ok(total)
    }
}

// ---------------------------------------------------------------------------
// The client

/// What some exchanges came to.
#[derive(Debug, Default)]
struct Sample {
    /// Latency of every successful exchange, in nanoseconds.
    latencies: Vec<u32>,
    ok: u64,
    /// Failures by `stage: kind`.
    errors: BTreeMap<String, u64>,
    /// Answers per backend, in [`BACKENDS`] order.
    backends: [u64; 3],
    /// Wall time; for threads merged into one sample, the longest thread's.
    elapsed: Duration,
}

impl Sample {
    fn merge(&mut self, other: Sample) {
        self.latencies.extend(other.latencies);
        self.ok += other.ok;
        for (k, v) in other.errors {
            *self.errors.entry(k).or_default() += v;
        }
        for (a, b) in self.backends.iter_mut().zip(other.backends) {
            *a += b;
        }
        self.elapsed = self.elapsed.max(other.elapsed);
    }

    fn failed(&self) -> u64 {
        self.errors.values().sum()
    }
}

type Failure = (&'static str, ErrorKind);

/// Exchanges one after the other until `until` or `max` attempts; runs on a thread
/// inside the client's namespace. `first` staggers the threads over `targets` when
/// there are several (the no-LB mode round-robins over the backends).
fn worker(
    proto: Proto,
    targets: &[SocketAddrV4],
    first: usize,
    until: Instant,
    max: usize,
) -> Sample {
    let mut sample = Sample {
        latencies: Vec::with_capacity(max.min(1 << 16)),
        ..Sample::default()
    };
    let start = Instant::now();
    let mut buf = [0u8; 64];
    // Attempts, not successes, are bounded: a broken mode must end its turn too.
    for i in first..first + max {
        let t0 = Instant::now();
        if t0 >= until || INTERRUPTED.load(Ordering::Relaxed) {
            break;
        }
        let target = targets[i % targets.len()];
        let result = match proto {
            Proto::Tcp => tcp_exchange(target, &mut buf),
            Proto::Udp => udp_exchange(target, &mut buf),
        };
        let latency = t0.elapsed();
        match result.and_then(|len| backend_of(&buf[..len])) {
            Ok(b) => {
                sample.ok += 1;
                sample.backends[b] += 1;
                sample
                    .latencies
                    .push(latency.as_nanos().min(u32::MAX as u128) as u32);
            }
            Err((stage, kind)) => {
                *sample
                    .errors
                    .entry(format!("{stage}: {kind:?}"))
                    .or_default() += 1;
            }
        }
    }
    sample.elapsed = start.elapsed();
    sample
}

/// Connect, send the request, read the one-line answer, close with a RST. The RST
/// (SO_LINGER 0) keeps the client's sockets out of TIME_WAIT, where tens of thousands
/// of short connections would otherwise exhaust its ephemeral ports within seconds.
fn tcp_exchange(target: SocketAddrV4, buf: &mut [u8]) -> Result<usize, Failure> {
    let mut stream = TcpStream::connect_timeout(&target.into(), IO_TIMEOUT)
        .map_err(|e| ("connect", e.kind()))?;
    let linger = nix::libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    setsockopt(&stream, sockopt::Linger, &linger)
        .map_err(|e| ("SO_LINGER", std::io::Error::from(e).kind()))?;
    stream
        .set_read_timeout(Some(IO_TIMEOUT))
        .map_err(|e| ("SO_RCVTIMEO", e.kind()))?;
    stream.write_all(REQUEST).map_err(|e| ("send", e.kind()))?;
    let mut len = 0;
    while !buf[..len].ends_with(b"\n") {
        match stream.read(&mut buf[len..]) {
            Ok(0) => return Err(("receive", ErrorKind::UnexpectedEof)),
            Ok(n) => len += n,
            Err(e) => return Err(("receive", e.kind())),
        }
        if len == buf.len() {
            return Err(("receive", ErrorKind::InvalidData));
        }
    }
    Ok(len)
}

/// A new socket (so a new source port and a new flow), one request, one answer. The
/// socket is connected, so only an answer from the address it sent to is accepted: a
/// reply that escaped reverse NAT counts as lost.
fn udp_exchange(target: SocketAddrV4, buf: &mut [u8]) -> Result<usize, Failure> {
    let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).map_err(|e| ("bind", e.kind()))?;
    socket.connect(target).map_err(|e| ("connect", e.kind()))?;
    socket
        .set_read_timeout(Some(UDP_TIMEOUT))
        .map_err(|e| ("SO_RCVTIMEO", e.kind()))?;
    socket.send(REQUEST).map_err(|e| ("send", e.kind()))?;
    socket.recv(buf).map_err(|e| ("receive", e.kind()))
}

fn backend_of(reply: &[u8]) -> Result<usize, Failure> {
    let name = reply.strip_suffix(b"\n").unwrap_or(reply);
    BACKENDS
        .iter()
        .position(|b| b.0.as_bytes() == name)
        .ok_or(("reply", ErrorKind::InvalidData))
}

// ---------------------------------------------------------------------------
// Measuring

/// One segment: a mode's threads for one protocol, in one round.
#[derive(Debug, Clone, Copy)]
struct Segment {
    rate: f64,
    /// Microseconds.
    p99: f64,
}

/// Everything measured for one mode, protocol and S, over all rounds.
struct Stats {
    services: u32,
    mode: Mode,
    proto: Proto,
    programming: Option<Duration>,
    ok: u64,
    failed: u64,
    errors: BTreeMap<String, u64>,
    backends: [u64; 3],
    seconds: f64,
    /// Each round's segment, in round order.
    rounds: Vec<Segment>,
    /// Sorted latencies in nanoseconds.
    latencies: Vec<u32>,
}

impl Stats {
    fn rate(&self) -> f64 {
        self.ok as f64 / self.seconds
    }

    fn percentile_us(&self, p: f64) -> f64 {
        percentile_us(&self.latencies, p)
    }
}

/// Nearest-rank percentile of sorted nanoseconds, in microseconds.
fn percentile_us(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1] as f64 / 1000.0
}

fn measure_size(cfg: &Config, services: u32) -> Result<Vec<Stats>> {
    let set = ServiceSet::new(services);
    let mut worlds = Vec::new();
    for mode in Mode::ALL {
        check_interrupted()?;
        let world = World::build(mode, &set, cfg.threads)
            .with_context(|| format!("set up {}", mode.label()))?;
        match world.programming {
            Some(d) => eprintln!(
                "S = {services}: {} ready, Services programmed in {d:.2?}",
                mode.label()
            ),
            None => eprintln!("S = {services}: {} ready", mode.label()),
        }
        worlds.push(world);
    }
    for world in &worlds {
        for proto in [Proto::Tcp, Proto::Udp] {
            world
                .warm_up(proto)
                .with_context(|| format!("warm up {}", world.mode.label()))?;
        }
    }
    // [world][proto]
    let mut totals: Vec<[(Sample, f64, Vec<Segment>); 2]> =
        worlds.iter().map(|_| Default::default()).collect();
    for round in 0..cfg.rounds {
        for (p, proto) in [Proto::Tcp, Proto::Udp].into_iter().enumerate() {
            for k in 0..worlds.len() {
                // Rotate the order each round so no mode always runs first or last.
                let w = (k + round) % worlds.len();
                check_interrupted()?;
                let world = &worlds[w];
                let mut sample = world
                    .measure(proto, cfg.threads, cfg.segment(proto))
                    .with_context(|| format!("measure {} {}", world.mode.label(), proto.key()))?;
                sample.latencies.sort_unstable();
                let seconds = sample.elapsed.as_secs_f64();
                let (total, total_seconds, segments) = &mut totals[w][p];
                segments.push(Segment {
                    rate: sample.ok as f64 / seconds,
                    p99: percentile_us(&sample.latencies, 0.99),
                });
                *total_seconds += seconds;
                total.merge(sample);
            }
        }
    }
    let mut out = Vec::new();
    for (world, pair) in worlds.iter().zip(totals) {
        for (proto, (mut sample, seconds, rounds)) in [Proto::Tcp, Proto::Udp].into_iter().zip(pair)
        {
            sample.latencies.sort_unstable();
            let stats = Stats {
                services,
                mode: world.mode,
                proto,
                programming: world.programming,
                ok: sample.ok,
                failed: sample.failed(),
                errors: sample.errors,
                backends: sample.backends,
                seconds,
                rounds,
                latencies: sample.latencies,
            };
            if stats.failed > 0 {
                eprintln!(
                    "warning: S = {services}, {} {}: {} of {} exchanges failed: {:?}",
                    world.mode.label(),
                    proto.key(),
                    stats.failed,
                    stats.failed + stats.ok,
                    stats.errors
                );
            }
            out.push(stats);
        }
    }
    eprintln!("S = {services}: measured");
    // The worlds drop here, agent and namespaces with them, before the next S is built.
    Ok(out)
}

// ---------------------------------------------------------------------------
// Reporting

struct Machine {
    cpu: String,
    cores: usize,
    kernel: String,
    iptables: String,
    nft: String,
}

impl Machine {
    fn probe() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or("unknown CPU".into(), |(_, v)| v.trim().to_owned());
        let version = |program: &str, arg: &str| {
            run_cmd(Command::new(program).arg(arg))
                .map(|s| s.trim().to_owned())
                .unwrap_or_else(|e| format!("{program}: {e:#}"))
        };
        Machine {
            cpu,
            cores: thread::available_parallelism().map_or(0, |n| n.get()),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map_or("unknown".into(), |s| s.trim().to_owned()),
            iptables: version("iptables", "--version"),
            nft: version("nft", "--version"),
        }
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// Median and quartiles of some ratios.
#[derive(Debug, Clone, Copy)]
struct Spread {
    median: f64,
    q1: f64,
    q3: f64,
}

impl Spread {
    fn of(mut values: Vec<f64>) -> Spread {
        values.retain(|v| v.is_finite());
        values.sort_by(f64::total_cmp);
        let at = |q: f64| {
            if values.is_empty() {
                return f64::NAN;
            }
            // Linear interpolation between closest ranks.
            let pos = q * (values.len() - 1) as f64;
            let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
            values[lo] + (values[hi] - values[lo]) * (pos - lo as f64)
        };
        Spread {
            median: at(0.5),
            q1: at(0.25),
            q3: at(0.75),
        }
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.2}x (quartiles {:.2}–{:.2})",
            self.median, self.q1, self.q3
        )
    }
}

struct Report<'a> {
    cfg: &'a Config,
    machine: &'a Machine,
    results: &'a [Stats],
    /// /proc/loadavg's 1-minute figure before and after the run.
    load: (String, String),
}

impl Report<'_> {
    fn find(&self, services: u32, mode: Mode, proto: Proto) -> Option<&Stats> {
        self.results
            .iter()
            .find(|s| s.services == services && s.mode == mode && s.proto == proto)
    }

    /// `s` against `base` round by round, through `f` (rate or p99). The two segments
    /// of a round ran within a second of each other, so their ratio is spared most of
    /// the machine's drift and of other tenants' bursts, which hit whole seconds; the
    /// median over rounds is what the tables show.
    fn paired(&self, s: &Stats, base: Mode, f: fn(&Segment) -> f64) -> Spread {
        let ratios = self
            .find(s.services, base, s.proto)
            .map_or(Vec::new(), |b| {
                s.rounds
                    .iter()
                    .zip(&b.rounds)
                    .map(|(x, y)| f(x) / f(y))
                    .collect()
            });
        Spread::of(ratios)
    }

    fn rate_vs(&self, s: &Stats, base: Mode) -> Spread {
        self.paired(s, base, |seg| seg.rate)
    }

    fn p99_vs(&self, s: &Stats, base: Mode) -> Spread {
        self.paired(s, base, |seg| seg.p99)
    }

    fn markdown(&self) -> String {
        let cfg = self.cfg;
        let m = self.machine;
        let mut out = String::new();
        out.push_str(&format!(
            "End to end through a ClusterIP (routed topology of design.md §6: a client pod \
             and three backend pods on one node), one run on this machine: {}, {} cores, \
             kernel {}; {}; {}. Load average (1 min) before / after: {} / {}.\n\n\
             Closed loop, {} client threads. TCP: connect, one request, one response, close \
             (RST); latency from connect to the response. UDP: a new socket (a new flow) per \
             request/response. The measured Service sits in the middle of the S Services; all \
             have {ENDPOINTS} endpoints. Each mode runs {} rounds of {} ms TCP + {} ms UDP, \
             the modes interleaved. Rates and percentiles are over all rounds; the ratios are \
             medians of per-round ratios (rate against kube-proxy's iptables mode and against \
             the client talking straight to the pods), which cancels most of the noise of a \
             shared machine.{}\n",
            m.cpu,
            m.cores,
            m.kernel,
            m.iptables,
            m.nft,
            self.load.0,
            self.load.1,
            cfg.threads,
            cfg.rounds,
            cfg.tcp_segment.as_millis(),
            cfg.udp_segment.as_millis(),
            if cfg.quick {
                " Quick mode: short segments, S up to 1,000."
            } else {
                ""
            }
        ));
        for (proto, title, unit) in [
            (Proto::Tcp, "Short TCP connections", "conn/s"),
            (Proto::Udp, "UDP request/response", "req/s"),
        ] {
            out.push_str(&format!(
                "\n### {title}\n\n\
                 | Services | mode | {unit} | vs iptables | vs no LB | p50 µs | p99 µs | failed |\n\
                 |---:|---|---:|---:|---:|---:|---:|---:|\n"
            ));
            for s in self.results.iter().filter(|s| s.proto == proto) {
                out.push_str(&format!(
                    "| {} | {} | {:.0} | {:.2}x | {:.2}x | {:.1} | {:.1} | {} |\n",
                    s.services,
                    s.mode.label(),
                    s.rate(),
                    self.rate_vs(s, Mode::Iptables).median,
                    self.rate_vs(s, Mode::Direct).median,
                    s.percentile_us(0.50),
                    s.percentile_us(0.99),
                    s.failed
                ));
            }
        }
        out.push_str(
            "\nTime to program the Services (agent start to healthy / iptables-restore / \
             nft -f):\n\n",
        );
        for &services in &cfg.sizes {
            let cells: Vec<String> = [Mode::Ebpf, Mode::Iptables, Mode::Nftables]
                .iter()
                .filter_map(|&mode| {
                    let s = self.find(services, mode, Proto::Tcp)?;
                    Some(format!(
                        "{} {:.2} s",
                        mode.label(),
                        s.programming?.as_secs_f64()
                    ))
                })
                .collect();
            out.push_str(&format!("- S = {services}: {}\n", cells.join(", ")));
        }
        out.push_str(&self.targets_markdown());
        out
    }

    /// The targets at 10,000 Services, or at the largest S measured with a
    /// note that it is not 10,000. Judged on the paired per-round medians; the
    /// quartiles say how firm each verdict is.
    fn targets_markdown(&self) -> String {
        let Some(&largest) = self.cfg.sizes.iter().max() else {
            return String::new();
        };
        let mut out = format!("\n### Targets (issue 6), TCP at S = {largest}");
        if largest < 10_000 {
            out.push_str(" (the targets are set at 10,000; this run stops earlier)");
        }
        out.push_str("\n\n");
        let get = |mode| self.find(largest, mode, Proto::Tcp);
        let (Some(ebpf), Some(ipt), Some(nft), Some(direct)) = (
            get(Mode::Ebpf),
            get(Mode::Iptables),
            get(Mode::Nftables),
            get(Mode::Direct),
        ) else {
            return out + "missing results\n";
        };
        let verdict = |met: bool| if met { "met" } else { "NOT met" };
        let vs_ipt = self.rate_vs(ebpf, Mode::Iptables);
        let vs_direct = self.rate_vs(ebpf, Mode::Direct);
        let p99_vs_ipt = self.p99_vs(ebpf, Mode::Iptables);
        out.push_str(&format!(
            "- connection rate at least 2x iptables' ({:.0} vs {:.0} conn/s): {vs_ipt}: {}\n\
             - p99 latency below iptables' ({:.1} vs {:.1} µs): {p99_vs_ipt} of it: {}\n\
             - within 10% of the no-LB limit ({:.0} vs {:.0} conn/s): {vs_direct}: {}\n\
             - for reference, kube-proxy nftables: {} iptables' rate, {} the no-LB limit\n",
            ebpf.rate(),
            ipt.rate(),
            verdict(vs_ipt.median >= 2.0),
            ebpf.percentile_us(0.99),
            ipt.percentile_us(0.99),
            verdict(p99_vs_ipt.median < 1.0),
            ebpf.rate(),
            direct.rate(),
            verdict(vs_direct.median >= 0.9),
            self.rate_vs(nft, Mode::Iptables),
            self.rate_vs(nft, Mode::Direct),
        ));
        // No load balancer can beat the client talking straight to the pods, so this
        // is the most any of them can reach against iptables on this machine.
        out.push_str(&format!(
            "- ceiling: the no-LB limit itself is {} iptables' rate here\n",
            self.rate_vs(direct, Mode::Iptables)
        ));
        let failed: u64 = self.results.iter().map(|s| s.failed).sum();
        if failed > 0 {
            out.push_str(&format!(
                "- {failed} exchanges failed in this run (see the tables and e2e.json)\n"
            ));
        }
        out
    }

    fn json(&self) -> serde_json::Value {
        let cfg = self.cfg;
        let m = self.machine;
        let spread = |s: Spread| json!({"median": s.median, "q1": s.q1, "q3": s.q3});
        let rows: Vec<serde_json::Value> = self
            .results
            .iter()
            .map(|s| {
                json!({
                    "services": s.services,
                    "mode": s.mode.key(),
                    "label": s.mode.label(),
                    "proto": s.proto.key(),
                    "per_second": s.rate(),
                    "vs_iptables": spread(self.rate_vs(s, Mode::Iptables)),
                    "vs_direct": spread(self.rate_vs(s, Mode::Direct)),
                    "p99_vs_iptables": spread(self.p99_vs(s, Mode::Iptables)),
                    "p50_us": s.percentile_us(0.50),
                    "p90_us": s.percentile_us(0.90),
                    "p99_us": s.percentile_us(0.99),
                    "ok": s.ok,
                    "failed": s.failed,
                    "errors": s.errors,
                    "per_backend": s.backends,
                    "seconds": s.seconds,
                    "round_rates": s.rounds.iter().map(|r| r.rate).collect::<Vec<_>>(),
                    "round_p99_us": s.rounds.iter().map(|r| r.p99).collect::<Vec<_>>(),
                    "programming_s": s.programming.map(|d| d.as_secs_f64()),
                })
            })
            .collect();
        json!({
            "machine": {
                "cpu": m.cpu,
                "cores": m.cores,
                "kernel": m.kernel,
                "iptables": m.iptables,
                "nft": m.nft,
            },
            "load_average_before_after": [self.load.0, self.load.1],
            "quick": cfg.quick,
            "client_threads": cfg.threads,
            "rounds": cfg.rounds,
            "tcp_segment_s": cfg.tcp_segment.as_secs_f64(),
            "udp_segment_s": cfg.udp_segment.as_secs_f64(),
            "endpoints_per_service": ENDPOINTS,
            "results": rows,
        })
    }
}
