//! Writes of new frontends gathered over many Services and written
//! together, one map at a time.
//!
//! At 100,000 Services x 10 endpoints the first sync writes 2.1 million
//! entries; written per frontend that is three system calls for every
//! frontend (its backends, its slots, its service entry). Gathered, they
//! are five calls per [`Batch`] (the sync loop writes one every 1,024
//! frontends). Only a frontend the maps do not have yet is gathered:
//! nothing points at its backends, slots, source ranges or service name
//! until its `SERVICES` entry is written, and every id it takes is one no
//! other frontend holds, so writing all names, then all backends, then all
//! slots, then all service entries keeps the update order of
//! docs/architecture.md ("Map update order") for each of them. A frontend the maps already hold is
//! written on its own, after the batch has landed.
//!
//! A batch may be written while the next one is gathered (the store's
//! choice: `MapStore::start_batch`): the kernel's inserts, most of a first
//! sync's time, then overlap the planning. The next batch may then use
//! backends the one being written adds; if that one fails, the next is
//! failed whole before it is written ([`Unlanded::with_all`]).

use std::{collections::BTreeSet, sync::Arc};

use hashbrown::HashSet;
use proxy_common::BackendSlotKey;

use super::{
    encode::SourceRangeEntry,
    ops::{Landing, MapOp, Phases},
    outcome::PlanError,
};
use crate::{model::FrontendKey, source::ObjectKey};

/// One gathered frontend: whose it is, and how many writes it has.
#[derive(Debug)]
pub(super) struct Gathered {
    pub key: FrontendKey,
    pub owner: Arc<ObjectKey>,
    pub writes: usize,
}

/// The gathered writes, by map, in the order they are written; and the
/// frontends that failed when a batch did not land.
#[derive(Debug)]
pub struct Batch<E: std::error::Error + 'static> {
    pub(super) source_ranges: Vec<MapOp>,
    /// The names of the service ids its frontends are the first to take.
    pub(super) names: Vec<MapOp>,
    pub(super) backends: Vec<MapOp>,
    pub(super) slots: Vec<MapOp>,
    /// One `PutService` per gathered frontend, in the order of `frontends`.
    pub(super) services: Vec<MapOp>,
    pub(super) frontends: Vec<Gathered>,
    /// The batch before, while it is written.
    pub(super) in_flight: Option<InFlight<E>>,
    failures: Vec<Unwritten<E>>,
}

/// A batch handed to the store, its frontends waiting for it to land.
#[derive(Debug)]
pub(super) struct InFlight<E> {
    pub phases: Arc<Phases>,
    pub frontends: Vec<Gathered>,
    pub landing: Landing<E>,
}

/// A gathered frontend that is not in the maps: its batch failed before its
/// service entry landed. The planner has forgotten it, so that the next sync
/// of its Service plans it anew.
#[derive(Debug)]
pub struct Unwritten<E: std::error::Error + 'static> {
    pub error: PlanError<E>,
    /// Its writes, counted when it was planned.
    pub writes: usize,
}

impl<E: std::error::Error + 'static> Default for Batch<E> {
    fn default() -> Self {
        Self {
            source_ranges: Vec::new(),
            names: Vec::new(),
            backends: Vec::new(),
            slots: Vec::new(),
            services: Vec::new(),
            frontends: Vec::new(),
            in_flight: None,
            failures: Vec::new(),
        }
    }
}

