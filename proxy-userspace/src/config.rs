//! `--config FILE`: kube-proxy's `KubeProxyConfiguration`
//! (`kubeproxy.config.k8s.io/v1alpha1`), as kubeadm stores it in the
//! `kube-proxy` ConfigMap, so that the same file configures this agent
//! (docs/kube-proxy-semantics.md, "Configuration file").
//!
//! Every field kube-proxy knows is accepted. Those that map onto a flag of
//! `ebpf-proxy run` set it, unless that flag (or the environment variable
//! it reads) was given: flags override the file. Those that mean nothing
//! here (`ipvs.*`, `oomScoreAdj`, ...) are logged once each, when they are
//! set: kubeadm writes every field with its zero value, which asks for
//! kube-proxy's default and so for nothing. A field not known here is
//! logged as an unknown field and skipped, whatever its value, since a newer
//! kubeadm writes fields this release has not seen (kube-proxy itself falls
//! back to lenient decoding for v1alpha1); a value kube-proxy would refuse
//! is an error naming the field.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use clap::ArgMatches;
use serde::{Deserialize, Deserializer};
use serde_yaml::Value;
use tracing::{info, warn};

use crate::{
    cli::RunArgs,
    detect_local::{DetectLocal, LocalMode},
    kube_proxy_flags::NodePortAddress,
    logging::LogFormat,
    model::Cidr,
};

pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

/// kube-proxy's ports when an address comes without one.
const HEALTHZ_PORT: u16 = 10256;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading the configuration file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: {field}: {message}")]
    Field {
        file: String,
        /// Dotted path of the field, as the file spells it (`.` for the
        /// document itself).
        field: String,
        message: String,
    },
}

/// What the file asks of the flags of `ebpf-proxy run`; None: nothing.
#[derive(Debug, Default, PartialEq)]
pub struct Settings {
    pub cluster_cidr: Option<crate::cluster_cidr::ClusterCidrs>,
    pub nodeport_addresses: Option<Vec<NodePortAddress>>,
    pub conntrack_max_per_core: Option<u32>,
    pub conntrack_min: Option<u32>,
    pub conntrack_tcp_timeout_established: Option<Duration>,
    pub conntrack_tcp_timeout_close_wait: Option<Duration>,
    pub conntrack_udp_timeout: Option<Duration>,
    pub node_ip: Option<crate::node_ip::NodeIps>,
    pub healthz_bind_address: Option<SocketAddr>,
    /// `Some(None)`: metrics off.
    pub metrics_bind_address: Option<Option<SocketAddr>>,
    pub kubeconfig: Option<PathBuf>,
    pub node_name: Option<String>,
    pub min_sync_period: Option<Duration>,
    pub sync_period: Option<Duration>,
    pub localhost_nodeports: Option<bool>,
    pub log_format: Option<LogFormat>,
    /// `mode`, for the sync period flags of a mode given on the command line.
    pub proxy_mode: Option<String>,
    pub detect_local_mode: Option<LocalMode>,
    pub pod_bridge_interface: Option<String>,
    pub pod_interface_name_prefix: Option<String>,
    /// The `masqueradeAll` of the mode's block.
    pub masquerade_all: Option<bool>,
}

/// A set field that does not apply to this agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ignored {
    pub field: String,
    pub value: String,
    pub why: &'static str,
}

/// A parsed configuration file.
#[derive(Debug)]
pub struct FileConfig {
    pub file: String,
    pub settings: Settings,
    pub ignored: Vec<Ignored>,
}

/// What merging a file into the flags did, to be logged once logging is up.
#[derive(Debug)]
pub struct Merged {
    pub file: String,
    pub ignored: Vec<Ignored>,
    /// Flags (clap ids) given on the command line or in the environment
    /// that override a value of the file.
    pub overridden: Vec<&'static str>,
}

impl Merged {
    pub fn log(&self) {
        for ignored in &self.ignored {
            warn!(
                file = %self.file,
                field = %ignored.field,
                value = %ignored.value,
                "configuration field not applied: {}",
                ignored.why
            );
        }
        for flag in &self.overridden {
            info!(file = %self.file, flag = %flag.replace('_', "-"), "flag overrides the configuration file");
        }
        info!(file = %self.file, "configuration file read");
    }
}

