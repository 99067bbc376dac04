//! Upgrades in place: an agent of a newer layout version starting on a root
//! where an older agent left its pins. The older program stays attached
//! through its pinned links and would go on translating ahead of this one,
//! with maps nobody updates; so once this agent's datapath is attached and
//! programmed, the older one is retired. Its conntrack is carried over
//! first where its layout is known, so established connections keep their
//! backends across the upgrade.

use std::path::{Path, PathBuf};

use aya::maps::{HashMap, Map, MapData, MapError};
use proxy_common::{CtKey, CtValue, is_v4_mapped, map_names};

use crate::datapath::{detach, maps::Maps, pins::PinLayout};

/// Backend and service ids of carried-over entries: the older agent's ids
/// mean nothing to this one's planner, so such flows are never swept as a
/// departed backend's; they finish or expire.
pub const CARRIED_ID: u32 = u32::MAX;

/// Conntrack key of layout version 2 (IPv4-mapped IPv6 addresses).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtKeyV2 {
    pub src_be: [u32; 4],
    pub dst_be: [u32; 4],
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// Conntrack value of layout version 2.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtValueV2 {
    pub nat_addr_be: [u32; 4],
    pub nat_port_be: u16,
    pub flags: u8,
    pub dir: u8,
    pub alt_addr_be: [u32; 4],
    pub alt_port_be: u16,
    pub _pad1: u16,
    pub backend_id: u32,
    pub service_id: u32,
    pub created_ns: u64,
    pub last_seen_ns: u64,
}

// SAFETY: plain `repr(C)` integers with explicit padding, as the kernel
// side wrote them.
unsafe impl aya::Pod for CtKeyV2 {}
// SAFETY: as for `CtKeyV2`.
unsafe impl aya::Pod for CtValueV2 {}

/// Conntrack value of layout versions 3 and 4: `created_ns` where today's
/// has the creation second and the highest acknowledgment number.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtValueV4 {
    pub nat_addr_be: u32,
    pub alt_addr_be: u32,
    pub nat_port_be: u16,
    pub alt_port_be: u16,
    pub flags: u8,
    pub dir: u8,
    pub path_mtu: u16,
    pub backend_id: u32,
    pub service_id: u32,
    pub created_ns: u64,
    pub last_seen_ns: u64,
}

// SAFETY: as for `CtKeyV2`.
unsafe impl aya::Pod for CtValueV4 {}

/// A version 3 or 4 entry in today's layout. Its flow's highest
/// acknowledgment numbers are not known (0: its next FIN or RST is taken as
/// inside the window, as before), and its `CLOSING` meant a FIN either way
/// or an RST: it closes in `tcp_close_ns`, as it would have.
pub fn from_v4(value: &CtValueV4) -> CtValue {
    CtValue {
        nat_addr_be: value.nat_addr_be,
        alt_addr_be: value.alt_addr_be,
        nat_port_be: value.nat_port_be,
        alt_port_be: value.alt_port_be,
        flags: value.flags,
        dir: value.dir,
        path_mtu: value.path_mtu,
        backend_id: CARRIED_ID,
        service_id: CARRIED_ID,
        created_s: secs(value.created_ns),
        tcp_max_ack: 0,
        last_seen_ns: value.last_seen_ns,
    }
}

fn secs(ns: u64) -> u32 {
    u32::try_from(ns / 1_000_000_000).unwrap_or(u32::MAX)
}

