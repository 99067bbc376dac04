//! What the sources have told us: every Service, every EndpointSlice (grouped
//! by the Service it belongs to) and the local Node. Applying an event
//! answers which Services may now need reprogramming, so a sync costs what
//! changed, not the cluster.

use std::{
    collections::{BTreeMap, BTreeSet},
    hash::BuildHasher,
    net::IpAddr,
    sync::Arc,
};

use hashbrown::{DefaultHashBuilder, HashMap, HashTable};
use k8s_openapi::api::core::v1::Node;
use tracing::{debug, warn};

use crate::{
    model::{
        self, AddressClaims, Cidr, CompactService, DEFAULT_MAX_FRONTENDS_PER_SERVICE, Frontend,
        LABEL_SERVICE_NAME, LABEL_ZONE, ModelConfig, ModelError, Modelled, NodeInfo, Slice,
        node_eligible,
    },
    source::{Kind, Object, ObjectKey, ServiceCidrRanges, SourceEvent},
};

/// Services whose frontends may differ after an event. Deleted services are
/// included: their frontends are now none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    pub services: BTreeSet<ObjectKey>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }

    pub fn len(&self) -> usize {
        self.services.len()
    }

    pub fn extend(&mut self, other: Changes) {
        self.services.extend(other.services);
    }
}

impl IntoIterator for Changes {
    type Item = ObjectKey;
    type IntoIter = std::collections::btree_set::IntoIter<ObjectKey>;

    fn into_iter(self) -> Self::IntoIter {
        self.services.into_iter()
    }
}

/// Every stored slice, found by its own namespace and name: a table of
/// slices rather than a map from a key, so that no slice holds its name
/// twice.
#[derive(Default)]
struct Slices {
    table: HashTable<Slice>,
    hasher: DefaultHashBuilder,
}

impl std::fmt::Debug for Slices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.table.iter()).finish()
    }
}

impl Slices {
    fn hash(&self, namespace: &str, name: &str) -> u64 {
        self.hasher.hash_one((namespace, name))
    }

    fn get(&self, namespace: &str, name: &str) -> Option<&Slice> {
        self.table.find(self.hash(namespace, name), |s| {
            &*s.namespace == namespace && &*s.name == name
        })
    }

    fn remove(&mut self, namespace: &str, name: &str) -> Option<Slice> {
        let hash = self.hash(namespace, name);
        let entry = self
            .table
            .find_entry(hash, |s| &*s.namespace == namespace && &*s.name == name)
            .ok()?;
        Some(entry.remove().0)
    }

    /// Stores `slice`, which is not stored yet.
    fn insert(&mut self, slice: Slice) {
        let hash = self.hash(&slice.namespace, &slice.name);
        let hasher = self.hasher.clone();
        self.table.insert_unique(hash, slice, move |s| {
            hasher.hash_one((&*s.namespace, &*s.name))
        });
    }

    fn len(&self) -> usize {
        self.table.len()
    }

    fn reserve(&mut self, additional: usize) {
        let hasher = self.hasher.clone();
        self.table.reserve(additional, move |s| {
            hasher.hash_one((&*s.namespace, &*s.name))
        });
    }
}

/// The cluster as the sources have described it so far.
#[derive(Debug)]
pub struct ClusterState {
    node: NodeInfo,
    /// Whether our Node, as last seen, takes traffic (kube-proxy's
    /// `nodeEligible`); true until it is seen.
    node_eligible: bool,
    /// Our Node's `spec.podCIDRs` (`spec.podCIDR` where that is all it
    /// has), as last seen: its pods, for `--detect-local-mode NodeCIDR`.
    node_pod_cidrs: Vec<Cidr>,
    /// Boxed: a map node holds eleven values, mostly empty room.
    services: BTreeMap<ObjectKey, Box<CompactService>>,
    slices: Slices,
    /// Service key → names of its slices (in its namespace), sorted so the
    /// model sees them in a stable order. A sorted boxed slice rather than
    /// a set: most Services have one slice. The names are the slices' own.
    slices_by_service: HashMap<ObjectKey, Box<[Arc<str>]>>,
    /// The addresses every Service and the node claim, for the address
    /// policy.
    claims: AddressClaims,
    /// The `ServiceCIDR` objects' ranges, by object name.
    service_cidrs: BTreeMap<String, Vec<Cidr>>,
    /// Moves each time `service_cidrs` changes.
    service_cidrs_generation: u64,
    /// `--max-frontends-per-service`: a Service asking for more keeps none
    /// of its external addresses here ([`CompactService::shed_over`]).
    frontend_budget: u64,
}

