//! The programs for packets another node sent here by direct server return
//! (`tc_dsr`, `tc_dsr6`), loaded and put in their slots of the `TC_DSR`
//! program array before anything is attached, as `xdp_next` does for
//! `xdp_ingress6` and for the same reasons; not pinned either. With a slot
//! empty, such packets pass untranslated, counted `dsr_refused`: the flows
//! another node sends here by direct server return then break, so a node
//! without them says so at start.

use aya::{
    Ebpf,
    maps::{MapData, ProgramArray},
    programs::SchedClassifier,
};
use proxy_common::{TC_DSR_IPV4, TC_DSR_IPV6, map_names, program_names};

use super::{
    ProgramLoad,
    program_array::{self, ProgramArrayError},
};

/// Loads both programs (noting the loads in `loads`) and puts them in
/// their slots. The array returned must be kept for as long as the
/// programs run: dropping it empties the slots.
pub fn fill(
    ebpf: &mut Ebpf,
    loads: &mut Vec<ProgramLoad>,
) -> Result<ProgramArray<MapData>, ProgramArrayError> {
    program_array::fill::<SchedClassifier>(
        ebpf,
        map_names::TC_DSR,
        &[
            (program_names::TC_DSR, TC_DSR_IPV4),
            (program_names::TC_DSR6, TC_DSR_IPV6),
        ],
        loads,
    )
}
/// `fill`; on failure the slots left empty are said once, and the agent
/// goes on: every other flow is served as before.
pub fn fill_or_warn(
    ebpf: &mut Ebpf,
    loads: &mut Vec<ProgramLoad>,
) -> Option<ProgramArray<MapData>> {
    fill(ebpf, loads)
        .inspect_err(|e| {
            tracing::error!(
                error = %e,
                "flows other nodes send here by direct server return are not served"
            );
        })
        .ok()
}
