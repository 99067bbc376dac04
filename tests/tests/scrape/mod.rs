//! One scrape of the agent's /metrics, parsed, for the tests that read
//! it (`metrics.rs`, `service_metrics.rs`): its samples by series, the wait for
//! a snapshot begun after the call, and promtool's check of the exposition.

use std::{
    collections::BTreeMap,
    io::Write,
    net::SocketAddrV4,
    process::{Command, Stdio},
    time::Duration,
};

use ebpf_proxy_tests::{agent::http_get, eventually_value, netns::NetNs};

/// One scrape: every sample by its series (`name{labels}` as exposed).
pub struct Scrape {
    pub text: String,
    samples: BTreeMap<String, f64>,
}

impl Scrape {
    pub fn parse(text: String) -> Scrape {
        let samples = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .map(|line| {
                let (series, value) = line
                    .rsplit_once(' ')
                    .unwrap_or_else(|| panic!("a sample line without a value: {line:?}"));
                let value = value
                    .parse()
                    .unwrap_or_else(|_| panic!("a sample whose value is not a number: {line:?}"));
                (series.to_owned(), value)
            })
            .collect();
        Scrape { text, samples }
    }

    /// The sum of `name`'s samples whose labels include every one of `labels`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let matching: Vec<f64> = self
            .samples
            .iter()
            .filter(|(series, _)| {
                let (n, rest) = series.split_once('{').unwrap_or((series, ""));
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
            })
            .map(|(_, v)| *v)
            .collect();
        (!matching.is_empty()).then(|| matching.iter().sum())
    }

    /// [`Scrape::sum`], which must exist.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.sum(name, labels).unwrap_or_else(|| {
            panic!(
                "no sample of {name} with {labels:?} in the exposition:\n{}",
                self.text
            )
        })
    }
}

/// A scrape that sees what happened before it: /metrics is served from a
/// snapshot up to a second old (docs/security.md, "HTTP endpoints"), so the
/// first snapshot begun after the call, one whose count of encodings is past
/// that of the snapshot answering at the call.
pub fn scrape(node: &NetNs, metrics: SocketAddrV4) -> Scrape {
    const SNAPSHOTS: &str = "ebpf_proxy_metrics_snapshots_total";
    let at_call = scrape_now(node, metrics).get(SNAPSHOTS, &[]);
    eventually_value(
        "a /metrics snapshot begun after the scrape was asked for",
        Duration::from_secs(5),
        || {
            let now = scrape_now(node, metrics);
            match now.get(SNAPSHOTS, &[]) {
                n if n > at_call => Ok(now),
                n => Err(format!(
                    "still snapshot {n} ({SNAPSHOTS}), the one answering at the call"
                )),
            }
        },
    )
    .0
}

/// What /metrics answers now (a snapshot up to a second old).
pub fn scrape_now(node: &NetNs, metrics: SocketAddrV4) -> Scrape {
    let (status, response) = node
        .run(|| http_get(metrics, "/metrics"))
        .expect("enter the node namespace")
        .expect("GET /metrics");
    assert_eq!(status, 200, "GET /metrics answered:\n{response}");
    let (head, body) = response
        .split_once("\r\n\r\n")
        .expect("an HTTP response with a body");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "not Prometheus' text format:\n{head}"
    );
    Scrape::parse(dechunk(head, body))
}

/// The body of a chunked response, as is otherwise.
fn dechunk(head: &str, body: &str) -> String {
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return body.to_owned();
    }
    let mut out = String::new();
    let mut rest = body;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let size = usize::from_str_radix(size.trim(), 16).expect("a chunk size");
        if size == 0 {
            break;
        }
        out.push_str(&after[..size]);
        rest = &after[size + 2..];
    }
    out
}

/// `promtool check metrics` on the exposition: it parses it as Prometheus
/// does and lints names, types and help.
pub fn promtool_accepts(scrape: &Scrape) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (Debian's prometheus package; `cargo xtask setup` installs it)");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(scrape.text.as_bytes())
        .expect("write the exposition to promtool");
    let out = child.wait_with_output().expect("promtool");
    assert!(
        out.status.success(),
        "promtool check metrics refused the exposition ({}): {}{}\n----- exposition -----\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        scrape.text
    );
}
