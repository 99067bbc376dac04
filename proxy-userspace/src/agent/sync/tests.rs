//! The sync loop on maps that fail on demand, driven as the agent drives it:
//! events go in, and the clock jumps to each wakeup the loop asks for.

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr},
    sync::atomic::AtomicU64,
    time::{Duration, Instant},
};

use k8s_openapi::api::{core::v1::Node, core::v1::Service, discovery::v1::EndpointSlice};
use serde_json::{Value, json};

use super::service::program_service;
use super::*;
use crate::{
    model::{FrontendKey, Protocol, Scope},
    planner::{MapOp, StoredState, encode},
    retry::{RETRY_INITIAL, RETRY_MAX},
    source::Kind,
    source::Object,
};

#[derive(Debug, thiserror::Error)]
enum TestMapsError {
    #[error("{op}: injected failure")]
    Injected { op: String },
    #[error("{op}: BACKENDS is full ({capacity} entries)")]
    Full { op: String, capacity: usize },
}

/// The service maps, failing on demand: every write fails while `failing`,
/// and BACKENDS refuses a new key once it holds `backend_capacity`, as a
/// full kernel hash map does. Every operation that lands must leave the
/// maps consistent for a packet.
#[derive(Default)]
struct TestMaps {
    maps: StoredState,
    failing: bool,
    backend_capacity: Option<usize>,
    /// Calls of `apply_all`: one per map written at once.
    runs: usize,
}

impl MapStore for TestMaps {
    type Error = TestMapsError;

    fn apply_all(&mut self, ops: &[MapOp]) -> Result<(), (usize, TestMapsError)> {
        self.runs += 1;
        for (landed, op) in ops.iter().enumerate() {
            self.apply(op).map_err(|e| (landed, e))?;
        }
        Ok(())
    }

    fn apply(&mut self, op: &MapOp) -> Result<(), TestMapsError> {
        if self.failing {
            return Err(TestMapsError::Injected { op: op.to_string() });
        }
        if let (MapOp::PutBackend { id, .. }, Some(capacity)) = (op, self.backend_capacity)
            && !self.maps.backends.contains_key(id)
            && self.maps.backends.len() >= capacity
        {
            return Err(TestMapsError::Full {
                op: op.to_string(),
                capacity,
            });
        }
        let Ok(()) = self.maps.apply(op);
        if let Err(e) = self.maps.check_consistent() {
            panic!("after `{op}` a packet would see an inconsistent service: {e}");
        }
        if let Err(e) = self.maps.check_named(op) {
            panic!("after `{op}` status could not name a frontend: {e}");
        }
        Ok(())
    }
}

#[derive(Default)]
struct TestTarget {
    maps: TestMaps,
    departed: Vec<Departed>,
    /// The affinity purges asked for, and whether they fail.
    affinity: Vec<AffinityPurge>,
    purge_fails: bool,
}

impl SyncTarget for TestTarget {
    type Store = TestMaps;

    fn store(&mut self) -> &mut TestMaps {
        &mut self.maps
    }

    fn clean_departed(&mut self, departed: &[Departed], affinity: &AffinityPurge) -> bool {
        self.departed.extend_from_slice(departed);
        self.affinity.push(affinity.clone());
        !self.purge_fails
    }
}

const NODE: &str = "node-a";
const TIMEOUT: Duration = Duration::from_mins(1);

/// The loop and what it drives, on a clock of its own.
struct Agent {
    sync: SyncLoop,
    state: ClusterState,
    planner: Planner,
    target: TestTarget,
    health: Health,
    model: ModelConfig,
    now: Instant,
    /// When the loop ran.
    runs: Vec<Instant>,
}

impl Agent {
    /// An agent started on maps holding `pinned`.
    fn adopting(pinned: &StoredState) -> Agent {
        let (mut planner, garbage) = Planner::adopt(pinned);
        let mut target = TestTarget::default();
        target.maps.maps = pinned.clone();
        let outcome = planner.collect_garbage(garbage, &mut target.maps);
        assert_eq!(outcome.ops, 0, "the pinned maps hold no garbage");
        let now = Instant::now();
        let health = Health::new(TIMEOUT);
        Agent {
            sync: SyncLoop::new(Duration::from_millis(20), health.clone(), now),
            state: ClusterState::new(NODE),
            planner,
            target,
            health,
            model: ModelConfig::default(),
            now,
            runs: Vec::new(),
        }
    }

    fn fresh() -> Agent {
        let mut agent = Agent::adopting(&StoredState::default());
        agent.sync.interfaces_applied(agent.now);
        agent
    }

    fn event(&mut self, event: SourceEvent) {
        self.sync.on_event(&mut self.state, event, self.now);
    }

    /// Given every listing of [`cluster`], and a second to sync them.
    fn listed(mut self) -> Agent {
        for event in cluster() {
            self.event(event);
        }
        self.advance(Duration::from_secs(1));
        self
    }

    /// Lets `by` pass: the loop runs at each wakeup it asks for, as the
    /// agent's timer runs it.
    fn advance(&mut self, by: Duration) {
        let until = self.now + by;
        while let Some(wakeup) = self.sync.wakeup().filter(|w| *w <= until) {
            self.now = self.now.max(wakeup);
            self.sync.run(
                self.now,
                &self.state,
                &self.model,
                &mut self.planner,
                &mut self.target,
            );
            self.runs.push(self.now);
        }
        self.now = until;
    }

    fn healthy(&self) -> bool {
        self.health.status_at(self.now).healthy
    }

    /// The backend addresses a packet to `vip`:80 would be sent to; None
    /// when the maps have no such frontend.
    fn served(&self, vip: &str) -> Option<Vec<String>> {
        let maps = &self.target.maps.maps;
        let key = encode::service_key(&FrontendKey {
            ip: vip.parse().expect("an address"),
            port: 80,
            protocol: Protocol::Tcp,
            scope: Scope::Any,
        });
        let value = maps.services.get(&key)?;
        Some(
            (0..value.count)
                .map(|slot| {
                    let id = maps.slots[&proxy_common::BackendSlotKey {
                        slot_set: value.slot_set,
                        slot,
                    }];
                    let backend = maps.backends[&id];
                    let ip = Ipv4Addr::from(backend.addr_be[3].to_ne_bytes());
                    IpAddr::V4(ip).to_string()
                })
                .collect(),
        )
    }

