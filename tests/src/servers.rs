//! Backends: small TCP and UDP servers inside a pod's namespace that say who they are
//! and which peer address they saw, so a test can tell which backend a connection
//! reached and whether the client's source address survived the trip.
//!
//! Protocol (see [`crate::client::Reply`]):
//! - TCP: on accept the server sends `<name> <peer ip>:<peer port>\n`; afterwards every
//!   line it receives is answered with `<name> <line>\n` until the peer closes.
//! - UDP: every datagram is answered with `<name> <peer ip>:<peer port>\n`; one that
//!   starts with `size <n>\n` gets that line padded to `n` bytes with
//!   [`padding`], so that a test can ask for an answer too large for one packet.
//!
//! [`PooledBackend`] is the benchmarks' backend, made for speed, with a protocol of its
//! own (see its doc).
//!
//! [`TcpServer`] and [`UdpServer`] listen on both families (`[::]`, IPv4 clients
//! arriving IPv4-mapped) and report an IPv4 peer in IPv4's form.
//!
//! Servers stop when dropped.

use std::{
    io::{BufRead, BufReader, ErrorKind, Read, Write},
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6, TcpListener, TcpStream, UdpSocket},
    os::fd::{AsFd, AsRawFd, OwnedFd},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use anyhow::{Context, Result};
use nix::{
    poll::{PollFd, PollFlags, PollTimeout, poll},
    sys::{
        socket::{
            AddressFamily, Backlog, SockFlag, SockType, SockaddrIn6, bind, listen, setsockopt,
            socket, sockopt,
        },
        time::{TimeVal, TimeValLike},
    },
};

use crate::{
    load::IO_TIMEOUT,
    netns::{NetNs, NsThread},
};

/// How often blocked server threads look at their stop flag.
const TICK: Duration = Duration::from_millis(50);

/// A TCP backend; see the module doc for what it answers.
#[derive(Debug)]
pub struct TcpServer {
    stop: Arc<AtomicBool>,
    thread: Option<NsThread<()>>,
}