/// Reads and checks the file at `path`.
pub fn load(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse(&text, &path.display().to_string())
}

/// Reads `--config` when the `run` command has one into `run` and
/// `log_format`, under what the command line and the environment set.
pub fn merge(
    run: &mut RunArgs,
    log_format: &mut LogFormat,
    matches: &ArgMatches,
) -> Result<Option<Merged>, ConfigError> {
    let Some(path) = run.config.clone() else {
        return Ok(None);
    };
    let config = load(&path)?;
    let given = |id: &str| crate::settle::given(matches, id);
    let mut overridden = config.settings.apply(run, &given);
    if let Some(format) = config.settings.log_format {
        if given("log_format") {
            overridden.push("log_format");
        } else {
            *log_format = format;
        }
    }
    Ok(Some(Merged {
        file: config.file,
        ignored: config.ignored,
        overridden,
    }))
}

impl Settings {
    /// Sets the fields of `run` the file has a value for and `given` says
    /// were not given; returns the ids of those that were.
    pub fn apply(&self, run: &mut RunArgs, given: &dyn Fn(&str) -> bool) -> Vec<&'static str> {
        let mut overridden = Vec::new();
        macro_rules! take {
            ($id:ident $(, $wrap:path)?) => {
                if let Some(value) = &self.$id {
                    if given(stringify!($id)) {
                        overridden.push(stringify!($id));
                    } else {
                        run.$id = $($wrap)?(value.clone());
                    }
                }
            };
        }
        take!(cluster_cidr);
        if let Some(entries) = &self.nodeport_addresses {
            if given("nodeport_addresses") {
                overridden.push("nodeport_addresses");
            } else {
                run.nodeport_address_list.clone_from(entries);
            }
        }
        take!(conntrack_max_per_core);
        take!(conntrack_min);
        take!(conntrack_tcp_timeout_established);
        take!(conntrack_tcp_timeout_close_wait);
        take!(conntrack_udp_timeout);
        take!(node_ip, Some);
        take!(healthz_bind_address);
        take!(metrics_bind_address);
        take!(kubeconfig, Some);
        take!(node_name, Some);
        take!(min_sync_period);
        take!(sync_period);
        take!(localhost_nodeports);
        take!(proxy_mode, Some);
        take!(detect_local_mode);
        take!(pod_bridge_interface, Some);
        take!(pod_interface_name_prefix, Some);
        take!(masquerade_all);
        overridden
    }
}

/// Parses a file's text; `file` names it in errors.
pub fn parse(text: &str, file: &str) -> Result<FileConfig, ConfigError> {
    let error = |field: &str, message: String| ConfigError::Field {
        file: file.to_owned(),
        field: if field.is_empty() { "." } else { field }.to_owned(),
        message,
    };
    let document: Value =
        serde_yaml::from_str(text).map_err(|e| error("", format!("not YAML: {e}")))?;
    if !document.is_mapping() {
        return Err(error(
            "",
            format!(
                "a {KIND} is a mapping of fields, not {}",
                kind_of(&document)
            ),
        ));
    }
    let mut document = document;
    let mut ignored = Vec::new();
    // An unknown field is taken out of the document and the rest read again,
    // until what is left is known; its path names the field itself.
    let typed: KubeProxyConfiguration = loop {
        match serde_path_to_error::deserialize(&document) {
            Ok(typed) => break typed,
            Err(e) => {
                let path: Vec<String> = e.path().iter().map(ToString::to_string).collect();
                let unknown = e.inner().to_string().starts_with("unknown field");
                match unknown.then(|| remove(&mut document, &path)).flatten() {
                    Some(value) => ignored.push(Ignored {
                        field: path.join("."),
                        value: one_line(&value),
                        why: UNKNOWN_FIELD,
                    }),
                    None => return Err(error(&e.path().to_string(), e.inner().to_string())),
                }
            }
        }
    };
    match typed.api_version.as_deref() {
        Some(API_VERSION) => {}
        other => {
            return Err(error(
                "apiVersion",
                format!("{other:?}: only {API_VERSION} is read"),
            ));
        }
    }
    if typed.kind.as_deref() != Some(KIND) {
        return Err(error("kind", format!("{:?}: not {KIND}", typed.kind)));
    }
    let (settings, honoured) = typed.settings().map_err(|(f, m)| error(&f, m))?;
    collect_ignored(&document, "", &honoured, &mut ignored);
    Ok(FileConfig {
        file: file.to_owned(),
        settings,
        ignored,
    })
}

