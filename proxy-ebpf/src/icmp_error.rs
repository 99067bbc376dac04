//! ICMP errors about translated flows: destination unreachable (port
//! unreachable, fragmentation needed), time exceeded and parameter problem.
//! An error quotes the header of the packet that caused it as that packet
//! was on the wire where it failed, translated: a pod's socket connected to
//! a ClusterIP does not recognise an error quoting the backend, nor an
//! outside client one quoting this node's SNAT port, so without this a
//! closed port would only time out and path MTU discovery would black-hole.
//! The quote is translated back as the flow's packets are, and the error's
//! own addresses with it, as netfilter translates its "related" packets.
//!
//! An error is matched to its flow by its quote reversed: the error travels
//! the way a packet of the flow going the other way would, and is rewritten
//! as that packet would be. Its conntrack entries are only read: an error
//! neither creates, refreshes nor assures a flow. The error's source is
//! rewritten only where it is the quoted destination (the peer itself
//! answered); a router's address on the way stays.
//!
//! A quote of a first fragment has its ports and is translated like any
//! other; one of a later fragment has none to find its flow by and passes
//! untouched, as netfilter leaves it.
//!
//! At XDP errors are left to tc, which runs on the same interface: they are
//! rare, and tc can route what it rewrites.

use aya_ebpf::programs::TcContext;
use proxy_common::{
    PROTO_TCP, PROTO_UDP, counter,
    csum::{apply, delta16, delta32, full_update},
    ct_flags,
};

use crate::{
    conntrack,
    event_log::{self, Event},
    family::V4,
    maps::count,
    nat::Nat,
    packet::{ETH_HLEN, Flow, IPPROTO_ICMP, Ipv4Head, frag},
    route::{self, Hop},
    verdict::Action,
};

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;
const ICMP_HLEN: usize = 8;
const IPV4_MIN_HLEN: usize = 20;
/// More-fragments flag and fragment offset, in host order after `from_be`.
const IP_MF_OFFSET_MASK: u16 = 0x3fff;
const IP_OFFSET_MASK: u16 = 0x1fff;
/// Offsets within an IPv4 header.
const IP_CSUM_OFF: usize = 10;
const IP_SRC_OFF: usize = 12;
/// Offsets within the quoted L4 header.
const UDP_CSUM_OFF: usize = 6;
const TCP_CSUM_OFF: usize = 16;

/// An ICMP error quoting a TCP or UDP header: where its parts sit, and what
/// was read from them.
struct Quoted {
    icmp_off: usize,
    quote_ip_off: usize,
    quote_l4_off: usize,
    /// Where the error's IP datagram ends: a quote reaches no further.
    end: usize,
    /// The error's own addresses and IP checksum.
    src_be: u32,
    dst_be: u32,
    ip_csum: u16,
    /// The quoted packet's.
    proto: u8,
    q_src_be: u32,
    q_dst_be: u32,
    q_sport_be: u16,
    q_dport_be: u16,
    q_ip_csum: u16,
}

impl Quoted {
    /// The packet of the flow that travels the error's way: the quote
    /// reversed.
    #[inline(always)]
    fn as_flow(&self) -> Flow {
        Flow {
            l4_off: self.quote_l4_off,
            src_be: self.q_dst_be,
            dst_be: self.q_src_be,
            sport_be: self.q_dport_be,
            dport_be: self.q_sport_be,
            proto: self.proto,
            tcp_flags: 0,
            tcp_seq_be: 0,
            tcp_ack_be: 0,
            frag: frag::NONE,
            frag_id_be: 0,
        }
    }
}

/// Translates an ICMP error about a translated flow (see the module's
/// comment); anything else passes as it is. Bytes are read and written
/// through helpers: the headers sit at offsets that depend on two IP
/// header lengths, which the verifier would otherwise have to follow
/// through every path, for packets that are rare.
#[inline(always)]
pub fn handle(ctx: &TcContext) -> Action {
    let Some(quoted) = parse(ctx) else {
        return Action::Pass;
    };
    if quoted.dst_be != quoted.q_src_be {
        // Not addressed to the quoted packet's sender: not an error about
        // that packet this node could match.
        return Action::Pass;
    }
    let flow = quoted.as_flow();
    let key = conntrack::flow_key(&flow);
    let Some(found) = conntrack::lookup::<V4>(&key, &flow, conntrack::now_ns()) else {
        return Action::Pass;
    };
    // SAFETY: a valid map value pointer for the duration of this program.
    let entry = unsafe { &*found.ptr };
    let nat = conntrack::translation(entry, &flow);
    let from_peer = quoted.src_be == quoted.q_dst_be;
    let outer = Nat {
        src_be: if from_peer { nat.src_be } else { quoted.src_be },
        sport_be: 0,
        dst_be: nat.dst_be,
        dport_be: 0,
        redirect: from_peer && entry.flags & ct_flags::REDIRECT != 0,
    };
    if rewrite(ctx, &quoted, &nat, &outer).is_err() {
        count(counter::DROP_REWRITE);
        return Action::Drop;
    }
    count(counter::ICMP_ERROR_TRANSLATED);
    if !outer.redirect {
        return Action::Pass;
    }
    // Its new source is an address of this node: routed here, as the
    // flow's own packets are.
    count(counter::REDIRECT);
    let len = (ctx.len() as usize).saturating_sub(ETH_HLEN) as u16;
    match route::lookup::<V4, _>(ctx, IPPROTO_ICMP, &outer.src_be, &outer.dst_be, len) {
        Hop::Via { .. } => Action::Redirect(
            Flow {
                proto: IPPROTO_ICMP,
                ..flow
            },
            outer,
        ),
        // An error is never longer than the minimum MTU (RFC 1812 4.3.2.3).
        Hop::TooBig(_) | Hop::Unroutable => {
            count(counter::DROP_NO_ROUTE);
            event_log::log_addrs(Event::NoRoute, IPPROTO_ICMP, outer.src_be, outer.dst_be);
            Action::Drop
        }
    }
}

