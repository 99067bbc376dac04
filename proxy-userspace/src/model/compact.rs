//! What the agent keeps of each object: an EndpointSlice reduced to the
//! endpoints the model reads (checked once, when it arrives), and a Service
//! with only the fields the model and the metrics read. Strings that repeat
//! across objects (namespaces, port names, node names, zones) are shared.
//!
//! An EndpointSlice as k8s-openapi decodes it holds about 340 bytes per
//! endpoint before any of its strings; kept this way it is 48. The numbers
//! per Service are in bench/results/scale.md.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc, time::SystemTime};

use k8s_openapi::{
    api::{core::v1::Service, discovery::v1::EndpointSlice},
    jiff::Timestamp,
};

use super::{
    LABEL_HEADLESS, LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME, ModelError,
    intern::intern,
    service_spec::{self, Parsed},
    slice::{self, ParsedSlice},
};

/// The annotation the EndpointSlice controller stamps with the time of the
/// change a slice reflects (kube-proxy's network programming latency).
pub const LAST_CHANGE_TRIGGER_TIME: &str = "endpoints.kubernetes.io/last-change-trigger-time";

/// The labels kube-proxy's informers filter objects by.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProxyLabels {
    pub headless: bool,
    pub service_proxy_name: Option<Arc<str>>,
}

impl ProxyLabels {
    pub fn of(labels: Option<&BTreeMap<String, String>>) -> Self {
        let Some(labels) = labels else {
            return Self::default();
        };
        ProxyLabels {
            headless: labels.contains_key(LABEL_HEADLESS),
            service_proxy_name: labels.get(LABEL_SERVICE_PROXY_NAME).map(|n| intern(n)),
        }
    }
}

/// An EndpointSlice as the agent keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slice {
    pub namespace: Arc<str>,
    /// Empty when the slice has no name. Shared with the cluster state's
    /// index of the slices of each Service.
    pub name: Arc<str>,
    /// Its `kubernetes.io/service-name` label, non-empty.
    pub service: Option<Box<str>>,
    pub labels: ProxyLabels,
    /// Its `last-change-trigger-time`, when that parses.
    pub trigger_time: Option<SystemTime>,
    /// The slice checked: None for an FQDN slice, the error for one the
    /// model cannot use (reported whenever its Service is programmed).
    pub(super) parsed: Result<Option<ParsedSlice>, ModelError>,
}

impl Slice {
    /// Number of endpoints of a usable slice.
    pub fn endpoint_count(&self) -> usize {
        match &self.parsed {
            Ok(Some(parsed)) => parsed.endpoints.len(),
            _ => 0,
        }
    }
}

impl From<&EndpointSlice> for Slice {
    fn from(slice: &EndpointSlice) -> Self {
        let meta = &slice.metadata;
        let labels = meta.labels.as_ref();
        Slice {
            namespace: intern(meta.namespace.as_deref().unwrap_or_default()),
            name: meta.name.as_deref().unwrap_or_default().into(),
            service: labels
                .and_then(|l| l.get(LABEL_SERVICE_NAME))
                .filter(|n| !n.is_empty())
                .map(|n| n.as_str().into()),
            labels: ProxyLabels::of(labels),
            trigger_time: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(LAST_CHANGE_TRIGGER_TIME))
                .and_then(|text| text.parse::<Timestamp>().ok())
                .map(SystemTime::from),
            parsed: slice::parse_slice(slice),
        }
    }
}

impl From<EndpointSlice> for Slice {
    fn from(slice: EndpointSlice) -> Self {
        Slice::from(&slice)
    }
}

/// A Service as the agent keeps it: its name, namespace and proxy labels,
/// whether it is of type LoadBalancer, and its spec (with its load balancer
/// ingress) checked once when it arrives, as a slice's endpoints are. A
/// few small blocks, where the k8s-openapi `Service` is over a kilobyte of
/// mostly empty fields (bench/results/scale.md has the bytes per Service).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompactService {
    /// As given: empty when unset ("default" is applied where it is read).
    namespace: Arc<str>,
    /// Shared with the rank of each address it claims
    /// ([`super::claims::Rank`]).
    pub(super) name: Option<Arc<str>>,
    pub(super) labels: ProxyLabels,
    /// spec.type is LoadBalancer: only such a Service has a health check.
    pub(super) load_balancer: bool,
    /// Whether (internalTrafficPolicy, externalTrafficPolicy) say Local.
    local_policies: (bool, bool),
    /// None when the Service has no spec; the reason when it cannot be
    /// programmed (reported whenever it is); `Ok(None)` when it has nothing
    /// for a proxy to do.
    pub(super) spec: Option<Result<Option<Parsed>, String>>,
    /// Its `metadata.creationTimestamp`: of two Services claiming one
    /// address, port and protocol the older wins, whatever order the agent
    /// learnt of them in.
    pub(super) created: Option<Timestamp>,
    /// Its `metadata.uid`, which the Events about it name.
    uid: Option<Box<str>>,
}

