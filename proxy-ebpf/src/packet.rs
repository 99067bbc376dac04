//! Parsing of the headers the datapath acts on, through bounds-checked
//! `bpf_skb_load_bytes` loads (no packet pointers to re-validate after the
//! checksum helpers move the data).

use aya_ebpf::programs::TcContext;
use proxy_common::{PROTO_SCTP, PROTO_TCP, PROTO_UDP};

pub const ETH_HLEN: usize = 14;
const ETH_P_IP_BE: u16 = 0x0800u16.to_be();
const IPV4_MIN_HLEN: usize = 20;
const TCP_MIN_HLEN: usize = 20;
const UDP_HLEN: usize = 8;
/// More-fragments flag and fragment offset, in host order after `from_be`.
const IP_MF_OFFSET_MASK: u16 = 0x3fff;

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// The fields of an IPv4 TCP/UDP packet the datapath needs.
#[derive(Clone, Copy)]
pub struct Flow {
    pub l4_off: usize,
    pub proto: u8,
    pub ihl_bytes: usize,
    pub src_be: u32,
    pub dst_be: u32,
    pub sport_be: u16,
    pub dport_be: u16,
    pub tcp_flags: u8,
}

impl Flow {
    /// Offset of the L4 checksum field.
    #[inline(always)]
    pub fn l4_csum_off(&self) -> usize {
        if self.proto == PROTO_TCP {
            self.l4_off + 16
        } else {
            self.l4_off + 6
        }
    }
}

/// Why a packet was not parsed into a [`Flow`].
pub enum Skip {
    /// Not something the datapath translates (not IPv4, not TCP/UDP, a
    /// fragment): passed silently.
    NotOurs,
    /// Headers shorter or inconsistent with what they claim: passed, and
    /// counted.
    Malformed,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Ipv4Head {
    ver_ihl: u8,
    tos: u8,
    tot_len_be: u16,
    id_be: u16,
    frag_be: u16,
    ttl: u8,
    proto: u8,
    csum: u16,
    src_be: u32,
    dst_be: u32,
}

#[inline(always)]
pub fn parse(ctx: &TcContext) -> Result<Flow, Skip> {
    let eth_type: u16 = ctx.load(12).map_err(|_| Skip::NotOurs)?;
    if eth_type != ETH_P_IP_BE {
        return Err(Skip::NotOurs);
    }
    let ip: Ipv4Head = ctx.load(ETH_HLEN).map_err(|_| Skip::Malformed)?;
    if ip.ver_ihl >> 4 != 4 {
        return Err(Skip::Malformed);
    }
    let ihl_bytes = ((ip.ver_ihl & 0x0f) as usize) * 4;
    let tot_len = u16::from_be(ip.tot_len_be) as usize;
    if ihl_bytes < IPV4_MIN_HLEN || tot_len < ihl_bytes || ETH_HLEN + tot_len > ctx.len() as usize {
        return Err(Skip::Malformed);
    }
    if ip.proto != PROTO_TCP && ip.proto != PROTO_UDP && ip.proto != PROTO_SCTP {
        return Err(Skip::NotOurs);
    }
    // Fragments carry no (or only some) L4 header; the datapath leaves them
    // to the stack rather than translating half a datagram.
    if u16::from_be(ip.frag_be) & IP_MF_OFFSET_MASK != 0 {
        return Err(Skip::NotOurs);
    }
    let l4_off = ETH_HLEN + ihl_bytes;
    let l4_len = tot_len - ihl_bytes;
    let ports: [u16; 2] = ctx.load(l4_off).map_err(|_| Skip::Malformed)?;
    let mut tcp_flags = 0;
    if ip.proto == PROTO_TCP {
        let doff: u8 = ctx.load(l4_off + 12).map_err(|_| Skip::Malformed)?;
        let doff_bytes = ((doff >> 4) as usize) * 4;
        if doff_bytes < TCP_MIN_HLEN || l4_len < doff_bytes {
            return Err(Skip::Malformed);
        }
        tcp_flags = ctx.load(l4_off + 13).map_err(|_| Skip::Malformed)?;
    } else if ip.proto == PROTO_SCTP {
        // Only its ports are read: SCTP frontends are counted, not translated.
    } else {
        let udp_len: u16 = ctx.load(l4_off + 4).map_err(|_| Skip::Malformed)?;
        let udp_len = u16::from_be(udp_len) as usize;
        if l4_len < UDP_HLEN || udp_len < UDP_HLEN || udp_len > l4_len {
            return Err(Skip::Malformed);
        }
    }
    Ok(Flow {
        l4_off,
        proto: ip.proto,
        ihl_bytes,
        src_be: ip.src_be,
        dst_be: ip.dst_be,
        sport_be: ports[0],
        dport_be: ports[1],
        tcp_flags,
    })
}
