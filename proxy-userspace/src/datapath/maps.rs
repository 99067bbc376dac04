//! Typed handles on the pinned maps, and the only code that writes the
//! service maps (through the planner's [`MapStore`]).

use aya::maps::{Array, HashMap, Map, MapData, MapError, PerCpuArray};
use proxy_common::{
    AffinityKey, AffinityValue, Backend, BackendSlot, BackendSlotKey, CtKey, CtTimeouts, CtValue,
    ServiceKey, ServiceValue, counter, map_names,
};

use super::pins::PinLayout;
use crate::planner::{MapOp, MapStore};

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
    #[error("{op}: {source}")]
    Write {
        op: String,
        #[source]
        source: MapError,
    },
}

fn wrap(name: &'static str) -> impl FnOnce(MapError) -> MapsError {
    move |source| MapsError::Map { name, source }
}

/// Every map of the datapath.
pub struct Maps {
    pub services: HashMap<MapData, ServiceKey, ServiceValue>,
    pub slots: HashMap<MapData, BackendSlotKey, BackendSlot>,
    pub backends: HashMap<MapData, u32, Backend>,
    pub conntrack: HashMap<MapData, CtKey, CtValue>,
    pub affinity: HashMap<MapData, AffinityKey, AffinityValue>,
    pub counters: PerCpuArray<MapData, u64>,
    pub ct_timeouts: Array<MapData, CtTimeouts>,
}

impl Maps {
    /// Takes the maps out of a loaded object.
    pub fn take(ebpf: &mut aya::Ebpf) -> Result<Self, MapsError> {
        let mut take = |name: &'static str| -> Result<Map, MapsError> {
            ebpf.take_map(name).ok_or(MapsError::Missing { name })
        };
        Self::from_maps(
            take(map_names::SERVICES)?,
            take(map_names::BACKEND_SLOTS)?,
            take(map_names::BACKENDS)?,
            take(map_names::CONNTRACK)?,
            take(map_names::AFFINITY)?,
            take(map_names::COUNTERS)?,
            take(map_names::CT_TIMEOUTS)?,
        )
    }

    /// Opens the pinned maps of a running (or exited) agent, without loading
    /// anything: for inspection and tests.
    pub fn open_pinned(pins: &PinLayout) -> Result<Self, MapsError> {
        let open = |name: &'static str| -> Result<Map, MapsError> {
            let data = MapData::from_pin(pins.map(name)).map_err(wrap(name))?;
            Map::from_map_data(data).map_err(wrap(name))
        };
        Self::from_maps(
            open(map_names::SERVICES)?,
            open(map_names::BACKEND_SLOTS)?,
            open(map_names::BACKENDS)?,
            open(map_names::CONNTRACK)?,
            open(map_names::AFFINITY)?,
            open(map_names::COUNTERS)?,
            open(map_names::CT_TIMEOUTS)?,
        )
    }

    fn from_maps(
        services: Map,
        slots: Map,
        backends: Map,
        conntrack: Map,
        affinity: Map,
        counters: Map,
        ct_timeouts: Map,
    ) -> Result<Self, MapsError> {
        Ok(Self {
            services: HashMap::try_from(services).map_err(wrap(map_names::SERVICES))?,
            slots: HashMap::try_from(slots).map_err(wrap(map_names::BACKEND_SLOTS))?,
            backends: HashMap::try_from(backends).map_err(wrap(map_names::BACKENDS))?,
            conntrack: HashMap::try_from(conntrack).map_err(wrap(map_names::CONNTRACK))?,
            affinity: HashMap::try_from(affinity).map_err(wrap(map_names::AFFINITY))?,
            counters: PerCpuArray::try_from(counters).map_err(wrap(map_names::COUNTERS))?,
            ct_timeouts: Array::try_from(ct_timeouts).map_err(wrap(map_names::CT_TIMEOUTS))?,
        })
    }

    /// Sets the conntrack timeouts the datapath and the reaper use.
    pub fn set_ct_timeouts(&mut self, timeouts: CtTimeouts) -> Result<(), MapsError> {
        self.ct_timeouts
            .set(0, timeouts, 0)
            .map_err(wrap(map_names::CT_TIMEOUTS))
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
        Ok(out)
    }

    /// Everything the service maps hold, for adoption at start-up.
    pub fn read_service_state(&self) -> Result<crate::planner::StoredState, MapsError> {
        let mut state = crate::planner::StoredState::default();
        for item in self.services.iter() {
            let (k, v) = item.map_err(wrap(map_names::SERVICES))?;
            state.services.insert(k, v);
        }
        for item in self.slots.iter() {
            let (k, v) = item.map_err(wrap(map_names::BACKEND_SLOTS))?;
            state.slots.insert(k, v.backend_id);
        }
        for item in self.backends.iter() {
            let (k, v) = item.map_err(wrap(map_names::BACKENDS))?;
            state.backends.insert(k, v);
        }
        Ok(state)
    }
}

impl MapStore for Maps {
    type Error = MapsError;

    fn apply(&mut self, op: &MapOp) -> Result<(), MapsError> {
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
