//! The IPv6 programs (`tc_ingress6`, and `xdp_ingress6` through
//! `xdp_ingress`'s tail call) on hand-built frames through
//! `BPF_PROG_TEST_RUN`, as tests/datapath.rs does for IPv4: every checksum
//! of every output frame recomputed from scratch (tests/src/frames.rs).
//! Needs root (it loads BPF programs and pins maps).

mod hand_on;
mod node_maps;
mod service_counts;

use std::{
    net::{IpAddr, Ipv6Addr},
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use aya::programs::{SchedClassifier, TestRun, TestRunOptions};
use ebpf_proxy_tests::frames::{
    self as frame, AUTH, DEST_OPTS, FRAGMENT, HOP_BY_HOP, ICMPV6, Spec6, build6, fragment6, icmp6,
    icmp6_error, parse_checked_icmp6_error, parse_checked6, reassemble6,
};
use ebpf_proxy_tests::sctp;
use hand_on::HandOn;
use node_maps::write_service_cidrs;
use proxy_userspace::{
    datapath::{Datapath, PinLayout, ip_summed},
    housekeeping::conntrack,
    model::{BackendAddr, Frontend, FrontendKind, NoEndpointAction, Protocol, ServicePortName},
    planner::Planner,
    source::ObjectKey,
};
use service_counts::{service_id_of, service_totals};

// How tc passes a packet: tcx's `TCX_NEXT` (-1), on to the interface's
// next program and legacy filters, as the kernel's test run reports it.
use ebpf_proxy_tests::fuzz::verdict::{TC_ACT_REDIRECT, TC_ACT_SHOT, TCX_NEXT as TC_PASS};
const SCTP: u8 = 132;

const CLIENT: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 0x11);
const VIP: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);
const EMPTY_VIP: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x20);
const BACKENDS: [Ipv6Addr; 3] = [
    Ipv6Addr::new(0xfd00, 0x10, 0, 1, 0, 0, 0, 0x21),
    Ipv6Addr::new(0xfd00, 0x10, 0, 1, 0, 0, 0, 0x22),
    Ipv6Addr::new(0xfd00, 0x10, 0, 1, 0, 0, 0, 0x23),
];

/// A loaded datapath on its own pin directory, removed on drop even when the
/// test panics.
struct Fixture {
    datapath: Datapath,
    pins: PinLayout,
    planner: Planner,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = proxy_userspace::datapath::cleanup(&self.pins);
    }
}

fn frontend(
    vip: Ipv6Addr,
    port: u16,
    protocol: Protocol,
    target: u16,
    backends: &[Ipv6Addr],
) -> Frontend {
    let backends = backends
        .iter()
        .map(|ip| BackendAddr::remote(IpAddr::V6(*ip), target, protocol))
        .collect();
    let service = ServicePortName::new("test", &format!("v6-{port}"), &port.to_string(), protocol);
    Frontend {
        no_endpoints: NoEndpointAction::Reject,
        ..Frontend::cluster_ip(service, IpAddr::V6(vip), port, backends)
    }
}

/// A pin directory of its own for one test.
fn unique_pins() -> PinLayout {
    static N: AtomicU32 = AtomicU32::new(0);
    if !proxy_userspace::datapath::pins::is_bpffs(std::path::Path::new("/sys/fs/bpf")) {
        let status = std::process::Command::new("mount")
            .args(["-t", "bpf", "bpf", "/sys/fs/bpf"])
            .status()
            .expect("running mount");
        assert!(status.success(), "mounting bpffs on /sys/fs/bpf failed");
    }
    PinLayout::new(format!(
        "/sys/fs/bpf/ebpf-proxy-trun6-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// A datapath loaded on `pins` with conntrack maps of `entries`, the test's
/// IPv6 Services programmed.
fn load_programmed(pins: &PinLayout, entries: u32) -> (Datapath, Planner) {
    let mut datapath = loaded(pins, Datapath::load_sized(pins.clone(), entries));
    let planner = program_services(&mut datapath);
    (datapath, planner)
}

/// The datapath a load on `pins` gave; a load that failed part-way has
/// its pins removed before the test panics, as a fixture's drop would.
fn loaded(
    pins: &PinLayout,
    load: Result<Datapath, proxy_userspace::datapath::DatapathError>,
) -> Datapath {
    let datapath = load.unwrap_or_else(|e| {
        let _ = proxy_userspace::datapath::cleanup(pins);
        panic!("loading the datapath under {}: {e}", pins.root().display())
    });
    // The flows' marks as the agent's housekeeping leaves them once its
    // programs run: what conntrack holds, so that every flow a test makes
    // must mark its own replies.
    proxy_userspace::datapath::prefilter_rebuild::settle(&datapath.maps)
        .expect("settling the prefilter's flow marks");
    datapath
}

/// The fixture on `datapath`, loaded on `pins`, with the test's IPv6
/// Services programmed.
fn programmed(mut datapath: Datapath, pins: PinLayout) -> Fixture {
    let planner = program_services(&mut datapath);
    Fixture {
        datapath,
        pins,
        planner,
    }
}

/// Programs the test's IPv6 Services into `datapath`.
fn program_services(datapath: &mut Datapath) -> Planner {
    let mut planner = Planner::new();
    let services = [
        frontend(VIP, 80, Protocol::Tcp, 8080, &BACKENDS),
        frontend(VIP, 53, Protocol::Udp, 5353, &BACKENDS),
        frontend(EMPTY_VIP, 80, Protocol::Tcp, 0, &[]),
        frontend(EMPTY_VIP, 53, Protocol::Udp, 0, &[]),
    ];
    for (i, fe) in services.iter().enumerate() {
        let owner = ObjectKey {
            namespace: "test".into(),
            name: format!("svc{i}"),
        };
        let out = planner.sync_service(&owner, std::slice::from_ref(fe), &mut datapath.maps);
        assert!(
            out.errors.is_empty(),
            "programming {}: {:?}",
            fe.key,
            out.errors
        );
    }
    planner
}

fn fixture() -> Fixture {
    let pins = unique_pins();
    let (datapath, planner) = load_programmed(&pins, proxy_common::MAX_CONNTRACK);
    Fixture {
        datapath,
        pins,
        planner,
    }
}

/// `program` on one frame: its verdict and the frame it left.
fn run_on(program: &SchedClassifier, input: &[u8]) -> (u32, Vec<u8>) {
    let mut out = vec![0u8; input.len() + 256];
    let mut opts = TestRunOptions::new();
    opts.data_in = Some(input);
    opts.data_out = Some(&mut out);
    let result = program
        .test_run(opts)
        .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN on a {}-byte frame: {e}", input.len()));
    out.truncate(result.data_size_out as usize);
    (result.return_value, out)
}

fn run(fx: &Fixture, input: &[u8]) -> (u32, Vec<u8>) {
    run_on(fx.datapath.tc6_program(), input)
}

fn counter(fx: &Fixture, name: &str) -> u64 {
    fx.datapath
        .maps
        .counters()
        .expect("reading counters")
        .into_iter()
        .find(|(n, _)| *n == name)
        .map_or_else(|| panic!("no counter {name}"), |(_, v)| v)
}

/// The counters that are not zero, for a failure's message: what the
/// programs did with the packets so far.
fn counters_set(fx: &Fixture) -> String {
    fx.datapath
        .maps
        .counters()
        .expect("reading counters")
        .into_iter()
        .filter(|(_, v)| *v != 0)
        .map(|(n, v)| format!("{n}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn spec(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, proto: u8, flags: u8) -> Spec6 {
    Spec6 {
        src,
        dst,
        sport,
        dport,
        proto,
        tcp_flags: flags,
        payload: if proto == frame::UDP {
            b"hello, v6 service".to_vec()
        } else {
            vec![]
        },
        ext: vec![],
    }
}

fn tcp(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16, flags: u8) -> Vec<u8> {
    build6(&spec(src, sport, dst, dport, frame::TCP, flags))
}

fn udp(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16) -> Vec<u8> {
    build6(&spec(src, sport, dst, dport, frame::UDP, 0))
}

/// A client's packet, then the backend's answer, then the client's next:
/// DNAT to one of the backends with the client's address kept, the answer
/// from the frontend again, and the flow staying on its backend.
fn round_trip(fx: &Fixture, proto: u8, port: u16, target: u16, sport: u16) {
    let name = if proto == frame::TCP { "TCP" } else { "UDP" };
    let first = if proto == frame::TCP {
        tcp(CLIENT, sport, VIP, port, frame::SYN)
    } else {
        udp(CLIENT, sport, VIP, port)
    };
    let (ret, out) = run(fx, &first);
    assert_eq!(ret, TC_PASS, "{name} first packet: verdict {ret}");
    let p = parse_checked6(&out, &format!("{name} first packet"));
    assert!(
        BACKENDS.contains(&p.dst),
        "{name} first packet went to {}, not a backend",
        p.dst
    );
    assert_eq!(p.dport, target, "{name} first packet's destination port");
    assert_eq!(
        p.src, CLIENT,
        "{name} first packet lost the client's address"
    );
    assert_eq!(p.sport, sport, "{name} first packet's source port");
    let backend = p.dst;

    let answer = if proto == frame::TCP {
        tcp(backend, target, CLIENT, sport, frame::SYN | frame::ACK)
    } else {
        udp(backend, target, CLIENT, sport)
    };
    let (ret, out) = run(fx, &answer);
    assert_eq!(ret, TC_PASS, "{name} answer: verdict {ret}");
    let r = parse_checked6(&out, &format!("{name} answer"));
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (VIP, port, CLIENT, sport),
        "{name} answer not reverse-translated to the frontend"
    );

    let next = if proto == frame::TCP {
        tcp(CLIENT, sport, VIP, port, frame::ACK)
    } else {
        udp(CLIENT, sport, VIP, port)
    };
    let (_, out) = run(fx, &next);
    let n = parse_checked6(&out, &format!("{name} next packet"));
    assert_eq!(
        (n.dst, n.dport),
        (backend, target),
        "{name} next packet left its flow's backend"
    );
}

#[test]
fn tcp_syn_is_dnated_and_the_reply_reverse_natted() {
    let fx = fixture();
    round_trip(&fx, frame::TCP, 80, 8080, 41000);
    assert_eq!(counter(&fx, "dnat_new"), 1, "new flows");
    assert_eq!(counter(&fx, "rev_nat"), 1, "reverse-translated answers");
    assert_eq!(counter(&fx, "dnat_established"), 1, "established packets");
    assert_eq!(
        counter(&fx, "ct_assured"),
        1,
        "the ACK after the SYN-ACK assures the flow"
    );
    let flows = fx
        .datapath
        .maps
        .conntrack6
        .as_ref()
        .expect("CONNTRACK6 is loaded")
        .iter()
        .count();
    assert_eq!(flows, 2, "a flow has an entry per direction in CONNTRACK6");
}

/// What the tc hook's one program does with IPv6: `tc_ingress` hands it to
/// `tc_ingress6` by its tail call (`TC_NEXT`), so one program run from tcx
/// translates it, as `tc_ingress6` itself does; with the slot empty (the
/// agent could not fill it) it hands the frame on untouched.
#[test]
fn tc_ingress_hands_ipv6_to_tc_ingress6_by_its_tail_call_else_on_untouched() {
    let fx = fixture();
    assert!(
        fx.datapath.tc6_handed_on(),
        "tc_ingress6 is not in TC_NEXT after the load"
    );
    let syn = tcp(CLIENT, 41100, VIP, 80, frame::SYN);
    let (ret, out) = run_on(fx.datapath.tc_program(), &syn);
    assert_eq!(ret, TC_PASS, "SYN through tc_ingress: verdict {ret}");
    let p = parse_checked6(&out, "SYN through tc_ingress");
    assert!(
        BACKENDS.contains(&p.dst) && p.dport == 8080,
        "SYN through tc_ingress went to [{}]:{}, not a backend: the tail call was not taken",
        p.dst,
        p.dport
    );
    assert_eq!(counter(&fx, "dnat_new"), 1, "new flows after the SYN");

    // As the kernel leaves it once the agent holding the array is gone.
    HandOn::open(&fx.datapath).set(false);
    let next = tcp(CLIENT, 41101, VIP, 80, frame::SYN);
    let (ret, out) = run_on(fx.datapath.tc_program(), &next);
    assert_eq!(
        (ret, out.as_slice()),
        (TC_PASS, next.as_slice()),
        "with TC_NEXT empty, tc_ingress must hand the frame on untouched"
    );
    assert_eq!(
        counter(&fx, "dnat_new"),
        1,
        "tc_ingress translated with its slot empty"
    );
    let (ret, out) = run(&fx, &next);
    assert_eq!(
        ret, TC_PASS,
        "the same SYN through tc_ingress6: verdict {ret}"
    );
    let p = parse_checked6(&out, "the same SYN through tc_ingress6");
    assert!(
        BACKENDS.contains(&p.dst),
        "tc_ingress6 sent [{}]:{} to no backend",
        p.dst,
        p.dport
    );
}

/// IPv6's client port opened again while its reset flow is closing, as
/// IPv4's (`datapath.rs`): the new flow starts in `CONNTRACK6`, in the
/// room its closed flow's two entries leave there, is never moved
/// (`ct_assured` stays), and is translated both ways, whether its backend
/// is the closed flow's or another.
#[test]
fn a_client_port_opened_again_starts_its_flow_where_the_closed_one_was() {
    let fx = fixture();
    round_trip(&fx, frame::TCP, 80, 8080, 41_002);
    let (ret, _) = run(&fx, &tcp(CLIENT, 41_002, VIP, 80, frame::RST | frame::ACK));
    assert_eq!(ret, TC_PASS, "the client's RST: verdict");
    let key = ct6_key(CLIENT, 41_002, VIP, 80, frame::TCP);
    let in_conntrack6 = |fx: &Fixture| {
        fx.datapath
            .maps
            .conntrack6
            .as_ref()
            .expect("CONNTRACK6 is loaded")
            .get(&key, 0)
            .ok()
    };
    let closed = in_conntrack6(&fx).expect("the reset flow's forward entry");
    assert_ne!(
        closed.flags & proxy_common::ct_flags::CLOSING,
        0,
        "{closed:?}"
    );
    let before = (counter(&fx, "ct_assured"), entries6(&fx));
    assert_eq!(
        before,
        (1, (2, 0)),
        "(ct_assured, (assured, unassured entries))"
    );

    round_trip(&fx, frame::TCP, 80, 8080, 41_002);
    let forward = in_conntrack6(&fx).expect("the reopened flow's forward entry in CONNTRACK6");
    assert_eq!(
        forward.flags & proxy_common::ct_flags::CLOSING,
        0,
        "{forward:?}"
    );
    assert_ne!(
        forward.flags & proxy_common::ct_flags::ASSURED,
        0,
        "{forward:?}"
    );
    assert_eq!(
        (counter(&fx, "ct_assured"), entries6(&fx)),
        before,
        "(ct_assured, entries) after the reopened connection's handshake: moved, or more entries"
    );
    assert_eq!(counter(&fx, "ct_reopened"), 1, "ct_reopened");

    // Reset and opened again until a new flow has had the closed one's
    // backend (its reply entry written over the voided one in place) and
    // another (the voided one removed): translated both ways either way
    // (`round_trip`), and no entry left over.
    let (mut last, mut same, mut moved, mut cycles) = (forward.nat_addr_be, 0, 0, 0);
    while (same == 0 || moved == 0) && cycles < 60 {
        let (ret, _) = run(&fx, &tcp(CLIENT, 41_002, VIP, 80, frame::RST | frame::ACK));
        assert_eq!(ret, TC_PASS, "cycle {cycles}: the client's RST: verdict");
        round_trip(&fx, frame::TCP, 80, 8080, 41_002);
        cycles += 1;
        let now = in_conntrack6(&fx)
            .unwrap_or_else(|| panic!("cycle {cycles}: no forward entry in CONNTRACK6"))
            .nat_addr_be;
        if now == last {
            same += 1;
        } else {
            moved += 1;
        }
        assert_eq!(
            (counter(&fx, "ct_assured"), entries6(&fx)),
            before,
            "cycle {cycles}: (ct_assured, entries): the flow to {now:?} (before: {last:?}) was \
             moved, or left more entries than its closed one"
        );
        last = now;
    }
    assert!(
        same > 0 && moved > 0,
        "in {cycles} cycles, {same} reopened flows had the closed one's backend and {moved} another"
    );
    assert_eq!(counter(&fx, "ct_reopened"), 1 + cycles, "ct_reopened");
}

/// IPv6's flows hold their client's share of `CONNTRACK6`
/// (`--conntrack-max-per-source`, counted in `CT_SOURCES6`) as IPv4's do
/// (`datapath.rs`): a flow past it stays unassured in `CT_NEW6`, still
/// translated; the reaper's pass counts the client's assured flows as it
/// reads `CONNTRACK6` and writes the count over the datapath's; and once a
/// flow of the client's has gone, its next flow is assured.
#[test]
fn a_client_past_its_share_of_conntrack6_stays_unassured() {
    use proxy_userspace::{
        housekeeping::ct_sources,
        planner::{MapOp, MapStore, node},
    };
    let mut fx = fixture();
    fx.datapath
        .maps
        .apply(&MapOp::SetNodeConfig {
            config: proxy_common::NodeConfig {
                ct_source_share: 1,
                ..node::node_config(None, false)
            },
        })
        .expect("a share of 1");
    let held = |fx: &Fixture| match fx.datapath.maps.ct_sources6.get(&words(CLIENT), 0) {
        Ok(held) => held,
        Err(aya::maps::MapError::KeyNotFound) => 0,
        Err(e) => panic!("reading the client's count in CT_SOURCES6: {e}"),
    };
    let reap = |fx: &mut Fixture| {
        let mut tally = ct_sources::Tally::default();
        let (maps, reap) = fx.datapath.conntrack_reaping();
        let reaped = conntrack::reap_expired(maps, &reap, conntrack::monotonic_ns(), &mut tally)
            .expect("reaping");
        assert_eq!(reaped, 0, "the reaper removed a live flow");
        ct_sources::write(&mut fx.datapath.maps, &tally).expect("writing the clients' counts");
    };
    round_trip(&fx, frame::TCP, 80, 8080, 41_100);
    round_trip(&fx, frame::TCP, 80, 8080, 41_101);
    assert_eq!(
        (held(&fx), entries6(&fx)),
        (1, (2, 2)),
        "(count, (assured, unassured entries)) with a share of 1 and two flows"
    );
    assert!(counter(&fx, "ct_share_refused") >= 1);

    fx.datapath
        .maps
        .ct_sources6
        .insert(words(CLIENT), 9, 0)
        .expect("writing the client's count");
    reap(&mut fx);
    assert_eq!(held(&fx), 1, "the client's count after the reaper's pass");

    fx.datapath
        .maps
        .conntrack6
        .as_mut()
        .expect("CONNTRACK6 is loaded")
        .remove(&ct6_key(CLIENT, 41_100, VIP, 80, frame::TCP))
        .expect("removing the assured flow's forward entry");
    reap(&mut fx);
    assert_eq!(
        held(&fx),
        0,
        "the client's count once its assured flow went"
    );
    round_trip(&fx, frame::TCP, 80, 8080, 41_102);
    assert!(
        fx.datapath
            .maps
            .conntrack6
            .as_ref()
            .expect("CONNTRACK6 is loaded")
            .get(&ct6_key(CLIENT, 41_102, VIP, 80, frame::TCP), 0)
            .is_ok(),
        "back under its share, the client's next flow was not assured"
    );
}

#[test]
fn udp_is_translated_both_ways() {
    let fx = fixture();
    round_trip(&fx, frame::UDP, 53, 5353, 41001);
    assert_eq!(counter(&fx, "dnat_new"), 1, "new flows");
    assert_eq!(counter(&fx, "rev_nat"), 1, "reverse-translated answers");
}

/// Counts of translated packets by the checksum state tc read (none,
/// unknown): `BPF_PROG_TEST_RUN` builds socket buffers without a checksum
/// state (`CHECKSUM_NONE`).
fn csum_states(fx: &Fixture) -> (u64, u64) {
    (counter(fx, "tc_csum_none"), counter(fx, "tc_csum_unknown"))
}

/// tc reads each translated packet's checksum state, counts it, and
/// updates the full checksum in place (round trips of TCP and UDP, every
/// checksum recomputed from scratch); a packet behind extension headers
/// goes through the kernel's helper, its state counted too.
#[test]
fn translated_packets_count_the_checksum_state_tc_read() {
    let fx = fixture();
    assert!(
        matches!(fx.datapath.ip_summed_read(), ip_summed::Read::Kfunc { .. }),
        "this kernel has the kfunc, so tc must read checksum states: {}",
        fx.datapath.ip_summed_read()
    );
    round_trip(&fx, frame::TCP, 80, 8080, 41100);
    round_trip(&fx, frame::UDP, 53, 5353, 41101);
    assert_eq!(
        csum_states(&fx),
        (6, 0),
        "(none, unknown) states tc read for 6 translated packets"
    );
    let mut s = spec(CLIENT, 41102, VIP, 80, frame::TCP, frame::SYN);
    s.ext = vec![DEST_OPTS];
    let (_, out) = run(&fx, &build6(&s));
    parse_checked6(&out, "SYN behind options");
    assert_eq!(
        csum_states(&fx),
        (7, 0),
        "(none, unknown) after a packet behind options"
    );
}

/// The same round trips through the kernel's checksum helper, as on a
/// kernel where tc cannot read checksum states.
#[test]
fn translated_packets_keep_valid_checksums_through_the_checksum_helper() {
    let pins = unique_pins();
    let datapath = loaded(
        &pins,
        Datapath::load_reading(pins.clone(), ip_summed::Read::Unknown),
    );
    let fx = programmed(datapath, pins);
    round_trip(&fx, frame::TCP, 80, 8080, 41110);
    round_trip(&fx, frame::UDP, 53, 5353, 41111);
    assert_eq!(
        csum_states(&fx),
        (0, 6),
        "(none, unknown) states tc read for 6 translated packets"
    );
}

#[test]
fn new_flows_spread_over_every_backend() {
    let fx = fixture();
    let mut seen = std::collections::BTreeMap::new();
    for sport in 20000..20300u16 {
        let (_, out) = run(&fx, &tcp(CLIENT, sport, VIP, 80, frame::SYN));
        *seen.entry(parse_checked6(&out, "SYN").dst).or_insert(0u32) += 1;
    }
    // 300 draws over 3 backends: each gets 100 +- 30 with probability
    // above 1 - 1e-4 (binomial, p = 1/3).
    assert_eq!(seen.len(), 3, "backends reached: {seen:?}");
    assert!(
        seen.values().all(|n| (70..=130).contains(n)),
        "300 new flows over 3 backends: {seen:?}"
    );
}

/// IPv6 rejects spend the node's one ICMP error budget, as IPv4's
/// (`datapath.rs`, `rejects_are_held_to_the_icmp_error_budget`): the
/// burst is answered, the rest dropped and counted.
#[test]
fn rejects_are_held_to_the_icmp_error_budget() {
    let mut fx = fixture();
    fx.datapath
        .limit_rejects(0, 2)
        .expect("writing REJECT_LIMIT");
    let mut verdicts: Vec<u32> = (0..6)
        .map(|i| run(&fx, &tcp(CLIENT, 45_000 + i, EMPTY_VIP, 80, frame::SYN)).0)
        .collect();
    verdicts.push(run(&fx, &udp(CLIENT, 45_100, EMPTY_VIP, 53)).0);
    assert_eq!(
        verdicts,
        [
            TC_ACT_REDIRECT,
            TC_ACT_REDIRECT,
            TC_ACT_SHOT,
            TC_ACT_SHOT,
            TC_ACT_SHOT,
            TC_ACT_SHOT,
            TC_ACT_SHOT
        ],
        "7 rejects against a burst of 2 with no refill"
    );
    assert_eq!(counter(&fx, "reject_rate_limited"), 5);
    assert_eq!(counter(&fx, "reject"), 7, "every reject decided is counted");
}

#[test]
fn no_endpoints_rejects_tcp_with_rst_and_udp_with_icmpv6_port_unreachable() {
    let fx = fixture();
    let syn = tcp(CLIENT, 42000, EMPTY_VIP, 80, frame::SYN);
    let (ret, out) = run(&fx, &syn);
    assert_eq!(
        ret, TC_ACT_REDIRECT,
        "SYN to a frontend without endpoints: verdict {ret}"
    );
    let rst = parse_checked6(&out, "RST");
    assert_eq!(rst.proto, frame::TCP, "the answer to a SYN");
    assert_eq!(
        (rst.src, rst.sport, rst.dst, rst.dport),
        (EMPTY_VIP, 80, CLIENT, 42000),
        "RST addressed from the frontend to the client"
    );
    assert_eq!(rst.l4[13], frame::RST | frame::ACK, "RST flags");
    let ack = u32::from_be_bytes(rst.l4[8..12].try_into().expect("4 bytes"));
    assert_eq!(ack, 0x1234_5679, "RST acknowledges the SYN's sequence + 1");
    assert_eq!(&out[0..6], &syn[6..12], "RST goes back to the sender's MAC");

    let datagram = udp(CLIENT, 42001, EMPTY_VIP, 53);
    let (ret, out) = run(&fx, &datagram);
    assert_eq!(
        ret, TC_ACT_REDIRECT,
        "datagram to a frontend without endpoints: verdict {ret}"
    );
    let icmp = parse_checked6(&out, "ICMPv6 port unreachable");
    assert_eq!(icmp.proto, ICMPV6, "the answer to a datagram");
    assert_eq!(
        (icmp.src, icmp.dst),
        (EMPTY_VIP, CLIENT),
        "ICMPv6 error's addresses"
    );
    assert_eq!(
        (icmp.l4[0], icmp.l4[1]),
        (1, 4),
        "destination unreachable, port unreachable"
    );
    assert_eq!(
        &icmp.l4[8..],
        &datagram[14..14 + 48],
        "the error quotes the datagram's IPv6 and UDP headers"
    );
    assert_eq!(counter(&fx, "reject"), 2, "rejects counted");
}

/// A datagram behind a destination options header, to a frontend without
/// endpoints, is dropped (counted `drop_reject_failed`), as IPv4 drops one
/// with IP options: the port unreachable once sent for it quoted the IPv6
/// header and the options header's first 8 bytes, which hold no ports for
/// the client's stack to find its socket by. A SYN behind options gets no
/// RST either.
#[test]
fn no_endpoints_drop_what_extension_headers_stand_before() {
    let fx = fixture();
    for (what, proto, sport, port, flags) in [
        ("datagram", frame::UDP, 42002, 53, 0),
        ("SYN", frame::TCP, 42003, 80, frame::SYN),
    ] {
        let packet = build6(&Spec6 {
            ext: vec![DEST_OPTS],
            ..spec(CLIENT, sport, EMPTY_VIP, port, proto, flags)
        });
        let (ret, _) = run(&fx, &packet);
        assert_eq!(ret, TC_ACT_SHOT, "{what} behind options: verdict");
    }
    assert_eq!(counter(&fx, "reject"), 2, "rejects decided");
    assert_eq!(
        counter(&fx, "drop_reject_failed"),
        2,
        "rejects that could not be answered"
    );
}

#[test]
fn extension_headers_before_tcp_are_walked() {
    let fx = fixture();
    let mut s = spec(CLIENT, 43000, VIP, 80, frame::TCP, frame::SYN);
    s.ext = vec![HOP_BY_HOP, DEST_OPTS, FRAGMENT];
    let (ret, out) = run(&fx, &build6(&s));
    assert_eq!(ret, TC_PASS, "verdict {ret}");
    let p = parse_checked6(&out, "SYN behind three extension headers");
    assert!(
        BACKENDS.contains(&p.dst),
        "went to {}, not a backend",
        p.dst
    );
    assert_eq!(p.dport, 8080, "destination port");

    // AH counts its length in 4-byte words (RFC 4302), the others in
    // 8-byte units: a 16-byte AH after options, each by its own rule.
    s.sport = 43001;
    s.ext = vec![DEST_OPTS, AUTH];
    let (ret, out) = run(&fx, &build6(&s));
    assert_eq!(ret, TC_PASS, "behind AH: verdict {ret}");
    let p = parse_checked6(&out, "SYN behind options and AH");
    assert!(
        BACKENDS.contains(&p.dst) && (p.sport, p.dport) == (43001, 8080),
        "behind AH: went to [{}]:{} from port {}, not to a backend's 8080",
        p.dst,
        p.dport,
        p.sport
    );

    // Five are more than the datapath walks: passed untouched, counted.
    s.ext = vec![HOP_BY_HOP, DEST_OPTS, DEST_OPTS, DEST_OPTS, DEST_OPTS];
    let long = build6(&s);
    let (ret, out) = run(&fx, &long);
    assert_eq!(
        (ret, &out),
        (TC_PASS, &long),
        "a chain of five headers passes untouched"
    );
    assert_eq!(
        counter(&fx, "pass_v6_ext_headers"),
        1,
        "the unwalked chain counted"
    );

    // A later fragment (offset 1,448 bytes) has no transport header, and
    // no first fragment was translated for it.
    s.ext = vec![FRAGMENT];
    let mut later = build6(&s);
    later[54 + 2..54 + 4].copy_from_slice(&(181u16 << 3).to_be_bytes());
    let (ret, out) = run(&fx, &later);
    assert_eq!(
        (ret, &out),
        (TC_PASS, &later),
        "a later fragment without its first passes untouched"
    );
    assert_eq!(
        counter(&fx, "frag_untracked"),
        1,
        "the later fragment counted"
    );
    assert_eq!(
        counter(&fx, "dnat_new"),
        2,
        "only the walked SYNs were translated"
    );
}

/// A UDP datagram of `len` payload bytes from `src` to `dst`, in fragments of
/// at most 1,448 payload bytes (a 1,500-byte MTU less the IPv6 and fragment
/// headers, rounded down to 8) under `id`.
fn fragmented(src: (Ipv6Addr, u16), dst: (Ipv6Addr, u16), len: usize, id: u32) -> Vec<Vec<u8>> {
    let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let whole = build6(&Spec6 {
        payload,
        ..spec(src.0, src.1, dst.0, dst.1, frame::UDP, 0)
    });
    fragment6(&whole, 1448, id)
}

/// Each of `fragments` through the program: the frames it left, all passed.
fn run_fragments(fx: &Fixture, fragments: &[Vec<u8>], what: &str) -> Vec<Vec<u8>> {
    fragments
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let (ret, out) = run(fx, f);
            assert_eq!(ret, TC_PASS, "{what} fragment {i}: verdict {ret}");
            out
        })
        .collect()
}

/// Only a datagram's first fragment carries the UDP header; the later ones
/// follow its translation, their addresses rewritten, so that the datagram
/// the receiver reassembles has the translated addresses throughout and a
/// checksum that is right for them (recomputed here from scratch).
#[test]
fn a_fragmented_udp_datagram_is_translated_whole_both_ways() {
    let fx = fixture();
    let request = fragmented((CLIENT, 42000), (VIP, 53), 3000, 0x1234_5678);
    assert_eq!(request.len(), 3, "3,000 bytes in 1,448-byte fragments");
    let out = run_fragments(&fx, &request, "request");
    let p = parse_checked6(&reassemble6(&out, "request"), "reassembled request");
    assert!(BACKENDS.contains(&p.dst), "request sent to {}", p.dst);
    assert_eq!(
        (p.src, p.sport, p.dport),
        (CLIENT, 42000, 5353),
        "the request's source and destination port"
    );

    let answer = fragmented((p.dst, 5353), (CLIENT, 42000), 3000, 0x0000_0077);
    let out = run_fragments(&fx, &answer, "answer");
    let r = parse_checked6(&reassemble6(&out, "answer"), "reassembled answer");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (VIP, 53, CLIENT, 42000),
        "the answer must come from the ClusterIP"
    );
    assert_eq!(
        counter(&fx, "frag_translated"),
        4,
        "later fragments translated"
    );
    assert_eq!(counter(&fx, "frag_untracked"), 0, "untracked fragments");
}

/// A later fragment is never translated by a guess: one that arrives before
/// its first fragment, or belongs to a datagram that is no Service's, passes
/// untouched and is counted; once its first fragment was translated, it
/// follows. Fragments of another datagram (another id) are not taken for it.
#[test]
fn later_fragments_without_a_translated_first_one_pass_untouched_and_are_counted() {
    let fx = fixture();
    let early = fragmented((CLIENT, 42001), (VIP, 53), 3000, 0x4343);
    let (ret, out) = run(&fx, &early[1]);
    assert_eq!(
        (ret, &out),
        (TC_PASS, &early[1]),
        "a later fragment before its first one"
    );
    assert_eq!(counter(&fx, "frag_untracked"), 1, "the early fragment");
    let (_, first) = run(&fx, &early[0]);
    let backend = &first[14 + 24..14 + 40];
    assert!(
        BACKENDS.iter().any(|b| b.octets() == backend),
        "first fragment sent to {backend:?}"
    );
    let (_, late) = run(&fx, &early[1]);
    assert_eq!(
        &late[14 + 24..14 + 40],
        backend,
        "the same fragment once its first one was translated"
    );

    let stranger = fragmented((CLIENT, 42001), (VIP, 53), 3000, 0x4344);
    let (ret, out) = run(&fx, &stranger[1]);
    assert_eq!(
        (ret, &out),
        (TC_PASS, &stranger[1]),
        "a later fragment of another datagram between the same hosts"
    );

    let elsewhere = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x99);
    let other = fragmented((CLIENT, 42002), (elsewhere, 53), 3000, 0x4545);
    for (i, f) in other.iter().enumerate() {
        let (ret, out) = run(&fx, f);
        assert_eq!(
            (ret, &out),
            (TC_PASS, f),
            "fragment {i} of a datagram to no Service"
        );
    }
    assert_eq!(counter(&fx, "frag_untracked"), 4, "untracked fragments");
    assert_eq!(counter(&fx, "frag_translated"), 1, "translated fragments");
}

