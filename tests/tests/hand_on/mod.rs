//! `tc_ingress`'s hand-on to `tc_ingress6` (`TC_NEXT`), reached from outside
//! the agent as `bpftool` would reach it, by the program's own map ids, so
//! that tests and benches can empty and fill its slot as the kernel and the
//! agent do: where the agent could not fill it, IPv6 passes untouched.

use aya::{
    maps::{Map, MapData, ProgramArray},
    programs::ProgramFd,
};
use proxy_common::{TC_NEXT_IPV6, map_names};
use proxy_userspace::datapath::Datapath;

/// `TC_NEXT` of a loaded datapath, with a descriptor of its `tc_ingress6`
/// to put back. The datapath holds its own descriptor of the array for as
/// long as it runs, so this one may be dropped at any time.
pub struct HandOn {
    array: ProgramArray<MapData>,
    tc6: ProgramFd,
}

impl HandOn {
    /// Opens `datapath`'s `TC_NEXT`; panics, naming what is missing, where
    /// `tc_ingress` has no such map.
    pub fn open(datapath: &Datapath) -> HandOn {
        let info = datapath.tc_program().info().expect("tc_ingress's info");
        let map = info
            .map_ids()
            .expect("tc_ingress's map ids")
            .expect("the kernel lists a program's maps")
            .into_iter()
            .map(|id| MapData::from_id(id).expect("a map of tc_ingress by its id"))
            .find(|m| {
                m.info()
                    .is_ok_and(|i| i.name_as_str() == Some(map_names::TC_NEXT))
            })
            .expect("tc_ingress uses no map named TC_NEXT");
        let array =
            ProgramArray::try_from(Map::ProgramArray(map)).expect("TC_NEXT as a program array");
        let tc6 = datapath
            .tc6_program()
            .fd()
            .expect("tc_ingress6's descriptor")
            .try_clone()
            .expect("a copy of tc_ingress6's descriptor");
        HandOn { array, tc6 }
    }

    /// Fills the slot with `tc_ingress6` (`true`) or empties it.
    pub fn set(&mut self, on: bool) {
        if on {
            self.array
                .set(TC_NEXT_IPV6, &self.tc6, 0)
                .expect("filling TC_NEXT's slot");
        } else {
            self.array
                .clear_index(&TC_NEXT_IPV6)
                .expect("emptying TC_NEXT's slot");
        }
    }
}