/// A version 2 entry in today's layout; None for an IPv6 flow, which today's
/// datapath does not handle.
pub fn from_v2(key: &CtKeyV2, value: &CtValueV2) -> Option<(CtKey, CtValue)> {
    let v4 = [key.src_be, key.dst_be, value.nat_addr_be, value.alt_addr_be];
    if !v4.iter().all(is_v4_mapped) {
        return None;
    }
    Some((
        CtKey::new(
            key.src_be[3],
            key.dst_be[3],
            key.sport_be,
            key.dport_be,
            key.proto,
        ),
        CtValue {
            nat_addr_be: value.nat_addr_be[3],
            alt_addr_be: value.alt_addr_be[3],
            nat_port_be: value.nat_port_be,
            alt_port_be: value.alt_port_be,
            flags: value.flags,
            dir: value.dir,
            path_mtu: 0,
            backend_id: CARRIED_ID,
            service_id: CARRIED_ID,
            created_s: secs(value.created_ns),
            tcp_max_ack: 0,
            last_seen_ns: value.last_seen_ns,
        },
    ))
}

/// What retiring one older layout did.
#[derive(Debug)]
pub struct Retired {
    pub dir: PathBuf,
    /// Conntrack entries carried over into this agent's map.
    pub flows: usize,
}

/// Retires every other layout under `pins`' root (see the module doc): the
/// older ones of an upgrade, or a newer one after a downgrade.
pub fn retire_older_layouts(pins: &PinLayout, maps: &mut Maps) -> Vec<Retired> {
    let mut retired = Vec::new();
    for dir in pins.other_layouts() {
        let conntrack = PinLayout::maps_in(&dir).join(map_names::CONNTRACK);
        let flows = match carry_conntrack(
            &conntrack,
            PinLayout::layout_version(&dir).unwrap_or(0),
            maps,
        ) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "older conntrack not carried over; its connections are balanced anew");
                0
            }
        };
        detach::detach_links_in(&PinLayout::links_in(&dir));
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => retired.push(Retired { dir, flows }),
            Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "removing an older layout"),
        }
    }
    // The carried flows' backends may be none of this agent's: their
    // replies pass the prefilter only once it holds the flows' keys.
    if retired.iter().any(|r| r.flows > 0)
        && let Err(e) = crate::datapath::prefilter_rebuild::rebuild(maps)
    {
        tracing::warn!(error = %e, "the prefilter not rebuilt after carrying older flows");
    }
    retired
}

/// Copies the pinned conntrack map of layout `version` at `path` into this
/// agent's: today's layout, version 3 and 4's (the same size as today's,
/// so told apart by the version alone), or version 2's. An entry this
/// agent's datapath already made for the same tuple is kept.
fn carry_conntrack(path: &Path, version: u32, maps: &mut Maps) -> Result<usize, MapError> {
    if !path.exists() {
        return Ok(0);
    }
    let open = || -> Result<Map, MapError> { Map::from_map_data(MapData::from_pin(path)?) };
    let v3_or_v4 = (3..=4).contains(&version);
    let entries: Vec<(CtKey, CtValue)> =
        if v3_or_v4 && let Ok(older) = HashMap::<_, CtKey, CtValueV4>::try_from(open()?) {
            older
                .iter()
                .flatten()
                .map(|(k, v)| (k, from_v4(&v)))
                .collect()
        } else if let Ok(older) = HashMap::<_, CtKey, CtValue>::try_from(open()?) {
            older
                .iter()
                .flatten()
                .map(|(k, v)| {
                    let carried = CtValue {
                        backend_id: CARRIED_ID,
                        service_id: CARRIED_ID,
                        ..v
                    };
                    (k, carried)
                })
                .collect()
        } else {
            let older = HashMap::<_, CtKeyV2, CtValueV2>::try_from(open()?)?;
            older
                .iter()
                .flatten()
                .filter_map(|(k, v)| from_v2(&k, &v))
                .collect()
        };
    Ok(crate::datapath::resize::carry_in(maps, entries))
}

#[cfg(test)]
mod tests {
    use proxy_common::{ct_dir, ct_flags, v4_mapped};

    use super::*;

    fn addr(a: [u8; 4]) -> u32 {
        u32::from_ne_bytes(a)
    }