#[test]
fn neighbour_discovery_and_other_icmpv6_pass_untouched() {
    let fx = fixture();
    // A neighbour solicitation for the frontend's address, from the
    // client's link-local address to the solicited-node multicast group.
    let link_local = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0x11);
    let solicited = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 1, 0xff00, 0x10);
    let mut body = vec![0, 0, 0, 0];
    body.extend_from_slice(&VIP.octets());
    body.extend_from_slice(&[1, 1, 0x02, 0, 0, 0, 0, 0xaa]);
    let cases = [
        (
            "neighbour solicitation",
            icmp6(link_local, solicited, 135, 0, &body),
        ),
        (
            "router advertisement",
            icmp6(
                link_local,
                Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1),
                134,
                0,
                &[64, 0, 0x07, 0x08, 0, 0, 0, 0, 0, 0, 0, 0],
            ),
        ),
        (
            "echo request to the frontend",
            icmp6(CLIENT, VIP, 128, 0, &[0, 1, 0, 1]),
        ),
    ];
    for (what, input) in cases {
        let (ret, out) = run(&fx, &input);
        assert_eq!(ret, TC_PASS, "{what}: verdict {ret}");
        assert_eq!(out, input, "{what}: the packet was modified");
    }
    assert_eq!(
        counter(&fx, "pass_malformed"),
        0,
        "ICMPv6 counted as malformed"
    );
}

/// `--conntrack-max` sizes `CONNTRACK6` as it sizes `CONNTRACK`: a pinned map
/// of another size is replaced at load, its IPv6 flows carried over, and the
/// new programs go on translating the carried flow.
#[test]
fn a_conntrack6_map_of_another_size_is_replaced_with_its_flows() {
    struct Unpin(PinLayout);
    impl Drop for Unpin {
        fn drop(&mut self) {
            let _ = proxy_userspace::datapath::cleanup(&self.0);
        }
    }
    let pins = unique_pins();
    let _unpin = Unpin(pins.clone());
    let capacity = || {
        aya::maps::MapInfo::from_pin(pins.map("CONNTRACK6"))
            .expect("CONNTRACK6 pin")
            .max_entries()
    };
    let (first, _) = load_programmed(&pins, 8192);
    assert_eq!(capacity(), 8192, "CONNTRACK6 not sized as asked");
    let (_, out) = run_on(first.tc6_program(), &udp(CLIENT, 45000, VIP, 53));
    let backend = parse_checked6(&out, "first datagram").dst;
    // Answered and asked again: assured, so in `CONNTRACK6`, the map that
    // is resized (`CT_NEW6` keeps its size).
    run_on(first.tc6_program(), &udp(backend, 5353, CLIENT, 45000));
    run_on(first.tc6_program(), &udp(CLIENT, 45000, VIP, 53));
    drop(first);

    let mut resized = Datapath::load_sized(pins.clone(), 16384)
        .unwrap_or_else(|e| panic!("loading with 16384 conntrack entries: {e}"));
    assert_eq!(capacity(), 16384, "CONNTRACK6 was not replaced");
    let flows = resized
        .maps
        .conntrack6
        .as_ref()
        .expect("CONNTRACK6 is loaded")
        .iter()
        .count();
    assert_eq!(flows, 2, "the flow's two entries were not carried over");
    let (_, out) = run_on(resized.tc6_program(), &udp(backend, 5353, CLIENT, 45000));
    let answer = parse_checked6(&out, "answer after the resize");
    assert_eq!(
        (answer.src, answer.sport),
        (VIP, 53),
        "the carried flow's answer was not reverse-translated"
    );
    assert_eq!(
        resized.finish_resize().map(|r| r.expect("finishing")),
        Some(0),
        "nothing new to carry"
    );
    assert!(
        !pins.map("CONNTRACK6-resizing").exists(),
        "the set-aside map is still pinned"
    );
}

/// The agent's housekeeping walks `CONNTRACK6` and `CT_NEW6` too: a
/// departed backend loses its UDP flows there (not its TCP connections),
/// and the reaper removes flows idle past their timeout.
#[test]
fn departed_backend_purge_and_reaper_walk_conntrack6() {
    let mut fx = fixture();
    let (_, out) = run(&fx, &udp(CLIENT, 7000, VIP, 53));
    let gone = parse_checked6(&out, "first datagram").dst;
    let tcp_sport = (44000..45000)
        .find(|sport| {
            let (_, out) = run(&fx, &tcp(CLIENT, *sport, VIP, 80, frame::SYN));
            parse_checked6(&out, "SYN").dst == gone
        })
        .expect("some source port lands on the UDP flow's backend");
    let remaining: Vec<Ipv6Addr> = BACKENDS.iter().copied().filter(|b| *b != gone).collect();
    for (port, proto, target, name) in [
        (80, Protocol::Tcp, 8080, "svc0"),
        (53, Protocol::Udp, 5353, "svc1"),
    ] {
        let owner = ObjectKey {
            namespace: "test".into(),
            name: name.into(),
        };
        let fe = frontend(VIP, port, proto, target, &remaining);
        let out = fx
            .planner
            .sync_service(&owner, &[fe], &mut fx.datapath.maps);
        assert!(
            out.errors.is_empty(),
            "reprogramming {name}: {:?}",
            out.errors
        );
    }
    let departed = fx.planner.take_departed();
    assert_eq!(
        departed.len(),
        2,
        "one backend left two service ports: {departed:?}"
    );
    let swept = conntrack::purge_departed(
        &mut fx.datapath.maps,
        &departed,
        &fx.planner.take_affinity_purge(&departed),
    )
    .expect("purge");
    assert_eq!(
        swept.conntrack, 2,
        "the UDP flow's two entries must go, the TCP ones stay"
    );
    let (_, out) = run(&fx, &udp(CLIENT, 7000, VIP, 53));
    let now = parse_checked6(&out, "datagram after the removal").dst;
    assert!(
        remaining.contains(&now),
        "UDP flow still sent to the departed backend {now}"
    );
    let (_, out) = run(&fx, &tcp(CLIENT, tcp_sport, VIP, 80, frame::ACK));
    assert_eq!(
        parse_checked6(&out, "TCP after the removal").dst,
        gone,
        "an established TCP connection must keep its backend"
    );

    // The TCP flows of every source port tried, and the new UDP flow, two
    // entries each, none assured (in `CT_NEW6`): a minute and a bit later
    // the UDP flow has expired, the unanswered TCP ones too (the SYN
    // timeout, 60 s).
    let expected = 2 * usize::from(tcp_sport - 44000 + 1) + 2;
    let flows6 = |fx: &Fixture| {
        let (assured, unassured) = entries6(fx);
        assert_eq!(assured, 0, "no flow was assured, none is in CONNTRACK6");
        unassured
    };
    assert_eq!(flows6(&fx), expected, "entries before reaping");
    let reaped = {
        let (maps, reap) = fx.datapath.conntrack_reaping();
        conntrack::reap_expired(
            maps,
            &reap,
            conntrack::monotonic_ns() + 61_000_000_000,
            &mut proxy_userspace::housekeeping::ct_sources::Tally::default(),
        )
    }
    .expect("reaping");
    assert_eq!(reaped, expected, "expired IPv6 entries reaped");
    assert_eq!(flows6(&fx), 0, "entries left after reaping");
}

/// A packet to an external IPv6 frontend (an ExternalIP, a LoadBalancer IP)
/// is translated as a ClusterIP packet is; on a node without an IPv6
/// address (this fixture writes none) there is no address to SNAT to, so
/// the client's address is kept, as IPv4 keeps it without one.
#[test]
fn a_packet_to_an_external_ipv6_frontend_is_translated() {
    let mut fx = fixture();
    let external = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x80);
    let owner = ObjectKey {
        namespace: "test".into(),
        name: "external6".into(),
    };
    // One address, reprogrammed as each kind in turn.
    for (i, kind) in [FrontendKind::ExternalIp, FrontendKind::LoadBalancer]
        .into_iter()
        .enumerate()
    {
        let fe = Frontend {
            kind,
            ..frontend(external, 80, Protocol::Tcp, 8080, &BACKENDS)
        };
        let out = fx
            .planner
            .sync_service(&owner, std::slice::from_ref(&fe), &mut fx.datapath.maps);
        assert!(
            out.errors.is_empty(),
            "programming {}: {:?}",
            fe.key,
            out.errors
        );
        let dnat_before = counter(&fx, "dnat_new");
        let sport = 45000 + i as u16;
        let (ret, out) = run(&fx, &tcp(CLIENT, sport, external, 80, frame::SYN));
        assert_eq!(ret, TC_PASS, "{:?} frontend: verdict {ret}", fe.kind);
        let p = parse_checked6(&out, &format!("{:?} SYN", fe.kind));
        assert!(
            BACKENDS.contains(&p.dst) && p.dport == 8080,
            "{:?} frontend: SYN sent to [{}]:{}, not a backend",
            fe.kind,
            p.dst,
            p.dport
        );
        assert_eq!(
            (p.src, p.sport),
            (CLIENT, sport),
            "{:?} frontend: the client's address changed without a node address",
            fe.kind
        );
        assert_eq!(
            counter(&fx, "dnat_new"),
            dnat_before + 1,
            "{:?} frontend: not counted as a new flow",
            fe.kind
        );
    }
    assert_eq!(counter(&fx, "snat_new"), 0, "SNAT without a node address");
}

// ---------------------------------------------------------------------------
// North-south on hand-built frames, as tests/datapath.rs runs IPv4's: inside
// a network namespace of its own holding the node's uplink (one end of a
// veth pair) with permanent neighbour entries, so that the program's FIB
// lookups have one fixed answer.

const NODE_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x50, 0, 0, 0, 0, 1);
const PEER_NODE: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x50, 0, 0, 0, 0, 2);
const OUTSIDE: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x50, 0, 0, 0, 0, 0x100);
const OUTSIDE_DENIED: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x50, 0, 0, 0, 0, 0x101);
/// A pod on the peer node, routed through it.
const REMOTE_POD: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 2, 0, 0, 0, 0, 5);
/// A pod of this node (the fixture's `CLIENT`, on the uplink here).
const LOCAL_POD: Ipv6Addr = CLIENT;
const LB_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x60, 0, 0, 0, 0, 0x10);
const HAIRPIN_VIP: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x30);
const NODE_PORT: u16 = 30080;
const LOCAL_ONLY_NODE_PORT: u16 = 30081;
const LOCAL_NODE_PORT: u16 = 30083;
const UPLINK_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
const OUTSIDE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x64];
const POD_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x21];
/// Offset of the hop limit in a frame.
const HOP_LIMIT: usize = 14 + 7;

/// The datapath fixture plus a namespace with the node's uplink.
struct NodeFixture {
    fx: Fixture,
    ns: ebpf_proxy_tests::netns::NetNs,
    uplink_index: u32,
}

fn mac_text(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

fn program(fx: &mut Fixture, name: &str, fe: &Frontend) {
    let owner = ObjectKey {
        namespace: "test".into(),
        name: name.into(),
    };
    let out = fx
        .planner
        .sync_service(&owner, std::slice::from_ref(fe), &mut fx.datapath.maps);
    assert!(
        out.errors.is_empty(),
        "programming {}: {:?}",
        fe.key,
        out.errors
    );
}

/// A router between the node and a backend.
const ROUTER: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0, 1, 0, 0, 0, 0x1);
const PACKET_TOO_BIG: (u8, u8, u32) = (2, 0, 1280);
const PORT_UNREACHABLE: (u8, u8, u32) = (1, 4, 0);
/// What Linux quotes: as much of the packet as keeps the error within
/// IPv6's minimum MTU.
const QUOTE_MAX: usize = 1280 - 40 - 8;

/// A "packet too big" from a router between the node and the backend,
/// quoting the SYN as the datapath sent it on (to the backend), reaches the
/// client quoting what the client sent: the ClusterIP and its port, so that
/// the client's socket lowers its path MTU. The router's address stays; the
/// quoted segment's checksum and the ICMPv6 checksum are right for the new
/// addresses (recomputed here from scratch).
#[test]
fn a_packet_too_big_from_a_router_reaches_the_client_quoting_the_cluster_ip() {
    let fx = fixture();
    let (_, sent) = run(&fx, &tcp(CLIENT, 46000, VIP, 80, frame::SYN));
    let backend = parse_checked6(&sent, "SYN").dst;
    let error = icmp6_error(ROUTER, CLIENT, PACKET_TOO_BIG, &sent, QUOTE_MAX);
    let (ret, out) = run(&fx, &error);
    assert_eq!(ret, TC_PASS, "packet too big: verdict {ret}");
    let got = parse_checked_icmp6_error(&out, "packet too big");
    assert_eq!(
        got,
        frame::Icmp6Error {
            src: ROUTER,
            dst: CLIENT,
            icmp_type: 2,
            code: 0,
            param: 1280,
            quoted: (frame::TCP, CLIENT, 46000, VIP, 80),
        },
        "the error about the SYN sent to {backend} as the client must see it"
    );
    assert_eq!(
        counter(&fx, "icmp_error_translated"),
        1,
        "translated errors"
    );
    assert_eq!(counter(&fx, "dnat_new"), 1, "the error made a flow");
}

