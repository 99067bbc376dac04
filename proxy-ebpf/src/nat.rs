//! Address and port rewrites: what a packet becomes, and the tc way of
//! writing it (XDP's is all in `checksum`).

use aya_ebpf::programs::TcContext;
use proxy_common::{
    PROTO_UDP,
    csum::{self, SkbCsum},
    ip_summed::{CHECKSUM_COMPLETE, CHECKSUM_NONE, CHECKSUM_PARTIAL, CHECKSUM_UNNECESSARY},
};

use crate::{
    checksum::{self, L4Csum},
    hook::Hook,
    ip_summed, maps,
    packet::{Flow, frag},
};

const BPF_F_PSEUDO_HDR: u64 = 1 << 4;
/// Keeps a UDP checksum of 0 ("none") at 0, and turns a computed 0 into
/// 0xffff, as RFC 768 wants.
const BPF_F_MARK_MANGLED_0: u64 = 1 << 5;

/// The addresses and ports a packet leaves with.
#[derive(Clone, Copy)]
pub struct Nat {
    pub src_be: u32,
    pub sport_be: u16,
    pub dst_be: u32,
    pub dport_be: u16,
    /// The new source is an address of this node: the packet must be routed
    /// by a FIB lookup and redirected, as the stack would drop it.
    pub redirect: bool,
}

impl Nat {
    /// The packet as it is.
    #[inline(always)]
    pub fn identity(flow: &Flow) -> Nat {
        Nat {
            src_be: flow.src_be,
            sport_be: flow.sport_be,
            dst_be: flow.dst_be,
            dport_be: flow.dport_be,
            redirect: false,
        }
    }

    /// Writes this translation into the packet.
    #[inline(always)]
    pub fn apply<H: Hook>(&self, ctx: &H, flow: &Flow) -> Result<(), ()> {
        if flow.frag == frag::LATER {
            // The IP header alone, at either hook: it is never offloaded,
            // and its sum stays the same, so a `CHECKSUM_COMPLETE`
            // `skb->csum` still holds.
            let (data, data_end) = ctx.bounds();
            return checksum::rewrite_ip(data, data_end, flow, self).map(|_| ());
        }
        ctx.rewrite(flow, self)
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
    let deltas =
        checksum::rewrite_direct(ctx.data(), ctx.data_end(), flow, nat, l4).map_err(|()| -1i64)?;
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
        let field = checksum::l4_csum_field(ctx.data(), ctx.data_end(), flow).ok_or(-1i64)?;
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
            unsafe { field.write(csum::full_update(after, u64::from(deltas.ports), udp)) };
        }
    }
    if nat.moves_ports(flow) && state == SkbCsum::Unknown {
        ctx.l4_csum_replace(csum_off, 0, u64::from(deltas.ports), mangled)?;
    }
    Ok(())
}
