//! The sync loop on maps that fail on demand, driven as the agent drives it:
//! events go in, and the clock jumps to each wakeup the loop asks for.

use std::{
    net::{IpAddr, Ipv4Addr},
    time::{Duration, Instant},
};

use k8s_openapi::api::{core::v1::Node, core::v1::Service, discovery::v1::EndpointSlice};
use serde_json::{Value, json};

use super::*;
use crate::{
    model::Scope,
    planner::{MapOp, StoredState, encode},
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
}

impl MapStore for TestMaps {
    type Error = TestMapsError;

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
        Ok(())
    }
}

#[derive(Default)]
struct TestTarget {
    maps: TestMaps,
    departed: Vec<Departed>,
}

impl SyncTarget for TestTarget {
    type Store = TestMaps;

    fn store(&mut self) -> &mut TestMaps {
        &mut self.maps
    }

    fn clean_departed(&mut self, departed: &[Departed]) {
        self.departed.extend_from_slice(departed);
    }
}

const NODE: &str = "node-a";
const TIMEOUT: Duration = Duration::from_secs(60);

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
    Object::Service(Box::new(decode::<Service>(json!({
        "metadata": {"name": name, "namespace": "demo"},
        "spec": {
            "type": "ClusterIP", "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
        },
    }))))
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
    agent.advance(TIMEOUT - Duration::from_millis(1));
    let retries: Vec<Duration> = agent
        .runs
        .iter()
        .filter(|t| **t > queued)
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
    agent.advance(Duration::from_secs(600));
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
    agent.advance(NODE_LISTING_WAIT - Duration::from_millis(1));
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
