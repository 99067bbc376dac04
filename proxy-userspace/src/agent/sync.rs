//! The sync loop: source events become dirty Services, programmed through
//! the planner at most once per `--min-sync-period`, as kube-proxy's
//! `BoundedFrequencyRunner` runs its syncs: a change that finds the last
//! sync at least that long ago is synced at once; one that comes sooner
//! waits until that long after the last sync, together with whatever else
//! comes meanwhile. A sync is a pipeline of steps, each its own function or
//! type:
//!
//! 1. the gate ([`first_sync`]): the first sync waits for the initial
//!    listings;
//! 2. `due_services`: the dirty Services and the retries that are due;
//! 3. per Service, `desired_frontends` and `plan_service` ([`service`])
//!    plan and write it and return its outcome, which `settle_service`
//!    books (retry, metrics); what the address policy refused of it is
//!    reported as it changes ([`refusals`]). Frontends the maps do not have yet are gathered into a
//!    `planner::Batch` of up to `BATCH_FRONTENDS` and written a map at a
//!    time; their Services are booked once it has landed. A Service
//!    waiting for a retry is written on its own;
//!    A Service that found a frontend still another's is tried again once
//!    the others are written, in the same sync: the other may have let
//!    go of it meanwhile (the older Service, or a ClusterIP, won it);
//! 4. the [`sweep`] of what no Service claims;
//! 5. `follow_ups`: departed backends' flows and sockets, health checks;
//!    a purge that failed is owed, and tried again on the loop's timer
//!    ([`purge`]);
//! 6. `mark_readiness`: /healthz learns the maps hold everything.
//!
//! A Service whose map write fails stays pending and is retried by the
//! loop's own timer with backoff ([`retry`]) until it lands; /healthz turns
//! unhealthy while it waits longer than the health timeout.

use std::{
    collections::BTreeSet,
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use tracing::{info, info_span, warn};

mod first_sync;
mod purge;
mod refusals;
mod retry;
mod service;
mod sweep;

pub use first_sync::NODE_LISTING_WAIT;
pub use refusals::{EVENT_QUEUE, ServiceEvent};

use self::{
    first_sync::FirstSync,
    purge::Purges,
    refusals::Refusals,
    retry::Retries,
    service::{HealthChecks, ServiceOutcome, Unsettled, desired_frontends, plan_service},
    sweep::{Sweeper, Swept},
};
use crate::{
    datapath::refusal_records::RefusalRecords,
    healthz::Health,
    metrics::{PolicyMetrics, ProxyMetrics, SyncStats, kube_proxy::Trigger},
    model::{HealthCheck, ModelConfig},
    planner::{AffinityPurge, Departed, MapStore, PlanError, Planner},
    retry::backoff,
    source::{ObjectKey, SourceEvent},
    state::ClusterState,
};

/// Where the loop's writes go: the pinned maps, or a double in tests.
pub trait SyncTarget {
    type Store: MapStore;
    fn store(&mut self) -> &mut Self::Store;
    /// Backends left their Services: their flows, affinity entries (where
    /// their Service has affinity) and the node's sockets connected to
    /// them go; and the affinity entries of the service ids in
    /// `affinity.dropped`. False when any of it failed: all of it is
    /// tried again (`purge`), which removes nothing twice.
    fn clean_departed(&mut self, departed: &[Departed], affinity: &AffinityPurge) -> bool;
}

/// What a sync leaves to the agent, outside the maps: the health check
/// servers await their listeners, which the loop does not.
#[derive(Debug, Default, PartialEq)]
pub struct FollowUps {
    /// Backends handed to [`SyncTarget::clean_departed`].
    pub departed: usize,
    /// Every health check node port, when any changed.
    pub health_checks: Option<Vec<HealthCheck>>,
}

/// One sync's counts.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    ops: usize,
    frontends_changed: usize,
    /// Frontends not programmed, for whatever reason.
    failed: usize,
    /// Writes that failed (the kernel's doing, retried).
    write_failures: usize,
    phases: Phases,
}

