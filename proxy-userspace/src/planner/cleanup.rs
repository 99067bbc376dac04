//! Deletes of what nothing references any more. A delete that fails leaves
//! only unreferenced garbage, which no packet can reach, so it waits for
//! the next sync instead of failing this one.

use super::{
    ledger::Planner,
    ops::{MapOp, MapStore},
    outcome::SyncOutcome,
};

impl Planner {
    pub(super) fn apply_cleanup<S: MapStore>(
        &mut self,
        cleanup: Vec<MapOp>,
        store: &mut S,
    ) -> usize {
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
    pub(super) fn roll_back<S: MapStore>(&mut self, done: &[MapOp], store: &mut S) {
        let undo: Vec<MapOp> = done
            .iter()
            .rev()
            .filter_map(|op| match op {
                MapOp::PutBackend { id, .. } => Some(MapOp::DeleteBackend { id: *id }),
                MapOp::PutSlot { key, .. } => Some(MapOp::DeleteSlot { key: *key }),
                MapOp::PutSourceRange { entry } => Some(MapOp::DeleteSourceRange { entry: *entry }),
                // An adopted id keeps the name it had for the frontends
                // that still hold it.
                MapOp::PutServiceName { id, .. } if !self.service_ids_in_use.contains_key(id) => {
                    Some(MapOp::DeleteServiceName { id: *id })
                }
                _ => None,
            })
            .collect();
        self.apply_cleanup(undo, store);
    }

    pub(super) fn retry_pending<S: MapStore>(
        &mut self,
        store: &mut S,
        outcome: &mut SyncOutcome<S::Error>,
    ) {
        let pending = std::mem::take(&mut self.pending);
        for op in pending {
            if store.apply(&op).is_ok() {
                outcome.ops += 1;
            } else {
                self.pending.push(op);
            }
        }
    }
}
