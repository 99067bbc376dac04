//! Parsing of IPv6 packets, as `packet` parses IPv4 ones: read in place,
//! offsets kept rather than pointers. The transport header may sit behind
//! extension headers; a bounded number of them is walked, and a packet whose
//! chain goes on longer, or holds one the datapath does not know, is left
//! untouched (and counted by the caller). A later fragment has no transport
//! header: it is parsed up to its fragment header, its protocol and ports
//! left for the caller to fill in from its datagram's first fragment
//! (`crate::frag`), whose chain may go on past the fragment header.

use proxy_common::{PROTO_SCTP, PROTO_TCP, PROTO_UDP};

use crate::{
    hook::Hook,
    packet::{ETH_HLEN, FlowOf, L4, L4Skip, frag, l4_header, read},
};

const ETH_P_IPV6_BE: u16 = 0x86ddu16.to_be();
pub const IPV6_HLEN: usize = 40;
const TCP_MIN_HLEN: usize = 20;
/// Offsets within the IPv6 header.
pub const IP6_SRC_OFF: usize = 8;
pub const IP6_DST_OFF: usize = 24;

/// Next-header values (RFC 8200, 4302).
pub const NEXTHDR_HOP: u8 = 0;
pub const NEXTHDR_ROUTING: u8 = 43;
pub const NEXTHDR_FRAGMENT: u8 = 44;
pub const NEXTHDR_AUTH: u8 = 51;
pub const NEXTHDR_DEST: u8 = 60;
pub const NEXTHDR_ICMPV6: u8 = 58;
/// Extension headers walked before the transport header: hop-by-hop,
/// destination options, routing and a fragment header make four, more than
/// any packet between pods carries.
const MAX_EXT_HEADERS: usize = 4;
/// Deepest transport header start accepted: bounds the offsets the verifier
/// sees, and what a tc packet is pulled to.
pub const MAX_L4_OFF: usize = ETH_HLEN + IPV6_HLEN + 128;
/// Bytes the parser may need in the linear area.
const PARSE_LEN: u32 = (MAX_L4_OFF + TCP_MIN_HLEN) as u32;
/// Fragment offset (in 8-byte units, shifted left by 3) and the
/// more-fragments flag, in host order after `from_be`.
pub const FRAG_OFFSET_MASK: u16 = 0xfff8;
const FRAG_MORE: u16 = 1;

/// An IPv6 packet's fields (`packet::FlowOf`): `frag_id_be` is its
/// fragment header's identification.
pub type Flow6 = FlowOf<[u32; 4]>;

