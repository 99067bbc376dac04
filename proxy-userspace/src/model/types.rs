//! The desired datapath state: what the model computes and the planner applies.

use std::{fmt, net::IpAddr};

pub use crate::maglev::LbAlgorithm;

/// L4 protocol of a frontend or backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// IANA protocol number, as in the IP header.
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => proxy_common::PROTO_TCP,
            Protocol::Udp => proxy_common::PROTO_UDP,
            Protocol::Sctp => proxy_common::PROTO_SCTP,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        })
    }
}

/// Which clients a frontend entry applies to (see `proxy_common::scope`).
///
/// The model emits `Internal` entries only for external frontends
/// (NodePort, `ExternalIp`, LoadBalancer) of a Service with
/// externalTrafficPolicy Local: in-cluster clients (pods, the node itself)
/// of those addresses get the Cluster endpoint set, as kube-proxy's EXT
/// chain sends them to the service chain instead of the local one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scope {
    Any,
    Internal,
}

/// What kind of address a frontend is: it decides which traffic policy applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FrontendKind {
    /// An address of spec.clusterIPs; internalTrafficPolicy applies.
    ClusterIp,
    /// A spec.ports[].nodePort. Its key's `ip` is the unspecified address of
    /// the family (0.0.0.0 or ::), meaning "every address of this node";
    /// externalTrafficPolicy applies.
    NodePort,
    /// An address of spec.externalIPs; externalTrafficPolicy applies.
    ExternalIp,
    /// An `ip` of status.loadBalancer.ingress (ipMode VIP or unset);
    /// externalTrafficPolicy applies.
    LoadBalancer,
}

/// A (address, port, protocol, scope) the datapath matches packets on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FrontendKey {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    pub scope: Scope,
}

impl fmt::Display for FrontendKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.ip {
            IpAddr::V4(ip) => write!(f, "{ip}:{}/{}", self.port, self.protocol)?,
            IpAddr::V6(ip) => write!(f, "[{ip}]:{}/{}", self.port, self.protocol)?,
        }
        if self.scope == Scope::Internal {
            f.write_str(" (internal)")?;
        }
        Ok(())
    }
}

/// kube-proxy's `ServicePortName`: "namespace/name:port" (no ":port" when the
/// port has no name), plus the protocol. Affinity and service ids are per
/// `ServicePort`, shared by every frontend of it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServicePortName {
    pub namespace: String,
    pub name: String,
    pub port: String,
    pub protocol: Protocol,
}

impl ServicePortName {
    pub fn new(namespace: &str, name: &str, port: &str, protocol: Protocol) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            port: port.into(),
            protocol,
        }
    }
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)?;
        if !self.port.is_empty() {
            write!(f, ":{}", self.port)?;
        }
        write!(f, "/{}", self.protocol)
    }
}

/// One endpoint the datapath may send a frontend's traffic to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendAddr {
    pub ip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    /// The endpoint is on this node.
    pub local: bool,
    /// The endpoint is serving but terminating (a fallback set).
    pub terminating: bool,
}

impl BackendAddr {
    /// A ready endpoint on another node.
    pub fn remote(ip: IpAddr, port: u16, protocol: Protocol) -> Self {
        Self {
            ip,
            port,
            protocol,
            local: false,
            terminating: false,
        }
    }

    /// kube-proxy's endpoint string, `net.JoinHostPort(ip, port)`, which is
    /// also the sort key of a backend set.
    pub fn host_port(&self) -> String {
        match self.ip {
            IpAddr::V4(ip) => format!("{ip}:{}", self.port),
            IpAddr::V6(ip) => format!("[{ip}]:{}", self.port),
        }
    }

