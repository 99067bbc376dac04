//! The sync loop: source events become dirty Services, coalesced for
//! `--min-sync-period` and programmed through the planner. The first sync
//! waits until every initial listing is in, so that an agent restarted on
//! maps programmed before diffs against the whole cluster and never against
//! half of it (Services without their EndpointSlices would read as Services
//! without endpoints). A Service whose map write fails stays pending and is
//! retried by the loop's own timer with backoff until it lands; /healthz
//! turns unhealthy while it waits longer than the health timeout.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use tracing::{error, info, info_span, warn};

use crate::{
    http::Health,
    metrics::{ProxyMetrics, kube_proxy::Trigger},
    model::{self, FrontendKey, HealthCheck, ModelConfig, Protocol},
    planner::{Departed, MapStore, PlanError, Planner},
    source::{Kind, ObjectKey, SourceEvent},
    state::ClusterState,
};

/// The wait before the first retry of a failed write; it doubles with each
/// failure up to [`RETRY_MAX`].
pub const RETRY_INITIAL: Duration = Duration::from_millis(100);
pub const RETRY_MAX: Duration = Duration::from_secs(5);
/// How long the first sync waits for the Node listing once Services and
/// EndpointSlices are listed. The Node only brings the zone topology hints
/// are read against, so an API server that never lists it (a missing RBAC
/// rule) delays the datapath by this much instead of forever.
pub const NODE_LISTING_WAIT: Duration = Duration::from_secs(10);

/// The wait before retry number `failures` (1 for the first).
pub fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    RETRY_INITIAL.saturating_mul(1 << doublings).min(RETRY_MAX)
}

/// Where the loop's writes go: the pinned maps, or a double in tests.
pub trait SyncTarget {
    type Store: MapStore;
    fn store(&mut self) -> &mut Self::Store;
    /// Backends left their Services: their flows, affinity entries and the
    /// node's sockets connected to them go.
    fn clean_departed(&mut self, departed: &[Departed]);
}

/// What the loop has done, for a metrics endpoint to read.
#[derive(Debug, Default)]
pub struct SyncStats {
    /// Syncs run.
    pub syncs: AtomicU64,
    /// Map operations applied by all syncs.
    pub map_ops: AtomicU64,
    /// Frontend writes that failed, each attempt counted.
    pub failed_writes: AtomicU64,
    /// Frontends whose last write failed, waiting for their retry (and
    /// stale frontends whose removal failed).
    pub pending: AtomicU64,
}

/// Something to try again: a Service, or the removal of frontends no
/// Service claimed.
#[derive(Clone, Copy, Debug)]
struct Retry {
    failures: u32,
    due: Instant,
    /// Frontends that failed on the last attempt.
    frontends: usize,
}

impl Retry {
    fn after(previous: Option<&Retry>, now: Instant, frontends: usize) -> Retry {
        let failures = previous.map_or(0, |r| r.failures) + 1;
        Retry {
            failures,
            due: now + backoff(failures),
            frontends,
        }
    }
}

/// Whether the first sync may run.
enum Gate {
    Open,
    /// Services and EndpointSlices are listed, the Node not yet.
    At(Instant),
    Closed,
}

pub struct SyncLoop {
    dirty: BTreeSet<ObjectKey>,
    /// Kinds a complete listing has been received for.
    listed: BTreeSet<Kind>,
    initial_done: bool,
    /// The datapath has been attached to the interfaces there were at least
    /// once: until then it serves nothing, so the agent is not ready.
    interfaces_applied: bool,
    sequence: u64,
    /// SCTP frontends already reported as not translated by the datapath.
    sctp_reported: BTreeSet<FrontendKey>,
    /// healthCheckNodePort of each Service that has one.
    health_checks: BTreeMap<ObjectKey, HealthCheck>,
    health_checks_changed: bool,
    min_sync_period: Duration,
    /// When the coalesced changes are due.
    deadline: Option<Instant>,
    node_listing_deadline: Instant,
    /// Services with a write that failed.
    retries: BTreeMap<ObjectKey, Retry>,
    /// Frontends adopted from the maps that no Service claimed and whose
    /// removal failed; and the planner's failed deletes of garbage.
    housekeeping: Option<Retry>,
    unclaimed_left: bool,
    health: Health,
    stats: Arc<SyncStats>,
    metrics: ProxyMetrics,
}

impl SyncLoop {
    pub fn new(min_sync_period: Duration, health: Health, now: Instant) -> Self {
        SyncLoop {
            dirty: BTreeSet::new(),
            listed: BTreeSet::new(),
            initial_done: false,
            interfaces_applied: false,
            sequence: 0,
            sctp_reported: BTreeSet::new(),
            health_checks: BTreeMap::new(),
            health_checks_changed: false,
            min_sync_period,
            deadline: None,
            node_listing_deadline: now + NODE_LISTING_WAIT,
            retries: BTreeMap::new(),
            housekeeping: None,
            unclaimed_left: false,
            health,
            stats: Arc::default(),
            metrics: ProxyMetrics::default(),
        }
    }

