//! The node's own IPv6 sockets through the agent's socket hooks (`connect6`,
//! `sendmsg6`, `recvmsg6`, `getpeername6`), on real sockets in the routed one-node
//! topology (docs/architecture.md, "Test topologies"), with the agent's cgroup hooks
//! on a cgroup of each test's own: an IPv6 Service reached from the node's IPv6
//! sockets, which its IPv6 backend pods answer, and an IPv4 Service reached through an
//! IPv6 socket at its IPv4-mapped address; the node's IPv6 UDP sockets the hook
//! connected to a backend are closed when that backend leaves, as IPv4's are.
//!
//! Every test builds its own namespaces, cgroup, bpffs root and manifest directory, so
//! they run in parallel; everything is removed on drop, also when a test fails.

use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    process::Output,
    thread,
    time::{Duration, Instant},
};

use ebpf_proxy_tests::{
    Protocol,
    agent::SYNC_DEADLINE,
    cgroup::TestCgroup,
    manifest::{Service, SessionAffinity},
    netns::NetNs,
    require_root,
    sandbox::Sandbox,
    topology::{
        NODE_IP, NODE_IP6, add_node_ip6,
        one_node::{
            BACKENDS, CLIENT, CLUSTER_IP, CLUSTER_IP6, TCP_PORT, TCP_SERVICE_PORT, UDP_PORT,
            UDP_SERVICE_PORT, backend_ips, backend_ips6, backend_names, web_service,
        },
        pod_ip6,
    },
};

/// A sandbox with `manifests` written, the node holding [`NODE_IP6`], and the agent
/// running with its socket hooks on a cgroup of the test's own, returned with the
/// cgroup.
fn hooked_sandbox(manifests: &[(&str, String)]) -> (Sandbox, TestCgroup) {
    require_root().expect("privileged test");
    let mut sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    add_node_ip6(&sb.topology().node).expect("the node's IPv6 address");
    for (name, yaml) in manifests {
        sb.manifests().write(name, yaml).expect("write manifest");
    }
    let cgroup = TestCgroup::create(sb.topology().stem()).expect("a cgroup of the test's own");
    let root = cgroup.path().display().to_string();
    sb.start_agent_with(&["--cgroup-root", &root])
        .expect("start the agent");
    (sb, cgroup)
}

/// `program target args..` from the tests' binaries, run in `cgroup` in `ns`; its
/// stdout split into words, or a panic that says what failed.
fn run_in(
    sb: &Sandbox,
    ns: &NetNs,
    cgroup: &TestCgroup,
    program: &str,
    target: SocketAddr,
    args: &[&str],
) -> Vec<String> {
    let out: Output = cgroup
        .command_in(ns, program)
        .arg(target.to_string())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{program} {target}: {} {text:?} {:?}; agent log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        sb.agent().log()
    );
    text.split_whitespace().map(str::to_owned).collect()
}

/// `udp-connected` in `cgroup` in `ns`: one UDP socket connected to `target`; each
/// line asked is one exchange (`peer` asks `getpeername()`). Killed on drop.
struct ConnectedUdp {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl ConnectedUdp {
    fn start(ns: &NetNs, cgroup: &TestCgroup, target: SocketAddr) -> ConnectedUdp {
        let mut child = cgroup
            .command_in(ns, env!("CARGO_BIN_EXE_udp-connected"))
            .arg(target.to_string())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("starting udp-connected");
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = std::io::BufReader::new(child.stdout.take().expect("piped stdout"));
        ConnectedUdp {
            child,
            stdin,
            stdout,
        }
    }

    fn ask(&mut self, line: &str) -> String {
        use std::io::{BufRead, Write};
        writeln!(self.stdin, "{line}").expect("writing to udp-connected");
        let mut answer = String::new();
        self.stdout
            .read_line(&mut answer)
            .expect("reading from udp-connected");
        answer.trim().to_owned()
    }

