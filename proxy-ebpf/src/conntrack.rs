//! Per-flow state, written once over the family (`Family`): both
//! directions of a translated flow have an entry, so a packet needs one
//! lookup whichever way it goes.
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
//! established flow's packets cost what they did with one map. IPv6 flows
//! live in `CONNTRACK6` and `CT_NEW6` by the same rules.
//!
//! One new flow starts in `CONNTRACK`: a TCP SYN opening again the tuple of
//! a closed flow there, whose two entries it voided (`reopen`, `create`),
//! as a busy client reuses its ports while its last connections' entries
//! are closing. It takes the room its old flow left, its forward entry
//! written over the old one in place (and its reply entry too where the
//! backend is the same), so `CONNTRACK` does not grow and a flood still
//! evicts only unassured flows; and it is never moved, which spares it the
//! two inserts into `CT_NEW`, the lookups that miss `CONNTRACK` first, and
//! the move (bench/README.md, "Where a connection's program time goes").
//!
//! Entries are read in place and built in this CPU's `Scratch`, never
//! copied to the stack: IPv6's program has room for little more than one
//! entry, and IPv4's for a few dozen bytes.

pub mod sctp;

use core::intrinsics::AtomicOrdering;

use aya_ebpf::helpers::{bpf_get_prandom_u32, bpf_jiffies64, bpf_ktime_get_coarse_ns};
use proxy_common::{
    Clock, CtKeyOf, CtValueOf, FlowAddr, HAIRPIN_ADDR, PROTO_SCTP, PROTO_TCP, clock_slot, counter,
    ct_dir, ct_flags, ct_timeout, slot_for, tcp_ack_after, tcp_close_step,
};

use crate::{
    event_log::Event,
    family::{Family, V4, V6},
    flow_cache::{self, Cached},
    maps::{CLOCK, Conntrack, Scratch, count, ct_source_share, expired},
    nat::NatOf,
    packet::{FlowOf, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN},
    prefilter,
};

const BPF_ANY: u64 = 0;
const BPF_NOEXIST: u64 = 1;
/// Tries at a free SNAT port before a new flow is dropped.
pub const SNAT_TRIES: u32 = 16;

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

/// The key of `flow`'s own direction.
#[inline(always)]
pub fn flow_key<A: FlowAddr>(flow: &FlowOf<A>) -> CtKeyOf<A> {
    CtKeyOf::new(
        flow.src_be,
        flow.dst_be,
        flow.sport_be,
        flow.dport_be,
        flow.proto,
    )
}

/// A live entry found for a packet's tuple, in its map.
pub struct Found<A> {
    pub ptr: *mut CtValueOf<A>,
    /// The entry is in `CT_NEW`: its flow is not assured yet, and moves
    /// when it is. (An entry of `CONNTRACK` may be of a flow not assured
    /// yet, a reopened tuple's, which never moves.)
    pub unassured: bool,
}

/// The live entry for this packet's tuple, if any: assured flows first.
/// `reopened` is left as `lookup_in` says.
#[inline(always)]
pub fn lookup<F: CreateFamily>(
    key: &CtKeyOf<F::Addr>,
    flow: &FlowOf<F::Addr>,
    now: u64,
    reopened: &mut u16,
) -> Option<Found<F::Addr>> {
    if let Some(ptr) = lookup_in::<F>(F::conntrack(), key, flow, now, reopened) {
        return Some(Found {
            ptr,
            unassured: false,
        });
    }
    if let Some(ptr) = lookup_in::<F>(F::ct_new(), key, flow, now, reopened) {
        return Some(Found {
            ptr,
            unassured: true,
        });
    }
    // Another CPU may have moved the flow between the two lookups: it
    // inserts into `CONNTRACK` before it removes from `CT_NEW`, so a flow
    // missed in both is in `CONNTRACK` now. Without this second look, the
    // client's request racing its ACK of the handshake (at tc, sent from
    // another CPU) started a new flow, with a new SNAT port, which the
    // backend answered with a reset. A SYN starts flows and never moves
    // one, and is not asked again.
    if flow.tcp_flags & TCP_SYN != 0 {
        return None;
    }
    let ptr = F::conntrack().get_ptr_mut(key)?;
    // SAFETY: a valid map value pointer for the duration of this program.
    if expired(unsafe { &*ptr }, flow.proto, now) {
        return None;
    }
    Some(Found {
        ptr,
        unassured: false,
    })
}

/// The live entry for a packet of `key`'s flow, as both pipelines find it:
/// this CPU's flow cache copy while it is good (`stamp`), else conntrack's.
pub struct Known<A> {
    /// This CPU's cache slot or a map value pointer, valid for this
    /// program's run; null when the flow has no live entry. One pointer for
    /// a copy and an entry, so that what follows is inlined once.
    pub entry: *const CtValueOf<A>,
    /// The entry in its map (None for a copy, which `seen` leaves alone).
    pub found: Option<Found<A>>,
    /// The source port (network order) a closed flow of this tuple was
    /// translated to, given up by the SYN that opened the tuple again
    /// (`lookup_in`): the new flow's first choice. 0: none.
    pub reopened_port_be: u16,
}

/// The live entry for this packet: the flow cache's copy first (see
/// `Known`).
#[inline(always)]
pub fn known<F: CreateFamily>(
    key: &CtKeyOf<F::Addr>,
    stamp: &flow_cache::Stamp,
    flow: &FlowOf<F::Addr>,
    now: u64,
) -> Known<F::Addr> {
    let cached = flow_cache::get::<F>(key, stamp, now);
    let mut reopened_port_be = 0;
    let found = match cached {
        Cached::Unknown => {
            let found = lookup::<F>(key, flow, now, &mut reopened_port_be);
            if found.is_none() {
                flow_cache::put_absent::<F>(key, stamp, now);
            }
            found
        }
        Cached::Copy(_) | Cached::Absent => None,
    };
    let entry = match (&cached, &found) {
        (Cached::Copy(copy), _) => *copy,
        (_, Some(found)) => found.ptr.cast_const(),
        _ => core::ptr::null(),
    };
    Known {
        entry,
        found,
        reopened_port_be,
    }
}

/// What a packet of a known flow, about to go as `nat` says, leaves behind:
/// its entry touched (`touch`) and, for a flow of `CONNTRACK`, copied into the
/// flow cache; counted by direction (`dir`, read before `touch`, which may
/// move the entry). `CT_NEW`'s flows are not cached: their entries move
/// when they are assured.
#[inline(always)]
pub fn seen<F: Family>(
    key: &CtKeyOf<F::Addr>,
    stamp: &flow_cache::Stamp,
    found: Option<&Found<F::Addr>>,
    flow: &FlowOf<F::Addr>,
    nat: &NatOf<F::Addr>,
    dir: u8,
    now: u64,
) {
    if let Some(found) = found {
        touch::<F>(key, found, flow, nat, now);
        if !found.unassured {
            flow_cache::put::<F>(key, stamp, found.ptr, now);
        }
    }
    count(if dir == ct_dir::FORWARD {
        counter::DNAT_ESTABLISHED
    } else {
        counter::REV_NAT
    });
}