    fn stat(&self, read: impl Fn(&SyncStats) -> &AtomicU64) -> u64 {
        read(&self.sync.stats()).load(Ordering::Relaxed)
    }
}

fn decode<T: serde::de::DeserializeOwned>(value: Value) -> T {
    serde_json::from_value(value).expect("a valid object")
}

fn service(name: &str, cluster_ip: &str) -> Object {
    Object::service(&decode::<Service>(json!({
        "metadata": {"name": name, "namespace": "demo"},
        "spec": {
            "type": "ClusterIP", "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
        },
    })))
}

/// A slice of `service` with ready endpoints at `ips`, each hinted for the
/// zone paired with it when given.
fn slice(name: &str, service: &str, ips: &[(&str, Option<&str>)]) -> Object {
    let endpoints: Vec<Value> = ips
        .iter()
        .map(|(ip, zone)| {
            let mut endpoint = json!({
                "addresses": [ip],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "nodeName": "node-b",
            });
            if let Some(zone) = zone {
                endpoint["hints"] = json!({"forZones": [{"name": zone}]});
            }
            endpoint
        })
        .collect();
    Object::slice(&decode::<EndpointSlice>(json!({
        "metadata": {
            "name": name, "namespace": "demo",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    })))
}

fn node(zone: &str) -> Object {
    Object::Node(Box::new(decode::<Node>(json!({
        "metadata": {"name": NODE, "labels": {"topology.kubernetes.io/zone": zone}},
    }))))
}

fn listing(kind: Kind, objects: Vec<Object>) -> SourceEvent {
    SourceEvent::Replace { kind, objects }
}

fn key(name: &str) -> ObjectKey {
    ObjectKey {
        namespace: "demo".into(),
        name: name.into(),
    }
}

fn plain(ips: &[&'static str]) -> Vec<(&'static str, Option<&'static str>)> {
    ips.iter().map(|ip| (*ip, None)).collect()
}

#[test]
fn a_failed_write_stays_pending_and_lands_on_the_loops_own_timer() {
    let mut agent = Agent::fresh();
    agent.event(listing(Kind::Service, vec![service("web", "10.96.0.10")]));
    agent.event(listing(
        Kind::EndpointSlice,
        vec![slice("web-1", "web", &plain(&["10.0.0.1", "10.0.0.2"]))],
    ));
    agent.event(listing(Kind::Node, vec![node("zone-a")]));
    agent.advance(Duration::from_secs(1));
    assert_eq!(
        agent.served("10.96.0.10"),
        Some(vec!["10.0.0.1".into(), "10.0.0.2".into()])
    );
    assert!(agent.healthy(), "programmed: healthy");

    agent.target.maps.failing = true;
    let queued = agent.now;
    agent.event(SourceEvent::Apply(service("api", "10.96.0.11")));
    agent.event(SourceEvent::Apply(slice(
        "api-1",
        "api",
        &plain(&["10.0.0.3"]),
    )));
    agent.advance(TIMEOUT.saturating_sub(Duration::from_millis(1)));
    let retries: Vec<Duration> = agent
        .runs
        .iter()
        .filter(|t| **t >= queued)
        .collect::<Vec<_>>()
        .windows(2)
        .map(|w| w[1].duration_since(*w[0]))
        .collect();
    assert_eq!(agent.served("10.96.0.11"), None, "every write fails");
    assert_eq!(
        agent.served("10.96.0.10").map(|b| b.len()),
        Some(2),
        "what was programmed stays"
    );
    assert!(
        retries.len() >= 10,
        "the loop retries by itself, with no event: {retries:?}"
    );
    assert_eq!(retries[0], RETRY_INITIAL, "first retry: {retries:?}");
    for pair in retries.windows(2) {
        assert_eq!(
            pair[1],
            (pair[0] * 2).min(RETRY_MAX),
            "the wait doubles up to {RETRY_MAX:?}: {retries:?}"
        );
    }
    let attempts = retries.len() as u64 + 1;
    assert_eq!(
        agent.stat(|s| &s.failed_writes),
        attempts,
        "one failed frontend write per attempt"
    );
    assert_eq!(agent.stat(|s| &s.pending), 1, "one frontend pending");
    assert!(
        agent.healthy(),
        "the change has waited less than the health timeout"
    );

    agent.advance(Duration::from_millis(1));
    assert!(
        !agent.healthy(),
        "a change unprogrammed for the health timeout makes /healthz 503"
    );

    agent.target.maps.failing = false;
    let cleared = agent.now;
    let failed = agent.stat(|s| &s.failed_writes);
    agent.advance(RETRY_MAX);
    assert_eq!(
        agent.served("10.96.0.11"),
        Some(vec!["10.0.0.3".into()]),
        "landed on the next retry, within {RETRY_MAX:?} of the failure clearing"
    );
    let landed = *agent.runs.last().expect("a run");
    assert!(landed > cleared && landed <= cleared + RETRY_MAX);
    assert!(agent.healthy(), "everything programmed: 200 again");
    assert_eq!(agent.stat(|s| &s.pending), 0);
    assert_eq!(
        agent.stat(|s| &s.failed_writes),
        failed,
        "no failure counted after the failure cleared"
    );
    let runs = agent.runs.len();
    agent.advance(Duration::from_mins(10));
    assert_eq!(
        agent.runs.len(),
        runs,
        "nothing left to retry: the loop sleeps"
    );
}

#[test]
fn a_service_refused_by_a_full_backends_map_lands_once_another_leaves() {
    let mut agent = Agent::fresh();
    agent.target.maps.backend_capacity = Some(3);
    agent.event(listing(
        Kind::Service,
        vec![service("one", "10.96.0.1"), service("two", "10.96.0.2")],
    ));
    agent.event(listing(
        Kind::EndpointSlice,
        vec![
            slice("one-1", "one", &plain(&["10.0.0.1", "10.0.0.2"])),
            slice("two-1", "two", &plain(&["10.0.0.3", "10.0.0.4"])),
        ],
    ));
    agent.event(listing(Kind::Node, vec![node("zone-a")]));
    agent.advance(Duration::from_secs(10));
    assert_eq!(agent.served("10.96.0.1").map(|b| b.len()), Some(2));
    assert_eq!(agent.served("10.96.0.2"), None, "BACKENDS is full");
    assert_eq!(
        agent.stat(|s| &s.pending),
        1,
        "two's frontend waits for its retry"
    );
    let failed = agent.stat(|s| &s.failed_writes);
    assert!(failed >= 2, "retried while full: {failed} failed writes");
    assert!(!agent.healthy(), "the first sync never fully landed: 503");

    agent.event(SourceEvent::Delete {
        kind: Kind::Service,
        key: key("one"),
    });
    agent.advance(RETRY_MAX);
    assert_eq!(agent.served("10.96.0.1"), None, "removed");
    assert_eq!(
        agent.served("10.96.0.2"),
        Some(vec!["10.0.0.3".into(), "10.0.0.4".into()]),
        "the retry lands in the room the removal made (no event touched it)"
    );
    assert_eq!(agent.stat(|s| &s.pending), 0, "nothing left pending");
    assert!(agent.healthy(), "everything programmed: 200");
}

/// Two Services, one with topology hints, which read differently with and
/// without the Node's zone.
fn cluster() -> [SourceEvent; 3] {
    [
        listing(
            Kind::Service,
            vec![service("web", "10.96.0.10"), service("zoned", "10.96.0.20")],
        ),
        listing(
            Kind::EndpointSlice,
            vec![
                slice("web-1", "web", &plain(&["10.0.0.1", "10.0.0.2"])),
                slice(
                    "zoned-1",
                    "zoned",
                    &[
                        ("10.0.1.1", Some("zone-a")),
                        ("10.0.1.2", Some("zone-b")),
                        ("10.0.1.3", Some("zone-a")),
                    ],
                ),
            ],
        ),
        listing(Kind::Node, vec![node("zone-a")]),
    ]
}

#[test]
fn a_restart_makes_no_write_whichever_listing_comes_first() {
    let mut first = Agent::fresh();
    for event in cluster() {
        first.event(event);
        first.advance(Duration::from_secs(1));
    }
    let pinned = first.target.maps.maps.clone();
    assert_eq!(
        first.served("10.96.0.20"),
        Some(vec!["10.0.1.1".into(), "10.0.1.3".into()]),
        "this node's zone's endpoints"
    );
    assert_eq!(first.served("10.96.0.10").map(|b| b.len()), Some(2));

    let orders = [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ];
    for order in orders {
        let mut agent = Agent::adopting(&pinned);
        let mut events: Vec<Option<SourceEvent>> = cluster().into_iter().map(Some).collect();
        for i in order {
            agent.event(events[i].take().expect("each listing once"));
            agent.advance(Duration::from_secs(1));
            assert!(
                agent.target.maps.maps == pinned,
                "lists in order {order:?}: the maps changed after listing {i} (Services 0, \
                 EndpointSlices 1, Node 2); web serves {:?}, zoned {:?}",
                agent.served("10.96.0.10"),
                agent.served("10.96.0.20")
            );
        }
        agent.sync.interfaces_applied(agent.now);
        assert_eq!(
            agent.stat(|s| &s.map_ops),
            0,
            "lists in order {order:?}: a restart on the same state writes nothing"
        );
        assert_eq!(agent.runs.len(), 1, "one sync, once every list is in");
        assert!(agent.target.departed.is_empty(), "no backend departed");
        assert!(agent.healthy(), "lists in order {order:?}: healthy");
    }
}

#[test]
fn without_a_node_listing_the_first_sync_waits_a_bounded_time() {
    let mut agent = Agent::fresh();
    let [services, slices, _] = cluster();
    agent.event(services);
    agent.event(slices);
    agent.advance(NODE_LISTING_WAIT.saturating_sub(Duration::from_millis(1)));
    assert!(agent.runs.is_empty(), "waiting for the Node listing");
    assert!(!agent.healthy());
    agent.advance(Duration::from_millis(1));
    assert_eq!(
        agent.runs.len(),
        1,
        "synced without it once the wait is over"
    );
    assert_eq!(
        agent.served("10.96.0.20").map(|b| b.len()),
        Some(3),
        "no zone known: every endpoint"
    );
    assert!(agent.healthy());
}

// The steps of a sync, one at a time.

fn state_with(objects: Vec<Object>) -> ClusterState {
    let mut state = ClusterState::new(NODE);
    for object in objects {
        state.apply(SourceEvent::Apply(object));
    }
    state
}

fn object_service(name: &str, spec: &Value) -> Object {
    Object::service(&decode::<Service>(json!({
        "metadata": {"name": name, "namespace": "demo"},
        "spec": spec,
    })))
}

#[test]
fn due_services_are_the_dirty_ones_and_the_retries_that_are_due() {
    let mut agent = Agent::fresh();
    let now = agent.now;
    agent.sync.dirty.insert(key("edited"));
    agent.sync.deadline = Some(now);
    agent.sync.retries.failed(&key("failed-once"), now, 1);
    agent.sync.retries.failed(&key("failed-twice"), now, 1);
    agent.sync.retries.failed(&key("failed-twice"), now, 1);
    let due = agent.sync.due_services(now + RETRY_INITIAL);
    assert_eq!(
        due,
        BTreeSet::from([key("edited"), key("failed-once")]),
        "at {RETRY_INITIAL:?}: the dirty Service and the first retry, not the backed-off one"
    );
    assert!(agent.sync.dirty.is_empty(), "taken: {:?}", agent.sync.dirty);
    assert_eq!(agent.sync.deadline, None, "the coalescing window closed");
    assert_eq!(
        agent.sync.due_services(now + backoff(2)),
        BTreeSet::from([key("failed-once"), key("failed-twice")]),
        "a retry stays due until its Service is settled"
    );
}

/// `web`; `twin`, on web's ClusterIP; `bogus`, whose ClusterIP is invalid.
fn web_twin_and_bogus() -> ClusterState {
    state_with(vec![
        service("web", "10.96.0.10"),
        slice("web-1", "web", &plain(&["10.0.0.1"])),
        service("twin", "10.96.0.10"),
        slice("twin-1", "twin", &plain(&["10.0.0.2"])),
        service("bogus", "10.96.0.999"),
    ])
}

#[test]
fn program_service_tells_invalid_objects_from_failed_writes_and_conflicts() {
    let state = web_twin_and_bogus();
    let model = ModelConfig::default();
    let mut planner = Planner::new();
    let mut maps = TestMaps::default();

    let invalid = program_service(&key("bogus"), &state, &model, &mut planner, &mut maps, None);
    assert!(
        matches!(invalid, ServiceOutcome::Invalid),
        "an unparsable clusterIP: {invalid:?}"
    );
    assert_eq!((invalid.failed(), invalid.write_failures()), (1, 0));

    maps.failing = true;
    let failed = program_service(&key("web"), &state, &model, &mut planner, &mut maps, None);
    assert_eq!(
        (failed.failed(), failed.write_failures()),
        (1, 1),
        "one frontend, its write failed: {failed:?}"
    );
    assert_eq!(maps.maps, StoredState::default(), "nothing landed");

    maps.failing = false;
    let landed = program_service(&key("web"), &state, &model, &mut planner, &mut maps, None);
    let ServiceOutcome::Planned { desired, planned } = &landed else {
        panic!("web is valid: {landed:?}");
    };
    assert_eq!(desired.len(), 1, "one ClusterIP frontend: {desired:?}");
    assert!(planned.errors.is_empty(), "{:?}", planned.errors);
    assert!(planned.ops > 0, "written");

    let conflict = program_service(&key("twin"), &state, &model, &mut planner, &mut maps, None);
    assert_eq!(
        (conflict.failed(), conflict.write_failures()),
        (1, 0),
        "a frontend another Service holds is the objects' doing, no write to retry: {conflict:?}"
    );
}

#[test]
fn settling_a_service_retries_failed_writes_only() {
    let state = web_twin_and_bogus();
    let mut agent = Agent::fresh();
    let now = agent.now;
    let program = |agent: &mut Agent, name: &str| {
        let outcome = program_service(
            &key(name),
            &state,
            &agent.model,
            &mut agent.planner,
            &mut agent.target.maps,
            None,
        );
        agent.sync.settle_service(&key(name), &outcome, &state, now);
    };
    agent.target.maps.failing = true;
    for attempt in 1..=2 {
        program(&mut agent, "web");
        assert_eq!(
            agent.sync.retries.next_due(),
            Some(now + backoff(attempt)),
            "failed write number {attempt}: retried after the backoff"
        );
    }
    assert_eq!(agent.sync.retries.pending_frontends(), 1);

    agent.target.maps.failing = false;
    program(&mut agent, "web");
    assert!(agent.sync.retries.is_empty(), "landed: nothing to retry");

    agent.sync.retries.failed(&key("bogus"), now, 1);
    program(&mut agent, "bogus");
    assert!(
        agent.sync.retries.is_empty(),
        "objects gone invalid are not retried: they must change first"
    );
}

#[test]
fn health_checks_are_handed_on_when_they_change() {
    let load_balancer = |node_port: u32| {
        object_service(
            "lb",
            &json!({
                "type": "LoadBalancer", "clusterIP": "10.96.0.40", "clusterIPs": ["10.96.0.40"],
                "externalTrafficPolicy": "Local", "healthCheckNodePort": node_port,
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080, "nodePort": 30080}],
            }),
        )
    };
    let model = ModelConfig::default();
    let mut checks = HealthChecks::default();
    let mut state = state_with(vec![load_balancer(30500)]);
    checks.refresh(&state, &key("lb"), &model);
    let ports = |checks: Option<Vec<HealthCheck>>| {
        checks.map(|c| c.iter().map(|c| c.node_port).collect::<Vec<_>>())
    };
    assert_eq!(ports(checks.take_changed()), Some(vec![30500]));
    checks.refresh(&state, &key("lb"), &model);
    assert_eq!(
        ports(checks.take_changed()),
        None,
        "unchanged: nothing to do"
    );

    state.apply(SourceEvent::Apply(load_balancer(70000)));
    checks.refresh(&state, &key("lb"), &model);
    assert_eq!(
        ports(checks.take_changed()),
        None,
        "an out-of-range port leaves the check as it was"
    );

    state.apply(SourceEvent::Delete {
        kind: Kind::Service,
        key: key("lb"),
    });
    checks.refresh(&state, &key("lb"), &model);
    assert_eq!(
        ports(checks.take_changed()),
        Some(vec![]),
        "the Service left: its port closes"
    );
}

