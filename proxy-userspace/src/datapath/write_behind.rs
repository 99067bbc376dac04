//! Batches of new frontends written on a thread of their own while the
//! sync plans the next one (`MapStore::start_batch`). A first sync at
//! 100,000 Services x 10 endpoints inserts 2.1 million entries; at
//! 830-930 ns of the kernel's CPU each (docs/architecture.md, "The first
//! sync's time") that is more than half the sync, and on its own thread it
//! overlaps the model and the planner, which need the other core.
//!
//! The writer holds duplicates of the four maps' descriptors, so that it
//! needs nothing of the maps' handles while the sync goes on; the
//! planner waits for it before any other write, which keeps the update
//! order (docs/architecture.md, "Map update order"). It knows descriptors
//! and batches only: the maps' own error wraps its [`RunError`].

use std::{
    io,
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    sync::Arc,
};

use proxy_common::{
    Backend, BackendSlot, BackendSlotKey, ServiceKey, ServiceName, ServiceValue, map_names,
};

use super::{
    batch::{self, BatchError},
    prefilter::{self, Prefilter},
    service_counters::{self, ServiceCountersError},
};
use crate::planner::{Landing, MapOp, Phases, write_phases};

/// A run of puts the kernel refused part of; `op` is the first put that did
/// not land.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("{op}: {source}")]
    Batch {
        op: String,
        #[source]
        source: BatchError,
    },
    /// Pins of an agent older than `SERVICE_NAMES`.
    #[error("{op}: there is no map {}", map_names::SERVICE_NAMES)]
    NoNames { op: String },
    #[error(transparent)]
    Counters(#[from] ServiceCountersError),
}

/// Batches of fewer entries are written at once: a thread costs more than
/// it saves, and a single Service's change should land without a hand-off.
pub const WRITE_BEHIND_MIN: usize = 4096;

/// Runs of backends or slots at least this long are written in two halves
/// at once (`RunWriter::write_run_split`).
const SPLIT_MIN: usize = 8192;

/// The descriptors of `SERVICE_NAMES` (where the pins have it),
/// `BACKENDS`, `BACKEND_SLOTS` and `SERVICES`: the maps a batch writes
/// after its source ranges.
#[derive(Debug)]
pub struct RunWriter<F> {
    pub names: Option<F>,
    /// `SERVICE_COUNTERS`, whose slots of the ids named are zeroed before
    /// their names land (see `service_counters`).
    pub counters: Option<F>,
    pub backends: F,
    pub slots: F,
    pub services: F,
    /// Where the entries' bits are set as they land (see `prefilter`).
    pub prefilter: Option<Arc<Prefilter>>,
}

impl<F: AsFd> RunWriter<F> {
    /// Writes `run`, puts to one of the four maps, in one call; on a
    /// failure, how many landed.
    pub fn write_run(&self, run: &[MapOp]) -> Result<(), (usize, RunError)> {
        prefilter::landing(self.prefilter.as_deref(), run, || {
            self.write_unfiltered(run)
        })
    }

    fn write_unfiltered(&self, run: &[MapOp]) -> Result<(), (usize, RunError)> {
        let result = match run.first() {
            Some(op @ MapOp::PutServiceName { .. }) => {
                let Some(names) = &self.names else {
                    return Err((0, RunError::NoNames { op: op.to_string() }));
                };
                let (ids, entries): (Vec<u32>, Vec<ServiceName>) = run
                    .iter()
                    .filter_map(|op| match op {
                        MapOp::PutServiceName { id, name } => Some((*id, **name)),
                        _ => None,
                    })
                    .unzip();
                if let Some(counters) = &self.counters
                    && let Err(e) = service_counters::reset(counters.as_fd(), &ids)
                {
                    return Err((0, RunError::from(e)));
                }
                batch::update(names.as_fd(), &ids, &entries)
            }
            Some(MapOp::PutBackend { .. }) => {
                let (ids, backends): (Vec<u32>, Vec<Backend>) = run
                    .iter()
                    .filter_map(|op| match op {
                        MapOp::PutBackend { id, backend } => Some((*id, *backend)),
                        _ => None,
                    })
                    .unzip();
                batch::update(self.backends.as_fd(), &ids, &backends)
            }
            Some(MapOp::PutService { .. }) => {
                let (keys, values): (Vec<ServiceKey>, Vec<ServiceValue>) = run
                    .iter()
                    .filter_map(|op| match op {
                        MapOp::PutService { key, value } => Some((*key, *value)),
                        _ => None,
                    })
                    .unzip();
                batch::update(self.services.as_fd(), &keys, &values)
            }
            _ => {
                let (keys, slots): (Vec<BackendSlotKey>, Vec<BackendSlot>) = run
                    .iter()
                    .filter_map(|op| match op {
                        MapOp::PutSlot { key, backend_id } => Some((
                            *key,
                            BackendSlot {
                                backend_id: *backend_id,
                            },
                        )),
                        _ => None,
                    })
                    .unzip();
                batch::update(self.slots.as_fd(), &keys, &slots)
            }
        };
        result.map_err(|(landed, source)| {
            (
                landed,
                RunError::Batch {
                    op: run[landed.min(run.len() - 1)].to_string(),
                    source,
                },
            )
        })
    }
}

