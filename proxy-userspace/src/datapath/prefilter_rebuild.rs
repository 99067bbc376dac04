//! The prefilter's rebuild (`prefilter`): the whole array written again
//! from what the maps hold, the only way its bits are ever cleared. Apart
//! from the mapping, which the maps' writers need: this reads the maps.

use aya::maps::{IterableMap, MapData};
use bytemuck::Pod;
use proxy_common::{
    Backend, CtKeyOf, CtValueOf, FlowAddr, ServiceKey, ServiceValue, ct_dir, map_names,
    prefilter::{BITS, bit, flows, side, to_bits},
};

use super::{
    batch,
    maps::{Maps, MapsError, batch_error, wrap},
    prefilter::{Bits, backend_bit, node_addr_bit, service_bits, service_cidr_bits},
    prefilter_flows::Refreshed,
};

/// What a rebuild left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rebuilt {
    /// Bits set, of `BITS`.
    pub ones: u32,
    /// Words whose bits changed.
    pub changed: usize,
}

impl Rebuilt {
    /// The share of the array set: about the share of each probe of a
    /// packet for no Service that answers "maybe".
    pub fn fill(&self) -> f64 {
        f64::from(self.ones) / f64::from(BITS)
    }
}

/// Writes the array again from what the maps hold now: every frontend,
/// the blocks of the node's NodePort addresses, of the service CIDRs and
/// of the ClusterIPs, and the keys of every flow in both families'
/// conntrack maps (a flow's forward entry names its frontend, with its
/// block's `frontends_bit`); while the prefilter keeps them
/// (`Prefilter::keeps_sources`), every backend's source bit and every
/// reply entry's too. Under the lock throughout, so no frontend or backend
/// goes, and none lands, while the maps are read. `None` where the maps
/// have no prefilter (the pins of an older agent).
pub fn rebuild(maps: &Maps) -> Result<Option<Rebuilt>, MapsError> {
    write(maps, false)
}

/// `rebuild` without backends' source bits, which the prefilter stops
/// keeping as it ends: for once this agent's programs have replaced an
/// earlier agent's on every interface, as only those read the bits. `None`
/// where there is no prefilter or it keeps none already. On an error the
/// bits stay as they were, kept, and the next call tries again.
pub fn retire_sources(maps: &Maps) -> Result<Option<Rebuilt>, MapsError> {
    match &maps.prefilter {
        Some(prefilter) if prefilter.keeps_sources() => write(maps, true),
        _ => Ok(None),
    }
}

fn write(maps: &Maps, retire: bool) -> Result<Option<Rebuilt>, MapsError> {
    let Some(prefilter) = &maps.prefilter else {
        return Ok(None);
    };
    let held = prefilter.hold();
    let sources = prefilter.keeps_sources() && !retire;
    let mut bits = Bits::new();
    batch::for_each_chunk(
        maps.services.map(),
        batch::CHUNK,
        |keys: &[ServiceKey], _: &[ServiceValue]| {
            for key in keys {
                service_bits(key, |bit| bits.set(bit));
            }
        },
    )
    .map_err(batch_error(map_names::SERVICES))?;
    if sources {
        batch::for_each_chunk(
            maps.backends.map(),
            batch::CHUNK,
            |_: &[u32], backends: &[Backend]| {
                for backend in backends {
                    bits.set(backend_bit(backend));
                }
            },
        )
        .map_err(batch_error(map_names::BACKENDS))?;
    }
    for entry in &maps.node_addrs {
        let (key, value) = entry.map_err(wrap(map_names::NODE_ADDRS))?;
        if let Some(bit) = node_addr_bit(&key, &value) {
            bits.set(bit);
        }
    }
    if let Some(map) = &maps.service_cidrs {
        for key in map.keys() {
            let key = key.map_err(wrap(map_names::SERVICE_CIDRS))?;
            service_cidr_bits(&(key.prefix_len(), key.data()), |bit| bits.set(bit));
        }
    }
    flows::<u32>(
        maps.conntrack.map(),
        map_names::CONNTRACK,
        sources,
        &mut bits,
    )?;
    flows::<u32>(maps.ct_new.map(), map_names::CT_NEW, sources, &mut bits)?;
    if let Some(map) = &maps.conntrack6 {
        flows::<[u32; 4]>(map.map(), map_names::CONNTRACK6, sources, &mut bits)?;
    }
    if let Some(map) = &maps.ct_new6 {
        flows::<[u32; 4]>(map.map(), map_names::CT_NEW6, sources, &mut bits)?;
    }
    let changed = prefilter.replace(&bits, &held);
    if retire {
        prefilter.retire_sources(&held);
    }
    Ok(Some(Rebuilt {
        ones: bits.ones(),
        changed,
    }))
}

