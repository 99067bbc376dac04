//! Hand-built Ethernet/IPv4/TCP-or-UDP (or SCTP) frames with valid checksums, and
//! checks that recompute them from scratch: the input of the datapath's
//! `BPF_PROG_TEST_RUN` tests and per-packet benchmarks.

use std::net::{Ipv4Addr, Ipv6Addr};

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const SCTP: u8 = 132;
pub const SYN: u8 = 0x02;
pub const ACK: u8 = 0x10;
pub const FIN: u8 = 0x01;
pub const RST: u8 = 0x04;
pub const PSH: u8 = 0x08;

pub fn csum(data: &[u8], initial: u32) -> u16 {
    let mut sum = initial;
    for chunk in data.chunks(2) {
        let word = if chunk.len() == 2 {
            u16::from_be_bytes([chunk[0], chunk[1]])
        } else {
            u16::from_be_bytes([chunk[0], 0])
        };
        sum += u32::from(word);
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn pseudo(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize) -> u32 {
    let mut sum = 0u32;
    for o in [src.octets(), dst.octets()] {
        sum += u32::from(u16::from_be_bytes([o[0], o[1]]))
            + u32::from(u16::from_be_bytes([o[2], o[3]]));
    }
    sum + u32::from(proto) + len as u32
}

pub struct Spec {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub tcp_flags: u8,
    pub payload: Vec<u8>,
    /// UDP only: send a checksum of 0 ("none").
    pub udp_no_csum: bool,
}

pub fn build(s: &Spec) -> Vec<u8> {
    let mut l4 = Vec::new();
    l4.extend_from_slice(&s.sport.to_be_bytes());
    l4.extend_from_slice(&s.dport.to_be_bytes());
    if s.proto == TCP {
        l4.extend_from_slice(&0x1234_5678u32.to_be_bytes()); // seq
        l4.extend_from_slice(&0u32.to_be_bytes()); // ack
        l4.push(5 << 4);
        l4.push(s.tcp_flags);
        l4.extend_from_slice(&64240u16.to_be_bytes());
        l4.extend_from_slice(&[0, 0, 0, 0]); // csum, urgent
    } else {
        l4.extend_from_slice(&((8 + s.payload.len()) as u16).to_be_bytes());
        l4.extend_from_slice(&[0, 0]);
    }
    l4.extend_from_slice(&s.payload);
    let c = csum(&l4, pseudo(s.src, s.dst, s.proto, l4.len()));
    let off = if s.proto == TCP { 16 } else { 6 };
    let c = if s.proto == UDP && s.udp_no_csum {
        0
    } else if s.proto == UDP && c == 0 {
        0xffff
    } else {
        c
    };
    l4[off..off + 2].copy_from_slice(&c.to_be_bytes());
    frame4(s.src, s.dst, s.proto, &l4)
}

/// An Ethernet/IPv4 frame carrying `l4` (already checksummed), its header
/// checksum right.
fn frame4(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, l4: &[u8]) -> Vec<u8> {
    let mut ip = vec![0x45, 0];
    ip.extend_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0x12, 0x34, 0x40, 0x00, 64, proto, 0, 0]);
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    let c = csum(&ip, 0);
    ip[10..12].copy_from_slice(&c.to_be_bytes());

    let mut f = vec![0x02, 0, 0, 0, 0, 0xaa, 0x02, 0, 0, 0, 0, 0xbb, 0x08, 0x00];
    f.extend_from_slice(&ip);
    f.extend_from_slice(l4);
    f
}

/// An Ethernet/IPv4 frame carrying the SCTP packet `sctp` as given (build it,
/// its `CRC32c` right, with `crate::sctp::packet`).
pub fn build_sctp(src: Ipv4Addr, dst: Ipv4Addr, sctp: &[u8]) -> Vec<u8> {
    frame4(src, dst, SCTP, sctp)
}

/// An Ethernet/IPv6 frame carrying the SCTP packet `sctp` as given.
pub fn build_sctp6(src: Ipv6Addr, dst: Ipv6Addr, sctp: &[u8]) -> Vec<u8> {
    frame6(src, dst, SCTP, &[], sctp)
}

