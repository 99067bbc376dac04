//! Per-packet cost of the tc and XDP programs, through `BPF_PROG_TEST_RUN`, at
//! growing numbers of installed services (10 endpoints each), each against a
//! do-nothing program of the same hook measured in the same run. Every Service is
//! dual-stack: the IPv6 programs (`tc_ingress` handing IPv6 on to `tc_ingress6` by its
//! tail call, rows of hook `tc6`; `xdp_ingress` to `xdp_ingress6`, rows of hook `xdp6`)
//! are measured on IPv6 frames to the IPv6 ClusterIPs against the same empty program of
//! their hook, fed the same IPv6 frames: what an IPv6 packet pays at the hook.
//!
//! Two methods, both reported:
//! - `repeat`: one packet run `REPEAT` times in the kernel; the kernel's
//!   average. The kernel runs the program on the same buffer each time, so a
//!   packet the program rewrites would be a different packet on the next
//!   run: established flows are measured as a "ping-pong" pair, the flow's
//!   own conntrack entry plus a mirror entry that translates the rewritten
//!   packet back, so that every run is a full established-flow translation.
//!   Not possible for a new flow (the first run creates the flow).
//! - `single`: each run is its own syscall on its own packet; the median of
//!   the kernel's per-run time (which includes the kernel's timer reads, the
//!   same for every case). The only way to measure a new flow.
//!
//! Every sample of a case is taken right after a sample of the empty
//! program, and the ratio reported is the median of those pairs' ratios
//! (see `paired`); the empty program paired with itself shows what that
//! pairing leaves of the machine's noise.
//!
//! After them, hooks on the wire (`wire`): what tc, generic XDP and native XDP cost
//! one packet sent through a veth pair, which `BPF_PROG_TEST_RUN` cannot show for
//! generic XDP.
//!
//! Before all that, what loading the datapath costs (the "Load" table):
//! `LOADS` fresh loads of the whole datapath, each on pins of its own that
//! are removed after it, and per program the time of its load (the kernel
//! verifying it) and the instructions the verifier went through, with the
//! wall time of the whole `Datapath::load`.
//!
//! For profiling one case (`cargo xtask profile` beside it): `--hold HOOK:CASE
//! [--hold-seconds N]` installs the first size, then runs only that case (HOOK `tc`,
//! `xdp`, `tc6` or `xdp6`; CASE `established`, `reply` or `not-a-service`) for N
//! seconds (default 30), and measures nothing else. `--wire` installs the first size
//! and measures only the hooks on the wire (`wire`), printing their table: for
//! comparing two builds' real-packet costs run after run.
//!
//! Usage: `cargo bench -p ebpf-proxy-tests --bench datapath -- [--quick] [--sizes N,..] [--out DIR]`
//! (root). Prints markdown tables and writes `datapath.md` and
//! `datapath.json` to DIR (`rows`: the per-packet rows; `load`: the load
//! report).

mod common;
mod wire;

use std::{
    cell::RefCell,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
    time::{Duration, Instant},
};

use aya::{
    maps::{Array, Map, MapData, RingBuf},
    programs::{SchedClassifier, TestRun, TestRunOptions, Xdp},
};
use ebpf_proxy_tests::frames;
use proxy_common::{Ct6Key, CtKey, ct_dir, map_names};
use proxy_userspace::{
    datapath::{Datapath, PinLayout, program_load},
    maglev::LbAlgorithm,
    model::{BackendAddr, Frontend, FrontendKind, Protocol, ServicePortName},
    planner::Planner,
    source::ObjectKey,
};

const ENDPOINTS: u32 = 10;
/// Established flows measured per hook and size, in turn.
const FLOWS: u16 = 8;
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 2);
const NEW_FLOW: &str = "new flow";
/// `program_names::TC_CT_PAIR` on new flows of its own: the part of a new
/// flow's cost that its two conntrack inserts take by themselves.
const CT_PAIR: &str = "its 2 conntrack inserts alone";
const ESTABLISHED: &str = "established flow";
/// A backend pod's packet from its serving port to a client that reached
/// it directly, by its pod IP (pod to pod, no Service): for no frontend and
/// the reply of no translated flow, from a backend's address and port. No
/// flow marked its tuple, so the prefilter turns it away as it does a
/// packet of no Service; where a mark of another tuple shares its slot,
/// conntrack answers for it.
const FROM_BACKEND: &str = "from a backend, no flow";
/// A packet for no Service that the prefilter passes by chance (its
/// destination key's bit and its block's set by other keys, as the bench's
/// sampled share of such packets are: see `fill`), so that it pays the full
/// path, every lookup of which misses: what each of those costs.
const CHANCE_PASS: &str = "not a service, passed by chance";
/// `CHANCE_PASS`'s destination, in a block of no frontend of the bench.
const CHANCE_DST: Ipv4Addr = Ipv4Addr::new(10, 9, 9, 9);
/// The same two with `ebpf-proxy trace` running: `TRACE_ON` ahead of the
/// clock and the ring buffer drained after each run.
const NEW_FLOW_TRACED: &str = "new flow, trace running";
/// New flows to an ExternalIP with random selection and with Maglev, side
/// by side: the table lookup's cost (`EXTERNAL_IPS`).
const NEW_FLOW_EXTERNAL: &str = "new flow, ExternalIP (random)";
const NEW_FLOW_MAGLEV: &str = "new flow, ExternalIP (Maglev)";
/// Cases of new flows, which have no repeated measurement (the first run
/// creates the flow).
const NOT_REPEATED: [&str; 5] = [
    NEW_FLOW,
    CT_PAIR,
    NEW_FLOW_TRACED,
    NEW_FLOW_EXTERNAL,
    NEW_FLOW_MAGLEV,
];
/// The ExternalIPs of those two cases: random, Maglev.
const EXTERNAL_IPS: [Ipv4Addr; 2] = [
    Ipv4Addr::new(192, 168, 99, 1),
    Ipv4Addr::new(192, 168, 99, 2),
];
const ESTABLISHED_TRACED: &str = "established flow, trace running";
/// An established flow to the Maglev ExternalIP: conntrack answers it
/// before the table is read, so it should cost what a random frontend's
/// does (`ESTABLISHED`).
const ESTABLISHED_MAGLEV: &str = "established flow, ExternalIP (Maglev)";
/// Where the Maglev ExternalIP's established flows take their client
/// ports, past the ClusterIP's (`FLOWS` from the hook's own first port).
const MAGLEV_PORTS_FROM: u16 = 500;

/// The pinned `TRACE_ON` and `TRACE_EVENTS` of the loaded datapath, for the
/// cases with a trace running.
struct Trace {
    on: Array<MapData, u64>,
    events: RingBuf<MapData>,
}

impl Trace {
    fn open(pins: &PinLayout) -> Trace {
        let map = |name: &str| {
            let data = MapData::from_pin(pins.map(name))
                .unwrap_or_else(|e| panic!("opening the pinned {name}: {e}"));
            Map::from_map_data(data).unwrap_or_else(|e| panic!("{name}: {e}"))
        };
        Trace {
            on: map(map_names::TRACE_ON)
                .try_into()
                .expect("TRACE_ON an array"),
            events: map(map_names::TRACE_EVENTS)
                .try_into()
                .expect("TRACE_EVENTS a ring buffer"),
        }
    }

    /// Runs `run` with a trace switched on (a deadline no clock reaches),
    /// then off, and drains the records, whose count it checks against
    /// `records`: a traced case that wrote none measured nothing.
    fn running(&mut self, records: usize, run: impl FnOnce() -> f64) -> f64 {
        self.on.set(0, u64::MAX, 0).expect("switching the trace on");
        let ns = run();
        self.on.set(0, 0, 0).expect("switching the trace off");
        let mut read = 0;
        while self.events.next().is_some() {
            read += 1;
        }
        assert_eq!(read, records, "records of one traced run");
        ns
    }
}

