//! Address and port rewrites of IPv6 packets, at tc and at XDP. IPv6 has no header
//! checksum; the transport checksum covers the addresses through the
//! pseudo-header (RFC 8200 8.1), so an address change is a pseudo-header
//! change and a port change a change of the covered data.
//!
//! Both go through the kernel's `bpf_l4_csum_replace`, which applies each
//! as the socket buffer's checksum state needs (a full checksum, a
//! `CHECKSUM_PARTIAL` pseudo-header sum, `skb->csum` of `CHECKSUM_COMPLETE`),
//! so this path does not read the state as IPv4's in-place one does
//! (`nat::rewrite_skb`): two helper calls a packet, for a slice of code that
//! is the same in every state. At XDP there is no socket buffer and so no
//! partial checksum: the packet is written directly and its full checksum
//! updated in place (`rewrite_direct`).

use aya_ebpf::programs::TcContext;
use proxy_common::{
    PROTO_TCP, PROTO_UDP,
    csum::{delta16, delta32, fold, full_update},
};

use crate::{
    packet::{ETH_HLEN, frag},
    packet6::{Flow6, IP6_DST_OFF, IP6_SRC_OFF, IPV6_HLEN, MAX_L4_OFF},
};

const BPF_F_PSEUDO_HDR: u64 = 1 << 4;

/// The addresses and ports an IPv6 packet leaves with.
#[derive(Clone, Copy)]
pub struct Nat6 {
    pub src_be: [u32; 4],
    pub sport_be: u16,
    pub dst_be: [u32; 4],
    pub dport_be: u16,
    /// The new source is an address of this node: routed and redirected
    /// (`route6`), as `nat::Nat::redirect`.
    pub redirect: bool,
}

impl Nat6 {
    /// The packet as it is.
    #[inline(always)]
    pub fn identity(flow: &Flow6) -> Nat6 {
        Nat6 {
            src_be: flow.src_be,
            sport_be: flow.sport_be,
            dst_be: flow.dst_be,
            dport_be: flow.dport_be,
            redirect: false,
        }
    }

    /// Writes this translation into the packet, transport checksum updated.
    /// A later fragment gets its addresses alone: it carries neither ports
    /// nor checksum, and its first fragment's checksum update covered the
    /// whole datagram's pseudo-header.
    #[inline(always)]
    pub fn apply(&self, ctx: &TcContext, flow: &Flow6) -> Result<(), i64> {
        if flow.frag == frag::LATER {
            return self.store_addrs(ctx);
        }
        let mut addrs = 0u64;
        for i in 0..4 {
            addrs +=
                delta32(flow.src_be[i], self.src_be[i]) + delta32(flow.dst_be[i], self.dst_be[i]);
        }
        let ports = delta16(flow.sport_be, self.sport_be) + delta16(flow.dport_be, self.dport_be);
        let csum_off = flow.l4_csum_off();
        // Size 0: `to` is a difference to add, not a field's new value.
        ctx.l4_csum_replace(csum_off, 0, u64::from(fold(addrs)), BPF_F_PSEUDO_HDR)?;
        ctx.l4_csum_replace(csum_off, 0, u64::from(fold(ports)), 0)?;
        if flow.proto == PROTO_UDP {
            // A computed 0 is sent as 0xffff: 0 means "no checksum", which
            // IPv6 forbids. The same sum in one's complement, so right for
            // a `CHECKSUM_PARTIAL` field too.
            let sum: u16 = ctx.load(csum_off)?;
            if sum == 0 {
                ctx.store(csum_off, &0xffffu16, 0)?;
            }
        }
        self.store_addrs(ctx)?;
        let ports: [u16; 2] = [self.sport_be, self.dport_be];
        ctx.store(flow.l4_off, &ports, 0)?;
        Ok(())
    }

    #[inline(always)]
    fn store_addrs(&self, ctx: &TcContext) -> Result<(), i64> {
        // Stored from where they are: a copy of both would take 32 bytes
        // of a stack that is nearly used up.
        ctx.store(ETH_HLEN + IP6_SRC_OFF, &self.src_be, 0)?;
        ctx.store(ETH_HLEN + IP6_DST_OFF, &self.dst_be, 0)
    }
}

/// Writes `nat` over `flow`'s addresses and ports in the packet between
/// `data` and `data_end`, with one update of the full transport checksum
/// for all of it (a computed UDP 0 sent as 0xffff). A later fragment gets
/// its addresses alone, as in `Nat6::apply`. Nothing is written unless
/// every field is inside the packet.
#[inline(always)]
pub fn rewrite_direct(data: usize, data_end: usize, flow: &Flow6, nat: &Nat6) -> Result<(), ()> {
    let ip = data + ETH_HLEN;
    if ip + IPV6_HLEN > data_end {
        return Err(());
    }
    if flow.frag != frag::LATER {
        let l4_off = flow.l4_off;
        if l4_off > MAX_L4_OFF {
            return Err(());
        }
        let l4p = data + l4_off;
        // Per protocol, so that the verifier sees constant offsets.
        let csum = if flow.proto == PROTO_TCP {
            if l4p + 20 > data_end {
                return Err(());
            }
            (l4p + 16) as *mut u16
        } else {
            if l4p + 8 > data_end {
                return Err(());
            }
            (l4p + 6) as *mut u16
        };
        let mut delta = delta16(flow.sport_be, nat.sport_be) + delta16(flow.dport_be, nat.dport_be);
        for i in 0..4 {
            delta +=
                delta32(flow.src_be[i], nat.src_be[i]) + delta32(flow.dst_be[i], nat.dst_be[i]);
        }
        // SAFETY: inside the bounds checked above.
        unsafe {
            (l4p as *mut [u16; 2]).write([nat.sport_be, nat.dport_be]);
            csum.write(full_update(csum.read(), delta, flow.proto == PROTO_UDP));
        }
    }
    // SAFETY: inside the bounds checked above.
    unsafe {
        ((ip + IP6_SRC_OFF) as *mut [u32; 4]).write(nat.src_be);
        ((ip + IP6_DST_OFF) as *mut [u32; 4]).write(nat.dst_be);
    }
    Ok(())
}