/// Why a packet was not parsed into a [`Flow6`].
#[derive(Clone, Copy)]
pub enum Skip6 {
    /// Not IPv6 TCP, UDP or SCTP, nor a whole ICMPv6 message: passed
    /// silently.
    NotOurs,
    /// Headers shorter or inconsistent with what they claim: passed, and
    /// counted.
    Malformed,
    /// Not all in the linear area; pulling may bring them in.
    Truncated,
    /// An extension header chain not walked to its end: passed, and counted.
    ExtHeaders,
    /// A whole ICMPv6 message, at this offset: an error among them may
    /// quote a translated flow's packet (`crate::icmp6_error`).
    Icmp6(usize),
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Ipv6Head {
    pub ver_tc_flow: [u16; 2],
    pub payload_len_be: u16,
    pub next_hdr: u8,
    pub hop_limit: u8,
    pub src_be: [u32; 4],
    pub dst_be: [u32; 4],
}

/// The length of an extension header of type `kind` (hop-by-hop,
/// routing, destination options or AH) whose length field is `len_field`.
#[inline(always)]
pub fn ext_header_len(kind: u8, len_field: u8) -> usize {
    if kind == NEXTHDR_AUTH {
        // RFC 4302: AH counts 4-byte words, less 2.
        (len_field as usize + 2) * 4
    } else {
        // RFC 8200: 8-byte units, not counting the first.
        (len_field as usize + 1) * 8
    }
}

/// Parses the packet's headers; a packet whose headers are not all in the
/// linear area is pulled once (at tc) and read again.
#[inline(always)]
pub fn parse<H: Hook>(ctx: &H) -> Result<Flow6, Skip6> {
    match parse_linear(ctx) {
        Err(Skip6::Truncated) if !H::XDP && ctx.pull(PARSE_LEN) => match parse_linear(ctx) {
            Err(Skip6::Truncated) => Err(Skip6::Malformed),
            other => other,
        },
        Err(Skip6::Truncated) => Err(Skip6::Malformed),
        other => other,
    }
}

#[inline(always)]
fn parse_linear<H: Hook>(ctx: &H) -> Result<Flow6, Skip6> {
    let (data, data_end) = ctx.bounds();
    let eth_type: u16 = read(data, data_end, 12).ok_or(Skip6::NotOurs)?;
    if eth_type != ETH_P_IPV6_BE {
        return Err(Skip6::NotOurs);
    }
    let ip: Ipv6Head = read(data, data_end, ETH_HLEN).ok_or(Skip6::Truncated)?;
    if (u16::from_be(ip.ver_tc_flow[0]) >> 12) != 6 {
        return Err(Skip6::Malformed);
    }
    let payload_len = u16::from_be(ip.payload_len_be) as usize;
    // A jumbogram (payload length 0, RFC 2675) is malformed here too: no
    // link between pods carries one.
    if ETH_HLEN + IPV6_HLEN + payload_len > ctx.wire_len() {
        return Err(Skip6::Malformed);
    }
    let mut next = ip.next_hdr;
    let mut off = ETH_HLEN + IPV6_HLEN;
    let mut frag = frag::NONE;
    let mut frag_id_be = 0;
    // XDP walks a fragment header alone, right after the IPv6 header (what
    // a fragmented datagram from outside carries), and leaves longer
    // chains to tc: every header walked multiplies the paths the verifier
    // follows through the direct writes that XDP's rewrite makes at the
    // offset found.
    let walked = if H::XDP { 1 } else { MAX_EXT_HEADERS };
    for _ in 0..walked {
        let len = match next {
            NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_DEST | NEXTHDR_AUTH if !H::XDP => {
                let head: [u8; 2] = read(data, data_end, off).ok_or(Skip6::Truncated)?;
                let len = ext_header_len(next, head[1]);
                next = head[0];
                len
            }
            NEXTHDR_FRAGMENT => {
                let head: [u32; 2] = read(data, data_end, off).ok_or(Skip6::Truncated)?;
                let [next_hdr, _, field_hi, field_lo] = head[0].to_ne_bytes();
                let field = u16::from_be_bytes([field_hi, field_lo]);
                next = next_hdr;
                frag_id_be = head[1];
                if field & FRAG_OFFSET_MASK != 0 {
                    // What follows is the middle of the datagram: no header
                    // of any kind to walk.
                    frag = frag::LATER;
                    off += 8;
                    break;
                }
                if field & FRAG_MORE != 0 {
                    frag = frag::FIRST;
                }
                8
            }
            _ => break,
        };
        off += len;
        if off > MAX_L4_OFF {
            return Err(Skip6::ExtHeaders);
        }
    }
    if frag == frag::LATER {
        // The header after a later fragment's fragment header begins the
        // datagram's fragmentable part: TCP, UDP, SCTP, or an extension header
        // (destination options) that only the first fragment carries. Its
        // transport protocol, like its ports, is the first fragment's
        // (`crate::frag::ports6`).
        return match next {
            PROTO_TCP | PROTO_UDP | PROTO_SCTP | NEXTHDR_DEST | NEXTHDR_AUTH => Ok(Flow6::new(
                off,
                ip.src_be,
                ip.dst_be,
                0,
                &L4::default(),
                frag,
                frag_id_be,
            )),
            _ => Err(Skip6::NotOurs),
        };
    }
    if next != PROTO_TCP && next != PROTO_UDP && next != PROTO_SCTP {
        return match next {
            NEXTHDR_HOP | NEXTHDR_ROUTING | NEXTHDR_FRAGMENT | NEXTHDR_AUTH | NEXTHDR_DEST => {
                Err(Skip6::ExtHeaders)
            }
            NEXTHDR_ICMPV6 if frag == frag::NONE => Err(Skip6::Icmp6(off)),
            _ => Err(Skip6::NotOurs),
        };
    }
    // Bytes the transport header and its payload have, by the IPv6 header.
    let Some(l4_len) = (ETH_HLEN + IPV6_HLEN + payload_len).checked_sub(off) else {
        return Err(Skip6::Malformed);
    };
    if off > MAX_L4_OFF {
        return Err(Skip6::ExtHeaders);
    }
    let l4 =
        l4_header(data, data_end, next, off, l4_len, frag == frag::NONE).map_err(
            |skip| match skip {
                L4Skip::Malformed => Skip6::Malformed,
                L4Skip::Short => Skip6::Truncated,
            },
        )?;
    Ok(Flow6::new(
        off, ip.src_be, ip.dst_be, next, &l4, frag, frag_id_be,
    ))
}
