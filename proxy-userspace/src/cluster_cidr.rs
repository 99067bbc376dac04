//! The cluster's pod CIDRs as configured (`--cluster-cidr`, the configuration
//! file's `clusterCIDR`): at most one per family, comma-separated for dual stack
//! (`10.244.0.0/16,fd00:10:244::/56`), as kube-proxy's validation allows
//! (docs/kube-proxy-semantics.md, "Dual stack").

use std::{fmt, net::IpAddr, ops::Deref, str::FromStr};

use crate::model::Cidr;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ClusterCidrError {
    #[error("{0:?} is not a CIDR (like 10.244.0.0/16)")]
    NotACidr(String),
    #[error("{first} and {second} are both {family}: give at most one CIDR per family")]
    SameFamily {
        family: &'static str,
        first: Cidr,
        second: Cidr,
    },
}

/// At most one CIDR per family, in the order given.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterCidrs(Vec<Cidr>);

impl ClusterCidrs {
    /// `cidrs`, refusing two of one family.
    pub fn new(cidrs: Vec<Cidr>) -> Result<Self, ClusterCidrError> {
        let family = |c: &Cidr| match c.ip {
            IpAddr::V4(_) => "IPv4",
            IpAddr::V6(_) => "IPv6",
        };
        for (i, second) in cidrs.iter().enumerate() {
            if let Some(first) = cidrs[..i].iter().find(|c| family(c) == family(second)) {
                return Err(ClusterCidrError::SameFamily {
                    family: family(second),
                    first: *first,
                    second: *second,
                });
            }
        }
        Ok(Self(cidrs))
    }
}

impl Deref for ClusterCidrs {
    type Target = [Cidr];

    fn deref(&self) -> &[Cidr] {
        &self.0
    }
}

impl FromStr for ClusterCidrs {
    type Err = ClusterCidrError;

    /// Comma-separated CIDRs, at most one per family; empty entries (a
    /// trailing comma, an empty value) are skipped.
    fn from_str(s: &str) -> Result<Self, ClusterCidrError> {
        let cidrs = s
            .split(',')
            .map(str::trim)
            .filter(|entry| !entry.is_empty())
            .map(|entry| Cidr::parse(entry).ok_or_else(|| ClusterCidrError::NotACidr(entry.into())))
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(cidrs)
    }
}

impl fmt::Display for ClusterCidrs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, cidr) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{cidr}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidr(text: &str) -> Cidr {
        Cidr::parse(text).unwrap()
    }

    #[test]
    fn one_cidr_per_family_in_either_order() {
        let both: ClusterCidrs = "10.244.0.0/16,fd00:10:244::/56".parse().unwrap();
        assert_eq!(*both, [cidr("10.244.0.0/16"), cidr("fd00:10:244::/56")]);
        assert_eq!(both.to_string(), "10.244.0.0/16,fd00:10:244::/56");
        let v6_first: ClusterCidrs = " fd00:10:244::/56 , 10.244.0.0/16 ".parse().unwrap();
        assert_eq!(*v6_first, [cidr("fd00:10:244::/56"), cidr("10.244.0.0/16")]);
        assert_eq!(
            *"10.244.0.0/16,".parse::<ClusterCidrs>().unwrap(),
            [cidr("10.244.0.0/16")]
        );
        assert!("".parse::<ClusterCidrs>().unwrap().is_empty());
    }

    #[test]
    fn two_of_one_family_or_a_non_cidr_is_refused_with_what_is_wrong() {
        assert_eq!(
            "10.244.0.0/16,10.245.0.0/16".parse::<ClusterCidrs>(),
            Err(ClusterCidrError::SameFamily {
                family: "IPv4",
                first: cidr("10.244.0.0/16"),
                second: cidr("10.245.0.0/16"),
            })
        );
        let err = "fd00:1::/64,10.0.0.0/8,fd00:2::/64"
            .parse::<ClusterCidrs>()
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "fd00:1::/64 and fd00:2::/64 are both IPv6: give at most one CIDR per family"
        );
        assert_eq!(
            "10.0.0.0/8,10.0.0.1".parse::<ClusterCidrs>(),
            Err(ClusterCidrError::NotACidr("10.0.0.1".into()))
        );
    }
}
