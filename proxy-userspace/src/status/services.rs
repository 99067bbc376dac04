//! The Services part of `ebpf-proxy status`: the service maps read back
//! (`StoredState`) grouped by Service and port, by the names the agent
//! keeps in `SERVICE_NAMES`. A frontend's kind is told from its key and
//! flags (`service_flags`), as the planner encodes them; its backends'
//! probabilities from its slots, each backend's share of them being the
//! share of new flows it gets (what kube-proxy's `statistic` rules give).

use std::{collections::BTreeMap, fmt::Write, net::IpAddr};

use proxy_common::{
    BackendSlotKey, ServiceKey, ServiceValue, backend_flags, ct_dir, scope, service_drop,
    service_flags,
};
use serde::Serialize;

use crate::{
    datapath::{refusal_records::Recorded, service_counters::Totals},
    planner::{StoredState, encode},
};

/// A Service, with every port of it that has a frontend here.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ServiceReport {
    /// None for the frontends of service ids without a name (written by an
    /// agent that kept no names): "(unnamed)".
    pub namespace: Option<String>,
    pub name: Option<String>,
    pub ports: Vec<PortReport>,
    /// What the agent refused of it and why (`SERVICE_REFUSALS`): an
    /// address, or the whole Service (then it has no ports here).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub refused: Vec<Recorded>,
}

/// One port of a Service: one service id.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PortReport {
    /// `spec.ports[].name`; empty for an unnamed port.
    pub name: String,
    /// `spec.ports[].port`; 0 where neither the name nor a frontend other
    /// than a NodePort tells it.
    pub port: u16,
    pub protocol: String,
    pub service_id: u32,
    pub frontends: Vec<FrontendReport>,
    /// Those of the port's first frontend (a ClusterIP, where it has one);
    /// a frontend with others lists its own.
    pub backends: Vec<BackendReport>,
    /// Its traffic since the agent started (`SERVICE_COUNTERS`); None where
    /// the pins have no counters or the id is past their size.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub counters: Option<CountersReport>,
}

/// A Service port's counters, summed over CPUs, as the metrics
/// `ebpf_proxy_service_*_total` give them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CountersReport {
    pub flows: u64,
    pub packets: Directions,
    /// Whole IP packets.
    pub bytes: Directions,
    /// New flows refused for want of endpoints.
    pub rejected: u64,
    /// New flows dropped, by reason (`service_drop::NAMES`).
    pub dropped: BTreeMap<&'static str, u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Directions {
    pub to_backend: u64,
    pub to_client: u64,
}