fn vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a60_0000 + i) // 10.96.0.0/12
}

fn backend_ip(service: u32, k: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a80_0000 + service * ENDPOINTS + k) // 10.128.0.0/9
}

/// The IPv6 ClusterIP of Service `i` (`fd00:96::/64`).
fn vip6(i: u32) -> Ipv6Addr {
    Ipv6Addr::from(0xfd00_0096_0000_0000_0000_0000_0000_0000u128 + u128::from(i))
}

/// IPv6 endpoints repeat after this many Services: the backend table holds 2^20,
/// which IPv4's million endpoints at 100,000 Services nearly fill. A backend
/// shared by frontends is one entry (refcounted), and what a packet costs does not
/// depend on how many there are.
const V6_BACKEND_SERVICES: u32 = 2_048;

fn backend_ip6(service: u32, k: u32) -> Ipv6Addr {
    let n = (service % V6_BACKEND_SERVICES) * ENDPOINTS + k;
    Ipv6Addr::from(0xfd00_0128_0000_0000_0000_0000_0000_0000u128 + u128::from(n))
}

/// Service `i`'s IPv6 frontend: the second of its dual-stack pair.
fn frontend6(i: u32) -> Frontend {
    let backends = (0..ENDPOINTS)
        .map(|k| BackendAddr::remote(IpAddr::V6(backend_ip6(i, k)), 8080, Protocol::Tcp))
        .collect();
    let service = ServicePortName::new("bench", &format!("svc-{i}"), "", Protocol::Tcp);
    Frontend::cluster_ip(service, IpAddr::V6(vip6(i)), 80, backends)
}

fn frontend(i: u32) -> Frontend {
    let backends = (0..ENDPOINTS)
        .map(|k| BackendAddr::remote(IpAddr::V4(backend_ip(i, k)), 8080, Protocol::Tcp))
        .collect();
    let service = ServicePortName::new("bench", &format!("svc-{i}"), "", Protocol::Tcp);
    Frontend::cluster_ip(service, IpAddr::V4(vip(i)), 80, backends)
}

/// The ExternalIP `ip` of 10 backends on this node (no SNAT: the cost is
/// the DNAT's), balanced by `algorithm`.
fn external(ip: Ipv4Addr, algorithm: LbAlgorithm) -> Frontend {
    let backends = (0..ENDPOINTS)
        .map(|k| BackendAddr {
            local: true,
            ..BackendAddr::remote(IpAddr::V4(backend_ip(0, k)), 8080, Protocol::Tcp)
        })
        .collect();
    let service = ServicePortName::new("bench", &format!("ext-{ip}"), "", Protocol::Tcp);
    Frontend {
        kind: FrontendKind::ExternalIp,
        lb_algorithm: Some(algorithm),
        ..Frontend::cluster_ip(service, IpAddr::V4(ip), 80, backends)
    }
}

/// Programs the two [`EXTERNAL_IPS`], random then Maglev.
fn install_externals(planner: &mut Planner, datapath: &mut Datapath) {
    for (ip, algorithm) in EXTERNAL_IPS
        .into_iter()
        .zip([LbAlgorithm::Random, LbAlgorithm::Maglev])
    {
        let owner = ObjectKey {
            namespace: "bench".into(),
            name: format!("ext-{ip}"),
        };
        let out = planner.sync_service(&owner, &[external(ip, algorithm)], &mut datapath.maps);
        assert!(
            out.errors.is_empty(),
            "programming {owner:?}: {:?}",
            out.errors
        );
    }
}

/// `singles` new flows to each of the [`EXTERNAL_IPS`], a port each.
fn external_flows(singles: usize, fresh_port: &mut impl FnMut() -> u16) -> [Vec<Vec<u8>>; 2] {
    EXTERNAL_IPS.map(|ip| {
        (0..singles)
            .map(|i| {
                let src = Ipv4Addr::from(u32::from(CLIENT) + 0x0003_0000 + i as u32 / 60000);
                tcp(src, fresh_port(), ip, 80, 0x02)
            })
            .collect()
    })
}

/// A TCP segment with valid checksums.
fn tcp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> Vec<u8> {
    frames::build(&frames::Spec {
        src,
        dst,
        sport,
        dport,
        proto: frames::TCP,
        tcp_flags: flags,
        payload: vec![],
        udp_no_csum: false,
    })
}

const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, 2);

/// An IPv6 TCP segment with a valid checksum.
fn tcp6(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, flags: u8) -> Vec<u8> {
    frames::build6(&frames::Spec6 {
        src,
        dst,
        sport,
        dport,
        proto: frames::TCP,
        tcp_flags: flags,
        payload: vec![],
        ext: vec![],
    })
}

