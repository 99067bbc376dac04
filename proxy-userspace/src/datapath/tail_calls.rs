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
//! - `TC_NEXT`: `tc_ingress6`, for what is not IPv4 at tc, which is how IPv6
//!   reaches its program there: `tc_ingress` is the one program the agent
//!   links into an interface's tcx chain, and hands on down the chain
//!   (`TCX_NEXT`) every packet it does not take, so a second program there
//!   would run on every IPv4 packet as well (docs/architecture.md,
//!   "Where programs attach").
//!
//! The kernel empties a program array when the last reference to it other
//! than a program's goes (a descriptor or a pin). `XDP_NEXT` and `TC_DSR`
//! are held by the agent alone: once it exits, each behaves as empty until
//! the next agent's programs take over. `TC_NEXT` is also pinned, under a
//! name of its own (`PinLayout::tc_next`, by the array's id), so that the
//! `tc_ingress` it serves goes on translating IPv6 while no agent runs;
//! the next agent pins its own beside it and unpins the older ones once
//! its programs have taken the links over (`retire_older_tc_next`).

use std::path::{Path, PathBuf};

use aya::{
    Ebpf,
    maps::{Map, MapData, ProgramArray},
    programs::{Program, ProgramError, SchedClassifier, Xdp},
};
use proxy_common::{
    TC_DSR_IPV4, TC_DSR_IPV6, TC_NEXT_IPV6, XDP_NEXT_IPV6, map_names, program_names,
};

use super::{Load, PinLayout, ProgramLoad};

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
    #[error("pinning {name} at {path}: {source}")]
    Pin {
        name: &'static str,
        path: String,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// The arrays, held for as long as the programs run, since dropping one
/// empties it. None where the array could not be filled: said once at
/// load, with what it costs (see the module's doc), and the agent goes on.
pub struct TailCalls {
    xdp_next: Option<ProgramArray<MapData>>,
    tc_dsr: Option<ProgramArray<MapData>>,
    tc_next: Option<ProgramArray<MapData>>,
    /// Where `tc_next` is pinned, when it could be.
    tc_next_pin: Option<PathBuf>,
}

impl TailCalls {
    /// Fills the three arrays, noting each program's load in `loads`, and
    /// pins `TC_NEXT` under `pins`.
    pub fn fill(ebpf: &mut Ebpf, loads: &mut Vec<ProgramLoad>, pins: &PinLayout) -> TailCalls {
        let xdp_next = fill::<Xdp>(
            ebpf,
            map_names::XDP_NEXT,
            &[(program_names::XDP_INGRESS6, XDP_NEXT_IPV6)],
            loads,
        )
        .map(|(array, _)| array)
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
        .map(|(array, _)| array)
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
            tracing::error!(
                error = %e,
                "tc_ingress cannot hand IPv6 to tc_ingress6: IPv6 Services are not served at tc"
            );
        });
        let tc_next_pin = tc_next.as_ref().ok().and_then(|(_, id)| {
            let path = pins.tc_next(*id);
            pin_by_id(*id, &path)
                .inspect_err(|e| {
                    tracing::warn!(
                        error = %e,
                        "IPv6 at tc is not translated from this agent's exit until the next agent's programs take over"
                    );
                })
                .ok()
                .map(|()| path)
        });
        TailCalls {
            xdp_next: xdp_next.ok(),
            tc_dsr: tc_dsr.ok(),
            tc_next: tc_next.ok().map(|(array, _)| array),
            tc_next_pin,
        }
    }

    /// Unpins every `TC_NEXT` under `pins` but this agent's: the arrays of
    /// earlier agents, which served their `tc_ingress` on links this
    /// agent's programs have now taken over. Returns how many went; one
    /// that cannot be removed is said and tried again next time.
    pub fn retire_older_tc_next(&self, pins: &PinLayout) -> usize {
        let Some(own) = &self.tc_next_pin else {
            return 0;
        };
        retire_other_pins(&pins.tail_calls_dir(), own)
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
/// loaded already. With the array, the kernel's id of it.
fn fill<P>(
    ebpf: &mut Ebpf,
    map: &'static str,
    programs: &[(&'static str, u32)],
    loads: &mut Vec<ProgramLoad>,
) -> Result<(ProgramArray<MapData>, u32), TailCallError>
where
    P: Load,
    for<'a> &'a mut P: TryFrom<&'a mut Program, Error = ProgramError>,
{
    let in_map = |source| TailCallError::Map { name: map, source };
    let taken = ebpf.take_map(map).ok_or(TailCallError::NoMap(map))?;
    let id = match &taken {
        Map::ProgramArray(data) => data.info().map_err(in_map)?.id(),
        _ => return Err(TailCallError::NoMap(map)),
    };
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
    Ok((array, id))
}

/// Pins the map of id `id` at `path`, through a descriptor of its own.
fn pin_by_id(id: u32, path: &Path) -> Result<(), TailCallError> {
    let failed = |source: Box<dyn std::error::Error + Send + Sync>| TailCallError::Pin {
        name: map_names::TC_NEXT,
        path: path.display().to_string(),
        source,
    };
    let data = MapData::from_id(id).map_err(|e| failed(e.into()))?;
    let _ = std::fs::remove_file(path);
    data.pin(path).map_err(|e| failed(e.into()))
}

/// Removes every pin in `dir` but `own`; how many went.
fn retire_other_pins(dir: &Path, own: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut retired = 0;
    for path in entries.flatten().map(|e| e.path()) {
        if path == own {
            continue;
        }
        match std::fs::remove_file(&path) {
            Ok(()) => retired += 1,
            Err(e) => {
                tracing::warn!(pin = %path.display(), error = %e, "unpinning an earlier agent's TC_NEXT");
            }
        }
    }
    retired
}