/// A port unreachable about a UDP flow, each way: from the backend about
/// the request it was sent (it comes from the ClusterIP, as the client
/// addressed it), and from the client about the answer it received from
/// the ClusterIP (it goes to the backend, quoting what the backend sent).
#[test]
fn a_port_unreachable_about_a_udp_flow_is_translated_both_ways() {
    let fx = fixture();
    let (_, sent) = run(&fx, &udp(CLIENT, 46001, VIP, 53));
    let backend = parse_checked6(&sent, "request").dst;
    let (ret, out) = run(
        &fx,
        &icmp6_error(backend, CLIENT, PORT_UNREACHABLE, &sent, QUOTE_MAX),
    );
    assert_eq!(ret, TC_PASS, "the backend's error: verdict {ret}");
    let got = parse_checked_icmp6_error(&out, "the backend's port unreachable");
    assert_eq!(
        (got.src, got.dst, got.icmp_type, got.code),
        (VIP, CLIENT, 1, 4),
        "the backend's error must come from the ClusterIP to the client"
    );
    assert_eq!(
        got.quoted,
        (frame::UDP, CLIENT, 46001, VIP, 53),
        "the backend's error must quote the request as the client sent it"
    );

    let (_, received) = run(&fx, &udp(backend, 5353, CLIENT, 46001));
    assert_eq!(
        parse_checked6(&received, "answer").src,
        VIP,
        "the answer was not reverse-translated"
    );
    let (ret, out) = run(
        &fx,
        &icmp6_error(CLIENT, VIP, PORT_UNREACHABLE, &received, QUOTE_MAX),
    );
    assert_eq!(ret, TC_PASS, "the client's error: verdict {ret}");
    let got = parse_checked_icmp6_error(&out, "the client's port unreachable");
    assert_eq!(
        (got.src, got.dst),
        (CLIENT, backend),
        "the client's error must go to the backend"
    );
    assert_eq!(
        got.quoted,
        (frame::UDP, backend, 5353, CLIENT, 46001),
        "the client's error must quote the answer as the backend sent it"
    );
    assert_eq!(
        counter(&fx, "icmp_error_translated"),
        2,
        "translated errors"
    );
}

/// Errors that quote no translated flow pass byte for byte: one about a
/// packet to an address that is no frontend, one whose quote is not from
/// its destination (so not about a packet this node's flows sent), one
/// quoting a flow's packet cut before its ports, and a time exceeded about
/// a flow that expired. None is counted as translated.
#[test]
fn icmpv6_errors_quoting_no_translated_flow_pass_untouched() {
    let fx = fixture();
    let elsewhere = Ipv6Addr::new(0xfd00, 0x10, 0, 2, 0, 0, 0, 0x99);
    let untranslated = tcp(CLIENT, 47000, elsewhere, 80, frame::SYN);
    let (_, sent) = run(&fx, &tcp(CLIENT, 47001, VIP, 80, frame::SYN));
    let backend = parse_checked6(&sent, "SYN").dst;
    let stranger = Ipv6Addr::new(0xfd00, 0x10, 0, 0, 0, 0, 0, 0x77);
    let cases = [
        (
            "quoting a packet to no frontend",
            icmp6_error(ROUTER, CLIENT, PACKET_TOO_BIG, &untranslated, QUOTE_MAX),
        ),
        (
            "addressed to another host than the quote's sender",
            icmp6_error(ROUTER, stranger, PACKET_TOO_BIG, &sent, QUOTE_MAX),
        ),
        (
            "quoting the IPv6 header and two bytes",
            icmp6_error(backend, CLIENT, PORT_UNREACHABLE, &sent, 42),
        ),
        (
            "time exceeded about a flow never seen (another client port)",
            icmp6_error(
                ROUTER,
                CLIENT,
                (3, 0, 0),
                &tcp(CLIENT, 47002, backend, 8080, frame::SYN),
                QUOTE_MAX,
            ),
        ),
    ];
    for (what, error) in cases {
        let (ret, out) = run(&fx, &error);
        assert_eq!(ret, TC_PASS, "{what}: verdict {ret}");
        assert_eq!(out, error, "{what}: the error was modified");
    }
    assert_eq!(
        counter(&fx, "icmp_error_translated"),
        0,
        "errors about no translated flow counted as translated"
    );
}

/// Errors quoting a packet with extension headers before its transport
/// header are matched through them, as tc walks the packet's own: a port
/// unreachable about a request behind a destination options header, and a
/// "packet too big" about the first fragment of a datagram the client
/// fragmented. Each reaches the client quoting exactly the bytes the client
/// sent, so every field and checksum of the quote is restored; the ICMPv6
/// checksum is recomputed from scratch. A quote of a later fragment holds
/// no ports to find the flow by: that error passes untouched.
#[test]
fn errors_quoting_extension_headers_or_a_first_fragment_are_translated() {
    let fx = fixture();
    let quoted_bytes = |error: &[u8]| error[14 + 40 + 8..].to_vec();

    let request = build6(&Spec6 {
        ext: vec![DEST_OPTS],
        ..spec(CLIENT, 46100, VIP, 53, frame::UDP, 0)
    });
    let (_, sent) = run(&fx, &request);
    let backend = parse_checked6(&sent, "request behind options").dst;
    let (ret, out) = run(
        &fx,
        &icmp6_error(backend, CLIENT, PORT_UNREACHABLE, &sent, QUOTE_MAX),
    );
    assert_eq!(ret, TC_PASS, "port unreachable: verdict {ret}");
    let got = parse_checked_icmp6_error(&out, "port unreachable quoting options");
    assert_eq!(
        (got.src, got.dst, got.quoted),
        (VIP, CLIENT, (frame::UDP, CLIENT, 46100, VIP, 53)),
        "the backend's error about a request behind options must be the client's"
    );
    assert_eq!(
        quoted_bytes(&out),
        request[14..],
        "the quote must be the request as the client sent it"
    );

    let fragments = fragmented((CLIENT, 46101), (VIP, 53), 3000, 0x0808_0808);
    let out = run_fragments(&fx, &fragments, "fragmented request");
    let first = &out[0];
    let error = icmp6_error(ROUTER, CLIENT, PACKET_TOO_BIG, first, QUOTE_MAX);
    let (ret, translated) = run(&fx, &error);
    assert_eq!(ret, TC_PASS, "packet too big: verdict {ret}");
    let got = parse_checked_icmp6_error(&translated, "packet too big quoting a first fragment");
    assert_eq!(
        (got.src, got.dst, got.param, got.quoted),
        (ROUTER, CLIENT, 1280, (frame::UDP, CLIENT, 46101, VIP, 53)),
        "the router's error about the first fragment must be the client's"
    );
    assert_eq!(
        quoted_bytes(&translated),
        fragments[0][14..14 + QUOTE_MAX],
        "the quote must be the first fragment as the client sent it"
    );

    let later = icmp6_error(ROUTER, CLIENT, PACKET_TOO_BIG, &out[1], QUOTE_MAX);
    let (ret, passed) = run(&fx, &later);
    assert_eq!(
        (ret, &passed),
        (TC_PASS, &later),
        "an error quoting a later fragment passes untouched"
    );
    assert_eq!(
        counter(&fx, "icmp_error_translated"),
        2,
        "translated errors"
    );
}

/// The SCTP frontends of the fixture: `VIP`:9000 -> 9000 (the port kept) and,
/// both programmed by [`sctp_fixture`], `VIP`:9001 -> 19001 (the port changed).
const SCTP_PORT: u16 = 9000;
const SCTP_REMAP_PORT: u16 = 9001;
const SCTP_REMAP_TARGET: u16 = 19_001;

/// The fixture with the SCTP frontend whose port changes as well.
fn sctp_fixture() -> Fixture {
    let mut fx = fixture();
    program(
        &mut fx,
        "sctp",
        &frontend(VIP, SCTP_PORT, Protocol::Sctp, SCTP_PORT, &BACKENDS),
    );
    program(
        &mut fx,
        "sctp-remap",
        &frontend(
            VIP,
            SCTP_REMAP_PORT,
            Protocol::Sctp,
            SCTP_REMAP_TARGET,
            &BACKENDS,
        ),
    );
    fx
}

/// Closing and time-wait timeouts of `close` (TCP's, which SCTP's closed
/// associations take).
fn closed_timeouts(fx: &mut Fixture, close: Duration) {
    use proxy_userspace::planner::{MapOp, MapStore};
    let ns = u64::try_from(close.as_nanos()).expect("a short timeout");
    let timeouts = proxy_common::CtTimeouts {
        tcp_time_wait_ns: ns,
        tcp_close_ns: ns,
        ..proxy_common::CtTimeouts::DEFAULT
    };
    fx.datapath
        .maps
        .apply(&MapOp::SetCtTimeouts { timeouts })
        .expect("setting the timeouts");
}

/// A frame carrying an SCTP packet of `chunks` under `vtag`, its `CRC32c` right.
fn sctp_frame(
    src: (Ipv6Addr, u16),
    dst: (Ipv6Addr, u16),
    vtag: u32,
    chunks: &[Vec<u8>],
) -> Vec<u8> {
    frame::build_sctp6(src.0, dst.0, &sctp::packet(src.1, dst.1, vtag, chunks))
}

/// The output frame `out` parsed, its `CRC32c` checked (`what` says which
/// packet in a failure).
fn sctp_out(out: &[u8], what: &str) -> (frame::Parsed6, sctp::Packet) {
    let p = parse_checked6(out, what);
    assert_eq!(p.proto, SCTP, "{what}: protocol {}", p.proto);
    let packet = sctp::parse(&p.l4).unwrap_or_else(|e| panic!("{what}: {e}"));
    (p, packet)
}

/// A 1,400-byte DATA chunk: a checksum update over more than 256 bytes.
fn long_data(tsn: u32) -> Vec<u8> {
    sctp::data(tsn, &[0xa5; 1400])
}

/// One association through an IPv6 SCTP ClusterIP at tc, as over IPv4, every packet's `CRC32c`
/// checked after the rewrite, with the port kept (9000 -> 9000) and with it
/// changed (9001 -> 19001): the INIT starts a flow to a backend, the client's
/// address kept; the backend's answers come back from the frontend; a packet
/// under another tag than its direction's (the INIT's Initiate Tag for the
/// reply, the INIT ACK's for the client) is dropped and counted; an ABORT with
/// the T bit under its sender's own tag is accepted.
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one association's packets in their order, each with its checks"
)]
fn sctp_association_through_a_cluster_ip_at_tc() {
    let fx = sctp_fixture();
    for (i, (port, target)) in [(SCTP_PORT, SCTP_PORT), (SCTP_REMAP_PORT, SCTP_REMAP_TARGET)]
        .into_iter()
        .enumerate()
    {
        let sport = 41_000 + i as u16;
        let (tag_a, tag_z) = (0x1111_0000 + i as u32, 0x2222_0000 + i as u32);
        let client = (CLIENT, sport);
        let fe = (VIP, port);
        let case = format!("{VIP}:{port} -> {target}");
        let (new, ct_new) = (counter(&fx, "dnat_new"), counter(&fx, "ct_new_flow"));

        let init = sctp_frame(
            client,
            fe,
            0,
            &[sctp::init(sctp::chunk::INIT, tag_a, 1, None)],
        );
        let (ret, out) = run(&fx, &init);
        assert_eq!(ret, TC_PASS, "{case}: INIT verdict");
        let (p, s) = sctp_out(&out, &format!("{case}: DNATed INIT"));
        assert!(
            BACKENDS.contains(&p.dst),
            "{case}: INIT sent to {}, not a backend",
            p.dst
        );
        assert_eq!(
            (p.src, p.sport, p.dport, s.vtag, s.initiate_tag()),
            (CLIENT, sport, target, 0, Some(tag_a)),
            "{case}: the INIT's source, destination port, tag or Initiate Tag after DNAT"
        );
        assert_eq!(
            (counter(&fx, "dnat_new"), counter(&fx, "ct_new_flow")),
            (new + 1, ct_new + 1),
            "{case}: (dnat_new, ct_new_flow) after the INIT"
        );
        let backend = (p.dst, target);

        // The reply must carry the INIT's Initiate Tag.
        let drops = counter(&fx, "drop_sctp_vtag");
        let forged = sctp_frame(
            backend,
            client,
            tag_a ^ 0xff,
            &[sctp::init(sctp::chunk::INIT_ACK, tag_z, 1, Some(b"cookie"))],
        );
        let (ret, _) = run(&fx, &forged);
        assert_eq!(
            ret,
            TC_ACT_SHOT,
            "{case}: an INIT ACK under tag {:#x}, not the INIT's {tag_a:#x}, must be dropped",
            tag_a ^ 0xff
        );
        assert_eq!(
            counter(&fx, "drop_sctp_vtag"),
            drops + 1,
            "{case}: the INIT ACK under another tag not counted drop_sctp_vtag"
        );

        let init_ack = sctp_frame(
            backend,
            client,
            tag_a,
            &[sctp::init(sctp::chunk::INIT_ACK, tag_z, 1, Some(b"cookie"))],
        );
        let (ret, out) = run(&fx, &init_ack);
        assert_eq!(ret, TC_PASS, "{case}: INIT ACK verdict");
        let (r, s) = sctp_out(&out, &format!("{case}: reverse-NATed INIT ACK"));
        assert_eq!(
            (r.src, r.sport, r.dst, r.dport, s.vtag),
            (VIP, port, CLIENT, sport, tag_a),
            "{case}: the INIT ACK must come back from the frontend, its tag kept"
        );

        // The client's packets must now carry the INIT ACK's Initiate Tag.
        let echo = |vtag| {
            sctp_frame(
                client,
                fe,
                vtag,
                &[sctp::chunk(sctp::kind::COOKIE_ECHO, 0, b"cookie")],
            )
        };
        let (ret, _) = run(&fx, &echo(tag_a));
        assert_eq!(
            ret, TC_ACT_SHOT,
            "{case}: a COOKIE ECHO under the client's own tag {tag_a:#x}, not the INIT ACK's \
             {tag_z:#x}, must be dropped"
        );
        assert_eq!(
            counter(&fx, "drop_sctp_vtag"),
            drops + 2,
            "{case}: the COOKIE ECHO under another tag not counted drop_sctp_vtag"
        );
        let (ret, out) = run(&fx, &echo(tag_z));
        assert_eq!(ret, TC_PASS, "{case}: COOKIE ECHO verdict");
        let (p, _) = sctp_out(&out, &format!("{case}: COOKIE ECHO"));
        assert_eq!(
            ((p.dst, p.dport), p.src),
            (backend, CLIENT),
            "{case}: the COOKIE ECHO went elsewhere"
        );

        // A long DATA each way: the checksum update over 1,400 bytes.
        let (ret, out) = run(&fx, &sctp_frame(client, fe, tag_z, &[long_data(1)]));
        assert_eq!(ret, TC_PASS, "{case}: long DATA verdict");
        let (p, s) = sctp_out(&out, &format!("{case}: long DATA"));
        assert_eq!(
            ((p.dst, p.dport), s.chunks[0].body.len()),
            (backend, 12 + 1400),
            "{case}: the long DATA"
        );
        let (ret, out) = run(
            &fx,
            &sctp_frame(backend, client, tag_a, &[sctp::sack(1), long_data(1)]),
        );
        assert_eq!(ret, TC_PASS, "{case}: long SACK and DATA reply verdict");
        let (r, _) = sctp_out(&out, &format!("{case}: long reply"));
        assert_eq!(
            (r.src, r.sport),
            (VIP, port),
            "{case}: the long reply's source"
        );

        // The client aborts with the T bit: its own tag, the reply direction's.
        let (ret, out) = run(
            &fx,
            &sctp_frame(
                client,
                fe,
                tag_a,
                &[sctp::chunk(sctp::chunk::ABORT, sctp::chunk::FLAG_T, &[])],
            ),
        );
        assert_eq!(
            ret, TC_PASS,
            "{case}: an ABORT with the T bit under the client's own tag {tag_a:#x} must pass"
        );
        let (p, s) = sctp_out(&out, &format!("{case}: ABORT"));
        assert_eq!(
            ((p.dst, p.dport), s.vtag),
            (backend, tag_a),
            "{case}: the ABORT's destination or tag"
        );
    }
    assert_eq!(
        counter(&fx, "unsupported_proto"),
        0,
        "SCTP counted as unsupported"
    );
}

/// An ABORT ends the association: its entries get the closing timeout (1 ms
/// here), after which a packet of the old association starts a new flow; an
/// INIT on the same addresses and ports is a new association whose reply
/// carries the new Initiate Tag, not the old one. A SHUTDOWN COMPLETE with the
/// T bit from the backend, under its own tag, is accepted.
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "two associations' packets in their order, each with its checks"
)]
fn an_sctp_abort_or_shutdown_complete_ends_the_association() {
    let mut fx = sctp_fixture();
    closed_timeouts(&mut fx, Duration::from_millis(1));
    let client = (CLIENT, 42_000);
    let fe = (VIP, SCTP_REMAP_PORT);
    let handshake = |tag_a: u32, tag_z: u32, what: &str| -> (Ipv6Addr, u16) {
        let (ret, out) = run(
            &fx,
            &sctp_frame(
                client,
                fe,
                0,
                &[sctp::init(sctp::chunk::INIT, tag_a, 1, None)],
            ),
        );
        assert_eq!(ret, TC_PASS, "{what}: INIT verdict");
        let (p, _) = sctp_out(&out, &format!("{what}: INIT"));
        let backend = (p.dst, p.dport);
        let (ret, out) = run(
            &fx,
            &sctp_frame(
                backend,
                client,
                tag_a,
                &[sctp::init(sctp::chunk::INIT_ACK, tag_z, 1, Some(b"c"))],
            ),
        );
        assert_eq!(
            ret, TC_PASS,
            "{what}: an INIT ACK under the INIT's Initiate Tag {tag_a:#x}"
        );
        sctp_out(&out, &format!("{what}: INIT ACK"));
        backend
    };

    let backend = handshake(0xaaaa_0001, 0xbbbb_0001, "first association");
    let (ret, _) = run(
        &fx,
        &sctp_frame(
            client,
            fe,
            0xaaaa_0001,
            &[sctp::chunk(sctp::chunk::ABORT, sctp::chunk::FLAG_T, &[])],
        ),
    );
    assert_eq!(ret, TC_PASS, "ABORT with the T bit under the client's tag");
    std::thread::sleep(Duration::from_millis(20));
    let new = counter(&fx, "dnat_new");
    let (ret, _) = run(
        &fx,
        &sctp_frame(client, fe, 0xbbbb_0001, &[sctp::data(2, b"late")]),
    );
    assert_eq!(ret, TC_PASS, "DATA of the aborted association");
    assert_eq!(
        counter(&fx, "dnat_new"),
        new + 1,
        "after an ABORT and its closing timeout, the association's flow must be gone (a \
         packet of it starts a new flow)"
    );

    // A new association on the same addresses and ports: its INIT is answered
    // under its own Initiate Tag, and the old one no longer holds.
    let backend2 = handshake(0xaaaa_0002, 0xbbbb_0002, "second association");
    let drops = counter(&fx, "drop_sctp_vtag");
    let (ret, _) = run(
        &fx,
        &sctp_frame(
            backend2,
            client,
            0xaaaa_0001,
            &[sctp::chunk(sctp::kind::COOKIE_ACK, 0, &[])],
        ),
    );
    assert_eq!(
        (ret, counter(&fx, "drop_sctp_vtag")),
        (TC_ACT_SHOT, drops + 1),
        "a reply under the first association's tag, in the second (backend before {backend:?})"
    );
    // The backend ends it with a SHUTDOWN COMPLETE with the T bit: its own tag,
    // the one the client's packets carry.
    let (ret, out) = run(
        &fx,
        &sctp_frame(
            backend2,
            client,
            0xbbbb_0002,
            &[sctp::chunk(
                sctp::chunk::SHUTDOWN_COMPLETE,
                sctp::chunk::FLAG_T,
                &[],
            )],
        ),
    );
    assert_eq!(
        ret, TC_PASS,
        "a SHUTDOWN COMPLETE with the T bit under the backend's own tag"
    );
    let (r, _) = sctp_out(&out, "SHUTDOWN COMPLETE");
    assert_eq!((r.src, r.sport), fe, "the SHUTDOWN COMPLETE's source");
    std::thread::sleep(Duration::from_millis(20));
    let new = counter(&fx, "dnat_new");
    let (ret, _) = run(
        &fx,
        &sctp_frame(client, fe, 0xbbbb_0002, &[sctp::data(2, b"late")]),
    );
    assert_eq!(ret, TC_PASS, "DATA of the completed association");
    assert_eq!(
        counter(&fx, "dnat_new"),
        new + 1,
        "after a SHUTDOWN COMPLETE and its closing timeout, the flow must be gone"
    );
}

/// An association met mid-way (its conntrack entries lost, say the agent
/// restarted): its first packet, a DATA, starts the flow, and its tag is the
/// one the client's packets must carry from then on.
#[test]
fn an_sctp_association_met_mid_way_takes_its_first_packets_tag() {
    let fx = sctp_fixture();
    let client = (CLIENT, 43_000);
    let fe = (VIP, SCTP_REMAP_PORT);
    let tag_z = 0x5eed_0001;
    let new = counter(&fx, "dnat_new");
    let (ret, out) = run(
        &fx,
        &sctp_frame(client, fe, tag_z, &[sctp::data(7, b"mid-way")]),
    );
    assert_eq!(ret, TC_PASS, "the first DATA met mid-way");
    let (p, _) = sctp_out(&out, "DATA met mid-way");
    assert!(BACKENDS.contains(&p.dst), "sent to {}", p.dst);
    assert_eq!(counter(&fx, "dnat_new"), new + 1, "a flow from a DATA");
    let backend = (p.dst, p.dport);
    let (ret, out) = run(
        &fx,
        &sctp_frame(client, fe, tag_z, &[sctp::data(8, b"more")]),
    );
    assert_eq!(ret, TC_PASS, "a DATA under the flow's tag");
    assert_eq!(sctp_out(&out, "second DATA").0.dst, backend.0);
    let drops = counter(&fx, "drop_sctp_vtag");
    let (ret, _) = run(
        &fx,
        &sctp_frame(client, fe, tag_z ^ 1, &[sctp::data(9, b"other")]),
    );
    assert_eq!(
        (ret, counter(&fx, "drop_sctp_vtag")),
        (TC_ACT_SHOT, drops + 1),
        "a DATA under tag {:#x}, not the flow's {tag_z:#x}: (verdict, drop_sctp_vtag)",
        tag_z ^ 1
    );
    let (ret, out) = run(
        &fx,
        &sctp_frame(backend, client, 0x0bad_cafe, &[sctp::sack(8)]),
    );
    assert_eq!(
        ret, TC_PASS,
        "the backend's SACK of an association met mid-way"
    );
    let (r, _) = sctp_out(&out, "SACK met mid-way");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (VIP, SCTP_REMAP_PORT, CLIENT, 43_000)
    );
}

