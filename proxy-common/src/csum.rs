//! Internet checksum arithmetic for packets rewritten in place (RFC 1624),
//! shared by the kernel programs and the host tests that check it against
//! the kernel's own formulas. Words are summed as they sit in memory, so no
//! byte swapping is needed: the one's complement sum does not care.

/// Folds a sum of 16-bit or 32-bit words into 16 bits with end-around
/// carry. Exact for any sum below 2^47: three rounds bring that under
/// 0x10000 (the first to under 2^32, the second to under 0x20000); the
/// datapath's sums, a few dozen 32-bit words at most, stay under 2^40.
#[inline(always)]
pub fn fold(mut sum: u64) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// What the change of a 32-bit word from `old` to `new` adds to a
/// checksum's one's complement sum (RFC 1624 eqn. 3: ~m + m'), summed as
/// one 32-bit word rather than two 16-bit halves: 2^16 is 1 modulo 0xffff,
/// so a 32-bit word and the sum of its halves fold alike (`fold`), and
/// either sum is zero exactly when `old` is all ones and `new` zero. Two
/// operations a word where the halves took six. An unchanged word adds
/// 0xffffffff, zero in one's complement, so unchanged fields need no branch.
#[inline(always)]
pub fn delta32(old: u32, new: u32) -> u64 {
    u64::from(!old) + u64::from(new)
}

#[inline(always)]
pub fn delta16(old: u16, new: u16) -> u64 {
    u64::from(!old) + u64::from(new)
}

/// The checksum `csum` after changes summing to `delta`: HC' = ~(~HC + delta).
#[inline(always)]
pub fn apply(csum: u16, delta: u64) -> u16 {
    !fold(u64::from(!csum) + delta)
}

#[inline(always)]
pub fn replace16(csum: u16, old: u16, new: u16) -> u16 {
    apply(csum, delta16(old, new))
}

/// A socket buffer's checksum state, as far as a tc program can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkbCsum {
    /// `CHECKSUM_PARTIAL`: the field holds the pseudo-header sum and the
    /// device finishes it; only pseudo-header fields change it.
    Partial,
    /// Any other state: the field holds the full checksum.
    Full,
    /// Not told apart (see `state_after_pseudo`).
    Unknown,
}

/// Which formula `bpf_l4_csum_replace` applied when it added the
/// pseudo-header difference `delta` (folded) to an L4 checksum that went
/// from `before` to `after`. Programs cannot read `skb->ip_summed`, but the
/// helper's result shows it: a full checksum becomes ~(~before + delta), a
/// partial one before + delta. The two differ unless `delta` is zero in
/// one's complement, which is then `Unknown`; so is a UDP checksum of 0
/// ("none", which the helper leaves alone) and anything matching neither.
#[inline(always)]
pub fn state_after_pseudo(before: u16, delta: u32, after: u16, udp: bool) -> SkbCsum {
    let delta = fold(u64::from(delta));
    if delta == 0 || delta == 0xffff || (udp && before == 0) {
        return SkbCsum::Unknown;
    }
    // As the helper writes them for UDP, where 0 means "none".
    let mangle = |c: u16| if udp && c == 0 { 0xffff } else { c };
    let full = mangle(apply(before, u64::from(delta)));
    let partial = mangle(fold(u64::from(before) + u64::from(delta)));
    if after == full && after != partial {
        SkbCsum::Full
    } else if after == partial && after != full {
        SkbCsum::Partial
    } else {
        SkbCsum::Unknown
    }
}

/// A full L4 checksum `csum` after changes summing to `delta`, as the
/// kernel's helper with `BPF_F_MARK_MANGLED_0` (for UDP) writes it: a UDP
/// checksum of 0 ("none") stays 0, a computed 0 is sent as 0xffff.
#[inline(always)]
pub fn full_update(csum: u16, delta: u64, udp: bool) -> u16 {
    if udp && csum == 0 {
        return 0;
    }
    let new = apply(csum, delta);
    if udp && new == 0 { 0xffff } else { new }
}

/// A `CHECKSUM_PARTIAL` field (the pseudo-header sum, not complemented)
/// after pseudo-header changes summing to `delta`, exactly as
/// `bpf_l4_csum_replace` with `BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0`
/// (for UDP) writes it: a UDP field of 0 stays 0, a result of 0 is 0xffff.
#[inline(always)]
pub fn pseudo_partial(csum: u16, delta: u64, udp: bool) -> u16 {
    if udp && csum == 0 {
        return 0;
    }
    let new = fold(u64::from(csum) + delta);
    if udp && new == 0 { 0xffff } else { new }
}

