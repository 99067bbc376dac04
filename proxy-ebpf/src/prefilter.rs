//! The prefilter's question, asked of every parsed packet before any hash
//! map lookup: may it be ours? (`proxy_common::prefilter`.) A no is final:
//! the packet is for no frontend and the reply of no flow, so neither
//! conntrack nor the frontends could know it. Each probe is an array read
//! the verifier inlines, where the lookups it saves hash their keys. And
//! the mark a new flow leaves for its replies (`mark_reply`).

pub use proxy_common::prefilter::Block;
use proxy_common::{
    CtKeyOf, FlowAddr,
    prefilter::{flows, word_and_mask},
};

use crate::{
    maps::{PREFILTER, PREFILTER_FLOWS},
    packet::FlowOf,
};

/// `None` when `flow` may be for a frontend (its own address and port, or
/// a NodePort's port) or the reply of a translated flow (its tuple
/// marked); when it cannot, what its destination's block said of the
/// service CIDRs, for `service_cidr::unserved`.
#[inline(always)]
pub fn turned_away<A: FlowAddr>(flow: &FlowOf<A>) -> Option<Block> {
    proxy_common::prefilter::turned_away(
        |word| PREFILTER.get(word).copied(),
        |slot| {
            let (word, shift) = flows::word_and_shift(slot);
            PREFILTER_FLOWS
                .get(word)
                .is_none_or(|w| (*w >> shift) & u64::from(flows::BOTH) != 0)
        },
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

/// Marks the slot of `key`, a flow's reply entry just inserted, so that its
/// replies pass the prefilter. A plain byte store (see
/// `proxy_common::prefilter::flows`).
#[inline(always)]
pub fn mark_reply<A: FlowAddr>(key: &CtKeyOf<A>) {
    let slot = flows::slot(
        &key.src_be.mapped(),
        key.sport_be,
        &key.dst_be.mapped(),
        key.dport_be,
        key.proto,
    );
    let (word, shift) = flows::word_and_shift(slot);
    if let Some(w) = PREFILTER_FLOWS.get_ptr_mut(word) {
        // SAFETY: a pointer into the array's value of `word`, valid for
        // this program's run; `shift / 8` is below its 8 bytes.
        unsafe { core::ptr::write_volatile(w.cast::<u8>().add((shift / 8) as usize), flows::BOTH) };
    }
}
