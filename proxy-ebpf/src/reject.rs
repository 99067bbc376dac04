//! Rejecting a packet to a frontend without backends, so the client fails at
//! once (kube-proxy's `REJECT`): a TCP SYN is answered with a RST, anything
//! else with an ICMP port unreachable. The packet is rewritten in place and
//! sent back out of the interface it came in on.
//!
//! A TCP SYN is turned into its RST by incremental checksum updates rather
//! than rebuilt: a SYN from a local socket is `CHECKSUM_PARTIAL`, which forbids
//! cutting it below its checksum field (what an ICMP quote would need) and
//! leaves the final checksum to the device, and the incremental helpers do
//! the right thing in both cases.

use aya_ebpf::{bindings::TC_ACT_REDIRECT, helpers, programs::TcContext};

use crate::packet::{ETH_HLEN, Flow, TCP_ACK, TCP_RST, TCP_SYN};

const IPV4_HLEN: usize = 20;
const ICMP_HLEN: usize = 8;
/// RFC 792: the offending IP header plus the first 8 bytes of its payload.
const QUOTE_LEN: usize = IPV4_HLEN + 8;
const BPF_ADJ_ROOM_MAC: u32 = 1;
const IPPROTO_ICMP: u8 = 1;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;

#[repr(C)]
#[derive(Clone, Copy)]
struct Reply {
    eth_dst: [u8; 6],
    eth_src: [u8; 6],
    eth_type_be: u16,
    ver_ihl: u8,
    tos: u8,
    tot_len_be: u16,
    id_be: u16,
    frag_be: u16,
    ttl: u8,
    proto: u8,
    ip_csum: u16,
    // Halves, so that the struct stays 2-aligned with no padding.
    src_be: [u16; 2],
    dst_be: [u16; 2],
    icmp_type: u8,
    icmp_code: u8,
    icmp_csum: u16,
    icmp_unused: [u16; 2],
}

#[inline(always)]
fn halves(word: u32) -> [u16; 2] {
    let b = word.to_ne_bytes();
    [
        u16::from_ne_bytes([b[0], b[1]]),
        u16::from_ne_bytes([b[2], b[3]]),
    ]
}

/// Folds a 32-bit one's complement sum into 16 bits.
#[inline(always)]
fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    !(sum as u16)
}

/// One's complement sum of native-order u16 words, as they sit in memory.
#[inline(always)]
fn sum_words(words: &[u16]) -> u32 {
    let mut sum = 0u32;
    for w in words {
        sum += u32::from(*w);
    }
    sum
}

const IP_SRC_OFF: usize = ETH_HLEN + 12;

/// Answers a bare SYN with RST|ACK (seq 0, ack = SYN's seq + 1, as RFC 793
/// has it for a segment without ACK). Any other TCP segment to a frontend
/// without backends is dropped: without a flow there is nothing to reset.
#[inline(always)]
pub fn tcp_reset(ctx: &TcContext, flow: &Flow) -> Result<i32, i64> {
    let l4 = flow.l4_off;
    let doff: u8 = ctx.load(l4 + 12)?;
    let tcp_len = ((doff >> 4) as usize) * 4;
    let tot_len_be: u16 = ctx.load(ETH_HLEN + 2)?;
    // Read where it is used: hoisted into code `tc_ingress` shares with
    // other actions, it would read a register those never set, which the
    // verifier refuses.
    // SAFETY: points at an initialised field of a live reference.
    let tcp_flags = unsafe { core::ptr::read_volatile(&raw const flow.tcp_flags) };
    if tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) != TCP_SYN
        || u16::from_be(tot_len_be) as usize != flow.ihl_bytes + tcp_len
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
            let addrs: [u32; 2] = [flow.dst_be, flow.src_be];
            ctx.store(IP_SRC_OFF, &addrs, 0)
        },
    )
}

/// A bare SYN, checked as such by its family's `tcp_reset`: where its TCP
/// header is, its data offset byte, where its checksum is, its ports.
pub struct Syn {
    pub l4: usize,
    pub doff: u8,
    pub csum: usize,
    pub sport_be: u16,
    pub dport_be: u16,
}

