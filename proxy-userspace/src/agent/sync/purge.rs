//! The purge of departed backends (`SyncTarget::clean_departed`: their
//! flows, affinity entries and the node's sockets connected to them) owed
//! until it lands. One that failed is tried again on the loop's own timer,
//! backed off as a failed write is ([`Retry`]), together with whatever
//! departs meanwhile; a backend back in its Service by then under the same
//! id is spared, since its flows under that id are live again
//! (`Planner::still_departed`).

use std::{collections::HashMap, time::Instant};

use tracing::info;

use crate::{
    planner::{Departed, Planner},
    retry::Retry,
};

/// The departures whose purge failed, by (service id, backend id): a pair
/// that departs again while owed is owed once.
#[derive(Debug, Default)]
pub(super) struct Purges {
    owed: HashMap<(u32, u32), Departed>,
    /// Set while the last purge failed: when the next is due. Also set
    /// with nothing owed here, for the planner's own retry of the
    /// affinity entries of Services whose affinity went off.
    retry: Option<Retry>,
}

impl Purges {
    /// When the next attempt is due.
    pub fn wakeup(&self) -> Option<Instant> {
        self.retry.map(|r| r.due)
    }

    /// Departures owed.
    pub fn owed(&self) -> usize {
        self.owed.len()
    }

    /// The departures to purge at `now`: `fresh` (this sync's), and the
    /// owed ones once their retry is due, less those whose backend id is
    /// back in its Service.
    pub fn due(&mut self, now: Instant, fresh: Vec<Departed>, planner: &Planner) -> Vec<Departed> {
        if !self.retry.is_some_and(|r| r.is_due(now)) || self.owed.is_empty() {
            return fresh;
        }
        let owed: Vec<Departed> = self.owed.drain().map(|(_, d)| d).collect();
        let owed_count = owed.len();
        let mut due = planner.still_departed(owed);
        info!(
            departed = due.len(),
            rejoined = owed_count - due.len(),
            failures = self.retry.map_or(0, |r| r.failures),
            "purging departed backends again"
        );
        due.extend(fresh);
        due
    }

    /// The purge of `departed`, tried at `now`, landed or not.
    pub fn settle(&mut self, now: Instant, departed: Vec<Departed>, landed: bool) {
        if landed {
            if self.owed.is_empty()
                && let Some(retry) = self.retry.take()
            {
                info!(
                    failures = retry.failures,
                    "departed backends purged after retrying"
                );
            }
            return;
        }
        for d in departed {
            self.owed.insert((d.service_id, d.backend_id), d);
        }
        self.retry = Some(Retry::after(self.retry.as_ref(), now, 0));
    }
}
