//! The Kubernetes API source against the loopback API server (`ebpf-proxy-apiserver`,
//! tests/apiserver/): the real kube-rs client and watcher, list and watch over loopback HTTP,
//! and the faults an API server has (dropped and stalled streams, expired
//! resource versions, 5xx, outages, malformed objects). No BPF and no root:
//! what comes out is the stream of `SourceEvent`s, and, in the last tests,
//! the frontends the state and model make of it.
//!
//! Each test has its own server on 127.0.0.1:0, so they run in parallel.

use ebpf_proxy_apiserver as apiserver;

use std::{collections::VecDeque, net::IpAddr, time::Duration};

use apiserver::{ApiServer, Fault, Logs, Resource, Verb, node, service, slice};
use k8s_openapi::api::core::v1::Service;
use proxy_userspace::{
    model::{CompactService, ModelConfig, Slice},
    source::{
        Kind, Object, ObjectKey, SourceEvent,
        kube::{self as kube_source, KubeSourceError},
    },
    state::ClusterState,
};
use serde_json::{Value, json};
use tokio::{sync::mpsc, task::JoinHandle, time::Instant};
use tracing::instrument::WithSubscriber;

/// This node.
const NODE: &str = "node-a";
/// How long an event may take when nothing fails.
const PROMPT: Duration = Duration::from_secs(5);
/// How long recovery may take: a few rounds of kube-rs's backoff (0.8 s,
/// 1.6 s, 3.2 s, each up to twice that with jitter) plus timeouts.
const RECOVERY: Duration = Duration::from_secs(20);

/// `source::kube::watch` running against a fake server, and what it sent.
struct Source {
    rx: Option<mpsc::Receiver<SourceEvent>>,
    /// Received events of other kinds than the one asked for.
    pending: VecDeque<SourceEvent>,
    task: JoinHandle<Result<(), KubeSourceError>>,
    logs: Logs,
}

impl Source {
    /// Starts the source on a client made the way the agent makes it
    /// (`--master URL`). `read_timeout` bounds how long a request or a
    /// silent watch may hang (kube-rs's own idle timeout is ~5 minutes).
    async fn start(server: &ApiServer, read_timeout: Option<Duration>) -> Source {
        let mut config = kube_source::config(None, Some(server.url().to_owned()))
            .await
            .expect("a client configuration for --master");
        config.read_timeout = read_timeout;
        config.reset_reader_on_write = true;
        let client = kube::Client::try_from(config).expect("a kube client");
        let logs = Logs::default();
        let (tx, rx) = mpsc::channel(1024);
        let task = tokio::spawn(
            kube_source::watch(client, NODE.to_owned(), tx).with_subscriber(logs.subscriber()),
        );
        Source {
            rx: Some(rx),
            pending: VecDeque::new(),
            task,
            logs,
        }
    }

    fn failure_context(&self, server: &ApiServer) -> String {
        format!(
            "events received but not asked for: {:?}\nsource log:\n{}\nrequests:\n{}",
            self.pending.iter().map(describe).collect::<Vec<_>>(),
            self.logs.text(),
            server.request_log()
        )
    }

    /// The next event of any kind, if one comes within `within`.
    async fn try_next(&mut self, server: &ApiServer, within: Duration) -> Option<SourceEvent> {
        if let Some(event) = self.pending.pop_front() {
            return Some(event);
        }
        let rx = self.rx.as_mut().expect("receiver open");
        match tokio::time::timeout(within, rx.recv()).await {
            Ok(Some(event)) => Some(event),
            Ok(None) => panic!("the source stopped\n{}", self.failure_context(server)),
            Err(_) => None,
        }
    }

