//! `ebpf-proxy status --flows`: the translated flows in conntrack, one line
//! each, as `conntrack -L` lists kube-proxy's. A flow is listed once, by its
//! forward entry (client to frontend, and the backend it was sent to); its
//! reply entry says the same backwards. Addresses print as sockets do,
//! `a.b.c.d:port` and `[v6]:port`, where `bpftool map dump` shows IPv6
//! addresses as four numbers (docs/operations.md, "Reading the maps").

use std::{
    collections::HashMap,
    fmt,
    net::{IpAddr, Ipv4Addr, SocketAddr},
};

use aya::maps::IterableMap;
use proxy_common::{Ct6Key, Ct6Value, CtKey, CtValue, PROTO_SCTP, ct_dir, ct_flags, map_names};

use crate::{
    datapath::{
        Maps, batch,
        maps::{MapsError, batch_error},
    },
    planner::encode,
};

/// One translated flow, as its forward conntrack entry holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Flow {
    pub proto: u8,
    pub client: SocketAddr,
    pub frontend: SocketAddr,
    pub backend: SocketAddr,
    /// The source the backend sees in the client's place (SNAT to the
    /// node, or the hairpin address), when it is not the client.
    pub source: Option<SocketAddr>,
    /// `ct_flags`.
    pub flags: u8,
    /// Of an SCTP flow, the verification tags its client's and its
    /// backend's packets carry, as on the wire (0: not known); 0 for other
    /// protocols.
    pub vtags_be: [u32; 2],
}

impl Flow {
    /// The flow of a forward entry of `CONNTRACK` or `CT_NEW`; None for a
    /// reply entry.
    pub fn of_v4(key: &CtKey, value: &CtValue) -> Option<Flow> {
        (value.dir == ct_dir::FORWARD).then(|| Flow {
            proto: key.proto,
            client: socket_v4(key.src_be, key.sport_be),
            frontend: socket_v4(key.dst_be, key.dport_be),
            backend: socket_v4(value.nat_addr_be, value.nat_port_be),
            source: (value.flags & ct_flags::TWO_SIDED != 0)
                .then(|| socket_v4(value.alt_addr_be, value.alt_port_be)),
            flags: value.flags,
            vtags_be: [sctp_tag(key.proto, value.tcp_max_ack), 0],
        })
    }

    /// The flow as JSON: sockets as text (`[v6]:port`), its protocol by
    /// name, and its flags as the text shows them.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "protocol": encode::protocol_from_number(self.proto)
                .map_or_else(|| self.proto.to_string(), |p| p.to_string()),
            "client": self.client.to_string(),
            "frontend": self.frontend.to_string(),
            "backend": self.backend.to_string(),
            "source": self.source.map(|s| s.to_string()),
            "flags": FLAG_NAMES
                .iter()
                .filter(|(flag, _)| self.flags & flag != 0)
                .map(|(_, name)| *name)
                .collect::<Vec<_>>(),
        })
    }

    /// The flow of a forward entry of `CONNTRACK6`; None for a reply entry.
    pub fn of_v6(key: &Ct6Key, value: &Ct6Value) -> Option<Flow> {
        (value.dir == ct_dir::FORWARD).then(|| Flow {
            proto: key.proto,
            client: socket_v6(&key.src_be, key.sport_be),
            frontend: socket_v6(&key.dst_be, key.dport_be),
            backend: socket_v6(&value.nat_addr_be, value.nat_port_be),
            source: (value.flags & ct_flags::TWO_SIDED != 0)
                .then(|| socket_v6(&value.alt_addr_be, value.alt_port_be)),
            flags: value.flags,
            vtags_be: [sctp_tag(key.proto, value.tcp_max_ack), 0],
        })
    }
}

/// A socket address of an IPv4 conntrack key or entry (network order).
fn socket_v4(addr_be: u32, port_be: u16) -> SocketAddr {
    SocketAddr::new(
        IpAddr::V4(Ipv4Addr::from(addr_be.to_ne_bytes())),
        u16::from_be(port_be),
    )
}

/// A socket address of an IPv6 conntrack key or entry (network order).
fn socket_v6(addr_be: &[u32; 4], port_be: u16) -> SocketAddr {
    SocketAddr::new(encode::words_addr(addr_be), u16::from_be(port_be))
}

/// An entry's verification tag, where it holds one (an SCTP flow's).
fn sctp_tag(proto: u8, word: u32) -> u32 {
    if proto == PROTO_SCTP { word } else { 0 }
}

/// The SCTP reply entries' tags, by the reply's own socket pair (from the
/// backend, to what it sees as the client).
type ReplyTags = HashMap<(SocketAddr, SocketAddr), u32>;

/// Notes `key`'s entry's tag in `tags` when it is an SCTP reply entry.
fn note_reply_tag(
    tags: &mut ReplyTags,
    proto: u8,
    dir: u8,
    src: SocketAddr,
    dst: SocketAddr,
    tag: u32,
) {
    if proto == PROTO_SCTP && dir == ct_dir::REPLY {
        tags.insert((src, dst), tag);
    }
}

/// Fills in each SCTP flow's reply tag from its reply entry's.
fn with_reply_tags(flows: &mut [Flow], tags: &ReplyTags) {
    for flow in flows.iter_mut().filter(|f| f.proto == PROTO_SCTP) {
        let seen_by_backend = flow.source.unwrap_or(flow.client);
        if let Some(tag) = tags.get(&(flow.backend, seen_by_backend)) {
            flow.vtags_be[1] = *tag;
        }
    }
}

