//! What a sync did, and why a frontend could not be: one sync goes on past
//! a frontend that failed, so its errors are gathered rather than returned.

use crate::{model::FrontendKey, source::ObjectKey};

/// Why a frontend could not be programmed.
#[derive(Debug, thiserror::Error)]
pub enum PlanError<E: std::error::Error + 'static> {
    #[error("frontend {frontend} of {owner}: already programmed for {other}")]
    Conflict {
        frontend: FrontendKey,
        owner: ObjectKey,
        other: ObjectKey,
    },
    #[error("frontend {frontend} of {owner}: {source}")]
    Write {
        frontend: FrontendKey,
        owner: ObjectKey,
        #[source]
        source: E,
    },
    /// Gathered into a [`Batch`] that failed before its service entry
    /// landed (`reason`, the write that failed, may be another frontend's).
    #[error("frontend {frontend} of {owner}: not written, its batch failed: {reason}")]
    Unwritten {
        frontend: FrontendKey,
        owner: ObjectKey,
        reason: String,
    },
    #[error("frontend {frontend}: {backends} backends is more than one frontend may have")]
    TooManyBackends {
        frontend: FrontendKey,
        backends: usize,
    },
}

/// Result of applying plans: what was done, and what failed (others went on).
#[derive(Debug, Default)]
pub struct SyncOutcome<E: std::error::Error + 'static> {
    pub ops: usize,
    pub frontends_changed: usize,
    pub errors: Vec<PlanError<E>>,
}

impl<E: std::error::Error + 'static> SyncOutcome<E> {
    pub(super) fn new() -> Self {
        Self {
            ops: 0,
            frontends_changed: 0,
            errors: Vec::new(),
        }
    }
}