impl CompactService {
    /// Whether this proxy serves the Service (by its proxy labels).
    pub fn is_ours(&self, config: &super::ModelConfig) -> bool {
        super::is_ours_by(&self.labels, config)
    }

    pub(super) fn namespace_or_default(&self) -> &str {
        if self.namespace.is_empty() {
            "default"
        } else {
            &self.namespace
        }
    }

    /// Its namespace as given: empty when unset.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Its name, if it has one.
    pub fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    /// Its namespace as given, shared.
    pub(super) fn namespace_arc(&self) -> Arc<str> {
        Arc::clone(&self.namespace)
    }

    /// spec.type is LoadBalancer: no other Service has a health check.
    pub fn is_load_balancer(&self) -> bool {
        self.load_balancer
    }

    /// Whether (internalTrafficPolicy, externalTrafficPolicy) say Local.
    pub fn local_policies(&self) -> (bool, bool) {
        self.local_policies
    }

    /// Its `metadata.uid`, if it has one.
    pub fn uid(&self) -> Option<&str> {
        self.uid.as_deref()
    }

    /// Its ClusterIPs as checked, primary family first; none when its spec
    /// has nothing to program or cannot be.
    pub fn cluster_ips(&self) -> &[IpAddr] {
        self.parsed().map_or(&[], |parsed| &parsed.cluster_ips)
    }

    /// Its externalIPs as checked (none once shed: [`Self::shed_over`]).
    pub fn external_ips(&self) -> &[IpAddr] {
        self.parsed().map_or(&[], |parsed| &parsed.external_ips)
    }

    fn parsed(&self) -> Option<&Parsed> {
        match &self.spec {
            Some(Ok(Some(parsed))) => Some(parsed),
            _ => None,
        }
    }

    /// The frontends it asks for, counted from the sizes of its spec (0
    /// when it has none to program).
    pub fn frontend_count(&self) -> u64 {
        self.parsed().map_or(0, |parsed| parsed.frontend_count)
    }

    /// Drops its external addresses when it asks for more than
    /// `max_frontends` frontends: the model refuses such a Service as a
    /// whole, so the agent need not keep what it asked for. Returns
    /// whether it did.
    pub fn shed_over(&mut self, max_frontends: u64) -> bool {
        let Some(Ok(Some(parsed))) = &mut self.spec else {
            return false;
        };
        if parsed.frontend_count <= max_frontends || parsed.shed {
            return false;
        }
        parsed.external_ips = Box::default();
        parsed.load_balancer_ips = Box::default();
        parsed.source_ranges = Box::default();
        parsed.shed = true;
        true
    }
}

impl From<&Service> for CompactService {
    fn from(service: &Service) -> Self {
        let meta = &service.metadata;
        CompactService {
            namespace: intern(meta.namespace.as_deref().unwrap_or_default()),
            name: meta.name.as_deref().map(Arc::from),
            labels: ProxyLabels::of(meta.labels.as_ref()),
            load_balancer: service
                .spec
                .as_ref()
                .is_some_and(|s| s.type_.as_deref() == Some("LoadBalancer")),
            local_policies: service.spec.as_ref().map_or((false, false), |s| {
                (
                    s.internal_traffic_policy.as_deref() == Some("Local"),
                    s.external_traffic_policy.as_deref() == Some("Local"),
                )
            }),
            spec: service
                .spec
                .as_ref()
                .map(|spec| service_spec::parse(service, spec)),
            created: meta.creation_timestamp.as_ref().map(|t| t.0),
            uid: meta.uid.as_deref().map(Box::from),
        }
    }
}

impl From<Service> for CompactService {
    fn from(service: Service) -> Self {
        CompactService::from(&service)
    }
}
