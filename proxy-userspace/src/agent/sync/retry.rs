//! The Services whose writes failed, each with the record of what it still
//! owes (`crate::retry`): tried again by the loop's own timer until it
//! lands, with no event needed.

use std::{collections::BTreeMap, time::Instant};

use crate::{retry::Retry, source::ObjectKey};

/// The Services with a write that failed, each waiting for its retry.
#[derive(Debug, Default)]
pub(super) struct Retries(BTreeMap<ObjectKey, Retry>);

impl Retries {
    /// The Services whose retry is due at `now`.
    pub fn due(&self, now: Instant) -> impl Iterator<Item = ObjectKey> + '_ {
        self.0
            .iter()
            .filter(move |(_, r)| r.is_due(now))
            .map(|(key, _)| key.clone())
    }

    /// The earliest retry.
    pub fn next_due(&self) -> Option<Instant> {
        self.0.values().map(|r| r.due).min()
    }

    /// `frontends` of `key` failed at `now`: its next retry, backed off from
    /// its last.
    pub fn failed(&mut self, key: &ObjectKey, now: Instant, frontends: usize) -> Retry {
        let retry = Retry::after(self.0.get(key), now, frontends);
        self.0.insert(key.clone(), retry);
        retry
    }

    /// Nothing of `key` is left to retry; the retry it had, if any.
    pub fn forget(&mut self, key: &ObjectKey) -> Option<Retry> {
        self.0.remove(key)
    }

    /// Frontends waiting for a retry.
    pub fn pending_frontends(&self) -> usize {
        self.0.values().map(|r| r.frontends).sum()
    }

    /// `key` failed and has not landed since.
    pub fn contains(&self, key: &ObjectKey) -> bool {
        self.0.contains_key(key)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
