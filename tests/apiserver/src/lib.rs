//! A loopback fake of the Kubernetes API server, enough of it for list-watch
//! clients (kube-rs's `watcher`, client-go's reflector) of Services,
//! EndpointSlices and Nodes, with faults to inject.
//!
//! What it speaks, as kube-apiserver does:
//! - `GET /api/v1/services`, `/apis/discovery.k8s.io/v1/endpointslices`,
//!   `/api/v1/nodes`: a `…List` with `metadata.resourceVersion`, paged by
//!   `limit` and `continue` (pages are served from the snapshot the first
//!   page was cut from; an unknown token is `410 Gone`). Items keep their
//!   `kind` and `apiVersion`, which the API server leaves out.
//! - `?watch=true&resourceVersion=N`: `200` and a chunked stream of
//!   newline-delimited `{"type":"ADDED|MODIFIED|DELETED|BOOKMARK|ERROR",
//!   "object":{…}}`: first every change after N still in the history, then
//!   live ones. N older than the history (see [`ApiServer::compact`]) gets
//!   one `ERROR` event carrying a `410` `Expired` Status and the end of the
//!   stream, which is how a real API server reports it. No N (or `0`) starts
//!   with a synthetic `ADDED` per object. `allowWatchBookmarks=true` adds a
//!   `BOOKMARK` every [`ApiServer::set_bookmark_interval`];
//!   `timeoutSeconds` ends the stream cleanly after that long.
//! - `fieldSelector=metadata.name=X` on lists and watches. Label selectors
//!   are refused (`400`), so a client sending one fails loudly.
//! - Errors as `Status` objects with the HTTP code.
//! - Events, written only: `POST` to
//!   `/apis/events.k8s.io/v1/namespaces/NS/events` (kube-rs's `Recorder`)
//!   or `/api/v1/namespaces/NS/events` creates one (`201`), `PATCH` of
//!   `.../events/NAME` merges into it; [`ApiServer::events`] reads them
//!   back, [`ApiServer::fail_events`] makes the next posts fail.
//!
//! Faults: [`ApiServer::fail_next`] (a status code, a stall, a delay, a `410`) for the
//! next requests of a resource and verb; [`ApiServer::drop_watches`] (the
//! connection breaks mid-stream), [`ApiServer::end_watches`] (a clean end,
//! as a server-side timeout), [`ApiServer::stall_watches`] (streams go
//! silent, bookmarks included); [`ApiServer::set_down`] (new connections
//! are closed at once and open ones break on their next read or write).
//!
//! The store is the test's: [`ApiServer::apply`] and [`ApiServer::delete`]
//! change it and tell every open watch. Objects are stored as JSON, never
//! validated beyond `kind` and `metadata.name`, so malformed objects go out
//! as they are.

mod logs;

pub use logs::Logs;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, VecDeque},
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{
    Router,
    body::Body,
    extract::{Request, State},
    http::{Method, StatusCode, header},
    response::Response,
    serve::Listener,
};
use futures::channel::mpsc;
use serde_json::{Value, json};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};

/// How long a [`Fault::Stall`] holds a request before giving up with a 504.
const STALL_LIMIT: Duration = Duration::from_mins(1);
/// How often watches are checked for bookmarks and timeouts.
const TICK: Duration = Duration::from_millis(20);
/// Changes kept for watches to resume from, by default.
const DEFAULT_HISTORY: usize = 10_000;

/// The resources served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Resource {
    Services,
    EndpointSlices,
    Nodes,
    ServiceCidrs,
}

impl Resource {
    pub const ALL: [Resource; 4] = [
        Resource::Services,
        Resource::EndpointSlices,
        Resource::Nodes,
        Resource::ServiceCidrs,
    ];