    /// Reports to these metrics (kube-proxy's) from now on.
    pub fn set_metrics(&mut self, metrics: ProxyMetrics) {
        self.metrics = metrics;
    }

    pub fn stats(&self) -> Arc<SyncStats> {
        Arc::clone(&self.stats)
    }

    /// Synced and attached: what readiness means.
    pub fn serving(&self) -> bool {
        self.initial_done && self.interfaces_applied
    }

    /// Nothing queued or failed is left out of the maps.
    fn programmed(&self) -> bool {
        self.serving() && self.dirty.is_empty() && self.retries.is_empty() && !self.unclaimed_left
    }

    /// The datapath is attached to the node's interfaces.
    pub fn interfaces_applied(&mut self, now: Instant) {
        self.interfaces_applied = true;
        if self.programmed() {
            self.health.mark_synced_at(now);
        }
    }

    /// The health check node ports, when they changed since the last call.
    pub fn take_health_checks(&mut self) -> Option<Vec<HealthCheck>> {
        std::mem::take(&mut self.health_checks_changed)
            .then(|| self.health_checks.values().cloned().collect())
    }

    /// Records an event in `state`; the Services it changed are synced at
    /// the end of the coalescing window.
    pub fn on_event(&mut self, state: &mut ClusterState, event: SourceEvent, now: Instant) {
        let listing = match &event {
            SourceEvent::Replace { kind, .. } => self.listed.insert(*kind),
            _ => false,
        };
        let (kind, triggers) = Trigger::of(&event);
        let changes = state.apply(event);
        if self.health.set_node_eligible(state.node_eligible()) {
            info!(
                node_eligible = state.node_eligible(),
                "this node's eligibility for traffic changed (/healthz)"
            );
        }
        self.metrics.queued(kind, &changes.services);
        self.metrics.triggered(triggers, &changes.services);
        // The first sync also removes what no Service claims, so the last
        // listing to arrive starts it even when it changed nothing.
        let first = listing && !self.initial_done;
        if changes.is_empty() && !first {
            return;
        }
        if !changes.is_empty() {
            self.health.queued_at(now);
        }
        self.dirty.extend(changes);
        self.deadline.get_or_insert(now + self.min_sync_period);
    }

    fn gate(&self) -> Gate {
        if self.initial_done || self.listed.len() == 3 {
            Gate::Open
        } else if self.listed.contains(&Kind::Service) && self.listed.contains(&Kind::EndpointSlice)
        {
            Gate::At(self.node_listing_deadline)
        } else {
            Gate::Closed
        }
    }

    /// When [`run`](Self::run) is next due, if anything is to be done.
    pub fn wakeup(&self) -> Option<Instant> {
        let changes = match (self.gate(), self.deadline) {
            (_, None) | (Gate::Closed, _) => None,
            (Gate::Open, Some(deadline)) => Some(deadline),
            (Gate::At(gate), Some(deadline)) => Some(deadline.max(gate)),
        };
        changes
            .into_iter()
            .chain(self.retries.values().map(|r| r.due))
            .chain(self.housekeeping.map(|r| r.due))
            .min()
    }

