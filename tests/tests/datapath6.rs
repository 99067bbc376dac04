//! The IPv6 tc program (`tc_ingress6`) on hand-built frames through
//! `BPF_PROG_TEST_RUN`, as tests/datapath.rs does for IPv4: every checksum
//! of every output frame recomputed from scratch (tests/src/frames.rs).
//! Needs root (it loads BPF programs and pins maps).

use std::{
    net::{IpAddr, Ipv6Addr},
    sync::atomic::{AtomicU32, Ordering},
};

use aya::programs::{SchedClassifier, TestRun, TestRunOptions};
use ebpf_proxy_tests::frames::{
    self as frame, DEST_OPTS, FRAGMENT, HOP_BY_HOP, ICMPV6, Spec6, build6, fragment6, icmp6,
    icmp6_error, parse_checked_icmp6_error, parse_checked6, reassemble6,
};
use proxy_userspace::{
    datapath::{Datapath, PinLayout},
    housekeeping::conntrack,
    model::{BackendAddr, Frontend, FrontendKind, NoEndpointAction, Protocol, ServicePortName},
    planner::Planner,
    source::ObjectKey,
};

const TC_ACT_OK: u32 = 0;
const TC_ACT_REDIRECT: u32 = 7;
/// tcx's "next program" (-1), as the kernel's test run reports it.
const TCX_NEXT: u32 = u32::MAX;

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
    let mut datapath = Datapath::load_sized(pins.clone(), entries)
        .unwrap_or_else(|e| panic!("loading the datapath under {}: {e}", pins.root().display()));
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
    (datapath, planner)
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
    assert_eq!(ret, TC_ACT_OK, "{name} first packet: verdict {ret}");
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
    assert_eq!(ret, TC_ACT_OK, "{name} answer: verdict {ret}");
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