    /// The next event about `kind`; events of other kinds are kept for
    /// later.
    async fn next_of(&mut self, server: &ApiServer, kind: Kind, within: Duration) -> SourceEvent {
        if let Some(i) = self.pending.iter().position(|e| kind_of(e) == kind) {
            return self.pending.remove(i).expect("index in range");
        }
        let deadline = Instant::now() + within;
        loop {
            let rx = self.rx.as_mut().expect("receiver open");
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(event)) if kind_of(&event) == kind => return event,
                Ok(Some(event)) => self.pending.push_back(event),
                Ok(None) => panic!(
                    "the source stopped while waiting for a {kind:?} event\n{}",
                    self.failure_context(server)
                ),
                Err(tokio::time::error::Elapsed { .. }) => panic!(
                    "no {kind:?} event within {within:?}\n{}",
                    self.failure_context(server)
                ),
            }
        }
    }

    /// Asserts that the next `kind` event is `want` (see [`describe`]) and
    /// returns it.
    async fn expect(
        &mut self,
        server: &ApiServer,
        kind: Kind,
        want: &str,
        within: Duration,
        what: &str,
    ) -> SourceEvent {
        let event = self.next_of(server, kind, within).await;
        let got = describe(&event);
        assert!(
            got == want,
            "{what}: the next {kind:?} event differs\n  want: {want}\n  got:  {got}\n{}",
            self.failure_context(server)
        );
        event
    }

    /// The initial listings, as `describe` shows them: `want` of the three
    /// kinds `populate` fills, and no `ServiceCIDR`.
    async fn expect_listings(&mut self, server: &ApiServer, want: [&str; 3]) {
        for (kind, want) in [Kind::Service, Kind::EndpointSlice, Kind::Node]
            .into_iter()
            .zip(want)
        {
            self.expect(server, kind, want, PROMPT, "initial listing")
                .await;
        }
        // `populate` makes no ServiceCIDR.
        self.expect(
            server,
            Kind::ServiceCidr,
            "Replace ServiceCidr []",
            PROMPT,
            "initial listing",
        )
        .await;
    }

    /// Drops the receiver; the source must then return `Ok` promptly.
    async fn stop(mut self) {
        drop(self.rx.take());
        let logs = self.logs.clone();
        let result = tokio::time::timeout(PROMPT, self.task)
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "the source did not return within {PROMPT:?} of its receiver going; log:\n{}",
                    logs.text()
                )
            })
            .expect("the source task panicked");
        result.unwrap_or_else(|e| panic!("the source ended with an error: {e}"));
    }
}

fn kind_of(event: &SourceEvent) -> Kind {
    match event {
        SourceEvent::Replace { kind, .. } | SourceEvent::Delete { kind, .. } => *kind,
        SourceEvent::Apply(Object::Service(_)) => Kind::Service,
        SourceEvent::Apply(Object::EndpointSlice(_)) => Kind::EndpointSlice,
        SourceEvent::Apply(Object::Node(_)) => Kind::Node,
        SourceEvent::Apply(Object::ServiceCidr(_)) => Kind::ServiceCidr,
    }
}

/// An object's key; a `ServiceCIDR`'s name with its ranges.
fn object_name(object: &Object) -> String {
    if let Object::ServiceCidr(c) = object {
        let cidrs: Vec<String> = c.cidrs.iter().map(ToString::to_string).collect();
        return format!("{}={}", c.name, cidrs.join(","));
    }
    object.key().map(|k| k.to_string()).unwrap_or_default()
}

/// `Replace Service [demo/a, demo/b]`, `Apply Service demo/a`,
/// `Delete Service demo/a`.
fn describe(event: &SourceEvent) -> String {
    match event {
        SourceEvent::Replace { kind, objects } => {
            let mut names: Vec<String> = objects.iter().map(object_name).collect();
            names.sort();
            format!("Replace {kind:?} [{}]", names.join(", "))
        }
        SourceEvent::Apply(object) => {
            format!("Apply {:?} {}", kind_of(event), object_name(object))
        }
        SourceEvent::Delete { kind, key } => format!("Delete {kind:?} {key}"),
    }
}

fn applied_service(event: &SourceEvent) -> &CompactService {
    match event {
        SourceEvent::Apply(Object::Service(s)) => s,
        other => panic!("expected an applied Service, got {}", describe(other)),
    }
}

fn applied_slice(event: &SourceEvent) -> &Slice {
    match event {
        SourceEvent::Apply(Object::EndpointSlice(s)) => s,
        other => panic!("expected an applied EndpointSlice, got {}", describe(other)),
    }
}

fn zone_of(event: &SourceEvent) -> Option<String> {
    match event {
        SourceEvent::Apply(Object::Node(n)) => n
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("topology.kubernetes.io/zone"))
            .cloned(),
        other => panic!("expected an applied Node, got {}", describe(other)),
    }
}

/// The usual store: demo/web and demo/api, web's slice on this node, and
/// two Nodes.
fn populate(server: &ApiServer) {
    server.apply(service("demo", "web", "10.96.0.10"));
    server.apply(service("demo", "api", "10.96.0.11"));
    server.apply(slice("demo", "web-abc", "web", NODE, &["10.0.0.1"]));
    server.apply(node(NODE, Some("zone-a")));
    server.apply(node("node-b", Some("zone-b")));
}

const LISTED: [&str; 3] = [
    "Replace Service [demo/api, demo/web]",
    "Replace EndpointSlice [demo/web-abc]",
    "Replace Node [node-a]",
];

