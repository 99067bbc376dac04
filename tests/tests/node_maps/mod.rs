//! Node-level maps written as the agent writes them (its node planner),
//! for tests that run the programs on hand-built frames.

use std::net::IpAddr;

use proxy_userspace::{
    datapath::maps::Maps,
    model::Cidr,
    planner::node::{DesiredNode, NodePlanner},
};

/// Writes `SERVICE_CIDRS`: `ranges` as service CIDRs, `held` as this
/// proxy's ClusterIPs and `foreign` as another proxy's; entries of an
/// earlier call that these leave out are deleted.
pub fn write_service_cidrs(maps: &mut Maps, ranges: &[&str], held: &[IpAddr], foreign: &[IpAddr]) {
    let ranges: Vec<Cidr> = ranges
        .iter()
        .map(|c| Cidr::parse(c).unwrap_or_else(|| panic!("{c:?} is not a CIDR")))
        .collect();
    let mut desired = DesiredNode::new(proxy_common::CtTimeouts::DEFAULT, &[]);
    desired.set_service_ranges(&ranges);
    let ours = held.iter().map(|ip| (*ip, true));
    desired.set_cluster_ips(ours.chain(foreign.iter().map(|ip| (*ip, false))));
    let mut planner = NodePlanner::adopt(maps.read_node_state().expect("reading the node maps"));
    let outcome = planner.sync(&desired, maps);
    assert!(
        outcome.failed.is_none(),
        "writing SERVICE_CIDRS: {:?}",
        outcome.failed
    );
}
