//! The agent: source events -> state -> model -> planner -> maps, one
//! coalesced sync at a time ([`sync`]), with interface attachment alongside.

mod events;
mod node;
pub mod sync;
mod takeover;

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::PathBuf,
    time::{Duration, Instant},
};

use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc,
};
use tracing::{error, info, warn};

use proxy_common::node_config_flags;

use crate::{
    adopt::Adoption,
    datapath::{
        Datapath, DatapathError, MapSizes, PinLayout, XdpModeSetting, event_log,
        interfaces::{self, Interfaces, Selection, Snapshot},
        maps::Maps,
        program_load,
        refusal_records::RefusalRecords,
    },
    detect_local::DetectLocal,
    health_check_server::{self, HealthCheckServer},
    healthz::Health,
    housekeeping,
    http::{self, HttpError},
    metrics::{
        Metrics,
        datapath::{DatapathCollector, InterfaceModes},
        server::MetricsError,
    },
    model::{Cidr, ModelConfig},
    planner::{AffinityPurge, Departed, Planner, node::DesiredNode},
    source::{SourceEvent, kube as kube_source, manifest},
    state::ClusterState,
};
use node::NodeMaps;
use sync::{SyncLoop, SyncTarget};
use takeover::Takeover;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error("reading the pinned maps for adoption: {0}")]
    Adopt(#[source] crate::datapath::maps::MapsError),
    #[error("installing signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    #[error(transparent)]
    KubeSource(#[from] kube_source::KubeSourceError),
}

/// Where Services, EndpointSlices and the Node come from.
#[derive(Clone, Debug)]
pub enum SourceConfig {
    /// YAML/JSON manifests: a file or a directory, followed as it changes.
    Manifests(PathBuf),
    /// The Kubernetes API (see [`kube_source::config`] for how the flags
    /// pick the server and credentials).
    Kube {
        kubeconfig: Option<PathBuf>,
        master: Option<String>,
    },
}

pub struct AgentConfig {
    pub bpf_root: PathBuf,
    pub source: SourceConfig,
    pub interfaces: Option<Vec<String>>,
    pub healthz: SocketAddr,
    /// Where `/metrics` is served; None: nowhere.
    pub metrics: Option<SocketAddr>,
    pub node_name: String,
    pub min_sync_period: Duration,
    /// `--sync-period`: /healthz turns unhealthy when a change has waited
    /// twice this long, as kube-proxy's.
    pub sync_period: Duration,
    pub model: ModelConfig,
    pub ct_timeouts: proxy_common::CtTimeouts,
    /// Capacity of the conntrack map (`--conntrack-max`, two a connection).
    pub conntrack_entries: u32,
    /// Service ports counted (`--service-counters`).
    pub service_counters: u32,
    /// `--lb-algorithm` and the Maglev table every node shares.
    pub lb: crate::maglev::LbConfig,
    /// Assured flows one client address may hold (`--conntrack-max-per-source`).
    pub ct_source_share: u32,
    /// CIDRs of the node addresses NodePorts are served on; empty = all.
    pub nodeport_addresses: Vec<Cidr>,
    /// The node's own connections to 127.0.0.0/8 reach NodePorts.
    pub localhost_nodeports: bool,
    /// Pod CIDRs: their clients are in-cluster (`--cluster-cidr`).
    pub cluster_cidrs: Vec<Cidr>,
    /// `--service-cluster-ip-range`: the service CIDRs (`SERVICE_CIDRS`).
    pub service_cidrs: Vec<Cidr>,
    /// How in-cluster clients are told (`--detect-local-mode`): with
    /// `NodeCidr`, by this node's Node's `spec.podCIDRs` rather than
    /// `cluster_cidrs`; with an interface mode, by the interface they
    /// arrive on.
    pub detect_local: DetectLocal,
    /// SNAT every new flow to a Service to the node (`--masquerade-all`).
    pub masquerade_all: bool,
    /// How external flows to backends on other nodes go (`--lb-mode`).
    pub lb_mode: crate::planner::node::LbMode,
    /// Whose connections the socket hooks send to a backend
    /// (`--socket-lb-pods`).
    pub socket_lb: crate::planner::node::SocketLb,
    /// How translated packets reach this node's pods (`--host-routing`).
    pub host_routing: crate::planner::node::HostRouting,
    pub xdp_mode: XdpModeSetting,
    /// Where XDP goes (`--xdp-interfaces`); None: the uplinks found.
    pub xdp_interfaces: Option<Vec<String>>,
    /// The node's address per family (`--node-ip`): the IPv4 one is the
    /// SNAT address for external flows to remote backends; default, per
    /// family: the first address of the first uplink that has one.
    pub node_ip: crate::node_ip::NodeIps,
    /// Where the socket hooks attach (`--cgroup-root`); None: nowhere.
    pub cgroup_root: Option<PathBuf>,
    /// The datapath's log level (`--datapath-log`).
    pub datapath_log: event_log::Level,
    /// Leave kube-proxy's rules in place (`--keep-kube-proxy-rules`).
    pub keep_kube_proxy_rules: bool,
}

impl AgentConfig {
    /// The sizes of the maps the agent sizes at load.
    fn map_sizes(&self) -> MapSizes {
        MapSizes {
            conntrack_entries: self.conntrack_entries,
            service_counters: self.service_counters,
        }
    }
}

/// Tells `planner` which service ids the pinned `AFFINITY` holds entries
/// of, so that those of Services without affinity go after the first sync.
fn note_affinity_entries(datapath: &Datapath, planner: &mut Planner) {
    match datapath.maps.affinity_service_ids() {
        Ok(ids) => planner.note_affinity_entries(ids),
        // Entries of Services without affinity then go only once idle past
        // their timeout (the reaper).
        Err(e) => warn!(error = %e, "reading which Services AFFINITY holds entries of"),
    }
}

/// Says, beside `tc_dsr`'s load error, what it means where direct server
/// return was asked for: this node cannot take the flows other nodes send
/// it that way.
fn warn_without_dsr(datapath: &Datapath, lb_mode: crate::planner::node::LbMode) {
    if lb_mode != crate::planner::node::LbMode::Snat && !datapath.dsr_loaded() {
        warn!(
            ?lb_mode,
            "direct server return asked for, but this node cannot take other nodes' flows sent that way"
        );
    }
}

/// Runs until SIGTERM or SIGINT. On exit the datapath stays as it is:
/// pinned maps and links keep serving traffic, and the next start adopts them.
pub async fn run(config: AgentConfig) -> Result<(), AgentError> {
    let pins = PinLayout::new(&config.bpf_root);
    let started = Instant::now();
    let mut datapath = Datapath::load_with_sizes(pins, config.map_sizes())?;
    log_program_loads(&datapath, started);
    warn_without_dsr(&datapath, config.lb_mode);
    let (mut node, mut adoption) = node_maps_at_start(&datapath, &config)?;
    node.sync(&mut datapath.maps, Instant::now());
    attach_socket_hooks(&mut datapath, config.cgroup_root.as_deref());
    start_event_log(&mut datapath, config.datapath_log);
    let stored = datapath
        .maps
        .read_service_state()
        .map_err(AgentError::Adopt)?;
    let (mut planner, garbage) = Planner::adopt(&stored);
    note_affinity_entries(&datapath, &mut planner);
    planner.count_ids_below(config.service_counters);
    planner.balance_with(config.lb);
    info!(
        frontends = planner.frontend_count(),
        backends = planner.backend_count(),
        bpf_root = %config.bpf_root.display(),
        "datapath loaded; adopted what the pinned maps hold"
    );
    let outcome = planner.collect_garbage(garbage, &mut datapath.maps);
    if outcome.ops > 0 {
        info!(ops = outcome.ops, "removed unreferenced map entries");
    }
    for e in outcome.errors {
        warn!(error = %e, "garbage collection; retried by the sync loop");
    }

    let health = Health::new(config.sync_period.saturating_mul(2));
    let mut sync = SyncLoop::new(config.min_sync_period, health.clone(), Instant::now());
    if let Some(map) = datapath.maps.service_refusals.take() {
        sync.set_refusal_records(RefusalRecords::new(map));
    }
    let interface_modes = InterfaceModes::default();
    let metrics = start_metrics(&config, &datapath, &mut sync, &interface_modes).await?;
    let _http = http::serve(config.healthz, health.clone(), &metrics).await?;

    let health_checks = start_health_checks(&config, &health, &metrics);

    let mut if_rx = watch_interfaces(&config);

    let (ev_tx, mut ev_rx) = mpsc::channel::<SourceEvent>(1024);
    spawn_source(&config, ev_tx, &metrics, &mut sync).await?;

    let mut sigterm = signal(SignalKind::terminate()).map_err(AgentError::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(AgentError::Signals)?;

    let mut state = cluster_state(&config);
    let mut reap = tokio::time::interval(housekeeping::REAP_PERIOD);
    let mut takeover = Takeover::default();
    // What `CLUSTER_CIDRS` holds of the Node's pod CIDRs (NodeCIDR).
    let mut node_pod_cidrs: Vec<Cidr> = Vec::new();
    loop {
        let wakeup = sync.wakeup();
        tokio::select! {
            Some(event) = ev_rx.recv() => sync.on_event(&mut state, event, Instant::now()),
            Some(snapshot) = if_rx.recv() => {
                apply_snapshot(&mut datapath, &mut node, &snapshot, &config);
                housekeeping::after_interface_pass(&mut datapath);
                sync.on_interface_addresses(&mut state, &snapshot.addrs, Instant::now());
                interface_modes.set(datapath.attached(), datapath.xdp_attached());
                sync.interfaces_applied(Instant::now());
                health_checks
                    .set_addresses(&health_check_addresses(&config.nodeport_addresses, Some(&snapshot.addrs)))
                    .await;
            }
            () = tokio::time::sleep_until(wakeup.unwrap_or_else(Instant::now).into()), if wakeup.is_some() => {
                let follow_ups = sync.run(Instant::now(), &state, &config.model, &mut planner, &mut datapath);
                // After the sync, so that a new Service's frontends land
                // before its ClusterIP's other ports are rejected.
                if node.follow_cluster_ips(&state, &config.model) {
                    node.sync(&mut datapath.maps, Instant::now());
                }
                if let Some(checks) = follow_ups.health_checks {
                    health_checks.update(checks).await;
                }
            }
            () = tokio::time::sleep_until(node.wakeup().unwrap_or_else(Instant::now).into()), if node.wakeup().is_some() => {
                node.sync(&mut datapath.maps, Instant::now());
            }
            _ = reap.tick() => {
                retry_attaches(&mut datapath, &interface_modes);
                housekeeping::reap_conntrack(&mut datapath);
                if adoption.check() {
                    node.set_netfilter_flows(false);
                    node.sync(&mut datapath.maps, Instant::now());
                    shed_privileges(false); // the takeover's last netfilter tool has run

                }
            }
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
        }
        if follow_state(&mut node, &state, &config, &mut node_pod_cidrs) {
            node.sync(&mut datapath.maps, Instant::now());
        }
        let attached = datapath.attached().next().is_some();
        takeover.poll(sync.serving(), attached, || {
            takeover::finish(&mut datapath);
            adoption.on_serving();
            // Everything loaded and attached, the older datapaths retired:
            // what remains to do needs fewer capabilities.
            shed_privileges(adoption.active());
        });
    }
    info!("exiting; the pinned datapath keeps serving (`ebpf-proxy cleanup` removes it)");
    Ok(())
}

/// What of the node maps follows the cluster state rather than the
/// configuration: the service CIDRs, and the Node's pod CIDRs under
/// `--detect-local-mode NodeCIDR` (`node_pod_cidrs`: what `CLUSTER_CIDRS`
/// holds of them). True when the maps are to be written.
fn follow_state(
    node: &mut NodeMaps,
    state: &ClusterState,
    config: &AgentConfig,
    node_pod_cidrs: &mut Vec<Cidr>,
) -> bool {
    let mut changed = node.follow_service_cidrs(state, &config.service_cidrs);
    if config.detect_local == DetectLocal::NodeCidr
        && state.node_pod_cidrs() != node_pod_cidrs.as_slice()
    {
        *node_pod_cidrs = state.node_pod_cidrs().to_vec();
        info!(pod_cidrs = ?node_pod_cidrs, "clients inside the Node's pod CIDRs are in-cluster");
        node.set_cluster_cidrs(node_pod_cidrs);
        node.set_masquerade_off_cluster(
            node_pod_cidrs.iter().any(|c| c.ip.is_ipv4()),
            node_pod_cidrs.iter().any(|c| c.ip.is_ipv6()),
        );
        changed = true;
    }
    changed
}

/// The node's interfaces and addresses, listed now and as they change.
fn watch_interfaces(config: &AgentConfig) -> mpsc::Receiver<Snapshot> {
    let (if_tx, if_rx) = mpsc::channel::<Snapshot>(4);
    let selection = Selection {
        only: config.interfaces.clone(),
    };
    tokio::spawn(async move {
        if let Err(e) = interfaces::watch(selection, Duration::from_secs(5), if_tx).await {
            error!(error = %e, "interface watcher stopped; attachments stay as they are");
        }
    });
    if_rx
}

/// The health check node ports: on every address, as kube-proxy does
/// without nodePortAddresses; with them, on the matching node addresses,
/// none until the interfaces are listed, and following them as they come
/// and go.
fn start_health_checks(
    config: &AgentConfig,
    health: &Health,
    metrics: &Metrics,
) -> HealthCheckServer {
    HealthCheckServer::new(
        &health_check_addresses(&config.nodeport_addresses, None),
        health.clone(),
        metrics.http.clone(),
    )
}

/// Keeps only the capabilities the running agent needs (`privileges::STEADY`,
/// and `CAP_NET_RAW` while `netfilter_tools` are still to run). A failure
/// leaves the agent running with what it had, which is logged.
fn shed_privileges(netfilter_tools: bool) {
    let kept = crate::privileges::steady_state(netfilter_tools)
        .map_err(|e| e.to_string())
        .and_then(|keep| {
            let names: Vec<String> = keep.iter().map(ToString::to_string).collect();
            crate::privileges::shed::keep_only(&keep)
                .map(|mask| (names, mask))
                .map_err(|e| e.to_string())
        });
    match kept {
        Ok((mut names, mask)) => {
            names.sort();
            info!(kept = ?names, effective = %format!("{mask:016x}"), "capabilities not needed from now on dropped, on every thread");
        }
        Err(e) => {
            warn!(error = %e, "could not drop the capabilities not needed from now on; running with those of the start");
        }
    }
}

/// The cluster as the agent starts to learn it, under the address policy
/// the configuration sets.
fn cluster_state(config: &AgentConfig) -> ClusterState {
    let mut state = ClusterState::new(config.node_name.clone());
    state.set_frontend_budget(config.model.max_frontends_per_service);
    if let Some(cidrs) = &config.model.external_ip_cidrs {
        info!(
            ?cidrs,
            "externalIPs outside these CIDRs are refused (--external-ip-cidrs)"
        );
    }
    state
}

/// The verifier's work is most of the start before anything is programmed,
/// and grows with each program: which ones took it is worth a line.
fn log_program_loads(datapath: &Datapath, started: Instant) {
    let loads = datapath.program_loads();
    info!(
        load_ms = started.elapsed().as_millis() as u64,
        programs = loads.len(),
        programs_ms = program_load::total(loads).as_millis() as u64,
        slowest = %program_load::Slowest(loads, 3),
        "datapath programs loaded and verified"
    );
}

/// The node-level maps as this agent wants them from its start, and what
/// it found of kube-proxy: tc is told to leave kube-proxy's flows to
/// netfilter before anything of this agent's translates, so that they find
/// it asking from their first packet through it.
fn node_maps_at_start(
    datapath: &Datapath,
    config: &AgentConfig,
) -> Result<(NodeMaps, Adoption), AgentError> {
    let stored_node = datapath.maps.read_node_state().map_err(AgentError::Adopt)?;
    let pinned_flag = stored_node.config.flags & node_config_flags::NETFILTER_FLOWS != 0;
    let mut node = NodeMaps::new(
        stored_node,
        DesiredNode::new(
            config.ct_timeouts,
            if config.detect_local == DetectLocal::ClusterCidr {
                &config.cluster_cidrs
            } else {
                &[]
            },
        )
        .with_masquerade_all(config.masquerade_all)
        .with_lb_mode(config.lb_mode)
        .with_socket_lb(config.socket_lb)
        .with_host_routing(config.host_routing)
        .with_ct_source_share(config.ct_source_share),
    );
    let adoption = Adoption::start(pinned_flag, config.keep_kube_proxy_rules);
    node.set_netfilter_flows(adoption.active());
    // kube-proxy masquerades off-cluster clients of a ClusterIP where its
    // local traffic detector of the family is implemented.
    let (detector_v4, detector_v6) = match &config.detect_local {
        DetectLocal::ClusterCidr => (
            config.cluster_cidrs.iter().any(|c| c.ip.is_ipv4()),
            config.cluster_cidrs.iter().any(|c| c.ip.is_ipv6()),
        ),
        // Until the Node says which families its pods have.
        DetectLocal::NodeCidr => (false, false),
        DetectLocal::BridgeInterface(_) | DetectLocal::InterfaceNamePrefix(_) => (true, true),
    };
    node.set_masquerade_off_cluster(detector_v4, detector_v6);
    Ok((node, adoption))
}

/// The metrics, wired to the sync loop, and their server when
/// `--metrics-bind-address` asks for one. Without the datapath's maps (an
/// unreadable pin) the other metrics are still served.
async fn start_metrics(
    config: &AgentConfig,
    datapath: &Datapath,
    sync: &mut SyncLoop,
    interfaces: &InterfaceModes,
) -> Result<Metrics, AgentError> {
    let counters = datapath.maps.service_counters().and_then(|c| {
        c.inspect_err(|e| warn!(error = %e, "per-Service metrics not served"))
            .ok()
    });
    let collector =
        DatapathCollector::open(datapath.pins(), counters, sync.stats(), interfaces.clone())
            .inspect_err(|e| warn!(error = %e, "datapath metrics not served"))
            .ok();
    let metrics = Metrics::new(collector);
    sync.set_metrics(metrics.proxy.clone());
    sync.set_policy_metrics(metrics.policy.clone());
    if let Some(addr) = config.metrics {
        crate::metrics::server::serve(addr, metrics.clone()).await?;
        info!(%addr, "serving metrics at /metrics");
    }
    Ok(metrics)
}

/// The datapath's log: its level written, its records forwarded into this
/// log. A failure leaves the datapath serving, without a log of its own.
fn start_event_log(datapath: &mut Datapath, level: event_log::Level) {
    let logger = match datapath.event_logger() {
        Ok(logger) => logger,
        Err(e) => {
            error!(error = %e, "the datapath's log records cannot be read: its log is turned off");
            if let Err(e) = event_log::set_level(datapath.pins(), event_log::Level::Off) {
                warn!(error = %e, "turning the datapath's log off");
            }
            return;
        }
    };
    let pins = datapath.pins().clone();
    tokio::spawn(async move {
        if let Err(e) = event_log::run(pins, level, logger).await {
            error!(error = %e, "the datapath's log records are no longer read");
        }
    });
}

/// The node's own connections to Services go through the socket hooks:
/// without them they would reach no backend, so a failure is loud, but the
/// pods' traffic does not depend on it.
fn attach_socket_hooks(datapath: &mut Datapath, cgroup_root: Option<&std::path::Path>) {
    let Some(cgroup) = cgroup_root else {
        warn!(
            "no cgroup v2 hierarchy found: the node's own connections to Services are not translated (--cgroup-root)"
        );
        return;
    };
    let attached = host_netns_cookie()
        .and_then(|cookie| {
            datapath
                .maps
                .set_host_netns(cookie)
                .map_err(|e| e.to_string())
        })
        .and_then(|()| datapath.attach_cgroup(cgroup).map_err(|e| e.to_string()));
    match attached {
        Ok(()) => {
            info!(cgroup = %cgroup.display(), "socket hooks attached: the node's own connections to Services are translated");
        }
        Err(e) => {
            error!(cgroup = %cgroup.display(), error = %e, "socket hooks not attached: the node's own connections to Services are not translated");
        }
    }
}

fn host_netns_cookie() -> Result<u64, String> {
    crate::datapath::host::netns_cookie()
        .map_err(|e| format!("reading this network namespace's cookie: {e}"))
}

impl SyncTarget for Datapath {
    type Store = Maps;

    fn store(&mut self) -> &mut Maps {
        &mut self.maps
    }

    fn clean_departed(&mut self, departed: &[Departed], affinity: &AffinityPurge) -> bool {
        housekeeping::clean_departed(self, departed, affinity)
    }
}

/// Starts the configured source feeding `tx`. A Kubernetes client that
/// cannot be configured is an error; once running, a source never stops the
/// agent (API failures are retried inside it). With the API, the sync
/// loop's Events on Services are posted through the same client.
async fn spawn_source(
    config: &AgentConfig,
    tx: mpsc::Sender<SourceEvent>,
    metrics: &Metrics,
    sync: &mut SyncLoop,
) -> Result<(), AgentError> {
    match &config.source {
        SourceConfig::Manifests(path) => {
            let path = path.clone();
            tokio::spawn(async move {
                if let Err(e) = manifest::watch(path, tx).await {
                    error!(error = %e, "manifest source stopped; the datapath keeps its last state");
                }
            });
        }
        SourceConfig::Kube { kubeconfig, master } => {
            let client = metrics
                .rest_client
                .client(kubeconfig.clone(), master.clone())
                .await?;
            let node_name = config.node_name.clone();
            sync.set_events(events::spawn(client.clone(), node_name.clone()));
            tokio::spawn(async move {
                if let Err(e) = kube_source::watch(client, node_name, tx).await {
                    error!(error = %e, "Kubernetes API source stopped; the datapath keeps its last state");
                }
            });
        }
    }
    Ok(())
}

/// Follows the node's interfaces and addresses: tc everywhere, XDP on
/// uplinks, the node addresses NodePorts are served on, the SNAT address.
fn apply_snapshot(
    datapath: &mut Datapath,
    node: &mut NodeMaps,
    snapshot: &Snapshot,
    config: &AgentConfig,
) {
    attach_all(datapath, &snapshot.interfaces);
    node.set_local_ifaces(config.detect_local.local_interfaces(&snapshot.interfaces));
    let ifindexes = |names: &std::collections::BTreeSet<String>| {
        names
            .iter()
            .filter_map(|name| snapshot.interfaces.get(name).copied())
            .collect()
    };
    node.set_pod_ifaces(ifindexes(&snapshot.pods), &ifindexes(&snapshot.shaped));
    apply_xdp(datapath, snapshot, config);
    let ips = node::node_addresses(config.node_ip, &snapshot.addrs);
    node.set_interfaces(
        &snapshot.addrs,
        &config.nodeport_addresses,
        ips,
        config.localhost_nodeports,
    );
    node.sync(&mut datapath.maps, Instant::now());
    info!(
        interfaces = snapshot.interfaces.len(),
        uplinks = ?snapshot.uplinks,
        xdp = ?datapath.xdp_attached().collect::<Vec<_>>(),
        node_addrs = ?snapshot.addrs,
        snat = ?ips.v4,
        node_ip6 = ?ips.v6,
        "interfaces and addresses"
    );
}

/// XDP where it pays ([`xdp_plan`]), and off everywhere else: also a link
/// an earlier run pinned on an interface that is no longer to have one, or
/// in another mode than this run's.
fn apply_xdp(datapath: &mut Datapath, snapshot: &Snapshot, config: &AgentConfig) {
    let plan = xdp_plan(config.xdp_mode, config.xdp_interfaces.as_deref(), snapshot);
    for (name, &index) in &snapshot.interfaces {
        let Some(setting) = plan.get(name.as_str()).copied().flatten() else {
            datapath.forget_xdp(name);
            if plan.contains_key(name.as_str()) && datapath.decline_xdp(name, index) {
                info!(
                    interface = %name,
                    "no XDP on this veth uplink under --xdp-mode auto (its frames may carry \
                     partial checksums, which native XDP cannot finish); tc ingress handles it"
                );
            }
            continue;
        };
        if datapath.xdp_declined(name, index) {
            continue;
        }
        let wanted = match setting {
            XdpModeSetting::Generic => "generic",
            _ => "native",
        };
        let running = snapshot.xdp.get(name).copied();
        if !datapath.has_xdp(name) && running.is_some_and(|m| m != wanted) {
            // An earlier run's link (its pin) in the other mode, or none of
            // ours (then nothing is detached, and the attach below fails).
            datapath.forget_xdp(name);
        }
        match datapath.attach_xdp(name, index, setting) {
            Ok(mode) => tracing::debug!(interface = %name, mode, "XDP attached"),
            Err(e) => {
                let first = datapath.xdp_failed(name, index, setting, &e);
                if !e.unsupported() {
                    if first {
                        warn!(
                            interface = %name,
                            error = %e,
                            "XDP not attached (another program's XDP in the way?); tc ingress \
                             alone handles this interface's north-south traffic until it is, \
                             tried again at each reap and interface change"
                        );
                    }
                } else if setting == XdpModeSetting::Native {
                    warn!(
                        interface = %name,
                        error = %e,
                        "native XDP not attached (the driver may not have it); tc ingress alone \
                         handles this interface's north-south traffic (--xdp-mode generic runs \
                         XDP on any driver)"
                    );
                } else {
                    warn!(
                        interface = %name,
                        error = %e,
                        "XDP not attached; tc ingress alone handles this interface's north-south \
                         traffic"
                    );
                }
            }
        }
    }
}

/// Which interfaces get XDP, and in which mode: the ones named in
/// `--xdp-interfaces` (of those in the snapshot), else the uplinks the
/// snapshot found, each in [`xdp_setting`]'s mode for it. None for an
/// interface XDP would go on but for its mode (a veth under `auto`).
pub fn xdp_plan<'a>(
    mode: XdpModeSetting,
    named: Option<&'a [String]>,
    snapshot: &'a Snapshot,
) -> BTreeMap<&'a str, Option<XdpModeSetting>> {
    let candidates: Vec<&str> = match named {
        Some(names) => names
            .iter()
            .filter(|n| snapshot.interfaces.contains_key(n.as_str()))
            .map(String::as_str)
            .collect(),
        None => snapshot.uplinks.iter().map(String::as_str).collect(),
    };
    candidates
        .into_iter()
        .filter_map(
            |name| match xdp_setting(mode, snapshot.veths.contains(name)) {
                XdpModeSetting::Off if mode == XdpModeSetting::Off => None,
                XdpModeSetting::Off => Some((name, None)),
                setting => Some((name, Some(setting))),
            },
        )
        .collect()
}

