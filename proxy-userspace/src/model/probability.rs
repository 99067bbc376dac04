//! Per-endpoint selection probabilities: kube-proxy's iptables cascade, and
//! our datapath's single-draw slot choice. Both are computed exactly from the
//! code that makes the decision, so tests can prove the two agree (docs/architecture.md,
//! "Backend selection"; docs/kube-proxy-semantics.md §1).

/// 2^31: the range of `random_u32 & 0x7fffffff` that `xt_statistic` compares
/// against a rule's threshold.
const TWO_POW_31: f64 = 2_147_483_648.0;

/// 2^32: the range of `bpf_get_prandom_u32()`.
const TWO_POW_32: u64 = 1 << 32;

/// The threshold iptables stores for `--probability` 1/k, through the same
/// pipeline as kube-proxy and iptables: Go's `%0.10f` (correctly rounded),
/// `strtod` (correctly rounded), then `lround(0x80000000 * p)`.
///
/// Rust's `{:.10}` is correctly rounded as well; the two could only disagree
/// on a decimal tie, which first happens at k = 2048 (1/2048 has 11 decimals),
/// outside anything we compare against. `f64::round` rounds half away from
/// zero, like `lround`. `k` must be at least 1.
pub fn iptables_threshold(k: usize) -> u32 {
    let text = format!("{:.10}", 1.0 / k as f64);
    let p: f64 = text.parse().expect("a formatted float always parses back");
    (TWO_POW_31 * p).round() as u32
}

/// Probability that kube-proxy's iptables rules pick endpoint i of n.
///
/// Rule i (0-based) of n matches with T(n−i)/2³¹ on its own random draw;
/// the last rule always matches, so it takes whatever is left:
/// P(i) = T(n−i)/2³¹ · ∏_{j<i} (1 − T(n−j)/2³¹).
pub fn iptables_probabilities(n: usize) -> Vec<f64> {
    let mut probabilities = Vec::with_capacity(n);
    let mut not_yet_matched = 1.0;
    for i in 0..n {
        if i + 1 == n {
            probabilities.push(not_yet_matched);
        } else {
            let p_match = f64::from(iptables_threshold(n - i)) / TWO_POW_31;
            probabilities.push(not_yet_matched * p_match);
            not_yet_matched *= 1.0 - p_match;
        }
    }
    probabilities
}

/// How many of the 2³² possible `r` our datapath maps to each slot, where
/// `slot = (r as u64 * n as u64) >> 32` (the kernel's `reciprocal_scale`, as
/// nftables' numgen uses).
///
/// `slot(r) >= s` exactly when `r >= ceil(s · 2³² / n)`, so slot s gets the
/// r in `[ceil(s·2³²/n), ceil((s+1)·2³²/n))`.
pub fn slot_counts(n: usize) -> Vec<u64> {
    let n = n as u64;
    let first_r = |s: u64| (s * TWO_POW_32).div_ceil(n);
    (0..n).map(|s| first_r(s + 1) - first_r(s)).collect()
}

