//! SCTP's common header and chunks as the datapath reads them (RFC 9260
//! 3), and its checksum, CRC-32C (RFC 9260 6.8, appendix A), kept right
//! across a port rewrite without reading the packet's payload.
//!
//! The checksum covers the SCTP packet alone (no pseudo-header): a rewrite
//! of the addresses leaves it as it is, one of the ports changes it. CRC-32C
//! is linear over GF(2) for messages of one length, so the checksum of the
//! rewritten packet is the old one XOR the CRC (without its initial and
//! final inversion) of the difference: the four port bytes that changed,
//! followed by as many zero bytes as the packet has after them. The
//! difference's CRC is the four bytes' register, carried through the zero
//! bytes by one multiplication by x^(8n) modulo the polynomial, its power
//! taken from two tables of 256 (`SHIFT_LO`, `SHIFT_HI`): a fixed cost of
//! two 32-step multiplications, whatever the packet's length.

/// Bytes of the common header: ports, verification tag, checksum.
pub const HEADER_LEN: usize = 12;
/// Bytes of a chunk's header: type, flags, length.
pub const CHUNK_HEADER_LEN: usize = 4;
/// Where the checksum sits in the common header (stored little-endian).
pub const CSUM_OFF: usize = 8;
/// Where the verification tag sits in the common header.
pub const VTAG_OFF: usize = 4;
/// Where an INIT or INIT ACK chunk's Initiate Tag sits, from the start of
/// the SCTP packet (common header, chunk header, then the tag).
pub const INITIATE_TAG_OFF: usize = HEADER_LEN + CHUNK_HEADER_LEN;

/// Chunk types the datapath tells apart (RFC 9260 3.2).
pub mod chunk {
    pub const DATA: u8 = 0;
    pub const INIT: u8 = 1;
    pub const INIT_ACK: u8 = 2;
    pub const ABORT: u8 = 6;
    pub const SHUTDOWN_COMPLETE: u8 = 14;
    /// The T bit of ABORT and SHUTDOWN COMPLETE: the packet carries its
    /// sender's own tag, as it has none of its peer's (RFC 9260 8.5.1).
    pub const FLAG_T: u8 = 0x01;
}

/// What a packet's first chunk means to conntrack, carried in the flow's
/// TCP flags byte as the TCP flags of the same meaning, so that what reads
/// them for TCP (the flow cache's "never cached", conntrack's "does not
/// assure") treats SCTP's alike: an association starts (`INIT`, INIT ACK),
/// is aborted (`ABORT`) or ends (`SHUTDOWN_COMPLETE`).
pub mod control {
    /// TCP's SYN: an INIT chunk.
    pub const INIT: u8 = 0x02;
    /// SYN and ACK: an INIT ACK chunk.
    pub const INIT_ACK: u8 = 0x12;
    /// TCP's RST: an ABORT chunk.
    pub const ABORT: u8 = 0x04;
    /// TCP's FIN: a SHUTDOWN COMPLETE chunk.
    pub const SHUTDOWN_COMPLETE: u8 = 0x01;
    /// The chunk's T bit (TCP's CWR, which SCTP packets never need).
    pub const T_BIT: u8 = 0x80;
}

/// The control bits (`control`) of a packet whose first chunk is of type
/// `kind` with `flags`.
#[inline(always)]
pub const fn control_of(kind: u8, flags: u8) -> u8 {
    let t = if flags & chunk::FLAG_T != 0 {
        control::T_BIT
    } else {
        0
    };
    match kind {
        chunk::INIT => control::INIT,
        chunk::INIT_ACK => control::INIT_ACK,
        chunk::ABORT => control::ABORT | t,
        chunk::SHUTDOWN_COMPLETE => control::SHUTDOWN_COMPLETE | t,
        _ => 0,
    }
}

/// CRC-32C's polynomial, bit-reversed (Castagnoli, 0x1EDC6F41).
pub const POLY: u32 = 0x82F6_3B78;

/// One bit of the reflected CRC register.
#[inline(always)]
const fn step(c: u32) -> u32 {
    if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 }
}

/// `a * b` modulo the polynomial, both in the reflected representation
/// (x^0 is bit 31).
#[inline(always)]
pub const fn mul(a: u32, b: u32) -> u32 {
    let mut p = 0u32;
    let mut b = b;
    let mut i = 0;
    while i < 32 {
        if a & (0x8000_0000 >> i) != 0 {
            p ^= b;
        }
        b = step(b);
        i += 1;
    }
    p
}

/// x^8 modulo the polynomial: one zero byte.
const X8: u32 = 1 << (31 - 8);

const fn shift_lo() -> [u32; 256] {
    let mut t = [0u32; 256];
    t[0] = 1 << 31;
    let mut i = 1;
    while i < 256 {
        t[i] = mul(t[i - 1], X8);
        i += 1;
    }
    t
}

const fn shift_hi() -> [u32; 256] {
    let lo = shift_lo();
    let step256 = mul(lo[255], X8);
    let mut t = [0u32; 256];
    t[0] = 1 << 31;
    let mut i = 1;
    while i < 256 {
        t[i] = mul(t[i - 1], step256);
        i += 1;
    }
    t
}

/// `SHIFT_LO[i]` is x^(8i): `i` zero bytes. Statics, not constants: read
/// with an index known only at run time, a constant array may be copied
/// whole to the stack first.
pub static SHIFT_LO: [u32; 256] = shift_lo();
/// `SHIFT_HI[i]` is x^(8 * 256i): `256i` zero bytes.
pub static SHIFT_HI: [u32; 256] = shift_hi();

