//! Per-flow state of IPv6 flows, in `CONNTRACK6`: both directions of a
//! translated flow have an entry, as in `conntrack`, with the same states
//! and timeouts (`proxy_common::idle_timeout_ns`). One map holds the flows
//! assured or not (`ct_flags::ASSURED` is set in place), where IPv4 keeps
//! two so that a flood of new flows cannot evict assured ones: the IPv6
//! flood guard is later work, and one map keeps this program's stack and
//! instruction count small.

use proxy_common::{Ct6Key, Ct6Value, PROTO_TCP, counter, ct_dir, ct_flags, ct_timeout};

use crate::{
    maps::{CONNTRACK6, count, ct_timeouts},
    nat6::Nat6,
    packet::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    packet6::Flow6,
};

const BPF_ANY: u64 = 0;

#[inline(always)]
pub fn flow_key(flow: &Flow6) -> Ct6Key {
    Ct6Key::new(
        flow.src_be,
        flow.dst_be,
        flow.sport_be,
        flow.dport_be,
        flow.proto,
    )
}

/// The live entry for this packet's tuple, if any. An expired entry counts
/// as absent; so does a closing TCP entry hit by a SYN (its ports are being
/// reused by a new connection, see `conntrack::lookup`), which is removed.
/// The entry is read in place, never copied: this program's stack holds
/// little more than one `Ct6Value`.
#[inline(always)]
pub fn lookup(key: &Ct6Key, flow: &Flow6, now: u64) -> Option<*mut Ct6Value> {
    let ptr = CONNTRACK6.get_ptr_mut(key)?;
    // SAFETY: a valid map value pointer for the duration of this program.
    let entry = unsafe { &*ptr };
    if entry.expired(flow.proto, now, &ct_timeouts()) {
        return None;
    }
    if flow.proto == PROTO_TCP
        && entry.flags & ct_flags::CLOSING != 0
        && flow.tcp_flags & (TCP_SYN | TCP_RST) == TCP_SYN
    {
        let _ = CONNTRACK6.remove(key);
        return None;
    }
    Some(ptr)
}

/// What a packet of a known flow becomes.
#[inline(always)]
pub fn translation(entry: &Ct6Value, flow: &Flow6) -> Nat6 {
    let two_sided = entry.flags & ct_flags::TWO_SIDED != 0;
    let mut nat = Nat6::identity(flow);
    if entry.dir == ct_dir::FORWARD {
        nat.dst_be = entry.nat_addr_be;
        nat.dport_be = entry.nat_port_be;
        if two_sided {
            nat.src_be = entry.alt_addr_be;
            nat.sport_be = entry.alt_port_be;
        }
    } else {
        nat.src_be = entry.nat_addr_be;
        nat.sport_be = entry.nat_port_be;
        if two_sided {
            nat.dst_be = entry.alt_addr_be;
            nat.dport_be = entry.alt_port_be;
        }
    }
    nat
}

/// Records what this packet tells about its flow: a reply makes it
/// established; its client's direction after a reply (not a SYN, FIN or
/// RST; a TCP ACK) assures it, as `conntrack::touch_unassured`; FIN or RST
/// starts closing. State changes are copied to the other direction's entry,
/// so both age alike; timestamps are refreshed at most once a second.
#[inline(always)]
pub fn touch(ptr: *mut Ct6Value, flow: &Flow6, nat: &Nat6, now: u64) {
    // SAFETY: a valid map value pointer for the duration of this program.
    let entry = unsafe { &*ptr };
    let old_flags = entry.flags;
    let mut flags = old_flags;
    if entry.dir == ct_dir::REPLY {
        flags |= ct_flags::SEEN_REPLY;
    } else if flags & ct_flags::SEEN_REPLY != 0
        && flow.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) == 0
        && (flow.proto != PROTO_TCP || flow.tcp_flags & TCP_ACK != 0)
    {
        flags |= ct_flags::ASSURED;
    }
    if flow.proto == PROTO_TCP && flow.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        flags |= ct_flags::CLOSING;
    }
    let stale = now.saturating_sub(entry.last_seen_ns) > ct_timeout::REFRESH_NS;
    if flags == old_flags && !stale {
        return;
    }
    // SAFETY: as in `lookup`; racing writers only store equal or newer
    // values of monotonic fields.
    unsafe {
        (*ptr).flags = flags;
        (*ptr).last_seen_ns = now;
    }
    if flags & ct_flags::ASSURED != 0 && old_flags & ct_flags::ASSURED == 0 {
        count(counter::CT_ASSURED);
    }
    if flags != old_flags {
        // The other direction's entry: this packet's translation, reversed.
        let peer = Ct6Key::new(
            nat.dst_be,
            nat.src_be,
            nat.dport_be,
            nat.sport_be,
            flow.proto,
        );
        if let Some(p) = CONNTRACK6.get_ptr_mut(&peer) {
            // SAFETY: a pointer the map lookup returned, valid for this
            // program's run.
            unsafe {
                (*p).flags |=
                    flags & (ct_flags::CLOSING | ct_flags::SEEN_REPLY | ct_flags::ASSURED);
                (*p).last_seen_ns = now;
            }
        }
    }
}

/// Creates both entries of a new flow of `flow` (client -> frontend), whose
/// first packet becomes `nat`: the
/// reply entry first, so that once packets are translated their answers
/// already find their way back. Both overwrite what the map holds for their
/// keys: the packet's own, which its lookup just found absent, expired or
/// removed, and a flow of another client port clashing on the backend side,
/// where the older flow loses.
#[inline(always)]
pub fn create(flow: &Flow6, nat: &Nat6, backend_id: u32, service_id: u32, now: u64) {
    // One value, made the reply entry and then the forward one: two would
    // take 64 more bytes of stack.
    let mut value = Ct6Value {
        nat_addr_be: flow.dst_be,
        alt_addr_be: flow.src_be,
        nat_port_be: flow.dport_be,
        alt_port_be: flow.sport_be,
        flags: 0,
        dir: ct_dir::REPLY,
        _pad: 0,
        backend_id,
        service_id,
        created_ns: now,
        last_seen_ns: now,
    };
    let mut key = Ct6Key::new(
        nat.dst_be,
        nat.src_be,
        nat.dport_be,
        nat.sport_be,
        flow.proto,
    );
    let mut failed = CONNTRACK6.insert(&key, &value, BPF_ANY).is_err();
    value.nat_addr_be = nat.dst_be;
    value.alt_addr_be = nat.src_be;
    value.nat_port_be = nat.dport_be;
    value.alt_port_be = nat.sport_be;
    value.dir = ct_dir::FORWARD;
    key = flow_key(flow);
    failed |= CONNTRACK6.insert(&key, &value, BPF_ANY).is_err();
    if failed {
        count(counter::CT_INSERT_FAILED);
    }
    count(counter::CT_NEW_FLOW);
}
