//! The prefilter: bit arrays that tell the datapath, before any hash map
//! lookup, that a packet is for no Service and the reply of no translated
//! flow, so that it leaves untouched at the cost of a few array reads
//! (docs/architecture.md, "The prefilter").
//!
//! A packet may be ours only when one of its keys is marked:
//!
//! - its destination (`side::TO`): a frontend's address and port, read
//!   only where its destination's block may hold a frontend
//!   (`frontends_bit`);
//! - its destination port (`port_bit`), where a NodePort has that port,
//!   read only where its destination's block may hold an address of this
//!   node that serves NodePorts (`nodeports_bit`);
//! - its whole tuple, in the flows' array (`flows`): the key of a flow's
//!   reply entry, which the datapath marks as it inserts the flow, so that
//!   the replies of translated flows pass and nothing else a backend sends
//!   does.
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
//! have made anyway, never a wrong answer. From its load until its
//! programs are attached the agent also keeps each backend's `side::FROM`
//! bit, which the datapath no longer reads: the programs of an earlier
//! agent on the same pins, during an upgrade, do.

/// The array's first `PORTS` bits are one per port number (as on the
/// wire): a NodePort sets its port's, since a NodePort may be served on any
/// of the node's addresses, which only a hash map lookup could list.
pub const PORTS: u32 = 1 << 16;
/// Then 2^`HASHED_LOG2` bits of hashed keys: 1 MiB. At 100,000 Services x
/// 10 endpoints, both families, 2.4% of them are set (13.9% with the
/// backends' `side::FROM` bits an agent keeps until its programs are
/// attached), and a packet between two pods reads a destination key only
/// where its block's `frontends_bit` is set by chance: the array passes
/// 0.057% of such packets by chance (1.85% with those bits; the datapath
/// bench samples both).
pub const HASHED_LOG2: u32 = 23;
/// Bits in the array.
pub const BITS: u32 = PORTS + (1 << HASHED_LOG2);
/// 64-bit words in the array: the map's entries.
pub const WORDS: u32 = BITS / 64;

