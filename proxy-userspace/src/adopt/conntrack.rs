//! The kernel's connection tracking table through ctnetlink: list it, delete
//! an entry, and insert one with its NAT already decided.
//!
//! Taking a node over from kube-proxy, the flows it translated stay alive only as
//! long as their conntrack entries keep translating; handing the node back,
//! flows our datapath translated need entries written for them so the
//! kernel's NAT carries on where the datapath stopped. This runs at start and
//! at cleanup, never per packet, so it is plain blocking code over one netlink
//! socket per call (async callers go through `spawn_blocking`). Every call
//! works in the calling thread's network namespace, the one its socket is
//! opened in.
//!
//! Only the default conntrack zone is handled, and only entries whose tuples
//! carry ports (TCP, UDP, SCTP, ...); ICMP entries are left out of a dump.

use std::io;
use std::net::IpAddr;

use netlink_packet_core::{
    DefaultNla, Emitable, NLA_F_NESTED, NLA_TYPE_MASK, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP,
    NLM_F_EXCL, NLM_F_REQUEST, NetlinkHeader, NetlinkMessage, NetlinkPayload, Nla, NlasIterator,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoInfo, ProtoInfoTCP, ProtoTuple, Protocol,
    Status, Tuple as CtTuple,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};
use netlink_sys::protocols::NETLINK_NETFILTER;
use netlink_sys::{Socket, SocketAddr};

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_SCTP: u8 = 132;
/// `SCTP_CONNTRACK_*`: netfilter's SCTP states.
pub const SCTP_CONNTRACK_CLOSED: u8 = 1;
pub const SCTP_CONNTRACK_ESTABLISHED: u8 = 4;

// Status bits, include/uapi/linux/netfilter/nf_conntrack_common.h.
pub const IPS_EXPECTED: u32 = 1;
pub const IPS_SEEN_REPLY: u32 = 1 << 1;
pub const IPS_ASSURED: u32 = 1 << 2;
pub const IPS_CONFIRMED: u32 = 1 << 3;
pub const IPS_SRC_NAT: u32 = 1 << 4;
pub const IPS_DST_NAT: u32 = 1 << 5;
pub const IPS_SRC_NAT_DONE: u32 = 1 << 7;
pub const IPS_DST_NAT_DONE: u32 = 1 << 8;
pub const IPS_FIXED_TIMEOUT: u32 = 1 << 10;

/// The status bits ctnetlink lets user space set on create. Everything else
/// is either the kernel's own bookkeeping (CONFIRMED, DYING, ...) or, for the
/// NAT bits, derived from the NAT set up by `CTA_NAT_DST`/`CTA_NAT_SRC`:
/// `__nf_ct_change_status` masks `IPS_UNCHANGEABLE_MASK` out of what it is
/// given.
const SETTABLE_STATUS: u32 = IPS_SEEN_REPLY | IPS_ASSURED | IPS_FIXED_TIMEOUT;

/// `TCP_CONNTRACK_*`, `include/uapi/linux/netfilter/nf_conntrack_tcp.h`.
pub const TCP_CONNTRACK_ESTABLISHED: u8 = 3;
/// The kernel refuses a state at or past this (`nlattr_to_tcp`).
const TCP_CONNTRACK_MAX: u8 = 10;
// `struct nf_ct_tcp_flags` bits, same header.
const IP_CT_TCP_FLAG_SACK_PERM: u8 = 0x02;
const IP_CT_TCP_FLAG_BE_LIBERAL: u8 = 0x08;

// Attribute numbers the crate has no names for,
// include/uapi/linux/netfilter/nfnetlink_conntrack.h.
const CTA_NAT_SRC: u16 = 6;
const CTA_NAT_DST: u16 = 13;
const CTA_NAT_V4_MINIP: u16 = 1;
const CTA_NAT_PROTO: u16 = 3;
const CTA_NAT_V6_MINIP: u16 = 4;
const CTA_PROTONAT_PORT_MIN: u16 = 1;
const CTA_PROTOINFO_TCP_FLAGS_ORIGINAL: u16 = 4;
const CTA_PROTOINFO_TCP_FLAGS_REPLY: u16 = 5;
const CTA_ZONE: u16 = 18;
const CTA_PROTOINFO_SCTP: u16 = 3;
const CTA_PROTOINFO_SCTP_STATE: u16 = 1;
const CTA_PROTOINFO_SCTP_VTAG_ORIGINAL: u16 = 2;
const CTA_PROTOINFO_SCTP_VTAG_REPLY: u16 = 3;

/// Everything that can go wrong talking to ctnetlink, or before: an entry
/// that could not be a conntrack entry is refused here with what is wrong
/// with it, rather than sent for the kernel to answer `EINVAL`.
#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    #[error("invalid conntrack entry: {0}")]
    Invalid(String),
    #[error("opening a netfilter netlink socket: {0}")]
    Socket(#[source] io::Error),
    #[error("{op}: talking to ctnetlink: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{op}: the kernel refused: {source}")]
    Kernel {
        op: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("{op}: ctnetlink's answer did not parse: {reason}")]
    Decode { op: &'static str, reason: String },
}

impl ConntrackError {
    /// The errno the kernel answered with, if it was the kernel that refused.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::Kernel { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn of(addr: IpAddr) -> Self {
        match addr {
            IpAddr::V4(_) => Self::V4,
            IpAddr::V6(_) => Self::V6,
        }
    }

    fn nfproto(self) -> NetfilterProtoFamily {
        match self {
            Self::V4 => NetfilterProtoFamily::IPv4,
            Self::V6 => NetfilterProtoFamily::IPv6,
        }
    }
}

/// One direction of a flow as conntrack keys it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tuple {
    /// `IPPROTO_TCP` or `IPPROTO_UDP` (a dump also yields other protocols
    /// with ports).
    pub proto: u8,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub sport: u16,
    pub dport: u16,
}

