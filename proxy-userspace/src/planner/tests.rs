use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
};

use proptest::prelude::*;
use proxy_common::{BackendSlotKey, service_flags};

use super::*;
use crate::model::{BackendAddr, FrontendKey, FrontendKind, Protocol, Scope, ServicePortName};

/// A store that checks, after every single operation, that a packet would
/// see a complete backend set, and that can be told to fail.
#[derive(Default)]
struct CheckingStore {
    state: StoredState,
    fail_at: Option<usize>,
    applied: usize,
}

#[derive(Debug, thiserror::Error)]
#[error("injected failure")]
struct Injected;

impl MapStore for CheckingStore {
    type Error = Injected;
    fn apply(&mut self, op: &MapOp) -> Result<(), Injected> {
        if self.fail_at == Some(self.applied) {
            self.fail_at = None;
            return Err(Injected);
        }
        self.applied += 1;
        let _ = self.state.apply(op);
        if let Err(e) = self.state.check_consistent() {
            panic!("after `{op}` a packet would see an inconsistent service: {e}");
        }
        if let Err(e) = self.state.check_named(op) {
            panic!("after `{op}` status could not name a frontend: {e}");
        }
        Ok(())
    }
}

fn owner(name: &str) -> ObjectKey {
    ObjectKey {
        namespace: "default".into(),
        name: name.into(),
    }
}

fn ip(last: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
}

fn frontend(vip: u8, backends: &[u8]) -> Frontend {
    let backends = backends
        .iter()
        .map(|last| BackendAddr::remote(ip(*last), 8080, Protocol::Tcp))
        .collect();
    let service = ServicePortName::new("default", &format!("svc{vip}"), "", Protocol::Tcp);
    Frontend::cluster_ip(
        service,
        IpAddr::V4(Ipv4Addr::new(10, 96, 0, vip)),
        80,
        backends,
    )
}

/// What the maps say a frontend's backends are, in slot order.
fn stored_backends(state: &StoredState, fe: &Frontend) -> Option<Vec<String>> {
    let value = state.services.get(&encode::service_key(&fe.key))?;
    Some(
        (0..value.count)
            .map(|slot| {
                let id = state.slots[&BackendSlotKey {
                    slot_set: value.slot_set,
                    slot,
                }];
                encode::backend_string(&state.backends[&id])
            })
            .collect(),
    )
}

fn expected_backends(fe: &Frontend) -> Vec<String> {
    fe.backends.iter().map(BackendAddr::host_port).collect()
}

fn sync(p: &mut Planner, s: &mut CheckingStore, name: &str, fes: &[Frontend]) -> usize {
    let out = p.sync_service(&owner(name), fes, s);
    assert!(
        out.errors.is_empty(),
        "sync of {name} failed: {:?}",
        out.errors
    );
    out.ops
}

#[test]
fn programs_grows_shrinks_and_removes_with_minimal_ops() {
    let mut p = Planner::new();
    let mut s = CheckingStore::default();
    let fe = frontend(1, &[11, 12, 13]);
    // The service id's name + 3 backends + 3 slots + 1 service.
    assert_eq!(sync(&mut p, &mut s, "a", std::slice::from_ref(&fe)), 8);
    assert_eq!(
        stored_backends(&s.state, &fe).unwrap(),
        expected_backends(&fe)
    );

    // 10.0.0.14 sorts last: grown in place with one backend, one slot and
    // the count.
    let grown = frontend(1, &[11, 12, 13, 14]);
    assert_eq!(sync(&mut p, &mut s, "a", std::slice::from_ref(&grown)), 3);
    assert_eq!(
        stored_backends(&s.state, &grown).unwrap(),
        expected_backends(&grown)
    );

    // Unchanged: nothing written.
    assert_eq!(sync(&mut p, &mut s, "a", std::slice::from_ref(&grown)), 0);

    // Removing one from the middle: a new slot set (3 slots), the flip, the
    // old set's 4 slots and the one unreferenced backend deleted.
    let shrunk = frontend(1, &[11, 13, 14]);
    assert_eq!(
        sync(&mut p, &mut s, "a", std::slice::from_ref(&shrunk)),
        3 + 1 + 4 + 1
    );
    assert_eq!(
        stored_backends(&s.state, &shrunk).unwrap(),
        expected_backends(&shrunk)
    );
    assert_eq!(
        s.state.slots.len(),
        3,
        "old slot set left behind: {:?}",
        s.state.slots
    );

    sync(&mut p, &mut s, "a", &[]);
    assert_eq!(
        s.state,
        StoredState::default(),
        "removal left entries behind"
    );
}

#[test]
fn backends_shared_by_frontends_are_refcounted() {
    let mut p = Planner::new();
    let mut s = CheckingStore::default();
    sync(&mut p, &mut s, "a", &[frontend(1, &[11, 12])]);
    sync(&mut p, &mut s, "b", &[frontend(2, &[12, 13])]);
    assert_eq!(s.state.backends.len(), 3);
    sync(&mut p, &mut s, "a", &[]);
    assert_eq!(s.state.backends.len(), 2, "backend 12 is still used by b");
    let b = frontend(2, &[12, 13]);
    assert_eq!(
        stored_backends(&s.state, &b).unwrap(),
        expected_backends(&b)
    );
}

