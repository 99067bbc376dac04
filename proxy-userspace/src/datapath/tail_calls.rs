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
//!   "Where programs attach"). And `tc_new6`, which `tc_ingress6` hands a
//!   new flow's first packet to. Empty, IPv6 at tc goes untranslated.
//!
//! The kernel empties a program array when the last reference to it other
//! than a program's goes (a descriptor or a pin). `XDP_NEXT` is held by
//! the agent alone: once it exits, IPv6 passes XDP to tc until the next
//! agent's programs take over. `TC_NEXT` and `TC_DSR` are also pinned,
//! each under a name of its own (`PinLayout::tail_call`: the array's name
//! and the program id of the `tc_ingress` that reads it), so that that
//! `tc_ingress` goes on translating IPv6 and learning direct server return
//! flows while no agent runs. The next agent pins its own beside them, and
//! unpins an older one once the `tc_ingress` its name gives is in no
//! interface's tcx chain (`retire_unread`): not before this agent's
//! programs have taken over every link that ran it, however long a takeover
//! takes to land, nor while it runs on an interface the agent was told to
//! leave alone.

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf,
    maps::{Map, MapData, ProgramArray},
    programs::{Program, ProgramError, SchedClassifier, Xdp},
};
use proxy_common::{
    TC_DSR_IPV4, TC_DSR_IPV6, TC_NEXT_IPV6, TC_NEXT_NEW6, XDP_NEXT_IPV6, map_names, program_names,
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
    #[error("the id of the loaded tc_ingress: {0}")]
    Reader(#[source] ProgramError),
    #[error("listing the node's interfaces: {0}")]
    Interfaces(#[source] nix::Error),
    #[error("reading the tcx ingress chain of {ifname}: {source}")]
    Linked {
        ifname: String,
        source: std::io::Error,
    },
}

/// The arrays, held for as long as the programs run, since dropping one
/// empties it. None where the array could not be filled: said once at
/// load, with what it costs (see the module's doc), and the agent goes on.
pub struct TailCalls {
    xdp_next: Option<ProgramArray<MapData>>,
    tc_dsr: Option<ProgramArray<MapData>>,
    tc_next: Option<ProgramArray<MapData>>,
    /// Where `tc_next` and `tc_dsr` are pinned, those that could be.
    own_pins: Vec<PathBuf>,
}

impl TailCalls {
    /// Fills the three arrays, noting each program's load in `loads`, and
    /// pins `TC_NEXT` and `TC_DSR` under `pins`.
    pub fn fill(ebpf: &mut Ebpf, loads: &mut Vec<ProgramLoad>, pins: &PinLayout) -> TailCalls {
        // The pins' names give the `tc_ingress` that reads the arrays.
        let reader = ebpf
            .program(program_names::TC_INGRESS)
            .ok_or(TailCallError::NoProgram(program_names::TC_INGRESS))
            .and_then(|p| p.info().map_err(TailCallError::Reader))
            .map(|info| info.id())
            .inspect_err(|e| {
                tracing::warn!(
                    error = %e,
                    "TC_NEXT and TC_DSR not pinned: from this agent's exit until the next agent's programs take over, IPv6 at tc is not translated and direct server return arrivals are not learnt"
                );
            })
            .ok();
        let pin_at = |map: &'static str, unpinned: &'static str| {
            reader.map(|reader| PinAt {
                path: pins.tail_call(map, reader),
                unpinned,
            })
        };
        let xdp_next = fill::<Xdp>(
            ebpf,
            map_names::XDP_NEXT,
            &[(program_names::XDP_INGRESS6, XDP_NEXT_IPV6)],
            loads,
            None,
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
            pin_at(
                map_names::TC_DSR,
                "flows other nodes send here by direct server return are not served from this agent's exit until the next agent's programs take over",
            ),
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
            &[
                (program_names::TC_INGRESS6, TC_NEXT_IPV6),
                (program_names::TC_NEW6, TC_NEXT_NEW6),
            ],
            loads,
            pin_at(
                map_names::TC_NEXT,
                "IPv6 at tc is not translated from this agent's exit until the next agent's programs take over",
            ),
        )
        .inspect_err(|e| {
            tracing::error!(
                error = %e,
                "tc_ingress cannot hand IPv6 to tc_ingress6: IPv6 Services are not served at tc"
            );
        });
        let own_pins = [&tc_next, &tc_dsr]
            .into_iter()
            .filter_map(|filled| filled.as_ref().ok()?.1.clone())
            .collect();
        TailCalls {
            xdp_next: xdp_next.ok().map(|(array, _)| array),
            tc_dsr: tc_dsr.ok().map(|(array, _)| array),
            tc_next: tc_next.ok().map(|(array, _)| array),
            own_pins,
        }
    }

    /// Unpins every program array under `pins` but this agent's whose
    /// `tc_ingress` (named in its pin, `PinLayout::tail_call`) is linked
    /// into no tcx ingress chain of this namespace: the arrays of earlier
    /// agents whose programs no longer run anywhere. An earlier release's
    /// pin, which names the array and not its reader, goes once `attached`
    /// (this agent's programs are), as that release had it. Returns how
    /// many went. An error reading the chains keeps every pin (asked again
    /// later); a pin that cannot be removed is said and kept.
    pub fn retire_unread(&self, pins: &PinLayout, attached: bool) -> Result<usize, TailCallError> {
        let older: Vec<PathBuf> = match std::fs::read_dir(pins.tail_calls_dir()) {
            Ok(entries) => entries
                .flatten()
                .map(|e| e.path())
                .filter(|path| !self.own_pins.contains(path))
                .collect(),
            Err(_) => return Ok(0),
        };
        if older.is_empty() {
            return Ok(0);
        }
        let linked = linked_tc_programs()?;
        let mut retired = 0;
        for path in older {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            let unread = match PinLayout::tail_call_reader(name) {
                Some(reader) => !linked.contains(&reader),
                None => attached,
            };
            if !unread {
                continue;
            }
            match std::fs::remove_file(&path) {
                Ok(()) => retired += 1,
                Err(e) => {
                    tracing::warn!(pin = %path.display(), error = %e, "unpinning an earlier agent's program array");
                }
            }
        }
        Ok(retired)
    }

    /// Whether `xdp_ingress6` is in its slot.
    pub fn xdp_ingress6(&self) -> bool {
        self.xdp_next.is_some()
    }

    /// Whether `tc_ingress6` and `tc_new6` are in their slots.
    pub fn tc_ingress6(&self) -> bool {
        self.tc_next.is_some()
    }

    /// Whether `tc_dsr` and `tc_dsr6` are in theirs.
    pub fn dsr(&self) -> bool {
        self.tc_dsr.is_some()
    }
}

/// Where to pin an array, and what its being unpinned costs once the
/// agent exits (said where the pin fails).
struct PinAt {
    path: PathBuf,
    unpinned: &'static str,
}

/// Takes the array `map` and puts each of `programs` (name, slot), of type
/// `P`, in its slot, loading it first (noted in `loads`) unless it is
/// loaded already; then pins it as `pin` says, if it says. With the array,
/// where it was pinned: a failed pin is said and leaves it unpinned.
fn fill<P>(
    ebpf: &mut Ebpf,
    map: &'static str,
    programs: &[(&'static str, u32)],
    loads: &mut Vec<ProgramLoad>,
    pin: Option<PinAt>,
) -> Result<(ProgramArray<MapData>, Option<PathBuf>), TailCallError>
where
    P: Load,
    for<'a> &'a mut P: TryFrom<&'a mut Program, Error = ProgramError>,
{
    let in_map = |source| TailCallError::Map { name: map, source };
    let mut taken = ebpf.take_map(map).ok_or(TailCallError::NoMap(map))?;
    let mut array = ProgramArray::try_from(&mut taken).map_err(in_map)?;
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
    let pinned = pin.and_then(|at| {
        pin_map(&taken, map, &at.path)
            .inspect_err(|e| tracing::warn!(error = %e, "{}", at.unpinned))
            .ok()
            .map(|()| at.path)
    });
    Ok((ProgramArray::try_from(taken).map_err(in_map)?, pinned))
}

/// Pins `map`, named `name`, at `path`, in place of anything pinned there,
/// through the descriptor the agent holds: opening it again by its id
/// would need `CAP_SYS_ADMIN`, which the DaemonSet does not grant.
fn pin_map(map: &Map, name: &'static str, path: &Path) -> Result<(), TailCallError> {
    let _ = std::fs::remove_file(path);
    map.pin(path).map_err(|e| TailCallError::Pin {
        name,
        path: path.display().to_string(),
        source: e.into(),
    })
}

/// The ids of the programs linked into the tcx ingress chain of any
/// interface of this network namespace. An interface gone between the
/// listing and its query has none.
fn linked_tc_programs() -> Result<HashSet<u32>, TailCallError> {
    let mut linked = HashSet::new();
    let ifaces = nix::net::if_::if_nameindex().map_err(TailCallError::Interfaces)?;
    for iface in &ifaces {
        match super::attach::tcx_ingress_ids(iface.index()) {
            Ok(ids) => linked.extend(ids),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => {}
            Err(source) => {
                return Err(TailCallError::Linked {
                    ifname: iface.name().to_string_lossy().into_owned(),
                    source,
                });
            }
        }
    }
    Ok(linked)
}
