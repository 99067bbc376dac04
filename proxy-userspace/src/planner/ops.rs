//! Map operations, and the one trait through which they reach a map.

use std::{fmt, sync::Arc, thread::JoinHandle};

use proxy_common::{
    Backend, BackendSlotKey, CtTimeouts, NodeAddr, NodeAddrKey, NodeConfig, ServiceKey,
    ServiceName, ServiceValue,
};

use super::encode::{
    ClusterCidrEntry, SourceRangeEntry, cluster_cidr_string, service_key_string,
    service_name_string, source_range_string, words_addr,
};

/// One write to the maps the agent programs: the service maps (planned by
/// `Planner`) and the node-level maps (by `NodePlanner`).
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
    /// `SERVICE_NAMES`: the Service port service id `id` stands for. Boxed:
    /// it is seven times the size of the other operations, of which a
    /// first sync holds millions.
    PutServiceName {
        id: u32,
        name: Box<ServiceName>,
    },
    DeleteServiceName {
        id: u32,
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
    /// `SERVICE_CIDRS`: a service CIDR (`service_cidr::RANGE`) or a
    /// ClusterIP in one (`service_cidr::HELD`, a /32 or /128 entry).
    PutServiceCidr {
        entry: ClusterCidrEntry,
        kind: u32,
    },
    DeleteServiceCidr {
        entry: ClusterCidrEntry,
    },
    /// `LOCAL_IFACES` or `POD_IFACES` (`set`) holds `ifindex`.
    PutIface {
        set: IfaceSet,
        ifindex: u32,
    },
    DeleteIface {
        set: IfaceSet,
        ifindex: u32,
    },
}

/// The maps that are sets of this node's interfaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IfaceSet {
    /// `LOCAL_IFACES`: packets arriving on it come from this node's pods
    /// (an interface local traffic detector).
    Local,
    /// `POD_IFACES`: a pod's host-side interface, where a translated packet
    /// may go straight into the pod (`--host-routing bpf`).
    Pod,
    /// `SHAPED_IFACES`: a pod's host-side interface that carries a qdisc,
    /// whose packets keep the stack's path both ways.
    Shaped,
}

impl IfaceSet {
    pub const ALL: [IfaceSet; 3] = [IfaceSet::Local, IfaceSet::Pod, IfaceSet::Shaped];

    /// The map's name.
    pub fn map_name(self) -> &'static str {
        match self {
            IfaceSet::Local => proxy_common::map_names::LOCAL_IFACES,
            IfaceSet::Pod => proxy_common::map_names::POD_IFACES,
            IfaceSet::Shaped => proxy_common::map_names::SHAPED_IFACES,
        }
    }

    fn noun(self) -> &'static str {
        match self {
            IfaceSet::Local => "local",
            IfaceSet::Pod => "pod",
            IfaceSet::Shaped => "shaped",
        }
    }
}

impl MapOp {
    pub fn is_delete(&self) -> bool {
        matches!(
            self,
            MapOp::DeleteService { .. }
                | MapOp::DeleteSlot { .. }
                | MapOp::DeleteBackend { .. }
                | MapOp::DeleteSourceRange { .. }
                | MapOp::DeleteServiceName { .. }
                | MapOp::DeleteNodeAddr { .. }
                | MapOp::DeleteClusterCidr { .. }
                | MapOp::DeleteServiceCidr { .. }
                | MapOp::DeleteIface { .. }
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
            MapOp::PutServiceName { id, name } => {
                write!(f, "write service name {id} ({})", service_name_string(name))
            }
            MapOp::DeleteServiceName { id } => write!(f, "delete service name {id}"),
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
            MapOp::PutServiceCidr { entry, kind } => write!(
                f,
                "write {} {}",
                service_cidr_kind(*kind),
                cluster_cidr_string(entry)
            ),
            MapOp::DeleteServiceCidr { entry } => write!(
                f,
                "delete service CIDR entry {}",
                cluster_cidr_string(entry)
            ),
            MapOp::PutIface { set, ifindex } => {
                write!(f, "write {} interface {ifindex}", set.noun())
            }
            MapOp::DeleteIface { set, ifindex } => {
                write!(f, "delete {} interface {ifindex}", set.noun())
            }
        }
    }
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
/// ranges, service names, backends, slots, service entries (see
/// `planner::Batch`).
pub type Phases = [Vec<MapOp>; 5];

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

/// What a `SERVICE_CIDRS` value stands for, in words.
fn service_cidr_kind(kind: u32) -> &'static str {
    match kind {
        proxy_common::service_cidr::HELD => "ClusterIP",
        _ => "service CIDR",
    }
}
