//! Which interfaces of this network namespace to attach to, and the node's
//! addresses, followed through rtnetlink (netns-aware; /sys/class/net shows
//! the namespace that mounted sysfs, not ours).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Duration,
};

use futures::{StreamExt, TryStreamExt};
use rtnetlink::{
    constants::{RTMGRP_IPV4_IFADDR, RTMGRP_IPV6_IFADDR, RTMGRP_LINK},
    new_connection,
    packet_route::{
        address::{AddressAttribute, AddressScope},
        link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo},
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
    /// Selected interfaces holding a global address: the uplinks,
    /// where north-south traffic arrives and XDP goes.
    pub uplinks: BTreeSet<String>,
    /// The selected interfaces that are veths. Their frames may carry
    /// partial checksums (to be finished on transmit, which a veth never
    /// does), which native XDP cannot see or finish.
    pub veths: BTreeSet<String>,
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
    let (interfaces, veths) = dump(handle, selection).await?;
    let mut by_index: BTreeMap<u32, Vec<IpAddr>> = BTreeMap::new();
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
        }
    }
    let uplinks = interfaces
        .iter()
        .filter(|(_, index)| by_index.contains_key(index))
        .map(|(name, _)| name.clone())
        .collect();
    Ok(Snapshot {
        interfaces,
        uplinks,
        veths,
        addrs: by_index.into_values().flatten().collect(),
    })
}

/// The selected interfaces, and which of them are veths.
async fn dump(
    handle: &rtnetlink::Handle,
    selection: &Selection,
) -> Result<(Interfaces, BTreeSet<String>), InterfacesError> {
    let mut out = Interfaces::new();
    let mut veths = BTreeSet::new();
    let mut links = handle.link().get().execute();
    while let Some(msg) = links.try_next().await? {
        let name = msg.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n.clone()),
            _ => None,
        });
        let veth = msg.attributes.iter().any(|a| match a {
            LinkAttribute::LinkInfo(infos) => infos
                .iter()
                .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth))),
            _ => false,
        });
        if let Some(name) = name
            && selection.wants(&name, msg.header.flags)
        {
            if veth {
                veths.insert(name.clone());
            }
            out.insert(name, msg.header.index);
        }
    }
    Ok((out, veths))
}

/// Sends a snapshot now and after every link or address change (and every
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
            RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR,
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
