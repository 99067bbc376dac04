//! ICMP errors about translated flows, both families, written once over the
//! family (`ErrorFamily` says what differs): destination unreachable, time
//! exceeded, parameter problem, and "fragmentation needed" or "packet too
//! big". An error quotes the packet that caused it as that packet was on
//! the wire where it failed, translated: a pod's socket connected to a
//! ClusterIP does not recognise an error quoting the backend, nor an outside
//! client one quoting this node's SNAT port, so without this a closed port
//! would only time out and path MTU discovery would black-hole. The quote is
//! translated back as the flow's packets are, and the error's own addresses
//! with it, as netfilter translates its "related" packets.
//!
//! An error is matched to its flow by its quote reversed: the error travels
//! the way a packet of the flow going the other way would, and is rewritten
//! as that packet would be. Its conntrack entries are only read: an error
//! neither creates, refreshes nor assures a flow. The error's source is
//! rewritten only where it is the quoted destination (the peer itself
//! answered); a router's address on the way stays. An error whose new
//! source is then an address of this node (the peer's answer, from a
//! NodePort or the node's SNAT address) is routed here, as the flow's own
//! packets are, which the stack would refuse as martian.
//!
//! A quote of a first fragment has its ports and is translated like any
//! other; one of a later fragment has none to find its flow by and passes
//! untouched, as netfilter leaves it. So do quotes cut before the ports,
//! and IPv6 quotes whose extension headers go on further than tc walks a
//! packet's own.
//!
//! Bytes are read and written through helpers: the headers sit at offsets
//! that depend on two IP headers' lengths, which the verifier would
//! otherwise have to follow through every path, for packets that are rare.
//! At XDP errors are left to tc, which runs on the same interface and can
//! route what it rewrites.

use aya_ebpf::programs::TcContext;
use proxy_common::{
    FlowAddr, PROTO_SCTP, PROTO_TCP, PROTO_UDP, counter,
    csum::{apply, delta16, full_update},
};

use crate::{
    conntrack,
    event_log::Event,
    family::{V4, V6},
    maps::count,
    nat::NatOf,
    packet::{
        ETH_HLEN, FlowOf, IP_CSUM_OFF, IP_MF_OFFSET_MASK, IP_OFFSET_MASK, IP_SRC_OFF, IPPROTO_ICMP,
        IPV4_MIN_HLEN, Ipv4Head, frag,
    },
    packet6::{
        FRAG_OFFSET_MASK, IP6_DST_OFF, IP6_SRC_OFF, IPV6_HLEN, Ipv6Head, NEXTHDR_AUTH,
        NEXTHDR_DEST, NEXTHDR_FRAGMENT, NEXTHDR_HOP, NEXTHDR_ICMPV6, NEXTHDR_ROUTING,
        ext_header_len,
    },
    route::{self, Hop},
};

const ICMP_HLEN: usize = 8;
/// Offsets within the quoted transport header.
const UDP_CSUM_OFF: usize = 6;
const TCP_CSUM_OFF: usize = 16;

/// What becomes of an ICMP message.
pub enum Verdict<R> {
    /// To the stack, translated or not.
    Pass,
    /// A rewrite failed half-way, or the node cannot route what it wrote.
    Drop,
    /// Translated, its new source an address of this node, and its route
    /// found: what the caller's `send` made of it.
    Sent(R),
}

/// What differs between the families' ICMP errors: which messages are
/// errors, the error's and the quote's IP headers, and which checksums an
/// address change reaches (IPv4's header checksums; ICMPv6's pseudo-header).
pub trait ErrorFamily: conntrack::CreateFamily {
    /// ICMP's protocol number: ICMP or ICMPv6.
    const ICMP: u8;

    /// Where the family's parser leaves an ICMP message: IPv4's header
    /// says where its ICMP header starts; IPv6's parser walked the
    /// extension headers to it, and hands on its offset.
    type IcmpAt: Copy;