/// Reads an ICMP error quoting a TCP or UDP header whose ports are there.
#[inline(always)]
fn parse(ctx: &TcContext) -> Option<Quoted> {
    let ip: Ipv4Head = ctx.load(ETH_HLEN).ok()?;
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
    let quote_ip_off = icmp_off + ICMP_HLEN;
    let quote: Ipv4Head = ctx.load(quote_ip_off).ok()?;
    let quote_ihl = ((quote.ver_ihl & 0x0f) as usize) * 4;
    let quote_l4_off = quote_ip_off + quote_ihl;
    if quote.ver_ihl >> 4 != 4
        || quote_ihl < IPV4_MIN_HLEN
        || (quote.proto != PROTO_TCP && quote.proto != PROTO_UDP)
        || u16::from_be(quote.frag_be) & IP_OFFSET_MASK != 0
        || quote_l4_off + 4 > end
    {
        return None;
    }
    let ports: [u16; 2] = ctx.load(quote_l4_off).ok()?;
    Some(Quoted {
        icmp_off,
        quote_ip_off,
        quote_l4_off,
        end,
        src_be: ip.src_be,
        dst_be: ip.dst_be,
        ip_csum: ip.csum,
        proto: quote.proto,
        q_src_be: quote.src_be,
        q_dst_be: quote.dst_be,
        q_sport_be: ports[0],
        q_dport_be: ports[1],
        q_ip_csum: quote.csum,
    })
}

/// Writes the translation: the quote as the flow's packet going the quoted
/// way becomes (`nat` reversed), its IP checksum, its L4 checksum where the
/// quote reaches it, the ICMP checksum over all of that, and the error's
/// own addresses (`outer`) with its IP checksum. Each header's checksum
/// balances its own change, so a `CHECKSUM_COMPLETE` sum still holds.
#[inline(always)]
fn rewrite(ctx: &TcContext, q: &Quoted, nat: &Nat, outer: &Nat) -> Result<(), i64> {
    // The quote's source is where the flow's packets going the error's way
    // are sent, its destination where they come from.
    let (src_be, sport_be, dst_be, dport_be) = (nat.dst_be, nat.dport_be, nat.src_be, nat.sport_be);
    let addrs = delta32(q.q_src_be, src_be) + delta32(q.q_dst_be, dst_be);
    let ports = delta16(q.q_sport_be, sport_be) + delta16(q.q_dport_be, dport_be);
    let q_ip_csum = apply(q.q_ip_csum, addrs);
    let mut icmp = addrs + ports + delta16(q.q_ip_csum, q_ip_csum);
    ctx.store(q.quote_ip_off + IP_CSUM_OFF, &q_ip_csum, 0)?;
    ctx.store(q.quote_ip_off + IP_SRC_OFF, &[src_be, dst_be], 0)?;
    ctx.store(q.quote_l4_off, &[sport_be, dport_be], 0)?;
    // A router may quote only the 8 bytes RFC 792 asks for: a TCP checksum
    // beyond them is left as it is, as netfilter leaves it.
    let csum_off = q.quote_l4_off
        + if q.proto == PROTO_TCP {
            TCP_CSUM_OFF
        } else {
            UDP_CSUM_OFF
        };
    if csum_off + 2 <= q.end {
        let old: u16 = ctx.load(csum_off)?;
        let new = full_update(old, addrs + ports, q.proto == PROTO_UDP);
        ctx.store(csum_off, &new, 0)?;
        icmp += delta16(old, new);
    }
    let icmp_csum: u16 = ctx.load(q.icmp_off + 2)?;
    ctx.store(q.icmp_off + 2, &apply(icmp_csum, icmp), 0)?;
    // No pseudo-header in the ICMP checksum: the error's addresses change
    // its IP checksum only.
    let ip_csum = apply(
        q.ip_csum,
        delta32(q.src_be, outer.src_be) + delta32(q.dst_be, outer.dst_be),
    );
    ctx.store(ETH_HLEN + IP_CSUM_OFF, &ip_csum, 0)?;
    ctx.store(ETH_HLEN + IP_SRC_OFF, &[outer.src_be, outer.dst_be], 0)
}
