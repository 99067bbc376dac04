//! The agent's log as log pipelines read it: no ANSI escape sequences when it
//! goes to a file or a pipe, colour on a terminal unless `NO_COLOR` is set
//! (no-color.org), and `--log-format json` lines that parse and carry what the
//! text lines carry (level, target, message, the event's fields, the spans'
//! fields).
//!
//! The terminal cases run the binary under `script` (util-linux's, in Debian's
//! essential `bsdutils`), which gives it a pseudo-terminal.

use std::process::{Command, Output};

use ebpf_proxy_tests::{
    Protocol,
    agent::{self, Agent},
    manifest::{ManifestDir, Service},
    netns::{NetNs, unique_stem},
    require_root,
    topology::one_node,
};
use serde_json::Value;

const ESC: char = '\u{1b}';

/// A node namespace and a manifest directory with one Service of two
/// endpoints: enough for the agent to log its start, its source and a sync.
fn node_with_one_service() -> (NetNs, ManifestDir) {
    let stem = unique_stem();
    let node = NetNs::create(&format!("{stem}-logs")).expect("creating the node namespace");
    node.ip(&["link", "set", "lo", "up"]).expect("lo up");
    let manifests = ManifestDir::create(&stem).expect("manifest directory");
    let svc =
        Service::new("logs", "web", one_node::CLUSTER_IP).port("http", 80, Protocol::Tcp, 8080);
    manifests
        .write("web.yaml", &svc.yaml(Some(&one_node::BACKEND_IPS[..2])))
        .expect("writing the manifest");
    (node, manifests)
}

#[test]
fn text_log_to_a_file_has_no_escape_sequences() {
    require_root().expect("privileged test");
    let (node, manifests) = node_with_one_service();
    let agent = Agent::start(&node, manifests.path()).expect("starting the agent");
    let log = agent.log();
    assert!(
        log.contains("manifests loaded"),
        "the agent did not log its manifest source; its log:\n{log}"
    );
    if let Some((n, line)) = log.lines().enumerate().find(|(_, l)| l.contains(ESC)) {
        panic!(
            "line {} of a log written to a file carries an escape sequence: {:?}",
            n + 1,
            line
        );
    }
}

#[test]
fn json_log_lines_parse_and_carry_level_target_message_and_spans() {
    require_root().expect("privileged test");
    let (node, manifests) = node_with_one_service();
    let agent = Agent::start_with(&node, manifests.path(), &["--log-format", "json"])
        .expect("starting the agent");
    let log = agent.log();
    let mut lines = Vec::new();
    for (n, line) in log.lines().enumerate() {
        let value: Value = serde_json::from_str(line).unwrap_or_else(|e| {
            panic!(
                "line {} of the JSON log is not JSON ({e}): {line:?}\nwhole log:\n{log}",
                n + 1
            )
        });
        for field in ["timestamp", "level", "target", "message"] {
            assert!(
                value.get(field).is_some_and(Value::is_string),
                "line {} of the JSON log has no string {field:?}: {line}",
                n + 1
            );
        }
        lines.push(value);
    }
    let loaded = lines
        .iter()
        .find(|l| l["message"] == "manifests loaded")
        .unwrap_or_else(|| panic!("no \"manifests loaded\" line in the JSON log:\n{log}"));
    assert_eq!(loaded["level"], "INFO", "level of {loaded}");
    // The module that logged it: a `RUST_LOG` directive for the manifest
    // source (`proxy_userspace::source::manifest`) covers its files.
    assert_eq!(
        loaded["target"], "proxy_userspace::source::manifest::watch",
        "target of {loaded}"
    );
    assert_eq!(
        (&loaded["services"], &loaded["endpoint_slices"]),
        (&Value::from(1), &Value::from(1)),
        "the event's own fields sit beside the message: {loaded}"
    );
    let source_span = loaded["spans"]
        .as_array()
        .and_then(|spans| spans.iter().find(|s| s["name"] == "manifest_source"))
        .unwrap_or_else(|| panic!("no manifest_source span in {loaded}"));
    assert_eq!(
        source_span["path"],
        manifests.path().display().to_string(),
        "the span's field: {loaded}"
    );
    let synced = lines
        .iter()
        .find(|l| l["span"]["name"] == "sync")
        .unwrap_or_else(|| panic!("no line logged inside a sync span:\n{log}"));
    assert!(
        synced["span"]["seq"].is_u64(),
        "the sync span's seq field: {synced}"
    );
}

/// `ebpf-proxy status` on pins that do not exist, with a `RUST_LOG` that is not
/// a filter: the agent logs a warning naming the variable (through the
/// subscriber under test) and fails without touching anything.
fn warn_and_fail(args: &[&str], on_terminal: bool, no_color: Option<&str>) -> String {
    let bin = agent::binary().expect("the agent binary");
    let missing = std::env::temp_dir().join(format!("{}-no-pins", unique_stem()));
    let mut argv = vec![bin.display().to_string()];
    argv.extend(args.iter().map(ToString::to_string));
    argv.extend([
        "status".into(),
        "--bpf-root".into(),
        missing.display().to_string(),
    ]);
    let mut cmd = if on_terminal {
        let quoted: Vec<String> = argv
            .iter()
            .map(|a| format!("'{}'", a.replace('\'', r"'\''")))
            .collect();
        let mut cmd = Command::new("script");
        // -q: no banner; -e: the command's exit status; /dev/null: no typescript.
        cmd.args(["-q", "-e", "-c", &quoted.join(" "), "/dev/null"]);
        cmd
    } else {
        let mut cmd = Command::new(&argv[0]);
        cmd.args(&argv[1..]);
        cmd
    };
    cmd.env("RUST_LOG", "info,proxy_userspace=loud")
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE");
    match no_color {
        Some(value) => cmd.env("NO_COLOR", value),
        None => cmd.env_remove("NO_COLOR"),
    };
    let Output {
        status,
        stdout,
        stderr,
    } = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        !status.success(),
        "status on pins that do not exist succeeded"
    );
    let text = String::from_utf8_lossy(&stdout).into_owned() + &String::from_utf8_lossy(&stderr);
    assert!(
        text.contains("RUST_LOG") && text.contains("not a log filter"),
        "the bad RUST_LOG was not reported: {text:?}"
    );
    text
}

#[test]
fn colour_only_on_a_terminal_and_never_with_no_color() {
    let piped = warn_and_fail(&[], false, None);
    assert!(
        !piped.contains(ESC),
        "escape sequences into a pipe: {piped:?}"
    );
    let terminal = warn_and_fail(&[], true, None);
    assert!(
        terminal.contains(&format!("{ESC}[")),
        "no colour on a terminal: {terminal:?}"
    );
    let empty = warn_and_fail(&[], true, Some(""));
    assert!(
        empty.contains(&format!("{ESC}[")),
        "an empty NO_COLOR is as if unset (no-color.org), yet no colour: {empty:?}"
    );
    let no_color = warn_and_fail(&[], true, Some("1"));
    assert!(
        !no_color.contains(ESC),
        "colour on a terminal despite NO_COLOR=1: {no_color:?}"
    );
    let json = warn_and_fail(&["--log-format", "json"], true, None);
    assert!(
        !json.contains(ESC),
        "escape sequences in the JSON log: {json:?}"
    );
    let line = json
        .lines()
        .find(|l| l.contains("not a log filter"))
        .expect("the warning line");
    let value: Value = serde_json::from_str(line.trim_end_matches('\r'))
        .unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}"));
    assert_eq!(
        (&value["level"], &value["variable"]),
        (&Value::from("WARN"), &Value::from("RUST_LOG")),
        "{value}"
    );
}
