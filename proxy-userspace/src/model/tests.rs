//! Table-driven tests of `service_frontends`: each case is a Service, its
//! slices and the node in, and the frontends (one line each: kind, key,
//! ordered backends, empty-set verdict, affinity) or an error out.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::{
        core::v1::{
            ClientIPConfig, LoadBalancerIngress, LoadBalancerStatus, Service, ServicePort,
            ServiceSpec, ServiceStatus, SessionAffinityConfig,
        },
        discovery::v1::{
            Endpoint, EndpointConditions, EndpointHints, EndpointPort, EndpointSlice, ForNode,
            ForZone,
        },
    },
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
};

use super::*;

// ---- builders -------------------------------------------------------------

type Labels = Option<BTreeMap<String, String>>;

#[expect(
    clippy::unnecessary_wraps,
    reason = "builds the optional map the object's `labels` field holds"
)]
fn labels(pairs: &[(&str, &str)]) -> Labels {
    Some(
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

pub(super) fn port(name: &str, number: i32, protocol: &str, target: IntOrString) -> ServicePort {
    ServicePort {
        name: (!name.is_empty()).then(|| name.to_owned()),
        port: number,
        protocol: (!protocol.is_empty()).then(|| protocol.to_owned()),
        target_port: Some(target),
        ..Default::default()
    }
}

/// demo/web: ClusterIP 10.96.0.10, port "http" 80/TCP → 8080, then `edit`.
/// The other model tests start from it too.
pub(super) fn svc(edit: impl FnOnce(&mut Service)) -> Service {
    let mut service = Service {
        metadata: ObjectMeta {
            namespace: Some("demo".into()),
            name: Some("web".into()),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            cluster_ip: Some("10.96.0.10".into()),
            cluster_ips: Some(vec!["10.96.0.10".into()]),
            ports: Some(vec![port("http", 80, "TCP", IntOrString::Int(8080))]),
            ..Default::default()
        }),
        ..Default::default()
    };
    edit(&mut service);
    service
}

pub(super) fn spec(service: &mut Service) -> &mut ServiceSpec {
    service.spec.as_mut().expect("test services have a spec")
}

fn set_cluster_ips(service: &mut Service, ips: &[&str]) {
    let spec = spec(service);
    spec.cluster_ip = ips.first().map(ToString::to_string);
    spec.cluster_ips = Some(ips.iter().map(ToString::to_string).collect());
}

fn set_lb_ingress(service: &mut Service, ingress: Vec<LoadBalancerIngress>) {
    service.status = Some(ServiceStatus {
        load_balancer: Some(LoadBalancerStatus {
            ingress: Some(ingress),
        }),
        ..Default::default()
    });
}

/// An endpoint with nil conditions (ready, serving, not terminating).
#[derive(Clone, Default)]
struct Ep {
    ip: &'static str,
    ready: Option<bool>,
    serving: Option<bool>,
    terminating: Option<bool>,
    node: Option<&'static str>,
    zones: &'static [&'static str],
    nodes: &'static [&'static str],
}

fn ep(ip: &'static str) -> Ep {
    Ep {
        ip,
        ..Default::default()
    }
}

impl Ep {
    /// Conditions as the EndpointSlice controller publishes them.
    fn conditions(mut self, ready: bool, serving: bool, terminating: bool) -> Self {
        self.ready = Some(ready);
        self.serving = Some(serving);
        self.terminating = Some(terminating);
        self
    }
    fn not_ready(self) -> Self {
        self.conditions(false, false, false)
    }
    /// A pod being deleted that still passes its readiness probe.
    fn terminating(self) -> Self {
        self.conditions(false, true, true)
    }
    fn on(mut self, node: &'static str) -> Self {
        self.node = Some(node);
        self
    }
    fn zones(mut self, zones: &'static [&'static str]) -> Self {
        self.zones = zones;
        self
    }
    fn for_nodes(mut self, nodes: &'static [&'static str]) -> Self {
        self.nodes = nodes;
        self
    }
}

/// A slice of demo/web.
fn slice(name: &str, address_type: &str, ports: &[(&str, i32, &str)], eps: &[Ep]) -> EndpointSlice {
    slice_of("web", name, address_type, ports, eps)
}

fn slice_of(
    service: &str,
    name: &str,
    address_type: &str,
    ports: &[(&str, i32, &str)],
    eps: &[Ep],
) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            namespace: Some("demo".into()),
            name: Some(name.into()),
            labels: labels(&[(LABEL_SERVICE_NAME, service)]),
            ..Default::default()
        },
        address_type: address_type.into(),
        ports: Some(
            ports
                .iter()
                .map(|(name, number, protocol)| EndpointPort {
                    name: Some(name.to_string()),
                    port: Some(*number),
                    protocol: (!protocol.is_empty()).then(|| protocol.to_string()),
                    ..Default::default()
                })
                .collect(),
        ),
        endpoints: eps
            .iter()
            .map(|e| Endpoint {
                addresses: vec![e.ip.into()],
                conditions: Some(EndpointConditions {
                    ready: e.ready,
                    serving: e.serving,
                    terminating: e.terminating,
                }),
                node_name: e.node.map(Into::into),
                hints: (!e.zones.is_empty() || !e.nodes.is_empty()).then(|| EndpointHints {
                    for_zones: (!e.zones.is_empty()).then(|| {
                        e.zones
                            .iter()
                            .map(|z| ForZone {
                                name: z.to_string(),
                            })
                            .collect()
                    }),
                    for_nodes: (!e.nodes.is_empty()).then(|| {
                        e.nodes
                            .iter()
                            .map(|n| ForNode {
                                name: n.to_string(),
                            })
                            .collect()
                    }),
                }),
                ..Default::default()
            })
            .collect(),
    }
}

/// The usual slice: port "http" 8080/TCP.
fn http_slice(name: &str, eps: &[Ep]) -> EndpointSlice {
    slice(name, "IPv4", &[("http", 8080, "TCP")], eps)
}

fn node(name: &str, zone: Option<&str>) -> NodeInfo {
    NodeInfo {
        name: name.into(),
        zone: zone.map(Into::into),
    }
}

// ---- rendering ------------------------------------------------------------

fn render_backend(b: &BackendAddr) -> String {
    let flags: Vec<&str> = [(b.local, "local"), (b.terminating, "terminating")]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
    if flags.is_empty() {
        b.host_port()
    } else {
        format!("{}({})", b.host_port(), flags.join(","))
    }
}