/// `lookup` in one map. An expired entry counts as absent. So does a
/// closing TCP entry hit by a SYN, or SCTP's by an INIT: the ports are
/// being reused by a new connection, which may not be ours at all (a client
/// connecting straight to a pod from the port it just used for the
/// service). The old flow goes whole, as netfilter kills a closed entry a
/// SYN opens again (`reopen`): its forward entry voided, its reply entry
/// voided or removed, which would otherwise hold a SNAT port until it
/// expired beside the new flow's own; that port is left in `reopened` for
/// the new flow. A TCP flow that goes whole from `CONNTRACK` leaves its
/// room there to the new one (`Scratch::room_key`).
#[inline(always)]
fn lookup_in<F: CreateFamily>(
    map: &Conntrack<F::Addr>,
    key: &CtKeyOf<F::Addr>,
    flow: &FlowOf<F::Addr>,
    now: u64,
    reopened: &mut u16,
) -> Option<*mut CtValueOf<F::Addr>> {
    let ptr = map.get_ptr_mut(key)?;
    // SAFETY: a valid map value pointer for the duration of this program.
    let entry = unsafe { &*ptr };
    if expired(entry, flow.proto, now) {
        return None;
    }
    if (flow.proto == PROTO_TCP || flow.proto == PROTO_SCTP)
        && entry.flags & ct_flags::CLOSING != 0
        && flow.tcp_flags & (TCP_SYN | TCP_RST) == TCP_SYN
    {
        *reopened = reopen::<F>(map, key, ptr, flow.proto);
        return None;
    }
    Some(ptr)
}

/// Ends the closed flow whose forward entry is at `ptr` (at `key`, in
/// `map`), hit by a SYN opening its tuple again: that entry is voided in
/// place (`void`), and its reply entry voided or removed if it is still
/// that flow's (its tuple may have gone to another flow since,
/// `port_free`).
/// Returns the source port the flow was given (network order) when it was
/// two-sided and its reply entry was its own, else 0: the same client port
/// may then have the same SNAT port, as netfilter keeps a reopened tuple's
/// translation when it is still unique, and late packets of the old flow
/// reach the client they were for.
///
/// A TCP flow of `CONNTRACK` whose reply entry is its own leaves its room
/// there to the new flow the SYN starts (`create`): both keys are left in
/// this CPU's `Scratch` (`room_key`, `room_reply_key`), and the new flow
/// is written over its voided forward entry, which has the new flow's own
/// key, in place (`overwrite`), and over its voided reply entry too when
/// the same backend is picked again (`reply_in_room`): a remove and an
/// insert into a preallocated LRU map each put a node back on its free
/// lists or take one off, where a write in place does neither
/// (bench/README.md, "A reopened flow written over its closed one").
///
/// The entry and its key are copied into that scratch, and the rest is
/// done by a global function (`CreateFamily::reopen`), which the verifier
/// checks once on its own: inlined, its branches split every path from
/// here to the new flow (`tc_ingress6` took about 37,000 more verified
/// instructions, near its limit).
#[inline(always)]
fn reopen<F: CreateFamily>(
    map: &Conntrack<F::Addr>,
    key: &CtKeyOf<F::Addr>,
    ptr: *mut CtValueOf<F::Addr>,
    proto: u8,
) -> u16 {
    // Voided first, whatever follows: `reopen_rest` reads none of what
    // that changes (the FIN bits and the clock).
    void::<F>(map, key, ptr);
    let Some(scratch) = scratch::<F>() else {
        return 0;
    };
    scratch.room_key = *key;
    // SAFETY: a valid map value pointer for this program's run, and this
    // CPU's scratch, which cannot overlap it. Copied, not assigned: see
    // `translation`.
    unsafe { core::ptr::copy_nonoverlapping(ptr, &raw mut scratch.value, 1) };
    let in_conntrack = core::ptr::eq(map, F::conntrack());
    F::reopen(u64::from(in_conntrack), u64::from(proto)) as u16
}

/// `reopen`'s part out of line, on the closed flow's forward entry and key
/// as `reopen` left them in this CPU's `Scratch` (`value`, `room_key`), in
/// `CONNTRACK` or (`in_conntrack` false) `CT_NEW`: its reply entry ended if
/// it is its own, the room left or not (`room_key`'s protocol 0: none).
/// Where the room is left, the reply entry is voided in place and its key
/// kept (`room_reply_key`), for the new flow's reply entry to be written
/// over when the same backend is picked again (`insert_pair`); elsewhere it
/// is removed. Each map is asked at a call site of its own: a site that may
/// see either map is not inlined by the verifier, and a lookup there went
/// through the helper's indirect call.
#[inline(always)]
fn reopen_rest<F: Family>(in_conntrack: bool, proto: u8) -> u16 {
    let Some(scratch) = scratch::<F>() else {
        return 0;
    };
    let forward = &scratch.value;
    scratch.key = CtKeyOf::new(
        forward.nat_addr_be,
        forward.alt_addr_be,
        forward.nat_port_be,
        forward.alt_port_be,
        proto,
    );
    let room = in_conntrack && proto == PROTO_TCP;
    let own = forward.dir == ct_dir::FORWARD
        && if in_conntrack {
            end_own_reply::<F>(F::conntrack(), scratch, room)
        } else {
            end_own_reply::<F>(F::ct_new(), scratch, false)
        };
    if own && room {
        scratch.room_reply_key = scratch.key;
    } else {
        scratch.room_key.proto = 0;
    }
    if own && forward.flags & ct_flags::TWO_SIDED != 0 {
        forward.alt_port_be
    } else {
        0
    }
}

/// Ends the entry at `scratch.key` in `map` if it is the reply entry of the
/// flow whose forward key is `scratch.room_key`: voided in place (`void`)
/// where the new flow takes that flow's room (`keep`), else removed;
/// whether it was.
#[inline(always)]
fn end_own_reply<F: Family>(
    map: &Conntrack<F::Addr>,
    scratch: &Scratch<F::Addr>,
    keep: bool,
) -> bool {
    let Some(reply) = map.get_ptr_mut(&scratch.key) else {
        return false;
    };
    // SAFETY: a pointer the map lookup returned, valid for this program's
    // run.
    if !answers(unsafe { &*reply }, &scratch.room_key) {
        return false;
    }
    if keep {
        void::<F>(map, &scratch.key, reply);
    } else {
        remove::<F>(map, &scratch.key);
    }
    true
}

/// Makes the closed entry at `ptr` (at `key`, in `map`) count as absent, in
/// place: reset rather than closed by FINs (`CtTimeouts::tcp_close_ns`, a
/// fixed 10 s, where `TIME_WAIT` is 120 s) and last seen at the clock's
/// start, so expired once the node has been up for 10 s, long before an
/// agent runs; every CPU's cached copy of it voided. Every reader takes it
/// for no entry (`expired`) and every writer overwrites it: the new flow of
/// its tuple (`overwrite`, `reply_in_room`; in `CT_NEW`
/// `insert_pair`'s and `insert_forward`'s inserts at its key; a move to
/// `CONNTRACK`, `claim`), else the reaper removes it. So a SYN whose new
/// flow is not created (refused, left to netfilter) leaves no live entry
/// of the closed flow behind.
#[inline(always)]
fn void<F: Family>(map: &Conntrack<F::Addr>, key: &CtKeyOf<F::Addr>, ptr: *mut CtValueOf<F::Addr>) {
    // SAFETY: a valid map value pointer for the duration of this program.
    // `CLOSING` is the forward entry's already (the SYN's lookup asked);
    // set for the reply entry, which a packet of the flow's last exchange
    // may not have reached.
    unsafe {
        (*ptr).flags = ((*ptr).flags & !ct_flags::FIN_BOTH) | ct_flags::CLOSING;
        (*ptr).last_seen_ns = 0;
    }
    void_copies::<F>(map, key);
}

