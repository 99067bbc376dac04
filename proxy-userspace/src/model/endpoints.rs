//! From EndpointSlices to the endpoints of one service port, and from those
//! to the Cluster and Local sets (kube-proxy's `endpointslicecache.go` and
//! `CategorizeEndpoints` in `topology.go`).

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
};

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::{BackendAddr, ModelError, NodeInfo, Protocol, compact::intern, topology};

/// An IP family: each one is proxied on its own, as kube-proxy runs one
/// proxier per family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Family {
    V4,
    V6,
}

impl Family {
    pub(super) fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// The "any address" of the family, which stands for every node address
    /// in NodePort frontends.
    pub(super) fn unspecified(self) -> IpAddr {
        match self {
            Family::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            Family::V6 => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        }
    }

    fn address_type(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }
}

/// Parses an IP the way kube-proxy does (`netutils.ParseIPSloppy`): IPv4
/// octets may carry leading zeros, which old API servers accepted and which
/// Go reads as decimal; an IPv4-mapped IPv6 address is the IPv4 address.
pub(super) fn parse_ip(text: &str) -> Option<IpAddr> {
    let ip = if let Ok(ip) = text.parse::<IpAddr>() {
        ip
    } else {
        let octets: Vec<&str> = text.split('.').collect();
        if octets.len() != 4
            || octets
                .iter()
                .any(|o| o.is_empty() || o.len() > 3 || !o.bytes().all(|b| b.is_ascii_digit()))
        {
            return None;
        }
        let mut bytes = [0u8; 4];
        for (byte, octet) in bytes.iter_mut().zip(&octets) {
            *byte = octet.parse().ok()?;
        }
        IpAddr::V4(Ipv4Addr::from(bytes))
    };
    Some(ip.to_canonical())
}

/// A Kubernetes protocol name; absent means TCP, as the API server defaults.
pub(super) fn parse_protocol(protocol: Option<&str>) -> Result<Protocol, String> {
    match protocol {
        None | Some("TCP") => Ok(Protocol::Tcp),
        Some("UDP") => Ok(Protocol::Udp),
        Some("SCTP") => Ok(Protocol::Sctp),
        Some(other) => Err(format!("protocol {other:?} is not one of TCP, UDP, SCTP")),
    }
}

/// A port of an EndpointSlice: every endpoint of the slice serves the
/// service port of this name and protocol on this number.
#[derive(Clone, Debug, PartialEq, Eq)]
struct SlicePort {
    name: Arc<str>,
    protocol: Protocol,
    port: u16,
}

/// An endpoint of a slice, conditions defaulted as kube-proxy does. Kept
/// for every endpoint of the cluster, so it is small: 48 bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct SliceEndpoint {
    ip: IpAddr,
    pub(super) ready: bool,
    pub(super) serving: bool,
    pub(super) terminating: bool,
    node_name: Option<Arc<str>>,
    /// Topology hints, which most endpoints do not have.
    hints: Option<Box<Hints>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Hints {
    zones: Box<[Arc<str>]>,
    nodes: Box<[Arc<str>]>,
}

impl SliceEndpoint {
    pub(super) fn zone_hints(&self) -> &[Arc<str>] {
        self.hints.as_ref().map_or(&[], |h| &h.zones)
    }

    pub(super) fn node_hints(&self) -> &[Arc<str>] {
        self.hints.as_ref().map_or(&[], |h| &h.nodes)
    }
}

/// An EndpointSlice checked and reduced to what the model uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct ParsedSlice {
    family: Family,
    ports: Box<[SlicePort]>,
    pub(super) endpoints: Box<[SliceEndpoint]>,
}

impl ParsedSlice {
    /// The service ports, by name and protocol, the slice has endpoints for.
    pub(super) fn service_ports(&self) -> impl Iterator<Item = (&str, Protocol)> + '_ {
        self.ports.iter().map(|p| (&*p.name, p.protocol))
    }
}

