//! Map operations, and the one trait through which they reach a map.

use std::{
    collections::{BTreeMap, BTreeSet},
    convert::Infallible,
    fmt,
    sync::Arc,
    thread::JoinHandle,
};

use proxy_common::{
    Backend, BackendSlotKey, CtTimeouts, NodeAddr, NodeAddrKey, NodeConfig, ServiceKey,
    ServiceValue, SourceRangeKey,
};

use super::{
    encode::{service_key_string, source_range_string, words_addr},
    node::{ClusterCidrEntry, NodeState},
};

/// One entry of the `SOURCE_RANGES` trie: (prefix length, key).
pub type SourceRangeEntry = (u32, SourceRangeKey);

/// One write to the maps the agent programs: the service maps (planned by
/// [`super::Planner`]) and the node-level maps (by [`super::node::NodePlanner`]).
/// Plans are ordered lists of these; every write the agent makes is one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MapOp {
    PutBackend {
        id: u32,
        backend: Backend,
    },
    PutSlot {
        key: BackendSlotKey,
        backend_id: u32,
    },
    PutService {
        key: ServiceKey,
        value: ServiceValue,
    },
    DeleteService {
        key: ServiceKey,
    },
    DeleteSlot {
        key: BackendSlotKey,
    },
    DeleteBackend {
        id: u32,
    },
    PutSourceRange {
        entry: SourceRangeEntry,
    },
    DeleteSourceRange {
        entry: SourceRangeEntry,
    },
    PutNodeAddr {
        key: NodeAddrKey,
        value: NodeAddr,
    },
    DeleteNodeAddr {
        key: NodeAddrKey,
    },
    SetNodeConfig {
        config: NodeConfig,
    },
    /// `NODE_CONFIG6`: the node's IPv6 address.
    SetNodeConfig6 {
        config: NodeConfig,
    },
    /// Also voids the flow cache's copies, which were taken under the old
    /// timeouts.
    SetCtTimeouts {
        timeouts: CtTimeouts,
    },
    PutClusterCidr {
        entry: ClusterCidrEntry,
    },
    DeleteClusterCidr {
        entry: ClusterCidrEntry,
    },
    /// `LOCAL_IFACES`: packets arriving on `ifindex` come from this node's
    /// pods.
    PutLocalIface {
        ifindex: u32,
    },
    DeleteLocalIface {
        ifindex: u32,
    },
}

impl MapOp {
    pub fn is_delete(&self) -> bool {
        matches!(
            self,
            MapOp::DeleteService { .. }
                | MapOp::DeleteSlot { .. }
                | MapOp::DeleteBackend { .. }
                | MapOp::DeleteSourceRange { .. }
                | MapOp::DeleteNodeAddr { .. }
                | MapOp::DeleteClusterCidr { .. }
                | MapOp::DeleteLocalIface { .. }
        )
    }
}

impl fmt::Display for MapOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MapOp::PutBackend { id, .. } => write!(f, "write backend {id}"),
            MapOp::PutSlot { key, backend_id } => write!(
                f,
                "write slot {}/{} -> backend {backend_id}",
                key.slot_set, key.slot
            ),
            MapOp::PutService { key, .. } => write!(f, "write service {}", service_key_string(key)),
            MapOp::DeleteService { key } => {
                write!(f, "delete service {}", service_key_string(key))
            }
            MapOp::DeleteSlot { key } => write!(f, "delete slot {}/{}", key.slot_set, key.slot),
            MapOp::DeleteBackend { id } => write!(f, "delete backend {id}"),
            MapOp::PutSourceRange { entry } => {
                write!(f, "write source range {}", source_range_string(entry))
            }
            MapOp::DeleteSourceRange { entry } => {
                write!(f, "delete source range {}", source_range_string(entry))
            }
            MapOp::PutNodeAddr { key, value } => write!(
                f,
                "write node address {} (flags {:#x})",
                words_addr(&key.addr_be),
                value.flags
            ),
            MapOp::DeleteNodeAddr { key } => {
                write!(f, "delete node address {}", words_addr(&key.addr_be))
            }
            MapOp::SetNodeConfig { config } => write!(
                f,
                "write node config (SNAT {} ports {}-{}, flags {:#x})",
                words_addr(&config.snat_addr_be),
                config.snat_port_min,
                config.snat_port_max,
                config.flags
            ),
            MapOp::SetNodeConfig6 { config } => write!(
                f,
                "write IPv6 node config (node address {})",
                words_addr(&config.snat_addr_be)
            ),
            MapOp::SetCtTimeouts { .. } => write!(f, "write conntrack timeouts"),
            MapOp::PutClusterCidr { entry } => {
                write!(f, "write cluster CIDR {}", cluster_cidr_string(entry))
            }
            MapOp::DeleteClusterCidr { entry } => {
                write!(f, "delete cluster CIDR {}", cluster_cidr_string(entry))
            }
            MapOp::PutLocalIface { ifindex } => write!(f, "write local interface {ifindex}"),
            MapOp::DeleteLocalIface { ifindex } => {
                write!(f, "delete local interface {ifindex}")
            }
        }
    }
}

