//! The tc program on hand-built frames through `BPF_PROG_TEST_RUN`: no
//! interface, no traffic, every byte of the output checked. Needs root (it
//! loads BPF programs and pins maps).

mod node_maps;
mod service_counts;

use std::{
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use aya::programs::{TestRun, TestRunOptions};
use node_maps::write_service_cidrs;
use proxy_common::{CtValue, TraceRecord, ct_flags, map_names};
use proxy_userspace::{
    datapath::{Datapath, PinLayout, ip_summed},
    housekeeping::{conntrack, ct_sources},
    model::{BackendAddr, Frontend, FrontendKind, NoEndpointAction, Protocol, ServicePortName},
    planner::{AffinityPurge, MapOp, MapStore, Planner, encode::addr_words},
    source::ObjectKey,
};
use service_counts::{service_id_of, service_totals};

// How tc passes a packet: tcx's `TCX_NEXT` (-1), on to the interface's
// next program and legacy filters, as the kernel's test run reports it.
use ebpf_proxy_tests::fuzz::verdict::{TC_ACT_REDIRECT, TC_ACT_SHOT, TCX_NEXT as TC_PASS};

const CLIENT: Ipv4Addr = one_node::CLIENT.1;
const VIP: Ipv4Addr = one_node::CLUSTER_IP;
const EMPTY_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 20);
const LOCAL_ONLY_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
const HAIRPIN_VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 40);
const HAIRPIN_SRC: Ipv4Addr = Ipv4Addr::new(169, 254, 42, 1);
const BACKENDS: [Ipv4Addr; 3] = one_node::BACKEND_IPS;

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

fn ensure_bpffs() {
    if !proxy_userspace::datapath::pins::is_bpffs(std::path::Path::new("/sys/fs/bpf")) {
        let status = std::process::Command::new("mount")
            .args(["-t", "bpf", "bpf", "/sys/fs/bpf"])
            .status()
            .expect("running mount");
        assert!(
            status.success(),
            "mounting bpffs on /sys/fs/bpf failed (are we root?)"
        );
    }
}

fn fixture() -> Fixture {
    fixture_reading(None)
}

/// A fixture whose tc program reads checksum states as `read` says (`None`:
/// as this kernel allows).
/// A bpffs root of its own for one test, `prefix` naming what it is for.
fn unique_root(prefix: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    ensure_bpffs();
    PathBuf::from(format!(
        "/sys/fs/bpf/{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

fn fixture_reading(read: Option<ip_summed::Read>) -> Fixture {
    fixture_loaded(|pins| match read {
        Some(read) => Datapath::load_reading(pins, read),
        None => Datapath::load(pins),
    })
}

/// The fixture on a datapath `load` loads onto its pins.
fn fixture_loaded(
    load: impl FnOnce(PinLayout) -> Result<Datapath, proxy_userspace::datapath::DatapathError>,
) -> Fixture {
    let root = unique_root("ebpf-proxy-trun");
    let pins = PinLayout::new(&root);
    let loaded = load(pins.clone());
    // A load that failed part-way leaves pins behind, which the fixture's
    // drop would have removed.
    let datapath = loaded.unwrap_or_else(|e| {
        let _ = proxy_userspace::datapath::cleanup(&pins);
        panic!("loading the datapath under {}: {e}", root.display())
    });
    // The flows' marks as the agent's housekeeping leaves them once its
    // programs run: what conntrack holds, so that every flow a test makes
    // must mark its own replies.
    proxy_userspace::datapath::prefilter_rebuild::settle(&datapath.maps)
        .expect("settling the prefilter's flow marks");
    let mut fixture = Fixture {
        datapath,
        pins,
        planner: Planner::new(),
    };
    let services = [
        frontend(
            VIP,
            80,
            Protocol::Tcp,
            &BACKENDS,
            8080,
            NoEndpointAction::Reject,
        ),
        frontend(
            VIP,
            53,
            Protocol::Udp,
            &BACKENDS,
            5353,
            NoEndpointAction::Reject,
        ),
        frontend(
            EMPTY_VIP,
            80,
            Protocol::Tcp,
            &[],
            0,
            NoEndpointAction::Reject,
        ),
        frontend(
            EMPTY_VIP,
            53,
            Protocol::Udp,
            &[],
            0,
            NoEndpointAction::Reject,
        ),
        frontend(
            LOCAL_ONLY_VIP,
            80,
            Protocol::Tcp,
            &[],
            0,
            NoEndpointAction::Drop,
        ),
        frontend(
            VIP,
            9000,
            Protocol::Sctp,
            &BACKENDS,
            9000,
            NoEndpointAction::Reject,
        ),
        frontend(
            HAIRPIN_VIP,
            80,
            Protocol::Tcp,
            &BACKENDS[..1],
            8080,
            NoEndpointAction::Reject,
        ),
    ];
    for (i, fe) in services.iter().enumerate() {
        let owner = ObjectKey {
            namespace: "test".into(),
            name: format!("svc{i}"),
        };
        let out = fixture.planner.sync_service(
            &owner,
            std::slice::from_ref(fe),
            &mut fixture.datapath.maps,
        );
        assert!(
            out.errors.is_empty(),
            "programming {}: {:?}",
            fe.key,
            out.errors
        );
    }
    fixture
}

fn frontend(
    vip: Ipv4Addr,
    port: u16,
    protocol: Protocol,
    backends: &[Ipv4Addr],
    target: u16,
    no_endpoints: NoEndpointAction,
) -> Frontend {
    let backends = backends
        .iter()
        .map(|ip| BackendAddr {
            local: true,
            ..BackendAddr::remote(IpAddr::V4(*ip), target, protocol)
        })
        .collect();
    let service = ServicePortName::new("test", &vip.to_string(), &port.to_string(), protocol);
    Frontend {
        no_endpoints,
        ..Frontend::cluster_ip(service, IpAddr::V4(vip), port, backends)
    }
}

use ebpf_proxy_tests::{
    frames::{self as frame, Spec, build, parse_checked},
    sctp,
    topology::{one_node, two_node},
};

fn run(fx: &Fixture, input: &[u8]) -> (u32, Vec<u8>) {
    try_run(fx, input)
        .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN on a {}-byte frame: {e}", input.len()))
}

fn try_run(fx: &Fixture, input: &[u8]) -> Result<(u32, Vec<u8>), aya::programs::ProgramError> {
    run_program(fx.datapath.tc_program(), input)
}

/// `program` on one frame: its verdict and the frame it left.
fn run_program<P>(program: &P, input: &[u8]) -> Result<(u32, Vec<u8>), aya::programs::ProgramError>
where
    P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = aya::programs::TestRunResult>,
{
    let mut out = vec![0u8; input.len() + 256];
    let mut opts = TestRunOptions::new();
    opts.data_in = Some(input);
    opts.data_out = Some(&mut out);
    let result = program.test_run(opts)?;
    out.truncate(result.data_size_out as usize);
    Ok((result.return_value, out))
}

fn tcp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> Vec<u8> {
    build(&Spec {
        src,
        dst,
        sport,
        dport,
        proto: frame::TCP,
        tcp_flags: flags,
        payload: vec![],
        udp_no_csum: false,
    })
}

fn udp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, no_csum: bool) -> Vec<u8> {
    build(&Spec {
        src,
        dst,
        sport,
        dport,
        proto: frame::UDP,
        tcp_flags: 0,
        payload: b"hello, service".to_vec(),
        udp_no_csum: no_csum,
    })
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

/// Counts of translated packets by the checksum state tc read: `BPF_PROG_TEST_RUN`
/// builds socket buffers without a checksum state (`CHECKSUM_NONE`).
fn csum_states(fx: &Fixture) -> (u64, u64) {
    (counter(fx, "tc_csum_none"), counter(fx, "tc_csum_unknown"))
}

#[test]
fn dnat_then_established_then_reverse_nat_with_valid_checksums() {
    let fx = fixture();
    assert!(
        matches!(fx.datapath.ip_summed_read(), ip_summed::Read::Kfunc { .. }),
        "this kernel has the kfunc, so tc must read checksum states: {}",
        fx.datapath.ip_summed_read()
    );
    dnat_established_reverse_nat(&fx);
    assert_eq!(
        csum_states(&fx),
        (22, 0),
        "(none, unknown) states tc read for 22 translated packets"
    );
}

/// The same through the kernel's checksum helper, as on a kernel where tc
/// cannot read checksum states (and for `CHECKSUM_COMPLETE` buffers).
#[test]
fn dnat_then_established_then_reverse_nat_through_the_checksum_helper() {
    let fx = fixture_reading(Some(ip_summed::Read::Unknown));
    dnat_established_reverse_nat(&fx);
    assert_eq!(
        csum_states(&fx),
        (0, 22),
        "(none, unknown) states tc read for 22 translated packets"
    );
}

fn dnat_established_reverse_nat(fx: &Fixture) {
    let syn = tcp(CLIENT, 40000, VIP, 80, frame::SYN);
    let (ret, out) = run(fx, &syn);
    assert_eq!(ret, TC_PASS, "SYN to the ClusterIP: verdict");
    let p = parse_checked(&out, "DNATed SYN");
    assert!(
        BACKENDS.contains(&p.dst),
        "SYN was sent to {}, not a backend",
        p.dst
    );
    assert_eq!(
        (p.src, p.sport, p.dport),
        (CLIENT, 40000, 8080),
        "DNAT changed the wrong fields"
    );
    let backend = p.dst;

    // Every later packet of the flow goes to the same backend.
    for _ in 0..20 {
        let (ret, out) = run(fx, &tcp(CLIENT, 40000, VIP, 80, frame::ACK));
        assert_eq!(ret, TC_PASS);
        let q = parse_checked(&out, "established packet");
        assert_eq!(q.dst, backend, "an established flow changed backend");
    }
    assert_eq!(counter(fx, "dnat_established"), 20);

    // The backend's reply is rewritten to come from the ClusterIP.
    let reply = tcp(backend, 8080, CLIENT, 40000, frame::SYN | frame::ACK);
    let (ret, out) = run(fx, &reply);
    assert_eq!(ret, TC_PASS);
    let r = parse_checked(&out, "reverse-NATed reply");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (VIP, 80, CLIENT, 40000),
        "reply not rewritten back to the frontend"
    );
    assert_eq!(counter(fx, "rev_nat"), 1);
}

/// A backend that reaches its own service and is picked as the backend:
/// its packet gets the hairpin source, and the answer goes back to it from
/// the frontend.
#[test]
fn hairpin_flows_are_snated_both_ways() {
    let fx = fixture();
    let pod = BACKENDS[0];
    let (ret, out) = run(&fx, &tcp(pod, 43000, HAIRPIN_VIP, 80, frame::SYN));
    assert_eq!(ret, TC_PASS);
    let p = parse_checked(&out, "hairpin SYN");
    assert_eq!(
        (p.src, p.sport, p.dst, p.dport),
        (HAIRPIN_SRC, 43000, pod, 8080),
        "hairpin SYN must reach the pod from the hairpin address"
    );
    let (ret, out) = run(
        &fx,
        &tcp(pod, 8080, HAIRPIN_SRC, 43000, frame::SYN | frame::ACK),
    );
    assert_eq!(ret, TC_PASS);
    let r = parse_checked(&out, "hairpin reply");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (HAIRPIN_VIP, 80, pod, 43000),
        "hairpin reply must come back from the frontend"
    );
    let (_, out) = run(&fx, &tcp(pod, 43000, HAIRPIN_VIP, 80, frame::ACK));
    let p = parse_checked(&out, "established hairpin packet");
    assert_eq!((p.src, p.dst), (HAIRPIN_SRC, pod));
    assert_eq!(counter(&fx, "hairpin"), 1);
}

/// A pod reaching itself from one port through two frontends: both hairpin flows would
/// be one tuple at the pod (the hairpin address, that port), so the second is given
/// another port of the client port's class, both ways, and the first keeps its own.
#[test]
fn a_hairpin_flow_clashing_at_its_backend_gets_another_source_port() {
    let mut fx = fixture();
    let pod = BACKENDS[0];
    let twin = Ipv4Addr::new(10, 96, 0, 53);
    reprogram(
        &mut fx,
        "twin",
        frontend(
            twin,
            80,
            Protocol::Tcp,
            &[pod],
            8080,
            NoEndpointAction::Reject,
        ),
    );
    let (_, out) = run(&fx, &tcp(pod, 43000, HAIRPIN_VIP, 80, frame::SYN));
    let first = parse_checked(&out, "the first hairpin SYN");
    assert_eq!(
        (first.src, first.sport, first.dst),
        (HAIRPIN_SRC, 43000, pod)
    );
    run(
        &fx,
        &tcp(pod, 8080, HAIRPIN_SRC, 43000, frame::SYN | frame::ACK),
    );
    run(&fx, &tcp(pod, 43000, HAIRPIN_VIP, 80, frame::ACK));

    let (_, out) = run(&fx, &tcp(pod, 43000, twin, 80, frame::SYN));
    let second = parse_checked(&out, "the clashing hairpin SYN");
    assert!(
        second.src == HAIRPIN_SRC
            && second.dst == pod
            && second.sport >= 1024
            && second.sport != 43000,
        "the clashing hairpin SYN left as {second:?}: want {HAIRPIN_SRC} from a port of \
         1024-65535 other than 43000, to {pod}"
    );
    for (port, vip, what) in [
        (second.sport, twin, "the clashing flow's answer"),
        (43000, HAIRPIN_VIP, "the first flow's answer"),
    ] {
        let (_, out) = run(&fx, &tcp(pod, 8080, HAIRPIN_SRC, port, frame::ACK));
        let answer = parse_checked(&out, what);
        assert_eq!(
            (answer.src, answer.sport, answer.dst, answer.dport),
            (vip, 80, pod, 43000),
            "{what}, sent to port {port}"
        );
    }
    let (_, out) = run(&fx, &tcp(pod, 43000, HAIRPIN_VIP, 80, frame::ACK));
    assert_eq!(
        parse_checked(&out, "the first flow's next packet").sport,
        43000,
        "the first flow's next packet"
    );
    assert_eq!(counter(&fx, "ct_port_remapped"), 1, "ct_port_remapped");
    assert_eq!(counter(&fx, "hairpin"), 2, "hairpin");
}

/// One client port reaching the same backend through two frontends (Linux hands a
/// connecting socket's port to connections to other destinations): the second flow's
/// tuple at the backend would be the first's, so it is given another source port (of
/// the client's own address, in the client port's class, as netfilter's NAT picks
/// one), both ways, and the first flow keeps its entries and its translation. TCP with
/// the first flow assured, UDP with it unanswered, and a privileged port.
#[test]
fn a_flow_clashing_at_its_backend_gets_another_source_port() {
    let mut fx = fixture();
    let pod = BACKENDS[0];
    let twin = Ipv4Addr::new(10, 96, 0, 50);
    let (udp_a, udp_b) = (Ipv4Addr::new(10, 96, 0, 51), Ipv4Addr::new(10, 96, 0, 52));
    let one = |vip, port, proto, target| {
        frontend(vip, port, proto, &[pod], target, NoEndpointAction::Reject)
    };
    reprogram(&mut fx, "twin", one(twin, 80, Protocol::Tcp, 8080));
    reprogram(&mut fx, "udp-a", one(udp_a, 53, Protocol::Udp, 5353));
    reprogram(&mut fx, "udp-b", one(udp_b, 53, Protocol::Udp, 5353));

    for (client_port, class) in [(44_000u16, 1024..=65535u16), (700, 600..=1023)] {
        let (_, out) = run(&fx, &tcp(CLIENT, client_port, HAIRPIN_VIP, 80, frame::SYN));
        let first = parse_checked(&out, "the first flow's SYN");
        assert_eq!(
            (first.src, first.sport, first.dst),
            (CLIENT, client_port, pod)
        );
        run(
            &fx,
            &tcp(pod, 8080, CLIENT, client_port, frame::SYN | frame::ACK),
        );
        run(&fx, &tcp(CLIENT, client_port, HAIRPIN_VIP, 80, frame::ACK));

        let (_, out) = run(&fx, &tcp(CLIENT, client_port, twin, 80, frame::SYN));
        let second = parse_checked(&out, "the clashing flow's SYN");
        assert!(
            second.src == CLIENT
                && second.dst == pod
                && second.sport != client_port
                && class.contains(&second.sport),
            "the clashing flow's SYN left as {second:?}: want {CLIENT} from a port of \
             {class:?} other than {client_port}, to {pod}"
        );
        let (_, out) = run(
            &fx,
            &tcp(pod, 8080, CLIENT, second.sport, frame::SYN | frame::ACK),
        );
        let answer = parse_checked(&out, "the clashing flow's SYN-ACK");
        assert_eq!(
            (answer.src, answer.sport, answer.dst, answer.dport),
            (twin, 80, CLIENT, client_port),
            "the clashing flow's SYN-ACK, back to the client's own port"
        );
        let (_, out) = run(&fx, &tcp(CLIENT, client_port, twin, 80, frame::ACK));
        assert_eq!(
            parse_checked(&out, "the clashing flow's ACK").sport,
            second.sport,
            "the clashing flow's next packet"
        );
        let (_, out) = run(&fx, &tcp(CLIENT, client_port, HAIRPIN_VIP, 80, frame::ACK));
        let again = parse_checked(&out, "the first flow's next packet");
        assert_eq!(
            (again.sport, again.dst),
            (client_port, pod),
            "the first flow"
        );
        let (_, out) = run(&fx, &tcp(pod, 8080, CLIENT, client_port, frame::ACK));
        let back = parse_checked(&out, "the first flow's answer");
        assert_eq!(
            (back.src, back.dport),
            (HAIRPIN_VIP, client_port),
            "the first flow's answer was taken for the clashing flow's"
        );
        let forward = ct_entries(
            &fx,
            &ct_key(CLIENT, client_port, twin, 80, proxy_common::PROTO_TCP),
        );
        let forward = forward
            .0
            .or(forward.1)
            .expect("the clashing flow's forward entry");
        assert!(
            forward.flags & ct_flags::SNAT != 0
                && u16::from_be(forward.alt_port_be) == second.sport
                && forward.alt_addr_be == u32::from_ne_bytes(CLIENT.octets()),
            "the clashing flow's forward entry {forward:?}"
        );
    }

    let (_, out) = run(&fx, &udp(CLIENT, 5000, udp_a, 53, false));
    assert_eq!(parse_checked(&out, "the first datagram").sport, 5000);
    let (_, out) = run(&fx, &udp(CLIENT, 5000, udp_b, 53, false));
    let second = parse_checked(&out, "the clashing datagram");
    assert!(
        second.dst == pod && second.sport != 5000 && second.sport >= 1024,
        "the clashing datagram left as {second:?}"
    );
    for (port, vip) in [(second.sport, udp_b), (5000, udp_a)] {
        let (_, out) = run(&fx, &udp(pod, 5353, CLIENT, port, false));
        let answer = parse_checked(&out, "an answer");
        assert_eq!(
            (answer.src, answer.sport, answer.dport),
            (vip, 53, 5000),
            "the answer to port {port}"
        );
    }
    assert_eq!(counter(&fx, "ct_port_remapped"), 3, "ct_port_remapped");
}

/// A packet from a backend's address and port that no flow knows (its pod answering
/// a client that reached it by its pod IP) passes untouched, again and again; this
/// CPU's flow cache then remembers its key as absent. A flow created afterwards with
/// that key as its reply voids what the cache remembered: its answers are translated
/// back, UDP (the first datagram's answer) and TCP (the ACKs after the handshake,
/// which use the cache, where the SYN-ACK does not).
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
            &udp(backend, 5353, CLIENT, 40555, false),
            &format!("a datagram from {backend}:5353 with no flow"),
        );
        untouched(
            &tcp(backend, 8080, CLIENT, 40556, frame::ACK),
            &format!("an ACK from {backend}:8080 with no flow"),
        );
    }

    let (_, out) = run(&fx, &udp(CLIENT, 40555, VIP, 53, false));
    let backend = parse_checked(&out, "the client's datagram").dst;
    let (_, out) = run(&fx, &udp(backend, 5353, CLIENT, 40555, false));
    let r = parse_checked(&out, "the backend's answer");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (VIP, 53, CLIENT, 40555),
        "the answer of a UDP flow created after that answer's key was seen without one"
    );

    let (_, out) = run(&fx, &tcp(CLIENT, 40556, VIP, 80, frame::SYN));
    let backend = parse_checked(&out, "SYN").dst;
    let (_, out) = run(
        &fx,
        &tcp(backend, 8080, CLIENT, 40556, frame::SYN | frame::ACK),
    );
    assert_eq!(parse_checked(&out, "SYN-ACK").src, VIP);
    run(&fx, &tcp(CLIENT, 40556, VIP, 80, frame::ACK));
    for i in 0..3 {
        let (_, out) = run(&fx, &tcp(backend, 8080, CLIENT, 40556, frame::ACK));
        let r = parse_checked(&out, "the backend's ACK");
        assert_eq!(
            (r.src, r.sport, r.dst, r.dport),
            (VIP, 80, CLIENT, 40556),
            "the backend's ACK {i} of a connection created after its key was seen without one"
        );
    }
}

