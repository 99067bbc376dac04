//! Direct server return's carrier (docs/architecture.md, "Direct server
//! return"): the entry node DNATs a flow to a backend on another node,
//! keeps the client's address, and adds the frontend the client addressed
//! to every packet, so that the backend's node can give the backend's
//! replies that frontend as their source. Over IPv4 it is an IP option,
//! over IPv6 a destination options header, both of RFC 4727's
//! experimental type 30: a host that does not know it skips it (IPv4's
//! receivers ignore options they do not know; the IPv6 type's two high
//! bits are 00, "skip"), and the packet stays routable to the backend
//! through any router, as an encapsulation's would, for 8 or 24 bytes.
//!
//! Both are written and read as bytes: their fields sit at offsets their
//! widths do not divide.

/// The IPv4 option's type: experimental option 30 with the copied flag
/// set, so that every fragment carries it (RFC 791, RFC 4727).
pub const IPV4_OPT_TYPE: u8 = 0x9e;
/// The IPv4 option's length: type, length, port, address.
pub const IPV4_OPT_LEN: usize = 8;
/// The IPv6 destination option's type: experimental option 30, to be
/// skipped by a node that does not know it, not changed en route.
pub const IPV6_OPT_TYPE: u8 = 0x1e;
/// The IPv6 destination options header's length: next header, length,
/// the option (type, length, port, address), two bytes of padding.
pub const IPV6_EXT_LEN: usize = 24;
/// IPv6's next-header value of a destination options header.
pub const IPPROTO_DSTOPTS: u8 = 60;
/// The option's data: port and address.
const IPV6_OPT_DATA_LEN: u8 = 18;
/// `PadN` (RFC 8200 4.2) with no data bytes: two bytes of padding.
const PADN: u8 = 1;

/// The IPv4 option naming the frontend `addr_be`:`port_be` (both as they
/// sit in a packet).
#[inline(always)]
pub fn ipv4_option(addr_be: u32, port_be: u16) -> [u8; IPV4_OPT_LEN] {
    let port = port_be.to_ne_bytes();
    let addr = addr_be.to_ne_bytes();
    [
        IPV4_OPT_TYPE,
        IPV4_OPT_LEN as u8,
        port[0],
        port[1],
        addr[0],
        addr[1],
        addr[2],
        addr[3],
    ]
}

/// The frontend an IPv4 option names, if it is the DSR option.
#[inline(always)]
pub fn ipv4_frontend(opt: &[u8; IPV4_OPT_LEN]) -> Option<(u32, u16)> {
    if opt[0] != IPV4_OPT_TYPE || opt[1] != IPV4_OPT_LEN as u8 {
        return None;
    }
    Some((
        u32::from_ne_bytes([opt[4], opt[5], opt[6], opt[7]]),
        u16::from_ne_bytes([opt[2], opt[3]]),
    ))
}

/// A 20-byte IPv4 header's first 16 bits and total length (network order)
/// once the option follows it: IHL 5 words to 7, 8 bytes longer. `word0`
/// and `tot_len_be` are both as they were in the packet, as read from it.
#[inline(always)]
pub fn ipv4_grown_fields(word0: u16, tot_len_be: u16) -> (u16, u16) {
    // The IHL is the low nibble of the first byte, which sits first in
    // memory whatever the host's order.
    let mut first = word0.to_ne_bytes();
    first[0] = (first[0] & 0xf0) | ((20 + IPV4_OPT_LEN) / 4) as u8;
    let tot_len = u16::from_be(tot_len_be).wrapping_add(IPV4_OPT_LEN as u16);
    (u16::from_ne_bytes(first), tot_len.to_be())
}

/// What inserting `opt` after a 20-byte IPv4 header adds to the header
/// checksum's one's complement sum: the fields `ipv4_grown_fields` changes
/// and the option's own words. `word0` is the header's first 16 bits and
/// `tot_len_be` its total length, both as they were in the packet.
#[inline(always)]
pub fn ipv4_grown_csum_delta(word0: u16, tot_len_be: u16, opt: &[u8; IPV4_OPT_LEN]) -> u64 {
    use crate::csum::delta16;
    let (grown_word0, grown_tot_len_be) = ipv4_grown_fields(word0, tot_len_be);
    let mut delta = delta16(word0, grown_word0) + delta16(tot_len_be, grown_tot_len_be);
    let mut i = 0;
    while i < IPV4_OPT_LEN {
        delta += u64::from(u16::from_ne_bytes([opt[i], opt[i + 1]]));
        i += 2;
    }
    delta
}

/// The IPv6 destination options header naming the frontend
/// `addr_be`:`port_be`, before the header `next` (the transport's, or the
/// next extension header's).
#[inline(always)]
pub fn ipv6_dest_opts(next: u8, addr_be: &[u32; 4], port_be: u16) -> [u8; IPV6_EXT_LEN] {
    let mut h = [0u8; IPV6_EXT_LEN];
    h[0] = next;
    // In 8-byte units, not counting the first 8.
    h[1] = (IPV6_EXT_LEN / 8 - 1) as u8;
    h[2] = IPV6_OPT_TYPE;
    h[3] = IPV6_OPT_DATA_LEN;
    let port = port_be.to_ne_bytes();
    h[4] = port[0];
    h[5] = port[1];
    let mut i = 0;
    while i < 4 {
        let word = addr_be[i].to_ne_bytes();
        h[6 + 4 * i] = word[0];
        h[7 + 4 * i] = word[1];
        h[8 + 4 * i] = word[2];
        h[9 + 4 * i] = word[3];
        i += 1;
    }
    h[22] = PADN;
    h[23] = 0;
    h
}

