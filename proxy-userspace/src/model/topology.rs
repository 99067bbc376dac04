//! Topology-aware routing: which ready endpoints Cluster traffic may use on
//! this node (kube-proxy's `topologyModeFromHints` / `availableForTopology`).
//!
//! kube-proxy reads only the hints, never `spec.trafficDistribution` or the
//! topology-mode annotation: the EndpointSlice controller turns those into
//! hints (`PreferClose` / `PreferSameZone` into zone hints, `PreferSameNode` into
//! node hints as well), so hints present means the Service asked for them.
//! The rule is all-or-nothing: hints are followed only when every ready
//! endpoint carries them and at least one is for this node (or zone);
//! otherwise every ready endpoint is used, so filtering never leaves the
//! set empty.

use super::{NodeInfo, slice::Endpoint};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// No filtering.
    All,
    /// Only endpoints hinted for this node.
    SameNode,
    /// Only endpoints hinted for this node's zone.
    SameZone,
}

/// How to filter ready endpoints on this node. Node hints win over zone
/// hints, as in kube-proxy with `PreferSameTrafficDistribution` on.
pub(super) fn mode(endpoints: &[Endpoint<'_>], node: &NodeInfo) -> Mode {
    let zone = node.zone.as_deref();
    let mut any_ready = false;
    let (mut all_node_hints, mut hint_for_node) = (true, false);
    let (mut all_zone_hints, mut hint_for_zone) = (true, false);
    for endpoint in endpoints.iter().filter(|e| e.ready()) {
        any_ready = true;
        let source = endpoint.source;
        if source.node_hints().is_empty() {
            all_node_hints = false;
        } else if source.node_hints().iter().any(|h| **h == *node.name) {
            hint_for_node = true;
        }
        if source.zone_hints().is_empty() {
            all_zone_hints = false;
        } else if zone.is_some_and(|z| source.zone_hints().iter().any(|h| &**h == z)) {
            hint_for_zone = true;
        }
    }
    if !any_ready {
        Mode::All
    } else if all_node_hints && hint_for_node {
        Mode::SameNode
    } else if all_zone_hints && hint_for_zone {
        Mode::SameZone
    } else {
        Mode::All
    }
}

/// Whether `endpoint` may take this node's Cluster traffic under `mode`.
pub(super) fn allows(mode: Mode, endpoint: &Endpoint<'_>, node: &NodeInfo) -> bool {
    match mode {
        Mode::All => true,
        Mode::SameNode => endpoint
            .source
            .node_hints()
            .iter()
            .any(|h| **h == *node.name),
        Mode::SameZone => node
            .zone
            .as_deref()
            .is_some_and(|z| endpoint.source.zone_hints().iter().any(|h| &**h == z)),
    }
}