/// Malformed SCTP to a frontend (shorter than the common header, a chunk
/// header cut short) is passed untouched and counted, never translated.
#[test]
fn malformed_sctp_is_not_translated() {
    let fx = sctp_fixture();
    let whole = sctp::packet(
        44_000,
        SCTP_PORT,
        0,
        &[sctp::init(sctp::chunk::INIT, 1, 1, None)],
    );
    for (what, bytes) in [
        ("8 bytes: shorter than the common header", &whole[..8]),
        ("11 bytes: shorter than the common header", &whole[..11]),
        ("14 bytes: a chunk header cut short", &whole[..14]),
    ] {
        let input = frame::build_sctp6(CLIENT, VIP, bytes);
        let malformed = counter(&fx, "pass_malformed");
        let (ret, out) = run(&fx, &input);
        assert_eq!(ret, TC_PASS, "{what}: verdict");
        assert_eq!(out, input, "{what}: the packet was modified");
        assert_eq!(
            counter(&fx, "pass_malformed"),
            malformed + 1,
            "{what}: not counted pass_malformed"
        );
    }
    assert_eq!(counter(&fx, "dnat_new"), 0, "malformed SCTP was translated");
}

/// The node fixture with an SCTP NodePort (`SCTP_NODE_PORT` -> 9999 on the
/// remote pod): external traffic to it is SNATed, as TCP's is.
const SCTP_NODE_PORT: u16 = 30_090;
const SCTP_NODE_TARGET: u16 = 9999;

fn sctp_node_fixture() -> NodeFixture {
    let mut nf = node_fixture();
    let mut fe = Frontend {
        kind: FrontendKind::NodePort,
        ..frontend(
            Ipv6Addr::UNSPECIFIED,
            SCTP_NODE_PORT,
            Protocol::Sctp,
            SCTP_NODE_TARGET,
            &[REMOTE_POD],
        )
    };
    for b in &mut fe.backends {
        b.local = false;
    }
    program(&mut nf.fx, "sctp-nodeport", &fe);
    nf
}

/// An association from outside through an SCTP NodePort with a remote
/// backend, run by `step` (XDP or tc on the uplink, whose verdict for a
/// routed frame is `sent` and for a dropped one `dropped`): the INIT is SNATed
/// to the node and DNATed to the pod (both ports changed, the `CRC32c` right),
/// the answers come back from the NodePort, a packet under another tag is
/// dropped and counted, and a long DATA keeps its checksum.
fn sctp_nodeport_association(
    nf: &NodeFixture,
    step: impl Fn(&NodeFixture, &[u8]) -> (u32, Vec<u8>),
    (sent, dropped): (u32, u32),
    path: &str,
) {
    let client = (OUTSIDE, 45_000);
    let fe = (NODE_IP, SCTP_NODE_PORT);
    let (tag_a, tag_z) = (0x0a0a_0a0a, 0x0b0b_0b0b);
    let init = sctp_frame(
        client,
        fe,
        0,
        &[sctp::init(sctp::chunk::INIT, tag_a, 1, None)],
    );
    let (ret, out) = step(nf, &init);
    assert_eq!(ret, sent, "{path}: NodePort INIT verdict");
    let (p, s) = sctp_out(&out, &format!("{path}: SNATed INIT"));
    assert_eq!(
        (p.src, p.dst, p.dport, s.vtag, s.initiate_tag()),
        (NODE_IP, REMOTE_POD, SCTP_NODE_TARGET, 0, Some(tag_a)),
        "{path}: the INIT must be SNATed to the node and DNATed to the remote pod"
    );
    assert!(
        (proxy_common::SNAT_PORT_MIN..=proxy_common::SNAT_PORT_MAX).contains(&p.sport),
        "{path}: SNAT port {} outside the range",
        p.sport
    );
    assert_eq!(counter(&nf.fx, "snat_new"), 1, "{path}: snat_new");
    let node_side = (NODE_IP, p.sport);
    let backend = (REMOTE_POD, SCTP_NODE_TARGET);

    let (ret, _) = step(
        nf,
        &sctp_frame(
            backend,
            node_side,
            tag_a ^ 0x10,
            &[sctp::init(sctp::chunk::INIT_ACK, tag_z, 1, Some(b"c"))],
        ),
    );
    assert_eq!(
        (ret, counter(&nf.fx, "drop_sctp_vtag")),
        (dropped, 1),
        "{path}: an INIT ACK under another tag than the INIT's: (verdict, drop_sctp_vtag)"
    );
    let (ret, out) = step(
        nf,
        &sctp_frame(
            backend,
            node_side,
            tag_a,
            &[sctp::init(sctp::chunk::INIT_ACK, tag_z, 1, Some(b"c"))],
        ),
    );
    assert_eq!(ret, sent, "{path}: INIT ACK verdict");
    let (r, s) = sctp_out(&out, &format!("{path}: reverse-translated INIT ACK"));
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport, s.vtag),
        (NODE_IP, SCTP_NODE_PORT, OUTSIDE, 45_000, tag_a),
        "{path}: the INIT ACK must come from the NodePort back to the client"
    );
    let (ret, out) = step(
        nf,
        &sctp_frame(
            client,
            fe,
            tag_z,
            &[sctp::chunk(sctp::kind::COOKIE_ECHO, 0, b"c"), long_data(1)],
        ),
    );
    assert_eq!(ret, sent, "{path}: COOKIE ECHO and long DATA verdict");
    let (p, _) = sctp_out(&out, &format!("{path}: COOKIE ECHO and long DATA"));
    assert_eq!(
        ((p.src, p.sport), (p.dst, p.dport)),
        (node_side, backend),
        "{path}: an established packet's translation"
    );
    let (ret, _) = step(nf, &sctp_frame(client, fe, tag_a, &[sctp::data(2, b"x")]));
    assert_eq!(
        (ret, counter(&nf.fx, "drop_sctp_vtag")),
        (dropped, 2),
        "{path}: a DATA under the client's own tag, not the INIT ACK's: (verdict, \
         drop_sctp_vtag)"
    );
    let (ret, out) = step(nf, &sctp_frame(backend, node_side, tag_a, &[long_data(1)]));
    assert_eq!(ret, sent, "{path}: the backend's long DATA");
    let (r, _) = sctp_out(&out, &format!("{path}: the backend's long DATA"));
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (NODE_IP, SCTP_NODE_PORT, OUTSIDE, 45_000),
        "{path}: the backend's long DATA"
    );
    assert_eq!(
        counter(&nf.fx, "unsupported_proto"),
        0,
        "{path}: SCTP counted as unsupported"
    );
}

/// XDP translates an SCTP NodePort association as it does UDP: new and
/// established packets, routed back out, tags checked.
#[test]
fn xdp_translates_an_sctp_nodeport_association() {
    let nf = sctp_node_fixture();
    sctp_nodeport_association(&nf, run_xdp, (XDP_REDIRECT, XDP_DROP), "XDP");
    assert_eq!(counter(&nf.fx, "xdp_tx"), 4, "frames XDP sent back out");
}

/// The same through tc on the uplink (XDP off).
#[test]
fn tc_translates_an_sctp_nodeport_association() {
    let nf = sctp_node_fixture();
    sctp_nodeport_association(&nf, run_on_uplink, (TC_ACT_REDIRECT, TC_ACT_SHOT), "tc");
    assert_eq!(counter(&nf.fx, "xdp_tx"), 0);
}

/// An SCTP LoadBalancer IP and an ExternalIP (port 9000, to 9999 on the remote
/// pod), reached from outside at XDP: the INIT is SNATed and DNATed, the INIT
/// ACK is translated back to come from the frontend, a reply under another tag
/// is dropped; every checksum right.
#[test]
fn xdp_translates_sctp_to_a_load_balancer_ip_and_an_external_ip() {
    let mut nf = node_fixture();
    let external_ip = Ipv6Addr::new(0x2001, 0xdb8, 0x60, 0, 0, 0, 0, 0x11);
    for (name, kind, ip) in [
        ("sctp-lb", FrontendKind::LoadBalancer, LB_IP),
        ("sctp-external", FrontendKind::ExternalIp, external_ip),
    ] {
        let mut fe = Frontend {
            kind,
            ..frontend(
                ip,
                SCTP_PORT,
                Protocol::Sctp,
                SCTP_NODE_TARGET,
                &[REMOTE_POD],
            )
        };
        for b in &mut fe.backends {
            b.local = false;
        }
        program(&mut nf.fx, name, &fe);
    }
    for (i, ip) in [LB_IP, external_ip].into_iter().enumerate() {
        let what = format!("SCTP to [{ip}]:{SCTP_PORT}");
        let client = (OUTSIDE, 47_000 + i as u16);
        let fe = (ip, SCTP_PORT);
        let tag_a = 0x00a1_0000 + i as u32;
        let (ret, out) = run_xdp(
            &nf,
            &sctp_frame(
                client,
                fe,
                0,
                &[sctp::init(sctp::chunk::INIT, tag_a, 1, None)],
            ),
        );
        assert_eq!(ret, XDP_REDIRECT, "{what}: INIT verdict");
        let (p, _) = sctp_out(&out, &format!("{what}: INIT"));
        assert_eq!(
            (p.src, p.dst, p.dport),
            (NODE_IP, REMOTE_POD, SCTP_NODE_TARGET),
            "{what}: the INIT must be SNATed to the node and DNATed to the pod"
        );
        let node_side = (NODE_IP, p.sport);
        let backend = (REMOTE_POD, SCTP_NODE_TARGET);
        let ack = |vtag| {
            sctp_frame(
                backend,
                node_side,
                vtag,
                &[sctp::init(sctp::chunk::INIT_ACK, 7, 1, Some(b"c"))],
            )
        };
        let drops = counter(&nf.fx, "drop_sctp_vtag");
        let (ret, _) = run_xdp(&nf, &ack(tag_a + 1));
        assert_eq!(
            (ret, counter(&nf.fx, "drop_sctp_vtag")),
            (XDP_DROP, drops + 1),
            "{what}: an INIT ACK under another tag: (verdict, drop_sctp_vtag)"
        );
        // Translated, then sent back out or passed on to the stack, as a TCP
        // reply from the LB IP is (its route from a frontend address is the
        // stack's to find).
        let (ret, out) = run_xdp(&nf, &ack(tag_a));
        assert!(
            ret == XDP_REDIRECT || ret == XDP_PASS,
            "{what}: INIT ACK verdict {ret}"
        );
        let (r, _) = sctp_out(&out, &format!("{what}: INIT ACK"));
        assert_eq!(
            ((r.src, r.sport), (r.dst, r.dport)),
            (fe, client),
            "{what}: the INIT ACK must come back from the frontend"
        );
    }
}

/// Malformed SCTP reaching XDP is left to tc, which counts it, once.
#[test]
fn malformed_sctp_through_xdp_then_tc_is_counted_once() {
    let nf = sctp_node_fixture();
    let whole = sctp::packet(46_000, SCTP_NODE_PORT, 0, &[sctp::data(1, b"x")]);
    let input = frame::build_sctp6(OUTSIDE, NODE_IP, &whole[..10]);
    let (ret, out) = run_xdp(&nf, &input);
    assert_eq!(
        (ret, &out),
        (XDP_PASS, &input),
        "XDP must pass malformed SCTP untouched"
    );
    assert_eq!(
        counter(&nf.fx, "pass_malformed"),
        0,
        "XDP counted what tc counts next"
    );
    let (ret, out) = run_on_uplink(&nf, &input);
    assert_eq!(
        (ret, &out),
        (TC_PASS, &input),
        "tc must pass malformed SCTP untouched"
    );
    assert_eq!(
        counter(&nf.fx, "pass_malformed"),
        1,
        "malformed SCTP counted once"
    );
    assert_eq!(
        counter(&nf.fx, "snat_new"),
        0,
        "malformed SCTP was translated"
    );
}

/// A datagram whose fragmentable part starts with a destination options
/// header: the first fragment's chain goes on past its fragment header to
/// the UDP header, the later ones name the options header and carry no
/// transport header at all. All of them are translated both ways, and the
/// datagrams reassembled here are right throughout.
#[test]
fn fragments_with_a_header_after_the_fragment_header_are_translated_whole() {
    let fx = fixture();
    let datagram = |src: (Ipv6Addr, u16), dst: (Ipv6Addr, u16), id: u32| {
        let payload: Vec<u8> = (0..3000).map(|i| (i % 253) as u8).collect();
        let whole = build6(&Spec6 {
            payload,
            ext: vec![DEST_OPTS],
            ..spec(src.0, src.1, dst.0, dst.1, frame::UDP, 0)
        });
        let fragments = fragment6(&whole, 1448, id);
        assert_eq!(
            fragments[1][54], DEST_OPTS,
            "later fragments name the options header"
        );
        fragments
    };
    let request = datagram((CLIENT, 48000), (VIP, 53), 0x0606_0606);
    let out = run_fragments(&fx, &request, "request");
    let p = parse_checked6(&reassemble6(&out, "request"), "reassembled request");
    assert!(BACKENDS.contains(&p.dst), "request sent to {}", p.dst);
    assert_eq!(
        (p.proto, p.src, p.sport, p.dport),
        (frame::UDP, CLIENT, 48000, 5353),
        "the reassembled request"
    );
    let answer = datagram((p.dst, 5353), (CLIENT, 48000), 0x0707_0707);
    let out = run_fragments(&fx, &answer, "answer");
    let r = parse_checked6(&reassemble6(&out, "answer"), "reassembled answer");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (VIP, 53, CLIENT, 48000),
        "the answer must come from the ClusterIP"
    );
    assert_eq!(
        counter(&fx, "frag_translated"),
        4,
        "later fragments translated"
    );
    assert_eq!(counter(&fx, "frag_untracked"), 0, "untracked fragments");
    assert_eq!(
        counter(&fx, "pass_v6_ext_headers"),
        0,
        "fragments passed for their extension headers"
    );
}

/// A frontend of `kind` on `ip:port` (TCP, to 8080) with `backends`, each
/// on this node when `local`.
fn external(
    kind: FrontendKind,
    ip: Ipv6Addr,
    port: u16,
    backends: &[Ipv6Addr],
    local: bool,
) -> Frontend {
    let mut fe = Frontend {
        kind,
        ..frontend(ip, port, Protocol::Tcp, 8080, backends)
    };
    for b in &mut fe.backends {
        b.local = local;
    }
    if backends.is_empty() {
        fe.no_endpoints = NoEndpointAction::Drop;
    }
    fe
}

fn node_fixture() -> NodeFixture {
    use proxy_userspace::planner::{MapOp, MapStore, node};
    let mut fx = fixture();
    let (ns, uplink_index) = uplink_namespace();
    for (&key, &value) in &node::node_addrs(&[NODE_IP], &[]) {
        fx.datapath
            .maps
            .apply(&MapOp::PutNodeAddr { key, value })
            .expect("node addresses");
    }
    for op in [
        MapOp::SetNodeConfig {
            config: node::node_config(None, false),
        },
        MapOp::SetNodeConfig6 {
            config: node::node_config6(Some(NODE_IP)),
        },
    ] {
        fx.datapath.maps.apply(&op).expect("node config");
    }
    program_north_south(&mut fx);
    NodeFixture {
        fx,
        ns,
        uplink_index,
    }
}

/// A namespace holding the node's uplink, its address, routes and
/// neighbours; and the uplink's index.
fn uplink_namespace() -> (ebpf_proxy_tests::netns::NetNs, u32) {
    let ns = ebpf_proxy_tests::netns::NetNs::create(&format!(
        "{}-v6ns",
        ebpf_proxy_tests::netns::unique_stem()
    ))
    .expect("namespace for the FIB");
    // The FIB answers IPv6 lookups only for an interface that forwards.
    ns.sysctl("net.ipv6.conf.all.forwarding", "1")
        .expect("forwarding");
    ns.sysctl("net.ipv6.conf.default.forwarding", "1")
        .expect("forwarding");
    for args in [
        // A veth (this kernel has no dummy driver); its peer only keeps it up.
        vec![
            "link",
            "add",
            "up0",
            "address",
            &mac_text(UPLINK_MAC),
            "type",
            "veth",
            "peer",
            "name",
            "up0p",
        ],
        vec!["link", "set", "up0p", "up"],
        vec!["link", "set", "up0", "up"],
        vec![
            "-6",
            "addr",
            "add",
            "2001:db8:50::1/64",
            "dev",
            "up0",
            "nodad",
        ],
        vec![
            "-6",
            "route",
            "add",
            "fd00:10:2::/64",
            "via",
            "2001:db8:50::2",
        ],
        vec!["-6", "route", "add", "2001:db8:60::/64", "dev", "up0"],
        vec!["-6", "route", "add", "fd00:10::/64", "dev", "up0"],
    ] {
        ns.ip(&args).expect("uplink setup");
    }
    for (ip, mac) in [
        (PEER_NODE, PEER_MAC),
        (OUTSIDE, OUTSIDE_MAC),
        (OUTSIDE_DENIED, OUTSIDE_MAC),
        (LOCAL_POD, POD_MAC),
    ] {
        ns.ip(&[
            "-6",
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
    let uplink_index: u32 = ns
        .run(|| nix::net::if_::if_nametoindex("up0"))
        .expect("run in namespace")
        .expect("uplink ifindex");
    (ns, uplink_index)
}

/// The north-south frontends of these tests.
fn program_north_south(fx: &mut Fixture) {
    let unspecified = Ipv6Addr::UNSPECIFIED;
    let mut lb = external(FrontendKind::LoadBalancer, LB_IP, 80, &[REMOTE_POD], false);
    lb.source_ranges = vec![proxy_userspace::model::Cidr::parse("2001:db8:50::100/128").unwrap()];
    let hairpin = frontend(HAIRPIN_VIP, 80, Protocol::Tcp, 8080, &[LOCAL_POD]);
    for (name, fe) in [
        (
            "np-remote",
            external(
                FrontendKind::NodePort,
                unspecified,
                NODE_PORT,
                &[REMOTE_POD],
                false,
            ),
        ),
        (
            "np-local-only",
            external(
                FrontendKind::NodePort,
                unspecified,
                LOCAL_ONLY_NODE_PORT,
                &[],
                true,
            ),
        ),
        (
            "np-local",
            external(
                FrontendKind::NodePort,
                unspecified,
                LOCAL_NODE_PORT,
                &[LOCAL_POD],
                true,
            ),
        ),
        ("lb", lb),
        ("hairpin", hairpin),
    ] {
        program(fx, name, &fe);
    }
}

/// `__sk_buff` with only the interfaces set (what tc sees on the uplink).
fn skb_ctx(ifindex: u32) -> Vec<u8> {
    // struct __sk_buff is 192 bytes; ifindex at 40, ingress_ifindex at 36.
    let mut ctx = vec![0u8; 192];
    ctx[36..40].copy_from_slice(&ifindex.to_ne_bytes());
    ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
    ctx
}

/// `tc_ingress6` on one frame arriving on the uplink.
fn run_on_uplink(nf: &NodeFixture, input: &[u8]) -> (u32, Vec<u8>) {
    let program = nf.fx.datapath.tc6_program();
    nf.ns
        .run(|| {
            let mut out = vec![0u8; input.len() + 256];
            let ctx = skb_ctx(nf.uplink_index);
            let mut opts = TestRunOptions::new();
            opts.data_in = Some(input);
            opts.data_out = Some(&mut out);
            opts.ctx_in = Some(&ctx);
            let result = program.test_run(opts).expect("tc test run");
            out.truncate(result.data_size_out as usize);
            (result.return_value, out)
        })
        .expect("run in the node namespace")
}

fn macs(frame: &[u8]) -> ([u8; 6], [u8; 6]) {
    (
        frame[0..6].try_into().unwrap(),
        frame[6..12].try_into().unwrap(),
    )
}

fn ncounter(nf: &NodeFixture, name: &str) -> u64 {
    counter(&nf.fx, name)
}

/// The first two packets of a NodePort flow from `OUTSIDE`, port
/// `client_port`, to a remote backend, each run through `run` (tc or XDP,
/// named `hook`), which must send both on itself (`redirect`): the SYN
/// DNATed to the pod and SNATed to the node from the SNAT port range,
/// routed to the peer node with the hop limit down by one; the reply
/// restored to come from the NodePort and routed to the client. Returns the
/// flow's SNAT port.
fn snated_syn_and_reply(
    nf: &NodeFixture,
    run: fn(&NodeFixture, &[u8]) -> (u32, Vec<u8>),
    redirect: u32,
    client_port: u16,
    hook: &str,
) -> u16 {
    let syn = tcp(OUTSIDE, client_port, NODE_IP, NODE_PORT, frame::SYN);
    let (ret, out) = run(nf, &syn);
    assert_eq!(
        ret, redirect,
        "NodePort SYN with a remote backend: {hook} verdict"
    );
    let p = parse_checked6(&out, &format!("SNATed SYN at {hook}"));
    assert_eq!(
        (p.src, p.dst, p.dport),
        (NODE_IP, REMOTE_POD, 8080),
        "{hook}: SYN not SNATed to the node and DNATed to the pod"
    );
    assert!(
        (proxy_common::SNAT_PORT_MIN..=proxy_common::SNAT_PORT_MAX).contains(&p.sport),
        "{hook}: SNAT port {} outside the range",
        p.sport
    );
    assert_eq!(
        macs(&out),
        (PEER_MAC, UPLINK_MAC),
        "{hook}: not routed to the peer node"
    );
    assert_eq!(
        out[HOP_LIMIT],
        syn[HOP_LIMIT] - 1,
        "{hook}: hop limit not taken down by one"
    );
    let snat_port = p.sport;

    let reply = tcp(
        REMOTE_POD,
        8080,
        NODE_IP,
        snat_port,
        frame::SYN | frame::ACK,
    );
    let (ret, out) = run(nf, &reply);
    assert_eq!(ret, redirect, "reply: {hook} verdict");
    let r = parse_checked6(&out, &format!("reverse-translated reply at {hook}"));
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (NODE_IP, NODE_PORT, OUTSIDE, client_port),
        "{hook}: the reply must come from the NodePort and go back to the client"
    );
    assert_eq!(
        macs(&out),
        (OUTSIDE_MAC, UPLINK_MAC),
        "{hook}: reply not routed to the client"
    );
    snat_port
}

/// ETP Cluster, remote backend: the SYN is DNATed to the pod and SNATed to
/// the node's IPv6 address (`NODE_CONFIG6`) from the SNAT port range, then
/// routed by the program (the peer node's MAC, hop limit down by one); the
/// reply is reverse-translated to the client, from the NodePort, and routed
/// too; the next packet keeps the flow's port.
#[test]
fn nodeport_to_a_remote_backend_is_snated_to_the_node_and_the_reply_restored() {
    let nf = node_fixture();
    let snat_port = snated_syn_and_reply(&nf, run_on_uplink, TC_ACT_REDIRECT, 41000, "tc");

    let (ret, out) = run_on_uplink(&nf, &tcp(OUTSIDE, 41000, NODE_IP, NODE_PORT, frame::ACK));
    assert_eq!(ret, TC_ACT_REDIRECT, "established packet: verdict");
    let e = parse_checked6(&out, "established packet");
    assert_eq!(
        (e.src, e.sport, e.dst),
        (NODE_IP, snat_port, REMOTE_POD),
        "established packet left its flow's SNAT port"
    );
    assert_eq!(ncounter(&nf, "snat_new"), 1, "SNATed flows");
    assert_eq!(
        ncounter(&nf, "redirect"),
        3,
        "packets routed by the program"
    );
}

/// A NodePort with a backend on this node: DNAT alone (the client's
/// address kept, the stack delivers it), and the reply, whose source
/// becomes the node's address, routed back to the client by the program.
#[test]
fn nodeport_to_a_local_backend_is_dnated_only() {
    let nf = node_fixture();
    let syn = tcp(OUTSIDE, 41001, NODE_IP, LOCAL_NODE_PORT, frame::SYN);
    let (ret, out) = run_on_uplink(&nf, &syn);
    assert_eq!(ret, TC_PASS, "NodePort SYN with a local backend: verdict");
    let p = parse_checked6(&out, "DNATed SYN");
    assert_eq!(
        (p.src, p.sport, p.dst, p.dport),
        (OUTSIDE, 41001, LOCAL_POD, 8080),
        "SYN to a local backend must be DNATed only"
    );
    assert_eq!(
        out[HOP_LIMIT], syn[HOP_LIMIT],
        "the stack forwards it, not the program"
    );

    let reply = tcp(LOCAL_POD, 8080, OUTSIDE, 41001, frame::SYN | frame::ACK);
    let (ret, out) = run_on_uplink(&nf, &reply);
    assert_eq!(
        ret, TC_ACT_REDIRECT,
        "reply from the node's address: verdict"
    );
    let r = parse_checked6(&out, "reply");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (NODE_IP, LOCAL_NODE_PORT, OUTSIDE, 41001),
        "reply not restored to the NodePort"
    );
    assert_eq!(
        macs(&out),
        (OUTSIDE_MAC, UPLINK_MAC),
        "reply not routed to the client"
    );
    assert_eq!(
        ncounter(&nf, "snat_new"),
        0,
        "a local backend needs no SNAT"
    );
}

/// externalTrafficPolicy Local with no endpoint on this node: dropped and
/// counted, as IPv4's.
#[test]
fn etp_local_without_local_endpoints_drops_and_counts() {
    let nf = node_fixture();
    let (ret, _) = run_on_uplink(
        &nf,
        &tcp(OUTSIDE, 41002, NODE_IP, LOCAL_ONLY_NODE_PORT, frame::SYN),
    );
    assert_eq!(
        ret, TC_ACT_SHOT,
        "SYN to a NodePort without local endpoints: verdict"
    );
    assert_eq!(
        ncounter(&nf, "drop_no_endpoint"),
        1,
        "the drop was not counted"
    );
    assert_eq!(ncounter(&nf, "reject"), 0, "rejected instead of dropped");
    assert_eq!(
        ncounter(&nf, "dnat_new"),
        0,
        "translated instead of dropped"
    );
}

/// loadBalancerSourceRanges with an IPv6 prefix: a client inside it is
/// served (SNATed to the remote backend), one outside is dropped and
/// counted.
#[test]
fn source_ranges_admit_one_client_and_refuse_another() {
    let nf = node_fixture();
    let (ret, out) = run_on_uplink(&nf, &tcp(OUTSIDE, 41003, LB_IP, 80, frame::SYN));
    assert_eq!(ret, TC_ACT_REDIRECT, "allowed client to the LB IP: verdict");
    let p = parse_checked6(&out, "allowed SYN");
    assert_eq!(
        (p.src, p.dst, p.dport),
        (NODE_IP, REMOTE_POD, 8080),
        "allowed SYN"
    );
    let (ret, out) = run_on_uplink(&nf, &tcp(OUTSIDE_DENIED, 41003, LB_IP, 80, frame::SYN));
    assert_eq!(ret, TC_ACT_SHOT, "client outside the ranges: verdict");
    assert_eq!(
        ncounter(&nf, "drop_source_range"),
        1,
        "the refusal was not counted"
    );
    assert_eq!(
        ncounter(&nf, "dnat_new"),
        1,
        "only the allowed client's flow is new"
    );
    drop(out);
}

/// A pod reaching its own Service and picked as its own backend: its
/// source becomes the node's IPv6 address with a port of the SNAT range
/// (routed back to the pod by the program), and the pod's answer is
/// restored to come from the Service to its own address and port.
#[test]
fn hairpin_flows_take_the_node_address_and_the_reply_is_restored() {
    let nf = node_fixture();
    let syn = tcp(LOCAL_POD, 41004, HAIRPIN_VIP, 80, frame::SYN);
    let (ret, out) = run_on_uplink(&nf, &syn);
    assert_eq!(ret, TC_ACT_REDIRECT, "hairpin SYN: verdict");
    let p = parse_checked6(&out, "hairpin SYN");
    assert_eq!(
        (p.src, p.dst, p.dport),
        (NODE_IP, LOCAL_POD, 8080),
        "hairpin SYN must reach the pod from the node's address"
    );
    assert!(
        (proxy_common::SNAT_PORT_MIN..=proxy_common::SNAT_PORT_MAX).contains(&p.sport),
        "hairpin port {} outside the SNAT range",
        p.sport
    );
    assert_eq!(
        macs(&out),
        (POD_MAC, UPLINK_MAC),
        "not routed back to the pod"
    );
    let reply = tcp(LOCAL_POD, 8080, NODE_IP, p.sport, frame::SYN | frame::ACK);
    let (ret, out) = run_on_uplink(&nf, &reply);
    assert_eq!(ret, TC_PASS, "hairpin reply: verdict");
    let r = parse_checked6(&out, "hairpin reply");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (HAIRPIN_VIP, 80, LOCAL_POD, 41004),
        "hairpin reply must come back from the Service"
    );
    assert_eq!(ncounter(&nf, "hairpin"), 1, "hairpin flows");
    assert_eq!(
        ncounter(&nf, "snat_new"),
        0,
        "a hairpin flow counted as SNAT"
    );
}

