//! Every address the cluster's Services claim, and the node's own: what
//! the address policy ([`super::address_policy`]) reads to tell a legal
//! external address from one that is another Service's ClusterIP, the
//! node's, or claimed first by an older Service. Kept by the cluster state
//! as objects come and go, so that deciding one Service's addresses costs
//! what it claims, not the cluster.

use std::{cmp::Ordering, net::IpAddr, sync::Arc};

use hashbrown::HashMap;
use k8s_openapi::jiff::Timestamp;
use smallvec::SmallVec;

use super::{
    CompactService, FrontendKind, ModelConfig, Protocol, ProxyLabels, family::Family, is_ours_by,
};

/// Which of two Services claiming one address, port and protocol wins: the
/// older by `metadata.creationTimestamp`, then the first by namespace and
/// name. A Service without a creation time (a manifest that gives none)
/// comes after every one that has one. Only the objects decide, never the
/// order the agent learnt of them in, so every agent of the cluster, and
/// the same agent after a restart, picks the same winner.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rank {
    pub created: Option<Timestamp>,
    /// As the Service gives it (empty for "default").
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl Rank {
    /// The Service's rank; None without a name (such a Service is never
    /// programmed).
    pub fn of(service: &CompactService) -> Option<Rank> {
        Some(Rank {
            created: service.created,
            namespace: service.namespace_arc(),
            name: Arc::clone(service.name.as_ref()?),
        })
    }
}

impl Ord for Rank {
    fn cmp(&self, other: &Self) -> Ordering {
        let created = match (self.created, other.created) {
            (Some(a), Some(b)) => a.cmp(&b),
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (None, None) => Ordering::Equal,
        };
        created
            .then_with(|| self.namespace.cmp(&other.namespace))
            .then_with(|| self.name.cmp(&other.name))
    }
}

impl PartialOrd for Rank {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl std::fmt::Display for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let namespace = if self.namespace.is_empty() {
            "default"
        } else {
            &self.namespace
        };
        write!(f, "{namespace}/{}", self.name)?;
        match self.created {
            Some(t) => write!(f, " (created {t})"),
            None => f.write_str(" (no creation time)"),
        }
    }
}

/// One Service's claim on an external address.
#[derive(Clone, Debug)]
struct Claim {
    rank: Rank,
    /// Its service ports: the frontends it would make on the address.
    ports: Arc<[(u16, Protocol)]>,
    labels: ProxyLabels,
    /// The frontends the Service asks for: one over the budget claims
    /// nothing.
    frontends: u64,
    /// Claimed as an externalIP (which `--external-ip-cidrs` may refuse)
    /// and as a load balancer IP (which it does not).
    external_ip: bool,
    load_balancer: bool,
}

/// The Services holding a ClusterIP: held inline, since the API server
/// gives each address to one Service (a vector's first push would make
/// room for four, 224 bytes per Service).
type Owners = SmallVec<[Rank; 1]>;

/// The cluster's addresses as the address policy reads them.
#[derive(Debug, Default)]
pub struct AddressClaims {
    /// Every ClusterIP, of every Service whose spec parses, ours or not:
    /// the address is that Service's wherever it is programmed. The
    /// Services holding it (the API server gives each to one; manifests
    /// may not).
    cluster_ips: HashMap<IpAddr, Owners>,
    /// Moves each time an address joins or leaves `cluster_ips`, so that
    /// the agent copies the set out only when it changed.
    cluster_ips_generation: u64,
    /// Every external address (externalIPs, load balancer ingress IPs of a
    /// family the Service has a ClusterIP of) and who claims it.
    external: HashMap<IpAddr, Vec<Claim>>,
    /// The node's addresses, from its Node's `status.addresses`.
    node_status: Vec<IpAddr>,
    /// The node's addresses, from its interfaces.
    node_interfaces: Vec<IpAddr>,
}

impl AddressClaims {
    /// The ClusterIP owners of `ip`.
    pub fn cluster_ip_owners(&self, ip: IpAddr) -> &[Rank] {
        self.cluster_ips
            .get(&ip.to_canonical())
            .map_or(&[], Owners::as_slice)
    }

    /// Every ClusterIP some Service holds, with the Services holding it,
    /// and the generation of the set (which moves whenever it changes).
    pub fn cluster_ips(&self) -> (impl Iterator<Item = (IpAddr, &[Rank])> + '_, u64) {
        let ips = self
            .cluster_ips
            .iter()
            .map(|(ip, owners)| (*ip, owners.as_slice()));
        (ips, self.cluster_ips_generation)
    }

    /// Whether `ip` is one of this node's addresses.
    pub fn is_node_address(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.node_status.contains(&ip) || self.node_interfaces.contains(&ip)
    }

    /// The Services claiming `ip` as an external address.
    pub fn claimants(&self, ip: IpAddr) -> impl Iterator<Item = &Rank> {
        self.external
            .get(&ip.to_canonical())
            .into_iter()
            .flatten()
            .map(|claim| &claim.rank)
    }