    /// The backend that answered a datagram, or None for an error (the socket
    /// closed under its owner, say).
    fn backend(&mut self) -> Option<String> {
        let answer = self.ask("hi");
        (!answer.starts_with("error")).then(|| {
            answer
                .split_whitespace()
                .next()
                .unwrap_or_default()
                .to_owned()
        })
    }
}

impl Drop for ConnectedUdp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `addr` as an IPv6 socket names it: IPv4-mapped.
fn mapped(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::new(ip.to_ipv6_mapped().into(), port)
}

/// A TCP connection of the node to `target` (connection `i`): `getpeername()` must
/// show `target`, and a backend answer that saw an address starting with `node`.
/// Returns the backend.
fn tcp_from_the_node(
    sb: &Sandbox,
    cgroup: &TestCgroup,
    target: SocketAddr,
    node: &str,
    i: usize,
) -> String {
    // `<peer> <backend> <address the backend saw>`
    let words = run_in(
        sb,
        &sb.topology().node,
        cgroup,
        env!("CARGO_BIN_EXE_tcp-peer"),
        target,
        &[],
    );
    assert_eq!(words.len(), 3, "tcp-peer {target} printed {words:?}");
    assert_eq!(
        words[0],
        target.to_string(),
        "TCP connection {i} to {target} (reached {}): getpeername() shows another peer",
        words[1]
    );
    assert!(
        backend_names().contains(&words[1].as_str()),
        "connection {i} to {target} reached {words:?}, no backend"
    );
    assert!(
        words[2].starts_with(node),
        "connection {i} to {target}: the backend saw {}, not the node's address {node}",
        words[2]
    );
    words[1].clone()
}

/// The node's UDP sockets to `target`: a backend answers the datagram of an
/// unconnected socket, having seen an address starting with `node`, and the answer
/// shows `target` as its source; a connected socket gets its answer and shows
/// `target` as its peer.
fn udp_from_the_node(sb: &Sandbox, cgroup: &TestCgroup, target: SocketAddr, node: &str) {
    // `<backend> <address the backend saw> from <source>`
    let words = run_in(
        sb,
        &sb.topology().node,
        cgroup,
        env!("CARGO_BIN_EXE_udp-sendto"),
        target,
        &[],
    );
    assert_eq!(
        (words.len(), words[2].as_str(), words[3].as_str()),
        (4, "from", target.to_string().as_str()),
        "the answer to a datagram of an unconnected IPv6 socket to {target}: {words:?}"
    );
    assert!(
        backend_names().contains(&words[0].as_str()) && words[1].starts_with(node),
        "the datagram to {target} reached {words:?}"
    );
    let mut udp = ConnectedUdp::start(&sb.topology().node, cgroup, target);
    let answer = udp.ask("hi");
    assert!(
        backend_names().contains(&answer.split_whitespace().next().unwrap_or_default()),
        "a connected IPv6 UDP socket to {target} got {answer:?}"
    );
    assert_eq!(
        udp.ask("peer"),
        target.to_string(),
        "getpeername() of a connected IPv6 UDP socket to {target}"
    );
}

/// A TCP connection of the node to `target`, a Service without endpoints, is
/// refused.
fn refused(sb: &Sandbox, cgroup: &TestCgroup, target: SocketAddr) {
    let out = cgroup
        .command_in(&sb.topology().node, env!("CARGO_BIN_EXE_tcp-peer"))
        .arg(target.to_string())
        .output()
        .expect("running tcp-peer");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("refused"),
        "an IPv6 socket's connection to {target}, a Service without endpoints: {} {stderr:?}",
        out.status
    );
}

