//! Command line of the `ebpf-proxy` binary.

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use clap::{Args, Parser, Subcommand};

use crate::{
    datapath::{XdpModeSetting, event_log::Level as DatapathLogLevel, pins::DEFAULT_BPF_ROOT},
    detect_local::{DetectLocal, LocalMode},
    kube_proxy_flags::{IgnoredFlags, NodePortAddress, parse_duration, parse_go_bool},
    logging::LogFormat,
    model::Cidr,
};

#[derive(Debug, Parser)]
#[command(
    name = "ebpf-proxy",
    version,
    about = "eBPF replacement for kube-proxy",
    args_override_self = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// How the log (on standard error) is written: `text`, coloured only
    /// on a terminal and never with `NO_COLOR` set, or `json`, one object per
    /// line with the same fields, for log collectors. Also kube-proxy's
    /// `--logging-format`.
    #[arg(
        long,
        alias = "logging-format",
        global = true,
        value_enum,
        default_value_t = LogFormat::Text
    )]
    pub log_format: LogFormat,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Program the datapath and keep it in sync with the Services.
    Run(Box<RunArgs>),
    /// Detach from every interface and remove every pin.
    Cleanup(CleanupArgs),
    /// Print the frontends, backends and counters in the pinned maps.
    Status(StatusArgs),
    /// Set the level of the datapath's log in the pinned maps: a running
    /// agent forwards what the datapath logs from then on (until its next
    /// start, which writes its --datapath-log).
    DatapathLog(DatapathLogArgs),
    /// Print new flows, rejects and drops as the datapath decides them,
    /// one a line, until interrupted (docs/operations.md, "Tracing").
    Trace(TraceArgs),
}

#[derive(Debug, Args)]
pub struct TraceArgs {
    #[command(flatten)]
    pub pins: PinArgs,
    /// `text`, or `json` for one object a line.
    #[arg(long, value_enum, default_value_t = StatusOutput::Text)]
    pub output: StatusOutput,
    /// Only flows to this Service.
    #[arg(long, value_name = "NAMESPACE/NAME", value_parser = parse_service)]
    pub service: Option<(String, String)>,
    /// Only flows from this client address.
    #[arg(long, value_name = "ADDR")]
    pub client: Option<IpAddr>,
    /// Only flows to this port of a frontend (a NodePort's, or any
    /// frontend's port).
    #[arg(long, value_name = "PORT")]
    pub node_port: Option<u16>,
}