/// One line per frontend: `Kind key -> [backends] Verdict[ affinity=Ns]`.
fn render(f: &Frontend) -> String {
    let backends: Vec<String> = f.backends.iter().map(render_backend).collect();
    let affinity = f
        .affinity_timeout_s
        .map(|t| format!(" affinity={t}s"))
        .unwrap_or_default();
    let from = if f.source_ranges.is_empty() {
        String::new()
    } else {
        let ranges: Vec<String> = f.source_ranges.iter().map(ToString::to_string).collect();
        format!(" from=[{}]", ranges.join(", "))
    };
    format!(
        "{:?} {} -> [{}] {:?}{affinity}{from}",
        f.kind,
        f.key,
        backends.join(", "),
        f.no_endpoints
    )
}

// ---- the table ------------------------------------------------------------

enum Want {
    /// The rendered frontends, in order.
    Frontends(&'static [&'static str]),
    /// The error's text contains each of these.
    Error(&'static [&'static str]),
}

struct Case {
    name: &'static str,
    service: Service,
    slices: Vec<EndpointSlice>,
    node: NodeInfo,
    config: ModelConfig,
    want: Want,
}

impl Case {
    fn new(name: &'static str, service: Service, slices: Vec<EndpointSlice>, want: Want) -> Self {
        Case {
            name,
            service,
            slices,
            node: node("node-a", Some("zone-a")),
            config: ModelConfig::default(),
            want,
        }
    }
    fn node(mut self, node: NodeInfo) -> Self {
        self.node = node;
        self
    }
    fn config(mut self, proxy_name: &str) -> Self {
        self.config.service_proxy_name = Some(proxy_name.into());
        self
    }
}

use Want::{Error as Fails, Frontends as Gives};

