//! Maglev's hashes, shared by the datapath (which hashes a new flow to a
//! slot of its frontend's table) and the agent (which places each backend in
//! the table): the same words and the same seed on every node give the same
//! slot and the same table, so a flow keeps its backend whichever node sees
//! it and after an agent restart. Nothing node-local goes in: neither the
//! destination address (a NodePort's differs per node) nor a backend id.

/// The default `--maglev-table-size`: a prime, so that every backend's skip
/// visits every slot; 100 times 163 backends, the most it keeps within 1%
/// of an even share.
pub const DEFAULT_TABLE_SIZE: u32 = 16_381;

/// The default `--maglev-hash-seed`. Any value works as long as every node
/// has the same one; this one is fixed so that nodes configured alike agree.
pub const DEFAULT_HASH_SEED: u32 = 0x6d61_676c;

/// Bob Jenkins' lookup3 mix, as the kernel's `jhash.h`.
#[inline(always)]
fn mix(a: &mut u32, b: &mut u32, c: &mut u32) {
    *a = a.wrapping_sub(*c);
    *a ^= c.rotate_left(4);
    *c = c.wrapping_add(*b);
    *b = b.wrapping_sub(*a);
    *b ^= a.rotate_left(6);
    *a = a.wrapping_add(*c);
    *c = c.wrapping_sub(*b);
    *c ^= b.rotate_left(8);
    *b = b.wrapping_add(*a);
    *a = a.wrapping_sub(*c);
    *a ^= c.rotate_left(16);
    *c = c.wrapping_add(*b);
    *b = b.wrapping_sub(*a);
    *b ^= a.rotate_left(19);
    *a = a.wrapping_add(*c);
    *c = c.wrapping_sub(*b);
    *c ^= b.rotate_left(4);
    *b = b.wrapping_add(*a);
}

#[inline(always)]
fn final_mix(a: &mut u32, b: &mut u32, c: &mut u32) {
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(14));
    *a ^= *c;
    *a = a.wrapping_sub(c.rotate_left(11));
    *b ^= *a;
    *b = b.wrapping_sub(a.rotate_left(25));
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(16));
    *a ^= *c;
    *a = a.wrapping_sub(c.rotate_left(4));
    *b ^= *a;
    *b = b.wrapping_sub(a.rotate_left(14));
    *c ^= *b;
    *c = c.wrapping_sub(b.rotate_left(24));
}

/// The kernel's `jhash2` of six words: straight-line code, a hundred or so
/// BPF instructions.
#[inline(always)]
fn jhash6(k: [u32; 6], seed: u32) -> u32 {
    let init = 0xdead_beef_u32.wrapping_add(6 << 2).wrapping_add(seed);
    let (mut a, mut b, mut c) = (init, init, init);
    a = a.wrapping_add(k[0]);
    b = b.wrapping_add(k[1]);
    c = c.wrapping_add(k[2]);
    mix(&mut a, &mut b, &mut c);
    a = a.wrapping_add(k[3]);
    b = b.wrapping_add(k[4]);
    c = c.wrapping_add(k[5]);
    final_mix(&mut a, &mut b, &mut c);
    c
}

/// The hash of a new flow from `src_be` (IPv4-mapped for IPv4, as keys hold
/// it) port `sport_be` to a frontend's port `dport_be` over `proto`: the
/// flow's slot in a table of `m` entries is this modulo `m`.
#[inline(always)]
pub fn flow_hash(src_be: [u32; 4], sport_be: u16, dport_be: u16, proto: u8, seed: u32) -> u32 {
    let ports = (u32::from(sport_be) << 16) | u32::from(dport_be);
    jhash6(
        [
            src_be[0],
            src_be[1],
            src_be[2],
            src_be[3],
            ports,
            u32::from(proto),
        ],
        seed,
    )
}

/// A backend's place in the table, from its address (IPv4-mapped), port and
/// protocol, never its id: its first preferred slot (`offset`) and the step
/// between its next ones (`skip`), each below `m` (a prime above 1), `skip`
/// never 0.
#[inline(always)]
pub fn permutation(addr_be: [u32; 4], port_be: u16, proto: u8, seed: u32, m: u32) -> (u32, u32) {
    let words = |salt: u32| {
        [
            addr_be[0],
            addr_be[1],
            addr_be[2],
            addr_be[3],
            (u32::from(port_be) << 16) | u32::from(proto),
            salt,
        ]
    };
    // Two hashes of the same name, told apart by the last word, as the
    // paper's h1 and h2.
    let offset = jhash6(words(0x6f66_6673), seed) % m;
    let skip = jhash6(words(0x736b_6970), seed) % (m - 1) + 1;
    (offset, skip)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_the_kernels_jhash2() {
        // jhash2({1, 2, 3, 4, 5, 6}, 6, 0) as the kernel computes it: the
        // lookup3 reference's hashword() of the same words and initval.
        assert_eq!(
            jhash6([1, 2, 3, 4, 5, 6], 0),
            hashword(&[1, 2, 3, 4, 5, 6], 0)
        );
        assert_ne!(
            flow_hash([0, 0, 0xffff_0000, 1], 1, 2, 6, 0),
            flow_hash([0, 0, 0xffff_0000, 1], 1, 2, 6, 1),
            "the seed changes the hash"
        );
    }

    /// lookup3's `hashword`, written from the reference as a loop, to check
    /// the unrolled form against.
    fn hashword(k: &[u32], initval: u32) -> u32 {
        let init = 0xdead_beef_u32
            .wrapping_add((k.len() as u32) << 2)
            .wrapping_add(initval);
        let (mut a, mut b, mut c) = (init, init, init);
        let mut rest = k;
        while rest.len() > 3 {
            a = a.wrapping_add(rest[0]);
            b = b.wrapping_add(rest[1]);
            c = c.wrapping_add(rest[2]);
            mix(&mut a, &mut b, &mut c);
            rest = &rest[3..];
        }
        if rest.len() == 3 {
            c = c.wrapping_add(rest[2]);
        }
        if rest.len() >= 2 {
            b = b.wrapping_add(rest[1]);
        }
        if !rest.is_empty() {
            a = a.wrapping_add(rest[0]);
            final_mix(&mut a, &mut b, &mut c);
        }
        c
    }

    #[test]
    fn a_permutation_stays_in_the_table() {
        for port in 0..2000u16 {
            let (offset, skip) = permutation([0, 0, 0xffff_0000, 7], port, 6, 3, 251);
            assert!(offset < 251, "offset {offset}");
            assert!((1..251).contains(&skip), "skip {skip}");
        }
    }
}
