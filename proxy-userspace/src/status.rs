//! `ebpf-proxy status`: what the pinned maps hold, readable: the Services
//! by name (`services`), then the node's part; with `--flows`, the
//! translated flows too (`flows`). As text, or as JSON.

pub mod flows;
pub mod services;

use std::fmt::Write;

use aya::maps::{IterableMap, MapInfo};
use proxy_common::{
    AffinityKey, AffinityValue, Ct6Key, Ct6Value, CtKey, CtValue, MAX_CT_NEW, map_names,
};
use serde::Serialize;

use crate::{
    datapath::resize,
    datapath::{
        Maps, PinLayout, batch,
        maps::{MapsError, batch_error},
        refusal_records::{self, RefusalRecordsError},
        service_counters::{self, ServiceCountersError, Totals},
    },
    housekeeping::{sock_diag, sock_notes},
    planner::encode,
};

/// Why the report could not be made.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error(transparent)]
    Maps(#[from] MapsError),
    #[error("writing the report as JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Counters(#[from] ServiceCountersError),
    #[error(transparent)]
    Refusals(#[from] RefusalRecordsError),
}

/// What `ebpf-proxy status` is asked for.
#[derive(Clone, Debug, Default)]
pub struct Options {
    pub json: bool,
    pub flows: bool,
    /// Only this Service (namespace, name) in the Services part.
    pub service: Option<(String, String)>,
}

/// The report as JSON: a struct, so that its keys come in this order.
#[derive(Serialize)]
struct Report<'a> {
    services: &'a [services::ServiceReport],
    node: &'a NodeReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    flows: Option<Vec<serde_json::Value>>,
}

/// `--host-routing` as `config` and `POD_IFACES` hold it.
fn host_routing(maps: &Maps, config: &proxy_common::NodeConfig) -> HostRoutingReport {
    HostRoutingReport {
        mode: if config.flags & proxy_common::node_config_flags::HOST_ROUTING_BPF != 0 {
            "bpf"
        } else {
            "stack"
        },
        pod_interfaces: maps.pod_ifaces.as_ref().map_or(0, |m| m.keys().count()),
        shaped_interfaces: maps.shaped_ifaces.as_ref().map_or(0, |m| m.keys().count()),
    }
}

/// `--host-routing` as the maps hold it.
#[derive(Debug, Serialize)]
pub struct HostRoutingReport {
    /// `stack` or `bpf` (`node_config_flags::HOST_ROUTING_BPF`).
    pub mode: &'static str,
    /// `POD_IFACES`' entries: the interfaces translated packets may be
    /// sent through into a pod.
    pub pod_interfaces: usize,
    /// `SHAPED_IFACES`' entries: the pod interfaces with a qdisc, whose
    /// packets keep the stack's path both ways.
    pub shaped_interfaces: usize,
}

/// The node's part of the report: what is not any one Service's.
#[derive(Debug, Serialize)]
pub struct NodeReport {
    pub frontends: usize,
    pub backends: usize,
    pub addresses: Vec<NodeAddress>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snat: Option<Snat>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub localhost_nodeports: Option<bool>,
    /// Whether pods' TCP connections to ClusterIPs go to a backend at
    /// `connect()` (`--socket-lb-pods`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub socket_lb_pods: Option<bool>,
    /// How translated packets reach this node's pods (`--host-routing`):
    /// `stack` or `bpf`, with the pod interfaces the datapath sends into.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_routing: Option<HostRoutingReport>,
    /// None where the pins have no `NODE_CONFIG6`; "none" as JSON null
    /// inside `Some` is the node without an IPv6 address.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ipv6_address: Option<Option<std::net::IpAddr>>,
    /// The datapath clock's tick in ns; 0 while not calibrated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clock_tick_ns: Option<u64>,
    pub attached: Vec<String>,
    pub conntrack_entries: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conntrack_capacity: Option<u32>,
    pub unassured_entries: usize,
    pub socket_notes: String,
    pub map_fill: Vec<MapFill>,
    /// Bits the prefilter has set, of `proxy_common::prefilter::BITS`;
    /// None where the pins have none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefilter_bits_set: Option<u32>,
    /// Slots the prefilter's flow marks hold marked, of
    /// `proxy_common::prefilter::flows::SLOTS`; None where the pins have
    /// none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefilter_flow_slots_marked: Option<u32>,
    /// What `SERVICE_CIDRS` holds; None where the pins have none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub service_cidrs: Option<ServiceCidrs>,
    pub counters: Vec<Counter>,
}