impl ClusterState {
    /// State for the agent on node `node_name`: endpoints on that node are
    /// local, and only the Node of that name supplies the zone.
    pub fn new(node_name: impl Into<String>) -> Self {
        ClusterState {
            node: NodeInfo {
                name: node_name.into(),
                zone: None,
            },
            node_eligible: true,
            node_pod_cidrs: Vec::new(),
            services: BTreeMap::new(),
            slices: Slices::default(),
            slices_by_service: HashMap::new(),
            claims: AddressClaims::default(),
            service_cidrs: BTreeMap::new(),
            service_cidrs_generation: 0,
            frontend_budget: DEFAULT_MAX_FRONTENDS_PER_SERVICE,
        }
    }

    /// Keeps nothing of the external addresses of a Service asking for
    /// more than `max` frontends (the model refuses it as a whole): set
    /// before any Service arrives, to the model's
    /// `max_frontends_per_service`.
    pub fn set_frontend_budget(&mut self, max: u64) {
        self.frontend_budget = max;
    }

    /// The addresses every Service and the node claim.
    pub fn claims(&self) -> &AddressClaims {
        &self.claims
    }

    /// The node's interfaces have these addresses now: the Services
    /// claiming one that came or went may be decided anew.
    pub fn set_interface_addresses(&mut self, addrs: &[IpAddr]) -> Changes {
        let mut changes = Changes::default();
        let changed = self.claims.set_node_interfaces(addrs.to_vec());
        self.mark_claimants(&changed, None, &mut changes);
        changes
    }

    /// Records an event and says which services it may have changed.
    pub fn apply(&mut self, event: SourceEvent) -> Changes {
        let mut changes = Changes::default();
        match event {
            SourceEvent::Apply(object) => self.apply_object(object, &mut changes),
            SourceEvent::Delete { kind, key } => self.delete(kind, &key, &mut changes),
            SourceEvent::Replace { kind, objects } => self.replace(kind, objects, &mut changes),
        }
        changes
    }

    /// Keys of every known Service, sorted.
    pub fn services(&self) -> impl Iterator<Item = &ObjectKey> {
        self.services.keys()
    }

    pub fn service(&self, key: &ObjectKey) -> Option<&CompactService> {
        self.services.get(key).map(|s| &**s)
    }

    /// The slices of a Service, sorted by name.
    pub fn slices_for(&self, key: &ObjectKey) -> Vec<&Slice> {
        self.slices_by_service
            .get(key)
            .into_iter()
            .flat_map(|names| names.iter())
            .filter_map(|name| self.slices.get(&key.namespace, name))
            .collect()
    }

    pub fn node(&self) -> &NodeInfo {
        &self.node
    }

    /// Our Node's pod CIDRs, as last seen (none until it is seen; a Node
    /// that is gone keeps its last ones).
    pub fn node_pod_cidrs(&self) -> &[Cidr] {
        &self.node_pod_cidrs
    }

    /// The ranges of every `ServiceCIDR` object, sorted. Empty where the
    /// API has none, or serves none.
    pub fn service_cidrs(&self) -> Vec<Cidr> {
        let mut cidrs: Vec<Cidr> = self.service_cidrs.values().flatten().copied().collect();
        cidrs.sort();
        cidrs.dedup();
        cidrs
    }

    /// Moves whenever [`Self::service_cidrs`] changes.
    pub fn service_cidrs_generation(&self) -> u64 {
        self.service_cidrs_generation
    }

    fn put_service_cidr(&mut self, object: &ServiceCidrRanges) {
        if self.service_cidrs.get(&object.name) != Some(&object.cidrs) {
            self.service_cidrs
                .insert(object.name.clone(), object.cidrs.clone());
            self.service_cidrs_generation += 1;
        }
    }

    fn remove_service_cidr(&mut self, name: &str) {
        if self.service_cidrs.remove(name).is_some() {
            self.service_cidrs_generation += 1;
        }
    }

    /// Our Node is neither being deleted nor tainted for deletion, as last
    /// seen. A Node that is gone keeps its last answer, as kube-proxy's does.
    pub fn node_eligible(&self) -> bool {
        self.node_eligible
    }

