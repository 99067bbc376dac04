//! The Kubernetes API source: Services and EndpointSlices of every namespace,
//! this node's Node and the cluster's `ServiceCIDR`s, list-watched through
//! kube-rs. An API server that serves no `ServiceCIDR` (older than 1.33,
//! or the agent not allowed to list them) is said once and not asked again:
//! the agent then takes `--service-cluster-ip-range`.
//!
//! Each kind has its own [`watcher`] with client-go's backoff
//! ([`WatchStreamExt::default_backoff`]). A listing (`Init`, `InitApply`...,
//! `InitDone`) is buffered and sent as one [`SourceEvent::Replace`], so the
//! consumer swaps the whole kind at once and diffs it against what it has:
//! a re-list after a reconnect or a `410 Gone` costs nothing where nothing
//! moved. Watch events after the listing become `Apply` and `Delete`.
//!
//! Failures never empty the consumer's state: API errors (refused
//! connections, 5xx, expired resource versions, dropped or stalled streams)
//! are logged and retried by the watcher's backoff while the datapath keeps
//! what it has, and the listing that follows recovery is diffed, not
//! flushed. An object the API returns that does not decode is skipped with
//! an error naming it; the others of its listing or stream still arrive (a
//! typed kube-rs watcher would instead fail the whole listing, forever, and
//! report a stream error naming nothing). When such an object is in a
//! re-list and was good before, its last good version stays.
//!
//! No label selector is sent: which Services are ours (the
//! `service.kubernetes.io/service-proxy-name` and `headless` labels) is the
//! model's decision, so a label toggle arrives as an ordinary update.

use std::{
    borrow::Cow,
    collections::BTreeSet,
    fmt::Debug,
    path::{Path, PathBuf},
    time::Duration,
};

use ::kube::{
    Api, Client, Config, Resource,
    config::{InClusterError, KubeConfigOptions, Kubeconfig, KubeconfigError},
    runtime::{
        WatchStreamExt,
        watcher::{self, Event, watcher},
    },
};
// The `http` crate kube-rs speaks, as axum re-exports it.
use axum::http::Uri;
use futures::StreamExt;
use k8s_openapi::{
    api::{
        core::v1::Node, core::v1::Service, discovery::v1::EndpointSlice,
        networking::v1::ServiceCIDR,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde::{Deserialize, Deserializer, de::DeserializeOwned};
use serde_json::value::RawValue;
use tokio::sync::mpsc;
use tracing::{Instrument, error, info, info_span, warn};

use super::{Kind, Object, ObjectKey, SourceEvent};

/// How long to wait before starting a watcher over when the API server
/// answered a watch request itself with `410 Gone` (see [`restart_needed`]).
const RESTART_DELAY: Duration = Duration::from_secs(1);
/// Objects per page of a listing (client-go's reflectors use 500 too): the
/// agent's peak memory during a listing grows with it, not with the
/// cluster.
pub const LIST_PAGE_SIZE: u32 = 500;

#[derive(Debug, thiserror::Error)]
pub enum KubeSourceError {
    #[error("--master {url:?} is not a usable URL: {reason}")]
    Master { url: String, reason: String },
    #[error("kubeconfig {}: {source}", path.display())]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: KubeconfigError,
    },
    #[error("--kubeconfig {}: names no file", paths.display())]
    NoKubeconfigFile { paths: PathBuf },
    #[error(
        "no API server to talk to: not in a cluster ({incluster}) and no usable default kubeconfig ({kubeconfig}); pass --kubeconfig or --master"
    )]
    NoConfig {
        incluster: InClusterError,
        kubeconfig: KubeconfigError,
    },
    #[error("creating the API client for {server}: {source}")]
    Client {
        server: String,
        #[source]
        source: ::kube::Error,
    },
    #[error("the node name is empty: pass --node-name or set NODE_NAME")]
    EmptyNodeName,
    /// An object from the API that does not decode (or has no name).
    #[error("{kind:?} {object}: {reason}; {outcome}")]
    Malformed {
        kind: Kind,
        object: String,
        reason: String,
        outcome: &'static str,
    },
    /// A list or watch request failed; the watcher retries it.
    #[error("{kind:?} list/watch: {source}; retrying with backoff, the datapath keeps its state")]
    Watch {
        kind: Kind,
        #[source]
        source: watcher::Error,
    },
}

