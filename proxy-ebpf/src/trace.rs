//! Records for `ebpf-proxy trace` (`proxy_common::trace`): a new flow
//! translated, rejected or dropped, written into `TRACE_EVENTS` while
//! `TRACE_ON` holds a deadline still ahead of the clock.
//!
//! The same discipline as `event_log`: every site is on a path a packet
//! takes once a flow at most (a new flow, a reject, a drop), never on an
//! established flow's packet or one that passes for no Service, and is one
//! call of an out-of-line, cold function that holds the check of
//! `TRACE_ON` and the writing of the record. Unlike `event_log`'s, that
//! function is global (`no_mangle`, scalar arguments and result): the
//! verifier checks it once, on its own, where it walks a static one again
//! for every state that reaches a site, and `tc_ingress6`, near the
//! verifier's limit, reaches these sites in many. The sites pass what they
//! know by value in registers; the record is written in the ring buffer's
//! slot, never on the stack, where `tc_ingress` and `tc_ingress6` have
//! little to spare.
//! IPv6's addresses are too many for the registers of a call: its record
//! reads the client and frontend from `FLOW_KEY6`, the key of the packet
//! `tc_ingress6` and `xdp_ingress6` are handling.

use aya_ebpf::{
    btf_maps::{Array, RingBuf},
    helpers::bpf_ktime_get_coarse_ns,
    macros::btf_map,
};
use proxy_common::{
    Ct6Key, TraceRecord,
    trace::{self, family, verdict},
};

use crate::{
    family::{Family, V4, V6},
    maps::FLOW_KEY6,
    packet::{Flow, FlowOf},
};

/// `BPF_RB_NO_WAKEUP`: the trace command reads on a timer rather than
/// being woken. A wakeup is an interrupt the kernel raises for the record
/// (`irq_work`), whenever the reader has caught up, which it mostly has: it
/// cost each traced new flow some 7 us in the datapath bench, where the
/// record costs well under one without.
const NO_WAKEUP: u64 = aya_ebpf::bindings::BPF_RB_NO_WAKEUP as u64;

/// The deadline (coarse clock, ns since boot) until which the datapath
/// writes records; 0, or past, for none.
#[btf_map]
pub static TRACE_ON: Array<u64, 1> = Array::new();

#[btf_map]
pub static TRACE_EVENTS: RingBuf<TraceRecord, { trace::RING_BYTES as usize }> = RingBuf::new();

/// What a site says of its packet, in one register: the verdict, the
/// reason, the hook (XDP or tc) and the service id.
#[derive(Clone, Copy)]
struct What(u64);

impl What {
    #[inline(always)]
    fn new(verdict: u8, reason: u8, xdp: bool, service_id: u32) -> Self {
        What(
            u64::from(verdict)
                | u64::from(reason) << 8
                | u64::from(xdp) << 16
                | u64::from(service_id) << 32,
        )
    }
}

/// How a family's records name their packet: IPv4's in registers from the
/// flow, IPv6's from `FLOW_KEY6`.
pub trait Traced: Family {
    /// Puts `flow`'s key where its record reads it, for a packet that left
    /// before the pipeline built it (a packet for no frontend).
    fn keyed(flow: &FlowOf<Self::Addr>);

    /// Records `flow`'s packet, `what` happened to it; `backend_be` and
    /// `backend_port_be` are zero where it has no backend.
    fn record(what: u64, flow: &FlowOf<Self::Addr>, backend_be: &Self::Addr, backend_port_be: u16);
}

impl Traced for V4 {
    #[inline(always)]
    fn keyed(_flow: &Flow) {}

    #[inline(always)]
    fn record(what: u64, f: &Flow, backend_be: &u32, backend_port_be: u16) {
        trace_record(
            what | u64::from(f.proto) << 24,
            u64::from(f.src_be) | u64::from(f.sport_be) << 32,
            u64::from(f.dst_be) | u64::from(f.dport_be) << 32,
            u64::from(*backend_be) | u64::from(backend_port_be) << 32,
        );
    }
}

/// IPv6's addresses are too many for the registers of a call: the record
/// reads the client and frontend from `FLOW_KEY6`, the key of the packet
/// being handled, and takes the backend's address as two words (see
/// `event_log::log6_ports` on pointers).
impl Traced for V6 {
    #[inline(always)]
    fn keyed(flow: &FlowOf<[u32; 4]>) {
        key6(flow);
    }

    #[inline(always)]
    fn record(what: u64, _flow: &FlowOf<[u32; 4]>, backend_be: &[u32; 4], backend_port_be: u16) {
        let pair = |a: u32, b: u32| u64::from(a) | (u64::from(b) << 32);
        trace_record6(
            what,
            pair(backend_be[0], backend_be[1]),
            pair(backend_be[2], backend_be[3]),
            u64::from(backend_port_be),
        );
    }
}

/// A new flow translated to `backend_be`:`backend_port_be`.
#[inline(always)]
pub fn translated<F: Traced>(
    xdp: bool,
    service_id: u32,
    flow: &FlowOf<F::Addr>,
    backend_be: &F::Addr,
    backend_port_be: u16,
) {
    let what = What::new(verdict::TRANSLATED, 0, xdp, service_id);
    F::record(what.0, flow, backend_be, backend_port_be);
}

