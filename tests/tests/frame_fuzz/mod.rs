//! The datapath's tc and XDP programs on seeded random and mutated frames
//! through `BPF_PROG_TEST_RUN`, every output checked against the property of
//! `ebpf_proxy_tests::fuzz`. Shared by the test (`tests/fuzz_frames.rs`: a
//! short run) and the bench (benches/fuzz.rs: a million frames and more).
//!
//! The programs run in a network namespace of their own holding the node's
//! uplink and permanent neighbours, so that the FIB lookups of routed
//! (SNATed, NodePort) packets have one fixed answer.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    sync::atomic::{AtomicU32, Ordering},
};

use aya::{
    maps::IterableMap,
    programs::{TestRun, TestRunOptions},
};
use ebpf_proxy_tests::{
    frames::{TCP, UDP},
    fuzz::{
        self, Conntrack, DropReason, Frontend as Fe, Generator, Hook, Outcome, Rng, Tally, Tuple,
        Universe,
    },
    netns::{NetNs, unique_stem},
    topology::{one_node, two_node},
};
use proxy_common::{CtKey, CtTimeouts, CtValue, counter, ct_dir, ct_flags};
use proxy_userspace::{
    datapath::{Datapath, PinLayout},
    model::{
        BackendAddr, Cidr, Frontend, FrontendKey, FrontendKind, NoEndpointAction, Protocol, Scope,
        ServicePortName,
    },
    planner::{MapOp, MapStore, Planner},
    source::ObjectKey,
};

const CLIENT: Ipv4Addr = one_node::CLIENT.1;
const VIP: Ipv4Addr = one_node::CLUSTER_IP;
const EMPTY_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const DROP_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const HAIRPIN_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 40);
const AFFINITY_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 50);
const HAIRPIN_SRC: Ipv4Addr = Ipv4Addr::new(169, 254, 42, 1);
const BACKENDS: [Ipv4Addr; 3] = one_node::BACKEND_IPS;
const NODE_IP: Ipv4Addr = two_node::NODE_A_IP;
const PEER_NODE: Ipv4Addr = two_node::NODE_B_IP;
const OUTSIDE: Ipv4Addr = two_node::CLIENT1.1;
const OUTSIDE_DENIED: Ipv4Addr = two_node::CLIENT2.1;
const REMOTE_POD: Ipv4Addr = two_node::NODE_B_POD;
const LB_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 60, 10);
const NODE_PORT: u16 = 30080;
const UDP_NODE_PORT: u16 = 30053;
const EMPTY_NODE_PORT: u16 = 30082;
const UPLINK_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
const OUTSIDE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x64];

/// Frames between resets of conntrack, so that the table never fills (a
/// full LRU map would drop entries the checker then misses).
const RESET_EVERY: u64 = 4096;
/// Violations kept in full for the report.
const KEEP: usize = 20;

/// A datapath loaded on its own pins, programmed with the fuzz's frontends,
/// and the namespace its programs run in; both removed on drop.
pub struct Fixture {
    datapath: Datapath,
    pins: PinLayout,
    ns: NetNs,
    uplink: u32,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = proxy_userspace::datapath::cleanup(&self.pins);
    }
}

/// What a run found.
pub struct Report {
    pub seed: u64,
    pub frames: u64,
    pub tally: Tally,
    /// Every violation, described in full for the first few.
    pub violations: u64,
    pub details: Vec<String>,
    /// Datapath counters moved during the run, by name.
    pub counters: Vec<(&'static str, u64)>,
}

impl Report {
    pub fn summary(&self) -> String {
        let mut out = format!(
            "seed {:#x}: {} frames, {} program runs, {} violations\n\n{}",
            self.seed,
            self.frames,
            self.tally.total(),
            self.violations,
            self.tally.table()
        );
        out += "\ndatapath counters moved: ";
        let moved: Vec<String> = self
            .counters
            .iter()
            .filter(|(_, n)| *n > 0)
            .map(|(name, n)| format!("{name} {n}"))
            .collect();
        out += &moved.join(", ");
        out.push('\n');
        for d in &self.details {
            out += &format!("\n{d}\n");
        }
        out
    }

