//! TCP state per direction through real connections, in the two-node world
//! of docs/architecture.md ("Test topologies") with an agent on each node:
//!
//! - a client that half-closes its connection (`shutdown(SHUT_WR)`, as
//!   HTTP/1.0 clients, rsync and many RPCs do) still gets everything its
//!   server streams for 40 s after the client's FIN, with pauses longer than
//!   a closed flow lives, through a ClusterIP and through a NodePort whose
//!   backend is on the other node (SNAT), both families;
//! - an RST forged by someone who knows a connection's addresses and ports
//!   but not where its sequence numbers are is counted (`ct_out_of_window`)
//!   and the connection goes on.
//!
//! Every test builds its own namespaces, bpffs roots and manifest directory,
//! so they run in parallel; everything is removed on drop, also when a test
//! fails.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd,
    time::{Duration, Instant},
};

use ebpf_proxy_tests::{
    Protocol,
    agent::Agent,
    client::TIMEOUT,
    cluster::{CLIENT1, Cluster},
    eventually,
    family::Family,
    frames::{self, Spec},
    manifest::{ManifestDir, ServiceType},
    netns::{NetNs, NsThread},
    require_root,
};
use nix::libc;

/// The client pod on node a.
const POD: (&str, Ipv4Addr) = ("pod-a", Ipv4Addr::new(10, 1, 1, 20));
/// The backend pod on node b.
const BACKEND: (&str, Ipv4Addr) = ("web-b", Ipv4Addr::new(10, 1, 2, 10));
const PORT: u16 = 8080;
const SERVICE_PORT: u16 = 80;
const NODE_PORT: u16 = 30095;

/// What the streaming server sends after its client's FIN, and when: a
/// burst at once, one after a pause longer than a reset flow lives (10 s)
/// and than a closed flow's SNAT port used to be held (1 s), and so on
/// until 40 s have passed.
const PAUSES: [Duration; 4] = [
    Duration::ZERO,
    Duration::from_secs(15),
    Duration::from_secs(15),
    Duration::from_secs(10),
];
const CHUNK: usize = 64 << 10;

/// The two-node world with `test/stream` (a NodePort Service: ClusterIP
/// [`Family::vip`] 64, NodePort [`NODE_PORT`]) whose one backend, on node b,
/// streams after its client's FIN; an agent on each node.
struct World {
    // Fields drop in declaration order: the agents while their nodes exist,
    // the manifests, then the cluster.
    agents: Vec<Agent>,
    _manifests: ManifestDir,
    cluster: Cluster,
}

impl World {
    fn new<F: Family>() -> World {
        require_root().expect("privileged test");
        let cluster = Cluster::new(&[("a", &[POD]), ("b", &[BACKEND])]).expect("two-node cluster");
        let manifests = ManifestDir::create(cluster.stem()).expect("manifest dir");
        let service = F::service("test", "stream", F::vip(64))
            .type_(ServiceType::NodePort)
            .port("http", SERVICE_PORT, Protocol::Tcp, PORT)
            .node_port("http", NODE_PORT);
        let node_b = cluster.node("b").ns.name().to_owned();
        manifests
            .write(
                "stream.yaml",
                &F::yaml_on_nodes(&service, &[(F::pod(BACKEND.1), &node_b)]),
            )
            .expect("write manifest");
        let agents = ["a", "b"]
            .iter()
            .map(|node| {
                let n = cluster.node(node);
                let node_ip = F::node_ip_arg(n);
                let mut args = vec![];
                if let Some(ip) = &node_ip {
                    args.extend(["--node-ip", ip.as_str()]);
                }
                Agent::start_with(&n.ns, manifests.path(), &args)
                    .unwrap_or_else(|e| panic!("agent on node {node}: {e:#}"))
            })
            .collect();
        World {
            agents,
            _manifests: manifests,
            cluster,
        }
    }

    fn pod(&self) -> &NetNs {
        &self.cluster.pod(POD.0).ns
    }

    fn client(&self) -> &NetNs {
        &self.cluster.client(CLIENT1.0).ns
    }

    fn backend(&self) -> &NetNs {
        &self.cluster.pod(BACKEND.0).ns
    }

    fn cluster_ip<F: Family>() -> SocketAddr {
        F::addr(F::vip(64), SERVICE_PORT).into()
    }

    fn node_port<F: Family>(&self) -> SocketAddr {
        F::addr(F::uplink(self.cluster.node("a").ip), NODE_PORT).into()
    }

    /// Node a's datapath counter `name`.
    fn counter(&self, name: &str) -> u64 {
        self.agents[0]
            .counter(name)
            .unwrap_or_else(|e| panic!("node a's counter {name}: {e:#}"))
    }
}

