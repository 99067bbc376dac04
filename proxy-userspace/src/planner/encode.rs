//! The model's types in the datapath's encoding, and back: addresses as
//! the maps' words, frontends as service keys, backends, and the entries of
//! the two tries; and each of them as a message names it. Everything that
//! writes or reads a map encodes through here, so it imports nothing of the
//! planner.

use std::{
    borrow::Cow,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use proxy_common::{
    Backend, ClusterCidrKey, PROTO_SCTP, PROTO_TCP, PROTO_UDP, REFUSAL_TEXT_LEN, RefusalKey,
    RefusalRecord, ServiceKey, ServiceName, SourceRangeKey, backend_flags, is_v4_mapped, scope,
    source_range_prefix, v4_mapped,
};

use crate::maglev::BackendName;
use crate::model::{BackendAddr, Cidr, FrontendKey, Protocol, Scope, ServicePortName};

/// One entry of the `SOURCE_RANGES` trie: (prefix length, key).
pub type SourceRangeEntry = (u32, SourceRangeKey);

/// One entry of the `CLUSTER_CIDRS` trie: (prefix length, key).
pub type ClusterCidrEntry = (u32, ClusterCidrKey);

pub fn addr_words(ip: IpAddr) -> [u32; 4] {
    match ip {
        IpAddr::V4(v4) => v4_mapped(u32::from_ne_bytes(v4.octets())),
        IpAddr::V6(v6) => {
            let o = v6.octets();
            std::array::from_fn(|i| {
                u32::from_ne_bytes([o[i * 4], o[i * 4 + 1], o[i * 4 + 2], o[i * 4 + 3]])
            })
        }
    }
}

pub fn words_addr(words: &[u32; 4]) -> IpAddr {
    if is_v4_mapped(words) {
        IpAddr::V4(Ipv4Addr::from(words[3].to_ne_bytes()))
    } else {
        IpAddr::V6(words_ipv6(words))
    }
}

/// The IPv6 address of four words in network order, as they are, an
/// IPv4-mapped one included.
pub fn words_ipv6(words: &[u32; 4]) -> Ipv6Addr {
    let mut o = [0u8; 16];
    for (chunk, w) in o.chunks_exact_mut(4).zip(words) {
        chunk.copy_from_slice(&w.to_ne_bytes());
    }
    Ipv6Addr::from(o)
}

pub fn protocol_from_number(n: u8) -> Option<Protocol> {
    match n {
        PROTO_TCP => Some(Protocol::Tcp),
        PROTO_UDP => Some(Protocol::Udp),
        PROTO_SCTP => Some(Protocol::Sctp),
        _ => None,
    }
}

pub fn service_key(key: &FrontendKey) -> ServiceKey {
    ServiceKey {
        addr_be: addr_words(key.ip),
        port_be: key.port.to_be(),
        proto: key.protocol.number(),
        scope: match key.scope {
            Scope::Any => scope::ANY,
            Scope::Internal => scope::INTERNAL,
        },
    }
}

pub fn frontend_key(key: &ServiceKey) -> Option<FrontendKey> {
    Some(FrontendKey {
        ip: words_addr(&key.addr_be),
        port: u16::from_be(key.port_be),
        protocol: protocol_from_number(key.proto)?,
        scope: match key.scope {
            scope::ANY => Scope::Any,
            scope::INTERNAL => Scope::Internal,
            _ => return None,
        },
    })
}

/// The map encoding of a backend. The flags are part of a backend's identity
/// (the planner dedups backends by this whole value): an endpoint that turns
/// terminating becomes a new backend id, so its old id departs from the
/// service and its flows and affinity entries are purged, while the datapath
/// can trust that an id's flags never change under an affinity entry.
pub fn backend(b: &BackendAddr) -> Backend {
    let mut flags = 0;
    if b.local {
        flags |= backend_flags::LOCAL;
    }
    if b.terminating {
        flags |= backend_flags::TERMINATING;
    }
    Backend {
        addr_be: addr_words(b.ip),
        port_be: b.port.to_be(),
        proto: b.protocol.number(),
        flags,
    }
}

/// A backend as every node names it, for its place in a Maglev table:
/// what `backend` encodes less the flags, which are node-local (`LOCAL`) or
/// change with the endpoint's state.
pub fn backend_name(b: &BackendAddr) -> BackendName {
    BackendName {
        addr_be: addr_words(b.ip),
        port_be: b.port.to_be(),
        proto: b.protocol.number(),
    }
}

/// "ip:port/proto" of a stored frontend, for messages.
pub fn service_key_string(key: &ServiceKey) -> String {
    match frontend_key(key) {
        Some(fk) => fk.to_string(),
        None => format!("{key:?}"),
    }
}

pub fn backend_string(b: &Backend) -> String {
    let ip = words_addr(&b.addr_be);
    let port = u16::from_be(b.port_be);
    match ip {
        IpAddr::V4(ip) => format!("{ip}:{port}"),
        IpAddr::V6(ip) => format!("[{ip}]:{port}"),
    }
}

/// The `SOURCE_RANGES` entry letting clients of `range` reach `frontend`.
pub fn source_range(frontend: &ServiceKey, range: &Cidr) -> SourceRangeEntry {
    (
        source_range_prefix(range.prefix128()),
        SourceRangeKey {
            frontend: *frontend,
            client_be: addr_words(range.ip),
        },
    )
}

/// "frontend from cidr", for messages.
pub fn source_range_string((prefix_len, key): &SourceRangeEntry) -> String {
    let prefix128 = prefix_len.saturating_sub(source_range_prefix(0));
    let ip = words_addr(&key.client_be);
    let prefix = if ip.is_ipv4() {
        prefix128.saturating_sub(96)
    } else {
        prefix128
    };
    format!("{} from {ip}/{prefix}", service_key_string(&key.frontend))
}

/// The `CLUSTER_CIDRS` entry of a pod CIDR.
pub fn cluster_cidr(cidr: &Cidr) -> ClusterCidrEntry {
    (
        cidr.prefix128(),
        ClusterCidrKey {
            addr_be: addr_words(cidr.ip),
        },
    )
}

/// "cidr", for messages.
pub fn cluster_cidr_string((prefix_len, key): &ClusterCidrEntry) -> String {
    let ip = words_addr(&key.addr_be);
    let prefix = if ip.is_ipv4() {
        prefix_len.saturating_sub(96)
    } else {
        *prefix_len
    };
    format!("{ip}/{prefix}")
}

/// The `SERVICE_NAMES` entry of `service`, whose port is `port` (0 when
/// unknown). Text longer than its field, which Kubernetes' limits rule out,
/// is cut at a character boundary.
pub fn service_name(service: &ServicePortName, port: u16) -> ServiceName {
    let mut out = ServiceName {
        port,
        proto: service.protocol.number(),
        ..ServiceName::default()
    };
    fill(&mut out.namespace, &service.namespace);
    fill(&mut out.name, &service.name);
    fill(&mut out.port_name, &service.port);
    out
}

/// The `SERVICE_REFUSALS` key of the `index`th refusal of the Service
/// `namespace`/`name`.
pub fn refusal_key(namespace: &str, name: &str, index: u32) -> RefusalKey {
    let mut out = RefusalKey {
        index,
        ..RefusalKey::default()
    };
    fill(&mut out.namespace, namespace);
    fill(&mut out.name, name);
    out
}

/// The `SERVICE_REFUSALS` value of a refusal for `reason`, told by `text`:
/// cut to its field, ending in "..." where it was.
pub fn refusal_record(reason: &str, text: &str) -> RefusalRecord {
    let mut out = RefusalRecord::default();
    fill(&mut out.reason, reason);
    fill(&mut out.text, &ellipsized(text, REFUSAL_TEXT_LEN));
    out
}

/// `text` in at most `max` bytes: whole, or cut at a character boundary
/// and ending in "...".
pub fn ellipsized(text: &str, max: usize) -> Cow<'_, str> {
    if text.len() <= max {
        return Cow::Borrowed(text);
    }
    let end = text.floor_char_boundary(max.saturating_sub(3));
    Cow::Owned(format!("{}...", &text[..end]))
}

fn fill(field: &mut [u8], text: &str) {
    let len = text.floor_char_boundary(field.len());
    field[..len].copy_from_slice(&text.as_bytes()[..len]);
}

/// A text field of a `SERVICE_NAMES` entry: up to its first NUL.
pub fn name_text(field: &[u8]) -> String {
    let end = field.iter().position(|b| *b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

/// "namespace/name:port" of a `SERVICE_NAMES` entry, for messages.
pub fn service_name_string(name: &ServiceName) -> String {
    format!(
        "{}/{}:{}",
        name_text(&name.namespace),
        name_text(&name.name),
        name_text(&name.port_name)
    )
}