/// A packet the program routes itself with a hop limit of 1 is dropped and
/// counted, as a router drops it.
#[test]
fn a_spent_hop_limit_is_dropped_and_counted() {
    let nf = node_fixture();
    let mut syn = tcp(OUTSIDE, 41005, NODE_IP, NODE_PORT, frame::SYN);
    syn[HOP_LIMIT] = 1;
    let (ret, _) = run_on_uplink(&nf, &syn);
    assert_eq!(ret, TC_ACT_SHOT, "SYN with hop limit 1: verdict");
    assert_eq!(ncounter(&nf, "drop_ttl"), 1, "the drop was not counted");
}

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_REDIRECT: u32 = 4;
/// On the uplink's link, with no neighbour entry.
const UNRESOLVED_CLIENT: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x50, 0, 0, 0, 0, 0x300);

/// `xdp_md` for a frame of `len` bytes arriving on `ifindex`.
fn xdp_md(len: usize, ifindex: u32) -> [u8; 24] {
    let mut md = [0u8; 24];
    md[4..8].copy_from_slice(&(len as u32).to_ne_bytes());
    md[12..16].copy_from_slice(&ifindex.to_ne_bytes());
    md
}

/// `xdp_ingress` on one frame arriving on `ifindex`: IPv6 reaches
/// `xdp_ingress6` only through its tail call, so a translation here says
/// the call was taken.
fn run_xdp_on(nf: &NodeFixture, ifindex: u32, input: &[u8]) -> (u32, Vec<u8>) {
    assert!(
        nf.fx.datapath.xdp6_loaded(),
        "xdp_ingress6 is not in XDP_NEXT: nothing here would run it"
    );
    let program = nf.fx.datapath.xdp_program();
    nf.ns
        .run(|| {
            let mut out = vec![0u8; input.len() + 256];
            let md = xdp_md(input.len(), ifindex);
            let mut opts = TestRunOptions::new();
            opts.data_in = Some(input);
            opts.data_out = Some(&mut out);
            opts.ctx_in = Some(&md);
            let result = program.test_run(opts).expect("XDP test run");
            out.truncate(result.data_size_out as usize);
            (result.return_value, out)
        })
        .expect("run in the node namespace")
}

fn run_xdp(nf: &NodeFixture, input: &[u8]) -> (u32, Vec<u8>) {
    run_xdp_on(nf, nf.uplink_index, input)
}

/// IPv6's flow cache remembers a miss as IPv4's does (`FLOW_CACHE6`): answers from a
/// backend's address and port that no flow knows pass untouched again and again; a
/// flow created afterwards with that key as its reply voids what was remembered, and
/// its answers are translated back, UDP and the ACKs of TCP after the handshake.
#[test]
fn a_flow_created_after_its_answers_were_seen_without_one_is_translated() {
    let fx = fixture();
    // One CPU throughout: the cache that remembered the keys as absent is the
    // one the answers would find.
    let _cpu = stay_on_this_cpu();
    let untouched = |frame: &[u8], what: &str| {
        for i in 0..3 {
            let (ret, out) = run(&fx, frame);
            assert_eq!(
                (ret, out == frame),
                (TC_PASS, true),
                "{what}, time {i}: verdict, and whether it is untouched"
            );
        }
    };
    for backend in BACKENDS {
        untouched(
            &udp(backend, 5353, CLIENT, 40555),
            &format!("a datagram from [{backend}]:5353 with no flow"),
        );
        untouched(
            &tcp(backend, 8080, CLIENT, 40556, frame::ACK),
            &format!("an ACK from [{backend}]:8080 with no flow"),
        );
    }

    let (_, out) = run(&fx, &udp(CLIENT, 40555, VIP, 53));
    let backend = parse_checked6(&out, "the client's datagram").dst;
    let (_, out) = run(&fx, &udp(backend, 5353, CLIENT, 40555));
    let r = parse_checked6(&out, "the backend's answer");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (VIP, 53, CLIENT, 40555),
        "the answer of a UDP flow created after that answer's key was seen without one"
    );

    let (_, out) = run(&fx, &tcp(CLIENT, 40556, VIP, 80, frame::SYN));
    let backend = parse_checked6(&out, "SYN").dst;
    let (_, out) = run(
        &fx,
        &tcp(backend, 8080, CLIENT, 40556, frame::SYN | frame::ACK),
    );
    assert_eq!(parse_checked6(&out, "SYN-ACK").src, VIP);
    run(&fx, &tcp(CLIENT, 40556, VIP, 80, frame::ACK));
    for i in 0..3 {
        let (_, out) = run(&fx, &tcp(backend, 8080, CLIENT, 40556, frame::ACK));
        let r = parse_checked6(&out, "the backend's ACK");
        assert_eq!(
            (r.src, r.sport, r.dst, r.dport),
            (VIP, 80, CLIENT, 40556),
            "the backend's ACK {i} of a connection created after its key was seen without one"
        );
    }
}

/// ETP Cluster, remote backend, at XDP: the SYN is SNATed to the node and
/// DNATed to the pod, routed by the program (the peer node's MAC, hop limit
/// down by one) and sent back out of the uplink; the reply comes back from
/// the NodePort to the client the same way, and so do the flow's next
/// packets, over TCP and UDP, every checksum recomputed from scratch. tc
/// does none of it.
#[test]
fn xdp_nodeport_snat_both_ways() {
    let _cpu = stay_on_this_cpu();
    let nf = node_fixture();
    let snat_port = snated_syn_and_reply(&nf, run_xdp, XDP_REDIRECT, 45000, "XDP");

    // Established packets, the second from this CPU's flow cache once the
    // first has assured the flow.
    for i in 0..2 {
        let (ret, out) = run_xdp(&nf, &tcp(OUTSIDE, 45000, NODE_IP, NODE_PORT, frame::ACK));
        assert_eq!(ret, XDP_REDIRECT, "established packet {i}: XDP verdict");
        let e = parse_checked6(&out, "established packet at XDP");
        assert_eq!(
            (e.src, e.sport, e.dst, e.dport),
            (NODE_IP, snat_port, REMOTE_POD, 8080),
            "established packet {i} left its flow's translation"
        );
    }

    let (ret, out) = run_xdp(&nf, &udp(OUTSIDE, 45001, NODE_IP, NODE_PORT));
    // The NodePort is TCP only: UDP to it is not ours, and untouched.
    assert_eq!(ret, XDP_PASS, "UDP to a TCP NodePort: XDP verdict");
    assert_eq!(
        parse_checked6(&out, "UDP to a TCP NodePort").dst,
        NODE_IP,
        "UDP to a TCP NodePort was translated"
    );

    assert_eq!(ncounter(&nf, "snat_new"), 1, "SNATed flows");
    assert_eq!(ncounter(&nf, "xdp_tx"), 4, "frames sent back out by XDP");
    assert_eq!(
        ncounter(&nf, "redirect"),
        4,
        "packets routed by the program"
    );
    assert_eq!(ncounter(&nf, "xdp_to_tc"), 0, "frames left to tc");
}

/// A UDP NodePort to a local backend at XDP: DNAT alone, passed to the
/// stack translated (checksum recomputed from scratch); the backend's
/// answer, whose source becomes the node's address, sent back to the
/// client by XDP.
#[test]
fn xdp_local_backend_dnat_and_the_reply_sent_back() {
    let mut nf = node_fixture();
    let mut fe = Frontend {
        kind: FrontendKind::NodePort,
        ..frontend(
            Ipv6Addr::UNSPECIFIED,
            30090,
            Protocol::Udp,
            8080,
            &[LOCAL_POD],
        )
    };
    for b in &mut fe.backends {
        b.local = true;
    }
    program(&mut nf.fx, "np-udp-local", &fe);
    let (ret, out) = run_xdp(&nf, &udp(OUTSIDE, 45100, NODE_IP, 30090));
    assert_eq!(ret, XDP_PASS, "UDP to a local backend: XDP verdict");
    let p = parse_checked6(&out, "DNATed datagram at XDP");
    assert_eq!(
        (p.src, p.sport, p.dst, p.dport),
        (OUTSIDE, 45100, LOCAL_POD, 8080),
        "datagram to a local backend must be DNATed only; counters: {}",
        counters_set(&nf.fx)
    );
    let (ret, out) = run_xdp(&nf, &udp(LOCAL_POD, 8080, OUTSIDE, 45100));
    assert_eq!(ret, XDP_REDIRECT, "answer from the node's address: verdict");
    let r = parse_checked6(&out, "answer at XDP");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (NODE_IP, 30090, OUTSIDE, 45100),
        "answer not restored to the NodePort"
    );
    assert_eq!(macs(&out), (OUTSIDE_MAC, UPLINK_MAC), "answer not routed");
    assert_eq!(ncounter(&nf, "xdp_tx"), 1, "frames sent back out by XDP");
}

/// What XDP cannot finish reaches tc as it came, counted `xdp_to_tc`: a
/// reject (no endpoints), a route to a neighbour not resolved yet, a route
/// out of another interface; ICMPv6 errors, extension headers XDP does not
/// walk and later fragments of no translated datagram pass uncounted, for
/// tc to count.
#[test]
fn xdp_defers_to_tc() {
    let nf = node_fixture();
    let mut expected_to_tc = 0;
    let mut defer = |input: &[u8], ifindex: u32, what: &str, counted: bool| {
        let (ret, out) = run_xdp_on(&nf, ifindex, input);
        assert_eq!(ret, XDP_PASS, "{what}: XDP verdict");
        assert!(out == input, "{what}: XDP changed the frame");
        if counted {
            expected_to_tc += 1;
        }
        assert_eq!(
            ncounter(&nf, "xdp_to_tc"),
            expected_to_tc,
            "{what}: frames left to tc"
        );
    };
    let reject = tcp(OUTSIDE, 45200, EMPTY_VIP, 80, frame::SYN);
    defer(&reject, nf.uplink_index, "no endpoints", true);
    assert_eq!(ncounter(&nf, "reject"), 0, "XDP rejected");
    // tc then rejects it.
    let (ret, _) = run_on_uplink(&nf, &reject);
    assert_eq!(
        ret, TC_ACT_REDIRECT,
        "no endpoints at tc: the RST's verdict"
    );
    assert_eq!(ncounter(&nf, "reject"), 1, "tc's reject");

    // Another egress: the frame "came in" on loopback.
    let syn = tcp(OUTSIDE, 45201, NODE_IP, NODE_PORT, frame::SYN);
    defer(&syn, 1, "a route out of another interface", true);
    assert_eq!(
        ncounter(&nf, "dnat_new"),
        0,
        "a deferred first packet made a flow"
    );

    // A client whose neighbour entry the node does not have: the SYN to a
    // local backend is DNATed at XDP (no routing), the reply deferred.
    let (ret, out) = run_xdp(
        &nf,
        &tcp(
            UNRESOLVED_CLIENT,
            45202,
            NODE_IP,
            LOCAL_NODE_PORT,
            frame::SYN,
        ),
    );
    assert_eq!(ret, XDP_PASS, "SYN to a local backend: XDP verdict");
    assert_eq!(parse_checked6(&out, "DNATed SYN").dst, LOCAL_POD);
    let reply = tcp(
        LOCAL_POD,
        8080,
        UNRESOLVED_CLIENT,
        45202,
        frame::SYN | frame::ACK,
    );
    defer(&reply, nf.uplink_index, "an unresolved neighbour", true);
    let (ret, out) = run_on_uplink(&nf, &reply);
    assert_eq!(
        ret, TC_ACT_REDIRECT,
        "tc resolves the neighbour itself (bpf_redirect_neigh)"
    );
    let r = parse_checked6(&out, "reply at tc");
    assert_eq!((r.src, r.sport), (NODE_IP, LOCAL_NODE_PORT));

    let mut long = spec(OUTSIDE, 45203, NODE_IP, NODE_PORT, frame::TCP, frame::SYN);
    long.ext = vec![HOP_BY_HOP, DEST_OPTS, DEST_OPTS, DEST_OPTS, DEST_OPTS];
    defer(
        &build6(&long),
        nf.uplink_index,
        "five extension headers",
        false,
    );
    assert_eq!(
        ncounter(&nf, "pass_v6_ext_headers"),
        0,
        "counted at XDP, and again at tc"
    );
    let error = icmp6_error(
        ROUTER,
        OUTSIDE,
        PORT_UNREACHABLE,
        &tcp(OUTSIDE, 45204, REMOTE_POD, 8080, frame::SYN),
        QUOTE_MAX,
    );
    defer(&error, nf.uplink_index, "an ICMPv6 error", false);
    let later = &fragmented((OUTSIDE, 45208), (NODE_IP, NODE_PORT), 3000, 0x4567)[1];
    defer(
        later,
        nf.uplink_index,
        "a later fragment of no translated datagram",
        false,
    );
    assert_eq!(
        ncounter(&nf, "frag_untracked"),
        0,
        "counted at XDP, and again at tc"
    );
}

/// What XDP drops itself, counted as tc counts it: a source outside the
/// source ranges, a NodePort without a local endpoint under
/// externalTrafficPolicy Local, a spent hop limit.
#[test]
fn xdp_drops() {
    let nf = node_fixture();
    let (ret, _) = run_xdp(&nf, &tcp(OUTSIDE_DENIED, 45205, LB_IP, 80, frame::SYN));
    assert_eq!(ret, XDP_DROP, "source outside loadBalancerSourceRanges");
    assert_eq!(ncounter(&nf, "drop_source_range"), 1);
    let (ret, _) = run_xdp(
        &nf,
        &tcp(OUTSIDE, 45206, NODE_IP, LOCAL_ONLY_NODE_PORT, frame::SYN),
    );
    assert_eq!(ret, XDP_DROP, "ETP Local without a local endpoint");
    assert_eq!(ncounter(&nf, "drop_no_endpoint"), 1);

    let mut spent = tcp(OUTSIDE, 45207, NODE_IP, NODE_PORT, frame::SYN);
    spent[HOP_LIMIT] = 1;
    let (ret, _) = run_xdp(&nf, &spent);
    assert_eq!(ret, XDP_DROP, "SYN with hop limit 1: XDP verdict");
    assert_eq!(ncounter(&nf, "drop_ttl"), 1, "the drop was not counted");
    assert_eq!(ncounter(&nf, "xdp_tx"), 0, "nothing here is XDP's to send");
}

/// A second load on the same pins, as an upgrade in place or a takeover of
/// pinned links makes: its `xdp_ingress` hands IPv6 to its own
/// `xdp_ingress6`, and keeps doing so once the first datapath is gone (its
/// program array emptied with it), on the flows the first one made.
#[test]
fn a_new_load_brings_its_own_xdp_ingress6() {
    let mut nf = node_fixture();
    let syn = tcp(OUTSIDE, 45300, NODE_IP, NODE_PORT, frame::SYN);
    let (ret, out) = run_xdp(&nf, &syn);
    assert_eq!(ret, XDP_REDIRECT, "SYN through the first load's XDP");
    let snat_port = parse_checked6(&out, "SNATed SYN").sport;
    let (second, planner) = load_programmed(&nf.fx.pins, proxy_common::MAX_CONNTRACK);
    // The first load's programs and descriptors go; its pins stay.
    let first = std::mem::replace(&mut nf.fx.datapath, second);
    drop(first);
    nf.fx.planner = planner;
    let reply = tcp(
        REMOTE_POD,
        8080,
        NODE_IP,
        snat_port,
        frame::SYN | frame::ACK,
    );
    let (ret, out) = run_xdp(&nf, &reply);
    assert_eq!(
        ret, XDP_REDIRECT,
        "the reply through the second load's XDP: verdict"
    );
    let r = parse_checked6(&out, "reply through the second load");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (NODE_IP, NODE_PORT, OUTSIDE, 45300),
        "the second load must translate the first one's flow"
    );
    assert_eq!(ncounter(&nf, "xdp_tx"), 2, "frames sent back out by XDP");
}

/// Pins the test to the CPU it runs on, so that every `BPF_PROG_TEST_RUN`
/// of a test finds the same per-CPU flow cache; restored on drop.
fn stay_on_this_cpu() -> CpuGuard {
    use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
    use nix::unistd::Pid;
    let before = sched_getaffinity(Pid::from_raw(0)).expect("sched_getaffinity");
    // SAFETY: sched_getcpu takes nothing and touches no memory of ours.
    let cpu = unsafe { libc::sched_getcpu() };
    assert!(cpu >= 0, "sched_getcpu failed");
    let mut one = CpuSet::new();
    one.set(cpu as usize).expect("CPU number within a CpuSet");
    sched_setaffinity(Pid::from_raw(0), &one).expect("sched_setaffinity");
    CpuGuard(before)
}

struct CpuGuard(nix::sched::CpuSet);

impl Drop for CpuGuard {
    fn drop(&mut self) {
        let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &self.0);
    }
}

fn words(ip: Ipv6Addr) -> [u32; 4] {
    let o = ip.octets();
    std::array::from_fn(|i| {
        u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
    })
}

