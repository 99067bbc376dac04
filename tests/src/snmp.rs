//! A namespace's IP, ICMP and TCP statistics (`/proc/net/snmp`, `/proc/net/snmp6`)
//! by the names `nstat` gives them (`IcmpInDestUnreachs`, `Icmp6InPktTooBigs`,
//! `TcpRetransSegs`), for failure messages that say where packets went.

use std::collections::BTreeMap;

use anyhow::{Context, Result};

use crate::netns::NetNs;

/// Every counter of `ns`'s `/proc/net/snmp` and `/proc/net/snmp6`.
pub fn read(ns: &NetNs) -> Result<BTreeMap<String, u64>> {
    // /proc/thread-self/net is the reading thread's namespace.
    let (snmp, snmp6) = ns.run(|| {
        (
            std::fs::read_to_string("/proc/thread-self/net/snmp"),
            std::fs::read_to_string("/proc/thread-self/net/snmp6"),
        )
    })?;
    let snmp = snmp.with_context(|| format!("/proc/net/snmp of {}", ns.name()))?;
    let snmp6 = snmp6.with_context(|| format!("/proc/net/snmp6 of {}", ns.name()))?;
    let mut out = BTreeMap::new();
    // Pairs of lines: `Icmp: InMsgs InErrors ...` and `Icmp: 3 0 ...`.
    let lines: Vec<&str> = snmp.lines().collect();
    for pair in lines.chunks(2) {
        let [names, values] = pair else { continue };
        let (Some((group, names)), Some((_, values))) =
            (names.split_once(": "), values.split_once(": "))
        else {
            continue;
        };
        for (name, value) in names.split_whitespace().zip(values.split_whitespace()) {
            if let Ok(v) = value.parse() {
                out.insert(format!("{group}{name}"), v);
            }
        }
    }
    for line in snmp6.lines() {
        let mut words = line.split_whitespace();
        if let (Some(name), Some(Ok(v))) = (words.next(), words.next().map(str::parse)) {
            out.insert(name.to_owned(), v);
        }
    }
    Ok(out)
}

/// Those of `names` that are not zero in `ns`, as `name=value` (or why they
/// could not be read), for a failure message.
pub fn nonzero(ns: &NetNs, names: &[&str]) -> String {
    match read(ns) {
        Ok(all) => names
            .iter()
            .filter_map(|n| all.get(*n).filter(|v| **v > 0).map(|v| format!("{n}={v}")))
            .collect::<Vec<_>>()
            .join(" "),
        Err(e) => format!("({e:#})"),
    }
}
