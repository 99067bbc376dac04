//! Which interfaces of this network namespace to attach to, and the node's
//! addresses, followed through rtnetlink (netns-aware; /sys/class/net shows
//! the namespace that mounted sysfs, not ours).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Duration,
};

use futures::{FutureExt, StreamExt, TryStreamExt};
use rtnetlink::{
    RouteMessageBuilder,
    constants::{
        RTMGRP_IPV4_IFADDR, RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_IFADDR, RTMGRP_IPV6_ROUTE, RTMGRP_LINK,
        RTMGRP_TC,
    },
    new_connection,
    packet_route::{
        address::{AddressAttribute, AddressScope},
        link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkXdp, XdpAttached},
        route::{RouteAddress, RouteAttribute, RouteHeader, RouteType},
        tc::TcAttribute,
    },
    sys::{AsyncSocket, SocketAddr},
};
use tokio::sync::mpsc;

/// Interface name -> ifindex.
pub type Interfaces = BTreeMap<String, u32>;

/// What the agent attaches to and serves NodePorts on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// The selected interfaces: tc on each.
    pub interfaces: Interfaces,
    /// The selected interfaces that are the node's way out ([`is_uplink`]):
    /// where north-south traffic arrives and XDP goes by default.
    pub uplinks: BTreeSet<String>,
    /// The selected interfaces that are veths. Their frames may carry
    /// partial checksums (to be finished on transmit, which a veth never
    /// does), which native XDP cannot see or finish.
    pub veths: BTreeSet<String>,
    /// The selected interfaces that are pods' host-side veths ([`is_pod`]):
    /// where `--host-routing bpf` sends translated packets into the pod.
    pub pods: BTreeSet<String>,
    /// Those of `pods` that carry a qdisc ([`qdisc_ifindexes`]), which
    /// `--host-routing bpf` leaves to the stack's path both ways.
    pub shaped: BTreeSet<String>,
    /// The mode an XDP program runs in on each selected interface that has
    /// one, as the kernel reports it (`native`, `generic`, `offload`,
    /// `multiple`): ours or another's.
    pub xdp: BTreeMap<String, &'static str>,
    /// Every global address of this namespace, of both families, in
    /// ifindex order of the interface holding it (the first of each family
    /// is the node's address of that family unless one is configured).
    pub addrs: Vec<IpAddr>,
}

#[derive(Debug, thiserror::Error)]
pub enum InterfacesError {
    #[error("opening an rtnetlink socket: {0}")]
    Socket(#[source] std::io::Error),
    #[error("subscribing to link events: {0}")]
    Subscribe(#[source] std::io::Error),
    #[error("listing links: {0}")]
    List(#[from] rtnetlink::Error),
}

/// Which interfaces the agent takes: all but loopback, or the named ones.
#[derive(Clone, Debug, Default)]
pub struct Selection {
    pub only: Option<Vec<String>>,
}

impl Selection {
    fn wants(&self, name: &str, flags: LinkFlags) -> bool {
        match &self.only {
            Some(names) => names.iter().any(|n| n == name),
            None => !flags.contains(LinkFlags::Loopback),
        }
    }
}

/// Lists the selected interfaces and the addresses now.
pub async fn list(selection: &Selection) -> Result<Snapshot, InterfacesError> {
    let (connection, handle, _) = new_connection().map_err(InterfacesError::Socket)?;
    let task = tokio::spawn(connection);
    let result = snapshot(&handle, selection).await;
    task.abort();
    result
}

async fn snapshot(
    handle: &rtnetlink::Handle,
    selection: &Selection,
) -> Result<Snapshot, InterfacesError> {
    let links = dump(handle).await?;
    let mut by_index: BTreeMap<u32, Vec<IpAddr>> = BTreeMap::new();
    let mut prefixes: Vec<(u32, IpAddr, u8)> = Vec::new();
    let mut addrs = handle.address().get().execute();
    while let Some(msg) = addrs.try_next().await? {
        // Host-scope (127/8, ::1) and link-local (169.254/16, fe80::/10)
        // addresses are not where NodePorts are served, as in kube-proxy.
        if msg.header.scope != AddressScope::Universe {
            continue;
        }
        let local = msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Local(ip) => Some(*ip),
            _ => None,
        });
        let address = msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        });
        if let Some(ip) = local.or(address) {
            by_index.entry(msg.header.index).or_default().push(ip);
            prefixes.push((msg.header.index, ip, msg.header.prefix_len));
        }
    }
    let routes = routes_out(handle, &prefixes).await?;
    let qdiscs = qdisc_ifindexes(handle).await?;
    let by_ifindex: BTreeMap<u32, &Link> = links.iter().map(|l| (l.index, l)).collect();
    let mut snapshot = Snapshot::default();
    for link in links.iter().filter(|l| selection.wants(&l.name, l.flags)) {
        snapshot.interfaces.insert(link.name.clone(), link.index);
        if link.kind == Some(InfoKind::Veth) {
            snapshot.veths.insert(link.name.clone());
        }
        if let Some(mode) = link.xdp {
            snapshot.xdp.insert(link.name.clone(), mode);
        }
        let master_kind = link
            .master
            .map(|m| by_ifindex.get(&m).and_then(|l| l.kind.clone()));
        let uplink = is_uplink(
            link.kind.as_ref(),
            master_kind.as_ref().map(Option::as_ref),
            by_index.contains_key(&link.index),
            routes.contains(&link.index),
        );
        if uplink {
            snapshot.uplinks.insert(link.name.clone());
        }
        if is_pod(link.kind.as_ref(), link.peer_elsewhere, link.master, uplink) {
            snapshot.pods.insert(link.name.clone());
            if qdiscs.contains(&link.index) {
                snapshot.shaped.insert(link.name.clone());
            }
        }
    }
    snapshot.addrs = by_index.into_values().flatten().collect();
    Ok(snapshot)
}