/// Which end of a packet a key names.
pub mod side {
    /// Its destination: a frontend.
    pub const TO: u8 = 1;
    /// Its source: a backend answering. Read only by the programs of
    /// earlier agents (see the module's doc).
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
/// IPv6 packet the prefilter turns away then asks `SERVICE_CIDRS`. IPv4's
/// programs do not read it: the agent sets the bits of every IPv4 block
/// of a range however many they are (2^24 at most), so that an IPv4 packet
/// for no Service reads one word fewer. The bit of port 0, which no
/// NodePort has.
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

/// The bit that says an address of this node that serves NodePorts (a
/// `NODE_ADDRS` entry with `node_addr_flags::NODEPORT`) may be in
/// `addr_be`'s block of 256, without which the datapath never reads a
/// NodePort's port bit for a packet to it: so that the packets to every
/// other block, most of a node's that are for no Service, skip that read.
/// Set before the entry lands, as a frontend's bits are. In the word of
/// the block's `block_bit` and `frontends_bit`, read anyway; a bit of its
/// own, so that a packet to a node address reads the port's bit and not a
/// hashed destination key as well. Another block's bits or a key's may
/// share its place: each only ever sends a packet the longer way.
#[inline(always)]
#[must_use]
pub const fn nodeports_bit(addr_be: &[u32; 4]) -> u32 {
    block_bit(addr_be) ^ 2
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
/// `marked` says whether a slot of the flows' array (`flows::slot`) is
/// marked, a slot it cannot read taken as marked.
///
/// The destination's block word first: it gates the hashed destination
/// key and the NodePort bit, and its service CIDR bit is wanted anyway
/// whenever the answer is no. Then the packet's own tuple in the flows'
/// array. A packet for no Service, to a block that holds no frontend and
/// no NodePort address, pays two hashes and two reads.
#[inline(always)]
#[must_use]
pub fn turned_away(
    word: impl Fn(u32) -> Option<u64>,
    marked: impl Fn(u32) -> bool,
    dst_be: &[u32; 4],
    dport_be: u16,
    src_be: &[u32; 4],
    sport_be: u16,
    proto: u8,
) -> Option<Block> {
    let block = unkeyed_destination(&word, dst_be, dport_be, proto)?;
    if marked(flows::slot(src_be, sport_be, dst_be, dport_be, proto)) {
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
    unkeyed_destination(&word, dst_be, dport_be, proto)
}

/// `Some`, with what its block said of the service CIDRs, when neither
/// the destination's own key nor its port's (a NodePort's) has its bit
/// set: its block's word first, whose frontends bit gates both.
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
    // `frontends_bit(dst_be)` and `nodeports_bit(dst_be)`, without hashing
    // the block again.
    let (_, frontends) = word_and_mask(block ^ 1);
    let (_, nodeports) = word_and_mask(block ^ 2);
    if (block_word & frontends != 0 && holds(word, bit(dst_be, dport_be, proto, side::TO)))
        || (block_word & nodeports != 0 && holds(word, port_bit(dport_be)))
    {
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

/// The flows' array (`map_names::PREFILTER_FLOWS`): one byte per slot, a
/// slot per hashed tuple, marked for the key of every flow's reply entry.
/// The datapath marks a slot by storing `BOTH` into its byte, after it
/// inserts the flow's entries and before the flow's first packet leaves,
/// so before any reply can come; a plain store, which the agent's atomic
/// operations on the byte's word neither lose nor are lost to.
///
/// Each byte holds two marks, one per half of the array (bits 0 and 1).
/// A slot is marked when either is. The agent clears marks one half at a
/// time (`half_mask`): it clears that half's bit in every byte, then reads
/// conntrack and marks that half for every reply entry in it. A flow the
/// datapath marked before the clear was inserted before it, so the read
/// finds it; one marked after the clear kept its mark. So the cleared half
/// ends the refresh holding every live flow, and the other half, untouched
/// meanwhile, answers for them while it refills: no live flow's replies
/// are ever turned away.
pub mod flows {
    /// Slots: 4 MiB. 200,000 reply keys (up to one rebuild's worth of
    /// closed flows beside the live ones) mark one slot in twenty.
    pub const SLOTS_LOG2: u32 = 22;
    /// Slots in the array.
    pub const SLOTS: u32 = 1 << SLOTS_LOG2;
    /// 64-bit words in the array: the map's entries.
    pub const WORDS: u32 = SLOTS / 8;
    /// A marked slot's byte as the datapath writes it: both halves.
    pub const BOTH: u8 = 0b11;

    /// The bit of half `half` (0 or 1) in every byte of a word.
    #[inline(always)]
    #[must_use]
    pub const fn half_mask(half: u32) -> u64 {
        0x0101_0101_0101_0101 << half
    }

    /// The word `slot` is in, and its byte's shift there.
    #[inline(always)]
    #[must_use]
    pub const fn word_and_shift(slot: u32) -> (u32, u32) {
        (slot >> 3, (slot & 7) * 8)
    }

    /// The slot of the tuple (addresses as `ServiceKey` holds them, IPv4
    /// mapped; ports and protocol as on the wire). Over IPv4 each address
    /// folds with no multiplication (its first two words are zero), and
    /// the tuple takes two.
    #[inline(always)]
    #[must_use]
    pub const fn slot(
        src_be: &[u32; 4],
        sport_be: u16,
        dst_be: &[u32; 4],
        dport_be: u16,
        proto: u8,
    ) -> u32 {
        const K0: u64 = 0x9e37_79b9_7f4a_7c15;
        const K1: u64 = 0xc2b2_ae3d_27d4_eb4f;
        let ends = (sport_be as u64) | ((dport_be as u64) << 16) | ((proto as u64) << 32);
        let mut x = (fold(src_be) ^ ends).wrapping_mul(K0);
        x ^= x >> 29;
        x ^= fold(dst_be);
        x ^= x >> 32;
        (x.wrapping_mul(K1) >> (64 - SLOTS_LOG2)) as u32
    }

    /// An address as one word: its high half multiplied in, which the
    /// compiler drops for an IPv4 address's zero words.
    #[inline(always)]
    const fn fold(addr_be: &[u32; 4]) -> u64 {
        const K: u64 = 0xff51_afd7_ed55_8ccd;
        let [w0, w1, w2, w3] = *addr_be;
        ((w0 as u64) | ((w1 as u64) << 32)).wrapping_mul(K) ^ ((w2 as u64) | ((w3 as u64) << 32))
    }
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
            let block = block_bit(&addr);
            for (name, other) in [
                ("frontends", frontends_bit(&addr)),
                ("NodePorts", nodeports_bit(&addr)),
            ] {
                assert_ne!(block, other, "{addr:?}: one bit for the CIDRs' and {name}'");
                assert_eq!(
                    word_and_mask(block).0,
                    word_and_mask(other).0,
                    "{addr:?}: the CIDRs' bit {block} and {name}' {other} in two words"
                );
                assert!(other >= PORTS, "{addr:?}: {name}' bit is a port's");
            }
            assert_ne!(frontends_bit(&addr), nodeports_bit(&addr));
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
        ask_marked(words, &[], dst, dport, src, sport)
    }

    /// `ask` with the flows' array's `marked` slots.
    fn ask_marked(
        words: &[u64],
        marked: &[u32],
        dst: [u32; 4],
        dport: u16,
        src: [u32; 4],
        sport: u16,
    ) -> Option<Block> {
        turned_away(
            |w| words.get(w as usize).copied(),
            |slot| marked.contains(&slot),
            &dst,
            dport.to_be(),
            &src,
            sport.to_be(),
            6,
        )
    }

    /// Each of the three keys alone lets a packet through; the destination
    /// key only with its block's `frontends_bit`, which `to_bits` sets
    /// with it, and the port's only with its block's `nodeports_bit`, set
    /// for an address that serves NodePorts; a packet none of them
    /// has is turned away with what its block said of the service CIDRs.
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
        let reply = flows::slot(&backend, 8080u16.to_be(), &client, 40_000u16.to_be(), 6);
        let none = array(&[]);
        assert_eq!(
            ask_marked(&none, &[reply], client, 40_000, backend, 8080),
            None,
            "a translated flow's reply"
        );
        assert_eq!(
            ask_marked(&none, &[reply], backend, 8080, client, 40_000),
            Some(Block::NoCidr),
            "the flow's packet to the backend, its reply's tuple reversed"
        );
        assert_eq!(
            ask_marked(&none, &[reply], client, 40_001, backend, 8080),
            Some(Block::NoCidr),
            "the backend's packet to another port of the client"
        );
        let words = array(&[bit(&backend, 8080u16.to_be(), 6, side::FROM)]);
        assert_eq!(
            ask(&words, client, 40_000, backend, 8080),
            Some(Block::NoCidr),
            "a backend's packet of no flow, passed for the backend's bit"
        );
        let node = ip(192, 168, 1, 5);
        let words = array(&[port_bit(30080u16.to_be()), nodeports_bit(&node)]);
        assert_eq!(
            ask(&words, node, 30080, client, 40_000),
            None,
            "to a NodePort on an address that serves NodePorts"
        );
        assert_eq!(
            ask(&words, backend, 30080, client, 40_000),
            Some(Block::NoCidr),
            "a NodePort's port was read for a block with no NodePort address"
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
            turned_away(|_| None, |_| false, &backend, 80, &client, 40_000, 6),
            None,
            "an unreadable array turned a packet away"
        );
    }

    /// Flows between a subnet's clients and a subnet's backends mark the
    /// flows' array as random tuples would: the fill of 200,000 reply keys,
    /// IPv4 and IPv6, within 1% of a random function's.
    #[test]
    fn a_subnets_flows_fill_the_flows_array_as_random_tuples_would() {
        let v4 = |net: u8, host: u32| {
            v4_mapped(u32::from_be_bytes([10, net, (host >> 8) as u8, host as u8]))
        };
        let v6 = |net: u8, host: u32| {
            [
                u32::from_be(0xfd00_0010),
                0,
                u32::from_be(u32::from(net)),
                u32::from_be(host),
            ]
        };
        for (family, addr_of) in [("IPv4", &v4 as &dyn Fn(u8, u32) -> [u32; 4]), ("IPv6", &v6)] {
            let mut marked = vec![false; flows::SLOTS as usize];
            let mut keys = 0u32;
            for backend in 0..1_000u32 {
                for client in 0..20u32 {
                    for sport in [80u16, 8080] {
                        let dport = 32_768 + ((backend * 7 + client * 13) % 28_000) as u16;
                        let slot = flows::slot(
                            &addr_of(244, backend),
                            sport.to_be(),
                            &addr_of(245, client),
                            dport.to_be(),
                            6,
                        );
                        assert!(slot < flows::SLOTS, "slot {slot} past the array");
                        marked[slot as usize] = true;
                        keys += 1;
                    }
                }
            }
            for client_port in 32_768..(32_768 + 160_000u32 / 4) {
                let slot = flows::slot(
                    &addr_of(244, 7),
                    80u16.to_be(),
                    &addr_of(245, 1),
                    (client_port as u16).to_be(),
                    17,
                );
                marked[slot as usize] = true;
                keys += 1;
            }
            let set = marked.iter().filter(|m| **m).count() as f64;
            let slots = f64::from(flows::SLOTS);
            let expected = slots * (1.0 - (-f64::from(keys) / slots).exp());
            let off = (set - expected).abs() / expected;
            assert!(
                off < 0.01,
                "{family}: {keys} tuples marked {set} slots, a random function about {expected:.0} ({:.2}% off)",
                off * 100.0
            );
        }
    }

    /// A slot's byte holds one mark per half, and the halves' masks
    /// cover each byte's two marks between them, nothing else.
    #[test]
    fn each_half_has_one_bit_of_every_byte() {
        assert_eq!(flows::half_mask(0) & flows::half_mask(1), 0);
        for shift in (0..64).step_by(8) {
            let byte = u64::from(flows::BOTH) << shift;
            assert_eq!(
                byte & (flows::half_mask(0) | flows::half_mask(1)),
                byte,
                "byte at {shift}"
            );
            assert_eq!((byte & flows::half_mask(0)).count_ones(), 1);
        }
        assert_eq!(
            flows::word_and_shift(flows::SLOTS - 1),
            (flows::WORDS - 1, 56)
        );
    }

    #[test]
    fn each_port_has_its_own_bit_before_the_hashed_ones() {
        assert_eq!(port_bit(0), 0);
        assert_eq!(port_bit(u16::MAX), PORTS - 1);
        assert!(bit(&[0; 4], 0, 0, 0) >= PORTS);
    }
}
