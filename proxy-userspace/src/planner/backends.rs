//! The programmed backends: each distinct backend once, with its id in
//! `BACKENDS` and how many slots point at it.
//!
//! Entries live in one array and two tables of 4-byte positions find them,
//! by backend and by id: about 50 bytes a backend at a million of them,
//! where two maps holding the backend and its id each (backend → id,
//! id → backend) took about 110, half their buckets empty. The planner's
//! share of the heap per Service is in bench/results/scale.md.

use std::hash::BuildHasher;

use hashbrown::{DefaultHashBuilder, HashTable};
use proxy_common::Backend;

/// One backend and what refers to it.
#[derive(Clone, Copy, Debug)]
struct Entry {
    backend: Backend,
    /// Its key in `BACKENDS`; 0 (never allocated) marks a vacant entry.
    id: u32,
    /// Slots pointing at it.
    refs: u32,
}

#[derive(Default)]
pub(super) struct Backends {
    entries: Vec<Entry>,
    /// Vacant positions in `entries`, reused before it grows.
    vacant: Vec<u32>,
    /// Positions in `entries`, found by backend.
    by_backend: HashTable<u32>,
    /// Positions in `entries`, found by id.
    by_id: HashTable<u32>,
    /// No id above this was ever held: ids are handed out in increasing
    /// order, so a new one is known to be free without a probe.
    highest_id: u32,
    hasher: DefaultHashBuilder,
}

/// A backend's hash, from [`Backends::find`], for [`Backends::insert_new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BackendHash(u64);

impl Backends {
    /// The id of `backend`, if it has one.
    pub(super) fn id_of(&self, backend: &Backend) -> Option<u32> {
        self.find(backend).0
    }

    /// [`Self::id_of`], and the backend's hash for [`Self::insert_new`].
    pub(super) fn find(&self, backend: &Backend) -> (Option<u32>, BackendHash) {
        let hash = hash_backend(&self.hasher, backend);
        let id = self
            .by_backend
            .find(hash, |&at| self.entries[at as usize].backend == *backend)
            .map(|&at| self.entries[at as usize].id);
        (id, BackendHash(hash))
    }

    /// The backend with id `id`, if any.
    pub(super) fn backend_of(&self, id: u32) -> Option<Backend> {
        self.position_of(id)
            .map(|at| self.entries[at as usize].backend)
    }

    /// Whether any backend has id `id`.
    pub(super) fn has_id(&self, id: u32) -> bool {
        id <= self.highest_id && self.position_of(id).is_some()
    }

    /// Number of ids held.
    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Records `backend` under `id` with no references, unless `id` is held
    /// already. A backend held under another id keeps being found by that
    /// one (an earlier run of the agent may have left a second copy).
    pub(super) fn insert(&mut self, id: u32, backend: Backend) {
        if id == 0 || self.has_id(id) {
            return;
        }
        let at = self.push(id, backend);
        let hash = hash_backend(&self.hasher, &backend);
        let entries = &self.entries;
        if self
            .by_backend
            .find(hash, |&p| entries[p as usize].backend == backend)
            .is_none()
        {
            self.index_by_backend(at, hash);
        }
    }

    /// [`Self::insert`] of a backend [`Self::find`] did not find (with the
    /// hash it gave), under an id [`Self::has_id`] says is free, nothing
    /// inserted since: one probe of each table where `insert` takes two.
    /// Every backend of a first sync comes this way.
    pub(super) fn insert_new(&mut self, id: u32, backend: Backend, hash: BackendHash) {
        debug_assert!(id != 0 && !self.has_id(id), "id {id} is held");
        debug_assert_eq!(self.find(&backend), (None, hash), "backend is held");
        let at = self.push(id, backend);
        self.index_by_backend(at, hash.0);
    }

    /// A new entry, found by id: its position.
    fn push(&mut self, id: u32, backend: Backend) -> u32 {
        let entry = Entry {
            backend,
            id,
            refs: 0,
        };
        let at = if let Some(at) = self.vacant.pop() {
            self.entries[at as usize] = entry;
            at
        } else {
            self.entries.push(entry);
            (self.entries.len() - 1) as u32
        };
        self.highest_id = self.highest_id.max(id);
        let entries = &self.entries;
        let hasher = &self.hasher;
        self.by_id.insert_unique(hasher.hash_one(id), at, |&p| {
            hasher.hash_one(entries[p as usize].id)
        });
        at
    }

    fn index_by_backend(&mut self, at: u32, hash: u64) {
        let entries = &self.entries;
        let hasher = &self.hasher;
        self.by_backend.insert_unique(hash, at, |&p| {
            hash_backend(hasher, &entries[p as usize].backend)
        });
    }