fn run(cases: Vec<Case>) {
    let mut failures = Vec::new();
    for case in cases {
        let slices: Vec<Slice> = case.slices.iter().map(Slice::from).collect();
        let slices: Vec<&Slice> = slices.iter().collect();
        let got = service_frontends(&case.service, &slices, &case.node, &case.config);
        match (&case.want, got) {
            (Gives(want), Ok(frontends)) => {
                let got: Vec<String> = frontends.iter().map(render).collect();
                if got != *want {
                    let first = (0..want.len().max(got.len()))
                        .find(|&i| want.get(i).map(ToString::to_string) != got.get(i).cloned())
                        .unwrap_or(0);
                    failures.push(format!(
                        "case {:?}: frontends differ from line {first}\n  want:\n    {}\n  got:\n    {}",
                        case.name,
                        want.join("\n    "),
                        got.join("\n    ")
                    ));
                }
            }
            (Gives(want), Err(e)) => failures.push(format!(
                "case {:?}: wanted frontends\n    {}\n  got error: {e}",
                case.name,
                want.join("\n    ")
            )),
            (Fails(parts), Ok(frontends)) => failures.push(format!(
                "case {:?}: wanted an error containing {parts:?}, got frontends\n    {}",
                case.name,
                frontends
                    .iter()
                    .map(render)
                    .collect::<Vec<_>>()
                    .join("\n    ")
            )),
            (Fails(parts), Err(e)) => {
                let text = e.to_string();
                let missing: Vec<&&str> = parts.iter().filter(|p| !text.contains(**p)).collect();
                if !missing.is_empty() {
                    failures.push(format!(
                        "case {:?}: error {text:?} does not contain {missing:?}",
                        case.name
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "a table of cases for one aspect of the Service, read together"
)]
fn ports_protocols_and_ordering() {
    run(vec![
        Case::new(
            "ready endpoints sorted as \"ip:port\" strings: .10: before .1: ('0' < ':') before .2",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[ep("10.0.0.2"), ep("10.0.0.10"), ep("10.0.0.1")],
            )],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.10:8080, 10.0.0.1:8080, 10.0.0.2:8080] Reject",
            ]),
        ),
        Case::new(
            "no slices: empty set, REJECT",
            svc(|_| {}),
            vec![],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [] Reject"]),
        ),
        Case::new(
            "protocol defaults to TCP on service and slice ports",
            svc(|s| spec(s).ports = Some(vec![port("http", 80, "", IntOrString::Int(8080))])),
            vec![slice(
                "web-1",
                "IPv4",
                &[("http", 8080, "")],
                &[ep("10.0.0.1")],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject"]),
        ),
        Case::new(
            "UDP and SCTP ports, each with the slice port of its name",
            svc(|s| {
                spec(s).ports = Some(vec![
                    port("dns", 53, "UDP", IntOrString::Int(5353)),
                    port("sig", 9, "SCTP", IntOrString::Int(9999)),
                ]);
            }),
            vec![slice(
                "web-1",
                "IPv4",
                &[("dns", 5353, "UDP"), ("sig", 9999, "SCTP")],
                &[ep("10.0.0.1")],
            )],
            Gives(&[
                "ClusterIp 10.96.0.10:53/UDP -> [10.0.0.1:5353] Reject",
                "ClusterIp 10.96.0.10:9/SCTP -> [10.0.0.1:9999] Reject",
            ]),
        ),
        Case::new(
            "named targetPort: the number comes from each slice's port",
            svc(|s| {
                spec(s).ports = Some(vec![port(
                    "http",
                    80,
                    "TCP",
                    IntOrString::String("web".into()),
                )]);
            }),
            vec![
                http_slice("web-1", &[ep("10.0.0.1")]),
                slice("web-2", "IPv4", &[("http", 9090, "TCP")], &[ep("10.0.0.2")]),
            ],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080, 10.0.0.2:9090] Reject"]),
        ),
        Case::new(
            "numeric targetPort is not used: the slice port is",
            svc(|s| spec(s).ports = Some(vec![port("http", 80, "TCP", IntOrString::Int(1234))])),
            vec![http_slice("web-1", &[ep("10.0.0.1")])],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject"]),
        ),
        Case::new(
            "a slice port of another name does not serve the service port",
            svc(|_| {}),
            vec![slice(
                "web-1",
                "IPv4",
                &[("metrics", 9100, "TCP")],
                &[ep("10.0.0.1")],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [] Reject"]),
        ),
        Case::new(
            "a slice port of the same name but another protocol does not serve it",
            svc(|_| {}),
            vec![slice(
                "web-1",
                "IPv4",
                &[("http", 8080, "UDP")],
                &[ep("10.0.0.1")],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [] Reject"]),
        ),
        Case::new(
            "multi-port service: same port number, two protocols",
            svc(|s| {
                spec(s).ports = Some(vec![
                    port("tcp", 80, "TCP", IntOrString::Int(8080)),
                    port("udp", 80, "UDP", IntOrString::Int(8081)),
                ]);
            }),
            vec![slice(
                "web-1",
                "IPv4",
                &[("tcp", 8080, "TCP"), ("udp", 8081, "UDP")],
                &[ep("10.0.0.1"), ep("10.0.0.2")],
            )],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080, 10.0.0.2:8080] Reject",
                "ClusterIp 10.96.0.10:80/UDP -> [10.0.0.1:8081, 10.0.0.2:8081] Reject",
            ]),
        ),
        Case::new(
            "unnamed single port matches the slice port named \"\"",
            svc(|s| spec(s).ports = Some(vec![port("", 80, "TCP", IntOrString::Int(8080))])),
            vec![slice(
                "web-1",
                "IPv4",
                &[("", 8080, "TCP")],
                &[ep("10.0.0.1")],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject"]),
        ),
        Case::new(
            "slice ports without a name or a number are ignored, as kube-proxy does",
            svc(|_| {}),
            vec![{
                let mut s = http_slice("web-1", &[ep("10.0.0.1")]);
                let ports = s.ports.as_mut().unwrap();
                ports[0].port = None;
                ports.push(EndpointPort {
                    name: None,
                    port: Some(8080),
                    ..Default::default()
                });
                s
            }],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [] Reject"]),
        ),
    ]);
}

#[test]
fn ip_families_and_slice_selection() {
    run(vec![
        Case::new(
            "dual-stack: each ClusterIP uses the slices of its family",
            svc(|s| set_cluster_ips(s, &["10.96.0.10", "fd00::10"])),
            vec![
                http_slice("web-v4", &[ep("10.0.0.1")]),
                slice(
                    "web-v6",
                    "IPv6",
                    &[("http", 8080, "TCP")],
                    &[ep("fd00::2"), ep("fd00::1")],
                ),
            ],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject",
                "ClusterIp [fd00::10]:80/TCP -> [[fd00::1]:8080, [fd00::2]:8080] Reject",
            ]),
        ),
        Case::new(
            "IPv6 endpoints sort by their bracketed string",
            svc(|s| set_cluster_ips(s, &["fd00::10"])),
            vec![slice(
                "web-v6",
                "IPv6",
                &[("http", 8080, "TCP")],
                &[ep("fd00::a"), ep("fd00::1:0"), ep("fd00::1")],
            )],
            Gives(&[
                "ClusterIp [fd00::10]:80/TCP -> [[fd00::1:0]:8080, [fd00::1]:8080, [fd00::a]:8080] Reject",
            ]),
        ),
        Case::new(
            "clusterIP alone (no clusterIPs) is used",
            svc(|s| spec(s).cluster_ips = None),
            vec![http_slice("web-1", &[ep("10.0.0.1")])],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject"]),
        ),
        Case::new(
            "an IPv6 slice does not serve an IPv4-only service",
            svc(|_| {}),
            vec![slice(
                "web-v6",
                "IPv6",
                &[("http", 8080, "TCP")],
                &[ep("fd00::1")],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [] Reject"]),
        ),
        Case::new(
            "FQDN slices are ignored",
            svc(|_| {}),
            vec![slice(
                "web-dns",
                "FQDN",
                &[("http", 8080, "TCP")],
                &[ep("backend.example")],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [] Reject"]),
        ),
        Case::new(
            "slices of another service or namespace are ignored",
            svc(|_| {}),
            vec![
                slice_of(
                    "api",
                    "api-1",
                    "IPv4",
                    &[("http", 8080, "TCP")],
                    &[ep("10.0.0.1")],
                ),
                {
                    let mut s = http_slice("web-x", &[ep("10.0.0.2")]);
                    s.metadata.namespace = Some("other".into());
                    s
                },
                http_slice("web-1", &[ep("10.0.0.3")]),
            ],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.3:8080] Reject"]),
        ),
        Case::new(
            "a slice labelled headless is ignored",
            svc(|_| {}),
            vec![{
                let mut s = http_slice("web-1", &[ep("10.0.0.1")]);
                s.metadata
                    .labels
                    .as_mut()
                    .unwrap()
                    .insert(LABEL_HEADLESS.into(), String::new());
                s
            }],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [] Reject"]),
        ),
        Case::new(
            "IPv4 addresses with leading zeros are read as decimal, like ParseIPSloppy",
            svc(|_| {}),
            vec![http_slice("web-1", &[ep("010.000.000.001")])],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject"]),
        ),
    ]);
}

#[test]
fn skipped_services() {
    let slices = || vec![http_slice("web-1", &[ep("10.0.0.1")])];
    run(vec![
        Case::new(
            "headless (clusterIP None)",
            svc(|s| set_cluster_ips(s, &["None"])),
            slices(),
            Gives(&[]),
        ),
        Case::new(
            "ExternalName",
            svc(|s| {
                let spec = spec(s);
                spec.type_ = Some("ExternalName".into());
                spec.external_name = Some("example.com".into());
                spec.cluster_ip = None;
                spec.cluster_ips = None;
            }),
            slices(),
            Gives(&[]),
        ),
        Case::new(
            "labelled service.kubernetes.io/headless",
            svc(|s| s.metadata.labels = labels(&[(LABEL_HEADLESS, "")])),
            slices(),
            Gives(&[]),
        ),
        Case::new(
            "labelled with another proxy's name",
            svc(|s| s.metadata.labels = labels(&[(LABEL_SERVICE_PROXY_NAME, "other")])),
            slices(),
            Gives(&[]),
        )
        .config("ebpf-proxy"),
        Case::new(
            "labelled with a proxy name while we have none",
            svc(|s| s.metadata.labels = labels(&[(LABEL_SERVICE_PROXY_NAME, "ebpf-proxy")])),
            slices(),
            Gives(&[]),
        ),
        Case::new(
            "labelled with our proxy name: programmed, slices carrying the label too",
            svc(|s| s.metadata.labels = labels(&[(LABEL_SERVICE_PROXY_NAME, "ebpf-proxy")])),
            vec![{
                let mut s = http_slice("web-1", &[ep("10.0.0.1")]);
                s.metadata
                    .labels
                    .as_mut()
                    .unwrap()
                    .insert(LABEL_SERVICE_PROXY_NAME.into(), "ebpf-proxy".into());
                s
            }],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject"]),
        )
        .config("ebpf-proxy"),
        Case::new(
            "no ports: nothing to program",
            svc(|s| spec(s).ports = None),
            slices(),
            Gives(&[]),
        ),
    ]);
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "a table of cases for one aspect of the Service, read together"
)]
fn endpoint_conditions() {
    run(vec![
        Case::new(
            "nil conditions mean ready, serving, not terminating",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[Ep {
                    ip: "10.0.0.1",
                    ..Default::default()
                }],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject"]),
        ),
        Case::new(
            "not-ready endpoints are left out",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[ep("10.0.0.1").not_ready(), ep("10.0.0.2")],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.2:8080] Reject"]),
        ),
        Case::new(
            "serving-terminating endpoints are unused while one is ready",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[ep("10.0.0.1").terminating(), ep("10.0.0.2")],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.2:8080] Reject"]),
        ),
        Case::new(
            "no ready endpoint: fall back to serving-terminating ones",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[
                    ep("10.0.0.1").terminating(),
                    ep("10.0.0.2").not_ready(),
                    ep("10.0.0.3").terminating(),
                ],
            )],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080(terminating), 10.0.0.3:8080(terminating)] Reject",
            ]),
        ),
        Case::new(
            "terminating and not serving: unusable, so REJECT",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[ep("10.0.0.1").conditions(false, false, true)],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [] Reject"]),
        ),
        Case::new(
            "publishNotReadyAddresses: ready while terminating stays in, flagged",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[ep("10.0.0.1").conditions(true, false, true), ep("10.0.0.2")],
            )],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080(terminating), 10.0.0.2:8080] Reject",
            ]),
        ),
        Case::new(
            "same ip:port in two slices: the non-terminating copy wins (it is in the later slice)",
            svc(|_| {}),
            vec![
                http_slice(
                    "web-a",
                    &[ep("10.0.0.1").terminating(), ep("10.0.0.2").terminating()],
                ),
                http_slice("web-b", &[ep("10.0.0.1")]),
            ],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject"]),
        ),
        Case::new(
            "same ip:port in two slices: the non-terminating copy wins (it is in the earlier slice)",
            svc(|_| {}),
            vec![
                http_slice("web-b", &[ep("10.0.0.1").terminating()]),
                http_slice("web-a", &[ep("10.0.0.1")]),
            ],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject"]),
        ),
        Case::new(
            "endpoints on this node are flagged local",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[
                    ep("10.0.0.1").on("node-a"),
                    ep("10.0.0.2").on("node-b"),
                    ep("10.0.0.3"),
                ],
            )],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080(local), 10.0.0.2:8080, 10.0.0.3:8080] Reject",
            ]),
        ),
    ]);
}

