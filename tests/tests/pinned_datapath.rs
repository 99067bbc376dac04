//! The datapath pinned in bpffs across the agent's lifetimes, on real packets in the
//! one-node world (docs/architecture.md, "Test topologies"): it keeps serving after
//! the agent exits until `cleanup`, an agent of a newer layout retires an older one's
//! datapath (an upgrade in place), a new `--conntrack-max` resizes conntrack with its
//! flows, one tc program per interface serves both families while no agent runs and
//! across restarts (an earlier release's second link detached), an earlier agent's
//! program arrays stay pinned while its `tc_ingress` runs anywhere, the pinned maps dump
//! with field names, `status
//! --flows` shows the flows in conntrack, IPv6's as `[addr]:port`, and the flow marks
//! a load opens are refreshed as soon as the programs attach.
//!
//! Every test builds its own namespaces, bpffs root and manifest directory, so they run
//! in parallel; everything is removed on drop, also when a test fails.

use std::{
    net::{SocketAddr, SocketAddrV6, TcpStream},
    process::Command,
    thread,
    time::Duration,
};

use aya::programs::{LinkOrder, SchedClassifier, TcAttachType, links::FdLink, tc::TcAttachOptions};
use ebpf_proxy_tests::{
    Protocol,
    client::{
        Outcome, TIMEOUT, TcpSession, assert_all_replied_from, tcp_request, tcp_tally, udp_request,
    },
    gone_within,
    manifest::Service,
    sandbox::Sandbox,
    topology::{
        one_node::{
            self, BACKENDS, CLIENT, CLUSTER_IP, CLUSTER_IP6, TCP_PORT, TCP_SERVICE_PORT, UDP_PORT,
            backend_ips, backend_ips6, dns, http, web_service,
        },
        pod_ip6,
    },
};
use proxy_userspace::datapath::PinLayout;

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
    // The point: what the exit tears down, the kernel may release a moment later
    // (deferred link and map release), and nothing announces it; the check below
    // must see the state after that.
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
        let json = bpftool(&["-j", "map", "dump", "pinned"], pin);
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

/// `bpftool -j map dump pinned` of the map `name` of the agent's pins, as JSON.
fn dump(sb: &Sandbox, name: &str) -> serde_json::Value {
    let pin = PinLayout::new(sb.agent().bpf_root()).map(name);
    let out = bpftool(&["-j", "map", "dump", "pinned"], &pin);
    serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("bpftool's dump of {name} is not JSON ({e}): {out}"))
}

/// `bpftool ARGS PIN`'s output; a panic with its error where it fails.
fn bpftool(args: &[&str], pin: &std::path::Path) -> String {
    bpftool_on(args, pin, &[])
}

/// `bpftool ARGS PIN AFTER`'s output; a panic with its error where it fails.
fn bpftool_on(args: &[&str], pin: &std::path::Path, after: &[&str]) -> String {
    let out = Command::new("bpftool")
        .args(args)
        .arg(pin)
        .args(after)
        .output()
        .expect("run bpftool");
    assert!(
        out.status.success(),
        "bpftool {} {} {}: {}",
        args.join(" "),
        pin.display(),
        after.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The "formatted" keys or values of `dump` (`part` "key" or "value").
fn formatted<'a>(dump: &'a serde_json::Value, part: &str) -> Vec<&'a serde_json::Value> {
    dump.as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["formatted"].get(part))
        .collect()
}