#[derive(Debug, Args)]
pub struct DatapathLogArgs {
    /// off, error, warn, info or debug.
    #[arg(value_enum)]
    pub level: DatapathLogLevel,
    #[command(flatten)]
    pub pins: PinArgs,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub pins: PinArgs,
    /// Also list every translated flow in conntrack, one a line:
    /// `<proto> <client> -> <frontend> => <backend>`, IPv6 addresses as
    /// `[addr]:port` (in JSON, a list under "flows").
    #[arg(long)]
    pub flows: bool,
    /// How to print the report: `text`, or `json` for tools.
    #[arg(long, value_enum, default_value_t = StatusOutput::Text)]
    pub output: StatusOutput,
    /// Only this Service in the Services part (the node's part is
    /// printed whole).
    #[arg(long, value_name = "NAMESPACE/NAME", value_parser = parse_service)]
    pub service: Option<(String, String)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StatusOutput {
    Text,
    Json,
}

/// `NAMESPACE/NAME` of `--service`.
fn parse_service(text: &str) -> Result<(String, String), String> {
    match text.split_once('/') {
        Some((namespace, name))
            if !namespace.is_empty() && !name.is_empty() && !name.contains('/') =>
        {
            Ok((namespace.to_owned(), name.to_owned()))
        }
        _ => Err(format!("{text:?} is not NAMESPACE/NAME")),
    }
}

#[derive(Debug, Args)]
pub struct CleanupArgs {
    #[command(flatten)]
    pub pins: PinArgs,
    /// Before detaching, hand every flow this datapath translates to the
    /// kernel's conntrack with its NAT, so that kube-proxy started next
    /// keeps each on its backend (docs/operations.md, "Handing back to
    /// kube-proxy"). Nothing pinned: nothing to do.
    #[arg(long)]
    pub handoff: bool,
}

#[derive(Debug, Args)]
pub struct PinArgs {
    /// Directory on bpffs holding the pinned maps and links.
    #[arg(long, default_value = DEFAULT_BPF_ROOT)]
    pub bpf_root: PathBuf,
}

#[derive(Debug, Args)]
// A flag given again overrides itself, as with Go's flags (a wrapper that
// appends `--v=4` to a command line that has `--v=2`).
#[command(args_override_self = true)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "one field per flag: kube-proxy's boolean flags are booleans"
)]
pub struct RunArgs {
    #[command(flatten)]
    pub pins: PinArgs,
    /// kube-proxy's configuration file (a KubeProxyConfiguration, as
    /// kubeadm keeps it in the `kube-proxy` ConfigMap): its fields set the
    /// flags they correspond to; flags given here override it.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Read Services, EndpointSlices and Nodes from this YAML file or
    /// directory (as `kubectl get -o yaml` prints them) and follow its
    /// changes, instead of watching the Kubernetes API.
    #[arg(long)]
    pub manifests: Option<PathBuf>,
    /// kubeconfig file(s) for the API server (a `:`-separated list is
    /// merged, as kubectl does). Without it: the in-cluster service account,
    /// else `--master` without credentials, else ~/.kube/config.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// The API server's URL, overriding the kubeconfig's or the in-cluster
    /// one. Without kube-proxy the in-cluster address (the `kubernetes`
    /// Service) is served by this proxy itself, so a DaemonSet points this
    /// at the API server's real address.
    #[arg(long, value_name = "URL", conflicts_with = "manifests")]
    pub master: Option<String>,
    /// Attach only to these interfaces (default: every non-loopback one,
    /// including ones created later).
    #[arg(long, value_delimiter = ',', value_parser = crate::datapath::interfaces::parse_name)]
    pub interfaces: Option<Vec<String>>,
    /// Where /healthz is served: IP:port, or an IP (port 10256), as
    /// kube-proxy's flag.
    #[arg(long, default_value = "0.0.0.0:10256", value_parser = parse_healthz_bind_address)]
    pub healthz_bind_address: SocketAddr,
    /// Where Prometheus metrics are served (`/metrics`), as kube-proxy's
    /// flag: IP:port, or an IP (port 10249); empty or 0 turns them off.
    #[arg(
        long,
        default_value = "127.0.0.1:10249",
        value_parser = crate::metrics::parse_bind_address
    )]
    #[expect(
        unused_qualifications,
        reason = "spelled out so that clap does not read the flag as optional: the parser's \
                  own `None` (an empty value or 0) turns metrics off"
    )]
    pub metrics_bind_address: std::option::Option<SocketAddr>,
    /// This node's name: decides which endpoints are local. Trimmed and
    /// lowercased, as kube-proxy's `--hostname-override` (also accepted
    /// under that name).
    #[arg(
        long,
        env = "NODE_NAME",
        alias = "hostname-override",
        value_parser = crate::kube_proxy_flags::parse_node_name
    )]
    pub node_name: Option<String>,
    /// kube-proxy's idea of the node's primary IP: the node address of its
    /// family where --node-ip gives none (0.0.0.0 and :: set nothing).
    #[arg(long, value_name = "IP")]
    pub bind_address: Option<IpAddr>,
    /// Changes arriving within this window are applied in one sync.
    #[arg(long, default_value = "20ms", value_parser = parse_duration)]
    pub min_sync_period: Duration,
    /// kube-proxy's flag: /healthz turns unhealthy when a change has not
    /// been programmed within twice this period.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub sync_period: Duration,
    /// kube-proxy's mode, which only decides whether the --iptables-* or the
    /// --ipvs-* sync periods apply (the datapath is eBPF whatever it says).
    #[arg(long, value_parser = crate::kube_proxy_flags::parse_proxy_mode)]
    pub proxy_mode: Option<String>,
    /// --sync-period, where that is not given and the mode is not ipvs.
    #[arg(long, value_parser = parse_duration)]
    pub iptables_sync_period: Option<Duration>,
    /// --min-sync-period, where that is not given and the mode is not ipvs.
    #[arg(long, value_parser = parse_duration)]
    pub iptables_min_sync_period: Option<Duration>,
    /// --sync-period, where that is not given and the mode is ipvs.
    #[arg(long, value_parser = parse_duration)]
    pub ipvs_sync_period: Option<Duration>,
    /// --min-sync-period, where that is not given and the mode is ipvs.
    #[arg(long, value_parser = parse_duration)]
    pub ipvs_min_sync_period: Option<Duration>,
    /// Idle timeout of an established TCP flow (kube-proxy's flag and
    /// default); 0, kube-proxy's "leave as is", is the kernel's 5 days.
    #[arg(long, default_value = "24h0m0s", value_parser = parse_duration)]
    pub conntrack_tcp_timeout_established: Duration,
    /// Idle timeout of a half-closed TCP flow, a FIN seen one way
    /// (kube-proxy's flag and default, netfilter's `CLOSE_WAIT`); 0 is the
    /// kernel's 60s. A flow closed both ways lives 120s (`TIME_WAIT`), a
    /// reset one 10s (`CLOSE`).
    #[arg(long, default_value = "1h0m0s", value_parser = parse_duration)]
    pub conntrack_tcp_timeout_close_wait: Duration,
    /// Idle timeout of a UDP flow. kube-proxy leaves the kernel's unless
    /// told; here it is 60s then, and 0 is 60s too.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub conntrack_udp_timeout: Duration,
    /// Connections conntrack holds, two map entries each, overriding
    /// kube-proxy's sizing by --conntrack-max-per-core and --conntrack-min.
    /// The map is allocated whole when it is created; a new value on a node
    /// that already has one replaces it at start, its flows carried over.
    /// When it is full, the least recently used flows make room.
    #[arg(
        long,
        value_parser = clap::value_parser!(u32).range(1024..=i64::from(crate::kube_proxy_flags::MAX_CONNECTIONS))
    )]
    pub conntrack_max: Option<u32>,
    /// Connections one client address may hold established in conntrack;
    /// past it, its newer connections stay unassured, where a flood of
    /// them evicts its own flows before anyone's established ones. Default:
    /// half of --conntrack-max. 0: no share.
    #[arg(long)]
    pub conntrack_max_per_source: Option<u32>,
    /// kube-proxy's sizing: this many connections per CPU, at least
    /// --conntrack-min; 0 leaves the size alone (131072 connections).
    #[arg(
        long,
        default_value_t = 32_768,
        value_parser = clap::value_parser!(u32).range(0..=i64::from(i32::MAX))
    )]
    pub conntrack_max_per_core: u32,
    /// kube-proxy's sizing: at least this many connections.
    #[arg(
        long,
        default_value_t = 131_072,
        value_parser = clap::value_parser!(u32).range(0..=i64::from(i32::MAX))
    )]
    pub conntrack_min: u32,
    /// NodePorts are served on the node addresses inside these CIDRs
    /// (kube-proxy's flag), or, with kube-proxy's `primary` alone, on the
    /// node's address of each family (--node-ip, --bind-address); default:
    /// every address of the node.
    #[arg(
        long = "nodeport-addresses",
        id = "nodeport_addresses",
        value_name = "CIDR,...|primary",
        value_delimiter = ',',
        value_parser = NodePortAddress::parse
    )]
    pub nodeport_address_list: Vec<NodePortAddress>,
    /// The CIDRs --nodeport-addresses comes to, settled at start.
    #[arg(skip)]
    pub nodeport_addresses: Vec<Cidr>,
    /// --nodeport-addresses is `primary`: `nodeport_addresses` holds the
    /// node's configured addresses, none when it has none configured.
    #[arg(skip)]
    pub nodeport_primary: bool,
    /// The node's own connections to 127.0.0.0/8 reach NodePorts, where
    /// --nodeport-addresses is unset or includes 127.0.0.1 (kube-proxy's
    /// --iptables-localhost-nodeports). Only the node's sockets, through the
    /// socket hooks: packets from elsewhere to a loopback address are left
    /// alone.
    #[arg(
        long,
        alias = "iptables-localhost-nodeports",
        num_args = 0..=1,
        default_value = "true",
        default_missing_value = "true",
        value_parser = parse_go_bool
    )]
    pub localhost_nodeports: bool,
    /// How XDP runs where it goes (the uplinks, or --xdp-interfaces):
    /// `auto`, native where the driver has it and tc alone on veths and
    /// where it has not; `native`; `generic`, on any driver; or `off`,
    /// leaving north-south traffic to tc ingress.
    #[arg(long, value_enum, default_value = "auto")]
    pub xdp_mode: XdpModeSetting,
    /// XDP on these interfaces (of those tc is attached to) instead of the
    /// uplinks the agent finds: bridges, veths or tunnels carrying pod
    /// traffic get XDP only when named here.
    #[arg(long, value_delimiter = ',', value_parser = crate::datapath::interfaces::parse_name)]
    pub xdp_interfaces: Option<Vec<String>>,
    /// Pod CIDRs of the cluster (kube-proxy's flag), at most one per family,
    /// comma-separated for dual stack (`10.244.0.0/16,fd00:10:244::/56`):
    /// clients inside them are in-cluster, and reach the NodePorts,
    /// LoadBalancer IPs and ExternalIPs of externalTrafficPolicy Local
    /// Services through every endpoint, as kube-proxy's local detector sends
    /// them. Without it every client of those addresses is external.
    #[arg(long, default_value = "", hide_default_value = true)]
    pub cluster_cidr: crate::cluster_cidr::ClusterCidrs,
    /// The service CIDRs ClusterIPs are allocated from (the API server's
    /// flag), at most one per family, comma-separated for dual stack
    /// (`10.96.0.0/12,fd00:10:96::/112`), where the API server serves no
    /// `ServiceCIDR` objects: a packet to an address of one that no Service
    /// holds is dropped, and one to a ClusterIP on a port its Service does
    /// not define is rejected, as kube-proxy's nftables mode does.
    #[arg(long, default_value = "", hide_default_value = true)]
    pub service_cluster_ip_range: crate::cluster_cidr::ClusterCidrs,
    /// kube-proxy's local traffic detection: `ClusterCIDR` (--cluster-cidr),
    /// `NodeCIDR` (the Node's spec.podCIDRs), `BridgeInterface`
    /// (--pod-bridge-interface) or `InterfaceNamePrefix`
    /// (--pod-interface-name-prefix), each carried out by the datapath
    /// (docs/operations.md).
    #[arg(long, default_value = "ClusterCIDR", value_parser = |s: &str| LocalMode::parse(s).map_err(|e| e.to_string()))]
    pub detect_local_mode: LocalMode,
    /// The bridge pods are behind, for --detect-local-mode `BridgeInterface`.
    #[arg(long, value_parser = crate::datapath::interfaces::parse_name)]
    pub pod_bridge_interface: Option<String>,
    /// The prefix of pods' interfaces, for --detect-local-mode
    /// `InterfaceNamePrefix`.
    #[arg(long, value_parser = |s: &str| crate::detect_local::parse_prefix(s).map_err(|e| e.to_string()))]
    pub pod_interface_name_prefix: Option<String>,
    /// The detector the three flags above come to, settled at start.
    #[arg(skip)]
    pub detect_local: DetectLocal,
    /// kube-proxy's --masquerade-all: SNAT every flow to a Service to the
    /// node's address.
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = parse_go_bool)]
    pub masquerade_all: bool,
    /// kube-proxy's --init-only: check the privileges and exit (there is
    /// nothing to prepare ahead).
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = parse_go_bool)]
    pub init_only: bool,
    /// kube-proxy's --write-config-to: refused at start (no configuration
    /// of defaults is written).
    #[arg(long, value_name = "FILE")]
    pub write_config_to: Option<PathBuf>,
    /// The node's address, one per family, comma-separated for dual stack
    /// (`10.0.0.5,fd00::5`): external IPv4 flows to backends on other nodes
    /// are SNATed to the IPv4 one, and the node's IPv6 sockets reach
    /// Services as the IPv6 one. Default, per family: the first global
    /// address of the first interface that has one.
    #[arg(long)]
    pub node_ip: Option<crate::node_ip::NodeIps>,
    /// cgroup v2 directory whose sockets the socket hooks see: the
    /// node's own connections to Services (host-network pods, node agents)
    /// are sent to a backend there. Default: the host's cgroup v2 mount
    /// (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on hybrid hosts).
    #[arg(long)]
    pub cgroup_root: Option<PathBuf>,
    /// Leave kube-proxy's rules (iptables, nftables, IPVS) where they are
    /// once this agent serves, for an operator who removes them by hand
    /// (`kube-proxy --cleanup`). By default the agent removes them itself,
    /// as that command would, and logs what it removed: while they stay,
    /// kube-proxy's filter rules drop replies this datapath translates.
    #[arg(long)]
    pub keep_kube_proxy_rules: bool,
    /// The datapath's log of rare events (rejects sent, drops by source
    /// range or for want of endpoints, full maps, untracked fragments),
    /// with addresses and ports, in this log under the target `datapath`,
    /// rate limited: off, error, warn, info or debug. `ebpf-proxy
    /// datapath-log LEVEL` changes it while the agent runs.
    #[arg(long, value_enum, default_value = "off")]
    pub datapath_log: DatapathLogLevel,
    /// The addresses a Service's externalIPs may be: when set, an
    /// externalIP outside every one of these CIDRs is refused (with a
    /// warning, an Event on the Service and a metric), as the
    /// `DenyServiceExternalIPs` admission plugin or an externalIP webhook
    /// would refuse it. Unset, any externalIP the address policy lets
    /// through is programmed (docs/security.md).
    #[arg(
        long,
        value_name = "CIDR,...",
        value_delimiter = ',',
        value_parser = crate::kube_proxy_flags::parse_cidr
    )]
    pub external_ip_cidrs: Option<Vec<Cidr>>,
    /// The most frontends (ports x addresses, as the agent programs them)
    /// one Service may ask for: one asking for more is refused as a whole,
    /// counted from its spec before anything is made of it
    /// (docs/security.md, "Budgets").
    #[arg(
        long,
        value_name = "N",
        default_value_t = crate::model::DEFAULT_MAX_FRONTENDS_PER_SERVICE,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub max_frontends_per_service: u64,
    /// Service ports whose traffic the datapath counts for the per-Service
    /// metrics (`ebpf_proxy_service_*`): 56 bytes of memory a CPU each,
    /// allocated at start. Ports past it are served, not counted. 0: none.
    #[arg(
        long,
        value_name = "N",
        default_value_t = proxy_common::DEFAULT_SERVICE_COUNTERS,
        value_parser = clap::value_parser!(u32).range(0..=i64::from(proxy_common::MAX_SERVICES))
    )]
    pub service_counters: u32,
    /// How a new flow to a NodePort, ExternalIP or LoadBalancer frontend
    /// picks its backend: `random` (kube-proxy's probabilities) or `maglev`
    /// (consistent hashing: the same backend on every node and after a
    /// restart; docs/maglev.md). A Service's `ebpf-proxy.io/lb-algorithm`
    /// annotation overrides it. ClusterIPs are always random.
    #[arg(long, value_name = "ALGORITHM", default_value = "random", value_parser = parse_lb_algorithm)]
    pub lb_algorithm: crate::maglev::LbAlgorithm,
    /// Slots of each Maglev table: a prime from 251 to 65521, above 100
    /// times a frontend's backends for shares within 1%. Every node must
    /// have the same.
    #[arg(long, value_name = "PRIME", default_value_t = crate::maglev::DEFAULT_TABLE_SIZE, value_parser = parse_maglev_table_size)]
    pub maglev_table_size: u32,
    /// Seed of Maglev's hashes (decimal or 0x-hexadecimal). Every node must
    /// have the same; the default is fixed (0x6d61676c).
    #[arg(long, value_name = "SEED", default_value = "0x6d61676c", value_parser = parse_hash_seed)]
    pub maglev_hash_seed: u32,
    /// How an external flow (NodePort, ExternalIP, LoadBalancer IP) to a
    /// backend on another node goes: `snat` (to the node's address, as
    /// kube-proxy does), `dsr` (direct server return: the backend sees the
    /// client's address and its node answers the client itself) or
    /// `hybrid` (DSR for TCP, SNAT for UDP). Every node must have the same
    /// (docs/architecture.md, "Direct server return").
    #[arg(long, value_name = "MODE", value_enum, default_value_t = crate::planner::node::LbMode::Snat)]
    pub lb_mode: crate::planner::node::LbMode,
    /// Pods' TCP connections to ClusterIPs (without session affinity) are
    /// sent to a backend at `connect()` by the socket hooks, as the node's
    /// own are, rather than translated packet by packet at tc. Off by
    /// default: a sidecar proxy that intercepts a pod's connections by
    /// their ClusterIP would see the backend's address instead
    /// (docs/architecture.md, "Pods' connections at `connect()`").
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true", value_parser = parse_go_bool)]
    pub socket_lb_pods: bool,
    /// How a packet translated at tc reaches a pod of this node: `stack`
    /// (routed and forwarded by the node, through netfilter's `FORWARD` and
    /// `POSTROUTING` and the pod interface's qdisc, as kube-proxy's
    /// translated packets go) or `bpf` (sent from tc straight into the pod's
    /// namespace where its route leads out of a pod's host-side veth:
    /// faster, but past those hooks, so not with a network policy or
    /// bandwidth limit enforced there; docs/architecture.md, "Host
    /// routing").
    #[arg(long, value_name = "MODE", value_enum, default_value_t = crate::planner::node::HostRouting::Stack)]
    pub host_routing: crate::planner::node::HostRouting,
    /// kube-proxy's flags without a meaning here (`IGNORED`): taken with
    /// kube-proxy's value syntax, named in one warning at start.
    #[command(flatten)]
    pub kube_proxy_ignored: IgnoredFlags,
}

