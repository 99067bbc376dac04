//! Sending a translated packet on without the stack, for both families: a
//! FIB lookup gives the egress interface, the next hop and the path's MTU,
//! and the packet is rewritten as a router would (MACs, TTL or hop limit)
//! and redirected. Used where the stack would refuse the packet: its new
//! source is an address of this node (SNAT to the node, hairpin over IPv6,
//! a reply from a NodePort), which input routing drops as martian.
//!
//! The route is looked up before the packet is written (`lookup`), so that
//! a packet that cannot go is still as its sender sent it: XDP leaves it to
//! tc, and tc answers one longer than the path's MTU with the ICMP error a
//! router sends (`reject::too_big`), quoting the packet as the client knows
//! it. The answer stays in this CPU's `ROUTE` entry until the packet is
//! sent (`forward`, `send_tc`): nothing in between looks up another route.
//!
//! With `--host-routing bpf` (`node_config_flags::HOST_ROUTING_BPF`) tc
//! also sends on a translated packet the stack would forward, where its
//! route leads into a pod of this node (`to_pod`): straight into the pod's
//! namespace, past the node's forwarding and its second pass through a
//! CPU's backlog (docs/architecture.md, "Host routing").
//!
//! The length given to the FIB is what the path has to carry: the packet's
//! network length, or for a GSO or GRO packet the length of each segment it
//! will be cut into, as the stack's own forwarding check counts it. The
//! whole super-packet's length would be refused by every route, and 0 (the
//! kernel then checks the egress device's MTU alone) would pass packets
//! longer than a route's own MTU.

use core::mem::size_of;

use aya_ebpf::{
    bindings::{
        BPF_FIB_LKUP_RET_FRAG_NEEDED, BPF_FIB_LKUP_RET_NO_NEIGH, BPF_FIB_LKUP_RET_SUCCESS,
        TC_ACT_REDIRECT, TC_ACT_SHOT,
    },
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_redirect_neigh, bpf_redirect_peer},
    programs::TcContext,
};
use proxy_common::{PROTO_TCP, counter, node_config_flags};

use crate::{
    event_log::Event,
    family::Family,
    hook::{Hook, TCX_NEXT},
    maps::{POD_IFACES, ROUTE, Route, SHAPED_IFACES, count, node_flags},
    packet::ETH_HLEN,
};

const UDP_HLEN: usize = 8;

/// The FIB's answer for a packet, its details in this CPU's `ROUTE` entry.
#[derive(Clone, Copy)]
pub enum Hop {
    /// Out of interface `ifindex`; `resolved` when the FIB knows the next
    /// hop's MACs, else only tc can send it (`bpf_redirect_neigh` resolves
    /// the neighbour).
    Via { ifindex: u32, resolved: bool },
    /// Longer than the route's MTU, this one.
    TooBig(u16),
    /// No route, or no `ROUTE` entry.
    Unroutable,
}

/// The route of a packet of `proto` from `src` to `dst` that came in on the
/// context's interface, `len` bytes long at the network layer (see
/// `network_len`).
#[inline(always)]
pub fn lookup<F: Family, H: Hook>(
    ctx: &H,
    proto: u8,
    src: &F::Addr,
    dst: &F::Addr,
    len: u16,
) -> Hop {
    let Some(route) = ROUTE.get_ptr_mut(0) else {
        return Hop::Unroutable;
    };
    // SAFETY: this CPU's entry, used by nothing else while this program
    // runs (tc and XDP run one program at a time on a CPU); all-zeros is a
    // valid `Route`, cleared a word at a time (its alignment and size are
    // whole words): a `write(zeroed())` is a memset, a call to a byte loop
    // over its 72 bytes here (docs/architecture.md, "No calls on a
    // packet's path").
    let route = unsafe {
        let words = route.cast::<u64>();
        for i in 0..size_of::<Route>() / 8 {
            words.add(i).write_volatile(0);
        }
        &mut *route
    };
    let params = &mut route.fib;
    params.family = F::AF;
    params.l4_protocol = proto;
    params.__bindgen_anon_1.tot_len = len;
    params.ifindex = ctx.ingress_ifindex();
    F::fib_addrs(params, src, dst);
    // SAFETY: the context and a `bpf_fib_lookup` in a map value, with its
    // size.
    let ret = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            core::ptr::from_mut(params),
            size_of::<aya_ebpf::bindings::bpf_fib_lookup>() as i32,
            0,
        )
    };
    let resolved = ret == i64::from(BPF_FIB_LKUP_RET_SUCCESS);
    if resolved || ret == i64::from(BPF_FIB_LKUP_RET_NO_NEIGH) {
        route.resolved = u32::from(resolved);
        Hop::Via {
            ifindex: params.ifindex,
            resolved,
        }
    } else if ret == i64::from(BPF_FIB_LKUP_RET_FRAG_NEEDED) {
        // SAFETY: the kernel wrote the route's MTU over the length it was
        // given (a union).
        Hop::TooBig(unsafe { params.__bindgen_anon_1.mtu_result })
    } else {
        Hop::Unroutable
    }
}

