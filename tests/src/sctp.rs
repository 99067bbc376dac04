//! SCTP (RFC 9260) without the kernel's SCTP: packets built and checked by hand
//! (common header, chunks, `CRC32c` from `proxy_common::sctp`), and a peer that
//! speaks them over a raw socket of protocol 132 in a namespace. This kernel has
//! no SCTP sockets; a raw socket of the protocol receives a copy of every SCTP
//! packet the namespace gets (and, having taken it, keeps the kernel from
//! answering it with an ICMP protocol unreachable), so a peer filters by its port.
//!
//! [`Association`] drives one association between a client peer and a server
//! peer step by step from one thread: each packet sent by one is received by the
//! other, which checks its checksum, verification tag, chunk and addresses.

use std::{
    io,
    mem::{size_of, zeroed},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use nix::libc;
pub use proxy_common::sctp::chunk;
use proxy_common::sctp::{CHUNK_HEADER_LEN, CSUM_OFF, HEADER_LEN, VTAG_OFF, packet_checksum};

use crate::netns::NetNs;

/// SCTP's IP protocol number.
pub const PROTO: u8 = 132;

/// Chunk types beyond those the datapath tells apart (`chunk`).
pub mod kind {
    pub const SACK: u8 = 3;
    pub const SHUTDOWN: u8 = 7;
    pub const SHUTDOWN_ACK: u8 = 8;
    pub const COOKIE_ECHO: u8 = 10;
    pub const COOKIE_ACK: u8 = 11;
}

/// INIT ACK's State Cookie parameter (RFC 9260 3.3.3).
const STATE_COOKIE: u16 = 7;

/// A chunk of type `kind` with `flags` and `body`, padded to 4 bytes (its length
/// field counts the body, not the padding).
pub fn chunk(kind: u8, flags: u8, body: &[u8]) -> Vec<u8> {
    let mut c = vec![kind, flags];
    c.extend_from_slice(&((CHUNK_HEADER_LEN + body.len()) as u16).to_be_bytes());
    c.extend_from_slice(body);
    while !c.len().is_multiple_of(4) {
        c.push(0);
    }
    c
}

/// An INIT (`kind` `chunk::INIT`) or INIT ACK (`chunk::INIT_ACK`, with a State
/// Cookie parameter holding `cookie`) with `initiate_tag` and initial TSN `tsn`.
pub fn init(kind: u8, initiate_tag: u32, tsn: u32, cookie: Option<&[u8]>) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&initiate_tag.to_be_bytes());
    body.extend_from_slice(&65_535u32.to_be_bytes()); // a_rwnd
    body.extend_from_slice(&1u16.to_be_bytes()); // outbound streams
    body.extend_from_slice(&1u16.to_be_bytes()); // inbound streams
    body.extend_from_slice(&tsn.to_be_bytes());
    if let Some(cookie) = cookie {
        body.extend_from_slice(&STATE_COOKIE.to_be_bytes());
        body.extend_from_slice(&((4 + cookie.len()) as u16).to_be_bytes());
        body.extend_from_slice(cookie);
        while !body.len().is_multiple_of(4) {
            body.push(0);
        }
    }
    chunk(kind, 0, &body)
}

/// A DATA chunk, the whole of one message (B and E bits), on stream 0.
pub fn data(tsn: u32, payload: &[u8]) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&tsn.to_be_bytes());
    body.extend_from_slice(&[0, 0, 0, 0]); // stream 0, sequence 0
    body.extend_from_slice(&0u32.to_be_bytes()); // payload protocol
    body.extend_from_slice(payload);
    chunk(chunk::DATA, 0x03, &body)
}

/// A SACK of everything up to `cum_tsn`, without gaps.
pub fn sack(cum_tsn: u32) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&cum_tsn.to_be_bytes());
    body.extend_from_slice(&65_535u32.to_be_bytes());
    body.extend_from_slice(&[0, 0, 0, 0]);
    chunk(kind::SACK, 0, &body)
}

/// A SHUTDOWN acknowledging up to `cum_tsn`.
pub fn shutdown(cum_tsn: u32) -> Vec<u8> {
    chunk(kind::SHUTDOWN, 0, &cum_tsn.to_be_bytes())
}

