//! The prefilter's question, asked of every parsed packet before any hash
//! map lookup: may it be ours? (`proxy_common::prefilter`.) A no is final:
//! the packet is for no frontend and from no backend, so neither conntrack
//! nor the frontends could know it. Each probe is an array read the
//! verifier inlines, where the lookups it saves hash their keys.

pub use proxy_common::prefilter::Block;
use proxy_common::{FlowAddr, prefilter::word_and_mask};

use crate::{maps::PREFILTER, packet::FlowOf};

/// `None` when `flow` may be for a frontend (its own address and port, or
/// a NodePort's port) or the reply of a translated flow (from a backend);
/// when it cannot, what its destination's block said of the service CIDRs,
/// for `service_cidr::unserved`.
#[inline(always)]
pub fn turned_away<A: FlowAddr>(flow: &FlowOf<A>) -> Option<Block> {
    proxy_common::prefilter::turned_away(
        |word| PREFILTER.get(word).copied(),
        &flow.dst_be.mapped(),
        flow.dport_be,
        &flow.src_be.mapped(),
        flow.sport_be,
        flow.proto,
    )
}

/// `Some` when no frontend may have `flow`'s destination, with what its
/// block said (`proxy_common::prefilter::for_no_frontend`).
#[inline(always)]
pub fn for_no_frontend<A: FlowAddr>(flow: &FlowOf<A>) -> Option<Block> {
    proxy_common::prefilter::for_no_frontend(
        |word| PREFILTER.get(word).copied(),
        &flow.dst_be.mapped(),
        flow.dport_be,
        flow.proto,
    )
}

/// Whether `bit` is set.
#[inline(always)]
pub fn holds(bit: u32) -> bool {
    let (word, mask) = word_and_mask(bit);
    PREFILTER.get(word).is_some_and(|w| *w & mask != 0)
}