    pub fn path(self) -> &'static str {
        match self {
            Resource::Services => "/api/v1/services",
            Resource::EndpointSlices => "/apis/discovery.k8s.io/v1/endpointslices",
            Resource::Nodes => "/api/v1/nodes",
            Resource::ServiceCidrs => "/apis/networking.k8s.io/v1/servicecidrs",
        }
    }

    pub fn kind(self) -> &'static str {
        match self {
            Resource::Services => "Service",
            Resource::EndpointSlices => "EndpointSlice",
            Resource::Nodes => "Node",
            Resource::ServiceCidrs => "ServiceCIDR",
        }
    }

    pub fn api_version(self) -> &'static str {
        match self {
            Resource::EndpointSlices => "discovery.k8s.io/v1",
            Resource::ServiceCidrs => "networking.k8s.io/v1",
            Resource::Services | Resource::Nodes => "v1",
        }
    }

    fn namespaced(self) -> bool {
        !matches!(self, Resource::Nodes | Resource::ServiceCidrs)
    }

    fn from_path(path: &str) -> Option<Resource> {
        Resource::ALL.into_iter().find(|r| r.path() == path)
    }

    fn of_kind(kind: &str) -> Option<Resource> {
        Resource::ALL.into_iter().find(|r| r.kind() == kind)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verb {
    List,
    Watch,
}

/// What an injected fault does to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Answer with this HTTP status and a matching Status object.
    Status(u16),
    /// Never answer (until [`STALL_LIMIT`]): a hung API server.
    Stall,
    /// Answer normally, but this much later (from the store as it is
    /// then): a slow listing, which lets another kind's arrive first.
    Delay(Duration),
    /// `410 Gone`, reason `Expired`, as the HTTP answer to the request
    /// itself (API servers report an expired watch inside the stream
    /// instead; that is [`ApiServer::compact`]).
    Gone,
}

/// One request as the server saw it.
#[derive(Clone, Debug)]
pub struct RequestRecord {
    pub method: String,
    pub path: String,
    pub query: String,
    pub resource: Option<Resource>,
    pub verb: Option<Verb>,
    /// The status answered (200 for a watch stream, whatever happens later).
    pub status: u16,
    pub fault: Option<Fault>,
}

/// One change in the history, as the watch event line it was sent as.
#[derive(Clone, Debug)]
struct Change {
    rv: u64,
    resource: Resource,
    name: String,
    line: Arc<str>,
}

/// An object in the store, and its JSON as lists serve it (encoded once:
/// large listings are then mostly copying).
#[derive(Clone, Debug)]
struct Stored {
    object: Value,
    json: Arc<str>,
}

/// An open watch stream.
struct Sink {
    resource: Resource,
    name: Option<String>,
    tx: mpsc::UnboundedSender<io::Result<String>>,
    bookmarks: bool,
    last_bookmark: Instant,
    deadline: Option<Instant>,
    stalled: bool,
}

impl Sink {
    fn wants(&self, resource: Resource, name: &str) -> bool {
        self.resource == resource && self.name.as_deref().is_none_or(|n| n == name)
    }

    /// False once the client is gone.
    fn send(&self, line: &str) -> bool {
        self.tx.unbounded_send(Ok(line.to_owned())).is_ok()
    }
}

/// A page of a paged list still to be served.
struct Page {
    resource: Resource,
    rv: u64,
    items: VecDeque<Arc<str>>,
}

#[derive(Default)]
struct Store {
    rv: u64,
    objects: BTreeMap<(Resource, String, String), Stored>,
    history: VecDeque<Change>,
    history_limit: usize,
    /// Changes up to this resourceVersion are no longer in the history.
    compacted: u64,
    sinks: Vec<Sink>,
    faults: Vec<(Resource, Verb, Fault, usize)>,
    requests: Vec<RequestRecord>,
    pages: HashMap<String, Page>,
    next_token: u64,
    next_uid: u64,
    bookmark_interval: Duration,
    /// Events posted, in order.
    events: Vec<Value>,
    /// The next this many event posts are answered with this status.
    event_faults: Option<(u16, usize)>,
    /// Resources answered with 404, as an API server of an older version
    /// that has no such kind.
    withheld: BTreeSet<Resource>,
}

struct Shared {
    store: Mutex<Store>,
    down: AtomicBool,
    /// Bumped by [`ApiServer::set_down`]: connections of an older epoch
    /// break.
    epoch: AtomicU64,
}

impl Shared {
    fn store(&self) -> MutexGuard<'_, Store> {
        // A test that panicked while holding the lock already failed; the
        // others may carry on with the data.
        self.store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The running server; stops when dropped.
pub struct ApiServer {
    url: String,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        // Open streams end with the server.
        self.shared.store().sinks.clear();
    }
}

