//! `cargo xtask run` without arguments: a sandbox of network namespaces (a routed node
//! with a client pod and three backend pods), the agent on deploy/examples/demo.yaml,
//! and a live table of which backend served how many of the client's connections to
//! the ClusterIP. Ctrl-C (or SIGTERM, or --seconds) ends it; the sandbox and the
//! agent's pins are removed on every way out but SIGKILL, and the next run sweeps
//! those leftovers too.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{IsTerminal, Write},
    net::{Ipv4Addr, SocketAddrV4},
    path::Path,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use ebpf_proxy_tests::{
    client::{Outcome, tcp_request_here, udp_request_here},
    netns::run_in,
    remove_stale_state,
    sandbox::Sandbox,
};
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};

use ebpf_proxy_tests::topology::one_node::{self, CLIENT, CLUSTER_IP};

use crate::workspace_root;

/// deploy/examples/demo.yaml: namespace `demo`, Service `web` at 10.96.0.10 with
/// 80/TCP -> 8080 and 53/UDP (`dns`) -> 5353, endpoints 10.200.0.11-13.
const MANIFEST: &str = "deploy/examples/demo.yaml";
/// The tests' one-node world, with the demo's pod names.
const BACKENDS: [(&str, Ipv4Addr); 3] = [
    ("web-1", one_node::BACKENDS[0].1),
    ("web-2", one_node::BACKENDS[1].1),
    ("web-3", one_node::BACKENDS[2].1),
];
/// Pause between two connections: about a hundred a second, enough to watch the
/// shares settle without keeping a core busy.
const PACE: Duration = Duration::from_millis(10);
const TIMEOUT: Duration = Duration::from_secs(1);

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn request_stop(_: std::ffi::c_int) {
    // Only an atomic store: async-signal-safe.
    STOP.store(true, Ordering::SeqCst);
}

fn install_signal_handlers() -> Result<()> {
    let action = SigAction::new(
        SigHandler::Handler(request_stop),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        // SAFETY: the handler only stores to an atomic.
        unsafe { sigaction(signal, &action) }.with_context(|| format!("handle {signal}"))?;
    }
    Ok(())
}

/// Per-backend counts of the demo's traffic.
#[derive(Default)]
struct Counts {
    tcp: BTreeMap<String, u64>,
    udp: BTreeMap<String, u64>,
    failures: BTreeMap<String, u64>,
    last_failure: Option<String>,
    /// Client addresses the backends reported: the client's own unless something
    /// SNATs.
    peers_seen: BTreeSet<Ipv4Addr>,
    elapsed: Duration,
}

impl Counts {
    fn record(&mut self, udp: bool, outcome: Outcome) {
        match outcome {
            Outcome::Reply(r) => {
                let map = if udp { &mut self.udp } else { &mut self.tcp };
                *map.entry(r.backend).or_default() += 1;
                self.peers_seen.insert(*r.peer.ip());
            }
            other => {
                let kind = match other {
                    Outcome::Refused => "refused",
                    Outcome::Timeout => "timeout",
                    _ => "other error",
                };
                *self.failures.entry(kind.to_owned()).or_default() += 1;
                self.last_failure = Some(other.to_string());
            }
        }
    }

    /// One line, for output that is not a terminal.
    fn summary(&self) -> String {
        let list = |m: &BTreeMap<String, u64>| {
            m.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" ")
        };
        format!(
            "{:>4.0} s  tcp: {}  udp: {}  failures: {}",
            self.elapsed.as_secs_f64(),
            list(&self.tcp),
            list(&self.udp),
            if self.failures.is_empty() {
                "none".to_owned()
            } else {
                list(&self.failures)
            }
        )
    }

    /// The table, one line per row.
    fn table(&self) -> Vec<String> {
        let tcp_total: u64 = self.tcp.values().sum();
        let udp_total: u64 = self.udp.values().sum();
        let pct = |n: u64, total: u64| {
            if total == 0 {
                0.0
            } else {
                100.0 * n as f64 / total as f64
            }
        };
        let mut rows = vec![format!(
            "{:<20} {:>16} {:>16}   ({:.0} s)",
            "backend",
            format!("TCP {CLUSTER_IP}:80"),
            "UDP :53",
            self.elapsed.as_secs_f64()
        )];
        for (name, ip) in BACKENDS {
            let t = self.tcp.get(name).copied().unwrap_or(0);
            let u = self.udp.get(name).copied().unwrap_or(0);
            rows.push(format!(
                "{:<20} {:>8} {:>6.1}% {:>8} {:>6.1}%",
                format!("{name} ({ip})"),
                t,
                pct(t, tcp_total),
                u,
                pct(u, udp_total)
            ));
        }
        rows.push(format!(
            "{:<20} {:>8} {:>16}",
            "total", tcp_total, udp_total
        ));
        let peers: Vec<String> = self.peers_seen.iter().map(Ipv4Addr::to_string).collect();
        rows.push(format!(
            "client address the backends saw: {} (the client is {})",
            if peers.is_empty() {
                "-".to_owned()
            } else {
                peers.join(", ")
            },
            CLIENT.1
        ));
        let failures: Vec<String> = self
            .failures
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect();
        rows.push(if failures.is_empty() {
            "failures: none".to_owned()
        } else {
            format!(
                "failures: {} (last: {})",
                failures.join(", "),
                self.last_failure.as_deref().unwrap_or("-")
            )
        });
        rows
    }
}