/// A backend leaving the service takes its UDP flows with it (the next
/// datagram is balanced anew instead of blackholed), while a TCP connection
/// to it keeps going until it ends.
#[test]
fn departed_backend_loses_its_udp_flows_but_not_its_tcp_connections() {
    let mut fx = fixture();
    // One CPU throughout, so that the flow's cached copy (taken by its
    // second datagram) is the one later datagrams would find.
    let _cpu = stay_on_this_cpu();
    let (_, out) = run(&fx, &udp(CLIENT, 7000, VIP, 53, false));
    let udp_backend = parse_checked(&out, "first datagram").dst;
    for _ in 0..2 {
        let (_, out) = run(&fx, &udp(CLIENT, 7000, VIP, 53, false));
        assert_eq!(
            parse_checked(&out, "datagram of the flow").dst,
            udp_backend,
            "a datagram of an established UDP flow changed backend"
        );
    }
    // A TCP connection to the same backend, opened before it departs.
    let tcp_sport = (44000..45000)
        .find(|sport| {
            let (_, out) = run(&fx, &tcp(CLIENT, *sport, VIP, 80, frame::SYN));
            parse_checked(&out, "SYN").dst == udp_backend
        })
        .expect("some source port lands on the UDP flow's backend");

    let remaining: Vec<Ipv4Addr> = BACKENDS
        .iter()
        .copied()
        .filter(|b| *b != udp_backend)
        .collect();
    for (port, proto, target, name) in [
        (53, Protocol::Udp, 5353, "svc1"),
        (80, Protocol::Tcp, 8080, "svc0"),
    ] {
        let fe = frontend(
            VIP,
            port,
            proto,
            &remaining,
            target,
            NoEndpointAction::Reject,
        );
        reprogram(&mut fx, name, fe);
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

    for _ in 0..5 {
        let (_, out) = run(&fx, &udp(CLIENT, 7000, VIP, 53, false));
        let now = parse_checked(&out, "datagram after removal").dst;
        assert!(
            remaining.contains(&now),
            "UDP flow still sent to the departed backend {now}"
        );
    }
    let (_, out) = run(&fx, &tcp(CLIENT, tcp_sport, VIP, 80, frame::ACK));
    assert_eq!(
        parse_checked(&out, "TCP after removal").dst,
        udp_backend,
        "an established TCP connection must keep its backend"
    );
}

/// Pins the calling thread to the CPU it is on (per-CPU state such as the
/// flow cache is then the same from one test run to the next), until the
/// guard drops.
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

/// Replaces the frontends of the fixture's Service `name` (`svcN`, the N-th
/// of `fixture`'s list) with `fe`, as a sync after an edit would.
/// A conntrack map pinned with another capacity than the load asks for
/// (`--conntrack-max` changed) is replaced by one of the asked size, its flows
/// carried over: at the load, and at `finish_resize` for the flows the older
/// programs made in between. So is a map that a load which stopped half-way set
/// aside.
#[test]
fn a_conntrack_map_of_another_size_is_replaced_with_its_flows() {
    use aya::maps::{HashMap, MapData, MapInfo};
    use proxy_common::{CtKey, ct_dir};

    let pins = PinLayout::new(unique_root("ebpf-proxy-resize"));
    struct Unpin(PinLayout);
    impl Drop for Unpin {
        fn drop(&mut self) {
            let _ = proxy_userspace::datapath::cleanup(&self.0);
        }
    }
    let _unpin = Unpin(pins.clone());
    let pin = pins.map("CONNTRACK");
    let aside = pins.map("CONNTRACK-resizing");
    let capacity = || {
        MapInfo::from_pin(&pin)
            .expect("conntrack pin")
            .max_entries()
    };
    let flow = |port: u16| {
        let key = CtKey::new(
            u32::from_ne_bytes(CLIENT.octets()),
            u32::from_ne_bytes(VIP.octets()),
            port.to_be(),
            80u16.to_be(),
            frame::TCP,
        );
        let value = CtValue {
            nat_addr_be: u32::from_ne_bytes(BACKENDS[1].octets()),
            nat_port_be: 8080u16.to_be(),
            // An established flow, as CONNTRACK holds them.
            flags: ct_flags::SEEN_REPLY | ct_flags::ASSURED,
            dir: ct_dir::FORWARD,
            backend_id: 7,
            service_id: 3,
            ..Default::default()
        };
        (key, value)
    };
    let load = |entries: u32| {
        Datapath::load_sized(pins.clone(), entries)
            .unwrap_or_else(|e| panic!("loading with {entries} conntrack entries: {e}"))
    };

    let mut first = load(8192);
    assert!(
        first.finish_resize().is_none(),
        "a map created anew has nothing to carry over"
    );
    let (k1, v1) = flow(40001);
    first.maps.conntrack.insert(k1, v1, 0).expect("a flow");
    drop(first);
    assert_eq!(capacity(), 8192);

    let mut resized = load(16384);
    assert_eq!(capacity(), 16384, "the map was not replaced");
    assert_eq!(
        resized.maps.conntrack.get(&k1, 0).ok(),
        Some(v1),
        "the flow was not carried over at the load"
    );
    // A flow the older programs make before this datapath takes over.
    let (k2, v2) = flow(40002);
    let mut older: HashMap<_, CtKey, CtValue> = HashMap::try_from(aya::maps::Map::LruHashMap(
        MapData::from_pin(&aside).expect("the set-aside map"),
    ))
    .expect("the set-aside map as conntrack");
    older
        .insert(k2, v2, 0)
        .expect("a flow of the older programs");
    let carried = resized.finish_resize().map(|r| r.expect("finishing"));
    assert_eq!(carried, Some(1), "only the newer flow is left to carry");
    assert_eq!(
        resized.maps.conntrack.get(&k2, 0).ok(),
        Some(v2),
        "the older programs' late flow was not carried over"
    );
    assert!(!aside.exists(), "the set-aside map is still pinned");
    drop(resized);

    // A load that stopped right after setting the map aside.
    std::fs::rename(&pin, &aside).expect("setting the map aside by hand");
    let mut again = load(16384);
    for (k, v) in [(k1, v1), (k2, v2)] {
        assert_eq!(
            again.maps.conntrack.get(&k, 0).ok(),
            Some(v),
            "a flow of the map left aside was lost"
        );
    }
    assert_eq!(
        again.finish_resize().map(|r| r.expect("finishing")),
        Some(0)
    );
    assert!(!aside.exists(), "the map left aside is still pinned");
}

/// A backend leaving a ClientIP-affinity service takes the affinity entries
/// that name it, and only those: clients stuck to the other backends stay
/// stuck, and the TCP connections to it are left to finish.
#[test]
fn departed_backend_takes_its_affinity_entries_and_only_those() {
    let mut fx = fixture();
    let sticky = |backends: &[Ipv4Addr]| Frontend {
        affinity_timeout_s: Some(10_800),
        ..frontend(
            VIP,
            8443,
            Protocol::Tcp,
            backends,
            8443,
            NoEndpointAction::Reject,
        )
    };
    assert_eq!(
        affinity_services(&fx),
        0,
        "affinity held before any frontend had it"
    );
    reprogram(&mut fx, "sticky", sticky(&BACKENDS));
    let leaving = BACKENDS[0];
    let mut picks = Vec::new();
    for i in 1..=30u8 {
        let client = Ipv4Addr::new(10, 200, 1, i);
        let (_, out) = run(&fx, &tcp(client, 40000, VIP, 8443, frame::SYN));
        picks.push((client, parse_checked(&out, "sticky SYN").dst));
    }
    let stuck_to_leaving = picks.iter().filter(|(_, b)| *b == leaving).count();
    assert!(
        stuck_to_leaving > 0 && stuck_to_leaving < picks.len(),
        "30 clients should spread over 3 backends: {picks:?}"
    );
    let affinity_entries = |fx: &Fixture| fx.datapath.maps.affinity.keys().count();
    assert_eq!(
        affinity_entries(&fx),
        picks.len(),
        "each client's first connection records its pick"
    );

    assert_eq!(affinity_services(&fx), 1, "entries made: one Service's");
    reprogram(&mut fx, "sticky", sticky(&BACKENDS[1..]));
    let departed = fx.planner.take_departed();
    let affinity = fx.planner.take_affinity_purge(&departed);
    let swept =
        conntrack::purge_departed(&mut fx.datapath.maps, &departed, &affinity).expect("purge");
    assert_eq!(
        (swept.affinity, swept.conntrack),
        (stuck_to_leaving, 0),
        "the leaving backend's affinity entries go, its TCP flows stay: {picks:?}"
    );
    assert_eq!(
        affinity_entries(&fx),
        picks.len() - stuck_to_leaving,
        "affinity entries of the remaining backends were removed too"
    );
    for (client, backend) in picks.iter().filter(|(_, b)| *b != leaving) {
        let (_, out) = run(&fx, &tcp(*client, 40001, VIP, 8443, frame::SYN));
        assert_eq!(
            parse_checked(&out, "new connection of a stuck client").dst,
            *backend,
            "client {client} lost its affinity when another backend left"
        );
    }
}

/// A Service whose session affinity goes off loses its affinity entries at the end
/// of that sync, as kube-proxy's `recent` lists go with its rules: turned on again,
/// its clients are balanced afresh, none sent back to a backend it had before by an
/// entry left over. Another Service's entries stay.
#[test]
fn affinity_turned_off_takes_its_entries_and_only_those() {
    let mut fx = fixture();
    let sticky = |vip: Ipv4Addr, on: bool| Frontend {
        affinity_timeout_s: on.then_some(10_800),
        ..frontend(
            vip,
            8443,
            Protocol::Tcp,
            &BACKENDS,
            8443,
            NoEndpointAction::Reject,
        )
    };
    let other = Ipv4Addr::new(10, 96, 0, 54);
    reprogram(&mut fx, "sticky", sticky(VIP, true));
    reprogram(&mut fx, "other", sticky(other, true));
    let _ = fx.planner.take_departed();
    for i in 1..=10u8 {
        let client = Ipv4Addr::new(10, 200, 1, i);
        for vip in [VIP, other] {
            run(&fx, &tcp(client, 40000, vip, 8443, frame::SYN));
        }
    }
    let held = |fx: &Fixture| fx.datapath.maps.affinity.keys().count();
    assert_eq!(held(&fx), 20, "each client's pick, for each Service");

    reprogram(&mut fx, "sticky", sticky(VIP, false));
    let departed = fx.planner.take_departed();
    let affinity = fx.planner.take_affinity_purge(&departed);
    assert_eq!(
        (affinity.dropped.len(), affinity.departed, departed.len()),
        (1, false, 0),
        "affinity off, no backend departed: {affinity:?}"
    );
    let swept =
        conntrack::purge_departed(&mut fx.datapath.maps, &departed, &affinity).expect("purge");
    assert_eq!(
        (swept.affinity, held(&fx)),
        (10, 10),
        "the entries removed, and those left (the other Service's)"
    );
    assert_eq!(
        affinity_services(&fx),
        1,
        "the other Service's entries stay"
    );
    reprogram(&mut fx, "sticky", sticky(VIP, true));
    let departed = fx.planner.take_departed();
    assert_eq!(
        fx.planner.take_affinity_purge(&departed),
        AffinityPurge::default(),
        "affinity on again: nothing to purge"
    );
}

/// How many Services `AFFINITY` holds entries of.
fn affinity_services(fx: &Fixture) -> usize {
    fx.datapath
        .maps
        .affinity_service_ids()
        .expect("AFFINITY read")
        .len()
}

fn reprogram(fx: &mut Fixture, name: &str, fe: Frontend) {
    let owner = ObjectKey {
        namespace: "test".into(),
        name: name.into(),
    };
    let out = fx
        .planner
        .sync_service(&owner, &[fe], &mut fx.datapath.maps);
    assert!(
        out.errors.is_empty(),
        "reprogramming {name}: {:?}",
        out.errors
    );
}

/// The agent's reap of expired conntrack entries at `now`, on the fixture's
/// datapath, and its write of the clients' counts it took on the way
/// (`ct_sources`); how many entries it removed.
fn reap_expired(fx: &mut Fixture, now: u64) -> usize {
    let (maps, reap) = fx.datapath.conntrack_reaping();
    let mut tally = ct_sources::Tally::default();
    let reaped = conntrack::reap_expired(maps, &reap, now, &mut tally).expect("reaping");
    ct_sources::write(&mut fx.datapath.maps, &tally).expect("writing the clients' counts");
    reaped
}

fn ct_key(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, proto: u8) -> proxy_common::CtKey {
    proxy_common::CtKey::new(
        u32::from_ne_bytes(src.octets()),
        u32::from_ne_bytes(dst.octets()),
        sport.to_be(),
        dport.to_be(),
        proto,
    )
}

/// Rewrites a forward conntrack entry to translate to `backend`, behind the
/// datapath's back (no invalidation), as only a test would.
fn point_entry_at(fx: &mut Fixture, key: &proxy_common::CtKey, backend: Ipv4Addr) {
    let conntrack = &mut fx.datapath.maps.conntrack;
    let mut entry = conntrack.get(key, 0).expect("flow entry");
    entry.nat_addr_be = u32::from_ne_bytes(backend.octets());
    conntrack
        .insert(key, entry, 0)
        .expect("rewriting the entry");
}

/// Established packets are translated from this CPU's copy of their
/// conntrack entry, and a copy is never used once its entry may have
/// changed: after the agent bumps the epoch, or after the datapath removes
/// or replaces the entry.
#[test]
fn flow_cache_serves_established_packets_until_its_entry_changes() {
    let mut fx = fixture();
    let _cpu = stay_on_this_cpu();
    let sport = 41500;
    let dst = |fx: &Fixture, flags: u8, what: &str| {
        let (ret, out) = run(fx, &tcp(CLIENT, sport, VIP, 80, flags));
        assert_eq!(ret, TC_PASS, "{what}: verdict");
        parse_checked(&out, what).dst
    };
    let first = dst(&fx, frame::SYN, "SYN");
    // The backend answers and the client's ACK assures the flow: only an
    // assured flow's entries are copied.
    let (ret, _) = run(
        &fx,
        &tcp(first, 8080, CLIENT, sport, frame::SYN | frame::ACK),
    );
    assert_eq!(ret, TC_PASS, "SYN-ACK: verdict");
    assert_eq!(dst(&fx, frame::ACK, "ACK assuring the flow"), first);
    assert_eq!(dst(&fx, frame::ACK, "ACK taking the copy"), first);
    assert_eq!(dst(&fx, frame::ACK, "ACK from the copy"), first);

    // The entry is pointed at another backend behind the datapath's back:
    // the copy still serves (which shows there is one) until the agent
    // bumps the epoch, as it does after removing entries.
    let other = *BACKENDS.iter().find(|b| **b != first).expect("3 backends");
    let key = ct_key(CLIENT, sport, VIP, 80, proxy_common::PROTO_TCP);
    point_entry_at(&mut fx, &key, other);
    assert_eq!(
        dst(&fx, frame::ACK, "ACK with a rewritten entry"),
        first,
        "an established packet did not come from the flow cache"
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
    let fe = frontend(
        VIP,
        80,
        Protocol::Tcp,
        &[third],
        8080,
        NoEndpointAction::Reject,
    );
    reprogram(&mut fx, "svc0", fe);
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

/// The benchmarks set new flows against the conntrack pair programs, so
/// those must do a new flow's conntrack work and nothing else: both entries
/// of the packet's flow, the packet itself untouched, at either hook, and
/// on a packet to a frontend no translation and no counter moved.
#[test]
fn conntrack_pair_programs_make_both_entries_and_nothing_else() {
    let mut fx = fixture();
    fx.datapath
        .load_floors()
        .expect("loading the benchmark reference programs");
    let dnat_before = counter(&fx, "dnat_new");
    let (tc_pair, xdp_pair) = fx.datapath.ct_pairs().expect("conntrack pair programs");
    for (hook, sport) in [("tc", 41_000u16), ("xdp", 41_001)] {
        let input = tcp(CLIENT, sport, VIP, 80, 0x02);
        let (verdict, out) = if hook == "tc" {
            run_program(tc_pair, &input)
        } else {
            run_program(xdp_pair, &input)
        }
        .unwrap_or_else(|e| panic!("{hook} conntrack pair program: {e}"));
        let pass = if hook == "tc" { TC_PASS } else { XDP_PASS };
        assert_eq!(verdict, pass, "{hook}: verdict");
        assert_eq!(out, input, "{hook}: the packet was changed");
        // A new flow's entries, not assured yet.
        let conntrack = &fx.datapath.maps.ct_new;
        let forward = ct_key(CLIENT, sport, VIP, 80, frame::TCP);
        let reply = ct_key(VIP, 80, CLIENT, sport, frame::TCP);
        for (what, key) in [("forward", forward), ("reply", reply)] {
            let entry = conntrack
                .get(&key, 0)
                .unwrap_or_else(|e| panic!("{hook}: no {what} entry for {key:?}: {e}"));
            let dir = if what == "forward" {
                proxy_common::ct_dir::FORWARD
            } else {
                proxy_common::ct_dir::REPLY
            };
            assert_eq!(entry.dir, dir, "{hook}: {what} entry {entry:?}");
        }
    }
    assert_eq!(
        counter(&fx, "dnat_new"),
        dnat_before,
        "the pair programs counted a new flow"
    );
}

/// The SCTP frontends of the fixture: `VIP`:9000 -> 9000 (the port kept) and,
/// programmed by [`sctp_fixture`], `VIP`:9001 -> 19001 (the port changed).
const SCTP_PORT: u16 = 9000;
const SCTP_REMAP_PORT: u16 = 9001;
const SCTP_REMAP_TARGET: u16 = 19_001;

/// The fixture with the SCTP frontend whose port changes as well.
fn sctp_fixture() -> Fixture {
    let mut fx = fixture();
    let fe = frontend(
        VIP,
        SCTP_REMAP_PORT,
        Protocol::Sctp,
        &BACKENDS,
        SCTP_REMAP_TARGET,
        NoEndpointAction::Reject,
    );
    reprogram(&mut fx, "sctp-remap", fe);
    fx
}

/// A frame carrying an SCTP packet of `chunks` under `vtag`, its `CRC32c` right.
fn sctp_frame(
    src: (Ipv4Addr, u16),
    dst: (Ipv4Addr, u16),
    vtag: u32,
    chunks: &[Vec<u8>],
) -> Vec<u8> {
    frame::build_sctp(src.0, dst.0, &sctp::packet(src.1, dst.1, vtag, chunks))
}

/// The output frame `out` parsed, its IPv4 header checksum and `CRC32c` checked
/// (`what` says which packet in a failure).
fn sctp_out(out: &[u8], what: &str) -> (frame::Parsed, sctp::Packet) {
    let p = parse_checked(out, what);
    assert_eq!(p.proto, frame::SCTP, "{what}: protocol {}", p.proto);
    let packet = sctp::parse(&out[34..]).unwrap_or_else(|e| panic!("{what}: {e}"));
    (p, packet)
}

/// A 1,400-byte DATA chunk: a checksum update over more than 256 bytes.
fn long_data(tsn: u32) -> Vec<u8> {
    sctp::data(tsn, &[0xa5; 1400])
}

/// One association through an SCTP ClusterIP at tc, every packet's `CRC32c`
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
    closed_timeouts(&mut fx, Duration::from_millis(1), Duration::from_millis(1));
    let client = (CLIENT, 42_000);
    let fe = (VIP, SCTP_REMAP_PORT);
    let handshake = |tag_a: u32, tag_z: u32, what: &str| -> (Ipv4Addr, u16) {
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
    let fx = fixture();
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
        let input = frame::build_sctp(CLIENT, VIP, bytes);
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
    let mut fe = frontend(
        Ipv4Addr::UNSPECIFIED,
        SCTP_NODE_PORT,
        Protocol::Sctp,
        &[REMOTE_POD],
        SCTP_NODE_TARGET,
        NoEndpointAction::Reject,
    );
    fe.kind = FrontendKind::NodePort;
    for b in &mut fe.backends {
        b.local = false;
    }
    reprogram(&mut nf.fx, "sctp-nodeport", fe);
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
    sctp_nodeport_association(&nf, run_tc_on_uplink, (TC_ACT_REDIRECT, TC_ACT_SHOT), "tc");
    assert_eq!(counter(&nf.fx, "xdp_tx"), 0);
}

/// An SCTP LoadBalancer IP and an ExternalIP (port 9000, to 9999 on the remote
/// pod), reached from outside at XDP: the INIT is SNATed and DNATed, the INIT
/// ACK is translated back to come from the frontend, a reply under another tag
/// is dropped; every checksum right.
#[test]
fn xdp_translates_sctp_to_a_load_balancer_ip_and_an_external_ip() {
    let mut nf = node_fixture();
    let external_ip = Ipv4Addr::new(192, 168, 60, 11);
    for (name, kind, ip) in [
        ("sctp-lb", FrontendKind::LoadBalancer, LB_IP),
        ("sctp-external", FrontendKind::ExternalIp, external_ip),
    ] {
        let mut fe = frontend(
            ip,
            SCTP_PORT,
            Protocol::Sctp,
            &[REMOTE_POD],
            SCTP_NODE_TARGET,
            NoEndpointAction::Reject,
        );
        fe.kind = kind;
        for b in &mut fe.backends {
            b.local = false;
        }
        reprogram(&mut nf.fx, name, fe);
    }
    for (i, ip) in [LB_IP, external_ip].into_iter().enumerate() {
        let what = format!("SCTP to {ip}:{SCTP_PORT}");
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
    let input = frame::build_sctp(OUTSIDE, NODE_IP, &whole[..10]);
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
    let (ret, out) = run_tc_on_uplink(&nf, &input);
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

/// A malformed frame is passed by XDP uncounted, and counted by tc, which
/// sees the same frame next: once a packet, as over IPv6.
#[test]
fn a_malformed_frame_through_xdp_then_tc_is_counted_once() {
    let nf = node_fixture();
    let mut malformed = tcp(CLIENT, 40_000, VIP, 80, frame::SYN);
    // A header length of 4 words: shorter than IPv4's fixed header.
    malformed[14] = 0x44;
    let (ret, out) = run_xdp(&nf, &malformed);
    assert_eq!(
        (ret, &out),
        (XDP_PASS, &malformed),
        "XDP must pass a malformed frame untouched"
    );
    assert_eq!(
        counter(&nf.fx, "pass_malformed"),
        0,
        "XDP counted a malformed frame that tc counts next"
    );
    let (ret, out) = run(&nf.fx, &malformed);
    assert_eq!(
        (ret, &out),
        (TC_PASS, &malformed),
        "tc must pass a malformed frame untouched"
    );
    assert_eq!(
        counter(&nf.fx, "pass_malformed"),
        1,
        "a malformed frame counted once"
    );
}

/// The datapath's clock (jiffies scaled by the calibration `Datapath::load`
/// makes) reads `CLOCK_MONOTONIC`, the reaper's clock, to within two ticks:
/// a new flow's conntrack timestamps fall between readings taken around it.
#[test]
fn datapath_clock_is_calibrated_to_the_monotonic_clock() {
    let fx = fixture();
    let scale = fx
        .datapath
        .maps
        .clock
        .get(&proxy_common::clock_slot::IN_FORCE, 0)
        .expect("reading CLOCK");
    assert!(
        [10_000_000, 4_000_000, 3_333_333, 1_000_000].contains(&scale.tick_ns),
        "calibrated tick is {} ns, not a kernel tick length",
        scale.tick_ns
    );
    for sport in 41000..41005 {
        let before = conntrack::monotonic_ns();
        run(&fx, &tcp(CLIENT, sport, VIP, 80, frame::SYN));
        let after = conntrack::monotonic_ns();
        let key = ct_key(CLIENT, sport, VIP, 80, proxy_common::PROTO_TCP);
        let entry = fx
            .datapath
            .maps
            .ct_new
            .get(&key, 0)
            .expect("the new flow's conntrack entry (not assured yet)");
        let slack = 2 * scale.tick_ns;
        assert!(
            entry.last_seen_ns + slack >= before && entry.last_seen_ns <= after + slack,
            "flow stamped at {} ns by the datapath clock, outside [{before}, {after}] \
             monotonic (+-{slack} ns)",
            entry.last_seen_ns
        );
        // The point: the next flow is stamped tens of ms later, so a clock that
        // stood still or ran at the wrong rate would leave the window.
        std::thread::sleep(Duration::from_millis(30));
    }
}

/// Configured conntrack timeouts rule both the datapath (an idle flow is
/// balanced anew) and the agent's reaper (it removes the idle entries).
#[test]
fn configured_udp_timeout_expires_flows_in_datapath_and_reaper() {
    let mut fx = fixture();
    set_udp_timeout(&mut fx, 1_000_000_000);
    run(&fx, &udp(CLIENT, 7100, VIP, 53, false));
    run(&fx, &udp(CLIENT, 7100, VIP, 53, false));
    assert_eq!(
        (counter(&fx, "dnat_new"), counter(&fx, "dnat_established")),
        (1, 1),
        "second datagram must use the flow"
    );
    // The point: the 1 s UDP timeout set above runs out (a sleep only overshoots).
    std::thread::sleep(Duration::from_millis(1_300));
    let reaped = reap_expired(&mut fx, conntrack::monotonic_ns());
    assert_eq!(
        reaped, 2,
        "both entries of the idle UDP flow must be reaped"
    );
    run(&fx, &udp(CLIENT, 7100, VIP, 53, false));
    assert_eq!(
        counter(&fx, "dnat_new"),
        2,
        "after the timeout the flow starts anew"
    );
}

/// Conntrack's timeouts set to `timeouts`, as the agent sets them.
fn set_timeouts(fx: &mut Fixture, timeouts: proxy_common::CtTimeouts) {
    fx.datapath
        .maps
        .apply(&MapOp::SetCtTimeouts { timeouts })
        .expect("setting the timeouts");
}

/// Conntrack's UDP idle timeout set to `ns`, the others left at their defaults.
fn set_udp_timeout(fx: &mut Fixture, ns: u64) {
    set_timeouts(
        fx,
        proxy_common::CtTimeouts {
            udp_ns: ns,
            ..proxy_common::CtTimeouts::DEFAULT
        },
    );
}

/// A flow lives while either direction sends, as netfilter's one entry does: a client
/// sending one way refreshes its flow's reply entry with its own (once a second), so
/// that an answer coming after the timeout from the flow's start, but within it of
/// the client's last datagram, is still translated back.
#[test]
fn a_client_sending_one_way_keeps_its_flows_reply_entry_alive() {
    let mut fx = fixture();
    set_udp_timeout(&mut fx, 2_000_000_000);
    let (_, out) = run(&fx, &udp(CLIENT, 7200, VIP, 53, false));
    let backend = parse_checked(&out, "the flow's first datagram").dst;
    // Past the once-a-second refresh, so that this datagram refreshes the entries;
    // then past the 2 s timeout counted from the flow's start, not from this one.
    std::thread::sleep(Duration::from_millis(1_200));
    run(&fx, &udp(CLIENT, 7200, VIP, 53, false));
    std::thread::sleep(Duration::from_millis(1_200));
    let rev_nat = counter(&fx, "rev_nat");
    let (_, out) = run(&fx, &udp(backend, 5353, CLIENT, 7200, false));
    let answer = parse_checked(&out, "the backend's answer");
    assert_eq!(
        (answer.src, answer.sport, counter(&fx, "rev_nat") - rev_nat),
        (VIP, 53, 1),
        "an answer 2.4 s into a flow whose client sent 1.2 s ago (timeout 2 s) should come \
         from the ClusterIP, reverse-NATed"
    );
}

#[test]
fn udp_checksums_stay_valid_and_zero_stays_zero() {
    udp_checksums(&fixture());
}

#[test]
fn udp_checksums_stay_valid_and_zero_stays_zero_through_the_checksum_helper() {
    let fx = fixture_reading(Some(ip_summed::Read::Unknown));
    udp_checksums(&fx);
    assert_eq!(csum_states(&fx), (0, 2), "(none, unknown) states tc read");
}

fn udp_checksums(fx: &Fixture) {
    let (ret, out) = run(fx, &udp(CLIENT, 5000, VIP, 53, false));
    assert_eq!(ret, TC_PASS);
    let p = parse_checked(&out, "DNATed UDP");
    assert!(
        BACKENDS.contains(&p.dst) && p.dport == 5353,
        "UDP not DNATed: {}:{}",
        p.dst,
        p.dport
    );

    let (ret, out) = run(fx, &udp(CLIENT, 5001, VIP, 53, true));
    assert_eq!(ret, TC_PASS);
    let p = parse_checked(&out, "DNATed UDP without checksum");
    assert!(BACKENDS.contains(&p.dst));
    assert_eq!(
        &out[40..42],
        &[0, 0],
        "a UDP checksum of 0 must stay 0 (no checksum)"
    );
}

/// Rejects are held to the node's ICMP error budget (`REJECT_LIMIT`): a
/// spoofed flood to a frontend without endpoints is answered at most at the
/// budget's rate, the rest dropped and counted. TCP's RSTs and UDP's errors
/// spend one budget.
#[test]
fn rejects_are_held_to_the_icmp_error_budget() {
    let mut fx = fixture();
    // A burst of 5 and no refill: what is sent is the burst alone.
    fx.datapath
        .limit_rejects(0, 5)
        .expect("writing REJECT_LIMIT");
    let mut verdicts = Vec::new();
    for i in 0..20 {
        let (ret, _) = run(&fx, &tcp(CLIENT, 42_000 + i, EMPTY_VIP, 80, frame::SYN));
        verdicts.push(ret);
    }
    let (ret, _) = run(&fx, &udp(CLIENT, 6001, EMPTY_VIP, 53, false));
    verdicts.push(ret);
    let sent = verdicts.iter().filter(|v| **v == TC_ACT_REDIRECT).count();
    let dropped = verdicts.iter().filter(|v| **v == TC_ACT_SHOT).count();
    assert_eq!(
        (sent, dropped),
        (5, 16),
        "21 rejects against a burst of 5 with no refill: verdicts {verdicts:?}"
    );
    assert_eq!(
        &verdicts[..5],
        &[TC_ACT_REDIRECT; 5],
        "the burst is the first five"
    );
    assert_eq!(counter(&fx, "reject_rate_limited"), 16);
    assert_eq!(
        counter(&fx, "reject"),
        21,
        "every reject decided is counted"
    );

    // Refilled by the millisecond, up to the burst. Slowly: a round's four
    // runs earn no credit unless 100 ms pass between two of them (at 1,000
    // a second one did, once, on a loaded machine: each run is a system
    // call that may wait for a CPU).
    fx.datapath
        .limit_rejects(10, 3)
        .expect("writing REJECT_LIMIT");
    let four_syns = |first_port: u16| -> Vec<u32> {
        (first_port..first_port + 4)
            .map(|port| run(&fx, &tcp(CLIENT, port, EMPTY_VIP, 80, frame::SYN)).0)
            .collect()
    };
    let burst_then_empty = [
        TC_ACT_REDIRECT,
        TC_ACT_REDIRECT,
        TC_ACT_REDIRECT,
        TC_ACT_SHOT,
    ];
    assert_eq!(
        four_syns(43_000),
        burst_then_empty,
        "a burst of 3, then the bucket is empty"
    );
    // Time must pass for the bucket to refill: 400 ms is 4 credits at 10
    // a second, capped at the burst.
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(
        four_syns(44_000),
        burst_then_empty,
        "refilled to the burst, no further"
    );
    assert_eq!(counter(&fx, "reject_rate_limited"), 18);
}

#[test]
fn no_endpoints_rejects_tcp_with_rst_and_udp_with_icmp() {
    let fx = fixture();
    let syn = tcp(CLIENT, 41000, EMPTY_VIP, 80, frame::SYN);
    let (ret, out) = run(&fx, &syn);
    assert_eq!(
        ret, TC_ACT_REDIRECT,
        "a rejected SYN is sent back where it came from"
    );
    let p = parse_checked(&out, "RST");
    assert_eq!(
        (p.src, p.sport, p.dst, p.dport),
        (EMPTY_VIP, 80, CLIENT, 41000),
        "RST must come from the frontend to the client"
    );
    let flags = out[14 + 20 + 13];
    assert_eq!(
        flags,
        frame::RST | frame::ACK,
        "flags of the reset: {flags:#x}"
    );
    let ack = u32::from_be_bytes(out[14 + 20 + 8..14 + 20 + 12].try_into().unwrap());
    assert_eq!(
        ack, 0x1234_5679,
        "RST must acknowledge the SYN's sequence number + 1"
    );
    assert_eq!(&out[0..6], &syn[6..12], "Ethernet addresses not swapped");

    let dgram = udp(CLIENT, 6000, EMPTY_VIP, 53, false);
    let (ret, out) = run(&fx, &dgram);
    assert_eq!(ret, TC_ACT_REDIRECT);
    let p = parse_checked(&out, "ICMP port unreachable");
    assert_eq!((p.proto, p.src, p.dst), (1, EMPTY_VIP, CLIENT));
    assert_eq!(
        (out[34], out[35]),
        (3, 3),
        "ICMP type/code must be port unreachable"
    );
    assert_eq!(
        &out[42..70],
        &dgram[14..42],
        "the ICMP error must quote the original IP header and 8 bytes"
    );
    assert_eq!(counter(&fx, "reject"), 2);

    // ITP Local with no local endpoint: dropped, as kube-proxy does.
    let (ret, _) = run(&fx, &tcp(CLIENT, 41001, LOCAL_ONLY_VIP, 80, frame::SYN));
    assert_eq!(ret, TC_ACT_SHOT, "no local endpoints: drop");
}

#[test]
fn non_service_and_malformed_packets_pass_untouched() {
    let fx = fixture();
    let cases: Vec<(&str, Vec<u8>)> = {
        let good = tcp(CLIENT, 42000, VIP, 80, frame::SYN);
        let mut bad_version = good.clone();
        bad_version[14] = 0x65;
        let mut short_ihl = good.clone();
        short_ihl[14] = 0x44;
        let mut long_tot = good.clone();
        long_tot[16..18].copy_from_slice(&200u16.to_be_bytes());
        let mut bad_doff = good.clone();
        bad_doff[14 + 20 + 12] = 0x40;
        let mut arp = good.clone();
        arp[12..14].copy_from_slice(&[0x08, 0x06]);
        // A later fragment (offset 1,480) whose first fragment never came.
        let mut fragment = good.clone();
        fragment[20..22].copy_from_slice(&[0x00, 0xb9]);
        let c = frame::csum(&[&fragment[14..24], &[0, 0], &fragment[26..34]].concat(), 0);
        fragment[24..26].copy_from_slice(&c.to_be_bytes());
        vec![
            (
                "other destination",
                tcp(CLIENT, 42000, Ipv4Addr::new(10, 1, 2, 3), 80, frame::SYN),
            ),
            ("other port", tcp(CLIENT, 42000, VIP, 81, frame::SYN)),
            // (A frame cut inside its IPv4 header cannot be test-run: the
            // kernel refuses it with EINVAL before any program sees it.)
            ("truncated in the TCP header", good[..44].to_vec()),
            ("IP version 6 in an IPv4 frame", bad_version),
            ("IHL below 5", short_ihl),
            ("total length beyond the frame", long_tot),
            ("TCP data offset below 5", bad_doff),
            ("ARP ethertype", arp),
            ("a later fragment without its first one", fragment),
        ]
    };
    for (what, input) in cases {
        let (ret, out) = try_run(&fx, &input).unwrap_or_else(|e| panic!("{what}: {e}"));
        // What is not IPv4 goes on to tc_ingress6 by its tail call, which
        // passes what is not IPv6 either: a pass all the same.
        assert_eq!(ret, TC_PASS, "{what}: verdict {ret}");
        assert_eq!(out, input, "{what}: the packet was modified");
    }
    assert!(
        counter(&fx, "pass_malformed") >= 5,
        "malformed packets not counted"
    );
    assert_eq!(
        counter(&fx, "dnat_new"),
        0,
        "a malformed packet was translated"
    );
}

/// Not the agent's map writer but the kernel's own random draw: 30,000 new
/// flows over three backends, tested for uniformity.
#[test]
fn new_flows_spread_uniformly_in_the_kernel() {
    let fx = fixture();
    let mut counts = [0u64; 3];
    let flows = 30_000u32;
    for i in 0..flows {
        let sport = 1024 + (i % 60000) as u16;
        let src = Ipv4Addr::from(u32::from(CLIENT) + i / 60000);
        let (ret, out) = run(&fx, &tcp(src, sport, VIP, 80, frame::SYN));
        assert_eq!(ret, TC_PASS);
        let p = parse_checked(&out, "DNATed SYN");
        let k = BACKENDS
            .iter()
            .position(|b| *b == p.dst)
            .expect("a backend");
        counts[k] += 1;
    }
    let expected = f64::from(flows) / 3.0;
    let chi2: f64 = counts
        .iter()
        .map(|&c| (c as f64 - expected).powi(2) / expected)
        .sum();
    // Critical value of chi-square with 2 degrees of freedom at p = 0.001.
    assert!(
        chi2 < 13.816,
        "kernel selection is not uniform: counts {counts:?}, chi2 {chi2:.2} >= 13.816"
    );
    eprintln!("kernel selection over 3 backends, {flows} flows: {counts:?} (chi2 {chi2:.2})");
}

// ---------------------------------------------------------------------------
// North-south per-packet logic, XDP and its tc fallback, on hand-built frames.
// The runs happen inside a network namespace of their own holding the node's
// uplink (one end of a veth pair) and permanent neighbour entries, so that the
// programs' FIB lookups have one fixed answer.

const XDP_DROP: u32 = 1;
const XDP_PASS: u32 = 2;
const XDP_REDIRECT: u32 = 4;
const NODE_IP: Ipv4Addr = two_node::NODE_A_IP;
const PEER_NODE: Ipv4Addr = two_node::NODE_B_IP;
const OUTSIDE: Ipv4Addr = two_node::CLIENT1.1;
const OUTSIDE_DENIED: Ipv4Addr = two_node::CLIENT2.1;
const REMOTE_POD: Ipv4Addr = two_node::NODE_B_POD;
const LB_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 60, 10);
const NODE_PORT: u16 = 30080;
const LOCAL_ONLY_NODE_PORT: u16 = 30081;
const EMPTY_NODE_PORT: u16 = 30082;
const UPLINK_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
const OUTSIDE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x64];

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

/// SNAT to `NODE_IP` from ports `min..=max`, with `flags`
/// (`proxy_common::node_config_flags`).
fn node_config(min: u16, max: u16, flags: u32) -> proxy_common::NodeConfig {
    proxy_common::NodeConfig {
        snat_addr_be: proxy_common::v4_mapped(u32::from_ne_bytes(NODE_IP.octets())),
        snat_port_min: min,
        snat_port_max: max,
        flags,
        ct_source_share: 0,
    }
}

#[expect(
    clippy::too_many_lines,
    reason = "the fixture's maps, filled in the order the datapath looks them up"
)]
fn node_fixture() -> NodeFixture {
    let mut fx = fixture();
    let ns = ebpf_proxy_tests::netns::NetNs::create(&format!(
        "{}-xdp",
        ebpf_proxy_tests::netns::unique_stem()
    ))
    .expect("namespace for the FIB");
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
        vec!["addr", "add", "192.168.50.1/24", "dev", "up0"],
        vec!["link", "set", "up0p", "up"],
        vec!["link", "set", "up0", "up"],
        vec!["route", "add", "10.1.2.0/24", "via", "192.168.50.2"],
        vec!["route", "add", "192.168.60.0/24", "dev", "up0"],
    ] {
        ns.ip(&args).expect("uplink setup");
    }
    for (ip, mac) in [
        (PEER_NODE, PEER_MAC),
        (OUTSIDE, OUTSIDE_MAC),
        (OUTSIDE_DENIED, OUTSIDE_MAC),
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
    let uplink_index: u32 = ns
        .run(|| nix::net::if_::if_nametoindex("up0"))
        .expect("run in namespace")
        .expect("uplink ifindex");

    let addrs = proxy_userspace::planner::node::node_addrs(&[NODE_IP], &[]);
    for (&key, &value) in &addrs {
        fx.datapath
            .maps
            .apply(&MapOp::PutNodeAddr { key, value })
            .expect("node addresses");
    }
    fx.datapath
        .maps
        .apply(&MapOp::SetNodeConfig {
            config: node_config(proxy_common::SNAT_PORT_MIN, proxy_common::SNAT_PORT_MAX, 0),
        })
        .expect("node config");
    let remote = |fe: &mut Frontend| {
        for b in &mut fe.backends {
            b.local = false;
        }
    };
    let mut node_port = frontend(
        Ipv4Addr::UNSPECIFIED,
        NODE_PORT,
        Protocol::Tcp,
        &[REMOTE_POD],
        8080,
        NoEndpointAction::Reject,
    );
    node_port.kind = FrontendKind::NodePort;
    remote(&mut node_port);
    let mut local_only = frontend(
        Ipv4Addr::UNSPECIFIED,
        LOCAL_ONLY_NODE_PORT,
        Protocol::Tcp,
        &[],
        0,
        NoEndpointAction::Drop,
    );
    local_only.kind = FrontendKind::NodePort;
    let mut empty = frontend(
        Ipv4Addr::UNSPECIFIED,
        EMPTY_NODE_PORT,
        Protocol::Tcp,
        &[],
        0,
        NoEndpointAction::Reject,
    );
    empty.kind = FrontendKind::NodePort;
    let mut lb = frontend(
        LB_IP,
        80,
        Protocol::Tcp,
        &[REMOTE_POD],
        8080,
        NoEndpointAction::Reject,
    );
    lb.kind = FrontendKind::LoadBalancer;
    remote(&mut lb);
    lb.source_ranges = vec![proxy_userspace::model::Cidr::parse("192.168.50.100/32").unwrap()];
    for (i, fe) in [node_port, local_only, empty, lb].iter().enumerate() {
        let owner = ObjectKey {
            namespace: "test".into(),
            name: format!("ns{i}"),
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
    NodeFixture {
        fx,
        ns,
        uplink_index,
    }
}

/// `xdp_md` for a frame of `len` bytes arriving on `ifindex`.
fn xdp_md(len: usize, ifindex: u32) -> [u8; 24] {
    let mut md = [0u8; 24];
    md[4..8].copy_from_slice(&(len as u32).to_ne_bytes());
    md[12..16].copy_from_slice(&ifindex.to_ne_bytes());
    md
}

fn run_xdp(nf: &NodeFixture, input: &[u8]) -> (u32, Vec<u8>) {
    let program = nf.fx.datapath.xdp_program();
    nf.ns
        .run(|| {
            let mut out = vec![0u8; input.len() + 256];
            let md = xdp_md(input.len(), nf.uplink_index);
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

/// `__sk_buff` with only the interfaces set (what tc sees on the uplink).
fn skb_ctx(ifindex: u32) -> Vec<u8> {
    // struct __sk_buff is 192 bytes; ifindex at 40, ingress_ifindex at 36.
    let mut ctx = vec![0u8; 192];
    ctx[36..40].copy_from_slice(&ifindex.to_ne_bytes());
    ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
    ctx
}

fn run_tc_on_uplink(nf: &NodeFixture, input: &[u8]) -> (u32, Vec<u8>) {
    let program = nf.fx.datapath.tc_program();
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

/// A backend's connection from its serving port to a NodePort on the
/// node's address: the prefilter passes it for its source, conntrack does
/// not know it, and the NodePort's port bit sends it to the frontends,
/// which translate it.
#[test]
fn a_backends_connection_from_its_serving_port_to_a_nodeport_is_translated() {
    let nf = node_fixture();
    let syn = tcp(REMOTE_POD, 8080, NODE_IP, NODE_PORT, frame::SYN);
    let (_, out) = run_tc_on_uplink(&nf, &syn);
    let p = parse_checked(
        &out,
        "a backend's SYN from its serving port to the NodePort",
    );
    assert_eq!(
        (p.dst, p.dport),
        (REMOTE_POD, 8080),
        "a backend's SYN from its serving port to the NodePort was not sent to the backend"
    );
}

/// A NodePort's port bit is read only for a destination whose block holds
/// an address serving NodePorts (`proxy_common::prefilter::nodeports_bit`),
/// which the node's `NODE_ADDRS` entries set as they land and a rebuild sets
/// again from the map: after a rebuild the NodePort is still translated at
/// XDP and tc, while a packet with its port to another address of no
/// frontend is turned away before the port's bit is read.
#[test]
fn a_node_port_is_served_after_a_prefilter_rebuild() {
    use proxy_userspace::datapath::prefilter_rebuild;
    let nf = node_fixture();
    let prefilter = nf
        .fx
        .datapath
        .maps
        .prefilter
        .as_ref()
        .expect("the datapath has a prefilter");
    let node_bit = proxy_common::prefilter::nodeports_bit(&proxy_common::v4_mapped(
        u32::from_ne_bytes(NODE_IP.octets()),
    ));
    assert!(
        prefilter.holds(node_bit),
        "the node address's NODE_ADDRS entry landed without its block's bit"
    );
    prefilter_rebuild::rebuild(&nf.fx.datapath.maps)
        .expect("rebuilding the prefilter")
        .expect("the datapath has a prefilter");
    assert!(
        prefilter.holds(node_bit),
        "a rebuild cleared the bit of the node address's block"
    );
    let syn = tcp(OUTSIDE, 41050, NODE_IP, NODE_PORT, frame::SYN);
    let (ret, out) = run_xdp(&nf, &syn);
    assert_eq!(
        ret, XDP_REDIRECT,
        "NodePort SYN after a rebuild: XDP verdict"
    );
    let p = parse_checked(&out, "NodePort SYN after a rebuild");
    assert_eq!(
        (p.src, p.dst, p.dport),
        (NODE_IP, REMOTE_POD, 8080),
        "the NodePort SYN after a rebuild was not SNATed and DNATed at XDP"
    );
    let (_, out) = run_tc_on_uplink(&nf, &tcp(OUTSIDE, 41051, NODE_IP, NODE_PORT, frame::SYN));
    let p = parse_checked(&out, "NodePort SYN after a rebuild, tc");
    assert_eq!(
        (p.dst, p.dport),
        (REMOTE_POD, 8080),
        "the NodePort SYN after a rebuild was not DNATed at tc"
    );
    let elsewhere = tcp(OUTSIDE, 41052, REMOTE_POD, NODE_PORT, frame::SYN);
    let (ret, out) = run_xdp(&nf, &elsewhere);
    assert_eq!(
        (ret, out.as_slice()),
        (XDP_PASS, elsewhere.as_slice()),
        "a packet with the NodePort's port to a pod address was not passed untouched"
    );
}

/// ETP Cluster, remote backend: XDP SNATs to the node and DNATs to the pod,
/// routes the frame itself (next hop's MAC, TTL down by one) and sends it back
/// out; the reply is reverse-translated to the client the same way.
#[test]
fn xdp_nodeport_snat_both_ways() {
    let nf = node_fixture();
    let syn = tcp(OUTSIDE, 41000, NODE_IP, NODE_PORT, frame::SYN);
    let (ret, out) = run_xdp(&nf, &syn);
    assert_eq!(
        ret, XDP_REDIRECT,
        "NodePort SYN with a remote backend: XDP verdict"
    );
    let p = parse_checked(&out, "SNATed SYN");
    assert_eq!((p.src, p.dst, p.dport), (NODE_IP, REMOTE_POD, 8080));
    assert!(
        (proxy_common::SNAT_PORT_MIN..=proxy_common::SNAT_PORT_MAX).contains(&p.sport),
        "SNAT port {} outside the range",
        p.sport
    );
    assert_eq!(macs(&out), (PEER_MAC, UPLINK_MAC), "routed to node B's MAC");
    assert_eq!(out[22], syn[22] - 1, "TTL taken down by one");
    let snat_port = p.sport;

    let reply = tcp(
        REMOTE_POD,
        8080,
        NODE_IP,
        snat_port,
        frame::SYN | frame::ACK,
    );
    let (ret, out) = run_xdp(&nf, &reply);
    assert_eq!(ret, XDP_REDIRECT, "reply: XDP verdict");
    let r = parse_checked(&out, "reverse-translated reply");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (NODE_IP, NODE_PORT, OUTSIDE, 41000),
        "the reply must come from the NodePort and go back to the client"
    );
    assert_eq!(macs(&out), (OUTSIDE_MAC, UPLINK_MAC));

    let (ret, out) = run_xdp(&nf, &tcp(OUTSIDE, 41000, NODE_IP, NODE_PORT, frame::ACK));
    assert_eq!(ret, XDP_REDIRECT, "established packet");
    let p = parse_checked(&out, "established packet");
    assert_eq!((p.src, p.sport, p.dst), (NODE_IP, snat_port, REMOTE_POD));
    assert_eq!(counter(&nf.fx, "snat_new"), 1);
    assert_eq!(counter(&nf.fx, "xdp_tx"), 3);
}

/// A TCP segment other than a SYN to a NodePort that no flow here knows may be the
/// answer to a flow netfilter masqueraded to the NodePort's port (or a flow of a
/// socket of the node's own on it), and XDP and tc ask the kernel's conntrack, each
/// through its own kfunc. Unknown to netfilter too, it is translated as a new flow,
/// as ever; once netfilter holds its tuple as a flow's reply, an ACK and a SYN-ACK
/// of it are left untouched: by XDP to tc (`xdp_to_tc`), by tc to netfilter
/// (`netfilter_pass`); a SYN of the same tuple still starts a flow here.
#[test]
fn a_node_port_segment_no_flow_knows_is_asked_of_netfilter() {
    use proxy_userspace::adopt::conntrack as kernel_ct;
    const THEIRS: u16 = 7000;
    let nf = node_fixture();
    let (ret, out) = run_xdp(&nf, &tcp(OUTSIDE, 41500, NODE_IP, NODE_PORT, frame::ACK));
    assert_eq!(
        ret, XDP_REDIRECT,
        "an ACK to the NodePort netfilter does not know: XDP verdict"
    );
    let p = parse_checked(&out, "ACK netfilter does not know");
    assert_eq!((p.src, p.dst, p.dport), (NODE_IP, REMOTE_POD, 8080));

    let orig = kernel_ct::Tuple {
        proto: 6,
        src: IpAddr::V4(NODE_IP),
        dst: IpAddr::V4(OUTSIDE),
        sport: NODE_PORT,
        dport: THEIRS,
    };
    nf.ns
        .run(|| {
            kernel_ct::create(&kernel_ct::Entry {
                orig,
                reply: orig.inverted(),
                status: 0,
                timeout_s: 60,
                tcp_state: None,
                sctp: None,
                mark: 0,
            })
        })
        .expect("run in the node namespace")
        .unwrap_or_else(|e| panic!("netfilter's entry for {orig:?}: {e}"));
    for (i, (what, flags)) in [("ACK", frame::ACK), ("SYN-ACK", frame::SYN | frame::ACK)]
        .into_iter()
        .enumerate()
    {
        let answer = tcp(OUTSIDE, THEIRS, NODE_IP, NODE_PORT, flags);
        let (ret, out) = run_xdp(&nf, &answer);
        assert_eq!(
            (ret, out == answer),
            (XDP_PASS, true),
            "{what} netfilter has as a reply, at XDP: verdict, and whether it is untouched"
        );
        let (ret, out) = run_tc_on_uplink(&nf, &answer);
        assert_eq!(
            (ret, out == answer),
            (TC_PASS, true),
            "{what} netfilter has as a reply, at tc: verdict, and whether it is untouched"
        );
        let passed = i as u64 + 1;
        assert_eq!(
            (
                counter(&nf.fx, "xdp_to_tc"),
                counter(&nf.fx, "netfilter_pass")
            ),
            (passed, passed),
            "{what}: left to tc by XDP, and to netfilter by tc"
        );
    }
    let (ret, out) = run_tc_on_uplink(&nf, &tcp(OUTSIDE, THEIRS, NODE_IP, NODE_PORT, frame::SYN));
    assert_eq!(ret, TC_ACT_REDIRECT, "a SYN of netfilter's tuple: verdict");
    assert_eq!(parse_checked(&out, "SYN").dst, REMOTE_POD);
    assert_eq!(counter(&nf.fx, "netfilter_pass"), 2, "a SYN is never asked");
}

/// The same flow through tc (XDP off): translated alike, and redirected.
#[test]
fn tc_fallback_nodeport_snat_both_ways() {
    let nf = node_fixture();
    let syn = tcp(OUTSIDE, 42000, NODE_IP, NODE_PORT, frame::SYN);
    let (ret, out) = run_tc_on_uplink(&nf, &syn);
    assert_eq!(ret, TC_ACT_REDIRECT, "NodePort SYN at tc: verdict");
    let p = parse_checked(&out, "SNATed SYN at tc");
    assert_eq!((p.src, p.dst, p.dport), (NODE_IP, REMOTE_POD, 8080));
    assert_eq!(macs(&out), (PEER_MAC, UPLINK_MAC));
    assert_eq!(out[22], syn[22] - 1, "TTL taken down by one");
    let reply = tcp(REMOTE_POD, 8080, NODE_IP, p.sport, frame::SYN | frame::ACK);
    let (ret, out) = run_tc_on_uplink(&nf, &reply);
    assert_eq!(ret, TC_ACT_REDIRECT, "reply at tc");
    let r = parse_checked(&out, "reply at tc");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (NODE_IP, NODE_PORT, OUTSIDE, 42000)
    );
    assert_eq!(counter(&nf.fx, "xdp_tx"), 0);
}

/// Many new flows from one client to one backend: every SNAT port differs.
#[test]
fn snat_ports_of_concurrent_flows_differ() {
    let nf = node_fixture();
    let mut ports = std::collections::BTreeSet::new();
    for i in 0..500u16 {
        let (ret, out) = run_xdp(
            &nf,
            &tcp(OUTSIDE, 20000 + i, NODE_IP, NODE_PORT, frame::SYN),
        );
        assert_eq!(ret, XDP_REDIRECT, "flow {i}");
        let p = parse_checked(&out, "SNATed SYN");
        assert!(
            ports.insert(p.sport),
            "flow {i} got SNAT port {} again",
            p.sport
        );
    }
    assert_eq!(counter(&nf.fx, "snat_exhausted"), 0);
}

/// Source ranges, ETP Local without local endpoints, and no endpoints at all.
#[test]
fn xdp_drops_and_defers() {
    let nf = node_fixture();
    let (ret, _) = run_xdp(&nf, &tcp(OUTSIDE, 43000, LB_IP, 80, frame::SYN));
    assert_eq!(ret, XDP_REDIRECT, "allowed source to the LB IP");
    let (ret, _) = run_xdp(&nf, &tcp(OUTSIDE_DENIED, 43000, LB_IP, 80, frame::SYN));
    assert_eq!(ret, XDP_DROP, "source outside loadBalancerSourceRanges");
    assert_eq!(counter(&nf.fx, "drop_source_range"), 1);

    let (ret, _) = run_xdp(
        &nf,
        &tcp(OUTSIDE, 43001, NODE_IP, LOCAL_ONLY_NODE_PORT, frame::SYN),
    );
    assert_eq!(ret, XDP_DROP, "ETP Local without a local endpoint");

    // A reject needs a reply built and sent back: XDP leaves it to tc untouched.
    let syn = tcp(OUTSIDE, 43002, NODE_IP, EMPTY_NODE_PORT, frame::SYN);
    let (ret, out) = run_xdp(&nf, &syn);
    assert_eq!(
        (ret, out.as_slice()),
        (XDP_PASS, syn.as_slice()),
        "no endpoints: left to tc"
    );
    assert_eq!(counter(&nf.fx, "xdp_to_tc"), 1);

    // A port no frontend has, on the node's address: not ours.
    let other = tcp(OUTSIDE, 43003, NODE_IP, 22, frame::SYN);
    let (ret, out) = run_xdp(&nf, &other);
    assert_eq!((ret, out.as_slice()), (XDP_PASS, other.as_slice()));
}

/// `--nodeport-addresses` leaving the node's address out: its NodePorts are
/// not served there (the packet is the stack's), other frontends still are.
#[test]
fn nodeport_addresses_outside_the_flag_serve_no_node_ports() {
    let mut nf = node_fixture();
    let only = [proxy_userspace::model::Cidr::parse("10.0.0.0/8").unwrap()];
    let addrs = proxy_userspace::planner::node::node_addrs(&[NODE_IP], &only);
    for (&key, &value) in &addrs {
        nf.fx
            .datapath
            .maps
            .apply(&MapOp::PutNodeAddr { key, value })
            .expect("node addresses");
    }
    let syn = tcp(OUTSIDE, 44000, NODE_IP, NODE_PORT, frame::SYN);
    let (ret, out) = run_xdp(&nf, &syn);
    assert_eq!((ret, out.as_slice()), (XDP_PASS, syn.as_slice()), "XDP");
    let (ret, out) = run_tc_on_uplink(&nf, &syn);
    assert_eq!((ret, out.as_slice()), (TC_PASS, syn.as_slice()), "tc");
    let (ret, _) = run_xdp(&nf, &tcp(OUTSIDE, 44001, LB_IP, 80, frame::SYN));
    assert_eq!(
        ret, XDP_REDIRECT,
        "the LB IP is served whatever the flag says"
    );
}

/// Localhost NodePorts are for the node's own sockets: a packet from outside
/// addressed to a loopback address is the stack's to drop as martian, never a
/// NodePort (CVE-2020-8558), whatever `--localhost-nodeports` says.
#[test]
fn a_packet_from_outside_to_a_loopback_address_is_never_a_node_port() {
    let mut nf = node_fixture();
    nf.fx
        .datapath
        .maps
        .apply(&MapOp::SetNodeConfig {
            config: node_config(
                proxy_common::SNAT_PORT_MIN,
                proxy_common::SNAT_PORT_MAX,
                proxy_common::node_config_flags::LOCALHOST_NODEPORTS,
            ),
        })
        .expect("node config with localhost NodePorts");
    for (i, dst) in [Ipv4Addr::LOCALHOST, Ipv4Addr::new(127, 1, 2, 3)]
        .into_iter()
        .enumerate()
    {
        let syn = tcp(OUTSIDE, 44000 + i as u16, dst, NODE_PORT, frame::SYN);
        let (ret, out) = run_xdp(&nf, &syn);
        assert_eq!(
            (ret, out.as_slice()),
            (XDP_PASS, syn.as_slice()),
            "XDP translated a packet from outside to {dst}:{NODE_PORT}"
        );
        let (ret, out) = run_tc_on_uplink(&nf, &syn);
        assert_eq!(
            (ret, out.as_slice()),
            (TC_PASS, syn.as_slice()),
            "tc translated a packet from outside to {dst}:{NODE_PORT}"
        );
    }
    let (ret, _) = run_xdp(&nf, &tcp(OUTSIDE, 44010, NODE_IP, NODE_PORT, frame::SYN));
    assert_eq!(
        ret, XDP_REDIRECT,
        "the node's address still serves the NodePort"
    );
}

/// Sets the conntrack timeouts of a closed TCP flow: `TIME_WAIT` (after a
/// FIN each way) and `CLOSE` (after an RST).
fn closed_timeouts(fx: &mut Fixture, time_wait: Duration, close: Duration) {
    let ns = |d: Duration| u64::try_from(d.as_nanos()).expect("a short timeout");
    set_timeouts(
        fx,
        proxy_common::CtTimeouts {
            tcp_time_wait_ns: ns(time_wait),
            tcp_close_ns: ns(close),
            ..proxy_common::CtTimeouts::DEFAULT
        },
    );
}

/// SNAT ports run out, and come back once their flows close: a reset flow
/// frees its port once its closing timeout (netfilter's `CLOSE`, 1 s here)
/// has passed, long before an established entry would expire.
#[test]
fn snat_ports_exhaust_then_come_back_from_closed_flows() {
    let mut nf = node_fixture();
    closed_timeouts(&mut nf.fx, Duration::from_mins(2), Duration::from_secs(1));
    nf.fx
        .datapath
        .maps
        .apply(&MapOp::SetNodeConfig {
            config: node_config(1024, 1027, 0),
        })
        .expect("a four-port SNAT range");
    let mut ports = std::collections::BTreeSet::new();
    let mut client_port = 45000u16;
    // Random tries can miss the last free port: keep opening flows until
    // all four are taken. Each flow's backend answers at once: an answered
    // flow keeps its port (one never answered gives it up to a new flow,
    // see `a_snat_port_held_by_a_flow_never_answered_goes_to_a_new_flow`).
    while ports.len() < 4 && client_port < 45200 {
        let (ret, out) = run_xdp(
            &nf,
            &tcp(OUTSIDE, client_port, NODE_IP, NODE_PORT, frame::SYN),
        );
        if ret == XDP_REDIRECT {
            let port = parse_checked(&out, "SNATed SYN").sport;
            ports.insert(port);
            let answer = tcp(REMOTE_POD, 8080, NODE_IP, port, frame::SYN | frame::ACK);
            let (ret, _) = run_xdp(&nf, &answer);
            assert_eq!(
                ret, XDP_REDIRECT,
                "the backend's answer on SNAT port {port}"
            );
        }
        client_port += 1;
    }
    assert_eq!(
        ports,
        (1024..=1027).collect(),
        "the four ports of the range"
    );
    let (ret, _) = run_xdp(&nf, &tcp(OUTSIDE, 46000, NODE_IP, NODE_PORT, frame::SYN));
    assert_eq!(ret, XDP_DROP, "no free SNAT port: dropped");
    assert_eq!(
        counter(&nf.fx, "snat_reclaimed"),
        0,
        "an answered flow's port taken"
    );
    assert!(counter(&nf.fx, "snat_exhausted") > 0);
    let node_port_id = service_id_of(&nf.fx.datapath.maps, Ipv4Addr::UNSPECIFIED, NODE_PORT);
    let exhausted = service_totals(&nf.fx.datapath.maps, node_port_id).dropped
        [proxy_common::service_drop::SNAT_EXHAUSTED as usize];
    assert_eq!(
        exhausted,
        counter(&nf.fx, "snat_exhausted"),
        "the NodePort's drops for want of a SNAT port: every one of the node's"
    );

    // Every flow that got a port is reset by its client.
    for p in 45000..client_port {
        run_xdp(
            &nf,
            &tcp(OUTSIDE, p, NODE_IP, NODE_PORT, frame::RST | frame::ACK),
        );
    }
    let (ret, _) = run_xdp(&nf, &tcp(OUTSIDE, 46001, NODE_IP, NODE_PORT, frame::SYN));
    assert_eq!(
        ret, XDP_DROP,
        "closed only just now: the ports are still held"
    );
    // The point: a reset flow's SNAT port is held for its closing timeout.
    std::thread::sleep(Duration::from_millis(1_200));
    let (ret, out) = run_xdp(&nf, &tcp(OUTSIDE, 46002, NODE_IP, NODE_PORT, frame::SYN));
    assert_eq!(ret, XDP_REDIRECT, "a closed flow's port is free again");
    let p = parse_checked(&out, "SNATed SYN on a reused port");
    assert!(
        ports.contains(&p.sport),
        "port {} not from the range",
        p.sport
    );
    let reply = tcp(REMOTE_POD, 8080, NODE_IP, p.sport, frame::SYN | frame::ACK);
    let (ret, out) = run_xdp(&nf, &reply);
    assert_eq!(ret, XDP_REDIRECT);
    let r = parse_checked(&out, "reply on the reused port");
    assert_eq!(
        (r.dst, r.dport),
        (OUTSIDE, 46002),
        "the reused port's replies must go to the new flow's client"
    );
}

/// A flow closed by a FIN each way holds its SNAT port for netfilter's
/// `TIME_WAIT` (4 s here, 120 s by default): a straggler of it, or the
/// backend's retransmitted FIN, must not reach another client given the
/// port. Only then does the port go to a new flow. One SNAT port makes
/// every choice certain.
#[test]
fn a_snat_port_closed_by_fins_waits_out_time_wait() {
    let mut nf = node_fixture();
    let time_wait = Duration::from_secs(4);
    closed_timeouts(&mut nf.fx, time_wait, Duration::from_secs(1));
    nf.fx
        .datapath
        .maps
        .apply(&MapOp::SetNodeConfig {
            config: node_config(1024, 1024, 0),
        })
        .expect("a one-port SNAT range");
    let client = |nf: &NodeFixture, flags: u8, what: &str| {
        let (ret, out) = run_xdp(nf, &tcp(OUTSIDE, 45000, NODE_IP, NODE_PORT, flags));
        assert_eq!(ret, XDP_REDIRECT, "{what}: not SNATed and sent on");
        parse_checked(&out, what).sport
    };
    let backend = |nf: &NodeFixture, flags: u8, what: &str| {
        let (ret, out) = run_xdp(nf, &tcp(REMOTE_POD, 8080, NODE_IP, 1024, flags));
        assert_eq!(ret, XDP_REDIRECT, "{what}: not translated back");
        let r = parse_checked(&out, what);
        assert_eq!(
            (r.dst, r.dport),
            (OUTSIDE, 45000),
            "{what}: not to the client"
        );
    };
    assert_eq!(client(&nf, frame::SYN, "SYN"), 1024);
    backend(&nf, frame::SYN | frame::ACK, "SYN-ACK");
    client(&nf, frame::ACK, "ACK");
    client(&nf, frame::FIN | frame::ACK, "client's FIN");
    backend(&nf, frame::FIN | frame::ACK, "backend's FIN");
    let closed = Instant::now();
    client(&nf, frame::ACK, "last ACK");
    let other = |nf: &NodeFixture, sport: u16| {
        run_xdp(nf, &tcp(OUTSIDE, sport, NODE_IP, NODE_PORT, frame::SYN)).0
    };
    assert_eq!(other(&nf, 45001), XDP_DROP, "closed just now: port held");
    // The point: past the second a closed flow's port used to wait.
    std::thread::sleep(Duration::from_millis(1_500));
    assert!(
        closed.elapsed() < time_wait,
        "the machine stalled past TIME_WAIT; the check below means nothing"
    );
    assert_eq!(
        other(&nf, 45002),
        XDP_DROP,
        "a closed flow's SNAT port went to another client inside TIME_WAIT"
    );
    backend(
        &nf,
        frame::FIN | frame::ACK,
        "the backend's FIN, retransmitted",
    );
    std::thread::sleep(time_wait + Duration::from_millis(500));
    assert_eq!(
        other(&nf, 45003),
        XDP_REDIRECT,
        "the port is free once TIME_WAIT has passed"
    );
}

/// A flood of SYNs whose backend never answers holds every SNAT port: a new
/// flow's last try takes the port of such a flow (counted
/// `snat_reclaimed`), as netfilter drops its unassured entries first, and
/// the port's replies then reach the new flow's client; a flow that was
/// answered keeps its port. One SNAT port makes every choice certain.
#[test]
fn a_snat_port_held_by_a_flow_never_answered_goes_to_a_new_flow() {
    let mut nf = node_fixture();
    nf.fx
        .datapath
        .maps
        .apply(&MapOp::SetNodeConfig {
            config: node_config(1024, 1024, 0),
        })
        .expect("a one-port SNAT range");
    let snat_port_of = |nf: &NodeFixture, client_port: u16, what: &str| {
        let syn = tcp(OUTSIDE, client_port, NODE_IP, NODE_PORT, frame::SYN);
        let (ret, out) = run_xdp(nf, &syn);
        assert_eq!(ret, XDP_REDIRECT, "{what}: not SNATed and sent on");
        parse_checked(&out, what).sport
    };
    assert_eq!(snat_port_of(&nf, 45000, "a SYN never answered"), 1024);
    assert_eq!(
        snat_port_of(&nf, 45001, "another client's SYN"),
        1024,
        "the unanswered flow's port"
    );
    assert_eq!(counter(&nf.fx, "snat_reclaimed"), 1);
    assert_eq!(counter(&nf.fx, "snat_exhausted"), 0);
    let answer = tcp(REMOTE_POD, 8080, NODE_IP, 1024, frame::SYN | frame::ACK);
    let (ret, out) = run_xdp(&nf, &answer);
    assert_eq!(ret, XDP_REDIRECT, "the backend's answer on the taken port");
    let r = parse_checked(&out, "the answer on the taken port");
    assert_eq!(
        (r.dst, r.dport),
        (OUTSIDE, 45001),
        "the taken port's replies must reach the new flow's client"
    );
    // Answered now: a third client is refused rather than take it.
    let (ret, _) = run_xdp(&nf, &tcp(OUTSIDE, 45002, NODE_IP, NODE_PORT, frame::SYN));
    assert_eq!(ret, XDP_DROP, "an answered flow's port taken");
    assert_eq!(counter(&nf.fx, "snat_reclaimed"), 1);
    assert!(counter(&nf.fx, "snat_exhausted") > 0);
}

/// Taking a closed flow's SNAT port back removes that flow's forward entry
/// too, but only while the entry is still that flow's: the old reply entry
/// names the client's port, which the client may have opened a newer
/// connection from since (a client cycles through its ports in a second or
/// two at a few thousand connections a second), and that connection's entry
/// has the same key. One SNAT port at a time makes every choice certain.
#[test]
fn reclaiming_a_snat_port_spares_the_newer_flow_from_the_same_client_port() {
    let mut nf = node_fixture();
    closed_timeouts(&mut nf.fx, Duration::from_mins(2), Duration::from_secs(1));
    let only_port = |nf: &mut NodeFixture, port: u16| {
        nf.fx
            .datapath
            .maps
            .apply(&MapOp::SetNodeConfig {
                config: node_config(port, port, 0),
            })
            .expect("a one-port SNAT range");
    };
    let snat_port_of = |nf: &NodeFixture, frame: &[u8], what: &str| {
        let (ret, out) = run_xdp(nf, frame);
        assert_eq!(ret, XDP_REDIRECT, "{what}: not SNATed and sent on");
        parse_checked(&out, what).sport
    };
    // The first connection from client port 45000 gets SNAT port 1024 and is
    // reset; once its closing timeout (1 s here) has passed, its port is
    // free to take back.
    only_port(&mut nf, 1024);
    let first = snat_port_of(
        &nf,
        &tcp(OUTSIDE, 45000, NODE_IP, NODE_PORT, frame::SYN),
        "first connection's SYN",
    );
    assert_eq!(first, 1024);
    run_xdp(
        &nf,
        &tcp(OUTSIDE, 45000, NODE_IP, NODE_PORT, frame::RST | frame::ACK),
    );
    // The point: the reset flow's SNAT port is held for its closing timeout.
    std::thread::sleep(Duration::from_millis(1_200));
    // The client opens its next connection from the same port: SNAT port 1025.
    only_port(&mut nf, 1025);
    let newer = snat_port_of(
        &nf,
        &tcp(OUTSIDE, 45000, NODE_IP, NODE_PORT, frame::SYN),
        "newer connection's SYN",
    );
    assert_eq!(newer, 1025);
    // Another client's connection takes port 1024 back.
    only_port(&mut nf, 1024);
    let other = snat_port_of(
        &nf,
        &tcp(OUTSIDE, 45001, NODE_IP, NODE_PORT, frame::SYN),
        "other client's SYN",
    );
    assert_eq!(other, 1024, "the first connection's port, free again");
    // The newer connection goes on from its own port.
    let (ret, out) = run_xdp(&nf, &tcp(OUTSIDE, 45000, NODE_IP, NODE_PORT, frame::ACK));
    assert_eq!(
        ret, XDP_REDIRECT,
        "the newer connection's ACK was not translated (its forward entry went with the first connection's port)"
    );
    let ack = parse_checked(&out, "newer connection's ACK");
    assert_eq!(
        (ack.dst, ack.sport),
        (REMOTE_POD, 1025),
        "the newer connection's ACK left for {}:{} from SNAT port {}",
        ack.dst,
        ack.dport,
        ack.sport
    );
}

/// A client opening a new connection from the port of one it just reset
/// (as the NodePort bench's client does, a few thousand connections a
/// second) gets the reset flow's SNAT port again: the SYN that opens the
/// closed tuple again ends the old flow whole, reply entry and all, as
/// netfilter kills a closed entry a SYN reopens, rather than leave its
/// port held for the closing timeout beside the new flow's. One SNAT port
/// makes every choice certain: without that, the second connection finds
/// its only port held and is dropped.
#[test]
fn a_client_port_opened_again_takes_its_reset_flows_snat_port() {
    let mut nf = node_fixture();
    nf.fx
        .datapath
        .maps
        .apply(&MapOp::SetNodeConfig {
            config: node_config(1024, 1024, 0),
        })
        .expect("a one-port SNAT range");
    for round in 0..3 {
        let port = nf
            .ns
            .run(|| reset_connection(&nf, 45000))
            .expect("run in the node namespace");
        assert_eq!(
            port,
            Some(1024),
            "connection {round} from client port 45000 (snat_exhausted {})",
            counter(&nf.fx, "snat_exhausted")
        );
    }
    assert_eq!(counter(&nf.fx, "snat_exhausted"), 0);
    // The last connection holds the port until its closing timeout: no
    // other client shares it.
    let (ret, _) = run_xdp(&nf, &tcp(OUTSIDE, 45001, NODE_IP, NODE_PORT, frame::SYN));
    assert_eq!(
        ret, XDP_DROP,
        "another client port took the SNAT port of a flow reset just now"
    );
    let (own, orphaned) = snat_port_holders(&nf);
    assert_eq!(
        (own, orphaned),
        (1, 0),
        "SNATed reply entries (of the client port's latest flow, of older ones)"
    );
}

/// The SYN that opens a closed flow's tuple again removes that flow's reply
/// entry only while it is still the flow's: one that rewrites replies to
/// another client port (here rewritten so behind the datapath's back, as
/// only a test would) is another flow's, whose SNAT port stays held.
#[test]
fn a_client_port_opened_again_spares_a_reply_entry_no_longer_its_flows() {
    let mut nf = node_fixture();
    nf.fx
        .datapath
        .maps
        .apply(&MapOp::SetNodeConfig {
            config: node_config(1024, 1024, 0),
        })
        .expect("a one-port SNAT range");
    let port = nf
        .ns
        .run(|| reset_connection(&nf, 45000))
        .expect("run in the node namespace");
    assert_eq!(port, Some(1024), "the first connection's SNAT port");
    let reply_key = ct_key(REMOTE_POD, 8080, NODE_IP, 1024, frame::TCP);
    let conntrack = &mut nf.fx.datapath.maps.conntrack;
    let mut reply = conntrack.get(&reply_key, 0).expect("the reply entry");
    reply.alt_port_be = 45002u16.to_be();
    conntrack
        .insert(reply_key, reply, 0)
        .expect("rewriting the reply entry");
    let (ret, _) = run_xdp(&nf, &tcp(OUTSIDE, 45000, NODE_IP, NODE_PORT, frame::SYN));
    assert_eq!(
        ret, XDP_DROP,
        "the SNAT port of another flow's reply entry went to a reopened client port"
    );
    let left = nf.fx.datapath.maps.conntrack.get(&reply_key, 0);
    assert!(
        left.as_ref()
            .is_ok_and(|r| r.alt_port_be == 45002u16.to_be()),
        "another flow's reply entry was removed by a reopening SYN: {left:?}"
    );
}

/// `run_xdp`'s test run for a caller already inside the node's namespace:
/// a workload of many packets enters it once.
fn xdp_here(nf: &NodeFixture, input: &[u8]) -> (u32, Vec<u8>) {
    let mut out = vec![0u8; input.len() + 256];
    let md = xdp_md(input.len(), nf.uplink_index);
    let mut opts = TestRunOptions::new();
    opts.data_in = Some(input);
    opts.data_out = Some(&mut out);
    opts.ctx_in = Some(&md);
    let result = nf
        .fx
        .datapath
        .xdp_program()
        .test_run(opts)
        .expect("XDP test run");
    out.truncate(result.data_size_out as usize);
    (result.return_value, out)
}

/// One connection of the NodePort bench's workload from `client_port`:
/// SYN, the backend's SYN-ACK, the ACK, and the client's RST. Its SNAT
/// port, or None when the SYN was dropped for want of one.
fn reset_connection(nf: &NodeFixture, client_port: u16) -> Option<u16> {
    let (ret, out) = xdp_here(
        nf,
        &tcp(OUTSIDE, client_port, NODE_IP, NODE_PORT, frame::SYN),
    );
    if ret == XDP_DROP {
        return None;
    }
    assert_eq!(ret, XDP_REDIRECT, "SYN from client port {client_port}");
    let port = parse_checked(&out, "SNATed SYN").sport;
    let answer = tcp(REMOTE_POD, 8080, NODE_IP, port, frame::SYN | frame::ACK);
    let (ret, out) = xdp_here(nf, &answer);
    assert_eq!(ret, XDP_REDIRECT, "SYN-ACK on SNAT port {port}");
    let r = parse_checked(&out, "SYN-ACK");
    assert_eq!(
        (r.dst, r.dport),
        (OUTSIDE, client_port),
        "SNAT port {port}'s SYN-ACK went to the wrong client port"
    );
    for flags in [frame::ACK, frame::RST | frame::ACK] {
        let (ret, _) = xdp_here(nf, &tcp(OUTSIDE, client_port, NODE_IP, NODE_PORT, flags));
        assert_eq!(
            ret, XDP_REDIRECT,
            "client port {client_port}, flags {flags:#x}"
        );
    }
    Some(port)
}

/// What holds the SNAT ports of `CONNTRACK`'s SNATed reply entries:
/// (the flow its client port's forward entry is, a flow whose client port
/// has opened a newer connection since).
fn snat_port_holders(nf: &NodeFixture) -> (usize, usize) {
    let conntrack = &nf.fx.datapath.maps.conntrack;
    let entries: std::collections::HashMap<_, _> = conntrack
        .iter()
        .map(|e| e.expect("reading CONNTRACK"))
        .collect();
    let (mut own, mut orphaned) = (0, 0);
    for (key, value) in &entries {
        if value.dir != proxy_common::ct_dir::REPLY || value.flags & ct_flags::SNAT == 0 {
            continue;
        }
        let forward_key = proxy_common::CtKey::new(
            value.alt_addr_be,
            value.nat_addr_be,
            value.alt_port_be,
            value.nat_port_be,
            key.proto,
        );
        match entries.get(&forward_key) {
            Some(f) if f.alt_port_be == key.dport_be => own += 1,
            _ => orphaned += 1,
        }
    }
    (own, orphaned)
}

/// The NodePort bench's workload at its rate: one client, 8 threads of
/// connect, request, response, RST to one backend, its kernel handing out
/// the even ports of 32768-60999 in turn (14,116 of them), about 20,000
/// connections inside one `CLOSE` timeout. Each reset flow holds its SNAT
/// port for that timeout; a client port used again before then must not
/// leave its old flow's port held beside its new one, or the range fills
/// and random tries miss (`snat_exhausted`). What is certain is asserted
/// exactly: no port held by an older flow of a reused client port, one held
/// by each client port's latest flow. A fresh port is still drawn at random
/// (16 tries) while the range fills to half, which misses about once in
/// 100,000 draws: a miss or two is allowed, counted, and printed.
#[test]
fn the_nodeport_bench_workload_never_runs_out_of_snat_ports() {
    let mut nf = node_fixture();
    // No flow's closing timeout passes while the workload runs.
    closed_timeouts(&mut nf.fx, Duration::from_mins(2), Duration::from_mins(2));
    let client_ports: Vec<u16> = (32768..=60999).step_by(2).collect();
    let connections = 20_000;
    let (dropped, ports) = nf
        .ns
        .run(|| {
            let mut dropped = 0;
            let mut ports = std::collections::HashMap::new();
            for &client_port in client_ports.iter().cycle().take(connections) {
                if let Some(port) = reset_connection(&nf, client_port) {
                    ports.insert(client_port, port);
                } else {
                    // Its earlier flow ended with this SYN: no port is its.
                    dropped += 1;
                    ports.remove(&client_port);
                }
            }
            (dropped, ports)
        })
        .expect("run in the node namespace");
    let (own, orphaned) = snat_port_holders(&nf);
    let exhausted = counter(&nf.fx, "snat_exhausted");
    println!(
        "{connections} connections from {} client ports: {dropped} dropped, snat_exhausted \
         {exhausted}; SNAT ports held by reply entries: {own} of their client port's latest \
         flow, {orphaned} of an older flow of a client port opened again",
        client_ports.len()
    );
    assert_eq!(
        orphaned, 0,
        "SNAT ports still held by flows whose client port opened a new connection \
         ({own} held by latest flows; {dropped} connections dropped, snat_exhausted {exhausted})"
    );
    assert!(
        dropped == exhausted && dropped <= 2,
        "{dropped} connections dropped, snat_exhausted {exhausted}: more than random tries \
         miss at half the range ({own} ports held by latest flows)"
    );
    assert_eq!(
        own,
        ports.len(),
        "reply entries holding a SNAT port, against client ports whose latest connection got \
         one ({} client ports)",
        client_ports.len()
    );
}

/// The reaper's removals go through `ct_reap`, which removes an entry only if it is
/// still expired: an entry a new flow took since the reaper read it as expired (here,
/// one live when handed over) stays, in each of the four conntrack maps; an expired
/// one goes; a key with no entry is passed over. More keys than one frame carries
/// (`ct_reap::MAX_KEYS`) go in several runs.
#[test]
fn the_reapers_removal_spares_an_entry_that_is_live_again() {
    use proxy_common::{Ct6Key, Ct6Value, ct_reap};
    let mut fx = fixture();
    let now = conntrack::monotonic_ns();
    let value = |last_seen_ns| CtValue {
        last_seen_ns,
        ..Default::default()
    };
    let value6 = |last_seen_ns| Ct6Value {
        last_seen_ns,
        ..Default::default()
    };
    let key = |i: u32| ct_key(Ipv4Addr::from(0x0a64_0000 + i), 40000, VIP, 80, 17);
    let key6 = |i: u32| {
        Ct6Key::new(
            [0xfd00_0000u32.to_be(), 0, 0, (0x100 + i).to_be()],
            [0xfd00_0000u32.to_be(), 0, 0, 0x80u32.to_be()],
            40000u16.to_be(),
            80u16.to_be(),
            17,
        )
    };
    // Key 0 live, keys 1..=150 expired, key 151 never inserted.
    const EXPIRED: u32 = 150;
    let maps = &mut fx.datapath.maps;
    for i in 0..=EXPIRED {
        let seen = if i == 0 { now } else { 1 };
        maps.conntrack
            .insert(key(i), value(seen), 0)
            .expect("insert");
        maps.ct_new.insert(key(i), value(seen), 0).expect("insert");
        let conntrack6 = maps.conntrack6.as_mut().expect("CONNTRACK6");
        conntrack6.insert(key6(i), value6(seen), 0).expect("insert");
        let ct_new6 = maps.ct_new6.as_mut().expect("CT_NEW6");
        ct_new6.insert(key6(i), value6(seen), 0).expect("insert");
    }
    let keys: Vec<_> = (0..=EXPIRED + 1).map(key).collect();
    let keys6: Vec<_> = (0..=EXPIRED + 1).map(key6).collect();
    let (_, reap) = fx.datapath.conntrack_reaping();
    let removed = [
        reap.remove_expired(ct_reap::map::CONNTRACK, &keys, now),
        reap.remove_expired(ct_reap::map::CT_NEW, &keys, now),
        reap.remove_expired(ct_reap::map::CONNTRACK6, &keys6, now),
        reap.remove_expired(ct_reap::map::CT_NEW6, &keys6, now),
    ]
    .map(|r| r.expect("ct_reap runs"));
    assert_eq!(
        removed, [EXPIRED as usize; 4],
        "CONNTRACK, CT_NEW, CONNTRACK6, CT_NEW6: each should lose its {EXPIRED} expired \
         entries, and neither the live one nor the key with no entry"
    );
    let maps = &fx.datapath.maps;
    let left = (
        maps.conntrack
            .keys()
            .map(|k| k.expect("key"))
            .collect::<Vec<_>>(),
        maps.ct_new
            .keys()
            .map(|k| k.expect("key"))
            .collect::<Vec<_>>(),
        maps.conntrack6
            .as_ref()
            .expect("CONNTRACK6")
            .keys()
            .map(|k| k.expect("key"))
            .collect::<Vec<_>>(),
        maps.ct_new6
            .as_ref()
            .expect("CT_NEW6")
            .keys()
            .map(|k| k.expect("key"))
            .collect::<Vec<_>>(),
    );
    assert_eq!(
        left,
        (vec![key(0)], vec![key(0)], vec![key6(0)], vec![key6(0)]),
        "only the live entry should be left in each map"
    );
}

/// The reaper reads and deletes conntrack in batches. Over more entries than a
/// batch holds, expired and live interleaved, exactly the expired ones go; and
/// a batch delete naming keys already gone skips them and deletes the rest.
#[test]
fn reaper_removes_exactly_the_expired_entries_of_a_large_table() {
    use aya::maps::IterableMap;
    use proxy_userspace::datapath::batch;
    let mut fx = fixture();
    let now = conntrack::monotonic_ns();
    let key = |i: u32| ct_key(Ipv4Addr::from(0x0a64_0000 + i), 40000, VIP, 80, 6);
    const N: u32 = 10_000;
    for i in 0..N {
        let seen = if i % 2 == 0 { 1 } else { now };
        let value = CtValue {
            last_seen_ns: seen,
            ..Default::default()
        };
        fx.datapath
            .maps
            .conntrack
            .insert(key(i), value, 0)
            .expect("insert");
    }
    let reaped = reap_expired(&mut fx, now);
    assert_eq!(
        reaped,
        N as usize / 2,
        "entries reaped of {N}, half expired"
    );
    let left: std::collections::HashSet<proxy_common::CtKey> = fx
        .datapath
        .maps
        .conntrack
        .keys()
        .map(|k| k.expect("key"))
        .collect();
    let live: std::collections::HashSet<proxy_common::CtKey> =
        (0..N).filter(|i| i % 2 == 1).map(key).collect();
    assert!(
        left == live,
        "{} entries left, {} live ones expected",
        left.len(),
        live.len()
    );

    let map = fx.datapath.maps.conntrack.map();
    let deleted = batch::delete(map, &[key(1), key(0), key(3), key(2)]).expect("delete");
    assert_eq!(deleted, 2, "keys 1 and 3 exist, 0 and 2 were reaped");
    for i in [1, 3] {
        assert!(
            fx.datapath.maps.conntrack.get(&key(i), 0).is_err(),
            "key {i} not deleted"
        );
    }
}

/// A datagram of `len` payload bytes from `src` to `dst`, as fragments of at most
/// 1,480 payload bytes (a 1,500-byte MTU) under identification `id`.
fn fragmented(
    proto: u8,
    (src, sport): (Ipv4Addr, u16),
    (dst, dport): (Ipv4Addr, u16),
    len: usize,
    id: u16,
) -> Vec<Vec<u8>> {
    let whole = build(&Spec {
        src,
        dst,
        sport,
        dport,
        proto,
        tcp_flags: frame::ACK,
        payload: (0..len).map(|i| (i % 251) as u8).collect(),
        udp_no_csum: false,
    });
    frame::fragment(&whole, 1480, id)
}

/// Runs `fragments` in order through `run_one`, each expected to be passed on with
/// `verdict` at its own length; returns what left.
fn run_fragments(
    fragments: &[Vec<u8>],
    verdict: u32,
    what: &str,
    run_one: impl Fn(&[u8]) -> (u32, Vec<u8>),
) -> Vec<Vec<u8>> {
    fragments
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let (ret, out) = run_one(f);
            assert_eq!(ret, verdict, "{what}: fragment {i}: verdict");
            assert_eq!(out.len(), f.len(), "{what}: fragment {i}: length changed");
            out
        })
        .collect()
}

/// Fragmented UDP through a ClusterIP, both ways (tc): every fragment of the request
/// goes to the one backend its first fragment chose, every fragment of the answer
/// comes back from the ClusterIP, and the datagrams the receivers reassemble carry
/// valid UDP checksums (updated in the first fragment for the whole datagram).
#[test]
fn fragmented_udp_is_translated_by_its_first_fragment_both_ways() {
    let fx = fixture();
    let request = fragmented(frame::UDP, (CLIENT, 40000), (VIP, 53), 3000, 0x4242);
    assert_eq!(request.len(), 3, "3,000 bytes in 1,480-byte fragments");
    let out = run_fragments(&request, TC_PASS, "request", |f| run(&fx, f));
    let p = parse_checked(&frame::reassemble(&out, "request"), "reassembled request");
    assert!(BACKENDS.contains(&p.dst), "request sent to {}", p.dst);
    assert_eq!((p.src, p.sport, p.dport), (CLIENT, 40000, 5353));

    let answer = fragmented(frame::UDP, (p.dst, 5353), (CLIENT, 40000), 3000, 0x0077);
    let out = run_fragments(&answer, TC_PASS, "answer", |f| run(&fx, f));
    let r = parse_checked(&frame::reassemble(&out, "answer"), "reassembled answer");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (VIP, 53, CLIENT, 40000),
        "the answer must come from the ClusterIP"
    );
    assert_eq!(
        counter(&fx, "frag_translated"),
        4,
        "later fragments translated"
    );
    assert_eq!(counter(&fx, "frag_untracked"), 0);
}

/// A later fragment is never translated by a guess: one that arrives before its
/// first fragment, or belongs to a datagram that is no Service's, passes untouched
/// and is counted; once its first fragment has been translated, it follows.
#[test]
fn later_fragments_without_a_translated_first_one_pass_untouched_and_are_counted() {
    let fx = fixture();
    let early = fragmented(frame::UDP, (CLIENT, 40001), (VIP, 53), 3000, 0x4343);
    let (ret, out) = run(&fx, &early[1]);
    assert_eq!(
        (ret, &out),
        (TC_PASS, &early[1]),
        "a later fragment before its first one"
    );
    assert_eq!(counter(&fx, "frag_untracked"), 1);
    let (_, first) = run(&fx, &early[0]);
    let backend = &first[14 + 16..14 + 20];
    assert!(
        BACKENDS.iter().any(|b| b.octets() == backend),
        "first fragment sent to {backend:?}"
    );
    let (_, late) = run(&fx, &early[1]);
    assert_eq!(
        &late[14 + 16..14 + 20],
        backend,
        "the same fragment once its first one was translated"
    );

    let elsewhere = Ipv4Addr::new(10, 200, 0, 99);
    let other = fragmented(frame::UDP, (CLIENT, 40002), (elsewhere, 53), 3000, 0x4444);
    for (i, f) in other.iter().enumerate() {
        let (ret, out) = run(&fx, f);
        assert_eq!(
            (ret, &out),
            (TC_PASS, f),
            "fragment {i} of a datagram to no Service"
        );
    }
    assert_eq!(counter(&fx, "frag_untracked"), 3);
    assert_eq!(counter(&fx, "frag_translated"), 1);
}

/// A backend reaching itself through its Service with a fragmented datagram: every
/// fragment gets the hairpin source and the backend's address, both ways.
#[test]
fn fragmented_hairpin_flows_are_snated_both_ways() {
    let fx = fixture();
    let pod = BACKENDS[0];
    let request = fragmented(frame::TCP, (pod, 40100), (HAIRPIN_VIP, 80), 3000, 0x5151);
    let out = run_fragments(&request, TC_PASS, "hairpin request", |f| run(&fx, f));
    let p = parse_checked(
        &frame::reassemble(&out, "hairpin request"),
        "hairpin request",
    );
    assert_eq!(
        (p.src, p.dst, p.dport),
        (HAIRPIN_SRC, pod, 8080),
        "hairpin request"
    );
    let answer = fragmented(
        frame::TCP,
        (pod, 8080),
        (HAIRPIN_SRC, p.sport),
        3000,
        0x5252,
    );
    let out = run_fragments(&answer, TC_PASS, "hairpin answer", |f| run(&fx, f));
    let r = parse_checked(&frame::reassemble(&out, "hairpin answer"), "hairpin answer");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (HAIRPIN_VIP, 80, pod, 40100)
    );
}

/// Fragmented traffic from outside to a NodePort whose backend is on another node,
/// through XDP: SNAT on the first fragment, the later ones translated and routed
/// alike (same next hop, TTL down by one), and the answer's fragments back to the
/// client from the NodePort.
#[test]
fn xdp_translates_and_routes_every_fragment_of_a_snated_flow() {
    let nf = node_fixture();
    let request = fragmented(
        frame::TCP,
        (OUTSIDE, 43000),
        (NODE_IP, NODE_PORT),
        3000,
        0x6161,
    );
    let out = run_fragments(&request, XDP_REDIRECT, "request through XDP", |f| {
        run_xdp(&nf, f)
    });
    for (i, f) in out.iter().enumerate() {
        assert_eq!(macs(f), (PEER_MAC, UPLINK_MAC), "fragment {i}: next hop");
        assert_eq!(f[22], request[i][22] - 1, "fragment {i}: TTL");
    }
    let p = parse_checked(&frame::reassemble(&out, "SNATed request"), "SNATed request");
    assert_eq!((p.src, p.dst, p.dport), (NODE_IP, REMOTE_POD, 8080));
    let answer = fragmented(
        frame::TCP,
        (REMOTE_POD, 8080),
        (NODE_IP, p.sport),
        3000,
        0x6262,
    );
    let out = run_fragments(&answer, XDP_REDIRECT, "answer through XDP", |f| {
        run_xdp(&nf, f)
    });
    let r = parse_checked(&frame::reassemble(&out, "answer"), "answer");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (NODE_IP, NODE_PORT, OUTSIDE, 43000)
    );
    assert_eq!(counter(&nf.fx, "frag_translated"), 4);
}

