//! Clients that talk to the backends of [`crate::servers`] from inside a namespace and
//! say what happened: a reply (and from whom), a refusal, a timeout or another error.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    io::{self, BufRead, BufReader, ErrorKind, Write},
    net::{
        AddrParseError, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, TcpStream,
        UdpSocket,
    },
    str::FromStr,
    time::Duration,
};

use anyhow::{Context, Result, anyhow, bail};

use crate::netns::NetNs;

/// A socket address of one family: what requests go to and what a backend says
/// it saw (`a.b.c.d:port` or `[addr]:port`).
pub trait Peer:
    Copy
    + Eq
    + Send
    + Sync
    + fmt::Debug
    + fmt::Display
    + FromStr<Err = AddrParseError>
    + Into<SocketAddr>
{
    type Ip: Copy + Ord + Send + Sync + fmt::Debug + fmt::Display;
    fn peer_ip(&self) -> Self::Ip;
    /// The family's "any address", port 0: where a client socket binds.
    fn any() -> SocketAddr;
}

impl Peer for SocketAddrV4 {
    type Ip = Ipv4Addr;
    fn peer_ip(&self) -> Ipv4Addr {
        *self.ip()
    }
    fn any() -> SocketAddr {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    }
}

impl Peer for SocketAddrV6 {
    type Ip = Ipv6Addr;
    fn peer_ip(&self) -> Ipv6Addr {
        *self.ip()
    }
    fn any() -> SocketAddr {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    }
}

/// A backend's greeting: `<name> <peer ip>:<peer port>`; the peer of the request's
/// family (IPv4 unless said otherwise).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply<A = SocketAddrV4> {
    /// The backend that answered.
    pub backend: String,
    /// The client address the backend saw.
    pub peer: A,
}

impl<A: Peer> Reply<A> {
    pub fn parse(line: &str) -> Result<Reply<A>> {
        let line = line.trim_end();
        let (backend, peer) = line
            .split_once(' ')
            .ok_or_else(|| anyhow!("malformed reply {line:?}"))?;
        let peer = peer
            .parse()
            .with_context(|| format!("malformed peer address in reply {line:?}"))?;
        Ok(Reply {
            backend: backend.to_owned(),
            peer,
        })
    }
}

/// What one request came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome<A = SocketAddrV4> {
    Reply(Reply<A>),
    /// ECONNREFUSED: a TCP RST, or ICMP port unreachable for TCP or UDP.
    Refused,
    /// Nothing came back in time.
    Timeout,
    /// Anything else (unreachable, reset, a garbled reply, a harness failure).
    Failed(String),
}

impl<A: Peer> Outcome<A> {
    fn from_io(e: &io::Error) -> Outcome<A> {
        match e.kind() {
            ErrorKind::ConnectionRefused => Outcome::Refused,
            ErrorKind::TimedOut | ErrorKind::WouldBlock => Outcome::Timeout,
            kind => Outcome::Failed(format!("{kind:?}: {e}")),
        }
    }

    fn from_line(line: &str) -> Outcome<A> {
        match Reply::parse(line) {
            Ok(reply) => Outcome::Reply(reply),
            Err(e) => Outcome::Failed(format!("{e:#}")),
        }
    }

    /// The reply; panics with the outcome otherwise (for tests).
    #[track_caller]
    pub fn expect_reply(self, what: &str) -> Reply<A> {
        match self {
            Outcome::Reply(reply) => reply,
            other => panic!("{what}: expected a reply from a backend, got {other}"),
        }
    }
}

impl<A: fmt::Display> fmt::Display for Outcome<A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Reply(r) => write!(f, "reply from {} (saw peer {})", r.backend, r.peer),
            Outcome::Refused => f.write_str("connection refused"),
            Outcome::Timeout => f.write_str("timeout"),
            Outcome::Failed(e) => write!(f, "failure: {e}"),
        }
    }
}

/// One TCP request from the calling thread's namespace: connect, read the greeting,
/// close.
pub fn tcp_request_here<A: Peer>(addr: A, timeout: Duration) -> Outcome<A> {
    read_greeting(TcpStream::connect_timeout(&addr.into(), timeout), timeout)
}

