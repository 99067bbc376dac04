//! The end-to-end benchmarks' results and the tables and JSON made of them.

use std::time::Duration;

use super::rounds::{Series, Spread};

/// A bench's modes. Each bench compares with kube-proxy's iptables mode and with the
/// client talking straight to the pods (no load balancer, the limit).
pub trait BenchMode: Copy + PartialEq {
    const IPTABLES: Self;
    const DIRECT: Self;
    /// The mode in the JSON.
    fn key(self) -> &'static str;
    /// The mode in the tables and messages.
    fn label(self) -> &'static str;
}

/// One result: a mode's series at one S, and what else the bench keeps with it.
#[derive(Debug)]
pub struct Stats<M, X> {
    pub services: u32,
    pub mode: M,
    /// Time to program the Services, for the modes that program any.
    pub programming: Option<Duration>,
    pub series: Series,
    /// The kind of exchange (e2e), node a's details (nodeport).
    pub detail: X,
}

/// What a bench keeps with each result besides [`Stats`]' own fields.
pub trait Detail {
    /// Whether two results at the same S ran interleaved, and so can be paired.
    fn same_cell(&self, other: &Self) -> bool;
}

/// What a report takes from a bench's results.
pub trait Rows<M, X> {
    /// The first result of `mode` at S `services`.
    fn find(&self, services: u32, mode: M) -> Option<&Stats<M, X>>;

    /// The result of `mode` that ran interleaved with `row`.
    fn peer(&self, row: &Stats<M, X>, mode: M) -> Option<&Stats<M, X>>;

    /// `row` against mode `base` in the same cell, round by round: see
    /// [`Series::paired`].
    fn rate_vs(&self, row: &Stats<M, X>, base: M) -> Spread {
        self.peer(row, base)
            .map_or_else(|| Spread::of(Vec::new()), |b| row.series.rate_vs(&b.series))
    }

    fn p99_vs(&self, row: &Stats<M, X>, base: M) -> Spread {
        self.peer(row, base)
            .map_or_else(|| Spread::of(Vec::new()), |b| row.series.p99_vs(&b.series))
    }

    /// A table row's cells from the mode on: `| mode | rate | vs iptables | vs no LB |
    /// p50 µs | p99 µs | failed |`.
    fn cells(&self, row: &Stats<M, X>) -> String
    where
        M: BenchMode,
    {
        let s = &row.series;
        format!(
            "| {} | {:.0} | {:.2}x | {:.2}x | {:.1} | {:.1} | {} |",
            row.mode.label(),
            s.rate(),
            self.rate_vs(row, M::IPTABLES).median,
            self.rate_vs(row, M::DIRECT).median,
            s.percentile_us(0.50),
            s.percentile_us(0.99),
            s.failed
        )
    }

    /// A row's JSON: the fields every bench has, and `extra`'s (an object).
    fn json(&self, row: &Stats<M, X>, extra: serde_json::Value) -> serde_json::Value
    where
        M: BenchMode,
    {
        let mut fields = row.series.json();
        merge(
            &mut fields,
            serde_json::json!({
                "services": row.services,
                "mode": row.mode.key(),
                "label": row.mode.label(),
                "vs_iptables": self.rate_vs(row, M::IPTABLES).json(),
                "vs_direct": self.rate_vs(row, M::DIRECT).json(),
                "p99_vs_iptables": self.p99_vs(row, M::IPTABLES).json(),
                "programming_s": row.programming.map(|d| d.as_secs_f64()),
            }),
        );
        merge(&mut fields, extra);
        fields
    }

    /// For each S, `modes`' time to program the Services: `- S = 10: ebpf-proxy 0.05
    /// s, …`.
    fn programming_markdown(&self, sizes: &[u32], modes: &[M]) -> String
    where
        M: BenchMode,
    {
        let mut out = String::new();
        for &services in sizes {
            let cells: Vec<String> = modes
                .iter()
                .filter_map(|&mode| {
                    let s = self.find(services, mode)?;
                    Some(format!(
                        "{} {:.2} s",
                        mode.label(),
                        s.programming?.as_secs_f64()
                    ))
                })
                .collect();
            out.push_str(&format!("- S = {services}: {}\n", cells.join(", ")));
        }
        out
    }
}

impl<M: PartialEq, X: Detail> Rows<M, X> for [Stats<M, X>] {
    fn find(&self, services: u32, mode: M) -> Option<&Stats<M, X>> {
        self.iter()
            .find(|s| s.services == services && s.mode == mode)
    }

    fn peer(&self, row: &Stats<M, X>, mode: M) -> Option<&Stats<M, X>> {
        self.iter().find(|s| {
            s.services == row.services && s.mode == mode && s.detail.same_cell(&row.detail)
        })
    }
}

/// Adds `from`'s fields to `into`, both objects.
fn merge(into: &mut serde_json::Value, from: serde_json::Value) {
    if let (serde_json::Value::Object(into), serde_json::Value::Object(from)) = (into, from) {
        into.extend(from);
    }
}
