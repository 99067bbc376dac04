//! Each client's count of assured flows (`CT_SOURCES`, `CT_SOURCES6`), put
//! right. The datapath adds one at each flow it assures and never takes one
//! away: flows end by expiring, by the reaper, or by LRU eviction, none of
//! which it sees. So at each reap the counts are taken again from the
//! assured flows themselves (their forward entries, keyed by the client),
//! as the reaper reads `CONNTRACK` and `CONNTRACK6` (`Tally`, fed by
//! `conntrack::reap_expired`: one pass over each map, not two), and written
//! over the datapath's. A flow assured between the count and the write is
//! missed until the next one, letting its client one flow past its share at
//! most per flow assured in that instant. A closed flow counts until it
//! expires: its entries stay in `CONNTRACK`, and the share is what bounds a
//! client's footprint there (docs/architecture.md, "TCP state").

use std::{collections::HashMap as Counts, hash::Hash};

use aya::{
    Pod,
    maps::{HashMap, MapData},
};
use proxy_common::{CtKeyOf, CtTimeouts, CtValueOf, ct_dir, map_names};

use crate::datapath::maps::{Maps, MapsError, wrap};

/// Each client's live assured flows in both families, as the reaper's pass
/// over `CONNTRACK` and `CONNTRACK6` counts them (`conntrack::reap_expired`).
/// A family whose pass did not read its map whole is not written: its
/// counts would be short, and let clients past their share.
#[derive(Debug, Default)]
pub struct Tally {
    pub v4: FamilyTally<u32>,
    pub v6: FamilyTally<[u32; 4]>,
}

/// One family's part of a `Tally`.
#[derive(Debug)]
pub struct FamilyTally<A> {
    counts: Counts<A, u32>,
    whole: bool,
}

impl<A> Default for FamilyTally<A> {
    fn default() -> Self {
        FamilyTally {
            counts: Counts::new(),
            whole: false,
        }
    }
}

impl<A: Copy + Eq + Hash> FamilyTally<A> {
    /// Counts the live assured flows among a chunk of the family's
    /// `CONNTRACK` map: each forward entry, by its client.
    pub fn add(
        &mut self,
        keys: &[CtKeyOf<A>],
        values: &[CtValueOf<A>],
        now_ns: u64,
        timeouts: &CtTimeouts,
    ) {
        for (key, value) in keys.iter().zip(values) {
            if value.dir == ct_dir::FORWARD && !value.expired(key.proto, now_ns, timeouts) {
                *self.counts.entry(key.src_be).or_insert(0) += 1;
            }
        }
    }

    /// The pass that fed `add` read the whole map.
    pub fn mark_whole(&mut self) {
        self.whole = true;
    }
}

/// Writes the counts of each family `tally` read whole over the
/// datapath's: the clients whose counts changed, or went.
pub fn write(maps: &mut Maps, tally: &Tally) -> Result<usize, MapsError> {
    let mut changed = 0;
    if tally.v4.whole {
        changed += rewrite(
            &mut maps.ct_sources,
            map_names::CT_SOURCES,
            &tally.v4.counts,
        )?;
    }
    if tally.v6.whole {
        changed += rewrite(
            &mut maps.ct_sources6,
            map_names::CT_SOURCES6,
            &tally.v6.counts,
        )?;
    }
    Ok(changed)
}

/// Makes `map` hold `counts`: clients without assured flows go. How many
/// entries changed.
fn rewrite<A>(
    map: &mut HashMap<MapData, A, u32>,
    name: &'static str,
    counts: &Counts<A, u32>,
) -> Result<usize, MapsError>
where
    A: Pod + Eq + Hash,
{
    let held: Counts<A, u32> = map.iter().filter_map(Result::ok).collect();
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
