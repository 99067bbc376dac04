//! The node's UDP sockets, IPv4 and IPv6, listed and closed through the
//! kernel's socket diagnostics (`NETLINK_SOCK_DIAG`: `SOCK_DIAG_BY_FAMILY`,
//! `SOCK_DESTROY`).
//!
//! A UDP socket of the node that the `connect()` hook sent to a backend stays
//! connected to that backend's address for its life: no conntrack entry
//! stands between, so removing the backend's flows does not move it, where
//! kube-proxy's conntrack cleanup would send its next datagram elsewhere.
//! Closing it (its owner reads `ECONNABORTED` and opens a new one, which the
//! hook sends to a live backend) is what Cilium does for the same reason.

use std::{
    collections::HashSet,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsRawFd, OwnedFd},
    path::Path,
};

use bytemuck::{Pod, Zeroable};
use nix::sys::socket::{AddressFamily, SockFlag, SockProtocol, SockType, recv, send, socket};
use proxy_common::{PROTO_UDP, is_v4_mapped, sock_note, v4_mapped};

use super::sock_notes::{self, SockNotesError};
use crate::planner::Departed;

/// Closes the node's UDP sockets that the socket hooks connected to a
/// departed backend: those connected to its address and port whose own
/// notes say the `connect()` hook connected them there. An IPv4 backend's
/// notes are in `SOCK_NOTES` (read through the iterator pinned at `notes`),
/// whether an IPv4 socket or an IPv6 one (at the IPv4-mapped address) was
/// connected to it; an IPv6 backend's in `SOCK_NOTES6` (at `notes6`). A
/// socket connected to the backend's address by its owner is left alone.
/// Returns how many were closed.
pub fn close_departed(
    notes: &Path,
    notes6: &Path,
    departed: &[Departed],
) -> Result<usize, SockDiagError> {
    // (address, port), both in network order, an IPv4 address IPv4-mapped,
    // as `UdpSocket::peer_be` gives them.
    let gone: HashSet<([u32; 4], u16)> = departed
        .iter()
        .filter_map(|d| d.backend)
        .filter(|b| b.proto == PROTO_UDP)
        .map(|b| (b.addr_be, b.port_be))
        .collect();
    if gone.is_empty() {
        return Ok(0);
    }
    let mut diag = SockDiag::open()?;
    let candidates: Vec<UdpSocket> = diag
        .connected_udp()?
        .into_iter()
        .filter(|s| gone.contains(&s.peer_be()))
        .collect();
    if candidates.is_empty() {
        return Ok(0);
    }
    // Each map is read only when a candidate's backend is of its family, so
    // that a node without the IPv6 iterator still closes IPv4 sockets.
    let to_v4 = |s: &UdpSocket| is_v4_mapped(&s.peer_be().0);
    let notes = if candidates.iter().any(to_v4) {
        sock_notes::read(notes)?
    } else {
        sock_notes::Notes::default()
    };
    let notes6 = if candidates.iter().all(to_v4) {
        sock_notes::Notes6::default()
    } else {
        sock_notes::read6(notes6)?
    };
    let mut closed = 0;
    for socket in candidates {
        let hooked = socket.hook_connected(&notes, &notes6);
        if hooked && diag.destroy(&socket)? {
            closed += 1;
        }
    }
    Ok(closed)
}

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const SOCK_DESTROY: u16 = 21;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const IPPROTO_UDP: u8 = 17;
/// Every TCP state bit: UDP sockets report ESTABLISHED (connected) or CLOSE.
const ALL_STATES: u32 = u32::MAX;

