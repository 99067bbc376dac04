//! Per-flow state: both directions of a translated flow have an entry, so a
//! packet needs one lookup whichever way it goes.

use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_jiffies64, bpf_ktime_get_coarse_ns};
use proxy_common::{
    Clock, CtKey, CtValue, HAIRPIN_ADDR, PROTO_TCP, clock_slot, counter, ct_dir, ct_flags,
    ct_timeout, slot_for,
};

use crate::{
    flow_cache,
    maps::{CLOCK, CONNTRACK, count, ct_timeouts},
    nat::Nat,
    packet::{Flow, TCP_FIN, TCP_RST, TCP_SYN},
};

const BPF_ANY: u64 = 0;
const BPF_NOEXIST: u64 = 1;
/// Tries at a free SNAT port before a new flow is dropped.
const SNAT_TRIES: u32 = 16;
/// A closed TCP flow (FIN or RST seen) gives its SNAT port up after this
/// long without packets, well before its entry expires: otherwise every
/// short connection would hold a port for the whole closing timeout, and a
/// few thousand connections a second to one backend would use the range up.
/// The same trade as Linux's `tcp_tw_reuse` (1 s): a straggler of the old
/// flow arriving later than this could be taken for the new one.
const SNAT_CLOSED_REUSE_NS: u64 = 1_000_000_000;

/// The clock of conntrack and affinity timestamps: CLOCK_MONOTONIC to
/// within a kernel tick, ample for timeouts of seconds and the same base the
/// agent's reaper reads. Scaled from jiffies, which the JIT reads inline,
/// once the agent has calibrated the scale (see `Clock`); until then the
/// coarse clock, a helper call.
#[inline(always)]
pub fn now_ns() -> u64 {
    match CLOCK.get_ptr(clock_slot::IN_FORCE) {
        // SAFETY: a valid array value pointer for this program's run.
        Some(clock) if unsafe { (*clock).tick_ns } != 0 => unsafe { (*clock).at(bpf_jiffies64()) },
        _ => unsafe { bpf_ktime_get_coarse_ns() },
    }
}

/// Leaves a reading of both clocks in `CLOCK[SAMPLE]` (see `Clock`).
#[inline(always)]
pub fn sample_clocks() {
    let sample = Clock {
        // Jiffies first: the coarse clock is read as of the tick that set
        // them or a later one, never an earlier one.
        jiffies: unsafe { bpf_jiffies64() },
        ns: unsafe { bpf_ktime_get_coarse_ns() },
        tick_ns: 0,
    };
    if let Some(slot) = CLOCK.get_ptr_mut(clock_slot::SAMPLE) {
        // SAFETY: as above; only the agent's probe runs write this slot.
        unsafe { *slot = sample };
    }
}

#[inline(always)]
pub fn key(src_be: u32, dst_be: u32, sport_be: u16, dport_be: u16, proto: u8) -> CtKey {
    CtKey::new(src_be, dst_be, sport_be, dport_be, proto)
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
pub fn lookup(key: &CtKey, flow: &Flow, now: u64) -> Option<(*mut CtValue, CtValue)> {
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
        remove(key);
        return None;
    }
    Some((ptr, entry))
}

/// What a packet of a known flow becomes.
#[inline(always)]
pub fn translation(entry: &CtValue, flow: &Flow) -> Nat {
    let two_sided = entry.flags & ct_flags::TWO_SIDED != 0;
    let mut nat = Nat::identity(flow);
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
    nat.redirect = entry.flags & ct_flags::REDIRECT != 0;
    nat
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
        let peer = mirror_flags(
            entry,
            flow,
            flags & (ct_flags::CLOSING | ct_flags::SEEN_REPLY),
            now,
        );
        if flags & ct_flags::CLOSING != 0 && entry.flags & ct_flags::CLOSING == 0 {
            // A closing flow's packets must keep its timestamps true: its
            // SNAT port is given back after it has been quiet for a while.
            // So copies taken before it closed go (later ones are refused).
            flow_cache::invalidate(&flow_key(flow));
            flow_cache::invalidate(&peer);
        }
    }
}