/// Panics, saying `what` and both values, unless the SCTP packet `l4` carries
/// the `CRC32c` of its bytes.
fn assert_sctp_checksum(l4: &[u8], what: &str) {
    assert!(
        l4.len() >= 12,
        "{what}: an SCTP packet of {} bytes",
        l4.len()
    );
    let stored = u32::from_le_bytes(l4[8..12].try_into().unwrap());
    let want = proxy_common::sctp::packet_checksum(l4);
    assert_eq!(
        stored,
        want,
        "{what}: SCTP CRC32c is wrong ({stored:#010x} stored, {want:#010x} computed over {} bytes)",
        l4.len()
    );
}

#[derive(Debug)]
pub struct Parsed {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
}

/// Parses an output frame and panics if any checksum is wrong.
pub fn parse_checked(f: &[u8], what: &str) -> Parsed {
    assert!(f.len() >= 34, "{what}: frame of {} bytes", f.len());
    let ip = &f[14..34];
    assert_eq!(csum(ip, 0), 0, "{what}: IPv4 header checksum is wrong");
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let tot = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    let l4 = &f[34..14 + tot];
    let proto = ip[9];
    match proto {
        TCP => assert_eq!(
            csum(l4, pseudo(src, dst, proto, l4.len())),
            0,
            "{what}: TCP checksum is wrong"
        ),
        UDP if l4[6] == 0 && l4[7] == 0 => {}
        UDP => assert_eq!(
            csum(l4, pseudo(src, dst, proto, l4.len())),
            0,
            "{what}: UDP checksum is wrong"
        ),
        1 => assert_eq!(csum(l4, 0), 0, "{what}: ICMP checksum is wrong"),
        SCTP => assert_sctp_checksum(l4, what),
        other => panic!("{what}: unexpected protocol {other}"),
    }
    Parsed {
        src,
        dst,
        proto,
        sport: u16::from_be_bytes([l4[0], l4[1]]),
        dport: u16::from_be_bytes([l4[2], l4[3]]),
    }
}

/// Splits the IPv4 datagram in `frame` into fragments carrying at most `chunk` bytes
/// of its payload each (a multiple of 8, as the fragment offset counts 8-byte units),
/// under the identification `id`, each a frame with a valid header checksum.
pub fn fragment(frame: &[u8], chunk: usize, id: u16) -> Vec<Vec<u8>> {
    assert!(
        chunk.is_multiple_of(8) && chunk > 0,
        "fragment size {chunk}"
    );
    let ihl = ((frame[14] & 0x0f) as usize) * 4;
    let tot = u16::from_be_bytes([frame[16], frame[17]]) as usize;
    let payload = &frame[14 + ihl..14 + tot];
    let pieces: Vec<&[u8]> = payload.chunks(chunk).collect();
    pieces
        .iter()
        .enumerate()
        .map(|(i, piece)| {
            let mut f = frame[..14 + ihl].to_vec();
            f.extend_from_slice(piece);
            let ip = &mut f[14..];
            ip[2..4].copy_from_slice(&((ihl + piece.len()) as u16).to_be_bytes());
            ip[4..6].copy_from_slice(&id.to_be_bytes());
            let more = if i + 1 < pieces.len() { 0x2000 } else { 0 };
            ip[6..8].copy_from_slice(&(more | (i * chunk / 8) as u16).to_be_bytes());
            ip[10..12].copy_from_slice(&[0, 0]);
            let c = csum(&ip[..ihl], 0);
            ip[10..12].copy_from_slice(&c.to_be_bytes());
            f
        })
        .collect()
}

