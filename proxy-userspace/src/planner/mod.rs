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

mod backends;
mod batch;
pub mod encode;
pub mod node;
mod ops;
mod stored;

use std::{collections::BTreeSet, sync::Arc};

pub use batch::{Batch, Unwritten};
pub use encode::SourceRangeEntry;
use hashbrown::HashMap;
pub use ops::{Landing, MapOp, MapStore, PhaseFailure, Phases, apply_phases, write_phases};
use proxy_common::{Backend, BackendSlotKey, ServiceKey, ServiceValue, service_flags};
pub use stored::{NodeState, StoredState};

use self::{
    backends::{BackendHash, Backends},
    batch::{Gathered, InFlight, Unlanded},
};
use crate::{
    model::{Frontend, FrontendKey, FrontendKind, NoEndpointAction, Scope, ServicePortName},
    source::ObjectKey,
};

/// Why a frontend could not be programmed.
#[derive(Debug, thiserror::Error)]
pub enum PlanError<E: std::error::Error + 'static> {
    #[error("frontend {frontend} of {owner}: already programmed for {other}")]
    Conflict {
        frontend: FrontendKey,
        owner: ObjectKey,
        other: ObjectKey,
    },
    #[error("frontend {frontend} of {owner}: {source}")]
    Write {
        frontend: FrontendKey,
        owner: ObjectKey,
        #[source]
        source: E,
    },
    /// Gathered into a [`Batch`] that failed before its service entry
    /// landed (`reason`, the write that failed, may be another frontend's).
    #[error("frontend {frontend} of {owner}: not written, its batch failed: {reason}")]
    Unwritten {
        frontend: FrontendKey,
        owner: ObjectKey,
        reason: String,
    },
    #[error("frontend {frontend}: {backends} backends is more than one frontend may have")]
    TooManyBackends {
        frontend: FrontendKey,
        backends: usize,
    },
}

/// What one frontend has in the maps.
#[derive(Clone, Debug)]
struct Applied {
    key: ServiceKey,
    value: ServiceValue,
    /// Backend id in each slot `0..value.count` of `value.slot_set`.
    backend_ids: Vec<u32>,
    /// None for a frontend adopted from pinned maps and not claimed since.
    /// Shared with the planner's index of what each Service owns.
    owner: Option<Arc<ObjectKey>>,
    /// Shared with the service id it holds.
    service: Option<Arc<ServicePortName>>,
    /// Its `SOURCE_RANGES` entries.
    source_ranges: BTreeSet<SourceRangeEntry>,
}

#[derive(Clone, Copy, Debug)]
struct Refcounted {
    id: u32,
    refs: u32,
}

/// Result of applying plans: what was done, and what failed (others went on).
#[derive(Debug, Default)]
pub struct SyncOutcome<E: std::error::Error + 'static> {
    pub ops: usize,
    pub frontends_changed: usize,
    pub errors: Vec<PlanError<E>>,
}

impl<E: std::error::Error + 'static> SyncOutcome<E> {
    fn new() -> Self {
        Self {
            ops: 0,
            frontends_changed: 0,
            errors: Vec::new(),
        }
    }
}

#[derive(Default)]
pub struct Planner {
    frontends: HashMap<FrontendKey, Applied>,
    /// Boxed slices, not sets: a Service has a frontend or two, and a set's
    /// first node has room for eleven.
    owned: HashMap<Arc<ObjectKey>, Box<[FrontendKey]>>,
    backends: Backends,
    service_ids: HashMap<Arc<ServicePortName>, Refcounted>,
    service_ids_in_use: HashMap<u32, u32>,
    slot_sets_in_use: BTreeSet<u32>,
    next_backend_id: u32,
    next_service_id: u32,
    next_slot_set: u32,
    /// Deletes of garbage that failed; retried on the next sync.
    pending: Vec<MapOp>,
    /// (service id, backend id) pairs that left a backend set since the
    /// last `take_departed`: their flows and affinity need cleaning.
    departed: Vec<Departed>,
}

