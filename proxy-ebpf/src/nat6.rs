//! Address and port rewrites of IPv6 packets, at tc and at XDP. IPv6 has no header
//! checksum; the transport checksum covers the addresses through the
//! pseudo-header (RFC 8200 8.1), so an address change is a pseudo-header
//! change and a port change a change of the covered data.
//!
//! At tc the socket buffer's checksum state (`ip_summed`) decides, as for
//! IPv4 (`nat::rewrite_skb`), and is counted the same way. A full checksum
//! (none, unnecessary, and complete too) is updated in place: with no header
//! checksum to take the address change, the field's change balances the
//! addresses' and ports' in the packet's byte sum, so a `CHECKSUM_COMPLETE`
//! `skb->csum` still holds (unlike IPv4's, which needs the kernel's helper).
//! A `CHECKSUM_PARTIAL` field, the pseudo-header sum the device finishes,
//! takes the address change alone. Packets with extension headers before
//! the transport header, and every packet on a kernel where tc cannot read
//! the state, go through the kernel's `bpf_l4_csum_replace`, which applies
//! each change as the state needs: direct writes at an offset the header
//! walk found would have the verifier follow every walk through them. At
//! XDP there is no socket buffer and so no partial checksum: the packet is
//! written directly and its full checksum updated in place
//! (`rewrite_direct`).

use aya_ebpf::programs::TcContext;
use proxy_common::{
    PROTO_TCP, PROTO_UDP,
    csum::{delta16, delta32, fold, full_update, pseudo_partial},
    ip_summed::{CHECKSUM_COMPLETE, CHECKSUM_NONE, CHECKSUM_PARTIAL, CHECKSUM_UNNECESSARY},
};

use crate::{
    ip_summed, maps,
    nat::{L4Csum, NatOf},
    packet::{ETH_HLEN, frag},
    packet6::{Flow6, IP6_DST_OFF, IP6_SRC_OFF, IPV6_HLEN, MAX_L4_OFF},
};

/// Where the transport header of a packet without extension headers
/// starts: the one offset tc writes at directly.
const PLAIN_L4_OFF: usize = ETH_HLEN + IPV6_HLEN;
/// The next-header field's offset within the IPv6 header.
const NEXT_HDR_OFF: usize = 6;

const BPF_F_PSEUDO_HDR: u64 = 1 << 4;

/// An IPv6 packet's translation (`nat::NatOf`).
pub type Nat6 = NatOf<[u32; 4]>;

impl Nat6 {
    /// Writes this translation into the packet at tc, transport checksum
    /// updated as the checksum state needs (see the module's comment).
    /// A later fragment gets its addresses alone: it carries neither ports
    /// nor checksum, and its first fragment's checksum update covered the
    /// whole datagram's pseudo-header.
    #[inline(always)]
    pub fn apply(&self, ctx: &TcContext, flow: &Flow6) -> Result<(), i64> {
        if flow.frag == frag::LATER {
            return self.store_addrs(ctx);
        }
        let state = ip_summed::read(ctx);
        maps::count_csum_state(state);
        let l4 = match state {
            CHECKSUM_NONE | CHECKSUM_UNNECESSARY | CHECKSUM_COMPLETE => L4Csum::Full,
            CHECKSUM_PARTIAL => L4Csum::Partial,
            _ => L4Csum::Caller,
        };
        if l4 != L4Csum::Caller && transport_follows_header(ctx) {
            return rewrite_at(ctx.data(), ctx.data_end(), PLAIN_L4_OFF, flow, self, l4)
                .map_err(|()| -1);
        }
        self.apply_by_helper(ctx, flow)
    }

    /// The translation through the kernel's checksum helper, whatever the
    /// checksum state.
    #[inline(always)]
    fn apply_by_helper(&self, ctx: &TcContext, flow: &Flow6) -> Result<(), i64> {
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

/// Whether the packet's transport header follows its IPv6 header, with no
/// extension header between, so that it starts at `PLAIN_L4_OFF`. Read
/// from the packet rather than told by the parser's offset: a branch on
/// that offset would have the verifier tell apart, all through the
/// program, every path the header walk took to it.
#[inline(always)]
fn transport_follows_header(ctx: &TcContext) -> bool {
    let (data, data_end) = (ctx.data(), ctx.data_end());
    let next = data + ETH_HLEN + NEXT_HDR_OFF;
    if next + 1 > data_end {
        return false;
    }
    // SAFETY: inside the bounds checked above.
    let next = unsafe { (next as *const u8).read() };
    next == PROTO_TCP || next == PROTO_UDP
}

/// Writes `nat` over `flow`'s addresses and ports in the packet between
/// `data` and `data_end`, with one update of the full transport checksum
/// for all of it (a computed UDP 0 sent as 0xffff): XDP's rewrite. A later
/// fragment gets its addresses alone, as in `Nat6::apply`. Nothing is
/// written unless every field is inside the packet.
#[inline(always)]
pub fn rewrite_direct(data: usize, data_end: usize, flow: &Flow6, nat: &Nat6) -> Result<(), ()> {
    rewrite_at(data, data_end, flow.l4_off, flow, nat, L4Csum::Full)
}

/// Writes `nat` over `flow`, whose transport header is at `l4_off`, with
/// the transport checksum updated as `l4` says it holds: the full checksum
/// takes every change, a `CHECKSUM_PARTIAL` pseudo-header sum the
/// addresses' alone (the device sums the ports). `l4_off` is a constant
/// where tc calls this, so that the verifier sees constant offsets.
#[inline(always)]
fn rewrite_at(
    data: usize,
    data_end: usize,
    l4_off: usize,
    flow: &Flow6,
    nat: &Nat6,
    l4: L4Csum,
) -> Result<(), ()> {
    let ip = data + ETH_HLEN;
    if ip + IPV6_HLEN > data_end {
        return Err(());
    }
    if flow.frag != frag::LATER {
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
        let ports = delta16(flow.sport_be, nat.sport_be) + delta16(flow.dport_be, nat.dport_be);
        let mut addrs = 0;
        for i in 0..4 {
            addrs +=
                delta32(flow.src_be[i], nat.src_be[i]) + delta32(flow.dst_be[i], nat.dst_be[i]);
        }
        let udp = flow.proto == PROTO_UDP;
        // SAFETY: inside the bounds checked above.
        unsafe {
            (l4p as *mut [u16; 2]).write([nat.sport_be, nat.dport_be]);
            let old = csum.read();
            csum.write(if l4 == L4Csum::Partial {
                pseudo_partial(old, addrs, udp)
            } else {
                full_update(old, addrs + ports, udp)
            });
        }
    }
    // SAFETY: inside the bounds checked above.
    unsafe {
        ((ip + IP6_SRC_OFF) as *mut [u32; 4]).write(nat.src_be);
        ((ip + IP6_DST_OFF) as *mut [u32; 4]).write(nat.dst_be);
    }
    Ok(())
}