/// How many requests `fault` was injected into: a fault test must hit its
/// faults, or it proves nothing.
fn faults_hit(server: &ApiServer, verb: Verb, fault: Fault) -> usize {
    server
        .requests()
        .iter()
        .filter(|r| r.verb == Some(verb) && r.fault == Some(fault))
        .count()
}

/// Makes the Service watch miss what `change` does: its stream goes silent
/// first, and the change lands in the store only.
async fn behind_the_services_watch(server: &ApiServer, change: impl FnOnce()) {
    server
        .wait_for_watchers(Resource::Services, 1, PROMPT)
        .await;
    assert_eq!(
        server.stall_watches(Some(Resource::Services)),
        1,
        "one Service watch to stall"
    );
    change();
}

#[tokio::test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom; its steps share the API server it sets up"
)]
async fn lists_each_kind_then_follows_changes() {
    let server = ApiServer::start().await;
    populate(&server);
    let mut source = Source::start(&server, None).await;
    source.expect_listings(&server, LISTED).await;

    server.apply(service("demo", "db", "10.96.0.12"));
    source
        .expect(
            &server,
            Kind::Service,
            "Apply Service demo/db",
            PROMPT,
            "a new Service",
        )
        .await;

    let mut web = service("demo", "web", "10.96.0.10");
    web["spec"]["externalIPs"] = json!(["192.0.2.7"]);
    server.apply(web);
    let event = source
        .expect(
            &server,
            Kind::Service,
            "Apply Service demo/web",
            PROMPT,
            "an update",
        )
        .await;
    // (Labels other than the proxy's own are not kept: model::compact.)
    assert_eq!(
        applied_service(&event).external_ips(),
        ["192.0.2.7".parse::<IpAddr>().unwrap()],
        "the update carries the new externalIP"
    );

    server.delete(Resource::Services, "demo", "api");
    source
        .expect(
            &server,
            Kind::Service,
            "Delete Service demo/api",
            PROMPT,
            "a deletion",
        )
        .await;

    server.apply(slice(
        "demo",
        "web-abc",
        "web",
        NODE,
        &["10.0.0.1", "10.0.0.2"],
    ));
    let event = source
        .expect(
            &server,
            Kind::EndpointSlice,
            "Apply EndpointSlice demo/web-abc",
            PROMPT,
            "a scaled slice",
        )
        .await;
    assert_eq!(
        applied_slice(&event).endpoint_count(),
        2,
        "the slice update carries both endpoints"
    );

    // Another node's change must not come through: the next Node event is
    // ours.
    server.apply(node("node-b", Some("zone-x")));
    server.apply(node(NODE, Some("zone-c")));
    let event = source
        .expect(
            &server,
            Kind::Node,
            "Apply Node node-a",
            PROMPT,
            "our Node only",
        )
        .await;
    assert_eq!(zone_of(&event).as_deref(), Some("zone-c"), "our new zone");

    server.delete(Resource::EndpointSlices, "demo", "web-abc");
    source
        .expect(
            &server,
            Kind::EndpointSlice,
            "Delete EndpointSlice demo/web-abc",
            PROMPT,
            "a deleted slice",
        )
        .await;

    for resource in Resource::ALL {
        assert_eq!(
            server.successes(resource, Verb::List),
            1,
            "{resource:?} listed once, nothing failed\n{}",
            server.request_log()
        );
    }
    let node_requests: Vec<String> = server
        .requests()
        .into_iter()
        .filter(|r| r.resource == Some(Resource::Nodes))
        .map(|r| r.query)
        .collect();
    assert!(
        node_requests
            .iter()
            .all(|q| q.contains("fieldSelector=metadata.name%3Dnode-a")),
        "every Node request selects node-a by name: {node_requests:?}"
    );
    assert!(
        source.pending.is_empty(),
        "unexpected events: {:?}",
        source.pending.iter().map(describe).collect::<Vec<_>>()
    );
    source.stop().await;
}