/// `ct_flags` bits by the names the report gives them.
const FLAG_NAMES: [(u8, &str); 7] = [
    (ct_flags::ASSURED, "assured"),
    (ct_flags::SEEN_REPLY, "replied"),
    (ct_flags::FIN_FORWARD, "client-fin"),
    (ct_flags::FIN_REPLY, "backend-fin"),
    (ct_flags::CLOSING, "closed"),
    (ct_flags::HAIRPIN, "hairpin"),
    (ct_flags::SNAT, "snat"),
];

/// `TCP 10.0.0.2:40000 -> 10.96.0.10:80 => 10.200.0.11:8080 assured`, and
/// `as <source>` after the backend when the backend sees another source.
impl fmt::Display for Flow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match encode::protocol_from_number(self.proto) {
            Some(proto) => write!(f, "{proto} ")?,
            None => write!(f, "proto {} ", self.proto)?,
        }
        write!(
            f,
            "{} -> {} => {}",
            self.client, self.frontend, self.backend
        )?;
        if let Some(source) = self.source {
            write!(f, " as {source}")?;
        }
        for (flag, name) in FLAG_NAMES {
            if self.flags & flag != 0 {
                write!(f, " {name}")?;
            }
        }
        Ok(())
    }
}

/// Every translated flow in the pinned conntrack maps, IPv4 (`CONNTRACK`
/// and `CT_NEW`) then IPv6 (`CONNTRACK6` and `CT_NEW6`), each sorted.
pub fn read(maps: &Maps) -> Result<Vec<Flow>, MapsError> {
    let mut tags = ReplyTags::new();
    let mut v4 = Vec::new();
    for (name, map) in [
        (map_names::CONNTRACK, maps.conntrack.map()),
        (map_names::CT_NEW, maps.ct_new.map()),
    ] {
        batch::for_each_chunk(map, batch::CHUNK, |keys: &[CtKey], values: &[CtValue]| {
            for (k, v) in keys.iter().zip(values) {
                let (src, dst) = (
                    socket_v4(k.src_be, k.sport_be),
                    socket_v4(k.dst_be, k.dport_be),
                );
                note_reply_tag(&mut tags, k.proto, v.dir, src, dst, v.tcp_max_ack);
            }
            v4.extend(
                keys.iter()
                    .zip(values)
                    .filter_map(|(k, v)| Flow::of_v4(k, v)),
            );
        })
        .map_err(batch_error(name))?;
    }
    v4.sort();
    let mut v6 = Vec::new();
    for (name, map) in [
        (map_names::CONNTRACK6, &maps.conntrack6),
        (map_names::CT_NEW6, &maps.ct_new6),
    ] {
        let Some(map) = map else {
            continue;
        };
        batch::for_each_chunk(
            map.map(),
            batch::CHUNK,
            |keys: &[Ct6Key], values: &[Ct6Value]| {
                for (k, v) in keys.iter().zip(values) {
                    let (src, dst) = (
                        socket_v6(&k.src_be, k.sport_be),
                        socket_v6(&k.dst_be, k.dport_be),
                    );
                    note_reply_tag(&mut tags, k.proto, v.dir, src, dst, v.tcp_max_ack);
                }
                v6.extend(
                    keys.iter()
                        .zip(values)
                        .filter_map(|(k, v)| Flow::of_v6(k, v)),
                );
            },
        )
        .map_err(batch_error(name))?;
    }
    v6.sort();
    v4.extend(v6);
    with_reply_tags(&mut v4, &tags);
    Ok(v4)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv6Addr;

    use proxy_common::{PROTO_TCP, PROTO_UDP};

    use super::*;

    fn words(ip: Ipv6Addr) -> [u32; 4] {
        encode::addr_words(IpAddr::V6(ip))
    }

    #[test]
    fn an_ipv6_flow_reads_as_bracketed_addresses_and_its_reply_is_not_listed() {
        let client = Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, 2);
        let vip = Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x10);
        let backend = Ipv6Addr::new(0xfd00, 0x200, 0, 0, 0, 0, 0, 0x12);
        let key = Ct6Key::new(
            words(client),
            words(vip),
            40000u16.to_be(),
            80u16.to_be(),
            PROTO_TCP,
        );
        let value = Ct6Value {
            nat_addr_be: words(backend),
            nat_port_be: 8080u16.to_be(),
            flags: ct_flags::SEEN_REPLY | ct_flags::ASSURED,
            dir: ct_dir::FORWARD,
            ..Ct6Value::default()
        };
        let flow = Flow::of_v6(&key, &value).expect("a forward entry");
        assert_eq!(
            flow.to_string(),
            "TCP [fd00:200::2]:40000 -> [fd00:96::10]:80 => [fd00:200::12]:8080 assured replied"
        );
        let reply = Ct6Value {
            dir: ct_dir::REPLY,
            ..value
        };
        assert_eq!(Flow::of_v6(&key, &reply), None);
    }

    #[test]
    fn an_ipv4_flow_shows_the_source_its_backend_sees() {
        let be = |o: [u8; 4]| u32::from_ne_bytes(o);
        let key = CtKey::new(
            be([192, 168, 1, 7]),
            be([10, 0, 0, 1]),
            5353u16.to_be(),
            30053u16.to_be(),
            PROTO_UDP,
        );
        let value = CtValue {
            nat_addr_be: be([10, 200, 1, 12]),
            alt_addr_be: be([10, 0, 0, 1]),
            nat_port_be: 53u16.to_be(),
            alt_port_be: 61000u16.to_be(),
            flags: ct_flags::SNAT,
            dir: ct_dir::FORWARD,
            ..CtValue::default()
        };
        assert_eq!(
            Flow::of_v4(&key, &value).map(|f| f.to_string()).as_deref(),
            Some("UDP 192.168.1.7:5353 -> 10.0.0.1:30053 => 10.200.1.12:53 as 10.0.0.1:61000 snat")
        );
    }
}
