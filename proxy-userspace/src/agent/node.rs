//! The node-level maps in the agent: what it wants them to hold (the
//! configuration, then the interfaces as they come), written through the node
//! planner, and a write that failed retried with the sync loop's backoff until
//! it lands.

use std::{net::Ipv4Addr, time::Instant};

use tracing::{info, warn};

use super::sync::backoff;
use crate::{
    model::Cidr,
    planner::{
        MapStore,
        node::{DesiredNode, NodePlanner, NodeState},
    },
};

pub struct NodeMaps {
    desired: DesiredNode,
    planner: NodePlanner,
    failures: u32,
    retry_at: Option<Instant>,
}

impl NodeMaps {
    /// Starts from what the maps hold (`applied`), wanting `desired`.
    pub fn new(applied: NodeState, desired: DesiredNode) -> Self {
        Self {
            desired,
            planner: NodePlanner::adopt(applied),
            failures: 0,
            retry_at: None,
        }
    }

    /// The interfaces as they are now: node addresses, and SNAT to `snat`.
    pub fn set_interfaces(
        &mut self,
        addrs: &[Ipv4Addr],
        nodeport_addresses: &[Cidr],
        snat: Option<Ipv4Addr>,
        localhost_nodeports: bool,
    ) {
        self.desired
            .set_interfaces(addrs, nodeport_addresses, snat, localhost_nodeports);
    }

    /// When a failed write is due for its retry.
    pub fn wakeup(&self) -> Option<Instant> {
        self.retry_at
    }

    /// Writes what the maps lack; a failure is logged with the write that
    /// failed and retried after the backoff.
    pub fn sync<S: MapStore>(&mut self, store: &mut S, now: Instant) {
        let outcome = self.planner.sync(&self.desired, store);
        match outcome.failed {
            None => {
                if self.failures > 0 {
                    info!(failures = self.failures, "node maps written after retrying");
                }
                self.failures = 0;
                self.retry_at = None;
            }
            Some((op, e)) => {
                self.failures += 1;
                let wait = backoff(self.failures);
                warn!(
                    error = %e,
                    failures = self.failures,
                    retry_in_ms = wait.as_millis() as u64,
                    "{op} failed; retrying"
                );
                self.retry_at = Some(now + wait);
            }
        }
    }
}