#[test]
fn empty_backend_set_is_programmed_for_reject() {
    let mut p = Planner::new();
    let mut s = CheckingStore::default();
    let fe = frontend(1, &[]);
    sync(&mut p, &mut s, "a", std::slice::from_ref(&fe));
    let value = s.state.services[&encode::service_key(&fe.key)];
    assert_eq!(
        (value.count, value.flags & service_flags::NO_EP_DROP),
        (0, 0)
    );
}

#[test]
fn one_endpoint_change_among_many_services_costs_a_few_ops() {
    let mut p = Planner::new();
    let mut s = CheckingStore::default();
    for svc in 0..200u8 {
        sync(
            &mut p,
            &mut s,
            &format!("s{svc}"),
            &[frontend(svc, &[11, 12, 13])],
        );
    }
    let ops = sync(&mut p, &mut s, "s7", &[frontend(7, &[11, 12, 13, 14])]);
    assert_eq!(ops, 3, "one added endpoint must cost O(1) map writes");
}

#[test]
fn a_failed_write_leaves_the_frontend_as_it_was_and_no_garbage() {
    let mut p = Planner::new();
    let mut s = CheckingStore::default();
    let before = frontend(1, &[11, 12, 13]);
    sync(&mut p, &mut s, "a", std::slice::from_ref(&before));
    let snapshot = s.state.clone();
    // Fail the third op of the replacement (a slot write, before the flip).
    s.fail_at = Some(s.applied + 2);
    let after = frontend(1, &[10, 12]);
    let out = p.sync_service(&owner("a"), std::slice::from_ref(&after), &mut s);
    assert_eq!(out.errors.len(), 1, "the injected failure must be reported");
    assert!(
        out.errors[0].to_string().contains("10.96.0.1:80/TCP"),
        "error does not name the frontend: {}",
        out.errors[0]
    );
    assert_eq!(s.state, snapshot, "a failed plan changed the maps");
    // And the next sync gets there.
    sync(&mut p, &mut s, "a", std::slice::from_ref(&after));
    assert_eq!(
        stored_backends(&s.state, &after).unwrap(),
        expected_backends(&after)
    );
}

#[test]
fn adoption_keeps_what_is_programmed_and_removes_only_the_unclaimed() {
    let mut p = Planner::new();
    let mut s = CheckingStore::default();
    let a = frontend(1, &[11, 12, 13]);
    let b = frontend(2, &[12, 14]);
    sync(&mut p, &mut s, "a", std::slice::from_ref(&a));
    sync(&mut p, &mut s, "b", std::slice::from_ref(&b));
    // A leftover slot from a crash mid-update.
    s.state.slots.insert(
        BackendSlotKey {
            slot_set: 999,
            slot: 0,
        },
        1,
    );

    let (mut adopted, garbage) = Planner::adopt(&s.state);
    assert_eq!(
        garbage.len(),
        1,
        "only the stray slot is garbage: {garbage:?}"
    );
    adopted.collect_garbage(garbage, &mut s);
    // Re-syncing the same desired state writes nothing.
    assert_eq!(sync(&mut adopted, &mut s, "a", std::slice::from_ref(&a)), 0);
    adopted.remove_unclaimed(&mut s);
    assert!(
        stored_backends(&s.state, &b).is_none(),
        "unclaimed frontend b survived"
    );
    assert_eq!(
        stored_backends(&s.state, &a).unwrap(),
        expected_backends(&a)
    );
    assert_eq!(s.state.backends.len(), 3, "b's own backend 14 must be gone");
}

#[test]
fn two_services_claiming_one_frontend_is_a_conflict_not_a_takeover() {
    let mut p = Planner::new();
    let mut s = CheckingStore::default();
    sync(&mut p, &mut s, "a", &[frontend(1, &[11])]);
    let out = p.sync_service(&owner("b"), &[frontend(1, &[12])], &mut s);
    assert!(matches!(
        out.errors.as_slice(),
        [PlanError::Conflict { .. }]
    ));
    let a = frontend(1, &[11]);
    assert_eq!(
        stored_backends(&s.state, &a).unwrap(),
        expected_backends(&a)
    );
}

proptest! {
    /// Any sequence of backend sets for a few services: every operation
    /// keeps the maps consistent (CheckingStore panics otherwise) and each
    /// sync ends with the maps encoding exactly the desired sets.
    #[test]
    fn any_sequence_converges(steps in prop::collection::vec(
        (0u8..3, prop::collection::btree_set(10u8..20, 0..6)), 1..40)) {
        let mut p = Planner::new();
        let mut s = CheckingStore::default();
        let mut current = std::collections::BTreeMap::<u8, Frontend>::new();
        for (svc, set) in steps {
            let backends: Vec<u8> = set.into_iter().collect();
            let fe = frontend(svc, &backends);
            sync(&mut p, &mut s, &format!("s{svc}"), std::slice::from_ref(&fe));
            current.insert(svc, fe);
            for fe in current.values() {
                prop_assert_eq!(stored_backends(&s.state, fe).unwrap(), expected_backends(fe));
            }
            let live: usize = current.values().map(|f| f.backends.len()).sum();
            prop_assert_eq!(s.state.slots.len(), live, "slots leaked");
        }
    }
}

