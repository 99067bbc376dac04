//! Housekeeping of the per-flow maps, from user space: the datapath only
//! ever creates and refreshes entries.
//!
//! - When a backend leaves a service, its UDP flows and its affinity entries
//!   for that service are removed at once, so the next datagram of a UDP
//!   "flow" is balanced to a live backend instead of being blackholed (the
//!   stale UDP conntrack problem kube-proxy users have had for years). TCP
//!   flows are left to finish, as with kube-proxy: an established connection
//!   keeps its backend.
//! - Entries idle past their timeout (`CtValue::expired`, shared with the
//!   datapath) are reaped periodically, so the LRU maps hold live flows.
//!
//! Both apply to every conntrack map: `CONNTRACK`, the assured flows, and
//! `CT_NEW`, those not assured yet, and IPv6's `CONNTRACK6` and `CT_NEW6`.
//!
//! Either removal is followed by a bump of the flow cache's epoch, which
//! voids the copies of entries that CPUs keep (`proxy_common::FlowCacheEntry`).

use std::{collections::HashSet, hash::Hash};

use aya::maps::IterableMap;
use aya::maps::MapData;
use proxy_common::{
    AffinityKey, AffinityValue, Ct6Key, Ct6Value, CtKey, CtKeyOf, CtTimeouts, CtValue, CtValueOf,
    PROTO_TCP, ct_reap, map_names,
};

use crate::{
    datapath::{
        batch,
        ct_reap::CtReap,
        maps::{Maps, MapsError, batch_error},
    },
    housekeeping::ct_sources::{FamilyTally, Tally},
    planner::{AffinityPurge, Departed},
};

/// What a sweep removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    pub conntrack: usize,
    pub affinity: usize,
}

/// `CLOCK_MONOTONIC` in ns: what the datapath clock (`proxy_common::Clock`)
/// reads.
pub fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
    })
}

/// Removes the UDP conntrack entries of departed backends, and the
/// affinity entries `affinity` names: the departed backends' (where their
/// Service has affinity) and every entry of the service ids whose affinity
/// went off. One pass over each map, only when it has something to lose,
/// read in chunks: the sync that reports the departure waits for it, and a
/// table of 200,000 flows read an entry at a time (two system calls each)
/// held it for most of a second. The conntrack maps are passed over only
/// when a departed backend's flows may be in them (`flows_to_remove`), and
/// `AFFINITY` only when `affinity` asks (`AffinityPurge::needed`): a pass
/// walks every bucket, 65,536 at the default size, whatever the map holds.
pub fn purge_departed(
    maps: &mut Maps,
    departed: &[Departed],
    affinity: &AffinityPurge,
) -> Result<Swept, MapsError> {
    let mut swept = Swept::default();
    if departed.is_empty() && !affinity.needed() {
        return Ok(swept);
    }
    let gone: HashSet<(u32, u32)> = departed
        .iter()
        .map(|d| (d.service_id, d.backend_id))
        .collect();
    if flows_to_remove(departed) {
        swept.conntrack = purge_departed_flows(maps, &gone)?;
    }
    if swept.conntrack > 0 {
        maps.bump_flow_epoch()?;
    }
    if affinity.needed() {
        let dropped: HashSet<u32> = affinity.dropped.iter().copied().collect();
        let doomed = batch::keys_where(
            maps.affinity.map(),
            batch::CHUNK,
            |k: &AffinityKey, v: &AffinityValue| {
                dropped.contains(&k.service_id)
                    || (affinity.departed && gone.contains(&(k.service_id, v.backend_id)))
            },
        )
        .map_err(batch_error(map_names::AFFINITY))?;
        swept.affinity = batch::delete(maps.affinity.map(), &doomed)
            .map_err(batch_error(map_names::AFFINITY))?;
    }
    Ok(swept)
}

/// Whether a departed backend's flows may be in conntrack for
/// `purge_departed` to remove: only UDP and SCTP flows go, so when every
/// departed backend served TCP, none can, and the pass over the conntrack
/// maps, which walks every bucket of each whatever they hold (about 2 ms
/// at the default sizes), is skipped. A departure whose backend the planner
/// no longer knows is passed over.
fn flows_to_remove(departed: &[Departed]) -> bool {
    departed
        .iter()
        .any(|d| d.backend.is_none_or(|b| b.proto != PROTO_TCP))
}

/// The conntrack half of `purge_departed`: the UDP and SCTP entries of the
/// `gone` (service id, backend id) pairs, from every conntrack map.
fn purge_departed_flows(maps: &mut Maps, gone: &HashSet<(u32, u32)>) -> Result<usize, MapsError> {
    let mut purged = 0;
    let departed_flow = |v: &CtValue| gone.contains(&(v.service_id, v.backend_id));
    for (name, map) in [
        (map_names::CONNTRACK, &mut maps.conntrack),
        (map_names::CT_NEW, &mut maps.ct_new),
    ] {
        let doomed = batch::keys_where(map.map(), batch::CHUNK, |k: &CtKey, v: &CtValue| {
            k.proto != PROTO_TCP && departed_flow(v)
        })
        .map_err(batch_error(name))?;
        for key in doomed {
            // Looked at again: the datapath may have replaced the entry with
            // a new flow's on the same tuple since the pass above. Few are
            // doomed, so this costs little next to the pass.
            let still = map.get(&key, 0).is_ok_and(|v| departed_flow(&v));
            if still && map.remove(&key).is_ok() {
                purged += 1;
            }
        }
    }
    for (name, map) in [
        (map_names::CONNTRACK6, &mut maps.conntrack6),
        (map_names::CT_NEW6, &mut maps.ct_new6),
    ] {
        let Some(map) = map else {
            continue;
        };
        let departed_flow = |v: &Ct6Value| gone.contains(&(v.service_id, v.backend_id));
        let doomed = batch::keys_where(map.map(), batch::CHUNK, |k: &Ct6Key, v: &Ct6Value| {
            k.proto != PROTO_TCP && departed_flow(v)
        })
        .map_err(batch_error(name))?;
        for key in doomed {
            // Looked at again, as above.
            let still = map.get(&key, 0).is_ok_and(|v| departed_flow(&v));
            if still && map.remove(&key).is_ok() {
                purged += 1;
            }
        }
    }
    Ok(purged)
}