#[tokio::test]
async fn large_listings_come_in_pages_and_one_replace() {
    let server = ApiServer::start().await;
    const N: usize = 1_201;
    for i in 0..N {
        server.apply(service(
            "bulk",
            &format!("svc-{i:04}"),
            &format!("10.97.{}.{}", i / 250, i % 250 + 1),
        ));
    }
    let mut source = Source::start(&server, None).await;
    match source.next_of(&server, Kind::Service, PROMPT).await {
        SourceEvent::Replace { objects, .. } => {
            assert_eq!(objects.len(), N, "every Service in one Replace");
        }
        other => panic!("expected the Service listing, got {}", describe(&other)),
    }
    let lists: Vec<String> = server
        .requests()
        .into_iter()
        .filter(|r| r.resource == Some(Resource::Services) && r.verb == Some(Verb::List))
        .map(|r| r.query)
        .collect();
    // Pages of 500, so that the agent never holds a whole kind as the API
    // sent it (docs/operations.md, "Memory").
    assert!(
        lists.len() == 3
            && lists.iter().all(|q| q.contains("limit=500"))
            && lists[1..].iter().all(|q| q.contains("continue=")),
        "the listing in pages of 500: {lists:?}"
    );
    source.stop().await;

    // The fake pages as the API server does, for clients that ask.
    let client = kube_source::client(None, Some(server.url().to_owned()))
        .await
        .expect("client");
    let api: kube::Api<Service> = kube::Api::all(client);
    let mut params = kube::api::ListParams::default().limit(500);
    let mut sizes = Vec::new();
    let mut rvs = Vec::new();
    loop {
        let page = api.list(&params).await.expect("a page");
        sizes.push(page.items.len());
        rvs.push(page.metadata.resource_version.clone());
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params.continue_token = Some(token),
            None => break,
        }
        // Pages come from the first page's snapshot: later changes do not
        // shift them.
        server.apply(service("bulk", "aaa-late", "10.98.0.1"));
    }
    assert_eq!(sizes, [500, 500, 201], "pages of 500");
    assert!(
        rvs.iter().all(|rv| rv == &rvs[0]),
        "every page has the snapshot's resourceVersion: {rvs:?}"
    );
    params.continue_token = Some("page-999".into());
    let err = api
        .list(&params)
        .await
        .expect_err("an unknown continue token");
    assert!(
        matches!(&err, kube::Error::Api(s) if s.code == 410),
        "an unknown continue token is 410 Gone: {err}"
    );
}

#[tokio::test]
async fn dropped_stream_resumes_where_it_was() {
    let server = ApiServer::start().await;
    populate(&server);
    let mut source = Source::start(&server, None).await;
    source.expect_listings(&server, LISTED).await;

    behind_the_services_watch(&server, || {
        server.apply(service("demo", "db", "10.96.0.12"));
        server.delete(Resource::Services, "demo", "api");
    })
    .await;
    server.drop_watches(Some(Resource::Services));

    source
        .expect(
            &server,
            Kind::Service,
            "Apply Service demo/db",
            PROMPT,
            "replayed after the drop",
        )
        .await;
    source
        .expect(
            &server,
            Kind::Service,
            "Delete Service demo/api",
            PROMPT,
            "replayed after the drop",
        )
        .await;
    assert_eq!(
        server.successes(Resource::Services, Verb::List),
        1,
        "a dropped stream resumes from its resourceVersion without listing again\n{}",
        server.request_log()
    );

    // A clean end (the server's watch timeout) resumes the same way.
    behind_the_services_watch(&server, || {
        server.apply(service("demo", "cache", "10.96.0.13"));
    })
    .await;
    server.end_watches(Some(Resource::Services));
    source
        .expect(
            &server,
            Kind::Service,
            "Apply Service demo/cache",
            PROMPT,
            "replayed after a clean end",
        )
        .await;
    assert_eq!(server.successes(Resource::Services, Verb::List), 1);
    source.stop().await;
}

#[tokio::test]
async fn expired_resource_version_lists_again_as_a_replace() {
    let server = ApiServer::start().await;
    populate(&server);
    let mut source = Source::start(&server, None).await;
    source.expect_listings(&server, LISTED).await;

    behind_the_services_watch(&server, || {
        server.apply(service("demo", "db", "10.96.0.12"));
        server.delete(Resource::Services, "demo", "api");
        server.compact();
    })
    .await;
    server.drop_watches(Some(Resource::Services));

    source
        .expect(
            &server,
            Kind::Service,
            "Replace Service [demo/db, demo/web]",
            PROMPT,
            "a 410 Gone watch is followed by a fresh listing",
        )
        .await;
    assert_eq!(
        server.successes(Resource::Services, Verb::List),
        2,
        "listed again after the 410\n{}",
        server.request_log()
    );
    // The other kinds were not disturbed.
    for resource in [Resource::EndpointSlices, Resource::Nodes] {
        assert_eq!(server.successes(resource, Verb::List), 1, "{resource:?}");
    }
    source.stop().await;
}

