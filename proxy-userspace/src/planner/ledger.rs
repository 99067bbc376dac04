//! What the planner holds: each frontend as the maps have it, the ids it
//! handed out and who refers to them. Every diff is taken against this,
//! not against the maps, so a sync reads nothing back from the kernel.

use std::{collections::BTreeSet, sync::Arc};

use hashbrown::HashMap;
use proxy_common::{Backend, ServiceKey, ServiceValue, service_flags};

use super::{affinity::AffinityLedger, backends::Backends, encode::SourceRangeEntry, ops::MapOp};
use crate::{
    maglev::LbConfig,
    model::{FrontendKey, ServicePortName},
    source::ObjectKey,
};

/// What one frontend has in the maps.
#[derive(Clone, Debug)]
pub(super) struct Applied {
    pub(super) key: ServiceKey,
    pub(super) value: ServiceValue,
    /// Backend id in each slot `0..value.count` of `value.slot_set`.
    pub(super) backend_ids: Vec<u32>,
    /// None for a frontend adopted from pinned maps and not claimed since.
    /// Shared with the planner's index of what each Service owns.
    pub(super) owner: Option<Arc<ObjectKey>>,
    /// Shared with the service id it holds.
    pub(super) service: Option<Arc<ServicePortName>>,
    /// Its `SOURCE_RANGES` entries.
    pub(super) source_ranges: BTreeSet<SourceRangeEntry>,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Refcounted {
    pub(super) id: u32,
    pub(super) refs: u32,
}

#[derive(Default)]
pub struct Planner {
    pub(super) frontends: HashMap<FrontendKey, Applied>,
    /// Boxed slices, not sets: a Service has a frontend or two, and a set's
    /// first node has room for eleven.
    pub(super) owned: HashMap<Arc<ObjectKey>, Box<[FrontendKey]>>,
    pub(super) backends: Backends,
    pub(super) service_ids: HashMap<Arc<ServicePortName>, Refcounted>,
    pub(super) service_ids_in_use: HashMap<u32, u32>,
    /// The `SERVICE_NAMES` entries of adopted service ids no Service port
    /// has taken since: a hash of the entry with its port number zeroed
    /// (the map's hasher), and the port number. A restart writes again
    /// only the names that changed.
    pub(super) adopted_names: HashMap<u32, (u64, u16)>,
    pub(super) slot_sets_in_use: BTreeSet<u32>,
    pub(super) next_backend_id: u32,
    pub(super) next_service_id: u32,
    /// Service ids below this are the ones the datapath counts
    /// (`Planner::count_ids_below`); 0: no such bound.
    pub(super) counted_ids: u32,
    /// How many ids below `counted_ids` are in use: whether one is free
    /// there, whatever the ports past it hold.
    pub(super) counted_in_use: usize,
    pub(super) next_slot_set: u32,
    /// Deletes of garbage that failed; retried on the next sync.
    pub(super) pending: Vec<MapOp>,
    /// (service id, backend id) pairs that left a backend set since the
    /// last `take_departed`: their flows and affinity need cleaning.
    pub(super) departed: Vec<Departed>,
    /// `--lb-algorithm` and the Maglev table every node shares.
    pub(super) lb: LbConfig,
    /// The frontends with session affinity per service id, kept by
    /// `insert_applied` and `remove_applied`: which ids' `AFFINITY` entries
    /// go after a sync.
    pub(super) affinity: AffinityLedger,
}

/// A backend that left a service's backend set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Departed {
    pub service_id: u32,
    pub backend_id: u32,
    /// Its address, port and protocol, taken before the id is released and
    /// perhaps given to another backend; None for an id the planner holds
    /// no entry of, and for a purge owed after the backend came back under
    /// another id (`Planner::still_departed`).
    pub backend: Option<Backend>,
}

impl Planner {
    /// Records `applied` as frontend `key`'s, in place of what it had.
    pub(super) fn insert_applied(&mut self, key: FrontendKey, applied: Applied) {
        if has_affinity(&applied) {
            self.affinity.add(applied.value.service_id);
        }
        if let Some(old) = self.frontends.insert(key, applied)
            && has_affinity(&old)
        {
            self.affinity.remove(old.value.service_id);
        }
    }

    /// Forgets frontend `key`, returning what it had.
    pub(super) fn remove_applied(&mut self, key: &FrontendKey) -> Option<Applied> {
        let old = self.frontends.remove(key)?;
        if has_affinity(&old) {
            self.affinity.remove(old.value.service_id);
        }
        Some(old)
    }
}

fn has_affinity(applied: &Applied) -> bool {
    applied.value.flags & service_flags::AFFINITY != 0
}