impl TcpServer {
    /// Listens on `[::]:port` inside `ns` (both families: a namespace's
    /// `net.ipv6.bindv6only` is 0); returns once the socket is listening.
    pub fn start(ns: &NetNs, name: &str, port: u16) -> Result<TcpServer> {
        let listener = ns
            .run(|| TcpListener::bind((Ipv6Addr::UNSPECIFIED, port)))?
            .with_context(|| format!("{name}: bind TCP port {port} in {}", ns.name()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            let name = name.to_owned();
            // The listener already belongs to the namespace; the thread enters it too
            // so that anything it creates later does as well.
            ns.spawn(&format!("tcp-{name}"), move || {
                accept_loop(&listener, &name, &stop);
            })?
        };
        Ok(TcpServer {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn accept_loop(listener: &TcpListener, name: &str, stop: &Arc<AtomicBool>) {
    let mut connections = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        // poll with a timeout instead of a blocking accept, so a stop request is
        // seen within one tick.
        let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(TICK.as_millis() as u16)) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => {}
            Err(e) => {
                eprintln!("{name}: poll: {e}");
                break;
            }
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                let name = name.to_owned();
                let stop = stop.clone();
                connections.push(thread::spawn(move || {
                    if let Err(e) = serve_connection(stream, peer, &name, &stop) {
                        // Clients that close early are normal; anything else is worth
                        // seeing in a failing test's output.
                        if !matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) {
                            eprintln!("{name}: connection from {peer}: {e}");
                        }
                    }
                }));
                connections.retain(|c| !c.is_finished());
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {}
            Err(e) => eprintln!("{name}: accept: {e}"),
        }
    }
    for c in connections {
        let _ = c.join();
    }
}

fn serve_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    name: &str,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    stream.write_all(format!("{name} {}\n", canonical(peer)).as_bytes())?;
    stream.set_read_timeout(Some(TICK))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    while !stop.load(Ordering::Relaxed) {
        match reader.read_line(&mut line) {
            Ok(0) => return Ok(()),
            Ok(_) => {
                stream.write_all(format!("{name} {}\n", line.trim_end()).as_bytes())?;
                line.clear();
            }
            // A timeout keeps what was read so far in `line`; keep reading.
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A UDP backend; see the module doc for what it answers.
#[derive(Debug)]
pub struct UdpServer {
    stop: Arc<AtomicBool>,
    thread: Option<NsThread<()>>,
}

impl UdpServer {
    /// Binds `[::]:port` inside `ns` (both families, as [`TcpServer::start`]);
    /// returns once the socket is bound.
    pub fn start(ns: &NetNs, name: &str, port: u16) -> Result<UdpServer> {
        let socket = ns
            .run(|| UdpSocket::bind((Ipv6Addr::UNSPECIFIED, port)))?
            .with_context(|| format!("{name}: bind UDP port {port} in {}", ns.name()))?;
        socket.set_read_timeout(Some(TICK))?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            let name = name.to_owned();
            ns.spawn(&format!("udp-{name}"), move || {
                let mut buf = vec![0u8; 65_536];
                while !stop.load(Ordering::Relaxed) {
                    match socket.recv_from(&mut buf) {
                        Ok((n, peer)) => {
                            let answer = udp_answer(&name, peer, &buf[..n]);
                            if let Err(e) = socket.send_to(&answer, peer) {
                                eprintln!("{name}: reply to {peer}: {e}");
                            }
                        }
                        Err(e)
                            if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                        Err(e) => eprintln!("{name}: recv: {e}"),
                    }
                }
            })?
        };
        Ok(UdpServer {
            stop,
            thread: Some(thread),
        })
    }
}

/// What the UDP backend `name` answers `request` from `peer` (see the module doc).
fn udp_answer(name: &str, peer: SocketAddr, request: &[u8]) -> Vec<u8> {
    let mut answer = format!("{name} {}\n", canonical(peer)).into_bytes();
    let asked = std::str::from_utf8(request).ok().and_then(|r| {
        r.lines()
            .next()?
            .strip_prefix("size ")?
            .parse::<usize>()
            .ok()
    });
    if let Some(size) = asked.filter(|&n| n > answer.len() && n <= 65_000) {
        let at = answer.len();
        answer.extend(padding(at, size - at));
    }
    answer
}

/// `peer` with an IPv4-mapped address (an IPv4 client of a socket of both families)
/// as the IPv4 address it is.
fn canonical(peer: SocketAddr) -> SocketAddr {
    SocketAddr::new(peer.ip().to_canonical(), peer.port())
}

/// `len` filler bytes for offset `at` of a padded datagram: a pattern that a lost,
/// duplicated or misplaced fragment would break, checked by [`crate::client`].
pub fn padding(at: usize, len: usize) -> impl Iterator<Item = u8> {
    (at..at + len).map(|i| b'a' + (i % 26) as u8)
}

impl Drop for UdpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// How often idle [`PooledBackend`] threads look at their stop flag.
const POOL_TICK: Duration = Duration::from_millis(100);

/// A request that a [`PooledBackend`] answers without closing the TCP connection: it
/// then reads the next request on the same one.
pub const KEEP_OPEN: &[u8] = b"more\n";

/// A backend pod's TCP (and optionally UDP) server, made for speed: a fixed pool of
/// threads serving one connection each inline (the harness's servers spawn a thread per
/// connection, which on a small machine would cost more than the load balancers being
/// compared). TCP: read the request, answer `<name>\n`, close; as long as the request
/// is [`KEEP_OPEN`], answer and read the next one instead (request/response on one
/// connection: a thread is then the connection's until the client closes, so a pool
/// serves as many such connections at once as it has threads). UDP: answer every
/// datagram with `<name>\n`. Each family has sockets and threads of its own
/// (`IPV6_V6ONLY`), so that IPv4's exchanges are served as they were before IPv6
/// ones existed.
pub struct PooledBackend {
    stop: Arc<AtomicBool>,
    threads: Vec<NsThread<()>>,
}

impl PooledBackend {
    /// `threads` TCP server threads on `tcp_port` and, with a `udp_port`, as many UDP
    /// ones, in `ns`.
    pub fn start(
        ns: &NetNs,
        name: &str,
        tcp_port: u16,
        udp_port: Option<u16>,
        threads: usize,
    ) -> Result<PooledBackend> {
        let mut backend = PooledBackend {
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
        };
        let (listener, udp) = ns
            .run(|| -> std::io::Result<_> {
                let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, tcp_port))?;
                let udp = udp_port
                    .map(|port| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port)))
                    .transpose()?;
                Ok((listener, udp))
            })?
            .with_context(|| format!("{name}: bind the IPv4 servers in {}", ns.name()))?;
        backend.serve(ns, &format!("{name}-4"), name, listener, udp, threads)?;
        let (listener, udp) = ns
            .run(|| -> nix::Result<_> {
                let listener = TcpListener::from(v6_only(SockType::Stream, tcp_port)?);
                let udp = udp_port
                    .map(|port| {
                        Ok::<_, nix::Error>(UdpSocket::from(v6_only(SockType::Datagram, port)?))
                    })
                    .transpose()?;
                Ok((listener, udp))
            })?
            .with_context(|| format!("{name}: bind the IPv6 servers in {}", ns.name()))?;
        backend.serve(ns, &format!("{name}-6"), name, listener, udp, threads)?;
        Ok(backend)
    }

    /// `threads` threads serving `listener` and as many `udp`, answering `name`.
    fn serve(
        &mut self,
        ns: &NetNs,
        label: &str,
        name: &str,
        listener: TcpListener,
        udp: Option<UdpSocket>,
        threads: usize,
    ) -> Result<()> {
        // accept() honours SO_RCVTIMEO on Linux, so threads blocked in it wake up to see
        // the stop flag; a blocking accept shared by several threads wakes one of them
        // per connection, where poll() would wake them all.
        setsockopt(
            &listener,
            sockopt::ReceiveTimeout,
            &TimeVal::milliseconds(POOL_TICK.as_millis() as i64),
        )
        .with_context(|| format!("{name}: SO_RCVTIMEO on the listener"))?;
        let listener = Arc::new(listener);
        let udp = udp
            .map(|udp| -> Result<_> {
                udp.set_read_timeout(Some(POOL_TICK))?;
                Ok(Arc::new(udp))
            })
            .transpose()?;
        let reply: Arc<[u8]> = format!("{name}\n").into_bytes().into();
        for i in 0..threads {
            let (listener, stop, tcp_reply) = (listener.clone(), self.stop.clone(), reply.clone());
            self.threads
                .push(ns.spawn(&format!("tcp-{label}-{i}"), move || {
                    tcp_serve(&listener, &tcp_reply, &stop);
                })?);
            if let Some(udp) = &udp {
                let (udp, stop, udp_reply) = (udp.clone(), self.stop.clone(), reply.clone());
                self.threads
                    .push(ns.spawn(&format!("udp-{label}-{i}"), move || {
                        udp_serve(&udp, &udp_reply, &stop);
                    })?);
            }
        }
        Ok(())
    }
}