/// Checks a slice. FQDN slices are of no use to a proxy and yield None.
pub(super) fn parse_slice(slice: &EndpointSlice) -> Result<Option<ParsedSlice>, ModelError> {
    let id = format!(
        "{}/{}",
        slice.metadata.namespace.as_deref().unwrap_or("default"),
        slice.metadata.name.as_deref().unwrap_or("<unnamed>")
    );
    let err = |reason: String| ModelError::InvalidSlice {
        slice: id.clone(),
        reason,
    };
    let family = match slice.address_type.as_str() {
        "IPv4" => Family::V4,
        "IPv6" => Family::V6,
        "FQDN" => return Ok(None),
        other => {
            return Err(err(format!(
                "addressType {other:?} is not one of IPv4, IPv6, FQDN"
            )));
        }
    };

    let mut ports = Vec::new();
    for port in slice.ports.iter().flatten() {
        // kube-proxy ignores a port without a name (the API defaults it to
        // "") or without a number ("all ports", which it does not support).
        let (Some(name), Some(number)) = (port.name.as_deref(), port.port) else {
            continue;
        };
        if number == 0 {
            continue;
        }
        let number = u16::try_from(number)
            .map_err(|_| err(format!("port {name:?}: {number} is out of range 1-65535")))?;
        let protocol = parse_protocol(port.protocol.as_deref())
            .map_err(|e| err(format!("port {name:?}: {e}")))?;
        ports.push(SlicePort {
            name: intern(name),
            protocol,
            port: number,
        });
    }

    let mut endpoints = Vec::with_capacity(slice.endpoints.len());
    for (index, endpoint) in slice.endpoints.iter().enumerate() {
        // Every address of an endpoint is the same pod; kube-proxy uses the
        // first.
        let Some(address) = endpoint.addresses.first() else {
            return Err(err(format!("endpoint {index} has no addresses")));
        };
        let ip = parse_ip(address).ok_or_else(|| {
            err(format!(
                "endpoint {index}: {address:?} is not an IP address"
            ))
        })?;
        if Family::of(ip) != family {
            return Err(err(format!(
                "endpoint {index}: {address} is not an {} address",
                family.address_type()
            )));
        }
        let conditions = endpoint.conditions.as_ref();
        let hints = endpoint.hints.as_ref();
        endpoints.push(SliceEndpoint {
            ip,
            ready: conditions.and_then(|c| c.ready).unwrap_or(true),
            serving: conditions.and_then(|c| c.serving).unwrap_or(true),
            terminating: conditions.and_then(|c| c.terminating).unwrap_or(false),
            node_name: endpoint.node_name.as_deref().map(intern),
            hints: hints
                .map(|h| Hints {
                    zones: h
                        .for_zones
                        .iter()
                        .flatten()
                        .map(|z| intern(&z.name))
                        .collect(),
                    nodes: h
                        .for_nodes
                        .iter()
                        .flatten()
                        .map(|n| intern(&n.name))
                        .collect(),
                })
                .filter(|h| !h.zones.is_empty() || !h.nodes.is_empty())
                .map(Box::new),
        });
    }

    Ok(Some(ParsedSlice {
        family,
        ports: ports.into(),
        endpoints: endpoints.into(),
    }))
}

/// One endpoint of one service port.
#[derive(Clone, Copy, Debug)]
pub(super) struct Endpoint<'a> {
    pub(super) addr: BackendAddr,
    pub(super) source: &'a SliceEndpoint,
}

impl Endpoint<'_> {
    pub(super) fn ready(&self) -> bool {
        self.source.ready
    }

    fn serving_terminating(&self) -> bool {
        self.source.serving && self.source.terminating
    }

    /// Which copy wins when the same ip:port is in two slices (an endpoint
    /// moving between slices): a non-terminating one, as kube-proxy prefers,
    /// then a ready, a serving, and a local one.
    fn preference(&self) -> (bool, bool, bool, bool) {
        (
            !self.source.terminating,
            self.source.ready,
            self.source.serving,
            self.addr.local,
        )
    }
}

