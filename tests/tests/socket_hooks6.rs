//! The node's own IPv6 sockets through the agent's socket hooks (`connect6`,
//! `sendmsg6`, `recvmsg6`, `getpeername6`), on real sockets in the routed one-node
//! topology (docs/architecture.md, "Test topologies"), with the agent's cgroup hooks
//! on a cgroup of each test's own: an IPv4 Service reached through an IPv6 socket at
//! its IPv4-mapped address.
//!
//! Every test builds its own namespaces, cgroup, bpffs root and manifest directory, so
//! they run in parallel; everything is removed on drop, also when a test fails.

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddr},
    process::Output,
};

use ebpf_proxy_tests::{
    Protocol,
    cgroup::TestCgroup,
    manifest::Service,
    netns::NetNs,
    require_root,
    sandbox::Sandbox,
    topology::{
        NODE_IP,
        one_node::{
            BACKENDS, CLIENT, CLUSTER_IP, TCP_PORT, TCP_SERVICE_PORT, UDP_PORT, UDP_SERVICE_PORT,
            backend_ips, backend_names, web_service,
        },
    },
};

/// A sandbox with `manifests` written and the agent running with its socket hooks on
/// a cgroup of the test's own, returned with the cgroup.
fn hooked_sandbox(manifests: &[(&str, String)]) -> (Sandbox, TestCgroup) {
    require_root().expect("privileged test");
    let mut sb = Sandbox::new(&[CLIENT], &BACKENDS, TCP_PORT, UDP_PORT).expect("sandbox");
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

/// `addr` as an IPv6 socket names it: IPv4-mapped.
fn mapped(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::new(ip.to_ipv6_mapped().into(), port)
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
    let node = &sb.topology().node;
    let http = mapped(CLUSTER_IP, TCP_SERVICE_PORT);
    let dns = mapped(CLUSTER_IP, UDP_SERVICE_PORT);
    let node_ip = format!("{NODE_IP}:");

    let mut reached = BTreeSet::new();
    for i in 0..8 {
        // `<peer> <backend> <address the backend saw>`
        let words = run_in(
            &sb,
            node,
            &cgroup,
            env!("CARGO_BIN_EXE_tcp-peer"),
            http,
            &[],
        );
        assert_eq!(words.len(), 3, "tcp-peer {http} printed {words:?}");
        assert_eq!(
            words[0],
            http.to_string(),
            "TCP connection {i} from an IPv6 socket to the mapped ClusterIP (reached {}): \
             getpeername() shows another peer",
            words[1]
        );
        assert!(
            backend_names().contains(&words[1].as_str()),
            "connection {i} reached {words:?}, no backend"
        );
        assert!(
            words[2].starts_with(&node_ip),
            "connection {i}: the backend saw {}, not the node's address",
            words[2]
        );
        reached.insert(words[1].clone());
    }
    assert!(
        reached.len() >= 2,
        "8 connections from the node's IPv6 sockets all reached {reached:?}"
    );

    // `<backend> <address the backend saw> from <source>`
    let words = run_in(
        &sb,
        node,
        &cgroup,
        env!("CARGO_BIN_EXE_udp-sendto"),
        dns,
        &[],
    );
    assert_eq!(
        (words.len(), words[2].as_str(), words[3].as_str()),
        (4, "from", dns.to_string().as_str()),
        "the answer to a datagram of an unconnected IPv6 socket to {dns}: {words:?}"
    );
    assert!(
        backend_names().contains(&words[0].as_str()) && words[1].starts_with(&node_ip),
        "the datagram to {dns} reached {words:?}"
    );

    let mut udp = cgroup
        .command_in(node, env!("CARGO_BIN_EXE_udp-connected"))
        .arg(dns.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("starting udp-connected");
    {
        use std::io::{BufRead, Write};
        let mut stdin = udp.stdin.take().expect("piped stdin");
        let mut stdout = std::io::BufReader::new(udp.stdout.take().expect("piped stdout"));
        let mut ask = |line: &str| {
            writeln!(stdin, "{line}").expect("writing to udp-connected");
            let mut answer = String::new();
            stdout
                .read_line(&mut answer)
                .expect("reading from udp-connected");
            answer.trim().to_owned()
        };
        let answer = ask("hi");
        assert!(
            backend_names().contains(&answer.split_whitespace().next().unwrap_or_default()),
            "a connected IPv6 UDP socket to {dns} got {answer:?}"
        );
        assert_eq!(
            ask("peer"),
            dns.to_string(),
            "getpeername() of a connected IPv6 UDP socket to {dns}"
        );
    }
    let _ = udp.kill();
    let _ = udp.wait();

    let empty = mapped(empty_ip, 80);
    let out = cgroup
        .command_in(node, env!("CARGO_BIN_EXE_tcp-peer"))
        .arg(empty.to_string())
        .output()
        .expect("running tcp-peer");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("refused"),
        "an IPv6 socket's connection to {empty}, a Service without endpoints: {} {stderr:?}",
        out.status
    );
}