impl ApiServer {
    /// Binds 127.0.0.1 on a free port and serves from the current tokio
    /// runtime.
    pub async fn start() -> ApiServer {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fake API server on 127.0.0.1");
        Self::serve(listener)
    }

    /// Serves on `listener` (bound by the caller, e.g. inside a network
    /// namespace).
    pub fn serve(listener: TcpListener) -> ApiServer {
        let addr = listener.local_addr().expect("local address");
        let shared = Arc::new(Shared {
            store: Mutex::new(Store {
                history_limit: DEFAULT_HISTORY,
                bookmark_interval: Duration::from_millis(200),
                ..Default::default()
            }),
            down: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
        });
        let router = Router::new()
            .fallback(handle)
            .with_state(Arc::clone(&shared));
        let listener = FlakyListener {
            inner: listener,
            shared: Arc::clone(&shared),
        };
        let server = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, router).await {
                panic!("fake API server stopped: {e}");
            }
        });
        let ticker = tokio::spawn(tick(Arc::clone(&shared)));
        ApiServer {
            url: format!("http://{addr}"),
            shared,
            tasks: vec![server, ticker],
        }
    }

    /// `http://127.0.0.1:PORT`, for `--master`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The current resourceVersion (of the last change).
    pub fn resource_version(&self) -> u64 {
        self.shared.store().rv
    }

    /// Creates or replaces an object (its `kind` says where it goes) and
    /// tells the watches. Sets `metadata.resourceVersion` and `uid`, and the
    /// namespace `default` when a namespaced object has none. Returns the
    /// new resourceVersion.
    pub fn apply(&self, mut object: Value) -> u64 {
        let kind = object["kind"].as_str().unwrap_or_default().to_owned();
        let resource = Resource::of_kind(&kind)
            .unwrap_or_else(|| panic!("the fake API server does not serve kind {kind:?}"));
        let name = name_of(&object).to_owned();
        assert!(!name.is_empty(), "{kind} without metadata.name: {object}");
        let mut store = self.shared.store();
        let namespace = if resource.namespaced() {
            let ns = object["metadata"]["namespace"]
                .as_str()
                .filter(|n| !n.is_empty())
                .unwrap_or("default")
                .to_owned();
            object["metadata"]["namespace"] = json!(ns);
            ns
        } else {
            String::new()
        };
        object["apiVersion"] = json!(resource.api_version());
        store.rv += 1;
        let rv = store.rv;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let key = (resource, namespace, name);
        let type_ = if let Some(old) = store.objects.get(&key) {
            object["metadata"]["uid"] = old.object["metadata"]["uid"].clone();
            "MODIFIED"
        } else {
            store.next_uid += 1;
            object["metadata"]["uid"] = json!(format!("uid-{}", store.next_uid));
            "ADDED"
        };
        let json: Arc<str> = object.to_string().into();
        store.record(resource, type_, &object);
        store.objects.insert(key, Stored { object, json });
        rv
    }

    /// Deletes an object and tells the watches; panics when there is none
    /// (a mistake in the test). Returns the new resourceVersion.
    pub fn delete(&self, resource: Resource, namespace: &str, name: &str) -> u64 {
        let mut store = self.shared.store();
        let key = (resource, namespace.to_owned(), name.to_owned());
        let Some(Stored { mut object, .. }) = store.objects.remove(&key) else {
            panic!("no {} {namespace}/{name} to delete", resource.kind());
        };
        store.rv += 1;
        let rv = store.rv;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        store.record(resource, "DELETED", &object);
        rv
    }

    /// The stored object, as a client would get it.
    pub fn get(&self, resource: Resource, namespace: &str, name: &str) -> Option<Value> {
        let key = (resource, namespace.to_owned(), name.to_owned());
        self.shared
            .store()
            .objects
            .get(&key)
            .map(|stored| stored.object.clone())
    }

    /// Forgets the history: a watch resuming from any resourceVersion
    /// before now gets `410 Gone` (as after an etcd compaction) and its
    /// client must list again.
    pub fn compact(&self) {
        let mut store = self.shared.store();
        store.history.clear();
        store.compacted = store.rv;
    }

    /// Keeps only the last `n` changes (default 10,000).
    pub fn set_history_limit(&self, n: usize) {
        let mut store = self.shared.store();
        store.history_limit = n;
        store.trim_history();
    }

    pub fn set_bookmark_interval(&self, interval: Duration) {
        self.shared.store().bookmark_interval = interval;
    }

    /// The next `times` requests of `verb` on `resource` get `fault`.
    pub fn fail_next(&self, resource: Resource, verb: Verb, fault: Fault, times: usize) {
        self.shared
            .store()
            .faults
            .push((resource, verb, fault, times));
    }

    /// Breaks the open watch streams of `resource` (all with `None`) as a
    /// dropped connection does: the response ends without its last chunk.
    pub fn drop_watches(&self, resource: Option<Resource>) -> usize {
        let mut store = self.shared.store();
        let (gone, kept): (Vec<Sink>, Vec<Sink>) = store
            .sinks
            .drain(..)
            .partition(|s| resource.is_none_or(|r| r == s.resource));
        store.sinks = kept;
        for sink in &gone {
            let _ = sink.tx.unbounded_send(Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "fault injected: watch stream dropped",
            )));
        }
        gone.len()
    }

    /// Ends the open watch streams of `resource` cleanly, as the API server
    /// does when a watch's timeout is up.
    pub fn end_watches(&self, resource: Option<Resource>) -> usize {
        let mut store = self.shared.store();
        let before = store.sinks.len();
        store
            .sinks
            .retain(|s| resource.is_some_and(|r| r != s.resource));
        before - store.sinks.len()
    }

    /// Makes the open watch streams of `resource` go silent (no events, no
    /// bookmarks) without closing them.
    pub fn stall_watches(&self, resource: Option<Resource>) -> usize {
        let mut store = self.shared.store();
        let mut n = 0;
        for sink in &mut store.sinks {
            if resource.is_none_or(|r| r == sink.resource) && !sink.stalled {
                sink.stalled = true;
                n += 1;
            }
        }
        n
    }

    /// An outage: while down, new connections are closed as soon as they
    /// are accepted, and connections open before break (watch streams at
    /// once, idle keep-alive ones on their next request).
    /// Answers every request for `resource` with 404 from now on, as an API
    /// server that has no such kind.
    pub fn withhold(&self, resource: Resource) {
        self.shared.store().withheld.insert(resource);
    }

    pub fn set_down(&self, down: bool) {
        self.shared.down.store(down, Ordering::SeqCst);
        if down {
            self.shared.epoch.fetch_add(1, Ordering::SeqCst);
            self.drop_watches(None);
        }
    }

    /// Open, not stalled watch streams of `resource`.
    pub fn watchers(&self, resource: Resource) -> usize {
        let store = self.shared.store();
        store
            .sinks
            .iter()
            .filter(|s| s.resource == resource && !s.stalled && !s.tx.is_closed())
            .count()
    }

    /// Waits until `resource` has at least `n` live watch streams; panics
    /// after `timeout`, listing the requests seen.
    pub async fn wait_for_watchers(&self, resource: Resource, n: usize, timeout: Duration) {
        let start = Instant::now();
        while self.watchers(resource) < n {
            assert!(
                start.elapsed() <= timeout,
                "no {n} watch(es) of {resource:?} after {timeout:?}; requests so far:\n{}",
                self.request_log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The Events posted so far, in order (a patched one as it is now).
    pub fn events(&self) -> Vec<Value> {
        self.shared.store().events.clone()
    }

    /// The next `times` posts (and patches) of Events are answered with
    /// HTTP `code`, as an API server that refuses them.
    pub fn fail_events(&self, code: u16, times: usize) {
        self.shared.store().event_faults = Some((code, times));
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.shared.store().requests.clone()
    }

    /// How many requests of `verb` on `resource` were answered 200.
    pub fn successes(&self, resource: Resource, verb: Verb) -> usize {
        self.requests()
            .iter()
            .filter(|r| r.resource == Some(resource) && r.verb == Some(verb) && r.status == 200)
            .count()
    }

    /// The requests so far, one a line, for failure messages.
    pub fn request_log(&self) -> String {
        self.requests()
            .iter()
            .map(|r| {
                let fault = r
                    .fault
                    .map(|f| format!(" (fault {f:?})"))
                    .unwrap_or_default();
                format!(
                    "  {} {}?{} -> {}{fault}\n",
                    r.method, r.path, r.query, r.status
                )
            })
            .collect()
    }
}

impl Store {
    fn record(&mut self, resource: Resource, type_: &'static str, object: &Value) {
        let line: Arc<str> = event_line(type_, object).into();
        let name = name_of(object);
        self.sinks.retain(|sink| {
            if !sink.wants(resource, name) || sink.stalled {
                return !sink.tx.is_closed();
            }
            sink.send(&line)
        });
        self.history.push_back(Change {
            rv: self.rv,
            resource,
            name: name.to_owned(),
            line,
        });
        self.trim_history();
    }

    fn trim_history(&mut self) {
        while self.history.len() > self.history_limit {
            if let Some(change) = self.history.pop_front() {
                self.compacted = change.rv;
            }
        }
    }

    fn take_fault(&mut self, resource: Resource, verb: Verb) -> Option<Fault> {
        let index = self
            .faults
            .iter()
            .position(|(r, v, _, n)| *r == resource && *v == verb && *n > 0)?;
        let entry = &mut self.faults[index];
        entry.3 -= 1;
        let fault = entry.2;
        if entry.3 == 0 {
            self.faults.remove(index);
        }
        Some(fault)
    }
}

fn name_of(object: &Value) -> &str {
    object["metadata"]["name"].as_str().unwrap_or_default()
}

/// `type` before `object`, as the API server's encoder writes it (a map
/// would sort `object` first).
fn event_line(type_: &str, object: &Value) -> String {
    format!("{{\"type\":{},\"object\":{object}}}\n", json!(type_))
}

fn status_object(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code,
    })
}