/// The client configuration kube-proxy would pick from these flags:
/// `--kubeconfig` (a path list like `KUBECONFIG`, merged) when given;
/// otherwise the in-cluster service account; otherwise, with `--master`,
/// that server without credentials; otherwise `~/.kube/config`. `--master`
/// overrides the server of whichever configuration applies.
///
/// Without kube-proxy, the in-cluster address (the `kubernetes` Service's
/// ClusterIP) is served by this proxy itself: point `--master` (or
/// `KUBERNETES_SERVICE_HOST`/`_PORT`) at the API server's real address.
pub async fn config(
    kubeconfig: Option<PathBuf>,
    master: Option<String>,
) -> Result<Config, KubeSourceError> {
    let master = master.as_deref().map(parse_master).transpose()?;
    let (mut config, origin) = match kubeconfig {
        Some(paths) => (
            from_kubeconfig(&paths).await?,
            format!("kubeconfig {}", paths.display()),
        ),
        None => match Config::incluster() {
            Ok(config) => (config, "in-cluster service account".to_owned()),
            Err(incluster) => match &master {
                Some(uri) => (Config::new(uri.clone()), "--master".to_owned()),
                None => match Config::from_kubeconfig(&KubeConfigOptions::default()).await {
                    Ok(config) => (config, "default kubeconfig".to_owned()),
                    Err(kubeconfig) => {
                        return Err(KubeSourceError::NoConfig {
                            incluster,
                            kubeconfig,
                        });
                    }
                },
            },
        },
    };
    if let Some(uri) = master {
        config.cluster_url = uri;
    }
    info!(server = %config.cluster_url, from = %origin, "API server");
    Ok(config)
}

/// A client for [`config`]'s choice.
pub async fn client(
    kubeconfig: Option<PathBuf>,
    master: Option<String>,
) -> Result<Client, KubeSourceError> {
    let config = config(kubeconfig, master).await?;
    let server = config.cluster_url.to_string();
    Client::try_from(config).map_err(|source| KubeSourceError::Client { server, source })
}

fn parse_master(url: &str) -> Result<Uri, KubeSourceError> {
    let invalid = |reason: String| KubeSourceError::Master {
        url: url.to_owned(),
        reason,
    };
    let uri: Uri = url.parse().map_err(|e| invalid(format!("{e}")))?;
    match uri.scheme_str() {
        Some("http" | "https") if uri.host().is_some() => Ok(uri),
        _ => Err(invalid(
            "expected http(s)://host[:port], as in https://10.0.0.1:6443".into(),
        )),
    }
}

/// Reads a kubeconfig path list (`a:b`, as `KUBECONFIG` holds), merging the
/// files in order as kubectl does.
async fn from_kubeconfig(paths: &Path) -> Result<Config, KubeSourceError> {
    let mut merged: Option<Kubeconfig> = None;
    for path in std::env::split_paths(paths).filter(|p| !p.as_os_str().is_empty()) {
        let error = |source| KubeSourceError::Kubeconfig {
            path: path.clone(),
            source,
        };
        let file = Kubeconfig::read_from(&path).map_err(error)?;
        merged = Some(match merged {
            None => file,
            Some(earlier) => earlier.merge(file).map_err(error)?,
        });
    }
    let merged = merged.ok_or_else(|| KubeSourceError::NoKubeconfigFile {
        paths: paths.to_owned(),
    })?;
    Config::from_custom_kubeconfig(merged, &KubeConfigOptions::default())
        .await
        .map_err(|source| KubeSourceError::Kubeconfig {
            path: paths.to_owned(),
            source,
        })
}

/// Follows Services and EndpointSlices in every namespace and the Node
/// `node_name`, sending what changes to `tx` (see the module doc).
///
/// Runs until the receiver is dropped, then returns `Ok`. API failures are
/// retried forever, so the only error is a configuration one.
pub async fn watch(
    client: Client,
    node_name: String,
    tx: mpsc::Sender<SourceEvent>,
) -> Result<(), KubeSourceError> {
    if node_name.is_empty() {
        return Err(KubeSourceError::EmptyNodeName);
    }
    // Listed in pages of LIST_PAGE_SIZE, as client-go's reflectors ask: a
    // kind is never held whole as the API sent it, only as the model keeps
    // it (docs/operations.md, "Memory"). kube-rs does not send
    // resourceVersion=0 with a limit, so the pages are read from etcd, at
    // the revision of the first.
    let list = || watcher::Config {
        page_size: Some(LIST_PAGE_SIZE),
        ..watcher::Config::default().any_semantic()
    };
    let node_selector = format!("metadata.name={node_name}");
    tokio::join!(
        follow::<Service>(Api::all(client.clone()), list(), tx.clone())
            .instrument(info_span!("kube_source", kind = "Service")),
        follow::<EndpointSlice>(Api::all(client.clone()), list(), tx.clone())
            .instrument(info_span!("kube_source", kind = "EndpointSlice")),
        follow::<Node>(
            Api::all(client.clone()),
            list().fields(&node_selector),
            tx.clone()
        )
        .instrument(info_span!("kube_source", kind = "Node", node = %node_name)),
        follow::<ServiceCIDR>(Api::all(client), list(), tx)
            .instrument(info_span!("kube_source", kind = "ServiceCIDR")),
    );
    Ok(())
}

