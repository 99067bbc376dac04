use std::net::{Ipv4Addr, Ipv6Addr};

use proptest::prelude::*;

use proxy_common::ClusterCidrKey;

use super::*;
use crate::planner::StoredState;

/// A store that can be told to fail its n-th write, and that checks after
/// every write that the addresses and CIDRs named in `keep` are present.
#[derive(Default)]
struct CheckingStore {
    state: StoredState,
    fail_at: Option<usize>,
    writes: usize,
    keep: NodeState,
}

#[derive(Debug, thiserror::Error)]
#[error("injected failure")]
struct Injected;

impl MapStore for CheckingStore {
    type Error = Injected;
    fn apply(&mut self, op: &MapOp) -> Result<(), Injected> {
        if self.fail_at == Some(self.writes) {
            self.fail_at = None;
            return Err(Injected);
        }
        self.writes += 1;
        let _ = self.state.apply(op);
        for key in self.keep.addrs.keys() {
            assert!(
                self.state.node.addrs.contains_key(key),
                "after `{op}` node address {key:?} is missing, though both the old and the new state have it"
            );
        }
        for entry in &self.keep.cluster_cidrs {
            assert!(
                self.state.node.cluster_cidrs.contains(entry),
                "after `{op}` cluster CIDR {entry:?} is missing, though both states have it"
            );
        }
        Ok(())
    }
}

fn ip(last: u8) -> Ipv4Addr {
    Ipv4Addr::new(10, 0, 0, last)
}

fn cidr(s: &str) -> Cidr {
    Cidr::parse(s).unwrap()
}

fn desired(addrs: &[u8], nodeports: &[&str], cidrs: &[&str], udp_s: u64) -> DesiredNode {
    let cidrs: Vec<Cidr> = cidrs.iter().map(|c| cidr(c)).collect();
    let timeouts = CtTimeouts {
        udp_ns: udp_s * 1_000_000_000,
        ..CtTimeouts::DEFAULT
    };
    let mut d = DesiredNode::new(timeouts, &cidrs);
    let snat = addrs.first().map(|a| ip(*a));
    let addrs: Vec<IpAddr> = addrs.iter().map(|a| IpAddr::V4(ip(*a))).collect();
    let nodeports: Vec<Cidr> = nodeports.iter().map(|c| cidr(c)).collect();
    d.set_interfaces(&addrs, &nodeports, snat, None, true);
    d
}

/// The state `desired` describes, with `base`'s entries where it leaves a map alone.
fn expected(base: &NodeState, d: &DesiredNode) -> NodeState {
    NodeState {
        addrs: d.addrs.clone().unwrap_or_else(|| base.addrs.clone()),
        config: d.config.unwrap_or(base.config),
        config6: d.config6.unwrap_or(base.config6),
        ct_timeouts: d.ct_timeouts,
        cluster_cidrs: d.cluster_cidrs.clone(),
        service_cidrs: d.service_cidrs.clone(),
        local_ifaces: d.local_ifaces.clone(),
        pod_ifaces: d.pod_ifaces.clone(),
        shaped_ifaces: d.shaped_ifaces.clone(),
    }
}

#[test]
fn local_interfaces_and_the_detectors_flags_follow_the_desired_state() {
    use proxy_common::node_config_flags::{MASQUERADE_ALL, MASQUERADE_OFF_CLUSTER};
    let mut store = CheckingStore::default();
    let mut planner = NodePlanner::default();
    let mut want = desired(&[1], &[], &[], 30).with_masquerade_all(true);
    want.set_masquerade_off_cluster(true, false);
    want.set_local_ifaces([4, 7].into());
    // The flags set after the interfaces reach the config already known.
    want.set_interfaces(&[IpAddr::V4(ip(1))], &[], Some(ip(1)), None, true);
    assert!(planner.sync(&want, &mut store).failed.is_none());
    let node = &store.state.node;
    assert_eq!(node.local_ifaces, [4, 7].into(), "both interfaces written");
    assert_ne!(node.config.flags & MASQUERADE_ALL, 0, "--masquerade-all");
    assert_ne!(
        node.config.flags & MASQUERADE_OFF_CLUSTER,
        0,
        "IPv4 has a detector"
    );
    assert_eq!(
        node.config6.flags & MASQUERADE_OFF_CLUSTER,
        0,
        "IPv6 has none"
    );
    want.set_local_ifaces([7, 9].into());
    want.set_masquerade_off_cluster(false, true);
    let outcome = planner.sync(&want, &mut store);
    assert!(outcome.failed.is_none());
    // 9 written, 4 deleted, both configs.
    assert_eq!(outcome.ops, 4, "ops of the change");
    let node = &store.state.node;
    assert_eq!(node.local_ifaces, [7, 9].into());
    assert_eq!(node.config.flags & MASQUERADE_OFF_CLUSTER, 0);
    assert_ne!(node.config6.flags & MASQUERADE_OFF_CLUSTER, 0);
    assert_eq!(store.state.node, expected(&NodeState::default(), &want));
}