#[test]
fn internal_traffic_policy() {
    let itp_local = |s: &mut Service| spec(s).internal_traffic_policy = Some("Local".into());
    run(vec![
        Case::new(
            "ITP Local: only local endpoints",
            svc(itp_local),
            vec![http_slice(
                "web-1",
                &[ep("10.0.0.1").on("node-b"), ep("10.0.0.2").on("node-a")],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.2:8080(local)] Reject"]),
        ),
        Case::new(
            "ITP Local, endpoints only elsewhere: DROP",
            svc(itp_local),
            vec![http_slice("web-1", &[ep("10.0.0.1").on("node-b")])],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [] Drop"]),
        ),
        Case::new(
            "ITP Local, no endpoints anywhere: REJECT, as kube-proxy",
            svc(itp_local),
            vec![],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [] Reject"]),
        ),
        Case::new(
            "ITP Local: local serving-terminating fallback even when remote ones are ready",
            svc(itp_local),
            vec![http_slice(
                "web-1",
                &[
                    ep("10.0.0.1").on("node-b"),
                    ep("10.0.0.2").on("node-a").terminating(),
                ],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.2:8080(local,terminating)] Reject"]),
        ),
        Case::new(
            "ITP Local ignores topology hints",
            svc(itp_local),
            vec![http_slice(
                "web-1",
                &[
                    ep("10.0.0.1").on("node-a").zones(&["zone-b"]),
                    ep("10.0.0.2").on("node-b").zones(&["zone-a"]),
                ],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080(local)] Reject"]),
        ),
        Case::new(
            "ITP Cluster (explicit) uses every ready endpoint",
            svc(|s| spec(s).internal_traffic_policy = Some("Cluster".into())),
            vec![http_slice(
                "web-1",
                &[ep("10.0.0.1").on("node-b"), ep("10.0.0.2").on("node-a")],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080, 10.0.0.2:8080(local)] Reject"]),
        ),
    ]);
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "a table of cases for one aspect of the Service, read together"
)]
fn topology_hints() {
    run(vec![
        Case::new(
            "zone hints: every ready endpoint hinted, some for our zone → only those",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[
                    ep("10.0.0.1").zones(&["zone-a"]),
                    ep("10.0.0.2").zones(&["zone-b"]),
                    ep("10.0.0.3").zones(&["zone-b", "zone-a"]),
                ],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080, 10.0.0.3:8080] Reject"]),
        ),
        Case::new(
            "zone hints: one ready endpoint without hints → no filtering",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[ep("10.0.0.1").zones(&["zone-a"]), ep("10.0.0.2")],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080, 10.0.0.2:8080] Reject"]),
        ),
        Case::new(
            "zone hints: a not-ready endpoint without hints does not matter",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[
                    ep("10.0.0.1").zones(&["zone-a"]),
                    ep("10.0.0.2").zones(&["zone-b"]),
                    ep("10.0.0.3").not_ready(),
                ],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject"]),
        ),
        Case::new(
            "zone hints: none for our zone → all ready endpoints",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[
                    ep("10.0.0.1").zones(&["zone-b"]),
                    ep("10.0.0.2").zones(&["zone-c"]),
                ],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080, 10.0.0.2:8080] Reject"]),
        ),
        Case::new(
            "zone hints: node without a zone label → all ready endpoints",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[
                    ep("10.0.0.1").zones(&["zone-a"]),
                    ep("10.0.0.2").zones(&["zone-b"]),
                ],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080, 10.0.0.2:8080] Reject"]),
        )
        .node(node("node-a", None)),
        Case::new(
            "node hints (PreferSameNode) win over zone hints",
            svc(|s| spec(s).traffic_distribution = Some("PreferSameNode".into())),
            vec![http_slice(
                "web-1",
                &[
                    ep("10.0.0.1").zones(&["zone-a"]).for_nodes(&["node-b"]),
                    ep("10.0.0.2").zones(&["zone-a"]).for_nodes(&["node-a"]),
                    ep("10.0.0.3").zones(&["zone-b"]).for_nodes(&["node-c"]),
                ],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.2:8080] Reject"]),
        ),
        Case::new(
            "node hints, none for this node → zone hints apply",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[
                    ep("10.0.0.1").zones(&["zone-a"]).for_nodes(&["node-b"]),
                    ep("10.0.0.2").zones(&["zone-b"]).for_nodes(&["node-c"]),
                ],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject"]),
        ),
        Case::new(
            "node hints missing on one endpoint → zone hints apply",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[
                    ep("10.0.0.1").zones(&["zone-b"]).for_nodes(&["node-a"]),
                    ep("10.0.0.2").zones(&["zone-a"]),
                ],
            )],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.2:8080] Reject"]),
        ),
        Case::new(
            "topology does not filter the terminating fallback",
            svc(|_| {}),
            vec![http_slice(
                "web-1",
                &[
                    ep("10.0.0.1").zones(&["zone-a"]).terminating(),
                    ep("10.0.0.2").zones(&["zone-b"]).terminating(),
                ],
            )],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080(terminating), 10.0.0.2:8080(terminating)] Reject",
            ]),
        ),
    ]);
}

