//! Control-plane cost at scale, side by side with kube-proxy's iptables mode
//! in the same kernel and the same run:
//!
//! - the agent binary from start to a fully programmed datapath (/healthz
//!   200) on S Services x 10 endpoints read from manifests, and its resident
//!   memory then;
//! - the map writes of one endpoint change (p50/p99 over 200 changes),
//!   through the planner and the real pinned maps;
//! - `iptables-restore` of the same Services written the way kube-proxy's
//!   iptables mode writes them (full load, and the full re-sync a change
//!   triggers when not partial).
//!
//! Usage: `cargo bench -p ebpf-proxy-tests --bench control_plane -- [--quick] [--out DIR]`
//! (root).

mod common;

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    time::{Duration, Instant},
};

use ebpf_proxy_tests::{
    Protocol as HarnessProtocol,
    agent::Agent,
    iptables::{self, KubeService},
    manifest::{ManifestDir, Service},
    netns::{NetNs, unique_stem},
    nftables,
};
use proxy_common::{CtKey, CtValue, PROTO_UDP, ct_dir};
use proxy_userspace::{
    datapath::{Datapath, PinLayout},
    housekeeping::{conntrack, ct_sources},
    model::{BackendAddr, Frontend, Protocol, ServicePortName},
    planner::{AffinityPurge, Planner},
    source::ObjectKey,
};

const ENDPOINTS: u32 = 10;

fn vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a60_0000 + i)
}

fn endpoint(service: u32, k: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a80_0000 + service * (ENDPOINTS + 1) + k)
}

fn endpoints(service: u32, n: u32) -> Vec<Ipv4Addr> {
    (0..n).map(|k| endpoint(service, k)).collect()
}

fn frontend(i: u32, n: u32) -> Frontend {
    let backends = endpoints(i, n)
        .into_iter()
        .map(|ip| BackendAddr::remote(IpAddr::V4(ip), 8080, Protocol::Tcp))
        .collect();
    let service = ServicePortName::new("bench", &format!("svc-{i}"), "http", Protocol::Tcp);
    Frontend::cluster_ip(service, IpAddr::V4(vip(i)), 80, backends)
}

fn kube_service(i: u32) -> KubeService {
    KubeService {
        namespace: "bench".into(),
        name: format!("svc-{i}"),
        port_name: "http".into(),
        protocol: HarnessProtocol::Tcp,
        cluster_ip: vip(i),
        port: 80,
        endpoints: endpoints(i, ENDPOINTS)
            .into_iter()
            .map(|ip| SocketAddrV4::new(ip, 8080))
            .collect(),
        affinity_timeout: None,
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn rss_kib(pid: u32) -> u64 {
    ebpf_proxy_tests::process::rss_kib(pid).unwrap_or(0)
}

/// What one departure costs the agent when conntrack is full of flows.
#[expect(
    clippy::struct_field_names,
    reason = "`purge` is the time of the purge the struct reports on"
)]
struct Purge {
    flows: u32,
    departed_flows: u32,
    /// `purge_departed` after the endpoint left.
    purge: Duration,
    /// One reaper pass over the same table, nothing expired: the cost of
    /// reading it once, for scale.
    reap_pass: Duration,
}

