//! One frontend's writes, planned before anything is written: its source
//! ranges, its new backends, and a backend set that either grows in the
//! slot set it has or moves whole to a new one, so that the single write of
//! its service entry switches a packet from one complete set to another.

use std::collections::BTreeSet;

use proxy_common::{BackendSlotKey, ServiceKey, ServiceValue, service_flags};

use super::{
    encode::{self, SourceRangeEntry},
    ids::Fresh,
    ledger::{Applied, Planner},
    ops::MapOp,
};
use crate::model::{Frontend, FrontendKind, NoEndpointAction, Scope};

/// One frontend's change, planned before anything is written.
pub(super) struct FrontendPlan {
    pub(super) key: ServiceKey,
    pub(super) value: ServiceValue,
    /// Backend id of each slot.
    pub(super) ids: Vec<u32>,
    /// Backends that get a new id (and a `BACKENDS` entry) with this plan.
    pub(super) fresh: Vec<Fresh>,
    pub(super) ranges: BTreeSet<SourceRangeEntry>,
    /// Up to and including the flip of the service entry.
    pub(super) writes: Vec<MapOp>,
    /// Old slots and stale source ranges, deleted once the flip is in.
    pub(super) cleanup: Vec<MapOp>,
    /// A slot set taken for this plan, given back if the writes fail.
    pub(super) new_slot_set: Option<u32>,
}

impl Planner {
    /// The writes that bring the maps from `prev` to `fe`, in the update
    /// order: the name of a service id it is the first to take, new source
    /// ranges, new backends and new slots, then the service entry (the
    /// flip); and the deletes that may follow it.
    pub(super) fn plan(
        &mut self,
        fe: &Frontend,
        prev: Option<&Applied>,
        service_id: u32,
        name: Option<MapOp>,
        ids: Vec<u32>,
        fresh: Vec<Fresh>,
    ) -> FrontendPlan {
        let key = encode::service_key(&fe.key);
        let ranges: BTreeSet<SourceRangeEntry> = fe
            .source_ranges
            .iter()
            .map(|r| encode::source_range(&key, r))
            .collect();
        let mut value = ServiceValue {
            service_id,
            slot_set: 0,
            count: ids.len() as u32,
            flags: service_flags_of(fe, !ranges.is_empty()),
            affinity_timeout_s: fe.affinity_timeout_s.unwrap_or(0),
            hash_seed: 0,
        };
        self.mark_maglev(fe, &mut value);
        let no_ranges = BTreeSet::new();
        let prev_ranges = prev.map_or(&no_ranges, |p| &p.source_ranges);

        // New source ranges go in before the service entry that turns the
        // firewall on; ranges no longer wanted go after it.
        let mut writes: Vec<MapOp> = Vec::with_capacity(ranges.len() + fresh.len() + ids.len() + 2);
        writes.extend(name);
        writes.extend(
            ranges
                .difference(prev_ranges)
                .map(|entry| MapOp::PutSourceRange { entry: *entry }),
        );
        let mut cleanup: Vec<MapOp> = Vec::new();
        writes.extend(fresh.iter().map(|f| MapOp::PutBackend {
            id: f.id,
            backend: f.backend,
        }));
        let mut new_slot_set = None;
        match prev {
            Some(p) if ids.starts_with(&p.backend_ids) => {
                // Same set, or grown at the end: new slots, then the count.
                value.slot_set = p.value.slot_set;
                for (slot, id) in ids.iter().enumerate().skip(p.backend_ids.len()) {
                    writes.push(put_slot(value.slot_set, slot, *id));
                }
            }
            _ => {
                let set = self.alloc_slot_set();
                new_slot_set = Some(set);
                value.slot_set = set;
                for (slot, id) in ids.iter().enumerate() {
                    writes.push(put_slot(set, slot, *id));
                }
                if let Some(p) = prev {
                    cleanup.extend((0..p.backend_ids.len()).map(|slot| MapOp::DeleteSlot {
                        key: BackendSlotKey {
                            slot_set: p.value.slot_set,
                            slot: slot as u32,
                        },
                    }));
                }
            }
        }
        cleanup.extend(
            prev_ranges
                .difference(&ranges)
                .map(|entry| MapOp::DeleteSourceRange { entry: *entry }),
        );
        if prev.map(|p| p.value) != Some(value) {
            writes.push(MapOp::PutService { key, value });
        }
        FrontendPlan {
            key,
            value,
            ids,
            fresh,
            ranges,
            writes,
            cleanup,
            new_slot_set,
        }
    }
}

fn service_flags_of(fe: &Frontend, has_source_ranges: bool) -> u32 {
    let mut flags = 0;
    if fe.affinity_timeout_s.is_some() {
        flags |= service_flags::AFFINITY;
    }
    if fe.no_endpoints == NoEndpointAction::Drop {
        flags |= service_flags::NO_EP_DROP;
    }
    // In-cluster clients of an external address are not masqueraded
    // (kube-proxy's EXT chain sends them to the service chain before its
    // masquerade mark), so the in-cluster entry is not external.
    if fe.kind != FrontendKind::ClusterIp && fe.key.scope == Scope::Any {
        flags |= service_flags::EXTERNAL;
    }
    if has_source_ranges {
        flags |= service_flags::SOURCE_RANGES;
    }
    if fe.kind == FrontendKind::LoadBalancer {
        flags |= service_flags::LOAD_BALANCER;
    }
    flags
}

fn put_slot(slot_set: u32, slot: usize, backend_id: u32) -> MapOp {
    MapOp::PutSlot {
        key: BackendSlotKey {
            slot_set,
            slot: slot as u32,
        },
        backend_id,
    }
}