/// Removes conntrack entries idle past their timeout, assured or not. Each
/// map is read in chunks, and each chunk's expired entries are handed to
/// the datapath's `ct_reap` (`reap`), which removes each only if it is
/// still expired: a new flow may have taken an expired entry's tuple since
/// the chunk was read, and a removal by key would take its fresh entry
/// with it (docs/architecture.md, "Conntrack's reaper"). The clients' live
/// assured flows are counted into `tally` from the same chunks of
/// `CONNTRACK` and `CONNTRACK6` (`ct_sources`), which spares a second pass
/// over each.
pub fn reap_expired(
    maps: &mut Maps,
    reap: &CtReap,
    now_ns: u64,
    tally: &mut Tally,
) -> Result<usize, MapsError> {
    let timeouts = maps.ct_timeouts()?;
    let mut reaped = 0;
    let mut failed = None;
    for (name, which, map, tally) in [
        (
            map_names::CONNTRACK,
            ct_reap::map::CONNTRACK,
            maps.conntrack.map(),
            Some(&mut tally.v4),
        ),
        (
            map_names::CT_NEW,
            ct_reap::map::CT_NEW,
            maps.ct_new.map(),
            None,
        ),
    ] {
        match reap_map::<u32>(name, which, map, reap, now_ns, &timeouts, tally) {
            Ok(n) => reaped += n,
            Err(e) => failed = Some(e),
        }
    }
    for (name, which, map, tally) in [
        (
            map_names::CONNTRACK6,
            ct_reap::map::CONNTRACK6,
            &maps.conntrack6,
            Some(&mut tally.v6),
        ),
        (
            map_names::CT_NEW6,
            ct_reap::map::CT_NEW6,
            &maps.ct_new6,
            None,
        ),
    ] {
        let Some(map) = map else {
            continue;
        };
        match reap_map::<[u32; 4]>(name, which, map.map(), reap, now_ns, &timeouts, tally) {
            Ok(n) => reaped += n,
            Err(e) => failed = Some(e),
        }
    }
    if reaped > 0 {
        maps.bump_flow_epoch()?;
    }
    failed.map_or(Ok(reaped), Err)
}

/// `reap_expired` for one conntrack map, `name` (`which` to `ct_reap`),
/// its chunks counted into `tally` too where there is one, which is told
/// when the map was read whole.
fn reap_map<A>(
    name: &'static str,
    which: u32,
    map: &MapData,
    reap: &CtReap,
    now_ns: u64,
    timeouts: &CtTimeouts,
    mut tally: Option<&mut FamilyTally<A>>,
) -> Result<usize, MapsError>
where
    A: Copy + Eq + Hash,
    CtKeyOf<A>: bytemuck::Pod,
    CtValueOf<A>: bytemuck::Pod,
{
    let batch_error = batch_error(name);
    let mut reaped = 0;
    let mut failed = None;
    let mut doomed: Vec<CtKeyOf<A>> = Vec::with_capacity(batch::CHUNK);
    batch::for_each_chunk(
        map,
        batch::CHUNK,
        |keys: &[CtKeyOf<A>], values: &[CtValueOf<A>]| {
            if let Some(tally) = tally.as_deref_mut() {
                tally.add(keys, values, now_ns, timeouts);
            }
            doomed.clear();
            doomed.extend(
                keys.iter()
                    .zip(values)
                    .filter(|(k, v)| v.expired(k.proto, now_ns, timeouts))
                    .map(|(k, _)| *k),
            );
            match reap.remove_expired(which, &doomed, now_ns) {
                Ok(n) => reaped += n,
                Err(e) => failed = Some(MapsError::from(e)),
            }
        },
    )
    .map_err(&batch_error)?;
    if let Some(tally) = tally {
        tally.mark_whole();
    }
    failed.map_or(Ok(reaped), Err)
}

#[cfg(test)]
mod tests {
    use proxy_common::{Backend, PROTO_SCTP, PROTO_UDP, v4_mapped};

    use super::*;

    fn departed(proto: Option<u8>) -> Departed {
        Departed {
            service_id: 7,
            backend_id: 9,
            backend: proto.map(|proto| Backend {
                addr_be: v4_mapped(0x0a01_0002_u32.to_be()),
                port_be: 8080u16.to_be(),
                proto,
                flags: 0,
            }),
        }
    }

    #[test]
    fn conntrack_is_passed_over_only_for_backends_whose_flows_go() {
        let tcp = departed(Some(PROTO_TCP));
        assert!(
            !flows_to_remove(&[tcp, tcp]),
            "departed TCP backends leave their flows: no pass over conntrack"
        );
        for (what, other) in [
            ("a UDP backend", departed(Some(PROTO_UDP))),
            ("an SCTP backend", departed(Some(PROTO_SCTP))),
            ("a backend the planner no longer knows", departed(None)),
        ] {
            assert!(
                flows_to_remove(&[tcp, other]),
                "{what} among departed TCP ones: its flows must be looked for"
            );
        }
    }
}
