//! An address's IP family, and an address read as kube-proxy reads one.
//! Services and slices alike are split by family, as kube-proxy runs one
//! proxier per family.

use std::net::{IpAddr, Ipv4Addr};

/// An IP family: each one is proxied on its own, as kube-proxy runs one
/// proxier per family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) enum Family {
    V4,
    V6,
}

impl Family {
    pub(super) fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// The "any address" of the family, which stands for every node address
    /// in NodePort frontends.
    pub(super) fn unspecified(self) -> IpAddr {
        match self {
            Family::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            Family::V6 => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        }
    }

    pub(super) fn address_type(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }
}

/// Parses an IP the way kube-proxy does (`netutils.ParseIPSloppy`): IPv4
/// octets may carry leading zeros, which old API servers accepted and which
/// Go reads as decimal; an IPv4-mapped IPv6 address is the IPv4 address.
pub(super) fn parse_ip(text: &str) -> Option<IpAddr> {
    let ip = if let Ok(ip) = text.parse::<IpAddr>() {
        ip
    } else {
        let octets: Vec<&str> = text.split('.').collect();
        if octets.len() != 4
            || octets
                .iter()
                .any(|o| o.is_empty() || o.len() > 3 || !o.bytes().all(|b| b.is_ascii_digit()))
        {
            return None;
        }
        let mut bytes = [0u8; 4];
        for (byte, octet) in bytes.iter_mut().zip(&octets) {
            *byte = octet.parse().ok()?;
        }
        IpAddr::V4(Ipv4Addr::from(bytes))
    };
    Some(ip.to_canonical())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_ip_accepts_what_kube_proxy_accepts() {
        let cases: [(&str, Option<&str>); 8] = [
            ("10.0.0.1", Some("10.0.0.1")),
            ("010.000.000.001", Some("10.0.0.1")),
            ("fd00::1", Some("fd00::1")),
            ("::ffff:10.1.2.3", Some("10.1.2.3")),
            ("10.0.0.256", None),
            ("10.0.0", None),
            ("", None),
            ("web.example", None),
        ];
        for (input, want) in cases {
            let got = parse_ip(input).map(|ip| ip.to_string());
            assert_eq!(got.as_deref(), want, "parse_ip({input:?})");
        }
    }
}