/// Addresses dump as their bytes in network order, ports as theirs, and
/// protocols by name (docs/maps.md, "Reading the maps"): the ClusterIP
/// 10.96.0.10 (IPv4 mapped) with port 80 and TCP in `SERVICES`, a
/// backend's 10.200.0.11 and port 8080 in `BACKENDS`, and a flow's client,
/// frontend and backend in `CONNTRACK`, each as `[10,96,0,10]`; a
/// frontend's scope and a flow's directions by their names too, and a
/// Service's namespace, name and port name as strings.
#[test]
fn pinned_maps_dump_addresses_and_ports_as_bytes_and_protocols_by_name() {
    let sb = Sandbox::serving_web(&[CLIENT], &[]).expect("the one-node world");
    let client = &sb.client().ns;
    let mut session = TcpSession::open(client, one_node::VIP, TIMEOUT)
        .unwrap_or_else(|e| panic!("a session to {}: {e:#}", one_node::VIP));
    let backend = session.greeting.backend.clone();

    let mapped = |ip: std::net::Ipv4Addr| {
        let mut bytes = vec![0u8; 10];
        bytes.extend([0xff, 0xff]);
        bytes.extend(ip.octets());
        serde_json::json!(bytes)
    };
    let port = |p: u16| serde_json::json!(p.to_be_bytes());
    let services = dump(&sb, "SERVICES");
    let keys = formatted(&services, "key");
    assert!(
        keys.iter().any(|k| {
            k["addr_be"] == mapped(CLUSTER_IP)
                && k["port_be"] == port(TCP_SERVICE_PORT)
                && k["proto"] == "TCP"
                && k["scope"] == "ANY"
        }),
        "no SERVICES key of {CLUSTER_IP}:{TCP_SERVICE_PORT}/TCP as bytes {} {} \"TCP\" \"ANY\": {keys:#?}",
        mapped(CLUSTER_IP),
        port(TCP_SERVICE_PORT)
    );
    let backends = dump(&sb, "BACKENDS");
    let values = formatted(&backends, "value");
    for (_, ip) in BACKENDS {
        assert!(
            values
                .iter()
                .any(|v| v["addr_be"] == mapped(ip) && v["port_be"] == port(TCP_PORT)),
            "no BACKENDS value of {ip}:{TCP_PORT} as bytes: {values:#?}"
        );
    }
    let conntrack = dump(&sb, "CONNTRACK");
    let ct_new = dump(&sb, "CT_NEW");
    let flows: Vec<&serde_json::Value> = formatted(&conntrack, "key")
        .into_iter()
        .chain(formatted(&ct_new, "key"))
        .collect();
    let Some(&(_, backend_ip)) = BACKENDS.iter().find(|(name, _)| *name == backend) else {
        panic!("the greeting names no backend of the world: {backend:?}");
    };
    let bytes = |ip: std::net::Ipv4Addr| serde_json::json!(ip.octets());
    assert!(
        flows.iter().any(|k| {
            k["src_be"] == bytes(CLIENT.1)
                && (k["dst_be"] == bytes(CLUSTER_IP) || k["dst_be"] == bytes(backend_ip))
                && k["proto"] == "TCP"
        }),
        "no conntrack key from {} as bytes {} (to {CLUSTER_IP} or {backend_ip}): {flows:#?}",
        CLIENT.1,
        bytes(CLIENT.1)
    );
    let names = dump(&sb, "SERVICE_NAMES");
    let values = formatted(&names, "value");
    assert!(
        values.iter().any(|v| {
            v["namespace"] == "test"
                && v["name"] == "web"
                && v["port_name"] == "http"
                && v["proto"] == "TCP"
        }),
        "no SERVICE_NAMES value of test/web port http with its names as strings: {values:#?}"
    );
    let directions: std::collections::BTreeSet<&str> = formatted(&conntrack, "value")
        .into_iter()
        .chain(formatted(&ct_new, "value"))
        .filter_map(|v| v["dir"].as_str())
        .collect();
    assert_eq!(
        directions,
        ["FORWARD", "REPLY"].into(),
        "a flow's two entries, their directions by name"
    );
    session
        .exchange("done")
        .unwrap_or_else(|e| panic!("the session after the dumps: {e:#}"));
}

/// The programs in the tcx ingress chain of the node's interface `ifname`, first to
/// last, by name.
fn tcx_chain(sb: &Sandbox, ifname: &str) -> Vec<String> {
    sb.topology()
        .node
        .run(|| SchedClassifier::query_tcx(ifname, TcAttachType::Ingress))
        .expect("entering the node's namespace")
        .unwrap_or_else(|e| panic!("querying the tcx chain of {ifname}: {e}"))
        .1
        .iter()
        .map(|p| p.name_as_str().unwrap_or("?").to_owned())
        .collect()
}