/// What becomes of a packet the datapath routes itself (`first`).
pub enum Ahead {
    /// Its route is in `ROUTE`: write it and send it.
    Go,
    /// XDP cannot send it (another interface, an unresolved neighbour, too
    /// long, no route): left to tc as it came, counted `xdp_to_tc`.
    ToTc,
    /// tc: longer than its route's MTU, this one: to be answered.
    TooBig(u16),
    /// tc: no route: to be dropped, counted `drop_no_route` (the caller
    /// logs it, with the flow).
    Unroutable,
}

/// Routes a translated packet of `proto` from `src` to `dst`, whose
/// transport header starts at `l4_off` and which will grow by `room` bytes
/// (direct server return's carrier), before anything is written or
/// created, both families and both hooks: XDP sends only back out of the
/// interface it came in on to a resolved neighbour.
#[inline(always)]
pub fn first<F: Family, H: Hook>(
    ctx: &H,
    l4_off: usize,
    proto: u8,
    room: u16,
    src: &F::Addr,
    dst: &F::Addr,
) -> Ahead {
    let len = network_len(ctx, l4_off, proto).saturating_add(room);
    let hop = lookup::<F, H>(ctx, proto, src, dst, len);
    if H::XDP {
        return match hop {
            Hop::Via {
                ifindex,
                resolved: true,
            } if ifindex == ctx.ingress_ifindex() => Ahead::Go,
            _ => {
                count(counter::XDP_TO_TC);
                Ahead::ToTc
            }
        };
    }
    match hop {
        Hop::Via { .. } => Ahead::Go,
        Hop::TooBig(mtu) => Ahead::TooBig(mtu),
        Hop::Unroutable => {
            count(counter::DROP_NO_ROUTE);
            Ahead::Unroutable
        }
    }
}

/// The MTU of the route a translated packet of `proto` from `src` to `dst`
/// leaves by when the stack forwards it, for a new flow's forward entry
/// (`CtValue::path_mtu`); 0 when there is none to keep to. Asked with the
/// longest length there is, which every route with an MTU refuses, saying
/// its MTU.
#[inline(always)]
pub fn path_mtu<F: Family, H: Hook>(ctx: &H, proto: u8, src: &F::Addr, dst: &F::Addr) -> u16 {
    match lookup::<F, H>(ctx, proto, src, dst, u16::MAX) {
        Hop::TooBig(mtu) => mtu,
        Hop::Via { .. } | Hop::Unroutable => 0,
    }
}

/// Whether the packet whose transport header starts at `l4_off` is longer
/// than `path_mtu` (0: no MTU to keep to) and is not to be fragmented by
/// the stack: it is then answered as too big.
#[inline(always)]
pub fn beyond<F: Family, H: Hook>(ctx: &H, l4_off: usize, proto: u8, path_mtu: u16) -> bool {
    if path_mtu == 0 || network_len(ctx, l4_off, proto) <= path_mtu {
        return false;
    }
    let (data, data_end) = ctx.bounds();
    !F::may_fragment(data, data_end)
}

/// What the path must carry of the packet whose transport header starts at
/// `l4_off`: its network length, or, for a GSO or GRO packet (tc only), the
/// network length of each segment: headers and `gso_size` bytes of
/// payload.
#[inline(always)]
pub fn network_len<H: Hook>(ctx: &H, l4_off: usize, proto: u8) -> u16 {
    let gso_size = ctx.gso_size() as usize;
    if gso_size == 0 {
        return ctx.wire_len().saturating_sub(ETH_HLEN) as u16;
    }
    // Read through the helper: a direct read at a transport offset that
    // varies with the extension headers would have the verifier follow
    // every one of them through what comes after.
    let l4_hlen = match ctx.tc() {
        Some(tc) if proto == PROTO_TCP => match tc.load::<u8>(l4_off + 12) {
            Ok(doff) => usize::from(doff >> 4) * 4,
            // Never, after parsing: the segments then count as if without
            // options, which errs on the short side.
            Err(_) => 20,
        },
        _ => UDP_HLEN,
    };
    (l4_off - ETH_HLEN + l4_hlen + gso_size) as u16
}

/// Why `forward` did not make a packet ready to send.
pub enum Spent {
    /// Its TTL or hop limit was 1 or 0: a router drops it.
    Hops,
    /// No `ROUTE` entry, or no room for the headers: never, after parsing.
    NoRoom,
}

/// Makes the (translated) packet between `data` and `data_end` ready to go
/// to the resolved next hop `lookup` found: one off its TTL or hop limit,
/// and the next hop's MACs.
#[inline(always)]
pub fn forward<F: Family>(data: usize, data_end: usize) -> Result<(), Spent> {
    let Some(route) = ROUTE.get_ptr(0) else {
        return Err(Spent::NoRoom);
    };
    if !F::decrement_hops(data, data_end) {
        return Err(Spent::Hops);
    }
    // SAFETY: this CPU's entry, as `lookup` left it.
    let fib = unsafe { &(*route).fib };
    if write_macs(data, data_end, &fib.dmac, &fib.smac) {
        Ok(())
    } else {
        Err(Spent::NoRoom)
    }
}