/// `rebuild` at load: an array created just now (or pinned by an agent
/// older than the maps' contents) knows nothing of what the maps hold.
/// Where the maps cannot be read, every bit is set: each packet then takes
/// the full path, as without a prefilter, until the next rebuild. The
/// flows' marks are opened whole: the programs of an earlier agent on
/// these pins may go on making flows unmarked until this agent's are
/// attached, after which `refresh_flows` clears what no flow needs.
pub fn write_at_load(maps: &Maps) {
    maps.open_flow_marks();
    match rebuild(maps) {
        Ok(Some(rebuilt)) => tracing::debug!(
            fill = rebuilt.fill(),
            "prefilter written from the maps' frontends, backends and flows"
        ),
        Ok(None) => {}
        Err(e) => {
            tracing::warn!(
                error = %e,
                "prefilter not written from the maps: every packet takes the full path until the next rebuild"
            );
            if let Some(prefilter) = &maps.prefilter {
                prefilter.open_all();
            }
        }
    }
}

/// The keys of the flows in one conntrack map: a forward entry's
/// destination (the frontend the client sent to) and, with `sources`, a
/// reply entry's source (the backend answering, for the programs of
/// earlier agents; this agent's datapath asks the flows' marks).
fn flows<A>(
    map: &MapData,
    name: &'static str,
    sources: bool,
    bits: &mut Bits,
) -> Result<(), MapsError>
where
    A: FlowAddr,
    CtKeyOf<A>: Pod,
    CtValueOf<A>: Pod,
{
    each_entry::<A>(map, name, |key, value| {
        if value.dir == ct_dir::FORWARD {
            for bit in to_bits(&key.dst_be.mapped(), key.dport_be, key.proto) {
                bits.set(bit);
            }
        } else if sources {
            bits.set(bit(
                &key.src_be.mapped(),
                key.sport_be,
                key.proto,
                side::FROM,
            ));
        }
    })
}

/// Calls `f` with each entry of one conntrack map, read in batches.
fn each_entry<A>(
    map: &MapData,
    name: &'static str,
    mut f: impl FnMut(&CtKeyOf<A>, &CtValueOf<A>),
) -> Result<(), MapsError>
where
    A: FlowAddr,
    CtKeyOf<A>: Pod,
    CtValueOf<A>: Pod,
{
    batch::for_each_chunk(
        map,
        batch::CHUNK,
        |keys: &[CtKeyOf<A>], values: &[CtValueOf<A>]| {
            for (key, value) in keys.iter().zip(values) {
                f(key, value);
            }
        },
    )
    .map_err(batch_error(name))
}

/// Refreshes one half of the flows' marks (`FlowMarks::refresh`) from the
/// reply entries both families' conntrack maps hold: `CT_NEW` before
/// `CONNTRACK`, as a flow assured meanwhile lands in `CONNTRACK` before it
/// leaves `CT_NEW`, so that one of the two reads sees it. `None` where the
/// maps have no marks (the pins of an older agent).
pub fn refresh_flows(maps: &Maps) -> Result<Option<Refreshed>, MapsError> {
    let Some(marks) = &maps.prefilter_flows else {
        return Ok(None);
    };
    marks
        .refresh(|mark| {
            reply_slots::<u32>(maps.ct_new.map(), map_names::CT_NEW, mark)?;
            reply_slots::<u32>(maps.conntrack.map(), map_names::CONNTRACK, mark)?;
            if let Some(map) = &maps.ct_new6 {
                reply_slots::<[u32; 4]>(map.map(), map_names::CT_NEW6, mark)?;
            }
            if let Some(map) = &maps.conntrack6 {
                reply_slots::<[u32; 4]>(map.map(), map_names::CONNTRACK6, mark)?;
            }
            Ok(())
        })
        .map(Some)
}

/// Calls `mark` with the slot of every reply entry's key in one conntrack
/// map, as the datapath marks it (`proxy_common::prefilter::flows`).
fn reply_slots<A>(
    map: &MapData,
    name: &'static str,
    mark: &mut dyn FnMut(u32),
) -> Result<(), MapsError>
where
    A: FlowAddr,
    CtKeyOf<A>: Pod,
    CtValueOf<A>: Pod,
{
    each_entry::<A>(map, name, |key, value| {
        if value.dir != ct_dir::FORWARD {
            mark(flows::slot(
                &key.src_be.mapped(),
                key.sport_be,
                &key.dst_be.mapped(),
                key.dport_be,
                key.proto,
            ));
        }
    })
}

/// The prefilter as the agent's housekeeping leaves it once its programs
/// run: both halves of the flows' marks refreshed, one after the other, so
/// that the marks hold what conntrack holds and no more, and backends'
/// source bits retired. For a datapath whose programs run only the packets
/// its caller hands them (`BPF_PROG_TEST_RUN` in tests and benchmarks); the
/// agent does both from its housekeeping, once its programs are attached.
pub fn settle(maps: &Maps) -> Result<(), MapsError> {
    refresh_flows(maps)?;
    refresh_flows(maps)?;
    retire_sources(maps)?;
    Ok(())
}
