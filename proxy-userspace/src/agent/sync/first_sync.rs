//! The first sync waits until every initial listing is in, so that an agent
//! restarted on maps programmed before diffs against the whole cluster and
//! never against half of it (Services without their EndpointSlices would
//! read as Services without endpoints).

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use tracing::warn;

use crate::source::Kind;

/// How long the first sync waits for the Node listing once Services and
/// EndpointSlices are listed. The Node only brings the zone topology hints
/// are read against, so an API server that never lists it (a missing RBAC
/// rule) delays the datapath by this much instead of forever.
pub const NODE_LISTING_WAIT: Duration = Duration::from_secs(10);

/// The kinds whose listings the first sync waits for. The service CIDRs
/// are not among them: they only add drops and rejects for addresses no
/// frontend answers, and an API server may serve none.
const AWAITED: [Kind; 3] = [Kind::Service, Kind::EndpointSlice, Kind::Node];

/// Whether a sync may run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gate {
    Open,
    /// Services and EndpointSlices are listed, the Node not yet: open from
    /// then on.
    At(Instant),
    Closed,
}

impl Gate {
    pub fn open_at(self, now: Instant) -> bool {
        match self {
            Gate::Open => true,
            Gate::At(gate) => now >= gate,
            Gate::Closed => false,
        }
    }
}

/// The listings received, and whether the first sync has run.
#[derive(Debug)]
pub(super) struct FirstSync {
    /// Kinds a complete listing has been received for.
    listed: BTreeSet<Kind>,
    done: bool,
    node_listing_deadline: Instant,
}

impl FirstSync {
    pub fn new(now: Instant) -> Self {
        FirstSync {
            listed: BTreeSet::new(),
            done: false,
            node_listing_deadline: now + NODE_LISTING_WAIT,
        }
    }

    /// A complete listing of `kind` arrived. True when it is the last one the
    /// first sync was waiting for, or one of them: the first sync also
    /// removes what no Service claims, so such a listing starts it even when
    /// it changed nothing.
    pub fn listed(&mut self, kind: Kind) -> bool {
        AWAITED.contains(&kind) && self.listed.insert(kind) && !self.done
    }

    pub fn done(&self) -> bool {
        self.done
    }

    pub fn gate(&self) -> Gate {
        if self.done || AWAITED.iter().all(|kind| self.listed.contains(kind)) {
            Gate::Open
        } else if self.listed.contains(&Kind::Service) && self.listed.contains(&Kind::EndpointSlice)
        {
            Gate::At(self.node_listing_deadline)
        } else {
            Gate::Closed
        }
    }

    /// The first sync has run.
    pub fn finish(&mut self) {
        if !self.listed.contains(&Kind::Node) {
            warn!(
                waited_s = NODE_LISTING_WAIT.as_secs(),
                "no listing of this node's Node yet: synced without its zone (topology hints) for now"
            );
        }
        self.done = true;
    }
}

/// The initial listing peaks memory (documents, parsed objects, event
/// copies) and is then freed; this hands it back to the system rather than
/// keep it as resident heap. Called once the first sync is marked ready: at
/// 100,000 Services the trim walks a heap of some 400 MiB, which readiness
/// need not wait for.
pub(super) fn release_listing_memory() {
    // SAFETY: malloc_trim only releases free heap pages.
    unsafe { libc::malloc_trim(0) };
}
