//! Per-packet cost of the tc program, through BPF_PROG_TEST_RUN, at growing
//! numbers of installed services (10 endpoints each), against a do-nothing
//! program of the same hook measured in the same run.
//!
//! Two methods, both reported:
//! - `repeat`: one packet run `REPEAT` times in the kernel; the kernel's
//!   average. Not possible for a new flow (the first run creates the flow).
//! - `single`: each run is its own syscall on its own packet; the median of
//!   the kernel's per-run time (which includes the kernel's timer reads, the
//!   same for every case). The only way to measure a new flow.
//!
//! Usage: `cargo bench -p ebpf-proxy-tests --bench datapath -- [--quick] [--out DIR]`
//! (root). Prints a markdown table and writes `datapath.md` and
//! `datapath.json` to DIR.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::PathBuf,
    time::{Duration, Instant},
};

use aya::programs::{SchedClassifier, TestRun, TestRunOptions};
use ebpf_proxy_tests::frames;
use proxy_userspace::{
    datapath::{Datapath, PinLayout},
    model::{
        BackendAddr, Frontend, FrontendKey, FrontendKind, NoEndpointAction, Protocol, Scope,
        ServicePortName,
    },
    planner::Planner,
    source::ObjectKey,
};

const ENDPOINTS: u32 = 10;
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 2);

fn vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a60_0000 + i) // 10.96.0.0/12
}

fn backend_ip(service: u32, k: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a80_0000 + service * ENDPOINTS + k) // 10.128.0.0/9
}

