//! The scenarios of `socket_hooks.rs` and `socket_hooks6.rs`, once over the family
//! ([`Family`]): the node's own sockets of one family through the agent's socket
//! hooks, on real sockets in the routed one-node topology (docs/architecture.md,
//! "Test topologies"), with the agent's cgroup hooks on a cgroup of each test's own,
//! and the tools both test files drive those sockets with.
//!
//! Every scenario builds its own namespaces, cgroup, bpffs root and manifest
//! directory, so they run in parallel; everything is removed on drop, also when one
//! fails.

use std::{
    collections::BTreeSet,
    net::{Ipv6Addr, SocketAddr},
    process::Output,
    time::Duration,
};

use ebpf_proxy_tests::{
    POLL, Protocol,
    agent::SYNC_DEADLINE,
    cgroup::TestCgroup,
    eventually_value,
    family::Family,
    manifest::SessionAffinity,
    netns::NetNs,
    require_root,
    sandbox::Sandbox,
    topology::one_node::{
        BACKENDS, CLIENT, TCP_PORT, TCP_SERVICE_PORT, UDP_PORT, UDP_SERVICE_PORT, backend_names,
    },
    wait_until,
};
use proxy_common::sock_note;
use proxy_userspace::{
    datapath::PinLayout,
    housekeeping::{
        sock_diag::{SockDiag, SockDiagError, UdpSocket},
        sock_notes::{self, Notes, Notes6, SockNotesError},
    },
};

/// A sandbox with `manifests` written, the node holding its address of family `F`,
/// and the agent running with its socket hooks on a cgroup of the test's own,
/// returned with the cgroup.
pub fn hooked_sandbox<F: Family>(manifests: &[(&str, String)]) -> (Sandbox, TestCgroup) {
    hooked_sandbox_with::<F>(manifests, &[])
}

/// [`hooked_sandbox`], the agent started with `args` too.
pub fn hooked_sandbox_with<F: Family>(
    manifests: &[(&str, String)],
    args: &[&str],
) -> (Sandbox, TestCgroup) {
    require_root().expect("privileged test");
    let mut sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
    F::give_node_its_address(&sb.topology().node).expect("the node's address of the family");
    for (name, yaml) in manifests {
        sb.manifests().write(name, yaml).expect("write manifest");
    }
    let cgroup = TestCgroup::create(sb.topology().stem()).expect("a cgroup of the test's own");
    let root = cgroup.path().display().to_string();
    let args: Vec<&str> = ["--cgroup-root", root.as_str()]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    sb.start_agent_with(&args).expect("start the agent");
    (sb, cgroup)
}

/// `test/web` of family `F` on its ClusterIP (`http` 80/TCP -> 8080, `dns` 53/UDP ->
/// 5353) with `backends` ready, as `web.yaml`.
pub fn web<F: Family>(backends: &[F]) -> (&'static str, String) {
    let service = F::service("test", "web", F::cluster_ip())
        .port("http", TCP_SERVICE_PORT, Protocol::Tcp, TCP_PORT)
        .port("dns", UDP_SERVICE_PORT, Protocol::Udp, UDP_PORT);
    ("web.yaml", F::yaml(&service, backends))
}

/// `test/sticky` of family `F` on ClusterIP `ip` (`http` 80/TCP -> 8080) with ClientIP
/// affinity and every backend ready, as `sticky.yaml`.
pub fn sticky<F: Family>(ip: F) -> (&'static str, String) {
    let service = F::service("test", "sticky", ip)
        .port("http", TCP_SERVICE_PORT, Protocol::Tcp, TCP_PORT)
        .session_affinity(SessionAffinity::ClientIp {
            timeout_seconds: None,
        });
    ("sticky.yaml", F::yaml(&service, &F::backend_ips()))
}