/// Service 0 loses an endpoint while conntrack holds `flows` live UDP flows,
/// `departed_flows` of them the leaving endpoint's: the sync after it
/// removes those, and only those.
fn departure_with_flows(
    planner: &mut Planner,
    datapath: &mut Datapath,
    owner: &ObjectKey,
    flows: u32,
) -> Purge {
    let _ = planner.take_departed();
    let out = planner.sync_service(owner, &[frontend(0, ENDPOINTS - 1)], &mut datapath.maps);
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    let departed = planner.take_departed();
    let [gone] = departed[..] else {
        panic!("one endpoint left service 0, but the planner reports {departed:?}");
    };
    let departed_flows = flows / 100;
    let now = conntrack::monotonic_ns();
    for i in 0..flows {
        // Distinct clients on one frontend; the leaving backend's flows
        // spread through the table.
        let backend_id = if i % 100 == 0 {
            gone.backend_id
        } else {
            gone.backend_id ^ 0x8000_0000
        };
        let key = CtKey::new(
            u32::from(Ipv4Addr::from(0x0b00_0000 + i)).to_be(),
            u32::from(vip(0)).to_be(),
            1234u16.to_be(),
            53u16.to_be(),
            PROTO_UDP,
        );
        let value = CtValue {
            nat_addr_be: u32::from(endpoint(0, 0)).to_be(),
            nat_port_be: 8080u16.to_be(),
            dir: ct_dir::FORWARD,
            backend_id,
            service_id: gone.service_id,
            created_s: (now / 1_000_000_000) as u32,
            last_seen_ns: now,
            ..Default::default()
        };
        datapath
            .maps
            .conntrack
            .insert(key, value, 0)
            .unwrap_or_else(|e| panic!("filling conntrack, entry {i} of {flows}: {e}"));
    }
    let t = Instant::now();
    // As for a Service with session affinity: `AFFINITY` passed over too.
    let affinity = AffinityPurge {
        dropped: Vec::new(),
        departed: true,
    };
    let swept =
        conntrack::purge_departed(&mut datapath.maps, &departed, &affinity).expect("purging");
    let purge = t.elapsed();
    assert_eq!(
        swept.conntrack, departed_flows as usize,
        "the purge must remove the leaving endpoint's flows and no other"
    );
    let t = Instant::now();
    let reaped = {
        let (maps, reap) = datapath.conntrack_reaping();
        let mut tally = ct_sources::Tally::default();
        let reaped = conntrack::reap_expired(maps, &reap, conntrack::monotonic_ns(), &mut tally);
        ct_sources::write(&mut datapath.maps, &tally).expect("writing the clients' counts");
        reaped
    }
    .expect("reaping");
    let reap_pass = t.elapsed();
    assert_eq!(
        reaped, 0,
        "no flow had expired, yet the reaper removed some"
    );
    Purge {
        flows,
        departed_flows,
        purge,
        reap_pass,
    }
}

