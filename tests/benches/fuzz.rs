//! The datapath's tc and XDP programs on a million seeded random and mutated
//! frames (see `tests/fuzz_frames.rs` for the property each output is
//! checked against), with the count of each outcome.
//!
//! Usage: `cargo bench -p ebpf-proxy-tests --bench fuzz -- [--quick]
//! [--frames N] [--seed S] [--out DIR]` (root). `--quick` runs 100,000
//! frames. Prints a markdown table and writes `fuzz.md` to DIR. Exits
//! non-zero when any output broke the property.

#[path = "../tests/frame_fuzz/mod.rs"]
mod frame_fuzz;

use std::{path::PathBuf, time::Instant};

fn main() {
    let mut frames: u64 = 1_000_000;
    let mut seed = None;
    let mut out: Option<PathBuf> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .unwrap_or_else(|| panic!("{name} needs a value"))
        };
        match arg.as_str() {
            "--quick" => frames = 100_000,
            "--frames" => {
                frames = value("--frames")
                    .parse()
                    .expect("--frames: a number of frames");
            }
            "--seed" => {
                let s = value("--seed");
                seed = Some(
                    s.strip_prefix("0x")
                        .map_or_else(|| s.parse(), |h| u64::from_str_radix(h, 16))
                        .expect("--seed: a number"),
                );
            }
            "--out" => out = Some(PathBuf::from(value("--out"))),
            // What `cargo bench` itself passes.
            "--bench" => {}
            other => panic!("unknown argument {other:?}"),
        }
    }
    let seed = seed.unwrap_or_else(frame_fuzz::seed);
    eprintln!("frame fuzz: seed {seed:#x}, {frames} frames, each through tc and XDP");
    let started = Instant::now();
    let report = frame_fuzz::run(seed, frames, true);
    let text = format!(
        "# Datapath fuzz\n\n{}\n({:.1} s)\n",
        report.summary(),
        started.elapsed().as_secs_f64()
    );
    println!("{text}");
    if let Some(dir) = out {
        std::fs::create_dir_all(&dir).expect("creating the output directory");
        std::fs::write(dir.join("fuzz.md"), &text).expect("writing fuzz.md");
    }
    report.assert_clean();
}
