//! Reading a Service (kube-proxy's `serviceport.go` and the informer label
//! filters) and assembling its frontends (the per-frontend choices of
//! `syncProxyRules`: which endpoint set each entry point uses, and REJECT
//! versus DROP when it is empty).

use std::{net::IpAddr, sync::Arc};

use k8s_openapi::{
    api::core::v1::{Service, ServicePort, ServiceSpec},
    apimachinery::pkg::util::intstr::IntOrString,
};

use super::{
    BackendAddr, Cidr, Frontend, FrontendKey, FrontendKind, ModelConfig, ModelError,
    NoEndpointAction, NodeInfo, Protocol, Scope, ServicePortName,
    compact::{CompactService, Slice, intern},
    endpoints::{self, Categorized, Family, ParsedSlice, parse_ip, parse_protocol},
    is_ours_by,
};

/// `DefaultClientIPServiceAffinitySeconds` in k8s.io/api.
const DEFAULT_AFFINITY_TIMEOUT_S: i32 = 10_800;
/// `MaxClientIPServiceAffinitySeconds`: the API server rejects more.
const MAX_AFFINITY_TIMEOUT_S: i32 = 86_400;

/// A service port, checked.
#[expect(
    clippy::struct_field_names,
    reason = "the fields carry the names the Service API gives them"
)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Port {
    /// Shared: most Services name their ports alike.
    name: Arc<str>,
    port: u16,
    protocol: Protocol,
    node_port: Option<u16>,
}

/// What the Service asks for, checked once when it arrives (and kept in
/// its [`CompactService`]). Boxed slices: most of them are empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Parsed {
    /// In spec order, so the first is of the primary family.
    pub(super) cluster_ips: Box<[IpAddr]>,
    pub(super) ports: Box<[Port]>,
    external_ips: Box<[IpAddr]>,
    load_balancer_ips: Box<[IpAddr]>,
    source_ranges: Box<[Cidr]>,
    internal_local: bool,
    pub(super) external_local: bool,
    affinity_timeout_s: Option<u32>,
    /// Unchecked: only the health check uses it, and a bad one must not
    /// cost the Service its frontends.
    pub(super) health_check_node_port: Option<i32>,
}

/// A Service that is this proxy's to program, with a name and a spec.
pub(super) struct Ours<'a> {
    pub(super) service: &'a CompactService,
    pub(super) namespace: &'a str,
    pub(super) name: &'a str,
    /// Its spec as checked on arrival.
    spec: &'a Result<Option<Parsed>, String>,
}

/// The Service if it is ours (kube-proxy's informer label filters), None if
/// not.
pub(super) fn ours<'a>(
    service: &'a CompactService,
    config: &ModelConfig,
) -> Result<Option<Ours<'a>>, ModelError> {
    let namespace = service.namespace_or_default();
    let Some(name) = service.name.as_deref() else {
        return Err(ModelError::InvalidService {
            service: format!("{namespace}/<unnamed>"),
            reason: "metadata.name is missing".into(),
        });
    };
    if !is_ours_by(&service.labels, config) {
        return Ok(None);
    }
    let Some(spec) = service.spec.as_ref() else {
        return Err(ModelError::InvalidService {
            service: format!("{namespace}/{name}"),
            reason: "spec is missing".into(),
        });
    };
    Ok(Some(Ours {
        service,
        namespace,
        name,
        spec,
    }))
}

impl<'a> Ours<'a> {
    pub(super) fn invalid(&self, reason: String) -> ModelError {
        ModelError::InvalidService {
            service: format!("{}/{}", self.namespace, self.name),
            reason,
        }
    }

    pub(super) fn parse(&self) -> Result<Option<&'a Parsed>, ModelError> {
        match self.spec {
            Ok(parsed) => Ok(parsed.as_ref()),
            Err(reason) => Err(self.invalid(reason.clone())),
        }
    }

    /// The Service's own slices among `slices`, checked, FQDN ones left out.
    pub(super) fn slices<'s>(
        &self,
        slices: &[&'s Slice],
        config: &ModelConfig,
    ) -> Result<Vec<&'s ParsedSlice>, ModelError> {
        let mut own: Vec<&Slice> = slices
            .iter()
            .copied()
            .filter(|s| {
                (if s.namespace.is_empty() {
                    "default"
                } else {
                    &*s.namespace
                }) == self.namespace
                    && s.service.as_deref() == Some(self.name)
                    && is_ours_by(&s.labels, config)
            })
            .collect();
        // Stable order, so which copy of a duplicated endpoint is kept does
        // not depend on the order the caller happened to hold the slices in.
        own.sort_by(|a, b| a.name.cmp(&b.name));
        own.into_iter()
            .filter_map(|s| match &s.parsed {
                Ok(parsed) => parsed.as_ref().map(Ok),
                Err(e) => Some(Err(e.clone())),
            })
            .collect()
    }
}

