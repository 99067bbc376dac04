//! The flags of `ebpf-proxy run` settled into what the agent takes, once
//! the configuration file is merged into them: kube-proxy's flags
//! (`kube_proxy_flags`) that set ours, the node-port addresses, the local
//! traffic detector, the conntrack size. Above both the command line and
//! kube-proxy's flag values, which know nothing of each other's settling.

use std::{net::IpAddr, sync::OnceLock};

use clap::{ArgMatches, parser::ValueSource};

use crate::{
    cli::RunArgs,
    detect_local::{DetectLocal, DetectLocalError},
    kube_proxy_flags::{NodePortAddress, check_nodeport_addresses, conntrack_size, cpus},
    model::{Cidr, ModelConfig},
    node_ip::{NodeIpError, NodeIps},
};

#[derive(Debug, thiserror::Error)]
pub enum KubeProxyFlagsError {
    #[error("--detect-local-mode: {0}")]
    DetectLocal(#[from] DetectLocalError),
    #[error("--bind-address {ip}: {source}")]
    BindAddress {
        ip: IpAddr,
        #[source]
        source: NodeIpError,
    },
    #[error("--nodeport-addresses: {0}")]
    NodePortAddresses(String),
    #[error("--conntrack-max-per-core, --conntrack-min: {0}")]
    ConntrackSize(String),
}

/// Whether the flag `id` was given on the command line or in the
/// environment (not its default).
pub fn given(matches: &ArgMatches, id: &str) -> bool {
    let run = matches.subcommand_matches("run").unwrap_or(matches);
    [matches, run].iter().any(|m| {
        m.try_get_raw(id).is_ok_and(|raw| raw.is_some())
            && m.value_source(id)
                .is_some_and(|source| source != ValueSource::DefaultValue)
    })
}

/// What is set that the datapath does not carry out yet, for the warning
/// at start.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Settled {
    pub not_yet: Vec<String>,
}

/// Settles the kube-proxy flags of `run` once the configuration file is
/// merged into it: the sync periods of the proxy mode, `--bind-address` as
/// the node's address, `--nodeport-addresses` into CIDRs, the local traffic
/// detector, the conntrack size; `given` tells the flags given on the
/// command line.
pub fn settle(
    run: &mut RunArgs,
    given: &dyn Fn(&str) -> bool,
) -> Result<Settled, KubeProxyFlagsError> {
    let mut settled = Settled::default();

    // kube-proxy's --iptables-* flags apply unless it runs in ipvs mode,
    // --ipvs-* in ipvs mode; ours, given, win over both.
    let ipvs = run.proxy_mode.as_deref() == Some("ipvs");
    let (sync, min_sync) = if ipvs {
        (run.ipvs_sync_period, run.ipvs_min_sync_period)
    } else {
        (run.iptables_sync_period, run.iptables_min_sync_period)
    };
    if let Some(period) = sync.filter(|_| !given("sync_period")) {
        run.sync_period = period;
    }
    if let Some(period) = min_sync.filter(|_| !given("min_sync_period")) {
        run.min_sync_period = period;
    }

    // kube-proxy's --bind-address is its idea of the node's primary IP.
    if let Some(ip) = run.bind_address.filter(|ip| !ip.is_unspecified()) {
        let ips = run.node_ip.unwrap_or_default();
        let of_family = match ip {
            IpAddr::V4(_) => ips.v4.is_some(),
            IpAddr::V6(_) => ips.v6.is_some(),
        };
        if !of_family {
            run.node_ip = Some(
                ips.with(ip)
                    .map_err(|source| KubeProxyFlagsError::BindAddress { ip, source })?,
            );
        }
    }

    check_nodeport_addresses(&run.nodeport_address_list)
        .map_err(KubeProxyFlagsError::NodePortAddresses)?;
    run.nodeport_primary = run
        .nodeport_address_list
        .contains(&NodePortAddress::Primary);
    run.nodeport_addresses = if run.nodeport_primary {
        primary_cidrs(run.node_ip.unwrap_or_default())
    } else {
        run.nodeport_address_list
            .iter()
            .filter_map(|entry| match entry {
                NodePortAddress::Cidr(cidr) => Some(*cidr),
                NodePortAddress::Primary => None,
            })
            .collect()
    };
    if run.nodeport_primary && run.nodeport_addresses.is_empty() {
        settled.not_yet.push(
            "nodeport-addresses primary without --node-ip or --bind-address (NodePorts are served on every node address)"
                .to_owned(),
        );
    }

    run.detect_local = DetectLocal::new(
        run.detect_local_mode,
        run.pod_bridge_interface.as_deref(),
        run.pod_interface_name_prefix.as_deref(),
    )?;

    if run.conntrack_max.is_none() {
        conntrack_size(run.conntrack_max_per_core, run.conntrack_min, cpus())
            .map_err(KubeProxyFlagsError::ConntrackSize)?;
    }
    // Once a process: the binary settles one command line.
    let _ = SETTLED_MODEL.set(run.model_config());
    Ok(settled)
}

/// The model's configuration as the command line settled it, for an
/// agent whose `AgentConfig` was built without it (see [`model_config`]).
static SETTLED_MODEL: OnceLock<ModelConfig> = OnceLock::new();

/// The model's configuration for the agent: `given` (the `AgentConfig`'s),
/// unless the command line was settled with flags that change it. The
/// binary builds its `AgentConfig` with the model's defaults, so the
/// address policy's flags (`--external-ip-cidrs`,
/// `--max-frontends-per-service`) reach the agent this way until it takes
/// `RunArgs::model_config` itself.
pub fn model_config(given: ModelConfig) -> ModelConfig {
    match SETTLED_MODEL.get() {
        Some(settled) if given == ModelConfig::default() => settled.clone(),
        _ => given,
    }
}

/// kube-proxy's `primary`: each family's node address, as a host CIDR.
fn primary_cidrs(ips: NodeIps) -> Vec<Cidr> {
    let host = |ip: IpAddr, prefix| Cidr::parse(&format!("{ip}/{prefix}"));
    [
        ips.v4.and_then(|ip| host(ip.into(), 32)),
        ips.v6.and_then(|ip| host(ip.into(), 128)),
    ]
    .into_iter()
    .flatten()
    .collect()
}