    /// Whether the ICMP checksum covers a pseudo-header of the error's own
    /// addresses: ICMPv6's does (RFC 4443 2.3), ICMP's not.
    const PSEUDO_HEADER: bool;

    /// An IP header as it is on the wire.
    type IpHead: Copy;

    /// Where the ICMP header of the error whose IP header is `head` starts,
    /// and where its datagram ends, when the message at `at` is an ICMP
    /// error about a packet (not informational, nor neighbour discovery) in
    /// a whole datagram; None otherwise.
    fn error_at(ctx: &TcContext, head: &Self::IpHead, at: Self::IcmpAt) -> Option<(usize, usize)>;

    /// The transport protocol of the packet whose IP header, quoted at
    /// `off`, is `quote`, and where its header starts, for a TCP, UDP or SCTP
    /// packet whose quote holds the start of its transport header (not a
    /// later fragment); None otherwise.
    fn quoted_transport(ctx: &TcContext, quote: &Self::IpHead, off: usize) -> Option<(u8, usize)>;

    /// `head`'s source and destination.
    fn addrs(head: &Self::IpHead) -> (&Self::Addr, &Self::Addr);

    /// `head`'s header checksum: IPv4's; IPv6 has none.
    fn ip_csum(head: &Self::IpHead) -> u16;

    /// Brings the IP header at `ip_off`, whose addresses change by `addrs`,
    /// to a checksum that holds (IPv4's, from `ip_csum`; IPv6 has none).
    /// Returns the change to the sum of the header's bytes, which an ICMP
    /// checksum covering the header takes.
    fn readdress(ctx: &TcContext, ip_off: usize, ip_csum: u16, addrs: u64) -> Result<u64, i64>;

    /// Writes the source and destination of the IP header at `ip_off`.
    fn store_addrs(
        ctx: &TcContext,
        ip_off: usize,
        src_be: &Self::Addr,
        dst_be: &Self::Addr,
    ) -> Result<(), i64>;
}

/// Where an error's parts are: its ICMP header, its quote, and the end of
/// its datagram, which a quote reaches no further than.
struct Offsets {
    icmp: usize,
    quote: usize,
    end: usize,
}

