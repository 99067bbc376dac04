//! The health check node port of a Service (kube-proxy's `NeedsHealthCheck`
//! in `pkg/api/v1/service/util.go`, `HealthCheckNodePorts` and
//! `LocalReadyEndpoints` in `pkg/proxy`): which port to answer on and how
//! many local endpoints to report there.
//!
//! A cloud load balancer in front of an externalTrafficPolicy=Local Service
//! probes that port on every node, and sends traffic only to the nodes that
//! answer 200, because only those have an endpoint to deliver it to.

use std::collections::{BTreeSet, HashSet};

use k8s_openapi::api::core::v1::Service;

use super::{
    ModelConfig, ModelError, NodeInfo, Protocol, address_policy,
    compact::{CompactService, Slice},
    endpoints,
    family::Family,
    service,
    slice::ParsedSlice,
};

/// What the health check node port of one Service must serve.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HealthCheck {
    pub namespace: String,
    pub name: String,
    /// spec.healthCheckNodePort.
    pub node_port: u16,
    /// Distinct IPs of the Service's endpoints that are on this node and
    /// Ready (kube-proxy's `LocalReadyEndpoints`). Serving-but-terminating
    /// endpoints do not count, so that the load balancer drains the node.
    pub local_endpoints: usize,
}

/// The health check a Service needs on this node, if any.
///
/// Some only when kube-proxy would open one: the Service is ours, not
/// headless, has ports, is of type LoadBalancer with externalTrafficPolicy
/// Local, and has a non-zero spec.healthCheckNodePort (kube-proxy logs and
/// skips a Service without one).
///
/// `slices` may hold slices of other services, as for `service_frontends`.
/// The count is taken over the endpoints of the Service's primary IP family
/// (that of its first clusterIP): kube-proxy counts per family, each
/// family's proxier seeing only its own slices, so a dual-stack pod must
/// count once, not once per address.
pub fn service_health_check(
    service: &Service,
    slices: &[&Slice],
    node: &NodeInfo,
    config: &ModelConfig,
) -> Result<Option<HealthCheck>, ModelError> {
    health_check(&CompactService::from(service), slices, node, config)
}

/// [`service_health_check`] of a Service as the agent keeps it.
pub(super) fn health_check(
    service: &CompactService,
    slices: &[&Slice],
    node: &NodeInfo,
    config: &ModelConfig,
) -> Result<Option<HealthCheck>, ModelError> {
    let Some(ours) = service::ours(service, config)? else {
        return Ok(None);
    };
    // Read before the spec is checked, so that a Service that can never
    // need a health check (ExternalName among them) is not reported here
    // for what its frontends already report.
    if !ours.service.load_balancer {
        return Ok(None);
    }
    // kube-proxy skips a headless Service before it looks at anything else.
    let Some(parsed) = ours.parse()? else {
        return Ok(None);
    };
    // The health check port hangs off kube-proxy's per-port service map: a
    // Service without ports has none. Nor does one refused as a whole for
    // its size: a load balancer told its nodes are healthy would send them
    // traffic no frontend takes.
    if parsed.ports.is_empty()
        || !parsed.external_local
        || address_policy::over_budget(config, parsed.frontend_count, parsed.shed)
    {
        return Ok(None);
    }
    let node_port = match parsed.health_check_node_port {
        None | Some(0) => return Ok(None),
        Some(n) => u16::try_from(n).map_err(|_| {
            ours.invalid(format!("healthCheckNodePort {n} is out of range 1-65535"))
        })?,
    };
    let Some(&primary) = parsed.cluster_ips.first() else {
        return Ok(None);
    };

    Ok(Some(HealthCheck {
        namespace: ours.namespace.to_owned(),
        name: ours.name.to_owned(),
        node_port,
        local_endpoints: local_ready_ips(&ours.slices(slices, config)?, Family::of(primary), node),
    }))
}