    /// [`host_port`](Self::host_port) as the sort key of a backend set,
    /// without a heap string: zero-padded, so that the arrays order as the
    /// strings do (the longest, `[v6]:port`, is 47 bytes).
    pub fn host_port_key(&self) -> [u8; 48] {
        use std::io::Write;
        let mut key = [0u8; 48];
        let IpAddr::V6(ip) = self.ip else {
            // IPv4 by hand: the formatter's machinery was most of a first
            // sync's sorting of 1,000,000 endpoints.
            let mut at = 0;
            if let IpAddr::V4(ip) = self.ip {
                for (i, octet) in ip.octets().into_iter().enumerate() {
                    if i > 0 {
                        key[at] = b'.';
                        at += 1;
                    }
                    at = put_decimal(&mut key, at, u32::from(octet));
                }
            }
            key[at] = b':';
            put_decimal(&mut key, at + 1, u32::from(self.port));
            return key;
        };
        let mut rest = &mut key[..];
        // Cannot run out of room: see above.
        let _ = write!(rest, "[{ip}]:{}", self.port);
        key
    }
}

/// Writes `n` in decimal into `key` at `at`; returns the position after it.
fn put_decimal(key: &mut [u8; 48], at: usize, n: u32) -> usize {
    let mut digits = [0u8; 10];
    let mut len = 0;
    let mut rest = n;
    loop {
        digits[len] = b'0' + (rest % 10) as u8;
        len += 1;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    for (i, digit) in digits[..len].iter().rev().enumerate() {
        key[at + i] = *digit;
    }
    at + len
}

/// What the datapath does with a packet to a frontend that has no backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NoEndpointAction {
    /// ICMP port unreachable, so clients fail at once (kube-proxy's REJECT).
    Reject,
    /// Silently dropped (kube-proxy's DROP for ITP/ETP Local with no local
    /// endpoints).
    Drop,
}

/// The complete desired programming of one frontend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frontend {
    pub key: FrontendKey,
    pub kind: FrontendKind,
    pub service: ServicePortName,
    /// The Service port's number (`spec.ports[].port`), which a NodePort
    /// frontend's key does not carry: what names the port to an operator.
    pub service_port: u16,
    /// Ordered as kube-proxy orders them (by `host_port()` string); empty
    /// means `no_endpoints` applies.
    pub backends: Vec<BackendAddr>,
    /// What to do when `backends` is empty: Reject when the Service has no
    /// usable endpoint anywhere, Drop when a Local traffic policy leaves this
    /// node without one. Always Reject when `backends` is not empty, so that
    /// it changes only when it matters.
    pub no_endpoints: NoEndpointAction,
    /// ClientIP session affinity timeout, when affinity is on.
    pub affinity_timeout_s: Option<u32>,
    /// loadBalancerSourceRanges of the address's family, for LoadBalancer
    /// frontends that have them: only clients inside one are served, the
    /// rest are dropped (kube-proxy's firewall chain). Empty means everyone.
    pub source_ranges: Vec<Cidr>,
    /// The Service's `ebpf-proxy.io/lb-algorithm`; None: `--lb-algorithm`'s.
    pub lb_algorithm: Option<LbAlgorithm>,
}

impl Frontend {
    /// A ClusterIP frontend `ip:port` of `service` (and of its protocol) with
    /// `backends` put in kube-proxy's order, rejecting when there are none:
    /// what tests and benches program without a Service object.
    pub fn cluster_ip(
        service: ServicePortName,
        ip: IpAddr,
        port: u16,
        mut backends: Vec<BackendAddr>,
    ) -> Self {
        backends.sort_by_key(BackendAddr::host_port_key);
        Self {
            key: FrontendKey {
                ip,
                port,
                protocol: service.protocol,
                scope: Scope::Any,
            },
            kind: FrontendKind::ClusterIp,
            service,
            service_port: port,
            backends,
            no_endpoints: NoEndpointAction::Reject,
            affinity_timeout_s: None,
            source_ranges: Vec::new(),
            lb_algorithm: None,
        }
    }
}

