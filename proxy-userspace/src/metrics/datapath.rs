//! The datapath's own metrics, under `ebpf_proxy_`: what `ebpf-proxy status`
//! shows (every per-CPU counter summed over CPUs, the fill of each map
//! against its size), the sync loop's failed and pending writes, and each
//! interface's XDP mode, and each Service port's traffic (`services`).
//! Maps are read at scrape time: a counter read is a
//! syscall per counter, cheaper than keeping copies fresh on a timer.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex, atomic::Ordering},
};

use aya::maps::{IterableMap, MapData, MapInfo, PerCpuArray};
use bytemuck::Pod;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};
use proxy_common::{
    AffinityKey, AffinityValue, Backend, BackendSlot, BackendSlotKey, Ct6Key, Ct6Value, CtKey,
    CtValue, ServiceCounters, ServiceKey, ServiceValue, map_names,
};

use super::SyncStats;
use crate::datapath::{Maps, PinLayout, batch};

/// The XDP mode of each interface the datapath is attached to, as the agent
/// last applied them (`none` where tc alone serves it).
#[derive(Clone, Debug, Default)]
pub struct InterfaceModes(Arc<Mutex<BTreeMap<String, &'static str>>>);

impl InterfaceModes {
    pub fn set<'a>(
        &self,
        attached: impl Iterator<Item = &'a str>,
        xdp: impl Iterator<Item = (&'a str, &'static str)>,
    ) {
        let mut modes: BTreeMap<String, &'static str> =
            attached.map(|name| (name.to_owned(), "none")).collect();
        modes.extend(xdp.map(|(name, mode)| (name.to_owned(), mode)));
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = modes;
    }

    fn get(&self) -> BTreeMap<String, &'static str> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// Reads the pinned maps at each scrape.
pub struct DatapathCollector {
    maps: Maps,
    /// The Service counters of the agent's object (never pinned), where it
    /// has them.
    service_counters: Option<PerCpuArray<MapData, ServiceCounters>>,
    pins: PinLayout,
    sync: Arc<SyncStats>,
    interfaces: InterfaceModes,
}

impl std::fmt::Debug for DatapathCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatapathCollector")
            .field("maps", &self.pins.maps_dir())
            .finish_non_exhaustive()
    }
}

impl DatapathCollector {
    /// Opens the maps pinned under `pins` (its own descriptors, so scrapes
    /// never wait for the sync loop), with `service_counters` beside them.
    pub fn open(
        pins: &PinLayout,
        service_counters: Option<PerCpuArray<MapData, ServiceCounters>>,
        sync: Arc<SyncStats>,
        interfaces: InterfaceModes,
    ) -> Result<Self, crate::datapath::maps::MapsError> {
        Ok(DatapathCollector {
            maps: Maps::open_pinned_unmapped(pins)?,
            service_counters,
            pins: pins.clone(),
            sync,
            interfaces,
        })
    }

    /// Entries in each hash map, against its size.
    fn fills(&self) -> Vec<(&'static str, Option<usize>, Option<u32>)> {
        fn count<K: Pod, V: Pod>(map: &MapData) -> Option<usize> {
            batch::count::<K, V>(map, batch::CHUNK).ok()
        }
        let m = &self.maps;
        let counted = [
            (
                map_names::SERVICES,
                count::<ServiceKey, ServiceValue>(m.services.map()),
            ),
            (
                map_names::BACKEND_SLOTS,
                count::<BackendSlotKey, BackendSlot>(m.slots.map()),
            ),
            (map_names::BACKENDS, count::<u32, Backend>(m.backends.map())),
            (
                map_names::CONNTRACK,
                count::<CtKey, CtValue>(m.conntrack.map()),
            ),
            (map_names::CT_NEW, count::<CtKey, CtValue>(m.ct_new.map())),
            (
                map_names::CONNTRACK6,
                m.conntrack6
                    .as_ref()
                    .and_then(|c| count::<Ct6Key, Ct6Value>(c.map())),
            ),
            (
                map_names::CT_NEW6,
                m.ct_new6
                    .as_ref()
                    .and_then(|c| count::<Ct6Key, Ct6Value>(c.map())),
            ),
            (
                map_names::AFFINITY,
                count::<AffinityKey, AffinityValue>(m.affinity.map()),
            ),
        ];
        counted
            .into_iter()
            .map(|(name, entries)| {
                let capacity = MapInfo::from_pin(self.pins.map(name))
                    .ok()
                    .map(|info| info.max_entries());
                (name, entries, capacity)
            })
            .collect()
    }
}