fn cluster_cidr_string((prefix_len, key): &ClusterCidrEntry) -> String {
    let ip = words_addr(&key.addr_be);
    let prefix = if ip.is_ipv4() {
        prefix_len.saturating_sub(96)
    } else {
        *prefix_len
    };
    format!("{ip}/{prefix}")
}

/// Something the planner's operations can be applied to: the real pinned
/// maps, or [`StoredState`] in tests.
pub trait MapStore {
    type Error: std::error::Error + Send + Sync + 'static;
    fn apply(&mut self, op: &MapOp) -> Result<(), Self::Error>;

    /// Applies `ops` in order, stopping at the first that fails: then says
    /// how many landed before it, and why it did not. A store may write a
    /// run of entries of one map in one call, as long as the order and
    /// that count hold.
    fn apply_all(&mut self, ops: &[MapOp]) -> Result<(), (usize, Self::Error)> {
        for (landed, op) in ops.iter().enumerate() {
            self.apply(op).map_err(|e| (landed, e))?;
        }
        Ok(())
    }

    /// Writes a batch's phases in order, each as [`Self::apply_all`],
    /// stopping at the first that fails. A store may write them on a thread
    /// of its own while the planner plans the next batch: the planner waits
    /// for the [`Landing`] before it writes anything else. This default
    /// writes them at once.
    fn start_batch(&mut self, phases: Arc<Phases>) -> Landing<Self::Error> {
        Landing::Done(apply_phases(self, &phases, 0))
    }
}

/// A batch's writes, one map at a time in the order they land: source
/// ranges, backends, slots, service entries (see [`super::Batch`]).
pub type Phases = [Vec<MapOp>; 4];

/// Where a batch's writes stopped: the phase, how many of its writes
/// landed before the one that failed, and why that one did not.
#[derive(Debug)]
pub struct PhaseFailure<E> {
    pub phase: usize,
    pub landed: usize,
    pub error: E,
}

/// A batch's writes on their way to the maps ([`MapStore::start_batch`]).
#[derive(Debug)]
pub enum Landing<E> {
    /// Written already.
    Done(Result<(), PhaseFailure<E>>),
    /// Being written on a thread of the store's.
    Writing(JoinHandle<Result<(), PhaseFailure<E>>>),
}

impl<E> Landing<E> {
    /// How the writes went, once they are over.
    pub fn wait(self) -> Result<(), PhaseFailure<E>> {
        match self {
            Landing::Done(result) => result,
            // A panic of the writer is a bug, as it would be on this thread.
            Landing::Writing(writer) => writer
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
        }
    }
}

/// Writes `phases` from phase `from` on into `store`, as
/// [`MapStore::start_batch`] says.
pub fn apply_phases<S: MapStore + ?Sized>(
    store: &mut S,
    phases: &Phases,
    from: usize,
) -> Result<(), PhaseFailure<S::Error>> {
    write_phases(phases, from, |ops| store.apply_all(ops))
}

/// Writes each phase of `phases` from `from` on with `write`, which says
/// how many of a phase's writes landed when one fails; stops there.
pub fn write_phases<E>(
    phases: &Phases,
    from: usize,
    mut write: impl FnMut(&[MapOp]) -> Result<(), (usize, E)>,
) -> Result<(), PhaseFailure<E>> {
    for (phase, ops) in phases.iter().enumerate().skip(from) {
        if ops.is_empty() {
            continue;
        }
        write(ops).map_err(|(landed, error)| PhaseFailure {
            phase,
            landed,
            error,
        })?;
    }
    Ok(())
}

/// The content of the service maps, as read back from the kernel (for
/// adoption) or kept in memory (as a test double with the same semantics).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoredState {
    pub services: BTreeMap<ServiceKey, ServiceValue>,
    pub slots: BTreeMap<BackendSlotKey, u32>,
    pub backends: BTreeMap<u32, Backend>,
    pub source_ranges: BTreeSet<SourceRangeEntry>,
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
            MapOp::PutLocalIface { ifindex } => {
                self.node.local_ifaces.insert(*ifindex);
            }
            MapOp::DeleteLocalIface { ifindex } => {
                self.node.local_ifaces.remove(ifindex);
            }
        }
        Ok(())
    }
}

impl StoredState {
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
