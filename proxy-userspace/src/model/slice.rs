//! An EndpointSlice checked once, when it arrives, and reduced to what the
//! model reads of its endpoints (kube-proxy's `endpointslicecache.go`), and
//! one endpoint of it as a service port uses it.

use std::{net::IpAddr, sync::Arc};

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::{
    BackendAddr, ModelError, Protocol,
    family::{Family, parse_ip},
    intern::intern,
    types::parse_protocol,
};

/// A port of an EndpointSlice: every endpoint of the slice serves the
/// service port of this name and protocol on this number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct SlicePort {
    pub(super) name: Arc<str>,
    pub(super) protocol: Protocol,
    pub(super) port: u16,
}

/// An endpoint of a slice, conditions defaulted as kube-proxy does. Kept
/// for every endpoint of the cluster, so it is small: 48 bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct SliceEndpoint {
    pub(super) ip: IpAddr,
    pub(super) ready: bool,
    pub(super) serving: bool,
    pub(super) terminating: bool,
    pub(super) node_name: Option<Arc<str>>,
    /// Topology hints, which most endpoints do not have.
    pub(super) hints: Option<Box<Hints>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Hints {
    pub(super) zones: Box<[Arc<str>]>,
    pub(super) nodes: Box<[Arc<str>]>,
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
    pub(super) family: Family,
    pub(super) ports: Box<[SlicePort]>,
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

    pub(super) fn serving_terminating(&self) -> bool {
        self.source.serving && self.source.terminating
    }

    /// Which copy wins when the same ip:port is in two slices (an endpoint
    /// moving between slices): a non-terminating one, as kube-proxy prefers,
    /// then a ready, a serving, and a local one.
    pub(super) fn preference(&self) -> (bool, bool, bool, bool) {
        (
            !self.source.terminating,
            self.source.ready,
            self.source.serving,
            self.addr.local,
        )
    }
}
