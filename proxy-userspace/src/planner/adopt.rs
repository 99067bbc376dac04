//! Taking over what pinned maps hold from an earlier run of the agent:
//! consistent frontends are kept as they are, so traffic keeps flowing
//! through a restart, and the rest is returned as garbage to delete.

use std::{collections::BTreeSet, hash::BuildHasher, sync::Arc};

use proxy_common::{BackendSlotKey, ServiceName};

use super::{
    encode,
    ledger::{Applied, Planner},
    ops::{MapOp, MapStore},
    outcome::SyncOutcome,
    stored::StoredState,
};
use crate::{model::FrontendKey, source::ObjectKey};

impl Planner {
    pub(super) fn from_stored(stored: &StoredState) -> (Self, Vec<MapOp>) {
        let mut planner = Self::new();
        let mut garbage = Vec::new();
        let mut referenced_slots = BTreeSet::new();
        for (key, value) in &stored.services {
            let Some(fkey) = encode::frontend_key(key) else {
                garbage.push(MapOp::DeleteService { key: *key });
                continue;
            };
            // A missing slot (a crash mid-update) becomes backend 0, which
            // is never allocated: the next plan sees a difference and
            // rewrites the whole set.
            let backend_ids: Vec<u32> = (0..value.count)
                .map(|slot| {
                    let sk = BackendSlotKey {
                        slot_set: value.slot_set,
                        slot,
                    };
                    referenced_slots.insert(sk);
                    stored.slots.get(&sk).copied().unwrap_or(0)
                })
                .collect();
            planner.slot_sets_in_use.insert(value.slot_set);
            *planner
                .service_ids_in_use
                .entry(value.service_id)
                .or_default() += 1;
            for id in &backend_ids {
                if let Some(b) = stored.backends.get(id) {
                    planner.backends.insert(*id, *b);
                    planner.backends.acquire(*id);
                }
            }
            planner.insert_applied(
                fkey,
                Applied {
                    key: *key,
                    value: *value,
                    backend_ids,
                    owner: None,
                    service: None,
                    source_ranges: stored
                        .source_ranges
                        .iter()
                        .filter(|(_, k)| k.frontend == *key)
                        .copied()
                        .collect(),
                },
            );
        }
        for entry in &stored.source_ranges {
            if !stored.services.contains_key(&entry.1.frontend) {
                garbage.push(MapOp::DeleteSourceRange { entry: *entry });
            }
        }
        for key in stored.slots.keys() {
            if !referenced_slots.contains(key) {
                garbage.push(MapOp::DeleteSlot { key: *key });
            }
        }
        for (id, b) in &stored.backends {
            if planner.backends.id_of(b) != Some(*id) {
                garbage.push(MapOp::DeleteBackend { id: *id });
            }
        }
        for (id, name) in &stored.names {
            if planner.service_ids_in_use.contains_key(id) {
                let unported = ServiceName { port: 0, ..*name };
                let hash = planner.adopted_names.hasher().hash_one(unported);
                planner.adopted_names.insert(*id, (hash, name.port));
            } else {
                garbage.push(MapOp::DeleteServiceName { id: *id });
            }
        }
        planner.next_backend_id = stored.backends.keys().max().map_or(1, |m| m + 1);
        planner.next_slot_set = planner.slot_sets_in_use.last().map_or(1, |m| m + 1);
        planner.next_service_id = planner.service_ids_in_use.keys().max().map_or(1, |m| m + 1);
        (planner, garbage)
    }

    pub(super) fn drop_unclaimed<S: MapStore>(&mut self, store: &mut S) -> SyncOutcome<S::Error> {
        let mut outcome = SyncOutcome::new();
        let unclaimed: Vec<FrontendKey> = self
            .frontends
            .iter()
            .filter(|(_, a)| a.owner.is_none())
            .map(|(k, _)| *k)
            .collect();
        let nobody = Arc::new(ObjectKey {
            namespace: String::new(),
            name: "(adopted)".into(),
        });
        for key in unclaimed {
            match self.remove_frontend(&nobody, &key, store) {
                Ok(ops) => {
                    outcome.ops += ops;
                    outcome.frontends_changed += 1;
                }
                Err(e) => outcome.errors.push(e),
            }
        }
        outcome
    }
}
