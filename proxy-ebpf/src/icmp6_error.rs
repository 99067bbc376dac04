//! ICMPv6 errors about translated IPv6 flows (RFC 4443: destination
//! unreachable, packet too big, time exceeded, parameter problem), as
//! `icmp_error` translates IPv4's: the quoted packet was on the wire
//! translated, and a socket connected to a ClusterIP does not recognise an
//! error quoting the backend. Without this, a closed port only times out,
//! and a "packet too big" from a router between the node and a backend
//! never lowers the client's path MTU: large transfers black-hole.
//!
//! An error is matched to its flow by its quote reversed (the way a packet
//! of the flow going the error's way travels) and rewritten as that packet
//! would be: the quote's addresses and ports, the quoted transport checksum
//! where the quote reaches it, the error's destination, and its source
//! where the peer itself answered (a router's address on the way stays).
//! Conntrack entries are only read. The ICMPv6 checksum covers the
//! pseudo-header (the error's addresses) and the whole quote, so it takes
//! every one of these changes; with them it balances the packet's byte sum,
//! which keeps a `CHECKSUM_COMPLETE` sum right without a helper.
//!
//! The quote's extension headers are walked to its transport header, as
//! far as tc walks a packet's own (a datagram a pod fragmented is quoted
//! with its fragment header, and "packet too big" is what its sender needs
//! to hear). A quote of a later fragment holds no ports to match a flow by,
//! nor does a chain longer than that: such errors, and errors quoting
//! nothing we know, pass untouched.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    programs::TcContext,
};
use proxy_common::{
    PROTO_TCP, PROTO_UDP, counter,
    csum::{apply, delta16, delta32, full_update},
};

use crate::{
    conntrack::{self, now_ns},
    event_log::{self, Event},
    family::V6,
    maps::count,
    nat6::Nat6,
    packet::{ETH_HLEN, frag},
    packet6::{
        FRAG_OFFSET_MASK, Flow6, IP6_SRC_OFF, IPV6_HLEN, Ipv6Head, NEXTHDR_AUTH, NEXTHDR_DEST,
        NEXTHDR_FRAGMENT, NEXTHDR_HOP, NEXTHDR_ROUTING, ext_header_len,
    },
    route::{self, Hop},
};

const IPPROTO_ICMPV6: u8 = 58;

/// Error message types (RFC 4443 2.1): 1 to 4; informational ones start
/// at 128, neighbour discovery among them.
const ICMPV6_ERROR_MAX: u8 = 4;
const ICMPV6_HLEN: usize = 8;
/// Offsets within the quoted transport header.
const UDP_CSUM_OFF: usize = 6;
const TCP_CSUM_OFF: usize = 16;
/// Extension headers walked in a quote: as many as tc walks in a packet
/// (`packet6`), so that every packet tc translates is matched when quoted.
const QUOTE_EXT_HEADERS: usize = 4;

/// Translates the ICMPv6 message at `icmp_off` if it is an error quoting a
/// translated flow's packet; anything else passes untouched. Bytes are read
/// and written through helpers, as in `icmp_error`: the quote sits past
/// headers the verifier would otherwise have to follow, for packets that
/// are rare.
#[inline(always)]
pub fn handle(ctx: &TcContext, icmp_off: usize) -> i32 {
    let Ok(icmp_type) = ctx.load::<u8>(icmp_off) else {
        return TC_ACT_OK;
    };
    if icmp_type == 0 || icmp_type > ICMPV6_ERROR_MAX {
        return TC_ACT_OK;
    }
    let Ok(outer) = ctx.load::<Ipv6Head>(ETH_HLEN) else {
        return TC_ACT_OK;
    };
    let quote_off = icmp_off + ICMPV6_HLEN;
    let Ok(quote) = ctx.load::<Ipv6Head>(quote_off) else {
        return TC_ACT_OK;
    };
    // Where the error's datagram ends: a quote reaches no further.
    let end = ETH_HLEN + IPV6_HLEN + u16::from_be(outer.payload_len_be) as usize;
    if (u16::from_be(quote.ver_tc_flow[0]) >> 12) != 6 || outer.dst_be != quote.src_be {
        // Not a quote of an IPv6 packet, or not addressed to the quoted
        // packet's sender.
        return TC_ACT_OK;
    }
    let Some((proto, quote_l4_off)) = quoted_transport(ctx, quote.next_hdr, quote_off + IPV6_HLEN)
    else {
        return TC_ACT_OK;
    };
    if quote_l4_off + 4 > end {
        // The quote is cut before the ports.
        return TC_ACT_OK;
    }
    let Ok(ports) = ctx.load::<[u16; 2]>(quote_l4_off) else {
        return TC_ACT_OK;
    };
    // The packet of the flow that travels the error's way: the quote
    // reversed.
    let flow = Flow6 {
        l4_off: quote_l4_off,
        src_be: quote.dst_be,
        dst_be: quote.src_be,
        sport_be: ports[1],
        dport_be: ports[0],
        proto,
        tcp_flags: 0,
        tcp_seq_be: 0,
        tcp_ack_be: 0,
        frag: frag::NONE,
        frag_id_be: 0,
    };
    let key = conntrack::flow_key(&flow);
    let Some(found) = conntrack::lookup::<V6>(&key, &flow, now_ns()) else {
        return TC_ACT_OK;
    };
    // SAFETY: a valid map value pointer for the duration of this program.
    let nat = conntrack::translation(unsafe { &*found.ptr }, &flow);
    let from_peer = outer.src_be == quote.dst_be;
    let at = Offsets {
        icmp: icmp_off,
        quote: quote_off,
        end,
    };
    if rewrite(ctx, &outer, &flow, &nat, from_peer, &at).is_err() {
        count(counter::DROP_REWRITE);
        return TC_ACT_SHOT;
    }
    count(counter::ICMP_ERROR_TRANSLATED);
    if !(from_peer && nat.redirect) {
        return TC_ACT_OK;
    }
    // Its new source is an address of this node (the peer's answer, from
    // the frontend or the node's SNAT address): routed here, as the flow's
    // own packets are, which the stack would refuse as martian.
    count(counter::REDIRECT);
    let len = (ctx.len() as usize).saturating_sub(ETH_HLEN) as u16;
    match route::lookup::<V6, _>(ctx, IPPROTO_ICMPV6, &nat.src_be, &nat.dst_be, len) {
        Hop::Via { .. } => route::send_tc::<V6>(ctx, IPPROTO_ICMPV6, &nat.src_be, &nat.dst_be),
        // An error is never longer than the minimum MTU (RFC 4443 2.4).
        Hop::TooBig(_) | Hop::Unroutable => {
            count(counter::DROP_NO_ROUTE);
            event_log::log6_addrs(Event::NoRoute, IPPROTO_ICMPV6, &nat.src_be, &nat.dst_be);
            TC_ACT_SHOT
        }
    }
}

