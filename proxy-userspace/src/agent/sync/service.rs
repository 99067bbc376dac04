//! Programming one dirty Service: its frontends from the model, written
//! through the planner, and what the sync learns from it along the way (its
//! health check node port).

use std::collections::BTreeMap;

use tracing::{error, warn};

use crate::{
    model::{CompactService, Frontend, HealthCheck, ModelConfig, ModelError, Modelled},
    planner::{Batch, PlanError, Planner, SyncOutcome, Unwritten},
    source::ObjectKey,
    state::ClusterState,
};

/// What programming one Service came to.
#[derive(Debug)]
pub(super) enum ServiceOutcome<E: std::error::Error + 'static> {
    /// Its objects make no valid frontends: whatever was programmed for it
    /// stays, as an invalid update never takes a working Service down.
    Invalid,
    /// Planned and written: `planned` says what landed and what failed.
    Planned {
        desired: Vec<Frontend>,
        planned: SyncOutcome<E>,
    },
}

impl<E: std::error::Error + 'static> ServiceOutcome<E> {
    /// Frontends whose write failed: a write can succeed later, so these are
    /// retried. A conflict or an oversized set is the objects' doing and
    /// stays until they change.
    pub fn write_failures(&self) -> usize {
        match self {
            ServiceOutcome::Invalid => 0,
            ServiceOutcome::Planned { planned, .. } => planned
                .errors
                .iter()
                .filter(|e| matches!(e, PlanError::Write { .. } | PlanError::Unwritten { .. }))
                .count(),
        }
    }

    /// A frontend of this Service gathered into a batch that failed: it is
    /// not programmed after all.
    pub fn unwritten(&mut self, failure: Unwritten<E>) {
        if let ServiceOutcome::Planned { planned, .. } = self {
            planned.frontends_changed = planned.frontends_changed.saturating_sub(1);
            planned.ops = planned.ops.saturating_sub(failure.writes);
            planned.errors.push(failure.error);
        }
    }

    /// Frontends not programmed (the whole Service, when invalid).
    pub fn failed(&self) -> usize {
        match self {
            ServiceOutcome::Invalid => 1,
            ServiceOutcome::Planned { planned, .. } => planned.errors.len(),
        }
    }
}

/// Makes the maps hold what the model says `key` should have; with a
/// `batch`, its new frontends are there once the batch is flushed
/// (`Planner::sync_service_batched`). The loop takes the two steps apart,
/// to time each.
#[cfg(test)]
pub(super) fn program_service<S: crate::planner::MapStore>(
    key: &ObjectKey,
    state: &ClusterState,
    model: &ModelConfig,
    planner: &mut Planner,
    store: &mut S,
    batch: Option<&mut Batch<S::Error>>,
) -> ServiceOutcome<S::Error> {
    match desired_frontends(key, state.service(key), state, model) {
        Ok(modelled) => plan_service(key, modelled.frontends, planner, store, batch),
        Err(_) => ServiceOutcome::Invalid,
    }
}

/// The model's frontends of `key`, whose Service in `state` is `service`,
/// and what the address policy refused of it; the error (logged) when its
/// objects make none.
pub(super) fn desired_frontends(
    key: &ObjectKey,
    service: Option<&CompactService>,
    state: &ClusterState,
    model: &ModelConfig,
) -> Result<Modelled, ModelError> {
    state
        .modelled_of(key, service, model)
        .inspect_err(|e| error!(service = %key, error = %e, "service skipped"))
}

/// [`program_service`] once the model has given `desired`.
pub(super) fn plan_service<S: crate::planner::MapStore>(
    key: &ObjectKey,
    desired: Vec<Frontend>,
    planner: &mut Planner,
    store: &mut S,
    batch: Option<&mut Batch<S::Error>>,
) -> ServiceOutcome<S::Error> {
    let planned = match batch {
        Some(batch) => planner.sync_service_batched(key, &desired, store, batch),
        None => planner.sync_service(key, &desired, store),
    };
    for e in &planned.errors {
        error!(service = %key, error = %e, "frontend not programmed");
    }
    ServiceOutcome::Planned { desired, planned }
}

/// The healthCheckNodePort of each Service that has one, for the health
/// check servers.
#[derive(Debug, Default)]
pub(super) struct HealthChecks {
    by_service: BTreeMap<ObjectKey, HealthCheck>,
    changed: bool,
}

impl HealthChecks {
    /// Reads `key`'s health check again. A Service whose objects make no
    /// valid health check keeps the one it had.
    #[cfg(test)]
    pub fn refresh(&mut self, state: &ClusterState, key: &ObjectKey, config: &ModelConfig) {
        self.refresh_service(state, key, state.service(key), config);
    }

