//! The per-CPU flow cache in front of conntrack: a packet of an established
//! flow finds a copy of its entry with an inline array lookup, where the
//! conntrack hash lookup is a call into the kernel. When a copy is good,
//! and who invalidates it, is `proxy_common::FlowCacheEntry`'s contract.
//! IPv6 flows have a cache of their own, `FLOW_CACHE6`, under the same
//! contract and the same counters (`FLOW_GEN`): a shared map would need a
//! family in every key, and IPv4's copies would grow by the 16-byte
//! addresses they never use. Written once over the family (`Family`).

use core::intrinsics::AtomicOrdering;

use proxy_common::{
    CtKeyOf, CtValueOf, FLOW_CACHE_ABSENT, FLOW_GEN_EPOCH, FlowAddr, ct_flags, ct_timeout,
    flow_cache_slot,
};

use crate::{
    family::Family,
    maps::{FLOW_GEN, expired},
    packet::{TCP_FIN, TCP_RST, TCP_SYN},
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

/// The stamp of a packet with `tcp_flags` of `key`'s flow.
#[inline(always)]
pub fn stamp<A: FlowAddr>(key: &CtKeyOf<A>, tcp_flags: u8) -> Stamp {
    stamp_slot(flow_cache_slot(key), tcp_flags)
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

/// What this CPU's cache says of a packet's flow.
pub enum Cached<A> {
    /// A good copy of its entry: a pointer into this CPU's slot, valid for
    /// this program's run, rather than a copy on the stack.
    Copy(*const CtValueOf<A>),
    /// An absent copy (`proxy_common::FLOW_CACHE_ABSENT`): conntrack had
    /// no live entry for it when this CPU last asked, and no flow has been
    /// created for it since.
    Absent,
    /// Nothing good: conntrack is asked.
    Unknown,
}

/// This CPU's word on `key`'s conntrack entry, when it is still good for
/// this packet.
#[inline(always)]
pub fn get<F: Family>(key: &CtKeyOf<F::Addr>, stamp: &Stamp, now: u64) -> Cached<F::Addr> {
    if !stamp.usable {
        return Cached::Unknown;
    }
    let Some(copy) = F::flow_cache().get_ptr(stamp.slot) else {
        return Cached::Unknown;
    };
    // SAFETY: this CPU's slot; only programs on this CPU write it, and they
    // do not run nested.
    let copy = unsafe { &*copy };
    // The protocol apart: its high bit tells an absent copy from a copy of
    // an entry.
    let good = copy.key.same_ends(key)
        && copy.slot_gen == stamp.slot_gen
        && copy.epoch == stamp.epoch
        && now.wrapping_sub(copy.value.last_seen_ns) < ct_timeout::REFRESH_NS;
    if !good {
        Cached::Unknown
    } else if copy.key.proto == key.proto {
        Cached::Copy(&raw const copy.value)
    } else if copy.key.proto == key.proto ^ FLOW_CACHE_ABSENT {
        Cached::Absent
    } else {
        Cached::Unknown
    }
}

/// Keeps an absent copy of `key` (`proxy_common::FLOW_CACHE_ABSENT`):
/// conntrack, asked after `stamp` was read, had no live entry for it. A
/// flow created for it since bumps its slot (`invalidate`), which voids
/// the copy.
#[inline(always)]
pub fn put_absent<F: Family>(key: &CtKeyOf<F::Addr>, stamp: &Stamp, now: u64) {
    if !stamp.usable {
        return;
    }
    if let Some(slot) = F::flow_cache().get_ptr_mut(stamp.slot) {
        // SAFETY: as in `get`.
        unsafe {
            (*slot).key = *key;
            (*slot).key.proto = key.proto ^ FLOW_CACHE_ABSENT;
            (*slot).value.last_seen_ns = now;
            (*slot).slot_gen = stamp.slot_gen;
            (*slot).epoch = stamp.epoch;
        }
    }
}

/// Keeps a copy of `*entry`, an assured entry of `CONNTRACK` just found
/// live for `key`, as this packet left it. Closing flows are not copied
/// (their next packets change or remove the entry), nor entries that could
/// expire while a copy is good.
#[inline(always)]
pub fn put<F: Family>(
    key: &CtKeyOf<F::Addr>,
    stamp: &Stamp,
    entry: *const CtValueOf<F::Addr>,
    now: u64,
) {
    if !stamp.usable {
        return;
    }
    // SAFETY: a valid map value pointer for this program's run.
    let entry = unsafe { &*entry };
    if entry.flags & ct_flags::CLOSING != 0
        || expired(entry, key.proto, now + 2 * ct_timeout::REFRESH_NS)
    {
        return;
    }
    if let Some(slot) = F::flow_cache().get_ptr_mut(stamp.slot) {
        // SAFETY: as in `get`; the entry is `CONNTRACK`'s, another map's
        // memory than the slot's. Written field by field: a whole entry
        // built first would take its size again on the stack (112 bytes for
        // IPv6), which has no room for it. The value copied, not assigned:
        // see `conntrack::translation`.
        unsafe {
            (*slot).key = *key;
            core::ptr::copy_nonoverlapping(entry, &raw mut (*slot).value, 1);
            (*slot).value.last_seen_ns = now;
            (*slot).slot_gen = stamp.slot_gen;
            (*slot).epoch = stamp.epoch;
        }
    }
}

/// Voids every CPU's copy of `key`'s entry: called once the datapath has
/// removed or overwritten that entry, or created it (voiding absent
/// copies).
#[inline(always)]
pub fn invalidate<A: FlowAddr>(key: &CtKeyOf<A>) {
    bump_slot(flow_cache_slot(key));
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
