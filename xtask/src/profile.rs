//! `cargo xtask profile`: where the agent's packet programs spend their time on the
//! traffic a node carries now, by source line. `perf` samples every CPU (the `cpu-clock`
//! event, which needs no hardware counters); each sample in a program's JIT image is
//! put on the source line the program's BTF line info gives that stretch of it, and
//! each sample in a kernel function a program called (a hash map lookup, an insert) on
//! that function and the line of the call. See bench/README.md, "Where a connection's
//! program time goes".

mod attribute;
mod kernel;

use std::{path::PathBuf, process::Command};

use anyhow::{Context, Result, bail};
use attribute::{Profile, Program};
use ebpf_proxy_tests::require_root;

/// The agent's packet programs, which `--program` defaults to.
pub use proxy_common::program_names::PACKET as PACKET_PROGRAMS;

/// What to sample, for how long, and how much to print.
pub struct Options {
    pub seconds: u64,
    pub programs: Vec<String>,
    pub top: usize,
}

pub fn run(options: &Options) -> Result<()> {
    require_root()?;
    let programs = kernel::programs(&options.programs)?;
    if programs.is_empty() {
        bail!(
            "no loaded program is named {}: is the agent running?",
            options.programs.join(" or ")
        );
    }
    let data = std::env::temp_dir().join(format!("ebpf-proxy-profile-{}.data", std::process::id()));
    let recorded = record(&data, options.seconds);
    let script = recorded.and_then(|()| script(&data));
    let _ = std::fs::remove_file(&data);
    let samples = attribute::parse_samples(&script?);
    let profiles = attribute::attribute(&programs, &samples);
    println!(
        "{} samples on every CPU over {} s (cpu-clock, 4999 Hz a CPU)",
        samples.len(),
        options.seconds
    );
    for (program, profile) in programs.iter().zip(&profiles) {
        print_profile(program, profile, samples.len() as u64, options.top);
    }
    Ok(())
}

/// `perf record` of every CPU, with call chains, for `seconds`.
fn record(data: &PathBuf, seconds: u64) -> Result<()> {
    let status = Command::new("perf")
        .args([
            "record",
            "-a",
            "-g",
            "-e",
            "cpu-clock",
            "-F",
            "4999",
            "-q",
            "-o",
        ])
        .arg(data)
        .args(["--", "sleep", &seconds.to_string()])
        .status()
        .context("run perf (apt-get install linux-perf)")?;
    if !status.success() {
        bail!("perf record failed: {status}");
    }
    Ok(())
}

/// The recording as `perf script` prints its call chains: addresses and symbols.
fn script(data: &PathBuf) -> Result<String> {
    let out = Command::new("perf")
        .args(["script", "-F", "ip,sym", "-i"])
        .arg(data)
        .output()
        .context("run perf script")?;
    if !out.status.success() {
        bail!(
            "perf script failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8(out.stdout).context("perf script's output is not UTF-8")
}

fn print_profile(program: &Program, profile: &Profile, all: u64, top: usize) {
    let pct = |n: u64, of: u64| 100.0 * n as f64 / of.max(1) as f64;
    let own = profile.own_samples();
    println!(
        "\n{} (id {}): {} samples, {:.2}% of all; {:.1}% at its own instructions, {:.1}% in \
         kernel functions it called",
        program.name,
        program.id,
        profile.samples,
        pct(profile.samples, all),
        pct(own, profile.samples),
        pct(profile.samples - own, profile.samples),
    );
    if profile.samples == 0 {
        return;
    }
    println!("  its own instructions, by source line (% of the program's samples):");
    for ((place, text), n) in Profile::ranked(&profile.own).into_iter().take(top) {
        let text: String = text.chars().take(80).collect();
        println!("  {:5.1}%  {place:<26} {text}", pct(n, profile.samples));
    }
    println!("  kernel functions it called, by the datapath's line before the call:");
    for ((callee, site), n) in Profile::ranked(&profile.called).into_iter().take(top) {
        println!(
            "  {:5.1}%  {callee:<32} after {site}",
            pct(n, profile.samples)
        );
    }
}