/// A server in `ns` that reads each connection's request to its end (the
/// client's FIN); answers a probe at once, and otherwise streams [`CHUNK`]s
/// after each of [`PAUSES`] and closes. It returns once `streams` streams
/// are done.
fn streaming_server(ns: &NetNs, any: SocketAddr, streams: usize) -> NsThread<()> {
    let listener_addr = SocketAddr::new(any.ip(), PORT);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread = ns
        .spawn("stream-server", move || {
            let listener = TcpListener::bind(listener_addr).expect("bind the streaming server");
            ready_tx.send(()).expect("tell the test");
            let mut workers = Vec::new();
            while workers.len() < streams {
                let (mut conn, peer) = listener.accept().expect("accept");
                let mut request = Vec::new();
                conn.read_to_end(&mut request)
                    .unwrap_or_else(|e| panic!("reading {peer}'s request: {e}"));
                if request == b"probe" {
                    let _ = conn.write_all(b"ok");
                    continue;
                }
                workers.push(std::thread::spawn(move || {
                    for (i, pause) in PAUSES.iter().enumerate() {
                        // The point: quiet for longer than a closed flow lives.
                        std::thread::sleep(*pause);
                        conn.write_all(&chunk(i))
                            .unwrap_or_else(|e| panic!("chunk {i} to {peer}: {e}"));
                    }
                }));
            }
            for w in workers {
                w.join().expect("a stream");
            }
        })
        .expect("the streaming server's thread");
    ready_rx
        .recv_timeout(Duration::from_secs(5))
        .expect("the streaming server listens");
    thread
}

fn chunk(i: usize) -> Vec<u8> {
    vec![b'a' + i as u8; CHUNK]
}

/// From `ns`: connects to `addr`, sends `request` and half-closes; then
/// reads the answer to its end.
fn half_closed_exchange(
    ns: &NetNs,
    addr: SocketAddr,
    request: &'static [u8],
    wait: Duration,
) -> Result<(Vec<u8>, Duration, std::io::Result<usize>), String> {
    ns.run(move || {
        let mut conn = TcpStream::connect_timeout(&addr, TIMEOUT)
            .map_err(|e| format!("connect to {addr}: {e}"))?;
        conn.set_read_timeout(Some(wait))
            .map_err(|e| e.to_string())?;
        conn.write_all(request)
            .map_err(|e| format!("request: {e}"))?;
        conn.shutdown(Shutdown::Write)
            .map_err(|e| format!("shutdown(SHUT_WR): {e}"))?;
        let started = Instant::now();
        let mut got = Vec::new();
        let read = conn.read_to_end(&mut got);
        Ok((got, started.elapsed(), read))
    })
    .map_err(|e| format!("{e:#}"))?
}

/// [`half_closed_exchange`] of a stream: says what differed from what was
/// sent.
fn half_closed_download(ns: &NetNs, addr: SocketAddr, what: &str) -> Result<(), String> {
    let (got, after, read) = half_closed_exchange(
        ns,
        addr,
        b"GET /stream HTTP/1.0\r\n\r\n",
        Duration::from_secs(30),
    )
    .map_err(|e| format!("{what}: {e}"))?;
    let want: Vec<u8> = (0..PAUSES.len()).flat_map(chunk).collect();
    match read {
        Ok(_) if got == want => Ok(()),
        Ok(_) => Err(format!(
            "{what}: the stream ended after {} of {} bytes, {after:?} after the FIN",
            got.len(),
            want.len(),
        )),
        Err(e) => Err(format!(
            "{what}: the stream broke after {} of {} bytes, {after:?} after the FIN: {e}",
            got.len(),
            want.len(),
        )),
    }
}

fn half_closed_streams<F: Family>() {
    let world = World::new::<F>();
    let server = streaming_server(world.backend(), F::any(0), 2);
    let paths = [
        (
            world.pod(),
            World::cluster_ip::<F>(),
            "ClusterIP from a pod",
        ),
        (
            world.client(),
            world.node_port::<F>(),
            "NodePort from outside, SNAT to node b",
        ),
    ];
    for (ns, addr, what) in paths {
        eventually(
            &format!("{} {what} answers", F::NAME),
            Duration::from_secs(10),
            || match half_closed_exchange(ns, addr, b"probe", TIMEOUT) {
                Ok((got, _, Ok(_))) if got == b"ok" => Ok(()),
                Ok((got, _, read)) => Err(format!("answered {got:?} ({read:?})")),
                Err(e) => Err(e),
            },
        );
    }
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let downloads: Vec<_> = paths
            .iter()
            .map(|&(ns, addr, what)| s.spawn(move || half_closed_download(ns, addr, what)))
            .collect();
        downloads
            .into_iter()
            .map(|d| d.join().expect("a download thread"))
            .collect()
    });
    server.join().expect("the streaming server");
    let failures: Vec<String> = results.into_iter().filter_map(Result::err).collect();
    assert!(
        failures.is_empty(),
        "{}: half-closed streams broke:\n  {}\nnode a's snat_new {}, ct_out_of_window {}",
        F::NAME,
        failures.join("\n  "),
        world.counter("snat_new"),
        world.counter("ct_out_of_window")
    );
}

#[test]
fn a_half_closed_stream_lives_through_a_clusterip_and_a_snated_nodeport() {
    half_closed_streams::<Ipv4Addr>();
}

#[test]
fn a_half_closed_stream_lives_through_a_clusterip_and_a_snated_nodeport_v6() {
    half_closed_streams::<Ipv6Addr>();
}