    /// [`Self::refresh`] with `service`, the Service of `key` in `state`.
    pub fn refresh_service(
        &mut self,
        state: &ClusterState,
        key: &ObjectKey,
        service: Option<&CompactService>,
        config: &ModelConfig,
    ) {
        let check = match service {
            // Only a LoadBalancer has one: its slices need not be looked up.
            Some(service) if !service.is_load_balancer() => None,
            None => None,
            Some(service) => {
                match service.health_check(&state.slices_for(key), state.node(), config) {
                    Ok(check) => check,
                    Err(e) => {
                        warn!(service = %key, error = %e, "health check node port left as it was");
                        return;
                    }
                }
            }
        };
        let changed = match check {
            Some(check) => self.by_service.insert(key.clone(), check.clone()) != Some(check),
            None => self.by_service.remove(key).is_some(),
        };
        self.changed |= changed;
    }

    /// Every health check, when any changed since the last call.
    pub fn take_changed(&mut self) -> Option<Vec<HealthCheck>> {
        std::mem::take(&mut self.changed).then(|| self.by_service.values().cloned().collect())
    }
}

/// Services programmed in a sync whose new frontends wait in a [`Batch`]:
/// what they came to is known once it is written. One batch may be
/// written while the next is gathered (`Planner::start`).
#[derive(Debug)]
pub(super) struct Unsettled<E: std::error::Error + 'static> {
    pub batch: Batch<E>,
    /// Those of the batch being written.
    in_flight: Vec<(ObjectKey, ServiceOutcome<E>)>,
    /// Those of the batch being gathered.
    outcomes: Vec<(ObjectKey, ServiceOutcome<E>)>,
}

impl<E: std::error::Error + 'static> Default for Unsettled<E> {
    fn default() -> Self {
        Self {
            batch: Batch::default(),
            in_flight: Vec::new(),
            outcomes: Vec::new(),
        }
    }
}

/// Frontends (or Services) waiting before their batch is written: four
/// system calls for 10,000 entries, and about 2 MiB of writes and outcomes
/// held, twice while one batch is written and the next gathered (4,096
/// held 7 MiB more at the peak of a first sync of 10,000 Services).
pub(super) const BATCH_FRONTENDS: usize = 1024;

impl<E: std::error::Error + 'static> Unsettled<E> {
    pub fn push(&mut self, key: ObjectKey, outcome: ServiceOutcome<E>) {
        self.outcomes.push((key, outcome));
    }

    /// Enough is waiting to be written.
    pub fn full(&self) -> bool {
        self.batch.len() >= BATCH_FRONTENDS || self.outcomes.len() >= BATCH_FRONTENDS
    }

    /// Hands the batch to the store to be written while the next is
    /// gathered, once the one before has landed; hands back the outcomes of
    /// that one, which are known now.
    pub fn launch<S: crate::planner::MapStore<Error = E>>(
        &mut self,
        planner: &mut Planner,
        store: &mut S,
    ) -> Vec<(ObjectKey, ServiceOutcome<E>)> {
        planner.start(&mut self.batch, store);
        let mut landed = std::mem::take(&mut self.in_flight);
        let split = landed.len();
        landed.append(&mut self.outcomes);
        self.book_failures(&mut landed);
        self.in_flight = landed.split_off(split);
        landed
    }

    /// Writes the batch, waits until everything has landed, and hands back
    /// every outcome.
    pub fn settle<S: crate::planner::MapStore<Error = E>>(
        &mut self,
        planner: &mut Planner,
        store: &mut S,
    ) -> Vec<(ObjectKey, ServiceOutcome<E>)> {
        planner.flush(&mut self.batch, store);
        let mut outcomes = std::mem::take(&mut self.in_flight);
        outcomes.append(&mut self.outcomes);
        self.book_failures(&mut outcomes);
        outcomes
    }

    /// Counts the frontends of a batch that failed as failed writes of
    /// their Service, which is among `outcomes` (its batch has not been
    /// booked).
    fn book_failures(&mut self, outcomes: &mut [(ObjectKey, ServiceOutcome<E>)]) {
        let failures = self.batch.take_failures();
        if failures.is_empty() {
            return;
        }
        let index: std::collections::HashMap<ObjectKey, usize> = outcomes
            .iter()
            .enumerate()
            .map(|(i, (key, _))| (key.clone(), i))
            .collect();
        for failure in failures {
            let PlanError::Unwritten { owner, .. } = &failure.error else {
                continue;
            };
            error!(service = %owner, error = %failure.error, "frontend not programmed");
            if let Some(&i) = index.get(owner) {
                outcomes[i].1.unwritten(failure);
            }
        }
    }
}
