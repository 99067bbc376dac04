//! `tc_ingress`'s hand-on to `tc_ingress6`: the IPv6 tc program put in its
//! slot of the `TC_NEXT` program array before any `tc_ingress` of this
//! load is attached, so that an IPv6 frame costs one program run from tcx
//! rather than two (bench/README.md, "IPv6 at tc by a tail call").
//!
//! `tc_ingress6` is attached after `tc_ingress` all the same, and the
//! array is not pinned: once the agent exits the kernel empties the slot,
//! `tc_ingress` hands IPv6 on down its tcx chain, and the `tc_ingress6`
//! links (pinned) translate it until the next agent's programs take over.
//! So a slot that could not be filled costs that run and nothing else.

use aya::{
    Ebpf,
    maps::{MapData, ProgramArray},
    programs::SchedClassifier,
};
use proxy_common::{TC_NEXT_IPV6, map_names, program_names};

use super::{
    ProgramLoad,
    program_array::{self, ProgramArrayError},
};

/// Puts `tc_ingress6`, which the object's load has loaded already (it is
/// attached too), in its slot. The array returned must be kept for as long
/// as the programs run: dropping it empties the slot.
pub fn fill(
    ebpf: &mut Ebpf,
    loads: &mut Vec<ProgramLoad>,
) -> Result<ProgramArray<MapData>, ProgramArrayError> {
    program_array::fill::<SchedClassifier>(
        ebpf,
        map_names::TC_NEXT,
        &[(program_names::TC_INGRESS6, TC_NEXT_IPV6)],
        loads,
    )
}

/// `fill`; on failure IPv6 goes on down the tcx chain to `tc_ingress6`:
/// said once, and the agent goes on.
pub fn fill_or_chain(
    ebpf: &mut Ebpf,
    loads: &mut Vec<ProgramLoad>,
) -> Option<ProgramArray<MapData>> {
    fill(ebpf, loads)
        .inspect_err(|e| {
            tracing::warn!(
                error = %e,
                "tc_ingress cannot hand IPv6 to tc_ingress6 by a tail call: IPv6 runs both programs of the tcx chain"
            );
        })
        .ok()
}
