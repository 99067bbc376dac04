//! Which addresses a Service may claim, and how many frontends it may ask
//! for (docs/security.md). A Service's external addresses (externalIPs,
//! load balancer ingress IPs) are whatever its author, or a load balancer
//! controller, wrote: unchecked, one tenant could capture another's
//! ClusterIP, the node's own ports, or the metadata server of every pod on
//! the node. Each such address is refused on its own, the rest of the
//! Service still served; a Service that asks for more frontends than its
//! budget is refused as a whole, counted from the sizes of its spec before
//! anything is made of it.

use std::{fmt, net::IpAddr};

use super::{
    FrontendKind, ModelConfig, Protocol,
    claims::{AddressClaims, Rank},
};

/// The budget of frontends one Service may ask for, unless
/// `--max-frontends-per-service` says otherwise (docs/security.md,
/// "Budgets", says how it was chosen).
pub const DEFAULT_MAX_FRONTENDS_PER_SERVICE: u64 = 4096;

/// Why an address, or a whole Service, is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// A ClusterIP, of any Service: ClusterIPs always win.
    ClusterIp,
    /// One of this node's addresses (its Node's `status.addresses`, its
    /// interfaces'): the node's own listeners would be captured.
    NodeAddress,
    /// `127.0.0.0/8`, `::1`.
    Loopback,
    /// `169.254.0.0/16` (where the cloud's metadata server answers), `fe80::/10`.
    LinkLocal,
    Multicast,
    /// `255.255.255.255`.
    Broadcast,
    /// `0.0.0.0`, `::`: the NodePort frontends' "every node address".
    Unspecified,
    /// An externalIP outside `--external-ip-cidrs`.
    NotAllowed,
    /// The address, port and protocol are an older Service's.
    Conflict,
    /// The Service asks for more frontends than `--max-frontends-per-service`.
    Budget,
}

impl Reason {
    pub const ALL: [Reason; 10] = [
        Reason::ClusterIp,
        Reason::NodeAddress,
        Reason::Loopback,
        Reason::LinkLocal,
        Reason::Multicast,
        Reason::Broadcast,
        Reason::Unspecified,
        Reason::NotAllowed,
        Reason::Conflict,
        Reason::Budget,
    ];

    /// Its name in the metrics' `reason` label.
    pub fn label(self) -> &'static str {
        match self {
            Reason::ClusterIp => "cluster_ip",
            Reason::NodeAddress => "node_address",
            Reason::Loopback => "loopback",
            Reason::LinkLocal => "link_local",
            Reason::Multicast => "multicast",
            Reason::Broadcast => "broadcast",
            Reason::Unspecified => "unspecified",
            Reason::NotAllowed => "not_allowed",
            Reason::Conflict => "conflict",
            Reason::Budget => "budget",
        }
    }

    /// The `reason` of the Event on the Service (`kubectl describe`).
    pub fn event_reason(self) -> &'static str {
        match self {
            Reason::Budget => "FrontendBudgetExceeded",
            Reason::Conflict => "AddressClaimedByOlderService",
            Reason::NotAllowed => "ExternalIPNotAllowed",
            _ => "AddressRefused",
        }
    }
}

/// What the model refused of a Service, and why.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Refusal {
    pub reason: Reason,
    /// The address refused; None when the whole Service is.
    pub address: Option<RefusedAddress>,
    /// The why in words: whose ClusterIP, which Service won, the count.
    pub detail: String,
}

/// An external address refused: on every port of the Service, or (for a
/// conflict) on one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RefusedAddress {
    pub kind: FrontendKind,
    pub ip: IpAddr,
    pub port: Option<(u16, Protocol)>,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.address {
            None => write!(f, "the Service: {}", self.detail),
            Some(address) => {
                let kind = match address.kind {
                    FrontendKind::ExternalIp => "externalIP",
                    FrontendKind::LoadBalancer => "load balancer IP",
                    FrontendKind::ClusterIp => "ClusterIP",
                    FrontendKind::NodePort => "NodePort",
                };
                write!(f, "{kind} {}", address.ip)?;
                if let Some((port, protocol)) = address.port {
                    write!(f, " port {port}/{protocol}")?;
                }
                write!(f, ": {}", self.detail)
            }
        }
    }
}

