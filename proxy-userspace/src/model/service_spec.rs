//! A Service's spec checked once, when it arrives (kube-proxy's
//! `serviceport.go`): its addresses, ports, policies and affinity, or why a
//! proxy cannot program it. What the model assembles from it is
//! `service`'s.

use std::{net::IpAddr, sync::Arc};

use k8s_openapi::{
    api::core::v1::{Service, ServicePort, ServiceSpec},
    apimachinery::pkg::util::intstr::IntOrString,
};

use super::{
    Cidr, LbAlgorithm, Protocol,
    family::{Family, parse_ip},
    intern::intern,
    types::parse_protocol,
};

/// `DefaultClientIPServiceAffinitySeconds` in k8s.io/api.
const DEFAULT_AFFINITY_TIMEOUT_S: i32 = 10_800;
/// `MaxClientIPServiceAffinitySeconds`: the API server rejects more.
const MAX_AFFINITY_TIMEOUT_S: i32 = 86_400;
/// The annotation choosing a Service's load-balancing algorithm over
/// `--lb-algorithm` (`random` or `maglev`).
pub const LB_ALGORITHM_ANNOTATION: &str = "ebpf-proxy.io/lb-algorithm";

/// A service port, checked.
#[expect(
    clippy::struct_field_names,
    reason = "the fields carry the names the Service API gives them"
)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Port {
    /// Shared: most Services name their ports alike.
    pub(super) name: Arc<str>,
    pub(super) port: u16,
    pub(super) protocol: Protocol,
    pub(super) node_port: Option<u16>,
}

/// What the Service asks for, checked once when it arrives (and kept in
/// its [`CompactService`]). Boxed slices: most of them are empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Parsed {
    /// In spec order, so the first is of the primary family.
    pub(super) cluster_ips: Box<[IpAddr]>,
    pub(super) ports: Box<[Port]>,
    pub(super) external_ips: Box<[IpAddr]>,
    pub(super) load_balancer_ips: Box<[IpAddr]>,
    pub(super) source_ranges: Box<[Cidr]>,
    pub(super) internal_local: bool,
    pub(super) external_local: bool,
    pub(super) affinity_timeout_s: Option<u32>,
    /// Its `ebpf-proxy.io/lb-algorithm`, when that names one: None leaves
    /// the choice to `--lb-algorithm`.
    pub(super) lb_algorithm: Option<LbAlgorithm>,
    /// Unchecked: only the health check uses it, and a bad one must not
    /// cost the Service its frontends.
    pub(super) health_check_node_port: Option<i32>,
    /// How many frontends the Service asks for, counted from the sizes of
    /// its spec as the model would make them ([`frontend_count`]), so that
    /// a Service over its budget is refused before anything is made of it.
    pub(super) frontend_count: u64,
    /// Its external addresses were dropped on arrival, as it asked for more
    /// frontends than a Service may have: what the agent keeps of it does
    /// not grow with what it asks for.
    pub(super) shed: bool,
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

    let external_local = is_local_policy(
        spec.external_traffic_policy.as_deref(),
        "externalTrafficPolicy",
    )?;
    let frontend_count = frontend_count(
        &cluster_ips,
        &ports,
        external_ips.iter().chain(&load_balancer_ips).copied(),
        external_local,
    );
    Ok(Some(Parsed {
        frontend_count,
        shed: false,
        cluster_ips: cluster_ips.into_boxed_slice(),
        ports: ports.into_boxed_slice(),
        external_ips: external_ips.into_boxed_slice(),
        load_balancer_ips: load_balancer_ips.into_boxed_slice(),
        source_ranges: source_ranges.into_boxed_slice(),
        internal_local: is_local_policy(
            spec.internal_traffic_policy.as_deref(),
            "internalTrafficPolicy",
        )?,
        external_local,
        affinity_timeout_s: affinity_timeout(spec)?,
        lb_algorithm: lb_algorithm(service),
        health_check_node_port: spec.health_check_node_port,
    }))
}

/// The Service's `ebpf-proxy.io/lb-algorithm`. A value that names no
/// algorithm is warned about and left to `--lb-algorithm`: it costs the
/// Service nothing else.
fn lb_algorithm(service: &Service) -> Option<LbAlgorithm> {
    let meta = &service.metadata;
    let text = meta.annotations.as_ref()?.get(LB_ALGORITHM_ANNOTATION)?;
    match text.parse() {
        Ok(algorithm) => Some(algorithm),
        Err(e) => {
            tracing::warn!(
                service = format!(
                    "{}/{}",
                    meta.namespace.as_deref().unwrap_or("default"),
                    meta.name.as_deref().unwrap_or_default()
                ),
                annotation = LB_ALGORITHM_ANNOTATION,
                value = %text,
                "{e}; using --lb-algorithm's"
            );
            None
        }
    }
}

/// The frontends a Service of these sizes makes, as `service::frontends`
/// makes them: per port and per family it has a ClusterIP of, the
/// ClusterIP, then its NodePort and each external address of that family
/// (externalIPs and load balancer IPs), twice each under
/// externalTrafficPolicy Local (the in-cluster variant). Addresses of a
/// family without a ClusterIP are not programmed and not counted. A key
/// that would repeat is counted each time: an upper bound, reached by
/// every Service that does not list an address twice.
pub(super) fn frontend_count(
    cluster_ips: &[IpAddr],
    ports: &[Port],
    external: impl Iterator<Item = IpAddr>,
    external_local: bool,
) -> u64 {
    let mut per_family = [0_u64; 2];
    for ip in external {
        per_family[usize::from(Family::of(ip) == Family::V6)] += 1;
    }
    let variants = if external_local { 2 } else { 1 };
    let mut total = 0_u64;
    for (i, family) in [Family::V4, Family::V6].into_iter().enumerate() {
        if !cluster_ips.iter().any(|ip| Family::of(*ip) == family) {
            continue;
        }
        for port in ports {
            let external = per_family[i] + u64::from(port.node_port.is_some());
            total = total.saturating_add(1 + external * variants);
        }
    }
    total
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