/// The frontend a destination options header names and the header after
/// it, if it is exactly the one `ipv6_dest_opts` writes.
#[inline(always)]
pub fn ipv6_frontend(h: &[u8; IPV6_EXT_LEN]) -> Option<([u32; 4], u16, u8)> {
    if h[1] != (IPV6_EXT_LEN / 8 - 1) as u8
        || h[2] != IPV6_OPT_TYPE
        || h[3] != IPV6_OPT_DATA_LEN
        || h[22] != PADN
        || h[23] != 0
    {
        return None;
    }
    let mut addr = [0u32; 4];
    let mut i = 0;
    while i < 4 {
        addr[i] = u32::from_ne_bytes([h[6 + 4 * i], h[7 + 4 * i], h[8 + 4 * i], h[9 + 4 * i]]);
        i += 1;
    }
    Some((addr, u16::from_ne_bytes([h[4], h[5]]), h[0]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::csum::apply;

    /// The one's complement checksum of `bytes`, as a header carries it.
    fn checksum(bytes: &[u8]) -> u16 {
        let sum: u64 = bytes
            .chunks(2)
            .map(|w| u64::from(u16::from_ne_bytes([w[0], w[1]])))
            .sum();
        !crate::csum::fold(sum)
    }

    fn header(tot_len: u16, tos: u8, ttl: u8) -> [u8; 20] {
        let mut h = [0u8; 20];
        h[0] = 0x45;
        h[1] = tos;
        h[2..4].copy_from_slice(&tot_len.to_be_bytes());
        h[4..6].copy_from_slice(&0x1234u16.to_be_bytes());
        h[6] = 0x40;
        h[8] = ttl;
        h[9] = 6;
        h[12..16].copy_from_slice(&[203, 0, 113, 7]);
        h[16..20].copy_from_slice(&[10, 1, 2, 10]);
        let c = checksum(&h);
        h[10..12].copy_from_slice(&c.to_ne_bytes());
        h
    }

    #[test]
    fn the_grown_header_checksum_is_the_recomputed_one() {
        for (tot_len, tos, ttl, port) in [
            (40u16, 0u8, 64u8, 80u16),
            (1500, 0xb8, 1, 30080),
            (65527, 0xff, 255, 65535),
            (20, 0, 0, 0),
        ] {
            let old = header(tot_len, tos, ttl);
            let opt = ipv4_option(u32::from_ne_bytes([192, 168, 60, 10]), port.to_be());
            let word0 = u16::from_ne_bytes([old[0], old[1]]);
            let tot_len_be = u16::from_ne_bytes([old[2], old[3]]);
            let delta = ipv4_grown_csum_delta(word0, tot_len_be, &opt);
            let mut grown = [0u8; 28];
            grown[..20].copy_from_slice(&old);
            grown[20..].copy_from_slice(&opt);
            grown[0] = 0x47;
            grown[2..4].copy_from_slice(&(tot_len + 8).to_be_bytes());
            let updated = apply(u16::from_ne_bytes([old[10], old[11]]), delta);
            grown[10..12].copy_from_slice(&[0, 0]);
            assert_eq!(
                updated,
                checksum(&grown),
                "header of {tot_len} bytes, tos {tos:#x}, ttl {ttl}, port {port}: updated checksum differs from the recomputed one"
            );
            grown[10..12].copy_from_slice(&updated.to_ne_bytes());
            assert_eq!(checksum(&grown), 0, "the grown header does not sum to zero");
        }
    }

    #[test]
    fn ipv4_option_round_trips_and_others_are_refused() {
        let addr = u32::from_ne_bytes([192, 168, 50, 1]);
        let opt = ipv4_option(addr, 30080u16.to_be());
        assert_eq!(
            opt[..4],
            [0x9e, 8, 0x75, 0x80],
            "type, length, port on the wire"
        );
        assert_eq!(opt[4..], [192, 168, 50, 1], "address on the wire");
        assert_eq!(ipv4_frontend(&opt), Some((addr, 30080u16.to_be())));
        let mut other = opt;
        other[0] = 0x94; // Router Alert
        assert_eq!(ipv4_frontend(&other), None, "another option type");
        let mut short = opt;
        short[1] = 6;
        assert_eq!(ipv4_frontend(&short), None, "another length");
    }

    #[test]
    fn ipv6_header_round_trips_and_others_are_refused() {
        let addr = [
            u32::from_ne_bytes([0xfd, 0, 0, 0x60]),
            0,
            0,
            u32::from_ne_bytes([0, 0, 0, 0x10]),
        ];
        let h = ipv6_dest_opts(6, &addr, 80u16.to_be());
        assert_eq!(h[..6], [6, 2, 0x1e, 18, 0, 80], "next, length, option head");
        assert_eq!(h[6..10], [0xfd, 0, 0, 0x60], "address on the wire");
        assert_eq!(h[22..], [1, 0], "PadN");
        assert_eq!(h.len() % 8, 0, "a whole number of 8-byte units");
        // RFC 8200 4.2: the option type's two high bits say what a node
        // that does not know it does; 00 is "skip".
        assert_eq!(IPV6_OPT_TYPE >> 6, 0);
        assert_eq!(ipv6_frontend(&h), Some((addr, 80u16.to_be(), 6)));
        for (at, value) in [(1, 1u8), (2, 0x1f), (3, 16), (22, 0), (23, 1)] {
            let mut other = h;
            other[at] = value;
            assert_eq!(ipv6_frontend(&other), None, "byte {at} = {value}");
        }
    }
}