/// Whether reply entry `reply` rewrites its packets back to the client and
/// frontend of forward key `forward_key`: whether it is that flow's.
#[inline(always)]
fn answers<A: FlowAddr>(reply: &CtValueOf<A>, forward_key: &CtKeyOf<A>) -> bool {
    reply.dir == ct_dir::REPLY
        && reply.alt_addr_be.same(&forward_key.src_be)
        && reply.alt_port_be == forward_key.sport_be
        && reply.nat_addr_be.same(&forward_key.dst_be)
        && reply.nat_port_be == forward_key.dport_be
}

/// Voids every CPU's cached copy of `key`'s entry in `map`: only
/// `CONNTRACK`'s entries are ever copied.
#[inline(always)]
fn void_copies<F: Family>(map: &Conntrack<F::Addr>, key: &CtKeyOf<F::Addr>) {
    if core::ptr::eq(map, F::conntrack()) {
        flow_cache::invalidate(key);
    }
}

/// Removes `key`'s entry from `map`, and every CPU's cached copy of it
/// (`void_copies`).
#[inline(always)]
fn remove<F: Family>(map: &Conntrack<F::Addr>, key: &CtKeyOf<F::Addr>) {
    let _ = map.remove(key);
    void_copies::<F>(map, key);
}

/// What a packet of a known flow becomes.
#[inline(always)]
pub fn translation<A: Copy>(entry: &CtValueOf<A>, flow: &FlowOf<A>) -> NatOf<A> {
    let two_sided = entry.flags & ct_flags::TWO_SIDED != 0;
    let mut nat = NatOf::identity(flow);
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
            // SAFETY: a map value's field into a local, which cannot overlap.
            // Assigned, it was a memmove, a call to a byte loop here
            // (docs/architecture.md, "No calls on a packet's path").
            unsafe {
                core::ptr::copy_nonoverlapping(
                    &raw const entry.alt_addr_be,
                    &raw mut nat.dst_be,
                    1,
                );
            }
            nat.dport_be = entry.alt_port_be;
        }
    }
    nat.redirect = entry.flags & ct_flags::REDIRECT != 0;
    // A forward entry sent by the datapath with the client's address kept
    // is direct server return's (`ct_flags::REDIRECT`). Bit arithmetic: a
    // branch here would split every known flow's path in two for the
    // verifier, from here to the packet's end.
    let flags = entry.flags;
    let redirect = (flags / ct_flags::REDIRECT) & 1;
    let one_sided = !((flags / ct_flags::HAIRPIN) | (flags / ct_flags::SNAT)) & 1;
    let forward = (entry.dir ^ ct_dir::REPLY) & 1;
    nat.dsr = redirect & one_sided & forward;
    nat
}

/// Records what this packet tells about its flow (`found`, at `key`; `nat`
/// its translation): a reply makes it established; its client's direction
/// after a reply (not a SYN, FIN or RST; a TCP ACK: the one that completes
/// the handshake) assures it, and an unassured flow then moves to
/// `CONNTRACK`; a TCP FIN or RST inside the window closes its direction or
/// the flow (`tcp_close_step`), one outside it is counted and changes
/// nothing. Timestamps and the highest acknowledgment number are
/// refreshed at most once a second, to spare a write per packet; each
/// refresh and each state change is copied to the other direction's entry,
/// so that both age alike and a flow lives while either direction sends,
/// as netfilter's one entry does (a client sending one way no longer keeps
/// a fresh forward entry over an expired reply entry).
#[inline(always)]
pub fn touch<F: Family>(
    key: &CtKeyOf<F::Addr>,
    found: &Found<F::Addr>,
    flow: &FlowOf<F::Addr>,
    nat: &NatOf<F::Addr>,
    now: u64,
) {
    let ptr = found.ptr;
    // SAFETY: a valid map value pointer for the duration of this program.
    let entry = unsafe { &*ptr };
    let old_flags = entry.flags;
    let mut flags = old_flags;
    if entry.dir == ct_dir::REPLY {
        flags |= ct_flags::SEEN_REPLY;
    } else {
        // A flow sent by direct server return is answered through another
        // node, never here: its client speaking again after its first
        // packet (a TCP client's ACK after the backend's SYN-ACK) is the
        // reply it shows.
        if nat.dsr != 0 && flow.tcp_flags & TCP_SYN == 0 {
            flags |= ct_flags::SEEN_REPLY;
        }
        if flags & ct_flags::SEEN_REPLY != 0
            && flow.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) == 0
            && (flow.proto != PROTO_TCP || flow.tcp_flags & TCP_ACK != 0)
        {
            flags |= ct_flags::ASSURED;
        }
    }
    if flow.proto == PROTO_TCP && flow.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        flags = closed::<F>(flags, entry.dir, flow, nat, found.unassured);
    } else if flow.proto == PROTO_SCTP {
        // An ABORT or SHUTDOWN COMPLETE (its tag checked, `sctp::tag_holds`)
        // ends the association.
        if flow.tcp_flags & (TCP_FIN | TCP_RST) != 0 {
            flags |= ct_flags::CLOSING;
        }
        if flow.tcp_flags & TCP_SYN != 0 {
            sctp::learn::<F>(found, flow, nat);
        }
    }
    let stale = now.saturating_sub(entry.last_seen_ns) > ct_timeout::REFRESH_NS;
    if flags == old_flags && !stale {
        return;
    }
    let Some(scratch) = scratch::<F>() else {
        return;
    };
    // The other direction's entry: this packet's translation, reversed.
    scratch.key = other_key(flow, nat);
    let max_ack = if flow.proto == PROTO_TCP && flow.tcp_flags & TCP_ACK != 0 {
        tcp_ack_after(entry.tcp_max_ack, u32::from_be(flow.tcp_ack_be))
    } else {
        entry.tcp_max_ack
    };
    if found.unassured && flags & ct_flags::ASSURED != 0 {
        match promote::<F>(key, ptr, flags, max_ack, scratch, flow, now) {
            Promoted::Moved => {
                count(counter::CT_ASSURED);
                return;
            }
            // Another CPU moved the flow since this packet's lookup: the
            // entry `ptr` points at may be gone, even reused by another
            // flow, and is not written.
            Promoted::Taken => return,
            Promoted::Stays => flags &= !ct_flags::ASSURED,
        }
    }
    // SAFETY: as above; racing writers only store equal or newer values of
    // monotonic fields.
    unsafe {
        (*ptr).flags = flags;
        (*ptr).tcp_max_ack = max_ack;
        (*ptr).last_seen_ns = now;
    }
    // Each map looked up at a call site of its own (see `reopen_rest`).
    let other = if found.unassured {
        F::ct_new().get_ptr_mut(&scratch.key)
    } else {
        F::conntrack().get_ptr_mut(&scratch.key)
    };
    if let Some(p) = other {
        // SAFETY: as above.
        unsafe {
            (*p).flags |= flags
                & (ct_flags::CLOSING
                    | ct_flags::SEEN_REPLY
                    | ct_flags::ASSURED
                    | ct_flags::FIN_BOTH);
            (*p).last_seen_ns = now;
        }
    }
    if flags & ct_flags::CLOSING != 0 && old_flags & ct_flags::CLOSING == 0 {
        // A closed flow's entries are not copied (see `flow_cache::put`), so
        // that its last packets refresh the entries themselves: copies
        // taken before it closed go.
        flow_cache::invalidate(key);
        flow_cache::invalidate(&scratch.key);
    }
}