pub(super) fn frontends(
    service: &CompactService,
    slices: &[&Slice],
    node: &NodeInfo,
    config: &ModelConfig,
) -> Result<Vec<Frontend>, ModelError> {
    let Some(ours) = ours(service, config)? else {
        return Ok(Vec::new());
    };
    let Some(parsed) = ours.parse()? else {
        return Ok(Vec::new());
    };
    let parsed_slices = ours.slices(slices, config)?;
    let (namespace, name) = (ours.namespace, ours.name);

    let mut families: Vec<Family> = Vec::new();
    for ip in &parsed.cluster_ips {
        if !families.contains(&Family::of(*ip)) {
            families.push(Family::of(*ip));
        }
    }

    let mut out = Output {
        frontends: Vec::new(),
        affinity_timeout_s: parsed.affinity_timeout_s,
        source_ranges: parsed.source_ranges.to_vec(),
    };
    for port in &parsed.ports {
        let service_port = ServicePortName {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            port: port.name.to_string(),
            protocol: port.protocol,
        };
        for &family in &families {
            let eps = endpoints::endpoints_for_port(
                &parsed_slices,
                family,
                &port.name,
                port.protocol,
                node,
            );
            let sets = endpoints::categorize(&eps, node);
            let internal = policy_set(&sets, parsed.internal_local);
            let external = policy_set(&sets, parsed.external_local);
            // In-cluster clients of an external address skip ETP=Local and use
            // the Cluster set (kube-proxy's EXT-chain short-circuit for pod
            // and node sources); only needed where that differs.
            let short_circuit = parsed.external_local.then(|| policy_set(&sets, false));

            let on = |ip: IpAddr| Family::of(ip) == family;
            let key = |ip: IpAddr, port_number: u16, scope: Scope| FrontendKey {
                ip,
                port: port_number,
                protocol: port.protocol,
                scope,
            };

            for &ip in parsed.cluster_ips.iter().filter(|ip| on(**ip)) {
                out.push(
                    key(ip, port.port, Scope::Any),
                    FrontendKind::ClusterIp,
                    &service_port,
                    &internal,
                );
            }
            let node_port = port
                .node_port
                .map(|n| (FrontendKind::NodePort, family.unspecified(), n));
            let external_ips = parsed
                .external_ips
                .iter()
                .filter(|ip| on(**ip))
                .map(|&ip| (FrontendKind::ExternalIp, ip, port.port));
            let load_balancer_ips = parsed
                .load_balancer_ips
                .iter()
                .filter(|ip| on(**ip))
                .map(|&ip| (FrontendKind::LoadBalancer, ip, port.port));
            for (kind, ip, port_number) in node_port
                .into_iter()
                .chain(external_ips)
                .chain(load_balancer_ips)
            {
                out.push(
                    key(ip, port_number, Scope::Any),
                    kind,
                    &service_port,
                    &external,
                );
                if let Some(cluster) = &short_circuit {
                    out.push(
                        key(ip, port_number, Scope::Internal),
                        kind,
                        &service_port,
                        cluster,
                    );
                }
            }
        }
    }
    Ok(out.frontends)
}

/// The backends one traffic policy gives, and what to do when there are
/// none. Borrowed: each frontend copies the set it uses, and a set no
/// frontend uses is never copied.
struct PolicySet<'a> {
    backends: &'a [BackendAddr],
    no_endpoints: NoEndpointAction,
}

fn policy_set(sets: &Categorized, local: bool) -> PolicySet<'_> {
    if !sets.has_any {
        // No usable endpoint anywhere: kube-proxy REJECTs whatever the
        // policy ("has no endpoints").
        return PolicySet {
            backends: &[],
            no_endpoints: NoEndpointAction::Reject,
        };
    }
    if local {
        PolicySet {
            backends: &sets.local,
            // Endpoints exist, just not here: "has no local endpoints", DROP.
            no_endpoints: NoEndpointAction::Drop,
        }
    } else {
        PolicySet {
            backends: &sets.cluster,
            no_endpoints: NoEndpointAction::Reject,
        }
    }
}