/// Probability that our datapath picks slot i of n for a uniform u32 draw.
/// Exact: each count is below 2⁵³ and dividing by a power of two loses
/// nothing.
pub fn slot_probabilities(n: usize) -> Vec<f64> {
    slot_counts(n)
        .into_iter()
        .map(|count| count as f64 / TWO_POW_32 as f64)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The thresholds of docs/kube-proxy-semantics.md §1.
    #[test]
    fn thresholds_match_reference_table() {
        let table: [(usize, u32); 9] = [
            (2, 1073741824),
            (3, 715827883),
            (4, 536870912),
            (5, 429496730),
            (6, 357913941),
            (7, 306783378),
            (8, 268435456),
            (9, 238609294),
            (10, 214748365),
        ];
        for (k, want) in table {
            let got = iptables_threshold(k);
            assert_eq!(
                got, want,
                "threshold for 1/{k}: got {got} ({got:#x}), reference says {want} ({want:#x})"
            );
        }
    }

    /// `slot_counts` is a closed form; this ties it to the function the
    /// datapath runs: the first draw of each slot's range maps to that slot,
    /// the draw before it to the previous one.
    #[test]
    fn slot_counts_are_the_ranges_of_the_datapath_function() {
        for n in 1..=1000u32 {
            let mut first = 0u64;
            for (slot, count) in slot_counts(n as usize).into_iter().enumerate() {
                let slot = slot as u32;
                assert_eq!(
                    proxy_common::slot_for(first as u32, n),
                    slot,
                    "n={n}: draw {first} should start slot {slot}"
                );
                if first > 0 {
                    assert_eq!(
                        proxy_common::slot_for((first - 1) as u32, n),
                        slot - 1,
                        "n={n}: draw {} should end slot {}",
                        first - 1,
                        slot - 1
                    );
                }
                first += count;
            }
            assert_eq!(
                proxy_common::slot_for(u32::MAX, n),
                n - 1,
                "n={n}: last draw"
            );
        }
    }

    #[test]
    fn slot_counts_cover_every_draw_once() {
        for n in 1..=1000usize {
            let counts = slot_counts(n);
            assert_eq!(counts.len(), n, "n={n}: wrong number of slots");
            let total: u64 = counts.iter().sum();
            assert_eq!(
                total, TWO_POW_32,
                "n={n}: slot counts sum to {total}, not 2^32"
            );
            let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            assert!(
                max - min <= 1,
                "n={n}: slot counts range from {min} to {max}; a multiply-shift never differs by more than one"
            );
        }
    }

    #[test]
    fn slot_counts_agree_with_brute_force_for_small_ranges() {
        // Same formula on a 2^12 space, checked draw by draw.
        for n in 1..=50u64 {
            let mut counts = vec![0u64; n as usize];
            for r in 0..(1u64 << 12) {
                counts[((r * n) >> 12) as usize] += 1;
            }
            let formula: Vec<u64> = (0..n)
                .map(|s| ((s + 1) << 12).div_ceil(n) - (s << 12).div_ceil(n))
                .collect();
            assert_eq!(
                counts, formula,
                "n={n}: interval formula disagrees with enumeration"
            );
        }
    }

    #[test]
    #[expect(
        clippy::float_cmp,
        reason = "the slot probabilities are built to sum to exactly 1"
    )]
    fn datapath_matches_iptables_within_1e9() {
        for n in 1..=1000usize {
            let ours = slot_probabilities(n);
            let theirs = iptables_probabilities(n);
            assert_eq!(ours.len(), n, "n={n}: slot vector length");
            assert_eq!(theirs.len(), n, "n={n}: iptables vector length");
            let our_sum: f64 = ours.iter().sum();
            assert_eq!(our_sum, 1.0, "n={n}: slot probabilities sum to {our_sum}");
            let their_sum: f64 = theirs.iter().sum();
            assert!(
                (their_sum - 1.0).abs() < 1e-12,
                "n={n}: iptables probabilities sum to {their_sum}"
            );
            for (i, (o, t)) in ours.iter().zip(&theirs).enumerate() {
                assert!(
                    (o - t).abs() < 1e-9,
                    "n={n} endpoint {i}: datapath {o:.15} vs iptables {t:.15} (diff {:e})",
                    o - t
                );
            }
        }
    }

    #[test]
    fn degenerate_sizes() {
        assert!(
            iptables_probabilities(0).is_empty(),
            "no endpoints, no probabilities"
        );
        assert!(
            slot_probabilities(0).is_empty(),
            "no slots, no probabilities"
        );
        assert_eq!(
            iptables_probabilities(1),
            vec![1.0],
            "a single rule always matches"
        );
        assert_eq!(
            slot_probabilities(1),
            vec![1.0],
            "a single slot takes every draw"
        );
    }
}
