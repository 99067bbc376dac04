//! From checked EndpointSlices to the endpoints of one service port, and
//! from those to the Cluster and Local sets (kube-proxy's
//! `endpointslicecache.go` and `CategorizeEndpoints` in `topology.go`).

use std::collections::BTreeMap;

use super::{
    BackendAddr, NodeInfo, Protocol,
    family::Family,
    slice::{Endpoint, ParsedSlice},
    topology,
};

/// The endpoints of the service port (`port_name`, `protocol`) in `family`,
/// one per ip:port, sorted by kube-proxy's "ip:port" string.
///
/// `slices` should be in a stable order (by name): when two copies of an
/// endpoint are equally good, the first is kept.
pub(super) fn endpoints_for_port<'a>(
    slices: &[&'a ParsedSlice],
    family: Family,
    port_name: &str,
    protocol: Protocol,
    node: &NodeInfo,
) -> Vec<Endpoint<'a>> {
    let mut by_host_port: BTreeMap<[u8; 48], Endpoint<'a>> = BTreeMap::new();
    for slice in slices.iter().filter(|s| s.family == family) {
        for port in slice
            .ports
            .iter()
            .filter(|p| &*p.name == port_name && p.protocol == protocol)
        {
            for source in &slice.endpoints {
                let local = !node.name.is_empty()
                    && source.node_name.as_deref() == Some(node.name.as_str());
                let endpoint = Endpoint {
                    addr: BackendAddr {
                        ip: source.ip,
                        port: port.port,
                        protocol,
                        local,
                        terminating: source.terminating,
                    },
                    source,
                };
                // The map iterates in byte order of the "ip:port" key,
                // which is Go's string order: the order kube-proxy sorts by.
                by_host_port
                    .entry(endpoint.addr.host_port_key())
                    .and_modify(|kept| {
                        if endpoint.preference() > kept.preference() {
                            *kept = endpoint;
                        }
                    })
                    .or_insert(endpoint);
            }
        }
    }
    by_host_port.into_values().collect()
}

/// The endpoint sets of one service port on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Categorized {
    /// For Cluster traffic policy: ready endpoints (topology-filtered), or
    /// serving-terminating ones when no endpoint is ready.
    pub(super) cluster: Vec<BackendAddr>,
    /// For Local traffic policy: local ready endpoints, or local
    /// serving-terminating ones when no local endpoint is ready. Topology
    /// does not apply.
    pub(super) local: Vec<BackendAddr>,
    /// Some endpoint anywhere is usable: what decides between REJECT ("no
    /// endpoints") and DROP ("no local endpoints").
    pub(super) has_any: bool,
}

/// kube-proxy's `CategorizeEndpoints`, with both sets always computed.
pub(super) fn categorize(endpoints: &[Endpoint<'_>], node: &NodeInfo) -> Categorized {
    let mode = topology::mode(endpoints, node);
    // Sized for all of them, as most are ready: grown from nothing, the
    // set's reallocations were a tenth of a first sync's model. It is
    // transient (each frontend copies its set).
    let mut cluster: Vec<BackendAddr> = Vec::with_capacity(endpoints.len());
    cluster.extend(
        endpoints
            .iter()
            .filter(|e| e.ready() && topology::allows(mode, e, node))
            .map(|e| e.addr),
    );
    if cluster.is_empty() {
        // Topology only filters when it leaves some ready endpoint, so an
        // empty set here means nothing is ready anywhere.
        cluster = endpoints
            .iter()
            .filter(|e| e.serving_terminating())
            .map(|e| e.addr)
            .collect();
    }

    let mut local: Vec<BackendAddr> = endpoints
        .iter()
        .filter(|e| e.addr.local && e.ready())
        .map(|e| e.addr)
        .collect();
    if local.is_empty() {
        local = endpoints
            .iter()
            .filter(|e| e.addr.local && e.serving_terminating())
            .map(|e| e.addr)
            .collect();
    }

    let has_any = endpoints
        .iter()
        .any(|e| e.ready() || e.serving_terminating());
    Categorized {
        cluster,
        local,
        has_any,
    }
}