/// A kind the source follows.
trait Watched:
    Resource<DynamicType = ()> + DeserializeOwned + Clone + Debug + Send + Sync + 'static
{
    const KIND: Kind;
    /// Whether an API server may not serve the kind at all: then a 404 or
    /// 403 ends its watch, as an empty listing, rather than being retried.
    const OPTIONAL: bool = false;
    fn into_object(self: Box<Self>) -> Object;
}

impl Watched for Service {
    const KIND: Kind = Kind::Service;
    fn into_object(self: Box<Self>) -> Object {
        Object::service(&self)
    }
}

impl Watched for EndpointSlice {
    const KIND: Kind = Kind::EndpointSlice;
    fn into_object(self: Box<Self>) -> Object {
        Object::slice(&self)
    }
}

impl Watched for Node {
    const KIND: Kind = Kind::Node;
    fn into_object(self: Box<Self>) -> Object {
        Object::Node(self)
    }
}

impl Watched for ServiceCIDR {
    const KIND: Kind = Kind::ServiceCidr;
    const OPTIONAL: bool = true;
    fn into_object(self: Box<Self>) -> Object {
        Object::service_cidr(&self)
    }
}

/// An object as the API sent it: decoded, or the reason it does not decode
/// with whatever of its metadata does. Watching this type instead of `K`
/// keeps one bad object from failing a whole listing or stream.
#[derive(Clone, Debug)]
enum Lenient<K> {
    Valid(Box<K>),
    Malformed {
        metadata: Box<ObjectMeta>,
        reason: String,
    },
}

impl<'de, K: DeserializeOwned + Resource> Deserialize<'de> for Lenient<K> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Taken as raw text first: serde_json skips a raw value without its
        // 128-level nesting limit, so an object nested deeper than that fails
        // alone here instead of failing its whole listing or watch stream.
        let raw = Box::<RawValue>::deserialize(deserializer)?;
        match serde_json::from_str::<K>(raw.get()) {
            Ok(mut object) => {
                // The API server's field ownership bookkeeping: often most of
                // an object's bytes and of no use to a proxy.
                object.meta_mut().managed_fields = None;
                Ok(Lenient::Valid(Box::new(object)))
            }
            Err(_) => Ok(Lenient::Malformed {
                metadata: Box::new(lenient_metadata(raw.get())),
                reason: decode_error::<K>(raw.get()),
            }),
        }
    }
}

/// Why `raw` does not decode as `K`, with the path of the field at fault
/// ("spec.ports: invalid type: ..."). Decoded again to learn it: only bad
/// objects pay for tracking the path.
fn decode_error<K: DeserializeOwned>(raw: &str) -> String {
    let mut deserializer = serde_json::Deserializer::from_str(raw);
    let Err(e) = serde_path_to_error::deserialize::<_, K>(&mut deserializer) else {
        return "does not decode".into();
    };
    let inner = e.inner();
    // The position is in the text as the API sent it, which an operator
    // does not have; the path says where instead.
    let message = inner.to_string();
    let position = format!(" at line {} column {}", inner.line(), inner.column());
    let message = message.strip_suffix(&position).unwrap_or(&message);
    match e.path().to_string().as_str() {
        "." => message.to_owned(),
        path => format!("{path}: {message}"),
    }
}

/// Only the metadata of an object, the rest skipped unparsed.
#[derive(Deserialize)]
struct MetadataOf<'a> {
    #[serde(borrow, default)]
    metadata: Option<&'a RawValue>,
}

/// The identifying strings of metadata that does not decode as a whole.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NamesOf<'a> {
    #[serde(borrow, default)]
    name: Option<&'a RawValue>,
    #[serde(borrow, default)]
    namespace: Option<&'a RawValue>,
    #[serde(borrow, default)]
    resource_version: Option<&'a RawValue>,
}