#[test]
fn session_affinity() {
    let client_ip = |timeout: Option<i32>| {
        move |s: &mut Service| {
            let spec = spec(s);
            spec.session_affinity = Some("ClientIP".into());
            spec.session_affinity_config = timeout.map(|t| SessionAffinityConfig {
                client_ip: Some(ClientIPConfig {
                    timeout_seconds: Some(t),
                }),
            });
        }
    };
    let slices = || vec![http_slice("web-1", &[ep("10.0.0.1")])];
    run(vec![
        Case::new(
            "ClientIP without a timeout: 10800 s",
            svc(client_ip(None)),
            slices(),
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject affinity=10800s"]),
        ),
        Case::new(
            "ClientIP 60 s",
            svc(client_ip(Some(60))),
            slices(),
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject affinity=60s"]),
        ),
        Case::new(
            "ClientIP at the 86400 s maximum",
            svc(client_ip(Some(86_400))),
            slices(),
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject affinity=86400s"]),
        ),
        Case::new(
            "sessionAffinity None",
            svc(|s| spec(s).session_affinity = Some("None".into())),
            slices(),
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject"]),
        ),
        Case::new(
            "timeout 0 is invalid",
            svc(client_ip(Some(0))),
            slices(),
            Fails(&["service demo/web", "timeoutSeconds 0"]),
        ),
        Case::new(
            "negative timeout is invalid",
            svc(client_ip(Some(-5))),
            slices(),
            Fails(&["service demo/web", "timeoutSeconds -5"]),
        ),
        Case::new(
            "timeout above 86400 is invalid",
            svc(client_ip(Some(86_401))),
            slices(),
            Fails(&["service demo/web", "timeoutSeconds 86401"]),
        ),
        Case::new(
            "affinity applies to every frontend of the port",
            svc(|s| {
                client_ip(Some(30))(s);
                let spec = spec(s);
                spec.type_ = Some("NodePort".into());
                spec.ports.as_mut().unwrap()[0].node_port = Some(30080);
            }),
            slices(),
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject affinity=30s",
                "NodePort 0.0.0.0:30080/TCP -> [10.0.0.1:8080] Reject affinity=30s",
            ]),
        ),
    ]);
}

fn node_port(s: &mut Service) {
    let spec = spec(s);
    spec.type_ = Some("NodePort".into());
    spec.ports.as_mut().unwrap()[0].node_port = Some(30080);
}