impl Tuple {
    /// The tuple of the other direction when nothing is translated.
    pub fn inverted(&self) -> Self {
        Self {
            proto: self.proto,
            src: self.dst,
            dst: self.src,
            sport: self.dport,
            dport: self.sport,
        }
    }

    fn family(&self, name: &str) -> Result<Family, ConntrackError> {
        let family = Family::of(self.src);
        if Family::of(self.dst) != family {
            return Err(ConntrackError::Invalid(format!(
                "{name} tuple mixes address families: source {} and destination {}",
                self.src, self.dst
            )));
        }
        Ok(family)
    }
}

/// A conntrack entry: what `conntrack -L` prints of it that matters for
/// handing a flow over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub orig: Tuple,
    pub reply: Tuple,
    /// `IPS_*` bits.
    pub status: u32,
    /// Seconds left; on create, the seconds the entry lives without traffic.
    pub timeout_s: u32,
    /// `TCP_CONNTRACK_*` for TCP; `None` otherwise. On create, `None` for TCP
    /// means established.
    pub tcp_state: Option<u8>,
    /// An SCTP entry's state and verification tags; `None` otherwise (and
    /// on create, none sent: netfilter then knows no tag, and calls the
    /// association's packets invalid).
    pub sctp: Option<SctpInfo>,
    pub mark: u32,
}

/// What netfilter tracks of an SCTP association (`CTA_PROTOINFO_SCTP`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SctpInfo {
    /// `SCTP_CONNTRACK_*`.
    pub state: u8,
    /// The verification tags the original and the reply direction's packets
    /// carry, as on the wire (read as native words).
    pub vtags_be: [u32; 2],
}

impl SctpInfo {
    /// Its attributes, as nested in `CTA_PROTOINFO`.
    fn nla(&self) -> ProtoInfo {
        let inner = [
            DefaultNla::new(CTA_PROTOINFO_SCTP_STATE, vec![self.state]),
            DefaultNla::new(
                CTA_PROTOINFO_SCTP_VTAG_ORIGINAL,
                self.vtags_be[0].to_ne_bytes().to_vec(),
            ),
            DefaultNla::new(
                CTA_PROTOINFO_SCTP_VTAG_REPLY,
                self.vtags_be[1].to_ne_bytes().to_vec(),
            ),
        ];
        ProtoInfo::Other(DefaultNla::new(
            CTA_PROTOINFO_SCTP | NLA_F_NESTED,
            emitted(&inner),
        ))
    }

    /// The info in a `CTA_PROTOINFO_SCTP` attribute's payload.
    fn parse(payload: &[u8]) -> Option<SctpInfo> {
        let mut info = SctpInfo {
            state: 0,
            vtags_be: [0; 2],
        };
        for nla in NlasIterator::new(payload) {
            let nla = nla.ok()?;
            let value = nla.value();
            let word = || {
                value
                    .get(..4)
                    .map(|b| u32::from_ne_bytes(b.try_into().unwrap()))
            };
            match nla.kind() {
                CTA_PROTOINFO_SCTP_STATE => info.state = *value.first()?,
                CTA_PROTOINFO_SCTP_VTAG_ORIGINAL => info.vtags_be[0] = word()?,
                CTA_PROTOINFO_SCTP_VTAG_REPLY => info.vtags_be[1] = word()?,
                _ => {}
            }
        }
        Some(info)
    }
}

impl Entry {
    /// Whether the flow's destination is translated: replies come from
    /// somewhere other than where the client sent. For an entry read from the
    /// kernel this agrees with `IPS_DST_NAT`, which the kernel sets only when
    /// the tuple changed; it also holds for an entry built to be created.
    pub fn is_dnat(&self) -> bool {
        self.reply.src != self.orig.dst || self.reply.sport != self.orig.dport
    }

    /// Whether the flow's source is translated: replies go to somewhere other
    /// than the client (`IPS_SRC_NAT` for an entry read from the kernel).
    pub fn is_snat(&self) -> bool {
        self.reply.dst != self.orig.src || self.reply.dport != self.orig.sport
    }
}

/// Every entry of `family` in the default zone that has ports (`conntrack -L`).
pub fn dump(family: Family) -> Result<Vec<Entry>, ConntrackError> {
    const OP: &str = "conntrack dump";
    let answers = request(
        family,
        ConntrackMessage::Get(Vec::new()),
        NLM_F_REQUEST | NLM_F_DUMP,
        OP,
    )?;
    Ok(answers
        .iter()
        .filter_map(|attributes| entry_from(attributes))
        .collect())
}