#[tokio::test]
async fn server_errors_are_retried_with_backoff() {
    let server = ApiServer::start().await;
    populate(&server);
    server.fail_next(Resource::Services, Verb::List, Fault::Status(500), 2);
    let mut source = Source::start(&server, None).await;

    // The other kinds do not wait for the failing one.
    source
        .expect(&server, Kind::EndpointSlice, LISTED[1], PROMPT, "slices")
        .await;
    source
        .expect(&server, Kind::Node, LISTED[2], PROMPT, "node")
        .await;
    source
        .expect(
            &server,
            Kind::Service,
            LISTED[0],
            RECOVERY,
            "Services listed after two 500s",
        )
        .await;
    assert_eq!(
        faults_hit(&server, Verb::List, Fault::Status(500)),
        2,
        "both failing lists were made\n{}",
        server.request_log()
    );
    let log = source.logs.text();
    assert!(
        log.contains("Service list/watch") && log.contains("500"),
        "the failures are logged with what the API said:\n{log}"
    );

    // Failing watch requests: the change arrives once they succeed.
    behind_the_services_watch(&server, || {
        server.apply(service("demo", "db", "10.96.0.12"));
    })
    .await;
    server.fail_next(Resource::Services, Verb::Watch, Fault::Status(503), 1);
    server.fail_next(Resource::Services, Verb::Watch, Fault::Status(500), 2);
    server.drop_watches(Some(Resource::Services));
    source
        .expect(
            &server,
            Kind::Service,
            "Apply Service demo/db",
            RECOVERY,
            "the change after failed watch requests",
        )
        .await;
    assert_eq!(
        (
            faults_hit(&server, Verb::Watch, Fault::Status(503)),
            faults_hit(&server, Verb::Watch, Fault::Status(500)),
        ),
        (1, 2),
        "all failing watches were made\n{}",
        server.request_log()
    );
    source
        .logs
        .wait_for("API requests succeed again", PROMPT)
        .await;
    source.stop().await;
}

#[tokio::test]
async fn a_watch_refused_as_gone_starts_over() {
    let server = ApiServer::start().await;
    populate(&server);
    let mut source = Source::start(&server, None).await;
    source.expect_listings(&server, LISTED).await;

    behind_the_services_watch(&server, || {
        server.apply(service("demo", "db", "10.96.0.12"));
    })
    .await;
    server.fail_next(Resource::Services, Verb::Watch, Fault::Gone, 1);
    server.drop_watches(Some(Resource::Services));
    source
        .expect(
            &server,
            Kind::Service,
            "Replace Service [demo/api, demo/db, demo/web]",
            RECOVERY,
            "a new listing after a watch answered 410",
        )
        .await;
    assert_eq!(
        faults_hit(&server, Verb::Watch, Fault::Gone),
        1,
        "the 410 was answered"
    );
    assert!(
        source.logs.text().contains("refused the watch as expired"),
        "the restart is logged:\n{}",
        source.logs.text()
    );
    source.stop().await;
}

#[tokio::test]
async fn stalled_requests_and_streams_time_out_and_recover() {
    let server = ApiServer::start().await;
    populate(&server);
    server.fail_next(Resource::Services, Verb::List, Fault::Stall, 1);
    // Healthy streams carry a bookmark every 200 ms, well inside the
    // client's 1 s read timeout.
    let mut source = Source::start(&server, Some(Duration::from_secs(1))).await;
    source
        .expect(
            &server,
            Kind::Service,
            LISTED[0],
            RECOVERY,
            "Services listed after a stalled list",
        )
        .await;
    assert_eq!(
        faults_hit(&server, Verb::List, Fault::Stall),
        1,
        "the stalled list was made\n{}",
        server.request_log()
    );

    behind_the_services_watch(&server, || {
        server.apply(service("demo", "db", "10.96.0.12"));
    })
    .await;
    source
        .expect(
            &server,
            Kind::Service,
            "Apply Service demo/db",
            RECOVERY,
            "the change after a silent stream timed out",
        )
        .await;
    assert_eq!(
        server.successes(Resource::Services, Verb::List),
        1,
        "a timed-out stream resumes without listing again\n{}",
        server.request_log()
    );
    source.stop().await;
}