fn etp_local(s: &mut Service) {
    spec(s).external_traffic_policy = Some("Local".into());
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "a table of cases for one aspect of the Service, read together"
)]
fn external_frontends() {
    let mixed = || {
        vec![http_slice(
            "web-1",
            &[ep("10.0.0.1").on("node-b"), ep("10.0.0.2").on("node-a")],
        )]
    };
    run(vec![
        Case::new(
            "NodePort: ClusterIP plus 0.0.0.0:nodePort, both with the cluster set",
            svc(node_port),
            mixed(),
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080, 10.0.0.2:8080(local)] Reject",
                "NodePort 0.0.0.0:30080/TCP -> [10.0.0.1:8080, 10.0.0.2:8080(local)] Reject",
            ]),
        ),
        Case::new(
            "dual-stack NodePort: one per family",
            svc(|s| {
                node_port(s);
                set_cluster_ips(s, &["10.96.0.10", "fd00::10"]);
            }),
            vec![
                http_slice("web-v4", &[ep("10.0.0.1")]),
                slice("web-v6", "IPv6", &[("http", 8080, "TCP")], &[ep("fd00::1")]),
            ],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject",
                "NodePort 0.0.0.0:30080/TCP -> [10.0.0.1:8080] Reject",
                "ClusterIp [fd00::10]:80/TCP -> [[fd00::1]:8080] Reject",
                "NodePort [::]:30080/TCP -> [[fd00::1]:8080] Reject",
            ]),
        ),
        Case::new(
            "ETP Local: external gets local endpoints, in-cluster clients the cluster set",
            svc(|s| {
                node_port(s);
                etp_local(s);
            }),
            mixed(),
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080, 10.0.0.2:8080(local)] Reject",
                "NodePort 0.0.0.0:30080/TCP -> [10.0.0.2:8080(local)] Reject",
                "NodePort 0.0.0.0:30080/TCP (internal) -> [10.0.0.1:8080, 10.0.0.2:8080(local)] Reject",
            ]),
        ),
        Case::new(
            "ETP Local without local endpoints: external DROPs, in-cluster still served",
            svc(|s| {
                node_port(s);
                etp_local(s);
            }),
            vec![http_slice("web-1", &[ep("10.0.0.1").on("node-b")])],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject",
                "NodePort 0.0.0.0:30080/TCP -> [] Drop",
                "NodePort 0.0.0.0:30080/TCP (internal) -> [10.0.0.1:8080] Reject",
            ]),
        ),
        Case::new(
            "ETP Local without any endpoint: everything REJECTs",
            svc(|s| {
                node_port(s);
                etp_local(s);
            }),
            vec![],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [] Reject",
                "NodePort 0.0.0.0:30080/TCP -> [] Reject",
                "NodePort 0.0.0.0:30080/TCP (internal) -> [] Reject",
            ]),
        ),
        Case::new(
            "ETP Local: local terminating fallback for external traffic",
            svc(|s| {
                node_port(s);
                etp_local(s);
            }),
            vec![http_slice(
                "web-1",
                &[
                    ep("10.0.0.1").on("node-b"),
                    ep("10.0.0.2").on("node-a").terminating(),
                ],
            )],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject",
                "NodePort 0.0.0.0:30080/TCP -> [10.0.0.2:8080(local,terminating)] Reject",
                "NodePort 0.0.0.0:30080/TCP (internal) -> [10.0.0.1:8080] Reject",
            ]),
        ),
        Case::new(
            "ITP Local does not narrow external frontends",
            svc(|s| {
                node_port(s);
                spec(s).internal_traffic_policy = Some("Local".into());
            }),
            mixed(),
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.2:8080(local)] Reject",
                "NodePort 0.0.0.0:30080/TCP -> [10.0.0.1:8080, 10.0.0.2:8080(local)] Reject",
            ]),
        ),
        Case::new(
            "externalIPs: one frontend each on the service port; other families ignored",
            svc(|s| {
                spec(s).external_ips = Some(vec![
                    "192.0.2.1".into(),
                    "192.0.2.2".into(),
                    "2001:db8::1".into(),
                ]);
            }),
            vec![http_slice("web-1", &[ep("10.0.0.1")])],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject",
                "ExternalIp 192.0.2.1:80/TCP -> [10.0.0.1:8080] Reject",
                "ExternalIp 192.0.2.2:80/TCP -> [10.0.0.1:8080] Reject",
            ]),
        ),
        Case::new(
            "externalIPs with ETP Local on a ClusterIP service",
            svc(|s| {
                etp_local(s);
                spec(s).external_ips = Some(vec!["192.0.2.1".into()]);
            }),
            mixed(),
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080, 10.0.0.2:8080(local)] Reject",
                "ExternalIp 192.0.2.1:80/TCP -> [10.0.0.2:8080(local)] Reject",
                "ExternalIp 192.0.2.1:80/TCP (internal) -> [10.0.0.1:8080, 10.0.0.2:8080(local)] Reject",
            ]),
        ),
        Case::new(
            "LoadBalancer: NodePort plus each ingress IP; hostname-only and ipMode Proxy skipped",
            svc(|s| {
                node_port(s);
                spec(s).type_ = Some("LoadBalancer".into());
                set_lb_ingress(
                    s,
                    vec![
                        LoadBalancerIngress {
                            ip: Some("203.0.113.7".into()),
                            ..Default::default()
                        },
                        LoadBalancerIngress {
                            hostname: Some("lb.example".into()),
                            ..Default::default()
                        },
                        LoadBalancerIngress {
                            ip: Some("203.0.113.8".into()),
                            ip_mode: Some("Proxy".into()),
                            ..Default::default()
                        },
                        LoadBalancerIngress {
                            ip: Some("203.0.113.9".into()),
                            ip_mode: Some("VIP".into()),
                            ..Default::default()
                        },
                    ],
                );
            }),
            vec![http_slice("web-1", &[ep("10.0.0.1")])],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject",
                "NodePort 0.0.0.0:30080/TCP -> [10.0.0.1:8080] Reject",
                "LoadBalancer 203.0.113.7:80/TCP -> [10.0.0.1:8080] Reject",
                "LoadBalancer 203.0.113.9:80/TCP -> [10.0.0.1:8080] Reject",
            ]),
        ),
        Case::new(
            "ingress IPs count only for type LoadBalancer",
            svc(|s| {
                set_lb_ingress(
                    s,
                    vec![LoadBalancerIngress {
                        ip: Some("203.0.113.7".into()),
                        ..Default::default()
                    }],
                );
            }),
            vec![http_slice("web-1", &[ep("10.0.0.1")])],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject"]),
        ),
        Case::new(
            "loadBalancerSourceRanges firewall the LoadBalancer IPs only, per family, host bits cleared",
            svc(|s| {
                spec(s).type_ = Some("LoadBalancer".into());
                spec(s).ports.as_mut().unwrap()[0].node_port = Some(30080);
                spec(s).external_ips = Some(vec!["203.0.113.20".into()]);
                spec(s).load_balancer_source_ranges = Some(vec![
                    "192.0.2.0/24".into(),
                    " 198.51.100.7/16 ".into(),
                    "2001:db8::/32".into(),
                ]);
                set_lb_ingress(
                    s,
                    vec![LoadBalancerIngress {
                        ip: Some("203.0.113.7".into()),
                        ..Default::default()
                    }],
                );
            }),
            vec![http_slice("web-1", &[ep("10.0.0.1")])],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject",
                "NodePort 0.0.0.0:30080/TCP -> [10.0.0.1:8080] Reject",
                "ExternalIp 203.0.113.20:80/TCP -> [10.0.0.1:8080] Reject",
                "LoadBalancer 203.0.113.7:80/TCP -> [10.0.0.1:8080] Reject from=[192.0.2.0/24, 198.51.0.0/16]",
            ]),
        ),
        Case::new(
            "a source range that is not a CIDR is an error naming it",
            svc(|s| {
                spec(s).type_ = Some("LoadBalancer".into());
                spec(s).load_balancer_source_ranges = Some(vec!["192.0.2.0/33".into()]);
            }),
            vec![http_slice("web-1", &[ep("10.0.0.1")])],
            Fails(&[
                "service demo/web",
                "loadBalancerSourceRanges",
                "192.0.2.0/33",
            ]),
        ),
        Case::new(
            "an address listed twice keeps its first frontend",
            svc(|s| {
                spec(s).type_ = Some("LoadBalancer".into());
                spec(s).external_ips = Some(vec!["203.0.113.7".into(), "10.96.0.10".into()]);
                set_lb_ingress(
                    s,
                    vec![LoadBalancerIngress {
                        ip: Some("203.0.113.7".into()),
                        ..Default::default()
                    }],
                );
            }),
            vec![http_slice("web-1", &[ep("10.0.0.1")])],
            Gives(&[
                "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject",
                "ExternalIp 203.0.113.7:80/TCP -> [10.0.0.1:8080] Reject",
            ]),
        ),
    ]);
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "a table of cases for one aspect of the Service, read together"
)]
fn invalid_input() {
    let slices = || vec![http_slice("web-1", &[ep("10.0.0.1")])];
    let with_port = |p: ServicePort| move |s: &mut Service| spec(s).ports = Some(vec![p]);
    run(vec![
        Case::new(
            "unparsable clusterIP",
            svc(|s| set_cluster_ips(s, &["10.96.0.300"])),
            slices(),
            Fails(&["service demo/web", "clusterIP \"10.96.0.300\""]),
        ),
        Case::new(
            "two clusterIPs of one family",
            svc(|s| set_cluster_ips(s, &["10.96.0.10", "10.96.0.11"])),
            slices(),
            Fails(&["service demo/web", "10.96.0.11", "same IP family"]),
        ),
        Case::new(
            "no clusterIP at all",
            svc(|s| set_cluster_ips(s, &[])),
            slices(),
            Fails(&["service demo/web", "no clusterIP"]),
        ),
        Case::new(
            "port 0",
            svc(with_port(port("http", 0, "TCP", IntOrString::Int(8080)))),
            slices(),
            Fails(&[
                "service demo/web",
                "port \"http\"",
                "port 0 is out of range",
            ]),
        ),
        Case::new(
            "port above 65535",
            svc(with_port(port(
                "http",
                70000,
                "TCP",
                IntOrString::Int(8080),
            ))),
            slices(),
            Fails(&["service demo/web", "port 70000 is out of range"]),
        ),
        Case::new(
            "nodePort above 65535",
            svc(with_port(ServicePort {
                node_port: Some(70000),
                ..port("http", 80, "TCP", IntOrString::Int(8080))
            })),
            slices(),
            Fails(&["service demo/web", "nodePort 70000"]),
        ),
        Case::new(
            "targetPort 0",
            svc(with_port(port("http", 80, "TCP", IntOrString::Int(0)))),
            slices(),
            Fails(&["service demo/web", "targetPort 0"]),
        ),
        Case::new(
            "unknown protocol",
            svc(with_port(port("http", 80, "ICMP", IntOrString::Int(8080)))),
            slices(),
            Fails(&["service demo/web", "\"ICMP\""]),
        ),
        Case::new(
            "duplicate port names",
            svc(|s| {
                spec(s).ports = Some(vec![
                    port("http", 80, "TCP", IntOrString::Int(8080)),
                    port("http", 81, "TCP", IntOrString::Int(8081)),
                ]);
            }),
            slices(),
            Fails(&["service demo/web", "two ports named \"http\""]),
        ),
        Case::new(
            "two unnamed ports",
            svc(|s| {
                spec(s).ports = Some(vec![
                    port("", 80, "TCP", IntOrString::Int(8080)),
                    port("", 81, "TCP", IntOrString::Int(8081)),
                ]);
            }),
            slices(),
            Fails(&["service demo/web", "without a name"]),
        ),
        Case::new(
            "duplicate port/protocol",
            svc(|s| {
                spec(s).ports = Some(vec![
                    port("a", 80, "TCP", IntOrString::Int(8080)),
                    port("b", 80, "TCP", IntOrString::Int(8081)),
                ]);
            }),
            slices(),
            Fails(&["service demo/web", "two ports are 80/TCP"]),
        ),
        Case::new(
            "unparsable externalIP",
            svc(|s| spec(s).external_ips = Some(vec!["192.0.2.x".into()])),
            slices(),
            Fails(&["service demo/web", "externalIPs", "192.0.2.x"]),
        ),
        Case::new(
            "unparsable load balancer IP",
            svc(|s| {
                spec(s).type_ = Some("LoadBalancer".into());
                set_lb_ingress(
                    s,
                    vec![LoadBalancerIngress {
                        ip: Some("lb".into()),
                        ..Default::default()
                    }],
                );
            }),
            slices(),
            Fails(&["service demo/web", "loadBalancer", "\"lb\""]),
        ),
        Case::new(
            "unknown type",
            svc(|s| spec(s).type_ = Some("Magic".into())),
            slices(),
            Fails(&["service demo/web", "type \"Magic\""]),
        ),
        Case::new(
            "unknown traffic policy",
            svc(|s| spec(s).external_traffic_policy = Some("local".into())),
            slices(),
            Fails(&["service demo/web", "externalTrafficPolicy \"local\""]),
        ),
        Case::new(
            "unknown session affinity",
            svc(|s| spec(s).session_affinity = Some("Cookie".into())),
            slices(),
            Fails(&["service demo/web", "sessionAffinity \"Cookie\""]),
        ),
        Case::new(
            "no spec",
            svc(|s| s.spec = None),
            slices(),
            Fails(&["service demo/web", "spec is missing"]),
        ),
        Case::new(
            "no name",
            svc(|s| s.metadata.name = None),
            slices(),
            Fails(&["service demo/<unnamed>", "metadata.name"]),
        ),
        Case::new(
            "unparsable endpoint address names the slice",
            svc(|_| {}),
            vec![http_slice("web-1", &[ep("10.0.0.1"), ep("10.0.0.999")])],
            Fails(&["endpointslice demo/web-1", "endpoint 1", "10.0.0.999"]),
        ),
        Case::new(
            "IPv6 address in an IPv4 slice",
            svc(|_| {}),
            vec![http_slice("web-1", &[ep("fd00::1")])],
            Fails(&["endpointslice demo/web-1", "fd00::1", "not an IPv4 address"]),
        ),
        Case::new(
            "unknown addressType",
            svc(|_| {}),
            vec![slice(
                "web-1",
                "IPv5",
                &[("http", 8080, "TCP")],
                &[ep("10.0.0.1")],
            )],
            Fails(&["endpointslice demo/web-1", "addressType \"IPv5\""]),
        ),
        Case::new(
            "slice port out of range",
            svc(|_| {}),
            vec![slice(
                "web-1",
                "IPv4",
                &[("http", 65536, "TCP")],
                &[ep("10.0.0.1")],
            )],
            Fails(&["endpointslice demo/web-1", "65536"]),
        ),
        Case::new(
            "endpoint without addresses",
            svc(|_| {}),
            vec![{
                let mut s = http_slice("web-1", &[ep("10.0.0.1")]);
                s.endpoints[0].addresses.clear();
                s
            }],
            Fails(&["endpointslice demo/web-1", "endpoint 0 has no addresses"]),
        ),
        Case::new(
            "an invalid slice of another service does not matter",
            svc(|_| {}),
            vec![
                slice_of(
                    "api",
                    "api-1",
                    "IPv4",
                    &[("http", 8080, "TCP")],
                    &[ep("bogus")],
                ),
                http_slice("web-1", &[ep("10.0.0.1")]),
            ],
            Gives(&["ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080] Reject"]),
        ),
    ]);
}