/// Every pod interface runs `tc_ingress`, and nothing else (IPv6 reaches
/// `tc_ingress6` through `TC_NEXT`), and the client reaches the IPv4 and the IPv6
/// ClusterIP, keeping its address.
fn both_families_serve(sb: &Sandbox, what: &str) {
    for pod in sb.topology().pods() {
        assert_eq!(
            tcx_chain(sb, &pod.host_if),
            ["tc_ingress"],
            "{what}: the tcx ingress chain of {} (pod {})",
            pod.host_if,
            pod.name
        );
    }
    let client = sb.client();
    let v4 = tcp_tally(&client.ns, http(CLUSTER_IP), 20, TIMEOUT).expect("IPv4 tally");
    assert_all_replied_from(client.ip, &format!("{what}: IPv4 ClusterIP"), &v4);
    let http6 = SocketAddrV6::new(CLUSTER_IP6, TCP_SERVICE_PORT, 0, 0);
    let v6 = tcp_tally(&client.ns, http6, 20, TIMEOUT).expect("IPv6 tally");
    assert_all_replied_from(client.ip6, &format!("{what}: IPv6 ClusterIP"), &v6);
}

/// The one-node world with an agent on an IPv4 and an IPv6 ClusterIP Service, both
/// served by every backend.
fn both_families_world() -> Sandbox {
    let mut sb =
        Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("the one-node world");
    sb.manifests()
        .write(
            "web.yaml",
            &web_service(CLUSTER_IP).yaml(Some(&backend_ips())),
        )
        .expect("write manifest");
    sb.manifests()
        .write(
            "web6.yaml",
            &Service::new_v6("test", "web6", CLUSTER_IP6)
                .port("http", TCP_SERVICE_PORT, Protocol::Tcp, TCP_PORT)
                .yaml6(&backend_ips6()),
        )
        .expect("write manifest");
    sb.start_agent_on_manifests().expect("start the agent");
    sb
}

/// The pinned program arrays `map` (`TC_NEXT`, `TC_DSR`) under `pins`
/// (`PinLayout::tail_call`).
fn tail_call_pins(pins: &PinLayout, map: &str) -> Vec<std::path::PathBuf> {
    let prefix = format!("{map}-");
    let mut found: Vec<_> = std::fs::read_dir(pins.tail_calls_dir())
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(&prefix))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

/// Every pinned program array under `pins`, `TC_NEXT`'s then `TC_DSR`'s.
fn tail_calls_pinned(pins: &PinLayout) -> Vec<std::path::PathBuf> {
    let mut all = tail_call_pins(pins, "TC_NEXT");
    all.extend(tail_call_pins(pins, "TC_DSR"));
    all
}

/// Waits until the pinned program arrays under `pins` are one `TC_NEXT` and one
/// `TC_DSR`, none of them among `earlier`'s.
fn one_agents_arrays_pinned(pins: &PinLayout, earlier: &[std::path::PathBuf], what: &str) {
    ebpf_proxy_tests::eventually(what, Duration::from_secs(25), || {
        let now = tail_calls_pinned(pins);
        match now.as_slice() {
            [next, dsr] if !earlier.contains(next) && !earlier.contains(dsr) => Ok(()),
            _ => Err(format!(
                "pinned program arrays {now:?}; the earlier agent's were {earlier:?}"
            )),
        }
    });
}

/// The id of the program in slot 0 of the program array pinned at `array`.
fn program_in_slot0(array: &std::path::Path) -> u32 {
    let out = bpftool_on(
        &["-j", "map", "lookup", "pinned"],
        array,
        &["key", "0", "0", "0", "0"],
    );
    let json: serde_json::Value = serde_json::from_str(&out)
        .unwrap_or_else(|e| panic!("bpftool's lookup of {}: {e}: {out}", array.display()));
    let bytes: Vec<u8> = json["value"]
        .as_array()
        .unwrap_or_else(|| panic!("no value in {}'s slot 0: {out}", array.display()))
        .iter()
        .map(|b| {
            u8::from_str_radix(b.as_str().unwrap_or("").trim_start_matches("0x"), 16)
                .unwrap_or_else(|e| panic!("a byte of {}'s slot 0: {e}: {out}", array.display()))
        })
        .collect();
    u32::from_le_bytes(bytes[..4].try_into().expect("a program id is 4 bytes"))
}