fn ct6_key(
    src: Ipv6Addr,
    sport: u16,
    dst: Ipv6Addr,
    dport: u16,
    proto: u8,
) -> proxy_common::Ct6Key {
    proxy_common::Ct6Key::new(words(src), words(dst), sport.to_be(), dport.to_be(), proto)
}

/// Rewrites an assured flow's forward entry to translate to `backend`,
/// behind the datapath's back (no invalidation), as only a test would.
fn point_entry_at(fx: &mut Fixture, key: &proxy_common::Ct6Key, backend: Ipv6Addr) {
    let conntrack6 = fx
        .datapath
        .maps
        .conntrack6
        .as_mut()
        .expect("CONNTRACK6 is loaded");
    let mut entry = conntrack6
        .get(key, 0)
        .expect("the flow's entry in CONNTRACK6");
    entry.nat_addr_be = words(backend);
    conntrack6
        .insert(key, entry, 0)
        .expect("rewriting the entry");
}

/// Entries of both IPv6 conntrack maps: (assured, not assured yet).
fn entries6(fx: &Fixture) -> (usize, usize) {
    let count = |map: &Option<aya::maps::HashMap<aya::maps::MapData, _, _>>, name: &str| {
        map.as_ref()
            .unwrap_or_else(|| panic!("{name} is loaded"))
            .iter()
            .count()
    };
    (
        count(&fx.datapath.maps.conntrack6, "CONNTRACK6"),
        count(&fx.datapath.maps.ct_new6, "CT_NEW6"),
    )
}

/// Established IPv6 packets are translated from this CPU's copy of their
/// conntrack entry (checksums recomputed from scratch on every frame), and
/// a copy is never used once its entry may have changed: after the agent
/// bumps the epoch, once the flow closes, or once the datapath removes the
/// entry for a new connection on the same ports.
#[test]
fn flow_cache_serves_established_packets_until_its_entry_changes() {
    let mut fx = fixture();
    let _cpu = stay_on_this_cpu();
    let sport = 41500;
    let dst = |fx: &Fixture, flags: u8, what: &str| {
        let (ret, out) = run(fx, &tcp(CLIENT, sport, VIP, 80, flags));
        assert_eq!(ret, TC_PASS, "{what}: verdict");
        let p = parse_checked6(&out, what);
        assert_eq!((p.src, p.sport, p.dport), (CLIENT, sport, 8080), "{what}");
        p.dst
    };
    let first = dst(&fx, frame::SYN, "SYN");
    // The backend answers and the client's ACK assures the flow: only an
    // assured flow's entries are copied.
    let (ret, out) = run(
        &fx,
        &tcp(first, 8080, CLIENT, sport, frame::SYN | frame::ACK),
    );
    assert_eq!(ret, TC_PASS, "SYN-ACK: verdict");
    let answer = parse_checked6(&out, "SYN-ACK");
    assert_eq!(
        (answer.src, answer.sport),
        (VIP, 80),
        "SYN-ACK not restored"
    );
    assert_eq!(dst(&fx, frame::ACK, "ACK assuring the flow"), first);
    assert_eq!(
        entries6(&fx),
        (2, 0),
        "the assured flow's two entries moved to CONNTRACK6"
    );
    assert_eq!(dst(&fx, frame::ACK, "ACK taking the copy"), first);
    assert_eq!(dst(&fx, frame::ACK, "ACK from the copy"), first);

    // The entry is pointed at another backend behind the datapath's back:
    // the copy still serves (which shows there is one) until the agent
    // bumps the epoch, as it does after removing entries.
    let other = *BACKENDS.iter().find(|b| **b != first).expect("3 backends");
    let key = ct6_key(CLIENT, sport, VIP, 80, frame::TCP);
    point_entry_at(&mut fx, &key, other);
    let established = counter(&fx, "dnat_established");
    assert_eq!(
        dst(&fx, frame::ACK, "ACK with a rewritten entry"),
        first,
        "an established packet did not come from the flow cache"
    );
    assert_eq!(
        counter(&fx, "dnat_established"),
        established + 1,
        "a packet from the cache is counted as established"
    );
    fx.datapath
        .maps
        .bump_flow_epoch()
        .expect("bumping the epoch");
    assert_eq!(
        dst(&fx, frame::ACK, "ACK after the epoch bump"),
        other,
        "a cached copy was used after the agent voided them"
    );
    assert_eq!(dst(&fx, frame::ACK, "ACK, copied again"), other);

    // The connection closes and the client reuses its port for a new one,
    // which the service now sends to a third backend: the datapath removes
    // the closed entry, and the old copy must not outlive it.
    let third = *BACKENDS
        .iter()
        .find(|b| **b != first && **b != other)
        .expect("3 backends");
    let owner = ObjectKey {
        namespace: "test".into(),
        name: "svc0".into(),
    };
    let fe = frontend(VIP, 80, Protocol::Tcp, 8080, &[third]);
    let out = fx
        .planner
        .sync_service(&owner, &[fe], &mut fx.datapath.maps);
    assert!(
        out.errors.is_empty(),
        "reprogramming svc0: {:?}",
        out.errors
    );
    assert_eq!(dst(&fx, frame::RST | frame::ACK, "client's RST"), other);
    // The reset closes the flow, and closing voids the copies (a closed
    // flow's packets keep its timestamp true, which decides when its SNAT
    // port is free): an ACK after it follows the entry, rewritten again
    // behind the datapath's back.
    point_entry_at(&mut fx, &key, first);
    assert_eq!(
        dst(&fx, frame::ACK, "ACK after the RST"),
        first,
        "a copy taken before the flow closed served a packet after it"
    );
    assert_eq!(dst(&fx, frame::SYN, "SYN reusing the port"), third);
    assert_eq!(
        dst(&fx, frame::ACK, "ACK of the new connection"),
        third,
        "a copy of the closed connection's entry outlived it"
    );
}

/// IPv6 flows follow TCP state per direction as IPv4's do: a FIN from the
/// client half-closes the flow (the backend's data is still translated),
/// RSTs and FINs outside the receiver's window are counted
/// (`ct_out_of_window`) and change nothing, and the backend's FIN then
/// closes the flow.
#[test]
fn tcp_state_is_tracked_per_direction_and_inside_the_window() {
    let fx = fixture();
    let (sport, c, b) = (41720u16, 3_000u32, 8_000_000u32);
    let with = |frame: Vec<u8>, seq: u32, ack: u32| frame::with_seq_ack(&frame, seq, ack);
    let (ret, out) = run(&fx, &with(tcp(CLIENT, sport, VIP, 80, frame::SYN), c, 0));
    assert_eq!(ret, TC_PASS, "SYN: verdict");
    let backend = parse_checked6(&out, "SYN").dst;
    let from_backend = |flags: u8, seq: u32, what: &str| {
        let (ret, out) = run(
            &fx,
            &with(tcp(backend, 8080, CLIENT, sport, flags), seq, c + 1),
        );
        assert_eq!(ret, TC_PASS, "{what}: verdict");
        let p = parse_checked6(&out, what);
        (p.src, p.sport)
    };
    let from_client = |flags: u8, seq: u32, what: &str| {
        let (ret, _) = run(&fx, &with(tcp(CLIENT, sport, VIP, 80, flags), seq, b + 1));
        assert_eq!(ret, TC_PASS, "{what}: verdict");
    };
    from_backend(frame::SYN | frame::ACK, b, "SYN-ACK");
    from_client(frame::ACK, c + 1, "ACK");
    let flags = || {
        fx.datapath
            .maps
            .conntrack6
            .as_ref()
            .expect("CONNTRACK6 is loaded")
            .get(&ct6_key(CLIENT, sport, VIP, 80, frame::TCP), 0)
            .expect("the flow's assured entry")
            .flags
            & (proxy_common::ct_flags::FIN_BOTH | proxy_common::ct_flags::CLOSING)
    };
    from_client(
        frame::RST | frame::ACK,
        (c + 1).wrapping_sub(100_000),
        "client's stale RST",
    );
    from_backend(frame::RST | frame::ACK, b - 1, "backend's stale RST");
    from_backend(
        frame::FIN | frame::ACK,
        b.wrapping_add(3 << 30),
        "backend's far FIN",
    );
    assert_eq!(
        counter(&fx, "ct_out_of_window"),
        3,
        "out-of-window segments counted"
    );
    assert_eq!(flags(), 0, "a segment outside the window changed the flow");
    from_client(frame::FIN | frame::ACK, c + 1, "client's FIN");
    assert_eq!(
        flags(),
        proxy_common::ct_flags::FIN_FORWARD,
        "the client's FIN must half-close the flow"
    );
    assert_eq!(
        from_backend(frame::ACK, b + 1, "the backend's data after it"),
        (VIP, 80),
        "a half-closed flow's other side lost its translation"
    );
    from_backend(frame::FIN | frame::ACK, b + 1, "backend's FIN");
    assert_eq!(
        flags(),
        proxy_common::ct_flags::FIN_BOTH | proxy_common::ct_flags::CLOSING,
        "a FIN each way closes the flow"
    );
    assert_eq!(counter(&fx, "ct_out_of_window"), 3);
}

/// A UDP flow served from the flow cache goes to a live backend as soon as
/// its backend departs: the purge removes its entries and voids every
/// copy.
#[test]
fn a_departed_backend_voids_its_cached_udp_flow() {
    let mut fx = fixture();
    let _cpu = stay_on_this_cpu();
    let sport = 7100;
    let send = |fx: &Fixture, what: &str| {
        let (ret, out) = run(fx, &udp(CLIENT, sport, VIP, 53));
        assert_eq!(ret, TC_PASS, "{what}: verdict");
        let p = parse_checked6(&out, what);
        assert_eq!((p.src, p.sport, p.dport), (CLIENT, sport, 5353), "{what}");
        p.dst
    };
    let gone = send(&fx, "first datagram");
    let (_, out) = run(&fx, &udp(gone, 5353, CLIENT, sport));
    assert_eq!(
        parse_checked6(&out, "answer").src,
        VIP,
        "answer not restored"
    );
    assert_eq!(send(&fx, "second datagram, assuring the flow"), gone);
    assert_eq!(entries6(&fx), (2, 0), "the assured flow's entries");
    assert_eq!(send(&fx, "datagram taking the copy"), gone);
    assert_eq!(send(&fx, "datagram from the copy"), gone);

    let remaining: Vec<Ipv6Addr> = BACKENDS.iter().copied().filter(|b| *b != gone).collect();
    let owner = ObjectKey {
        namespace: "test".into(),
        name: "svc1".into(),
    };
    let fe = frontend(VIP, 53, Protocol::Udp, 5353, &remaining);
    let out = fx
        .planner
        .sync_service(&owner, &[fe], &mut fx.datapath.maps);
    assert!(
        out.errors.is_empty(),
        "reprogramming svc1: {:?}",
        out.errors
    );
    let departed = fx.planner.take_departed();
    let swept = conntrack::purge_departed(
        &mut fx.datapath.maps,
        &departed,
        &fx.planner.take_affinity_purge(&departed),
    )
    .expect("purge");
    assert_eq!(swept.conntrack, 2, "the UDP flow's two entries go");
    let now = send(&fx, "datagram after the purge");
    assert!(
        remaining.contains(&now),
        "a datagram after the purge went to the departed backend {now} (a stale copy)"
    );
}

/// A flood of new IPv6 flows cannot push established ones out of
/// conntrack: with `CONNTRACK6` of 1,024 entries, 100 established TCP
/// connections and 50 UDP flows that exchanged twice (assured) keep their
/// backends, both ways, through 100,000 new flows (SYNs never answered, and
/// one-shot UDP exchanges), about 100 times what `CONNTRACK6` holds and
/// more than `CT_NEW6` does; a connection opened in the middle of the flood
/// is served and assured.
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom, over one loaded datapath"
)]
fn a_flood_of_new_flows_leaves_established_flows_alone() {
    const CAPACITY: u32 = 1024;
    let pins = unique_pins();
    let (datapath, planner) = load_programmed(&pins, CAPACITY);
    let fx = Fixture {
        datapath,
        pins,
        planner,
    };
    let _cpu = stay_on_this_cpu();
    let backend_of = |out: &[u8], what: &str| parse_checked6(out, what).dst;
    let connect = |sport: u16| {
        let (_, out) = run(&fx, &tcp(CLIENT, sport, VIP, 80, frame::SYN));
        let backend = backend_of(&out, "SYN");
        let (_, out) = run(
            &fx,
            &tcp(backend, 8080, CLIENT, sport, frame::SYN | frame::ACK),
        );
        assert_eq!(
            parse_checked6(&out, "SYN-ACK").src,
            VIP,
            "SYN-ACK of {sport}"
        );
        let (_, out) = run(&fx, &tcp(CLIENT, sport, VIP, 80, frame::ACK));
        assert_eq!(backend_of(&out, "ACK"), backend, "ACK of {sport}");
        backend
    };
    let exchange_twice = |sport: u16| {
        let (_, out) = run(&fx, &udp(CLIENT, sport, VIP, 53));
        let backend = backend_of(&out, "request");
        run(&fx, &udp(backend, 5353, CLIENT, sport));
        let (_, out) = run(&fx, &udp(CLIENT, sport, VIP, 53));
        assert_eq!(backend_of(&out, "second request"), backend);
        backend
    };
    let tcp_flows: Vec<(u16, Ipv6Addr)> = (20_000..20_100).map(|p| (p, connect(p))).collect();
    let udp_flows: Vec<(u16, Ipv6Addr)> =
        (21_000..21_050).map(|p| (p, exchange_twice(p))).collect();
    assert_eq!(
        counter(&fx, "ct_assured"),
        150,
        "flows assured before the flood"
    );

    const FLOOD: u32 = 100_000;
    let mut during = None;
    for i in 0..FLOOD {
        // Clients all over fd00:201::/64, ports all over the range.
        let client = Ipv6Addr::from(
            u128::from(Ipv6Addr::new(0xfd00, 0x201, 0, 0, 0, 0, 0, 0)) + u128::from(i >> 4),
        );
        let sport = 1024 + (i % 60_000) as u16;
        if i % 4 == 0 {
            let (_, out) = run(&fx, &udp(client, sport, VIP, 53));
            let backend = backend_of(&out, "flood datagram");
            run(&fx, &udp(backend, 5353, client, sport));
        } else {
            run(&fx, &tcp(client, sport, VIP, 80, frame::SYN));
        }
        if i == FLOOD / 2 {
            during = Some(connect(30_000));
        }
    }
    // Copies in the flow cache would hide an evicted entry for up to a second.
    let mut fx = fx;
    fx.datapath
        .maps
        .bump_flow_epoch()
        .expect("voiding the flow cache");
    let mut lost = Vec::new();
    for (sport, backend) in &tcp_flows {
        let (_, out) = run(&fx, &tcp(CLIENT, *sport, VIP, 80, frame::ACK));
        let (_, back) = run(&fx, &tcp(*backend, 8080, CLIENT, *sport, frame::ACK));
        let now = (
            backend_of(&out, "ACK after"),
            parse_checked6(&back, "answer after").src,
        );
        if now != (*backend, VIP) {
            lost.push(format!(
                "TCP {sport}: {now:?} instead of ({backend}, {VIP})"
            ));
        }
    }
    for (sport, backend) in &udp_flows {
        let (_, out) = run(&fx, &udp(CLIENT, *sport, VIP, 53));
        let now = backend_of(&out, "UDP after");
        if now != *backend {
            lost.push(format!("UDP {sport}: {now} instead of {backend}"));
        }
    }
    assert!(
        lost.is_empty(),
        "{} of 150 established IPv6 flows lost their entries to a flood of {FLOOD} new flows \
         (CONNTRACK6 of {CAPACITY} entries): {:?}",
        lost.len(),
        &lost[..lost.len().min(10)]
    );
    let during = during.expect("a connection during the flood");
    assert!(
        BACKENDS.contains(&during),
        "connection during the flood: {during}"
    );
    assert_eq!(
        counter(&fx, "ct_assured"),
        151,
        "the flood assured flows, or the connection made during it was not"
    );
    assert!(
        counter(&fx, "ct_new_flow") >= u64::from(150 + FLOOD),
        "new flows counted: {}",
        counter(&fx, "ct_new_flow")
    );
    let (assured, unassured) = entries6(&fx);
    assert_eq!(assured, 2 * 151, "CONNTRACK6 holds the assured flows alone");
    assert!(
        unassured > 0 && unassured <= proxy_common::MAX_CT_NEW as usize,
        "CT_NEW6 holds {unassured} entries"
    );
}

/// `tc_ingress6`'s rare events reach the datapath log as IPv4's do, with
/// IPv6 addresses as `[addr]:port`: read back from the ring buffer through
/// the agent's reader.
#[test]
fn rare_events_are_logged_with_ipv6_addresses() {
    use proxy_userspace::datapath::event_log;
    let mut fx = fixture();
    event_log::set_level(&fx.pins, event_log::Level::Info).expect("setting the log level");
    let mut logger = fx.datapath.event_logger().expect("the log reader");
    let (ret, out) = run(&fx, &tcp(CLIENT, 42000, EMPTY_VIP, 80, frame::SYN));
    assert_eq!(ret, TC_ACT_REDIRECT, "reject: verdict");
    assert!(
        parse_checked6(&out, "RST").l4[13] & frame::RST != 0,
        "no RST for a frontend without endpoints"
    );
    let (ret, _) = run(&fx, &udp(CLIENT, 42001, EMPTY_VIP, 53));
    assert_eq!(ret, TC_ACT_REDIRECT, "UDP reject: verdict");
    // A debug event, below the level: not logged.
    let early = fragmented((CLIENT, 42002), (VIP, 53), 3000, 0x7777);
    let (ret, _) = run(&fx, &early[1]);
    assert_eq!(ret, TC_PASS, "untracked later fragment: verdict");
    assert_eq!(
        counter(&fx, "frag_untracked"),
        1,
        "the later fragment was not seen"
    );

    let logs = ebpf_proxy_apiserver::Logs::default();
    tracing::subscriber::with_default(logs.subscriber(), || logger.flush());
    let text = logs.text();
    for line in [
        "tcp [fd00:10::11]:42000 -> [fd00:96::20]:80: reject sent, no endpoints",
        "udp [fd00:10::11]:42001 -> [fd00:96::20]:53: reject sent, no endpoints",
    ] {
        assert!(
            text.lines()
                .any(|l| l.contains("datapath") && l.contains(line)),
            "the datapath log lacks {line:?}; it holds:\n{text}"
        );
    }
    assert!(
        !text.contains("later fragment"),
        "a debug event was logged at level info:\n{text}"
    );
}

// ---------------------------------------------------------------------------
// SNAT port exhaustion, ICMPv6 errors on the SNAT, hairpin and NodePort-reply
// paths, and packets longer than their route's MTU.

/// Sets the SNAT port range to `min..=max` (IPv4's `NODE_CONFIG` holds it
/// for both families).
fn snat_range(nf: &mut NodeFixture, min: u16, max: u16) {
    use proxy_userspace::planner::{MapOp, MapStore, node};
    let mut config = node::node_config(None, false);
    config.snat_port_min = min;
    config.snat_port_max = max;
    nf.fx
        .datapath
        .maps
        .apply(&MapOp::SetNodeConfig { config })
        .expect("the SNAT port range");
}

/// Sets how long a reset TCP flow lives (netfilter's `CLOSE`), holding its
/// SNAT port.
fn reset_timeout(nf: &mut NodeFixture, close: Duration) {
    use proxy_userspace::planner::{MapOp, MapStore};
    let timeouts = proxy_common::CtTimeouts {
        tcp_close_ns: u64::try_from(close.as_nanos()).expect("a short timeout"),
        ..proxy_common::CtTimeouts::DEFAULT
    };
    nf.fx
        .datapath
        .maps
        .apply(&MapOp::SetCtTimeouts { timeouts })
        .expect("setting the timeouts");
}

/// SNAT ports run out, and come back once their flows close, through `run`
/// (tc or XDP, named `hook`, whose verdicts are `redirect` and `drop`): four
/// ports give four flows, each from the range; a fifth is dropped, counted
/// `snat_exhausted` and leaves no entry; once the four are reset and their
/// closing timeout (1 s here) has gone by, a new flow takes one of their
/// ports and its reply reaches it.
fn snat_ports_exhaust_then_come_back(
    run: fn(&NodeFixture, &[u8]) -> (u32, Vec<u8>),
    (redirect, drop): (u32, u32),
    base: u16,
    hook: &str,
) {
    let _cpu = stay_on_this_cpu();
    let mut nf = node_fixture();
    snat_range(&mut nf, 1024, 1027);
    reset_timeout(&mut nf, Duration::from_secs(1));
    let syn = |port: u16| tcp(OUTSIDE, port, NODE_IP, NODE_PORT, frame::SYN);
    let mut ports = std::collections::BTreeSet::new();
    let mut client_port = base;
    // Random tries can miss the last free port: keep opening flows until
    // all four are taken.
    while ports.len() < 4 && client_port < base + 200 {
        let (ret, out) = run(&nf, &syn(client_port));
        if ret == redirect {
            let p = parse_checked6(&out, &format!("SNATed SYN at {hook}"));
            assert!(
                (1024..=1027).contains(&p.sport),
                "{hook}: SNAT port {} outside 1024..=1027",
                p.sport
            );
            ports.insert(p.sport);
            // Its backend answers at once: an answered flow keeps its port
            // (one never answered gives it up to a new flow, see
            // `a_snat_port_held_by_a_flow_never_answered_goes_to_a_new_flow`).
            let answer = tcp(REMOTE_POD, 8080, NODE_IP, p.sport, frame::SYN | frame::ACK);
            let (ret, _) = run(&nf, &answer);
            assert_eq!(
                ret, redirect,
                "{hook}: the backend's answer on SNAT port {}",
                p.sport
            );
        } else {
            assert_eq!(ret, drop, "{hook}: a SYN neither SNATed nor dropped");
        }
        client_port += 1;
    }
    assert_eq!(
        ports,
        (1024..=1027).collect(),
        "{hook}: the four ports of the range"
    );
    assert_eq!(ncounter(&nf, "snat_new"), 4, "{hook}: SNATed flows");
    let exhausted = ncounter(&nf, "snat_exhausted");
    let entries = entries6(&nf.fx);
    let (ret, _) = run(&nf, &syn(base + 1000));
    assert_eq!(ret, drop, "{hook}: no free SNAT port: verdict");
    assert_eq!(
        ncounter(&nf, "snat_exhausted"),
        exhausted + 1,
        "{hook}: the refused flow was not counted snat_exhausted"
    );
    assert_eq!(
        entries6(&nf.fx),
        entries,
        "{hook}: the refused flow left conntrack entries"
    );
    assert_eq!(
        ncounter(&nf, "snat_reclaimed"),
        0,
        "{hook}: an answered flow's port taken"
    );

    // Every flow that got a port is reset by its client.
    for p in base..client_port {
        run(
            &nf,
            &tcp(OUTSIDE, p, NODE_IP, NODE_PORT, frame::RST | frame::ACK),
        );
    }
    let (ret, _) = run(&nf, &syn(base + 1001));
    assert_eq!(
        ret, drop,
        "{hook}: closed only just now: the ports are still held"
    );
    // The point: a reset flow's SNAT port is held for its closing timeout.
    std::thread::sleep(Duration::from_millis(1_200));
    let (ret, out) = run(&nf, &syn(base + 1002));
    assert_eq!(ret, redirect, "{hook}: a closed flow's port is free again");
    let p = parse_checked6(&out, &format!("SNATed SYN on a reused port at {hook}"));
    assert!(
        ports.contains(&p.sport),
        "{hook}: port {} not from the range",
        p.sport
    );
    let reply = tcp(REMOTE_POD, 8080, NODE_IP, p.sport, frame::SYN | frame::ACK);
    let (ret, out) = run(&nf, &reply);
    assert_eq!(ret, redirect, "{hook}: reply on the reused port: verdict");
    let r = parse_checked6(&out, &format!("reply on the reused port at {hook}"));
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (NODE_IP, NODE_PORT, OUTSIDE, base + 1002),
        "{hook}: the reused port's replies must go to the new flow's client"
    );
}