fn parse_lb_algorithm(text: &str) -> Result<crate::maglev::LbAlgorithm, String> {
    text.parse()
        .map_err(|e: crate::maglev::MaglevError| e.to_string())
}

fn parse_maglev_table_size(text: &str) -> Result<u32, String> {
    let size: u32 = text
        .parse()
        .map_err(|e| format!("{text:?} is not a table size: {e}"))?;
    crate::maglev::table_size(size).map_err(|e| e.to_string())
}

fn parse_hash_seed(text: &str) -> Result<u32, String> {
    let parsed = match text.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => text.parse(),
    };
    parsed.map_err(|e| format!("{text:?} is not a 32-bit seed: {e}"))
}

impl RunArgs {
    /// How frontends balance: `--lb-algorithm` and the Maglev table.
    pub fn lb_config(&self) -> crate::maglev::LbConfig {
        crate::maglev::LbConfig {
            algorithm: self.lb_algorithm,
            table_size: self.maglev_table_size,
            hash_seed: self.maglev_hash_seed,
        }
    }

    /// What the flags ask of the model: the address policy's allow-list
    /// and budget.
    pub fn model_config(&self) -> crate::model::ModelConfig {
        crate::model::ModelConfig {
            external_ip_cidrs: self.external_ip_cidrs.clone(),
            max_frontends_per_service: self.max_frontends_per_service,
            ..crate::model::ModelConfig::default()
        }
    }