/// An address range (loadBalancerSourceRanges, `--nodeport-addresses`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    /// The network address (host bits cleared).
    pub ip: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    /// Parses "a.b.c.d/n" or "`v6::/n`"; host bits are cleared.
    pub fn parse(text: &str) -> Option<Cidr> {
        let (ip, prefix) = text.trim().split_once('/')?;
        let ip: IpAddr = ip.parse().ok()?;
        let prefix: u8 = prefix.parse().ok()?;
        let ip = match ip {
            IpAddr::V4(v4) if prefix <= 32 => {
                let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
                IpAddr::V4((u32::from(v4) & mask).into())
            }
            IpAddr::V6(v6) if prefix <= 128 => {
                let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
                IpAddr::V6((u128::from(v6) & mask).into())
            }
            _ => return None,
        };
        Some(Cidr { ip, prefix })
    }

    /// The range of `ip` alone (a /32 or /128).
    pub fn host(ip: IpAddr) -> Cidr {
        let ip = ip.to_canonical();
        let prefix = if ip.is_ipv4() { 32 } else { 128 };
        Cidr { ip, prefix }
    }

    /// Whether `ip` is inside the range.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.ip, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(ip) & mask == u32::from(net)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(ip) & mask == u128::from(net)
            }
            _ => false,
        }
    }

    /// The prefix over the 128-bit datapath form of the address (IPv4 is
    /// IPv4-mapped, so its prefix sits 96 bits in).
    pub fn prefix128(&self) -> u32 {
        match self.ip {
            IpAddr::V4(_) => 96 + u32::from(self.prefix),
            IpAddr::V6(_) => u32::from(self.prefix),
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.ip, self.prefix)
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_sort_by_their_key_as_by_their_host_port_string() {
        let mut backends: Vec<BackendAddr> = [
            ("10.0.0.10", 80),
            ("10.0.0.9", 8080),
            ("10.0.0.9", 80),
            ("10.0.0.1", 443),
            ("192.168.1.1", 1),
            ("2001:db8::1", 80),
            ("2001:db8::10", 65535),
            ("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", 65535),
            ("::ffff:255.255.255.255", 9),
            ("fd00::", 443),
        ]
        .into_iter()
        .map(|(ip, port)| BackendAddr::remote(ip.parse().unwrap(), port, Protocol::Tcp))
        .collect();
        let mut by_string = backends.clone();
        by_string.sort_by_key(BackendAddr::host_port);
        backends.sort_by_key(BackendAddr::host_port_key);
        assert_eq!(
            backends
                .iter()
                .map(BackendAddr::host_port)
                .collect::<Vec<_>>(),
            by_string
                .iter()
                .map(BackendAddr::host_port)
                .collect::<Vec<_>>(),
            "the key orders as the string"
        );
        let longest = BackendAddr::remote(
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff".parse().unwrap(),
            65535,
            Protocol::Tcp,
        );
        let key = longest.host_port_key();
        let len = key.iter().position(|b| *b == 0).unwrap_or(key.len());
        assert_eq!(
            &key[..len],
            longest.host_port().as_bytes(),
            "the longest host:port fits"
        );
        for (ip, port) in [
            ("0.0.0.0", 0),
            ("10.0.0.1", 80),
            ("10.96.100.9", 8080),
            ("255.255.255.255", 65535),
            ("1.20.199.0", 10),
        ] {
            let addr = BackendAddr::remote(ip.parse().unwrap(), port, Protocol::Tcp);
            let key = addr.host_port_key();
            let text = addr.host_port();
            assert_eq!(&key[..text.len()], text.as_bytes(), "{text}");
            assert!(key[text.len()..].iter().all(|b| *b == 0), "{text}: padded");
        }
    }

    #[test]
    fn cidrs_parse_clear_host_bits_and_match() {
        let c = Cidr::parse(" 192.168.50.7/24 ").expect("a CIDR");
        assert_eq!(c.to_string(), "192.168.50.0/24");
        assert_eq!(c.prefix128(), 120);
        assert!(c.contains("192.168.50.200".parse().unwrap()));
        assert!(!c.contains("192.168.51.1".parse().unwrap()));
        assert!(!c.contains("::ffff:192.168.50.1".parse().unwrap()));
        assert!(
            Cidr::parse("0.0.0.0/0")
                .unwrap()
                .contains("8.8.8.8".parse().unwrap())
        );
        let v6 = Cidr::parse("2001:db8::1/32").unwrap();
        assert_eq!(v6.to_string(), "2001:db8::/32");
        assert!(v6.contains("2001:db8:ffff::1".parse().unwrap()));
        for bad in [
            "192.168.0.0",
            "192.168.0.0/33",
            "fd00::/129",
            "x/8",
            "10.0.0.0/-1",
        ] {
            assert_eq!(Cidr::parse(bad), None, "{bad} is not a CIDR");
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
