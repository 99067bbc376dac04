//! Which service ids `AFFINITY` may hold entries of. A Service port whose
//! session affinity goes off (or whose last frontend goes) loses its
//! entries at the end of that sync, as kube-proxy's `recent` lists go with
//! the rules that named them: turned on again, it starts afresh rather than
//! sending clients to the backends they had before. And a departure's purge
//! reads the map only when the departed backend's Service has affinity:
//! the pass walks every bucket, whatever the map holds.

use hashbrown::{HashMap, HashSet};

/// The frontends with session affinity per service id, and the ids whose
/// entries are to go.
#[derive(Debug, Default)]
pub(super) struct AffinityLedger {
    /// Frontends with session affinity, per service id (a Service port's
    /// ClusterIP, NodePorts and external addresses share one).
    frontends: HashMap<u32, u32>,
    /// Ids whose entries may be in the map with no frontend of affinity
    /// left to use them: their last such frontend went, or the map held
    /// them at the start. Those still without one at the next
    /// `AffinityLedger::take` are purged.
    orphaned: HashSet<u32>,
}

/// What `AFFINITY` loses after a sync (`Planner::take_affinity_purge`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AffinityPurge {
    /// Service ids with no frontend of session affinity left: every entry
    /// of theirs goes.
    pub dropped: Vec<u32>,
    /// Whether a departed backend's Service has affinity: the entries of
    /// the departed (service id, backend id) pairs go.
    pub departed: bool,
}

impl AffinityPurge {
    /// Whether the map must be read at all.
    pub fn needed(&self) -> bool {
        self.departed || !self.dropped.is_empty()
    }
}

impl AffinityLedger {
    /// A frontend of `service_id` with session affinity was programmed or
    /// adopted.
    pub(super) fn add(&mut self, service_id: u32) {
        *self.frontends.entry(service_id).or_default() += 1;
    }

    /// A frontend of `service_id` with session affinity was replaced or
    /// removed.
    pub(super) fn remove(&mut self, service_id: u32) {
        if let Some(count) = self.frontends.get_mut(&service_id) {
            *count -= 1;
            if *count == 0 {
                self.frontends.remove(&service_id);
                self.orphaned.insert(service_id);
            }
        }
    }

    /// The ids `AFFINITY` held entries of at the start.
    pub(super) fn found(&mut self, ids: impl IntoIterator<Item = u32>) {
        self.orphaned.extend(ids);
    }

    /// Whether a frontend of `service_id` has session affinity.
    pub(super) fn has(&self, service_id: u32) -> bool {
        self.frontends.contains_key(&service_id)
    }

    /// What `AFFINITY` loses now that backends left the service ids
    /// `departed`: the orphaned ids that no frontend of affinity took up
    /// again since, and the departed pairs of Services with affinity.
    pub(super) fn take(&mut self, mut departed: impl Iterator<Item = u32>) -> AffinityPurge {
        let mut dropped: Vec<u32> = self
            .orphaned
            .drain()
            .filter(|id| !self.frontends.contains_key(id))
            .collect();
        dropped.sort_unstable();
        AffinityPurge {
            dropped,
            departed: departed.any(|id| self.has(id)),
        }
    }

    /// Ids whose purge did not land: tried again at the next `take`.
    pub(super) fn retry(&mut self, dropped: &[u32]) {
        self.orphaned.extend(dropped.iter().copied());
    }
}