/// An IPv4 Service reached from an IPv6 socket of the node at the IPv4-mapped form of
/// its ClusterIP is that Service: TCP connections spread over its IPv4 backends, which
/// see the node's IPv4 address, and `getpeername()` shows the mapped ClusterIP; a
/// connected UDP socket gets its answer and shows the mapped ClusterIP as its peer; the
/// answer to an unconnected socket's datagram shows it as its source; a Service without
/// endpoints refuses.
#[test]
fn an_ipv4_service_is_reached_through_an_ipv6_socket_at_its_mapped_address() {
    let empty_ip = Ipv4Addr::new(10, 96, 0, 30);
    let (sb, cgroup) = hooked_sandbox(&[
        (
            "web.yaml",
            web_service(CLUSTER_IP).yaml(Some(&backend_ips())),
        ),
        (
            "empty.yaml",
            Service::new("test", "empty", empty_ip)
                .port("http", 80, Protocol::Tcp, TCP_PORT)
                .yaml(Some(&[])),
        ),
    ]);
    let node_ip = format!("{NODE_IP}:");
    let http = mapped(CLUSTER_IP, TCP_SERVICE_PORT);
    let reached: BTreeSet<String> = (0..8)
        .map(|i| tcp_from_the_node(&sb, &cgroup, http, &node_ip, i))
        .collect();
    assert!(
        reached.len() >= 2,
        "8 connections from the node's IPv6 sockets to {http} all reached {reached:?}"
    );
    udp_from_the_node(&sb, &cgroup, mapped(CLUSTER_IP, UDP_SERVICE_PORT), &node_ip);
    refused(&sb, &cgroup, mapped(empty_ip, 80));
}

/// The node's IPv6 sockets reach an IPv6 Service: TCP connections to its ClusterIP
/// spread over its IPv6 backend pods, which see the node's IPv6 address, and
/// `getpeername()` shows the ClusterIP; the answer to an unconnected UDP socket's
/// datagram shows the ClusterIP as its source, and a connected one shows it as its
/// peer; with ClientIP affinity every connection of the node reaches one backend;
/// `ebpf-proxy status` shows the IPv6 frontends and backends as `[addr]:port`; a
/// Service without endpoints refuses.
#[test]
fn the_nodes_ipv6_sockets_reach_an_ipv6_service() {
    let sticky_ip6 = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x20);
    let empty_ip6 = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x30);
    let (sb, cgroup) = hooked_sandbox(&[
        (
            "web6.yaml",
            Service::new_v6("test", "web6", CLUSTER_IP6)
                .port("http", TCP_SERVICE_PORT, Protocol::Tcp, TCP_PORT)
                .port("dns", UDP_SERVICE_PORT, Protocol::Udp, UDP_PORT)
                .yaml6(&backend_ips6()),
        ),
        (
            "sticky6.yaml",
            Service::new_v6("test", "sticky6", sticky_ip6)
                .port("http", TCP_SERVICE_PORT, Protocol::Tcp, TCP_PORT)
                .session_affinity(SessionAffinity::ClientIp {
                    timeout_seconds: None,
                })
                .yaml6(&backend_ips6()),
        ),
        (
            "empty6.yaml",
            Service::new_v6("test", "empty6", empty_ip6)
                .port("http", TCP_SERVICE_PORT, Protocol::Tcp, TCP_PORT)
                .yaml6(&[]),
        ),
    ]);
    let node_ip6 = format!("[{NODE_IP6}]:");
    let http = SocketAddr::new(CLUSTER_IP6.into(), TCP_SERVICE_PORT);
    let translated_before = sb.counter("sock_connect_translated");
    let reached: BTreeSet<String> = (0..8)
        .map(|i| tcp_from_the_node(&sb, &cgroup, http, &node_ip6, i))
        .collect();
    assert!(
        reached.len() >= 2,
        "8 connections from the node's IPv6 sockets to {http} all reached {reached:?}"
    );
    assert!(
        sb.counter("sock_connect_translated") >= translated_before + 8,
        "the connections were not counted as the hook's"
    );
    let sticky = SocketAddr::new(sticky_ip6.into(), TCP_SERVICE_PORT);
    let stuck: BTreeSet<String> = (0..8)
        .map(|i| tcp_from_the_node(&sb, &cgroup, sticky, &node_ip6, i))
        .collect();
    assert_eq!(
        stuck.len(),
        1,
        "ClientIP affinity: the node's connections to {sticky} reached {stuck:?}"
    );
    udp_from_the_node(
        &sb,
        &cgroup,
        SocketAddr::new(CLUSTER_IP6.into(), UDP_SERVICE_PORT),
        &node_ip6,
    );

    // `ebpf-proxy status` shows IPv6 frontends, backends and the node's IPv6 address
    // as `[addr]:port`.
    let status = sb.agent().status().expect("ebpf-proxy status");
    let backends6: Vec<String> = backend_ips6()
        .iter()
        .map(|ip| format!("[{ip}]:{TCP_PORT}"))
        .collect();
    let web6 = status
        .lines()
        .find(|line| line.starts_with(&format!("{http}/TCP (service id")))
        .unwrap_or_else(|| panic!("no line of {http}/TCP in the status:\n{status}"));
    assert!(
        backends6.iter().all(|b| web6.contains(b.as_str())),
        "the status line of {http}/TCP lacks a backend of {backends6:?}: {web6}"
    );
    assert!(
        status.contains(&format!("[{empty_ip6}]:{TCP_SERVICE_PORT}/TCP"))
            && status.contains(&format!("node IPv6 address: {NODE_IP6}")),
        "the status lacks the empty IPv6 frontend or the node's IPv6 address:\n{status}"
    );

    refused(
        &sb,
        &cgroup,
        SocketAddr::new(empty_ip6.into(), TCP_SERVICE_PORT),
    );
}