/// One tc program per interface: `tc_ingress`, which hands IPv6 to `tc_ingress6`
/// through `TC_NEXT`. The array is pinned, so both families are still served while
/// no agent runs; a restarted agent takes the links over and then unpins the older
/// arrays, whose `tc_ingress` is then linked nowhere. An earlier release linked `tc_ingress6`
/// after `tc_ingress` (pinned `tc-ingress6-<interface>`), where it would now run on
/// every packet `tc_ingress` hands on down the chain, IPv6 ones a second time: the
/// agent detaches such a link and says so, and unpins that release's `TC_NEXT-<id>`.
#[test]
fn one_tc_program_per_interface_serves_both_families_across_restarts() {
    let mut sb = both_families_world();
    assert_eq!(sb.client().ip6, pod_ip6(CLIENT.1));
    both_families_serve(&sb, "the first agent");
    let pins = PinLayout::new(sb.agent().bpf_root());
    let first = tail_call_pins(&pins, "TC_NEXT");
    assert_eq!(first.len(), 1, "one pinned TC_NEXT expected: {first:?}");
    let first_arrays = tail_calls_pinned(&pins);
    assert_eq!(
        first_arrays.len(),
        2,
        "one pinned TC_NEXT and one TC_DSR expected: {first_arrays:?}"
    );

    let status = sb.agent_mut().terminate().expect("stop the agent");
    assert!(status.success(), "the agent exited with {status}");
    // What the exit releases, the kernel may release a moment later.
    thread::sleep(Duration::from_millis(200));
    both_families_serve(&sb, "while no agent runs");

    // An earlier release's layout on the client's interface: `tc_ingress6` (the
    // one in the pinned array's slot) linked after `tc_ingress`.
    let client_if = sb.client().host_if.clone();
    let older_pin = pins.tc_ingress6_link(&client_if);
    let program_pin = pins.root().join("older-tc_ingress6");
    let id = program_in_slot0(&first[0]);
    bpftool(&["prog", "pin", "id", &id.to_string()], &program_pin);
    sb.topology()
        .node
        .run(|| -> anyhow::Result<()> {
            let mut older = SchedClassifier::from_pin(&program_pin)?;
            let link = older.attach_with_options(
                &client_if,
                TcAttachType::Ingress,
                TcAttachOptions::TcxOrder(LinkOrder::last()),
            )?;
            FdLink::try_from(older.take_link(link)?)?.pin(&older_pin)?;
            Ok(())
        })
        .expect("entering the node's namespace")
        .expect("linking tc_ingress6 after tc_ingress, as an earlier release did");
    std::fs::remove_file(&program_pin).expect("unpinning tc_ingress6");
    // And the name that release gave its pinned `TC_NEXT` (the array's id, not
    // its reader's): gone once the restarted agent's programs are attached.
    let older_array = pins.tail_calls_dir().join("TC_NEXT-1");
    bpftool(
        &["map", "pin", "pinned", &first[0].display().to_string()],
        &older_array,
    );
    assert_eq!(
        tcx_chain(&sb, &client_if),
        ["tc_ingress", "tc_ingress6"],
        "{client_if} as an earlier release left it"
    );

    let restarted = sb
        .agent_on_the_same_root(&[])
        .expect("restart on the same root");
    let log = restarted.log();
    assert!(
        log.matches("took over pinned tc link").count() >= sb.topology().pods().len(),
        "the restarted agent did not take over every pod interface's link:\n{log}"
    );
    assert!(
        log.contains("detached an earlier release's link") && !older_pin.exists(),
        "the restarted agent did not detach and unpin {}:\n{log}",
        older_pin.display()
    );
    both_families_serve(&sb, "after a restart that took over the links");
    one_agents_arrays_pinned(
        &pins,
        &first_arrays,
        "the restarted agent's TC_NEXT and TC_DSR pinned alone",
    );
}