    /// Connections conntrack holds: `--conntrack-max`, else kube-proxy's
    /// sizing, within what the map can be (`settle` refuses a sizing
    /// outside it).
    pub fn conntrack_connections(&self) -> u32 {
        use crate::kube_proxy_flags::{MAX_CONNECTIONS, conntrack_size, cpus};
        self.conntrack_max.unwrap_or_else(|| {
            match conntrack_size(self.conntrack_max_per_core, self.conntrack_min, cpus()) {
                Ok(Some(size)) => size,
                Ok(None) => proxy_common::MAX_CONNTRACK / 2,
                Err(_) => MAX_CONNECTIONS,
            }
        })
    }

    /// `NodeConfig::ct_source_share`: `--conntrack-max-per-source`, by
    /// default half the connections conntrack holds.
    pub fn ct_source_share(&self) -> u32 {
        self.conntrack_max_per_source
            .unwrap_or(self.conntrack_connections() / 2)
    }

    /// Conntrack map entries for [`Self::conntrack_connections`].
    pub fn conntrack_entries(&self) -> u32 {
        self.conntrack_connections() * 2
    }

    /// The conntrack timeouts these flags ask for; a zero is kube-proxy's
    /// "leave as is", the kernel's own default here.
    /// Each is at least `MIN_IDLE_TIMEOUT` (see there).
    pub fn ct_timeouts(&self) -> proxy_common::CtTimeouts {
        let or = |d: Duration, kernel: Duration| {
            if d.is_zero() {
                kernel
            } else {
                d.max(MIN_IDLE_TIMEOUT)
            }
        };
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        proxy_common::CtTimeouts {
            tcp_syn_ns: proxy_common::ct_timeout::TCP_SYN_NS,
            tcp_established_ns: ns(or(
                self.conntrack_tcp_timeout_established,
                KERNEL_TCP_ESTABLISHED,
            )),
            tcp_close_wait_ns: ns(or(
                self.conntrack_tcp_timeout_close_wait,
                KERNEL_TCP_CLOSE_WAIT,
            )),
            tcp_time_wait_ns: proxy_common::ct_timeout::TCP_TIME_WAIT_NS,
            tcp_close_ns: proxy_common::ct_timeout::TCP_CLOSE_NS,
            udp_ns: ns(or(self.conntrack_udp_timeout, UDP_TIMEOUT)),
        }
    }

