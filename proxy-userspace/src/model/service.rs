//! Whether a Service is this proxy's (the informer label filters), and its
//! frontends assembled from its checked spec (the per-frontend choices of
//! `syncProxyRules`: which endpoint set each entry point uses, and REJECT
//! versus DROP when it is empty).

use std::{collections::HashSet, net::IpAddr};

use super::{
    BackendAddr, Cidr, Frontend, FrontendKey, FrontendKind, LbAlgorithm, ModelConfig, ModelError,
    Modelled, NoEndpointAction, NodeInfo, Scope, ServicePortName,
    address_policy::{AddressCheck, Reason, Refusal, RefusedAddress},
    claims::{AddressClaims, Rank},
    compact::{CompactService, Slice},
    endpoints::{self, Categorized},
    family::Family,
    is_ours_by,
    service_spec::Parsed,
    slice::ParsedSlice,
};

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
    claims: &AddressClaims,
) -> Result<Modelled, ModelError> {
    let Some(ours) = ours(service, config)? else {
        return Ok(Modelled::default());
    };
    let Some(parsed) = ours.parse()? else {
        return Ok(Modelled::default());
    };
    let rank = Rank::of(service).ok_or_else(|| ours.invalid("metadata.name is missing".into()))?;
    let check = AddressCheck::new(config, claims, rank);
    // Counted from the spec's sizes, before any frontend is made: a
    // Service over its budget costs no more than one within it.
    if let Some(refusal) = check.budget(parsed.frontend_count, parsed.shed) {
        return Ok(Modelled::refused(refusal));
    }
    let parsed_slices = ours.slices(slices, config)?;
    let (namespace, name) = (ours.namespace, ours.name);
    let families = families_of(&parsed.cluster_ips);

    let mut out = Output {
        frontends: Vec::new(),
        affinity_timeout_s: parsed.affinity_timeout_s,
        lb_algorithm: parsed.lb_algorithm,
        source_ranges: parsed.source_ranges.to_vec(),
    };
    let (mut refusals, refused) = refused_addresses(parsed, &families, &check);
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
                    port.port,
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
            let claimed: Vec<_> = external_ips
                .chain(load_balancer_ips)
                .filter(|(kind, ip, _)| !refused.contains(&(*kind, *ip)))
                .filter(|&(kind, ip, number)| {
                    unclaimed(&check, &mut refusals, kind, ip, number, port.protocol)
                })
                .collect();
            for (kind, ip, port_number) in node_port.into_iter().chain(claimed) {
                out.push(
                    key(ip, port_number, Scope::Any),
                    kind,
                    &service_port,
                    port.port,
                    &external,
                );
                if let Some(cluster) = &short_circuit {
                    out.push(
                        key(ip, port_number, Scope::Internal),
                        kind,
                        &service_port,
                        port.port,
                        cluster,
                    );
                }
            }
        }
    }
    Ok(Modelled {
        frontends: out.frontends,
        refusals,
    })
}

/// The families of `cluster_ips`, in their order.
fn families_of(cluster_ips: &[IpAddr]) -> Vec<Family> {
    let mut families: Vec<Family> = Vec::new();
    for ip in cluster_ips {
        if !families.contains(&Family::of(*ip)) {
            families.push(Family::of(*ip));
        }
    }
    families
}

/// The external addresses of `parsed` (of `families`) the policy refuses
/// on every port, each refused once, and the refusals.
fn refused_addresses(
    parsed: &Parsed,
    families: &[Family],
    check: &AddressCheck,
) -> (Vec<Refusal>, HashSet<(FrontendKind, IpAddr)>) {
    let mut refusals = Vec::new();
    let mut refused = HashSet::new();
    let externals = parsed
        .external_ips
        .iter()
        .map(|ip| (FrontendKind::ExternalIp, *ip))
        .chain(
            parsed
                .load_balancer_ips
                .iter()
                .map(|ip| (FrontendKind::LoadBalancer, *ip)),
        )
        .filter(|(_, ip)| families.contains(&Family::of(*ip)));
    for (kind, ip) in externals {
        if let Some((reason, detail)) = check.address(kind, ip)
            && refused.insert((kind, ip))
        {
            refusals.push(Refusal {
                reason,
                address: Some(RefusedAddress {
                    kind,
                    ip,
                    port: None,
                }),
                detail,
            });
        }
    }
    (refusals, refused)
}

/// Whether no older Service has `ip:port/protocol`; when one has, the
/// conflict goes to `refusals` (once).
fn unclaimed(
    check: &AddressCheck,
    refusals: &mut Vec<Refusal>,
    kind: FrontendKind,
    ip: IpAddr,
    port: u16,
    protocol: super::Protocol,
) -> bool {
    let Some(detail) = check.conflict(ip, port, protocol) else {
        return true;
    };
    let refusal = Refusal {
        reason: Reason::Conflict,
        address: Some(RefusedAddress {
            kind,
            ip,
            port: Some((port, protocol)),
        }),
        detail,
    };
    if !refusals.contains(&refusal) {
        refusals.push(refusal);
    }
    false
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
    lb_algorithm: Option<LbAlgorithm>,
    source_ranges: Vec<Cidr>,
}

impl Output {
    fn push(
        &mut self,
        key: FrontendKey,
        kind: FrontendKind,
        service: &ServicePortName,
        service_port: u16,
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
            service_port,
            backends: set.backends.to_vec(),
            // Only meaningful for an empty set; fixed otherwise so that a
            // policy change alone never looks like a frontend change.
            no_endpoints: if set.backends.is_empty() {
                set.no_endpoints
            } else {
                NoEndpointAction::Reject
            },
            affinity_timeout_s: self.affinity_timeout_s,
            lb_algorithm: self.lb_algorithm,
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