/// A packet answered with a reject (tc only: XDP leaves them to it);
/// `service_id` 0 for an undefined port of a ClusterIP.
#[inline(always)]
pub fn rejected<F: Traced>(service_id: u32, flow: &FlowOf<F::Addr>) {
    let what = What::new(verdict::REJECTED, 0, false, service_id);
    F::record(what.0, flow, &F::Addr::default(), 0);
}

/// A packet dropped for `reason`.
#[inline(always)]
pub fn dropped<F: Traced>(xdp: bool, reason: u8, service_id: u32, flow: &FlowOf<F::Addr>) {
    let what = What::new(verdict::DROPPED, reason, xdp, service_id);
    F::record(what.0, flow, &F::Addr::default(), 0);
}

/// Puts `flow`'s key into `FLOW_KEY6` for IPv6's record (`Traced::keyed`),
/// where the pipeline has not: a packet that left before its conntrack
/// lookup.
#[inline(always)]
fn key6(flow: &FlowOf<[u32; 4]>) {
    if let Some(key) = FLOW_KEY6.get_ptr_mut(0) {
        // SAFETY: this CPU's entry, used by nothing else meanwhile (see
        // `FLOW_KEY6`).
        unsafe {
            *key = Ct6Key::new(
                flow.src_be,
                flow.dst_be,
                flow.sport_be,
                flow.dport_be,
                flow.proto,
            );
        }
    }
}

/// Whether a trace asks for records now.
#[inline(always)]
fn on() -> bool {
    // SAFETY: a valid array value pointer for this program's run.
    let deadline = TRACE_ON.get_ptr(0).map_or(0, |p| unsafe { *p });
    // SAFETY: a helper that takes no pointers and has no preconditions.
    deadline != 0 && unsafe { bpf_ktime_get_coarse_ns() } < deadline
}

/// The one body of IPv4's sites (see the module's documentation): `what`
/// with the protocol in its fourth byte, then client, frontend and backend
/// as address | port << 32. Returns 0: a global function's result must be
/// a scalar. In `.text`, with the functions the programs call, where aya
/// resolves calls (in the `.text.unlikely.` the compiler gives cold ones,
/// a call landed in another function).
#[cold]
#[inline(never)]
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text")]
pub extern "C" fn trace_record(what: u64, client: u64, frontend: u64, backend: u64) -> u32 {
    if !on() {
        return 0;
    }
    let Some(mut entry) = TRACE_EVENTS.reserve(0) else {
        // The reader is 256 KiB behind: this record is lost.
        return 0;
    };
    let r = entry.as_mut_ptr();
    // SAFETY: a reserved record of the ring buffer, written field by
    // field (every byte: the slot holds what an earlier record left).
    unsafe {
        head(r, what);
        (*r).proto = (what >> 24) as u8;
        (*r).family = family::V4;
        (*r).client_port_be = (client >> 32) as u16;
        (*r).frontend_port_be = (frontend >> 32) as u16;
        (*r).backend_port_be = (backend >> 32) as u16;
        (*r).client_be = [client as u32, 0, 0, 0];
        (*r).frontend_be = [frontend as u32, 0, 0, 0];
        (*r).backend_be = [backend as u32, 0, 0, 0];
    }
    entry.submit(NO_WAKEUP);
    0
}

/// The one body of IPv6's sites: the client and frontend from
/// `FLOW_KEY6`, the backend in two words and its port.
#[cold]
#[inline(never)]
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text")]
pub extern "C" fn trace_record6(
    what: u64,
    backend_lo: u64,
    backend_hi: u64,
    backend_port_be: u64,
) -> u32 {
    if !on() {
        return 0;
    }
    let Some(key) = FLOW_KEY6.get_ptr(0) else {
        return 0;
    };
    let Some(mut entry) = TRACE_EVENTS.reserve(0) else {
        return 0;
    };
    let r = entry.as_mut_ptr();
    // SAFETY: as in `record`; `key` is this CPU's entry of `FLOW_KEY6`.
    unsafe {
        let key = &*key;
        head(r, what);
        (*r).proto = key.proto;
        (*r).family = family::V6;
        (*r).client_port_be = key.sport_be;
        (*r).frontend_port_be = key.dport_be;
        (*r).backend_port_be = backend_port_be as u16;
        // Copies, not assignments: between two maps' memory an assignment
        // is a memmove, a call to a byte loop here (docs/architecture.md,
        // "No calls on a packet's path").
        core::ptr::copy_nonoverlapping(&raw const key.src_be, &raw mut (*r).client_be, 1);
        core::ptr::copy_nonoverlapping(&raw const key.dst_be, &raw mut (*r).frontend_be, 1);
        (*r).backend_be = [
            backend_lo as u32,
            (backend_lo >> 32) as u32,
            backend_hi as u32,
            (backend_hi >> 32) as u32,
        ];
    }
    entry.submit(NO_WAKEUP);
    0
}

/// The fields `What` carries, and the padding.
#[inline(always)]
unsafe fn head(r: *mut TraceRecord, what: u64) {
    // SAFETY: the caller's record.
    unsafe {
        (*r).service_id = (what >> 32) as u32;
        (*r).verdict = what as u8;
        (*r).reason = (what >> 8) as u8;
        (*r).hook = ((what >> 16) & 1) as u8;
        (*r)._pad = 0;
    }
}