/// A flood of new flows cannot push established ones out of conntrack: with a
/// conntrack of 1,024 entries (`--conntrack-max 512`), 100 established TCP
/// connections and 50 UDP flows that exchanged twice (assured) all keep their
/// backends through a flood of 100,000 new flows (SYNs that are never answered, and
/// one-shot UDP exchanges), 200 times what conntrack holds and more than `CT_NEW`
/// holds too; a connection opened in the middle of the flood is served and assured.
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom, over one loaded datapath"
)]
fn a_flood_of_new_flows_leaves_established_flows_alone() {
    const CAPACITY: u32 = 1024;
    let mut fx = fixture_loaded(|pins| Datapath::load_sized(pins, CAPACITY));
    let _cpu = stay_on_this_cpu();
    let backend_of = |out: &[u8], what: &str| parse_checked(out, what).dst;
    // Opens a TCP connection (handshake through the datapath); its backend.
    let connect = |sport: u16| {
        let (_, out) = run(&fx, &tcp(CLIENT, sport, VIP, 80, frame::SYN));
        let backend = backend_of(&out, "SYN");
        let (_, out) = run(
            &fx,
            &tcp(backend, 8080, CLIENT, sport, frame::SYN | frame::ACK),
        );
        assert_eq!(
            parse_checked(&out, "SYN-ACK").src,
            VIP,
            "SYN-ACK of {sport}"
        );
        let (_, out) = run(&fx, &tcp(CLIENT, sport, VIP, 80, frame::ACK));
        assert_eq!(backend_of(&out, "ACK"), backend, "ACK of {sport}");
        backend
    };
    // A UDP flow that exchanges twice; its backend.
    let exchange_twice = |sport: u16| {
        let (_, out) = run(&fx, &udp(CLIENT, sport, VIP, 53, false));
        let backend = backend_of(&out, "request");
        run(&fx, &udp(backend, 5353, CLIENT, sport, false));
        let (_, out) = run(&fx, &udp(CLIENT, sport, VIP, 53, false));
        assert_eq!(backend_of(&out, "second request"), backend);
        backend
    };
    let tcp_flows: Vec<(u16, Ipv4Addr)> = (20_000..20_100).map(|p| (p, connect(p))).collect();
    let udp_flows: Vec<(u16, Ipv4Addr)> =
        (21_000..21_050).map(|p| (p, exchange_twice(p))).collect();
    assert_eq!(
        counter(&fx, "ct_assured"),
        150,
        "flows assured before the flood"
    );

    const FLOOD: u32 = 100_000;
    let mut during = None;
    for i in 0..FLOOD {
        // Clients all over 10.201.0.0/16, ports all over the range.
        let client = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 201, 0, 0)) + (i >> 4));
        let sport = 1024 + (i % 60_000) as u16;
        if i % 4 == 0 {
            let (_, out) = run(&fx, &udp(client, sport, VIP, 53, false));
            let backend = backend_of(&out, "flood datagram");
            run(&fx, &udp(backend, 5353, client, sport, false));
        } else {
            run(&fx, &tcp(client, sport, VIP, 80, frame::SYN));
        }
        if i == FLOOD / 2 {
            during = Some(connect(30_000));
        }
    }
    // Copies in the flow cache would hide an evicted entry for up to a second.
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
            parse_checked(&back, "answer after").src,
        );
        if now != (*backend, VIP) {
            lost.push(format!(
                "TCP {sport}: {now:?} instead of ({backend}, {VIP})"
            ));
        }
    }
    for (sport, backend) in &udp_flows {
        let (_, out) = run(&fx, &udp(CLIENT, *sport, VIP, 53, false));
        let now = backend_of(&out, "UDP after");
        if now != *backend {
            lost.push(format!("UDP {sport}: {now} instead of {backend}"));
        }
    }
    assert!(
        lost.is_empty(),
        "{} of 150 established flows lost their entries to a flood of {FLOOD} new flows \
         (conntrack of {CAPACITY} entries): {:?}",
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
    let assured = proxy_userspace::datapath::batch::count::<proxy_common::CtKey, CtValue>(
        aya::maps::IterableMap::map(&fx.datapath.maps.conntrack),
        proxy_userspace::datapath::batch::CHUNK,
    )
    .expect("counting CONNTRACK");
    assert_eq!(
        assured,
        2 * 151,
        "CONNTRACK holds the assured flows' entries and nothing else"
    );
}