/// Translates the ICMP message at `at` if it is an error about a translated
/// flow (see the module's comment); anything else passes as it is. An
/// error the node routes itself is handed to `send` in the pipeline's
/// terms, as the packet of the flow that travels its way (with ICMP's
/// protocol) and that packet's translation, once `route::lookup` found its
/// next hop: taken by reference rather than returned, which would hold
/// both on IPv6's nearly full stack.
#[inline(always)]
pub fn handle<F: ErrorFamily, R>(
    ctx: &TcContext,
    at: F::IcmpAt,
    send: impl FnOnce(&FlowOf<F::Addr>, &NatOf<F::Addr>) -> R,
) -> Verdict<R> {
    // Read into the locals that hold them to the end, where both families
    // read their addresses from: a copy would take room on IPv6's stack.
    let Ok(head) = ctx.load::<F::IpHead>(ETH_HLEN) else {
        return Verdict::Pass;
    };
    let Some((icmp_off, end)) = F::error_at(ctx, &head, at) else {
        return Verdict::Pass;
    };
    let quote_off = icmp_off + ICMP_HLEN;
    let Ok(quote) = ctx.load::<F::IpHead>(quote_off) else {
        return Verdict::Pass;
    };
    if !F::addrs(&head).1.same(F::addrs(&quote).0) {
        // Not addressed to the quoted packet's sender: not an error about
        // that packet this node could match.
        return Verdict::Pass;
    }
    let Some((proto, l4_off)) = F::quoted_transport(ctx, &quote, quote_off) else {
        return Verdict::Pass;
    };
    if l4_off + 4 > end {
        // The quote is cut before the ports.
        return Verdict::Pass;
    }
    let Ok(ports) = ctx.load::<[u16; 2]>(l4_off) else {
        return Verdict::Pass;
    };
    // The packet of the flow that travels the error's way: the quote
    // reversed.
    let (quoted_src_be, quoted_dst_be) = F::addrs(&quote);
    let flow = &FlowOf {
        l4_off,
        src_be: *quoted_dst_be,
        dst_be: *quoted_src_be,
        sport_be: ports[1],
        dport_be: ports[0],
        proto,
        tcp_flags: 0,
        tcp_seq_be: 0,
        tcp_ack_be: 0,
        l4_len: 0,
        frag: frag::NONE,
        frag_id_be: 0,
    };
    let key = conntrack::flow_key(flow);
    // No SYN: no closed flow is opened again.
    let mut reopened = 0;
    let Some(found) = conntrack::lookup::<F>(&key, flow, conntrack::now_ns(), &mut reopened) else {
        return Verdict::Pass;
    };
    // SAFETY: a valid map value pointer for the duration of this program.
    let nat = conntrack::translation(unsafe { &*found.ptr }, flow);
    let from_peer = F::addrs(&head).0.same(&flow.src_be);
    let at = Offsets {
        icmp: icmp_off,
        quote: quote_off,
        end,
    };
    if rewrite::<F>(ctx, &head, &quote, &at, flow, &nat, from_peer).is_err() {
        count(counter::DROP_REWRITE);
        return Verdict::Drop;
    }
    count(counter::ICMP_ERROR_TRANSLATED);
    if !(from_peer && nat.redirect) {
        return Verdict::Pass;
    }
    count(counter::REDIRECT);
    let len = (ctx.len() as usize).saturating_sub(ETH_HLEN) as u16;
    match route::lookup::<F, _>(ctx, F::ICMP, &nat.src_be, &nat.dst_be, len) {
        Hop::Via { .. } => {
            let error = FlowOf {
                proto: F::ICMP,
                ..*flow
            };
            Verdict::Sent(send(&error, &nat))
        }
        // An error is never longer than the minimum MTU (RFC 1812 4.3.2.3,
        // RFC 4443 2.4).
        Hop::TooBig(_) | Hop::Unroutable => {
            count(counter::DROP_NO_ROUTE);
            F::log_addrs(Event::NoRoute, F::ICMP, &nat.src_be, &nat.dst_be);
            Verdict::Drop
        }
    }
}

/// Writes the translation: the quote as the flow's packet going the quoted
/// way becomes (`nat` reversed; `flow` is the quote reversed), with the
/// quote's IP checksum and its transport checksum where the quote reaches
/// it; the error's own addresses, its source only where the peer sent it
/// (`from_peer`), with its IP checksum; and the ICMP checksum over all it
/// covers (ICMPv6's over the error's addresses too). Each header's checksum
/// balances its own change, so a `CHECKSUM_COMPLETE` sum still holds.
#[inline(always)]
fn rewrite<F: ErrorFamily>(
    ctx: &TcContext,
    head: &F::IpHead,
    quote: &F::IpHead,
    at: &Offsets,
    flow: &FlowOf<F::Addr>,
    nat: &NatOf<F::Addr>,
    from_peer: bool,
) -> Result<(), i64> {
    // The quote's source is where the flow's packets going the error's way
    // are sent, its destination where they come from; the error goes where
    // they go, and comes from where they come from when the peer sent it.
    let (old_src_be, old_dst_be) = F::addrs(head);
    let addrs = F::addr_delta(&flow.dst_be, &nat.dst_be) + F::addr_delta(&flow.src_be, &nat.src_be);
    let quoted =
        addrs + delta16(flow.dport_be, nat.dport_be) + delta16(flow.sport_be, nat.sport_be);
    let mut moved = F::addr_delta(old_dst_be, &nat.dst_be);
    if from_peer {
        moved += F::addr_delta(old_src_be, &nat.src_be);
    }
    let mut icmp = quoted;
    if F::PSEUDO_HEADER {
        icmp += moved;
    }
    // A router may quote only the 8 bytes RFC 792 asks for: a transport
    // checksum beyond them is left as it is, as netfilter leaves it. So is
    // a quoted SCTP packet's, which covers its whole packet, rarely all
    // quoted: its receiver matches the quote by addresses, ports and
    // verification tag (RFC 9260 10.1), never by its checksum.
    let csum_off = flow.l4_off
        + if flow.proto == PROTO_TCP {
            TCP_CSUM_OFF
        } else {
            UDP_CSUM_OFF
        };
    if flow.proto != PROTO_SCTP && csum_off + 2 <= at.end {
        let old: u16 = ctx.load(csum_off)?;
        let new = full_update(old, quoted, flow.proto == PROTO_UDP);
        ctx.store(csum_off, &new, 0)?;
        icmp += delta16(old, new);
    }
    icmp += F::readdress(ctx, at.quote, F::ip_csum(quote), addrs)?;
    F::store_addrs(ctx, at.quote, &nat.dst_be, &nat.src_be)?;
    ctx.store(flow.l4_off, &[nat.dport_be, nat.sport_be], 0)?;
    let icmp_csum: u16 = ctx.load(at.icmp + 2)?;
    ctx.store(at.icmp + 2, &apply(icmp_csum, icmp), 0)?;
    F::readdress(ctx, ETH_HLEN, F::ip_csum(head), moved)?;
    let src_be = if from_peer { &nat.src_be } else { old_src_be };
    F::store_addrs(ctx, ETH_HLEN, src_be, &nat.dst_be)
}

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;