/// An earlier agent's `tc_ingress` still linked where the next agent has not taken
/// the link over (here an interface it is told to leave alone, `--interfaces`; as
/// where a takeover failed and waits for its retry) goes on handing IPv6 to its own
/// `tc_ingress6`: the earlier agent's `TC_NEXT` and `TC_DSR` stay pinned while it is
/// linked anywhere. Once that interface is gone, the running agent unpins them at
/// its next reap, with the capabilities it keeps once serving.
#[test]
fn an_earlier_agents_arrays_stay_pinned_while_its_tc_ingress_runs() {
    let mut sb = both_families_world();
    let pins = PinLayout::new(sb.agent().bpf_root());
    let first = tail_calls_pinned(&pins);
    assert_eq!(
        first.len(),
        2,
        "one pinned TC_NEXT and one TC_DSR expected: {first:?}"
    );
    let status = sb.agent_mut().terminate().expect("stop the agent");
    assert!(status.success(), "the agent exited with {status}");

    let client_if = sb.client().host_if.clone();
    let others: Vec<String> = sb
        .topology()
        .pods()
        .iter()
        .map(|p| p.host_if.clone())
        .filter(|name| *name != client_if)
        .collect();
    let partial = sb
        .agent_on_the_same_root(&["--interfaces", &others.join(",")])
        .expect("restart on the same root, the client's interface left alone");
    let log = partial.log();
    assert!(
        log.matches("took over pinned tc link").count() >= others.len(),
        "the restarted agent did not take over {others:?}:\n{log}"
    );
    // Longer than a reap (10 s), which asks again, as every interface pass does.
    thread::sleep(Duration::from_secs(12));
    let now = tail_calls_pinned(&pins);
    assert!(
        first.iter().all(|p| now.contains(p)),
        "the first agent's arrays {first:?} were unpinned while its tc_ingress still runs \
         on {client_if}: pinned now {now:?}\n{}",
        partial.log()
    );
    both_families_serve(
        &sb,
        "the client's interface left to the first agent's tc_ingress",
    );

    sb.topology()
        .node
        .ip(&["link", "del", &client_if])
        .unwrap_or_else(|e| panic!("deleting {client_if}: {e:#}"));
    one_agents_arrays_pinned(
        &pins,
        &first,
        "the first agent's arrays unpinned once its tc_ingress is linked nowhere",
    );
    assert!(
        partial
            .log()
            .contains("unpinned earlier agents' program arrays"),
        "the restarted agent did not say it unpinned the first agent's arrays:\n{}",
        partial.log()
    );
}