/// `TCP_REPAIR`'s options (`include/uapi/linux/tcp.h`): a socket in repair
/// mode tells its sequence numbers.
const TCP_REPAIR: libc::c_int = 19;
const TCP_REPAIR_QUEUE: libc::c_int = 20;
const TCP_QUEUE_SEQ: libc::c_int = 21;
const TCP_SEND_QUEUE: libc::c_int = 2;

/// The next sequence number `conn` sends (its `write_seq`), read in repair
/// mode, which is left again at once.
fn send_seq(conn: &TcpStream) -> u32 {
    let fd = conn.as_raw_fd();
    let set = |opt: libc::c_int, value: libc::c_int| {
        // SAFETY: a valid socket and an int option of the size given.
        let rc = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_TCP,
                opt,
                (&raw const value).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(
            rc,
            0,
            "setsockopt({opt}, {value}): {}",
            std::io::Error::last_os_error()
        );
    };
    set(TCP_REPAIR, 1);
    set(TCP_REPAIR_QUEUE, TCP_SEND_QUEUE);
    let mut seq: u32 = 0;
    let mut len = size_of::<u32>() as libc::socklen_t;
    // SAFETY: as above, with room for the u32 the option returns.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_TCP,
            TCP_QUEUE_SEQ,
            (&raw mut seq).cast(),
            &raw mut len,
        )
    };
    assert_eq!(rc, 0, "TCP_QUEUE_SEQ: {}", std::io::Error::last_os_error());
    set(TCP_REPAIR, 0);
    seq
}

/// Sends one IPv4 TCP segment, built whole, from the calling thread's
/// namespace through a raw socket (the source address is the caller's to
/// forge).
fn send_raw_v4(frame: &[u8], to: Ipv4Addr) {
    // SAFETY: plain socket calls on a descriptor owned here.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW);
        assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(to.octets()),
            },
            sin_zero: [0; 8],
        };
        let packet = &frame[14..];
        let sent = libc::sendto(
            fd,
            packet.as_ptr().cast(),
            packet.len(),
            0,
            (&raw const sin).cast(),
            size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        assert_eq!(sent, packet.len() as isize, "sending the forged RST: {err}");
    }
}

/// An outside client's connection through the NodePort (SNAT to node b)
/// gets RSTs forged with its own addresses and ports, their sequence
/// numbers before what the server acknowledged and half the space away:
/// node a counts them (`ct_out_of_window`), keeps the flow, and the
/// connection goes on.
#[test]
fn a_forged_rst_outside_the_window_does_not_end_a_connection() {
    let world = World::new::<Ipv4Addr>();
    let echo = world
        .backend()
        .spawn("echo", || {
            let listener = TcpListener::bind(("0.0.0.0", PORT)).expect("bind the echo server");
            let (mut conn, _) = listener.accept().expect("accept");
            let mut buf = [0u8; 64];
            while let Ok(n) = conn.read(&mut buf) {
                if n == 0 || conn.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        })
        .expect("the echo server");
    let node_port = world.node_port::<Ipv4Addr>();
    let SocketAddr::V4(to) = node_port else {
        unreachable!("an IPv4 NodePort")
    };
    let client_ip = CLIENT1.1;
    let outcome = world.client().run(move || {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut conn = loop {
            match TcpStream::connect_timeout(&node_port, TIMEOUT) {
                Ok(conn) => break conn,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => panic!("connect to the NodePort {node_port}: {e}"),
            }
        };
        conn.set_read_timeout(Some(TIMEOUT)).expect("timeout");
        let echo = |conn: &mut TcpStream, msg: &[u8]| -> Result<(), String> {
            conn.write_all(msg).map_err(|e| e.to_string())?;
            let mut back = vec![0u8; msg.len()];
            conn.read_exact(&mut back).map_err(|e| e.to_string())?;
            if back == msg {
                Ok(())
            } else {
                Err(format!("echoed {back:?}"))
            }
        };
        echo(&mut conn, b"before").expect("the connection before the forged RSTs");
        // Everything sent has been acknowledged (it came back); the next
        // sequence number is what the server expects.
        let next = send_seq(&conn);
        let sport = conn.local_addr().expect("local address").port();
        for seq in [next.wrapping_sub(100_000), next.wrapping_add(1 << 31)] {
            let rst = frames::build(&Spec {
                src: client_ip,
                dst: *to.ip(),
                sport,
                dport: to.port(),
                proto: frames::TCP,
                tcp_flags: frames::RST | frames::ACK,
                payload: Vec::new(),
                udp_no_csum: false,
            });
            send_raw_v4(&frames::with_seq_ack(&rst, seq, 0), *to.ip());
        }
        // Give the forged segments time to reach the server, were they let
        // through and believed.
        std::thread::sleep(Duration::from_millis(300));
        echo(&mut conn, b"after")
    });
    let after = outcome.expect("the client's thread");
    let counted = world.counter("ct_out_of_window");
    drop(echo);
    assert_eq!(
        after,
        Ok(()),
        "the connection broke after forged RSTs outside the window (node a counted {counted})"
    );
    assert_eq!(
        counted, 2,
        "node a's ct_out_of_window after two forged RSTs"
    );
}
