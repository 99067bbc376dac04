//! Interleaved rounds of the end-to-end benchmarks, the per-round series they give,
//! and ratios paired round by round.

use std::collections::BTreeMap;

use anyhow::Result;

use super::interrupt::check_interrupted;
use crate::load::Sample;

/// One segment: a mode's threads for one kind of exchange, in one round.
#[derive(Debug, Clone, Copy)]
pub struct Segment {
    pub rate: f64,
    /// Microseconds.
    pub p99: f64,
}

/// Everything measured for one mode and kind of exchange over all rounds.
#[derive(Debug, Default)]
pub struct Series {
    pub ok: u64,
    pub failed: u64,
    pub errors: BTreeMap<String, u64>,
    pub backends: Vec<u64>,
    pub seconds: f64,
    /// Each round's segment, in round order.
    pub rounds: Vec<Segment>,
    /// Latencies in nanoseconds, sorted once every round is in.
    pub latencies: Vec<u32>,
}

impl Series {
    /// Adds one round's segment.
    pub fn record(&mut self, mut sample: Sample) {
        sample.latencies.sort_unstable();
        let seconds = sample.elapsed.as_secs_f64();
        self.rounds.push(Segment {
            rate: sample.ok as f64 / seconds,
            p99: percentile_us(&sample.latencies, 0.99),
        });
        self.seconds += seconds;
        self.ok += sample.ok;
        self.failed += sample.failed();
        for (k, v) in sample.errors {
            *self.errors.entry(k).or_default() += v;
        }
        if self.backends.len() < sample.backends.len() {
            self.backends.resize(sample.backends.len(), 0);
        }
        for (a, b) in self.backends.iter_mut().zip(sample.backends) {
            *a += b;
        }
        self.latencies.extend(sample.latencies);
    }

    pub fn rate(&self) -> f64 {
        self.ok as f64 / self.seconds
    }

    /// Failed exchanges over all attempted.
    pub fn failure_rate(&self) -> f64 {
        self.failed as f64 / (self.ok + self.failed).max(1) as f64
    }

    /// Of the latencies, once sorted ([`interleaved`] sorts them).
    pub fn percentile_us(&self, p: f64) -> f64 {
        percentile_us(&self.latencies, p)
    }

    /// `self` against `base` round by round, through `f` (rate or p99). The two
    /// segments of a round ran within a second or two of each other, so their ratio is
    /// spared most of the machine's drift and of other tenants' bursts, which hit whole
    /// seconds; the median over rounds is what the tables show.
    pub fn paired(&self, base: &Series, f: fn(&Segment) -> f64) -> Spread {
        Spread::of(
            self.rounds
                .iter()
                .zip(&base.rounds)
                .map(|(x, y)| f(x) / f(y))
                .collect(),
        )
    }

    pub fn rate_vs(&self, base: &Series) -> Spread {
        self.paired(base, |seg| seg.rate)
    }

    pub fn p99_vs(&self, base: &Series) -> Spread {
        self.paired(base, |seg| seg.p99)
    }

    /// The JSON fields of what was measured, for a bench's result row.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "per_second": self.rate(),
            "p50_us": self.percentile_us(0.50),
            "p90_us": self.percentile_us(0.90),
            "p99_us": self.percentile_us(0.99),
            "ok": self.ok,
            "failed": self.failed,
            "errors": self.errors,
            "seconds": self.seconds,
            "round_rates": self.rounds.iter().map(|r| r.rate).collect::<Vec<_>>(),
            "round_p99_us": self.rounds.iter().map(|r| r.p99).collect::<Vec<_>>(),
        })
    }
}

/// `rounds` rounds over `modes` side by side and `kinds` kinds of exchange (TCP, UDP):
/// in each round every kind in turn, and for each kind every mode, the modes' order
/// rotating each round so no mode always runs first or last. `measure(mode, kind)`
/// measures one segment. Returns the series as `[mode][kind]`, latencies sorted.
pub fn interleaved(
    rounds: usize,
    modes: usize,
    kinds: usize,
    mut measure: impl FnMut(usize, usize) -> Result<Sample>,
) -> Result<Vec<Vec<Series>>> {
    // Flat, mode-major: series[mode * kinds + kind].
    let mut series: Vec<Series> = (0..modes * kinds).map(|_| Series::default()).collect();
    for round in 0..rounds {
        for kind in 0..kinds {
            for k in 0..modes {
                let mode = (k + round) % modes;
                check_interrupted()?;
                series[mode * kinds + kind].record(measure(mode, kind)?);
            }
        }
    }
    let mut out = Vec::with_capacity(modes);
    let mut series = series.into_iter();
    for _ in 0..modes {
        let mut per_kind: Vec<Series> = series.by_ref().take(kinds).collect();
        for s in &mut per_kind {
            s.latencies.sort_unstable();
        }
        out.push(per_kind);
    }
    Ok(out)
}

/// Nearest-rank percentile of sorted nanoseconds, in microseconds.
pub fn percentile_us(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    f64::from(sorted[rank - 1]) / 1000.0
}

/// Median and quartiles of some ratios.
#[derive(Debug, Clone, Copy)]
pub struct Spread {
    pub median: f64,
    pub q1: f64,
    pub q3: f64,
}

impl Spread {
    pub fn of(mut values: Vec<f64>) -> Spread {
        values.retain(|v| v.is_finite());
        values.sort_by(f64::total_cmp);
        let at = |q: f64| {
            if values.is_empty() {
                return f64::NAN;
            }
            // Linear interpolation between closest ranks.
            let pos = q * (values.len() - 1) as f64;
            let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
            values[lo] + (values[hi] - values[lo]) * (pos - lo as f64)
        };
        Spread {
            median: at(0.5),
            q1: at(0.25),
            q3: at(0.75),
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"median": self.median, "q1": self.q1, "q3": self.q3})
    }
}

impl std::fmt::Display for Spread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.2}x (quartiles {:.2}–{:.2})",
            self.median, self.q1, self.q3
        )
    }
}
