//! Where XDP goes (docs/operations.md, "Where XDP goes"), on real interfaces in
//! network namespaces: a node whose uplink `eth0` is a veth carrying its default route
//! (kind-style), a bridge `cni0` with the pods' gateway address (flannel's, k3s'), a
//! pod's veth enslaved to it, and a routed pod's host-side veth carrying a global /32
//! of its own (ptp-style). tc goes on all four; XDP by default nowhere but the uplinks,
//! and never generic: on this node, whose one uplink is a veth, `auto` leaves all to
//! tc; `native` and `generic` put XDP on `eth0` alone, and `--xdp-interfaces` on the
//! bridge or the pods' veths too (the kernel takes XDP on a bridge or on its ports,
//! not both). The agent's XDP state is read from the kernel
//! (`ip link`), its pins from `ebpf-proxy status`.
//!
//! Each test builds its own namespaces (unique names, deleted on drop, also when it
//! fails), bpffs root and manifest directory.

use std::time::Duration;

use ebpf_proxy_tests::{
    agent::Agent,
    eventually,
    manifest::ManifestDir,
    netns::{NetNs, unique_stem},
    require_root,
};

const UPLINK: &str = "eth0";
const BRIDGE: &str = "cni0";
/// The bridged pod's veth, a port of [`BRIDGE`].
const BRIDGED_POD: &str = "vb-pod1";
/// The routed pod's host-side veth, with a /32 of its own.
const ROUTED_POD: &str = "vr-pod2";
/// A second uplink, added while the agent runs.
const LATE_UPLINK: &str = "eth1";
const ALL: [&str; 4] = [UPLINK, BRIDGE, BRIDGED_POD, ROUTED_POD];
const WAIT: Duration = Duration::from_secs(10);

/// The node and the namespaces at the other ends of its veths. Fields drop in
/// order: the node first (and with it every veth and the bridge).
struct Node {
    ns: NetNs,
    outside: NetNs,
    _pods: Vec<NetNs>,
    manifests: ManifestDir,
}

impl Node {
    fn new() -> Node {
        require_root().expect("privileged test");
        let stem = unique_stem();
        let ns = NetNs::create(&format!("{stem}-node")).expect("node namespace");
        let outside = NetNs::create(&format!("{stem}-out")).expect("outside namespace");
        let pod1 = NetNs::create(&format!("{stem}-pod1")).expect("pod namespace");
        let pod2 = NetNs::create(&format!("{stem}-pod2")).expect("pod namespace");
        let manifests = ManifestDir::create(&stem).expect("manifest dir");
        let node = Node {
            ns,
            outside,
            _pods: Vec::new(),
            manifests,
        };
        let run = |ns: &NetNs, args: &[&str]| {
            ns.ip(args)
                .unwrap_or_else(|e| panic!("ip {}: {e:#}", args.join(" ")))
        };
        let n = &node.ns;
        // The uplink: a veth to the outside, holding the node's address and its
        // default route.
        run(
            n,
            &[
                "link",
                "add",
                UPLINK,
                "type",
                "veth",
                "peer",
                "name",
                "up0",
                "netns",
                node.outside.name(),
            ],
        );
        run(n, &["addr", "add", "192.168.77.2/24", "dev", UPLINK]);
        run(n, &["link", "set", UPLINK, "up"]);
        run(n, &["route", "add", "default", "via", "192.168.77.1"]);
        run(
            &node.outside,
            &["addr", "add", "192.168.77.1/24", "dev", "up0"],
        );
        run(&node.outside, &["link", "set", "up0", "up"]);
        // The bridge with the pods' gateway address, and a pod's veth on it.
        run(n, &["link", "add", BRIDGE, "type", "bridge"]);
        run(n, &["addr", "add", "10.42.0.1/24", "dev", BRIDGE]);
        run(n, &["link", "set", BRIDGE, "up"]);
        run(
            n,
            &[
                "link",
                "add",
                BRIDGED_POD,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                pod1.name(),
            ],
        );
        run(n, &["link", "set", BRIDGED_POD, "master", BRIDGE]);
        run(n, &["link", "set", BRIDGED_POD, "up"]);
        run(&pod1, &["addr", "add", "10.42.0.5/24", "dev", "eth0"]);
        run(&pod1, &["link", "set", "eth0", "up"]);
        // A routed pod whose host-side veth has a global /32 (the gateway's, as
        // the ptp plugin gives it) and a host route to the pod.
        run(
            n,
            &[
                "link",
                "add",
                ROUTED_POD,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                pod2.name(),
            ],
        );
        run(n, &["addr", "add", "10.42.1.1/32", "dev", ROUTED_POD]);
        run(n, &["link", "set", ROUTED_POD, "up"]);
        run(n, &["route", "add", "10.42.1.5/32", "dev", ROUTED_POD]);
        run(&pod2, &["addr", "add", "10.42.1.5/32", "dev", "eth0"]);
        run(&pod2, &["link", "set", "eth0", "up"]);
        Node {
            _pods: vec![pod1, pod2],
            ..node
        }
    }

