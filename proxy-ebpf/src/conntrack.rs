//! Per-flow state: both directions of a translated flow have an entry, so a
//! packet needs one lookup whichever way it goes.
//!
//! A flow's entries live in one of two LRU maps, so that a flood of new
//! flows cannot push established ones out: `CT_NEW` holds flows not yet
//! assured, `CONNTRACK` the assured ones. A flow is created in `CT_NEW` and
//! moved to `CONNTRACK` by the first packet of its client's direction after
//! a reply (the ACK of a TCP handshake; a UDP flow's second request), as
//! netfilter marks a flow assured. A flood of SYNs or one-shot datagrams
//! thus only ever evicts other unassured flows; what evicts an assured flow
//! is more assured flows than `CONNTRACK` holds, as netfilter's table full
//! of assured flows refuses new ones. Lookups try `CONNTRACK` first, so an
//! established flow's packets cost what they did with one map.

use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_jiffies64, bpf_ktime_get_coarse_ns};
use proxy_common::{
    Clock, CtKey, CtTimeouts, CtValue, HAIRPIN_ADDR, PROTO_TCP, clock_slot, counter, ct_dir,
    ct_flags, ct_timeout, slot_for,
};

use crate::{
    event_log::{self, Event},
    flow_cache,
    maps::{CLOCK, CONNTRACK, CT_NEW, Conntrack, count, ct_timeouts},
    nat::Nat,
    packet::{Flow, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
};

const BPF_ANY: u64 = 0;
const BPF_NOEXIST: u64 = 1;
/// Tries at a free SNAT port before a new flow is dropped.
pub const SNAT_TRIES: u32 = 16;
/// A closed TCP flow (FIN or RST seen) gives its SNAT port up after this
/// long without packets, well before its entry expires: otherwise every
/// short connection would hold a port for the whole closing timeout, and a
/// few thousand connections a second to one backend would use the range up.
/// The same trade as Linux's `tcp_tw_reuse` (1 s): a straggler of the old
/// flow arriving later than this could be taken for the new one.
pub const SNAT_CLOSED_REUSE_NS: u64 = 1_000_000_000;

/// The clock of conntrack and affinity timestamps: `CLOCK_MONOTONIC` to
/// within a kernel tick, ample for timeouts of seconds and the same base the
/// agent's reaper reads. Scaled from jiffies, which the JIT reads inline,
/// once the agent has calibrated the scale (see `Clock`); until then the
/// coarse clock, a helper call.
#[inline(always)]
pub fn now_ns() -> u64 {
    match CLOCK.get_ptr(clock_slot::IN_FORCE) {
        // SAFETY: a valid array value pointer for this program's run.
        Some(clock) if unsafe { (*clock).tick_ns } != 0 => unsafe { (*clock).at(bpf_jiffies64()) },
        // SAFETY: a helper that takes no pointers and has no preconditions.
        _ => unsafe { bpf_ktime_get_coarse_ns() },
    }
}

/// Leaves a reading of both clocks in `CLOCK[SAMPLE]` (see `Clock`).
#[inline(always)]
pub fn sample_clocks() {
    let sample = Clock {
        // Jiffies first: the coarse clock is read as of the tick that set
        // them or a later one, never an earlier one.
        // SAFETY: a helper that takes no pointers and has no preconditions.
        jiffies: unsafe { bpf_jiffies64() },
        // SAFETY: a helper that takes no pointers and has no preconditions.
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

/// A live entry found for a packet's tuple.
pub struct Found {
    /// The entry in its map, or null for a flow cache copy (not an
    /// `Option`: the unused payload of a `None` is an undefined register to
    /// the verifier).
    pub ptr: *mut CtValue,
    pub entry: CtValue,
    /// The entry is in `CT_NEW`: its flow is not assured yet.
    pub unassured: bool,
}

/// The live entry for this packet's tuple, if any: assured flows first.
#[inline(always)]
pub fn lookup(key: &CtKey, flow: &Flow, now: u64) -> Option<Found> {
    if let Some((ptr, entry)) = lookup_in(&CONNTRACK, key, flow, now) {
        return Some(Found {
            ptr,
            entry,
            unassured: false,
        });
    }
    lookup_in(&CT_NEW, key, flow, now).map(|(ptr, entry)| Found {
        ptr,
        entry,
        unassured: true,
    })
}

/// `lookup` in one map. An expired entry counts as absent. So does a
/// closing TCP entry hit by a SYN or SYN-ACK: the ports are being reused by
/// a new connection, which may not be ours at all (a client connecting
/// straight to a pod from the port it just used for the service); the stale
/// entry is removed so its replies go untranslated.
#[inline(always)]
fn lookup_in(
    map: &Conntrack,
    key: &CtKey,
    flow: &Flow,
    now: u64,
) -> Option<(*mut CtValue, CtValue)> {
    let ptr = map.get_ptr_mut(key)?;
    // SAFETY: a valid map value pointer for the duration of this program.
    let entry = unsafe { *ptr };
    if entry.expired(flow.proto, now, &ct_timeouts()) {
        return None;
    }
    if flow.proto == PROTO_TCP
        && entry.flags & ct_flags::CLOSING != 0
        && flow.tcp_flags & (TCP_SYN | TCP_RST) == TCP_SYN
    {
        remove(map, key);
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

/// Records what this packet tells about an unassured flow (`touch`), and
/// moves the flow to `CONNTRACK` when this packet assures it: its client's
/// direction after a reply, not a SYN, FIN or RST (a TCP flow is assured by
/// the ACK that completes its handshake).
#[inline(always)]
pub fn touch_unassured(key: &CtKey, found: &Found, flow: &Flow, now: u64) {
    let entry = &found.entry;
    let assures = entry.dir == ct_dir::FORWARD
        && entry.flags & ct_flags::SEEN_REPLY != 0
        && flow.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) == 0
        && (flow.proto != PROTO_TCP || flow.tcp_flags & TCP_ACK != 0);
    if !assures || !promote(key, entry, flow, now) {
        touch(&CT_NEW, found.ptr, entry, flow, now);
    }
}

/// Moves both entries of the flow whose forward entry is `entry` (at `key`)
/// from `CT_NEW` to `CONNTRACK`, reply entry first (as `create` orders
/// them). False when the flow stays where it was.
#[inline(always)]
fn promote(key: &CtKey, entry: &CtValue, flow: &Flow, now: u64) -> bool {
    let peer = peer_key(entry, flow);
    // SAFETY: a valid map value pointer for the duration of this program.
    let Some(reply) = CT_NEW.get_ptr(&peer).map(|p| unsafe { *p }) else {
        // Its reply entry was evicted: the flow could not go on anyway.
        return false;
    };
    let reply = CtValue {
        flags: reply.flags | ct_flags::ASSURED,
        last_seen_ns: now,
        ..reply
    };
    let forward = CtValue {
        flags: entry.flags | ct_flags::ASSURED,
        last_seen_ns: now,
        ..*entry
    };
    if insert_over(&peer, &reply).is_err() || insert_over(key, &forward).is_err() {
        count(counter::CT_INSERT_FAILED);
        event_log::log(Event::CtInsertFailed, flow);
        return false;
    }
    // Never copied into the flow cache (`handle` caches assured entries
    // only), so nothing to invalidate.
    let _ = CT_NEW.remove(key);
    let _ = CT_NEW.remove(&peer);
    count(counter::CT_ASSURED);
    true
}

/// Records what this packet tells about the flow: a reply makes it
/// established, FIN/RST starts closing. Timestamps are refreshed at most once
/// a second to spare a write per packet.
#[inline(always)]
pub fn touch(map: &Conntrack, ptr: *mut CtValue, entry: &CtValue, flow: &Flow, now: u64) {
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
            map,
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

/// The key of the other direction's entry: this packet's translation,
/// reversed.
#[inline(always)]
fn peer_key(entry: &CtValue, flow: &Flow) -> CtKey {
    let nat = translation(entry, flow);
    key(
        nat.dst_be,
        nat.src_be,
        nat.dport_be,
        nat.sport_be,
        flow.proto,
    )
}

/// Copies state changes to the entry of the other direction (in the same
/// map: a flow's entries move together), so that both age the same way.
/// Returns that entry's key.
#[inline(always)]
fn mirror_flags(map: &Conntrack, entry: &CtValue, flow: &Flow, state: u8, now: u64) -> CtKey {
    let peer = peer_key(entry, flow);
    if let Some(p) = map.get_ptr_mut(peer) {
        // SAFETY: a pointer the map lookup returned, valid for this program's run.
        unsafe {
            (*p).flags |= state;
            (*p).last_seen_ns = now;
        }
    }
    peer
}

/// Removes `key`'s entry from `map`, and every CPU's cached copy of it.
#[inline(always)]
fn remove(map: &Conntrack, key: &CtKey) {
    let _ = map.remove(key);
    flow_cache::invalidate(key);
}

/// Inserts `key`'s entry into `CONNTRACK` if it has none. Otherwise (a live
/// flow of another client port clashing on the backend side, or an expired
/// one) overwrites it, and voids the copies of what it replaced: the
/// uncommon case pays for the invalidation.
#[inline(always)]
fn insert_over(key: &CtKey, value: &CtValue) -> Result<(), ()> {
    if CONNTRACK.insert(key, value, BPF_NOEXIST).is_ok() {
        return Ok(());
    }
    CONNTRACK.insert(key, value, BPF_ANY).map_err(|_| ())?;
    flow_cache::invalidate(key);
    Ok(())
}

/// Makes way in `CONNTRACK` for a new flow's reply entry at `reply_key`:
/// an assured flow there would shadow it (lookups try `CONNTRACK` first).
/// One lookup, a miss but for a clash on the backend side, where the older
/// flow loses, as one map overwrote it.
#[inline(always)]
fn unshadow(reply_key: &CtKey) {
    if CONNTRACK.get_ptr(reply_key).is_some() {
        remove(&CONNTRACK, reply_key);
    }
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
    /// The forward entry's `path_mtu`.
    pub path_mtu: u16,
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
        path_mtu: nf.path_mtu,
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
        path_mtu: 0,
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
    unshadow(&reply_key);
    // Reply entry first: once the forward entry exists, packets are
    // translated, and their answers must already find their way back. Both
    // overwrite what `CT_NEW` holds for their keys: the packet's own key,
    // which its lookup just found absent, expired or removed, and an
    // unassured flow of another client port clashing on the backend side.
    // Neither was ever copied into the flow cache.
    if CT_NEW.insert(&reply_key, &reply, BPF_ANY).is_err()
        || CT_NEW.insert(&flow_key(flow), &forward, BPF_ANY).is_err()
    {
        count(counter::CT_INSERT_FAILED);
        event_log::log(Event::CtInsertFailed, flow);
    }
    count(counter::CT_NEW_FLOW);
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
/// flow holds that (backend, node address, port) tuple, assured or not, so
/// two flows never share one. Returns the port (network order), or None
/// when every try was taken.
#[inline(always)]
pub fn create_snat(flow: &Flow, nf: &mut NewFlow, min: u16, max: u16, now: u64) -> Option<u16> {
    let span = u32::from(max).saturating_sub(u32::from(min)) + 1;
    let timeouts = ct_timeouts();
    for _ in 0..SNAT_TRIES {
        // SAFETY: a helper that takes no pointers and has no preconditions.
        let port = u32::from(min) + slot_for(unsafe { bpf_get_prandom_u32() }, span);
        nf.nat.sport_be = (port as u16).to_be();
        let (reply_key, forward, reply) = entries(flow, nf, now);
        if !port_free(&CONNTRACK, &reply_key, flow.proto, now, &timeouts) {
            continue;
        }
        // Claimed with NOEXIST, so that two racing CPUs never both win it.
        let mut taken = CT_NEW.insert(reply_key, reply, BPF_NOEXIST).is_err();
        if taken && port_free(&CT_NEW, &reply_key, flow.proto, now, &timeouts) {
            taken = CT_NEW.insert(reply_key, reply, BPF_NOEXIST).is_err();
        }
        if !taken {
            if CT_NEW.insert(&flow_key(flow), &forward, BPF_ANY).is_err() {
                count(counter::CT_INSERT_FAILED);
                event_log::log(Event::CtInsertFailed, flow);
            }
            count(counter::CT_NEW_FLOW);
            return Some(nf.nat.sport_be);
        }
    }
    None
}

/// Whether no live flow in `map` holds the SNAT tuple `reply_key`. An
/// expired flow, or a closed one quiet for a while, gives its port up: it
/// is removed whole (its forward entry would still send a straggler to this
/// port), so that the caller can claim the port.
#[inline(always)]
fn port_free(
    map: &Conntrack,
    reply_key: &CtKey,
    proto: u8,
    now: u64,
    timeouts: &CtTimeouts,
) -> bool {
    // SAFETY: a valid map value pointer for the duration of this program.
    let Some(old) = map.get_ptr(reply_key).map(|p| unsafe { *p }) else {
        return true;
    };
    let free = old.expired(proto, now, timeouts)
        || (old.flags & ct_flags::CLOSING != 0
            && now.saturating_sub(old.last_seen_ns) > SNAT_CLOSED_REUSE_NS);
    if !free {
        return false;
    }
    // Its forward entry goes only while it is still the old flow's: the old
    // client may have opened a newer connection from the same port since,
    // whose forward entry has the same key and another SNAT port.
    if old.dir == ct_dir::REPLY {
        let forward_key = key(
            old.alt_addr_be,
            old.nat_addr_be,
            old.alt_port_be,
            old.nat_port_be,
            proto,
        );
        let still_old = map
            .get_ptr(forward_key)
            // SAFETY: a pointer the map lookup returned, valid for this program's run.
            .is_some_and(|f| replies_to(unsafe { &*f }, reply_key));
        if still_old {
            remove(map, &forward_key);
        }
    }
    remove(map, reply_key);
    true
}
