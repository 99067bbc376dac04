//! The node-level maps (`NODE_ADDRS`, `NODE_CONFIG`, `NODE_CONFIG6`,
//! `CT_TIMEOUTS`, `CLUSTER_CIDRS`, `SERVICE_CIDRS`) under the service maps' discipline: a desired state, a diff
//! against what the maps hold, ordered writes through the same [`MapStore`],
//! and what failed left pending for the next try. Nothing is flushed.
//!
//! Order: every entry that is wanted is written before any stale one is
//! deleted, so an address or CIDR that stays is never missing; the first
//! failure stops the writes, so a delete never runs ahead of a put that did
//! not land. Each op that lands is recorded at once, so a retry writes only
//! what is still missing.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use proxy_common::{
    CtTimeouts, NodeAddr, NodeAddrKey, NodeConfig, node_addr_flags, node_config_flags, service_cidr,
};

use super::{
    encode::{ClusterCidrEntry, addr_words, cluster_cidr},
    ops::{IfaceSet, MapOp, MapStore},
    stored::NodeState,
};
use crate::model::Cidr;

/// How an external flow to a backend on another node leaves the entry node
/// (`--lb-mode`; docs/architecture.md, "Direct server return").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LbMode {
    /// SNATed to the node's address, as kube-proxy does: replies come back
    /// through it.
    #[default]
    Snat,
    /// Direct server return: the client's address kept, the backend's node
    /// answering the client itself (`node_config_flags::DSR`).
    Dsr,
    /// Direct server return for TCP, SNAT for UDP
    /// (`node_config_flags::DSR_TCP_ONLY`).
    Hybrid,
}

impl LbMode {
    /// The `NODE_CONFIG` flags it sets.
    pub fn flags(self) -> u32 {
        match self {
            LbMode::Snat => 0,
            LbMode::Dsr => node_config_flags::DSR,
            LbMode::Hybrid => node_config_flags::DSR | node_config_flags::DSR_TCP_ONLY,
        }
    }
}

/// How a packet tc translated reaches a pod of this node (`--host-routing`;
/// docs/architecture.md, "Host routing").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum HostRouting {
    /// Through the node's stack, as kube-proxy's translated packets go:
    /// routed and forwarded there, through netfilter's `FORWARD` and
    /// `POSTROUTING` and the pod interface's qdisc.
    #[default]
    Stack,
    /// Straight into the pod's namespace from tc, where its route leads out
    /// of a pod's host-side veth (`node_config_flags::HOST_ROUTING_BPF`,
    /// `POD_IFACES`).
    Bpf,
}

/// Whose connections the socket hooks send to a backend at `connect()`
/// (docs/architecture.md, "Pods' connections at `connect()`").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SocketLb {
    /// The node's own, every one to a frontend: pods' are tc's.
    #[default]
    Node,
    /// Pods' TCP connections to ClusterIPs too (`--socket-lb-pods`,
    /// `node_config_flags::SOCKET_LB_PODS`).
    NodeAndPods,
}