    /// Panics, naming the seed, unless the run kept the property.
    pub fn assert_clean(&self) {
        assert!(
            self.violations == 0,
            "{} of {} program runs broke the property (seed {:#x}; rerun with \
             EBPF_PROXY_FUZZ_SEED={:#x}):\n{}",
            self.violations,
            self.tally.total() + self.violations,
            self.seed,
            self.seed,
            self.summary()
        );
    }
}

fn unique_root() -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    if !proxy_userspace::datapath::pins::is_bpffs(std::path::Path::new("/sys/fs/bpf")) {
        let status = std::process::Command::new("mount")
            .args(["-t", "bpf", "bpf", "/sys/fs/bpf"])
            .status()
            .expect("running mount");
        assert!(status.success(), "mounting bpffs on /sys/fs/bpf failed");
    }
    PathBuf::from(format!(
        "/sys/fs/bpf/ebpf-proxy-fuzz-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

fn mac_text(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

fn protocol(proto: u8) -> Protocol {
    if proto == TCP {
        Protocol::Tcp
    } else {
        Protocol::Udp
    }
}

/// The frontends programmed, as the checker sees them: a ClusterIP for TCP
/// and UDP, one without endpoints that rejects and one that drops, one with
/// ClientIP affinity, one whose backend reaches itself (hairpin), NodePorts
/// (TCP, UDP) whose backend is on another node (SNAT, routed), a NodePort
/// without endpoints, and a LoadBalancer IP with source ranges.
pub fn universe() -> Universe {
    let on = |addr, port, proto, backends: &[Ipv4Addr], target| Fe {
        addr,
        port,
        proto,
        backends: backends.iter().map(|b| (*b, target)).collect(),
        drop_when_empty: false,
        snat: false,
        allowed: None,
    };
    let remote = |fe: Fe| Fe { snat: true, ..fe };
    Universe {
        frontends: vec![
            on(VIP, 80, TCP, &BACKENDS, 8080),
            on(VIP, 53, UDP, &BACKENDS, 5353),
            on(EMPTY_VIP, 80, TCP, &[], 0),
            on(EMPTY_VIP, 53, UDP, &[], 0),
            Fe {
                drop_when_empty: true,
                ..on(DROP_VIP, 80, TCP, &[], 0)
            },
            on(AFFINITY_VIP, 443, TCP, &BACKENDS, 8443),
            on(HAIRPIN_VIP, 80, TCP, &BACKENDS[..1], 8080),
            remote(on(NODE_IP, NODE_PORT, TCP, &[REMOTE_POD], 8080)),
            remote(on(NODE_IP, UDP_NODE_PORT, UDP, &[REMOTE_POD], 5353)),
            on(NODE_IP, EMPTY_NODE_PORT, TCP, &[], 0),
            remote(Fe {
                allowed: Some(vec![OUTSIDE]),
                ..on(LB_IP, 80, TCP, &[REMOTE_POD], 8080)
            }),
        ],
        node_ip: NODE_IP,
        snat_ports: proxy_common::SNAT_PORT_MIN..=proxy_common::SNAT_PORT_MAX,
        hairpin_src: HAIRPIN_SRC,
        clients: vec![CLIENT, OUTSIDE, OUTSIDE_DENIED],
        // As `fixture` sets them up in the node's namespace.
        routes: vec![
            (Ipv4Addr::new(192, 168, 50, 0), 24),
            (Ipv4Addr::new(10, 1, 2, 0), 24),
            (Ipv4Addr::new(192, 168, 60, 0), 24),
            (Ipv4Addr::new(10, 200, 0, 0), 24),
        ],
    }
}

/// The model's frontend for one of `universe()`'s.
fn programmed(fe: &Fe) -> Frontend {
    let protocol = protocol(fe.proto);
    let (ip, kind) = if fe.addr == NODE_IP {
        (Ipv4Addr::UNSPECIFIED, FrontendKind::NodePort)
    } else if fe.addr == LB_IP {
        (fe.addr, FrontendKind::LoadBalancer)
    } else {
        (fe.addr, FrontendKind::ClusterIp)
    };
    Frontend {
        key: FrontendKey {
            ip: IpAddr::V4(ip),
            port: fe.port,
            protocol,
            scope: Scope::Any,
        },
        kind,
        service: ServicePortName {
            namespace: "fuzz".into(),
            name: format!("{}-{}", fe.addr, fe.port),
            port: fe.port.to_string(),
            protocol,
        },
        service_port: fe.port,
        backends: fe
            .backends
            .iter()
            .map(|(ip, port)| BackendAddr {
                ip: IpAddr::V4(*ip),
                port: *port,
                protocol,
                local: !fe.snat,
                terminating: false,
            })
            .collect(),
        no_endpoints: if fe.drop_when_empty {
            NoEndpointAction::Drop
        } else {
            NoEndpointAction::Reject
        },
        affinity_timeout_s: (fe.addr == AFFINITY_VIP).then_some(10_800),
        source_ranges: match &fe.allowed {
            Some(clients) => clients
                .iter()
                .map(|c| Cidr::parse(&format!("{c}/32")).expect("a /32"))
                .collect(),
            None => Vec::new(),
        },
        lb_algorithm: None,
    }
}

pub fn fixture() -> Fixture {
    let pins = PinLayout::new(unique_root());
    let mut datapath = Datapath::load(pins.clone())
        .unwrap_or_else(|e| panic!("loading the datapath under {pins:?}: {e}"));
    // The flows' marks as the agent's housekeeping leaves them once its
    // programs run: what conntrack holds, so that every flow a test makes
    // must mark its own replies.
    proxy_userspace::datapath::prefilter_rebuild::settle(&datapath.maps)
        .expect("settling the prefilter's flow marks");
    // Every frame's own verdict is the property, not the node's budget of
    // rejects (`rejects_are_held_to_the_icmp_error_budget` shows that): a
    // burst larger than a run's rejects.
    datapath
        .limit_rejects(u32::MAX, u32::MAX)
        .expect("lifting the reject budget for the fuzz run");
    let ns = NetNs::create(&format!("{}-fuzz", unique_stem())).expect("namespace for the FIB");
    let up = mac_text(UPLINK_MAC);
    for args in [
        vec![
            "link", "add", "up0", "address", &up, "type", "veth", "peer", "name", "up0p",
        ],
        vec!["addr", "add", "192.168.50.1/24", "dev", "up0"],
        vec!["link", "set", "up0p", "up"],
        vec!["link", "set", "up0", "up"],
        vec!["route", "add", "10.1.2.0/24", "via", "192.168.50.2"],
        vec!["route", "add", "192.168.60.0/24", "dev", "up0"],
        // The pods of this node, where answers to their NodePort flows go.
        vec!["route", "add", "10.200.0.0/24", "dev", "up0"],
    ] {
        ns.ip(&args).expect("uplink setup");
    }
    for (ip, mac) in [
        (PEER_NODE, PEER_MAC),
        (OUTSIDE, OUTSIDE_MAC),
        (OUTSIDE_DENIED, OUTSIDE_MAC),
        (CLIENT, OUTSIDE_MAC),
    ] {
        ns.ip(&[
            "neigh",
            "add",
            &ip.to_string(),
            "lladdr",
            &mac_text(mac),
            "dev",
            "up0",
            "nud",
            "permanent",
        ])
        .expect("neighbour");
    }
    ns.sysctl("net.ipv4.ip_forward", "1").expect("forwarding");
    let uplink = ns
        .run(|| nix::net::if_::if_nametoindex("up0"))
        .expect("run in namespace")
        .expect("uplink ifindex");
    let maps = &mut datapath.maps;
    for (key, value) in proxy_userspace::planner::node::node_addrs(&[NODE_IP], &[]) {
        maps.apply(&MapOp::PutNodeAddr { key, value })
            .expect("node addresses");
    }
    maps.apply(&MapOp::SetNodeConfig {
        config: proxy_common::NodeConfig {
            snat_addr_be: proxy_common::v4_mapped(u32::from_ne_bytes(NODE_IP.octets())),
            snat_port_min: proxy_common::SNAT_PORT_MIN,
            snat_port_max: proxy_common::SNAT_PORT_MAX,
            flags: 0,
            ct_source_share: 0,
        },
    })
    .expect("node config");
    let mut planner = Planner::new();
    for (i, fe) in universe().frontends.iter().enumerate() {
        let owner = ObjectKey {
            namespace: "fuzz".into(),
            name: format!("svc{i}"),
        };
        let out = planner.sync_service(&owner, &[programmed(fe)], &mut datapath.maps);
        assert!(
            out.errors.is_empty(),
            "programming {}:{}: {:?}",
            fe.addr,
            fe.port,
            out.errors
        );
    }
    Fixture {
        datapath,
        pins,
        ns,
        uplink,
    }
}

/// Conntrack as the checker asks about it.
struct Table<'a>(&'a Datapath);

fn ct_key(t: &Tuple) -> CtKey {
    CtKey::new(
        u32::from_ne_bytes(t.src.octets()),
        u32::from_ne_bytes(t.dst.octets()),
        t.sport.to_be(),
        t.dport.to_be(),
        t.proto,
    )
}

/// What a packet of `t` becomes by `entry` (the datapath's
/// `conntrack::translation`).
fn translate(t: &Tuple, entry: &CtValue) -> (Tuple, bool) {
    let ip = |be: u32| Ipv4Addr::from(be.to_ne_bytes());
    let two_sided = entry.flags & ct_flags::TWO_SIDED != 0;
    let mut out = *t;
    if entry.dir == ct_dir::FORWARD {
        (out.dst, out.dport) = (ip(entry.nat_addr_be), u16::from_be(entry.nat_port_be));
        if two_sided {
            (out.src, out.sport) = (ip(entry.alt_addr_be), u16::from_be(entry.alt_port_be));
        }
    } else {
        (out.src, out.sport) = (ip(entry.nat_addr_be), u16::from_be(entry.nat_port_be));
        if two_sided {
            (out.dst, out.dport) = (ip(entry.alt_addr_be), u16::from_be(entry.alt_port_be));
        }
    }
    (out, entry.flags & ct_flags::REDIRECT != 0)
}

/// Whether `entry`, of a flow of `proto`, is live: the datapath takes an
/// expired entry for none, as it does the closed flow's entry a SYN opening
/// its tuple again voided in place (its clock 0) until the new flow is
/// written over it.
fn live(entry: &CtValue, proto: u8) -> bool {
    !entry.expired(
        proto,
        proxy_userspace::housekeeping::conntrack::monotonic_ns(),
        &CtTimeouts::DEFAULT,
    )
}

impl Conntrack for Table<'_> {
    fn translation(&self, t: &Tuple) -> Option<(Tuple, bool)> {
        // Assured flows first, as the datapath looks them up.
        let maps = &self.0.maps;
        let key = ct_key(t);
        let entry = [&maps.conntrack, &maps.ct_new]
            .into_iter()
            .find_map(|map| map.get(&key, 0).ok().filter(|e| live(e, key.proto)))?;
        Some(translate(t, &entry))
    }

    fn address_translations(
        &self,
        proto: u8,
        src: Ipv4Addr,
        dst: Ipv4Addr,
    ) -> Vec<(Ipv4Addr, Ipv4Addr)> {
        let (src_be, dst_be) = (
            u32::from_ne_bytes(src.octets()),
            u32::from_ne_bytes(dst.octets()),
        );
        let maps = &self.0.maps;
        maps.conntrack
            .iter()
            .chain(maps.ct_new.iter())
            .filter_map(Result::ok)
            .filter(|(k, v)| {
                k.proto == proto && k.src_be == src_be && k.dst_be == dst_be && live(v, proto)
            })
            .map(|(k, v)| {
                let t = Tuple {
                    proto,
                    src,
                    sport: u16::from_be(k.sport_be),
                    dst,
                    dport: u16::from_be(k.dport_be),
                };
                let (to, _) = translate(&t, &v);
                (to.src, to.dst)
            })
            .collect()
    }
}

impl Fixture {
    /// `hook`'s verdict and output on `input`, run in the node's namespace
    /// (the caller's thread must be in it); an error when `BPF_PROG_TEST_RUN`
    /// refuses the frame.
    fn run(&self, hook: Hook, input: &[u8]) -> Result<(u32, Vec<u8>), String> {
        let mut out = vec![0u8; input.len() + 256];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(input);
        opts.data_out = Some(&mut out);
        let result = match hook {
            Hook::Tc => {
                // __sk_buff: ingress_ifindex at 36, ifindex at 40.
                let mut ctx = [0u8; 192];
                ctx[36..40].copy_from_slice(&self.uplink.to_ne_bytes());
                ctx[40..44].copy_from_slice(&self.uplink.to_ne_bytes());
                opts.ctx_in = Some(&ctx);
                self.datapath.tc_program().test_run(opts)
            }
            Hook::Xdp => {
                // xdp_md: data_end at 4, ingress_ifindex at 12.
                let mut md = [0u8; 24];
                md[4..8].copy_from_slice(&(input.len() as u32).to_ne_bytes());
                md[12..16].copy_from_slice(&self.uplink.to_ne_bytes());
                opts.ctx_in = Some(&md);
                self.datapath.xdp_program().test_run(opts)
            }
        }
        .map_err(|e| e.to_string())?;
        out.truncate(result.data_size_out as usize);
        Ok((result.return_value, out))
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        self.datapath.maps.counters().expect("reading counters")
    }

    /// Empties both conntrack maps (and voids every CPU's cached copies).
    fn reset_conntrack(&mut self) {
        let maps = &self.datapath.maps;
        for map in [&maps.conntrack, &maps.ct_new] {
            let keys: Vec<CtKey> = map.keys().filter_map(Result::ok).collect();
            proxy_userspace::datapath::batch::delete(map.map(), &keys).expect("emptying conntrack");
        }
        self.datapath
            .maps
            .bump_flow_epoch()
            .expect("bumping the flow epoch");
    }
}

/// The seed to use: `EBPF_PROXY_FUZZ_SEED` (decimal or 0x-hex) to replay a
/// run, else a new one.
pub fn seed() -> u64 {
    match std::env::var("EBPF_PROXY_FUZZ_SEED") {
        Ok(s) => {
            let s = s.trim();
            s.strip_prefix("0x")
                .map_or_else(|| s.parse(), |h| u64::from_str_radix(h, 16))
                .unwrap_or_else(|e| panic!("EBPF_PROXY_FUZZ_SEED={s:?}: {e}"))
        }
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
    }
}

/// Feeds `frames` frames, each to tc and to XDP, and checks every output.
/// `sweep` first runs every TCP flag combination on each TCP flow kind.
pub fn run(seed: u64, frames: u64, sweep: bool) -> Report {
    let mut fx = fixture();
    let ns = fx.ns.path();
    let before = fx.counters();
    let mut report = ebpf_proxy_tests::netns::run_in(&ns, || {
        let mut state = Run::new(seed);
        if sweep {
            state.flag_sweep(&mut fx);
        }
        for i in 0..frames {
            if i % RESET_EVERY == 0 {
                fx.reset_conntrack();
                state.generator.forget();
            }
            let input = state.generator.frame(&mut state.rng);
            state.one(&fx, &input, i);
        }
        state.into_report(frames)
    })
    .expect("running in the node namespace");
    let after = fx.counters();
    report.counters = after
        .iter()
        .zip(&before)
        .map(|((name, a), (_, b))| (*name, a - b))
        .collect();
    check_drop_counters(&mut report);
    report
}

/// Every drop on purpose is counted, and every reject: the counters moved
/// exactly as the outcomes say.
fn check_drop_counters(report: &mut Report) {
    let moved = |name: &str| {
        report
            .counters
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |(_, v)| *v)
    };
    let t = &report.tally;
    let both = |o: Outcome| t.get(Hook::Tc, o) + t.get(Hook::Xdp, o);
    let expected = [
        (
            counter::NAMES[counter::DROP_NO_ENDPOINT as usize],
            both(Outcome::Dropped(DropReason::NoEndpoint)),
        ),
        (
            counter::NAMES[counter::DROP_SOURCE_RANGE as usize],
            both(Outcome::Dropped(DropReason::SourceRange)),
        ),
        (
            counter::NAMES[counter::REJECT as usize],
            t.get(Hook::Tc, Outcome::Reset)
                + t.get(Hook::Tc, Outcome::PortUnreachable)
                + t.get(Hook::Tc, Outcome::Dropped(DropReason::RejectImpossible)),
        ),
        (
            counter::NAMES[counter::DROP_REJECT_FAILED as usize],
            t.get(Hook::Tc, Outcome::Dropped(DropReason::RejectImpossible)),
        ),
        (
            counter::NAMES[counter::DROP_TTL as usize],
            both(Outcome::Dropped(DropReason::TtlSpent))
                + t.get(Hook::Tc, Outcome::IcmpErrorDropped(DropReason::TtlSpent)),
        ),
        (
            counter::NAMES[counter::DROP_NO_ROUTE as usize],
            both(Outcome::Dropped(DropReason::Unroutable))
                + t.get(Hook::Tc, Outcome::IcmpErrorDropped(DropReason::Unroutable)),
        ),
        (
            counter::NAMES[counter::ICMP_ERROR_TRANSLATED as usize],
            t.get(Hook::Tc, Outcome::IcmpError)
                + t.get(Hook::Tc, Outcome::IcmpErrorDropped(DropReason::TtlSpent))
                + t.get(Hook::Tc, Outcome::IcmpErrorDropped(DropReason::Unroutable)),
        ),
    ];
    for (name, want) in expected {
        let got = moved(name);
        if got != want {
            report.violations += 1;
            report.details.push(format!(
                "counter {name} moved by {got}, but the outcomes say {want}"
            ));
        }
    }
}

struct Run {
    seed: u64,
    rng: Rng,
    generator: Generator,
    universe: Universe,
    tally: Tally,
    violations: u64,
    details: Vec<String>,
    /// The backend each client's affinity connections went to: with the
    /// backends never changing, always the same one.
    stuck: HashMap<Ipv4Addr, Ipv4Addr>,
}

impl Run {
    fn new(seed: u64) -> Self {
        Run {
            seed,
            rng: Rng::new(seed),
            generator: Generator::new(universe()),
            universe: universe(),
            tally: Tally::default(),
            violations: 0,
            details: Vec::new(),
            stuck: HashMap::new(),
        }
    }