fn frontend(i: u32) -> Frontend {
    let mut backends: Vec<BackendAddr> = (0..ENDPOINTS)
        .map(|k| BackendAddr {
            ip: IpAddr::V4(backend_ip(i, k)),
            port: 8080,
            protocol: Protocol::Tcp,
            local: false,
            terminating: false,
        })
        .collect();
    backends.sort_by_key(|b| b.host_port());
    Frontend {
        key: FrontendKey {
            ip: IpAddr::V4(vip(i)),
            port: 80,
            protocol: Protocol::Tcp,
            scope: Scope::Any,
        },
        kind: FrontendKind::ClusterIp,
        service: ServicePortName {
            namespace: "bench".into(),
            name: format!("svc-{i}"),
            port: String::new(),
            protocol: Protocol::Tcp,
        },
        backends,
        no_endpoints: NoEndpointAction::Reject,
        affinity_timeout_s: None,
        source_ranges: Vec::new(),
    }
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

fn run(program: &SchedClassifier, frame: &[u8], repeat: u32) -> Duration {
    let mut out = vec![0u8; frame.len() + 64];
    let mut opts = TestRunOptions::new();
    opts.data_in = Some(frame);
    opts.data_out = Some(&mut out);
    opts.repeat = repeat;
    program.test_run(opts).expect("BPF_PROG_TEST_RUN").duration
}

/// Kernel-measured ns per packet of one frame run `repeat` times; the
/// median of `rounds` such measurements.
fn repeated(program: &SchedClassifier, frame: &[u8], repeat: u32, rounds: usize) -> f64 {
    let mut samples: Vec<f64> = (0..rounds)
        .map(|_| run(program, frame, repeat).as_nanos() as f64)
        .collect();
    median(&mut samples)
}

/// Median kernel-measured ns of single runs over the frames.
fn single(program: &SchedClassifier, frames: &[Vec<u8>]) -> f64 {
    let mut samples: Vec<f64> = frames
        .iter()
        .map(|f| run(program, f, 1).as_nanos() as f64)
        .collect();
    median(&mut samples)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

struct Row {
    services: u32,
    program_s: f64,
    cases: Vec<(&'static str, f64, Option<f64>)>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let out_dir = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|i| args.get(i + 1))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("bench/results"));
    let sizes: &[u32] = if quick {
        &[10, 1_000, 10_000]
    } else {
        &[10, 1_000, 10_000, 100_000]
    };
    let (repeat, rounds, singles) = if quick {
        (20_000, 5, 2_000)
    } else {
        (100_000, 9, 10_000)
    };

    let root = PathBuf::from(format!(
        "/sys/fs/bpf/ebpf-proxy-bench-{}",
        std::process::id()
    ));
    let pins = PinLayout::new(&root);
    let _cleanup = Cleanup(pins.clone());
    let mut datapath = Datapath::load(pins).expect("loading the datapath (root, bpffs mounted?)");
    let mut planner = Planner::new();
    let mut installed = 0u32;
    let mut rows = Vec::new();
    let mut next_port = 1024u16;
    let mut fresh_port = || {
        next_port = if next_port == u16::MAX {
            1024
        } else {
            next_port + 1
        };
        next_port
    };

    for &size in sizes {
        let started = Instant::now();
        while installed < size {
            let owner = ObjectKey {
                namespace: "bench".into(),
                name: format!("svc-{installed}"),
            };
            let out = planner.sync_service(&owner, &[frontend(installed)], &mut datapath.maps);
            assert!(out.errors.is_empty(), "programming: {:?}", out.errors);
            installed += 1;
        }
        let program_s = started.elapsed().as_secs_f64();
        // Target a service in the middle of what is installed.
        let target = vip(size / 2);
        let floor = datapath.floor_program().expect("loading the floor program");
        let floor_frame = tcp(CLIENT, 1000, target, 80, 0x10);
        let floor_rep = repeated(floor, &floor_frame, repeat, rounds);
        let floor_single = single(floor, &vec![floor_frame.clone(); singles]);
        let program = datapath.tc_program();

        let other = tcp(CLIENT, 1000, Ipv4Addr::new(10, 1, 2, 3), 80, 0x10);
        let other_rep = repeated(program, &other, repeat, rounds);
        let other_single = single(program, &vec![other.clone(); singles]);

        // New flows: a distinct source port (and so a conntrack miss) each.
        let news: Vec<Vec<u8>> = (0..singles)
            .map(|i| {
                let src = Ipv4Addr::from(u32::from(CLIENT) + 1 + (i as u32 / 60000) + size);
                tcp(src, fresh_port(), target, 80, 0x02)
            })
            .collect();
        let new_single = single(program, &news);

        // Established: the first packet creates the flow, the rest hit it.
        let est = tcp(CLIENT, 2000, target, 80, 0x10);
        let mut out = vec![0u8; 128];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(&est);
        opts.data_out = Some(&mut out);
        program.test_run(opts).expect("first packet");
        let backend = Ipv4Addr::new(out[30], out[31], out[32], out[33]);
        let est_rep = repeated(program, &est, repeat, rounds);
        let est_single = single(program, &vec![est.clone(); singles]);

        let reply = tcp(backend, 8080, CLIENT, 2000, 0x10);
        let reply_rep = repeated(program, &reply, repeat, rounds);
        let reply_single = single(program, &vec![reply.clone(); singles]);

        rows.push(Row {
            services: size,
            program_s,
            cases: vec![
                ("empty program", floor_single, Some(floor_rep)),
                ("not a service", other_single, Some(other_rep)),
                ("new flow", new_single, None),
                ("established flow", est_single, Some(est_rep)),
                ("reply (reverse NAT)", reply_single, Some(reply_rep)),
            ],
        });
        eprintln!("{size} services: programmed in {program_s:.2}s, measured");
    }

    let table = render(&rows, repeat);
    println!("{table}");
    std::fs::create_dir_all(&out_dir).expect("creating the output directory");
    std::fs::write(out_dir.join("datapath.md"), &table).expect("writing datapath.md");
    std::fs::write(out_dir.join("datapath.json"), json(&rows)).expect("writing datapath.json");
}

fn render(rows: &[Row], repeat: u32) -> String {
    let mut s = String::new();
    s.push_str(&format!(
        "Per-packet cost of tc_ingress (BPF_PROG_TEST_RUN, ns per packet; `single` = median of \
         one-packet runs, `x{repeat}` = kernel average over {repeat} runs of one packet; ratio = \
         against the empty program, same method)\n\n"
    ));
    s.push_str("| services | case | single ns | ratio | repeat ns | ratio |\n");
    s.push_str("|---:|---|---:|---:|---:|---:|\n");
    for row in rows {
        let (floor_single, floor_rep) = (row.cases[0].1, row.cases[0].2.unwrap_or(f64::NAN));
        for (name, single, rep) in &row.cases {
            let rep_cells = match rep {
                Some(r) => format!("{r:.1} | {:.2}x", r / floor_rep),
                None => "- | -".into(),
            };
            s.push_str(&format!(
                "| {} | {name} | {single:.0} | {:.2}x | {rep_cells} |\n",
                row.services,
                single / floor_single
            ));
        }
    }
    s.push('\n');
    for row in rows {
        s.push_str(&format!(
            "Programming {} services x {ENDPOINTS} endpoints (cumulative step): {:.2} s\n",
            row.services, row.program_s
        ));
    }
    if let (Some(first), Some(last)) = (rows.first(), rows.last()) {
        let est = |r: &Row| r.cases[3].1;
        s.push_str(&format!(
            "\nEstablished-flow cost at {} vs {} services: {:+.1}%\n",
            last.services,
            first.services,
            (est(last) / est(first) - 1.0) * 100.0
        ));
    }
    s
}

fn json(rows: &[Row]) -> String {
    let rows: Vec<String> = rows
        .iter()
        .map(|r| {
            let cases: Vec<String> = r
                .cases
                .iter()
                .map(|(n, single, rep)| {
                    format!(
                        "{{\"case\":\"{n}\",\"single_ns\":{single:.1},\"repeat_ns\":{}}}",
                        rep.map_or("null".to_string(), |v| format!("{v:.2}"))
                    )
                })
                .collect();
            format!(
                "{{\"services\":{},\"program_s\":{:.3},\"cases\":[{}]}}",
                r.services,
                r.program_s,
                cases.join(",")
            )
        })
        .collect();
    format!("[{}]\n", rows.join(","))
}

struct Cleanup(PinLayout);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = proxy_userspace::datapath::cleanup(&self.0);
    }
}