/// What the agent wants the node-level maps to hold. `None` leaves a map as
/// it is: until the first look at the interfaces, the node addresses and
/// SNAT address adopted from the pins keep serving NodePorts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DesiredNode {
    pub addrs: Option<BTreeMap<NodeAddrKey, NodeAddr>>,
    pub config: Option<NodeConfig>,
    pub config6: Option<NodeConfig>,
    pub ct_timeouts: CtTimeouts,
    pub cluster_cidrs: BTreeSet<ClusterCidrEntry>,
    /// Whether flows netfilter translated before this datapath (kube-
    /// proxy's) may still live (`node_config_flags::NETFILTER_FLOWS`).
    pub netfilter_flows: bool,
    /// `--masquerade-all` (`node_config_flags::MASQUERADE_ALL`).
    pub masquerade_all: bool,
    /// `--lb-mode`.
    pub lb_mode: LbMode,
    /// `--socket-lb-pods`.
    pub socket_lb: SocketLb,
    /// Off-cluster clients of a ClusterIP are SNATed, per family (IPv4,
    /// IPv6): where a local traffic detector of the family is configured
    /// (`node_config_flags::MASQUERADE_OFF_CLUSTER`).
    pub masquerade_off_cluster: (bool, bool),
    /// `LOCAL_IFACES`.
    pub local_ifaces: BTreeSet<u32>,
    /// `POD_IFACES`: kept empty unless `host_routing` is `Bpf`.
    pub pod_ifaces: BTreeSet<u32>,
    /// `SHAPED_IFACES`: kept empty unless `host_routing` is `Bpf`.
    pub shaped_ifaces: BTreeSet<u32>,
    /// `--host-routing`.
    pub host_routing: HostRouting,
    /// `NodeConfig::ct_source_share` (`--conntrack-max-per-source`).
    pub ct_source_share: u32,
    /// `SERVICE_CIDRS`: the service CIDRs (`service_cidr::RANGE`) and the
    /// ClusterIPs (`service_cidr::HELD`), from `service_ranges` and
    /// `cluster_ips`.
    pub service_cidrs: BTreeMap<ClusterCidrEntry, u32>,
    service_ranges: BTreeSet<ClusterCidrEntry>,
    cluster_ips: BTreeMap<ClusterCidrEntry, u32>,
}

impl DesiredNode {
    pub fn new(ct_timeouts: CtTimeouts, cluster_cidrs: &[Cidr]) -> Self {
        Self {
            addrs: None,
            config: None,
            config6: None,
            ct_timeouts,
            cluster_cidrs: cluster_cidrs.iter().map(cluster_cidr).collect(),
            netfilter_flows: false,
            masquerade_all: false,
            lb_mode: LbMode::Snat,
            socket_lb: SocketLb::Node,
            masquerade_off_cluster: (false, false),
            local_ifaces: BTreeSet::new(),
            pod_ifaces: BTreeSet::new(),
            shaped_ifaces: BTreeSet::new(),
            host_routing: HostRouting::Stack,
            ct_source_share: 0,
            service_cidrs: BTreeMap::new(),
            service_ranges: BTreeSet::new(),
            cluster_ips: BTreeMap::new(),
        }
    }

    /// The service CIDRs: an address in one that no Service holds is
    /// dropped.
    pub fn set_service_ranges(&mut self, cidrs: &[Cidr]) {
        self.service_ranges = cidrs.iter().map(cluster_cidr).collect();
        self.merge_service_cidrs();
    }

    /// Every Service's ClusterIPs, each with whether a Service of this
    /// proxy holds it: a port of one its Service does not define is then
    /// rejected; another proxy's ClusterIP is passed, for that proxy.
    pub fn set_cluster_ips(&mut self, ips: impl IntoIterator<Item = (IpAddr, bool)>) {
        self.cluster_ips = ips
            .into_iter()
            .map(|(ip, ours)| {
                let kind = if ours {
                    service_cidr::HELD
                } else {
                    service_cidr::FOREIGN
                };
                (cluster_cidr(&Cidr::host(ip)), kind)
            })
            .collect();
        self.merge_service_cidrs();
    }

    fn merge_service_cidrs(&mut self) {
        let ranges = self
            .service_ranges
            .iter()
            .map(|e| (*e, service_cidr::RANGE));
        // A ClusterIP that is also a range of its own (a /32 service CIDR)
        // is held: it comes last and wins.
        let held = self.cluster_ips.iter().map(|(e, kind)| (*e, *kind));
        self.service_cidrs = ranges.chain(held).collect();
    }

    /// SNATs off-cluster clients of a ClusterIP, per family (IPv4, IPv6);
    /// written with the node's configuration, at once where that is known.
    pub fn set_masquerade_off_cluster(&mut self, v4: bool, v6: bool) {
        self.masquerade_off_cluster = (v4, v6);
        if let Some(config) = &mut self.config {
            set_flag(config, node_config_flags::MASQUERADE_OFF_CLUSTER, v4);
        }
        if let Some(config) = &mut self.config6 {
            set_flag(config, node_config_flags::MASQUERADE_OFF_CLUSTER, v6);
        }
    }