/// A program of either hook.
#[derive(Clone, Copy)]
enum Prog<'a> {
    Tc(&'a SchedClassifier),
    Xdp(&'a Xdp),
}

impl Prog<'_> {
    /// Runs `frame` `repeat` times; the kernel-measured time per run, and
    /// the output frame.
    fn run(self, frame: &[u8], repeat: u32) -> (Duration, Vec<u8>) {
        let mut out = vec![0u8; frame.len() + 64];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.data_out = Some(&mut out);
        opts.repeat = repeat;
        let result = match self {
            Prog::Tc(p) => p.test_run(opts),
            Prog::Xdp(p) => p.test_run(opts),
        }
        .expect("BPF_PROG_TEST_RUN");
        out.truncate(result.data_size_out as usize);
        (result.duration, out)
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// One case measured against the empty program of its hook. Every sample of
/// the case is taken right after a sample of the floor, and the ratio is the
/// median of those pairs' ratios: this machine's speed drifts by tens of
/// percent over seconds (shared cores), which pairing cancels.
#[derive(Clone, Copy)]
struct Measured {
    ns: f64,
    floor_ns: f64,
    ratio: f64,
}

/// `rounds` rounds of (floor sample, case sample) pairs, one pair per case
/// per round: the cases take turns, so a slow spell of the machine falls on
/// all of them alike rather than on whichever ran then. Sample `i` of a
/// case is `case(i)`, in ns.
fn paired(
    rounds: usize,
    mut floor: impl FnMut() -> f64,
    cases: &mut [&mut dyn FnMut(usize) -> f64],
) -> Vec<Measured> {
    let mut samples = vec![(Vec::new(), Vec::new(), Vec::new()); cases.len()];
    for i in 0..rounds {
        for (case, (floors, values, ratios)) in cases.iter_mut().zip(samples.iter_mut()) {
            let f = floor();
            let c = case(i);
            floors.push(f);
            values.push(c);
            ratios.push(c / f);
        }
    }
    samples
        .into_iter()
        .map(|(mut floors, mut values, mut ratios)| Measured {
            ns: median(&mut values),
            floor_ns: median(&mut floors),
            ratio: median(&mut ratios),
        })
        .collect()
}

struct Case {
    name: &'static str,
    /// One-packet runs.
    single: Measured,
    /// The kernel's average over `repeat` runs of one packet (not for new
    /// flows).
    repeated: Option<Measured>,
}

struct Row {
    hook: &'static str,
    services: u32,
    program_s: f64,
    cases: Vec<Case>,
}

/// Adds the mirror of conntrack entry `key`: the entry for the packet as
/// `key`'s entry rewrites it, translating it back (see the module doc).
fn add_mirror(datapath: &mut Datapath, key: CtKey) {
    let entry = datapath
        .maps
        .conntrack
        .get(&key, 0)
        .expect("the flow's conntrack entry");
    let mut mirror_key = key;
    let mut mirror = entry;
    if entry.dir == ct_dir::FORWARD {
        mirror_key.dst_be = entry.nat_addr_be;
        mirror_key.dport_be = entry.nat_port_be;
        mirror.nat_addr_be = key.dst_be;
        mirror.nat_port_be = key.dport_be;
    } else {
        mirror_key.src_be = entry.nat_addr_be;
        mirror_key.sport_be = entry.nat_port_be;
        mirror.nat_addr_be = key.src_be;
        mirror.nat_port_be = key.sport_be;
    }
    datapath
        .maps
        .conntrack
        .insert(mirror_key, mirror, 0)
        .expect("inserting the mirror entry");
}

/// Tuples sampled at each size for the prefilter's chance passes.
const CHANCE_SAMPLES: u32 = 200_000;

/// What the prefilter holds at one size.
struct Fill {
    size: u32,
    /// Bits set, of its hashed ones (the NodePorts' port bits aside: this
    /// bench has none).
    ones: u32,
    /// The share of packets for no Service whose destination probes pass
    /// by chance: the array's own share of the full path.
    chance: f64,
    /// The same with every backend's source bit set, as an agent keeps
    /// them from its load until its programs are attached (the only time
    /// an earlier agent's programs, which read them, may run), and as an
    /// agent kept them always before: the bits set, and the share.
    with_sources: (u32, f64),
    /// The flows' marks: the share of their slots marked (by the bench's
    /// own flows so far, live in conntrack), and the share of packets for
    /// no Service that pass by chance in all, marks included.
    marks: (f64, f64),
}

/// The prefilter at `size` Services (`install_both`'s): its bits, and the
/// share of packets for no Service that pass it by chance and take the full
/// path after all, sampled: TCP between two pod addresses
/// (10.128.0.0/9, where the backends are), random ports, asked as the
/// datapath asks (`proxy_common::prefilter::turned_away`), over the array
/// alone and with the flows' marks as they are.
fn fill(datapath: &Datapath, size: u32) -> Fill {
    use proxy_common::prefilter::{WORDS, flows::SLOTS, turned_away, word_and_mask};
    use proxy_userspace::{datapath::prefilter::backend_bit, planner::encode::addr_words};
    let prefilter = datapath
        .maps
        .prefilter
        .as_ref()
        .expect("the datapath has a prefilter");
    let marks = datapath
        .maps
        .prefilter_flows
        .as_ref()
        .expect("the datapath has flow marks");
    let mut words: Vec<u64> = (0..WORDS)
        .map(|w| prefilter.word(w).expect("a word of the array"))
        .collect();
    let chance = |words: &[u64], marked: &dyn Fn(u32) -> bool| {
        // splitmix64: the same tuples at every size and in every run.
        let mut state = 0x5eed_u64;
        let mut next = || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        let pod =
            |r: u64| proxy_common::v4_mapped((0x0a80_0000 | (r as u32 & 0x007f_ffff)).to_be());
        let passed = (0..CHANCE_SAMPLES)
            .filter(|_| {
                let (a, b) = (next(), next());
                turned_away(
                    |w| words.get(w as usize).copied(),
                    marked,
                    &pod(a),
                    (a >> 32) as u16,
                    &pod(b),
                    (b >> 32) as u16,
                    6,
                )
                .is_none()
            })
            .count();
        passed as f64 / f64::from(CHANCE_SAMPLES)
    };
    let unmarked = |_: u32| false;
    let measured = chance(&words, &unmarked);
    let in_all = chance(&words, &|slot| marks.is_marked(slot));
    let addrs = (0..size).flat_map(|i| {
        (0..ENDPOINTS)
            .flat_map(move |k| [IpAddr::V4(backend_ip(i, k)), IpAddr::V6(backend_ip6(i, k))])
    });
    for addr in addrs {
        let (word, mask) = word_and_mask(backend_bit(&proxy_common::Backend {
            addr_be: addr_words(addr),
            port_be: 8080u16.to_be(),
            proto: 6,
            flags: 0,
        }));
        words[word as usize] |= mask;
    }
    let ones = |words: &[u64]| words.iter().map(|w| w.count_ones()).sum::<u32>();
    Fill {
        size,
        ones: prefilter.ones(),
        chance: measured,
        with_sources: (ones(&words), chance(&words, &unmarked)),
        marks: (f64::from(marks.marked()) / f64::from(SLOTS), in_all),
    }
}

/// What the prefilter holds at each size. The rows' "not a service" is a
/// packet that passes none of its probes: measured over several ports,
/// the median over them; "passed by chance" one whose destination probes
/// pass (`CHANCE_PASS`).
fn render_fills(fills: &[Fill]) -> String {
    let hashed = f64::from(proxy_common::prefilter::BITS - proxy_common::prefilter::PORTS);
    let mut s = String::from("\n");
    for f in fills {
        let (ones_kept, chance_kept) = f.with_sources;
        let (marked, in_all) = f.marks;
        s.push_str(&format!(
            "Prefilter at {} services: {} bits set ({:.2}% of its hashed bits), {ones_kept} \
             ({:.2}%) with backends' source bits, which an agent keeps from its load until its \
             programs are attached. Of {CHANCE_SAMPLES} TCP tuples between pod addresses, the \
             array passes {:.3}% by chance ({:.3}% with the source bits); with the flows' marks \
             ({:.2}% of their slots marked, by the bench's own flows so far) {:.3}% in all\n",
            f.size,
            f.ones,
            f64::from(f.ones) / hashed * 100.0,
            f64::from(ones_kept) / hashed * 100.0,
            f.chance * 100.0,
            chance_kept * 100.0,
            marked * 100.0,
            in_all * 100.0
        ));
    }
    s
}

/// `CHANCE_PASS`'s frames, to `CHANCE_DST`:80 from one client port each,
/// once the bits a frontend there would set (its key's and its block's
/// `frontends_bit`) are set without a frontend: a chance collision, until
/// the next rebuild, which clears them.
fn chances(datapath: &Datapath) -> Vec<Vec<u8>> {
    use proxy_userspace::{
        datapath::prefilter::landing,
        planner::{MapOp, encode::addr_words},
    };
    let key = proxy_common::ServiceKey {
        addr_be: addr_words(IpAddr::V4(CHANCE_DST)),
        port_be: 80u16.to_be(),
        proto: 6,
        scope: proxy_common::scope::ANY,
    };
    let value = bytemuck::Zeroable::zeroed();
    landing(
        datapath.maps.prefilter.as_deref(),
        &[MapOp::PutService { key, value }],
        || (),
    );
    (0..FLOWS)
        .map(|k| tcp(CLIENT, 1000 + k, CHANCE_DST, 80, 0x10))
        .collect()
}

/// The mirrors' packets are for no frontend and from no backend: the
/// prefilter learns them as it learns any flow it did not see start, by a
/// rebuild from conntrack (a forward mirror's destination key) and a
/// refresh of the flows' marks (a reply mirror's tuple), or it would pass
/// them untranslated after the first run (`ping_pongs` checks it does not).
fn admit_mirrors(datapath: &Datapath) {
    proxy_userspace::datapath::prefilter_rebuild::rebuild(&datapath.maps)
        .expect("rebuilding the prefilter")
        .expect("the datapath has a prefilter");
    proxy_userspace::datapath::prefilter_rebuild::settle(&datapath.maps)
        .expect("settling the prefilter's flow marks");
}

/// Checks that each of `frames` ping-pongs under `prog` as the repeated
/// runs need: translated by one run, back as it was after two (checksums
/// aside, whose two zeros an incremental update may swap). A frame that
/// passed untouched would have its row measure another path.
fn ping_pongs(prog: Prog, frames: Frames, checksums: &[usize], what: &str) {
    let masked = |f: &[u8]| {
        let mut f = f.to_vec();
        for &at in checksums {
            f[at..at + 2].fill(0);
        }
        f
    };
    for (i, frame) in frames.iter().enumerate() {
        let (_, once) = prog.run(frame, 1);
        let (_, twice) = prog.run(frame, 2);
        assert_ne!(
            masked(&once),
            masked(frame),
            "{what} {i}: one run left it untranslated, so its repeated runs would not measure a translation"
        );
        assert_eq!(
            masked(&twice),
            masked(frame),
            "{what} {i}: two runs did not bring it back, so its repeated runs would not ping-pong"
        );
    }
}

/// Where `ping_pongs` finds the checksums of an IPv4 TCP frame (IP header
/// and TCP, no options), and of an IPv6 one (TCP's alone).
const CHECKSUMS: &[usize] = &[14 + 10, 14 + 20 + 16];
const CHECKSUMS6: &[usize] = &[14 + 40 + 16];

fn ct_key(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> CtKey {
    let addr = |ip: Ipv4Addr| u32::from_ne_bytes(ip.octets());
    CtKey::new(
        addr(src),
        addr(dst),
        sport.to_be(),
        dport.to_be(),
        frames::TCP,
    )
}

/// The one of a (tc, XDP) pair of programs that runs at `hook`.
fn of_hook<'a>(hook: &str, (tc, xdp): (&'a SchedClassifier, &'a Xdp)) -> Prog<'a> {
    if hook == "tc" {
        Prog::Tc(tc)
    } else {
        Prog::Xdp(xdp)
    }
}

/// The program an IPv6 packet meets first at `hook` as at its IPv4 twin: at `tc6`
/// `tc_ingress`, at `xdp6` `xdp_ingress`, each handing IPv6 on to its IPv6 program
/// by a tail call.
fn program<'a>(datapath: &'a Datapath, hook: &str) -> Prog<'a> {
    match hook {
        "tc" | "tc6" => Prog::Tc(datapath.tc_program()),
        _ => Prog::Xdp(datapath.xdp_program()),
    }
}

/// Frames, one a run.
type Frames<'a> = &'a [Vec<u8>];

/// Established flows to `target` from `client_port` on, and their replies:
/// several, taken in turn, since one flow's cost depends on what else
/// shares its conntrack hash bucket.
fn establish(
    datapath: &mut Datapath,
    hook: &str,
    target: Ipv4Addr,
    client_port: u16,
) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    // A flow's first packets make and assure it; its mirror entries make
    // repeated runs ping-pong (see the module doc).
    let (mut ests, mut replies, mut mirrors) = (Vec::new(), Vec::new(), Vec::new());
    for port in client_port..client_port + FLOWS {
        let est = tcp(CLIENT, port, target, 80, 0x10);
        let (_, out) = program(datapath, hook).run(&est, 1);
        let backend = Ipv4Addr::new(out[30], out[31], out[32], out[33]);
        let reply = tcp(backend, 8080, CLIENT, port, 0x10);
        program(datapath, hook).run(&reply, 1);
        // The client's packet after the reply assures the flow: its entries
        // move to CONNTRACK, where established flows live.
        program(datapath, hook).run(&est, 1);
        ests.push(est);
        replies.push(reply);
        mirrors.push(ct_key(CLIENT, port, target, 80));
        mirrors.push(ct_key(backend, 8080, CLIENT, port));
    }
    for key in mirrors {
        add_mirror(datapath, key);
    }
    admit_mirrors(datapath);
    let prog = program(datapath, hook);
    ping_pongs(prog, &ests, CHECKSUMS, "established flow");
    ping_pongs(prog, &replies, CHECKSUMS, "reply");
    (ests, replies)
}