/// Sends a translated tc packet from `src` to `dst` to the next hop
/// `lookup` found for it, resolving the neighbour where the FIB did not.
/// A spent TTL or hop limit drops the packet (`drop_ttl`), as a router
/// would; so does a failure to send (`drop_no_route`).
#[inline(always)]
pub fn send_tc<F: Family>(ctx: &TcContext, proto: u8, src: &F::Addr, dst: &F::Addr) -> i32 {
    let no_route = || {
        count(counter::DROP_NO_ROUTE);
        F::log_addrs(Event::NoRoute, proto, src, dst);
        TC_ACT_SHOT
    };
    let Some(route) = ROUTE.get_ptr(0) else {
        return no_route();
    };
    // SAFETY: this CPU's entry, as `lookup` left it.
    let route: &Route = unsafe { &*route };
    if route.resolved != 0 {
        return match forward::<F>(ctx.data(), ctx.data_end()) {
            // SAFETY: takes an interface index and flags, no pointers.
            Ok(()) => unsafe { bpf_redirect(route.fib.ifindex, 0) as i32 },
            Err(Spent::Hops) => spent::<F>(proto, src, dst),
            Err(Spent::NoRoom) => no_route(),
        };
    }
    if !F::decrement_hops(ctx.data(), ctx.data_end()) {
        return spent::<F>(proto, src, dst);
    }
    // SAFETY: a null `params` is allowed: the kernel then looks the
    // neighbour up itself, from the packet's destination.
    let r = unsafe { bpf_redirect_neigh(route.fib.ifindex, core::ptr::null_mut(), 0, 0) };
    if r == i64::from(TC_ACT_REDIRECT) {
        TC_ACT_REDIRECT
    } else {
        no_route()
    }
}

/// A translated tc packet of `proto` from `src` to `dst` that the stack
/// would forward (its transport header at `l4_off`): with
/// `HOST_ROUTING_BPF`, one whose route leads out of one of `POD_IFACES` to
/// a resolved neighbour, and that did not arrive on one of `SHAPED_IFACES`,
/// goes straight into that pod's namespace, routed as the stack would route
/// it (one off its TTL or hop limit, the next hop's MACs). Every other
/// packet is passed to the stack untouched by this, so that it answers what
/// only it answers: a spent TTL, a packet longer than its route's MTU, a
/// neighbour to resolve, a route elsewhere, a shaped pod's qdiscs.
#[inline(always)]
pub fn to_pod<F: Family>(
    ctx: &TcContext,
    l4_off: usize,
    proto: u8,
    src: &F::Addr,
    dst: &F::Addr,
) -> i32 {
    if node_flags() & node_config_flags::HOST_ROUTING_BPF == 0 {
        return TCX_NEXT;
    }
    let len = network_len(ctx, l4_off, proto);
    let Hop::Via {
        ifindex,
        resolved: true,
    } = lookup::<F, TcContext>(ctx, proto, src, dst, len)
    else {
        return TCX_NEXT;
    };
    // A redirect from tcx skips the rest of the arrival interface's tc
    // (its legacy filters: the `bandwidth` plugin's egress limit) as the
    // peer redirect skips the pod interface's qdisc: neither way through
    // a shaped pod's interface.
    if POD_IFACES.get_ptr(&ifindex).is_none()
        || SHAPED_IFACES.get_ptr(&ctx.ingress_ifindex()).is_some()
    {
        return TCX_NEXT;
    }
    // `decrement_hops` writes nothing to a packet it refuses.
    if forward::<F>(ctx.data(), ctx.data_end()).is_err() {
        return TCX_NEXT;
    }
    count(counter::TO_POD);
    // SAFETY: takes an interface index and flags, no pointers. The kernel
    // drops the packet if the interface has no peer in another namespace:
    // `POD_IFACES` holds only veths whose peer is (the agent's `pod_ifaces`).
    unsafe { bpf_redirect_peer(ifindex, 0) as i32 }
}

/// A packet whose TTL or hop limit is spent: dropped, as a router drops it.
#[inline(always)]
pub fn spent<F: Family>(proto: u8, src: &F::Addr, dst: &F::Addr) -> i32 {
    count(counter::DROP_TTL);
    F::log_addrs(Event::Ttl, proto, src, dst);
    TC_ACT_SHOT
}

/// Writes the next hop's Ethernet addresses. False when the packet has no
/// room for an Ethernet header.
#[inline(always)]
pub fn write_macs(data: usize, data_end: usize, dmac: &[u8; 6], smac: &[u8; 6]) -> bool {
    if data + ETH_HLEN > data_end {
        return false;
    }
    // SAFETY: inside the bounds checked above; from a map value into the
    // packet, which never overlap. Copies: see `conntrack::translation`.
    unsafe {
        core::ptr::copy_nonoverlapping(dmac, data as *mut [u8; 6], 1);
        core::ptr::copy_nonoverlapping(smac, (data + 6) as *mut [u8; 6], 1);
    }
    true
}