    /// Programs the dirty Services and the retries that are due.
    pub fn run<T: SyncTarget>(
        &mut self,
        now: Instant,
        state: &ClusterState,
        model: &ModelConfig,
        planner: &mut Planner,
        target: &mut T,
    ) {
        if let Gate::Closed = self.gate() {
            return;
        }
        if let Gate::At(gate) = self.gate()
            && now < gate
        {
            return;
        }
        let due: Vec<ObjectKey> = self
            .retries
            .iter()
            .filter(|(_, r)| r.due <= now)
            .map(|(key, _)| key.clone())
            .collect();
        self.dirty.extend(due);
        self.deadline = None;
        self.sequence += 1;
        let span = info_span!("sync", seq = self.sequence, services = self.dirty.len());
        let _enter = span.enter();
        let started = Instant::now();
        let (mut ops, mut changed, mut failed, mut write_failures) = (0, 0, 0, 0);
        for key in std::mem::take(&mut self.dirty) {
            self.refresh_health_check(state, &key, model);
            let desired = match state.frontends_for(&key, model) {
                Ok(desired) => desired,
                Err(e) => {
                    // Whatever was programmed for it stays: an invalid
                    // update never takes a working service down.
                    error!(service = %key, error = %e, "service skipped");
                    self.retries.remove(&key);
                    failed += 1;
                    continue;
                }
            };
            for fe in desired
                .iter()
                .filter(|fe| fe.key.protocol == Protocol::Sctp)
            {
                if self.sctp_reported.insert(fe.key) {
                    warn!(
                        service = %key,
                        frontend = %fe.key,
                        "SCTP frontend programmed, but the datapath does not translate SCTP yet: \
                         its packets pass untranslated (counter unsupported_proto)"
                    );
                }
            }
            let outcome = planner.sync_service(&key, &desired, target.store());
            ops += outcome.ops;
            changed += outcome.frontends_changed;
            failed += outcome.errors.len();
            let mut writes_failed = 0;
            for e in &outcome.errors {
                error!(service = %key, error = %e, "frontend not programmed");
                // A conflict or an oversized set is the objects' doing and
                // stays until they change; a write can succeed later.
                if matches!(e, PlanError::Write { .. }) {
                    writes_failed += 1;
                }
            }
            write_failures += writes_failed;
            if outcome.errors.is_empty() {
                self.metrics.programmed(&key);
            }
            self.metrics
                .local_endpoints(&key, state.service(&key), &desired);
            if writes_failed > 0 {
                let retry = Retry::after(self.retries.get(&key), now, writes_failed);
                warn!(
                    service = %key,
                    failures = retry.failures,
                    retry_in_ms = backoff(retry.failures).as_millis() as u64,
                    "write failed; retrying"
                );
                self.retries.insert(key, retry);
            } else if let Some(retry) = self.retries.remove(&key) {
                info!(service = %key, failures = retry.failures, "programmed after retrying");
            }
        }
        let housekeeping_due = self.housekeeping.is_some_and(|r| r.due <= now);
        let first = !self.initial_done;
        if first || (housekeeping_due && self.unclaimed_left) {
            let outcome = planner.remove_unclaimed(target.store());
            ops += outcome.ops;
            changed += outcome.frontends_changed;
            for e in &outcome.errors {
                error!(error = %e, "stale frontend not removed");
            }
            write_failures += outcome.errors.len();
            self.unclaimed_left = !outcome.errors.is_empty();
        }
        if housekeeping_due {
            ops += planner.collect_garbage(Vec::new(), target.store()).ops;
        }
        if first || housekeeping_due || self.housekeeping.is_none() {
            let left = self.unclaimed_left || planner.has_garbage();
            self.housekeeping = left.then(|| Retry::after(self.housekeeping.as_ref(), now, 0));
        }
        if first {
            if !self.listed.contains(&Kind::Node) {
                warn!(
                    waited_s = NODE_LISTING_WAIT.as_secs(),
                    "no listing of this node's Node yet: synced without its zone (topology hints) for now"
                );
            }
            self.initial_done = true;
            // The initial listing peaks memory (documents, parsed objects,
            // event copies) and is then freed; hand it back to the system
            // rather than keep it as resident heap.
            // SAFETY: malloc_trim only releases free heap pages.
            unsafe { libc::malloc_trim(0) };
        }
        target.clean_departed(&planner.take_departed());
        let pending = self.retries.values().map(|r| r.frontends).sum::<usize>()
            + usize::from(self.unclaimed_left);
        self.stats.syncs.fetch_add(1, Ordering::Relaxed);
        self.stats.map_ops.fetch_add(ops as u64, Ordering::Relaxed);
        self.stats
            .failed_writes
            .fetch_add(write_failures as u64, Ordering::Relaxed);
        self.stats.pending.store(pending as u64, Ordering::Relaxed);
        if self.programmed() {
            self.health.mark_synced_at(now);
        }
        self.metrics
            .synced(first, started.elapsed(), write_failures == 0);
        info!(
            ops,
            frontends_changed = changed,
            failed,
            pending,
            frontends = planner.frontend_count(),
            elapsed_us = started.elapsed().as_micros() as u64,
            "synced"
        );
    }

    fn refresh_health_check(
        &mut self,
        state: &ClusterState,
        key: &ObjectKey,
        config: &ModelConfig,
    ) {
        let check = match state.service(key) {
            None => None,
            Some(service) => {
                match model::service_health_check(
                    service,
                    &state.slices_for(key),
                    state.node(),
                    config,
                ) {
                    Ok(check) => check,
                    Err(e) => {
                        warn!(service = %key, error = %e, "health check node port left as it was");
                        return;
                    }
                }
            }
        };
        let changed = match check {
            Some(check) => self.health_checks.insert(key.clone(), check.clone()) != Some(check),
            None => self.health_checks.remove(key).is_some(),
        };
        self.health_checks_changed |= changed;
    }
}

#[cfg(test)]
mod tests;