/// An SCTP packet: the common header (its checksum right) and `chunks`.
pub fn packet(sport: u16, dport: u16, vtag: u32, chunks: &[Vec<u8>]) -> Vec<u8> {
    let mut p = Vec::with_capacity(HEADER_LEN + chunks.iter().map(Vec::len).sum::<usize>());
    p.extend_from_slice(&sport.to_be_bytes());
    p.extend_from_slice(&dport.to_be_bytes());
    p.extend_from_slice(&vtag.to_be_bytes());
    p.extend_from_slice(&[0; 4]);
    for c in chunks {
        p.extend_from_slice(c);
    }
    let c = packet_checksum(&p);
    p[CSUM_OFF..CSUM_OFF + 4].copy_from_slice(&c.to_le_bytes());
    p
}

/// One chunk of a received packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub kind: u8,
    pub flags: u8,
    /// The body, without the header and the padding.
    pub body: Vec<u8>,
}

/// A received SCTP packet, its checksum checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet {
    pub sport: u16,
    pub dport: u16,
    pub vtag: u32,
    pub chunks: Vec<Chunk>,
}

impl Packet {
    /// The first chunk's type.
    pub fn kind(&self) -> u8 {
        self.chunks[0].kind
    }

    /// An INIT's or INIT ACK's Initiate Tag.
    pub fn initiate_tag(&self) -> Option<u32> {
        let c = &self.chunks[0];
        (matches!(c.kind, chunk::INIT | chunk::INIT_ACK) && c.body.len() >= 4)
            .then(|| u32::from_be_bytes(c.body[0..4].try_into().unwrap()))
    }

    /// The first chunk of type `kind`.
    pub fn find(&self, kind: u8) -> Option<&Chunk> {
        self.chunks.iter().find(|c| c.kind == kind)
    }
}

/// The verification tag of the SCTP packet `p`.
pub fn vtag_of(p: &[u8]) -> u32 {
    u32::from_be_bytes(p[VTAG_OFF..VTAG_OFF + 4].try_into().unwrap())
}

/// The checksum field of the SCTP packet `p`, as stored (little-endian).
pub fn stored_checksum(p: &[u8]) -> u32 {
    u32::from_le_bytes(p[CSUM_OFF..CSUM_OFF + 4].try_into().unwrap())
}

/// Parses an SCTP packet, common header first; an error says what is wrong
/// (a checksum that is not the recomputed one, a chunk cut short).
pub fn parse(p: &[u8]) -> std::result::Result<Packet, String> {
    if p.len() < HEADER_LEN + CHUNK_HEADER_LEN {
        return Err(format!("an SCTP packet of {} bytes", p.len()));
    }
    let (stored, want) = (stored_checksum(p), packet_checksum(p));
    if stored != want {
        return Err(format!(
            "CRC32c {stored:#010x} where the packet's bytes give {want:#010x} ({} bytes)",
            p.len()
        ));
    }
    let mut chunks = Vec::new();
    let mut off = HEADER_LEN;
    while off < p.len() {
        if p.len() - off < CHUNK_HEADER_LEN {
            return Err(format!("{} bytes after the last chunk", p.len() - off));
        }
        let len = usize::from(u16::from_be_bytes([p[off + 2], p[off + 3]]));
        if len < CHUNK_HEADER_LEN || off + len > p.len() {
            return Err(format!(
                "chunk of type {} at {off}: length {len} in {} bytes",
                p[off],
                p.len()
            ));
        }
        chunks.push(Chunk {
            kind: p[off],
            flags: p[off + 1],
            body: p[off + CHUNK_HEADER_LEN..off + len].to_vec(),
        });
        off += len.next_multiple_of(4);
    }
    Ok(Packet {
        sport: u16::from_be_bytes([p[0], p[1]]),
        dport: u16::from_be_bytes([p[2], p[3]]),
        vtag: vtag_of(p),
        chunks,
    })
}

/// A raw socket of protocol 132 in a namespace: one end of an association,
/// bound to nothing, taking the packets to its `port`.
#[derive(Debug)]
pub struct RawPeer {
    fd: OwnedFd,
    pub port: u16,
    v6: bool,
    /// Packets to `port` received but not asked for yet: none in a passing run
    /// (every packet is asked for in order); kept for the failure message.
    what: String,
}

/// A packet received by a [`RawPeer`]: from whom, to whom (IPv4 only: an IPv6 raw
/// socket gets no header) and the packet.
#[derive(Debug, Clone)]
pub struct Received {
    pub from: IpAddr,
    pub to: Option<IpAddr>,
    pub packet: Packet,
}

