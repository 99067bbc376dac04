//! The sync loop's counts: the loop adds to them as it runs, and the
//! datapath collector reads them at scrape time. They live here, below
//! both, so that the loop reports to the metrics without the metrics
//! knowing the loop.

use std::sync::atomic::AtomicU64;

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
    /// Departed backends whose purge (flows, affinity entries, sockets)
    /// failed, waiting for its retry.
    pub departures_owed: AtomicU64,
}
