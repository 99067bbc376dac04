//! `--config FILE`: kube-proxy's `KubeProxyConfiguration`
//! (`kubeproxy.config.k8s.io/v1alpha1`), as kubeadm stores it in the
//! `kube-proxy` ConfigMap, so that the same file configures this agent
//! (docs/kube-proxy-semantics.md, "Configuration file").
//!
//! Every field kube-proxy knows is accepted. Those that map onto a flag of
//! `ebpf-proxy run` set it, unless that flag (or the environment variable
//! it reads) was given: flags override the file. Those that mean nothing
//! here (`mode`, `iptables.*`, `ipvs.*`, ...) are logged once each, when
//! they are set: kubeadm writes every field with its zero value, which asks
//! for kube-proxy's default and so for nothing. A field kube-proxy does not
//! know, or a value it would refuse, is an error naming the field, as
//! kube-proxy's strict decoding is.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use clap::{ArgMatches, parser::ValueSource};
use serde::{Deserialize, Deserializer};
use serde_yaml::Value;
use tracing::{info, warn};

use crate::{cli::RunArgs, logging::LogFormat, model::Cidr};

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
    pub nodeport_addresses: Option<Vec<Cidr>>,
    pub conntrack_max: Option<u32>,
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
    let run_matches = matches.subcommand_matches("run").unwrap_or(matches);
    let given = |id: &str| {
        [matches, run_matches].iter().any(|m| {
            m.try_get_raw(id).is_ok_and(|raw| raw.is_some())
                && m.value_source(id)
                    .is_some_and(|source| source != ValueSource::DefaultValue)
        })
    };
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
        take!(nodeport_addresses);
        take!(conntrack_max);
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
    // The path names an unknown field itself, not only where it is.
    let typed: KubeProxyConfiguration = serde_path_to_error::deserialize(&document)
        .map_err(|e| error(&e.path().to_string(), e.inner().to_string()))?;
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
    let mut ignored = Vec::new();
    collect_ignored(&document, "", &honoured, &mut ignored);
    Ok(FileConfig {
        file: file.to_owned(),
        settings,
        ignored,
    })
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
            let mut cidrs = Vec::new();
            for entry in entries {
                cidrs.extend(node_port_address(entry)?);
            }
            s.nodeport_addresses = Some(cidrs);
        }
        if let Some(conntrack) = &self.conntrack {
            s.conntrack_max = conntrack.max()?;
            let positive = |d: &Option<GoDuration>| d.map(|d| d.0).filter(|d| !d.is_zero());
            s.conntrack_tcp_timeout_established = positive(&conntrack.tcp_established_timeout);
            s.conntrack_tcp_timeout_close_wait = positive(&conntrack.tcp_close_wait_timeout);
            s.conntrack_udp_timeout = positive(&conntrack.udp_timeout);
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
            s.healthz_bind_address = Some(listen_address(text, HEALTHZ_PORT).ok_or_else(|| {
                invalid(
                    "healthzBindAddress",
                    format!("{text:?} is not an address to listen on (like 0.0.0.0:10256)"),
                )
            })?);
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
        match non_empty(self.detect_local_mode.as_deref()) {
            None | Some("ClusterCIDR") => {}
            Some(other) => {
                return Err(invalid(
                    "detectLocalMode",
                    format!(
                        "{other:?} is not supported: clients are told local by clusterCIDR (ClusterCIDR)"
                    ),
                ));
            }
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
        let mut honoured = Vec::new();
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
    /// kube-proxy's table size: `maxPerCore` per CPU, at least `min`, each
    /// defaulted as kube-proxy does; a `maxPerCore` of 0 leaves the size as
    /// it is.
    fn max(&self) -> Result<Option<u32>, FieldError> {
        if self.max_per_core.is_none() && self.min.is_none() {
            return Ok(None);
        }
        let per_core = self.max_per_core.unwrap_or(32_768);
        let min = self.min.unwrap_or(131_072);
        if per_core < 0 {
            return Err(invalid(
                "conntrack.maxPerCore",
                format!("{per_core} is negative"),
            ));
        }
        if min < 0 {
            return Err(invalid("conntrack.min", format!("{min} is negative")));
        }
        if per_core == 0 {
            return Ok(None);
        }
        let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get) as u64;
        let max = (per_core as u64 * cpus).max(min as u64);
        let range = 1024..=(1u64 << 30);
        if !range.contains(&max) {
            return Err(invalid(
                "conntrack.maxPerCore",
                format!(
                    "{per_core} per CPU x {cpus} CPUs (at least min {min}) is {max} connections; \
                     the table holds {} to {}",
                    range.start(),
                    range.end()
                ),
            ));
        }
        Ok(Some(max as u32))
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

/// A `nodePortAddresses` entry: a CIDR, or kube-proxy's keywords `all` and
/// `localhost`.
fn node_port_address(entry: &str) -> Result<Vec<Cidr>, FieldError> {
    let field = "nodePortAddresses";
    let parse = |c: &str| cidr(field, c);
    match entry.trim() {
        "all" => Ok(vec![parse("0.0.0.0/0")?, parse("::/0")?]),
        "localhost" => Ok(vec![parse("127.0.0.0/8")?, parse("::1/128")?]),
        "primary" => Err(invalid(
            field,
            "the keyword \"primary\" is not supported: list the CIDRs of the addresses instead",
        )),
        other => Ok(vec![parse(other)?]),
    }
}

/// "IP:port", "[v6]:port" or a bare IP (on `default_port`).
fn listen_address(text: &str, default_port: u16) -> Option<SocketAddr> {
    text.parse().ok().or_else(|| {
        text.trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, default_port))
    })
}