/// A socket of `kind` bound to `[::]:port` for IPv6 alone, listening if a stream.
fn v6_only(kind: SockType, port: u16) -> nix::Result<OwnedFd> {
    let fd = socket(AddressFamily::Inet6, kind, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    bind(
        fd.as_raw_fd(),
        &SockaddrIn6::from(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, port, 0, 0)),
    )?;
    if kind == SockType::Stream {
        listen(&fd, Backlog::MAXCONN)?;
    }
    Ok(fd)
}

impl Drop for PooledBackend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

fn tcp_serve(listener: &TcpListener, reply: &[u8], stop: &AtomicBool) {
    let mut buf = [0u8; 256];
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((mut stream, _)) => {
                // Errors are the client's business (it counts them); a server that gives
                // up on one connection goes on with the next.
                let _ = (|| -> std::io::Result<()> {
                    stream.set_read_timeout(Some(IO_TIMEOUT))?;
                    // The client waits for each answer before its next request, so a
                    // read never holds more than one.
                    loop {
                        let mut len = 0;
                        while !buf[..len].ends_with(b"\n") {
                            match stream.read(&mut buf[len..])? {
                                0 => return Ok(()),
                                n => len += n,
                            }
                            if len == buf.len() {
                                return Ok(());
                            }
                        }
                        stream.write_all(reply)?;
                        // Otherwise close: the FIN goes first, and the client's RST (it
                        // closes with SO_LINGER 0) ends the socket, so neither side keeps
                        // TIME_WAIT.
                        if buf[..len] != *KEEP_OPEN {
                            return Ok(());
                        }
                    }
                })();
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => {
                eprintln!("warning: accept: {e}");
                // Backs off a failing accept rather than spin on it.
                thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn udp_serve(socket: &UdpSocket, reply: &[u8], stop: &AtomicBool) {
    let mut buf = [0u8; 256];
    while !stop.load(Ordering::Relaxed) {
        match socket.recv_from(&mut buf) {
            Ok((_, peer)) => {
                let _ = socket.send_to(reply, peer);
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(e) => {
                eprintln!("warning: udp recv: {e}");
                // Backs off a failing receive rather than spin on it.
                thread::sleep(Duration::from_millis(10));
            }
        }
    }
}