fn status_response(code: u16, reason: &str, message: &str) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(code).expect("a valid status code"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(status_object(code, reason, message).to_string()))
        .expect("a valid response")
}

fn reason_for(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        410 => "Expired",
        429 => "TooManyRequests",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "InternalError",
    }
}

/// Decodes `a=b&c=d` with percent-escapes (and `+` as a space).
fn parse_query(query: &str) -> HashMap<String, String> {
    fn hex(b: u8) -> Option<u8> {
        (b as char).to_digit(16).map(|d| d as u8)
    }
    fn decode(s: &str) -> String {
        let bytes = s.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            let escaped = (bytes[i] == b'%' && i + 2 < bytes.len())
                .then(|| Some(hex(bytes[i + 1])? << 4 | hex(bytes[i + 2])?))
                .flatten();
            match (bytes[i], escaped) {
                (_, Some(b)) => {
                    out.push(b);
                    i += 2;
                }
                (b'+', None) => out.push(b' '),
                (b, None) => out.push(b),
            }
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    }
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// The name a `fieldSelector` asks for (`Ok(None)`: none), or why it is not
/// supported.
fn name_selector(query: &HashMap<String, String>) -> Result<Option<String>, String> {
    if query.get("labelSelector").is_some_and(|s| !s.is_empty()) {
        return Err("the fake API server does not support labelSelector".into());
    }
    let Some(selector) = query.get("fieldSelector").filter(|s| !s.is_empty()) else {
        return Ok(None);
    };
    selector
        .strip_prefix("metadata.name==")
        .or_else(|| selector.strip_prefix("metadata.name="))
        .filter(|name| !name.contains(','))
        .map(|name| Some(name.to_owned()))
        .ok_or_else(|| {
            format!(
                "the fake API server supports only fieldSelector=metadata.name=X, not {selector:?}"
            )
        })
}

/// The namespace and, for a patch, the name of an Event at `path`.
fn event_path(path: &str) -> Option<(&str, Option<&str>)> {
    let rest = path
        .strip_prefix("/apis/events.k8s.io/v1/namespaces/")
        .or_else(|| path.strip_prefix("/api/v1/namespaces/"))?;
    let (namespace, rest) = rest.split_once('/')?;
    match rest.strip_prefix("events") {
        Some("") => Some((namespace, None)),
        Some(name) => Some((namespace, Some(name.strip_prefix('/')?))),
        None => None,
    }
}

/// A post or patch of an Event: stored, and answered with what is stored.
async fn handle_event(
    shared: &Shared,
    request: Request,
    namespace: &str,
    name: Option<&str>,
) -> Response {
    let method = request.method().clone();
    let body = match axum::body::to_bytes(request.into_body(), 1 << 20).await {
        Ok(body) => body,
        Err(e) => return status_response(400, "BadRequest", &format!("reading the body: {e}")),
    };
    let Ok(mut event) = serde_json::from_slice::<Value>(&body) else {
        return status_response(400, "BadRequest", "the body is not JSON");
    };
    let mut store = shared.store();
    if let Some((code, times)) = store.event_faults {
        store.event_faults = (times > 1).then_some((code, times - 1));
        return status_response(code, reason_for(code), "fault injected: event refused");
    }
    store.rv += 1;
    let rv = store.rv.to_string();
    match (method, name) {
        (Method::POST, None) => {
            event["metadata"]["namespace"] = json!(namespace);
            event["metadata"]["resourceVersion"] = json!(rv);
            store.events.push(event.clone());
            Response::builder()
                .status(StatusCode::CREATED)
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(event.to_string()))
                .expect("a valid response")
        }
        (Method::PATCH, Some(name)) => {
            let Some(stored) = store.events.iter_mut().find(|e| {
                e["metadata"]["name"] == json!(name)
                    && e["metadata"]["namespace"] == json!(namespace)
            }) else {
                return status_response(404, "NotFound", &format!("no event {namespace}/{name}"));
            };
            if let (Some(stored), Some(patch)) = (stored.as_object_mut(), event.as_object()) {
                for (k, v) in patch {
                    if k != "metadata" {
                        stored.insert(k.clone(), v.clone());
                    }
                }
            }
            stored["metadata"]["resourceVersion"] = json!(rv);
            let stored = stored.clone();
            Response::builder()
                .status(StatusCode::OK)
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(stored.to_string()))
                .expect("a valid response")
        }
        (method, _) => status_response(
            405,
            "MethodNotAllowed",
            &format!("{method} of events is not served"),
        ),
    }
}