/// The datagram that `fragments` (in order, as [`fragment`] makes them) carry, as one
/// frame: the first one's headers, the payloads joined, with a valid header checksum.
/// Panics when a fragment's header checksum is wrong, or when they disagree on what a
/// receiver reassembles by (addresses, protocol, identification).
pub fn reassemble(fragments: &[Vec<u8>], what: &str) -> Vec<u8> {
    let first = &fragments[0];
    let ihl = ((first[14] & 0x0f) as usize) * 4;
    let mut f = first[..14 + ihl].to_vec();
    for (i, frag) in fragments.iter().enumerate() {
        assert_eq!(
            csum(&frag[14..14 + ihl], 0),
            0,
            "{what}: fragment {i}: IPv4 header checksum is wrong"
        );
        let tie = |f: &[u8]| {
            (
                f[14 + 4..14 + 6].to_vec(),
                f[14 + 9],
                f[14 + 12..14 + 20].to_vec(),
            )
        };
        assert_eq!(
            tie(frag),
            tie(first),
            "{what}: fragment {i} differs from the first in (id, protocol, addresses)"
        );
        let tot = u16::from_be_bytes([frag[16], frag[17]]) as usize;
        f.extend_from_slice(&frag[14 + ihl..14 + tot]);
    }
    let tot = (f.len() - 14) as u16;
    let ip = &mut f[14..];
    ip[2..4].copy_from_slice(&tot.to_be_bytes());
    ip[6..8].copy_from_slice(&[0, 0]);
    ip[10..12].copy_from_slice(&[0, 0]);
    let c = csum(&ip[..ihl], 0);
    ip[10..12].copy_from_slice(&c.to_be_bytes());
    f
}

/// An ICMP error from `from` to `to` of `icmp_type`/`code` (with `mtu` in
/// the next-hop MTU field, for "fragmentation needed"), quoting the first
/// `quote_len` bytes past the IP header of the IPv4 packet in `frame` (8 is
/// what RFC 792 asks a router for; Linux quotes as much as fits).
pub fn icmp_error(
    from: Ipv4Addr,
    to: Ipv4Addr,
    (icmp_type, code, mtu): (u8, u8, u16),
    frame: &[u8],
    quote_len: usize,
) -> Vec<u8> {
    let ihl = ((frame[14] & 0x0f) as usize) * 4;
    let tot = u16::from_be_bytes([frame[16], frame[17]]) as usize;
    let quote = &frame[14..14 + ihl + quote_len.min(tot - ihl)];
    let mut icmp = vec![icmp_type, code, 0, 0, 0, 0];
    icmp.extend_from_slice(&mtu.to_be_bytes());
    icmp.extend_from_slice(quote);
    let c = csum(&icmp, 0);
    icmp[2..4].copy_from_slice(&c.to_be_bytes());

    let mut ip = vec![0x45, 0xc0];
    ip.extend_from_slice(&((20 + icmp.len()) as u16).to_be_bytes());
    ip.extend_from_slice(&[0x56, 0x78, 0, 0, 64, 1, 0, 0]);
    ip.extend_from_slice(&from.octets());
    ip.extend_from_slice(&to.octets());
    let c = csum(&ip, 0);
    ip[10..12].copy_from_slice(&c.to_be_bytes());

    let mut f = frame[..14].to_vec();
    f.extend_from_slice(&ip);
    f.extend_from_slice(&icmp);
    f
}

/// An ICMP error as [`parse_checked_icmp_error`] reads it.
#[derive(Debug, PartialEq, Eq)]
pub struct IcmpError {
    pub src: Ipv4Addr,
    pub dst: Ipv4Addr,
    pub icmp_type: u8,
    pub code: u8,
    /// The quoted packet: protocol, source and destination address and port.
    pub quoted: (u8, Ipv4Addr, u16, Ipv4Addr, u16),
}

/// Parses an ICMP error frame and panics if any checksum it carries is
/// wrong: its IP header's, its ICMP checksum, the quoted IP header's, and
/// the quoted TCP or UDP checksum when the quote holds the whole segment.
pub fn parse_checked_icmp_error(f: &[u8], what: &str) -> IcmpError {
    let ip = &f[14..34];
    assert_eq!(csum(ip, 0), 0, "{what}: IPv4 header checksum is wrong");
    assert_eq!(ip[9], 1, "{what}: not ICMP");
    let tot = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    let icmp = &f[34..14 + tot];
    assert_eq!(csum(icmp, 0), 0, "{what}: ICMP checksum is wrong");
    let quote = &icmp[8..];
    let qihl = ((quote[0] & 0x0f) as usize) * 4;
    assert_eq!(
        csum(&quote[..qihl], 0),
        0,
        "{what}: the quoted IPv4 header's checksum is wrong"
    );
    let addr = |o: usize| Ipv4Addr::new(quote[o], quote[o + 1], quote[o + 2], quote[o + 3]);
    let (qsrc, qdst, proto) = (addr(12), addr(16), quote[9]);
    let l4 = &quote[qihl..];
    let qtot = u16::from_be_bytes([quote[2], quote[3]]) as usize;
    #[expect(
        clippy::verbose_bit_mask,
        reason = "the More Fragments flag and the fragment offset, masked as RFC 791 lays them out"
    )]
    let whole = qtot == quote.len() && u16::from_be_bytes([quote[6], quote[7]]) & 0x3fff == 0;
    if whole && !(proto == UDP && l4[6] == 0 && l4[7] == 0) {
        assert_eq!(
            csum(l4, pseudo(qsrc, qdst, proto, l4.len())),
            0,
            "{what}: the quoted segment's checksum is wrong"
        );
    }
    IcmpError {
        src: Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]),
        dst: Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]),
        icmp_type: icmp[0],
        code: icmp[1],
        quoted: (
            proto,
            qsrc,
            u16::from_be_bytes([l4[0], l4[1]]),
            qdst,
            u16::from_be_bytes([l4[2], l4[3]]),
        ),
    }
}

