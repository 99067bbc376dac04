//! kube-proxy's local traffic detector as configured (`--detect-local-mode`
//! with `--pod-bridge-interface` / `--pod-interface-name-prefix`, or the
//! configuration file's `detectLocalMode` and `detectLocal.*`): how a client
//! is told to be a pod of this cluster (docs/kube-proxy-semantics.md,
//! "Local traffic").

use std::fmt;

/// The mode alone, as `--detect-local-mode` spells it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LocalMode {
    /// The source is inside `--cluster-cidr` (kube-proxy's default).
    #[default]
    ClusterCidr,
    /// The source is inside this Node's `spec.podCIDRs`.
    NodeCidr,
    /// The packet came in through `--pod-bridge-interface`.
    BridgeInterface,
    /// The packet came in through an interface named
    /// `--pod-interface-name-prefix`*.
    InterfaceNamePrefix,
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum DetectLocalError {
    #[error(
        "{0:?} is not a local traffic detection mode (ClusterCIDR, NodeCIDR, BridgeInterface or InterfaceNamePrefix)"
    )]
    UnknownMode(String),
    #[error("detect-local-mode {mode} needs {needs}")]
    Missing {
        mode: LocalMode,
        needs: &'static str,
    },
    #[error("{0:?} is not an interface name prefix (1 to 15 bytes, no '/', ':' or spaces)")]
    BadPrefix(String),
}

impl LocalMode {
    /// kube-proxy's spelling, case and all (it compares exactly); empty is
    /// its default, `ClusterCIDR`.
    pub fn parse(text: &str) -> Result<Self, DetectLocalError> {
        match text {
            "" | "ClusterCIDR" => Ok(Self::ClusterCidr),
            "NodeCIDR" => Ok(Self::NodeCidr),
            "BridgeInterface" => Ok(Self::BridgeInterface),
            "InterfaceNamePrefix" => Ok(Self::InterfaceNamePrefix),
            other => Err(DetectLocalError::UnknownMode(other.to_owned())),
        }
    }
}

impl fmt::Display for LocalMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::ClusterCidr => "ClusterCIDR",
            Self::NodeCidr => "NodeCIDR",
            Self::BridgeInterface => "BridgeInterface",
            Self::InterfaceNamePrefix => "InterfaceNamePrefix",
        })
    }
}

/// The detector with what it needs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DetectLocal {
    #[default]
    ClusterCidr,
    /// Needs the Node's `spec.podCIDRs`, which only the agent reads.
    NodeCidr,
    BridgeInterface(String),
    InterfaceNamePrefix(String),
}

impl DetectLocal {
    /// The detector of `mode`, with the interface it names (kube-proxy's
    /// validation: the field of the chosen mode must be set; the other is
    /// not looked at).
    pub fn new(
        mode: LocalMode,
        bridge: Option<&str>,
        prefix: Option<&str>,
    ) -> Result<Self, DetectLocalError> {
        let set = |v: Option<&str>| {
            v.map(str::trim)
                .filter(|v| !v.is_empty())
                .map(str::to_owned)
        };
        Ok(match mode {
            LocalMode::ClusterCidr => Self::ClusterCidr,
            LocalMode::NodeCidr => Self::NodeCidr,
            LocalMode::BridgeInterface => {
                Self::BridgeInterface(set(bridge).ok_or(DetectLocalError::Missing {
                    mode,
                    needs: "a bridge interface (--pod-bridge-interface, detectLocal.bridgeInterface)",
                })?)
            }
            LocalMode::InterfaceNamePrefix => {
                Self::InterfaceNamePrefix(set(prefix).ok_or(DetectLocalError::Missing {
                    mode,
                    needs: "an interface name prefix (--pod-interface-name-prefix, detectLocal.interfaceNamePrefix)",
                })?)
            }
        })
    }

