//! Removal of what no Service claims: frontends adopted from the pinned maps
//! that the first complete listing did not claim, and map entries the
//! planner left behind when a delete failed. Either is retried with backoff
//! until it lands.

use std::time::Instant;

use tracing::error;

use crate::{
    planner::{MapStore, Planner},
    retry::Retry,
};

/// What a sweep did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Swept {
    pub ops: usize,
    pub frontends_changed: usize,
    /// Frontend removals that failed.
    pub failures: usize,
}

/// What the sweep still owes: set while something is left to remove, its
/// frontends 1 while unclaimed frontends whose removal failed are among it
/// (the sync's pending count takes them as one), 0 for garbage alone.
#[derive(Debug, Default)]
pub(super) struct Sweeper {
    retry: Option<Retry>,
}

impl Sweeper {
    /// When the next attempt is due.
    pub fn wakeup(&self) -> Option<Instant> {
        self.retry.map(|r| r.due)
    }

    /// Unclaimed frontends are still in the maps.
    pub fn unclaimed_left(&self) -> bool {
        self.pending_frontends() > 0
    }

    /// What the sweep leaves out of the maps, as the sync counts it.
    pub fn pending_frontends(&self) -> usize {
        self.retry.map_or(0, |r| r.frontends)
    }

    /// Sweeps when due: always after the first sync's Services (`first`),
    /// and on its retry timer while something is left.
    pub fn run<S: MapStore>(
        &mut self,
        now: Instant,
        first: bool,
        planner: &mut Planner,
        store: &mut S,
    ) -> Swept {
        let mut swept = Swept::default();
        let due = self.retry.is_some_and(|r| r.is_due(now));
        let mut unclaimed_left = self.unclaimed_left();
        if first || (due && unclaimed_left) {
            let outcome = planner.remove_unclaimed(store);
            swept.ops += outcome.ops;
            swept.frontends_changed += outcome.frontends_changed;
            for e in &outcome.errors {
                error!(error = %e, "stale frontend not removed");
            }
            swept.failures += outcome.errors.len();
            unclaimed_left = !outcome.errors.is_empty();
        }
        if due {
            swept.ops += planner.collect_garbage(Vec::new(), store).ops;
        }
        // Garbage a Service's sync left gets its timer on the next sync that
        // finds none running.
        if first || due || self.retry.is_none() {
            let left = unclaimed_left || planner.has_garbage();
            self.retry =
                left.then(|| Retry::after(self.retry.as_ref(), now, usize::from(unclaimed_left)));
        }
        swept
    }
}
