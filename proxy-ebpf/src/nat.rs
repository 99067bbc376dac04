//! Address and port rewrites: what a packet becomes, and its writing, with
//! every checksum kept right: in place, straight into packet memory (XDP,
//! and tc where the checksum state is known), or through the kernel's
//! helpers (tc otherwise). The arithmetic is `proxy_common::csum`, tested
//! on the host. Loads and stores are of the field's width even where
//! packet memory is misaligned for it (see `packet::read`).

use aya_ebpf::programs::TcContext;
use proxy_common::{
    PROTO_TCP, PROTO_UDP,
    csum::{self, SkbCsum, apply, delta16, delta32, fold, full_update, pseudo_partial},
    ip_summed::{CHECKSUM_COMPLETE, CHECKSUM_NONE, CHECKSUM_PARTIAL, CHECKSUM_UNNECESSARY},
};

use crate::{
    hook::Hook,
    ip_summed, maps,
    packet::{ETH_HLEN, Flow, FlowOf, IP_CSUM_OFF, IP_DST_OFF, IP_SRC_OFF, IPV4_MIN_HLEN, frag},
};

/// Deepest L4 header start the parser accepts (Ethernet plus a full
/// 60-byte IPv4 header); bounds the offsets the verifier sees.
const MAX_L4_OFF: usize = ETH_HLEN + 60;

const BPF_F_PSEUDO_HDR: u64 = 1 << 4;
/// Keeps a UDP checksum of 0 ("none") at 0, and turns a computed 0 into
/// 0xffff, as RFC 768 wants.
const BPF_F_MARK_MANGLED_0: u64 = 1 << 5;

/// The addresses and ports a packet leaves with, of either family (`Nat`,
/// `crate::nat6::Nat6`).
#[derive(Clone, Copy)]
pub struct NatOf<A> {
    pub src_be: A,
    pub sport_be: u16,
    pub dst_be: A,
    pub dport_be: u16,
    /// The new source is an address of this node: the packet must be routed
    /// by a FIB lookup and redirected, as the stack would drop it.
    pub redirect: bool,
}

/// An IPv4 packet's translation.
pub type Nat = NatOf<u32>;

impl<A: Copy> NatOf<A> {
    /// The packet as it is.
    #[inline(always)]
    pub fn identity(flow: &FlowOf<A>) -> Self {
        NatOf {
            src_be: flow.src_be,
            sport_be: flow.sport_be,
            dst_be: flow.dst_be,
            dport_be: flow.dport_be,
            redirect: false,
        }
    }
}

impl Nat {
    /// Writes this translation into the packet.
    #[inline(always)]
    pub fn apply<H: Hook>(&self, ctx: &H, flow: &Flow) -> Result<(), ()> {
        if flow.frag == frag::LATER {
            // The IP header alone, at either hook: it is never offloaded,
            // and its sum stays the same, so a `CHECKSUM_COMPLETE`
            // `skb->csum` still holds.
            let (data, data_end) = ctx.bounds();
            return rewrite_ip(data, data_end, flow, self).map(|_| ());
        }
        if let Some(tc) = ctx.tc() {
            return rewrite_skb(tc, flow, self).map_err(|_| ());
        }
        // XDP: checksums are as on the wire.
        let (data, data_end) = ctx.bounds();
        rewrite_direct(data, data_end, flow, self, L4Csum::Full).map(|_| ())
    }

    #[inline(always)]
    fn moves_addrs(&self, flow: &Flow) -> bool {
        self.src_be != flow.src_be || self.dst_be != flow.dst_be
    }

    #[inline(always)]
    fn moves_ports(&self, flow: &Flow) -> bool {
        self.sport_be != flow.sport_be || self.dport_be != flow.dport_be
    }
}

/// Writes `nat` over `flow` at tc. Addresses, ports and the IP checksum
/// (never offloaded) are written in place. How the L4 checksum changes
/// depends on the socket buffer's checksum state (`ip_summed`):
/// - none or unnecessary: the field holds the full checksum, updated in
///   place as at XDP;
/// - partial (every packet a local socket sends with offload, so all pod
///   traffic): the field holds the pseudo-header sum the device finishes,
///   updated in place for the addresses only;
/// - complete (`skb->csum` covers the packet and must follow the address
///   change): the address change goes through the kernel's helper, the port
///   change (which the checksum field balances within `skb->csum`'s
///   coverage) is written in place;
/// - not read (a kernel without the kfunc): as complete, except that the
///   helper's result must tell a partial field from a full one
///   (`proxy_common::csum::state_after_pseudo`), and where it cannot, the
///   port change goes through the helper too.
#[inline(always)]
pub fn rewrite_skb(ctx: &TcContext, flow: &Flow, nat: &Nat) -> Result<(), i64> {
    let read = ip_summed::read(ctx);
    maps::count_csum_state(read);
    let l4 = match read {
        CHECKSUM_NONE | CHECKSUM_UNNECESSARY => L4Csum::Full,
        CHECKSUM_PARTIAL => L4Csum::Partial,
        _ => L4Csum::Caller,
    };
    let deltas = rewrite_direct(ctx.data(), ctx.data_end(), flow, nat, l4).map_err(|()| -1i64)?;
    if l4 != L4Csum::Caller {
        return Ok(());
    }
    let csum_off = flow.l4_csum_off();
    let udp = flow.proto == PROTO_UDP;
    let mangled = if udp { BPF_F_MARK_MANGLED_0 } else { 0 };
    let mut state = SkbCsum::Unknown;
    // Size 0: `to` is a difference to add, not a field's new value.
    if nat.moves_addrs(flow) {
        ctx.l4_csum_replace(
            csum_off,
            0,
            u64::from(deltas.addrs),
            BPF_F_PSEUDO_HDR | mangled,
        )?;
        // The helper may have moved packet data: pointers are taken anew.
        let field = l4_csum_field(ctx.data(), ctx.data_end(), flow).ok_or(-1i64)?;
        // SAFETY: inside the packet, as `l4_csum_field` checked.
        let after = unsafe { field.read() };
        state = if read == CHECKSUM_COMPLETE && !(udp && after == 0) {
            SkbCsum::Full
        } else {
            csum::state_after_pseudo(deltas.csum, deltas.addrs, after, udp)
        };
        if nat.moves_ports(flow) && state == SkbCsum::Full {
            // SAFETY: inside the packet, as `l4_csum_field` checked; nothing moved
            // packet data since.
            unsafe { field.write(full_update(after, u64::from(deltas.ports), udp)) };
        }
    }
    if nat.moves_ports(flow) && state == SkbCsum::Unknown {
        ctx.l4_csum_replace(csum_off, 0, u64::from(deltas.ports), mangled)?;
    }
    Ok(())
}

