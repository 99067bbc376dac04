//! Typed handles on the pinned maps, and the only code that writes the
//! service and node-level maps (through the planners' [`MapStore`]).

use aya::{
    Pod,
    maps::{
        Array, HashMap, IterableMap, Map, MapData, MapError, PerCpuArray, SkStorage,
        lpm_trie::{Key, LpmTrie},
    },
};
use proxy_common::{
    AffinityKey, AffinityValue, Backend, BackendSlot, BackendSlotKey, Clock, ClusterCidrKey,
    Ct6Key, Ct6Value, CtKey, CtTimeouts, CtValue, FLOW_GEN_EPOCH, NodeAddr, NodeAddrKey,
    NodeConfig, RefusalKey, RefusalRecord, ServiceCounters, ServiceKey, ServiceName, ServiceValue,
    SockNotes, SockNotes6, SourceRangeKey, counter, ip_summed, map_names, sock_counter,
};

use std::{
    collections::BTreeSet,
    os::fd::{AsFd, BorrowedFd},
    sync::Arc,
};

use super::{
    pins::PinLayout,
    prefilter::{self, Prefilter, PrefilterError},
    prefilter_flows::FlowMarks,
    service_counters::{self, ServiceCountersError},
    write_behind::{self, RunError, RunWriter},
};
use crate::planner::{
    IfaceSet, Landing, MapOp, MapStore, NodeState, PhaseFailure, Phases, apply_phases,
};