#[test]
fn udp_is_translated_both_ways() {
    let fx = fixture();
    round_trip(&fx, frame::UDP, 53, 5353, 41001);
    assert_eq!(counter(&fx, "dnat_new"), 1, "new flows");
    assert_eq!(counter(&fx, "rev_nat"), 1, "reverse-translated answers");
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

#[test]
fn extension_headers_before_tcp_are_walked() {
    let fx = fixture();
    let mut s = spec(CLIENT, 43000, VIP, 80, frame::TCP, frame::SYN);
    s.ext = vec![HOP_BY_HOP, DEST_OPTS, FRAGMENT];
    let (ret, out) = run(&fx, &build6(&s));
    assert_eq!(ret, TC_ACT_OK, "verdict {ret}");
    let p = parse_checked6(&out, "SYN behind three extension headers");
    assert!(
        BACKENDS.contains(&p.dst),
        "went to {}, not a backend",
        p.dst
    );
    assert_eq!(p.dport, 8080, "destination port");

    // Five are more than the datapath walks: passed untouched, counted.
    s.ext = vec![HOP_BY_HOP, DEST_OPTS, DEST_OPTS, DEST_OPTS, DEST_OPTS];
    let long = build6(&s);
    let (ret, out) = run(&fx, &long);
    assert_eq!(
        (ret, &out),
        (TC_ACT_OK, &long),
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
        (TC_ACT_OK, &later),
        "a later fragment without its first passes untouched"
    );
    assert_eq!(
        counter(&fx, "frag_untracked"),
        1,
        "the later fragment counted"
    );
    assert_eq!(
        counter(&fx, "dnat_new"),
        1,
        "only the walked SYN was translated"
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
            assert_eq!(ret, TC_ACT_OK, "{what} fragment {i}: verdict {ret}");
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
        (TC_ACT_OK, &early[1]),
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
        (TC_ACT_OK, &stranger[1]),
        "a later fragment of another datagram between the same hosts"
    );

    let elsewhere = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x99);
    let other = fragmented((CLIENT, 42002), (elsewhere, 53), 3000, 0x4545);
    for (i, f) in other.iter().enumerate() {
        let (ret, out) = run(&fx, f);
        assert_eq!(
            (ret, &out),
            (TC_ACT_OK, f),
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
        assert_eq!(ret, TC_ACT_OK, "{what}: verdict {ret}");
        assert_eq!(out, input, "{what}: the packet was modified");
    }
    assert_eq!(
        counter(&fx, "pass_malformed"),
        0,
        "ICMPv6 counted as malformed"
    );
}

#[test]
fn tc_ingress_hands_ipv6_on_to_the_next_program() {
    let fx = fixture();
    let syn = tcp(CLIENT, 44000, VIP, 80, frame::SYN);
    let (ret, out) = run_on(fx.datapath.tc_program(), &syn);
    assert_eq!(ret, TCX_NEXT, "tc_ingress's verdict on IPv6");
    assert_eq!(out, syn, "tc_ingress modified an IPv6 packet");
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

/// The agent's housekeeping walks `CONNTRACK6` too: a departed backend loses
/// its UDP flows there (not its TCP connections), and the reaper removes
/// flows idle past their timeout.
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
    let swept = conntrack::purge_departed(&mut fx.datapath.maps, &departed).expect("purge");
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
    // entries each: a minute and a bit later the UDP flow has expired, the
    // unanswered TCP ones too (the SYN timeout, 60 s).
    let expected = 2 * usize::from(tcp_sport - 44000 + 1) + 2;
    let flows6 = |fx: &Fixture| {
        fx.datapath
            .maps
            .conntrack6
            .as_ref()
            .expect("CONNTRACK6")
            .iter()
            .count()
    };
    assert_eq!(flows6(&fx), expected, "entries before reaping");
    let reaped = conntrack::reap_expired(
        &mut fx.datapath.maps,
        conntrack::monotonic_ns() + 61_000_000_000,
    )
    .expect("reaping");
    assert_eq!(reaped, expected, "expired IPv6 entries reaped");
    assert_eq!(flows6(&fx), 0, "entries left after reaping");
}

/// A packet to an external IPv6 frontend (an ExternalIP, a LoadBalancer IP)
/// passes untranslated, as IPv6 at tc covers ClusterIPs alone so far, and is
/// counted (`pass_v6_external`), so that traffic this slice leaves alone
/// shows in status and metrics; a ClusterIP packet does not move the count.
#[test]
fn a_packet_to_an_external_ipv6_frontend_passes_untranslated_and_is_counted() {
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
        let before = counter(&fx, "pass_v6_external");
        let dnat_before = counter(&fx, "dnat_new");
        let syn = tcp(CLIENT, 45000 + i as u16, external, 80, frame::SYN);
        let (ret, out) = run(&fx, &syn);
        assert_eq!(ret, TC_ACT_OK, "{:?} frontend: verdict {ret}", fe.kind);
        assert_eq!(
            out, syn,
            "{:?} frontend: the packet was translated",
            fe.kind
        );
        assert_eq!(
            counter(&fx, "pass_v6_external"),
            before + 1,
            "{:?} frontend: the passed packet was not counted",
            fe.kind
        );
        assert_eq!(
            counter(&fx, "dnat_new"),
            dnat_before,
            "{:?} frontend: counted as a translation",
            fe.kind
        );
    }

    let passed = counter(&fx, "pass_v6_external");
    let (ret, out) = run(&fx, &tcp(CLIENT, 45100, VIP, 80, frame::SYN));
    assert_eq!(ret, TC_ACT_OK, "ClusterIP SYN: verdict {ret}");
    let p = parse_checked6(&out, "ClusterIP SYN");
    assert!(
        BACKENDS.contains(&p.dst),
        "ClusterIP SYN not translated: {}",
        p.dst
    );
    assert_eq!(
        counter(&fx, "pass_v6_external"),
        passed,
        "a ClusterIP packet counted as passed to an external frontend"
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
    assert_eq!(ret, TC_ACT_OK, "packet too big: verdict {ret}");
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
    assert_eq!(ret, TC_ACT_OK, "the backend's error: verdict {ret}");
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
    assert_eq!(ret, TC_ACT_OK, "the client's error: verdict {ret}");
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
        assert_eq!(ret, TC_ACT_OK, "{what}: verdict {ret}");
        assert_eq!(out, error, "{what}: the error was modified");
    }
    assert_eq!(
        counter(&fx, "icmp_error_translated"),
        0,
        "errors about no translated flow counted as translated"
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