#[test]
fn a_sync_writes_the_desired_state_and_then_nothing() {
    let mut store = CheckingStore::default();
    let mut planner = NodePlanner::default();
    // 30 s: not the default timeouts a never-written planner starts from.
    let want = desired(&[1, 2], &[], &["10.244.0.0/16"], 30);
    let outcome = planner.sync(&want, &mut store);
    assert!(outcome.failed.is_none());
    // Timeouts, one CIDR, two addresses, the config.
    assert_eq!(outcome.ops, 5, "ops of a first sync");
    assert_eq!(store.state.node, expected(&NodeState::default(), &want));
    assert_eq!(planner.applied(), &store.state.node);
    assert!(planner.in_sync(&want));
    let again = planner.sync(&want, &mut store);
    assert_eq!(again.ops, 0, "an unchanged state writes nothing");
}

#[test]
fn puts_come_before_deletes_so_what_stays_is_never_missing() {
    let before = desired(&[1, 2, 3], &[], &["10.244.0.0/16", "10.245.0.0/16"], 60);
    let after = desired(
        &[2, 3, 4],
        &["10.0.0.3/32"],
        &["10.245.0.0/16", "10.246.0.0/16"],
        30,
    );
    let mut store = CheckingStore::default();
    let mut planner = NodePlanner::default();
    planner.sync(&before, &mut store);
    store.keep = NodeState {
        addrs: node_addrs(&[ip(2), ip(3)], &[]),
        cluster_cidrs: [cluster_cidr(&cidr("10.245.0.0/16"))].into(),
        ..Default::default()
    };
    let plan = planner.plan(&after);
    let first_delete = plan
        .iter()
        .position(MapOp::is_delete)
        .expect("stale entries go");
    assert!(
        plan[first_delete..].iter().all(MapOp::is_delete),
        "a put after a delete: {plan:?}"
    );
    let outcome = planner.sync(&after, &mut store);
    assert!(outcome.failed.is_none());
    assert_eq!(store.state.node, expected(&NodeState::default(), &after));
    // 10.0.0.2 changes its flags (no NodePorts any more) and is rewritten in place.
    let two = NodeAddrKey {
        addr_be: addr_words(IpAddr::V4(ip(2))),
    };
    assert_eq!(store.state.node.addrs[&two].flags, 0);
}

#[test]
fn before_the_interfaces_are_known_the_adopted_addresses_stay() {
    let adopted = expected(
        &NodeState::default(),
        &desired(&[7, 8], &[], &["10.244.0.0/16"], 60),
    );
    let mut store = CheckingStore {
        state: StoredState {
            node: adopted.clone(),
            ..Default::default()
        },
        ..Default::default()
    };
    let mut planner = NodePlanner::adopt(adopted.clone());
    let start = DesiredNode::new(CtTimeouts::DEFAULT, &[cidr("10.244.0.0/16")]);
    let outcome = planner.sync(&start, &mut store);
    assert!(outcome.failed.is_none());
    assert_eq!(store.state.node.addrs, adopted.addrs, "node addresses kept");
    assert_eq!(store.state.node.config, adopted.config, "SNAT kept");
}

