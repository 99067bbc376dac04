//! `ebpf-proxy trace` on real packets: a routed node (docs/architecture.md,
//! "Test topologies") with a client pod and two backends, the agent in the
//! node namespace, a Service with endpoints (and a NodePort), one without
//! (rejects), one the filters leave out and one whose ClusterIP port is the
//! NodePort's number. The trace runs as an operator runs it, a child process
//! on the agent's pins with `--output json`, and each test reads its lines.
//!
//! Every test builds its own namespaces, bpffs root and manifest directory, so
//! they run in parallel; everything is removed on drop, also when a test fails.

use std::{
    io::{BufRead, BufReader},
    net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6},
    process::{Child, Command, Stdio},
    sync::mpsc::{self, Receiver, RecvTimeoutError},
    thread,
    time::{Duration, Instant},
};

use aya::maps::{Array, Map, MapData};
use ebpf_proxy_tests::{
    Protocol, agent,
    client::{Outcome, TIMEOUT, tcp_request_from_port_here},
    family::Family,
    manifest::{Service, ServiceType},
    require_root,
    sandbox::Sandbox,
    topology::{
        NODE_IP,
        one_node::{BACKENDS, CLIENT, TCP_PORT, UDP_PORT},
    },
    wait_until,
};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use proxy_common::map_names;
use proxy_userspace::datapath::PinLayout;
use serde_json::Value;

/// `test/web`: a ClusterIP with both backends.
const WEB_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 40);
/// `test/empty`: a ClusterIP without endpoints, whose packets are rejected.
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 41);
/// `test/other`: a ClusterIP with endpoints, which the filters leave out.
const OTHER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 42);
/// `test/high`: a ClusterIP whose port is web's NodePort's number, which
/// `--node-port` leaves out.
const HIGH_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 43);
/// `test/web`'s NodePort.
const NODE_PORT: u16 = 30480;
/// What the issue asks: a record on the trace's output within a second.
const WITHIN: Duration = Duration::from_secs(1);
/// How long a line that must not come is waited for.
const QUIET: Duration = Duration::from_millis(1500);

/// The sandbox with the three Services programmed.
fn sandbox() -> Sandbox {
    require_root().expect("privileged test");
    let backends = [BACKENDS[0], BACKENDS[1]];
    let mut sb = Sandbox::new(&[CLIENT], &backends, TCP_PORT, UDP_PORT).expect("sandbox");
    let ips = [BACKENDS[0].1, BACKENDS[1].1];
    for (name, ip, port, endpoints) in [
        ("web", WEB_IP, 80, &ips[..]),
        ("empty", EMPTY_IP, 80, &[][..]),
        ("other", OTHER_IP, 80, &ips[..]),
        ("high", HIGH_IP, NODE_PORT, &ips[..]),
    ] {
        let mut svc = Service::new("test", name, ip).port("http", port, Protocol::Tcp, TCP_PORT);
        if name == "web" {
            svc = svc
                .type_(ServiceType::NodePort)
                .node_port("http", NODE_PORT);
        }
        sb.manifests()
            .write(&format!("{name}.yaml"), &svc.yaml(Some(endpoints)))
            .unwrap_or_else(|e| panic!("write test/{name}: {e}"));
    }
    sb.start_agent_with(&[]).expect("agent");
    let programmed =
        wait_until(
            Duration::from_secs(10),
            Duration::from_millis(100),
            || match tcp_from(&sb, 40000, SocketAddrV4::new(EMPTY_IP, 80)) {
                Outcome::Refused => Ok(()),
                other => Err(format!("{other}")),
            },
        );
    if let Err(last) = programmed {
        panic!(
            "test/empty was never rejected (last: {last}); agent output:\n{}",
            sb.agent().log()
        );
    }
    sb
}

/// One TCP request from the client pod, from source port `port`.
fn tcp_from(sb: &Sandbox, port: u16, addr: SocketAddrV4) -> Outcome {
    sb.client()
        .ns
        .run(move || tcp_request_from_port_here(port, addr, TIMEOUT))
        .expect("run in the client pod")
}

/// A running `ebpf-proxy trace --output json`, its lines arriving on a
/// channel; killed on drop.
struct Trace {
    child: Child,
    lines: Receiver<String>,
    args: Vec<String>,
}