fn source_ranges_of(state: &StoredState, fe: &Frontend) -> Vec<String> {
    let key = encode::service_key(&fe.key);
    state
        .source_ranges
        .iter()
        .filter(|(_, k)| k.frontend == key)
        .map(encode::source_range_string)
        .collect()
}

#[test]
fn source_ranges_follow_the_frontend_and_never_leave_it_firewalled_empty() {
    let mut p = Planner::new();
    let mut s = CheckingStore::default();
    let mut fe = frontend(1, &[11]);
    fe.kind = FrontendKind::LoadBalancer;
    let cidr = |t: &str| crate::model::Cidr::parse(t).unwrap();
    fe.source_ranges = vec![cidr("192.0.2.0/24"), cidr("198.51.100.7/32")];
    sync(&mut p, &mut s, "a", std::slice::from_ref(&fe));
    let value = s.state.services[&encode::service_key(&fe.key)];
    assert_eq!(
        value.flags & (service_flags::SOURCE_RANGES | service_flags::EXTERNAL),
        service_flags::SOURCE_RANGES | service_flags::EXTERNAL
    );
    assert_eq!(
        source_ranges_of(&s.state, &fe),
        [
            "10.96.0.1:80/TCP from 192.0.2.0/24",
            "10.96.0.1:80/TCP from 198.51.100.7/32"
        ]
    );

    // A range replaced: the new one is in before the old one goes.
    fe.source_ranges = vec![cidr("192.0.2.0/24"), cidr("203.0.113.0/24")];
    assert_eq!(sync(&mut p, &mut s, "a", std::slice::from_ref(&fe)), 2);
    assert_eq!(
        source_ranges_of(&s.state, &fe),
        [
            "10.96.0.1:80/TCP from 192.0.2.0/24",
            "10.96.0.1:80/TCP from 203.0.113.0/24"
        ]
    );

    // Adopted after a restart: nothing to write, nothing left behind.
    let (mut adopted, garbage) = Planner::adopt(&s.state);
    assert!(garbage.is_empty(), "adoption garbage: {garbage:?}");
    assert_eq!(
        sync(&mut adopted, &mut s, "a", std::slice::from_ref(&fe)),
        0
    );

    // Firewall off: the flag goes first, then the ranges.
    fe.source_ranges.clear();
    sync(&mut adopted, &mut s, "a", std::slice::from_ref(&fe));
    let value = s.state.services[&encode::service_key(&fe.key)];
    assert_eq!(value.flags & service_flags::SOURCE_RANGES, 0);
    assert!(s.state.source_ranges.is_empty());

    // Removing a firewalled frontend removes its ranges.
    fe.source_ranges = vec![cidr("192.0.2.0/24")];
    sync(&mut adopted, &mut s, "a", std::slice::from_ref(&fe));
    sync(&mut adopted, &mut s, "a", &[]);
    assert!(s.state.source_ranges.is_empty() && s.state.services.is_empty());
}

#[test]
fn external_frontends_are_flagged_and_their_in_cluster_entries_are_not() {
    let mut p = Planner::new();
    let mut s = CheckingStore::default();
    let mut node_port = frontend(1, &[11]);
    node_port.kind = FrontendKind::NodePort;
    let mut internal = node_port.clone();
    internal.key.scope = Scope::Internal;
    let cluster_ip = frontend(2, &[11]);
    sync(&mut p, &mut s, "np", &[node_port.clone(), internal.clone()]);
    sync(&mut p, &mut s, "cip", std::slice::from_ref(&cluster_ip));
    let external = |fe: &Frontend| {
        s.state.services[&encode::service_key(&fe.key)].flags & service_flags::EXTERNAL != 0
    };
    assert!(external(&node_port), "a NodePort SNATs remote backends");
    assert!(
        !external(&internal),
        "in-cluster clients are not masqueraded"
    );
    assert!(!external(&cluster_ip));
}

/// Six Services of one frontend each, three backends each, one of them
/// (10.0.0.200) shared by all: its id is taken by the first and reused by
/// the others within one batch.
fn six_services() -> Vec<(ObjectKey, Vec<Frontend>)> {
    (1..=6u8)
        .map(|i| {
            (
                owner(&format!("svc{i}")),
                vec![frontend(i, &[10 + i, 20 + i, 200])],
            )
        })
        .collect()
}

/// Entries no frontend reaches: slots outside every service's `0..count`
/// of its slot set, backends no such slot names.
fn garbage(state: &StoredState) -> Vec<String> {
    let mut slots = BTreeSet::new();
    let mut backends = BTreeSet::new();
    for value in state.services.values() {
        for slot in 0..value.count {
            let key = BackendSlotKey {
                slot_set: value.slot_set,
                slot,
            };
            slots.insert(key);
            if let Some(id) = state.slots.get(&key) {
                backends.insert(*id);
            }
        }
    }
    let mut found: Vec<String> = state
        .slots
        .keys()
        .filter(|k| !slots.contains(k))
        .map(|k| format!("slot {}/{}", k.slot_set, k.slot))
        .collect();
    found.extend(
        state
            .backends
            .keys()
            .filter(|id| !backends.contains(id))
            .map(|id| format!("backend {id}")),
    );
    found
}

