//! The planner's side of a [`Batch`]: handing it to the store, waiting for
//! it to land, and forgetting the frontends of one that failed, so that
//! the ids and slot sets they took are free again and a later sync
//! programs them anew.

use std::sync::Arc;

use proxy_common::BackendSlotKey;

use super::{
    batch::{Batch, Gathered, InFlight, Unlanded, Unwritten},
    ledger::Planner,
    ops::{MapOp, MapStore, PhaseFailure},
    outcome::PlanError,
};
use crate::{model::FrontendKey, source::ObjectKey};

impl Planner {
    /// Writes `batch` before a write that is not gathered: such a write may
    /// point at what the batch holds, or free an id it took.
    pub(super) fn flush_first<S: MapStore>(
        &mut self,
        batch: Option<&mut Batch<S::Error>>,
        store: &mut S,
    ) {
        if let Some(batch) = batch
            && !batch.is_settled()
        {
            self.flush(batch, store);
        }
    }

    pub(super) fn hand_to_store<S: MapStore>(
        &mut self,
        batch: &mut Batch<S::Error>,
        store: &mut S,
    ) {
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
    pub(super) fn land_in_flight<S: MapStore>(
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
        let Some(applied) = self.remove_applied(key) else {
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
        deletes.extend(match applied.service.as_ref() {
            Some(name) => self.release_service_id(name),
            None => self.release_adopted_service_id(applied.value.service_id),
        });
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
}