/// `program target args..` from the tests' binaries, run in `cgroup` in `ns`; its
/// stdout split into words, or a panic that says what failed.
pub fn run_in(
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

/// `udp-connected` in `cgroup` in `ns`: one UDP socket connected to `target` for the
/// process's life, one exchange per line (`peer` asks `getpeername()`). Killed on
/// drop.
pub struct ConnectedUdp {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl ConnectedUdp {
    pub fn start(ns: &NetNs, cgroup: &TestCgroup, target: SocketAddr) -> ConnectedUdp {
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

    /// One line and its answer: `hi` is a datagram and its answer (`<backend>
    /// <peer>`) or `error: ...`, within the client's 1 s receive timeout.
    pub fn ask(&mut self, line: &str) -> String {
        use std::io::{BufRead, Write};
        writeln!(self.stdin, "{line}").expect("writing to udp-connected");
        let mut answer = String::new();
        self.stdout
            .read_line(&mut answer)
            .expect("reading from udp-connected");
        answer.trim().to_owned()
    }

    /// What `getpeername()` says the socket is connected to.
    pub fn peer(&mut self) -> String {
        self.ask("peer")
    }

    /// The backend that answered a datagram, or None for an error (the socket
    /// closed under its owner, say).
    pub fn backend(&mut self) -> Option<String> {
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

/// A TCP connection of the node to `target` (connection `i`): `getpeername()` must
/// show `target`, and a backend answer that saw an address starting with `node`.
/// Returns the backend.
pub fn tcp_from_the_node(
    sb: &Sandbox,
    cgroup: &TestCgroup,
    target: SocketAddr,
    node: &str,
    i: usize,
) -> String {
    tcp_from(sb, &sb.topology().node, cgroup, target, node, i)
}

/// [`tcp_from_the_node`] from namespace `ns`, whose address starts with `client`.
pub fn tcp_from(
    sb: &Sandbox,
    ns: &NetNs,
    cgroup: &TestCgroup,
    target: SocketAddr,
    client: &str,
    i: usize,
) -> String {
    // `<peer> <backend> <address the backend saw>`
    let words = run_in(sb, ns, cgroup, env!("CARGO_BIN_EXE_tcp-peer"), target, &[]);
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
        words[2].starts_with(client),
        "connection {i} to {target}: the backend saw {}, not the client's address {client}",
        words[2]
    );
    words[1].clone()
}

/// The node's UDP sockets to `target`: a backend answers each of `datagrams`
/// datagrams of unconnected sockets, having seen an address starting with `node`,
/// every answer shows `target` as its source, and they reach at least two backends;
/// a connected socket gets its answer and shows `target` as its peer.
pub fn udp_from_the_node(
    sb: &Sandbox,
    cgroup: &TestCgroup,
    target: SocketAddr,
    node: &str,
    datagrams: usize,
) {
    let mut reached = BTreeSet::new();
    for i in 0..datagrams {
        // `<backend> <address the backend saw> from <source>`
        let words = run_in(
            sb,
            &sb.topology().node,
            cgroup,
            env!("CARGO_BIN_EXE_udp-sendto"),
            target,
            &[],
        );
        let word = |n: usize| words.get(n).map(String::as_str);
        assert_eq!(
            (words.len(), word(2), word(3)),
            (4, Some("from"), Some(target.to_string().as_str())),
            "the answer to datagram {i} of an unconnected socket to {target}: {words:?}"
        );
        assert!(
            backend_names().contains(&words[0].as_str()) && words[1].starts_with(node),
            "datagram {i} to {target} reached {words:?}"
        );
        reached.insert(words[0].clone());
    }
    assert!(
        reached.len() >= 2,
        "{datagrams} datagrams from unconnected sockets to {target} all reached {reached:?}"
    );
    let mut udp = ConnectedUdp::start(&sb.topology().node, cgroup, target);
    let answer = udp.ask("hi");
    assert!(
        backend_names().contains(&answer.split_whitespace().next().unwrap_or_default()),
        "a connected UDP socket to {target} got {answer:?}"
    );
    assert_eq!(
        udp.peer(),
        target.to_string(),
        "getpeername() of a connected UDP socket to {target}"
    );
}

/// A TCP connection of the node to `target`, a Service without endpoints, is
/// refused.
pub fn refused(sb: &Sandbox, cgroup: &TestCgroup, target: SocketAddr) {
    let out = cgroup
        .command_in(&sb.topology().node, env!("CARGO_BIN_EXE_tcp-peer"))
        .arg(target.to_string())
        .output()
        .expect("running tcp-peer");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("refused"),
        "the node's connection to {target}, a Service without endpoints: {} {stderr:?}",
        out.status
    );
}

/// `ebpf-proxy status` shows `test/web`'s `http` frontend of family `F` with every
/// backend, the frontend of `empty_ip`, and the node's address.
fn status_shows_the_frontends<F: Family>(sb: &Sandbox, empty_ip: F) {
    let http = F::http(F::cluster_ip());
    let status = sb.agent().status().expect("ebpf-proxy status");
    let backends: Vec<String> = F::backend_ips()
        .into_iter()
        .map(|ip| F::addr(ip, TCP_PORT).to_string())
        .collect();
    // A frontend's backends are its port's (the `port` line above it),
    // unless its own line lists others.
    let frontend = format!("    ClusterIP {http}/TCP");
    let mut port_line = "";
    let line = status
        .lines()
        .find_map(|line| {
            if line.starts_with("  port ") {
                port_line = line;
            }
            match line.strip_prefix(frontend.as_str()) {
                Some(rest) if rest.contains(" -> ") => Some(line),
                Some(_) => Some(port_line),
                None => None,
            }
        })
        .unwrap_or_else(|| panic!("no line of {http}/TCP in the status:\n{status}"));
    assert!(
        backends.iter().all(|b| line.contains(b.as_str())),
        "the status line of {http}/TCP's backends lacks one of {backends:?}: {line}"
    );
    let node_ip = F::node_ip().to_string();
    assert!(
        status.contains(&format!("{}/TCP", F::http(empty_ip)))
            && status
                .lines()
                .any(|l| l.starts_with(F::STATUS_NODE_IP) && l.contains(node_ip.as_str())),
        "the status lacks the empty {} frontend or the node's address {node_ip}:\n{status}",
        F::NAME
    );
}

/// (f) Connections that start on the node itself (host-network pods, node agents)
/// never cross tc ingress: the agent's `connect()` hook on the cgroup sends them to a
/// backend. TCP connections to the ClusterIP of family `F` spread over the backends,
/// which see the node's address, and `getpeername()` shows the ClusterIP; the answers
/// to datagrams of unconnected sockets, balanced anew each, show the ClusterIP as
/// their source, and a connected socket shows it as its peer; a Service without
/// endpoints refuses at once; the hooks count each, and tc translates none; with
/// ClientIP affinity every connection of the node reaches one backend; `ebpf-proxy
/// status` shows the frontends, their backends and the node's address. Returned for
/// what only one family's test goes on to check.
pub fn the_nodes_own_connections_reach_backends<F: Family>() -> (Sandbox, TestCgroup) {
    let sticky_ip = F::vip(20);
    let empty_ip = F::vip(30);
    let (sb, cgroup) = hooked_sandbox::<F>(&[
        web::<F>(&F::backend_ips()),
        sticky::<F>(sticky_ip),
        (
            "empty.yaml",
            F::yaml(
                &F::service("test", "empty", empty_ip).port(
                    "http",
                    TCP_SERVICE_PORT,
                    Protocol::Tcp,
                    TCP_PORT,
                ),
                &[],
            ),
        ),
    ]);
    let node = F::node_prefix();
    let http: SocketAddr = F::http(F::cluster_ip()).into();
    let tc_new_before = sb.counter("dnat_new");
    let reached: BTreeSet<String> = (0..30)
        .map(|i| tcp_from_the_node(&sb, &cgroup, http, &node, i))
        .collect();
    assert!(
        reached.len() >= 2,
        "30 connections from the node's {} sockets to {http} all reached {reached:?}",
        F::NAME
    );
    udp_from_the_node(&sb, &cgroup, F::dns(F::cluster_ip()).into(), &node, 12);
    refused(&sb, &cgroup, F::http(empty_ip).into());
    for (name, want, what) in [
        (
            "sock_connect_translated",
            31,
            "30 TCP connections and a UDP socket from the node",
        ),
        (
            "sock_connect_refused",
            1,
            "one connection to a Service without endpoints",
        ),
        (
            "sock_sendmsg_translated",
            12,
            "12 datagrams from unconnected sockets",
        ),
        (
            "dnat_new",
            tc_new_before,
            "none: the node's connections must not go through tc's translation",
        ),
    ] {
        assert_eq!(
            sb.counter(name),
            want,
            "{}: counter {name}: {what}",
            F::NAME
        );
    }

    let sticky: SocketAddr = F::http(sticky_ip).into();
    let stuck: BTreeSet<String> = (0..8)
        .map(|i| tcp_from_the_node(&sb, &cgroup, sticky, &node, i))
        .collect();
    assert_eq!(
        stuck.len(),
        1,
        "ClientIP affinity: the node's connections to {sticky} reached {stuck:?}"
    );

    status_shows_the_frontends::<F>(&sb, empty_ip);
    (sb, cgroup)
}

/// (p) With `--socket-lb-pods`, a pod's TCP connections to a ClusterIP go to a
/// backend at `connect()`: `getpeername()` shows the ClusterIP, the backend sees the
/// pod's own address, they spread over the backends, the hook counts each and tc
/// translates none. What stays tc's: the pod's datagrams, connected or not, answered
/// from the ClusterIP by tc's reverse translation, and its connections to a ClusterIP
/// with ClientIP affinity, all to one backend.
pub fn pods_tcp_connections_go_at_connect<F: Family>() {
    let sticky_ip = F::vip(20);
    let (sb, cgroup) = hooked_sandbox_with::<F>(
        &[web::<F>(&F::backend_ips()), sticky::<F>(sticky_ip)],
        &["--socket-lb-pods"],
    );
    let pod = &sb.client().ns;
    let me = &F::prefix(F::pod(CLIENT.1));
    let http: SocketAddr = F::http(F::cluster_ip()).into();
    let counters = |sb: &Sandbox| {
        [
            "sock_connect_translated",
            "sock_sendmsg_translated",
            "dnat_new",
        ]
        .map(|name| sb.counter(name))
    };
    let before = counters(&sb);
    let reached: BTreeSet<String> = (0..20)
        .map(|i| tcp_from(&sb, pod, &cgroup, http, me, i))
        .collect();
    assert!(
        reached.len() >= 2,
        "20 connections from the pod's {} sockets to {http} all reached {reached:?}",
        F::NAME
    );
    assert_eq!(
        counters(&sb),
        [before[0] + 20, before[1], before[2]],
        "{}: [connect hook, sendmsg hook, tc's new flows] after 20 TCP connections of \
         the pod: the hook must send each, tc none",
        F::NAME
    );

    let dns: SocketAddr = F::dns(F::cluster_ip()).into();
    let words = run_in(
        &sb,
        pod,
        &cgroup,
        env!("CARGO_BIN_EXE_udp-sendto"),
        dns,
        &[],
    );
    assert!(
        words.len() == 4 && words[1].starts_with(me) && words[3] == dns.to_string(),
        "{}: a datagram of the pod's unconnected socket to {dns}: answered {words:?}",
        F::NAME
    );
    let mut udp = ConnectedUdp::start(pod, &cgroup, dns);
    assert!(
        udp.backend().is_some(),
        "{}: the pod's connected UDP socket to {dns} got no answer",
        F::NAME
    );
    assert_eq!(udp.peer(), dns.to_string(), "getpeername() of that socket");
    let sticky: SocketAddr = F::http(sticky_ip).into();
    let stuck: BTreeSet<String> = (0..6)
        .map(|i| tcp_from(&sb, pod, &cgroup, sticky, me, i))
        .collect();
    assert_eq!(
        stuck.len(),
        1,
        "{}: ClientIP affinity: the pod's connections to {sticky} reached {stuck:?}",
        F::NAME
    );
    assert_eq!(
        counters(&sb),
        [before[0] + 20, before[1], before[2] + 8],
        "{}: [connect hook, sendmsg hook, tc's new flows] after the pod's two UDP \
         sockets and 6 connections to a Service with affinity: all tc's",
        F::NAME
    );
    let status = sb.agent().status().expect("status");
    assert!(
        status.contains("pods' TCP connections to ClusterIPs: at connect() (--socket-lb-pods)"),
        "status does not say where pods' connections go:\n{status}"
    );
}

/// (i) A socket of the node that the hook connected to a backend shows the frontend
/// as its peer (`getpeername()`), as a connection DNATed by kube-proxy does, while the
/// backend sees the node's address; a socket connected straight to a pod shows the
/// pod; a connected UDP socket to the ClusterIP shows the ClusterIP.
pub fn the_nodes_sockets_show_the_frontend_as_their_peer<F: Family>() {
    let (sb, cgroup) = hooked_sandbox::<F>(&[web::<F>(&F::backend_ips())]);
    let node = F::node_prefix();
    let http: SocketAddr = F::http(F::cluster_ip()).into();
    for i in 0..6 {
        tcp_from_the_node(&sb, &cgroup, http, &node, i);
    }
    let pod: SocketAddr = F::addr(F::pod(BACKENDS[0].1), TCP_PORT).into();
    let words = run_in(
        &sb,
        &sb.topology().node,
        &cgroup,
        env!("CARGO_BIN_EXE_tcp-peer"),
        pod,
        &[],
    );
    assert_eq!(
        (
            words.first().map(String::as_str),
            words.get(1).map(String::as_str)
        ),
        (Some(pod.to_string().as_str()), Some(BACKENDS[0].0)),
        "a connection straight to a pod"
    );
    let dns: SocketAddr = F::dns(F::cluster_ip()).into();
    let mut udp = ConnectedUdp::start(&sb.topology().node, &cgroup, dns);
    assert!(
        udp.backend().is_some(),
        "connected UDP to the ClusterIP got no answer"
    );
    assert_eq!(
        udp.peer(),
        dns.to_string(),
        "getpeername() of a connected UDP socket to the ClusterIP"
    );
}

/// `n` connected UDP sockets of the node to `target`, each with the backend that
/// answered its first datagram.
pub fn connected_udp_clients(
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
/// backend pod by name (as the node's sockets connect to it), and the manifest
/// without the named backend.
pub struct Departing {
    pub frontend: SocketAddr,
    pub pod: fn(&str) -> SocketAddr,
    pub without: fn(&str) -> (&'static str, String),
}

impl Departing {
    /// [`web`] of family `F`, at its `dns` port.
    pub fn web<F: Family>() -> Departing {
        Departing {
            frontend: F::dns(F::cluster_ip()).into(),
            pod: |name| F::addr(F::pod(backend_ip(name)), UDP_PORT).into(),
            without: |name| {
                let remaining: Vec<F> = BACKENDS
                    .iter()
                    .filter(|b| b.0 != name)
                    .map(|b| F::pod(b.1))
                    .collect();
                web::<F>(&remaining)
            },
        }
    }
}

/// The IPv4 address of backend pod `name` (one of [`BACKENDS`]).
pub fn backend_ip(name: &str) -> std::net::Ipv4Addr {
    BACKENDS
        .iter()
        .find(|b| b.0 == name)
        .unwrap_or_else(|| panic!("answer from {name}, no backend of the test"))
        .1
}

/// Takes the backend of `clients[0]`, the node's UDP sockets connected to
/// `service`'s frontend, out of the Service and checks that the agent closes exactly
/// the clients' sockets connected to it, within the sync deadline, and says so in its
/// log, while the others, and a socket connected straight to the departing pod, keep
/// theirs; new sockets then reach the remaining backends. `what` says when.
pub fn departed_backends_sockets_are_closed(
    sb: &Sandbox,
    cgroup: &TestCgroup,
    service: &Departing,
    clients: &mut [(ConnectedUdp, String)],
    what: &str,
) {
    let node = &sb.topology().node;
    let what = format!("{} ({what})", service.frontend);
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
    let deadline = SYNC_DEADLINE + Duration::from_secs(1);
    // Until the first client's socket is closed; the checks below say what
    // every client sees then.
    let _ = wait_until(deadline, POLL, || match clients[0].0.backend() {
        Some(backend) => Err(format!("client 0 still reaches {backend}")),
        None => Ok(()),
    });
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

/// (h) A UDP socket of the node that the hook connected to a backend of family `F`
/// stays connected to it (no conntrack entry stands between), so when the backend
/// leaves the Service the agent closes the socket, as kube-proxy's conntrack cleanup
/// moves such a flow and Cilium closes such sockets: its owner reads an error and
/// reconnects to a live backend. The node's sockets the hook sent elsewhere, and one
/// connected straight to the departed pod's address, are left alone.
pub fn the_nodes_udp_sockets_connected_to_a_departed_backend_are_closed<F: Family>() {
    let (sb, cgroup) = hooked_sandbox::<F>(&[web::<F>(&F::backend_ips())]);
    let service = Departing::web::<F>();
    let mut clients = connected_udp_clients(&sb, &cgroup, service.frontend, 12);
    departed_backends_sockets_are_closed(
        &sb,
        &cgroup,
        &service,
        &mut clients,
        "the backend leaving",
    );
}

/// `udp-sendto --hold` in `cgroup` in `ns`: an unconnected UDP socket that has sent
/// one datagram to `target` and reads the answer only when told. Killed on drop.
pub struct HeldDatagram {
    child: Option<std::process::Child>,
}

impl HeldDatagram {
    pub fn send(ns: &NetNs, cgroup: &TestCgroup, target: SocketAddr) -> HeldDatagram {
        use std::io::BufRead;
        let mut child = cgroup
            .command_in(ns, env!("CARGO_BIN_EXE_udp-sendto"))
            .args([&target.to_string(), "--hold"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("starting udp-sendto --hold");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.as_mut().expect("piped stdout"))
            .read_line(&mut line)
            .expect("reading from udp-sendto");
        assert_eq!(line.trim(), "sent", "udp-sendto {target} --hold");
        HeldDatagram { child: Some(child) }
    }

    /// Reads the answer: `(<answer's first word>, <source>)`.
    pub fn receive(mut self) -> (String, String) {
        use std::io::Write;
        let mut child = self.child.take().expect("a held datagram is received once");
        let mut stdin = child.stdin.take().expect("piped stdin");
        writeln!(stdin).expect("writing to udp-sendto");
        drop(stdin);
        let out = child.wait_with_output().expect("waiting for udp-sendto");
        let text = String::from_utf8_lossy(&out.stdout);
        match text.trim().split_once(" from ") {
            Some((answer, from)) if out.status.success() => (
                answer
                    .split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_owned(),
                from.to_owned(),
            ),
            _ => panic!(
                "udp-sendto --hold: {} {text:?} {:?}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    }
}

impl Drop for HeldDatagram {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One note of the socket hooks, of either family's backends: the backend a socket
/// was sent to in the frontend's place, and how (`sock_note` bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Noted {
    pub backend: SocketAddr,
    pub frontend: SocketAddr,
    pub how: u32,
    /// Whether the note sits in its backend's slot, where the hooks look it up.
    pub in_its_slot: bool,
}

/// Where the socket hooks keep their notes about a family's backends, and the
/// node's UDP sockets of that family, as the agent reads them: `SOCK_NOTES` and
/// IPv4 sockets, `SOCK_NOTES6` and IPv6 sockets.
pub trait Noting: Family {
    /// The notes of every socket holding some.
    type Notes: std::fmt::Debug + Send;
    /// The map the family's notes live in, as messages name it.
    const NOTES_MAP: &'static str;

    /// The notes, read by the agent's iterator pinned under `pins`.
    fn read_notes(pins: &PinLayout) -> Result<Self::Notes, SockNotesError>;

    /// The family's UDP sockets of the calling thread's namespace.
    fn udp_sockets(diag: &mut SockDiag) -> Result<Vec<UdpSocket>, SockDiagError>;

    /// How many sockets hold notes.
    fn holding(notes: &Self::Notes) -> usize;

    /// Whether the socket with `cookie` holds notes, empty ones included.
    fn holds_notes(notes: &Self::Notes, cookie: u64) -> bool;

    /// The notes of the socket with `cookie` that are not empty.
    fn noted(notes: &Self::Notes, cookie: u64) -> Vec<Noted>;

    /// Whether the `connect()` hook connected `socket` to its peer, a backend.
    fn hook_connected(notes: &Self::Notes, socket: &UdpSocket) -> bool;
}

/// A port as a note keeps it (network order).
fn port(port_be: u16) -> u16 {
    u16::from_be(port_be)
}

impl Noting for std::net::Ipv4Addr {
    type Notes = Notes;
    const NOTES_MAP: &'static str = "SOCK_NOTES";

    fn read_notes(pins: &PinLayout) -> Result<Notes, SockNotesError> {
        sock_notes::read(&pins.sock_notes())
    }

    fn udp_sockets(diag: &mut SockDiag) -> Result<Vec<UdpSocket>, SockDiagError> {
        diag.udp()
    }

    fn holding(notes: &Notes) -> usize {
        notes.len()
    }

    fn holds_notes(notes: &Notes, cookie: u64) -> bool {
        notes.of(cookie).is_some()
    }

    fn noted(notes: &Notes, cookie: u64) -> Vec<Noted> {
        let ip = |addr_be: u32| std::net::Ipv4Addr::from(addr_be.to_ne_bytes());
        let Some(held) = notes.of(cookie) else {
            return Vec::new();
        };
        held.notes
            .iter()
            .filter(|n| n.backend_be != 0)
            .map(|n| Noted {
                backend: (ip(n.backend_be), port(n.backend_port_be)).into(),
                frontend: (ip(n.frontend_be), port(n.frontend_port_be)).into(),
                how: n.how,
                in_its_slot: held.find(&n.backend_be, n.backend_port_be) == Some(n),
            })
            .collect()
    }

    fn hook_connected(notes: &Notes, socket: &UdpSocket) -> bool {
        socket.hook_connected(notes, &Notes6::default())
    }
}

impl Noting for Ipv6Addr {
    type Notes = Notes6;
    const NOTES_MAP: &'static str = "SOCK_NOTES6";

    fn read_notes(pins: &PinLayout) -> Result<Notes6, SockNotesError> {
        sock_notes::read6(&pins.sock_notes6())
    }

    fn udp_sockets(diag: &mut SockDiag) -> Result<Vec<UdpSocket>, SockDiagError> {
        diag.udp6()
    }

    fn holding(notes: &Notes6) -> usize {
        notes.len()
    }

    fn holds_notes(notes: &Notes6, cookie: u64) -> bool {
        notes.of(cookie).is_some()
    }

    fn noted(notes: &Notes6, cookie: u64) -> Vec<Noted> {
        // The words in network order, as they lie in memory.
        let ip = |addr_be: [u32; 4]| {
            let mut bytes = [0u8; 16];
            for (chunk, word) in bytes.chunks_exact_mut(4).zip(addr_be) {
                chunk.copy_from_slice(&word.to_ne_bytes());
            }
            Ipv6Addr::from(bytes)
        };
        let Some(held) = notes.of(cookie) else {
            return Vec::new();
        };
        held.notes
            .iter()
            .filter(|n| n.backend_be != [0; 4])
            .map(|n| Noted {
                backend: (ip(n.backend_be), port(n.backend_port_be)).into(),
                frontend: (ip(n.frontend_be), port(n.frontend_port_be)).into(),
                how: n.how,
                in_its_slot: held.find(&n.backend_be, n.backend_port_be) == Some(n),
            })
            .collect()
    }

    fn hook_connected(notes: &Notes6, socket: &UdpSocket) -> bool {
        socket.hook_connected(&Notes::default(), notes)
    }
}

/// The node's UDP sockets of family `F`, as the kernel's socket dump lists them.
pub fn node_udp_sockets<F: Noting>(sb: &Sandbox) -> Vec<UdpSocket> {
    sb.topology()
        .node
        .run(|| SockDiag::open().and_then(|mut diag| F::udp_sockets(&mut diag)))
        .expect("entering the node's namespace")
        .unwrap_or_else(|e| panic!("listing the node's {} UDP sockets: {e}", F::NAME))
}

/// What the socket hooks have noted about `F`'s backends in every UDP socket of the
/// node that holds such notes, read out of `F::NOTES_MAP` by the agent's pinned
/// iterator, run in the node's namespace (it lists the UDP sockets of its reader's).
pub fn hooks_notes<F: Noting>(sb: &Sandbox) -> F::Notes {
    let pins = PinLayout::new(sb.agent().bpf_root());
    sb.topology()
        .node
        .run(|| F::read_notes(&pins))
        .expect("entering the node's namespace")
        .unwrap_or_else(|e| panic!("reading the socket hooks' notes of {}: {e}", F::NOTES_MAP))
}

/// The hooks' notes of `F` once at most `most` sockets hold some, or a panic after
/// 5 s: the kernel frees a closed socket's storage after an RCU grace period.
pub fn notes_down_to<F: Noting>(sb: &Sandbox, most: usize, what: &str) -> F::Notes {
    eventually_value(
        &format!(
            "{what}: at most {most} sockets holding notes in {}",
            F::NOTES_MAP
        ),
        Duration::from_secs(5),
        || {
            let notes = hooks_notes::<F>(sb);
            match F::holding(&notes) {
                holding if holding <= most => Ok(notes),
                holding => Err(format!("{holding} sockets hold notes")),
            }
        },
    )
    .0
}

/// Connections `tcp-churn` opens: more than the 65,536 entries of the table the socket
/// hooks once kept their notes in, so that no table of theirs could have held them all.
pub const CHURN: u64 = 100_000;

/// (j) What the socket hooks remember about a socket of family `F` lives with the
/// socket: after 100,000 TCP connections of the node through the hook, each of which
/// the hook counts, an unconnected UDP socket's answer to a datagram it sent to the
/// ClusterIP before them still shows the ClusterIP as its source, UDP sockets
/// connected through the hook before them are still closed when their backend leaves,
/// and of the node's UDP sockets only those still open hold notes in
/// `F::NOTES_MAP`.
pub fn the_nodes_socket_notes_outlive_tcp_churn<F: Noting>() {
    let (sb, cgroup) = hooked_sandbox::<F>(&[web::<F>(&F::backend_ips())]);
    let node = &sb.topology().node;
    let service = Departing::web::<F>();
    let mut clients = connected_udp_clients(&sb, &cgroup, service.frontend, 12);
    let dns: SocketAddr = F::dns(F::cluster_ip()).into();
    let held = HeldDatagram::send(node, &cgroup, dns);
    let before = sb.counter("sock_connect_translated");

    let http = F::http(F::cluster_ip()).to_string();
    let out = cgroup
        .command_in(node, env!("CARGO_BIN_EXE_tcp-churn"))
        .args([http.clone(), CHURN.to_string()])
        .output()
        .expect("running tcp-churn");
    assert!(
        out.status.success(),
        "tcp-churn {http}: {} {:?} {:?}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let translated = sb.counter("sock_connect_translated") - before;
    assert_eq!(
        translated,
        CHURN,
        "{}: connect() calls of tcp-churn to {http} the hook sent to a backend",
        F::NAME
    );

    let (backend, from) = held.receive();
    assert_eq!(
        from,
        dns.to_string(),
        "after {CHURN} TCP connections, the answer (from {backend}) to a datagram sent to \
         the ClusterIP before them shows another source"
    );
    let what = format!("after {CHURN} {} TCP connections", F::NAME);
    departed_backends_sockets_are_closed(&sb, &cgroup, &service, &mut clients, &what);
    // Of the node's UDP sockets, only the 12 still open hold notes (the iterator
    // lists UDP sockets only: the 100,000 TCP ones' notes are not read back).
    notes_down_to::<F>(&sb, clients.len(), &what);
}

/// (k) What the socket hooks remember about a socket of family `F` is kept in the
/// socket itself (socket-local storage, `F::NOTES_MAP`), as the agent's pinned
/// iterator over the node's UDP sockets lists it: each unconnected socket that sent a
/// datagram to the ClusterIP holds one note (the backend it went to, in the slot of
/// that backend, the ClusterIP, sent), each socket the hook connected holds one for
/// its peer (connected), a socket connected straight to a pod holds none, the map
/// holds nothing else, and `ebpf-proxy status` counts the sockets holding notes. Once
/// sockets close, the map's entries for them are gone, and the others' stay. Returned
/// for what only one family's test goes on to check.
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom; its steps share the namespaces and agent it sets up"
)]
pub fn the_hooks_notes_live_in_their_sockets<F: Noting>() -> (Sandbox, TestCgroup) {
    let (sb, cgroup) = hooked_sandbox::<F>(&[web::<F>(&F::backend_ips())]);
    let node = &sb.topology().node;
    let frontend: SocketAddr = F::dns(F::cluster_ip()).into();
    let held: Vec<HeldDatagram> = (0..8)
        .map(|_| HeldDatagram::send(node, &cgroup, frontend))
        .collect();
    let mut clients = connected_udp_clients(&sb, &cgroup, frontend, 4);
    let pod: SocketAddr = F::addr(F::pod(BACKENDS[0].1), UDP_PORT).into();
    let mut direct = ConnectedUdp::start(node, &cgroup, pod);
    assert_eq!(
        direct.backend().as_deref(),
        Some(BACKENDS[0].0),
        "a socket connected straight to {pod}"
    );

    let backends: BTreeSet<SocketAddr> = F::backend_ips()
        .into_iter()
        .map(|ip| F::addr(ip, UDP_PORT).into())
        .collect();
    let notes = hooks_notes::<F>(&sb);
    let sockets = node_udp_sockets::<F>(&sb);
    let (mut sent, mut connected) = (0, 0);
    for socket in &sockets {
        let kept = F::noted(&notes, socket.cookie());
        if kept.is_empty() {
            continue;
        }
        assert_eq!(
            kept.len(),
            1,
            "{socket:?}: one socket, one backend: {kept:?}"
        );
        let note = kept[0];
        assert!(
            backends.contains(&note.backend),
            "{socket:?}: {} is no backend of {backends:?}",
            note.backend
        );
        assert_eq!(note.frontend, frontend, "{socket:?}: the frontend noted");
        assert!(
            note.in_its_slot,
            "{socket:?}: the note is not in its backend's slot: {note:?}"
        );
        if socket.connected() {
            assert_eq!(
                socket.peer(),
                note.backend,
                "{socket:?}: noted another backend"
            );
            assert_eq!(
                note.how,
                sock_note::CONNECTED,
                "{socket:?}: how it was sent"
            );
            assert!(F::hook_connected(&notes, socket), "{socket:?}");
            connected += 1;
        } else {
            assert_eq!(note.how, sock_note::SENT, "{socket:?}: how it was sent");
            sent += 1;
        }
    }
    assert_eq!(
        (sent, connected),
        (8, 4),
        "sockets with notes in {} (unconnected, connected) among the node's {} {} UDP sockets: {sockets:#?}",
        F::NOTES_MAP,
        sockets.len(),
        F::NAME
    );
    assert_eq!(
        F::holding(&notes),
        12,
        "sockets holding notes in {}: {notes:?}",
        F::NOTES_MAP
    );
    let status = sb.agent().status().expect("status");
    assert!(
        status.contains("sockets with socket hook notes: 12 "),
        "status does not count the 12 sockets with notes in {}:\n{status}",
        F::NOTES_MAP
    );
    let straight: Vec<&UdpSocket> = sockets.iter().filter(|s| s.peer() == pod).collect();
    assert!(
        straight
            .iter()
            .filter(|s| !F::holds_notes(&notes, s.cookie()))
            .count()
            == 1,
        "the socket connected straight to {pod} holds notes in {}, or is not listed: {straight:#?}",
        F::NOTES_MAP
    );

    // The map's own entries go with their sockets, not just the sockets.
    drop(held);
    clients.truncate(1);
    let notes = notes_down_to::<F>(&sb, 1, "11 of the 12 sockets with notes closed");
    let left = node_udp_sockets::<F>(&sb)
        .into_iter()
        .filter(|s| F::hook_connected(&notes, s))
        .count();
    assert!(
        F::holding(&notes) == 1 && left == 1,
        "after 11 of the 12 sockets with notes closed: {notes:?}, {left} connected by the hook"
    );
    assert!(
        clients[0].0.backend().is_some(),
        "the socket left open lost its backend"
    );
    drop((clients, direct));
    (sb, cgroup)
}