#[test]
fn a_batch_lands_what_frontend_by_frontend_writes_would() {
    let services = six_services();
    let mut one_by_one = Planner::new();
    let mut expected = CheckingStore::default();
    for (owner, fes) in &services {
        let out = one_by_one.sync_service(owner, fes, &mut expected);
        assert!(out.errors.is_empty(), "{:?}", out.errors);
    }

    let mut planner = Planner::new();
    let mut store = CheckingStore::default();
    let mut batch = Batch::default();
    let mut ops = 0;
    for (owner, fes) in &services {
        let out = planner.sync_service_batched(owner, fes, &mut store, &mut batch);
        assert!(out.errors.is_empty(), "{:?}", out.errors);
        ops += out.ops;
    }
    assert_eq!(batch.len(), 6, "every new frontend gathered");
    assert_eq!(
        store.state,
        StoredState::default(),
        "nothing written before the flush"
    );
    // The store checks after every write that no packet sees half a set:
    // all backends, then all slots, then the service entries.
    planner.flush(&mut batch, &mut store);
    assert!(batch.is_empty());
    let failures = batch.take_failures();
    assert!(failures.is_empty(), "{failures:?}");
    assert_eq!(
        store.state, expected.state,
        "the same entries, ids and all, as written frontend by frontend"
    );
    assert_eq!(ops, store.applied, "the outcomes counted every write");
}

#[test]
fn a_write_to_a_programmed_frontend_waits_for_the_batch() {
    let mut planner = Planner::new();
    let mut store = CheckingStore::default();
    sync(&mut planner, &mut store, "a", &[frontend(1, &[11])]);
    let mut batch = Batch::default();
    let b = frontend(2, &[12]);
    let out = planner.sync_service_batched(
        &owner("b"),
        std::slice::from_ref(&b),
        &mut store,
        &mut batch,
    );
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_eq!(batch.len(), 1, "b is new: gathered");
    // a grows by b's backend, whose id the batch took: its slot may only
    // be written once the backend is in the map (the store would panic).
    let grown = frontend(1, &[11, 12]);
    let out = planner.sync_service_batched(
        &owner("a"),
        std::slice::from_ref(&grown),
        &mut store,
        &mut batch,
    );
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert!(batch.is_empty(), "flushed before a was written");
    assert_eq!(
        stored_backends(&store.state, &grown).unwrap(),
        expected_backends(&grown)
    );
    assert_eq!(
        stored_backends(&store.state, &b).unwrap(),
        expected_backends(&b)
    );
}

proptest! {
    /// Whichever write of a batch fails, each frontend is either in the
    /// maps as desired or absent and reported; nothing is left that no
    /// frontend reaches; and the reported ones land when synced again.
    #[test]
    fn a_failed_batch_keeps_what_landed_and_forgets_the_rest(fail_at in 0usize..46) {
        let services = six_services();
        let mut planner = Planner::new();
        let mut store = CheckingStore { fail_at: Some(fail_at), ..Default::default() };
        let mut batch = Batch::default();
        for (owner, fes) in &services {
            planner.sync_service_batched(owner, fes, &mut store, &mut batch);
        }
        planner.flush(&mut batch, &mut store);
        // 6 names, 13 backends, 18 slots, 6 service entries: 43 writes.
        let failures = batch.take_failures();
        prop_assert_eq!(!failures.is_empty(), fail_at < 43, "{:?}", failures);
        let unwritten = reported(&failures)?;
        check_after_failed_batches(&services, &mut planner, &mut store, &unwritten)?;
    }
}

proptest! {
    /// A batch gathered while the one before is written (`Planner::start`)
    /// shares a backend with it (10.0.0.200, whose id the first batch
    /// took). When the first fails, the second is not written: its slots
    /// could name a backend that never landed (the store would panic at
    /// its service entry). Every frontend is in the maps or reported,
    /// nothing is left that no frontend reaches, and the reported ones land
    /// when synced again. Failures past the first batch's 22 writes fail
    /// the second batch as `flush` would.
    #[test]
    fn a_batch_gathered_while_a_failed_one_was_written_is_not_written(fail_at in 0usize..46) {
        let services = six_services();
        let mut planner = Planner::new();
        let mut store = CheckingStore { fail_at: Some(fail_at), ..Default::default() };
        let mut batch = Batch::default();
        for (owner, fes) in &services[..3] {
            planner.sync_service_batched(owner, fes, &mut store, &mut batch);
        }
        planner.start(&mut batch, &mut store);
        prop_assert!(batch.is_empty() && !batch.is_settled(), "the first batch is in flight");
        for (owner, fes) in &services[3..] {
            planner.sync_service_batched(owner, fes, &mut store, &mut batch);
        }
        prop_assert_eq!(batch.len(), 3, "the second gathered while the first is in flight");
        planner.flush(&mut batch, &mut store);
        prop_assert!(batch.is_settled());
        // First batch: 3 names, 7 backends, 9 slots, 3 service entries.
        let first_failed = fail_at < 22;
        let failures = batch.take_failures();
        // Second: 3 names, 6 backends (10.0.0.200 is in), 9 slots, 3
        // service entries.
        prop_assert_eq!(!failures.is_empty(), fail_at < 43, "{:?}", failures);
        let unwritten = reported(&failures)?;
        if first_failed {
            for (owner, fes) in &services[3..] {
                prop_assert!(
                    unwritten.contains(&(owner.clone(), fes[0].key)),
                    "{} of the second batch written after the first failed", owner
                );
            }
        }
        check_after_failed_batches(&services, &mut planner, &mut store, &unwritten)?;
    }
}

