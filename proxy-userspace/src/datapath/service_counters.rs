//! Each Service port's counters (`SERVICE_COUNTERS`, proxy-ebpf's
//! `service_counters`): their totals over CPUs for the metrics, and the
//! reset of an id's slot when the planner gives the id to a Service port
//! or takes it back, so that a port never shows another's totals.
//!
//! The map is never pinned: each agent creates it at load, sized by
//! `--service-counters`, and hands its descriptor to whoever reads it.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use aya::maps::{MapData, MapError, PerCpuArray};
use proxy_common::{ServiceCounters, service_drop};

use super::batch;

/// Why counters could not be read or reset.
#[derive(Debug, thiserror::Error)]
pub enum ServiceCountersError {
    #[error("reading the possible CPUs: {0}")]
    Cpus(std::io::Error),
    #[error("resetting the counters of service id {id}: {source}")]
    Reset {
        id: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("reading the counters of service id {id}: {source}")]
    Read {
        id: u32,
        #[source]
        source: MapError,
    },
    #[error("duplicating the counters' descriptor: {0}")]
    Dup(std::io::Error),
    #[error("opening the counters' duplicate descriptor: {0}")]
    Open(MapError),
}

/// Zeroes every CPU's counters of each id in `ids`, in the map behind
/// `fd`. An id past the map's end has none to zero (the datapath counts
/// only ids below its size). Takes a descriptor, so that the thread
/// writing a batch's names can reset them as it goes.
pub fn reset(fd: BorrowedFd<'_>, ids: &[u32]) -> Result<(), ServiceCountersError> {
    if ids.is_empty() {
        return Ok(());
    }
    let cpus = aya::util::nr_cpus().map_err(|(_, e)| ServiceCountersError::Cpus(e))?;
    // A per-CPU value is each possible CPU's, one after the other.
    let zeros = vec![ServiceCounters::default(); cpus];
    for &id in ids {
        let key = std::ptr::from_ref(&id).cast();
        // SAFETY: `key` is a u32 (the array's key) and the value holds one
        // `ServiceCounters` for each possible CPU, the map's value size
        // times their number.
        match unsafe { batch::update_elem(fd.as_raw_fd() as u32, key, zeros.as_ptr().cast()) } {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::E2BIG) => {}
            Err(source) => return Err(ServiceCountersError::Reset { id, source }),
        }
    }
    Ok(())
}

/// One Service port's counters summed over CPUs: the 32-bit ones widened,
/// so that their sum does not wrap sooner than each CPU's count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub packets: [u64; 2],
    pub bytes: [u64; 2],
    pub flows: u64,
    pub rejected: u64,
    pub dropped: [u64; service_drop::COUNT as usize],
}

/// The totals of service id `id`; None past the map's end.
pub fn total(
    map: &PerCpuArray<MapData, ServiceCounters>,
    id: u32,
) -> Result<Option<Totals>, ServiceCountersError> {
    if id >= map.len() {
        return Ok(None);
    }
    let per_cpu = map
        .get(&id, 0)
        .map_err(|source| ServiceCountersError::Read { id, source })?;
    let mut sum = Totals::default();
    for c in per_cpu.iter() {
        for dir in 0..2 {
            sum.packets[dir] = sum.packets[dir].wrapping_add(c.packets[dir]);
            sum.bytes[dir] = sum.bytes[dir].wrapping_add(c.bytes[dir]);
        }
        sum.flows = sum.flows.wrapping_add(c.flows);
        sum.rejected += u64::from(c.rejected);
        for (s, d) in sum.dropped.iter_mut().zip(c.dropped) {
            *s += u64::from(d);
        }
    }
    Ok(Some(sum))
}

/// A handle of its own on `map` (a duplicate descriptor), for a reader on
/// another thread.
pub fn duplicate(
    map: &PerCpuArray<MapData, ServiceCounters>,
) -> Result<PerCpuArray<MapData, ServiceCounters>, ServiceCountersError> {
    use aya::maps::IterableMap;
    let fd = map
        .map()
        .fd()
        .as_fd()
        .try_clone_to_owned()
        .map_err(ServiceCountersError::Dup)?;
    let data = MapData::from_fd(fd).map_err(ServiceCountersError::Open)?;
    PerCpuArray::try_from(aya::maps::Map::PerCpuArray(data)).map_err(ServiceCountersError::Open)
}
