//! Where Services, EndpointSlices, the Node and the service CIDRs come from. Every source (the
//! Kubernetes API, manifest files) turns what it sees into [`SourceEvent`]s;
//! nothing downstream knows which source fed it.

pub mod kube;
pub mod manifest;

use k8s_openapi::{
    api::{
        core::v1::Node, core::v1::Service, discovery::v1::EndpointSlice,
        networking::v1::ServiceCIDR,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use tracing::warn;

use crate::model::{Cidr, CompactService, Slice};

/// The kinds of object a source delivers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
    /// `networking.k8s.io/v1` `ServiceCIDR`: the ranges ClusterIPs come from.
    ServiceCidr,
}

/// namespace/name of an object (namespace empty for cluster-scoped ones).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    pub namespace: String,
    pub name: String,
}

impl ObjectKey {
    /// A Service's key, when it has a name.
    pub fn of_service(service: &CompactService) -> Option<ObjectKey> {
        let name = service.name().filter(|n| !n.is_empty())?;
        Some(ObjectKey {
            namespace: service.namespace().to_owned(),
            name: name.to_owned(),
        })
    }

    /// An EndpointSlice's key, when it has a name.
    pub fn of_slice(slice: &Slice) -> Option<ObjectKey> {
        (!slice.name.is_empty()).then(|| ObjectKey {
            namespace: slice.namespace.to_string(),
            name: slice.name.to_string(),
        })
    }

    /// The key an API object's metadata gives, when it has a name.
    pub fn of_meta(metadata: &ObjectMeta) -> Option<ObjectKey> {
        let name = metadata.name.as_deref().filter(|n| !n.is_empty())?;
        Some(ObjectKey {
            namespace: metadata.namespace.clone().unwrap_or_default(),
            name: name.to_owned(),
        })
    }
}

impl std::fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.namespace.is_empty() {
            f.write_str(&self.name)
        } else {
            write!(f, "{}/{}", self.namespace, self.name)
        }
    }
}

/// One object from a source, in the form the agent keeps it (see
/// `model::compact`): sources reduce each object as it arrives, so a whole
/// listing is never held in the API's form.
#[derive(Clone, Debug)]
pub enum Object {
    Service(Box<CompactService>),
    EndpointSlice(Box<Slice>),
    Node(Box<Node>),
    ServiceCidr(Box<ServiceCidrRanges>),
}

/// A `ServiceCIDR`, reduced to its name and the ranges it gives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceCidrRanges {
    pub name: String,
    pub cidrs: Vec<Cidr>,
}

impl Object {
    /// A Service, reduced to what the model reads.
    pub fn service(service: &Service) -> Object {
        Object::Service(Box::new(CompactService::from(service)))
    }

    /// A `ServiceCIDR`, reduced to its ranges; one that does not parse
    /// is named in the log and left out.
    pub fn service_cidr(object: &ServiceCIDR) -> Object {
        let name = object.metadata.name.clone().unwrap_or_default();
        let texts = object.spec.as_ref().and_then(|s| s.cidrs.as_deref());
        let cidrs = texts
            .unwrap_or_default()
            .iter()
            .filter_map(|text| {
                let cidr = Cidr::parse(text);
                if cidr.is_none() {
                    warn!(service_cidr = %name, cidr = %text, "not a CIDR; left out");
                }
                cidr
            })
            .collect();
        Object::ServiceCidr(Box::new(ServiceCidrRanges { name, cidrs }))
    }

    /// An EndpointSlice, reduced to what the model reads.
    pub fn slice(slice: &EndpointSlice) -> Object {
        Object::EndpointSlice(Box::new(Slice::from(slice)))
    }

    /// The object's key, when it has a name (a `ServiceCIDR`'s is its name
    /// alone: it has no namespace).
    pub fn key(&self) -> Option<ObjectKey> {
        match self {
            Object::Service(s) => ObjectKey::of_service(s),
            Object::EndpointSlice(s) => ObjectKey::of_slice(s),
            Object::Node(n) => ObjectKey::of_meta(&n.metadata),
            Object::ServiceCidr(c) => (!c.name.is_empty()).then(|| ObjectKey {
                namespace: String::new(),
                name: c.name.clone(),
            }),
        }
    }
}

/// What a source reports.
#[derive(Clone, Debug)]
pub enum SourceEvent {
    /// A complete listing of one kind: anything of that kind not in it is
    /// gone (kube-rs `InitDone`, or a re-read of the manifest files).
    Replace { kind: Kind, objects: Vec<Object> },
    /// An object was added or changed.
    Apply(Object),
    /// An object was deleted.
    Delete { kind: Kind, key: ObjectKey },
}