/// IPv6's SNAT ports as IPv4's (`datapath.rs`): a new flow's last try takes
/// the port of a flow never answered (counted `snat_reclaimed`), whose
/// replies then reach the new client; an answered flow keeps its port.
#[test]
fn a_snat_port_held_by_a_flow_never_answered_goes_to_a_new_flow() {
    let _cpu = stay_on_this_cpu();
    let mut nf = node_fixture();
    snat_range(&mut nf, 1024, 1024);
    let syn = |port: u16| tcp(OUTSIDE, port, NODE_IP, NODE_PORT, frame::SYN);
    for (client_port, what) in [
        (46_000, "a SYN never answered"),
        (46_001, "another client's SYN"),
    ] {
        let (ret, out) = run_on_uplink(&nf, &syn(client_port));
        assert_eq!(ret, TC_ACT_REDIRECT, "{what}: not SNATed and sent on");
        assert_eq!(parse_checked6(&out, what).sport, 1024, "{what}: SNAT port");
    }
    assert_eq!(ncounter(&nf, "snat_reclaimed"), 1);
    let answer = tcp(REMOTE_POD, 8080, NODE_IP, 1024, frame::SYN | frame::ACK);
    let (ret, out) = run_on_uplink(&nf, &answer);
    assert_eq!(
        ret, TC_ACT_REDIRECT,
        "the backend's answer on the taken port"
    );
    let r = parse_checked6(&out, "the answer on the taken port");
    assert_eq!(
        (r.dst, r.dport),
        (OUTSIDE, 46_001),
        "the taken port's replies must reach the new flow's client"
    );
    let (ret, _) = run_on_uplink(&nf, &syn(46_002));
    assert_eq!(ret, TC_ACT_SHOT, "an answered flow's port taken");
    assert_eq!(ncounter(&nf, "snat_reclaimed"), 1);
}

#[test]
fn snat_ports_exhaust_then_come_back_from_closed_flows_at_tc() {
    snat_ports_exhaust_then_come_back(run_on_uplink, (TC_ACT_REDIRECT, TC_ACT_SHOT), 42000, "tc");
}

#[test]
fn snat_ports_exhaust_then_come_back_from_closed_flows_at_xdp() {
    snat_ports_exhaust_then_come_back(run_xdp, (XDP_REDIRECT, XDP_DROP), 43000, "XDP");
}

/// IPv6's reopened client port as IPv4's (`datapath.rs`): a connection
/// from the port of one its client just reset, inside that flow's closing
/// timeout, ends the old flow whole and takes its SNAT port again, where
/// the old flow's reply entry used to hold it beside the new flow's. One
/// SNAT port makes every choice certain: without that, the second
/// connection finds its only port held and is dropped.
#[test]
fn a_client_port_opened_again_takes_its_reset_flows_snat_port() {
    let _cpu = stay_on_this_cpu();
    let mut nf = node_fixture();
    snat_range(&mut nf, 1024, 1024);
    let client = |nf: &NodeFixture, flags: u8, what: &str| {
        let (ret, out) = run_on_uplink(nf, &tcp(OUTSIDE, 47000, NODE_IP, NODE_PORT, flags));
        assert_eq!(
            ret,
            TC_ACT_REDIRECT,
            "{what}: not SNATed and sent on (snat_exhausted {})",
            ncounter(nf, "snat_exhausted")
        );
        parse_checked6(&out, what).sport
    };
    for round in 0..3 {
        let port = client(&nf, frame::SYN, &format!("connection {round}'s SYN"));
        assert_eq!(port, 1024, "connection {round}'s SNAT port");
        let answer = tcp(REMOTE_POD, 8080, NODE_IP, 1024, frame::SYN | frame::ACK);
        let (ret, out) = run_on_uplink(&nf, &answer);
        assert_eq!(ret, TC_ACT_REDIRECT, "connection {round}'s SYN-ACK");
        let r = parse_checked6(&out, "SYN-ACK");
        assert_eq!(
            (r.dst, r.dport),
            (OUTSIDE, 47000),
            "connection {round}'s SYN-ACK went elsewhere"
        );
        client(&nf, frame::ACK, &format!("connection {round}'s ACK"));
        client(
            &nf,
            frame::RST | frame::ACK,
            &format!("connection {round}'s RST"),
        );
    }
    assert_eq!(ncounter(&nf, "snat_exhausted"), 0);
    assert_eq!(
        entries6(&nf.fx),
        (2, 0),
        "(assured, unassured) entries: only the last connection's two should be left"
    );
    let (ret, _) = run_on_uplink(&nf, &tcp(OUTSIDE, 47001, NODE_IP, NODE_PORT, frame::SYN));
    assert_eq!(
        ret, TC_ACT_SHOT,
        "another client port took the SNAT port of a flow reset just now"
    );
}

/// `frame` with its hop limit one down, as the program routed it on.
fn one_hop_on(frame: &[u8]) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[HOP_LIMIT] -= 1;
    f
}

/// The bytes an ICMPv6 error frame quotes.
fn quote_of(error: &[u8]) -> &[u8] {
    &error[14 + 40 + 8..]
}

/// NodePort with SNAT to a remote backend, as IPv4's
/// `icmp_errors_about_a_snated_nodeport_flow_reach_the_outside_client`: a
/// router between this node and the backend says "packet too big" to this
/// node, quoting its SNAT port; tc hands it on to the outside client quoting
/// the SYN as the client sent it (but for the hop limit the node took
/// down), the router's address and the MTU kept (the stack forwards it).
/// The backend's own port unreachable comes back from the NodePort, an
/// address of this node, so tc routes it to the client itself (counted
/// `redirect`). XDP leaves errors to tc.
#[test]
fn icmpv6_errors_about_a_snated_nodeport_flow_reach_the_outside_client() {
    let nf = node_fixture();
    let syn = tcp(OUTSIDE, 41100, NODE_IP, NODE_PORT, frame::SYN);
    let (_, out) = run_xdp(&nf, &syn);
    let p = parse_checked6(&out, "SNATed SYN");
    assert_eq!((p.src, p.dst), (NODE_IP, REMOTE_POD), "SNATed SYN");
    let client_saw = (frame::TCP, OUTSIDE, 41100, NODE_IP, NODE_PORT);

    let from_router = icmp6_error(ROUTER, NODE_IP, PACKET_TOO_BIG, &out, QUOTE_MAX);
    let (ret, xdp_out) = run_xdp(&nf, &from_router);
    assert_eq!(
        (ret, &xdp_out),
        (XDP_PASS, &from_router),
        "XDP must leave the error to tc untouched"
    );
    let redirects = ncounter(&nf, "redirect");
    let (ret, tc_out) = run_on_uplink(&nf, &from_router);
    assert_eq!(ret, TC_PASS, "the router's error: tc verdict");
    let e = parse_checked_icmp6_error(&tc_out, "the router's error");
    assert_eq!(
        e,
        frame::Icmp6Error {
            src: ROUTER,
            dst: OUTSIDE,
            icmp_type: 2,
            code: 0,
            param: 1280,
            quoted: client_saw,
        },
        "the router's error, translated"
    );
    assert_eq!(
        quote_of(&tc_out),
        &one_hop_on(&syn)[14..],
        "the router's error must quote the SYN as the client sent it"
    );
    assert_eq!(
        ncounter(&nf, "redirect"),
        redirects,
        "the router's error was routed by the program"
    );

    let from_backend = icmp6_error(REMOTE_POD, NODE_IP, PORT_UNREACHABLE, &out, QUOTE_MAX);
    let (ret, tc_out) = run_on_uplink(&nf, &from_backend);
    assert_eq!(
        ret, TC_ACT_REDIRECT,
        "the backend's error must be routed here"
    );
    let e = parse_checked_icmp6_error(&tc_out, "the backend's error");
    assert_eq!(
        (e.src, e.dst, e.icmp_type, e.code, e.quoted),
        (NODE_IP, OUTSIDE, 1, 4, client_saw),
        "the backend's error, translated"
    );
    assert_eq!(
        quote_of(&tc_out),
        &one_hop_on(&syn)[14..],
        "the backend's error must quote the SYN as the client sent it"
    );
    assert_eq!(
        macs(&tc_out),
        (OUTSIDE_MAC, UPLINK_MAC),
        "the backend's error not routed to the client"
    );
    assert_eq!(
        tc_out[HOP_LIMIT],
        from_backend[HOP_LIMIT] - 1,
        "the backend's error: hop limit not taken down by one"
    );
    assert_eq!(
        ncounter(&nf, "redirect"),
        redirects + 1,
        "the backend's error not counted as routed by the program"
    );
    assert_eq!(
        ncounter(&nf, "icmp_error_translated"),
        2,
        "translated errors"
    );
}

/// The other way on the same flow, whose other side is a pod on the peer
/// node: the outside client (a firewall on it rejecting, say) answers the
/// backend's SYN-ACK with port unreachable, to the NodePort it came from.
/// Translated, the error comes from this node's SNAT address to the
/// backend, quoting the SYN-ACK as the backend sent it: its new source is an
/// address of this node, so tc routes it to the peer node itself, as it
/// routes the flow's own packets, where the stack would refuse it. (The twin
/// of IPv4's `icmp_errors_from_the_outside_client_reach_a_snated_flows_backend`;
/// the IPv6 datapath once handed such errors to the stack.)
#[test]
fn icmpv6_errors_from_the_outside_client_reach_a_snated_flows_backend() {
    let nf = node_fixture();
    let syn = tcp(OUTSIDE, 41302, NODE_IP, NODE_PORT, frame::SYN);
    let (ret, out) = run_on_uplink(&nf, &syn);
    assert_eq!(ret, TC_ACT_REDIRECT, "SNATed SYN: verdict");
    let p = parse_checked6(&out, "SNATed SYN");
    assert_eq!((p.src, p.dst), (NODE_IP, REMOTE_POD), "SNATed SYN");
    let syn_ack = tcp(
        REMOTE_POD,
        p.dport,
        NODE_IP,
        p.sport,
        frame::SYN | frame::ACK,
    );
    let (ret, reply) = run_on_uplink(&nf, &syn_ack);
    assert_eq!(ret, TC_ACT_REDIRECT, "the backend's SYN-ACK: verdict");
    let r = parse_checked6(&reply, "the backend's SYN-ACK");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (NODE_IP, NODE_PORT, OUTSIDE, 41302),
        "the backend's SYN-ACK, translated"
    );

    let redirects = ncounter(&nf, "redirect");
    let input = icmp6_error(OUTSIDE, NODE_IP, PORT_UNREACHABLE, &reply, QUOTE_MAX);
    let (ret, got) = run_on_uplink(&nf, &input);
    assert_eq!(
        ret, TC_ACT_REDIRECT,
        "the client's error must be routed here"
    );
    let e = parse_checked_icmp6_error(&got, "the client's error");
    assert_eq!(
        (e.src, e.dst, e.icmp_type, e.code, e.quoted),
        (
            NODE_IP,
            REMOTE_POD,
            1,
            4,
            (frame::TCP, REMOTE_POD, p.dport, NODE_IP, p.sport)
        ),
        "the client's error, translated"
    );
    assert_eq!(
        quote_of(&got),
        &one_hop_on(&syn_ack)[14..],
        "the client's error must quote the SYN-ACK as the backend sent it"
    );
    assert_eq!(
        macs(&got),
        (PEER_MAC, UPLINK_MAC),
        "the client's error not routed to the peer node"
    );
    assert_eq!(
        got[HOP_LIMIT],
        input[HOP_LIMIT] - 1,
        "the client's error: hop limit not taken down by one"
    );
    assert_eq!(
        ncounter(&nf, "redirect"),
        redirects + 1,
        "the client's error not counted as routed by the program"
    );
    assert_eq!(
        ncounter(&nf, "icmp_error_translated"),
        1,
        "translated errors"
    );
}

/// Hairpin, as IPv4's `icmp_errors_about_a_hairpin_flow_come_back_from_the_frontend`:
/// the pod that reached itself through its Service gets the error its own
/// kernel sent about the hairpinned SYN (to the node's address, quoting it)
/// from the frontend, quoting the frontend; a router's error about it keeps
/// the router's address. Both go to the pod through the stack (their new
/// source is no address of this node).
#[test]
fn icmpv6_errors_about_a_hairpin_flow_come_back_from_the_frontend() {
    let nf = node_fixture();
    let syn = tcp(LOCAL_POD, 41300, HAIRPIN_VIP, 80, frame::SYN);
    let (ret, out) = run_on_uplink(&nf, &syn);
    assert_eq!(ret, TC_ACT_REDIRECT, "hairpin SYN: verdict");
    let p = parse_checked6(&out, "hairpin SYN");
    assert_eq!((p.src, p.dst), (NODE_IP, LOCAL_POD), "hairpin SYN");
    let pod_saw = (frame::TCP, LOCAL_POD, 41300, HAIRPIN_VIP, 80);
    let redirects = ncounter(&nf, "redirect");
    for (i, (what, from, kind, src)) in [
        (
            "the pod's own error",
            LOCAL_POD,
            PORT_UNREACHABLE,
            HAIRPIN_VIP,
        ),
        ("a router's error", ROUTER, PACKET_TOO_BIG, ROUTER),
    ]
    .into_iter()
    .enumerate()
    {
        let input = icmp6_error(from, NODE_IP, kind, &out, QUOTE_MAX);
        let (ret, got) = run_on_uplink(&nf, &input);
        assert_eq!(ret, TC_PASS, "{what}: verdict");
        let e = parse_checked_icmp6_error(&got, what);
        assert_eq!(
            (e.src, e.dst, e.icmp_type, e.param, e.quoted),
            (src, LOCAL_POD, kind.0, kind.2, pod_saw),
            "{what}, translated"
        );
        assert_eq!(
            quote_of(&got),
            &one_hop_on(&syn)[14..],
            "{what} must quote the SYN as the pod sent it"
        );
        assert_eq!(
            ncounter(&nf, "icmp_error_translated"),
            i as u64 + 1,
            "{what}: translated errors"
        );
    }
    assert_eq!(
        ncounter(&nf, "redirect"),
        redirects,
        "an error about a hairpin flow was routed by the program"
    );
}

/// A NodePort with a backend on this node (DNAT alone): the backend's port
/// unreachable about the client's SYN, addressed to the client, comes back
/// from the NodePort, an address of this node, which the stack would refuse
/// as martian: tc routes it to the client itself, as the flow's replies.
#[test]
fn a_local_backends_icmpv6_error_about_a_nodeport_flow_is_routed_from_the_node() {
    let nf = node_fixture();
    let syn = tcp(OUTSIDE, 41301, NODE_IP, LOCAL_NODE_PORT, frame::SYN);
    let (ret, out) = run_on_uplink(&nf, &syn);
    assert_eq!(ret, TC_PASS, "SYN to a local backend: verdict");
    assert_eq!(parse_checked6(&out, "DNATed SYN").dst, LOCAL_POD);
    let redirects = ncounter(&nf, "redirect");
    let input = icmp6_error(LOCAL_POD, OUTSIDE, PORT_UNREACHABLE, &out, QUOTE_MAX);
    let (ret, got) = run_on_uplink(&nf, &input);
    assert_eq!(
        ret, TC_ACT_REDIRECT,
        "the backend's error must be routed here"
    );
    let e = parse_checked_icmp6_error(&got, "the backend's error");
    assert_eq!(
        (e.src, e.dst, e.icmp_type, e.code, e.quoted),
        (
            NODE_IP,
            OUTSIDE,
            1,
            4,
            (frame::TCP, OUTSIDE, 41301, NODE_IP, LOCAL_NODE_PORT)
        ),
        "the backend's error, translated"
    );
    assert_eq!(
        quote_of(&got),
        &syn[14..],
        "the backend's error must quote the SYN as the client sent it"
    );
    assert_eq!(
        macs(&got),
        (OUTSIDE_MAC, UPLINK_MAC),
        "the backend's error not routed to the client"
    );
    assert_eq!(
        ncounter(&nf, "redirect"),
        redirects + 1,
        "the backend's error not counted as routed by the program"
    );
}

/// A TCP segment of `flow` carrying `payload` bytes.
fn segment(src: (Ipv6Addr, u16), dst: (Ipv6Addr, u16), payload: usize) -> Vec<u8> {
    build6(&Spec6 {
        payload: vec![0x5a; payload],
        ..spec(src.0, src.1, dst.0, dst.1, frame::TCP, frame::ACK)
    })
}

/// The MAC addresses of an answer sent back to `frame`'s sender.
fn back_to_sender(frame: &[u8]) -> ([u8; 6], [u8; 6]) {
    let (dst, src) = macs(frame);
    (src, dst)
}

/// Checks that `out` (verdict `ret`) is the "packet too big" answering
/// `sent` (to `frontend`, from `client`): from the frontend, the route's
/// MTU of 1280, quoting the IPv6 header and the 20 bytes of the TCP header
/// of the packet as the client sent it, sent back where it came from.
fn assert_packet_too_big(
    (ret, out): (u32, &[u8]),
    sent: &[u8],
    client: (Ipv6Addr, u16),
    frontend: (Ipv6Addr, u16),
    what: &str,
) {
    assert_eq!(ret, TC_ACT_REDIRECT, "{what}: verdict");
    assert_eq!(out.len(), 14 + 40 + 8 + 60, "{what}: length of the answer");
    let e = parse_checked_icmp6_error(out, what);
    assert_eq!(
        e,
        frame::Icmp6Error {
            src: frontend.0,
            dst: client.0,
            icmp_type: 2,
            code: 0,
            param: 1280,
            quoted: (frame::TCP, client.0, client.1, frontend.0, frontend.1),
        },
        "{what}: the answer"
    );
    assert_eq!(
        quote_of(out),
        &sent[14..14 + 60],
        "{what}: the quote must be the packet as the client sent it"
    );
    assert_eq!(
        macs(out),
        back_to_sender(sent),
        "{what}: not sent back to the sender"
    );
}

/// A SNATed flow whose route to the backend has an MTU of 1280 (locked: the
/// kernel's FIB lookup helper reports an unlocked route MTU as the
/// device's, though forwarding keeps to it):
/// a segment
/// that fits (1,280 bytes) is sent on; a longer one is answered "packet too
/// big" with the route's MTU, from the frontend (the LB IP), quoting the
/// segment as the client sent it (counted `too_big`), and XDP leaves it to
/// tc untouched. A new flow's first packet too long for the route is
/// answered the same and makes no flow.
#[test]
fn a_snated_packet_longer_than_the_route_mtu_is_answered_packet_too_big() {
    let nf = node_fixture();
    nf.ns
        .ip(&[
            "-6",
            "route",
            "replace",
            "fd00:10:2::/64",
            "via",
            "2001:db8:50::2",
            "mtu",
            "lock",
            "1280",
        ])
        .expect("a route of MTU 1280 to the remote pods");
    let client = (OUTSIDE, 41400);
    let lb = (LB_IP, 80);
    let (ret, _) = run_on_uplink(&nf, &tcp(client.0, client.1, lb.0, lb.1, frame::SYN));
    assert_eq!(ret, TC_ACT_REDIRECT, "SYN to the LB IP: verdict");

    let fits = segment(client, lb, 1280 - 40 - 20);
    let (ret, out) = run_on_uplink(&nf, &fits);
    assert_eq!(ret, TC_ACT_REDIRECT, "a 1,280-byte segment: verdict");
    let p = parse_checked6(&out, "a 1,280-byte segment");
    assert_eq!(
        (p.src, p.dst),
        (NODE_IP, REMOTE_POD),
        "a 1,280-byte segment"
    );
    assert_eq!(
        ncounter(&nf, "too_big"),
        0,
        "a segment that fits, counted too_big"
    );

    let long = segment(client, lb, 1281 - 40 - 20);
    let (ret, out) = run_xdp(&nf, &long);
    assert_eq!(
        (ret, &out),
        (XDP_PASS, &long),
        "XDP must leave a segment too long for its route to tc untouched"
    );
    let (ret, out) = run_on_uplink(&nf, &long);
    assert_packet_too_big((ret, &out), &long, client, lb, "a 1,281-byte segment");
    assert_eq!(ncounter(&nf, "too_big"), 1, "too_big");

    let (entries, new_flows) = (entries6(&nf.fx), ncounter(&nf, "dnat_new"));
    let first = build6(&Spec6 {
        payload: vec![0x5a; 1400],
        ..spec(OUTSIDE, 41401, LB_IP, 80, frame::TCP, frame::SYN)
    });
    let (ret, out) = run_on_uplink(&nf, &first);
    assert_packet_too_big(
        (ret, &out),
        &first,
        (OUTSIDE, 41401),
        lb,
        "a new flow's first packet too long",
    );
    assert_eq!(ncounter(&nf, "too_big"), 2, "too_big");
    assert_eq!(
        (entries6(&nf.fx), ncounter(&nf, "dnat_new")),
        (entries, new_flows),
        "a first packet answered too big made a flow"
    );
}

/// A ClusterIP flow the stack forwards (DNAT alone) keeps its route's MTU
/// (1280, its device's here) in its forward conntrack entry (`path_mtu`); a
/// segment of it longer than that is answered "packet too big" from the ClusterIP,
/// quoting the segment as the client sent it, and one that fits is
/// translated and passed on.
#[test]
fn a_cluster_ip_flow_keeps_its_route_mtu_and_longer_packets_are_answered() {
    let nf = node_fixture();
    for args in [
        vec!["link", "set", "up0", "mtu", "1280"],
        vec!["-6", "route", "add", "fd00:10:0:1::/64", "dev", "up0"],
    ] {
        nf.ns
            .ip(&args)
            .expect("a route to the backends over a device of MTU 1280");
    }
    let client = (LOCAL_POD, 41500);
    let vip = (VIP, 80);
    let (ret, out) = run_on_uplink(&nf, &tcp(client.0, client.1, vip.0, vip.1, frame::SYN));
    assert_eq!(ret, TC_PASS, "SYN to the ClusterIP: verdict");
    let backend = parse_checked6(&out, "DNATed SYN").dst;
    assert!(BACKENDS.contains(&backend), "SYN sent to {backend}");

    let key = ct6_key(client.0, client.1, vip.0, vip.1, proxy_common::PROTO_TCP);
    let maps = &nf.fx.datapath.maps;
    let entry = [&maps.ct_new6, &maps.conntrack6]
        .into_iter()
        .find_map(|m| m.as_ref().expect("IPv6 conntrack maps").get(&key, 0).ok())
        .expect("the flow's forward entry");
    assert_eq!(
        (entry.dir, entry.path_mtu),
        (proxy_common::ct_dir::FORWARD, 1280),
        "the forward entry's (direction, path_mtu)"
    );

    let fits = segment(client, vip, 1280 - 40 - 20);
    let (ret, out) = run_on_uplink(&nf, &fits);
    assert_eq!(ret, TC_PASS, "a 1,280-byte segment: verdict");
    assert_eq!(parse_checked6(&out, "a 1,280-byte segment").dst, backend);

    let long = segment(client, vip, 1281 - 40 - 20);
    let (ret, out) = run_on_uplink(&nf, &long);
    assert_packet_too_big((ret, &out), &long, client, vip, "a 1,281-byte segment");
    assert_eq!(ncounter(&nf, "too_big"), 1, "too_big");
}