#[expect(
    clippy::too_many_lines,
    reason = "the bench's steps in the order they run, sharing one agent and its namespaces"
)]
fn main() {
    let args = common::Args::from_env();
    let quick = args.flag("--quick");
    let out_dir = args.out_dir().expect("--out");
    let services: u32 = if quick { 1_000 } else { 10_000 };
    let changes = 200;

    // 1. The agent binary, from start to healthy, on manifests.
    let stem = unique_stem();
    let node = NetNs::create(&format!("{stem}-cp")).expect("creating the node namespace");
    node.ip(&["link", "set", "lo", "up"]).expect("lo up");
    let manifests = ManifestDir::create(&stem).expect("manifest directory");
    let mut yaml = String::new();
    for i in 0..services {
        let svc = Service::new("bench", &format!("svc-{i}"), vip(i)).port(
            "http",
            80,
            HarnessProtocol::Tcp,
            8080,
        );
        yaml.push_str(&svc.yaml(Some(&endpoints(i, ENDPOINTS))));
    }
    manifests
        .write("services.yaml", &yaml)
        .expect("writing manifests");
    let started = Instant::now();
    let mut agent = Agent::start(&node, manifests.path()).expect("starting the agent");
    let agent_ready = started.elapsed();
    let pid = agent.pid().expect("agent pid");
    let agent_rss_mib = rss_kib(pid) as f64 / 1024.0;
    agent.cleanup().expect("agent cleanup");
    drop(agent);
    eprintln!(
        "agent: {services} services healthy after {agent_ready:?}, RSS {agent_rss_mib:.1} MiB"
    );

    // 2. Map writes: full programming and one-endpoint changes.
    let root = PathBuf::from(format!(
        "/sys/fs/bpf/ebpf-proxy-bench-cp-{}",
        std::process::id()
    ));
    let pins = PinLayout::new(&root);
    let mut datapath = Datapath::load(pins.clone()).expect("loading the datapath");
    let mut planner = Planner::new();
    let owner = |i: u32| ObjectKey {
        namespace: "bench".into(),
        name: format!("svc-{i}"),
    };
    let started = Instant::now();
    for i in 0..services {
        let out = planner.sync_service(&owner(i), &[frontend(i, ENDPOINTS)], &mut datapath.maps);
        assert!(out.errors.is_empty(), "{:?}", out.errors);
    }
    let maps_full = started.elapsed();
    let mut latencies = Vec::with_capacity(changes);
    let mut state = vec![ENDPOINTS; services as usize];
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..changes {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let i = (rng % u64::from(services)) as u32;
        // Alternate one endpoint in and out.
        let n = if state[i as usize] == ENDPOINTS {
            ENDPOINTS + 1
        } else {
            ENDPOINTS
        };
        state[i as usize] = n;
        let fe = frontend(i, n);
        let t = Instant::now();
        let out = planner.sync_service(&owner(i), &[fe], &mut datapath.maps);
        latencies.push(t.elapsed());
        assert!(out.errors.is_empty(), "{:?}", out.errors);
    }
    latencies.sort();
    let (p50, p99) = (percentile(&latencies, 0.5), percentile(&latencies, 0.99));
    let purge = departure_with_flows(
        &mut planner,
        &mut datapath,
        &owner(0),
        if quick { 50_000 } else { 200_000 },
    );
    drop(datapath);
    let _ = proxy_userspace::datapath::cleanup(&pins);

    // 3. iptables-restore of the same Services in a namespace of their own.
    let ipt_ns = NetNs::create(&format!("{stem}-ipt")).expect("iptables namespace");
    let kube: Vec<KubeService> = (0..services).map(kube_service).collect();
    let started = Instant::now();
    iptables::apply(&ipt_ns, &kube).expect("iptables-restore, full load");
    let ipt_full = started.elapsed();
    // kube-proxy without partial sync rewrites the whole table on a change.
    let mut kube_changed = kube.clone();
    kube_changed[0]
        .endpoints
        .push(SocketAddrV4::new(endpoint(0, ENDPOINTS), 8080));
    let started = Instant::now();
    iptables::apply(&ipt_ns, &kube_changed).expect("iptables-restore, re-sync");
    let ipt_resync = started.elapsed();
    let rules = iptables::nat_table(&kube).map_or(0, |t| t.lines().count());
    drop(ipt_ns);

    // 4. nft -f of the same Services, written as kube-proxy's nftables mode
    // writes them.
    let nft_ns = NetNs::create(&format!("{stem}-nft")).expect("nftables namespace");
    let started = Instant::now();
    nftables::apply(&nft_ns, &kube, &[]).expect("nft -f, full load");
    let nft_full = started.elapsed();
    let started = Instant::now();
    nftables::apply(&nft_ns, &kube_changed, &[]).expect("nft -f, re-apply");
    let nft_resync = started.elapsed();
    drop(nft_ns);

    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let faster = |slow: Duration, fast: Duration| slow.as_secs_f64() / fast.as_secs_f64();
    let table = format!(
        "Control plane, {services} Services x {ENDPOINTS} endpoints ({} backends), one run on this machine\n\n\
         | measurement | ebpf-proxy | iptables-restore (kube-proxy iptables) | nft -f (kube-proxy nftables) |\n\
         |---|---:|---:|---:|\n\
         | full programming (agent start to healthy; iptables: {rules} lines) | {:.0} ms | {:.0} ms ({:.1}x ours) | {:.0} ms ({:.1}x ours) |\n\
         | map writes alone, full programming | {:.0} ms | | |\n\
         | one endpoint change, p50 (ebpf-proxy: planner + map writes; others: full re-apply) | {:.3} ms | {:.0} ms | {:.0} ms |\n\
         | one endpoint change, p99 | {:.3} ms | | |\n\
         | one endpoint leaving with {} UDP flows in conntrack: removing its {} (one reaper pass over the table: {:.0} ms) | {:.0} ms | | |\n\
         | agent resident memory after full sync | {agent_rss_mib:.1} MiB | | |\n",
        services * ENDPOINTS,
        ms(agent_ready),
        ms(ipt_full),
        faster(ipt_full, agent_ready),
        ms(nft_full),
        faster(nft_full, agent_ready),
        ms(maps_full),
        ms(p50),
        ms(ipt_resync),
        ms(nft_resync),
        ms(p99),
        purge.flows,
        purge.departed_flows,
        ms(purge.reap_pass),
        ms(purge.purge),
    );
    println!("{table}");
    std::fs::create_dir_all(&out_dir).expect("creating the output directory");
    std::fs::write(out_dir.join("control_plane.md"), &table).expect("writing control_plane.md");
}
