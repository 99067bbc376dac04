//! Harness for ebpf-proxy's privileged integration tests and for `cargo xtask run`'s
//! demo: network namespaces, the routed one-node topology of docs/architecture.md (test topologies) and its
//! two-node cluster with outside clients on a bridge ([`cluster`]), small TCP
//! and UDP backends that report the peer they saw, clients that classify what
//! happened, the agent process, kube-proxy-style iptables and nftables rules, a
//! chi-square test, and [`sandbox::Sandbox`], which bundles them the way the tests and
//! the demo use them.
//!
//! Namespaces, servers, iptables and the agent need root and the real kernel. Every
//! resource is owned by a value whose `Drop` removes it, so a panicking test leaves
//! nothing behind.

pub mod affinity;
pub mod agent;
pub mod bench;
pub mod bulk;
pub mod cgroup;
pub mod client;
pub mod cluster;
pub mod family;
pub mod flood;
pub mod frames;
pub mod fuzz;
pub mod image;
pub mod iptables;
pub mod load;
pub mod manifest;
pub mod manifest_check;
pub mod netns;
pub mod nftables;
pub mod offloads;
pub mod sandbox;
pub mod servers;
pub mod snmp;
pub mod stats;
pub mod topology;

use std::{path::Path, process::Command};

use anyhow::{Context, Result, bail};

/// The address first argument of the tests' small client binaries
/// (`udp-sendto`, `udp-connected`, `tcp-peer`, `tcp-churn`), of either family
/// (`a.b.c.d:port` or `[v6]:port`, IPv4-mapped included), or their usage on
/// stderr.
pub fn sock_addr_arg(program: &str) -> Option<std::net::SocketAddr> {
    let addr = std::env::args().nth(1).and_then(|a| a.parse().ok());
    if addr.is_none() {
        eprintln!("usage: {program} a.b.c.d:port|[v6]:port");
    }
    addr
}

/// The unspecified address of `addr`'s family, any port: where a client
/// socket that talks to `addr` binds (`[::]` for IPv4-mapped too, so that the
/// socket is an IPv6 one).
pub fn any_addr_for(addr: std::net::SocketAddr) -> std::net::SocketAddr {
    match addr {
        std::net::SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, 0).into(),
        std::net::SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    }
}

/// Fails with a clear message unless the process is root: namespaces, veths, BPF and
/// iptables all need it, and a permission error deep inside `ip` helps nobody.
pub fn require_root() -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("this needs root (network namespaces, BPF, iptables): run it as root");
    }
    Ok(())
}

/// Removes what harness processes that died without running their `Drop`s (SIGKILL,
/// a crash) left: network namespaces, bpffs roots (after `ebpf-proxy cleanup` on them
/// when `bin` is given) and temporary files. Everything the harness creates carries
/// its creator's pid, so live runs are left alone. Says what it removed.
pub fn remove_stale_state(bin: Option<&Path>) -> Result<()> {
    for ns in netns::remove_stale()? {
        eprintln!("removed stale network namespace {ns}");
    }
    for root in agent::remove_stale_bpf_roots(bin)? {
        eprintln!("removed stale bpffs directory {}", root.display());
    }
    let tmp = std::env::temp_dir();
    for entry in std::fs::read_dir(&tmp).with_context(|| tmp.display().to_string())? {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if netns::owner_pid(&name).is_some_and(|pid| !netns::pid_alive(pid)) {
            let removed = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            removed.with_context(|| format!("remove {}", path.display()))?;
            eprintln!("removed stale {}", path.display());
        }
    }
    Ok(())
}

/// Runs a command to completion; an error carries the command line and its stderr.
pub fn run_cmd(cmd: &mut Command) -> Result<String> {
    let output = cmd
        .output()
        .with_context(|| format!("cannot start {}", describe(cmd)))?;
    if !output.status.success() {
        bail!(
            "{} failed ({}): {}",
            describe(cmd),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// `program arg arg ...`, for error messages.
pub fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|s| s.to_string_lossy())
        .collect::<Vec<_>>()
        .join(" ")
}

/// How often [`eventually`] asks again.
pub const POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// Asks `check` every `every` until it passes, for at most `within`: how long it
/// took, or its last complaint. The one wait of the harness: a test waits for the
/// condition it needs, never for a guessed time, and a condition that never comes
/// is reported with what was last seen.
pub fn wait_until(
    within: std::time::Duration,
    every: std::time::Duration,
    mut check: impl FnMut() -> std::result::Result<(), String>,
) -> std::result::Result<std::time::Duration, String> {
    let start = std::time::Instant::now();
    loop {
        match check() {
            Ok(()) => return Ok(start.elapsed()),
            Err(e) if start.elapsed() > within => return Err(e),
            Err(_) => std::thread::sleep(every),
        }
    }
}

/// [`wait_until`] every [`POLL`], panicking with `what` and the last complaint
/// after `within`. Returns how long it took.
#[track_caller]
pub fn eventually(
    what: &str,
    within: std::time::Duration,
    check: impl FnMut() -> std::result::Result<(), String>,
) -> std::time::Duration {
    wait_until(within, POLL, check)
        .unwrap_or_else(|e| panic!("{what}: still after {within:?}: {e}"))
}

/// Whether `path` is gone, or goes within `within`.
pub fn gone_within(path: &Path, within: std::time::Duration) -> bool {
    wait_until(within, POLL, || {
        if path.exists() {
            Err(format!("{} still there", path.display()))
        } else {
            Ok(())
        }
    })
    .is_ok()
}

/// A service port's transport protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
}

impl Protocol {
    /// As Kubernetes spells it (`TCP`).
    pub fn upper(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
        }
    }

    /// As iptables and kube-proxy's chain hashes spell it (`tcp`).
    pub fn lower(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}