/// Maps a first agent programmed with `web`, for another agent to adopt.
fn pinned_web() -> StoredState {
    let first = Agent::fresh().listed();
    assert_eq!(first.served("10.96.0.10").map(|b| b.len()), Some(2));
    first.target.maps.maps.clone()
}

#[test]
fn the_sweep_removes_unclaimed_frontends_and_retries_until_it_lands() {
    let mut agent = Agent::adopting(&pinned_web());
    let now = agent.now;
    agent.target.maps.failing = true;
    let swept = agent
        .sync
        .sweeper
        .run(now, true, &mut agent.planner, &mut agent.target.maps);
    assert_eq!(
        swept.failures, 2,
        "both frontends' removals failed: {swept:?}"
    );
    assert!(agent.sync.sweeper.unclaimed_left());
    assert_eq!(agent.sync.sweeper.wakeup(), Some(now + RETRY_INITIAL));

    agent.target.maps.failing = false;
    let early = agent.sync.sweeper.run(
        now + RETRY_INITIAL / 2,
        false,
        &mut agent.planner,
        &mut agent.target.maps,
    );
    assert_eq!(early, Swept::default(), "not due yet: nothing done");
    assert!(agent.served("10.96.0.10").is_some());

    let due = agent.sync.sweeper.run(
        now + RETRY_INITIAL,
        false,
        &mut agent.planner,
        &mut agent.target.maps,
    );
    assert_eq!((due.frontends_changed, due.failures), (2, 0), "{due:?}");
    assert_eq!(agent.served("10.96.0.10"), None, "removed on the retry");
    assert_eq!(
        agent.target.maps.maps,
        StoredState::default(),
        "nothing left"
    );
    assert!(!agent.sync.sweeper.unclaimed_left());
    assert_eq!(agent.sync.sweeper.wakeup(), None, "done: no timer");
}

