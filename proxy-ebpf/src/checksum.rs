//! Internet checksums updated in place (RFC 1624), for writes made straight
//! into packet memory. Words are summed as they sit in memory, so no byte
//! swapping is needed: the one's complement sum does not care. Loads and
//! stores are of the field's width even where packet memory is misaligned
//! for it (see `packet::read`).

use proxy_common::{PROTO_TCP, PROTO_UDP};

use crate::{
    nat::Side,
    packet::{ETH_HLEN, Flow},
};

const IP_CSUM_OFF: usize = 10;
const IP_TTL_OFF: usize = 8;
const IP_SRC_OFF: usize = 12;
const IP_DST_OFF: usize = 16;
const IPV4_MIN_HLEN: usize = 20;
/// Deepest L4 header start the parser accepts (Ethernet plus a full
/// 60-byte IPv4 header); bounds the offsets the verifier sees.
const MAX_L4_OFF: usize = ETH_HLEN + 60;

#[inline(always)]
fn fold(mut sum: u64) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// The checksum after a 32-bit word of the covered data went from `old` to
/// `new`: HC' = ~(~HC + ~m + m').
#[inline(always)]
pub fn replace32(csum: u16, old: u32, new: u32) -> u16 {
    let sum = (!csum) as u64
        + ((!old) >> 16) as u64
        + ((!old) & 0xffff) as u64
        + (new >> 16) as u64
        + (new & 0xffff) as u64;
    !fold(sum)
}

#[inline(always)]
pub fn replace16(csum: u16, old: u16, new: u16) -> u16 {
    let sum = (!csum) as u64 + (!old) as u64 + new as u64;
    !fold(sum)
}

/// Who keeps the L4 checksum right after a rewrite.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum L4Csum {
    /// Updated here, in place (XDP: checksums on the wire are complete).
    Here,
    /// Left to the caller (tc: only the kernel's helper knows whether the
    /// socket buffer holds a partial or complete checksum).
    Caller,
}

/// Rewrites one side of `flow` in the packet between `data` and `data_end`,
/// fixing the IP checksum, and the L4 one if `l4` says so. A UDP checksum of
/// 0 means "none" and stays 0; a computed 0 is sent as 0xffff (RFC 768).
#[inline(always)]
pub fn rewrite_direct(
    data: usize,
    data_end: usize,
    flow: &Flow,
    side: Side,
    addr_be: u32,
    port_be: u16,
    l4: L4Csum,
) -> Result<(), ()> {
    let ip = data + ETH_HLEN;
    if ip + IPV4_MIN_HLEN > data_end {
        return Err(());
    }
    let l4_off = flow.l4_off;
    if l4_off > MAX_L4_OFF {
        return Err(());
    }
    let l4p = data + l4_off;
    // Per protocol, so that the verifier sees constant offsets.
    let csum_at = if flow.proto == PROTO_TCP {
        if l4p + 20 > data_end {
            return Err(());
        }
        l4p + 16
    } else {
        if l4p + 8 > data_end {
            return Err(());
        }
        l4p + 6
    };
    let (addr_at, port_at, old_addr, old_port) = match side {
        Side::Source => (IP_SRC_OFF, 0, flow.src_be, flow.sport_be),
        Side::Destination => (IP_DST_OFF, 2, flow.dst_be, flow.dport_be),
    };
    // SAFETY: every access below is inside the bounds checked above.
    unsafe {
        let ip_csum = (ip + IP_CSUM_OFF) as *mut u16;
        if old_addr != addr_be {
            ip_csum.write(replace32(ip_csum.read(), old_addr, addr_be));
            ((ip + addr_at) as *mut u32).write(addr_be);
        }
        if old_port != port_be {
            ((l4p + port_at) as *mut u16).write(port_be);
        }
        if l4 == L4Csum::Caller {
            return Ok(());
        }
        let l4_csum = csum_at as *mut u16;
        let mut l4c = l4_csum.read();
        let udp_none = flow.proto == PROTO_UDP && l4c == 0;
        if old_addr != addr_be {
            // The address is in the L4 pseudo-header.
            l4c = replace32(l4c, old_addr, addr_be);
        }
        if old_port != port_be {
            l4c = replace16(l4c, old_port, port_be);
        }
        if udp_none {
            l4c = 0;
        } else if flow.proto == PROTO_UDP && l4c == 0 {
            l4c = 0xffff;
        }
        l4_csum.write(l4c);
    }
    Ok(())
}

/// Takes one off the TTL, as a router does, for a packet sent on without
/// the stack. False when the TTL is spent: the packet is not to be sent on.
#[inline(always)]
pub fn decrement_ttl(data: usize, data_end: usize) -> bool {
    let ip = data + ETH_HLEN;
    if ip + IPV4_MIN_HLEN > data_end {
        return false;
    }
    // SAFETY: inside the bounds checked above.
    unsafe {
        let ttl_word = (ip + IP_TTL_OFF) as *mut u16;
        let old = ttl_word.read();
        let ttl = *((ip + IP_TTL_OFF) as *const u8);
        if ttl <= 1 {
            return false;
        }
        *((ip + IP_TTL_OFF) as *mut u8) = ttl - 1;
        let new = ttl_word.read();
        let ip_csum = (ip + IP_CSUM_OFF) as *mut u16;
        ip_csum.write(replace16(ip_csum.read(), old, new));
    }
    true
}

/// Writes the next hop's Ethernet addresses. False when the packet has no
/// room for an Ethernet header.
#[inline(always)]
pub fn write_macs(data: usize, data_end: usize, dmac: &[u8; 6], smac: &[u8; 6]) -> bool {
    if data + ETH_HLEN > data_end {
        return false;
    }
    // SAFETY: inside the bounds checked above.
    unsafe {
        (data as *mut [u8; 6]).write(*dmac);
        ((data + 6) as *mut [u8; 6]).write(*smac);
    }
    true
}