impl ErrorFamily for V4 {
    const ICMP: u8 = IPPROTO_ICMP;
    type IcmpAt = ();
    type IpHead = Ipv4Head;
    /// RFC 792: ICMP's checksum covers the ICMP message alone.
    const PSEUDO_HEADER: bool = false;

    /// Destination unreachable, time exceeded and parameter problem (RFC
    /// 792), in a datagram long enough to quote an IP header.
    #[inline(always)]
    fn error_at(ctx: &TcContext, ip: &Ipv4Head, (): ()) -> Option<(usize, usize)> {
        let ihl = ((ip.ver_ihl & 0x0f) as usize) * 4;
        let tot_len = u16::from_be(ip.tot_len_be) as usize;
        let end = ETH_HLEN + tot_len;
        if ip.ver_ihl >> 4 != 4
            || ihl < IPV4_MIN_HLEN
            || tot_len < ihl + ICMP_HLEN + IPV4_MIN_HLEN
            || end > ctx.len() as usize
            || u16::from_be(ip.frag_be) & IP_MF_OFFSET_MASK != 0
        {
            return None;
        }
        let icmp_off = ETH_HLEN + ihl;
        let icmp_type: u8 = ctx.load(icmp_off).ok()?;
        if icmp_type != ICMP_DEST_UNREACH
            && icmp_type != ICMP_TIME_EXCEEDED
            && icmp_type != ICMP_PARAMETERPROB
        {
            return None;
        }
        Some((icmp_off, end))
    }

    /// Past the quote's options, of a datagram's first fragment or a whole
    /// one.
    #[inline(always)]
    fn quoted_transport(_ctx: &TcContext, quote: &Ipv4Head, off: usize) -> Option<(u8, usize)> {
        let ihl = ((quote.ver_ihl & 0x0f) as usize) * 4;
        if quote.ver_ihl >> 4 != 4
            || ihl < IPV4_MIN_HLEN
            || (quote.proto != PROTO_TCP && quote.proto != PROTO_UDP && quote.proto != PROTO_SCTP)
            || u16::from_be(quote.frag_be) & IP_OFFSET_MASK != 0
        {
            return None;
        }
        Some((quote.proto, off + ihl))
    }

    #[inline(always)]
    fn addrs(head: &Ipv4Head) -> (&u32, &u32) {
        (&head.src_be, &head.dst_be)
    }

    #[inline(always)]
    fn ip_csum(head: &Ipv4Head) -> u16 {
        head.csum
    }

    #[inline(always)]
    fn readdress(ctx: &TcContext, ip_off: usize, ip_csum: u16, addrs: u64) -> Result<u64, i64> {
        let new = apply(ip_csum, addrs);
        ctx.store(ip_off + IP_CSUM_OFF, &new, 0)?;
        Ok(delta16(ip_csum, new))
    }