/// Why an unknown field is skipped.
pub const UNKNOWN_FIELD: &str =
    "unknown field: not a field of KubeProxyConfiguration as this release knows it; skipped";

/// Takes the field at `path` (map keys) out of `document`.
fn remove(document: &mut Value, path: &[String]) -> Option<Value> {
    let (last, parents) = path.split_last()?;
    let mut map = document.as_mapping_mut()?;
    for key in parents {
        map = map.get_mut(key.as_str())?.as_mapping_mut()?;
    }
    map.remove(last.as_str())
}

fn one_line(value: &Value) -> String {
    let text = serde_yaml::to_string(value).unwrap_or_default();
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

type FieldError = (String, String);

fn invalid(field: &str, message: impl Into<String>) -> FieldError {
    (field.to_owned(), message.into())
}

impl KubeProxyConfiguration {
    /// The flags' values, and the fields that gave them (besides the ones
    /// every configuration has).
    #[expect(
        clippy::too_many_lines,
        reason = "one line per KubeProxyConfiguration field, in the order the file gives them"
    )]
    fn settings(&self) -> Result<(Settings, Vec<String>), FieldError> {
        let mut s = Settings::default();
        fn non_empty(v: Option<&str>) -> Option<&str> {
            v.map(str::trim).filter(|v| !v.is_empty())
        }

        if let Some(cidrs) = non_empty(self.cluster_cidr.as_deref()) {
            s.cluster_cidr = Some(cidrs.parse().map_err(
                |e: crate::cluster_cidr::ClusterCidrError| invalid("clusterCIDR", e.to_string()),
            )?);
        }
        if let Some(entries) = self.node_port_addresses.as_ref().filter(|a| !a.is_empty()) {
            let mut addresses = Vec::new();
            for entry in entries {
                addresses.extend(node_port_address(entry)?);
            }
            crate::kube_proxy_flags::check_nodeport_addresses(&addresses)
                .map_err(|e| invalid("nodePortAddresses", e))?;
            s.nodeport_addresses = Some(addresses);
        }
        if let Some(conntrack) = &self.conntrack {
            (s.conntrack_max_per_core, s.conntrack_min) = conntrack.size()?;
            // A zero is kube-proxy's "leave as is" (RunArgs::ct_timeouts);
            // null, its default, is the flag's.
            let set = |d: &Option<GoDuration>| d.map(|d| d.0);
            s.conntrack_tcp_timeout_established = set(&conntrack.tcp_established_timeout);
            s.conntrack_tcp_timeout_close_wait = set(&conntrack.tcp_close_wait_timeout);
            // kubeadm writes 0s here, and 0 means the flag's default anyway.
            s.conntrack_udp_timeout = set(&conntrack.udp_timeout).filter(|d| !d.is_zero());
        }
        if let Some(text) = non_empty(self.bind_address.as_deref()) {
            let ip: IpAddr = text
                .parse()
                .map_err(|_| invalid("bindAddress", format!("{text:?} is not an IP address")))?;
            // kube-proxy's bindAddress overrides the node IP of its family.
            s.node_ip = if ip.is_unspecified() {
                None
            } else {
                Some(
                    crate::node_ip::NodeIps::default()
                        .with(ip)
                        .map_err(|e| invalid("bindAddress", format!("{text:?}: {e}")))?,
                )
            };
        }
        if let Some(text) = non_empty(self.healthz_bind_address.as_deref()) {
            s.healthz_bind_address = Some(
                crate::cli::listen_address(text, HEALTHZ_PORT).ok_or_else(|| {
                    invalid(
                        "healthzBindAddress",
                        format!("{text:?} is not an address to listen on (like 0.0.0.0:10256)"),
                    )
                })?,
            );
        }
        if let Some(text) = non_empty(self.metrics_bind_address.as_deref()) {
            s.metrics_bind_address = Some(
                crate::metrics::parse_bind_address(text)
                    .map_err(|e| invalid("metricsBindAddress", e))?,
            );
        }
        if let Some(connection) = &self.client_connection {
            s.kubeconfig = non_empty(connection.kubeconfig.as_deref()).map(PathBuf::from);
        }
        // As kube-proxy takes it (its GetHostname).
        s.node_name = non_empty(self.hostname_override.as_deref()).map(str::to_lowercase);
        if let Some(mode) = non_empty(self.detect_local_mode.as_deref()) {
            let mode =
                LocalMode::parse(mode).map_err(|e| invalid("detectLocalMode", e.to_string()))?;
            s.detect_local_mode = Some(mode);
        }
        if let Some(detect) = &self.detect_local {
            s.pod_bridge_interface = non_empty(detect.bridge_interface.as_deref())
                .map(|name| {
                    crate::datapath::interfaces::parse_name(name)
                        .map_err(|e| invalid("detectLocal.bridgeInterface", e))
                })
                .transpose()?;
            s.pod_interface_name_prefix = non_empty(detect.interface_name_prefix.as_deref())
                .map(|prefix| {
                    crate::detect_local::parse_prefix(prefix)
                        .map_err(|e| invalid("detectLocal.interfaceNamePrefix", e.to_string()))
                })
                .transpose()?;
        }
        // kube-proxy's validation of the file: the chosen mode's field is set.
        if let Some(mode) = s.detect_local_mode {
            let field = match mode {
                LocalMode::BridgeInterface => "detectLocal.bridgeInterface",
                _ => "detectLocal.interfaceNamePrefix",
            };
            DetectLocal::new(
                mode,
                s.pod_bridge_interface.as_deref(),
                s.pod_interface_name_prefix.as_deref(),
            )
            .map_err(|e| invalid(field, e.to_string()))?;
        }
        if let Some(logging) = &self.logging {
            s.log_format = match non_empty(logging.format.as_deref()) {
                None => None,
                Some("text") => Some(LogFormat::Text),
                Some("json") => Some(LogFormat::Json),
                Some(other) => {
                    return Err(invalid(
                        "logging.format",
                        format!("{other:?} is not a log format (text or json)"),
                    ));
                }
            };
        }

        // The sync periods of the mode kube-proxy would run in: they mean
        // what --sync-period and --min-sync-period mean here.
        let mode = non_empty(self.mode.as_deref()).unwrap_or("iptables");
        let periods = match mode {
            "iptables" => self
                .iptables
                .as_ref()
                .map(|b| (b.sync_period, b.min_sync_period)),
            "nftables" => self
                .nftables
                .as_ref()
                .map(|b| (b.sync_period, b.min_sync_period)),
            "ipvs" => self
                .ipvs
                .as_ref()
                .map(|b| (b.sync_period, b.min_sync_period)),
            "kernelspace" => None,
            other => {
                return Err(invalid(
                    "mode",
                    format!(
                        "{other:?} is not a proxy mode (iptables, ipvs, nftables, kernelspace)"
                    ),
                ));
            }
        };
        s.proxy_mode = non_empty(self.mode.as_deref())
            .filter(|m| *m != "kernelspace")
            .map(str::to_owned);
        let mut honoured = Vec::new();
        // kube-proxy reads masqueradeAll from nftables in nftables mode and
        // from iptables in every other.
        let masquerade_block = if mode == "nftables" {
            self.nftables.as_ref().and_then(|b| b.masquerade_all)
        } else {
            self.iptables.as_ref().and_then(|b| b.masquerade_all)
        };
        // false is kube-proxy's default, and so asks for nothing.
        s.masquerade_all = masquerade_block.filter(|all| *all);
        let masquerade_block = if mode == "nftables" {
            "nftables"
        } else {
            "iptables"
        };
        honoured.push(format!("{masquerade_block}.masqueradeAll"));
        if let Some((sync, min_sync)) = periods {
            let set = |d: Option<GoDuration>| d.map(|d| d.0).filter(|d| !d.is_zero());
            s.sync_period = set(sync);
            s.min_sync_period = set(min_sync);
            honoured.push(format!("{mode}.syncPeriod"));
            honoured.push(format!("{mode}.minSyncPeriod"));
        }
        if mode == "iptables" {
            s.localhost_nodeports = self.iptables.as_ref().and_then(|b| b.localhost_node_ports);
            honoured.push("iptables.localhostNodePorts".to_owned());
        }
        Ok((s, honoured))
    }
}