/// Why a top-level field (or block) does not apply.
fn why_ignored(field: &str) -> &'static str {
    let top = field.split('.').next().unwrap_or(field);
    match top {
        "mode" => "ebpf-proxy has one datapath (eBPF); there is no mode to choose",
        "iptables" | "ipvs" | "nftables" => {
            "a setting of another kube-proxy mode; only the sync periods of the selected mode apply"
        }
        "winkernel" | "windowsRunAsService" => "Windows only",
        "clientConnection" => "the API client's rate limits and content types are its own",
        "featureGates" => "kube-proxy's feature gates do not apply",
        "logging" => "only logging.format applies; the level is set with RUST_LOG",
        "detectLocal" => "only detectLocalMode ClusterCIDR is supported",
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
            value: serde_yaml::to_string(value)
                .unwrap_or_default()
                .trim()
                .replace('\n', " "),
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
        parse_go_duration(&text)
            .map(GoDuration)
            .map_err(serde::de::Error::custom)
    }
}

/// Go's `time.ParseDuration`, for the durations a configuration may hold
/// (not negative).
pub fn parse_go_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a duration (like 30s, 1m30s, 250ms, 1h0m0s)");
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    if text.starts_with('-') {
        return Err(format!("{text:?} is negative"));
    }
    let mut rest = text.strip_prefix('+').unwrap_or(text);
    if rest.is_empty() {
        return Err(bad());
    }
    let mut nanos: f64 = 0.0;
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .ok_or_else(bad)?;
        let (number, tail) = rest.split_at(number_end);
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return Err(bad());
        }
        let value: f64 = number.parse().map_err(|_| bad())?;
        let unit_end = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_end);
        let scale = match unit {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return Err(bad()),
        };
        nanos += value * scale;
        rest = tail;
    }
    // Go's durations are int64 nanoseconds.
    if nanos > i64::MAX as f64 {
        return Err(format!("{text:?} is longer than Go's longest duration"));
    }
    Ok(Duration::from_nanos(nanos.round() as u64))
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
    #[expect(
        dead_code,
        reason = "parsed only to be checked; the setting does not apply here and `collect_ignored` reports it"
    )]
    detect_local: Option<DetectLocal>,
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

#[expect(
    dead_code,
    reason = "its fields are parsed only to be checked; what applies is read in `settings`"
)]
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct DetectLocal {
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