#[tokio::test]
async fn an_outage_keeps_what_was_sent_and_converges() {
    let server = ApiServer::start().await;
    populate(&server);
    let mut source = Source::start(&server, None).await;
    source.expect_listings(&server, LISTED).await;

    server.set_down(true);
    server.apply(service("demo", "db", "10.96.0.12"));
    server.delete(Resource::Services, "demo", "api");
    server.apply(slice("demo", "db-xyz", "db", NODE, &["10.0.1.1"]));
    // Long enough that the history no longer covers what the source saw.
    server.compact();
    source.logs.wait_for("API error", RECOVERY).await;
    assert!(
        source.pending.is_empty() && source.rx.as_mut().unwrap().is_empty(),
        "nothing is sent while the API is down (the consumer keeps its state): {:?}",
        source.pending.iter().map(describe).collect::<Vec<_>>()
    );
    server.set_down(false);

    source
        .expect(
            &server,
            Kind::Service,
            "Replace Service [demo/db, demo/web]",
            RECOVERY,
            "Services after the outage",
        )
        .await;
    source
        .expect(
            &server,
            Kind::EndpointSlice,
            "Replace EndpointSlice [demo/db-xyz, demo/web-abc]",
            RECOVERY,
            "slices after the outage",
        )
        .await;
    source.stop().await;
}

/// A Service whose spec.ports is a string, as no API server would store.
fn broken_service(name: &str) -> Value {
    let mut broken = service("demo", name, "10.96.0.66");
    broken["spec"]["ports"] = json!("not-a-list");
    broken
}

#[tokio::test]
async fn malformed_objects_are_skipped_and_named() {
    let server = ApiServer::start().await;
    populate(&server);
    server.apply(broken_service("broken"));
    let mut bad_slice = slice("demo", "bad-slice", "web", NODE, &["10.0.0.9"]);
    bad_slice["endpoints"] = json!({"addresses": "10.0.0.9"});
    server.apply(bad_slice);
    let mut source = Source::start(&server, None).await;

    source.expect_listings(&server, LISTED).await;
    let log = source.logs.text();
    for needle in [
        "Service demo/broken: spec.ports: invalid type: string \"not-a-list\", expected a sequence; skipped",
        "EndpointSlice demo/bad-slice: endpoints: invalid type: map, expected a sequence; skipped",
    ] {
        assert!(
            log.contains(needle),
            "the log names the bad object: {needle:?}\n{log}"
        );
    }

    // A bad update of a good object: nothing is sent, so the consumer keeps
    // its last good version; later changes still arrive.
    let mut web = service("demo", "web", "10.96.0.10");
    web["spec"]["ports"] = json!(7);
    server.apply(web);
    server.apply(service("demo", "db", "10.96.0.12"));
    source
        .expect(
            &server,
            Kind::Service,
            "Apply Service demo/db",
            PROMPT,
            "the bad update of demo/web sends nothing; the next change arrives",
        )
        .await;
    source
        .logs
        .wait_for(
            "Service demo/web: spec.ports: invalid type: integer `7`, expected a sequence; skipped, its last good version stays",
            PROMPT,
        )
        .await;

    // A re-list while demo/web is still bad must not delete it either.
    behind_the_services_watch(&server, || {
        server.delete(Resource::Services, "demo", "api");
        server.compact();
    })
    .await;
    server.drop_watches(Some(Resource::Services));
    source
        .expect(
            &server,
            Kind::Service,
            "Delete Service demo/api",
            PROMPT,
            "re-list with a held object bad: the unlisted one goes",
        )
        .await;
    source
        .expect(
            &server,
            Kind::Service,
            "Apply Service demo/db",
            PROMPT,
            "re-list with a held object bad: the listed good ones are applied",
        )
        .await;

    // Fixed, it comes through.
    server.apply(service("demo", "web", "10.96.0.10"));
    source
        .expect(
            &server,
            Kind::Service,
            "Apply Service demo/web",
            PROMPT,
            "the fix",
        )
        .await;
    // Deleting a bad object works whatever its content.
    server.delete(Resource::Services, "demo", "broken");
    source
        .expect(
            &server,
            Kind::Service,
            "Delete Service demo/broken",
            PROMPT,
            "deleting a bad object",
        )
        .await;
    source.stop().await;
}

#[tokio::test]
async fn an_empty_node_name_is_refused() {
    let server = ApiServer::start().await;
    let client = kube_source::client(None, Some(server.url().to_owned()))
        .await
        .expect("client");
    let (tx, _rx) = mpsc::channel(1);
    let err = kube_source::watch(client, String::new(), tx)
        .await
        .expect_err("no node name");
    assert!(
        matches!(err, KubeSourceError::EmptyNodeName),
        "the error says the node name is missing: {err}"
    );
}

// ---- Through the state and the model: the frontends the agent would program. ----