/// Why a map could not be opened or written.
#[derive(Debug, thiserror::Error)]
pub enum MapsError {
    #[error("map {name} is missing from the eBPF object")]
    Missing { name: &'static str },
    #[error("map {name}: {source}")]
    Map {
        name: &'static str,
        #[source]
        source: MapError,
    },
    #[error("map {name}: {source}")]
    Batch {
        name: &'static str,
        #[source]
        source: super::batch::BatchError,
    },
    #[error("{op}: {source}")]
    Write {
        op: String,
        #[source]
        source: MapError,
    },
    #[error(transparent)]
    BatchWrite(#[from] RunError),
    #[error(transparent)]
    Prefilter(#[from] PrefilterError),
    #[error(transparent)]
    ServiceCounters(#[from] ServiceCountersError),
    #[error(transparent)]
    Reap(#[from] super::ct_reap::CtReapError),
}

pub(crate) fn wrap(name: &'static str) -> impl FnOnce(MapError) -> MapsError {
    move |source| MapsError::Map { name, source }
}

/// How many ops at the start of `ops` write the same map and can go in one
/// batch: backend writes, slot writes, or service writes.
fn batched_run(ops: &[MapOp]) -> usize {
    let same = |a: &MapOp, b: &MapOp| {
        matches!(
            (a, b),
            (MapOp::PutBackend { .. }, MapOp::PutBackend { .. })
                | (MapOp::PutSlot { .. }, MapOp::PutSlot { .. })
                | (MapOp::PutService { .. }, MapOp::PutService { .. })
        )
    };
    match ops.first() {
        Some(
            first @ (MapOp::PutBackend { .. } | MapOp::PutSlot { .. } | MapOp::PutService { .. }),
        ) => ops.iter().take_while(|op| same(first, op)).count(),
        _ => 0,
    }
}

impl Maps {
    /// The descriptors a batch's runs are written through.
    fn run_writer(&self) -> RunWriter<BorrowedFd<'_>> {
        use aya::maps::IterableMap;
        RunWriter {
            names: self.service_names.as_ref().map(|m| m.map().fd().as_fd()),
            counters: self.service_counters.as_ref().map(|m| m.map().fd().as_fd()),
            backends: self.backends.map().fd().as_fd(),
            slots: self.slots.map().fd().as_fd(),
            services: self.services.map().fd().as_fd(),
            prefilter: self.prefilter.clone(),
        }
    }
}

/// `wrap` for a batched read or delete of map `name`.
pub fn batch_error(name: &'static str) -> impl Fn(super::batch::BatchError) -> MapsError {
    move |source| MapsError::Batch { name, source }
}

/// A map of `map_names::LATER`: None where the pins lack it.
fn later<T>(
    map: Result<Map, MapsError>,
    name: &'static str,
    convert: impl FnOnce(Map) -> Result<T, MapError>,
) -> Result<Option<T>, MapsError> {
    match map {
        Ok(map) => convert(map).map(Some).map_err(wrap(name)),
        Err(MapsError::Missing { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `map`'s data, once checked to be socket-local storage of `V`.
fn socket_storage<V: Pod>(map: Map) -> Result<MapData, MapError> {
    SkStorage::<&MapData, V>::try_from(&map)?;
    match map {
        Map::SkStorage(data) => Ok(data),
        _ => unreachable!("SkStorage::try_from accepted a map of another type"),
    }
}

/// Whether `Maps` maps the prefilter's arrays into memory (`Prefilter`,
/// `FlowMarks`), or leaves them to a holder that does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Arrays {
    Mapped,
    Unmapped,
}

/// Every map of the datapath.
pub struct Maps {
    pub services: HashMap<MapData, ServiceKey, ServiceValue>,
    pub slots: HashMap<MapData, BackendSlotKey, BackendSlot>,
    pub backends: HashMap<MapData, u32, Backend>,
    /// Assured flows (see proxy-ebpf's `conntrack`).
    pub conntrack: HashMap<MapData, CtKey, CtValue>,
    /// Flows not assured yet.
    pub ct_new: HashMap<MapData, CtKey, CtValue>,
    /// Assured IPv6 flows (proxy-ebpf's `conntrack`, over IPv6); absent from pins of
    /// an agent older than it, like `csum_states`.
    pub conntrack6: Option<HashMap<MapData, Ct6Key, Ct6Value>>,
    /// IPv6 flows not assured yet; absent like `conntrack6`.
    pub ct_new6: Option<HashMap<MapData, Ct6Key, Ct6Value>>,
    /// Assured flows per IPv4 client address (proxy-ebpf's `CtSources`).
    pub ct_sources: HashMap<MapData, u32, u32>,
    /// Assured flows per IPv6 client address.
    pub ct_sources6: HashMap<MapData, [u32; 4], u32>,
    pub affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    pub counters: PerCpuArray<MapData, u64>,
    pub ct_timeouts: Array<MapData, CtTimeouts>,
    pub node_addrs: HashMap<MapData, NodeAddrKey, NodeAddr>,
    pub node_config: Array<MapData, NodeConfig>,
    pub source_ranges: LpmTrie<MapData, SourceRangeKey, u32>,
    pub cluster_cidrs: LpmTrie<MapData, ClusterCidrKey, u32>,
    pub clock: Array<MapData, Clock>,
    /// Invalidation counters of the datapath's flow cache
    /// (`proxy_common::FlowCacheEntry`).
    pub flow_gen: Array<MapData, u64>,
    /// Packets tc translated, by checksum state. Absent from the pins of an
    /// agent built before it existed, which `open_pinned` may be looking at.
    pub csum_states: Option<PerCpuArray<MapData, u64>>,
    /// The node's network namespace cookie, for the socket hook; absent
    /// like `csum_states`.
    pub host_netns: Option<Array<MapData, u64>>,
    /// The socket hook's counters (`proxy_common::sock_counter`); absent
    /// like `csum_states`.
    pub sock_counters: Option<PerCpuArray<MapData, u64>>,
    /// What the socket hooks noted in each socket of the node they sent to
    /// a backend (`proxy_common::SockNotes`), socket-local storage; absent
    /// like `csum_states`. Read back through an iterator (`sock_notes`),
    /// which needs only the map's descriptor.
    pub sock_notes: Option<MapData>,
    /// `sock_notes` of IPv6 backends (`proxy_common::SockNotes6`).
    pub sock_notes6: Option<MapData>,
    /// The node's IPv6 address (`NODE_CONFIG6`); absent like `csum_states`.
    pub node_config6: Option<Array<MapData, NodeConfig>>,
    /// Interfaces whose packets come from this node's pods
    /// (`LOCAL_IFACES`); absent like `csum_states`.
    pub local_ifaces: Option<HashMap<MapData, u32, u32>>,
    /// The host-side interfaces of this node's pods (`POD_IFACES`); absent
    /// like `csum_states`.
    pub pod_ifaces: Option<HashMap<MapData, u32, u32>>,
    /// Those of them that carry a qdisc (`SHAPED_IFACES`); absent like
    /// `csum_states`.
    pub shaped_ifaces: Option<HashMap<MapData, u32, u32>>,
    /// The prefilter's bits, mapped (`prefilter`), shared with the thread
    /// that writes batches behind the sync; absent like `csum_states`, and
    /// where opened unmapped (`open_pinned_unmapped`).
    pub prefilter: Option<Arc<Prefilter>>,
    /// The prefilter's marks of flows, mapped (`prefilter_flows`); absent
    /// as `prefilter` is.
    pub prefilter_flows: Option<FlowMarks>,
    /// The Service port of each service id (`SERVICE_NAMES`); absent like
    /// `csum_states`.
    pub service_names: Option<HashMap<MapData, u32, ServiceName>>,
    /// The service CIDRs and the ClusterIPs in them (`SERVICE_CIDRS`);
    /// absent like `csum_states`.
    pub service_cidrs: Option<LpmTrie<MapData, ClusterCidrKey, u32>>,
    /// What the agent refused of each Service (`SERVICE_REFUSALS`); absent
    /// like `csum_states`, and taken by the sync loop, which writes it.
    pub service_refusals: Option<HashMap<MapData, RefusalKey, RefusalRecord>>,
    /// Each Service port's counters (`SERVICE_COUNTERS`): the loaded
    /// object's, or where the maps were opened from pins, the last agent's
    /// (None where it pinned none).
    pub service_counters: Option<PerCpuArray<MapData, ServiceCounters>>,
}

impl Maps {
    /// Takes the maps out of a loaded object.
    pub fn take(ebpf: &mut aya::Ebpf) -> Result<Self, MapsError> {
        let take = |name: &'static str| -> Result<Map, MapsError> {
            ebpf.take_map(name).ok_or(MapsError::Missing { name })
        };
        Self::from_maps(take, Arrays::Mapped)
    }

    /// Opens the pinned maps of a running (or exited) agent, without loading
    /// anything: for inspection and tests.
    pub fn open_pinned(pins: &PinLayout) -> Result<Self, MapsError> {
        Self::open_pinned_with(pins, Arrays::Mapped)
    }

    /// `open_pinned`, the prefilter's arrays left unmapped (`prefilter` and
    /// `prefilter_flows` None): for a reader that never asks them, such as
    /// the metrics' collector, beside the sync loop's own maps. Each mapping
    /// of the two arrays counts their 5 MiB in the agent's resident memory
    /// again (the kernel maps every page of an array at once).
    pub fn open_pinned_unmapped(pins: &PinLayout) -> Result<Self, MapsError> {
        Self::open_pinned_with(pins, Arrays::Unmapped)
    }

    fn open_pinned_with(pins: &PinLayout, arrays: Arrays) -> Result<Self, MapsError> {
        let open = |name: &'static str| -> Result<Map, MapsError> {
            let path = pins.map(name);
            if map_names::LATER.contains(&name) && !path.exists() {
                return Err(MapsError::Missing { name });
            }
            let data = MapData::from_pin(path).map_err(wrap(name))?;
            Map::from_map_data(data).map_err(wrap(name))
        };
        Self::from_maps(open, arrays)
    }

    fn from_maps(
        mut get: impl FnMut(&'static str) -> Result<Map, MapsError>,
        arrays: Arrays,
    ) -> Result<Self, MapsError> {
        use map_names::{
            AFFINITY, BACKEND_SLOTS, BACKENDS, CLOCK, CLUSTER_CIDRS, CONNTRACK, CONNTRACK6,
            COUNTERS, CSUM_STATES, CT_NEW, CT_NEW6, CT_SOURCES, CT_SOURCES6, CT_TIMEOUTS, FLOW_GEN,
            HOST_NETNS, LOCAL_IFACES, NODE_ADDRS, NODE_CONFIG, NODE_CONFIG6, POD_IFACES, PREFILTER,
            PREFILTER_FLOWS, SERVICE_CIDRS, SERVICE_COUNTERS, SERVICE_NAMES, SERVICE_REFUSALS,
            SERVICES, SHAPED_IFACES, SOCK_COUNTERS, SOCK_NOTES, SOCK_NOTES6, SOURCE_RANGES,
        };
        Ok(Self {
            services: HashMap::try_from(get(SERVICES)?).map_err(wrap(SERVICES))?,
            slots: HashMap::try_from(get(BACKEND_SLOTS)?).map_err(wrap(BACKEND_SLOTS))?,
            backends: HashMap::try_from(get(BACKENDS)?).map_err(wrap(BACKENDS))?,
            conntrack: HashMap::try_from(get(CONNTRACK)?).map_err(wrap(CONNTRACK))?,
            ct_new: HashMap::try_from(get(CT_NEW)?).map_err(wrap(CT_NEW))?,
            conntrack6: later(get(CONNTRACK6), CONNTRACK6, HashMap::try_from)?,
            ct_new6: later(get(CT_NEW6), CT_NEW6, HashMap::try_from)?,
            ct_sources: HashMap::try_from(get(CT_SOURCES)?).map_err(wrap(CT_SOURCES))?,
            ct_sources6: HashMap::try_from(get(CT_SOURCES6)?).map_err(wrap(CT_SOURCES6))?,
            affinity: HashMap::try_from(get(AFFINITY)?).map_err(wrap(AFFINITY))?,
            counters: PerCpuArray::try_from(get(COUNTERS)?).map_err(wrap(COUNTERS))?,
            ct_timeouts: Array::try_from(get(CT_TIMEOUTS)?).map_err(wrap(CT_TIMEOUTS))?,
            node_addrs: HashMap::try_from(get(NODE_ADDRS)?).map_err(wrap(NODE_ADDRS))?,
            node_config: Array::try_from(get(NODE_CONFIG)?).map_err(wrap(NODE_CONFIG))?,
            source_ranges: LpmTrie::try_from(get(SOURCE_RANGES)?).map_err(wrap(SOURCE_RANGES))?,
            cluster_cidrs: LpmTrie::try_from(get(CLUSTER_CIDRS)?).map_err(wrap(CLUSTER_CIDRS))?,
            clock: Array::try_from(get(CLOCK)?).map_err(wrap(CLOCK))?,
            flow_gen: Array::try_from(get(FLOW_GEN)?).map_err(wrap(FLOW_GEN))?,
            csum_states: later(get(CSUM_STATES), CSUM_STATES, PerCpuArray::try_from)?,
            host_netns: later(get(HOST_NETNS), HOST_NETNS, Array::try_from)?,
            sock_counters: later(get(SOCK_COUNTERS), SOCK_COUNTERS, PerCpuArray::try_from)?,
            sock_notes: later(get(SOCK_NOTES), SOCK_NOTES, socket_storage::<SockNotes>)?,
            sock_notes6: later(get(SOCK_NOTES6), SOCK_NOTES6, socket_storage::<SockNotes6>)?,
            node_config6: later(get(NODE_CONFIG6), NODE_CONFIG6, Array::try_from)?,
            local_ifaces: later(get(LOCAL_IFACES), LOCAL_IFACES, HashMap::try_from)?,
            pod_ifaces: later(get(POD_IFACES), POD_IFACES, HashMap::try_from)?,
            shaped_ifaces: later(get(SHAPED_IFACES), SHAPED_IFACES, HashMap::try_from)?,
            prefilter: match arrays {
                Arrays::Mapped => {
                    later(get(PREFILTER), PREFILTER, Array::<MapData, u64>::try_from)?
                        .map(|array| Prefilter::map(array).map(Arc::new))
                        .transpose()?
                }
                Arrays::Unmapped => None,
            },
            prefilter_flows: match arrays {
                Arrays::Mapped => later(
                    get(PREFILTER_FLOWS),
                    PREFILTER_FLOWS,
                    Array::<MapData, u64>::try_from,
                )?
                .map(FlowMarks::map)
                .transpose()?,
                Arrays::Unmapped => None,
            },
            service_names: later(get(SERVICE_NAMES), SERVICE_NAMES, HashMap::try_from)?,
            service_cidrs: later(get(SERVICE_CIDRS), SERVICE_CIDRS, LpmTrie::try_from)?,
            service_refusals: later(get(SERVICE_REFUSALS), SERVICE_REFUSALS, HashMap::try_from)?,
            service_counters: later(
                get(SERVICE_COUNTERS),
                SERVICE_COUNTERS,
                PerCpuArray::try_from,
            )?,
        })
    }

    /// Opens the prefilter's flow marks (`FlowMarks::open`) where the maps
    /// have them: wherever conntrack may hold flows the datapath did not
    /// mark. The housekeeping's refreshes clear what no flow needs.
    pub fn open_flow_marks(&self) {
        if let Some(marks) = &self.prefilter_flows {
            marks.open();
        }
    }

    /// Tells the socket hook which network namespace is the node's.
    /// The interfaces map `set`, where these pins have it.
    fn ifaces(&self, set: IfaceSet) -> Option<&HashMap<MapData, u32, u32>> {
        match set {
            IfaceSet::Local => self.local_ifaces.as_ref(),
            IfaceSet::Pod => self.pod_ifaces.as_ref(),
            IfaceSet::Shaped => self.shaped_ifaces.as_ref(),
        }
    }

    fn ifaces_mut(&mut self, set: IfaceSet) -> Option<&mut HashMap<MapData, u32, u32>> {
        match set {
            IfaceSet::Local => self.local_ifaces.as_mut(),
            IfaceSet::Pod => self.pod_ifaces.as_mut(),
            IfaceSet::Shaped => self.shaped_ifaces.as_mut(),
        }
    }

    pub fn set_host_netns(&mut self, cookie: u64) -> Result<(), MapsError> {
        let map = self.host_netns.as_mut().ok_or(MapsError::Missing {
            name: map_names::HOST_NETNS,
        })?;
        map.set(0, cookie, 0).map_err(wrap(map_names::HOST_NETNS))
    }

    /// The service ids `AFFINITY` holds entries of
    /// (`Planner::note_affinity_entries`): one pass over the map at the
    /// start, read in chunks (a full map, one key at a time, is 65,536
    /// system calls).
    pub fn affinity_service_ids(&self) -> Result<BTreeSet<u32>, MapsError> {
        let mut ids = BTreeSet::new();
        super::batch::for_each_chunk(
            IterableMap::map(&self.affinity),
            super::batch::CHUNK,
            |keys: &[AffinityKey], _: &[AffinityValue]| {
                ids.extend(keys.iter().map(|key| key.service_id));
            },
        )
        .map_err(batch_error(map_names::AFFINITY))?;
        Ok(ids)
    }

    /// Voids every copy the datapath's flow cache holds: called after
    /// conntrack entries were removed from here, so that no CPU goes on
    /// translating a removed flow from its copy. The agent is the epoch's
    /// only writer, so read-then-write is enough.
    pub fn bump_flow_epoch(&mut self) -> Result<(), MapsError> {
        self.bump_epoch().map_err(wrap(map_names::FLOW_GEN))
    }

    fn bump_epoch(&mut self) -> Result<(), MapError> {
        let epoch = self.flow_gen.get(&FLOW_GEN_EPOCH, 0)?;
        self.flow_gen.set(FLOW_GEN_EPOCH, epoch.wrapping_add(1), 0)
    }

    /// The conntrack timeouts in force.
    pub fn ct_timeouts(&self) -> Result<CtTimeouts, MapsError> {
        self.ct_timeouts
            .get(&0, 0)
            .map(CtTimeouts::or_default)
            .map_err(wrap(map_names::CT_TIMEOUTS))
    }

    /// Counter totals over all CPUs, by name.
    pub fn counters(&self) -> Result<Vec<(&'static str, u64)>, MapsError> {
        let mut out = Vec::new();
        for (index, name) in counter::NAMES.iter().enumerate() {
            let per_cpu = self
                .counters
                .get(&(index as u32), 0)
                .map_err(wrap(map_names::COUNTERS))?;
            out.push((*name, per_cpu.iter().sum()));
        }
        let optional = [
            (
                &self.csum_states,
                map_names::CSUM_STATES,
                &ip_summed::STATE_NAMES[..],
            ),
            (
                &self.sock_counters,
                map_names::SOCK_COUNTERS,
                &sock_counter::NAMES[..],
            ),
        ];
        for (map, map_name, names) in optional {
            let Some(map) = map else { continue };
            for (index, name) in names.iter().enumerate() {
                let per_cpu = map.get(&(index as u32), 0).map_err(wrap(map_name))?;
                out.push((*name, per_cpu.iter().sum()));
            }
        }
        Ok(out)
    }

    /// Everything the service maps hold, for adoption at start-up.
    pub fn read_service_state(&self) -> Result<crate::planner::StoredState, MapsError> {
        let mut state = crate::planner::StoredState::default();
        for item in &self.services {
            let (k, v) = item.map_err(wrap(map_names::SERVICES))?;
            state.services.insert(k, v);
        }
        for item in &self.slots {
            let (k, v) = item.map_err(wrap(map_names::BACKEND_SLOTS))?;
            state.slots.insert(k, v.backend_id);
        }
        for item in &self.backends {
            let (k, v) = item.map_err(wrap(map_names::BACKENDS))?;
            state.backends.insert(k, v);
        }
        for key in self.source_ranges.keys() {
            let key = key.map_err(wrap(map_names::SOURCE_RANGES))?;
            state.source_ranges.insert((key.prefix_len(), key.data()));
        }
        if let Some(map) = &self.service_names {
            for item in map {
                let (k, v) = item.map_err(wrap(map_names::SERVICE_NAMES))?;
                state.names.insert(k, v);
            }
        }
        Ok(state)
    }

    /// What the node-level maps hold, for the node planner to start from.
    pub fn read_node_state(&self) -> Result<NodeState, MapsError> {
        let mut state = NodeState::default();
        for item in &self.node_addrs {
            let (k, v) = item.map_err(wrap(map_names::NODE_ADDRS))?;
            state.addrs.insert(k, v);
        }
        state.config = self
            .node_config
            .get(&0, 0)
            .map_err(wrap(map_names::NODE_CONFIG))?;
        if let Some(map) = &self.node_config6 {
            state.config6 = map.get(&0, 0).map_err(wrap(map_names::NODE_CONFIG6))?;
        }
        state.ct_timeouts = self
            .ct_timeouts
            .get(&0, 0)
            .map_err(wrap(map_names::CT_TIMEOUTS))?;
        for key in self.cluster_cidrs.keys() {
            let key = key.map_err(wrap(map_names::CLUSTER_CIDRS))?;
            state.cluster_cidrs.insert((key.prefix_len(), key.data()));
        }
        if let Some(map) = &self.service_cidrs {
            for item in map {
                let (key, kind) = item.map_err(wrap(map_names::SERVICE_CIDRS))?;
                state
                    .service_cidrs
                    .insert((key.prefix_len(), key.data()), kind);
            }
        }
        for set in IfaceSet::ALL {
            if let Some(map) = self.ifaces(set) {
                for key in map.keys() {
                    state
                        .ifaces_mut(set)
                        .insert(key.map_err(wrap(set.map_name()))?);
                }
            }
        }
        Ok(state)
    }
}

impl MapStore for Maps {
    type Error = MapsError;

    /// Runs of backend, slot and service writes (a frontend's whole set in
    /// a plan; every new frontend's, one map at a time, in a
    /// `planner::Batch`) go in one `BPF_MAP_UPDATE_BATCH` each: at 100,000
    /// Services x 10 endpoints a system call per entry was most of the
    /// initial sync.
    fn apply_all(&mut self, ops: &[MapOp]) -> Result<(), (usize, MapsError)> {
        let mut done = 0;
        while done < ops.len() {
            let run = batched_run(&ops[done..]);
            let landed = if run < 2 {
                self.apply(&ops[done]).map_err(|e| (done, e))?;
                1
            } else {
                self.run_writer()
                    .write_run(&ops[done..done + run])
                    .map_err(|(landed, e)| (done + landed, e.into()))?;
                run
            };
            done += landed;
        }
        Ok(())
    }

    /// A batch big enough is written on a thread of its own (see
    /// `write_behind`), its source ranges first, here: an LPM trie, which
    /// has no batched writes.
    fn start_batch(&mut self, phases: Arc<Phases>) -> Landing<MapsError> {
        if !write_behind::worth_a_thread(&phases) {
            return Landing::Done(apply_phases(self, &phases, 0));
        }
        if let Err((landed, error)) = self.apply_all(&phases[0]) {
            return Landing::Done(Err(PhaseFailure {
                phase: 0,
                landed,
                error,
            }));
        }
        let writer = self.run_writer().to_owned();
        match writer.and_then(|writer| writer.spawn(Arc::clone(&phases))) {
            Ok(landing) => landing,
            Err(e) => {
                tracing::debug!(error = %e, "no thread for a batch's writes; writing them here");
                Landing::Done(apply_phases(self, &phases, 1))
            }
        }
    }

    fn apply(&mut self, op: &MapOp) -> Result<(), MapsError> {
        // A handle of its own: the write borrows the maps mutably.
        let prefilter = self.prefilter.clone();
        prefilter::landing(prefilter.as_deref(), std::slice::from_ref(op), || {
            self.apply_unfiltered(op)
        })
    }
}

impl Maps {
    /// Zeroes the counters of service id `id`, which a Service port is
    /// taking or giving back (see `service_counters`).
    fn reset_service_counters(&self, id: u32) -> Result<(), MapsError> {
        use aya::maps::IterableMap;
        match &self.service_counters {
            Some(map) => Ok(service_counters::reset(map.map().fd().as_fd(), &[id])?),
            None => Ok(()),
        }
    }

    /// A handle of its own on the Service counters, for the metrics.
    pub fn service_counters(
        &self,
    ) -> Option<Result<PerCpuArray<MapData, ServiceCounters>, MapsError>> {
        self.service_counters
            .as_ref()
            .map(|map| service_counters::duplicate(map).map_err(MapsError::from))
    }

    fn apply_unfiltered(&mut self, op: &MapOp) -> Result<(), MapsError> {
        let result = match op {
            MapOp::PutBackend { id, backend } => self.backends.insert(id, backend, 0),
            MapOp::PutSlot { key, backend_id } => self.slots.insert(
                key,
                BackendSlot {
                    backend_id: *backend_id,
                },
                0,
            ),
            MapOp::PutService { key, value } => self.services.insert(key, value, 0),
            MapOp::DeleteService { key } => self.services.remove(key),
            MapOp::DeleteSlot { key } => self.slots.remove(key),
            MapOp::DeleteBackend { id } => self.backends.remove(id),
            MapOp::PutSourceRange { entry } => {
                self.source_ranges.insert(&Key::new(entry.0, entry.1), 1, 0)
            }
            MapOp::DeleteSourceRange { entry } => {
                self.source_ranges.remove(&Key::new(entry.0, entry.1))
            }
            // The counters are zeroed before a port's name lands, and so
            // before any frontend of it exists to count into them.
            MapOp::PutServiceName { id, name } => {
                self.reset_service_counters(*id)?;
                match &mut self.service_names {
                    Some(map) => map.insert(id, **name, 0),
                    None => {
                        return Err(MapsError::Missing {
                            name: map_names::SERVICE_NAMES,
                        });
                    }
                }
            }
            MapOp::DeleteServiceName { id } => {
                self.reset_service_counters(*id)?;
                match &mut self.service_names {
                    Some(map) => map.remove(id),
                    None => Ok(()),
                }
            }
            MapOp::PutNodeAddr { key, value } => self.node_addrs.insert(key, value, 0),
            MapOp::DeleteNodeAddr { key } => self.node_addrs.remove(key),
            MapOp::SetNodeConfig { config } => self.node_config.set(0, config, 0),
            MapOp::SetNodeConfig6 { config } => match &mut self.node_config6 {
                Some(map) => map.set(0, config, 0),
                None => {
                    return Err(MapsError::Missing {
                        name: map_names::NODE_CONFIG6,
                    });
                }
            },
            MapOp::SetCtTimeouts { timeouts } => {
                // The flow cache copies only entries that outlive a copy by
                // the timeouts it saw; shorter ones void that promise.
                self.ct_timeouts
                    .set(0, timeouts, 0)
                    .and_then(|()| self.bump_epoch())
            }
            MapOp::PutClusterCidr { entry } => {
                self.cluster_cidrs.insert(&Key::new(entry.0, entry.1), 1, 0)
            }
            MapOp::DeleteClusterCidr { entry } => {
                self.cluster_cidrs.remove(&Key::new(entry.0, entry.1))
            }
            MapOp::PutServiceCidr { entry, kind } => match &mut self.service_cidrs {
                Some(map) => map.insert(&Key::new(entry.0, entry.1), kind, 0),
                None => {
                    return Err(MapsError::Missing {
                        name: map_names::SERVICE_CIDRS,
                    });
                }
            },
            MapOp::DeleteServiceCidr { entry } => match &mut self.service_cidrs {
                Some(map) => map.remove(&Key::new(entry.0, entry.1)),
                None => Ok(()),
            },
            MapOp::PutIface { set, ifindex } => match self.ifaces_mut(*set) {
                Some(map) => map.insert(ifindex, 1, 0),
                None => {
                    return Err(MapsError::Missing {
                        name: set.map_name(),
                    });
                }
            },
            MapOp::DeleteIface { set, ifindex } => match self.ifaces_mut(*set) {
                Some(map) => map.remove(ifindex),
                None => Ok(()),
            },
        };
        match result {
            Ok(()) => Ok(()),
            // Deleting what is already gone is the state we wanted.
            Err(MapError::KeyNotFound) if op.is_delete() => Ok(()),
            Err(MapError::SyscallError(e))
                if op.is_delete() && e.io_error.raw_os_error() == Some(libc::ENOENT) =>
            {
                Ok(())
            }
            Err(source) => Err(MapsError::Write {
                op: op.to_string(),
                source,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(id: u32) -> MapOp {
        MapOp::PutBackend {
            id,
            backend: Backend::default(),
        }
    }

    fn slot(slot: u32) -> MapOp {
        MapOp::PutSlot {
            key: BackendSlotKey { slot_set: 1, slot },
            backend_id: slot + 1,
        }
    }

    #[test]
    fn a_batch_is_a_run_of_writes_to_one_map() {
        let service = MapOp::PutService {
            key: ServiceKey::default(),
            value: ServiceValue::default(),
        };
        let plan = [
            backend(1),
            backend(2),
            slot(0),
            slot(1),
            slot(2),
            service.clone(),
        ];
        assert_eq!(batched_run(&plan), 2, "the backends");
        assert_eq!(
            batched_run(&plan[2..]),
            3,
            "the slots, not the service after them"
        );
        assert_eq!(
            batched_run(&plan[5..]),
            1,
            "a lone service write (applied on its own)"
        );
        let services = [service.clone(), service.clone(), backend(3)];
        assert_eq!(
            batched_run(&services),
            2,
            "the service writes of a batch, not the backend after them"
        );
        assert_eq!(batched_run(&[]), 0, "nothing");
        let deletes = [
            MapOp::DeleteBackend { id: 1 },
            MapOp::DeleteBackend { id: 2 },
        ];
        assert_eq!(batched_run(&deletes), 0, "deletes go one by one");
    }
}