/// The reason an address is refused by what it is, whoever claims it.
/// An IPv4-mapped IPv6 address is read as the IPv4 address it maps.
pub fn special_address(ip: IpAddr) -> Option<Reason> {
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            if v4.is_unspecified() {
                Some(Reason::Unspecified)
            } else if v4.is_loopback() {
                Some(Reason::Loopback)
            } else if v4.is_link_local() {
                Some(Reason::LinkLocal)
            } else if v4.is_multicast() {
                Some(Reason::Multicast)
            } else if v4.is_broadcast() {
                Some(Reason::Broadcast)
            } else {
                None
            }
        }
        IpAddr::V6(v6) => {
            if v6.is_unspecified() {
                Some(Reason::Unspecified)
            } else if v6.is_loopback() {
                Some(Reason::Loopback)
            } else if v6.segments()[0] & 0xffc0 == 0xfe80 {
                Some(Reason::LinkLocal)
            } else if v6.is_multicast() {
                Some(Reason::Multicast)
            } else {
                None
            }
        }
    }
}

/// The policy as one Service's model reads it: the configuration, the
/// cluster's claims, and the Service's own rank among claimants.
pub(super) struct AddressCheck<'a> {
    pub(super) config: &'a ModelConfig,
    pub(super) claims: &'a AddressClaims,
    pub(super) rank: Rank,
}

impl<'a> AddressCheck<'a> {
    pub(super) fn new(config: &'a ModelConfig, claims: &'a AddressClaims, rank: Rank) -> Self {
        AddressCheck {
            config,
            claims,
            rank,
        }
    }

    /// Why `ip`, claimed as `kind`, is refused on every port; None when it
    /// may be programmed (unless an older Service has a port of it).
    pub(super) fn address(&self, kind: FrontendKind, ip: IpAddr) -> Option<(Reason, String)> {
        if let Some(reason) = special_address(ip) {
            let what = match reason {
                Reason::Unspecified => "the unspecified address",
                Reason::Loopback => "a loopback address",
                Reason::LinkLocal => "a link-local address (the metadata server's range)",
                Reason::Multicast => "a multicast address",
                _ => "the broadcast address",
            };
            return Some((reason, format!("{what} is no Service's to claim")));
        }
        if let Some(owner) = self.claims.cluster_ip_owners(ip).first() {
            return Some((
                Reason::ClusterIp,
                format!("the ClusterIP of {owner}; ClusterIPs always win"),
            ));
        }
        if self.claims.is_node_address(ip) {
            return Some((
                Reason::NodeAddress,
                "an address of this node, whose own listeners it would capture".to_owned(),
            ));
        }
        if kind == FrontendKind::ExternalIp && !self.allowed(ip) {
            return Some((Reason::NotAllowed, "outside --external-ip-cidrs".to_owned()));
        }
        None
    }

    /// Whether `--external-ip-cidrs` lets an externalIP be `ip` (always,
    /// when it is not set).
    fn allowed(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.config
            .external_ip_cidrs
            .as_ref()
            .is_none_or(|cidrs| cidrs.iter().any(|c| c.contains(ip)))
    }

    /// The older Service that has `ip:port/protocol`, when one has.
    pub(super) fn conflict(&self, ip: IpAddr, port: u16, protocol: Protocol) -> Option<String> {
        self.claims
            .older_claimant(
                ip,
                port,
                protocol,
                &self.rank,
                self.config,
                self.allowed(ip),
            )
            .map(|winner| format!("claimed by the older Service {winner}"))
    }

    /// The Service as a whole, when it asks for more frontends than it may.
    pub(super) fn budget(&self, frontends: u64, shed: bool) -> Option<Refusal> {
        let max = self.config.max_frontends_per_service;
        over_budget(self.config, frontends, shed).then(|| Refusal {
            reason: Reason::Budget,
            address: None,
            detail: format!(
                "it asks for {frontends} frontends (ports x addresses), more than \
                 --max-frontends-per-service {max}: none of them is programmed"
            ),
        })
    }
}

/// Whether a Service asking for `frontends` frontends (or one whose
/// addresses were shed, `shed`) is over `config`'s budget: refused as a
/// whole, its frontends and its health check node port alike.
pub(super) fn over_budget(config: &ModelConfig, frontends: u64, shed: bool) -> bool {
    frontends > config.max_frontends_per_service || shed
}