    pub fn service_count(&self) -> usize {
        self.services.len()
    }

    pub fn slice_count(&self) -> usize {
        self.slices.len()
    }

    /// The frontends the Service should have now; none once it is gone.
    pub fn frontends_for(
        &self,
        key: &ObjectKey,
        config: &ModelConfig,
    ) -> Result<Vec<Frontend>, ModelError> {
        self.frontends_of(key, self.service(key), config)
    }

    /// [`Self::frontends_for`] of `service`, the Service of `key` as
    /// [`Self::service`] gave it: a sync looks it up once for all it reads.
    pub fn frontends_of(
        &self,
        key: &ObjectKey,
        service: Option<&CompactService>,
        config: &ModelConfig,
    ) -> Result<Vec<Frontend>, ModelError> {
        self.modelled_of(key, service, config)
            .map(|modelled| modelled.frontends)
    }

    /// [`Self::frontends_of`], with what the address policy refused.
    pub fn modelled_of(
        &self,
        key: &ObjectKey,
        service: Option<&CompactService>,
        config: &ModelConfig,
    ) -> Result<Modelled, ModelError> {
        let Some(service) = service else {
            return Ok(Modelled::default());
        };
        service.modelled(&self.slices_for(key), &self.node, config, &self.claims)
    }

    fn apply_object(&mut self, object: Object, changes: &mut Changes) {
        match object {
            Object::Service(service) => {
                if let Some(key) = ObjectKey::of_service(&service) {
                    self.put_service(key, service, changes);
                } else {
                    warn!("service without a name; ignored");
                }
            }
            Object::EndpointSlice(slice) => self.put_slice(*slice, changes),
            Object::Node(node) => self.put_node(Some(&node), changes),
            Object::ServiceCidr(object) => self.put_service_cidr(&object),
        }
    }

    fn delete(&mut self, kind: Kind, key: &ObjectKey, changes: &mut Changes) {
        match kind {
            Kind::Service => self.remove_service(key, changes),
            Kind::EndpointSlice => self.remove_slice(key, changes),
            Kind::Node => {
                if key.name == self.node.name {
                    self.put_node(None, changes);
                }
            }
            Kind::ServiceCidr => self.remove_service_cidr(&key.name),
        }
    }

    /// A complete listing: whatever of `kind` is not in it is gone. Only
    /// objects that differ from what was stored count as changes, so a
    /// re-list after a reconnect costs nothing when nothing moved.
    fn replace(&mut self, kind: Kind, objects: Vec<Object>, changes: &mut Changes) {
        // Into an empty store (the first listing) nothing can go missing:
        // the listing's keys are not collected, which at 100,000 objects is
        // a tenth of a second before the first sync can start.
        let stored_before = match kind {
            Kind::Service => self.services.len(),
            Kind::EndpointSlice => self.slices.len(),
            Kind::Node | Kind::ServiceCidr => 0,
        };
        if stored_before == 0 && kind == Kind::EndpointSlice {
            // Sized once for the listing rather than doubled up to it, each
            // doubling moving every slice; the same buckets either way.
            self.slices.reserve(objects.len());
        }
        let mut listed: BTreeSet<ObjectKey> = BTreeSet::new();
        let mut ours: Option<Box<Node>> = None;
        let mut listed_cidrs: Vec<String> = Vec::new();
        for object in objects {
            match (kind, object) {
                (Kind::Service, Object::Service(service)) => {
                    if let Some(key) = ObjectKey::of_service(&service) {
                        if stored_before > 0 {
                            listed.insert(key.clone());
                        }
                        self.put_service(key, service, changes);
                    }
                }
                (Kind::EndpointSlice, Object::EndpointSlice(slice)) => {
                    if !slice.name.is_empty() {
                        if stored_before > 0 {
                            listed.extend(ObjectKey::of_slice(&slice));
                        }
                        self.put_slice(*slice, changes);
                    }
                }
                (Kind::Node, Object::Node(node)) => {
                    if node.metadata.name.as_deref() == Some(self.node.name.as_str()) {
                        ours = Some(node);
                    }
                }
                (Kind::ServiceCidr, Object::ServiceCidr(object)) => {
                    listed_cidrs.push(object.name.clone());
                    self.put_service_cidr(&object);
                }
                (kind, object) => {
                    warn!(?kind, object = %describe(&object), "object of another kind in a listing; ignored");
                }
            }
        }
        match kind {
            Kind::Service | Kind::EndpointSlice if stored_before == 0 => {}
            Kind::Service => {
                let gone: Vec<ObjectKey> = self
                    .services
                    .keys()
                    .filter(|k| !listed.contains(*k))
                    .cloned()
                    .collect();
                for key in gone {
                    self.remove_service(&key, changes);
                }
            }
            Kind::EndpointSlice => {
                let gone: Vec<ObjectKey> = self
                    .slices
                    .table
                    .iter()
                    .filter_map(ObjectKey::of_slice)
                    .filter(|k| !listed.contains(k))
                    .collect();
                for key in gone {
                    self.remove_slice(&key, changes);
                }
            }
            Kind::Node => self.put_node(ours.as_deref(), changes),
            Kind::ServiceCidr => {
                let gone: Vec<String> = self
                    .service_cidrs
                    .keys()
                    .filter(|name| !listed_cidrs.contains(name))
                    .cloned()
                    .collect();
                for name in gone {
                    self.remove_service_cidr(&name);
                }
            }
        }
        // Strings only the departed objects held.
        model::forget_unused_strings();
    }

