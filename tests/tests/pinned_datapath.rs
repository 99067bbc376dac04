//! The datapath pinned in bpffs across the agent's lifetimes, on real packets in the
//! one-node world (docs/architecture.md, "Test topologies"): it keeps serving after
//! the agent exits until `cleanup`, an agent of a newer layout retires an older one's
//! datapath (an upgrade in place), a new `--conntrack-max` resizes conntrack with its
//! flows, and the pinned maps dump with field names.
//!
//! Every test builds its own namespaces, bpffs root and manifest directory, so they run
//! in parallel; everything is removed on drop, also when a test fails.

use std::{process::Command, thread, time::Duration};

use ebpf_proxy_tests::{
    client::{
        Outcome, TIMEOUT, TcpSession, assert_all_replied_from, tcp_request, tcp_tally, udp_request,
    },
    gone_within,
    sandbox::Sandbox,
    topology::one_node::{BACKENDS, CLIENT, CLUSTER_IP, dns, http, web_service},
};

/// (e) After SIGTERM the agent exits cleanly and the pinned datapath keeps serving new
/// connections; `ebpf-proxy cleanup` then removes it and the ClusterIP goes dark.
#[test]
fn pinned_datapath_outlives_the_agent_until_cleanup() {
    let mut sb = Sandbox::serving_web(&[CLIENT], &[]).expect("the one-node world");
    let before = tcp_tally(&sb.client().ns, http(CLUSTER_IP), 30, TIMEOUT).expect("before");
    assert_all_replied_from(CLIENT.1, "with the agent running", &before);

    let status = sb.agent_mut().terminate().expect("stop the agent");
    assert!(
        status.success(),
        "the agent exited with {status} on SIGTERM"
    );
    // Give anything the exit might tear down a moment to go, so that the check below
    // sees the state the agent left.
    thread::sleep(Duration::from_millis(200));

    let after = tcp_tally(&sb.client().ns, http(CLUSTER_IP), 90, TIMEOUT).expect("after");
    assert_all_replied_from(CLIENT.1, "after the agent exited", &after);
    assert_eq!(
        after.counts.len(),
        3,
        "all backends should still be used after the agent exited: {:?}",
        after.counts
    );
    let udp = udp_request(&sb.client().ns, dns(CLUSTER_IP), TIMEOUT);
    assert!(
        matches!(udp, Outcome::Reply(_)),
        "UDP after the agent exited: {udp}"
    );

    sb.agent_mut().cleanup().expect("ebpf-proxy cleanup");
    let left = sb.agent().pins();
    assert!(left.is_empty(), "cleanup left pins behind: {left:?}");
    // Right away: once `cleanup` has returned, nothing of the datapath may act on
    // packets any more (a link freed later, when bpffs drops its last reference,
    // would still serve for a moment).
    let gone = tcp_request(&sb.client().ns, http(CLUSTER_IP), Duration::from_secs(1));
    assert!(
        !matches!(gone, Outcome::Reply(_)),
        "the ClusterIP still answers right after `ebpf-proxy cleanup` returned: {gone}"
    );
}

/// An agent of a newer layout version on the root an older one left (an upgrade in
/// place) retires the older datapath once its own serves: the older program, still
/// attached through its pinned links, would otherwise go on translating first with
/// maps nobody updates. Here the older datapath balances over all three backends and
/// the newer one's Service has only backend-a: after the handover every new
/// connection must reach backend-a, and the older layout's pins must be gone. A
/// connection the older datapath sent to another backend keeps it: conntrack is
/// carried over.
#[test]
fn an_older_layouts_datapath_is_retired_once_this_one_serves() {
    let mut sb = Sandbox::serving_web(&[CLIENT], &[]).expect("the one-node world");
    let status = sb.agent_mut().terminate().expect("stop the agent");
    assert!(
        status.success(),
        "the agent exited with {status} on SIGTERM"
    );
    let root = sb.agent().bpf_root().to_owned();
    let current = format!("v{}", proxy_common::LAYOUT_VERSION);
    let older = root.join(format!("v{}", proxy_common::LAYOUT_VERSION - 1));
    std::fs::rename(root.join(&current), &older).expect("making the pins an older layout's");
    let stale = tcp_tally(&sb.client().ns, http(CLUSTER_IP), 30, TIMEOUT).expect("old datapath");
    assert_eq!(
        stale.counts.len(),
        3,
        "the older datapath should still balance over every backend: {:?}",
        stale.counts
    );

    // A connection of the older datapath's to a backend the newer one drops.
    let mut session = (0..20)
        .map(|_| {
            TcpSession::open(&sb.client().ns, http(CLUSTER_IP), TIMEOUT)
                .expect("connect through the older datapath")
        })
        .find(|session| session.greeting.backend != BACKENDS[0].0)
        .expect("20 connections through the older datapath all reached backend-a");
    let backend = session.greeting.backend.clone();

    sb.manifests()
        .write(
            "web.yaml",
            &web_service(CLUSTER_IP).yaml(Some(&[BACKENDS[0].1])),
        )
        .expect("write manifest");
    let upgraded = sb
        .agent_on_the_same_root(&[])
        .expect("start the newer agent on the same root");
    assert!(
        gone_within(&older, Duration::from_secs(5)),
        "{} still there 5 s after the newer agent started; its log:\n{}",
        older.display(),
        upgraded.log()
    );
    assert!(
        root.join(&current).exists(),
        "the newer agent's own layout {current} must stay"
    );
    let after = tcp_tally(&sb.client().ns, http(CLUSTER_IP), 30, TIMEOUT).expect("new datapath");
    assert_all_replied_from(CLIENT.1, "after the handover", &after);
    assert_eq!(
        after.counts.keys().map(String::as_str).collect::<Vec<_>>(),
        ["backend-a"],
        "after the handover only the newer datapath's backend may answer: {:?}",
        after.counts
    );
    let answer = session
        .exchange("after")
        .expect("the connection made before the upgrade, after it");
    assert_eq!(
        answer,
        format!("{backend} after"),
        "the connection made before the upgrade changed backend"
    );
}

