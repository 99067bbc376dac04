//! Per-flow state of IPv6 flows: both directions of a translated flow have
//! an entry, as in `conntrack`, with the same states and timeouts
//! (`proxy_common::idle_timeout_ns`) and the same two maps, so that a flood
//! of new flows cannot push established ones out: `CT_NEW6` holds the flows
//! not assured yet, `CONNTRACK6` the assured ones, and the packet that
//! assures a flow (its client's first after a reply) moves both its entries
//! (see `conntrack`). Lookups try `CONNTRACK6` first. Entries are read in
//! place and built in `SCRATCH6`, never copied to the stack: this program's
//! stack holds little more than one `Ct6Value`.

use aya_ebpf::helpers::bpf_get_prandom_u32;
use proxy_common::{Ct6Key, Ct6Value, PROTO_TCP, counter, ct_dir, ct_flags, ct_timeout, slot_for};

use crate::{
    conntrack::{SNAT_CLOSED_REUSE_NS, SNAT_TRIES},
    event_log::{self, Event},
    flow_cache,
    maps::{CONNTRACK6, CT_NEW6, Conntrack6, Scratch6, count, ct_timeouts, scratch6},
    nat6::Nat6,
    packet::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    packet6::Flow6,
};

const BPF_ANY: u64 = 0;
const BPF_NOEXIST: u64 = 1;

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

/// A live entry found for a packet's tuple, in its map.
pub struct Found6 {
    pub ptr: *mut Ct6Value,
    /// The entry is in `CT_NEW6`: its flow is not assured yet.
    pub unassured: bool,
}

/// The live entry for this packet's tuple, if any: assured flows first.
#[inline(always)]
pub fn lookup(key: &Ct6Key, flow: &Flow6, now: u64) -> Option<Found6> {
    if let Some(ptr) = lookup_in(&CONNTRACK6, key, flow, now) {
        return Some(Found6 {
            ptr,
            unassured: false,
        });
    }
    lookup_in(&CT_NEW6, key, flow, now).map(|ptr| Found6 {
        ptr,
        unassured: true,
    })
}

/// `lookup` in one map. An expired entry counts as absent; so does a
/// closing TCP entry hit by a SYN (its ports are being reused by a new
/// connection, see `conntrack::lookup_in`), which is removed.
#[inline(always)]
fn lookup_in(map: &Conntrack6, key: &Ct6Key, flow: &Flow6, now: u64) -> Option<*mut Ct6Value> {
    let ptr = map.get_ptr_mut(key)?;
    // SAFETY: a valid map value pointer for the duration of this program.
    let entry = unsafe { &*ptr };
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
    Some(ptr)
}

/// Removes `key`'s entry from `map`, and every CPU's cached copy of it:
/// only `CONNTRACK6`'s entries are ever copied, so `CT_NEW6`'s removals
/// void none (where IPv4 voids them too, a cost its smaller key makes
/// small).
#[inline(always)]
fn remove(map: &Conntrack6, key: &Ct6Key) {
    let _ = map.remove(key);
    if core::ptr::eq(map, &raw const CONNTRACK6) {
        flow_cache::invalidate6(key);
    }
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
    nat.redirect = entry.flags & ct_flags::REDIRECT != 0;
    nat
}