/// [`tcp_request_here`], the client speaking first as most protocols do: it sends a
/// line (which the backend answers after its greeting) before it reads the greeting.
/// Its data segment also completes a handshake whose last ACK was lost at a backend
/// that answered with a SYN cookie; a client that waits for the greeting waits for a
/// retransmission such a backend never sends.
pub fn tcp_request_speaking_first_here<A: Peer>(addr: A, timeout: Duration) -> Outcome<A> {
    let stream = TcpStream::connect_timeout(&addr.into(), timeout)
        .and_then(|mut stream| stream.write_all(b"hello\n").map(|()| stream));
    read_greeting(stream, timeout)
}

/// [`tcp_request_here`] from a fixed local port. The socket has `SO_REUSEADDR`, so a
/// port whose previous connection (also made here) waits in `TIME_WAIT` can be used
/// again towards another destination, as the kernel itself may do.
pub fn tcp_request_from_port_here<A: Peer>(
    local_port: u16,
    addr: A,
    timeout: Duration,
) -> Outcome<A> {
    read_greeting(connect_from_port(local_port, addr, timeout), timeout)
}

/// [`tcp_request_from_port_here`], the connection closed with a RST (`SO_LINGER`
/// 0), as a load generator closes its connections to stay out of `TIME_WAIT`: the
/// same port may then connect to the same destination again at once.
pub fn tcp_request_from_port_reset_here<A: Peer>(
    local_port: u16,
    addr: A,
    timeout: Duration,
) -> Outcome<A> {
    let stream = connect_from_port(local_port, addr, timeout)
        .and_then(|stream| reset_on_close(&stream).map(|()| stream));
    read_greeting(stream, timeout)
}

/// Makes closing `stream` send a RST (`SO_LINGER` 0) and leave no `TIME_WAIT`, as
/// a load generator's connections close.
pub fn reset_on_close(stream: &TcpStream) -> io::Result<()> {
    use nix::libc;

    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    nix::sys::socket::setsockopt(stream, nix::sys::socket::sockopt::Linger, &linger)?;
    Ok(())
}

/// A TCP connection to `addr` from `local_port`, with `SO_REUSEADDR`; a connect that
/// takes longer than `timeout` fails with `TimedOut`.
fn connect_from_port<A: Peer>(
    local_port: u16,
    addr: A,
    timeout: Duration,
) -> io::Result<TcpStream> {
    use std::os::fd::AsRawFd;

    use nix::sys::{
        socket::{
            AddressFamily, SockFlag, SockType, SockaddrStorage, bind, connect, setsockopt, socket,
            sockopt,
        },
        time::{TimeVal, TimeValLike},
    };
    let mut local = A::any();
    local.set_port(local_port);
    let family = match local {
        SocketAddr::V4(_) => AddressFamily::Inet,
        SocketAddr::V6(_) => AddressFamily::Inet6,
    };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    // A blocking connect gives up after SO_SNDTIMEO (with EINPROGRESS).
    setsockopt(
        &fd,
        sockopt::SendTimeout,
        &TimeVal::milliseconds(timeout.as_millis() as i64),
    )?;
    bind(fd.as_raw_fd(), &SockaddrStorage::from(local))?;
    let remote: SocketAddr = addr.into();
    match connect(fd.as_raw_fd(), &SockaddrStorage::from(remote)) {
        Ok(()) => Ok(TcpStream::from(fd)),
        Err(nix::errno::Errno::EINPROGRESS) => {
            Err(io::Error::new(ErrorKind::TimedOut, "connect timed out"))
        }
        Err(e) => Err(e.into()),
    }
}

