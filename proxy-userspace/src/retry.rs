//! What a write still owes, and when it is tried again. Every write the
//! agent retries by its own timer (a Service's frontends, the sweep of what
//! no Service claims, the node-level maps) keeps one [`Retry`] while it has
//! not landed, and backs off on the same schedule; the health check
//! servers' ports that failed to open follow that schedule too. It sits
//! below all of them, so that none of them imports another for it.

use std::time::{Duration, Instant};

/// The wait before the first retry of a failed write; it doubles with each
/// failure up to [`RETRY_MAX`].
pub const RETRY_INITIAL: Duration = Duration::from_millis(100);
pub const RETRY_MAX: Duration = Duration::from_secs(5);

/// The wait before retry number `failures` (1 for the first).
pub fn backoff(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    RETRY_INITIAL.saturating_mul(1 << doublings).min(RETRY_MAX)
}

/// A write that has not landed: how often it failed, when it is tried
/// again, and how many frontends it leaves out of the maps meanwhile (what
/// `ebpf_proxy_sync_pending` counts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retry {
    pub failures: u32,
    pub due: Instant,
    /// Frontends that failed on the last attempt; 0 where what is owed is
    /// no frontend's (garbage left by a failed delete, the node maps).
    pub frontends: usize,
}

impl Retry {
    /// The record after an attempt at `now` failed, backed off from
    /// `previous`, the record it replaces.
    pub fn after(previous: Option<&Retry>, now: Instant, frontends: usize) -> Retry {
        let failures = previous.map_or(0, |r| r.failures) + 1;
        Retry {
            failures,
            due: now + backoff(failures),
            frontends,
        }
    }

    /// Due at `now`.
    pub fn is_due(&self, now: Instant) -> bool {
        self.due <= now
    }
}
