//! The prefilter's question, asked of every parsed packet before any hash
//! map lookup: may it be ours? (`proxy_common::prefilter`.) A no is final:
//! the packet is for no frontend and from no backend, so neither conntrack
//! nor the frontends could know it. Each probe is an array read the
//! verifier inlines, where the lookups it saves hash their keys.

use proxy_common::{
    FlowAddr,
    prefilter::{bit, port_bit, side, word_and_mask},
};

use crate::{maps::PREFILTER, packet::FlowOf};

/// Whether `flow` may be for a frontend (its own address and port, or a
/// NodePort's port) or the reply of a translated flow (from a backend).
#[inline(always)]
pub fn may_be_ours<A: FlowAddr>(flow: &FlowOf<A>) -> bool {
    let proto = flow.proto;
    holds(bit(&flow.dst_be.mapped(), flow.dport_be, proto, side::TO))
        || holds(bit(&flow.src_be.mapped(), flow.sport_be, proto, side::FROM))
        || holds(port_bit(flow.dport_be))
}

/// Whether `bit` is set.
#[inline(always)]
pub fn holds(bit: u32) -> bool {
    let (word, mask) = word_and_mask(bit);
    PREFILTER.get(word).is_some_and(|w| *w & mask != 0)
}
