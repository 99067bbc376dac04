//! The model: a pure function from (Service, its EndpointSlices, the Node,
//! config) to the frontends and ordered backend sets the datapath must have.
//! All of kube-proxy's Service policy lives here; nothing here touches the
//! kernel.
//!
//! Its files form layers, each reading only those below it:
//!
//! - at the bottom, the small pieces every reading shares: the public
//!   types ([`types`]), an address's family ([`family`]), one copy of each
//!   repeated string ([`intern`]), and the node the agent runs on
//!   ([`node`]);
//! - each object checked once, when it arrives: an EndpointSlice and its
//!   endpoints ([`slice`]), a Service's spec ([`service_spec`]);
//! - what the agent keeps of each object, those checks included
//!   ([`compact`]); kube-proxy's topology-hint rules ([`topology`]);
//! - the endpoints of one service port and its cluster and local sets
//!   ([`endpoints`]);
//! - which addresses a Service may claim and how many frontends it may
//!   ask for ([`address_policy`]), against the addresses every Service and
//!   the node claim ([`claims`]);
//! - at the top, a Service's frontends ([`service`]) and its health check
//!   node port ([`health_check`]).
//!
//! [`probability`] stands apart: the selection-probability proofs of
//! docs/architecture.md, "Backend selection".

mod address_policy;
mod claims;
mod compact;
mod endpoints;
mod family;
mod health_check;
mod intern;
mod node;
#[cfg(test)]
mod policy_tests;
mod probability;
mod service;
mod service_spec;
mod slice;
#[cfg(test)]
mod tests;
mod topology;
mod types;

use std::collections::BTreeMap;

pub use address_policy::{
    DEFAULT_MAX_FRONTENDS_PER_SERVICE, Reason, Refusal, RefusedAddress, special_address,
};
pub use claims::{AddressClaims, Rank};
pub use compact::{CompactService, LAST_CHANGE_TRIGGER_TIME, ProxyLabels, Slice};
pub use health_check::{HealthCheck, service_health_check};
pub use intern::{forget_unused_strings, intern};
use k8s_openapi::api::core::v1::Service;
pub use node::{NodeInfo, node_eligible};
pub use probability::{
    iptables_probabilities, iptables_threshold, slot_counts, slot_probabilities,
};
pub use types::*;

/// Label naming the proxy that should program a Service; kube-proxy skips any
/// Service (and EndpointSlice) that carries it.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Label marking a Service (and its EndpointSlices) as headless; kube-proxy
/// skips it whatever the clusterIP says.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Label tying an EndpointSlice to its Service (same namespace).
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
/// Node label holding the node's zone, matched against endpoint zone hints.
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";

/// Agent configuration that changes what gets programmed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    /// Value of our `service.kubernetes.io/service-proxy-name`, if any: a
    /// Service carrying that label with a different value (or any value, when
    /// this is None) is not ours to program.
    pub service_proxy_name: Option<String>,
    /// `--max-frontends-per-service`: a Service asking for more is refused
    /// as a whole.
    pub max_frontends_per_service: u64,
    /// `--external-ip-cidrs`: when set, an externalIP outside every one of
    /// them is refused; None lets any address through (that the other
    /// checks let through).
    pub external_ip_cidrs: Option<Vec<Cidr>>,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            service_proxy_name: None,
            max_frontends_per_service: DEFAULT_MAX_FRONTENDS_PER_SERVICE,
            external_ip_cidrs: None,
        }
    }
}

/// What the model makes of one Service: its frontends, and what of it the
/// address policy refused (docs/security.md).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Modelled {
    pub frontends: Vec<Frontend>,
    pub refusals: Vec<Refusal>,
}

impl Modelled {
    /// A Service refused as a whole.
    pub fn refused(refusal: Refusal) -> Self {
        Modelled {
            frontends: Vec::new(),
            refusals: vec![refusal],
        }
    }
}

/// Why a Service could not be programmed. Each names the object.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum ModelError {
    #[error("service {service}: {reason}")]
    InvalidService { service: String, reason: String },
    #[error("endpointslice {slice}: {reason}")]
    InvalidSlice { slice: String, reason: String },
}

/// Frontends of one Service. Skipped services (headless, ExternalName,
/// another proxy's) yield an empty list.
///
/// `slices` may hold slices of other services: only those in the Service's
/// namespace whose `kubernetes.io/service-name` label names it are used.
///
/// Frontends come out per service port (in spec order) and, within it, per
/// IP family (in clusterIPs order): the ClusterIP, the NodePort, the
/// externalIPs, the LoadBalancer IPs, each external one followed by its
/// in-cluster (`Scope::Internal`) variant when externalTrafficPolicy is
/// Local. External addresses of a family the Service has no ClusterIP in
/// are ignored, as kube-proxy's per-family proxiers never see them. A key
/// that would appear twice keeps its first frontend, as the first matching
/// iptables rule wins.
///
/// The address policy applies with no other Service and no node address
/// known: addresses refused by what they are (loopback, link-local...),
/// by `--external-ip-cidrs`, and the budget. [`CompactService::modelled`]
/// reads the cluster's claims too.
pub fn service_frontends(
    service: &Service,
    slices: &[&Slice],
    node: &NodeInfo,
    config: &ModelConfig,
) -> Result<Vec<Frontend>, ModelError> {
    CompactService::from(service).frontends(slices, node, config)
}

impl CompactService {
    /// [`service_frontends`] of the Service as the agent keeps it.
    pub fn frontends(
        &self,
        slices: &[&Slice],
        node: &NodeInfo,
        config: &ModelConfig,
    ) -> Result<Vec<Frontend>, ModelError> {
        service::frontends(self, slices, node, config, &AddressClaims::default())
            .map(|modelled| modelled.frontends)
    }

    /// Its frontends and what the address policy refused of it, against
    /// the addresses the cluster's Services and the node claim.
    pub fn modelled(
        &self,
        slices: &[&Slice],
        node: &NodeInfo,
        config: &ModelConfig,
        claims: &AddressClaims,
    ) -> Result<Modelled, ModelError> {
        service::frontends(self, slices, node, config, claims)
    }

    /// [`service_health_check`] of the Service as the agent keeps it.
    pub fn health_check(
        &self,
        slices: &[&Slice],
        node: &NodeInfo,
        config: &ModelConfig,
    ) -> Result<Option<HealthCheck>, ModelError> {
        health_check::health_check(self, slices, node, config)
    }
}

/// Whether an object with these labels is for this proxy to program, by the
/// rules kube-proxy applies to its informers (`!service-proxy-name`,
/// `!headless`), with our own proxy name accepted.
pub fn is_ours(labels: Option<&BTreeMap<String, String>>, config: &ModelConfig) -> bool {
    is_ours_by(&ProxyLabels::of(labels), config)
}

/// [`is_ours`] on the labels an object was kept with.
pub fn is_ours_by(labels: &ProxyLabels, config: &ModelConfig) -> bool {
    if labels.headless {
        return false;
    }
    match &labels.service_proxy_name {
        None => true,
        Some(name) => config.service_proxy_name.as_deref() == Some(&**name),
    }
}
