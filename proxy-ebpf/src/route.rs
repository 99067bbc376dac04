//! Sending a translated packet on without the stack: a FIB lookup gives the
//! egress interface and next hop, the packet is rewritten as a router
//! would (MACs, TTL) and redirected. Used where the stack would refuse the
//! packet: its new source is an address of this node (SNAT to the node, or
//! a reply from a NodePort), which input routing drops as martian.

use core::mem::size_of;

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS, TC_ACT_REDIRECT, TC_ACT_SHOT,
        bpf_fib_lookup,
    },
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
};

use proxy_common::counter;

use crate::{
    checksum,
    event_log::{self, Event},
    hook::Hook,
    maps::count,
};

const AF_INET: u8 = 2;

/// Where a packet goes next.
pub struct NextHop {
    pub ifindex: u32,
    /// Ethernet addresses, valid when `resolved`.
    pub smac: [u8; 6],
    pub dmac: [u8; 6],
    /// The neighbour is known; otherwise only tc can send the packet, by
    /// `bpf_redirect_neigh`, which resolves it.
    pub resolved: bool,
}

/// The FIB's answer for a packet from `src_be` to `dst_be`.
#[inline(always)]
pub fn lookup<H: Hook>(
    ctx: &H,
    proto: u8,
    src_be: u32,
    dst_be: u32,
    tot_len: u16,
) -> Option<NextHop> {
    // SAFETY: a plain C struct; all-zeros is valid.
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    params.family = AF_INET;
    params.l4_protocol = proto;
    params.__bindgen_anon_1.tot_len = tot_len;
    params.ifindex = ctx.ingress_ifindex();
    params.__bindgen_anon_3.ipv4_src = src_be;
    params.__bindgen_anon_4.ipv4_dst = dst_be;
    // SAFETY: the context's own skb and a `bpf_fib_lookup` on this stack, with
    // its size.
    let ret = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            &raw mut params,
            size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    let resolved = ret == i64::from(BPF_FIB_LKUP_RET_SUCCESS);
    if !resolved && ret != i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        return None;
    }
    Some(NextHop {
        ifindex: params.ifindex,
        smac: params.smac,
        dmac: params.dmac,
        resolved,
    })
}

/// Routes and redirects a (translated) tc packet. The TTL is taken down by
/// one as the stack would when forwarding. A spent TTL or no route drops
/// the packet: the stack would drop it too, for its source.
#[inline(always)]
pub fn redirect_tc(ctx: &TcContext, proto: u8, src_be: u32, dst_be: u32, tot_len: u16) -> i32 {
    let no_route = || {
        count(counter::DROP_NO_ROUTE);
        event_log::log_addrs(Event::NoRoute, proto, src_be, dst_be);
        TC_ACT_SHOT
    };
    let Some(hop) = lookup(ctx, proto, src_be, dst_be, tot_len) else {
        return no_route();
    };
    // Headers written in place: the IP checksum is never offloaded, and the
    // L4 checksum does not cover the TTL or the MACs.
    let (data, data_end) = (ctx.data(), ctx.data_end());
    if !checksum::decrement_ttl(data, data_end) {
        count(counter::DROP_TTL);
        event_log::log_addrs(Event::Ttl, proto, src_be, dst_be);
        return TC_ACT_SHOT;
    }
    if hop.resolved {
        if !checksum::write_macs(data, data_end, &hop.dmac, &hop.smac) {
            return no_route();
        }
        // SAFETY: takes an interface index and flags, no pointers.
        unsafe { bpf_redirect(hop.ifindex, 0) as i32 }
    } else {
        // SAFETY: a null `params` is allowed: the kernel then looks the neighbour
        // up itself.
        let r = unsafe { bpf_redirect_neigh(hop.ifindex, core::ptr::null_mut(), 0, 0) };
        if r == i64::from(TC_ACT_REDIRECT) {
            TC_ACT_REDIRECT
        } else {
            no_route()
        }
    }
}
