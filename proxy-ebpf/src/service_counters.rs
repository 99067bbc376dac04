//! Each Service port's counters (`proxy_common::ServiceCounters`), in this
//! CPU's entry of `SERVICE_COUNTERS` at the port's service id: plain adds
//! to a per-CPU array, whose lookup the verifier inlines, so that an
//! established flow's packet costs no helper call. An id past the array
//! (more Service ports than the agent sized it for) is not counted.
//!
//! Built without the `service-counters` feature every function here is
//! empty: what the datapath benchmark compares against.

use proxy_common::{ServiceCounters, ct_dir, service_drop};

use crate::{hook::Hook, maps::SERVICE_COUNTERS, packet::ETH_HLEN};

const ENABLED: bool = cfg!(feature = "service-counters");

/// This CPU's counters of `service_id`.
#[inline(always)]
fn of(service_id: u32) -> Option<&'static mut ServiceCounters> {
    if !ENABLED {
        return None;
    }
    // SAFETY: this CPU's entry; tc, XDP and the socket hooks run one
    // program at a time on a CPU, neither interrupting another.
    SERVICE_COUNTERS
        .get_ptr_mut(service_id)
        .map(|p| unsafe { &mut *p })
}

/// The length of the packet's IP datagram (for a GRO packet at tc, its
/// segments' together): what the hook sees, less the Ethernet header.
#[inline(always)]
fn ip_bytes<H: Hook>(ctx: &H) -> u64 {
    ctx.wire_len().saturating_sub(ETH_HLEN) as u64
}

/// A packet of a known flow, read from its conntrack entry (`service_id`
/// and `dir`, before the entry is touched), counted once it is on its way.
#[derive(Clone, Copy)]
pub struct Seen {
    /// The service id, and the direction in the low bit: one register, as
    /// `tc_ingress` has little stack left to spill to.
    tagged: u64,
}

impl Seen {
    #[inline(always)]
    pub fn of(service_id: u32, dir: u8) -> Self {
        Seen {
            tagged: u64::from(service_id) << 1 | u64::from(dir & 1),
        }
    }

    #[inline(always)]
    pub fn count<H: Hook>(self, ctx: &H) {
        if let Some(c) = of((self.tagged >> 1) as u32) {
            let dir = (self.tagged & 1) as usize;
            c.packets[dir] += 1;
            c.bytes[dir] += ip_bytes(ctx);
        }
    }
}

/// The first packet of a new flow to `service_id`, on its way (tc, XDP).
#[inline(always)]
pub fn new_flow<H: Hook>(ctx: &H, service_id: u32) {
    if let Some(c) = of(service_id) {
        c.flows += 1;
        c.packets[ct_dir::FORWARD as usize] += 1;
        c.bytes[ct_dir::FORWARD as usize] += ip_bytes(ctx);
    }
}

/// A `connect()` of the node's sent to a backend of `service_id` by the
/// socket hook: its packets pass no translation, so only the flow counts.
#[inline(always)]
pub fn connected(service_id: u32) {
    if let Some(c) = of(service_id) {
        c.flows += 1;
    }
}

/// A new flow to `service_id` refused for want of endpoints.
#[inline(always)]
pub fn rejected(service_id: u32) {
    if let Some(c) = of(service_id) {
        c.rejected = c.rejected.wrapping_add(1);
    }
}

/// A new flow to `service_id` dropped: its client is outside the source
/// ranges.
#[inline(always)]
pub fn source_range(service_id: u32) {
    dropped(service_id, service_drop::SOURCE_RANGE);
}

/// A new flow to `service_id` dropped: no endpoint its policy allows.
#[inline(always)]
pub fn no_endpoint(service_id: u32) {
    dropped(service_id, service_drop::NO_ENDPOINT);
}

/// A new flow to `service_id` dropped: no SNAT port was free.
#[inline(always)]
pub fn snat_exhausted(service_id: u32) {
    dropped(service_id, service_drop::SNAT_EXHAUSTED);
}

/// A new flow to `service_id` dropped, for `reason` (`service_drop`).
#[inline(always)]
fn dropped(service_id: u32, reason: u32) {
    if let Some(c) = of(service_id) {
        let slot = &mut c.dropped[(reason % service_drop::COUNT) as usize];
        *slot = slot.wrapping_add(1);
    }
}