impl Trace {
    /// Starts the trace on `sb`'s agent with `filters`, and waits until it
    /// has switched the datapath's records on (a connection's record
    /// shows up).
    fn start(sb: &Sandbox, filters: &[&str]) -> Trace {
        let bin = agent::binary().expect("agent binary");
        let mut args = vec!["trace".to_owned(), "--output".to_owned(), "json".to_owned()];
        args.extend(filters.iter().map(|f| (*f).to_owned()));
        let mut child = Command::new(bin)
            .args(&args)
            .arg("--bpf-root")
            .arg(sb.agent().bpf_root())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting ebpf-proxy trace");
        let stdout = child.stdout.take().expect("the trace's stdout");
        let (send, lines) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        // The trace writes its deadline at start: give it a moment to.
        thread::sleep(Duration::from_millis(300));
        Trace { child, lines, args }
    }

    /// The first line within `wait` that `want` accepts, with every line
    /// before it; None if none came.
    fn expect_line(
        &self,
        wait: Duration,
        want: impl Fn(&Value) -> bool,
    ) -> (Option<Value>, Vec<String>) {
        let deadline = Instant::now() + wait;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let value: Value = serde_json::from_str(&line).unwrap_or_else(|e| {
                        panic!("trace {:?}: not JSON ({e}): {line}", self.args)
                    });
                    if want(&value) {
                        return (Some(value), seen);
                    }
                    seen.push(line);
                }
                Err(RecvTimeoutError::Timeout) => return (None, seen),
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("trace {:?} exited; lines before: {seen:?}", self.args)
                }
            }
        }
    }

    /// Every line that arrives within `wait`.
    fn lines_within(&self, wait: Duration) -> Vec<Value> {
        let (_, seen) = self.expect_line(wait, |_| false);
        seen.iter()
            .map(|l| serde_json::from_str(l).expect("JSON"))
            .collect()
    }
}