/// The IPv6 pseudo-header's sum (RFC 8200 8.1): addresses, upper-layer
/// length and next header.
fn pseudo6(src: Ipv6Addr, dst: Ipv6Addr, next: u8, len: usize) -> u32 {
    let mut sum = 0u32;
    for o in [src.octets(), dst.octets()] {
        for pair in o.chunks(2) {
            sum += u32::from(u16::from_be_bytes([pair[0], pair[1]]));
        }
    }
    sum + (len as u32 >> 16) + (len as u32 & 0xffff) + u32::from(next)
}

pub const ICMPV6: u8 = 58;
/// IPv6 extension headers (next-header values).
pub const HOP_BY_HOP: u8 = 0;
pub const DEST_OPTS: u8 = 60;
pub const FRAGMENT: u8 = 44;
/// The authentication header (RFC 4302).
pub const AUTH: u8 = 51;

pub struct Spec6 {
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub tcp_flags: u8,
    pub payload: Vec<u8>,
    /// Extension headers before the transport header, in order: each an
    /// 8-byte header of this kind (options of padding; a fragment header
    /// of offset 0 without more fragments).
    pub ext: Vec<u8>,
}

/// An 8-byte extension header of `kind`, followed by `next`.
fn ext_header(kind: u8, next: u8) -> Vec<u8> {
    if kind == FRAGMENT {
        // Offset 0, no more fragments (an atomic fragment), id 0x1234.
        vec![next, 0, 0, 0, 0, 0, 0x12, 0x34]
    } else if kind == AUTH {
        // Length 2 (RFC 4302: (2 + 2) x 4 = 16 bytes): SPI, sequence number
        // and a 4-byte ICV. Its length counts otherwise than the others'.
        vec![
            next, 2, 0, 0, 0, 0, 0x01, 0x00, 0, 0, 0, 1, 0xa1, 0xa2, 0xa3, 0xa4,
        ]
    } else {
        // Length 0 (8 bytes): a PadN option of 4 bytes filling it.
        vec![next, 0, 1, 4, 0, 0, 0, 0]
    }
}

/// The length of the extension header at the start of `header`, of type
/// `kind`.
fn ext_header_len(kind: u8, header: &[u8]) -> usize {
    match kind {
        FRAGMENT => 8,
        AUTH => (header[1] as usize + 2) * 4,
        _ => (header[1] as usize + 1) * 8,
    }
}

/// An Ethernet/IPv6 frame carrying `l4` (already checksummed) after the
/// extension headers `ext`.
fn frame6(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, ext: &[u8], l4: &[u8]) -> Vec<u8> {
    let mut chain = Vec::new();
    for (i, kind) in ext.iter().enumerate() {
        let next = ext.get(i + 1).copied().unwrap_or(proto);
        chain.extend_from_slice(&ext_header(*kind, next));
    }
    let first = ext.first().copied().unwrap_or(proto);
    let mut f = vec![0x02, 0, 0, 0, 0, 0xaa, 0x02, 0, 0, 0, 0, 0xbb, 0x86, 0xdd];
    f.extend_from_slice(&[0x60, 0, 0, 0]);
    f.extend_from_slice(&((chain.len() + l4.len()) as u16).to_be_bytes());
    f.extend_from_slice(&[first, 64]);
    f.extend_from_slice(&src.octets());
    f.extend_from_slice(&dst.octets());
    f.extend_from_slice(&chain);
    f.extend_from_slice(l4);
    f
}