/// A backend that left a service's backend set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Departed {
    pub service_id: u32,
    pub backend_id: u32,
    /// Its address, port and protocol, taken before the id is released and
    /// perhaps given to another backend; None for an id the planner holds
    /// no entry of.
    pub backend: Option<Backend>,
}

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
        let mut planner = Self::new();
        let mut garbage = Vec::new();
        let mut referenced_slots = BTreeSet::new();
        for (key, value) in &stored.services {
            let Some(fkey) = encode::frontend_key(key) else {
                garbage.push(MapOp::DeleteService { key: *key });
                continue;
            };
            // A missing slot (a crash mid-update) becomes backend 0, which
            // is never allocated: the next plan sees a difference and
            // rewrites the whole set.
            let backend_ids: Vec<u32> = (0..value.count)
                .map(|slot| {
                    let sk = BackendSlotKey {
                        slot_set: value.slot_set,
                        slot,
                    };
                    referenced_slots.insert(sk);
                    stored.slots.get(&sk).copied().unwrap_or(0)
                })
                .collect();
            planner.slot_sets_in_use.insert(value.slot_set);
            *planner
                .service_ids_in_use
                .entry(value.service_id)
                .or_default() += 1;
            for id in &backend_ids {
                if let Some(b) = stored.backends.get(id) {
                    planner.backends.insert(*id, *b);
                    planner.backends.acquire(*id);
                }
            }
            planner.frontends.insert(
                fkey,
                Applied {
                    key: *key,
                    value: *value,
                    backend_ids,
                    owner: None,
                    service: None,
                    source_ranges: stored
                        .source_ranges
                        .iter()
                        .filter(|(_, k)| k.frontend == *key)
                        .copied()
                        .collect(),
                },
            );
        }
        for entry in &stored.source_ranges {
            if !stored.services.contains_key(&entry.1.frontend) {
                garbage.push(MapOp::DeleteSourceRange { entry: *entry });
            }
        }
        for key in stored.slots.keys() {
            if !referenced_slots.contains(key) {
                garbage.push(MapOp::DeleteSlot { key: *key });
            }
        }
        for (id, b) in &stored.backends {
            if planner.backends.id_of(b) != Some(*id) {
                garbage.push(MapOp::DeleteBackend { id: *id });
            }
        }
        planner.next_backend_id = stored.backends.keys().max().map_or(1, |m| m + 1);
        planner.next_slot_set = planner.slot_sets_in_use.last().map_or(1, |m| m + 1);
        planner.next_service_id = planner.service_ids_in_use.keys().max().map_or(1, |m| m + 1);
        (planner, garbage)
    }

    /// Backend `backend_id` leaving service `service_id`, with its address
    /// while the id still names it.
    fn departure(&self, service_id: u32, backend_id: u32) -> Departed {
        Departed {
            service_id,
            backend_id,
            backend: self.backends.backend_of(backend_id),
        }
    }

    /// Backends that left a service since the last call.
    pub fn take_departed(&mut self) -> Vec<Departed> {
        std::mem::take(&mut self.departed)
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

    fn sync_service_in<S: MapStore>(
        &mut self,
        owner: &ObjectKey,
        desired: &[Frontend],
        store: &mut S,
        mut batch: Option<&mut Batch<S::Error>>,
    ) -> SyncOutcome<S::Error> {
        let mut outcome = SyncOutcome::new();
        if !self.pending.is_empty() {
            self.flush_first(batch.as_deref_mut(), store);
        }
        self.retry_pending(store, &mut outcome);
        let (owner, previous): (Arc<ObjectKey>, BTreeSet<FrontendKey>) =
            match self.owned.remove_entry(owner) {
                Some((shared, keys)) => (shared, keys.into_vec().into_iter().collect()),
                None => (Arc::new(owner.clone()), BTreeSet::new()),
            };
        let mut now_owned = BTreeSet::new();
        for fe in desired {
            match self.apply_frontend(&owner, fe, store, batch.as_deref_mut()) {
                Ok(ops) => {
                    if ops > 0 {
                        outcome.frontends_changed += 1;
                    }
                    outcome.ops += ops;
                    now_owned.insert(fe.key);
                }
                // A conflict leaves the other owner's frontend alone; a write
                // error leaves this one as it was, still ours.
                Err(e @ PlanError::Conflict { .. }) => outcome.errors.push(e),
                Err(e) => {
                    if previous.contains(&fe.key) {
                        now_owned.insert(fe.key);
                    }
                    outcome.errors.push(e);
                }
            }
        }
        let dropped: Vec<FrontendKey> = previous
            .difference(&now_owned)
            .filter(|key| !desired.iter().any(|fe| fe.key == **key))
            .copied()
            .collect();
        if !dropped.is_empty() {
            self.flush_first(batch, store);
        }
        for key in &dropped {
            match self.remove_frontend(&owner, key, store) {
                Ok(ops) => {
                    outcome.ops += ops;
                    outcome.frontends_changed += 1;
                }
                Err(e) => {
                    now_owned.insert(*key);
                    outcome.errors.push(e);
                }
            }
        }
        // A frontend gathered above and forgotten when its batch failed
        // (flushed before a later write of this Service) is not ours.
        now_owned.retain(|key| self.frontends.contains_key(key));
        if !now_owned.is_empty() {
            self.owned.insert(owner, now_owned.into_iter().collect());
        }
        outcome
    }

    /// Writes `batch` before a write that is not gathered: such a write may
    /// point at what the batch holds, or free an id it took.
    fn flush_first<S: MapStore>(&mut self, batch: Option<&mut Batch<S::Error>>, store: &mut S) {
        if let Some(batch) = batch
            && !batch.is_settled()
        {
            self.flush(batch, store);
        }
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
        let failed = self.land_in_flight(batch, store);
        if batch.is_empty() {
            return;
        }
        let (phases, gathered) = batch.take_phases();
        if let Some((unlanded, reason)) = failed {
            let unlanded = unlanded.with_all(&phases);
            let reason = format!("the batch before, whose backends it may use, failed: {reason}");
            self.forget_batch(gathered, &unlanded, &reason, batch, store);
            return;
        }
        let phases = Arc::new(phases);
        batch.in_flight = Some(InFlight {
            landing: store.start_batch(Arc::clone(&phases)),
            phases,
            frontends: gathered,
        });
    }

    /// Waits until the batch handed to the store has landed (see
    /// [`Self::flush`] for what a failure does); when it failed, what of it
    /// never landed and why. Only once what was gathered since is started
    /// or failed: it may use what the batch did not write.
    fn land_in_flight<S: MapStore>(
        &mut self,
        batch: &mut Batch<S::Error>,
        store: &mut S,
    ) -> Option<(Unlanded, String)> {
        let in_flight = batch.in_flight.take()?;
        let PhaseFailure {
            phase,
            landed,
            error,
        } = in_flight.landing.wait().err()?;
        let phases = &in_flight.phases;
        // The store's error may name the write already.
        let error = error.to_string();
        let reason = match phases[phase].get(landed).map(ToString::to_string) {
            Some(op) if !error.starts_with(&op) => format!("{op}: {error}"),
            _ => error,
        };
        tracing::warn!(error = %reason, "a batch of new frontends failed; retrying them");
        // Service entries land in the order of the frontends.
        let first_failed = if phase == phases.len() - 1 { landed } else { 0 };
        let unlanded = Unlanded::new(phases, phase, landed);
        let failed = in_flight.frontends.into_iter().skip(first_failed).collect();
        self.forget_batch(failed, &unlanded, &reason, batch, store);
        Some((unlanded, reason))
    }

    /// Forgets `failed`, gathered frontends not in the maps, deleting what
    /// of them landed (what is not `unlanded`), and hands them to the
    /// batch's failures.
    fn forget_batch<S: MapStore>(
        &mut self,
        failed: Vec<Gathered>,
        unlanded: &Unlanded,
        reason: &str,
        batch: &mut Batch<S::Error>,
        store: &mut S,
    ) {
        for fe in failed {
            let undo: Vec<MapOp> = self
                .forget_unwritten(&fe.key, &fe.owner)
                .into_iter()
                .filter(|op| unlanded.needs(op))
                .collect();
            self.apply_cleanup(undo, store);
            batch.fail(Unwritten {
                error: PlanError::Unwritten {
                    frontend: fe.key,
                    owner: (*fe.owner).clone(),
                    reason: reason.to_owned(),
                },
                writes: fe.writes,
            });
        }
    }

    /// Undoes the bookkeeping of a gathered frontend whose writes did not
    /// all land; returns the deletes of what it alone held.
    fn forget_unwritten(&mut self, key: &FrontendKey, owner: &ObjectKey) -> Vec<MapOp> {
        let Some(applied) = self.frontends.remove(key) else {
            return Vec::new();
        };
        self.slot_sets_in_use.remove(&applied.value.slot_set);
        let mut deletes: Vec<MapOp> = (0..applied.backend_ids.len())
            .map(|slot| MapOp::DeleteSlot {
                key: BackendSlotKey {
                    slot_set: applied.value.slot_set,
                    slot: slot as u32,
                },
            })
            .collect();
        deletes.extend(
            applied
                .source_ranges
                .iter()
                .map(|entry| MapOp::DeleteSourceRange { entry: *entry }),
        );
        deletes.extend(self.release_backends(&applied.backend_ids));
        match applied.service.as_ref() {
            Some(name) => self.release_service_id(name),
            None => self.release_adopted_service_id(applied.value.service_id),
        }
        if let Some(keys) = self.owned.get_mut(owner) {
            let rest: Box<[FrontendKey]> = keys.iter().filter(|k| *k != key).copied().collect();
            if rest.is_empty() {
                self.owned.remove(owner);
            } else {
                *keys = rest;
            }
        }
        deletes
    }

    /// After a complete listing has been synced: frontends adopted from the
    /// pinned maps that no service claimed are removed.
    pub fn remove_unclaimed<S: MapStore>(&mut self, store: &mut S) -> SyncOutcome<S::Error> {
        let mut outcome = SyncOutcome::new();
        let unclaimed: Vec<FrontendKey> = self
            .frontends
            .iter()
            .filter(|(_, a)| a.owner.is_none())
            .map(|(k, _)| *k)
            .collect();
        let nobody = Arc::new(ObjectKey {
            namespace: String::new(),
            name: "(adopted)".into(),
        });
        for key in unclaimed {
            match self.remove_frontend(&nobody, &key, store) {
                Ok(ops) => {
                    outcome.ops += ops;
                    outcome.frontends_changed += 1;
                }
                Err(e) => outcome.errors.push(e),
            }
        }
        outcome
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

    fn retry_pending<S: MapStore>(&mut self, store: &mut S, outcome: &mut SyncOutcome<S::Error>) {
        let pending = std::mem::take(&mut self.pending);
        for op in pending {
            if store.apply(&op).is_ok() {
                outcome.ops += 1;
            } else {
                self.pending.push(op);
            }
        }
    }

    /// Programs one frontend in the steps the update order needs: check it
    /// may be ours, resolve its backend ids and service id, plan the writes
    /// up to the flip of its service entry, write them (rolled back on
    /// failure), then commit the bookkeeping and clean up what the flip
    /// left unreferenced.
    fn apply_frontend<S: MapStore>(
        &mut self,
        owner: &Arc<ObjectKey>,
        fe: &Frontend,
        store: &mut S,
        mut batch: Option<&mut Batch<S::Error>>,
    ) -> Result<usize, PlanError<S::Error>> {
        let prev = self.claim(owner, fe)?;
        if prev.is_some() {
            // Before its backends are resolved: a failed batch releases ids.
            self.flush_first(batch.as_deref_mut(), store);
        }
        let (ids, fresh) = self.backend_ids(fe);
        let service_id = self.service_id(fe, prev.as_ref());
        let mut plan = self.plan(fe, prev.as_ref(), service_id, ids, fresh);
        if let Some(batch) = batch
            && prev.is_none()
        {
            debug_assert!(Batch::<S::Error>::can_gather(&plan.writes));
            let writes = std::mem::take(&mut plan.writes);
            let count = writes.len();
            batch.gather(fe.key, owner, writes);
            // Nothing to clean up after a new frontend: commit writes nothing.
            return Ok(count + self.commit(owner, fe, prev, plan, store));
        }
        if let Err(source) = self.write(&plan, store) {
            return Err(PlanError::Write {
                frontend: fe.key,
                owner: (**owner).clone(),
                source,
            });
        }
        Ok(self.commit(owner, fe, prev, plan, store))
    }

    /// What the maps hold for `fe` now, if `owner` may program it.
    fn claim<E: std::error::Error + 'static>(
        &self,
        owner: &ObjectKey,
        fe: &Frontend,
    ) -> Result<Option<Applied>, PlanError<E>> {
        if fe.backends.len() > proxy_common::MAX_BACKENDS_PER_SERVICE as usize {
            return Err(PlanError::TooManyBackends {
                frontend: fe.key,
                backends: fe.backends.len(),
            });
        }
        let prev = self.frontends.get(&fe.key).cloned();
        if let Some(other) = prev.as_ref().and_then(|p| p.owner.as_deref())
            && other != owner
        {
            return Err(PlanError::Conflict {
                frontend: fe.key,
                owner: owner.clone(),
                other: other.clone(),
            });
        }
        Ok(prev)
    }

    /// The id of each backend in slot order: existing ones are reused; new
    /// ones (returned apart) are tentative until the plan is committed.
    fn backend_ids(&mut self, fe: &Frontend) -> (Vec<u32>, Vec<Fresh>) {
        let mut ids = Vec::with_capacity(fe.backends.len());
        let mut fresh: Vec<Fresh> = Vec::new();
        for b in &fe.backends {
            let enc = encode::backend(b);
            let id = match self.backends.find(&enc) {
                (Some(id), _) => id,
                (None, hash) => {
                    if let Some(f) = fresh.iter().find(|f| f.backend == enc) {
                        f.id
                    } else {
                        let id = self.alloc_backend_id(&fresh);
                        fresh.push(Fresh {
                            id,
                            backend: enc,
                            hash,
                        });
                        id
                    }
                }
            };
            ids.push(id);
        }
        (ids, fresh)
    }

    fn service_id(&mut self, fe: &Frontend, prev: Option<&Applied>) -> u32 {
        match self.service_ids.get(&fe.service) {
            Some(r) => r.id,
            // An adopted frontend keeps its id, so affinity survives a restart.
            None => match prev {
                Some(p) if p.service.is_none() => p.value.service_id,
                _ => self.alloc_service_id(),
            },
        }
    }

    /// The writes that bring the maps from `prev` to `fe`, in the update
    /// order: new source ranges, new backends and new slots, then the service
    /// entry (the flip); and the deletes that may follow it.
    fn plan(
        &mut self,
        fe: &Frontend,
        prev: Option<&Applied>,
        service_id: u32,
        ids: Vec<u32>,
        fresh: Vec<Fresh>,
    ) -> FrontendPlan {
        let key = encode::service_key(&fe.key);
        let ranges: BTreeSet<SourceRangeEntry> = fe
            .source_ranges
            .iter()
            .map(|r| encode::source_range(&key, r))
            .collect();
        let mut value = ServiceValue {
            service_id,
            slot_set: 0,
            count: ids.len() as u32,
            flags: service_flags_of(fe, !ranges.is_empty()),
            affinity_timeout_s: fe.affinity_timeout_s.unwrap_or(0),
            _pad: 0,
        };
        let no_ranges = BTreeSet::new();
        let prev_ranges = prev.map_or(&no_ranges, |p| &p.source_ranges);

        // New source ranges go in before the service entry that turns the
        // firewall on; ranges no longer wanted go after it.
        let mut writes: Vec<MapOp> = Vec::with_capacity(ranges.len() + fresh.len() + ids.len() + 1);
        writes.extend(
            ranges
                .difference(prev_ranges)
                .map(|entry| MapOp::PutSourceRange { entry: *entry }),
        );
        let mut cleanup: Vec<MapOp> = Vec::new();
        writes.extend(fresh.iter().map(|f| MapOp::PutBackend {
            id: f.id,
            backend: f.backend,
        }));
        let mut new_slot_set = None;
        match prev {
            Some(p) if ids.starts_with(&p.backend_ids) => {
                // Same set, or grown at the end: new slots, then the count.
                value.slot_set = p.value.slot_set;
                for (slot, id) in ids.iter().enumerate().skip(p.backend_ids.len()) {
                    writes.push(put_slot(value.slot_set, slot, *id));
                }
            }
            _ => {
                let set = self.alloc_slot_set();
                new_slot_set = Some(set);
                value.slot_set = set;
                for (slot, id) in ids.iter().enumerate() {
                    writes.push(put_slot(set, slot, *id));
                }
                if let Some(p) = prev {
                    cleanup.extend((0..p.backend_ids.len()).map(|slot| MapOp::DeleteSlot {
                        key: BackendSlotKey {
                            slot_set: p.value.slot_set,
                            slot: slot as u32,
                        },
                    }));
                }
            }
        }
        cleanup.extend(
            prev_ranges
                .difference(&ranges)
                .map(|entry| MapOp::DeleteSourceRange { entry: *entry }),
        );
        if prev.map(|p| p.value) != Some(value) {
            writes.push(MapOp::PutService { key, value });
        }
        FrontendPlan {
            key,
            value,
            ids,
            fresh,
            ranges,
            writes,
            cleanup,
            new_slot_set,
        }
    }

    /// Applies a plan's writes in order; on a failure undoes those already
    /// made and gives back the slot set it took, so the frontend stays as it
    /// was.
    fn write<S: MapStore>(&mut self, plan: &FrontendPlan, store: &mut S) -> Result<(), S::Error> {
        let Err((landed, source)) = store.apply_all(&plan.writes) else {
            return Ok(());
        };
        self.roll_back(&plan.writes[..landed], store);
        if let Some(set) = plan.new_slot_set {
            self.slot_sets_in_use.remove(&set);
        }
        Err(source)
    }

    /// The maps now serve the new set: takes the references it holds, lets go
    /// of those `prev` held (departed backends noted for conntrack cleanup)
    /// and deletes what nothing references any more. Returns the operations
    /// done.
    fn commit<S: MapStore>(
        &mut self,
        owner: &Arc<ObjectKey>,
        fe: &Frontend,
        prev: Option<Applied>,
        plan: FrontendPlan,
        store: &mut S,
    ) -> usize {
        let FrontendPlan {
            key,
            value,
            ids,
            fresh,
            ranges,
            writes,
            mut cleanup,
            new_slot_set,
        } = plan;
        for f in &fresh {
            self.backends.insert_new(f.id, f.backend, f.hash);
        }
        for id in &ids {
            self.backends.acquire(*id);
        }
        let service = self.acquire_service_id(&fe.service, value.service_id);
        if let Some(p) = prev {
            if new_slot_set.is_some() {
                self.slot_sets_in_use.remove(&p.value.slot_set);
            }
            for id in p.backend_ids.iter().filter(|id| !ids.contains(id)) {
                self.departed.push(self.departure(p.value.service_id, *id));
            }
            cleanup.extend(self.release_backends(&p.backend_ids));
            if let Some(name) = p.service.as_ref() {
                self.release_service_id(name);
            } else {
                self.release_adopted_service_id(p.value.service_id);
            }
        }
        let cleaned = self.apply_cleanup(cleanup, store);
        self.frontends.insert(
            fe.key,
            Applied {
                key,
                value,
                backend_ids: ids,
                owner: Some(Arc::clone(owner)),
                service: Some(service),
                source_ranges: ranges,
            },
        );
        writes.len() + cleaned
    }

    fn remove_frontend<S: MapStore>(
        &mut self,
        owner: &Arc<ObjectKey>,
        key: &FrontendKey,
        store: &mut S,
    ) -> Result<usize, PlanError<S::Error>> {
        let Some(prev) = self.frontends.get(key).cloned() else {
            return Ok(0);
        };
        store
            .apply(&MapOp::DeleteService { key: prev.key })
            .map_err(|source| PlanError::Write {
                frontend: *key,
                owner: (**owner).clone(),
                source,
            })?;
        self.frontends.remove(key);
        self.slot_sets_in_use.remove(&prev.value.slot_set);
        for id in &prev.backend_ids {
            self.departed
                .push(self.departure(prev.value.service_id, *id));
        }
        let mut cleanup: Vec<MapOp> = (0..prev.backend_ids.len())
            .map(|slot| MapOp::DeleteSlot {
                key: BackendSlotKey {
                    slot_set: prev.value.slot_set,
                    slot: slot as u32,
                },
            })
            .collect();
        cleanup.extend(
            prev.source_ranges
                .iter()
                .map(|entry| MapOp::DeleteSourceRange { entry: *entry }),
        );
        cleanup.extend(self.release_backends(&prev.backend_ids));
        match prev.service.as_ref() {
            Some(name) => self.release_service_id(name),
            None => self.release_adopted_service_id(prev.value.service_id),
        }
        Ok(1 + self.apply_cleanup(cleanup, store))
    }

    fn apply_cleanup<S: MapStore>(&mut self, cleanup: Vec<MapOp>, store: &mut S) -> usize {
        let mut done = 0;
        for op in cleanup {
            match store.apply(&op) {
                Ok(()) => done += 1,
                Err(e) => {
                    tracing::warn!(error = %e, "{op} failed; retrying on the next sync");
                    self.pending.push(op);
                }
            }
        }
        done
    }

    /// Best effort: whatever fails stays as unreferenced garbage for later.
    fn roll_back<S: MapStore>(&mut self, done: &[MapOp], store: &mut S) {
        let undo: Vec<MapOp> = done
            .iter()
            .rev()
            .filter_map(|op| match op {
                MapOp::PutBackend { id, .. } => Some(MapOp::DeleteBackend { id: *id }),
                MapOp::PutSlot { key, .. } => Some(MapOp::DeleteSlot { key: *key }),
                MapOp::PutSourceRange { entry } => Some(MapOp::DeleteSourceRange { entry: *entry }),
                _ => None,
            })
            .collect();
        self.apply_cleanup(undo, store);
    }

    /// Drops one reference to each id; deletes for those left unreferenced.
    fn release_backends(&mut self, ids: &[u32]) -> Vec<MapOp> {
        ids.iter()
            .filter(|id| self.backends.release(**id))
            .map(|id| MapOp::DeleteBackend { id: *id })
            .collect()
    }

    /// Takes a reference to `name`'s service id (`id` if it has none yet);
    /// returns the name as the planner holds it, shared.
    fn acquire_service_id(&mut self, name: &ServicePortName, id: u32) -> Arc<ServicePortName> {
        *self.service_ids_in_use.entry(id).or_default() += 1;
        if let Some((shared, r)) = self.service_ids.get_key_value_mut(name) {
            r.refs += 1;
            return Arc::clone(shared);
        }
        let shared = Arc::new(name.clone());
        self.service_ids
            .insert(Arc::clone(&shared), Refcounted { id, refs: 1 });
        shared
    }

    fn release_service_id(&mut self, name: &ServicePortName) {
        if let Some(r) = self.service_ids.get_mut(name) {
            r.refs = r.refs.saturating_sub(1);
            let id = r.id;
            if r.refs == 0 {
                self.service_ids.remove(name);
            }
            self.release_adopted_service_id(id);
        }
    }

    fn release_adopted_service_id(&mut self, id: u32) {
        if let Some(n) = self.service_ids_in_use.get_mut(&id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.service_ids_in_use.remove(&id);
            }
        }
    }

    fn alloc_backend_id(&mut self, fresh: &[Fresh]) -> u32 {
        loop {
            let id = self.next_backend_id;
            self.next_backend_id = self.next_backend_id.checked_add(1).unwrap_or(1);
            if id != 0 && !self.backends.has_id(id) && !fresh.iter().any(|f| f.id == id) {
                return id;
            }
        }
    }

    fn alloc_service_id(&mut self) -> u32 {
        loop {
            let id = self.next_service_id;
            self.next_service_id = self.next_service_id.checked_add(1).unwrap_or(1);
            if id != 0 && !self.service_ids_in_use.contains_key(&id) {
                return id;
            }
        }
    }

    fn alloc_slot_set(&mut self) -> u32 {
        loop {
            let set = self.next_slot_set;
            self.next_slot_set = self.next_slot_set.checked_add(1).unwrap_or(1);
            if set != 0 && self.slot_sets_in_use.insert(set) {
                return set;
            }
        }
    }
}