/// Records what this packet tells about its flow (`found`, at `key`): a
/// reply makes it established; its client's direction after a reply (not
/// a SYN, FIN or RST; a TCP ACK) assures it, and an unassured flow then
/// moves to `CONNTRACK6` (as `conntrack::touch_unassured`); FIN or RST
/// starts closing. State changes are copied to the other direction's entry,
/// so both age alike; timestamps are refreshed at most once a second.
#[inline(always)]
pub fn touch(key: &Ct6Key, found: &Found6, flow: &Flow6, nat: &Nat6, now: u64) {
    let ptr = found.ptr;
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
    let Some(scratch) = scratch() else {
        return;
    };
    // The other direction's entry: this packet's translation, reversed.
    scratch.key = Ct6Key::new(
        nat.dst_be,
        nat.src_be,
        nat.dport_be,
        nat.sport_be,
        flow.proto,
    );
    if found.unassured && flags & ct_flags::ASSURED != 0 {
        if promote(key, ptr, flags, scratch, flow, now) {
            count(counter::CT_ASSURED);
            return;
        }
        flags &= !ct_flags::ASSURED;
    }
    // SAFETY: as above; racing writers only store equal or newer values of
    // monotonic fields.
    unsafe {
        (*ptr).flags = flags;
        (*ptr).last_seen_ns = now;
    }
    if flags == old_flags {
        return;
    }
    let map = if found.unassured {
        &CT_NEW6
    } else {
        &CONNTRACK6
    };
    if let Some(p) = map.get_ptr_mut(&scratch.key) {
        // SAFETY: a pointer the map lookup returned, valid for this
        // program's run.
        unsafe {
            (*p).flags |= flags & (ct_flags::CLOSING | ct_flags::SEEN_REPLY | ct_flags::ASSURED);
            (*p).last_seen_ns = now;
        }
    }
    if flags & ct_flags::CLOSING != 0 && old_flags & ct_flags::CLOSING == 0 {
        // As `conntrack::touch`: copies taken before the flow closed go.
        flow_cache::invalidate6(key);
        flow_cache::invalidate6(&scratch.key);
    }
}

/// Moves both entries of the flow whose forward entry is `entry` (at `key`,
/// its flags now `flags`) from `CT_NEW6` to `CONNTRACK6`, reply entry
/// (at `scratch.key`) first, as `conntrack::promote`. False when the flow
/// stays where it was.
#[inline(always)]
fn promote(
    key: &Ct6Key,
    entry: *const Ct6Value,
    flags: u8,
    scratch: &mut Scratch6,
    flow: &Flow6,
    now: u64,
) -> bool {
    let Some(reply) = CT_NEW6.get_ptr(&scratch.key) else {
        // Its reply entry was evicted: the flow could not go on anyway.
        return false;
    };
    // SAFETY: map value pointers valid for this program's run.
    unsafe {
        scratch.value = *reply;
        scratch.value.flags |= ct_flags::ASSURED;
        scratch.value.last_seen_ns = now;
    }
    let reply_in = insert_over(&scratch.key, &scratch.value);
    // SAFETY: as above.
    unsafe {
        scratch.value = *entry;
        scratch.value.flags = flags;
        scratch.value.last_seen_ns = now;
    }
    if !reply_in || !insert_over(key, &scratch.value) {
        count(counter::CT_INSERT_FAILED);
        event_log::log6(Event::CtInsertFailed, flow);
        return false;
    }
    // Never copied into the flow cache (only `CONNTRACK6`'s entries are),
    // so nothing to invalidate.
    let _ = CT_NEW6.remove(key);
    let _ = CT_NEW6.remove(&scratch.key);
    true
}

/// Inserts `key`'s entry into `CONNTRACK6` if it has none; otherwise
/// overwrites it and voids the copies of what it replaced, as
/// `conntrack::insert_over`. False when neither insert went in.
#[inline(always)]
fn insert_over(key: &Ct6Key, value: &Ct6Value) -> bool {
    if CONNTRACK6.insert(key, value, BPF_NOEXIST).is_ok() {
        return true;
    }
    if CONNTRACK6.insert(key, value, BPF_ANY).is_err() {
        return false;
    }
    flow_cache::invalidate6(key);
    true
}

/// A new flow, as decided: `nat` is what its first packet becomes (as
/// `conntrack::NewFlow`).
pub struct NewFlow6 {
    pub nat: Nat6,
    pub backend_id: u32,
    pub service_id: u32,
    /// `ct_flags::HAIRPIN` or `SNAT` for a two-sided flow, else 0.
    pub kind: u8,
    /// Replies leave with a source that is an address of this node.
    pub reply_redirect: bool,
    /// The forward entry's `path_mtu`.
    pub path_mtu: u16,
}

