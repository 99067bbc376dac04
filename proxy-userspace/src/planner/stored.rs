//! What the maps hold, as the planners see it: read back from the kernel
//! when the agent adopts pinned maps, or kept in memory as the test double
//! every plan is checked against. Both planners start from it, so it sits
//! below them.

use std::{
    collections::{BTreeMap, BTreeSet},
    convert::Infallible,
};

use proxy_common::{
    Backend, BackendSlotKey, CtTimeouts, NodeAddr, NodeAddrKey, NodeConfig, ServiceKey,
    ServiceName, ServiceValue,
};

use super::{
    encode::{ClusterCidrEntry, SourceRangeEntry, service_key_string},
    ops::{IfaceSet, MapOp, MapStore},
};

/// What the node-level maps hold, or should.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeState {
    pub addrs: BTreeMap<NodeAddrKey, NodeAddr>,
    pub config: NodeConfig,
    /// The node's IPv6 address (`NODE_CONFIG6`); zeros while it has none.
    pub config6: NodeConfig,
    /// Zeros until first written (the datapath then uses the defaults).
    pub ct_timeouts: CtTimeouts,
    pub cluster_cidrs: BTreeSet<ClusterCidrEntry>,
    /// `SERVICE_CIDRS`: each entry and what it is (`service_cidr`).
    pub service_cidrs: BTreeMap<ClusterCidrEntry, u32>,
    /// `LOCAL_IFACES`: ifindexes.
    pub local_ifaces: BTreeSet<u32>,
    /// `POD_IFACES`: ifindexes.
    pub pod_ifaces: BTreeSet<u32>,
    /// `SHAPED_IFACES`: ifindexes.
    pub shaped_ifaces: BTreeSet<u32>,
}

impl NodeState {
    /// The interfaces map `set` holds.
    pub fn ifaces(&self, set: IfaceSet) -> &BTreeSet<u32> {
        match set {
            IfaceSet::Local => &self.local_ifaces,
            IfaceSet::Pod => &self.pod_ifaces,
            IfaceSet::Shaped => &self.shaped_ifaces,
        }
    }

    pub fn ifaces_mut(&mut self, set: IfaceSet) -> &mut BTreeSet<u32> {
        match set {
            IfaceSet::Local => &mut self.local_ifaces,
            IfaceSet::Pod => &mut self.pod_ifaces,
            IfaceSet::Shaped => &mut self.shaped_ifaces,
        }
    }
}

/// The content of the service maps, as read back from the kernel (for
/// adoption) or kept in memory (as a test double with the same semantics).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredState {
    pub services: BTreeMap<ServiceKey, ServiceValue>,
    pub slots: BTreeMap<BackendSlotKey, u32>,
    pub backends: BTreeMap<u32, Backend>,
    pub source_ranges: BTreeSet<SourceRangeEntry>,
    /// `SERVICE_NAMES`: service id to its Service port. Empty where the
    /// pins are an agent's that did not write them.
    pub names: BTreeMap<u32, ServiceName>,
    pub node: NodeState,
}

impl MapStore for StoredState {
    type Error = Infallible;

    fn apply(&mut self, op: &MapOp) -> Result<(), Infallible> {
        match op {
            MapOp::PutBackend { id, backend } => {
                self.backends.insert(*id, *backend);
            }
            MapOp::PutSlot { key, backend_id } => {
                self.slots.insert(*key, *backend_id);
            }
            MapOp::PutService { key, value } => {
                self.services.insert(*key, *value);
            }
            MapOp::DeleteService { key } => {
                self.services.remove(key);
            }
            MapOp::DeleteSlot { key } => {
                self.slots.remove(key);
            }
            MapOp::DeleteBackend { id } => {
                self.backends.remove(id);
            }
            MapOp::PutSourceRange { entry } => {
                self.source_ranges.insert(*entry);
            }
            MapOp::DeleteSourceRange { entry } => {
                self.source_ranges.remove(entry);
            }
            MapOp::PutServiceName { id, name } => {
                self.names.insert(*id, **name);
            }
            MapOp::DeleteServiceName { id } => {
                self.names.remove(id);
            }
            MapOp::PutNodeAddr { key, value } => {
                self.node.addrs.insert(*key, *value);
            }
            MapOp::DeleteNodeAddr { key } => {
                self.node.addrs.remove(key);
            }
            MapOp::SetNodeConfig { config } => self.node.config = *config,
            MapOp::SetNodeConfig6 { config } => self.node.config6 = *config,
            MapOp::SetCtTimeouts { timeouts } => self.node.ct_timeouts = *timeouts,
            MapOp::PutClusterCidr { entry } => {
                self.node.cluster_cidrs.insert(*entry);
            }
            MapOp::DeleteClusterCidr { entry } => {
                self.node.cluster_cidrs.remove(entry);
            }
            MapOp::PutServiceCidr { entry, kind } => {
                self.node.service_cidrs.insert(*entry, *kind);
            }
            MapOp::DeleteServiceCidr { entry } => {
                self.node.service_cidrs.remove(entry);
            }
            MapOp::PutIface { set, ifindex } => {
                self.node.ifaces_mut(*set).insert(*ifindex);
            }
            MapOp::DeleteIface { set, ifindex } => {
                self.node.ifaces_mut(*set).remove(ifindex);
            }
        }
        Ok(())
    }
}

impl StoredState {
    /// After `op`: a service entry it wrote has the name of its service id
    /// in place already, and a name it deleted is of an id no service entry
    /// holds, so that a reader of the maps can always name a frontend.
    pub fn check_named(&self, op: &MapOp) -> Result<(), String> {
        match op {
            MapOp::PutService { key, value } if !self.names.contains_key(&value.service_id) => {
                Err(format!(
                    "service {} was written before the name of its service id {}",
                    service_key_string(key),
                    value.service_id
                ))
            }
            MapOp::DeleteServiceName { id } => match self
                .services
                .iter()
                .find(|(_, value)| value.service_id == *id)
            {
                Some((key, _)) => Err(format!(
                    "the name of service id {id} was deleted while service {} holds it",
                    service_key_string(key)
                )),
                None => Ok(()),
            },
            _ => Ok(()),
        }
    }

    /// What a packet would see: every frontend's slots `0..count` exist and
    /// name an existing backend. Holds after every single operation of a
    /// plan, not just at its end.
    pub fn check_consistent(&self) -> Result<(), String> {
        for (key, value) in &self.services {
            for slot in 0..value.count {
                let slot_key = BackendSlotKey {
                    slot_set: value.slot_set,
                    slot,
                };
                let Some(id) = self.slots.get(&slot_key) else {
                    return Err(format!(
                        "service {} (slot set {}, count {}) has no slot {slot}",
                        service_key_string(key),
                        value.slot_set,
                        value.count
                    ));
                };
                if !self.backends.contains_key(id) {
                    return Err(format!(
                        "service {} slot {slot} names backend {id}, which does not exist",
                        service_key_string(key)
                    ));
                }
            }
            // A firewalled frontend without its ranges would drop everyone.
            if value.flags & proxy_common::service_flags::SOURCE_RANGES != 0
                && !self.source_ranges.iter().any(|(_, k)| k.frontend == *key)
            {
                return Err(format!(
                    "service {} is firewalled but has no source range",
                    service_key_string(key)
                ));
            }
        }
        Ok(())
    }
}