impl RawPeer {
    /// A raw SCTP socket of the family of `v6` in `ns`, for packets to `port`.
    pub fn open(ns: &NetNs, v6: bool, port: u16, what: &str) -> Result<RawPeer> {
        let fd = ns
            .run(move || {
                let family = if v6 { libc::AF_INET6 } else { libc::AF_INET };
                // SAFETY: socket(2) with constant arguments; a non-negative
                // result is a new descriptor that nothing else owns.
                let fd = unsafe {
                    libc::socket(
                        family,
                        libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                        i32::from(PROTO),
                    )
                };
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                // SAFETY: fd was just returned by socket(2).
                Ok(unsafe { OwnedFd::from_raw_fd(fd) })
            })
            .context("entering the namespace")?
            .with_context(|| format!("{what}: a raw socket of protocol {PROTO}"))?;
        Ok(RawPeer {
            fd,
            port,
            v6,
            what: what.to_owned(),
        })
    }

    /// Sends the SCTP packet `p` to `to` (the kernel adds the IP header, its
    /// source the route's).
    pub fn send(&self, to: IpAddr, p: &[u8]) -> Result<()> {
        let (sa, len) = socket_addr(to);
        // SAFETY: `p` and `sa` are valid for their lengths during the call.
        let sent = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                p.as_ptr().cast(),
                p.len(),
                0,
                (&raw const sa).cast(),
                len,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error())
                .with_context(|| format!("{}: sending {} bytes to {to}", self.what, p.len()));
        }
        Ok(())
    }

    /// The next SCTP packet to this peer's port within `within`, parsed; a packet
    /// to the port that does not parse (a wrong checksum) is an error. `None`
    /// when none came.
    pub fn recv(&self, within: Duration) -> Result<Option<Received>> {
        let until = Instant::now() + within;
        let mut buf = vec![0u8; 65_536];
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            let mut pfd = libc::pollfd {
                fd: self.fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX);
            // SAFETY: one valid pollfd.
            let ready = unsafe { libc::poll(&raw mut pfd, 1, ms) };
            if ready < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e).context("poll");
            }
            if ready == 0 {
                continue;
            }
            // SAFETY: sockaddr_storage is plain data; zero is a valid value.
            let mut from: libc::sockaddr_storage = unsafe { zeroed() };
            let mut from_len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            // SAFETY: `buf` and `from` are valid for their lengths.
            let n = unsafe {
                libc::recvfrom(
                    self.fd.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT,
                    (&raw mut from).cast(),
                    &raw mut from_len,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) {
                    continue;
                }
                return Err(e).context("recvfrom");
            }
            let got = &buf[..n as usize];
            let (src, dst, sctp) = if self.v6 {
                // SAFETY: an AF_INET6 socket fills a sockaddr_in6.
                let sin6 = unsafe { *(&raw const from).cast::<libc::sockaddr_in6>() };
                (
                    IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)),
                    None,
                    got,
                )
            } else {
                let ihl = usize::from(got[0] & 0x0f) * 4;
                let src = Ipv4Addr::new(got[12], got[13], got[14], got[15]);
                let dst = Ipv4Addr::new(got[16], got[17], got[18], got[19]);
                (IpAddr::V4(src), Some(IpAddr::V4(dst)), &got[ihl..])
            };
            if sctp.len() < 4 || u16::from_be_bytes([sctp[2], sctp[3]]) != self.port {
                continue;
            }
            let packet = parse(sctp).map_err(|e| {
                anyhow::anyhow!(
                    "{}: a packet from {src} to port {}: {e}",
                    self.what,
                    self.port
                )
            })?;
            return Ok(Some(Received {
                from: src,
                to: dst,
                packet,
            }));
        }
    }
}

/// `ip` as a socket address of port 0 (raw sockets have no ports), and its length.
fn socket_addr(ip: IpAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { zeroed() };
    let len = match ip {
        IpAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr.
            let sin = unsafe { &mut *(&raw mut ss).cast::<libc::sockaddr_in>() };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_addr.s_addr = u32::from_ne_bytes(v4.octets());
            size_of::<libc::sockaddr_in>()
        }
        IpAddr::V6(v6) => {
            // SAFETY: as above.
            let sin6 = unsafe { &mut *(&raw mut ss).cast::<libc::sockaddr_in6>() };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_addr.s6_addr = v6.octets();
            size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// How an [`Association`] ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// SHUTDOWN, SHUTDOWN ACK, SHUTDOWN COMPLETE (the client's, without the T
    /// bit, under the server's tag).
    Shutdown,
    /// An ABORT from the client with the T bit, under its own tag.
    Abort,
}

/// Where the two ends of an association send and what each must see.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Where the client sends (a frontend) and whence it must see replies.
    pub service: SocketAddr,
    /// The client's port.
    pub client_port: u16,
    /// The client's address as the server must see it (its own, or the node's
    /// when SNATed).
    pub client_seen: IpAddr,
    /// Whether the server must see the client's own port (not SNATed).
    pub client_port_kept: bool,
    /// The server's address (what the server answers from) and port.
    pub server: SocketAddr,
    pub client_tag: u32,
    pub server_tag: u32,
}

