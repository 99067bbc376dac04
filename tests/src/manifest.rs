//! Manifests for `ebpf-proxy run --manifests DIR`: Services and EndpointSlices in the
//! shape `kubectl get -o yaml` prints them, written to a private directory that tests
//! can rewrite while the agent watches it.

use std::{
    fmt::Write as _,
    fs,
    net::{Ipv4Addr, SocketAddrV4},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};

use crate::{Protocol, iptables::KubeService};

/// One port of a Service.
#[derive(Debug, Clone)]
pub struct ServicePort {
    pub name: String,
    pub port: u16,
    pub protocol: Protocol,
    pub target_port: u16,
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
/// controller publishes for a pod: reference/kube-proxy-semantics.md §3.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    pub ip: Ipv4Addr,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

impl Endpoint {
    /// A running pod that passes its readiness probe.
    pub fn ready(ip: Ipv4Addr) -> Endpoint {
        Endpoint {
            ip,
            ready: true,
            serving: true,
            terminating: false,
        }
    }

    /// A pod being deleted that still passes its readiness probe: `ready` turns false
    /// (`ready = serving && !terminating`), `serving` stays true.
    pub fn terminating_serving(ip: Ipv4Addr) -> Endpoint {
        Endpoint {
            ip,
            ready: false,
            serving: true,
            terminating: true,
        }
    }

    /// A pod being deleted that no longer passes its readiness probe.
    pub fn terminating_not_serving(ip: Ipv4Addr) -> Endpoint {
        Endpoint {
            ip,
            ready: false,
            serving: false,
            terminating: true,
        }
    }
}

/// A ClusterIP Service; its endpoints are given when writing its EndpointSlice.
#[derive(Debug, Clone)]
pub struct Service {
    pub namespace: String,
    pub name: String,
    pub cluster_ip: Ipv4Addr,
    pub ports: Vec<ServicePort>,
    pub session_affinity: SessionAffinity,
}

impl Service {
    pub fn new(namespace: &str, name: &str, cluster_ip: Ipv4Addr) -> Service {
        Service {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            cluster_ip,
            ports: Vec::new(),
            session_affinity: SessionAffinity::None,
        }
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
        });
        self
    }

    /// The Service object.
    pub fn service_yaml(&self) -> String {
        let mut y = String::new();
        let ip = self.cluster_ip;
        let _ = write!(
            y,
            "apiVersion: v1\n\
             kind: Service\n\
             metadata:\n  name: {name}\n  namespace: {ns}\n\
             spec:\n  clusterIP: {ip}\n  clusterIPs:\n  - {ip}\n  \
             internalTrafficPolicy: Cluster\n  ipFamilies:\n  - IPv4\n  \
             ipFamilyPolicy: SingleStack\n  ports:\n",
            name = self.name,
            ns = self.namespace,
        );
        for p in &self.ports {
            let _ = write!(
                y,
                "  - name: {}\n    port: {}\n    protocol: {}\n    targetPort: {}\n",
                p.name,
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
        y.push_str("  type: ClusterIP\n");
        y
    }

    /// An EndpointSlice for this Service with `endpoints` ready (none is valid: a
    /// Service whose pods are all gone).
    pub fn endpoint_slice_yaml(&self, endpoints: &[Ipv4Addr]) -> String {
        let endpoints: Vec<Endpoint> = endpoints.iter().map(|ip| Endpoint::ready(*ip)).collect();
        self.endpoint_slice_yaml_with(&endpoints)
    }

    /// An EndpointSlice for this Service with `endpoints` and their conditions.
    pub fn endpoint_slice_yaml_with(&self, endpoints: &[Endpoint]) -> String {
        let mut y = String::new();
        let _ = write!(
            y,
            "apiVersion: discovery.k8s.io/v1\n\
             kind: EndpointSlice\n\
             metadata:\n  name: {name}-x7k2p\n  namespace: {ns}\n  labels:\n    \
             endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io\n    \
             kubernetes.io/service-name: {name}\n\
             addressType: IPv4\n",
            name = self.name,
            ns = self.namespace,
        );
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
        y
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

    /// The Service and an EndpointSlice with `endpoints` and their conditions, as one
    /// multi-document file.
    pub fn yaml_with(&self, endpoints: &[Endpoint]) -> String {
        format!(
            "{}---\n{}",
            self.service_yaml(),
            self.endpoint_slice_yaml_with(endpoints)
        )
    }

    /// The same service port as kube-proxy's iptables mode would see it, with its
    /// ClusterIP replaced by `cluster_ip` (to run both datapaths side by side) and
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
}
