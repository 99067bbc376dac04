//! The node-level maps in the agent: what it wants them to hold (the
//! configuration, then the interfaces as they come), written through the node
//! planner, and a write that failed retried on the agent's one record of
//! what a write still owes (`crate::retry`) until it lands.

use std::{net::IpAddr, time::Instant};

use tracing::{info, warn};

use crate::{
    model::{Cidr, ModelConfig, Rank},
    node_ip::NodeIps,
    planner::{
        MapStore, NodeState,
        node::{DesiredNode, NodePlanner},
    },
    retry::Retry,
    source::ObjectKey,
    state::ClusterState,
};

pub struct NodeMaps {
    desired: DesiredNode,
    planner: NodePlanner,
    /// Set while a write has not landed.
    retry: Option<Retry>,
    families: FamilyNotice,
    /// `AddressClaims`' generation of the ClusterIPs last copied.
    cluster_ips_generation: Option<u64>,
    /// The cluster state's generation of the service CIDRs last read.
    service_cidrs_generation: Option<u64>,
}

impl NodeMaps {
    /// Starts from what the maps hold (`applied`), wanting `desired`.
    pub fn new(applied: NodeState, desired: DesiredNode) -> Self {
        Self {
            desired,
            planner: NodePlanner::adopt(applied),
            retry: None,
            families: FamilyNotice::default(),
            cluster_ips_generation: None,
            service_cidrs_generation: None,
        }
    }

    /// The interfaces as they are now: node addresses of both families,
    /// and the node's address of each family (`node_addresses`). A family
    /// the node has no address of is said once, and again when that changes.
    pub fn set_interfaces(
        &mut self,
        addrs: &[IpAddr],
        nodeport_addresses: &[Cidr],
        ips: NodeIps,
        localhost_nodeports: bool,
    ) {
        if let Some(missing) = self.families.update(ips) {
            for family in missing {
                warn!(
                    family,
                    "this node has no {family} address: {family} Services are served all the same \
                     (their ClusterIPs, ExternalIPs and LoadBalancer IPs), their NodePorts on no \
                     address, as kube-proxy's proxier of a family the node has no address of"
                );
            }
        }
        self.desired.set_interfaces(
            addrs,
            nodeport_addresses,
            ips.v4,
            ips.v6,
            localhost_nodeports,
        );
    }

    /// The interfaces whose packets come from this node's pods; written at
    /// the next `sync`.
    pub fn set_local_ifaces(&mut self, ifindexes: std::collections::BTreeSet<u32>) {
        self.desired.set_local_ifaces(ifindexes);
    }

    /// The host-side interfaces of this node's pods, and which of them
    /// carry a qdisc (kept only with `--host-routing bpf`); written at the
    /// next `sync`.
    pub fn set_pod_ifaces(
        &mut self,
        pods: std::collections::BTreeSet<u32>,
        shaped: &std::collections::BTreeSet<u32>,
    ) {
        self.desired.set_pod_ifaces(pods, shaped);
    }

    /// SNATs off-cluster clients of a ClusterIP, per family; written at the
    /// next `sync`.
    pub fn set_masquerade_off_cluster(&mut self, v4: bool, v6: bool) {
        self.desired.set_masquerade_off_cluster(v4, v6);
    }

    /// The pod CIDRs whose clients are in-cluster; written at the next
    /// `sync`.
    pub fn set_cluster_cidrs(&mut self, cidrs: &[Cidr]) {
        self.desired.set_cluster_cidrs(cidrs);
    }

    /// The service CIDRs as `state` has them from the `ServiceCIDR` objects
    /// where there are any, else `fallback` (`--service-cluster-ip-range`):
    /// read only when they moved since the last call. True when they did
    /// (to be written at the next `sync`).
    pub fn follow_service_cidrs(&mut self, state: &ClusterState, fallback: &[Cidr]) -> bool {
        let generation = state.service_cidrs_generation();
        if self.service_cidrs_generation == Some(generation) {
            return false;
        }
        self.service_cidrs_generation = Some(generation);
        let listed = state.service_cidrs();
        let (cidrs, from) = if listed.is_empty() {
            (fallback, "--service-cluster-ip-range")
        } else {
            (listed.as_slice(), "ServiceCIDR objects")
        };
        info!(service_cidrs = ?cidrs, from, "service CIDRs");
        self.desired.set_service_ranges(cidrs);
        true
    }

    /// Every Service's ClusterIPs as `state`'s claims hold them, each with
    /// whether a Service of this proxy (by `config`) holds it: copied into
    /// the desired state only when the set moved since the last call. True
    /// when it did (to be written at the next `sync`).
    pub fn follow_cluster_ips(&mut self, state: &ClusterState, config: &ModelConfig) -> bool {
        let (ips, generation) = state.claims().cluster_ips();
        if self.cluster_ips_generation == Some(generation) {
            return false;
        }
        self.cluster_ips_generation = Some(generation);
        let ours = |owner: &Rank| {
            let key = ObjectKey {
                namespace: owner.namespace.to_string(),
                name: owner.name.to_string(),
            };
            state
                .service(&key)
                .is_some_and(|service| service.is_ours(config))
        };
        self.desired
            .set_cluster_ips(ips.map(|(ip, owners)| (ip, owners.iter().any(ours))));
        true
    }

