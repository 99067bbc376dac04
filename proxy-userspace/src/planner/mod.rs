//! The planner: diffs the desired frontends of a service against what the
//! maps hold and applies the smallest ordered list of map operations, so that
//! a sync costs O(what changed), never O(cluster).
//!
//! Order is what keeps packets consistent (docs/architecture.md, "Map update order"):
//! 1. new backends, then new slots (nothing points at them yet);
//! 2. one write of the service entry: grows `count` over slots already
//!    written, or flips to a whole new slot set;
//! 3. only then old slots and unreferenced backends are deleted.
//!
//! A failure before step 2 rolls back what step 1 wrote and leaves the
//! frontend as it was; a failure in step 3 leaves only unreferenced garbage,
//! retried on the next sync. Nothing is ever flushed.
//!
//! This file is the planner's face; the work is below it, each file
//! importing only those under it. [`Planner`] and what it holds are in
//! `ledger` (its ids and their references in `ids`); `service` diffs a
//! Service's frontends against those it owned, `frontend` programs or
//! removes one, from the writes `plan` lists, and `cleanup` deletes what
//! nothing references. New frontends' writes are gathered in a `batch`,
//! which `landing` hands to the store; `adopt` takes over pinned maps read
//! back as `stored`. `node` plans the node-level maps the same way; every
//! write is an `ops::MapOp`, in the maps' encoding (`encode`).

mod adopt;
mod affinity;
mod backends;
mod balance;
mod batch;
mod cleanup;
pub mod encode;
mod frontend;
mod ids;
mod landing;
mod ledger;
pub mod node;
mod ops;
mod outcome;
mod plan;
mod service;
mod stored;

pub use affinity::AffinityPurge;
pub use batch::{Batch, Unwritten};
pub use encode::SourceRangeEntry;
pub use ledger::{Departed, Planner};
pub use ops::{
    IfaceSet, Landing, MapOp, MapStore, PhaseFailure, Phases, apply_phases, write_phases,
};
pub use outcome::{PlanError, SyncOutcome};
pub use stored::{NodeState, StoredState};

use std::collections::HashSet;

use crate::{model::Frontend, source::ObjectKey};

impl Planner {
    pub fn new() -> Self {
        Self {
            next_backend_id: 1,
            next_service_id: 1,
            next_slot_set: 1,
            ..Default::default()
        }
    }

    /// Takes over what pinned maps hold, from an earlier run of the agent:
    /// every consistent frontend is kept as it is (traffic keeps flowing) and
    /// will be diffed against the desired state; unreferenced slots and
    /// backends are returned as deletes.
    pub fn adopt(stored: &StoredState) -> (Self, Vec<MapOp>) {
        Self::from_stored(stored)
    }

    /// Balances frontends with `lb` from now on: a frontend changes
    /// algorithm or table when it is next programmed.
    pub fn balance_with(&mut self, lb: crate::maglev::LbConfig) {
        self.lb = lb;
    }

    /// Backends that left a service since the last call.
    pub fn take_departed(&mut self) -> Vec<Departed> {
        std::mem::take(&mut self.departed)
    }

    /// Of `departed`, those a purge tried again after a failure still owes:
    /// those whose backend id none of the service id's frontends holds
    /// again. A backend back under the same id (another Service held it
    /// meanwhile), or another given the id that joined, has live flows
    /// under it, which the purge must spare. One back under a new id is
    /// still owed its flows under the old id, which date from before it
    /// left and go as kube-proxy's cleanup would have removed them then (a
    /// purge by id would otherwise never reach them); but not the closing
    /// of the node's sockets connected to it, which goes by address and
    /// would reach those connected since: its address is dropped
    /// (`backend` None), which the flows' purge does not need.
    pub fn still_departed(&self, mut departed: Vec<Departed>) -> Vec<Departed> {
        let services: HashSet<u32> = departed.iter().map(|d| d.service_id).collect();
        let mut ids = HashSet::new();
        let mut endpoints = HashSet::new();
        for applied in self.frontends.values() {
            let service_id = applied.value.service_id;
            if !services.contains(&service_id) {
                continue;
            }
            for id in &applied.backend_ids {
                if ids.insert((service_id, *id))
                    && let Some(b) = self.backends.backend_of(*id)
                {
                    endpoints.insert((service_id, b.addr_be, b.port_be, b.proto));
                }
            }
        }
        departed.retain(|d| !ids.contains(&(d.service_id, d.backend_id)));
        for d in &mut departed {
            if d.backend
                .is_some_and(|b| endpoints.contains(&(d.service_id, b.addr_be, b.port_be, b.proto)))
            {
                d.backend = None;
            }
        }
        departed
    }

