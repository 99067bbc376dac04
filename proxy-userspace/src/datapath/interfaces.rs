//! Which interfaces of this network namespace to attach to, followed through
//! rtnetlink (netns-aware; /sys/class/net shows the namespace that mounted
//! sysfs, not ours).

use std::{collections::BTreeMap, time::Duration};

use futures::{StreamExt, TryStreamExt};
use rtnetlink::{
    constants::RTMGRP_LINK,
    new_connection,
    packet_route::link::{LinkAttribute, LinkFlags},
    sys::{AsyncSocket, SocketAddr},
};
use tokio::sync::mpsc;

/// Interface name -> ifindex.
pub type Interfaces = BTreeMap<String, u32>;

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

/// Lists the selected interfaces now.
pub async fn list(selection: &Selection) -> Result<Interfaces, InterfacesError> {
    let (connection, handle, _) = new_connection().map_err(InterfacesError::Socket)?;
    let task = tokio::spawn(connection);
    let result = dump(&handle, selection).await;
    task.abort();
    result
}

async fn dump(
    handle: &rtnetlink::Handle,
    selection: &Selection,
) -> Result<Interfaces, InterfacesError> {
    let mut out = Interfaces::new();
    let mut links = handle.link().get().execute();
    while let Some(msg) = links.try_next().await? {
        let name = msg.attributes.iter().find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n.clone()),
            _ => None,
        });
        if let Some(name) = name
            && selection.wants(&name, msg.header.flags)
        {
            out.insert(name, msg.header.index);
        }
    }
    Ok(out)
}

/// Sends the selected interfaces now and after every link change (and every
/// `resync` as a safety net against lost netlink messages).
pub async fn watch(
    selection: Selection,
    resync: Duration,
    tx: mpsc::Sender<Interfaces>,
) -> Result<(), InterfacesError> {
    let (mut connection, handle, mut messages) =
        new_connection().map_err(InterfacesError::Socket)?;
    connection
        .socket_mut()
        .socket_mut()
        .bind(&SocketAddr::new(0, RTMGRP_LINK))
        .map_err(InterfacesError::Subscribe)?;
    let task = tokio::spawn(connection);
    let mut last: Option<Interfaces> = None;
    let mut ticker = tokio::time::interval(resync);
    loop {
        let current = dump(&handle, &selection).await?;
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
