//! Segmentation and receive offloads of a namespace's interfaces: turned on and
//! read back with `ethtool`, so that a test moves TSO/GSO super-packets and
//! GRO-merged ones through the datapath as hosts with offloading NICs do.

use anyhow::{Context, Result, bail};

use crate::{cluster::ethtool, netns::NetNs, run_cmd};

/// The features [`enable`] turns on, as `ethtool -K` names them, and how
/// `ethtool -k` shows each.
pub const FEATURES: [(&str, &str); 4] = [
    ("tx", "tx-checksumming"),
    ("tso", "tcp-segmentation-offload"),
    ("gso", "generic-segmentation-offload"),
    ("gro", "generic-receive-offload"),
];

/// Every veth of `ns`.
pub fn veths(ns: &NetNs) -> Result<Vec<String>> {
    let out = ns.ip(&["-o", "link", "show", "type", "veth"])?;
    Ok(out
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|name| name.split('@').next().unwrap_or(name).to_owned())
        .collect())
}

/// Turns checksum offload on transmit, TSO, GSO and GRO on for every veth of `ns`,
/// and checks with `ethtool -k` that they are on.
pub fn enable(ns: &NetNs) -> Result<()> {
    for ifname in veths(ns)? {
        let mut cmd = ns.command(ethtool());
        cmd.args(["-K", &ifname]);
        for (feature, _) in FEATURES {
            cmd.args([feature, "on"]);
        }
        run_cmd(&mut cmd).with_context(|| format!("offloads on {ifname} in {}", ns.name()))?;
        let off = off(ns, &ifname)?;
        if !off.is_empty() {
            bail!(
                "{ifname} in {}: still off after ethtool -K: {off:?}",
                ns.name()
            );
        }
    }
    Ok(())
}

/// Those of [`FEATURES`] that `ethtool -k` shows off on `ifname` in `ns`.
pub fn off(ns: &NetNs, ifname: &str) -> Result<Vec<&'static str>> {
    let shown = run_cmd(ns.command(ethtool()).args(["-k", ifname]))
        .with_context(|| format!("ethtool -k {ifname} in {}", ns.name()))?;
    Ok(FEATURES
        .iter()
        .filter(|(_, name)| {
            !shown
                .lines()
                .any(|l| l.trim_start().starts_with(&format!("{name}: on")))
        })
        .map(|(feature, _)| *feature)
        .collect())
}
