//! Writes made straight into packet memory, with their checksums updated
//! in place (the arithmetic is `proxy_common::csum`, tested on the host).
//! Loads and stores are of the field's width even where packet memory is
//! misaligned for it (see `packet::read`).

use proxy_common::{
    PROTO_TCP, PROTO_UDP,
    csum::{apply, delta16, delta32, fold, full_update, pseudo_partial, replace16},
};

use crate::{
    nat::Nat,
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

/// What the L4 checksum field holds, and so who keeps it right after a
/// rewrite.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum L4Csum {
    /// The full checksum, with nothing else to follow it (XDP, where
    /// checksums are as on the wire; tc with `CHECKSUM_NONE` or
    /// `CHECKSUM_UNNECESSARY`): updated here, in place.
    Full,
    /// The pseudo-header sum a device finishes (tc, `CHECKSUM_PARTIAL`):
    /// updated here for the addresses only, as the kernel does.
    Partial,
    /// Left to the caller (tc, when the state is `CHECKSUM_COMPLETE`, whose
    /// `skb->csum` only the kernel's helper can update, or unknown).
    Caller,
}

/// What a rewrite changed in the L4 checksum's coverage, for a caller that
/// updates it (`L4Csum::Caller`): folded one's complement sums, as the
/// kernel's checksum helpers take them, split because only addresses are
/// in the pseudo-header; and the checksum field as it was.
pub struct L4Deltas {
    pub addrs: u32,
    pub ports: u32,
    pub csum: u16,
}

/// The L4 checksum field of `flow` in the packet between `data` and
/// `data_end`, if it is inside.
#[inline(always)]
pub fn l4_csum_field(data: usize, data_end: usize, flow: &Flow) -> Option<*mut u16> {
    let l4_off = flow.l4_off;
    if l4_off > MAX_L4_OFF {
        return None;
    }
    let l4p = data + l4_off;
    // Per protocol, so that the verifier sees constant offsets.
    if flow.proto == PROTO_TCP {
        (l4p + 20 <= data_end).then_some((l4p + 16) as *mut u16)
    } else {
        (l4p + 8 <= data_end).then_some((l4p + 6) as *mut u16)
    }
}

/// Writes `nat` over `flow`'s addresses and ports in the packet between
/// `data` and `data_end` in one pass, with one checksum update for all of
/// it: the IP checksum, and the L4 one unless `l4` leaves it to the caller.
/// A UDP checksum of 0 means "none" and stays 0; a computed 0 is sent as
/// 0xffff (RFC 768).
#[inline(always)]
pub fn rewrite_direct(
    data: usize,
    data_end: usize,
    flow: &Flow,
    nat: &Nat,
    l4: L4Csum,
) -> Result<L4Deltas, ()> {
    let l4_csum = l4_csum_field(data, data_end, flow).ok_or(())?;
    let l4p = data + flow.l4_off;
    let addrs = rewrite_ip(data, data_end, flow, nat)?;
    let ports = delta16(flow.sport_be, nat.sport_be) + delta16(flow.dport_be, nat.dport_be);
    // SAFETY: every access below is inside the bounds `l4_csum_field`
    // checked.
    unsafe {
        (l4p as *mut u16).write(nat.sport_be);
        ((l4p + 2) as *mut u16).write(nat.dport_be);
        let old = l4_csum.read();
        let udp = flow.proto == PROTO_UDP;
        match l4 {
            L4Csum::Full => l4_csum.write(full_update(old, addrs + ports, udp)),
            // Ports are not in the pseudo-header: the device sums them.
            L4Csum::Partial => l4_csum.write(pseudo_partial(old, addrs, udp)),
            L4Csum::Caller => {}
        }
        Ok(L4Deltas {
            addrs: u32::from(fold(addrs)),
            ports: u32::from(fold(ports)),
            csum: old,
        })
    }
}

/// Writes `nat`'s addresses into the IP header, with its checksum updated;
/// returns the change to the sum of the addresses (unfolded), which the L4
/// checksum's pseudo-header follows. All a later fragment needs: its L4
/// header, and the checksum that covers the whole datagram, are in the
/// first fragment.
#[inline(always)]
pub fn rewrite_ip(data: usize, data_end: usize, flow: &Flow, nat: &Nat) -> Result<u64, ()> {
    let ip = data + ETH_HLEN;
    if ip + IPV4_MIN_HLEN > data_end {
        return Err(());
    }
    let addrs = delta32(flow.src_be, nat.src_be) + delta32(flow.dst_be, nat.dst_be);
    // SAFETY: inside the bounds checked above.
    unsafe {
        ((ip + IP_SRC_OFF) as *mut u32).write(nat.src_be);
        ((ip + IP_DST_OFF) as *mut u32).write(nat.dst_be);
        let ip_csum = (ip + IP_CSUM_OFF) as *mut u16;
        ip_csum.write(apply(ip_csum.read(), addrs));
    }
    Ok(addrs)
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