pub fn build6(s: &Spec6) -> Vec<u8> {
    let mut l4 = Vec::new();
    l4.extend_from_slice(&s.sport.to_be_bytes());
    l4.extend_from_slice(&s.dport.to_be_bytes());
    if s.proto == TCP {
        l4.extend_from_slice(&0x1234_5678u32.to_be_bytes()); // seq
        l4.extend_from_slice(&0u32.to_be_bytes()); // ack
        l4.push(5 << 4);
        l4.push(s.tcp_flags);
        l4.extend_from_slice(&64240u16.to_be_bytes());
        l4.extend_from_slice(&[0, 0, 0, 0]); // csum, urgent
    } else {
        l4.extend_from_slice(&((8 + s.payload.len()) as u16).to_be_bytes());
        l4.extend_from_slice(&[0, 0]);
    }
    l4.extend_from_slice(&s.payload);
    let c = csum(&l4, pseudo6(s.src, s.dst, s.proto, l4.len()));
    // UDP over IPv6 must carry a checksum: a computed 0 is sent as 0xffff.
    let c = if s.proto == UDP && c == 0 { 0xffff } else { c };
    let off = if s.proto == TCP { 16 } else { 6 };
    l4[off..off + 2].copy_from_slice(&c.to_be_bytes());
    frame6(s.src, s.dst, s.proto, &s.ext, &l4)
}

/// An ICMPv6 message (`body` after the type, code and checksum) in a frame,
/// its checksum over the pseudo-header.
pub fn icmp6(src: Ipv6Addr, dst: Ipv6Addr, icmp_type: u8, code: u8, body: &[u8]) -> Vec<u8> {
    let mut l4 = vec![icmp_type, code, 0, 0];
    l4.extend_from_slice(body);
    let c = csum(&l4, pseudo6(src, dst, ICMPV6, l4.len()));
    l4[2..4].copy_from_slice(&c.to_be_bytes());
    frame6(src, dst, ICMPV6, &[], &l4)
}

pub struct Parsed6 {
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    /// The transport protocol, past any extension headers.
    pub proto: u8,
    /// The transport header and what follows it.
    pub l4: Vec<u8>,
    pub sport: u16,
    pub dport: u16,
}

/// Parses an output IPv6 frame (walking its extension headers) and
/// panics if its transport checksum, recomputed from scratch, is wrong.
pub fn parse_checked6(f: &[u8], what: &str) -> Parsed6 {
    assert!(f.len() >= 54, "{what}: frame of {} bytes", f.len());
    assert_eq!(&f[12..14], &[0x86, 0xdd], "{what}: not an IPv6 frame");
    let ip = &f[14..54];
    assert_eq!(ip[0] >> 4, 6, "{what}: IP version {}", ip[0] >> 4);
    let octets = |b: &[u8]| -> Ipv6Addr { <[u8; 16]>::try_from(b).expect("16 bytes").into() };
    let src = octets(&ip[8..24]);
    let dst = octets(&ip[24..40]);
    let payload_len = u16::from_be_bytes([ip[4], ip[5]]) as usize;
    assert_eq!(
        f.len(),
        54 + payload_len,
        "{what}: frame length against the payload length"
    );
    let mut next = ip[6];
    let mut off = 54;
    while [HOP_BY_HOP, DEST_OPTS, FRAGMENT, 43, AUTH].contains(&next) {
        let len = ext_header_len(next, &f[off..]);
        next = f[off];
        off += len;
    }
    let l4 = f[off..].to_vec();
    if next == SCTP {
        assert_sctp_checksum(&l4, what);
    } else {
        assert_eq!(
            csum(&l4, pseudo6(src, dst, next, l4.len())),
            0,
            "{what}: the checksum of protocol {next} is wrong"
        );
    }
    if next == UDP {
        assert_ne!(&l4[6..8], &[0, 0], "{what}: a UDP checksum of 0 over IPv6");
    }
    Parsed6 {
        src,
        dst,
        proto: next,
        sport: u16::from_be_bytes([l4[0], l4[1]]),
        dport: u16::from_be_bytes([l4[2], l4[3]]),
        l4,
    }
}