/// An IPv6 service CIDR wider than a /104 sets `WIDE_BIT` rather than its
/// blocks' bits: every IPv6 packet the prefilter turns away then asks the
/// trie, so an unallocated address of a /64 is dropped at tc and at XDP,
/// and one outside it passes.
#[test]
fn a_wide_ipv6_service_cidr_drops_its_unallocated_addresses() {
    let mut nf = node_fixture();
    write_service_cidrs(
        &mut nf.fx.datapath.maps,
        &["fd00:96::/64"],
        &[IpAddr::V6(VIP)],
        &[],
    );
    let unallocated = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0x1234, 0, 0, 0x99);
    let (ret, _) = run(&nf.fx, &tcp(CLIENT, 43400, unallocated, 80, frame::SYN));
    assert_eq!(ret, TC_ACT_SHOT, "{unallocated} in fd00:96::/64 at tc");
    let (ret, _) = run_xdp(&nf, &tcp(CLIENT, 43401, unallocated, 80, frame::SYN));
    assert_eq!(ret, XDP_DROP, "{unallocated} in fd00:96::/64 at XDP");
    assert_eq!(counter(&nf.fx, "drop_unallocated"), 2);
    let outside = Ipv6Addr::new(0xfd00, 0x97, 0, 0, 0, 0, 0, 1);
    let past = tcp(CLIENT, 43402, outside, 80, frame::SYN);
    let (ret, out) = run(&nf.fx, &past);
    assert_eq!(
        (ret, out),
        (TC_PASS, past),
        "an address outside the range was not passed untouched"
    );
}

/// IPv6's service CIDRs, as IPv4's
/// (`service_cidrs_drop_unallocated_addresses_and_reject_undefined_ports`):
/// an unallocated address of one dropped, at tc and at XDP; a ClusterIP's
/// undefined port rejected by tc (a reset, a port unreachable), left to tc
/// by XDP; the Service's own port translated.
#[test]
fn service_cidrs_drop_unallocated_addresses_and_reject_undefined_ports() {
    let mut nf = node_fixture();
    let unallocated = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x99);
    let (ret, _) = run(&nf.fx, &tcp(CLIENT, 43100, unallocated, 80, frame::SYN));
    assert_eq!(ret, TC_PASS, "no service CIDR known yet: passed");

    write_service_cidrs(
        &mut nf.fx.datapath.maps,
        &["fd00:96::/112"],
        &[IpAddr::V6(VIP)],
        &[],
    );
    let (ret, _) = run(&nf.fx, &tcp(CLIENT, 43101, unallocated, 80, frame::SYN));
    assert_eq!(ret, TC_ACT_SHOT, "an unallocated address of the CIDR");
    let (ret, _) = run_xdp(&nf, &udp(CLIENT, 43102, unallocated, 53));
    assert_eq!(ret, XDP_DROP, "an unallocated address at XDP");
    assert_eq!(counter(&nf.fx, "drop_unallocated"), 2);

    let (ret, _) = run_xdp(&nf, &tcp(CLIENT, 43103, VIP, 81, frame::SYN));
    assert_eq!(ret, XDP_PASS, "an undefined port at XDP: on to tc");
    let (ret, out) = run(&nf.fx, &tcp(CLIENT, 43103, VIP, 81, frame::SYN));
    assert_eq!(
        ret, TC_ACT_REDIRECT,
        "a ClusterIP's undefined port: rejected"
    );
    let rst = parse_checked6(&out, "RST");
    assert_eq!(
        (rst.src, rst.sport, rst.dst, rst.dport, rst.l4[13]),
        (VIP, 81, CLIENT, 43103, frame::RST | frame::ACK),
        "the reset comes from the ClusterIP's port to the client"
    );
    let (ret, out) = run(&nf.fx, &udp(CLIENT, 43104, VIP, 54));
    assert_eq!(ret, TC_ACT_REDIRECT);
    let icmp = parse_checked6(&out, "ICMPv6 port unreachable");
    assert_eq!(
        (icmp.proto, icmp.src, icmp.dst, icmp.l4[0], icmp.l4[1]),
        (ICMPV6, VIP, CLIENT, 1, 4),
        "UDP to an undefined port: port unreachable from the ClusterIP"
    );
    assert_eq!(counter(&nf.fx, "reject_undefined_port"), 2);

    let (ret, out) = run(&nf.fx, &tcp(CLIENT, 43105, VIP, 80, frame::SYN));
    assert_eq!(ret, TC_PASS, "the Service's own port is translated");
    let syn = parse_checked6(&out, "DNATed SYN");
    assert!(BACKENDS.contains(&syn.dst), "DNATed to {}", syn.dst);
}

/// IPv6's Service counters at tc: a flow's packets and IP bytes each way
/// (its SYN, the answer, the next packet), then a reject, which moves
/// nothing else.
#[test]
fn service_counters_count_ipv6_flows_each_way_and_rejects() {
    let fx = fixture();
    round_trip(&fx, frame::TCP, 80, 8080, 42100);
    let ip = |frame: &[u8]| frame.len() as u64 - 14;
    let (syn, ack) = (
        tcp(CLIENT, 42100, VIP, 80, frame::SYN),
        tcp(CLIENT, 42100, VIP, 80, frame::ACK),
    );
    let answer = tcp(BACKENDS[0], 8080, CLIENT, 42100, frame::SYN | frame::ACK);
    let got = service_totals(&fx.datapath.maps, service_id_of(&fx.datapath.maps, VIP, 80));
    assert_eq!(
        (got.flows, got.packets, got.bytes, got.rejected),
        (1, [2, 1], [ip(&syn) + ip(&ack), ip(&answer)], 0),
        "the ClusterIP's (flows, packets, bytes, rejects): a SYN and an ACK to the \
         backend, one answer, by their IPv6 packets' lengths"
    );
    let (ret, _) = run(&fx, &tcp(CLIENT, 42101, EMPTY_VIP, 80, frame::SYN));
    assert_eq!(ret, TC_ACT_REDIRECT, "no endpoints: a reset");
    // The fixture names both frontends of port 80 as one Service port:
    // one service id, one set of counters.
    let got = service_totals(
        &fx.datapath.maps,
        service_id_of(&fx.datapath.maps, EMPTY_VIP, 80),
    );
    assert_eq!(
        (got.rejected, got.flows, got.packets, got.dropped),
        (1, 1, [2, 1], [0; 3]),
        "port 80's (rejects, flows, packets, drops) after the reject: only rejects moved"
    );
}

/// `addr` as a trace record holds it: network order, in words.
fn record_addr6(addr: Ipv6Addr) -> [u32; 4] {
    let o = addr.octets();
    core::array::from_fn(|i| {
        u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
    })
}

/// IPv6's records, whose client and frontend come from the packet's key
/// (`FLOW_KEY6`): with a trace running a new flow and a reject each leave one
/// with the packet's addresses and ports, the backend and the Service port's
/// id, and an established packet none; with `TRACE_ON` at 0, nothing.
#[test]
fn trace_records_of_ipv6_new_flows_and_rejects_while_switched_on_only() {
    use aya::maps::{Array, Map, MapData, RingBuf};
    use proxy_common::{
        TraceRecord, map_names,
        trace::{family, hook, verdict},
    };

    let fx = fixture();
    let open = |name: &str| {
        let data = MapData::from_pin(fx.pins.map(name))
            .unwrap_or_else(|e| panic!("opening the pinned {name}: {e}"));
        Map::from_map_data(data).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let mut on: Array<MapData, u64> = open(map_names::TRACE_ON).try_into().expect("an array");
    let mut events: RingBuf<MapData> = open(map_names::TRACE_EVENTS)
        .try_into()
        .expect("a ring buffer");
    let mut drain = || {
        let mut out = Vec::new();
        while let Some(item) = events.next() {
            out.push(
                *bytemuck::try_from_bytes::<TraceRecord>(&item)
                    .unwrap_or_else(|e| panic!("a record of {} bytes: {e}", item.len())),
            );
        }
        out
    };

    run(&fx, &tcp(CLIENT, 43_000, VIP, 80, frame::SYN));
    run(&fx, &tcp(CLIENT, 43_001, EMPTY_VIP, 80, frame::SYN));
    assert_eq!(drain(), [], "records while no trace runs");

    on.set(0, u64::MAX, 0).expect("switching the trace on");
    let (ret, out) = run(&fx, &tcp(CLIENT, 43_010, VIP, 80, frame::SYN));
    assert_eq!(ret, TC_PASS, "the new flow passes translated");
    let backend = parse_checked6(&out, "the new flow").dst;
    let (ret, _) = run(&fx, &tcp(CLIENT, 43_011, EMPTY_VIP, 80, frame::SYN));
    assert_eq!(ret, TC_ACT_REDIRECT, "the reject goes back to the client");
    run(&fx, &tcp(CLIENT, 43_010, VIP, 80, frame::ACK));
    let records = drain();
    on.set(0, 0, 0).expect("switching the trace off");

    let maps = &fx.datapath.maps;
    let record =
        |service_id, verdict, port: u16, frontend, backend: Option<Ipv6Addr>| TraceRecord {
            service_id,
            verdict,
            reason: 0,
            proto: frame::TCP,
            family: family::V6,
            hook: hook::TC,
            _pad: 0,
            client_port_be: port.to_be(),
            frontend_port_be: 80u16.to_be(),
            backend_port_be: if backend.is_some() {
                8080u16.to_be()
            } else {
                0
            },
            client_be: record_addr6(CLIENT),
            frontend_be: record_addr6(frontend),
            backend_be: backend.map_or([0; 4], record_addr6),
        };
    let expected = [
        record(
            service_id_of(maps, VIP, 80),
            verdict::TRANSLATED,
            43_010,
            VIP,
            Some(backend),
        ),
        record(
            service_id_of(maps, EMPTY_VIP, 80),
            verdict::REJECTED,
            43_011,
            EMPTY_VIP,
            None,
        ),
    ];
    assert_eq!(records, expected, "the records of a trace");

    run(&fx, &tcp(CLIENT, 43_020, VIP, 80, frame::SYN));
    assert_eq!(drain(), [], "records after the trace ended");
}

// ---------------------------------------------------------------------------
// Direct server return over IPv6: the frontend carried in a destination
// options header right after the IPv6 header.

/// A LoadBalancer IP whose one backend is `LOCAL_POD`: what another node
/// sends here by direct server return.
const LB_LOCAL_IP: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x60, 0, 0, 0, 0, 0x12);

/// `node_fixture` with direct server return on (`node_config_flags::DSR`,
/// in IPv4's `NODE_CONFIG` for both families) and `LB_LOCAL_IP`.
fn dsr_node_fixture() -> NodeFixture {
    use proxy_userspace::planner::{MapOp, MapStore, node};
    let mut nf = node_fixture();
    let mut config = node::node_config(None, false);
    config.flags |= proxy_common::node_config_flags::DSR;
    nf.fx
        .datapath
        .maps
        .apply(&MapOp::SetNodeConfig { config })
        .expect("node config");
    let lb = external(
        FrontendKind::LoadBalancer,
        LB_LOCAL_IP,
        80,
        &[LOCAL_POD],
        true,
    );
    program(&mut nf.fx, "lb-local", &lb);
    nf
}

/// `frame` with the DSR destination options header naming `frontend`
/// after its IPv6 header, as the entry node writes it.
fn with_dsr_dest_opts(frame: &[u8], frontend: (Ipv6Addr, u16)) -> Vec<u8> {
    let addr = frontend.0.octets();
    let words: [u32; 4] =
        std::array::from_fn(|i| u32::from_ne_bytes(addr[4 * i..4 * i + 4].try_into().unwrap()));
    let ext = proxy_common::dsr::ipv6_dest_opts(frame[20], &words, frontend.1.to_be());
    let mut f = frame[..54].to_vec();
    f.extend_from_slice(&ext);
    f.extend_from_slice(&frame[54..]);
    f[20] = DEST_OPTS;
    let len = u16::from_be_bytes([f[18], f[19]]) + 24;
    f[18..20].copy_from_slice(&len.to_be_bytes());
    f
}

/// The frontend the DSR header of `out` names, and `out` parsed (its
/// transport checksum checked).
fn dsr_carried6(out: &[u8], what: &str) -> ((Ipv6Addr, u16), frame::Parsed6) {
    assert_eq!(
        out[20], DEST_OPTS,
        "{what}: no destination options header first"
    );
    let ext: [u8; 24] = out[54..78].try_into().unwrap();
    let (words, port, next) = proxy_common::dsr::ipv6_frontend(&ext)
        .unwrap_or_else(|| panic!("{what}: not the DSR header: {ext:02x?}"));
    assert_eq!(next, frame::TCP, "{what}: the header after it");
    let mut addr = [0u8; 16];
    for (i, w) in words.iter().enumerate() {
        addr[4 * i..4 * i + 4].copy_from_slice(&w.to_ne_bytes());
    }
    (
        (Ipv6Addr::from(addr), u16::from_be(port)),
        parse_checked6(out, what),
    )
}

/// With DSR, an IPv6 NodePort or LoadBalancer flow to a remote backend is
/// DNATed with the client's address kept and the frontend carried, sent to
/// the backend's node by XDP (which moves the packet's head to make room)
/// as by tc.
#[test]
fn dsr_keeps_the_ipv6_client_and_carries_the_frontend() {
    let nf = dsr_node_fixture();
    let mut sport = 43000;
    for frontend in [(NODE_IP, NODE_PORT), (LB_IP, 80)] {
        for hook in ["xdp", "tc"] {
            sport += 1;
            let what = format!("[{}]:{}, {hook}", frontend.0, frontend.1);
            for (packet, flags) in [("SYN", frame::SYN), ("ACK", frame::ACK)] {
                let input = tcp(OUTSIDE, sport, frontend.0, frontend.1, flags);
                let (ret, out, sent) = if hook == "xdp" {
                    let (ret, out) = run_xdp(&nf, &input);
                    (ret, out, XDP_REDIRECT)
                } else {
                    let (ret, out) = run_on_uplink(&nf, &input);
                    (ret, out, TC_ACT_REDIRECT)
                };
                let what = format!("{what}, {packet}");
                assert_eq!(ret, sent, "{what}: verdict");
                assert_eq!(out.len(), input.len() + 24, "{what}: length");
                let (carried, p) = dsr_carried6(&out, &what);
                assert_eq!(carried, frontend, "{what}: the frontend carried");
                assert_eq!(
                    (p.src, p.sport, p.dst, p.dport),
                    (OUTSIDE, sport, REMOTE_POD, 8080),
                    "{what}: the client's address kept, DNATed to the backend"
                );
                assert_eq!(macs(&out), (PEER_MAC, UPLINK_MAC), "{what}: to node B");
                assert_eq!(out[HOP_LIMIT], input[HOP_LIMIT] - 1, "{what}: hop limit");
            }
        }
    }
    assert_eq!(ncounter(&nf, "dsr_new"), 4, "dsr_new");
    assert_eq!(ncounter(&nf, "xdp_tx"), 4, "xdp_tx (XDP's SYNs and ACKs)");
    assert_eq!(ncounter(&nf, "snat_new"), 0, "snat_new");
}

/// The carrier's 24 bytes count against the route's MTU: with a route of
/// MTU 1280 to the backend's node, a packet of 1,256 bytes goes (1,280 with
/// the header); one of 1,257 is answered "packet too big" with an MTU of
/// 1,256, quoting it as the client sent it.
#[test]
fn an_ipv6_dsr_packet_too_long_for_the_header_is_answered_with_the_mtu_less_it() {
    let nf = dsr_node_fixture();
    nf.ns
        .ip(&[
            "-6",
            "route",
            "replace",
            "fd00:10:2::/64",
            "via",
            "2001:db8:50::2",
            "mtu",
            "lock",
            "1280",
        ])
        .expect("a route of MTU 1280 to the remote pods");
    let client = (OUTSIDE, 47200);
    let lb = (LB_IP, 80);
    let (ret, _) = run_on_uplink(&nf, &tcp(client.0, client.1, lb.0, lb.1, frame::SYN));
    assert_eq!(ret, TC_ACT_REDIRECT, "SYN to the LB IP: verdict");
    let fits = segment(client, lb, 1256 - 60);
    let (ret, out) = run_on_uplink(&nf, &fits);
    assert_eq!(ret, TC_ACT_REDIRECT, "a 1,256-byte packet: verdict");
    assert_eq!(out.len(), 14 + 1280, "a 1,256-byte packet with the header");
    dsr_carried6(&out, "a 1,256-byte packet");
    let (ret, out) = run_xdp(&nf, &fits);
    assert_eq!(ret, XDP_REDIRECT, "a 1,256-byte packet at XDP: verdict");
    assert_eq!(out.len(), 14 + 1280, "a 1,256-byte packet at XDP");
    dsr_carried6(&out, "a 1,256-byte packet at XDP");
    let long = segment(client, lb, 1257 - 60);
    // XDP cannot answer: tc does, with the packet as it came.
    assert_eq!(
        run_xdp(&nf, &long),
        (XDP_PASS, long.clone()),
        "a 1,257-byte packet at XDP: left to tc untouched"
    );
    let (ret, out) = run_on_uplink(&nf, &long);
    assert_eq!(ret, TC_ACT_REDIRECT, "a 1,257-byte packet: verdict");
    let e = parse_checked_icmp6_error(&out, "a 1,257-byte packet");
    assert_eq!(
        (e.src, e.dst, e.icmp_type, e.code, e.param),
        (LB_IP, OUTSIDE, 2, 0, 1256),
        "a 1,257-byte packet: packet too big from the frontend, MTU less the header"
    );
    assert_eq!(
        quote_of(&out),
        &long[14..14 + 60],
        "the quote as the client sent it"
    );
    assert_eq!(ncounter(&nf, "too_big"), 1, "too_big");
}

/// With DSR on, an IPv6 packet whose extension headers are the carrier's
/// length is first a packet like any other: to an unallocated address of a
/// service CIDR it is dropped by tc (XDP, which walks no extension header,
/// leaves it to tc), not handed to `tc_dsr6`, which passes what it refuses.
#[test]
fn with_dsr_on_a_carrier_sized_ipv6_packet_to_an_unallocated_service_address_is_still_dropped() {
    let mut nf = dsr_node_fixture();
    write_service_cidrs(
        &mut nf.fx.datapath.maps,
        &["fd00:96::/112"],
        &[IpAddr::V6(VIP)],
        &[],
    );
    let unallocated = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x99);
    let sent = with_dsr_dest_opts(
        &tcp(OUTSIDE, 44100, unallocated, 80, frame::SYN),
        (LB_IP, 80),
    );
    let (ret, _) = run_on_uplink(&nf, &sent);
    assert_eq!(
        ret, TC_ACT_SHOT,
        "tc: an unallocated address, carrier-sized header"
    );
    // XDP walks no extension header: it leaves the packet to tc, as it came.
    assert_eq!(
        run_xdp(&nf, &sent),
        (XDP_PASS, sent.clone()),
        "XDP: a packet with a destination options header, left to tc"
    );
    assert_eq!(ncounter(&nf, "drop_unallocated"), 1, "drop_unallocated");
    assert_eq!(
        (ncounter(&nf, "dsr_learnt"), ncounter(&nf, "dsr_refused")),
        (0, 0),
        "neither reached tc_dsr6"
    );
}

/// The backend's node over IPv6: the first packet carrying the header
/// creates the flow keyed by the frontend it names, the backend's reply
/// leaves from the frontend straight to the client, later packets find the
/// flow, and the client's packets arriving here directly go to the same
/// backend. A header naming no frontend here is refused, counted.
#[test]
fn dsr_ipv6_backends_node_learns_the_flow_and_answers_from_the_frontend() {
    let nf = dsr_node_fixture();
    let lb = (LB_LOCAL_IP, 80);
    let sent = with_dsr_dest_opts(&tcp(OUTSIDE, 44000, LOCAL_POD, 8080, frame::SYN), lb);
    let (ret, out) = run_on_uplink(&nf, &sent);
    assert_eq!((ret, &out), (TC_PASS, &sent), "the SYN goes on as it came");
    assert_eq!(ncounter(&nf, "dsr_learnt"), 1, "dsr_learnt");

    let reply = tcp(LOCAL_POD, 8080, OUTSIDE, 44000, frame::SYN | frame::ACK);
    let (ret, out) = run_on_uplink(&nf, &reply);
    assert_eq!(ret, TC_ACT_REDIRECT, "the backend's reply: verdict");
    let r = parse_checked6(&out, "the backend's reply");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (LB_LOCAL_IP, 80, OUTSIDE, 44000),
        "the reply must come from the frontend, to the client"
    );
    assert_eq!(
        macs(&out),
        (OUTSIDE_MAC, UPLINK_MAC),
        "straight to the client"
    );

    let established = ncounter(&nf, "dnat_established");
    let ack = with_dsr_dest_opts(&tcp(OUTSIDE, 44000, LOCAL_POD, 8080, frame::ACK), lb);
    let (ret, out) = run_on_uplink(&nf, &ack);
    assert_eq!((ret, &out), (TC_PASS, &ack), "the ACK goes on as it came");
    assert_eq!(
        ncounter(&nf, "dnat_established"),
        established + 1,
        "the ACK found its flow"
    );

    let direct = tcp(OUTSIDE, 44000, LB_LOCAL_IP, 80, frame::ACK);
    let (ret, out) = run_on_uplink(&nf, &direct);
    assert_eq!(ret, TC_PASS, "the client's packet arriving here: verdict");
    let p = parse_checked6(&out, "the client's packet arriving here");
    assert_eq!(
        (p.src, p.sport, p.dst, p.dport),
        (OUTSIDE, 44000, LOCAL_POD, 8080),
        "moved here by the network, the flow keeps its backend"
    );

    let forged = with_dsr_dest_opts(
        &tcp(OUTSIDE, 44001, LOCAL_POD, 8080, frame::SYN),
        (Ipv6Addr::new(0x2001, 0xdb8, 0x99, 0, 0, 0, 0, 9), 4444),
    );
    let (ret, out) = run_on_uplink(&nf, &forged);
    assert_eq!((ret, &out), (TC_PASS, &forged), "a refused header passes");
    assert_eq!(ncounter(&nf, "dsr_refused"), 1, "dsr_refused");
    assert_eq!(ncounter(&nf, "dsr_learnt"), 1, "learnt once");
}