#[test]
fn service_port_names() {
    let service = svc(|s| {
        spec(s).ports = Some(vec![
            port("http", 80, "TCP", IntOrString::Int(8080)),
            port("dns", 53, "UDP", IntOrString::Int(5353)),
        ]);
    });
    let got = service_frontends(
        &service,
        &[],
        &node("node-a", None),
        &ModelConfig::default(),
    )
    .expect("valid service");
    let names: Vec<String> = got.iter().map(|f| f.service.to_string()).collect();
    assert_eq!(
        names,
        ["demo/web:http/TCP", "demo/web:dns/UDP"],
        "ServicePortName of each frontend"
    );

    let unnamed = svc(|s| spec(s).ports = Some(vec![port("", 80, "TCP", IntOrString::Int(8080))]));
    let got = service_frontends(
        &unnamed,
        &[],
        &node("node-a", None),
        &ModelConfig::default(),
    )
    .expect("valid service");
    assert_eq!(
        got[0].service.to_string(),
        "demo/web/TCP",
        "an unnamed port has no :port part"
    );
}

#[test]
fn slice_order_does_not_change_the_result() {
    let slices = [
        http_slice("web-b", &[ep("10.0.0.3"), ep("10.0.0.1").terminating()]),
        http_slice("web-a", &[ep("10.0.0.2"), ep("10.0.0.1").on("node-a")]),
    ];
    let service = svc(|_| {});
    let node = node("node-a", None);
    let slices: Vec<Slice> = slices.iter().map(Slice::from).collect();
    let forward: Vec<&Slice> = slices.iter().collect();
    let backward: Vec<&Slice> = slices.iter().rev().collect();
    let a = service_frontends(&service, &forward, &node, &ModelConfig::default()).unwrap();
    let b = service_frontends(&service, &backward, &node, &ModelConfig::default()).unwrap();
    assert_eq!(
        a.iter().map(render).collect::<Vec<_>>(),
        b.iter().map(render).collect::<Vec<_>>(),
        "frontends must not depend on the order slices are passed in"
    );
    assert_eq!(
        render(&a[0]),
        "ClusterIp 10.96.0.10:80/TCP -> [10.0.0.1:8080(local), 10.0.0.2:8080, 10.0.0.3:8080] Reject",
        "the ready local copy of 10.0.0.1 wins over the terminating one"
    );
}