/// The quoted packet's transport protocol, TCP or UDP, and where its
/// header starts, past the extension headers from `off` on (`next` the
/// first one's type); `None` for a quote of a later fragment, of another
/// protocol, or whose chain goes on past `QUOTE_EXT_HEADERS`.
#[inline(always)]
fn quoted_transport(ctx: &TcContext, mut next: u8, mut off: usize) -> Option<(u8, usize)> {
    for _ in 0..QUOTE_EXT_HEADERS {
        let len = match next {
            NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_DEST | NEXTHDR_AUTH => {
                let head: [u8; 2] = ctx.load(off).ok()?;
                let len = ext_header_len(next, head[1]);
                next = head[0];
                len
            }
            NEXTHDR_FRAGMENT => {
                let head: [u8; 4] = ctx.load(off).ok()?;
                if u16::from_be_bytes([head[2], head[3]]) & FRAG_OFFSET_MASK != 0 {
                    return None;
                }
                next = head[0];
                8
            }
            _ => break,
        };
        off += len;
    }
    (next == PROTO_TCP || next == PROTO_UDP).then_some((next, off))
}

/// Where the error's parts are: its ICMPv6 header, its quote, and the end
/// of its datagram.
struct Offsets {
    icmp: usize,
    quote: usize,
    end: usize,
}

/// Writes the translation: the quote as the flow's packet going the quoted
/// way becomes (`nat` reversed), its transport checksum where the quote
/// holds it, the error's own addresses, and the ICMPv6 checksum over all of
/// that. `flow` is the quote reversed.
#[inline(always)]
fn rewrite(
    ctx: &TcContext,
    outer: &Ipv6Head,
    flow: &Flow6,
    nat: &Nat6,
    from_peer: bool,
    at: &Offsets,
) -> Result<(), i64> {
    // The quote's source is where the flow's packets going the error's way
    // are sent, its destination where they come from; the error goes where
    // they go, and comes from where they come from when the peer sent it.
    let mut quoted = 0u64;
    let mut error = 0u64;
    for i in 0..4 {
        quoted += delta32(flow.dst_be[i], nat.dst_be[i]) + delta32(flow.src_be[i], nat.src_be[i]);
        error += delta32(outer.dst_be[i], nat.dst_be[i]);
        if from_peer {
            error += delta32(outer.src_be[i], nat.src_be[i]);
        }
    }
    quoted += delta16(flow.dport_be, nat.dport_be) + delta16(flow.sport_be, nat.sport_be);
    let mut icmp = quoted + error;
    // Linux quotes as much of the packet as fits in the minimum MTU, the
    // transport checksum with it; a quote cut shorter leaves it as it is.
    let csum_off = flow.l4_off
        + if flow.proto == PROTO_TCP {
            TCP_CSUM_OFF
        } else {
            UDP_CSUM_OFF
        };
    if csum_off + 2 <= at.end {
        let old: u16 = ctx.load(csum_off)?;
        let new = full_update(old, quoted, flow.proto == PROTO_UDP);
        ctx.store(csum_off, &new, 0)?;
        icmp += delta16(old, new);
    }
    ctx.store(at.quote + IP6_SRC_OFF, &[nat.dst_be, nat.src_be], 0)?;
    ctx.store(flow.l4_off, &[nat.dport_be, nat.sport_be], 0)?;
    let icmp_csum: u16 = ctx.load(at.icmp + 2)?;
    ctx.store(at.icmp + 2, &apply(icmp_csum, icmp), 0)?;
    let src_be = if from_peer {
        &nat.src_be
    } else {
        &outer.src_be
    };
    ctx.store(ETH_HLEN + IP6_SRC_OFF, &[*src_be, nat.dst_be], 0)
}