fn encode_counter(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: u64,
) -> Result<(), std::fmt::Error> {
    let counter = ConstCounter::new(value);
    counter.encode(encoder.encode_descriptor(name, help, None, counter.metric_type())?)
}

fn encode_gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: i64,
) -> Result<(), std::fmt::Error> {
    let gauge = ConstGauge::new(value);
    gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)
}

impl Collector for DatapathCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        match self.maps.counters() {
            Ok(counters) => {
                let mut family = encoder.encode_descriptor(
                    "ebpf_proxy_datapath_events",
                    "Datapath counters summed over CPUs, by the name ebpf-proxy status shows them under",
                    None,
                    prometheus_client::metrics::MetricType::Counter,
                )?;
                for (name, value) in counters {
                    let labels = [("event", name)];
                    ConstCounter::new(value).encode(family.encode_family(&labels)?)?;
                }
            }
            Err(e) => tracing::warn!(error = %e, "datapath counters left out of this scrape"),
        }

        let fills = self.fills();
        let mut family = encoder.encode_descriptor(
            "ebpf_proxy_map_entries",
            "Entries in each datapath map",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (map, entries, _) in &fills {
            if let Some(entries) = entries {
                let labels = [("map", *map)];
                ConstGauge::new(*entries as i64).encode(family.encode_family(&labels)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "ebpf_proxy_map_capacity_entries",
            "Entries each datapath map can hold (conntrack: --conntrack-max, two a connection)",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (map, _, capacity) in &fills {
            if let Some(capacity) = capacity {
                let labels = [("map", *map)];
                ConstGauge::new(i64::from(*capacity)).encode(family.encode_family(&labels)?)?;
            }
        }

        if let (Some(names), Some(counters)) = (&self.maps.service_names, &self.service_counters) {
            super::services::encode(&mut encoder, names, counters)?;
        }

        let modes = self.interfaces.get();
        let mut family = encoder.encode_descriptor(
            "ebpf_proxy_interface_xdp_mode",
            "Interfaces the datapath is attached to (tc ingress), with the mode XDP runs in on each: native, generic, or none",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (interface, mode) in &modes {
            let labels = [("interface", interface.as_str()), ("mode", *mode)];
            ConstGauge::new(1i64).encode(family.encode_family(&labels)?)?;
        }

        let sync = &self.sync;
        encode_counter(
            &mut encoder,
            "ebpf_proxy_syncs",
            "Syncs of the maps run",
            sync.syncs.load(Ordering::Relaxed),
        )?;
        encode_counter(
            &mut encoder,
            "ebpf_proxy_map_operations",
            "Map writes and deletes applied by the syncs",
            sync.map_ops.load(Ordering::Relaxed),
        )?;
        encode_counter(
            &mut encoder,
            "ebpf_proxy_map_write_failures",
            "Frontend writes that failed, each attempt counted (each is retried until it lands)",
            sync.failed_writes.load(Ordering::Relaxed),
        )?;
        encode_gauge(
            &mut encoder,
            "ebpf_proxy_map_writes_pending",
            "Frontends whose last write failed, waiting for their retry",
            sync.pending.load(Ordering::Relaxed) as i64,
        )?;
        encode_gauge(
            &mut encoder,
            "ebpf_proxy_departed_purges_pending",
            "Backends that left their Services whose purge (UDP and SCTP flows, affinity entries, the node's sockets connected to them) failed, waiting for its retry",
            sync.departures_owed.load(Ordering::Relaxed) as i64,
        )?;
        Ok(())
    }
}
