//! The prefilter: one bit array (`map_names::PREFILTER`) that tells the
//! datapath, before any hash map lookup, that a packet is for no Service
//! and the reply of no translated flow, so that it leaves untouched at the
//! cost of a few array reads (docs/architecture.md, "The prefilter").
//!
//! A packet may be ours only when one of its keys has its bit set:
//!
//! - its destination (`side::TO`): a frontend's address and port, read
//!   only where its destination's block may hold a frontend
//!   (`frontends_bit`);
//! - its source (`side::FROM`): a backend's address and port, which every
//!   reply of a translated flow comes from;
//! - its destination port (`port_bit`), where a NodePort has that port.
//!
//! A packet the answer is no for may still be for a service CIDR, which
//! is not ours to pass (`crate::service_cidr`): its destination's block
//! (`block_bit`) says whether it may be, or `WIDE_BIT` that any may.
//! `turned_away` is the question as the datapath asks it.
//!
//! The agent sets a key's bit before the entry that needs it lands, and
//! clears bits only by rebuilding the whole array from what the maps hold,
//! conntrack included, so an established flow keeps its bits after its
//! Service goes. A bit set for nothing costs a packet the lookups it would
//! have made anyway, never a wrong answer.

/// The array's first `PORTS` bits are one per port number (as on the
/// wire): a NodePort sets its port's, since a NodePort may be served on any
/// of the node's addresses, which only a hash map lookup could list.
pub const PORTS: u32 = 1 << 16;
/// Then 2^`HASHED_LOG2` bits of hashed keys: 1 MiB. At 100,000 Services x
/// 10 endpoints (about 1.1 million keys) one bit in eight is set, so about
/// a quarter of the packets for no Service take the lookups of the full
/// path; at 10,000 Services one in sixty.
pub const HASHED_LOG2: u32 = 23;
/// Bits in the array.
pub const BITS: u32 = PORTS + (1 << HASHED_LOG2);
/// 64-bit words in the array: the map's entries.
pub const WORDS: u32 = BITS / 64;

/// Which end of a packet a key names.
pub mod side {
    /// Its destination: a frontend.
    pub const TO: u8 = 1;
    /// Its source: a backend answering.
    pub const FROM: u8 = 2;
    /// Its destination's block of 256 addresses (`block_bit`).
    pub const BLOCK: u8 = 3;
}

/// Prefix length, IPv4-mapped, of the blocks a service CIDR sets bits of:
/// an IPv4 /24, an IPv6 /120.
pub const BLOCK_PREFIX: u8 = 120;
/// The most blocks one service CIDR sets bits of (an IPv4 /8, an IPv6
/// /104); a wider one sets `WIDE_BIT` instead.
pub const MAX_BLOCKS: u64 = 1 << 16;
/// Set when some service CIDR is too wide for its blocks' bits: every
/// packet the prefilter passes then asks `SERVICE_CIDRS`. The bit of port
/// 0, which no NodePort has.
pub const WIDE_BIT: u32 = 0;

/// The bit of the block of 256 addresses `addr_be` (IPv4 mapped) is in.
#[inline(always)]
#[must_use]
pub const fn block_bit(addr_be: &[u32; 4]) -> u32 {
    let [w0, w1, w2, w3] = *addr_be;
    bit(
        &[w0, w1, w2, w3 & u32::from_be(0xffff_ff00)],
        0,
        0,
        side::BLOCK,
    )
}

/// The bit that says a frontend's address may be in `addr_be`'s block of
/// 256: set beside every key's `side::TO` bit (`to_bits`), so that a
/// packet to any other block is turned away without hashing its
/// destination key. The neighbour of the block's `block_bit`, in the same
/// word, so that one read answers both; a bit of its own, so that the
/// blocks of LoadBalancer IPs and node addresses, often in the nodes'
/// subnet, send no packet to `SERVICE_CIDRS`.
#[inline(always)]
#[must_use]
pub const fn frontends_bit(addr_be: &[u32; 4]) -> u32 {
    block_bit(addr_be) ^ 1
}