#[test]
fn follow_ups_hand_departed_backends_to_the_target_once() {
    let mut agent = Agent::fresh().listed();
    assert!(agent.target.departed.is_empty(), "nothing departed yet");

    agent.event(SourceEvent::Apply(slice(
        "web-1",
        "web",
        &plain(&["10.0.0.1"]),
    )));
    let wakeup = agent.sync.wakeup().expect("a sync due");
    let follow_ups = agent.sync.run(
        wakeup,
        &agent.state,
        &agent.model,
        &mut agent.planner,
        &mut agent.target,
    );
    assert_eq!(
        follow_ups,
        FollowUps {
            departed: 1,
            health_checks: None
        }
    );
    let gone: Vec<String> = agent
        .target
        .departed
        .iter()
        .filter_map(|d| d.backend)
        .map(|b| Ipv4Addr::from(b.addr_be[3].to_ne_bytes()).to_string())
        .collect();
    assert_eq!(gone, ["10.0.0.2"], "the backend that left web");

    let again = agent
        .sync
        .follow_ups(agent.now, &mut agent.planner, &mut agent.target);
    assert_eq!(again.departed, 0, "handed on once");
    assert_eq!(agent.target.departed.len(), 1);
}

/// The backend addresses of `departed`.
fn addresses(departed: &[Departed]) -> BTreeSet<String> {
    departed
        .iter()
        .filter_map(|d| d.backend)
        .map(|b| Ipv4Addr::from(b.addr_be[3].to_ne_bytes()).to_string())
        .collect()
}