    /// Of `interfaces` (name to ifindex), those whose packets come from
    /// this node's pods under an interface detector; none under the others.
    pub fn local_interfaces<'a>(
        &self,
        interfaces: impl IntoIterator<Item = (&'a String, &'a u32)>,
    ) -> std::collections::BTreeSet<u32> {
        interfaces
            .into_iter()
            .filter(|(name, _)| match self {
                Self::BridgeInterface(bridge) => *name == bridge,
                Self::InterfaceNamePrefix(prefix) => name.starts_with(prefix.as_str()),
                Self::ClusterCidr | Self::NodeCidr => false,
            })
            .map(|(_, ifindex)| *ifindex)
            .collect()
    }

    pub fn mode(&self) -> LocalMode {
        match self {
            Self::ClusterCidr => LocalMode::ClusterCidr,
            Self::NodeCidr => LocalMode::NodeCidr,
            Self::BridgeInterface(_) => LocalMode::BridgeInterface,
            Self::InterfaceNamePrefix(_) => LocalMode::InterfaceNamePrefix,
        }
    }
}

/// A prefix of interface names: what an interface name may hold, so that a
/// prefix that no interface could have is refused rather than matching
/// nothing silently.
pub fn parse_prefix(text: &str) -> Result<String, DetectLocalError> {
    crate::datapath::interfaces::parse_name(text)
        .map_err(|_| DetectLocalError::BadPrefix(text.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_detectors_pick_their_interfaces_by_name() {
        let interfaces: std::collections::BTreeMap<String, u32> = [
            ("eth0", 2),
            ("cbr0", 3),
            ("cbr01", 4),
            ("veth1a2b", 5),
            ("vethx", 6),
            ("lxc1", 7),
        ]
        .into_iter()
        .map(|(name, ifindex)| (name.to_owned(), ifindex))
        .collect();
        let picked = |detector: DetectLocal| -> Vec<u32> {
            detector.local_interfaces(&interfaces).into_iter().collect()
        };
        assert_eq!(
            picked(DetectLocal::BridgeInterface("cbr0".into())),
            [3],
            "the bridge by its whole name, not a prefix of it"
        );
        assert_eq!(
            picked(DetectLocal::InterfaceNamePrefix("veth".into())),
            [5, 6]
        );
        assert!(picked(DetectLocal::ClusterCidr).is_empty());
        assert!(picked(DetectLocal::NodeCidr).is_empty());
    }

    #[test]
    fn modes_are_kube_proxys_spellings() {
        for mode in [
            LocalMode::ClusterCidr,
            LocalMode::NodeCidr,
            LocalMode::BridgeInterface,
            LocalMode::InterfaceNamePrefix,
        ] {
            assert_eq!(LocalMode::parse(&mode.to_string()), Ok(mode));
        }
        assert_eq!(LocalMode::parse(""), Ok(LocalMode::ClusterCidr));
        for bad in ["clustercidr", "NodeCidr", "Bridge", " ClusterCIDR"] {
            assert!(LocalMode::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_mode_needs_its_own_field_only() {
        assert_eq!(
            DetectLocal::new(LocalMode::BridgeInterface, Some("cbr0"), None),
            Ok(DetectLocal::BridgeInterface("cbr0".into()))
        );
        assert_eq!(
            DetectLocal::new(LocalMode::InterfaceNamePrefix, Some("cbr0"), Some("veth")),
            Ok(DetectLocal::InterfaceNamePrefix("veth".into()))
        );
        assert_eq!(
            DetectLocal::new(LocalMode::NodeCidr, Some("cbr0"), None),
            Ok(DetectLocal::NodeCidr)
        );
        let err = DetectLocal::new(LocalMode::BridgeInterface, Some(" "), Some("veth"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("--pod-bridge-interface"), "{err}");
        let err = DetectLocal::new(LocalMode::InterfaceNamePrefix, None, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--pod-interface-name-prefix"), "{err}");
    }
}
