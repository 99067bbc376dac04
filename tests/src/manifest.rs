//! Manifests for `ebpf-proxy run --manifests DIR`: Services and EndpointSlices in the
//! shape `kubectl get -o yaml` prints them, written to a private directory that tests
//! can rewrite while the agent watches it.

use std::{
    fmt::Write as _,
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};

use crate::{
    Protocol,
    iptables::{KubeService, KubeService6},
};

/// One port of a Service.
#[derive(Debug, Clone)]
pub struct ServicePort {
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
    pub target_port: u16,
    /// `nodePort`, for NodePort and LoadBalancer Services ([`Service::node_port`]).
    pub node_port: Option<u16>,
}

/// `spec.type` (ExternalName is left out: a proxy has nothing to do for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ServiceType {
    #[default]
    ClusterIp,
    NodePort,
    LoadBalancer,
}

impl ServiceType {
    /// As Kubernetes spells it (`ClusterIP`).
    pub fn as_str(self) -> &'static str {
        match self {
            ServiceType::ClusterIp => "ClusterIP",
            ServiceType::NodePort => "NodePort",
            ServiceType::LoadBalancer => "LoadBalancer",
        }
    }
}

/// `spec.externalTrafficPolicy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TrafficPolicy {
    #[default]
    Cluster,
    Local,
}

impl TrafficPolicy {
    /// As Kubernetes spells it (`Cluster`).
    pub fn as_str(self) -> &'static str {
        match self {
            TrafficPolicy::Cluster => "Cluster",
            TrafficPolicy::Local => "Local",
        }
    }
}

/// `DefaultClientIPServiceAffinitySeconds` (k8s.io/api): what the API server fills in
/// when a ClientIP Service leaves `timeoutSeconds` out.
pub const DEFAULT_AFFINITY_TIMEOUT_S: u32 = 10_800;

/// `spec.sessionAffinity` (and its `sessionAffinityConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SessionAffinity {
    #[default]
    None,
    /// `ClientIP`, with `timeoutSeconds` when given; without it the field is left out
    /// of the manifest and the API default ([`DEFAULT_AFFINITY_TIMEOUT_S`]) applies.
    ClientIp { timeout_seconds: Option<u32> },
}

impl SessionAffinity {
    /// The stickiness window a proxy applies, if affinity is on.
    pub fn timeout_seconds(self) -> Option<u32> {
        match self {
            SessionAffinity::None => None,
            SessionAffinity::ClientIp { timeout_seconds } => {
                Some(timeout_seconds.unwrap_or(DEFAULT_AFFINITY_TIMEOUT_S))
            }
        }
    }
}

/// One endpoint of an EndpointSlice with its conditions (what the EndpointSlice
/// controller publishes for a pod: docs/kube-proxy-semantics.md §3); of an IPv4
/// slice unless said otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint<A = Ipv4Addr> {
    pub ip: A,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

impl<A> Endpoint<A> {
    /// A running pod that passes its readiness probe.
    pub fn ready(ip: A) -> Endpoint<A> {
        Endpoint {
            ip,
            ready: true,
            serving: true,
            terminating: false,
        }
    }

    /// A pod being deleted that still passes its readiness probe: `ready` turns false
    /// (`ready = serving && !terminating`), `serving` stays true.
    pub fn terminating_serving(ip: A) -> Endpoint<A> {
        Endpoint {
            ip,
            ready: false,
            serving: true,
            terminating: true,
        }
    }

    /// A pod being deleted that no longer passes its readiness probe.
    pub fn terminating_not_serving(ip: A) -> Endpoint<A> {
        Endpoint {
            ip,
            ready: false,
            serving: false,
            terminating: true,
        }
    }
}

impl Endpoint {
    /// This endpoint on node `node` (`endpoints[].nodeName`, which
    /// externalTrafficPolicy Local goes by).
    pub fn on_node(self, node: &str) -> SliceEndpoint {
        SliceEndpoint {
            endpoint: self,
            node_name: Some(node.to_owned()),
        }
    }
}

/// One entry of an EndpointSlice's `endpoints`: an [`Endpoint`] and, if known, the
/// node its pod runs on. The `yaml_with` methods take these or plain [`Endpoint`]s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SliceEndpoint {
    pub endpoint: Endpoint,
    /// `nodeName`; left out of the manifest when None.
    pub node_name: Option<String>,
}