/// The "not a service" frames: to an address no frontend or backend has,
/// from one client port each.
fn others() -> Vec<Vec<u8>> {
    (0..FLOWS)
        .map(|k| tcp(CLIENT, 1000 + k, Ipv4Addr::new(10, 1, 2, 3), 80, 0x10))
        .collect()
}

/// `FROM_BACKEND`'s frames: from the first Service's backends' serving
/// port to the client, one client port each, which no flow has.
fn from_backends() -> Vec<Vec<u8>> {
    (0..FLOWS)
        .map(|k| tcp(backend_ip(0, u32::from(k)), 8080, CLIENT, 1000 + k, 0x10))
        .collect()
}

/// `from_backends` over IPv6.
fn from_backends6() -> Vec<Vec<u8>> {
    (0..FLOWS)
        .map(|k| {
            tcp6(
                backend_ip6(0, u32::from(k)),
                8080,
                CLIENT6,
                1000 + k,
                frames::ACK,
            )
        })
        .collect()
}

/// IPv6's "not a service" frames: to an address no frontend or backend
/// has.
fn others6() -> Vec<Vec<u8>> {
    (0..FLOWS)
        .map(|k| {
            tcp6(
                CLIENT6,
                1000 + k,
                Ipv6Addr::new(0xfd00, 1, 2, 3, 0, 0, 0, 4),
                80,
                frames::ACK,
            )
        })
        .collect()
}

