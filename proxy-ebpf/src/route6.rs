//! `route`'s redirect for IPv6 packets: a FIB lookup of the translated
//! addresses gives the egress interface and next hop, the packet is
//! rewritten as a router would (MACs, hop limit) and redirected. Used where
//! IPv4 redirects: the new source is an address of this node (SNAT,
//! hairpin, a reply from a NodePort), which the stack would not forward.
//! tc sends anywhere, resolving the neighbour if need be; XDP only back out
//! of the interface the packet came in on, to a resolved neighbour, and
//! looks that up before anything is written (`xdp_next_hop`).

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
    event_log::{self, Event},
    hook::Hook,
    maps::{count, scratch6},
    packet::ETH_HLEN,
    packet6::IPV6_HLEN,
};

const AF_INET6: u8 = 10;
/// Offset of the hop limit in the IPv6 header.
const IP6_HOP_LIMIT_OFF: usize = 7;

/// Routes and redirects a translated IPv6 tc packet from `src_be` to
/// `dst_be`. The hop limit is taken down by one as the stack would when
/// forwarding; a spent one (1 or 0) or no route drops the packet, counted as
/// IPv4's (`drop_ttl`, `drop_no_route`).
#[inline(always)]
pub fn redirect(ctx: &TcContext, proto: u8, src_be: &[u32; 4], dst_be: &[u32; 4]) -> i32 {
    let no_route = || {
        count(counter::DROP_NO_ROUTE);
        event_log::log6_addrs(Event::NoRoute, proto, src_be, dst_be);
        TC_ACT_SHOT
    };
    // `tot_len` 0: the kernel then checks the packet against the egress
    // device's MTU itself, which knows a GSO packet from a large one (IPv4
    // passes its header's total length; `Flow6` keeps no length).
    let Some((ret, params)) = lookup(ctx, proto, src_be, dst_be, 0) else {
        return no_route();
    };
    let resolved = ret == i64::from(BPF_FIB_LKUP_RET_SUCCESS);
    if !resolved && ret != i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        return no_route();
    }
    // IPv6 has no header checksum, and the transport checksum covers
    // neither the hop limit nor the MACs: plain stores.
    let Ok(hop_limit) = ctx.load::<u8>(ETH_HLEN + IP6_HOP_LIMIT_OFF) else {
        return no_route();
    };
    if hop_limit <= 1 {
        count(counter::DROP_TTL);
        event_log::log6_addrs(Event::Ttl, proto, src_be, dst_be);
        return TC_ACT_SHOT;
    }
    if ctx
        .store(ETH_HLEN + IP6_HOP_LIMIT_OFF, &(hop_limit - 1), 0)
        .is_err()
    {
        return no_route();
    }
    if resolved {
        let macs_written =
            ctx.store(0, &params.dmac, 0).is_ok() && ctx.store(6, &params.smac, 0).is_ok();
        if !macs_written {
            return no_route();
        }
        // SAFETY: takes an interface index and flags, no pointers.
        unsafe { bpf_redirect(params.ifindex, 0) as i32 }
    } else {
        // SAFETY: a null `params` is allowed: the kernel then looks the
        // neighbour up itself, from the packet's destination.
        let r = unsafe { bpf_redirect_neigh(params.ifindex, core::ptr::null_mut(), 0, 0) };
        if r == i64::from(TC_ACT_REDIRECT) {
            TC_ACT_REDIRECT
        } else {
            no_route()
        }
    }
}

/// Whether XDP can send a packet from `src_be` to `dst_be` itself: the FIB
/// has a resolved next hop for it out of the interface it came in on. The
/// answer (its MACs) stays in this CPU's `SCRATCH6` for `xdp_forward`,
/// which nothing between the two overwrites (`conntrack6` uses its keys and
/// entry only). `len` is the IPv6 packet's length, for the FIB's MTU check.
#[inline(always)]
pub fn xdp_next_hop<H: Hook>(
    ctx: &H,
    proto: u8,
    src_be: &[u32; 4],
    dst_be: &[u32; 4],
    len: u16,
) -> bool {
    let Some((ret, params)) = lookup(ctx, proto, src_be, dst_be, len) else {
        return false;
    };
    ret == i64::from(BPF_FIB_LKUP_RET_SUCCESS) && params.ifindex == ctx.ingress_ifindex()
}

/// The FIB's answer for a packet of `proto` from `src_be` to `dst_be` that
/// came in on the context's interface, `tot_len` bytes long (0: the kernel
/// checks the egress MTU itself): the helper's return code, and its
/// parameters filled in (egress interface, MACs), in this CPU's `SCRATCH6`.
/// None without that entry.
#[inline(always)]
fn lookup<H: Hook>(
    ctx: &H,
    proto: u8,
    src_be: &[u32; 4],
    dst_be: &[u32; 4],
    tot_len: u16,
) -> Option<(i64, &'static mut bpf_fib_lookup)> {
    let scratch = scratch6()?;
    // SAFETY: this CPU's entry, used by nothing else while this program
    // runs (see `maps::Scratch6`); all-zeros is a valid `bpf_fib_lookup`.
    let params = unsafe {
        let params = &raw mut (*scratch).fib;
        params.write(core::mem::zeroed());
        &mut *params
    };
    params.family = AF_INET6;
    params.l4_protocol = proto;
    params.__bindgen_anon_1.tot_len = tot_len;
    params.ifindex = ctx.ingress_ifindex();
    params.__bindgen_anon_3.ipv6_src = *src_be;
    params.__bindgen_anon_4.ipv6_dst = *dst_be;
    // SAFETY: the context and a `bpf_fib_lookup` in a map value, with its
    // size.
    let ret = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            core::ptr::from_mut(params),
            size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    Some((ret, params))
}

/// Why `xdp_forward` did not make a packet ready to send.
pub enum Spent {
    /// Its hop limit was 1 or 0: a router drops it.
    HopLimit,
    /// Too short for an IPv6 header: never, after parsing.
    NoRoom,
}

/// Takes the hop limit of the (translated) packet between `data` and
/// `data_end` down by one and writes the MACs `xdp_next_hop` found. Plain
/// stores: IPv6 has no header checksum, and the transport checksum covers
/// neither.
#[inline(always)]
pub fn xdp_forward(data: usize, data_end: usize) -> Result<(), Spent> {
    if data + ETH_HLEN + IPV6_HLEN > data_end {
        return Err(Spent::NoRoom);
    }
    let Some(scratch) = scratch6() else {
        return Err(Spent::NoRoom);
    };
    // SAFETY: inside the bounds checked above; this CPU's `SCRATCH6` entry,
    // as `xdp_next_hop` left it.
    unsafe {
        let hop_limit = (data + ETH_HLEN + IP6_HOP_LIMIT_OFF) as *mut u8;
        if *hop_limit <= 1 {
            return Err(Spent::HopLimit);
        }
        *hop_limit -= 1;
        let fib = &(*scratch).fib;
        (data as *mut [u8; 6]).write(fib.dmac);
        ((data + 6) as *mut [u8; 6]).write(fib.smac);
    }
    Ok(())
}