/// `ebpf-proxy status --flows` lists each translated flow in conntrack once, IPv4's
/// as `a.b.c.d:port` and IPv6's as `[addr]:port`: an open IPv6 connection from the
/// client to the IPv6 ClusterIP is the line `flow TCP [client]:port -> [ClusterIP]:80
/// => [backend]:8080 ...`, its backend the one that answered, and an IPv4 connection's
/// line reads the same way. `bpftool map dump` of `CONNTRACK6` shows the same flow's
/// addresses as four 32-bit words each, which read back as docs/operations.md says.
#[test]
fn status_lists_the_flows_of_both_families_readably() {
    let sb = both_families_world();
    let client = sb.client();

    let http6 = SocketAddr::V6(SocketAddrV6::new(CLUSTER_IP6, TCP_SERVICE_PORT, 0, 0));
    let stream = client
        .ns
        .run(|| TcpStream::connect_timeout(&http6, TIMEOUT))
        .expect("entering the client's namespace")
        .unwrap_or_else(|e| panic!("connect to {http6}: {e}"));
    stream
        .set_read_timeout(Some(TIMEOUT))
        .expect("read timeout");
    let mut greeting = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(stream.try_clone().expect("clone the stream")),
        &mut greeting,
    )
    .expect("the greeting");
    let backend6 = greeting.split_whitespace().next().unwrap_or_default();
    let backend6_ip = BACKENDS.iter().find(|b| b.0 == backend6).map_or_else(
        || panic!("greeting {greeting:?} names no backend"),
        |b| pod_ip6(b.1),
    );
    let local6 = stream.local_addr().expect("the connection's own address");
    let session4 =
        TcpSession::open(&client.ns, http(CLUSTER_IP), TIMEOUT).expect("an IPv4 connection");
    let backend4_ip = BACKENDS
        .iter()
        .find(|b| b.0 == session4.greeting.backend)
        .map(|b| b.1)
        .expect("the IPv4 greeting names a backend");

    let status = sb
        .agent()
        .status_flows()
        .expect("ebpf-proxy status --flows");
    let line6 = format!("flow TCP {local6} -> {http6} => [{backend6_ip}]:{TCP_PORT}");
    assert!(
        local6.is_ipv6() && status.lines().any(|l| l.starts_with(&line6)),
        "no line starting {line6:?} in:\n{status}"
    );
    let prefix4 = format!(" -> {} => {backend4_ip}:{TCP_PORT}", http(CLUSTER_IP));
    assert!(
        status
            .lines()
            .any(|l| l.starts_with(&format!("flow TCP {}:", client.ip)) && l.contains(&prefix4)),
        "no line of the IPv4 connection ({prefix4:?}) in:\n{status}"
    );
    let flows = status.lines().filter(|l| l.starts_with("flow ")).count();
    assert!(
        status.contains(&format!("flows: {flows} (client -> frontend => backend)")) && flows >= 2,
        "the flow count does not match the {flows} flow lines:\n{status}"
    );

    // What `bpftool map dump` shows of the same flow: each address four u32 words,
    // read back as docs/operations.md ("Reading the maps") says.
    let SocketAddr::V6(local6) = local6 else {
        unreachable!("checked above")
    };
    let forward = conntrack6_entry(&sb, *local6.ip(), CLUSTER_IP6);
    assert_eq!(
        words_of(&forward["value"]["nat_addr_be"]),
        bpftool_words(backend6_ip),
        "the forward entry's backend, read as bytes: {forward}"
    );
    drop(stream);
}

/// An IPv6 address as `bpftool map dump` prints an `addr_be` field of it: its
/// 16 bytes in network order (docs/maps.md, "Reading a dump").
fn bpftool_words(ip: std::net::Ipv6Addr) -> Vec<u64> {
    ip.octets().into_iter().map(u64::from).collect()
}

/// The numbers of a JSON array (empty for anything else).
fn words_of(value: &serde_json::Value) -> Vec<u64> {
    value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(serde_json::Value::as_u64)
        .collect()
}

/// The `CONNTRACK6` entry of the flow from `src` to `dst` as `bpftool -j map dump`
/// formats it (BTF field names), found by reading its addresses' bytes as
/// docs/maps.md says; a panic with the dump when there is none.
fn conntrack6_entry(
    sb: &Sandbox,
    src: std::net::Ipv6Addr,
    dst: std::net::Ipv6Addr,
) -> serde_json::Value {
    let dump = dump(sb, "CONNTRACK6");
    let (src_words, dst_words) = (bpftool_words(src), bpftool_words(dst));
    let entry = dump
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e.get("formatted"))
        .find(|e| {
            words_of(&e["key"]["src_be"]) == src_words && words_of(&e["key"]["dst_be"]) == dst_words
        })
        .unwrap_or_else(|| {
            panic!(
                "no CONNTRACK6 entry from {src} to {dst} read as bytes {src_words:?}, \
                 {dst_words:?}: {dump}"
            )
        });
    eprintln!("CONNTRACK6 entry of {src} -> {dst}: {entry}");
    entry.clone()
}

