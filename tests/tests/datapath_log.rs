//! The datapath's log of rare events on real packets: a routed node
//! (docs/architecture.md, "Test topologies") with a client pod, the agent in the
//! node namespace, a Service without endpoints (rejects) and a LoadBalancer whose
//! source ranges leave the client out (drops). Each test looks for the records in
//! the agent's own output, where they arrive under the target `datapath`.
//!
//! Every test builds its own namespaces, bpffs root and manifest directory, so they
//! run in parallel; everything is removed on drop, also when a test fails.

use std::{
    net::{Ipv4Addr, SocketAddrV4, UdpSocket},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use ebpf_proxy_tests::{
    Protocol,
    agent::{self, Agent},
    client::{Outcome, tcp_request_from_port_here},
    manifest::{Service, ServiceType},
    require_root, run_cmd,
    sandbox::Sandbox,
    wait_for, wait_until,
};
use proxy_common::datapath_log::PER_CPU_PER_WINDOW;

use ebpf_proxy_tests::topology::one_node::{CLIENT, TCP_PORT, UDP_PORT};

const BACKEND: (&str, Ipv4Addr) = ebpf_proxy_tests::topology::one_node::BACKENDS[0];
/// `test/empty`: a ClusterIP without endpoints, whose packets are rejected.
const EMPTY_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 30);
/// `test/lb`'s load-balancer IP; its source ranges leave the client out.
const LB_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 70, 10);
use ebpf_proxy_tests::client::TIMEOUT;
/// A dropped connection attempt is given this long to (wrongly) succeed.
const DROP_WAIT: Duration = Duration::from_millis(700);
/// How long a record may take from the datapath to the agent's output.
const LOG_WAIT: Duration = Duration::from_secs(5);

/// A sandbox with the agent (run with `args`) on `test/empty` and `test/lb`, both
/// programmed: the empty Service refuses a connection.
fn sandbox(args: &[&str]) -> Sandbox {
    require_root().expect("privileged test");
    let mut sb = Sandbox::new(&[CLIENT], &[BACKEND], TCP_PORT, UDP_PORT).expect("sandbox");
    let empty = Service::new("test", "empty", EMPTY_IP)
        .port("http", 80, Protocol::Tcp, TCP_PORT)
        .port("dns", 53, Protocol::Udp, UDP_PORT);
    sb.manifests()
        .write("empty.yaml", &empty.yaml(Some(&[])))
        .expect("write test/empty");
    let lb = Service::new("test", "lb", Ipv4Addr::new(10, 96, 0, 31))
        .port("http", 80, Protocol::Tcp, TCP_PORT)
        .type_(ServiceType::LoadBalancer)
        .load_balancer_ingress(LB_IP)
        .load_balancer_source_range("192.168.99.0/24");
    sb.manifests()
        .write("lb.yaml", &lb.yaml(Some(&[BACKEND.1])))
        .expect("write test/lb");
    sb.start_agent_with(args).expect("agent");
    wait_programmed(&sb);
    sb
}

/// Waits until a connection to the empty Service is refused (the agent has
/// programmed the manifests). Uses source port 40000, which no test looks for.
fn wait_programmed(sb: &Sandbox) {
    let rejected = wait_until(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || match tcp_from(sb, 40000, SocketAddrV4::new(EMPTY_IP, 80), TIMEOUT) {
            Outcome::Refused => Ok(()),
            other => Err(format!("{other}")),
        },
    );
    if let Err(last) = rejected {
        panic!(
            "the empty Service was never rejected (last: {last}); agent output:\n{}",
            sb.agent().log()
        );
    }
}

/// One TCP connection attempt from the client pod, from source port `port`.
fn tcp_from(sb: &Sandbox, port: u16, addr: SocketAddrV4, wait: Duration) -> Outcome {
    sb.client()
        .ns
        .run(move || tcp_request_from_port_here(port, addr, wait))
        .expect("run in the client pod")
}

/// `count` UDP datagrams from the client pod, from source port `port`, as fast as
/// the socket takes them (an unconnected socket: ICMP answers raise no errors).
fn udp_from(sb: &Sandbox, port: u16, addr: SocketAddrV4, count: usize) {
    sb.client()
        .ns
        .run(move || -> std::io::Result<()> {
            let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port))?;
            for _ in 0..count {
                socket.send_to(b"ping\n", addr)?;
            }
            Ok(())
        })
        .expect("run in the client pod")
        .unwrap_or_else(|e| panic!("sending to {addr} from port {port}: {e}"));
}

