//! The node's own connections through the agent's socket hooks, on real sockets: a
//! routed node (docs/architecture.md, "Test topologies") with three backend pods and
//! the agent's cgroup hooks on a cgroup of each test's own. Connections from the node
//! never cross tc ingress; the hooks translate them at `connect()` and `sendmsg()`, close
//! the node's UDP sockets whose backend leaves, and keep what they remember about a
//! socket in the socket itself. The scenarios with an IPv6 twin are
//! `socket_hooks_scenarios`'s, shared with `socket_hooks6.rs`.
//!
//! Every test builds its own namespaces, cgroup, bpffs root and manifest directory, so
//! they run in parallel; everything is removed on drop, also when a test fails.

mod socket_hooks_scenarios;

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddrV4},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use ebpf_proxy_tests::{
    cgroup::TestCgroup,
    manifest::ServiceType,
    netns::NetNs,
    sandbox::Sandbox,
    topology::one_node::{
        BACKENDS, CLIENT, CLUSTER_IP, UDP_PORT, backend_ips, backend_names, dns, http, web_service,
    },
};
use proxy_common::{SockNote, sock_note};
use proxy_userspace::{
    datapath::PinLayout,
    housekeeping::{
        sock_diag::{SockDiag, UdpSocket},
        sock_notes::{self, Notes},
    },
};
use socket_hooks_scenarios::{self as scenario, ConnectedUdp, Departing};

/// `script` run by bash (whose `/dev/tcp` and `/dev/udp` open connected sockets) in
/// `ns`, inside `cgroup` when given, for at most 3 s.
fn bash_in(ns: &NetNs, cgroup: Option<&TestCgroup>, script: &str) -> std::process::Output {
    let mut cmd = match cgroup {
        Some(cgroup) => cgroup.command_in(ns, "timeout"),
        None => ns.command("timeout"),
    };
    cmd.args(["3", "bash", "-c", script])
        .output()
        .expect("running bash")
}

/// The `<backend> <peer>` greeting a bash client printed, or a panic that says what
/// went wrong.
fn greeting(sb: &Sandbox, out: &std::process::Output, what: &str) -> (String, String) {
    let text = String::from_utf8_lossy(&out.stdout);
    let mut words = text.split_whitespace();
    match (out.status.success(), words.next(), words.next()) {
        (true, Some(name), Some(peer)) => (name.to_string(), peer.to_string()),
        _ => panic!(
            "{what}: {} stdout {text:?} stderr {:?}; agent log:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            sb.agent().log()
        ),
    }
}
/// address, and they must reach at least two backends in all.
fn spread_from_the_node(
    sb: &Sandbox,
    cgroup: &TestCgroup,
    n: usize,
    client: impl Fn(usize) -> (String, String),
) {
    let mut backends = BTreeSet::new();
    for i in 0..n {
        let (script, what) = client(i);
        let out = bash_in(&sb.topology().node, Some(cgroup), &script);
        let (backend, peer) = greeting(sb, &out, &what);
        assert!(
            peer.starts_with(&format!("{}:", ebpf_proxy_tests::topology::NODE_IP)),
            "{what}: the backend saw {peer}, not the node's address"
        );
        backends.insert(backend);
    }
    assert!(
        backends.len() >= 2,
        "{n} connections from the node all reached {backends:?}"
    );
}