/// The ifindexes with a qdisc of their own: any but the `noqueue` a veth
/// starts with, such as the CNI `bandwidth` plugin's `tbf` (the pod's
/// ingress limit) and `ingress` (its egress limit, a legacy tc filter
/// redirecting through an `ifb`), or an operator's. A packet the datapath
/// redirects past such an interface would skip them.
async fn qdisc_ifindexes(handle: &rtnetlink::Handle) -> Result<BTreeSet<u32>, InterfacesError> {
    let mut found = BTreeSet::new();
    let mut qdiscs = handle.qdisc().get().execute();
    while let Some(msg) = qdiscs.try_next().await? {
        let own = msg
            .attributes
            .iter()
            .any(|a| matches!(a, TcAttribute::Kind(kind) if kind != "noqueue"));
        if own && let Ok(index) = u32::try_from(msg.header.index) {
            found.insert(index);
        }
    }
    Ok(found)
}

/// Whether an interface is one of the node's uplinks, where XDP pays:
/// it holds a global address, carries a route out of the node ([`routes_out`]),
/// is not enslaved to a bridge or a bond (a VRF's member is fine), and is of a kind that
/// can be the node's own link: a device without a kind (a NIC), or a veth
/// (a node in a container, kind-style), VLAN, bond, team, macvlan or
/// ipvlan. Never a bridge (flannel's `cni0`), a tunnel (vxlan, geneve,
/// IPIP, wireguard), a dummy, tun or netkit: pod traffic goes through
/// those, and they have no native XDP that pays. A pod's host-side veth
/// has no route out (only host routes to its pod), so it is none either.
pub fn is_uplink(
    kind: Option<&InfoKind>,
    master: Option<Option<&InfoKind>>,
    global_address: bool,
    route_out: bool,
) -> bool {
    let own_kind = matches!(
        kind,
        None | Some(
            InfoKind::Veth
                | InfoKind::Vlan
                | InfoKind::Bond
                | InfoKind::Team
                | InfoKind::MacVlan
                | InfoKind::IpVlan
        )
    );
    let free = match master {
        None => true,
        Some(master) => master == Some(&InfoKind::Vrf),
    };
    own_kind && free && global_address && route_out
}

/// The ifindexes that carry a route out of the node in the main table: a
/// default route (either family), a route through a gateway, or the prefix
/// route of one of the interface's own global addresses (its network, of
/// more than one address). Host routes without a gateway (`10.1.1.10 dev
/// veth`, a routed pod's) are not.
async fn routes_out(
    handle: &rtnetlink::Handle,
    prefixes: &[(u32, IpAddr, u8)],
) -> Result<BTreeSet<u32>, InterfacesError> {
    let mut out = BTreeSet::new();
    for request in [
        RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
        RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
    ] {
        let mut routes = handle.route().get(request).execute();
        while let Some(msg) = routes.try_next().await? {
            let table = msg
                .attributes
                .iter()
                .find_map(|a| match a {
                    RouteAttribute::Table(t) => Some(*t),
                    _ => None,
                })
                .unwrap_or(u32::from(msg.header.table));
            if table != u32::from(RouteHeader::RT_TABLE_MAIN)
                || msg.header.kind != RouteType::Unicast
            {
                continue;
            }
            let len = msg.header.destination_prefix_length;
            let dst = msg.attributes.iter().find_map(|a| match a {
                RouteAttribute::Destination(RouteAddress::Inet(ip)) => Some(IpAddr::V4(*ip)),
                RouteAttribute::Destination(RouteAddress::Inet6(ip)) => Some(IpAddr::V6(*ip)),
                _ => None,
            });
            let mut hops: Vec<(u32, bool)> = Vec::new();
            let oif = msg.attributes.iter().find_map(|a| match a {
                RouteAttribute::Oif(i) => Some(*i),
                _ => None,
            });
            if let Some(oif) = oif {
                hops.push((oif, has_gateway(&msg.attributes)));
            }
            for a in &msg.attributes {
                if let RouteAttribute::MultiPath(next) = a {
                    hops.extend(
                        next.iter()
                            .map(|h| (h.interface_index, has_gateway(&h.attributes))),
                    );
                }
            }
            for (index, gateway) in hops {
                let own_network = dst.is_some_and(|dst| {
                    prefixes
                        .iter()
                        .any(|(i, ip, plen)| *i == index && *plen == len && covers(dst, len, *ip))
                });
                if len == 0 || gateway || own_network {
                    out.insert(index);
                }
            }
        }
    }
    Ok(out)
}