/// Copies state changes to the entry of the other direction, so that both
/// age the same way. Returns that entry's key.
#[inline(always)]
fn mirror_flags(entry: &CtValue, flow: &Flow, state: u8, now: u64) -> CtKey {
    // The other direction's tuple is this packet's translation, reversed.
    let nat = translation(entry, flow);
    let peer = key(
        nat.dst_be,
        nat.src_be,
        nat.dport_be,
        nat.sport_be,
        flow.proto,
    );
    if let Some(p) = CONNTRACK.get_ptr_mut(peer) {
        unsafe {
            (*p).flags |= state;
            (*p).last_seen_ns = now;
        }
    }
    peer
}

/// Removes `key`'s entry, and every CPU's cached copy of it.
#[inline(always)]
fn remove(key: &CtKey) {
    let _ = CONNTRACK.remove(key);
    flow_cache::invalidate(key);
}

/// Inserts the entry of a key that has no live one: the packet's own key,
/// which its lookup just found absent, expired (never copied: see
/// `flow_cache::put`) or removed. No CPU holds a copy of what it replaces.
#[inline(always)]
fn insert_new(key: &CtKey, value: &CtValue) -> Result<(), ()> {
    CONNTRACK.insert(key, value, BPF_ANY).map_err(|_| ())
}

/// Inserts `key`'s entry if it has none. Otherwise (a live flow of another
/// client port clashing on the backend side) overwrites it, and voids the
/// copies of what it replaced: the uncommon case pays for the invalidation.
#[inline(always)]
fn insert_over(key: &CtKey, value: &CtValue) -> Result<(), ()> {
    if CONNTRACK.insert(key, value, BPF_NOEXIST).is_ok() {
        return Ok(());
    }
    CONNTRACK.insert(key, value, BPF_ANY).map_err(|_| ())?;
    flow_cache::invalidate(key);
    Ok(())
}

/// The hairpin source address as it sits in a packet.
#[inline(always)]
pub fn hairpin_addr() -> u32 {
    u32::from_ne_bytes(HAIRPIN_ADDR)
}

/// A new flow, as decided: `nat` is what its first packet becomes.
pub struct NewFlow {
    pub nat: Nat,
    pub backend_id: u32,
    pub service_id: u32,
    /// HAIRPIN or SNAT for a two-sided flow, else 0.
    pub kind: u8,
    /// Replies leave with a source that is an address of this node.
    pub reply_redirect: bool,
}

/// Creates both entries of a new flow of `flow` (client -> frontend). The
/// backend answers `nf.nat`'s source (the client, the hairpin address, or
/// this node for SNAT), and its replies are rewritten back to the frontend
/// and the client.
#[inline(always)]
fn entries(flow: &Flow, nf: &NewFlow, now: u64) -> (CtKey, CtValue, CtValue) {
    let forward = CtValue {
        nat_addr_be: nf.nat.dst_be,
        nat_port_be: nf.nat.dport_be,
        flags: nf.kind
            | if nf.nat.redirect {
                ct_flags::REDIRECT
            } else {
                0
            },
        dir: ct_dir::FORWARD,
        alt_addr_be: nf.nat.src_be,
        alt_port_be: nf.nat.sport_be,
        _pad: 0,
        backend_id: nf.backend_id,
        service_id: nf.service_id,
        created_ns: now,
        last_seen_ns: now,
    };
    let reply = CtValue {
        nat_addr_be: flow.dst_be,
        nat_port_be: flow.dport_be,
        flags: nf.kind
            | if nf.reply_redirect {
                ct_flags::REDIRECT
            } else {
                0
            },
        dir: ct_dir::REPLY,
        alt_addr_be: flow.src_be,
        alt_port_be: flow.sport_be,
        ..forward
    };
    let reply_key = key(
        nf.nat.dst_be,
        nf.nat.src_be,
        nf.nat.dport_be,
        nf.nat.sport_be,
        flow.proto,
    );
    (reply_key, forward, reply)
}