/// The frontends `failures` report, each a batch's failure of the injected
/// error.
fn reported(
    failures: &[Unwritten<Injected>],
) -> Result<BTreeSet<(ObjectKey, FrontendKey)>, TestCaseError> {
    let mut unwritten = BTreeSet::new();
    for failure in failures {
        let PlanError::Unwritten {
            frontend,
            owner,
            reason,
        } = &failure.error
        else {
            panic!("not a batch failure: {:?}", failure.error);
        };
        prop_assert!(reason.contains("injected failure"), "{}", reason);
        unwritten.insert((owner.clone(), *frontend));
    }
    Ok(unwritten)
}

/// After batches of `services` failed: each frontend is either in the maps
/// as desired or reported in `unwritten`; nothing is left that no frontend
/// reaches; and the reported ones land when synced again.
fn check_after_failed_batches(
    services: &[(ObjectKey, Vec<Frontend>)],
    planner: &mut Planner,
    store: &mut CheckingStore,
    unwritten: &BTreeSet<(ObjectKey, FrontendKey)>,
) -> Result<(), TestCaseError> {
    for (owner, fes) in services {
        let fe = &fes[0];
        match stored_backends(&store.state, fe) {
            Some(b) => {
                prop_assert_eq!(b, expected_backends(fe));
                prop_assert!(!unwritten.contains(&(owner.clone(), fe.key)));
            }
            None => prop_assert!(
                unwritten.contains(&(owner.clone(), fe.key)),
                "{} is neither in the maps nor reported",
                owner
            ),
        }
    }
    prop_assert_eq!(garbage(&store.state), Vec::<String>::new());
    prop_assert_eq!(planner.frontend_count(), services.len() - unwritten.len());

    for (owner, fes) in services {
        if unwritten.iter().any(|(o, _)| o == owner) {
            sync(planner, store, &owner.name, fes);
        }
    }
    for (_, fes) in services {
        prop_assert_eq!(
            stored_backends(&store.state, &fes[0]),
            Some(expected_backends(&fes[0]))
        );
    }
    prop_assert_eq!(garbage(&store.state), Vec::<String>::new());
    Ok(())
}

/// `SERVICE_NAMES` as "id namespace/name:port port", sorted by id.
fn names_of(state: &StoredState) -> Vec<String> {
    state
        .names
        .iter()
        .map(|(id, n)| format!("{id} {} {}", encode::service_name_string(n), n.port))
        .collect()
}

#[test]
fn a_service_id_is_named_while_a_frontend_holds_it() {
    let mut p = Planner::new();
    let mut s = CheckingStore::default();
    let mut http = frontend(1, &[11]);
    http.service = ServicePortName::new("shop", "web", "http", Protocol::Tcp);
    // The NodePort of the same port: its key has a port of its own.
    let mut node_port = http.clone();
    node_port.kind = FrontendKind::NodePort;
    node_port.key.ip = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
    node_port.key.port = 30080;
    let mut metrics = frontend(2, &[12]);
    metrics.service = ServicePortName::new("shop", "web", "metrics", Protocol::Tcp);
    metrics.key.port = 9090;
    metrics.service_port = 9090;
    {
        let (mut p, mut s) = (Planner::new(), CheckingStore::default());
        sync(&mut p, &mut s, "web", std::slice::from_ref(&node_port));
        assert_eq!(
            names_of(&s.state),
            ["1 shop/web:http 80"],
            "a port whose NodePort is planned alone is named by the Service port's number"
        );
    }
    sync(&mut p, &mut s, "web", &[http.clone(), node_port.clone()]);
    assert_eq!(names_of(&s.state), ["1 shop/web:http 80"]);
    sync(
        &mut p,
        &mut s,
        "web",
        &[node_port.clone(), http.clone(), metrics.clone()],
    );
    assert_eq!(
        names_of(&s.state),
        ["1 shop/web:http 80", "2 shop/web:metrics 9090"],
        "a second port gets an id and a name of its own"
    );
    sync(&mut p, &mut s, "web", std::slice::from_ref(&node_port));
    assert_eq!(
        names_of(&s.state),
        ["1 shop/web:http 80"],
        "the name of an id no frontend holds is gone, the other stays"
    );

    // Adopted: the name of a held id is kept and not written again; a
    // stray name (its id held by no frontend) is garbage.
    s.state
        .names
        .insert(7, encode::service_name(&metrics.service, 9090));
    let (mut adopted, garbage) = Planner::adopt(&s.state);
    assert_eq!(garbage, [MapOp::DeleteServiceName { id: 7 }]);
    adopted.collect_garbage(garbage, &mut s);
    assert_eq!(
        sync(
            &mut adopted,
            &mut s,
            "web",
            std::slice::from_ref(&node_port)
        ),
        0,
        "an adopted name that is right is not written again"
    );
    sync(&mut adopted, &mut s, "web", &[]);
    assert_eq!(
        names_of(&s.state),
        Vec::<String>::new(),
        "names left behind"
    );
}