    /// What `AFFINITY` loses after this sync, whose departed backends are
    /// `departed` (`take_departed`): the entries of the service ids whose
    /// session affinity went off or whose last frontend went, and those of
    /// the departed backends, where their Service has affinity.
    pub fn take_affinity_purge(&mut self, departed: &[Departed]) -> AffinityPurge {
        self.affinity.take(departed.iter().map(|d| d.service_id))
    }

    /// A purge `take_affinity_purge` handed out did not land: its dropped
    /// ids go at the next one.
    pub fn retry_affinity_purge(&mut self, purge: &AffinityPurge) {
        self.affinity.retry(&purge.dropped);
    }

    /// The service ids `AFFINITY` held entries of at the start (from an
    /// earlier agent): those no frontend with session affinity takes up by
    /// the end of the next sync go then.
    pub fn note_affinity_entries(&mut self, service_ids: impl IntoIterator<Item = u32>) {
        self.affinity.found(service_ids);
    }

    /// Hands out service ids below `bound` (the size of the datapath's
    /// Service counters) while one is free, so that every Service port
    /// is counted while there are fewer than that.
    pub fn count_ids_below(&mut self, bound: u32) {
        self.counted_ids = bound;
        self.counted_in_use = self
            .service_ids_in_use
            .keys()
            .filter(|id| **id < bound)
            .count();
    }

    /// Number of frontends programmed.
    pub fn frontend_count(&self) -> usize {
        self.frontends.len()
    }

    /// Number of distinct backends programmed.
    pub fn backend_count(&self) -> usize {
        self.backends.len()
    }

    /// Makes room for `services` more Services' frontends, so that a first
    /// sync does not rehash the tables as they fill.
    pub fn reserve(&mut self, services: usize) {
        self.frontends.reserve(services);
        self.owned.reserve(services);
        self.service_ids.reserve(services);
        self.service_ids_in_use.reserve(services);
    }

    /// Makes the maps hold exactly `desired` for the service `owner`:
    /// frontends it had and no longer has are removed.
    pub fn sync_service<S: MapStore>(
        &mut self,
        owner: &ObjectKey,
        desired: &[Frontend],
        store: &mut S,
    ) -> SyncOutcome<S::Error> {
        self.sync_service_in(owner, desired, store, None)
    }

    /// [`Self::sync_service`], with the writes of frontends the maps do not
    /// have yet gathered into `batch` rather than written: they are in the
    /// maps once [`Self::flush`] has written the batch (which this does
    /// first whenever it has to write anything else). Until then the
    /// outcome counts them as programmed; those of a batch that fails are
    /// in the batch's failures instead.
    pub fn sync_service_batched<S: MapStore>(
        &mut self,
        owner: &ObjectKey,
        desired: &[Frontend],
        store: &mut S,
        batch: &mut Batch<S::Error>,
    ) -> SyncOutcome<S::Error> {
        self.sync_service_in(owner, desired, store, Some(batch))
    }

    /// Writes what `batch` gathered, and waits until it has landed: every
    /// source range, then every backend, every slot and every service
    /// entry, one map at a time (see [`Batch`]). When a write fails, the
    /// frontends whose service entry did not land are forgotten, what of
    /// them landed is deleted, and they go to the batch's failures.
    pub fn flush<S: MapStore>(&mut self, batch: &mut Batch<S::Error>, store: &mut S) {
        self.start(batch, store);
        self.land_in_flight(batch, store);
    }

    /// Hands what `batch` gathered to the store, which may write it while
    /// the next batch is gathered ([`MapStore::start_batch`]), once the
    /// batch before has landed. When that one failed, what `batch` gathered
    /// is not written: it may use backends the failed one did not write.
    /// Its frontends go to the failures with those of the failed batch.
    pub fn start<S: MapStore>(&mut self, batch: &mut Batch<S::Error>, store: &mut S) {
        self.hand_to_store(batch, store);
    }

    /// After a complete listing has been synced: frontends adopted from the
    /// pinned maps that no service claimed are removed.
    pub fn remove_unclaimed<S: MapStore>(&mut self, store: &mut S) -> SyncOutcome<S::Error> {
        self.drop_unclaimed(store)
    }

    /// Deletes that failed are waiting for another try.
    pub fn has_garbage(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Applies garbage deletes (from adoption or failed earlier cleanups).
    pub fn collect_garbage<S: MapStore>(
        &mut self,
        garbage: Vec<MapOp>,
        store: &mut S,
    ) -> SyncOutcome<S::Error> {
        self.pending.extend(garbage);
        let mut outcome = SyncOutcome::new();
        self.retry_pending(store, &mut outcome);
        outcome
    }
}

#[cfg(test)]
mod tests;