/// Where a sync's time went, for its log line. In a first sync at
/// 100,000 Services the kernel's inserts of 2.1 million entries are more
/// than half of the CPU; written on a thread of their own while the next
/// batch is planned, `write` counts only the time the sync waited for them
/// (docs/architecture.md, "The first sync's time").
#[derive(Clone, Copy, Debug, Default)]
struct Phases {
    /// The model: each Service's frontends from its objects.
    model: Duration,
    /// The planner: backend ids, slot sets, writes, its bookkeeping (and the
    /// writes to frontends the maps have already, which are not gathered).
    plan: Duration,
    /// Writing the batches of new frontends to the maps: the time the sync
    /// waited for them, when they are written on a thread of their own.
    write: Duration,
    /// Booking each Service's outcome: retries, metrics.
    book: Duration,
}

/// Adds the time `f` takes to `phase`.
fn timed<T>(phase: &mut Duration, f: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let out = f();
    *phase += started.elapsed();
    out
}

impl Tally {
    fn add_service<E: std::error::Error>(&mut self, outcome: &ServiceOutcome<E>) {
        if let ServiceOutcome::Planned { planned, .. } = outcome {
            self.ops += planned.ops;
            self.frontends_changed += planned.frontends_changed;
        }
        self.failed += outcome.failed();
        self.write_failures += outcome.write_failures();
    }

    fn add_sweep(&mut self, swept: Swept) {
        self.ops += swept.ops;
        self.frontends_changed += swept.frontends_changed;
        self.write_failures += swept.failures;
    }
}

pub struct SyncLoop {
    dirty: BTreeSet<ObjectKey>,
    first_sync: FirstSync,
    /// The datapath has been attached to the interfaces there were at least
    /// once: until then it serves nothing, so the agent is not ready.
    interfaces_applied: bool,
    sequence: u64,
    health_checks: HealthChecks,
    min_sync_period: Duration,
    /// When the queued changes are due.
    deadline: Option<Instant>,
    /// When the last sync ran: the next is due `min_sync_period` after it.
    last_run: Option<Instant>,
    /// When the oldest change still queued reached the loop: what the
    /// `synced` line's `event_to_write_us` counts from.
    first_queued: Option<Instant>,
    retries: Retries,
    sweeper: Sweeper,
    /// Departed backends whose purge failed, tried again on a timer.
    purges: Purges,
    health: Health,
    stats: Arc<SyncStats>,
    metrics: ProxyMetrics,
    refusals: Refusals,
    /// Services of this sync that found a frontend another's: tried once
    /// more at its end.
    contested: BTreeSet<ObjectKey>,
}

impl SyncLoop {
    pub fn new(min_sync_period: Duration, health: Health, now: Instant) -> Self {
        SyncLoop {
            dirty: BTreeSet::new(),
            first_sync: FirstSync::new(now),
            interfaces_applied: false,
            sequence: 0,
            health_checks: HealthChecks::default(),
            min_sync_period,
            deadline: None,
            last_run: None,
            first_queued: None,
            retries: Retries::default(),
            sweeper: Sweeper::default(),
            purges: Purges::default(),
            health,
            stats: Arc::default(),
            metrics: ProxyMetrics::default(),
            refusals: Refusals::default(),
            contested: BTreeSet::new(),
        }
    }

    /// Reports what the address policy refused to these metrics.
    pub fn set_policy_metrics(&mut self, metrics: PolicyMetrics) {
        self.refusals.set_metrics(metrics);
    }

    /// Records what is refused of each Service in `records`, for
    /// `ebpf-proxy status`.
    pub fn set_refusal_records(&mut self, records: RefusalRecords) {
        self.refusals.set_records(records);
    }

    /// Posts an Event on each Service the address policy refuses something
    /// of, through `events` (never waiting: a full queue drops it).
    pub fn set_events(&mut self, events: tokio::sync::mpsc::Sender<ServiceEvent>) {
        self.refusals.set_events(events);
    }

    /// The node's interfaces have `addrs` now: Services claiming one that
    /// came or went are synced again, as after an event.
    pub fn on_interface_addresses(
        &mut self,
        state: &mut ClusterState,
        addrs: &[std::net::IpAddr],
        now: Instant,
    ) {
        let changes = state.set_interface_addresses(addrs);
        if changes.is_empty() {
            return;
        }
        self.health.queued_at(now);
        self.first_queued.get_or_insert(now);
        self.dirty.extend(changes);
        let due = self.due_at(now);
        self.deadline.get_or_insert(due);
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
        self.first_sync.done() && self.interfaces_applied
    }