    /// The timeout flags given below `MIN_IDLE_TIMEOUT`, which
    /// `ct_timeouts` raises to it: (flag, value given).
    pub fn raised_timeouts(&self) -> Vec<(&'static str, Duration)> {
        [
            (
                "--conntrack-tcp-timeout-established",
                self.conntrack_tcp_timeout_established,
            ),
            (
                "--conntrack-tcp-timeout-close-wait",
                self.conntrack_tcp_timeout_close_wait,
            ),
            ("--conntrack-udp-timeout", self.conntrack_udp_timeout),
        ]
        .into_iter()
        .filter(|(_, d)| !d.is_zero() && *d < MIN_IDLE_TIMEOUT)
        .collect()
    }
}

/// The shortest idle timeout a flow is given. The datapath refreshes a
/// flow's entries at most once a second (`ct_timeout::REFRESH_NS`), so an
/// entry may read a second older than its flow's last packet: with a
/// timeout of a second or less, a flow sending all the time expired
/// between two refreshes, and its answers went untranslated. At 3 s, a
/// flow whose packets come less than 2 s apart lives on.
pub const MIN_IDLE_TIMEOUT: Duration = Duration::from_secs(3);

/// `nf_conntrack_tcp_timeout_established`'s default.
const KERNEL_TCP_ESTABLISHED: Duration = Duration::from_hours(120);
/// `nf_conntrack_tcp_timeout_close_wait`'s default.
const KERNEL_TCP_CLOSE_WAIT: Duration = Duration::from_mins(1);
/// The UDP idle timeout when none is given.
const UDP_TIMEOUT: Duration = Duration::from_mins(1);