/// The bits a destination key needs set: its own (`side::TO`), and its
/// block's `frontends_bit`, without which the datapath never reads it.
#[inline(always)]
#[must_use]
pub const fn to_bits(addr_be: &[u32; 4], port_be: u16, proto: u8) -> [u32; 2] {
    [
        bit(addr_be, port_be, proto, side::TO),
        frontends_bit(addr_be),
    ]
}

/// What the prefilter read of a packet's destination block, carried to
/// the service CIDRs' question, which would otherwise read it again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    /// Its `block_bit` is set: it may be for a service CIDR.
    Cidr,
    /// Its `block_bit` is clear (only `WIDE_BIT` can still say maybe).
    NoCidr,
    /// Not read.
    Unread,
}

/// The prefilter's question of a packet (addresses IPv4 mapped, ports as
/// on the wire), over the array's words as `word` reads them (`None`, for
/// a word it cannot read, taken as every bit set). `None` when it may be
/// ours; when it is not, what its destination's block said of the service
/// CIDRs.
///
/// The destination's block word first: it gates the hashed destination
/// key, and its service CIDR bit is wanted anyway whenever the answer is
/// no. Then the source key, then the NodePort bit. A packet for no
/// Service pays two hashes and three reads.
#[inline(always)]
#[must_use]
pub fn turned_away(
    word: impl Fn(u32) -> Option<u64>,
    dst_be: &[u32; 4],
    dport_be: u16,
    src_be: &[u32; 4],
    sport_be: u16,
    proto: u8,
) -> Option<Block> {
    let block = unkeyed_destination(&word, dst_be, dport_be, proto)?;
    if holds(&word, bit(src_be, sport_be, proto, side::FROM)) || holds(&word, port_bit(dport_be)) {
        return None;
    }
    Some(block)
}

/// `Some`, with what its destination's block said, when no frontend may
/// have a packet's destination: neither its key's bit nor its port's (a
/// NodePort's) is set. Asked where conntrack knows no flow of a packet
/// the prefilter passed, before the frontend lookups, which it answers for
/// where the packet passed for its source alone (a backend pod's reply to
/// a client that reached it by its pod IP). What `turned_away` found of the
/// destination is asked again rather than carried through the conntrack
/// path, where one more value the verifier tracks multiplies the states it
/// walks (docs/architecture.md, "The prefilter").
#[inline(always)]
#[must_use]
pub fn for_no_frontend(
    word: impl Fn(u32) -> Option<u64>,
    dst_be: &[u32; 4],
    dport_be: u16,
    proto: u8,
) -> Option<Block> {
    let block = unkeyed_destination(&word, dst_be, dport_be, proto)?;
    if holds(&word, port_bit(dport_be)) {
        return None;
    }
    Some(block)
}

/// `Some`, with what its block said of the service CIDRs, when the
/// destination's own key has no bit set: its block's word first, whose
/// frontends bit gates the hashed key.
#[inline(always)]
fn unkeyed_destination(
    word: &impl Fn(u32) -> Option<u64>,
    dst_be: &[u32; 4],
    dport_be: u16,
    proto: u8,
) -> Option<Block> {
    let block = block_bit(dst_be);
    let (w, cidr) = word_and_mask(block);
    let block_word = word(w)?;
    // `frontends_bit(dst_be)`, without hashing the block again.
    let (_, frontends) = word_and_mask(block ^ 1);
    if block_word & frontends != 0 && holds(word, bit(dst_be, dport_be, proto, side::TO)) {
        return None;
    }
    Some(if block_word & cidr != 0 {
        Block::Cidr
    } else {
        Block::NoCidr
    })
}

/// Whether `bit` is set, a word that cannot be read taken as all set.
#[inline(always)]
fn holds(word: &impl Fn(u32) -> Option<u64>, bit: u32) -> bool {
    let (w, mask) = word_and_mask(bit);
    word(w).is_none_or(|w| w & mask != 0)
}