/// The key of the other direction of `flow`'s flow: its translation,
/// reversed.
#[inline(always)]
fn other_key<A: FlowAddr>(flow: &FlowOf<A>, nat: &NatOf<A>) -> CtKeyOf<A> {
    CtKeyOf::new(
        nat.dst_be,
        nat.src_be,
        nat.dport_be,
        nat.sport_be,
        flow.proto,
    )
}

/// `flags` after the TCP FIN or RST `flow` (sent in direction `dir`,
/// translated as `nat`), judged against what its receiver acknowledged
/// (`tcp_close_step`): unchanged, and counted, when it is outside the
/// window. The receiver's entry is looked up here and let go, so that
/// nothing after holds a pointer that may be null (each would be walked
/// by the verifier both ways).
#[inline(always)]
fn closed<F: Family>(
    flags: u8,
    dir: u8,
    flow: &FlowOf<F::Addr>,
    nat: &NatOf<F::Addr>,
    unassured: bool,
) -> u8 {
    let Some(scratch) = scratch::<F>() else {
        return flags;
    };
    scratch.key = other_key(flow, nat);
    // Each map looked up at a call site of its own (see `reopen_rest`).
    let receiver = if unassured {
        F::ct_new().get_ptr(&scratch.key)
    } else {
        F::conntrack().get_ptr(&scratch.key)
    };
    // SAFETY: a pointer the map lookup returned, valid for this program's
    // run.
    let receiver_max_ack = receiver.map_or(0, |p| unsafe { (*p).tcp_max_ack });
    let step = tcp_close_step(
        flags,
        dir,
        flow.tcp_flags & TCP_FIN != 0,
        flow.tcp_flags & TCP_RST != 0,
        u32::from_be(flow.tcp_seq_be),
        receiver_max_ack,
    );
    step.unwrap_or_else(|| {
        count(counter::CT_OUT_OF_WINDOW);
        flags
    })
}

/// What became of a flow `promote` was asked to move.
enum Promoted {
    /// Moved to `CONNTRACK` by this packet.
    Moved,
    /// Moved by another CPU's packet since this one found it in `CT_NEW`.
    Taken,
    /// Left where it was.
    Stays,
}

/// Moves both entries of the flow whose forward entry is `entry` (at `key`,
/// its flags now `flags`) from `CT_NEW` to `CONNTRACK`. Two packets of the
/// flow may find it in `CT_NEW` at once on two CPUs (at tc, the client's
/// ACK of the handshake and its request, sent from different CPUs): one
/// moves it, and the other must neither move it again nor read or write
/// the `CT_NEW` entries, which the first removes and which a preallocated
/// map hands to the next insert at once. The forward entry is inserted
/// first, into an empty key only: that insert is the claim, and what
/// either copy read is checked to be the flow's before it is used. The
/// reply entry (at `scratch.key`) follows; until it is in, replies find
/// its `CT_NEW` copy.
#[inline(always)]
fn promote<F: Family>(
    key: &CtKeyOf<F::Addr>,
    entry: *const CtValueOf<F::Addr>,
    flags: u8,
    max_ack: u32,
    scratch: &mut Scratch<F::Addr>,
    flow: &FlowOf<F::Addr>,
    now: u64,
) -> Promoted {
    let share = ct_source_share();
    if share != 0 && !within_share::<F>(&key.src_be, share) {
        count(counter::CT_SHARE_REFUSED);
        return Promoted::Stays;
    }
    // SAFETY: map value pointers valid for this program's run (their
    // contents checked below: another CPU may have removed and reused
    // them), of two maps, so never overlapping. Copied, not assigned: see
    // `translation`.
    unsafe {
        core::ptr::copy_nonoverlapping(entry, &raw mut scratch.value, 1);
    }
    if !replies_to(&scratch.value, &scratch.key) {
        return Promoted::Taken;
    }
    scratch.value.flags = flags;
    scratch.value.tcp_max_ack = max_ack;
    scratch.value.last_seen_ns = now;
    match claim::<F>(key, &scratch.value, flow.proto, now) {
        Promoted::Moved => {}
        other => {
            if matches!(other, Promoted::Stays) {
                count(counter::CT_INSERT_FAILED);
                F::log(Event::CtInsertFailed, flow);
            }
            return other;
        }
    }
    // Never copied into the flow cache (only `CONNTRACK`'s entries are),
    // so nothing to invalidate.
    let _ = F::ct_new().remove(key);
    // With its reply entry evicted, replies find none, in either map.
    if let Some(reply) = F::ct_new().get_ptr(&scratch.key) {
        // SAFETY: as above.
        unsafe {
            core::ptr::copy_nonoverlapping(reply, &raw mut scratch.value, 1);
        }
        if answers(&scratch.value, key) {
            scratch.value.flags |= ct_flags::ASSURED;
            scratch.value.last_seen_ns = now;
            if insert_over::<F>(&scratch.key, &scratch.value) {
                let _ = F::ct_new().remove(&scratch.key);
            } else {
                // Its `CT_NEW` entry goes on answering for it.
                count(counter::CT_INSERT_FAILED);
                F::log(Event::CtInsertFailed, flow);
            }
        }
    }
    if share != 0 {
        charge::<F>(&key.src_be);
    }
    Promoted::Moved
}

/// Inserts forward entry `value` into `CONNTRACK` at `key` for `promote`:
/// Moved when it went in, Taken when a live flow already holds the key
/// (the same flow, moved by another CPU since this packet's lookup, which
/// found none there), Stays when the insert failed. An expired flow holding
/// the key is overwritten, and its copies voided.
#[inline(always)]
fn claim<F: Family>(
    key: &CtKeyOf<F::Addr>,
    value: &CtValueOf<F::Addr>,
    proto: u8,
    now: u64,
) -> Promoted {
    if F::conntrack().insert(key, value, BPF_NOEXIST).is_ok() {
        return Promoted::Moved;
    }
    match F::conntrack().get_ptr(key) {
        // SAFETY: a pointer the map lookup returned, valid for this
        // program's run.
        Some(old) if !expired(unsafe { &*old }, proto, now) => Promoted::Taken,
        _ => {
            if F::conntrack().insert(key, value, BPF_ANY).is_err() {
                return Promoted::Stays;
            }
            flow_cache::invalidate(key);
            Promoted::Moved
        }
    }
}

/// Whether `client` holds fewer assured flows than `share`.
#[inline(always)]
fn within_share<F: Family>(client: &F::Addr, share: u32) -> bool {
    // SAFETY: a pointer the map lookup returned, valid for this program's
    // run.
    F::ct_sources()
        .get_ptr(client)
        .is_none_or(|held| unsafe { *held } < share)
}