/// Writes the reply entry of the new flow `nf` of `flow` into `value`, and
/// its key into `key`: the backend answers `nf.nat`'s source (the client,
/// or this node for SNAT and hairpin), and its replies are rewritten back
/// to the frontend and the client.
#[inline(always)]
fn reply_entry(flow: &Flow6, nf: &NewFlow6, now: u64, key: &mut Ct6Key, value: &mut Ct6Value) {
    *key = Ct6Key::new(
        nf.nat.dst_be,
        nf.nat.src_be,
        nf.nat.dport_be,
        nf.nat.sport_be,
        flow.proto,
    );
    *value = Ct6Value {
        nat_addr_be: flow.dst_be,
        alt_addr_be: flow.src_be,
        nat_port_be: flow.dport_be,
        alt_port_be: flow.sport_be,
        flags: nf.kind | redirect_flag(nf.reply_redirect),
        dir: ct_dir::REPLY,
        path_mtu: 0,
        backend_id: nf.backend_id,
        service_id: nf.service_id,
        created_ns: now,
        last_seen_ns: now,
    };
}

#[inline(always)]
fn redirect_flag(redirect: bool) -> u8 {
    if redirect { ct_flags::REDIRECT } else { 0 }
}

/// Turns `scratch.value`, the reply entry of `nf`, into its forward entry
/// and inserts it into `CT_NEW6` at `flow`'s own key: one value made both
/// entries.
#[inline(always)]
fn insert_forward(flow: &Flow6, nf: &NewFlow6, scratch: &mut Scratch6) -> bool {
    let value = &mut scratch.value;
    value.nat_addr_be = nf.nat.dst_be;
    value.alt_addr_be = nf.nat.src_be;
    value.nat_port_be = nf.nat.dport_be;
    value.alt_port_be = nf.nat.sport_be;
    value.flags = nf.kind | redirect_flag(nf.nat.redirect);
    value.dir = ct_dir::FORWARD;
    value.path_mtu = nf.path_mtu;
    scratch.other_key = flow_key(flow);
    CT_NEW6
        .insert(&scratch.other_key, &scratch.value, BPF_ANY)
        .is_ok()
}

/// This CPU's `SCRATCH6` entry, or None (never: the map has its one entry).
#[inline(always)]
fn scratch() -> Option<&'static mut Scratch6> {
    // SAFETY: this CPU's entry, used by nothing else while this program
    // runs (see `Scratch6`).
    scratch6().map(|p| unsafe { &mut *p })
}

/// Creates both entries of a new flow of `flow` (client -> frontend) whose
/// source port is kept, in `CT_NEW6`: the reply entry first, so that once
/// packets are translated their answers already find their way back. An
/// assured flow holding the reply entry's key in `CONNTRACK6` (a clash on
/// the backend side) would shadow it, and goes: the older flow loses. Both
/// overwrite what `CT_NEW6` holds for their keys: the packet's own, which
/// its lookup just found absent, expired or removed, and an unassured flow
/// of another client port clashing on the backend side.
#[inline(always)]
pub fn create(flow: &Flow6, nf: &NewFlow6, now: u64) {
    let failed = match scratch() {
        Some(scratch) => {
            reply_entry(flow, nf, now, &mut scratch.key, &mut scratch.value);
            if CONNTRACK6.get_ptr(&scratch.key).is_some() {
                remove(&CONNTRACK6, &scratch.key);
            }
            let reply_failed = CT_NEW6
                .insert(&scratch.key, &scratch.value, BPF_ANY)
                .is_err();
            !insert_forward(flow, nf, scratch) || reply_failed
        }
        None => true,
    };
    if failed {
        count(counter::CT_INSERT_FAILED);
        event_log::log6(Event::CtInsertFailed, flow);
    }
    count(counter::CT_NEW_FLOW);
}