/// The metadata of an object that does not decode: all of it if that part
/// decodes, else whichever of the name, namespace and resourceVersion are
/// strings.
fn lenient_metadata(raw: &str) -> ObjectMeta {
    let Some(metadata) = serde_json::from_str::<MetadataOf>(raw)
        .ok()
        .and_then(|o| o.metadata)
    else {
        return ObjectMeta::default();
    };
    if let Ok(parsed) = serde_json::from_str::<ObjectMeta>(metadata.get()) {
        return ObjectMeta {
            managed_fields: None,
            ..parsed
        };
    }
    let Ok(names) = serde_json::from_str::<NamesOf>(metadata.get()) else {
        return ObjectMeta::default();
    };
    let string = |field: Option<&RawValue>| field.and_then(|v| serde_json::from_str(v.get()).ok());
    ObjectMeta {
        name: string(names.name),
        namespace: string(names.namespace),
        resource_version: string(names.resource_version),
        ..Default::default()
    }
}

impl<K: Resource<DynamicType = ()>> Resource for Lenient<K> {
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        K::kind(dt)
    }
    fn group(dt: &()) -> Cow<'_, str> {
        K::group(dt)
    }
    fn version(dt: &()) -> Cow<'_, str> {
        K::version(dt)
    }
    fn api_version(dt: &()) -> Cow<'_, str> {
        K::api_version(dt)
    }
    fn plural(dt: &()) -> Cow<'_, str> {
        K::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        match self {
            Lenient::Valid(object) => object.meta(),
            Lenient::Malformed { metadata, .. } => metadata,
        }
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        match self {
            Lenient::Valid(object) => object.meta_mut(),
            Lenient::Malformed { metadata, .. } => metadata,
        }
    }
}

/// What the source knows of one object it received.
enum Received {
    Valid(ObjectKey, Object),
    /// Does not decode; its key when it has a name.
    Malformed(Option<ObjectKey>, String),
}

fn receive<K: Watched>(object: Lenient<K>) -> Received {
    let key = ObjectKey::of_meta(object.meta());
    match (object, key) {
        (Lenient::Valid(object), Some(key)) => Received::Valid(key, object.into_object()),
        (Lenient::Valid(_), None) => Received::Malformed(None, "metadata.name is missing".into()),
        (Lenient::Malformed { reason, .. }, key) => Received::Malformed(key, reason),
    }
}

fn describe(key: Option<&ObjectKey>) -> String {
    key.map_or_else(|| "<unnamed>".to_owned(), ObjectKey::to_string)
}

/// One kind's view of what the consumer has been told, to turn listings
/// and watch events into [`SourceEvent`]s.
#[derive(Debug)]
struct Follower {
    kind: Kind,
    /// Keys of the objects the consumer holds (sent and not deleted since).
    known: BTreeSet<ObjectKey>,
    /// The listing being received, between `Init` and `InitDone`.
    listing: Option<Listing>,
}

#[derive(Debug, Default)]
struct Listing {
    objects: Vec<(ObjectKey, Object)>,
    malformed: Vec<ObjectKey>,
}

impl Follower {
    fn new(kind: Kind) -> Self {
        Follower {
            kind,
            known: BTreeSet::new(),
            listing: None,
        }
    }

    fn malformed(&self, key: Option<&ObjectKey>, reason: String) {
        let outcome = match key {
            Some(key) if self.known.contains(key) => "skipped, its last good version stays",
            _ => "skipped",
        };
        let e = KubeSourceError::Malformed {
            kind: self.kind,
            object: describe(key),
            reason,
            outcome,
        };
        error!(error = %e, "malformed object");
    }

    /// The events for one watcher event, in order.
    fn on_event<K: Watched>(&mut self, event: Event<Lenient<K>>) -> Vec<SourceEvent> {
        match event {
            Event::Init => {
                self.listing = Some(Listing::default());
                Vec::new()
            }
            Event::InitApply(object) => {
                match receive(object) {
                    Received::Valid(key, object) => {
                        self.listing
                            .get_or_insert_default()
                            .objects
                            .push((key, object));
                    }
                    Received::Malformed(key, reason) => {
                        self.malformed(key.as_ref(), reason);
                        if let Some(key) = key {
                            self.listing.get_or_insert_default().malformed.push(key);
                        }
                    }
                }
                Vec::new()
            }
            Event::InitDone => {
                let listing = self.listing.take().unwrap_or_default();
                self.finish(listing)
            }
            Event::Apply(object) => match receive(object) {
                Received::Valid(key, object) => {
                    self.known.insert(key);
                    vec![SourceEvent::Apply(object)]
                }
                Received::Malformed(key, reason) => {
                    self.malformed(key.as_ref(), reason);
                    Vec::new()
                }
            },
            Event::Delete(object) => {
                // A deleted object goes whether or not it decodes.
                let Some(key) = ObjectKey::of_meta(object.meta()) else {
                    self.malformed(None, "deleted without metadata.name".into());
                    return Vec::new();
                };
                self.known.remove(&key);
                vec![SourceEvent::Delete {
                    kind: self.kind,
                    key,
                }]
            }
        }
    }