/// (f) The node's own connections reach backends through the `connect()` and
/// `sendmsg()` hooks (the scenario, shared with IPv6); then a pod's socket in the
/// same cgroup is left to tc, a process outside the cgroup is not translated at all,
/// the hook outlives the agent through its pinned link, and `cleanup` takes it away.
/// These steps are IPv4's alone: they are the cgroup link's, not a family's.
#[test]
fn the_nodes_own_connections_reach_backends_through_the_socket_hook() {
    let (mut sb, cgroup) = scenario::the_nodes_own_connections_reach_backends::<Ipv4Addr>();
    let root = cgroup.path().display().to_string();
    let tcp = format!("exec 3<>/dev/tcp/{CLUSTER_IP}/80 && head -n1 <&3");
    let translated = sb.counter("sock_connect_translated");
    let tc_new_before = sb.counter("dnat_new");

    // A pod's socket in the same cgroup: translated by tc, not by the hook.
    let out = bash_in(&sb.client().ns, Some(&cgroup), &tcp);
    let (_, peer) = greeting(&sb, &out, "TCP connection from a pod in the cgroup");
    assert!(
        peer.starts_with(&format!("{}:", CLIENT.1)),
        "the backend saw {peer}, not the pod's address"
    );
    assert_eq!(
        sb.counter("sock_connect_translated"),
        translated,
        "the hook translated a pod's connection, which is tc's to translate"
    );
    assert_eq!(
        sb.counter("dnat_new"),
        tc_new_before + 1,
        "tc did not translate the pod's connection"
    );

    // Outside the cgroup the hook sees nothing: the ClusterIP leads nowhere.
    let out = bash_in(&sb.topology().node, None, &tcp);
    assert!(
        !out.status.success(),
        "a process of the node outside the hook's cgroup reached the ClusterIP: {:?}",
        String::from_utf8_lossy(&out.stdout)
    );

    // The hook outlives the agent through its pinned link, and the next agent
    // swaps its own program into that link.
    let status = sb.agent_mut().terminate().expect("stop the agent");
    assert!(status.success(), "the agent exited with {status}");
    let out = bash_in(&sb.topology().node, Some(&cgroup), &tcp);
    greeting(
        &sb,
        &out,
        "TCP connection from the node after the agent exited",
    );
    let mut again = sb
        .agent_on_the_same_root(&["--cgroup-root", &root])
        .expect("start the agent again");
    assert!(
        again.log().contains("took over pinned cgroup link"),
        "the restarted agent did not take the pinned link over; its log:\n{}",
        again.log()
    );
    let out = bash_in(&sb.topology().node, Some(&cgroup), &tcp);
    greeting(&sb, &out, "TCP connection from the node after the restart");
    assert_eq!(
        sb.counter("sock_connect_translated"),
        translated + 2,
        "the connections before and after the restart"
    );
    let status = again.terminate().expect("stop the restarted agent");
    assert!(status.success(), "the restarted agent exited with {status}");

    sb.agent_mut().cleanup().expect("ebpf-proxy cleanup");
    let out = bash_in(&sb.topology().node, Some(&cgroup), &tcp);
    assert!(
        !out.status.success(),
        "the node still reaches the ClusterIP after `ebpf-proxy cleanup`: {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// (g) The node's own connections to 127.0.0.0/8 reach NodePorts, as with kube-proxy's
/// `--iptables-localhost-nodeports` (its default): TCP and connected UDP, from the
/// node's address, spread over the backends. `--localhost-nodeports=false`, or
/// `--nodeport-addresses` without 127.0.0.1, turns them off. IPv4 only, as
/// kube-proxy's: `route_localnet` has no IPv6 twin.
#[test]
fn the_nodes_connections_to_localhost_node_ports_reach_backends() {
    let (mut sb, cgroup) = scenario::hooked_sandbox::<Ipv4Addr>(&[(
        "web.yaml",
        web_service(CLUSTER_IP)
            .type_(ServiceType::NodePort)
            .node_port("http", 30080)
            .node_port("dns", 30053)
            .yaml(Some(&backend_ips())),
    )]);
    let root = cgroup.path().display().to_string();
    let node = &sb.topology().node;
    let tcp = |ip: &str| format!("exec 3<>/dev/tcp/{ip}/30080 && head -n1 <&3");

    spread_from_the_node(&sb, &cgroup, 20, |i| {
        let ip = if i % 2 == 0 { "127.0.0.1" } else { "127.1.2.3" };
        (tcp(ip), format!("TCP connection {i} to {ip}:30080"))
    });
    let out = bash_in(
        node,
        Some(&cgroup),
        "exec 3<>/dev/udp/127.0.0.1/30053 && echo hi >&3 && head -n1 <&3",
    );
    let (backend, _) = greeting(&sb, &out, "UDP request to 127.0.0.1:30053");
    assert!(backend_names().contains(&backend.as_str()), "{backend}");
    assert_eq!(
        sb.counter("sock_connect_translated"),
        21,
        "20 TCP connections and a UDP socket to localhost NodePorts"
    );
    let status = sb.agent().status().expect("status");
    assert!(
        status.contains("localhost NodePorts: on"),
        "status does not show localhost NodePorts on:\n{status}"
    );
    let status = sb.agent_mut().terminate().expect("stop the agent");
    assert!(status.success(), "the agent exited with {status}");

    for args in [
        &["--localhost-nodeports=false"][..],
        &["--nodeport-addresses", "10.0.0.0/8"][..],
    ] {
        let node = &sb.topology().node;
        let mut agent = sb
            .agent_on_the_same_root(&[&["--cgroup-root", &root][..], args].concat())
            .expect("start the agent again");
        let status = agent.status().expect("status");
        assert!(
            status.contains("localhost NodePorts: off"),
            "with {args:?}, status does not show localhost NodePorts off:\n{status}"
        );
        let before = sb.counter("sock_connect_translated");
        let out = bash_in(node, Some(&cgroup), &tcp("127.0.0.1"));
        assert!(
            !out.status.success(),
            "with {args:?}, 127.0.0.1:30080 still reached {:?}",
            String::from_utf8_lossy(&out.stdout)
        );
        // The node's own address still serves the NodePort.
        let out = bash_in(
            node,
            Some(&cgroup),
            &tcp(&ebpf_proxy_tests::topology::NODE_IP.to_string()),
        );
        greeting(
            &sb,
            &out,
            &format!("TCP connection to the node's NodePort with {args:?}"),
        );
        assert_eq!(
            sb.counter("sock_connect_translated"),
            before + 1,
            "with {args:?}: only the connection to the node's address is translated; \
             status:\n{}\nagent log:\n{}",
            agent.status().unwrap_or_default(),
            agent.log()
        );
        let status = agent.terminate().expect("stop the agent");
        assert!(status.success(), "the agent exited with {status}");
    }
}

#[test]
fn the_nodes_sockets_show_the_frontend_as_their_peer() {
    scenario::the_nodes_sockets_show_the_frontend_as_their_peer::<Ipv4Addr>();
}

#[test]
fn the_nodes_udp_sockets_connected_to_a_departed_backend_are_closed() {
    scenario::the_nodes_udp_sockets_connected_to_a_departed_backend_are_closed::<Ipv4Addr>();
}

/// `udp-sendto --hold` in `cgroup` in `ns`: an unconnected UDP socket that has sent
/// one datagram to `target` and reads the answer only when told. Killed on drop.
struct HeldDatagram {
    child: Option<std::process::Child>,
}

impl HeldDatagram {
    fn send(ns: &NetNs, cgroup: &TestCgroup, target: SocketAddrV4) -> HeldDatagram {
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
    fn receive(mut self) -> (String, String) {
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

/// Connections `tcp-churn` opens: more than the 65,536 entries of the table the socket
/// hooks once kept their notes in, so that no table of theirs could have held them all.
const CHURN: u64 = 100_000;

/// (j) What the socket hooks remember about a socket lives with the socket: after
/// 100,000 TCP connections of the node through the hook, an unconnected UDP socket's
/// answer to a datagram it sent to the ClusterIP before them still shows the
/// ClusterIP as its source, and UDP sockets connected through the hook before them are
/// still closed when their backend leaves. No IPv6 twin yet (docs/testing.md).
#[test]
fn the_nodes_socket_notes_outlive_tcp_churn() {
    let (sb, cgroup) = scenario::hooked_sandbox::<Ipv4Addr>(&[scenario::web(&backend_ips())]);
    let node = &sb.topology().node;
    let service = Departing::web::<Ipv4Addr>();
    let mut clients = scenario::connected_udp_clients(&sb, &cgroup, service.frontend, 12);
    let held = HeldDatagram::send(node, &cgroup, dns(CLUSTER_IP));
    let before = sb.counter("sock_connect_translated");

    let out = cgroup
        .command_in(node, env!("CARGO_BIN_EXE_tcp-churn"))
        .args([http(CLUSTER_IP).to_string(), CHURN.to_string()])
        .output()
        .expect("running tcp-churn");
    assert!(
        out.status.success(),
        "tcp-churn: {} {:?} {:?}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let translated = sb.counter("sock_connect_translated") - before;
    assert_eq!(
        translated, CHURN,
        "connect() calls of tcp-churn the hook sent to a backend"
    );

    let (backend, from) = held.receive();
    assert_eq!(
        from,
        dns(CLUSTER_IP).to_string(),
        "after {CHURN} TCP connections, the answer (from {backend}) to a datagram sent to \
         the ClusterIP before them shows another source"
    );
    scenario::departed_backends_sockets_are_closed(
        &sb,
        &cgroup,
        &service,
        &mut clients,
        &format!("after {CHURN} TCP connections"),
    );
    // Of the node's UDP sockets, only the 12 still open hold notes (the iterator
    // lists UDP sockets only: the 100,000 TCP ones' notes are not read back).
    notes_down_to(
        &sb,
        clients.len(),
        &format!("after {CHURN} TCP connections"),
    );
}

/// The node's IPv4 UDP sockets, as the kernel's socket dump lists them.
fn node_udp_sockets(sb: &Sandbox) -> Vec<UdpSocket> {
    sb.topology()
        .node
        .run(|| SockDiag::open().and_then(|mut diag| diag.udp()))
        .expect("entering the node's namespace")
        .expect("listing the node's UDP sockets")
}

/// What the socket hooks have noted in every UDP socket of the node that holds
/// notes, read out of `SOCK_NOTES` by the agent's pinned iterator, run in the
/// node's namespace (it lists the UDP sockets of its reader's).
fn hooks_notes(sb: &Sandbox) -> Notes {
    let pins = PinLayout::new(sb.agent().bpf_root());
    sb.topology()
        .node
        .run(|| sock_notes::read(&pins.sock_notes()))
        .expect("entering the node's namespace")
        .expect("reading the socket hooks' notes")
}

/// The hooks' notes once at most `most` sockets hold some, or a panic after 5 s: the
/// kernel frees a closed socket's storage after an RCU grace period.
fn notes_down_to(sb: &Sandbox, most: usize, what: &str) -> Notes {
    let start = Instant::now();
    loop {
        let notes = hooks_notes(sb);
        if notes.len() <= most {
            return notes;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{what}: {} sockets still hold notes, {most} expected",
            notes.len()
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// The notes of `socket` that are not empty.
fn notes_of(notes: &Notes, socket: &UdpSocket) -> Vec<SockNote> {
    notes
        .of(socket.cookie())
        .map(|n| {
            n.notes
                .iter()
                .copied()
                .filter(|n| n.backend_be != 0)
                .collect()
        })
        .unwrap_or_default()
}

/// (k) What the socket hooks remember about a socket is kept in the socket itself
/// (socket-local storage), as the agent's pinned iterator over the node's UDP sockets lists it: each
/// unconnected socket that sent a datagram to the ClusterIP holds one note (the
/// backend it went to, in the slot of that backend, the ClusterIP, sent), each socket
/// the hook connected holds one for its peer (connected), a socket connected straight
/// to a pod holds none, and the map holds nothing else. Once sockets close, the map's
/// entries for them are gone, and the others' stay. The `SOCK_REVNAT` table an earlier
/// agent kept its notes in is unpinned by the next agent. No IPv6 twin yet: its notes
/// are `SOCK_NOTES6`'s, which this reads none of (docs/testing.md).
#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, read top to bottom; its steps share the namespaces and agent it sets up"
)]
fn the_hooks_notes_live_in_their_sockets() {
    let (mut sb, cgroup) = scenario::hooked_sandbox::<Ipv4Addr>(&[scenario::web(&backend_ips())]);
    let node = &sb.topology().node;
    let held: Vec<HeldDatagram> = (0..8)
        .map(|_| HeldDatagram::send(node, &cgroup, dns(CLUSTER_IP)))
        .collect();
    let mut clients = scenario::connected_udp_clients(&sb, &cgroup, dns(CLUSTER_IP).into(), 4);
    let pod = SocketAddrV4::new(BACKENDS[0].1, UDP_PORT);
    let mut direct = ConnectedUdp::start(node, &cgroup, pod.into());
    assert_eq!(direct.backend().as_deref(), Some(BACKENDS[0].0));

    let frontend = dns(CLUSTER_IP);
    let backends: BTreeSet<SocketAddrV4> = backend_ips()
        .into_iter()
        .map(|ip| SocketAddrV4::new(ip, UDP_PORT))
        .collect();
    let addr = |addr_be: u32, port_be: u16| {
        SocketAddrV4::new(Ipv4Addr::from(u32::from_be(addr_be)), u16::from_be(port_be))
    };
    let notes = hooks_notes(&sb);
    let sockets = node_udp_sockets(&sb);
    let (mut sent, mut connected) = (0, 0);
    for socket in &sockets {
        let kept = notes_of(&notes, socket);
        if kept.is_empty() {
            continue;
        }
        assert_eq!(
            kept.len(),
            1,
            "{socket:?}: one socket, one backend: {kept:?}"
        );
        let note = kept[0];
        let backend = addr(note.backend_be, note.backend_port_be);
        assert!(
            backends.contains(&backend),
            "{socket:?}: {backend} is no backend"
        );
        assert_eq!(
            addr(note.frontend_be, note.frontend_port_be),
            frontend,
            "{socket:?}: the frontend noted"
        );
        assert_eq!(
            notes
                .of(socket.cookie())
                .and_then(|n| n.find(note.backend_be, note.backend_port_be)),
            Some(&note),
            "{socket:?}: the note is not in its backend's slot"
        );
        if socket.connected() {
            assert_eq!(
                socket.peer(),
                backend.into(),
                "{socket:?}: noted another backend"
            );
            assert_eq!(
                note.how,
                sock_note::CONNECTED,
                "{socket:?}: how it was sent"
            );
            assert!(notes.hook_connected(socket), "{socket:?}");
            connected += 1;
        } else {
            assert_eq!(note.how, sock_note::SENT, "{socket:?}: how it was sent");
            sent += 1;
        }
    }
    assert_eq!(
        (sent, connected),
        (8, 4),
        "sockets with notes (unconnected, connected) among the node's {} UDP sockets: {sockets:#?}",
        sockets.len()
    );
    assert_eq!(
        notes.len(),
        12,
        "sockets holding notes in SOCK_NOTES: {notes:?}"
    );
    let status = sb.agent().status().expect("status");
    assert!(
        status.contains("sockets with socket hook notes: 12 "),
        "status does not count the 12 sockets with notes:\n{status}"
    );
    let straight: Vec<&UdpSocket> = sockets.iter().filter(|s| s.peer() == pod.into()).collect();
    assert!(
        straight
            .iter()
            .filter(|s| notes.of(s.cookie()).is_none())
            .count()
            == 1,
        "the socket connected straight to {pod} holds notes, or is not listed: {straight:#?}"
    );

    // The map's own entries go with their sockets, not just the sockets.
    drop(held);
    clients.truncate(1);
    let notes = notes_down_to(&sb, 1, "11 of the 12 sockets with notes closed");
    let left = node_udp_sockets(&sb)
        .into_iter()
        .filter(|s| notes.hook_connected(s))
        .count();
    assert!(
        notes.len() == 1 && left == 1,
        "after 11 of the 12 sockets with notes closed: {notes:?}, {left} connected by the hook"
    );
    assert!(
        clients[0].0.backend().is_some(),
        "the socket left open lost its backend"
    );

    // An agent that kept its notes in the SOCK_REVNAT table left it pinned; the next
    // agent unpins it.
    let status = sb.agent_mut().terminate().expect("stop the agent");
    assert!(status.success(), "the agent exited with {status}");
    let revnat = PinLayout::new(sb.agent().bpf_root()).map("SOCK_REVNAT");
    let out = Command::new("bpftool")
        .args(["map", "create"])
        .arg(&revnat)
        .args([
            "type", "lru_hash", "key", "16", "value", "8", "entries", "16",
        ])
        .args(["name", "SOCK_REVNAT"])
        .output()
        .expect("running bpftool");
    assert!(
        out.status.success(),
        "bpftool map create: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let root = cgroup.path().display().to_string();
    let mut again = sb
        .agent_on_the_same_root(&["--cgroup-root", &root])
        .expect("start the agent again");
    assert!(
        !revnat.exists()
            && again
                .log()
                .contains("unpinned a map this release no longer has"),
        "a SOCK_REVNAT pin left by an earlier agent stays; log:\n{}",
        again.log()
    );
    let status = again.terminate().expect("stop the restarted agent");
    assert!(status.success(), "the restarted agent exited with {status}");
}