/// The register of the four bytes `bytes` (as in memory, read as a
/// little-endian word), from a register of 0.
#[inline(always)]
pub const fn word_register(bytes_le: u32) -> u32 {
    let mut c = bytes_le;
    let mut i = 0;
    while i < 32 {
        c = step(c);
        i += 1;
    }
    c
}

/// What to XOR into the checksum (read as a little-endian word) of an SCTP
/// packet of `len` bytes whose first four bytes (the ports) change by
/// `diff_le` (old XOR new, read as a little-endian word). `len` below 4 or
/// above 65535 never comes from a parsed packet; it gives 0 (no change).
#[inline(always)]
pub fn ports_delta(diff_le: u32, len: usize) -> u32 {
    if !(4..=0xffff).contains(&len) {
        return 0;
    }
    let zeros = len - 4;
    let c = word_register(diff_le);
    let c = mul(SHIFT_LO[zeros & 0xff], c);
    mul(SHIFT_HI[(zeros >> 8) & 0xff], c)
}

/// CRC-32C of `data`, as SCTP computes it over a packet whose checksum
/// field holds 0 (`packet_checksum`); stored little-endian. The host's
/// (tests, tools): the datapath only ever updates a checksum
/// (`ports_delta`).
pub fn crc32c(data: &[u8]) -> u32 {
    !data.iter().fold(!0u32, |c, &b| byte(c, b))
}

/// The checksum `packet` (an SCTP packet, common header first) should
/// carry: its CRC-32C with the checksum field read as 0.
pub fn packet_checksum(packet: &[u8]) -> u32 {
    let field = CSUM_OFF..CSUM_OFF + 4;
    !packet.iter().enumerate().fold(!0u32, |c, (i, &b)| {
        byte(c, if field.contains(&i) { 0 } else { b })
    })
}

/// The register after one more byte.
fn byte(c: u32, b: u8) -> u32 {
    (0..8).fold(c ^ u32::from(b), |c, _| step(c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// RFC 3720 B.4's CRC-32C test vectors.
    #[test]
    fn crc32c_matches_known_vectors() {
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA, "32 zero bytes");
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43, "32 bytes of 0xff");
        let inc: [u8; 32] = core::array::from_fn(|i| i as u8);
        assert_eq!(crc32c(&inc), 0x46DD_794E, "32 incrementing bytes");
        assert_eq!(crc32c(b"123456789"), 0xE306_9283, "check value");
    }

    #[test]
    fn shift_tables_are_powers_of_x8() {
        // x^(8 * 256) is 256 steps of x^8.
        let by_steps = (0..256).fold(1u32 << 31, |p, _| mul(p, X8));
        assert_eq!(SHIFT_HI[1], by_steps, "SHIFT_HI[1] is not x^2048");
        assert_eq!(SHIFT_LO[1], X8, "SHIFT_LO[1] is not x^8");
        assert_eq!(
            mul(1 << 31, 0x1234_5678),
            0x1234_5678,
            "x^0 is not the identity"
        );
    }

    /// An SCTP packet of `len` bytes (at least the common header) from
    /// `seed`, its checksum right.
    fn packet(seed: &[u8], len: usize) -> Vec<u8> {
        let mut p: Vec<u8> = (0..len).map(|i| seed[i % seed.len()] ^ (i as u8)).collect();
        let c = packet_checksum(&p);
        p[CSUM_OFF..CSUM_OFF + 4].copy_from_slice(&c.to_le_bytes());
        p
    }

    proptest! {
        /// The updated checksum is the recomputed one, for any ports and
        /// any length a packet can have.
        #[test]
        fn ports_delta_matches_a_recomputed_checksum(
            seed in proptest::collection::vec(any::<u8>(), 1..64),
            len in 12usize..2000,
            new_ports in any::<[u8; 4]>(),
        ) {
            let mut p = packet(&seed, len);
            let old_field = u32::from_le_bytes(p[CSUM_OFF..CSUM_OFF + 4].try_into().unwrap());
            let old_ports = u32::from_le_bytes(p[0..4].try_into().unwrap());
            p[0..4].copy_from_slice(&new_ports);
            let diff = old_ports ^ u32::from_le_bytes(new_ports);
            let updated = old_field ^ ports_delta(diff, len);
            prop_assert_eq!(updated, packet_checksum(&p), "len {}", len);
        }
    }

    #[test]
    fn ports_delta_holds_for_the_longest_packets() {
        for len in [12, 255 + 4, 256 + 4, 1500, 9000, 65535] {
            let mut p = packet(&[7, 1, 9], len);
            let old = u32::from_le_bytes(p[CSUM_OFF..CSUM_OFF + 4].try_into().unwrap());
            let old_ports = u32::from_le_bytes(p[0..4].try_into().unwrap());
            p[0..4].copy_from_slice(&[0x1f, 0x90, 0x23, 0x28]);
            let diff = old_ports ^ u32::from_le_bytes([0x1f, 0x90, 0x23, 0x28]);
            assert_eq!(
                old ^ ports_delta(diff, len),
                packet_checksum(&p),
                "checksum of a {len}-byte packet after its ports changed"
            );
        }
    }

    #[test]
    fn control_bits_of_chunks() {
        assert_eq!(control_of(chunk::INIT, 0), control::INIT);
        assert_eq!(control_of(chunk::INIT_ACK, 0), control::INIT_ACK);
        assert_eq!(
            control_of(chunk::ABORT, chunk::FLAG_T),
            control::ABORT | control::T_BIT
        );
        assert_eq!(
            control_of(chunk::SHUTDOWN_COMPLETE, 0),
            control::SHUTDOWN_COMPLETE
        );
        assert_eq!(
            control_of(chunk::DATA, 0xff),
            0,
            "DATA's flags are not the T bit"
        );
    }
}