/// A purge of departed backends that failed is owed: tried again on the
/// loop's own timer, backed off as a failed write is, with no event to
/// wake the loop, until it lands; a backend that rejoined its Service
/// under the same backend id meanwhile (another Service held the id) is
/// left out of it, its flows under that id live again.
#[test]
fn a_failed_departed_purge_is_retried_on_the_loops_timer_sparing_a_rejoined_backend() {
    let mut agent = Agent::fresh();
    agent.event(listing(
        Kind::Service,
        vec![service("web", "10.96.0.10"), service("api", "10.96.0.11")],
    ));
    agent.event(listing(
        Kind::EndpointSlice,
        vec![
            slice(
                "web-1",
                "web",
                &plain(&["10.0.0.1", "10.0.0.2", "10.0.0.3"]),
            ),
            slice("api-1", "api", &plain(&["10.0.0.2"])),
        ],
    ));
    agent.event(listing(Kind::Node, vec![node("zone-a")]));
    agent.advance(Duration::from_secs(1));
    assert_eq!(agent.sync.wakeup(), None, "programmed: nothing due");

    agent.target.purge_fails = true;
    agent.event(SourceEvent::Apply(slice(
        "web-1",
        "web",
        &plain(&["10.0.0.1"]),
    )));
    let synced = agent.sync.wakeup().expect("the change is due");
    agent.advance(Duration::from_millis(50));
    assert_eq!(
        addresses(&agent.target.departed),
        BTreeSet::from(["10.0.0.2".into(), "10.0.0.3".into()]),
        "the two that left are handed to the purge, which fails"
    );
    assert_eq!(agent.sync.purges.owed(), 2);
    let gauge = agent.sync.stats();
    assert_eq!(
        gauge.departures_owed.load(Ordering::Relaxed),
        2,
        "ebpf_proxy_departed_purges_pending"
    );
    assert_eq!(
        agent.sync.wakeup(),
        Some(synced + RETRY_INITIAL),
        "the failed purge is due again on the loop's timer"
    );

    // 10.0.0.2 comes back before the retry, under the id api kept for it;
    // the sync that programs it purges nothing (the owed purge is not due
    // yet).
    agent.event(SourceEvent::Apply(slice(
        "web-1",
        "web",
        &plain(&["10.0.0.1", "10.0.0.2"]),
    )));
    agent.target.departed.clear();
    agent.advance(Duration::from_millis(20));
    assert_eq!(
        agent.served("10.96.0.10"),
        Some(vec!["10.0.0.1".into(), "10.0.0.2".into()])
    );
    assert!(agent.target.departed.is_empty(), "not due: nothing handed");

    // Due, still failing: only 10.0.0.3 is purged again, then backed off.
    agent.advance(synced + RETRY_INITIAL - agent.now);
    assert_eq!(
        (
            addresses(&agent.target.departed),
            agent.target.departed.len()
        ),
        (BTreeSet::from(["10.0.0.3".into()]), 1),
        "the retry spares 10.0.0.2, back in web: {:?}",
        agent.target.departed
    );
    assert_eq!(
        agent.sync.wakeup(),
        Some(agent.now + RETRY_INITIAL * 2),
        "the second failure backs off"
    );

    agent.target.purge_fails = false;
    agent.target.departed.clear();
    agent.advance(RETRY_INITIAL * 2);
    assert_eq!(
        addresses(&agent.target.departed),
        BTreeSet::from(["10.0.0.3".into()]),
        "handed once more, and it lands"
    );
    assert_eq!(agent.sync.purges.owed(), 0);
    assert_eq!(gauge.departures_owed.load(Ordering::Relaxed), 0);
    assert_eq!(agent.sync.wakeup(), None, "landed: no timer");
    agent.target.departed.clear();
    agent.advance(Duration::from_secs(10));
    assert!(agent.target.departed.is_empty(), "never handed again");
}