/// Deletes the entry whose original-direction tuple is `orig`; `false` when
/// there was none.
pub fn delete(orig: &Tuple) -> Result<bool, ConntrackError> {
    const OP: &str = "conntrack delete";
    let family = orig.family("original")?;
    let message =
        ConntrackMessage::Delete(vec![ConntrackAttribute::CtaTupleOrig(tuple_nlas(orig))]);
    match request(family, message, NLM_F_REQUEST | NLM_F_ACK, OP) {
        Ok(_) => Ok(true),
        Err(e) if e.errno() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Inserts `entry` (`conntrack -I`); fails with `EEXIST` if an entry for the
/// flow is already there (delete the kernel's own one first).
///
/// What is set and what the kernel derives
/// (`net/netfilter/nf_conntrack_netlink.c`, `ctnetlink_create_conntrack`):
/// - NAT is set up only from `CTA_NAT_DST`/`CTA_NAT_SRC`, which are sent when
///   `entry.reply` says the destination or source is translated; the reply
///   tuple sent is the untranslated one. The kernel computes the real reply
///   tuple itself (`nf_nat_setup_info`, which may pick another port on a
///   clash) and sets `IPS_{DST,SRC}_NAT` and both `_DONE` bits, a null
///   binding standing for the direction not given. A translated reply tuple
///   sent as such would be stored as is with no NAT bit, and `nf_nat_packet`
///   translates only on those bits.
/// - status: `SEEN_REPLY|ASSURED` always (the flow is established and must
///   not be the first evicted), plus `FIXED_TIMEOUT` if asked; the other
///   bits of `entry.status` are the kernel's and are ignored.
/// - TCP: the state (established unless given) and, as the kernel does when
///   it picks a flow up mid-stream, liberal window tracking in both
///   directions, since the window scale of a flow it did not see open is
///   unknown and a strict check would mark its segments invalid.
pub fn create(entry: &Entry) -> Result<(), ConntrackError> {
    const OP: &str = "conntrack create";
    let family = validate(entry)?;
    let mut attributes = vec![
        ConntrackAttribute::CtaTupleOrig(tuple_nlas(&entry.orig)),
        // The untranslated reply: `nf_nat_setup_info` sets the NAT status
        // bits, which are what makes later packets translate
        // (`nf_nat_packet`), only when the tuple it computes differs from the
        // one the reply tuple implies. Sent already translated, the entry
        // would read back right and translate nothing.
        ConntrackAttribute::CtaTupleReply(tuple_nlas(&entry.orig.inverted())),
    ];
    if entry.is_dnat() {
        attributes.push(nat_nla(CTA_NAT_DST, entry.reply.src, entry.reply.sport));
    }
    if entry.is_snat() {
        attributes.push(nat_nla(CTA_NAT_SRC, entry.reply.dst, entry.reply.dport));
    }
    // CONFIRMED is already set on the new entry when ctnetlink applies
    // CTA_STATUS, which refuses any change to it (`-EBUSY`): it has to be
    // sent as it stands.
    let status = (entry.status & SETTABLE_STATUS) | IPS_SEEN_REPLY | IPS_ASSURED | IPS_CONFIRMED;
    attributes.push(ConntrackAttribute::CtaStatus(Status::from_bits_retain(
        status,
    )));
    attributes.push(ConntrackAttribute::CtaTimeout(entry.timeout_s));
    if entry.orig.proto == IPPROTO_TCP {
        let flags = IP_CT_TCP_FLAG_SACK_PERM | IP_CT_TCP_FLAG_BE_LIBERAL;
        attributes.push(ConntrackAttribute::CtaProtoInfo(vec![ProtoInfo::TCP(
            vec![
                ProtoInfoTCP::State(entry.tcp_state.unwrap_or(TCP_CONNTRACK_ESTABLISHED)),
                ProtoInfoTCP::Other(DefaultNla::new(
                    CTA_PROTOINFO_TCP_FLAGS_ORIGINAL,
                    vec![flags, flags],
                )),
                ProtoInfoTCP::Other(DefaultNla::new(
                    CTA_PROTOINFO_TCP_FLAGS_REPLY,
                    vec![flags, flags],
                )),
            ],
        )]));
    }
    if let Some(sctp) = entry.sctp {
        attributes.push(ConntrackAttribute::CtaProtoInfo(vec![sctp.nla()]));
    }
    attributes.push(ConntrackAttribute::CtaMark(entry.mark));
    request(
        family,
        ConntrackMessage::New(attributes),
        NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        OP,
    )?;
    Ok(())
}

fn validate(entry: &Entry) -> Result<Family, ConntrackError> {
    let family = entry.orig.family("original")?;
    let reply_family = entry.reply.family("reply")?;
    if reply_family != family {
        return Err(ConntrackError::Invalid(format!(
            "the original tuple is {family:?} ({} -> {}) but the reply tuple is \
             {reply_family:?} ({} -> {}): a conntrack entry has one address family",
            entry.orig.src, entry.orig.dst, entry.reply.src, entry.reply.dst
        )));
    }
    if entry.orig.proto != entry.reply.proto {
        return Err(ConntrackError::Invalid(format!(
            "the original tuple is protocol {} but the reply tuple is protocol {}",
            entry.orig.proto, entry.reply.proto
        )));
    }
    if !matches!(entry.orig.proto, IPPROTO_TCP | IPPROTO_UDP | IPPROTO_SCTP) {
        return Err(ConntrackError::Invalid(format!(
            "protocol {} is none of TCP ({IPPROTO_TCP}), UDP ({IPPROTO_UDP}), SCTP ({IPPROTO_SCTP})",
            entry.orig.proto
        )));
    }
    if (entry.orig.proto == IPPROTO_SCTP) != entry.sctp.is_some() {
        return Err(ConntrackError::Invalid(format!(
            "protocol {} with{} SCTP state and verification tags: an SCTP entry needs them \
             (netfilter calls packets without their tags invalid), no other has them",
            entry.orig.proto,
            if entry.sctp.is_some() { "" } else { "out" }
        )));
    }
    if entry.timeout_s == 0 {
        return Err(ConntrackError::Invalid(
            "a timeout of 0 s would have the entry expire as it is created".into(),
        ));
    }
    match (entry.orig.proto, entry.tcp_state) {
        (IPPROTO_TCP, Some(state)) if state >= TCP_CONNTRACK_MAX => Err(ConntrackError::Invalid(
            format!("TCP state {state} is not a TCP_CONNTRACK_* state (below {TCP_CONNTRACK_MAX})"),
        )),
        (IPPROTO_UDP | IPPROTO_SCTP, Some(state)) => Err(ConntrackError::Invalid(format!(
            "a UDP or SCTP entry has no TCP state, {state} given"
        ))),
        _ => Ok(family),
    }
}

fn tuple_nlas(tuple: &Tuple) -> Vec<CtTuple> {
    vec![
        CtTuple::Ip(vec![
            IPTuple::SourceAddress(tuple.src),
            IPTuple::DestinationAddress(tuple.dst),
        ]),
        CtTuple::Proto(vec![
            ProtoTuple::Protocol(Protocol::from(tuple.proto)),
            ProtoTuple::SourcePort(tuple.sport),
            ProtoTuple::DestinationPort(tuple.dport),
        ]),
    ]
}

/// `CTA_NAT_{DST,SRC}` mapping to exactly `addr`:`port`
/// (`nfnetlink_parse_nat_setup`: the maximum defaults to the minimum).
fn nat_nla(kind: u16, addr: IpAddr, port: u16) -> ConntrackAttribute {
    let (ip_kind, ip) = match addr {
        IpAddr::V4(a) => (CTA_NAT_V4_MINIP, a.octets().to_vec()),
        IpAddr::V6(a) => (CTA_NAT_V6_MINIP, a.octets().to_vec()),
    };
    let proto = DefaultNla::new(
        CTA_NAT_PROTO | NLA_F_NESTED,
        emitted(&[DefaultNla::new(
            CTA_PROTONAT_PORT_MIN,
            port.to_be_bytes().to_vec(),
        )]),
    );
    ConntrackAttribute::Other(DefaultNla::new(
        kind | NLA_F_NESTED,
        emitted(&[DefaultNla::new(ip_kind, ip), proto]),
    ))
}

fn emitted(nlas: &[DefaultNla]) -> Vec<u8> {
    let mut buf = vec![0; nlas.buffer_len()];
    nlas.emit(&mut buf);
    buf
}

fn entry_from(attributes: &[ConntrackAttribute]) -> Option<Entry> {
    let mut orig = None;
    let mut reply = None;
    let mut status = 0;
    let mut timeout_s = 0;
    let mut tcp_state = None;
    let mut sctp = None;
    let mut mark = 0;
    for attribute in attributes {
        match attribute {
            ConntrackAttribute::CtaTupleOrig(nlas) => orig = tuple_from(nlas),
            ConntrackAttribute::CtaTupleReply(nlas) => reply = tuple_from(nlas),
            ConntrackAttribute::CtaStatus(s) => status = s.bits(),
            ConntrackAttribute::CtaTimeout(t) => timeout_s = *t,
            ConntrackAttribute::Other(nla) if outside_default_zone(nla) => return None,
            ConntrackAttribute::CtaMark(m) => mark = *m,
            ConntrackAttribute::CtaProtoInfo(infos) => {
                for info in infos {
                    match info {
                        ProtoInfo::TCP(tcp) => {
                            for nla in tcp {
                                if let ProtoInfoTCP::State(state) = nla {
                                    tcp_state = Some(*state);
                                }
                            }
                        }
                        ProtoInfo::Other(nla)
                            if nla.kind() & !NLA_F_NESTED == CTA_PROTOINFO_SCTP =>
                        {
                            let mut payload = vec![0; nla.value_len()];
                            nla.emit_value(&mut payload);
                            sctp = SctpInfo::parse(&payload);
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some(Entry {
        orig: orig?,
        reply: reply?,
        status,
        timeout_s,
        tcp_state,
        sctp,
        mark,
    })
}

/// Only an entry outside the default zone carries `CTA_ZONE`
/// (`ctnetlink_dump_zone_id`); delete and create could not reach it, so a
/// dump does not report it as if they could.
fn outside_default_zone(nla: &DefaultNla) -> bool {
    if nla.kind() & NLA_TYPE_MASK != CTA_ZONE || nla.value_len() != 2 {
        return false;
    }
    let mut zone = [0u8; 2];
    nla.emit_value(&mut zone);
    zone != [0, 0]
}

/// A tuple with both addresses and both ports; `None` for one without ports
/// (ICMP's id/type/code).
fn tuple_from(nlas: &[CtTuple]) -> Option<Tuple> {
    let (mut src, mut dst, mut proto, mut sport, mut dport) = (None, None, None, None, None);
    for nla in nlas {
        match nla {
            CtTuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => src = Some(*a),
                        IPTuple::DestinationAddress(a) => dst = Some(*a),
                        _ => {}
                    }
                }
            }
            CtTuple::Proto(protos) => {
                for p in protos {
                    match p {
                        ProtoTuple::Protocol(n) => proto = Some(u8::from(*n)),
                        ProtoTuple::SourcePort(port) => sport = Some(*port),
                        ProtoTuple::DestinationPort(port) => dport = Some(*port),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some(Tuple {
        proto: proto?,
        src: src?,
        dst: dst?,
        sport: sport?,
        dport: dport?,
    })
}

/// Sends one ctnetlink request on a socket of its own and collects the
/// attributes of every conntrack message in the answer, up to the
/// acknowledgement (`NLM_F_ACK`) or the end of the dump.
fn request(
    family: Family,
    message: ConntrackMessage,
    flags: u16,
    op: &'static str,
) -> Result<Vec<Vec<ConntrackAttribute>>, ConntrackError> {
    const SEQ: u32 = 1;
    let io_err = |source| ConntrackError::Io { op, source };
    let mut socket = Socket::new(NETLINK_NETFILTER).map_err(ConntrackError::Socket)?;
    socket.bind_auto().map_err(ConntrackError::Socket)?;
    socket
        .connect(&SocketAddr::new(0, 0))
        .map_err(ConntrackError::Socket)?;

    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = SEQ;
    let mut packet = NetlinkMessage::new(
        header,
        NetlinkPayload::from(NetfilterMessage::new(
            NetfilterHeader::new(family.nfproto(), 0, 0),
            message,
        )),
    );
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf);
    socket.send(&buf, 0).map_err(io_err)?;

    let mut answers = Vec::new();
    loop {
        let (datagram, _) = socket.recv_from_full().map_err(io_err)?;
        let mut rest = &datagram[..];
        while !rest.is_empty() {
            let parsed = NetlinkMessage::<NetfilterMessage>::deserialize(rest).map_err(|e| {
                ConntrackError::Decode {
                    op,
                    reason: e.to_string(),
                }
            })?;
            let len = parsed.header.length as usize;
            // A length that does not move forward would loop for ever on a
            // corrupt answer.
            if len == 0 || len > rest.len() {
                return Err(ConntrackError::Decode {
                    op,
                    reason: format!("message length {len} in {} bytes", rest.len()),
                });
            }
            rest = &rest[len.next_multiple_of(4).min(rest.len())..];
            if parsed.header.sequence_number != SEQ {
                continue;
            }
            match parsed.payload {
                NetlinkPayload::Done(done) => {
                    return if done.code == 0 {
                        Ok(answers)
                    } else {
                        Err(ConntrackError::Kernel {
                            op,
                            source: io::Error::from_raw_os_error(-done.code),
                        })
                    };
                }
                NetlinkPayload::Error(error) => {
                    return match error.code {
                        None => Ok(answers),
                        Some(code) => Err(ConntrackError::Kernel {
                            op,
                            source: io::Error::from_raw_os_error(-code.get()),
                        }),
                    };
                }
                NetlinkPayload::InnerMessage(NetfilterMessage {
                    inner: NetfilterMessageInner::Conntrack(ConntrackMessage::New(attributes)),
                    ..
                }) => answers.push(attributes),
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr as InetAddr, UdpSocket};
    use std::process::Command;
    use std::time::Duration;

    /// Runs `f` on a thread of its own in a fresh network namespace with `lo`
    /// up; the namespace goes away with the thread.
    fn in_netns<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let euid = unsafe { libc::geteuid() };
        assert_eq!(
            euid, 0,
            "adopt::conntrack tests must run as root: they create network namespaces and \
             conntrack entries"
        );
        std::thread::spawn(move || {
            // SAFETY: unshare takes no pointers; network namespaces are per
            // thread, so only this thread (and what it spawns) moves.
            let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
            assert_eq!(
                rc,
                0,
                "unshare(CLONE_NEWNET): {}",
                io::Error::last_os_error()
            );
            run("ip", &["link", "set", "lo", "up"]);
            f()
        })
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    }

    /// Runs a command in the calling thread's network namespace.
    fn run(program: &str, args: &[&str]) {
        let out = Command::new(program)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{program} {args:?}: {e}"));
        assert!(
            out.status.success(),
            "{program} {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A namespace tracks connections only while something asks for it (a
    /// `ct` match, a NAT rule), and translates by its entries only while
    /// some nat chain is registered: a `ct` match in a filter chain and an
    /// empty nat chain, no NAT rule anywhere.
    fn conntrack_and_nat_chain(family: &str) {
        nft(&format!(
            "add table {family} t; \
             add chain {family} t post {{ type nat hook postrouting priority 100; }}; \
             add chain {family} t out {{ type filter hook output priority 0; }}; \
             add rule {family} t out ct state new,established counter"
        ));
    }

    /// Runs one nft script (commands separated by `;`).
    fn nft(script: &str) {
        run("nft", &[script]);
    }

    fn tuple(proto: u8, src: &str, sport: u16, dst: &str, dport: u16) -> Tuple {
        Tuple {
            proto,
            src: src.parse().unwrap(),
            dst: dst.parse().unwrap(),
            sport,
            dport,
        }
    }

    fn find(family: Family, orig: &Tuple) -> Option<Entry> {
        dump(family).unwrap().into_iter().find(|e| e.orig == *orig)
    }

    /// The `BE_LIBERAL` bit of both directions' TCP flags of the entry
    /// whose original tuple is `orig`.
    fn tcp_flags(family: Family, orig: &Tuple) -> [u8; 2] {
        let answers = request(
            family,
            ConntrackMessage::Get(Vec::new()),
            NLM_F_REQUEST | NLM_F_DUMP,
            "test dump",
        )
        .unwrap();
        let attributes = answers
            .iter()
            .find(|a| entry_from(a).is_some_and(|e| e.orig == *orig))
            .expect("entry");
        let mut flags = [0; 2];
        for attribute in attributes {
            if let ConntrackAttribute::CtaProtoInfo(infos) = attribute {
                for info in infos {
                    if let ProtoInfo::TCP(nlas) = info {
                        for nla in nlas {
                            match nla {
                                ProtoInfoTCP::OriginalFlags(f) => flags[0] = f.flags,
                                ProtoInfoTCP::ReplyFlags(f) => flags[1] = f.flags,
                                _ => {}
                            }
                        }
                    }
                }
            }
        }
        flags.map(|f| f & IP_CT_TCP_FLAG_BE_LIBERAL)
    }

    /// Creates a translated entry, finds it in a dump as the kernel made it,
    /// deletes it, and deletes it again.
    fn create_dump_delete(family: Family, orig: Tuple, reply: Tuple) {
        in_netns(move || {
            let entry = Entry {
                orig,
                reply,
                status: 0,
                timeout_s: 120,
                tcp_state: None,
                sctp: None,
                mark: 7,
            };
            create(&entry).unwrap();
            let got = find(family, &orig).expect("created entry in the dump");
            assert_eq!(got.reply, reply, "{got:?}");
            let must = IPS_CONFIRMED
                | IPS_SEEN_REPLY
                | IPS_ASSURED
                | IPS_DST_NAT
                | IPS_DST_NAT_DONE
                | IPS_SRC_NAT_DONE;
            assert_eq!(got.status & must, must, "status {:#x}", got.status);
            assert_eq!(
                got.status & IPS_SRC_NAT != 0,
                entry.is_snat(),
                "status {:#x}",
                got.status
            );
            assert!(got.is_dnat());
            assert_eq!(got.is_snat(), entry.is_snat());
            let expected_state = (orig.proto == IPPROTO_TCP).then_some(TCP_CONNTRACK_ESTABLISHED);
            assert_eq!(got.tcp_state, expected_state);
            assert!(
                (100..=120).contains(&got.timeout_s),
                "timeout {}",
                got.timeout_s
            );
            assert_eq!(got.mark, 7);
            if orig.proto == IPPROTO_TCP {
                assert_eq!(tcp_flags(family, &orig), [IP_CT_TCP_FLAG_BE_LIBERAL; 2]);
            }

            assert!(delete(&orig).unwrap());
            assert_eq!(find(family, &orig), None);
            assert!(!delete(&orig).unwrap());
        });
    }

    /// An SCTP association handed to netfilter keeps its state and both
    /// verification tags: without them netfilter would call its packets
    /// invalid.
    #[test]
    fn sctp_entry_round_trips_with_its_verification_tags() {
        for (family, orig, reply) in [
            (
                Family::V4,
                tuple(IPPROTO_SCTP, "127.0.0.1", 40000, "10.96.0.10", 3868),
                tuple(IPPROTO_SCTP, "10.244.1.5", 3869, "127.0.0.1", 40000),
            ),
            (
                Family::V6,
                tuple(IPPROTO_SCTP, "::1", 40000, "fd00:96::10", 3868),
                tuple(IPPROTO_SCTP, "fd00:244::5", 3869, "::1", 40000),
            ),
        ] {
            in_netns(move || {
                let sctp = SctpInfo {
                    state: SCTP_CONNTRACK_ESTABLISHED,
                    vtags_be: [0x1122_3344u32.to_be(), 0xa1b2_c3d4u32.to_be()],
                };
                let entry = Entry {
                    orig,
                    reply,
                    status: 0,
                    timeout_s: 210,
                    tcp_state: None,
                    sctp: Some(sctp),
                    mark: 0,
                };
                create(&entry).unwrap();
                let got = find(family, &orig).expect("created SCTP entry in the dump");
                assert_eq!(got.reply, reply, "{got:?}");
                assert_eq!(got.sctp, Some(sctp), "state and tags as written: {got:?}");
                assert!(delete(&orig).unwrap());
            });
        }
    }

    #[test]
    fn tcp4_dnat_entry_round_trips() {
        create_dump_delete(
            Family::V4,
            tuple(IPPROTO_TCP, "127.0.0.1", 40000, "10.96.0.10", 80),
            tuple(IPPROTO_TCP, "10.244.1.5", 8080, "127.0.0.1", 40000),
        );
    }

    #[test]
    fn tcp4_dnat_snat_entry_round_trips() {
        create_dump_delete(
            Family::V4,
            tuple(IPPROTO_TCP, "127.0.0.1", 40000, "10.96.0.10", 80),
            tuple(IPPROTO_TCP, "10.244.1.5", 8080, "192.168.0.1", 61000),
        );
    }

    #[test]
    fn udp4_dnat_entry_round_trips() {
        create_dump_delete(
            Family::V4,
            tuple(IPPROTO_UDP, "127.0.0.1", 40000, "10.96.0.10", 53),
            tuple(IPPROTO_UDP, "10.244.1.5", 5353, "127.0.0.1", 40000),
        );
    }

    #[test]
    fn tcp6_dnat_entry_round_trips() {
        create_dump_delete(
            Family::V6,
            tuple(IPPROTO_TCP, "fd00::1", 40000, "fd00:96::10", 80),
            tuple(IPPROTO_TCP, "fd00:244::5", 8080, "fd00::1", 40000),
        );
    }

    #[test]
    fn udp6_dnat_snat_entry_round_trips() {
        create_dump_delete(
            Family::V6,
            tuple(IPPROTO_UDP, "fd00::1", 40000, "fd00:96::10", 53),
            tuple(IPPROTO_UDP, "fd00:244::5", 5353, "fd00::2", 61000),
        );
    }

    /// A datagram to an address no interface has reaches the backend (on
    /// another port) only through a created entry, with no NAT rule anywhere,
    /// and the answer comes back from the frontend.
    fn created_entry_translates(
        family: Family,
        setup: &'static [&'static [&'static str]],
        client: &'static str,
        frontend: &'static str,
        backend: &'static str,
    ) {
        in_netns(move || {
            for args in setup {
                run("ip", args);
            }
            conntrack_and_nat_chain(match family {
                Family::V4 => "ip",
                Family::V6 => "ip6",
            });
            let (client, frontend, backend): (InetAddr, InetAddr, InetAddr) = (
                client.parse().unwrap(),
                frontend.parse().unwrap(),
                backend.parse().unwrap(),
            );
            let server = UdpSocket::bind(backend).unwrap();
            server
                .set_read_timeout(Some(Duration::from_millis(300)))
                .unwrap();
            let sender = UdpSocket::bind(client).unwrap();
            sender
                .set_read_timeout(Some(Duration::from_secs(2)))
                .unwrap();
            let mut buf = [0u8; 64];

            // Without an entry the datagram goes nowhere, and leaves the
            // kernel's untranslated entry behind, as kube-proxy's flows would.
            sender.send_to(b"before", frontend).unwrap();
            assert!(
                server.recv_from(&mut buf).is_err(),
                "reached the backend untranslated"
            );
            let orig = Tuple {
                proto: IPPROTO_UDP,
                src: client.ip(),
                dst: frontend.ip(),
                sport: client.port(),
                dport: frontend.port(),
            };
            let untranslated = find(family, &orig).expect("the kernel's own entry");
            assert!(!untranslated.is_dnat(), "{untranslated:?}");
            assert!(delete(&orig).unwrap());

            create(&Entry {
                orig,
                reply: Tuple {
                    src: backend.ip(),
                    sport: backend.port(),
                    ..orig.inverted()
                },
                status: 0,
                timeout_s: 60,
                tcp_state: None,
                sctp: None,
                mark: 0,
            })
            .unwrap();

            sender.send_to(b"ping", frontend).unwrap();
            let (n, from) = server.recv_from(&mut buf).expect("translated datagram");
            assert_eq!(&buf[..n], b"ping");
            assert_eq!(from, client);
            server.send_to(b"pong", from).unwrap();
            let (n, from) = sender.recv_from(&mut buf).expect("answer");
            assert_eq!(&buf[..n], b"pong");
            assert_eq!(from, frontend, "the answer must come from the frontend");
        });
    }

    #[test]
    fn created_entry_translates_packets4() {
        created_entry_translates(
            Family::V4,
            &[&["route", "add", "10.96.0.0/24", "dev", "lo"]],
            "127.0.0.1:40000",
            "10.96.0.10:53",
            "127.0.0.2:5353",
        );
    }

    #[test]
    fn created_entry_translates_packets6() {
        created_entry_translates(
            Family::V6,
            // IPv6 turns a route through lo into a reject route: the
            // frontend prefix goes out a veth instead (the kernel here may
            // have no dummy devices).
            &[
                &["-6", "addr", "add", "fd00::1/128", "dev", "lo", "nodad"],
                &["-6", "addr", "add", "fd00::2/128", "dev", "lo", "nodad"],
                &["link", "add", "d0", "type", "veth", "peer", "name", "d1"],
                &["link", "set", "d0", "up"],
                &["link", "set", "d1", "up"],
                &["-6", "route", "add", "fd00:96::/64", "dev", "d0"],
            ],
            "[fd00::1]:40000",
            "[fd00:96::10]:53",
            "[fd00::2]:5353",
        );
    }

    /// The hand-over itself, for an open TCP connection: its entry, made by
    /// a DNAT rule, is read, the rule removed, the entry deleted and created
    /// again from what was read; the connection carries data both ways
    /// afterwards, translated by the created entry alone.
    #[test]
    fn recreated_tcp_entry_keeps_connection() {
        use std::io::{Read, Write};
        in_netns(|| {
            // Without a source on the route, lo's host-scoped 127.0.0.1 is
            // no candidate and the connection runs from 0.0.0.0, which a
            // created entry does not carry through.
            run("ip", &["addr", "add", "10.0.0.1/32", "dev", "lo"]);
            run("ip", &["addr", "add", "10.244.0.5/32", "dev", "lo"]);
            run(
                "ip",
                &[
                    "route",
                    "add",
                    "10.96.0.0/24",
                    "dev",
                    "lo",
                    "src",
                    "10.0.0.1",
                ],
            );
            conntrack_and_nat_chain("ip");
            nft(
                "add chain ip t svc { type nat hook output priority -100; }; \
                 add rule ip t svc ip daddr 10.96.0.10 tcp dport 80 dnat to 10.244.0.5:8080",
            );
            let listener = std::net::TcpListener::bind("10.244.0.5:8080").unwrap();
            let mut client = std::net::TcpStream::connect_timeout(
                &"10.96.0.10:80".parse().unwrap(),
                Duration::from_secs(2),
            )
            .unwrap();
            let (mut server, _) = listener.accept().unwrap();
            for stream in [&client, &server] {
                stream
                    .set_read_timeout(Some(Duration::from_secs(3)))
                    .unwrap();
            }
            let mut buf = [0u8; 5];
            client.write_all(b"first").unwrap();
            server.read_exact(&mut buf).unwrap();

            let local = client.local_addr().unwrap();
            let orig = Tuple {
                proto: IPPROTO_TCP,
                src: local.ip(),
                dst: "10.96.0.10".parse().unwrap(),
                sport: local.port(),
                dport: 80,
            };
            let entry = find(Family::V4, &orig).expect("the rule's entry");
            assert!(entry.is_dnat(), "{entry:?}");
            nft("flush chain ip t svc");
            assert!(delete(&orig).unwrap());
            create(&entry).unwrap();
            assert_eq!(find(Family::V4, &orig).map(|e| e.reply), Some(entry.reply));

            client.write_all(b"again").unwrap();
            server
                .read_exact(&mut buf)
                .expect("data after the hand-over");
            assert_eq!(&buf, b"again");
            server.write_all(b"reply").unwrap();
            client
                .read_exact(&mut buf)
                .expect("answer after the hand-over");
            assert_eq!(&buf, b"reply");
        });
    }

    /// Entries the kernel made for traffic through an nft DNAT rule read back
    /// as DNATed, with the backend in the reply tuple.
    #[test]
    fn dump_shows_rule_dnat() {
        in_netns(|| {
            run(
                "ip",
                &[
                    "route",
                    "add",
                    "10.96.0.0/24",
                    "dev",
                    "lo",
                    "src",
                    "127.0.0.1",
                ],
            );
            nft("add table ip t; \
                 add chain ip t out { type nat hook output priority -100; }; \
                 add rule ip t out ip daddr 10.96.0.10 udp dport 53 dnat to 127.0.0.2:5353; \
                 add rule ip t out ip daddr 10.96.0.10 tcp dport 80 dnat to 127.0.0.2:8080");

            let server = UdpSocket::bind("127.0.0.2:5353").unwrap();
            server
                .set_read_timeout(Some(Duration::from_secs(2)))
                .unwrap();
            let client = UdpSocket::bind("127.0.0.1:40001").unwrap();
            client.send_to(b"q", "10.96.0.10:53").unwrap();
            let mut buf = [0u8; 8];
            server
                .recv_from(&mut buf)
                .expect("datagram through the rule");

            let listener = std::net::TcpListener::bind("127.0.0.2:8080").unwrap();
            let stream = std::net::TcpStream::connect_timeout(
                &"10.96.0.10:80".parse().unwrap(),
                Duration::from_secs(2),
            )
            .unwrap();
            let _accepted = listener.accept().unwrap();
            let local = stream.local_addr().unwrap();

            let udp = find(
                Family::V4,
                &tuple(IPPROTO_UDP, "127.0.0.1", 40001, "10.96.0.10", 53),
            )
            .expect("UDP entry");
            assert!(udp.is_dnat() && !udp.is_snat(), "{udp:?}");
            assert_ne!(udp.status & IPS_DST_NAT, 0, "{udp:?}");
            assert_eq!(
                udp.reply,
                tuple(IPPROTO_UDP, "127.0.0.2", 5353, "127.0.0.1", 40001)
            );

            let tcp_orig = Tuple {
                proto: IPPROTO_TCP,
                src: local.ip(),
                dst: IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10)),
                sport: local.port(),
                dport: 80,
            };
            let tcp = find(Family::V4, &tcp_orig).expect("TCP entry");
            assert!(tcp.is_dnat(), "{tcp:?}");
            assert_ne!(tcp.status & IPS_DST_NAT, 0, "{tcp:?}");
            assert_eq!(tcp.tcp_state, Some(TCP_CONNTRACK_ESTABLISHED));
            assert_eq!(
                tcp.reply,
                Tuple {
                    src: "127.0.0.2".parse().unwrap(),
                    sport: 8080,
                    ..tcp_orig.inverted()
                }
            );
        });
    }

    /// A DNAT entry of a TCP connection that ctnetlink takes.
    fn valid_tcp_entry() -> Entry {
        Entry {
            orig: tuple(IPPROTO_TCP, "127.0.0.1", 40000, "10.96.0.10", 80),
            reply: tuple(IPPROTO_TCP, "10.244.1.5", 8080, "127.0.0.1", 40000),
            status: 0,
            timeout_s: 60,
            tcp_state: None,
            sctp: None,
            mark: 0,
        }
    }

    /// An SCTP entry without its state and tags, and a TCP one with
    /// them, are refused before ctnetlink sees them.
    #[test]
    fn sctp_state_goes_with_sctp_alone() {
        let tcp = valid_tcp_entry();
        let sctp = |t: Tuple| Tuple {
            proto: IPPROTO_SCTP,
            ..t
        };
        for (entry, needle) in [
            (
                Entry {
                    orig: sctp(tcp.orig),
                    reply: sctp(tcp.reply),
                    ..tcp.clone()
                },
                "without SCTP state",
            ),
            (
                Entry {
                    sctp: Some(SctpInfo {
                        state: SCTP_CONNTRACK_ESTABLISHED,
                        vtags_be: [1, 2],
                    }),
                    ..tcp.clone()
                },
                "with SCTP state",
            ),
        ] {
            let err = validate(&entry).expect_err(needle);
            assert!(err.to_string().contains(needle), "{err} lacks {needle:?}");
        }
    }

    /// Entries that cannot be conntrack entries are refused with what is
    /// wrong, before anything reaches the kernel; what the kernel refuses
    /// comes back as its errno.
    #[test]
    fn hostile_entries_are_refused() {
        in_netns(|| {
            let good = valid_tcp_entry();
            let refused = |entry: Entry, needle: &str| {
                let err = create(&entry).expect_err(needle);
                assert!(matches!(err, ConntrackError::Invalid(_)), "{err:?}");
                assert!(err.to_string().contains(needle), "{err} lacks {needle:?}");
            };
            let v6: IpAddr = IpAddr::V6(Ipv6Addr::LOCALHOST);
            refused(
                Entry {
                    reply: Tuple {
                        src: v6,
                        dst: v6,
                        ..good.reply
                    },
                    ..good.clone()
                },
                "one address family",
            );
            refused(
                Entry {
                    orig: Tuple {
                        dst: v6,
                        ..good.orig
                    },
                    ..good.clone()
                },
                "mixes address families",
            );
            refused(
                Entry {
                    orig: Tuple {
                        proto: 1,
                        ..good.orig
                    },
                    reply: Tuple {
                        proto: 1,
                        ..good.reply
                    },
                    ..good.clone()
                },
                "none of TCP",
            );

            refused(
                Entry {
                    reply: Tuple {
                        proto: IPPROTO_UDP,
                        ..good.reply
                    },
                    ..good.clone()
                },
                "protocol 17",
            );
            refused(
                Entry {
                    timeout_s: 0,
                    ..good.clone()
                },
                "timeout of 0",
            );
            refused(
                Entry {
                    tcp_state: Some(200),
                    ..good.clone()
                },
                "TCP state 200",
            );
            let err = delete(&Tuple {
                dst: v6,
                ..good.orig
            })
            .unwrap_err();
            assert!(err.to_string().contains("mixes address families"), "{err}");

            create(&good).unwrap();
            let err = create(&good).unwrap_err();
            assert_eq!(err.errno(), Some(libc::EEXIST), "{err:?}");
        });
    }

    fn attributes(orig: &Tuple, reply: &Tuple) -> Vec<ConntrackAttribute> {
        vec![
            ConntrackAttribute::CtaTupleOrig(tuple_nlas(orig)),
            ConntrackAttribute::CtaTupleReply(tuple_nlas(reply)),
            ConntrackAttribute::CtaStatus(Status::from_bits_retain(IPS_CONFIRMED)),
            ConntrackAttribute::CtaTimeout(30),
        ]
    }

    /// What a dump cannot stand for is left out of it instead of failing it
    /// or coming out half-filled: tuples without ports (ICMP), entries
    /// outside the default zone, entries missing a direction.
    #[test]
    fn entries_a_dump_leaves_out() {
        let orig = tuple(IPPROTO_UDP, "10.0.0.1", 1000, "10.0.0.2", 53);
        let udp = attributes(&orig, &orig.inverted());
        assert_eq!(
            entry_from(&udp),
            Some(Entry {
                orig,
                reply: orig.inverted(),
                status: IPS_CONFIRMED,
                timeout_s: 30,
                tcp_state: None,
                sctp: None,
                mark: 0,
            })
        );

        let icmp_tuple = vec![
            CtTuple::Ip(vec![
                IPTuple::SourceAddress(orig.src),
                IPTuple::DestinationAddress(orig.dst),
            ]),
            CtTuple::Proto(vec![
                ProtoTuple::Protocol(Protocol::Icmp),
                ProtoTuple::Other(DefaultNla::new(4, 7u16.to_be_bytes().to_vec())),
            ]),
        ];
        let icmp = vec![
            ConntrackAttribute::CtaTupleOrig(icmp_tuple.clone()),
            ConntrackAttribute::CtaTupleReply(icmp_tuple),
        ];
        assert_eq!(entry_from(&icmp), None);

        let mut zoned = udp.clone();
        zoned.push(ConntrackAttribute::Other(DefaultNla::new(
            CTA_ZONE,
            3u16.to_be_bytes().to_vec(),
        )));
        assert_eq!(entry_from(&zoned), None);
        let mut zone0 = udp.clone();
        zone0.push(ConntrackAttribute::Other(DefaultNla::new(
            CTA_ZONE,
            vec![0, 0],
        )));
        assert!(entry_from(&zone0).is_some());

        assert_eq!(entry_from(&udp[1..]), None);
    }
}