/// kube-proxy's `LocalReadyEndpoints` for one Service and family: distinct
/// IPs of endpoints that are local and Ready, over every port of the
/// Service's slices.
///
/// kube-proxy's endpoints map is keyed by the slices' ports, not the
/// Service's, so the ports come from the slices. Each ip:port is first
/// reduced to one copy, as for programming, so that a terminating duplicate
/// is judged the way the datapath judges it. The Ready condition is taken
/// as published: with publishNotReadyAddresses it is true even for
/// not-ready or terminating pods, and kube-proxy counts those too.
fn local_ready_ips(slices: &[&ParsedSlice], family: Family, node: &NodeInfo) -> usize {
    let ports: BTreeSet<(&str, Protocol)> = slices.iter().flat_map(|s| s.service_ports()).collect();
    let mut ips = HashSet::new();
    for (port_name, protocol) in ports {
        for endpoint in endpoints::endpoints_for_port(slices, family, port_name, protocol, node) {
            if endpoint.addr.local && endpoint.ready() {
                ips.insert(endpoint.addr.ip);
            }
        }
    }
    ips.len()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::{
        api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
        apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
    };

    use super::*;
    use crate::model::{
        LABEL_HEADLESS, LABEL_SERVICE_NAME, LABEL_SERVICE_PROXY_NAME,
        tests::{self as model_tests, spec},
    };

    const NODE: &str = "node-a";

    /// The model tests' demo/web made a LoadBalancer with ETP Local,
    /// healthCheckNodePort 32000 and ports "http" 80 and "https" 443; then
    /// `edit`.
    fn svc(edit: impl FnOnce(&mut Service)) -> Service {
        model_tests::svc(|service| {
            let spec = spec(service);
            spec.type_ = Some("LoadBalancer".into());
            spec.ports = Some(vec![
                model_tests::port("http", 80, "TCP", IntOrString::Int(8080)),
                model_tests::port("https", 443, "TCP", IntOrString::Int(8443)),
            ]);
            spec.external_traffic_policy = Some("Local".into());
            spec.health_check_node_port = Some(32000);
            edit(service);
        })
    }

    /// An endpoint: IP, node, (ready, serving, terminating) as published;
    /// None leaves the conditions nil.
    type Ep = (&'static str, &'static str, Option<(bool, bool, bool)>);

    /// A slice of `service` in demo with ports "http" 8080 and "https"
    /// 8443.
    fn slice(service: &str, name: &str, address_type: &str, eps: &[Ep]) -> EndpointSlice {
        let port = |name: &str, number: i32| EndpointPort {
            name: Some(name.into()),
            port: Some(number),
            protocol: Some("TCP".into()),
            ..Default::default()
        };
        EndpointSlice {
            metadata: ObjectMeta {
                namespace: Some("demo".into()),
                name: Some(name.into()),
                labels: Some(BTreeMap::from([(
                    LABEL_SERVICE_NAME.to_owned(),
                    service.to_owned(),
                )])),
                ..Default::default()
            },
            address_type: address_type.into(),
            ports: Some(vec![port("http", 8080), port("https", 8443)]),
            endpoints: eps
                .iter()
                .map(|(ip, node, conditions)| Endpoint {
                    addresses: vec![(*ip).into()],
                    conditions: conditions.map(|(ready, serving, terminating)| {
                        EndpointConditions {
                            ready: Some(ready),
                            serving: Some(serving),
                            terminating: Some(terminating),
                        }
                    }),
                    node_name: Some((*node).into()),
                    ..Default::default()
                })
                .collect(),
        }
    }

    /// The Service's one IPv4 slice.
    fn web_a(eps: &[Ep]) -> Vec<EndpointSlice> {
        vec![slice("web", "web-a", "IPv4", eps)]
    }

    const READY: Option<(bool, bool, bool)> = Some((true, true, false));
    const NOT_READY: Option<(bool, bool, bool)> = Some((false, false, false));
    const TERMINATING: Option<(bool, bool, bool)> = Some((false, true, true));
    /// What the slice controller publishes for a terminating pod of a
    /// Service with publishNotReadyAddresses.
    const PNRA_TERMINATING: Option<(bool, bool, bool)> = Some((true, true, true));
    const PNRA_NOT_READY: Option<(bool, bool, bool)> = Some((true, false, false));

    /// None: no health check; Some(n): port 32000 with n local endpoints.
    type Want = Result<Option<usize>, ModelError>;

    #[test]
    #[expect(clippy::too_many_lines, reason = "a table of cases, one per line")]
    fn service_health_check_table() {
        let local2 = [("10.0.0.1", NODE, READY), ("10.0.0.2", NODE, READY)];
        let cases: Vec<(&str, Service, Vec<EndpointSlice>, Want)> = vec![
            (
                "not a LoadBalancer",
                svc(|s| spec(s).type_ = Some("NodePort".into())),
                web_a(&local2),
                Ok(None),
            ),
            (
                "ExternalName",
                svc(|s| spec(s).type_ = Some("ExternalName".into())),
                vec![],
                Ok(None),
            ),
            (
                "ETP Cluster",
                svc(|s| spec(s).external_traffic_policy = Some("Cluster".into())),
                web_a(&local2),
                Ok(None),
            ),
            (
                "ETP unset",
                svc(|s| spec(s).external_traffic_policy = None),
                vec![],
                Ok(None),
            ),
            (
                "no healthCheckNodePort",
                svc(|s| spec(s).health_check_node_port = None),
                vec![],
                Ok(None),
            ),
            (
                "healthCheckNodePort 0",
                svc(|s| spec(s).health_check_node_port = Some(0)),
                vec![],
                Ok(None),
            ),
            (
                "headless",
                svc(|s| {
                    spec(s).cluster_ip = Some("None".into());
                    spec(s).cluster_ips = Some(vec!["None".into()]);
                }),
                vec![],
                Ok(None),
            ),
            (
                "headless label",
                svc(|s| {
                    s.metadata.labels =
                        Some(BTreeMap::from([(LABEL_HEADLESS.to_owned(), String::new())]));
                }),
                vec![],
                Ok(None),
            ),
            (
                "another proxy's",
                svc(|s| {
                    s.metadata.labels = Some(BTreeMap::from([(
                        LABEL_SERVICE_PROXY_NAME.to_owned(),
                        "other".to_owned(),
                    )]));
                }),
                vec![],
                Ok(None),
            ),
            ("no ports", svc(|s| spec(s).ports = None), vec![], Ok(None)),
            ("no slices", svc(|_| {}), vec![], Ok(Some(0))),
            (
                "one local ready IP on two ports counts once",
                svc(|_| {}),
                web_a(&[("10.0.0.1", NODE, READY)]),
                Ok(Some(1)),
            ),
            (
                "two local ready IPs",
                svc(|_| {}),
                web_a(&local2),
                Ok(Some(2)),
            ),
            (
                "nil conditions are ready",
                svc(|_| {}),
                web_a(&[("10.0.0.1", NODE, None)]),
                Ok(Some(1)),
            ),
            (
                "remote only",
                svc(|_| {}),
                web_a(&[("10.0.0.1", "node-b", READY), ("10.0.0.2", "node-c", READY)]),
                Ok(Some(0)),
            ),
            (
                "local terminating and serving only",
                svc(|_| {}),
                web_a(&[("10.0.0.1", NODE, TERMINATING)]),
                Ok(Some(0)),
            ),
            (
                "local not ready",
                svc(|_| {}),
                web_a(&[("10.0.0.1", NODE, NOT_READY)]),
                Ok(Some(0)),
            ),
            (
                "publishNotReadyAddresses: ready as published, even terminating",
                svc(|s| spec(s).publish_not_ready_addresses = Some(true)),
                web_a(&[
                    ("10.0.0.1", NODE, PNRA_TERMINATING),
                    ("10.0.0.2", NODE, PNRA_NOT_READY),
                ]),
                Ok(Some(2)),
            ),
            (
                "mixed: local ready, local terminating, remote ready",
                svc(|_| {}),
                vec![
                    slice("web", "web-a", "IPv4", &[("10.0.0.1", NODE, READY)]),
                    slice(
                        "web",
                        "web-b",
                        "IPv4",
                        &[
                            ("10.0.0.2", NODE, TERMINATING),
                            ("10.0.0.3", "node-b", READY),
                        ],
                    ),
                ],
                Ok(Some(1)),
            ),
            (
                "ready copy in one slice, terminating copy in another: non-terminating wins",
                svc(|_| {}),
                vec![
                    slice("web", "web-a", "IPv4", &[("10.0.0.1", NODE, TERMINATING)]),
                    slice("web", "web-b", "IPv4", &[("10.0.0.1", NODE, READY)]),
                ],
                Ok(Some(1)),
            ),
            (
                "other services' slices are ignored",
                svc(|_| {}),
                vec![slice("api", "api-a", "IPv4", &local2)],
                Ok(Some(0)),
            ),
            (
                "dual-stack pod counts once, in the primary family",
                svc(|s| {
                    spec(s).cluster_ips = Some(vec!["10.96.0.10".into(), "fd00::10".into()]);
                }),
                vec![
                    slice("web", "web-v4", "IPv4", &[("10.0.0.1", NODE, READY)]),
                    slice("web", "web-v6", "IPv6", &[("fd00::1", NODE, READY)]),
                ],
                Ok(Some(1)),
            ),
            (
                "IPv6 primary counts IPv6 endpoints",
                svc(|s| {
                    spec(s).cluster_ip = Some("fd00::10".into());
                    spec(s).cluster_ips = Some(vec!["fd00::10".into()]);
                }),
                vec![slice(
                    "web",
                    "web-v6",
                    "IPv6",
                    &[("fd00::1", NODE, READY), ("fd00::2", NODE, READY)],
                )],
                Ok(Some(2)),
            ),
            (
                "bad externalTrafficPolicy",
                svc(|s| spec(s).external_traffic_policy = Some("local".into())),
                vec![],
                Err(ModelError::InvalidService {
                    service: "demo/web".into(),
                    reason: "externalTrafficPolicy \"local\" is not one of Cluster, Local".into(),
                }),
            ),
            (
                "healthCheckNodePort out of range",
                svc(|s| spec(s).health_check_node_port = Some(70000)),
                vec![],
                Err(ModelError::InvalidService {
                    service: "demo/web".into(),
                    reason: "healthCheckNodePort 70000 is out of range 1-65535".into(),
                }),
            ),
            (
                "bad slice",
                svc(|_| {}),
                web_a(&[("fd00::1", NODE, READY)]),
                Err(ModelError::InvalidSlice {
                    slice: "demo/web-a".into(),
                    reason: "endpoint 0: fd00::1 is not an IPv4 address".into(),
                }),
            ),
        ];

        let node = NodeInfo {
            name: NODE.into(),
            zone: None,
        };
        for (label, service, slices, want) in cases {
            let slices: Vec<Slice> = slices.iter().map(Slice::from).collect();
            let refs: Vec<&Slice> = slices.iter().collect();
            let got = service_health_check(&service, &refs, &node, &ModelConfig::default());
            let want = want.map(|w| {
                w.map(|local_endpoints| HealthCheck {
                    namespace: "demo".into(),
                    name: "web".into(),
                    node_port: 32000,
                    local_endpoints,
                })
            });
            assert_eq!(got, want, "{label}");
        }
    }

    #[test]
    fn no_endpoint_is_local_to_an_unnamed_node() {
        let service = svc(|_| {});
        let slices = web_a(&[("10.0.0.1", "", READY)]);
        let slices: Vec<Slice> = slices.iter().map(Slice::from).collect();
        let refs: Vec<&Slice> = slices.iter().collect();
        let got = service_health_check(
            &service,
            &refs,
            &NodeInfo::default(),
            &ModelConfig::default(),
        )
        .expect("valid service")
        .expect("needs a health check");
        assert_eq!(got.local_endpoints, 0);
    }

    /// A Service refused as a whole for its size (`--max-frontends-per-
    /// service`) has no frontend here, so no health check either: a load
    /// balancer probing it must not find this node healthy.
    #[test]
    fn a_service_over_its_budget_has_no_health_check() {
        let service = svc(|_| {});
        let slices = web_a(&[("10.0.0.1", NODE, READY)]);
        let slices: Vec<Slice> = slices.iter().map(Slice::from).collect();
        let refs: Vec<&Slice> = slices.iter().collect();
        let node = NodeInfo {
            name: NODE.into(),
            zone: None,
        };
        let check = |max: u64| {
            let config = ModelConfig {
                max_frontends_per_service: max,
                ..ModelConfig::default()
            };
            service_health_check(&service, &refs, &node, &config).expect("valid service")
        };
        let frontends = CompactService::from(&service).frontend_count();
        assert_eq!(
            check(frontends).map(|c| c.local_endpoints),
            Some(1),
            "within its budget"
        );
        assert_eq!(check(frontends - 1), None, "over its budget");
    }
}
