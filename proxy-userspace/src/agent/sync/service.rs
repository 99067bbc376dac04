//! Programming one dirty Service: its frontends from the model, written
//! through the planner, and what the sync learns from it along the way (its
//! health check node port, SCTP frontends the datapath passes untranslated).

use std::collections::{BTreeMap, BTreeSet};

use tracing::{error, warn};

use crate::{
    model::{Frontend, FrontendKey, HealthCheck, ModelConfig, Protocol},
    planner::{PlanError, Planner, SyncOutcome},
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
                .filter(|e| matches!(e, PlanError::Write { .. }))
                .count(),
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

/// Makes the maps hold what the model says `key` should have.
pub(super) fn program_service<S: crate::planner::MapStore>(
    key: &ObjectKey,
    state: &ClusterState,
    model: &ModelConfig,
    planner: &mut Planner,
    store: &mut S,
) -> ServiceOutcome<S::Error> {
    let desired = match state.frontends_for(key, model) {
        Ok(desired) => desired,
        Err(e) => {
            error!(service = %key, error = %e, "service skipped");
            return ServiceOutcome::Invalid;
        }
    };
    let planned = planner.sync_service(key, &desired, store);
    for e in &planned.errors {
        error!(service = %key, error = %e, "frontend not programmed");
    }
    ServiceOutcome::Planned { desired, planned }
}

/// SCTP frontends are programmed, but the datapath passes their packets
/// untranslated: each is reported once.
#[derive(Debug, Default)]
pub(super) struct SctpWarnings(BTreeSet<FrontendKey>);

impl SctpWarnings {
    /// Warns about the SCTP frontends of `desired` not reported before;
    /// returns how many that was.
    pub fn report(&mut self, key: &ObjectKey, desired: &[Frontend]) -> usize {
        let mut reported = 0;
        for fe in desired
            .iter()
            .filter(|fe| fe.key.protocol == Protocol::Sctp)
        {
            if self.0.insert(fe.key) {
                reported += 1;
                warn!(
                    service = %key,
                    frontend = %fe.key,
                    "SCTP frontend programmed, but the datapath does not translate SCTP yet: \
                     its packets pass untranslated (counter unsupported_proto)"
                );
            }
        }
        reported
    }
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
    pub fn refresh(&mut self, state: &ClusterState, key: &ObjectKey, config: &ModelConfig) {
        let check = match state.service(key) {
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