/// The cases of one hook at one size: `program` against `floor`.
fn measure_hook(
    datapath: &mut Datapath,
    hook: &'static str,
    target: Ipv4Addr,
    client_port: u16,
    (news, traced_news, pairs, externals): (Frames, Frames, Frames, [Frames; 2]),
    (repeat, rounds, singles): (u32, usize, usize),
    trace: &RefCell<Trace>,
) -> Vec<Case> {
    datapath.load_floors().expect("loading the floor programs");
    let (ests, replies) = establish(datapath, hook, target, client_port);
    let (maglev_ests, _) = establish(
        datapath,
        hook,
        EXTERNAL_IPS[1],
        client_port + MAGLEV_PORTS_FROM,
    );

    let floor = of_hook(hook, datapath.floors().expect("floor programs loaded"));
    let ct_pair = of_hook(
        hook,
        datapath.ct_pairs().expect("conntrack pair programs loaded"),
    );
    let program = program(datapath, hook);
    let floor_frame = tcp(CLIENT, 1000, target, 80, 0x10);
    let (others, from_backends, chances) = (others(), from_backends(), chances(datapath));
    let ns = |prog: Prog, frame: &[u8], repeat: u32| prog.run(frame, repeat).0.as_nanos() as f64;

    let singles_of = paired(
        singles,
        || ns(floor, &floor_frame, 1),
        &mut [
            &mut |_| ns(floor, &floor_frame, 1),
            &mut |i| ns(program, &others[i % others.len()], 1),
            &mut |i| ns(program, &from_backends[i % from_backends.len()], 1),
            &mut |i| ns(program, &chances[i % chances.len()], 1),
            &mut |i| ns(program, &news[i], 1),
            &mut |i| ns(ct_pair, &pairs[i], 1),
            &mut |i| ns(program, &ests[i % ests.len()], 1),
            &mut |i| ns(program, &replies[i % replies.len()], 1),
            // XDP leaves nothing of a new flow to tc here: one record each.
            &mut |i| {
                trace
                    .borrow_mut()
                    .running(1, || ns(program, &traced_news[i], 1))
            },
            &mut |i| {
                trace
                    .borrow_mut()
                    .running(0, || ns(program, &ests[i % ests.len()], 1))
            },
            &mut |i| ns(program, &externals[0][i], 1),
            &mut |i| ns(program, &externals[1][i], 1),
            &mut |i| ns(program, &maglev_ests[i % maglev_ests.len()], 1),
        ],
    );
    let repeated_of = paired(
        rounds,
        || ns(floor, &floor_frame, repeat),
        &mut [
            &mut |_| ns(floor, &floor_frame, repeat),
            &mut |i| ns(program, &others[i % others.len()], repeat),
            &mut |i| ns(program, &from_backends[i % from_backends.len()], repeat),
            &mut |i| ns(program, &chances[i % chances.len()], repeat),
            &mut |i| ns(program, &ests[i % ests.len()], repeat),
            &mut |i| ns(program, &replies[i % replies.len()], repeat),
            &mut |i| {
                trace
                    .borrow_mut()
                    .running(0, || ns(program, &ests[i % ests.len()], repeat))
            },
            &mut |i| ns(program, &maglev_ests[i % maglev_ests.len()], repeat),
        ],
    );
    // The pair program's entries go again, so that the conntrack map fills
    // only with the pipeline's own, as before that case existed (a full LRU
    // map would make later inserts evict).
    for pair in pairs {
        let p = frames::parse_checked(pair, "conntrack pair frame");
        for key in [
            ct_key(p.src, p.sport, p.dst, p.dport),
            ct_key(p.dst, p.dport, p.src, p.sport),
        ] {
            let _ = datapath.maps.ct_new.remove(&key);
        }
    }
    let names = [
        "empty program",
        "not a service",
        FROM_BACKEND,
        CHANCE_PASS,
        NEW_FLOW,
        CT_PAIR,
        ESTABLISHED,
        "reply (reverse NAT)",
        NEW_FLOW_TRACED,
        ESTABLISHED_TRACED,
        NEW_FLOW_EXTERNAL,
        NEW_FLOW_MAGLEV,
        ESTABLISHED_MAGLEV,
    ];
    // New flows have no repeated measurement (the first run creates them).
    let mut repeated = repeated_of.into_iter();
    names
        .into_iter()
        .zip(singles_of)
        .map(|(name, single)| Case {
            name,
            single,
            repeated: if NOT_REPEATED.contains(&name) {
                None
            } else {
                repeated.next()
            },
        })
        .collect()
}

/// [`add_mirror`] for an IPv6 flow's entry in `CONNTRACK6`.
fn add_mirror6(datapath: &mut Datapath, key: Ct6Key) {
    let conntrack6 = datapath
        .maps
        .conntrack6
        .as_mut()
        .expect("CONNTRACK6 is loaded");
    let entry = conntrack6
        .get(&key, 0)
        .expect("the flow's CONNTRACK6 entry");
    let mut mirror_key = key;
    let mut mirror = entry;
    if entry.dir == ct_dir::FORWARD {
        mirror_key.dst_be = entry.nat_addr_be;
        mirror_key.dport_be = entry.nat_port_be;
        mirror.nat_addr_be = key.dst_be;
        mirror.nat_port_be = key.dport_be;
    } else {
        mirror_key.src_be = entry.nat_addr_be;
        mirror_key.sport_be = entry.nat_port_be;
        mirror.nat_addr_be = key.src_be;
        mirror.nat_port_be = key.sport_be;
    }
    conntrack6
        .insert(mirror_key, mirror, 0)
        .expect("inserting the mirror entry");
}

fn ct6_key(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16) -> Ct6Key {
    let addr = |ip: Ipv6Addr| -> [u32; 4] {
        let o = ip.octets();
        std::array::from_fn(|i| {
            u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
        })
    };
    Ct6Key::new(
        addr(src),
        addr(dst),
        sport.to_be(),
        dport.to_be(),
        frames::TCP,
    )
}

/// The destination address of an IPv6 frame.
fn dst6(frame: &[u8]) -> Ipv6Addr {
    <[u8; 16]>::try_from(&frame[38..54])
        .expect("16 bytes")
        .into()
}

/// `FLOWS` established IPv6 flows to `target` from client ports
/// `first_port..`, as [`establish`] makes IPv4's: their client's packets and
/// their backends' answers.
fn establish6(
    datapath: &mut Datapath,
    target: Ipv6Addr,
    first_port: u16,
) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let (mut ests, mut replies, mut mirrors) = (Vec::new(), Vec::new(), Vec::new());
    let tc6 = program(datapath, "tc6");
    for port in first_port..first_port + FLOWS {
        let est = tcp6(CLIENT6, port, target, 80, frames::ACK);
        let (_, out) = tc6.run(&est, 1);
        let backend = dst6(&out);
        let reply = tcp6(backend, 8080, CLIENT6, port, frames::ACK);
        tc6.run(&reply, 1);
        tc6.run(&est, 1);
        ests.push(est);
        replies.push(reply);
        mirrors.push(ct6_key(CLIENT6, port, target, 80));
        mirrors.push(ct6_key(backend, 8080, CLIENT6, port));
    }
    for key in mirrors {
        add_mirror6(datapath, key);
    }
    admit_mirrors(datapath);
    (ests, replies)
}

/// IPv6 at `hook` (`tc6`: `tc_ingress` and its tail call to `tc_ingress6`; `xdp6`:
/// `xdp_ingress` and its tail call to `xdp_ingress6`) at one size, as
/// [`measure_hook`] measures IPv4: the empty program of the hook as its floor, on
/// IPv6 frames. No conntrack-pair reference: that program is IPv4's.
fn measure6(
    datapath: &mut Datapath,
    hook: &str,
    size: u32,
    fresh_port: &mut dyn FnMut() -> u16,
    (repeat, rounds, singles): (u32, usize, usize),
) -> Vec<Case> {
    const FIRST_PORT: u16 = 4000;
    // A service in the middle of what is installed; new flows from a client
    // address per 60,000 ports, apart from every earlier size's.
    let target = vip6(size / 2);
    let news: Vec<Vec<u8>> = (0..singles)
        .map(|i| {
            let src =
                Ipv6Addr::from(u128::from(CLIENT6) + 1 + u128::from(size) + (i as u128 / 60_000));
            tcp6(src, fresh_port(), target, 80, frames::SYN)
        })
        .collect();
    datapath.load_floors().expect("loading the floor programs");
    let (ests, replies) = establish6(datapath, target, FIRST_PORT);
    assert!(
        if hook == "tc6" {
            datapath.tc6_handed_on()
        } else {
            datapath.xdp6_loaded()
        },
        "{hook}: the IPv6 program is not in its hand-on slot: the rows would measure the \
         IPv4 program's hand-on alone"
    );
    let floors = datapath.floors().expect("floor programs loaded");
    let floor = if hook == "tc6" {
        Prog::Tc(floors.0)
    } else {
        Prog::Xdp(floors.1)
    };
    let program = program(datapath, hook);
    ping_pongs(program, &ests, CHECKSUMS6, "established IPv6 flow");
    ping_pongs(program, &replies, CHECKSUMS6, "IPv6 reply");
    let floor_frame = tcp6(CLIENT6, 1000, target, 80, frames::ACK);
    let (others, from_backends) = (others6(), from_backends6());
    let ns = |prog: Prog, frame: &[u8], repeat: u32| prog.run(frame, repeat).0.as_nanos() as f64;
    let singles_of = paired(
        singles,
        || ns(floor, &floor_frame, 1),
        &mut [
            &mut |_| ns(floor, &floor_frame, 1),
            &mut |i| ns(program, &others[i % others.len()], 1),
            &mut |i| ns(program, &from_backends[i % from_backends.len()], 1),
            &mut |i| ns(program, &news[i], 1),
            &mut |i| ns(program, &ests[i % ests.len()], 1),
            &mut |i| ns(program, &replies[i % replies.len()], 1),
        ],
    );
    let repeated_of = paired(
        rounds,
        || ns(floor, &floor_frame, repeat),
        &mut [
            &mut |_| ns(floor, &floor_frame, repeat),
            &mut |i| ns(program, &others[i % others.len()], repeat),
            &mut |i| ns(program, &from_backends[i % from_backends.len()], repeat),
            &mut |i| ns(program, &ests[i % ests.len()], repeat),
            &mut |i| ns(program, &replies[i % replies.len()], repeat),
        ],
    );
    let names = [
        "empty program",
        "not a service",
        FROM_BACKEND,
        NEW_FLOW,
        ESTABLISHED,
        "reply (reverse NAT)",
    ];
    let mut repeated = repeated_of.into_iter();
    names
        .into_iter()
        .zip(singles_of)
        .map(|(name, single)| Case {
            name,
            single,
            repeated: if name == NEW_FLOW {
                None
            } else {
                repeated.next()
            },
        })
        .collect()
}