/// kube-proxy's `--healthz-bind-address`: IP:port, or an IP on port 10256.
pub fn parse_healthz_bind_address(s: &str) -> Result<SocketAddr, String> {
    listen_address(s.trim(), 10256)
        .ok_or_else(|| format!("{s:?} is not an address to listen on (like 0.0.0.0:10256)"))
}

/// "IP:port", "[v6]:port" or a bare IP (on `default_port`).
pub(crate) fn listen_address(text: &str, default_port: u16) -> Option<SocketAddr> {
    text.parse().ok().or_else(|| {
        text.trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, default_port))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::interfaces::parse_name as parse_interface;

    #[test]
    fn manifests_are_optional_and_master_excludes_them() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(["ebpf-proxy", "run"].iter().chain(args)).map(|cli| {
                match cli.command {
                    Command::Run(run) => run,
                    other => panic!("not a run command: {other:?}"),
                }
            })
        };
        let run = parse(&["--master", "http://127.0.0.1:8080"]).expect("API source");
        assert_eq!(run.manifests, None, "no manifests: the API source");
        assert_eq!(run.master.as_deref(), Some("http://127.0.0.1:8080"));
        let run = parse(&["--kubeconfig", "/k/a:/k/b"]).expect("kubeconfig list");
        assert_eq!(run.kubeconfig, Some(PathBuf::from("/k/a:/k/b")));
        let run = parse(&["--manifests", "/m"]).expect("manifest source");
        assert_eq!(run.manifests, Some(PathBuf::from("/m")));
        let err = parse(&["--manifests", "/m", "--master", "http://x"])
            .expect_err("--master with --manifests is a mistake");
        assert!(err.to_string().contains("cannot be used with"), "{err}");
    }

    #[test]
    fn lb_mode_defaults_to_snat_and_takes_dsr_and_hybrid() {
        use crate::planner::node::LbMode;
        let parse = |args: &[&str]| {
            Cli::try_parse_from(["ebpf-proxy", "run"].iter().chain(args)).map(|cli| {
                match cli.command {
                    Command::Run(run) => run.lb_mode,
                    other => panic!("not a run command: {other:?}"),
                }
            })
        };
        assert_eq!(parse(&[]).expect("default"), LbMode::Snat);
        assert_eq!(parse(&["--lb-mode", "dsr"]).expect("dsr"), LbMode::Dsr);
        assert_eq!(
            parse(&["--lb-mode", "hybrid"]).expect("hybrid"),
            LbMode::Hybrid
        );
        let err = parse(&["--lb-mode", "ipip"]).expect_err("an unknown mode");
        assert!(
            err.to_string().contains("snat, dsr, hybrid"),
            "the error names the modes: {err}"
        );
    }

    #[test]
    fn maglev_flags_default_to_random_and_refuse_bad_tables() {
        use crate::maglev::{DEFAULT_HASH_SEED, DEFAULT_TABLE_SIZE, LbAlgorithm, LbConfig};
        let parse = |args: &[&str]| {
            Cli::try_parse_from(["ebpf-proxy", "run"].iter().chain(args)).map(|cli| {
                match cli.command {
                    Command::Run(run) => run.lb_config(),
                    other => panic!("not a run command: {other:?}"),
                }
            })
        };
        assert_eq!(parse(&[]).expect("defaults"), LbConfig::default());
        assert_eq!(
            parse(&[
                "--lb-algorithm",
                "maglev",
                "--maglev-table-size",
                "65521",
                "--maglev-hash-seed",
                "0x10"
            ])
            .expect("maglev"),
            LbConfig {
                algorithm: LbAlgorithm::Maglev,
                table_size: 65_521,
                hash_seed: 16,
            }
        );
        assert_eq!(
            parse(&["--maglev-hash-seed", "42"])
                .expect("decimal seed")
                .hash_seed,
            42
        );
        assert_eq!(LbConfig::default().table_size, DEFAULT_TABLE_SIZE);
        assert_eq!(LbConfig::default().hash_seed, DEFAULT_HASH_SEED);
        for (args, says) in [
            (&["--maglev-table-size", "16384"][..], "not a prime"),
            (
                &["--maglev-table-size", "131071"][..],
                "outside 251..=65521",
            ),
            (&["--maglev-table-size", "lots"][..], "not a table size"),
            (
                &["--lb-algorithm", "round-robin"][..],
                "not a load-balancing algorithm",
            ),
            (
                &["--maglev-hash-seed", "0xfffffffff"][..],
                "not a 32-bit seed",
            ),
        ] {
            let err = parse(args).expect_err("refused");
            assert!(err.to_string().contains(says), "{args:?}: {err}");
        }
    }

    #[test]
    fn conntrack_max_counts_connections_of_two_entries() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(["ebpf-proxy", "run"].iter().chain(args)).map(|cli| {
                match cli.command {
                    Command::Run(run) => run.conntrack_entries(),
                    other => panic!("not a run command: {other:?}"),
                }
            })
        };
        assert_eq!(parse(&[]).expect("default"), proxy_common::MAX_CONNTRACK);
        assert_eq!(
            parse(&["--conntrack-max", "524288"]).expect("a larger table"),
            1 << 20
        );
        let err = parse(&["--conntrack-max", "10"]).expect_err("too small a table");
        assert!(err.to_string().contains("1024"), "{err}");
    }

    /// Values a flag may be given by mistake or malice: every one must be
    /// taken or refused with an error naming the flag, never a panic.
    const HOSTILE: &[&str] = &[
        "",
        " ",
        ",",
        "a,,b",
        "99999999999999999999h",
        "99999999999999999999",
        "18446744073709551616",
        "4294967296",
        "-1",
        "-5s",
        "1e400s",
        "1e400",
        "inf",
        "NaN",
        "0",
        "0x10",
        "1.5.5s",
        ".",
        "5d",
        "584942417356h",
        "9999999999999999999999999999999999999999999999999999999999999999999ms",
        "1/33",
        "10.0.0.0/33",
        "300.1.2.3/8",
        "10.0.0.0/-1",
        "::/129",
        "256.256.256.256",
        "1.2.3.4:99999",
        "[::1]:0",
        "\u{0}",
        "ñ\u{202e}鍵🦀",
        "a\u{0}b",
        "//..//",
        "true",
        "maybe",
        "eth0:1",
        "a-name-longer-than-fifteen",
        // kube-proxy's value syntaxes: Go durations, booleans, integers at
        // int32's edges, keywords, feature gates.
        "1h-1s",
        "2562048h",
        "t",
        "2147483648",
        "-2147483649",
        "-1001",
        "primary",
        "primary,10.0.0.0/8",
        "NodeCIDR",
        "=true",
        "A=,B",
        "FATAL",
    ];

    /// Every flag of every subcommand, found through clap's own definition
    /// (so that a new flag is covered without a change here), with every
    /// hostile value.
    #[test]
    fn no_value_of_any_flag_panics_and_refusals_name_the_flag() {
        use clap::CommandFactory;
        let command = Cli::command();
        let mut tried = 0;
        let mut refused = 0;
        for sub in command.get_subcommands() {
            let subname = sub.get_name();
            for arg in sub.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                if !arg.get_action().takes_values() {
                    continue;
                }
                for value in HOSTILE {
                    let flag = format!("--{long}={value}");
                    let argv = ["ebpf-proxy", subname, &flag];
                    let parsed = std::panic::catch_unwind(|| {
                        let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
                        // What the agent derives from the flags at start.
                        if let Command::Run(mut run) = cli.command {
                            crate::settle::settle(&mut run, &|_| false)
                                .map_err(|e| e.to_string())?;
                            let _ = (run.ct_timeouts(), run.conntrack_entries());
                        }
                        Ok::<(), String>(())
                    })
                    .unwrap_or_else(|_| panic!("`ebpf-proxy {subname} {flag}` panicked"));
                    tried += 1;
                    if let Err(text) = parsed {
                        refused += 1;
                        assert!(
                            text.contains(&format!("--{long}")),
                            "`ebpf-proxy {subname} {flag}` was refused without naming --{long}: {text}"
                        );
                    }
                }
            }
        }
        let flags = tried / HOSTILE.len();
        assert!(
            flags >= 20,
            "only {flags} flags found in the command's definition"
        );
        assert!(refused > 0, "no hostile value was ever refused");
    }

    #[test]
    fn huge_and_malformed_durations_are_errors() {
        for bad in [
            "99999999999999999999h",
            "1e400s",
            "-1s",
            "inf",
            "NaN",
            "1.5.5s",
        ] {
            assert!(
                parse_duration(bad).is_err(),
                "{bad:?} parsed as {:?}",
                parse_duration(bad)
            );
        }
        assert_eq!(
            parse_duration("2562047h"),
            Ok(Duration::from_hours(2_562_047)),
            "the longest whole number of hours Go's durations hold"
        );
        assert!(parse_duration("2562048h").unwrap_err().contains("longest"));
    }

    #[test]
    fn interface_names_are_what_the_kernel_allows() {
        for good in ["eth0", "veth-a.100", "abcdefghijklmno"] {
            assert_eq!(parse_interface(good).as_deref(), Ok(good));
        }
        for bad in ["", ".", "..", "a/b", "eth0:1", "a b", "abcdefghijklmnop"] {
            assert!(parse_interface(bad).is_err(), "{bad:?} was accepted");
        }
    }

    /// `ebpf-proxy run` with `args`, parsed.
    fn run_args(args: &[&str]) -> RunArgs {
        let cli = Cli::try_parse_from(["ebpf-proxy", "run"].iter().chain(args)).expect("parses");
        let Command::Run(run) = cli.command else {
            panic!("not a run command");
        };
        *run
    }

    #[test]
    fn close_wait_is_kube_proxys_and_the_closed_states_netfilters() {
        let timeouts = |args: &[&str]| run_args(args).ct_timeouts();
        let secs = |ns: u64| Duration::from_nanos(ns).as_secs();
        let default = timeouts(&[]);
        assert_eq!(
            (
                secs(default.tcp_close_wait_ns),
                secs(default.tcp_time_wait_ns),
                secs(default.tcp_close_ns)
            ),
            (3600, 120, 10),
            "close-wait kube-proxy's 1h; TIME_WAIT and CLOSE netfilter's"
        );
        assert_eq!(
            secs(timeouts(&["--conntrack-tcp-timeout-close-wait=10s"]).tcp_close_wait_ns),
            10
        );
        assert_eq!(
            secs(timeouts(&["--conntrack-tcp-timeout-close-wait=0s"]).tcp_close_wait_ns),
            60,
            "0: the kernel's 60 s"
        );
    }

    #[test]
    fn idle_timeouts_below_three_seconds_are_raised_to_three() {
        let short = run_args(&[
            "--conntrack-udp-timeout=1s",
            "--conntrack-tcp-timeout-close-wait=500ms",
            "--conntrack-tcp-timeout-established=2s",
        ]);
        let t = short.ct_timeouts();
        assert_eq!(
            (t.udp_ns, t.tcp_close_wait_ns, t.tcp_established_ns),
            (3_000_000_000, 3_000_000_000, 3_000_000_000),
            "1 s, 500 ms and 2 s are each raised to 3 s"
        );
        assert_eq!(
            short.raised_timeouts(),
            [
                (
                    "--conntrack-tcp-timeout-established",
                    Duration::from_secs(2)
                ),
                (
                    "--conntrack-tcp-timeout-close-wait",
                    Duration::from_millis(500)
                ),
                ("--conntrack-udp-timeout", Duration::from_secs(1)),
            ],
            "every flag raised is named with the value given"
        );
        let fine = run_args(&["--conntrack-udp-timeout=3s"]);
        assert_eq!(fine.ct_timeouts().udp_ns, 3_000_000_000, "3 s stays 3 s");
        assert!(
            fine.raised_timeouts().is_empty(),
            "neither 3 s nor the defaults are raised"
        );
    }

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("6h"), Ok(Duration::from_hours(6)));
        assert_eq!(parse_duration("1h0m0s"), Ok(Duration::from_hours(1)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(
            parse_duration("0"),
            Ok(Duration::ZERO),
            "Go's one unitless duration"
        );
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for bad in ["3", "2d", "fast", "-1s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }
}
