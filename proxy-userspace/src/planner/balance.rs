//! Which frontends balance by Maglev, and their slot sets: a random-mode
//! frontend's slots are its backends (a backend's weight being how many
//! slots it has); a Maglev frontend's are its Maglev table over the same
//! weighted set, so terminating fallbacks and traffic policies shape both
//! alike.

use proxy_common::{ServiceValue, service_flags};

use super::{encode, ledger::Planner};
use crate::{
    maglev::{self, BackendName, LbAlgorithm},
    model::{Frontend, FrontendKind},
};

impl Planner {
    /// Whether `fe` picks new flows' backends by Maglev: its Service's
    /// annotation, else `--lb-algorithm`, says so, and it is reached from
    /// outside the cluster. A ClusterIP's flows start and stay on one node
    /// (the client's), where conntrack already keeps them, and a table
    /// for each of them would cost `BACKEND_SLOTS` far more than it gives
    /// (docs/maglev.md).
    pub(super) fn uses_maglev(&self, fe: &Frontend) -> bool {
        fe.kind != FrontendKind::ClusterIp
            && fe.lb_algorithm.unwrap_or(self.lb.algorithm) == LbAlgorithm::Maglev
    }

    /// The slots of `fe`, whose backends have the ids `ids` (in the order
    /// of `fe.backends`): those ids, or its Maglev table over them.
    pub(super) fn slots(&self, fe: &Frontend, ids: Vec<u32>) -> Vec<u32> {
        if ids.is_empty() || !self.uses_maglev(fe) {
            return ids;
        }
        let named: Vec<(BackendName, u32)> = fe
            .backends
            .iter()
            .map(encode::backend_name)
            .zip(ids)
            .collect();
        maglev::build(&named, self.lb.table_size, self.lb.hash_seed)
    }

    /// Marks `value` as `fe`'s Maglev table where it is one.
    pub(super) fn mark_maglev(&self, fe: &Frontend, value: &mut ServiceValue) {
        if self.uses_maglev(fe) {
            value.flags |= service_flags::MAGLEV;
            value.hash_seed = self.lb.hash_seed;
        }
    }
}