/// `--conntrack-max` sizes the conntrack map, two entries a connection. An agent
/// started with another value on a node whose map has the former size replaces the
/// map: a connection made before keeps its backend (its entries were carried over),
/// the former map's pin goes, and `status` shows the new capacity.
#[test]
fn a_new_conntrack_max_resizes_the_map_and_keeps_its_flows() {
    let mut sb =
        Sandbox::serving_web(&[CLIENT], &["--conntrack-max", "4096"]).expect("the one-node world");
    let root = sb.agent().bpf_root().to_owned();
    let maps = root
        .join(format!("v{}", proxy_common::LAYOUT_VERSION))
        .join("maps");
    let capacity = || {
        aya::maps::MapInfo::from_pin(maps.join("CONNTRACK"))
            .expect("the pinned conntrack map")
            .max_entries()
    };
    assert_eq!(capacity(), 8192, "--conntrack-max 4096: two entries each");
    // Six: a connection without its entries would land on its own backend by chance
    // one time in three.
    let mut sessions: Vec<TcpSession> = (0..6)
        .map(|_| {
            TcpSession::open(&sb.client().ns, http(CLUSTER_IP), TIMEOUT)
                .expect("connect through the ClusterIP")
        })
        .collect();

    let status = sb.agent_mut().terminate().expect("stop the agent");
    assert!(status.success(), "the agent exited with {status}");
    let resized = sb
        .agent_on_the_same_root(&["--conntrack-max", "16384"])
        .expect("start the agent again with a larger table");
    let aside = maps.join("CONNTRACK-resizing");
    assert!(
        gone_within(&aside, Duration::from_secs(5)),
        "the former conntrack map is still pinned 5 s after the start; the log:\n{}",
        resized.log()
    );
    assert_eq!(capacity(), 32768, "--conntrack-max 16384 after the restart");
    for (i, session) in sessions.iter_mut().enumerate() {
        let backend = session.greeting.backend.clone();
        let answer = session.exchange("after").unwrap_or_else(|e| {
            panic!(
                "connection {i} made before the resize, after it: {e}; the log:\n{}",
                resized.log()
            )
        });
        assert_eq!(
            answer,
            format!("{backend} after"),
            "connection {i} made before the resize changed backend; the log:\n{}",
            resized.log()
        );
    }
    let status = resized.status().expect("ebpf-proxy status");
    let entries: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("conntrack entries: "))
        .and_then(|l| l.strip_suffix(" of 32768 (16384 connections)"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("status does not show the new capacity:\n{status}"));
    assert!(
        entries >= 2 * sessions.len(),
        "status counts {entries} conntrack entries with {} connections open",
        sessions.len()
    );
    let after = tcp_tally(&sb.client().ns, http(CLUSTER_IP), 30, TIMEOUT).expect("after");
    assert_all_replied_from(CLIENT.1, "after the resize", &after);
}

/// The maps are pinned with their BTF, so `bpftool map dump pinned` prints keys and
/// values by field name (the documented way to inspect the datapath).
#[test]
fn pinned_maps_dump_with_field_names() {
    let sb = Sandbox::serving_web(&[CLIENT], &[]).expect("the one-node world");
    let pins = sb.agent().pins();
    let mut dumped = Vec::new();
    for pin in &pins {
        // Links are pinned too; only maps have a `map show`.
        let show = Command::new("bpftool")
            .args(["-j", "map", "show", "pinned"])
            .arg(pin)
            .output()
            .expect("run bpftool");
        if !show.status.success() {
            continue;
        }
        // Socket-local storage has no keys to walk: the agent's pinned iterator
        // reads it (see the socket hook tests). A ring buffer (the datapath
        // log's) has no entries either: its records are read as they come.
        let show = String::from_utf8_lossy(&show.stdout);
        if show.contains("\"type\":\"sk_storage\"") || show.contains("\"type\":\"ringbuf\"") {
            continue;
        }
        let out = Command::new("bpftool")
            .args(["-j", "map", "dump", "pinned"])
            .arg(pin)
            .output()
            .expect("run bpftool");
        assert!(
            out.status.success(),
            "bpftool map dump pinned {}: {}",
            pin.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let json = String::from_utf8_lossy(&out.stdout);
        if json.trim() == "[]" {
            continue;
        }
        // With BTF, every entry has a "formatted" object next to the raw bytes.
        assert!(
            json.contains("\"formatted\""),
            "bpftool prints {} without field names (no BTF?): {}",
            pin.display(),
            &json[..json.len().min(300)]
        );
        dumped.push(pin.display().to_string());
    }
    assert!(
        dumped.len() >= 2,
        "expected the service and backend maps to have entries; pins: {pins:?}, \
         dumped with field names: {dumped:?}"
    );
}