impl From<&Totals> for CountersReport {
    fn from(t: &Totals) -> Self {
        let dir = |of: &[u64; 2]| Directions {
            to_backend: of[ct_dir::FORWARD as usize],
            to_client: of[ct_dir::REPLY as usize],
        };
        CountersReport {
            flows: t.flows,
            packets: dir(&t.packets),
            bytes: dir(&t.bytes),
            rejected: t.rejected,
            dropped: service_drop::NAMES.iter().copied().zip(t.dropped).collect(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FrontendReport {
    pub address: IpAddr,
    pub port: u16,
    pub protocol: String,
    /// `ClusterIP`, `NodePort`, `LoadBalancer` or `ExternalIP`.
    pub kind: &'static str,
    /// `affinity`, `source-ranges`, `in-cluster` (the entry of clients of
    /// the cluster, under a Local external traffic policy),
    /// `no-endpoints-reject`, `no-endpoints-drop`, `maglev` (new flows
    /// pick by the Maglev table its slots hold).
    pub flags: Vec<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub affinity_timeout_s: Option<u32>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub source_ranges: Vec<String>,
    /// Its backends, where they are not the port's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backends: Option<Vec<BackendReport>>,
    /// Slots of its set that are missing from `BACKEND_SLOTS`, or name no
    /// backend: a crash mid-update, which the next sync repairs.
    #[serde(skip_serializing_if = "is_zero")]
    pub missing_slots: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BackendReport {
    pub address: IpAddr,
    pub port: u16,
    /// The share of the frontend's new flows it gets, 0 to 1.
    pub probability: f64,
    /// `local` (on this node), `terminating`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub flags: Vec<&'static str>,
}

#[expect(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's skip_serializing_if passes a reference"
)]
fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The Services of `stored`, sorted by namespace and name, the unnamed
/// last; only `only` (namespace, name) when given.
pub fn services(stored: &StoredState, only: Option<(&str, &str)>) -> Vec<ServiceReport> {
    let mut by_id: BTreeMap<u32, Vec<(&ServiceKey, &ServiceValue)>> = BTreeMap::new();
    for (key, value) in &stored.services {
        by_id
            .entry(value.service_id)
            .or_default()
            .push((key, value));
    }
    // (namespace, name) -> ports; None -> the unnamed.
    let mut grouped: BTreeMap<Option<(String, String)>, Vec<PortReport>> = BTreeMap::new();
    for (id, mut frontends) in by_id {
        let name = stored.names.get(&id);
        let service = name.map(|n| (encode::name_text(&n.namespace), encode::name_text(&n.name)));
        if let Some((namespace, name)) = only
            && service
                .as_ref()
                .is_none_or(|(ns, n)| ns != namespace || n != name)
        {
            continue;
        }
        frontends.sort_by_key(|(key, value)| (kind_rank(key, value), **key));
        let reports: Vec<(FrontendReport, Vec<BackendReport>)> = frontends
            .iter()
            .map(|(key, value)| frontend(stored, key, value))
            .collect();
        let shared = reports.first().map(|(_, b)| b.clone()).unwrap_or_default();
        let port = name
            .map(|n| n.port)
            .filter(|p| *p != 0)
            .or_else(|| {
                reports
                    .iter()
                    .find(|(f, _)| f.kind != "NodePort")
                    .map(|(f, _)| f.port)
            })
            .unwrap_or(0);
        let protocol = reports
            .first()
            .map(|(f, _)| f.protocol.clone())
            .unwrap_or_default();
        grouped.entry(service).or_default().push(PortReport {
            name: name
                .map(|n| encode::name_text(&n.port_name))
                .unwrap_or_default(),
            port,
            protocol,
            service_id: id,
            counters: None,
            frontends: reports
                .into_iter()
                .map(|(mut f, backends)| {
                    if backends != shared {
                        f.backends = Some(backends);
                    }
                    f
                })
                .collect(),
            backends: shared,
        });
    }
    let mut out: Vec<ServiceReport> = grouped
        .into_iter()
        .map(|(service, mut ports)| {
            ports.sort_by(|a, b| {
                (&a.name, a.port, &a.protocol).cmp(&(&b.name, b.port, &b.protocol))
            });
            let (namespace, name) = service.unzip();
            ServiceReport {
                namespace,
                name,
                ports,
                refused: Vec::new(),
            }
        })
        .collect();
    // BTreeMap puts None first; the unnamed go after the named.
    let unnamed = usize::from(out.first().is_some_and(|s| s.name.is_none()));
    out.rotate_left(unnamed);
    out
}

/// Adds to `services` each port's `counters` (by service id) and each
/// Service's refusals, the Services refused as a whole among them (only
/// `only`'s, when given), in the order `services` keeps.
pub fn annotate(
    services: &mut Vec<ServiceReport>,
    counters: &BTreeMap<u32, Totals>,
    refusals: BTreeMap<(String, String), Vec<Recorded>>,
    only: Option<(&str, &str)>,
) {
    for port in services.iter_mut().flat_map(|s| s.ports.iter_mut()) {
        port.counters = counters.get(&port.service_id).map(CountersReport::from);
    }
    for ((namespace, name), refused) in refusals {
        if only.is_some_and(|(ns, n)| ns != namespace || n != name) {
            continue;
        }
        match services.iter_mut().find(|s| {
            s.namespace.as_deref() == Some(&namespace) && s.name.as_deref() == Some(&name)
        }) {
            Some(service) => service.refused = refused,
            None => services.push(ServiceReport {
                namespace: Some(namespace),
                name: Some(name),
                ports: Vec::new(),
                refused,
            }),
        }
    }
    // The named by name, the unnamed last, as `services` gives them.
    services.sort_by(|a, b| {
        (a.name.is_none(), &a.namespace, &a.name).cmp(&(b.name.is_none(), &b.namespace, &b.name))
    });
}

fn counters_text(c: &CountersReport) -> String {
    let mut text = format!(
        "{} flows, packets {}/{}, bytes {}/{} (to backend/to client)",
        c.flows, c.packets.to_backend, c.packets.to_client, c.bytes.to_backend, c.bytes.to_client
    );
    if c.rejected > 0 {
        let _ = write!(text, ", {} rejected", c.rejected);
    }
    for (reason, n) in &c.dropped {
        if *n > 0 {
            let _ = write!(text, ", {n} dropped ({reason})");
        }
    }
    text
}

/// The frontend `key` and its backends.
fn frontend(
    stored: &StoredState,
    key: &ServiceKey,
    value: &ServiceValue,
) -> (FrontendReport, Vec<BackendReport>) {
    let mut flags = Vec::new();
    if key.scope == scope::INTERNAL {
        flags.push("in-cluster");
    }
    let affinity = value.flags & service_flags::AFFINITY != 0;
    if affinity {
        flags.push("affinity");
    }
    if value.flags & service_flags::MAGLEV != 0 {
        flags.push("maglev");
    }
    let mut source_ranges = Vec::new();
    if value.flags & service_flags::SOURCE_RANGES != 0 {
        flags.push("source-ranges");
        source_ranges = stored
            .source_ranges
            .iter()
            .filter(|(_, k)| k.frontend == *key)
            .map(|entry| {
                let text = encode::source_range_string(entry);
                text.rsplit(" from ").next().unwrap_or_default().to_string()
            })
            .collect();
    }
    if value.count == 0 {
        flags.push(if value.flags & service_flags::NO_EP_DROP != 0 {
            "no-endpoints-drop"
        } else {
            "no-endpoints-reject"
        });
    }
    // Backend ids in the order of their first slot, with their slots.
    let mut shares: Vec<(u32, u32)> = Vec::new();
    let mut missing_slots = 0;
    for slot in 0..value.count {
        let sk = BackendSlotKey {
            slot_set: value.slot_set,
            slot,
        };
        match stored.slots.get(&sk) {
            Some(id) if stored.backends.contains_key(id) => {
                match shares.iter_mut().find(|(b, _)| b == id) {
                    Some((_, n)) => *n += 1,
                    None => shares.push((*id, 1)),
                }
            }
            _ => missing_slots += 1,
        }
    }
    let total: u32 = shares.iter().map(|(_, n)| n).sum();
    let backends = shares
        .iter()
        .map(|(id, n)| {
            let b = &stored.backends[id];
            let mut flags = Vec::new();
            if b.flags & backend_flags::LOCAL != 0 {
                flags.push("local");
            }
            if b.flags & backend_flags::TERMINATING != 0 {
                flags.push("terminating");
            }
            BackendReport {
                address: encode::words_addr(&b.addr_be),
                port: u16::from_be(b.port_be),
                probability: f64::from(*n) / f64::from(total),
                flags,
            }
        })
        .collect();
    let report = FrontendReport {
        address: encode::words_addr(&key.addr_be),
        port: u16::from_be(key.port_be),
        protocol: encode::protocol_from_number(key.proto)
            .map_or_else(|| format!("proto {}", key.proto), |p| p.to_string()),
        kind: kind(key, value),
        flags,
        affinity_timeout_s: affinity.then_some(value.affinity_timeout_s),
        source_ranges,
        backends: None,
        missing_slots,
    };
    (report, backends)
}

/// The kind of a frontend, as the planner encodes it: a NodePort is keyed
/// by the unspecified address; a LoadBalancer address is flagged so;
/// every other external frontend (flagged `EXTERNAL`, or the in-cluster
/// entry of one) is an ExternalIP; the rest are ClusterIPs.
fn kind(key: &ServiceKey, value: &ServiceValue) -> &'static str {
    if encode::words_addr(&key.addr_be).is_unspecified() {
        "NodePort"
    } else if value.flags & service_flags::LOAD_BALANCER != 0 {
        "LoadBalancer"
    } else if value.flags & service_flags::EXTERNAL != 0 || key.scope == scope::INTERNAL {
        "ExternalIP"
    } else {
        "ClusterIP"
    }
}

/// ClusterIPs first, so that a port's backends are its ClusterIP's.
fn kind_rank(key: &ServiceKey, value: &ServiceValue) -> u8 {
    match kind(key, value) {
        "ClusterIP" => 0,
        "NodePort" => 1,
        "ExternalIP" => 2,
        _ => 3,
    }
}

/// `ip:port` as sockets print it.
fn socket(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(ip) => format!("{ip}:{port}"),
        IpAddr::V6(ip) => format!("[{ip}]:{port}"),
    }
}

/// "50%", "33.33%".
fn percent(probability: f64) -> String {
    let percent = probability * 100.0;
    if (percent - percent.round()).abs() < 0.005 {
        format!("{percent:.0}%")
    } else {
        format!("{percent:.2}%")
    }
}

fn backends_text(backends: &[BackendReport]) -> String {
    if backends.is_empty() {
        return "-".to_string();
    }
    backends
        .iter()
        .map(|b| {
            let mut text = format!("{} {}", socket(b.address, b.port), percent(b.probability));
            for flag in &b.flags {
                text.push_str(&format!(" {flag}"));
            }
            text
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The Services as text: a line per Service, a line per port with its
/// backends, a line per frontend.
pub fn text(services: &[ServiceReport]) -> String {
    let mut out = String::new();
    for service in services {
        match (&service.namespace, &service.name) {
            (Some(namespace), Some(name)) => {
                let _ = writeln!(out, "{namespace}/{name}");
            }
            _ => out.push_str("(unnamed)\n"),
        }
        for refusal in &service.refused {
            let _ = writeln!(out, "  refused ({}): {}", refusal.reason, refusal.text);
        }
        for port in &service.ports {
            let name = if port.name.is_empty() {
                String::new()
            } else {
                format!("{} ", port.name)
            };
            let _ = writeln!(
                out,
                "  port {name}{}/{} (service id {}) -> {}",
                port.port,
                port.protocol,
                port.service_id,
                backends_text(&port.backends)
            );
            if let Some(counters) = &port.counters {
                let _ = writeln!(out, "    traffic: {}", counters_text(counters));
            }
            for f in &port.frontends {
                let mut notes = Vec::new();
                for flag in &f.flags {
                    notes.push(match *flag {
                        "affinity" => {
                            format!("affinity {}s", f.affinity_timeout_s.unwrap_or_default())
                        }
                        "source-ranges" => format!("from {}", f.source_ranges.join(" ")),
                        "no-endpoints-reject" => "no endpoints: reject".to_string(),
                        "no-endpoints-drop" => "no endpoints: drop".to_string(),
                        other => other.to_string(),
                    });
                }
                if f.missing_slots > 0 {
                    notes.push(format!("{} slots missing", f.missing_slots));
                }
                // A NodePort's unspecified address stands for every
                // address of the node it is served on.
                let _ = write!(
                    out,
                    "    {} {}/{}",
                    f.kind,
                    socket(f.address, f.port),
                    f.protocol
                );
                if !notes.is_empty() {
                    let _ = write!(out, ", {}", notes.join(", "));
                }
                if let Some(backends) = &f.backends {
                    let _ = write!(out, " -> {}", backends_text(backends));
                }
                out.push('\n');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use proxy_common::{Backend, PROTO_TCP, PROTO_UDP, SourceRangeKey};

    use super::*;
    use crate::model::{Protocol, ServicePortName};

    fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(a, b, c, d))
    }

    fn key(ip: IpAddr, port: u16, proto: u8, scope: u8) -> ServiceKey {
        ServiceKey {
            addr_be: encode::addr_words(ip),
            port_be: port.to_be(),
            proto,
            scope,
        }
    }

    /// A hand-built state: kube-dns (UDP, two backends, one of them in two
    /// of three slots), shop/web (ClusterIP, a NodePort of local backends
    /// only with affinity, a LoadBalancer with source ranges and its
    /// in-cluster entry, an ExternalIP without endpoints), an IPv6
    /// ClusterIP, and a frontend of an id without a name.
    #[expect(
        clippy::too_many_lines,
        reason = "one hand-built state, entry by entry"
    )]
    pub(super) fn state() -> StoredState {
        let mut s = StoredState::default();
        let mut backend = |id: u32, ip: IpAddr, port: u16, flags: u8| {
            s.backends.insert(
                id,
                Backend {
                    addr_be: encode::addr_words(ip),
                    port_be: port.to_be(),
                    proto: PROTO_TCP,
                    flags,
                },
            );
        };
        backend(1, v4(10, 0, 1, 5), 8053, 0);
        backend(2, v4(10, 0, 1, 6), 8053, backend_flags::LOCAL);
        backend(3, v4(10, 0, 2, 7), 8080, backend_flags::LOCAL);
        backend(4, v4(10, 0, 2, 8), 8080, backend_flags::TERMINATING);
        backend(
            5,
            IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 9)),
            8080,
            0,
        );
        let mut slots = |set: u32, ids: &[u32]| {
            for (slot, id) in ids.iter().enumerate() {
                s.slots.insert(
                    BackendSlotKey {
                        slot_set: set,
                        slot: slot as u32,
                    },
                    *id,
                );
            }
        };
        slots(1, &[1, 2, 1]);
        slots(2, &[3, 4]);
        slots(3, &[3]);
        slots(4, &[5]);
        slots(5, &[4]);
        let value = |service_id: u32, slot_set: u32, count: u32, flags: u32| ServiceValue {
            service_id,
            slot_set,
            count,
            flags,
            affinity_timeout_s: if flags & service_flags::AFFINITY != 0 {
                10800
            } else {
                0
            },
            hash_seed: 0,
        };
        let lb = key(v4(192, 0, 2, 10), 80, PROTO_TCP, scope::ANY);
        for (k, v) in [
            (
                key(v4(10, 96, 0, 10), 53, PROTO_UDP, scope::ANY),
                value(7, 1, 3, 0),
            ),
            (
                key(v4(10, 96, 0, 20), 80, PROTO_TCP, scope::ANY),
                value(9, 2, 2, 0),
            ),
            (
                key(v4(0, 0, 0, 0), 30080, PROTO_TCP, scope::ANY),
                value(9, 3, 1, service_flags::EXTERNAL | service_flags::AFFINITY),
            ),
            (
                lb,
                value(
                    9,
                    2,
                    2,
                    service_flags::EXTERNAL
                        | service_flags::SOURCE_RANGES
                        | service_flags::LOAD_BALANCER,
                ),
            ),
            (
                key(v4(192, 0, 2, 10), 80, PROTO_TCP, scope::INTERNAL),
                value(9, 2, 2, service_flags::LOAD_BALANCER),
            ),
            (
                key(v4(198, 51, 100, 1), 80, PROTO_TCP, scope::ANY),
                value(9, 6, 0, service_flags::EXTERNAL | service_flags::NO_EP_DROP),
            ),
            (
                key(
                    IpAddr::V6(Ipv6Addr::new(0xfd00, 0x96, 0, 0, 0, 0, 0, 0x20)),
                    80,
                    PROTO_TCP,
                    scope::ANY,
                ),
                value(10, 4, 1, 0),
            ),
            (
                key(v4(10, 96, 0, 30), 443, PROTO_TCP, scope::ANY),
                value(3, 5, 1, 0),
            ),
        ] {
            s.services.insert(k, v);
        }
        s.source_ranges.insert((
            proxy_common::source_range_prefix(96 + 24),
            SourceRangeKey {
                frontend: lb,
                client_be: encode::addr_words(v4(203, 0, 113, 0)),
            },
        ));
        for (id, service, port) in [
            (
                7,
                ServicePortName::new("kube-system", "kube-dns", "dns", Protocol::Udp),
                53,
            ),
            (
                9,
                ServicePortName::new("shop", "web", "", Protocol::Tcp),
                80,
            ),
            (
                10,
                ServicePortName::new("shop", "web6", "http", Protocol::Tcp),
                80,
            ),
        ] {
            s.names.insert(id, encode::service_name(&service, port));
        }
        s
    }

    #[test]
    fn services_read_as_text_by_name_port_and_frontend() {
        let text = text(&services(&state(), None));
        let expected = "\
kube-system/kube-dns
  port dns 53/UDP (service id 7) -> 10.0.1.5:8053 66.67%, 10.0.1.6:8053 33.33% local
    ClusterIP 10.96.0.10:53/UDP
shop/web
  port 80/TCP (service id 9) -> 10.0.2.7:8080 50% local, 10.0.2.8:8080 50% terminating
    ClusterIP 10.96.0.20:80/TCP
    NodePort 0.0.0.0:30080/TCP, affinity 10800s -> 10.0.2.7:8080 100% local
    ExternalIP 198.51.100.1:80/TCP, no endpoints: drop -> -
    LoadBalancer 192.0.2.10:80/TCP, from 203.0.113.0/24
    LoadBalancer 192.0.2.10:80/TCP, in-cluster
shop/web6
  port http 80/TCP (service id 10) -> [fd00::9]:8080 100%
    ClusterIP [fd00:96::20]:80/TCP
(unnamed)
  port 443/TCP (service id 3) -> 10.0.2.8:8080 100% terminating
    ClusterIP 10.96.0.30:443/TCP
";
        assert!(
            text == expected,
            "the Services part differs:\n--- got\n{text}--- expected\n{expected}"
        );
    }

    #[test]
    fn services_read_as_json_with_probabilities_and_plain_ipv6_addresses() {
        let json = serde_json::to_value(services(&state(), None)).expect("serializable");
        let dns = &json[0];
        assert_eq!(dns["namespace"], "kube-system", "{dns}");
        assert_eq!(dns["name"], "kube-dns", "{dns}");
        let port = &dns["ports"][0];
        assert_eq!(
            (
                &port["name"],
                &port["port"],
                &port["protocol"],
                &port["service_id"]
            ),
            (
                &serde_json::json!("dns"),
                &serde_json::json!(53),
                &serde_json::json!("UDP"),
                &serde_json::json!(7)
            ),
            "{port}"
        );
        assert_eq!(
            port["frontends"],
            serde_json::json!([{
                "address": "10.96.0.10", "port": 53, "protocol": "UDP",
                "kind": "ClusterIP", "flags": [],
            }]),
            "{port}"
        );
        let probabilities: Vec<(String, f64)> = port["backends"]
            .as_array()
            .expect("backends")
            .iter()
            .map(|b| {
                (
                    b["address"].as_str().unwrap_or("?").to_string(),
                    b["probability"].as_f64().unwrap_or(-1.0),
                )
            })
            .collect();
        assert_eq!(
            probabilities,
            [
                ("10.0.1.5".to_string(), 2.0 / 3.0),
                ("10.0.1.6".to_string(), 1.0 / 3.0)
            ],
            "{port}"
        );
        let web6 = &json[2]["ports"][0];
        assert_eq!(web6["frontends"][0]["address"], "fd00:96::20", "{web6}");
        assert_eq!(web6["backends"][0]["address"], "fd00::9", "{web6}");
        let unnamed = &json[3];
        assert_eq!(
            (&unnamed["namespace"], &unnamed["name"]),
            (&serde_json::Value::Null, &serde_json::Value::Null),
            "{unnamed}"
        );
    }

    #[test]
    fn one_service_alone_when_asked_for() {
        let only = services(&state(), Some(("shop", "web")));
        let names: Vec<_> = only
            .iter()
            .map(|s| (s.namespace.clone(), s.name.clone()))
            .collect();
        assert_eq!(names, [(Some("shop".into()), Some("web".into()))]);
        assert_eq!(only[0].ports[0].frontends.len(), 5, "{:?}", only[0]);
        assert!(
            services(&state(), Some(("shop", "nothing"))).is_empty(),
            "a Service not in the maps"
        );
    }
}

#[cfg(test)]
mod annotate_tests {
    use super::*;
    use tests::state as tests_state;

