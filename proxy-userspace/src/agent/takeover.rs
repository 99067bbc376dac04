//! What waits until this agent's datapath has taken the node over: a
//! conntrack map of another size (`--conntrack-max` changed) and the
//! datapaths of other layout versions are served by the older programs
//! until this agent's are attached and programmed, so their flows are
//! carried over and they are retired only then, and only once.

use tracing::{info, warn};

use crate::{datapath::Datapath, housekeeping::upgrade};

/// Whether the takeover's work has been done.
#[derive(Debug, Default)]
pub struct Takeover {
    done: bool,
}

impl Takeover {
    /// Runs `finish` the first time this agent is `serving` (its first sync
    /// is in the maps) with its programs attached to at least one
    /// interface; true when it ran.
    pub fn poll(&mut self, serving: bool, attached: bool, finish: impl FnOnce()) -> bool {
        if self.done || !serving || !attached {
            return false;
        }
        self.done = true;
        finish();
        true
    }
}

/// Carries over the last flows of a resized conntrack map and of the
/// datapaths of other layouts, and lets them go.
pub fn finish(datapath: &mut Datapath) {
    match datapath.finish_resize() {
        Some(Ok(flows)) => info!(
            flows_carried_over = flows,
            "the conntrack map of the former size is gone"
        ),
        Some(Err(e)) => warn!(error = %e, "finishing the conntrack resize"),
        None => {}
    }
    let pins = datapath.pins().clone();
    for retired in upgrade::retire_older_layouts(&pins, &mut datapath.maps) {
        info!(
            dir = %retired.dir.display(),
            flows_carried_over = retired.flows,
            "retired the datapath of an older layout version"
        );
    }
    // An older agent's programs on these same maps, until their links were
    // taken over, created flows without voiding the flow cache's absent
    // copies (`proxy_common::FLOW_CACHE_ABSENT`), which lapse within a
    // second anyway: voided at once.
    if let Err(e) = datapath.maps.bump_flow_epoch() {
        warn!(error = %e, "voiding the flow cache after the takeover");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_takeover_runs_once_when_synced_and_attached() {
        let mut takeover = Takeover::default();
        let mut runs = 0;
        for (serving, attached) in [(false, false), (false, true), (true, false)] {
            assert!(
                !takeover.poll(serving, attached, || runs += 1),
                "ran with serving={serving} attached={attached}: the older programs \
                 would be retired while this agent's serve nothing"
            );
        }
        assert_eq!(runs, 0);
        assert!(
            takeover.poll(true, true, || runs += 1),
            "synced and attached: due"
        );
        for _ in 0..3 {
            assert!(!takeover.poll(true, true, || runs += 1), "ran again");
        }
        assert_eq!(runs, 1, "the takeover's work runs exactly once");
    }
}