    /// One more slot points at `id`.
    pub(super) fn acquire(&mut self, id: u32) {
        if let Some(at) = self.position_of(id) {
            self.entries[at as usize].refs += 1;
        }
    }

    /// One slot fewer points at `id`; true when that was the last and the
    /// id is gone.
    pub(super) fn release(&mut self, id: u32) -> bool {
        let Some(at) = self.position_of(id) else {
            return false;
        };
        let entry = &mut self.entries[at as usize];
        entry.refs = entry.refs.saturating_sub(1);
        if entry.refs > 0 {
            return false;
        }
        let backend = entry.backend;
        let hasher = &self.hasher;
        if let Ok(found) = self.by_id.find_entry(hasher.hash_one(id), |&p| p == at) {
            found.remove();
        }
        if let Ok(found) = self
            .by_backend
            .find_entry(hash_backend(hasher, &backend), |&p| p == at)
        {
            found.remove();
        }
        self.entries[at as usize] = Entry {
            backend: Backend::default(),
            id: 0,
            refs: 0,
        };
        self.vacant.push(at);
        true
    }

    fn position_of(&self, id: u32) -> Option<u32> {
        if id == 0 || id > self.highest_id {
            return None;
        }
        self.by_id
            .find(self.hasher.hash_one(id), |&at| {
                self.entries[at as usize].id == id
            })
            .copied()
    }
}

/// A backend's bytes hashed at once: its fields one by one cost twice as
/// much, and the initial sync hashes every backend of every frontend.
fn hash_backend(hasher: &DefaultHashBuilder, backend: &Backend) -> u64 {
    hasher.hash_one(bytemuck::bytes_of(backend))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(last: u32) -> Backend {
        Backend {
            addr_be: [0, 0, 0xffff_u32.to_be(), (0x0a00_0000 + last).to_be()],
            port_be: 8080u16.to_be(),
            proto: proxy_common::PROTO_TCP,
            flags: 0,
        }
    }

    #[test]
    fn entries_are_found_both_ways_and_go_with_their_last_reference() {
        let mut table = Backends::default();
        table.insert(7, backend(1));
        table.insert(9, backend(2));
        table.acquire(7);
        table.acquire(7);
        table.acquire(9);
        assert_eq!(table.id_of(&backend(1)), Some(7), "by backend");
        assert_eq!(table.backend_of(9), Some(backend(2)), "by id");
        assert_eq!(table.len(), 2);

        assert!(!table.release(7), "7 has another reference");
        assert_eq!(table.id_of(&backend(1)), Some(7), "still held");
        assert!(table.release(7), "the last reference to 7");
        assert_eq!(table.id_of(&backend(1)), None, "7 is gone by backend");
        assert_eq!(table.backend_of(7), None, "7 is gone by id");
        assert!(!table.release(7), "releasing a gone id does nothing");

        // The vacant position is reused, and nothing else moved.
        table.insert(11, backend(3));
        assert_eq!(table.entries.len(), 2, "position reused");
        assert_eq!(table.id_of(&backend(3)), Some(11));
        assert_eq!(table.backend_of(9), Some(backend(2)));
        assert_eq!(table.len(), 2);
    }

    #[test]
    fn a_second_id_of_a_backend_is_held_but_not_found_by_backend() {
        let mut table = Backends::default();
        table.insert(3, backend(1));
        table.insert(4, backend(1));
        table.insert(3, backend(9));
        assert_eq!(table.id_of(&backend(1)), Some(3), "the first id wins");
        assert_eq!(table.backend_of(4), Some(backend(1)), "the second is held");
        assert_eq!(table.backend_of(3), Some(backend(1)), "an id is not reused");
        table.acquire(4);
        assert!(table.release(4));
        assert_eq!(table.id_of(&backend(1)), Some(3), "3 survives 4 going");
        table.acquire(3);
        assert!(table.release(3));
        assert_eq!(table.id_of(&backend(1)), None);
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn many_entries_survive_the_tables_growing() {
        let mut table = Backends::default();
        for i in 1..=5000 {
            table.insert(i, backend(i));
            table.acquire(i);
        }
        for i in (1..=5000).step_by(2) {
            assert!(table.release(i), "{i} had one reference");
        }
        for i in 1..=5000 {
            let want = (i % 2 == 0).then_some(i);
            assert_eq!(table.id_of(&backend(i)), want, "backend {i}");
        }
        assert_eq!(table.len(), 2500);
    }
}