pub fn run(bin: &Path, seconds: Option<u64>) -> Result<()> {
    let manifest = workspace_root().join(MANIFEST);
    if !manifest.is_file() {
        bail!("{} is missing", manifest.display());
    }
    install_signal_handlers()?;
    remove_stale_state(Some(bin))?;

    println!("demo: building the sandbox (node, client and three backend pods)");
    let mut sandbox = Sandbox::new(&[CLIENT], &BACKENDS, 8080, 5353)?;
    println!(
        "demo: starting {} on {} in netns {}",
        bin.display(),
        manifest.display(),
        sandbox.topology().node.name()
    );
    // The sandbox (agent, servers, namespaces) is removed when it drops at the end of
    // this function, however it ends.
    let agent = sandbox.start_agent(&manifest)?;
    let bpf_root = agent.bpf_root().to_owned();
    let pins = agent.pins();
    println!(
        "demo: agent healthy; it pinned {} objects under {}",
        pins.len(),
        bpf_root.display()
    );
    println!("demo: to look inside while this runs (in another terminal):");
    println!(
        "  {} status --bpf-root {}",
        bin.display(),
        bpf_root.display()
    );
    if let Some(services) = pins.iter().find(|p| p.ends_with("SERVICES")) {
        println!("  bpftool map dump pinned {}", services.display());
    }
    println!(
        "demo: client {} connects to {CLUSTER_IP}:80 (TCP) and :53 (UDP); {}",
        CLIENT.1,
        match seconds {
            Some(s) => format!("ending after {s} s or at Ctrl-C"),
            None => "Ctrl-C ends the demo and removes the sandbox".to_owned(),
        }
    );

    let counts = traffic(&sandbox, seconds)?;
    for row in counts.table() {
        println!("{row}");
    }
    println!("demo: stopping the agent and removing the sandbox");
    drop(sandbox);
    println!("demo: done");
    Ok(())
}

/// Sends traffic until stopped, redrawing the table about once a second; returns the
/// final counts.
fn traffic(sandbox: &Sandbox, seconds: Option<u64>) -> Result<Counts> {
    let deadline = seconds.map(Duration::from_secs);
    let client = sandbox.client().ns.path();
    let tcp_addr = SocketAddrV4::new(CLUSTER_IP, 80);
    let udp_addr = SocketAddrV4::new(CLUSTER_IP, 53);
    let live = std::io::stdout().is_terminal();
    // One thread inside the client's namespace does all the requests.
    run_in(&client, || {
        let start = Instant::now();
        let mut counts = Counts::default();
        let mut drawn_rows = 0;
        let mut next_draw = start + Duration::from_secs(1);
        let mut n = 0u64;
        while !STOP.load(Ordering::SeqCst) && deadline.is_none_or(|d| start.elapsed() < d) {
            counts.record(false, tcp_request_here(tcp_addr, TIMEOUT));
            // Every fifth round a DNS-style datagram as well.
            if n.is_multiple_of(5) {
                counts.record(true, udp_request_here(udp_addr, TIMEOUT));
            }
            n += 1;
            if Instant::now() >= next_draw {
                counts.elapsed = start.elapsed();
                if live {
                    drawn_rows = redraw(&counts.table(), drawn_rows);
                } else {
                    println!("{}", counts.summary());
                }
                next_draw += Duration::from_secs(1);
            }
            std::thread::sleep(PACE);
        }
        counts.elapsed = start.elapsed();
        if live && drawn_rows > 0 {
            // Erase the live table: the final one is printed in its place.
            let _ = write!(std::io::stdout(), "\x1b[{drawn_rows}A\x1b[J");
        }
        counts
    })
}

/// Prints the table over the previous one (a terminal is assumed).
fn redraw(rows: &[String], previous_rows: usize) -> usize {
    let mut out = std::io::stdout().lock();
    if previous_rows > 0 {
        let _ = write!(out, "\x1b[{previous_rows}A");
    }
    for row in rows {
        // Clear the line first: the new row may be shorter.
        let _ = writeln!(out, "\x1b[2K{row}");
    }
    let _ = out.flush();
    rows.len()
}