async fn handle(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    if let Some((namespace, name)) = event_path(&path) {
        let (namespace, name) = (namespace.to_owned(), name.map(str::to_owned));
        let query = request.uri().query().unwrap_or_default().to_owned();
        let response = handle_event(&shared, request, &namespace, name.as_deref()).await;
        shared.store().requests.push(RequestRecord {
            method: method.to_string(),
            path,
            query,
            resource: None,
            verb: None,
            status: response.status().as_u16(),
            fault: None,
        });
        return response;
    }
    let raw_query = request.uri().query().unwrap_or_default().to_owned();
    let query = parse_query(&raw_query);
    let resource = Resource::from_path(&path);
    let watch = matches!(query.get("watch").map(String::as_str), Some("true" | "1"));
    let verb = resource.map(|_| if watch { Verb::Watch } else { Verb::List });

    let mut record = RequestRecord {
        method: method.to_string(),
        path: path.clone(),
        query: raw_query,
        resource,
        verb,
        status: 0,
        fault: None,
    };
    let resource = resource.filter(|r| !shared.store().withheld.contains(r));
    let (Some(resource), Some(verb)) = (resource, verb) else {
        record.status = 404;
        shared.store().requests.push(record);
        return status_response(
            404,
            "NotFound",
            &format!("the fake API server does not serve {path}"),
        );
    };
    if method != Method::GET {
        record.status = 405;
        shared.store().requests.push(record);
        return status_response(405, "MethodNotAllowed", &format!("{method} is not served"));
    }
    let fault = shared.store().take_fault(resource, verb);
    record.fault = fault;
    let response = match fault {
        Some(Fault::Status(code)) => status_response(
            code,
            reason_for(code),
            &format!("fault injected: {code} for {verb:?} {}", resource.kind()),
        ),
        Some(Fault::Gone) => {
            status_response(410, "Expired", "fault injected: too old resource version")
        }
        Some(Fault::Stall) => {
            record.status = 504;
            shared.store().requests.push(record);
            tokio::time::sleep(STALL_LIMIT).await;
            return status_response(504, "Timeout", "fault injected: stalled request gave up");
        }
        Some(Fault::Delay(delay)) => {
            tokio::time::sleep(delay).await;
            serve(&shared, resource, verb, &query)
        }
        None => serve(&shared, resource, verb, &query),
    };
    record.status = response.status().as_u16();
    shared.store().requests.push(record);
    response
}

