//! SCTP associations in conntrack: their verification tags (RFC 9260 8.5),
//! as netfilter tracks them. Each direction's entry holds, in its
//! `tcp_max_ack` word, the tag that direction's packets carry (as on the
//! wire; 0 while unknown): the peer's Initiate Tag, learnt from the INIT
//! (the reply's) and the INIT ACK (the client's), or, for an association
//! met mid-way (its entries lost), its first packet's. A packet with
//! another tag is stale or forged, and dropped, as netfilter marks it
//! invalid and kube-proxy drops what netfilter calls invalid.

use proxy_common::{CtValueOf, FlowAddr, PROTO_SCTP, sctp::control};

use super::{Found, other_key, scratch};
use crate::{family::Family, flow_cache, nat::NatOf, packet::FlowOf};

/// The tags of a new flow's forward and reply entries, whose first packet
/// is `flow`: the reply's from an INIT, else the forward's from the
/// packet itself. Not SCTP: 0 and 0.
#[inline(always)]
pub fn first_tags<A>(flow: &FlowOf<A>) -> (u32, u32) {
    if flow.proto != PROTO_SCTP {
        (0, 0)
    } else if flow.tcp_flags == control::INIT {
        (0, flow.sctp_initiate_tag_be())
    } else {
        (flow.sctp_vtag_be(), 0)
    }
}

/// Whether the SCTP packet `flow`, of a known flow whose entry for its
/// direction is `entry` (in its map, `found`, unless a copy), carries the
/// tag it must: an INIT none (RFC 9260 8.5.1); an ABORT or SHUTDOWN
/// COMPLETE with the T bit its sender's own, the one the other direction
/// carries; any other packet its direction's, once known.
#[inline(always)]
pub fn tag_holds<F: Family>(
    entry: &CtValueOf<F::Addr>,
    found: Option<&Found<F::Addr>>,
    flow: &FlowOf<F::Addr>,
    nat: &NatOf<F::Addr>,
) -> bool {
    let vtag = flow.sctp_vtag_be();
    if flow.tcp_flags == control::INIT {
        return vtag == 0;
    }
    if flow.tcp_flags & control::T_BIT == 0 {
        return entry.tcp_max_ack == 0 || vtag == entry.tcp_max_ack;
    }
    // Never a copy: ABORT and SHUTDOWN COMPLETE are not cached
    // (`flow_cache::stamp`).
    let Some(found) = found else {
        return false;
    };
    let other = other_tag::<F>(found, flow, nat);
    other == 0 || vtag == other
}

/// The tag the other direction of the flow of `flow` (at `found`,
/// translated as `nat`) carries; 0 when unknown or gone.
#[inline(always)]
fn other_tag<F: Family>(
    found: &Found<F::Addr>,
    flow: &FlowOf<F::Addr>,
    nat: &NatOf<F::Addr>,
) -> u32 {
    let Some(scratch) = scratch::<F>() else {
        return 0;
    };
    scratch.key = other_key(flow, nat);
    // Each map looked up at a call site of its own (see
    // `conntrack::reopen_rest`).
    let other = if found.unassured {
        F::ct_new().get_ptr(&scratch.key)
    } else {
        F::conntrack().get_ptr(&scratch.key)
    };
    // SAFETY: a pointer the map lookup returned, valid for this program's
    // run.
    other.map_or(0, |p| unsafe { (*p).tcp_max_ack })
}

/// Records the Initiate Tag of the INIT or INIT ACK `flow` (at `found`,
/// translated as `nat`) as the tag the other direction carries from now
/// on: an INIT ACK tells the client's, an INIT met on a live flow (its
/// association restarting) the reply's. Copies of that entry go, so that
/// none checks against the tag it replaces.
#[inline(always)]
pub fn learn<F: Family>(found: &Found<F::Addr>, flow: &FlowOf<F::Addr>, nat: &NatOf<F::Addr>)
where
    F::Addr: FlowAddr,
{
    let Some(scratch) = scratch::<F>() else {
        return;
    };
    scratch.key = other_key(flow, nat);
    // Each map looked up at a call site of its own (see
    // `conntrack::reopen_rest`).
    let other = if found.unassured {
        F::ct_new().get_ptr_mut(&scratch.key)
    } else {
        F::conntrack().get_ptr_mut(&scratch.key)
    };
    if let Some(p) = other {
        // SAFETY: as above; a racing writer stores the same tag.
        unsafe { (*p).tcp_max_ack = flow.sctp_initiate_tag_be() };
        flow_cache::invalidate(&scratch.key);
    }
}
