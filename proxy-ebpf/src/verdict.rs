//! What the pipelines' decisions become in each hook's terms
//! (`Verdicts`): the return code, and the replies and redirects only that
//! hook can send. tc finishes everything; XDP finishes what it can send
//! back out of the interface it came in on, and leaves the rest untouched
//! to tc, which runs the same pipeline.

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, xdp_action},
    programs::{TcContext, XdpContext},
};
use proxy_common::{PROTO_TCP, counter};

use crate::{
    event_log::Event,
    family::Family,
    hook::{Hook, TCX_NEXT},
    icmp_error::{self, ErrorFamily},
    maps::{TC_DSR, TC_NEXT, XDP_NEXT, count},
    nat::NatOf,
    packet::FlowOf,
    reject::{self, ResetFamily},
    route,
};

/// A hook the pipelines run at, by its verdicts.
pub trait Verdicts: Hook {
    /// The hook's return code.
    type Verdict: Copy;
    /// Leave the packet to the stack (at XDP: to tc), translated or not.
    const PASS: Self::Verdict;
    const DROP: Self::Verdict;

    /// Not this program's family: handed on to the other family's program.
    fn next(&self) -> Self::Verdict;

    /// A packet another node sent by direct server return: handed on to
    /// the family's `tc_dsr` program (`crate::dsr`), in slot `slot` of
    /// `TC_DSR`; XDP leaves it to tc.
    fn dsr(&self, slot: u32) -> Self::Verdict;

    /// The first packet of a new flow, handed on to the family's program
    /// for new flows (`tc_new6`, in `TC_NEXT`) with what it needs in this
    /// CPU's handoff (`pipeline::hand_off`). tc only: XDP finishes its new
    /// flows itself.
    fn new_flow_apart(&self) -> Self::Verdict;
    /// An ICMP message at `at`: translated back if it is an error about a
    /// translated flow (`icmp_error`).
    fn icmp_error<F: ErrorFamily>(&self, at: F::IcmpAt) -> Self::Verdict;

    /// Answers with a TCP reset or ICMP port unreachable.
    fn reject<F: ResetFamily>(&self, flow: &FlowOf<F::Addr>) -> Self::Verdict;

    /// Answers a packet longer than its route's `mtu` (`reject::too_big`).
    fn too_big<F: Family>(&self, mtu: u16) -> Self::Verdict;

    /// Sends on a translated packet whose new source is an address of this
    /// node, which the stack would not forward, to the next hop that
    /// `route::lookup` found before anything was written.
    fn send<F: Family>(&self, flow: &FlowOf<F::Addr>, nat: &NatOf<F::Addr>) -> Self::Verdict;

    /// Sends on a translated packet the stack forwards: passed to it, or at
    /// tc, with `--host-routing bpf`, straight into a pod of this node
    /// (`route::to_pod`).
    fn onward<F: Family>(&self, flow: &FlowOf<F::Addr>, nat: &NatOf<F::Addr>) -> Self::Verdict;
}

/// `XDP_NEXT`'s slot of `xdp_ingress6`.
const XDP_NEXT_IPV6: u32 = proxy_common::XDP_NEXT_IPV6;
/// `TC_NEXT`'s slot of `tc_ingress6`.
const TC_NEXT_IPV6: u32 = proxy_common::TC_NEXT_IPV6;
/// `TC_NEXT`'s slot of `tc_new6`.
const TC_NEXT_NEW6: u32 = proxy_common::TC_NEXT_NEW6;

impl Verdicts for TcContext {
    type Verdict = i32;
    const PASS: i32 = TCX_NEXT;
    const DROP: i32 = TC_ACT_SHOT;

    /// A tail call to `tc_ingress6` through `TC_NEXT`, inlined into
    /// `tc_ingress`'s own frame, as `XdpContext::next` is: the frame goes
    /// on without a second program run from the tcx chain. It returns only
    /// when the slot is empty (the agent could not fill it, said at its
    /// start): the frame then goes on untranslated.
    #[inline(always)]
    fn next(&self) -> i32 {
        // SAFETY: a tail call with this program's own context.
        unsafe { TC_NEXT.tail_call(self, TC_NEXT_IPV6) };
        TCX_NEXT
    }

    /// A tail call, inlined into the entry program's own frame, as
    /// `XdpContext::next` is. It returns only when the slot is empty (the
    /// agent could not load the program, or has gone): the packet then
    /// goes on untranslated, counted.
    #[inline(always)]
    fn dsr(&self, slot: u32) -> i32 {
        // SAFETY: a tail call with this program's own context.
        unsafe { TC_DSR.tail_call(self, slot) };
        count(counter::DSR_REFUSED);
        TCX_NEXT
    }

    /// A tail call, inlined into the entry program's own frame, as `dsr`
    /// is. It returns only when the slot is empty (the agent could not load
    /// the program): the packet then goes on untranslated, counted as a
    /// slot that missed, and its retransmission tries again.
    #[inline(always)]
    fn new_flow_apart(&self) -> i32 {
        // SAFETY: a tail call with this program's own context.
        unsafe { TC_NEXT.tail_call(self, TC_NEXT_NEW6) };
        count(counter::LOOKUP_MISS);
        TCX_NEXT
    }
    #[inline(always)]
    fn icmp_error<F: ErrorFamily>(&self, at: F::IcmpAt) -> i32 {
        let send = |error: &FlowOf<F::Addr>, nat: &NatOf<F::Addr>| {
            route::send_tc::<F>(self, error.proto, &nat.src_be, &nat.dst_be)
        };
        match icmp_error::handle::<F, _>(self, at, send) {
            icmp_error::Verdict::Pass => TCX_NEXT,
            icmp_error::Verdict::Drop => TC_ACT_SHOT,
            icmp_error::Verdict::Sent(verdict) => verdict,
        }
    }