#[test]
fn a_failed_write_stops_the_sync_and_the_retry_writes_only_the_rest() {
    let before = desired(&[1, 2, 3], &[], &["10.244.0.0/16"], 60);
    let after = desired(&[3, 4, 5], &[], &["10.246.0.0/16"], 30);
    for fail_at in 0..9 {
        let mut store = CheckingStore::default();
        let mut planner = NodePlanner::default();
        planner.sync(&before, &mut store);
        let planned = planner.plan(&after).len();
        store.fail_at = Some(store.writes + fail_at);
        let first = planner.sync(&after, &mut store);
        if fail_at >= planned {
            assert!(first.failed.is_none());
            continue;
        }
        let (op, _) = first.failed.as_ref().expect("the injected failure");
        assert_eq!(first.ops, fail_at, "writes before the failed `{op}`");
        assert_eq!(
            planner.applied(),
            &store.state.node,
            "the record follows what landed"
        );
        let retry = planner.sync(&after, &mut store);
        assert!(retry.failed.is_none());
        assert_eq!(
            retry.ops,
            planned - fail_at,
            "the retry rewrote what had landed"
        );
        assert_eq!(store.state.node, expected(&NodeState::default(), &after));
    }
}

#[test]
fn nodeport_addresses_pick_which_node_addresses_serve_node_ports() {
    let addrs: Vec<Ipv4Addr> = ["192.168.50.1", "10.244.0.1"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    let flags = |cidrs: &[&str]| -> Vec<u32> {
        let cidrs: Vec<Cidr> = cidrs.iter().map(|c| cidr(c)).collect();
        node_addrs(&addrs, &cidrs)
            .values()
            .map(|v| v.flags)
            .collect()
    };
    let np = node_addr_flags::NODEPORT;
    // Map order is by address: 10.244.0.1, then 192.168.50.1.
    assert_eq!(
        flags(&[]),
        [np, np],
        "no --nodeport-addresses: every address"
    );
    assert_eq!(flags(&["192.168.0.0/16"]), [0, np]);
    assert_eq!(
        flags(&["172.16.0.0/12"]),
        [0, 0],
        "still node addresses, no NodePorts"
    );
}

#[test]
fn a_dual_stack_node_serves_node_ports_on_both_families() {
    let addrs: Vec<IpAddr> = ["192.168.50.1", "fd00:1::1", "10.244.0.1", "fd00:2::1"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    let flags = |cidrs: &[&str]| -> Vec<(IpAddr, u32)> {
        let cidrs: Vec<Cidr> = cidrs.iter().map(|c| cidr(c)).collect();
        node_addrs(&addrs, &cidrs)
            .iter()
            .map(|(k, v)| (crate::planner::encode::words_addr(&k.addr_be), v.flags))
            .collect()
    };
    let np = node_addr_flags::NODEPORT;
    let at = |a: &str| -> IpAddr { a.parse().unwrap() };
    // Map order is by the 16-byte key: IPv4-mapped (`::ffff:`) before `fd00:`.
    assert_eq!(
        flags(&[]),
        [
            (at("10.244.0.1"), np),
            (at("192.168.50.1"), np),
            (at("fd00:1::1"), np),
            (at("fd00:2::1"), np)
        ],
        "no --nodeport-addresses: every address of both families"
    );
    assert_eq!(
        flags(&["fd00:1::/64", "192.168.0.0/16"]),
        [
            (at("10.244.0.1"), 0),
            (at("192.168.50.1"), np),
            (at("fd00:1::1"), np),
            (at("fd00:2::1"), 0)
        ],
        "a CIDR of each family picks within its family"
    );
    assert_eq!(
        flags(&["192.168.0.0/16"]),
        [
            (at("10.244.0.1"), 0),
            (at("192.168.50.1"), np),
            (at("fd00:1::1"), np),
            (at("fd00:2::1"), np)
        ],
        "IPv4 CIDRs only: every IPv6 address, as kube-proxy's IPv6 proxier keeps no CIDR"
    );
    assert_eq!(
        flags(&["fd00:2::/64"]),
        [
            (at("10.244.0.1"), np),
            (at("192.168.50.1"), np),
            (at("fd00:1::1"), 0),
            (at("fd00:2::1"), np)
        ],
        "IPv6 CIDRs only: every IPv4 address"
    );
}

#[test]
fn the_nodes_ipv6_address_goes_to_node_config6_and_its_cidrs_to_cluster_cidrs() {
    let v6: Ipv6Addr = "fd00:1::1".parse().unwrap();
    let mut want = DesiredNode::new(
        CtTimeouts::DEFAULT,
        &[cidr("10.244.0.0/16"), cidr("fd00:10:244::/56")],
    );
    want.set_interfaces(
        &[IpAddr::V4(ip(1)), IpAddr::V6(v6)],
        &[],
        Some(ip(1)),
        Some(v6),
        true,
    );
    let mut store = CheckingStore::default();
    let mut planner = NodePlanner::default();
    assert!(planner.sync(&want, &mut store).failed.is_none());
    let node = &store.state.node;
    assert_eq!(
        node.config6.snat_addr_be,
        addr_words(IpAddr::V6(v6)),
        "NODE_CONFIG6 holds the node's IPv6 address"
    );
    assert_eq!(node.config.snat_addr_be, addr_words(IpAddr::V4(ip(1))));
    assert!(
        node.cluster_cidrs.contains(&(
            56,
            ClusterCidrKey {
                addr_be: addr_words("fd00:10:244::".parse().unwrap())
            }
        )),
        "the IPv6 pod CIDR, its own prefix length: {:?}",
        node.cluster_cidrs
    );
    assert!(node.addrs.contains_key(&NodeAddrKey {
        addr_be: addr_words(IpAddr::V6(v6))
    }));
    // The node loses its IPv6 address: NODE_CONFIG6 goes back to zeros.
    want.set_interfaces(&[IpAddr::V4(ip(1))], &[], Some(ip(1)), None, true);
    assert!(planner.sync(&want, &mut store).failed.is_none());
    assert_eq!(store.state.node.config6.snat_addr_be, [0; 4]);
}

#[test]
fn one_address_encoding_for_every_node_map() {
    let config = node_config(Some(ip(9)), false);
    let addrs = node_addrs(&[ip(9)], &[]);
    let key = addrs.keys().next().unwrap();
    assert_eq!(config.snat_addr_be, key.addr_be);
    assert_eq!(
        config.snat_addr_be,
        proxy_common::v4_mapped(u32::from_ne_bytes(ip(9).octets())),
        "IPv4-mapped, network byte order"
    );
    let (prefix, cidr_key) = cluster_cidr(&cidr("10.0.0.0/8"));
    assert_eq!(prefix, 96 + 8);
    assert_eq!(cidr_key.addr_be[..3], key.addr_be[..3], "the same mapping");
}

fn arb_desired() -> impl Strategy<Value = DesiredNode> {
    (
        proptest::collection::btree_set(1u8..8, 0..5),
        proptest::collection::btree_set(0u8..4, 0..3),
        prop_oneof![Just(30u64), Just(60)],
        any::<bool>(),
    )
        .prop_map(|(addrs, cidrs, udp, known)| {
            let cidrs: Vec<String> = cidrs
                .iter()
                .map(|c| format!("10.{}.0.0/16", 240 + c))
                .collect();
            let cidrs: Vec<&str> = cidrs.iter().map(String::as_str).collect();
            let addrs: Vec<u8> = addrs.into_iter().collect();
            let mut d = desired(&addrs, &["10.0.0.0/30"], &cidrs, udp);
            if !known {
                d.addrs = None;
                d.config = None;
                d.config6 = None;
            }
            d
        })
}

proptest! {
    /// Any sequence of desired states, with a failure injected anywhere,
    /// ends, after retries, with the maps holding the last one.
    #[test]
    fn any_sequence_with_failures_converges(
        steps in proptest::collection::vec((arb_desired(), proptest::option::of(0usize..6)), 1..8)
    ) {
        let mut store = CheckingStore::default();
        let mut planner = NodePlanner::default();
        let mut base = NodeState::default();
        for (want, fail) in &steps {
            store.fail_at = fail.map(|f| store.writes + f);
            let mut tries = 0;
            while planner.sync(want, &mut store).failed.is_some() {
                tries += 1;
                prop_assert!(tries < 3, "a single injected failure needs one retry");
            }
            base = expected(&base, want);
            prop_assert_eq!(&store.state.node, &base);
            prop_assert_eq!(planner.applied(), &base);
        }
    }
}

/// `SERVICE_CIDRS` holds the service CIDRs as ranges and every ClusterIP as
/// held, both families; a ClusterIP that goes is deleted, the ranges stay
/// (written before any delete runs).
#[test]
fn service_cidrs_and_cluster_ips_follow_the_desired_state() {
    use proxy_common::service_cidr::{HELD, RANGE};
    let mut store = CheckingStore::default();
    let mut planner = NodePlanner::default();
    let mut want = desired(&[1], &[], &[], 30);
    want.set_service_ranges(&[cidr("10.96.0.0/12"), cidr("fd00:96::/112")]);
    let (a, b, c): (IpAddr, IpAddr, IpAddr) = (
        "10.96.0.10".parse().unwrap(),
        "10.96.0.11".parse().unwrap(),
        "fd00:96::a".parse().unwrap(),
    );
    want.set_cluster_ips([(a, true), (b, true), (c, true)]);
    planner.sync(&want, &mut store);
    let held = |state: &NodeState| -> Vec<String> {
        let mut held: Vec<String> = state
            .service_cidrs
            .iter()
            .map(|(entry, kind)| {
                format!(
                    "{} {kind}",
                    crate::planner::encode::cluster_cidr_string(entry)
                )
            })
            .collect();
        held.sort();
        held
    };
    assert_eq!(
        held(&store.state.node),
        [
            format!("10.96.0.0/12 {RANGE}"),
            format!("10.96.0.10/32 {HELD}"),
            format!("10.96.0.11/32 {HELD}"),
            format!("fd00:96::/112 {RANGE}"),
            format!("fd00:96::a/128 {HELD}"),
        ],
        "SERVICE_CIDRS after the first sync",
    );
    want.set_cluster_ips([(a, true)]);
    let ops = planner.plan(&want);
    assert_eq!(ops.len(), 2, "two ClusterIPs went: {ops:?}");
    assert!(
        ops.iter()
            .all(|op| matches!(op, MapOp::DeleteServiceCidr { .. }))
    );
    planner.sync(&want, &mut store);
    assert_eq!(store.state.node, expected(&store.state.node, &want));
    assert!(planner.in_sync(&want));
}

/// The node maps a sync of one IPv4 address and `--masquerade-all` writes,
/// with `setting` applied to what is wanted: for the tests of one
/// `NODE_CONFIG` flag beside `MASQUERADE_ALL`'s.
fn synced_with_masquerade_all(setting: impl FnOnce(DesiredNode) -> DesiredNode) -> NodeState {
    let mut store = CheckingStore::default();
    let mut planner = NodePlanner::default();
    let mut want = setting(desired(&[1], &[], &[], 30)).with_masquerade_all(true);
    want.set_interfaces(&[IpAddr::V4(ip(1))], &[], Some(ip(1)), None, true);
    assert!(planner.sync(&want, &mut store).failed.is_none());
    store.state.node
}

#[test]
fn lb_mode_sets_the_dsr_flags_in_the_ipv4_config_both_families_read() {
    use proxy_common::node_config_flags::{DSR, DSR_TCP_ONLY, MASQUERADE_ALL};
    for (mode, want_flags) in [
        (LbMode::Snat, 0),
        (LbMode::Dsr, DSR),
        (LbMode::Hybrid, DSR | DSR_TCP_ONLY),
    ] {
        let node = &synced_with_masquerade_all(|want| want.with_lb_mode(mode));
        assert_eq!(
            node.config.flags & (DSR | DSR_TCP_ONLY),
            want_flags,
            "--lb-mode {mode:?}: NODE_CONFIG's flags {:#x}",
            node.config.flags
        );
        assert_ne!(
            node.config.flags & MASQUERADE_ALL,
            0,
            "--lb-mode {mode:?} left --masquerade-all's flag alone"
        );
        assert_eq!(
            node.config6.flags & (DSR | DSR_TCP_ONLY),
            0,
            "IPv6's config holds no DSR flag: IPv4's is read for both"
        );
    }
}

#[test]
fn host_routing_bpf_sets_its_flag_and_keeps_the_pod_interfaces_the_stack_has_none_of() {
    use proxy_common::node_config_flags::{HOST_ROUTING_BPF, MASQUERADE_ALL};
    for (routing, on) in [(HostRouting::Stack, false), (HostRouting::Bpf, true)] {
        let mut store = CheckingStore::default();
        let mut planner = NodePlanner::default();
        let mut want = desired(&[1], &[], &[], 30)
            .with_masquerade_all(true)
            .with_host_routing(routing);
        want.set_pod_ifaces([5, 8].into(), &BTreeSet::new());
        want.set_interfaces(&[IpAddr::V4(ip(1))], &[], Some(ip(1)), None, true);
        assert!(planner.sync(&want, &mut store).failed.is_none());
        let node = &store.state.node;
        assert_eq!(
            node.config.flags & HOST_ROUTING_BPF != 0,
            on,
            "{routing:?}: NODE_CONFIG's flags {:#x}",
            node.config.flags
        );
        assert_ne!(node.config.flags & MASQUERADE_ALL, 0, "{routing:?}");
        assert_eq!(
            node.config6.flags & HOST_ROUTING_BPF,
            0,
            "IPv4's is read for both"
        );
        let kept: BTreeSet<u32> = if on { [5, 8].into() } else { BTreeSet::new() };
        assert_eq!(node.pod_ifaces, kept, "{routing:?}: POD_IFACES");
        assert!(
            node.local_ifaces.is_empty(),
            "{routing:?}: LOCAL_IFACES untouched"
        );
        // A pod gone, another come: one write, one delete (none for the stack).
        want.set_pod_ifaces([8, 11].into(), &BTreeSet::new());
        let outcome = planner.sync(&want, &mut store);
        assert!(outcome.failed.is_none());
        assert_eq!(
            outcome.ops,
            if on { 2 } else { 0 },
            "{routing:?}: ops of the change"
        );
        assert_eq!(store.state.node, expected(&NodeState::default(), &want));
    }
}

/// A pod interface that carries a qdisc is held in `SHAPED_IFACES` and not in
/// `POD_IFACES` (no packet goes into it or out of it by a redirect), and moves
/// between them as its qdisc comes and goes; with the stack routing neither map
/// holds anything.
#[test]
fn shaped_pod_interfaces_are_held_apart_from_the_pod_interfaces() {
    for (routing, on) in [(HostRouting::Stack, false), (HostRouting::Bpf, true)] {
        let mut store = CheckingStore::default();
        let mut planner = NodePlanner::default();
        let mut want = desired(&[1], &[], &[], 30).with_host_routing(routing);
        want.set_pod_ifaces([5, 8, 11].into(), &[8, 42].into());
        want.set_interfaces(&[IpAddr::V4(ip(1))], &[], Some(ip(1)), None, true);
        assert!(planner.sync(&want, &mut store).failed.is_none());
        let node = &store.state.node;
        let (pods, shaped): (BTreeSet<u32>, BTreeSet<u32>) = if on {
            ([5, 11].into(), [8].into())
        } else {
            (BTreeSet::new(), BTreeSet::new())
        };
        assert_eq!(node.pod_ifaces, pods, "{routing:?}: POD_IFACES");
        assert_eq!(
            node.shaped_ifaces, shaped,
            "{routing:?}: SHAPED_IFACES (42 is no pod's)"
        );
        // 8's qdisc gone, 5 shaped: two moves, each a delete and a write.
        want.set_pod_ifaces([5, 8, 11].into(), &[5].into());
        let outcome = planner.sync(&want, &mut store);
        assert!(outcome.failed.is_none());
        assert_eq!(
            outcome.ops,
            if on { 4 } else { 0 },
            "{routing:?}: ops of the change"
        );
        assert_eq!(store.state.node, expected(&NodeState::default(), &want));
    }
}

#[test]
fn socket_lb_pods_sets_its_flag_in_the_ipv4_config_both_families_read() {
    use proxy_common::node_config_flags::{MASQUERADE_ALL, SOCKET_LB_PODS};
    for (socket_lb, on) in [(SocketLb::Node, false), (SocketLb::NodeAndPods, true)] {
        let node = &synced_with_masquerade_all(|want| want.with_socket_lb(socket_lb));
        assert_eq!(
            node.config.flags & SOCKET_LB_PODS != 0,
            on,
            "{socket_lb:?}: NODE_CONFIG's flags {:#x}",
            node.config.flags
        );
        assert_ne!(
            node.config.flags & MASQUERADE_ALL,
            0,
            "{socket_lb:?} left --masquerade-all's flag alone"
        );
        assert_eq!(
            node.config6.flags & SOCKET_LB_PODS,
            0,
            "IPv6's config holds no such flag: IPv4's is read for both"
        );
    }
}