/// Counts one more assured flow of `client`.
#[inline(always)]
fn charge<F: Family>(client: &F::Addr) {
    match F::ct_sources().get_ptr_mut(client) {
        // SAFETY: a valid, aligned map value pointer, shared by all CPUs:
        // an atomic add, as a lost one would let a client past its share.
        Some(held) => unsafe {
            core::intrinsics::atomic_xadd::<u32, u32, { AtomicOrdering::Relaxed }>(held, 1);
        },
        None => {
            let _ = F::ct_sources().insert(client, &1, BPF_NOEXIST);
        }
    }
}

/// Inserts `key`'s entry into `CONNTRACK` if it has none. Otherwise (a live
/// flow of another client port clashing on the backend side, or an expired
/// one) overwrites it, and voids the copies of what it replaced: the
/// uncommon case pays for the invalidation. False when neither insert went
/// in.
#[inline(always)]
fn insert_over<F: Family>(key: &CtKeyOf<F::Addr>, value: &CtValueOf<F::Addr>) -> bool {
    if F::conntrack().insert(key, value, BPF_NOEXIST).is_ok() {
        return true;
    }
    if F::conntrack().insert(key, value, BPF_ANY).is_err() {
        return false;
    }
    flow_cache::invalidate(key);
    true
}

/// The hairpin source address as it sits in a packet.
#[inline(always)]
pub fn hairpin_addr() -> u32 {
    u32::from_ne_bytes(HAIRPIN_ADDR)
}

/// A new flow, as decided: `nat` is what its first packet becomes.
pub struct NewFlow<A> {
    pub nat: NatOf<A>,
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
/// the hairpin address, or this node for SNAT), and its replies are
/// rewritten back to the frontend and the client.
#[inline(always)]
fn reply_entry<A: FlowAddr>(
    flow: &FlowOf<A>,
    nf: &NewFlow<A>,
    now: u64,
    key: &mut CtKeyOf<A>,
    value: &mut CtValueOf<A>,
) {
    *key = other_key(flow, &nf.nat);
    *value = CtValueOf {
        nat_addr_be: flow.dst_be,
        alt_addr_be: flow.src_be,
        nat_port_be: flow.dport_be,
        alt_port_be: flow.sport_be,
        flags: nf.kind | redirect_flag(nf.reply_redirect),
        dir: ct_dir::REPLY,
        path_mtu: 0,
        backend_id: nf.backend_id,
        service_id: nf.service_id,
        created_s: (now / 1_000_000_000) as u32,
        tcp_max_ack: sctp::first_tags(flow).1,
        last_seen_ns: now,
    };
}

#[inline(always)]
fn redirect_flag(redirect: bool) -> u8 {
    if redirect { ct_flags::REDIRECT } else { 0 }
}

/// Turns `scratch.value`, the reply entry of `nf`, into its forward entry
/// and inserts it into `CT_NEW` at `flow`'s own key: one value made both
/// entries.
#[inline(always)]
fn insert_forward<F: Family>(
    flow: &FlowOf<F::Addr>,
    nf: &NewFlow<F::Addr>,
    scratch: &mut Scratch<F::Addr>,
) -> bool {
    forward_entry(flow, nf, &mut scratch.value);
    scratch.other_key = flow_key(flow);
    let inserted = F::ct_new()
        .insert(&scratch.other_key, &scratch.value, BPF_ANY)
        .is_ok();
    // Both entries are in now (the reply entry went first): the copies
    // that said they were absent go (`flow_cache::put_absent`).
    flow_cache::invalidate(&scratch.key);
    flow_cache::invalidate(&scratch.other_key);
    inserted
}

/// Turns `value`, the reply entry of `nf` (`reply_entry`), into its
/// forward entry.
#[inline(always)]
fn forward_entry<A: FlowAddr>(flow: &FlowOf<A>, nf: &NewFlow<A>, value: &mut CtValueOf<A>) {
    value.nat_addr_be = nf.nat.dst_be;
    value.alt_addr_be = nf.nat.src_be;
    value.nat_port_be = nf.nat.dport_be;
    value.alt_port_be = nf.nat.sport_be;
    value.flags = nf.kind | redirect_flag(nf.nat.redirect);
    value.dir = ct_dir::FORWARD;
    value.path_mtu = nf.path_mtu;
    // A flow met mid-stream (its entries lost) starts from its ACK.
    value.tcp_max_ack = if flow.proto == PROTO_TCP && flow.tcp_flags & TCP_ACK != 0 {
        u32::from_be(flow.tcp_ack_be)
    } else {
        sctp::first_tags(flow).0
    };
}

/// This CPU's `Scratch` of the family, or None (never: the map has its one
/// entry).
#[inline(always)]
fn scratch<F: Family>() -> Option<&'static mut Scratch<F::Addr>> {
    // SAFETY: this CPU's entry, used by nothing else while this program
    // runs (see `Scratch`).
    F::scratch().map(|p| unsafe { &mut *p })
}

/// Creates both entries of a new flow of `flow` (client -> frontend) whose
/// source port is kept, in `CT_NEW`: the reply entry first, so that once
/// packets are translated their answers already find their way back. An
/// assured flow holding the reply entry's key in `CONNTRACK` (a clash on
/// the backend side) would shadow it (lookups try `CONNTRACK` first), and
/// goes: the older flow loses, as one map overwrote it. Both overwrite what
/// `CT_NEW` holds for their keys: the packet's own, which its lookup just
/// found absent, expired or removed, and an unassured flow of another
/// client port clashing on the backend side. (Only direct server return's
/// flows come here, which cannot change their port: the backend answers
/// their client straight. A flow that keeps its client's port otherwise
/// goes through `create_kept`, which never overwrites a live clash.)
///
/// A TCP flow whose SYN ended its tuple's closed flow in `CONNTRACK`
/// (`reopen`, `Scratch::room_key`) is created there instead, in the room
/// it left, its forward entry over the voided one, its reply entry
/// overwriting a clash there as `CT_NEW`'s inserts do, and is never moved.
/// The room is taken once. Its client's
/// share (`ct_source_share`) is neither asked nor charged: the flow takes
/// the place of one of the client's own that the share counted, and the
/// agent's recount counts what `CONNTRACK` holds.
///
/// Both entries are built in this CPU's `Scratch` and inserted by a global
/// function (`CreateFamily::insert_pair`), which the verifier checks once
/// on its own: inlined, the choice of map split every path to a new flow
/// in two, and `tc_ingress6` went past the verifier's limit.
#[inline(always)]
pub fn create<F: CreateFamily>(flow: &FlowOf<F::Addr>, nf: &NewFlow<F::Addr>, now: u64) {
    create_pair::<F>(flow, nf, now, 0);
}