    #[inline(always)]
    fn reject<F: ResetFamily>(&self, flow: &FlowOf<F::Addr>) -> i32 {
        if !reject::allowed() {
            return TC_ACT_SHOT;
        }
        let rejected = if flow.proto == PROTO_TCP {
            reject::tcp_reset::<F>(self, flow)
        } else {
            reject::icmp_port_unreachable::<F>(self, flow)
        };
        reject::answer::<F>(rejected, flow, Event::Reject)
    }

    #[inline(always)]
    fn too_big<F: Family>(&self, mtu: u16) -> i32 {
        reject::too_big::<F>(self, mtu)
    }

    #[inline(always)]
    fn send<F: Family>(&self, flow: &FlowOf<F::Addr>, nat: &NatOf<F::Addr>) -> i32 {
        route::send_tc::<F>(self, flow.proto, &nat.src_be, &nat.dst_be)
    }

    #[inline(always)]
    fn onward<F: Family>(&self, flow: &FlowOf<F::Addr>, nat: &NatOf<F::Addr>) -> i32 {
        route::to_pod::<F>(self, flow.l4_off, flow.proto, &nat.src_be, &nat.dst_be)
    }
}

impl Verdicts for XdpContext {
    type Verdict = u32;
    const PASS: u32 = xdp_action::XDP_PASS;
    const DROP: u32 = xdp_action::XDP_DROP;

    /// A tail call to `xdp_ingress6` through `XDP_NEXT`, inlined into
    /// `xdp_ingress`'s own frame, where it must be: the verifier refuses a
    /// tail call from a subprogram whose callers' frames use 256 bytes of
    /// stack or more.
    #[inline(always)]
    fn next(&self) -> u32 {
        // SAFETY: a tail call with this program's own context. It only
        // returns when it fails (an empty slot: `xdp_ingress6` was not
        // loaded, or its agent has gone), and then IPv6 is left to tc.
        unsafe { XDP_NEXT.tail_call(self, XDP_NEXT_IPV6) };
        xdp_action::XDP_PASS
    }

    #[inline(always)]
    fn dsr(&self, _slot: u32) -> u32 {
        count(counter::XDP_TO_TC);
        xdp_action::XDP_PASS
    }
    /// Never reached: XDP finishes its new flows itself
    /// (`PipelineFamily::NEW_FLOW_APART` is asked of tc alone).
    #[inline(always)]
    fn new_flow_apart(&self) -> u32 {
        xdp_action::XDP_PASS
    }

    /// Left to tc, which can write past the headers XDP reads and answers
    /// for every checksum state.
    #[inline(always)]
    fn icmp_error<F: ErrorFamily>(&self, _at: F::IcmpAt) -> u32 {
        xdp_action::XDP_PASS
    }

    /// Never reached: the pipeline leaves rejects to tc before it gets here
    /// (counted `xdp_to_tc`).
    #[inline(always)]
    fn reject<F: ResetFamily>(&self, _flow: &FlowOf<F::Addr>) -> u32 {
        xdp_action::XDP_PASS
    }

    /// Never reached: XDP leaves a packet it cannot send to tc.
    #[inline(always)]
    fn too_big<F: Family>(&self, _mtu: u16) -> u32 {
        xdp_action::XDP_PASS
    }

    /// Out of the interface it came in on: a redirect to it rather than
    /// `XDP_TX`, the same on a NIC, and on a veth it also works when the peer
    /// runs no XDP program (`XDP_TX` frames then wait in the peer's queue
    /// until other traffic flushes it).
    #[inline(always)]
    fn send<F: Family>(&self, flow: &FlowOf<F::Addr>, nat: &NatOf<F::Addr>) -> u32 {
        match route::forward::<F>(self.data(), self.data_end()) {
            Ok(()) => {
                count(counter::XDP_TX);
                // SAFETY: takes an interface index and flags, no pointers.
                unsafe {
                    aya_ebpf::helpers::bpf_redirect(XdpContext::ingress_ifindex(self) as u32, 0)
                        as u32
                }
            }
            Err(route::Spent::Hops) => {
                count(counter::DROP_TTL);
                F::log_addrs(Event::Ttl, flow.proto, &nat.src_be, &nat.dst_be);
                xdp_action::XDP_DROP
            }
            Err(route::Spent::NoRoom) => {
                count(counter::DROP_NO_ROUTE);
                F::log_addrs(Event::NoRoute, flow.proto, &nat.src_be, &nat.dst_be);
                xdp_action::XDP_DROP
            }
        }
    }

    /// Passed to the stack translated, counted.
    #[inline(always)]
    fn onward<F: Family>(&self, _flow: &FlowOf<F::Addr>, _nat: &NatOf<F::Addr>) -> u32 {
        count(counter::XDP_TRANSLATED);
        xdp_action::XDP_PASS
    }
}