fn has_gateway(attributes: &[RouteAttribute]) -> bool {
    attributes
        .iter()
        .any(|a| matches!(a, RouteAttribute::Gateway(_) | RouteAttribute::Via(_)))
}

/// Whether `net/len` holds `ip` and is wider than one address.
fn covers(net: IpAddr, len: u8, ip: IpAddr) -> bool {
    match (net, ip) {
        (IpAddr::V4(net), IpAddr::V4(ip)) if len < 32 => {
            let mask = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            u32::from(net) & mask == u32::from(ip) & mask
        }
        (IpAddr::V6(net), IpAddr::V6(ip)) if len < 128 => {
            let mask = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            u128::from(net) & mask == u128::from(ip) & mask
        }
        _ => false,
    }
}

/// Whether an interface is a pod's host-side veth, whose peer is the pod's
/// own interface: a veth whose peer is in another namespace, enslaved to
/// nothing (a bridge's port is not where the FIB sends a packet) and not
/// one of the node's uplinks (a kind-style node's way out, past which the
/// node's `POSTROUTING` may masquerade what leaves).
pub fn is_pod(
    kind: Option<&InfoKind>,
    peer_elsewhere: bool,
    master: Option<u32>,
    uplink: bool,
) -> bool {
    kind == Some(&InfoKind::Veth) && peer_elsewhere && master.is_none() && !uplink
}

/// What the link dump says of one interface.
struct Link {
    name: String,
    index: u32,
    flags: LinkFlags,
    kind: Option<InfoKind>,
    /// The ifindex of the bridge, bond or VRF it is enslaved to.
    master: Option<u32>,
    /// Its peer (a veth's) is in another network namespace.
    peer_elsewhere: bool,
    /// The mode of the XDP program attached to it, if any.
    xdp: Option<&'static str>,
}

/// Every interface of this namespace.
async fn dump(handle: &rtnetlink::Handle) -> Result<Vec<Link>, InterfacesError> {
    let mut out = Vec::new();
    let mut links = handle.link().get().execute();
    while let Some(msg) = links.try_next().await? {
        let mut link = Link {
            name: String::new(),
            index: msg.header.index,
            flags: msg.header.flags,
            kind: None,
            master: None,
            peer_elsewhere: false,
            xdp: None,
        };
        for a in &msg.attributes {
            match a {
                LinkAttribute::IfName(n) => link.name.clone_from(n),
                LinkAttribute::Controller(m) if *m != 0 => link.master = Some(*m),
                LinkAttribute::LinkNetNsId(_) => link.peer_elsewhere = true,
                LinkAttribute::LinkInfo(infos) => {
                    link.kind = infos.iter().find_map(|i| match i {
                        LinkInfo::Kind(k) => Some(k.clone()),
                        _ => None,
                    });
                }
                LinkAttribute::Xdp(xdp) => {
                    link.xdp = xdp.iter().find_map(|x| match x {
                        LinkXdp::Attached(XdpAttached::Driver) => Some("native"),
                        LinkXdp::Attached(XdpAttached::SocketBuffer) => Some("generic"),
                        LinkXdp::Attached(XdpAttached::Hardware) => Some("offload"),
                        LinkXdp::Attached(XdpAttached::Multiple) => Some("multiple"),
                        _ => None,
                    });
                }
                _ => {}
            }
        }
        if !link.name.is_empty() {
            out.push(link);
        }
    }
    Ok(out)
}