/// The bit of the key (`addr_be` as `ServiceKey` and `Backend` hold
/// addresses, IPv4 mapped; port and protocol as on the wire). An IPv4
/// key's first two words are zero and its third constant, so over IPv4
/// this is one multiplication: the key folded onto itself, so that every
/// bit of it reaches the high bits of the product, which are the hash.
#[inline(always)]
#[must_use]
pub const fn bit(addr_be: &[u32; 4], port_be: u16, proto: u8, side: u8) -> u32 {
    const K0: u64 = 0x9e37_79b9_7f4a_7c15;
    const K1: u64 = 0xc2b2_ae3d_27d4_eb4f;
    let [w0, w1, w2, w3] = *addr_be;
    let high = ((w0 as u64) | ((w1 as u64) << 32)).wrapping_mul(K0);
    let mut x = high
        ^ ((w2 as u64) | ((w3 as u64) << 32))
        ^ ((port_be as u64) << 8)
        ^ (proto as u64)
        ^ ((side as u64) << 24);
    x ^= x >> 32;
    PORTS + (x.wrapping_mul(K1) >> (64 - HASHED_LOG2)) as u32
}

/// The bit of a NodePort's port number (`port_be` as on the wire).
#[inline(always)]
#[must_use]
pub const fn port_bit(port_be: u16) -> u32 {
    port_be as u32
}

