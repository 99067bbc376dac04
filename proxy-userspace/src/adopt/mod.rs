//! Taking a node over from kube-proxy, and handing it back, without
//! breaking a connection (docs/operations.md, "Taking over from
//! kube-proxy").
//!
//! kube-proxy's flows live in netfilter's conntrack, each with its NAT, and
//! netfilter keeps translating them from those entries alone, without any
//! rule, as long as a nat chain keeps NAT and conntrack running in the
//! namespace (`rules::keep_nat_alive`). So the agent leaves them there: while
//! they may live, tc asks netfilter's conntrack about every packet to a
//! frontend that has no flow in the datapath and starts none, and leaves
//! netfilter's to it (`proxy_common::netfilter_ct`). Once this agent serves,
//! kube-proxy's rules go (`rules::remove`), as their filter rules drop the
//! replies this datapath translates; when the last of the flows they made
//! has ended, the keep-alive goes too. Handing back (`handoff`) writes the
//! datapath's flows into netfilter's conntrack with their NAT, so that
//! kube-proxy started next keeps them on their backends.

pub mod conntrack;
pub mod handoff;
pub mod rules;

use std::collections::BTreeSet;

use tracing::{info, warn};

/// A flow's original direction, as netfilter's conntrack keys it.
type FlowKey = (u8, std::net::IpAddr, std::net::IpAddr, u16, u16);

/// What the agent knows of kube-proxy on this node.
#[derive(Debug, Default)]
pub struct Adoption {
    /// kube-proxy's rules, found at start and not removed yet.
    leftovers: Option<rules::Leftovers>,
    keep_rules: bool,
    /// Whether flows netfilter translated may live: tc asks netfilter.
    active: bool,
    /// The flows netfilter translated when this agent took over, until
    /// each has ended. None until then.
    adopted: Option<BTreeSet<FlowKey>>,
}

impl Adoption {
    /// Looks for kube-proxy at start: its rules, or the datapath's own note
    /// that its flows may live (`pinned_flag`, from an agent that took over
    /// before this one). Where either is found, NAT is kept running for
    /// kube-proxy's flows and tc is to leave them to netfilter.
    pub fn start(pinned_flag: bool, keep_rules: bool) -> Self {
        let leftovers = match rules::find() {
            Ok(found) if found.is_empty() => None,
            Ok(found) => Some(found),
            Err(e) => {
                warn!(error = %e, "looking for kube-proxy's rules; taken as none");
                None
            }
        };
        let active = pinned_flag || leftovers.is_some();
        if let Some(found) = &leftovers {
            info!(
                found = %found,
                "kube-proxy ran on this node: its flows are left to netfilter until they end"
            );
        } else if pinned_flag {
            info!("flows kube-proxy translated may still live: they are left to netfilter");
        }
        if active {
            if let Err(e) = rules::keep_nat_alive() {
                warn!(
                    error = %e,
                    "netfilter's NAT is not kept running: kube-proxy's flows break once its rules go"
                );
            }
        }
        Self {
            leftovers,
            keep_rules,
            active,
            adopted: None,
        }
    }

    /// Whether tc is to leave flows netfilter translates to it.
    pub fn active(&self) -> bool {
        self.active
    }

    /// Once this agent serves (attached, first sync in the maps): kube-proxy's
    /// rules go, and the flows netfilter translates are noted, to know when
    /// the last has ended.
    pub fn on_serving(&mut self) {
        if let Some(found) = self.leftovers.take() {
            if self.keep_rules {
                warn!(
                    found = %found,
                    "kube-proxy's rules kept (--keep-kube-proxy-rules): their filter rules drop \
                     replies this datapath translates until they are removed (`kube-proxy --cleanup`)"
                );
            } else {
                match rules::remove(&found) {
                    Ok(removed) => info!(removed = %removed, "removed kube-proxy's rules"),
                    Err(e) => warn!(
                        error = %e,
                        "removing kube-proxy's rules failed; retried at the next start, or remove \
                         them with `kube-proxy --cleanup`"
                    ),
                }
            }
        }
        if self.active {
            match netfilter_flows() {
                Ok(flows) => {
                    info!(
                        flows = flows.len(),
                        "flows netfilter translates, left to it until they end"
                    );
                    self.adopted = Some(flows);
                }
                Err(e) => warn!(error = %e, "reading netfilter's conntrack; read again later"),
            }
        }
    }

    /// Looks again at the flows netfilter translated when this agent took
    /// over; true when the last has ended, NAT's keep-alive is gone and tc
    /// is to stop asking (the caller clears the flag).
    pub fn check(&mut self) -> bool {
        if !self.active {
            return false;
        }
        let now = match netfilter_flows() {
            Ok(now) => now,
            Err(e) => {
                warn!(error = %e, "reading netfilter's conntrack; read again later");
                return false;
            }
        };
        let adopted = self.adopted.get_or_insert_with(|| now.clone());
        adopted.retain(|flow| now.contains(flow));
        if !adopted.is_empty() {
            return false;
        }
        match rules::release_nat() {
            Ok(_) => {
                info!(
                    "the last flow kube-proxy translated has ended: netfilter is no longer asked"
                );
                self.active = false;
                true
            }
            Err(e) => {
                warn!(error = %e, "removing NAT's keep-alive; tried again later");
                false
            }
        }
    }
}

/// The original directions of the flows netfilter's conntrack translates
/// (DNAT), both families.
fn netfilter_flows() -> Result<BTreeSet<FlowKey>, conntrack::ConntrackError> {
    let mut flows = BTreeSet::new();
    for family in [conntrack::Family::V4, conntrack::Family::V6] {
        for entry in conntrack::dump(family)? {
            if entry.is_dnat() {
                let t = &entry.orig;
                flows.insert((t.proto, t.src, t.dst, t.sport, t.dport));
            }
        }
    }
    Ok(flows)
}