/// A Service's frontends, one a line: `10.96.0.10:80/TCP -> 10.0.0.1:8080 …`,
/// or `… -> none (Reject)` when it has no backends.
fn frontends(state: &ClusterState, namespace: &str, name: &str) -> Vec<String> {
    let key = ObjectKey {
        namespace: namespace.into(),
        name: name.into(),
    };
    state
        .frontends_for(&key, &ModelConfig::default())
        .unwrap_or_else(|e| panic!("{key} does not model: {e}"))
        .iter()
        .map(|f| {
            if f.backends.is_empty() {
                format!("{} -> none ({:?})", f.key, f.no_endpoints)
            } else {
                let backends: Vec<String> = f
                    .backends
                    .iter()
                    .map(proxy_userspace::model::BackendAddr::host_port)
                    .collect();
                format!("{} -> {}", f.key, backends.join(" "))
            }
        })
        .collect()
}

/// Applies the source's events to `state` until demo/web's frontends are
/// `want`; panics with the difference after `within`.
async fn converge(
    source: &mut Source,
    server: &ApiServer,
    state: &mut ClusterState,
    want: &[&str],
    within: Duration,
    what: &str,
) {
    let deadline = Instant::now() + within;
    loop {
        let got = frontends(state, "demo", "web");
        if got == want {
            return;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "{what}: demo/web's frontends differ after {within:?}\n  want: {want:?}\n  got:  {got:?}\n{}",
            source.failure_context(server)
        );
        let Some(event) = source.try_next(server, left).await else {
            panic!(
                "{what}: no more events within {within:?} and demo/web's frontends differ\n  want: {want:?}\n  got:  {got:?}\n{}",
                source.failure_context(server)
            );
        };
        state.apply(event);
    }
}

#[tokio::test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom; its steps share the API server it sets up"
)]
async fn frontends_follow_create_scale_relabel_and_delete() {
    let server = ApiServer::start().await;
    server.apply(node(NODE, Some("zone-a")));
    let mut source = Source::start(&server, None).await;
    let mut state = ClusterState::new(NODE);
    converge(
        &mut source,
        &server,
        &mut state,
        &[],
        PROMPT,
        "empty cluster",
    )
    .await;

    server.apply(service("demo", "web", "10.96.0.10"));
    server.apply(slice("demo", "web-abc", "web", NODE, &["10.0.0.1"]));
    converge(
        &mut source,
        &server,
        &mut state,
        &["10.96.0.10:80/TCP -> 10.0.0.1:8080"],
        PROMPT,
        "create: the named targetPort resolves through the slice",
    )
    .await;

    server.apply(slice(
        "demo",
        "web-abc",
        "web",
        NODE,
        &["10.0.0.1", "10.0.0.2", "10.0.0.10"],
    ));
    server.apply(slice("demo", "web-def", "web", "node-b", &["10.0.0.3"]));
    let scaled = ["10.96.0.10:80/TCP -> 10.0.0.10:8080 10.0.0.1:8080 10.0.0.2:8080 10.0.0.3:8080"];
    converge(
        &mut source,
        &server,
        &mut state,
        &scaled,
        PROMPT,
        "scale: four endpoints over two slices, in kube-proxy's string order (\"10.0.0.10:\" < \"10.0.0.1:\")",
    )
    .await;

    let mut other_proxy = service("demo", "web", "10.96.0.10");
    other_proxy["metadata"]["labels"] =
        json!({"service.kubernetes.io/service-proxy-name": "other-proxy"});
    server.apply(other_proxy);
    converge(
        &mut source,
        &server,
        &mut state,
        &[],
        PROMPT,
        "relabel: another proxy's Service is not programmed",
    )
    .await;

    server.apply(service("demo", "web", "10.96.0.10"));
    converge(
        &mut source,
        &server,
        &mut state,
        &scaled,
        PROMPT,
        "label removed: programmed again",
    )
    .await;

    // An outage with changes behind it: the state stays as it was, then
    // converges on the re-list.
    server.set_down(true);
    server.delete(Resource::EndpointSlices, "demo", "web-def");
    server.apply(slice("demo", "web-abc", "web", NODE, &["10.0.0.2"]));
    server.compact();
    source.logs.wait_for("API error", RECOVERY).await;
    while let Ok(event) = source.rx.as_mut().unwrap().try_recv() {
        state.apply(event);
    }
    assert_eq!(
        frontends(&state, "demo", "web"),
        scaled,
        "during the outage the frontends stay as they were"
    );
    server.set_down(false);
    converge(
        &mut source,
        &server,
        &mut state,
        &["10.96.0.10:80/TCP -> 10.0.0.2:8080"],
        RECOVERY,
        "after the outage: scaled down to the store's one endpoint",
    )
    .await;

    server.delete(Resource::EndpointSlices, "demo", "web-abc");
    converge(
        &mut source,
        &server,
        &mut state,
        &["10.96.0.10:80/TCP -> none (Reject)"],
        PROMPT,
        "no endpoints: rejected",
    )
    .await;

    server.delete(Resource::Services, "demo", "web");
    converge(
        &mut source,
        &server,
        &mut state,
        &[],
        PROMPT,
        "delete: no frontends",
    )
    .await;
    assert_eq!(state.service_count(), 0, "no Services left in the state");
    source.stop().await;
}