    /// Stores `service` under `key`, its [`ObjectKey::of_service`].
    fn put_service(
        &mut self,
        key: ObjectKey,
        mut service: Box<CompactService>,
        changes: &mut Changes,
    ) {
        if service.shed_over(self.frontend_budget) {
            debug!(service = %key, frontends = service.frontend_count(), "over its frontend budget: its external addresses are not kept");
        }
        if self.services.get(&key) == Some(&service) {
            return;
        }
        let mut touched = AddressClaims::addresses_of(&service);
        if let Some(old) = self.services.get(&key) {
            touched.extend(AddressClaims::addresses_of(old));
            self.claims.remove(old);
        }
        self.claims.add(&service);
        self.services.insert(key.clone(), service);
        self.mark_claimants(&touched, Some(&key), changes);
        changes.services.insert(key);
    }

    fn remove_service(&mut self, key: &ObjectKey, changes: &mut Changes) {
        let Some(old) = self.services.remove(key) else {
            return;
        };
        self.claims.remove(&old);
        self.mark_claimants(&AddressClaims::addresses_of(&old), Some(key), changes);
        changes.services.insert(key.clone());
    }

    /// The Services claiming one of `addrs` as an external address (but
    /// `except`): whether they may have it depends on who else claims it,
    /// and on the node's addresses.
    fn mark_claimants(&self, addrs: &[IpAddr], except: Option<&ObjectKey>, changes: &mut Changes) {
        for ip in addrs {
            for rank in self.claims.claimants(*ip) {
                if except.is_some_and(|k| *k.namespace == *rank.namespace && *k.name == *rank.name)
                {
                    continue;
                }
                let key = ObjectKey {
                    namespace: rank.namespace.to_string(),
                    name: rank.name.to_string(),
                };
                if !changes.services.contains(&key) {
                    changes.services.insert(key);
                }
            }
        }
    }

    fn put_slice(&mut self, slice: Slice, changes: &mut Changes) {
        if slice.name.is_empty() {
            warn!("endpointslice without a name; ignored");
            return;
        }
        let Some(owner) = owner_of(&slice) else {
            // kube-proxy cannot tell which Service such a slice serves
            // either, and ignores it.
            if let Some(key) = ObjectKey::of_slice(&slice) {
                debug!(slice = %key, "endpointslice without the {LABEL_SERVICE_NAME} label; ignored");
            }
            self.remove_slice_named(&slice.namespace, &slice.name, changes);
            return;
        };
        // The same slice names the same Service: its label is part of it.
        // Found by its own strings: a key of its own would be two more
        // allocations for each slice of a listing.
        if self.slices.get(&slice.namespace, &slice.name) == Some(&slice) {
            return;
        }
        // The label can change, moving the slice to another Service: both
        // the old and the new one are affected.
        self.remove_slice_named(&slice.namespace, &slice.name, changes);
        let names = self.slices_by_service.entry(owner.clone()).or_default();
        let mut grown: Vec<Arc<str>> = std::mem::take(names).into_vec();
        if let Err(at) = grown.binary_search(&slice.name) {
            grown.insert(at, Arc::clone(&slice.name));
        }
        *names = grown.into_boxed_slice();
        self.slices.insert(slice);
        self.mark(owner, changes);
    }