    fn into_report(self, frames: u64) -> Report {
        Report {
            seed: self.seed,
            frames,
            tally: self.tally,
            violations: self.violations,
            details: self.details,
            counters: Vec::new(),
        }
    }

    fn violation(&mut self, text: String) {
        self.violations += 1;
        if self.details.len() < KEEP {
            self.details.push(text);
        }
    }

    /// One frame through both hooks, in a random order (each may leave
    /// conntrack entries the other then meets).
    fn one(&mut self, fx: &Fixture, input: &[u8], index: u64) {
        let hooks = if self.rng.chance(50) {
            [Hook::Tc, Hook::Xdp]
        } else {
            [Hook::Xdp, Hook::Tc]
        };
        for hook in hooks {
            // The kernel refuses some frames before any program runs: too
            // short for the hook, or an IPv6 ethertype without an IPv6
            // header. A program's own failure is a verdict, never this.
            let Ok((verdict, output)) = fx.run(hook, input) else {
                self.tally.add(hook, Outcome::Refused);
                continue;
            };
            let table = Table(&fx.datapath);
            let checked = fuzz::check(&self.universe, &table, hook, input, verdict, &output)
                .and_then(|outcome| self.follow(outcome, &output));
            match checked {
                Ok(outcome) => self.tally.add(hook, outcome),
                Err(why) => self.violation(format!(
                    "frame {index}, {hook:?}: {why}\n  input  {}\n  verdict {verdict}\n  output {}",
                    fuzz::hex(input),
                    fuzz::hex(&output)
                )),
            }
        }
    }

