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
//! Either removal is followed by a bump of the flow cache's epoch, which
//! voids the copies of entries that CPUs keep (`proxy_common::FlowCacheEntry`).

use std::collections::HashSet;

use aya::maps::MapError;
use proxy_common::{PROTO_TCP, map_names};

use super::maps::{Maps, MapsError};
use crate::planner::Departed;

/// What a sweep removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Swept {
    pub conntrack: usize,
    pub affinity: usize,
}

fn wrap(name: &'static str) -> impl FnOnce(MapError) -> MapsError {
    move |source| MapsError::Map { name, source }
}

/// CLOCK_MONOTONIC in ns: what the datapath clock (`proxy_common::Clock`)
/// reads.
pub fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}

/// Removes the UDP conntrack entries and the affinity entries of departed
/// backends. One pass over each map, only when something departed.
pub fn purge_departed(maps: &mut Maps, departed: &[Departed]) -> Result<Swept, MapsError> {
    let mut swept = Swept::default();
    if departed.is_empty() {
        return Ok(swept);
    }
    let gone: HashSet<Departed> = departed.iter().copied().collect();
    let mut doomed = Vec::new();
    for item in maps.conntrack.iter() {
        let (key, value) = item.map_err(wrap(map_names::CONNTRACK))?;
        if key.proto != PROTO_TCP
            && gone.contains(&Departed {
                service_id: value.service_id,
                backend_id: value.backend_id,
            })
        {
            doomed.push(key);
        }
    }
    for key in doomed {
        // Looked at again: the datapath may have replaced the entry with a new
        // flow's on the same tuple since the pass above.
        let still = maps.conntrack.get(&key, 0).is_ok_and(|v| {
            gone.contains(&Departed {
                service_id: v.service_id,
                backend_id: v.backend_id,
            })
        });
        if still && maps.conntrack.remove(&key).is_ok() {
            swept.conntrack += 1;
        }
    }
    let mut doomed = Vec::new();
    for item in maps.affinity.iter() {
        let (key, value) = item.map_err(wrap(map_names::AFFINITY))?;
        if gone.contains(&Departed {
            service_id: key.service_id,
            backend_id: value.backend_id,
        }) {
            doomed.push(key);
        }
    }
    if swept.conntrack > 0 {
        maps.bump_flow_epoch()?;
    }
    for key in doomed {
        if maps.affinity.remove(&key).is_ok() {
            swept.affinity += 1;
        }
    }
    Ok(swept)
}

/// Removes conntrack entries idle past their timeout.
pub fn reap_expired(maps: &mut Maps, now_ns: u64) -> Result<usize, MapsError> {
    let timeouts = maps.ct_timeouts()?;
    let mut doomed = Vec::new();
    for item in maps.conntrack.iter() {
        let (key, value) = item.map_err(wrap(map_names::CONNTRACK))?;
        if value.expired(key.proto, now_ns, &timeouts) {
            doomed.push(key);
        }
    }
    // Each is looked at again just before it goes: a new connection reusing
    // the tuple since the pass above has replaced the entry with a live one.
    let reaped = doomed
        .into_iter()
        .filter(|key| {
            maps.conntrack
                .get(key, 0)
                .is_ok_and(|v| v.expired(key.proto, now_ns, &timeouts))
                && maps.conntrack.remove(key).is_ok()
        })
        .count();
    if reaped > 0 {
        maps.bump_flow_epoch()?;
    }
    Ok(reaped)
}