    /// As one word pair: 8 bytes of stack, one helper call.
    #[inline(always)]
    fn store_addrs(ctx: &TcContext, ip_off: usize, src_be: &u32, dst_be: &u32) -> Result<(), i64> {
        ctx.store(ip_off + IP_SRC_OFF, &[*src_be, *dst_be], 0)
    }
}

/// Error message types (RFC 4443 2.1): 1 to 4; informational ones start
/// at 128, neighbour discovery among them.
const ICMPV6_ERROR_MAX: u8 = 4;
/// Extension headers walked in a quote: as many as tc walks in a packet
/// (`packet6`), so that every packet tc translates is matched when quoted.
const QUOTE_EXT_HEADERS: usize = 4;

impl ErrorFamily for V6 {
    const ICMP: u8 = NEXTHDR_ICMPV6;
    /// Past the error's extension headers, where `packet6` found it.
    type IcmpAt = usize;
    type IpHead = Ipv6Head;
    const PSEUDO_HEADER: bool = true;

    /// Destination unreachable, packet too big, time exceeded and parameter
    /// problem (RFC 4443); `packet6` hands on whole ICMPv6 messages only.
    #[inline(always)]
    fn error_at(ctx: &TcContext, ip: &Ipv6Head, icmp_off: usize) -> Option<(usize, usize)> {
        let icmp_type: u8 = ctx.load(icmp_off).ok()?;
        if icmp_type == 0 || icmp_type > ICMPV6_ERROR_MAX {
            return None;
        }
        Some((
            icmp_off,
            ETH_HLEN + IPV6_HLEN + u16::from_be(ip.payload_len_be) as usize,
        ))
    }

    /// Past the quote's extension headers, as far as tc walks a packet's
    /// own (a datagram a pod fragmented is quoted with its fragment header,
    /// and "packet too big" is what its sender needs to hear).
    #[inline(always)]
    fn quoted_transport(ctx: &TcContext, quote: &Ipv6Head, off: usize) -> Option<(u8, usize)> {
        if u16::from_be(quote.ver_tc_flow[0]) >> 12 != 6 {
            return None;
        }
        walk_quote(ctx, quote.next_hdr, off + IPV6_HLEN)
    }

    #[inline(always)]
    fn addrs(head: &Ipv6Head) -> (&[u32; 4], &[u32; 4]) {
        (&head.src_be, &head.dst_be)
    }

    #[inline(always)]
    fn ip_csum(_head: &Ipv6Head) -> u16 {
        0
    }

    /// Nothing to write: the addresses are summed by the transport and
    /// ICMPv6 checksums' pseudo-headers alone.
    #[inline(always)]
    fn readdress(_ctx: &TcContext, _ip_off: usize, _ip_csum: u16, _addrs: u64) -> Result<u64, i64> {
        Ok(0)
    }

    /// One at a time, from where they lie: a copy of both would take 32
    /// bytes of a stack that is nearly used up.
    #[inline(always)]
    fn store_addrs(
        ctx: &TcContext,
        ip_off: usize,
        src_be: &[u32; 4],
        dst_be: &[u32; 4],
    ) -> Result<(), i64> {
        ctx.store(ip_off + IP6_SRC_OFF, src_be, 0)?;
        ctx.store(ip_off + IP6_DST_OFF, dst_be, 0)
    }
}

/// The quoted packet's transport protocol, TCP, UDP or SCTP, and where its
/// header starts, past the extension headers from `off` on (`next` the
/// first one's type); `None` for a quote of a later fragment, of another
/// protocol, or whose chain goes on past `QUOTE_EXT_HEADERS`.
#[inline(always)]
fn walk_quote(ctx: &TcContext, mut next: u8, mut off: usize) -> Option<(u8, usize)> {
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
    (next == PROTO_TCP || next == PROTO_UDP || next == PROTO_SCTP).then_some((next, off))
}