/// The service CIDRs in force and the ClusterIPs held in them.
#[derive(Debug, Default, Serialize)]
pub struct ServiceCidrs {
    /// The ranges: an address of one no Service holds is dropped.
    pub ranges: Vec<String>,
    /// ClusterIPs of this proxy's Services: their undefined ports are
    /// rejected.
    pub cluster_ips: usize,
    /// ClusterIPs of Services another proxy serves: passed.
    pub foreign_cluster_ips: usize,
}

#[derive(Debug, Serialize)]
pub struct NodeAddress {
    pub address: std::net::IpAddr,
    pub nodeports: bool,
}

#[derive(Debug, Serialize)]
pub struct Snat {
    pub address: std::net::IpAddr,
    pub port_min: u16,
    pub port_max: u16,
}

#[derive(Debug, Serialize)]
pub struct MapFill {
    pub map: &'static str,
    pub entries: usize,
    /// None where the pin's capacity could not be read (`error` says why).
    pub capacity: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct Counter {
    pub name: &'static str,
    pub value: u64,
}

/// The report as `options` ask: text or JSON, one Service or all, with
/// the flows or without.
pub fn render(pins: &PinLayout, options: &Options) -> Result<String, StatusError> {
    let maps = Maps::open_pinned(pins)?;
    let stored = maps.read_service_state()?;
    let only = options
        .service
        .as_ref()
        .map(|(namespace, name)| (namespace.as_str(), name.as_str()));
    let mut services = services::services(&stored, only);
    let counters = counters(&maps, &services)?;
    let refusals = match &maps.service_refusals {
        Some(map) => refusal_records::read(map)?,
        None => std::collections::BTreeMap::new(),
    };
    services::annotate(&mut services, &counters, refusals, only);
    let node = node(pins, &maps, &stored)?;
    let flows = if options.flows {
        Some(flows::read(&maps)?)
    } else {
        None
    };
    if options.json {
        let report = Report {
            services: &services,
            node: &node,
            flows: flows
                .as_ref()
                .map(|flows| flows.iter().map(flows::Flow::json).collect()),
        };
        let mut out = serde_json::to_string_pretty(&report)?;
        out.push('\n');
        return Ok(out);
    }
    let mut out = format!("{} frontends, {} backends\n", node.frontends, node.backends);
    out.push_str(&services::text(&services));
    if let Some((namespace, name)) = &options.service
        && services.is_empty()
    {
        let _ = writeln!(out, "{namespace}/{name}: no frontend in the maps");
    }
    out.push_str(&node_text(&node));
    if let Some(flows) = flows {
        let _ = writeln!(
            out,
            "flows: {} (client -> frontend => backend)",
            flows.len()
        );
        for flow in flows {
            let _ = writeln!(out, "flow {flow}");
        }
    }
    Ok(out)
}

/// The counters of each port of `services`, where the pins have them.
fn counters(
    maps: &Maps,
    services: &[services::ServiceReport],
) -> Result<std::collections::BTreeMap<u32, Totals>, StatusError> {
    let mut out = std::collections::BTreeMap::new();
    let Some(map) = &maps.service_counters else {
        return Ok(out);
    };
    for port in services.iter().flat_map(|s| &s.ports) {
        if let Some(totals) = service_counters::total(map, port.service_id)? {
            out.insert(port.service_id, totals);
        }
    }
    Ok(out)
}

/// The node's part, read from the pins.
fn node(
    pins: &PinLayout,
    maps: &Maps,
    stored: &crate::planner::StoredState,
) -> Result<NodeReport, MapsError> {
    let addresses = maps
        .node_addrs
        .iter()
        .filter_map(Result::ok)
        .map(|(k, v)| NodeAddress {
            address: encode::words_addr(&k.addr_be),
            nodeports: v.flags & proxy_common::node_addr_flags::NODEPORT != 0,
        })
        .collect();
    let config = maps.node_config.get(&0, 0).ok();
    let ipv6_address = match maps.node_config6.as_ref().map(|m| m.get(&0, 0)) {
        Some(Ok(config6)) => Some(match config6.snat_addr_be {
            [0, 0, 0, 0] => None,
            addr => Some(encode::words_addr(&addr)),
        }),
        _ => None,
    };
    let clock_tick_ns = maps
        .clock
        .get(&proxy_common::clock_slot::IN_FORCE, 0)
        .ok()
        .map(|clock| clock.tick_ns);
    let mut attached: Vec<String> = std::fs::read_dir(pins.links_dir())
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    attached.sort();
    // In chunks: a table of a million entries read one at a time would take
    // seconds.
    let entries = batch::count::<CtKey, CtValue>(maps.conntrack.map(), batch::CHUNK)
        .map_err(batch_error(map_names::CONNTRACK))?;
    let unassured = batch::count::<CtKey, CtValue>(maps.ct_new.map(), batch::CHUNK)
        .map_err(batch_error(map_names::CT_NEW))?;
    let flows6 = match &maps.conntrack6 {
        Some(map) => batch::count::<Ct6Key, Ct6Value>(map.map(), batch::CHUNK)
            .map_err(batch_error(map_names::CONNTRACK6))?,
        None => 0,
    };
    let unassured6 = match &maps.ct_new6 {
        Some(map) => batch::count::<Ct6Key, Ct6Value>(map.map(), batch::CHUNK)
            .map_err(batch_error(map_names::CT_NEW6))?,
        None => 0,
    };
    let affinity = batch::count::<AffinityKey, AffinityValue>(maps.affinity.map(), batch::CHUNK)
        .map_err(batch_error(map_names::AFFINITY))?;
    let map_fill = [
        (map_names::SERVICES, stored.services.len()),
        (map_names::SERVICE_NAMES, stored.names.len()),
        (map_names::BACKEND_SLOTS, stored.slots.len()),
        (map_names::BACKENDS, stored.backends.len()),
        (map_names::SOURCE_RANGES, stored.source_ranges.len()),
        (map_names::AFFINITY, affinity),
        (map_names::CONNTRACK, entries),
        (map_names::CT_NEW, unassured),
        (map_names::CONNTRACK6, flows6),
        (map_names::CT_NEW6, unassured6),
    ]
    .into_iter()
    .filter(|(name, _)| *name != map_names::SERVICE_NAMES || maps.service_names.is_some())
    .map(|(name, entries)| fill(pins, name, entries))
    .collect();
    let counters = maps
        .counters()?
        .into_iter()
        .map(|(name, value)| Counter { name, value })
        .collect();
    Ok(NodeReport {
        frontends: stored.services.len(),
        backends: stored.backends.len(),
        addresses,
        snat: config.map(|c| Snat {
            address: encode::words_addr(&c.snat_addr_be),
            port_min: c.snat_port_min,
            port_max: c.snat_port_max,
        }),
        localhost_nodeports: config
            .map(|c| c.flags & proxy_common::node_config_flags::LOCALHOST_NODEPORTS != 0),
        socket_lb_pods: config
            .map(|c| c.flags & proxy_common::node_config_flags::SOCKET_LB_PODS != 0),
        host_routing: config.map(|c| host_routing(maps, &c)),
        ipv6_address,
        clock_tick_ns,
        attached,
        conntrack_entries: entries,
        conntrack_capacity: resize::capacity(&pins.maps_dir()).ok(),
        unassured_entries: unassured,
        socket_notes: socket_notes(pins),
        map_fill,
        prefilter_bits_set: maps.prefilter.as_ref().map(|p| p.ones()),
        prefilter_flow_slots_marked: maps
            .prefilter_flows
            .as_ref()
            .map(crate::datapath::prefilter_flows::FlowMarks::marked),
        service_cidrs: service_cidrs(maps)?,
        counters,
    })
}

/// `SERVICE_CIDRS` read back: its ranges, and its ClusterIPs counted.
fn service_cidrs(maps: &Maps) -> Result<Option<ServiceCidrs>, MapsError> {
    let Some(map) = &maps.service_cidrs else {
        return Ok(None);
    };
    let mut report = ServiceCidrs::default();
    for item in map {
        let (key, kind) = item.map_err(crate::datapath::maps::wrap(map_names::SERVICE_CIDRS))?;
        match kind {
            proxy_common::service_cidr::HELD => report.cluster_ips += 1,
            proxy_common::service_cidr::FOREIGN => report.foreign_cluster_ips += 1,
            _ => report
                .ranges
                .push(encode::cluster_cidr_string(&(key.prefix_len(), key.data()))),
        }
    }
    report.ranges.sort();
    Ok(Some(report))
}

/// What `NODE_CONFIG` says, a line each: the SNAT address and ports, and
/// where the socket hooks act.
fn node_config_text(node: &NodeReport, out: &mut String) {
    if let Some(snat) = &node.snat {
        let _ = writeln!(
            out,
            "SNAT to {} ports {}-{}",
            snat.address, snat.port_min, snat.port_max
        );
    }
    if let Some(localhost) = node.localhost_nodeports {
        let _ = writeln!(
            out,
            "localhost NodePorts: {}",
            if localhost { "on" } else { "off" }
        );
    }
    if let Some(pods) = node.socket_lb_pods {
        let _ = writeln!(
            out,
            "pods' TCP connections to ClusterIPs: {}",
            if pods {
                "at connect() (--socket-lb-pods)"
            } else {
                "at tc"
            }
        );
    }
    if let Some(routing) = &node.host_routing {
        let _ = writeln!(
            out,
            "host routing: {} ({} pod interfaces known, {} with a qdisc left to the stack)",
            routing.mode, routing.pod_interfaces, routing.shaped_interfaces
        );
    }
}

/// The node's part as text, a line each, but for the count of frontends
/// and backends, which heads the report.
fn node_text(node: &NodeReport) -> String {
    let mut out = String::new();
    let addresses: Vec<String> = node
        .addresses
        .iter()
        .map(|a| {
            if a.nodeports {
                format!("{} (NodePorts)", a.address)
            } else {
                a.address.to_string()
            }
        })
        .collect();
    let _ = writeln!(out, "node addresses: {}", addresses.join(", "));
    node_config_text(node, &mut out);
    let _ = match node.ipv6_address {
        Some(None) => writeln!(out, "node IPv6 address: none"),
        Some(Some(addr)) => writeln!(out, "node IPv6 address: {addr}"),
        None => Ok(()),
    };
    let _ = match node.clock_tick_ns {
        Some(0) => writeln!(out, "datapath clock: coarse monotonic (not calibrated)"),
        Some(tick) => writeln!(
            out,
            "datapath clock: jiffies x {tick} ns (HZ {})",
            (1_000_000_000 + tick / 2) / tick
        ),
        None => Ok(()),
    };
    let _ = writeln!(out, "attached: {}", node.attached.join(", "));
    let _ = match node.conntrack_capacity {
        Some(capacity) => writeln!(
            out,
            "conntrack entries: {} of {capacity} ({} connections)",
            node.conntrack_entries,
            capacity / 2
        ),
        None => writeln!(out, "conntrack entries: {}", node.conntrack_entries),
    };
    let _ = writeln!(
        out,
        "unassured conntrack entries: {} of {MAX_CT_NEW} (flows whose handshake or first exchange is under way)",
        node.unassured_entries
    );
    let _ = writeln!(out, "{}", node.socket_notes);
    for fill in &node.map_fill {
        let _ = match (fill.capacity, &fill.error) {
            (Some(capacity), _) if capacity > 0 => writeln!(
                out,
                "map fill {}: {} of {capacity} ({:.1}%)",
                fill.map,
                fill.entries,
                100.0 * fill.entries as f64 / f64::from(capacity)
            ),
            (_, Some(error)) => writeln!(
                out,
                "map fill {}: {} of unknown capacity ({error})",
                fill.map, fill.entries
            ),
            _ => writeln!(out, "map fill {}: {}", fill.map, fill.entries),
        };
    }
    if let Some(ones) = node.prefilter_bits_set {
        let bits = proxy_common::prefilter::BITS;
        let _ = writeln!(
            out,
            "prefilter: {ones} of {bits} bits set ({:.2}%)",
            100.0 * f64::from(ones) / f64::from(bits)
        );
    }
    if let Some(marked) = node.prefilter_flow_slots_marked {
        let slots = proxy_common::prefilter::flows::SLOTS;
        let _ = writeln!(
            out,
            "prefilter flow marks: {marked} of {slots} slots marked ({:.2}%)",
            100.0 * f64::from(marked) / f64::from(slots)
        );
    }
    if let Some(cidrs) = &node.service_cidrs {
        let ranges = if cidrs.ranges.is_empty() {
            "none".to_owned()
        } else {
            cidrs.ranges.join(", ")
        };
        let _ = writeln!(
            out,
            "service CIDRs: {ranges} ({} ClusterIPs held, {} of another proxy)",
            cidrs.cluster_ips, cidrs.foreign_cluster_ips
        );
    }
    for counter in &node.counters {
        let _ = writeln!(out, "counter {}: {}", counter.name, counter.value);
    }
    out
}

/// How close a map is to refusing writes (docs/maps.md, "Sizes").
fn fill(pins: &PinLayout, name: &'static str, entries: usize) -> MapFill {
    match MapInfo::from_pin(pins.map(name)).map(|info| info.max_entries()) {
        Ok(capacity) => MapFill {
            map: name,
            entries,
            capacity: Some(capacity),
            error: None,
        },
        Err(e) => MapFill {
            map: name,
            entries,
            capacity: None,
            error: Some(e.to_string()),
        },
    }
}

/// How many UDP sockets of this network namespace (the node's, where status
/// is run) hold the socket hooks' notes (they live in the sockets
/// themselves, `SOCK_NOTES` and `SOCK_NOTES6`), and how many of them, IPv4 or
/// IPv6, the `connect()` hook connected. The IPv6
/// notes count where their iterator is pinned (an agent of this version).
fn socket_notes(pins: &PinLayout) -> String {
    let notes = match sock_notes::read(&pins.sock_notes()) {
        Ok(notes) => notes,
        Err(e) => return format!("sockets with socket hook notes: unknown ({e})"),
    };
    let notes6 = sock_notes::read6(&pins.sock_notes6()).unwrap_or_default();
    let holding: std::collections::HashSet<u64> = notes.cookies().chain(notes6.cookies()).collect();
    let connected = sock_diag::SockDiag::open()
        .and_then(|mut diag| diag.connected_udp())
        .map_or_else(
            |e| format!("unknown ({e})"),
            |sockets| {
                let n = sockets
                    .iter()
                    .filter(|s| s.hook_connected(&notes, &notes6))
                    .count();
                n.to_string()
            },
        );
    format!(
        "sockets with socket hook notes: {} (connected UDP sockets here connected by the hook: {connected})",
        holding.len()
    )
}