/// Programs Services `*installed..size` (their frontends of `frontend`, owners
/// named `<prefix>-<i>`); the seconds it took.
fn install(
    planner: &mut Planner,
    datapath: &mut Datapath,
    (installed, size): (&mut u32, u32),
    prefix: &str,
    frontend: fn(u32) -> Frontend,
) -> f64 {
    let started = Instant::now();
    while *installed < size {
        let owner = ObjectKey {
            namespace: "bench".into(),
            name: format!("{prefix}-{installed}"),
        };
        let out = planner.sync_service(&owner, &[frontend(*installed)], &mut datapath.maps);
        assert!(
            out.errors.is_empty(),
            "programming {owner:?}: {:?}",
            out.errors
        );
        *installed += 1;
    }
    started.elapsed().as_secs_f64()
}

/// Programs both families' Services up to `size`: the seconds each took.
/// The IPv6 halves apart, so that the IPv4 programming time stays what it
/// measured before; both before any measuring, so that every row of this
/// size sees the same maps.
fn install_both(
    planner: &mut Planner,
    datapath: &mut Datapath,
    (installed, installed6): (&mut u32, &mut u32),
    size: u32,
) -> (f64, f64) {
    let v4 = install(planner, datapath, (installed, size), "svc", frontend);
    let v6 = install(planner, datapath, (installed6, size), "svc6", frontend6);
    (v4, v6)
}

fn main() {
    let args = common::Args::from_env();
    let quick = args.flag("--quick");
    let out_dir = args.out_dir().expect("--out");
    // `--sizes 10,1000` measures only those sizes (for profiling one case).
    let sizes = args.sizes().expect("--sizes").unwrap_or_else(|| {
        if quick {
            vec![10, 1_000, 10_000]
        } else {
            vec![10, 1_000, 10_000, 100_000]
        }
    });
    // Many short rounds rather than a few long ones: the pairing with the
    // floor (see `paired`) cancels drift only over the span of one pair.
    let params = if quick {
        (10_000, 25, 2_000)
    } else {
        (20_000, 51, 10_000)
    };
    let (repeat, rounds, singles) = params;

    if let Some(what) = args.value("--hold").expect("--hold") {
        let seconds = args.number("--hold-seconds").expect("--hold-seconds");
        return hold(what, sizes[0], seconds);
    }
    if args.flag("--wire") {
        return wire_alone(sizes[0], quick);
    }
    let loads = measure_loads(if quick { 2 } else { LOADS });
    let pins = bench_pins();
    let _cleanup = Cleanup(pins.clone());
    let mut datapath = open(&pins);
    let trace = RefCell::new(Trace::open(&pins));
    let mut planner = Planner::new();
    install_externals(&mut planner, &mut datapath);
    let mut installed = 0u32;
    let mut installed6 = 0u32;
    let mut rows = Vec::new();
    let mut fills = Vec::new();
    let mut next_port = 1024u16;
    let mut fresh_port = || {
        next_port = next_port.checked_add(1).unwrap_or(1024);
        next_port
    };

    for &size in &sizes {
        let (program_s, program6_s) = install_both(
            &mut planner,
            &mut datapath,
            (&mut installed, &mut installed6),
            size,
        );
        fills.push(fill(&datapath, size));
        // Target a service in the middle of what is installed.
        let target = vip(size / 2);
        for (hook, client_port) in [("tc", 2000u16), ("xdp", 3000u16)] {
            // New flows: a distinct source port (and so a conntrack miss) each;
            // the conntrack pair program's from other client addresses, so
            // that neither case finds the other's entries.
            let mut flows = |first_client: u32| -> Vec<Vec<u8>> {
                (0..singles)
                    .map(|i| {
                        let src = Ipv4Addr::from(first_client + (i as u32 / 60000) + size);
                        tcp(src, fresh_port(), target, 80, 0x02)
                    })
                    .collect()
            };
            let news = flows(u32::from(CLIENT) + 1);
            let pairs = flows(u32::from(CLIENT) + 0x0001_0000);
            let traced_news = flows(u32::from(CLIENT) + 0x0002_0000);
            let externals = external_flows(singles, &mut fresh_port);
            let cases = measure_hook(
                &mut datapath,
                hook,
                target,
                client_port,
                (&news, &traced_news, &pairs, [&externals[0], &externals[1]]),
                (repeat, rounds, singles),
                &trace,
            );
            rows.push(Row {
                hook,
                services: size,
                program_s,
                cases,
            });
        }
        for hook in ["tc6", "xdp6"] {
            let cases = measure6(&mut datapath, hook, size, &mut fresh_port, params);
            rows.push(Row {
                hook,
                services: size,
                program_s: program6_s,
                cases,
            });
        }
        eprintln!(
            "{size} services: programmed in {program_s:.2}s (IPv6 frontends {program6_s:.2}s), \
             measured"
        );
    }

    let mut table = render(&rows, repeat);
    table.push_str(&render_fills(&fills));
    table.push_str(&flood(&mut datapath, if quick { 1 } else { 10 }));
    let wire = on_the_wire(&mut datapath, installed, quick);
    table.push_str(&wire.render());
    table.push_str(&render_loads(&loads));
    println!("{table}");
    write_results(&out_dir, &table, &json(&rows, &loads, &wire.json()));
}

/// The pins of this run's datapath.
fn bench_pins() -> PinLayout {
    PinLayout::new(format!(
        "/sys/fs/bpf/ebpf-proxy-bench-{}",
        std::process::id()
    ))
}

/// The datapath every case runs on, on `pins`, with the flows' marks as the
/// agent's housekeeping leaves them once its programs run: what conntrack
/// holds, so that every flow a test makes must mark its own replies.
fn open(pins: &PinLayout) -> Datapath {
    let datapath =
        Datapath::load(pins.clone()).expect("loading the datapath (root, bpffs mounted?)");
    proxy_userspace::datapath::prefilter_rebuild::settle(&datapath.maps)
        .expect("settling the prefilter's flow marks");
    datapath
}