/// The agent's lines from the datapath that contain `text`.
fn datapath_lines(agent: &Agent, text: &str) -> Vec<String> {
    agent
        .log()
        .lines()
        .filter(|l| l.contains(" datapath: ") && l.contains(text))
        .map(str::to_owned)
        .collect()
}

/// Waits until the agent has logged a datapath line containing every one of
/// `parts`; panics with the agent's datapath lines if it never does.
#[track_caller]
fn expect_logged(agent: &Agent, parts: &[&str]) -> String {
    let found = wait_for(LOG_WAIT, Duration::from_millis(100), || {
        datapath_lines(agent, parts[0])
            .into_iter()
            .find(|l| parts.iter().all(|p| l.contains(p)))
            .ok_or("no such line yet")
    });
    let Ok((line, _)) = found else {
        panic!(
            "no datapath log line with {parts:?} within {LOG_WAIT:?}; the agent's datapath lines:\n{}",
            datapath_lines(agent, "").join("\n")
        )
    };
    line
}

fn counter(agent: &Agent, name: &str) -> u64 {
    agent
        .counter(name)
        .unwrap_or_else(|e| panic!("counter {name}: {e:#}"))
}

/// `ebpf-proxy datapath-log LEVEL` on the agent's pins, as an operator runs it.
fn switch_level(agent: &Agent, level: &str) -> String {
    let bin = agent::binary().expect("agent binary");
    run_cmd(
        Command::new(bin)
            .args(["datapath-log", level, "--bpf-root"])
            .arg(agent.bpf_root()),
    )
    .unwrap_or_else(|e| panic!("datapath-log {level}: {e:#}"))
}

/// With `--datapath-log info`: a TCP reset, an ICMP port unreachable and a
/// source-range drop each leave a line with the protocol, addresses and ports.
#[test]
fn rejects_and_source_range_drops_are_logged_with_addresses_and_ports() {
    let sb = sandbox(&["--datapath-log", "info"]);
    let agent = sb.agent();

    let outcome = tcp_from(&sb, 40101, SocketAddrV4::new(EMPTY_IP, 80), TIMEOUT);
    assert_eq!(outcome, Outcome::Refused, "a Service without endpoints");
    let line = expect_logged(
        agent,
        &["reject sent", "tcp 10.200.0.2:40101 -> 10.96.0.30:80"],
    );
    assert!(line.contains("INFO"), "a reject is logged at info: {line}");

    udp_from(&sb, 40102, SocketAddrV4::new(EMPTY_IP, 53), 1);
    expect_logged(
        agent,
        &["reject sent", "udp 10.200.0.2:40102 -> 10.96.0.30:53"],
    );

    let denied = tcp_from(&sb, 40103, SocketAddrV4::new(LB_IP, 80), DROP_WAIT);
    assert_eq!(denied, Outcome::Timeout, "the client is outside the ranges");
    assert!(
        counter(agent, "drop_source_range") > 0,
        "the drop is counted"
    );
    expect_logged(
        agent,
        &[
            "loadBalancerSourceRanges",
            "tcp 10.200.0.2:40103 -> 192.168.70.10:80",
        ],
    );
}

/// Off by default: the same traffic logs nothing. `ebpf-proxy datapath-log info`
/// turns it on in the running agent, and `off` off again.
#[test]
fn off_by_default_and_switched_at_run_time() {
    let sb = sandbox(&[]);
    let agent = sb.agent();
    let before = counter(agent, "reject");
    let outcome = tcp_from(&sb, 40201, SocketAddrV4::new(EMPTY_IP, 80), TIMEOUT);
    assert_eq!(outcome, Outcome::Refused, "a Service without endpoints");
    let denied = tcp_from(&sb, 40202, SocketAddrV4::new(LB_IP, 80), DROP_WAIT);
    assert_eq!(denied, Outcome::Timeout, "the client is outside the ranges");
    assert!(counter(agent, "reject") > before, "the reject is counted");
    // The point: an absence is checked, so there is no condition to wait for;
    // records written would have reached the output within this.
    thread::sleep(Duration::from_secs(1));
    let lines = datapath_lines(agent, "");
    assert!(
        lines.is_empty(),
        "the datapath logged with its log off:\n{}",
        lines.join("\n")
    );

    let said = switch_level(agent, "info");
    assert!(
        said.contains("info"),
        "datapath-log says what it set: {said}"
    );
    let outcome = tcp_from(&sb, 40203, SocketAddrV4::new(EMPTY_IP, 80), TIMEOUT);
    assert_eq!(outcome, Outcome::Refused);
    expect_logged(
        agent,
        &["reject sent", "tcp 10.200.0.2:40203 -> 10.96.0.30:80"],
    );

    switch_level(agent, "off");
    let rejects = counter(agent, "reject");
    let outcome = tcp_from(&sb, 40204, SocketAddrV4::new(EMPTY_IP, 80), TIMEOUT);
    assert_eq!(outcome, Outcome::Refused);
    assert!(counter(agent, "reject") > rejects, "the reject is counted");
    // The point, as above: nothing must come, so the wait is for a time.
    thread::sleep(Duration::from_secs(1));
    let lines = datapath_lines(agent, ":40204 ");
    assert!(
        lines.is_empty(),
        "logged after datapath-log off:\n{}",
        lines.join("\n")
    );
}