/// Creates both entries of a flow whose source becomes this node's
/// (SNAT, hairpin), choosing its source port in `min..=max` (host order)
/// by `conntrack::create_snat`'s rules: the reply entry is inserted only if
/// no live flow holds that (backend, node address, port) tuple, assured or
/// not, so two flows never share one. Keys and entry are built in
/// `SCRATCH6`. Returns false when every try was taken.
#[inline(always)]
pub fn create_snat(flow: &Flow6, nf: &mut NewFlow6, min: u16, max: u16, now: u64) -> bool {
    let Some(scratch) = scratch() else {
        return false;
    };
    let span = u32::from(max).saturating_sub(u32::from(min)) + 1;
    // The reply entry is the same whatever the port.
    reply_entry(flow, nf, now, &mut scratch.key, &mut scratch.value);
    for _ in 0..SNAT_TRIES {
        // SAFETY: a helper that takes no pointers and has no preconditions.
        let port = u32::from(min) + slot_for(unsafe { bpf_get_prandom_u32() }, span);
        nf.nat.sport_be = (port as u16).to_be();
        scratch.key.dport_be = nf.nat.sport_be;
        if !port_free(&CONNTRACK6, scratch, flow.proto, now) {
            continue;
        }
        // Claimed with NOEXIST, so that two racing CPUs never both win it.
        let mut taken = CT_NEW6
            .insert(&scratch.key, &scratch.value, BPF_NOEXIST)
            .is_err();
        if taken && port_free(&CT_NEW6, scratch, flow.proto, now) {
            taken = CT_NEW6
                .insert(&scratch.key, &scratch.value, BPF_NOEXIST)
                .is_err();
        }
        if taken {
            continue;
        }
        if !insert_forward(flow, nf, scratch) {
            count(counter::CT_INSERT_FAILED);
            event_log::log6(Event::CtInsertFailed, flow);
        }
        count(counter::CT_NEW_FLOW);
        return true;
    }
    false
}

/// Whether no live flow in `map` holds the SNAT tuple `scratch.key`, as
/// `conntrack::port_free`: an expired flow, or a closed one quiet for
/// `SNAT_CLOSED_REUSE_NS`, gives its port up and is removed whole, its
/// forward entry (looked up at `scratch.other_key`) only while that still
/// translates to this port.
#[inline(always)]
fn port_free(map: &Conntrack6, scratch: &mut Scratch6, proto: u8, now: u64) -> bool {
    let reply_key = &scratch.key;
    let Some(old) = map.get_ptr(reply_key) else {
        return true;
    };
    // SAFETY: a valid map value pointer for the duration of this program.
    let old = unsafe { &*old };
    let free = old.expired(proto, now, &ct_timeouts())
        || (old.flags & ct_flags::CLOSING != 0
            && now.saturating_sub(old.last_seen_ns) > SNAT_CLOSED_REUSE_NS);
    if !free {
        return false;
    }
    if old.dir == ct_dir::REPLY {
        scratch.other_key = Ct6Key::new(
            old.alt_addr_be,
            old.nat_addr_be,
            old.alt_port_be,
            old.nat_port_be,
            proto,
        );
        let still_old = map
            .get_ptr(&scratch.other_key)
            // SAFETY: a pointer the map lookup returned, valid for this
            // program's run.
            .is_some_and(|f| replies_to(unsafe { &*f }, &scratch.key));
        if still_old {
            remove(map, &scratch.other_key);
        }
    }
    remove(map, &scratch.key);
    true
}

/// Whether the SNATed flow of forward entry `forward` is the one whose
/// replies have the tuple `reply_key` (backend -> node address, SNAT port).
#[inline(always)]
fn replies_to(forward: &Ct6Value, reply_key: &Ct6Key) -> bool {
    forward.dir == ct_dir::FORWARD
        && forward.nat_addr_be == reply_key.src_be
        && forward.nat_port_be == reply_key.sport_be
        && forward.alt_addr_be == reply_key.dst_be
        && forward.alt_port_be == reply_key.dport_be
}