/// The endpoints of the service port (`port_name`, `protocol`) in `family`,
/// one per ip:port, sorted by kube-proxy's "ip:port" string.
///
/// `slices` should be in a stable order (by name): when two copies of an
/// endpoint are equally good, the first is kept.
pub(super) fn endpoints_for_port<'a>(
    slices: &[&'a ParsedSlice],
    family: Family,
    port_name: &str,
    protocol: Protocol,
    node: &NodeInfo,
) -> Vec<Endpoint<'a>> {
    let mut by_host_port: BTreeMap<[u8; 48], Endpoint<'a>> = BTreeMap::new();
    for slice in slices.iter().filter(|s| s.family == family) {
        for port in slice
            .ports
            .iter()
            .filter(|p| &*p.name == port_name && p.protocol == protocol)
        {
            for source in &slice.endpoints {
                let local = !node.name.is_empty()
                    && source.node_name.as_deref() == Some(node.name.as_str());
                let endpoint = Endpoint {
                    addr: BackendAddr {
                        ip: source.ip,
                        port: port.port,
                        protocol,
                        local,
                        terminating: source.terminating,
                    },
                    source,
                };
                // The map iterates in byte order of the "ip:port" key,
                // which is Go's string order: the order kube-proxy sorts by.
                by_host_port
                    .entry(endpoint.addr.host_port_key())
                    .and_modify(|kept| {
                        if endpoint.preference() > kept.preference() {
                            *kept = endpoint;
                        }
                    })
                    .or_insert(endpoint);
            }
        }
    }
    by_host_port.into_values().collect()
}

/// The endpoint sets of one service port on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Categorized {
    /// For Cluster traffic policy: ready endpoints (topology-filtered), or
    /// serving-terminating ones when no endpoint is ready.
    pub(super) cluster: Vec<BackendAddr>,
    /// For Local traffic policy: local ready endpoints, or local
    /// serving-terminating ones when no local endpoint is ready. Topology
    /// does not apply.
    pub(super) local: Vec<BackendAddr>,
    /// Some endpoint anywhere is usable: what decides between REJECT ("no
    /// endpoints") and DROP ("no local endpoints").
    pub(super) has_any: bool,
}

/// kube-proxy's `CategorizeEndpoints`, with both sets always computed.
pub(super) fn categorize(endpoints: &[Endpoint<'_>], node: &NodeInfo) -> Categorized {
    let mode = topology::mode(endpoints, node);
    let mut cluster: Vec<BackendAddr> = endpoints
        .iter()
        .filter(|e| e.ready() && topology::allows(mode, e, node))
        .map(|e| e.addr)
        .collect();
    if cluster.is_empty() {
        // Topology only filters when it leaves some ready endpoint, so an
        // empty set here means nothing is ready anywhere.
        cluster = endpoints
            .iter()
            .filter(|e| e.serving_terminating())
            .map(|e| e.addr)
            .collect();
    }

    let mut local: Vec<BackendAddr> = endpoints
        .iter()
        .filter(|e| e.addr.local && e.ready())
        .map(|e| e.addr)
        .collect();
    if local.is_empty() {
        local = endpoints
            .iter()
            .filter(|e| e.addr.local && e.serving_terminating())
            .map(|e| e.addr)
            .collect();
    }

    let has_any = endpoints
        .iter()
        .any(|e| e.ready() || e.serving_terminating());
    Categorized {
        cluster,
        local,
        has_any,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_ip_accepts_what_kube_proxy_accepts() {
        let cases: [(&str, Option<&str>); 8] = [
            ("10.0.0.1", Some("10.0.0.1")),
            ("010.000.000.001", Some("10.0.0.1")),
            ("fd00::1", Some("fd00::1")),
            ("::ffff:10.1.2.3", Some("10.1.2.3")),
            ("10.0.0.256", None),
            ("10.0.0", None),
            ("", None),
            ("web.example", None),
        ];
        for (input, want) in cases {
            let got = parse_ip(input).map(|ip| ip.to_string());
            assert_eq!(got.as_deref(), want, "parse_ip({input:?})");
        }
    }

    #[test]
    fn parse_protocol_defaults_to_tcp() {
        assert_eq!(parse_protocol(None), Ok(Protocol::Tcp), "absent protocol");
        assert_eq!(parse_protocol(Some("UDP")), Ok(Protocol::Udp), "UDP");
        assert_eq!(parse_protocol(Some("SCTP")), Ok(Protocol::Sctp), "SCTP");
        let err = parse_protocol(Some("tcp")).expect_err("protocols are case-sensitive");
        assert!(
            err.contains("\"tcp\""),
            "error should quote the bad value: {err}"
        );
    }
}