/// A client opening a new connection from the port of one it just reset,
/// while that flow's entries are closing in `CONNTRACK`, starts the new flow
/// in the room they leave there: its SYN removes the closed reply entry and
/// voids the closed forward entry, the new flow's reply entry goes in and its
/// forward entry is written over the voided one, none goes through `CT_NEW`, none
/// is moved when the handshake assures the flow (`ct_assured` stays), and
/// `CONNTRACK` holds as many entries as before. The new flow is translated
/// both ways, and its retransmitted SYN keeps its backend. Where the closed
/// flow's reply entry is no longer its own (rewritten here behind the
/// datapath's back, as only a test would), the SYN leaves no room, and the
/// new flow starts in `CT_NEW` as any does. A client at its share of
/// `CONNTRACK` (`ct_source_share`) takes the room of its own closed flow
/// as well, and holds no more flows than before.
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom, over one loaded datapath"
)]
fn a_client_port_opened_again_starts_its_flow_where_the_closed_one_was() {
    let mut fx = fixture();
    let _cpu = stay_on_this_cpu();
    let key = |sport: u16| ct_key(CLIENT, sport, VIP, 80, proxy_common::PROTO_TCP);
    let reply_key = |backend: Ipv4Addr, sport: u16| {
        ct_key(backend, 8080, CLIENT, sport, proxy_common::PROTO_TCP)
    };
    // SYN, SYN-ACK, ACK through the ClusterIP: the backend.
    let connect = |fx: &Fixture, sport: u16, what: &str| {
        let (ret, out) = run(fx, &tcp(CLIENT, sport, VIP, 80, frame::SYN));
        assert_eq!(ret, TC_PASS, "{what}: SYN verdict");
        let backend = parse_checked(&out, &format!("{what}: SYN")).dst;
        assert!(BACKENDS.contains(&backend), "{what}: SYN sent to {backend}");
        let (_, out) = run(
            fx,
            &tcp(backend, 8080, CLIENT, sport, frame::SYN | frame::ACK),
        );
        let answer = parse_checked(&out, &format!("{what}: SYN-ACK"));
        assert_eq!(
            (answer.src, answer.sport),
            (VIP, 80),
            "{what}: the SYN-ACK was not translated back"
        );
        let (_, out) = run(fx, &tcp(CLIENT, sport, VIP, 80, frame::ACK));
        assert_eq!(
            parse_checked(&out, &format!("{what}: ACK")).dst,
            backend,
            "{what}: the ACK went elsewhere"
        );
        backend
    };
    let reset = |fx: &Fixture, sport: u16| {
        let (ret, _) = run(fx, &tcp(CLIENT, sport, VIP, 80, frame::RST | frame::ACK));
        assert_eq!(ret, TC_PASS, "client port {sport}: RST verdict");
        let entry = fx.datapath.maps.conntrack.get(&key(sport), 0);
        assert!(
            entry
                .as_ref()
                .is_ok_and(|e| e.flags & ct_flags::CLOSING != 0),
            "client port {sport}: the reset flow is not closing in CONNTRACK: {entry:?}"
        );
    };

    // An open connection beside the one reset and opened again.
    let other = connect(&fx, 43_001, "the other connection");
    let first = connect(&fx, 43_000, "the first connection");
    reset(&fx, 43_000);
    let (assured, entries) = (counter(&fx, "ct_assured"), ct_len(&fx));
    assert_eq!((assured, entries), (2, 4), "(ct_assured, entries) before");

    let (_, out) = run(&fx, &tcp(CLIENT, 43_000, VIP, 80, frame::SYN));
    let second = parse_checked(&out, "the reopening SYN").dst;
    assert!(
        BACKENDS.contains(&second),
        "the reopening SYN went to {second}"
    );
    let (forward, forward_in_ct_new) = ct_entries(&fx, &key(43_000));
    let forward = forward.unwrap_or_else(|| {
        panic!(
            "the reopened flow's forward entry is not in CONNTRACK (in CT_NEW: {forward_in_ct_new:?})"
        )
    });
    assert!(
        forward_in_ct_new.is_none(),
        "the reopened flow's forward entry is in CT_NEW too"
    );
    assert_eq!(
        forward.flags & (ct_flags::CLOSING | ct_flags::ASSURED | ct_flags::SEEN_REPLY),
        0,
        "the reopened flow's forward entry is the closed flow's: {forward:?}"
    );
    let (reply, reply_in_ct_new) = ct_entries(&fx, &reply_key(second, 43_000));
    assert!(
        reply.is_some() && reply_in_ct_new.is_none(),
        "the reopened flow's reply entry: in CONNTRACK {reply:?}, in CT_NEW {reply_in_ct_new:?}"
    );
    if second != first {
        assert_eq!(
            ct_entries(&fx, &reply_key(first, 43_000)),
            (None, None),
            "the closed flow's reply entry outlived the reopening SYN"
        );
    }
    let (_, out) = run(&fx, &tcp(CLIENT, 43_000, VIP, 80, frame::SYN));
    assert_eq!(
        parse_checked(&out, "the retransmitted SYN").dst,
        second,
        "a retransmitted SYN of the reopened flow changed its backend"
    );
    let (_, out) = run(
        &fx,
        &tcp(second, 8080, CLIENT, 43_000, frame::SYN | frame::ACK),
    );
    let answer = parse_checked(&out, "the reopened flow's SYN-ACK");
    assert_eq!(
        (answer.src, answer.sport),
        (VIP, 80),
        "the reopened flow's SYN-ACK"
    );
    for flags in [frame::ACK, frame::ACK | frame::PSH] {
        let (_, out) = run(&fx, &tcp(CLIENT, 43_000, VIP, 80, flags));
        assert_eq!(
            parse_checked(&out, "the reopened flow's data").dst,
            second,
            "the reopened flow's packet with flags {flags:#x} went elsewhere"
        );
    }
    let (_, out) = run(&fx, &tcp(second, 8080, CLIENT, 43_000, frame::ACK));
    assert_eq!(parse_checked(&out, "the reopened flow's answer").src, VIP);
    let forward = fx
        .datapath
        .maps
        .conntrack
        .get(&key(43_000), 0)
        .expect("the reopened flow's forward entry after its handshake");
    assert_ne!(forward.flags & ct_flags::ASSURED, 0, "{forward:?}");
    assert_eq!(
        (
            counter(&fx, "ct_assured"),
            ct_len(&fx),
            counter(&fx, "ct_reopened")
        ),
        (assured, entries, 1),
        "(ct_assured, entries, ct_reopened): the reopened flow was moved, or left more entries than its closed one"
    );
    let (_, out) = run(&fx, &tcp(CLIENT, 43_001, VIP, 80, frame::ACK));
    assert_eq!(parse_checked(&out, "the other connection").dst, other);

    // The port reset and opened again until its new flow has had the
    // closed one's backend (its reply entry written over the voided one in
    // place) and another (the voided one removed, the new one inserted):
    // either way translated both ways, and nothing left behind.
    let (mut before, mut same, mut moved, mut cycles) = (second, 0, 0, 0);
    while (same == 0 || moved == 0) && cycles < 60 {
        reset(&fx, 43_000);
        let now = connect(&fx, 43_000, "the port opened again");
        cycles += 1;
        if now == before {
            same += 1;
        } else {
            moved += 1;
            assert_eq!(
                ct_entries(&fx, &reply_key(before, 43_000)),
                (None, None),
                "cycle {cycles}: the closed flow's reply entry (to {before}) outlived the flow to {now}"
            );
        }
        let reply = fx
            .datapath
            .maps
            .conntrack
            .get(&reply_key(now, 43_000), 0)
            .unwrap_or_else(|e| panic!("cycle {cycles}: no reply entry of the flow to {now}: {e}"));
        assert!(
            reply.last_seen_ns != 0 && reply.flags & ct_flags::CLOSING == 0,
            "cycle {cycles}: the flow to {now} (before: {before}) has the closed flow's reply entry: {reply:?}"
        );
        assert_eq!(
            (counter(&fx, "ct_assured"), ct_len(&fx)),
            (assured, entries),
            "cycle {cycles}: (ct_assured, entries): the flow to {now} (before: {before}) was moved, \
             or left more entries than its closed one"
        );
        before = now;
    }
    assert!(
        same > 0 && moved > 0,
        "in {cycles} cycles, {same} reopened flows had the closed one's backend and {moved} another"
    );
    assert_eq!(counter(&fx, "ct_reopened"), 1 + cycles, "ct_reopened");
    let second = before;

    // No room: the closed flow's reply entry is another client port's now.
    reset(&fx, 43_000);
    let reply = reply_key(second, 43_000);
    let mut theirs = fx
        .datapath
        .maps
        .conntrack
        .get(&reply, 0)
        .expect("the closed flow's reply entry");
    theirs.alt_port_be = 43_002u16.to_be();
    fx.datapath
        .maps
        .conntrack
        .insert(reply, theirs, 0)
        .expect("rewriting the reply entry");
    run(&fx, &tcp(CLIENT, 43_000, VIP, 80, frame::SYN));
    // The closed flow's forward entry stays in `CONNTRACK`, voided (its
    // clock 0: expired), until the flow's move or the reaper overwrites or
    // removes it.
    let entries = ct_entries(&fx, &key(43_000));
    assert!(
        matches!(
            entries,
            (
                None | Some(CtValue {
                    last_seen_ns: 0,
                    ..
                }),
                Some(_)
            )
        ),
        "a SYN that left no room started its flow in CONNTRACK, or left the closed flow's \
         forward entry live there: {entries:?}"
    );

    // A share of 1 flow, which the client holds (43_001, as the reaper's
    // recount finds): that flow's port opened again takes its room all the
    // same, and the client holds no more than before, so a new port's flow
    // stays in CT_NEW, unassured.
    set_ct_source_share(&mut fx, 1);
    reap_expired(&mut fx, conntrack::monotonic_ns());
    reset(&fx, 43_001);
    let again = connect(&fx, 43_001, "the other connection opened again");
    let (forward, forward_in_ct_new) = ct_entries(&fx, &key(43_001));
    assert!(
        forward.is_some_and(|f| f.flags & ct_flags::ASSURED != 0) && forward_in_ct_new.is_none(),
        "at its share, a client's reopened port did not take its closed flow's room \
         (in CT_NEW: {forward_in_ct_new:?})"
    );
    assert!(BACKENDS.contains(&again));
    let refused = counter(&fx, "ct_share_refused");
    connect(&fx, 43_004, "a connection past the share");
    assert!(
        matches!(ct_entries(&fx, &key(43_004)), (None, Some(_))),
        "a client at its share, whose reopened port took a room, had a new port's flow assured"
    );
    assert!(counter(&fx, "ct_share_refused") > refused);
    assert_eq!(counter(&fx, "ct_reopened"), 2 + cycles, "ct_reopened");
}

