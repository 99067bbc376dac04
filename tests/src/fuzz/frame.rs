//! IPv4 frames as the fuzz builds and reads them: headers read as far as
//! they go, whatever the bytes say, and checksums computed and checked.

use std::net::Ipv4Addr;

use super::{ICMP, Tuple};
use crate::frames::{TCP, UDP, csum};

pub(super) const ETH_HLEN: usize = 14;
pub(super) const ETH_P_IP: u16 = 0x0800;

/// The IPv4 headers of a frame, as far as they can be read.
#[derive(Clone, Copy, Debug)]
pub(super) struct View {
    pub(super) ihl: usize,
    pub(super) tot_len: usize,
    pub(super) proto: u8,
    pub(super) ttl: u8,
    pub(super) src: Ipv4Addr,
    pub(super) dst: Ipv4Addr,
    pub(super) more_fragments: bool,
    pub(super) frag_offset: u16,
    pub(super) l4: usize,
}

impl View {
    pub(super) fn fragment(&self) -> bool {
        self.more_fragments || self.frag_offset != 0
    }

    /// The L4 header is in the frame and its ports can be read.
    pub(super) fn ports(&self, f: &[u8]) -> Option<(u16, u16)> {
        if self.frag_offset != 0 || self.l4 + 4 > f.len() {
            return None;
        }
        Some((be16(f, self.l4), be16(f, self.l4 + 2)))
    }

    pub(super) fn tuple(&self, f: &[u8]) -> Option<Tuple> {
        let (sport, dport) = self.ports(f)?;
        Some(Tuple {
            proto: self.proto,
            src: self.src,
            sport,
            dst: self.dst,
            dport,
        })
    }

    pub(super) fn l4_csum_off(&self) -> Option<usize> {
        match self.proto {
            TCP => Some(self.l4 + 16),
            UDP => Some(self.l4 + 6),
            ICMP => Some(self.l4 + 2),
            _ => None,
        }
    }
}

pub(super) fn be16(f: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([f[at], f[at + 1]])
}