/// `create` for a flow whose client's port is kept (a pod's flow to a
/// ClusterIP, its address kept too; IPv4's hairpin flow, from the hairpin
/// address), unless a live flow of another client tuple already has that
/// source address and port at the same backend: the client reached the
/// backend from the same port through another frontend (Linux
/// hands one local port to connections to different destinations). Both
/// would be one connection to the backend, whose socket of the older would
/// answer the newer's SYN with a challenge ACK, and what followed would
/// reset the older. So the newer flow's source port is changed, as
/// netfilter's NAT changes a clashing tuple's (`proxy_common::remap_ports`; the port
/// its client port's closed flow was given, `reopened_be`, first), and
/// the flow is two-sided (`ct_flags::SNAT`, its source address kept),
/// counted `ct_port_remapped`. The source port its packets leave with
/// (network order), or None when no port was free.
///
/// The port is claimed here, through the global `try_port`, as
/// `create_snat` claims one: a global function calling it would nest a
/// third frame under the program's, past the 512 bytes of stack they share.
#[inline(always)]
pub fn create_kept<F: CreateFamily>(
    flow: &FlowOf<F::Addr>,
    nf: &NewFlow<F::Addr>,
    reopened_be: u16,
    now: u64,
) -> Option<u16> {
    if create_pair::<F>(flow, nf, now, KEEP) != PAIR_CLASH {
        return Some(flow.sport_be);
    }
    let (min, max) = proxy_common::remap_ports(u16::from_be(flow.sport_be));
    let port_be = claim_port(flow.proto, min, max, reopened_be, now, F::try_port)?;
    let outcome = F::insert_pair(REMAPPED | u64::from(port_be) << 16, now);
    created::<F>(flow, outcome);
    Some(port_be)
}

/// `insert_pair`'s `how`: the flow starts in its closed flow's room
/// (`ROOM`); it keeps its client's port unless that clashes (`KEEP`,
/// `create_kept`); its reply entry is in at the port in bits 16-31, its
/// forward entry is to follow (`REMAPPED`).
const ROOM: u64 = 1;
const KEEP: u64 = 2;
const REMAPPED: u64 = 4;

/// What `insert_pair` returns: both entries in, an insert failed, or
/// (with `KEEP`) a clash found and nothing written.
const PAIR_FAILED: u32 = 0;
const PAIR_INSERTED: u32 = 1;
const PAIR_CLASH: u32 = 2;

/// `create` with `insert_pair`'s `how` (less `ROOM`, which this finds):
/// `insert_pair`'s result, counted unless a clash.
#[inline(always)]
fn create_pair<F: CreateFamily>(
    flow: &FlowOf<F::Addr>,
    nf: &NewFlow<F::Addr>,
    now: u64,
    how: u64,
) -> u32 {
    let outcome = match scratch::<F>() {
        Some(scratch) => {
            reply_entry(flow, nf, now, &mut scratch.key, &mut scratch.value);
            // SAFETY: two fields of one struct, which cannot overlap.
            // Copied, not assigned: see `translation`.
            unsafe {
                core::ptr::copy_nonoverlapping(
                    &raw const scratch.value,
                    &raw mut scratch.other_value,
                    1,
                );
            }
            forward_entry(flow, nf, &mut scratch.other_value);
            scratch.other_key = flow_key(flow);
            let room = scratch.room_key.same_ends(&scratch.other_key)
                && scratch.room_key.proto == flow.proto;
            // A key of protocol 0 is no flow's.
            scratch.room_key.proto = 0;
            F::insert_pair(how | u64::from(room), now)
        }
        None => PAIR_FAILED,
    };
    if outcome != PAIR_CLASH {
        created::<F>(flow, outcome);
    }
    outcome
}

/// Counts a new flow of `flow` whose entries `insert_pair` wrote with
/// `outcome`.
#[inline(always)]
fn created<F: Family>(flow: &FlowOf<F::Addr>, outcome: u32) {
    if outcome == PAIR_FAILED {
        count(counter::CT_INSERT_FAILED);
        F::log(Event::CtInsertFailed, flow);
    }
    count(counter::CT_NEW_FLOW);
}

/// Creates both entries of a flow whose source becomes this node's (SNAT,
/// and IPv6's hairpin), choosing its source port in `min..=max` (host
/// order): the reply entry is inserted only if no live flow holds that
/// (backend, node address, port) tuple, assured or not, so two flows never
/// share one. The port its client port's closed flow had (`reopened_be`,
/// network order, 0: none; see `Known`) is tried first, then random ones.
/// The port is left in `nf.nat.sport_be`. False when every try was taken.
#[inline(always)]
pub fn create_snat<F: CreateFamily>(
    flow: &FlowOf<F::Addr>,
    nf: &mut NewFlow<F::Addr>,
    min: u16,
    max: u16,
    reopened_be: u16,
    now: u64,
) -> bool {
    let Some(scratch) = scratch::<F>() else {
        return false;
    };
    // The reply entry is the same whatever the port.
    reply_entry(flow, nf, now, &mut scratch.key, &mut scratch.value);
    let Some(port_be) = claim_port(flow.proto, min, max, reopened_be, now, F::try_port) else {
        return false;
    };
    nf.nat.sport_be = port_be;
    if !insert_forward::<F>(flow, nf, scratch) {
        count(counter::CT_INSERT_FAILED);
        F::log(Event::CtInsertFailed, flow);
    }
    count(counter::CT_NEW_FLOW);
    true
}

/// A port of `min..=max` (host order) claimed for the reply entry in this
/// CPU's `Scratch` by `try_at` (`try_port`'s arguments as the global
/// functions take them), network order: `reopened_be` if it is in the
/// range and free, else the first of `SNAT_TRIES` random tries free.
#[inline(always)]
fn claim_port(
    proto: u8,
    min: u16,
    max: u16,
    reopened_be: u16,
    now: u64,
    try_at: impl Fn(u64, u64, u64) -> u32,
) -> Option<u16> {
    let reopened = u16::from_be(reopened_be);
    if reopened_be != 0
        && (min..=max).contains(&reopened)
        && try_at(u64::from(proto), now, u64::from(reopened_be)) != 0
    {
        return Some(reopened_be);
    }
    let span = u32::from(max).saturating_sub(u32::from(min)) + 1;
    for try_ in 0..SNAT_TRIES {
        // SAFETY: a helper that takes no pointers and has no preconditions.
        let port = u32::from(min) + slot_for(unsafe { bpf_get_prandom_u32() }, span);
        let port_be = (port as u16).to_be();
        // The last try may take the port of a flow never answered (see
        // `try_port`).
        let reclaim = u64::from(try_ == SNAT_TRIES - 1);
        if try_at(u64::from(proto), now, u64::from(port_be) | reclaim << 16) != 0 {
            return Some(port_be);
        }
    }
    None
}

/// What a family's new flows call as functions of their own: the try at a
/// SNAT port (`try_port`) and the inserts of a flow's two entries
/// (`insert_pair`).
pub trait CreateFamily: Family {
    /// `try_port` of this family, `port` holding the port (network order)
    /// and, in bit 16, whether it may reclaim.
    fn try_port(proto: u64, now: u64, port: u64) -> u32;

    /// `insert_pair` of this family.
    fn insert_pair(how: u64, now: u64) -> u32;

    /// `reopen_rest` of this family.
    fn reopen(in_conntrack: u64, proto: u64) -> u32;
}

impl CreateFamily for V4 {
    #[inline(always)]
    fn try_port(proto: u64, now: u64, port: u64) -> u32 {
        snat_try_port(proto, now, port)
    }

    #[inline(always)]
    fn insert_pair(how: u64, now: u64) -> u32 {
        ct_insert_pair(how, now)
    }