/// A SYN opening again the tuple of a flow closed by FINs each way voids
/// that flow's forward entry in place for the new flow to be written over
/// (`conntrack::reopen`): last seen at the clock's start, with a reset
/// flow's timeout rather than `TIME_WAIT`'s.
/// Where no new flow follows (its Service has lost its endpoints, and the
/// SYN is rejected), the voided entry is taken for none: the client's next
/// packet on that tuple is refused as a packet of no flow to that Service
/// is (dropped: no SYN, nothing to reset), never sent to the closed flow's
/// backend; the reaper removes the entry; and the tuple,
/// opened once the Service has endpoints again, starts a flow as any new
/// one does.
#[test]
fn a_reopening_syn_that_starts_no_flow_leaves_no_live_entry_of_the_closed_one() {
    let mut fx = fixture();
    let _cpu = stay_on_this_cpu();
    let key = ct_key(CLIENT, 43_300, VIP, 80, proxy_common::PROTO_TCP);
    let (_, out) = run(&fx, &tcp(CLIENT, 43_300, VIP, 80, frame::SYN));
    let first = parse_checked(&out, "the first SYN").dst;
    run(
        &fx,
        &tcp(first, 8080, CLIENT, 43_300, frame::SYN | frame::ACK),
    );
    run(&fx, &tcp(CLIENT, 43_300, VIP, 80, frame::ACK));
    run(&fx, &tcp(CLIENT, 43_300, VIP, 80, frame::FIN | frame::ACK));
    run(
        &fx,
        &tcp(first, 8080, CLIENT, 43_300, frame::FIN | frame::ACK),
    );
    let closed = ct_flags::CLOSING | ct_flags::FIN_BOTH;
    assert!(
        matches!(ct_entries(&fx, &key), (Some(e), None) if e.flags & closed == closed),
        "the flow closed by FINs each way is not closing in CONNTRACK: {:?}",
        ct_entries(&fx, &key)
    );
    let owner = ObjectKey {
        namespace: "test".into(),
        name: "svc0".into(),
    };
    let resync = |fx: &mut Fixture, backends: &[Ipv4Addr]| {
        let fe = frontend(
            VIP,
            80,
            Protocol::Tcp,
            backends,
            8080,
            NoEndpointAction::Reject,
        );
        let out = fx
            .planner
            .sync_service(&owner, std::slice::from_ref(&fe), &mut fx.datapath.maps);
        assert!(
            out.errors.is_empty(),
            "resyncing {}: {:?}",
            fe.key,
            out.errors
        );
    };
    resync(&mut fx, &[]);

    let rejects = counter(&fx, "reject");
    let (ret, out) = run(&fx, &tcp(CLIENT, 43_300, VIP, 80, frame::SYN));
    let p = parse_checked(&out, "the answer to the SYN");
    assert_eq!(
        (ret, p.src, p.dst),
        (TC_ACT_REDIRECT, VIP, CLIENT),
        "the SYN on the closed flow's tuple, its Service without endpoints, was not rejected \
         (sent to {}; the closed flow's backend was {first})",
        p.dst
    );
    let (ret, out) = run(&fx, &tcp(CLIENT, 43_300, VIP, 80, frame::ACK));
    assert_eq!(
        ret,
        TC_ACT_SHOT,
        "the ACK after it, a packet of no flow to a Service without endpoints, was not refused \
         (sent to {}; the closed flow's backend was {first})",
        parse_checked(&out, "the ACK").dst
    );
    assert_eq!(counter(&fx, "reject"), rejects + 2, "reject");
    // Both entries voided: a reset flow's timeout (10 s, where TIME_WAIT's
    // is 120 s), last seen at the clock's start, so expired on any node up
    // 10 s.
    let reply_key = ct_key(first, 8080, CLIENT, 43_300, proxy_common::PROTO_TCP);
    for (what, key) in [("forward", &key), ("reply", &reply_key)] {
        assert!(
            matches!(
                ct_entries(&fx, key),
                (Some(e), None) if e.last_seen_ns == 0 && e.flags & closed == ct_flags::CLOSING
            ),
            "the closed flow's {what} entry was not voided: {:?}",
            ct_entries(&fx, key)
        );
    }
    let reaped = reap_expired(&mut fx, conntrack::monotonic_ns());
    assert_eq!(
        (
            reaped,
            ct_entries(&fx, &key),
            ct_entries(&fx, &reply_key),
            ct_len(&fx)
        ),
        (2, (None, None), (None, None), 0),
        "(reaped, the tuple's entries, its reply entries, entries left): a voided entry outlived \
         the reaper"
    );

    resync(&mut fx, &BACKENDS);
    let (ret, out) = run(&fx, &tcp(CLIENT, 43_300, VIP, 80, frame::SYN));
    let to = parse_checked(&out, "the SYN once the Service has endpoints again").dst;
    assert!(
        ret == TC_PASS && BACKENDS.contains(&to),
        "the SYN once the Service has endpoints again: verdict {ret}, sent to {to}"
    );
    assert!(
        matches!(ct_entries(&fx, &key), (None, Some(_))),
        "the new flow did not start in CT_NEW: {:?}",
        ct_entries(&fx, &key)
    );
}

/// Only an assured flow's room in `CONNTRACK` is taken by its port opened
/// again: a flow reset before its handshake completed leaves its entries
/// in `CT_NEW`, and the SYN that opens its tuple again starts the new flow
/// there too, unassured, so that a client cycling SYN and RST on its ports
/// never reaches `CONNTRACK` without completing a handshake.
#[test]
fn a_client_port_reset_before_its_handshake_opens_again_in_ct_new() {
    let fx = fixture();
    let _cpu = stay_on_this_cpu();
    let key = ct_key(CLIENT, 43_100, VIP, 80, proxy_common::PROTO_TCP);
    for round in 0..3 {
        let (ret, out) = run(&fx, &tcp(CLIENT, 43_100, VIP, 80, frame::SYN));
        assert_eq!(ret, TC_PASS, "SYN {round}: verdict");
        let to = parse_checked(&out, &format!("SYN {round}")).dst;
        assert!(BACKENDS.contains(&to), "SYN {round} sent to {to}");
        if round == 0 {
            run(&fx, &tcp(to, 8080, CLIENT, 43_100, frame::SYN | frame::ACK));
        }
        let (in_conntrack, in_ct_new) = ct_entries(&fx, &key);
        assert!(
            in_conntrack.is_none() && in_ct_new.is_some(),
            "SYN {round}: the flow's forward entry in CONNTRACK {in_conntrack:?}, in CT_NEW {in_ct_new:?}"
        );
        run(&fx, &tcp(CLIENT, 43_100, VIP, 80, frame::RST | frame::ACK));
        let (in_conntrack, in_ct_new) = ct_entries(&fx, &key);
        assert!(
            in_conntrack.is_none() && in_ct_new.is_some_and(|e| e.flags & ct_flags::CLOSING != 0),
            "RST {round}: the reset flow is not closing in CT_NEW alone \
             (in CONNTRACK {in_conntrack:?}, in CT_NEW {in_ct_new:?})"
        );
    }
    assert_eq!(
        (
            counter(&fx, "ct_reopened"),
            counter(&fx, "ct_assured"),
            fx.datapath.maps.conntrack.keys().count()
        ),
        (0, 0, 0),
        "(ct_reopened, ct_assured, CONNTRACK's entries): an unassured flow's port opened again reached CONNTRACK"
    );
}

/// A TCP flow that saw its SYN-ACK but never the client's ACK (a half-open
/// flow, as a SYN flood from spoofed clients leaves) keeps the handshake's
/// timeout, not the established one: with a 1 s SYN timeout its entries are
/// gone from `CT_NEW` after it, while an assured flow's stay.
#[test]
fn a_half_open_flow_expires_with_the_handshake_timeout() {
    let mut fx = fixture();
    set_timeouts(
        &mut fx,
        proxy_common::CtTimeouts {
            tcp_syn_ns: 1_000_000_000,
            ..proxy_common::CtTimeouts::DEFAULT
        },
    );
    let handshake = |fx: &Fixture, sport: u16, ack: bool| {
        let (_, out) = run(fx, &tcp(CLIENT, sport, VIP, 80, frame::SYN));
        let backend = parse_checked(&out, "SYN").dst;
        run(
            fx,
            &tcp(backend, 8080, CLIENT, sport, frame::SYN | frame::ACK),
        );
        if ack {
            run(fx, &tcp(CLIENT, sport, VIP, 80, frame::ACK));
        }
    };
    handshake(&fx, 44_000, false);
    handshake(&fx, 44_001, true);
    // The point: the half-open flow's 1 s timeout set above runs out.
    std::thread::sleep(Duration::from_millis(1500));
    let reaped = reap_expired(&mut fx, conntrack::monotonic_ns());
    assert_eq!(
        reaped, 2,
        "the half-open flow's two entries, and only those"
    );
    let half_open = ct_key(CLIENT, 44_000, VIP, 80, proxy_common::PROTO_TCP);
    assert!(
        fx.datapath.maps.ct_new.get(&half_open, 0).is_err(),
        "the half-open flow outlived the handshake timeout"
    );
    let assured = ct_key(CLIENT, 44_001, VIP, 80, proxy_common::PROTO_TCP);
    let entry = fx
        .datapath
        .maps
        .conntrack
        .get(&assured, 0)
        .expect("the assured flow's entry");
    assert_ne!(entry.flags & ct_flags::ASSURED, 0, "{entry:?}");
}

/// A connection through the ClusterIP from client port `sport`, its
/// handshake done with real sequence numbers (client from `c`, backend
/// from `b`): its backend.
fn handshake_with_seqs(fx: &Fixture, sport: u16, c: u32, b: u32) -> Ipv4Addr {
    let (ret, out) = run(
        fx,
        &frame::with_seq_ack(&tcp(CLIENT, sport, VIP, 80, frame::SYN), c, 0),
    );
    assert_eq!(ret, TC_PASS, "SYN: verdict");
    let backend = parse_checked(&out, "SYN").dst;
    let syn_ack = tcp(backend, 8080, CLIENT, sport, frame::SYN | frame::ACK);
    let (ret, _) = run(fx, &frame::with_seq_ack(&syn_ack, b, c + 1));
    assert_eq!(ret, TC_PASS, "SYN-ACK: verdict");
    let ack = tcp(CLIENT, sport, VIP, 80, frame::ACK);
    let (ret, _) = run(fx, &frame::with_seq_ack(&ack, c + 1, b + 1));
    assert_eq!(ret, TC_PASS, "ACK: verdict");
    backend
}

/// The flags of the forward conntrack entry of the flow from `sport`.
fn forward_flags(fx: &Fixture, sport: u16) -> u8 {
    let key = ct_key(CLIENT, sport, VIP, 80, proxy_common::PROTO_TCP);
    fx.datapath
        .maps
        .conntrack
        .get(&key, 0)
        .expect("the flow's assured entry")
        .flags
}

/// A FIN closes its own direction only: the backend of a client that
/// half-closed its connection (`shutdown(SHUT_WR)`) goes on sending, past
/// the timeout of a closed flow, and its packets are still translated; the
/// backend's FIN then closes the flow, which is gone once `TIME_WAIT` has
/// passed.
#[test]
fn a_half_closed_flow_keeps_its_translation_until_both_sides_close() {
    let mut fx = fixture();
    let short = Duration::from_secs(1);
    closed_timeouts(&mut fx, short, short);
    let (sport, c, b) = (41700, 1_000, 500_000);
    let backend = handshake_with_seqs(&fx, sport, c, b);
    let fin = tcp(CLIENT, sport, VIP, 80, frame::FIN | frame::ACK);
    let (ret, out) = run(&fx, &frame::with_seq_ack(&fin, c + 1, b + 1));
    assert_eq!(ret, TC_PASS, "client's FIN: verdict");
    assert_eq!(parse_checked(&out, "client's FIN").dst, backend);
    assert_eq!(
        forward_flags(&fx, sport) & (ct_flags::FIN_BOTH | ct_flags::CLOSING),
        ct_flags::FIN_FORWARD,
        "the client's FIN must half-close the flow, not close it"
    );
    let from_backend = |fx: &Fixture, flags: u8, seq: u32, what: &str| {
        let mut data = build(&Spec {
            src: backend,
            dst: CLIENT,
            sport: 8080,
            dport: sport,
            proto: frame::TCP,
            tcp_flags: flags,
            payload: b"still streaming".to_vec(),
            udp_no_csum: false,
        });
        data = frame::with_seq_ack(&data, seq, c + 2);
        let (ret, out) = run(fx, &data);
        assert_eq!(ret, TC_PASS, "{what}: verdict");
        let p = parse_checked(&out, what);
        (p.src, p.sport)
    };
    // The point: longer than a closed flow lives.
    std::thread::sleep(short + Duration::from_millis(500));
    assert_eq!(
        from_backend(
            &fx,
            frame::ACK,
            b + 1,
            "the backend's data after the client's FIN"
        ),
        (VIP, 80),
        "a half-closed flow lost its translation"
    );
    assert_eq!(
        from_backend(&fx, frame::FIN | frame::ACK, b + 16, "the backend's FIN"),
        (VIP, 80)
    );
    assert_eq!(
        forward_flags(&fx, sport) & (ct_flags::FIN_BOTH | ct_flags::CLOSING),
        ct_flags::FIN_BOTH | ct_flags::CLOSING,
        "a FIN each way closes the flow"
    );
    // The point: TIME_WAIT (1 s here) passes.
    std::thread::sleep(short + Duration::from_millis(500));
    assert_eq!(
        from_backend(&fx, frame::ACK, b + 17, "a straggler after TIME_WAIT"),
        (backend, 8080),
        "a closed flow outlived TIME_WAIT"
    );
}