/// What the L4 checksum field holds, and so who keeps it right after a
/// rewrite.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum L4Csum {
    /// The full checksum, with nothing else to follow it (XDP, where
    /// checksums are as on the wire; tc with `CHECKSUM_NONE` or
    /// `CHECKSUM_UNNECESSARY`): updated here, in place.
    Full,
    /// The pseudo-header sum a device finishes (tc, `CHECKSUM_PARTIAL`):
    /// updated here for the addresses only, as the kernel does.
    Partial,
    /// Left to the caller (tc, when the state is `CHECKSUM_COMPLETE`, whose
    /// `skb->csum` only the kernel's helper can update, or unknown).
    Caller,
}

/// What a rewrite changed in the L4 checksum's coverage, for a caller that
/// updates it (`L4Csum::Caller`): folded one's complement sums, as the
/// kernel's checksum helpers take them, split because only addresses are
/// in the pseudo-header; and the checksum field as it was.
pub struct L4Deltas {
    pub addrs: u32,
    pub ports: u32,
    pub csum: u16,
}

/// The L4 checksum field of `flow` in the packet between `data` and
/// `data_end`, if it is inside.
#[inline(always)]
pub fn l4_csum_field(data: usize, data_end: usize, flow: &Flow) -> Option<*mut u16> {
    let l4_off = flow.l4_off;
    if l4_off > MAX_L4_OFF {
        return None;
    }
    let l4p = data + l4_off;
    // Per protocol, so that the verifier sees constant offsets.
    if flow.proto == PROTO_TCP {
        (l4p + 20 <= data_end).then_some((l4p + 16) as *mut u16)
    } else {
        (l4p + 8 <= data_end).then_some((l4p + 6) as *mut u16)
    }
}

/// Writes `nat` over `flow`'s addresses and ports in the packet between
/// `data` and `data_end` in one pass, with one checksum update for all of
/// it: the IP checksum, and the L4 one unless `l4` leaves it to the caller.
/// A UDP checksum of 0 means "none" and stays 0; a computed 0 is sent as
/// 0xffff (RFC 768).
#[inline(always)]
pub fn rewrite_direct(
    data: usize,
    data_end: usize,
    flow: &Flow,
    nat: &Nat,
    l4: L4Csum,
) -> Result<L4Deltas, ()> {
    let l4_csum = l4_csum_field(data, data_end, flow).ok_or(())?;
    let l4p = data + flow.l4_off;
    let addrs = rewrite_ip(data, data_end, flow, nat)?;
    let ports = delta16(flow.sport_be, nat.sport_be) + delta16(flow.dport_be, nat.dport_be);
    // SAFETY: every access below is inside the bounds `l4_csum_field`
    // checked.
    unsafe {
        (l4p as *mut u16).write(nat.sport_be);
        ((l4p + 2) as *mut u16).write(nat.dport_be);
        let old = l4_csum.read();
        let udp = flow.proto == PROTO_UDP;
        match l4 {
            L4Csum::Full => l4_csum.write(full_update(old, addrs + ports, udp)),
            // Ports are not in the pseudo-header: the device sums them.
            L4Csum::Partial => l4_csum.write(pseudo_partial(old, addrs, udp)),
            L4Csum::Caller => {}
        }
        Ok(L4Deltas {
            addrs: u32::from(fold(addrs)),
            ports: u32::from(fold(ports)),
            csum: old,
        })
    }
}

/// Writes `nat`'s addresses into the IP header, with its checksum updated;
/// returns the change to the sum of the addresses (unfolded), which the L4
/// checksum's pseudo-header follows. All a later fragment needs: its L4
/// header, and the checksum that covers the whole datagram, are in the
/// first fragment.
#[inline(always)]
pub fn rewrite_ip(data: usize, data_end: usize, flow: &Flow, nat: &Nat) -> Result<u64, ()> {
    let ip = data + ETH_HLEN;
    if ip + IPV4_MIN_HLEN > data_end {
        return Err(());
    }
    let addrs = delta32(flow.src_be, nat.src_be) + delta32(flow.dst_be, nat.dst_be);
    // SAFETY: inside the bounds checked above.
    unsafe {
        ((ip + IP_SRC_OFF) as *mut u32).write(nat.src_be);
        ((ip + IP_DST_OFF) as *mut u32).write(nat.dst_be);
        let ip_csum = (ip + IP_CSUM_OFF) as *mut u16;
        ip_csum.write(apply(ip_csum.read(), addrs));
    }
    Ok(addrs)
}