/// Splits the IPv6 datagram in `frame` (no extension headers but destination
/// options) into fragments
/// carrying at most `chunk` bytes of its payload each (a multiple of 8), each
/// behind a fragment header of identification `id` (RFC 8200 4.5).
pub fn fragment6(frame: &[u8], chunk: usize, id: u32) -> Vec<Vec<u8>> {
    assert!(
        chunk.is_multiple_of(8) && chunk > 0,
        "fragment size {chunk}"
    );
    let next = frame[14 + 6];
    // A destination options header first belongs to the fragmentable part
    // (RFC 8200 4.5): it goes after the fragment header, in the first
    // fragment alone.
    assert!(
        ![HOP_BY_HOP, FRAGMENT, 43].contains(&next),
        "fragment6 takes a datagram without extension headers before its fragmentable part"
    );
    let payload = &frame[54..];
    let pieces: Vec<&[u8]> = payload.chunks(chunk).collect();
    pieces
        .iter()
        .enumerate()
        .map(|(i, piece)| {
            let mut f = frame[..54].to_vec();
            f[14 + 4..14 + 6].copy_from_slice(&((8 + piece.len()) as u16).to_be_bytes());
            f[14 + 6] = FRAGMENT;
            let more = u16::from(i + 1 < pieces.len());
            let field = ((i * chunk) as u16) | more;
            f.extend_from_slice(&[next, 0]);
            f.extend_from_slice(&field.to_be_bytes());
            f.extend_from_slice(&id.to_be_bytes());
            f.extend_from_slice(piece);
            f
        })
        .collect()
}

/// The datagram that IPv6 `fragments` (in order, as [`fragment6`] makes them)
/// carry, as one frame without a fragment header. Panics when they disagree on
/// what a receiver reassembles by (addresses, identification, the header
/// after the fragment header) or a fragment sits at the wrong offset.
pub fn reassemble6(fragments: &[Vec<u8>], what: &str) -> Vec<u8> {
    let first = &fragments[0];
    let tie = |f: &[u8]| (f[14 + 8..14 + 40].to_vec(), f[54], f[58..62].to_vec());
    let mut f = first[..54].to_vec();
    f[14 + 6] = first[54];
    for (i, frag) in fragments.iter().enumerate() {
        assert_eq!(
            frag[14 + 6],
            FRAGMENT,
            "{what}: fragment {i} has no fragment header"
        );
        assert_eq!(
            tie(frag),
            tie(first),
            "{what}: fragment {i} differs from the first in (addresses, next header, id)"
        );
        let field = u16::from_be_bytes([frag[56], frag[57]]);
        assert_eq!(
            usize::from(field & 0xfff8),
            f.len() - 54,
            "{what}: fragment {i}'s offset"
        );
        assert_eq!(
            field & 1 == 1,
            i + 1 < fragments.len(),
            "{what}: fragment {i}'s more-fragments flag"
        );
        f.extend_from_slice(&frag[62..]);
    }
    let len = (f.len() - 54) as u16;
    f[14 + 4..14 + 6].copy_from_slice(&len.to_be_bytes());
    f
}

/// An ICMPv6 error (RFC 4443) from `from` to `to` of `icmp_type`/`code`,
/// with `param` in its second word (the MTU of a "packet too big", the
/// pointer of a parameter problem), quoting the first `quote_len` bytes of
/// the IPv6 packet in `frame`, its header included (Linux quotes as much as
/// fits in 1,280 bytes).
pub fn icmp6_error(
    from: Ipv6Addr,
    to: Ipv6Addr,
    (icmp_type, code, param): (u8, u8, u32),
    frame: &[u8],
    quote_len: usize,
) -> Vec<u8> {
    let packet = &frame[14..];
    let mut body = param.to_be_bytes().to_vec();
    body.extend_from_slice(&packet[..quote_len.min(packet.len())]);
    icmp6(from, to, icmp_type, code, &body)
}

/// An ICMPv6 error as [`parse_checked_icmp6_error`] reads it.
#[derive(Debug, PartialEq, Eq)]
pub struct Icmp6Error {
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub icmp_type: u8,
    pub code: u8,
    /// The message's second word: an MTU, a pointer, or unused.
    pub param: u32,
    /// The quoted packet: protocol, source and destination address and port.
    pub quoted: (u8, Ipv6Addr, u16, Ipv6Addr, u16),
}