struct Output {
    frontends: Vec<Frontend>,
    affinity_timeout_s: Option<u32>,
    source_ranges: Vec<Cidr>,
}

impl Output {
    fn push(
        &mut self,
        key: FrontendKey,
        kind: FrontendKind,
        service: &ServicePortName,
        set: &PolicySet,
    ) {
        // A Service has a few frontends: a scan beats hashing them.
        if self.frontends.iter().any(|f| f.key == key) {
            return;
        }
        self.frontends.push(Frontend {
            key,
            kind,
            service: service.clone(),
            backends: set.backends.to_vec(),
            // Only meaningful for an empty set; fixed otherwise so that a
            // policy change alone never looks like a frontend change.
            no_endpoints: if set.backends.is_empty() {
                set.no_endpoints
            } else {
                NoEndpointAction::Reject
            },
            affinity_timeout_s: self.affinity_timeout_s,
            // The firewall of a LoadBalancer IP: ranges of its own family.
            source_ranges: if kind == FrontendKind::LoadBalancer {
                self.source_ranges
                    .iter()
                    .filter(|r| r.ip.is_ipv4() == key.ip.is_ipv4())
                    .copied()
                    .collect()
            } else {
                Vec::new()
            },
        });
    }
}

/// Checks the Service. `Ok(None)` means it has nothing for a proxy to do
/// (ExternalName, headless).
pub(super) fn parse(service: &Service, spec: &ServiceSpec) -> Result<Option<Parsed>, String> {
    let type_ = spec.type_.as_deref().unwrap_or("ClusterIP");
    match type_ {
        "ExternalName" => return Ok(None),
        "ClusterIP" | "NodePort" | "LoadBalancer" => {}
        other => {
            return Err(format!(
                "type {other:?} is not one of ClusterIP, NodePort, LoadBalancer, ExternalName"
            ));
        }
    }

    let Some(cluster_ips) = cluster_ips(spec)? else {
        return Ok(None);
    };
    let ports = ports(spec.ports.as_deref().unwrap_or_default())?;
    let external_ips = spec
        .external_ips
        .iter()
        .flatten()
        .map(|text| {
            parse_ip(text).ok_or_else(|| format!("externalIPs: {text:?} is not an IP address"))
        })
        .collect::<Result<Vec<_>, _>>()?;

    let mut load_balancer_ips = Vec::new();
    if type_ == "LoadBalancer" {
        let ingress = service
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref());
        for entry in ingress.into_iter().flatten() {
            // ipMode Proxy means the load balancer delivers to the node with
            // its own address as destination, so kube-proxy must not capture
            // the VIP; hostname-only entries have nothing to capture.
            let Some(text) = entry.ip.as_deref().filter(|t| !t.is_empty()) else {
                continue;
            };
            if entry.ip_mode.as_deref().is_some_and(|m| m != "VIP") {
                continue;
            }
            let ip = parse_ip(text).ok_or_else(|| {
                format!("status.loadBalancer.ingress: {text:?} is not an IP address")
            })?;
            load_balancer_ips.push(ip);
        }
    }

    let source_ranges = spec
        .load_balancer_source_ranges
        .iter()
        .flatten()
        .map(|text| {
            Cidr::parse(text)
                .ok_or_else(|| format!("loadBalancerSourceRanges: {text:?} is not a CIDR"))
        })
        .collect::<Result<Vec<_>, _>>()?;

    Ok(Some(Parsed {
        cluster_ips: cluster_ips.into_boxed_slice(),
        ports: ports.into_boxed_slice(),
        external_ips: external_ips.into_boxed_slice(),
        load_balancer_ips: load_balancer_ips.into_boxed_slice(),
        source_ranges: source_ranges.into_boxed_slice(),
        internal_local: is_local_policy(
            spec.internal_traffic_policy.as_deref(),
            "internalTrafficPolicy",
        )?,
        external_local: is_local_policy(
            spec.external_traffic_policy.as_deref(),
            "externalTrafficPolicy",
        )?,
        affinity_timeout_s: affinity_timeout(spec)?,
        health_check_node_port: spec.health_check_node_port,
    }))
}

