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
pub mod kube_agent;
pub mod load;
pub mod manifest;
pub mod manifest_check;
pub mod netns;
pub mod nftables;
pub mod offloads;
pub mod process;
pub mod raw_bpf;
pub mod sandbox;
pub mod sctp;
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

/// Why a check of [`wait_for`] did not pass: not yet, with what it saw (asked
/// again until the time is up), or never (waiting longer cannot help, say the
/// process that was to answer has exited: the wait ends at once).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotYet {
    /// The condition does not hold yet; what was seen instead.
    Again(String),
    /// The condition cannot come any more; why.
    Never(String),
}

impl std::fmt::Display for NotYet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotYet::Again(seen) => write!(f, "{seen}"),
            NotYet::Never(why) => write!(f, "gave up: {why}"),
        }
    }
}

impl From<String> for NotYet {
    fn from(seen: String) -> Self {
        NotYet::Again(seen)
    }
}

impl From<&str> for NotYet {
    fn from(seen: &str) -> Self {
        NotYet::Again(seen.to_owned())
    }
}

impl From<anyhow::Error> for NotYet {
    fn from(e: anyhow::Error) -> Self {
        NotYet::Again(format!("{e:#}"))
    }
}

/// Asks `check` every `every` until it gives a value, for at most `within`: the
/// value and how long it took, or why not ([`NotYet::Again`] with the last thing
/// seen once the time is up, [`NotYet::Never`] as soon as the check says so). The
/// one wait of the harness: a test waits for the condition it needs, never for a
/// guessed time, and a condition that never comes is reported with what was last
/// seen. The check may complain with a `String`, an `anyhow::Error` or a
/// [`NotYet`].
pub fn wait_for<T, E: Into<NotYet>>(
    within: std::time::Duration,
    every: std::time::Duration,
    mut check: impl FnMut() -> std::result::Result<T, E>,
) -> std::result::Result<(T, std::time::Duration), NotYet> {
    let start = std::time::Instant::now();
    loop {
        match check().map_err(Into::into) {
            Ok(value) => return Ok((value, start.elapsed())),
            Err(never @ NotYet::Never(_)) => return Err(never),
            Err(again) if start.elapsed() > within => return Err(again),
            Err(_) => std::thread::sleep(every),
        }
    }
}

/// [`wait_for`] of a condition without a value: how long it took, or the last
/// complaint.
pub fn wait_until(
    within: std::time::Duration,
    every: std::time::Duration,
    check: impl FnMut() -> std::result::Result<(), String>,
) -> std::result::Result<std::time::Duration, String> {
    wait_for(within, every, check)
        .map(|((), took)| took)
        .map_err(|e| e.to_string())
}

/// [`wait_until`] every [`POLL`], panicking with `what` and the last complaint
/// after `within`. Returns how long it took.
#[track_caller]
pub fn eventually(
    what: &str,
    within: std::time::Duration,
    check: impl FnMut() -> std::result::Result<(), String>,
) -> std::time::Duration {
    eventually_value(what, within, check).1
}

/// [`wait_for`] every [`POLL`]: the value and how long it took, or a panic with
/// `what` and the last complaint (after `within`, or at once when the check says
/// [`NotYet::Never`]).
#[track_caller]
pub fn eventually_value<T, E: Into<NotYet>>(
    what: &str,
    within: std::time::Duration,
    check: impl FnMut() -> std::result::Result<T, E>,
) -> (T, std::time::Duration) {
    match wait_for(within, POLL, check) {
        Ok(done) => done,
        Err(NotYet::Again(seen)) => panic!("{what}: still after {within:?}: {seen}"),
        Err(NotYet::Never(why)) => panic!("{what}: given up on before {within:?}: {why}"),
    }
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
    /// SCTP: no sockets on this kernel; spoken over raw sockets ([`sctp`]).
    Sctp,
}

impl Protocol {
    /// As Kubernetes spells it (`TCP`).
    pub fn upper(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }

    /// As iptables and kube-proxy's chain hashes spell it (`tcp`).
    pub fn lower(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{NotYet, wait_for};

    const EVERY: Duration = Duration::from_millis(1);

    #[test]
    fn wait_for_gives_the_value_once_the_check_passes() {
        let mut asked = 0;
        let got = wait_for(Duration::from_secs(5), EVERY, || {
            asked += 1;
            if asked < 3 {
                Err(format!("asked {asked} times"))
            } else {
                Ok(asked * 10)
            }
        });
        assert_eq!(got.map(|(v, _)| v), Ok(30));
    }

    #[test]
    fn wait_for_times_out_with_the_last_complaint() {
        let mut asked = 0;
        let got: Result<((), Duration), NotYet> =
            wait_for(Duration::from_millis(20), EVERY, || {
                asked += 1;
                Err(format!("asked {asked} times"))
            });
        assert_eq!(got, Err(NotYet::Again(format!("asked {asked} times"))));
        assert!(asked > 1, "asked again before the time was up");
    }

    #[test]
    fn wait_for_gives_up_at_once_on_never() {
        let mut asked = 0;
        let got: Result<((), Duration), NotYet> = wait_for(Duration::from_mins(1), EVERY, || {
            asked += 1;
            Err(NotYet::Never("the process exited".into()))
        });
        assert_eq!(got, Err(NotYet::Never("the process exited".into())));
        assert_eq!(asked, 1);
    }
}