/// An RST (or FIN) whose sequence number is outside its receiver's window
/// (before what it acknowledged, or past any window) is stale or forged by
/// someone who guessed the flow's addresses and ports: it is counted
/// (`ct_out_of_window`) and the flow goes on; one inside the window closes
/// it. Both directions.
#[test]
fn an_rst_outside_the_window_is_counted_and_leaves_the_flow() {
    let fx = fixture();
    let (sport, c, b) = (41710, 70_000, 9_000_000);
    let backend = handshake_with_seqs(&fx, sport, c, b);
    let client_rst = |seq: u32| {
        let rst = tcp(CLIENT, sport, VIP, 80, frame::RST | frame::ACK);
        run(&fx, &frame::with_seq_ack(&rst, seq, b + 1)).0
    };
    let backend_rst = |seq: u32| {
        let rst = tcp(backend, 8080, CLIENT, sport, frame::RST | frame::ACK);
        run(&fx, &frame::with_seq_ack(&rst, seq, c + 1)).0
    };
    let closing = |fx: &Fixture| forward_flags(fx, sport) & ct_flags::CLOSING != 0;
    let client_fin = |seq: u32| {
        let fin = tcp(CLIENT, sport, VIP, 80, frame::FIN | frame::ACK);
        run(&fx, &frame::with_seq_ack(&fin, seq, b + 1)).0
    };
    let forged: [(&str, &dyn Fn() -> u32); 4] = [
        ("client's RST 65,536 bytes back", &|| {
            client_rst(c + 1 - 65_536)
        }),
        ("client's RST 2 GiB away", &|| {
            client_rst(c.wrapping_add(1 << 31))
        }),
        ("backend's RST one byte back", &|| backend_rst(b)),
        ("client's FIN before the window", &|| client_fin(c - 10)),
    ];
    for (n, (what, send)) in (1..).zip(forged) {
        assert_eq!(
            send(),
            TC_PASS,
            "{what}: verdict (passed on, for the endpoint to judge)"
        );
        assert_eq!(counter(&fx, "ct_out_of_window"), n, "{what}: not counted");
        assert!(!closing(&fx), "{what} closed the flow");
        assert_eq!(
            forward_flags(&fx, sport) & ct_flags::FIN_BOTH,
            0,
            "{what} half-closed the flow"
        );
    }
    let (ret, out) = run(&fx, &tcp(CLIENT, sport, VIP, 80, frame::ACK));
    assert_eq!(ret, TC_PASS);
    assert_eq!(
        parse_checked(&out, "data after the forged RSTs").dst,
        backend,
        "the flow lost its backend"
    );
    assert_eq!(backend_rst(b + 1), TC_PASS, "backend's RST in the window");
    assert!(closing(&fx), "an RST inside the window must close the flow");
    assert_eq!(counter(&fx, "ct_out_of_window"), 4);
}

/// Gives each client a share of `share` assured flows
/// (`--conntrack-max-per-source`), SNAT as `node_config` has it.
fn set_ct_source_share(fx: &mut Fixture, share: u32) {
    fx.datapath
        .maps
        .apply(&MapOp::SetNodeConfig {
            config: proxy_common::NodeConfig {
                ct_source_share: share,
                ..node_config(1024, 65535, 0)
            },
        })
        .unwrap_or_else(|e| panic!("a share of {share}: {e}"));
}

/// A client that completes handshakes past its share of assured flows
/// (`--conntrack-max-per-source`, 2 here) keeps them working, but
/// unassured in `CT_NEW` (counted `ct_share_refused`), where they can only
/// evict other unassured flows; another client's flows are assured as
/// ever. Once the reaper's recount finds one of the first client's assured
/// flows gone, its next flow is assured again.
#[test]
fn a_client_past_its_share_of_conntrack_stays_unassured() {
    let mut fx = fixture();
    set_ct_source_share(&mut fx, 2);
    let other_client = Ipv4Addr::new(10, 200, 0, 77);
    let connect = |fx: &Fixture, client: Ipv4Addr, sport: u16| {
        let (ret, out) = run(fx, &tcp(client, sport, VIP, 80, frame::SYN));
        assert_eq!(ret, TC_PASS, "{client}:{sport} SYN: verdict");
        let backend = parse_checked(&out, "SYN").dst;
        let (ret, _) = run(
            fx,
            &tcp(backend, 8080, client, sport, frame::SYN | frame::ACK),
        );
        assert_eq!(ret, TC_PASS, "{client}:{sport} SYN-ACK: verdict");
        let (ret, out) = run(fx, &tcp(client, sport, VIP, 80, frame::ACK));
        assert_eq!(ret, TC_PASS, "{client}:{sport} ACK: verdict");
        assert_eq!(
            parse_checked(&out, "ACK").dst,
            backend,
            "{client}:{sport}: the handshake's ACK went elsewhere"
        );
    };
    let assured = |fx: &Fixture, client: Ipv4Addr, sport: u16| {
        let key = ct_key(client, sport, VIP, 80, proxy_common::PROTO_TCP);
        let (in_conntrack, in_ct_new) = ct_entries(fx, &key);
        let (in_conntrack, in_ct_new) = (in_conntrack.is_some(), in_ct_new.is_some());
        assert!(
            in_conntrack != in_ct_new,
            "{client}:{sport}: in CONNTRACK {in_conntrack}, in CT_NEW {in_ct_new}"
        );
        in_conntrack
    };
    for sport in [42000, 42001, 42002] {
        connect(&fx, CLIENT, sport);
    }
    assert_eq!(
        [42000, 42001, 42002].map(|p| assured(&fx, CLIENT, p)),
        [true, true, false],
        "the third flow of a client with a share of 2"
    );
    assert!(counter(&fx, "ct_share_refused") >= 1);
    let (ret, out) = run(&fx, &tcp(CLIENT, 42002, VIP, 80, frame::ACK));
    assert_eq!(ret, TC_PASS);
    assert_ne!(
        parse_checked(&out, "the unassured flow's data").dst,
        VIP,
        "a flow past the share must still be translated"
    );
    connect(&fx, other_client, 42000);
    assert!(
        assured(&fx, other_client, 42000),
        "another client's flow was refused its assurance"
    );

    // One of the client's assured flows goes; the recount sees it.
    let key = ct_key(CLIENT, 42000, VIP, 80, proxy_common::PROTO_TCP);
    fx.datapath
        .maps
        .conntrack
        .remove(&key)
        .expect("removing a flow's forward entry");
    assert_eq!(
        reap_expired(&mut fx, conntrack::monotonic_ns()),
        0,
        "the reaper removed a live flow"
    );
    let held = fx
        .datapath
        .maps
        .ct_sources
        .get(&u32::from_ne_bytes(CLIENT.octets()), 0)
        .expect("the client's count");
    assert_eq!(held, 1, "the client's count after the recount");
    connect(&fx, CLIENT, 42003);
    assert!(
        assured(&fx, CLIENT, 42003),
        "back under its share, the client's next flow must be assured"
    );
}

const ROUTER: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
const ICMP_PORT_UNREACHABLE: (u8, u8, u16) = (3, 3, 0);
const ICMP_FRAG_NEEDED: (u8, u8, u16) = (3, 4, 1400);
const ICMP_TTL_EXCEEDED: (u8, u8, u16) = (11, 0, 0);

/// `key`'s entries in `CONNTRACK` and in `CT_NEW`: where its flow lives.
fn ct_entries(fx: &Fixture, key: &proxy_common::CtKey) -> (Option<CtValue>, Option<CtValue>) {
    (
        fx.datapath.maps.conntrack.get(key, 0).ok(),
        fx.datapath.maps.ct_new.get(key, 0).ok(),
    )
}

/// Entries in both conntrack maps.
fn ct_len(fx: &Fixture) -> usize {
    fx.datapath.maps.conntrack.keys().count() + fx.datapath.maps.ct_new.keys().count()
}

/// ICMP errors about a ClusterIP flow, from its backend and from a router on
/// the way, quote the backend: translated back, they quote the flow as its
/// client sent it (the ClusterIP), so the client's socket finds them. The
/// error's source becomes the ClusterIP where the backend sent it, and stays
/// the router's otherwise; every checksum stays valid, the quoted segment's
/// too when it is quoted whole. Errors neither create nor change flows.
#[test]
fn icmp_errors_about_a_clusterip_flow_quote_the_clusterip() {
    let fx = fixture();
    let (_, out) = run(&fx, &tcp(CLIENT, 40100, VIP, 80, frame::SYN));
    let backend = parse_checked(&out, "DNATed SYN").dst;
    let (_, dnated_udp) = run(&fx, &udp(CLIENT, 40101, VIP, 53, false));
    let udp_backend = parse_checked(&dnated_udp, "DNATed datagram").dst;
    let entries = ct_len(&fx);

    let cases = [
        (
            "port unreachable from the backend, the whole segment quoted",
            icmp_error_frame(backend, ICMP_PORT_UNREACHABLE, &out, 1000),
            (VIP, (frame::TCP, CLIENT, 40100, VIP, 80)),
        ),
        (
            "fragmentation needed from a router, 8 bytes quoted",
            frame::icmp_error(ROUTER, CLIENT, ICMP_FRAG_NEEDED, &out, 8),
            (ROUTER, (frame::TCP, CLIENT, 40100, VIP, 80)),
        ),
        (
            "TTL exceeded from a router, 28 bytes quoted",
            frame::icmp_error(ROUTER, CLIENT, ICMP_TTL_EXCEEDED, &out, 28),
            (ROUTER, (frame::TCP, CLIENT, 40100, VIP, 80)),
        ),
        (
            "port unreachable for a datagram, quoted whole",
            icmp_error_frame(udp_backend, ICMP_PORT_UNREACHABLE, &dnated_udp, 1000),
            (VIP, (frame::UDP, CLIENT, 40101, VIP, 53)),
        ),
    ];
    for (i, (what, input, (src, quoted))) in cases.iter().enumerate() {
        let (ret, out) = run(&fx, input);
        assert_eq!(ret, TC_PASS, "{what}: verdict");
        assert_eq!(out.len(), input.len(), "{what}: length changed");
        let e = frame::parse_checked_icmp_error(&out, what);
        assert_eq!(
            (e.src, e.dst, e.quoted),
            (*src, CLIENT, *quoted),
            "{what}: translated error"
        );
        assert_eq!(
            counter(&fx, "icmp_error_translated"),
            i as u64 + 1,
            "{what}: counted"
        );
    }

    // The client's error about a reply it got (its port closed since): it
    // quotes the ClusterIP, and goes to the backend quoting the backend.
    let reply = tcp(backend, 8080, CLIENT, 40100, frame::SYN | frame::ACK);
    let (_, reply) = run(&fx, &reply);
    let input = frame::icmp_error(CLIENT, VIP, ICMP_PORT_UNREACHABLE, &reply, 1000);
    let (ret, out) = run(&fx, &input);
    assert_eq!(ret, TC_PASS, "the client's error: verdict");
    let e = frame::parse_checked_icmp_error(&out, "the client's error");
    assert_eq!(
        (e.src, e.dst, e.quoted),
        (CLIENT, backend, (frame::TCP, backend, 8080, CLIENT, 40100)),
        "the client's error about a reply"
    );
    assert_eq!(ct_len(&fx), entries, "errors made or removed entries");
}

/// Hairpin: a pod that reached itself through its Service gets the error its own
/// kernel sent about the hairpinned segment (to the hairpin address, quoting it) from
/// the frontend, quoting the frontend.
#[test]
fn icmp_errors_about_a_hairpin_flow_come_back_from_the_frontend() {
    let fx = fixture();
    let pod = BACKENDS[0];
    let (_, out) = run(&fx, &tcp(pod, 43100, HAIRPIN_VIP, 80, frame::SYN));
    let p = parse_checked(&out, "hairpin SYN");
    assert_eq!((p.src, p.dst), (HAIRPIN_SRC, pod), "hairpin SYN");
    for (what, from, kind, src) in [
        ("the pod's own error", pod, ICMP_FRAG_NEEDED, HAIRPIN_VIP),
        ("a router's error", ROUTER, ICMP_TTL_EXCEEDED, ROUTER),
    ] {
        let input = frame::icmp_error(from, HAIRPIN_SRC, kind, &out, 1000);
        let (ret, got) = run(&fx, &input);
        assert_eq!(ret, TC_PASS, "{what} about a hairpin flow: verdict");
        let e = frame::parse_checked_icmp_error(&got, what);
        assert_eq!(
            (e.src, e.dst, e.icmp_type, e.code, e.quoted),
            (
                src,
                pod,
                kind.0,
                kind.1,
                (frame::TCP, pod, 43100, HAIRPIN_VIP, 80)
            ),
            "{what} about a hairpin flow, translated"
        );
    }
    assert_eq!(
        counter(&fx, "redirect"),
        0,
        "an error about a hairpin flow was routed by the program"
    );
}

/// `frame::icmp_error` from `from` back to the source of the packet in `frame`.
fn icmp_error_frame(from: Ipv4Addr, kind: (u8, u8, u16), frame: &[u8], quote: usize) -> Vec<u8> {
    let to = Ipv4Addr::new(frame[26], frame[27], frame[28], frame[29]);
    frame::icmp_error(from, to, kind, frame, quote)
}

/// What is not an ICMP error about a translated flow passes untouched and
/// uncounted: an echo request, an error about a flow of no Service, an error
/// not addressed to the quoted packet's sender, one quoting a later fragment
/// (no ports to find the flow by), and one whose quote is cut before the
/// ports. An error quoting a first fragment is translated like any other.
#[test]
fn other_icmp_passes_untouched() {
    let fx = fixture();
    let (_, out) = run(&fx, &udp(CLIENT, 40200, VIP, 53, false));
    let backend = parse_checked(&out, "DNATed datagram").dst;
    let elsewhere = Ipv4Addr::new(10, 200, 0, 99);
    let mut echo = frame::icmp_error(CLIENT, VIP, (8, 0, 0), &out, 8);
    // An echo request's payload is free: make it the same bytes, recomputed.
    let icmp_len = echo.len() - 34;
    echo[36..38].copy_from_slice(&[0, 0]);
    let c = frame::csum(&echo[34..34 + icmp_len], 0);
    echo[36..38].copy_from_slice(&c.to_be_bytes());
    let big = fragmented(frame::UDP, (CLIENT, 40201), (VIP, 53), 3000, 0x5151);
    let (_, first) = run(&fx, &big[0]);
    let (_, later) = run(&fx, &big[1]);
    let untouched = [
        ("an echo request", echo),
        (
            "an error about a flow of no Service",
            frame::icmp_error(
                elsewhere,
                CLIENT,
                ICMP_PORT_UNREACHABLE,
                &udp(CLIENT, 40202, elsewhere, 53, false),
                1000,
            ),
        ),
        (
            "an error to someone else than the quoted sender",
            frame::icmp_error(backend, elsewhere, ICMP_PORT_UNREACHABLE, &out, 1000),
        ),
        (
            "an error quoting a later fragment",
            icmp_error_frame(backend, ICMP_PORT_UNREACHABLE, &later, 8),
        ),
        (
            "an error quoting 2 bytes of the segment",
            icmp_error_frame(backend, ICMP_PORT_UNREACHABLE, &out, 2),
        ),
    ];
    for (what, input) in &untouched {
        let (ret, out) = run(&fx, input);
        assert_eq!((ret, &out), (TC_PASS, input), "{what}: must pass untouched");
    }
    assert_eq!(counter(&fx, "icmp_error_translated"), 0, "nothing counted");

    let first_backend = Ipv4Addr::new(first[30], first[31], first[32], first[33]);
    let input = icmp_error_frame(first_backend, ICMP_FRAG_NEEDED, &first, 8);
    let (_, out) = run(&fx, &input);
    let e = frame::parse_checked_icmp_error(&out, "error quoting a first fragment");
    assert_eq!(
        (e.src, e.quoted),
        (VIP, (frame::UDP, CLIENT, 40201, VIP, 53)),
        "an error quoting a first fragment"
    );
}

/// NodePort with SNAT to a remote backend: a router between this node and the
/// backend says "fragmentation needed" to this node, quoting its SNAT port; tc
/// on the uplink hands the error on to the outside client quoting the NodePort,
/// the router's address kept (the stack forwards it). The backend's own port
/// unreachable comes back from the NodePort, an address of this node, so it is
/// routed here as the flow's replies are. XDP leaves errors to tc.
#[test]
fn icmp_errors_about_a_snated_nodeport_flow_reach_the_outside_client() {
    let nf = node_fixture();
    let (_, out) = run_xdp(&nf, &tcp(OUTSIDE, 41100, NODE_IP, NODE_PORT, frame::SYN));
    let p = parse_checked(&out, "SNATed SYN");
    assert_eq!((p.src, p.dst), (NODE_IP, REMOTE_POD), "SNATed SYN");

    let from_router = frame::icmp_error(ROUTER, NODE_IP, ICMP_FRAG_NEEDED, &out, 8);
    let (ret, xdp_out) = run_xdp(&nf, &from_router);
    assert_eq!(
        (ret, &xdp_out),
        (XDP_PASS, &from_router),
        "XDP leaves the error to tc"
    );
    let (ret, tc_out) = run_tc_on_uplink(&nf, &from_router);
    assert_eq!(ret, TC_PASS, "the router's error: tc verdict");
    let e = frame::parse_checked_icmp_error(&tc_out, "the router's error");
    assert_eq!(
        (e.src, e.dst, e.icmp_type, e.code, e.quoted),
        (
            ROUTER,
            OUTSIDE,
            3,
            4,
            (frame::TCP, OUTSIDE, 41100, NODE_IP, NODE_PORT)
        ),
        "the router's error, translated"
    );
    assert_eq!(
        &tc_out[34 + 6..34 + 8],
        &1400u16.to_be_bytes(),
        "the next-hop MTU is kept"
    );

    let redirects = counter(&nf.fx, "redirect");
    let from_backend = icmp_error_frame(REMOTE_POD, ICMP_PORT_UNREACHABLE, &out, 1000);
    let (ret, tc_out) = run_tc_on_uplink(&nf, &from_backend);
    assert_eq!(ret, TC_ACT_REDIRECT, "the backend's error is routed here");
    let e = frame::parse_checked_icmp_error(&tc_out, "the backend's error");
    assert_eq!(
        (e.src, e.dst, e.quoted),
        (
            NODE_IP,
            OUTSIDE,
            (frame::TCP, OUTSIDE, 41100, NODE_IP, NODE_PORT)
        ),
        "the backend's error, translated"
    );
    assert_eq!(
        macs(&tc_out),
        (OUTSIDE_MAC, UPLINK_MAC),
        "routed to the client"
    );
    assert_eq!(
        counter(&nf.fx, "redirect"),
        redirects + 1,
        "the backend's error not counted as routed by the program"
    );
    assert_eq!(counter(&nf.fx, "icmp_error_translated"), 2);
}

/// The other way on the same flow, whose other side is a pod on the peer
/// node: the outside client (a firewall on it rejecting, say) answers the
/// backend's SYN-ACK with port unreachable, to the NodePort it came from.
/// Translated, the error comes from this node's SNAT address to the backend,
/// quoting the SYN-ACK as the backend sent it: its new source is an address
/// of this node, so tc routes it to the peer node itself, as it routes the
/// flow's own packets. IPv6's twin is
/// `icmpv6_errors_from_the_outside_client_reach_a_snated_flows_backend`.
#[test]
fn icmp_errors_from_the_outside_client_reach_a_snated_flows_backend() {
    let nf = node_fixture();
    let (ret, out) = run_tc_on_uplink(&nf, &tcp(OUTSIDE, 41101, NODE_IP, NODE_PORT, frame::SYN));
    assert_eq!(ret, TC_ACT_REDIRECT, "SNATed SYN: verdict");
    let p = parse_checked(&out, "SNATed SYN");
    assert_eq!((p.src, p.dst), (NODE_IP, REMOTE_POD), "SNATed SYN");
    let syn_ack = tcp(
        REMOTE_POD,
        p.dport,
        NODE_IP,
        p.sport,
        frame::SYN | frame::ACK,
    );
    let (ret, reply) = run_tc_on_uplink(&nf, &syn_ack);
    assert_eq!(ret, TC_ACT_REDIRECT, "the backend's SYN-ACK: verdict");
    let r = parse_checked(&reply, "the backend's SYN-ACK");
    assert_eq!(
        (r.src, r.sport, r.dst, r.dport),
        (NODE_IP, NODE_PORT, OUTSIDE, 41101),
        "the backend's SYN-ACK, translated"
    );

    let redirects = counter(&nf.fx, "redirect");
    let input = icmp_error_frame(OUTSIDE, ICMP_PORT_UNREACHABLE, &reply, 1000);
    let (ret, got) = run_tc_on_uplink(&nf, &input);
    assert_eq!(
        ret, TC_ACT_REDIRECT,
        "the client's error must be routed here"
    );
    let e = frame::parse_checked_icmp_error(&got, "the client's error");
    assert_eq!(
        (e.src, e.dst, e.icmp_type, e.code, e.quoted),
        (
            NODE_IP,
            REMOTE_POD,
            3,
            3,
            (frame::TCP, REMOTE_POD, p.dport, NODE_IP, p.sport)
        ),
        "the client's error, translated"
    );
    assert_eq!(
        macs(&got),
        (PEER_MAC, UPLINK_MAC),
        "the client's error not routed to the peer node"
    );
    assert_eq!(got[22], input[22] - 1, "TTL taken down by one");
    assert_eq!(
        counter(&nf.fx, "redirect"),
        redirects + 1,
        "the client's error not counted as routed by the program"
    );
    assert_eq!(counter(&nf.fx, "icmp_error_translated"), 1);
}

/// A TCP segment carrying `payload` bytes, with `flags`.
fn segment(src: (Ipv4Addr, u16), dst: (Ipv4Addr, u16), flags: u8, payload: usize) -> Vec<u8> {
    build(&Spec {
        src: src.0,
        dst: dst.0,
        sport: src.1,
        dport: dst.1,
        proto: frame::TCP,
        tcp_flags: flags,
        payload: vec![0x5a; payload],
        udp_no_csum: false,
    })
}

/// Checks that `out` (verdict `ret`) is the "fragmentation needed"
/// answering `sent` (to `frontend`, from `client`): from the frontend, the
/// route's MTU of 1280 (`assert_frag_needed_of`: another), quoting the IP header and 8 bytes of the packet as
/// the client sent it, sent back where it came from.
fn assert_frag_needed(
    (ret, out): (u32, &[u8]),
    sent: &[u8],
    client: (Ipv4Addr, u16),
    frontend: (Ipv4Addr, u16),
    what: &str,
) {
    assert_frag_needed_of((ret, out), sent, client, frontend, 1280, what);
}

/// `assert_frag_needed` with a next-hop MTU of `mtu`.
fn assert_frag_needed_of(
    (ret, out): (u32, &[u8]),
    sent: &[u8],
    client: (Ipv4Addr, u16),
    frontend: (Ipv4Addr, u16),
    mtu: u16,
    what: &str,
) {
    assert_eq!(ret, TC_ACT_REDIRECT, "{what}: verdict");
    assert_eq!(out.len(), 14 + 20 + 8 + 40, "{what}: length of the answer");
    let e = frame::parse_checked_icmp_error(out, what);
    assert_eq!(
        e,
        frame::IcmpError {
            src: frontend.0,
            dst: client.0,
            icmp_type: 3,
            code: 4,
            quoted: (frame::TCP, client.0, client.1, frontend.0, frontend.1),
        },
        "{what}: the answer"
    );
    assert_eq!(
        &out[34 + 6..34 + 8],
        &mtu.to_be_bytes(),
        "{what}: the next-hop MTU field"
    );
    assert_eq!(
        &out[34 + 8..],
        &sent[14..14 + 40],
        "{what}: the quote must be the packet as the client sent it"
    );
    let (dst, src) = macs(sent);
    assert_eq!(macs(out), (src, dst), "{what}: not sent back to the sender");
}

/// `frame` without IPv4's don't-fragment flag, its header checksum made
/// right again.
fn without_df(frame: &[u8]) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[14 + 6] &= !0x40;
    f[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
    let c = frame::csum(&f[14..34], 0);
    f[14 + 10..14 + 12].copy_from_slice(&c.to_be_bytes());
    f
}

/// A SNATed flow whose route to the backend has an MTU of 1280 (locked: the
/// kernel's FIB lookup helper reports an unlocked route MTU as the
/// device's, though forwarding keeps to it): a segment
/// that fits (1,280 bytes) is sent on; a longer one with DF is answered
/// "fragmentation needed" with the route's MTU, from the frontend (the LB
/// IP), quoting the segment as the client sent it, and one without DF is
/// dropped (fragmenting it is the stack's, which would refuse its new
/// source), both counted `too_big`; XDP leaves it to tc untouched. A new
/// flow's first packet too long for the route is answered the same and
/// makes no flow.
#[test]
fn a_snated_packet_longer_than_the_route_mtu_is_answered_fragmentation_needed() {
    let nf = node_fixture();
    nf.ns
        .ip(&[
            "route",
            "replace",
            "10.1.2.0/24",
            "via",
            "192.168.50.2",
            "mtu",
            "lock",
            "1280",
        ])
        .expect("a route of MTU 1280 to the remote pods");
    let client = (OUTSIDE, 47100);
    let lb = (LB_IP, 80);
    let (ret, _) = run_tc_on_uplink(&nf, &tcp(client.0, client.1, lb.0, lb.1, frame::SYN));
    assert_eq!(ret, TC_ACT_REDIRECT, "SYN to the LB IP: verdict");

    let fits = segment(client, lb, frame::ACK, 1280 - 40);
    let (ret, out) = run_tc_on_uplink(&nf, &fits);
    assert_eq!(ret, TC_ACT_REDIRECT, "a 1,280-byte segment: verdict");
    let p = parse_checked(&out, "a 1,280-byte segment");
    assert_eq!(
        (p.src, p.dst),
        (NODE_IP, REMOTE_POD),
        "a 1,280-byte segment"
    );
    assert_eq!(
        counter(&nf.fx, "too_big"),
        0,
        "a segment that fits, counted too_big"
    );

    let long = segment(client, lb, frame::ACK, 1281 - 40);
    let (ret, out) = run_xdp(&nf, &long);
    assert_eq!(
        (ret, &out),
        (XDP_PASS, &long),
        "XDP must leave a segment too long for its route to tc untouched"
    );
    let (ret, out) = run_tc_on_uplink(&nf, &long);
    assert_frag_needed(
        (ret, &out),
        &long,
        client,
        lb,
        "a 1,281-byte segment with DF",
    );
    assert_eq!(counter(&nf.fx, "too_big"), 1, "too_big");

    let (ret, _) = run_tc_on_uplink(&nf, &without_df(&long));
    assert_eq!(ret, TC_ACT_SHOT, "a 1,281-byte segment without DF: verdict");
    assert_eq!(counter(&nf.fx, "too_big"), 2, "too_big without DF");

    let (entries, new_flows) = (ct_len(&nf.fx), counter(&nf.fx, "dnat_new"));
    let first = segment((OUTSIDE, 47101), lb, frame::SYN, 1400);
    let (ret, out) = run_tc_on_uplink(&nf, &first);
    assert_frag_needed(
        (ret, &out),
        &first,
        (OUTSIDE, 47101),
        lb,
        "a new flow's first packet too long",
    );
    assert_eq!(counter(&nf.fx, "too_big"), 3, "too_big");
    assert_eq!(
        (ct_len(&nf.fx), counter(&nf.fx, "dnat_new")),
        (entries, new_flows),
        "a first packet answered too big made a flow"
    );
}