    /// The interfaces whose packets come from this node's pods.
    pub fn set_local_ifaces(&mut self, ifindexes: BTreeSet<u32>) {
        self.local_ifaces = ifindexes;
    }

    /// The host-side interfaces of this node's pods, those of them that
    /// carry a qdisc in `shaped` (`SHAPED_IFACES`) and the others in
    /// `POD_IFACES`, held only where packets are sent into pods straight
    /// (`HostRouting::Bpf`): with the stack routing, both maps stay empty.
    pub fn set_pod_ifaces(&mut self, pods: BTreeSet<u32>, shaped: &BTreeSet<u32>) {
        (self.pod_ifaces, self.shaped_ifaces) = match self.host_routing {
            HostRouting::Bpf => pods.into_iter().partition(|i| !shaped.contains(i)),
            HostRouting::Stack => (BTreeSet::new(), BTreeSet::new()),
        };
    }

    /// The interfaces map `set` should hold.
    pub fn ifaces(&self, set: IfaceSet) -> &BTreeSet<u32> {
        match set {
            IfaceSet::Local => &self.local_ifaces,
            IfaceSet::Pod => &self.pod_ifaces,
            IfaceSet::Shaped => &self.shaped_ifaces,
        }
    }

    /// The most assured flows one client address may hold
    /// (`--conntrack-max-per-source`; 0: no share).
    pub fn with_ct_source_share(mut self, share: u32) -> Self {
        self.ct_source_share = share;
        self
    }

    /// SNATs every new flow to a Service to the node (`--masquerade-all`).
    pub fn with_masquerade_all(mut self, on: bool) -> Self {
        self.masquerade_all = on;
        self
    }

    /// How external flows to backends on other nodes go (`--lb-mode`).
    pub fn with_lb_mode(mut self, mode: LbMode) -> Self {
        self.lb_mode = mode;
        self
    }

    /// How translated packets reach this node's pods (`--host-routing`).
    pub fn with_host_routing(mut self, host_routing: HostRouting) -> Self {
        self.host_routing = host_routing;
        self
    }

    /// Whose connections go to a backend at `connect()`
    /// (`--socket-lb-pods`).
    pub fn with_socket_lb(mut self, socket_lb: SocketLb) -> Self {
        self.socket_lb = socket_lb;
        self
    }

    /// The pod CIDRs whose clients are in-cluster (`CLUSTER_CIDRS`), where
    /// they follow the Node (`--detect-local-mode NodeCIDR`).
    pub fn set_cluster_cidrs(&mut self, cidrs: &[Cidr]) {
        self.cluster_cidrs = cidrs.iter().map(cluster_cidr).collect();
    }

    /// Tells tc (or stops telling it) to leave to netfilter the packets of
    /// flows netfilter's conntrack translates; written with the node's
    /// configuration, at once where that is known.
    pub fn set_netfilter_flows(&mut self, on: bool) {
        self.netfilter_flows = on;
        if let Some(config) = &mut self.config {
            set_flag(config, node_config_flags::NETFILTER_FLOWS, on);
        }
    }

    /// The node's addresses of both families as the interfaces show them
    /// now, those `nodeport_addresses` lets serve NodePorts (see
    /// `node_addrs`) serving them; SNAT to `snat`; the node's IPv6 address
    /// `node6`.
    pub fn set_interfaces(
        &mut self,
        addrs: &[IpAddr],
        nodeport_addresses: &[Cidr],
        snat: Option<Ipv4Addr>,
        node6: Option<Ipv6Addr>,
        localhost_nodeports: bool,
    ) {
        self.addrs = Some(node_addrs(addrs, nodeport_addresses));
        let mut config = node_config(snat, localhost_nodeports);
        config.ct_source_share = self.ct_source_share;
        set_flag(
            &mut config,
            node_config_flags::NETFILTER_FLOWS,
            self.netfilter_flows,
        );
        set_flag(
            &mut config,
            node_config_flags::MASQUERADE_ALL,
            self.masquerade_all,
        );
        set_flag(
            &mut config,
            node_config_flags::MASQUERADE_OFF_CLUSTER,
            self.masquerade_off_cluster.0,
        );
        config.flags |= self.lb_mode.flags();
        set_flag(
            &mut config,
            node_config_flags::SOCKET_LB_PODS,
            self.socket_lb == SocketLb::NodeAndPods,
        );
        set_flag(
            &mut config,
            node_config_flags::HOST_ROUTING_BPF,
            self.host_routing == HostRouting::Bpf,
        );
        self.config = Some(config);
        let mut config6 = node_config6(node6);
        set_flag(
            &mut config6,
            node_config_flags::MASQUERADE_OFF_CLUSTER,
            self.masquerade_off_cluster.1,
        );
        self.config6 = Some(config6);
    }
}

