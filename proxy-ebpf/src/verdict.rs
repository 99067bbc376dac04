//! The pipeline's decision (`Action`) and what it becomes in each hook's
//! terms: the return code, and the replies and redirects only that hook can
//! send.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT, xdp_action},
    programs::{TcContext, XdpContext},
};
use proxy_common::{PROTO_TCP, counter};

use crate::{
    event_log::Event,
    family::V4,
    maps::{XDP_NEXT, count},
    nat::NatOf,
    packet::Flow,
    reject, route,
};

/// What the hook does with the packet.
pub enum Action {
    /// Leave it to the stack, translated or not.
    Pass,
    /// Not IPv4: leave it to the next program at the hook (tc: `tc_ingress6`).
    Next,
    Drop,
    /// Answer with a TCP reset or ICMP port unreachable.
    Reject(Flow),
    /// Translated; the stack would refuse its source, so it is sent to the
    /// next hop `route::lookup` found for it before it was written.
    Redirect(Flow, NatOf<u32>),
    /// tc only: longer than the MTU of the route it would be sent on:
    /// answered with "fragmentation needed" and that MTU, as a router
    /// answers (`reject::too_big`).
    TooBig(Flow, u16),
    /// XDP only: translated and routed back out of the interface it came in
    /// on.
    Tx,
    /// XDP only: left untouched for tc, which runs the same pipeline and can
    /// do what XDP cannot (rejects, neighbour resolution, other egress).
    ToTc,
}

/// tcx: run the next program in the chain; from the last one, a pass.
pub const TCX_NEXT: i32 = -1;

/// `XDP_NEXT`'s slot of `xdp_ingress6`.
const XDP_NEXT_IPV6: u32 = proxy_common::XDP_NEXT_IPV6;

/// tc's return code for `action`, after the reply or redirect it asks for.
#[inline(always)]
#[expect(
    clippy::match_same_arms,
    reason = "what is not produced at this hook has its own arm, apart from the hook's answers"
)]
pub fn tc(ctx: &TcContext, action: Action) -> i32 {
    match action {
        Action::Pass => TC_ACT_OK,
        // `TC_ACT_OK` would end the tcx chain before `tc_ingress6`.
        Action::Next => TCX_NEXT,
        Action::Drop => TC_ACT_SHOT,
        Action::Reject(flow) => {
            if !reject::allowed() {
                return TC_ACT_SHOT;
            }
            let rejected = if flow.proto == PROTO_TCP {
                reject::tcp_reset::<V4>(ctx, &flow)
            } else {
                reject::icmp_port_unreachable::<V4>(ctx, &flow)
            };
            reject::answer::<V4>(rejected, &flow, Event::Reject)
        }
        Action::Redirect(flow, nat) => {
            route::send_tc::<V4>(ctx, flow.proto, &nat.src_be, &nat.dst_be)
        }
        Action::TooBig(flow, mtu) => {
            reject::answer::<V4>(reject::too_big(ctx, &flow, mtu), &flow, Event::TooBig)
        }
        // Not produced at tc.
        Action::Tx | Action::ToTc => TC_ACT_OK,
    }
}

/// XDP's return code for `action`. Inlined into `xdp_ingress`'s own frame,
/// where its tail call must be: the verifier refuses a tail call from a
/// subprogram whose callers' frames use 256 bytes of stack or more.
#[inline(always)]
#[expect(
    clippy::match_same_arms,
    reason = "what is not produced at this hook has its own arm, apart from the hook's answers"
)]
pub fn xdp(ctx: &XdpContext, action: Action) -> u32 {
    match action {
        Action::Pass | Action::ToTc => xdp_action::XDP_PASS,
        Action::Next => {
            // SAFETY: a tail call with this program's own context. It only
            // returns when it fails (an empty slot: `xdp_ingress6` was not
            // loaded, or its agent has gone), and then IPv6 is left to tc.
            unsafe { XDP_NEXT.tail_call(ctx, XDP_NEXT_IPV6) };
            xdp_action::XDP_PASS
        }
        Action::Drop => xdp_action::XDP_DROP,
        Action::Tx => {
            // A redirect to the interface the packet came in on, rather than
            // XDP_TX: the same on a NIC, and on a veth it also works when
            // the peer runs no XDP program (XDP_TX frames then wait in the
            // peer's queue until other traffic flushes it).
            count(counter::XDP_TX);
            // SAFETY: takes an interface index and flags, no pointers.
            unsafe { aya_ebpf::helpers::bpf_redirect(ctx.ingress_ifindex() as u32, 0) as u32 }
        }
        // Not produced at XDP.
        Action::Reject(_) | Action::Redirect(..) | Action::TooBig(..) => xdp_action::XDP_PASS,
    }
}