#[test]
fn an_adopted_name_that_differs_is_written_again_before_its_frontend_changes() {
    let mut p = Planner::new();
    let mut s = CheckingStore::default();
    let fe = frontend(1, &[11]);
    sync(&mut p, &mut s, "svc1", std::slice::from_ref(&fe));
    // As an agent of another naming left it.
    let stale = ServicePortName::new("old", "svc", "", Protocol::Tcp);
    s.state.names.insert(1, encode::service_name(&stale, 80));
    let (mut adopted, garbage) = Planner::adopt(&s.state);
    assert!(garbage.is_empty(), "{garbage:?}");
    let grown = frontend(1, &[11, 12]);
    sync(&mut adopted, &mut s, "svc1", std::slice::from_ref(&grown));
    assert_eq!(names_of(&s.state), ["1 default/svc1: 80"]);
}

/// The service ids of the Services `svc1`.. as the maps name them.
fn ids_of(state: &StoredState) -> Vec<u32> {
    let mut ids: Vec<u32> = state.names.keys().copied().collect();
    ids.sort_unstable();
    ids
}

#[test]
fn service_ids_stay_below_the_counted_bound_while_one_is_free() {
    let mut p = Planner::new();
    p.count_ids_below(4);
    let mut s = CheckingStore::default();
    for vip in 1..=3 {
        sync(
            &mut p,
            &mut s,
            &format!("svc{vip}"),
            &[frontend(vip, &[11])],
        );
    }
    assert_eq!(
        ids_of(&s.state),
        [1, 2, 3],
        "ids 1 to 3 are below the bound"
    );
    sync(&mut p, &mut s, "svc4", &[frontend(4, &[11])]);
    assert_eq!(
        ids_of(&s.state),
        [1, 2, 3, 4],
        "with every id below the bound held, a port gets one past it"
    );
    sync(&mut p, &mut s, "svc2", &[]);
    sync(&mut p, &mut s, "svc4", &[]);
    sync(&mut p, &mut s, "svc5", &[frontend(5, &[11])]);
    assert_eq!(
        ids_of(&s.state),
        [1, 2, 3],
        "a freed id below the bound is taken again, round robin"
    );
    // Every id below the bound held, one past it; then one below freed:
    // the port past the bound does not keep the next one from it.
    sync(&mut p, &mut s, "svc6", &[frontend(6, &[11])]);
    sync(&mut p, &mut s, "svc1", &[]);
    sync(&mut p, &mut s, "svc7", &[frontend(7, &[11])]);
    let ids = ids_of(&s.state);
    assert!(
        ids.iter().filter(|id| **id < 4).count() == 3,
        "a freed id below the bound goes to the next port, though one past it is held: {ids:?}"
    );
}

fn maglev_config(algorithm: crate::maglev::LbAlgorithm) -> crate::maglev::LbConfig {
    crate::maglev::LbConfig {
        algorithm,
        table_size: 251,
        hash_seed: 7,
    }
}

fn external(vip: u8, backends: &[u8]) -> Frontend {
    Frontend {
        kind: FrontendKind::ExternalIp,
        ..frontend(vip, backends)
    }
}

/// The table a node should hold for `fe`: built from the backends' names.
fn expected_table(fe: &Frontend, lb: crate::maglev::LbConfig) -> Vec<String> {
    let named: Vec<_> = fe
        .backends
        .iter()
        .map(|b| (encode::backend_name(b), b.host_port()))
        .collect();
    crate::maglev::build(&named, lb.table_size, lb.hash_seed)
}