impl Conntrack {
    /// `maxPerCore` and `min` as set, checked as kube-proxy's sizing of the
    /// table (`maxPerCore` per CPU, at least `min`, each defaulted as
    /// kube-proxy does; a `maxPerCore` of 0 leaves the size as it is) fits it.
    fn size(&self) -> Result<(Option<u32>, Option<u32>), FieldError> {
        let non_negative = |field: &str, n: Option<i32>| {
            n.map(|n| u32::try_from(n).map_err(|_| invalid(field, format!("{n} is negative"))))
                .transpose()
        };
        let per_core = non_negative("conntrack.maxPerCore", self.max_per_core)?;
        let min = non_negative("conntrack.min", self.min)?;
        crate::kube_proxy_flags::conntrack_size(
            per_core.unwrap_or(32_768),
            min.unwrap_or(131_072),
            crate::kube_proxy_flags::cpus(),
        )
        .map_err(|e| invalid("conntrack.maxPerCore", e))?;
        Ok((per_core, min))
    }
}

fn cidr(field: &str, text: &str) -> Result<Cidr, FieldError> {
    Cidr::parse(text).ok_or_else(|| {
        invalid(
            field,
            format!("{text:?} is not a CIDR (like 10.244.0.0/16)"),
        )
    })
}

/// A `nodePortAddresses` entry: a CIDR, kube-proxy's keyword `primary`, or
/// the keywords `all` and `localhost`.
fn node_port_address(entry: &str) -> Result<Vec<NodePortAddress>, FieldError> {
    let field = "nodePortAddresses";
    let parse = |c: &str| cidr(field, c).map(NodePortAddress::Cidr);
    match entry.trim() {
        "all" => Ok(vec![parse("0.0.0.0/0")?, parse("::/0")?]),
        "localhost" => Ok(vec![parse("127.0.0.0/8")?, parse("::1/128")?]),
        "primary" => Ok(vec![NodePortAddress::Primary]),
        other => Ok(vec![parse(other)?]),
    }
}