#[derive(Debug, thiserror::Error)]
pub enum SockDiagError {
    #[error("opening a NETLINK_SOCK_DIAG socket: {0}")]
    Open(#[source] io::Error),
    #[error("sending a socket diagnostics request: {0}")]
    Send(#[source] io::Error),
    #[error("reading the socket diagnostics answer: {0}")]
    Receive(#[source] io::Error),
    #[error("the kernel refused to list UDP sockets: {0}")]
    Dump(#[source] io::Error),
    #[error("the kernel refused to close a UDP socket: {0}")]
    Destroy(#[source] io::Error),
    #[error("a socket diagnostics message of {len} bytes is cut short")]
    Truncated { len: usize },
    #[error(transparent)]
    Notes(#[from] SockNotesError),
}

impl SockDiagError {
    /// The kernel cannot close sockets at all (built without
    /// `CONFIG_INET_DIAG_DESTROY`): asking again would fail the same way.
    pub fn unsupported(&self) -> bool {
        matches!(self, SockDiagError::Destroy(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP))
    }
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
struct NlMsgHdr {
    len: u32,
    kind: u16,
    flags: u16,
    seq: u32,
    pid: u32,
}

/// `struct inet_diag_sockid`: ports and addresses in network order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
struct InetDiagSockId {
    sport_be: u16,
    dport_be: u16,
    src_be: [u32; 4],
    dst_be: [u32; 4],
    interface: u32,
    /// Low word first, as the kernel splits the socket cookie.
    cookie: [u32; 2],
}

/// `struct inet_diag_req_v2`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
struct InetDiagReqV2 {
    family: u8,
    protocol: u8,
    ext: u8,
    pad: u8,
    states: u32,
    id: InetDiagSockId,
}

/// `struct inet_diag_msg`, the head of every socket the dump lists.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
struct InetDiagMsg {
    family: u8,
    state: u8,
    timer: u8,
    retrans: u8,
    id: InetDiagSockId,
    expires: u32,
    rqueue: u32,
    wqueue: u32,
    uid: u32,
    inode: u32,
}

/// A UDP socket of this network namespace, IPv4 or IPv6, as the kernel
/// names it to list and to close it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UdpSocket {
    family: u8,
    id: InetDiagSockId,
}

/// A `NETLINK_SOCK_DIAG` socket of the calling thread's network namespace.
pub struct SockDiag {
    fd: OwnedFd,
    seq: u32,
}

impl SockDiag {
    pub fn open() -> Result<Self, SockDiagError> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkSockDiag,
        )
        .map_err(|e| SockDiagError::Open(e.into()))?;
        Ok(Self { fd, seq: 0 })
    }

    /// The connected UDP sockets of this namespace, IPv4 and IPv6.
    pub fn connected_udp(&mut self) -> Result<Vec<UdpSocket>, SockDiagError> {
        let mut sockets = self.udp()?;
        match self.udp6() {
            Ok(sockets6) => sockets.extend(sockets6),
            // A kernel without IPv6 has no IPv6 sockets to list.
            Err(SockDiagError::Dump(e))
                if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EAFNOSUPPORT)) => {}
            Err(e) => return Err(e),
        }
        sockets.retain(UdpSocket::connected);
        Ok(sockets)
    }

    /// Every IPv4 UDP socket of this namespace, connected or not.
    pub fn udp(&mut self) -> Result<Vec<UdpSocket>, SockDiagError> {
        self.dump(AF_INET)
    }

    /// Every IPv6 UDP socket of this namespace, connected or not (an IPv6
    /// socket talking IPv4 among them, its addresses IPv4-mapped).
    pub fn udp6(&mut self) -> Result<Vec<UdpSocket>, SockDiagError> {
        self.dump(AF_INET6)
    }

    fn dump(&mut self, family: u8) -> Result<Vec<UdpSocket>, SockDiagError> {
        self.request(
            SOCK_DIAG_BY_FAMILY,
            NLM_F_DUMP,
            family,
            InetDiagSockId::default(),
        )?;
        let mut sockets = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let len = self.receive(&mut buf)?;
            for (kind, payload) in messages(&buf[..len])? {
                match kind {
                    NLMSG_DONE => return Ok(sockets),
                    NLMSG_ERROR => match error_of(payload)? {
                        None => {}
                        Some(e) => return Err(SockDiagError::Dump(e)),
                    },
                    SOCK_DIAG_BY_FAMILY => {
                        let msg: InetDiagMsg = read(payload)?;
                        if msg.family == family {
                            sockets.push(UdpSocket { family, id: msg.id });
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    /// Closes `socket`; Ok(false) when it is already gone.
    pub fn destroy(&mut self, socket: &UdpSocket) -> Result<bool, SockDiagError> {
        self.request(SOCK_DESTROY, NLM_F_ACK, socket.family, socket.id)?;
        let mut buf = vec![0u8; 4096];
        loop {
            let len = self.receive(&mut buf)?;
            for (kind, payload) in messages(&buf[..len])? {
                if kind == NLMSG_ERROR {
                    return match error_of(payload)? {
                        None => Ok(true),
                        Some(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
                        Some(e) => Err(SockDiagError::Destroy(e)),
                    };
                }
            }
        }
    }

    /// One datagram of the kernel's answer; its length.
    fn receive(&self, buf: &mut [u8]) -> Result<usize, SockDiagError> {
        recv(
            self.fd.as_raw_fd(),
            buf,
            nix::sys::socket::MsgFlags::empty(),
        )
        .map_err(|e| SockDiagError::Receive(e.into()))
    }

    fn request(
        &mut self,
        kind: u16,
        flags: u16,
        family: u8,
        id: InetDiagSockId,
    ) -> Result<(), SockDiagError> {
        self.seq = self.seq.wrapping_add(1);
        let req = InetDiagReqV2 {
            family,
            protocol: IPPROTO_UDP,
            ext: 0,
            pad: 0,
            states: ALL_STATES,
            id,
        };
        let hdr = NlMsgHdr {
            len: (size_of::<NlMsgHdr>() + size_of::<InetDiagReqV2>()) as u32,
            kind,
            flags: NLM_F_REQUEST | flags,
            seq: self.seq,
            pid: 0,
        };
        let mut msg = bytemuck::bytes_of(&hdr).to_vec();
        msg.extend_from_slice(bytemuck::bytes_of(&req));
        send(
            self.fd.as_raw_fd(),
            &msg,
            nix::sys::socket::MsgFlags::empty(),
        )
        .map_err(|e| SockDiagError::Send(e.into()))?;
        Ok(())
    }
}

impl UdpSocket {
    /// Whether the `connect()` hook connected the socket to its peer, a
    /// backend, in a frontend's place: by its IPv4 notes for an IPv4 peer
    /// (of an IPv4 socket, or of an IPv6 one at its IPv4-mapped address),
    /// by its IPv6 notes for an IPv6 one.
    pub fn hook_connected(&self, notes: &sock_notes::Notes, notes6: &sock_notes::Notes6) -> bool {
        let (addr_be, port_be) = self.peer_be();
        let connected_by =
            |how: Option<u32>| how.is_some_and(|how| how & sock_note::CONNECTED != 0);
        self.connected()
            && if is_v4_mapped(&addr_be) {
                connected_by(
                    notes
                        .of(self.cookie())
                        .and_then(|n| n.find(&addr_be[3], port_be))
                        .map(|n| n.how),
                )
            } else {
                connected_by(
                    notes6
                        .of(self.cookie())
                        .and_then(|n| n.find(&addr_be, port_be))
                        .map(|n| n.how),
                )
            }
    }

    /// Whether the socket is connected (has a peer).
    pub fn connected(&self) -> bool {
        self.id.dport_be != 0
    }

    /// The cookie `bpf_get_socket_cookie` gives the hooks.
    pub fn cookie(&self) -> u64 {
        u64::from(self.id.cookie[0]) | (u64::from(self.id.cookie[1]) << 32)
    }

    /// Whether it is an IPv6 socket (`AF_INET6`), which may talk IPv4 too.
    pub fn ipv6(&self) -> bool {
        self.family == AF_INET6
    }

    /// The peer's address and port, in network order, the address in the
    /// maps' form: an IPv4 peer (of an IPv4 socket, or of an IPv6 one at
    /// the IPv4-mapped address) IPv4-mapped, as backends are kept.
    pub fn peer_be(&self) -> ([u32; 4], u16) {
        (self.words(&self.id.dst_be), self.id.dport_be)
    }

    pub fn local(&self) -> SocketAddr {
        addr(self.words(&self.id.src_be), self.id.sport_be)
    }

    pub fn peer(&self) -> SocketAddr {
        let (addr_be, port_be) = self.peer_be();
        addr(addr_be, port_be)
    }

    /// An address as the kernel reports it (an IPv4 socket's in the first
    /// word), in the maps' form.
    fn words(&self, addr_be: &[u32; 4]) -> [u32; 4] {
        match self.family {
            AF_INET => v4_mapped(addr_be[0]),
            _ => *addr_be,
        }
    }
}

/// `addr_be:port_be` as a socket address; an IPv4-mapped address as the IPv4
/// address it names.
fn addr(addr_be: [u32; 4], port_be: u16) -> SocketAddr {
    let ip = if is_v4_mapped(&addr_be) {
        IpAddr::V4(Ipv4Addr::from(addr_be[3].to_ne_bytes()))
    } else {
        IpAddr::V6(Ipv6Addr::from(bytemuck::cast::<[u32; 4], [u8; 16]>(
            addr_be,
        )))
    };
    SocketAddr::new(ip, u16::from_be(port_be))
}

/// The netlink messages of one datagram: (type, payload).
fn messages(mut buf: &[u8]) -> Result<Vec<(u16, &[u8])>, SockDiagError> {
    let mut out = Vec::new();
    while buf.len() >= size_of::<NlMsgHdr>() {
        let hdr: NlMsgHdr = read(buf)?;
        let len = hdr.len as usize;
        if len < size_of::<NlMsgHdr>() || len > buf.len() {
            return Err(SockDiagError::Truncated { len });
        }
        out.push((hdr.kind, &buf[size_of::<NlMsgHdr>()..len]));
        // Messages are 4-byte aligned.
        buf = &buf[len.next_multiple_of(4).min(buf.len())..];
    }
    Ok(out)
}

/// An `NLMSG_ERROR`'s error: None for an acknowledgement (error 0).
fn error_of(payload: &[u8]) -> Result<Option<io::Error>, SockDiagError> {
    let code = payload
        .get(..4)
        .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .ok_or(SockDiagError::Truncated { len: payload.len() })?;
    Ok((code != 0).then(|| io::Error::from_raw_os_error(-code)))
}

fn read<T: Pod>(buf: &[u8]) -> Result<T, SockDiagError> {
    buf.get(..size_of::<T>())
        .map(bytemuck::pod_read_unaligned)
        .ok_or(SockDiagError::Truncated { len: buf.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a kernel's refusal to close any socket is final: every other
    /// failure is worth another try.
    #[test]
    fn only_a_kernel_without_sock_destroy_is_unsupported() {
        let errno = |code| io::Error::from_raw_os_error(code);
        assert!(SockDiagError::Destroy(errno(libc::EOPNOTSUPP)).unsupported());
        for e in [
            SockDiagError::Destroy(errno(libc::EBUSY)),
            SockDiagError::Dump(errno(libc::EOPNOTSUPP)),
            SockDiagError::Open(errno(libc::EMFILE)),
            SockDiagError::Truncated { len: 3 },
        ] {
            assert!(!e.unsupported(), "{e} taken for final");
        }
    }

    #[test]
    fn structs_have_the_kernels_sizes() {
        assert_eq!(size_of::<NlMsgHdr>(), 16);
        assert_eq!(size_of::<InetDiagSockId>(), 48);
        assert_eq!(size_of::<InetDiagReqV2>(), 56);
        assert_eq!(size_of::<InetDiagMsg>(), 72);
    }

    /// A socket bound at `client`, connected to a peer bound at `peer`, is
    /// listed with its addresses (an IPv4 one, as the maps keep it,
    /// IPv4-mapped, in `peer_be`), and closed.
    fn lists_and_closes(client: &str, peer: &str) {
        let peer = std::net::UdpSocket::bind(peer).expect("peer socket");
        let client = std::net::UdpSocket::bind(client).expect("client socket");
        let target = match peer.local_addr().unwrap() {
            // An IPv6 socket reaches an IPv4 peer at its IPv4-mapped address.
            SocketAddr::V4(v4) if client.local_addr().unwrap().is_ipv6() => {
                SocketAddr::new(IpAddr::V6(v4.ip().to_ipv6_mapped()), v4.port())
            }
            other => other,
        };
        client.connect(target).expect("connect");
        let unmapped = |a: SocketAddr| match a {
            SocketAddr::V6(v6) => v6
                .ip()
                .to_ipv4_mapped()
                .map_or(a, |v4| SocketAddr::new(IpAddr::V4(v4), v6.port())),
            v4 @ SocketAddr::V4(_) => v4,
        };
        let (local, peer_addr) = (
            unmapped(client.local_addr().unwrap()),
            unmapped(peer.local_addr().unwrap()),
        );
        let mut diag = SockDiag::open().expect("sock_diag socket");
        let listed = diag.connected_udp().expect("listing UDP sockets");
        let found = listed
            .iter()
            .find(|s| s.local() == local)
            .unwrap_or_else(|| panic!("{local} is not among the {} listed", listed.len()));
        assert_eq!(found.peer(), peer_addr, "{found:?}");
        assert_eq!(
            found.ipv6(),
            client.local_addr().unwrap().is_ipv6(),
            "{found:?}"
        );
        let words = crate::planner::encode::addr_words(peer_addr.ip());
        assert_eq!(
            found.peer_be(),
            (words, peer_addr.port().to_be()),
            "{found:?}: the peer in the maps' form"
        );
        assert!(
            !listed.iter().any(|s| s.local() == peer_addr),
            "an unconnected socket was listed"
        );
        assert!(
            diag.destroy(found).expect("destroy"),
            "the socket was not found"
        );
        let err = client.send(b"x").expect_err("a closed socket still sends");
        assert!(
            matches!(
                err.raw_os_error(),
                Some(libc::ECONNABORTED | libc::EDESTADDRREQ)
            ),
            "after the close: {err}"
        );
        assert!(
            !diag.destroy(found).expect("second destroy"),
            "closed twice"
        );
    }

    #[test]
    fn lists_and_closes_a_connected_ipv4_socket_of_this_process() {
        lists_and_closes("127.0.0.1:0", "127.0.0.1:0");
    }

    #[test]
    fn lists_and_closes_a_connected_ipv6_socket_of_this_process() {
        lists_and_closes("[::1]:0", "[::1]:0");
    }

    #[test]
    fn lists_and_closes_an_ipv6_socket_connected_to_an_ipv4_mapped_peer() {
        lists_and_closes("[::]:0", "127.0.0.1:0");
    }
}