/// Turns `syn` into its RST|ACK in place and sends it back: seq 0, ack =
/// SYN's seq + 1, no window, ports swapped, the IP addresses swapped by
/// `swap_addrs`, MACs swapped. Shared by both families, whose TCP headers
/// differ only in where they sit. The family swaps its own addresses, and
/// only there: read sooner, `tc_ingress` keeps them on its stack meanwhile.
#[inline(always)]
pub fn reset_syn(
    ctx: &TcContext,
    syn: &Syn,
    swap_addrs: impl FnOnce() -> Result<(), i64>,
) -> Result<i32, i64> {
    let (l4, csum) = (syn.l4, syn.csum);
    let macs: [u8; 12] = ctx.load(0)?;
    let seq_be: u32 = ctx.load(l4 + 4)?;
    let ack_be: u32 = ctx.load(l4 + 8)?;
    let flags_word_be: u16 = ctx.load(l4 + 12)?;
    let window_be: u16 = ctx.load(l4 + 14)?;
    let new_ack_be = u32::from_be(seq_be).wrapping_add(1).to_be();
    // The data-offset byte and the flags byte, as they sit in the packet.
    let new_flags_word_be = u16::from_ne_bytes([syn.doff, TCP_RST | TCP_ACK]);
    // Swapping addresses or ports leaves every checksum as it is (one's
    // complement sums commute, and IPv6's pseudo-header sums the same two
    // addresses); only the changed fields are accounted for.
    ctx.l4_csum_replace(csum, u64::from(seq_be), 0, 4)?;
    ctx.l4_csum_replace(csum, u64::from(ack_be), u64::from(new_ack_be), 4)?;
    ctx.l4_csum_replace(
        csum,
        u64::from(flags_word_be),
        u64::from(new_flags_word_be),
        2,
    )?;
    ctx.l4_csum_replace(csum, u64::from(window_be), 0, 2)?;
    let seq_ack: [u32; 2] = [0, new_ack_be];
    ctx.store(l4 + 4, &seq_ack, 0)?;
    ctx.store(l4 + 12, &new_flags_word_be, 0)?;
    ctx.store(l4 + 14, &0u16, 0)?;
    let ports: [u16; 2] = [syn.dport_be, syn.sport_be];
    ctx.store(l4, &ports, 0)?;
    swap_addrs()?;
    let swapped: [u8; 12] = [
        macs[6], macs[7], macs[8], macs[9], macs[10], macs[11], macs[0], macs[1], macs[2], macs[3],
        macs[4], macs[5],
    ];
    ctx.store(0, &swapped, 0)?;
    Ok(redirect_back(ctx))
}

#[inline(always)]
pub fn redirect_back(ctx: &TcContext) -> i32 {
    // SAFETY: `skb` is the context the kernel passed this program, valid for its run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: takes an interface index and flags, no pointers.
    unsafe { helpers::bpf_redirect(ifindex, 0) };
    TC_ACT_REDIRECT
}

/// Turns `flow`'s packet into an ICMP port unreachable addressed to its
/// sender. Returns the tc verdict; on any failure the packet is dropped,
/// which is still the right outcome for a frontend without backends.
#[inline(always)]
pub fn icmp_port_unreachable(ctx: &TcContext, flow: &Flow) -> Result<i32, i64> {
    // Quoting IP options too would make the reply variable-length; such
    // packets are rare enough to drop instead.
    if flow.ihl_bytes != IPV4_HLEN {
        return Err(0);
    }
    let macs: [u8; 12] = ctx.load(0)?;
    // The quote must be exactly one IPv4 header and 8 bytes: cut the rest,
    // then open room for the new IP and ICMP headers before it.
    let quoted_end = (ETH_HLEN + QUOTE_LEN) as u32;
    // SAFETY: this program's own skb; no packet pointer is held across the
    // call (the quote and the headers are loaded afresh after it).
    let ret = unsafe { helpers::bpf_skb_change_tail(ctx.skb.skb, quoted_end, 0) };
    if ret != 0 {
        return Err(ret);
    }
    ctx.adjust_room((IPV4_HLEN + ICMP_HLEN) as i32, BPF_ADJ_ROOM_MAC, 0)?;
    let quote: [u16; QUOTE_LEN / 2] = ctx.load(ETH_HLEN + IPV4_HLEN + ICMP_HLEN)?;

    let mut reply = Reply {
        eth_dst: [macs[6], macs[7], macs[8], macs[9], macs[10], macs[11]],
        eth_src: [macs[0], macs[1], macs[2], macs[3], macs[4], macs[5]],
        eth_type_be: 0x0800u16.to_be(),
        ver_ihl: 0x45,
        tos: 0,
        tot_len_be: ((IPV4_HLEN + ICMP_HLEN + QUOTE_LEN) as u16).to_be(),
        id_be: 0,
        frag_be: 0,
        ttl: 64,
        proto: IPPROTO_ICMP,
        ip_csum: 0,
        // From the frontend the client addressed: that is whom it expects
        // errors from.
        src_be: halves(flow.dst_be),
        dst_be: halves(flow.src_be),
        icmp_type: ICMP_DEST_UNREACH,
        icmp_code: ICMP_PORT_UNREACH,
        icmp_csum: 0,
        icmp_unused: [0, 0],
    };
    let (ip_sum, icmp_sum) = {
        // SAFETY: Reply is repr(C) and 42 bytes with no padding; reading it
        // as u16 words is how the Internet checksum is defined.
        let words: &[u16; 21] = unsafe { &*(&raw const reply).cast::<[u16; 21]>() };
        (sum_words(&words[7..17]), sum_words(&words[17..21]))
    };
    reply.ip_csum = fold(ip_sum);
    reply.icmp_csum = fold(icmp_sum + sum_words(&quote));
    ctx.store(0, &reply, 0)?;
    Ok(redirect_back(ctx))
}