    /// Notes a translated packet (its answer is worth sending later) and
    /// checks ClientIP affinity.
    fn follow(&mut self, outcome: Outcome, output: &[u8]) -> Result<Outcome, String> {
        let (Outcome::Forward { .. } | Outcome::Reply { .. }) = outcome else {
            return Ok(outcome);
        };
        let Some(to) = fuzz::tuple_of(output) else {
            return Ok(outcome);
        };
        self.generator.saw(to);
        let affinity = self
            .universe
            .frontends
            .iter()
            .find(|f| f.addr == AFFINITY_VIP)
            .expect("the affinity frontend");
        if matches!(outcome, Outcome::Forward { .. })
            && to.dport == 8443
            && affinity.backends.contains(&(to.dst, to.dport))
        {
            let client = if to.src == HAIRPIN_SRC {
                to.dst
            } else {
                to.src
            };
            let first = *self.stuck.entry(client).or_insert(to.dst);
            if first != to.dst {
                return Err(format!(
                    "client {client} went to {} under ClientIP affinity, after {first}",
                    to.dst
                ));
            }
        }
        Ok(outcome)
    }

    /// Every TCP flag combination on a flow of each kind: to a ClusterIP, to
    /// one without endpoints, to a NodePort (SNAT, routed), and the replies.
    fn flag_sweep(&mut self, fx: &mut Fixture) {
        fx.reset_conntrack();
        let mut index = 0;
        for (src, dst, dport) in [
            (CLIENT, VIP, 80),
            (CLIENT, EMPTY_VIP, 80),
            (OUTSIDE, NODE_IP, NODE_PORT),
            (OUTSIDE, LB_IP, 80),
            (OUTSIDE_DENIED, LB_IP, 80),
            (BACKENDS[0], HAIRPIN_VIP, 80),
        ] {
            for flags in 0..=255u8 {
                let sport = 50000 + u16::from(flags);
                let packet = |src, sport, dst, dport, flags| {
                    fuzz::Packet {
                        src,
                        dst,
                        ttl: 64,
                        id: 1,
                        frag: 0x4000,
                        options: Vec::new(),
                        l4: fuzz::L4::Tcp {
                            sport,
                            dport,
                            seq: 0x1234_5678,
                            flags,
                            options: Vec::new(),
                            payload: Vec::new(),
                        },
                    }
                    .encode()
                };
                // A SYN opens the flow, then the combination in each
                // direction.
                self.one(fx, &packet(src, sport, dst, dport, 0x02), index);
                self.one(fx, &packet(src, sport, dst, dport, flags), index + 1);
                let forward = Tuple {
                    proto: TCP,
                    src,
                    sport,
                    dst,
                    dport,
                };
                if let Some((to, _)) = Table(&fx.datapath).translation(&forward) {
                    let back = to.reversed();
                    self.one(
                        fx,
                        &packet(back.src, back.sport, back.dst, back.dport, flags),
                        index + 2,
                    );
                }
                index += 3;
            }
        }
        fx.reset_conntrack();
    }
}