/// A list or watch answered from the store.
fn serve(
    shared: &Shared,
    resource: Resource,
    verb: Verb,
    query: &HashMap<String, String>,
) -> Response {
    match name_selector(query) {
        Err(message) => status_response(400, "BadRequest", &message),
        Ok(name) => match verb {
            Verb::List => list(shared, resource, name.as_deref(), query),
            Verb::Watch => watch_stream(shared, resource, name, query),
        },
    }
}

fn list(
    shared: &Shared,
    resource: Resource,
    name: Option<&str>,
    query: &HashMap<String, String>,
) -> Response {
    let limit = query
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0);
    let mut store = shared.store();
    let page = match query.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => match store.pages.remove(token) {
            Some(page) if page.resource == resource => page,
            _ => {
                return status_response(
                    410,
                    "Expired",
                    "the provided continue parameter is too old or unknown",
                );
            }
        },
        None => Page {
            resource,
            rv: store.rv,
            // Items keep their kind and apiVersion (the API server leaves
            // them out of lists; clients accept both).
            items: store
                .objects
                .range((resource, String::new(), String::new())..)
                .take_while(|((r, _, _), _)| *r == resource)
                .filter(|((_, _, n), _)| name.is_none_or(|x| x == n))
                .map(|(_, stored)| Arc::clone(&stored.json))
                .collect(),
        },
    };
    let Page { rv, mut items, .. } = page;
    let rest = match limit {
        Some(limit) if items.len() > limit => items.split_off(limit),
        _ => VecDeque::new(),
    };
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if !rest.is_empty() {
        store.next_token += 1;
        let token = format!("page-{}", store.next_token);
        metadata["continue"] = json!(token);
        metadata["remainingItemCount"] = json!(rest.len());
        store.pages.insert(
            token,
            Page {
                resource,
                rv,
                items: rest,
            },
        );
    }
    drop(store);
    let mut body = String::with_capacity(items.iter().map(|i| i.len() + 1).sum::<usize>() + 200);
    body.push_str(&format!(
        r#"{{"apiVersion":"{}","kind":"{}List","metadata":{metadata},"items":["#,
        resource.api_version(),
        resource.kind()
    ));
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(item);
    }
    body.push_str("]}");
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .expect("a valid response")
}