/// What a load owes until this agent's programs attach is settled by the interface
/// pass that attaches them, not only by the conntrack reap's next tick (every 10 s;
/// its first, at start, finds nothing attached and leaves it): the flow marks it
/// opens (every slot marked, so that no flow the marks do not know yet is turned
/// away) are refreshed, and backends' source bits in the prefilter, which only an
/// earlier agent's programs read, are cleared. A node with no interface but `lo` at
/// start and `test/web`'s backends programmed, then one: the marks stay opened and
/// the source bits set while nothing is attached (an earlier agent's programs may
/// still be, on these pins); once tc is on the new interface the marks are down to
/// what conntrack holds (nothing) and the source bits gone, within a few seconds of
/// the agent's start, well before the reap's second tick.
#[test]
fn what_a_load_owes_is_settled_when_the_programs_attach() {
    use ebpf_proxy_tests::{
        agent::Agent,
        eventually,
        manifest::ManifestDir,
        netns::{NetNs, unique_stem},
    };
    use proxy_userspace::{
        datapath::{maps::Maps, prefilter::backend_bit},
        planner::encode::addr_words,
    };
    ebpf_proxy_tests::require_root().expect("privileged test");
    let stem = unique_stem();
    let node = NetNs::create(&format!("{stem}-node")).expect("node namespace");
    let manifests = ManifestDir::create(&stem).expect("manifest dir");
    manifests
        .write(
            "web.yaml",
            &web_service(CLUSTER_IP).yaml(Some(&backend_ips())),
        )
        .expect("write manifest");
    let started = std::time::Instant::now();
    let agent = Agent::start(&node, manifests.path()).expect("agent on a node with only lo");
    let maps = Maps::open_pinned(&PinLayout::new(agent.bpf_root())).expect("the agent's maps");
    let prefilter = maps.prefilter.as_ref().expect("the pins have a prefilter");
    // Each backend's bit for both of its ports.
    let sources: Vec<(String, u32)> = backend_ips()
        .into_iter()
        .flat_map(|ip| {
            [(TCP_PORT, 6u8), (UDP_PORT, 17u8)].map(move |(port, proto)| (ip, port, proto))
        })
        .map(|(ip, port, proto)| {
            let bit = backend_bit(&proxy_common::Backend {
                addr_be: addr_words(ip.into()),
                port_be: port.to_be(),
                proto,
                flags: 0,
            });
            (format!("{ip}:{port}/{proto}"), bit)
        })
        .collect();
    let set = || -> Vec<&str> {
        sources
            .iter()
            .filter(|(_, bit)| prefilter.holds(*bit))
            .map(|(what, _)| what.as_str())
            .collect()
    };
    let slots = u64::from(proxy_common::prefilter::flows::SLOTS);
    let marked = |status: &str| -> u64 {
        ebpf_proxy_tests::agent::marked_flow_slots(status)
            .unwrap_or_else(|| panic!("status shows no prefilter flow marks:\n{status}"))
    };
    eventually(
        "test/web's backends programmed, with their source bits",
        Duration::from_secs(6),
        || {
            if set().len() == sources.len() {
                Ok(())
            } else {
                Err(format!("source bits set: {:?} of {sources:?}", set()))
            }
        },
    );
    let status = agent.status().expect("status");
    assert!(
        !status.contains("tc-ingress-"),
        "a tc link with no interface but lo:\n{status}"
    );
    assert_eq!(
        marked(&status),
        slots,
        "the marks opened at load were refreshed with no program attached:\n{status}"
    );
    // A veth pair, both ends in the node (this kernel has no dummy interfaces).
    node.ip(&["link", "add", "d0", "type", "veth", "peer", "name", "d1"])
        .expect("an interface");
    for end in ["d0", "d1"] {
        node.ip(&["link", "set", end, "up"]).expect("up");
    }
    eventually(
        "tc on the new interface, the opened marks refreshed and the source bits cleared",
        Duration::from_secs(6),
        || {
            let status = agent.status().map_err(|e| format!("{e:#}"))?;
            let (now, left) = (marked(&status), set());
            if status.contains("tc-ingress-d0") && now < slots && left.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "{now} of {slots} slots marked, source bits still set {left:?}, {:.1} s \
                     after the agent's start (the reap's second tick at 10 s):\n{status}",
                    started.elapsed().as_secs_f64()
                ))
            }
        },
    );
}