/// A Service whose session affinity goes off loses its `AFFINITY` entries at
/// the end of that sync (kube-proxy's `recent` lists go with their rules), and a
/// purge that failed is asked for again at the next sync; a backend leaving a
/// Service without affinity asks for no pass over the map.
#[test]
fn affinity_turned_off_purges_its_entries_and_a_failed_purge_is_retried() {
    let mut agent = Agent::fresh().listed();
    let sticky = |on: bool| {
        let mut svc = decode::<Service>(json!({
            "metadata": {"name": "web", "namespace": "demo"},
            "spec": {
                "type": "ClusterIP", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
            },
        }));
        if on {
            svc.spec.as_mut().expect("a spec").session_affinity = Some("ClientIP".into());
        }
        SourceEvent::Apply(Object::service(&svc))
    };
    let service_id = |agent: &Agent| {
        let key = encode::service_key(&FrontendKey {
            ip: "10.96.0.10".parse().expect("an address"),
            port: 80,
            protocol: Protocol::Tcp,
            scope: Scope::Any,
        });
        agent.target.maps.maps.services[&key].service_id
    };
    let last = |agent: &Agent| agent.target.affinity.last().cloned().unwrap_or_default();

    agent.event(SourceEvent::Apply(slice(
        "web-1",
        "web",
        &plain(&["10.0.0.1"]),
    )));
    agent.advance(Duration::from_secs(1));
    assert_eq!(
        last(&agent),
        AffinityPurge::default(),
        "a backend left a Service without affinity: no pass over AFFINITY"
    );
    agent.event(sticky(true));
    agent.advance(Duration::from_secs(1));
    let id = service_id(&agent);
    agent.event(SourceEvent::Apply(slice(
        "web-1",
        "web",
        &plain(&["10.0.0.2"]),
    )));
    agent.advance(Duration::from_secs(1));
    assert_eq!(
        last(&agent),
        AffinityPurge {
            dropped: vec![],
            departed: true
        },
        "a backend left a Service with affinity"
    );

    agent.target.purge_fails = true;
    agent.event(sticky(false));
    agent.advance(Duration::from_secs(1));
    assert_eq!(service_id(&agent), id, "the Service port kept its id");
    assert_eq!(
        last(&agent),
        AffinityPurge {
            dropped: vec![id],
            departed: false
        },
        "affinity turned off: its entries go"
    );
    agent.target.purge_fails = false;
    agent.event(SourceEvent::Apply(slice(
        "zoned-1",
        "zoned",
        &[("10.0.1.1", Some("zone-a"))],
    )));
    agent.advance(Duration::from_secs(1));
    assert_eq!(
        last(&agent),
        AffinityPurge {
            dropped: vec![id],
            departed: false
        },
        "the failed purge, asked for again at the next sync"
    );
    let asked = agent.target.affinity.len();
    agent.event(SourceEvent::Apply(slice(
        "zoned-1",
        "zoned",
        &[("10.0.1.2", Some("zone-b"))],
    )));
    agent.advance(Duration::from_secs(1));
    assert_eq!(agent.target.affinity.len(), asked + 1);
    assert_eq!(
        last(&agent),
        AffinityPurge::default(),
        "a purge that landed is not asked for again"
    );
}

#[test]
fn readiness_waits_for_the_interfaces_and_for_every_write() {
    let mut agent = Agent::adopting(&StoredState::default()).listed();
    assert_eq!(agent.served("10.96.0.10").map(|b| b.len()), Some(2));
    assert!(!agent.healthy(), "synced, but attached to no interface yet");
    let status = agent.health.status_at(agent.now);
    assert!(
        !status.started && !status.alive,
        "/readyz and /livez 503 until attached"
    );
    agent.sync.interfaces_applied(agent.now);
    assert!(agent.healthy(), "synced and attached");

    let mut agent = Agent::fresh();
    agent.target.maps.failing = true;
    let agent = agent.listed();
    assert!(agent.sync.serving(), "the first sync ran");
    agent.sync.mark_readiness(agent.now);
    assert!(!agent.healthy(), "writes pending: never marked programmed");
    let later = agent.now + TIMEOUT * 3;
    let status = agent.health.status_at(later);
    assert!(
        status.started && status.alive && !status.healthy,
        "writes left failing, retried by the loop: /readyz and /livez 200, /healthz 503: {status:?}"
    );
}

#[test]
fn the_first_sync_waits_for_the_listings() {
    use first_sync::{FirstSync, Gate};
    let start = Instant::now();
    let mut first = FirstSync::new(start);
    assert_eq!(first.gate(), Gate::Closed);
    assert!(first.listed(Kind::EndpointSlice), "a first listing");
    assert!(!first.listed(Kind::EndpointSlice), "listed again");
    assert!(
        !first.listed(Kind::ServiceCidr),
        "the service CIDRs are not waited for"
    );
    assert_eq!(first.gate(), Gate::Closed, "Services not listed");
    assert!(first.listed(Kind::Service));
    let gate = first.gate();
    assert_eq!(
        gate,
        Gate::At(start + NODE_LISTING_WAIT),
        "the Node is waited for"
    );
    assert!(!gate.open_at(start + NODE_LISTING_WAIT.saturating_sub(Duration::from_millis(1))));
    assert!(gate.open_at(start + NODE_LISTING_WAIT));
    assert!(first.listed(Kind::Node));
    assert_eq!(first.gate(), Gate::Open, "every listing in");
    first.finish();
    assert!(first.done());
    assert!(
        !first.listed(Kind::Node),
        "after the first sync a listing starts nothing by itself"
    );
}

/// Three listings in, the service CIDRs one of them: Services are still
/// missing, so the first sync still waits (it would diff against a cluster
/// without Services).
#[test]
fn the_service_cidrs_listing_opens_no_gate() {
    use first_sync::{FirstSync, Gate};
    let mut first = FirstSync::new(Instant::now());
    for kind in [Kind::EndpointSlice, Kind::ServiceCidr, Kind::Node] {
        first.listed(kind);
    }
    assert_eq!(first.gate(), Gate::Closed, "Services not listed");
    assert!(first.listed(Kind::Service));
    assert_eq!(first.gate(), Gate::Open);
}