/// Why a top-level field (or block) does not apply.
fn why_ignored(field: &str) -> &'static str {
    let top = field.split('.').next().unwrap_or(field);
    match top {
        "mode" => {
            "ebpf-proxy has one datapath (eBPF); the mode only picks its block's sync periods"
        }
        "iptables" | "ipvs" | "nftables" => {
            "a setting of another kube-proxy mode; only the sync periods of the selected mode apply"
        }
        "winkernel" | "windowsRunAsService" => "Windows only",
        "clientConnection" => "the API client's rate limits and content types are its own",
        "featureGates" => "kube-proxy's feature gates do not apply",
        "logging" => "only logging.format applies; the level is set with RUST_LOG",
        "detectLocal" => "read for its detectLocalMode only",
        "conntrack" => match field {
            "conntrack.udpStreamTimeout" => {
                "the datapath has one UDP idle timeout, conntrack.udpTimeout"
            }
            _ => "the datapath's conntrack follows no TCP windows",
        },
        "oomScoreAdj" => "the agent leaves its OOM score to the pod's QoS class",
        "configSyncPeriod" => "the API watches are not resynced periodically",
        "enableProfiling" => "no profiling endpoint is served",
        _ => "not used by ebpf-proxy",
    }
}

/// Fields of every configuration, or read into [`Settings`].
const HONOURED: &[&str] = &[
    "apiVersion",
    "kind",
    "clusterCIDR",
    "nodePortAddresses",
    "conntrack.maxPerCore",
    "conntrack.min",
    "conntrack.tcpEstablishedTimeout",
    "conntrack.tcpCloseWaitTimeout",
    "conntrack.udpTimeout",
    "bindAddress",
    "healthzBindAddress",
    "metricsBindAddress",
    "clientConnection.kubeconfig",
    "hostnameOverride",
    "detectLocalMode",
    "detectLocal.bridgeInterface",
    "detectLocal.interfaceNamePrefix",
    "logging.format",
    // The agent always stops when it cannot listen, which is what true asks.
    "bindAddressHardFail",
];

