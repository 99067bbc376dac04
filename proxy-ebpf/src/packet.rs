//! Parsing of the headers the datapath acts on, read in place (direct
//! packet access: no helper call per field). The result holds offsets, not
//! pointers, so it stays valid after helpers that move packet data.

use proxy_common::{PROTO_SCTP, PROTO_TCP, PROTO_UDP, sctp};

use crate::hook::Hook;

pub const ETH_HLEN: usize = 14;
pub const IPPROTO_ICMP: u8 = 1;
const ETH_P_IP_BE: u16 = 0x0800u16.to_be();
pub const IPV4_MIN_HLEN: usize = 20;
/// Offsets within the IPv4 header.
pub const IP_CSUM_OFF: usize = 10;
pub const IP_SRC_OFF: usize = 12;
pub const IP_DST_OFF: usize = 16;
const TCP_MIN_HLEN: usize = 20;
const UDP_HLEN: usize = 8;
/// More-fragments flag and fragment offset, in host order after `from_be`.
pub const IP_MF_OFFSET_MASK: u16 = 0x3fff;
/// The fragment offset alone.
pub const IP_OFFSET_MASK: u16 = 0x1fff;

/// `Flow::frag`: where the packet sits in its datagram.
pub mod frag {
    /// A whole datagram.
    pub const NONE: u8 = 0;
    /// The first fragment: it carries the L4 header, ports included.
    pub const FIRST: u8 = 1;
    /// A later fragment: no L4 header; its ports are the first fragment's
    /// (`crate::frag`).
    pub const LATER: u8 = 2;
}

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// The fields of a TCP, UDP or SCTP packet the datapath needs, of either
/// family (`Flow`, `crate::packet6::Flow6`): what conntrack, NAT and the
/// pipelines are written once over.
#[derive(Clone, Copy)]
pub struct FlowOf<A> {
    /// Where the transport header starts: past IPv4's options, or IPv6's
    /// extension headers.
    pub l4_off: usize,
    pub src_be: A,
    pub dst_be: A,
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
    /// TCP's flags; SCTP's first chunk as the TCP flags of the same meaning
    /// (`proxy_common::sctp::control`).
    pub tcp_flags: u8,
    /// TCP's sequence and acknowledgment numbers: what tells a FIN or RST
    /// inside the window from one outside it. SCTP's verification tag and,
    /// of an INIT or INIT ACK, its Initiate Tag (`sctp_vtag_be`,
    /// `sctp_initiate_tag_be`). 0 for UDP.
    pub tcp_seq_be: u32,
    pub tcp_ack_be: u32,
    /// The bytes the IP header gives the transport header and its payload
    /// (of a first fragment, its own part): the length SCTP's checksum
    /// covers.
    pub l4_len: u16,
    /// `frag::NONE`, `FIRST` or `LATER`.
    pub frag: u8,
    /// What ties the fragments of a datagram together, as on the wire:
    /// IPv4's 16-bit identification (in the low-address half) or IPv6's
    /// fragment header's; 0 for a whole datagram.
    pub frag_id_be: u32,
}

/// An IPv4 packet's fields.
pub type Flow = FlowOf<u32>;

impl<A> FlowOf<A> {
    /// A packet of `proto` whose transport header, at `l4_off`, reads `l4`.
    #[inline(always)]
    pub fn new(
        l4_off: usize,
        src_be: A,
        dst_be: A,
        proto: u8,
        l4: &L4,
        frag: u8,
        frag_id_be: u32,
    ) -> Self {
        FlowOf {
            l4_off,
            src_be,
            dst_be,
            sport_be: l4.ports[0],
            dport_be: l4.ports[1],
            proto,
            tcp_flags: l4.tcp_flags,
            tcp_seq_be: l4.seq_ack_be[0],
            tcp_ack_be: l4.seq_ack_be[1],
            l4_len: l4.len,
            frag,
            frag_id_be,
        }
    }

    /// An SCTP packet's verification tag, as on the wire.
    #[inline(always)]
    pub fn sctp_vtag_be(&self) -> u32 {
        self.tcp_seq_be
    }

    /// The Initiate Tag of an SCTP INIT or INIT ACK, as on the wire.
    #[inline(always)]
    pub fn sctp_initiate_tag_be(&self) -> u32 {
        self.tcp_ack_be
    }

    /// Offset of the L4 checksum field.
    #[inline(always)]
    pub fn l4_csum_off(&self) -> usize {
        if self.proto == PROTO_TCP {
            self.l4_off + 16
        } else {
            self.l4_off + 6
        }
    }

    /// The IP header's length, options or extension headers included.
    #[inline(always)]
    pub fn ip_len(&self) -> usize {
        self.l4_off - ETH_HLEN
    }
}

