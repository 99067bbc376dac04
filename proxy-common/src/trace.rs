//! `ebpf-proxy trace`: what the datapath writes into `TRACE_EVENTS` about a
//! new flow, a reject or a drop while `TRACE_ON` holds a deadline in the
//! future (`bpf_ktime_get_coarse_ns`, nanoseconds since boot). The trace
//! command keeps moving the deadline a few seconds ahead and sets it to 0
//! when it exits; one killed without a chance to do so stops costing once
//! its deadline passes. Several traces share the maps: each only ever moves
//! the deadline later, and as `TRACE_EVENTS` is one ring buffer, a record
//! reaches one of them or both (docs/operations.md).

use crate::service_drop;

/// What became of the packet: `TraceRecord::verdict`.
pub mod verdict {
    /// The first packet of a new flow, translated to a backend.
    pub const TRANSLATED: u8 = 1;
    /// A new flow answered with a TCP reset or ICMP unreachable.
    pub const REJECTED: u8 = 2;
    /// A new flow dropped, for `TraceRecord::reason`.
    pub const DROPPED: u8 = 3;
}

/// Why a packet was dropped: `TraceRecord::reason` of `verdict::DROPPED`.
/// The first are `service_drop`'s, whose names the metrics use.
pub mod reason {
    use super::service_drop;

    pub const SOURCE_RANGE: u8 = service_drop::SOURCE_RANGE as u8;
    pub const NO_ENDPOINT: u8 = service_drop::NO_ENDPOINT as u8;
    pub const SNAT_EXHAUSTED: u8 = service_drop::SNAT_EXHAUSTED as u8;
    /// An address of a service CIDR no Service holds (`service_cidr`).
    pub const UNALLOCATED: u8 = 3;
    /// An SCTP packet with a verification tag its association does not
    /// carry (`counter::DROP_SCTP_VTAG`).
    pub const SCTP_VTAG: u8 = 4;
    pub const COUNT: u8 = 5;
    /// The `reason` of each in the trace's output, by number.
    pub const NAMES: [&str; COUNT as usize] = [
        service_drop::NAMES[0],
        service_drop::NAMES[1],
        service_drop::NAMES[2],
        "unallocated",
        "sctp_vtag",
    ];
}

/// Which program wrote the record: `TraceRecord::hook`.
pub mod hook {
    pub const TC: u8 = 0;
    pub const XDP: u8 = 1;
}

/// `TraceRecord::family`.
pub mod family {
    pub const V4: u8 = 4;
    pub const V6: u8 = 6;
}

/// `TRACE_EVENTS`' byte size: 4096 records of 64 bytes (and the ring
/// buffer's 8-byte header each), a second of new flows at a few thousand a
/// second before the reader falls behind and records are lost.
pub const RING_BYTES: u32 = 256 * 1024;

/// How far ahead of now the trace command sets `TRACE_ON`'s deadline; it
/// moves it every second, so a reader killed outright stops the records
/// within this.
pub const DEADLINE_AHEAD_NS: u64 = 3_000_000_000;

/// One record of `TRACE_EVENTS`. Addresses and ports in network order, as
/// on the wire; an IPv4 address is the first word of its field, the rest
/// zero. `frontend` is the address the client sent to, `backend` where the
/// flow was translated to (zeros unless `verdict::TRANSLATED`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(bytemuck::Pod, bytemuck::Zeroable))]
pub struct TraceRecord {
    /// `ServiceValue::service_id`; 0 where no Service port is known (an
    /// unallocated service CIDR address).
    pub service_id: u32,
    pub verdict: u8,
    pub reason: u8,
    pub proto: u8,
    /// `family::V4` or `family::V6`.
    pub family: u8,
    pub hook: u8,
    pub _pad: u8,
    pub client_port_be: u16,
    pub frontend_port_be: u16,
    pub backend_port_be: u16,
    pub client_be: [u32; 4],
    pub frontend_be: [u32; 4],
    pub backend_be: [u32; 4],
}

const _: () = assert!(size_of::<TraceRecord>() == 64);