/// Sends a snapshot now and after every link, address, route or qdisc change (and every
/// `resync` as a safety net against lost netlink messages).
pub async fn watch(
    selection: Selection,
    resync: Duration,
    tx: mpsc::Sender<Snapshot>,
) -> Result<(), InterfacesError> {
    let (mut connection, handle, mut messages) =
        new_connection().map_err(InterfacesError::Socket)?;
    connection
        .socket_mut()
        .socket_mut()
        .bind(&SocketAddr::new(
            0,
            RTMGRP_LINK
                | RTMGRP_IPV4_IFADDR
                | RTMGRP_IPV6_IFADDR
                | RTMGRP_IPV4_ROUTE
                | RTMGRP_IPV6_ROUTE
                | RTMGRP_TC,
        ))
        .map_err(InterfacesError::Subscribe)?;
    let task = tokio::spawn(connection);
    let mut last: Option<Snapshot> = None;
    let mut ticker = tokio::time::interval(resync);
    loop {
        let current = snapshot(&handle, &selection).await?;
        if last.as_ref() != Some(&current) {
            if tx.send(current.clone()).await.is_err() {
                break;
            }
            last = Some(current);
        }
        tokio::select! {
            msg = messages.next() => if msg.is_none() { break },
            _ = ticker.tick() => {}
        }
        // A burst of changes (a pod's veth, its addresses and routes) makes
        // one snapshot.
        while let Some(msg) = messages.next().now_or_never() {
            if msg.is_none() {
                break;
            }
        }
    }
    task.abort();
    Ok(())
}

/// A name the kernel could give an interface (its `dev_valid_name`): one
/// that could never match would leave the datapath attached nowhere, silently.
pub fn parse_name(s: &str) -> Result<String, String> {
    let valid = !s.is_empty()
        && s.len() < IFNAMSIZ
        && s != "."
        && s != ".."
        && !s.chars().any(|c| c == '/' || c == ':' || c.is_whitespace());
    if valid {
        Ok(s.to_owned())
    } else {
        Err(format!(
            "{s:?} is not an interface name (1 to {} bytes, no '/', ':' or spaces)",
            IFNAMSIZ - 1
        ))
    }
}

const IFNAMSIZ: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_are_unenslaved_veths_whose_peer_is_in_another_namespace() {
        assert!(is_pod(Some(&InfoKind::Veth), true, None, false));
        // Both ends here: the kernel would drop a packet sent to its peer.
        assert!(!is_pod(Some(&InfoKind::Veth), false, None, false));
        // A bridge's port: the FIB sends to the bridge.
        assert!(!is_pod(Some(&InfoKind::Veth), true, Some(3), false));
        // A kind-style node's own way out.
        assert!(!is_pod(Some(&InfoKind::Veth), true, None, true));
        for kind in [None, Some(InfoKind::Bridge), Some(InfoKind::Vxlan)] {
            assert!(!is_pod(kind.as_ref(), true, None, false), "{kind:?}");
        }
    }

    #[test]
    fn uplinks_are_the_nodes_own_links_with_an_address_and_a_way_out() {
        // A NIC, a veth (kind-style node), a VLAN with an address and a route out.
        assert!(is_uplink(None, None, true, true));
        assert!(is_uplink(Some(&InfoKind::Veth), None, true, true));
        assert!(is_uplink(Some(&InfoKind::Vlan), None, true, true));
        assert!(is_uplink(None, Some(Some(&InfoKind::Vrf)), true, true));
        // A pod's host-side veth with an address but only host routes.
        assert!(!is_uplink(Some(&InfoKind::Veth), None, true, false));
        // No address.
        assert!(!is_uplink(None, None, false, true));
        // A bridge (cni0), a tunnel (flannel.1), a dummy (kube-ipvs0).
        for kind in [InfoKind::Bridge, InfoKind::Vxlan, InfoKind::Dummy] {
            assert!(!is_uplink(Some(&kind), None, true, true), "{kind:?}");
        }
        // A bridge's or a bond's port.
        assert!(!is_uplink(None, Some(Some(&InfoKind::Bridge)), true, true));
        assert!(!is_uplink(None, Some(Some(&InfoKind::Bond)), true, true));
    }

    #[test]
    fn an_own_network_is_wider_than_one_address() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(covers(ip("192.168.77.0"), 24, ip("192.168.77.2")));
        assert!(!covers(ip("192.168.78.0"), 24, ip("192.168.77.2")));
        assert!(
            !covers(ip("10.42.1.1"), 32, ip("10.42.1.1")),
            "a host route"
        );
        assert!(covers(ip("fd00:50::"), 64, ip("fd00:50::1")));
        assert!(!covers(ip("fd00:50::1"), 128, ip("fd00:50::1")));
        assert!(!covers(ip("fd00:50::"), 64, ip("192.168.77.2")));
        assert!(covers(ip("0.0.0.0"), 0, ip("192.168.77.2")));
    }
}
