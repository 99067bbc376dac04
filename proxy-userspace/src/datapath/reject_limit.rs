//! The node's budget of rejects (`REJECT_LIMIT`): the datapath answers a
//! packet to a frontend without endpoints with a RST or an ICMP error, and
//! holds those answers to the limit the kernel holds its own ICMP errors
//! to, read from this node's sysctls at each load (the map is not pinned).
//! Until it is written, or where the sysctls cannot be read, the datapath
//! keeps the kernel's defaults.

use std::{fs, io, path::Path};

use aya::{
    Ebpf,
    maps::{Array, MapError},
};
use proxy_common::{RejectLimit, map_names};

#[derive(Debug, thiserror::Error)]
pub enum RejectLimitError {
    #[error("reading {path}: {source}")]
    Read {
        path: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{path} holds {value:?}, not a count")]
    Parse { path: &'static str, value: String },
    #[error("the eBPF object has no {} map", map_names::REJECT_LIMIT)]
    NoMap,
    #[error("{name}: {source}", name = map_names::REJECT_LIMIT)]
    Map {
        #[from]
        source: MapError,
    },
}

const MSGS_PER_SEC: &str = "/proc/sys/net/ipv4/icmp_msgs_per_sec";
const MSGS_BURST: &str = "/proc/sys/net/ipv4/icmp_msgs_burst";

/// The node's limits: `(per second, burst)`, as its kernel applies them to
/// ICMP errors of both families.
pub fn node_limits() -> Result<(u32, u32), RejectLimitError> {
    Ok((read_count(MSGS_PER_SEC)?, read_count(MSGS_BURST)?))
}

fn read_count(path: &'static str) -> Result<u32, RejectLimitError> {
    let text = fs::read_to_string(Path::new(path))
        .map_err(|source| RejectLimitError::Read { path, source })?;
    let value = text.trim();
    // The kernel takes a negative value and clamps it to 0 when it uses it.
    match value.parse::<i64>() {
        Ok(n) => Ok(u32::try_from(n.max(0)).unwrap_or(u32::MAX)),
        Err(_) => Err(RejectLimitError::Parse {
            path,
            value: value.to_owned(),
        }),
    }
}

/// Writes `per_sec` and `burst` into the loaded object's `REJECT_LIMIT`,
/// its bucket full.
pub fn write(ebpf: &mut Ebpf, per_sec: u32, burst: u32) -> Result<(), RejectLimitError> {
    let map = ebpf
        .map_mut(map_names::REJECT_LIMIT)
        .ok_or(RejectLimitError::NoMap)?;
    let mut array: Array<_, RejectLimit> = Array::try_from(map)?;
    let limit = RejectLimit {
        msgs_per_sec: per_sec,
        burst,
        configured: 1,
        credit: burst,
        stamp_ns: 0,
    };
    array.set(0, limit, 0)?;
    Ok(())
}

/// `write` of the node's limits; where they cannot be read or written the
/// datapath keeps the kernel's defaults, which is said once.
pub fn write_node_limits(ebpf: &mut Ebpf) {
    let written = node_limits().and_then(|(per_sec, burst)| {
        write(ebpf, per_sec, burst)?;
        Ok((per_sec, burst))
    });
    match written {
        Ok((per_sec, burst)) => {
            tracing::debug!(per_sec, burst, "rejects limited as the node's ICMP errors");
        }
        Err(e) => tracing::warn!(
            error = %e,
            "rejects limited by the kernel's default ICMP error budget (1000/s, burst 50)"
        ),
    }
}