/// Why a packet was not parsed into a [`Flow`].
#[derive(Clone, Copy)]
pub enum Skip {
    /// Not IPv4: handed on to the next tc program (`tc_ingress6` for
    /// IPv6), passed at XDP.
    NotIpv4,
    /// Not something the datapath translates (not TCP/UDP/SCTP): passed
    /// silently.
    NotOurs,
    /// Headers shorter or inconsistent with what they claim: passed, and
    /// counted.
    Malformed,
    /// The headers are not (all) in the linear area; pulling this many
    /// bytes may bring them in.
    Truncated(u32),
    /// ICMP: an error among them may be about a translated flow
    /// (`crate::icmp_error`).
    Icmp,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Ipv4Head {
    pub ver_ihl: u8,
    pub tos: u8,
    pub tot_len_be: u16,
    pub id_be: u16,
    pub frag_be: u16,
    pub ttl: u8,
    pub proto: u8,
    pub csum: u16,
    pub src_be: u32,
    pub dst_be: u32,
}

/// Bytes the parser needs in the linear area: Ethernet, the longest IPv4
/// header, and a TCP header without options.
const PARSE_LEN: u32 = (ETH_HLEN + 60 + TCP_MIN_HLEN) as u32;

/// Reads a `T` at `off` when the packet has it in its linear area.
///
/// A plain load of the type's width, not `read_unaligned`, which the BPF
/// target splits into single bytes: packet memory may be misaligned for
/// `T`, which BPF allows on the architectures whose JIT this targets (the
/// verifier refuses it elsewhere, at load time).
#[inline(always)]
pub fn read<T: Copy>(data: usize, data_end: usize, off: usize) -> Option<T> {
    let at = data + off;
    if at + size_of::<T>() > data_end {
        return None;
    }
    // SAFETY: inside the packet, as just checked; see above on alignment.
    Some(unsafe { (at as *const T).read() })
}

/// Parses the packet's headers, reading them in place. A tc packet whose
/// headers are not all in the linear area is pulled once and read again.
#[inline(always)]
pub fn parse<H: Hook>(ctx: &H) -> Result<Flow, Skip> {
    match parse_linear(ctx) {
        Err(Skip::Truncated(need)) if !H::XDP && ctx.pull(need) => match parse_linear(ctx) {
            Err(Skip::Truncated(_)) => Err(Skip::Malformed),
            other => other,
        },
        Err(Skip::Truncated(_)) => Err(Skip::Malformed),
        other => other,
    }
}

#[inline(always)]
fn parse_linear<H: Hook>(ctx: &H) -> Result<Flow, Skip> {
    let (data, data_end) = ctx.bounds();
    let short = Skip::Truncated(PARSE_LEN);
    let eth_type: u16 = read(data, data_end, 12).ok_or(Skip::NotOurs)?;
    if eth_type != ETH_P_IP_BE {
        return Err(Skip::NotIpv4);
    }
    let ip: Ipv4Head = read(data, data_end, ETH_HLEN).ok_or(short)?;
    if ip.ver_ihl >> 4 != 4 {
        return Err(Skip::Malformed);
    }
    let ihl_bytes = ((ip.ver_ihl & 0x0f) as usize) * 4;
    let tot_len = u16::from_be(ip.tot_len_be) as usize;
    if ihl_bytes < IPV4_MIN_HLEN || tot_len < ihl_bytes || ETH_HLEN + tot_len > ctx.wire_len() {
        return Err(Skip::Malformed);
    }
    if ip.proto == IPPROTO_ICMP {
        return Err(Skip::Icmp);
    }
    if ip.proto != PROTO_TCP && ip.proto != PROTO_UDP && ip.proto != PROTO_SCTP {
        return Err(Skip::NotOurs);
    }
    let frag_field = u16::from_be(ip.frag_be);
    let frag = if frag_field & IP_MF_OFFSET_MASK == 0 {
        frag::NONE
    } else if frag_field & IP_OFFSET_MASK == 0 {
        frag::FIRST
    } else {
        frag::LATER
    };
    let l4_off = ETH_HLEN + ihl_bytes;
    let l4_len = tot_len - ihl_bytes;
    // A later fragment has no L4 header: its ports are filled in from the
    // datagram's first fragment, if that was translated (`crate::frag`).
    let l4 = if frag == frag::LATER {
        L4::default()
    } else {
        l4_header(data, data_end, ip.proto, l4_off, l4_len, frag == frag::NONE).map_err(|skip| {
            match skip {
                L4Skip::Malformed => Skip::Malformed,
                L4Skip::Short => Skip::Truncated(PARSE_LEN),
            }
        })?
    };
    Ok(Flow::new(
        l4_off,
        ip.src_be,
        ip.dst_be,
        ip.proto,
        &l4,
        frag,
        u32::from(ip.id_be),
    ))
}

/// Why a transport header was not read (`l4_header`).
pub enum L4Skip {
    /// Shorter than it must be, or than the IP header leaves it.
    Malformed,
    /// Not all in the linear area.
    Short,
}

/// TCP's fixed header (RFC 9293 3.1).
#[repr(C)]
#[derive(Clone, Copy)]
struct TcpHead {
    ports_be: [u16; 2],
    seq_ack_be: [u32; 2],
    doff_flags: [u8; 2],
    window_be: u16,
    csum: u16,
    urgent_be: u16,
}

/// SCTP's common header and its first chunk's header (RFC 9260 3.1, 3.2).
#[repr(C)]
#[derive(Clone, Copy)]
struct SctpHead {
    ports_be: [u16; 2],
    vtag_be: u32,
    csum: u32,
    chunk_type: u8,
    chunk_flags: u8,
    chunk_len_be: u16,
}

/// An INIT or INIT ACK's `SctpHead` and its Initiate Tag.
#[repr(C)]
#[derive(Clone, Copy)]
struct SctpInitHead {
    head: SctpHead,
    initiate_tag_be: u32,
}

/// What the datapath reads of a transport header.
#[derive(Clone, Copy, Default)]
pub struct L4 {
    pub ports: [u16; 2],
    pub tcp_flags: u8,
    /// TCP's sequence and acknowledgment numbers, as on the wire; SCTP's
    /// verification tag and Initiate Tag.
    pub seq_ack_be: [u32; 2],
    /// The `l4_len` it was read with.
    pub len: u16,
}

/// The ports and TCP flags of the transport header at `l4_off`, both
/// families: checked against the `l4_len` bytes the IP header leaves it
/// (all of the datagram's when `whole`, else a first fragment's part of
/// it). Of SCTP, the common header (RFC 9260 3.1) and the first chunk's
/// header: an SCTP packet holds at least one chunk, and INIT and INIT ACK,
/// whose Initiate Tag is read too, are never bundled (RFC 9260 6.10).
#[inline(always)]
pub fn l4_header(
    data: usize,
    data_end: usize,
    proto: u8,
    l4_off: usize,
    l4_len: usize,
    whole: bool,
) -> Result<L4, L4Skip> {
    let ports: [u16; 2] = read(data, data_end, l4_off).ok_or(L4Skip::Short)?;
    let mut tcp_flags = 0;
    let mut seq_ack_be = [0u32; 2];
    if proto == PROTO_SCTP {
        if l4_len < sctp::HEADER_LEN + sctp::CHUNK_HEADER_LEN {
            return Err(L4Skip::Malformed);
        }
        let head: SctpHead = read(data, data_end, l4_off).ok_or(L4Skip::Short)?;
        tcp_flags = sctp::control_of(head.chunk_type, head.chunk_flags);
        seq_ack_be[0] = head.vtag_be;
        if head.chunk_type == sctp::chunk::INIT || head.chunk_type == sctp::chunk::INIT_ACK {
            if l4_len < sctp::INITIATE_TAG_OFF + 4 {
                return Err(L4Skip::Malformed);
            }
            // From the start again, in one read with the header: a second
            // read past the first's end lost its bound to the verifier.
            let init: SctpInitHead = read(data, data_end, l4_off).ok_or(L4Skip::Short)?;
            seq_ack_be[1] = init.initiate_tag_be;
        }
    } else if proto == PROTO_TCP {
        // The whole fixed header at once, one bound check: with the fields
        // read here, the checksum a rewrite updates, which must be in the
        // linear area too (a tc packet is pulled for it).
        let head: TcpHead = read(data, data_end, l4_off).ok_or(L4Skip::Short)?;
        let doff_bytes = ((head.doff_flags[0] >> 4) as usize) * 4;
        if doff_bytes < TCP_MIN_HLEN || l4_len < doff_bytes {
            return Err(L4Skip::Malformed);
        }
        tcp_flags = head.doff_flags[1];
        seq_ack_be = head.seq_ack_be;
    } else {
        let udp_len: u16 = read(data, data_end, l4_off + 4).ok_or(L4Skip::Short)?;
        let udp_len = u16::from_be(udp_len) as usize;
        // A first fragment holds part of the datagram its UDP length counts.
        if l4_len < UDP_HLEN || udp_len < UDP_HLEN || (whole && udp_len > l4_len) {
            return Err(L4Skip::Malformed);
        }
    }
    Ok(L4 {
        ports,
        tcp_flags,
        seq_ack_be,
        len: l4_len as u16,
    })
}