    fn refusal(reason: &str, text: &str) -> Recorded {
        Recorded {
            reason: reason.to_string(),
            text: text.to_string(),
        }
    }

    #[test]
    fn counters_go_to_their_ports_and_refusals_to_their_services_by_name() {
        let mut reports = services(&tests_state(), None);
        let counters = BTreeMap::from([(
            9,
            Totals {
                packets: [10, 8],
                bytes: [1000, 2000],
                flows: 3,
                rejected: 2,
                dropped: [0, 1, 0],
            },
        )]);
        let refusals = BTreeMap::from([
            (
                ("shop".to_string(), "web".to_string()),
                vec![refusal(
                    "cluster_ip",
                    "externalIP 10.96.0.10 is kube-dns's ClusterIP",
                )],
            ),
            (
                ("aaa".to_string(), "hollow".to_string()),
                vec![refusal("invalid", "spec is missing")],
            ),
        ]);
        annotate(&mut reports, &counters, refusals, None);
        let names: Vec<_> = reports.iter().map(|s| s.name.clone()).collect();
        assert_eq!(
            names,
            [
                Some("hollow".to_string()),
                Some("kube-dns".to_string()),
                Some("web".to_string()),
                Some("web6".to_string()),
                None
            ],
            "a Service refused as a whole is listed by name, the unnamed last"
        );
        let text = text(&reports);
        for line in [
            "aaa/hollow\n  refused (invalid): spec is missing\nkube-system/kube-dns\n",
            "shop/web\n  refused (cluster_ip): externalIP 10.96.0.10 is kube-dns's ClusterIP\n",
            "    traffic: 3 flows, packets 10/8, bytes 1000/2000 (to backend/to client), 2 rejected, 1 dropped (no_endpoint)\n",
        ] {
            assert!(text.contains(line), "no {line:?} in:\n{text}");
        }
        let json = serde_json::to_value(&reports).expect("serializable");
        assert_eq!(
            json[2]["ports"][0]["counters"],
            serde_json::json!({
                "flows": 3,
                "packets": {"to_backend": 10, "to_client": 8},
                "bytes": {"to_backend": 1000, "to_client": 2000},
                "rejected": 2,
                "dropped": {"no_endpoint": 1, "snat_exhausted": 0, "source_range": 0},
            }),
            "{json:#}"
        );
        assert!(
            json[1]["ports"][0].get("counters").is_none() && json[1].get("refused").is_none(),
            "kube-dns, without counters or refusals, shows neither: {:#}",
            json[1]
        );
    }

    #[test]
    fn a_narrowed_report_takes_only_its_services_refusals() {
        let mut reports = services(&tests_state(), Some(("shop", "web")));
        let refusals = BTreeMap::from([(
            ("aaa".to_string(), "hollow".to_string()),
            vec![refusal("invalid", "spec is missing")],
        )]);
        annotate(
            &mut reports,
            &BTreeMap::new(),
            refusals,
            Some(("shop", "web")),
        );
        assert_eq!(reports.len(), 1, "{reports:?}");
        assert!(reports[0].refused.is_empty(), "{reports:?}");
    }
}
