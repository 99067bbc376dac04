//! Retries with backoff: what failed is tried again by the loop's own timer
//! until it lands, with no event needed.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use crate::source::ObjectKey;

/// The wait before the first retry of a failed write; it doubles with each
/// failure up to [`RETRY_MAX`].
pub const RETRY_INITIAL: Duration = Duration::from_millis(100);
pub const RETRY_MAX: Duration = Duration::from_secs(5);

/// The wait before retry number `failures` (1 for the first).
pub fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    RETRY_INITIAL.saturating_mul(1 << doublings).min(RETRY_MAX)
}

/// Something to try again: a Service, or the removal of frontends no
/// Service claimed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Retry {
    pub failures: u32,
    pub due: Instant,
    /// Frontends that failed on the last attempt.
    pub frontends: usize,
}

impl Retry {
    pub fn after(previous: Option<&Retry>, now: Instant, frontends: usize) -> Retry {
        let failures = previous.map_or(0, |r| r.failures) + 1;
        Retry {
            failures,
            due: now + backoff(failures),
            frontends,
        }
    }
}

/// The Services with a write that failed, each waiting for its retry.
#[derive(Debug, Default)]
pub(super) struct Retries(BTreeMap<ObjectKey, Retry>);

impl Retries {
    /// The Services whose retry is due at `now`.
    pub fn due(&self, now: Instant) -> impl Iterator<Item = ObjectKey> + '_ {
        self.0
            .iter()
            .filter(move |(_, r)| r.due <= now)
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