#[test]
fn is_ours_follows_kube_proxy_label_filters() {
    let ours = ModelConfig {
        service_proxy_name: Some("ebpf-proxy".into()),
        ..ModelConfig::default()
    };
    let none = ModelConfig::default();
    let cases: [(&str, Labels, &ModelConfig, bool); 6] = [
        ("no labels", None, &none, true),
        ("unrelated labels", labels(&[("app", "web")]), &none, true),
        ("headless", labels(&[(LABEL_HEADLESS, "")]), &ours, false),
        (
            "our proxy",
            labels(&[(LABEL_SERVICE_PROXY_NAME, "ebpf-proxy")]),
            &ours,
            true,
        ),
        (
            "other proxy",
            labels(&[(LABEL_SERVICE_PROXY_NAME, "cilium")]),
            &ours,
            false,
        ),
        (
            "any proxy, none configured",
            labels(&[(LABEL_SERVICE_PROXY_NAME, "ebpf-proxy")]),
            &none,
            false,
        ),
    ];
    for (name, labels, config, want) in cases {
        assert_eq!(is_ours(labels.as_ref(), config), want, "is_ours: {name}");
    }
}

/// A log kept in memory, for the warnings a test expects.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log lock").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn the_lb_algorithm_annotation_chooses_and_a_bad_one_is_warned_about() {
    let annotated = |value: &str| {
        let value = value.to_owned();
        svc(move |s| {
            s.metadata.annotations = Some(
                [(service_spec::LB_ALGORITHM_ANNOTATION.to_owned(), value)]
                    .into_iter()
                    .collect(),
            );
            node_port(s);
        })
    };
    let node = node("node-a", None);
    let slices = [http_slice("web-1", &[ep("10.0.0.1")])];
    let slices: Vec<Slice> = slices.iter().map(Slice::from).collect();
    let slices: Vec<&Slice> = slices.iter().collect();
    let algorithms = |service: &Service| {
        let frontends =
            service_frontends(service, &slices, &node, &ModelConfig::default()).unwrap();
        assert_eq!(frontends.len(), 2, "the ClusterIP and the NodePort");
        frontends.iter().map(|f| f.lb_algorithm).collect::<Vec<_>>()
    };
    assert_eq!(
        algorithms(&annotated("maglev")),
        [Some(LbAlgorithm::Maglev); 2]
    );
    assert_eq!(
        algorithms(&annotated("random")),
        [Some(LbAlgorithm::Random); 2]
    );
    assert_eq!(algorithms(&svc(node_port)), [None; 2], "no annotation");

    // A bad value: warned about, naming the Service and the value, and left
    // to the flag; the Service keeps its frontends.
    let log = Captured::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let bad = annotated("Maglev!");
    let got = tracing::subscriber::with_default(subscriber, || algorithms(&bad));
    assert_eq!(got, [None; 2]);
    let text = String::from_utf8(log.0.lock().expect("log lock").clone()).expect("UTF-8 log");
    for part in ["WARN", "demo/web", "ebpf-proxy.io/lb-algorithm", "Maglev!"] {
        assert!(text.contains(part), "the warning names {part:?}: {text}");
    }
}
