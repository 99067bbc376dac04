//! The tc and XDP programs on seeded random and mutated frames through
//! `BPF_PROG_TEST_RUN` (truncated headers, IP options, bad lengths, fragments,
//! ICMP errors quoting inner headers, VLAN tags, every TCP flag
//! combination, other ethertypes): each output must be the frame untouched,
//! a drop the datapath means (and counts), a reject addressed back to the
//! sender, or a translation consistent with the maps and conntrack with
//! valid checksums. A short run here; `cargo bench --bench fuzz` runs a
//! million frames. Needs root.
//!
//! `EBPF_PROXY_FUZZ_SEED` replays a run; `EBPF_PROXY_FUZZ_FRAMES` sets its
//! length.

mod frame_fuzz;

use ebpf_proxy_tests::fuzz::{DropReason, Hook, Outcome};

/// Frames of the short run (each through both programs).
const FRAMES: u64 = 4000;

#[test]
fn random_and_mutated_frames_are_passed_dropped_rejected_or_translated_right() {
    let frames = std::env::var("EBPF_PROXY_FUZZ_FRAMES")
        .ok()
        .map_or(FRAMES, |n| {
            n.parse().expect("EBPF_PROXY_FUZZ_FRAMES: a number")
        });
    let seed = frame_fuzz::seed();
    eprintln!("frame fuzz: seed {seed:#x}, {frames} frames");
    let report = frame_fuzz::run(seed, frames, true);
    eprintln!("{}", report.summary());
    report.assert_clean();
    // A run that never reached the interesting paths would show nothing:
    // each outcome the universe offers must have happened.
    let t = &report.tally;
    let plain = |snat, hairpin| Outcome::Forward {
        snat,
        hairpin,
        remapped: false,
    };
    let reply = |snat, hairpin| Outcome::Reply {
        snat,
        hairpin,
        remapped: false,
    };
    for (hook, outcome) in [
        (Hook::Tc, Outcome::Untouched),
        (Hook::Xdp, Outcome::Untouched),
        (Hook::Tc, plain(false, false)),
        (Hook::Xdp, plain(false, false)),
        (Hook::Tc, plain(true, false)),
        (Hook::Xdp, plain(true, false)),
        (Hook::Tc, plain(false, true)),
        (Hook::Tc, reply(false, false)),
        (Hook::Xdp, reply(false, false)),
        (Hook::Tc, reply(true, false)),
        (Hook::Xdp, reply(true, false)),
        (Hook::Tc, reply(false, true)),
        (Hook::Tc, Outcome::Reset),
        (Hook::Tc, Outcome::PortUnreachable),
        (Hook::Tc, Outcome::Dropped(DropReason::NoEndpoint)),
        (Hook::Xdp, Outcome::Dropped(DropReason::NoEndpoint)),
        (Hook::Tc, Outcome::Dropped(DropReason::SourceRange)),
        (Hook::Xdp, Outcome::Dropped(DropReason::SourceRange)),
        (Hook::Tc, Outcome::Dropped(DropReason::RejectImpossible)),
        (Hook::Tc, Outcome::IcmpError),
    ] {
        assert!(
            t.get(hook, outcome) > 0,
            "seed {seed:#x}: no frame was {outcome} at {hook:?}:\n{}",
            report.summary()
        );
    }
}