/// Parses an ICMPv6 error frame (its quote's extension headers
/// walked) and panics if a checksum it carries is wrong: the ICMPv6
/// checksum over its pseudo-header and whole message, and the quoted TCP or
/// UDP checksum when the quote holds the whole segment (and not a fragment
/// of it).
pub fn parse_checked_icmp6_error(f: &[u8], what: &str) -> Icmp6Error {
    let outer = parse_checked6(f, what);
    assert_eq!(outer.proto, ICMPV6, "{what}: not ICMPv6");
    let icmp = &outer.l4;
    assert!(
        icmp.len() >= 8 + 40 + 4,
        "{what}: a quote of {} bytes",
        icmp.len() - 8
    );
    let quote = &icmp[8..];
    assert_eq!(quote[0] >> 4, 6, "{what}: the quote is not IPv6");
    let octets = |b: &[u8]| -> Ipv6Addr { <[u8; 16]>::try_from(b).expect("16 bytes").into() };
    let (qsrc, qdst) = (octets(&quote[8..24]), octets(&quote[24..40]));
    let (mut proto, mut off, mut fragment) = (quote[6], 40, false);
    while [HOP_BY_HOP, DEST_OPTS, FRAGMENT, 43, AUTH].contains(&proto) {
        assert!(
            quote.len() >= off + 8,
            "{what}: the quote ends inside its extension headers"
        );
        fragment |= proto == FRAGMENT;
        let len = ext_header_len(proto, &quote[off..]);
        proto = quote[off];
        off += len;
    }
    let l4 = &quote[off..];
    assert!(l4.len() >= 4, "{what}: the quote ends before the ports");
    let qlen = u16::from_be_bytes([quote[4], quote[5]]) as usize;
    if !fragment && qlen + 40 == quote.len() {
        assert_eq!(
            csum(l4, pseudo6(qsrc, qdst, proto, l4.len())),
            0,
            "{what}: the quoted segment's checksum is wrong"
        );
    }
    Icmp6Error {
        src: outer.src,
        dst: outer.dst,
        icmp_type: icmp[0],
        code: icmp[1],
        param: u32::from_be_bytes([icmp[4], icmp[5], icmp[6], icmp[7]]),
        quoted: (
            proto,
            qsrc,
            u16::from_be_bytes([l4[0], l4[1]]),
            qdst,
            u16::from_be_bytes([l4[2], l4[3]]),
        ),
    }
}

/// `frame` (Ethernet, IPv4 or IPv6 without extension headers, TCP) with
/// its sequence and acknowledgment numbers set to `seq` and `ack` and its
/// TCP checksum recomputed: the frames above all carry the same ones.
pub fn with_seq_ack(frame: &[u8], seq: u32, ack: u32) -> Vec<u8> {
    let mut f = frame.to_vec();
    let v6 = f[12..14] == [0x86, 0xdd];
    let l4 = if v6 {
        14 + 40
    } else {
        14 + usize::from(f[14] & 0x0f) * 4
    };
    let next = if v6 { f[14 + 6] } else { f[14 + 9] };
    assert_eq!(next, TCP, "with_seq_ack: not a TCP frame");
    f[l4 + 4..l4 + 8].copy_from_slice(&seq.to_be_bytes());
    f[l4 + 8..l4 + 12].copy_from_slice(&ack.to_be_bytes());
    f[l4 + 16..l4 + 18].copy_from_slice(&[0, 0]);
    let len = f.len() - l4;
    let initial = if v6 {
        let addr = |at: usize| Ipv6Addr::from(<[u8; 16]>::try_from(&f[at..at + 16]).unwrap());
        pseudo6(addr(14 + 8), addr(14 + 24), TCP, len)
    } else {
        let addr = |at: usize| Ipv4Addr::from(<[u8; 4]>::try_from(&f[at..at + 4]).unwrap());
        pseudo(addr(14 + 12), addr(14 + 16), TCP, len)
    };
    let c = csum(&f[l4..], initial);
    f[l4 + 16..l4 + 18].copy_from_slice(&c.to_be_bytes());
    f
}
