//! Programming and removing one frontend in the update order
//! (docs/architecture.md, "Map update order"): what a failure before the
//! flip of its service entry leaves is undone, so the frontend stays as it
//! was; what the flip leaves unreferenced is deleted only after it.

use std::{collections::HashSet, sync::Arc};

use proxy_common::BackendSlotKey;

use super::{
    batch::Batch,
    ledger::{Applied, Planner},
    ops::{MapOp, MapStore},
    outcome::PlanError,
    plan::FrontendPlan,
};
use crate::{
    model::{Frontend, FrontendKey},
    source::ObjectKey,
};

impl Planner {
    /// Programs one frontend in the steps the update order needs: check it
    /// may be ours, resolve its backend ids and service id, plan the writes
    /// up to the flip of its service entry, write them (rolled back on
    /// failure), then commit the bookkeeping and clean up what the flip
    /// left unreferenced.
    pub(super) fn apply_frontend<S: MapStore>(
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
        let ids = self.slots(fe, ids);
        let (service_id, unnamed) = self.service_id(fe, prev.as_ref());
        let name = if unnamed {
            self.service_name_write(fe, service_id)
        } else {
            None
        };
        let mut plan = self.plan(fe, prev.as_ref(), service_id, name, ids, fresh);
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
            for id in departed_ids(&p.backend_ids, &ids) {
                self.departed.push(self.departure(p.value.service_id, id));
            }
            cleanup.extend(self.release_backends(&p.backend_ids));
            cleanup.extend(match p.service.as_ref() {
                Some(name) => self.release_service_id(name),
                None => self.release_adopted_service_id(p.value.service_id),
            });
        }
        let cleaned = self.apply_cleanup(cleanup, store);
        self.insert_applied(
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

    pub(super) fn remove_frontend<S: MapStore>(
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
        self.remove_applied(key);
        self.slot_sets_in_use.remove(&prev.value.slot_set);
        for id in departed_ids(&prev.backend_ids, &[]) {
            self.departed
                .push(self.departure(prev.value.service_id, id));
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
        cleanup.extend(match prev.service.as_ref() {
            Some(name) => self.release_service_id(name),
            None => self.release_adopted_service_id(prev.value.service_id),
        });
        Ok(1 + self.apply_cleanup(cleanup, store))
    }
}

/// The ids of `before`'s slots that none of `after`'s hold, each once: a
/// Maglev table holds each backend's id in thousands of slots.
fn departed_ids(before: &[u32], after: &[u32]) -> Vec<u32> {
    let mut seen: HashSet<u32> = after.iter().copied().collect();
    before
        .iter()
        .copied()
        .filter(|id| seen.insert(*id))
        .collect()
}