/// `--hold HOOK:CASE`: runs that case alone at `size` Services for `seconds`
/// (30 unless given), so that a profiler sampling the machine meanwhile sees
/// its path only.
fn hold(what: &str, size: u32, seconds: Option<usize>) {
    const HOOKS: [&str; 4] = ["tc", "xdp", "tc6", "xdp6"];
    const CASES: [&str; 3] = ["established", "reply", "not-a-service"];
    let seconds = Duration::from_secs(seconds.unwrap_or(30) as u64);
    let (hook, case) = what
        .split_once(':')
        .filter(|(hook, case)| HOOKS.contains(hook) && CASES.contains(case))
        .unwrap_or_else(|| {
            panic!(
                "--hold {what:?}: expected HOOK:CASE, HOOK one of {HOOKS:?}, CASE one of {CASES:?}"
            )
        });
    let pins = bench_pins();
    let _cleanup = Cleanup(pins.clone());
    let datapath = &mut open(&pins);
    install_both(&mut Planner::new(), datapath, (&mut 0, &mut 0), size);
    let frames = match (hook, case) {
        ("tc" | "xdp", "not-a-service") => others(),
        ("tc6" | "xdp6", "not-a-service") => others6(),
        ("tc" | "xdp", "established" | "reply") => {
            let (ests, replies) = establish(datapath, hook, vip(size / 2), 2000);
            if case == "reply" { replies } else { ests }
        }
        ("tc6" | "xdp6", "established" | "reply") => {
            let (ests, replies) = establish6(datapath, vip6(size / 2), 4000);
            if case == "reply" { replies } else { ests }
        }
        _ => unreachable!("checked above"),
    };
    let program = program(datapath, hook);
    eprintln!(
        "holding {hook} {case} at {size} services for {} s: profile it now",
        seconds.as_secs()
    );
    let start = Instant::now();
    let (mut runs, mut ns) = (0u64, 0.0);
    while start.elapsed() < seconds {
        for frame in &frames {
            ns += program.run(frame, 10_000).0.as_nanos() as f64;
            runs += 1;
        }
    }
    eprintln!(
        "{hook} {case}: {:.1} ns a packet on average",
        ns / runs as f64
    );
}

/// `--wire`: the hooks on the wire alone, at `size` Services, printed.
fn wire_alone(size: u32, quick: bool) {
    let pins = bench_pins();
    let _cleanup = Cleanup(pins.clone());
    let datapath = &mut open(&pins);
    install_both(&mut Planner::new(), datapath, (&mut 0, &mut 0), size);
    println!("{}", on_the_wire(datapath, size, quick).render());
}

/// The hooks on the wire (`wire`) with `services` Services installed, on a packet
/// not for any of them: pod to pod, a backend's address and port (over IPv6, to an
/// address no frontend or backend has).
fn on_the_wire(datapath: &mut Datapath, services: u32, quick: bool) -> wire::Wire {
    let not_a_service = tcp(CLIENT, 40_000, backend_ip(0, 0), 8080, 0x10);
    let not_a_service6 = &others6()[0];
    let rounds = if quick { 100 } else { 300 };
    wire::measure(
        datapath,
        services,
        (&not_a_service, not_a_service6),
        rounds,
        4_096,
    )
}

/// `datapath.md` (`table`) and `datapath.json` (`json`) in `out_dir`.
fn write_results(out_dir: &Path, table: &str, json: &str) {
    std::fs::create_dir_all(out_dir).expect("creating the output directory");
    std::fs::write(out_dir.join("datapath.md"), table).expect("writing datapath.md");
    std::fs::write(out_dir.join("datapath.json"), json).expect("writing datapath.json");
}

/// Fresh loads of the whole datapath the Load table is made of.
const LOADS: usize = 5;

/// One program over the fresh loads.
struct ProgramLoads {
    name: &'static str,
    took: Vec<Duration>,
    /// The kernel's count per load; the same program on the same kernel
    /// verifies alike, so more than one value would be worth seeing.
    verified_insns: Vec<Option<u32>>,
}

struct Loads {
    /// In the datapath's load order.
    programs: Vec<ProgramLoads>,
    /// Each load's programs together.
    programs_total: Vec<Duration>,
    /// Each `Datapath::load`, start to end.
    whole: Vec<Duration>,
}

impl Loads {
    /// Program `name`'s loads, a new entry (after the others) at its first.
    fn program(&mut self, name: &'static str) -> &mut ProgramLoads {
        let index = self
            .programs
            .iter()
            .position(|p| p.name == name)
            .unwrap_or_else(|| {
                self.programs.push(ProgramLoads {
                    name,
                    took: Vec::new(),
                    verified_insns: Vec::new(),
                });
                self.programs.len() - 1
            });
        &mut self.programs[index]
    }
}

/// `runs` loads of the datapath, each on fresh pins removed after it, so that
/// every one creates its maps and verifies every program as an agent's
/// first start on a node does.
fn measure_loads(runs: usize) -> Loads {
    let mut loads = Loads {
        programs: Vec::new(),
        programs_total: Vec::new(),
        whole: Vec::new(),
    };
    for run in 0..runs {
        let pins = PinLayout::new(format!(
            "/sys/fs/bpf/ebpf-proxy-bench-{}-load-{run}",
            std::process::id()
        ));
        let cleanup = Cleanup(pins.clone());
        let started = Instant::now();
        let datapath = Datapath::load(pins).expect("loading the datapath (root, bpffs mounted?)");
        loads.whole.push(started.elapsed());
        let report = datapath.program_loads();
        assert!(
            !report.is_empty(),
            "load {run}: Datapath::load reported no program loads"
        );
        loads.programs_total.push(program_load::total(report));
        for load in report {
            let program = loads.program(load.name);
            program.took.push(load.took);
            program.verified_insns.push(load.verified_insns);
        }
        // The programs go with the object, then the pins: nothing of this
        // load is left for the next to find.
        drop(datapath);
        drop(cleanup);
        eprintln!(
            "load {}/{runs}: {:.2}s",
            run + 1,
            loads.whole[run].as_secs_f64()
        );
    }
    loads
}

/// Median (of an even count the upper middle one, as `median` takes it), least
/// and greatest of `samples`, in ms.
fn spread_ms(samples: &[Duration]) -> (f64, f64, f64) {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    let med = median(&mut ms);
    (med, ms[0], ms[ms.len() - 1])
}

/// The distinct counts of `insns`, least first ("-" for a kernel that keeps
/// none).
fn insns_cell(insns: &[Option<u32>]) -> String {
    let mut counts: Vec<Option<u32>> = insns.to_vec();
    counts.sort();
    counts.dedup();
    counts
        .iter()
        .map(|c| c.map_or("-".to_string(), |n| n.to_string()))
        .collect::<Vec<_>>()
        .join(", ")
}

fn render_loads(loads: &Loads) -> String {
    let runs = loads.whole.len();
    let mut s = format!(
        "\nLoad: {runs} fresh loads of the whole datapath, each on pins of its own (maps \
         created, every program verified, as at an agent's first start on a node); per \
         program, its `load` (the kernel verifying it; for the socket notes' iterators also \
         reading the kernel's BTF and pinning their link), median and min-max ms, and the \
         instructions the verifier processed (the kernel's `verified_insns`, Linux 5.16: \
         each path it walks counts its instructions again; `-` where it keeps none)\n\n"
    );
    s.push_str("| program | load ms | min-max ms | verified insns |\n");
    s.push_str("|---|---:|---:|---:|\n");
    let row = |s: &mut String, name: &str, samples: &[Duration], insns: &str| {
        let (med, min, max) = spread_ms(samples);
        s.push_str(&format!(
            "| {name} | {med:.1} | {min:.1}-{max:.1} | {insns} |\n"
        ));
    };
    for program in &loads.programs {
        row(
            &mut s,
            program.name,
            &program.took,
            &insns_cell(&program.verified_insns),
        );
    }
    row(&mut s, "all programs", &loads.programs_total, "");
    row(&mut s, "`Datapath::load` (wall)", &loads.whole, "");
    s
}