fn watch_stream(
    shared: &Shared,
    resource: Resource,
    name: Option<String>,
    query: &HashMap<String, String>,
) -> Response {
    let from = query
        .get("resourceVersion")
        .filter(|v| !v.is_empty())
        .map(|v| v.parse::<u64>());
    let from = match from {
        None => 0,
        Some(Ok(rv)) => rv,
        Some(Err(_)) => {
            return status_response(400, "BadRequest", "resourceVersion is not a number");
        }
    };
    let (tx, rx) = mpsc::unbounded::<io::Result<String>>();
    let mut store = shared.store();
    let sink = Sink {
        resource,
        name,
        tx,
        bookmarks: query.get("allowWatchBookmarks").map(String::as_str) == Some("true"),
        last_bookmark: Instant::now(),
        deadline: query
            .get("timeoutSeconds")
            .and_then(|t| t.parse::<u64>().ok())
            .map(|t| Instant::now() + Duration::from_secs(t)),
        stalled: false,
    };
    let mut open = true;
    if from == 0 {
        for ((r, _, name), stored) in &store.objects {
            if *r == resource && sink.wants(resource, name) {
                open &= sink.send(&event_line("ADDED", &stored.object));
            }
        }
    } else if from < store.compacted {
        let message = format!("too old resource version: {from} ({})", store.compacted + 1);
        sink.send(&event_line(
            "ERROR",
            &status_object(410, "Expired", &message),
        ));
        open = false;
    } else {
        for change in &store.history {
            if change.rv > from && sink.wants(change.resource, &change.name) {
                open &= sink.send(&change.line);
            }
        }
    }
    if open {
        store.sinks.push(sink);
    }
    drop(store);
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(rx))
        .expect("a valid response")
}