    /// Nothing queued or failed is left out of the maps.
    fn programmed(&self) -> bool {
        self.serving()
            && self.dirty.is_empty()
            && self.retries.is_empty()
            && !self.sweeper.unclaimed_left()
    }

    /// The datapath is attached to the node's interfaces.
    pub fn interfaces_applied(&mut self, now: Instant) {
        self.interfaces_applied = true;
        self.mark_readiness(now);
    }

    /// Records an event in `state`; the Services it changed are synced at
    /// once when the last sync ran at least `min_sync_period` ago, else that
    /// long after it ([`Self::due_at`]).
    pub fn on_event(&mut self, state: &mut ClusterState, event: SourceEvent, now: Instant) {
        let starts_first_sync = match &event {
            SourceEvent::Replace { kind, .. } => self.first_sync.listed(*kind),
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
        if changes.is_empty() && !starts_first_sync {
            return;
        }
        if !changes.is_empty() {
            self.health.queued_at(now);
            self.first_queued.get_or_insert(now);
        }
        // Merged whole rather than key by key: a listing's 100,000 keys are
        // taken as they are when nothing is queued, and merged in one pass
        // otherwise.
        let mut changes = changes.services;
        self.dirty.append(&mut changes);
        let due = self.due_at(now);
        self.deadline.get_or_insert(due);
    }

    /// When changes queued at `now` are synced: at once when the last sync
    /// ran at least `min_sync_period` ago (or never), else `min_sync_period`
    /// after it. A burst is synced at its start and then once a period,
    /// each sync taking everything that came meanwhile.
    fn due_at(&self, now: Instant) -> Instant {
        self.last_run
            .map_or(now, |last| now.max(last + self.min_sync_period))
    }

    /// When [`run`](Self::run) is next due, if anything is to be done.
    pub fn wakeup(&self) -> Option<Instant> {
        use first_sync::Gate;
        let changes = match (self.first_sync.gate(), self.deadline) {
            (_, None) | (Gate::Closed, _) => None,
            (Gate::Open, Some(deadline)) => Some(deadline),
            (Gate::At(gate), Some(deadline)) => Some(deadline.max(gate)),
        };
        changes
            .into_iter()
            .chain(self.retries.next_due())
            .chain(self.sweeper.wakeup())
            .chain(self.purges.wakeup())
            .min()
    }

    /// Programs the dirty Services and the retries that are due, sweeps
    /// what no Service claims, follows up (departed backends, health
    /// checks) and marks readiness. What it returns is for the agent to do.
    pub fn run<T: SyncTarget>(
        &mut self,
        now: Instant,
        state: &ClusterState,
        model: &ModelConfig,
        planner: &mut Planner,
        target: &mut T,
    ) -> FollowUps {
        if !self.first_sync.gate().open_at(now) {
            return FollowUps::default();
        }
        let services = self.due_services(now);
        let first_queued = self.first_queued.take();
        self.last_run = Some(now);
        self.sequence += 1;
        let span = info_span!("sync", seq = self.sequence, services = services.len());
        let _enter = span.enter();
        let started = Instant::now();
        let cpu_started = thread_cpu_time();
        let process_cpu_started = process_cpu_time();
        let first = !self.first_sync.done();
        let mut tally = Tally::default();
        if first {
            planner.reserve(services.len());
        }
        let mut unsettled = Unsettled::default();
        // Two rounds at most: a Service that found a frontend another's may
        // find it free once the others' writes are in (an older Service, or
        // a ClusterIP, won the address), and is programmed once more. What
        // is still another's after that stays so until either changes.
        let mut round = services;
        for _ in 0..2 {
            self.program(
                round,
                state,
                model,
                now,
                planner,
                target,
                &mut unsettled,
                &mut tally,
            );
            // The sweep deletes: everything new is written first.
            self.settle_services(&mut unsettled, state, now, planner, target, &mut tally);
            round = std::mem::take(&mut self.contested);
            if round.is_empty() {
                break;
            }
        }
        self.contested.clear();
        // On the loop's clock, which the events were stamped with.
        let written = now + started.elapsed();
        tally.add_sweep(self.sweeper.run(now, first, planner, target.store()));
        if first {
            self.first_sync.finish();
        }
        let follow_ups = self.follow_ups(now, planner, target);
        self.record(&tally);
        // Everything queued was tried, whatever the writes came to: /livez
        // leaves the failures to the retries.
        self.health.tried();
        self.mark_readiness(now);
        self.metrics
            .synced(first, started.elapsed(), tally.write_failures == 0);
        info!(
            ops = tally.ops,
            frontends_changed = tally.frontends_changed,
            failed = tally.failed,
            pending = self.pending(),
            departures_owed = self.purges.owed(),
            frontends = planner.frontend_count(),
            elapsed_us = started.elapsed().as_micros() as u64,
            cpu_us = thread_cpu_time().saturating_sub(cpu_started).as_micros() as u64,
            process_cpu_us = process_cpu_time()
                .saturating_sub(process_cpu_started)
                .as_micros() as u64,
            event_to_write_us =
                first_queued.map(|at| written.saturating_duration_since(at).as_micros() as u64),
            model_us = tally.phases.model.as_micros() as u64,
            plan_us = tally.phases.plan.as_micros() as u64,
            write_us = tally.phases.write.as_micros() as u64,
            book_us = tally.phases.book.as_micros() as u64,
            "synced"
        );
        if first {
            first_sync::release_listing_memory();
        }
        follow_ups
    }

    /// Models, plans and writes `services`, their new frontends gathered
    /// in `unsettled`'s batches.
    #[expect(
        clippy::too_many_arguments,
        reason = "the sync's own state, threaded through its two passes"
    )]
    fn program<T: SyncTarget>(
        &mut self,
        services: BTreeSet<ObjectKey>,
        state: &ClusterState,
        model: &ModelConfig,
        now: Instant,
        planner: &mut Planner,
        target: &mut T,
        unsettled: &mut Unsettled<<T::Store as MapStore>::Error>,
        tally: &mut Tally,
    ) {
        for key in services {
            // Looked up once: each lookup is a search of every Service.
            let service = state.service(&key);
            self.health_checks
                .refresh_service(state, &key, service, model);
            // A Service that failed is retried on its own, so that one
            // frontend a full map refuses does not fail a whole batch
            // again and again; the batch goes first, as the update order
            // needs.
            let alone = self.retries.contains(&key);
            if alone {
                self.settle_services(unsettled, state, now, planner, target, tally);
            }
            let phases = &mut tally.phases;
            let modelled = timed(&mut phases.model, || {
                desired_frontends(&key, service, state, model)
            });
            let outcome = match modelled {
                Ok(modelled) => {
                    self.refusals
                        .report(&key, service.and_then(|s| s.uid()), modelled.refusals);
                    timed(&mut phases.plan, || {
                        plan_service(
                            &key,
                            modelled.frontends,
                            planner,
                            target.store(),
                            (!alone).then_some(&mut unsettled.batch),
                        )
                    })
                }
                Err(e) => {
                    self.refusals.invalid(&key, &e);
                    ServiceOutcome::Invalid
                }
            };
            unsettled.push(key, outcome);
            if unsettled.full() {
                let landed = timed(&mut tally.phases.write, || {
                    unsettled.launch(planner, target.store())
                });
                self.book_services(landed, state, now, tally);
            }
        }
    }

    /// Writes what `unsettled` gathered and books each Service's outcome.
    fn settle_services<T: SyncTarget>(
        &mut self,
        unsettled: &mut Unsettled<<T::Store as MapStore>::Error>,
        state: &ClusterState,
        now: Instant,
        planner: &mut Planner,
        target: &mut T,
        tally: &mut Tally,
    ) {
        let outcomes = timed(&mut tally.phases.write, || {
            unsettled.settle(planner, target.store())
        });
        self.book_services(outcomes, state, now, tally);
    }

    /// Books the outcomes of Services whose writes are over.
    fn book_services<E: std::error::Error>(
        &mut self,
        outcomes: Vec<(ObjectKey, ServiceOutcome<E>)>,
        state: &ClusterState,
        now: Instant,
        tally: &mut Tally,
    ) {
        let started = Instant::now();
        for (key, outcome) in outcomes {
            self.settle_service(&key, &outcome, state, now);
            tally.add_service(&outcome);
        }
        tally.phases.book += started.elapsed();
    }

    /// The Services this sync programs: the dirty ones, and those whose
    /// retry is due. Nothing is queued any more.
    fn due_services(&mut self, now: Instant) -> BTreeSet<ObjectKey> {
        self.dirty.extend(self.retries.due(now));
        self.deadline = None;
        std::mem::take(&mut self.dirty)
    }

    /// Books what programming `key` came to: its retry, its metrics.
    fn settle_service<E: std::error::Error>(
        &mut self,
        key: &ObjectKey,
        outcome: &ServiceOutcome<E>,
        state: &ClusterState,
        now: Instant,
    ) {
        let ServiceOutcome::Planned { desired, planned } = outcome else {
            // Retrying cannot help objects that are invalid: they change.
            self.retries.forget(key);
            return;
        };
        if planned
            .errors
            .iter()
            .any(|e| matches!(e, PlanError::Conflict { .. }))
        {
            self.contested.insert(key.clone());
        }
        if planned.errors.is_empty() {
            self.metrics.programmed(key);
        }
        self.metrics
            .local_endpoints(key, state.service(key), desired);
        let writes_failed = outcome.write_failures();
        if writes_failed > 0 {
            let retry = self.retries.failed(key, now, writes_failed);
            warn!(
                service = %key,
                failures = retry.failures,
                retry_in_ms = backoff(retry.failures).as_millis() as u64,
                "write failed; retrying"
            );
        } else if let Some(retry) = self.retries.forget(key) {
            info!(service = %key, failures = retry.failures, "programmed after retrying");
        }
    }

    /// What follows a sync outside the service maps: the departed backends'
    /// flows and sockets (through the target), with those a failed purge
    /// still owes once due, and the health checks for the agent's servers.
    fn follow_ups<T: SyncTarget>(
        &mut self,
        now: Instant,
        planner: &mut Planner,
        target: &mut T,
    ) -> FollowUps {
        let fresh = planner.take_departed();
        let departed = self.purges.due(now, fresh, planner);
        let affinity = planner.take_affinity_purge(&departed);
        let landed = (departed.is_empty() && !affinity.needed())
            || target.clean_departed(&departed, &affinity);
        if !landed {
            planner.retry_affinity_purge(&affinity);
        }
        let count = departed.len();
        self.purges.settle(now, departed, landed);
        FollowUps {
            departed: count,
            health_checks: self.health_checks.take_changed(),
        }
    }

    /// Frontends left out of the maps by a failure, waiting for a retry.
    fn pending(&self) -> usize {
        self.retries.pending_frontends() + self.sweeper.pending_frontends()
    }

    fn record(&self, tally: &Tally) {
        self.stats.syncs.fetch_add(1, Ordering::Relaxed);
        self.stats
            .map_ops
            .fetch_add(tally.ops as u64, Ordering::Relaxed);
        self.stats
            .failed_writes
            .fetch_add(tally.write_failures as u64, Ordering::Relaxed);
        self.stats
            .pending
            .store(self.pending() as u64, Ordering::Relaxed);
        self.stats
            .departures_owed
            .store(self.purges.owed() as u64, Ordering::Relaxed);
    }

    /// /readyz learns the first sync ran and the datapath is attached, and
    /// /healthz that the maps hold everything, when they do.
    fn mark_readiness(&self, now: Instant) {
        if self.serving() {
            self.health.mark_started();
        }
        if self.programmed() {
            self.health.mark_synced_at(now);
        }
    }
}

/// CPU time this thread has used: a sync's cost apart from the time it
/// waited for a CPU on a busy node.
fn thread_cpu_time() -> Duration {
    cpu_time(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time the agent's threads have used: with the writes of a first
/// sync's batches on a thread of their own (`MapStore::start_batch`), what
/// the sync costs the node.
fn process_cpu_time() -> Duration {
    cpu_time(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn cpu_time(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    if unsafe { libc::clock_gettime(clock, &raw mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[cfg(test)]
mod tests;
