//! One Service's frontends against those it owned: new and changed ones
//! are programmed, those it no longer has removed. A frontend that fails
//! stays as it was and still owned, so the next sync retries it.

use std::{collections::BTreeSet, sync::Arc};

use super::{
    batch::Batch,
    ledger::Planner,
    ops::MapStore,
    outcome::{PlanError, SyncOutcome},
};
use crate::{
    model::{Frontend, FrontendKey},
    source::ObjectKey,
};

impl Planner {
    pub(super) fn sync_service_in<S: MapStore>(
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
}
