//! Keeping the kernel state the datapath leaves behind in order: policy over
//! the maps and sockets, not loading them (that is `datapath`). One module,
//! because every part answers the same question, what may go now that
//! something changed, and each is found by its job:
//!
//! - `conntrack`: the flows and affinity of departed backends purged, idle
//!   flows reaped, flows carried into this agent's conntrack;
//! - `ct_sources`: each client's count of live assured flows, taken again
//!   as each reap reads conntrack;
//! - `sock_diag` and `sock_notes`: the node's UDP sockets the socket hooks
//!   connected to a departed backend, found through the hooks' notes and
//!   closed;
//! - the prefilter's bits of departed frontends and backends cleared, by a
//!   rebuild from what the maps hold (`rebuild_prefilter`), and backends'
//!   source bits once no earlier agent's programs read them
//!   (`retire_source_bits`);
//! - earlier agents' pinned `TC_NEXT` and `TC_DSR` arrays, once their
//!   `tc_ingress` runs nowhere (`retire_unread_tail_calls`);
//! - `upgrade`: the datapaths of other layout versions retired, their flows
//!   kept.

pub mod conntrack;
pub mod ct_sources;
pub mod sock_diag;
pub mod sock_notes;
pub mod upgrade;

use std::time::Duration;

use tracing::{debug, info, warn};

use crate::{
    datapath::{Datapath, prefilter_flows::FlowMarks, prefilter_rebuild},
    planner::{AffinityPurge, Departed},
};

/// How often idle conntrack entries are reaped.
pub const REAP_PERIOD: Duration = Duration::from_secs(10);

/// Backends left their Services: their UDP flows and affinity entries go
/// (the latter where their Service has affinity), and the node's sockets
/// the hooks connected to them are closed, so the next datagram finds a
/// live backend; and so do the affinity entries of Services whose affinity
/// went off (`affinity.dropped`). A failure is logged; false when either
/// the maps' purge or the sockets' closing failed (but for a kernel that
/// cannot close sockets), for the sync loop to try all of it again.
pub fn clean_departed(
    datapath: &mut Datapath,
    departed: &[Departed],
    affinity: &AffinityPurge,
) -> bool {
    let purged = match conntrack::purge_departed(&mut datapath.maps, departed, affinity) {
        Ok(swept) => {
            if swept != conntrack::Swept::default() {
                info!(
                    udp_flows = swept.conntrack,
                    affinities = swept.affinity,
                    "removed flows of departed backends and affinity entries"
                );
            }
            true
        }
        Err(e) => {
            warn!(error = %e, "cleaning flows of departed backends and affinity entries");
            false
        }
    };
    let pins = datapath.pins();
    match sock_diag::close_departed(&pins.sock_notes(), &pins.sock_notes6(), departed) {
        Ok(0) => {}
        Ok(closed) => {
            info!("closed {closed} UDP sockets of the node connected to departed backends");
        }
        Err(e) => {
            warn!(error = %e, "closing the node's UDP sockets of departed backends");
            // A kernel that cannot close sockets never will: the purge is
            // not tried again for them.
            if !e.unsupported() {
                return false;
            }
        }
    }
    purged
}

/// Removes conntrack entries idle past their timeout, counting each
/// client's live assured flows as it goes, then writes the counts
/// (`ct_sources`), then rebuilds the prefilter where it is due, and lets go
/// of what earlier agents' programs no longer read.
pub fn reap_conntrack(datapath: &mut Datapath) {
    let now = conntrack::monotonic_ns();
    let (maps, reap) = datapath.conntrack_reaping();
    let mut tally = ct_sources::Tally::default();
    match conntrack::reap_expired(maps, &reap, now, &mut tally) {
        Ok(0) => {}
        Ok(n) => debug!(entries = n, "reaped idle conntrack entries"),
        Err(e) => warn!(error = %e, "reaping conntrack"),
    }
    match ct_sources::write(&mut datapath.maps, &tally) {
        Ok(0) => {}
        Ok(n) => debug!(clients = n, "recounted clients' assured flows"),
        Err(e) => warn!(error = %e, "recounting clients' assured flows"),
    }
    rebuild_prefilter(datapath);
    refresh_flow_marks(datapath);
    retire_source_bits(datapath);
    retire_unread_tail_calls(datapath);
}

/// Whether this agent's programs are attached anywhere: from then on no
/// earlier agent's run on these pins (each interface pass attaches to
/// every interface, taking over the links it finds).
fn programs_attached(datapath: &Datapath) -> bool {
    datapath.attached().next().is_some() || datapath.xdp_attached().next().is_some()
}

