//! The machine a benchmark ran on, and the settings that follow from it.

use std::{process::Command, thread};

use crate::run_cmd;

pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub kernel: String,
    pub iptables: String,
    pub nft: String,
}

impl Machine {
    pub fn probe() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or("unknown CPU".into(), |(_, v)| v.trim().to_owned());
        let version = |program: &str, arg: &str| {
            run_cmd(Command::new(program).arg(arg))
                .map_or_else(|e| format!("{program}: {e:#}"), |s| s.trim().to_owned())
        };
        Machine {
            cpu,
            cores: thread::available_parallelism().map_or(0, std::num::NonZero::get),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map_or("unknown".into(), |s| s.trim().to_owned()),
            iptables: version("iptables", "--version"),
            nft: version("nft", "--version"),
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "cpu": self.cpu,
            "cores": self.cores,
            "kernel": self.kernel,
            "iptables": self.iptables,
            "nft": self.nft,
        })
    }
}

/// The clock ticks a second `/proc`'s CPU times count in (`USER_HZ`, as `getconf
/// CLK_TCK` reports it).
pub fn clock_ticks_per_second() -> anyhow::Result<f64> {
    use anyhow::Context;
    let out = Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .context("run getconf CLK_TCK")?;
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .context("getconf CLK_TCK")
}

/// /proc/loadavg's 1-minute figure.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into())
}

/// Client threads: four per core, at least 8 and at most 32. The rate measured is
/// the machine's capacity for short connections, so the cores must stay busy: with
/// one thread per core each exchange waits for the other side to be woken, and a
/// woken vCPU of a VM takes tens of µs to run, which the rate then measures instead
/// of the per-connection work the datapaths differ in. On 2 cores, 8 threads gave 65%
/// more connections/s than 2 for every mode (no LB 14,800 against 9,000), and 16
/// threads no more than 8.
pub fn default_threads() -> usize {
    thread::available_parallelism()
        .map_or(2, std::num::NonZero::get)
        .saturating_mul(4)
        .clamp(8, 32)
}

/// The last 20 lines of an agent's output, to go with an error.
pub fn log_tail(agent: &crate::agent::Agent) -> String {
    let log = agent.log();
    let lines: Vec<&str> = log.lines().collect();
    format!(
        "\nlast lines of the agent's output:\n{}",
        lines[lines.len().saturating_sub(20)..].join("\n")
    )
}