#[test]
fn the_first_sync_writes_new_frontends_a_map_at_a_time() {
    let mut agent = Agent::fresh();
    let names: Vec<String> = (1..=50).map(|i| format!("svc{i}")).collect();
    let ips: Vec<String> = (1..=50).map(|i| format!("10.0.2.{i}")).collect();
    agent.event(listing(
        Kind::Service,
        (1..=50)
            .map(|i| service(&names[i - 1], &format!("10.96.1.{i}")))
            .collect(),
    ));
    agent.event(listing(
        Kind::EndpointSlice,
        (1..=50)
            .map(|i| {
                slice(
                    &format!("{}-1", names[i - 1]),
                    &names[i - 1],
                    &[(ips[i - 1].as_str(), None), ("10.0.3.1", None)],
                )
            })
            .collect(),
    ));
    agent.event(listing(Kind::Node, vec![node("zone-a")]));
    agent.advance(Duration::from_secs(1));
    for i in 1..=50 {
        let mut expected = vec![ips[i - 1].clone(), "10.0.3.1".to_owned()];
        expected.sort();
        let mut served = agent
            .served(&format!("10.96.1.{i}"))
            .unwrap_or_else(|| panic!("svc{i} is not programmed"));
        served.sort();
        assert_eq!(served, expected, "svc{i}");
    }
    assert!(agent.healthy(), "programmed: healthy");
    assert_eq!(
        agent.target.maps.runs, 4,
        "50 frontends' 251 entries in four writes (service names, backends, slots, service \
         entries), not four per frontend"
    );
}

/// `web`'s slice with ready endpoints at `ips`.
fn web_at(ips: &[&str]) -> SourceEvent {
    let ips: Vec<(&str, Option<&str>)> = ips.iter().map(|ip| (*ip, None)).collect();
    SourceEvent::Apply(slice("web-1", "web", &ips))
}

const MIN_SYNC_PERIOD: Duration = Duration::from_millis(20);

#[test]
fn an_isolated_change_is_synced_at_once() {
    let mut agent = Agent::fresh().listed();
    assert_eq!(agent.sync.wakeup(), None, "nothing queued once listed");
    let synced = agent.runs.len();
    let at = agent.now;
    agent.event(web_at(&["10.0.0.1", "10.0.0.3"]));
    assert_eq!(
        agent.sync.wakeup(),
        Some(at),
        "the last sync was long ago: no window to wait for"
    );
    agent.advance(Duration::ZERO);
    assert_eq!(agent.runs[synced..], [at], "one sync, when the event came");
    assert_eq!(
        agent.served("10.96.0.10"),
        Some(vec!["10.0.0.1".into(), "10.0.0.3".into()])
    );
}

#[test]
fn a_change_within_the_period_waits_until_the_period_after_the_last_sync() {
    let mut agent = Agent::fresh().listed();
    let synced = agent.runs.len();
    let first = agent.now;
    agent.event(web_at(&["10.0.0.1", "10.0.0.3"]));
    agent.advance(Duration::from_millis(5));
    agent.event(web_at(&["10.0.0.4"]));
    assert_eq!(
        agent.sync.wakeup(),
        Some(first + MIN_SYNC_PERIOD),
        "5 ms after a sync: due once the period since it is over"
    );
    agent.advance(Duration::from_millis(10));
    assert_eq!(agent.runs.len(), synced + 1, "still waiting 15 ms after");
    assert_eq!(agent.served("10.96.0.10").map(|b| b.len()), Some(2));
    agent.advance(Duration::from_millis(10));
    assert_eq!(
        agent.runs[synced..],
        [first, first + MIN_SYNC_PERIOD],
        "the second change synced at the end of the period"
    );
    assert_eq!(agent.served("10.96.0.10"), Some(vec!["10.0.0.4".into()]));

    // Long after the last sync, the next change goes at once again.
    agent.advance(Duration::from_millis(100));
    let at = agent.now;
    agent.event(web_at(&["10.0.0.5"]));
    agent.advance(Duration::ZERO);
    assert_eq!(agent.runs.last(), Some(&at), "synced when it came");
}

#[test]
fn a_burst_of_a_thousand_changes_takes_a_few_syncs() {
    let mut agent = Agent::fresh().listed();
    let synced = agent.runs.len();
    let started = agent.now;
    // 1,000 changes of one Service's endpoints, one every 50 µs: 50 ms.
    let mut last = String::new();
    for i in 0..1000 {
        last = format!("10.0.{}.{}", i / 250, i % 250 + 1);
        agent.event(web_at(&[&last]));
        agent.advance(Duration::from_micros(50));
    }
    agent.advance(Duration::from_secs(1));
    let runs: Vec<Duration> = agent.runs[synced..]
        .iter()
        .map(|at| at.duration_since(started))
        .collect();
    assert_eq!(
        runs,
        [0, 20, 40, 60].map(Duration::from_millis),
        "at the burst's start, then once every 20 ms while it lasts"
    );
    assert_eq!(
        agent.served("10.96.0.10"),
        Some(vec![last]),
        "the last change is in"
    );
    assert_eq!(agent.stat(|s| &s.syncs), runs.len() as u64 + 1);
}

/// `namespace/name` at `cluster_ip` with `external_ips`, port 80/TCP,
/// created `created` seconds into 2024.
fn claiming(
    namespace: &str,
    name: &str,
    cluster_ip: &str,
    external_ips: &[&str],
    created: u32,
) -> Object {
    Object::service(&decode::<Service>(json!({
        "metadata": {
            "name": name, "namespace": namespace,
            "creationTimestamp": format!("2024-01-01T00:00:{created:02}Z"),
        },
        "spec": {
            "type": "ClusterIP", "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
            "externalIPs": external_ips,
        },
    })))
}

fn slice_in(namespace: &str, service: &str, ip: &str) -> Object {
    Object::slice(&decode::<EndpointSlice>(json!({
        "metadata": {
            "name": format!("{service}-1"), "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": true}, "nodeName": "node-b"}],
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
    })))
}

