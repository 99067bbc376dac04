//! The Kubernetes e2e suite's ClientIP affinity scenario, for a Service of either
//! family: a run of new connections from one client that must stick to one backend,
//! then rounds of waiting out a short affinity timeout until the client is balanced
//! anew. Judging is left to the caller, so that two datapaths (ebpf-proxy's and
//! kube-proxy's `-m recent` rules) can be compared.

use std::{collections::BTreeSet, thread, time::Duration};

use crate::{
    client::{Outcome, Peer, TIMEOUT, tcp_request_here},
    netns::NetNs,
};

/// Consecutive connections that must land on one backend: the Kubernetes e2e suite's
/// `AffinityConfirmCount`.
pub const STICKY_RUN: usize = 15;
/// The affinity timeout of the expiry checks: short enough to wait out.
pub const AFFINITY_TIMEOUT_S: u32 = 3;
/// How far past the timeout a client waits before it expects a fresh pick. The last
/// stamp is taken before the wait starts and a sleep only ever overshoots, so this
/// only covers the granularity of the kernel clocks the windows are measured with
/// (jiffies for `-m recent`, ktime for the datapath).
pub const TIMEOUT_MARGIN: Duration = Duration::from_millis(500);
/// Wait-and-reconnect rounds before "never re-balanced" is declared. Each round's
/// first connection is a fresh uniform pick among 3 backends, so a correct datapath
/// repeats the stuck backend in all of them with probability (1/3)^10 < 2e-5; the
/// rounds stop as soon as a second backend shows up (1.5 rounds on average).
pub const REBALANCE_ROUNDS: usize = 10;
/// Connections per round after a wait: the first is the new pick, the rest must
/// follow it (affinity is still on, it only expired).
pub const ROUND_CONNECTIONS: usize = 3;

/// `n` new TCP connections, one after the other, from `ns` to `addr`: which backend
/// answered each. Anything but a reply, or a backend that saw another address than
/// `client`, is an error naming the connection.
pub fn try_connect_n<A: Peer>(
    ns: &NetNs,
    client: A::Ip,
    addr: A,
    n: usize,
) -> Result<Vec<String>, String> {
    ns.run(|| {
        (0..n)
            .map(|i| match tcp_request_here(addr, TIMEOUT) {
                Outcome::Reply(r) if r.peer.peer_ip() == client => Ok(r.backend),
                Outcome::Reply(r) => Err(format!(
                    "connection {i} to {addr}: {} saw the client as {} instead of {client}",
                    r.backend, r.peer
                )),
                other => Err(format!("connection {i} to {addr}: {other}")),
            })
            .collect()
    })
    .map_err(|e| format!("{e:#}"))?
}

/// [`try_connect_n`], panicking with its error.
#[track_caller]
pub fn connect_n<A: Peer>(ns: &NetNs, client: A::Ip, addr: A, n: usize) -> Vec<String> {
    try_connect_n(ns, client, addr, n).unwrap_or_else(|e| panic!("{e}"))
}

/// The distinct backends among `backends`.
pub fn distinct(backends: &[String]) -> BTreeSet<&str> {
    backends.iter().map(String::as_str).collect()
}

/// What one client saw of a service's ClientIP affinity with a short timeout.
#[derive(Debug)]
pub struct AffinityRun {
    /// Backends of [`STICKY_RUN`] consecutive new connections.
    pub sticky: Vec<String>,
    /// Per wait past the timeout, the backends of the connections right after it.
    pub rounds: Vec<Vec<String>>,
}

impl AffinityRun {
    pub fn stuck(&self) -> bool {
        distinct(&self.sticky).len() == 1
    }

    /// The first connection after each wait is a fresh pick; the client is
    /// re-balanced if those picks (and the backend it was stuck to) differ.
    pub fn picks(&self) -> Vec<String> {
        std::iter::once(&self.sticky[0])
            .chain(self.rounds.iter().map(|r| &r[0]))
            .cloned()
            .collect()
    }

    pub fn rebalanced(&self) -> bool {
        distinct(&self.picks()).len() >= 2
    }

    /// Each round's fresh pick is sticky again.
    pub fn resticks(&self) -> bool {
        self.rounds.iter().all(|r| distinct(r).len() == 1)
    }

    pub fn summary(&self) -> String {
        format!(
            "{} connections -> {:?}; after each wait of {}s + {:?}: {:?} \
             (stuck: {}, re-balanced: {}, sticky again after each pick: {})",
            self.sticky.len(),
            distinct(&self.sticky),
            AFFINITY_TIMEOUT_S,
            TIMEOUT_MARGIN,
            self.rounds,
            self.stuck(),
            self.rebalanced(),
            self.resticks()
        )
    }
}

/// The e2e affinity-timeout scenario against a service with ClientIP affinity and a
/// [`AFFINITY_TIMEOUT_S`] timeout: [`STICKY_RUN`] connections, then rounds of waiting
/// out the timeout and reconnecting until a second backend shows up (or
/// [`REBALANCE_ROUNDS`] pass).
pub fn affinity_run<A: Peer>(ns: &NetNs, client: A::Ip, addr: A) -> Result<AffinityRun, String> {
    let sticky = try_connect_n(ns, client, addr, STICKY_RUN)?;
    let mut run = AffinityRun {
        sticky,
        rounds: Vec::new(),
    };
    let wait = Duration::from_secs(AFFINITY_TIMEOUT_S.into()) + TIMEOUT_MARGIN;
    while run.rounds.len() < REBALANCE_ROUNDS && !run.rebalanced() {
        // The point: the affinity timeout runs out before the next round.
        thread::sleep(wait);
        run.rounds
            .push(try_connect_n(ns, client, addr, ROUND_CONNECTIONS)?);
    }
    Ok(run)
}