#[cfg(test)]
mod tests {
    //! The kernel's side, transcribed from include/net/checksum.h and
    //! net/core/utils.c (`inet_proto_csum_replace_by_diff`) with
    //! `BPF_F_MARK_MANGLED_0` as `bpf_l4_csum_replace` applies it.
    use proptest::prelude::*;

    use super::*;

    fn k_csum_add(a: u32, b: u32) -> u32 {
        let (res, carry) = a.overflowing_add(b);
        res + u32::from(carry)
    }

    fn k_csum_fold(sum: u32) -> u16 {
        let sum = (sum & 0xffff) + (sum >> 16);
        let sum = (sum & 0xffff) + (sum >> 16);
        !(sum as u16)
    }

    /// `bpf_l4_csum_replace(skb, off, 0, diff, BPF_F_PSEUDO_HDR | mangle)`.
    fn kernel_pseudo(csum: u16, diff: u32, partial: bool, udp: bool) -> u16 {
        if udp && csum == 0 {
            return 0;
        }
        let new = if partial {
            !k_csum_fold(k_csum_add(u32::from(csum), diff))
        } else {
            k_csum_fold(k_csum_add(diff, !u32::from(csum)))
        };
        if udp && new == 0 { 0xffff } else { new }
    }

    /// The checksum of `words` (pseudo-header and segment, check field 0).
    fn checksum(words: &[u16]) -> u16 {
        !fold(words.iter().map(|w| u64::from(*w)).sum())
    }