/// A ClusterIP flow the stack forwards (DNAT alone) keeps its route's MTU
/// (1280, its device's here) in its forward conntrack entry (`path_mtu`); a
/// segment of it
/// longer than that, with DF, is answered "fragmentation needed" from the
/// ClusterIP, quoting the segment as the client sent it; one that fits is
/// translated and passed on.
#[test]
fn a_cluster_ip_flow_keeps_its_route_mtu_and_longer_packets_are_answered() {
    let nf = node_fixture();
    for args in [
        vec!["link", "set", "up0", "mtu", "1280"],
        vec!["route", "add", "10.200.0.0/24", "dev", "up0"],
    ] {
        nf.ns
            .ip(&args)
            .expect("a route to the backends over a device of MTU 1280");
    }
    let client = (CLIENT, 47200);
    let vip = (VIP, 80);
    let (ret, out) = run_tc_on_uplink(&nf, &tcp(client.0, client.1, vip.0, vip.1, frame::SYN));
    assert_eq!(ret, TC_PASS, "SYN to the ClusterIP: verdict");
    let backend = parse_checked(&out, "DNATed SYN").dst;
    assert!(BACKENDS.contains(&backend), "SYN sent to {backend}");

    let key = ct_key(client.0, client.1, vip.0, vip.1, proxy_common::PROTO_TCP);
    let maps = &nf.fx.datapath.maps;
    let entry = [&maps.ct_new, &maps.conntrack]
        .into_iter()
        .find_map(|m| m.get(&key, 0).ok())
        .expect("the flow's forward entry");
    assert_eq!(
        (entry.dir, entry.path_mtu),
        (proxy_common::ct_dir::FORWARD, 1280),
        "the forward entry's (direction, path_mtu)"
    );

    let fits = segment(client, vip, frame::ACK, 1280 - 40);
    let (ret, out) = run_tc_on_uplink(&nf, &fits);
    assert_eq!(ret, TC_PASS, "a 1,280-byte segment: verdict");
    assert_eq!(parse_checked(&out, "a 1,280-byte segment").dst, backend);

    let long = segment(client, vip, frame::ACK, 1281 - 40);
    let (ret, out) = run_tc_on_uplink(&nf, &long);
    assert_frag_needed((ret, &out), &long, client, vip, "a 1,281-byte segment");
    assert_eq!(counter(&nf.fx, "too_big"), 1, "too_big");
}

/// Opens one TCP flow to `VIP:80` from `sport` and assures it (the
/// client's packet after the backend's answer); its backend.
fn assured_flow(fx: &Fixture, sport: u16) -> Ipv4Addr {
    let (_, out) = run(fx, &tcp(CLIENT, sport, VIP, 80, frame::SYN));
    let backend = parse_checked(&out, "DNATed SYN").dst;
    assert!(BACKENDS.contains(&backend), "SYN sent to {backend}");
    run(
        fx,
        &tcp(backend, 8080, CLIENT, sport, frame::SYN | frame::ACK),
    );
    run(fx, &tcp(CLIENT, sport, VIP, 80, frame::ACK));
    backend
}

/// A backend's packet from its serving port that conntrack does not know
/// (its reply to a client that reached it by its pod IP, no Service)
/// passes untouched and leaves no entry: the prefilter turns it away, as
/// no flow marked its tuple; from that same address and port, a
/// connection to a ClusterIP is still translated: the prefilter's bits of
/// the destination decide whether the frontends are looked up.
#[test]
fn a_backends_packet_conntrack_does_not_know_passes_and_its_own_connections_are_translated() {
    let fx = fixture();
    let backend = BACKENDS[0];
    let reply = tcp(backend, 8080, CLIENT, 41900, frame::ACK);
    let (ret, out) = run(&fx, &reply);
    assert_eq!(
        (ret, &out),
        (TC_PASS, &reply),
        "a backend's packet to a client that reached it directly was not passed untouched"
    );
    let key = ct_key(backend, 8080, CLIENT, 41900, proxy_common::PROTO_TCP);
    let maps = &fx.datapath.maps;
    assert!(
        maps.ct_new.get(&key, 0).is_err() && maps.conntrack.get(&key, 0).is_err(),
        "the passed packet left a conntrack entry"
    );

    let syn = tcp(backend, 8080, VIP, 80, frame::SYN);
    let (_, out) = run(&fx, &syn);
    let p = parse_checked(
        &out,
        "a backend's SYN from its serving port to the ClusterIP",
    );
    assert!(
        BACKENDS.contains(&p.dst) && p.dport == 8080,
        "a backend's connection from its serving port to the ClusterIP went to {}:{}",
        p.dst,
        p.dport
    );
}

