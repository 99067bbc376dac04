//! Rejecting an IPv6 packet to a frontend without backends, as `reject`
//! does for IPv4: a TCP SYN is answered with a RST, a UDP datagram with an
//! ICMPv6 destination unreachable, port unreachable (RFC 4443 3.1, type 1
//! code 4), each sent back out of the interface the packet came in on.

use aya_ebpf::{helpers, programs::TcContext};
use proxy_common::csum::fold;

use crate::{
    packet::{ETH_HLEN, TCP_ACK, TCP_RST, TCP_SYN},
    packet6::{Flow6, IP6_SRC_OFF, IPV6_HLEN},
    reject::{Syn, redirect_back, reset_syn},
};

const ICMP6_HLEN: usize = 8;
/// What an error quotes of the packet that caused it: its IPv6 header and
/// the first 8 bytes after it (the UDP header). RFC 4443 asks for as much
/// as fits in the minimum MTU; this much is what a receiver needs to find
/// its socket, and keeps the reply one fixed size.
const QUOTE_LEN: usize = IPV6_HLEN + 8;
const BPF_ADJ_ROOM_MAC: u32 = 1;
const IPPROTO_ICMPV6: u8 = 58;
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_PORT_UNREACH: u8 = 4;
const HOP_LIMIT: u8 = 64;

/// Bytes of the error: Ethernet, IPv6 and ICMPv6 headers and the quote.
const REPLY_LEN: usize = ETH_HLEN + IPV6_HLEN + ICMP6_HLEN + QUOTE_LEN;
const ICMP6_OFF: usize = ETH_HLEN + IPV6_HLEN;

/// One's complement sum of 32-bit words, as they sit in memory, folded to
/// the 16-bit checksum: the same as summing 16-bit words (RFC 1071).
#[inline(always)]
fn checksum(sum: u64) -> u16 {
    !fold(sum)
}

#[inline(always)]
fn sum_addr(addr: &[u32; 4]) -> u64 {
    u64::from(addr[0]) + u64::from(addr[1]) + u64::from(addr[2]) + u64::from(addr[3])
}

/// Answers a bare SYN (no extension headers, no payload) with RST|ACK
/// (seq 0, ack = SYN's seq + 1, RFC 9293). Any other TCP segment to a
/// frontend without backends is dropped. The segment is rewritten as
/// IPv4's is (`reject::reset_syn`): the changed fields go through the
/// kernel's incremental checksum helper, which is right whatever the socket
/// buffer's checksum state.
#[inline(always)]
pub fn tcp_reset(ctx: &TcContext, flow: &Flow6) -> Result<i32, i64> {
    let l4 = flow.l4_off;
    let doff: u8 = ctx.load(l4 + 12)?;
    let tcp_len = ((doff >> 4) as usize) * 4;
    let payload_len_be: u16 = ctx.load(ETH_HLEN + 4)?;
    // SAFETY: points at an initialised field of a live reference; read
    // where it is used, as in `reject::tcp_reset`.
    let tcp_flags = unsafe { core::ptr::read_volatile(&raw const flow.tcp_flags) };
    if tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) != TCP_SYN
        || l4 != ETH_HLEN + IPV6_HLEN
        || u16::from_be(payload_len_be) as usize != tcp_len
    {
        return Err(0);
    }
    reset_syn(
        ctx,
        &Syn {
            l4,
            doff,
            csum: flow.l4_csum_off(),
            sport_be: flow.sport_be,
            dport_be: flow.dport_be,
        },
        || {
            let addrs: [[u32; 4]; 2] = [flow.dst_be, flow.src_be];
            ctx.store(ETH_HLEN + IP6_SRC_OFF, &addrs, 0)
        },
    )
}

/// Turns `flow`'s packet into an ICMPv6 port unreachable from the frontend
/// to its sender, its checksum over the IPv6 pseudo-header. Returns the tc
/// verdict; on failure the caller drops the packet, still the right outcome
/// for a frontend without backends.
#[inline(always)]
pub fn icmp_port_unreachable(ctx: &TcContext, flow: &Flow6) -> Result<i32, i64> {
    let macs: [u8; 12] = ctx.load(0)?;
    // Cut to the quote, then open room for the new IPv6 and ICMPv6 headers
    // before it.
    let quoted_end = (ETH_HLEN + QUOTE_LEN) as u32;
    // SAFETY: this program's own skb; no packet pointer is held across the
    // call (everything after it is loaded afresh).
    let ret = unsafe { helpers::bpf_skb_change_tail(ctx.skb.skb, quoted_end, 0) };
    if ret != 0 {
        return Err(ret);
    }
    ctx.adjust_room((IPV6_HLEN + ICMP6_HLEN) as i32, BPF_ADJ_ROOM_MAC, 0)?;
    let (data, data_end) = (ctx.data(), ctx.data_end());
    if data + REPLY_LEN > data_end {
        return Err(0);
    }
    let icmp_len = (ICMP6_HLEN + QUOTE_LEN) as u32;
    // The pseudo-header (addresses, upper-layer length, next header as
    // 32-bit big-endian words, RFC 8200 8.1), the ICMPv6 header and the
    // quote, summed as they sit in memory. From the frontend the client
    // addressed: whom it expects errors from.
    let icmp_head = u32::from_ne_bytes([ICMPV6_DEST_UNREACH, ICMPV6_PORT_UNREACH, 0, 0]);
    let mut sum = sum_addr(&flow.dst_be)
        + sum_addr(&flow.src_be)
        + u64::from(icmp_len.to_be())
        + u64::from(u32::from(IPPROTO_ICMPV6).to_be())
        + u64::from(icmp_head);
    // SAFETY: every access below is inside the `REPLY_LEN` bytes checked
    // above; plain loads and stores of the field's width, as `packet::read`
    // does. Written in place rather than built on the stack, which this
    // program has little of to spare.
    unsafe {
        let quote = (data + ICMP6_OFF + ICMP6_HLEN) as *const u32;
        for i in 0..QUOTE_LEN / 4 {
            sum += u64::from(quote.add(i).read());
        }
        (data as *mut [u8; 6]).write([macs[6], macs[7], macs[8], macs[9], macs[10], macs[11]]);
        ((data + 6) as *mut [u8; 6]).write([macs[0], macs[1], macs[2], macs[3], macs[4], macs[5]]);
        ((data + 12) as *mut u16).write(0x86ddu16.to_be());
        let ip = data + ETH_HLEN;
        (ip as *mut u32).write(0x6000_0000u32.to_be());
        ((ip + 4) as *mut u16).write((icmp_len as u16).to_be());
        ((ip + 6) as *mut u8).write(IPPROTO_ICMPV6);
        ((ip + 7) as *mut u8).write(HOP_LIMIT);
        for i in 0..4 {
            ((ip + IP6_SRC_OFF + 4 * i) as *mut u32).write(flow.dst_be[i]);
            ((ip + IP6_SRC_OFF + 16 + 4 * i) as *mut u32).write(flow.src_be[i]);
        }
        let icmp = data + ICMP6_OFF;
        (icmp as *mut u32).write(icmp_head);
        ((icmp + 4) as *mut u32).write(0);
        ((icmp + 2) as *mut u16).write(checksum(sum));
    }
    Ok(redirect_back(ctx))
}