    /// A complete listing: normally one `Replace`. When objects the
    /// consumer holds come back malformed, a `Replace` would delete them;
    /// instead the listed objects are applied and only the unlisted ones
    /// deleted, so their last good versions stay.
    fn finish(&mut self, listing: Listing) -> Vec<SourceEvent> {
        let Listing { objects, malformed } = listing;
        info!(
            objects = objects.len(),
            malformed = malformed.len(),
            "listed"
        );
        let kept: BTreeSet<ObjectKey> = malformed
            .into_iter()
            .filter(|key| self.known.contains(key))
            .collect();
        // The keys are moved out, not copied: a first listing has 100,000.
        let (keys, objects): (Vec<ObjectKey>, Vec<Object>) = objects.into_iter().unzip();
        let listed: BTreeSet<ObjectKey> = keys.into_iter().chain(kept.iter().cloned()).collect();
        let gone: Vec<ObjectKey> = self.known.difference(&listed).cloned().collect();
        self.known = listed;
        if kept.is_empty() {
            return vec![SourceEvent::Replace {
                kind: self.kind,
                objects,
            }];
        }
        gone.into_iter()
            .map(|key| SourceEvent::Delete {
                kind: self.kind,
                key,
            })
            .chain(objects.into_iter().map(SourceEvent::Apply))
            .collect()
    }
}

/// Whether the watcher cannot get out of this error by itself: kube-rs
/// retries a watch that the API server refused with `410 Gone` from the
/// same (expired) resourceVersion forever. API servers report an expired
/// version inside the watch stream, which kube-rs handles by re-listing,
/// but a proxy in front of one might answer the request itself.
fn restart_needed(error: &watcher::Error) -> bool {
    matches!(error, watcher::Error::WatchStartFailed(::kube::Error::Api(status)) if status.code == 410)
}

/// The API status code of a listing the API server refused: 404 where it
/// serves no such kind, 403 where the agent may not list it.
fn listing_refused(error: &watcher::Error) -> Option<u16> {
    match error {
        watcher::Error::InitialListFailed(::kube::Error::Api(status))
            if matches!(status.code, 403 | 404) =>
        {
            Some(status.code)
        }
        _ => None,
    }
}

