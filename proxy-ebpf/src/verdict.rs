//! The pipeline's decision (`pipeline::Action`) in each hook's terms: the
//! return code, and the replies and redirects only that hook can send.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT, xdp_action},
    programs::{TcContext, XdpContext},
};
use proxy_common::{PROTO_TCP, counter};

use crate::{
    event_log::{self, Event},
    maps::{XDP_NEXT, count},
    pipeline::Action,
    reject, route,
};

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
            let rejected = if flow.proto == PROTO_TCP {
                reject::tcp_reset(ctx, &flow)
            } else {
                reject::icmp_port_unreachable(ctx, &flow)
            };
            if let Ok(verdict) = rejected {
                event_log::log(Event::Reject, &flow);
                verdict
            } else {
                count(counter::DROP_REJECT_FAILED);
                event_log::log(Event::RejectFailed, &flow);
                TC_ACT_SHOT
            }
        }
        Action::Redirect(flow, nat) => {
            route::redirect_tc(ctx, flow.proto, nat.src_be, nat.dst_be, flow.tot_len)
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
        Action::Reject(_) | Action::Redirect(..) => xdp_action::XDP_PASS,
    }
}