#[test]
fn maglev_frontends_hold_their_table_and_cluster_ips_stay_random() {
    use crate::maglev::LbAlgorithm;
    let lb = maglev_config(LbAlgorithm::Maglev);
    let mut p = Planner::new();
    p.balance_with(lb);
    let mut s = CheckingStore::default();
    let ext = external(1, &[11, 12, 13]);
    let cluster = frontend(2, &[11, 12, 13]);
    sync(&mut p, &mut s, "svc", &[ext.clone(), cluster.clone()]);

    let value = s.state.services[&encode::service_key(&ext.key)];
    assert_eq!(
        value.count, 251,
        "an external frontend's slots are its table"
    );
    assert_ne!(value.flags & service_flags::MAGLEV, 0, "flagged Maglev");
    assert_eq!(value.hash_seed, 7, "the seed goes to the datapath");
    assert_eq!(
        stored_backends(&s.state, &ext).unwrap(),
        expected_table(&ext, lb)
    );
    let value = s.state.services[&encode::service_key(&cluster.key)];
    assert_eq!(
        value.flags & service_flags::MAGLEV,
        0,
        "a ClusterIP is random"
    );
    assert_eq!(
        stored_backends(&s.state, &cluster).unwrap(),
        expected_backends(&cluster)
    );

    // The Service's annotation wins over the flag, both ways.
    let mut random = ext.clone();
    random.lb_algorithm = Some(LbAlgorithm::Random);
    sync(&mut p, &mut s, "svc", std::slice::from_ref(&random));
    assert_eq!(
        stored_backends(&s.state, &random).unwrap(),
        expected_backends(&random)
    );
    p.balance_with(maglev_config(LbAlgorithm::Random));
    let mut maglev = ext.clone();
    maglev.lb_algorithm = Some(LbAlgorithm::Maglev);
    sync(&mut p, &mut s, "svc", std::slice::from_ref(&maglev));
    assert_eq!(
        stored_backends(&s.state, &maglev).unwrap(),
        expected_table(&maglev, lb)
    );
}

#[test]
fn nodes_that_gave_backends_other_ids_hold_the_same_table() {
    let lb = maglev_config(crate::maglev::LbAlgorithm::Maglev);
    let fe = external(1, &[21, 22, 23, 24, 25]);
    let mut a = (Planner::new(), CheckingStore::default());
    a.0.balance_with(lb);
    sync(&mut a.0, &mut a.1, "svc", std::slice::from_ref(&fe));

    // Node b saw another Service first (other ids) and the endpoints in
    // another order.
    let mut b = (Planner::new(), CheckingStore::default());
    b.0.balance_with(lb);
    sync(&mut b.0, &mut b.1, "other", &[frontend(9, &[25, 23, 30])]);
    let mut reversed = fe.clone();
    reversed.backends.reverse();
    sync(&mut b.0, &mut b.1, "svc", std::slice::from_ref(&reversed));
    assert_ne!(
        a.1.state.backends.keys().collect::<BTreeSet<_>>(),
        b.1.state.backends.keys().collect::<BTreeSet<_>>(),
        "the nodes' ids differ"
    );
    assert_eq!(
        stored_backends(&a.1.state, &fe),
        stored_backends(&b.1.state, &fe)
    );

    // A restart adopts the table and, the set unchanged, writes nothing.
    let (mut adopted, garbage) = Planner::adopt(&a.1.state);
    adopted.balance_with(lb);
    assert!(garbage.is_empty(), "garbage after adoption: {garbage:?}");
    assert_eq!(
        sync(&mut adopted, &mut a.1, "svc", std::slice::from_ref(&fe)),
        0
    );
}

#[test]
fn a_backend_leaving_a_table_departs_once_and_the_table_is_swapped_whole() {
    let lb = maglev_config(crate::maglev::LbAlgorithm::Maglev);
    let mut p = Planner::new();
    p.balance_with(lb);
    let mut s = CheckingStore::default();
    let fe = external(1, &[11, 12, 13, 14]);
    sync(&mut p, &mut s, "svc", std::slice::from_ref(&fe));
    let before = s.state.services[&encode::service_key(&fe.key)].slot_set;
    p.take_departed();

    let fewer = external(1, &[11, 12, 14]);
    sync(&mut p, &mut s, "svc", std::slice::from_ref(&fewer));
    let value = s.state.services[&encode::service_key(&fe.key)];
    assert_ne!(value.slot_set, before, "a new table, flipped in one write");
    assert_eq!(
        stored_backends(&s.state, &fewer).unwrap(),
        expected_table(&fewer, lb)
    );
    let departed = p.take_departed();
    assert_eq!(departed.len(), 1, "13 departs once: {departed:?}");
    assert_eq!(
        departed[0].backend.map(|b| encode::backend_string(&b)),
        Some("10.0.0.13:8080".to_owned())
    );
    assert_eq!(
        s.state.slots.len(),
        251,
        "the old table's slots are deleted after the flip"
    );
}

