//! `xdp_ingress`'s hand-on to `xdp_ingress6`: the IPv6 XDP program loaded
//! and put in its slot of the `XDP_NEXT` program array, before any
//! `xdp_ingress` of this load is attached, so that the first frame it sees
//! finds it there. An upgrade in place or a takeover of pinned links needs
//! nothing more: the program taking the links over is this load's, and
//! reads this load's array.
//!
//! The array is not pinned. The kernel empties a program array when the last
//! reference to it other than a program's goes (here, the agent's
//! descriptor): once the agent exits, `xdp_ingress` finds the slot empty and
//! passes IPv6 to tc, which translates it as before, until the next agent's
//! programs take over.

use aya::{
    Ebpf,
    maps::{MapData, ProgramArray},
    programs::Xdp,
};
use proxy_common::{XDP_NEXT_IPV6, map_names, program_names};

use super::{
    ProgramLoad,
    program_array::{self, ProgramArrayError},
};

/// Loads `xdp_ingress6` (noting the load in `loads`) and puts it in its
/// slot. The array returned must be kept for as long as the programs run:
/// dropping it empties the slot.
pub fn fill(
    ebpf: &mut Ebpf,
    loads: &mut Vec<ProgramLoad>,
) -> Result<ProgramArray<MapData>, ProgramArrayError> {
    program_array::fill::<Xdp>(
        ebpf,
        map_names::XDP_NEXT,
        &[(program_names::XDP_INGRESS6, XDP_NEXT_IPV6)],
        loads,
    )
}

/// `fill`; on failure (a kernel or verifier that refuses `xdp_ingress6`) the
/// slot stays empty and IPv6 is translated at tc, which costs IPv6's XDP
/// fast path and nothing else: said once, and the agent goes on.
pub fn fill_or_leave_to_tc(
    ebpf: &mut Ebpf,
    loads: &mut Vec<ProgramLoad>,
) -> Option<ProgramArray<MapData>> {
    fill(ebpf, loads)
        .inspect_err(|e| {
            tracing::warn!(
                error = %e,
                "IPv6 at XDP unavailable: IPv6 north-south traffic is translated at tc"
            );
        })
        .ok()
}
