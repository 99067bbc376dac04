//! The ids the planner hands out (backend ids, service ids, slot sets) and
//! the references that keep them taken. An id is given back when its last
//! reference goes, so a backend or slot set is deleted from the maps only
//! once nothing points at it; the counters wrap past 0, which the datapath
//! reads as "none".

use std::{hash::BuildHasher, sync::Arc};

use proxy_common::Backend;

use super::{
    backends::BackendHash,
    encode,
    ledger::{Applied, Departed, Planner, Refcounted},
    ops::MapOp,
};
use crate::model::{Frontend, ServicePortName};

/// A backend no id is held for: the id it gets with the plan.
pub(super) struct Fresh {
    pub(super) id: u32,
    pub(super) backend: Backend,
    pub(super) hash: BackendHash,
}

impl Planner {
    /// The id of each backend in slot order: existing ones are reused; new
    /// ones (returned apart) are tentative until the plan is committed.
    pub(super) fn backend_ids(&mut self, fe: &Frontend) -> (Vec<u32>, Vec<Fresh>) {
        let mut ids = Vec::with_capacity(fe.backends.len());
        let mut fresh: Vec<Fresh> = Vec::new();
        for b in &fe.backends {
            let enc = encode::backend(b);
            let id = match self.backends.find(&enc) {
                (Some(id), _) => id,
                (None, hash) => {
                    if let Some(f) = fresh.iter().find(|f| f.backend == enc) {
                        f.id
                    } else {
                        let id = self.alloc_backend_id(&fresh);
                        fresh.push(Fresh {
                            id,
                            backend: enc,
                            hash,
                        });
                        id
                    }
                }
            };
            ids.push(id);
        }
        (ids, fresh)
    }

    /// The service id of `fe`'s Service port, and whether the port holds
    /// none yet (it takes this one when `fe` is committed).
    pub(super) fn service_id(&mut self, fe: &Frontend, prev: Option<&Applied>) -> (u32, bool) {
        match self.service_ids.get(&fe.service) {
            Some(r) => (r.id, false),
            // An adopted frontend keeps its id, so affinity survives a restart.
            None => match prev {
                Some(p) if p.service.is_none() => (p.value.service_id, true),
                _ => (self.alloc_service_id(), true),
            },
        }
    }

    /// The write of `fe`'s Service port as the name of service id `id`,
    /// which the port is taking: None when the maps hold that name for it
    /// already (adopted). The port number is the Service port's, whichever
    /// of its frontends (a NodePort among them) comes first.
    pub(super) fn service_name_write(&mut self, fe: &Frontend, id: u32) -> Option<MapOp> {
        let name = encode::service_name(&fe.service, fe.service_port);
        if let Some((hash, port)) = self.adopted_names.remove(&id)
            && hash
                == self
                    .adopted_names
                    .hasher()
                    .hash_one(encode::service_name(&fe.service, 0))
            && port == fe.service_port
        {
            return None;
        }
        Some(MapOp::PutServiceName {
            id,
            name: Box::new(name),
        })
    }

    /// Backend `backend_id` leaving service `service_id`, with its address
    /// while the id still names it.
    pub(super) fn departure(&self, service_id: u32, backend_id: u32) -> Departed {
        Departed {
            service_id,
            backend_id,
            backend: self.backends.backend_of(backend_id),
        }
    }

    /// Drops one reference to each id; deletes for those left unreferenced.
    pub(super) fn release_backends(&mut self, ids: &[u32]) -> Vec<MapOp> {
        ids.iter()
            .filter(|id| self.backends.release(**id))
            .map(|id| MapOp::DeleteBackend { id: *id })
            .collect()
    }

    /// Takes a reference to `name`'s service id (`id` if it has none yet);
    /// returns the name as the planner holds it, shared.
    pub(super) fn acquire_service_id(
        &mut self,
        name: &ServicePortName,
        id: u32,
    ) -> Arc<ServicePortName> {
        let holds = self.service_ids_in_use.entry(id).or_default();
        if *holds == 0 && id < self.counted_ids {
            self.counted_in_use += 1;
        }
        *holds += 1;
        if let Some((shared, r)) = self.service_ids.get_key_value_mut(name) {
            r.refs += 1;
            return Arc::clone(shared);
        }
        let shared = Arc::new(name.clone());
        self.service_ids
            .insert(Arc::clone(&shared), Refcounted { id, refs: 1 });
        shared
    }

    /// Drops one reference to `name`'s service id; the delete of the id's
    /// name once nothing holds the id.
    pub(super) fn release_service_id(&mut self, name: &ServicePortName) -> Option<MapOp> {
        let r = self.service_ids.get_mut(name)?;
        r.refs = r.refs.saturating_sub(1);
        let id = r.id;
        if r.refs == 0 {
            self.service_ids.remove(name);
        }
        self.release_adopted_service_id(id)
    }

    /// Drops one hold on service id `id`; the delete of its name once
    /// nothing holds it.
    pub(super) fn release_adopted_service_id(&mut self, id: u32) -> Option<MapOp> {
        let n = self.service_ids_in_use.get_mut(&id)?;
        *n = n.saturating_sub(1);
        if *n > 0 {
            return None;
        }
        self.service_ids_in_use.remove(&id);
        if id < self.counted_ids {
            self.counted_in_use = self.counted_in_use.saturating_sub(1);
        }
        self.adopted_names.remove(&id);
        Some(MapOp::DeleteServiceName { id })
    }

    fn alloc_backend_id(&mut self, fresh: &[Fresh]) -> u32 {
        loop {
            let id = self.next_backend_id;
            self.next_backend_id = self.next_backend_id.checked_add(1).unwrap_or(1);
            if id != 0 && !self.backends.has_id(id) && !fresh.iter().any(|f| f.id == id) {
                return id;
            }
        }
    }

    /// The next free service id, round robin: a freed id is taken again as
    /// late as can be (conntrack entries of its flows still name it until
    /// they expire, and count into its counters). Below `counted_ids` while
    /// one is free there, past it otherwise: such a port is served, not
    /// counted.
    fn alloc_service_id(&mut self) -> u32 {
        let bound = self.counted_ids;
        let below = bound > 1 && self.counted_in_use < (bound - 1) as usize;
        loop {
            let mut id = self.next_service_id;
            if below && id >= bound {
                id = 1;
            } else if !below && bound > 1 && id < bound {
                id = bound;
            }
            self.next_service_id = id.checked_add(1).unwrap_or(1);
            if id != 0 && !self.service_ids_in_use.contains_key(&id) {
                return id;
            }
        }
    }

    pub(super) fn alloc_slot_set(&mut self) -> u32 {
        loop {
            let set = self.next_slot_set;
            self.next_slot_set = self.next_slot_set.checked_add(1).unwrap_or(1);
            if set != 0 && self.slot_sets_in_use.insert(set) {
                return set;
            }
        }
    }
}