    fn agent(&self, args: &[&str]) -> Agent {
        Agent::start_with(&self.ns, self.manifests.path(), args)
            .unwrap_or_else(|e| panic!("agent with {args:?}: {e:#}"))
    }

    /// The mode of the XDP program on `ifname` as `ip link` shows it (`xdp`,
    /// `xdpgeneric`, ...), None without one.
    fn xdp(&self, ifname: &str) -> Option<String> {
        let out = self
            .ns
            .ip(&["link", "show", "dev", ifname])
            .unwrap_or_else(|e| panic!("ip link show {ifname}: {e:#}"));
        let first = out.lines().next().unwrap_or_default();
        first
            .split_whitespace()
            .find(|t| t.starts_with("xdp"))
            .map(|t| t.split('/').next().unwrap_or(t).to_owned())
    }

    /// Every interface of [`ALL`] with its XDP mode, for failure messages.
    fn xdp_state(&self) -> String {
        ALL.iter()
            .map(|i| format!("{i}: {:?}", self.xdp(i)))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Waits until each of `expected` has XDP in its mode (None: none).
    #[track_caller]
    fn wait_for(&self, what: &str, expected: &[(&str, Option<&str>)]) {
        eventually(what, WAIT, || {
            let wrong: Vec<String> = expected
                .iter()
                .filter(|(i, mode)| self.xdp(i).as_deref() != *mode)
                .map(|(i, mode)| format!("{i} has {:?}, not {mode:?}", self.xdp(i)))
                .collect();
            if wrong.is_empty() {
                Ok(())
            } else {
                Err(format!("{}; all: {}", wrong.join("; "), self.xdp_state()))
            }
        });
    }
}

/// tc ingress on every interface, whatever XDP does.
#[track_caller]
fn assert_tc_everywhere(agent: &Agent) {
    let status = agent.status().expect("status");
    for ifname in ALL {
        assert!(
            status.contains(&format!("tc-ingress-{ifname}")),
            "no tc link on {ifname}:\n{status}"
        );
    }
}

/// The default: XDP only on uplinks, native only. This node's one uplink is a veth
/// (whose frames may carry partial checksums), so XDP goes nowhere and says why; the
/// bridge and the pods' veths, with global addresses of their own, get none either.
#[test]
fn by_default_xdp_goes_nowhere_but_native_on_uplinks() {
    let node = Node::new();
    let agent = node.agent(&[]);
    eventually("the veth uplink left to tc, logged", WAIT, || {
        let log = agent.log();
        if log.contains("no XDP on this veth uplink") && log.contains(UPLINK) {
            Ok(())
        } else {
            Err("not logged yet".into())
        }
    });
    node.wait_for("no XDP anywhere", &ALL.map(|i| (i, None::<&str>)));
    assert_tc_everywhere(&agent);
    let status = agent.status().expect("status");
    assert!(!status.contains("xdp-"), "an XDP link pinned:\n{status}");
}

/// `--xdp-mode native`: native XDP on the uplink, nowhere else; a second uplink
/// (an address and its network on a new veth) gets it when it appears, and loses it
/// when its address goes.
#[test]
fn native_goes_on_the_uplinks_alone_and_follows_them() {
    let node = Node::new();
    let agent = node.agent(&["--xdp-mode", "native"]);
    node.wait_for(
        "native XDP on the uplink alone",
        &[
            (UPLINK, Some("xdp")),
            (BRIDGE, None),
            (BRIDGED_POD, None),
            (ROUTED_POD, None),
        ],
    );
    assert_tc_everywhere(&agent);
    let status = agent.status().expect("status");
    assert!(status.contains("xdp-eth0"), "{status}");
    for other in [BRIDGE, BRIDGED_POD, ROUTED_POD] {
        assert!(!status.contains(&format!("xdp-{other}")), "{status}");
    }

    node.ns
        .ip(&[
            "link",
            "add",
            LATE_UPLINK,
            "type",
            "veth",
            "peer",
            "name",
            "up1",
            "netns",
            node.outside.name(),
        ])
        .expect("second uplink");
    node.ns.ip(&["link", "set", LATE_UPLINK, "up"]).expect("up");
    node.ns
        .ip(&["addr", "add", "192.168.78.2/24", "dev", LATE_UPLINK])
        .expect("address");
    node.wait_for(
        "native XDP on the new uplink",
        &[(LATE_UPLINK, Some("xdp")), (BRIDGE, None)],
    );
    node.ns
        .ip(&["addr", "flush", "dev", LATE_UPLINK])
        .expect("flush");
    node.wait_for(
        "no XDP once it is no uplink",
        &[(LATE_UPLINK, None), (UPLINK, Some("xdp"))],
    );
}

/// `--xdp-mode generic` asks for generic XDP: on the uplink alone still; with
/// `--xdp-interfaces` naming them, on the bridge and the pods' veths too.
#[test]
fn generic_and_other_interfaces_only_when_asked() {
    let node = Node::new();
    {
        let agent = node.agent(&["--xdp-mode", "generic"]);
        node.wait_for(
            "generic XDP on the uplink alone",
            &[
                (UPLINK, Some("xdpgeneric")),
                (BRIDGE, None),
                (BRIDGED_POD, None),
                (ROUTED_POD, None),
            ],
        );
        assert_tc_everywhere(&agent);
    }
    node.wait_for("the agent's cleanup", &ALL.map(|i| (i, None::<&str>)));
    // The bridge's port, not the bridge: the kernel refuses XDP on a port while
    // the bridge above it has XDP (the next test names the bridge).
    let named = [UPLINK, BRIDGED_POD, ROUTED_POD].join(",");
    let agent = node.agent(&["--xdp-mode", "generic", "--xdp-interfaces", &named]);
    node.wait_for(
        "generic XDP on every named interface",
        &[
            (UPLINK, Some("xdpgeneric")),
            (BRIDGE, None),
            (BRIDGED_POD, Some("xdpgeneric")),
            (ROUTED_POD, Some("xdpgeneric")),
        ],
    );
    assert_tc_everywhere(&agent);
}

/// An upgrade from a run that put generic XDP on the bridge, a pod's veth and the
/// veth uplink (the earlier default on the uplink and, with global addresses, on the
/// others): the next agent, with the default, detaches
/// every one of those pinned links and keeps tc.
#[test]
fn earlier_generic_links_are_detached_by_the_default() {
    let node = Node::new();
    let named = [UPLINK, BRIDGE, ROUTED_POD];
    let mut earlier = node.agent(&[
        "--xdp-mode",
        "generic",
        "--xdp-interfaces",
        &named.join(","),
    ]);
    let generic = named.map(|i| (i, Some("xdpgeneric")));
    node.wait_for("generic XDP on every named interface", &generic);
    earlier.terminate().expect("stop the earlier agent");
    node.wait_for("the links outlive their agent", &generic);
    let agent = Agent::start_on_root(
        &node.ns,
        node.manifests.path(),
        &[],
        earlier.bpf_root().to_owned(),
    )
    .expect("agent with the default");
    node.wait_for("no XDP anywhere", &ALL.map(|i| (i, None::<&str>)));
    assert_tc_everywhere(&agent);
    let status = agent.status().expect("status");
    assert!(
        !status.contains("xdp-"),
        "an XDP link still pinned:\n{status}"
    );
    drop(agent);
    drop(earlier);
}

/// An uplink whose native XDP hook another program holds (here a link of the test's
/// own, as an operator's filter or another tool would leave one): the agent's attach
/// fails (`EBUSY`), which it says once, and tc handles the uplink meanwhile; once the
/// other program goes, the agent attaches its XDP (at the interface pass the change
/// sets off, else at its next reap, every 10 s), where it used to give the uplink up
/// for good.
#[test]
fn xdp_held_by_another_program_is_attached_once_it_goes() {
    use std::os::fd::AsFd;

    use ebpf_proxy_tests::raw_bpf::{BPF_XDP, XDP_FLAGS_DRV_MODE, link_create, load_xdp_pass};

    let node = Node::new();
    let other = node
        .ns
        .run(|| {
            let index = nix::net::if_::if_nametoindex(UPLINK)?;
            let prog = load_xdp_pass("other_xdp")?;
            let link = link_create(prog.as_fd(), index, BPF_XDP, XDP_FLAGS_DRV_MODE)?;
            Ok::<_, std::io::Error>((prog, link))
        })
        .expect("entering the node's namespace")
        .unwrap_or_else(|e| panic!("another program's native XDP on {UPLINK}: {e}"));
    node.wait_for("the other program's XDP", &[(UPLINK, Some("xdp"))]);
    let agent = node.agent(&["--xdp-mode", "native"]);
    eventually("the attach that failed, logged", WAIT, || {
        let log = agent.log();
        if log.contains("tried again at each reap") && log.contains(UPLINK) {
            Ok(())
        } else {
            Err("not logged yet".into())
        }
    });
    assert_tc_everywhere(&agent);
    let status = agent.status().expect("status");
    assert!(
        !status.contains("xdp-eth0"),
        "an XDP link of the agent's pinned while another program holds the hook:\n{status}"
    );

    drop(other);
    node.wait_for("no XDP once the other program went", &[(UPLINK, None)]);
    eventually(
        "the agent's XDP on the uplink",
        Duration::from_secs(25),
        || {
            let status = agent.status().map_err(|e| e.to_string())?;
            match node.xdp(UPLINK) {
                Some(mode) if mode == "xdp" && status.contains("xdp-eth0") => Ok(()),
                mode => Err(format!("{UPLINK} has {mode:?}; status:\n{status}")),
            }
        },
    );
}