/// List-watches one kind until the receiver is gone.
async fn follow<K: Watched>(
    api: Api<Lenient<K>>,
    config: watcher::Config,
    tx: mpsc::Sender<SourceEvent>,
) {
    let mut follower = Follower::new(K::KIND);
    let mut failing = false;
    loop {
        let mut stream = watcher(api.clone(), config.clone())
            .default_backoff()
            .boxed();
        loop {
            let next = tokio::select! {
                biased;
                () = tx.closed() => return,
                next = stream.next() => next,
            };
            let event = match next {
                Some(Ok(event)) => event,
                Some(Err(source)) => {
                    if K::OPTIONAL
                        && let Some(code) = listing_refused(&source)
                    {
                        info!(
                            code,
                            "the API server serves no {:?} objects to this agent (HTTP {code}); not asked again",
                            K::KIND
                        );
                        let none = SourceEvent::Replace {
                            kind: K::KIND,
                            objects: Vec::new(),
                        };
                        let _ = tx.send(none).await;
                        return;
                    }
                    let restart = restart_needed(&source);
                    let e = KubeSourceError::Watch {
                        kind: K::KIND,
                        source,
                    };
                    warn!(error = %e, "API error");
                    failing = true;
                    if restart {
                        warn!("the API server refused the watch as expired; listing again");
                        tokio::select! {
                            () = tx.closed() => return,
                            () = tokio::time::sleep(RESTART_DELAY) => break,
                        }
                    }
                    continue;
                }
                // The watcher retries forever and never ends; if it ever
                // does, start another.
                None => break,
            };
            if failing {
                failing = false;
                info!("API requests succeed again");
            }
            for event in follower.on_event(event) {
                if tx.send(event).await.is_err() {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use k8s_openapi::api::core::v1::ServiceSpec;
    use serde_json::{Value, json};

    use super::*;

    fn service_json(name: &str, cluster_ip: &str, rv: &str) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {
                "name": name, "namespace": "demo", "resourceVersion": rv,
                "managedFields": [{"manager": "kubectl", "operation": "Apply"}]
            },
            "spec": {"clusterIP": cluster_ip, "ports": [{"name": "http", "port": 80}]}
        })
    }

    fn lenient(value: Value) -> Lenient<Service> {
        serde_json::from_value(value).expect("any JSON object is a Lenient")
    }

    fn key(name: &str) -> ObjectKey {
        ObjectKey {
            namespace: "demo".into(),
            name: name.into(),
        }
    }

    /// A compact picture of events: "Replace Service [a, b]", "Apply demo/a",
    /// "Delete demo/a".
    fn summary(events: &[SourceEvent]) -> Vec<String> {
        fn name(object: &Object) -> String {
            object.key().map(|k| k.to_string()).unwrap_or_default()
        }
        events
            .iter()
            .map(|event| match event {
                SourceEvent::Replace { kind, objects } => format!(
                    "Replace {kind:?} [{}]",
                    objects.iter().map(name).collect::<Vec<_>>().join(", ")
                ),
                SourceEvent::Apply(object) => format!("Apply {}", name(object)),
                SourceEvent::Delete { kind, key } => format!("Delete {kind:?} {key}"),
            })
            .collect()
    }

    #[test]
    fn valid_objects_decode_without_managed_fields() {
        let Lenient::Valid(service) = lenient(service_json("web", "10.96.0.10", "7")) else {
            panic!("a valid Service must decode");
        };
        assert_eq!(
            service.metadata.managed_fields, None,
            "managedFields dropped"
        );
        assert_eq!(
            service.spec.as_ref().and_then(|s| s.cluster_ip.as_deref()),
            Some("10.96.0.10"),
            "spec kept"
        );
    }

    #[test]
    fn malformed_objects_keep_their_names_and_the_reason() {
        let mut value = service_json("broken", "10.96.0.11", "8");
        value["spec"]["ports"] = json!("not-a-list");
        let Lenient::Malformed { metadata, reason } = lenient(value) else {
            panic!("spec.ports as a string must not decode");
        };
        assert_eq!(
            ObjectKey::of_meta(&metadata),
            Some(key("broken")),
            "the key survives a bad spec"
        );
        assert_eq!(metadata.resource_version.as_deref(), Some("8"));
        assert_eq!(metadata.managed_fields, None, "managedFields dropped");
        assert!(
            reason == "spec.ports: invalid type: string \"not-a-list\", expected a sequence",
            "the decoder's reason: {reason}"
        );

        // Even broken metadata keeps the strings it has.
        let Lenient::Malformed { metadata, .. } = lenient(json!({
            "metadata": {"name": "odd", "namespace": "demo", "resourceVersion": "9", "labels": "x"},
        })) else {
            panic!("labels as a string must not decode");
        };
        assert_eq!(
            ObjectKey::of_meta(&metadata),
            Some(key("odd")),
            "name from raw strings"
        );
        assert_eq!(metadata.resource_version.as_deref(), Some("9"));
    }

    #[test]
    fn lists_of_lenient_objects_survive_bad_items() {
        let mut broken = service_json("broken", "10.96.0.11", "8");
        broken["spec"]["ports"] = json!("not-a-list");
        let list: ::kube::core::ObjectList<Lenient<Service>> = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ServiceList",
            "metadata": {"resourceVersion": "10"},
            "items": [service_json("a", "10.96.0.1", "1"), broken, service_json("b", "10.96.0.2", "2")]
        }))
        .expect("a list with a bad item still decodes");
        let verdicts: Vec<bool> = list
            .items
            .iter()
            .map(|o| matches!(o, Lenient::Valid(_)))
            .collect();
        assert_eq!(
            verdicts,
            [true, false, true],
            "only the bad item is malformed"
        );
    }

    /// `depth` arrays around a number: deeper than `serde_json`'s 128-level
    /// limit when `depth` is over 127.
    fn nested(depth: usize) -> String {
        format!("{}1{}", "[".repeat(depth), "]".repeat(depth))
    }

    #[test]
    fn an_object_nested_past_the_parser_limit_fails_alone() {
        let item = |name: &str| service_json(name, "10.96.0.1", "1").to_string();
        let deep = format!(
            r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"deep","namespace":"demo"}},"spec":{{"clusterIPs":{}}}}}"#,
            nested(300)
        );
        let list = format!(
            r#"{{"apiVersion":"v1","kind":"ServiceList","metadata":{{"resourceVersion":"10"}},"items":[{},{deep},{}]}}"#,
            item("a"),
            item("b")
        );
        let list: ::kube::core::ObjectList<Lenient<Service>> =
            serde_json::from_str(&list).expect("a list with a deeply nested item still decodes");
        let verdicts: Vec<_> = list
            .items
            .iter()
            .map(|o| match o {
                Lenient::Valid(s) => format!("valid {:?}", s.metadata.name),
                Lenient::Malformed { metadata, reason } => {
                    format!("malformed {:?}: {reason}", metadata.name)
                }
            })
            .collect();
        assert_eq!(verdicts.len(), 3, "{verdicts:?}");
        assert_eq!(verdicts[0], "valid Some(\"a\")");
        assert!(
            verdicts[1].starts_with("malformed Some(\"deep\"): "),
            "the deep item is skipped by name: {verdicts:?}"
        );
        assert_eq!(verdicts[2], "valid Some(\"b\")");

        // A watch line as the API server writes it, and deep metadata.
        let line = format!(
            r#"{{"type":"ADDED","object":{{"metadata":{{"name":"x","namespace":"demo","labels":{{"a":{}}}}}}}}}"#,
            nested(300)
        );
        let event: ::kube::core::WatchEvent<Lenient<Service>> =
            serde_json::from_str(&line).expect("a deep watch event decodes");
        let ::kube::core::WatchEvent::Added(Lenient::Malformed { metadata, .. }) = event else {
            panic!("deep labels must not decode: {event:?}");
        };
        assert_eq!(
            ObjectKey::of_meta(&metadata),
            Some(key("x")),
            "named from its strings"
        );
    }

    fn apply(value: Value) -> Event<Lenient<Service>> {
        Event::Apply(lenient(value))
    }

    fn listing(values: Vec<Value>) -> Vec<Event<Lenient<Service>>> {
        std::iter::once(Event::Init)
            .chain(values.into_iter().map(|v| Event::InitApply(lenient(v))))
            .chain(std::iter::once(Event::InitDone))
            .collect()
    }

    fn feed(follower: &mut Follower, events: Vec<Event<Lenient<Service>>>) -> Vec<String> {
        let out: Vec<SourceEvent> = events
            .into_iter()
            .flat_map(|e| follower.on_event(e))
            .collect();
        summary(&out)
    }

    #[test]
    fn listings_become_replaces_and_watch_events_applies_and_deletes() {
        let mut f = Follower::new(Kind::Service);
        let mut bad = service_json("c", "10.96.0.3", "3");
        bad["spec"]["ports"] = json!(7);
        assert_eq!(
            feed(
                &mut f,
                listing(vec![
                    service_json("a", "10.96.0.1", "1"),
                    bad.clone(),
                    service_json("b", "10.96.0.2", "2"),
                ])
            ),
            ["Replace Service [demo/a, demo/b]"],
            "first listing, the malformed object left out"
        );
        assert_eq!(
            feed(
                &mut f,
                vec![
                    apply(service_json("d", "10.96.0.4", "4")),
                    apply(bad.clone()),
                    Event::Delete(lenient(service_json("a", "10.96.0.1", "5"))),
                ]
            ),
            ["Apply demo/d", "Delete Service demo/a"],
            "watch events; the malformed update sends nothing"
        );
        assert_eq!(
            f.known,
            [key("b"), key("d")].into_iter().collect(),
            "known after the watch events"
        );
        assert_eq!(
            feed(
                &mut f,
                listing(vec![
                    service_json("b", "10.96.0.2", "2"),
                    service_json("e", "10.96.0.5", "6"),
                ])
            ),
            ["Replace Service [demo/b, demo/e]"],
            "a re-list is a Replace: demo/d is gone by omission"
        );
    }

    #[test]
    fn a_relist_keeps_the_last_good_version_of_objects_gone_bad() {
        let mut f = Follower::new(Kind::Service);
        feed(
            &mut f,
            listing(vec![
                service_json("a", "10.96.0.1", "1"),
                service_json("b", "10.96.0.2", "2"),
                service_json("c", "10.96.0.3", "3"),
            ]),
        );
        let mut bad_b = service_json("b", "10.96.0.2", "4");
        bad_b["spec"] = json!([]);
        let mut bad_new = service_json("n", "10.96.0.9", "5");
        bad_new["spec"] = json!([]);
        assert_eq!(
            feed(
                &mut f,
                listing(vec![service_json("a", "10.96.0.1", "1"), bad_b, bad_new,])
            ),
            ["Delete Service demo/c", "Apply demo/a"],
            "demo/b (bad now, good before) keeps its old version; demo/c is gone; demo/n was never good"
        );
        assert_eq!(
            f.known,
            [key("a"), key("b")].into_iter().collect(),
            "demo/b is still held by the consumer"
        );
        assert_eq!(
            feed(&mut f, listing(vec![service_json("a", "10.96.0.1", "1")])),
            ["Replace Service [demo/a]"],
            "once nothing held is malformed, listings are Replaces again"
        );
    }

    #[test]
    fn unnamed_objects_are_skipped() {
        let mut f = Follower::new(Kind::Service);
        let unnamed = json!({"metadata": {"namespace": "demo"}, "spec": {}});
        assert_eq!(
            feed(
                &mut f,
                listing(vec![unnamed.clone(), service_json("a", "10.96.0.1", "1")])
            ),
            ["Replace Service [demo/a]"]
        );
        assert!(
            feed(&mut f, vec![apply(unnamed)]).is_empty(),
            "an unnamed update sends nothing"
        );
    }

    #[test]
    fn malformed_error_names_the_object() {
        let e = KubeSourceError::Malformed {
            kind: Kind::EndpointSlice,
            object: "demo/web-1".into(),
            reason: "invalid type: string \"x\", expected a sequence".into(),
            outcome: "skipped",
        };
        assert_eq!(
            e.to_string(),
            "EndpointSlice demo/web-1: invalid type: string \"x\", expected a sequence; skipped"
        );
    }

    #[test]
    fn restart_only_for_a_refused_watch_start() {
        let status = |code| {
            Box::new(::kube::core::Status {
                code,
                ..Default::default()
            })
        };
        assert!(restart_needed(&watcher::Error::WatchStartFailed(
            ::kube::Error::Api(status(410))
        )));
        assert!(!restart_needed(&watcher::Error::WatchStartFailed(
            ::kube::Error::Api(status(500))
        )));
        assert!(
            !restart_needed(&watcher::Error::WatchError(status(410))),
            "kube-rs re-lists by itself on an in-stream 410"
        );
    }

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(test: &str) -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "ebpf-proxy-kube-{test}-{}-{}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).expect("create temp dir");
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn kubeconfig(server: &str, context: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: {context}\nclusters:\n- name: {context}\n  cluster:\n    server: {server}\ncontexts:\n- name: {context}\n  context:\n    cluster: {context}\n    user: {context}\nusers:\n- name: {context}\n  user:\n    token: secret-{context}\n"
        )
    }

    #[tokio::test]
    async fn kubeconfig_paths_merge_and_master_overrides_the_server() {
        let dir = TempDir::new("config");
        let a = dir.0.join("a.yaml");
        let b = dir.0.join("b.yaml");
        std::fs::write(&a, kubeconfig("https://10.0.0.1:6443", "first")).unwrap();
        std::fs::write(&b, kubeconfig("https://10.0.0.2:6443", "second")).unwrap();
        let list = std::env::join_paths([&a, &b]).unwrap();

        let c = config(Some(PathBuf::from(&list)), None)
            .await
            .expect("merged kubeconfig");
        assert_eq!(
            c.cluster_url.to_string(),
            "https://10.0.0.1:6443/",
            "the first file's current-context wins, as with kubectl"
        );
        let c = config(Some(b.clone()), Some("http://127.0.0.1:8080".into()))
            .await
            .expect("kubeconfig with --master");
        assert_eq!(
            c.cluster_url.to_string(),
            "http://127.0.0.1:8080/",
            "--master overrides the server"
        );
        assert!(
            c.auth_info.token.is_some(),
            "the kubeconfig's credentials stay"
        );

        let err = config(Some(dir.0.join("missing.yaml")), None)
            .await
            .expect_err("a missing kubeconfig is an error");
        assert!(
            err.to_string().contains("missing.yaml"),
            "the error names the file: {err}"
        );
    }

    #[tokio::test]
    async fn master_alone_and_bad_masters() {
        if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
            // In a pod the in-cluster config applies first; --master then
            // only overrides its server, which the other test covers.
            eprintln!("skipping the no-credentials --master check: running in a cluster");
        } else {
            let c = config(None, Some("http://127.0.0.1:8080".into()))
                .await
                .expect("--master alone");
            assert_eq!(c.cluster_url.to_string(), "http://127.0.0.1:8080/");
            assert!(
                c.auth_info.token.is_none(),
                "no credentials with --master alone"
            );
        }
        for bad in ["127.0.0.1:8080", "ftp://x", "http://", "not a url"] {
            let err = config(None, Some(bad.into()))
                .await
                .expect_err("not an http(s) URL");
            assert!(
                matches!(err, KubeSourceError::Master { .. }),
                "{bad:?}: {err}"
            );
        }
    }

    #[test]
    fn services_round_trip_through_lenient() {
        // A typed object re-encoded as the API would send it decodes back
        // to itself.
        let service = Service {
            metadata: ObjectMeta {
                name: Some("web".into()),
                namespace: Some("demo".into()),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                cluster_ip: Some("10.96.0.10".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let Lenient::Valid(back) = lenient(serde_json::to_value(&service).unwrap()) else {
            panic!("round trip");
        };
        assert_eq!(*back, service);
    }
}
