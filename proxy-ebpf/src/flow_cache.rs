//! The per-CPU flow cache in front of conntrack: a packet of an established
//! flow finds a copy of its entry with an inline array lookup, where the
//! conntrack hash lookup is a call into the kernel. When a copy is good,
//! and who invalidates it, is `proxy_common::FlowCacheEntry`'s contract.
//! IPv6 flows have a cache of their own, `FLOW_CACHE6`, under the same
//! contract and the same counters (`FLOW_GEN`): a shared map would need a
//! family in every key, and IPv4's copies would grow by the 16-byte
//! addresses they never use.

use core::intrinsics::AtomicOrdering;

use proxy_common::{
    Ct6Key, Ct6Value, CtKey, CtValue, FLOW_GEN_EPOCH, FlowCacheEntry, ct_flags, ct_timeout,
    flow_cache_slot, flow_cache6_slot,
};

use crate::{
    maps::{FLOW_CACHE, FLOW_CACHE6, FLOW_GEN, ct_timeouts},
    packet::{Flow, TCP_FIN, TCP_RST, TCP_SYN},
};

/// Where a flow's copy lives, and the invalidation counters as they were
/// before its conntrack lookup: a copy taken from that lookup records these,
/// so that an invalidation racing with the lookup still voids it.
pub struct Stamp {
    slot: u32,
    slot_gen: u32,
    epoch: u32,
    /// False for packets that neither use nor take a copy (TCP SYN, FIN,
    /// RST: they create, close or remove entries). Their counters are not
    /// read: for a new flow's SYN that saves a cache miss on its slot's.
    usable: bool,
}

#[inline(always)]
fn generation(index: u32) -> u32 {
    // SAFETY: a valid array value pointer for this program's run; a racing
    // writer only ever adds to it. The low half is kept: a copy lives for a
    // second, far too short for 2^32 invalidations to wrap it round.
    FLOW_GEN
        .get_ptr(index)
        .map_or(0, |p| unsafe { core::ptr::read_volatile(p) } as u32)
}

#[inline(always)]
pub fn stamp(key: &CtKey, flow: &Flow) -> Stamp {
    stamp_slot(flow_cache_slot(key), flow.tcp_flags)
}

/// `stamp` of an IPv6 flow.
#[inline(always)]
pub fn stamp6(key: &Ct6Key, tcp_flags: u8) -> Stamp {
    stamp_slot(flow_cache6_slot(key), tcp_flags)
}

#[inline(always)]
fn stamp_slot(slot: u32, tcp_flags: u8) -> Stamp {
    if tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) != 0 {
        return Stamp {
            slot,
            slot_gen: 0,
            epoch: 0,
            usable: false,
        };
    }
    Stamp {
        slot,
        slot_gen: generation(slot),
        epoch: generation(FLOW_GEN_EPOCH),
        usable: true,
    }
}

/// This CPU's copy of `key`'s conntrack entry, when it is still good for
/// this packet.
#[inline(always)]
pub fn get(key: &CtKey, stamp: &Stamp, now: u64) -> Option<CtValue> {
    if !stamp.usable {
        return None;
    }
    // SAFETY: this CPU's slot; only programs on this CPU write it, and they
    // do not run nested.
    let copy = unsafe { &*FLOW_CACHE.get_ptr(stamp.slot)? };
    let good = copy.key == *key
        && copy.slot_gen == stamp.slot_gen
        && copy.epoch == stamp.epoch
        && now.wrapping_sub(copy.value.last_seen_ns) < ct_timeout::REFRESH_NS;
    good.then_some(copy.value)
}