impl From<Endpoint> for SliceEndpoint {
    fn from(endpoint: Endpoint) -> SliceEndpoint {
        SliceEndpoint {
            endpoint,
            node_name: None,
        }
    }
}

/// `spec.ipFamilies` of a [`Service`], in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpFamilies {
    V4,
    V6,
    /// Dual-stack, IPv4 primary.
    V4V6,
}

/// A Service; its endpoints are given when writing its EndpointSlice. ClusterIP unless
/// [`Service::type_`] says otherwise.
#[derive(Debug, Clone)]
pub struct Service {
    pub namespace: String,
    pub name: String,
    /// The IPv4 ClusterIP; `0.0.0.0` (and unused) for a Service of IPv6 alone
    /// ([`Service::new_v6`]).
    pub cluster_ip: Ipv4Addr,
    /// Which families the Service has, in `spec.ipFamilies` order.
    pub families: IpFamilies,
    /// The IPv6 ClusterIP of a Service with IPv6 ([`Service::new_v6`],
    /// [`Service::dual_stack`]).
    pub cluster_ip6: Option<Ipv6Addr>,
    pub ports: Vec<ServicePort>,
    pub session_affinity: SessionAffinity,
    /// `spec.type`.
    pub type_: ServiceType,
    /// `spec.externalIPs`.
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip` (what a load-balancer controller publishes).
    pub load_balancer_ingress: Vec<IpAddr>,
    /// `spec.loadBalancerSourceRanges`, CIDRs as written (`203.0.113.0/24`).
    pub load_balancer_source_ranges: Vec<String>,
    /// `spec.externalTrafficPolicy`; None writes what the API server defaults to:
    /// `Cluster` for an externally reachable Service (NodePort, LoadBalancer or with
    /// externalIPs), nothing otherwise.
    pub external_traffic_policy: Option<TrafficPolicy>,
    /// `spec.healthCheckNodePort` (LoadBalancer with externalTrafficPolicy Local).
    pub health_check_node_port: Option<u16>,
}

impl Service {
    pub fn new(namespace: &str, name: &str, cluster_ip: Ipv4Addr) -> Service {
        Service {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            cluster_ip,
            families: IpFamilies::V4,
            cluster_ip6: None,
            ports: Vec::new(),
            session_affinity: SessionAffinity::None,
            type_: ServiceType::ClusterIp,
            external_ips: Vec::new(),
            load_balancer_ingress: Vec::new(),
            load_balancer_source_ranges: Vec::new(),
            external_traffic_policy: None,
            health_check_node_port: None,
        }
    }

    /// A Service of IPv6 alone (`ipFamilies: [IPv6]`, `SingleStack`).
    pub fn new_v6(namespace: &str, name: &str, cluster_ip6: Ipv6Addr) -> Service {
        Service {
            families: IpFamilies::V6,
            cluster_ip6: Some(cluster_ip6),
            ..Service::new(namespace, name, Ipv4Addr::UNSPECIFIED)
        }
    }

    /// Makes this IPv4 Service dual-stack (`RequireDualStack`), IPv4 first: its
    /// `clusterIPs` are its IPv4 ClusterIP and `cluster_ip6`.
    pub fn dual_stack(mut self, cluster_ip6: Ipv6Addr) -> Service {
        self.families = IpFamilies::V4V6;
        self.cluster_ip6 = Some(cluster_ip6);
        self
    }

    /// `spec.clusterIPs`, the primary family's first.
    pub fn cluster_ips(&self) -> Vec<IpAddr> {
        let v4 = IpAddr::V4(self.cluster_ip);
        let v6 = self.cluster_ip6.map(IpAddr::V6);
        match self.families {
            IpFamilies::V4 => vec![v4],
            IpFamilies::V6 => v6.into_iter().collect(),
            IpFamilies::V4V6 => std::iter::once(v4).chain(v6).collect(),
        }
    }

    /// Sets `spec.type` (builder style).
    pub fn type_(mut self, type_: ServiceType) -> Service {
        self.type_ = type_;
        self
    }

    /// Gives the port named `port_name` the `nodePort` `node_port` (builder style);
    /// panics if there is no such port (add it first).
    pub fn node_port(mut self, port_name: &str, node_port: u16) -> Service {
        let name = self.name.clone();
        self.ports
            .iter_mut()
            .find(|p| p.name == port_name)
            .unwrap_or_else(|| panic!("service {name} has no port {port_name}"))
            .node_port = Some(node_port);
        self
    }

    /// Adds an address (of either family) to `spec.externalIPs` (builder style).
    pub fn external_ip(mut self, ip: impl Into<IpAddr>) -> Service {
        self.external_ips.push(ip.into());
        self
    }

    /// Adds an `ip` (of either family) to `status.loadBalancer.ingress` (builder
    /// style).
    pub fn load_balancer_ingress(mut self, ip: impl Into<IpAddr>) -> Service {
        self.load_balancer_ingress.push(ip.into());
        self
    }

    /// Adds a CIDR (`"203.0.113.0/24"`) to `spec.loadBalancerSourceRanges` (builder
    /// style).
    pub fn load_balancer_source_range(mut self, cidr: &str) -> Service {
        self.load_balancer_source_ranges.push(cidr.to_owned());
        self
    }

    /// Sets `spec.externalTrafficPolicy` (builder style).
    pub fn external_traffic_policy(mut self, policy: TrafficPolicy) -> Service {
        self.external_traffic_policy = Some(policy);
        self
    }

    /// Sets `spec.healthCheckNodePort` (builder style).
    pub fn health_check_node_port(mut self, port: u16) -> Service {
        self.health_check_node_port = Some(port);
        self
    }

    /// True for what the API server calls externally accessible: NodePort,
    /// LoadBalancer, or any externalIPs.
    pub fn is_externally_accessible(&self) -> bool {
        self.type_ != ServiceType::ClusterIp || !self.external_ips.is_empty()
    }

    /// The externalTrafficPolicy written to the manifest: the one set, else the API
    /// default (`Cluster` when externally accessible).
    pub fn effective_external_traffic_policy(&self) -> Option<TrafficPolicy> {
        self.external_traffic_policy.or(self
            .is_externally_accessible()
            .then_some(TrafficPolicy::Cluster))
    }

    /// Sets `spec.sessionAffinity` (builder style).
    pub fn session_affinity(mut self, affinity: SessionAffinity) -> Service {
        self.session_affinity = affinity;
        self
    }

    /// Adds a port (builder style).
    pub fn port(mut self, name: &str, port: u16, protocol: Protocol, target_port: u16) -> Service {
        self.ports.push(ServicePort {
            name: name.to_owned(),
            port,
            protocol,
            target_port,
            node_port: None,
        });
        self
    }

    /// The Service object, its fields in `kubectl get -o yaml`'s (alphabetical) order.
    pub fn service_yaml(&self) -> String {
        let mut y = String::new();
        let ips = self.cluster_ips();
        let _ = write!(
            y,
            "apiVersion: v1\n\
             kind: Service\n\
             metadata:\n  name: {name}\n  namespace: {ns}\n\
             spec:\n  clusterIP: {ip}\n  clusterIPs:\n",
            name = self.name,
            ns = self.namespace,
            ip = ips[0],
        );
        for ip in &ips {
            let _ = writeln!(y, "  - {ip}");
        }
        if !self.external_ips.is_empty() {
            y.push_str("  externalIPs:\n");
            for ip in &self.external_ips {
                let _ = writeln!(y, "  - {ip}");
            }
        }
        if let Some(policy) = self.effective_external_traffic_policy() {
            let _ = writeln!(y, "  externalTrafficPolicy: {}", policy.as_str());
        }
        if let Some(port) = self.health_check_node_port {
            let _ = writeln!(y, "  healthCheckNodePort: {port}");
        }
        y.push_str("  internalTrafficPolicy: Cluster\n  ipFamilies:\n");
        for ip in &ips {
            let family = if ip.is_ipv4() { "IPv4" } else { "IPv6" };
            let _ = writeln!(y, "  - {family}");
        }
        let policy = match self.families {
            IpFamilies::V4 | IpFamilies::V6 => "SingleStack",
            IpFamilies::V4V6 => "RequireDualStack",
        };
        let _ = writeln!(y, "  ipFamilyPolicy: {policy}");
        if !self.load_balancer_source_ranges.is_empty() {
            y.push_str("  loadBalancerSourceRanges:\n");
            for cidr in &self.load_balancer_source_ranges {
                let _ = writeln!(y, "  - {cidr}");
            }
        }
        y.push_str("  ports:\n");
        for p in &self.ports {
            let _ = writeln!(y, "  - name: {}", p.name);
            if let Some(node_port) = p.node_port {
                let _ = writeln!(y, "    nodePort: {node_port}");
            }
            let _ = write!(
                y,
                "    port: {}\n    protocol: {}\n    targetPort: {}\n",
                p.port,
                p.protocol.upper(),
                p.target_port
            );
        }
        match self.session_affinity {
            SessionAffinity::None => y.push_str("  sessionAffinity: None\n"),
            SessionAffinity::ClientIp { timeout_seconds } => {
                y.push_str("  sessionAffinity: ClientIP\n");
                if let Some(t) = timeout_seconds {
                    let _ = write!(
                        y,
                        "  sessionAffinityConfig:\n    clientIP:\n      timeoutSeconds: {t}\n"
                    );
                }
            }
        }
        let _ = writeln!(y, "  type: {}", self.type_.as_str());
        if !self.load_balancer_ingress.is_empty() {
            y.push_str("status:\n  loadBalancer:\n    ingress:\n");
            for ip in &self.load_balancer_ingress {
                let _ = writeln!(y, "    - ip: {ip}");
            }
        }
        y
    }

    /// An EndpointSlice for this Service with `endpoints` ready (none is valid: a
    /// Service whose pods are all gone).
    pub fn endpoint_slice_yaml(&self, endpoints: &[Ipv4Addr]) -> String {
        let endpoints: Vec<Endpoint> = endpoints.iter().map(|ip| Endpoint::ready(*ip)).collect();
        self.endpoint_slice_yaml_with(&endpoints)
    }

    /// An EndpointSlice for this Service with `endpoints` and their conditions, and
    /// their nodes when given as [`SliceEndpoint`]s ([`Endpoint::on_node`]).
    pub fn endpoint_slice_yaml_with<E>(&self, endpoints: &[E]) -> String
    where
        E: Clone + Into<SliceEndpoint>,
    {
        let mut y = self.slice_header("x7k2p", "IPv4");
        if endpoints.is_empty() {
            y.push_str("endpoints: []\n");
        } else {
            y.push_str("endpoints:\n");
            for ep in endpoints {
                let SliceEndpoint {
                    endpoint: ep,
                    node_name,
                } = ep.clone().into();
                let _ = write!(
                    y,
                    "- addresses:\n  - {}\n  conditions:\n    ready: {}\n    \
                     serving: {}\n    terminating: {}\n",
                    ep.ip, ep.ready, ep.serving, ep.terminating
                );
                if let Some(node) = node_name {
                    let _ = writeln!(y, "  nodeName: {node}");
                }
            }
        }
        self.slice_ports(&mut y);
        y
    }

    /// An EndpointSlice of `addressType: IPv6` for this Service with `endpoints`
    /// ready; named apart from the IPv4 one, as the EndpointSlice controller keeps
    /// one slice per family.
    pub fn endpoint_slice6_yaml(&self, endpoints: &[Ipv6Addr]) -> String {
        let endpoints: Vec<Endpoint<Ipv6Addr>> =
            endpoints.iter().map(|ip| Endpoint::ready(*ip)).collect();
        self.endpoint_slice6_yaml_with(&endpoints)
    }

    /// [`Service::endpoint_slice6_yaml`] with each endpoint's conditions.
    pub fn endpoint_slice6_yaml_with(&self, endpoints: &[Endpoint<Ipv6Addr>]) -> String {
        let mut y = self.slice_header("v6q9r", "IPv6");
        if endpoints.is_empty() {
            y.push_str("endpoints: []\n");
        } else {
            y.push_str("endpoints:\n");
            for ep in endpoints {
                let _ = write!(
                    y,
                    "- addresses:\n  - {}\n  conditions:\n    ready: {}\n    \
                     serving: {}\n    terminating: {}\n",
                    ep.ip, ep.ready, ep.serving, ep.terminating
                );
            }
        }
        self.slice_ports(&mut y);
        y
    }

    /// The Service and an IPv6 EndpointSlice with `endpoints` and their
    /// conditions, as one multi-document file.
    pub fn yaml6_with(&self, endpoints: &[Endpoint<Ipv6Addr>]) -> String {
        format!(
            "{}---\n{}",
            self.service_yaml(),
            self.endpoint_slice6_yaml_with(endpoints)
        )
    }

    /// The Service and an IPv6 EndpointSlice with `endpoints` ready, as one
    /// multi-document file.
    pub fn yaml6(&self, endpoints: &[Ipv6Addr]) -> String {
        format!(
            "{}---\n{}",
            self.service_yaml(),
            self.endpoint_slice6_yaml(endpoints)
        )
    }

    /// [`Service::yaml6`] with each endpoint on its node (`nodeName`, which
    /// externalTrafficPolicy Local and the SNAT of flows to other nodes go by).
    pub fn yaml6_on_nodes(&self, endpoints: &[(Ipv6Addr, &str)]) -> String {
        let mut y = self.slice_header("v6q9r", "IPv6");
        if endpoints.is_empty() {
            y.push_str("endpoints: []\n");
        } else {
            y.push_str("endpoints:\n");
            for (ip, node) in endpoints {
                let _ = write!(
                    y,
                    "- addresses:\n  - {ip}\n  conditions:\n    ready: true\n    \
                     serving: true\n    terminating: false\n  nodeName: {node}\n",
                );
            }
        }
        self.slice_ports(&mut y);
        format!("{}---\n{y}", self.service_yaml())
    }

    fn slice_header(&self, suffix: &str, address_type: &str) -> String {
        format!(
            "apiVersion: discovery.k8s.io/v1\n\
             kind: EndpointSlice\n\
             metadata:\n  name: {name}-{suffix}\n  namespace: {ns}\n  labels:\n    \
             endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io\n    \
             kubernetes.io/service-name: {name}\n\
             addressType: {address_type}\n",
            name = self.name,
            ns = self.namespace,
        )
    }

    fn slice_ports(&self, y: &mut String) {
        y.push_str("ports:\n");
        for p in &self.ports {
            let _ = write!(
                y,
                "- name: {}\n  port: {}\n  protocol: {}\n",
                p.name,
                p.target_port,
                p.protocol.upper()
            );
        }
    }

    /// The Service and, if `endpoints` is given, its EndpointSlice, as one
    /// multi-document file.
    pub fn yaml(&self, endpoints: Option<&[Ipv4Addr]>) -> String {
        match endpoints {
            Some(eps) => format!(
                "{}---\n{}",
                self.service_yaml(),
                self.endpoint_slice_yaml(eps)
            ),
            None => self.service_yaml(),
        }
    }

    /// The Service and an EndpointSlice with `endpoints` and their conditions (and
    /// nodes, for [`SliceEndpoint`]s), as one multi-document file.
    pub fn yaml_with<E>(&self, endpoints: &[E]) -> String
    where
        E: Clone + Into<SliceEndpoint>,
    {
        format!(
            "{}---\n{}",
            self.service_yaml(),
            self.endpoint_slice_yaml_with(endpoints)
        )
    }

    /// The same service port as kube-proxy's iptables mode would see it (its ClusterIP
    /// part only: [`KubeService`] has no NodePorts, externalIPs or load-balancer IPs),
    /// with its ClusterIP replaced by `cluster_ip` (to run both datapaths side by side) and
    /// `endpoints` as the endpoints its service chain uses.
    pub fn kube_service(
        &self,
        port_name: &str,
        cluster_ip: Ipv4Addr,
        endpoints: &[Ipv4Addr],
    ) -> KubeService {
        let port = self
            .ports
            .iter()
            .find(|p| p.name == port_name)
            .unwrap_or_else(|| panic!("service {} has no port {port_name}", self.name));
        KubeService {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            port_name: port.name.clone(),
            protocol: port.protocol,
            cluster_ip,
            port: port.port,
            endpoints: endpoints
                .iter()
                .map(|ip| SocketAddrV4::new(*ip, port.target_port))
                .collect(),
            affinity_timeout: self.session_affinity.timeout_seconds(),
        }
    }

    /// [`Service::kube_service`] for kube-proxy's IPv6 proxier: the port on
    /// `cluster_ip6` with `endpoints` (at its target port).
    pub fn kube_service6(
        &self,
        port_name: &str,
        cluster_ip6: Ipv6Addr,
        endpoints: &[Ipv6Addr],
    ) -> KubeService6 {
        let port = self
            .ports
            .iter()
            .find(|p| p.name == port_name)
            .unwrap_or_else(|| panic!("service {} has no port {port_name}", self.name));
        KubeService6 {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            port_name: port.name.clone(),
            protocol: port.protocol,
            cluster_ip: cluster_ip6,
            port: port.port,
            endpoints: endpoints
                .iter()
                .map(|ip| SocketAddrV6::new(*ip, port.target_port, 0, 0))
                .collect(),
            affinity_timeout: self.session_affinity.timeout_seconds(),
        }
    }
}

/// A private directory of manifest files, removed on drop.
#[derive(Debug)]
pub struct ManifestDir {
    root: PathBuf,
    dir: PathBuf,
}

impl ManifestDir {
    /// Creates `/tmp/<stem>-manifests/manifests`.
    pub fn create(stem: &str) -> Result<ManifestDir> {
        let root = std::env::temp_dir().join(format!("{stem}-manifests"));
        let dir = root.join("manifests");
        fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
        Ok(ManifestDir { root, dir })
    }

    /// The directory to pass to `--manifests`.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Writes `file` atomically: the content goes to a file outside the watched
    /// directory first and is renamed into place, so the agent never reads half a file.
    pub fn write(&self, file: &str, contents: &str) -> Result<()> {
        let staging = self.root.join(format!(".{file}.staging"));
        fs::write(&staging, contents).with_context(|| format!("write {}", staging.display()))?;
        let target = self.dir.join(file);
        fs::rename(&staging, &target).with_context(|| format!("rename to {}", target.display()))
    }

    /// Deletes `file` from the directory.
    pub fn remove(&self, file: &str) -> Result<()> {
        let target = self.dir.join(file);
        fs::remove_file(&target).with_context(|| format!("remove {}", target.display()))
    }
}

impl Drop for ManifestDir {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.root) {
            eprintln!("warning: cannot remove {}: {e}", self.root.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yaml_has_the_kubectl_shape() {
        let svc = Service::new("demo", "web", Ipv4Addr::new(10, 96, 0, 10))
            .port("http", 80, Protocol::Tcp, 8080)
            .port("dns", 53, Protocol::Udp, 5353);
        let y = svc.yaml(Some(&[Ipv4Addr::new(10, 200, 0, 11)]));
        for needle in [
            "kind: Service\n",
            "  clusterIP: 10.96.0.10\n",
            "  clusterIPs:\n  - 10.96.0.10\n",
            "  - name: http\n    port: 80\n    protocol: TCP\n    targetPort: 8080\n",
            "  - name: dns\n    port: 53\n    protocol: UDP\n    targetPort: 5353\n",
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\n",
            "    kubernetes.io/service-name: web\n",
            "- addresses:\n  - 10.200.0.11\n  conditions:\n    ready: true\n",
            "- name: dns\n  port: 5353\n  protocol: UDP\n",
        ] {
            assert!(y.contains(needle), "missing {needle:?} in\n{y}");
        }
        assert!(svc.yaml(Some(&[])).contains("endpoints: []\n"));
        assert!(!svc.yaml(None).contains("EndpointSlice"));
        assert!(y.contains("  sessionAffinity: None\n"));
        assert!(!y.contains("sessionAffinityConfig"));
        assert_eq!(
            svc.kube_service("http", svc.cluster_ip, &[])
                .affinity_timeout,
            None
        );
    }

    #[test]
    fn affinity_and_conditions_are_written() {
        let ip = Ipv4Addr::new(10, 200, 0, 11);
        let sticky = Service::new("demo", "web", Ipv4Addr::new(10, 96, 0, 10))
            .port("http", 80, Protocol::Tcp, 8080)
            .session_affinity(SessionAffinity::ClientIp {
                timeout_seconds: Some(3),
            });
        let y = sticky.yaml_with(&[Endpoint::terminating_serving(ip)]);
        for needle in [
            "  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    clientIP:\n      \
             timeoutSeconds: 3\n  type: ClusterIP\n",
            "- addresses:\n  - 10.200.0.11\n  conditions:\n    ready: false\n    \
             serving: true\n    terminating: true\n",
        ] {
            assert!(y.contains(needle), "missing {needle:?} in\n{y}");
        }
        assert_eq!(
            sticky
                .kube_service("http", sticky.cluster_ip, &[ip])
                .affinity_timeout,
            Some(3)
        );
        // Without timeoutSeconds the field is left out, and the API default applies.
        let default = sticky.session_affinity(SessionAffinity::ClientIp {
            timeout_seconds: None,
        });
        let y = default.service_yaml();
        assert!(
            y.contains("  sessionAffinity: ClientIP\n  type: ClusterIP\n"),
            "{y}"
        );
        assert_eq!(
            default
                .kube_service("http", default.cluster_ip, &[ip])
                .affinity_timeout,
            Some(DEFAULT_AFFINITY_TIMEOUT_S)
        );
    }

    /// Parses `yaml` with the agent's own manifest reader (`serde_yaml` into
    /// k8s-openapi's types), failing on any object it rejects.
    fn parse(
        yaml: &str,
    ) -> (
        Vec<k8s_openapi::api::core::v1::Service>,
        Vec<k8s_openapi::api::discovery::v1::EndpointSlice>,
    ) {
        let (parsed, errors) =
            proxy_userspace::source::manifest::parse_manifest(Path::new("test.yaml"), yaml)
                .unwrap_or_else(|e| panic!("{e}\n{yaml}"));
        assert!(errors.is_empty(), "{errors:?}\n{yaml}");
        (parsed.services, parsed.endpoint_slices)
    }

    #[test]
    fn cluster_ip_yaml_parses_as_kubernetes_objects() {
        let svc = Service::new("demo", "web", Ipv4Addr::new(10, 96, 0, 10))
            .port("http", 80, Protocol::Tcp, 8080)
            .session_affinity(SessionAffinity::ClientIp {
                timeout_seconds: Some(3),
            });
        let (services, slices) = parse(&svc.yaml(Some(&[Ipv4Addr::new(10, 200, 0, 11)])));
        assert_eq!(services.len(), 1);
        assert_eq!(slices.len(), 1);
        let spec = services[0].spec.clone().expect("spec");
        assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
        assert_eq!(spec.external_traffic_policy, None);
        assert_eq!(spec.external_ips, None);
        assert!(services[0].status.is_none());
        let port = &spec.ports.expect("ports")[0];
        assert_eq!((port.port, port.node_port), (80, None));
        assert_eq!(slices[0].endpoints[0].node_name, None);
    }

    #[test]
    fn ipv6_and_dual_stack_yaml_parse_as_kubernetes_objects() {
        let ip6: Ipv6Addr = "fd00:96::10".parse().expect("literal");
        let backend6: Ipv6Addr = "fd00:10::a00:b".parse().expect("literal");
        let v6 = Service::new_v6("demo", "web6", ip6).port("http", 80, Protocol::Tcp, 8080);
        let (services, slices) = parse(&v6.yaml6(&[backend6]));
        let spec = services[0].spec.clone().expect("spec");
        assert_eq!(spec.cluster_ips, Some(vec![ip6.to_string()]));
        assert_eq!(spec.ip_families, Some(vec!["IPv6".to_owned()]));
        assert_eq!(slices[0].address_type, "IPv6");
        assert_eq!(slices[0].endpoints[0].addresses, vec![backend6.to_string()]);

        let dual = Service::new("demo", "web", Ipv4Addr::new(10, 96, 0, 10))
            .dual_stack(ip6)
            .port("http", 80, Protocol::Tcp, 8080);
        let both = format!(
            "{}---\n{}",
            dual.yaml(Some(&[Ipv4Addr::new(10, 200, 0, 11)])),
            dual.endpoint_slice6_yaml(&[backend6])
        );
        let (services, slices) = parse(&both);
        let spec = services[0].spec.clone().expect("spec");
        assert_eq!(spec.cluster_ip.as_deref(), Some("10.96.0.10"));
        assert_eq!(
            spec.cluster_ips,
            Some(vec!["10.96.0.10".to_owned(), ip6.to_string()])
        );
        assert_eq!(
            spec.ip_families,
            Some(vec!["IPv4".to_owned(), "IPv6".to_owned()])
        );
        assert_eq!(spec.ip_family_policy.as_deref(), Some("RequireDualStack"));
        let types: Vec<&str> = slices.iter().map(|s| s.address_type.as_str()).collect();
        assert_eq!(types, ["IPv4", "IPv6"]);
        assert_ne!(slices[0].metadata.name, slices[1].metadata.name);
    }

    #[test]
    fn north_south_fields_parse_as_kubernetes_objects() {
        let (a, b) = (Ipv4Addr::new(10, 1, 1, 10), Ipv4Addr::new(10, 1, 2, 10));
        let svc = Service::new("demo", "web", Ipv4Addr::new(10, 96, 0, 10))
            .type_(ServiceType::LoadBalancer)
            .port("http", 80, Protocol::Tcp, 8080)
            .port("dns", 53, Protocol::Udp, 5353)
            .node_port("http", 30080)
            .external_ip(Ipv4Addr::new(192, 168, 60, 20))
            .load_balancer_ingress(Ipv4Addr::new(192, 168, 60, 10))
            .load_balancer_ingress(Ipv4Addr::new(192, 168, 60, 11))
            .load_balancer_source_range("192.168.50.100/32")
            .load_balancer_source_range("203.0.113.0/24")
            .external_traffic_policy(TrafficPolicy::Local)
            .health_check_node_port(32000);
        let y = svc.yaml_with(&[
            Endpoint::ready(a).on_node("a"),
            Endpoint::terminating_serving(b).on_node("b"),
            Endpoint::ready(Ipv4Addr::new(10, 1, 2, 11)).into(),
        ]);
        for needle in [
            "  - name: http\n    nodePort: 30080\n    port: 80\n",
            "  - name: dns\n    port: 53\n",
            "  type: LoadBalancer\nstatus:\n  loadBalancer:\n    ingress:\n    \
             - ip: 192.168.60.10\n    - ip: 192.168.60.11\n",
            "    terminating: false\n  nodeName: a\n",
        ] {
            assert!(y.contains(needle), "missing {needle:?} in\n{y}");
        }
        let (services, slices) = parse(&y);
        let spec = services[0].spec.clone().expect("spec");
        assert_eq!(spec.type_.as_deref(), Some("LoadBalancer"));
        assert_eq!(spec.external_traffic_policy.as_deref(), Some("Local"));
        assert_eq!(spec.health_check_node_port, Some(32000));
        assert_eq!(spec.external_ips, Some(vec!["192.168.60.20".to_owned()]));
        assert_eq!(
            spec.load_balancer_source_ranges,
            Some(vec![
                "192.168.50.100/32".to_owned(),
                "203.0.113.0/24".to_owned()
            ])
        );
        let ports = spec.ports.expect("ports");
        assert_eq!(
            ports
                .iter()
                .map(|p| (p.name.as_deref(), p.port, p.node_port))
                .collect::<Vec<_>>(),
            vec![(Some("http"), 80, Some(30080)), (Some("dns"), 53, None)]
        );
        let ingress: Vec<Option<String>> = services[0]
            .status
            .clone()
            .and_then(|s| s.load_balancer)
            .and_then(|lb| lb.ingress)
            .expect("status.loadBalancer.ingress")
            .into_iter()
            .map(|i| i.ip)
            .collect();
        assert_eq!(
            ingress,
            vec![
                Some("192.168.60.10".to_owned()),
                Some("192.168.60.11".to_owned())
            ]
        );
        let endpoints = &slices[0].endpoints;
        assert_eq!(
            endpoints
                .iter()
                .map(|e| (e.addresses[0].as_str(), e.node_name.as_deref()))
                .collect::<Vec<_>>(),
            vec![
                ("10.1.1.10", Some("a")),
                ("10.1.2.10", Some("b")),
                ("10.1.2.11", None)
            ]
        );
        let conditions = endpoints[1].conditions.clone().expect("conditions");
        assert_eq!(
            (conditions.ready, conditions.serving, conditions.terminating),
            (Some(false), Some(true), Some(true))
        );
    }

    #[test]
    fn external_traffic_policy_defaults_like_the_api_server() {
        let cluster_ip = Service::new("demo", "web", Ipv4Addr::new(10, 96, 0, 10)).port(
            "http",
            80,
            Protocol::Tcp,
            8080,
        );
        assert_eq!(cluster_ip.effective_external_traffic_policy(), None);
        let node_port = cluster_ip
            .clone()
            .type_(ServiceType::NodePort)
            .node_port("http", 30080);
        let external = cluster_ip.external_ip(Ipv4Addr::new(192, 168, 60, 20));
        for svc in [node_port, external] {
            let (services, _) = parse(&svc.service_yaml());
            assert_eq!(
                services[0]
                    .spec
                    .as_ref()
                    .and_then(|s| s.external_traffic_policy.as_deref()),
                Some("Cluster"),
                "{}",
                svc.service_yaml()
            );
        }
    }
}
