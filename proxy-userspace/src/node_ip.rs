//! The node's addresses as configured (`--node-ip`, the configuration
//! file's `bindAddress`): at most one per family, as kubelet's dual-stack
//! `--node-ip` (`10.0.0.5,fd00::5`). The IPv4 one is the SNAT address of
//! external IPv4 flows to remote backends; the IPv6 one the address the
//! node's IPv6 sockets reach Services as. A family left out is taken from
//! the interfaces.

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    str::FromStr,
};

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum NodeIpError {
    #[error("{0:?} is not an IP address")]
    NotAnAddress(String),
    #[error("{first} and {second} are both {family}: give at most one address per family")]
    SameFamily {
        family: &'static str,
        first: IpAddr,
        second: IpAddr,
    },
    #[error("{0} is not an address of this node (unspecified, loopback or multicast)")]
    NotNodeAddress(IpAddr),
}

/// At most one configured address per family.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeIps {
    pub v4: Option<Ipv4Addr>,
    pub v6: Option<Ipv6Addr>,
}

impl NodeIps {
    /// Adds `ip`, refusing a second address of its family.
    pub fn with(mut self, ip: IpAddr) -> Result<Self, NodeIpError> {
        // An IPv4-mapped address is the IPv4 address it names.
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            IpAddr::V4(_) => ip,
        };
        if ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() {
            return Err(NodeIpError::NotNodeAddress(ip));
        }
        let same = |family, first: IpAddr| NodeIpError::SameFamily {
            family,
            first,
            second: ip,
        };
        match ip {
            IpAddr::V4(v4) => match self.v4 {
                Some(first) => return Err(same("IPv4", first.into())),
                None => self.v4 = Some(v4),
            },
            IpAddr::V6(v6) => match self.v6 {
                Some(first) => return Err(same("IPv6", first.into())),
                None => self.v6 = Some(v6),
            },
        }
        Ok(self)
    }

    pub fn is_empty(&self) -> bool {
        self.v4.is_none() && self.v6.is_none()
    }
}

impl FromStr for NodeIps {
    type Err = NodeIpError;

    /// Comma-separated addresses, at most one per family; empty entries
    /// (a trailing comma) are skipped.
    fn from_str(s: &str) -> Result<Self, NodeIpError> {
        s.split(',')
            .map(str::trim)
            .filter(|entry| !entry.is_empty())
            .try_fold(NodeIps::default(), |ips, entry| {
                let ip = entry
                    .parse()
                    .map_err(|_| NodeIpError::NotAnAddress(entry.to_owned()))?;
                ips.with(ip)
            })
    }
}

impl fmt::Display for NodeIps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.v4, self.v6) {
            (Some(v4), Some(v6)) => write!(f, "{v4},{v6}"),
            (Some(v4), None) => write!(f, "{v4}"),
            (None, Some(v6)) => write!(f, "{v6}"),
            (None, None) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_per_family_in_either_order() {
        let v4 = Ipv4Addr::new(10, 0, 0, 5);
        let v6: Ipv6Addr = "fd00::5".parse().unwrap();
        let both = NodeIps {
            v4: Some(v4),
            v6: Some(v6),
        };
        assert_eq!("10.0.0.5,fd00::5".parse(), Ok(both));
        assert_eq!(
            " fd00::5 , 10.0.0.5 ".parse(),
            Ok(both),
            "IPv6 first, spaces"
        );
        assert_eq!(
            "10.0.0.5".parse(),
            Ok(NodeIps {
                v4: Some(v4),
                v6: None
            })
        );
        assert_eq!(
            "fd00::5,".parse(),
            Ok(NodeIps {
                v4: None,
                v6: Some(v6)
            })
        );
        assert_eq!("".parse(), Ok(NodeIps::default()));
        assert_eq!(both.to_string(), "10.0.0.5,fd00::5");
    }

    #[test]
    fn an_ipv4_mapped_address_is_the_ipv4_one() {
        assert_eq!(
            "::ffff:10.0.0.5".parse(),
            Ok(NodeIps {
                v4: Some(Ipv4Addr::new(10, 0, 0, 5)),
                v6: None
            })
        );
    }

    #[test]
    fn bad_input_names_what_is_wrong() {
        assert_eq!(
            "10.0.0.5,10.0.0.6".parse::<NodeIps>(),
            Err(NodeIpError::SameFamily {
                family: "IPv4",
                first: "10.0.0.5".parse().unwrap(),
                second: "10.0.0.6".parse().unwrap(),
            })
        );
        let err = "fd00::1,10.0.0.5,fd00::2".parse::<NodeIps>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "fd00::1 and fd00::2 are both IPv6: give at most one address per family"
        );
        assert_eq!(
            "10.0.0.5,node-a".parse::<NodeIps>(),
            Err(NodeIpError::NotAnAddress("node-a".into()))
        );
        for not_node in ["0.0.0.0", "::", "127.0.0.1", "::1", "ff02::1"] {
            assert!(
                matches!(
                    not_node.parse::<NodeIps>(),
                    Err(NodeIpError::NotNodeAddress(_))
                ),
                "{not_node} taken as a node address"
            );
        }
    }
}