    fn remove_slice(&mut self, key: &ObjectKey, changes: &mut Changes) {
        self.remove_slice_named(&key.namespace, &key.name, changes);
    }

    fn remove_slice_named(&mut self, namespace: &str, name: &str, changes: &mut Changes) {
        let Some(stored) = self.slices.remove(namespace, name) else {
            return;
        };
        let Some(owner) = owner_of(&stored) else {
            return;
        };
        if let Some(names) = self.slices_by_service.get_mut(&owner) {
            *names = names.iter().filter(|n| ***n != *name).cloned().collect();
            if names.is_empty() {
                self.slices_by_service.remove(&owner);
            }
        }
        self.mark(owner, changes);
    }

    /// Only a known Service can change: a slice that arrives before its
    /// Service is picked up when the Service arrives.
    fn mark(&self, service: ObjectKey, changes: &mut Changes) {
        if self.services.contains_key(&service) {
            changes.services.insert(service);
        }
    }

    /// Our Node's zone feeds topology for every Service, so a change to it
    /// marks them all. `None` means our Node is gone (or not listed).
    fn put_node(&mut self, node: Option<&Node>, changes: &mut Changes) {
        let Some(node) = node else {
            self.set_zone(None, changes);
            return;
        };
        if node.metadata.name.as_deref() != Some(self.node.name.as_str()) {
            return;
        }
        self.node_eligible = node_eligible(node);
        self.node_pod_cidrs = pod_cidrs(node);
        let changed = self.claims.set_node_status(node_addresses(node));
        self.mark_claimants(&changed, None, changes);
        let zone = node
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(LABEL_ZONE))
            .cloned();
        self.set_zone(zone, changes);
    }

    fn set_zone(&mut self, zone: Option<String>, changes: &mut Changes) {
        if self.node.zone != zone {
            debug!(node = %self.node.name, ?zone, "node zone changed; every service is re-evaluated");
            self.node.zone = zone;
            changes.services.extend(self.services.keys().cloned());
        }
    }
}

/// A Node's pod CIDRs: `spec.podCIDRs`, else `spec.podCIDR`; one that does
/// not parse is named in the log and left out.
fn pod_cidrs(node: &Node) -> Vec<Cidr> {
    let Some(spec) = &node.spec else {
        return Vec::new();
    };
    let texts: Vec<&String> = match (&spec.pod_cidrs, &spec.pod_cidr) {
        (Some(list), _) if !list.is_empty() => list.iter().collect(),
        (_, Some(one)) => vec![one],
        _ => Vec::new(),
    };
    texts
        .into_iter()
        .filter_map(|text| {
            let cidr = Cidr::parse(text);
            if cidr.is_none() {
                warn!(node = ?node.metadata.name, cidr = %text, "a pod CIDR of the Node is not a CIDR; left out");
            }
            cidr
        })
        .collect()
}

/// A Node's addresses in `status.addresses` that are IP addresses (not
/// host names).
fn node_addresses(node: &Node) -> Vec<IpAddr> {
    node.status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|a| a.address.trim().parse().ok())
        .collect()
}

/// The Service a slice belongs to: its label's name, in its namespace.
fn owner_of(slice: &Slice) -> Option<ObjectKey> {
    Some(ObjectKey {
        namespace: slice.namespace.to_string(),
        name: slice.service.as_deref()?.to_owned(),
    })
}

