//! Address and port rewrites: what a packet becomes, and the tc way of
//! writing it (XDP's is all in `checksum`).

use aya_ebpf::programs::TcContext;
use proxy_common::PROTO_UDP;

use crate::{
    checksum::{self, L4Csum},
    hook::Hook,
    packet::Flow,
};

const BPF_F_PSEUDO_HDR: u64 = 1 << 4;
/// Keeps a UDP checksum of 0 ("none") at 0, and turns a computed 0 into
/// 0xffff, as RFC 768 wants.
const BPF_F_MARK_MANGLED_0: u64 = 1 << 5;

pub enum Side {
    Source,
    Destination,
}

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
        if self.dst_be != flow.dst_be || self.dport_be != flow.dport_be {
            ctx.rewrite(flow, Side::Destination, self.dst_be, self.dport_be)?;
        }
        if self.src_be != flow.src_be || self.sport_be != flow.sport_be {
            ctx.rewrite(flow, Side::Source, self.src_be, self.sport_be)?;
        }
        Ok(())
    }
}

/// Rewrites the source or destination address and port of `flow` at tc.
/// Addresses, ports and the IP checksum (never offloaded) are written in
/// place; the L4 checksum goes through the kernel's helper, the only code
/// that knows whether the socket buffer holds a partial checksum (to be
/// finished by the device: only the pseudo-header part changes) or a
/// complete one (whose `skb->csum` must follow).
#[inline(always)]
pub fn rewrite_skb(
    ctx: &TcContext,
    flow: &Flow,
    side: Side,
    addr_be: u32,
    port_be: u16,
) -> Result<(), i64> {
    let (old_addr, old_port) = match side {
        Side::Source => (flow.src_be, flow.sport_be),
        Side::Destination => (flow.dst_be, flow.dport_be),
    };
    checksum::rewrite_direct(
        ctx.data(),
        ctx.data_end(),
        flow,
        side,
        addr_be,
        port_be,
        L4Csum::Caller,
    )
    .map_err(|()| -1i64)?;
    let csum_off = flow.l4_csum_off();
    let mangled = if flow.proto == PROTO_UDP {
        BPF_F_MARK_MANGLED_0
    } else {
        0
    };
    if old_addr != addr_be {
        ctx.l4_csum_replace(
            csum_off,
            old_addr as u64,
            addr_be as u64,
            BPF_F_PSEUDO_HDR | mangled | 4,
        )?;
    }
    if old_port != port_be {
        ctx.l4_csum_replace(csum_off, old_port as u64, port_be as u64, mangled | 2)?;
    }
    Ok(())
}