/// Creates both entries of a new flow whose source port is kept.
#[inline(always)]
pub fn create(flow: &Flow, nf: &NewFlow, now: u64) {
    let (reply_key, forward, reply) = entries(flow, nf, now);
    // Reply entry first: once the forward entry exists, packets are
    // translated, and their answers must already find their way back.
    if insert_over(&reply_key, &reply).is_err() || insert_new(&flow_key(flow), &forward).is_err() {
        count(counter::CT_INSERT_FAILED);
    }
}

/// Whether the SNATed flow of forward entry `forward` is the one whose
/// replies have the tuple `reply_key` (backend -> node address, SNAT port).
#[inline(always)]
fn replies_to(forward: &CtValue, reply_key: &CtKey) -> bool {
    forward.dir == ct_dir::FORWARD
        && forward.nat_addr_be == reply_key.src_be
        && forward.nat_port_be == reply_key.sport_be
        && forward.alt_addr_be == reply_key.dst_be
        && forward.alt_port_be == reply_key.dport_be
}

/// Creates both entries of a SNATed flow, choosing its source port in
/// `min..=max` (host order): the reply entry is inserted only if no live
/// flow holds that (backend, node address, port) tuple, so two flows never
/// share one. Returns the port (network order), or None when every try was
/// taken.
#[inline(always)]
pub fn create_snat(flow: &Flow, nf: &mut NewFlow, min: u16, max: u16, now: u64) -> Option<u16> {
    let span = (max as u32).saturating_sub(min as u32) + 1;
    let timeouts = ct_timeouts();
    for _ in 0..SNAT_TRIES {
        let port = min as u32 + slot_for(unsafe { bpf_get_prandom_u32() }, span);
        nf.nat.sport_be = (port as u16).to_be();
        let (reply_key, forward, reply) = entries(flow, nf, now);
        let mut taken = CONNTRACK.insert(reply_key, reply, BPF_NOEXIST).is_err();
        if taken {
            // An expired flow, or a closed one quiet for a while, gives its
            // port up. Removing and inserting again (not overwriting) keeps
            // two racing CPUs from both winning it.
            let old = CONNTRACK.get_ptr(reply_key).map(|p| unsafe { *p });
            let free = old.is_some_and(|old| {
                old.expired(flow.proto, now, &timeouts)
                    || (old.flags & ct_flags::CLOSING != 0
                        && now.saturating_sub(old.last_seen_ns) > SNAT_CLOSED_REUSE_NS)
            });
            if let (true, Some(old)) = (free, old) {
                // The old flow goes whole: its forward entry would still
                // send a straggler to this port. Only while that entry is
                // still the old flow's, though: the old client may have
                // opened a newer connection from the same port since, whose
                // forward entry has the same key and another SNAT port.
                if old.dir == ct_dir::REPLY {
                    let forward_key = key(
                        old.alt_addr_be,
                        old.nat_addr_be,
                        old.alt_port_be,
                        old.nat_port_be,
                        flow.proto,
                    );
                    let still_old = CONNTRACK
                        .get_ptr(forward_key)
                        .is_some_and(|f| replies_to(unsafe { &*f }, &reply_key));
                    if still_old {
                        remove(&forward_key);
                    }
                }
                remove(&reply_key);
                taken = CONNTRACK.insert(reply_key, reply, BPF_NOEXIST).is_err();
            }
        }
        if !taken {
            if insert_new(&flow_key(flow), &forward).is_err() {
                count(counter::CT_INSERT_FAILED);
            }
            return Some(nf.nat.sport_be);
        }
    }
    None
}