    /// The winner of `ip:port/protocol` when it is a Service ranked before
    /// `rank`: one that is ours, within its budget, and whose claim the
    /// allow-list (`allowed`, for externalIPs) does not refuse. A claim the
    /// other checks refuse is refused for `rank` too (they read the
    /// address alone), so it needs no test here.
    pub fn older_claimant(
        &self,
        ip: IpAddr,
        port: u16,
        protocol: Protocol,
        rank: &Rank,
        config: &ModelConfig,
        allowed: bool,
    ) -> Option<&Rank> {
        self.external
            .get(&ip.to_canonical())?
            .iter()
            .filter(|claim| claim.rank < *rank)
            .filter(|claim| claim.ports.contains(&(port, protocol)))
            .filter(|claim| claim.load_balancer || (claim.external_ip && allowed))
            .filter(|claim| is_ours_by(&claim.labels, config))
            .filter(|claim| claim.frontends <= config.max_frontends_per_service)
            .map(|claim| &claim.rank)
            .min()
    }

    /// Every address `service` claims: its ClusterIPs and its external
    /// addresses. Whoever else claims one of them may be decided anew when
    /// it comes or goes.
    pub fn addresses_of(service: &CompactService) -> Vec<IpAddr> {
        let Some(Ok(Some(parsed))) = &service.spec else {
            return Vec::new();
        };
        parsed
            .cluster_ips
            .iter()
            .chain(&parsed.external_ips)
            .chain(&parsed.load_balancer_ips)
            .map(IpAddr::to_canonical)
            .collect()
    }

    /// Records what `service` claims.
    pub fn add(&mut self, service: &CompactService) {
        let Some(rank) = Rank::of(service) else {
            return;
        };
        let Some(Ok(Some(parsed))) = &service.spec else {
            return;
        };
        for ip in &parsed.cluster_ips {
            let owners = self.cluster_ips.entry(ip.to_canonical()).or_default();
            if owners.is_empty() {
                self.cluster_ips_generation += 1;
            }
            owners.push(rank.clone());
        }
        let ports: Arc<[(u16, Protocol)]> =
            parsed.ports.iter().map(|p| (p.port, p.protocol)).collect();
        let has_family = |ip: &IpAddr| {
            parsed
                .cluster_ips
                .iter()
                .any(|c| Family::of(*c) == Family::of(*ip))
        };
        let external = parsed
            .external_ips
            .iter()
            .map(|ip| (FrontendKind::ExternalIp, ip))
            .chain(
                parsed
                    .load_balancer_ips
                    .iter()
                    .map(|ip| (FrontendKind::LoadBalancer, ip)),
            )
            .filter(|(_, ip)| has_family(ip));
        for (kind, ip) in external {
            let claims = self.external.entry(ip.to_canonical()).or_default();
            if !claims.iter().any(|c| c.rank == rank) {
                claims.push(Claim {
                    rank: rank.clone(),
                    ports: Arc::clone(&ports),
                    labels: service.labels.clone(),
                    frontends: parsed.frontend_count,
                    external_ip: false,
                    load_balancer: false,
                });
            }
            let Some(claim) = claims.iter_mut().find(|c| c.rank == rank) else {
                continue;
            };
            match kind {
                FrontendKind::ExternalIp => claim.external_ip = true,
                _ => claim.load_balancer = true,
            }
        }
    }

    /// Forgets what `service` claimed.
    pub fn remove(&mut self, service: &CompactService) {
        let Some(rank) = Rank::of(service) else {
            return;
        };
        for ip in Self::addresses_of(service) {
            if let Some(owners) = self.cluster_ips.get_mut(&ip) {
                owners.retain(|r| *r != rank);
                if owners.is_empty() {
                    self.cluster_ips.remove(&ip);
                    self.cluster_ips_generation += 1;
                }
            }
            if let Some(claims) = self.external.get_mut(&ip) {
                claims.retain(|c| c.rank != rank);
                if claims.is_empty() {
                    self.external.remove(&ip);
                }
            }
        }
    }

    /// The node's addresses as its Node gives them; returns those that came
    /// or went.
    pub fn set_node_status(&mut self, addrs: Vec<IpAddr>) -> Vec<IpAddr> {
        replace_set(&mut self.node_status, addrs)
    }

    /// The node's addresses as its interfaces have them; returns those that
    /// came or went.
    pub fn set_node_interfaces(&mut self, addrs: Vec<IpAddr>) -> Vec<IpAddr> {
        replace_set(&mut self.node_interfaces, addrs)
    }
}

/// Replaces `set` (sorted, canonical) with `new`; the addresses in one and
/// not the other.
fn replace_set(set: &mut Vec<IpAddr>, new: Vec<IpAddr>) -> Vec<IpAddr> {
    let mut new: Vec<IpAddr> = new.into_iter().map(|ip| ip.to_canonical()).collect();
    new.sort_unstable();
    new.dedup();
    let changed: Vec<IpAddr> = set
        .iter()
        .filter(|ip| new.binary_search(ip).is_err())
        .chain(new.iter().filter(|ip| set.binary_search(ip).is_err()))
        .copied()
        .collect();
    *set = new;
    changed
}