/// The slot of a flow's reply key in the prefilter's flows' array.
fn reply_slot(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> u32 {
    let addr = |ip: Ipv4Addr| proxy_common::v4_mapped(u32::from_ne_bytes(ip.octets()));
    proxy_common::prefilter::flows::slot(
        &addr(src),
        sport.to_be(),
        &addr(dst),
        dport.to_be(),
        proxy_common::PROTO_TCP,
    )
}

fn flow_marks(fx: &Fixture) -> &proxy_userspace::datapath::prefilter_flows::FlowMarks {
    fx.datapath
        .maps
        .prefilter_flows
        .as_ref()
        .expect("the datapath has flow marks")
}

/// A flow's replies pass the prefilter by the mark its SYN left on their
/// tuple, and by nothing else: a flow put into conntrack behind the
/// datapath's back, unmarked, has its reply turned away untranslated
/// until a refresh of the marks reads it from conntrack; once it is gone
/// from conntrack, two refreshes clear its mark. Opening the marks passes
/// everything; a refresh whose read of conntrack fails leaves its half
/// marked whole.
#[test]
fn a_flows_replies_pass_the_prefilter_by_its_mark_alone() {
    use proxy_userspace::datapath::prefilter_rebuild;
    let mut fx = fixture();
    assert!(
        !flow_marks(&fx).is_marked(reply_slot(BACKENDS[0], 8080, CLIENT, 42_100)),
        "a settled array marked a tuple no flow has"
    );
    let backend = assured_flow(&fx, 42_100);
    assert!(
        flow_marks(&fx).is_marked(reply_slot(backend, 8080, CLIENT, 42_100)),
        "the SYN's flow left its reply's tuple unmarked"
    );
    let reply = tcp(backend, 8080, CLIENT, 42_100, frame::ACK);
    let (_, out) = run(&fx, &reply);
    assert_eq!(
        parse_checked(&out, "the flow's reply").src,
        VIP,
        "the marked flow's reply was not translated back"
    );

    // The same flow's two entries again for another client port, written
    // here: the datapath never saw its SYN.
    let proto = proxy_common::PROTO_TCP;
    let conntrack = &mut fx.datapath.maps.conntrack;
    let forward = conntrack
        .get(&ct_key(CLIENT, 42_100, VIP, 80, proto), 0)
        .expect("the assured flow's entry in CONNTRACK");
    conntrack
        .insert(ct_key(CLIENT, 42_101, VIP, 80, proto), forward, 0)
        .expect("writing the unmarked flow's entry");
    let mut value = conntrack
        .get(&ct_key(backend, 8080, CLIENT, 42_100, proto), 0)
        .expect("the assured flow's reply entry in CONNTRACK");
    value.alt_port_be = 42_101u16.to_be();
    let unmarked_key = ct_key(backend, 8080, CLIENT, 42_101, proto);
    conntrack
        .insert(unmarked_key, value, 0)
        .expect("writing the unmarked flow's reply entry");
    let slot = reply_slot(backend, 8080, CLIENT, 42_101);
    assert!(
        !flow_marks(&fx).is_marked(slot),
        "the written flow's tuple shares a slot with another: pick another port"
    );
    let reply = tcp(backend, 8080, CLIENT, 42_101, frame::ACK);
    assert_eq!(
        run(&fx, &reply),
        (TC_PASS, reply.clone()),
        "an unmarked flow's reply was not turned away untouched: the prefilter let it through for something other than its mark"
    );

    prefilter_rebuild::refresh_flows(&fx.datapath.maps)
        .expect("refreshing the flow marks")
        .expect("the datapath has flow marks");
    assert!(
        flow_marks(&fx).is_marked(slot),
        "a refresh left a flow in CONNTRACK unmarked"
    );
    let (_, out) = run(&fx, &reply);
    assert_eq!(
        parse_checked(&out, "the written flow's reply, marked").src,
        VIP,
        "the written flow's reply was not translated once marked"
    );

    fx.datapath
        .maps
        .conntrack
        .remove(&unmarked_key)
        .expect("removing the written reply entry");
    prefilter_rebuild::settle(&fx.datapath.maps).expect("settling the flow marks");
    let marks = flow_marks(&fx);
    assert!(
        !marks.is_marked(slot),
        "two refreshes kept a gone flow's mark"
    );
    assert!(
        marks.is_marked(reply_slot(backend, 8080, CLIENT, 42_100)),
        "two refreshes cleared a live flow's mark"
    );

    marks.open();
    assert_eq!(
        marks.marked(),
        proxy_common::prefilter::flows::SLOTS,
        "opened marks left slots unmarked"
    );
    prefilter_rebuild::settle(&fx.datapath.maps).expect("settling the flow marks");
    let failed = marks.refresh(|_| Err("a read of conntrack that fails"));
    assert!(failed.is_err(), "a failed read was reported as a refresh");
    assert_eq!(
        marks.marked(),
        proxy_common::prefilter::flows::SLOTS,
        "a refresh whose read failed left its half with slots unmarked"
    );
}

/// Refreshes of the flow marks, run without pause on another thread while
/// new flows start here, never leave a flow's reply unmarked: each new
/// flow's tuple is marked right after its SYN, and its reply translated.
/// Flows start until eight refreshes have run beside them.
#[test]
fn refreshes_beside_new_flows_never_unmark_a_live_flow() {
    use proxy_userspace::datapath::prefilter_rebuild;
    const REFRESHES: u32 = 8;
    let fx = fixture();
    let marks = flow_marks(&fx);
    let refreshes = AtomicU32::new(0);
    let flows = std::thread::scope(|scope| {
        scope.spawn(|| {
            while refreshes.load(Ordering::Relaxed) < REFRESHES {
                prefilter_rebuild::refresh_flows(&fx.datapath.maps)
                    .expect("refreshing the flow marks");
                refreshes.fetch_add(1, Ordering::Relaxed);
            }
        });
        let mut flows = 0u32;
        for sport in (20_000u16..60_000).cycle() {
            if refreshes.load(Ordering::Relaxed) >= REFRESHES {
                break;
            }
            let (_, out) = run(&fx, &tcp(CLIENT, sport, VIP, 80, frame::SYN));
            let backend = parse_checked(&out, "DNATed SYN").dst;
            assert!(
                marks.is_marked(reply_slot(backend, 8080, CLIENT, sport)),
                "flow from port {sport}: its reply's tuple unmarked right after its SYN"
            );
            let (_, out) = run(
                &fx,
                &tcp(backend, 8080, CLIENT, sport, frame::SYN | frame::ACK),
            );
            assert_eq!(
                parse_checked(&out, "SYN-ACK").src,
                VIP,
                "flow from port {sport}: its SYN-ACK was not translated back"
            );
            flows += 1;
        }
        flows
    });
    assert!(
        flows > 2 * REFRESHES,
        "only {flows} flows started beside {REFRESHES} refreshes: the test did not test them"
    );
}

/// `CLIENT`:`sport`'s flow to `VIP`:80 (`assured_flow`) still goes to
/// `backend`:8080, and its reply comes back from `VIP`:80.
fn translated_both_ways(fx: &Fixture, sport: u16, backend: Ipv4Addr, when: &str) {
    let (ret, out) = run(fx, &tcp(CLIENT, sport, VIP, 80, frame::ACK));
    assert_eq!(ret, TC_PASS, "the flow's packet {when}");
    let p = parse_checked(&out, &format!("the flow's packet {when}"));
    assert_eq!(
        (p.dst, p.dport),
        (backend, 8080),
        "the flow's packet {when} was not sent to its backend"
    );
    let (_, out) = run(fx, &tcp(backend, 8080, CLIENT, sport, frame::ACK));
    let r = parse_checked(&out, &format!("the flow's reply {when}"));
    assert_eq!(
        (r.src, r.sport),
        (VIP, 80),
        "the flow's reply {when} was not translated back"
    );
}

/// The prefilter's bits of a Service that went are cleared by a rebuild,
/// except where a flow in conntrack still needs them: that flow goes on
/// being translated both ways, as a flow outlives its Service in
/// kube-proxy's conntrack, while a new connection to the address passes
/// untouched.
#[test]
fn a_prefilter_rebuild_clears_what_went_and_keeps_what_flows_still_use() {
    use proxy_userspace::datapath::{prefilter::service_bit, prefilter_rebuild};
    let mut fx = fixture();
    let backend = assured_flow(&fx, 41700);
    let (tcp_key, udp_key) = (
        service_key(VIP, 80, frame::TCP),
        service_key(VIP, 53, frame::UDP),
    );
    let holds = |fx: &Fixture, k: &proxy_common::ServiceKey| {
        prefilter_of(&fx.datapath).holds(service_bit(k))
    };
    assert!(
        holds(&fx, &tcp_key) && holds(&fx, &udp_key),
        "the frontends' bits are set as they are programmed"
    );

    // Services svc0 (VIP:80/TCP, with the flow) and svc1 (VIP:53/UDP,
    // without) go.
    for name in ["svc0", "svc1"] {
        let owner = ObjectKey {
            namespace: "test".into(),
            name: name.into(),
        };
        let out = fx.planner.sync_service(&owner, &[], &mut fx.datapath.maps);
        assert!(out.errors.is_empty(), "removing {name}: {:?}", out.errors);
    }
    let rebuilt = prefilter_rebuild::rebuild(&fx.datapath.maps)
        .expect("rebuilding the prefilter")
        .expect("the datapath has a prefilter");
    assert!(
        rebuilt.changed > 0,
        "the rebuild cleared nothing: {rebuilt:?}"
    );
    assert!(
        !holds(&fx, &udp_key),
        "VIP:53/UDP went with no flow left, and its bit is still set"
    );
    assert!(
        holds(&fx, &tcp_key),
        "VIP:80/TCP still has a flow in conntrack, and the rebuild cleared its bit"
    );

    translated_both_ways(
        &fx,
        41700,
        backend,
        "after its Service went and the rebuild",
    );
    let syn = tcp(CLIENT, 41701, VIP, 80, frame::SYN);
    let (ret, out) = run(&fx, &syn);
    assert_eq!(
        (ret, &out),
        (TC_PASS, &syn),
        "a new connection to a frontend that went was not passed untouched"
    );
}

/// The bit of a backend's replies' source key, TCP, on `port`.
fn source_bit(ip: Ipv4Addr, port: u16) -> u32 {
    proxy_userspace::datapath::prefilter::backend_bit(&proxy_common::Backend {
        addr_be: addr_words(IpAddr::V4(ip)),
        port_be: port.to_be(),
        proto: frame::TCP,
        flags: 0,
    })
}

fn prefilter_of(datapath: &Datapath) -> &proxy_userspace::datapath::prefilter::Prefilter {
    datapath
        .maps
        .prefilter
        .as_ref()
        .expect("the datapath has a prefilter")
}

/// Service `vip`:80/TCP to `backend`:8080, for `reprogram`.
fn to_one_backend(vip: Ipv4Addr, backend: Ipv4Addr) -> Frontend {
    frontend(
        vip,
        80,
        Protocol::Tcp,
        &[backend],
        8080,
        NoEndpointAction::Reject,
    )
}

/// The key of frontend `vip`:`port` over `proto`.
fn service_key(vip: Ipv4Addr, port: u16, proto: u8) -> proxy_common::ServiceKey {
    proxy_common::ServiceKey {
        addr_be: addr_words(IpAddr::V4(vip)),
        port_be: port.to_be(),
        proto,
        scope: proxy_common::scope::ANY,
    }
}

/// Backends' source bits, which only an earlier agent's programs read, are
/// set from a load until they are retired (the agent retires them once its
/// programs are attached), and by no landing or rebuild after: a new
/// backend then sets only its frontend's bits. A flow from before goes on
/// being translated both ways, its replies passing by their flow's mark.
#[test]
fn backend_source_bits_are_kept_from_a_load_until_retired() {
    use proxy_userspace::datapath::{prefilter::service_bit, prefilter_rebuild};
    let mut fx = fixture();
    let flow_backend = assured_flow(&fx, 41900);
    assert!(
        !prefilter_of(&fx.datapath).keeps_sources()
            && BACKENDS
                .iter()
                .all(|b| !prefilter_of(&fx.datapath).holds(source_bit(*b, 8080))),
        "the fixture's datapath was settled, and keeps backends' source bits still"
    );

    // A second load on the same pins, as an upgrade's: the earlier
    // programs may still be attached, so the bits are back. The fixture's
    // planner writes the same pinned maps, through its prefilter.
    fx.datapath = Datapath::load(fx.pins.clone()).expect("loading again on the same pins");
    assert!(
        prefilter_of(&fx.datapath).keeps_sources(),
        "a load keeps no source bits"
    );
    for backend in BACKENDS {
        assert!(
            prefilter_of(&fx.datapath).holds(source_bit(backend, 8080)),
            "the load's rebuild left out backend {backend}:8080's source bit"
        );
    }
    let (early, late) = (Ipv4Addr::new(10, 244, 9, 1), Ipv4Addr::new(10, 244, 9, 2));
    let late_vip = Ipv4Addr::new(10, 96, 9, 2);
    reprogram(
        &mut fx,
        "early",
        to_one_backend(Ipv4Addr::new(10, 96, 9, 1), early),
    );
    assert!(
        prefilter_of(&fx.datapath).holds(source_bit(early, 8080)),
        "a backend landed before the retirement did not set its source bit"
    );

    let retired = prefilter_rebuild::retire_sources(&fx.datapath.maps)
        .expect("retiring the source bits")
        .expect("the datapath has a prefilter that kept them");
    assert!(
        retired.changed > 0,
        "the retirement cleared nothing: {retired:?}"
    );
    for backend in BACKENDS.into_iter().chain([early]) {
        assert!(
            !prefilter_of(&fx.datapath).holds(source_bit(backend, 8080)),
            "backend {backend}:8080's source bit outlived the retirement"
        );
    }
    assert_eq!(
        prefilter_rebuild::retire_sources(&fx.datapath.maps).expect("retiring again"),
        None,
        "a second retirement found source bits kept"
    );

    reprogram(&mut fx, "late", to_one_backend(late_vip, late));
    let late_key = service_key(late_vip, 80, frame::TCP);
    let late_bits = |fx: &Fixture| {
        let prefilter = prefilter_of(&fx.datapath);
        (
            prefilter.holds(service_bit(&late_key)),
            prefilter.holds(source_bit(late, 8080)),
        )
    };
    assert_eq!(
        late_bits(&fx),
        (true, false),
        "a backend landed after the retirement: (its frontend's bit, its source bit) set"
    );
    prefilter_rebuild::rebuild(&fx.datapath.maps)
        .expect("rebuilding the prefilter")
        .expect("the datapath has a prefilter");
    assert!(
        !prefilter_of(&fx.datapath).holds(source_bit(flow_backend, 8080))
            && late_bits(&fx) == (true, false),
        "a rebuild after the retirement set a backend's source bit again"
    );

    // The load opened every flow mark; the housekeeping's refreshes leave
    // what conntrack holds.
    for _ in 0..2 {
        prefilter_rebuild::refresh_flows(&fx.datapath.maps).expect("refreshing the flow marks");
    }
    translated_both_ways(&fx, 41900, flow_backend, "after the retirement");
}

/// Pins that lack the prefilter (an older agent's) get one at load,
/// written from the maps before any program runs: the flows and frontends
/// already there are translated by the new programs.
#[test]
fn a_load_on_pins_without_a_prefilter_writes_it_from_the_maps() {
    let fx = fixture();
    let backend = assured_flow(&fx, 41800);
    std::fs::remove_file(fx.pins.map(map_names::PREFILTER)).expect("unpinning PREFILTER");
    let next = Datapath::load(fx.pins.clone()).expect("loading again on the same pins");
    let tc = next.tc_program();

    let (_, out) = run_program(tc, &tcp(CLIENT, 41800, VIP, 80, frame::ACK))
        .expect("running the new tc program");
    let p = parse_checked(&out, "established packet through the new programs");
    assert_eq!(
        (p.dst, p.dport),
        (backend, 8080),
        "the flow from before the load lost its backend"
    );
    let (_, out) =
        run_program(tc, &udp(CLIENT, 41801, VIP, 53, false)).expect("running the new tc program");
    let q = parse_checked(&out, "new UDP flow through the new programs");
    assert!(
        BACKENDS.contains(&q.dst) && q.dport == 5353,
        "a new flow to a frontend from before the load went to {}:{}",
        q.dst,
        q.dport
    );
    assert!(
        fx.pins.map(map_names::PREFILTER).exists(),
        "the new prefilter was not pinned"
    );
}

/// kube-proxy's nftables mode over the service CIDRs: a packet to an
/// address of one that no Service holds is dropped (`drop_unallocated`),
/// one to a ClusterIP on a port its Service does not define rejected
/// (`reject_undefined_port`: a reset for TCP, port unreachable for UDP);
/// the Service's own ports, addresses outside the CIDRs, and another
/// proxy's ClusterIPs, as before.
#[test]
fn service_cidrs_drop_unallocated_addresses_and_reject_undefined_ports() {
    let mut fx = fixture();
    let unallocated = Ipv4Addr::new(10, 96, 0, 99);
    let outside = Ipv4Addr::new(10, 97, 0, 1);
    let (ret, _) = run(&fx, &tcp(CLIENT, 40100, unallocated, 80, frame::SYN));
    assert_eq!(ret, TC_PASS, "no service CIDR known yet: passed");

    let foreign = Ipv4Addr::new(10, 96, 0, 98);
    write_service_cidrs(
        &mut fx.datapath.maps,
        &["10.96.0.0/16"],
        &[IpAddr::V4(VIP)],
        &[IpAddr::V4(foreign)],
    );
    let (ret, _) = run(&fx, &tcp(CLIENT, 40101, unallocated, 80, frame::SYN));
    assert_eq!(ret, TC_ACT_SHOT, "an unallocated address of the CIDR");
    let (ret, _) = run(&fx, &udp(CLIENT, 40102, unallocated, 53, false));
    assert_eq!(ret, TC_ACT_SHOT, "UDP to an unallocated address");
    assert_eq!(counter(&fx, "drop_unallocated"), 2);

    let syn = tcp(CLIENT, 40103, VIP, 81, frame::SYN);
    let (ret, out) = run(&fx, &syn);
    assert_eq!(
        ret, TC_ACT_REDIRECT,
        "a ClusterIP's undefined port: rejected"
    );
    let p = parse_checked(&out, "RST");
    assert_eq!(
        (p.src, p.sport, p.dst, p.dport, out[14 + 20 + 13]),
        (VIP, 81, CLIENT, 40103, frame::RST | frame::ACK),
        "the reset comes from the ClusterIP's port to the client"
    );
    let (ret, out) = run(&fx, &udp(CLIENT, 40104, VIP, 54, false));
    assert_eq!(ret, TC_ACT_REDIRECT);
    let p = parse_checked(&out, "ICMP port unreachable");
    assert_eq!(
        (p.proto, p.src, p.dst, out[34], out[35]),
        (1, VIP, CLIENT, 3, 3),
        "UDP to an undefined port: port unreachable from the ClusterIP"
    );
    assert_eq!(counter(&fx, "reject_undefined_port"), 2);

    let (ret, out) = run(&fx, &tcp(CLIENT, 40105, VIP, 80, frame::SYN));
    assert_eq!(ret, TC_PASS, "the Service's own port is translated");
    let p = parse_checked(&out, "DNATed SYN");
    assert!(BACKENDS.contains(&p.dst), "DNATed to {}", p.dst);
    let (ret, out) = run(&fx, &tcp(CLIENT, 40106, outside, 80, frame::SYN));
    assert_eq!(
        (ret, parse_checked(&out, "outside").dst),
        (TC_PASS, outside),
        "outside the CIDRs: passed untouched"
    );

    let (ret, out) = run(&fx, &tcp(CLIENT, 40108, foreign, 80, frame::SYN));
    assert_eq!(
        (ret, parse_checked(&out, "foreign").dst),
        (TC_PASS, foreign),
        "another proxy's ClusterIP: passed untouched, for that proxy"
    );

    // The ClusterIP released: its address is as unallocated as any.
    write_service_cidrs(&mut fx.datapath.maps, &["10.96.0.0/16"], &[], &[]);
    let (ret, _) = run(&fx, &tcp(CLIENT, 40107, VIP, 81, frame::SYN));
    assert_eq!(ret, TC_ACT_SHOT, "a released ClusterIP's port");
    assert_eq!(counter(&fx, "drop_unallocated"), 3);
}

/// A service CIDR wider than an IPv4 /8 (more blocks of 256 than
/// `MAX_BLOCKS`): IPv4's programs do not read `WIDE_BIT`, so the agent sets
/// every one of its blocks' bits, and an unallocated address anywhere in
/// it is dropped at tc and at XDP, while an address past it passes.
#[test]
fn a_service_cidr_wider_than_a_slash_8_drops_its_unallocated_addresses() {
    let mut nf = node_fixture();
    write_service_cidrs(
        &mut nf.fx.datapath.maps,
        &["10.0.0.0/7"],
        &[IpAddr::V4(VIP)],
        &[],
    );
    for (i, addr) in [Ipv4Addr::new(10, 1, 2, 3), Ipv4Addr::new(11, 255, 0, 9)]
        .into_iter()
        .enumerate()
    {
        let port = 40300 + 2 * i as u16;
        let (ret, _) = run(&nf.fx, &tcp(CLIENT, port, addr, 80, frame::SYN));
        assert_eq!(ret, TC_ACT_SHOT, "{addr} in 10.0.0.0/7, unallocated, at tc");
        let (ret, _) = run_xdp(&nf, &tcp(CLIENT, port + 1, addr, 80, frame::SYN));
        assert_eq!(ret, XDP_DROP, "{addr} in 10.0.0.0/7, unallocated, at XDP");
    }
    assert_eq!(counter(&nf.fx, "drop_unallocated"), 4);
    let past = tcp(CLIENT, 40310, Ipv4Addr::new(12, 0, 0, 1), 80, frame::SYN);
    let (ret, out) = run(&nf.fx, &past);
    assert_eq!(
        (ret, out),
        (TC_PASS, past),
        "an address past the range was not passed untouched"
    );
}

/// At XDP an unallocated address is dropped there; an undefined port of a
/// ClusterIP is left to tc, which sends the reject (counted there).
#[test]
fn xdp_drops_unallocated_addresses_and_leaves_rejects_to_tc() {
    let mut nf = node_fixture();
    write_service_cidrs(
        &mut nf.fx.datapath.maps,
        &["10.96.0.0/16"],
        &[IpAddr::V4(VIP)],
        &[],
    );
    let (ret, _) = run_xdp(
        &nf,
        &tcp(CLIENT, 40200, Ipv4Addr::new(10, 96, 7, 7), 80, frame::SYN),
    );
    assert_eq!(ret, XDP_DROP, "an unallocated address at XDP");
    assert_eq!(counter(&nf.fx, "drop_unallocated"), 1);
    let (ret, _) = run_xdp(&nf, &tcp(CLIENT, 40201, VIP, 81, frame::SYN));
    assert_eq!(ret, XDP_PASS, "an undefined port: on to tc");
    assert_eq!(
        counter(&nf.fx, "reject_undefined_port"),
        0,
        "counted by tc alone"
    );
}

/// Each Service port's counters at tc: a flow's first packet, its later
/// ones and a reply, packets and IP bytes each way; a reject and a drop
/// for want of endpoints on the Services they happened to, nothing on
/// another.
#[test]
fn service_counters_count_each_way_and_each_refusal_at_tc() {
    use proxy_common::service_drop;
    let fx = fixture();
    let (web, empty, local_only, idle) = (
        service_id_of(&fx.datapath.maps, VIP, 80),
        service_id_of(&fx.datapath.maps, EMPTY_VIP, 80),
        service_id_of(&fx.datapath.maps, LOCAL_ONLY_VIP, 80),
        service_id_of(&fx.datapath.maps, HAIRPIN_VIP, 80),
    );
    let syn = tcp(CLIENT, 41800, VIP, 80, frame::SYN);
    let (ret, out) = run(&fx, &syn);
    assert_eq!(ret, TC_PASS, "SYN to the ClusterIP");
    let backend = parse_checked(&out, "DNATed SYN").dst;
    let ack = tcp(CLIENT, 41800, VIP, 80, frame::ACK);
    for _ in 0..5 {
        assert_eq!(run(&fx, &ack).0, TC_PASS, "an established packet");
    }
    let reply = tcp(backend, 8080, CLIENT, 41800, frame::SYN | frame::ACK);
    assert_eq!(run(&fx, &reply).0, TC_PASS, "the backend's reply");
    let ip = |frame: &[u8]| frame.len() as u64 - 14;
    let got = service_totals(&fx.datapath.maps, web);
    assert_eq!(
        (got.flows, got.packets, got.bytes),
        (1, [6, 1], [ip(&syn) + 5 * ip(&ack), ip(&reply)]),
        "web's (flows, packets, bytes): one flow, its SYN and 5 packets to the backend, \
         one reply, each counted by its IP packet's length"
    );
    assert_eq!(
        (got.rejected, got.dropped),
        (0, [0; 3]),
        "web refused nothing"
    );

    assert_eq!(
        run(&fx, &tcp(CLIENT, 41801, EMPTY_VIP, 80, frame::SYN)).0,
        TC_ACT_REDIRECT,
        "no endpoints: a reset"
    );
    assert_eq!(
        run(&fx, &tcp(CLIENT, 41802, LOCAL_ONLY_VIP, 80, frame::SYN)).0,
        TC_ACT_SHOT,
        "no local endpoint: a drop"
    );
    let got = service_totals(&fx.datapath.maps, empty);
    assert_eq!(
        (got.rejected, got.flows, got.packets),
        (1, 0, [0, 0]),
        "empty's (rejects, flows, packets)"
    );
    let mut dropped = [0; 3];
    dropped[service_drop::NO_ENDPOINT as usize] = 1;
    assert_eq!(
        service_totals(&fx.datapath.maps, local_only).dropped,
        dropped,
        "local-only's drops by reason (source range, no endpoint, SNAT exhausted)"
    );
    assert_eq!(
        service_totals(&fx.datapath.maps, idle),
        proxy_userspace::datapath::service_counters::Totals::default(),
        "a Service without traffic counts nothing"
    );
}

/// At XDP: a drop by source range and one for want of a local endpoint on
/// their Services; a reject left to tc, counted once, by tc; a flow XDP
/// sends back out counted there.
#[test]
fn service_counters_count_at_xdp_and_once_what_xdp_leaves_to_tc() {
    use proxy_common::service_drop;
    let nf = node_fixture();
    let fx = &nf.fx;
    let (lb, local_only, empty) = (
        service_id_of(&fx.datapath.maps, LB_IP, 80),
        service_id_of(
            &fx.datapath.maps,
            Ipv4Addr::UNSPECIFIED,
            LOCAL_ONLY_NODE_PORT,
        ),
        service_id_of(&fx.datapath.maps, Ipv4Addr::UNSPECIFIED, EMPTY_NODE_PORT),
    );
    let denied = tcp(OUTSIDE_DENIED, 43100, LB_IP, 80, frame::SYN);
    assert_eq!(
        run_xdp(&nf, &denied).0,
        XDP_DROP,
        "outside the source ranges"
    );
    let allowed = tcp(OUTSIDE, 43101, LB_IP, 80, frame::SYN);
    assert_eq!(run_xdp(&nf, &allowed).0, XDP_REDIRECT, "inside them");
    let got = service_totals(&fx.datapath.maps, lb);
    let mut dropped = [0; 3];
    dropped[service_drop::SOURCE_RANGE as usize] = 1;
    assert_eq!(
        (got.dropped, got.flows, got.packets[0], got.bytes[0]),
        (dropped, 1, 1, allowed.len() as u64 - 14),
        "the LB's (drops by reason, flows, packets and bytes to the backend)"
    );

    let local = tcp(OUTSIDE, 43102, NODE_IP, LOCAL_ONLY_NODE_PORT, frame::SYN);
    assert_eq!(run_xdp(&nf, &local).0, XDP_DROP, "no local endpoint");
    let mut dropped = [0; 3];
    dropped[service_drop::NO_ENDPOINT as usize] = 1;
    assert_eq!(
        service_totals(&fx.datapath.maps, local_only).dropped,
        dropped,
        "the local-only NodePort's drops by reason"
    );

    let syn = tcp(OUTSIDE, 43103, NODE_IP, EMPTY_NODE_PORT, frame::SYN);
    assert_eq!(run_xdp(&nf, &syn).0, XDP_PASS, "no endpoints: left to tc");
    assert_eq!(
        service_totals(&fx.datapath.maps, empty).rejected,
        0,
        "XDP leaves the reject to tc, uncounted"
    );
    run_tc_on_uplink(&nf, &syn);
    assert_eq!(
        service_totals(&fx.datapath.maps, empty).rejected,
        1,
        "tc rejects it, counted once"
    );
}

/// The pinned `TRACE_ON` and `TRACE_EVENTS` under `pins`.
fn trace_maps(
    pins: &PinLayout,
) -> (
    aya::maps::Array<aya::maps::MapData, u64>,
    aya::maps::RingBuf<aya::maps::MapData>,
) {
    let open = |name: &str| {
        let data = aya::maps::MapData::from_pin(pins.map(name))
            .unwrap_or_else(|e| panic!("opening the pinned {name}: {e}"));
        aya::maps::Map::from_map_data(data).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    (
        open(map_names::TRACE_ON)
            .try_into()
            .expect("TRACE_ON an array"),
        open(map_names::TRACE_EVENTS)
            .try_into()
            .expect("TRACE_EVENTS a ring buffer"),
    )
}

/// Every record waiting in the ring buffer.
fn drain(events: &mut aya::maps::RingBuf<aya::maps::MapData>) -> Vec<TraceRecord> {
    let mut out = Vec::new();
    while let Some(item) = events.next() {
        out.push(
            *bytemuck::try_from_bytes::<TraceRecord>(&item)
                .unwrap_or_else(|e| panic!("a record of {} bytes: {e}", item.len())),
        );
    }
    out
}

/// `addr` as a record holds an IPv4 address: its first word, network order.
fn record_addr(addr: Ipv4Addr) -> [u32; 4] {
    [u32::from_ne_bytes(addr.octets()), 0, 0, 0]
}

/// With a trace running (`TRACE_ON` ahead of the clock), a new flow, a reject
/// and a drop each leave one record with the packet's addresses and ports, the
/// backend the flow went to and the Service port's id, and an established
/// flow's packet none; with `TRACE_ON` at 0 the same packets leave nothing.
#[test]
fn trace_records_new_flows_rejects_and_drops_while_switched_on_only() {
    use proxy_common::trace::{hook, reason, verdict};

    let fx = fixture();
    let (mut on, mut events) = trace_maps(&fx.pins);
    run(&fx, &tcp(CLIENT, 43_000, VIP, 80, frame::SYN));
    run(&fx, &tcp(CLIENT, 43_001, EMPTY_VIP, 80, frame::SYN));
    run(&fx, &tcp(CLIENT, 43_002, LOCAL_ONLY_VIP, 80, frame::SYN));
    assert_eq!(drain(&mut events), [], "records while no trace runs");

    on.set(0, u64::MAX, 0).expect("switching the trace on");
    let (ret, out) = run(&fx, &tcp(CLIENT, 43_010, VIP, 80, frame::SYN));
    assert_eq!(ret, TC_PASS, "the new flow passes translated");
    let backend = parse_checked(&out, "the new flow").dst;
    let (ret, _) = run(&fx, &tcp(CLIENT, 43_011, EMPTY_VIP, 80, frame::SYN));
    assert_ne!(ret, TC_ACT_SHOT, "a reject is sent, not dropped");
    let (ret, _) = run(&fx, &tcp(CLIENT, 43_012, LOCAL_ONLY_VIP, 80, frame::SYN));
    assert_eq!(ret, TC_ACT_SHOT, "no local endpoint: dropped");
    run(&fx, &tcp(CLIENT, 43_010, VIP, 80, frame::ACK));
    let records = drain(&mut events);
    on.set(0, 0, 0).expect("switching the trace off");

    let maps = &fx.datapath.maps;
    let record =
        |service_id, verdict, reason, port: u16, frontend, backend: Option<Ipv4Addr>| TraceRecord {
            service_id,
            verdict,
            reason,
            proto: proxy_common::PROTO_TCP,
            family: proxy_common::trace::family::V4,
            hook: hook::TC,
            _pad: 0,
            client_port_be: port.to_be(),
            frontend_port_be: 80u16.to_be(),
            backend_port_be: if backend.is_some() {
                8080u16.to_be()
            } else {
                0
            },
            client_be: record_addr(CLIENT),
            frontend_be: record_addr(frontend),
            backend_be: backend.map_or([0; 4], record_addr),
        };
    let expected = [
        record(
            service_id_of(maps, VIP, 80),
            verdict::TRANSLATED,
            0,
            43_010,
            VIP,
            Some(backend),
        ),
        record(
            service_id_of(maps, EMPTY_VIP, 80),
            verdict::REJECTED,
            0,
            43_011,
            EMPTY_VIP,
            None,
        ),
        record(
            service_id_of(maps, LOCAL_ONLY_VIP, 80),
            verdict::DROPPED,
            reason::NO_ENDPOINT,
            43_012,
            LOCAL_ONLY_VIP,
            None,
        ),
    ];
    assert_eq!(records, expected, "the records of a trace");

    run(&fx, &tcp(CLIENT, 43_020, VIP, 80, frame::SYN));
    assert_eq!(drain(&mut events), [], "records after the trace ended");
}

/// Packets to a service CIDR that no frontend answers are traced too, with no
/// Service (id 0): a drop of an unallocated address, a reject of a ClusterIP's
/// undefined port.
#[test]
fn trace_records_service_cidr_drops_and_rejects_without_a_service() {
    use proxy_common::trace::{family, hook, reason, verdict};

    let mut fx = fixture();
    write_service_cidrs(
        &mut fx.datapath.maps,
        &["10.96.0.0/16"],
        &[IpAddr::V4(VIP)],
        &[],
    );
    let (mut on, mut events) = trace_maps(&fx.pins);
    on.set(0, u64::MAX, 0).expect("switching the trace on");
    let unallocated = Ipv4Addr::new(10, 96, 0, 99);
    let (ret, _) = run(&fx, &tcp(CLIENT, 44_001, unallocated, 80, frame::SYN));
    assert_eq!(ret, TC_ACT_SHOT, "an unallocated address of the CIDR");
    let (ret, _) = run(&fx, &tcp(CLIENT, 44_002, VIP, 81, frame::SYN));
    assert_eq!(ret, TC_ACT_REDIRECT, "a ClusterIP's undefined port");
    let records = drain(&mut events);
    on.set(0, 0, 0).expect("switching the trace off");

    let record = |verdict, reason, port: u16, frontend: Ipv4Addr, frontend_port: u16| TraceRecord {
        service_id: 0,
        verdict,
        reason,
        proto: proxy_common::PROTO_TCP,
        family: family::V4,
        hook: hook::TC,
        _pad: 0,
        client_port_be: port.to_be(),
        frontend_port_be: frontend_port.to_be(),
        backend_port_be: 0,
        client_be: record_addr(CLIENT),
        frontend_be: record_addr(frontend),
        backend_be: [0; 4],
    };
    assert_eq!(
        records,
        [
            record(
                verdict::DROPPED,
                reason::UNALLOCATED,
                44_001,
                unallocated,
                80
            ),
            record(verdict::REJECTED, 0, 44_002, VIP, 81),
        ],
        "the records of a trace"
    );
}

// ---------------------------------------------------------------------------
// Direct server return on hand-built frames: the entry node's side (a remote
// backend keeps the client's address, the frontend carried in an IP option)
// and the backend node's (`tc_dsr`, reached by a tail call).

/// A pod of the fixture's node (node A's pod CIDR), for the backend node's
/// side.
const LOCAL_POD: Ipv4Addr = Ipv4Addr::new(10, 1, 1, 10);
/// A LoadBalancer IP whose one backend is `LOCAL_POD`: what another node
/// sends here by direct server return.
const LB_LOCAL_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 60, 12);

/// Programs `LB_LOCAL_IP`:80 -> `LOCAL_POD`:8080 on `nf`'s node.
fn add_local_lb(nf: &mut NodeFixture) {
    let mut lb = frontend(
        LB_LOCAL_IP,
        80,
        Protocol::Tcp,
        &[LOCAL_POD],
        8080,
        NoEndpointAction::Reject,
    );
    lb.kind = FrontendKind::LoadBalancer;
    let owner = ObjectKey {
        namespace: "test".into(),
        name: "lb-local".into(),
    };
    let out = nf
        .fx
        .planner
        .sync_service(&owner, &[lb], &mut nf.fx.datapath.maps);
    assert!(
        out.errors.is_empty(),
        "programming {LB_LOCAL_IP}: {:?}",
        out.errors
    );
}

/// `node_fixture` with `flags` (`node_config_flags`) set, DSR among them.
fn dsr_node_fixture(flags: u32) -> NodeFixture {
    let mut nf = node_fixture();
    nf.fx
        .datapath
        .maps
        .apply(&MapOp::SetNodeConfig {
            config: node_config(
                proxy_common::SNAT_PORT_MIN,
                proxy_common::SNAT_PORT_MAX,
                flags,
            ),
        })
        .expect("node config");
    nf
}

/// `frame` with the DSR option naming `frontend` after its IPv4 header, as
/// the entry node writes it.
fn with_dsr_option(frame: &[u8], frontend: (Ipv4Addr, u16)) -> Vec<u8> {
    let opt =
        proxy_common::dsr::ipv4_option(u32::from_ne_bytes(frontend.0.octets()), frontend.1.to_be());
    let mut f = frame[..34].to_vec();
    f.extend_from_slice(&opt);
    f.extend_from_slice(&frame[34..]);
    f[14] = 0x47;
    let tot = u16::from_be_bytes([f[16], f[17]]) + 8;
    f[16..18].copy_from_slice(&tot.to_be_bytes());
    f[24..26].copy_from_slice(&[0, 0]);
    let c = frame::csum(&f[14..42], 0);
    f[24..26].copy_from_slice(&c.to_be_bytes());
    f
}

/// The frontend the DSR option of `out` names, and `out` parsed (every
/// checksum checked) as it would be without the option: panics if the
/// header does not carry exactly that option, with a right checksum.
fn dsr_carried(out: &[u8], what: &str) -> ((Ipv4Addr, u16), frame::Parsed) {
    assert!(out.len() >= 42, "{what}: frame of {} bytes", out.len());
    assert_eq!(
        out[14], 0x47,
        "{what}: IHL must be 7 (20 bytes + the option)"
    );
    assert_eq!(
        frame::csum(&out[14..42], 0),
        0,
        "{what}: the IPv4 header checksum (over the option too) is wrong"
    );
    let opt: [u8; 8] = out[34..42].try_into().unwrap();
    let (addr, port) = proxy_common::dsr::ipv4_frontend(&opt)
        .unwrap_or_else(|| panic!("{what}: not the DSR option: {opt:02x?}"));
    let mut plain = out[..34].to_vec();
    plain.extend_from_slice(&out[42..]);
    plain[14] = 0x45;
    let tot = u16::from_be_bytes([plain[16], plain[17]]) - 8;
    plain[16..18].copy_from_slice(&tot.to_be_bytes());
    plain[24..26].copy_from_slice(&[0, 0]);
    let c = frame::csum(&plain[14..34], 0);
    plain[24..26].copy_from_slice(&c.to_be_bytes());
    (
        (Ipv4Addr::from(addr.to_ne_bytes()), u16::from_be(port)),
        parse_checked(&plain, what),
    )
}

/// With `--lb-mode dsr`, a NodePort flow to a remote backend is DNATed with
/// the client's address kept, the NodePort carried in the option, and sent
/// to the backend's node, by XDP (which moves the packet's head to make
/// room) as by tc; so is every later packet. A LoadBalancer IP's flow
/// carries the LB IP. `hybrid` does the same for TCP. No SNAT port is taken.
#[test]
fn dsr_keeps_the_client_and_carries_the_frontend_to_the_backends_node() {
    for (mode, flags) in [
        ("dsr", proxy_common::node_config_flags::DSR),
        (
            "hybrid",
            proxy_common::node_config_flags::DSR | proxy_common::node_config_flags::DSR_TCP_ONLY,
        ),
    ] {
        let nf = dsr_node_fixture(flags);
        let mut sport = 43000;
        for frontend in [(NODE_IP, NODE_PORT), (LB_IP, 80)] {
            for hook in ["xdp", "tc"] {
                sport += 1;
                let what = format!("{mode}, {}:{}, {hook}", frontend.0, frontend.1);
                for (packet, flags) in [("SYN", frame::SYN), ("ACK", frame::ACK)] {
                    let input = tcp(OUTSIDE, sport, frontend.0, frontend.1, flags);
                    let (ret, out) = if hook == "xdp" {
                        run_xdp(&nf, &input)
                    } else {
                        run_tc_on_uplink(&nf, &input)
                    };
                    let what = format!("{what}, {packet}");
                    let sent = if hook == "xdp" {
                        XDP_REDIRECT
                    } else {
                        TC_ACT_REDIRECT
                    };
                    assert_eq!(ret, sent, "{what}: verdict");
                    assert_eq!(out.len(), input.len() + 8, "{what}: length");
                    let (carried, p) = dsr_carried(&out, &what);
                    assert_eq!(carried, frontend, "{what}: the frontend carried");
                    assert_eq!(
                        (p.src, p.sport, p.dst, p.dport),
                        (OUTSIDE, sport, REMOTE_POD, 8080),
                        "{what}: the client's address kept, DNATed to the backend"
                    );
                    assert_eq!(macs(&out), (PEER_MAC, UPLINK_MAC), "{what}: to node B");
                    assert_eq!(out[22], input[22] - 1, "{what}: TTL taken down by one");
                }
            }
        }
        assert_eq!(counter(&nf.fx, "dsr_new"), 4, "{mode}: dsr_new");
        assert_eq!(
            counter(&nf.fx, "xdp_tx"),
            4,
            "{mode}: xdp_tx (XDP's SYNs and ACKs)"
        );
        assert_eq!(counter(&nf.fx, "xdp_to_tc"), 0, "{mode}: xdp_to_tc");
        assert_eq!(counter(&nf.fx, "snat_new"), 0, "{mode}: snat_new");
    }
}

/// Without DSR (the default), the same flow is SNATed as kube-proxy does:
/// the control of the test above.
#[test]
fn without_dsr_a_remote_backends_flow_is_snated() {
    let nf = node_fixture();
    let (ret, out) = run_tc_on_uplink(&nf, &tcp(OUTSIDE, 43100, NODE_IP, NODE_PORT, frame::SYN));
    assert_eq!(ret, TC_ACT_REDIRECT, "verdict");
    let p = parse_checked(&out, "SNATed SYN");
    assert_eq!((p.src, p.dst), (NODE_IP, REMOTE_POD), "SNAT, not DSR");
    assert_eq!(counter(&nf.fx, "dsr_new"), 0, "dsr_new");
}

/// The carrier's 8 bytes count against the route's MTU: with a route of
/// MTU 1280 to the backend's node, a segment of 1,272 bytes goes (1,280
/// with the option); one of 1,273 with DF is answered "fragmentation
/// needed" quoting it as the client sent it, with an MTU of 1,272, so
/// that the client's next segments fit with the option in.
#[test]
fn a_dsr_packet_too_long_for_the_option_is_answered_with_the_mtu_less_the_option() {
    let nf = dsr_node_fixture(proxy_common::node_config_flags::DSR);
    nf.ns
        .ip(&[
            "route",
            "replace",
            "10.1.2.0/24",
            "via",
            "192.168.50.2",
            "mtu",
            "lock",
            "1280",
        ])
        .expect("a route of MTU 1280 to the remote pods");
    let client = (OUTSIDE, 47200);
    let lb = (LB_IP, 80);
    let (ret, _) = run_tc_on_uplink(&nf, &tcp(client.0, client.1, lb.0, lb.1, frame::SYN));
    assert_eq!(ret, TC_ACT_REDIRECT, "SYN to the LB IP: verdict");
    let fits = segment(client, lb, frame::ACK, 1272 - 40);
    let (ret, out) = run_tc_on_uplink(&nf, &fits);
    assert_eq!(ret, TC_ACT_REDIRECT, "a 1,272-byte segment: verdict");
    assert_eq!(out.len(), 14 + 1280, "a 1,272-byte segment with the option");
    dsr_carried(&out, "a 1,272-byte segment");
    let (ret, out) = run_xdp(&nf, &fits);
    assert_eq!(ret, XDP_REDIRECT, "a 1,272-byte segment at XDP: verdict");
    assert_eq!(out.len(), 14 + 1280, "a 1,272-byte segment at XDP");
    dsr_carried(&out, "a 1,272-byte segment at XDP");
    let long = segment(client, lb, frame::ACK, 1273 - 40);
    // XDP cannot answer: tc does, with the packet as it came.
    assert_eq!(
        run_xdp(&nf, &long),
        (XDP_PASS, long.clone()),
        "a 1,273-byte segment at XDP: left to tc untouched"
    );
    let (ret, out) = run_tc_on_uplink(&nf, &long);
    assert_frag_needed_of((ret, &out), &long, client, lb, 1272, "a 1,273-byte segment");
    assert_eq!(counter(&nf.fx, "too_big"), 1, "too_big");
}

/// With DSR on, a packet whose options are the carrier's length is first a
/// packet like any other: to an unallocated address of a service CIDR it is
/// dropped, at tc and at XDP, not handed to `tc_dsr` (which passes what it
/// refuses); a ClusterIP's undefined port is still rejected.
#[test]
fn with_dsr_on_a_carrier_sized_packet_to_an_unallocated_service_address_is_still_dropped() {
    let mut nf = dsr_node_fixture(proxy_common::node_config_flags::DSR);
    let claimed = Ipv4Addr::new(10, 96, 0, 7);
    write_service_cidrs(
        &mut nf.fx.datapath.maps,
        &["10.96.0.0/16"],
        &[IpAddr::V4(claimed)],
        &[],
    );
    let unallocated = Ipv4Addr::new(10, 96, 0, 99);
    let sent = with_dsr_option(
        &tcp(OUTSIDE, 44100, unallocated, 80, frame::SYN),
        (LB_IP, 80),
    );
    let (ret, _) = run_tc_on_uplink(&nf, &sent);
    assert_eq!(
        ret, TC_ACT_SHOT,
        "tc: an unallocated address, carrier-sized options"
    );
    let (ret, _) = run_xdp(&nf, &sent);
    assert_eq!(
        ret, XDP_DROP,
        "XDP: an unallocated address, carrier-sized options"
    );
    assert_eq!(counter(&nf.fx, "drop_unallocated"), 2, "drop_unallocated");
    let sent = with_dsr_option(&tcp(OUTSIDE, 44101, claimed, 81, frame::SYN), (LB_IP, 80));
    let (ret, _) = run_tc_on_uplink(&nf, &sent);
    assert_eq!(
        ret, TC_ACT_REDIRECT,
        "tc: a claimed address's undefined port: rejected"
    );
    assert_eq!(
        counter(&nf.fx, "reject_undefined_port"),
        1,
        "reject_undefined_port"
    );
    assert_eq!(
        (
            counter(&nf.fx, "dsr_learnt"),
            counter(&nf.fx, "dsr_refused")
        ),
        (0, 0),
        "none of them reached tc_dsr"
    );
}

/// The backend's node: the first packet carrying the option creates the
/// flow keyed by the frontend it names (`tc_dsr`), and goes on as it came;
/// the backend's reply leaves from the frontend straight to the client; a
/// later packet of the flow touches it. When the network then brings the
/// client's packets here directly, to the frontend, the flow learnt sends
/// them to the same backend. A carrier naming no frontend of this node is
/// refused, counted, and its flow's replies go untranslated; so is every
/// carrier while DSR is off here.
#[test]
fn dsr_backends_node_learns_the_flow_and_answers_from_the_frontend() {
    let mut nf = dsr_node_fixture(proxy_common::node_config_flags::DSR);
    add_local_lb(&mut nf);
    let lb = (LB_LOCAL_IP, 80);
    let sent = with_dsr_option(&tcp(OUTSIDE, 44000, LOCAL_POD, 8080, frame::SYN), lb);
    let (ret, out) = run_xdp(&nf, &sent);
    assert_eq!((ret, &out), (XDP_PASS, &sent), "XDP leaves it to tc");
    let (ret, out) = run_tc_on_uplink(&nf, &sent);
    assert_eq!((ret, &out), (TC_PASS, &sent), "the SYN goes on as it came");
    assert_eq!(counter(&nf.fx, "dsr_learnt"), 1, "dsr_learnt");

    let reply = tcp(LOCAL_POD, 8080, OUTSIDE, 44000, frame::SYN | frame::ACK);
    let (ret, out) = run_tc_on_uplink(&nf, &reply);
    assert_eq!(ret, TC_ACT_REDIRECT, "the backend's reply: verdict");
    let r = parse_checked(&out, "the backend's reply");
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

    let established = counter(&nf.fx, "dnat_established");
    let ack = with_dsr_option(&tcp(OUTSIDE, 44000, LOCAL_POD, 8080, frame::ACK), lb);
    let (ret, out) = run_tc_on_uplink(&nf, &ack);
    assert_eq!((ret, &out), (TC_PASS, &ack), "the ACK goes on as it came");
    assert_eq!(
        counter(&nf.fx, "dnat_established"),
        established + 1,
        "the ACK found its flow"
    );
    assert_eq!(counter(&nf.fx, "dsr_learnt"), 1, "learnt once");

    let direct = tcp(OUTSIDE, 44000, LB_LOCAL_IP, 80, frame::ACK);
    let (ret, out) = run_tc_on_uplink(&nf, &direct);
    assert_eq!(ret, TC_PASS, "the client's packet arriving here: verdict");
    let p = parse_checked(&out, "the client's packet arriving here");
    assert_eq!(
        (p.src, p.sport, p.dst, p.dport),
        (OUTSIDE, 44000, LOCAL_POD, 8080),
        "moved here by the network, the flow keeps its backend"
    );

    let forged = with_dsr_option(
        &tcp(OUTSIDE, 44001, LOCAL_POD, 8080, frame::SYN),
        (Ipv4Addr::new(203, 0, 113, 9), 4444),
    );
    let (ret, out) = run_tc_on_uplink(&nf, &forged);
    assert_eq!((ret, &out), (TC_PASS, &forged), "a refused carrier passes");
    assert_eq!(counter(&nf.fx, "dsr_refused"), 1, "dsr_refused");
    let reply = tcp(LOCAL_POD, 8080, OUTSIDE, 44001, frame::SYN | frame::ACK);
    let (ret, out) = run_tc_on_uplink(&nf, &reply);
    assert_eq!(
        (ret, &out),
        (TC_PASS, &reply),
        "the reply of a refused carrier's flow must go untranslated"
    );

    let mut off = node_fixture();
    add_local_lb(&mut off);
    let sent = with_dsr_option(&tcp(OUTSIDE, 44002, LOCAL_POD, 8080, frame::SYN), lb);
    let (ret, out) = run_tc_on_uplink(&off, &sent);
    assert_eq!((ret, &out), (TC_PASS, &sent), "DSR off: passed");
    assert_eq!(counter(&off.fx, "dsr_learnt"), 0, "DSR off: dsr_learnt");
    let reply = tcp(LOCAL_POD, 8080, OUTSIDE, 44002, frame::SYN | frame::ACK);
    let (ret, out) = run_tc_on_uplink(&off, &reply);
    assert_eq!(
        (ret, &out),
        (TC_PASS, &reply),
        "DSR off: the reply untranslated"
    );
}

/// Every packet program verifies in at most half the verifier's limit of a
/// million processed instructions. A program past the limit does not load
/// at all, and what the verifier walks grows with each path a change adds
/// and differs from one kernel to the next: half leaves room for both.
/// `tc_ingress6` had come to 887,090 before a new flow's paths went to a
/// program of their own (`tc_new6`, docs/architecture.md, "One pipeline
/// over both families").
#[test]
fn every_packet_program_verifies_well_within_the_kernels_limit() {
    const HALF: u32 = 500_000;
    let fx = fixture();
    let loads = fx.datapath.program_loads();
    let counted: Vec<(&str, Option<u32>)> =
        loads.iter().map(|l| (l.name, l.verified_insns)).collect();
    for name in proxy_common::program_names::PACKET {
        let insns = counted
            .iter()
            .find(|(loaded, _)| *loaded == name)
            .unwrap_or_else(|| panic!("{name} was not loaded; loads: {counted:?}"))
            .1
            .unwrap_or_else(|| {
                panic!(
                    "{name}: the kernel kept no count of verified instructions (Linux 5.16 does)"
                )
            });
        assert!(
            insns <= HALF,
            "{name}: {insns} verified instructions, more than half the verifier's limit ({HALF}); all: {counted:?}"
        );
    }
}