/// Keeps a copy of `entry`, just found live in conntrack for `key`. Closing
/// flows are not copied (their next packets change or remove the entry),
/// nor entries that could expire while a copy is good.
#[inline(always)]
pub fn put(key: &CtKey, stamp: &Stamp, entry: &CtValue, now: u64) {
    if !stamp.usable
        || entry.flags & ct_flags::CLOSING != 0
        || entry.expired(key.proto, now + 2 * ct_timeout::REFRESH_NS, &ct_timeouts())
    {
        return;
    }
    if let Some(slot) = FLOW_CACHE.get_ptr_mut(stamp.slot) {
        // SAFETY: as in `get`.
        unsafe {
            *slot = FlowCacheEntry {
                key: *key,
                value: CtValue {
                    last_seen_ns: now,
                    ..*entry
                },
                slot_gen: stamp.slot_gen,
                epoch: stamp.epoch,
            }
        };
    }
}

/// This CPU's copy of the IPv6 `key`'s entry, when it is still good for
/// this packet: a pointer into this CPU's `FLOW_CACHE6` slot, valid for
/// this program's run, rather than a copy on `tc_ingress6`'s stack.
#[inline(always)]
pub fn get6(key: &Ct6Key, stamp: &Stamp, now: u64) -> Option<*const Ct6Value> {
    if !stamp.usable {
        return None;
    }
    // SAFETY: as in `get`.
    let copy = unsafe { &*FLOW_CACHE6.get_ptr(stamp.slot)? };
    let good = same6(&copy.key, key)
        && copy.slot_gen == stamp.slot_gen
        && copy.epoch == stamp.epoch
        && now.wrapping_sub(copy.value.last_seen_ns) < ct_timeout::REFRESH_NS;
    good.then_some(&raw const copy.value)
}

/// Whether two IPv6 keys are equal, in a few register operations: `==`
/// on their address arrays may become a call to `bcmp`.
#[inline(always)]
fn same6(a: &Ct6Key, b: &Ct6Key) -> bool {
    let mut diff = 0;
    for i in 0..4 {
        diff |= (a.src_be[i] ^ b.src_be[i]) | (a.dst_be[i] ^ b.dst_be[i]);
    }
    diff == 0 && a.sport_be == b.sport_be && a.dport_be == b.dport_be && a.proto == b.proto
}

/// `put` of an IPv6 flow: keeps a copy of `*entry`, an assured entry of
/// `CONNTRACK6` just found live for `key`, as refreshed by this packet.
#[inline(always)]
pub fn put6(key: &Ct6Key, stamp: &Stamp, entry: *const Ct6Value, now: u64) {
    if !stamp.usable {
        return;
    }
    // SAFETY: a valid map value pointer for this program's run.
    let entry = unsafe { &*entry };
    if entry.flags & ct_flags::CLOSING != 0
        || entry.expired(key.proto, now + 2 * ct_timeout::REFRESH_NS, &ct_timeouts())
    {
        return;
    }
    if let Some(slot) = FLOW_CACHE6.get_ptr_mut(stamp.slot) {
        // SAFETY: as in `get`. Written field by field: a whole
        // `FlowCache6Entry` built first would take 112 bytes of a stack
        // that has no room for them.
        unsafe {
            (*slot).key = *key;
            (*slot).value = *entry;
            (*slot).value.last_seen_ns = now;
            (*slot).slot_gen = stamp.slot_gen;
            (*slot).epoch = stamp.epoch;
        }
    }
}

/// Voids every CPU's copy of `key`'s entry: called once the datapath has
/// removed or overwritten that entry.
#[inline(always)]
pub fn invalidate(key: &CtKey) {
    bump_slot(flow_cache_slot(key));
}

/// `invalidate` of an IPv6 flow's entry.
#[inline(always)]
pub fn invalidate6(key: &Ct6Key) {
    bump_slot(flow_cache6_slot(key));
}

#[inline(always)]
fn bump_slot(slot: u32) {
    if let Some(p) = FLOW_GEN.get_ptr_mut(slot) {
        // SAFETY: a valid, aligned array value pointer, shared by all CPUs:
        // an atomic add (BPF_XADD), since a lost increment could leave a
        // stale copy good. Rust's BPF target offers no atomic read-modify-
        // write types, so the intrinsic.
        unsafe { core::intrinsics::atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, 1) };
    }
}