/// How long a peer waits for each packet of an association.
pub const STEP_WAIT: Duration = Duration::from_secs(3);

/// What one association saw: the client's address and port as the server saw
/// them.
#[derive(Debug, Clone, Copy)]
pub struct Seen {
    pub client_at_server: SocketAddr,
}

/// One association over raw sockets between `client` and `server` per `plan`:
/// INIT, INIT ACK (with a cookie), COOKIE ECHO, COOKIE ACK, DATA and SACK both
/// ways (the long DATA `payload_len` bytes), then `ending`. Every received
/// packet is checked (checksum, verification tag, chunk, ports, addresses); an
/// error says which step saw what.
#[expect(
    clippy::too_many_lines,
    reason = "the association's steps in their order, each with its checks"
)]
pub fn associate(
    client: &RawPeer,
    server: &RawPeer,
    plan: &Plan,
    payload_len: usize,
    ending: Ending,
) -> Result<Seen> {
    let (ct, st) = (plan.client_tag, plan.server_tag);
    let svc = plan.service;
    let cp = plan.client_port;
    let payload: Vec<u8> = (0..payload_len).map(|i| (i * 7 + 1) as u8).collect();

    // Client -> server (through the frontend).
    let to_server = |step: &str, vtag: u32, chunks: &[Vec<u8>], kind: u8| -> Result<Received> {
        client
            .send(svc.ip(), &packet(cp, svc.port(), vtag, chunks))
            .with_context(|| format!("{step}: client send"))?;
        let r = server
            .recv(STEP_WAIT)
            .with_context(|| format!("{step}: server receive"))?
            .with_context(|| {
                format!(
                    "{step}: the server got nothing within {STEP_WAIT:?} (sent to {svc} under \
                     tag {vtag:#x})"
                )
            })?;
        let p = &r.packet;
        if p.vtag != vtag || p.kind() != kind || p.dport != plan.server.port() {
            bail!(
                "{step}: the server got chunk {} under tag {:#x} to port {} from {}:{}; expected \
                 chunk {kind} under {vtag:#x} to port {}",
                p.kind(),
                p.vtag,
                p.dport,
                r.from,
                p.sport,
                plan.server.port()
            );
        }
        if r.from != plan.client_seen || (plan.client_port_kept && p.sport != cp) {
            bail!(
                "{step}: the server saw the client as {}:{}, not {}{}",
                r.from,
                p.sport,
                plan.client_seen,
                if plan.client_port_kept {
                    format!(":{cp}")
                } else {
                    " (any port)".to_owned()
                }
            );
        }
        if let Some(to) = r.to
            && to != plan.server.ip()
        {
            bail!(
                "{step}: the server got a packet to {to}, not its own {}",
                plan.server.ip()
            );
        }
        Ok(r)
    };

    let first = to_server("INIT", 0, &[init(chunk::INIT, ct, 1000, None)], chunk::INIT)?;
    if first.packet.initiate_tag() != Some(ct) {
        bail!(
            "INIT: the server got Initiate Tag {:?}, not {ct:#x}",
            first.packet.initiate_tag()
        );
    }
    let seen_port = first.packet.sport;
    let seen_ip = first.from;

    // Server -> client (to the client as it saw it; the reply is translated back).
    let to_client = |step: &str, vtag: u32, chunks: &[Vec<u8>], kind: u8| -> Result<Received> {
        server
            .send(
                seen_ip,
                &packet(plan.server.port(), seen_port, vtag, chunks),
            )
            .with_context(|| format!("{step}: server send"))?;
        let r = client
            .recv(STEP_WAIT)
            .with_context(|| format!("{step}: client receive"))?
            .with_context(|| {
                format!("{step}: the client got nothing within {STEP_WAIT:?} (tag {vtag:#x})")
            })?;
        let p = &r.packet;
        if p.vtag != vtag || p.kind() != kind || r.from != svc.ip() || p.sport != svc.port() {
            bail!(
                "{step}: the client got chunk {} under tag {:#x} from {}:{}; expected chunk \
                 {kind} under {vtag:#x} from {svc}",
                p.kind(),
                p.vtag,
                r.from,
                p.sport
            );
        }
        Ok(r)
    };

    let cookie = b"a state cookie of the server's";
    let ack = to_client(
        "INIT ACK",
        ct,
        &[init(chunk::INIT_ACK, st, 5000, Some(cookie))],
        chunk::INIT_ACK,
    )?;
    if ack.packet.initiate_tag() != Some(st) {
        bail!(
            "INIT ACK: Initiate Tag {:?}, not {st:#x}",
            ack.packet.initiate_tag()
        );
    }
    to_server(
        "COOKIE ECHO",
        st,
        &[chunk(kind::COOKIE_ECHO, 0, cookie)],
        kind::COOKIE_ECHO,
    )?;
    to_client(
        "COOKIE ACK",
        ct,
        &[chunk(kind::COOKIE_ACK, 0, &[])],
        kind::COOKIE_ACK,
    )?;
    let d = to_server("DATA", st, &[data(1000, &payload)], chunk::DATA)?;
    let got = &d.packet.chunks[0].body[12..];
    if got != payload.as_slice() {
        bail!(
            "DATA: the server got {} bytes that differ from the {} sent",
            got.len(),
            payload.len()
        );
    }
    let back = to_client(
        "SACK and DATA",
        ct,
        &[sack(1000), data(5000, b"hello back")],
        kind::SACK,
    )?;
    if back.packet.find(chunk::DATA).is_none() {
        bail!("SACK and DATA: the client got {:?}", back.packet.chunks);
    }
    to_server("SACK", st, &[sack(5000)], kind::SACK)?;
    match ending {
        Ending::Shutdown => {
            to_server("SHUTDOWN", st, &[shutdown(5000)], kind::SHUTDOWN)?;
            to_client(
                "SHUTDOWN ACK",
                ct,
                &[chunk(kind::SHUTDOWN_ACK, 0, &[])],
                kind::SHUTDOWN_ACK,
            )?;
            to_server(
                "SHUTDOWN COMPLETE",
                st,
                &[chunk(chunk::SHUTDOWN_COMPLETE, 0, &[])],
                chunk::SHUTDOWN_COMPLETE,
            )?;
        }
        Ending::Abort => {
            to_server(
                "ABORT (T bit)",
                ct,
                &[chunk(chunk::ABORT, chunk::FLAG_T, &[])],
                chunk::ABORT,
            )?;
        }
    }
    Ok(Seen {
        client_at_server: SocketAddr::new(seen_ip, seen_port),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_packets_carry_the_checksum_of_their_bytes() {
        for chunks in [
            vec![init(chunk::INIT, 0xdead_beef, 1, None)],
            vec![init(chunk::INIT_ACK, 7, 9, Some(b"cookie!"))],
            vec![sack(3), data(4, &[0x5a; 1400])],
            vec![chunk(chunk::ABORT, chunk::FLAG_T, &[])],
        ] {
            let p = packet(40_000, 9000, 0x0102_0304, &chunks);
            assert_eq!(stored_checksum(&p), packet_checksum(&p));
            let parsed = parse(&p).expect("a built packet parses");
            assert_eq!(parsed.chunks.len(), chunks.len());
            assert_eq!(
                (parsed.sport, parsed.dport, parsed.vtag),
                (40_000, 9000, 0x0102_0304)
            );
        }
        let mut p = packet(1, 2, 3, &[data(1, b"x")]);
        p[20] ^= 1;
        assert!(parse(&p).is_err(), "a changed byte must fail the checksum");
    }

    #[test]
    fn the_initiate_tag_is_where_the_datapath_reads_it() {
        let p = packet(1, 2, 0, &[init(chunk::INIT, 0xabcd_0123, 1, None)]);
        let off = proxy_common::sctp::INITIATE_TAG_OFF;
        assert_eq!(
            u32::from_be_bytes(p[off..off + 4].try_into().unwrap()),
            0xabcd_0123
        );
        assert_eq!(parse(&p).unwrap().initiate_tag(), Some(0xabcd_0123));
    }
}
