//! Per-flow state: both directions of a translated flow have an entry, so a
//! packet needs one lookup whichever way it goes.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use proxy_common::{
    CtKey, CtValue, HAIRPIN_ADDR, PROTO_TCP, counter, ct_dir, ct_flags, ct_timeout, v4_mapped,
};

use crate::{
    maps::{CONNTRACK, count, ct_timeouts},
    packet::{Flow, TCP_FIN, TCP_RST, TCP_SYN},
};

#[inline(always)]
pub fn now_ns() -> u64 {
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
pub fn key(src_be: u32, dst_be: u32, sport_be: u16, dport_be: u16, proto: u8) -> CtKey {
    CtKey {
        src_be: v4_mapped(src_be),
        dst_be: v4_mapped(dst_be),
        sport_be,
        dport_be,
        proto,
        _pad: [0; 3],
    }
}

#[inline(always)]
pub fn flow_key(flow: &Flow) -> CtKey {
    key(
        flow.src_be,
        flow.dst_be,
        flow.sport_be,
        flow.dport_be,
        flow.proto,
    )
}

/// The live entry for this packet's tuple, if any. An expired entry counts
/// as absent. So does a closing TCP entry hit by a SYN or SYN-ACK: the ports
/// are being reused by a new connection, which may not be ours at all (a
/// client connecting straight to a pod from the port it just used for the
/// service); the stale entry is removed so its replies go untranslated.
#[inline(always)]
pub fn lookup(flow: &Flow, now: u64) -> Option<(*mut CtValue, CtValue)> {
    let key = flow_key(flow);
    let ptr = CONNTRACK.get_ptr_mut(key)?;
    // SAFETY: a valid map value pointer for the duration of this program.
    let entry = unsafe { *ptr };
    if entry.expired(flow.proto, now, &ct_timeouts()) {
        return None;
    }
    if flow.proto == PROTO_TCP
        && entry.flags & ct_flags::CLOSING != 0
        && flow.tcp_flags & (TCP_SYN | TCP_RST) == TCP_SYN
    {
        let _ = CONNTRACK.remove(key);
        return None;
    }
    Some((ptr, entry))
}

/// Records what this packet tells about the flow: a reply makes it
/// established, FIN/RST starts closing. Timestamps are refreshed at most once
/// a second to spare a write per packet.
#[inline(always)]
pub fn touch(ptr: *mut CtValue, entry: &CtValue, flow: &Flow, now: u64) {
    let mut flags = entry.flags;
    if entry.dir == ct_dir::REPLY {
        flags |= ct_flags::SEEN_REPLY;
    }
    if flow.proto == PROTO_TCP && flow.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        flags |= ct_flags::CLOSING;
    }
    let stale = now.saturating_sub(entry.last_seen_ns) > ct_timeout::REFRESH_NS;
    if flags != entry.flags || stale {
        // SAFETY: as in `lookup`; racing writers only store equal or newer
        // values of monotonic fields.
        unsafe {
            (*ptr).flags = flags;
            (*ptr).last_seen_ns = now;
        }
    }
    if flags != entry.flags {
        mirror_flags(entry, flow, flags, now);
    }
}

/// Copies state changes to the entry of the other direction, so that both
/// age the same way.
#[inline(always)]
fn mirror_flags(entry: &CtValue, flow: &Flow, flags: u8, now: u64) {
    // The other direction's tuple: the translated address and port swap in
    // for this packet's destination (forward) or source (reply).
    let hairpin = entry.flags & ct_flags::HAIRPIN != 0;
    let peer = if entry.dir == ct_dir::FORWARD {
        CtKey {
            src_be: entry.nat_addr_be,
            dst_be: v4_mapped(if hairpin { hairpin_addr() } else { flow.src_be }),
            sport_be: entry.nat_port_be,
            dport_be: flow.sport_be,
            proto: flow.proto,
            _pad: [0; 3],
        }
    } else {
        CtKey {
            src_be: v4_mapped(if hairpin { flow.src_be } else { flow.dst_be }),
            dst_be: entry.nat_addr_be,
            sport_be: flow.dport_be,
            dport_be: entry.nat_port_be,
            proto: flow.proto,
            _pad: [0; 3],
        }
    };
    if let Some(p) = CONNTRACK.get_ptr_mut(peer) {
        unsafe {
            (*p).flags |= flags;
            (*p).last_seen_ns = now;
        }
    }
}

/// The hairpin source address as it sits in a packet.
#[inline(always)]
pub fn hairpin_addr() -> u32 {
    u32::from_ne_bytes(HAIRPIN_ADDR)
}

/// Creates both entries of a new flow from `flow` (client -> frontend) to
/// the backend at `backend_addr`:`backend_port`. A hairpin flow's backend
/// answers the hairpin address instead of the client.
#[inline(always)]
pub fn create(
    flow: &Flow,
    backend_addr_be: [u32; 4],
    backend_port_be: u16,
    backend_id: u32,
    service_id: u32,
    hairpin: bool,
    now: u64,
) {
    let client = v4_mapped(if hairpin { hairpin_addr() } else { flow.src_be });
    let forward = CtValue {
        nat_addr_be: backend_addr_be,
        nat_port_be: backend_port_be,
        flags: if hairpin { ct_flags::HAIRPIN } else { 0 },
        dir: ct_dir::FORWARD,
        backend_id,
        service_id,
        _pad1: 0,
        created_ns: now,
        last_seen_ns: now,
    };
    let reply = CtValue {
        nat_addr_be: v4_mapped(flow.dst_be),
        nat_port_be: flow.dport_be,
        dir: ct_dir::REPLY,
        ..forward
    };
    let reply_key = CtKey {
        src_be: backend_addr_be,
        dst_be: client,
        sport_be: backend_port_be,
        dport_be: flow.sport_be,
        proto: flow.proto,
        _pad: [0; 3],
    };
    // Reply entry first: once the forward entry exists, packets are
    // translated, and their answers must already find their way back.
    if CONNTRACK.insert(reply_key, reply, 0).is_err()
        || CONNTRACK.insert(flow_key(flow), forward, 0).is_err()
    {
        count(counter::CT_INSERT_FAILED);
    }
}