/// Whichever order the sync meets them in (the attacker's namespace before
/// or after the victim's), a ClusterIP an attacker's externalIP held before
/// the ClusterIP's Service existed is the Service's once it does, in the
/// sync that learns of it; and of two Services on one address the older
/// takes it from the younger, which gets it back once the older goes.
#[test]
fn a_frontend_another_service_held_is_taken_over_in_the_same_sync() {
    for attacker_namespace in ["aaa", "zzz"] {
        let mut agent = Agent::fresh();
        let (tx, mut events) = tokio::sync::mpsc::channel(16);
        agent.sync.set_events(tx);
        agent.event(listing(
            Kind::Service,
            vec![claiming(
                attacker_namespace,
                "evil",
                "10.96.0.99",
                &["10.96.0.10"],
                1,
            )],
        ));
        agent.event(listing(
            Kind::EndpointSlice,
            vec![slice_in(attacker_namespace, "evil", "10.0.0.66")],
        ));
        agent.event(listing(Kind::Node, vec![node("zone-a")]));
        agent.advance(Duration::from_secs(1));
        assert_eq!(
            agent.served("10.96.0.10"),
            Some(vec!["10.0.0.66".into()]),
            "no Service has 10.96.0.10 yet: the externalIP is served"
        );
        let runs = agent.runs.len();
        agent.event(SourceEvent::Apply(slice_in("demo", "dns", "10.0.0.53")));
        agent.event(SourceEvent::Apply(claiming(
            "demo",
            "dns",
            "10.96.0.10",
            &[],
            5,
        )));
        agent.advance(Duration::from_secs(1));
        assert_eq!(
            agent.served("10.96.0.10"),
            Some(vec!["10.0.0.53".into()]),
            "attacker in {attacker_namespace}: the ClusterIP is its Service's"
        );
        assert_eq!(
            agent.runs.len(),
            runs + 1,
            "attacker in {attacker_namespace}: in one sync"
        );
        assert_eq!(
            agent.sync.refusals.count(crate::model::Reason::ClusterIp),
            1
        );
        let event = events.try_recv().expect("an Event for the refusal");
        assert_eq!(event.service.name, "evil");
        assert_eq!(event.reason, "AddressRefused");
        assert!(event.note.contains("10.96.0.10"), "{}", event.note);
        assert!(events.try_recv().is_err(), "one Event");
        // Synced again, still refused: reported once, not at each sync.
        agent.event(SourceEvent::Apply(slice_in(
            attacker_namespace,
            "evil",
            "10.0.0.67",
        )));
        agent.advance(Duration::from_secs(1));
        assert!(
            events.try_recv().is_err(),
            "no Event for a refusal already reported"
        );
        assert_eq!(
            agent.sync.refusals.count(crate::model::Reason::ClusterIp),
            1
        );
    }
}

/// Of two Services on one address, the older takes it from the younger, which
/// has it back once the older goes, whichever of them the sync meets first.
#[test]
fn the_older_service_takes_a_shared_address_and_gives_it_back_when_it_goes() {
    for attacker_namespace in ["aaa", "zzz"] {
        let mut agent = Agent::fresh();
        agent.event(listing(Kind::Service, Vec::new()));
        agent.event(listing(Kind::EndpointSlice, Vec::new()));
        agent.event(listing(Kind::Node, vec![node("zone-a")]));
        agent.advance(Duration::from_secs(1));
        // Two Services on 203.0.113.50: the older, arriving second, wins.
        agent.event(SourceEvent::Apply(claiming(
            attacker_namespace,
            "young",
            "10.96.0.98",
            &["203.0.113.50"],
            30,
        )));
        agent.event(SourceEvent::Apply(slice_in(
            attacker_namespace,
            "young",
            "10.0.0.77",
        )));
        agent.advance(Duration::from_secs(1));
        assert_eq!(agent.served("203.0.113.50"), Some(vec!["10.0.0.77".into()]));
        agent.event(SourceEvent::Apply(claiming(
            "demo",
            "old",
            "10.96.0.97",
            &["203.0.113.50"],
            10,
        )));
        agent.event(SourceEvent::Apply(slice_in("demo", "old", "10.0.0.88")));
        agent.advance(Duration::from_secs(1));
        assert_eq!(
            agent.served("203.0.113.50"),
            Some(vec!["10.0.0.88".into()]),
            "young in {attacker_namespace}: the older Service takes the address"
        );
        assert_eq!(agent.sync.refusals.count(crate::model::Reason::Conflict), 1);
        agent.event(SourceEvent::Delete {
            kind: Kind::Service,
            key: ObjectKey {
                namespace: "demo".into(),
                name: "old".into(),
            },
        });
        agent.advance(Duration::from_secs(1));
        assert_eq!(
            agent.served("203.0.113.50"),
            Some(vec!["10.0.0.77".into()]),
            "the older gone, the younger has it back"
        );
        assert_eq!(agent.sync.refusals.count(crate::model::Reason::Conflict), 0);
    }
}

/// An address of the node's interfaces is refused once the agent learns
/// of it, and served again once it is gone; an Event queue that is full
/// drops Events without holding the sync up.
#[test]
fn interface_addresses_refuse_external_ips_as_they_come_and_go() {
    let mut agent = Agent::fresh();
    let (tx, _events) = tokio::sync::mpsc::channel(1);
    agent.sync.set_events(tx);
    agent.event(listing(
        Kind::Service,
        vec![claiming(
            "t",
            "web",
            "10.96.0.20",
            &["192.168.50.1", "192.168.50.2"],
            1,
        )],
    ));
    agent.event(listing(
        Kind::EndpointSlice,
        vec![slice_in("t", "web", "10.0.0.5")],
    ));
    agent.event(listing(Kind::Node, vec![node("zone-a")]));
    agent.advance(Duration::from_secs(1));
    assert!(agent.served("192.168.50.1").is_some());
    agent.sync.on_interface_addresses(
        &mut agent.state,
        &[
            "192.168.50.1".parse().unwrap(),
            "192.168.50.2".parse().unwrap(),
        ],
        agent.now,
    );
    agent.advance(Duration::from_secs(1));
    assert_eq!(agent.served("192.168.50.1"), None, "a node address");
    assert_eq!(agent.served("192.168.50.2"), None, "a node address");
    assert!(agent.served("10.96.0.20").is_some(), "the ClusterIP stays");
    assert_eq!(
        agent.sync.refusals.count(crate::model::Reason::NodeAddress),
        2
    );
    agent.sync.on_interface_addresses(
        &mut agent.state,
        &["192.168.50.2".parse().unwrap()],
        agent.now,
    );
    agent.advance(Duration::from_secs(1));
    assert!(
        agent.served("192.168.50.1").is_some(),
        "no longer the node's"
    );
    assert_eq!(agent.served("192.168.50.2"), None);
}
