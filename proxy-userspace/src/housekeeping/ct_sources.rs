//! Each client's count of assured flows (`CT_SOURCES`, `CT_SOURCES6`), put
//! right. The datapath adds one at each flow it assures and never takes one
//! away: flows end by expiring, by the reaper, or by LRU eviction, none of
//! which it sees. So after each reap the counts are taken again from the
//! assured flows themselves (their forward entries, keyed by the client),
//! and written over the datapath's. A flow assured between the count and
//! the write is missed until the next one, letting its client one flow past
//! its share at most per flow assured in that instant.

use std::collections::BTreeMap;

use aya::{
    Pod,
    maps::{HashMap, IterableMap, MapData},
};
use proxy_common::{CtKeyOf, CtTimeouts, CtValueOf, FlowAddr, ct_dir, map_names};

use crate::datapath::{
    batch,
    maps::{Maps, MapsError, batch_error, wrap},
};

/// Counts again both families' assured flows per client and writes the
/// counts: the clients whose counts changed, or went.
pub fn recount(maps: &mut Maps, now_ns: u64) -> Result<usize, MapsError> {
    let timeouts = maps.ct_timeouts()?;
    let v4 = by_client(
        maps.conntrack.map(),
        map_names::CONNTRACK,
        now_ns,
        &timeouts,
    )?;
    let mut changed = rewrite(&mut maps.ct_sources, map_names::CT_SOURCES, &v4)?;
    if let Some(conntrack6) = &maps.conntrack6 {
        let v6 = by_client(conntrack6.map(), map_names::CONNTRACK6, now_ns, &timeouts)?;
        changed += rewrite(&mut maps.ct_sources6, map_names::CT_SOURCES6, &v6)?;
    }
    Ok(changed)
}

/// Live assured flows per client address in the conntrack map `name`.
fn by_client<A>(
    map: &MapData,
    name: &'static str,
    now_ns: u64,
    timeouts: &CtTimeouts,
) -> Result<BTreeMap<A, u32>, MapsError>
where
    A: FlowAddr + Ord,
    CtKeyOf<A>: bytemuck::Pod,
    CtValueOf<A>: bytemuck::Pod,
{
    let mut counts = BTreeMap::new();
    batch::for_each_chunk(
        map,
        batch::CHUNK,
        |keys: &[CtKeyOf<A>], values: &[CtValueOf<A>]| {
            for (key, value) in keys.iter().zip(values) {
                if value.dir == ct_dir::FORWARD && !value.expired(key.proto, now_ns, timeouts) {
                    *counts.entry(key.src_be).or_insert(0) += 1;
                }
            }
        },
    )
    .map_err(batch_error(name))?;
    Ok(counts)
}

/// Makes `map` hold `counts`: clients without assured flows go. How many
/// entries changed.
fn rewrite<A>(
    map: &mut HashMap<MapData, A, u32>,
    name: &'static str,
    counts: &BTreeMap<A, u32>,
) -> Result<usize, MapsError>
where
    A: Pod + Ord,
{
    let held: BTreeMap<A, u32> = map.iter().filter_map(Result::ok).collect();
    let mut changed = 0;
    for client in held.keys().filter(|c| !counts.contains_key(c)) {
        match map.remove(client) {
            Ok(()) => changed += 1,
            // Evicted meanwhile.
            Err(aya::maps::MapError::KeyNotFound) => {}
            Err(e) => return Err(wrap(name)(e)),
        }
    }
    for (client, count) in counts {
        if held.get(client) == Some(count) {
            continue;
        }
        map.insert(client, count, 0).map_err(wrap(name))?;
        changed += 1;
    }
    Ok(changed)
}