/// The XDP mode for an interface XDP goes on. `auto` is native, never
/// generic (which costs more than tc: bench/README.md), and nothing on a
/// veth: frames sent by another namespace on this host reach it with the
/// checksum still to be finished on transmit, which native XDP can neither
/// see nor finish, so tc alone handles a veth uplink. `--xdp-mode native`
/// forces native mode there too (for veths fed with complete checksums),
/// `generic` runs on the socket buffer and keeps them right.
pub fn xdp_setting(wanted: XdpModeSetting, veth: bool) -> XdpModeSetting {
    match wanted {
        XdpModeSetting::Auto if veth => XdpModeSetting::Off,
        XdpModeSetting::Auto => XdpModeSetting::Native,
        other => other,
    }
}

/// Where the health check node ports listen: every address when
/// `--nodeport-addresses` is unset; else the node addresses (`addrs`, none
/// before they are listed) it lets serve NodePorts, by the same rule as the
/// NodePorts' own (`planner::node::node_addrs`: per family, every address of
/// a family it names no CIDR of), and 127.0.0.1 when one of its CIDRs holds
/// it, as kube-proxy's node IPs matching nodePortAddresses.
fn health_check_addresses(
    nodeport_addresses: &[Cidr],
    addrs: Option<&[IpAddr]>,
) -> health_check_server::Addresses {
    if nodeport_addresses.is_empty() {
        return health_check_server::Addresses::Every;
    }
    let mut allowed: Vec<IpAddr> = addrs
        .unwrap_or_default()
        .iter()
        .copied()
        .filter(|ip| {
            crate::planner::node::node_addrs(&[*ip], nodeport_addresses)
                .values()
                .all(|a| a.flags & proxy_common::node_addr_flags::NODEPORT != 0)
        })
        .collect();
    if serves_loopback(nodeport_addresses) {
        allowed.push(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    health_check_server::Addresses::Only(allowed)
}

/// Whether `--nodeport-addresses` lets NodePorts be served on loopback
/// addresses: when it is unset, or one of its CIDRs holds 127.0.0.1, as
/// kube-proxy's `ContainsIPv4Loopback`.
pub fn serves_loopback(nodeport_addresses: &[Cidr]) -> bool {
    nodeport_addresses.is_empty()
        || nodeport_addresses
            .iter()
            .any(|c| c.contains(IpAddr::V4(Ipv4Addr::LOCALHOST)))
}

/// Attaches tc again where an interface pass could not
/// (`Datapath::retry_attaches`), and XDP where it failed for a reason that
/// may pass (`Datapath::retry_xdp`), and follows what lands as a pass is
/// followed. Asked at each reap.
fn retry_attaches(datapath: &mut Datapath, modes: &InterfaceModes) {
    let mut landed = false;
    for (name, outcome) in datapath.retry_attaches() {
        match outcome {
            Ok(()) => {
                info!(interface = %name, "attached on a retry");
                landed = true;
            }
            Err(e) => {
                warn!(error = %e, "interface still without the datapath; tried again at the next reap");
            }
        }
    }
    for (name, outcome) in datapath.retry_xdp() {
        match outcome {
            Ok(mode) => {
                info!(interface = %name, mode, "XDP attached on a retry");
                landed = true;
            }
            Err(e) if e.unsupported() => warn!(
                interface = %name,
                error = %e,
                "XDP cannot be attached in this mode; tc ingress alone handles this interface's \
                 north-south traffic"
            ),
            // Logged when it first failed; an operator's own XDP program
            // may hold the interface for good.
            Err(e) => tracing::debug!(interface = %name, error = %e, "XDP still not attached"),
        }
    }
    if landed {
        housekeeping::after_interface_pass(datapath);
        modes.set(datapath.attached(), datapath.xdp_attached());
    }
}

fn attach_all(datapath: &mut Datapath, ifaces: &Interfaces) {
    let gone: Vec<String> = datapath
        .attached()
        .chain(datapath.tc_pending())
        .filter(|name| !ifaces.contains_key(*name))
        .map(str::to_string)
        .collect();
    for name in gone {
        info!(interface = %name, "interface gone");
        datapath.forget(&name);
    }
    for (name, index) in ifaces {
        match datapath.attach(name, *index) {
            Ok(()) => {}
            Err(e) => error!(
                error = %e,
                "interface left without the datapath; tried again at each reap"
            ),
        }
    }
}

/// NODE_NAME-less default, as kube-proxy: the hostname.
pub fn default_node_name() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_xdp_is_native_and_never_on_veths() {
        use XdpModeSetting::*;
        assert_eq!(xdp_setting(Auto, true), Off);
        assert_eq!(xdp_setting(Auto, false), Native);
        assert_eq!(xdp_setting(Native, true), Native);
        assert_eq!(xdp_setting(Generic, false), Generic);
        assert_eq!(xdp_setting(Off, true), Off);
    }

    #[test]
    fn xdp_goes_on_uplinks_unless_interfaces_are_named() {
        use XdpModeSetting::*;
        let names = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let mut snapshot = Snapshot::default();
        for (i, name) in ["eth0", "eth1", "cni0", "veth1"].iter().enumerate() {
            snapshot.interfaces.insert((*name).to_owned(), i as u32 + 2);
        }
        snapshot.uplinks = ["eth0", "eth1"].iter().map(|s| (*s).to_owned()).collect();
        snapshot.veths = ["eth1", "veth1"].iter().map(|s| (*s).to_owned()).collect();
        let plan = |mode, named: Option<&[String]>| {
            xdp_plan(mode, named, &snapshot)
                .into_iter()
                .map(|(n, s)| (n.to_owned(), s))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            plan(Auto, None),
            vec![("eth0".into(), Some(Native)), ("eth1".into(), None)],
            "auto: native on uplinks, a veth uplink left to tc"
        );
        assert_eq!(
            plan(Generic, None),
            vec![
                ("eth0".into(), Some(Generic)),
                ("eth1".into(), Some(Generic))
            ]
        );
        assert!(plan(Off, None).is_empty());
        let named = names(&["cni0", "veth1", "gone0"]);
        assert_eq!(
            plan(Generic, Some(&named)),
            vec![
                ("cni0".into(), Some(Generic)),
                ("veth1".into(), Some(Generic))
            ],
            "named interfaces instead of the uplinks; one not there skipped"
        );
    }

    #[test]
    fn health_check_ports_listen_where_node_ports_are_served() {
        use health_check_server::Addresses;
        let cidrs = |cidrs: &[&str]| -> Vec<Cidr> {
            cidrs.iter().map(|c| Cidr::parse(c).unwrap()).collect()
        };
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let addrs = [
            ip("10.0.0.5"),
            ip("192.168.1.5"),
            ip("fd00::5"),
            ip("2001:db8::5"),
        ];
        assert_eq!(
            health_check_addresses(&[], Some(&addrs)),
            Addresses::Every,
            "unset: every address, as kube-proxy"
        );
        assert_eq!(
            health_check_addresses(&cidrs(&["10.0.0.0/8"]), None),
            Addresses::Only(Vec::new()),
            "set, before the node's addresses are known: none"
        );
        assert_eq!(
            health_check_addresses(&cidrs(&["10.0.0.0/8", "fd00::/8"]), Some(&addrs)),
            Addresses::Only(vec![ip("10.0.0.5"), ip("fd00::5")]),
        );
        assert_eq!(
            health_check_addresses(&cidrs(&["192.168.0.0/16"]), Some(&addrs)),
            Addresses::Only(vec![ip("192.168.1.5"), ip("fd00::5"), ip("2001:db8::5")]),
            "a family without a CIDR: all of its addresses, as the NodePorts"
        );
        assert_eq!(
            health_check_addresses(&cidrs(&["127.0.0.0/8"]), Some(&addrs)),
            Addresses::Only(vec![ip("fd00::5"), ip("2001:db8::5"), ip("127.0.0.1")]),
        );
    }

    #[test]
    fn localhost_node_ports_follow_nodeport_addresses() {
        let serves = |cidrs: &[&str]| {
            let cidrs: Vec<Cidr> = cidrs.iter().map(|c| Cidr::parse(c).unwrap()).collect();
            serves_loopback(&cidrs)
        };
        assert!(serves(&[]), "no --nodeport-addresses: loopback too");
        assert!(serves(&["192.168.0.0/16", "127.0.0.0/8"]));
        assert!(serves(&["127.0.0.1/32"]));
        assert!(!serves(&["192.168.0.0/16"]), "loopback not listed");
        assert!(!serves(&["127.0.0.2/32"]), "a CIDR without 127.0.0.1");
    }
}
