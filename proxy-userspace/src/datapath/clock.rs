//! Calibrates the datapath clock (see `proxy_common::Clock`): the jiffies
//! counter the programs read inline, scaled to `CLOCK_MONOTONIC` nanoseconds.
//! The kernel's tick length (`CONFIG_HZ`) is not readable from user space, so
//! it is measured: two readings of both clocks 100 ms apart, snapped to the
//! tick lengths Linux can be built with.

use std::time::Duration;

use aya::{
    maps::{Array, MapData},
    programs::{ProgramError, TestRun, TestRunOptions, Xdp},
};
use proxy_common::{Clock, clock_slot};

/// How far apart the two readings are: 25 ticks at HZ=250 and 30 at 300,
/// so a tick more or less still points to the right one of the two
/// closest tick lengths; 10 at HZ=100, whose neighbours are far off.
const SPAN: Duration = Duration::from_millis(100);

/// The tick lengths of the HZ values Linux offers (100, 250, 300, 1000), as
/// the kernel rounds them (`TICK_NSEC`).
const TICKS_NS: [u64; 4] = [10_000_000, 4_000_000, 3_333_333, 1_000_000];

#[derive(Debug, thiserror::Error)]
pub enum ClockError {
    #[error("running clock_probe: {0}")]
    Probe(#[from] ProgramError),
    #[error("CLOCK map: {0}")]
    Map(#[from] aya::maps::MapError),
    #[error(
        "jiffies advanced {jiffies} in {ns} ns, which matches no kernel tick length (HZ 100, 250, 300 or 1000)"
    )]
    NoTick { jiffies: u64, ns: u64 },
}

/// The tick length `jiffies` ticks in `ns` nanoseconds point to: the nearest
/// of `TICKS_NS`, if within 15% (a tick more or less at HZ=100 is 11%).
pub fn tick_ns(jiffies: u64, ns: u64) -> Result<u64, ClockError> {
    let no_tick = ClockError::NoTick { jiffies, ns };
    if jiffies == 0 {
        return Err(no_tick);
    }
    let measured = ns as f64 / jiffies as f64;
    let nearest = TICKS_NS
        .iter()
        .copied()
        .min_by_key(|t| (*t as f64 - measured).abs() as u64)
        .expect("TICKS_NS is not empty");
    if (nearest as f64 - measured).abs() <= nearest as f64 * 0.15 {
        Ok(nearest)
    } else {
        Err(no_tick)
    }
}

/// One reading of both clocks, taken by `probe` in the kernel.
fn sample(probe: &Xdp, clock: &Array<MapData, Clock>) -> Result<Clock, ClockError> {
    let frame = [0u8; 64];
    let mut opts = TestRunOptions::new();
    opts.data_in = Some(&frame);
    probe.test_run(opts)?;
    Ok(clock.get(&clock_slot::SAMPLE, 0)?)
}

/// Measures the scale and puts it in force. Blocks for `SPAN`.
pub fn calibrate(probe: &Xdp, clock: &mut Array<MapData, Clock>) -> Result<Clock, ClockError> {
    let first = sample(probe, clock)?;
    std::thread::sleep(SPAN);
    let last = sample(probe, clock)?;
    let tick_ns = tick_ns(
        last.jiffies.saturating_sub(first.jiffies),
        last.ns.saturating_sub(first.ns),
    )?;
    let scale = Clock { tick_ns, ..last };
    clock.set(clock_slot::IN_FORCE, scale, 0)?;
    Ok(scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snaps_to_the_kernel_tick_lengths() {
        // 100 ms at each HZ, off by a tick either way.
        for (hz, tick) in [
            (100, 10_000_000),
            (250, 4_000_000),
            (300, 3_333_333),
            (1000, 1_000_000),
        ] {
            let ticks = hz / 10;
            for jiffies in [ticks - 1, ticks, ticks + 1] {
                assert_eq!(
                    tick_ns(jiffies, 100_000_000).unwrap(),
                    tick,
                    "HZ={hz}, {jiffies} jiffies in 100 ms"
                );
            }
        }
    }

    #[test]
    fn rejects_what_no_tick_explains() {
        // No tick seen, and a rate between HZ 300 and 1000.
        for (jiffies, ns) in [(0, 100_000_000), (50, 100_000_000)] {
            let err = tick_ns(jiffies, ns).unwrap_err().to_string();
            assert!(
                err.contains(&format!("jiffies advanced {jiffies} in {ns} ns")),
                "{err}"
            );
        }
    }
}