impl<F: AsFd + Sync> RunWriter<F> {
    /// [`Self::write_run`], a long run of backends or slots in two halves
    /// on two threads: the kernel's inserts are most of a first sync, and
    /// one writer alone left the sync waiting for it with a core idle (at
    /// 100,000 Services, 0.5 s of a 2.0 s sync on a quiet machine). The phase's entries all
    /// land before the next phase starts, as the update order needs.
    /// Service entries are written in one run: a failure there must leave
    /// exactly the first `landed` of them in the map, as the frontends'
    /// order counts on.
    ///
    /// When the first half fails and part of the second landed, the failure
    /// is reported after the second half's last landed entry: what is
    /// reported unlanded must not be in the map (its undoing is skipped),
    /// and a backend or slot reported landed that is not is deleted for
    /// nothing. Either way every frontend of the batch is failed.
    pub fn write_run_split(&self, run: &[MapOp]) -> Result<(), (usize, RunError)> {
        let split = run.len() >= SPLIT_MIN
            && matches!(
                run.first(),
                Some(MapOp::PutBackend { .. } | MapOp::PutSlot { .. })
            );
        // Both halves' bits under one hold of the prefilter's lock, so that
        // they land at once rather than one after the other.
        prefilter::landing(self.prefilter.as_deref(), run, || {
            if split {
                self.write_halves(run)
            } else {
                self.write_unfiltered(run)
            }
        })
    }

    fn write_halves(&self, run: &[MapOp]) -> Result<(), (usize, RunError)> {
        let mid = run.len() / 2;
        let (first, second) = run.split_at(mid);
        let (first, second) = std::thread::scope(|scope| {
            let helper = std::thread::Builder::new()
                .name("map-writer".into())
                .spawn_scoped(scope, || self.write_unfiltered(second));
            let first = self.write_unfiltered(first);
            let second = match helper {
                Ok(helper) => helper
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                // No thread for it: written here, after the first.
                Err(_) => self.write_unfiltered(second),
            };
            (first, second)
        });
        halves_landed(mid, run.len(), first, second)
    }
}

/// What a run written in two halves, split at `mid` of `len`, came to, as
/// one run's result: a failure at the count of entries that may have landed
/// (see [`RunWriter::write_run_split`]), with the first half's error if it
/// failed.
fn halves_landed<E>(
    mid: usize,
    len: usize,
    first: Result<(), (usize, E)>,
    second: Result<(), (usize, E)>,
) -> Result<(), (usize, E)> {
    match (first, second) {
        (Ok(()), Ok(())) => Ok(()),
        (Err((landed, e)), Err((0, _))) => Err((landed, e)),
        (Err((_, e)), Ok(())) => Err((len, e)),
        (first, Err((landed, e))) => Err((mid + landed, first.err().map_or(e, |(_, e)| e))),
    }
}

impl RunWriter<BorrowedFd<'_>> {
    /// Owned duplicates, for a thread that outlives the borrow.
    pub fn to_owned(&self) -> io::Result<RunWriter<OwnedFd>> {
        Ok(RunWriter {
            names: self.names.map(|fd| fd.try_clone_to_owned()).transpose()?,
            counters: self
                .counters
                .map(|fd| fd.try_clone_to_owned())
                .transpose()?,
            backends: self.backends.try_clone_to_owned()?,
            slots: self.slots.try_clone_to_owned()?,
            services: self.services.try_clone_to_owned()?,
            prefilter: self.prefilter.clone(),
        })
    }
}

impl RunWriter<OwnedFd> {
    /// Writes phases 1 to 4 of `phases` (service names, backends, slots,
    /// service entries; each one run of one map) on a thread of its own,
    /// failing with the
    /// caller's error.
    pub fn spawn<E: From<RunError> + Send + 'static>(
        self,
        phases: Arc<Phases>,
    ) -> io::Result<Landing<E>> {
        let writer = std::thread::Builder::new()
            .name("map-writer".into())
            .spawn(move || {
                write_phases(&phases, 1, |ops| {
                    self.write_run_split(ops)
                        .map_err(|(landed, e)| (landed, E::from(e)))
                })
            })?;
        Ok(Landing::Writing(writer))
    }
}

/// Whether `phases` is worth a thread: enough entries, and each of phases
/// 1 to 4 one run of puts to its map, as `planner::Batch` gathers them.
pub fn worth_a_thread(phases: &Phases) -> bool {
    let entries: usize = phases[1..].iter().map(Vec::len).sum();
    let one_map = |ops: &[MapOp], put: fn(&MapOp) -> bool| ops.iter().all(put);
    entries >= WRITE_BEHIND_MIN
        && one_map(&phases[1], |op| matches!(op, MapOp::PutServiceName { .. }))
        && one_map(&phases[2], |op| matches!(op, MapOp::PutBackend { .. }))
        && one_map(&phases[3], |op| matches!(op, MapOp::PutSlot { .. }))
        && one_map(&phases[4], |op| matches!(op, MapOp::PutService { .. }))
}

#[cfg(test)]
mod tests {
    use super::halves_landed;

    #[test]
    fn halves_report_no_unlanded_entry_that_landed() {
        let ok = || Ok::<(), (usize, &str)>(());
        assert_eq!(halves_landed(5, 10, ok(), ok()), Ok(()));
        assert_eq!(
            halves_landed(5, 10, ok(), Err((2, "second"))),
            Err((7, "second")),
            "the first half whole, the second's first two"
        );
        assert_eq!(
            halves_landed(5, 10, Err((3, "first")), Err((0, "second"))),
            Err((3, "first")),
            "nothing of the second: exactly the first three"
        );
        assert_eq!(
            halves_landed(5, 10, Err((3, "first")), ok()),
            Err((10, "first")),
            "the second whole: all of it may be in the maps"
        );
        assert_eq!(
            halves_landed(5, 10, Err((3, "first")), Err((4, "second"))),
            Err((9, "first")),
            "up to the second's last landed entry, with the first's error"
        );
    }
}