/// A departure owed by a failed purge is still owed while its backend id is
/// out of its Service: a backend back under the same id (held meanwhile by
/// another Service) is not, one back under a new id is (its flows under
/// the old id are from before it left), without its address (the node's
/// sockets connected to it are live); another Service's backends and the
/// departures of other Services do not count.
#[test]
fn a_departure_is_still_owed_until_its_backend_id_rejoins_its_service() {
    let mut p = Planner::new();
    let mut s = CheckingStore::default();
    // 12 is also svc2's, so its id outlives its departure from svc1; 13 is
    // svc1's alone, so its id is freed.
    sync(&mut p, &mut s, "svc1", &[frontend(1, &[11, 12, 13])]);
    sync(&mut p, &mut s, "svc2", &[frontend(2, &[12, 14])]);
    p.take_departed();
    sync(&mut p, &mut s, "svc1", &[frontend(1, &[11])]);
    let departed = p.take_departed();
    let names = |departed: &[Departed]| -> Vec<String> {
        let mut names: Vec<String> = departed
            .iter()
            .filter_map(|d| d.backend.map(|b| encode::backend_string(&b)))
            .collect();
        names.sort();
        names
    };
    assert_eq!(names(&departed), ["10.0.0.12:8080", "10.0.0.13:8080"]);
    assert_eq!(
        names(&p.still_departed(departed.clone())),
        ["10.0.0.12:8080", "10.0.0.13:8080"],
        "both still out of svc1 (12 still in svc2 does not count)"
    );

    sync(&mut p, &mut s, "svc1", &[frontend(1, &[11, 12, 13])]);
    let rejoined = p.take_departed();
    assert!(rejoined.is_empty(), "nothing left: {rejoined:?}");
    let id_of = |s: &CheckingStore, name: &str| -> Vec<u32> {
        s.state
            .backends
            .iter()
            .filter(|(_, b)| encode::backend_string(b) == name)
            .map(|(id, _)| *id)
            .collect()
    };
    let departed_id = |name: &str| -> Vec<u32> {
        departed
            .iter()
            .filter(|d| {
                d.backend
                    .is_some_and(|b| encode::backend_string(&b) == name)
            })
            .map(|d| d.backend_id)
            .collect()
    };
    assert_eq!(id_of(&s, "10.0.0.12:8080"), departed_id("10.0.0.12:8080"));
    assert_ne!(
        id_of(&s, "10.0.0.13:8080"),
        departed_id("10.0.0.13:8080"),
        "13 came back under a new id"
    );
    let owed = p.still_departed(departed.clone());
    assert_eq!(
        owed.iter()
            .map(|d| (d.backend_id, d.backend))
            .collect::<Vec<_>>(),
        [(departed_id("10.0.0.13:8080")[0], None)],
        "12 back in svc1 under its own id is spared; 13's old id is still owed its flows, \
         but not its address (the sockets connected to it since are live)"
    );

    sync(&mut p, &mut s, "svc1", &[frontend(1, &[11, 13])]);
    let owed = p.still_departed(departed.clone());
    assert_eq!(
        (names(&owed), owed.len()),
        (vec!["10.0.0.12:8080".to_owned()], 2),
        "12 out again, with its address; 13's old id as before: {owed:?}"
    );
}

/// `AFFINITY` is read after a sync only for what it may hold: the entries of a
/// departed backend whose Service has affinity, and every entry of a service id
/// whose affinity went off, whose last frontend went, or which the map held at
/// the start with no frontend with affinity to take it up; a purge that failed is
/// asked for again.
#[test]
fn affinity_purges_follow_the_frontends_with_affinity() {
    let mut p = Planner::new();
    let mut s = CheckingStore::default();
    let purge = |p: &mut Planner| {
        let departed = p.take_departed();
        p.take_affinity_purge(&departed)
    };
    let purge_of = |dropped: Vec<u32>, departed: bool| AffinityPurge { dropped, departed };
    let sticky_id = |s: &CheckingStore| {
        s.state
            .services
            .values()
            .find(|v| v.flags & service_flags::AFFINITY != 0)
            .expect("the sticky frontend")
            .service_id
    };
    sync(&mut p, &mut s, "plain", &[frontend(1, &[1, 2])]);
    sync(&mut p, &mut s, "plain", &[frontend(1, &[2])]);
    assert_eq!(
        purge(&mut p),
        AffinityPurge::default(),
        "a backend left a Service without affinity"
    );
    let sticky = |backends: &[u8]| Frontend {
        affinity_timeout_s: Some(10_800),
        ..frontend(2, backends)
    };
    sync(&mut p, &mut s, "sticky", &[sticky(&[3])]);
    let id = sticky_id(&s);
    sync(&mut p, &mut s, "sticky", &[sticky(&[4])]);
    assert_eq!(
        purge(&mut p),
        purge_of(vec![], true),
        "a backend left a Service with affinity"
    );
    sync(&mut p, &mut s, "sticky", &[frontend(2, &[4])]);
    assert_eq!(
        purge(&mut p),
        purge_of(vec![id], false),
        "affinity turned off"
    );
    sync(&mut p, &mut s, "sticky", &[sticky(&[4])]);
    let id = sticky_id(&s);
    sync(&mut p, &mut s, "sticky", &[]);
    assert_eq!(
        purge(&mut p),
        purge_of(vec![id], false),
        "the sticky Service went: its id's entries go"
    );
    assert_eq!(purge(&mut p), AffinityPurge::default(), "asked for once");

    sync(&mut p, &mut s, "sticky", &[sticky(&[4])]);
    let id = sticky_id(&s);
    let (mut adopted, _) = Planner::adopt(&s.state);
    adopted.note_affinity_entries([id, 999]);
    let found = purge(&mut adopted);
    assert_eq!(
        found,
        purge_of(vec![999], false),
        "entries found at the start: only those of no frontend with affinity go"
    );
    adopted.retry_affinity_purge(&found);
    assert_eq!(
        purge(&mut adopted),
        purge_of(vec![999], false),
        "a failed purge, asked for again"
    );
    assert_eq!(purge(&mut adopted), AffinityPurge::default());
}