    /// Whether tc leaves to netfilter the packets of flows its conntrack
    /// translates (kube-proxy's, after a takeover); written at the next
    /// `sync`.
    pub fn set_netfilter_flows(&mut self, on: bool) {
        self.desired.set_netfilter_flows(on);
    }

    /// When a failed write is due for its retry.
    pub fn wakeup(&self) -> Option<Instant> {
        self.retry.map(|r| r.due)
    }

    /// Writes what the maps lack; a failure is logged with the write that
    /// failed and retried after the backoff.
    pub fn sync<S: MapStore>(&mut self, store: &mut S, now: Instant) {
        let outcome = self.planner.sync(&self.desired, store);
        match outcome.failed {
            None => {
                if let Some(retry) = self.retry.take() {
                    info!(
                        failures = retry.failures,
                        "node maps written after retrying"
                    );
                }
            }
            Some((op, e)) => {
                let retry = Retry::after(self.retry.as_ref(), now, 0);
                warn!(
                    error = %e,
                    failures = retry.failures,
                    retry_in_ms = retry.due.saturating_duration_since(now).as_millis() as u64,
                    "{op} failed; retrying"
                );
                self.retry = Some(retry);
            }
        }
    }
}

/// The node's address of each family: the configured one (`--node-ip`),
/// else the first of that family the interfaces show.
pub fn node_addresses(configured: NodeIps, addrs: &[IpAddr]) -> NodeIps {
    let first_v4 = addrs.iter().find_map(|ip| match ip {
        IpAddr::V4(v4) => Some(*v4),
        IpAddr::V6(_) => None,
    });
    let first_v6 = addrs.iter().find_map(|ip| match ip {
        IpAddr::V6(v6) => Some(*v6),
        IpAddr::V4(_) => None,
    });
    NodeIps {
        v4: configured.v4.or(first_v4),
        v6: configured.v6.or(first_v6),
    }
}

/// Which families the node had no address of when last told.
#[derive(Debug, Default)]
struct FamilyNotice {
    missing: Option<Vec<&'static str>>,
}

impl FamilyNotice {
    /// The families `ips` lacks, when that is news: the first time, and
    /// when the set changed since (empty: the node has both now).
    fn update(&mut self, ips: NodeIps) -> Option<Vec<&'static str>> {
        let missing: Vec<&'static str> = [(ips.v4.is_none(), "IPv4"), (ips.v6.is_none(), "IPv6")]
            .into_iter()
            .filter_map(|(lacks, family)| lacks.then_some(family))
            .collect();
        if self.missing.as_ref() == Some(&missing) {
            return None;
        }
        if self
            .missing
            .as_ref()
            .is_some_and(|before| !before.is_empty())
            && missing.is_empty()
        {
            info!("this node has addresses of both families now");
        }
        self.missing = Some(missing.clone());
        Some(missing)
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    #[test]
    fn each_family_takes_the_configured_address_else_the_first_shown() {
        let v4a = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
        let v4b = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));
        let v6a: Ipv6Addr = "fd00::1".parse().unwrap();
        let v6b: Ipv6Addr = "fd00::2".parse().unwrap();
        let shown = [v4a, IpAddr::V6(v6a), v4b, IpAddr::V6(v6b)];
        assert_eq!(
            node_addresses(NodeIps::default(), &shown),
            NodeIps {
                v4: Some(Ipv4Addr::new(10, 0, 0, 1)),
                v6: Some(v6a)
            },
            "nothing configured: the first of each family"
        );
        let configured = NodeIps {
            v4: None,
            v6: Some(v6b),
        };
        assert_eq!(
            node_addresses(configured, &shown),
            NodeIps {
                v4: Some(Ipv4Addr::new(10, 0, 0, 1)),
                v6: Some(v6b)
            },
            "the configured IPv6 address, the first IPv4 one shown"
        );
        assert_eq!(
            node_addresses(NodeIps::default(), &[v4b]),
            NodeIps {
                v4: Some(Ipv4Addr::new(10, 0, 0, 2)),
                v6: None
            },
            "an IPv4-only node"
        );
    }

    #[test]
    fn a_missing_family_is_said_once_and_again_when_it_changes() {
        let mut notice = FamilyNotice::default();
        let v4_only = NodeIps {
            v4: Some(Ipv4Addr::new(10, 0, 0, 1)),
            v6: None,
        };
        assert_eq!(notice.update(v4_only), Some(vec!["IPv6"]), "first look");
        assert_eq!(notice.update(v4_only), None, "the same again: nothing new");
        assert_eq!(notice.update(v4_only), None);
        let both = NodeIps {
            v6: Some("fd00::1".parse().unwrap()),
            ..v4_only
        };
        assert_eq!(notice.update(both), Some(vec![]), "an IPv6 address came");
        assert_eq!(notice.update(both), None);
        assert_eq!(notice.update(v4_only), Some(vec!["IPv6"]), "and went");
        let mut fresh = FamilyNotice::default();
        assert_eq!(
            fresh.update(both),
            Some(vec![]),
            "a dual-stack node says nothing"
        );
    }
}
