//! A program array filled at load: each program loaded and put in its slot
//! before anything that tail-calls into it is attached (`xdp_next`,
//! `tc_dsr`, `tc_next`). Never pinned: the kernel empties a program array
//! when the last reference to it other than a program's goes, so the array
//! returned is held for as long as the programs run.

use aya::{
    Ebpf,
    maps::{MapData, ProgramArray},
    programs::{Program, ProgramError},
};

use super::{Load, ProgramLoad};

#[derive(Debug, thiserror::Error)]
pub enum ProgramArrayError {
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

/// Takes the array `map` and puts each of `programs` (name, slot), of type
/// `P`, in its slot, loading it first (noted in `loads`) unless it is
/// loaded already.
pub fn fill<P>(
    ebpf: &mut Ebpf,
    map: &'static str,
    programs: &[(&'static str, u32)],
    loads: &mut Vec<ProgramLoad>,
) -> Result<ProgramArray<MapData>, ProgramArrayError>
where
    P: Load,
    for<'a> &'a mut P: TryFrom<&'a mut Program, Error = ProgramError>,
{
    let in_map = |source| ProgramArrayError::Map { name: map, source };
    let taken = ebpf.take_map(map).ok_or(ProgramArrayError::NoMap(map))?;
    let mut array = ProgramArray::try_from(taken).map_err(in_map)?;
    for &(name, slot) in programs {
        let failed = |source| ProgramArrayError::Program { name, source };
        let program: &mut P = ebpf
            .program_mut(name)
            .ok_or(ProgramArrayError::NoProgram(name))?
            .try_into()
            .map_err(failed)?;
        super::load_noting(program, name, loads).map_err(failed)?;
        array
            .set(slot, program.fd().map_err(failed)?, 0)
            .map_err(in_map)?;
    }
    Ok(array)
}
