//! The manifest source at rest and on a change, through the agent binary: a
//! directory of many files, left alone, is not parsed again; an edit of one
//! of them is parsed alone and reaches the maps.

use std::{net::Ipv4Addr, thread, time::Duration};

use ebpf_proxy_tests::{
    Protocol,
    agent::Agent,
    manifest::{ManifestDir, Service},
    netns::{NetNs, unique_stem},
    require_root, wait_until,
};
use serde_json::Value;

const FILES: u32 = 20;
/// Longer than the source's periodic check (2 s), twice over.
const AT_REST: Duration = Duration::from_secs(5);
/// The README's promise for a manifest edit, with room for a loaded machine.
const CONVERGE: Duration = Duration::from_secs(5);

fn vip(i: u32) -> Ipv4Addr {
    Ipv4Addr::new(10, 96, 3, i as u8)
}

fn service(i: u32) -> Service {
    Service::new("many", &format!("svc-{i}"), vip(i)).port("http", 80, Protocol::Tcp, 8080)
}

fn file_name(i: u32) -> String {
    format!("svc-{i:02}.yaml")
}

/// The agent's JSON log lines with this message.
fn logged(agent: &Agent, message: &str) -> Vec<Value> {
    agent
        .log()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["message"] == message)
        .collect()
}

#[test]
fn one_edited_file_of_many_is_parsed_alone_and_reaches_the_maps() {
    require_root().expect("privileged test");
    let stem = unique_stem();
    let node = NetNs::create(&format!("{stem}-many")).expect("creating the node namespace");
    node.ip(&["link", "set", "lo", "up"]).expect("lo up");
    let manifests = ManifestDir::create(&stem).expect("manifest directory");
    for i in 0..FILES {
        manifests
            .write(
                &file_name(i),
                &service(i).yaml(Some(&[Ipv4Addr::new(10, 200, 1, i as u8)])),
            )
            .expect("writing a manifest");
    }
    let agent = Agent::start_with(&node, manifests.path(), &["--log-format", "json"])
        .expect("starting the agent");
    let loaded = logged(&agent, "manifests loaded");
    assert_eq!(
        loaded.len(),
        1,
        "one initial listing; the log:\n{}",
        agent.log()
    );
    assert_eq!(
        (&loaded[0]["services"], &loaded[0]["files"]),
        (&Value::from(FILES), &Value::from(FILES)),
        "every file parsed once at start: {}",
        loaded[0]
    );

    // The point: nothing must happen while the files rest, so the wait is a time.
    thread::sleep(AT_REST);
    let changed = logged(&agent, "manifests changed");
    assert!(
        changed.is_empty(),
        "nothing changed, yet the source reported changes: {changed:?}"
    );

    let edited = manifests.path().join(file_name(7));
    let moved = Ipv4Addr::new(10, 201, 0, 99);
    manifests
        .write(&file_name(7), &service(7).yaml(Some(&[moved])))
        .expect("editing one manifest");
    let frontend = format!("{}:80", vip(7));
    let backend = format!("{moved}:8080");
    let reached = wait_until(CONVERGE, Duration::from_millis(100), || {
        let status = agent
            .status()
            .map_err(|e| format!("ebpf-proxy status: {e:#}"))?;
        // A port's backends are on its line, above its frontends' lines.
        let lines: Vec<&str> = status.lines().collect();
        let line = lines
            .iter()
            .position(|l| l.contains(&frontend))
            .and_then(|at| lines[..at].iter().rev().find(|l| l.contains(" port ")))
            .copied()
            .unwrap_or_default();
        if line.contains(&backend) {
            Ok(())
        } else {
            Err(format!("{frontend} is {line:?}\nstatus:\n{status}"))
        }
    });
    if let Err(last) = reached {
        panic!(
            "the edit of {} did not reach the maps within {CONVERGE:?}: {last}",
            edited.display()
        );
    }
    let changed = logged(&agent, "manifests changed");
    assert_eq!(
        changed.len(),
        1,
        "one change, one report: {changed:?}\nlog:\n{}",
        agent.log()
    );
    assert_eq!(
        changed[0]["parsed"],
        Value::from(format!("[{edited:?}]")),
        "only the edited file is parsed: {}",
        changed[0]
    );
}