/// The word of the array `bit` is in, and its mask there.
#[inline(always)]
#[must_use]
pub const fn word_and_mask(bit: u32) -> (u32, u64) {
    (bit >> 6, 1 << (bit & 63))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v4_mapped;

    #[test]
    fn every_bit_is_in_the_array() {
        for addr in [[0; 4], [u32::MAX; 4], v4_mapped(0x0a60_000a)] {
            for port in [0, 53, u16::MAX] {
                let b = bit(&addr, port, 6, side::TO);
                assert!(b < BITS, "bit {b} of {addr:?}:{port} is past the array");
                assert!(word_and_mask(b).0 < WORDS);
            }
        }
    }

    #[test]
    fn the_two_sides_and_protocols_of_one_address_and_port_differ() {
        let addr = v4_mapped(u32::from_ne_bytes([10, 96, 0, 10]));
        assert_ne!(
            bit(&addr, 53u16.to_be(), 17, side::TO),
            bit(&addr, 53u16.to_be(), 17, side::FROM)
        );
        assert_ne!(
            bit(&addr, 53u16.to_be(), 17, side::TO),
            bit(&addr, 53u16.to_be(), 6, side::TO)
        );
    }

    /// A pod network's addresses and ports spread over the hashed bits as
    /// random keys would: the fill of 100,000 keys, IPv4 and IPv6, is within
    /// 1% of a random function's, whose false positive rate the sizing
    /// above counts on.
    #[test]
    fn a_subnets_keys_fill_the_array_as_random_keys_would() {
        let v4 =
            |host: u32| v4_mapped(u32::from_be_bytes([10, 244, (host >> 8) as u8, host as u8]));
        let v6 = |host: u32| {
            [
                u32::from_be(0xfd00_0010),
                0,
                u32::from_be(0x0244),
                u32::from_be(host),
            ]
        };
        for (family, addr_of) in [("IPv4", &v4 as &dyn Fn(u32) -> [u32; 4]), ("IPv6", &v6)] {
            let mut words = vec![0u64; WORDS as usize];
            let mut keys = 0u32;
            for host in 0..10_000u32 {
                let addr = addr_of(host);
                for port in [80u16, 443, 8080, 8443, 53, 9090, 3000, 5432, 6379, 27017] {
                    let (w, m) = word_and_mask(bit(&addr, port.to_be(), 6, side::FROM));
                    assert!(w >= PORTS / 64, "a hashed bit among the ports' bits");
                    words[w as usize] |= m;
                    keys += 1;
                }
            }
            let set: u32 = words.iter().map(|w| w.count_ones()).sum();
            let hashed = f64::from(BITS - PORTS);
            let expected = hashed * (1.0 - (-f64::from(keys) / hashed).exp());
            let off = (f64::from(set) - expected).abs() / expected;
            assert!(
                off < 0.01,
                "{family}: {keys} keys set {set} bits, a random function about {expected:.0} ({:.2}% off)",
                off * 100.0
            );
        }
    }

    /// A block's two bits share one word, so that the datapath reads it
    /// once, and are two bits, so that a frontend's block does not send
    /// packets to the service CIDRs' trie.
    #[test]
    fn a_blocks_frontends_bit_is_its_cidr_bits_neighbour_in_one_word() {
        for addr in [[0; 4], [u32::MAX; 4], v4_mapped(0x0a60_000a)] {
            let (block, frontends) = (block_bit(&addr), frontends_bit(&addr));
            assert_ne!(block, frontends, "{addr:?}: one bit for both");
            assert_eq!(
                word_and_mask(block).0,
                word_and_mask(frontends).0,
                "{addr:?}: bits {block} and {frontends} in two words"
            );
            assert!(frontends >= PORTS, "{addr:?}: a port's bit");
        }
        let addr = v4_mapped(u32::from_ne_bytes([10, 96, 0, 10]));
        let other = v4_mapped(u32::from_ne_bytes([10, 96, 0, 200]));
        assert_eq!(
            frontends_bit(&addr),
            frontends_bit(&other),
            "two addresses of one /24"
        );
        assert_eq!(
            to_bits(&addr, 80u16.to_be(), 6),
            [bit(&addr, 80u16.to_be(), 6, side::TO), frontends_bit(&addr)]
        );
    }

    /// An array of `bits` set, read as the datapath reads it.
    fn array(bits: &[u32]) -> Vec<u64> {
        let mut words = vec![0u64; WORDS as usize];
        for &b in bits {
            let (w, m) = word_and_mask(b);
            words[w as usize] |= m;
        }
        words
    }

    fn ask(words: &[u64], dst: [u32; 4], dport: u16, src: [u32; 4], sport: u16) -> Option<Block> {
        turned_away(
            |w| words.get(w as usize).copied(),
            &dst,
            dport.to_be(),
            &src,
            sport.to_be(),
            6,
        )
    }

    /// Each of the three keys alone lets a packet through; the destination
    /// key only with its block's `frontends_bit`, which `to_bits` sets
    /// with it; a packet none of them has is turned away with what its
    /// block said of the service CIDRs.
    #[test]
    fn a_packet_is_turned_away_only_when_none_of_its_keys_is_set() {
        let ip = |a: u8, b: u8, c: u8, d: u8| v4_mapped(u32::from_ne_bytes([a, b, c, d]));
        let (cluster_ip, backend, client) =
            (ip(10, 96, 0, 10), ip(10, 244, 1, 5), ip(10, 244, 2, 7));
        let frontend = to_bits(&cluster_ip, 80u16.to_be(), 6);
        let words = array(&frontend);
        assert_eq!(
            ask(&words, cluster_ip, 80, client, 40_000),
            None,
            "to the frontend"
        );
        assert_eq!(
            ask(&words, cluster_ip, 81, client, 40_000),
            Some(Block::NoCidr),
            "to another port of its address"
        );
        let without_gate = array(&frontend[..1]);
        assert_eq!(
            ask(&without_gate, cluster_ip, 80, client, 40_000),
            Some(Block::NoCidr),
            "a destination key was read without its block's frontends bit"
        );
        let words = array(&[bit(&backend, 8080u16.to_be(), 6, side::FROM)]);
        assert_eq!(
            ask(&words, client, 40_000, backend, 8080),
            None,
            "a backend's reply"
        );
        assert_eq!(
            ask(&words, backend, 8080, client, 40_000),
            Some(Block::NoCidr),
            "to the backend"
        );
        let words = array(&[port_bit(30080u16.to_be())]);
        assert_eq!(
            ask(&words, backend, 30080, client, 40_000),
            None,
            "to a NodePort"
        );
        let words = array(&[block_bit(&cluster_ip)]);
        assert_eq!(
            ask(&words, ip(10, 96, 0, 99), 80, client, 40_000),
            Some(Block::Cidr),
            "to the service CIDR's block"
        );
        assert_eq!(
            ask(&words, backend, 80, client, 40_000),
            Some(Block::NoCidr)
        );
        assert_eq!(
            turned_away(|_| None, &backend, 80, &client, 40_000, 6),
            None,
            "an unreadable array turned a packet away"
        );
    }

    #[test]
    fn each_port_has_its_own_bit_before_the_hashed_ones() {
        assert_eq!(port_bit(0), 0);
        assert_eq!(port_bit(u16::MAX), PORTS - 1);
        assert!(bit(&[0; 4], 0, 0, 0) >= PORTS);
    }
}