/// `n` connected UDP sockets of the node to `target`, each with the backend that
/// answered its first datagram.
fn connected_udp_clients(
    sb: &Sandbox,
    cgroup: &TestCgroup,
    target: SocketAddr,
    n: usize,
) -> Vec<(ConnectedUdp, String)> {
    (0..n)
        .map(|i| {
            let mut client = ConnectedUdp::start(&sb.topology().node, cgroup, target);
            let backend = client.backend().unwrap_or_else(|| {
                panic!(
                    "connected UDP client {i} of the node to {target} got no answer; agent log:\n{}",
                    sb.agent().log()
                )
            });
            (client, backend)
        })
        .collect()
}

/// A Service whose backends leave one at a time: its UDP frontend, the address of a
/// backend pod by name (as an IPv6 socket connects to it), and the manifest without
/// the named backend.
struct Departing {
    frontend: SocketAddr,
    pod: fn(&str) -> SocketAddr,
    without: fn(&str) -> (&'static str, String),
}

/// 12 connected IPv6 UDP sockets of the node to `service`'s frontend; then the
/// backend of the first leaves the Service: the agent closes exactly the sockets the
/// hook connected to it, within the sync deadline, and says so in its log, while the
/// others, and an IPv6 socket connected straight to the departing pod, keep theirs;
/// new sockets reach the remaining backends.
fn departed_backends_ipv6_sockets_are_closed(
    sb: &Sandbox,
    cgroup: &TestCgroup,
    service: &Departing,
) {
    let node = &sb.topology().node;
    let what = service.frontend;
    let mut clients = connected_udp_clients(sb, cgroup, service.frontend, 12);
    let departing = clients[0].1.clone();
    let mut direct = ConnectedUdp::start(node, cgroup, (service.pod)(&departing));
    assert_eq!(
        direct.backend().as_deref(),
        Some(departing.as_str()),
        "{what}: a socket connected straight to {departing}"
    );

    let (manifest, yaml) = (service.without)(&departing);
    sb.manifests()
        .write(manifest, &yaml)
        .expect("rewrite manifest");
    let written = Instant::now();
    let deadline = SYNC_DEADLINE + Duration::from_secs(1);
    while clients[0].0.backend().is_some() && written.elapsed() < deadline {
        thread::sleep(Duration::from_millis(50));
    }
    let mut closed = 0;
    for (i, (client, backend)) in clients.iter_mut().enumerate() {
        let now = client.backend();
        if *backend == departing {
            assert_eq!(
                now, None,
                "{what}: client {i}: {deadline:?} after {departing} left, its socket still reaches it"
            );
            closed += 1;
        } else {
            assert_eq!(
                now.as_ref(),
                Some(&*backend),
                "{what}: client {i} of {backend}, which stays, lost its socket"
            );
        }
    }
    assert_eq!(
        direct.backend().as_deref(),
        Some(departing.as_str()),
        "{what}: a socket connected straight to the pod's address, not through the hook, was closed"
    );
    assert!(
        sb.agent()
            .log()
            .contains(&format!("closed {closed} UDP sockets")),
        "{what}: the agent's log does not say it closed {closed} sockets:\n{}",
        sb.agent().log()
    );
    for i in 0..10 {
        let backend = ConnectedUdp::start(node, cgroup, service.frontend).backend();
        assert!(
            backend.as_ref().is_some_and(|b| *b != departing),
            "{what}: new connected UDP socket {i} after {departing} left: {backend:?}"
        );
    }
}

/// The address of backend pod `name` (one of [`BACKENDS`]).
fn backend_ip(name: &str) -> Ipv4Addr {
    BACKENDS
        .iter()
        .find(|b| b.0 == name)
        .unwrap_or_else(|| panic!("answer from {name}, no backend of the test"))
        .1
}

/// A UDP socket of the node that the IPv6 `connect()` hook connected to an IPv6
/// backend stays connected to it, as an IPv4 one does, so when the backend leaves its
/// Service the agent closes the socket (its notes in `SOCK_NOTES6`, read through their
/// own pinned iterator): its owner reads an error and reconnects to a live backend.
/// The node's sockets the hook sent elsewhere, and one connected straight to the
/// departed pod's IPv6 address, are left alone.
#[test]
fn the_nodes_ipv6_udp_sockets_connected_to_a_departed_backend_are_closed() {
    fn web6(backends: &[Ipv6Addr]) -> String {
        Service::new_v6("test", "web6", CLUSTER_IP6)
            .port("dns", UDP_SERVICE_PORT, Protocol::Udp, UDP_PORT)
            .yaml6(backends)
    }
    let (sb, cgroup) = hooked_sandbox(&[("web6.yaml", web6(&backend_ips6()))]);
    departed_backends_ipv6_sockets_are_closed(
        &sb,
        &cgroup,
        &Departing {
            frontend: SocketAddr::new(CLUSTER_IP6.into(), UDP_SERVICE_PORT),
            pod: |name| SocketAddr::new(IpAddr::V6(pod_ip6(backend_ip(name))), UDP_PORT),
            without: |name| {
                let remaining: Vec<Ipv6Addr> = BACKENDS
                    .iter()
                    .filter(|b| b.0 != name)
                    .map(|b| pod_ip6(b.1))
                    .collect();
                ("web6.yaml", web6(&remaining))
            },
        },
    );
}

/// The same for an IPv4 Service reached from IPv6 sockets at its IPv4-mapped
/// ClusterIP: the hook noted them in `SOCK_NOTES` by the IPv4 backend, and the agent
/// finds them among the node's IPv6 sockets and closes them when that backend leaves.
#[test]
fn the_nodes_ipv6_udp_sockets_connected_to_a_departed_ipv4_backend_are_closed() {
    let (sb, cgroup) = hooked_sandbox(&[(
        "web.yaml",
        web_service(CLUSTER_IP).yaml(Some(&backend_ips())),
    )]);
    departed_backends_ipv6_sockets_are_closed(
        &sb,
        &cgroup,
        &Departing {
            frontend: mapped(CLUSTER_IP, UDP_SERVICE_PORT),
            pod: |name| mapped(backend_ip(name), UDP_PORT),
            without: |name| {
                let remaining: Vec<Ipv4Addr> = BACKENDS
                    .iter()
                    .filter(|b| b.0 != name)
                    .map(|b| b.1)
                    .collect();
                ("web.yaml", web_service(CLUSTER_IP).yaml(Some(&remaining)))
            },
        },
    );
}
