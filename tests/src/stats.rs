//! Pearson's chi-square goodness-of-fit test, with the p-value from the regularized
//! upper incomplete gamma function (no statistics crate: the harness keeps to light
//! dependencies, and this is forty lines of Numerical Recipes).

use std::fmt;

/// The result of a goodness-of-fit test.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChiSquare {
    pub statistic: f64,
    pub df: u32,
    /// Probability of a statistic at least this large if the counts do follow the
    /// expected distribution.
    pub p_value: f64,
}

impl ChiSquare {
    /// True unless the counts are implausible at significance `alpha`.
    pub fn passes(&self, alpha: f64) -> bool {
        self.p_value >= alpha
    }
}

impl fmt::Display for ChiSquare {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "chi2 = {:.3}, df = {}, p = {:.4}",
            self.statistic, self.df, self.p_value
        )
    }
}

/// Tests `observed` against the distribution `probabilities` (which must sum to 1).
pub fn chi_square(observed: &[u64], probabilities: &[f64]) -> ChiSquare {
    assert_eq!(
        observed.len(),
        probabilities.len(),
        "one probability per category"
    );
    assert!(
        observed.len() >= 2,
        "a goodness-of-fit test needs two categories"
    );
    let total: u64 = observed.iter().sum();
    assert!(total > 0, "no observations");
    let statistic = observed
        .iter()
        .zip(probabilities)
        .map(|(&o, &p)| {
            let expected = p * total as f64;
            assert!(expected > 0.0, "a category with probability 0");
            (o as f64 - expected).powi(2) / expected
        })
        .sum();
    let df = observed.len() as u32 - 1;
    ChiSquare {
        statistic,
        df,
        p_value: chi_square_sf(statistic, df),
    }
}

/// Tests `observed` against the uniform distribution over its categories.
pub fn chi_square_uniform(observed: &[u64]) -> ChiSquare {
    let p = 1.0 / observed.len() as f64;
    chi_square(observed, &vec![p; observed.len()])
}

/// P(X >= x) for X chi-square distributed with `df` degrees of freedom.
pub fn chi_square_sf(x: f64, df: u32) -> f64 {
    assert!(df > 0);
    if x <= 0.0 {
        return 1.0;
    }
    gamma_q(f64::from(df) / 2.0, x / 2.0)
}

/// Regularized upper incomplete gamma Q(a, x) = Γ(a, x) / Γ(a), for a > 0, x >= 0.
/// The series converges fast below a + 1, the continued fraction above (Numerical
/// Recipes §6.2).
#[expect(
    clippy::many_single_char_names,
    reason = "the names Numerical Recipes gives the terms, so the code can be checked against it"
)]
fn gamma_q(a: f64, x: f64) -> f64 {
    const EPS: f64 = 1e-15;
    const MAX_ITER: usize = 10_000;
    let log_prefactor = -x + a * x.ln() - ln_gamma(a);
    if x < a + 1.0 {
        // P(a, x) = e^-x x^a / Γ(a+1) · Σ x^n / ((a+1)...(a+n))
        let mut term = 1.0 / a;
        let mut sum = term;
        let mut ap = a;
        for _ in 0..MAX_ITER {
            ap += 1.0;
            term *= x / ap;
            sum += term;
            if term.abs() < sum.abs() * EPS {
                break;
            }
        }
        (1.0 - sum * log_prefactor.exp()).max(0.0)
    } else {
        // Modified Lentz evaluation of the continued fraction for Q.
        let tiny = f64::MIN_POSITIVE / EPS;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..MAX_ITER {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let delta = d * c;
            h *= delta;
            if (delta - 1.0).abs() < EPS {
                break;
            }
        }
        (log_prefactor.exp() * h).min(1.0)
    }
}

/// ln Γ(x) for x > 0 (Lanczos, g = 7, n = 9; relative error below 1e-15).
fn ln_gamma(x: f64) -> f64 {
    const G: f64 = 7.0;
    const COEF: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection keeps the approximation in its accurate range.
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut sum = COEF[0];
    for (i, c) in COEF.iter().enumerate().skip(1) {
        sum += c / (x + i as f64);
    }
    let t = x + G + 0.5;
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + sum.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol * b.abs().max(1e-300)
    }

    #[test]
    fn ln_gamma_matches_factorials() {
        let mut fact = 1.0f64;
        for n in 1..30u32 {
            // Γ(n) = (n-1)!
            // Γ(1) = Γ(2) = 1: compare absolutely near ln = 0.
            let (got, want) = (ln_gamma(f64::from(n)), fact.ln());
            assert!((got - want).abs() <= 1e-12 * want.abs().max(1.0), "n = {n}");
            fact *= f64::from(n);
        }
        assert!(close(
            ln_gamma(0.5),
            std::f64::consts::PI.sqrt().ln(),
            1e-12
        ));
    }

    #[test]
    fn two_degrees_of_freedom_is_exponential() {
        for x in [0.1, 1.0, 2.5, 7.0, 13.8155, 30.0, 80.0] {
            let exact = (-x / 2.0f64).exp();
            assert!(close(chi_square_sf(x, 2), exact, 1e-10), "x = {x}");
        }
    }

    #[test]
    fn matches_published_critical_values() {
        // (df, critical value, alpha) from standard chi-square tables.
        let table = [
            (1, 3.841_458_820_694_124, 0.05),
            (1, 10.827_566_170_662_733, 0.001),
            (2, 13.815_510_557_964_274, 0.001),
            (4, 9.487_729_036_781_154, 0.05),
            (5, 20.515_005_652_432_873, 0.001),
            (10, 29.588_298_445_074_42, 0.001),
            (10, 18.307_038_053_275_146, 0.05),
            (20, 45.314_746_618_125_39, 0.001),
            (20, 31.410_432_844_230_918, 0.05),
            (3, 0.351_846_317_749_729_3, 0.95),
        ];
        for (df, x, alpha) in table {
            let p = chi_square_sf(x, df);
            assert!(
                close(p, alpha, 1e-7),
                "df {df}, x {x}: p = {p}, want {alpha}"
            );
        }
    }

    #[test]
    #[expect(
        clippy::float_cmp,
        reason = "observed counts equal to the expected ones give exactly 0 and 1"
    )]
    fn uniform_counts_pass_and_skewed_counts_fail() {
        let fair = chi_square_uniform(&[300, 310, 290]);
        assert_eq!(fair.df, 2);
        assert!(close(fair.statistic, 2.0 / 3.0, 1e-12));
        assert!(fair.passes(0.001), "{fair}");
        let skewed = chi_square_uniform(&[450, 300, 150]);
        assert!(!skewed.passes(0.001), "{skewed}");
        let weighted = chi_square(&[500, 250, 250], &[0.5, 0.25, 0.25]);
        assert_eq!(weighted.statistic, 0.0);
        assert_eq!(weighted.p_value, 1.0);
    }
}