/// Every set leaf of `value` below `path` that nothing honours.
fn collect_ignored(value: &Value, path: &str, honoured: &[String], out: &mut Vec<Ignored>) {
    if HONOURED.contains(&path) || honoured.iter().any(|h| h == path) {
        return;
    }
    match value {
        Value::Mapping(map) if !map.is_empty() => {
            for (key, child) in map {
                let key = match key {
                    Value::String(s) => s.clone(),
                    other => serde_yaml::to_string(other)
                        .unwrap_or_default()
                        .trim()
                        .to_owned(),
                };
                let child_path = if path.is_empty() {
                    key
                } else {
                    format!("{path}.{key}")
                };
                collect_ignored(child, &child_path, honoured, out);
            }
        }
        _ if is_zero(value) => {}
        _ => out.push(Ignored {
            field: path.to_owned(),
            value: one_line(value),
            why: why_ignored(path),
        }),
    }
}

/// What kubeadm writes for a field left at kube-proxy's default.
fn is_zero(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => matches!(s.as_str(), "" | "0" | "0s"),
        Value::Sequence(s) => s.is_empty(),
        Value::Mapping(m) => m.is_empty(),
        Value::Tagged(t) => is_zero(&t.value),
    }
}

fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "empty",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Sequence(_) => "a list",
        Value::Mapping(_) => "a mapping",
        Value::Tagged(_) => "a tagged value",
    }
}

/// A Go duration (`metav1.Duration`): "1h0m0s", "250ms", "1.5h", "0".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GoDuration(Duration);

impl<'de> Deserialize<'de> for GoDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        crate::kube_proxy_flags::parse_go_duration(&text)
            .map(GoDuration)
            .map_err(serde::de::Error::custom)
    }
}

// The document, field for field as kube-proxy's v1alpha1 types spell it.
// Fields are read only to be checked; what applies is read in `settings`
// and what does not is found in the document's tree by `collect_ignored`.

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct KubeProxyConfiguration {
    api_version: Option<String>,
    kind: Option<String>,
    #[expect(
        dead_code,
        reason = "parsed only to be checked; the setting does not apply here and `collect_ignored` reports it"
    )]
    feature_gates: Option<BTreeMap<String, bool>>,
    client_connection: Option<ClientConnection>,
    logging: Option<Logging>,
    hostname_override: Option<String>,
    bind_address: Option<String>,
    healthz_bind_address: Option<String>,
    metrics_bind_address: Option<String>,
    #[expect(
        dead_code,
        reason = "parsed only to be checked; the setting does not apply here and `collect_ignored` reports it"
    )]
    bind_address_hard_fail: Option<bool>,
    #[expect(
        dead_code,
        reason = "parsed only to be checked; the setting does not apply here and `collect_ignored` reports it"
    )]
    enable_profiling: Option<bool>,
    #[expect(
        dead_code,
        reason = "parsed only to be checked; the setting does not apply here and `collect_ignored` reports it"
    )]
    show_hidden_metrics_for_version: Option<String>,
    mode: Option<String>,
    iptables: Option<IpTables>,
    ipvs: Option<Ipvs>,
    nftables: Option<NfTables>,
    #[expect(
        dead_code,
        reason = "parsed only to be checked; the setting does not apply here and `collect_ignored` reports it"
    )]
    winkernel: Option<Winkernel>,
    detect_local_mode: Option<String>,
    detect_local: Option<DetectLocalFields>,
    #[serde(rename = "clusterCIDR")]
    cluster_cidr: Option<String>,
    node_port_addresses: Option<Vec<String>>,
    #[expect(
        dead_code,
        reason = "parsed only to be checked; the setting does not apply here and `collect_ignored` reports it"
    )]
    oom_score_adj: Option<i32>,
    conntrack: Option<Conntrack>,
    #[expect(
        dead_code,
        reason = "parsed only to be checked; the setting does not apply here and `collect_ignored` reports it"
    )]
    config_sync_period: Option<GoDuration>,
    #[expect(
        dead_code,
        reason = "parsed only to be checked; the setting does not apply here and `collect_ignored` reports it"
    )]
    port_range: Option<String>,
    #[expect(
        dead_code,
        reason = "parsed only to be checked; the setting does not apply here and `collect_ignored` reports it"
    )]
    windows_run_as_service: Option<bool>,
}