    #[test]
    fn a_v2_ipv4_entry_keeps_its_translation() {
        let (client, vip, backend) = (
            addr([10, 0, 0, 2]),
            addr([10, 96, 0, 1]),
            addr([10, 1, 0, 5]),
        );
        let key = CtKeyV2 {
            src_be: v4_mapped(client),
            dst_be: v4_mapped(vip),
            sport_be: 40000u16.to_be(),
            dport_be: 80u16.to_be(),
            proto: 6,
            _pad: [0; 3],
        };
        let value = CtValueV2 {
            nat_addr_be: v4_mapped(backend),
            nat_port_be: 8080u16.to_be(),
            flags: ct_flags::SEEN_REPLY,
            dir: ct_dir::FORWARD,
            alt_addr_be: v4_mapped(client),
            alt_port_be: 40000u16.to_be(),
            _pad1: 0,
            backend_id: 7,
            service_id: 3,
            created_ns: 11_000_000_000 - 1,
            last_seen_ns: 22,
        };
        let (k, v) = from_v2(&key, &value).expect("an IPv4 flow");
        assert_eq!(
            k,
            CtKey::new(client, vip, 40000u16.to_be(), 80u16.to_be(), 6)
        );
        assert_eq!(
            (v.nat_addr_be, v.nat_port_be, v.alt_addr_be, v.alt_port_be),
            (backend, 8080u16.to_be(), client, 40000u16.to_be()),
            "translation changed"
        );
        assert_eq!(
            (v.flags, v.dir, v.created_s, v.last_seen_ns),
            (ct_flags::SEEN_REPLY, ct_dir::FORWARD, 10, 22),
            "state or timestamps changed"
        );
        assert_eq!((v.backend_id, v.service_id), (CARRIED_ID, CARRIED_ID));
        assert_eq!(
            (size_of::<CtKeyV2>(), size_of::<CtValueV2>()),
            (40, 64),
            "version 2's sizes"
        );
    }

    #[test]
    fn a_v4_entry_keeps_its_translation_and_knows_no_acknowledgment() {
        let value = CtValueV4 {
            nat_addr_be: addr([10, 1, 0, 5]),
            alt_addr_be: addr([10, 0, 0, 2]),
            nat_port_be: 8080u16.to_be(),
            alt_port_be: 40000u16.to_be(),
            flags: ct_flags::SEEN_REPLY | ct_flags::ASSURED | ct_flags::CLOSING,
            dir: ct_dir::REPLY,
            path_mtu: 1400,
            backend_id: 7,
            service_id: 3,
            created_ns: 5_500_000_000,
            last_seen_ns: 22,
        };
        let v = from_v4(&value);
        assert_eq!(
            (v.nat_addr_be, v.nat_port_be, v.alt_addr_be, v.alt_port_be),
            (
                value.nat_addr_be,
                value.nat_port_be,
                value.alt_addr_be,
                value.alt_port_be
            ),
            "translation changed"
        );
        assert_eq!(
            (v.flags, v.dir, v.path_mtu, v.last_seen_ns),
            (value.flags, value.dir, 1400, 22),
            "state changed"
        );
        assert_eq!(
            (v.created_s, v.tcp_max_ack),
            (5, 0),
            "creation second, no acknowledgment known"
        );
        assert_eq!(size_of::<CtValueV4>(), size_of::<CtValue>());
        assert_eq!(
            PinLayout::layout_version(Path::new("/sys/fs/bpf/ebpf-proxy/v4")),
            Some(4)
        );
        assert_eq!(
            PinLayout::layout_version(Path::new("/sys/fs/bpf/ebpf-proxy/maps")),
            None
        );
    }

    #[test]
    fn a_v2_ipv6_entry_is_left_behind() {
        let key = CtKeyV2 {
            src_be: [0x20010db8u32.to_be(), 0, 0, 1],
            dst_be: v4_mapped(addr([10, 96, 0, 1])),
            ..Default::default()
        };
        assert_eq!(from_v2(&key, &CtValueV2::default()), None);
    }
}