/// Keeps the node-level maps at the desired state.
#[derive(Debug, Default)]
pub struct NodePlanner {
    applied: NodeState,
}

/// What a sync did, and the write that stopped it.
#[derive(Debug)]
pub struct NodeOutcome<E> {
    pub ops: usize,
    pub failed: Option<(MapOp, E)>,
}

impl NodePlanner {
    /// Starts from what the pinned maps hold.
    pub fn adopt(stored: NodeState) -> Self {
        Self { applied: stored }
    }

    pub fn applied(&self) -> &NodeState {
        &self.applied
    }

    /// The writes that bring the maps to `desired`: puts first, deletes last.
    pub fn plan(&self, desired: &DesiredNode) -> Vec<MapOp> {
        let applied = &self.applied;
        let mut puts = Vec::new();
        let mut deletes = Vec::new();
        if applied.ct_timeouts != desired.ct_timeouts {
            puts.push(MapOp::SetCtTimeouts {
                timeouts: desired.ct_timeouts,
            });
        }
        puts.extend(
            desired
                .cluster_cidrs
                .difference(&applied.cluster_cidrs)
                .map(|entry| MapOp::PutClusterCidr { entry: *entry }),
        );
        deletes.extend(
            applied
                .cluster_cidrs
                .difference(&desired.cluster_cidrs)
                .map(|entry| MapOp::DeleteClusterCidr { entry: *entry }),
        );
        puts.extend(
            desired
                .service_cidrs
                .iter()
                .filter(|(entry, kind)| applied.service_cidrs.get(entry) != Some(kind))
                .map(|(entry, kind)| MapOp::PutServiceCidr {
                    entry: *entry,
                    kind: *kind,
                }),
        );
        deletes.extend(
            applied
                .service_cidrs
                .keys()
                .filter(|entry| !desired.service_cidrs.contains_key(entry))
                .map(|entry| MapOp::DeleteServiceCidr { entry: *entry }),
        );
        for set in IfaceSet::ALL {
            let (want, have) = (desired.ifaces(set), applied.ifaces(set));
            puts.extend(
                want.difference(have)
                    .map(|&ifindex| MapOp::PutIface { set, ifindex }),
            );
            deletes.extend(
                have.difference(want)
                    .map(|&ifindex| MapOp::DeleteIface { set, ifindex }),
            );
        }
        if let Some(addrs) = &desired.addrs {
            puts.extend(
                addrs
                    .iter()
                    .filter(|(key, value)| applied.addrs.get(key) != Some(value))
                    .map(|(key, value)| MapOp::PutNodeAddr {
                        key: *key,
                        value: *value,
                    }),
            );
            deletes.extend(
                applied
                    .addrs
                    .keys()
                    .filter(|key| !addrs.contains_key(key))
                    .map(|key| MapOp::DeleteNodeAddr { key: *key }),
            );
        }
        if let Some(config) = desired.config
            && config != applied.config
        {
            puts.push(MapOp::SetNodeConfig { config });
        }
        if let Some(config) = desired.config6
            && config != applied.config6
        {
            puts.push(MapOp::SetNodeConfig6 { config });
        }
        puts.extend(deletes);
        puts
    }

    /// Whether the maps hold `desired`.
    pub fn in_sync(&self, desired: &DesiredNode) -> bool {
        self.plan(desired).is_empty()
    }