/// spec.clusterIPs (spec.clusterIP when that is absent); None when headless.
fn cluster_ips(spec: &ServiceSpec) -> Result<Option<Vec<IpAddr>>, String> {
    let texts: Vec<&str> = match spec.cluster_ips.as_deref() {
        Some(ips) if !ips.is_empty() => ips.iter().map(String::as_str).collect(),
        _ => spec
            .cluster_ip
            .as_deref()
            .filter(|ip| !ip.is_empty())
            .into_iter()
            .collect(),
    };
    match texts.first() {
        None => return Err("no clusterIP (spec.clusterIP and spec.clusterIPs are empty)".into()),
        Some(&"None") => return Ok(None),
        Some(_) => {}
    }
    let mut ips: Vec<IpAddr> = Vec::with_capacity(texts.len());
    for text in texts {
        let ip =
            parse_ip(text).ok_or_else(|| format!("clusterIP {text:?} is not an IP address"))?;
        if ips.iter().any(|other| Family::of(*other) == Family::of(ip)) {
            return Err(format!(
                "clusterIPs {ip} is a second address of the same IP family"
            ));
        }
        ips.push(ip);
    }
    Ok(Some(ips))
}

fn ports(ports: &[ServicePort]) -> Result<Vec<Port>, String> {
    let mut out: Vec<Port> = Vec::with_capacity(ports.len());
    for port in ports {
        let name = port.name.as_deref().unwrap_or("");
        let label = if name.is_empty() {
            format!("port {}", port.port)
        } else {
            format!("port {name:?}")
        };
        let number = u16::try_from(port.port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| format!("{label}: port {} is out of range 1-65535", port.port))?;
        let protocol =
            parse_protocol(port.protocol.as_deref()).map_err(|e| format!("{label}: {e}"))?;
        let node_port = match port.node_port {
            None | Some(0) => None,
            Some(n) => Some(
                u16::try_from(n)
                    .map_err(|_| format!("{label}: nodePort {n} is out of range 1-65535"))?,
            ),
        };
        match &port.target_port {
            Some(IntOrString::Int(t)) if !(1..=65535).contains(t) => {
                return Err(format!("{label}: targetPort {t} is out of range 1-65535"));
            }
            Some(IntOrString::String(t)) if t.is_empty() => {
                return Err(format!("{label}: targetPort is an empty name"));
            }
            _ => {}
        }
        for other in &out {
            // Endpoints are matched to service ports by name, so names must
            // tell the ports apart; the API server enforces the same.
            if &*other.name == name {
                return Err(if name.is_empty() {
                    "more than one port without a name".to_owned()
                } else {
                    format!("two ports named {name:?}")
                });
            }
            if other.port == number && other.protocol == protocol {
                return Err(format!("two ports are {number}/{protocol}"));
            }
            if let Some(n) = node_port
                && other.node_port == Some(n)
                && other.protocol == protocol
            {
                return Err(format!("two ports use nodePort {n}/{protocol}"));
            }
        }
        out.push(Port {
            name: intern(name),
            port: number,
            protocol,
            node_port,
        });
    }
    Ok(out)
}

fn is_local_policy(policy: Option<&str>, field: &str) -> Result<bool, String> {
    match policy {
        None | Some("Cluster") => Ok(false),
        Some("Local") => Ok(true),
        Some(other) => Err(format!("{field} {other:?} is not one of Cluster, Local")),
    }
}

fn affinity_timeout(spec: &ServiceSpec) -> Result<Option<u32>, String> {
    match spec.session_affinity.as_deref() {
        None | Some("None") => Ok(None),
        Some("ClientIP") => {
            let timeout = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds)
                .unwrap_or(DEFAULT_AFFINITY_TIMEOUT_S);
            if timeout <= 0 || timeout > MAX_AFFINITY_TIMEOUT_S {
                return Err(format!(
                    "sessionAffinityConfig.clientIP.timeoutSeconds {timeout} is out of range 1-{MAX_AFFINITY_TIMEOUT_S}"
                ));
            }
            Ok(Some(timeout as u32))
        }
        Some(other) => Err(format!(
            "sessionAffinity {other:?} is not one of None, ClientIP"
        )),
    }
}
