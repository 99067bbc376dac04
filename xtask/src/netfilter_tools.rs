//! The netfilter tools the agent runs and the amd64 image carries, in one
//! list for both the image (`image`) and what `cargo xtask setup` installs
//! (`setup`), which knows nothing of images.

/// A tool the agent runs (proxy-userspace's `adopt::rules`, which looks for each
/// on PATH, then in /usr/sbin and /sbin, and skips that backend without it).
#[derive(Debug)]
pub struct Tool {
    /// Where it is here and in the image: Debian's path, symbolic links
    /// followed here, so the image holds the file itself.
    pub path: &'static str,
    /// The names in the same directory that are links to it, here and in the
    /// image: the commands of a multi-call binary.
    pub links: &'static [&'static str],
    /// The Debian package that brings it (`cargo xtask setup` installs it).
    pub deb: &'static str,
}

/// The tools the amd64 image carries: `nft` for kube-proxy's nftables tables and
/// the agent's NAT keep-alive table, both iptables backends for kube-proxy's
/// iptables and IPVS-mode rules, and `ip` for the IPVS dummy link. Not
/// `ipvsadm` and `ipset` (IPVS mode's virtual servers and sets): Debian's
/// packages are not in `cargo xtask setup`, and without them the takeover says
/// what it left.
pub const TOOLS: &[Tool] = &[
    Tool {
        path: "/usr/sbin/nft",
        links: &[],
        deb: "nftables",
    },
    Tool {
        path: "/usr/sbin/xtables-legacy-multi",
        links: &[
            "iptables-legacy",
            "iptables-legacy-save",
            "iptables-legacy-restore",
            "ip6tables-legacy",
            "ip6tables-legacy-save",
            "ip6tables-legacy-restore",
        ],
        deb: "iptables",
    },
    Tool {
        path: "/usr/sbin/xtables-nft-multi",
        links: &[
            "iptables-nft",
            "iptables-nft-save",
            "iptables-nft-restore",
            "ip6tables-nft",
            "ip6tables-nft-save",
            "ip6tables-nft-restore",
        ],
        deb: "iptables",
    },
    Tool {
        path: "/usr/sbin/ip",
        links: &[],
        deb: "iproute2",
    },
];