    /// Applies the plan in order, up to the first write that fails.
    pub fn sync<S: MapStore>(
        &mut self,
        desired: &DesiredNode,
        store: &mut S,
    ) -> NodeOutcome<S::Error> {
        let mut ops = 0;
        for op in self.plan(desired) {
            if let Err(e) = store.apply(&op) {
                return NodeOutcome {
                    ops,
                    failed: Some((op, e)),
                };
            }
            self.record(&op);
            ops += 1;
        }
        NodeOutcome { ops, failed: None }
    }

    fn record(&mut self, op: &MapOp) {
        let applied = &mut self.applied;
        match op {
            MapOp::SetCtTimeouts { timeouts } => applied.ct_timeouts = *timeouts,
            MapOp::PutClusterCidr { entry } => {
                applied.cluster_cidrs.insert(*entry);
            }
            MapOp::DeleteClusterCidr { entry } => {
                applied.cluster_cidrs.remove(entry);
            }
            MapOp::PutServiceCidr { entry, kind } => {
                applied.service_cidrs.insert(*entry, *kind);
            }
            MapOp::DeleteServiceCidr { entry } => {
                applied.service_cidrs.remove(entry);
            }
            MapOp::PutIface { set, ifindex } => {
                applied.ifaces_mut(*set).insert(*ifindex);
            }
            MapOp::DeleteIface { set, ifindex } => {
                applied.ifaces_mut(*set).remove(ifindex);
            }
            MapOp::PutNodeAddr { key, value } => {
                applied.addrs.insert(*key, *value);
            }
            MapOp::DeleteNodeAddr { key } => {
                applied.addrs.remove(key);
            }
            MapOp::SetNodeConfig { config } => applied.config = *config,
            MapOp::SetNodeConfig6 { config } => applied.config6 = *config,
            _ => {}
        }
    }
}

/// `NODE_ADDRS` for these addresses: each is a node address; one serves
/// NodePorts when it is inside one of the `nodeport_addresses` of its
/// family, or that list has none of its family, as kube-proxy's proxier of
/// each family keeps only the CIDRs of its own family and serves every
/// address of the family without one.
pub fn node_addrs<A: Copy + Into<IpAddr>>(
    addrs: &[A],
    nodeport_addresses: &[Cidr],
) -> BTreeMap<NodeAddrKey, NodeAddr> {
    addrs
        .iter()
        .map(|ip| {
            let ip: IpAddr = (*ip).into();
            let mut of_family = nodeport_addresses
                .iter()
                .filter(|c| c.ip.is_ipv4() == ip.is_ipv4())
                .peekable();
            let serves = of_family.peek().is_none() || of_family.any(|c| c.contains(ip));
            (
                NodeAddrKey {
                    addr_be: addr_words(ip),
                },
                NodeAddr {
                    flags: if serves { node_addr_flags::NODEPORT } else { 0 },
                },
            )
        })
        .collect()
}

/// `NODE_CONFIG`: SNAT to `snat` (none: external flows to remote backends
/// pass untranslated) from the default port range.
pub fn node_config(snat: Option<Ipv4Addr>, localhost_nodeports: bool) -> NodeConfig {
    NodeConfig {
        snat_addr_be: snat.map_or([0; 4], |ip| addr_words(IpAddr::V4(ip))),
        snat_port_min: proxy_common::SNAT_PORT_MIN,
        snat_port_max: proxy_common::SNAT_PORT_MAX,
        flags: if localhost_nodeports {
            node_config_flags::LOCALHOST_NODEPORTS
        } else {
            0
        },
        ct_source_share: 0,
    }
}

fn set_flag(config: &mut NodeConfig, flag: u32, on: bool) {
    if on {
        config.flags |= flag;
    } else {
        config.flags &= !flag;
    }
}

/// `NODE_CONFIG6`: the node's IPv6 address (zeros for none).
pub fn node_config6(node6: Option<Ipv6Addr>) -> NodeConfig {
    NodeConfig {
        snat_addr_be: node6.map_or([0; 4], |ip| addr_words(IpAddr::V6(ip))),
        ..NodeConfig::default()
    }
}

#[cfg(test)]
mod tests;