pub(super) fn put16(f: &mut [u8], at: usize, v: u16) {
    f[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

pub(super) fn addr(f: &[u8], at: usize) -> Ipv4Addr {
    Ipv4Addr::new(f[at], f[at + 1], f[at + 2], f[at + 3])
}

/// An IPv4 frame whose version, IHL and header fit; nothing else checked.
pub(super) fn view(f: &[u8]) -> Option<View> {
    if f.len() < ETH_HLEN + 20 || be16(f, 12) != ETH_P_IP || f[14] >> 4 != 4 {
        return None;
    }
    let ihl = (f[14] & 0x0f) as usize * 4;
    if ihl < 20 || ETH_HLEN + ihl > f.len() {
        return None;
    }
    let frag = be16(f, 20);
    Some(View {
        ihl,
        tot_len: be16(f, 16) as usize,
        proto: f[23],
        ttl: f[22],
        src: addr(f, 26),
        dst: addr(f, 30),
        more_fragments: frag & 0x2000 != 0,
        frag_offset: frag & 0x1fff,
        l4: ETH_HLEN + ihl,
    })
}

pub(super) fn pseudo_sum(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize) -> u32 {
    let mut sum = 0u32;
    for o in [src.octets(), dst.octets()] {
        sum += u32::from(u16::from_be_bytes([o[0], o[1]]))
            + u32::from(u16::from_be_bytes([o[2], o[3]]));
    }
    sum + u32::from(proto) + len as u32
}

/// The IP header's checksum residual: 0 when valid.
pub(super) fn ip_residual(f: &[u8], v: &View) -> u16 {
    csum(&f[ETH_HLEN..v.l4], 0)
}

/// The L4 checksum residual over the whole segment (0 when valid), where
/// the segment is in the frame and not a fragment. 0 and 0xffff are the
/// same in one's complement: both come out as 0.
pub(super) fn l4_residual(f: &[u8], v: &View) -> Option<u16> {
    if v.fragment() || v.tot_len < v.ihl || ETH_HLEN + v.tot_len > f.len() {
        return None;
    }
    let seg = &f[v.l4..ETH_HLEN + v.tot_len];
    let r = match v.proto {
        TCP | UDP => csum(seg, pseudo_sum(v.src, v.dst, v.proto, seg.len())),
        ICMP => csum(seg, 0),
        _ => return None,
    };
    Some(if r == 0xffff { 0 } else { r })
}

/// Recomputes the IPv4 header checksum (when the header can be read).
pub fn fix_ip_csum(f: &mut [u8]) {
    if let Some(v) = view(f) {
        put16(f, 24, 0);
        let c = csum(&f[ETH_HLEN..v.l4], 0);
        put16(f, 24, c);
    }
}

/// Recomputes the L4 checksum over what the IP header says the segment is,
/// where that is inside the frame.
pub fn fix_l4_csum(f: &mut [u8]) {
    let Some(v) = view(f) else { return };
    let Some(off) = v.l4_csum_off() else { return };
    let end = ETH_HLEN + v.tot_len;
    if v.fragment() || v.tot_len < v.ihl || end > f.len() || off + 2 > end {
        return;
    }
    put16(f, off, 0);
    let seg = &f[v.l4..end];
    let c = if v.proto == ICMP {
        csum(seg, 0)
    } else {
        csum(seg, pseudo_sum(v.src, v.dst, v.proto, seg.len()))
    };
    let c = if v.proto == UDP && c == 0 { 0xffff } else { c };
    put16(f, off, c);
}

/// A well-formed frame, checksums computed.
#[derive(Clone, Debug)]
pub struct Packet {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub ttl: u8,
    pub id: u16,
    /// Flags and fragment offset, as in the header.
    pub frag: u16,
    /// IP options (padded to 4 bytes when encoded).
    pub options: Vec<u8>,
    pub l4: L4,
}

#[derive(Clone, Debug)]
pub enum L4 {
    Tcp {
        sport: u16,
        dport: u16,
        seq: u32,
        flags: u8,
        options: Vec<u8>,
        payload: Vec<u8>,
    },
    Udp {
        sport: u16,
        dport: u16,
        payload: Vec<u8>,
        no_csum: bool,
    },
    Icmp {
        kind: u8,
        code: u8,
        payload: Vec<u8>,
    },
    Other {
        proto: u8,
        payload: Vec<u8>,
    },
}

impl Packet {
    pub fn encode(&self) -> Vec<u8> {
        let (proto, mut l4) = match &self.l4 {
            L4::Tcp {
                sport,
                dport,
                seq,
                flags,
                options,
                payload,
            } => {
                let mut opts = options.clone();
                opts.resize(opts.len().div_ceil(4) * 4, 0);
                let mut b = Vec::new();
                b.extend_from_slice(&sport.to_be_bytes());
                b.extend_from_slice(&dport.to_be_bytes());
                b.extend_from_slice(&seq.to_be_bytes());
                b.extend_from_slice(&0u32.to_be_bytes());
                b.push((((20 + opts.len()) / 4) as u8) << 4);
                b.push(*flags);
                b.extend_from_slice(&64240u16.to_be_bytes());
                b.extend_from_slice(&[0, 0, 0, 0]);
                b.extend_from_slice(&opts);
                b.extend_from_slice(payload);
                (TCP, b)
            }
            L4::Udp {
                sport,
                dport,
                payload,
                ..
            } => {
                let mut b = Vec::new();
                b.extend_from_slice(&sport.to_be_bytes());
                b.extend_from_slice(&dport.to_be_bytes());
                b.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
                b.extend_from_slice(&[0, 0]);
                b.extend_from_slice(payload);
                (UDP, b)
            }
            L4::Icmp {
                kind,
                code,
                payload,
            } => {
                let mut b = vec![*kind, *code, 0, 0, 0, 0, 0, 0];
                b.extend_from_slice(payload);
                (ICMP, b)
            }
            L4::Other { proto, payload } => (*proto, payload.clone()),
        };
        let mut options = self.options.clone();
        options.resize(options.len().div_ceil(4) * 4, 0);
        options.truncate(40);
        let ihl = 20 + options.len();
        let mut f = vec![0x02, 0, 0, 0, 0, 0xaa, 0x02, 0, 0, 0, 0, 0xbb, 0x08, 0x00];
        f.push(0x40 | (ihl / 4) as u8);
        f.push(0);
        f.extend_from_slice(&((ihl + l4.len()) as u16).to_be_bytes());
        f.extend_from_slice(&self.id.to_be_bytes());
        f.extend_from_slice(&self.frag.to_be_bytes());
        f.extend_from_slice(&[self.ttl, proto, 0, 0]);
        f.extend_from_slice(&self.src.octets());
        f.extend_from_slice(&self.dst.octets());
        f.extend_from_slice(&options);
        let l4_at = f.len();
        f.append(&mut l4);
        fix_ip_csum(&mut f);
        // The L4 checksum covers the whole datagram: a fragment's is made as
        // if it were whole, which is what its first fragment would carry.
        let frag = self.frag;
        put16(&mut f, 20, 0);
        fix_ip_csum(&mut f);
        fix_l4_csum(&mut f);
        if let L4::Udp { no_csum: true, .. } = self.l4 {
            put16(&mut f, l4_at + 6, 0);
        }
        put16(&mut f, 20, frag);
        fix_ip_csum(&mut f);
        f
    }
}

/// The addresses and ports of an IPv4 TCP or UDP frame whose L4 header is
/// there.
pub fn tuple_of(f: &[u8]) -> Option<Tuple> {
    view(f)?.tuple(f)
}

/// Hex of a frame, for failure messages.
pub fn hex(f: &[u8]) -> String {
    f.iter().map(|b| format!("{b:02x}")).collect()
}