/// The greeting read from a connection, or what failed: its connect (`stream`'s
/// error) or the read.
fn read_greeting<A: Peer>(stream: io::Result<TcpStream>, timeout: Duration) -> Outcome<A> {
    let stream = match stream.and_then(|s| s.set_read_timeout(Some(timeout)).map(|()| s)) {
        Ok(stream) => stream,
        Err(e) => return Outcome::from_io(&e),
    };
    let mut line = String::new();
    match BufReader::new(stream).read_line(&mut line) {
        Ok(0) => Outcome::Failed("connection closed without a greeting".into()),
        Ok(_) => Outcome::from_line(&line),
        Err(e) => Outcome::from_io(&e),
    }
}

/// One UDP request from the calling thread's namespace, on a connected socket, so
/// that an ICMP port unreachable surfaces as ECONNREFUSED and only a reply from `addr`
/// itself (i.e. correctly reverse-NATed) is accepted.
pub fn udp_request_here<A: Peer>(addr: A, timeout: Duration) -> Outcome<A> {
    let attempt = || -> io::Result<String> {
        let socket = UdpSocket::bind(A::any())?;
        let addr: SocketAddr = addr.into();
        socket.connect(addr)?;
        socket.set_read_timeout(Some(timeout))?;
        socket.send(b"hello\n")?;
        let mut buf = [0u8; 2048];
        let n = socket.recv(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    };
    match attempt() {
        Ok(line) => Outcome::from_line(&line),
        Err(e) => Outcome::from_io(&e),
    }
}

/// A UDP request of `request_len` bytes on a connected socket, asking the backend
/// for an answer of `answer_len` bytes (see [`crate::servers`]): either may be larger
/// than one packet, so that the datagrams travel as IP fragments. The answer must
/// be whole, its padding intact.
pub fn udp_sized_request_here<A: Peer>(
    addr: A,
    request_len: usize,
    answer_len: usize,
    timeout: Duration,
) -> Outcome<A> {
    let attempt = || -> io::Result<Vec<u8>> {
        let socket = UdpSocket::bind(A::any())?;
        let addr: SocketAddr = addr.into();
        socket.connect(addr)?;
        socket.set_read_timeout(Some(timeout))?;
        let mut request = format!("size {answer_len}\n").into_bytes();
        let at = request.len();
        request.extend(crate::servers::padding(at, request_len.saturating_sub(at)));
        socket.send(&request)?;
        let mut buf = vec![0u8; 65_536];
        let n = socket.recv(&mut buf)?;
        buf.truncate(n);
        Ok(buf)
    };
    let answer = match attempt() {
        Ok(answer) => answer,
        Err(e) => return Outcome::from_io(&e),
    };
    let Some(end) = answer.iter().position(|&b| b == b'\n') else {
        return Outcome::Failed(format!(
            "an answer of {} bytes without a line",
            answer.len()
        ));
    };
    let line = String::from_utf8_lossy(&answer[..=end]);
    if answer.len() != answer_len.max(end + 1) {
        return Outcome::Failed(format!(
            "an answer of {} bytes where {answer_len} were asked for ({line:?})",
            answer.len()
        ));
    }
    let padding_ok = answer[end + 1..]
        .iter()
        .copied()
        .eq(crate::servers::padding(end + 1, answer.len() - end - 1));
    if !padding_ok {
        return Outcome::Failed(format!("the padding of the answer {line:?} is corrupt"));
    }
    Outcome::from_line(&line)
}

/// [`udp_sized_request_here`] from inside `ns`.
pub fn udp_sized_request<A: Peer>(
    ns: &NetNs,
    addr: A,
    request_len: usize,
    answer_len: usize,
    timeout: Duration,
) -> Outcome<A> {
    ns.run(|| udp_sized_request_here(addr, request_len, answer_len, timeout))
        .unwrap_or_else(|e| Outcome::Failed(format!("{e:#}")))
}

/// [`tcp_request_here`] from inside `ns`.
pub fn tcp_request<A: Peer>(ns: &NetNs, addr: A, timeout: Duration) -> Outcome<A> {
    ns.run(|| tcp_request_here(addr, timeout))
        .unwrap_or_else(|e| Outcome::Failed(format!("{e:#}")))
}

/// [`tcp_request_speaking_first_here`] from inside `ns`.
pub fn tcp_request_speaking_first<A: Peer>(ns: &NetNs, addr: A, timeout: Duration) -> Outcome<A> {
    ns.run(|| tcp_request_speaking_first_here(addr, timeout))
        .unwrap_or_else(|e| Outcome::Failed(format!("{e:#}")))
}

/// [`udp_request_here`] from inside `ns`.
pub fn udp_request<A: Peer>(ns: &NetNs, addr: A, timeout: Duration) -> Outcome<A> {
    ns.run(|| udp_request_here(addr, timeout))
        .unwrap_or_else(|e| Outcome::Failed(format!("{e:#}")))
}

/// Counts of many requests: which backend answered how often, which peer addresses the
/// backends saw, and everything that was not a reply.
#[derive(Debug, Clone)]
pub struct Tally<A: Peer = SocketAddrV4> {
    pub counts: BTreeMap<String, u64>,
    pub peers_seen: BTreeSet<A::Ip>,
    pub failures: Vec<Outcome<A>>,
}

impl<A: Peer> Default for Tally<A> {
    fn default() -> Self {
        Tally {
            counts: BTreeMap::new(),
            peers_seen: BTreeSet::new(),
            failures: Vec::new(),
        }
    }
}

impl<A: Peer> Tally<A> {
    pub fn record(&mut self, outcome: Outcome<A>) {
        match outcome {
            Outcome::Reply(r) => {
                *self.counts.entry(r.backend).or_default() += 1;
                self.peers_seen.insert(r.peer.peer_ip());
            }
            other => self.failures.push(other),
        }
    }

    pub fn replies(&self) -> u64 {
        self.counts.values().sum()
    }

    /// Counts for `backends` in that order, 0 for a backend that never answered.
    pub fn counts_for(&self, backends: &[&str]) -> Vec<u64> {
        backends
            .iter()
            .map(|b| self.counts.get(*b).copied().unwrap_or(0))
            .collect()
    }
}

/// Per request; generous, as a loaded CI machine runs several tests at once.
pub const TIMEOUT: Duration = Duration::from_secs(2);

/// Panics, saying how, unless every request of `tally` got a reply and every backend
/// saw `client`'s address.
#[track_caller]
pub fn assert_all_replied_from<A: Peer>(client: A::Ip, what: &str, tally: &Tally<A>) {
    assert!(
        tally.failures.is_empty(),
        "{what}: {} of {} requests failed{}; first failures: {:?}",
        tally.failures.len(),
        tally.failures.len() as u64 + tally.replies(),
        if tally.failures.len() >= TALLY_MAX_FAILURES {
            " (the batch stopped there)"
        } else {
            ""
        },
        &tally.failures[..tally.failures.len().min(5)]
    );
    let expected: BTreeSet<A::Ip> = [client].into();
    assert_eq!(
        tally.peers_seen, expected,
        "{what}: backends saw these client addresses instead of only the client's {client}"
    );
}

/// A batch stops after this many failures: enough to see what goes wrong, while a
/// broken datapath would otherwise cost `n` times the timeout.
pub const TALLY_MAX_FAILURES: usize = 10;

/// `n` TCP requests to `addr` from inside `ns`, one new connection each (fewer if
/// [`TALLY_MAX_FAILURES`] is reached).
pub fn tcp_tally<A: Peer>(ns: &NetNs, addr: A, n: usize, timeout: Duration) -> Result<Tally<A>> {
    tally(ns, n, || tcp_request_here(addr, timeout))
}

/// `n` UDP requests to `addr` from inside `ns`, a new socket (source port) each.
pub fn udp_tally<A: Peer>(ns: &NetNs, addr: A, n: usize, timeout: Duration) -> Result<Tally<A>> {
    tally(ns, n, || udp_request_here(addr, timeout))
}

fn tally<A: Peer>(
    ns: &NetNs,
    n: usize,
    request: impl Fn() -> Outcome<A> + Send + Sync,
) -> Result<Tally<A>> {
    // One thread in the namespace for the whole batch.
    ns.run(|| {
        let mut tally = Tally::default();
        for _ in 0..n {
            tally.record(request());
            if tally.failures.len() >= TALLY_MAX_FAILURES {
                break;
            }
        }
        tally
    })
}

/// A TCP connection kept open, to check that established flows survive changes; to
/// an address of either family (IPv4 unless said otherwise).
#[derive(Debug)]
pub struct TcpSession<A: Peer = SocketAddrV4> {
    stream: TcpStream,
    reader: BufReader<TcpStream>,
    pub greeting: Reply<A>,
}

impl<A: Peer> TcpSession<A> {
    /// Connects from inside `ns` and reads the greeting.
    pub fn open(ns: &NetNs, addr: A, timeout: Duration) -> Result<TcpSession<A>> {
        let stream = ns
            .run(|| TcpStream::connect_timeout(&addr.into(), timeout))?
            .with_context(|| format!("connect to {addr} from {}", ns.name()))?;
        Self::greeted(stream, addr, timeout)
    }

    /// [`TcpSession::open`] from `local_port`, bound with `SO_REUSEADDR`: another
    /// connection to another destination may hold that port too.
    pub fn open_from_port(
        ns: &NetNs,
        local_port: u16,
        addr: A,
        timeout: Duration,
    ) -> Result<TcpSession<A>> {
        let stream = ns
            .run(|| connect_from_port(local_port, addr, timeout))?
            .with_context(|| {
                format!("connect to {addr} from port {local_port} in {}", ns.name())
            })?;
        Self::greeted(stream, addr, timeout)
    }

    /// The session on `stream`, connected to `addr`, once its greeting is read.
    fn greeted(stream: TcpStream, addr: A, timeout: Duration) -> Result<TcpSession<A>> {
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut line = String::new();
        if reader.read_line(&mut line).context("read greeting")? == 0 {
            bail!("{addr} closed the connection without a greeting");
        }
        Ok(TcpSession {
            stream,
            reader,
            greeting: Reply::parse(&line)?,
        })
    }

    /// Sends `text` as one line and returns the answer line (`<backend> <text>`).
    pub fn exchange(&mut self, text: &str) -> Result<String> {
        self.stream
            .write_all(format!("{text}\n").as_bytes())
            .context("send on established connection")?;
        let mut line = String::new();
        if self
            .reader
            .read_line(&mut line)
            .context("receive on established connection")?
            == 0
        {
            bail!("the backend closed the established connection");
        }
        Ok(line.trim_end().to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_greetings() {
        assert_eq!(
            Reply::<SocketAddrV4>::parse("backend-a 10.200.0.2:40000\n").unwrap(),
            Reply {
                backend: "backend-a".into(),
                peer: "10.200.0.2:40000".parse().unwrap()
            }
        );
        assert!(Reply::<SocketAddrV4>::parse("garbage").is_err());
        assert!(Reply::<SocketAddrV4>::parse("backend-a nowhere").is_err());
    }

    #[test]
    fn parses_ipv6_greetings() {
        let reply = Reply::<SocketAddrV6>::parse("backend-a [fd00:10::ac8:2]:40000\n").unwrap();
        assert_eq!(
            reply.peer.peer_ip(),
            "fd00:10::ac8:2".parse::<Ipv6Addr>().unwrap()
        );
        assert!(Reply::<SocketAddrV6>::parse("backend-a 10.200.0.2:40000").is_err());
    }

    #[test]
    fn tally_counts_replies_and_failures() {
        let mut t: Tally = Tally::default();
        t.record(Outcome::from_line("a 10.0.0.1:1"));
        t.record(Outcome::from_line("a 10.0.0.1:2"));
        t.record(Outcome::from_line("b 10.0.0.2:1"));
        t.record(Outcome::Timeout);
        assert_eq!(t.counts_for(&["a", "b", "c"]), vec![2, 1, 0]);
        assert_eq!(t.replies(), 3);
        assert_eq!(t.failures, vec![Outcome::Timeout]);
        assert_eq!(t.peers_seen.len(), 2);
    }
}
