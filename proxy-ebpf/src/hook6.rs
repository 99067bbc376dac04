//! What differs between the hooks IPv6's pipeline (`pipeline6`) runs at,
//! as `hook` is for IPv4's: the verdicts, and how a packet routed by the
//! program leaves. tc finishes everything; XDP finishes what it can send
//! back out of the interface it came in on, and leaves the rest untouched
//! to tc (`tc_ingress6`), which runs the same pipeline.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT, xdp_action},
    programs::{TcContext, XdpContext},
};
use proxy_common::{PROTO_TCP, counter};

use crate::{
    event_log::{self, Event},
    family::V6,
    hook::Hook,
    icmp_error::{self, Verdict},
    maps::count,
    nat::NatOf,
    packet6::Flow6,
    reject, route,
};

/// A hook IPv6's pipeline runs at.
pub trait Hook6: Hook {
    /// The hook's return code.
    type Verdict: Copy;
    /// Leave the packet to the stack (at XDP: to tc), translated or not.
    const PASS: Self::Verdict;
    const DROP: Self::Verdict;

    /// A whole ICMPv6 message at `icmp_off`: translated if it is an error
    /// about a translated flow (`icmp_error`).
    fn icmp6_error(&self, icmp_off: usize) -> Self::Verdict;

    /// Answers with a TCP reset or ICMPv6 port unreachable.
    fn reject6(&self, flow: &Flow6) -> Self::Verdict;

    /// Answers a packet longer than its route's `mtu` with ICMPv6 "packet
    /// too big" (`reject::too_big6`).
    fn too_big6(&self, mtu: u16) -> Self::Verdict;

    /// Sends on a translated packet whose new source is an address of this
    /// node, which the stack would not forward.
    fn send6(&self, flow: &Flow6, nat: &NatOf<[u32; 4]>) -> Self::Verdict;
}

impl Hook6 for TcContext {
    type Verdict = i32;
    const PASS: i32 = TC_ACT_OK;
    const DROP: i32 = TC_ACT_SHOT;

    #[inline(always)]
    fn icmp6_error(&self, icmp_off: usize) -> i32 {
        let send = |error: &Flow6, nat: &NatOf<[u32; 4]>| {
            route::send_tc::<V6>(self, error.proto, &nat.src_be, &nat.dst_be)
        };
        match icmp_error::handle::<V6, _>(self, icmp_off, send) {
            Verdict::Pass => TC_ACT_OK,
            Verdict::Drop => TC_ACT_SHOT,
            Verdict::Sent(verdict) => verdict,
        }
    }

    #[inline(always)]
    fn reject6(&self, flow: &Flow6) -> i32 {
        if !reject::allowed() {
            return TC_ACT_SHOT;
        }
        let rejected = if flow.proto == PROTO_TCP {
            reject::tcp_reset::<V6>(self, flow)
        } else {
            reject::icmp_port_unreachable::<V6>(self, flow)
        };
        reject::answer::<V6>(rejected, flow, Event::Reject)
    }

    #[inline(always)]
    fn too_big6(&self, mtu: u16) -> i32 {
        reject::too_big6(self, mtu)
    }

    #[inline(always)]
    fn send6(&self, flow: &Flow6, nat: &NatOf<[u32; 4]>) -> i32 {
        route::send_tc::<V6>(self, flow.proto, &nat.src_be, &nat.dst_be)
    }
}

impl Hook6 for XdpContext {
    type Verdict = u32;
    const PASS: u32 = xdp_action::XDP_PASS;
    const DROP: u32 = xdp_action::XDP_DROP;

    /// Left to tc, which can write past the headers XDP reads and answers
    /// for every checksum state.
    #[inline(always)]
    fn icmp6_error(&self, _icmp_off: usize) -> u32 {
        xdp_action::XDP_PASS
    }

    /// Never reached: the pipeline leaves rejects to tc before it gets here
    /// (counted `xdp_to_tc`), as IPv4's does.
    #[inline(always)]
    fn reject6(&self, _flow: &Flow6) -> u32 {
        xdp_action::XDP_PASS
    }

    /// Never reached: XDP leaves a packet it cannot send to tc.
    #[inline(always)]
    fn too_big6(&self, _mtu: u16) -> u32 {
        xdp_action::XDP_PASS
    }

    /// Out of the interface it came in on, to the next hop that
    /// `route::lookup` found before anything was written.
    #[inline(always)]
    fn send6(&self, flow: &Flow6, nat: &NatOf<[u32; 4]>) -> u32 {
        match route::forward::<V6>(self.data(), self.data_end()) {
            Ok(()) => {
                count(counter::XDP_TX);
                // A redirect to the ingress interface rather than XDP_TX, as
                // IPv4's (see `verdict::xdp`).
                // SAFETY: takes an interface index and flags, no pointers.
                unsafe {
                    aya_ebpf::helpers::bpf_redirect(XdpContext::ingress_ifindex(self) as u32, 0)
                        as u32
                }
            }
            Err(route::Spent::Hops) => {
                count(counter::DROP_TTL);
                event_log::log6_addrs(Event::Ttl, flow.proto, &nat.src_be, &nat.dst_be);
                xdp_action::XDP_DROP
            }
            Err(route::Spent::NoRoom) => {
                count(counter::DROP_NO_ROUTE);
                event_log::log6_addrs(Event::NoRoute, flow.proto, &nat.src_be, &nat.dst_be);
                xdp_action::XDP_DROP
            }
        }
    }
}