/// The prefilter's backend source bits cleared (`prefilter_rebuild::retire_sources`)
/// once this agent's programs are attached: only an earlier agent's
/// programs read them. Asked after each interface pass and at each reap;
/// a failure is logged, the bits kept, and the next asking tries again.
pub fn retire_source_bits(datapath: &mut Datapath) {
    if !programs_attached(datapath) {
        return;
    }
    match prefilter_rebuild::retire_sources(&datapath.maps) {
        Ok(Some(rebuilt)) => info!(
            fill = rebuilt.fill(),
            words_changed = rebuilt.changed,
            "prefilter rebuilt without backends' source bits, which only earlier agents' programs read"
        ),
        Ok(None) => {}
        Err(e) => warn!(error = %e, "clearing the prefilter's backend source bits"),
    }
}

/// What an interface pass lets go, once it has attached this agent's
/// programs: the flow marks owed since the load settled, the backends'
/// source bits cleared and the earlier agents' program arrays unpinned,
/// none of which this agent's programs need and an earlier agent's may.
pub fn after_interface_pass(datapath: &mut Datapath) {
    settle_owed_flow_marks(datapath);
    retire_source_bits(datapath);
    retire_unread_tail_calls(datapath);
}

/// The `TC_NEXT` and `TC_DSR` arrays of earlier agents unpinned once their
/// `tc_ingress` is linked nowhere (`Datapath::retire_unread_tail_calls`):
/// until then it still runs somewhere, and hands IPv6 and direct server
/// return arrivals to them. Asked after each interface pass and at each
/// reap; what cannot go yet is asked again.
pub fn retire_unread_tail_calls(datapath: &Datapath) {
    match datapath.retire_unread_tail_calls(programs_attached(datapath)) {
        Ok(0) => {}
        Ok(retired) => info!(
            retired,
            "unpinned earlier agents' program arrays, which no linked tc program reads"
        ),
        Err(e) => warn!(error = %e, "earlier agents' program arrays kept"),
    }
}

/// The prefilter's flow marks refreshed where due (`FlowMarks::refresh_due`):
/// both halves at once where they were opened, one otherwise. Only once
/// this agent's programs are attached: until then an earlier agent's may
/// still be making flows it does not mark. A failure is logged, and the
/// half it was refreshing left marked whole.
pub fn refresh_flow_marks(datapath: &mut Datapath) {
    if !programs_attached(datapath) {
        return;
    }
    let Some(marks) = &datapath.maps.prefilter_flows else {
        return;
    };
    let rounds = if marks.owed() { 2 } else { 1 };
    for _ in 0..rounds {
        if !marks.refresh_due() {
            return;
        }
        match prefilter_rebuild::refresh_flows(&datapath.maps) {
            Ok(Some(refreshed)) => debug!(
                half = refreshed.half,
                live = refreshed.live,
                marked = refreshed.marked,
                "prefilter's flow marks refreshed from conntrack"
            ),
            Ok(None) => {}
            Err(e) => {
                warn!(error = %e, "refreshing the prefilter's flow marks");
                return;
            }
        }
    }
}

/// The refresh the flows' marks owe since they were opened (at load, after
/// a carry), once this agent's programs are attached: asked after each
/// interface pass, which is where they are. Whether a refresh is due for
/// marks that owe none is the reap's question (`refresh_flow_marks`),
/// which counts the marked slots, a pass over the 4 MiB array: not one to
/// ask at every interface change.
pub fn settle_owed_flow_marks(datapath: &mut Datapath) {
    if datapath
        .maps
        .prefilter_flows
        .as_ref()
        .is_some_and(FlowMarks::owed)
    {
        refresh_flow_marks(datapath);
    }
}

/// The prefilter's bits written again once enough frontends and backends
/// went (`Prefilter::rebuild_due`): what they leave set costs packets for no
/// Service the full path, and only a rebuild clears it. A failure is
/// logged and the bits stay as they were, a superset of what is needed.
pub fn rebuild_prefilter(datapath: &mut Datapath) {
    let due = datapath
        .maps
        .prefilter
        .as_ref()
        .is_some_and(|p| p.rebuild_due());
    if !due {
        return;
    }
    match prefilter_rebuild::rebuild(&datapath.maps) {
        Ok(Some(rebuilt)) => debug!(
            fill = rebuilt.fill(),
            words_changed = rebuilt.changed,
            "prefilter rebuilt from the maps"
        ),
        Ok(None) => {}
        Err(e) => warn!(error = %e, "rebuilding the prefilter"),
    }
}
