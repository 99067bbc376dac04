//! What `/proc/<pid>/status` says of a process: the agent's memory, as the
//! benches and the tests that watch it read it.

use anyhow::{Context, Result};

/// A `status` field counted in kB (`VmRSS:`, `VmHWM:`, with its colon).
pub fn status_kib(pid: u32, field: &str) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let status = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no {field} in {path}:\n{status}"))
}

/// The process's resident set, in KiB.
pub fn rss_kib(pid: u32) -> Result<u64> {
    status_kib(pid, "VmRSS:")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process_memory() {
        let rss = rss_kib(std::process::id()).expect("this process's VmRSS");
        let peak = status_kib(std::process::id(), "VmHWM:").expect("this process's VmHWM");
        assert!(rss > 0 && peak >= rss, "VmRSS {rss} kB, VmHWM {peak} kB");
        let err = status_kib(std::process::id(), "NoSuchField:").unwrap_err();
        assert!(
            format!("{err:#}").contains("no NoSuchField:"),
            "the error names the field: {err:#}"
        );
    }
}