/// One frontend's change, planned before anything is written.
struct FrontendPlan {
    key: ServiceKey,
    value: ServiceValue,
    /// Backend id of each slot.
    ids: Vec<u32>,
    /// Backends that get a new id (and a `BACKENDS` entry) with this plan.
    fresh: Vec<Fresh>,
    ranges: BTreeSet<SourceRangeEntry>,
    /// Up to and including the flip of the service entry.
    writes: Vec<MapOp>,
    /// Old slots and stale source ranges, deleted once the flip is in.
    cleanup: Vec<MapOp>,
    /// A slot set taken for this plan, given back if the writes fail.
    new_slot_set: Option<u32>,
}

/// A backend no id is held for: the id it gets with the plan.
struct Fresh {
    id: u32,
    backend: Backend,
    hash: BackendHash,
}

fn service_flags_of(fe: &Frontend, has_source_ranges: bool) -> u32 {
    let mut flags = 0;
    if fe.affinity_timeout_s.is_some() {
        flags |= service_flags::AFFINITY;
    }
    if fe.no_endpoints == NoEndpointAction::Drop {
        flags |= service_flags::NO_EP_DROP;
    }
    // In-cluster clients of an external address are not masqueraded
    // (kube-proxy's EXT chain sends them to the service chain before its
    // masquerade mark), so the in-cluster entry is not external.
    if fe.kind != FrontendKind::ClusterIp && fe.key.scope == Scope::Any {
        flags |= service_flags::EXTERNAL;
    }
    if has_source_ranges {
        flags |= service_flags::SOURCE_RANGES;
    }
    flags
}

fn put_slot(slot_set: u32, slot: usize, backend_id: u32) -> MapOp {
    MapOp::PutSlot {
        key: BackendSlotKey {
            slot_set,
            slot: slot as u32,
        },
        backend_id,
    }
}

#[cfg(test)]
mod tests;