/// Bookmarks, watch timeouts, and forgetting closed streams.
async fn tick(shared: Arc<Shared>) {
    let mut interval = tokio::time::interval(TICK);
    loop {
        interval.tick().await;
        let mut store = shared.store();
        let now = Instant::now();
        let rv = store.rv;
        let every = store.bookmark_interval;
        store.sinks.retain_mut(|sink| {
            if sink.tx.is_closed() || sink.deadline.is_some_and(|d| now >= d) {
                return false;
            }
            if sink.bookmarks && !sink.stalled && now - sink.last_bookmark >= every {
                sink.last_bookmark = now;
                let bookmark = json!({
                    "kind": sink.resource.kind(),
                    "apiVersion": sink.resource.api_version(),
                    "metadata": {"resourceVersion": rv.to_string()},
                });
                return sink.send(&event_line("BOOKMARK", &bookmark));
            }
            true
        });
    }
}

/// Accepts connections, except while the server is down.
struct FlakyListener {
    inner: TcpListener,
    shared: Arc<Shared>,
}

impl Listener for FlakyListener {
    type Io = Conn;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Conn, SocketAddr) {
        loop {
            let Ok((stream, addr)) = self.inner.accept().await else {
                // Out of file descriptors and the like: try again.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            if self.shared.down.load(Ordering::SeqCst) {
                drop(stream);
                continue;
            }
            let epoch = self.shared.epoch.load(Ordering::SeqCst);
            return (
                Conn {
                    stream,
                    epoch,
                    shared: Arc::clone(&self.shared),
                },
                addr,
            );
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// A connection that breaks once the server has gone down after it was
/// accepted.
struct Conn {
    stream: TcpStream,
    epoch: u64,
    shared: Arc<Shared>,
}

impl Conn {
    fn broken(&self) -> Option<io::Error> {
        (self.shared.epoch.load(Ordering::SeqCst) != self.epoch).then(|| {
            io::Error::new(
                io::ErrorKind::ConnectionReset,
                "fault injected: the API server went down",
            )
        })
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(e) = self.broken() {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.broken() {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// The fake API server, listening in `node`'s namespace, and its runtime: one
/// worker thread, while the test's thread drives the (blocking) traffic. The
/// server lives as long as the runtime.
pub fn serve_in(node: &ebpf_proxy_tests::netns::NetNs) -> (tokio::runtime::Runtime, ApiServer) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let listener = node
        .run(|| std::net::TcpListener::bind("127.0.0.1:0"))
        .expect("enter the node namespace")
        .expect("bind the fake API server in the node namespace");
    listener.set_nonblocking(true).expect("non-blocking");
    let server = {
        let _context = runtime.enter();
        let listener = TcpListener::from_std(listener).expect("listener");
        ApiServer::serve(listener)
    };
    (runtime, server)
}

// ---- Objects, as `kubectl get -o json` shows them. ----

/// `namespace/name`: ClusterIP `cluster_ip`, port `http` 80/TCP to the
/// endpoints' port named `http`.
pub fn service(namespace: &str, name: &str, cluster_ip: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": cluster_ip, "clusterIPs": [cluster_ip],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": "http"}],
        },
    })
}

/// An EndpointSlice of `service` with port `http` 8080/TCP and one ready
/// endpoint per address, on `node`.
pub fn slice(namespace: &str, name: &str, service: &str, node: &str, ips: &[&str]) -> Value {
    slice_on(namespace, name, service, node, ("http", 8080, "TCP"), ips)
}

/// `slice` with port `port` (its `port_name` and `protocol`).
pub fn slice_on(
    namespace: &str,
    name: &str,
    service: &str,
    node: &str,
    (port_name, port, protocol): (&str, u16, &str),
    ips: &[&str],
) -> Value {
    let endpoints: Vec<Value> = ips
        .iter()
        .map(|ip| {
            json!({
                "addresses": [ip],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "nodeName": node,
            })
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": name, "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": port_name, "port": port, "protocol": protocol}],
    })
}

/// A Node, in `zone` when given.
pub fn node(name: &str, zone: Option<&str>) -> Value {
    let mut labels = json!({"kubernetes.io/hostname": name});
    if let Some(zone) = zone {
        labels["topology.kubernetes.io/zone"] = json!(zone);
    }
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels},
    })
}

/// A `ServiceCIDR` named `name` giving `cidrs`.
pub fn service_cidr(name: &str, cidrs: &[&str]) -> Value {
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": name},
        "spec": {"cidrs": cidrs},
    })
}