    #[inline(always)]
    fn reopen(in_conntrack: u64, proto: u64) -> u32 {
        ct_reopen(in_conntrack, proto)
    }
}

impl CreateFamily for V6 {
    #[inline(always)]
    fn try_port(proto: u64, now: u64, port: u64) -> u32 {
        snat_try_port6(proto, now, port)
    }

    #[inline(always)]
    fn insert_pair(how: u64, now: u64) -> u32 {
        ct_insert_pair6(how, now)
    }

    #[inline(always)]
    fn reopen(in_conntrack: u64, proto: u64) -> u32 {
        ct_reopen6(in_conntrack, proto)
    }
}

/// `try_port` of IPv4. Global (`no_mangle`, scalar arguments and result):
/// the verifier checks it once, on its own, where it would walk it again
/// for every try of every state that reaches a new SNAT flow, and those
/// are many; its frame is its own, small next to the stack its callers
/// use. In `.text`, where aya resolves calls (see `trace::trace_record`).
#[inline(never)]
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text")]
pub extern "C" fn snat_try_port(proto: u64, now: u64, port: u64) -> u32 {
    try_port::<V4>(proto as u8, now, port as u16, port >> 16 != 0)
}

/// `try_port` of IPv6, as `snat_try_port`.
#[inline(never)]
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text")]
pub extern "C" fn snat_try_port6(proto: u64, now: u64, port: u64) -> u32 {
    try_port::<V6>(proto as u8, now, port as u16, port >> 16 != 0)
}

/// `insert_pair` of IPv4, global as `snat_try_port` is.
#[inline(never)]
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text")]
pub extern "C" fn ct_insert_pair(how: u64, now: u64) -> u32 {
    insert_pair::<V4>(how, now)
}

/// `insert_pair` of IPv6, as `ct_insert_pair`.
#[inline(never)]
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text")]
pub extern "C" fn ct_insert_pair6(how: u64, now: u64) -> u32 {
    insert_pair::<V6>(how, now)
}

/// `reopen_rest` of IPv4, global as `snat_try_port` is.
#[inline(never)]
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text")]
pub extern "C" fn ct_reopen(in_conntrack: u64, proto: u64) -> u32 {
    u32::from(reopen_rest::<V4>(in_conntrack != 0, proto as u8))
}

/// `reopen_rest` of IPv6, as `ct_reopen`.
#[inline(never)]
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text")]
pub extern "C" fn ct_reopen6(in_conntrack: u64, proto: u64) -> u32 {
    u32::from(reopen_rest::<V6>(in_conntrack != 0, proto as u8))
}

/// Inserts the new flow `create` built in this CPU's `Scratch`: its reply
/// entry (`key`, `value`) first, so that once packets are translated their
/// answers already find their way back, then its forward entry
/// (`other_key`, `other_value`), into `CT_NEW`, where an assured flow
/// holding the reply entry's key in `CONNTRACK` goes first. With `ROOM`,
/// while the closed flow's forward entry that `reopen` voided is still in
/// `CONNTRACK`, the new forward entry is written over it first
/// (`overwrite`, which says why that order is safe), and the reply entry
/// put there (`reply_in_room`), overwriting what `CONNTRACK` holds at its
/// key. Either way the copies
/// that said the keys were absent, or were of what `CONNTRACK` held there,
/// go (`flow_cache::put_absent`). With `KEEP`, a live flow of another
/// client tuple holding the reply entry's key in either map is not
/// overwritten: nothing is written, and the reply entry is made two-sided
/// for `create_kept` to claim another port with. With `REMAPPED`, that
/// claim's forward entry (`remapped`).
#[inline(always)]
fn insert_pair<F: Family>(how: u64, now: u64) -> u32 {
    let Some(scratch) = scratch::<F>() else {
        return PAIR_FAILED;
    };
    if how & REMAPPED != 0 {
        return remapped::<F>(scratch, (how >> 16) as u16);
    }
    let assured = F::conntrack().get_ptr(&scratch.key);
    if how & KEEP != 0
        && (assured.is_some_and(|held| another_flows(held, scratch, now))
            || F::ct_new()
                .get_ptr(&scratch.key)
                .is_some_and(|held| another_flows(held, scratch, now)))
    {
        scratch.value.flags |= ct_flags::SNAT;
        return PAIR_CLASH;
    }
    let room =
        how & ROOM != 0 && overwrite::<F>(&scratch.other_key, &raw const scratch.other_value);
    // Each map inserted into at a call site of its own: the verifier
    // calls a site that may see either map through the helper's indirect
    // call, where it calls one map's own insert directly.
    let (reply, forward) = if room {
        (reply_in_room::<F>(scratch), true)
    } else {
        if assured.is_some() {
            remove::<F>(F::conntrack(), &scratch.key);
        }
        let reply = F::ct_new()
            .insert(&scratch.key, &scratch.value, BPF_ANY)
            .is_ok();
        let forward = F::ct_new()
            .insert(&scratch.other_key, &scratch.other_value, BPF_ANY)
            .is_ok();
        (reply, forward)
    };
    flow_cache::invalidate(&scratch.key);
    flow_cache::invalidate(&scratch.other_key);
    prefilter::mark_reply(&scratch.key);
    if room {
        count(counter::CT_REOPENED);
    }
    if reply && forward {
        PAIR_INSERTED
    } else {
        PAIR_FAILED
    }
}

/// Writes `value` over `CONNTRACK`'s entry at `key` if it is one that
/// `reopen` voided for the new flow of its tuple (its clock 0), in place:
/// the room the new flow takes (its reply entry's, `reply_in_room`, where
/// the key is the same). False, writing nothing, when there is
/// none: the entry is gone (evicted, reaped, or never voided: a SYN whose
/// flow was not created left its `Scratch::room_key` behind) or another's.
/// Written before the reply entry, with nothing between this lookup and
/// the write that could hand its node to another entry on this CPU; the
/// reply entry follows at once, long before an answer to anything the
/// forward entry translates can come back. Only a straggler of the same
/// tuple reads the entry meanwhile (one client socket sends it at a time,
/// and this SYN is its newest): it finds the voided entry, the new one, or
/// for the instant of the write a mix of the closed flow's translation
/// and the new one's, of the same Service.
#[inline(always)]
fn overwrite<F: Family>(key: &CtKeyOf<F::Addr>, value: *const CtValueOf<F::Addr>) -> bool {
    let Some(entry) = F::conntrack().get_ptr_mut(key) else {
        return false;
    };
    // SAFETY: a valid map value pointer for this program's run, and this
    // CPU's scratch, which cannot overlap it. Copied, not assigned: see
    // `translation`.
    unsafe {
        if (*entry).last_seen_ns != 0 {
            return false;
        }
        core::ptr::copy_nonoverlapping(value, entry, 1);
    }
    true
}