    proptest! {
        /// The state told is never the wrong one.
        #[test]
        fn state_is_never_misread(
            before: u16, diff: u32, partial: bool, udp: bool,
        ) {
            let diff = u32::from(fold(u64::from(diff)));
            let after = kernel_pseudo(before, diff, partial, udp);
            let told = state_after_pseudo(before, diff, after, udp);
            let truth = if partial { SkbCsum::Partial } else { SkbCsum::Full };
            prop_assert!(
                told == truth || told == SkbCsum::Unknown,
                "before {before:#x} diff {diff:#x} after {after:#x}: told {told:?}, was {truth:?}"
            );
            // And it is told whenever it can be: the fallback (a second
            // helper call) is for a zero difference and UDP without
            // checksum only.
            let tellable = diff != 0 && diff != 0xffff && !(udp && before == 0);
            prop_assert!(
                !tellable || told == truth,
                "before {before:#x} diff {diff:#x} after {after:#x}: not told apart"
            );
        }

        /// The in-place updates tc makes once it has read the buffer's
        /// checksum state write what the kernel's helper would have
        /// written, for partial and full checksums, TCP and UDP (zero
        /// included), and sums of any size: bit for bit, except that a full
        /// TCP checksum may come out as 0x0000 where the helper writes
        /// 0xffff or the reverse (the same number in one's complement; only
        /// when the field was 0xffff and the change is nil).
        #[test]
        fn in_place_updates_equal_the_helper(
            before: u16, words in prop::collection::vec(any::<u16>(), 1..8), udp: bool,
        ) {
            let delta: u64 = words.iter().map(|w| u64::from(*w)).sum();
            let diff = u32::from(fold(delta));
            let helper = kernel_pseudo(before, diff, true, udp);
            let ours = pseudo_partial(before, delta, udp);
            prop_assert_eq!(ours, helper, "partial, before {:#x} delta {:#x}", before, delta);
            let helper = kernel_pseudo(before, diff, false, udp);
            let ours = full_update(before, delta, udp);
            prop_assert!(
                ours == helper || !udp && (ours | helper) == 0xffff && (ours & helper) == 0,
                "full, before {:#x} delta {:#x}: ours {:#x}, helper {:#x}", before, delta, ours, helper
            );
        }

        /// A full checksum rewritten as tc does it (addresses through the
        /// kernel's helper, ports in place once the state is told) equals
        /// the checksum computed afresh over the rewritten packet; a partial
        /// one equals the new pseudo-header sum and ignores the ports.
        #[test]
        fn tc_rewrite_matches_a_fresh_checksum(
            addrs in prop::array::uniform4(any::<u16>()),
            new_addrs in prop::array::uniform4(any::<u16>()),
            ports in prop::array::uniform2(any::<u16>()),
            new_ports in prop::array::uniform2(any::<u16>()),
            rest in prop::collection::vec(any::<u16>(), 1..16),
            partial: bool,
        ) {
            // Pseudo-header: addresses, protocol (TCP), length.
            let len = (20 + rest.len() * 2) as u16;
            let packet = |a: [u16; 4], p: [u16; 2]| {
                let mut w = a.to_vec();
                w.extend([6u16.to_be(), len.to_be()]);
                w.extend(p);
                w.extend(&rest);
                w
            };
            let pseudo_sum = |a: [u16; 4]| fold(a.iter().map(|w| u64::from(*w)).sum::<u64>()
                + u64::from(6u16.to_be()) + u64::from(len.to_be()));
            let before = if partial { pseudo_sum(addrs) } else { checksum(&packet(addrs, ports)) };
            let d_addrs = u32::from(fold((0..4).map(|i| delta16(addrs[i], new_addrs[i])).sum()));
            let d_ports = u32::from(fold((0..2).map(|i| delta16(ports[i], new_ports[i])).sum()));
            let mut csum = kernel_pseudo(before, d_addrs, partial, false);
            match state_after_pseudo(before, d_addrs, csum, false) {
                SkbCsum::Full => csum = full_update(csum, u64::from(d_ports), false),
                SkbCsum::Partial => {}
                SkbCsum::Unknown => {
                    // The helper again, without the pseudo-header flag.
                    if !partial {
                        csum = k_csum_fold(k_csum_add(d_ports, !u32::from(csum)));
                    }
                }
            }
            let want = if partial { pseudo_sum(new_addrs) } else { checksum(&packet(new_addrs, new_ports)) };
            // 0 and 0xffff are the same number in one's complement.
            prop_assert!(
                csum == want || (csum | want) == 0xffff && (csum & want) == 0,
                "partial {partial}: got {csum:#x}, want {want:#x}"
            );
        }

        /// `fold` is exact below 2^47: the residue modulo 0xffff kept, and
        /// zero only for a zero sum.
        #[test]
        fn fold_is_exact_below_2_47(sum in prop_oneof![0u64..(1 << 47), Just((1 << 47) - 1)]) {
            let folded = u64::from(fold(sum));
            prop_assert_eq!(folded % 0xffff, sum % 0xffff, "sum {:#x}", sum);
            prop_assert_eq!(folded == 0, sum == 0, "sum {:#x}", sum);
        }

        /// A change summed a 32-bit word at a time (`delta32`) folds to
        /// exactly what RFC 1624's 16-bit halves fold to, and so does any
        /// checksum applied over it, for as many words as the datapath ever
        /// sums (an ICMP error's quote of two IPv6 addresses and the error's
        /// own two: 16 words), all-ones and zero words included.
        #[test]
        fn word_deltas_fold_as_their_halves(
            pairs in prop::collection::vec(
                (prop_oneof![Just(0u32), Just(u32::MAX), any::<u32>()],
                 prop_oneof![Just(0u32), Just(u32::MAX), any::<u32>()]),
                1..=16,
            ),
            csum: u16,
        ) {
            let halves = |w: u32| u64::from(w >> 16) + u64::from(w & 0xffff);
            let by_halves: u64 = pairs.iter().map(|&(old, new)| halves(!old) + halves(new)).sum();
            let by_words: u64 = pairs.iter().map(|&(old, new)| delta32(old, new)).sum();
            prop_assert_eq!(fold(by_words), fold(by_halves), "pairs {:x?}", pairs);
            prop_assert_eq!(apply(csum, by_words), apply(csum, by_halves), "pairs {:x?}", pairs);
        }

        /// IPv6 has no header checksum: a full transport checksum updated
        /// in place for a change of addresses (in the IPv6 header) and ports
        /// changes the packet's one's complement sum by exactly nothing, so
        /// a `CHECKSUM_COMPLETE` `skb->csum` over it still holds without the
        /// kernel's helper (proxy-ebpf's `nat6`). A UDP checksum of 0 ("none",
        /// which IPv6 forbids) is left as it is, and is no such balance.
        #[test]
        fn an_ipv6_in_place_update_keeps_the_packet_sum(
            addrs in prop::array::uniform16(any::<u16>()),
            new_addrs in prop::array::uniform16(any::<u16>()),
            ports in prop::array::uniform2(any::<u16>()),
            new_ports in prop::array::uniform2(any::<u16>()),
            csum: u16,
            udp: bool,
        ) {
            prop_assume!(!(udp && csum == 0));
            let delta: u64 = (0..16).map(|i| delta16(addrs[i], new_addrs[i])).sum::<u64>()
                + (0..2).map(|i| delta16(ports[i], new_ports[i])).sum::<u64>();
            let new_csum = full_update(csum, delta, udp);
            let sum = |a: &[u16; 16], p: &[u16; 2], c: u16| {
                fold(a.iter().chain(p).map(|w| u64::from(*w)).sum::<u64>() + u64::from(c))
            };
            let (before, after) = (sum(&addrs, &ports, csum), sum(&new_addrs, &new_ports, new_csum));
            // 0 and 0xffff are the same number in one's complement.
            prop_assert!(
                before == after || (before | after) == 0xffff && (before & after) == 0,
                "the packet's sum went from {before:#x} to {after:#x}"
            );
        }
    }
}