fn json_loads(loads: &Loads) -> String {
    let spread = |samples: &[Duration]| {
        let (med, min, max) = spread_ms(samples);
        format!("{{\"median_ms\":{med:.2},\"min_ms\":{min:.2},\"max_ms\":{max:.2}}}")
    };
    let programs: Vec<String> = loads
        .programs
        .iter()
        .map(|p| {
            // The last load's count: they agree unless the table shows
            // otherwise.
            let insns = p
                .verified_insns
                .last()
                .copied()
                .flatten()
                .map_or("null".to_string(), |n| n.to_string());
            format!(
                "{{\"program\":\"{}\",\"load\":{},\"verified_insns\":{insns}}}",
                p.name,
                spread(&p.took)
            )
        })
        .collect();
    format!(
        "{{\"runs\":{},\"programs\":[{}],\"all_programs\":{},\"datapath_load\":{}}}",
        loads.whole.len(),
        programs.join(","),
        spread(&loads.programs_total),
        spread(&loads.whole)
    )
}

/// Established flows against a flood of new ones, with conntrack at its default
/// size (`--conntrack-max` 131,072 connections): 1,000 TCP connections made and
/// assured through tc, then `times` x 131,072 SYNs from ever new clients and ports
/// (never answered), then one packet of each connection: how many kept their
/// backend, and what a flood packet cost.
fn flood(datapath: &mut Datapath, times: u32) -> String {
    const ESTABLISHED_FLOWS: u16 = 1_000;
    let target = vip(0);
    let tc = |datapath: &Datapath, frame: &[u8]| program(datapath, "tc").run(frame, 1);
    let flows: Vec<(u16, [u8; 4])> = (40_000..40_000 + ESTABLISHED_FLOWS)
        .map(|port| {
            let (_, out) = tc(datapath, &tcp(CLIENT, port, target, 80, 0x02));
            let backend = Ipv4Addr::new(out[30], out[31], out[32], out[33]);
            tc(datapath, &tcp(backend, 8080, CLIENT, port, 0x12));
            tc(datapath, &tcp(CLIENT, port, target, 80, 0x10));
            (port, backend.octets())
        })
        .collect();
    let syns = times * proxy_common::MAX_CONNTRACK / 2;
    let started = Instant::now();
    let mut kernel = Duration::ZERO;
    for i in 0..syns {
        let client = Ipv4Addr::from(0x0aca_0000 + i / 60_000); // 10.202.0.0/16
        let (ns, _) = tc(
            datapath,
            &tcp(client, 1024 + (i % 60_000) as u16, target, 80, 0x02),
        );
        kernel += ns;
    }
    let wall = started.elapsed();
    datapath
        .maps
        .bump_flow_epoch()
        .expect("voiding the flow cache");
    let kept = flows
        .iter()
        .filter(|(port, backend)| {
            let (_, out) = tc(datapath, &tcp(CLIENT, *port, target, 80, 0x10));
            out[30..34] == backend[..]
        })
        .count();
    format!(
        "\nConntrack under a flood (tc, default size: {} connections): {} established \
         connections, then {syns} SYNs from new clients and ports ({times}x what conntrack \
         holds), {:.0} ns of program time each ({:.1} s in all): {kept} of {} connections \
         kept their backend\n",
        proxy_common::MAX_CONNTRACK / 2,
        ESTABLISHED_FLOWS,
        kernel.as_nanos() as f64 / f64::from(syns),
        wall.as_secs_f64(),
        ESTABLISHED_FLOWS
    )
}

fn render(rows: &[Row], repeat: u32) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "Per-packet cost of tc_ingress and xdp_ingress, and of tc_ingress6 and xdp_ingress6 \
         (hooks `tc6`, `xdp6`: IPv6 frames to the Services' IPv6 ClusterIPs, against the same \
         empty program of the hook; at both hooks through the IPv4 program's tail call) \
         (BPF_PROG_TEST_RUN, ns per packet; \
         `single` = median of one-packet runs, `x{repeat}` = median of kernel averages over \
         {repeat} runs of one packet, established flows as a ping-pong pair; ratio = median of \
         (case / empty program of the same hook) over samples taken in pairs, same method; \
         the empty program's own row shows the noise of that pairing)\n\n"
    ));
    s.push_str("| hook | services | case | single ns | ratio | repeat ns | ratio |\n");
    s.push_str("|---|---:|---|---:|---:|---:|---:|\n");
    for row in rows {
        for case in &row.cases {
            let rep_cells = match case.repeated {
                Some(r) => format!("{:.1} | {:.2}x", r.ns, r.ratio),
                None => "- | -".into(),
            };
            s.push_str(&format!(
                "| {} | {} | {} | {:.0} | {:.2}x | {rep_cells} |\n",
                row.hook, row.services, case.name, case.single.ns, case.single.ratio
            ));
        }
    }
    s.push('\n');
    for row in rows.iter().filter(|r| r.hook == "tc") {
        s.push_str(&format!(
            "Programming {} services x {ENDPOINTS} endpoints (cumulative step): {:.2} s\n",
            row.services, row.program_s
        ));
    }
    for row in rows.iter().filter(|r| r.hook == "tc6") {
        s.push_str(&format!(
            "Programming their {} IPv6 frontends (cumulative step): {:.2} s\n",
            row.services, row.program_s
        ));
    }
    for hook in ["tc", "xdp", "tc6", "xdp6"] {
        let of_hook: Vec<&Row> = rows.iter().filter(|r| r.hook == hook).collect();
        if let (Some(first), Some(last)) = (of_hook.first(), of_hook.last()) {
            let est = |r: &Row| {
                r.cases
                    .iter()
                    .find(|c| c.name == ESTABLISHED)
                    .and_then(|c| c.repeated)
                    .expect("established is repeated")
            };
            let (a, b) = (est(first), est(last));
            s.push_str(&format!(
                "\n{hook}: established flow (repeat) at {} vs {} services: {:+.1}% in ns, \
                 {:+.1}% relative to the empty program measured alongside",
                last.services,
                first.services,
                (b.ns / a.ns - 1.0) * 100.0,
                (b.ratio / a.ratio - 1.0) * 100.0
            ));
        }
    }
    s.push('\n');
    s
}

/// The rows under `rows`, the load report under `load`, the hooks on the wire
/// under `wire`.
fn json(rows: &[Row], loads: &Loads, wire: &str) -> String {
    let measured = |m: &Measured| {
        format!(
            "{{\"ns\":{:.2},\"floor_ns\":{:.2},\"ratio\":{:.3}}}",
            m.ns, m.floor_ns, m.ratio
        )
    };
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            let cases: Vec<String> = r
                .cases
                .iter()
                .map(|c| {
                    format!(
                        "{{\"case\":\"{}\",\"single_ns\":{:.1},\"repeat_ns\":{},\
                         \"single\":{},\"repeat\":{}}}",
                        c.name,
                        c.single.ns,
                        c.repeated
                            .map_or("null".to_string(), |m| format!("{:.2}", m.ns)),
                        measured(&c.single),
                        c.repeated.as_ref().map_or("null".to_string(), measured)
                    )
                })
                .collect();
            format!(
                "{{\"hook\":\"{}\",\"services\":{},\"program_s\":{:.3},\"cases\":[{}]}}",
                r.hook,
                r.services,
                r.program_s,
                cases.join(",")
            )
        })
        .collect();
    format!(
        "{{\"rows\":[{}],\"load\":{},\"wire\":{wire}}}\n",
        rows.join(","),
        json_loads(loads)
    )
}

struct Cleanup(PinLayout);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = proxy_userspace::datapath::cleanup(&self.0);
    }
}