/// Puts the new flow's reply entry (`key`, `value` in this CPU's `Scratch`)
/// into `CONNTRACK`, in the room of the closed flow it follows: written over
/// that flow's voided reply entry in place when the key is the same (the
/// same backend picked again), as its forward entry was (`overwrite`);
/// otherwise inserted, the voided one removed first if it is still there
/// (a live entry another CPU wrote at its key since is not). Whether it
/// went in.
#[inline(always)]
fn reply_in_room<F: Family>(scratch: &Scratch<F::Addr>) -> bool {
    let old = &scratch.room_reply_key;
    let same = scratch.key.same_ends(old) && scratch.key.proto == old.proto;
    if same {
        if overwrite::<F>(&scratch.key, &raw const scratch.value) {
            return true;
        }
    } else if F::conntrack()
        .get_ptr(old)
        // SAFETY: a pointer the map lookup returned, valid for this
        // program's run.
        .is_some_and(|e| unsafe { (*e).last_seen_ns } == 0)
    {
        remove::<F>(F::conntrack(), old);
    }
    F::conntrack()
        .insert(&scratch.key, &scratch.value, BPF_ANY)
        .is_ok()
}

/// Whether `held`, an entry at the reply key in this CPU's `Scratch`
/// (`key`), is live and another flow's than the one whose forward key is
/// `other_key`. An expired entry, or the flow's own reply entry, is
/// overwritten as before.
#[inline(always)]
fn another_flows<A: FlowAddr>(held: *const CtValueOf<A>, scratch: &Scratch<A>, now: u64) -> bool {
    // SAFETY: a valid map value pointer for the duration of this program.
    let held = unsafe { &*held };
    !expired(held, scratch.key.proto, now) && !answers(held, &scratch.other_key)
}

/// Inserts the forward entry of the flow in this CPU's `Scratch` whose
/// reply entry `create_kept` claimed at `port_be`: two-sided, that port
/// its source. Its key is the reply entry's client and frontend: the
/// claim may have used `other_key`.
#[inline(always)]
fn remapped<F: Family>(scratch: &mut Scratch<F::Addr>, port_be: u16) -> u32 {
    forward_key_into(
        &raw const scratch.value,
        scratch.key.proto,
        &mut scratch.other_key,
    );
    scratch.other_value.flags |= ct_flags::SNAT;
    scratch.other_value.alt_port_be = port_be;
    let forward = F::ct_new()
        .insert(&scratch.other_key, &scratch.other_value, BPF_ANY)
        .is_ok();
    flow_cache::invalidate(&scratch.key);
    flow_cache::invalidate(&scratch.other_key);
    count(counter::CT_PORT_REMAPPED);
    if forward { PAIR_INSERTED } else { PAIR_FAILED }
}

/// Claims `port_be` for the reply entry in this CPU's `Scratch`
/// (`create_snat`) by inserting that entry into `CT_NEW` with it: 1 when
/// it did, 0 when a live flow holds the port. With `reclaim`, the port of
/// a flow never answered is taken, as netfilter drops its unassured
/// entries first when its table is full: a flood of SYNs (or of one-way
/// datagrams) holding every port would otherwise refuse every new flow
/// until its entries expired.
#[inline(always)]
fn try_port<F: Family>(proto: u8, now: u64, port_be: u16, reclaim: bool) -> u32 {
    let Some(scratch) = scratch::<F>() else {
        return 0;
    };
    scratch.key.dport_be = port_be;
    if !port_free::<F>(F::conntrack(), scratch, proto, now, false) {
        return 0;
    }
    // Claimed with NOEXIST, so that two racing CPUs never both win it.
    let mut taken = F::ct_new()
        .insert(&scratch.key, &scratch.value, BPF_NOEXIST)
        .is_err();
    if taken && port_free::<F>(F::ct_new(), scratch, proto, now, reclaim) {
        taken = F::ct_new()
            .insert(&scratch.key, &scratch.value, BPF_NOEXIST)
            .is_err();
    }
    if !taken {
        // The claimed entry is the flow's reply entry: `create_snat`
        // inserts its forward entry next and never this one again.
        prefilter::mark_reply(&scratch.key);
    }
    u32::from(!taken)
}

/// Whether no live flow in `map` holds the SNAT tuple `scratch.key`. An
/// expired flow gives its port up (a closed one only once its closing
/// timeout has passed, netfilter's `TIME_WAIT` after its FINs: its late
/// packets must not reach another client), and with `reclaim` one whose
/// backend never answered
/// (counted `snat_reclaimed`): it is removed whole (its forward entry,
/// looked up at `scratch.other_key`, would still send a straggler to this
/// port), so that the caller can claim the port.
#[inline(always)]
fn port_free<F: Family>(
    map: &Conntrack<F::Addr>,
    scratch: &mut Scratch<F::Addr>,
    proto: u8,
    now: u64,
    reclaim: bool,
) -> bool {
    let Some(old) = map.get_ptr(&scratch.key) else {
        return true;
    };
    // SAFETY: a valid map value pointer for the duration of this program.
    let old = unsafe { &*old };
    let unanswered = reclaim && old.flags & ct_flags::SEEN_REPLY == 0;
    let free = expired(old, proto, now);
    if !free && !unanswered {
        return false;
    }
    if !free {
        count(counter::SNAT_RECLAIMED);
    }
    // Its forward entry goes only while it is still the old flow's: the old
    // client may have opened a newer connection from the same port since,
    // whose forward entry has the same key and another SNAT port.
    if old.dir == ct_dir::REPLY {
        forward_key_into(old, proto, &mut scratch.other_key);
        let still_old = map
            .get_ptr(&scratch.other_key)
            // SAFETY: a pointer the map lookup returned, valid for this
            // program's run.
            .is_some_and(|f| replies_to(unsafe { &*f }, &scratch.key));
        if still_old {
            remove::<F>(map, &scratch.other_key);
        }
    }
    remove::<F>(map, &scratch.key);
    true
}

/// Writes into `key` the forward key of the flow whose reply entry is
/// `reply` (its client and frontend, `alt_*` and `nat_*`), of `proto`:
/// `CtKeyOf::new(alt_addr_be, nat_addr_be, ...)` written in place, since
/// built whole the key's addresses took 32 bytes of its caller's stack,
/// which `tc_ingress6`'s frame has to leave room for (512 bytes for all).
/// A pointer, as `reply` may be a field of the scratch `key` is in.
#[inline(always)]
fn forward_key_into<A: FlowAddr>(reply: *const CtValueOf<A>, proto: u8, key: &mut CtKeyOf<A>) {
    // SAFETY: `reply` is a valid entry, a map's value or the scratch's
    // `value`, another field than `key`: the copies do not overlap.
    unsafe {
        core::ptr::copy_nonoverlapping(&raw const (*reply).alt_addr_be, &raw mut key.src_be, 1);
        core::ptr::copy_nonoverlapping(&raw const (*reply).nat_addr_be, &raw mut key.dst_be, 1);
        key.sport_be = (*reply).alt_port_be;
        key.dport_be = (*reply).nat_port_be;
    }
    key.proto = proto;
    key._pad0 = 0;
    key._pad1 = 0;
}

/// Whether the SNATed flow of forward entry `forward` is the one whose
/// replies have the tuple `reply_key` (backend -> node address, SNAT port).
#[inline(always)]
fn replies_to<A: FlowAddr>(forward: &CtValueOf<A>, reply_key: &CtKeyOf<A>) -> bool {
    forward.dir == ct_dir::FORWARD
        && forward.nat_addr_be.same(&reply_key.src_be)
        && forward.nat_port_be == reply_key.sport_be
        && forward.alt_addr_be.same(&reply_key.dst_be)
        && forward.alt_port_be == reply_key.dport_be
}
