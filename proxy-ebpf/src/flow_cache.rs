//! The per-CPU flow cache in front of conntrack: a packet of an established
//! flow finds a copy of its entry with an inline array lookup, where the
//! conntrack hash lookup is a call into the kernel. When a copy is good,
//! and who invalidates it, is `proxy_common::FlowCacheEntry`'s contract.

use core::intrinsics::AtomicOrdering;

use proxy_common::{
    CtKey, CtValue, FLOW_GEN_EPOCH, FlowCacheEntry, ct_flags, ct_timeout, flow_cache_slot,
};

use crate::{
    maps::{FLOW_CACHE, FLOW_GEN, ct_timeouts},
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
    let slot = flow_cache_slot(key);
    if flow.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) != 0 {
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

/// Voids every CPU's copy of `key`'s entry: called once the datapath has
/// removed or overwritten that entry.
#[inline(always)]
pub fn invalidate(key: &CtKey) {
    if let Some(p) = FLOW_GEN.get_ptr_mut(flow_cache_slot(key)) {
        // SAFETY: a valid, aligned array value pointer, shared by all CPUs:
        // an atomic add (BPF_XADD), since a lost increment could leave a
        // stale copy good. Rust's BPF target offers no atomic read-modify-
        // write types, so the intrinsic.
        unsafe { core::intrinsics::atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, 1) };
    }
}