impl<E: std::error::Error + 'static> Batch<E> {
    /// Frontends gathered and not written yet.
    pub fn len(&self) -> usize {
        self.frontends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.frontends.is_empty()
    }

    /// Nothing gathered, and nothing being written.
    pub fn is_settled(&self) -> bool {
        self.frontends.is_empty() && self.in_flight.is_none()
    }

    /// The frontends of batches that failed since the last call, each with
    /// its owner: their Services need another sync.
    pub fn take_failures(&mut self) -> Vec<Unwritten<E>> {
        std::mem::take(&mut self.failures)
    }

    pub(super) fn fail(&mut self, failure: Unwritten<E>) {
        self.failures.push(failure);
    }

    /// What a new frontend's plan is: puts, ending with its service entry.
    pub(super) fn can_gather(writes: &[MapOp]) -> bool {
        matches!(writes.last(), Some(MapOp::PutService { .. }))
            && writes.iter().all(|op| {
                matches!(
                    op,
                    MapOp::PutSourceRange { .. }
                        | MapOp::PutServiceName { .. }
                        | MapOp::PutBackend { .. }
                        | MapOp::PutSlot { .. }
                        | MapOp::PutService { .. }
                )
            })
    }

    /// Adds a new frontend's writes, its service entry last.
    pub(super) fn gather(&mut self, key: FrontendKey, owner: &Arc<ObjectKey>, writes: Vec<MapOp>) {
        let count = writes.len();
        for op in writes {
            match op {
                MapOp::PutSourceRange { .. } => self.source_ranges.push(op),
                MapOp::PutServiceName { .. } => self.names.push(op),
                MapOp::PutBackend { .. } => self.backends.push(op),
                MapOp::PutSlot { .. } => self.slots.push(op),
                _ => self.services.push(op),
            }
        }
        self.frontends.push(Gathered {
            key,
            owner: Arc::clone(owner),
            writes: count,
        });
    }

    /// The writes in the order they land: source ranges, service names,
    /// backends, slots, then the service entries. Empties the batch.
    pub(super) fn take_phases(&mut self) -> (Phases, Vec<Gathered>) {
        (
            [
                std::mem::take(&mut self.source_ranges),
                std::mem::take(&mut self.names),
                std::mem::take(&mut self.backends),
                std::mem::take(&mut self.slots),
                std::mem::take(&mut self.services),
            ],
            std::mem::take(&mut self.frontends),
        )
    }
}

/// What of a failed batch never reached the maps: the writes from the one
/// that failed on, in the phase that failed and every phase after it.
#[derive(Debug, Default)]
pub(super) struct Unlanded {
    source_ranges: BTreeSet<SourceRangeEntry>,
    names: HashSet<u32>,
    backends: HashSet<u32>,
    slots: HashSet<BackendSlotKey>,
}

impl Unlanded {
    pub fn new(phases: &Phases, failed_phase: usize, landed: usize) -> Self {
        let mut this = Self::default();
        this.add(phases, failed_phase, landed);
        this
    }

    /// And every write of `phases`, none of which was made: the batch
    /// gathered while a failed one was written.
    pub fn with_all(mut self, phases: &Phases) -> Self {
        self.add(phases, 0, 0);
        self
    }

    fn add(&mut self, phases: &Phases, failed_phase: usize, landed: usize) {
        for (phase, ops) in phases.iter().enumerate().skip(failed_phase) {
            let skipped = if phase == failed_phase { landed } else { 0 };
            for op in ops.iter().skip(skipped) {
                match op {
                    MapOp::PutSourceRange { entry } => {
                        self.source_ranges.insert(*entry);
                    }
                    MapOp::PutServiceName { id, .. } => {
                        self.names.insert(*id);
                    }
                    MapOp::PutBackend { id, .. } => {
                        self.backends.insert(*id);
                    }
                    MapOp::PutSlot { key, .. } => {
                        self.slots.insert(*key);
                    }
                    _ => {}
                }
            }
        }
    }

    /// Whether `delete` removes something that is in the maps, or may be:
    /// a write that never landed needs no undoing, and at a million
    /// entries the system calls would be seconds.
    pub fn needs(&self, delete: &MapOp) -> bool {
        match delete {
            MapOp::DeleteSourceRange { entry } => !self.source_ranges.contains(entry),
            MapOp::DeleteServiceName { id } => !self.names.contains(id),
            MapOp::DeleteBackend { id } => !self.backends.contains(id),
            MapOp::DeleteSlot { key } => !self.slots.contains(key),
            _ => true,
        }
    }
}