#[expect(
    dead_code,
    reason = "its fields are parsed only to be checked; what applies is read in `settings`"
)]
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ClientConnection {
    kubeconfig: Option<String>,
    accept_content_types: Option<String>,
    content_type: Option<String>,
    qps: Option<f32>,
    burst: Option<i32>,
}

#[expect(
    dead_code,
    reason = "its fields are parsed only to be checked; what applies is read in `settings`"
)]
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Logging {
    format: Option<String>,
    /// Nanoseconds or a duration string.
    flush_frequency: Option<Value>,
    verbosity: Option<u32>,
    vmodule: Option<Vec<Value>>,
    options: Option<Value>,
}

#[expect(
    dead_code,
    reason = "its fields are parsed only to be checked; what applies is read in `settings`"
)]
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct IpTables {
    masquerade_bit: Option<i32>,
    masquerade_all: Option<bool>,
    localhost_node_ports: Option<bool>,
    #[serde(rename = "snatNodeInternalIP")]
    snat_node_internal_ip: Option<bool>,
    sync_period: Option<GoDuration>,
    min_sync_period: Option<GoDuration>,
}

#[expect(
    dead_code,
    reason = "its fields are parsed only to be checked; what applies is read in `settings`"
)]
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Ipvs {
    sync_period: Option<GoDuration>,
    min_sync_period: Option<GoDuration>,
    scheduler: Option<String>,
    #[serde(rename = "excludeCIDRs")]
    exclude_cidrs: Option<Vec<String>>,
    #[serde(rename = "strictARP")]
    strict_arp: Option<bool>,
    tcp_timeout: Option<GoDuration>,
    tcp_fin_timeout: Option<GoDuration>,
    udp_timeout: Option<GoDuration>,
}

#[expect(
    dead_code,
    reason = "its fields are parsed only to be checked; what applies is read in `settings`"
)]
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NfTables {
    masquerade_bit: Option<i32>,
    masquerade_all: Option<bool>,
    sync_period: Option<GoDuration>,
    min_sync_period: Option<GoDuration>,
}

#[expect(
    dead_code,
    reason = "its fields are parsed only to be checked; what applies is read in `settings`"
)]
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Winkernel {
    network_name: Option<String>,
    source_vip: Option<String>,
    #[serde(rename = "enableDSR")]
    enable_dsr: Option<bool>,
    root_hns_endpoint_name: Option<String>,
    forward_health_check_vip: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct DetectLocalFields {
    bridge_interface: Option<String>,
    interface_name_prefix: Option<String>,
}

#[expect(
    dead_code,
    reason = "its fields are parsed only to be checked; what applies is read in `settings`"
)]
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Conntrack {
    max_per_core: Option<i32>,
    min: Option<i32>,
    tcp_established_timeout: Option<GoDuration>,
    tcp_close_wait_timeout: Option<GoDuration>,
    tcp_be_liberal: Option<bool>,
    udp_timeout: Option<GoDuration>,
    udp_stream_timeout: Option<GoDuration>,
}

#[cfg(test)]
mod tests;
