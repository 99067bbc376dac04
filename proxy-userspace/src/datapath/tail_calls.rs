//! The program arrays the entry programs tail-call into, each filled at
//! load: its programs loaded and put in their slots before anything that
//! tail-calls into them is attached, so that the first frame finds them
//! there. An upgrade in place or a takeover of pinned links needs nothing
//! more: the programs taking the links over are this load's, and read this
//! load's arrays.
//!
//! - `XDP_NEXT`: `xdp_ingress6`, for what is not IPv4 at XDP. Empty, IPv6
//!   passes to tc, which translates it: IPv6 loses its XDP fast path.
//! - `TC_DSR`: `tc_dsr` and `tc_dsr6`, for packets another node sent here by
//!   direct server return. Empty, such packets pass untranslated, counted
//!   `dsr_refused`, and the flows another node sends here that way break:
//!   a node without them says so at start.
//! - `TC_NEXT`: `tc_ingress6`, for what is not IPv4 at tc, so that an IPv6
//!   frame costs one program run from tcx rather than two (bench/README.md,
//!   "IPv6 at tc by a tail call"). `tc_ingress6` is attached after
//!   `tc_ingress` all the same: empty, `tc_ingress` hands IPv6 on down its
//!   tcx chain, which costs that run and nothing else.
//!
//! No array is pinned. The kernel empties a program array when the last
//! reference to it other than a program's goes (here, the agent's
//! descriptor): once the agent exits, each behaves as empty until the next
//! agent's programs take over.

use aya::{
    Ebpf,
    maps::{MapData, ProgramArray},
    programs::{Program, ProgramError, SchedClassifier, Xdp},
};
use proxy_common::{
    TC_DSR_IPV4, TC_DSR_IPV6, TC_NEXT_IPV6, XDP_NEXT_IPV6, map_names, program_names,
};

use super::{Load, ProgramLoad};

#[derive(Debug, thiserror::Error)]
pub enum TailCallError {
    #[error("the eBPF object has no {0} map")]
    NoMap(&'static str),
    #[error("{name}: {source}")]
    Map {
        name: &'static str,
        source: aya::maps::MapError,
    },
    #[error("loading {name}: {source}")]
    Program {
        name: &'static str,
        source: ProgramError,
    },
    #[error("the eBPF object has no {0} program")]
    NoProgram(&'static str),
}

/// The arrays, held for as long as the programs run, since dropping one
/// empties it. None where the array could not be filled: said once at
/// load, with what it costs (see the module's doc), and the agent goes on.
pub struct TailCalls {
    xdp_next: Option<ProgramArray<MapData>>,
    tc_dsr: Option<ProgramArray<MapData>>,
    tc_next: Option<ProgramArray<MapData>>,
}

impl TailCalls {
    /// Fills the three arrays, noting each program's load in `loads`.
    pub fn fill(ebpf: &mut Ebpf, loads: &mut Vec<ProgramLoad>) -> TailCalls {
        let xdp_next = fill::<Xdp>(
            ebpf,
            map_names::XDP_NEXT,
            &[(program_names::XDP_INGRESS6, XDP_NEXT_IPV6)],
            loads,
        )
        .inspect_err(|e| {
            tracing::warn!(
                error = %e,
                "IPv6 at XDP unavailable: IPv6 north-south traffic is translated at tc"
            );
        });
        let tc_dsr = fill::<SchedClassifier>(
            ebpf,
            map_names::TC_DSR,
            &[
                (program_names::TC_DSR, TC_DSR_IPV4),
                (program_names::TC_DSR6, TC_DSR_IPV6),
            ],
            loads,
        )
        .inspect_err(|e| {
            tracing::error!(
                error = %e,
                "flows other nodes send here by direct server return are not served"
            );
        });
        let tc_next = fill::<SchedClassifier>(
            ebpf,
            map_names::TC_NEXT,
            &[(program_names::TC_INGRESS6, TC_NEXT_IPV6)],
            loads,
        )
        .inspect_err(|e| {
            tracing::warn!(
                error = %e,
                "tc_ingress cannot hand IPv6 to tc_ingress6 by a tail call: IPv6 runs both programs of the tcx chain"
            );
        });
        TailCalls {
            xdp_next: xdp_next.ok(),
            tc_dsr: tc_dsr.ok(),
            tc_next: tc_next.ok(),
        }
    }

    /// Whether `xdp_ingress6` is in its slot.
    pub fn xdp_ingress6(&self) -> bool {
        self.xdp_next.is_some()
    }

    /// Whether `tc_ingress6` is in its slot.
    pub fn tc_ingress6(&self) -> bool {
        self.tc_next.is_some()
    }

    /// Whether `tc_dsr` and `tc_dsr6` are in theirs.
    pub fn dsr(&self) -> bool {
        self.tc_dsr.is_some()
    }
}

/// Takes the array `map` and puts each of `programs` (name, slot), of type
/// `P`, in its slot, loading it first (noted in `loads`) unless it is
/// loaded already.
fn fill<P>(
    ebpf: &mut Ebpf,
    map: &'static str,
    programs: &[(&'static str, u32)],
    loads: &mut Vec<ProgramLoad>,
) -> Result<ProgramArray<MapData>, TailCallError>
where
    P: Load,
    for<'a> &'a mut P: TryFrom<&'a mut Program, Error = ProgramError>,
{
    let in_map = |source| TailCallError::Map { name: map, source };
    let taken = ebpf.take_map(map).ok_or(TailCallError::NoMap(map))?;
    let mut array = ProgramArray::try_from(taken).map_err(in_map)?;
    for &(name, slot) in programs {
        let failed = |source| TailCallError::Program { name, source };
        let program: &mut P = ebpf
            .program_mut(name)
            .ok_or(TailCallError::NoProgram(name))?
            .try_into()
            .map_err(failed)?;
        super::load_noting(program, name, loads).map_err(failed)?;
        array
            .set(slot, program.fd().map_err(failed)?, 0)
            .map_err(in_map)?;
    }
    Ok(array)
}