fn describe(object: &Object) -> String {
    let kind = match object {
        Object::Service(_) => "Service",
        Object::EndpointSlice(_) => "EndpointSlice",
        Object::Node(_) => "Node",
        Object::ServiceCidr(_) => "ServiceCIDR",
    };
    match object.key() {
        Some(key) => format!("{kind} {key}"),
        None => format!("{kind} <unnamed>"),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::{
        api::{
            core::v1::{Service, ServicePort, ServiceSpec},
            discovery::v1::EndpointSlice,
        },
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;

    fn meta(namespace: &str, name: &str, labels: &[(&str, &str)]) -> ObjectMeta {
        ObjectMeta {
            namespace: (!namespace.is_empty()).then(|| namespace.to_owned()),
            name: Some(name.to_owned()),
            labels: (!labels.is_empty()).then(|| {
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>()
            }),
            ..Default::default()
        }
    }

    fn service(name: &str, cluster_ip: &str) -> Object {
        Object::service(&Service {
            metadata: meta("demo", name, &[]),
            spec: Some(ServiceSpec {
                cluster_ip: Some(cluster_ip.to_owned()),
                ports: Some(vec![ServicePort {
                    name: Some("http".into()),
                    port: 80,
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        })
    }

    fn slice(name: &str, service: &str, ips: &[&str]) -> Object {
        Object::slice(&k8s_slice(name, service, ips))
    }

    fn k8s_slice(name: &str, service: &str, ips: &[&str]) -> EndpointSlice {
        use k8s_openapi::api::discovery::v1::{Endpoint, EndpointPort};
        let labels: Vec<(&str, &str)> = if service.is_empty() {
            vec![]
        } else {
            vec![(LABEL_SERVICE_NAME, service)]
        };
        EndpointSlice {
            metadata: meta("demo", name, &labels),
            address_type: "IPv4".into(),
            ports: Some(vec![EndpointPort {
                name: Some("http".into()),
                port: Some(8080),
                ..Default::default()
            }]),
            endpoints: ips
                .iter()
                .map(|ip| Endpoint {
                    addresses: vec![ip.to_string()],
                    ..Default::default()
                })
                .collect(),
        }
    }

    fn node(name: &str, zone: Option<&str>) -> Object {
        let labels: Vec<(&str, &str)> = zone.map(|z| (LABEL_ZONE, z)).into_iter().collect();
        Object::Node(Box::new(Node {
            metadata: meta("", name, &labels),
            ..Default::default()
        }))
    }

    fn key(name: &str) -> ObjectKey {
        ObjectKey {
            namespace: "demo".into(),
            name: name.into(),
        }
    }

    fn changed(names: &[&str]) -> Changes {
        Changes {
            services: names.iter().map(|n| key(n)).collect(),
        }
    }

    fn backends(state: &ClusterState, name: &str) -> Vec<String> {
        let frontends = state
            .frontends_for(&key(name), &ModelConfig::default())
            .expect("valid service");
        frontends
            .iter()
            .flat_map(|f| f.backends.iter().map(model::BackendAddr::host_port))
            .collect()
    }

    #[test]
    fn service_and_slice_lifecycle() {
        let mut state = ClusterState::new("node-a");
        let steps: Vec<(&str, SourceEvent, Changes, Vec<&str>)> = vec![
            (
                "slice before its service: nothing to reprogram yet",
                SourceEvent::Apply(slice("web-1", "web", &["10.0.0.1"])),
                changed(&[]),
                vec![],
            ),
            (
                "service arrives and picks up the slice",
                SourceEvent::Apply(service("web", "10.96.0.10")),
                changed(&["web"]),
                vec!["10.0.0.1:8080"],
            ),
            (
                "the same service again: no change",
                SourceEvent::Apply(service("web", "10.96.0.10")),
                changed(&[]),
                vec!["10.0.0.1:8080"],
            ),
            (
                "a second slice",
                SourceEvent::Apply(slice("web-2", "web", &["10.0.0.2"])),
                changed(&["web"]),
                vec!["10.0.0.1:8080", "10.0.0.2:8080"],
            ),
            (
                "the first slice changes",
                SourceEvent::Apply(slice("web-1", "web", &["10.0.0.3"])),
                changed(&["web"]),
                vec!["10.0.0.2:8080", "10.0.0.3:8080"],
            ),
            (
                "a slice is deleted",
                SourceEvent::Delete {
                    kind: Kind::EndpointSlice,
                    key: key("web-2"),
                },
                changed(&["web"]),
                vec!["10.0.0.3:8080"],
            ),
            (
                "deleting an unknown slice changes nothing",
                SourceEvent::Delete {
                    kind: Kind::EndpointSlice,
                    key: key("web-9"),
                },
                changed(&[]),
                vec!["10.0.0.3:8080"],
            ),
            (
                "the service is deleted",
                SourceEvent::Delete {
                    kind: Kind::Service,
                    key: key("web"),
                },
                changed(&["web"]),
                vec![],
            ),
        ];
        for (what, event, want_changes, want_backends) in steps {
            let got = state.apply(event);
            assert_eq!(got, want_changes, "{what}: changed services");
            assert_eq!(
                backends(&state, "web"),
                want_backends,
                "{what}: backends of demo/web"
            );
        }
        assert!(
            state
                .frontends_for(&key("web"), &ModelConfig::default())
                .unwrap()
                .is_empty(),
            "a deleted service has no frontends"
        );
        assert_eq!(state.slice_count(), 1, "the slice outlives its service");
    }

    #[test]
    fn slice_moving_between_services_marks_both() {
        let mut state = ClusterState::new("node-a");
        state.apply(SourceEvent::Apply(service("web", "10.96.0.10")));
        state.apply(SourceEvent::Apply(service("api", "10.96.0.11")));
        state.apply(SourceEvent::Apply(slice("s-1", "web", &["10.0.0.1"])));
        let got = state.apply(SourceEvent::Apply(slice("s-1", "api", &["10.0.0.1"])));
        assert_eq!(
            got,
            changed(&["api", "web"]),
            "relabelled slice: old and new owner"
        );
        assert!(backends(&state, "web").is_empty(), "web lost the slice");
        assert_eq!(
            backends(&state, "api"),
            ["10.0.0.1:8080"],
            "api gained the slice"
        );

        let got = state.apply(SourceEvent::Apply(slice("s-1", "", &["10.0.0.1"])));
        assert_eq!(got, changed(&["api"]), "slice losing its label leaves api");
        assert_eq!(state.slice_count(), 0, "an unlabelled slice is not stored");
    }

    #[test]
    fn replace_reports_only_differences() {
        let mut state = ClusterState::new("node-a");
        let got = state.apply(SourceEvent::Replace {
            kind: Kind::Service,
            objects: vec![service("web", "10.96.0.10"), service("api", "10.96.0.11")],
        });
        assert_eq!(
            got,
            changed(&["api", "web"]),
            "first listing: everything is new"
        );

        let got = state.apply(SourceEvent::Replace {
            kind: Kind::EndpointSlice,
            objects: vec![
                slice("web-1", "web", &["10.0.0.1"]),
                slice("db-1", "db", &["10.0.0.9"]),
            ],
        });
        assert_eq!(got, changed(&["web"]), "slices: only web's service exists");

        let got = state.apply(SourceEvent::Replace {
            kind: Kind::Service,
            objects: vec![service("web", "10.96.0.10"), service("api", "10.96.0.12")],
        });
        assert_eq!(got, changed(&["api"]), "re-list: only api changed");

        let got = state.apply(SourceEvent::Replace {
            kind: Kind::Service,
            objects: vec![service("api", "10.96.0.12")],
        });
        assert_eq!(got, changed(&["web"]), "web left the listing");
        assert_eq!(
            state.services().cloned().collect::<Vec<_>>(),
            vec![key("api")],
            "services() after the re-list"
        );

        let got = state.apply(SourceEvent::Replace {
            kind: Kind::EndpointSlice,
            objects: vec![],
        });
        assert_eq!(
            got,
            changed(&[]),
            "web's slice went, but web is gone already"
        );
        assert_eq!(state.slice_count(), 0, "empty listing clears the slices");
    }

    #[test]
    fn our_nodes_pod_cidrs_are_kept_for_the_node_cidr_detector() {
        use k8s_openapi::api::core::v1::NodeSpec;
        let with_cidrs = |name: &str, list: Option<&[&str]>, one: Option<&str>| {
            Object::Node(Box::new(Node {
                metadata: meta("", name, &[]),
                spec: Some(NodeSpec {
                    pod_cidrs: list.map(|l| l.iter().map(|c| (*c).to_owned()).collect()),
                    pod_cidr: one.map(str::to_owned),
                    ..Default::default()
                }),
                ..Default::default()
            }))
        };
        let cidrs = |state: &ClusterState| -> Vec<String> {
            state
                .node_pod_cidrs()
                .iter()
                .map(ToString::to_string)
                .collect()
        };
        let mut state = ClusterState::new("node-a");
        assert!(cidrs(&state).is_empty(), "none before the Node is seen");
        state.apply(SourceEvent::Apply(with_cidrs(
            "node-b",
            Some(&["10.244.1.0/24"]),
            None,
        )));
        assert!(cidrs(&state).is_empty(), "another Node's are not ours");
        state.apply(SourceEvent::Apply(with_cidrs(
            "node-a",
            Some(&["10.244.0.0/24", "fd00:10:244::/64", "not-a-cidr"]),
            Some("10.244.0.0/24"),
        )));
        assert_eq!(
            cidrs(&state),
            ["10.244.0.0/24", "fd00:10:244::/64"],
            "spec.podCIDRs, both families, what does not parse left out"
        );
        state.apply(SourceEvent::Apply(with_cidrs(
            "node-a",
            None,
            Some("10.244.7.0/24"),
        )));
        assert_eq!(
            cidrs(&state),
            ["10.244.7.0/24"],
            "spec.podCIDR where podCIDRs is unset"
        );
    }

    #[test]
    fn node_zone_changes_mark_every_service() {
        let mut state = ClusterState::new("node-a");
        state.apply(SourceEvent::Apply(service("web", "10.96.0.10")));
        state.apply(SourceEvent::Apply(service("api", "10.96.0.11")));
        let steps: Vec<(&str, SourceEvent, Changes, Option<&str>)> = vec![
            (
                "another node's zone is not ours",
                SourceEvent::Apply(node("node-b", Some("zone-b"))),
                changed(&[]),
                None,
            ),
            (
                "our node gets a zone",
                SourceEvent::Apply(node("node-a", Some("zone-a"))),
                changed(&["api", "web"]),
                Some("zone-a"),
            ),
            (
                "same zone again",
                SourceEvent::Replace {
                    kind: Kind::Node,
                    objects: vec![node("node-b", None), node("node-a", Some("zone-a"))],
                },
                changed(&[]),
                Some("zone-a"),
            ),
            (
                "zone label removed",
                SourceEvent::Apply(node("node-a", None)),
                changed(&["api", "web"]),
                None,
            ),
            (
                "zone back, then our node deleted",
                SourceEvent::Apply(node("node-a", Some("zone-c"))),
                changed(&["api", "web"]),
                Some("zone-c"),
            ),
            (
                "our node deleted",
                SourceEvent::Delete {
                    kind: Kind::Node,
                    key: ObjectKey {
                        namespace: String::new(),
                        name: "node-a".into(),
                    },
                },
                changed(&["api", "web"]),
                None,
            ),
        ];
        for (what, event, want_changes, want_zone) in steps {
            let got = state.apply(event);
            assert_eq!(got, want_changes, "{what}: changed services");
            assert_eq!(state.node().zone.as_deref(), want_zone, "{what}: zone");
            assert_eq!(state.node().name, "node-a", "{what}: node name is fixed");
        }
    }

    #[test]
    fn local_endpoints_follow_the_constructor_node_name() {
        use k8s_openapi::api::discovery::v1::Endpoint;
        let mut state = ClusterState::new("node-a");
        state.apply(SourceEvent::Apply(service("web", "10.96.0.10")));
        let mut s = k8s_slice("web-1", "web", &["10.0.0.1", "10.0.0.2"]);
        s.endpoints[0].node_name = Some("node-a".into());
        s.endpoints.push(Endpoint {
            addresses: vec!["10.0.0.3".into()],
            node_name: Some("node-b".into()),
            ..Default::default()
        });
        state.apply(SourceEvent::Apply(Object::slice(&s)));
        let frontends = state
            .frontends_for(&key("web"), &ModelConfig::default())
            .unwrap();
        let local: Vec<(String, bool)> = frontends[0]
            .backends
            .iter()
            .map(|b| (b.host_port(), b.local))
            .collect();
        assert_eq!(
            local,
            [
                ("10.0.0.1:8080".to_string(), true),
                ("10.0.0.2:8080".to_string(), false),
                ("10.0.0.3:8080".to_string(), false),
            ],
            "only endpoints with nodeName node-a are local"
        );
    }

    #[test]
    fn changes_iterate_as_keys() {
        let mut state = ClusterState::new("node-a");
        let mut dirty: BTreeSet<ObjectKey> = BTreeSet::new();
        dirty.extend(state.apply(SourceEvent::Apply(service("web", "10.96.0.10"))));
        dirty.extend(state.apply(SourceEvent::Apply(service("api", "10.96.0.11"))));
        assert_eq!(
            dirty.into_iter().collect::<Vec<_>>(),
            vec![key("api"), key("web")],
            "Changes feed a set of dirty keys"
        );
    }
}