#[tokio::test]
async fn type_changes_program_and_unprogram() {
    let server = ApiServer::start().await;
    server.apply(node(NODE, Some("zone-a")));
    server.apply(slice("demo", "web-abc", "web", NODE, &["10.0.0.1"]));
    let mut source = Source::start(&server, None).await;
    let mut state = ClusterState::new(NODE);

    let cluster_ip = service("demo", "web", "10.96.0.10");
    let mut external_name = service("demo", "web", "10.96.0.10");
    external_name["spec"] = json!({"type": "ExternalName", "externalName": "web.example.com"});
    let mut node_port = service("demo", "web", "10.96.0.10");
    node_port["spec"]["type"] = json!("NodePort");
    node_port["spec"]["ports"][0]["nodePort"] = json!(30080);
    let mut load_balancer = node_port.clone();
    load_balancer["spec"]["type"] = json!("LoadBalancer");
    load_balancer["status"] = json!({"loadBalancer": {"ingress": [{"ip": "192.0.2.10"}]}});

    let steps: [(&str, &Value, &[&str]); 6] = [
        (
            "ClusterIP",
            &cluster_ip,
            &["10.96.0.10:80/TCP -> 10.0.0.1:8080"],
        ),
        (
            "ClusterIP -> ExternalName: unprogrammed",
            &external_name,
            &[],
        ),
        (
            "ExternalName -> NodePort",
            &node_port,
            &[
                "10.96.0.10:80/TCP -> 10.0.0.1:8080",
                "0.0.0.0:30080/TCP -> 10.0.0.1:8080",
            ],
        ),
        (
            "NodePort -> LoadBalancer",
            &load_balancer,
            &[
                "10.96.0.10:80/TCP -> 10.0.0.1:8080",
                "0.0.0.0:30080/TCP -> 10.0.0.1:8080",
                "192.0.2.10:80/TCP -> 10.0.0.1:8080",
            ],
        ),
        (
            "LoadBalancer -> ClusterIP: the node port and LB IP go",
            &cluster_ip,
            &["10.96.0.10:80/TCP -> 10.0.0.1:8080"],
        ),
        ("ClusterIP -> ExternalName again", &external_name, &[]),
    ];
    for (what, object, want) in steps {
        server.apply(object.clone());
        converge(&mut source, &server, &mut state, want, PROMPT, what).await;
    }
    source.stop().await;
}

/// `ServiceCIDR`s are listed and followed like the other kinds, a bad range
/// left out; an API server that has no such kind (older than 1.33) answers
/// 404, said once as an empty listing, and is not asked again.
#[tokio::test]
async fn service_cidrs_are_followed_and_a_server_without_them_is_not_asked_again() {
    let server = ApiServer::start().await;
    server.apply(apiserver::service_cidr(
        "kubernetes",
        &["10.96.0.0/12", "fd00:96::/112"],
    ));
    let mut source = Source::start(&server, None).await;
    source
        .expect(
            &server,
            Kind::ServiceCidr,
            "Replace ServiceCidr [kubernetes=10.96.0.0/12,fd00:96::/112]",
            PROMPT,
            "the listing",
        )
        .await;
    server.apply(apiserver::service_cidr(
        "more",
        &["10.100.0.0/16", "not-a-cidr"],
    ));
    source
        .expect(
            &server,
            Kind::ServiceCidr,
            "Apply ServiceCidr more=10.100.0.0/16",
            PROMPT,
            "a second ServiceCIDR, its bad range left out",
        )
        .await;
    source.stop().await;

    let older = ApiServer::start().await;
    older.withhold(Resource::ServiceCidrs);
    let mut source = Source::start(&older, None).await;
    source
        .expect(
            &older,
            Kind::ServiceCidr,
            "Replace ServiceCidr []",
            PROMPT,
            "a server without the kind",
        )
        .await;
    // Long enough for several of the watcher's retries, had it kept asking.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let asked = older
        .requests()
        .iter()
        .filter(|r| r.path == Resource::ServiceCidrs.path())
        .count();
    assert_eq!(
        asked,
        1,
        "requests for ServiceCIDRs:\n{}",
        older.request_log()
    );
    source.stop().await;
}