/// A flood of rejects: each CPU writes at most `PER_CPU_PER_WINDOW` records a
/// second, the rest are counted as rate limited, and nothing is lost between
/// the two. Rejects over the node's ICMP error budget are not sent, so not
/// logged: counted apart (`reject_rate_limited`).
#[test]
fn a_flood_of_rejects_is_rate_limited() {
    const FLOOD: usize = 5000;
    let sb = sandbox(&["--datapath-log", "info"]);
    let agent = sb.agent();
    // The reject `sandbox` waited for is logged before the counts are taken.
    expect_logged(agent, &["reject sent", ":40000 "]);
    let rejects_before = counter(agent, "reject");
    let limited_before = counter(agent, "log_rate_limited");
    let unsent_before = counter(agent, "reject_rate_limited");
    let start = Instant::now();
    udp_from(&sb, 40301, SocketAddrV4::new(EMPTY_IP, 53), FLOOD);
    let elapsed = start.elapsed();

    let decided = counter(agent, "reject") - rejects_before;
    assert!(
        decided >= FLOOD as u64 / 2,
        "only {decided} of {FLOOD} datagrams were rejected"
    );
    let unsent = counter(agent, "reject_rate_limited") - unsent_before;
    let rejects = decided - unsent;
    // Every reject is either a record or a count; wait for the records (the
    // count below says what was missing if they never all come).
    let mut seen = (0, 0);
    let _ = wait_until(LOG_WAIT, Duration::from_millis(100), || {
        let lines = datapath_lines(agent, ":40301 ").len() as u64;
        let limited = counter(agent, "log_rate_limited") - limited_before;
        seen = (lines, limited);
        if lines + limited >= rejects {
            Ok(())
        } else {
            Err(format!("{lines} records + {limited} rate limited"))
        }
    });
    let (lines, limited) = seen;
    let cpus = aya::util::nr_cpus().expect("CPU count") as u64;
    // The flood spans at most this many one-second windows.
    let windows = elapsed.as_secs() + 2;
    let bound = u64::from(PER_CPU_PER_WINDOW) * cpus * windows;
    assert!(
        lines <= bound,
        "{lines} lines for {rejects} rejects in {elapsed:?}: more than {PER_CPU_PER_WINDOW} a second on each of {cpus} CPUs ({bound})"
    );
    assert!(lines > 0, "nothing logged of {rejects} rejects");
    assert!(limited > 0, "the rate-limited counter did not move");
    assert_eq!(
        lines + limited,
        rejects,
        "{rejects} rejects sent ({decided} decided, {unsent} over the ICMP error budget), \
         {lines} records, {limited} rate limited: records lost"
    );
}

/// Records the programs write while no agent runs wait in the pinned ring buffer,
/// and the next agent on the same pins forwards them.
#[test]
fn records_written_between_agents_reach_the_next_one() {
    let mut sb = sandbox(&["--datapath-log", "info"]);
    let status = sb.agent_mut().terminate().expect("stop the agent");
    assert!(status.success(), "the agent exits cleanly: {status}");
    let outcome = tcp_from(&sb, 40401, SocketAddrV4::new(EMPTY_IP, 80), TIMEOUT);
    assert_eq!(
        outcome,
        Outcome::Refused,
        "the datapath serves with no agent running"
    );
    let next = sb
        .agent_on_the_same_root(&["--datapath-log", "info"])
        .expect("the next agent");
    expect_logged(
        &next,
        &["reject sent", "tcp 10.200.0.2:40401 -> 10.96.0.30:80"],
    );
}