impl Trace {
    /// Stops the trace as an operator's Ctrl-C does, and waits for it.
    fn interrupt(&mut self) {
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGINT).expect("SIGINT the trace");
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.child.try_wait().expect("waiting on the trace") {
                Some(status) => {
                    assert!(
                        status.success(),
                        "trace {:?} exited with {status}",
                        self.args
                    );
                    return;
                }
                None if Instant::now() > deadline => {
                    panic!("trace {:?} still running 5 s after SIGINT", self.args)
                }
                None => thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

/// The deadline in the agent's pinned `TRACE_ON`.
fn trace_on(sb: &Sandbox) -> u64 {
    let path = PinLayout::new(sb.agent().bpf_root()).map(map_names::TRACE_ON);
    let data = MapData::from_pin(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let map = Map::from_map_data(data).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let array: Array<MapData, u64> = map.try_into().expect("TRACE_ON an array");
    array.get(&0, 0).expect("reading TRACE_ON")
}

impl Drop for Trace {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The client's address and `port` as the trace prints it.
fn client(port: u16) -> String {
    format!("{}:{port}", CLIENT.1)
}

/// A connection's translated line within a second, with the client's address
/// and the backend that answered it; a reject of the Service without endpoints.
#[test]
fn translated_and_rejected_flows_are_traced_with_client_and_backend() {
    let sb = sandbox();
    let trace = Trace::start(&sb, &[]);

    let sent = Instant::now();
    let reply = match tcp_from(&sb, 41001, SocketAddrV4::new(WEB_IP, 80)) {
        Outcome::Reply(reply) => reply,
        other => panic!("test/web: {other}"),
    };
    let (line, seen) = trace.expect_line(WITHIN, |v| v["client"] == client(41001));
    let Some(line) = line else {
        panic!(
            "no line for client {} within {WITHIN:?} of the connection; lines: {seen:?}",
            client(41001)
        );
    };
    assert!(
        sent.elapsed() < WITHIN + TIMEOUT,
        "the line took {:?}",
        sent.elapsed()
    );
    let (_, backend_ip) = BACKENDS
        .iter()
        .find(|(name, _)| *name == reply.backend)
        .unwrap_or_else(|| panic!("reply from an unknown backend {:?}", reply.backend));
    let expected = serde_json::json!({
        "service": "test/web",
        "port": "http",
        "protocol": "tcp",
        "client": client(41001),
        "frontend": format!("{WEB_IP}:80"),
        "backend": format!("{backend_ip}:{TCP_PORT}"),
        "verdict": "translated",
        "hook": "tc",
    });
    assert_eq!(line, expected, "the translated flow's line");

    assert_eq!(
        tcp_from(&sb, 41002, SocketAddrV4::new(EMPTY_IP, 80)),
        Outcome::Refused
    );
    let (line, seen) = trace.expect_line(WITHIN, |v| v["client"] == client(41002));
    let Some(line) = line else {
        panic!(
            "no line for the reject of {} within {WITHIN:?}; lines: {seen:?}",
            client(41002)
        );
    };
    let expected = serde_json::json!({
        "service": "test/empty",
        "port": "http",
        "protocol": "tcp",
        "client": client(41002),
        "frontend": format!("{EMPTY_IP}:80"),
        "backend": null,
        "verdict": "rejected",
        "hook": "tc",
    });
    assert_eq!(line, expected, "the reject's line");

    assert_ne!(trace_on(&sb), 0, "the deadline while the trace runs");
    let mut trace = trace;
    trace.interrupt();
    assert_eq!(trace_on(&sb), 0, "the deadline after the trace's SIGINT");
}

/// On pins without the trace's maps (an agent older than the trace, or none)
/// the trace fails and names the map it looked for.
#[test]
fn pins_without_the_trace_maps_are_an_error_naming_the_map() {
    let root = std::env::temp_dir().join(format!("ebpf-proxy-trace-nopins-{}", std::process::id()));
    let bin = agent::binary().expect("agent binary");
    let out = Command::new(bin)
        .args(["trace", "--bpf-root"])
        .arg(&root)
        .output()
        .expect("running ebpf-proxy trace");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "trace on {} succeeded: {stderr}",
        root.display()
    );
    assert!(
        stderr.contains(map_names::TRACE_ON) && stderr.contains("predates"),
        "the error names the missing map: {stderr}"
    );
}

/// `--service test/web` leaves out the other Services' flows and rejects, and
/// `--client` a client that is not the one asked for.
#[test]
fn filters_leave_out_other_services_and_clients() {
    let sb = sandbox();
    let by_service = Trace::start(&sb, &["--service", "test/web"]);
    let by_client = Trace::start(&sb, &["--client", "10.200.0.99"]);

    assert!(matches!(
        tcp_from(&sb, 42001, SocketAddrV4::new(OTHER_IP, 80)),
        Outcome::Reply(_)
    ));
    assert_eq!(
        tcp_from(&sb, 42002, SocketAddrV4::new(EMPTY_IP, 80)),
        Outcome::Refused
    );
    assert!(matches!(
        tcp_from(&sb, 42003, SocketAddrV4::new(WEB_IP, 80)),
        Outcome::Reply(_)
    ));

    // Two readers share the ring buffer (docs/operations.md): a record
    // reaches one of them or both. So the filters are checked in what each
    // printed, and the test/web flow below, in what either did.
    let service_lines = by_service.lines_within(QUIET);
    let client_lines = by_client.lines_within(Duration::from_millis(100));
    let foreign: Vec<&Value> = service_lines
        .iter()
        .filter(|v| v["service"] != "test/web")
        .collect();
    assert!(
        foreign.is_empty(),
        "--service test/web printed other Services' lines: {foreign:?}"
    );
    let foreign: Vec<&Value> = client_lines
        .iter()
        .filter(|v| {
            v["client"]
                .as_str()
                .is_none_or(|c| !c.starts_with("10.200.0.99:"))
        })
        .collect();
    assert!(
        foreign.is_empty(),
        "--client 10.200.0.99 printed other clients' lines: {foreign:?}"
    );
    drop(by_client);
    // Alone now, the service's trace sees every record: the test/web flow is
    // in it and the other two are not.
    let alone = Trace::start(&sb, &["--service", "test/web"]);
    assert!(matches!(
        tcp_from(&sb, 42011, SocketAddrV4::new(OTHER_IP, 80)),
        Outcome::Reply(_)
    ));
    assert_eq!(
        tcp_from(&sb, 42012, SocketAddrV4::new(EMPTY_IP, 80)),
        Outcome::Refused
    );
    assert!(matches!(
        tcp_from(&sb, 42013, SocketAddrV4::new(WEB_IP, 80)),
        Outcome::Reply(_)
    ));
    let lines: Vec<Value> = alone
        .lines_within(QUIET)
        .into_iter()
        .chain(by_service.lines_within(Duration::from_millis(100)))
        .collect();
    // Both readers may have read the same record.
    let mut clients: Vec<&str> = lines.iter().filter_map(|v| v["client"].as_str()).collect();
    clients.dedup();
    assert_eq!(
        clients,
        [client(42013).as_str()],
        "--service test/web: only the test/web flow; lines: {lines:?}"
    );
}

/// `--node-port` keeps the flows to that NodePort on a node address, and
/// leaves out a ClusterIP's flow to a port of the same number and one to
/// the NodePort Service's ClusterIP.
#[test]
fn the_node_port_filter_keeps_node_port_flows_only() {
    let sb = sandbox();
    let trace = Trace::start(&sb, &["--node-port", &NODE_PORT.to_string()]);
    assert!(matches!(
        tcp_from(&sb, 43001, SocketAddrV4::new(HIGH_IP, NODE_PORT)),
        Outcome::Reply(_)
    ));
    assert!(matches!(
        tcp_from(&sb, 43002, SocketAddrV4::new(WEB_IP, 80)),
        Outcome::Reply(_)
    ));
    let node_port = SocketAddrV4::new(NODE_IP, NODE_PORT);
    let outcome = tcp_from(&sb, 43003, node_port);
    assert!(
        matches!(outcome, Outcome::Reply(_)),
        "test/web's NodePort {node_port}: {outcome}"
    );
    let lines = trace.lines_within(QUIET);
    let seen: Vec<(&str, &str, &str)> = lines
        .iter()
        .map(|v| {
            (
                v["client"].as_str().unwrap_or("?"),
                v["frontend"].as_str().unwrap_or("?"),
                v["service"].as_str().unwrap_or("?"),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [(
            client(43003).as_str(),
            node_port.to_string().as_str(),
            "test/web"
        )],
        "--node-port {NODE_PORT}: the NodePort flow alone; lines: {lines:?}"
    );
}

/// IPv6, whose records take client and frontend from the packet's key: a
/// translated flow's line with the client's IPv6 address and the backend that
/// answered, as `[addr]:port`, and a reject's line.
#[test]
fn ipv6_flows_are_traced_with_bracketed_addresses() {
    require_root().expect("privileged test");
    let backends = [BACKENDS[0], BACKENDS[1]];
    let mut sb = Sandbox::new(&[CLIENT], &backends, TCP_PORT, UDP_PORT).expect("sandbox");
    let (web, empty) = (Ipv6Addr::vip(43), Ipv6Addr::vip(44));
    let ips: Vec<Ipv6Addr> = backends.iter().map(|b| Ipv6Addr::pod(b.1)).collect();
    for (name, vip, endpoints) in [("web6", web, &ips[..]), ("empty6", empty, &[][..])] {
        let svc = Ipv6Addr::service("test", name, vip).port("http", 80, Protocol::Tcp, TCP_PORT);
        sb.manifests()
            .write(&format!("{name}.yaml"), &Ipv6Addr::yaml(&svc, endpoints))
            .unwrap_or_else(|e| panic!("write test/{name}: {e}"));
    }
    sb.start_agent_with(&[]).expect("agent");
    let tcp6 = |port: u16, vip: Ipv6Addr| {
        sb.client()
            .ns
            .run(move || {
                tcp_request_from_port_here(port, SocketAddrV6::new(vip, 80, 0, 0), TIMEOUT)
            })
            .expect("run in the client pod")
    };
    let programmed = wait_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || match tcp6(45000, empty) {
            Outcome::Refused => Ok(()),
            other => Err(format!("{other}")),
        },
    );
    if let Err(last) = programmed {
        panic!(
            "test/empty6 was never rejected (last: {last}); agent output:\n{}",
            sb.agent().log()
        );
    }
    let trace = Trace::start(&sb, &[]);
    let client6 = |port: u16| format!("[{}]:{port}", Ipv6Addr::pod(CLIENT.1));

    let reply = match tcp6(45001, web) {
        Outcome::Reply(reply) => reply,
        other => panic!("test/web6: {other}"),
    };
    let (line, seen) = trace.expect_line(WITHIN, |v| v["client"] == client6(45001));
    let Some(line) = line else {
        panic!(
            "no line for {} within {WITHIN:?}; lines: {seen:?}",
            client6(45001)
        );
    };
    let (_, backend_ip) = BACKENDS
        .iter()
        .find(|(name, _)| *name == reply.backend)
        .unwrap_or_else(|| panic!("reply from an unknown backend {:?}", reply.backend));
    let expected = serde_json::json!({
        "service": "test/web6",
        "port": "http",
        "protocol": "tcp",
        "client": client6(45001),
        "frontend": format!("[{web}]:80"),
        "backend": format!("[{}]:{TCP_PORT}", Ipv6Addr::pod(*backend_ip)),
        "verdict": "translated",
        "hook": "tc",
    });
    assert_eq!(line, expected, "the translated IPv6 flow's line");

    assert_eq!(tcp6(45002, empty), Outcome::Refused);
    let (line, seen) = trace.expect_line(WITHIN, |v| v["client"] == client6(45002));
    let Some(line) = line else {
        panic!(
            "no line for the reject of {} within {WITHIN:?}; lines: {seen:?}",
            client6(45002)
        );
    };
    assert_eq!(
        (&line["service"], &line["verdict"], &line["backend"]),
        (
            &serde_json::json!("test/empty6"),
            &serde_json::json!("rejected"),
            &Value::Null
        ),
        "the IPv6 reject's line: {line}"
    );
}
